//! [`ResponseFuture`]: wait for the decision, then call the inner service or answer for it.
//!
//! When the decision needs no waiting (the memory store, see
//! [`Store::check_now`]; no rule applies), `call` decides and the
//! future carries only the inner service's future or the answer. Otherwise it first waits for
//! the decision (key extractors that need a lookup, then the store).
//!
//! ```
//! use std::convert::Infallible;
//! use http::{Request, Response};
//! use tollgate::future::ResponseFuture;
//! use tollgate::key::Global;
//! use tollgate::{Quota, RateLimitLayer, Rule};
//! use tower::{Layer, Service, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let layer = RateLimitLayer::builder().rule(Rule::new("r", Quota::per_second(5)).key(Global)).build().unwrap();
//! let mut service = layer.layer(service_fn(|_: Request<String>| async {
//!     Ok::<_, Infallible>(Response::new(String::from("ok")))
//! }));
//! let future: ResponseFuture<_, _, _> = service.call(Request::new(String::new())); // decided here
//! let response = future.await.unwrap();
//! assert!(response.headers().contains_key("ratelimit"));
//! # }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::Decision;
use crate::decide::{Applied, Check, DeferredCheck, FoundKeys, Next, Shared, Start};
use crate::response::{ResponseBody, is_grpc};
use crate::store::Store;

pin_project! {
    /// The response future of [`RateLimit`](crate::RateLimit).
    pub struct ResponseFuture<S, ReqBody, St>
    where
        S: Service<Request<ReqBody>>,
        St: Store,
    {
        #[pin]
        state: State<S, Request<ReqBody>, S::Future, Check<St::Future>>,
        applied: Applied,
        // The keys, kept only when a rule may fall back to the local limiter.
        keys: Option<Box<FoundKeys>>,
        shared: Arc<Shared<St>>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, R, F, C> {
        // The ready inner service and the request wait here for the decision.
        Checking { #[pin] check: C, call: Option<(S, R)> },
        Deferred { check: DeferredCheck, call: Option<(S, R)> },
        Calling { #[pin] future: F, decision: Option<Decision> },
        // Decided in `call`: tollgate's own answer, ready.
        Answered { response: Option<Response<Bytes>> },
        Done,
    }
}

impl<S, ReqBody, St> ResponseFuture<S, ReqBody, St>
where
    S: Service<Request<ReqBody>>,
    St: Store,
{
    /// The future of a request after [`Shared::start`]: the inner service is called now when it
    /// was decided, else the future waits for the decision first.
    pub(crate) fn new(
        start: Start<St::Future>,
        mut service: S,
        request: Request<ReqBody>,
        shared: Arc<Shared<St>>,
    ) -> Self {
        let (state, applied, keys) = match start {
            Start::Decided {
                next: Next::Call(decision),
                applied,
            } => (
                State::Calling {
                    future: service.call(request),
                    decision,
                },
                applied,
                None,
            ),
            Start::Decided {
                next: Next::Answer(response),
                applied,
            } => (
                State::Answered {
                    response: Some(response),
                },
                applied,
                None,
            ),
            Start::Checking {
                check,
                applied,
                keys,
            } => (
                State::Checking {
                    check,
                    call: Some((service, request)),
                },
                applied,
                keys,
            ),
            Start::Deferred(check) => (
                State::Deferred {
                    check,
                    call: Some((service, request)),
                },
                Applied::new(),
                None,
            ),
        };
        ResponseFuture {
            state,
            applied,
            keys,
            shared,
        }
    }
}

impl<S, ReqBody, ResBody, St> Future for ResponseFuture<S, ReqBody, St>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    St: Store,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let (result, call) = match this.state.as_mut().project() {
                StateProj::Checking { check, call } => {
                    let result = ready!(check.poll(cx));
                    (result, call.take())
                }
                StateProj::Deferred { check, call } => {
                    let (applied, keys, result) = ready!(check.as_mut().poll(cx));
                    *this.applied = applied;
                    *this.keys = keys;
                    (result, call.take())
                }
                StateProj::Calling { future, decision } => {
                    let mut response = ready!(future.poll(cx))?;
                    let decision = decision.take();
                    this.state.set(State::Done);
                    if let Some(decision) = decision {
                        let shared = &**this.shared;
                        shared.answers.write_budget(
                            response.headers_mut(),
                            &shared.rules,
                            this.applied,
                            &decision,
                        );
                    }
                    return Poll::Ready(Ok(response.map(ResponseBody::inner)));
                }
                StateProj::Answered { response } => {
                    let response = response.take();
                    this.state.set(State::Done);
                    let Some(response) = response else {
                        panic!("ResponseFuture polled after completion");
                    };
                    return Poll::Ready(Ok(response.map(ResponseBody::full)));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            };
            let Some((mut service, request)) = call else {
                panic!("ResponseFuture polled after completion");
            };
            let grpc = || is_grpc(request.headers());
            let next = this
                .shared
                .after_check(this.applied, this.keys.as_deref(), result, grpc);
            match next {
                Next::Call(decision) => this.state.set(State::Calling {
                    future: service.call(request),
                    decision,
                }),
                Next::Answer(response) => {
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(response.map(ResponseBody::full)));
                }
            }
        }
    }
}
