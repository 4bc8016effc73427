//! Keys from the request body: [`BodyKeyLayer`] finds a field (an email on a login route) and
//! [`FromBody`] counts by it.
//!
//! ```
//! use axum::{Router, routing::{get, post}};
//! use tollgate::key::{BodyKeyLayer, ClientIp, FromBody, Key, KeyExtractorExt};
//! use tollgate::{Quota, RateLimitLayer, Rule};
//!
//! // 5 login attempts per minute per account, whatever IP they come from. Bodies without a
//! // usable email (too large, another content type, no field) share one budget, so padding a
//! // body cannot turn the per-account limit into a per-IP one; each IP also has its own limit.
//! let no_account = |_: &http::request::Parts| Some(Key::text("login-without-account"));
//! let limit = RateLimitLayer::builder()
//!     .rule(Rule::new("login", Quota::per_minute(5)).key(FromBody.or(no_account)))
//!     .rule(Rule::new("login-ip", Quota::per_minute(20)).key(ClientIp::new()))
//!     .build()?;
//! let login = Router::new()
//!     .route("/login", post(|body: String| async move { format!("{} bytes", body.len()) }))
//!     .route_layer(limit)                        // inner: runs second
//!     .route_layer(BodyKeyLayer::new("email"));  // outer: runs first (added last)
//! let app: Router = Router::new().route("/", get(|| async { "home" })).merge(login);
//! # Ok::<(), tollgate::ConfigError>(())
//! ```
//!
//! # How it works
//!
//! A [`KeyExtractor`] only sees the request head, so the body is read by a layer placed
//! *outside* the rate limit on the routes that need it (with `Router`, a layer added later is
//! outermost; with `ServiceBuilder`, a layer listed earlier is). For each request it:
//!
//! 1. looks at `Content-Type`: JSON (`application/json`, `application/*+json`) or a form
//!    (`application/x-www-form-urlencoded`), not content-encoded. Anything else is passed on
//!    untouched, without reading a byte;
//! 2. passes on untouched a body whose declared length (`Content-Length` or size hint) exceeds
//!    the limit (16 KiB by default);
//! 3. otherwise reads frames until the body ends or more than the limit has arrived (so it holds
//!    at most the limit plus one frame, whatever the body's size);
//! 4. if the whole body arrived, finds the top-level field (a JSON object member or a form
//!    field, present exactly once, a string or a number), normalises it (for emails: trimmed
//!    and lowercased) and inserts its key as a [`BodyFieldKey`] extension. The key is the
//!    value's SHA-256 by default, so emails reach neither the store nor any log;
//! 5. in every case hands the inner service a body with the identical byte stream: the frames
//!    it read, then the rest of the original body (trailers and errors included).
//!
//! [`FromBody`] then reads the [`BodyFieldKey`]; when there is none (body too large, another
//! content type, no such field, invalid JSON) it finds no key, so chain the fallback you want.
//! Choose it with care: a client controls whether its body is usable, so a per-IP fallback lets
//! an attacker who pads the body past the limit and rotates addresses escape the per-account
//! budget. A fallback to one shared key (as above) keeps that budget closed to such requests,
//! while well-formed requests are counted per account. Every request that passed the layer also carries a
//! [`BodyScan`] extension saying what happened and how many bytes were held.
//!
//! Values are never logged; at `debug` level the layer logs only the outcome.

use std::collections::VecDeque;
use std::fmt;
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::warn::Once;
use axum::BoxError;
use axum::body::Body;
use bytes::Bytes;
use http::header::{CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE};
use http::request::Parts;
use http::{HeaderMap, Request};
use http_body::{Body as HttpBody, Frame, SizeHint};
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use tower_layer::Layer;
use tower_service::Service;

use super::{Extracted, Key, KeyExtractor};

/// The default most bytes of a body [`BodyKeyLayer`] holds: 16 KiB.
pub const DEFAULT_BODY_LIMIT: usize = 16 * 1024;

/// How a field's value is normalised before it becomes a key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Normalize {
    /// Trimmed and lowercased (the default): `" Alice@Example.COM "` and `"alice@example.com"`
    /// are one account.
    #[default]
    Email,
    /// Whitespace trimmed from both ends.
    Trim,
    /// The value as it is.
    Exact,
}

impl Normalize {
    fn apply(self, value: &str) -> String {
        match self {
            Normalize::Email => value.trim().to_lowercase(),
            Normalize::Trim => value.trim().to_owned(),
            Normalize::Exact => value.to_owned(),
        }
    }
}

#[derive(Clone, Debug)]
struct Config {
    field: Box<str>,
    limit: usize,
    normalize: Normalize,
    hashed: bool,
}

/// Reads a field of JSON and form bodies, up to a limit, so that [`FromBody`] can count by it.
/// See the [module documentation](self).
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

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The ready service goes with this request; a fresh clone waits for the next poll_ready.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        Box::pin(async move {
            let request = scan(&config, request).await;
            inner.call(request).await
        })
    }
}

/// The key [`BodyKeyLayer`] found in a request body; read by [`FromBody`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BodyFieldKey(Key);

impl BodyFieldKey {
    /// The key.
    pub fn key(&self) -> &Key {
        &self.0
    }
}

/// What [`BodyKeyLayer`] did with a request body; an extension of every request it passed on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BodyScan {
    /// The outcome.
    pub outcome: BodyOutcome,
    /// How many body bytes the layer held before passing the request on.
    pub buffered: usize,
}

/// See [`BodyScan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BodyOutcome {
    /// The field was found: the request carries a [`BodyFieldKey`].
    Found,
    /// The whole body was read but has no usable field (absent, repeated, empty, not a string or
    /// number, or the body is not valid JSON).
    Missing,
    /// The body is larger than the limit (declared or found while reading).
    TooLarge,
    /// Not JSON or a form, or content-encoded: not read.
    NotChecked,
    /// The body failed while being read; the inner service sees the same error.
    Unreadable,
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
            let mut held = Held::default();
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

enum End {
    Complete,
    TooLarge,
    Failed(axum::Error),
}

#[derive(Default)]
struct Held {
    chunks: VecDeque<Bytes>,
    len: usize,
    trailers: Option<HeaderMap>,
}

impl Held {
    fn replay(self, rest: Option<Body>, error: Option<axum::Error>) -> Replay {
        Replay {
            chunks: self.chunks,
            len: self.len as u64,
            trailers: self.trailers,
            error,
            rest,
        }
    }
}

/// The frames read, then the rest of the original body.
struct Replay {
    chunks: VecDeque<Bytes>,
    len: u64,
    trailers: Option<HeaderMap>,
    error: Option<axum::Error>,
    rest: Option<Body>,
}

impl HttpBody for Replay {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        if let Some(chunk) = this.chunks.pop_front() {
            this.len -= chunk.len() as u64;
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        if let Some(error) = this.error.take() {
            return Poll::Ready(Some(Err(error)));
        }
        if let Some(rest) = &mut this.rest {
            return Pin::new(rest).poll_frame(cx);
        }
        Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_empty()
            && self.error.is_none()
            && self.trailers.is_none()
            && self.rest.as_ref().is_none_or(HttpBody::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let rest = self
            .rest
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), HttpBody::size_hint);
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower().saturating_add(self.len));
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(self.len));
        }
        hint
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Json,
    Form,
}

fn content_kind(headers: &HeaderMap) -> Option<Kind> {
    let encoded = headers
        .get(CONTENT_ENCODING)
        .is_some_and(|e| !e.as_bytes().trim_ascii().eq_ignore_ascii_case(b"identity"));
    if encoded {
        return None;
    }
    let value = headers.get(CONTENT_TYPE)?.to_str().ok()?;
    let essence = value.split(';').next()?.trim();
    let (kind, subtype) = essence.split_once('/')?;
    if !kind.eq_ignore_ascii_case("application") {
        return None;
    }
    let json_suffix = subtype.len() > 5
        && subtype.is_char_boundary(subtype.len() - 5)
        && subtype[subtype.len() - 5..].eq_ignore_ascii_case("+json");
    if subtype.eq_ignore_ascii_case("json") || json_suffix {
        Some(Kind::Json)
    } else if subtype.eq_ignore_ascii_case("x-www-form-urlencoded") {
        Some(Kind::Form)
    } else {
        None
    }
}

fn declared_len(headers: &HeaderMap) -> u64 {
    headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

fn find(config: &Config, kind: Kind, chunks: &VecDeque<Bytes>) -> Option<Key> {
    let joined;
    let bytes: &[u8] = match chunks.len() {
        0 => &[],
        1 => &chunks[0],
        _ => {
            joined = chunks
                .iter()
                .flat_map(|c| c.iter().copied())
                .collect::<Vec<u8>>();
            &joined
        }
    };
    let value = match kind {
        Kind::Json => json_field(bytes, &config.field)?,
        Kind::Form => form_field(bytes, &config.field)?,
    };
    let value = config.normalize.apply(&value);
    if value.is_empty() {
        return None;
    }
    Some(if config.hashed {
        Key::digest(value)
    } else {
        Key::text(value)
    })
}

/// The top-level member `field` of a JSON object: a string, or a number as written.
fn json_field(bytes: &[u8], field: &str) -> Option<String> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = FieldOf(field).deserialize(&mut de).ok()?;
    de.end().ok()?;
    value
}

/// The value of the form field `field`, if it occurs exactly once.
fn form_field(bytes: &[u8], field: &str) -> Option<String> {
    let mut found = None;
    for (name, value) in form_urlencoded::parse(bytes) {
        if name == field {
            if found.is_some() {
                return None;
            }
            found = Some(value.into_owned());
        }
    }
    found
}

/// Finds a member of a JSON object; `None` when absent, repeated or not a scalar.
struct FieldOf<'f>(&'f str);

impl<'de> DeserializeSeed<'de> for FieldOf<'_> {
    type Value = Option<String>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for FieldOf<'_> {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found: Option<Option<String>> = None;
        let mut repeated = false;
        while let Some(is_field) = map.next_key_seed(NameIs(self.0))? {
            if is_field {
                let value = map.next_value::<Scalar>()?.0;
                repeated |= found.is_some();
                found = Some(value);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(if repeated { None } else { found.flatten() })
    }
}

/// Whether an object member's name is the field's.
struct NameIs<'f>(&'f str);

impl<'de> DeserializeSeed<'de> for NameIs<'_> {
    type Value = bool;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for NameIs<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a member name")
    }

    fn visit_str<E: de::Error>(self, name: &str) -> Result<bool, E> {
        Ok(name == self.0)
    }
}

/// A string or number as text; anything else (consumed) as `None`.
struct Scalar(Option<String>);

impl<'de> de::Deserialize<'de> for Scalar {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ScalarVisitor)
    }
}

struct ScalarVisitor;

impl<'de> Visitor<'de> for ScalarVisitor {
    type Value = Scalar;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Scalar, E> {
        Ok(Scalar(Some(v.to_owned())))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Scalar, E> {
        Ok(Scalar(Some(v.to_string())))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Scalar, E> {
        Ok(Scalar(Some(v.to_string())))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Scalar, E> {
        Ok(Scalar(None))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Scalar, E> {
        Ok(Scalar(None))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Scalar, E> {
        Ok(Scalar(None))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Scalar, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Scalar(None))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Scalar, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Scalar(None))
    }
}

/// Counts by the [`BodyFieldKey`] that [`BodyKeyLayer`] found; no key without one.
///
/// If a request reaches it that no [`BodyKeyLayer`] read (the body layer was placed inside the
/// rate limit, or only on other routes), this is reported once through `tracing`.
#[derive(Clone, Copy, Debug, Default)]
pub struct FromBody;

static HINTED: Once = Once::new();

impl KeyExtractor for FromBody {
    fn extract(&self, parts: &Parts) -> Extracted {
        if let Some(found) = parts.extensions.get::<BodyFieldKey>() {
            return Extracted::Ready(Some(found.0.clone()));
        }
        if parts.extensions.get::<BodyScan>().is_none() && HINTED.first() {
            tracing::warn!(
                "tollgate: FromBody saw a request that no BodyKeyLayer had read, so it has no \
                 body key (the rule's fallback, if any, applies). If this route should be keyed \
                 by its body, add BodyKeyLayer outside RateLimitLayer on it (with Router, add it \
                 after). Reported once."
            );
        }
        Extracted::Ready(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_fields() {
        let f = |body: &str| json_field(body.as_bytes(), "email");
        assert_eq!(
            f(r#"{"email":"a@b.c","password":"x"}"#),
            Some("a@b.c".into())
        );
        assert_eq!(
            f(r#"{"x":{"email":"no"},"email":"yes"}"#),
            Some("yes".into())
        );
        assert_eq!(f(r#"{"em\u0061il":"escaped"}"#), Some("escaped".into()));
        assert_eq!(f(r#"{"email":12}"#), Some("12".into()));
        assert_eq!(f(r#"{"email":"a","email":"b"}"#), None);
        assert_eq!(f(r#"{"email":null}"#), None);
        assert_eq!(f(r#"{"email":["a"]}"#), None);
        assert_eq!(f(r#"{"other":"a"}"#), None);
        assert_eq!(f(r#"["email","a"]"#), None);
        assert_eq!(f(r#"{"email":"a"} trailing"#), None);
        assert_eq!(f(r#"{"email":"a""#), None);
        assert_eq!(f(""), None);
    }

    #[test]
    fn form_fields() {
        let f = |body: &str| form_field(body.as_bytes(), "email");
        assert_eq!(f("email=a%40b.c&password=x"), Some("a@b.c".into()));
        assert_eq!(f("password=x&email=A+B"), Some("A B".into()));
        assert_eq!(f("email=a&email=b"), None);
        assert_eq!(f("e-mail=a"), None);
    }

    #[test]
    fn content_kinds() {
        let kind = |ct: &str, enc: Option<&str>| {
            let mut headers = HeaderMap::new();
            headers.insert(CONTENT_TYPE, ct.parse().unwrap());
            if let Some(enc) = enc {
                headers.insert(CONTENT_ENCODING, enc.parse().unwrap());
            }
            content_kind(&headers)
        };
        assert_eq!(kind("application/json", None), Some(Kind::Json));
        assert_eq!(
            kind("Application/JSON; charset=utf-8", None),
            Some(Kind::Json)
        );
        assert_eq!(kind("application/vnd.api+json", None), Some(Kind::Json));
        assert_eq!(
            kind("application/x-www-form-urlencoded", None),
            Some(Kind::Form)
        );
        assert_eq!(kind("application/json", Some("identity")), Some(Kind::Json));
        assert_eq!(kind("application/json", Some("gzip")), None);
        assert_eq!(kind("text/plain", None), None);
        assert_eq!(kind("multipart/form-data; boundary=x", None), None);
        assert_eq!(kind("json", None), None);
    }

    #[test]
    fn normalisation() {
        assert_eq!(
            Normalize::Email.apply("  Alice@Example.COM\t"),
            "alice@example.com"
        );
        assert_eq!(Normalize::Trim.apply(" Bob "), "Bob");
        assert_eq!(Normalize::Exact.apply(" Bob "), " Bob ");
    }
}
