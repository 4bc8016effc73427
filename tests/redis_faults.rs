//! The layer in front of a Redis that turns slow or goes away, through a TCP proxy that adds
//! latency or cuts the connection: time budgets, the circuit breaker and each rule's failure mode.
//! A Redis Cluster cannot sit behind one proxy (its redirections name the nodes themselves), so
//! its nodes are paused instead.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::{Request, StatusCode};
use support::fault_proxy::FaultProxy;
use support::{RedisCluster, standalone, unique_prefix};
use tollgate::policy::CircuitBreaker;
use tollgate::store::{RedisClusterStore, RedisStore, Store};
use tollgate::{FailureMode, Quota, RateLimitLayer, Rule};
use tower::{Service, ServiceExt};

/// The answer to a request from `ip`.
async fn send(app: &mut Router, ip: [u8; 4]) -> http::Response<Body> {
    let mut req = Request::get("/").body(Body::empty()).unwrap();
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::from((ip, 40_000))));
    app.as_service()
        .ready()
        .await
        .unwrap()
        .call(req)
        .await
        .unwrap()
}

async fn status(app: &mut Router, ip: [u8; 4]) -> StatusCode {
    send(app, ip).await.status()
}

async fn app_behind(proxy: &FaultProxy, rules: Vec<Rule>, breaker: CircuitBreaker) -> Router {
    let store = RedisStore::builder(proxy.url())
        .prefix(unique_prefix("faults"))
        .response_timeout(Duration::from_millis(50))
        .build()
        .await
        .unwrap();
    app_with(store, rules, breaker)
}

fn app_with<St: Store>(store: St, rules: Vec<Rule>, breaker: CircuitBreaker) -> Router {
    let layer = RateLimitLayer::builder()
        .rules(rules)
        .store(store)
        .circuit_breaker(breaker)
        .build()
        .unwrap();
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
}

#[tokio::test]
async fn a_slow_redis_opens_the_breaker_and_the_local_limiter_takes_over() {
    let proxy = FaultProxy::start(standalone().port).await;
    let rules = vec![Rule::new("api", Quota::per_hour(5)).on_store_error(FailureMode::Local)];
    let breaker = CircuitBreaker::after_failures(3).cooldown(Duration::from_secs(60));
    let mut app = app_behind(&proxy, rules, breaker).await;
    let ip = [10, 1, 0, 1];

    // Redis decides.
    assert_eq!(status(&mut app, ip).await, StatusCode::OK);
    assert_eq!(proxy.checks_delivered(), 1);

    // Redis turns slow: every check exceeds its 50 ms budget. The local limiter answers instead
    // (its own budget of 5), and after 3 failures the breaker stops asking Redis at all.
    proxy.set_delay(Duration::from_millis(300));
    for _ in 0..3 {
        assert_eq!(status(&mut app, ip).await, StatusCode::OK);
    }
    // Whatever of the slow checks still reaches Redis arrives within a second (the proxy delays
    // each write by 300 ms); then the count must not move while the breaker is open.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let delivered = proxy.checks_delivered();
    assert!(delivered >= 1);
    assert_eq!(status(&mut app, ip).await, StatusCode::OK);
    assert_eq!(status(&mut app, ip).await, StatusCode::OK);
    assert_eq!(
        status(&mut app, ip).await,
        StatusCode::TOO_MANY_REQUESTS,
        "the local limit holds"
    );
    assert_eq!(
        status(&mut app, [10, 1, 0, 2]).await,
        StatusCode::OK,
        "per client, locally too"
    );
    // Anything sent now would arrive within 300 ms: wait longer, then count.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        proxy.checks_delivered(),
        delivered,
        "the open breaker asked Redis nothing"
    );
}

#[tokio::test]
async fn a_cut_connection_fails_each_rule_its_own_way_and_redis_is_used_again_after() {
    let proxy = FaultProxy::start(standalone().port).await;
    let rules = vec![
        Rule::new("login", Quota::per_hour(100)).on_store_error(FailureMode::Closed),
        Rule::new("api", Quota::per_hour(100)),
    ];
    let mut strict = app_behind(&proxy, rules, CircuitBreaker::disabled()).await;
    let mut lenient = app_behind(
        &proxy,
        vec![Rule::new("api", Quota::per_hour(1))],
        CircuitBreaker::disabled(),
    )
    .await;
    let ip = [10, 2, 0, 1];
    assert_eq!(status(&mut strict, ip).await, StatusCode::OK);
    assert_eq!(status(&mut lenient, ip).await, StatusCode::OK);
    assert_eq!(
        status(&mut lenient, ip).await,
        StatusCode::TOO_MANY_REQUESTS,
        "Redis counts"
    );

    proxy.set_cut(true);
    // A rule failing closed refuses; a layer of open rules lets everything through.
    assert_eq!(
        status(&mut strict, ip).await,
        StatusCode::SERVICE_UNAVAILABLE
    );
    for _ in 0..3 {
        assert_eq!(status(&mut lenient, ip).await, StatusCode::OK);
    }

    // The connection comes back: Redis decides again, with the budget it kept.
    proxy.set_cut(false);
    let mut recovered = false;
    for _ in 0..50 {
        if status(&mut lenient, ip).await == StatusCode::TOO_MANY_REQUESTS {
            recovered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        recovered,
        "the store reconnected and Redis still holds the spent budget"
    );
    // Each store replaces its dead connections as requests find them (a failed request marks its
    // connection broken): the strict layer, failing closed meanwhile, recovers too.
    let mut strict_recovered = false;
    for _ in 0..10 {
        if status(&mut strict, ip).await == StatusCode::OK {
            strict_recovered = true;
            break;
        }
    }
    assert!(strict_recovered);
}

/// Asks until `app` answers `wanted` for `ip`, for at most 5 s.
async fn eventually(app: &mut Router, ip: [u8; 4], wanted: StatusCode) -> bool {
    for _ in 0..50 {
        if status(app, ip).await == wanted {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

#[tokio::test]
async fn a_paused_cluster_fails_each_rule_its_own_way_and_is_used_again_after() {
    // A cluster of its own: pausing the shared one would slow the other tests.
    let cluster = RedisCluster::start();
    let store_with = |prefix: String| async {
        RedisClusterStore::builder(cluster.urls())
            .prefix(prefix)
            .response_timeout(Duration::from_millis(50))
            .build()
            .await
            .unwrap()
    };
    let store = || store_with(unique_prefix("cluster-faults"));
    let local_prefix = unique_prefix("cluster-faults");
    let no_breaker = CircuitBreaker::disabled;
    let mut strict = app_with(
        store().await,
        vec![
            Rule::new("login", Quota::per_hour(100)).on_store_error(FailureMode::Closed),
            Rule::new("api", Quota::per_hour(100)),
        ],
        no_breaker(),
    );
    let mut lenient = app_with(
        store().await,
        vec![Rule::new("api", Quota::per_hour(1))],
        no_breaker(),
    );
    let mut local = app_with(
        store_with(local_prefix.clone()).await,
        vec![Rule::new("local", Quota::per_hour(2)).on_store_error(FailureMode::Local)],
        no_breaker(),
    );
    let mut counted = app_with(
        store().await,
        vec![Rule::new("once", Quota::per_hour(10))],
        no_breaker(),
    );
    let ip = [10, 3, 0, 1];
    assert_eq!(status(&mut strict, ip).await, StatusCode::OK);
    assert_eq!(status(&mut lenient, ip).await, StatusCode::OK);
    assert_eq!(
        status(&mut lenient, ip).await,
        StatusCode::TOO_MANY_REQUESTS,
        "the cluster counts"
    );

    // Every node holds back writes (and so scripts) for far longer than the 50 ms budget.
    cluster.on_every_node(redis::cmd("CLIENT").arg("PAUSE").arg(30_000).arg("WRITE"));
    assert_eq!(
        status(&mut strict, ip).await,
        StatusCode::SERVICE_UNAVAILABLE,
        "a rule failing closed refuses"
    );
    for _ in 0..3 {
        assert_eq!(
            status(&mut lenient, ip).await,
            StatusCode::OK,
            "open rules let everything through"
        );
    }
    assert_eq!(status(&mut counted, ip).await, StatusCode::OK);
    assert_eq!(status(&mut local, ip).await, StatusCode::OK);
    assert_eq!(status(&mut local, ip).await, StatusCode::OK);
    assert_eq!(
        status(&mut local, ip).await,
        StatusCode::TOO_MANY_REQUESTS,
        "the local limit holds"
    );

    // The nodes resume: the cluster decides again, with the budget it kept.
    cluster.on_every_node(redis::cmd("CLIENT").arg("UNPAUSE"));
    assert!(
        eventually(&mut lenient, ip, StatusCode::TOO_MANY_REQUESTS).await,
        "the cluster still holds the spent budget"
    );
    assert!(eventually(&mut strict, ip, StatusCode::OK).await);
    // Checks that ran out of time are not lost: the nodes ran them when they resumed. The two
    // requests the local limiter admitted were served, and the cluster counted them too (the
    // third was denied there as well), so its budget for this rule is spent. The local layer
    // never reached the cluster before the pause, so the key proves it.
    let key = format!("{local_prefix}:{{10.3.0.1}}:local");
    let mut conn = cluster.conn_for(&key);
    let mut exists = false;
    for _ in 0..50 {
        exists = redis::cmd("EXISTS").arg(&key).query(&mut conn).unwrap();
        if exists {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(exists, "{key} was written when the nodes resumed");
    assert_eq!(
        status(&mut local, ip).await,
        StatusCode::TOO_MANY_REQUESTS,
        "the cluster counted the requests served during the pause"
    );
    // A check that ran out of time is run once, never re-sent: 10 - 1 (timed out, run on resume)
    // - 1 (this one) = 8 left.
    let field = ratelimit(&mut counted, ip).await;
    assert!(
        field.starts_with("\"once\";r=8;"),
        "the timed-out check was charged exactly once: {field}"
    );
}

/// The `RateLimit` field of the answer to one request.
async fn ratelimit(app: &mut Router, ip: [u8; 4]) -> String {
    let response = send(app, ip).await;
    let field = response
        .headers()
        .get("ratelimit")
        .expect("a RateLimit field");
    field.to_str().unwrap().to_owned()
}
