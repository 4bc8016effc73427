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
