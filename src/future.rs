//! [`ResponseFuture`]: decide, then call the inner service or answer for it.
//!
//! The future first waits for the decision (key extractors that need a lookup, then the store),
//! and only then either calls the inner service, adding the budget headers to its response, or
//! answers for it (429, a gRPC status, or 503 when the store failed and the layer fails closed).
//! When the decision needs no waiting (the memory store, see [`Store::check_now`]; no rule
//! applies; the circuit breaker is open) and no key needs a lookup, `call` decides, and the
//! future carries only the inner service's future or the answer.
//!
//! ```
//! use std::convert::Infallible;
//! use http::{Request, Response};
//! use tollgate::{Quota, RateLimitLayer, ResponseFuture, Rule};
//! use tollgate::key::Global;
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
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{Request, Response, StatusCode};
use pin_project_lite::pin_project;
use tower_service::Service;

use smallvec::SmallVec;

use crate::decision::Decision;
use crate::layer::Shared;
use crate::policy::FailureMode;
use crate::response::{
    PROBLEM_JSON, RateLimited, ResponseBody, grpc_denied, grpc_unavailable, is_grpc,
    problem_response, write_headers,
};
use crate::service::{Applied, FoundKeys};
use crate::store::{Charge, Store, StoreError};

/// The check of a request whose keys needed asynchronous work: the rules that applied, their
/// keys when a local fallback may need them, and the store's answer.
type DeferredCheck = Pin<
    Box<
        dyn Future<
                Output = (
                    Applied,
                    Option<Box<FoundKeys>>,
                    Result<Decision, StoreError>,
                ),
            > + Send,
    >,
>;

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

pin_project! {
    /// The store's answer, or an answer made without asking it.
    #[project = CheckProj]
    pub(crate) enum Check<C> {
        Store { #[pin] future: C },
        Decided { result: Option<Result<Decision, StoreError>> },
    }
}

impl<C> Check<C> {
    /// Asks the store, unless no rule applies or its circuit breaker is open.
    pub(crate) fn ask<St: Store<Future = C>>(shared: &Shared<St>, charges: &[Charge<'_>]) -> Self {
        if charges.is_empty() {
            Check::Decided {
                result: Some(Ok(Decision::default())),
            }
        } else if shared.breaker.admits() {
            match shared.store.check_now(charges) {
                Some(result) => Check::Decided {
                    result: Some(result),
                },
                None => Check::Store {
                    future: shared.store.check(charges),
                },
            }
        } else {
            Check::Decided {
                result: Some(Err(StoreError::CircuitOpen)),
            }
        }
    }
}

impl<C> Check<C> {
    /// The answer, when it was known without waiting.
    pub(crate) fn into_decided(self) -> Result<Result<Decision, StoreError>, Self> {
        match self {
            Check::Decided {
                result: Some(result),
            } => Ok(result),
            pending => Err(pending),
        }
    }
}

impl<C> Future for Check<C>
where
    C: Future<Output = Result<Decision, StoreError>>,
{
    type Output = Result<Decision, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            CheckProj::Store { future } => future.poll(cx),
            CheckProj::Decided { result } => {
                Poll::Ready(result.take().unwrap_or(Err(StoreError::CircuitOpen)))
            }
        }
    }
}

impl<S, ReqBody, St> ResponseFuture<S, ReqBody, St>
where
    S: Service<Request<ReqBody>>,
    St: Store,
{
    pub(crate) fn checking(
        check: Check<St::Future>,
        applied: Applied,
        service: S,
        request: Request<ReqBody>,
        shared: Arc<Shared<St>>,
    ) -> Self {
        ResponseFuture {
            state: State::Checking {
                check,
                call: Some((service, request)),
            },
            applied,
            keys: None,
            shared,
        }
    }

    /// A request whose check was answered at once: the inner service is called now, or
    /// tollgate's answer is ready.
    pub(crate) fn decided(
        next: Next,
        applied: Applied,
        mut service: S,
        request: Request<ReqBody>,
        shared: Arc<Shared<St>>,
    ) -> Self {
        let state = match next {
            Next::Call(decision) => State::Calling {
                future: service.call(request),
                decision,
            },
            Next::Answer(response) => State::Answered {
                response: Some(response),
            },
        };
        ResponseFuture {
            state,
            applied,
            keys: None,
            shared,
        }
    }

    /// Keeps the request's keys, for rules that fall back to the local limiter.
    pub(crate) fn keeping_keys(mut self, keys: FoundKeys) -> Self {
        self.keys = Some(Box::new(keys));
        self
    }

    pub(crate) fn deferred(
        check: DeferredCheck,
        service: S,
        request: Request<ReqBody>,
        shared: Arc<Shared<St>>,
    ) -> Self {
        ResponseFuture {
            state: State::Deferred {
                check,
                call: Some((service, request)),
            },
            applied: Applied::new(),
            keys: None,
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
                        write_headers(
                            response.headers_mut(),
                            shared.headers,
                            &shared.rules,
                            &shared.policies,
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
            let grpc = || {
                call.as_ref()
                    .is_some_and(|(_, request)| is_grpc(request.headers()))
            };
            let decision = match after_check(
                this.shared,
                this.applied,
                this.keys.as_deref(),
                result,
                grpc,
            ) {
                Next::Call(decision) => decision,
                Next::Answer(response) => {
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(response.map(ResponseBody::full)));
                }
            };
            let Some((mut service, request)) = call else {
                panic!("ResponseFuture polled after completion");
            };
            this.state.set(State::Calling {
                future: service.call(request),
                decision,
            });
        }
    }
}

/// What follows a request's check.
pub(crate) enum Next {
    /// Call the inner service, then add the budget headers of this decision (none when no
    /// rule limited the request).
    Call(Option<Decision>),
    /// Answer for the inner service: a denial, or a refusal when the store failed.
    Answer(Response<Bytes>),
}

/// Turns the store's answer into what follows: the circuit breaker learns of it, a denial
/// becomes the answer, and a store failure is decided by each applied rule's
/// [`FailureMode`]. `grpc` tells whether the request is a gRPC call (asked only to answer).
pub(crate) fn after_check<St>(
    shared: &Shared<St>,
    applied: &mut Applied,
    keys: Option<&FoundKeys>,
    result: Result<Decision, StoreError>,
    grpc: impl Fn() -> bool,
) -> Next {
    match result {
        Ok(decision) => {
            // A request no rule applied to never asked the store: it tells the breaker nothing.
            if !decision.outcomes().is_empty() {
                shared.breaker.success();
            }
            if decision.allowed() {
                Next::Call(Some(decision))
            } else {
                Next::Answer(denied(shared, applied, &decision, grpc()))
            }
        }
        Err(error) => {
            let opened = !matches!(error, StoreError::CircuitOpen) && shared.breaker.failure();
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as u64);
            if opened {
                tracing::error!(%error, "tollgate: the rate-limit store keeps failing; its circuit breaker opened: requests are decided without it until a probe succeeds");
            } else if shared.warned_store_error.due(now, 60_000_000) {
                tracing::error!(%error, "tollgate: the rate-limit store failed; each rule's FailureMode decides (reported at most once a minute)");
            } else {
                tracing::debug!(%error, "tollgate: the rate-limit store failed");
            }
            match decide_without_store(shared, applied, keys) {
                WithoutStore::Refuse => Next::Answer(unavailable(grpc())),
                WithoutStore::Decided(decision) if !decision.allowed() => {
                    Next::Answer(denied(shared, applied, &decision, grpc()))
                }
                WithoutStore::Decided(decision) => Next::Call(Some(decision)),
                WithoutStore::Unlimited => Next::Call(None),
            }
        }
    }
}

/// How a request is decided when the store failed.
enum WithoutStore {
    /// A rule fails closed.
    Refuse,
    /// The local limiter decided the rules that fall back to it.
    Decided(Decision),
    /// Every rule fails open.
    Unlimited,
}

/// Decides by each applied rule's [`FailureMode`]; on a local decision, `applied` becomes the
/// rules it covers.
fn decide_without_store<St>(
    shared: &Shared<St>,
    applied: &mut Applied,
    keys: Option<&FoundKeys>,
) -> WithoutStore {
    let mode = |i: &u16| shared.rules[usize::from(*i)].on_store_error;
    if applied.iter().any(|i| mode(i) == FailureMode::Closed) {
        return WithoutStore::Refuse;
    }
    let (Some(fallback), Some(keys)) = (&shared.fallback, keys) else {
        return WithoutStore::Unlimited;
    };
    let local: SmallVec<[Charge<'_>; 2]> = keys
        .iter()
        .filter(|(i, _, _)| mode(i) == FailureMode::Local)
        .map(|(i, key, cost)| Charge {
            rule: &shared.rules[usize::from(*i)].spec,
            key,
            cost: *cost,
        })
        .collect();
    if local.is_empty() {
        return WithoutStore::Unlimited;
    }
    *applied = keys
        .iter()
        .filter(|(i, _, _)| mode(i) == FailureMode::Local)
        .map(|(i, _, _)| *i)
        .collect();
    // The memory store decides at once and never fails.
    match fallback.check(&local).into_inner() {
        Ok(decision) => WithoutStore::Decided(decision),
        Err(_) => WithoutStore::Unlimited,
    }
}

fn denied<St>(
    shared: &Shared<St>,
    applied: &[u16],
    decision: &Decision,
    grpc: bool,
) -> Response<Bytes> {
    let mut response = match &shared.on_denied {
        _ if grpc => grpc_denied(decision.retry_after_micros()),
        Some(handler) => handler(&RateLimited::new(&shared.rules, applied, decision)),
        None => problem_response(&shared.rules, &shared.problems, applied, decision),
    };
    write_headers(
        response.headers_mut(),
        shared.headers,
        &shared.rules,
        &shared.policies,
        applied,
        decision,
    );
    response
}

fn unavailable(grpc: bool) -> Response<Bytes> {
    if grpc {
        return grpc_unavailable();
    }
    let body = Bytes::from_static(
        b"{\"type\":\"about:blank\",\"title\":\"Service Unavailable\",\"status\":503,\"detail\":\"The rate limiter cannot decide right now; retry shortly.\"}",
    );
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, PROBLEM_JSON.clone());
    headers.insert(RETRY_AFTER, HeaderValue::from_static("1"));
    response
}
