//! The layer as a tower `Service`: what becomes of the inner service's readiness when a request
//! is admitted at once, refused at once, or waits for its key. A concurrency limit of one shared
//! by two clones of the limited service shows it: the permit `poll_ready` takes is the inner
//! service's until it is called, or dropped.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tokio::sync::Semaphore;
use tollgate::key::{Global, Key, async_fn};
use tollgate::{Quota, RateLimitLayer, Rule};
use tower::limit::ConcurrencyLimit;
use tower::{Layer, Service, ServiceExt, service_fn};

type Inner = ConcurrencyLimit<
    tower::util::ServiceFn<
        fn(Request<String>) -> std::future::Ready<Result<Response<String>, Infallible>>,
    >,
>;

/// A handler behind a concurrency limit of one that every clone shares.
fn limited() -> Inner {
    fn ok(_: Request<String>) -> std::future::Ready<Result<Response<String>, Infallible>> {
        std::future::ready(Ok(Response::new(String::from("ok"))))
    }
    let handler: fn(Request<String>) -> _ = ok;
    ConcurrencyLimit::with_semaphore(service_fn(handler), Arc::new(Semaphore::new(1)))
}

/// Whether `service` becomes ready within a second (its permit is free).
async fn ready_soon<S: Service<Request<String>>>(service: &mut S) -> bool {
    tokio::time::timeout(Duration::from_secs(1), service.ready())
        .await
        .is_ok_and(|ready| ready.is_ok())
}

#[tokio::test]
async fn a_request_refused_at_once_leaves_no_permit_taken() {
    // One request an hour: the first is admitted, the second refused.
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("one", Quota::per_hour(1)).key(Global))
        .build()
        .unwrap();
    let mut first = layer.layer(limited());
    let mut second = first.clone();

    let admitted = first
        .ready()
        .await
        .unwrap()
        .call(Request::new(String::new()));
    assert_eq!(admitted.await.unwrap().status(), StatusCode::OK);
    // Called and answered: its permit came back, and the same service is made ready again.
    assert!(ready_soon(&mut first).await);
    let refused = first.call(Request::new(String::new())).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    // The refused request did not call the handler, and holds nothing of it: another clone
    // gets the one permit.
    assert!(ready_soon(&mut second).await, "the refusal kept the permit");
    drop(second);
    // And so does the first again.
    assert!(ready_soon(&mut first).await);
}

#[tokio::test]
async fn a_request_that_waits_for_its_key_takes_the_ready_service_along() {
    // A key that needs a lookup: the decision is waited for, in the response future.
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("per-caller", Quota::per_hour(100)).key(async_fn(
            |_: &http::request::Parts| async {
                tokio::task::yield_now().await;
                Some(Key::text("caller"))
            },
        )))
        .build()
        .unwrap();
    let mut service = layer.layer(limited());
    let mut other = service.clone();

    let waiting = service
        .ready()
        .await
        .unwrap()
        .call(Request::new(String::new()));
    // The waiting request holds the permit (its ready service went with it)…
    assert!(!ready_soon(&mut other).await);
    drop(other);
    // …and is served with it; dropped undecided, it gives it back.
    assert_eq!(waiting.await.unwrap().status(), StatusCode::OK);
    assert!(ready_soon(&mut service).await);
    let undecided = service.call(Request::new(String::new()));
    drop(undecided);
    let mut another = service.clone();
    assert!(
        ready_soon(&mut another).await,
        "a dropped request kept the permit"
    );
}
