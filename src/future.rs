//! [`ResponseFuture`]: decide, then call the inner service or answer for it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{Request, Response, StatusCode};
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::decision::Decision;
use crate::layer::Shared;
use crate::policy::FailureMode;
use crate::response::{RateLimited, ResponseBody, problem_response, write_headers};
use crate::service::Applied;
use crate::store::{Store, StoreError};

type DeferredCheck = Pin<Box<dyn Future<Output = (Applied, Result<Decision, StoreError>)> + Send>>;

pin_project! {
    /// The response future of [`RateLimit`](crate::RateLimit).
    pub struct ResponseFuture<S, ReqBody, St>
    where
        S: Service<Request<ReqBody>>,
        St: Store,
    {
        #[pin]
        state: State<S::Future, St::Future>,
        call: Option<(S, Request<ReqBody>)>,
        applied: Applied,
        decision: Option<Decision>,
        shared: Arc<Shared<St>>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, C> {
        Checking { #[pin] check: C },
        Deferred { check: DeferredCheck },
        Calling { #[pin] future: F },
        Done,
    }
}

impl<S, ReqBody, St> ResponseFuture<S, ReqBody, St>
where
    S: Service<Request<ReqBody>>,
    St: Store,
{
    pub(crate) fn checking(
        check: St::Future,
        applied: Applied,
        service: S,
        request: Request<ReqBody>,
        shared: Arc<Shared<St>>,
    ) -> Self {
        ResponseFuture {
            state: State::Checking { check },
            call: Some((service, request)),
            applied,
            decision: None,
            shared,
        }
    }

    pub(crate) fn deferred(
        check: DeferredCheck,
        service: S,
        request: Request<ReqBody>,
        shared: Arc<Shared<St>>,
    ) -> Self {
        ResponseFuture {
            state: State::Deferred { check },
            call: Some((service, request)),
            applied: Applied::new(),
            decision: None,
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
            let result = match this.state.as_mut().project() {
                StateProj::Checking { check } => ready!(check.poll(cx)),
                StateProj::Deferred { check } => {
                    let (applied, result) = ready!(check.as_mut().poll(cx));
                    *this.applied = applied;
                    result
                }
                StateProj::Calling { future } => {
                    let mut response = ready!(future.poll(cx))?;
                    this.state.set(State::Done);
                    if let Some(decision) = this.decision.take() {
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
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            };
            let shared = &**this.shared;
            match result {
                Ok(decision) if decision.allowed() => *this.decision = Some(decision),
                Ok(decision) => {
                    this.state.set(State::Done);
                    this.call.take();
                    return Poll::Ready(Ok(denied(shared, this.applied, &decision)));
                }
                Err(error) => {
                    if !shared.warned_store_error.swap(true, Ordering::Relaxed) {
                        tracing::error!(%error, mode = ?shared.on_store_error, "tollgate: the rate-limit store failed; reported once");
                    } else {
                        tracing::debug!(%error, "tollgate: the rate-limit store failed");
                    }
                    if shared.on_store_error == FailureMode::Closed {
                        this.state.set(State::Done);
                        this.call.take();
                        return Poll::Ready(Ok(unavailable()));
                    }
                }
            }
            let Some((mut service, request)) = this.call.take() else {
                panic!("ResponseFuture polled after completion");
            };
            this.state.set(State::Calling {
                future: service.call(request),
            });
        }
    }
}

fn denied<St, B>(
    shared: &Shared<St>,
    applied: &[u16],
    decision: &Decision,
) -> Response<ResponseBody<B>> {
    let mut response = match &shared.on_denied {
        Some(handler) => handler(&RateLimited::new(&shared.rules, applied, decision)),
        None => problem_response(&shared.rules, applied, decision),
    };
    write_headers(
        response.headers_mut(),
        shared.headers,
        &shared.rules,
        &shared.policies,
        applied,
        decision,
    );
    response.map(ResponseBody::full)
}

fn unavailable<B>() -> Response<ResponseBody<B>> {
    let body = Bytes::from_static(
        b"{\"type\":\"about:blank\",\"title\":\"Service Unavailable\",\"status\":503,\"detail\":\"The rate limiter cannot decide right now; retry shortly.\"}",
    );
    let mut response = Response::new(ResponseBody::full(body));
    *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    let headers = response.headers_mut();
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    headers.insert(RETRY_AFTER, HeaderValue::from_static("1"));
    response
}
