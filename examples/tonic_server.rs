//! The same layer in front of a tonic gRPC server (here the standard health service).
//!
//! ```text
//! cargo run --example tonic_server --features tonic
//! ```
//!
//! Listens on 127.0.0.1:50051, or on the address in `TOLLGATE_GRPC_ADDR`. Each client IP may call
//! 10 times per minute.

use tollgate::{Quota, RateLimitLayer, Rule};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (_reporter, health) = tonic_health::server::health_reporter();
    let limits = RateLimitLayer::builder()
        .rule(Rule::new("grpc", Quota::per_minute(10)))
        .build()?;

    let addr = std::env::var("TOLLGATE_GRPC_ADDR").unwrap_or_else(|_| "127.0.0.1:50051".to_owned());
    let addr = addr.parse()?;
    println!("gRPC health service on {addr}, 10 calls per minute per client IP (Ctrl-C to stop)");
    tonic::transport::Server::builder()
        .layer(limits)
        .add_service(health)
        .serve_with_shutdown(addr, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
