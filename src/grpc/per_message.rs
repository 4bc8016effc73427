//! [`PerMessageLayer`]: a layer's rules charged for each message of a client or bidirectional
//! stream, not once per call.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::fmt;
use std::future::{Future, Ready, ready};
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
use crate::decide::Shared;
use crate::future::ResponseFuture;
use crate::response::ResponseBody;
use crate::store::{MemoryStore, Store};

/// The most bytes of one message held while it waits for its check (tonic's default largest
/// message is 4 MiB); a longer one is passed on unchecked, for the server's decoder to refuse.
const MAX_HELD_MESSAGE: usize = 16 * 1024 * 1024;

impl<St> RateLimitLayer<St> {
    /// The layer's rules charged per message of each call's request stream (see
    /// [`PerMessageLayer`]), on the same store and budgets.
    pub fn per_message(&self) -> PerMessageLayer<St> {
        PerMessageLayer {
            shared: self.shared().clone(),
        }
    }
}

/// A layer's rules charged for each message a gRPC client sends, one check per message (its
/// rules' cost each), none when the call opens: for client streams and bidirectional streams,
/// on a server (`Server::builder().layer(..)`) or on one service (`layer.layer(service)`).
///
/// A message is checked once it has fully arrived, before the service sees it. When one is
/// refused, the request stream ends there: the service gets every message accepted before it
/// (none is cut in two), answers as it does when its client is done, and the call ends with
/// `RESOURCE_EXHAUSTED`, a `RetryInfo` and `grpc-retry-pushback-ms` in the trailers instead of
/// the service's status.
///
/// ```
/// use tollgate::{Quota, RateLimitLayer, Rule};
///
/// # fn main() -> Result<(), tollgate::ConfigError> {
/// // 100 messages a minute per peer, over all its streams.
/// let messages = RateLimitLayer::builder()
///     .rule(Rule::new("messages", Quota::per_minute(100)))
///     .build()?
///     .per_message();
/// let (_reporter, health) = tonic_health::server::health_reporter();
/// let _router = tonic::transport::Server::builder().layer(messages).add_service(health);
/// # Ok(())
/// # }
/// ```
pub struct PerMessageLayer<St = MemoryStore> {
    shared: Arc<Shared<St>>,
}

impl<St> Clone for PerMessageLayer<St> {
    fn clone(&self) -> Self {
        PerMessageLayer {
            shared: self.shared.clone(),
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
            shared: self.shared.clone(),
        }
    }
}

/// The service of [`PerMessageLayer`].
pub struct PerMessage<S, St = MemoryStore> {
    inner: S,
    shared: Arc<Shared<St>>,
}

impl<S: Clone, St> Clone for PerMessage<S, St> {
    fn clone(&self) -> Self {
        PerMessage {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
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
        let (parts, body) = request.into_parts();
        let cut = Cut::default();
        let metered = MeteredBody {
            inner: body,
            checker: Checker {
                shared: self.shared.clone(),
                head: copy_head(&parts),
            },
            buffer: BytesMut::new(),
            waiting: None,
            accepted: VecDeque::new(),
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

/// An inner service that answers at once: what the layer's decision wraps, per message.
#[derive(Clone, Copy)]
struct Verdict;

impl Service<Request<()>> for Verdict {
    type Response = Response<()>;
    type Error = Infallible;
    type Future = Ready<Result<Response<()>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<()>) -> Self::Future {
        ready(Ok(Response::new(())))
    }
}

type MessageCheck =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<()>>, Infallible>> + Send>>;

/// Checks one message as the layer checks a request: the same rules, keys, store and events.
struct Checker<St> {
    shared: Arc<Shared<St>>,
    head: Parts,
}

impl<St: Store> Checker<St> {
    fn check(&self) -> MessageCheck {
        let mut parts = copy_head(&self.head);
        let span = crate::observe::span();
        let (snapshot, start) = self.shared.start(&mut parts, &span);
        Box::pin(ResponseFuture::new(
            start,
            snapshot,
            span,
            Verdict,
            Request::from_parts(parts, ()),
            self.shared.clone(),
            None,
        ))
    }
}

pin_project! {
    /// A request stream whose messages are checked one by one.
    struct MeteredBody<St> {
        #[pin]
        inner: tonic::body::Body,
        checker: Checker<St>,
        // Bytes of the message being received.
        buffer: BytesMut,
        // A whole message, and its check.
        waiting: Option<(Bytes, MessageCheck)>,
        // Messages admitted, not yet passed on.
        accepted: VecDeque<Bytes>,
        cut: Cut,
        ended: bool,
    }
}

/// The length of the first gRPC message in `buffer` (5-byte prefix included), once it is
/// whole.
fn whole_message(buffer: &[u8]) -> Option<usize> {
    let prefix = buffer.get(..5)?;
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    let whole = 5usize.saturating_add(len);
    (buffer.len() >= whole || whole > MAX_HELD_MESSAGE).then_some(whole.min(buffer.len()))
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
            if let Some(message) = this.accepted.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(message))));
            }
            if let Some((_, check)) = this.waiting.as_mut() {
                let Poll::Ready(Ok(answer)) = check.as_mut().poll(cx) else {
                    return Poll::Pending;
                };
                let (message, _) = this.waiting.take().expect("a message waits");
                if answer.headers().contains_key("grpc-status") {
                    // Refused: the stream ends before this message, and the call with the
                    // layer's answer.
                    let mut trailers = answer.into_parts().0.headers;
                    trailers.remove(http::header::CONTENT_TYPE);
                    *this.cut.lock().unwrap_or_else(|e| e.into_inner()) = Some(trailers);
                    *this.ended = true;
                    this.buffer.clear();
                    return Poll::Ready(None);
                }
                this.accepted.push_back(message);
                continue;
            }
            if *this.ended {
                return Poll::Ready(None);
            }
            if let Some(len) = whole_message(this.buffer) {
                let message = this.buffer.split_to(len).freeze();
                let check = this.checker.check();
                *this.waiting = Some((message, check));
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
                    // Trailers of a request: passed on.
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
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
        self.ended && self.accepted.is_empty() && self.waiting.is_none()
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
        let cut = this.cut.take().unwrap_or_default();
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
                        for (name, value) in &answer {
                            trailers.insert(name, value.clone());
                        }
                        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
                    }
                    None => Poll::Ready(Some(Ok(frame))),
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
