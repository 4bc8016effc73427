//! Runs `n` memory-store decisions or `n` in-process axum requests, for counting their
//! instructions under callgrind: a figure that, unlike time, the other work of a shared machine
//! does not move.
//!
//! ```text
//! ./scripts/instructions.sh     # every subject, per decision or request, as ratios
//! cargo bench --bench instructions --no-run   # prints the path of the binary: $bin
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!     $bin store tollgate_token_bucket hot_key_allowed 1000000
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null $bin layer tollgate_allow 100000
//! ```
//!
//! * `store <limiter> <case> <n>`: limiters `tollgate_token_bucket`, `tollgate_gcra` (the memory
//!   store) and `governor` (its keyed limiter); cases `hot_key_allowed`, `hot_key_denied` (one
//!   key; a quota nobody reaches, or one per hour) and `100k_keys_allowed` (cycling over 100,000
//!   IPv4 addresses): the cases of `benches/memory_store.rs`.
//! * `layer <router> <n>`: the routers of `benches/layer.rs` (`bare`, `tollgate_allow`,
//!   `tollgate_reject`, `tower_governor_allow`, `tower_governor_reject`), called in process.
//!   Built with `--features metrics` and run with `RECORDER=prometheus`, a Prometheus recorder
//!   records them (`./scripts/instructions.sh` compares with and without: `METRICS=1`).
//! * `policy <router> <n>`: the routers of `benches/policy.rs` (`fixed_ip`, `policy_ip`,
//!   `fixed_tenant`, `policy_tenant`, `policy_tenant_header`), called in process.
//! * `stacked <1|2|4> <n>`: memory-store decisions of 1, 2 or 4 stacked rules over 1,000,000
//!   clients whose keys are all in the store (`benches/support/stacked.rs`).
//!
//! Run each once with `n = 0` and once with a large `n`: the difference over `n` is the cost of
//! one decision or request, setup excluded.

#[path = "support/layer_apps.rs"]
mod layer_apps;
#[path = "support/policy_apps.rs"]
mod policy_apps;
#[path = "support/stacked.rs"]
mod stacked;

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::num::NonZeroU32;
use std::process::ExitCode;

use tollgate::Algorithm;
use tollgate::algorithm::Limits;
use tollgate::key::Key;
use tollgate::store::RuleSpec;
use tollgate::store::{Charge, MemoryStore, Store};

const USAGE: &str = "usage: instructions store <tollgate_token_bucket|tollgate_gcra|governor> \
                     <hot_key_allowed|hot_key_denied|100k_keys_allowed> <n>\n       \
                     instructions layer <bare|tollgate_allow|tollgate_reject|\
                     tower_governor_allow|tower_governor_reject> <n>\n       \
                     instructions policy <fixed_ip|policy_ip|fixed_tenant|policy_tenant|\
                     policy_tenant_header> <n>\n       \
                     instructions stacked <1|2|4> <n>";

fn main() -> ExitCode {
    // `cargo bench` adds `--bench`.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let result = match args.as_slice() {
        ["store", limiter, case, n] => count(n).and_then(|n| store(limiter, case, n)),
        ["layer", router, n] => count(n).and_then(|n| layer(router, n)),
        ["policy", router, n] => count(n).and_then(|n| policy(router, n)),
        ["stacked", rules, n] => count(n).and_then(|n| stacked_rules(rules, n)),
        _ => Err(String::from("wrong arguments")),
    };
    match result {
        Ok(report) => {
            println!("{report}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("{error}\n{USAGE}");
            ExitCode::FAILURE
        }
    }
}

fn count(n: &str) -> Result<usize, String> {
    n.parse()
        .map_err(|_| format!("n must be a number, not {n:?}"))
}

fn store(limiter: &str, case: &str, n: usize) -> Result<String, String> {
    let (allow, keys) = match case {
        "hot_key_allowed" => (true, 1),
        "hot_key_denied" => (false, 1),
        "100k_keys_allowed" => (true, 100_000),
        _ => return Err(format!("unknown case {case:?}")),
    };
    let ips: Vec<IpAddr> = (0..keys as u32)
        .map(|i| IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i * 7)))
        .collect();
    let admitted = match limiter {
        "tollgate_token_bucket" => tollgate(Algorithm::TokenBucket, allow, &ips, n),
        "tollgate_gcra" => tollgate(Algorithm::Gcra, allow, &ips, n),
        "governor" => governor(allow, &ips, n),
        _ => return Err(format!("unknown limiter {limiter:?}")),
    };
    Ok(format!(
        "{limiter} {case}: {n} decisions, {admitted} admitted"
    ))
}

fn tollgate(algorithm: Algorithm, allow: bool, ips: &[IpAddr], n: usize) -> usize {
    // The quotas of benches/memory_store.rs: 1 per µs with a burst of 10^9, or 1 per hour.
    let limits = if allow {
        Limits::new(1_000_000, 1_000_000, 1_000_000_000)
    } else {
        Limits::new(1, 3_600_000_000, 1)
    }
    .expect("valid limits");
    let rule = RuleSpec::new("instructions", algorithm, limits).unwrap();
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

fn stacked_rules(rules: &str, n: usize) -> Result<String, String> {
    let rules: usize = match rules {
        "1" | "2" | "4" => rules.parse().unwrap_or(1),
        _ => return Err(format!("rules must be 1, 2 or 4, not {rules:?}")),
    };
    // Every client's keys are in the store before the counted decisions (setup, also run with
    // n = 0).
    let (store, specs, keys) = stacked::stacked(rules);
    let admitted = (0..n)
        .filter(|i| stacked::decide(&store, &specs, black_box(&keys[i % keys.len()])))
        .count();
    Ok(format!(
        "{rules} stacked rules: {n} decisions, {admitted} admitted"
    ))
}

fn policy(router: &str, n: usize) -> Result<String, String> {
    let (app, tenant, header) = policy_apps::apps()
        .into_iter()
        .find_map(|(name, app, tenant, header)| (name == router).then_some((app, tenant, header)))
        .ok_or_else(|| format!("unknown router {router:?}"))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot build a runtime: {e}"))?;
    runtime.block_on(async {
        for _ in 0..n {
            policy_apps::serve_one(&app, tenant, header).await;
        }
    });
    Ok(format!("{router}: {n} requests"))
}

fn layer(router: &str, n: usize) -> Result<String, String> {
    let app = layer_apps::apps()
        .into_iter()
        .find_map(|(name, app)| (name == router).then_some(app))
        .ok_or_else(|| format!("unknown router {router:?}"))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot build a runtime: {e}"))?;
    // RECORDER=prometheus (with the feature `metrics`): the requests are recorded by a
    // Prometheus recorder, as a service that exports its metrics would.
    #[cfg(feature = "metrics")]
    let recorder = (std::env::var("RECORDER").as_deref() == Ok("prometheus"))
        .then(|| metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder());
    #[cfg(feature = "metrics")]
    let _recording = recorder
        .as_ref()
        .map(|r| metrics::set_default_local_recorder(r));
    runtime.block_on(async {
        for _ in 0..n {
            layer_apps::serve_one(&app).await;
        }
    });
    Ok(format!("{router}: {n} requests"))
}
