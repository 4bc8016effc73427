//! [`ResponseBody`]: the body of a rate-limited service's responses, which holds the request's
//! concurrency slots, its place among the requests in flight and its meter until it ends, and
//! ends a metered stream whose budget is spent.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::engine::Slots;
use crate::shed::InFlight;

mod metered;

pub(crate) use metered::MeteredStream;
use metered::Next;

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
        // The budget a metered response streams from, and how it ends.
        metered: Option<MeteredStream>,
        // A metered stream ended at its budget: its last frame was sent.
        cut: bool,
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
            metered: None,
            cut: false,
        }
    }

    /// Wraps the inner service's body, holding the request's slots, its place among the
    /// requests in flight and its meter until it ends.
    pub(crate) fn holding(
        body: B,
        slots: Option<Slots>,
        in_flight: Option<InFlight>,
        metered: Option<MeteredStream>,
    ) -> Self {
        ResponseBody {
            kind: Kind::Inner { body },
            slots,
            in_flight,
            metered,
            cut: false,
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
            metered: None,
            cut: false,
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
            KindProj::Inner { mut body } => {
                if *this.cut {
                    return Poll::Ready(None);
                }
                let drain = match this.metered.as_mut().map(|m| m.next(cx)) {
                    None | Some(Next::Poll) => false,
                    Some(Next::Drain) => true,
                    Some(Next::Wait) => return Poll::Pending,
                    Some(Next::End(last)) => {
                        return Poll::Ready(end(
                            this.cut,
                            this.slots,
                            this.in_flight,
                            this.metered,
                            last,
                        ));
                    }
                };
                let frame = body.as_mut().poll_frame(cx);
                if drain {
                    // The budget is spent: frames its producer already made pass; its own
                    // trailers (a gRPC OK) give way to the refusal's.
                    if let Poll::Ready(Some(Ok(frame))) = frame
                        && frame.is_data()
                        && let Some(metered) = this.metered.as_mut()
                    {
                        metered.drained();
                        return Poll::Ready(Some(Ok(frame)));
                    }
                    let last = this.metered.as_ref().and_then(MeteredStream::last);
                    return Poll::Ready(end(
                        this.cut,
                        this.slots,
                        this.in_flight,
                        this.metered,
                        last,
                    ));
                }
                match frame {
                    Poll::Ready(Some(Ok(frame))) => {
                        let frame = match this.metered.as_mut() {
                            Some(metered) => metered.count(frame),
                            None => frame,
                        };
                        Poll::Ready(Some(Ok(frame)))
                    }
                    // The last frame, or an error that ends the body: the slots go back now.
                    Poll::Ready(None) => {
                        // A producer that stopped at its budget: the refusal is the last frame.
                        let last = this.metered.as_ref().and_then(MeteredStream::last);
                        match last {
                            Some(last) => Poll::Ready(end(
                                this.cut,
                                this.slots,
                                this.in_flight,
                                this.metered,
                                Some(last),
                            )),
                            None => {
                                this.slots.take();
                                this.in_flight.take();
                                this.metered.take();
                                Poll::Ready(None)
                            }
                        }
                    }
                    Poll::Ready(Some(Err(error))) => {
                        this.slots.take();
                        this.in_flight.take();
                        Poll::Ready(Some(Err(error)))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d.into())))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { .. } if self.cut => true,
            // A metered stream may still end with the refusal.
            Kind::Inner { body } => body.is_end_stream() && self.metered.is_none(),
            Kind::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            // A metered stream may end early, or with one frame more.
            Kind::Inner { .. } if self.metered.is_some() => SizeHint::default(),
            Kind::Inner { body } => body.size_hint(),
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

/// Ends the body: the slots, the place in flight and the meter go, and `last` (the refusal,
/// if the budget ended it) is its last frame.
fn end<D, E>(
    cut: &mut bool,
    slots: &mut Option<Slots>,
    in_flight: &mut Option<InFlight>,
    metered: &mut Option<MeteredStream>,
    last: Option<Frame<D>>,
) -> Option<Result<Frame<D>, E>> {
    *cut = true;
    slots.take();
    in_flight.take();
    metered.take();
    last.map(Ok)
}
