//! [`ResponseBody`]: the body of a rate-limited service's responses, which holds the request's
//! concurrency slots, its place among the requests in flight and its meter until it ends, and
//! ends a metered stream whose budget is spent.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

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
        // What a request of a concurrency rule or a metered one holds until its body ends
        // (dropped before the place in flight: the slots, then the meter). Boxed: most requests
        // hold nothing, and a response is moved several times on its way out (every layer's
        // future hands it on), each move a copy of the body's bytes.
        held: Option<Box<Held>>,
        // The request's place in the load shedder's count, given up with the last frame or an
        // error that ends the body (or when the body is dropped before either).
        in_flight: Option<InFlight>,
    }
}

/// What polling a body `B` for its next frame gives.
type NextFrame<B> = Poll<Option<Result<Frame<<B as Body>::Data>, <B as Body>::Error>>>;

/// What a response body holds until it ends, besides its place in flight.
struct Held {
    // The concurrency slots of the request, given back with the last frame (or when the
    // body is dropped before it).
    slots: Option<Slots>,
    // The budget a metered response streams from, and how it ends.
    metered: Option<MeteredStream>,
    // A metered stream ended at its budget: its last frame was sent.
    cut: bool,
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
            held: None,
            in_flight: None,
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
        let held = (slots.is_some() || metered.is_some()).then(|| {
            Box::new(Held {
                slots,
                metered,
                cut: false,
            })
        });
        ResponseBody {
            kind: Kind::Inner { body },
            held,
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
            held: None,
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
            KindProj::Inner { body } => match this.held.as_deref_mut() {
                None => {
                    let frame = ready!(body.poll_frame(cx));
                    // The last frame, or an error that ends the body: the place in flight goes.
                    if !matches!(frame, Some(Ok(_))) {
                        this.in_flight.take();
                    }
                    Poll::Ready(frame)
                }
                Some(held) => held.poll_frame(body, this.in_flight, cx),
            },
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d.into())))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => match &self.held {
                None => body.is_end_stream(),
                Some(held) if held.cut => true,
                // A metered stream may still end with the refusal.
                Some(held) => body.is_end_stream() && held.metered.is_none(),
            },
            Kind::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            // A metered stream may end early, or with one frame more.
            Kind::Inner { .. } if self.held.as_ref().is_some_and(|h| h.metered.is_some()) => {
                SizeHint::default()
            }
            Kind::Inner { body } => body.size_hint(),
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

impl Held {
    /// The next frame of `body`, which holds this: metered, and the slots and the place in
    /// flight given up when it ends.
    fn poll_frame<B>(
        &mut self,
        mut body: Pin<&mut B>,
        in_flight: &mut Option<InFlight>,
        cx: &mut Context<'_>,
    ) -> NextFrame<B>
    where
        B: Body,
        B::Data: From<Bytes>,
    {
        if self.cut {
            return Poll::Ready(None);
        }
        let drain = match self.metered.as_mut().map(|m| m.next(cx)) {
            None | Some(Next::Poll) => false,
            Some(Next::Drain) => true,
            Some(Next::Wait) => return Poll::Pending,
            Some(Next::End(last)) => return Poll::Ready(self.end(in_flight, last)),
        };
        let frame = body.as_mut().poll_frame(cx);
        if drain {
            // The budget is spent: frames its producer already made pass; its own trailers (a
            // gRPC OK) give way to the refusal's.
            if let Poll::Ready(Some(Ok(frame))) = frame
                && frame.is_data()
                && let Some(metered) = self.metered.as_mut()
            {
                metered.drained();
                return Poll::Ready(Some(Ok(frame)));
            }
            let last = self.metered.as_ref().and_then(MeteredStream::last);
            return Poll::Ready(self.end(in_flight, last));
        }
        match frame {
            Poll::Ready(Some(Ok(frame))) => {
                let frame = match self.metered.as_mut() {
                    Some(metered) => metered.count(frame),
                    None => frame,
                };
                Poll::Ready(Some(Ok(frame)))
            }
            // The last frame, or an error that ends the body: the slots go back now.
            Poll::Ready(None) => {
                // A producer that stopped at its budget: the refusal is the last frame.
                match self.metered.as_ref().and_then(MeteredStream::last) {
                    Some(last) => Poll::Ready(self.end(in_flight, Some(last))),
                    None => {
                        self.slots.take();
                        in_flight.take();
                        self.metered.take();
                        Poll::Ready(None)
                    }
                }
            }
            Poll::Ready(Some(Err(error))) => {
                self.slots.take();
                in_flight.take();
                Poll::Ready(Some(Err(error)))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    /// Ends the body: the slots, the place in flight and the meter go, and `last` (the
    /// refusal, if the budget ended it) is its last frame.
    fn end<D, E>(
        &mut self,
        in_flight: &mut Option<InFlight>,
        last: Option<Frame<D>>,
    ) -> Option<Result<Frame<D>, E>> {
        self.cut = true;
        self.slots.take();
        in_flight.take();
        self.metered.take();
        last.map(Ok)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A response's body is moved with the response several times on its way out: what a
    /// request holds until its body ends is boxed, so that the body is its inner body (or
    /// tollgate's bytes), the place in flight and two words (the box, and which body it is).
    #[test]
    fn a_body_that_holds_nothing_is_small() {
        type Inner = http_body_util::Full<Bytes>;
        let most = std::mem::size_of::<Inner>().max(std::mem::size_of::<Option<Bytes>>())
            + std::mem::size_of::<Option<InFlight>>()
            + 2 * std::mem::size_of::<usize>();
        assert!(
            std::mem::size_of::<ResponseBody<Inner>>() <= most,
            "{} bytes, more than {most}",
            std::mem::size_of::<ResponseBody<Inner>>()
        );
    }
}
