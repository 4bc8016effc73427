//! The body handed on: the frames the layer read, then the rest of the original body.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body as HttpBody, Frame, SizeHint};

/// How reading a body ended.
pub(super) enum End {
    Complete,
    TooLarge,
    Failed(axum::Error),
}

/// What was read of a body.
#[derive(Default)]
pub(super) struct BodyRead {
    pub(super) chunks: VecDeque<Bytes>,
    pub(super) len: usize,
    pub(super) trailers: Option<HeaderMap>,
}

impl BodyRead {
    pub(super) fn replay(self, rest: Option<Body>, error: Option<axum::Error>) -> Replay {
        Replay {
            chunks: self.chunks,
            len: self.len as u64,
            trailers: self.trailers,
            error,
            rest,
        }
    }
}

/// The frames read, then the rest of the original body.
pub(super) struct Replay {
    chunks: VecDeque<Bytes>,
    len: u64,
    trailers: Option<HeaderMap>,
    error: Option<axum::Error>,
    rest: Option<Body>,
}

impl HttpBody for Replay {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        if let Some(chunk) = this.chunks.pop_front() {
            this.len -= chunk.len() as u64;
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        if let Some(error) = this.error.take() {
            return Poll::Ready(Some(Err(error)));
        }
        if let Some(rest) = &mut this.rest {
            return Pin::new(rest).poll_frame(cx);
        }
        Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_empty()
            && self.error.is_none()
            && self.trailers.is_none()
            && self.rest.as_ref().is_none_or(HttpBody::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let rest = self
            .rest
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), HttpBody::size_hint);
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower().saturating_add(self.len));
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(self.len));
        }
        hint
    }
}
