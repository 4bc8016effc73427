//! The quickstart on Redis: every replica of this service shares the same budgets.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example redis
//! curl -i http://127.0.0.1:3000/
//! ```

use std::net::SocketAddr;

use axum::Router;
use axum::routing::get;
use tollgate::store::RedisStore;
use tollgate::{Algorithm, Quota, RateLimitLayer, Rule};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    // Connects in the background: the service starts even while Redis is down (each rule's
    // FailureMode decides until it answers). `RedisStore::connect(url).await?` would wait.
    let store = RedisStore::builder(url.as_str()).build()?;

    // Per client IP: bursts of 10 refilled at 5 per second, and 1000 per hour, checked together
    // in one atomic step on Redis.
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("burst", Quota::per_second(5).burst(10)))
        .rule(Rule::new("hourly", Quota::per_hour(1000)).algorithm(Algorithm::SlidingWindowCounter))
        .store(store)
        .build()?;

    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(layer);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
