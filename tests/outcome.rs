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
use tower::ServiceExt;

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
    let res = send(&app, request("POST", "/complete/200")).await;
    assert_eq!(res.status(), 200);
    assert!(res.headers().get("x-tokens-used").is_none(), "{name}");
    let next = send(&app, request("POST", "/complete/500")).await;
    assert_eq!(remaining(&next), 10_000 - 200 - 500, "{name}");
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
    assert_eq!(
        (again.remaining, again.allowed),
        (0, true),
        "{name}: peek charges nothing"
    );
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
    // A forced charge beyond the budget is a debt.
    limiter.force("login", &alice, 10).await.unwrap();
    let debt = limiter.peek("login", &alice).await.unwrap();
    assert_eq!(debt.remaining, 0);
    assert!(
        !limiter.charge("login", &alice, 1).await.unwrap().allowed(),
        "{name}"
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
    assert!(after.1 <= before.1, "the expiry is untouched");
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
