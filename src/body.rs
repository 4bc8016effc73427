//! [`ResponseBody`]: the body of a rate-limited service's responses, which holds the request's
//! concurrency slots, its place among the requests in flight and its meter until it ends, and
//! ends a metered stream whose budget is spent.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use http::HeaderMap;
use http::header::CONTENT_TYPE;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::engine::{Meter, Slots};
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
        // The budget a metered response streams from, and the form its end takes.
        meter: Option<(Meter, StreamForm)>,
        // A metered stream ended at its budget: its last frame was sent.
        cut: bool,
        // Frames passed on after the budget was spent (already made by the producer).
        drained: u8,
    }
}

/// The most frames a metered stream passes on once its budget is spent: those its producer
/// made before it was told.
const MAX_DRAIN: u8 = 64;

/// How a metered response is ended when its budget is spent, from its `content-type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StreamForm {
    /// Server-sent events: a final `error` event with the problem document.
    Events,
    /// gRPC: trailers with the refused call's status.
    Grpc,
    /// Anything else: trailers with the budget fields.
    Other,
}

impl StreamForm {
    pub(crate) fn of(headers: &HeaderMap) -> StreamForm {
        let content_type = headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let essence = content_type
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        if essence == "text/event-stream" {
            StreamForm::Events
        } else if essence == "application/grpc" || essence.starts_with("application/grpc+") {
            StreamForm::Grpc
        } else {
            StreamForm::Other
        }
    }
}

/// The last frame of a metered response whose budget `meter` ended, in `form`.
fn last_frame<D: From<Bytes>>(meter: &Meter, form: StreamForm) -> Option<Frame<D>> {
    let refusal = meter.exhausted()?;
    let answers = &meter.snapshot().answers;
    let answer = answers.render(&refusal, form == StreamForm::Grpc);
    Some(match form {
        StreamForm::Events => {
            let problem = answer.body();
            let mut event = BytesMut::with_capacity(problem.len() + 32);
            event.put_slice(b"event: error\ndata: ");
            // A problem document is one line of JSON; a data field ends at a line break.
            event.extend(
                problem
                    .iter()
                    .map(|&b| if b == b'\n' || b == b'\r' { b' ' } else { b }),
            );
            event.put_slice(b"\n\n");
            Frame::data(event.freeze().into())
        }
        StreamForm::Grpc | StreamForm::Other => {
            let mut trailers = answer.into_parts().0.headers;
            trailers.remove(CONTENT_TYPE);
            Frame::trailers(trailers)
        }
    })
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
            meter: None,
            cut: false,
            drained: 0,
        }
    }

    /// Wraps the inner service's body, holding the request's slots, its place among the
    /// requests in flight and its meter until it ends.
    pub(crate) fn holding(
        body: B,
        slots: Option<Slots>,
        in_flight: Option<InFlight>,
        meter: Option<(Meter, StreamForm)>,
    ) -> Self {
        ResponseBody {
            kind: Kind::Inner { body },
            slots,
            in_flight,
            meter,
            cut: false,
            drained: 0,
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
            meter: None,
            cut: false,
            drained: 0,
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
                // A metered stream whose budget is spent ends with the refusal, once the frames
                // its producer already made are out (at most `MAX_DRAIN`: one that ignores the
                // refusal is cut all the same).
                if let Some((meter, form)) = this.meter.as_ref()
                    && meter.poll_exhausted(cx).is_ready()
                {
                    if *this.drained < MAX_DRAIN
                        && let Poll::Ready(Some(Ok(frame))) = body.as_mut().poll_frame(cx)
                        && frame.is_data()
                    {
                        *this.drained += 1;
                        return Poll::Ready(Some(Ok(frame)));
                    }
                    // The inner body's own trailers (a gRPC OK) give way to the refusal's.
                    let last = last_frame(meter, *form);
                    *this.cut = true;
                    this.slots.take();
                    this.in_flight.take();
                    this.meter.take();
                    return Poll::Ready(last.map(Ok));
                }
                let frame = body.poll_frame(cx);
                // The last frame, or an error that ends the body: the slots go back now.
                if matches!(frame, Poll::Ready(None | Some(Err(_)))) {
                    this.slots.take();
                    this.in_flight.take();
                    // A producer that stopped at its budget: the refusal is the last frame.
                    if let (Poll::Ready(None), Some((meter, form))) = (&frame, this.meter.take())
                        && let Some(last) = last_frame(&meter, form)
                    {
                        *this.cut = true;
                        return Poll::Ready(Some(Ok(last)));
                    }
                }
                frame
            }
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d.into())))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { .. } if self.cut => true,
            // A metered stream may still end with the refusal.
            Kind::Inner { body } => body.is_end_stream() && self.meter.is_none(),
            Kind::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            // A metered stream may end early, or with one frame more.
            Kind::Inner { .. } if self.meter.is_some() => SizeHint::default(),
            Kind::Inner { body } => body.size_hint(),
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}
