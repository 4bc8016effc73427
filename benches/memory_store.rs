//! Memory-store decision cost, side by side with governor's keyed limiter in the same run.
//!
//! ```text
//! cargo bench --bench memory_store
//! ```
//!
//! Each group measures one decision: on one hot key, and cycling over 100,000 IPv4 keys; allowed
//! (a quota nobody reaches) and denied (a quota of one per hour). Both limiters use their default
//! clock. `1m_keys_stacked` measures tollgate alone over 1,000,000 clients with 1, 2 (per IP and
//! `Global`, the README's example) and 4 stacked rules.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::num::NonZeroU32;

use criterion::{Criterion, criterion_group, criterion_main};

#[path = "support/stacked.rs"]
mod stacked;
use governor::{Quota as GQuota, RateLimiter};
use tollgate::Algorithm;
use tollgate::algorithm::Limits;
use tollgate::key::Key;
use tollgate::store::RuleSpec;
use tollgate::store::{Charge, MemoryStore, Store};

const KEYS: usize = 100_000;

fn ips() -> Vec<IpAddr> {
    (0..KEYS as u32)
        .map(|i| IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i * 7)))
        .collect()
}

/// A quota nobody reaches in a benchmark: 1 per µs with a burst of 10^9.
fn open_limits() -> Limits {
    Limits::new(1_000_000, 1_000_000, 1_000_000_000).unwrap()
}

/// One per hour: everything after the first request is denied.
fn closed_limits() -> Limits {
    Limits::new(1, 3_600_000_000, 1).unwrap()
}

fn tollgate_check(store: &MemoryStore, rule: &RuleSpec, key: &Key) -> bool {
    store
        .check(&[Charge { rule, key, cost: 1 }])
        .into_inner()
        .unwrap()
        .allowed()
}

fn governor_open() -> governor::DefaultKeyedRateLimiter<IpAddr> {
    RateLimiter::keyed(
        GQuota::per_second(NonZeroU32::new(1_000_000).unwrap())
            .allow_burst(NonZeroU32::new(1_000_000_000).unwrap()),
    )
}

fn governor_closed() -> governor::DefaultKeyedRateLimiter<IpAddr> {
    RateLimiter::keyed(GQuota::per_hour(NonZeroU32::new(1).unwrap()))
}

fn bench(c: &mut Criterion) {
    let ips = ips();
    let keys: Vec<Key> = ips.iter().map(|ip| Key::ip(*ip)).collect();
    let hot_ip = ips[0];
    let hot_key = Key::ip(hot_ip);

    for (group_name, allow) in [("hot_key_allowed", true), ("hot_key_denied", false)] {
        let mut group = c.benchmark_group(group_name);
        let limits = if allow {
            open_limits()
        } else {
            closed_limits()
        };
        for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
            let store = MemoryStore::new();
            let rule = RuleSpec::new("bench", algorithm, limits).unwrap();
            group.bench_function(format!("tollgate_{algorithm}"), |b| {
                b.iter(|| black_box(tollgate_check(&store, &rule, black_box(&hot_key))))
            });
        }
        let limiter = if allow {
            governor_open()
        } else {
            governor_closed()
        };
        group.bench_function("governor_keyed", |b| {
            b.iter(|| black_box(limiter.check_key(black_box(&hot_ip)).is_ok()))
        });
        group.finish();
    }

    let mut group = c.benchmark_group("100k_ipv4_keys_allowed");
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
        let store = MemoryStore::new();
        let rule = RuleSpec::new("bench", algorithm, open_limits()).unwrap();
        for key in &keys {
            tollgate_check(&store, &rule, key);
        }
        let mut i = 0;
        group.bench_function(format!("tollgate_{algorithm}"), |b| {
            b.iter(|| {
                i = (i + 1) % KEYS;
                black_box(tollgate_check(&store, &rule, &keys[i]))
            })
        });
    }
    let limiter = governor_open();
    for ip in &ips {
        let _ = limiter.check_key(ip);
    }
    let mut i = 0;
    group.bench_function("governor_keyed", |b| {
        b.iter(|| {
            i = (i + 1) % KEYS;
            black_box(limiter.check_key(&ips[i]).is_ok())
        })
    });
    group.finish();
}

/// Stacked rules over 1,000,000 clients: 1, 2 (per IP + `Global`) and 4 rules per decision.
fn stacked(c: &mut Criterion) {
    let mut group = c.benchmark_group("1m_keys_stacked");
    for rules in [1, 2, 4] {
        let (store, specs, keys) = stacked::stacked(rules);
        let mut i = 0;
        group.bench_function(format!("tollgate_{rules}_rules"), |b| {
            b.iter(|| {
                i = (i + 1) % keys.len();
                black_box(stacked::decide(&store, &specs, &keys[i]))
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(std::time::Duration::from_secs(1)).measurement_time(std::time::Duration::from_secs(3));
    targets = bench, stacked
}
criterion_main!(benches);
