//! The memory store keeps the store contract: atomic stacked rules, exact counts under
//! concurrency, expiry, a bound on keys, and the reference model's decisions.

use std::sync::Arc;
use std::time::Duration;

use tollgate::Algorithm;
use tollgate::algorithm::{Limits, State};
use tollgate::clock::ManualClock;
use tollgate::key::Key;
use tollgate::store::RuleSpec;
use tollgate::store::{Charge, MemoryStore, Store};

fn spec(name: &str, algorithm: Algorithm, limit: u64, period: Duration) -> RuleSpec {
    let period = period.as_micros() as u64;
    RuleSpec::new(name, algorithm, Limits::new(limit, period, limit).unwrap()).unwrap()
}

fn check(store: &MemoryStore, charges: &[Charge<'_>]) -> tollgate::Decision {
    // The memory store decides synchronously: its future is `std::future::Ready`.
    store
        .check(charges)
        .into_inner()
        .expect("the memory store never fails")
}

/// Checks one rule for one key.
fn check_one(store: &MemoryStore, rule: &RuleSpec, key: &Key, cost: u64) -> tollgate::Decision {
    check(store, &[Charge { rule, key, cost }])
}

fn store_with(clock: &ManualClock, max_keys: usize) -> MemoryStore {
    MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(max_keys)
        .build()
        .unwrap()
}

#[test]
fn a_request_denied_by_one_rule_charges_no_other() {
    let clock = ManualClock::default();
    let store = store_with(&clock, 1000);
    let per_second = spec(
        "per-second",
        Algorithm::TokenBucket,
        2,
        Duration::from_secs(1),
    );
    let daily = spec(
        "daily",
        Algorithm::FixedWindow,
        5,
        Duration::from_secs(86_400),
    );
    // Keys chosen so that both rules land in many different shards across the loop.
    for n in 0..50 {
        let key = Key::text(format!("client-{n}"));
        let charges = [
            Charge {
                rule: &per_second,
                key: &key,
                cost: 1,
            },
            Charge {
                rule: &daily,
                key: &key,
                cost: 1,
            },
        ];
        assert!(check(&store, &charges).allowed());
        assert!(check(&store, &charges).allowed());
        // A burst of denials must not eat the daily quota.
        for _ in 0..100 {
            let decision = check(&store, &charges);
            assert!(!decision.allowed());
            assert!(!decision.outcomes()[0].allowed);
            assert!(
                decision.outcomes()[1].allowed,
                "the daily rule alone would admit it"
            );
        }
        let daily_alone = check_one(&store, &daily, &key, 0);
        assert_eq!(
            daily_alone.outcomes()[0].remaining,
            3,
            "only the 2 admitted requests were charged"
        );
    }
}

#[test]
fn concurrent_requests_for_one_key_admit_exactly_the_limit() {
    for algorithm in Algorithm::ALL {
        let clock = ManualClock::default();
        let store = store_with(&clock, 1000);
        let rule = Arc::new(spec("hot", algorithm, 100, Duration::from_secs(3600)));
        let admitted: usize = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    let store = store.clone();
                    let rule = rule.clone();
                    scope.spawn(move || {
                        let key = Key::text("one");
                        (0..125)
                            .filter(|_| check_one(&store, &rule, &key, 1).allowed())
                            .count()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(admitted, 100, "{algorithm}");
    }
}

#[test]
fn keys_expire_when_their_budget_is_full_again() {
    let clock = ManualClock::default();
    let store = store_with(&clock, 1000);
    let rule = spec("r", Algorithm::Gcra, 10, Duration::from_secs(10));
    for n in 0..20 {
        let key = Key::text(format!("k{n}"));
        assert!(check_one(&store, &rule, &key, 1).allowed());
    }
    assert_eq!(store.len(), 20);
    // One token takes 1 s to come back.
    clock.advance(Duration::from_millis(999));
    store.sweep();
    assert_eq!(store.len(), 20);
    clock.advance(Duration::from_millis(1));
    store.sweep();
    assert_eq!(store.len(), 0);
}

#[test]
fn expired_keys_are_dropped_as_the_store_is_used() {
    let clock = ManualClock::default();
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .shards(1)
        .build()
        .unwrap();
    let rule = spec("r", Algorithm::FixedWindow, 10, Duration::from_secs(1));
    for n in 0..100 {
        let key = Key::text(format!("k{n}"));
        check_one(&store, &rule, &key, 1);
    }
    assert_eq!(store.len(), 100);
    clock.advance(Duration::from_secs(2));
    // No manual sweep: the next check on the shard drops what expired.
    let key = Key::text("fresh");
    check_one(&store, &rule, &key, 1);
    assert_eq!(store.len(), 1);
}

#[test]
fn the_store_stays_within_max_keys_and_evicts_the_keys_closest_to_full() {
    let clock = ManualClock::default();
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .shards(1)
        .max_keys(100)
        .build()
        .unwrap();
    let short = spec("short", Algorithm::FixedWindow, 10, Duration::from_secs(1));
    let long = spec(
        "long",
        Algorithm::FixedWindow,
        10,
        Duration::from_secs(3600),
    );
    // 50 keys that will be full again within a second, 50 that need an hour.
    for n in 0..50 {
        let key = Key::text(format!("s{n}"));
        check_one(&store, &short, &key, 1);
        let key = Key::text(format!("l{n}"));
        check_one(&store, &long, &key, 5);
    }
    assert_eq!(store.len(), 100);
    for n in 0..1000 {
        let key = Key::text(format!("new{n}"));
        check_one(&store, &long, &key, 1);
        assert!(store.len() <= 100);
    }
    assert!(store.evictions() >= 950);
    // The keys whose budget was closest to full (the short-lived ones) went first.
    let probe = Key::text("s0");
    let d = check_one(&store, &short, &probe, 0);
    assert_eq!(
        d.outcomes()[0].remaining,
        10,
        "the short-lived key was evicted"
    );
}

#[test]
fn the_store_gives_the_reference_models_decisions() {
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    for algorithm in Algorithm::ALL {
        let clock = ManualClock::default();
        let store = store_with(&clock, 1000);
        let rule = spec("model", algorithm, 7, Duration::from_millis(900));
        let key = Key::text("k");
        let mut state: Option<State> = None;
        for _ in 0..2000 {
            clock.advance(Duration::from_micros(next(300_000)));
            let cost = next(3);
            let now = {
                use tollgate::clock::Clock;
                clock.now_micros()
            };
            let expected = algorithm.check(rule.limits(), state.as_ref(), now, cost);
            if expected.allowed {
                algorithm.commit(rule.limits(), &mut state, now, cost);
            }
            let got = check(
                &store,
                &[Charge {
                    rule: &rule,
                    key: &key,
                    cost,
                }],
            );
            assert_eq!(got.outcomes(), &[expected], "{algorithm}");
        }
    }
}

#[test]
fn bad_configuration_is_an_error_not_a_panic() {
    assert!(MemoryStore::builder().max_keys(0).build().is_err());
    // The largest bound is accepted, and a bound is never exceeded even when it does not divide
    // into the shards.
    assert!(MemoryStore::builder().max_keys(usize::MAX).build().is_ok());
    let clock = ManualClock::default();
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(65)
        .build()
        .unwrap();
    let rule = spec("r", Algorithm::FixedWindow, 10, Duration::from_secs(60));
    for n in 0..1000 {
        let key = Key::text(format!("k{n}"));
        check_one(&store, &rule, &key, 1);
        assert!(store.len() <= 65, "{} keys", store.len());
    }
    let err = MemoryStore::builder().shards(3).build().unwrap_err();
    assert!(err.to_string().contains("power of two"), "{err}");
}

/// A store smaller than one request's new keys (one key, two stacked rules) goes over its bound
/// for that request rather than failing it; the next request that brings new keys evicts.
#[tokio::test]
async fn a_store_smaller_than_one_request_still_decides() {
    let store = MemoryStore::builder().max_keys(1).build().unwrap();
    let limits = Limits::new(5, 1_000_000, 5).unwrap();
    let second = RuleSpec::new("second", Algorithm::TokenBucket, limits).unwrap();
    let first = RuleSpec::new("first", Algorithm::TokenBucket, limits).unwrap();
    let key = Key::text("client");
    let charges = [
        Charge {
            rule: &first,
            key: &key,
            cost: 1,
        },
        Charge {
            rule: &second,
            key: &key,
            cost: 1,
        },
    ];
    let decision = store.check(&charges).await.unwrap();
    assert!(decision.allowed());
    assert_eq!(store.len(), 2, "over the bound for this one request");
    let decision = store.check(&charges).await.unwrap();
    assert!(decision.allowed());
    assert_eq!(store.len(), 2, "known keys need no room");
    assert_eq!(store.evictions(), 0);
    let other = Key::text("other");
    let decision = store
        .check(&[
            Charge {
                rule: &first,
                key: &other,
                cost: 1,
            },
            Charge {
                rule: &second,
                key: &other,
                cost: 1,
            },
        ])
        .await
        .unwrap();
    assert!(decision.allowed());
    assert!(store.len() <= 2);
    assert_eq!(store.evictions(), 2, "new keys made room");
}

#[test]
fn a_stacked_check_does_not_scan_its_shards() {
    // One shard, so that every key shares it. A stacked check must only make room when the
    // shard would overflow: expired keys wait for the periodic sweep instead of being swept by
    // every request (a whole-shard scan under its lock).
    let clock = ManualClock::default();
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .shards(1)
        .build()
        .unwrap();
    let short = spec(
        "short",
        Algorithm::FixedWindow,
        10,
        Duration::from_millis(100),
    );
    let a = spec("a", Algorithm::TokenBucket, 10, Duration::from_secs(60));
    let b = spec("b", Algorithm::TokenBucket, 10, Duration::from_secs(60));
    // The first check sweeps (none was due yet) and schedules the next sweep a second later.
    check_one(&store, &short, &Key::text("expires-soon"), 1);
    assert_eq!(store.len(), 1);
    clock.advance(Duration::from_millis(200)); // expired, not swept yet
    let key = Key::text("client");
    let charges = [
        Charge {
            rule: &a,
            key: &key,
            cost: 1,
        },
        Charge {
            rule: &b,
            key: &key,
            cost: 1,
        },
    ];
    for _ in 0..3 {
        assert!(check(&store, &charges).allowed());
    }
    assert_eq!(
        store.len(),
        3,
        "the stacked checks swept the shard although no sweep was due and it was not full"
    );
    // The periodic sweep still drops it.
    clock.advance(Duration::from_secs(1));
    check(&store, &charges);
    assert_eq!(store.len(), 2);
}

#[test]
fn a_rule_that_denies_after_others_were_charged_puts_them_back() {
    // The store charges stacked rules one by one and puts back what it charged when a later
    // rule denies: every kind of key (known, new, a sliding log, the same key twice) must end as
    // it started.
    let clock = ManualClock::default();
    let store = store_with(&clock, 1000);
    let hour = Duration::from_secs(3600);
    let closed = spec("closed", Algorithm::FixedWindow, 1, hour);
    let tight = Key::text("tight");
    assert!(check_one(&store, &closed, &tight, 1).allowed()); // now full: it denies from here
    for algorithm in Algorithm::ALL {
        let open = spec("open", algorithm, 10, hour);
        for (n, known) in [false, true].into_iter().enumerate() {
            let key = Key::text(format!("{algorithm}-{n}"));
            if known {
                assert!(check_one(&store, &open, &key, 3).allowed());
            }
            let before = check_one(&store, &open, &key, 0).outcomes()[0];
            let len = store.len();
            for _ in 0..5 {
                let charges = [
                    Charge {
                        rule: &open,
                        key: &key,
                        cost: 2,
                    },
                    Charge {
                        rule: &open,
                        key: &key,
                        cost: 1,
                    },
                    Charge {
                        rule: &closed,
                        key: &tight,
                        cost: 1,
                    },
                ];
                let decision = check(&store, &charges);
                assert!(!decision.allowed(), "{algorithm}");
                // Every rule reports the budget as it stands.
                assert_eq!(
                    decision.outcomes()[0].remaining,
                    before.remaining,
                    "{algorithm}"
                );
                assert!(decision.outcomes()[0].allowed && !decision.outcomes()[2].allowed);
            }
            let after = check_one(&store, &open, &key, 0).outcomes()[0];
            assert_eq!(after, before, "{algorithm}, known key: {known}");
            assert_eq!(
                store.len(),
                len,
                "{algorithm}: a new key put back is removed"
            );
        }
    }
}
