//! Runs `n` decisions of one limiter, for counting their instructions: a figure that, unlike
//! time, does not move with the other work of a shared machine.
//!
//! ```text
//! cargo build --release --example decision_cost
//! ./scripts/instructions.sh        # every case, per decision and as a ratio to governor
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!     target/release/examples/decision_cost tollgate_token_bucket hot_key_allowed 1000000
//! ```
//!
//! Limiters: `tollgate_token_bucket`, `tollgate_gcra` (the memory store) and `governor` (its
//! keyed limiter). Cases: `hot_key_allowed`, `hot_key_denied` (one key; a quota nobody reaches,
//! or one per hour) and `100k_keys_allowed` (cycling over 100,000 IPv4 addresses). The same
//! cases as `benches/memory_store.rs`. Run it once with `n = 0` and once with a large `n`: the
//! difference over `n` is the cost of one decision, setup excluded.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::num::NonZeroU32;
use std::process::ExitCode;

use tollgate::algorithm::{Algorithm, Limits};
use tollgate::key::Key;
use tollgate::policy::RuleSpec;
use tollgate::store::{Charge, MemoryStore, Store};

const USAGE: &str = "usage: decision_cost <tollgate_token_bucket|tollgate_gcra|governor> \
                     <hot_key_allowed|hot_key_denied|100k_keys_allowed> <n>";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [limiter, case, n] = args.as_slice() else {
        eprintln!("{USAGE}");
        return ExitCode::FAILURE;
    };
    let Ok(n) = n.parse::<usize>() else {
        eprintln!("n must be a number\n{USAGE}");
        return ExitCode::FAILURE;
    };
    let (allow, keys) = match case.as_str() {
        "hot_key_allowed" => (true, 1),
        "hot_key_denied" => (false, 1),
        "100k_keys_allowed" => (true, 100_000),
        _ => {
            eprintln!("unknown case {case}\n{USAGE}");
            return ExitCode::FAILURE;
        }
    };
    let ips: Vec<IpAddr> = (0..keys as u32)
        .map(|i| IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i * 7)))
        .collect();
    let admitted = match limiter.as_str() {
        "tollgate_token_bucket" => tollgate(Algorithm::TokenBucket, allow, &ips, n),
        "tollgate_gcra" => tollgate(Algorithm::Gcra, allow, &ips, n),
        "governor" => governor(allow, &ips, n),
        _ => {
            eprintln!("unknown limiter {limiter}\n{USAGE}");
            return ExitCode::FAILURE;
        }
    };
    println!("{limiter} {case}: {n} decisions, {admitted} admitted");
    ExitCode::SUCCESS
}

fn tollgate(algorithm: Algorithm, allow: bool, ips: &[IpAddr], n: usize) -> usize {
    // The quotas of benches/memory_store.rs: 1 per µs with a burst of 10^9, or 1 per hour.
    let limits = if allow {
        Limits::new(1_000_000, 1_000_000, 1_000_000_000)
    } else {
        Limits::new(1, 3_600_000_000, 1)
    }
    .expect("valid limits");
    let rule = RuleSpec::new("decision_cost", algorithm, limits);
    let store = MemoryStore::new();
    let keys: Vec<Key> = ips.iter().map(|ip| Key::ip(*ip)).collect();
    (0..n)
        .filter(|i| {
            let key = black_box(&keys[i % keys.len()]);
            store
                .check(&[Charge {
                    rule: &rule,
                    key,
                    cost: 1,
                }])
                .into_inner()
                .is_ok_and(|decision| decision.allowed())
        })
        .count()
}

fn governor(allow: bool, ips: &[IpAddr], n: usize) -> usize {
    let quota = if allow {
        governor::Quota::per_second(NonZeroU32::new(1_000_000).expect("not zero"))
            .allow_burst(NonZeroU32::new(1_000_000_000).expect("not zero"))
    } else {
        governor::Quota::per_hour(NonZeroU32::new(1).expect("not zero"))
    };
    let limiter = governor::RateLimiter::keyed(quota);
    (0..n)
        .filter(|i| limiter.check_key(black_box(&ips[i % ips.len()])).is_ok())
        .count()
}
