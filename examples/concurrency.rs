//! A concurrency limit: `GET /slow` takes a second and allows 5 requests at once per client IP;
//! `GET /` is not limited. A request holds its slot until its response body has been sent.
//!
//! ```text
//! cargo run --example concurrency
//! seq 20 | xargs -P 20 -I{} curl -s -o /dev/null -w '%{http_code}\n' http://127.0.0.1:3000/slow | sort | uniq -c
//! ```
//!
//! Twenty at once: five 200s and fifteen 429s, whose `RateLimit-Policy` says
//! `"slow";q=5;qu="concurrent-requests"`. Listens on 127.0.0.1:3000, or on the address in
//! `TOLLGATE_ADDR`. Ctrl-C stops it.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use tollgate::{RateLimitLayer, Rule};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // 5 requests in flight per client IP (the layer's default key); a slot a replica never gave
    // back (it died) is free after the longest hold, 60 s unless `.max_hold(..)` says otherwise.
    let at_most_five = RateLimitLayer::builder()
        .rule(Rule::concurrent("slow", 5))
        .build()?;

    let app = Router::new()
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(1)).await;
                "Done, after a second of hard work.\n"
            })
            .route_layer(at_most_five),
        )
        .route(
            "/",
            get(|| async { "Not limited. Try /slow twenty times at once.\n" }),
        );

    let addr = std::env::var("TOLLGATE_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|e| {
        format!("cannot listen on {addr}: {e} (set TOLLGATE_ADDR to another address)")
    })?;
    let addr = listener.local_addr()?;
    println!("tollgate concurrency example on http://{addr} (Ctrl-C to stop)");
    println!("/slow takes 1 s and allows 5 requests at once per client IP; / is not limited. Try:");
    println!();
    println!("  curl -i http://{addr}/slow");
    println!(
        "  seq 20 | xargs -P 20 -I{{}} curl -s -o /dev/null -w '%{{http_code}}\\n' http://{addr}/slow | sort | uniq -c"
    );
    println!();
    println!(
        "Twenty at once give five 200s and fifteen 429s with Retry-After: 1 and \
         RateLimit-Policy: \"slow\";q=5;qu=\"concurrent-requests\"."
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
