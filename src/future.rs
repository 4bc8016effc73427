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
use http::request::Parts;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::body::{MeteredStream, ResponseBody};
use crate::engine::{
    Admitted, Decide, Driver, Engine, Meter, Ruling, Slots, finish_detached, report_settle,
};
use crate::observe::Head;
use crate::policy::snapshot::Snapshot;
use crate::runtime::Origin;
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
        state: State<S, ReqBody, S::Future, Driver<St>, S::Response>,
        // The policy the request started under: it finishes under it.
        snapshot: Arc<Snapshot>,
        // The request's place in the load shedder's count: it goes with the response body.
        in_flight: Option<InFlight>,
        engine: Arc<Engine<St>>,
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
            match this.state.project() {
                StateProj::Deciding {
                    driver,
                    call: Some((_, parts, _)),
                } => driver.cancel(Head::of_parts(parts)),
                StateProj::Settling { future, origin, .. } => {
                    if let Some(future) = future.take() {
                        finish_settle(future, origin);
                    }
                }
                _ => {}
            }
        }
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B, F, D, Resp> {
        // The ready inner service and the request wait here for the decision.
        Deciding { #[pin] driver: D, call: Option<(S, Parts, B)> },
        // The inner service works; the request's slots are held here meanwhile.
        Calling { #[pin] future: F, admitted: Admitted },
        // The inner service answered; its charges are settled in the store first.
        Settling {
            future: Option<StoreFuture<()>>,
            // The runtime it is settled on: the settle finishes there if the request is
            // dropped on a thread that runs none.
            origin: Origin,
            response: Option<Resp>,
            slots: Option<Slots>,
            meter: Option<Meter>,
        },
        // Decided: tollgate's own answer, ready.
        Answered { response: Option<Response<Bytes>> },
        Done,
    }
}

impl<S, ReqBody, St> ResponseFuture<S, ReqBody, St>
where
    S: Service<Request<ReqBody>>,
    St: Store,
{
    /// The future of a request after [`Engine::decide`]: the ready `service` is called now when
    /// it was decided, else the future drives the decision first.
    #[inline]
    pub(crate) fn new(
        decide: Decide<St::Future>,
        snapshot: Arc<Snapshot>,
        span: tracing::Span,
        service: &mut S,
        request: (Parts, ReqBody),
        engine: Arc<Engine<St>>,
        in_flight: Option<InFlight>,
    ) -> Self
    where
        S: Clone,
    {
        let (parts, body) = request;
        let state = match decide {
            // Called now: the service stays, for the next request to make ready again.
            Decide::Ready(ruling @ Ruling::Call(_)) => {
                enter(ruling, &snapshot, service, parts, body)
            }
            // Not called: what the ready service holds for a call (a concurrency limit's
            // permit, a buffer's slot) goes with it, and a fresh clone waits for the next
            // poll_ready, as after a call.
            Decide::Ready(ruling) => {
                let clone = service.clone();
                drop(std::mem::replace(service, clone));
                enter(ruling, &snapshot, service, parts, body)
            }
            Decide::Waiting(pending) => {
                // The ready service waits with this request; a fresh clone waits for the next
                // poll_ready.
                let clone = service.clone();
                State::Deciding {
                    driver: Driver::new(pending, engine.clone(), snapshot.clone(), span),
                    call: Some((std::mem::replace(service, clone), parts, body)),
                }
            }
        };
        ResponseFuture {
            state,
            snapshot,
            in_flight,
            engine,
        }
    }
}

/// The state that follows a ruling.
#[inline]
fn enter<S, ReqBody, D>(
    ruling: Ruling,
    snapshot: &Snapshot,
    service: &mut S,
    mut parts: Parts,
    body: ReqBody,
) -> State<S, ReqBody, S::Future, D, S::Response>
where
    S: Service<Request<ReqBody>>,
{
    match ruling {
        Ruling::Call(admitted) => {
            if let Some(meter) = &admitted.meter {
                // Behind another metered layer, the handler spends from both.
                let meter = match parts.extensions.get::<Meter>() {
                    Some(outer) => meter.within(outer),
                    None => meter.clone(),
                };
                parts.extensions.insert(meter);
            }
            State::Calling {
                future: service.call(Request::from_parts(parts, body)),
                admitted,
            }
        }
        Ruling::Answer { refusal, grpc } => State::Answered {
            response: Some(snapshot.answers.render(&refusal, grpc)),
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
            match this.state.as_mut().project() {
                StateProj::Deciding { driver, call } => {
                    let Some((_, parts, _)) = call.as_mut() else {
                        panic!("ResponseFuture polled after completion");
                    };
                    let ruling = ready!(driver.poll_decide(cx, parts));
                    let Some((mut service, parts, body)) = call.take() else {
                        panic!("ResponseFuture polled after completion");
                    };
                    this.state
                        .set(enter(ruling, this.snapshot, &mut service, parts, body));
                }
                StateProj::Calling { future, admitted } => {
                    // An error of the inner service drops the slots with this state.
                    let mut response = ready!(future.poll(cx))?;
                    let mut decision = admitted.decision.take();
                    let slots = admitted.slots.take();
                    let meter = admitted.meter.take();
                    let mut pending = None;
                    if let Some(settle) = admitted.settle.take() {
                        let answer = decision.as_mut().map(|d| (d, &admitted.applied[..]));
                        (response, pending) =
                            this.engine.settle(this.snapshot, &settle, response, answer);
                    }
                    let snapshot = &**this.snapshot;
                    for name in &snapshot.cost_headers {
                        response.headers_mut().remove(name);
                    }
                    if let Some(decision) = decision {
                        snapshot.answers.write_budget(
                            response.headers_mut(),
                            &admitted.applied,
                            &decision,
                        );
                    }
                    if let Some(future) = pending {
                        this.state.set(State::Settling {
                            future: Some(future),
                            origin: Origin::here(),
                            response: Some(response),
                            slots,
                            meter,
                        });
                        continue;
                    }
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(holding(response, slots, this.in_flight.take(), meter)));
                }
                StateProj::Settling {
                    future,
                    response,
                    slots,
                    meter,
                    ..
                } => {
                    if let Some(pending) = future {
                        report_settle(ready!(pending.as_mut().poll(cx)));
                        *future = None;
                    }
                    let response = response.take();
                    let slots = slots.take();
                    let meter = meter.take();
                    this.state.set(State::Done);
                    let Some(response) = response else {
                        panic!("ResponseFuture polled after completion");
                    };
                    return Poll::Ready(Ok(holding(response, slots, this.in_flight.take(), meter)));
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
            }
        }
    }
}

/// The inner service's response, its body holding the request's slots, its place among the
/// requests in flight and its meter until it ends.
fn holding<B>(
    response: Response<B>,
    slots: Option<Slots>,
    in_flight: Option<InFlight>,
    meter: Option<Meter>,
) -> Response<ResponseBody<B>> {
    let (mut parts, body) = response.into_parts();
    // A metered body may end early, or with one frame more: its length is not known.
    if meter.is_some() {
        parts.headers.remove(http::header::CONTENT_LENGTH);
    }
    let metered = meter.map(|meter| MeteredStream::new(meter, &parts.headers));
    // The inner service answers: the request's latency is the service's, worth learning from.
    let in_flight = in_flight.map(InFlight::served);
    Response::from_parts(
        parts,
        ResponseBody::holding(body, slots, in_flight, metered),
    )
}

/// Lets a settle whose request was dropped finish on the runtime it was started on (a store's
/// calls have their own time budget), wherever the request is dropped. With neither that
/// runtime nor a current one it is dropped, and said: the reserved units stay, as for a
/// response that never came.
fn finish_settle(future: StoreFuture<()>, origin: &Origin) {
    finish_detached(
        future,
        report_settle,
        "a request dropped outside a Tokio runtime while its charge was settled",
        origin,
    );
}
