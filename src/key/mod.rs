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
//! assert_eq!(by_tenant.extract(&parts).found(), Some(Key::text("acme")));
//! assert_eq!(Global.extract(&parts).found(), Some(Key::global()));
//! ```
//!
//! Extraction is synchronous on the fast path; an extractor that must look something up returns
//! [`Extracted::Pending`] with a future.
//!
//! When an extractor finds no key (no authenticated user, no peer address), the request is not
//! let through unlimited: the rule counts it under one shared key, [`Key::unidentified`], and
//! the layer says so once per rule through `tracing`, with the fix to apply. Chain extractors
//! (a user, else the IP) so that every request has a key of its own, or let a rule
//! [skip](crate::Rule::skip_unidentified) such requests.
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

mod async_fn;
#[cfg(feature = "axum")]
mod body;
mod client_ip;
mod compose;
mod extension;
pub mod forwarded;
mod global;
mod header;
mod identity;
mod peer_ip;
mod route;

pub use async_fn::{AsyncFn, async_fn};
#[cfg(feature = "axum")]
pub use body::{
    BodyFieldKey, BodyKey, BodyKeyFuture, BodyKeyLayer, BodyOutcome, BodyScan, DEFAULT_BODY_LIMIT,
    FromBody, Normalize,
};
pub use client_ip::{ClientIp, MAX_HOPS, ProxyHeader};
pub use compose::{Combine, FirstOf, KeyExtractorExt, combine, first_of};
pub(crate) use compose::{CombineShared, FirstOfShared};
pub use extension::FromExtension;
pub use global::Global;
pub use header::FromHeader;
pub use identity::{Key, MAX_TEXT_KEY_LEN, canonical_ip};
pub use ipnet::IpNet;
pub use peer_ip::PeerIp;
pub use route::{MAX_GRPC_PATH_LEN, Route};

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use http::request::Parts;

/// A future that finds a key later.
pub type KeyFuture = Pin<Box<dyn Future<Output = Option<Key>> + Send + 'static>>;

/// What an extractor found for a request.
pub enum Extracted {
    /// The key.
    Found(Key),
    /// The request has no key for this extractor (no authenticated user, no peer address). The
    /// rule then counts it under [`Key::unidentified`], unless it
    /// [skips such requests](crate::Rule::skip_unidentified).
    Missing,
    /// The key needs asynchronous work (a lookup) to find; the future resolves to `None` when
    /// it is missing.
    Pending(KeyFuture),
}

impl Extracted {
    /// The key, waiting for the lookup of [`Extracted::Pending`]; `None` when it is missing.
    pub async fn resolve(self) -> Option<Key> {
        match self {
            Extracted::Found(key) => Some(key),
            Extracted::Missing => None,
            Extracted::Pending(future) => future.await,
        }
    }

    /// The key of [`Extracted::Found`]; `None` when it is missing **or** needs a lookup (use
    /// [`resolve`](Extracted::resolve) to wait for one).
    pub fn found(self) -> Option<Key> {
        match self {
            Extracted::Found(key) => Some(key),
            Extracted::Missing | Extracted::Pending(_) => None,
        }
    }
}

impl From<Option<Key>> for Extracted {
    fn from(key: Option<Key>) -> Self {
        match key {
            Some(key) => Extracted::Found(key),
            None => Extracted::Missing,
        }
    }
}

impl From<Key> for Extracted {
    fn from(key: Key) -> Self {
        Extracted::Found(key)
    }
}

impl fmt::Debug for Extracted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Extracted::Found(key) => f.debug_tuple("Found").field(key).finish(),
            Extracted::Missing => f.write_str("Missing"),
            Extracted::Pending(_) => f.write_str("Pending(..)"),
        }
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
        self(parts).into()
    }
}

/// A shared, type-erased extractor.
pub(crate) type SharedExtractor = Arc<dyn KeyExtractor>;
