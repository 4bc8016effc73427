//! [`RuleSpec`]: a rule as a store sees it.

use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;

use crate::algorithm::{Limits, MAX_LOG_ENTRIES, MICROS_PER_SECOND};
use crate::{Algorithm, ConfigError};

/// The validated, store-facing part of a rule: its name, algorithm and numbers. What a
/// [`Store`](super::Store) needs to check it.
///
/// ```
/// use tollgate::Algorithm;
/// use tollgate::algorithm::Limits;
/// use tollgate::store::RuleSpec;
///
/// let limits = Limits::new(10, 60_000_000, 10)?; // 10 per minute
/// let spec = RuleSpec::new("api", Algorithm::TokenBucket, limits)?;
/// assert_eq!(spec.policy(), (10, 60));
/// // A sliding log of 50,000,000 entries per key is refused.
/// let huge = Limits::new(50_000_000, 86_400_000_000, 50_000_000)?;
/// assert!(RuleSpec::new("daily", Algorithm::SlidingWindowLog, huge).is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleSpec {
    name: Arc<str>,
    algorithm: Algorithm,
    limits: Limits,
    id: u64,
}

impl RuleSpec {
    /// Validates a rule as a store sees it: the name (1 to 64 characters of
    /// `A-Z a-z 0-9 - _ .`), the sliding window counter's quota (at most `u32::MAX` per window)
    /// and the sliding log's (at most [`MAX_LOG_ENTRIES`]). [`Limits::new`] checked the numbers.
    pub fn new(
        name: impl Into<Arc<str>>,
        algorithm: Algorithm,
        limits: Limits,
    ) -> Result<Self, ConfigError> {
        let name = name.into();
        validate_name(&name)?;
        if algorithm == Algorithm::SlidingWindowCounter && limits.limit > u64::from(u32::MAX) {
            return Err(ConfigError::in_rule(
                &name,
                "the sliding window counter counts at most 4294967295 per window; lower the quota or use another algorithm",
            ));
        }
        if algorithm == Algorithm::SlidingWindowLog && limits.limit > MAX_LOG_ENTRIES {
            return Err(ConfigError::in_rule(
                &name,
                format_args!(
                    "a sliding window log keeps one entry per request, so its quota is at most \
                     {MAX_LOG_ENTRIES}, not {}; use Algorithm::SlidingWindowCounter (two numbers \
                     per key, whatever the quota) or a shorter period",
                    limits.limit
                ),
            ));
        }
        // A stable 64-bit id of the name, so that stores can key by a number.
        let mut hasher =
            foldhash::fast::FixedState::with_seed(0x746f_6c6c_6761_7465).build_hasher();
        hasher.write(name.as_bytes());
        let id = hasher.finish();
        Ok(RuleSpec {
            name,
            algorithm,
            limits,
            id,
        })
    }

    /// The rule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The rule's name, shared.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) fn shared_name(&self) -> &Arc<str> {
        &self.name
    }

    /// The rule's algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The rule's numbers in microseconds.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// A stable number derived from the name (equal names give equal ids).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The policy as `(quota, window in whole seconds)` for `RateLimit-Policy`: for token bucket
    /// and GCRA, the burst and the time to refill it; for window algorithms, the quota and period.
    pub fn policy(&self) -> (u64, u64) {
        let l = &self.limits;
        let (quota, micros) = if self.algorithm.has_burst() {
            // burst × period / limit: the time to refill the whole burst.
            let micros = (l.burst as u128 * l.period as u128 / l.limit as u128) as u64;
            (l.burst, micros)
        } else {
            (l.limit, l.period)
        };
        // Rounded up: "q per w" never promises more than the rule allows.
        (quota, micros.div_ceil(MICROS_PER_SECOND).max(1))
    }
}

fn validate_name(name: &str) -> Result<(), ConfigError> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if name.is_empty() || name.len() > 64 || !name.chars().all(ok_char) {
        return Err(ConfigError::new(format!(
            "rule name {name:?} is not allowed; use 1 to 64 characters of A-Z a-z 0-9 - _ ."
        )));
    }
    Ok(())
}
