//! The README's sample answers are the layer's real answers: its quick start (5 per minute,
//! rule "per-minute") is run and every header and body line the README shows is compared.

use std::net::SocketAddr;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::Request;
use http_body_util::BodyExt;
use tollgate::clock::ManualClock;
use tollgate::store::MemoryStore;
use tollgate::{Quota, RateLimitLayer, Rule};
use tower::ServiceExt;

/// A sample answer of the README: status line, headers, body.
struct Sample {
    status: String,
    headers: Vec<(String, String)>,
    body: String,
}

/// Every `text` block of the README that shows an HTTP answer.
fn samples() -> Vec<Sample> {
    let readme = include_str!("../README.md");
    let mut samples = Vec::new();
    for block in readme.split("```text\n").skip(1) {
        let block = &block[..block.find("```").expect("a closed block")];
        let Some(rest) = block.strip_prefix("HTTP/1.1 ") else {
            continue;
        };
        let (head, body) = rest.split_once("\n\n").unwrap_or((rest, ""));
        let mut lines = head.lines();
        let status = lines.next().unwrap().to_owned();
        let headers = lines
            .map(|line| {
                let (name, value) = line.split_once(": ").expect("name: value");
                (name.to_owned(), value.to_owned())
            })
            .collect();
        samples.push(Sample {
            status,
            headers,
            body: body.trim().to_owned(),
        });
    }
    samples
}

async fn send(app: &Router) -> http::Response<Body> {
    let mut request = Request::get("/hello").body(Body::empty()).unwrap();
    request
        .extensions_mut()
        .insert(ConnectInfo(SocketAddr::from(([127, 0, 0, 1], 50_000))));
    app.clone().oneshot(request).await.unwrap()
}

async fn compare(app: &Router, sample: &Sample) {
    let response = send(app).await;
    let status = response.status();
    assert_eq!(
        format!("{} {}", status.as_u16(), status.canonical_reason().unwrap()),
        sample.status
    );
    for (name, value) in &sample.headers {
        assert_eq!(
            response
                .headers()
                .get(name.as_str())
                .map(|v| v.to_str().unwrap()),
            Some(value.as_str()),
            "README header {name}"
        );
    }
    let body = response.into_body().collect().await.unwrap().to_bytes();
    if !sample.body.is_empty() {
        assert_eq!(String::from_utf8_lossy(&body), sample.body, "README body");
    }
}

#[tokio::test]
async fn the_quick_start_samples_are_what_the_layer_answers() {
    let example = include_str!("../examples/quickstart.rs");
    assert!(
        example.contains(r#"Rule::new("per-minute", Quota::per_minute(5))"#),
        "the README samples describe the quickstart example's rule"
    );
    let samples = samples();
    assert_eq!(
        samples.len(),
        2,
        "the README shows an admitted and a denied answer"
    );

    let store = MemoryStore::builder()
        .clock(ManualClock::default())
        .build()
        .unwrap();
    let limits = RateLimitLayer::builder()
        .rule(Rule::new("per-minute", Quota::per_minute(5)))
        .store(store)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/hello", get(|| async { "Hello from behind tollgate!\n" }))
        .layer(limits);

    compare(&app, &samples[0]).await; // the first request
    for _ in 2..=5 {
        assert!(send(&app).await.status().is_success());
    }
    compare(&app, &samples[1]).await; // the sixth
}
