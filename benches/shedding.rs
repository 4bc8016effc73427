//! Load shedding under a bounded loopback load that exceeds the server's capacity: how many
//! requests of each priority class were served and shed, and how long the served ones took,
//! with and without [`Shedding`], in one run.
//!
//! ```text
//! cargo bench --bench shedding
//! SHED_SECONDS=10 cargo bench --bench shedding
//! ```
//!
//! The server (axum, on its own thread) has 16 workers, each taking 4 ms per request (a
//! semaphore and a sleep): it serves at most 4,000 requests a second, and a request that waits
//! for a worker waits in its handler. The clients, on loopback only, keep 64 `low`, 32
//! `normal` and 4 `critical` requests in flight (closed loops, one connection each, a shed
//! client trying again after 2 ms) for `SHED_SECONDS` (default 5) per configuration:
//!
//! - **no shedding**: the same layer with its rate rule only (every request admitted);
//! - **shedding**: `Shedding::new(32)` (low up to 16 in flight, normal up to 25, critical all
//!   32), priority from the `x-priority` header.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use tokio::sync::Semaphore;
use tollgate::key::Global;
use tollgate::{Priority, Quota, RateLimitLayer, Rule, Shedding};

const WORKERS: usize = 16;
const WORK: Duration = Duration::from_millis(4);
const CLASSES: [(&str, usize); 3] = [("low", 64), ("normal", 32), ("critical", 4)];

fn app(shed: bool) -> Router {
    let workers = Arc::new(Semaphore::new(WORKERS));
    let mut limits = RateLimitLayer::builder()
        .rule(Rule::new("api", Quota::per_second(1_000_000).burst(1_000_000_000)).key(Global));
    if shed {
        limits = limits.shed(Shedding::new(2 * WORKERS).priority(
            |parts: &http::request::Parts| {
                match parts.headers.get("x-priority").map(|v| v.as_bytes()) {
                    Some(b"critical") => Priority::Critical,
                    Some(b"low") => Priority::Low,
                    _ => Priority::Normal,
                }
            },
        ));
    }
    Router::new()
        .route(
            "/",
            get(move || {
                let workers = workers.clone();
                async move {
                    let _worker = workers.acquire().await.expect("open");
                    tokio::time::sleep(WORK).await;
                    "done"
                }
            }),
        )
        .layer(limits.build().expect("valid configuration"))
}

/// Serves `app` on a loopback port from a thread of its own, until `stop` is sent.
fn serve(
    app: Router,
) -> (
    SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    std::thread::JoinHandle<()>,
) {
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            addr_tx
                .send(listener.local_addr().expect("addr"))
                .expect("send");
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
    (addr_rx.recv().expect("address"), stop_tx, thread)
}

#[derive(Default)]
struct ClassFigures {
    served: u64,
    shed: u64,
    other: u64,
    /// Latencies of served requests, in µs.
    latencies: Vec<u64>,
}

impl ClassFigures {
    fn percentile(&mut self, p: f64) -> f64 {
        if self.latencies.is_empty() {
            return f64::NAN;
        }
        self.latencies.sort_unstable();
        let i = ((self.latencies.len() as f64 * p).ceil() as usize).clamp(1, self.latencies.len());
        self.latencies[i - 1] as f64 / 1000.0
    }
}

/// Runs the clients against `addr` for `seconds`: the figures of each class.
async fn drive(addr: SocketAddr, seconds: f64) -> Vec<ClassFigures> {
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    let mut classes = Vec::new();
    for (class, loops) in CLASSES {
        let mut tasks = Vec::new();
        for _ in 0..loops {
            tasks.push(tokio::spawn(async move {
                let client = Client::builder(hyper_util::rt::TokioExecutor::new())
                    .pool_max_idle_per_host(1)
                    .build_http::<Empty<Bytes>>();
                let mut figures = ClassFigures::default();
                while Instant::now() < until {
                    let request = http::Request::get(format!("http://{addr}/"))
                        .header("x-priority", class)
                        .body(Empty::new())
                        .expect("request");
                    let sent = Instant::now();
                    let Ok(response) = client.request(request).await else {
                        figures.other += 1;
                        continue;
                    };
                    let status = response.status();
                    let _ = response.into_body().collect().await;
                    match status.as_u16() {
                        200 => {
                            figures.served += 1;
                            figures.latencies.push(sent.elapsed().as_micros() as u64);
                        }
                        503 => {
                            figures.shed += 1;
                            tokio::time::sleep(Duration::from_millis(2)).await;
                        }
                        _ => figures.other += 1,
                    }
                }
                figures
            }));
        }
        classes.push(tasks);
    }
    let mut out = Vec::new();
    for tasks in classes {
        let mut total = ClassFigures::default();
        for task in tasks {
            let figures = task.await.expect("client");
            total.served += figures.served;
            total.shed += figures.shed;
            total.other += figures.other;
            total.latencies.extend(figures.latencies);
        }
        out.push(total);
    }
    out
}

fn main() {
    let seconds: f64 = std::env::var("SHED_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5.0);
    let clients = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "capacity: {WORKERS} workers × {} ms per request = {} requests/s; clients in flight: \
         low 64, normal 32, critical 4; {seconds} s per configuration",
        WORK.as_millis(),
        WORKERS as u128 * 1000 / WORK.as_millis()
    );
    println!();
    println!(
        "| configuration | class | served/s | shed | p50 served (ms) | p99 served (ms) | errors |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|");
    for (name, shed) in [("no shedding", false), ("Shedding::new(32)", true)] {
        let (addr, stop, thread) = serve(app(shed));
        let mut figures = clients.block_on(drive(addr, seconds));
        let _ = stop.send(());
        let _ = thread.join();
        for ((class, _), f) in CLASSES.iter().zip(figures.iter_mut()) {
            let asked = f.served + f.shed;
            let shed_share = if asked == 0 {
                0.0
            } else {
                f.shed as f64 / asked as f64 * 100.0
            };
            let (p50, p99) = (f.percentile(0.50), f.percentile(0.99));
            println!(
                "| {name} | {class} | {:.0} | {} ({shed_share:.1} %) | {p50:.1} | {p99:.1} | {} |",
                f.served as f64 / seconds,
                f.shed,
                f.other
            );
        }
    }
}
