//! [`ResponseBody`]: the body of a rate-limited service's responses, which holds the request's
//! concurrency slots and its place among the requests in flight until it ends.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::engine::Slots;
use crate::shed::InFlight;

pin_project! {
    /// The body of a rate-limited service's responses: the inner service's body, or tollgate's
    /// own (the 429 problem document).
    ///
    /// Works with any inner body whose data chunks can be made from [`Bytes`]: axum's and tonic's
    /// bodies, `Full<Bytes>`, `String` bodies…
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
        // The concurrency slots of the request, given back with the last frame (or when the
        // body is dropped before it).
        slots: Option<Slots>,
        // The request's place in the load shedder's count, given up at the same time.
        in_flight: Option<InFlight>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Full { data: Option<Bytes> },
    }
}

impl<B> ResponseBody<B> {
    /// Wraps the inner service's body.
    pub fn inner(body: B) -> Self {
        ResponseBody {
            kind: Kind::Inner { body },
            slots: None,
            in_flight: None,
        }
    }

    /// Wraps the inner service's body, holding the request's slots and its place among the
    /// requests in flight until it ends.
    pub(crate) fn holding(body: B, slots: Option<Slots>, in_flight: Option<InFlight>) -> Self {
        ResponseBody {
            kind: Kind::Inner { body },
            slots,
            in_flight,
        }
    }

    /// A body of these bytes.
    pub fn full(data: impl Into<Bytes>) -> Self {
        let data = data.into();
        ResponseBody {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
            },
            slots: None,
            in_flight: None,
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
        let this = self.project();
        match this.kind.project() {
            KindProj::Inner { body } => {
                let frame = body.poll_frame(cx);
                // The last frame, or an error that ends the body: the slots go back now.
                if matches!(frame, Poll::Ready(None | Some(Err(_)))) {
                    this.slots.take();
                    this.in_flight.take();
                }
                frame
            }
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d.into())))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}
