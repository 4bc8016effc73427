//! [`ClientBody`]: an answer's body, its trailers read for a gRPC status that asks to wait.

use std::pin::Pin;
use std::task::{Context, Poll};

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::Watch;

pin_project! {
    /// The body of an answer through [`HonourLimitsLayer`](super::HonourLimitsLayer) or
    /// [`RetryAfterLayer`](super::RetryAfterLayer): the server's body, whose trailers (a gRPC
    /// call's status) are read for a request to wait.
    pub struct ClientBody<B> {
        #[pin]
        inner: B,
        watch: Option<Box<Watch>>,
    }
}

impl<B> ClientBody<B> {
    pub(crate) fn new(inner: B, watch: Option<Watch>) -> Self {
        ClientBody {
            inner,
            watch: watch.map(Box::new),
        }
    }

    /// The server's body.
    pub fn into_inner(self) -> B {
        self.inner
    }
}

impl<B: Body> Body for ClientBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let frame = this.inner.poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &frame
            && let Some(trailers) = frame.trailers_ref()
            && let Some(watch) = this.watch.take()
        {
            watch.trailers(trailers);
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
