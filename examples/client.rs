//! A client that honours the limit: it calls a limited server in a loop, as fast as it can,
//! and the layer paces the calls to the budget the server announces (`RateLimit`,
//! `RateLimit-Policy`) and waits out any delay it asks for, instead of hammering it.
//!
//! ```text
//! cargo run --example client                  # against a server of its own: 3 per 3 s
//! cargo run --example quickstart &            # or against another server:
//! TOLLGATE_URL=http://127.0.0.1:3000/hello cargo run --example client
//! ```
//!
//! `TOLLGATE_CALLS` sets how many calls (default 12). Only loopback servers make sense here: it
//! stops by itself after its calls.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use tollgate::client::{ClientError, Pacing, Retry, RetryAfterLayer};
use tollgate::key::Global;
use tollgate::{Quota, RateLimitLayer, Rule};
use tower::{Layer, Service, ServiceExt};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let calls: usize = std::env::var("TOLLGATE_CALLS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(12);
    let served = Arc::new(AtomicUsize::new(0));
    let denied = Arc::new(AtomicUsize::new(0));
    let url = match std::env::var("TOLLGATE_URL") {
        Ok(url) => url,
        Err(_) => {
            let addr = serve(served.clone(), denied.clone()).await?;
            println!("a server of its own on http://{addr}/ allows 3 requests per 3 s");
            format!("http://{addr}/")
        }
    };
    println!("{calls} calls to {url}, one after the other, as fast as the layer lets them go:");
    println!();

    // Paces the calls to the budget the server announces, and waits what it says (Retry-After,
    // a spent RateLimit policy), plus jitter.
    let retry = Retry::new()
        .max_wait(Duration::from_secs(70))
        .pace(Pacing::new());
    let mut client = RetryAfterLayer::new(retry)
        .layer(Client::builder(hyper_util::rt::TokioExecutor::new()).build_http::<Empty<Bytes>>());
    let start = Instant::now();
    let mut refused = 0;
    for n in 1..=calls {
        let request = http::Request::get(&url).body(Empty::new())?;
        let sent = Instant::now();
        match client.ready().await?.call(request).await {
            Ok(response) => {
                let status = response.status();
                if status == http::StatusCode::TOO_MANY_REQUESTS {
                    refused += 1;
                }
                let budget = response
                    .headers()
                    .get("ratelimit")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("-")
                    .to_owned();
                response.into_body().collect().await?;
                println!(
                    "call {n:>2} at {:>6.2} s: {status}, after {:>5} ms (RateLimit: {budget})",
                    start.elapsed().as_secs_f64(),
                    sent.elapsed().as_millis()
                );
            }
            Err(ClientError::Throttled(throttled)) => println!(
                "call {n:>2}: not sent, the server asked to wait {} ms more",
                throttled.wait().as_millis()
            ),
            Err(ClientError::Inner(error)) => return Err(error.into()),
        }
    }
    println!();
    println!("the client received {refused} 429s");
    if std::env::var("TOLLGATE_URL").is_err() {
        println!(
            "the server served {} and denied {} in {:.1} s",
            served.load(Ordering::SeqCst),
            denied.load(Ordering::SeqCst),
            start.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// A server on a free loopback port: 3 requests per 3 s for everyone, counting what it served
/// and what it denied.
async fn serve(served: Arc<AtomicUsize>, denied: Arc<AtomicUsize>) -> std::io::Result<SocketAddr> {
    let limits = RateLimitLayer::builder()
        .rule(Rule::new("three", Quota::new(3, Duration::from_secs(3))).key(Global))
        .build()
        .map_err(std::io::Error::other)?;
    let app = Router::new()
        .route(
            "/",
            get(move || {
                served.fetch_add(1, Ordering::SeqCst);
                async { "served\n" }
            }),
        )
        .layer(limits)
        .layer(axum::middleware::map_response(
            move |response: axum::response::Response| {
                if response.status() == http::StatusCode::TOO_MANY_REQUESTS {
                    denied.fetch_add(1, Ordering::SeqCst);
                }
                async { response }
            },
        ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await;
    });
    Ok(addr)
}
