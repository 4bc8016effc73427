//! Who the tenant is and which tier it has: [`Tenant`], the [`TenantExtractor`] trait and its
//! implementations.
//!
//! ```
//! use tollgate::policy::{Tenant, TenantExtractor, TenantFromHeader, Found};
//!
//! // API keys of the form "<tier>-<anything>"; a real service looks them up in its directory.
//! let by_api_key = TenantFromHeader::new("x-api-key").lookup(|key: &str| {
//!     let (tier, _) = key.split_once('-')?;
//!     Some(Tenant::new(key).with_tier(tier))
//! });
//! let (parts, ()) = http::Request::get("/").header("x-api-key", "pro-1234").body(()).unwrap().into_parts();
//! let Found::Tenant(tenant) = by_api_key.tenant(&parts) else { panic!() };
//! assert_eq!(tenant.id(), "pro-1234");
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
/// [`TenantFromExtension`] to find; the rate-limit layer also inserts the tenant it found, so
/// that handlers can read it.
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

    /// The tenant's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The tier the extractor gave it, if any.
    pub fn tier(&self) -> Option<&str> {
        self.tier.as_deref()
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
/// network call). A missing header, a value that is not visible ASCII, or a value longer than
/// [`MAX_HEADER_VALUE_LEN`] is no tenant, as is a value the lookup does not know.
#[derive(Clone)]
pub struct TenantFromHeader {
    name: HeaderName,
    lookup: Lookup,
    timeout: Duration,
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
        match value.to_str() {
            Ok(value) if !value.is_empty() => match (self.lookup)(value) {
                // The timer needs tokio's runtime, as the lookups of servers have.
                Found::Pending(lookup) if tokio::runtime::Handle::try_current().is_ok() => {
                    let timeout = self.timeout;
                    Found::Pending(Box::pin(async move {
                        tokio::time::timeout(timeout, lookup).await.ok().flatten()
                    }))
                }
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
        parts
            .extensions
            .get::<Tenant>()
            .map(|tenant| crate::key::Key::text(tenant.id()))
            .into()
    }
}
