//! What the layer costs per request, without the network: an axum router called in process,
//! bare and behind tollgate / tower_governor, allowing and rejecting. Same run, same machine.
//!
//! ```text
//! cargo bench --bench layer
//! ```

use std::net::SocketAddr;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use criterion::{Criterion, criterion_group, criterion_main};
use http::Request;
use tollgate::{Quota, RateLimitLayer, Rule};
use tower::{Service, ServiceExt};

fn hello() -> Router {
    Router::new().route("/", get(|| async { "Hello, World!" }))
}

fn request() -> Request<Body> {
    let mut req = Request::get("/").body(Body::empty()).unwrap();
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::from(([127, 0, 0, 1], 40000))));
    req
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let governor = |per_ns: bool| {
        let mut builder = tower_governor::governor::GovernorConfigBuilder::default();
        if per_ns {
            builder.per_nanosecond(1).burst_size(1_000_000_000);
        } else {
            builder.per_second(3600).burst_size(1);
        }
        tower_governor::GovernorLayer::new(builder.finish().unwrap())
    };
    let apps: Vec<(&str, Router)> = vec![
        ("bare", hello()),
        (
            "tollgate_allow",
            hello().layer(
                RateLimitLayer::builder()
                    .rule(Rule::new(
                        "load",
                        Quota::per_second(1_000_000).burst(1_000_000_000),
                    ))
                    .build()
                    .unwrap(),
            ),
        ),
        (
            "tollgate_reject",
            hello().layer(
                RateLimitLayer::builder()
                    .rule(Rule::new("load", Quota::per_hour(1)))
                    .build()
                    .unwrap(),
            ),
        ),
        ("tower_governor_allow", hello().layer(governor(true))),
        ("tower_governor_reject", hello().layer(governor(false))),
    ];
    let mut group = c.benchmark_group("axum_in_process");
    for (name, app) in apps {
        // Finalise the router as `axum::serve` does, so handlers are not converted per request.
        let app = app.with_state::<()>(());
        group.bench_function(name, |b| {
            b.to_async(&rt).iter(|| {
                let mut app = app.clone();
                async move {
                    let res = app
                        .as_service()
                        .ready()
                        .await
                        .unwrap()
                        .call(request())
                        .await
                        .unwrap();
                    // Read the body, as a server would.
                    let body = http_body_util::BodyExt::collect(res.into_body())
                        .await
                        .unwrap();
                    std::hint::black_box(body);
                }
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(std::time::Duration::from_secs(1)).measurement_time(std::time::Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
