//! tonic without a server-wide layer, with generated clients and servers (the standard health
//! service): the interceptor limits per peer and, with `GrpcPathLayer`, per method; the layer
//! on one service limits it with the Redis store; and the answers a client of any gRPC
//! implementation reads (`RESOURCE_EXHAUSTED`, a `google.rpc.Status` with a `RetryInfo`,
//! `grpc-retry-pushback-ms`), decoded byte for byte.
#![cfg(feature = "tonic")]

mod support;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tollgate::grpc::GrpcPathLayer;
use tollgate::key::{KeyExtractorExt, PeerIp, Route};
use tollgate::policy::{Policy, Tier};
use tollgate::store::RedisStore;
use tollgate::{Quota, RateLimitLayer, Rule};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use tower::Layer;

fn request() -> HealthCheckRequest {
    HealthCheckRequest {
        service: String::new(),
    }
}

/// A client of `addr` whose connections come from `from`.
async fn client_from(addr: SocketAddr, from: [u8; 4]) -> HealthClient<Channel> {
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .local_address(Some(IpAddr::from(from)))
        .connect()
        .await
        .unwrap();
    HealthClient::new(channel)
}

/// A loopback listener, and its address.
async fn listen() -> (tonic::transport::server::TcpIncoming, SocketAddr) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    (tonic::transport::server::TcpIncoming::from(listener), addr)
}

/// Serves `router` on a loopback port.
async fn serve(router: tonic::transport::server::Router) -> SocketAddr {
    let (incoming, addr) = listen().await;
    tokio::spawn(router.serve_with_incoming(incoming));
    addr
}

/// The fields of a protobuf message: (number, varint or bytes).
fn fields(mut message: &[u8]) -> Vec<(u64, Result<u64, Vec<u8>>)> {
    fn varint(bytes: &mut &[u8]) -> u64 {
        let mut n = 0;
        for shift in (0..64).step_by(7) {
            let (byte, rest) = bytes.split_first().expect("a whole varint");
            *bytes = rest;
            n |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                break;
            }
        }
        n
    }
    let mut out = Vec::new();
    while !message.is_empty() {
        let key = varint(&mut message);
        let value = match key & 7 {
            0 => Ok(varint(&mut message)),
            2 => {
                let len = varint(&mut message) as usize;
                let (bytes, rest) = message.split_at(len);
                message = rest;
                Err(bytes.to_vec())
            }
            other => panic!("wire type {other} in a google.rpc.Status"),
        };
        out.push((key >> 3, value));
    }
    out
}

/// Checks a denial as any gRPC client reads it: `RESOURCE_EXHAUSTED`, a `google.rpc.Status`
/// of the same code whose details hold one `google.rpc.RetryInfo`, and the pushback in
/// milliseconds; returns the RetryInfo's delay.
fn check_denial(status: &tonic::Status) -> Duration {
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    let details = fields(status.details());
    // google.rpc.Status: 1 code, 2 message, 3 details (Any).
    assert_eq!(details[0], (1, Ok(8)));
    assert!(matches!(&details[1], (2, Err(message)) if !message.is_empty()));
    let anys: Vec<&Vec<u8>> = details
        .iter()
        .filter(|(n, _)| *n == 3)
        .map(|(_, v)| v.as_ref().unwrap_err())
        .collect();
    assert_eq!(anys.len(), 1);
    let any = fields(anys[0]);
    assert_eq!(
        any[0],
        (1, Err(b"type.googleapis.com/google.rpc.RetryInfo".to_vec()))
    );
    // RetryInfo: 1 retry_delay (Duration: 1 seconds, 2 nanos).
    let retry_info = fields(any[1].1.as_ref().unwrap_err());
    let duration = fields(retry_info[0].1.as_ref().unwrap_err());
    let mut delay = Duration::ZERO;
    for (n, v) in duration {
        match (n, v) {
            (1, Ok(seconds)) => delay += Duration::from_secs(seconds),
            (2, Ok(nanos)) => delay += Duration::from_nanos(nanos),
            other => panic!("{other:?} in a Duration"),
        }
    }
    let pushback: u64 = status
        .metadata()
        .get("grpc-retry-pushback-ms")
        .expect("a pushback")
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    // The same delay, rounded up to whole milliseconds: never sooner.
    let pushback = Duration::from_millis(pushback);
    assert!(pushback >= delay && pushback - delay < Duration::from_millis(1));
    delay
}

#[tokio::test]
async fn the_interceptor_limits_per_peer() {
    let (_reporter, health) = tonic_health::server::health_reporter();
    let limits = RateLimitLayer::builder()
        .rule(Rule::new("health", Quota::per_hour(2)))
        .build()
        .unwrap();
    let service = InterceptedService::new(health, limits.interceptor().unwrap());
    let addr = serve(tonic::transport::Server::builder().add_service(service)).await;

    let mut first = client_from(addr, [127, 0, 0, 1]).await;
    for _ in 0..2 {
        first.check(request()).await.unwrap();
    }
    let denied = first.check(request()).await.unwrap_err();
    let delay = check_denial(&denied);
    assert!(delay > Duration::from_secs(29 * 60), "{delay:?}");
    let retry_after = denied
        .metadata()
        .get("retry-after")
        .unwrap()
        .to_str()
        .unwrap();
    assert!(["1799", "1800"].contains(&retry_after), "{retry_after}");
    assert!(denied.metadata().get("ratelimit").is_some());
    // Another peer has its own budget.
    let mut second = client_from(addr, [127, 0, 0, 2]).await;
    for _ in 0..2 {
        second.check(request()).await.unwrap();
    }
    check_denial(&second.check(request()).await.unwrap_err());
}

#[tokio::test]
async fn the_interceptor_limits_per_method_with_the_path_layer() {
    let (_reporter, health) = tonic_health::server::health_reporter();
    // 1 call per hour per peer and method.
    let limits = RateLimitLayer::builder()
        .rule(Rule::new("per-method", Quota::per_hour(1)).key(PeerIp::new().and(Route::new())))
        .build()
        .unwrap();
    let service = InterceptedService::new(health, limits.interceptor().unwrap());
    let (incoming, addr) = listen().await;
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(GrpcPathLayer)
            .add_service(service)
            .serve_with_incoming(incoming),
    );
    let mut client = client_from(addr, [127, 0, 0, 3]).await;
    client.check(request()).await.unwrap();
    check_denial(&client.check(request()).await.unwrap_err());
    // Watch is another method: its own budget (the stream opens, then the second is denied).
    let mut stream = client.watch(request()).await.unwrap().into_inner();
    assert!(stream.message().await.unwrap().is_some());
    drop(stream);
    check_denial(&client.watch(request()).await.unwrap_err());
}

#[test]
fn rules_an_interceptor_cannot_keep_are_refused() {
    for rule in [
        Rule::concurrent("slots", 5),
        Rule::new("failures", Quota::per_minute(5)).charge_on_status([500]),
        Rule::new("smooth", Quota::per_minute(5)).delay(Duration::from_secs(1)),
    ] {
        let layer = RateLimitLayer::builder().rule(rule).build().unwrap();
        let error = layer.interceptor().unwrap_err().to_string();
        assert!(error.contains("layer on the service"), "{error}");
    }
}

#[tokio::test]
async fn the_layer_on_one_service_limits_it_with_the_redis_store() {
    let store = RedisStore::builder(support::standalone().url())
        .prefix(support::unique_prefix("grpc-service"))
        .connect()
        .await
        .unwrap();
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("health", Quota::per_hour(2)))
        .store(store)
        .build()
        .unwrap();
    let (_reporter, health) = tonic_health::server::health_reporter();
    let addr = serve(tonic::transport::Server::builder().add_service(layer.layer(health))).await;
    let mut client = client_from(addr, [127, 0, 0, 4]).await;
    let first = client.check(request()).await.unwrap();
    // The layer adds the budget fields to every answer, as metadata.
    assert_eq!(
        first.metadata().get("ratelimit-policy").unwrap(),
        r#""health";q=2;w=3600"#
    );
    client.check(request()).await.unwrap();
    check_denial(&client.check(request()).await.unwrap_err());
}

#[tokio::test]
async fn a_shadow_rule_in_an_interceptor_never_denies_and_the_enforced_rules_still_do() {
    let (_reporter, health) = tonic_health::server::health_reporter();
    let limits = RateLimitLayer::builder()
        .rule(Rule::new("dark", Quota::per_hour(1)).shadow())
        .rule(Rule::new("enforced", Quota::per_hour(3)))
        .build()
        .unwrap();
    let service = InterceptedService::new(health, limits.interceptor().unwrap());
    let addr = serve(tonic::transport::Server::builder().add_service(service)).await;
    let mut client = client_from(addr, [127, 0, 0, 5]).await;
    // The shadow rule would deny from the second call: it is checked again without it.
    for _ in 0..3 {
        client.check(request()).await.unwrap();
    }
    let denied = client.check(request()).await.unwrap_err();
    check_denial(&denied);
    assert!(
        denied
            .metadata()
            .get("ratelimit")
            .unwrap()
            .to_str()
            .unwrap()
            .contains("enforced"),
        "{denied:?}"
    );
}

#[tokio::test]
async fn the_layer_on_one_service_limits_per_method_with_the_path_layer() {
    let (_reporter, health) = tonic_health::server::health_reporter();
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("per-method", Quota::per_hour(1)).key(PeerIp::new().and(Route::new())))
        .build()
        .unwrap();
    let (incoming, addr) = listen().await;
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(GrpcPathLayer)
            .add_service(layer.layer(health))
            .serve_with_incoming(incoming),
    );
    let mut client = client_from(addr, [127, 0, 0, 6]).await;
    client.check(request()).await.unwrap();
    check_denial(&client.check(request()).await.unwrap_err());
    let mut stream = client.watch(request()).await.unwrap().into_inner();
    assert!(stream.message().await.unwrap().is_some());
}

#[tokio::test]
async fn a_forged_grpc_content_type_does_not_make_a_key_per_path_on_an_axum_route() {
    use tower::ServiceExt;
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("per-route", Quota::per_hour(1)).key(Route::new()))
        .build()
        .unwrap();
    let app = axum::Router::new()
        .route("/users/{id}", axum::routing::get(|| async { "user" }))
        .route_layer(layer);
    let forged = |path: &str| {
        http::Request::get(path)
            .header("content-type", "application/grpc")
            .body(axum::body::Body::empty())
            .unwrap()
    };
    let first = app.clone().oneshot(forged("/users/1")).await.unwrap();
    assert!(first.headers().get("grpc-status").is_none(), "admitted");
    // Another path of the same route: the same key (the route pattern), whatever the type
    // says; denied as a gRPC call is (grpc-status 8).
    let second = app.clone().oneshot(forged("/users/2")).await.unwrap();
    assert_eq!(second.headers()["grpc-status"], "8");
}

#[test]
fn a_reload_that_brings_rules_the_interceptor_cannot_keep_is_refused() {
    let policy = |version: &str, rule: Rule| {
        Policy::new(version)
            .tier(Tier::new("all").rule(rule))
            .default_tier("all")
    };
    let layer = RateLimitLayer::builder()
        .policy_source(policy("v1", Rule::new("calls", Quota::per_minute(5))))
        .build()
        .unwrap();
    let handle = layer.policy_handle().unwrap();
    let _interceptor = layer.interceptor().unwrap();
    for (version, rule) in [
        // Would pass every call unlimited: the interceptor cannot wait.
        (
            "v2",
            Rule::new("smooth", Quota::per_minute(5)).delay(Duration::from_secs(1)),
        ),
        ("v3", Rule::concurrent("slots", 5)),
        (
            "v4",
            Rule::new("failures", Quota::per_minute(5)).charge_on_status([500]),
        ),
    ] {
        let error = handle
            .install(policy(version, rule))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("interceptor") && error.contains("layer on the service"),
            "{error}"
        );
        assert_eq!(handle.version(), "v1");
    }
    handle
        .install(policy("v5", Rule::new("calls", Quota::per_minute(9))))
        .unwrap();
    assert_eq!(handle.version(), "v5");
}

#[tokio::test]
async fn the_interceptor_never_polls_a_key_lookup_it_cannot_wait_for() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tollgate::key::{Key, async_fn};

    // A lookup that would be ready at its first poll: the interceptor still does not poll it
    // (a lookup polled only to be dropped would cost the backend for nothing), and the calls
    // go through undecided, as the grpc module says.
    let polled = Arc::new(AtomicUsize::new(0));
    let seen = polled.clone();
    let lookup = async_fn(move |_: &http::request::Parts| {
        let seen = seen.clone();
        async move {
            seen.fetch_add(1, Ordering::Relaxed);
            Some(Key::text("account"))
        }
    });
    let (_reporter, health) = tonic_health::server::health_reporter();
    let limits = RateLimitLayer::builder()
        .rule(Rule::new("by-account", Quota::per_hour(1)).key(lookup))
        .build()
        .unwrap();
    let service = InterceptedService::new(health, limits.interceptor().unwrap());
    let addr = serve(tonic::transport::Server::builder().add_service(service)).await;
    let mut client = client_from(addr, [127, 0, 0, 1]).await;
    for call in 0..3 {
        client
            .check(request())
            .await
            .unwrap_or_else(|status| panic!("call {call}: {status:?}"));
    }
    assert_eq!(polled.load(Ordering::Relaxed), 0, "the lookup was polled");
}
