//! Per-message limits on gRPC streams, with a generated tonic client and server
//! (`tests/generated/notes.proto`): a client stream and a bidirectional stream end with
//! `RESOURCE_EXHAUSTED` and a `RetryInfo` after exactly the allowed messages, every message
//! accepted before that is processed whole, and the budget is shared by a peer's streams, on
//! the memory store and on Redis.
#![cfg(feature = "tonic")]

mod support;

#[allow(missing_docs, clippy::all)]
#[path = "generated/notes.rs"]
mod notes;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures_util::{Stream, StreamExt};
use notes::notes_client::NotesClient;
use notes::notes_server::{Notes, NotesServer};
use notes::{Note, Summary};
use tollgate::grpc::PerMessageLayer;
use tollgate::policy::{Policy, Tier};
use tollgate::store::{RedisStore, Store};
use tollgate::{Quota, RateLimitLayer, Rule};
use tonic::{Request, Response, Status, Streaming};

/// Counts the notes it receives whole; records them, or echoes each.
#[derive(Clone, Default)]
struct Recorder {
    received: Arc<AtomicUsize>,
}

type Echoes = Pin<Box<dyn Stream<Item = Result<Note, Status>> + Send>>;

#[tonic::async_trait]
impl Notes for Recorder {
    async fn record(&self, request: Request<Streaming<Note>>) -> Result<Response<Summary>, Status> {
        let mut notes = request.into_inner();
        let mut count = 0;
        // Ends as if its client were done, whatever error ended the stream: the layer puts its
        // refusal in the trailers instead of this OK. (Chat passes the error on instead.)
        while let Ok(Some(note)) = notes.message().await {
            // Short notes, or long ones padded with 300,000 dots: each whole, in order.
            let text = note.text.trim_end_matches('.');
            assert_eq!(text, format!("note {count}"), "in order");
            assert!(
                note.text.len() == text.len() || note.text.len() == text.len() + 300_000,
                "a message arrived whole"
            );
            self.received.fetch_add(1, Ordering::SeqCst);
            count += 1;
        }
        Ok(Response::new(Summary { count }))
    }

    type ChatStream = Echoes;

    async fn chat(&self, request: Request<Streaming<Note>>) -> Result<Response<Echoes>, Status> {
        let received = self.received.clone();
        // Each note echoed; the stream's error (a refused note) passed on, ending the call.
        let echoes = request.into_inner().map(move |note| {
            if note.is_ok() {
                received.fetch_add(1, Ordering::SeqCst);
            }
            note
        });
        Ok(Response::new(Box::pin(echoes)))
    }
}

/// A server whose calls may send 3 messages an hour per peer, over all their streams (the
/// health service's unary calls too).
async fn server<St: Store>(store: St) -> (SocketAddr, Recorder) {
    let messages: PerMessageLayer<St> = RateLimitLayer::builder()
        .rule(Rule::new("messages", Quota::per_hour(3)))
        .store(store)
        .build()
        .unwrap()
        .per_message()
        .unwrap();
    let recorder = Recorder::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(messages)
            .add_service(NotesServer::new(recorder.clone()))
            .add_service(tonic_health::server::health_reporter().1)
            .serve_with_incoming(incoming),
    );
    (addr, recorder)
}

async fn client(addr: SocketAddr, from: [u8; 4]) -> NotesClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .local_address(Some(std::net::IpAddr::from(from)))
        .connect()
        .await
        .unwrap();
    NotesClient::new(channel)
}

fn notes(n: usize) -> impl Stream<Item = Note> + Send + 'static {
    futures_util::stream::iter((0..n).map(|i| Note {
        text: format!("note {i}"),
    }))
}

/// Notes of 300 KB each: each spans many HTTP/2 frames.
fn long_notes(n: usize) -> impl Stream<Item = Note> + Send + 'static {
    futures_util::stream::iter((0..n).map(|i| Note {
        text: format!("note {i}{}", ".".repeat(300_000)),
    }))
}

/// The delay of the `google.rpc.RetryInfo` in a status's details: a `RetryInfo` is there.
fn has_retry_info(status: &Status) -> bool {
    let url = b"type.googleapis.com/google.rpc.RetryInfo";
    status.details().windows(url.len()).any(|w| w == url)
        && status.metadata().get("grpc-retry-pushback-ms").is_some()
}

async fn a_client_stream_ends_after_exactly_the_allowed_messages<St: Store>(
    store: St,
    from: [u8; 4],
) {
    let (addr, recorder) = server(store).await;
    let mut client = client(addr, from).await;
    let refused = client.record(notes(5)).await.unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(has_retry_info(&refused), "{refused:?}");
    assert_eq!(recorder.received.load(Ordering::SeqCst), 3);
    // The budget is the peer's, over its streams: the next stream's first message is refused.
    let next = client.record(notes(1)).await.unwrap_err();
    assert_eq!(next.code(), tonic::Code::ResourceExhausted);
    assert_eq!(recorder.received.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_client_stream_ends_after_exactly_the_allowed_messages_in_memory() {
    a_client_stream_ends_after_exactly_the_allowed_messages(
        tollgate::store::MemoryStore::new(),
        [127, 0, 0, 1],
    )
    .await;
}

#[tokio::test]
async fn a_client_stream_ends_after_exactly_the_allowed_messages_on_redis() {
    let store = RedisStore::builder(support::standalone().url())
        .prefix(support::unique_prefix("streams"))
        .connect()
        .await
        .unwrap();
    a_client_stream_ends_after_exactly_the_allowed_messages(store, [127, 0, 0, 2]).await;
}

#[tokio::test]
async fn a_bidirectional_stream_echoes_the_allowed_messages_then_ends_exhausted() {
    let (addr, recorder) = server(tollgate::store::MemoryStore::new()).await;
    let mut client = client(addr, [127, 0, 0, 3]).await;
    let mut echoes = client.chat(notes(5)).await.unwrap().into_inner();
    let mut echoed = Vec::new();
    let end = loop {
        match echoes.message().await {
            Ok(Some(note)) => echoed.push(note.text),
            Ok(None) => panic!("the stream ended OK after {echoed:?}"),
            Err(status) => break status,
        }
    };
    assert_eq!(echoed, ["note 0", "note 1", "note 2"]);
    assert_eq!(end.code(), tonic::Code::ResourceExhausted, "{end:?}");
    assert!(has_retry_info(&end), "{end:?}");
    assert_eq!(recorder.received.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_stream_within_its_budget_ends_as_its_service_says() {
    let (addr, recorder) = server(tollgate::store::MemoryStore::new()).await;
    let mut client = client(addr, [127, 0, 0, 4]).await;
    let summary = client.record(notes(2)).await.unwrap().into_inner();
    assert_eq!(summary.count, 2);
    let mut echoes = client.chat(notes(1)).await.unwrap().into_inner();
    assert_eq!(echoes.message().await.unwrap().unwrap().text, "note 0");
    assert!(echoes.message().await.unwrap().is_none(), "ended OK");
    assert_eq!(recorder.received.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn long_messages_over_many_frames_are_checked_whole() {
    let (addr, recorder) = server(tollgate::store::MemoryStore::new()).await;
    let mut client = client(addr, [127, 0, 0, 5]).await;
    let refused = client.record(long_notes(5)).await.unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(has_retry_info(&refused), "{refused:?}");
    assert_eq!(recorder.received.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_unary_call_counts_its_one_message_and_is_refused_as_exhausted() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

    let (addr, _) = server(tollgate::store::MemoryStore::new()).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .local_address(Some(std::net::IpAddr::from([127, 0, 0, 6])))
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let check = || HealthCheckRequest {
        service: String::new(),
    };
    for _ in 0..3 {
        health.check(check()).await.unwrap();
    }
    let refused = health.check(check()).await.unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(has_retry_info(&refused), "{refused:?}");
}

#[test]
fn rules_that_act_after_a_response_are_refused_per_message() {
    let layer = RateLimitLayer::builder()
        .rule(Rule::concurrent("slots", 3))
        .build()
        .unwrap();
    assert!(layer.per_message().is_err());
}

#[test]
fn a_reload_that_brings_rules_a_message_cannot_keep_is_refused() {
    let policy = |version: &str, rule: Rule| {
        Policy::new(version)
            .tier(Tier::new("all").rule(rule))
            .default_tier("all")
    };
    let layer = RateLimitLayer::builder()
        .policy_source(policy("v1", Rule::new("messages", Quota::per_minute(5))))
        .build()
        .unwrap();
    let handle = layer.policy_handle().unwrap();
    let _messages = layer.per_message().unwrap();
    for (version, rule) in [
        // Would give every message its units back: a message has no response.
        (
            "v2",
            Rule::new("failures", Quota::per_minute(5)).charge_on_status([500]),
        ),
        ("v3", Rule::concurrent("slots", 5)),
        ("v4", Rule::new("tokens", Quota::per_minute(500)).settle()),
    ] {
        let error = handle
            .install(policy(version, rule))
            .unwrap_err()
            .to_string();
        assert!(error.contains("per message"), "{error}");
        assert_eq!(handle.version(), "v1");
    }
    handle
        .install(policy("v5", Rule::new("messages", Quota::per_minute(9))))
        .unwrap();
    assert_eq!(handle.version(), "v5");
}
