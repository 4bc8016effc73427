//! Hot keys on Redis: the deny cache answers a denied key's next requests here, with Redis's
//! numbers, until the retry-after Redis computed; leases follow their key's demand, give back
//! a window's unspent units into it, never admit more than the shared budget and under-admit by
//! at most `(n - 1)` units per replica; split keys spread over a cluster's primaries and stay
//! within their bound.

#![cfg(all(feature = "redis", feature = "testing"))]

mod support;

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tollgate::algorithm::{Limits, MAX_PERIOD_MICROS, State};
use tollgate::clock::ManualClock;
use tollgate::key::Key;
use tollgate::store::{Charge, RedisClusterStore, RedisStore, RuleSpec, Store};
use tollgate::{Algorithm, Decision, DecisionSource};

/// The calls of tollgate's code a server ran (`FCALL`, or `EVALSHA` where it has no functions).
fn calls(server: &support::RedisServer) -> u64 {
    support::server().code_calls(server)
}

async fn check<S: Store>(store: &S, rule: &RuleSpec, key: &Key, cost: u64) -> Decision {
    store
        .check(&[Charge { rule, key, cost }])
        .await
        .expect("check")
}

async fn store_on(server: &support::RedisServer, clock: Option<&ManualClock>) -> RedisStore {
    // Denials answered here until the retry-after Redis computed (their cap, of minutes of
    // the manual clock, is `tests/redis_recovery.rs`'s).
    let mut builder = RedisStore::builder(server.url())
        .response_timeout(Duration::from_secs(5))
        .deny_cache_max_age(Duration::from_secs(3600));
    if let Some(clock) = clock {
        builder = builder.clock(clock.clone());
    }
    builder.connect().await.unwrap()
}

// ---------------------------------------------------------------------------------------------
// The deny cache

/// A denied key's next requests are answered here, with the numbers Redis would give (a store
/// without the cache, on the same server and clock, asks Redis), until Redis's retry-after; the
/// request after it goes to Redis and is admitted.
#[tokio::test]
async fn a_denied_key_is_answered_here_as_redis_would_until_its_retry_after() {
    let server = support::RedisServer::start();
    for algorithm in Algorithm::ALL {
        let clock = ManualClock::new(1_700_000_000_000_000);
        let cached = store_on(&server, Some(&clock)).await;
        let uncached = RedisStore::builder(server.url())
            .clock(clock.clone())
            .deny_cache(0)
            .connect()
            .await
            .unwrap();
        let limits = Limits::new(3, 60_000_000, 3).unwrap();
        let rule = RuleSpec::new("cached", algorithm, limits).unwrap();
        let key = Key::text(format!("cached-{algorithm}"));
        for _ in 0..3 {
            assert!(check(&cached, &rule, &key, 1).await.allowed());
        }
        let denied = check(&cached, &rule, &key, 1).await;
        assert!(!denied.allowed());
        assert_eq!(denied.source(), DecisionSource::Store);
        let wait = denied.retry_after_micros().unwrap();
        let before = calls(&server);
        assert!(before > 0);
        if algorithm.is_concurrency() {
            // Slots come back when responses end, which no time here can tell: never cached.
            clock.advance(Duration::from_micros(wait / 2));
            let again = check(&cached, &rule, &key, 1).await;
            assert_eq!(again.source(), DecisionSource::Store, "{algorithm}");
            assert_eq!(calls(&server), before + 1, "{algorithm}: asked Redis again");
            continue;
        }
        // Ten steps up to a microsecond before the retry-after: answered here, as Redis would.
        for step in 0..10 {
            let by = if step < 9 {
                wait / 10
            } else {
                wait - 9 * (wait / 10) - 1
            };
            clock.advance(Duration::from_micros(by));
            let local = check(&cached, &rule, &key, 1).await;
            let redis = check(&uncached, &rule, &key, 1).await;
            assert!(!redis.allowed(), "{algorithm}, step {step}");
            assert_eq!(
                local.source(),
                DecisionSource::DenyCache,
                "{algorithm}, {step}"
            );
            assert_eq!(
                local, redis,
                "{algorithm}, step {step}: the cached answer is Redis's"
            );
        }
        // Only the store without the cache asked Redis.
        assert_eq!(calls(&server) - before, 10, "{algorithm}");
        // At the retry-after, Redis decides, and admits.
        clock.advance(Duration::from_micros(1));
        let admitted = check(&cached, &rule, &key, 1).await;
        assert_eq!(admitted.source(), DecisionSource::Store, "{algorithm}");
        assert!(admitted.allowed(), "{algorithm}");
    }
}

/// 1,000 requests of a known-denied key cost Redis nothing; a new quota for the rule (a policy
/// change) is a new budget, which Redis decides.
#[tokio::test]
async fn a_known_denied_key_costs_redis_nothing_and_a_new_quota_asks_it_again() {
    let server = support::RedisServer::start();
    let store = store_on(&server, None).await;
    let hour = |limit| Limits::new(limit, 3_600_000_000, limit).unwrap();
    let rule = RuleSpec::new("denied", Algorithm::TokenBucket, hour(1)).unwrap();
    let key = Key::ip("203.0.113.9".parse().unwrap());
    assert!(check(&store, &rule, &key, 1).await.allowed());
    assert!(!check(&store, &rule, &key, 1).await.allowed());
    let before = calls(&server);
    for _ in 0..1000 {
        let decision = check(&store, &rule, &key, 1).await;
        assert!(!decision.allowed());
        assert_eq!(decision.source(), DecisionSource::DenyCache);
    }
    assert_eq!(calls(&server), before, "no call for a known-denied key");
    // Another cost is another request: Redis decides it.
    assert!(!check(&store, &rule, &key, 2).await.allowed());
    assert_eq!(calls(&server), before + 1);
    // The same name with a new quota: Redis decides, with the new numbers (the bucket is full
    // again at the same time, so a burst of 5 refills a token every 12 minutes from now).
    let raised = RuleSpec::new("denied", Algorithm::TokenBucket, hour(5)).unwrap();
    let decision = check(&store, &raised, &key, 1).await;
    assert_eq!(decision.source(), DecisionSource::Store);
    assert_eq!(decision.outcomes()[0].limit, 5);
    assert_eq!(calls(&server), before + 2);
}

/// A global rule (a unit back every millisecond, leased `lease` units at a time when given) over
/// a tenant's (2 a minute).
fn global_and_tenant(lease: Option<u64>) -> (RuleSpec, RuleSpec) {
    let mut global = RuleSpec::new(
        "global",
        Algorithm::TokenBucket,
        Limits::new(1000, 1_000_000, 1000).unwrap(),
    )
    .unwrap();
    if let Some(units) = lease {
        global = global.with_lease(units, Duration::from_secs(10)).unwrap();
    }
    let tenant = RuleSpec::new(
        "tenant",
        Algorithm::TokenBucket,
        Limits::new(2, 60_000_000, 2).unwrap(),
    )
    .unwrap();
    (global, tenant)
}

/// The charges of one request of tenant `key`: the global key's and its own.
fn global_and_tenant_charges<'a>(
    global: &'a RuleSpec,
    tenant: &'a RuleSpec,
    key: &'a Key,
) -> [Charge<'a>; 2] {
    static EVERYONE: std::sync::LazyLock<Key> = std::sync::LazyLock::new(|| Key::text("global"));
    [
        Charge {
            rule: global,
            key: &EVERYONE,
            cost: 1,
        },
        Charge {
            rule: tenant,
            key,
            cost: 1,
        },
    ]
}

/// A per-tenant rule stacked under a global one (the common shape: a fleet-wide ceiling over
/// each tenant's quota): a denied tenant is answered here while other tenants' requests pass
/// and the global rule's next unit comes and goes, on a standalone server and on a cluster,
/// with the numbers Redis gives (a store without the cache, on the same server and clock,
/// asks it: the global rule's units come back in the cached answer as they do in Redis).
#[tokio::test]
async fn a_denied_tenant_under_a_global_rule_is_answered_here_while_others_pass() {
    let server = support::RedisServer::start();
    let clock = ManualClock::new(1_700_000_000_000_000);
    let standalone = store_on(&server, Some(&clock)).await;
    let uncached = RedisStore::builder(server.url())
        .clock(clock.clone())
        .deny_cache(0)
        .connect()
        .await
        .unwrap();
    denied_tenant_under_a_global_rule(&standalone, &uncached, &clock, || calls(&server)).await;

    let cluster = support::RedisCluster::start();
    let clock = ManualClock::new(1_700_000_000_000_000);
    let builder = || {
        RedisClusterStore::builder(cluster.urls())
            .response_timeout(Duration::from_secs(5))
            .deny_cache_max_age(Duration::from_secs(3600))
            .clock(clock.clone())
    };
    let store = builder().connect().await.unwrap();
    let uncached = builder().deny_cache(0).connect().await.unwrap();
    let cluster_calls = || cluster.nodes.iter().map(calls).sum::<u64>();
    denied_tenant_under_a_global_rule(&store, &uncached, &clock, cluster_calls).await;
}

async fn denied_tenant_under_a_global_rule<S: Store>(
    store: &S,
    uncached: &S,
    clock: &ManualClock,
    calls: impl Fn() -> u64,
) {
    // The global rule refills a unit every millisecond; a tenant has 2 a minute.
    let (global, tenant) = global_and_tenant(None);
    let request =
        |store: &S, key: &Key| store.check(&global_and_tenant_charges(&global, &tenant, key));
    let over = Key::text("tenant-over");
    for _ in 0..2 {
        assert!(request(store, &over).await.unwrap().allowed());
    }
    let denied = request(store, &over).await.unwrap();
    assert!(!denied.allowed());
    assert_eq!(denied.source(), DecisionSource::Store);
    let mut others = 0;
    for round in 0..20 {
        // Another tenant passes (the global rule admits and spends), and 5 ms go by: past the
        // global rule's next unit, well within the denied tenant's 30 s.
        let other = Key::text(format!("tenant-{round}"));
        let passed = request(store, &other).await.unwrap();
        assert!(passed.allowed());
        others += 1;
        clock.advance(Duration::from_millis(5));
        let before = calls();
        let again = request(store, &over).await.unwrap();
        assert!(!again.allowed(), "round {round}");
        assert_eq!(
            again.source(),
            DecisionSource::DenyCache,
            "round {round}: answered here"
        );
        assert_eq!(calls(), before, "round {round}: no call to Redis");
        // Redis's own answer (a denial charges nothing): the same numbers, every rule's.
        let redis = request(uncached, &over).await.unwrap();
        assert_eq!(redis.source(), DecisionSource::Store);
        assert_eq!(
            again.outcomes(),
            redis.outcomes(),
            "round {round}: the cached answer is Redis's"
        );
        assert!(passed.outcomes()[0].remaining < redis.outcomes()[0].remaining);
        assert_eq!(
            again.retry_after_micros(),
            denied
                .retry_after_micros()
                .map(|wait| wait - 5_000 * (round + 1)),
            "round {round}: the retry-after, aged"
        );
    }
    assert_eq!(others, 20);
    // At its retry-after, Redis decides, and admits.
    clock.advance(Duration::from_micros(denied.retry_after_micros().unwrap()));
    let admitted = request(store, &over).await.unwrap();
    assert_eq!(admitted.source(), DecisionSource::Store);
    assert!(admitted.allowed());
}

/// The same with the global rule leased (each replica spends its units from a lease): the
/// denied tenant is answered here, the global rule's numbers those its lease here reports.
#[tokio::test]
async fn a_denied_tenant_under_a_leased_global_rule_is_answered_here() {
    let server = support::RedisServer::start();
    let clock = ManualClock::new(1_700_000_000_000_000);
    let store = store_on(&server, Some(&clock)).await;
    let (global, tenant) = global_and_tenant(Some(100));
    let request = |key: &Key| store.check(&global_and_tenant_charges(&global, &tenant, key));
    let over = Key::text("tenant-over");
    for _ in 0..2 {
        assert!(request(&over).await.unwrap().allowed());
    }
    let denied = request(&over).await.unwrap();
    assert!(!denied.allowed());
    let mut answered_here = 0;
    for round in 0..20 {
        let other = Key::text(format!("tenant-{round}"));
        assert!(request(&other).await.unwrap().allowed());
        clock.advance(Duration::from_millis(5));
        let before = calls(&server);
        let again = request(&over).await.unwrap();
        assert!(!again.allowed(), "round {round}");
        assert!(again.outcomes()[0].allowed, "round {round}");
        if again.source() == DecisionSource::DenyCache {
            assert_eq!(calls(&server), before, "round {round}: no call to Redis");
            answered_here += 1;
        }
    }
    // Every round once the global rule's lease has grown to its demand (the first rounds
    // send its charge to Redis, and then its own cached numbers last until its next unit only).
    assert!(answered_here >= 15, "{answered_here} of 20 answered here");
}

/// While Redis is away, a key Redis denied stays denied (Redis would deny it); other keys
/// follow their failure mode.
#[tokio::test]
async fn a_denial_holds_while_redis_is_away() {
    let server = support::RedisServer::start();
    let store = RedisStore::builder(server.url())
        .response_timeout(Duration::from_millis(100))
        .connect()
        .await
        .unwrap();
    let rule = RuleSpec::new(
        "outage",
        Algorithm::FixedWindow,
        Limits::new(1, 3_600_000_000, 1).unwrap(),
    )
    .unwrap();
    let denied_key = Key::text("over-its-limit");
    assert!(check(&store, &rule, &denied_key, 1).await.allowed());
    assert!(!check(&store, &rule, &denied_key, 1).await.allowed());
    server.stop();
    for _ in 0..5 {
        let decision = store
            .check(&[Charge {
                rule: &rule,
                key: &denied_key,
                cost: 1,
            }])
            .await
            .expect("answered here");
        assert!(!decision.allowed());
    }
    let other = Key::text("new-client");
    assert!(
        store
            .check(&[Charge {
                rule: &rule,
                key: &other,
                cost: 1
            }])
            .await
            .is_err(),
        "a key Redis never denied needs Redis"
    );
}

// ---------------------------------------------------------------------------------------------
// Leases

const LIMIT: u64 = 100;
const LEASE: u64 = 10;
const REQUESTS: usize = 500;
const REPLICAS: usize = 3;
const TRIALS: usize = 50;

fn leased(algorithm: Algorithm) -> Arc<RuleSpec> {
    let limits = Limits::new(LIMIT, MAX_PERIOD_MICROS, LIMIT).unwrap();
    Arc::new(
        RuleSpec::new("leased", algorithm, limits)
            .unwrap()
            .with_lease(LEASE, Duration::from_secs(60))
            .unwrap(),
    )
}

async fn admitted<S: Store + Clone>(replicas: &[S], rule: &Arc<RuleSpec>, key: &Key) -> u64 {
    let mut tasks = JoinSet::new();
    for i in 0..REQUESTS {
        let (store, rule, key) = (
            replicas[i % replicas.len()].clone(),
            rule.clone(),
            key.clone(),
        );
        tasks.spawn(async move {
            store
                .check(&[Charge {
                    rule: &rule,
                    key: &key,
                    cost: 1,
                }])
                .await
        });
    }
    let mut admitted = 0;
    while let Some(result) = tasks.join_next().await {
        admitted += u64::from(result.unwrap().expect("no check fails").allowed());
    }
    admitted
}

async fn within_the_lease_bound<S: Store + Clone>(replicas: &[S], name: &str) {
    let floor = LIMIT - (LEASE - 1) * REPLICAS as u64;
    for algorithm in [Algorithm::TokenBucket, Algorithm::FixedWindow] {
        let rule = leased(algorithm);
        let mut lowest = LIMIT;
        for trial in 0..TRIALS {
            let key = Key::text(format!("{name}-{algorithm}-{trial}"));
            let n = admitted(replicas, &rule, &key).await;
            assert!(
                n <= LIMIT,
                "{name} {algorithm} trial {trial}: {n} admitted of {LIMIT}"
            );
            assert!(
                n >= floor,
                "{name} {algorithm} trial {trial}: {n} admitted, below {floor}"
            );
            lowest = lowest.min(n);
        }
        println!("{name} {algorithm}: at least {lowest} of {LIMIT} admitted in {TRIALS} trials");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_never_admit_more_than_the_budget_nor_less_than_the_bound_standalone() {
    // Three replicas on one budget: one server, one prefix.
    let prefix = support::unique_prefix("lease");
    let mut replicas = Vec::new();
    for _ in 0..REPLICAS {
        replicas.push(
            RedisStore::builder(support::standalone().url())
                .prefix(&prefix)
                .response_timeout(Duration::from_secs(5))
                .connect()
                .await
                .unwrap(),
        );
    }
    within_the_lease_bound(&replicas, "standalone").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_never_admit_more_than_the_budget_nor_less_than_the_bound_cluster() {
    let prefix = support::unique_prefix("lease");
    let mut replicas = Vec::new();
    for _ in 0..REPLICAS {
        replicas.push(
            RedisClusterStore::builder(support::cluster().urls())
                .prefix(&prefix)
                .response_timeout(Duration::from_secs(5))
                .connect()
                .await
                .unwrap(),
        );
    }
    within_the_lease_bound(&replicas, "cluster").await;
}

/// 15 requests of `key` one after the other, all admitted: a lease of 10 grows with the key's
/// demand (its cost alone, then 2, 4 and 8 units, each spent before its time), so that the
/// key's next refill takes a whole lease.
async fn grow<S: Store>(store: &S, rule: &RuleSpec, key: &Key) {
    for _ in 0..15 {
        assert!(check(store, rule, key, 1).await.allowed());
    }
}

/// One replica with a lease of 10 asks Redis about once per 10 requests of a hot key, once its
/// lease has grown with the key's demand (1, 2, 4, 8, then 10 units a call).
#[tokio::test]
async fn a_lease_asks_redis_once_per_lease() {
    let server = support::RedisServer::start();
    let store = store_on(&server, None).await;
    let rule = leased(Algorithm::TokenBucket);
    let key = Key::text("hot");
    let mut sources = Vec::new();
    for _ in 0..100 {
        let decision = check(&store, &rule, &key, 1).await;
        assert!(decision.allowed());
        sources.push(decision.source());
    }
    assert_eq!(
        calls(&server),
        4 + 9,
        "100 requests: 15 in 4 calls, 85 in 9"
    );
    assert_eq!(
        sources
            .iter()
            .filter(|s| **s == DecisionSource::Lease)
            .count(),
        100 - 13
    );
    // The budget is spent: the next request is denied by Redis.
    assert!(!check(&store, &rule, &key, 1).await.allowed());
}

/// A small deterministic generator (xorshift), so that a failure is repeated by its seed.
fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    }
}

/// The code takes a lease as the reference model's `lease_take` does, at every cost: at least
/// the cost, and at cost 0 (a refill ahead of need) every unit there is up to the lease,
/// possibly none, always admitted. The code is called as `RedisStore::script_source`
/// documents it, on the server's clock: as a function (`FCALL`) where the server has them, as
/// the script (`EVALSHA`) where it has not; the model runs at the time each call answers.
#[test]
fn the_code_takes_a_lease_as_the_model_does_at_every_cost() {
    let server = support::RedisServer::start();
    let mut conn = server.conn();
    let call = if support::server().has_functions() {
        let (library, function) = RedisStore::function_library();
        let _: String = redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg("REPLACE")
            .arg(library)
            .query(&mut conn)
            .unwrap();
        let mut call = redis::cmd("FCALL");
        call.arg(function);
        call
    } else {
        let sha: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(RedisStore::script_source())
            .query(&mut conn)
            .unwrap();
        let mut call = redis::cmd("EVALSHA");
        call.arg(sha);
        call
    };
    let mut next = xorshift(0x00a4_ead5);
    let mut partial = 0;
    for algorithm in Algorithm::ALL {
        let code = match algorithm {
            Algorithm::TokenBucket => "tb",
            Algorithm::Gcra => "gcra",
            Algorithm::FixedWindow => "fw",
            Algorithm::SlidingWindowLog => "sl",
            Algorithm::SlidingWindowCounter => "sc",
            _ => continue,
        };
        let limits = Limits::new(12, 50_000, 12).unwrap();
        let key = format!("lease-model:{algorithm}");
        let mut state: Option<State> = None;
        let mut ahead_takes = 0;
        for step in 0..200 {
            if next().is_multiple_of(4) {
                std::thread::sleep(Duration::from_micros(next() % 20_000));
            }
            let cost = [0, 0, 1, 1, 2, 3][(next() % 6) as usize];
            let lease = 2 + next() % 16;
            let charge = format!(
                "{code}:{}:{}:{}:{}:{cost}:{lease}",
                limits.limit, limits.period, limits.burst, limits.interval
            );
            let reply: Vec<i64> = call
                .clone()
                .arg(1)
                .arg(&key)
                .arg("c")
                .arg(&charge)
                .query(&mut conn)
                .unwrap();
            let now = reply[0] as u64;
            let take = algorithm.lease_take(&limits, state.as_ref(), now, cost, lease);
            let outcome = algorithm.check(&limits, state.as_ref(), now, take);
            let at = format!("{algorithm} step {step}: cost {cost}, lease {lease}");
            assert_eq!(reply[3] == 0, outcome.allowed, "{at}: admitted");
            assert_eq!(reply[1] as u64, outcome.remaining, "{at}: remaining");
            if outcome.allowed {
                assert_eq!(reply[5] as u64, take, "{at}: taken");
                algorithm.commit(&limits, &mut state, now, take);
                if cost == 0 && take > 0 {
                    ahead_takes += 1;
                    partial += u64::from(take < lease);
                }
            } else {
                assert_eq!(reply[5], 0, "{at}: nothing taken");
                assert!(cost > 0, "{at}: a refill ahead of need is never denied");
            }
        }
        assert!(
            ahead_takes > 0,
            "{algorithm}: no refill ahead of need took a unit"
        );
    }
    assert!(partial > 0, "no refill ahead of need was partly filled");
}

/// Three requests of `key` planned at once, then waited for (3, the admitted): on a leased rule
/// whose lease has grown ([`grow`]) the first refills and the other two, finding no unit while
/// it is out, go to Redis alone.
async fn three_at_once<S: Store>(store: &S, rule: &RuleSpec, key: &Key) -> u64 {
    let charge = [Charge { rule, key, cost: 1 }];
    let (a, b, c) = tokio::join!(
        store.check(&charge),
        store.check(&charge),
        store.check(&charge)
    );
    for decision in [a, b, c] {
        assert!(decision.expect("check").allowed(), "{}", rule.name());
    }
    3
}

/// A key spent by many requests at once refills its lease ahead of need, and one replica still
/// spends exactly the budget, every algorithm: time stopped, requests one at a time after a
/// first burst (each one's refill ahead of need settled before the next), until Redis has
/// nothing left, whether a refill ahead asks for all there is, some of it, or none.
#[tokio::test]
async fn a_refill_ahead_of_need_loses_nothing() {
    let server = support::RedisServer::start();
    for limit in [40, 16, 12] {
        for algorithm in Algorithm::ALL {
            if algorithm.is_concurrency() {
                continue;
            }
            let clock = ManualClock::new(1_700_000_000_000_000);
            let store = store_on(&server, Some(&clock)).await;
            let rule = RuleSpec::new(
                format!("ahead-{algorithm}-{limit}"),
                algorithm,
                Limits::new(limit, 3_600_000_000, limit).unwrap(),
            )
            .unwrap()
            .with_lease(10, Duration::from_secs(60))
            .unwrap();
            let key = Key::text("hot");
            // Three requests at once on a new key: the first goes to Redis alone, the second
            // refills (2 taken), the third finds no unit while it is out: a mark of 1, so that
            // leases grow and refills ahead of need go out as the key is spent.
            let mut admitted = three_at_once(&store, &rule, &key).await;
            // A refill ahead of need settles in a task of its own: a denial is final once
            // requests have been denied for a second.
            let mut denied_since = None;
            loop {
                let decision = check(&store, &rule, &key, 1).await;
                if decision.allowed() {
                    admitted += 1;
                    denied_since = None;
                } else if denied_since
                    .get_or_insert_with(std::time::Instant::now)
                    .elapsed()
                    > Duration::from_secs(1)
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
                assert!(admitted <= limit, "{algorithm}: {admitted} admitted");
            }
            assert_eq!(
                admitted, limit,
                "{algorithm}, budget {limit}: every unit spent"
            );
        }
    }
}

/// Units held here are spent while Redis is away and its breaker open, those that a refill
/// ahead of need would follow included; past them, requests need Redis.
#[tokio::test]
async fn leased_units_are_spent_while_redis_is_away() {
    let server = support::RedisServer::start();
    let store = RedisStore::builder(server.url())
        .response_timeout(Duration::from_millis(100))
        .circuit_breaker(
            tollgate::CircuitBreaker::after_failures(1).cooldown(Duration::from_secs(60)),
        )
        .connect()
        .await
        .unwrap();
    let rule = leased(Algorithm::TokenBucket);
    let key = Key::text("hot");
    // A refill and two requests at once: 9 held, a mark of 3.
    grow(&store, &rule, &key).await;
    three_at_once(&store, &rule, &key).await;
    let charge = [Charge {
        rule: &rule,
        key: &key,
        cost: 1,
    }];
    server.stop();
    let other = Key::text("other");
    let error = store
        .check(&[Charge {
            rule: &rule,
            key: &other,
            cost: 1,
        }])
        .await
        .unwrap_err();
    assert!(!matches!(error, tollgate::store::StoreError::CircuitOpen));
    for held in (0..9).rev() {
        // Answered at once, as the layer asks first.
        let decision = store
            .check_now(&charge)
            .expect("answered at once")
            .expect("paid here");
        assert!(decision.allowed(), "{held} left");
        assert_eq!(decision.source(), DecisionSource::Lease);
    }
    assert!(matches!(
        store.check_now(&charge),
        Some(Err(tollgate::store::StoreError::CircuitOpen))
    ));
    assert!(matches!(
        store.check(&charge).await,
        Err(tollgate::store::StoreError::CircuitOpen)
    ));
}

/// A replica with a lease decides as the reference model with the same leases does: one
/// replica, random costs and times within and past the leases' time to live, every algorithm;
/// leases that follow the key's demand, and units of a window left unspent given back.
#[tokio::test]
async fn a_leased_replica_decides_as_the_model_of_leases() {
    let server = support::RedisServer::start();
    let mut next = xorshift(0x001e_a5e5);
    for algorithm in Algorithm::ALL {
        let clock = ManualClock::new(1_700_000_000_000_000);
        // Without the deny cache: a request it answers is not seen by the leases.
        let store = RedisStore::builder(server.url())
            .clock(clock.clone())
            .deny_cache(0)
            .connect()
            .await
            .unwrap();
        let limit = 20;
        let limits = Limits::new(limit, 10_000_000, limit).unwrap();
        let (lease, ttl) = (6, Duration::from_secs(2));
        let spec = RuleSpec::new(format!("model-{algorithm}"), algorithm, limits).unwrap();
        if algorithm.is_concurrency() {
            // A slot goes back to the key that holds it: not leased.
            assert!(spec.with_lease(lease, ttl).is_err());
            continue;
        }
        let rule = spec.with_lease(lease, ttl).unwrap();
        let key = Key::text("model");
        // The model: Redis's state, the units held here and until when; when the key was
        // last seen, the size of the lease being spent and what the last one spent; and units
        // of a window left unspent, with when they were charged, on their way back.
        let mut state: Option<State> = None;
        let (mut held, mut until) = (0u64, 0u64);
        let (mut seen, mut taken, mut spent) = (None::<u64>, 0u64, 0u64);
        let (mut charged, mut returning) = (0u64, None::<(u64, u64)>);
        let ttl_micros = ttl.as_micros() as u64;
        for step in 0..300 {
            clock.advance(Duration::from_micros(next() % 1_500_000));
            let now = tollgate::clock::Clock::now_micros(&clock);
            let cost = 1 + next() % 3;
            let again = seen.is_some_and(|seen| now - seen < ttl_micros);
            seen = Some(now);
            if now >= until {
                if taken > 0 {
                    spent = taken - held;
                    taken = 0;
                }
                if held > 0 && algorithm.lease_gives_back() {
                    returning = match returning {
                        Some((units, at)) if at / limits.period == charged / limits.period => {
                            Some((units + held, at))
                        }
                        _ => Some((held, charged)),
                    };
                }
                held = 0;
            }
            let expected = if held >= cost {
                held -= cost;
                true
            } else {
                // The key's call gives back what its leases left unspent, first.
                if let Some((units, at)) = returning.take() {
                    algorithm.refund(&limits, &mut state, now, units, at);
                }
                let size = if !again {
                    cost
                } else if now < until {
                    taken * 2
                } else {
                    spent
                }
                .max(cost + u64::from(again))
                .min(lease);
                if size <= cost {
                    spent = 0;
                    algorithm.admit(&limits, &mut state, now, cost).allowed
                } else {
                    let (need, want) = (cost - held, size - held);
                    let take = algorithm.lease_take(&limits, state.as_ref(), now, need, want);
                    let outcome = algorithm.check(&limits, state.as_ref(), now, take);
                    if outcome.allowed {
                        algorithm.commit(&limits, &mut state, now, take);
                        taken = take + held;
                        held = take - need;
                        charged = now;
                        let horizon = match algorithm {
                            Algorithm::FixedWindow | Algorithm::SlidingWindowCounter => {
                                limits.period - now % limits.period
                            }
                            _ => u64::MAX,
                        };
                        until = now + ttl_micros.min(horizon);
                    }
                    outcome.allowed
                }
            };
            let decision = check(&store, &rule, &key, cost).await;
            assert_eq!(
                decision.allowed(),
                expected,
                "{algorithm}, step {step}, cost {cost}, held {held}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Split keys

/// The sub-keys of one hot key live on more than one primary of the cluster, and the key admits
/// at most its quota, and at least the quota less `(parts - 1) × replicas`.
#[tokio::test]
async fn a_split_key_spreads_over_the_primaries_within_its_bound() {
    let cluster = support::cluster();
    let prefix = support::unique_prefix("split");
    let (quota, parts) = (80u64, 8u16);
    let rule = Arc::new(
        RuleSpec::new(
            "split",
            Algorithm::FixedWindow,
            Limits::new(quota, MAX_PERIOD_MICROS, quota).unwrap(),
        )
        .unwrap()
        .with_parts(parts)
        .unwrap(),
    );
    let key = Key::text("big-tenant");
    let mut replicas = Vec::new();
    for _ in 0..REPLICAS {
        replicas.push(
            RedisClusterStore::builder(cluster.urls())
                .prefix(&prefix)
                .response_timeout(Duration::from_secs(5))
                .connect()
                .await
                .unwrap(),
        );
    }
    let mut admitted = 0;
    for i in 0..200 {
        admitted += u64::from(
            check(&replicas[i % REPLICAS], &rule, &key, 1)
                .await
                .allowed(),
        );
    }
    let floor = quota - u64::from(parts - 1) * REPLICAS as u64;
    assert!(admitted <= quota, "{admitted} admitted of {quota}");
    assert!(admitted >= floor, "{admitted} admitted, below {floor}");
    // Where the sub-keys live.
    let mut conn = cluster.nodes[0].conn();
    let mut primaries = std::collections::HashSet::new();
    let mut written = 0;
    for part in 0..parts {
        let name = format!("{prefix}:{{big-tenant~{part}}}:split");
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(&name)
            .query(&mut conn)
            .unwrap();
        primaries.insert(cluster.primary_of(slot).expect("a primary"));
        let exists: bool = redis::cmd("EXISTS")
            .arg(&name)
            .query(&mut cluster.conn_for(&name))
            .unwrap();
        written += u32::from(exists);
    }
    assert_eq!(written, u32::from(parts), "every sub-key was used");
    assert!(
        primaries.len() >= 2,
        "sub-keys on {} primaries",
        primaries.len()
    );
}

/// A split key's denials are cached per sub-key: once every sub-key is spent, its requests
/// cost Redis nothing.
#[tokio::test]
async fn a_spent_split_key_costs_redis_nothing() {
    let server = support::RedisServer::start();
    let store = store_on(&server, None).await;
    let rule = RuleSpec::new(
        "split-denied",
        Algorithm::TokenBucket,
        Limits::new(8, 3_600_000_000, 8).unwrap(),
    )
    .unwrap()
    .with_parts(4)
    .unwrap();
    let key = Key::text("spent");
    let outcomes: Vec<bool> = {
        let mut all = Vec::new();
        for _ in 0..12 {
            all.push(check(&store, &rule, &key, 1).await.allowed());
        }
        all
    };
    assert_eq!(outcomes.iter().filter(|a| **a).count(), 8, "{outcomes:?}");
    let before = calls(&server);
    for _ in 0..100 {
        assert!(!check(&store, &rule, &key, 1).await.allowed());
    }
    assert_eq!(calls(&server), before);
}

/// A leased rule's units go back when another rule of the request denies it, and only to the
/// lease they came from: the replica never holds more than `n - 1`, and the budget is exact.
#[tokio::test]
async fn units_taken_for_a_denied_request_go_back_to_their_lease() {
    let server = support::RedisServer::start();
    let store = store_on(&server, None).await;
    let leased = leased(Algorithm::TokenBucket);
    let strict = RuleSpec::new(
        "strict",
        Algorithm::FixedWindow,
        Limits::new(1, MAX_PERIOD_MICROS, 1).unwrap(),
    )
    .unwrap();
    let (key, other) = (Key::text("giveback"), Key::text("giveback-other"));
    let both = |strict_key: &Key| {
        [
            Charge {
                rule: &leased,
                key: &key,
                cost: 1,
            },
            Charge {
                rule: &strict,
                key: strict_key,
                cost: 1,
            },
        ]
        .map(|c| (c.rule.clone(), c.key.clone(), c.cost))
    };
    let run = |charges: [(RuleSpec, Key, u64); 2]| {
        let store = store.clone();
        async move {
            let charges: Vec<Charge<'_>> = charges
                .iter()
                .map(|(rule, key, cost)| Charge {
                    rule,
                    key,
                    cost: *cost,
                })
                .collect();
            store.check(&charges).await.unwrap()
        }
    };
    // The first request after the lease has grown leases 10 and passes the strict rule once.
    grow(&store, &leased, &key).await;
    assert!(run(both(&other)).await.allowed());
    // The strict rule now denies: the leased unit taken for each goes back.
    for _ in 0..20 {
        assert!(!run(both(&other)).await.allowed());
    }
    // The lease alone: the 9 units held are all there (no Redis call), then a refill.
    let before = calls(&server);
    for _ in 0..9 {
        let d = check(&store, &leased, &key, 1).await;
        assert_eq!(d.source(), DecisionSource::Lease);
    }
    assert_eq!(calls(&server), before, "9 units held, not 9 + 20");
    assert_eq!(
        check(&store, &leased, &key, 1).await.source(),
        DecisionSource::Store
    );
    // The whole budget: 100 admitted in all, never more.
    let mut admitted = 15 + 11; // 15 growing, 1 with the strict rule, 9 from the lease, 1 refill
    while check(&store, &leased, &key, 1).await.allowed() {
        admitted += 1;
        assert!(admitted <= LIMIT, "more than the budget");
    }
    assert!(admitted >= LIMIT - (LEASE - 1), "{admitted}");
}

/// Leased units of a fixed window are never spent in the next window: each window admits at
/// most its quota, however long the lease's time to live.
#[tokio::test]
async fn leased_units_of_a_window_are_not_spent_in_the_next() {
    let server = support::RedisServer::start();
    let clock = ManualClock::new(1_700_000_000_000_000);
    let store = store_on(&server, Some(&clock)).await;
    let limits = Limits::new(10, 1_000_000, 10).unwrap();
    let rule = RuleSpec::new("windowed", Algorithm::FixedWindow, limits)
        .unwrap()
        .with_lease(8, Duration::from_secs(60))
        .unwrap();
    let key = Key::text("windowed");
    for window in 0..6u64 {
        // To the start of the next window. Every other window spends 5 of the 8 units it leased
        // and leaves 3; the next must not spend them.
        let now = tollgate::clock::Clock::now_micros(&clock);
        clock.advance(Duration::from_micros(1_000_000 - now % 1_000_000));
        let requests = if window % 2 == 0 { 5 } else { 30 };
        let mut admitted = 0;
        for step in 0..requests {
            if step == 3 {
                clock.advance(Duration::from_millis(900));
            }
            admitted += u64::from(check(&store, &rule, &key, 1).await.allowed());
        }
        assert_eq!(
            admitted,
            requests.min(10),
            "window {window}: at most its quota, leases or not"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Leases that follow demand

/// Requests of one key `every` apart on `clock`, `requests` of them, taken by `replicas` in
/// turn: how many are admitted.
async fn paced<S: Store>(
    replicas: &[S],
    clock: &ManualClock,
    rule: &RuleSpec,
    key: &Key,
    every: Duration,
    requests: usize,
) -> u64 {
    let mut admitted = 0;
    for i in 0..requests {
        admitted += u64::from(
            check(&replicas[i % replicas.len()], rule, key, 1)
                .await
                .allowed(),
        );
        clock.advance(every);
    }
    admitted
}

/// Admitted by the rule leased 10 at a time (the default time to live, 1 s) and by the same
/// rule without a lease, each on a key of its own, at each pace: 100 per hour, 1,000
/// requests, on `replicas` taking the requests in turn.
async fn leased_and_not<S: Store>(
    replicas: &[S],
    clock: &ManualClock,
    name: &str,
    algorithm: Algorithm,
    every: Duration,
) -> (u64, u64) {
    let limits = Limits::new(LIMIT, 3_600_000_000, LIMIT).unwrap();
    let plain = RuleSpec::new(format!("{name}-{algorithm}-plain"), algorithm, limits).unwrap();
    let leased = RuleSpec::new(format!("{name}-{algorithm}-leased"), algorithm, limits)
        .unwrap()
        .with_lease(LEASE, tollgate::DEFAULT_LEASE_TTL)
        .unwrap();
    let key = Key::text(format!("{name}-{every:?}"));
    // Both start at the same point of the hour.
    let start = tollgate::clock::Clock::now_micros(clock);
    let with = paced(replicas, clock, &leased, &key, every, 1_000).await;
    let now = tollgate::clock::Clock::now_micros(clock);
    clock.advance(Duration::from_micros(
        3_600_000_000 - (now - start) % 3_600_000_000,
    ));
    let without = paced(replicas, clock, &plain, &key, every, 1_000).await;
    (with, without)
}

/// The paces of the tests below: a key spent less than once per lease time to live, about
/// once, and several times per time to live on each replica.
const PACES: [Duration; 5] = [
    Duration::from_secs(2),
    Duration::from_millis(1_000),
    Duration::from_millis(400),
    Duration::from_millis(150),
    Duration::from_millis(30),
];

/// A lease follows its key's demand: a key spent less than once per time to live takes its
/// cost alone, and units left unspent when a lease expires go back to the shared budget where
/// that is exact (a fixed window, a sliding counter). So a leased rule admits what the same
/// rule without a lease admits, never more, and less by at most `(n - 1)` per replica (on one
/// replica, a fixed window or sliding counter exactly as much), at every pace, leases expiring
/// or not.
async fn a_lease_follows_demand<S: Store>(replicas: &[S], clock: &ManualClock, name: &str) {
    let per_replica = (LEASE - 1) * replicas.len() as u64;
    let mut wrong = Vec::new();
    for algorithm in Algorithm::ALL {
        if algorithm.is_concurrency() {
            continue;
        }
        for every in PACES {
            let (with, without) = leased_and_not(replicas, clock, name, algorithm, every).await;
            println!("{name} {algorithm}, every {every:?}: {with} admitted leased, {without} not");
            // One replica spends what it holds, and gives back what expires where that is
            // exact: a fixed window or sliding counter then loses nothing.
            let exact = replicas.len() == 1 && algorithm.lease_gives_back();
            if with > without || with + per_replica < without || (exact && with != without) {
                wrong.push(format!(
                    "{algorithm}, a request every {every:?}: {with} admitted with a lease, \
                     {without} without"
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{name}: {wrong:#?}");
}

#[tokio::test]
async fn a_lease_follows_demand_standalone() {
    let server = support::RedisServer::start();
    let clock = ManualClock::new(1_700_000_000_000_000);
    let mut replicas = Vec::new();
    for _ in 0..2 {
        replicas.push(store_on(&server, Some(&clock)).await);
    }
    a_lease_follows_demand(&replicas[..1], &clock, "one").await;
    a_lease_follows_demand(&replicas, &clock, "two").await;
}

#[tokio::test]
async fn a_lease_follows_demand_cluster() {
    let prefix = support::unique_prefix("demand");
    let clock = ManualClock::new(1_700_000_000_000_000);
    let mut replicas = Vec::new();
    for _ in 0..2 {
        replicas.push(
            RedisClusterStore::builder(support::cluster().urls())
                .prefix(&prefix)
                .clock(clock.clone())
                .response_timeout(Duration::from_secs(5))
                .connect()
                .await
                .unwrap(),
        );
    }
    a_lease_follows_demand(&replicas[..1], &clock, "one").await;
    a_lease_follows_demand(&replicas, &clock, "two").await;
}

/// What Redis holds of a rule's key, peeked: the units remaining.
async fn remaining<S: Store>(store: &S, rule: &RuleSpec, key: &Key) -> u64 {
    store
        .peek(&[Charge { rule, key, cost: 1 }])
        .await
        .expect("peek")
        .outcomes()[0]
        .remaining
}

/// Units a lease leaves unspent go back into the window they were taken from, exactly, and into
/// no other: after a burst that grows a key's lease, then a quiet spell past its time to live,
/// Redis holds what it holds for the same requests of the same rule without a lease, whether
/// the next request comes in the same window or in the next; the key's next request carries
/// them back. A token bucket's are not given back (see `Rule::lease`).
async fn unspent_units_go_back_into_their_window<S: Store>(store: &S, clock: &ManualClock) {
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindowCounter] {
        for next_window in [false, true] {
            let limits = Limits::new(LIMIT, 60_000_000, LIMIT).unwrap();
            let name = format!("back-{algorithm}-{next_window}");
            let plain = RuleSpec::new(format!("{name}-plain"), algorithm, limits).unwrap();
            let leased = RuleSpec::new(format!("{name}-leased"), algorithm, limits)
                .unwrap()
                .with_lease(LEASE, tollgate::DEFAULT_LEASE_TTL)
                .unwrap();
            let key = Key::text("burst");
            let mut seen = Vec::new();
            for rule in [&leased, &plain] {
                // To the start of a window, a second in.
                let now = tollgate::clock::Clock::now_micros(clock);
                clock.advance(Duration::from_micros(61_000_000 - now % 60_000_000));
                // 20 requests 10 ms apart: the lease grows (1, 2, 4, 8, then 10 of which 5
                // are left).
                let admitted = paced(
                    std::slice::from_ref(store),
                    clock,
                    rule,
                    &key,
                    Duration::from_millis(10),
                    20,
                )
                .await;
                assert_eq!(admitted, 20, "{name}");
                clock.advance(if next_window {
                    Duration::from_secs(60)
                } else {
                    Duration::from_secs(5)
                });
                assert!(check(store, rule, &key, 1).await.allowed(), "{name}");
                seen.push(remaining(store, rule, &key).await);
            }
            assert_eq!(
                seen[0], seen[1],
                "{name}: Redis holds, with a lease and without"
            );
        }
    }
}

#[tokio::test]
async fn unspent_units_go_back_into_their_window_standalone() {
    let server = support::RedisServer::start();
    let clock = ManualClock::new(1_700_000_000_000_000);
    let store = store_on(&server, Some(&clock)).await;
    unspent_units_go_back_into_their_window(&store, &clock).await;
}

#[tokio::test]
async fn unspent_units_go_back_into_their_window_cluster() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let store = RedisClusterStore::builder(support::cluster().urls())
        .prefix(support::unique_prefix("back"))
        .clock(clock.clone())
        .response_timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    unspent_units_go_back_into_their_window(&store, &clock).await;
}
