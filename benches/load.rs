//! HTTP load harness: hello-world axum served on one runtime thread, bare and behind rate
//! limiters, measured in one run so the figures compare on the same (noisy) machine.
//!
//! ```text
//! cargo bench --bench load                 # 3 rounds × 5 s per configuration
//! LOAD_SECONDS=10 LOAD_ROUNDS=5 LOAD_CONNECTIONS=64 cargo bench --bench load
//! REDIS_URL=redis://127.0.0.1:6379 cargo bench --bench load -- --redis
//! cargo bench --bench load --features metrics -- --metrics
//! ```
//!
//! Configurations: bare; tollgate allowing everything; tollgate rejecting everything (after the
//! first request); tower_governor allowing everything; tower_governor rejecting everything;
//! tollgate with a concurrency rule (`Rule::concurrent`) allowing everything (`LOAD_ONLY=0,1,5`
//! compares it with the token bucket). With
//! `--redis`, also tollgate with the Redis store (`REDIS_URL`), allowing and rejecting everything,
//! and allowing with a lease of `LOAD_LEASE` units (default 200; `Rule::lease`: the load is one
//! hot key, every connection comes from 127.0.0.1; `LOAD_ONLY=0,5,9` without `--metrics`:
//! `LOAD_ONLY` counts the configurations that remain after `--redis` and `--metrics` filter
//! them); its connections are driven by the serving thread, so their cost is counted where it
//! is paid.
//! With `--metrics` (and the feature `metrics`), also tollgate allowing and rejecting with a
//! Prometheus recorder (`metrics-exporter-prometheus`) installed on the serving thread.
//! The load generator is `wrk` when it is installed (one thread, the other core), else a built-in
//! hyper client. Rounds are interleaved; each figure is the median over rounds. "machine idle" is
//! the share of all cores' time that no process used during the run (`/proc/stat`): a server
//! bound by waiting (on Redis, on waking a core) leaves it high, a CPU-bound one near zero. Only
//! loopback addresses are used and every run stops by itself.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use tollgate::store::RedisStore;
use tollgate::{Quota, RateLimitLayer, Rule};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Config {
    Bare,
    TollgateAllow,
    TollgateReject,
    GovernorAllow,
    GovernorReject,
    RedisAllow,
    RedisAllowUnbatched,
    RedisReject,
    RedisAllowLeased,
    MetricsAllow,
    MetricsReject,
    ConcurrencyAllow,
}

impl Config {
    const ALL: [Config; 12] = [
        Config::Bare,
        Config::TollgateAllow,
        Config::TollgateReject,
        Config::GovernorAllow,
        Config::GovernorReject,
        Config::RedisAllow,
        Config::RedisAllowUnbatched,
        Config::RedisReject,
        Config::MetricsAllow,
        Config::MetricsReject,
        Config::ConcurrencyAllow,
        Config::RedisAllowLeased,
    ];

    fn name(self) -> &'static str {
        match self {
            Config::Bare => "bare axum",
            Config::TollgateAllow => "tollgate, allowing all",
            Config::TollgateReject => "tollgate, rejecting all",
            Config::GovernorAllow => "tower_governor, allowing all",
            Config::GovernorReject => "tower_governor, rejecting all",
            Config::RedisAllow => "tollgate + Redis, allowing all",
            Config::RedisAllowUnbatched => "tollgate + Redis, allowing, max_batch 1",
            Config::RedisReject => "tollgate + Redis, rejecting a denied key",
            Config::MetricsAllow => "tollgate + Prometheus, allowing all",
            Config::MetricsReject => "tollgate + Prometheus, rejecting all",
            Config::ConcurrencyAllow => "tollgate, concurrency rule allowing all",
            Config::RedisAllowLeased => "tollgate + Redis, allowing, leased",
        }
    }

    fn uses_redis(self) -> bool {
        matches!(
            self,
            Config::RedisAllow
                | Config::RedisAllowUnbatched
                | Config::RedisReject
                | Config::RedisAllowLeased
        )
    }

    fn records_metrics(self) -> bool {
        matches!(self, Config::MetricsAllow | Config::MetricsReject)
    }

    /// The app; `redis` is the URL and a key prefix of its own (so that every run starts from
    /// an empty budget).
    async fn app(self, redis: &(String, String)) -> Router {
        let app = Router::new().route("/", get(|| async { "Hello, World!" }));
        let redis_store = |max_batch: usize| async move {
            RedisStore::builder(&redis.0)
                .prefix(&redis.1)
                .max_batch(max_batch)
                .connect()
                .await
                .expect("connect to Redis (set REDIS_URL)")
        };
        match self {
            Config::Bare => app,
            Config::TollgateAllow | Config::MetricsAllow => app.layer(
                RateLimitLayer::builder()
                    .rule(Rule::new(
                        "load",
                        Quota::per_second(1_000_000).burst(1_000_000_000),
                    ))
                    .build()
                    .expect("valid configuration"),
            ),
            Config::TollgateReject | Config::MetricsReject => app.layer(
                RateLimitLayer::builder()
                    .rule(Rule::new("load", Quota::per_hour(1)))
                    .build()
                    .expect("valid configuration"),
            ),
            // The same layer with a concurrency rule instead of a token bucket: a slot taken
            // when the request is admitted, given back when its body ends.
            Config::ConcurrencyAllow => app.layer(
                RateLimitLayer::builder()
                    .rule(Rule::concurrent("load", 10_000))
                    .build()
                    .expect("valid configuration"),
            ),
            Config::GovernorAllow => {
                let config = tower_governor::governor::GovernorConfigBuilder::default()
                    .per_nanosecond(1)
                    .burst_size(1_000_000_000)
                    .finish()
                    .expect("valid configuration");
                app.layer(tower_governor::GovernorLayer::new(config))
            }
            Config::GovernorReject => {
                // tower_governor's per_second(n) means one request every n seconds.
                let config = tower_governor::governor::GovernorConfigBuilder::default()
                    .per_second(3600)
                    .burst_size(1)
                    .finish()
                    .expect("valid configuration");
                app.layer(tower_governor::GovernorLayer::new(config))
            }
            // RedisAllowLeased: the load is one key (every connection comes from 127.0.0.1), a
            // hot key; each call takes up to LOAD_LEASE units that the next requests spend here.
            Config::RedisAllow | Config::RedisAllowUnbatched | Config::RedisAllowLeased => {
                let rule = Rule::new("load", Quota::per_second(1_000_000).burst(1_000_000_000));
                let rule = if self == Config::RedisAllowLeased {
                    rule.lease(env_u64("LOAD_LEASE", 200))
                } else {
                    rule
                };
                let max_batch = if self == Config::RedisAllowUnbatched {
                    1
                } else {
                    tollgate::store::DEFAULT_MAX_BATCH
                };
                app.layer(
                    RateLimitLayer::builder()
                        .rule(rule)
                        .store(redis_store(max_batch).await)
                        .build()
                        .expect("valid configuration"),
                )
            }
            // After its first request the client is a known-denied key (the deny cache).
            Config::RedisReject => app.layer(
                RateLimitLayer::builder()
                    .rule(Rule::new("load", Quota::per_hour(1)))
                    .store(redis_store(tollgate::store::DEFAULT_MAX_BATCH).await)
                    .build()
                    .expect("valid configuration"),
            ),
        }
    }
}

/// A server on its own OS thread with a current-thread runtime: one core serves.
struct Server {
    addr: SocketAddr,
    /// `/proc/<pid>/task/<tid>` of the serving thread, to read its CPU time.
    task: Option<std::path::PathBuf>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    fn start(config: Config, redis: (String, String)) -> Server {
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (task_tx, task_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let _ = task_tx.send(
                std::fs::read_link("/proc/thread-self")
                    .ok()
                    .map(|p| std::path::Path::new("/proc").join(p)),
            );
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            // The serving thread records into a Prometheus recorder of its own.
            #[cfg(feature = "metrics")]
            let recorder = config
                .records_metrics()
                .then(|| metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder());
            #[cfg(feature = "metrics")]
            let _recording = recorder
                .as_ref()
                .map(|r| metrics::set_default_local_recorder(r));
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind");
                addr_tx
                    .send(listener.local_addr().expect("addr"))
                    .expect("send addr");
                let app = config
                    .app(&redis)
                    .await
                    .into_make_service_with_connect_info::<SocketAddr>();
                axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = stop_rx.await;
                    })
                    .await
                    .expect("serve");
            });
        });
        Server {
            task: task_rx.recv().ok().flatten(),
            addr: addr_rx.recv().expect("server address"),
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }
}

impl Server {
    /// What the serving thread used so far: CPU time in user space and in the kernel, in
    /// seconds, and the times it went to sleep (voluntary context switches: it waited for
    /// the network or Redis, and something had to wake it); from /proc on Linux.
    fn usage(&self) -> Option<Usage> {
        let task = self.task.as_ref()?;
        let stat = std::fs::read_to_string(task.join("stat")).ok()?;
        // Fields after the command name (which is in parentheses): state is field 3; utime and
        // stime are fields 14 and 15, in clock ticks (100 per second on Linux).
        let rest = &stat[stat.rfind(')')? + 2..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let ticks = |i: usize| Some(fields.get(i)?.parse::<f64>().ok()? / 100.0);
        let status = std::fs::read_to_string(task.join("status")).ok()?;
        let sleeps = status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))?
            .trim()
            .parse()
            .ok()?;
        Some(Usage {
            user: ticks(11)?,
            system: ticks(12)?,
            sleeps,
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// What a thread used: CPU seconds in user space and in the kernel, and its sleeps.
#[derive(Clone, Copy, Debug)]
struct Usage {
    user: f64,
    system: f64,
    sleeps: f64,
}

/// Idle and total CPU time of the whole machine so far (`/proc/stat`, in clock ticks).
fn machine_cpu_ticks() -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let ticks: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal …: idle and iowait are idle time.
    let idle = ticks.get(3)? + ticks.get(4)?;
    Some((idle, ticks.iter().take(8).sum()))
}

/// Calls of tollgate's code (`FCALL`, `EVALSHA`) Redis ran so far, and the µs it spent in them.
fn redis_calls(url: &str) -> Option<(f64, f64)> {
    let mut conn = redis::Client::open(url).ok()?.get_connection().ok()?;
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut conn)
        .ok()?;
    let mut calls = 0.0;
    let mut usec = 0.0;
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
    Some((calls, usec))
}

#[derive(Clone, Copy, Debug, Default)]
struct Measurement {
    /// Server CPU time per request, in µs (NaN where /proc is not available), and the part of
    /// it spent in the kernel.
    cpu_micros_per_request: f64,
    system_micros_per_request: f64,
    /// Times the serving thread went to sleep, per request.
    sleeps_per_request: f64,
    /// Redis calls per request, and Redis µs per request (NaN without Redis).
    redis_calls_per_request: f64,
    redis_micros_per_request: f64,
    requests_per_second: f64,
    p50_micros: f64,
    p99_micros: f64,
    non_2xx_share: f64,
    /// Share of the machine's CPU time (all cores) that was idle during the run: a server
    /// that waits on Redis leaves cores idle that a CPU-bound one keeps busy.
    machine_idle_share: f64,
}

fn have_wrk() -> bool {
    Command::new("wrk").arg("--version").output().is_ok()
}

fn measure_wrk(addr: SocketAddr, seconds: u64, connections: u64) -> Measurement {
    let out = Command::new("wrk")
        .args([
            "-t1",
            &format!("-c{connections}"),
            &format!("-d{seconds}s"),
            "--latency",
        ])
        .arg(format!("http://{addr}/"))
        .output()
        .expect("run wrk");
    let text = String::from_utf8_lossy(&out.stdout);
    let field = |prefix: &str| -> Option<&str> {
        text.lines()
            .map(str::trim)
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.split_whitespace().nth(1))
    };
    let latency = |s: &str| -> f64 {
        let (num, unit) = s.split_at(s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len()));
        let v: f64 = num.parse().unwrap_or(f64::NAN);
        match unit {
            "us" => v,
            "ms" => v * 1e3,
            "s" => v * 1e6,
            _ => f64::NAN,
        }
    };
    let total: f64 = text
        .lines()
        .find(|l| l.contains("requests in"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(f64::NAN);
    let non_2xx: f64 = field("Non-2xx or 3xx responses:")
        .and_then(|_| {
            text.lines()
                .find(|l| l.contains("Non-2xx"))
                .and_then(|l| l.split(':').nth(1))
                .and_then(|n| n.trim().parse().ok())
        })
        .unwrap_or(0.0);
    Measurement {
        cpu_micros_per_request: f64::NAN,
        system_micros_per_request: f64::NAN,
        sleeps_per_request: f64::NAN,
        redis_calls_per_request: f64::NAN,
        redis_micros_per_request: f64::NAN,
        requests_per_second: field("Requests/sec:")
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN),
        p50_micros: field("50%").map(latency).unwrap_or(f64::NAN),
        p99_micros: field("99%").map(latency).unwrap_or(f64::NAN),
        non_2xx_share: non_2xx / total,
        machine_idle_share: f64::NAN,
    }
}

/// The fallback load generator: `connections` keep-alive HTTP/1.1 connections on one thread.
fn measure_hyper(addr: SocketAddr, seconds: u64, connections: u64) -> Measurement {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for _ in 0..connections {
            let stop = stop.clone();
            tasks.push(tokio::spawn(async move {
                let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
                let io = hyper_util::rt::TokioIo::new(stream);
                let (mut sender, conn) = hyper::client::conn::http1::handshake::<
                    _,
                    http_body_util::Empty<bytes::Bytes>,
                >(io)
                .await
                .expect("handshake");
                tokio::spawn(conn);
                let mut latencies = Vec::new();
                let mut rejected = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let req = http::Request::get("/")
                        .header("host", "localhost")
                        .body(Default::default())
                        .expect("request");
                    let start = Instant::now();
                    let res = sender.send_request(req).await.expect("response");
                    let status = res.status();
                    http_body_util::BodyExt::collect(res.into_body())
                        .await
                        .expect("body");
                    latencies.push(start.elapsed().as_micros() as u32);
                    rejected += u64::from(!status.is_success());
                }
                (latencies, rejected)
            }));
        }
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        let mut rejected = 0;
        for task in tasks {
            let (latencies, r) = task.await.expect("load task");
            all.extend(latencies);
            rejected += r;
        }
        all.sort_unstable();
        let pct = |p: f64| {
            all.get(((all.len() as f64 - 1.0) * p) as usize)
                .copied()
                .unwrap_or(0) as f64
        };
        Measurement {
            cpu_micros_per_request: f64::NAN,
            system_micros_per_request: f64::NAN,
            sleeps_per_request: f64::NAN,
            redis_calls_per_request: f64::NAN,
            redis_micros_per_request: f64::NAN,
            requests_per_second: all.len() as f64 / seconds as f64,
            p50_micros: pct(0.50),
            p99_micros: pct(0.99),
            non_2xx_share: rejected as f64 / all.len().max(1) as f64,
            machine_idle_share: f64::NAN,
        }
    })
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let seconds = env_u64("LOAD_SECONDS", 5).clamp(1, 60);
    let rounds = env_u64("LOAD_ROUNDS", 3).clamp(1, 10);
    let connections = env_u64("LOAD_CONNECTIONS", 32).clamp(1, 512);
    let wrk = have_wrk() && std::env::var("LOAD_CLIENT").as_deref() != Ok("hyper");
    let with_redis = std::env::args().any(|a| a == "--redis");
    let with_metrics = std::env::args().any(|a| a == "--metrics");
    if with_metrics && !cfg!(feature = "metrics") {
        eprintln!(
            "--metrics needs the feature: cargo bench --bench load --features metrics -- --metrics"
        );
        std::process::exit(2);
    }
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let configs: Vec<Config> = Config::ALL
        .into_iter()
        .filter(|c| with_redis || !c.uses_redis())
        .filter(|c| with_metrics || !c.records_metrics())
        .collect();
    println!(
        "load: {} configurations × {rounds} rounds × {seconds} s, {connections} connections, client: {}{}",
        configs.len(),
        if wrk {
            "wrk -t1"
        } else {
            "built-in hyper client"
        },
        if with_redis {
            format!(
                ", Redis at {url}, lease of {} units",
                env_u64("LOAD_LEASE", 200)
            )
        } else {
            String::new()
        }
    );

    // LOAD_ONLY=1,2 measures only those configurations (0 is bare), e.g. under a profiler.
    let only: Option<Vec<usize>> = std::env::var("LOAD_ONLY")
        .ok()
        .map(|v| v.split(',').filter_map(|i| i.trim().parse().ok()).collect());
    let mut results: Vec<Vec<Measurement>> = vec![Vec::new(); configs.len()];
    for round in 1..=rounds {
        for (i, config) in configs.iter().enumerate() {
            if only.as_ref().is_some_and(|only| !only.contains(&i)) {
                continue;
            }
            let prefix = format!("tollgate-load-{}-{round}-{i}", std::process::id());
            let server = Server::start(*config, (url.clone(), prefix));
            let usage_before = server.usage();
            let machine_before = machine_cpu_ticks();
            let redis_before = config.uses_redis().then(|| redis_calls(&url)).flatten();
            let mut m = if wrk {
                measure_wrk(server.addr, seconds, connections)
            } else {
                measure_hyper(server.addr, seconds, connections)
            };
            let requests = m.requests_per_second * seconds as f64;
            if let (Some(before), Some(after)) = (usage_before, server.usage()) {
                let system = after.system - before.system;
                m.cpu_micros_per_request = (after.user - before.user + system) * 1e6 / requests;
                m.system_micros_per_request = system * 1e6 / requests;
                m.sleeps_per_request = (after.sleeps - before.sleeps) / requests;
            } else {
                m.cpu_micros_per_request = f64::NAN;
                m.system_micros_per_request = f64::NAN;
                m.sleeps_per_request = f64::NAN;
            }
            if let (Some((idle, total)), Some((idle_after, total_after))) =
                (machine_before, machine_cpu_ticks())
            {
                m.machine_idle_share = (idle_after - idle) / (total_after - total).max(1.0);
            }
            if let (Some((calls, usec)), Some((calls_after, usec_after))) =
                (redis_before, redis_calls(&url))
            {
                m.redis_calls_per_request = (calls_after - calls) / requests;
                m.redis_micros_per_request = (usec_after - usec) / requests;
            }
            drop(server);
            eprintln!(
                "round {round}: {:<30} {:>10.0} req/s  p50 {:>7.0} µs  p99 {:>7.0} µs  non-2xx {:>5.1}%  server CPU {:.2} µs/req ({:.2} in the kernel, {:.3} sleeps/req)  machine idle {:>4.1}%",
                config.name(),
                m.requests_per_second,
                m.p50_micros,
                m.p99_micros,
                100.0 * m.non_2xx_share,
                m.cpu_micros_per_request,
                m.system_micros_per_request,
                m.sleeps_per_request,
                100.0 * m.machine_idle_share
            );
            results[i].push(m);
        }
    }

    let summary: Vec<Measurement> = results
        .iter()
        .map(|ms| {
            if ms.is_empty() {
                Measurement::default()
            } else {
                Measurement {
                    requests_per_second: median(ms.iter().map(|m| m.requests_per_second).collect()),
                    p50_micros: median(ms.iter().map(|m| m.p50_micros).collect()),
                    p99_micros: median(ms.iter().map(|m| m.p99_micros).collect()),
                    non_2xx_share: median(ms.iter().map(|m| m.non_2xx_share).collect()),
                    cpu_micros_per_request: median(
                        ms.iter().map(|m| m.cpu_micros_per_request).collect(),
                    ),
                    system_micros_per_request: median(
                        ms.iter().map(|m| m.system_micros_per_request).collect(),
                    ),
                    sleeps_per_request: median(ms.iter().map(|m| m.sleeps_per_request).collect()),
                    redis_calls_per_request: median(
                        ms.iter().map(|m| m.redis_calls_per_request).collect(),
                    ),
                    redis_micros_per_request: median(
                        ms.iter().map(|m| m.redis_micros_per_request).collect(),
                    ),
                    machine_idle_share: median(ms.iter().map(|m| m.machine_idle_share).collect()),
                }
            }
        })
        .collect();
    let bare = summary[0];
    println!();
    println!(
        "| configuration | req/s | × bare | server CPU µs/req | over bare | in the kernel | sleeps/req | p50 µs | p99 µs | added p99 µs | non-2xx | machine idle | Redis calls/req | Redis µs/req |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for ((config, m), measured) in configs.iter().zip(&summary).zip(&results) {
        if measured.is_empty() {
            // Left out by LOAD_ONLY.
            continue;
        }
        let redis = |v: f64, digits: usize| {
            if v.is_nan() {
                String::new()
            } else {
                format!("{v:.digits$}")
            }
        };
        println!(
            "| {} | {:.0} | {:.2} | {:.2} | {:+.2} | {:.2} | {:.3} | {:.0} | {:.0} | {:+.0} | {:.1}% | {:.0}% | {} | {} |",
            config.name(),
            m.requests_per_second,
            m.requests_per_second / bare.requests_per_second,
            m.cpu_micros_per_request,
            m.cpu_micros_per_request - bare.cpu_micros_per_request,
            m.system_micros_per_request,
            m.sleeps_per_request,
            m.p50_micros,
            m.p99_micros,
            m.p99_micros - bare.p99_micros,
            100.0 * m.non_2xx_share,
            100.0 * m.machine_idle_share,
            redis(m.redis_calls_per_request, 4),
            redis(m.redis_micros_per_request, 2)
        );
    }
}
