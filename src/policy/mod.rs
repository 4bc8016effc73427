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
//!     .tenant(TenantFromHeader::new("x-api-key").hashed().lookup(|key: &str| {
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
//! # Which rules apply
//!
//! For each request the most specific rule set wins, and the rules of that set are checked
//! together, all or nothing:
//!
//! 1. the tenant's exception for the route;
//! 2. the rules of the tenant's tier for the route;
//! 3. the rules of the tenant's tier;
//! 4. the default tier's rules for the route, then its own rules.
//!
//! A request without a tenant, from a tenant the policy does not list whose extractor gave no
//! known tier, gets the default tier; the default tier must have rules of its own (or the policy rules for
//! every tier), so **no request is ever unlimited** (a policy without one does not build). A route is an axum route
//! pattern (`/users/{id}`, never the raw path) or a gRPC method (`/package.Service/Method`),
//! optionally after an HTTP method (`POST /search`). With a tenant extractor, rules without a
//! `key` count **per tenant**, and requests without a tenant by the layer's key.
//!
//! **Behind a proxy**, the layer's key is the socket peer unless you set one: every request
//! without a tenant would be counted under the proxy's address, one budget for every anonymous
//! client. Give the layer the client's address as its key:
//!
//! ```
//! use tollgate::RateLimitLayer;
//! use tollgate::key::ClientIp;
//! use tollgate::policy::{Policy, Tier, TenantFromHeader, Tenant};
//! use tollgate::{Quota, Rule};
//!
//! # fn main() -> Result<(), tollgate::ConfigError> {
//! let policy = Policy::new("v1")
//!     .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(100))))
//!     .default_tier("free");
//! let layer = RateLimitLayer::builder()
//!     .policy(policy)
//!     .tenant(TenantFromHeader::new("x-api-key").lookup(|key: &str| {
//!         key.strip_prefix("pro-").map(|org| Tenant::new(org).with_tier("pro"))
//!     }))
//!     // Anonymous requests: by the client your proxies (10.0.0.0/8) saw, not by the proxy.
//!     .key(ClientIp::new().parse_trusted_proxies(["10.0.0.0/8"])?)
//!     .build()?;
//! # let _ = layer;
//! # Ok(())
//! # }
//! ```
//!
//! Tenants come from an extractor, like keys: [`TenantFromExtension`] (a [`Tenant`] your
//! authentication layer inserted: the common case), [`TenantFromHeader`] with a lookup
//! (`lookup` for a map, `lookup_async` for a directory behind a network call), [`FixedTenant`],
//! or any closure over the request head. A tenant is trusted as found: return only tenants you
//! verified, or a client could invent one per request. The layer inserts the tenant it found as
//! a request extension, for your handlers.
//!
//! # The rules file
//!
//! With the feature `toml` (on by default), [`Policy::from_toml`]`(text, name)` and
//! [`Policy::from_file`]`(path)` read a file into a [`Policy`], and [`FileSource`] re-reads it
//! while serving (`RateLimitLayerBuilder::policy_source`). A `Policy` built in code decides
//! exactly as the same file (a property test holds them together). A complete file:
//!
//! ```toml
//! # Any text; PolicyHandle::version() answers the version in force.
//! version = "2026-12-01.1"
//! # Requests without a tenant, unknown tenants, tiers the policy does not have.
//! default_tier = "free"
//!
//! # Optional: options for every rule that does not set its own.
//! [defaults]
//! algorithm = "token-bucket"   # gcra, fixed-window, sliding-window-log, sliding-window-counter, concurrency
//! on_store_error = "open"      # closed, local
//!
//! [tiers.free]
//! rules = [
//!   { name = "free", limit = 5, per = "minute" },
//!   { name = "free-daily", limit = 500, per = "day", algorithm = "fixed-window" },
//! ]
//!
//! [tiers.pro]
//! rules = [{ name = "pro", limit = 50, per = "minute", burst = 100 }]
//!
//! # Per route within a tier: instead of the tier's own rules on this route.
//! [tiers.pro.routes."POST /search"]
//! rules = [
//!   { name = "pro-search", limit = 10, per = "minute", cost = 1 },
//!   # Rolled out dark: checked and charged, never denies, logged as "would deny".
//!   { name = "pro-search-next", limit = 5, per = "minute", mode = "shadow" },
//! ]
//!
//! [tiers.pro.routes."/export"]
//! # Smoothed, not refused: a request waits up to 2 s for its unit, then proceeds.
//! rules = [{ name = "pro-export", limit = 1, per = "second", mode = "delay", max_delay = "2s" }]
//!
//! [tenants.acme]
//! tier = "pro"
//! # An exception for one tenant on one route.
//! routes."/search".rules = [{ name = "acme-search", limit = 2, per = "minute" }]
//!
//! [tenants.big-customer]
//! tier = "pro"
//! routes."/search".rules = [
//!   # Keys: ip (the layer's key), tenant, global, route, method-route, header:<name>, or a+b.
//!   { name = "big-search", limit = 1000, per = "minute", key = "tenant+route", on_store_error = "local" },
//! ]
//!
//! [lists]
//! allow = ["203.0.113.0/24", "tenant:internal"]    # never limited
//! deny = ["192.0.2.0/24", "2001:db8:bad::/48", "tenant:abuser", "key:9f86d081"]   # 403
//!
//! # Optional: this region's share of every quota (each region enforces it in its own store).
//! # [region]
//! # name = "eu-west"
//! # share = 0.5
//! ```
//!
//! | rule field | meaning |
//! |---|---|
//! | `name` | the rule's budget: one name is one budget in the store; a name may appear in several places only for the same rule |
//! | `limit`, `per` | `limit` units per `second`, `minute`, `hour`, `day` or a duration (`"30s"`, `"15m"`, `"2h"`, `"7d"`); with `algorithm = "concurrency"`, `limit` requests in flight, each slot held at most `per` |
//! | `burst` | token bucket and GCRA: the bucket size (default `limit`) |
//! | `algorithm`, `cost`, `on_store_error`, `skip_unidentified` | as [`Rule`] in code |
//! | `key` | who is counted (default: the tenant, else the layer's key) |
//! | `mode` | `enforce` (default), `shadow`, or `delay` with `max_delay` |
//! | `lease`, `lease_ttl` | on Redis: units each replica takes at once, and how long it may spend them ([`Rule::lease`](crate::Rule::lease)) |
//! | `split` | on Redis: sub-keys of each key ([`Rule::split`](crate::Rule::split)) |
//!
//! Errors name the file, the line and the column, and what to change
//! (`tiers.toml:12:3: rule "free": per = "fortnight" is not a period; write "second", …`).
//!
//! # Live reload
//!
//! [`FileSource`] checks the file every second (`.interval(..)`): it polls, one `stat` per
//! interval, because that needs no platform watch API and sees every way a file is replaced,
//! including the symlink swap of a Kubernetes ConfigMap. The layer reads its policy through an
//! atomically swapped snapshot: no lock on the request path, and a request finishes under the
//! policy it started with. A file with a syntax error, a policy that breaks a check (no default
//! tier, one name with two quotas), or a missing file **never replaces the policy in force**: the
//! error is logged once per bad version (target `tollgate::policy`) and counted
//! ([`PolicyHandle::rejected`]); the next good file is picked up. Your own source (a
//! configuration service, a database) implements [`PolicySource`], or pushes policies with
//! `layer.policy_handle().unwrap().install(policy)`.
//!
//! Budgets live in the store under each rule's name, so a reload keeps the state of every rule
//! whose name and algorithm it keeps and reads it with the new numbers at once: window
//! algorithms keep their counts (40 used of 50 this hour leaves none under a new quota of 30);
//! token bucket and GCRA keep the time at which the bucket is full again. A renamed rule starts
//! from a full budget, and a rule whose algorithm changed starts again from no state.
//!
//! # Shadow, delay, lists and regions
//!
//! * **Shadow** (`mode = "shadow"`, [`Rule::shadow`](crate::Rule::shadow)): the rule is checked
//!   and charged as if it were enforced; a request it would deny is admitted and logged at
//!   `info` (target `tollgate::shadow`, "would deny"), and it adds no fields to answers. How a
//!   new limit is rolled out: watch what it would do, then enforce it.
//! * **Delay** (`mode = "delay"`, [`Rule::delay`](crate::Rule::delay)): a request over the limit
//!   waits until its unit should be there, is checked again, and proceeds when admitted (smooth
//!   output, at the cost of latency); one that would wait longer than `max_delay` is denied at
//!   once. Waiting requests hold no reservation: those that wake for the same unit race for it,
//!   and the others wait again while `max_delay` allows. The wait holds no lock and no store
//!   connection, ends when the client goes away, and at most `max_waiting` requests (default
//!   1024) wait per layer.
//! * **Lists**: `allow` entries are never limited; `deny` entries get `403 Forbidden` with a
//!   problem body (gRPC `PERMISSION_DENIED`); deny wins (a denied tenant from an allowed network
//!   is refused). Entries are addresses and networks (matched against the layer's key: the
//!   peer, or `ClientIp` behind proxies; IPv6 clients by their /64, so IPv6 entries are /64 or
//!   shorter, or IPv4-mapped networks, which stand for their IPv4 network), `tenant:<id>`, and
//!   `key:<text>` (a text key of the layer's extractor). Lists reload with the policy. Never
//!   allow-list your own proxies' networks: a request whose client IP cannot be found is keyed
//!   by the proxy's address.
//! * **Regions**: a fleet that spans regions should not pay a cross-region round trip per
//!   request. With `[region] name = "eu-west", share = 0.5`, every quota of the policy is scaled
//!   by the share (rounded down, at least 1), and each region enforces its share in its own
//!   store (its own Redis, or its own prefix: `RedisStore::builder(url).prefix("tollgate:eu-west")`).
//!   The fleet admits at most the global quota when the shares add up to 1; the price is that a
//!   client whose traffic all lands in one region gets only that region's share.
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
//!     .tenant(TenantFromHeader::new("x-api-key").hashed().lookup(|key: &str| {
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
//!
#![cfg_attr(
    not(feature = "toml"),
    doc = "[`Policy::from_toml`]: https://docs.rs/tollgate/latest/tollgate/policy/struct.Policy.html#method.from_toml
[`Policy::from_file`]: https://docs.rs/tollgate/latest/tollgate/policy/struct.Policy.html#method.from_file
[`FileSource`]: https://docs.rs/tollgate/latest/tollgate/policy/struct.FileSource.html"
)]

/// The most rules one layer may hold.
///
/// Every rule of a layer is checked in one atomic step: all charged or none. Layers stacked on
/// one another are checked one after the other, so a request that an inner layer denies keeps
/// the charges of the outer ones: put rules that must be all-or-nothing in one layer.
pub const MAX_RULES: usize = 32;

mod applied;
pub(crate) mod cost;
pub(crate) mod failure;
#[cfg(feature = "toml")]
mod file;
mod key_spec;
pub(crate) mod lists;
pub(crate) mod metering;
pub(crate) mod mode;
mod model;
pub(crate) mod outcome;
pub(crate) mod quota;
pub(crate) mod resolve;
pub(crate) mod rule;
pub(crate) mod share;
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

pub(crate) use applied::{Applied, AppliedRules, RuleIndices};
pub(crate) use cost::Cost;
pub(crate) use failure::FailureMode;
pub(crate) use mode::RuleMode;
pub(crate) use quota::Quota;
pub(crate) use resolve::{Resolution, Resolved};
pub(crate) use rule::{CompiledRule, Rule};
pub(crate) use source::{Live, Registrar};
pub(crate) use tenant::SharedTenantExtractor;
