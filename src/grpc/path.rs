//! [`GrpcPathLayer`]: the call's path (`/package.Service/Method`) in its extensions, for
//! interceptors, which tonic hands no path.

use std::task::{Context, Poll};

use http::Request;
use tower_layer::Layer;
use tower_service::Service;

pub use crate::key::route::GrpcPath;

/// Records each request's path in its extensions as a [`GrpcPath`], so that a
/// [`RateLimitInterceptor`](super::RateLimitInterceptor) can limit per method. Put it on the
/// server once: `Server::builder().layer(GrpcPathLayer)`.
#[derive(Clone, Copy, Debug, Default)]
pub struct GrpcPathLayer;

impl<S> Layer<S> for GrpcPathLayer {
    type Service = GrpcPathService<S>;

    fn layer(&self, inner: S) -> GrpcPathService<S> {
        GrpcPathService { inner }
    }
}

/// The service of [`GrpcPathLayer`].
#[derive(Clone, Debug)]
pub struct GrpcPathService<S> {
    inner: S,
}

impl<S, B> Service<Request<B>> for GrpcPathService<S>
where
    S: Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        if let Some(path) = request.uri().path_and_query().cloned() {
            request.extensions_mut().insert(GrpcPath(path));
        }
        self.inner.call(request)
    }
}
