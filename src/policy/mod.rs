//! What is limited and how much, by tier, tenant and route: [`Policy`], read from code or from
//! a rules file, and reloaded while serving.
//!
//! ```
//! use axum::{Router, routing::get};
//! use tollgate::policy::{Policy, Tenant, TenantFromHeader, TenantRules, Tier};
//! use tollgate::{Quota, RateLimitLayer, Rule};
//!
//! let policy = Policy::new("v1")
//!     .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(5))))
//!     .tier(Tier::new("pro").rule(Rule::new("pro", Quota::per_minute(50))))
//!     .default_tier("free")
//!     .tenant(TenantRules::new("acme").tier("pro").route(
//!         "/search",
//!         [Rule::new("acme-search", Quota::per_minute(2))],
//!     ));
//! let layer = RateLimitLayer::builder()
//!     .policy(policy)
//!     // A real service verifies API keys in its directory here.
//!     .tenant(TenantFromHeader::new("x-api-key").lookup(|key: &str| {
//!         let (tier, _) = key.split_once('-')?;
//!         Some(Tenant::new(key).with_tier(tier))
//!     }))
//!     .build()?;
//! let app: Router = Router::new()
//!     .route("/", get(|| async { "hello" }))
//!     .route("/search", get(|| async { "results" }))
//!     .layer(layer);
//! # Ok::<(), tollgate::ConfigError>(())
//! ```
//!
//! * [`Policy`], [`Tier`], [`TenantRules`]: rules by tier, tenant and route, and which set wins.
//! * [`Tenant`] and the [`TenantExtractor`]s: who the tenant is and which tier it has.
//! * [`Policy::from_toml`] (feature `toml`): the rules file.
//! * [`PolicySource`], [`FileSource`], [`PolicyHandle`]: live reload.
//! * [`Listed`]: allow and deny lists; [`Region`]: a region's share of each quota.
//! * [`RuleMode`]: shadow and delay rules.
//!
//! # Rules for every tier
//!
//! "100 per minute per IP for everyone, plus the tier's limits" is one policy and one layer:
//! [`Policy::all_tiers`] adds rules to every request's set, whatever its tier, tenant and
//! route, and [`Policy::all_tiers_route`] adds rules for one route in every tier. They are
//! checked with the tier's rules in the same atomic step, all or nothing: a request that one
//! rule refuses is charged to none (see [`Policy`](Policy#rules-for-every-tier)). In a rules
//! file they are the table `[all_tiers]`, which has the form of a tier (`rules`, and `routes`
//! with their `rules`). Here, every request may make 100 a minute per client IP (the layer's
//! key, `ip`), and `POST /login` 5 attempts per 15 minutes per IP, in every tier:
//!
//! ```
//! # #[cfg(feature = "toml")] {
//! use tollgate::key::ClientIp;
//! use tollgate::policy::{Policy, Tenant, TenantFromHeader};
//! use tollgate::RateLimitLayer;
//!
//! let policy = Policy::from_toml(r#"
//! version = "v1"
//! default_tier = "free"
//!
//! [tiers.free]
//! rules = [{ name = "free", limit = 10, per = "minute" }]
//!
//! [tiers.pro]
//! rules = [{ name = "pro", limit = 1000, per = "minute" }]
//!
//! [all_tiers]
//! rules = [{ name = "per-ip", limit = 100, per = "minute", key = "ip" }]
//! routes."POST /login".rules = [
//!   { name = "login", limit = 5, per = "15m", key = "ip", algorithm = "fixed-window" },
//! ]
//! "#, "tiers.toml")?;
//! let layer = RateLimitLayer::builder()
//!     .policy(policy)
//!     .tenant(TenantFromHeader::new("x-api-key").lookup(|key: &str| {
//!         let (tier, _) = key.split_once('-')?;
//!         Some(Tenant::new(key).with_tier(tier))
//!     }))
//!     // Behind a proxy, the layer's key (`ip`, and requests without a tenant) must read the
//!     // client through it: else every anonymous client shares the proxy's budget.
//!     .key(ClientIp::new().parse_trusted_proxies(["10.0.0.0/8"])?)
//!     .build()?;
//! # let _ = layer;
//! # }
//! # Ok::<(), tollgate::ConfigError>(())
//! ```

pub(crate) mod cost;
pub(crate) mod failure;
#[cfg(feature = "toml")]
mod file;
mod key_spec;
pub(crate) mod mode;
mod model;
pub(crate) mod outcome;
pub(crate) mod quota;
pub(crate) mod rule;
pub(crate) mod snapshot;
mod source;
mod tenant;

pub use model::{Listed, Policy, Region, TenantRules, Tier};
#[cfg(feature = "toml")]
pub use source::{FileSource, MAX_FILE_LEN};
pub use source::{PolicyHandle, PolicySource};
pub use tenant::{
    FixedTenant, Found, MAX_HEADER_VALUE_LEN, Tenant, TenantExtractor, TenantFromExtension,
    TenantFromHeader, TenantFuture, TenantKey,
};

pub(crate) use cost::Cost;
pub(crate) use failure::FailureMode;
pub(crate) use mode::RuleMode;
pub(crate) use quota::Quota;
pub(crate) use rule::{CompiledRule, Rule};
pub(crate) use source::{Live, Registrar};
pub(crate) use tenant::SharedTenantExtractor;
