//! Store-level benchmark of the Redis stores, side by side with `redis-benchmark` running an
//! `EVALSHA` of the same script with the same arguments, in the same run.
//!
//! ```text
//! flock /tmp/tollgate-bench.lock cargo bench --bench redis_store
//! BENCH_SECONDS=5 BENCH_CONCURRENCY=64 cargo bench --bench redis_store
//! ```
//!
//! It starts its own `redis-server` (and a 3-primary cluster) on free loopback ports, and
//! measures, for token-bucket checks of 10,000 clients from one process (one runtime thread):
//!
//! 1. `RedisStore` at a fixed concurrency, for pool sizes 1, 2 and 4: decisions/s, p50, p99;
//! 2. `redis-benchmark` with the same concurrency, the same `EVALSHA`, with `-P 16` and without;
//! 3. `RedisStore` in open loop at half of its best rate: p50, p99;
//! 4. the cluster: `RedisClusterStore` (one multiplexed cluster connection) against a bb8 pool of
//!    4 cluster connections sending the same `EVALSHA`;
//! 5. `MEMORY USAGE` of one key per algorithm.

#[path = "../tests/support/mod.rs"]
mod support;

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tollgate::Algorithm;
use tollgate::algorithm::Limits;
use tollgate::key::Key;
use tollgate::store::RuleSpec;

use tollgate::store::{Charge, RedisClusterStore, RedisStore, Store};

const CLIENTS: u64 = 10_000;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One in a million requests is denied at most: the bucket refills far faster than we ask.
fn rule() -> Arc<RuleSpec> {
    let limits = Limits::new(1_000_000_000, 3_600_000_000, 1_000_000_000).unwrap();
    Arc::new(RuleSpec::new("bench", Algorithm::TokenBucket, limits).unwrap())
}

#[derive(Clone, Copy, Debug, Default)]
struct Figures {
    rate: f64,
    p50: f64,
    p99: f64,
    /// Checks that ended in an error (a timeout when the store cannot keep up), not counted in
    /// the rate or the latencies.
    failed: usize,
}

/// Resets the server's command statistics.
fn reset_stats(server: &support::RedisServer) {
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut server.conn())
        .expect("CONFIG RESETSTAT");
}

/// The server's mean time in `EVALSHA` since the last reset, in µs per call.
fn script_micros(server: &support::RedisServer) -> f64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut server.conn())
        .expect("INFO");
    info.lines()
        .find(|l| l.starts_with("cmdstat_evalsha:"))
        .and_then(|l| l.split("usec_per_call=").nth(1))
        .and_then(|v| v.split(',').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

/// The load average of the last minute (other work on the machine skews every figure).
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

fn figures(mut latencies: Vec<u32>, seconds: f64) -> Figures {
    latencies.sort_unstable();
    let pct = |p: f64| {
        latencies
            .get(((latencies.len() as f64 - 1.0) * p) as usize)
            .copied()
            .unwrap_or(0) as f64
    };
    Figures {
        rate: latencies.len() as f64 / seconds,
        p50: pct(0.50),
        p99: pct(0.99),
        failed: 0,
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// Closed loop: `concurrency` tasks, each checking one random client after another.
async fn closed_loop<S: Store + Clone>(store: S, concurrency: u64, seconds: u64) -> Figures {
    let rule = Arc::new(rule());
    let keys: Arc<Vec<Key>> = Arc::new((0..CLIENTS).map(|i| Key::text(i.to_string())).collect());
    timed_loop(concurrency, seconds, move |client| {
        let (store, rule, keys) = (store.clone(), rule.clone(), keys.clone());
        async move {
            let decision = store
                .check(&[Charge {
                    rule: &rule,
                    key: &keys[client as usize],
                    cost: 1,
                }])
                .await
                .expect("check");
            std::hint::black_box(decision);
        }
    })
    .await
}

/// `concurrency` tasks, each calling `call` for one random client (below `CLIENTS`) after
/// another for `seconds`: the rate and latencies of the calls.
async fn timed_loop<F, Fut>(concurrency: u64, seconds: u64, call: F) -> Figures
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..concurrency {
        let (stop, call) = (stop.clone(), call.clone());
        tasks.push(tokio::spawn(async move {
            let mut seed = 0x9E37_79B9_7F4A_7C15u64 ^ (t + 1);
            let mut latencies = Vec::with_capacity(1 << 16);
            while !stop.load(Ordering::Relaxed) {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let start = Instant::now();
                call(seed % CLIENTS).await;
                latencies.push(start.elapsed().as_micros() as u32);
            }
            latencies
        }));
    }
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.expect("task"));
    }
    figures(all, started.elapsed().as_secs_f64())
}

/// Open loop: `rate` checks per second, started on a schedule whatever the answers' speed.
async fn open_loop<S: Store + Clone>(store: S, rate: f64, seconds: u64) -> Figures {
    let rule = rule();
    let keys: Arc<Vec<Key>> = Arc::new((0..CLIENTS).map(|i| Key::text(i.to_string())).collect());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Option<u32>>();
    let tick = Duration::from_millis(1);
    let per_tick = rate / 1000.0;
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let started = Instant::now();
    let mut owed = 0.0;
    let mut n = 0u64;
    while started.elapsed() < Duration::from_secs(seconds) {
        interval.tick().await;
        owed += per_tick;
        while owed >= 1.0 {
            owed -= 1.0;
            n += 1;
            let (store, rule, keys, tx) = (store.clone(), rule.clone(), keys.clone(), tx.clone());
            // From the moment the check is due: waiting to be scheduled counts too.
            let start = Instant::now();
            tokio::spawn(async move {
                let key = &keys[(n.wrapping_mul(0x9E37_79B9) % CLIENTS) as usize];
                let result = store
                    .check(&[Charge {
                        rule: &rule,
                        key,
                        cost: 1,
                    }])
                    .await;
                let latency = result.ok().map(|decision| {
                    std::hint::black_box(decision);
                    start.elapsed().as_micros() as u32
                });
                let _ = tx.send(latency);
            });
        }
    }
    drop(tx);
    let (mut all, mut failed) = (Vec::new(), 0);
    while let Some(latency) = rx.recv().await {
        match latency {
            Some(latency) => all.push(latency),
            None => failed += 1,
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    Figures {
        failed,
        ..figures(all, elapsed)
    }
}

/// `redis-benchmark` sending the store's `EVALSHA` for random clients.
fn redis_benchmark(
    port: u16,
    sha: &str,
    concurrency: u64,
    requests: u64,
    pipeline: u64,
) -> Figures {
    let mut command = Command::new("redis-benchmark");
    command.args([
        "-h",
        "127.0.0.1",
        "-p",
        &port.to_string(),
        "-c",
        &concurrency.to_string(),
        "-n",
        &requests.to_string(),
        "-r",
        &CLIENTS.to_string(),
        "-P",
        &pipeline.to_string(),
        "--csv",
        "EVALSHA",
        sha,
        "1",
        "tollgate:{__rand_int__}:bench",
        "c",
        "0",
        "0",
        "tb",
        "1",
        "1000000000",
        "3600000000",
        "1000000000",
        "4",
    ]);
    eprintln!("  $ {command:?}");
    let output = command.output().expect("run redis-benchmark");
    let text = String::from_utf8_lossy(&output.stdout);
    // "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
    let line = text
        .lines()
        .find(|l| l.starts_with("\"EVALSHA"))
        .unwrap_or_else(|| panic!("redis-benchmark answered: {text}"));
    let fields: Vec<f64> = line
        .split("\",\"")
        .skip(1)
        .map(|f| f.trim_matches('"').parse().unwrap_or(f64::NAN))
        .collect();
    Figures {
        rate: fields[0],
        p50: fields[3] * 1000.0,
        p99: fields[5] * 1000.0,
        failed: 0,
    }
}

fn row(name: &str, f: Figures) {
    println!(
        "| {name} | {:.0} | {:.0} | {:.0} | {} |",
        f.rate,
        f.p50,
        f.p99,
        load_average()
    );
}

/// A row of the standalone table, with the server's time per script call.
fn server_row(name: &str, f: Figures, server: &support::RedisServer) {
    println!(
        "| {name} | {:.0} | {:.0} | {:.0} | {} | {:.1} | {} |",
        f.rate,
        f.p50,
        f.p99,
        f.failed,
        script_micros(server),
        load_average()
    );
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` passes nothing: run only when benched.
    if !std::env::args().any(|a| a == "--bench") {
        println!("redis_store: run with `cargo bench --bench redis_store`");
        return;
    }
    let seconds = env_u64("BENCH_SECONDS", 5).clamp(1, 60);
    let concurrency = env_u64("BENCH_CONCURRENCY", 64).clamp(1, 1024);
    let server = support::RedisServer::start();
    let rt = runtime();
    println!(
        "redis_store: token-bucket checks of {CLIENTS} clients, {concurrency} concurrent, \
         {seconds} s each, one client runtime thread; {}",
        String::from_utf8_lossy(
            &Command::new("redis-server")
                .arg("--version")
                .output()
                .expect("redis-server")
                .stdout
        )
        .trim()
    );
    println!();
    println!(
        "| what | decisions/s | p50 µs | p99 µs | failed | server µs per EVALSHA | load average |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");

    if let Ok(rates) = std::env::var("BENCH_OPEN_RATES") {
        // Only the open loop, at the given rates (a latency curve).
        let store = rt
            .block_on(RedisStore::connect(server.url()))
            .expect("store");
        for rate in rates
            .split(',')
            .filter_map(|r| r.trim().parse::<f64>().ok())
        {
            reset_stats(&server);
            let f = rt.block_on(open_loop(store.clone(), rate, seconds));
            server_row(&format!("RedisStore, open loop at {rate:.0}/s"), f, &server);
        }
        return;
    }
    let mut best = Figures::default();
    let mut best_store = None;
    for pool in [1, 2, 4] {
        let store = rt.block_on(async {
            RedisStore::builder(server.url())
                .pool_size(pool)
                .response_timeout(Duration::from_secs(5))
                .connect()
                .await
                .expect("store")
        });
        reset_stats(&server);
        let f = rt.block_on(closed_loop(store.clone(), concurrency, seconds));
        server_row(&format!("RedisStore, pool_size {pool}"), f, &server);
        if f.rate > best.rate {
            best = f;
            best_store = Some(store);
        }
    }
    let sha = redis::Script::new(RedisStore::script_source())
        .get_hash()
        .to_owned();
    let requests = (best.rate * seconds as f64) as u64;
    reset_stats(&server);
    let plain = redis_benchmark(server.port, &sha, concurrency, requests, 1);
    server_row("redis-benchmark EVALSHA, no pipelining", plain, &server);
    reset_stats(&server);
    let pipelined = redis_benchmark(server.port, &sha, concurrency, requests * 2, 16);
    server_row("redis-benchmark EVALSHA, -P 16", pipelined, &server);
    reset_stats(&server);
    let half = rt.block_on(open_loop(
        best_store.expect("a store"),
        best.rate / 2.0,
        seconds,
    ));
    server_row(
        &format!(
            "RedisStore, open loop at {:.0}/s (half its best)",
            best.rate / 2.0
        ),
        half,
        &server,
    );
    println!();
    println!(
        "best RedisStore / pipelined redis-benchmark: {:.2}; / unpipelined: {:.2}",
        best.rate / pipelined.rate,
        best.rate / plain.rate
    );

    // The cluster: the store's one multiplexed connection against a bb8 pool of connections.
    let cluster = support::RedisCluster::start();
    println!();
    println!("| cluster (3 primaries) | decisions/s | p50 µs | p99 µs | load average |");
    println!("|---|---:|---:|---:|---:|");
    let store = rt.block_on(async {
        RedisClusterStore::builder(cluster.urls())
            .response_timeout(Duration::from_secs(5))
            .connect()
            .await
            .expect("cluster store")
    });
    row(
        "RedisClusterStore (a multiplexed connection per primary)",
        rt.block_on(closed_loop(store, concurrency, seconds)),
    );
    row(
        "bb8 pool of 4 cluster connections, same EVALSHA",
        rt.block_on(pooled_cluster(&cluster, &sha, concurrency, seconds)),
    );
    row(
        "one multiplexed cluster connection, same EVALSHA",
        rt.block_on(shared_cluster(&cluster, &sha, concurrency, seconds)),
    );

    memory_usage(&rt, &server);
}

fn evalsha(sha: &str, client: u64) -> redis::Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(sha)
        .arg(1)
        .arg(format!("tollgate:{{{client}}}:bench"))
        .arg(&["c", "0", "0", "tb", "1"][..])
        .arg(&["1000000000", "3600000000", "1000000000", "4"][..]);
    cmd
}

async fn pooled_cluster(
    cluster: &support::RedisCluster,
    sha: &str,
    concurrency: u64,
    seconds: u64,
) -> Figures {
    let client = redis::cluster::ClusterClient::new(cluster.urls()).expect("client");
    let pool = bb8::Pool::builder()
        .max_size(4)
        .build(client)
        .await
        .expect("pool");
    let sha = sha.to_owned();
    timed_loop(concurrency, seconds, move |client| {
        let (pool, cmd) = (pool.clone(), evalsha(&sha, client));
        async move {
            let mut conn = pool.get().await.expect("pooled connection");
            cmd.query_async::<redis::Value>(&mut *conn)
                .await
                .expect("EVALSHA");
        }
    })
    .await
}

async fn shared_cluster(
    cluster: &support::RedisCluster,
    sha: &str,
    concurrency: u64,
    seconds: u64,
) -> Figures {
    let client = redis::cluster::ClusterClient::new(cluster.urls()).expect("client");
    let conn = client.get_async_connection().await.expect("connection");
    let sha = sha.to_owned();
    timed_loop(concurrency, seconds, move |client| {
        let (mut conn, cmd) = (conn.clone(), evalsha(&sha, client));
        async move {
            cmd.query_async::<redis::Value>(&mut conn)
                .await
                .expect("EVALSHA");
        }
    })
    .await
}

/// `MEMORY USAGE` of `tollgate:{203.0.113.7}:burst` under each algorithm, 100 per hour.
fn memory_usage(rt: &tokio::runtime::Runtime, server: &support::RedisServer) {
    let store = rt
        .block_on(RedisStore::connect(server.url()))
        .expect("store");
    let mut conn = server.conn();
    let client = Key::ip("203.0.113.7".parse().unwrap());
    println!();
    println!("| algorithm (100 per hour) | key | after 10 requests | after 100 requests |");
    println!("|---|---|---:|---:|");
    for algorithm in Algorithm::ALL {
        let rule = RuleSpec::new(
            "burst",
            algorithm,
            Limits::new(100, 3_600_000_000, 100).unwrap(),
        )
        .unwrap();
        let key = store.key_name("burst", &client);
        let mut sizes = Vec::new();
        for requests in [10, 90] {
            for _ in 0..requests {
                rt.block_on(store.check(&[Charge {
                    rule: &rule,
                    key: &client,
                    cost: 1,
                }]))
                .expect("check");
            }
            let bytes: u64 = redis::cmd("MEMORY")
                .arg("USAGE")
                .arg(&key)
                .query(&mut conn)
                .expect("MEMORY USAGE");
            sizes.push(bytes);
        }
        println!(
            "| {algorithm} | `{key}` | {} B | {} B |",
            sizes[0], sizes[1]
        );
        let _: () = redis::cmd("DEL").arg(&key).query(&mut conn).expect("DEL");
    }
}
