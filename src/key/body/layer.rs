//! [`BodyKeyLayer`] and its service: read a request's body as far as needed, find the field,
//! and pass the identical body on.

use std::fmt;
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::BoxError;
use axum::body::Body;
use bytes::Bytes;
use http::Request;
use http_body::Body as HttpBody;
use tower_layer::Layer;
use tower_service::Service;

use super::field::{Config, Normalize, content_kind, declared_len, find};
use super::from_body::{BodyFieldKey, BodyOutcome, BodyScan};
use super::replay::{BodyRead, End};
#[cfg(doc)]
use crate::key::{FromBody, Key, KeyExtractor};

/// The default most bytes of a body [`BodyKeyLayer`] holds: 16 KiB.
pub const DEFAULT_BODY_LIMIT: usize = 16 * 1024;

/// Reads a field of JSON and form bodies (an email on a login route), up to a limit, so that
/// [`FromBody`] can count by it.
///
/// ```
/// use axum::{Router, routing::{get, post}};
/// use tollgate::key::{BodyKeyLayer, ClientIp, FromBody, Key, KeyExtractorExt};
/// use tollgate::{Quota, RateLimitLayer, Rule};
///
/// // 5 login attempts per minute per account, whatever IP they come from. Bodies without a
/// // usable email (too large, another content type, no field) share one budget, so padding a
/// // body cannot turn the per-account limit into a per-IP one; each IP also has its own limit.
/// let no_account = |_: &http::request::Parts| Some(Key::text("login-without-account"));
/// let limit = RateLimitLayer::builder()
///     .rule(Rule::new("login", Quota::per_minute(5)).key(FromBody.or(no_account)))
///     .rule(Rule::new("login-ip", Quota::per_minute(20)).key(ClientIp::new()))
///     .build()?;
/// let login = Router::new()
///     .route("/login", post(|body: String| async move { format!("{} bytes", body.len()) }))
///     .route_layer(limit)                        // inner: runs second
///     .route_layer(BodyKeyLayer::new("email"));  // outer: runs first (added last)
/// let app: Router = Router::new().route("/", get(|| async { "home" })).merge(login);
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
///
/// # How it works
///
/// A [`KeyExtractor`] only sees the request head, so the body is read by a layer placed
/// *outside* the rate limit on the routes that need it (with `Router`, a layer added later is
/// outermost; with `ServiceBuilder`, a layer listed earlier is). For each request it:
///
/// 1. looks at `Content-Type`: JSON (`application/json`, `application/*+json`) or a form
///    (`application/x-www-form-urlencoded`), not content-encoded. Anything else is passed on
///    untouched, without reading a byte;
/// 2. passes on untouched a body whose declared length (`Content-Length` or size hint) exceeds
///    the limit (16 KiB by default);
/// 3. otherwise reads frames until the body ends or more than the limit has arrived (so it holds
///    at most the limit plus one frame, whatever the body's size);
/// 4. if the whole body arrived, finds the top-level field (a JSON object member or a form
///    field, present exactly once, a string or a number), normalises it (for emails: trimmed
///    and lowercased) and inserts its key as a [`BodyFieldKey`] extension. The key is the
///    value's SHA-256 by default, so emails reach neither the store nor any log;
/// 5. in every case hands the inner service a body with the identical byte stream: the frames
///    it read, then the rest of the original body (trailers and errors included).
///
/// [`FromBody`] then reads the [`BodyFieldKey`]; when there is none (body too large, another
/// content type, no such field, invalid JSON) it finds no key, so chain the fallback you want.
/// Choose it with care: a client controls whether its body is usable, so a per-IP fallback lets
/// an attacker who pads the body past the limit and rotates addresses escape the per-account
/// budget. A fallback to one shared key (as above) keeps that budget closed to such requests,
/// while well-formed requests are counted per account. Every request that passed the layer also carries a
/// [`BodyScan`] extension saying what happened and how many bytes were held.
///
#[derive(Clone, Debug)]
pub struct BodyKeyLayer {
    config: Arc<Config>,
}

impl BodyKeyLayer {
    /// Finds the top-level field `field` of JSON and form bodies of at most 16 KiB, normalised
    /// as an email and hashed.
    pub fn new(field: impl Into<String>) -> Self {
        BodyKeyLayer {
            config: Arc::new(Config {
                field: field.into().into_boxed_str(),
                limit: DEFAULT_BODY_LIMIT,
                normalize: Normalize::default(),
                hashed: true,
            }),
        }
    }

    /// The most body bytes looked at (default [`DEFAULT_BODY_LIMIT`]). Larger bodies are passed
    /// on without a key, after holding at most this many bytes plus one frame.
    pub fn limit(mut self, bytes: usize) -> Self {
        Arc::make_mut(&mut self.config).limit = bytes;
        self
    }

    /// How the value is normalised (default [`Normalize::Email`]).
    pub fn normalize(mut self, normalize: Normalize) -> Self {
        Arc::make_mut(&mut self.config).normalize = normalize;
        self
    }

    /// Whether the key is the SHA-256 of the value (default `true`) or the value itself,
    /// escaped by [`Key::text`]. Keep hashing for personal data such as emails.
    pub fn hashed(mut self, hashed: bool) -> Self {
        Arc::make_mut(&mut self.config).hashed = hashed;
        self
    }
}

impl<S> Layer<S> for BodyKeyLayer {
    type Service = BodyKey<S>;

    fn layer(&self, inner: S) -> BodyKey<S> {
        BodyKey {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The service made by [`BodyKeyLayer`].
#[derive(Clone)]
pub struct BodyKey<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S: fmt::Debug> fmt::Debug for BodyKey<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BodyKey")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish()
    }
}

/// The future of [`BodyKey`].
pub type BodyKeyFuture<R, E> = Pin<Box<dyn Future<Output = Result<R, E>> + Send + 'static>>;

impl<S, B> Service<Request<B>> for BodyKey<S>
where
    S: Service<Request<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Send + 'static,
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BodyKeyFuture<S::Response, S::Error>;

    /// Always ready: the inner service is driven ready by each request's future, once its body
    /// was read, so that a client that sends its body slowly never holds the inner service's
    /// readiness (a concurrency permit, a buffer slot) meanwhile. So a concurrency limit inside
    /// this layer does not bound how many bodies are being read at once (each holds at most the
    /// limit plus one frame): bound connections or concurrency outside it.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let mut inner = self.inner.clone();
        let config = self.config.clone();
        Box::pin(async move {
            let request = scan(&config, request).await;
            poll_fn(|cx| inner.poll_ready(cx)).await?;
            inner.call(request).await
        })
    }
}

/// Reads the body of `request` as far as needed and returns the request to pass on.
async fn scan<B>(config: &Config, request: Request<B>) -> Request<Body>
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (mut parts, body) = request.into_parts();
    let mut body = Body::new(body);
    let kind = content_kind(&parts.headers);
    let declared = declared_len(&parts.headers).max(body.size_hint().lower());
    let (outcome, buffered, body) = match kind {
        None => (BodyOutcome::NotChecked, 0, body),
        Some(_) if declared > config.limit as u64 => (BodyOutcome::TooLarge, 0, body),
        Some(kind) => {
            let mut held = BodyRead::default();
            let end = loop {
                match poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
                    None => break End::Complete,
                    Some(Err(error)) => break End::Failed(error),
                    Some(Ok(frame)) => match frame.into_data() {
                        Ok(data) => {
                            held.len += data.len();
                            held.chunks.push_back(data);
                            if held.len > config.limit {
                                break End::TooLarge;
                            }
                        }
                        Err(frame) => {
                            if let Ok(trailers) = frame.into_trailers() {
                                held.trailers = Some(trailers);
                            }
                        }
                    },
                }
            };
            let buffered = held.len;
            match end {
                End::Complete => {
                    let outcome = match find(config, kind, &held.chunks) {
                        Some(key) => {
                            parts.extensions.insert(BodyFieldKey(key));
                            BodyOutcome::Found
                        }
                        None => BodyOutcome::Missing,
                    };
                    (outcome, buffered, Body::new(held.replay(None, None)))
                }
                End::TooLarge => (
                    BodyOutcome::TooLarge,
                    buffered,
                    Body::new(held.replay(Some(body), None)),
                ),
                End::Failed(error) => (
                    BodyOutcome::Unreadable,
                    buffered,
                    Body::new(held.replay(None, Some(error))),
                ),
            }
        }
    };
    tracing::debug!(?outcome, buffered, "tollgate: body key");
    parts.extensions.insert(BodyScan { outcome, buffered });
    Request::from_parts(parts, body)
}
