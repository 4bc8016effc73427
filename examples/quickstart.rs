//! The smallest useful setup: axum, 5 requests per minute per client IP, in-process memory store.
//!
//! ```text
//! cargo run --example quickstart
//! for i in 1 2 3 4 5 6; do curl -i http://127.0.0.1:3000/hello; done
//! ```
//!
//! Listens on 127.0.0.1:3000, or on the address in `TOLLGATE_ADDR`. Ctrl-C stops it.

use std::net::SocketAddr;

use axum::Router;
use axum::routing::get;
use tollgate::{Quota, RateLimitLayer, Rule};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let limits = RateLimitLayer::builder()
        .rule(Rule::new("per-minute", Quota::per_minute(5)))
        .build()?;

    let app = Router::new()
        .route(
            "/hello",
            get(|| async { "Hello from behind tollgate!\n" }).route_layer(limits),
        )
        .route(
            "/",
            get(|| async { "Not limited. Try /hello a few times.\n" }),
        );

    let addr = std::env::var("TOLLGATE_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|e| {
        format!("cannot listen on {addr}: {e} (set TOLLGATE_ADDR to another address)")
    })?;
    let addr = listener.local_addr()?;
    println!("tollgate quickstart on http://{addr} (Ctrl-C to stop)");
    println!("/hello allows 5 requests per minute per client IP; try:");
    println!();
    println!("  curl -i http://{addr}/hello");
    println!(
        "  for i in 1 2 3 4 5 6; do curl -s -o /dev/null -w '%{{http_code}}\\n' http://{addr}/hello; done"
    );
    println!();
    println!("The sixth answer is 429 with Retry-After and a problem+json body.");

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
