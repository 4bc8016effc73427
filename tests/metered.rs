//! Budgets that hold during a stream ([`Rule::meter`]): three 4,000-token streams against
//! 10,000 tokens, the third cut at the budget with a final event a client can parse and its
//! producer stopped; another key unaffected; a client that leaves mid-stream charged for what
//! was produced; ten streams at once over three replicas sharing Redis, and over a 3-primary
//! cluster, delivering no more than the budget and settling exactly what they delivered; gRPC
//! and other bodies ended with trailers; a handler that cannot be changed metered by its
//! frames, or settled by its usage trailer; a response read or dropped on a thread without a
//! Tokio runtime charged and settled all the same.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::Response;
use axum::routing::post;
use http::Request;
use http_body_util::BodyExt;
use tokio::sync::mpsc;
use tollgate::clock::ManualClock;
use tollgate::key::FromHeader;
use tollgate::store::{MemoryStore, RedisClusterStore, RedisStore, Store};
use tollgate::{Meter, Quota, RateLimitLayer, Rule, Spend};
use tower::ServiceExt;

const BUDGET: u64 = 10_000;
const CHUNK: u64 = 500;
const TOKENS: u64 = 4_000;

/// Tokens every producer of one app generated.
#[derive(Clone, Default)]
struct Produced(Arc<AtomicU64>);

/// An app streaming `tokens` tokens (the `x-tokens` header) as server-sent events (or as
/// `content_type` says), each spent from the meter before it is generated, through a channel
/// of one event: a producer that a slow or gone client holds back.
fn app<St: Store>(store: St, content_type: &'static str) -> (Router, Produced) {
    let layer = RateLimitLayer::builder()
        .rule(
            Rule::new("tokens", Quota::per_minute(BUDGET))
                .key(FromHeader::new("x-api-key"))
                .meter(CHUNK),
        )
        .store(store)
        .build()
        .unwrap();
    let produced = Produced::default();
    let router = Router::new()
        .route(
            "/v1/completions",
            post(
                move |State(produced): State<Produced>,
                      meter: Option<axum::Extension<Meter>>,
                      headers: http::HeaderMap| async move {
                    let tokens: u64 = headers
                        .get("x-tokens")
                        .and_then(|v| v.to_str().ok()?.parse().ok())
                        .unwrap_or(TOKENS);
                    let meter = meter.map(|axum::Extension(m)| m);
                    let (events, receiver) = mpsc::channel::<Bytes>(1);
                    tokio::spawn(async move {
                        for index in 0..tokens {
                            if let Some(meter) = &meter
                                && meter.spend(1).await == Spend::Exhausted
                            {
                                return;
                            }
                            produced.0.fetch_add(1, Ordering::SeqCst);
                            let event = format!("data: tok{index}\n\n");
                            if events.send(Bytes::from(event)).await.is_err() {
                                return;
                            }
                        }
                        let _ = events
                            .send(Bytes::from_static(b"event: done\ndata: end\n\n"))
                            .await;
                    });
                    let stream =
                        futures_util::stream::unfold(receiver, |mut receiver| async move {
                            let event = receiver.recv().await?;
                            Some((Ok::<_, std::convert::Infallible>(event), receiver))
                        });
                    Response::builder()
                        .header(http::header::CONTENT_TYPE, content_type)
                        .body(Body::from_stream(stream))
                        .unwrap()
                },
            ),
        )
        .with_state(produced.clone())
        .layer(layer);
    (router, produced)
}

fn request(key: &str, tokens: u64) -> Request<Body> {
    Request::post("/v1/completions")
        .header("x-api-key", key)
        .header("x-tokens", tokens.to_string())
        .body(Body::empty())
        .unwrap()
}

/// What a client read of one stream.
#[derive(Debug, Default)]
struct Read {
    status: u16,
    tokens: u64,
    done: bool,
    /// The data of a final `error` event.
    error: Option<serde_json::Value>,
    /// The `retry` field of a final `error` event (milliseconds).
    retry: Option<u64>,
    trailers: Option<http::HeaderMap>,
    /// `r` of the `RateLimit` field at admission.
    remaining: Option<u64>,
}

/// Sends one request and reads its stream to its end, or `max_tokens` tokens then leaves.
async fn read(app: &Router, key: &str, tokens: u64, max_tokens: Option<u64>) -> Read {
    let response = app.clone().oneshot(request(key, tokens)).await.unwrap();
    let mut read = Read {
        status: response.status().as_u16(),
        remaining: response
            .headers()
            .get("ratelimit")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(";r=").nth(1)?.split(';').next()?.parse().ok()),
        ..Read::default()
    };
    let mut body = response.into_body();
    let mut text = String::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.unwrap();
        if let Some(trailers) = frame.trailers_ref() {
            read.trailers = Some(trailers.clone());
            continue;
        }
        let Ok(data) = frame.into_data() else {
            continue;
        };
        text.push_str(std::str::from_utf8(&data).unwrap());
        while let Some(end) = text.find("\n\n") {
            let event: String = text.drain(..end + 2).collect();
            if event.starts_with("data: tok") {
                read.tokens += 1;
            } else if event.starts_with("event: done") {
                read.done = true;
            } else if event.starts_with("event: error\n") {
                for line in event.lines() {
                    if let Some(data) = line.strip_prefix("data: ") {
                        read.error = Some(serde_json::from_str(data).expect("a JSON problem"));
                    } else if let Some(retry) = line.strip_prefix("retry: ") {
                        read.retry = Some(retry.parse().expect("a number of milliseconds"));
                    }
                }
            }
        }
        if max_tokens.is_some_and(|max| read.tokens >= max) {
            // The client leaves.
            return read;
        }
    }
    read
}

/// Three 4,000-token streams in a row on one key against 10,000 tokens: the first two
/// complete, the third is cut at the budget with a final event a client can parse, and its
/// producer stops there; another key streams in full; the next request is refused.
#[tokio::test]
async fn the_third_stream_is_cut_at_the_budget_and_its_producer_stops() {
    // A clock that stands still: no token comes back during the test.
    let clock = ManualClock::new(1_700_000_000_000_000);
    let store = MemoryStore::builder().clock(clock).build().unwrap();
    let (app, produced) = app(store, "text/event-stream");
    for stream in 0..2 {
        let read = read(&app, "demo", TOKENS, None).await;
        assert_eq!(read.status, 200);
        assert_eq!(read.tokens, TOKENS, "stream {stream}");
        assert!(
            read.done && read.error.is_none(),
            "stream {stream}: {read:?}"
        );
    }
    let before = produced.0.load(Ordering::SeqCst);
    let third = read(&app, "demo", TOKENS, None).await;
    assert_eq!(third.status, 200);
    assert!(!third.done);
    // Cut at the budget: 2,000 left, within one chunk.
    assert!(
        third.tokens.abs_diff(BUDGET - 2 * TOKENS) <= CHUNK,
        "{} tokens",
        third.tokens
    );
    let problem = third.error.expect("a final error event");
    assert_eq!(
        problem["type"],
        "https://iana.org/assignments/http-problem-types#quota-exceeded"
    );
    assert_eq!(problem["status"], 429);
    assert_eq!(problem["violated-policies"][0], "tokens");
    // The producer stopped within one chunk of the cut (here, at it: it asks first).
    let generated = produced.0.load(Ordering::SeqCst) - before;
    assert!(generated >= third.tokens && generated - third.tokens <= CHUNK);
    // Another key has its own budget.
    let other = read(&app, "other", TOKENS, None).await;
    assert_eq!((other.tokens, other.done), (TOKENS, true));
    // The key's budget is spent: the next request is refused at once.
    let next = read(&app, "demo", 10, None).await;
    assert_eq!(next.status, 429);
    assert_eq!(
        next.remaining,
        Some(BUDGET - 2 * TOKENS - third.tokens),
        "settled at what was delivered"
    );
}

/// A client that leaves mid-stream is charged for the tokens produced for it, not for the
/// admission's chunk nor for the stream it asked for.
#[tokio::test]
async fn a_client_that_leaves_is_charged_for_what_was_produced() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let store = MemoryStore::builder().clock(clock).build().unwrap();
    let (app, produced) = app(store, "text/event-stream");
    let gone = read(&app, "leaver", TOKENS, Some(700)).await;
    assert_eq!(gone.tokens, 700);
    // The producer notices the client is gone at its next send, and the meter settles.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let generated = produced.0.load(Ordering::SeqCst);
    // At most the channel's event and the one being sent beyond what was read.
    assert!((700..=702).contains(&generated), "{generated} produced");
    // A probe: admitted with a chunk of its own, the budget less what was produced before it.
    let probe = read(&app, "leaver", 1, None).await;
    assert_eq!(probe.remaining, Some(BUDGET - generated - CHUNK));
}

/// Ten streams at once on one key, over three replicas sharing Redis and over a 3-primary
/// cluster: the fleet delivers at most the budget (chunks are taken before their tokens), and
/// what the store holds after is exactly what was delivered.
#[tokio::test]
async fn ten_streams_at_once_over_replicas_deliver_the_budget_and_settle_it() {
    for cluster in [false, true] {
        let clock = ManualClock::new(1_700_000_000_000_000);
        let prefix = support::unique_prefix(if cluster { "meter-cluster" } else { "meter" });
        let mut apps = Vec::new();
        for _ in 0..3 {
            let app = if cluster {
                let store = RedisClusterStore::builder(support::cluster().urls())
                    .prefix(prefix.clone())
                    .clock(clock.clone())
                    .response_timeout(Duration::from_secs(5))
                    .connect()
                    .await
                    .unwrap();
                app(store, "text/event-stream").0
            } else {
                let store = RedisStore::builder(support::standalone().url())
                    .prefix(prefix.clone())
                    .clock(clock.clone())
                    .response_timeout(Duration::from_secs(5))
                    .connect()
                    .await
                    .unwrap();
                app(store, "text/event-stream").0
            };
            apps.push(app);
        }
        let mut streams = tokio::task::JoinSet::new();
        for i in 0..10 {
            let app = apps[i % 3].clone();
            streams.spawn(async move { read(&app, "shared", TOKENS, None).await });
        }
        let mut delivered = 0;
        let mut cut = 0;
        while let Some(read) = streams.join_next().await {
            let read = read.unwrap();
            delivered += read.tokens;
            cut += usize::from(read.status == 429 || read.error.is_some());
        }
        assert!(
            delivered <= BUDGET,
            "cluster {cluster}: {delivered} delivered"
        );
        assert!(
            delivered >= BUDGET - 10 * CHUNK,
            "cluster {cluster}: only {delivered} delivered"
        );
        assert!(cut >= 7, "cluster {cluster}: {cut} streams cut or refused");
        // What the store holds now: a probe of one token sees exactly the budget less what
        // was delivered (its own chunk taken, when it fits).
        tokio::time::sleep(Duration::from_millis(200)).await;
        let probe = read(&apps[0], "shared", 1, None).await;
        let left = BUDGET - delivered;
        let expected = if left >= CHUNK { left - CHUNK } else { left };
        assert_eq!(
            probe.remaining,
            Some(expected),
            "cluster {cluster}: {delivered} delivered"
        );
    }
}

/// A gRPC response is ended with the refused call's trailers, another body with trailers
/// holding `Retry-After` and the budget fields.
#[tokio::test]
async fn grpc_and_other_bodies_end_with_trailers() {
    for (content_type, status) in [
        ("application/grpc", "grpc-status"),
        ("application/x-ndjson", "retry-after"),
    ] {
        let clock = ManualClock::new(1_700_000_000_000_000);
        let store = MemoryStore::builder().clock(clock).build().unwrap();
        let (app, _) = app(store, content_type);
        let read = read(&app, "k", BUDGET + 1_000, None).await;
        assert_eq!(read.tokens, BUDGET, "{content_type}");
        let trailers = read.trailers.expect("trailers");
        assert!(
            trailers.contains_key(status),
            "{content_type}: {trailers:?}"
        );
        if content_type == "application/grpc" {
            assert_eq!(trailers["grpc-status"], "8");
            assert!(trailers.contains_key("grpc-retry-pushback-ms"));
        } else {
            assert!(trailers.contains_key("ratelimit"));
        }
    }
}

/// Rules a meter cannot keep are refused when the layer is built, saying why.
#[test]
fn rules_that_cannot_be_metered_are_refused_at_build_time() {
    let refused = |rule: Rule| {
        RateLimitLayer::builder()
            .rule(rule)
            .build()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let quota = Quota::per_minute(BUDGET);
    for (rule, says) in [
        (Rule::new("t", quota).meter(0), "chunk"),
        (Rule::new("t", quota).meter(BUDGET + 1), "chunk"),
        (Rule::new("t", quota).meter(10).lease(10), "leased"),
        (
            Rule::new("t", quota)
                .algorithm(tollgate::Algorithm::SlidingWindowLog)
                .meter(10),
            "sliding window log",
        ),
        (Rule::concurrent("t", 5).meter(1), "concurrency"),
        (
            Rule::new("t", quota).meter(10).settle(),
            "charges by the response",
        ),
    ] {
        let message = refused(rule);
        assert!(message.contains(says), "{message:?} should say {says:?}");
    }
}

#[allow(missing_docs, clippy::all)]
#[path = "generated/notes.rs"]
mod notes;

/// A gRPC server that streams `n` notes for the first note it receives, each spent from the
/// meter before it is made (tonic hands the request's extensions to the handler).
#[derive(Clone, Default)]
struct Streamer {
    produced: Arc<AtomicU64>,
}

type Notes =
    std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<notes::Note, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl notes::notes_server::Notes for Streamer {
    async fn record(
        &self,
        _: tonic::Request<tonic::Streaming<notes::Note>>,
    ) -> Result<tonic::Response<notes::Summary>, tonic::Status> {
        Err(tonic::Status::unimplemented("streams only"))
    }

    type ChatStream = Notes;

    async fn chat(
        &self,
        request: tonic::Request<tonic::Streaming<notes::Note>>,
    ) -> Result<tonic::Response<Notes>, tonic::Status> {
        let meter = request.extensions().get::<Meter>().cloned();
        let produced = self.produced.clone();
        let notes = futures_util::stream::unfold(0u64, move |index| {
            let (meter, produced) = (meter.clone(), produced.clone());
            async move {
                if index == TOKENS {
                    return None;
                }
                if let Some(meter) = &meter
                    && meter.spend(1).await == Spend::Exhausted
                {
                    return None;
                }
                produced.fetch_add(1, Ordering::SeqCst);
                let note = notes::Note {
                    text: format!("tok{index}"),
                };
                Some((Ok(note), index + 1))
            }
        });
        Ok(tonic::Response::new(Box::pin(notes)))
    }
}

/// The gRPC form: a server stream of 4,000 notes on one peer against 10,000: two complete,
/// the third ends with `RESOURCE_EXHAUSTED` and a `RetryInfo` at the budget, its producer
/// stopped there, and the peer's budget is what was delivered.
#[tokio::test]
async fn a_grpc_server_stream_ends_with_resource_exhausted_at_the_budget() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let store = MemoryStore::builder().clock(clock).build().unwrap();
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("tokens", Quota::per_minute(BUDGET)).meter(CHUNK))
        .store(store)
        .build()
        .unwrap();
    let streamer = Streamer::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(layer)
            .add_service(notes::notes_server::NotesServer::new(streamer.clone()))
            .serve_with_incoming(incoming),
    );
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = notes::notes_client::NotesClient::new(channel);
    let mut delivered = Vec::new();
    for _ in 0..3 {
        let hello = futures_util::stream::iter([notes::Note {
            text: "hello".into(),
        }]);
        let mut stream = client.chat(hello).await.unwrap().into_inner();
        let mut count = 0u64;
        let end = loop {
            match stream.message().await {
                Ok(Some(_)) => count += 1,
                Ok(None) => break None,
                Err(status) => break Some(status),
            }
        };
        delivered.push((count, end));
    }
    assert_eq!(delivered[0].0, TOKENS);
    assert!(delivered[0].1.is_none() && delivered[1].1.is_none());
    assert_eq!(delivered[1].0, TOKENS);
    let (third, end) = &delivered[2];
    assert_eq!(*third, BUDGET - 2 * TOKENS, "cut at the budget");
    let status = end.as_ref().expect("a status");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    let url = b"type.googleapis.com/google.rpc.RetryInfo";
    assert!(status.details().windows(url.len()).any(|w| w == url));
    assert_eq!(
        streamer.produced.load(Ordering::SeqCst),
        BUDGET,
        "the producer stopped at the budget"
    );
}

/// An app whose handler knows nothing of the meter: it streams `x-tokens` events (each a
/// frame), then trailers saying what it used (`x-usage-tokens`, when `x-usage` is set); the
/// rule counts its frames, or reads its trailer.
fn unchanged_app(rule: Rule) -> (Router, Produced) {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let store = MemoryStore::builder().clock(clock).build().unwrap();
    let layer = RateLimitLayer::builder()
        .rule(rule.key(FromHeader::new("x-api-key")))
        .store(store)
        .build()
        .unwrap();
    let produced = Produced::default();
    let router = Router::new()
        .route(
            "/v1/completions",
            post(
                move |State(produced): State<Produced>, headers: http::HeaderMap| async move {
                    let number = |name: &str| {
                        headers
                            .get(name)
                            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                    };
                    let tokens = number("x-tokens").unwrap_or(TOKENS);
                    let usage = number("x-usage");
                    let (frames, receiver) = mpsc::channel::<http_body::Frame<Bytes>>(1);
                    tokio::spawn(async move {
                        for index in 0..tokens {
                            produced.0.fetch_add(1, Ordering::SeqCst);
                            let event = Bytes::from(format!("data: tok{index}\n\n"));
                            if frames.send(http_body::Frame::data(event)).await.is_err() {
                                return;
                            }
                        }
                        if let Some(usage) = usage {
                            let mut trailers = http::HeaderMap::new();
                            trailers.insert("x-usage-tokens", usage.into());
                            let _ = frames.send(http_body::Frame::trailers(trailers)).await;
                        }
                    });
                    let stream =
                        futures_util::stream::unfold(receiver, |mut receiver| async move {
                            let frame = receiver.recv().await?;
                            Some((Ok::<_, std::convert::Infallible>(frame), receiver))
                        });
                    Response::builder()
                        .header(http::header::CONTENT_TYPE, "text/event-stream")
                        .body(Body::new(http_body_util::StreamBody::new(stream)))
                        .unwrap()
                },
            ),
        )
        .with_state(produced.clone())
        .layer(layer);
    (router, produced)
}

/// A handler that cannot be changed, metered by its frames: two streams complete, the third
/// ends with the final event one frame past the budget (that frame is a debt), its producer
/// held back there, and the charge is what was delivered.
#[tokio::test]
async fn a_handler_that_cannot_be_changed_is_metered_by_its_frames() {
    let rule = Rule::new("tokens", Quota::per_minute(BUDGET))
        .meter(CHUNK)
        .meter_frames(|frame: &[u8]| frame.windows(6).filter(|w| w == b"data: ").count() as u64);
    let (app, produced) = unchanged_app(rule);
    for stream in 0..2 {
        let read = read(&app, "demo", TOKENS, None).await;
        assert_eq!(read.tokens, TOKENS, "stream {stream}");
        assert!(read.error.is_none(), "stream {stream}");
    }
    let before = produced.0.load(Ordering::SeqCst);
    let third = read(&app, "demo", TOKENS, None).await;
    assert_eq!(
        third.tokens,
        BUDGET - 2 * TOKENS + 1,
        "one frame past the budget"
    );
    assert_eq!(third.error.expect("a final event")["status"], 429);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let generated = produced.0.load(Ordering::SeqCst) - before;
    assert!(
        generated <= third.tokens + 2,
        "the producer is held back: {generated} made for {} delivered",
        third.tokens
    );
    // In debt by the one frame: refused, nothing left.
    let next = read(&app, "demo", 1, None).await;
    assert_eq!((next.status, next.remaining), (429, Some(0)));
}

/// A service that reports its usage in the trailers is settled to that number (the trailer
/// removed), whatever it streamed.
#[tokio::test]
async fn a_usage_trailer_settles_the_charge() {
    let rule = Rule::new("tokens", Quota::per_minute(BUDGET))
        .meter(CHUNK)
        .meter_usage_trailer(http::HeaderName::from_static("x-usage-tokens"));
    let (app, _) = unchanged_app(rule);
    let mut request = request("k", 20);
    request
        .headers_mut()
        .insert("x-usage", http::HeaderValue::from_static("1234"));
    let response = app.clone().oneshot(request).await.unwrap();
    let collected = response.into_body().collect().await.unwrap();
    let trailers = collected.trailers().cloned().unwrap_or_default();
    assert!(!trailers.contains_key("x-usage-tokens"), "{trailers:?}");
    // Settled to 1,234: a probe takes its chunk from the rest.
    let probe = read(&app, "k", 1, None).await;
    assert_eq!(probe.remaining, Some(BUDGET - 1234 - CHUNK));
}

/// Two metered layers, a tenant's budget around a route's: the handler's meter spends from
/// both, the outer budget cuts the stream, and each layer settles what was delivered.
#[tokio::test]
async fn a_stream_behind_two_metered_layers_spends_from_both() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let tenant_store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let route_store = MemoryStore::builder().clock(clock).build().unwrap();
    let (inner, _) = app(route_store.clone(), "text/event-stream");
    // The same route budget, without the tenant's layer: to look at what it was charged.
    let (route_alone, _) = app(route_store, "text/event-stream");
    let tenant = RateLimitLayer::builder()
        .rule(
            Rule::new("tenant", Quota::per_minute(3_000))
                .key(FromHeader::new("x-api-key"))
                .meter(CHUNK),
        )
        .store(tenant_store)
        .build()
        .unwrap();
    let app = inner.layer(tenant);
    let first = read(&app, "k", TOKENS, None).await;
    assert_eq!(first.tokens, 3_000, "cut by the outer budget");
    assert_eq!(
        first.error.expect("a final event")["violated-policies"][0],
        "tenant"
    );
    let probe = read(&app, "k", 1, None).await;
    assert_eq!(probe.status, 429, "the tenant's budget is spent");
    assert_eq!(probe.remaining, Some(0));
    // The route's budget was charged what was delivered: a probe takes its chunk of the rest.
    let route = read(&route_alone, "k", 1, None).await;
    assert_eq!(route.remaining, Some(BUDGET - 3_000 - CHUNK));
}

/// A chunk taken ahead of need in the next window, then the stream ends: each chunk's unspent
/// units go back to the window they were charged in. (Given all to the newest window, they
/// would free units there that other requests of that window had spent.)
#[tokio::test]
async fn unspent_units_go_back_to_the_windows_they_were_charged_in() {
    let clock = ManualClock::new(1_800_000_000_000_000);
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let layer = RateLimitLayer::builder()
        .rule(
            Rule::new("tokens", Quota::per_minute(1_000))
                .algorithm(tollgate::Algorithm::FixedWindow)
                .key(FromHeader::new("x-api-key"))
                .meter(100),
        )
        .store(store)
        .build()
        .unwrap();
    // Each stream spends what its test sends it, and ends when its sender is dropped.
    type Orders = Arc<std::sync::Mutex<Vec<mpsc::UnboundedReceiver<u64>>>>;
    let orders: Orders = Arc::default();
    let app = Router::new()
        .route(
            "/v1/completions",
            post(
                |State(orders): State<Orders>, meter: Option<axum::Extension<Meter>>| async move {
                    let mut spends = orders.lock().unwrap().remove(0);
                    let meter = meter.map(|axum::Extension(m)| m);
                    let (done, receiver) = mpsc::channel::<Bytes>(1);
                    tokio::spawn(async move {
                        while let Some(units) = spends.recv().await {
                            if let Some(meter) = &meter {
                                let _ = meter.spend(units).await;
                            }
                            let _ = done.send(Bytes::from_static(b"data: spent\n\n")).await;
                        }
                    });
                    let stream =
                        futures_util::stream::unfold(receiver, |mut receiver| async move {
                            let event = receiver.recv().await?;
                            Some((Ok::<_, std::convert::Infallible>(event), receiver))
                        });
                    Response::builder()
                        .header(http::header::CONTENT_TYPE, "text/event-stream")
                        .body(Body::from_stream(stream))
                        .unwrap()
                },
            ),
        )
        .with_state(orders.clone())
        .layer(layer);
    let open = |orders: &Orders| {
        let (sender, receiver) = mpsc::unbounded_channel();
        orders.lock().unwrap().push(receiver);
        sender
    };
    // The first stream, admitted in window 1 (100 taken), spends 40 there.
    let first = open(&orders);
    let response = app.clone().oneshot(request("k", 0)).await.unwrap();
    let mut first_body = response.into_body();
    first.send(40).unwrap();
    first_body.frame().await.unwrap().unwrap();
    // Window 2: a second stream is admitted (100 taken there) and stays open; the first spends
    // 20 more, which takes its next chunk ahead of need, in window 2.
    clock.advance(Duration::from_secs(60));
    let second = open(&orders);
    let response = app.clone().oneshot(request("k", 0)).await.unwrap();
    let _second_body = response.into_body();
    first.send(20).unwrap();
    first_body.frame().await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    // The first stream ends: 60 spent, all in window 1's chunk; window 2's chunk goes back whole.
    drop(first);
    while first_body.frame().await.is_some() {}
    drop(first_body);
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Window 2 holds the second stream's 100: a probe takes its own chunk of the 900 left.
    let third = open(&orders);
    let probe = app.clone().oneshot(request("k", 0)).await.unwrap();
    let remaining = probe
        .headers()
        .get("ratelimit")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.split(";r=")
                .nth(1)?
                .split(';')
                .next()?
                .parse::<u64>()
                .ok()
        });
    assert_eq!(
        remaining,
        Some(800),
        "window 2: the second stream's 100 and the probe's"
    );
    drop((second, third));
}

/// A metered response dropped on a thread with no Tokio runtime (a body handed to another
/// executor) settles all the same: its unspent chunk goes back, at once on the memory store,
/// where it is dropped (this runtime of one thread runs nothing else meanwhile), and on the
/// runtime the request was served on for Redis and a cluster.
#[tokio::test]
async fn a_metered_response_dropped_outside_a_runtime_settles() {
    let (redis, cluster) = redis_stores("metered-elsewhere").await;
    dropped_elsewhere_settles(MemoryStore::new(), "memory").await;
    dropped_elsewhere_settles(redis, "redis").await;
    dropped_elsewhere_settles(cluster, "cluster").await;
}

/// A Redis store and a cluster store, each with a prefix of its own.
async fn redis_stores(name: &str) -> (RedisStore, RedisClusterStore) {
    let redis = RedisStore::builder(support::standalone().url())
        .prefix(support::unique_prefix(name))
        .connect()
        .await
        .unwrap();
    let cluster = RedisClusterStore::builder(support::cluster().urls())
        .prefix(support::unique_prefix(name))
        .connect()
        .await
        .unwrap();
    (redis, cluster)
}

/// Admits one metered request of [`frames_app`] on `store` (a chunk taken), drops its response
/// unread on a thread of its own, and waits for the chunk to be back.
async fn dropped_elsewhere_settles<St: Store>(store: St, name: &str) {
    let (app, limiter) = frames_app(store);
    let response = app.oneshot(request("elsewhere", 1)).await.unwrap();
    assert_eq!(response.status(), 200, "{name}");
    let key = tollgate::key::Key::text("elsewhere");
    let remaining = || async { limiter.peek("tokens", &key).await.unwrap().remaining };
    assert_eq!(remaining().await, BUDGET - CHUNK, "{name}: a chunk taken");
    std::thread::spawn(move || drop(response)).join().unwrap();
    if name == "memory" {
        // The memory store's peek answers without a turn of the runtime.
        assert_eq!(remaining().await, BUDGET, "{name}: settled at once");
        return;
    }
    let start = std::time::Instant::now();
    while remaining().await != BUDGET {
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{name}: the chunk of a response dropped outside a runtime is still charged"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A metered response whose body is read on a thread with no Tokio runtime (handed to another
/// executor) takes its next chunks all the same, on the runtime the request was served on: the
/// store is charged exactly what was delivered, on Redis and a cluster as on the memory store.
#[tokio::test]
async fn a_metered_body_read_outside_a_runtime_takes_its_next_chunks() {
    let (redis, cluster) = redis_stores("metered-read-elsewhere").await;
    read_elsewhere_charges_what_was_delivered(MemoryStore::new(), "memory").await;
    read_elsewhere_charges_what_was_delivered(redis, "redis").await;
    read_elsewhere_charges_what_was_delivered(cluster, "cluster").await;
}

/// The frames of the stream of [`frames_app`].
const FRAMES: u64 = 1_200;

/// An app streaming `FRAMES` frames of one token each through a rule metered by its frames in
/// chunks of `CHUNK` on `store` (a fixed window of a day: nothing comes back by itself), and
/// its limiter.
fn frames_app<St: Store>(store: St) -> (Router, tollgate::Limiter<St>) {
    let layer = RateLimitLayer::builder()
        .rule(
            Rule::new("tokens", Quota::per_day(BUDGET))
                .algorithm(tollgate::Algorithm::FixedWindow)
                .key(FromHeader::new("x-api-key"))
                .meter(CHUNK)
                .meter_frames(|frame: &[u8]| frame.len() as u64),
        )
        .store(store)
        .build()
        .unwrap();
    let limiter = layer.limiter();
    let app = Router::new()
        .route(
            "/v1/completions",
            post(|| async {
                let frames =
                    (0..FRAMES).map(|_| Ok::<_, std::convert::Infallible>(Bytes::from("x")));
                Body::from_stream(futures_util::stream::iter(frames))
            }),
        )
        .layer(layer);
    (app, limiter)
}

/// Reads the stream of [`frames_app`] on a thread of its own, and waits for the store to hold
/// what was read.
async fn read_elsewhere_charges_what_was_delivered<St: Store>(store: St, name: &str) {
    let (app, limiter) = frames_app(store);
    let response = app.oneshot(request("read-elsewhere", 1)).await.unwrap();
    assert_eq!(response.status(), 200, "{name}");
    // Waited for without blocking this runtime, which the reading thread's chunks are taken on.
    let (sender, read) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let _ = sender.send(block_on(response.into_body().collect()));
    });
    let read = tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .expect("the reading thread is stuck")
        .unwrap()
        .unwrap()
        .to_bytes()
        .len() as u64;
    assert_eq!(read, FRAMES, "{name}: the whole stream read");
    let key = tollgate::key::Key::text("read-elsewhere");
    let remaining = || async { limiter.peek("tokens", &key).await.unwrap().remaining };
    let start = std::time::Instant::now();
    loop {
        let left = remaining().await;
        if left == BUDGET - FRAMES {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{name}: {} charged for {FRAMES} delivered",
            BUDGET - left
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// On the memory store, a metered body read where no runtime runs, after the runtime its
/// request was served on is gone, takes its chunks where it is read, and settles there.
#[test]
fn a_metered_body_read_after_its_runtime_is_gone_is_charged_on_the_memory_store() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (limiter, response) = runtime.block_on(async {
        let (app, limiter) = frames_app(MemoryStore::new());
        let response = app.oneshot(request("runtime-gone", 1)).await.unwrap();
        (limiter, response)
    });
    drop(runtime);
    let read = block_on(response.into_body().collect())
        .unwrap()
        .to_bytes()
        .len() as u64;
    assert_eq!(read, FRAMES);
    let key = tollgate::key::Key::text("runtime-gone");
    let left = block_on(limiter.peek("tokens", &key)).unwrap().remaining;
    assert_eq!(
        left,
        BUDGET - FRAMES,
        "charged and settled where it was read"
    );
}

/// Runs `future` to its end on this thread, with no Tokio runtime (as another executor would).
fn block_on<F: std::future::Future>(future: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut context = std::task::Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        if let std::task::Poll::Ready(output) = future.as_mut().poll(&mut context) {
            return output;
        }
        std::thread::park_timeout(Duration::from_secs(1));
    }
}

/// A rule settled by its usage trailer, on a stream that ends without the trailer or is dropped
/// before it: the chunks it took stay charged (a stream cannot make its charge 0 by never
/// reporting). 50 streams of 999 events on one key of 10,000 a minute: the first leaves after
/// 10 events, and 20 streams in all are admitted (a chunk each), the rest refused.
#[tokio::test]
async fn a_stream_without_its_usage_trailer_keeps_the_chunks_it_took() {
    let rule = Rule::new("tokens", Quota::per_minute(BUDGET))
        .meter(CHUNK)
        .meter_usage_trailer(http::HeaderName::from_static("x-usage-tokens"));
    let (app, _) = unchanged_app(rule);
    let left = read(&app, "k", 999, Some(10)).await;
    assert_eq!((left.status, left.tokens), (200, 10));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut admitted = 1;
    let mut last = None;
    for _ in 1..50 {
        let stream = read(&app, "k", 999, None).await;
        if stream.status == 200 {
            assert_eq!(stream.tokens, 999);
            admitted += 1;
        }
        last = Some(stream);
    }
    assert_eq!(admitted, BUDGET / CHUNK, "a chunk charged for each stream");
    let last = last.unwrap();
    assert_eq!((last.status, last.remaining), (429, Some(0)));
}

/// A memory store whose checks answer only while its gate is open (a slow store's chunk).
#[derive(Clone)]
struct Gated {
    store: MemoryStore,
    open: Arc<tokio::sync::watch::Sender<bool>>,
}

impl Store for Gated {
    type Future = std::pin::Pin<
        Box<
            dyn std::future::Future<
                    Output = Result<tollgate::Decision, tollgate::store::StoreError>,
                > + Send,
        >,
    >;

    fn check(&self, charges: &[tollgate::store::Charge<'_>]) -> Self::Future {
        let answer = self.store.check(charges);
        let mut open = self.open.subscribe();
        Box::pin(async move {
            let _ = open.wait_for(|open| *open).await;
            answer.await
        })
    }

    fn adjust(
        &self,
        adjustments: &[tollgate::store::Adjustment<'_>],
    ) -> tollgate::store::StoreFuture<()> {
        self.store.adjust(adjustments)
    }

    fn try_adjust_now(
        &self,
        adjustments: &[tollgate::store::Adjustment<'_>],
    ) -> Option<Result<(), tollgate::store::StoreError>> {
        self.store.try_adjust_now(adjustments)
    }

    fn peek(
        &self,
        charges: &[tollgate::store::Charge<'_>],
    ) -> tollgate::store::StoreFuture<tollgate::Decision> {
        self.store.peek(charges)
    }
}

/// Behind two metered layers, a spend dropped while the inner layer waits for its next chunk
/// did not happen: the outer layer does not charge its units either.
#[tokio::test]
async fn a_spend_dropped_while_the_inner_layer_fetches_gives_the_outer_units_back() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let tenant_store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let gate = Arc::new(tokio::sync::watch::channel(true).0);
    let route_store = Gated {
        store: MemoryStore::builder().clock(clock).build().unwrap(),
        open: gate.clone(),
    };
    let metered = |name: &str| {
        Rule::new(name, Quota::per_minute(BUDGET))
            .key(FromHeader::new("x-api-key"))
            .meter(CHUNK)
    };
    let route = RateLimitLayer::builder()
        .rule(metered("route"))
        .store(route_store)
        .build()
        .unwrap();
    let tenant = RateLimitLayer::builder()
        .rule(metered("tenant"))
        .store(tenant_store)
        .build()
        .unwrap();
    let tenant_limiter = tenant.limiter();
    // The handler hands its meter to the test and streams nothing until it is dropped.
    let meters: Arc<std::sync::Mutex<Option<Meter>>> = Arc::default();
    let slot = meters.clone();
    let app = Router::new()
        .route(
            "/v1/completions",
            post(move |axum::Extension(meter): axum::Extension<Meter>| {
                let slot = slot.clone();
                async move {
                    *slot.lock().unwrap() = Some(meter);
                    Body::from_stream(futures_util::stream::pending::<
                        Result<Bytes, std::convert::Infallible>,
                    >())
                }
            }),
        )
        .layer(route)
        .layer(tenant);
    let response = app.oneshot(request("k", 0)).await.unwrap();
    assert_eq!(response.status(), 200);
    let meter = meters.lock().unwrap().take().expect("the handler's meter");
    gate.send_replace(false);
    // The admission's chunks spent: each layer asks for its next chunk ahead of need, the
    // route's waiting at the gate.
    assert_eq!(meter.spend(CHUNK).await, Spend::Holds);
    // One unit past them: the route's layer waits for its chunk, and the spend is dropped.
    let waited = tokio::time::timeout(Duration::from_millis(100), meter.spend(1)).await;
    assert!(waited.is_err(), "the route's chunk is held at the gate");
    drop(meter);
    drop(response);
    gate.send_replace(true);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let key = tollgate::key::Key::text("k");
    let left = tenant_limiter.peek("tenant", &key).await.unwrap().remaining;
    assert_eq!(left, BUDGET - CHUNK, "the tenant is charged what was spent");
}

/// A metered request starts with what is left of the budget when that is less than a chunk:
/// 348 tokens left of 10,000, a request for 10 streams them (and the one after it its 338),
/// though the chunk is 500; a stream is cut at the budget, not a chunk before it.
#[tokio::test]
async fn a_metered_request_starts_with_what_is_left_of_the_budget() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let store = MemoryStore::builder().clock(clock).build().unwrap();
    let (app, _) = app(store, "text/event-stream");
    let first = read(&app, "k", BUDGET - 348, None).await;
    assert!(first.done, "{first:?}");
    let small = read(&app, "k", 10, None).await;
    assert_eq!(small.status, 200, "348 left: a request for 10 starts");
    assert_eq!((small.tokens, small.done), (10, true));
    let rest = read(&app, "k", 400, None).await;
    assert_eq!(rest.status, 200);
    assert_eq!(rest.tokens, 338, "cut at the budget");
    assert_eq!(rest.error.expect("a final event")["status"], 429);
    let next = read(&app, "k", 1, None).await;
    assert_eq!((next.status, next.remaining), (429, Some(0)));
    // A stream admitted with a whole chunk takes the part of one left when it needs it: 600
    // left, a stream of 1,000 delivers 600.
    let other = read(&app, "other", BUDGET - 600, None).await;
    assert!(other.done);
    let cut = read(&app, "other", 1_000, None).await;
    assert_eq!(cut.tokens, 600, "cut at the budget, not a chunk before it");
}

/// The final event of a stream cut at its budget says when to come back, as `Retry-After`
/// says it to a refused request: `retry-after` (seconds) in its data, and the event stream's
/// `retry` field (milliseconds).
#[tokio::test]
async fn the_final_event_says_when_to_retry() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let store = MemoryStore::builder().clock(clock).build().unwrap();
    let (app, _) = app(store, "text/event-stream");
    let cut = read(&app, "k", BUDGET + 100, None).await;
    let problem = cut.error.expect("a final event");
    let seconds = problem["retry-after"]
        .as_u64()
        .expect("a retry-after member");
    assert!(seconds >= 1, "{problem}");
    assert_eq!(cut.retry, Some(seconds * 1_000), "the retry field");
    let refused = app.clone().oneshot(request("k", 1)).await.unwrap();
    assert_eq!(refused.status(), 429);
    let header: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(seconds, header, "the refused request's Retry-After");
}

/// A metered request on Redis starts with what is left after a chunk was denied: 300 left of a
/// key, a stream takes them (its first check, for a whole chunk, denied with `r=300`), a few
/// units refill, and the next request for 3 streams them.
#[tokio::test]
async fn a_metered_request_on_redis_starts_with_what_is_left_after_a_chunk_was_denied() {
    let server = support::RedisServer::start();
    let store = RedisStore::builder(server.url())
        .prefix(support::unique_prefix("cut-again"))
        .connect()
        .await
        .unwrap();
    // 10 a second, chunks of 500.
    let layer = RateLimitLayer::builder()
        .rule(
            Rule::new("tokens", Quota::per_hour(36_000))
                .key(FromHeader::new("x-api-key"))
                .meter(CHUNK),
        )
        .store(store)
        .build()
        .unwrap();
    let limiter = layer.limiter();
    let app = Router::new()
        .route(
            "/v1/completions",
            post(
                |meter: Option<axum::Extension<Meter>>, headers: http::HeaderMap| async move {
                    let tokens: u64 = headers["x-tokens"].to_str().unwrap().parse().unwrap();
                    let meter = meter.map(|axum::Extension(m)| m).expect("a meter");
                    let mut text = String::new();
                    for index in 0..tokens {
                        if meter.spend(1).await == Spend::Exhausted {
                            break;
                        }
                        text.push_str(&format!("data: tok{index}\n\n"));
                    }
                    text
                },
            ),
        )
        .layer(layer);
    let key = tollgate::key::Key::text("k");
    limiter.charge("tokens", &key, 36_000 - 300).await.unwrap();
    let first = read(&app, "k", 300, None).await;
    assert_eq!((first.status, first.tokens), (200, 300), "{first:?}");
    // A few units refill; the replica still holds the denial of a whole chunk, with r=300.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let next = read(&app, "k", 3, None).await;
    assert_eq!(
        (next.status, next.tokens),
        (200, 3),
        "a few units left: a request for 3 starts with them: {next:?}"
    );
}
