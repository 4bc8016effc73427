//! A tonic health service limited through a tonic interceptor (no server-wide layer): 10
//! calls per minute per peer IP, in the memory store.
//!
//! ```text
//! cargo run --example grpc_interceptor
//! grpcurl -plaintext 127.0.0.1:50051 grpc.health.v1.Health/Check    # eleven times
//! ```
//!
//! Listens on 127.0.0.1:50051, or on the address in `TOLLGATE_GRPC_ADDR`. The eleventh call in
//! a minute ends with `RESOURCE_EXHAUSTED`, a `google.rpc.RetryInfo` in its details and
//! `grpc-retry-pushback-ms` in its trailers. Ctrl-C stops it.

use tollgate::{Quota, RateLimitLayer, Rule};
use tonic::service::interceptor::InterceptedService;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (_reporter, health) = tonic_health::server::health_reporter();
    // Per peer IP, the layer's default key; the interceptor decides before each call.
    let limits = RateLimitLayer::builder()
        .rule(Rule::new("health", Quota::per_minute(10)))
        .build()?;
    let limited = InterceptedService::new(health, limits.interceptor()?);

    let addr = std::env::var("TOLLGATE_GRPC_ADDR").unwrap_or_else(|_| "127.0.0.1:50051".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|e| {
        format!("cannot listen on {addr}: {e} (set TOLLGATE_GRPC_ADDR to another address)")
    })?;
    let addr = listener.local_addr()?;
    println!(
        "gRPC health service on {addr}, through an interceptor: 10 calls per minute per peer IP"
    );
    println!("(Ctrl-C to stop). Try:");
    println!();
    println!(
        "  for i in $(seq 11); do grpcurl -plaintext {addr} grpc.health.v1.Health/Check; done"
    );
    println!();
    println!(
        "The eleventh call ends with RESOURCE_EXHAUSTED and a RetryInfo; a tollgate client \
         (tollgate::client::HonourLimitsLayer) stops sending until the delay is over."
    );
    tonic::transport::Server::builder()
        .add_service(limited)
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener),
            async {
                let _ = tokio::signal::ctrl_c().await;
            },
        )
        .await?;
    Ok(())
}
