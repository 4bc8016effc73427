//! [`PerMessageLayer`]: a layer's rules charged for each message of a client or bidirectional
//! stream, not once per call.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::request::Parts;
use http::{HeaderMap, Request, Response};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use crate::RateLimitLayer;
use crate::engine::{Decide, Driver, Engine, Ruling, Use};
use crate::observe::Head;
use crate::policy::snapshot::Snapshot;
use crate::store::{MemoryStore, Store};

/// The most bytes of one message held while it waits for its check (tonic's default largest
/// message): a longer one is checked when its length prefix arrives, then passed on as it
/// comes, unheld (and refused by the server's decoder unless it takes such messages).
const MAX_HELD_MESSAGE: usize = 4 * 1024 * 1024;

impl<St> RateLimitLayer<St> {
    /// The layer's rules charged per message of each call's request stream (see
    /// [`PerMessageLayer`]), on the same store and budgets.
    ///
    /// Rules that act after the response (concurrency limits, charges by outcome, settled
    /// costs) mean nothing per message: they are refused, now and by every reload of the
    /// layer's policy from then on (the policy in force stays, and the error says why).
    pub fn per_message(&self) -> Result<PerMessageLayer<St>, crate::ConfigError> {
        self.engine().adopt(Use::PerMessage)?;
        Ok(PerMessageLayer {
            engine: self.engine().clone(),
        })
    }
}

/// A layer's rules charged for each message a gRPC client sends, one check per message (its
/// rules' cost each), none when the call opens: for client streams and bidirectional streams,
/// on a server (`Server::builder().layer(..)`) or on one service (`layer.layer(service)`).
///
/// A message is checked once it has fully arrived, before the service sees it (one longer than
/// 4 MiB, when its length prefix has). When one is refused, the service gets every message
/// accepted before it (none is cut in two), then the stream fails with the layer's answer as
/// its error: `RESOURCE_EXHAUSTED` with a `RetryInfo` and `grpc-retry-pushback-ms` (or
/// `PERMISSION_DENIED` for the deny list, `UNAVAILABLE` when the store fails closed). A
/// service that passes the error on (`stream.message().await?`) ends the call with it; one
/// that ends as if its client were done has its status replaced by it. Requests that are not
/// gRPC pass through unchecked. Metrics and events count each message as a request.
///
/// ```
/// use tollgate::{Quota, RateLimitLayer, Rule};
///
/// # fn main() -> Result<(), tollgate::ConfigError> {
/// // 100 messages a minute per peer, over all its streams.
/// let messages = RateLimitLayer::builder()
///     .rule(Rule::new("messages", Quota::per_minute(100)))
///     .build()?
///     .per_message()?;
/// let (_reporter, health) = tonic_health::server::health_reporter();
/// let _router = tonic::transport::Server::builder().layer(messages).add_service(health);
/// # Ok(())
/// # }
/// ```
pub struct PerMessageLayer<St = MemoryStore> {
    engine: Arc<Engine<St>>,
}

impl<St> Clone for PerMessageLayer<St> {
    fn clone(&self) -> Self {
        PerMessageLayer {
            engine: self.engine.clone(),
        }
    }
}

impl<St> fmt::Debug for PerMessageLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PerMessageLayer").finish_non_exhaustive()
    }
}

impl<S, St> Layer<S> for PerMessageLayer<St> {
    type Service = PerMessage<S, St>;

    fn layer(&self, inner: S) -> PerMessage<S, St> {
        PerMessage {
            inner,
            engine: self.engine.clone(),
        }
    }
}

/// The service of [`PerMessageLayer`].
pub struct PerMessage<S, St = MemoryStore> {
    inner: S,
    engine: Arc<Engine<St>>,
}

impl<S: Clone, St> Clone for PerMessage<S, St> {
    fn clone(&self) -> Self {
        PerMessage {
            inner: self.inner.clone(),
            engine: self.engine.clone(),
        }
    }
}

impl<S: fmt::Debug, St> fmt::Debug for PerMessage<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PerMessage")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S: tonic::server::NamedService, St> tonic::server::NamedService for PerMessage<S, St> {
    const NAME: &'static str = S::NAME;
}

/// The trailers that end a call whose stream was refused, once it is.
type Cut = Arc<Mutex<Option<HeaderMap>>>;

impl<S, St, ResBody> Service<Request<tonic::body::Body>> for PerMessage<S, St>
where
    S: Service<Request<tonic::body::Body>, Response = Response<ResBody>>,
    St: Store,
{
    type Response = Response<PerMessageBody<ResBody>>;
    type Error = S::Error;
    type Future = PerMessageFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<tonic::body::Body>) -> Self::Future {
        if !crate::wire::is_grpc(request.headers()) {
            return PerMessageFuture {
                future: self.inner.call(request),
                cut: None,
            };
        }
        let (parts, body) = request.into_parts();
        let cut = Cut::default();
        let metered = MeteredBody {
            inner: body,
            checker: Checker {
                engine: self.engine.clone(),
                head: copy_head(&parts),
            },
            buffer: BytesMut::new(),
            waiting: None,
            accepted: None,
            passing: 0,
            cut: cut.clone(),
            ended: false,
        };
        let request = Request::from_parts(parts, tonic::body::Body::new(metered));
        PerMessageFuture {
            future: self.inner.call(request),
            cut: Some(cut),
        }
    }
}

/// A request head without its body, for one check per message.
fn copy_head(parts: &Parts) -> Parts {
    let (mut head, ()) = Request::new(()).into_parts();
    head.method = parts.method.clone();
    head.uri = parts.uri.clone();
    head.version = parts.version;
    head.headers = parts.headers.clone();
    head.extensions = parts.extensions.clone();
    head
}

/// The check of one message: its answer when refused, `None` when admitted.
type MessageCheck<St> = Pin<Box<MessageDecision<St>>>;

/// A message refused: the layer's gRPC answer, as the call's trailers and as the stream's error.
struct Refused {
    trailers: HeaderMap,
    status: tonic::Status,
}

pin_project! {
    /// One message's decision, driven by the engine's driver on a head of its own.
    struct MessageDecision<St>
    where
        St: Store,
    {
        #[pin]
        driver: Option<Driver<St>>,
        parts: Parts,
        snapshot: Arc<Snapshot>,
        refused: Option<Option<Refused>>,
    }

    impl<St> PinnedDrop for MessageDecision<St>
    where
        St: Store,
    {
        // A message whose stream went away before it was decided is told to events.
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(driver) = this.driver.as_pin_mut() {
                driver.cancel(Head::of_parts(this.parts));
            }
        }
    }
}

impl<St: Store> Future for MessageDecision<St> {
    type Output = Option<Refused>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Refused>> {
        let mut this = self.project();
        if let Some(driver) = this.driver.as_mut().as_pin_mut() {
            let ruling = std::task::ready!(driver.poll_decide(cx, this.parts));
            this.driver.set(None);
            *this.refused = Some(refusal(this.snapshot, ruling));
        }
        Poll::Ready(this.refused.take().flatten())
    }
}

/// The headers of a refusal; none for a message admitted (it has no response: nothing to
/// settle, and its slots, if a reload brought any, go back now).
fn refusal(snapshot: &Snapshot, ruling: Ruling) -> Option<Refused> {
    match ruling {
        Ruling::Call(_) => None,
        Ruling::Answer { refusal, .. } => Some(Refused {
            trailers: snapshot
                .answers
                .render(&refusal, true)
                .into_parts()
                .0
                .headers,
            status: snapshot.answers.status(&refusal),
        }),
    }
}

/// Checks one message as the layer checks a request: the same rules, keys, store and events.
struct Checker<St> {
    engine: Arc<Engine<St>>,
    head: Parts,
}

impl<St: Store> Checker<St> {
    fn check(&self) -> MessageCheck<St> {
        let mut parts = copy_head(&self.head);
        let span = crate::observe::span();
        let (snapshot, decide) = self.engine.decide(&mut parts, &span);
        let (driver, refused) = match decide {
            Decide::Ready(ruling) => (None, Some(refusal(&snapshot, ruling))),
            Decide::Waiting(pending) => {
                let driver = Driver::new(pending, self.engine.clone(), snapshot.clone(), span);
                (Some(driver), None)
            }
        };
        Box::pin(MessageDecision {
            driver,
            parts,
            snapshot,
            refused,
        })
    }
}

pin_project! {
    /// A request stream whose messages are checked one by one.
    struct MeteredBody<St>
    where
        St: Store,
    {
        #[pin]
        inner: tonic::body::Body,
        checker: Checker<St>,
        // Bytes of the message being received.
        buffer: BytesMut,
        // A whole message (or a long one's prefix, and how long its rest is), and its check.
        waiting: Option<(Bytes, usize, MessageCheck<St>)>,
        // A message admitted, not yet passed on.
        accepted: Option<Bytes>,
        // Bytes of a long message admitted, still to pass on as they come.
        passing: usize,
        cut: Cut,
        ended: bool,
    }
}

/// The first gRPC message in `buffer`, once it can be checked: `(bytes to hold, bytes still to
/// come)`: the whole message (its 5-byte prefix included) and 0, or for a message longer than
/// [`MAX_HELD_MESSAGE`], its prefix and the length of the rest.
fn next_message(buffer: &[u8]) -> Option<(usize, usize)> {
    let prefix = buffer.get(..5)?;
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if len > MAX_HELD_MESSAGE {
        return Some((5, len));
    }
    (buffer.len() >= 5 + len).then_some((5 + len, 0))
}

impl<St: Store> Body for MeteredBody<St> {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let mut this = self.project();
        loop {
            if let Some(message) = this.accepted.take() {
                return Poll::Ready(Some(Ok(Frame::data(message))));
            }
            // The rest of a long message admitted: passed on as it comes.
            if *this.passing > 0 && !this.buffer.is_empty() {
                let n = (*this.passing).min(this.buffer.len());
                *this.passing -= n;
                return Poll::Ready(Some(Ok(Frame::data(this.buffer.split_to(n).freeze()))));
            }
            if let Some((_, _, check)) = this.waiting.as_mut() {
                let Poll::Ready(refused) = check.as_mut().poll(cx) else {
                    return Poll::Pending;
                };
                let (message, rest, _) = this.waiting.take().expect("a message waits");
                if let Some(Refused { trailers, status }) = refused {
                    // Refused: the stream fails before this message with the layer's answer,
                    // and the call ends with it.
                    *this.cut.lock().unwrap_or_else(|e| e.into_inner()) = Some(trailers);
                    *this.ended = true;
                    this.buffer.clear();
                    return Poll::Ready(Some(Err(status)));
                }
                *this.passing = rest;
                *this.accepted = Some(message);
                continue;
            }
            if *this.ended {
                return Poll::Ready(None);
            }
            if *this.passing == 0
                && let Some((hold, rest)) = next_message(this.buffer)
            {
                let message = this.buffer.split_to(hold).freeze();
                let check = this.checker.check();
                *this.waiting = Some((message, rest, check));
                continue;
            }
            match this.inner.as_mut().poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(mut data) => {
                        while data.has_remaining() {
                            let chunk = data.chunk().len();
                            this.buffer.extend_from_slice(data.chunk());
                            data.advance(chunk);
                        }
                    }
                    // Trailers of a request: after what is buffered.
                    Err(frame) => {
                        if !this.buffer.is_empty() {
                            *this.ended = true;
                            let rest = this.buffer.split().freeze();
                            return Poll::Ready(Some(Ok(Frame::data(rest))));
                        }
                        return Poll::Ready(Some(Ok(frame)));
                    }
                },
                Poll::Ready(Some(Err(error))) => return Poll::Ready(Some(Err(error))),
                Poll::Ready(None) => {
                    *this.ended = true;
                    // A message cut short by its client: passed on for the decoder to refuse.
                    if !this.buffer.is_empty() {
                        let rest = this.buffer.split().freeze();
                        return Poll::Ready(Some(Ok(Frame::data(rest))));
                    }
                    return Poll::Ready(None);
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.accepted.is_none() && self.waiting.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

pin_project! {
    /// The response future of [`PerMessage`].
    pub struct PerMessageFuture<F> {
        #[pin]
        future: F,
        cut: Option<Cut>,
    }
}

impl<F, B, E> Future for PerMessageFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<PerMessageBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let response = std::task::ready!(this.future.poll(cx))?;
        // A trailers-only answer (the service ended the call with a status of its own, the
        // refusal's when it passed the stream's error on) gets no second status.
        let cut = match this.cut.take() {
            Some(_) if response.headers().contains_key("grpc-status") => Cut::default(),
            cut => cut.unwrap_or_default(),
        };
        Poll::Ready(Ok(response.map(|inner| PerMessageBody {
            inner,
            cut,
            ended: false,
        })))
    }
}

pin_project! {
    /// The body of a call through [`PerMessageLayer`]: the service's, whose trailers become
    /// the layer's `RESOURCE_EXHAUSTED` when its request stream was refused.
    pub struct PerMessageBody<B> {
        #[pin]
        inner: B,
        cut: Cut,
        ended: bool,
    }
}

impl<B: Body<Data = Bytes>> Body for PerMessageBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        if *this.ended {
            return Poll::Ready(None);
        }
        match std::task::ready!(this.inner.poll_frame(cx)) {
            Some(Ok(frame)) if frame.is_trailers() => {
                let refused = this.cut.lock().unwrap_or_else(|e| e.into_inner()).take();
                match refused {
                    Some(answer) => {
                        *this.ended = true;
                        let mut trailers = frame.into_trailers().unwrap_or_default();
                        for name in answer.keys() {
                            trailers.remove(name);
                        }
                        for (name, value) in &answer {
                            trailers.append(name, value.clone());
                        }
                        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
                    }
                    None => {
                        *this.ended = true;
                        Poll::Ready(Some(Ok(frame)))
                    }
                }
            }
            Some(other) => Poll::Ready(Some(other)),
            None => {
                *this.ended = true;
                let refused = this.cut.lock().unwrap_or_else(|e| e.into_inner()).take();
                Poll::Ready(refused.map(|answer| Ok(Frame::trailers(answer))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefixed(len: u32) -> Vec<u8> {
        let mut message = vec![0];
        message.extend_from_slice(&len.to_be_bytes());
        message
    }

    #[test]
    fn messages_are_whole_before_their_check_and_long_ones_go_by_their_prefix() {
        let mut two = prefixed(3);
        two.extend_from_slice(b"abc");
        two.extend_from_slice(&prefixed(0));
        assert_eq!(next_message(&two), Some((8, 0)));
        assert_eq!(next_message(&two[8..]), Some((5, 0)), "an empty message");
        assert_eq!(next_message(&two[..7]), None, "not whole yet");
        assert_eq!(next_message(&two[..4]), None, "no prefix yet");
        let long = prefixed(MAX_HELD_MESSAGE as u32 + 1);
        assert_eq!(next_message(&long), Some((5, MAX_HELD_MESSAGE + 1)));
        assert_eq!(
            next_message(&prefixed(u32::MAX)),
            Some((5, u32::MAX as usize))
        );
    }
}
