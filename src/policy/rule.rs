use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;

use super::{Algorithm, ConfigError, Cost, FailureMode, Quota};
use crate::algorithm::{Limits, MICROS_PER_SECOND};
use crate::key::{KeyExtractor, SharedExtractor};

/// One limit: a name, a [`Quota`], an [`Algorithm`], who it counts (a
/// [`KeyExtractor`]) and what a request [`Cost`]s.
///
/// ```
/// use tollgate::key::Global;
/// use tollgate::policy::{Algorithm, Quota, Rule};
///
/// let rule = Rule::new("search", Quota::per_minute(60))
///     .algorithm(Algorithm::SlidingWindowCounter)
///     .key(Global)
///     .cost(2);
/// assert_eq!(rule.name(), "search");
/// ```
///
/// The name identifies the rule in headers, metrics and store keys: two layers that share a
/// store share a budget under the same rule name. Names are 1 to 64 characters of
/// `A-Z a-z 0-9 - _ .`.
///
/// Without [`key`](Rule::key) the rule uses the layer's default extractor (the client's peer IP).
#[derive(Clone)]
pub struct Rule {
    pub(crate) name: String,
    pub(crate) quota: Quota,
    pub(crate) algorithm: Algorithm,
    pub(crate) key: Option<SharedExtractor>,
    pub(crate) cost: Cost,
    pub(crate) on_store_error: Option<FailureMode>,
}

impl Rule {
    /// A token-bucket rule named `name` with `quota`.
    pub fn new(name: impl Into<String>, quota: Quota) -> Self {
        Rule {
            name: name.into(),
            quota,
            algorithm: Algorithm::default(),
            key: None,
            cost: Cost::default(),
            on_store_error: None,
        }
    }

    /// Chooses the algorithm (default: [`Algorithm::TokenBucket`]).
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// Chooses who the rule counts.
    pub fn key<K: KeyExtractor>(mut self, extractor: K) -> Self {
        self.key = Some(Arc::new(extractor));
        self
    }

    /// Sets what a request costs (default 1).
    pub fn cost(mut self, cost: impl Into<Cost>) -> Self {
        self.cost = cost.into();
        self
    }

    /// What to do for this rule when the store fails (default: the layer's
    /// [`on_store_error`](crate::RateLimitLayerBuilder::on_store_error)).
    pub fn on_store_error(mut self, mode: FailureMode) -> Self {
        self.on_store_error = Some(mode);
        self
    }

    /// The rule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The rule's quota.
    pub fn quota(&self) -> &Quota {
        &self.quota
    }

    /// Validates the rule and fixes its key extractor.
    pub(crate) fn compile(
        self,
        default_key: &SharedExtractor,
        default_failure: FailureMode,
    ) -> Result<CompiledRule, ConfigError> {
        let name = self.name;
        validate_name(&name)?;
        let quota = self.quota;
        if quota.burst_size().is_some() && !self.algorithm.has_burst() {
            return Err(ConfigError::in_rule(
                &name,
                format_args!(
                    "{} has no burst; remove .burst(..) or use Algorithm::TokenBucket or Algorithm::Gcra",
                    self.algorithm
                ),
            ));
        }
        if self.algorithm == Algorithm::SlidingWindowCounter && quota.limit() > u64::from(u32::MAX)
        {
            return Err(ConfigError::in_rule(
                &name,
                "the sliding window counter counts at most 4294967295 per window; lower the quota or use another algorithm",
            ));
        }
        let period = quota.period().as_micros();
        let period = u64::try_from(period).unwrap_or(u64::MAX);
        let limits = Limits::new(
            quota.limit(),
            period,
            quota.burst_size().unwrap_or(quota.limit()),
        )
        .map_err(|e| ConfigError::in_rule(&name, e))?;
        if let Cost::Fixed(cost) = self.cost {
            let capacity = self.algorithm.capacity(&limits);
            if cost > capacity {
                return Err(ConfigError::in_rule(
                    &name,
                    format_args!(
                        "a request costs {cost} but the rule never holds more than {capacity}; \
                         lower the cost or raise the quota{}",
                        if self.algorithm.has_burst() {
                            " or burst"
                        } else {
                            ""
                        }
                    ),
                ));
            }
        }
        let spec = RuleSpec::new(name, self.algorithm, limits);
        Ok(CompiledRule {
            spec: Arc::new(spec),
            key: self.key.unwrap_or_else(|| default_key.clone()),
            cost: self.cost,
            on_store_error: self.on_store_error.unwrap_or(default_failure),
        })
    }
}

impl fmt::Debug for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rule")
            .field("name", &self.name)
            .field("quota", &self.quota)
            .field("algorithm", &self.algorithm)
            .field("cost", &self.cost)
            .finish_non_exhaustive()
    }
}

/// The largest quota of a [`SlidingWindowLog`](Algorithm::SlidingWindowLog) rule: the log keeps
/// one entry (8 bytes in memory, a list element in Redis) per admitted request.
pub const MAX_LOG_ENTRIES: u64 = 10_000;

fn validate_name(name: &str) -> Result<(), ConfigError> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if name.is_empty() || name.len() > 64 || !name.chars().all(ok_char) {
        return Err(ConfigError::new(format!(
            "rule name {name:?} is not allowed; use 1 to 64 characters of A-Z a-z 0-9 - _ ."
        )));
    }
    Ok(())
}

/// The validated, store-facing part of a rule: what a [`Store`](crate::store::Store) needs to
/// check it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleSpec {
    name: Arc<str>,
    algorithm: Algorithm,
    limits: Limits,
    id: u64,
}

impl RuleSpec {
    /// A rule as a store sees it, for store implementations and tests. Nothing is validated here
    /// beyond what [`Limits::new`] checks: [`Rule`] validates the name, the sliding window
    /// counter's quota (at most `u32::MAX` per window) and the sliding log's (at most
    /// [`MAX_LOG_ENTRIES`]).
    pub fn new(name: impl Into<Arc<str>>, algorithm: Algorithm, limits: Limits) -> Self {
        let name = name.into();
        // A stable 64-bit id of the name, so that stores can key by a number.
        let mut hasher =
            foldhash::fast::FixedState::with_seed(0x746f_6c6c_6761_7465).build_hasher();
        hasher.write(name.as_bytes());
        let id = hasher.finish();
        RuleSpec {
            name,
            algorithm,
            limits,
            id,
        }
    }

    /// The rule's name.
    pub fn name(&self) -> &str {
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

/// A rule ready to run: its spec, its key extractor and its cost.
#[derive(Clone)]
pub(crate) struct CompiledRule {
    pub(crate) spec: Arc<RuleSpec>,
    pub(crate) key: SharedExtractor,
    pub(crate) cost: Cost,
    pub(crate) on_store_error: FailureMode,
}
