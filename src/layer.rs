//! [`RateLimitLayer`] and its builder.
//!
//! ```
//! use axum::{Router, routing::get};
//! use tollgate::{Algorithm, Quota, RateLimitLayer, Rule};
//!
//! let layer = RateLimitLayer::builder()
//!     .rule(Rule::new("burst", Quota::per_second(10).burst(20)))
//!     .rule(Rule::new("daily", Quota::per_day(1000)).algorithm(Algorithm::FixedWindow))
//!     .build()?;
//! // Cheap to clone: every route and every connection shares the rules and the store.
//! let app: Router = Router::new().route("/", get(|| async { "hi" })).layer(layer.clone());
//! # Ok::<(), tollgate::ConfigError>(())
//! ```

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use tower_layer::Layer;

use crate::key::{KeyExtractor, PeerIp, SharedExtractor};
use crate::policy::{Breaker, CircuitBreaker, CompiledRule, ConfigError, FailureMode, Quota, Rule};
use crate::response::{Headers, PolicyItems, ProblemBodies, RateLimited};
use crate::service::RateLimit;
use crate::store::{MemoryStore, Store};
use crate::warn::{Every, Once};

/// A function that writes the response to a denied request.
pub(crate) type DeniedHandler = Arc<dyn Fn(&RateLimited) -> http::Response<Bytes> + Send + Sync>;

/// The most rules one layer may hold.
pub const MAX_RULES: usize = 32;

/// Applies rate limits to a service. See the [crate documentation](crate) for an example.
///
/// Cheap to clone: clones share the rules and the store.
pub struct RateLimitLayer<St = MemoryStore> {
    shared: Arc<Shared<St>>,
}

/// Everything the layer's services share.
pub(crate) struct Shared<St> {
    pub(crate) rules: Box<[CompiledRule]>,
    pub(crate) warned_missing_key: Box<[Once]>,
    pub(crate) policies: PolicyItems,
    pub(crate) problems: ProblemBodies,
    pub(crate) store: St,
    pub(crate) headers: Headers,
    pub(crate) on_denied: Option<DeniedHandler>,
    /// The local limiter of rules that fall back to one when the store fails.
    pub(crate) fallback: Option<MemoryStore>,
    pub(crate) warned_store_error: Every,
    pub(crate) breaker: Breaker,
}

impl RateLimitLayer<MemoryStore> {
    /// One token-bucket rule named `default`, counted per client IP (the socket peer), in a new
    /// memory store.
    ///
    /// ```
    /// use tollgate::{Quota, RateLimitLayer};
    ///
    /// let layer = RateLimitLayer::new(Quota::per_minute(60))?;
    /// # let _ = layer;
    /// # Ok::<(), tollgate::ConfigError>(())
    /// ```
    pub fn new(quota: Quota) -> Result<Self, ConfigError> {
        Self::builder().rule(Rule::new("default", quota)).build()
    }

    /// Configures a layer: rules, key, store, headers, denied response.
    pub fn builder() -> RateLimitLayerBuilder<MemoryStore> {
        RateLimitLayerBuilder {
            rules: Vec::new(),
            key: Arc::new(PeerIp::new()),
            store: StoreChoice::Default(MemoryStore::new),
            headers: Headers::default(),
            on_denied: None,
            on_store_error: FailureMode::default(),
            circuit_breaker: CircuitBreaker::default(),
        }
    }
}

impl<St> RateLimitLayer<St> {
    /// The store the layer checks.
    pub fn store(&self) -> &St {
        &self.shared.store
    }
}

impl<St> Clone for RateLimitLayer<St> {
    fn clone(&self) -> Self {
        RateLimitLayer {
            shared: self.shared.clone(),
        }
    }
}

impl<St> fmt::Debug for RateLimitLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field(
                "rules",
                &self
                    .shared
                    .rules
                    .iter()
                    .map(|r| r.spec.name())
                    .collect::<Vec<_>>(),
            )
            .field("headers", &self.shared.headers)
            .finish_non_exhaustive()
    }
}

impl<S, St> Layer<S> for RateLimitLayer<St> {
    type Service = RateLimit<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::new(inner, self.shared.clone())
    }
}

/// Builds a [`RateLimitLayer`]; [`build`](RateLimitLayerBuilder::build) checks the configuration.
///
/// ```
/// use tollgate::clock::ManualClock;
/// use tollgate::key::Global;
/// use tollgate::store::MemoryStore;
/// use tollgate::{Algorithm, Quota, RateLimitLayer, Rule};
///
/// let store = MemoryStore::builder().clock(ManualClock::default()).build()?;
/// let layer = RateLimitLayer::builder()
///     .rule(Rule::new("burst", Quota::per_second(10)))
///     .rule(Rule::new("daily", Quota::per_day(10_000)).algorithm(Algorithm::FixedWindow))
///     .rule(Rule::new("everyone", Quota::per_second(5000)).key(Global))
///     .store(store)
///     .build()?;
/// # let _ = layer;
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
#[must_use]
pub struct RateLimitLayerBuilder<St> {
    rules: Vec<Rule>,
    key: SharedExtractor,
    store: StoreChoice<St>,
    headers: Headers,
    on_denied: Option<DeniedHandler>,
    on_store_error: FailureMode,
    circuit_breaker: CircuitBreaker,
}

/// The store given to the builder, or how to make the default one (only if it is needed).
enum StoreChoice<St> {
    Given(St),
    Default(fn() -> St),
}

impl<St: Store> RateLimitLayerBuilder<St> {
    /// Adds a rule. All rules that apply to a request are checked together: the request is
    /// admitted only if every one admits it, and a denied request is charged to none.
    pub fn rule(mut self, rule: Rule) -> Self {
        self.rules.push(rule);
        self
    }

    /// Adds several rules.
    pub fn rules(mut self, rules: impl IntoIterator<Item = Rule>) -> Self {
        self.rules.extend(rules);
        self
    }

    /// The extractor of rules that do not name their own (default: [`PeerIp`]).
    pub fn key<K: KeyExtractor>(mut self, extractor: K) -> Self {
        self.key = Arc::new(extractor);
        self
    }

    /// Where the state lives (default: a new [`MemoryStore`] for this layer).
    pub fn store<T: Store>(self, store: T) -> RateLimitLayerBuilder<T> {
        RateLimitLayerBuilder {
            rules: self.rules,
            key: self.key,
            store: StoreChoice::Given(store),
            headers: self.headers,
            on_denied: self.on_denied,
            on_store_error: self.on_store_error,
            circuit_breaker: self.circuit_breaker,
        }
    }

    /// Which budget headers to send (default: [`Headers::ietf`]).
    pub fn headers(mut self, headers: Headers) -> Self {
        self.headers = headers;
        self
    }

    /// Replaces the 429 problem response with your own. `Retry-After` and the budget headers are
    /// still added to it. gRPC calls keep their `RESOURCE_EXHAUSTED` answer: a gRPC client could
    /// not read another one.
    pub fn on_denied<F>(mut self, f: F) -> Self
    where
        F: Fn(&RateLimited) -> http::Response<Bytes> + Send + Sync + 'static,
    {
        self.on_denied = Some(Arc::new(f));
        self
    }

    /// What to do when the store fails (default: [`FailureMode::Open`]); a rule may choose its
    /// own with [`Rule::on_store_error`].
    pub fn on_store_error(mut self, mode: FailureMode) -> Self {
        self.on_store_error = mode;
        self
    }

    /// When to stop asking a failing store for a while (default: after 5 failures in a row,
    /// for 1 s). See [`CircuitBreaker`].
    pub fn circuit_breaker(mut self, breaker: CircuitBreaker) -> Self {
        self.circuit_breaker = breaker;
        self
    }

    /// Checks the configuration and builds the layer.
    pub fn build(self) -> Result<RateLimitLayer<St>, ConfigError> {
        self.circuit_breaker.validate()?;
        if self.rules.is_empty() {
            return Err(ConfigError::new(
                "no rules; add one with .rule(Rule::new(name, quota))",
            ));
        }
        if self.rules.len() > MAX_RULES {
            return Err(ConfigError::new(format!(
                "{} rules in one layer; use at most {MAX_RULES} (stack layers for more)",
                self.rules.len()
            )));
        }
        let mut names = HashSet::new();
        for rule in &self.rules {
            if !names.insert(rule.name()) {
                return Err(ConfigError::new(format!(
                    "two rules are named \"{}\"; give each rule of a layer its own name",
                    rule.name()
                )));
            }
        }
        let rules = self
            .rules
            .into_iter()
            .map(|rule| rule.compile(&self.key, self.on_store_error))
            .collect::<Result<Box<[_]>, _>>()?;
        let policies = PolicyItems::new(&rules);
        let fallback = rules
            .iter()
            .any(|rule| rule.on_store_error == FailureMode::Local)
            .then(MemoryStore::new);
        let problems = ProblemBodies::new(&rules);
        Ok(RateLimitLayer {
            shared: Arc::new(Shared {
                warned_missing_key: rules.iter().map(|_| Once::new()).collect(),
                rules,
                policies,
                problems,
                store: match self.store {
                    StoreChoice::Given(store) => store,
                    StoreChoice::Default(make) => make(),
                },
                headers: self.headers,
                on_denied: self.on_denied,
                fallback,
                warned_store_error: Every::default(),
                breaker: Breaker::new(self.circuit_breaker),
            }),
        })
    }
}
