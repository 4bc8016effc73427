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
        // The concurrency slots of the request (one word: they are boxed), given back with the
        // last frame or an error that ends the body (or when the body is dropped before either).
        slots: Option<Slots>,
        // The request's place in the load shedder's count, given up at the same time.
        in_flight: Option<InFlight>,
        // A metered response's stream. Boxed: most responses are not metered, and a response
        // is moved several times on its way out (every layer's future hands it on), each move a
        // copy of the body's bytes.
        metering: Option<Box<Metering>>,
    }
}

/// What polling a body `B` for its next frame gives.
type NextFrame<B> = Poll<Option<Result<Frame<<B as Body>::Data>, <B as Body>::Error>>>;

/// The budget a metered response streams from, and how it ends.
struct Metering {
    // Taken when the body ends.
    stream: Option<MeteredStream>,
    // The stream ended at its budget: its last frame was sent.
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
            slots: None,
            in_flight: None,
            metering: None,
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
            metering: metered.map(|stream| {
                Box::new(Metering {
                    stream: Some(stream),
                    cut: false,
                })
            }),
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
            metering: None,
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
            KindProj::Inner { body } => match this.metering.as_deref_mut() {
                None => {
                    let frame = ready!(body.poll_frame(cx));
                    // The last frame, or an error that ends the body: the slots go back now.
                    if !matches!(frame, Some(Ok(_))) {
                        this.slots.take();
                        this.in_flight.take();
                    }
                    Poll::Ready(frame)
                }
                Some(metering) => metering.poll_frame(body, this.slots, this.in_flight, cx),
            },
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d.into())))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => match &self.metering {
                None => body.is_end_stream(),
                Some(metering) if metering.cut => true,
                // A metered stream may still end with the refusal.
                Some(metering) => body.is_end_stream() && metering.stream.is_none(),
            },
            Kind::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            // A metered stream may end early, or with one frame more.
            Kind::Inner { .. } if self.metering.as_ref().is_some_and(|m| m.stream.is_some()) => {
                SizeHint::default()
            }
            Kind::Inner { body } => body.size_hint(),
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

impl Metering {
    /// The next frame of `body`, metered: the slots and the place in flight are given up when
    /// it ends.
    fn poll_frame<B>(
        &mut self,
        mut body: Pin<&mut B>,
        slots: &mut Option<Slots>,
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
        let drain = match self.stream.as_mut().map(|m| m.next(cx)) {
            None | Some(Next::Poll) => false,
            Some(Next::Drain) => true,
            Some(Next::Wait) => return Poll::Pending,
            Some(Next::End(last)) => return Poll::Ready(self.end(slots, in_flight, last)),
        };
        let frame = body.as_mut().poll_frame(cx);
        if drain {
            // The budget is spent: frames its producer already made pass; its own trailers (a
            // gRPC OK) give way to the refusal's.
            if let Poll::Ready(Some(Ok(frame))) = frame
                && frame.is_data()
                && let Some(stream) = self.stream.as_mut()
            {
                stream.drained();
                return Poll::Ready(Some(Ok(frame)));
            }
            let last = self.stream.as_ref().and_then(MeteredStream::last);
            return Poll::Ready(self.end(slots, in_flight, last));
        }
        match frame {
            Poll::Ready(Some(Ok(frame))) => {
                let frame = match self.stream.as_mut() {
                    Some(stream) => stream.count(frame),
                    None => frame,
                };
                Poll::Ready(Some(Ok(frame)))
            }
            // The last frame, or an error that ends the body: the slots go back now.
            Poll::Ready(None) => {
                // A producer that stopped at its budget: the refusal is the last frame.
                match self.stream.as_ref().and_then(MeteredStream::last) {
                    Some(last) => Poll::Ready(self.end(slots, in_flight, Some(last))),
                    None => {
                        slots.take();
                        in_flight.take();
                        self.stream.take();
                        Poll::Ready(None)
                    }
                }
            }
            Poll::Ready(Some(Err(error))) => {
                slots.take();
                in_flight.take();
                Poll::Ready(Some(Err(error)))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    /// Ends the body: the slots, the place in flight and the stream go, and `last` (the
    /// refusal, if the budget ended it) is its last frame.
    fn end<D, E>(
        &mut self,
        slots: &mut Option<Slots>,
        in_flight: &mut Option<InFlight>,
        last: Option<Frame<D>>,
    ) -> Option<Result<Frame<D>, E>> {
        self.cut = true;
        slots.take();
        in_flight.take();
        self.stream.take();
        last.map(Ok)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A response's body is moved with the response several times on its way out: the slots
    /// and a metered stream are boxed, so that the body is its inner body (or tollgate's
    /// bytes), the place in flight and three words (the slots, the stream, which body it is).
    #[test]
    fn a_body_is_small() {
        type Inner = http_body_util::Full<Bytes>;
        let most = std::mem::size_of::<Inner>().max(std::mem::size_of::<Option<Bytes>>())
            + std::mem::size_of::<Option<InFlight>>()
            + 3 * std::mem::size_of::<usize>();
        assert!(
            std::mem::size_of::<ResponseBody<Inner>>() <= most,
            "{} bytes, more than {most}",
            std::mem::size_of::<ResponseBody<Inner>>()
        );
    }
}
