//! Costs known after the response: an LLM-style endpoint limited to 10,000 tokens per minute per
//! API key, each request reserving an estimate of 500 and settled at what it used.
//!
//! ```text
//! cargo run --example tokens
//! curl -i -H 'x-api-key: demo' -H 'content-type: application/json' \
//!      -d '{"max_tokens": 4000}' http://127.0.0.1:3000/complete
//! ```
//!
//! `POST /complete` stands in for a model call: it "uses" the `max_tokens` of its JSON body and
//! says so in the response header `x-tokens-used`, which the layer reads (and removes) to settle
//! the request's charge: the 500 it reserved become what was used, in one store call. Three
//! requests of 4,000 are admitted (the third takes the budget into debt: 12,000 used of 10,000);
//! the fourth waits for the debt and its own estimate, about 15 s at 10,000 tokens per minute.
//!
//! Listens on 127.0.0.1:3000, or on the address in `TOLLGATE_ADDR`. Ctrl-C stops it.

use std::net::SocketAddr;

use axum::Router;
use axum::body::Bytes;
use axum::routing::post;
use http::{HeaderName, StatusCode};
use tollgate::key::FromHeader;
use tollgate::{Quota, RateLimitLayer, Rule};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let limits = RateLimitLayer::builder()
        .rule(
            Rule::new("tokens", Quota::per_minute(10_000))
                .key(FromHeader::new("x-api-key").hashed())
                // Reserved when a request is admitted...
                .cost(500)
                // ...and settled at what it used, once the response says.
                .settle_from_header(HeaderName::from_static("x-tokens-used")),
        )
        .build()?;
    let app = Router::new()
        .route("/complete", post(complete))
        .layer(limits);

    let addr = std::env::var("TOLLGATE_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|e| {
        format!("cannot listen on {addr}: {e} (set TOLLGATE_ADDR to another address)")
    })?;
    let url = format!("http://{}/complete", listener.local_addr()?);
    println!("tollgate tokens on {url}: 10,000 tokens per minute per x-api-key, 500 reserved");
    println!();
    println!("# four requests of 4,000 tokens: 200, 200, 200 (into debt), then 429");
    println!(
        "for i in 1 2 3 4; do curl -s -o /dev/null -w '%{{http_code}} ' -H 'x-api-key: demo' -H 'content-type: application/json' -d '{{\"max_tokens\": 4000}}' {url}; done; echo"
    );
    println!("# the 429 says how long the debt and the next estimate take to refill (about 15 s)");
    println!(
        "curl -i -H 'x-api-key: demo' -H 'content-type: application/json' -d '{{\"max_tokens\": 10}}' {url}"
    );
    println!("# another key has its own budget");
    println!(
        "curl -i -H 'x-api-key: other' -H 'content-type: application/json' -d '{{\"max_tokens\": 100}}' {url}"
    );
    println!();
    println!("Ctrl-C to stop.");

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

/// The model call: it uses the request's `max_tokens` (default 100), and says how many.
async fn complete(body: Bytes) -> (StatusCode, [(&'static str, String); 1], String) {
    let max_tokens = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("max_tokens")?.as_u64())
        .unwrap_or(100);
    (
        StatusCode::OK,
        [("x-tokens-used", max_tokens.to_string())],
        format!("(a completion of {max_tokens} tokens)\n"),
    )
}
