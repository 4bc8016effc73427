//! A fallback that knows its share: replicas that share a Redis count each other with a
//! heartbeat, and while Redis is away each checks a rule that falls back to the local limiter at
//! `1 / replicas` of its quota, so that the fleet keeps close to the quota, not K times it.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::{Request, StatusCode};
use support::{RedisServer, cluster, unique_prefix};
use tollgate::algorithm::Limits;
use tollgate::key::Key;
use tollgate::store::{Charge, RedisClusterStore, RedisStore, RuleSpec, Store};
use tollgate::{
    Algorithm, CircuitBreaker, FailureMode, FallbackShare, Quota, RateLimitLayer, Rule,
};
use tower::{Service, ServiceExt};

const BEAT: Duration = Duration::from_millis(200);

/// 100 a minute per client, checked locally while the store is away.
fn app<St: Store>(store: St, share: FallbackShare) -> Router {
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("api", Quota::per_minute(100)).on_store_error(FailureMode::Local))
        .store(store)
        .fallback_share(share)
        .build()
        .unwrap();
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
}

async fn status(app: &mut Router) -> StatusCode {
    let mut req = Request::get("/").body(Body::empty()).unwrap();
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::from(([10, 7, 0, 1], 40_000))));
    let response = app
        .as_service()
        .ready()
        .await
        .unwrap()
        .call(req)
        .await
        .unwrap();
    response.status()
}

/// `requests` requests of one client, in turn over `apps`: how many were admitted.
async fn admitted(apps: &mut [Router], requests: usize) -> usize {
    let mut admitted = 0;
    for i in 0..requests {
        let n = apps.len();
        match status(&mut apps[i % n]).await {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("unexpected {other}"),
        }
    }
    admitted
}

/// Waits (10 s at most) until every store counts `replicas`.
async fn counted<St: Store>(stores: &[St], replicas: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let counts: Vec<_> = stores.iter().map(Store::replicas).collect();
        if counts.iter().all(|c| *c == Some(replicas)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the stores count {counts:?}, not {replicas} each"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn store_builder(server_url: &str, prefix: &str) -> tollgate::store::RedisStoreBuilder {
    RedisStore::builder(server_url)
        .prefix(prefix)
        .heartbeat(BEAT)
        .response_timeout(Duration::from_millis(50))
        .connect_timeout(Duration::from_millis(200))
        .circuit_breaker(CircuitBreaker::after_failures(3).cooldown(Duration::from_millis(200)))
}

#[tokio::test]
async fn three_replicas_keep_the_fleet_to_its_quota_while_redis_is_down_and_share_it_again_after() {
    let server = RedisServer::start();
    let port = server.port;
    let prefix = unique_prefix("share");
    let mut stores = Vec::new();
    for _ in 0..3 {
        stores.push(
            store_builder(&server.url(), &prefix)
                .connect()
                .await
                .unwrap(),
        );
    }
    counted(&stores, 3).await;
    let mut shared: Vec<Router> = stores
        .iter()
        .map(|s| app(s.clone(), FallbackShare::default()))
        .collect();
    // The same replicas with each the whole quota, as before shares: for comparison.
    let mut whole: Vec<Router> = stores
        .iter()
        .map(|s| app(s.clone(), FallbackShare::whole()))
        .collect();

    server.stop();
    let by_share = admitted(&mut shared, 300).await;
    let by_whole = admitted(&mut whole, 300).await;
    eprintln!(
        "Redis down: the fleet admitted {by_share} of 300 by share, {by_whole} with the whole quota each"
    );
    // 33 on each of three replicas (100 / 3, rounded down), and what refills meanwhile
    // (a unit every 1.8 s on each).
    assert!(
        (99..=110).contains(&by_share),
        "three replicas by share admitted {by_share}"
    );
    assert!(by_whole >= 297, "the whole quota each admitted {by_whole}");
    assert_eq!(
        stores[0].replicas(),
        Some(3),
        "the count last read stands while Redis is away"
    );

    // A replica that starts while Redis is down has counted nothing: it assumes the fleet it
    // is told to, or 8 (`DEFAULT_UNTIL_COUNTED`: an eighth of the quota).
    let late = store_builder(&format!("redis://127.0.0.1:{port}"), &prefix)
        .build()
        .unwrap();
    assert_eq!(late.replicas(), None);
    let mut told = [app(
        late.clone(),
        FallbackShare::per_replica().until_counted(4),
    )];
    let mut untold = [app(late.clone(), FallbackShare::default())];
    // (and what refills meanwhile: a unit every 2.4 s, or 4.8 s)
    let (by_four, by_default) = (
        admitted(&mut told, 60).await,
        admitted(&mut untold, 150).await,
    );
    assert!((25..=26).contains(&by_four), "100 / 4: {by_four}");
    assert!(
        (12..=13).contains(&by_default),
        "100 / 8, the default: {by_default}"
    );

    // Redis is back (empty: it kept nothing on disk): limiting is fleet-wide again.
    let server = RedisServer::start_on(port, &[]).expect("restart on the same port");
    // Each store answers again once its breaker lets a probe through.
    let deadline = Instant::now() + Duration::from_secs(10);
    let spec = RuleSpec::new(
        "probe",
        Algorithm::TokenBucket,
        Limits::new(1000, 1_000_000, 1000).unwrap(),
    )
    .unwrap();
    let key = Key::text("probe");
    let look = [Charge {
        rule: &spec,
        key: &key,
        cost: 0,
    }];
    for store in &stores {
        while store.check(&look).await.is_err() {
            assert!(Instant::now() < deadline, "the stores reach Redis again");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let fleet_wide = admitted(&mut shared, 300).await;
    eprintln!("Redis back: the fleet admitted {fleet_wide} of 300");
    // Exactly the budget, unless a check of the 300 still found a connection not yet back
    // (then the spent local budget refused it).
    assert!(
        (90..=102).contains(&fleet_wide),
        "one budget for the fleet again: {fleet_wide}"
    );
    // The late replica reached Redis too, and is counted.
    counted(&[stores[0].clone(), late], 4).await;
    drop(server);
}

#[tokio::test]
async fn cluster_stores_count_each_other_and_a_replica_that_stops_lapses() {
    let cluster = cluster();
    let prefix = unique_prefix("share-cluster");
    let mut stores = Vec::new();
    for _ in 0..3 {
        stores.push(
            RedisClusterStore::builder(cluster.urls())
                .prefix(&prefix)
                .heartbeat(BEAT)
                .connect()
                .await
                .unwrap(),
        );
    }
    counted(&stores, 3).await;
    let key = format!("{prefix}:replicas");
    let members: u64 = redis::cmd("ZCARD")
        .arg(&key)
        .query(&mut cluster.conn_for(&key))
        .unwrap();
    assert_eq!(members, 3, "one member per replica in {key}");
    drop(stores.pop());
    // Three intervals without a beat, and the next beat of the others.
    counted(&stores, 2).await;
}

/// Waits (5 s at most) until `store` has counted, and returns its count.
async fn first_count<St: Store>(store: &St) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(count) = store.replicas() {
            return count;
        }
        assert!(Instant::now() < deadline, "the store never counted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_replica_that_beats_seldom_stays_counted_after_one_that_beats_often_stops() {
    let server = RedisServer::start();
    let prefix = unique_prefix("mixed-beats");
    let builder = |every: Duration| {
        RedisStore::builder(server.url())
            .prefix(&prefix)
            .heartbeat(every)
    };
    // One replica beats every 3 s (it lapses after 9 s), another every 100 ms (300 ms).
    let seldom = builder(Duration::from_secs(3)).connect().await.unwrap();
    assert_eq!(first_count(&seldom).await, 1);
    let often = builder(Duration::from_millis(100)).connect().await.unwrap();
    counted(std::slice::from_ref(&often), 2).await;
    // The frequent one stops; its member lapses after 300 ms, the other's does not.
    drop(often);
    tokio::time::sleep(Duration::from_millis(700)).await;
    // A replica that joins now, before the seldom one beats again, counts it and itself.
    let joined = builder(Duration::from_millis(100)).connect().await.unwrap();
    assert_eq!(
        first_count(&joined).await,
        2,
        "the replica that beats every 3 s is still counted"
    );
}

/// A store that is always down, and whose count of replicas the test sets.
#[derive(Clone, Default)]
struct DownCounting(std::sync::Arc<std::sync::atomic::AtomicU32>);

impl Store for DownCounting {
    type Future = std::future::Ready<Result<tollgate::Decision, tollgate::store::StoreError>>;

    fn check(&self, _: &[Charge<'_>]) -> Self::Future {
        std::future::ready(Err(tollgate::store::StoreError::Timeout))
    }

    fn replicas(&self) -> Option<u32> {
        Some(self.0.load(std::sync::atomic::Ordering::SeqCst))
    }

    fn counts_replicas(&self) -> bool {
        true
    }
}

/// A charge the fallback made at one share is settled at that share, though the count of
/// replicas changed while its response was out: 100 a minute is 50 a minute on each of 2
/// replicas and 10 on each of 10, so one unit given back at the share of 10 would refill
/// five times what the share of 2 charged.
#[tokio::test]
async fn a_fallback_charge_is_settled_at_the_share_it_was_made_at() {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;

    let store = DownCounting::default();
    store.0.store(2, Ordering::SeqCst);
    let released = Arc::new(tokio::sync::Notify::new());
    let layer = RateLimitLayer::builder()
        .rule(
            Rule::new("logins", Quota::per_minute(100))
                .charge_on_status([401])
                .on_store_error(FailureMode::Local),
        )
        .store(store.clone())
        .build()
        .unwrap();
    let held = released.clone();
    let app = Router::new()
        .route("/failed", get(|| async { StatusCode::UNAUTHORIZED }))
        .route(
            "/held",
            get(move || {
                let held = held.clone();
                async move {
                    held.notified().await;
                    StatusCode::OK
                }
            }),
        )
        .layer(layer);
    let send = |path: &'static str| {
        let app = app.clone();
        async move {
            let mut req = Request::get(path).body(Body::empty()).unwrap();
            req.extensions_mut()
                .insert(ConnectInfo(SocketAddr::from(([10, 7, 0, 2], 40_000))));
            app.oneshot(req).await.unwrap().status()
        }
    };
    // At a share of 50: 49 failed logins are charged, then one more request is held.
    for _ in 0..49 {
        assert_eq!(send("/failed").await, StatusCode::UNAUTHORIZED);
    }
    let out = tokio::spawn(send("/held"));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        send("/failed").await,
        StatusCode::TOO_MANY_REQUESTS,
        "the share is spent"
    );
    // The fleet grows to 10 while the held request is out; it ends with a 200, so its unit
    // comes back: at the share it was charged at, a fiftieth of a minute.
    store.0.store(10, Ordering::SeqCst);
    released.notify_one();
    assert_eq!(out.await.unwrap(), StatusCode::OK);
    assert_eq!(
        send("/failed").await,
        StatusCode::TOO_MANY_REQUESTS,
        "a unit given back at the share it was charged at refills no more than it took"
    );
}
