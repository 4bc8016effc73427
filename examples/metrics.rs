//! Watching the limiter: Prometheus metrics of every decision, served beside a limited route.
//!
//! ```text
//! cargo run --example metrics
//! for i in 1 2 3 4 5 6 7; do curl -s -o /dev/null -w '%{http_code}\n' http://127.0.0.1:3000/hello; done
//! curl -s http://127.0.0.1:3000/metrics | grep tollgate_requests_total
//! ```
//!
//! * `GET /hello`: 5 requests per minute per client IP.
//! * `GET /metrics` (never limited): every metric in the Prometheus text format, through
//!   `metrics-exporter-prometheus`.
//! * `examples/metrics/grafana-dashboard.json` (import it in Grafana, with a Prometheus data
//!   source that scrapes this server) and `examples/metrics/alerts.yml` (add it to
//!   Prometheus's `rule_files`) go with it.
//!
//! Listens on 127.0.0.1:3000, or on the address in `TOLLGATE_ADDR`. Ctrl-C stops it.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use tollgate::{Quota, RateLimitLayer, Rule};

/// Store latency buckets, in seconds: from 50 µs (the memory store) to 1 s (a store past its
/// time budget).
const LATENCY_BUCKETS: [f64; 12] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 1.0,
];

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The recorder first: the layer records into whatever recorder is installed.
    let prometheus = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("tollgate_store_check_duration_seconds".into()),
            &LATENCY_BUCKETS,
        )?
        .install_recorder()?;
    let upkeep = prometheus.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });

    let limits = RateLimitLayer::builder()
        .rule(Rule::new("per-minute", Quota::per_minute(5)))
        .build()?;
    let app = Router::new()
        .route("/hello", get(|| async { "Hello from behind tollgate!\n" }))
        .route_layer(limits)
        .route(
            "/metrics",
            get(move || {
                let prometheus = prometheus.clone();
                async move { prometheus.render() }
            }),
        );

    let addr = std::env::var("TOLLGATE_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|e| {
        format!("cannot listen on {addr}: {e} (set TOLLGATE_ADDR to another address)")
    })?;
    let addr = listener.local_addr()?;
    println!("tollgate metrics on http://{addr} (Ctrl-C to stop)");
    println!("/hello allows 5 requests per minute per client IP; /metrics is never limited. Try:");
    println!();
    println!(
        "  for i in 1 2 3 4 5 6 7; do curl -s -o /dev/null -w '%{{http_code}}\\n' http://{addr}/hello; done"
    );
    println!("  curl -s http://{addr}/metrics | grep tollgate_");
    println!();
    println!(
        "tollgate_requests_total{{outcome=\"denied\",route=\"/hello\",...}} counts the 429s. \
         Grafana dashboard and Prometheus alerts: examples/metrics/."
    );

    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
        println!("\nshutting down");
    })
    .await?;
    Ok(())
}
