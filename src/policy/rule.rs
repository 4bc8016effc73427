use std::fmt;
use std::sync::Arc;

use std::time::Duration;

use super::key_spec::KeySpec;
use super::{Cost, FailureMode, Quota, RuleMode};
use crate::algorithm::Limits;
use crate::key::{KeyExtractor, SharedExtractor};
use crate::store::RuleSpec;
use crate::{Algorithm, ConfigError};

/// One limit: a name, a [`Quota`], an [`Algorithm`], who it counts (a
/// [`KeyExtractor`]) and what a request [`Cost`]s.
///
/// ```
/// use tollgate::key::Global;
/// use tollgate::{Algorithm, Quota, Rule};
///
/// let rule = Rule::new("search", Quota::per_minute(60))
///     .algorithm(Algorithm::SlidingWindowCounter)
///     .key(Global)
///     .cost(2);
/// assert_eq!(rule.name(), "search");
/// ```
///
/// The name identifies the rule in headers, metrics and store keys: two layers that share a
/// store share a budget under the same rule name, and must give it the same quota and algorithm
/// (the layer's `build()` refuses otherwise). Names are 1 to 64 characters of
/// `A-Z a-z 0-9 - _ .`.
///
/// Without [`key`](Rule::key) the rule uses the layer's default extractor (the client's peer IP).
/// A request whose key the extractor cannot find is counted under one shared "unidentified" key
/// unless the rule says [`skip_unidentified`](Rule::skip_unidentified).
#[derive(Clone)]
pub struct Rule {
    pub(crate) name: String,
    pub(crate) quota: Quota,
    pub(crate) algorithm: Algorithm,
    pub(crate) key: Option<SharedExtractor>,
    /// The key as a rules file names it (wins over `key`).
    pub(crate) key_spec: Option<KeySpec>,
    pub(crate) cost: Cost,
    pub(crate) on_store_error: Option<FailureMode>,
    pub(crate) skip_unidentified: bool,
    pub(crate) mode: RuleMode,
}

impl Rule {
    /// A token-bucket rule named `name` with `quota`.
    pub fn new(name: impl Into<String>, quota: Quota) -> Self {
        Rule {
            name: name.into(),
            quota,
            algorithm: Algorithm::default(),
            key: None,
            key_spec: None,
            cost: Cost::default(),
            on_store_error: None,
            skip_unidentified: false,
            mode: RuleMode::Enforce,
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
        self.key_spec = None;
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

    /// Lets a request through this rule when its extractor finds no key.
    ///
    /// By default such requests are not unlimited: they share one budget under the key
    /// [`Key::unidentified`](crate::key::Key::unidentified), so that a missing header or peer
    /// address (a server that does not record it, a proxy that strips it) never turns the limit
    /// off. The first such request of each rule is reported through `tracing` with the fix to
    /// apply. Skip them only when another rule limits them, or when not being identified is
    /// itself a guarantee (an internal route that only authenticated callers reach).
    pub fn skip_unidentified(mut self) -> Self {
        self.skip_unidentified = true;
        self
    }

    /// Checks and charges the rule as if it were enforced, but admits what it would deny and
    /// says so instead (see [`RuleMode::Shadow`]).
    pub fn shadow(mut self) -> Self {
        self.mode = RuleMode::Shadow;
        self
    }

    /// Makes a request over the limit wait for its budget, up to `max`, instead of denying it
    /// (see [`RuleMode::Delay`]).
    pub fn delay(mut self, max: Duration) -> Self {
        self.mode = RuleMode::Delay { max };
        self
    }

    /// What the rule does with a request over its limit (default [`RuleMode::Enforce`]).
    pub fn mode(&self) -> RuleMode {
        self.mode
    }

    /// The rule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The rule's quota.
    pub fn quota(&self) -> &Quota {
        &self.quota
    }

    /// Whether `other` is the same rule: the same name, numbers, algorithm, mode and failure
    /// mode, and the same key extractor and cost function (the same values, cloned).
    pub(crate) fn same_as(&self, other: &Rule) -> bool {
        let same_key = match (&self.key, &other.key) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        let same_cost = match (&self.cost, &other.cost) {
            (Cost::Fixed(a), Cost::Fixed(b)) => a == b,
            (Cost::Dynamic(a), Cost::Dynamic(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        self.name == other.name
            && self.quota == other.quota
            && self.algorithm == other.algorithm
            && self.on_store_error == other.on_store_error
            && self.skip_unidentified == other.skip_unidentified
            && self.mode == other.mode
            && same_key
            && self.key_spec == other.key_spec
            && same_cost
    }

    /// Validates the rule and fixes its key extractor.
    pub(crate) fn compile(
        self,
        default_key: &SharedExtractor,
        layer_key: &SharedExtractor,
        default_failure: FailureMode,
    ) -> Result<CompiledRule, ConfigError> {
        let name = self.name;
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
        let period = u64::try_from(quota.period().as_micros()).unwrap_or(u64::MAX);
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
        if let RuleMode::Delay { max } = self.mode
            && (max.is_zero() || max > MAX_DELAY)
        {
            return Err(ConfigError::in_rule(
                &name,
                format_args!(
                    "a delay rule waits at most {max:?}; give it a maximum between 1 ms and {} s",
                    MAX_DELAY.as_secs()
                ),
            ));
        }
        let spec = RuleSpec::new(name, self.algorithm, limits)?;
        Ok(CompiledRule {
            spec: Arc::new(spec),
            key: match (self.key_spec, self.key) {
                (Some(spec), _) => spec.extractor(layer_key),
                (None, Some(key)) => key,
                (None, None) => default_key.clone(),
            },
            cost: self.cost,
            on_store_error: self.on_store_error.unwrap_or(default_failure),
            skip_unidentified: self.skip_unidentified,
            mode: self.mode,
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
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

/// A rule ready to run: its spec, its key extractor and its cost.
#[derive(Clone)]
pub(crate) struct CompiledRule {
    pub(crate) spec: Arc<RuleSpec>,
    pub(crate) key: SharedExtractor,
    pub(crate) cost: Cost,
    pub(crate) on_store_error: FailureMode,
    pub(crate) skip_unidentified: bool,
    pub(crate) mode: RuleMode,
}

/// The longest a [`RuleMode::Delay`] rule may make a request wait.
pub(crate) const MAX_DELAY: Duration = Duration::from_secs(60);
