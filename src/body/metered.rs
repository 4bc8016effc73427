//! [`MeteredStream`]: what a metered response's body keeps — its meter, the form its end
//! takes, frames counted as they pass, a usage trailer read — and the frames that end it.

use std::sync::Mutex;
use std::task::Context;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderName};
use http_body::Frame;

use crate::engine::{Meter, SpendFuture};
use crate::policy::metering::FrameUnits;
use crate::wire::is_grpc;

/// The most frames a metered stream passes on once its budget is spent: those its producer
/// made before it was told (the bound `Meter`'s and `Rule::meter`'s docs state: 64).
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
        let events = headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("text/event-stream"));
        if events {
            StreamForm::Events
        } else if is_grpc(headers) {
            StreamForm::Grpc
        } else {
            StreamForm::Other
        }
    }
}

/// A metered response's body state.
pub(crate) struct MeteredStream {
    meter: Meter,
    form: StreamForm,
    /// How each data frame counts, when the layer counts them.
    frames: Option<FrameUnits>,
    /// The trailer holding the response's usage, when it has one.
    usage: Option<HeaderName>,
    /// The next chunk, asked for by a frame that went past the units held: no frame passes
    /// until it is known. (In a mutex only so that the body stays `Sync`.)
    fetch: Option<Mutex<SpendFuture>>,
    /// Frames passed on after the budget was spent.
    drained: u8,
}

/// What the body does next, before it polls its inner body.
pub(crate) enum Next<D> {
    /// Poll the inner body.
    Poll,
    /// Poll the inner body for a frame its producer already made (the budget is spent): pass
    /// a data frame on, else end with [`MeteredStream::last`].
    Drain,
    /// Wait: the next chunk is not known yet.
    Wait,
    /// End the body with this frame (the refusal), or with nothing.
    End(Option<Frame<D>>),
}

impl MeteredStream {
    pub(crate) fn new(meter: Meter, headers: &HeaderMap) -> MeteredStream {
        MeteredStream {
            form: StreamForm::of(headers),
            frames: meter.frame_units(),
            usage: meter.usage_trailer(),
            meter,
            fetch: None,
            drained: 0,
        }
    }

    /// What to do before the inner body is polled.
    pub(crate) fn next<D: From<Bytes>>(&mut self, cx: &mut Context<'_>) -> Next<D> {
        if let Some(fetch) = &mut self.fetch {
            let fetch = fetch.get_mut().unwrap_or_else(|p| p.into_inner());
            if fetch.as_mut().poll(cx).is_pending() {
                return Next::Wait;
            }
            self.fetch = None;
        }
        if self.meter.poll_exhausted(cx).is_pending() {
            return Next::Poll;
        }
        // Frames the layer counts were paid as they passed: none is held back to drain.
        if self.frames.is_none() && self.drained < MAX_DRAIN {
            return Next::Drain;
        }
        Next::End(self.last())
    }

    /// A frame drained after the budget was spent.
    pub(crate) fn drained(&mut self) {
        self.drained += 1;
    }

    /// Counts a frame the inner body gave, before it is passed on: a data frame's units when
    /// the layer counts them (the next chunk fetched when they go past what is held), a usage
    /// trailer read (and removed).
    pub(crate) fn count<D: Buf + From<Bytes>>(&mut self, frame: Frame<D>) -> Frame<D> {
        let frame = match (&self.frames, frame.into_data()) {
            (Some(units), Ok(mut data)) => {
                // One slice to count (no copy for `Bytes`, the usual data).
                let bytes = data.copy_to_bytes(data.remaining());
                if let Some(fetch) = self.meter.count_frame(units(&bytes)) {
                    self.fetch = Some(Mutex::new(fetch));
                }
                return Frame::data(D::from(bytes));
            }
            (_, Ok(data)) => return Frame::data(data),
            (_, Err(frame)) => frame,
        };
        let mut frame = frame;
        if let (Some(name), Some(trailers)) = (&self.usage, frame.trailers_mut())
            && let Some(value) = trailers.remove(name)
        {
            match value
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
            {
                Some(total) => self.meter.settle_to(total),
                None => tracing::warn!(
                    trailer = %name,
                    "tollgate: a usage trailer that is not a number; the units spent or the chunks \
                     taken, the more, are charged"
                ),
            }
        }
        frame
    }

    /// The last frame of a metered response whose budget ended: the refusal, in its form.
    pub(crate) fn last<D: From<Bytes>>(&self) -> Option<Frame<D>> {
        let refusal = self.meter.exhausted()?;
        let answers = &self.meter.snapshot().answers;
        let answer = answers.render(&refusal, self.form == StreamForm::Grpc);
        Some(match self.form {
            StreamForm::Events => {
                // The head went out with the 200: the event carries the `Retry-After` seconds,
                // as a `retry-after` member of the problem and as the event stream's `retry`
                // field (in milliseconds, the reconnection time of an `EventSource`).
                let retry_after = answer
                    .headers()
                    .get(RETRY_AFTER)
                    .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
                let problem = answer.body();
                // The member goes in before the document's closing brace.
                let close = problem
                    .iter()
                    .rposition(|&b| b == b'}')
                    .filter(|_| retry_after.is_some());
                let (head, tail) = problem.split_at(close.unwrap_or(problem.len()));
                let mut event = BytesMut::with_capacity(problem.len() + 80);
                event.put_slice(b"event: error\ndata: ");
                // A problem document is one line of JSON; a data field ends at a line break.
                let one_line = |b: &u8| if *b == b'\n' || *b == b'\r' { b' ' } else { *b };
                event.extend(head.iter().map(one_line));
                if let (Some(seconds), Some(_)) = (retry_after, close) {
                    event.put_slice(format!(",\"retry-after\":{seconds}").as_bytes());
                }
                event.extend(tail.iter().map(one_line));
                if let Some(seconds) = retry_after {
                    event.put_slice(
                        format!("\nretry: {}", seconds.saturating_mul(1_000)).as_bytes(),
                    );
                }
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
}
