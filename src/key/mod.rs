//! Who is asking: the [`KeyExtractor`] trait, the [`Key`] it returns, and the extractors.
//!
//! ```
//! use http::Request;
//! use tollgate::key::{Extracted, Global, Key, KeyExtractor};
//!
//! // Any closure over the request head is an extractor.
//! let by_tenant = |parts: &http::request::Parts| {
//!     parts.headers.get("x-tenant").and_then(|v| v.to_str().ok()).map(Key::text)
//! };
//! let (parts, ()) = Request::get("/").header("x-tenant", "acme").body(()).unwrap().into_parts();
//! assert_eq!(by_tenant.extract(&parts).ready(), Some(Some(Key::text("acme"))));
//! assert_eq!(Global.extract(&parts).ready(), Some(Some(Key::global())));
//! ```
//!
//! Extraction is synchronous on the fast path; an extractor that must look something up returns
//! [`Extracted::Pending`] with a future.
//!
//! When an extractor finds no key (no authenticated user, no peer address), the rule does not
//! apply to that request; the layer logs this once per rule through `tracing`. Chain extractors
//! (a user, else the IP) to make sure every request is counted.
//!
//! # The extractors
//!
//! | Extractor | Key |
//! |---|---|
//! | [`PeerIp`] | the socket peer's address (the default) |
//! | [`ClientIp`] | the client's address through trusted proxies (`X-Forwarded-For`, `Forwarded`, …) |
//! | [`FromExtension`] | a typed request extension, such as the user your authentication set |
//! | [`FromHeader`] | a header value (hashed for secrets) |
//! | [`async_fn()`] | a closure returning a future, for lookups |
//! | `FromBody` + `BodyKeyLayer` (feature `axum`) | a JSON or form field of the body, such as the email of a login |
//! | [`Route`] | the route pattern (`/users/{id}`) or gRPC method, optionally with the method |
//! | [`Global`] | one key for everyone |
//! | [`combine`], [`first_of`], [`KeyExtractorExt`] | several in one key; fallback chains |
//!
//! Identities come from untrusted input, so every [`Key`] is bounded: IP keys are addresses
//! (no allocation), text keys escape `{`, `}`, `%`, `|`, `~`, whitespace and control characters
//! and are hashed to 71 bytes past [`MAX_TEXT_KEY_LEN`].

pub mod async_fn;
#[cfg(feature = "axum")]
pub mod body;
pub mod client_ip;
pub mod compose;
pub mod extension;
pub mod forwarded;
mod global;
pub mod header;
mod identity;
mod peer_ip;
pub mod route;

pub use async_fn::{AsyncFn, async_fn};
#[cfg(feature = "axum")]
pub use body::{
    BodyFieldKey, BodyKey, BodyKeyFuture, BodyKeyLayer, BodyOutcome, BodyScan, DEFAULT_BODY_LIMIT,
    FromBody, Normalize,
};
pub use client_ip::{ClientIp, MAX_HOPS, ProxyHeader};
pub use compose::{Combine, FirstOf, KeyExtractorExt, combine, first_of};
pub use extension::FromExtension;
pub use global::Global;
pub use header::FromHeader;
pub use identity::{Key, MAX_TEXT_KEY_LEN};
pub use ipnet::IpNet;
pub use peer_ip::PeerIp;
pub use route::{MAX_GRPC_PATH_LEN, Route};

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use http::request::Parts;

/// A future that finds a key later.
pub type KeyFuture = Pin<Box<dyn Future<Output = Option<Key>> + Send + 'static>>;

/// What an extractor found.
pub enum Extracted {
    /// The key, or `None` when the request has none (the rule then does not apply).
    Ready(Option<Key>),
    /// A key that needs asynchronous work (a lookup) to find.
    Pending(KeyFuture),
}

impl Extracted {
    /// The key if it was found synchronously; `None` for [`Extracted::Pending`].
    pub fn ready(self) -> Option<Option<Key>> {
        match self {
            Extracted::Ready(key) => Some(key),
            Extracted::Pending(_) => None,
        }
    }
}

impl From<Option<Key>> for Extracted {
    fn from(key: Option<Key>) -> Self {
        Extracted::Ready(key)
    }
}

impl From<Key> for Extracted {
    fn from(key: Key) -> Self {
        Extracted::Ready(Some(key))
    }
}

/// Finds who a request counts against.
///
/// Implemented for every `Fn(&Parts) -> Option<Key>` closure.
pub trait KeyExtractor: Send + Sync + 'static {
    /// The key of this request.
    fn extract(&self, parts: &Parts) -> Extracted;
}

impl<F> KeyExtractor for F
where
    F: Fn(&Parts) -> Option<Key> + Send + Sync + 'static,
{
    fn extract(&self, parts: &Parts) -> Extracted {
        Extracted::Ready(self(parts))
    }
}

/// A shared, type-erased extractor.
pub(crate) type SharedExtractor = Arc<dyn KeyExtractor>;
