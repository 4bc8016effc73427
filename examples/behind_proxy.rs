//! Rate limiting by client IP behind a reverse proxy.
//!
//! ```text
//! cargo run --example behind_proxy
//! TOLLGATE_ADDR=127.0.0.1:8080 cargo run --example behind_proxy
//! ```
//!
//! The server trusts 127.0.0.0/8 as its proxy, so `curl` on this machine plays the proxy: the
//! `X-Forwarded-For` it sends is believed, but only its rightmost untrusted entry. Each client
//! gets 5 requests per minute.

use std::net::SocketAddr;

use axum::Router;
use axum::extract::Request;
use axum::routing::get;
use tollgate::key::ClientIp;
use tollgate::{Quota, RateLimitLayer, Rule};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr: SocketAddr = std::env::var("TOLLGATE_ADDR")
        .unwrap_or_else(|_| "127.0.0.1:3000".to_owned())
        .parse()?;

    // Forwarding headers are read only from these peers; everyone else is keyed by socket
    // address, whatever headers they send.
    let client_ip = ClientIp::new().parse_trusted_proxies(["127.0.0.0/8"])?;
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("per-client", Quota::per_minute(5)).key(client_ip.clone()))
        .build()?;

    let app = Router::new()
        .route(
            "/",
            get(move |request: Request| {
                let (parts, _) = request.into_parts();
                let client = client_ip
                    .client_addr(&parts)
                    .map_or_else(|| "unknown".to_owned(), |ip| ip.to_string());
                async move { format!("hello; you are counted as {client}\n") }
            }),
        )
        .layer(layer);

    let listener = tokio::net::TcpListener::bind(addr).await?;
    let url = format!("http://{}/", listener.local_addr()?);
    println!(
        "listening on {url} (trusting 127.0.0.0/8 as the proxy; 5 requests per minute per client)"
    );
    println!();
    println!("# no header: the peer itself (127.0.0.1) is the client");
    println!("curl -i {url}");
    println!("# the proxy says the client is 203.0.113.7");
    println!("curl -i -H 'X-Forwarded-For: 203.0.113.7' {url}");
    println!("# a client-invented entry on the left changes nothing: still 203.0.113.7");
    println!("curl -i -H 'X-Forwarded-For: 6.6.6.6, 203.0.113.7' {url}");
    println!("# six requests as 198.51.100.1: five 200s, then 429 with Retry-After");
    println!(
        "for i in 1 2 3 4 5 6; do curl -s -o /dev/null -w '%{{http_code}}\\n' -H 'X-Forwarded-For: 198.51.100.1' {url}; done"
    );
    println!();
    println!("Ctrl-C to stop.");

    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
        println!("shutting down");
    })
    .await?;
    Ok(())
}
