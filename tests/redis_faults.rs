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
use tollgate::CircuitBreaker;
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

/// A layer on a Redis behind `proxy`. Its store keeps no denials: these tests watch what each
/// failure mode does with requests the store would be asked about (a denial Redis made stays
/// one while Redis is away: `tests/redis_hot_keys.rs`).
async fn app_behind(proxy: &FaultProxy, rules: Vec<Rule>, breaker: CircuitBreaker) -> Router {
    let store = RedisStore::builder(proxy.url())
        .prefix(unique_prefix("faults"))
        .response_timeout(Duration::from_millis(50))
        .circuit_breaker(breaker)
        .deny_cache(0)
        .connect()
        .await
        .unwrap();
    app_with(store, rules)
}

fn app_with<St: Store>(store: St, rules: Vec<Rule>) -> Router {
    let layer = RateLimitLayer::builder()
        .rules(rules)
        .store(store)
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
            .circuit_breaker(CircuitBreaker::disabled())
            .deny_cache(0)
            .connect()
            .await
            .unwrap()
    };
    let store = || store_with(unique_prefix("cluster-faults"));
    let local_prefix = unique_prefix("cluster-faults");
    let mut strict = app_with(
        store().await,
        vec![
            Rule::new("login", Quota::per_hour(100)).on_store_error(FailureMode::Closed),
            Rule::new("api", Quota::per_hour(100)),
        ],
    );
    let mut lenient = app_with(store().await, vec![Rule::new("api", Quota::per_hour(1))]);
    let mut local = app_with(
        store_with(local_prefix.clone()).await,
        vec![Rule::new("local", Quota::per_hour(2)).on_store_error(FailureMode::Local)],
    );
    let mut counted = app_with(store().await, vec![Rule::new("once", Quota::per_hour(10))]);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_check_whose_reply_is_lost_is_charged_exactly_once() {
    use tollgate::Algorithm;
    use tollgate::algorithm::Limits;
    use tollgate::key::Key;
    use tollgate::store::{Charge, RuleSpec};

    let (cluster, proxies) = support::fault_proxy::cluster_behind_proxies().await;
    let urls: Vec<String> = proxies.iter().map(FaultProxy::url).collect();
    let store = RedisClusterStore::builder(urls)
        .prefix(unique_prefix("once"))
        .response_timeout(Duration::from_secs(3))
        .connect()
        .await
        .unwrap();
    let hour = Limits::new(100, 3_600_000_000, 100).unwrap();
    let rule = RuleSpec::new("once", Algorithm::FixedWindow, hour).unwrap();
    let key = Key::text("lost-reply");
    let charge = [Charge {
        rule: &rule,
        key: &key,
        cost: 1,
    }];
    assert!(store.check(&charge).await.unwrap().allowed());

    let name = store.key_name("once", &key);
    let slot: u16 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(&name)
        .query(&mut cluster.nodes[0].conn())
        .unwrap();
    let slots: redis::Value = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query(&mut cluster.nodes[0].conn())
        .unwrap();
    let owner = (0..3)
        .find(|&i| support::owns(&slots, slot, proxies[i].port))
        .expect("a node owns the slot");
    let count = || -> u64 {
        let value: String = redis::cmd("GET")
            .arg(&name)
            .query(&mut cluster.nodes[owner].conn())
            .unwrap();
        value.split(':').nth(1).unwrap().parse().unwrap()
    };
    assert_eq!(count(), 1);

    // The next check reaches Redis, and the link is cut before its reply comes back. The link
    // heals 300 ms later, well within the check's budget: a client that re-sent the script
    // would charge it twice.
    proxies[owner].cut_after_next_check();
    let heal = async {
        while !proxies[owner].has_cut() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        proxies[owner].set_cut(false);
    };
    let (result, ()) = tokio::join!(store.check(&charge), heal);
    assert!(
        result.is_err(),
        "a check whose reply was lost cannot know its outcome: {result:?}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(count(), 2, "the lost check ran exactly once");
    // And the store is usable again.
    assert!(store.check(&charge).await.unwrap().allowed());
    assert_eq!(count(), 3);
}

#[tokio::test]
async fn a_short_stall_replaces_no_connection() {
    use tollgate::Algorithm;
    use tollgate::algorithm::Limits;
    use tollgate::key::Key;
    use tollgate::store::{Charge, RuleSpec};

    // A Redis that stalls for a moment (a fork, an fsync) on a link that is fine: the checks
    // caught in the stall time out, and nothing else happens. The pooled multiplexed
    // connections are kept; replacing them would only add reconnects to the stall.
    let proxy = FaultProxy::start(standalone().port).await;
    let store = RedisStore::builder(proxy.url())
        .prefix(unique_prefix("stall"))
        .pool_size(2)
        .response_timeout(Duration::from_millis(50))
        // Ten failures fit the breaker's budget: it stays closed through the stall.
        .circuit_breaker(CircuitBreaker::after_failures(20))
        .connect()
        .await
        .unwrap();
    let hour = Limits::new(1000, 3_600_000_000, 1000).unwrap();
    let rule = RuleSpec::new("stall", Algorithm::TokenBucket, hour).unwrap();
    let key = Key::text("stalled");
    let charge = [Charge {
        rule: &rule,
        key: &key,
        cost: 1,
    }];
    for _ in 0..10 {
        assert!(store.check(&charge).await.unwrap().allowed());
    }
    // The pool's 2, the first connection, which loaded the script, and the one that listens
    // for the keys other replicas forget.
    let connections = proxy.connections_accepted();
    assert!(
        connections <= 4,
        "{connections} connections for a pool of 2"
    );

    // Two stalls: checks one at a time, then eight in flight at once.
    proxy.set_delay(Duration::from_millis(120));
    for _ in 0..2 {
        assert!(matches!(
            store.check(&charge).await,
            Err(tollgate::store::StoreError::Timeout)
        ));
    }
    let in_flight = futures_util::future::join_all((0..8).map(|_| store.check(&charge))).await;
    assert!(
        in_flight
            .iter()
            .all(|r| matches!(r, Err(tollgate::store::StoreError::Timeout)))
    );
    proxy.set_delay(Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(300)).await; // the stalled replies drain
    for _ in 0..20 {
        assert!(store.check(&charge).await.unwrap().allowed());
    }
    assert_eq!(
        proxy.connections_accepted(),
        connections,
        "a stall reconnected"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthy_slots_keep_answering_while_a_primary_fails_over() {
    use std::sync::Arc;
    use std::time::Instant;
    use tollgate::Algorithm;
    use tollgate::algorithm::Limits;
    use tollgate::key::Key;
    use tollgate::store::{Charge, RuleSpec};

    // 3 primaries, a replica each; a primary that stops answering for 1 s is replaced. The
    // cluster serves the slots it covers while one is not covered: with Redis' default
    // (cluster-require-full-coverage yes) every node answers CLUSTERDOWN until the failover
    // completes, whatever the client does.
    let cluster = tokio::task::spawn_blocking(|| {
        RedisCluster::start_with(1, 1000, &["--cluster-require-full-coverage", "no"])
    })
    .await
    .unwrap();
    let store = RedisClusterStore::builder(cluster.urls())
        .prefix(unique_prefix("failover"))
        .connect()
        .await
        .unwrap();
    let hour = Limits::new(1_000_000, 3_600_000_000, 1_000_000).unwrap();
    let rule = Arc::new(RuleSpec::new("fo", Algorithm::TokenBucket, hour).unwrap());

    // One key on each primary; the first primary is the victim.
    let mut keys: Vec<(usize, Key)> = Vec::new();
    for n in 0.. {
        let key = Key::text(format!("client-{n}"));
        let name = store.key_name("fo", &key);
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(&name)
            .query(&mut cluster.nodes[0].conn())
            .unwrap();
        let primary = cluster.primary_of(slot).unwrap();
        if !keys.iter().any(|(p, _)| *p == primary) {
            keys.push((primary, key));
        }
        if keys.len() == 3 {
            break;
        }
    }
    let (victim, victim_key) = keys[0].clone();
    let healthy: Vec<Key> = keys[1..].iter().map(|(_, k)| k.clone()).collect();
    let check = |key: Key| {
        let (store, rule) = (store.clone(), rule.clone());
        async move {
            let started = Instant::now();
            let charge = [Charge {
                rule: &rule,
                key: &key,
                cost: 1,
            }];
            let result = store.check(&charge).await;
            (result.is_ok(), started.elapsed())
        }
    };
    for key in keys.iter().map(|(_, k)| k) {
        assert!(
            check(key.clone()).await.0,
            "every slot answers before the kill"
        );
    }

    cluster.nodes[victim].kill9();
    let killed = Instant::now();
    let mut healthy_ok = 0;
    let mut healthy_total = 0;
    let mut slowest = Duration::ZERO;
    let mut victim_back = None;
    while killed.elapsed() < Duration::from_secs(8) {
        for key in &healthy {
            let (ok, took) = check(key.clone()).await;
            healthy_total += 1;
            healthy_ok += usize::from(ok);
            slowest = slowest.max(took);
        }
        let (ok, _) = check(victim_key.clone()).await;
        if ok && victim_back.is_none() {
            victim_back = Some(killed.elapsed());
        }
        if victim_back.is_some() && killed.elapsed() > Duration::from_secs(4) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    eprintln!(
        "healthy checks answered: {healthy_ok}/{healthy_total}, slowest {slowest:?}; \
         the failed-over slot answered again after {victim_back:?}"
    );
    assert!(
        healthy_ok * 100 >= healthy_total * 99,
        "healthy slots stalled while a primary failed over: {healthy_ok}/{healthy_total} answered"
    );
    assert!(
        victim_back.is_some(),
        "the failed-over slot never answered again"
    );
}
