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
//! and are hashed to 71 bytes past [`MAX_TEXT_KEY_LEN`]. IPv6 clients are grouped by /64, and
//! IPv4-mapped addresses and NAT64 `64:ff9b::/96` addresses of global IPv4 clients are counted
//! as those clients.
//!
//! **A request is never unlimited because its key is missing.** When a rule's extractor finds no
//! key, the request is counted under [`Key::unidentified`], and the first such request is
//! reported through `tracing` with the fix for the server in use (axum: serve with
//! `into_make_service_with_connect_info::<SocketAddr>()`; tonic: `Server::builder()` records the
//! peer, and tollgate reads it through its `tonic` feature, on by default). A client chooses to
//! be unidentified by leaving out what the extractor reads (a header, a body field): it then
//! spends the budget it shares with every other unidentified client. When unidentified clients
//! must not affect one another, chain a fallback by client IP.
//!
//! # Client IP behind proxies: [`ClientIp`]
//!
//! ```
//! use tollgate::ConfigError;
//! use tollgate::key::{ClientIp, ProxyHeader};
//!
//! fn extractors(cloudflare_ranges: &[&str]) -> Result<Vec<ClientIp>, ConfigError> {
//!     // The client is the rightmost X-Forwarded-For entry outside the trusted networks;
//!     // headers from any other peer are ignored.
//!     let client_ip = ClientIp::new().parse_trusted_proxies(["10.0.0.0/8", "fd00::/8"])?;
//!     let forwarded = ClientIp::new().parse_trusted_proxies(["10.0.0.0/8"])?.header(ProxyHeader::Forwarded);
//!     let two_hops = ClientIp::new().trusted_hops(2);
//!     let cloudflare = ClientIp::new().parse_trusted_proxies(cloudflare_ranges)?.header(ProxyHeader::CfConnectingIp);
//!     Ok(vec![client_ip, forwarded, two_hops, cloudflare])
//! }
//! # extractors(&["173.245.48.0/20"]).unwrap();
//! ```
//!
//! The peer address comes from axum's `ConnectInfo<SocketAddr>`, a `SocketAddr` extension, or
//! tonic's `TcpConnectInfo`, so gRPC needs no interceptor. The key falls back to the socket peer
//! when the client entry is `unknown`, obfuscated or malformed, when every hop is trusted, or
//! when there are fewer entries than trusted hops. At most 32 entries are read per request.
//! Misconfigurations (forwarding headers but no trusted proxy, every hop trusted) are reported
//! once through `tracing`, never per request and never with client addresses. Behind a proxy,
//! give the layer `ClientIp` as its key (`RateLimitLayerBuilder::key`) as well as its rules:
//! requests that a policy counts by the layer's key (those without a tenant) are otherwise
//! counted under the proxy's address.
//!
//! **Why the leftmost `X-Forwarded-For` entry is never used:** each proxy appends the address it
//! saw to the right of whatever the request already carried, so only the entries your own
//! proxies appended are true, and everything to their left was written by the client. Keying on
//! the leftmost entry lets any client pick a fresh key per request (or someone else's), which
//! turns the limit off; tollgate walks from the right and stops at the first address that is not
//! a trusted proxy.
//!
//! # An authenticated user, an API key, a lookup
//!
//! ```
//! use std::sync::Arc;
//! use tollgate::http::request::Parts;
//! use tollgate::key::{ClientIp, FromExtension, FromHeader, Key, KeyExtractor, KeyExtractorExt, async_fn};
//!
//! #[derive(Clone)]
//! struct User { id: u64 }          // inserted by your authentication layer
//!
//! struct Directory;                // your API-key directory
//! impl Directory {
//!     async fn tenant_of(&self, api_key: String) -> Option<String> { Some(format!("tenant-of-{api_key}")) }
//! }
//!
//! fn extractors(directory: Arc<Directory>) -> (impl KeyExtractor, impl KeyExtractor, impl KeyExtractor) {
//!     // Inserted by your auth layer (add it after the rate-limit layer so that it runs first).
//!     let user = FromExtension::new(|user: &User| Some(Key::text(user.id.to_string())));
//!     // A secret header, hashed; requests without it by client IP.
//!     let api_key = FromHeader::new("x-api-key").hashed().or(ClientIp::new());
//!     // A lookup: a closure returning a future.
//!     let tenant = async_fn(move |parts: &Parts| {
//!         let token = parts.headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::to_owned);
//!         let directory = directory.clone();
//!         async move { directory.tenant_of(token?).await.map(Key::text) }
//!     });
//!     (user, api_key, tenant)
//! }
//! # let _ = extractors(Arc::new(Directory));
//! ```
//!
//! A header is only as trustworthy as whoever writes it: key by a header only when its value is
//! validated upstream or set by your own infrastructure.
//!
//! # A body field (login by email): `BodyKeyLayer` + `FromBody`
//!
//! ```
//! use axum::{Router, routing::post};
//! use tollgate::http::request::Parts;
//! use tollgate::key::{BodyKeyLayer, ClientIp, FromBody, Key, KeyExtractorExt};
//! use tollgate::{ConfigError, Quota, RateLimitLayer, Rule};
//!
//! async fn login_handler(body: String) -> String { format!("{} bytes", body.len()) }
//!
//! fn login() -> Result<Router, ConfigError> {
//!     // Bodies without a usable email share one budget, so padding a body cannot escape it.
//!     let no_account = |_: &Parts| Some(Key::text("login-without-account"));
//!     let limit = RateLimitLayer::builder()
//!         .rule(Rule::new("per-account", Quota::per_minute(5)).key(FromBody.or(no_account)))
//!         .rule(Rule::new("per-ip", Quota::per_minute(20)).key(ClientIp::new()))
//!         .build()?;
//!     Ok(Router::new()
//!         .route("/login", post(login_handler))
//!         .route_layer(limit)                        // inner
//!         .route_layer(BodyKeyLayer::new("email")))  // outer: runs first
//! }
//! # login().unwrap();
//! ```
//!
//! `BodyKeyLayer` (feature `axum`) works only on the routes where it is added. It reads JSON or
//! form bodies up to 16 KiB (`.limit(n)`), finds the top-level field, trims, lowercases and
//! hashes it, so rotating IPs buys no extra guesses and emails reach neither the store nor the
//! logs. The handler always receives the identical body, however large, and a client that sends
//! its body slowly holds none of the inner service's capacity meanwhile. A body over the limit,
//! of another content type or without the field passes through after at most the limit is held,
//! and `FromBody` finds no key: the chained fallback applies.
//!
//! The email is normalised by trimming and lowercasing only. If your application matches
//! accounts more loosely (Unicode case folding, Gmail's dots and `+tags`, aliases), one account
//! has several spellings here, and each spelling its own budget: normalise the field the way
//! your account lookup does (`Normalize::Exact` and your own canonical form upstream), or key
//! the rule by the account id your login handler resolves.
//!
//! # Per route, combined, with fallbacks
//!
//! ```
//! use tollgate::key::{ClientIp, FromExtension, FromHeader, Key, KeyExtractor, KeyExtractorExt, Route, combine, first_of};
//!
//! #[derive(Clone)]
//! struct User { id: u64 }
//!
//! fn extractors() -> Vec<Box<dyn KeyExtractor>> {
//!     let user = FromExtension::new(|user: &User| Some(Key::text(user.id.to_string())));
//!     let per_client_and_route = ClientIp::new().and(Route::new());   // 203.0.113.7 + /users/{id}
//!     let per_method_and_route = Route::new().with_method();          // GET /users/{id}
//!     let tenant_route = combine((FromHeader::new("x-tenant"), Route::new()));            // both, or no key
//!     let who = first_of((user, FromHeader::new("x-api-key").hashed(), ClientIp::new())); // first found
//!     vec![Box::new(per_client_and_route), Box::new(per_method_and_route), Box::new(tenant_route), Box::new(who)]
//! }
//! # assert_eq!(extractors().len(), 4);
//! ```
//!
//! The route is axum's `MatchedPath` pattern, never the raw URI (a client could vary that); for
//! a gRPC call it is the `/package.Service/Method` path. In a fallback chain, text keys from the
//! second extractor onward are tagged with their position, so a client sending
//! `X-Api-Key: alice` is not counted as the user `alice`.

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
pub(crate) mod route;

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
pub(crate) use identity::{canonical_net, hex_digest, nat64_net};
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
