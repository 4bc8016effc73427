//! [`RuleSpec`]: a rule as a store sees it.

use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

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
    /// A stable number derived from the name, the algorithm and the numbers.
    fingerprint: u64,
    lease: Option<Lease>,
    /// The number of sub-keys a remote store splits a key into (1: not split), and the numbers
    /// of each sub-key.
    parts: u16,
    part_limits: Limits,
    /// The rule as the Redis code reads each charge's argument, up to the cost:
    /// `<algorithm>:<limit>:<period>:<burst>:<interval>:`; and of a sub-key.
    #[cfg(feature = "redis")]
    wire: (Arc<str>, Arc<str>),
}

/// How many units a replica leases at once for a rule, and for how long it may spend them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Lease {
    /// The most units taken from the shared budget in one call.
    pub units: u64,
    /// How long leased units may be spent; past it, those left are dropped.
    pub ttl: Duration,
}

/// The longest time leased units may be spent.
pub const MAX_LEASE_TTL: Duration = Duration::from_secs(60);

/// The most sub-keys a key may be split into.
pub const MAX_PARTS: u16 = 64;

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
        if algorithm == Algorithm::Concurrency && limits.limit > MAX_LOG_ENTRIES {
            return Err(ConfigError::in_rule(
                &name,
                format_args!(
                    "a concurrency limit keeps one entry per held slot, so it holds at most \
                     {MAX_LOG_ENTRIES} slots, not {}",
                    limits.limit
                ),
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
        let mut hasher = foldhash::fast::FixedState::with_seed(id).build_hasher();
        algorithm.hash(&mut hasher);
        limits.hash(&mut hasher);
        Ok(RuleSpec {
            name,
            algorithm,
            limits,
            id,
            fingerprint: hasher.finish(),
            lease: None,
            parts: 1,
            part_limits: limits,
            #[cfg(feature = "redis")]
            wire: {
                let wire = crate::store::redis::wire(algorithm, &limits);
                (wire.clone(), wire)
            },
        })
    }

    /// Leases up to `units` at once to each replica of a remote store, spent locally for at
    /// most `ttl` (see [`Rule::lease`](crate::Rule::lease)). The memory store ignores it.
    pub fn with_lease(mut self, units: u64, ttl: Duration) -> Result<Self, ConfigError> {
        if self.algorithm.is_concurrency() {
            return Err(ConfigError::in_rule(
                &self.name,
                "a concurrency slot is given back to the key that holds it: not leased",
            ));
        }
        let capacity = self.algorithm.capacity(&self.limits);
        if units < 2 || units > capacity {
            return Err(ConfigError::in_rule(
                &self.name,
                format_args!(
                    "a lease of {units} units; lease 2 to {capacity} (the most the rule holds)"
                ),
            ));
        }
        if ttl.is_zero() || ttl > MAX_LEASE_TTL {
            return Err(ConfigError::in_rule(
                &self.name,
                format_args!(
                    "leased units live {ttl:?}; give them between 1 ms and {} s",
                    MAX_LEASE_TTL.as_secs()
                ),
            ));
        }
        if self.parts > 1 {
            return Err(ConfigError::in_rule(
                &self.name,
                "a rule is either leased or split, not both: both spread a hot key's load, and \
                 together their error bounds would multiply",
            ));
        }
        self.lease = Some(Lease { units, ttl });
        Ok(self)
    }

    /// The rule's lease, if it has one.
    pub fn lease(&self) -> Option<Lease> {
        self.lease
    }

    /// Splits each key of this rule into `parts` sub-keys in a remote store, each with
    /// `1/parts` of the quota and burst, rounded down (see [`Rule::split`](crate::Rule::split)).
    /// The memory store keeps one key, with the whole quota.
    pub fn with_parts(mut self, parts: u16) -> Result<Self, ConfigError> {
        if !(2..=MAX_PARTS).contains(&parts) {
            return Err(ConfigError::in_rule(
                &self.name,
                format_args!("split into {parts} sub-keys; split into 2 to {MAX_PARTS}"),
            ));
        }
        if self.algorithm.is_concurrency() {
            return Err(ConfigError::in_rule(
                &self.name,
                "a concurrency limit counts the requests in flight of one key: not split",
            ));
        }
        let l = &self.limits;
        let k = u64::from(parts);
        if self.lease.is_some() {
            return Err(ConfigError::in_rule(
                &self.name,
                "a rule is either leased or split, not both: both spread a hot key's load, and \
                 together their error bounds would multiply",
            ));
        }
        let part = Limits::new(l.limit / k, l.period, l.burst / k).map_err(|_| {
            ConfigError::in_rule(
                &self.name,
                format_args!(
                    "split into {parts} sub-keys, each would hold less than one unit (a quota of \
                     {} and a burst of {}); split into fewer, or raise the quota",
                    l.limit, l.burst
                ),
            )
        })?;
        self.parts = parts;
        self.part_limits = part;
        #[cfg(feature = "redis")]
        {
            self.wire.1 = crate::store::redis::wire(self.algorithm, &part);
        }
        let mut hasher = foldhash::fast::FixedState::with_seed(self.fingerprint).build_hasher();
        hasher.write_u16(parts);
        self.fingerprint = hasher.finish();
        Ok(self)
    }

    /// Into how many sub-keys a remote store splits a key of this rule (1: not split).
    pub fn parts(&self) -> u16 {
        self.parts
    }

    /// The rule as the Redis code reads it, up to a charge's cost: of the whole key, and of a
    /// sub-key.
    #[cfg(feature = "redis")]
    pub(crate) fn wire(&self) -> &(Arc<str>, Arc<str>) {
        &self.wire
    }

    /// The numbers of each sub-key (the rule's own when it is not split).
    pub fn part_limits(&self) -> &Limits {
        &self.part_limits
    }

    /// A stable number derived from the name, the algorithm and the numbers: two specs with
    /// the same fingerprint count the same budget in the same way.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
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
