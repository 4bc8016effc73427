//! What metering a stream costs per frame on the memory store: one response of 1,000 frames
//! through the layer in process, each frame spent from its [`Meter`] (a store call per chunk),
//! against the same stream under a rule that is not metered. Same run, same machine.
//!
//! ```text
//! cargo bench --all-features --bench metered
//! ```

use std::convert::Infallible;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::response::Response;
use axum::routing::get;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use http::Request;
use http_body_util::BodyExt;
use tollgate::key::FromHeader;
use tollgate::{Meter, Quota, RateLimitLayer, Rule, Spend};
use tower::ServiceExt;

/// Frames of each response.
const FRAMES: u64 = 1_000;

fn app(meter: Option<u64>) -> Router {
    // Never refused: each response is a new key's (`x-key`), with a budget far above its frames.
    let mut rule = Rule::new("frames", Quota::per_second(1_000_000)).key(FromHeader::new("x-key"));
    if let Some(chunk) = meter {
        rule = rule.meter(chunk);
    }
    let layer = RateLimitLayer::builder().rule(rule).build().unwrap();
    Router::new()
        .route(
            "/",
            get(|meter: Option<axum::Extension<Meter>>| async move {
                let meter = meter.map(|axum::Extension(m)| m);
                let frames = futures_util::stream::unfold((meter, 0u64), |(meter, n)| async move {
                    if n == FRAMES {
                        return None;
                    }
                    if let Some(meter) = &meter
                        && meter.spend(1).await == Spend::Exhausted
                    {
                        return None;
                    }
                    Some((
                        Ok::<_, Infallible>(Bytes::from_static(b"data: token\n\n")),
                        (meter, n + 1),
                    ))
                });
                Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(Body::from_stream(frames))
                    .unwrap()
            }),
        )
        .layer(layer)
}

async fn stream(app: &Router, n: u64) -> usize {
    let request = Request::get("/")
        .header("x-key", n.to_string())
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let mut body = response.into_body();
    let mut frames = 0;
    while let Some(frame) = body.frame().await {
        frames += usize::from(frame.unwrap().is_data());
    }
    assert_eq!(frames as u64, FRAMES);
    frames
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("stream_of_1000_frames");
    group.throughput(Throughput::Elements(FRAMES));
    for (name, meter) in [
        ("not metered", None),
        ("metered, chunk 500", Some(500)),
        ("metered, chunk 50", Some(50)),
    ] {
        let app = app(meter);
        let mut n = 0u64;
        group.bench_function(name, |b| {
            b.to_async(&rt).iter(|| {
                n += 1;
                stream(&app, n)
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(std::time::Duration::from_secs(1)).measurement_time(std::time::Duration::from_secs(4));
    targets = bench
}
criterion_main!(benches);
