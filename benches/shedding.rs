//! Load shedding under a bounded loopback load that exceeds the server's capacity, with the
//! capacity dropping to half mid-run and coming back: how many requests of each priority class
//! were served and shed, how long the served ones took, and what an adaptive shedder learned,
//! with no shedding, a fixed capacity and an adaptive one, in one run.
//!
//! ```text
//! cargo bench --bench shedding
//! SHED_PHASE_SECONDS=10 cargo bench --bench shedding
//! SHED_WORK_SPREAD_MS=0 cargo bench --bench shedding   # every request exactly 10 ms
//! ```
//!
//! The server (axum, on its own thread) has 16 workers, each taking 10 ms per request on
//! average (a semaphore and a sleep of 8 to 12 ms, `SHED_WORK_SPREAD_MS` = 2): it serves at
//! most 1,600 requests a second, and a request that waits for a worker waits in its handler.
//! Work that always takes the same time makes the workers move in lock-step on the timer's
//! millisecond, so that any request that waits waits a whole request: no backend does that. Each configuration runs three phases of
//! `SHED_PHASE_SECONDS` (default 6): 16 workers, then 8 (800 a second: half the permits are
//! taken away), then 16 again. The clients, on loopback only, keep 64 `low`, 32 `normal` and 4
//! `critical` requests in flight (closed loops, one connection each, a shed client trying again
//! after 20 ms). The backend's capacity is well below what the load generator and the server
//! can carry on this machine (about 2,900 requests a second with 4 ms workers), so that
//! goodput measures the shedding, not the machine.
//!
//! - **uncongested**: 8 `normal` clients and no shedding, 16 workers: the latency of a server
//!   below its capacity, the reference for the others' p99;
//! - **no shedding**: the same layer with its rate rule only (every request admitted);
//! - **fixed**: `Shedding::new(32)` (low up to 16 in flight, normal up to 25, critical all 32);
//! - **adaptive**: `Shedding::new(64).adaptive(Adaptive::new())`, its capacity sampled every
//!   250 ms, and the same with a tolerance of 10 % instead of 25 % (less queue, less margin).
//!
//! Priority comes from the `x-priority` header (a bench: never do this in production).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tollgate::key::Global;
use tollgate::{Adaptive, Priority, Quota, RateLimitLayer, Rule, Shedding};

const WORKERS: usize = 16;
/// A request's work: 10 ms on average, each within `SHED_WORK_SPREAD_MS` of it.
const WORK: Duration = Duration::from_millis(10);
/// How long a shed client waits before it tries again.
const BACK_OFF: Duration = Duration::from_millis(20);
const CLASSES: [(&str, usize); 3] = [("low", 64), ("normal", 32), ("critical", 4)];
/// Workers in each phase.
const PHASES: [usize; 3] = [WORKERS, WORKERS / 2, WORKERS];

/// The backend's workers, some of which can be taken away.
#[derive(Clone)]
struct Backend {
    workers: Arc<Semaphore>,
    taken: Arc<Mutex<Option<OwnedSemaphorePermit>>>,
}

impl Backend {
    fn new() -> Self {
        Backend {
            workers: Arc::new(Semaphore::new(WORKERS)),
            taken: Arc::new(Mutex::new(None)),
        }
    }

    /// Leaves `workers` of them working.
    async fn set(&self, workers: usize) {
        let previous = self.taken.lock().unwrap().take();
        drop(previous);
        if workers < WORKERS {
            let permits = u32::try_from(WORKERS - workers).unwrap();
            let taken = self
                .workers
                .clone()
                .acquire_many_owned(permits)
                .await
                .unwrap();
            *self.taken.lock().unwrap() = Some(taken);
        }
    }
}

/// The work of the `n`th request: `WORK` ± `spread_ms`, spread evenly (splitmix64 of `n`).
fn work(n: u64, spread_ms: u64) -> Duration {
    let mut z = n.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    let spread = z % (2 * spread_ms + 1);
    WORK + Duration::from_millis(spread) - Duration::from_millis(spread_ms)
}

fn app(shedding: Option<Shedding>, backend: &Backend, spread_ms: u64) -> Router {
    let workers = backend.workers.clone();
    let requests = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut limits = RateLimitLayer::builder()
        .rule(Rule::new("api", Quota::per_second(1_000_000).burst(1_000_000_000)).key(Global));
    if let Some(shedding) = shedding {
        limits = limits.shed(shedding.priority(|parts: &http::request::Parts| {
            match parts.headers.get("x-priority").map(|v| v.as_bytes()) {
                Some(b"critical") => Priority::Critical,
                Some(b"low") => Priority::Low,
                _ => Priority::Normal,
            }
        }));
    }
    Router::new()
        .route(
            "/",
            get(move || {
                let workers = workers.clone();
                let n = requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                async move {
                    let _worker = workers.acquire().await.expect("open");
                    tokio::time::sleep(work(n, spread_ms)).await;
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

/// What one class saw in one phase.
#[derive(Default, Clone)]
struct Figures {
    served: u64,
    shed: u64,
    other: u64,
    /// Latencies of served requests, in µs.
    latencies: Vec<u64>,
    /// Those of the requests sent after the phase's first second: the level it settled at,
    /// without the change that began it.
    settled: Vec<u64>,
}

impl Figures {
    fn add(&mut self, other: &Figures) {
        self.served += other.served;
        self.shed += other.shed;
        self.other += other.other;
        self.latencies.extend_from_slice(&other.latencies);
        self.settled.extend_from_slice(&other.settled);
    }

    fn percentile(&mut self, p: f64) -> f64 {
        percentile(&mut self.latencies, p)
    }

    fn settled_percentile(&mut self, p: f64) -> f64 {
        percentile(&mut self.settled, p)
    }
}

/// The `p` quantile of `latencies` (µs), in ms.
fn percentile(latencies: &mut [u64], p: f64) -> f64 {
    if latencies.is_empty() {
        return f64::NAN;
    }
    latencies.sort_unstable();
    let i = ((latencies.len() as f64 * p).ceil() as usize).clamp(1, latencies.len());
    latencies[i - 1] as f64 / 1000.0
}

/// Runs `classes` of clients against `addr` through the phases, moving the backend's workers
/// at each phase's start: the figures of each class in each phase (`[phase][class]`).
async fn drive(
    addr: SocketAddr,
    classes: &[(&'static str, usize)],
    phases: &[usize],
    phase: Duration,
    backend: &Backend,
) -> Vec<Vec<Figures>> {
    let start = Instant::now();
    let end = start + phase * u32::try_from(phases.len()).unwrap();
    let mut tasks = Vec::new();
    for (c, &(class, loops)) in classes.iter().enumerate() {
        for _ in 0..loops {
            let phases = phases.len();
            tasks.push((
                c,
                tokio::spawn(async move {
                    let client = Client::builder(hyper_util::rt::TokioExecutor::new())
                        .pool_max_idle_per_host(1)
                        .build_http::<Empty<Bytes>>();
                    let mut figures = vec![Figures::default(); phases];
                    while Instant::now() < end {
                        let request = http::Request::get(format!("http://{addr}/"))
                            .header("x-priority", class)
                            .body(Empty::new())
                            .expect("request");
                        let sent = Instant::now();
                        let into = (sent - start).as_secs_f64() / phase.as_secs_f64();
                        let at = (into as usize).min(phases - 1);
                        let settled = (into - at as f64) * phase.as_secs_f64() >= 1.0;
                        let f = &mut figures[at];
                        let Ok(response) = client.request(request).await else {
                            f.other += 1;
                            continue;
                        };
                        let status = response.status();
                        let _ = response.into_body().collect().await;
                        match status.as_u16() {
                            200 => {
                                f.served += 1;
                                let latency = sent.elapsed().as_micros() as u64;
                                f.latencies.push(latency);
                                if settled {
                                    f.settled.push(latency);
                                }
                            }
                            503 => {
                                f.shed += 1;
                                tokio::time::sleep(BACK_OFF).await;
                            }
                            _ => f.other += 1,
                        }
                    }
                    figures
                }),
            ));
        }
    }
    for (i, &workers) in phases.iter().enumerate() {
        let at = start + phase * u32::try_from(i).unwrap();
        tokio::time::sleep_until(at.into()).await;
        backend.set(workers).await;
    }
    let mut out = vec![vec![Figures::default(); classes.len()]; phases.len()];
    for (c, task) in tasks {
        for (p, figures) in task.await.expect("client").iter().enumerate() {
            out[p][c].add(figures);
        }
    }
    backend.set(WORKERS).await;
    out
}

/// Samples `shedding`'s capacity every 250 ms until `until`: (seconds since start, capacity).
async fn sample(shedding: Shedding, until: Instant) -> Vec<(f64, usize)> {
    let start = Instant::now();
    let mut samples = Vec::new();
    while Instant::now() < until {
        samples.push((start.elapsed().as_secs_f64(), shedding.capacity_now()));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    samples
}

/// For each phase after the first: the seconds after its start until the capacity came within
/// 25 % of the level it holds in the second half of the phase (its median there), and stayed.
fn follow_times(samples: &[(f64, usize)], phase: f64, phases: usize) -> Vec<(usize, f64)> {
    (1..phases)
        .map(|p| {
            let (from, to) = (phase * p as f64, phase * (p + 1) as f64);
            let mut late: Vec<usize> = samples
                .iter()
                .filter(|(t, _)| *t >= (from + to) / 2.0 && *t < to)
                .map(|s| s.1)
                .collect();
            late.sort_unstable();
            let level = late.get(late.len() / 2).copied().unwrap_or(0);
            let band = |c: usize| (c as f64 - level as f64).abs() <= 0.25 * level as f64;
            let within: Vec<&(f64, usize)> = samples
                .iter()
                .filter(|(t, _)| *t >= from && *t < to)
                .collect();
            let settled = within
                .iter()
                .rposition(|(_, c)| !band(*c))
                .map_or(0.0, |i| {
                    within.get(i + 1).map_or(to - from, |(t, _)| t - from)
                });
            (level, settled)
        })
        .collect()
}

fn main() {
    let phase_seconds: f64 = std::env::var("SHED_PHASE_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(6.0);
    let phase = Duration::from_secs_f64(phase_seconds);
    let spread_ms: u64 = std::env::var("SHED_WORK_SPREAD_MS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2)
        .min(WORK.as_millis() as u64 - 1);
    let clients = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "capacity: {WORKERS} workers × {} ms per request (± {spread_ms} ms) = {} requests/s, then \
         {} workers, then {WORKERS}; clients in flight: low 64, normal 32, critical 4, a shed one back after {} \
         ms; {phase_seconds} s per phase",
        WORK.as_millis(),
        WORKERS as u128 * 1000 / WORK.as_millis(),
        WORKERS / 2,
        BACK_OFF.as_millis(),
    );

    // The reference: a server below its capacity.
    let backend = Backend::new();
    let (addr, stop, thread) = serve(app(None, &backend, spread_ms));
    let mut reference =
        clients.block_on(drive(addr, &[("normal", 8)], &[WORKERS], phase, &backend));
    let _ = stop.send(());
    let _ = thread.join();
    let uncongested = &mut reference[0][0];
    let (ref_p50, ref_p99) = (uncongested.percentile(0.5), uncongested.percentile(0.99));
    println!(
        "uncongested (8 normal clients, {WORKERS} workers, no shedding): {:.0} served/s, p50 \
         {ref_p50:.1} ms, p99 {ref_p99:.1} ms",
        uncongested.served as f64 / phase_seconds
    );
    println!();
    println!(
        "| configuration | workers | class | served/s | shed | p50 served (ms) | p99 served (ms) | p99 / uncongested | errors |"
    );
    println!("|---|---:|---|---:|---:|---:|---:|---:|---:|");
    let configurations: [(&str, Option<Shedding>); 4] = [
        ("no shedding", None),
        ("`Shedding::new(32)`", Some(Shedding::new(2 * WORKERS))),
        (
            "`Shedding::new(64).adaptive(..)`",
            Some(Shedding::new(4 * WORKERS).adaptive(Adaptive::new())),
        ),
        (
            "`.adaptive(Adaptive::new().tolerance(10))`",
            Some(Shedding::new(4 * WORKERS).adaptive(Adaptive::new().tolerance(10))),
        ),
    ];
    let mut summary = Vec::new();
    for (name, shedding) in configurations {
        let backend = Backend::new();
        let (addr, stop, thread) = serve(app(shedding.clone(), &backend, spread_ms));
        let sampler = shedding.clone().map(|s| {
            let until = Instant::now() + phase * 3;
            clients.spawn(sample(s, until))
        });
        let mut figures = clients.block_on(drive(addr, &CLASSES, &PHASES, phase, &backend));
        let samples = sampler.map(|task| clients.block_on(task).expect("sampler"));
        let _ = stop.send(());
        let _ = thread.join();
        let mut critical_shed = 0;
        let mut goodput = Vec::new();
        for (p, classes) in figures.iter_mut().enumerate() {
            let workers = PHASES[p];
            let mut served = 0;
            for ((class, _), f) in CLASSES.iter().zip(classes.iter_mut()) {
                let asked = f.served + f.shed;
                let shed_share = if asked == 0 {
                    0.0
                } else {
                    f.shed as f64 / asked as f64 * 100.0
                };
                let (p50, p99) = (f.percentile(0.50), f.percentile(0.99));
                println!(
                    "| {name} | {workers} | {class} | {:.0} | {} ({shed_share:.1} %) | {p50:.1} | {p99:.1} | {:.2}× | {} |",
                    f.served as f64 / phase_seconds,
                    f.shed,
                    p99 / ref_p99,
                    f.other
                );
                served += f.served;
                if *class == "critical" {
                    critical_shed += f.shed;
                }
            }
            let capacity = workers as f64 * 1000.0 / WORK.as_millis() as f64;
            goodput.push(served as f64 / phase_seconds / capacity * 100.0);
            // Every class's served requests of the phase together.
            let mut all = Figures::default();
            for f in classes.iter() {
                all.add(f);
            }
            let p99 = all.percentile(0.99);
            goodput.push(p99 / ref_p99);
            goodput.push(all.settled_percentile(0.99) / ref_p99);
        }
        summary.push((name, goodput, critical_shed, samples));
    }
    // The backend's capacity as measured: what no shedding served in each phase, every worker
    // busy all the time (sleeps round up to the timer's millisecond, so a worker takes a little
    // more than its 10 ms).
    let measured: Vec<f64> = summary[0].1.iter().step_by(3).copied().collect();
    println!();
    println!(
        "| configuration | goodput per phase, % of the nominal capacity (16 / 8 / 16 workers) | % of the measured capacity (what no shedding served) | p99 of all served / uncongested, per phase | the same after each phase's first second | critical shed |"
    );
    println!("|---|---|---|---|---|---:|");
    for (name, figures, critical_shed, _) in &summary {
        let goodput: Vec<String> = figures
            .iter()
            .step_by(3)
            .map(|g| format!("{g:.1} %"))
            .collect();
        let of_measured: Vec<String> = figures
            .iter()
            .step_by(3)
            .zip(&measured)
            .map(|(g, m)| format!("{:.1} %", g / m * 100.0))
            .collect();
        // Each phase's three figures: goodput, p99 ratio, settled p99 ratio.
        let ratios = |at: usize| {
            figures
                .iter()
                .skip(at)
                .step_by(3)
                .map(|r| format!("{r:.2}×"))
                .collect::<Vec<String>>()
                .join(" / ")
        };
        println!(
            "| {name} | {} | {} | {} | {} | {critical_shed} |",
            goodput.join(" / "),
            of_measured.join(" / "),
            ratios(1),
            ratios(2)
        );
    }
    for (name, _, _, samples) in &summary {
        let Some(samples) = samples else { continue };
        if !name.contains("adaptive") && !name.contains("tolerance") {
            continue;
        }
        println!();
        println!("{name}, capacity every 250 ms:");
        let line: Vec<String> = samples
            .iter()
            .map(|(t, c)| format!("{t:.2}s={c}"))
            .collect();
        println!("{}", line.join(" "));
        for (i, (level, settled)) in follow_times(samples, phase_seconds, PHASES.len())
            .iter()
            .enumerate()
        {
            println!(
                "after the change to {} workers: settled at {level} in flight, within 25 % of it \
                 {settled:.2} s after the change",
                PHASES[i + 1]
            );
        }
    }
}
