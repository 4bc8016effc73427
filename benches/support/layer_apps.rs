//! The routers that `benches/layer.rs` and `examples/instructions.rs` measure: hello-world axum,
//! bare and behind tollgate / tower_governor, allowing and rejecting everything.

use std::net::SocketAddr;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::Request;
use tollgate::{Quota, RateLimitLayer, Rule};
use tower::{Service, ServiceExt};

fn hello() -> Router {
    Router::new().route("/", get(|| async { "Hello, World!" }))
}

/// Behind tower_governor, keyed by the peer IP like tollgate's default.
fn governed(allow: bool) -> Router {
    let mut builder = tower_governor::governor::GovernorConfigBuilder::default();
    if allow {
        builder.per_nanosecond(1).burst_size(1_000_000_000);
    } else {
        builder.per_second(3600).burst_size(1);
    }
    let config = builder.finish().expect("valid governor config");
    hello().layer(tower_governor::GovernorLayer::new(config))
}

fn tollgate(quota: Quota) -> RateLimitLayer {
    RateLimitLayer::builder()
        .rule(Rule::new("load", quota))
        .build()
        .expect("valid tollgate config")
}

/// The measured routers by name, finalised as `axum::serve` does (so that handlers are not
/// converted per request).
pub fn apps() -> Vec<(&'static str, Router)> {
    vec![
        ("bare", hello()),
        (
            "tollgate_allow",
            hello().layer(tollgate(Quota::per_second(1_000_000).burst(1_000_000_000))),
        ),
        (
            "tollgate_reject",
            hello().layer(tollgate(Quota::per_hour(1))),
        ),
        ("tower_governor_allow", governed(true)),
        ("tower_governor_reject", governed(false)),
    ]
    .into_iter()
    .map(|(name, app)| (name, app.with_state::<()>(())))
    .collect()
}

/// One request from 127.0.0.1, answered and its body read to the end, as a server would; its
/// status.
pub async fn serve_one(app: &Router) -> http::StatusCode {
    let mut request = Request::get("/")
        .body(Body::empty())
        .expect("valid request");
    request
        .extensions_mut()
        .insert(ConnectInfo(SocketAddr::from(([127, 0, 0, 1], 40000))));
    let mut app = app.clone();
    let response = app
        .as_service()
        .ready()
        .await
        .expect("axum routers are always ready")
        .call(request)
        .await
        .expect("axum routers never fail");
    let status = response.status();
    let body = http_body_util::BodyExt::collect(response.into_body())
        .await
        .expect("in-memory bodies never fail");
    std::hint::black_box(body);
    status
}
