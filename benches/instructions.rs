//! Runs `n` memory-store decisions or `n` in-process axum requests, for counting their
//! instructions under callgrind: a figure that, unlike time, the other work of a shared machine
//! does not move.
//!
//! ```text
//! ./scripts/instructions.sh     # every subject, per decision or request, as ratios
//! cargo bench --bench instructions --no-run   # prints the path of the binary: $bin
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null --toggle-collect=instructions::counted \
//!     $bin store tollgate_token_bucket hot_key_allowed 1000000
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!     --toggle-collect=instructions::counted_block_on $bin layer tollgate_allow 100000
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
//! * `redis <router> <n>` (feature `redis`, a server at `REDIS_URL`): in-process axum requests
//!   in waves of 32 at once, as 32 connections would send them, so that the store batches them
//!   as it does under load: `bare` (no limiter, the same waves), `memory_allow` (tollgate on
//!   its memory store), `redis_allow` (batched), `redis_allow_unbatched` (`max_batch(1)`),
//!   `redis_reject` (a known-denied key) and `redis_leased` (a lease of 200 units on the one
//!   hot key); `memory_allow_two_rules` and `redis_allow_two_rules` add a second rule (two
//!   charges a check). Only this process's instructions are counted: Redis's own are its `INFO
//!   commandstats` (`./scripts/instructions.sh` with `REDIS=1` starts a server and prints both).
//!
//! The `n` decisions or requests of `store`, `stacked`, `layer`, `policy` and `redis` run inside
//! one function, `counted` or `counted_block_on`, after a warm-up of [`WARM_UP`] outside it;
//! count only those two functions' instructions (`--toggle-collect=instructions::counted
//! --toggle-collect=instructions::counted_block_on`, each named exactly: a toggle switches
//! counting on at its function's entry and off at its exit), and the total over `n` is the cost
//! of one, setup excluded. Only the thread that calls them is counted: every subject runs on a
//! current-thread runtime. (Subtracting a run with `n = 0` instead
//! leaves the setup's own variation in the figure: `quanta`'s calibration of its clock alone
//! moves by millions of instructions from run to run, ±25 per decision over 200,000.) The
//! `redis` waves are counted the same way, after one uncounted wave.

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
                     instructions stacked <1|2|4> <n>\n       \
                     instructions redis <bare|memory_allow|memory_allow_two_rules|redis_allow|\
                     redis_allow_two_rules|redis_allow_unbatched|redis_reject|redis_leased> <n>";

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
        #[cfg(feature = "redis")]
        ["redis", router, n] => count(n).and_then(|n| redis_waves(router, n)),
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

/// Decisions or requests run before the counted ones, uncounted: what the first of them sets up
/// once (lazily built tables, the first allocations of a pool) is not a cost per request.
const WARM_UP: usize = 1_000;

/// How many of `one(0..n)` are true, after [`WARM_UP`] uncounted calls: only [`counted`]'s
/// instructions are counted.
fn warm_then_count(n: usize, one: impl FnMut(usize) -> bool) -> usize {
    warm_over_then_count(WARM_UP, n, one)
}

/// [`warm_then_count`] with a warm-up of `warm` calls (at least [`WARM_UP`]).
fn warm_over_then_count(warm: usize, n: usize, mut one: impl FnMut(usize) -> bool) -> usize {
    for i in 0..warm.max(WARM_UP) {
        black_box(one(i));
    }
    counted(n, one)
}

/// The counted calls (never inlined: callgrind counts this function and what it calls).
#[inline(never)]
fn counted(n: usize, mut one: impl FnMut(usize) -> bool) -> usize {
    // A plain loop: a closure of its own here would be named `counted::{{closure}}`, which the
    // script's toggles do not name, and counting would not follow into it.
    let mut admitted = 0;
    for i in 0..n {
        admitted += usize::from(one(i));
    }
    admitted
}

/// `serve_one` [`WARM_UP`] times uncounted, then `n` times inside [`counted_block_on`].
fn warm_then_serve<F: Future<Output = ()>>(
    runtime: &tokio::runtime::Runtime,
    n: usize,
    mut serve_one: impl FnMut() -> F,
) {
    runtime.block_on(async {
        for _ in 0..WARM_UP {
            serve_one().await;
        }
    });
    counted_block_on(runtime, async {
        for _ in 0..n {
            serve_one().await;
        }
    });
}

/// The counted requests: a current-thread runtime runs every task of `future` inside this
/// call (never inlined: callgrind counts this function and what it calls; `black_box` keeps
/// it a frame of its own, not a jump into `block_on`).
#[inline(never)]
fn counted_block_on<F: Future>(runtime: &tokio::runtime::Runtime, future: F) -> F::Output {
    black_box(runtime.block_on(future))
}

/// The decisions of `benches/memory_store.rs`'s cases, for both limiters.
///
/// Under callgrind a decision takes microseconds rather than a tenth of one, so a refill of 1
/// per µs (the criterion bench's quota) would fill the bucket again between two decisions: its
/// key would expire each time, and the memory store, which keeps no state for a full bucket,
/// would start it afresh, a path a hot key never takes at native speed. A key of the 100,000
/// comes back only every 100,000 decisions, so any refill of a run's length does the same. The
/// allowing cases refill 1 per 10 s from a burst of 10^7 (a bucket must refill within
/// `MAX_REFILL_MICROS`): no bucket is full again in a run of fewer than 10^7 decisions, and no
/// key expires, under callgrind or not. Every client's key is decided once in the warm-up, so
/// that the counted decisions find their keys, as a hot client's do.
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
    // A burst of 10^7 refilled 1 per 10 s (see `store`), or 1 per hour.
    let limits = if allow {
        Limits::new(1, 10_000_000, 10_000_000)
    } else {
        Limits::new(1, 3_600_000_000, 1)
    }
    .expect("valid limits");
    let rule = RuleSpec::new("instructions", algorithm, limits).unwrap();
    let store = MemoryStore::new();
    let keys: Vec<Key> = ips.iter().map(|ip| Key::ip(*ip)).collect();
    warm_over_then_count(keys.len(), n, |i| {
        let key = black_box(&keys[i % keys.len()]);
        // As the layer asks: `check_now`, the decision read where the store wrote it.
        let decision = store.check_now(&[Charge {
            rule: &rule,
            key,
            cost: 1,
        }]);
        matches!(black_box(&decision), Some(Ok(decision)) if decision.allowed())
    })
}

fn governor(allow: bool, ips: &[IpAddr], n: usize) -> usize {
    let quota = if allow {
        governor::Quota::with_period(std::time::Duration::from_secs(10))
            .expect("not zero")
            .allow_burst(NonZeroU32::new(10_000_000).expect("not zero"))
    } else {
        governor::Quota::per_hour(NonZeroU32::new(1).expect("not zero"))
    };
    let limiter = governor::RateLimiter::keyed(quota);
    warm_over_then_count(ips.len(), n, |i| {
        black_box(limiter.check_key(black_box(&ips[i % ips.len()]))).is_ok()
    })
}

fn stacked_rules(rules: &str, n: usize) -> Result<String, String> {
    let rules: usize = match rules {
        "1" | "2" | "4" => rules.parse().unwrap_or(1),
        _ => return Err(format!("rules must be 1, 2 or 4, not {rules:?}")),
    };
    // Every client's keys are in the store before the counted decisions (setup).
    let (store, specs, keys) = stacked::stacked(rules);
    let admitted = warm_then_count(n, |i| {
        stacked::decide(&store, &specs, black_box(&keys[i % keys.len()]))
    });
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
    warm_then_serve(&runtime, n, || policy_apps::serve_one(&app, tenant, header));
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
    warm_then_serve(&runtime, n, || async {
        layer_apps::serve_one(&app).await;
    });
    Ok(format!("{router}: {n} requests"))
}

/// Requests sent at once in [`redis_waves`]: the load harness's connections.
#[cfg(feature = "redis")]
const WAVE: usize = 32;

/// `n` requests (rounded up to whole waves) in waves of [`WAVE`] at once, through `router`,
/// inside [`counted_block_on`]; one wave first, uncounted, so that connecting and loading the
/// code are setup.
#[cfg(feature = "redis")]
fn redis_waves(router: &str, n: usize) -> Result<String, String> {
    use std::time::Duration;
    use tollgate::store::{DEFAULT_MAX_BATCH, RedisStore};
    use tollgate::{Quota, RateLimitLayer, Rule};

    let allow = Quota::per_second(1_000_000).burst(1_000_000_000);
    let (store, quota, max_batch, lease) = match router {
        "bare" => (None, allow, DEFAULT_MAX_BATCH, 0),
        "memory_allow" | "memory_allow_two_rules" => (Some(false), allow, DEFAULT_MAX_BATCH, 0),
        "redis_allow" | "redis_allow_two_rules" => (Some(true), allow, DEFAULT_MAX_BATCH, 0),
        "redis_allow_unbatched" => (Some(true), allow, 1, 0),
        "redis_reject" => (Some(true), Quota::per_hour(1), DEFAULT_MAX_BATCH, 0),
        "redis_leased" => (Some(true), allow, DEFAULT_MAX_BATCH, 200),
        _ => return Err(format!("unknown router {router:?}")),
    };
    // A second rule on every request (a sustained rate beside the burst, say): two charges a
    // check.
    let second = router
        .ends_with("_two_rules")
        .then(|| Rule::new("load-daily", Quota::per_day(1_000_000_000)));
    let url = std::env::var("REDIS_URL").map_err(|_| {
        String::from("set REDIS_URL (REDIS=1 ./scripts/instructions.sh starts a server)")
    })?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot build a runtime: {e}"))?;
    let app = runtime.block_on(async {
        let hello =
            axum::Router::new().route("/", axum::routing::get(|| async { "Hello, World!" }));
        let rule = Rule::new("load", quota);
        let rule = if lease > 0 { rule.lease(lease) } else { rule };
        let app = match store {
            None => hello,
            Some(false) => hello.layer(
                RateLimitLayer::builder()
                    .rule(rule)
                    .rules(second)
                    .build()
                    .map_err(|e| e.to_string())?,
            ),
            Some(true) => {
                // A prefix of this run's own: every run starts from an empty budget. Budgets
                // far above valgrind's pace: no check times out.
                let store = RedisStore::builder(url)
                    .prefix(format!("instructions{}", std::process::id()))
                    .max_batch(max_batch)
                    .response_timeout(Duration::from_secs(10))
                    .connect()
                    .await
                    .map_err(|e| format!("cannot connect to REDIS_URL: {e}"))?;
                hello.layer(
                    RateLimitLayer::builder()
                        .rule(rule)
                        .rules(second)
                        .store(store)
                        .build()
                        .map_err(|e| e.to_string())?,
                )
            }
        }
        .with_state::<()>(());
        // One wave first, uncounted: connecting and loading the code are setup.
        futures_util::future::join_all((0..WAVE).map(|_| layer_apps::serve_one(&app))).await;
        Ok::<_, String>(app)
    })?;
    // Statuses of the counted waves: 200s for a router that allows, 429s for one that rejects;
    // anything else (a store that failed open, say) is an error of the run.
    let served = counted_block_on(&runtime, async {
        let (mut ok, mut limited) = (0, 0);
        for _ in 0..n.div_ceil(WAVE) {
            let statuses =
                futures_util::future::join_all((0..WAVE).map(|_| layer_apps::serve_one(&app)))
                    .await;
            for status in statuses {
                match status.as_u16() {
                    200 => ok += 1,
                    429 => limited += 1,
                    other => return Err(format!("{router}: a request answered {other}")),
                }
            }
        }
        Ok::<_, String>((ok, limited))
    })?;
    let (ok, limited) = served;
    let expected = if router == "redis_reject" {
        ok == 0
    } else {
        limited == 0
    };
    if !expected {
        return Err(format!("{router}: {ok} allowed and {limited} limited"));
    }
    Ok(format!(
        "{router}: {} requests in waves of {WAVE}, {ok} allowed, {limited} limited",
        ok + limited
    ))
}
