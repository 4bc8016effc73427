//! The load check: a bounded load on running servers, every answer counted and compared with a
//! replay of the same arrivals. It holds for the quickstart example and for three replicas
//! sharing one Redis behind a round-robin, and fails for three replicas that each count in
//! their own memory (the bug a shared store exists to fix).

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use http::Uri;
use tollgate::clock::ManualClock;
use tollgate::key::FromHeader;
use tollgate::replay::{LoadCheck, LoadCheckError, Replay};
use tollgate::store::{MemoryStore, RedisStore, Store};
use tollgate::{Quota, RateLimitLayer, RateLimitLayerBuilder, Rule};

/// The rules the replicas enforce: 100 a minute per API key.
fn per_key() -> Rule {
    Rule::new("per-minute", Quota::per_minute(100)).key(FromHeader::new("x-api-key"))
}

/// The prediction: the same rules on a memory store of its own, on a clock the replay moves.
fn expected(rule: Rule) -> Replay<MemoryStore> {
    let clock = ManualClock::default();
    let builder: RateLimitLayerBuilder<MemoryStore> = RateLimitLayer::builder()
        .rule(rule)
        .store(MemoryStore::builder().clock(clock.clone()).build().unwrap());
    Replay::new(builder).clock(clock)
}

/// A replica on a free loopback port: `/hello` behind its own layer on `store`.
async fn replica<S: Store + Clone>(store: S) -> Uri {
    let layer = RateLimitLayer::builder()
        .rule(per_key())
        .store(store)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/hello", get(|| async { "hello" }))
        .layer(layer);
    let addr = serve(app).await;
    format!("http://{addr}/hello").parse().unwrap()
}

/// 400 requests in 2 s, round-robin over the targets, over two keys.
fn load(targets: Vec<Uri>) -> LoadCheck {
    LoadCheck::new(targets)
        .rate(200)
        .duration(Duration::from_secs(2))
        .connections(2)
        .keys(["key-a", "key-b"])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quickstart_admits_what_its_rule_predicts() {
    let example = support::example::Example::start("quickstart", "TOLLGATE_ADDR", &[]);
    let target: Uri = format!("http://{}/hello", example.addr).parse().unwrap();
    // The quickstart's rule: 5 a minute per client IP.
    let outcome = LoadCheck::new([target])
        .rate(100)
        .duration(Duration::from_secs(2))
        .run(expected(Rule::new("per-minute", Quota::per_minute(5))))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    example.stop();
    println!("quickstart: {outcome}");
    assert_eq!(outcome.sent, 200);
    assert_eq!(outcome.predicted.total.admitted, 5, "{outcome}");
    assert_eq!(outcome.admitted, 5, "{outcome}");
    assert_eq!(outcome.denied, 195);
    assert_eq!(outcome.failed, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_sharing_redis_admit_what_the_rules_predict() {
    let server = support::RedisServer::start();
    let prefix = support::unique_prefix("load-check");
    let mut targets = Vec::new();
    for _ in 0..3 {
        let store = RedisStore::builder(server.url())
            .prefix(&prefix)
            .build()
            .unwrap();
        targets.push(replica(store).await);
    }
    let outcome = load(targets)
        .run(expected(per_key()))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    println!("three replicas on Redis: {outcome}");
    // Two keys of 100 a minute, and a unit back every 0.6 s of the 2 s.
    let predicted = outcome.predicted.total.admitted;
    assert!((200..=210).contains(&predicted), "{outcome}");
    assert_eq!((outcome.sent, outcome.failed, outcome.refused), (400, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_each_on_its_own_memory_fail_the_check() {
    let mut targets = Vec::new();
    for _ in 0..3 {
        targets.push(replica(MemoryStore::new()).await);
    }
    let error = load(targets).run(expected(per_key())).await.unwrap_err();
    let LoadCheckError::Mismatch(outcome) = &error else {
        panic!("not a mismatch: {error}");
    };
    // Each replica sees about 67 requests of each key, under its own 100 a minute: the fleet
    // admits all 400, about twice what the rules allow.
    assert!(outcome.admitted >= 390, "{error}");
    assert!(outcome.predicted.total.admitted <= 210, "{error}");
    let message = error.to_string();
    println!("three replicas on memory: {message}");
    assert!(
        message.contains(&format!("admitted {} of 400", outcome.admitted))
            && message.contains(&format!("predict {}", outcome.predicted.total.admitted)),
        "{message}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_login_rule_is_predicted_with_the_answers_the_endpoint_gave() {
    // 20 failed logins a minute per key: the key `wrong` is answered 401 and charged, `right`
    // is answered 200 and given its unit back.
    let failed_logins = || {
        Rule::new("failed-logins", Quota::per_minute(20))
            .key(FromHeader::new("x-api-key"))
            .charge_on_status([401])
    };
    let login = |headers: http::HeaderMap| async move {
        match headers.get("x-api-key").map(|v| v.as_bytes()) {
            Some(b"right") => http::StatusCode::OK,
            _ => http::StatusCode::UNAUTHORIZED,
        }
    };
    let app = Router::new().route("/login", get(login)).layer(
        RateLimitLayer::builder()
            .rule(failed_logins())
            .build()
            .unwrap(),
    );
    let addr = serve(app).await;
    let outcome = LoadCheck::new([format!("http://{addr}/login").parse().unwrap()])
        .rate(200)
        .duration(Duration::from_secs(1))
        .connections(2)
        .keys(["right", "wrong"])
        .run(expected(failed_logins()))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // 100 right (all admitted), 100 wrong: 20 answered 401, 80 refused.
    assert_eq!(outcome.predicted.total.admitted, 120, "{outcome}");
    assert_eq!(
        outcome.predicted.rule("failed-logins").denied,
        80,
        "{outcome}"
    );
    assert_eq!((outcome.admitted, outcome.denied), (120, 80), "{outcome}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_the_server_closes_are_opened_again() {
    // Every answer closes its connection (`Connection: close`), as some proxies do.
    let app = Router::new()
        .route("/hello", get(|| async { "hello" }))
        .layer(axum::middleware::map_response(
            |mut response: axum::response::Response| async move {
                response.headers_mut().insert(
                    http::header::CONNECTION,
                    http::HeaderValue::from_static("close"),
                );
                response
            },
        ))
        .layer(RateLimitLayer::builder().rule(per_key()).build().unwrap());
    let addr = serve(app).await;
    let outcome = load(vec![format!("http://{addr}/hello").parse().unwrap()])
        .duration(Duration::from_millis(500))
        .run(expected(per_key()))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((outcome.sent, outcome.failed), (100, 0), "{outcome}");
    assert_eq!(outcome.admitted, 100, "{outcome}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_answers_fails_the_check_within_its_timeout() {
    // Accepts connections, reads nothing, answers nothing.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    let started = std::time::Instant::now();
    let error = LoadCheck::new([format!("http://{addr}/").parse().unwrap()])
        .rate(20)
        .duration(Duration::from_millis(500))
        .timeout(Duration::from_millis(300))
        .run(expected(per_key()))
        .await
        .unwrap_err();
    silent.abort();
    let LoadCheckError::Mismatch(outcome) = &error else {
        panic!("not a mismatch: {error}");
    };
    assert_eq!((outcome.sent, outcome.failed), (10, 10), "{error}");
    assert!(
        error.to_string().contains("10 requests got no answer"),
        "{error}"
    );
    // Ten requests over 4 connections, each given up after 300 ms (and a connection opened
    // again for the next): bounded, not forever.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_load_of_no_request_or_too_many_is_refused() {
    for (rate, duration) in [
        (100, Duration::ZERO),
        (1, Duration::from_millis(100)),
        (u32::MAX, Duration::from_secs(3600)),
    ] {
        let error = LoadCheck::new(["http://127.0.0.1:1/".parse().unwrap()])
            .rate(rate)
            .duration(duration)
            .run(expected(per_key()))
            .await
            .unwrap_err();
        assert!(matches!(error, LoadCheckError::Config(_)), "{error}");
    }
}

#[tokio::test]
async fn an_address_nobody_listens_on_is_an_error_before_any_load() {
    let port = support::free_ports::<1>()[0];
    let error = LoadCheck::new([format!("http://127.0.0.1:{port}/").parse().unwrap()])
        .run(expected(per_key()))
        .await
        .unwrap_err();
    assert!(matches!(error, LoadCheckError::Connect { .. }), "{error}");
    let error = LoadCheck::new(["https://127.0.0.1:1/".parse().unwrap()])
        .run(expected(per_key()))
        .await
        .unwrap_err();
    assert!(matches!(error, LoadCheckError::Config(_)), "{error}");
}

/// Serves `app` on a free loopback port: its address.
async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
    });
    addr
}
