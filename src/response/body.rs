use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// The body of a rate-limited service's responses: the inner service's body, or tollgate's
    /// own (the 429 problem document).
    ///
    /// Works with any inner body whose data chunks can be made from [`Bytes`]: axum's and tonic's
    /// bodies, `Full<Bytes>`, `String` bodies…
    #[project = ResponseBodyProj]
    pub enum ResponseBody<B> {
        /// The inner service's body, untouched.
        Inner {
            /// The inner body.
            #[pin]
            body: B,
        },
        /// A body tollgate wrote.
        Full {
            /// What is left to send.
            data: Option<Bytes>,
        },
    }
}

impl<B> ResponseBody<B> {
    /// Wraps the inner service's body.
    pub fn inner(body: B) -> Self {
        ResponseBody::Inner { body }
    }

    /// A body of these bytes.
    pub fn full(data: impl Into<Bytes>) -> Self {
        let data = data.into();
        ResponseBody::Full {
            data: (!data.is_empty()).then_some(data),
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body,
    B::Data: From<Bytes>,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match self.project() {
            ResponseBodyProj::Inner { body } => body.poll_frame(cx),
            ResponseBodyProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d.into())))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Inner { body } => body.is_end_stream(),
            ResponseBody::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Inner { body } => body.size_hint(),
            ResponseBody::Full { data } => SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64)),
        }
    }
}
