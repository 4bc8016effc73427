//! Who the tenant is and which tier it has: [`Tenant`], the [`TenantExtractor`] trait and its
//! implementations.
//!
//! ```
//! use tollgate::policy::{Tenant, TenantExtractor, TenantFromHeader, Found};
//!
//! // API keys of the form "<tier>-<anything>"; a real service looks them up in its directory.
//! // Each key is its own tenant, named by its digest: the key reaches no store and no log.
//! let by_api_key = TenantFromHeader::new("x-api-key").hashed().lookup(|key: &str| {
//!     let (tier, _) = key.split_once('-')?;
//!     Some(Tenant::new(key).with_tier(tier))
//! });
//! let (parts, ()) = http::Request::get("/").header("x-api-key", "pro-1234").body(()).unwrap().into_parts();
//! let Found::Tenant(tenant) = by_api_key.tenant(&parts) else { panic!() };
//! assert_eq!(tenant.id(), Tenant::new("pro-1234").hashed().id());
//! assert_eq!(tenant.tier(), Some("pro"));
//! ```
//!
//! The tenant decides which rules apply (its tier, and the exceptions the policy lists for it),
//! and, for rules without a key of their own, who is counted: each tenant has its own budget,
//! and requests without a tenant are counted by the layer's key (the client IP by default).
//! **A tenant is trusted as found**: an extractor must only return tenants it verified (an API
//! key from your directory, a user your authentication layer checked), or any client could
//! invent a tenant id per request and with it a fresh budget.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;
use http::request::Parts;

/// Who a request is for: a tenant id (an organisation, an account) and, optionally, the tier
/// its plan gives it. The policy's own entry for a tenant, when it has one, decides its tier
/// instead.
///
/// An authentication layer can insert a `Tenant` as a request extension, for
/// [`TenantFromExtension`] to find; the rate-limit layer also inserts the tenant its extractor
/// found, so that handlers can read it (`Option<axum::Extension<Tenant>>`). A request has
/// it whenever a tenant was found, whatever its tier: a tenant whose tier the policy does not
/// have is checked against the default tier's rules and still has its extension. A request without a tenant (no header, a key the lookup does
/// not know, a lookup that timed out) has none, though it gets the default tier too: the
/// extension tells a tenant from no tenant, and [`hashed`](Self::hashed) tenants carry their
/// digest there.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Tenant {
    id: Arc<str>,
    tier: Option<Arc<str>>,
}

impl Tenant {
    /// A tenant with no tier of its own (the policy's entry or the default tier decides).
    pub fn new(id: impl Into<Arc<str>>) -> Self {
        Tenant {
            id: id.into(),
            tier: None,
        }
    }

    /// Gives the tenant the tier its plan names. A tier the policy does not have means the
    /// default tier.
    pub fn with_tier(mut self, tier: impl Into<Arc<str>>) -> Self {
        self.tier = Some(tier.into());
        self
    }

    /// Names the tenant by the SHA-256 of its id instead of the id: `sha256:` and 64 hex digits,
    /// as [`Key::digest`](crate::key::Key::digest) writes them. For tenants named by an API key
    /// or a token, whose id then reaches neither the store's key names nor the logs; their
    /// entries in a policy, their list entries and an admin's [`Limiter`](crate::Limiter) calls
    /// name them by this digest. The tier stays.
    ///
    /// ```
    /// use tollgate::key::Key;
    /// use tollgate::policy::Tenant;
    ///
    /// let tenant = Tenant::new("free-bob").with_tier("free").hashed();
    /// assert_eq!(tenant.id(), Key::digest("free-bob").to_string());
    /// assert_eq!(tenant.id().len(), 71);
    /// assert_eq!(tenant.tier(), Some("free"));
    /// ```
    pub fn hashed(mut self) -> Self {
        self.id = crate::key::hex_digest(self.id.as_bytes()).into();
        self
    }

    /// The tenant's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The tier the extractor gave it, if any.
    pub fn tier(&self) -> Option<&str> {
        self.tier.as_deref()
    }

    /// The key that rules without a key of their own count this tenant by (the text of its id,
    /// as [`TenantKey`] makes it): with it, a [`Limiter`](crate::Limiter) reads, charges or
    /// resets a tenant's budget from your own code, an admin endpoint for one, with no request
    /// of the tenant's.
    ///
    /// ```
    /// use tollgate::policy::{Policy, Tenant, TenantFromHeader, Tier};
    /// use tollgate::{Quota, RateLimitLayer, Rule};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = RateLimitLayer::builder()
    ///     .policy(
    ///         Policy::new("v1")
    ///             .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(5))))
    ///             .default_tier("free"),
    ///     )
    ///     .tenant(TenantFromHeader::new("x-api-key").hashed())
    ///     .build()?;
    /// // The tenant whose requests carry `x-api-key: k-123`, named as the layer names it.
    /// let tenant = Tenant::new("k-123").hashed();
    /// let budget = layer.limiter().peek("free", &tenant.key()).await?;
    /// assert_eq!(budget.remaining, 5);
    /// # Ok(())
    /// # }
    /// ```
    pub fn key(&self) -> crate::key::Key {
        crate::key::Key::text(&*self.id)
    }
}

impl fmt::Debug for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tenant")
            .field("id", &self.id)
            .field("tier", &self.tier)
            .finish()
    }
}

/// A future that finds a tenant later (a lookup in a directory).
pub type TenantFuture = Pin<Box<dyn Future<Output = Option<Tenant>> + Send + 'static>>;

/// What a [`TenantExtractor`] found for a request.
pub enum Found {
    /// The tenant.
    Tenant(Tenant),
    /// No tenant: the request gets the default tier, counted by the layer's key.
    None,
    /// The tenant needs a lookup; the future resolves to `None` when there is none.
    Pending(TenantFuture),
    /// The tenant is the request's [`Tenant`] extension (as [`TenantFromExtension`] finds it:
    /// read in place, not copied).
    InExtensions,
}

impl From<Option<Tenant>> for Found {
    fn from(tenant: Option<Tenant>) -> Self {
        match tenant {
            Some(tenant) => Found::Tenant(tenant),
            None => Found::None,
        }
    }
}

impl fmt::Debug for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Found::Tenant(tenant) => f.debug_tuple("Tenant").field(tenant).finish(),
            Found::None => f.write_str("None"),
            Found::Pending(_) => f.write_str("Pending(..)"),
            Found::InExtensions => f.write_str("InExtensions"),
        }
    }
}

/// Finds the tenant of a request. Implemented for every `Fn(&Parts) -> Option<Tenant>` closure.
pub trait TenantExtractor: Send + Sync + 'static {
    /// The tenant of this request.
    fn tenant(&self, parts: &Parts) -> Found;
}

impl<F> TenantExtractor for F
where
    F: Fn(&Parts) -> Option<Tenant> + Send + Sync + 'static,
{
    fn tenant(&self, parts: &Parts) -> Found {
        self(parts).into()
    }
}

/// The [`Tenant`] an authentication layer inserted as a request extension (the common case).
///
/// ```
/// use tollgate::policy::{Tenant, TenantExtractor, TenantFromExtension, Found};
///
/// let mut request = http::Request::new(());
/// request.extensions_mut().insert(Tenant::new("acme"));
/// let (parts, ()) = request.into_parts();
/// assert!(matches!(TenantFromExtension.tenant(&parts), Found::InExtensions));
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct TenantFromExtension;

impl TenantExtractor for TenantFromExtension {
    fn tenant(&self, parts: &Parts) -> Found {
        if parts.extensions.get::<Tenant>().is_some() {
            Found::InExtensions
        } else {
            Found::None
        }
    }
}

/// One tenant for every request of the layer (a layer in front of one customer's service).
#[derive(Clone, Debug)]
pub struct FixedTenant(pub Tenant);

impl TenantExtractor for FixedTenant {
    fn tenant(&self, _parts: &Parts) -> Found {
        Found::Tenant(self.0.clone())
    }
}

type Lookup = Arc<dyn Fn(&str) -> Found + Send + Sync>;

/// A header's value mapped to a tenant through a lookup, synchronous
/// ([`lookup`](TenantFromHeader::lookup)) or asynchronous
/// ([`lookup_async`](TenantFromHeader::lookup_async), for an API-key directory behind a
/// network call).
///
/// The lookup gets the value as the request carries it: 1 to [`MAX_HEADER_VALUE_LEN`] bytes,
/// each a visible ASCII character (`!` to `~`), a space or a tab, not trimmed (HTTP servers
/// take off the spaces around a header's value; the ones inside stay). So
/// `Authorization: Bearer k-123` is looked up as `Bearer k-123`: take the scheme off in the
/// lookup. A missing header, an empty one, a longer one, one with any other byte (a control
/// character, a byte of UTF-8 past ASCII) is no tenant, as is a value the lookup does not know.
///
/// Tenants named by the API key itself put the key in the store's key names and, with
/// [`log_raw_keys`](crate::RateLimitLayerBuilder::log_raw_keys), in the logs:
/// [`hashed`](Self::hashed) names them by its digest instead.
///
/// ```
/// use tollgate::policy::{Found, Tenant, TenantExtractor, TenantFromHeader};
///
/// // `Authorization: Bearer <tier>-<anything>`; a real service looks keys up in its directory.
/// let by_bearer = TenantFromHeader::new("authorization").hashed().lookup(|value: &str| {
///     let (scheme, key) = value.split_once(' ')?;
///     let (tier, _) = key.split_once('-')?;
///     scheme.eq_ignore_ascii_case("bearer").then(|| Tenant::new(key).with_tier(tier))
/// });
/// let (parts, ()) = http::Request::get("/")
///     .header("authorization", "Bearer pro-1234")
///     .body(())
///     .unwrap()
///     .into_parts();
/// let Found::Tenant(tenant) = by_bearer.tenant(&parts) else { panic!() };
/// assert_eq!(tenant, Tenant::new("pro-1234").with_tier("pro").hashed());
/// assert!(!tenant.id().contains("1234"));
/// ```
#[derive(Clone)]
pub struct TenantFromHeader {
    name: HeaderName,
    lookup: Lookup,
    timeout: Duration,
    /// Whether the tenants found are named by the digest of their id.
    hashed: bool,
}

/// The longest header value [`TenantFromHeader`] looks up.
pub const MAX_HEADER_VALUE_LEN: usize = 256;

impl TenantFromHeader {
    /// The value of header `name` is the tenant's id (no tier of its own). Use
    /// [`lookup`](Self::lookup) to verify it: with this one, any client can name any tenant.
    ///
    /// # Panics
    ///
    /// If `name` is not a valid header name (a programming error, like `HeaderName::from_static`).
    pub fn new(name: &'static str) -> Self {
        TenantFromHeader {
            name: HeaderName::from_static(name),
            lookup: Arc::new(|value| Found::Tenant(Tenant::new(value))),
            timeout: Duration::from_secs(1),
            hashed: false,
        }
    }

    /// Maps the header's value to a tenant, or to none when the value is unknown.
    pub fn lookup<F>(mut self, f: F) -> Self
    where
        F: Fn(&str) -> Option<Tenant> + Send + Sync + 'static,
    {
        self.lookup = Arc::new(move |value| f(value).into());
        self
    }

    /// Maps the header's value to a tenant with an asynchronous lookup; the request waits for
    /// it before it is checked (without holding anything of the layer), at most
    /// [`timeout`](Self::timeout), after which it has no tenant. The lookup runs for every
    /// request that sends the header, before any limit applies: cache what it finds.
    pub fn lookup_async<F, Fut>(mut self, f: F) -> Self
    where
        F: Fn(String) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Option<Tenant>> + Send + 'static,
    {
        self.lookup = Arc::new(move |value| Found::Pending(Box::pin(f(value.to_owned()))));
        self
    }
}

impl TenantFromHeader {
    /// Names every tenant found by the SHA-256 of the id it was found with
    /// ([`Tenant::hashed`]): for tenants named by their API key or token (the value itself,
    /// without a lookup, or the key a lookup names the tenant by), which then reach neither
    /// the store's key names nor the logs. The lookup still gets the value, and decides whether
    /// there is a tenant and its tier. A tenant the policy lists (its tier, its exceptions, a
    /// list entry) is listed by that digest, `Tenant::new(id).hashed().id()`.
    ///
    /// When some tenants are named by a directory's id and others by their key, leave this off
    /// and return `Tenant::new(key).hashed()` from the lookup for the latter.
    pub fn hashed(mut self) -> Self {
        self.hashed = true;
        self
    }

    /// The longest an asynchronous lookup may take (default 1 s); a request whose lookup takes
    /// longer has no tenant (the default tier, by the layer's key).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

impl fmt::Debug for TenantFromHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TenantFromHeader")
            .field("name", &self.name)
            .field("hashed", &self.hashed)
            .finish_non_exhaustive()
    }
}

impl TenantExtractor for TenantFromHeader {
    fn tenant(&self, parts: &Parts) -> Found {
        let Some(value) = parts.headers.get(&self.name) else {
            return Found::None;
        };
        if value.len() > MAX_HEADER_VALUE_LEN {
            return Found::None;
        }
        let hashed = self.hashed;
        let name = move |tenant: Tenant| if hashed { tenant.hashed() } else { tenant };
        match value.to_str() {
            Ok(value) if !value.is_empty() => match (self.lookup)(value) {
                // The timer needs tokio's runtime, as the lookups of servers have.
                Found::Pending(lookup) if tokio::runtime::Handle::try_current().is_ok() => {
                    let timeout = self.timeout;
                    Found::Pending(Box::pin(async move {
                        tokio::time::timeout(timeout, lookup)
                            .await
                            .ok()
                            .flatten()
                            .map(name)
                    }))
                }
                Found::Pending(lookup) if hashed => {
                    Found::Pending(Box::pin(async move { lookup.await.map(name) }))
                }
                Found::Tenant(tenant) => Found::Tenant(name(tenant)),
                found => found,
            },
            _ => Found::None,
        }
    }
}

/// A shared, type-erased tenant extractor.
pub(crate) type SharedTenantExtractor = Arc<dyn TenantExtractor>;

/// A key per tenant: the id of the [`Tenant`] of the request (the one the layer found, or one an
/// authentication layer inserted as an extension); no key without a tenant.
///
/// In a layer with a tenant extractor
/// ([`RateLimitLayerBuilder::tenant`](crate::RateLimitLayerBuilder::tenant)), rules without a
/// key of their own count by tenant already, and by the layer's key when there is none.
///
/// ```
/// use tollgate::key::{Key, KeyExtractor};
/// use tollgate::policy::{Tenant, TenantKey};
///
/// let mut request = http::Request::new(());
/// request.extensions_mut().insert(Tenant::new("acme"));
/// let (parts, ()) = request.into_parts();
/// assert_eq!(TenantKey.extract(&parts).found(), Some(Key::text("acme")));
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct TenantKey;

impl crate::key::KeyExtractor for TenantKey {
    fn extract(&self, parts: &Parts) -> crate::key::Extracted {
        parts.extensions.get::<Tenant>().map(Tenant::key).into()
    }
}
