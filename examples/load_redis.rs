//! HTTP load harness, Redis variant: hello-world axum served on one runtime thread, bare and
//! behind tollgate with the Redis store, measured in one run so the figures compare on the same
//! (noisy) machine.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --release --example load_redis
//! LOAD_SECONDS=10 LOAD_ROUNDS=5 LOAD_CONNECTIONS=64 cargo run --release --example load_redis
//! ```
//!
//! Configurations: bare; tollgate with the memory store (for reference); tollgate with the Redis
//! store, allowing everything; tollgate with the Redis store, rejecting everything (after the
//! first request). The Redis store's connections are driven by the serving thread, so its client
//! cost is counted where it is paid. The load generator is `wrk` (one thread) when it is
//! installed, else a built-in hyper client. Rounds are interleaved; each figure is the median
//! over rounds. Only loopback addresses are used and every run stops by itself.

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
    Memory,
    RedisAllow,
    RedisReject,
}

impl Config {
    const ALL: [Config; 4] = [
        Config::Bare,
        Config::Memory,
        Config::RedisAllow,
        Config::RedisReject,
    ];

    fn name(self) -> &'static str {
        match self {
            Config::Bare => "bare axum",
            Config::Memory => "tollgate + memory, allowing all",
            Config::RedisAllow => "tollgate + Redis, allowing all",
            Config::RedisReject => "tollgate + Redis, rejecting all",
        }
    }

    async fn app(self, url: &str, prefix: &str) -> Router {
        let app = Router::new().route("/", get(|| async { "Hello, World!" }));
        let allow = Rule::new("load", Quota::per_second(1_000_000).burst(1_000_000_000));
        let reject = Rule::new("load", Quota::per_hour(1));
        let redis = || async {
            RedisStore::builder(url)
                .prefix(prefix)
                .build()
                .await
                .expect("connect to Redis (set REDIS_URL)")
        };
        match self {
            Config::Bare => app,
            Config::Memory => app.layer(
                RateLimitLayer::builder()
                    .rule(allow)
                    .build()
                    .expect("valid configuration"),
            ),
            Config::RedisAllow => app.layer(
                RateLimitLayer::builder()
                    .rule(allow)
                    .store(redis().await)
                    .build()
                    .expect("valid configuration"),
            ),
            Config::RedisReject => app.layer(
                RateLimitLayer::builder()
                    .rule(reject)
                    .store(redis().await)
                    .build()
                    .expect("valid configuration"),
            ),
        }
    }
}

/// A server on its own OS thread with a current-thread runtime: one core serves.
struct Server {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    fn start(config: Config, url: String, prefix: String) -> Server {
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let app = config.app(&url, &prefix).await;
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind");
                addr_tx
                    .send(listener.local_addr().expect("addr"))
                    .expect("send addr");
                axum::serve(
                    listener,
                    app.into_make_service_with_connect_info::<SocketAddr>(),
                )
                .with_graceful_shutdown(async {
                    let _ = stop_rx.await;
                })
                .await
                .expect("serve");
            });
        });
        Server {
            addr: addr_rx.recv().expect("server address"),
            stop: Some(stop_tx),
            thread: Some(thread),
        }
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

#[derive(Clone, Copy, Debug, Default)]
struct Measurement {
    requests_per_second: f64,
    p50_micros: f64,
    p99_micros: f64,
    non_2xx_share: f64,
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
    let non_2xx: f64 = text
        .lines()
        .find(|l| l.contains("Non-2xx"))
        .and_then(|l| l.split(':').nth(1))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0.0);
    Measurement {
        requests_per_second: field("Requests/sec:")
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN),
        p50_micros: field("50%").map(latency).unwrap_or(f64::NAN),
        p99_micros: field("99%").map(latency).unwrap_or(f64::NAN),
        non_2xx_share: non_2xx / total,
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
            requests_per_second: all.len() as f64 / seconds as f64,
            p50_micros: pct(0.50),
            p99_micros: pct(0.99),
            non_2xx_share: rejected as f64 / all.len().max(1) as f64,
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
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let wrk = have_wrk() && std::env::var("LOAD_CLIENT").as_deref() != Ok("hyper");
    println!(
        "load_redis: {} configurations × {rounds} rounds × {seconds} s, {connections} connections, \
         client: {}, Redis at {url}",
        Config::ALL.len(),
        if wrk {
            "wrk -t1"
        } else {
            "built-in hyper client"
        }
    );
    let mut results: Vec<Vec<Measurement>> = vec![Vec::new(); Config::ALL.len()];
    for round in 1..=rounds {
        for (i, config) in Config::ALL.iter().enumerate() {
            // A prefix per run: the rejecting configuration starts from an empty budget.
            let prefix = format!("tollgate-load-{}-{round}-{i}", std::process::id());
            let server = Server::start(*config, url.clone(), prefix);
            let m = if wrk {
                measure_wrk(server.addr, seconds, connections)
            } else {
                measure_hyper(server.addr, seconds, connections)
            };
            drop(server);
            eprintln!(
                "round {round}: {:<34} {:>9.0} req/s  p50 {:>7.0} µs  p99 {:>7.0} µs  non-2xx {:>5.1}%",
                config.name(),
                m.requests_per_second,
                m.p50_micros,
                m.p99_micros,
                100.0 * m.non_2xx_share
            );
            results[i].push(m);
        }
    }
    let summary: Vec<Measurement> = results
        .iter()
        .map(|ms| Measurement {
            requests_per_second: median(ms.iter().map(|m| m.requests_per_second).collect()),
            p50_micros: median(ms.iter().map(|m| m.p50_micros).collect()),
            p99_micros: median(ms.iter().map(|m| m.p99_micros).collect()),
            non_2xx_share: median(ms.iter().map(|m| m.non_2xx_share).collect()),
        })
        .collect();
    let bare = summary[0];
    println!();
    println!("| configuration | req/s | × bare | p50 µs | p99 µs | added p99 µs | non-2xx |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for (config, m) in Config::ALL.iter().zip(&summary) {
        println!(
            "| {} | {:.0} | {:.2} | {:.0} | {:.0} | {:+.0} | {:.1}% |",
            config.name(),
            m.requests_per_second,
            m.requests_per_second / bare.requests_per_second,
            m.p50_micros,
            m.p99_micros,
            m.p99_micros - bare.p99_micros,
            100.0 * m.non_2xx_share
        );
    }
}
