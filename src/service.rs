//! [`RateLimit`]: the service that checks every request before the inner service sees it.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use crate::body::ResponseBody;
use crate::engine::Engine;
use crate::future::ResponseFuture;
use crate::store::{MemoryStore, Store};

/// The rate-limiting service made by [`RateLimitLayer`](crate::RateLimitLayer): it checks every
/// request before the inner service sees it.
///
/// The inner service is called only after every rule admitted the request; its error type is
/// kept as it is, so no `HandleErrorLayer` is needed.
///
/// ```
/// use std::convert::Infallible;
/// use http::{Request, Response, StatusCode};
/// use tollgate::key::Global;
/// use tollgate::{Quota, RateLimitLayer, Rule};
/// use tower::{Layer, Service, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let layer = RateLimitLayer::builder().rule(Rule::new("one", Quota::per_hour(1)).key(Global)).build().unwrap();
/// let inner = service_fn(|_req: Request<String>| async {
///     Ok::<_, Infallible>(Response::new(String::from("served")))
/// });
/// let mut service = layer.layer(inner);
/// let first = service.ready().await.unwrap().call(Request::new(String::new())).await.unwrap();
/// assert_eq!(first.status(), StatusCode::OK);
/// let second = service.ready().await.unwrap().call(Request::new(String::new())).await.unwrap();
/// assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
/// # }
/// ```
pub struct RateLimit<S, St = MemoryStore> {
    inner: S,
    engine: Arc<Engine<St>>,
}

impl<S, St> RateLimit<S, St> {
    pub(crate) fn new(inner: S, engine: Arc<Engine<St>>) -> Self {
        RateLimit { inner, engine }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// On one generated tonic service (`layer.layer(MyServiceServer::new(service))`), the limited
/// service keeps its name, so `Server::builder().add_service` routes to it.
#[cfg(feature = "tonic")]
impl<S: tonic::server::NamedService, St> tonic::server::NamedService for RateLimit<S, St> {
    const NAME: &'static str = S::NAME;
}

impl<S: Clone, St> Clone for RateLimit<S, St> {
    fn clone(&self) -> Self {
        RateLimit {
            inner: self.inner.clone(),
            engine: self.engine.clone(),
        }
    }
}

impl<S: fmt::Debug, St> fmt::Debug for RateLimit<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S, St>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    St: Store,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody, St>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let (mut parts, body) = request.into_parts();
        let span = crate::observe::span();
        // Load shedding comes first: a busy process spends nothing on what it sheds.
        let mut in_flight = None;
        let (snapshot, decide) = match self.engine.shedder.as_ref().map(|s| s.enter(&parts)) {
            Some(Err((priority, share))) => self.engine.shed(&parts, &span, priority, share),
            entered => {
                in_flight = entered.and_then(Result::ok);
                self.engine.decide(&mut parts, &span)
            }
        };
        ResponseFuture::new(
            decide,
            snapshot,
            span,
            &mut self.inner,
            (parts, body),
            self.engine.clone(),
            in_flight,
        )
    }
}
