//! Why a shared store: K replicas behind a round-robin load balancer, each with its own
//! `RateLimitLayer` and its own store handle, and one client sending 3 × the limit.
//!
//! ```text
//! cargo run --example replicas            # Redis at REDIS_URL, default redis://127.0.0.1:6379
//! store=memory replicas=3 limit=100 sent=300 admitted=300
//! store=redis replicas=3 limit=100 sent=300 admitted=100
//! store=redis-lease replicas=3 limit=100 lease=10 sent=300 admitted=100
//! ```
//!
//! With in-process memory stores every replica admits the limit: the fleet lets the client
//! through K times. With Redis the replicas share one budget. With a lease of 10
//! (`Rule::lease(10)`), each replica takes 10 units from Redis at a time and spends them itself:
//! the same 100 are admitted (the 300 requests spend every leased unit), with about a tenth of
//! the calls to Redis. The limit is 100 per hour, so that nothing refills during the run. When
//! Redis cannot be reached the example says so and exits with status 1 after the memory line.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use http_body_util::Empty;
use hyper::StatusCode;
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tollgate::store::{ConnectError, MemoryStore, RedisStore, Store};
use tollgate::{Quota, RateLimitLayer, Rule};

const REPLICAS: usize = 3;
const LIMIT: u64 = 100;
const LEASE: u64 = 10;

/// Starts one replica on a free loopback port: a hello-world app behind its own layer.
async fn replica<S: Store + Clone>(
    store: S,
    rule: Rule,
) -> Result<SocketAddr, Box<dyn std::error::Error>> {
    let layer = RateLimitLayer::builder().rule(rule).store(store).build()?;
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    tokio::spawn(async move {
        let service = app.into_make_service_with_connect_info::<SocketAddr>();
        let _ = axum::serve(listener, service).await;
    });
    Ok(address)
}

/// Sends 3 × LIMIT requests round-robin over the replicas; counts the admitted ones.
async fn run(replicas: &[SocketAddr]) -> Result<u64, Box<dyn std::error::Error>> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let mut admitted = 0;
    for i in 0..3 * LIMIT {
        let address = replicas[i as usize % replicas.len()];
        let response = client.get(format!("http://{address}/").parse()?).await?;
        match response.status() {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => return Err(format!("replica {address} answered {other}").into()),
        }
    }
    Ok(admitted)
}

fn summary(store: &str, lease: Option<u64>, admitted: u64) {
    let lease = lease.map(|n| format!(" lease={n}")).unwrap_or_default();
    println!(
        "store={store} replicas={REPLICAS} limit={LIMIT}{lease} sent={} admitted={admitted}",
        3 * LIMIT
    );
}

fn rule() -> Rule {
    Rule::new("replicas", Quota::per_hour(LIMIT))
}

#[tokio::main]
async fn main() -> ExitCode {
    match fleet().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn fleet() -> Result<(), Box<dyn std::error::Error>> {
    let mut replicas = Vec::new();
    for _ in 0..REPLICAS {
        replicas.push(replica(MemoryStore::new(), rule()).await?);
    }
    summary("memory", None, run(&replicas).await?);

    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    // A prefix of its own per run: earlier runs' budgets (100 per hour) do not count.
    let prefix = format!(
        "tollgate-replicas-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis()
    );
    for (store, lease) in [("redis", None), ("redis-lease", Some(LEASE))] {
        let mut replicas = Vec::new();
        for _ in 0..REPLICAS {
            let redis = RedisStore::builder(url.as_str())
                .prefix(format!("{prefix}-{store}"))
                .connect()
                .await
                .map_err(|e| match e {
                    // A configuration error is said as such, not as a Redis that cannot be reached.
                    ConnectError::Config(e) => format!("REDIS_URL={url}: {e}"),
                    e => format!("cannot reach Redis at {url} (set REDIS_URL): {e}"),
                })?;
            // Leased units live 10 s here, far longer than the run: every one is spent.
            let rule = match lease {
                Some(units) => rule().lease(units).lease_ttl(Duration::from_secs(10)),
                None => rule(),
            };
            replicas.push(replica(redis, rule).await?);
        }
        summary(store, lease, run(&replicas).await?);
    }
    Ok(())
}
