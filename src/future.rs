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

use crate::decide::{
    Admitted, Applied, Check, Checked, Ctx, DeferredCheck, FoundKeys, Next, Phase, Shared, Start,
};
use crate::held::Held;
use crate::observe::Head;
use crate::policy::TenantFuture;
use crate::policy::snapshot::{Listing, Snapshot};
use crate::response::ResponseBody;
use crate::shed::InFlight;
use crate::store::{Store, StoreFuture};

pin_project! {
    /// The response future of [`RateLimit`](crate::RateLimit).
    pub struct ResponseFuture<S, ReqBody, St>
    where
        S: Service<Request<ReqBody>>,
        St: Store,
    {
        #[pin]
        state: State<S, Request<ReqBody>, S::Future, Check<St::Future>, S::Response>,
        applied: Applied,
        // The keys, kept only when they may be needed again (local fallback, shadow and delay
        // rules).
        keys: Option<Box<FoundKeys>>,
        // The policy the request started under: it finishes under it.
        snapshot: Arc<Snapshot>,
        // Open until the request is decided.
        span: tracing::Span,
        // When the store was asked, when the latency is measured.
        asked_at: Option<std::time::Instant>,
        // The request's place in the load shedder's count: it goes with the response body.
        in_flight: Option<InFlight>,
        shared: Arc<Shared<St>>,
    }

    impl<S, ReqBody, St> PinnedDrop for ResponseFuture<S, ReqBody, St>
    where
        S: Service<Request<ReqBody>>,
        St: Store,
    {
        // A request dropped before it was decided (its client went away) is told to events. One
        // dropped while its charges are settled has its settle finish on its own: the handler's
        // work was done, its cost is charged.
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            let call = match this.state.project() {
                StateProj::Tenant { call, .. }
                | StateProj::Checking { call, .. }
                | StateProj::Deferred { call, .. } => call.as_ref(),
                StateProj::Settling { future, .. } => {
                    if let Some(future) = future.take() {
                        finish_settle(future);
                    }
                    None
                }
                _ => None,
            };
            if let Some((_, request)) = call {
                this.shared.cancelled(
                    this.snapshot,
                    Head::of_request(request),
                    this.applied,
                    this.span,
                );
            }
        }
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, R, F, C, Resp> {
        // The tenant is looked up; the ready inner service and the request wait here.
        Tenant { future: TenantFuture, listing: Listing, call: Option<(S, R)> },
        // The ready inner service and the request wait here for the decision.
        Checking { #[pin] check: C, call: Option<(S, R)> },
        Deferred { check: DeferredCheck, call: Option<(S, R)> },
        // The inner service works; the request's slots are held here meanwhile.
        Calling { #[pin] future: F, admitted: Admitted },
        // The inner service answered; its charges are settled in the store first.
        Settling {
            future: Option<StoreFuture<()>>,
            response: Option<Resp>,
            held: Option<Held>,
        },
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
        snapshot: Arc<Snapshot>,
        span: tracing::Span,
        service: S,
        request: Request<ReqBody>,
        shared: Arc<Shared<St>>,
        in_flight: Option<InFlight>,
    ) -> Self {
        let mut applied = Applied::new();
        let mut keys = None;
        let mut asked_at = None;
        let state = enter(
            start,
            service,
            request,
            &mut applied,
            &mut keys,
            &mut asked_at,
        );
        // Decided already: the span is closed now, not with the response.
        let span = match state {
            State::Calling { .. } | State::Answered { .. } => tracing::Span::none(),
            _ => span,
        };
        ResponseFuture {
            state,
            applied,
            keys,
            snapshot,
            span,
            asked_at,
            in_flight,
            shared,
        }
    }
}

/// The state in which a request waits after `start`.
#[allow(clippy::type_complexity)]
fn enter<S, ReqBody, C>(
    start: Start<C>,
    mut service: S,
    request: Request<ReqBody>,
    applied: &mut Applied,
    keys: &mut Option<Box<FoundKeys>>,
    asked_at: &mut Option<std::time::Instant>,
) -> State<S, Request<ReqBody>, S::Future, Check<C>, S::Response>
where
    S: Service<Request<ReqBody>>,
{
    match start {
        Start::Decided {
            next,
            applied: decided,
        } => {
            *applied = decided;
            match next {
                Next::Call(admitted) => State::Calling {
                    future: service.call(request),
                    admitted,
                },
                Next::Answer(response) => State::Answered {
                    response: Some(response),
                },
                Next::Again(check) => State::Deferred {
                    check,
                    call: Some((service, request)),
                },
            }
        }
        Start::Checking {
            check,
            applied: checking,
            keys: kept,
            asked_at: asked,
        } => {
            *applied = checking;
            *keys = kept;
            *asked_at = asked;
            State::Checking {
                check,
                call: Some((service, request)),
            }
        }
        Start::Deferred(check) => State::Deferred {
            check,
            call: Some((service, request)),
        },
        Start::Tenant { future, listing } => State::Tenant {
            future,
            listing,
            call: Some((service, request)),
        },
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
            let (result, call, phase, latency) = match this.state.as_mut().project() {
                StateProj::Tenant {
                    future,
                    listing,
                    call,
                } => {
                    let tenant = ready!(future.as_mut().poll(cx));
                    let Some((service, request)) = call.take() else {
                        panic!("ResponseFuture polled after completion");
                    };
                    let (mut parts, body) = request.into_parts();
                    let start = this.shared.with_tenant(
                        this.snapshot,
                        tenant.into(),
                        *listing,
                        &mut parts,
                        this.span,
                    );
                    let request = Request::from_parts(parts, body);
                    let state = enter(
                        start,
                        service,
                        request,
                        this.applied,
                        this.keys,
                        this.asked_at,
                    );
                    if matches!(state, State::Calling { .. } | State::Answered { .. }) {
                        // Decided: the span closes.
                        *this.span = tracing::Span::none();
                    }
                    this.state.set(state);
                    continue;
                }
                StateProj::Checking { check, call } => {
                    let result = ready!(check.poll(cx));
                    let latency = this.asked_at.take().map(|at| at.elapsed());
                    this.shared.observer.store_checked(latency, &result);
                    (result, call.take(), Phase::default(), latency)
                }
                StateProj::Deferred { check, call } => {
                    let Checked {
                        applied,
                        keys,
                        result,
                        phase,
                        latency,
                    } = ready!(check.as_mut().poll(cx));
                    *this.applied = applied;
                    *this.keys = keys;
                    (result, call.take(), phase, latency)
                }
                StateProj::Calling { future, admitted } => {
                    // An error of the inner service drops the slots with this state.
                    let mut response = ready!(future.poll(cx))?;
                    let mut decision = admitted.decision.take();
                    let held = admitted.held.take();
                    let mut pending = None;
                    if let Some(settle) = admitted.settle.take() {
                        let answer = decision.as_mut().map(|d| (d, &this.applied[..]));
                        (response, pending) =
                            this.shared.settle(this.snapshot, &settle, response, answer);
                    }
                    let snapshot = &**this.snapshot;
                    for name in &snapshot.cost_headers {
                        response.headers_mut().remove(name);
                    }
                    if let Some(decision) = decision {
                        snapshot.answers.write_budget(
                            response.headers_mut(),
                            &snapshot.rules,
                            this.applied,
                            &decision,
                        );
                    }
                    if let Some(future) = pending {
                        this.state.set(State::Settling {
                            future: Some(future),
                            response: Some(response),
                            held,
                        });
                        continue;
                    }
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(response
                        .map(|body| ResponseBody::holding(body, held, this.in_flight.take()))));
                }
                StateProj::Settling {
                    future,
                    response,
                    held,
                } => {
                    if let Some(pending) = future {
                        crate::decide::report_settle(ready!(pending.as_mut().poll(cx)));
                        *future = None;
                    }
                    let response = response.take();
                    let held = held.take();
                    this.state.set(State::Done);
                    let Some(response) = response else {
                        panic!("ResponseFuture polled after completion");
                    };
                    return Poll::Ready(Ok(response
                        .map(|body| ResponseBody::holding(body, held, this.in_flight.take()))));
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
            let ctx = Ctx {
                head: Head::of_request(&request),
                span: this.span,
                latency,
                phase,
            };
            let next = this.shared.after_check(
                this.snapshot,
                this.applied,
                this.keys.as_deref(),
                result,
                &ctx,
            );
            if !matches!(next, Next::Again(_)) {
                // Decided: the span closes.
                *this.span = tracing::Span::none();
            }
            match next {
                Next::Call(admitted) => this.state.set(State::Calling {
                    future: service.call(request),
                    admitted,
                }),
                Next::Answer(response) => {
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(response.map(ResponseBody::full)));
                }
                Next::Again(check) => this.state.set(State::Deferred {
                    check,
                    call: Some((service, request)),
                }),
            }
        }
    }
}

/// Lets a settle whose request was dropped finish on the runtime (a store's calls have their
/// own time budget). Without a runtime it is dropped, and said: the reserved units stay, as for
/// a response that never came.
fn finish_settle(future: StoreFuture<()>) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(async move { crate::decide::report_settle(future.await) });
        }
        Err(_) => tracing::warn!(
            "tollgate: a request dropped outside a Tokio runtime while its charge was settled; \
             the reserved units stay"
        ),
    }
}
