//! Replaying recorded traffic against rules (features `testing` and `axum`): requests sent
//! through a real [`RateLimitLayer`](crate::RateLimitLayer) on a clock you move, and a
//! [`Report`] of what each rule, tier, tenant and route admitted and denied.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::RateLimitLayer;
//! use tollgate::clock::ManualClock;
//! use tollgate::policy::{Policy, Tenant, TenantFromHeader};
//! use tollgate::replay::{Arrival, Replay};
//! use tollgate::store::MemoryStore;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // The new rules (in your repository: Policy::from_file("rules.toml")?).
//! let rules = Policy::from_toml(
//!     r#"
//!     version = "next"
//!     default_tier = "free"
//!     tiers.free.rules = [{ name = "free", limit = 5, per = "minute" }]
//!     tiers.enterprise.rules = [{ name = "enterprise", limit = 1000, per = "minute" }]
//!     "#,
//!     "rules.toml",
//! )?;
//! let clock = ManualClock::default();
//! let layer = RateLimitLayer::builder()
//!     .policy(rules)
//!     .tenant(TenantFromHeader::new("x-api-key").hashed().lookup(|key: &str| {
//!         let (tier, _) = key.split_once('-')?;
//!         Some(Tenant::new(key).with_tier(tier))
//!     }))
//!     .store(MemoryStore::builder().clock(clock.clone()).build()?);
//!
//! // Yesterday's traffic (in your repository: Traffic::open("yesterday.jsonl")? and
//! // run_traffic): a minute of one enterprise tenant, many free ones and one free bot.
//! let traffic = (0..3000u64).map(|n| {
//!     let key = match n % 100 {
//!         1 => "free-bot".to_owned(),
//!         m if m % 10 == 0 => "enterprise-acme".to_owned(),
//!         _ => format!("free-{}", n % 1000),
//!     };
//!     Arrival::get(Duration::from_millis(n * 20), "/search").key(key)
//! });
//! let report = Replay::new(layer).clock(clock).run(traffic).await?;
//!
//! // No enterprise tenant is denied; free-tier denials stay under 2 %.
//! assert_eq!(report.tier("enterprise").denied, 0);
//! assert!(report.tier("free").denied_share() < 0.02, "{report}");
//! // The bot's 30 requests in a minute: its burst of 5 and one more every 12 s admitted (the
//! // report names tenants as the layer does: by the digest of their key).
//! assert_eq!(report.tenant(Tenant::new("free-bot").hashed().id()).admitted, 9);
//! # Ok(())
//! # }
//! ```
//!
//! * [`Replay`]: the layer your builder builds, the routes it serves, how time moves.
//! * [`Arrival`]: one recorded request (time, client IP, method, path, key, cost, headers) and
//!   what the service answered (its status and what it really cost), which the replay answers.
//! * [`Traffic`]: arrivals read from a file, in one of three [`Format`]s: JSON lines, CSV with
//!   a header, or the common access log; a line that cannot be read ends the traffic with a
//!   [`TrafficError`] that names it, never skipped.
//! * [`Report`]: [`Counts`] in all and by rule, tier, tenant and route, and each decision if
//!   asked for ([`Replay::keep_decisions`]).
//! * [`LoadCheck`]: a bounded load on a running endpoint (staging, in CI), its admitted count
//!   and share of 429s compared with what a replay of the same arrivals predicts.
//!
//! On the memory store with a [`ManualClock`](crate::clock::ManualClock) a replay is
//! deterministic: the same traffic and rules give the same report, as fast as the layer
//! decides. On a Redis store the requests are sent at their times (or on the store's testing
//! clock, `RedisStore::builder().clock(..)`).

mod arrival;
mod load;
mod report;
mod run;
mod time;
mod traffic;

pub use arrival::Arrival;
pub use load::{LoadCheck, LoadCheckError, LoadOutcome};
pub use report::{Counts, Replayed, Report};
pub use run::{Replay, ReplayError};
pub use traffic::{Format, Traffic, TrafficError};
