//! Fuzzes the settling of a request's cost from a response header
//! (`Rule::settle_from_header`): whatever number (or not) the service writes there.
//!
//! The first byte picks the algorithm (token bucket, GCRA, fixed window, sliding window
//! counter), the second the estimate (0 to 7 units, at most the quota), the third the quota
//! (1 to 16 per minute); the rest is split at newlines into the header values of up to 8
//! requests in a row. Besides "never panics", it checks that:
//!
//! * each answer is the service's (200) or a denial (429) with a `Retry-After` of at least 1 s;
//! * the cost header never reaches the client;
//! * an admitted answer's `RateLimit` shows no more than the quota left.

#![no_main]

mod common;

use std::convert::Infallible;
use std::future::{Ready, ready};
use std::sync::OnceLock;
use std::task::{Context, Poll};

use common::value;
use http::{HeaderName, HeaderValue, Request, Response};
use libfuzzer_sys::fuzz_target;
use tollgate::key::Global;
use tollgate::{Algorithm, Quota, RateLimitLayer, Rule};
use tower_layer::Layer;
use tower_service::Service;

const COST: HeaderName = HeaderName::from_static("x-cost");

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    })
}

/// A service that reports the cost it is given.
#[derive(Clone)]
struct Reports(HeaderValue);

impl Service<Request<()>> for Reports {
    type Response = Response<()>;
    type Error = Infallible;
    type Future = Ready<Result<Response<()>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<()>) -> Self::Future {
        let mut response = Response::new(());
        response.headers_mut().insert(COST, self.0.clone());
        ready(Ok(response))
    }
}

fuzz_target!(|data: &[u8]| {
    let [algorithm, estimate, quota, values @ ..] = data else {
        return;
    };
    let algorithm = [
        Algorithm::TokenBucket,
        Algorithm::Gcra,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindowCounter,
    ][usize::from(algorithm % 4)];
    let quota = u64::from(quota % 16 + 1);
    let rule = Rule::new("tokens", Quota::per_minute(quota))
        .algorithm(algorithm)
        // An estimate above what the rule ever holds is refused when the layer is built.
        .cost(u64::from(estimate % 8).min(quota))
        .key(Global)
        .settle_from_header(COST);
    runtime().block_on(async {
        let layer = RateLimitLayer::builder().rule(rule).build().unwrap();
        for line in values.split(|&b| b == b'\n').take(8) {
            let mut service = layer.layer(Reports(value(line)));
            std::future::poll_fn(|cx| service.poll_ready(cx))
                .await
                .unwrap();
            let response = service.call(Request::new(())).await.unwrap();
            let headers = response.headers();
            assert!(
                !headers.contains_key(COST),
                "the cost header reached the client"
            );
            match response.status().as_u16() {
                200 => {
                    for limit in headers.get_all("ratelimit") {
                        let limit = limit.to_str().unwrap();
                        let r = limit
                            .split(';')
                            .find_map(|p| p.trim().strip_prefix("r="))
                            .map(|r| r.parse::<u64>().unwrap());
                        assert!(r.is_none_or(|r| r <= quota), "{limit} of {quota}");
                    }
                }
                429 => {
                    let after = headers["retry-after"].to_str().unwrap();
                    assert!(after.parse::<u64>().unwrap() >= 1, "Retry-After: {after}");
                }
                status => panic!("status {status}"),
            }
        }
    });
});
