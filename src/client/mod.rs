//! The client's half of the contract: honour what a server said about when to come back.
//!
//! ```
//! use http_body_util::Empty;
//! use tollgate::client::HonourLimitsLayer;
//! use tower::ServiceBuilder;
//!
//! # fn build<S>(inner: S) where S: tower::Service<http::Request<Empty<bytes::Bytes>>> {
//! // Any Tower HTTP client: hyper-util's, or a tonic `Channel`.
//! let client = ServiceBuilder::new()
//!     .layer(HonourLimitsLayer::new())
//!     .service(inner);
//! # let _ = client;
//! # }
//! ```
//!
//! [`HonourLimitsLayer`] reads every answer for a server's request to wait: `Retry-After` on a
//! 429 or a 503 (seconds, or an HTTP date), a `RateLimit` policy whose budget is spent (`r=0`
//! with a `t`, draft-ietf-httpapi-ratelimit-headers-11), and for gRPC `RESOURCE_EXHAUSTED` or
//! `UNAVAILABLE` with `grpc-retry-pushback-ms` or a `google.rpc.RetryInfo` (in a trailers-only
//! answer's head, or in the trailers). Until that time has passed, calls to the same server
//! (the request's authority) are not sent: they fail at once with [`Throttled`], which tells
//! the wait left. A tonic client sees `RESOURCE_EXHAUSTED` with the wait in its message. A
//! wait longer than [`MAX_ANNOUNCED_WAIT`] (a day) is capped to it.
//!
//! [`RetryAfterLayer`] waits instead of failing: a call the server asked to wait is retried
//! after the server's delay plus a random jitter (so that clients told the same delay do not
//! come back at the same instant), a few times at most, within a retry budget shared by the
//! layer's calls (so that retries cannot multiply the load). It needs requests whose body can
//! be cloned.
//!
//! Both work against any server that sends these fields, not only tollgate's.

mod body;
mod retry;
mod signals;

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

pub use body::ClientBody;
pub use retry::{Retry, RetryAfter, RetryAfterLayer};
pub use signals::MAX_ANNOUNCED_WAIT;
#[cfg(feature = "tonic")]
pub(crate) use signals::base64_decode;

/// The most servers whose waits a layer remembers; past it, those whose wait is over are
/// forgotten, then the soonest to end.
const MAX_SERVERS: usize = 1024;

/// The servers that asked to wait, by authority, and until when.
#[derive(Debug, Default)]
pub(crate) struct Waits {
    until: Mutex<HashMap<Box<str>, Instant>>,
}

impl Waits {
    /// The wait left for `server`, if any.
    pub(crate) fn left(&self, server: &str) -> Option<Duration> {
        let until = self.until.lock().unwrap_or_else(|e| e.into_inner());
        let left = until.get(server)?.checked_duration_since(Instant::now())?;
        (!left.is_zero()).then_some(left)
    }

    /// `server` asked to wait `wait` from now (a shorter wait than one known does not shorten
    /// it).
    pub(crate) fn learn(&self, server: &str, wait: Duration) {
        if wait.is_zero() {
            return;
        }
        let now = Instant::now();
        let end = now + wait;
        let mut until = self.until.lock().unwrap_or_else(|e| e.into_inner());
        if until.len() >= MAX_SERVERS && !until.contains_key(server) {
            until.retain(|_, end| *end > now);
            if until.len() >= MAX_SERVERS
                && let Some(soonest) = until
                    .iter()
                    .min_by_key(|(_, end)| **end)
                    .map(|(k, _)| k.clone())
            {
                until.remove(&soonest);
            }
        }
        let known = until.entry(server.into()).or_insert(end);
        *known = (*known).max(end);
    }
}

/// The server a request goes to: its authority (`""` for a request with a path only, as a
/// tonic `Channel`'s are: one channel, one server; so give each channel a layer of its own).
pub(crate) fn server_of<B>(request: &Request<B>) -> &str {
    request.uri().authority().map_or("", |a| a.as_str())
}

/// The request's authority, to remember it by (a shared handle: no copy of the text).
pub(crate) fn authority_of<B>(request: &Request<B>) -> Option<http::uri::Authority> {
    request.uri().authority().cloned()
}

/// Whether a request is a gRPC call.
fn is_grpc<B>(request: &Request<B>) -> bool {
    crate::response::is_grpc(request.headers())
}

/// A call not sent: the server asked to wait, and the wait is not over.
#[derive(Debug)]
pub struct Throttled {
    wait: Duration,
    /// For a gRPC call: the status a tonic client reads from this error's source.
    #[cfg(feature = "tonic")]
    status: Option<tonic::Status>,
}

impl Throttled {
    pub(crate) fn new(wait: Duration, grpc: bool) -> Self {
        #[cfg(not(feature = "tonic"))]
        let _ = grpc;
        Throttled {
            wait,
            #[cfg(feature = "tonic")]
            status: grpc.then(|| {
                tonic::Status::resource_exhausted(format!(
                    "not sent: the server asked to wait {} ms more",
                    wait.as_millis()
                ))
            }),
        }
    }

    /// How long the server's wait has left.
    pub fn wait(&self) -> Duration {
        self.wait
    }
}

impl fmt::Display for Throttled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "not sent: the server asked to wait, {} ms more",
            self.wait.as_millis()
        )
    }
}

impl std::error::Error for Throttled {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        #[cfg(feature = "tonic")]
        if let Some(status) = &self.status {
            return Some(status);
        }
        None
    }
}

/// The error of a client behind [`HonourLimitsLayer`] or [`RetryAfterLayer`]: a call not sent,
/// or the inner client's error.
#[derive(Debug)]
pub enum ClientError<E> {
    /// Not sent: the server asked to wait.
    Throttled(Throttled),
    /// The inner client failed.
    Inner(E),
}

impl<E: fmt::Display> fmt::Display for ClientError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientError::Throttled(throttled) => throttled.fmt(f),
            ClientError::Inner(error) => error.fmt(f),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for ClientError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            // A tonic client finds its Status one step further, in the Throttled's source.
            ClientError::Throttled(throttled) => Some(throttled),
            ClientError::Inner(error) => Some(error),
        }
    }
}

/// Fails calls at once while their server has asked to wait; learns the waits from the
/// answers (see the [module](crate::client)).
#[derive(Clone, Debug, Default)]
pub struct HonourLimitsLayer {
    waits: Arc<Waits>,
}

impl HonourLimitsLayer {
    /// A layer with waits of its own: the services it makes share them.
    pub fn new() -> Self {
        HonourLimitsLayer::default()
    }
}

impl<S> Layer<S> for HonourLimitsLayer {
    type Service = HonourLimits<S>;

    fn layer(&self, inner: S) -> HonourLimits<S> {
        HonourLimits {
            inner,
            waits: self.waits.clone(),
        }
    }
}

/// The service of [`HonourLimitsLayer`].
#[derive(Clone, Debug)]
pub struct HonourLimits<S> {
    inner: S,
    waits: Arc<Waits>,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for HonourLimits<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Response = Response<ClientBody<ResBody>>;
    type Error = ClientError<S::Error>;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(ClientError::Inner)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let server = server_of(&request);
        if let Some(wait) = self.waits.left(server) {
            return ResponseFuture {
                state: State::Throttled {
                    throttled: Some(Throttled::new(wait, is_grpc(&request))),
                },
            };
        }
        let watch = Watch {
            waits: self.waits.clone(),
            server: authority_of(&request),
        };
        ResponseFuture {
            state: State::Sent {
                future: self.inner.call(request),
                watch: Some(watch),
            },
        }
    }
}

/// Where an answer's wait is recorded: the layer's waits, for the request's server.
pub(crate) struct Watch {
    pub(crate) waits: Arc<Waits>,
    pub(crate) server: Option<http::uri::Authority>,
}

impl Watch {
    /// Notes that the request's server asked to wait `wait` from now.
    pub(crate) fn learn(&self, wait: Duration) {
        let server = self.server.as_ref().map_or("", |a| a.as_str());
        self.waits.learn(server, wait);
    }

    /// Reads the answer's head; a gRPC answer's body is watched for the trailers.
    pub(crate) fn answer<B>(self, response: Response<B>) -> Response<ClientBody<B>> {
        let wait = signals::wait_of_head(response.status(), response.headers());
        self.answered(response, wait)
    }

    /// [`answer`](Self::answer), the wait of the answer's head read already.
    pub(crate) fn answered<B>(
        self,
        response: Response<B>,
        wait: Option<Duration>,
    ) -> Response<ClientBody<B>> {
        if let Some(wait) = wait {
            self.learn(wait);
        }
        let grpc = crate::response::is_grpc(response.headers());
        response.map(|body| ClientBody::new(body, grpc.then_some(self)))
    }
}

pin_project! {
    /// The response future of [`HonourLimits`].
    pub struct ResponseFuture<F> {
        #[pin]
        state: State<F>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F> {
        Throttled { throttled: Option<Throttled> },
        Sent { #[pin] future: F, watch: Option<Watch> },
    }
}

impl<F, B, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ClientBody<B>>, ClientError<E>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Throttled { throttled } => Poll::Ready(Err(ClientError::Throttled(
                throttled
                    .take()
                    .expect("ResponseFuture polled after completion"),
            ))),
            StateProj::Sent { future, watch } => {
                let response = ready!(future.poll(cx)).map_err(ClientError::Inner)?;
                let watch = watch
                    .take()
                    .expect("ResponseFuture polled after completion");
                Poll::Ready(Ok(watch.answer(response)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_are_per_server_never_shortened_and_bounded() {
        let waits = Waits::default();
        waits.learn("a:1", Duration::from_secs(10));
        waits.learn("a:1", Duration::from_secs(1));
        assert!(waits.left("a:1").unwrap() > Duration::from_secs(9));
        assert_eq!(waits.left("b:1"), None);
        for n in 0..MAX_SERVERS + 10 {
            waits.learn(&format!("s{n}"), Duration::from_secs(60));
        }
        assert!(waits.until.lock().unwrap().len() <= MAX_SERVERS);
    }
}
