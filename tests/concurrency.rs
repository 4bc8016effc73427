//! Concurrency limits on the memory store, a standalone Redis and a 3-primary cluster: never
//! more requests in flight than the limit over several replicas, every slot free afterwards
//! (bodies read to the end, streamed, or dropped by a client that leaves), slots of a replica
//! that dies (its responses forgotten, or its process killed) free after the longest hold,
//! slots taken for a request that went away mid-check given back (also when it, or a body
//! holding slots, is dropped on a thread without a Tokio runtime), stacking with rate rules
//! all or nothing, and the answers a client gets.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::{Request, Response};
use http_body_util::BodyExt;
use tollgate::key::{Global, Key};
use tollgate::store::{MemoryStore, RedisClusterStore, RedisStore, Store};
use tollgate::testing::Budget;
use tollgate::{Quota, RateLimitLayer, Rule};
use tower::ServiceExt;

fn request(path: &str) -> Request<Body> {
    let mut req = Request::get(path).body(Body::empty()).unwrap();
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::from(([10, 9, 0, 1], 40_000))));
    req
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

/// Requests in flight, from the handler's start to the end (or drop) of the body, and the most
/// there ever were.
#[derive(Clone, Default)]
struct InFlight {
    now: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
}

impl InFlight {
    fn enter(&self) -> Leaving {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        Leaving(self.now.clone())
    }
}

/// Counts a request out when dropped.
struct Leaving(Arc<AtomicUsize>);

impl Drop for Leaving {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A replica: `/slow` answers after a moment with a body of one chunk; `/stream` streams five
/// chunks, a moment apart. A request counts as in flight until its body is done.
fn replica<St: Store>(store: St, rule: Rule, in_flight: InFlight) -> Router {
    let layer = RateLimitLayer::builder()
        .rule(rule)
        .store(store)
        .build()
        .unwrap();
    let slow = in_flight.clone();
    let stream = in_flight;
    Router::new()
        .route(
            "/slow",
            get(move || {
                let leaving = slow.enter();
                async move {
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    let stream = futures_util::stream::once(async move {
                        let _leaving = leaving;
                        Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"done"))
                    });
                    Body::from_stream(stream)
                }
            }),
        )
        .route(
            "/stream",
            get(move || {
                let leaving = stream.enter();
                async move {
                    let chunks = futures_util::stream::unfold(
                        (0, Some(leaving)),
                        |(i, leaving)| async move {
                            if i == 5 {
                                drop(leaving);
                                return None;
                            }
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            Some((
                                Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"chunk")),
                                (i + 1, leaving),
                            ))
                        },
                    );
                    Body::from_stream(chunks)
                }
            }),
        )
        .layer(layer)
}

/// How a client reads its answer.
#[derive(Clone, Copy, Debug)]
enum Reading {
    /// To the end.
    Whole,
    /// The first frame, then it leaves.
    Leaves,
}

async fn send(app: &Router, path: &str, reading: Reading) -> u16 {
    let response: Response<Body> = app.clone().oneshot(request(path)).await.unwrap();
    let status = response.status().as_u16();
    let mut body = response.into_body();
    match reading {
        Reading::Whole => while body.frame().await.is_some() {},
        Reading::Leaves => {
            body.frame().await;
        }
    }
    status
}

/// 200 concurrent requests of one client over 3 replicas against 20 slots: never more than 20
/// in flight, and all of them free afterwards, whether bodies are read, streamed or left.
async fn never_more_than_the_limit<St: Store + Clone>(store: St, name: &str) -> Vec<u16> {
    let rule = Rule::concurrent("in-flight", 20);
    let in_flight = InFlight::default();
    let replicas: Vec<Router> = (0..3)
        .map(|_| replica(store.clone(), rule.clone(), in_flight.clone()))
        .collect();
    let mut statuses = Vec::new();
    for (path, reading) in [
        ("/slow", Reading::Whole),
        ("/stream", Reading::Whole),
        ("/stream", Reading::Leaves),
    ] {
        let calls = (0..200).map(|i| send(&replicas[i % 3], path, reading));
        let round: Vec<u16> = futures_util::future::join_all(calls).await;
        assert!(
            round.iter().all(|s| *s == 200 || *s == 429),
            "{name}: {round:?}"
        );
        let admitted = round.iter().filter(|s| **s == 200).count();
        assert!(
            admitted >= 20,
            "{name} {path} {reading:?}: {admitted} admitted"
        );
        statuses.extend(round);
        assert_eq!(in_flight.now.load(Ordering::SeqCst), 0, "{name}");
    }
    let most = in_flight.most.load(Ordering::SeqCst);
    assert!(most <= 20, "{name}: {most} in flight at once");
    assert!(most >= 10, "{name}: only {most} in flight at once");
    statuses
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_more_in_flight_than_the_limit_and_every_slot_free_after() {
    let (memory, redis, cluster) = stores("in-flight").await;
    never_more_than_the_limit(memory.clone(), "memory").await;
    let layer = RateLimitLayer::builder()
        .rule(Rule::concurrent("in-flight", 20))
        .store(memory)
        .build()
        .unwrap();
    let client = Key::ip("10.9.0.1".parse().unwrap());
    assert_eq!(
        layer
            .limiter()
            .peek("in-flight", &client)
            .await
            .unwrap()
            .remaining,
        20,
        "memory: every slot free"
    );

    never_more_than_the_limit(redis.clone(), "redis").await;
    let held = redis.key_name("in-flight", &client);
    // Slots are given back on the runtime when a body ends: a moment for the last ones.
    let mut exists = 1;
    for _ in 0..100 {
        let mut conn = support::standalone().conn();
        exists = redis::cmd("EXISTS").arg(&held).query(&mut conn).unwrap();
        if exists == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(exists, 0, "redis: the list of held slots is gone");

    never_more_than_the_limit(cluster.clone(), "cluster").await;
    let held = cluster.key_name("in-flight", &client);
    let mut exists = 1;
    for _ in 0..100 {
        let mut conn = support::cluster().conn_for(&held);
        exists = redis::cmd("EXISTS").arg(&held).query(&mut conn).unwrap();
        if exists == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(exists, 0, "cluster: the list of held slots is gone");
}

/// A replica that dies holding slots (its requests never end: their slots are never given
/// back) leaks them for the longest hold, no longer.
#[tokio::test]
async fn the_slots_of_a_replica_that_died_are_free_after_the_longest_hold() {
    let (_, redis, cluster) = stores("died").await;
    async fn run<St: Store + Clone>(store: St, name: &str) {
        let rule = Rule::concurrent("held", 3)
            .key(Global)
            .max_hold(Duration::from_secs(1));
        let app = replica(store.clone(), rule.clone(), InFlight::default());
        // The dead replica's requests: admitted, then never finished.
        for _ in 0..3 {
            let response = app.clone().oneshot(request("/slow")).await.unwrap();
            assert_eq!(response.status(), 200, "{name}");
            std::mem::forget(response);
        }
        let other = replica(store, rule, InFlight::default());
        assert_eq!(send(&other, "/slow", Reading::Whole).await, 429, "{name}");
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        assert_eq!(send(&other, "/slow", Reading::Whole).await, 200, "{name}");
    }
    run(redis, "redis").await;
    run(cluster, "cluster").await;
}

/// A concurrency rule stacked with a rate rule: a request the rate rule denies takes no slot,
/// one denied a slot is charged nothing by the rate rule.
#[tokio::test]
async fn stacked_with_a_rate_rule_all_or_nothing() {
    let (memory, redis, cluster) = stores("stacked").await;
    async fn run<St: Store + Clone>(store: St, name: &str) {
        let layer = RateLimitLayer::builder()
            .rule(Rule::concurrent("searches-in-flight", 2).key(Global))
            .rule(Rule::new("searches", Quota::per_hour(3)).key(Global))
            .store(store)
            .build()
            .unwrap();
        let limiter = layer.limiter();
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer);
        // Two responses held open: both slots taken, two of three searches spent.
        let first = app.clone().oneshot(request("/")).await.unwrap();
        let second = app.clone().oneshot(request("/")).await.unwrap();
        assert_eq!(
            (first.status().as_u16(), second.status().as_u16()),
            (200, 200),
            "{name}"
        );
        // Denied a slot: no search is charged.
        let third = app.clone().oneshot(request("/")).await.unwrap();
        assert_eq!(third.status(), 429, "{name}");
        let budget = Budget::of(third.headers()).unwrap();
        assert_eq!(budget.retry_after, Some(1), "{name}");
        assert_eq!(
            limiter
                .peek("searches", &Key::global())
                .await
                .unwrap()
                .remaining,
            1,
            "{name}: denied a slot, charged no search"
        );
        drop((first, second));
        // The slots come back (on the runtime, for a remote store).
        let mut free = 0;
        for _ in 0..100 {
            free = limiter
                .peek("searches-in-flight", &Key::global())
                .await
                .unwrap()
                .remaining;
            if free == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(free, 2, "{name}");
        // The last search: admitted, and its slot given back.
        assert_eq!(send(&app, "/", Reading::Whole).await, 200, "{name}");
        // Searches spent: denied, and no slot taken.
        let denied = app.clone().oneshot(request("/")).await.unwrap();
        assert_eq!(denied.status(), 429, "{name}");
        for _ in 0..100 {
            free = limiter
                .peek("searches-in-flight", &Key::global())
                .await
                .unwrap()
                .remaining;
            if free == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(free, 2, "{name}: a request denied a search holds no slot");
    }
    run(memory, "memory").await;
    run(redis, "redis").await;
    run(cluster, "cluster").await;
}

/// What a client is told: the policy's unit and the free slots, and a second to wait.
#[tokio::test]
async fn the_answers_say_concurrent_requests_and_the_free_slots() {
    let layer = RateLimitLayer::builder()
        .rule(Rule::concurrent("in-flight", 2).key(Global))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let first = app.clone().oneshot(request("/")).await.unwrap();
    assert_eq!(
        first.headers()["ratelimit-policy"],
        "\"in-flight\";q=2;qu=\"concurrent-requests\""
    );
    assert_eq!(first.headers()["ratelimit"], "\"in-flight\";r=1");
    let second = app.clone().oneshot(request("/")).await.unwrap();
    assert_eq!(second.headers()["ratelimit"], "\"in-flight\";r=0");
    let denied = app.clone().oneshot(request("/")).await.unwrap();
    assert_eq!(denied.status(), 429);
    assert_eq!(denied.headers()["retry-after"], "1");
    assert_eq!(denied.headers()["ratelimit"], "\"in-flight\";r=0");
    let budget = Budget::of(denied.headers()).unwrap();
    assert_eq!(
        budget.policies[0].unit.as_deref(),
        Some("concurrent-requests")
    );
    assert_eq!(budget.limits[0].reset, None);
    // A body read to its end gives its slot back.
    let body = first.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"ok");
    let again = app.clone().oneshot(request("/")).await.unwrap();
    assert_eq!(again.status(), 200);
    assert_eq!(again.headers()["ratelimit"], "\"in-flight\";r=0");
    drop(second);
    drop(again);
}

/// A request whose inner service fails, or whose client leaves before the answer, gives its
/// slot back too.
#[tokio::test]
async fn a_request_that_never_answers_gives_its_slot_back() {
    let layer = RateLimitLayer::builder()
        .rule(Rule::concurrent("in-flight", 1).key(Global))
        .build()
        .unwrap();
    let limiter = layer.limiter();
    let failing = tower::service_fn(|_: Request<Body>| async {
        Err::<Response<Body>, std::io::Error>(std::io::Error::other("the handler failed"))
    });
    let service = tower::Layer::layer(&layer, failing);
    assert!(service.oneshot(request("/")).await.is_err());
    assert_eq!(
        limiter
            .peek("in-flight", &Key::global())
            .await
            .unwrap()
            .remaining,
        1
    );
    let slow = tower::service_fn(|_: Request<Body>| async {
        tokio::time::sleep(Duration::from_secs(30)).await;
        Ok::<_, std::io::Error>(Response::new(Body::empty()))
    });
    let service = tower::Layer::layer(&layer, slow);
    let call = service.oneshot(request("/"));
    assert!(
        tokio::time::timeout(Duration::from_millis(20), call)
            .await
            .is_err()
    );
    assert_eq!(
        limiter
            .peek("in-flight", &Key::global())
            .await
            .unwrap()
            .remaining,
        1
    );
}

#[test]
fn concurrency_rules_that_cannot_work_are_refused_at_build_time() {
    let error = |rule: Rule| {
        RateLimitLayer::builder()
            .rule(rule)
            .build()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert!(error(Rule::concurrent("c", 5).lease(2)).contains("concurrency"));
    assert!(error(Rule::concurrent("c", 5).split(2)).contains("concurrency"));
    assert!(error(Rule::concurrent("c", 5).charge_on_status([500])).contains("concurrency"));
    assert!(error(Rule::concurrent("c", 5).max_hold(Duration::from_millis(10))).contains("1 s"));
    assert!(error(Rule::concurrent("c", 20_000)).contains("10000"));
    assert!(error(Rule::concurrent("c", 5).delay(Duration::from_secs(1))).contains("cannot delay"));
    assert!(
        error(Rule::new("r", Quota::per_minute(5)).max_hold(Duration::from_secs(5)))
            .contains("max_hold")
    );
}

/// A check whose request goes away while Redis takes its slot (the client left, or the check's
/// time budget ran out with the call still on its way) gives the slot back: nothing is held for
/// the longest hold by a request that is gone.
#[tokio::test]
async fn a_slot_taken_for_a_request_that_went_away_is_given_back() {
    use tollgate::store::Charge;

    let (rule, key) = one_slot("orphans", "orphan");
    let charges = [Charge {
        rule: &rule,
        key: &key,
        cost: 1,
    }];

    // Standalone, behind a proxy that delays every chunk by 100 ms.
    let proxy = support::fault_proxy::FaultProxy::start(support::standalone().port).await;
    let slow = RedisStore::builder(proxy.url())
        .prefix(support::unique_prefix("orphans"))
        .response_timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap();
    let timed_out = RedisStore::builder(proxy.url())
        .prefix(support::unique_prefix("orphans"))
        .response_timeout(Duration::from_millis(150))
        .connect()
        .await
        .unwrap();
    // Both connected, and their code loaded, before the link slows down.
    admits_again(&slow, &charges, "slow").await;
    admits_again(&timed_out, &charges, "timed out").await;
    let before = proxy.checks_delivered();
    proxy.set_delay(Duration::from_millis(100));
    // The client leaves 20 ms into its check: the call is on its way and takes the slot.
    let left = tokio::time::timeout(Duration::from_millis(20), slow.check(&charges)).await;
    assert!(left.is_err(), "the check was still out");
    // Its time budget runs out while the call is out.
    assert!(matches!(
        timed_out.check(&charges).await,
        Err(tollgate::store::StoreError::Timeout)
    ));
    proxy.set_delay(Duration::ZERO);
    assert_eq!(
        proxy.checks_delivered() - before,
        2,
        "both checks reached Redis"
    );
    for (name, store) in [("left", &slow), ("timed out", &timed_out)] {
        admits_again(store, &charges, name).await;
    }

    // A cluster: the check is dropped before it is even polled.
    let cluster = RedisClusterStore::builder(support::cluster().urls())
        .prefix(support::unique_prefix("orphans"))
        .response_timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    let before = cluster_calls();
    for _ in 0..5 {
        drop(cluster.check(&charges));
    }
    admits_again(&cluster, &charges, "cluster").await;
    // The dropped checks did reach the cluster (and the slot taken was given back).
    assert!(
        cluster_calls() >= before + 6,
        "the dropped checks were never sent"
    );
}

/// Calls of tollgate's code on every primary of the test cluster so far.
fn cluster_calls() -> u64 {
    support::cluster()
        .urls()
        .iter()
        .map(|url| {
            let mut conn = redis::Client::open(url.as_str())
                .unwrap()
                .get_connection()
                .unwrap();
            let command = if support::server().has_functions() {
                "fcall"
            } else {
                "evalsha"
            };
            support::command_calls(&mut conn, command)
        })
        .sum()
}

/// A request whose rules span several slots, one of them paid from a lease here, gives its
/// slot back at the time its own node took it: ten rounds of one slot never find it held.
#[tokio::test]
async fn a_cluster_slot_is_given_back_at_its_own_nodes_time_beside_a_leased_rule() {
    use tollgate::algorithm::Limits;
    use tollgate::store::{Adjustment, Change, Charge, RuleSpec};

    let cluster = RedisClusterStore::builder(support::cluster().urls())
        .prefix(support::unique_prefix("leased-beside"))
        .response_timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    let leased = RuleSpec::new(
        "leased",
        tollgate::Algorithm::TokenBucket,
        Limits::new(1_000, 60_000_000, 1_000).unwrap(),
    )
    .unwrap()
    .with_lease(50, Duration::from_secs(30))
    .unwrap();
    let plain = RuleSpec::new(
        "plain",
        tollgate::Algorithm::TokenBucket,
        Limits::new(1_000, 60_000_000, 1_000).unwrap(),
    )
    .unwrap();
    let slots = RuleSpec::new(
        "one-slot",
        tollgate::Algorithm::Concurrency,
        Limits::new(1, 60_000_000, 1).unwrap(),
    )
    .unwrap();
    for round in 0..10 {
        // Keys in other slots each round, so that the node order of the call changes.
        let keys = [
            Key::text(format!("a-{round}")),
            Key::text(format!("b-{round}")),
            Key::text(format!("c-{round}")),
        ];
        for step in 0..3 {
            let charges = [
                Charge {
                    rule: &leased,
                    key: &keys[0],
                    cost: 1,
                },
                Charge {
                    rule: &plain,
                    key: &keys[1],
                    cost: 1,
                },
                Charge {
                    rule: &slots,
                    key: &keys[2],
                    cost: 1,
                },
            ];
            let decision = cluster.check(&charges).await.unwrap();
            assert!(
                decision.allowed(),
                "round {round}, step {step}: the slot is held"
            );
            cluster
                .adjust(&[Adjustment {
                    rule: &slots,
                    key: &keys[2],
                    change: Change::Refund(1),
                    charged_at: decision.charged_at(2),
                }])
                .await
                .unwrap();
        }
    }
}

/// A request whose check's reply came, unread, and that is then dropped on a thread with no
/// Tokio runtime (a client's future dropped by another executor) still gives the slot back: the
/// give-back runs on the runtime that received the reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_of_a_request_dropped_outside_a_runtime_is_given_back() {
    use tollgate::store::Charge;

    let (rule, key) = one_slot("dropped-elsewhere", "dropped-elsewhere");
    let charges = [Charge {
        rule: &rule,
        key: &key,
        cost: 1,
    }];
    let (_, standalone, cluster) = stores("dropped-elsewhere").await;
    drop_unread_elsewhere(&standalone, &charges, "redis").await;
    drop_unread_elsewhere(&cluster, &charges, "cluster").await;
}

/// A response whose body holds a slot, dropped on a thread with no Tokio runtime (a body handed
/// to another executor), gives the slot back: at once on the memory store, where it is dropped
/// (this runtime of one thread runs nothing else meanwhile), and on the runtime the request was
/// served on for Redis and a cluster.
#[tokio::test]
async fn a_slot_held_by_a_body_dropped_outside_a_runtime_is_given_back() {
    let (memory, redis, cluster) = stores("body-dropped-elsewhere").await;
    body_dropped_elsewhere(memory, "memory").await;
    body_dropped_elsewhere(redis, "redis").await;
    body_dropped_elsewhere(cluster, "cluster").await;
}

/// A body read to its end gives its slot back before the next request of its client is
/// checked, on every store: a client that sends its next request at once, the body still in
/// hand, is admitted (the give-back's call leaves as the body ends, ahead of the next check).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_of_a_body_read_to_its_end_is_free_for_the_next_request() {
    let (memory, redis, cluster) = stores("next-request").await;
    next_request_admitted(memory, "memory").await;
    next_request_admitted(redis, "redis").await;
    next_request_admitted(cluster, "cluster").await;
}

/// Reads bodies that hold the one slot of a rule on `store` to their end, each request sent
/// as soon as the one before ended, whose body is kept until then.
async fn next_request_admitted<St: Store>(store: St, name: &str) {
    let rule = Rule::concurrent("next-request", 1).key(Global);
    let app = replica(store, rule, InFlight::default());
    let mut kept = None;
    for i in 0..20 {
        let response = app.clone().oneshot(request("/slow")).await.unwrap();
        assert_eq!(
            response.status(),
            200,
            "{name}: request {i}, sent when the one before ended"
        );
        let mut body = response.into_body();
        while body.frame().await.is_some() {}
        // Kept until the next one is checked: its end, not its drop, gives the slot back.
        kept = Some(body);
    }
    drop(kept);
}

/// Holds the one slot of a rule on `store` in a response's body, drops the response on a
/// thread of its own, and waits for the slot to be free again.
async fn body_dropped_elsewhere<St: Store>(store: St, name: &str) {
    let rule = Rule::concurrent("body-elsewhere", 1).key(Global);
    let app = replica(store, rule, InFlight::default());
    let response: Response<Body> = app.clone().oneshot(request("/slow")).await.unwrap();
    assert_eq!(response.status(), 200, "{name}");
    assert_eq!(
        send(&app, "/slow", Reading::Whole).await,
        429,
        "{name}: the body holds the slot"
    );
    std::thread::spawn(move || drop(response)).join().unwrap();
    if name == "memory" {
        // Decided in the call, before anything else runs here.
        assert_eq!(
            send(&app, "/slow", Reading::Whole).await,
            200,
            "{name}: given back at once, where the body was dropped"
        );
        return;
    }
    let start = std::time::Instant::now();
    while send(&app, "/slow", Reading::Whole).await != 200 {
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{name}: the slot of a body dropped outside a runtime is still held"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A concurrency rule `name` of one slot (held at most 60 s), and the key `key`.
fn one_slot(name: &str, key: &str) -> (tollgate::store::RuleSpec, Key) {
    let rule = tollgate::store::RuleSpec::new(
        name,
        tollgate::Algorithm::Concurrency,
        tollgate::algorithm::Limits::new(1, 60_000_000, 1).unwrap(),
    )
    .unwrap();
    (rule, Key::text(key))
}

/// Sends a check of `charges` (one slot of a limit of one), lets its reply come without reading
/// it, drops it on a thread of its own, and waits for the slot to be free again.
async fn drop_unread_elsewhere<St: Store>(
    store: &St,
    charges: &[tollgate::store::Charge<'_>],
    name: &str,
) {
    // Connected, and the code loaded.
    admits_again(store, charges, name).await;
    let mut attempts = 0;
    let check = loop {
        let mut check = Box::pin(store.check(charges));
        // Polled once: sent (a cluster's check was sent already, and may have been answered).
        let polled = std::future::poll_fn(|cx| {
            std::task::Poll::Ready(std::future::Future::poll(check.as_mut(), cx))
        })
        .await;
        match polled {
            std::task::Poll::Pending => break check,
            std::task::Poll::Ready(decision) => {
                // Read at once: nothing left unread. Its slot back, and again.
                refund(store, charges, &decision.unwrap()).await;
                attempts += 1;
                assert!(
                    attempts < 10,
                    "{name}: every check was answered at its first poll"
                );
            }
        }
    };
    // Its reply comes, and takes the slot; nothing reads it. Redis holds the slot before it
    // replies, and the reply takes moments more.
    let start = std::time::Instant::now();
    while store.peek(charges).await.unwrap().outcomes()[0].remaining > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{name}: the check never took the slot"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    std::thread::spawn(move || drop(check)).join().unwrap();
    admits_again(store, charges, name).await;
}

/// Gives back the slot `decision` took for `charges`.
async fn refund<St: Store>(
    store: &St,
    charges: &[tollgate::store::Charge<'_>],
    decision: &tollgate::Decision,
) {
    if decision.allowed() {
        let refund = [tollgate::store::Adjustment {
            rule: charges[0].rule,
            key: charges[0].key,
            change: tollgate::store::Change::Refund(1),
            charged_at: decision.charged_at(0),
        }];
        store.adjust(&refund).await.unwrap();
    }
}

/// Waits up to 3 s for the one slot to be free again (given back on the runtime), then takes
/// and gives it back.
async fn admits_again<St: Store>(store: &St, charges: &[tollgate::store::Charge<'_>], name: &str) {
    let start = std::time::Instant::now();
    loop {
        let decision = store.check(charges).await.unwrap();
        if decision.allowed() {
            refund(store, charges, &decision).await;
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{name}: the slot of a request that went away is still held"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A slot given back by a request decided under an older policy (a shorter longest hold)
/// takes only its own slot: the slots of requests decided under the new one stay held. And a
/// request may take thousands of slots at once.
#[tokio::test]
async fn a_give_back_under_an_older_policy_takes_only_its_own_slot() {
    use tollgate::algorithm::Limits;
    use tollgate::clock::ManualClock;
    use tollgate::store::{Adjustment, Change, Charge, RuleSpec};

    let old = RuleSpec::new(
        "reloaded",
        tollgate::Algorithm::Concurrency,
        Limits::new(9_000, 1_000_000, 9_000).unwrap(),
    )
    .unwrap();
    let new = RuleSpec::new(
        "reloaded",
        tollgate::Algorithm::Concurrency,
        Limits::new(9_000, 60_000_000, 9_000).unwrap(),
    )
    .unwrap();
    fn take<'a>(rule: &'a RuleSpec, key: &'a Key, cost: u64) -> [Charge<'a>; 1] {
        [Charge { rule, key, cost }]
    }
    async fn run<St: Store>(
        store: St,
        clock: &ManualClock,
        old: &RuleSpec,
        new: &RuleSpec,
        name: &str,
    ) {
        let key = Key::text(format!("reload-{name}"));
        let first = store.check(&take(old, &key, 1)).await.unwrap();
        assert!(first.allowed(), "{name}");
        clock.advance(Duration::from_millis(500));
        // 8,000 slots at once, under the new policy.
        let second = store.check(&take(new, &key, 8_000)).await.unwrap();
        assert!(second.allowed(), "{name}");
        assert_eq!(second.outcomes()[0].remaining, 999, "{name}");
        clock.advance(Duration::from_millis(1_500));
        // The old request ends, past its own longest hold.
        store
            .adjust(&[Adjustment {
                rule: old,
                key: &key,
                change: Change::Refund(1),
                charged_at: first.charged_at(0),
            }])
            .await
            .unwrap();
        let held = store.peek(&take(new, &key, 0)).await.unwrap();
        assert_eq!(
            held.outcomes()[0].remaining,
            1_000,
            "{name}: the new request's 8,000 slots are still held"
        );
        store
            .adjust(&[Adjustment {
                rule: new,
                key: &key,
                change: Change::Refund(8_000),
                charged_at: second.charged_at(0),
            }])
            .await
            .unwrap();
        let free = store.peek(&take(new, &key, 0)).await.unwrap();
        assert_eq!(free.outcomes()[0].remaining, 9_000, "{name}");
    }
    let clock = ManualClock::new(1_700_000_000_000_000);
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    run(memory, &clock, &old, &new, "memory").await;
    let redis = RedisStore::builder(support::standalone().url())
        .prefix(support::unique_prefix("reloaded"))
        .clock(clock.clone())
        .connect()
        .await
        .unwrap();
    run(redis, &clock, &old, &new, "redis").await;
    let cluster = RedisClusterStore::builder(support::cluster().urls())
        .prefix(support::unique_prefix("reloaded"))
        .clock(clock.clone())
        .connect()
        .await
        .unwrap();
    run(cluster, &clock, &old, &new, "cluster").await;
}

/// Code outside the request path holds slots as a request does: charged, then given back with
/// the decision of the charge. A plain refund, which cannot tell which slots, is refused.
#[tokio::test]
async fn the_limiter_takes_and_gives_back_slots() {
    let (memory, redis, cluster) = stores("limiter-slots").await;
    async fn run<St: Store>(store: St, name: &str) {
        let layer = RateLimitLayer::builder()
            .rule(Rule::concurrent("jobs", 2).key(Global))
            .store(store)
            .build()
            .unwrap();
        let limiter = layer.limiter();
        let key = Key::global();
        let first = limiter.charge("jobs", &key, 1).await.unwrap();
        let second = limiter.charge("jobs", &key, 1).await.unwrap();
        assert!(first.allowed() && second.allowed(), "{name}");
        assert!(
            !limiter.charge("jobs", &key, 1).await.unwrap().allowed(),
            "{name}"
        );
        assert!(limiter.refund("jobs", &key, 1).await.is_err(), "{name}");
        assert!(limiter.force("jobs", &key, 1).await.is_err(), "{name}");
        limiter.give_back("jobs", &key, 1, first).await.unwrap();
        assert_eq!(
            limiter.peek("jobs", &key).await.unwrap().remaining,
            1,
            "{name}"
        );
        limiter.give_back("jobs", &key, 1, second).await.unwrap();
        assert_eq!(
            limiter.peek("jobs", &key).await.unwrap().remaining,
            2,
            "{name}"
        );
    }
    run(memory, "memory").await;
    run(redis, "redis").await;
    run(cluster, "cluster").await;
}

/// The rule of the killed-replica test: 3 slots for everyone, held at most 2 s.
fn held_by_a_process() -> Rule {
    Rule::concurrent("held-by-a-process", 3)
        .key(Global)
        .max_hold(Duration::from_secs(2))
}

/// A replica in a process of its own takes every slot (on a standalone Redis and on the
/// cluster), says so, and is killed (SIGKILL) while its responses are out: its slots are
/// refused to the other replicas until the longest hold, and free after it.
#[tokio::test]
async fn a_killed_replica_process_frees_its_slots_after_the_longest_hold() {
    if let Ok(servers) = std::env::var("TOLLGATE_TEST_HOLDER") {
        return hold_until_killed(&servers).await;
    }
    let (redis_prefix, cluster_prefix) = (
        support::unique_prefix("killed"),
        support::unique_prefix("killed"),
    );
    let servers = format!(
        "{}|{redis_prefix}|{}|{cluster_prefix}",
        support::standalone().url(),
        support::cluster().urls().join(",")
    );
    let mut holder = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_killed_replica_process_frees_its_slots_after_the_longest_hold",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("TOLLGATE_TEST_HOLDER", &servers)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = holder.stdout.take().unwrap();
    let holding = std::thread::spawn(move || {
        use std::io::BufRead;
        std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line.ends_with("HOLDING"))
    });
    assert!(holding.join().unwrap(), "the holder never took its slots");
    holder.kill().unwrap();
    holder.wait().unwrap();
    let killed_at = std::time::Instant::now();

    let redis = RedisStore::builder(support::standalone().url())
        .prefix(redis_prefix)
        .connect()
        .await
        .unwrap();
    let cluster = RedisClusterStore::builder(support::cluster().urls())
        .prefix(cluster_prefix)
        .connect()
        .await
        .unwrap();
    let redis = replica(redis, held_by_a_process(), InFlight::default());
    let cluster = replica(cluster, held_by_a_process(), InFlight::default());
    assert_eq!(send(&redis, "/slow", Reading::Whole).await, 429, "redis");
    assert_eq!(
        send(&cluster, "/slow", Reading::Whole).await,
        429,
        "cluster"
    );
    tokio::time::sleep(Duration::from_millis(2_100).saturating_sub(killed_at.elapsed())).await;
    assert_eq!(send(&redis, "/slow", Reading::Whole).await, 200, "redis");
    assert_eq!(
        send(&cluster, "/slow", Reading::Whole).await,
        200,
        "cluster"
    );
}

/// The killed replica: takes every slot, says `HOLDING`, and waits to be killed.
async fn hold_until_killed(servers: &str) {
    let parts: Vec<&str> = servers.split('|').collect();
    let redis = RedisStore::builder(parts[0])
        .prefix(parts[1])
        .connect()
        .await
        .unwrap();
    let cluster = RedisClusterStore::builder(parts[2].split(','))
        .prefix(parts[3])
        .connect()
        .await
        .unwrap();
    let mut held = Vec::new();
    for app in [
        replica(redis, held_by_a_process(), InFlight::default()),
        replica(cluster, held_by_a_process(), InFlight::default()),
    ] {
        for _ in 0..3 {
            let response = app.clone().oneshot(request("/slow")).await.unwrap();
            assert_eq!(response.status(), 200);
            held.push(response);
        }
    }
    println!("HOLDING");
    std::io::Write::flush(&mut std::io::stdout()).unwrap();
    tokio::time::sleep(Duration::from_secs(60)).await;
    drop(held);
}
