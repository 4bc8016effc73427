//! A budget that holds during a stream: an LLM-style endpoint streams tokens as server-sent
//! events, limited to 10,000 tokens per minute per API key, metered as they are generated.
//!
//! ```text
//! cargo run --example stream
//! curl -N -H 'x-api-key: demo' -H 'content-type: application/json' \
//!      -d '{"max_tokens": 4000}' http://127.0.0.1:3000/v1/completions
//! ```
//!
//! `POST /v1/completions` streams `max_tokens` tokens (default 100), one event per token, with a
//! millisecond's pause every ten tokens. The rule takes 500 tokens from the store when it
//! admits the request and 500 more each time they are spent ([`Rule::meter`]); the producer
//! asks the request's [`Meter`] before each token and stops when the budget is spent; the
//! layer then ends the stream with a final `event: error` carrying the `quota-exceeded`
//! problem document. When the stream ends (or the client leaves), the charge is settled to
//! the tokens generated.
//!
//! Three streams of 4,000 tokens in a row on one key: the first two complete, the third is cut
//! at the budget (about 2,000 tokens in, plus the few hundred that refilled meanwhile, within
//! one chunk of 500). Another key is not affected.
//!
//! Listens on 127.0.0.1:3000, or on the address in `TOLLGATE_ADDR`. Ctrl-C stops it.

use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::response::Response;
use axum::routing::post;
use http::header::{CACHE_CONTROL, CONTENT_TYPE};
use http_body::Frame;
use tokio::sync::mpsc;
use tollgate::key::FromHeader;
use tollgate::{Meter, Quota, RateLimitLayer, Rule, Spend};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let limits = RateLimitLayer::builder()
        .rule(
            Rule::new("tokens", Quota::per_minute(10_000))
                .key(FromHeader::new("x-api-key").hashed())
                // 500 tokens taken from the store at a time as the answer streams.
                .meter(500),
        )
        .build()?;
    let app = Router::new()
        .route("/v1/completions", post(completions))
        .layer(limits);

    let addr = std::env::var("TOLLGATE_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|e| {
        format!("cannot listen on {addr}: {e} (set TOLLGATE_ADDR to another address)")
    })?;
    let url = format!("http://{}/v1/completions", listener.local_addr()?);
    println!(
        "tollgate stream on {url}: 10,000 tokens per minute per x-api-key, metered 500 at a time"
    );
    println!();
    println!(
        "# three streams of 4,000 tokens: the first two complete, the third is cut at the budget"
    );
    println!(
        "for i in 1 2 3; do curl -sN -H 'x-api-key: demo' -H 'content-type: application/json' -d '{{\"max_tokens\": 4000}}' {url} | tail -n 3; done"
    );
    println!("# another key has its own budget");
    println!(
        "curl -N -H 'x-api-key: other' -H 'content-type: application/json' -d '{{\"max_tokens\": 20}}' {url}"
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

/// The model call: streams `max_tokens` tokens, spending each from the meter first.
async fn completions(meter: Option<axum::Extension<Meter>>, body: Bytes) -> Response {
    let max_tokens = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("max_tokens")?.as_u64())
        .unwrap_or(100)
        .min(100_000);
    let meter = meter.map(|axum::Extension(meter)| meter);
    let (events, receiver) = mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        for index in 0..max_tokens {
            // Asked before the token is generated: a spent budget stops the producer here.
            if let Some(meter) = &meter
                && meter.spend(1).await == Spend::Exhausted
            {
                return;
            }
            // Generating: a millisecond every ten tokens (about 10,000 tokens a second).
            if index % 10 == 9 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let event = format!("data: {{\"index\":{index},\"text\":\"tok{index}\"}}\n\n");
            if events.send(Bytes::from(event)).await.is_err() {
                // The client left: the meter settles what was generated.
                return;
            }
        }
        let done = format!("event: done\ndata: {{\"tokens\":{max_tokens}}}\n\n");
        let _ = events.send(Bytes::from(done)).await;
    });
    Response::builder()
        .header(CONTENT_TYPE, "text/event-stream")
        .header(CACHE_CONTROL, "no-cache")
        .body(Body::new(Events { receiver }))
        .expect("a valid response")
}

/// The events the producer sends, as a response body.
struct Events {
    receiver: mpsc::Receiver<Bytes>,
}

impl http_body::Body for Events {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.receiver
            .poll_recv(cx)
            .map(|event| event.map(|bytes| Ok(Frame::data(bytes))))
    }
}
