//! The memory store and the Redis stores give identical decisions over random timelines, for
//! every algorithm, alone and stacked, on a standalone server and on a 3-primary cluster.
//!
//! Both stores read one shared `ManualClock` (the Redis stores pass its time to the script, which
//! otherwise reads the server's `TIME`), so every decision can be compared field by field.

mod support;

use std::time::Duration;

use tollgate::Algorithm;
use tollgate::Decision;
use tollgate::algorithm::{Limits, MAX_PERIOD_MICROS};
use tollgate::clock::ManualClock;
use tollgate::key::Key;
use tollgate::store::RuleSpec;
use tollgate::store::{Charge, MemoryStore, RedisClusterStore, RedisStore, Store};

/// A small deterministic generator (xorshift64*), so that a failure names its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn range(&mut self, low: u64, high: u64) -> u64 {
        low + self.below(high - low + 1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

fn random_limits(rng: &mut Rng, algorithm: Algorithm) -> Limits {
    let periods = [
        1_000,
        7_919,
        250_000,
        1_000_000,
        3_000_000,
        60_000_000,
        3_600_000_000,
    ];
    loop {
        let period = periods[rng.below(periods.len() as u64) as usize] + rng.below(3);
        let limit = if rng.chance(25) {
            rng.range(13, 1000)
        } else {
            rng.range(1, 12)
        };
        let burst = if algorithm.has_burst() && rng.chance(50) {
            rng.range(1, limit + 3)
        } else {
            limit
        };
        if let Ok(limits) = Limits::new(limit, period.min(MAX_PERIOD_MICROS), burst) {
            return limits;
        }
    }
}

/// One step of the clock: often none, often exactly to (or a microsecond before) the moment the
/// last decision named, sometimes a fraction of a period, sometimes whole periods.
fn advance(rng: &mut Rng, clock: &ManualClock, rules: &[RuleSpec], last: Option<&Decision>) {
    let rule = rng.below(rules.len() as u64) as usize;
    let limits = rules[rule].limits();
    let period = limits.period;
    let edge = last.and_then(|d| d.outcomes().get(rule)).map(|o| {
        let at = if o.retry_after != 0 && o.retry_after != u64::MAX && rng.chance(60) {
            o.retry_after
        } else {
            o.reset
        };
        if rng.chance(50) {
            at
        } else {
            at.saturating_sub(1)
        }
    });
    let micros = match rng.below(12) {
        0 | 1 => 0,
        2..=5 => edge.unwrap_or(0),
        6 => limits.interval * rng.range(1, 3),
        7 | 8 => rng.range(1, period / 3 + 1),
        9 => rng.range(1, period),
        10 => rng.range(period, 3 * period),
        _ => rng.range(1, 10),
    };
    clock.advance(Duration::from_micros(micros));
}

fn random_cost(rng: &mut Rng, rule: &RuleSpec) -> u64 {
    let capacity = rule.algorithm().capacity(rule.limits());
    match rng.below(10) {
        0 => 0,
        1 => capacity + 1,
        2 | 3 => rng.range(1, capacity),
        _ => 1,
    }
}

/// What to compare.
struct Plan {
    name: &'static str,
    seed: u64,
    timelines: u64,
    steps: u64,
    algorithms: &'static [Algorithm],
    /// Two or three rules per request.
    stacked: bool,
    /// The rules of one request count different identities (different cluster slots).
    distinct_identities: bool,
}

/// Runs `timelines` random timelines of `steps` checks through the memory store and the store
/// made by `redis`, and compares every decision.
async fn compare<S, F, Fut>(plan: Plan, redis: F)
where
    S: Store,
    F: Fn(ManualClock, String) -> Fut,
    Fut: std::future::Future<Output = S>,
{
    let Plan {
        name,
        seed,
        timelines,
        steps,
        algorithms,
        stacked,
        distinct_identities,
    } = plan;
    let mut rng = Rng(seed);
    let mut compared = 0u64;
    for timeline in 0..timelines {
        let clock = ManualClock::new(1_700_000_000_000_000 + rng.below(1 << 40));
        let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let prefix = support::unique_prefix(name);
        let redis = redis(clock.clone(), prefix).await;
        let count = if stacked { rng.range(2, 3) } else { 1 };
        let rules: Vec<RuleSpec> = (0..count)
            .map(|i| {
                let algorithm = algorithms[rng.below(algorithms.len() as u64) as usize];
                RuleSpec::new(
                    format!("r{i}"),
                    algorithm,
                    random_limits(&mut rng, algorithm),
                )
                .unwrap()
            })
            .collect();
        let keys: Vec<Key> = (0..count)
            .map(|i| {
                if distinct_identities && i > 0 {
                    Key::text(format!("user-{timeline}-{i}"))
                } else {
                    Key::text(format!("user-{timeline}"))
                }
            })
            .collect();
        let mut last: Option<Decision> = None;
        for step in 0..steps {
            advance(&mut rng, &clock, &rules, last.as_ref());
            let charges: Vec<Charge<'_>> = rules
                .iter()
                .zip(&keys)
                .map(|(rule, key)| Charge {
                    rule,
                    key,
                    cost: random_cost(&mut rng, rule),
                })
                .collect();
            let expected: Decision = memory.check(&charges).await.unwrap();
            let actual: Decision = redis.check(&charges).await.unwrap_or_else(|e| {
                panic!("{name}: seed {seed}, timeline {timeline}, step {step}: {e}")
            });
            assert_eq!(
                actual,
                expected,
                "{name}: seed {seed}, timeline {timeline}, step {step}\n rules: {rules:?}\n \
                 charges: {:?}",
                charges.iter().map(|c| c.cost).collect::<Vec<_>>()
            );
            compared += 1;
            last = Some(expected);
        }
    }
    assert_eq!(compared, timelines * steps);
}

async fn standalone(clock: ManualClock, prefix: String) -> RedisStore {
    RedisStore::builder(support::standalone().url())
        .prefix(prefix)
        .response_timeout(Duration::from_secs(10))
        .clock(clock)
        .connect()
        .await
        .unwrap()
}

async fn cluster(clock: ManualClock, prefix: String) -> RedisClusterStore {
    RedisClusterStore::builder(support::cluster().urls())
        .prefix(prefix)
        .response_timeout(Duration::from_secs(10))
        .clock(clock)
        .connect()
        .await
        .unwrap()
}

const TIMELINES: u64 = 60;
const STEPS: u64 = 80;

macro_rules! differential {
    ($standalone:ident, $cluster:ident, $algorithm:expr, $seed:expr) => {
        #[tokio::test]
        async fn $standalone() {
            compare(
                Plan {
                    name: stringify!($standalone),
                    seed: $seed,
                    timelines: TIMELINES,
                    steps: STEPS,
                    algorithms: &[$algorithm; 1],
                    stacked: false,
                    distinct_identities: false,
                },
                standalone,
            )
            .await;
        }

        #[tokio::test]
        async fn $cluster() {
            compare(
                Plan {
                    name: stringify!($cluster),
                    seed: $seed + 1,
                    timelines: TIMELINES / 2,
                    steps: STEPS,
                    algorithms: &[$algorithm; 1],
                    stacked: false,
                    distinct_identities: false,
                },
                cluster,
            )
            .await;
        }
    };
}

differential!(
    standalone_token_bucket_matches_the_model,
    cluster_token_bucket_matches_the_model,
    Algorithm::TokenBucket,
    0x7011_6a7e_0001
);
differential!(
    standalone_gcra_matches_the_model,
    cluster_gcra_matches_the_model,
    Algorithm::Gcra,
    0x7011_6a7e_0101
);
differential!(
    standalone_fixed_window_matches_the_model,
    cluster_fixed_window_matches_the_model,
    Algorithm::FixedWindow,
    0x7011_6a7e_0201
);
differential!(
    standalone_sliding_log_matches_the_model,
    cluster_sliding_log_matches_the_model,
    Algorithm::SlidingWindowLog,
    0x7011_6a7e_0301
);
differential!(
    standalone_sliding_counter_matches_the_model,
    cluster_sliding_counter_matches_the_model,
    Algorithm::SlidingWindowCounter,
    0x7011_6a7e_0401
);

differential!(
    standalone_concurrency_matches_the_model,
    cluster_concurrency_matches_the_model,
    Algorithm::Concurrency,
    0x7011_6a7e_0501
);

#[tokio::test]
async fn standalone_stacked_rules_match_the_model() {
    compare(
        Plan {
            name: "standalone_stacked",
            seed: 0x7011_6a7e_0501,
            timelines: TIMELINES,
            steps: STEPS,
            algorithms: &Algorithm::ALL,
            stacked: true,
            distinct_identities: false,
        },
        standalone,
    )
    .await;
}

#[tokio::test]
async fn cluster_stacked_rules_of_one_caller_match_the_model() {
    compare(
        Plan {
            name: "cluster_stacked",
            seed: 0x7011_6a7e_0601,
            timelines: TIMELINES / 2,
            steps: STEPS,
            algorithms: &Algorithm::ALL,
            stacked: true,
            distinct_identities: false,
        },
        cluster,
    )
    .await;
}

#[tokio::test]
async fn cluster_stacked_rules_across_slots_match_the_model() {
    compare(
        Plan {
            name: "cluster_cross_slot",
            seed: 0x7011_6a7e_0701,
            timelines: TIMELINES / 2,
            steps: STEPS,
            algorithms: &Algorithm::ALL,
            stacked: true,
            distinct_identities: true,
        },
        cluster,
    )
    .await;
}

/// The sliding window counter weighs the previous window in `f64`; the script must round exactly
/// like the model. These cases are the ones where another order of the same operations
/// (`previous * ((period - elapsed) / period)`) would round to another integer.
#[tokio::test]
async fn standalone_sliding_counter_rounds_like_the_model() {
    let period: u64 = 1000;
    let limit: u64 = 1000;
    let mut cases = Vec::new();
    'search: for previous in 1..=limit {
        for elapsed in 0..period {
            let model = (previous as f64) * ((period - elapsed) as f64) / (period as f64);
            let other = (previous as f64) * (((period - elapsed) as f64) / (period as f64));
            if model.floor() != other.floor() {
                cases.push((previous, elapsed));
                if cases.len() == 8 {
                    break 'search;
                }
            }
        }
    }
    assert_eq!(
        cases.len(),
        8,
        "no case where the order of operations matters"
    );
    let limits = Limits::new(limit, period, limit).unwrap();
    let rule = RuleSpec::new("sc", Algorithm::SlidingWindowCounter, limits).unwrap();
    for (i, &(previous, elapsed)) in cases.iter().enumerate() {
        let start = 1_700_000_000_000_000 / period * period;
        let clock = ManualClock::new(start);
        let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let redis = standalone(clock.clone(), support::unique_prefix("rounding")).await;
        let key = Key::text(format!("case-{i}"));
        let charge = |cost| {
            [Charge {
                rule: &rule,
                key: &key,
                cost,
            }]
        };
        let first = redis.check(&charge(previous)).await.unwrap();
        assert_eq!(first, memory.check(&charge(previous)).await.unwrap());
        clock.set(start + period + elapsed);
        let expected = memory.check(&charge(0)).await.unwrap();
        let actual = redis.check(&charge(0)).await.unwrap();
        assert_eq!(actual, expected, "previous {previous}, elapsed {elapsed}");
    }
}

/// The calls of tollgate's code `server` has run: `FCALL`s, or `EVALSHA`s on a server without
/// functions.
fn code_calls(server: &support::RedisServer) -> u64 {
    support::server().code_calls(server)
}

/// Concurrent checks go to Redis in batches (one call decides many requests, each at its own
/// time): they decide as the model does, one after the other in the order they were made.
#[tokio::test]
async fn standalone_batched_checks_match_the_model_one_by_one() {
    let mut rng = Rng(0xba7c);
    // A server of its own, to count the calls.
    let server = support::RedisServer::start();
    for algorithm in Algorithm::ALL {
        let clock = ManualClock::new(1_700_000_000_000_000);
        let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        // One connection, one call out at a time: checks reach Redis in the order they were
        // made (with two, two calls race, as concurrent requests may).
        let redis = RedisStore::builder(server.url())
            .pool_size(1)
            .response_timeout(Duration::from_secs(10))
            .clock(clock.clone())
            .connect()
            .await
            .unwrap();
        for round in 0..10 {
            let rule =
                RuleSpec::new("batched", algorithm, random_limits(&mut rng, algorithm)).unwrap();
            let key = Key::text(format!("batched-{round}"));
            let costs: Vec<u64> = (0..40).map(|_| random_cost(&mut rng, &rule)).collect();
            // Each check reads its time when it is made; the clock moves between them.
            let mut checks = Vec::new();
            let mut expected = Vec::new();
            for &cost in &costs {
                let charge = [Charge {
                    rule: &rule,
                    key: &key,
                    cost,
                }];
                checks.push(redis.check(&charge));
                expected.push(memory.check(&charge).await.unwrap());
                clock.advance(Duration::from_micros(rng.below(rule.limits().interval * 2)));
            }
            let actual = futures_util::future::join_all(checks).await;
            for (i, (actual, expected)) in actual.into_iter().zip(expected).enumerate() {
                assert_eq!(
                    actual.unwrap(),
                    expected,
                    "{algorithm}, round {round}, check {i}, costs {costs:?}"
                );
            }
        }
    }
    let calls = code_calls(&server);
    let checks = 5 * 10 * 40;
    assert!(
        calls * 4 < checks,
        "{calls} calls for {checks} checks: batched"
    );
}

/// A batch reads and writes a hot key once, however many of its checks the key has (token
/// bucket and GCRA, whose keys hold one number): far fewer writes than admitted checks, each
/// decision the model's one by one, and the value written the one they leave (the next
/// check and a peek say so).
#[tokio::test]
async fn a_batch_reads_and_writes_a_hot_key_once() {
    let server = support::RedisServer::start();
    let mut conn = server.conn();
    let writes_of = |conn: &mut redis::Connection| {
        support::command_calls(conn, "set") + support::command_calls(conn, "del")
    };
    for (round, algorithm) in [Algorithm::TokenBucket, Algorithm::Gcra]
        .into_iter()
        .enumerate()
    {
        let clock = ManualClock::new(1_700_000_000_000_000);
        let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let redis = RedisStore::builder(server.url())
            .pool_size(1)
            .deny_cache(0)
            .response_timeout(Duration::from_secs(10))
            .prefix(support::unique_prefix("hot-batch"))
            .clock(clock.clone())
            .connect()
            .await
            .unwrap();
        // 30 of the 40 checks are admitted.
        let rule =
            RuleSpec::new("hot", algorithm, Limits::new(10, 1_000_000, 30).unwrap()).unwrap();
        let key = Key::text(format!("hot-{round}"));
        let charge = [Charge {
            rule: &rule,
            key: &key,
            cost: 1,
        }];
        let (calls, writes) = (code_calls(&server), writes_of(&mut conn));
        let checks: Vec<_> = (0..40).map(|_| redis.check(&charge)).collect();
        let mut expected = Vec::new();
        for _ in 0..40 {
            expected.push(memory.check(&charge).await.unwrap());
        }
        let actual = futures_util::future::join_all(checks).await;
        for (i, (actual, expected)) in actual.into_iter().zip(expected).enumerate() {
            assert_eq!(actual.unwrap(), expected, "{algorithm}, check {i}");
        }
        let calls = code_calls(&server) - calls;
        let writes = writes_of(&mut conn) - writes;
        assert!(
            calls < 10,
            "{algorithm}: {calls} calls for 40 checks: batched"
        );
        assert!(
            writes <= calls,
            "{algorithm}: {writes} writes of the key in {calls} calls that admitted 30 checks"
        );
        clock.advance(Duration::from_millis(250));
        assert_eq!(
            redis.peek(&charge).await.unwrap(),
            memory.peek(&charge).await.unwrap(),
            "{algorithm}: the state the batch wrote"
        );
        assert_eq!(
            redis.check(&charge).await.unwrap(),
            memory.check(&charge).await.unwrap(),
            "{algorithm}: the next check"
        );
    }
}

/// Batches decided on the server's clock (no clock injected: one `TIME` per call, a charge
/// argument per check, or one for the whole batch when its checks share one rule and cost):
/// each decision equals the model's at the time the call was made, the decisions replayed in
/// the order Redis made them.
#[tokio::test]
async fn standalone_batches_on_the_server_clock_match_the_model() {
    let mut rng = Rng(0x5e7e);
    let server = support::RedisServer::start();
    let redis = RedisStore::builder(server.url())
        .pool_size(1)
        .deny_cache(0)
        .response_timeout(Duration::from_secs(10))
        .prefix(support::unique_prefix("server-clock"))
        .connect()
        .await
        .unwrap();
    let mut checks_made = 0u64;
    for algorithm in Algorithm::ALL {
        let clock = ManualClock::new(0);
        let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        for round in 0..6 {
            let rules: Vec<RuleSpec> = (0..3)
                .map(|i| {
                    RuleSpec::new(
                        format!("server-clock-{algorithm}-{round}-{i}"),
                        algorithm,
                        random_limits(&mut rng, algorithm),
                    )
                    .unwrap()
                })
                .collect();
            let keys: Vec<Key> = (0..5)
                .map(|i| Key::text(format!("server-clock-{algorithm}-{round}-{i}")))
                .collect();
            // Even rounds: one rule, one unit each (the shared charge); odd ones: any rule, any
            // cost.
            let plan: Vec<(usize, usize, u64)> = (0..40)
                .map(|_| {
                    let key = rng.below(5) as usize;
                    if round % 2 == 0 {
                        (0, key, 1)
                    } else {
                        let rule = rng.below(3) as usize;
                        (rule, key, random_cost(&mut rng, &rules[rule]))
                    }
                })
                .collect();
            let checks = plan.iter().map(|&(rule, key, cost)| {
                let redis = &redis;
                let (rule, key) = (&rules[rule], &keys[key]);
                async move { redis.check(&[Charge { rule, key, cost }]).await.unwrap() }
            });
            let actual = futures_util::future::join_all(checks).await;
            checks_made += plan.len() as u64;
            // The order Redis made them in: by the time of their call, then as they were made.
            let mut order: Vec<usize> = (0..plan.len()).collect();
            order.sort_by_key(|&i| actual[i].made_at());
            for i in order {
                let (rule, key, cost) = plan[i];
                assert!(actual[i].made_at() > 0, "the server's time");
                clock.set(actual[i].made_at());
                let expected = memory
                    .check(&[Charge {
                        rule: &rules[rule],
                        key: &keys[key],
                        cost,
                    }])
                    .await
                    .unwrap();
                assert_eq!(
                    actual[i], expected,
                    "{algorithm}, round {round}, check {i} (rule {rule}, key {key}, cost {cost})"
                );
            }
        }
    }
    let calls = code_calls(&server);
    assert!(
        calls * 4 < checks_made,
        "{calls} calls for {checks_made} checks: batched"
    );
}

/// A hot key's checks of one batch, on the server's clock, are decided and answered as one run
/// (token bucket and GCRA): each answer is the model's one by one, across the first denial
/// of a run, for costs of none, one unit and more, and the state the run leaves is the model's.
#[tokio::test]
async fn a_hot_keys_run_of_checks_matches_the_model_one_by_one() {
    let server = support::RedisServer::start();
    let redis = RedisStore::builder(server.url())
        .pool_size(1)
        .deny_cache(0)
        .response_timeout(Duration::from_secs(10))
        .prefix(support::unique_prefix("runs"))
        .connect()
        .await
        .unwrap();
    let calls_before = code_calls(&server);
    let mut checks_made = 0u64;
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
        for cost in [0, 1, 3] {
            let clock = ManualClock::new(0);
            let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
            // 25 units: a batch of 40 is admitted up to its 25th unit, then denied.
            let rule = RuleSpec::new(
                format!("run-{algorithm}-{cost}"),
                algorithm,
                Limits::new(10, 1_000_000, 25).unwrap(),
            )
            .unwrap();
            let key = Key::text(format!("run-{algorithm}-{cost}"));
            let charge = [Charge {
                rule: &rule,
                key: &key,
                cost,
            }];
            for wave in 0..3 {
                let actual =
                    futures_util::future::join_all((0..40).map(|_| redis.check(&charge))).await;
                let actual: Vec<Decision> = actual.into_iter().map(Result::unwrap).collect();
                checks_made += actual.len() as u64;
                // The order Redis made them in: by the time of their call, then as they were
                // made.
                let mut order: Vec<usize> = (0..actual.len()).collect();
                order.sort_by_key(|&i| actual[i].made_at());
                for i in order {
                    clock.set(actual[i].made_at());
                    let expected = memory.check(&charge).await.unwrap();
                    assert_eq!(
                        actual[i], expected,
                        "{algorithm}, cost {cost}, wave {wave}, check {i}"
                    );
                }
                assert!(
                    actual.iter().any(Decision::allowed) || wave > 0,
                    "{algorithm}, cost {cost}: the first wave admits"
                );
                assert!(
                    cost == 0 || actual.iter().any(|d| !d.allowed()),
                    "{algorithm}, cost {cost}, wave {wave}: a run goes past its first denial"
                );
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
        }
    }
    let calls = code_calls(&server) - calls_before;
    assert!(
        calls * 4 < checks_made,
        "{calls} calls for {checks_made} checks: batched"
    );
}

/// The decisions of `charges` sent together (their order kept in one call), each equal to the
/// model's at the time of its call, replayed in the order Redis made them.
async fn batch_matches_the_model(
    redis: &RedisStore,
    memory: &MemoryStore,
    clock: &ManualClock,
    charges: &[Charge<'_>],
    what: &str,
) -> Vec<Decision> {
    let actual = futures_util::future::join_all(
        charges
            .iter()
            .map(|charge| redis.check(std::slice::from_ref(charge))),
    )
    .await;
    let actual: Vec<Decision> = actual.into_iter().map(Result::unwrap).collect();
    let mut order: Vec<usize> = (0..actual.len()).collect();
    order.sort_by_key(|&i| actual[i].made_at());
    for i in order {
        clock.set(actual[i].made_at());
        let expected = memory
            .check(std::slice::from_ref(&charges[i]))
            .await
            .unwrap();
        assert_eq!(actual[i], expected, "{what}, check {i}");
    }
    actual
}

/// Runs of one key apart in one call (its state carried between them), runs over a debt (a
/// forced charge past the budget), and runs over a key that holds another algorithm's value:
/// each answer is the model's.
#[tokio::test]
async fn runs_apart_over_debts_and_over_another_algorithms_value_match_the_model() {
    use tollgate::store::{Adjustment, Change};

    let server = support::RedisServer::start();
    let redis = RedisStore::builder(server.url())
        .pool_size(1)
        .deny_cache(0)
        .response_timeout(Duration::from_secs(10))
        .prefix(support::unique_prefix("runs-apart"))
        .connect()
        .await
        .unwrap();
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
        let clock = ManualClock::new(0);
        let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let rule = RuleSpec::new(
            format!("apart-{algorithm}"),
            algorithm,
            Limits::new(10, 1_000_000, 25).unwrap(),
        )
        .unwrap();
        let (a, b) = (
            Key::text(format!("a-{algorithm}")),
            Key::text(format!("b-{algorithm}")),
        );
        let charge = |key: &'static Key, cost| Charge {
            rule: &rule,
            key,
            cost,
        };
        let (a, b): (&'static Key, &'static Key) = (Box::leak(Box::new(a)), Box::leak(Box::new(b)));
        // A's runs apart, B's between them (one charge: runs); 27 units of A's 25 asked: its
        // last run is denied.
        let apart: Vec<Charge> = [a, a, a, b, b, a, a, a, a, b, a, a]
            .iter()
            .map(|key| charge(key, 3))
            .collect();
        batch_matches_the_model(
            &redis,
            &memory,
            &clock,
            &apart,
            &format!("{algorithm}, apart"),
        )
        .await;
        // A debt: 60 units more than A holds, whatever its budget.
        let debt = [Adjustment {
            rule: &rule,
            key: a,
            change: Change::Charge(60),
            charged_at: 0,
        }];
        redis.adjust(&debt).await.unwrap();
        memory.adjust(&debt).await.unwrap();
        for cost in [1, 0] {
            let over_debt: Vec<Charge> = (0..4).map(|_| charge(a, cost)).collect();
            let what = format!("{algorithm}, over a debt, cost {cost}");
            let decided = batch_matches_the_model(&redis, &memory, &clock, &over_debt, &what).await;
            if cost > 0 {
                assert!(!decided[0].allowed(), "{what}: the debt denies a unit");
            }
        }
    }
    // A key that holds another algorithm's value: the other algorithm's rule of the same name
    // and key starts from no state, as the model's rule of its own does.
    let clock = ManualClock::new(0);
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let limits = Limits::new(10, 1_000_000, 25).unwrap();
    let gcra = RuleSpec::new("switched", Algorithm::Gcra, limits).unwrap();
    let bucket = RuleSpec::new("switched", Algorithm::TokenBucket, limits).unwrap();
    let key = Key::text("switched");
    let gcra_charges: Vec<Charge> = (0..5)
        .map(|_| Charge {
            rule: &gcra,
            key: &key,
            cost: 2,
        })
        .collect();
    batch_matches_the_model(&redis, &memory, &clock, &gcra_charges, "gcra first").await;
    let bucket_charges: Vec<Charge> = (0..30)
        .map(|_| Charge {
            rule: &bucket,
            key: &key,
            cost: 1,
        })
        .collect();
    batch_matches_the_model(
        &redis,
        &memory,
        &clock,
        &bucket_charges,
        "then token bucket",
    )
    .await;
}

/// An ACL user that may not `MGET` gets the same decisions (a batch then reads its keys one
/// by one).
#[tokio::test]
async fn a_user_that_may_not_mget_gets_the_same_decisions() {
    let server = support::RedisServer::start();
    let prefix = support::unique_prefix("no-mget");
    // The code runs as a function library where the server has functions, as a script where
    // it has not (Redis 6.2).
    let code: &[&str] = if support::server().has_functions() {
        &["+fcall", "+function|load"]
    } else {
        &["+evalsha", "+script|load"]
    };
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("no-mget")
        .arg("on")
        .arg(">secret")
        .arg(format!("~{prefix}:*"))
        .arg("resetchannels")
        .arg(format!("&{prefix}:forget"))
        .arg("-@all")
        .arg("+time")
        .arg("+get")
        .arg("+set")
        .arg("+del")
        .arg("+pexpire")
        .arg(code)
        .arg("+ping")
        .arg("+publish")
        .arg("+subscribe")
        .query(&mut server.conn())
        .unwrap();
    let redis = RedisStore::builder(server.url())
        .credentials("no-mget", "secret")
        .pool_size(1)
        .deny_cache(0)
        .response_timeout(Duration::from_secs(10))
        .prefix(&prefix)
        .connect()
        .await
        .unwrap();
    let clock = ManualClock::new(0);
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let rule = RuleSpec::new(
        "no-mget",
        Algorithm::TokenBucket,
        Limits::new(3, 1_000_000, 3).unwrap(),
    )
    .unwrap();
    let keys: Vec<Key> = (0..4).map(|i| Key::text(format!("k{i}"))).collect();
    let charges: Vec<Charge> = (0..20)
        .map(|i| Charge {
            rule: &rule,
            key: &keys[i % keys.len()],
            cost: 1,
        })
        .collect();
    let decided = batch_matches_the_model(&redis, &memory, &clock, &charges, "no MGET").await;
    assert_eq!(decided.iter().filter(|d| d.allowed()).count(), 12);
    let refused: Vec<redis::Value> = redis::cmd("ACL")
        .arg("LOG")
        .query(&mut server.conn())
        .unwrap();
    assert!(
        format!("{refused:?}").contains("mget"),
        "the batch asked for MGET and was refused: {refused:?}"
    );
}

/// Costs settled after the fact (a refund of what was not used, a forced charge of the rest,
/// into debt, bounded however large): Redis holds them as the model does, over random
/// timelines of estimates and real costs settled at once or later (across a window's end), for
/// every algorithm that settles.
async fn settle_matches_the_model<S, F, Fut>(redis: F, name: &str)
where
    S: Store,
    F: Fn(ManualClock, String) -> Fut,
    Fut: std::future::Future<Output = S>,
{
    use tollgate::store::{Adjustment, Change};

    let mut rng = Rng(0x005e_771e);
    let algorithms = [
        Algorithm::TokenBucket,
        Algorithm::Gcra,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindowCounter,
    ];
    for timeline in 0..24 {
        let algorithm = algorithms[timeline % algorithms.len()];
        let clock = ManualClock::new(1_700_000_000_000_000 + rng.below(1 << 40));
        let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let redis = redis(clock.clone(), support::unique_prefix(name)).await;
        let rule = RuleSpec::new("settled", algorithm, random_limits(&mut rng, algorithm)).unwrap();
        let key = Key::text(format!("settled-{timeline}"));
        let mut last: Option<Decision> = None;
        for step in 0..60 {
            advance(&mut rng, &clock, std::slice::from_ref(&rule), last.as_ref());
            let estimate = random_cost(&mut rng, &rule);
            let charge = [Charge {
                rule: &rule,
                key: &key,
                cost: estimate,
            }];
            let expected = memory.check(&charge).await.unwrap();
            let actual = redis.check(&charge).await.unwrap();
            assert_eq!(
                actual, expected,
                "{name} {algorithm}: timeline {timeline}, step {step}"
            );
            if expected.allowed() && estimate > 0 {
                // The response may come later, in another window than the one that counted.
                if rng.chance(40) {
                    advance(
                        &mut rng,
                        &clock,
                        std::slice::from_ref(&rule),
                        Some(&expected),
                    );
                }
                // Near the end of a timeline, a cost far past any budget: the debt is bounded
                // alike.
                let real = if step >= 56 && rng.chance(30) {
                    u64::MAX / 2 + rng.below(1_000)
                } else {
                    rng.below(estimate * 3 + 1)
                };
                let change = if real > estimate {
                    Change::Charge(real - estimate)
                } else {
                    Change::Refund(estimate - real)
                };
                let adjust = |decision: &Decision| {
                    [Adjustment {
                        rule: &rule,
                        key: &key,
                        change,
                        charged_at: decision.made_at(),
                    }]
                };
                memory.adjust(&adjust(&expected)).await.unwrap();
                redis.adjust(&adjust(&actual)).await.unwrap();
            }
            // The budget after the settle, as a peek sees it.
            let peek = [Charge {
                rule: &rule,
                key: &key,
                cost: 1,
            }];
            let expected_peek = memory.peek(&peek).await.unwrap();
            let actual_peek = redis.peek(&peek).await.unwrap();
            assert_eq!(
                actual_peek, expected_peek,
                "{name} {algorithm}: after step {step}"
            );
            last = Some(expected);
        }
    }
}

#[tokio::test]
async fn standalone_settled_costs_match_the_model() {
    settle_matches_the_model(standalone, "standalone").await;
}

#[tokio::test]
async fn cluster_settled_costs_match_the_model() {
    settle_matches_the_model(cluster, "cluster").await;
}

/// Quotas past 2^32 (ten billion tokens a month) count exactly, charged, forced into debt and
/// given back, on Redis as in the model.
#[tokio::test]
async fn standalone_quotas_past_two_to_the_32_match_the_model() {
    use tollgate::store::{Adjustment, Change};

    let month = 30 * 24 * 3600 * 1_000_000;
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::TokenBucket,
        Algorithm::Gcra,
    ] {
        let clock = ManualClock::new(1_700_000_000_000_000);
        let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let redis = standalone(clock.clone(), support::unique_prefix("big")).await;
        let limits = Limits::new(10_000_000_000, month, 10_000_000_000).unwrap();
        let rule = RuleSpec::new("big", algorithm, limits).unwrap();
        let key = Key::text("big-tenant");
        let charge = |cost| {
            [Charge {
                rule: &rule,
                key: &key,
                cost,
            }]
        };
        for (step, cost) in [6_000_000_000, 4_000_000_000, 1, 0].into_iter().enumerate() {
            let expected = memory.check(&charge(cost)).await.unwrap();
            let actual = redis.check(&charge(cost)).await.unwrap();
            assert_eq!(actual, expected, "{algorithm}: step {step}");
            clock.advance(Duration::from_secs(1));
        }
        for change in [Change::Charge(u64::MAX / 4), Change::Refund(3_000_000_000)] {
            let adjust = [Adjustment {
                rule: &rule,
                key: &key,
                change,
                charged_at: 0,
            }];
            memory.adjust(&adjust).await.unwrap();
            redis.adjust(&adjust).await.unwrap();
            let expected = memory.peek(&charge(1)).await.unwrap();
            let actual = redis.peek(&charge(1)).await.unwrap();
            assert_eq!(actual, expected, "{algorithm}: after {change:?}");
        }
    }
}

/// Concurrency holds taken and given back (at their own time, now or after their hold expired,
/// out of order), over random timelines whose clock sometimes steps back: Redis holds what the
/// model holds.
async fn holds_match_the_model<S, F, Fut>(redis: F, name: &str)
where
    S: Store,
    F: Fn(ManualClock, String) -> Fut,
    Fut: std::future::Future<Output = S>,
{
    use tollgate::store::{Adjustment, Change};

    let mut rng = Rng(0x00c0_ffee);
    for timeline in 0..16 {
        let clock = ManualClock::new(1_700_000_000_000_000 + rng.below(1 << 40));
        let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let redis = redis(clock.clone(), support::unique_prefix(name)).await;
        let limits = random_limits(&mut rng, Algorithm::Concurrency);
        let rule = RuleSpec::new("held", Algorithm::Concurrency, limits).unwrap();
        let key = Key::text(format!("held-{timeline}"));
        // What each store says it took, and when: given back in any order.
        let mut held: Vec<(u64, u64, u64)> = Vec::new();
        let mut last: Option<Decision> = None;
        for step in 0..80 {
            advance(&mut rng, &clock, std::slice::from_ref(&rule), last.as_ref());
            if rng.chance(8) {
                // The clock steps back a little: holds stay in order.
                use tollgate::clock::Clock;
                clock.set(clock.now_micros() - rng.range(1, 2_000));
            }
            if !held.is_empty() && rng.chance(40) {
                let (cost, memory_at, redis_at) =
                    held.remove(rng.below(held.len() as u64) as usize);
                let give = |at| {
                    [Adjustment {
                        rule: &rule,
                        key: &key,
                        change: Change::Refund(cost),
                        charged_at: at,
                    }]
                };
                memory.adjust(&give(memory_at)).await.unwrap();
                redis.adjust(&give(redis_at)).await.unwrap();
            }
            let cost = random_cost(&mut rng, &rule);
            let charge = [Charge {
                rule: &rule,
                key: &key,
                cost,
            }];
            let expected = memory.check(&charge).await.unwrap();
            let actual = redis.check(&charge).await.unwrap();
            assert_eq!(actual, expected, "{name}: timeline {timeline}, step {step}");
            if expected.allowed() && cost > 0 {
                held.push((cost, expected.made_at(), actual.made_at()));
            }
            last = Some(expected);
        }
    }
}

#[tokio::test]
async fn standalone_concurrency_holds_match_the_model() {
    holds_match_the_model(standalone, "standalone").await;
}

#[tokio::test]
async fn cluster_concurrency_holds_match_the_model() {
    holds_match_the_model(cluster, "cluster").await;
}
