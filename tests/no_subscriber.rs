//! With no `tracing` subscriber, a checked request makes no span: `tracing`'s `log` feature
//! (on with axum's default features) would otherwise describe an empty `tollgate.check` span to
//! the `log` crate on every request.
//!
//! This binary installs no subscriber, only a `log` logger that keeps every record. A logger is
//! set once per process: this file holds one test.

use std::net::SocketAddr;
use std::sync::Mutex;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, StatusCode};
use tollgate::{Quota, RateLimitLayer, Rule};
use tower::{Service, ServiceExt};

static RECORDS: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Keep;

impl log::Log for Keep {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        RECORDS
            .lock()
            .unwrap()
            .push(format!("{} {}", record.target(), record.args()));
    }
    fn flush(&self) {}
}

#[tokio::test]
async fn without_a_subscriber_a_request_makes_no_span_for_the_log_crate() {
    log::set_logger(&Keep).unwrap();
    log::set_max_level(log::LevelFilter::Trace);
    assert_eq!(
        tracing::level_filters::LevelFilter::current(),
        tracing::level_filters::LevelFilter::OFF,
        "no subscriber is installed in this binary"
    );
    // The bridge works: an event with no subscriber reaches the logger.
    tracing::debug!(target: "bridge", "reached");
    assert!(
        RECORDS
            .lock()
            .unwrap()
            .iter()
            .any(|r| r.contains("reached")),
        "tracing's `log` feature is off in this build: {:?}",
        RECORDS.lock().unwrap()
    );

    let layer = RateLimitLayer::builder()
        .rule(Rule::new("per-minute", Quota::per_minute(1)))
        .build()
        .unwrap();
    let mut app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    for expected in [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS] {
        let mut request = Request::get("/").body(Body::empty()).unwrap();
        request
            .extensions_mut()
            .insert(axum::extract::ConnectInfo(SocketAddr::from((
                [9, 9, 9, 9],
                4000,
            ))));
        let response = app.as_service().ready().await.unwrap().call(request).await;
        assert_eq!(response.unwrap().status(), expected);
    }
    let records = RECORDS.lock().unwrap();
    assert!(
        !records.iter().any(|r| r.contains("tollgate.check")),
        "{records:#?}"
    );
}
