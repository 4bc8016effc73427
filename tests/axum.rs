//! The layer on real axum routers: per-key limits, per-route limits, stacked rules, headers that
//! agree with the decision, Retry-After, and a handler that never runs for a denied request.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tollgate::clock::ManualClock;
use tollgate::key::{Extracted, Global, Key, KeyExtractor};
use tollgate::store::MemoryStore;
use tollgate::{Algorithm, Cost, FailureMode, Quota, RateLimitLayer, Rule};
use tollgate::{Headers, ResetFormat};
use tower::{Service, ServiceBuilder, ServiceExt};

fn manual_store() -> (ManualClock, MemoryStore) {
    let clock = ManualClock::default();
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    (clock, store)
}

fn request(path: &str, ip: [u8; 4]) -> Request<Body> {
    let mut req = Request::get(path).body(Body::empty()).unwrap();
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::from((ip, 50_000))));
    req
}

async fn send(app: &mut Router, req: Request<Body>) -> Response<Body> {
    app.as_service()
        .ready()
        .await
        .unwrap()
        .call(req)
        .await
        .unwrap()
}

/// `GET /` answering "ok", behind `layer`.
fn hello<St: tollgate::store::Store>(layer: RateLimitLayer<St>) -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
}

/// The status of a GET of `path` from `ip`.
async fn status(app: &mut Router, path: &str, ip: [u8; 4]) -> StatusCode {
    send(app, request(path, ip)).await.status()
}

fn header<'a>(res: &'a Response<Body>, name: &str) -> Option<&'a str> {
    res.headers().get(name).map(|v| v.to_str().unwrap())
}

/// Parses `"name";r=1;t=2, "other";r=3;t=4` into (name, [(param, value)]).
fn parse_items(value: &str) -> Vec<(String, Vec<(String, u64)>)> {
    value
        .split(',')
        .map(|item| {
            let mut parts = item.trim().split(';');
            let name = parts.next().unwrap();
            assert!(
                name.starts_with('"') && name.ends_with('"'),
                "policy names are quoted strings: {name}"
            );
            let params = parts
                .map(|p| {
                    let (k, v) = p.split_once('=').unwrap();
                    (k.to_owned(), v.parse::<u64>().expect("integer parameters"))
                })
                .collect();
            (name.trim_matches('"').to_owned(), params)
        })
        .collect()
}

fn param(item: &(String, Vec<(String, u64)>), name: &str) -> u64 {
    item.1
        .iter()
        .find(|(k, _)| k == name)
        .unwrap_or_else(|| panic!("no {name} in {item:?}"))
        .1
}

fn counting_handler() -> (Arc<AtomicUsize>, Router) {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let router = Router::new().route(
        "/",
        get(move || {
            c.fetch_add(1, Ordering::SeqCst);
            async { "ok" }
        }),
    );
    (calls, router)
}

#[tokio::test]
async fn limits_hold_per_client_ip_and_the_handler_never_runs_when_denied() {
    let (_clock, store) = manual_store();
    let (calls, router) = counting_handler();
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("per-ip", Quota::per_minute(3)))
        .store(store)
        .build()
        .unwrap();
    let mut app = router.layer(layer);

    for _ in 0..3 {
        assert_eq!(status(&mut app, "/", [10, 0, 0, 1]).await, StatusCode::OK);
    }
    for _ in 0..5 {
        assert_eq!(
            status(&mut app, "/", [10, 0, 0, 1]).await,
            StatusCode::TOO_MANY_REQUESTS
        );
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        3,
        "denied requests never reach the handler"
    );
    // Another client has its own budget.
    assert_eq!(status(&mut app, "/", [10, 0, 0, 2]).await, StatusCode::OK);
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn routes_have_separate_limits_with_route_layer() {
    let (_clock, store) = manual_store();
    let strict = RateLimitLayer::builder()
        .rule(Rule::new("login", Quota::per_minute(1)))
        .store(store.clone())
        .build()
        .unwrap();
    let relaxed = RateLimitLayer::builder()
        .rule(Rule::new("search", Quota::per_minute(5)))
        .store(store)
        .build()
        .unwrap();
    let mut app = Router::new()
        .route("/login", get(|| async { "login" }).route_layer(strict))
        .route("/search", get(|| async { "search" }).route_layer(relaxed));

    assert_eq!(
        status(&mut app, "/login", [1, 1, 1, 1]).await,
        StatusCode::OK
    );
    assert_eq!(
        status(&mut app, "/login", [1, 1, 1, 1]).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    for _ in 0..5 {
        assert_eq!(
            status(&mut app, "/search", [1, 1, 1, 1]).await,
            StatusCode::OK
        );
    }
    assert_eq!(
        status(&mut app, "/search", [1, 1, 1, 1]).await,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn stacked_rules_are_all_or_nothing() {
    let (clock, store) = manual_store();
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("burst", Quota::per_second(2)))
        .rule(Rule::new("daily", Quota::per_day(5)).algorithm(Algorithm::FixedWindow))
        .store(store)
        .build()
        .unwrap();
    let mut app = hello(layer);

    // 2 admitted, then 50 denied by "burst": the denials must not charge "daily".
    for _ in 0..2 {
        assert_eq!(status(&mut app, "/", [7, 7, 7, 7]).await, StatusCode::OK);
    }
    for _ in 0..50 {
        let res = send(&mut app, request("/", [7, 7, 7, 7])).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        let body: serde_json::Value =
            serde_json::from_slice(&res.into_body().collect().await.unwrap().to_bytes()).unwrap();
        let violated: Vec<&str> = body["violated-policies"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap())
            .collect();
        assert_eq!(violated, ["burst"]);
    }
    clock.advance(Duration::from_secs(1));
    let res = send(&mut app, request("/", [7, 7, 7, 7])).await;
    assert_eq!(res.status(), StatusCode::OK);
    let items = parse_items(header(&res, "ratelimit").unwrap());
    let daily = items.iter().find(|i| i.0 == "daily").unwrap();
    assert_eq!(
        param(daily, "r"),
        2,
        "5 per day, 3 admitted so far: the 50 denials charged nothing"
    );
}

#[tokio::test]
async fn headers_agree_with_the_decision_and_retry_after_is_honest() {
    let (clock, store) = manual_store();
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("burst", Quota::per_minute(10)))
        .store(store)
        .headers(Headers::ietf().with_legacy(ResetFormat::DeltaSeconds))
        .build()
        .unwrap();
    let mut app = hello(layer);

    for expected_remaining in (0..10).rev() {
        let res = send(&mut app, request("/", [9, 9, 9, 9])).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(
            header(&res, "ratelimit-policy"),
            Some("\"burst\";q=10;w=60")
        );
        let items = parse_items(header(&res, "ratelimit").unwrap());
        assert_eq!(items.len(), 1);
        assert_eq!(items[0].0, "burst");
        assert_eq!(param(&items[0], "r"), expected_remaining);
        // 10 per minute: one token every 6 s; t is the effective window, the time until the
        // next token (the clock does not move here).
        assert_eq!(param(&items[0], "t"), 6);
        assert_eq!(header(&res, "x-ratelimit-limit"), Some("10"));
        assert_eq!(
            header(&res, "x-ratelimit-remaining").unwrap(),
            expected_remaining.to_string()
        );
        assert!(header(&res, "retry-after").is_none());
    }

    let res = send(&mut app, request("/", [9, 9, 9, 9])).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = header(&res, "retry-after").unwrap().parse().unwrap();
    assert_eq!(retry, 6);
    assert_eq!(
        header(&res, "content-type"),
        Some("application/problem+json")
    );
    assert_eq!(
        param(&parse_items(header(&res, "ratelimit").unwrap())[0], "r"),
        0
    );
    let body: serde_json::Value =
        serde_json::from_slice(&res.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(body["status"], 429);
    assert_eq!(body["title"], "Quota Exceeded");
    assert_eq!(
        body["type"],
        "https://iana.org/assignments/http-problem-types#quota-exceeded"
    );
    assert!(body["detail"].as_str().unwrap().contains("Retry-After"));
    assert_eq!(body["violated-policies"], serde_json::json!(["burst"]));

    // Just before Retry-After: still denied. At Retry-After: admitted.
    clock.advance(Duration::from_secs(retry) - Duration::from_micros(1));
    assert_eq!(
        status(&mut app, "/", [9, 9, 9, 9]).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    clock.advance(Duration::from_micros(1));
    assert_eq!(status(&mut app, "/", [9, 9, 9, 9]).await, StatusCode::OK);
}

#[tokio::test]
async fn retry_after_rounds_up_and_is_never_zero() {
    let (clock, store) = manual_store();
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("fast", Quota::per_second(10).burst(1)))
        .store(store)
        .build()
        .unwrap();
    let mut app = hello(layer);
    assert_eq!(status(&mut app, "/", [1, 2, 3, 4]).await, StatusCode::OK);
    clock.advance(Duration::from_millis(99));
    // 1 ms left to wait: Retry-After says 1, never 0.
    let res = send(&mut app, request("/", [1, 2, 3, 4])).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&res, "retry-after"), Some("1"));
}

#[tokio::test]
async fn works_in_a_service_builder_and_keeps_the_inner_error_type() {
    let (_clock, store) = manual_store();
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("all", Quota::per_hour(1)).key(Global))
        .store(store)
        .build()
        .unwrap();
    #[derive(Debug)]
    struct MyError;
    let mut svc = ServiceBuilder::new()
        .layer(layer)
        .service_fn(|_req: Request<String>| async {
            Ok::<_, MyError>(Response::new(http_body_util::Full::new(
                bytes::Bytes::from("hi"),
            )))
        });
    let res: Result<_, MyError> = svc
        .ready()
        .await
        .unwrap()
        .call(Request::new(String::new()))
        .await;
    let res = res.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "hi");
    let res = svc
        .ready()
        .await
        .unwrap()
        .call(Request::new(String::new()))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn allowed_responses_keep_what_the_handler_returned() {
    let (_clock, store) = manual_store();
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("r", Quota::per_hour(5)))
        .store(store)
        .build()
        .unwrap();
    let mut app = Router::new()
        .route(
            "/",
            get(|| async {
                (
                    StatusCode::CREATED,
                    [("x-custom", "yes"), ("ratelimit", "\"inner\";r=1;t=1")],
                    "body",
                )
            }),
        )
        .layer(layer);
    let res = send(&mut app, request("/", [5, 5, 5, 5])).await;
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(header(&res, "x-custom"), Some("yes"));
    // An inner limiter's field is kept; ours is added as another field line.
    let lines: Vec<_> = res
        .headers()
        .get_all("ratelimit")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect();
    assert_eq!(lines.len(), 2);
    assert!(lines[0].contains("inner") && lines[1].contains("\"r\""));
    assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "body");
}

#[tokio::test]
async fn cost_can_come_from_the_request() {
    let (_clock, store) = manual_store();
    let layer = RateLimitLayer::builder()
        .rule(
            Rule::new("units", Quota::per_hour(10)).cost(Cost::from_fn(|parts| {
                parts
                    .headers
                    .get("x-units")
                    .and_then(|v| v.to_str().ok()?.parse().ok())
                    .unwrap_or(1)
            })),
        )
        .store(store)
        .build()
        .unwrap();
    let mut app = hello(layer);
    let with_units = |n: &str| {
        let mut req = request("/", [3, 3, 3, 3]);
        req.headers_mut().insert("x-units", n.parse().unwrap());
        req
    };
    assert_eq!(
        send(&mut app, with_units("8")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&mut app, with_units("3")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(&mut app, with_units("2")).await.status(),
        StatusCode::OK
    );
    // A cost the rule can never hold: denied, and no Retry-After promises a retry that cannot work.
    let res = send(&mut app, with_units("11")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(header(&res, "retry-after").is_none());
}

#[tokio::test]
async fn a_custom_denied_response_still_gets_the_headers() {
    let (_clock, store) = manual_store();
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("r", Quota::per_hour(1)))
        .store(store)
        .on_denied(|denied| {
            let names: Vec<&str> = denied.violated().collect();
            http::Response::builder()
                .status(StatusCode::SERVICE_UNAVAILABLE)
                .body(bytes::Bytes::from(format!("busy: {}", names.join(","))))
                .unwrap()
        })
        .build()
        .unwrap();
    let mut app = hello(layer);
    send(&mut app, request("/", [4, 4, 4, 4])).await;
    let res = send(&mut app, request("/", [4, 4, 4, 4])).await;
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(header(&res, "retry-after"), Some("3600"));
    assert!(header(&res, "ratelimit").is_some());
    assert_eq!(
        res.into_body().collect().await.unwrap().to_bytes(),
        "busy: r"
    );
}

#[tokio::test]
async fn requests_without_a_key_share_one_budget_unless_the_rule_skips_them() {
    let by_user = |parts: &http::request::Parts| {
        parts
            .headers
            .get("x-user")
            .and_then(|v| v.to_str().ok())
            .map(Key::text)
    };
    let with_user = |user: &'static str| {
        let mut req = request("/", [1, 1, 1, 1]);
        req.headers_mut().insert("x-user", user.parse().unwrap());
        req
    };
    // By default: never unlimited. Requests without a user count together, under one key.
    let (_clock, store) = manual_store();
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("per-user", Quota::per_hour(2)).key(by_user))
        .store(store)
        .build()
        .unwrap();
    let mut app = hello(layer);
    for _ in 0..2 {
        let res = send(&mut app, request("/", [1, 1, 1, 1])).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert!(header(&res, "ratelimit").is_some());
    }
    assert_eq!(
        status(&mut app, "/", [2, 2, 2, 2]).await,
        StatusCode::TOO_MANY_REQUESTS,
        "every request without a user shares one budget, whatever its IP"
    );
    // Identified users have their own.
    assert_eq!(
        send(&mut app, with_user("ann")).await.status(),
        StatusCode::OK
    );

    // A rule may let them through instead.
    let (_clock, store) = manual_store();
    let layer = RateLimitLayer::builder()
        .rule(
            Rule::new("per-user", Quota::per_hour(1))
                .key(by_user)
                .skip_unidentified(),
        )
        .store(store)
        .build()
        .unwrap();
    let mut app = hello(layer);
    for _ in 0..3 {
        let res = send(&mut app, request("/", [1, 1, 1, 1])).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert!(
            header(&res, "ratelimit").is_none(),
            "no rule applied, no budget to report"
        );
    }
    assert_eq!(
        send(&mut app, with_user("ann")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&mut app, with_user("ann")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// An extractor that needs an asynchronous lookup.
struct TenantLookup;

impl KeyExtractor for TenantLookup {
    fn extract(&self, parts: &http::request::Parts) -> Extracted {
        let token = parts
            .headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        Extracted::Pending(Box::pin(async move {
            tokio::task::yield_now().await;
            token.map(|t| Key::text(format!("tenant-of-{t}")))
        }))
    }
}

#[tokio::test]
async fn async_extractors_are_awaited_before_the_decision() {
    let (_clock, store) = manual_store();
    let (calls, router) = counting_handler();
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("tenant", Quota::per_hour(2)).key(TenantLookup))
        .rule(Rule::new("ip", Quota::per_hour(100)))
        .store(store)
        .build()
        .unwrap();
    let mut app = router.layer(layer);
    let req = || {
        let mut req = request("/", [8, 8, 8, 8]);
        req.headers_mut()
            .insert("authorization", "abc".parse().unwrap());
        req
    };
    assert_eq!(send(&mut app, req()).await.status(), StatusCode::OK);
    let res = send(&mut app, req()).await;
    let items = parse_items(header(&res, "ratelimit").unwrap());
    assert_eq!(
        items.iter().map(|i| i.0.as_str()).collect::<Vec<_>>(),
        ["tenant", "ip"]
    );
    assert_eq!(
        send(&mut app, req()).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// A store that always fails, to see the failure modes.
#[derive(Clone)]
struct BrokenStore;

impl tollgate::store::Store for BrokenStore {
    type Future = std::future::Ready<Result<tollgate::Decision, tollgate::store::StoreError>>;
    fn check(&self, _charges: &[tollgate::store::Charge<'_>]) -> Self::Future {
        std::future::ready(Err(tollgate::store::StoreError::Timeout))
    }
}

#[tokio::test]
async fn a_failing_store_fails_open_or_closed_as_configured() {
    for (mode, expected) in [
        (FailureMode::Open, StatusCode::OK),
        (FailureMode::Closed, StatusCode::SERVICE_UNAVAILABLE),
    ] {
        let (calls, router) = counting_handler();
        let layer = RateLimitLayer::builder()
            .rule(Rule::new("r", Quota::per_hour(1)))
            .store(BrokenStore)
            .on_store_error(mode)
            .build()
            .unwrap();
        let mut app = router.layer(layer);
        let res = send(&mut app, request("/", [6, 6, 6, 6])).await;
        assert_eq!(res.status(), expected, "{mode:?}");
        assert_eq!(
            calls.load(Ordering::SeqCst),
            usize::from(mode == FailureMode::Open)
        );
        if mode == FailureMode::Closed {
            assert_eq!(header(&res, "retry-after"), Some("1"));
        }
    }
}

#[tokio::test]
async fn each_rule_decides_what_a_store_failure_means() {
    // One rule failing closed refuses the request, whatever the others say.
    let (calls, router) = counting_handler();
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("login", Quota::per_minute(5)).on_store_error(FailureMode::Closed))
        .rule(Rule::new("api", Quota::per_second(50)))
        .store(BrokenStore)
        .build()
        .unwrap();
    let mut app = router.layer(layer);
    let res = send(&mut app, request("/", [6, 6, 6, 8])).await;
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    // Local rules are checked in the layer's own limiter, with the usual answers; open rules are
    // skipped. This holds while the circuit breaker is open too (after the 5th failure).
    let (calls, router) = counting_handler();
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("local", Quota::per_hour(8)).on_store_error(FailureMode::Local))
        .rule(Rule::new("open", Quota::per_hour(1)))
        .store(BrokenStore)
        .build()
        .unwrap();
    let mut app = router.layer(layer);
    for remaining in (0..8).rev() {
        let res = send(&mut app, request("/", [6, 6, 6, 9])).await;
        assert_eq!(res.status(), StatusCode::OK);
        let items = parse_items(header(&res, "ratelimit").unwrap());
        assert_eq!(items.len(), 1, "only the local rule reports a budget");
        assert_eq!(items[0].0, "local");
        assert_eq!(param(&items[0], "r"), remaining);
    }
    let res = send(&mut app, request("/", [6, 6, 6, 9])).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(header(&res, "retry-after").is_some());
    assert_eq!(calls.load(Ordering::SeqCst), 8);
    // Another client has its own local budget.
    assert_eq!(status(&mut app, "/", [6, 6, 6, 10]).await, StatusCode::OK);

    // Keys found asynchronously fall back the same way.
    let layer = RateLimitLayer::builder()
        .rule(
            Rule::new("tenant", Quota::per_hour(1))
                .key(TenantLookup)
                .on_store_error(FailureMode::Local),
        )
        .store(BrokenStore)
        .build()
        .unwrap();
    let mut app = hello(layer);
    let req = || {
        let mut req = request("/", [8, 8, 8, 9]);
        req.headers_mut()
            .insert("authorization", "xyz".parse().unwrap());
        req
    };
    assert_eq!(send(&mut app, req()).await.status(), StatusCode::OK);
    assert_eq!(
        send(&mut app, req()).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[test]
fn configuration_mistakes_are_errors_that_say_what_to_change() {
    let err = |layer: Result<RateLimitLayer, tollgate::ConfigError>| layer.unwrap_err().to_string();
    let one = |rule: Rule| RateLimitLayer::builder().rule(rule).build();
    assert!(err(one(Rule::new("a", Quota::per_second(0)))).contains("use at least 1"));
    assert!(err(one(Rule::new("a", Quota::new(1, Duration::ZERO)))).contains("period"));
    assert!(err(one(Rule::new("a", Quota::per_second(5).burst(0)))).contains("burst is 0"));
    assert!(err(one(Rule::new("a", Quota::per_second(5)).cost(6))).contains("lower the cost"));
    assert!(
        err(one(
            Rule::new("a", Quota::per_minute(5).burst(9)).algorithm(Algorithm::FixedWindow)
        ))
        .contains("remove .burst")
    );
    assert!(err(one(Rule::new("has space", Quota::per_second(5)))).contains("rule name"));
    assert!(err(RateLimitLayer::builder().build()).contains("no rules"));
    let dup = RateLimitLayer::builder()
        .rule(Rule::new("same", Quota::per_second(1)))
        .rule(Rule::new("same", Quota::per_day(1)))
        .build();
    assert!(err(dup).contains("two rules are named \"same\""));
    assert!(RateLimitLayer::new(Quota::per_second(1)).is_ok());
}

#[tokio::test]
async fn a_real_server_limits_by_the_socket_peer() {
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(RateLimitLayer::new(Quota::per_minute(2)).unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let res = client
            .get(format!("http://{addr}/").parse().unwrap())
            .await
            .unwrap();
        statuses.push(res.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 429, 429]);
    server.abort();
}

#[test]
fn a_sliding_log_too_large_to_keep_is_refused_at_build_time() {
    // 50,000,000 a day would mean a log of up to 50,000,000 entries per client.
    let huge = RateLimitLayer::builder()
        .rule(Rule::new("daily", Quota::per_day(50_000_000)).algorithm(Algorithm::SlidingWindowLog))
        .build();
    let message = huge.unwrap_err().to_string();
    assert!(message.contains("SlidingWindowCounter"), "{message}");
    assert!(message.contains("10000"), "{message}");
    let at_the_cap = RateLimitLayer::builder()
        .rule(Rule::new("daily", Quota::per_day(10_000)).algorithm(Algorithm::SlidingWindowLog))
        .build();
    assert!(at_the_cap.is_ok());
}

#[tokio::test]
async fn a_429_reports_the_uncharged_budget_of_rules_that_did_not_deny() {
    let (_clock, store) = manual_store();
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("burst", Quota::per_minute(10)))
        .rule(Rule::new("daily", Quota::per_day(1)).algorithm(Algorithm::FixedWindow))
        .store(store)
        .build()
        .unwrap();
    let mut app = hello(layer);
    let res = send(&mut app, request("/", [5, 5, 5, 5])).await;
    assert_eq!(res.status(), StatusCode::OK);
    let items = parse_items(header(&res, "ratelimit").unwrap());
    assert_eq!(param(&items[0], "r"), 9);
    // Denied by "daily" alone: nothing is charged, so "burst" still has 9.
    for _ in 0..3 {
        let res = send(&mut app, request("/", [5, 5, 5, 5])).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        let items = parse_items(header(&res, "ratelimit").unwrap());
        assert_eq!(items[0].0, "burst");
        assert_eq!(param(&items[0], "r"), 9, "burst was not charged");
        assert_eq!(param(&items[1], "r"), 0);
    }
}

#[test]
fn layers_sharing_a_store_cannot_give_one_rule_name_two_quotas() {
    let store = MemoryStore::new();
    let fast = RateLimitLayer::builder()
        .rule(Rule::new("default", Quota::per_minute(100)))
        .store(store.clone())
        .build()
        .unwrap();
    // The same name with the same quota is one budget, shared on purpose.
    let same = RateLimitLayer::builder()
        .rule(Rule::new("default", Quota::per_minute(100)))
        .store(store.clone())
        .build();
    assert!(same.is_ok());
    let slow = RateLimitLayer::builder()
        .rule(Rule::new("default", Quota::per_minute(2)))
        .store(store.clone())
        .build();
    let message = slow.unwrap_err().to_string();
    assert!(message.contains("\"default\""), "{message}");
    assert!(message.contains("another name"), "{message}");
    // Once the first layers are gone, the name is free again.
    drop((fast, same));
    let again = RateLimitLayer::builder()
        .rule(Rule::new("default", Quota::per_minute(2)))
        .store(store)
        .build();
    assert!(again.is_ok());
}
