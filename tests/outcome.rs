//! Charges that follow the outcome, on the memory store, a standalone Redis and a 3-primary
//! cluster: only failures counted, exactly, under concurrency; costs settled after the
//! response; a limiter handle that peeks, charges, refunds and resets; CORS preflights not
//! counted, and a 429 behind `CorsLayer` that a browser can read.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::{get, post};
use axum::{Extension, Router};
use http::{Request, Response, StatusCode};
use tollgate::key::Key;
use tollgate::store::{MemoryStore, RedisClusterStore, RedisStore, Store};
use tollgate::testing::{Budget, Problem};
use tollgate::{ActualCost, Quota, RateLimitLayer, Rule};
use tower::{Service, ServiceExt};

fn request(method: &str, path: &str) -> Request<Body> {
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .body(Body::empty())
        .unwrap();
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::from(([10, 7, 0, 1], 40_000))));
    req
}

async fn send(app: &Router, req: Request<Body>) -> Response<Body> {
    app.clone().oneshot(req).await.unwrap()
}

/// The stores under test, each with a prefix of its own.
async fn stores(name: &str) -> (MemoryStore, RedisStore, RedisClusterStore) {
    let redis = RedisStore::builder(support::standalone().url())
        .prefix(support::unique_prefix(name))
        .response_timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    let cluster = RedisClusterStore::builder(support::cluster().urls())
        .prefix(support::unique_prefix(name))
        .response_timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    (MemoryStore::new(), redis, cluster)
}

/// A login endpoint whose answer the request chooses (`/login/401`, `/login/200`), after a
/// moment: 5 failed logins per minute per client.
fn login_app<St: Store>(store: St) -> Router {
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("failed-logins", Quota::per_minute(5)).charge_on_status([401, 403]))
        .store(store)
        .build()
        .unwrap();
    Router::new()
        .route(
            "/login/{status}",
            post(
                |axum::extract::Path(status): axum::extract::Path<u16>| async move {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    StatusCode::from_u16(status).unwrap()
                },
            ),
        )
        .layer(layer)
}

async fn only_failures_are_counted<St: Store>(store: St, name: &str) {
    let app = login_app(store);
    // Successful logins never use the budget.
    for _ in 0..20 {
        assert_eq!(
            send(&app, request("POST", "/login/200")).await.status(),
            200,
            "{name}"
        );
    }
    // 50 concurrent failing logins against 5: exactly 5 are let through (each holds its unit
    // from admission).
    let attempts = (0..50).map(|_| send(&app, request("POST", "/login/401")));
    let statuses: Vec<u16> = futures_util::future::join_all(attempts)
        .await
        .into_iter()
        .map(|r| r.status().as_u16())
        .collect();
    assert_eq!(
        statuses.iter().filter(|s| **s == 401).count(),
        5,
        "{name}: {statuses:?}"
    );
    assert_eq!(statuses.iter().filter(|s| **s == 429).count(), 45, "{name}");
    // The budget is spent by the failures: a success now is refused too, and says why.
    let refused = send(&app, request("POST", "/login/200")).await;
    assert_eq!(refused.status(), 429, "{name}");
    let budget = Budget::of(refused.headers()).unwrap();
    assert_eq!(budget.limit("failed-logins").unwrap().remaining, 0);
    let body = axum::body::to_bytes(refused.into_body(), 4096)
        .await
        .unwrap();
    assert_eq!(
        Problem::of(&body).unwrap().violated_policies,
        ["failed-logins"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_failures_are_counted_exactly_on_every_store() {
    let (memory, redis, cluster) = stores("failures").await;
    only_failures_are_counted(memory, "memory").await;
    only_failures_are_counted(redis, "redis").await;
    only_failures_are_counted(cluster, "cluster").await;
}

/// An endpoint that reports the tokens it used in `x-tokens-used` (the request says how many):
/// 10,000 tokens per minute, 500 reserved per request.
fn tokens_app<St: Store>(store: St, from_header: bool) -> Router {
    let rule = Rule::new("tokens", Quota::per_minute(10_000)).cost(500);
    let rule = if from_header {
        rule.settle_from_header(http::HeaderName::from_static("x-tokens-used"))
    } else {
        rule.settle()
    };
    let layer = RateLimitLayer::builder()
        .rule(rule)
        .store(store)
        .build()
        .unwrap();
    Router::new()
        .route(
            "/complete/{tokens}",
            post(
                |axum::extract::Path(tokens): axum::extract::Path<u64>| async move {
                    ([("x-tokens-used", tokens.to_string())], "done")
                },
            ),
        )
        .route(
            "/extension/{tokens}",
            post(
                |axum::extract::Path(tokens): axum::extract::Path<u64>| async move {
                    (Extension(ActualCost(tokens)), "done")
                },
            ),
        )
        .layer(layer)
}

async fn costs_are_settled<St: Store + Clone>(store: St, name: &str) {
    let app = tokens_app(store.clone(), true);
    let remaining = |res: &Response<Body>| {
        Budget::of(res.headers())
            .unwrap()
            .limit("tokens")
            .unwrap()
            .remaining
    };
    // 200 used of 500 reserved: 300 come back. The header is not passed on.
    let started = std::time::Instant::now();
    let res = send(&app, request("POST", "/complete/200")).await;
    assert_eq!(res.status(), 200);
    assert!(res.headers().get("x-tokens-used").is_none(), "{name}");
    let next = send(&app, request("POST", "/complete/500")).await;
    // A token comes back every 6 ms (10,000 a minute): a slow machine sees a few.
    let refilled = u64::try_from(started.elapsed().as_millis() / 6).unwrap();
    let left = remaining(&next);
    assert!(
        (10_000 - 200 - 500..=10_000 - 200 - 500 + refilled).contains(&left),
        "{name}: {left} left, {refilled} refilled"
    );
    // 4,000 used of 500 reserved: 3,500 more, until the budget is in debt. The handler may
    // say so with an `ActualCost` extension instead (the same rule, on the same store).
    let by_extension = tokens_app(store, false);
    for _ in 0..2 {
        let res = send(&by_extension, request("POST", "/extension/4000")).await;
        assert_eq!(res.status(), 200, "{name}");
    }
    // 700 + 8,000 used: 1,300 left, one more request of 4,000 overdraws it by 2,700.
    assert_eq!(
        send(&app, request("POST", "/complete/4000")).await.status(),
        200,
        "{name}"
    );
    let denied = send(&app, request("POST", "/complete/100")).await;
    assert_eq!(denied.status(), 429, "{name}");
    // The debt of 2,700 and the 500 asked for refill at 10,000 a minute: 19.2 s.
    let retry = Budget::of(denied.headers()).unwrap().retry_after.unwrap();
    assert!((19..=20).contains(&retry), "{name}: Retry-After {retry}");
}

#[tokio::test]
async fn costs_known_after_the_response_are_settled_on_every_store() {
    let (memory, redis, cluster) = stores("settle").await;
    costs_are_settled(memory, "memory").await;
    costs_are_settled(redis, "redis").await;
    costs_are_settled(cluster, "cluster").await;
}

async fn the_limiter<St: Store + Clone>(store: St, name: &str) {
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("login", Quota::per_minute(5)))
        .store(store.clone())
        .build()
        .unwrap();
    let limiter = layer.limiter();
    let alice = Key::text(format!("alice-{name}"));
    // Peek changes nothing.
    let before = limiter.peek("login", &alice).await.unwrap();
    assert_eq!(before.remaining, 5);
    assert_eq!(
        limiter.peek("login", &alice).await.unwrap().remaining,
        5,
        "{name}"
    );
    for _ in 0..5 {
        assert!(limiter.charge("login", &alice, 1).await.unwrap().allowed());
    }
    let spent = limiter.peek("login", &alice).await.unwrap();
    assert_eq!(spent.remaining, 0);
    // (Time moves on the stores' clocks: the budget, not its times, is compared.)
    let again = limiter.peek("login", &alice).await.unwrap();
    assert_eq!(again.remaining, 0, "{name}: peek charges nothing");
    assert!(!limiter.charge("login", &alice, 1).await.unwrap().allowed());
    // A refund gives units back; a reset the whole budget.
    limiter.refund("login", &alice, 2).await.unwrap();
    assert_eq!(
        limiter.peek("login", &alice).await.unwrap().remaining,
        2,
        "{name}"
    );
    limiter.reset("login", &alice).await.unwrap();
    assert_eq!(
        limiter.peek("login", &alice).await.unwrap().remaining,
        5,
        "{name}"
    );
    assert!(
        limiter.charge("login", &alice, 1).await.unwrap().allowed(),
        "{name}"
    );
    // A forced charge beyond the budget is a debt: 4 left, 10 forced, so 6 owed and one asked
    // for, at one every 12 s: 84 s.
    limiter.force("login", &alice, 10).await.unwrap();
    let debt = limiter.peek("login", &alice).await.unwrap();
    assert_eq!(debt.remaining, 0);
    let refused = limiter.charge("login", &alice, 1).await.unwrap();
    assert!(!refused.allowed(), "{name}");
    let retry = refused.outcomes()[0].retry_after;
    assert!(
        (83_000_000..=84_000_000).contains(&retry),
        "{name}: retry after {retry} µs"
    );
    assert!(matches!(
        limiter.peek("signup", &alice).await,
        Err(tollgate::LimiterError::UnknownRule(_))
    ));
}

#[tokio::test]
async fn the_limiter_peeks_charges_refunds_and_resets_on_every_store() {
    let (memory, redis, cluster) = stores("limiter").await;
    the_limiter(memory, "memory").await;
    the_limiter(redis, "redis").await;
    the_limiter(cluster, "cluster").await;
}

/// Redis's value of a key is the same before and after a peek.
#[tokio::test]
async fn a_peek_leaves_redis_as_it_was() {
    let (_, redis, _) = stores("peek-state").await;
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("peeked", Quota::per_minute(5)))
        .store(redis.clone())
        .build()
        .unwrap();
    let limiter = layer.limiter();
    let key = Key::text("peeked-client");
    limiter.charge("peeked", &key, 2).await.unwrap();
    let name = redis.key_name("peeked", &key);
    let value = || -> (Option<String>, i64) {
        let mut conn = support::standalone().conn();
        let value: Option<String> = redis::cmd("GET").arg(&name).query(&mut conn).unwrap();
        let ttl: i64 = redis::cmd("PTTL").arg(&name).query(&mut conn).unwrap();
        (value, ttl)
    };
    let before = value();
    assert!(before.0.is_some());
    for _ in 0..10 {
        limiter.peek("peeked", &key).await.unwrap();
    }
    let after = value();
    assert_eq!(after.0, before.0, "the value is untouched");
    // The expiry only ran down: neither rewritten later nor removed.
    assert!(
        0 < after.1 && after.1 <= before.1,
        "the expiry is untouched: {before:?} then {after:?}"
    );
}

fn cors_app() -> Router {
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("api", Quota::per_minute(1)))
        .build()
        .unwrap();
    // CorsLayer outside the limit: it answers preflights, and adds its headers to every
    // response, the 429s among them.
    Router::new()
        .route("/api", get(|| async { "ok" }))
        .layer(layer)
        .layer(
            tower_http::cors::CorsLayer::new()
                .allow_origin(tower_http::cors::Any)
                .expose_headers([
                    http::HeaderName::from_static("ratelimit"),
                    http::HeaderName::from_static("ratelimit-policy"),
                    http::header::RETRY_AFTER,
                ]),
        )
}

#[tokio::test]
async fn a_429_behind_cors_carries_what_a_browser_needs_and_preflights_are_free() {
    let app = cors_app();
    let from_browser = |method: &str| {
        let mut req = request(method, "/api");
        req.headers_mut()
            .insert("origin", "https://app.example".parse().unwrap());
        req
    };
    assert_eq!(send(&app, from_browser("GET")).await.status(), 200);
    let denied = send(&app, from_browser("GET")).await;
    assert_eq!(denied.status(), 429);
    assert_eq!(
        denied.headers().get("access-control-allow-origin").unwrap(),
        "*"
    );
    assert!(
        denied
            .headers()
            .contains_key("access-control-expose-headers")
    );

    // The limit layer alone: a browser's preflights are never counted, other OPTIONS are.
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("api", Quota::per_minute(1)))
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/api",
            get(|| async { "ok" }).options(|| async { "options" }),
        )
        .layer(layer);
    let preflight = || {
        let mut req = request("OPTIONS", "/api");
        req.headers_mut()
            .insert("access-control-request-method", "GET".parse().unwrap());
        req.headers_mut()
            .insert("origin", "https://app.example".parse().unwrap());
        req
    };
    for _ in 0..10 {
        let res = send(&app, preflight()).await;
        assert_eq!(res.status(), 200);
        assert!(!res.headers().contains_key("ratelimit"), "not counted");
    }
    assert_eq!(send(&app, request("GET", "/api")).await.status(), 200);
    assert_eq!(send(&app, request("GET", "/api")).await.status(), 429);
    assert_eq!(
        send(&app, request("OPTIONS", "/api")).await.status(),
        429,
        "plain OPTIONS"
    );
    // Without an Origin, it is no preflight.
    let mut no_origin = request("OPTIONS", "/api");
    no_origin
        .headers_mut()
        .insert("access-control-request-method", "GET".parse().unwrap());
    assert_eq!(send(&app, no_origin).await.status(), 429, "no Origin");
    // Counted when asked.
    let counted = RateLimitLayer::builder()
        .rule(Rule::new("api", Quota::per_minute(1)))
        .count_preflight(true)
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/api",
            get(|| async { "ok" }).options(|| async { "options" }),
        )
        .layer(counted);
    assert_eq!(send(&app, preflight()).await.status(), 200);
    assert_eq!(send(&app, preflight()).await.status(), 429);
}

#[test]
fn rules_that_cannot_settle_are_refused_at_build_time() {
    let error = |rule: Rule| {
        RateLimitLayer::builder()
            .rule(rule)
            .build()
            .unwrap_err()
            .to_string()
    };
    let log = Rule::new("log", Quota::per_minute(10))
        .algorithm(tollgate::Algorithm::SlidingWindowLog)
        .settle();
    assert!(error(log).contains("cannot hold a debt"));
    let leased = Rule::new("leased", Quota::per_minute(10)).lease(5).settle();
    assert!(error(leased).contains("leased or split"));
    let split = Rule::new("split", Quota::per_minute(10))
        .split(2)
        .charge_on_status([401]);
    assert!(error(split).contains("leased or split"));
    // Every other algorithm settles.
    for algorithm in [
        tollgate::Algorithm::TokenBucket,
        tollgate::Algorithm::Gcra,
        tollgate::Algorithm::FixedWindow,
        tollgate::Algorithm::SlidingWindowCounter,
    ] {
        RateLimitLayer::builder()
            .rule(
                Rule::new("ok", Quota::per_minute(10))
                    .algorithm(algorithm)
                    .settle(),
            )
            .build()
            .unwrap();
    }
}

/// A response that never comes keeps its charge: the inner service failed, or the client went
/// away while the handler worked.
#[tokio::test]
async fn a_response_that_never_comes_keeps_its_charge() {
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("failed", Quota::per_minute(2)).charge_on_status([401]))
        .build()
        .unwrap();
    let limiter = layer.limiter();
    let peer = Key::ip("10.7.0.1".parse().unwrap());
    // An inner service that fails.
    let failing = tower::service_fn(|_: Request<Body>| async {
        Err::<Response<Body>, std::io::Error>(std::io::Error::other("the handler failed"))
    });
    let mut service = tower::Layer::layer(&layer, failing);
    assert!(
        service
            .ready()
            .await
            .unwrap()
            .call(request("POST", "/"))
            .await
            .is_err()
    );
    assert_eq!(
        limiter.peek("failed", &peer).await.unwrap().remaining,
        1,
        "kept"
    );
    // A handler the client does not wait for.
    let slow = tower::service_fn(|_: Request<Body>| async {
        tokio::time::sleep(Duration::from_secs(30)).await;
        Ok::<_, std::io::Error>(Response::new(Body::empty()))
    });
    let mut service = tower::Layer::layer(&layer, slow);
    let call = service.ready().await.unwrap().call(request("POST", "/"));
    assert!(
        tokio::time::timeout(Duration::from_millis(20), call)
            .await
            .is_err()
    );
    assert_eq!(
        limiter.peek("failed", &peer).await.unwrap().remaining,
        0,
        "kept"
    );
}

/// On the memory store, on a clock that does not move, a peek leaves the budget exactly as it
/// was: every field of its outcome, and of the next check's.
#[tokio::test]
async fn a_peek_leaves_the_memory_store_as_it_was() {
    let clock = tollgate::clock::ManualClock::default();
    let store = MemoryStore::builder().clock(clock).build().unwrap();
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("peeked", Quota::per_minute(5)))
        .store(store)
        .build()
        .unwrap();
    let limiter = layer.limiter();
    let key = Key::text("peeked");
    limiter.charge("peeked", &key, 2).await.unwrap();
    let first = limiter.peek("peeked", &key).await.unwrap();
    for _ in 0..10 {
        assert_eq!(limiter.peek("peeked", &key).await.unwrap(), first);
    }
    let charged = limiter.charge("peeked", &key, 1).await.unwrap();
    assert_eq!(charged.outcomes()[0].remaining, first.remaining - 1);
}

/// A store that is always down.
struct Down;

impl Store for Down {
    type Future = std::future::Ready<Result<tollgate::Decision, tollgate::store::StoreError>>;

    fn check(&self, _: &[tollgate::store::Charge<'_>]) -> Self::Future {
        std::future::ready(Err(tollgate::store::StoreError::Timeout))
    }
}

/// With the store down, the rule fails open: nothing is settled, and the header the handler
/// reports its cost in is still not passed on.
#[tokio::test]
async fn a_cost_header_never_reaches_the_client() {
    let rule = Rule::new("tokens", Quota::per_minute(10_000))
        .cost(500)
        .on_store_error(tollgate::FailureMode::Open)
        .settle_from_header(http::HeaderName::from_static("x-tokens-used"));
    let layer = RateLimitLayer::builder()
        .rule(rule)
        .store(Down)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", post(|| async { ([("x-tokens-used", "900")], "done") }))
        .layer(layer);
    let res = send(&app, request("POST", "/")).await;
    assert_eq!(res.status(), 200);
    assert!(!res.headers().contains_key("x-tokens-used"));
    assert!(!res.headers().contains_key("ratelimit"), "failed open");
}

/// With the store down, a rule that falls back to the local limiter is settled there: successful
/// logins give their unit back, failed ones keep it.
#[tokio::test]
async fn the_local_fallback_settles_too() {
    let layer = RateLimitLayer::builder()
        .rule(
            Rule::new("failed-logins", Quota::per_minute(3))
                .charge_on_status([401])
                .on_store_error(tollgate::FailureMode::Local),
        )
        .store(Down)
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/login/{status}",
            post(
                |axum::extract::Path(status): axum::extract::Path<u16>| async move {
                    StatusCode::from_u16(status).unwrap()
                },
            ),
        )
        .layer(layer);
    for _ in 0..10 {
        assert_eq!(
            send(&app, request("POST", "/login/200")).await.status(),
            200
        );
    }
    for _ in 0..3 {
        assert_eq!(
            send(&app, request("POST", "/login/401")).await.status(),
            401
        );
    }
    assert_eq!(
        send(&app, request("POST", "/login/200")).await.status(),
        429
    );
}

/// A handler that reports a cost past any budget puts the key in a bounded debt, and nothing
/// panics: on every store.
#[tokio::test]
async fn a_cost_past_any_budget_is_a_bounded_debt() {
    let (memory, redis, cluster) = stores("huge").await;
    async fn run<St: Store + Clone>(store: St, name: &str) {
        let app = tokens_app(store.clone(), false);
        let huge = format!("/extension/{}", u64::MAX);
        assert_eq!(
            send(&app, request("POST", &huge)).await.status(),
            200,
            "{name}"
        );
        let denied = send(&app, request("POST", "/extension/1")).await;
        assert_eq!(denied.status(), 429, "{name}");
        let retry = Budget::of(denied.headers()).unwrap().retry_after.unwrap();
        let bound = tollgate::algorithm::MAX_DEBT_MICROS / 1_000_000;
        assert!(
            retry > bound / 2 && retry <= bound,
            "{name}: Retry-After {retry} s"
        );
        // Giving back more than was ever charged leaves a full budget.
        let limiter = RateLimitLayer::builder()
            .rule(
                Rule::new("tokens", Quota::per_minute(10_000))
                    .cost(500)
                    .settle(),
            )
            .store(store)
            .build()
            .unwrap()
            .limiter();
        let peer = Key::ip("10.7.0.1".parse().unwrap());
        limiter.refund("tokens", &peer, u64::MAX).await.unwrap();
        assert_eq!(
            limiter.peek("tokens", &peer).await.unwrap().remaining,
            10_000,
            "{name}"
        );
    }
    run(memory, "memory").await;
    run(redis, "redis").await;
    run(cluster, "cluster").await;
}

/// A memory store whose settles wait until the test lets them go, as a remote store's take a
/// while.
#[derive(Clone)]
struct SlowSettle(MemoryStore, std::sync::Arc<tokio::sync::Notify>);

impl Store for SlowSettle {
    type Future = <MemoryStore as Store>::Future;

    fn check(&self, charges: &[tollgate::store::Charge<'_>]) -> Self::Future {
        self.0.check(charges)
    }

    fn peek(
        &self,
        charges: &[tollgate::store::Charge<'_>],
    ) -> tollgate::store::StoreFuture<tollgate::Decision> {
        self.0.peek(charges)
    }

    fn adjust(
        &self,
        adjustments: &[tollgate::store::Adjustment<'_>],
    ) -> tollgate::store::StoreFuture<()> {
        let store = self.0.clone();
        let go = self.1.clone();
        let owned: Vec<_> = adjustments
            .iter()
            .map(|a| (a.rule.clone(), a.key.clone(), a.change, a.charged_at))
            .collect();
        Box::pin(async move {
            go.notified().await;
            let adjustments: Vec<_> = owned
                .iter()
                .map(
                    |(rule, key, change, charged_at)| tollgate::store::Adjustment {
                        rule,
                        key,
                        change: *change,
                        charged_at: *charged_at,
                    },
                )
                .collect();
            store.adjust(&adjustments).await
        })
    }
}

/// A client that goes away while its cost is settled does not undo the charge: the settle
/// finishes on its own.
#[tokio::test]
async fn a_settle_finishes_when_the_client_leaves() {
    // On a clock that does not move: the budget is what was charged.
    let clock = tollgate::clock::ManualClock::default();
    let go = std::sync::Arc::new(tokio::sync::Notify::new());
    let store = SlowSettle(
        MemoryStore::builder().clock(clock).build().unwrap(),
        go.clone(),
    );
    // The handler says when it answered: the request then waits for its settle.
    let (answered, mut handler_done) = tokio::sync::mpsc::unbounded_channel::<()>();
    let layer = RateLimitLayer::builder()
        .rule(
            Rule::new("tokens", Quota::per_minute(10_000))
                .cost(500)
                .settle(),
        )
        .store(store.clone())
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/extension/{tokens}",
            post(
                move |axum::extract::Path(tokens): axum::extract::Path<u64>| async move {
                    let _ = answered.send(());
                    (Extension(ActualCost(tokens)), "done")
                },
            ),
        )
        .layer(layer);
    let limiter = RateLimitLayer::builder()
        .rule(
            Rule::new("tokens", Quota::per_minute(10_000))
                .cost(500)
                .settle(),
        )
        .store(store)
        .build()
        .unwrap()
        .limiter();
    let peer = Key::ip("10.7.0.1".parse().unwrap());
    // The client leaves once the handler answered, while the settle waits.
    let call = send(&app, request("POST", "/extension/3000"));
    tokio::select! {
        _ = call => panic!("the settle was let go before the client left"),
        _ = handler_done.recv() => {}
    }
    assert_eq!(
        limiter.peek("tokens", &peer).await.unwrap().remaining,
        9_500,
        "reserved, not yet settled"
    );
    go.notify_one();
    let mut remaining = 0;
    for _ in 0..500 {
        remaining = limiter.peek("tokens", &peer).await.unwrap().remaining;
        if remaining != 9_500 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(remaining, 7_000, "settled after the client left");
}

/// The deny list comes before the preflight exemption: a denied client's `OPTIONS` with CORS
/// headers is refused like its other requests.
#[tokio::test]
async fn a_denied_client_gets_nothing_from_a_preflight() {
    use tollgate::policy::{Policy, Tier};
    let policy = Policy::new("1")
        .tier(Tier::new("all").rule(Rule::new("api", Quota::per_minute(100))))
        .default_tier("all")
        .deny("10.7.0.1".parse().unwrap());
    let layer = RateLimitLayer::builder().policy(policy).build().unwrap();
    let app = Router::new()
        .route(
            "/api",
            get(|| async { "ok" }).options(|| async { "options" }),
        )
        .layer(layer);
    let mut preflight = request("OPTIONS", "/api");
    preflight
        .headers_mut()
        .insert("access-control-request-method", "GET".parse().unwrap());
    preflight
        .headers_mut()
        .insert("origin", "https://app.example".parse().unwrap());
    assert_eq!(send(&app, preflight).await.status(), 403);
}
