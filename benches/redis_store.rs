//! Store-level benchmark of the Redis stores, side by side with `redis-benchmark` calling the
//! same code with the same arguments, and the seed's plain token-bucket script, in the same run.
//!
//! ```text
//! flock /tmp/tollgate-bench.lock cargo bench --bench redis_store
//! BENCH_SECONDS=5 BENCH_CONCURRENCY=64 cargo bench --bench redis_store
//! ```
//!
//! It starts its own `redis-server` (and a 3-primary cluster) on free loopback ports, and
//! measures, for token-bucket checks of 10,000 clients from one process (one runtime thread):
//!
//! 1. `RedisStore` at a fixed concurrency, for pool sizes 1, 2 and 4 (batched), and with
//!    `max_batch(1)` (each check its own call): decisions/s, p50, p99, decisions per call and
//!    the server's µs per decision (`INFO commandstats`);
//! 2. `redis-benchmark` with the same concurrency calling tollgate's function (one decision
//!    per call) and the seed's plain token-bucket script, twice each, interleaved; and the
//!    function with `-P 16`; and, where `node` and `npm` are installed, the Node limiter
//!    rate-limiter-flexible over ioredis (`benches/support/node_limiter.js`, installed under
//!    `target/node-limiter` on the first run) at the same concurrency;
//! 3. `RedisStore` in open loop at half of its best rate: p50, p99 (with `BENCH_OPEN_RATES`,
//!    only the open loop, at those rates, each beside the same schedule of bare `FCALL`s of
//!    tollgate's function on one redis-rs connection: the latency of the machine itself);
//! 4. the cluster: `RedisClusterStore` (one pipelined connection per primary) against a bb8
//!    pool of 4 cluster connections sending the same `FCALL`;
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

/// The calls of scripts and functions (`FCALL`, `EVALSHA`) since the last reset, and the µs
/// the server spent in them.
fn script_calls(server: &support::RedisServer) -> (f64, f64) {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut server.conn())
        .expect("INFO");
    let (mut calls, mut usec) = (0.0, 0.0);
    for line in info
        .lines()
        .filter(|l| l.starts_with("cmdstat_fcall:") || l.starts_with("cmdstat_evalsha:"))
    {
        let field = |name: &str| {
            line.split(name)
                .nth(1)
                .and_then(|v| v.split(',').next())
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        calls += field("calls=");
        usec += field("usec=");
    }
    (calls, usec)
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

/// Open loop: checks started on a schedule whatever the answers, `rate` a second, spread over
/// the second rather than in bursts: a thread of its own starts each one on the runtime when
/// it is due (as a server's connections would; a sleep overshoots by the timer slack, 50–80
/// µs, and the few checks due meanwhile start together), and its latency counts from the moment
/// it was due, so a check the schedule or the runtime started late counts as late. Its CPU is
/// the process's, the schedule's thread included.
async fn open_loop<S: Store + Clone + Send + Sync + 'static>(
    store: S,
    rate: f64,
    seconds: u64,
) -> Figures
where
    S::Future: Send,
{
    let rule = Arc::new(rule());
    scheduled(rate, seconds, move |key| {
        let (store, rule) = (store.clone(), rule.clone());
        async move {
            let result = store
                .check(&[Charge {
                    rule: &rule,
                    key: &key,
                    cost: 1,
                }])
                .await;
            result.map(std::hint::black_box).is_ok()
        }
    })
    .await
}

/// [`open_loop`]'s schedule with no store between the checks and Redis: each check is the
/// same `FCALL` of tollgate's function (one key, one charge), sent on one redis-rs multiplexed
/// connection, its reply only read. What is left of the latency is the machine's: the
/// schedule's thread, the runtime and `redis-server` taking turns on its cores.
async fn open_loop_bare(server: &support::RedisServer, rate: f64, seconds: u64) -> Figures {
    let (library, function) = RedisStore::function_library();
    let client = redis::Client::open(server.url()).expect("client");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connection");
    let _: redis::Value = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(library)
        .query_async(&mut conn)
        .await
        .expect("FUNCTION LOAD");
    let charge = "tb:1000000000:3600000000:1000000000:4:1:0";
    scheduled(rate, seconds, move |key| {
        let mut conn = conn.clone();
        async move {
            let mut cmd = redis::cmd("FCALL");
            cmd.arg(function)
                .arg(1)
                .arg(format!("bare:{{{key}}}:bench"))
                .arg("c")
                .arg(charge);
            cmd.query_async::<redis::Value>(&mut conn).await.is_ok()
        }
    })
    .await
}

/// Starts `check(key)` for a client key `rate` times a second for `seconds` (see
/// [`open_loop`]); the latencies of the checks that succeeded, from when each was due.
async fn scheduled<F, Fut>(rate: f64, seconds: u64, check: F) -> Figures
where
    F: Fn(Key) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send + 'static,
{
    let keys: Vec<Key> = (0..CLIENTS).map(|i| Key::text(i.to_string())).collect();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Option<u32>>();
    let runtime = tokio::runtime::Handle::current();
    let total = (rate * seconds as f64) as u64;
    let schedule = std::thread::spawn(move || {
        let started = Instant::now();
        for n in 0..total {
            let due = started + Duration::from_secs_f64(n as f64 / rate);
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            let key = keys[(n.wrapping_mul(0x9E37_79B9) % CLIENTS) as usize].clone();
            let (checked, tx) = (check(key), tx.clone());
            runtime.spawn(async move {
                let latency = checked.await.then(|| due.elapsed().as_micros() as u32);
                let _ = tx.send(latency);
            });
        }
        started
    });
    let (mut all, mut failed) = (Vec::new(), 0);
    while let Some(latency) = rx.recv().await {
        match latency {
            Some(latency) => all.push(latency),
            None => failed += 1,
        }
    }
    let started = schedule.join().expect("the schedule's thread");
    let elapsed = started.elapsed().as_secs_f64();
    Figures {
        failed,
        ..figures(all, elapsed)
    }
}

/// The seed's plain token bucket (000/001): one key, `TIME`, `HMGET`, `HSET`, `PEXPIRE`.
const SEED_SCRIPT: &str = r#"
local cap, rate, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(b[1]) or cap
local ts = tonumber(b[2]) or now
tokens = math.min(cap, tokens + (now - ts) / 1000 * rate)
local allowed = 0
if tokens >= cost then
  tokens = tokens - cost
  allowed = 1
end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(cap / rate * 1000) + 1000)
local retry_ms = 0
if allowed == 0 then retry_ms = math.ceil((cost - tokens) / rate * 1000) end
return { allowed, math.floor(tokens), retry_ms }
"#;

/// rate-limiter-flexible's `RateLimiterRedis` over one ioredis connection (pinned versions,
/// installed under `target/node-limiter` with npm on the first run), checking the same number
/// of clients at the same concurrency against `server`; its row, with its own client CPU. `None`,
/// said on stderr, without `node` and `npm` or when the install fails.
fn node_limiter(server: &support::RedisServer, seconds: u64, concurrency: u64) -> Option<Figures> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let prefix = root.join("target").join("node-limiter");
    let modules = prefix.join("node_modules");
    if !modules.join("rate-limiter-flexible").exists() || !modules.join("ioredis").exists() {
        // Packages' own install scripts are not run; a registry out of reach gives up in 2 min.
        let installed = run_for(
            Command::new("npm")
                .args([
                    "install",
                    "--no-save",
                    "--no-audit",
                    "--no-fund",
                    "--ignore-scripts",
                    "--prefix",
                ])
                .arg(&prefix)
                .args(["rate-limiter-flexible@11.4.0", "ioredis@6.0.0"]),
            Duration::from_secs(120),
        );
        if !matches!(&installed, Some(output) if output.status.success()) {
            eprintln!(
                "  the Node limiter is not measured: `npm install rate-limiter-flexible ioredis` \
                 failed or ran out of time ({:?}); install Node.js and npm to compare with it",
                installed.map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
            );
            return None;
        }
    }
    reset_stats(server);
    let before = cpu(server);
    let output = run_for(
        Command::new("node")
            .env("NODE_PATH", &modules)
            .arg(root.join("benches/support/node_limiter.js"))
            .args([
                server.port.to_string(),
                seconds.to_string(),
                concurrency.to_string(),
            ]),
        Duration::from_secs(seconds + 60),
    );
    let text = match &output {
        Some(output) if output.status.success() => String::from_utf8_lossy(&output.stdout),
        _ => {
            eprintln!("  the Node limiter did not run: {output:?}");
            return None;
        }
    };
    let fields: Vec<f64> = text
        .split_whitespace()
        .filter_map(|f| f.parse().ok())
        .collect();
    let [rate, p50, p99, failed, decisions, client_cpu] = fields[..] else {
        eprintln!("  the Node limiter answered {text:?}");
        return None;
    };
    let f = Figures {
        rate,
        p50,
        p99,
        failed: failed as usize,
    };
    let node = Command::new("node").arg("--version").output();
    let version = node.map(|o| o.stdout).unwrap_or_default();
    row_with_client_cpu(
        &format!(
            "rate-limiter-flexible 11.4 (Node {}, ioredis, one connection)",
            String::from_utf8_lossy(&version).trim()
        ),
        f,
        decisions,
        client_cpu,
        before.1,
        server,
    );
    Some(f)
}

/// Runs `command` until it ends or `limit` has passed (then it is killed): its output (read
/// while it runs, so that a talkative command never blocks on a full pipe), `None` when it could
/// not start or ran out of time.
fn run_for(command: &mut Command, limit: Duration) -> Option<std::process::Output> {
    use std::io::Read;
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .ok()?;
    fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    }
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let (stdout, stderr) = (
        stdout.join().unwrap_or_default(),
        stderr.join().unwrap_or_default(),
    );
    Some(std::process::Output {
        status: status?,
        stdout,
        stderr,
    })
}

/// `redis-benchmark` sending `command` (`__rand_int__` for random clients).
fn redis_benchmark(
    port: u16,
    command_line: &[&str],
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
    ]);
    command.args(command_line);
    eprintln!("  $ {command:?}");
    let output = command.output().expect("run redis-benchmark");
    let text = String::from_utf8_lossy(&output.stdout);
    // "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("\"{}", command_line[0])))
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

/// The CPU time (user + system) of this process and of the server so far, in seconds.
fn cpu(server: &support::RedisServer) -> (f64, f64) {
    let own = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| {
            let rest = stat[stat.rfind(')')? + 2..].to_owned();
            let fields: Vec<f64> = rest
                .split_whitespace()
                .map(|f| f.parse().unwrap_or(0.0))
                .collect();
            Some((fields.get(11)? + fields.get(12)?) / 100.0)
        })
        .unwrap_or(f64::NAN);
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query(&mut server.conn())
        .expect("INFO cpu");
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(f64::NAN)
    };
    (own, field("used_cpu_user:") + field("used_cpu_sys:"))
}

/// A row of the standalone table: `decisions` made, with the server's calls and time in them
/// per decision, and the CPU this process and the server used per decision since `cpu_before`.
fn server_row(
    name: &str,
    f: Figures,
    decisions: f64,
    cpu_before: (f64, f64),
    server: &support::RedisServer,
) {
    let (own, _) = cpu(server);
    let client_cpu = (own - cpu_before.0) * 1e6 / decisions;
    row_with_client_cpu(name, f, decisions, client_cpu, cpu_before.1, server);
}

/// [`server_row`] for a client of its own, which measured its CPU per decision itself.
fn row_with_client_cpu(
    name: &str,
    f: Figures,
    decisions: f64,
    client_cpu: f64,
    redis_cpu_before: f64,
    server: &support::RedisServer,
) {
    let (calls, usec) = script_calls(server);
    let (_, redis) = cpu(server);
    println!(
        "| {name} | {:.0} | {:.0} | {:.0} | {} | {:.1} | {:.2} | {client_cpu:.2} | {:.2} | {} |",
        f.rate,
        f.p50,
        f.p99,
        f.failed,
        decisions / calls,
        usec / decisions,
        (redis - redis_cpu_before) * 1e6 / decisions,
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
        "| what | decisions/s | p50 µs | p99 µs | failed | decisions per call | Redis µs in calls per decision | client CPU µs per decision | Redis CPU µs per decision | load average |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");

    let secs = seconds as f64;
    if let Ok(rates) = std::env::var("BENCH_OPEN_RATES") {
        // Only the open loop, at the given rates (a latency curve).
        let store = rt
            .block_on(RedisStore::connect(server.url()))
            .expect("store");
        for rate in rates
            .split(',')
            .filter_map(|r| r.trim().parse::<f64>().ok())
            .filter(|r| {
                let measurable = r.is_finite() && (1.0..=10_000_000.0).contains(r);
                if !measurable {
                    eprintln!("  BENCH_OPEN_RATES: {r}/s is not measured (1 to 10,000,000/s)");
                }
                measurable
            })
        {
            reset_stats(&server);
            let before = cpu(&server);
            let f = rt.block_on(open_loop(store.clone(), rate, seconds));
            server_row(
                &format!("RedisStore, open loop at {rate:.0}/s"),
                f,
                f.rate * secs,
                before,
                &server,
            );
            reset_stats(&server);
            let before = cpu(&server);
            let f = rt.block_on(open_loop_bare(&server, rate, seconds));
            server_row(
                &format!("bare FCALL (redis-rs), open loop at {rate:.0}/s"),
                f,
                f.rate * secs,
                before,
                &server,
            );
        }
        return;
    }
    let mut best = Figures::default();
    let mut best_store = None;
    for (pool, max_batch) in [(1, 64), (2, 64), (4, 64), (2, 1)] {
        let store = rt.block_on(async {
            RedisStore::builder(server.url())
                .pool_size(pool)
                .max_batch(max_batch)
                .response_timeout(Duration::from_secs(5))
                .connect()
                .await
                .expect("store")
        });
        reset_stats(&server);
        let before = cpu(&server);
        let f = rt.block_on(closed_loop(store.clone(), concurrency, seconds));
        server_row(
            &format!("RedisStore, pool_size {pool}, max_batch {max_batch}"),
            f,
            f.rate * secs,
            before,
            &server,
        );
        if f.rate > best.rate {
            best = f;
            best_store = Some(store);
        }
    }
    // The same code called by redis-benchmark, one decision per call, and the seed's script.
    let (library, function) = RedisStore::function_library();
    let _: redis::Value = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(library)
        .query(&mut server.conn())
        .expect("FUNCTION LOAD");
    let seed_sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(SEED_SCRIPT)
        .query(&mut server.conn())
        .expect("SCRIPT LOAD");
    let fcall = [
        "FCALL",
        function,
        "1",
        "tollgate:{__rand_int__}:bench",
        "c",
        "tb:1000000000:3600000000:1000000000:4:1:0",
    ];
    let seed = [
        "EVALSHA",
        &seed_sha,
        "1",
        "seed:{__rand_int__}:bench",
        "1000000000",
        "277777.8",
        "1",
    ];
    let requests = (best.rate * secs) as u64;
    let mut seed_figures = Vec::new();
    for round in 0..2 {
        for (name, command) in [
            ("tollgate's FCALL", &fcall[..]),
            ("the seed's script", &seed[..]),
        ] {
            reset_stats(&server);
            let before = cpu(&server);
            let f = redis_benchmark(server.port, command, concurrency, requests, 1);
            let (calls, usec) = script_calls(&server);
            server_row(
                &format!(
                    "redis-benchmark, {name}, no pipelining (round {})",
                    round + 1
                ),
                f,
                requests as f64,
                before,
                &server,
            );
            if name.starts_with("the seed") {
                seed_figures.push(usec / calls);
            }
        }
    }
    // The Node limiter of the issue that set the goal, on the same server.
    let node = node_limiter(&server, seconds, concurrency);
    reset_stats(&server);
    let before = cpu(&server);
    let pipelined = redis_benchmark(server.port, &fcall, concurrency, requests * 2, 16);
    server_row(
        "redis-benchmark, tollgate's FCALL, -P 16",
        pipelined,
        (requests * 2) as f64,
        before,
        &server,
    );
    reset_stats(&server);
    let before = cpu(&server);
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
        half.rate * secs,
        before,
        &server,
    );
    println!();
    println!(
        "best RedisStore / pipelined redis-benchmark FCALL: {:.2}; the seed's script: {:.2} µs per call",
        best.rate / pipelined.rate,
        median(seed_figures)
    );
    if let Some(node) = node {
        println!(
            "best RedisStore / rate-limiter-flexible (Node): {:.2}",
            best.rate / node.rate
        );
    }

    // The cluster: the store's one connection per node against a bb8 pool of connections.
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
        "RedisClusterStore (a connection per primary)",
        rt.block_on(closed_loop(store, concurrency, seconds)),
    );
    cluster.on_every_node(
        redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg("REPLACE")
            .arg(library),
    );
    row(
        "bb8 pool of 4 cluster connections, same FCALL",
        rt.block_on(pooled_cluster(&cluster, function, concurrency, seconds)),
    );
    row(
        "one multiplexed cluster connection, same FCALL",
        rt.block_on(shared_cluster(&cluster, function, concurrency, seconds)),
    );

    memory_usage(&rt, &server);
}

/// The store's call for one client, as `FCALL` of its function.
fn fcall(function: &str, client: u64) -> redis::Cmd {
    let mut cmd = redis::cmd("FCALL");
    cmd.arg(function)
        .arg(1)
        .arg(format!("tollgate:{{{client}}}:bench"))
        .arg("c")
        .arg("tb:1000000000:3600000000:1000000000:4:1:0");
    cmd
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

async fn pooled_cluster(
    cluster: &support::RedisCluster,
    function: &str,
    concurrency: u64,
    seconds: u64,
) -> Figures {
    let client = redis::cluster::ClusterClient::new(cluster.urls()).expect("client");
    let pool = bb8::Pool::builder()
        .max_size(4)
        .build(client)
        .await
        .expect("pool");
    let function = function.to_owned();
    timed_loop(concurrency, seconds, move |client| {
        let (pool, cmd) = (pool.clone(), fcall(&function, client));
        async move {
            let mut conn = pool.get().await.expect("pooled connection");
            cmd.query_async::<redis::Value>(&mut *conn)
                .await
                .expect("FCALL");
        }
    })
    .await
}

async fn shared_cluster(
    cluster: &support::RedisCluster,
    function: &str,
    concurrency: u64,
    seconds: u64,
) -> Figures {
    let client = redis::cluster::ClusterClient::new(cluster.urls()).expect("client");
    let conn = client.get_async_connection().await.expect("connection");
    let function = function.to_owned();
    timed_loop(concurrency, seconds, move |client| {
        let (mut conn, cmd) = (conn.clone(), fcall(&function, client));
        async move {
            cmd.query_async::<redis::Value>(&mut conn)
                .await
                .expect("FCALL");
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
