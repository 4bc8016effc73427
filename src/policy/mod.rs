//! What is limited and how much: [`Quota`], [`Rule`], [`Cost`].
//!
//! ```
//! use tollgate::policy::{Algorithm, Quota, Rule};
//!
//! // 10 per second with bursts of 20, and 1000 per day: checked together, all or nothing.
//! let rules = [
//!     Rule::new("burst", Quota::per_second(10).burst(20)),
//!     Rule::new("daily", Quota::per_day(1000)).algorithm(Algorithm::FixedWindow),
//! ];
//! assert_eq!(rules[0].quota().limit(), 10);
//! ```

mod breaker;
mod cost;
mod error;
mod failure;
mod quota;
mod rule;

pub use crate::algorithm::Algorithm;
pub use breaker::CircuitBreaker;
pub use cost::Cost;
pub use error::ConfigError;
pub use failure::FailureMode;
pub use quota::Quota;
pub use rule::{MAX_LOG_ENTRIES, Rule, RuleSpec};

pub(crate) use breaker::Breaker;
pub(crate) use rule::CompiledRule;
