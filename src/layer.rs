//! [`RateLimitLayer`] and its builder: configuration only.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use tower_layer::Layer;

use crate::decide::Shared;
use crate::key::{KeyExtractor, PeerIp, SharedExtractor};
use crate::response::{Answers, DeniedHandler, Headers, RateLimited};
use crate::service::RateLimit;
use crate::store::{MemoryStore, Store};
use crate::warn::{Every, Once};
use crate::{ConfigError, FailureMode, Quota, Rule};

/// The most rules one layer may hold.
///
/// Every rule of a layer is checked in one atomic step: all charged or none. Layers stacked on
/// one another are checked one after the other, so a request that an inner layer denies keeps
/// the charges of the outer ones: put rules that must be all-or-nothing in one layer.
pub const MAX_RULES: usize = 32;

/// Applies rate limits to a service.
///
/// ```
/// use axum::{Router, routing::get};
/// use tollgate::{Algorithm, Quota, RateLimitLayer, Rule};
///
/// let layer = RateLimitLayer::builder()
///     .rule(Rule::new("burst", Quota::per_second(10).burst(20)))
///     .rule(Rule::new("daily", Quota::per_day(1000)).algorithm(Algorithm::FixedWindow))
///     .build()?;
/// // Cheap to clone: every route and every connection shares the rules and the store.
/// let app: Router = Router::new().route("/", get(|| async { "hi" })).layer(layer.clone());
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
///
/// It works with `Router::layer`, `Router::route_layer`, `tower::ServiceBuilder` and
/// `tonic::transport::Server::builder().layer`, and keeps the inner service's error type.
pub struct RateLimitLayer<St = MemoryStore> {
    shared: Arc<Shared<St>>,
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
            .field("headers", &self.shared.answers.headers())
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
    ///
    /// Layers that share a store share the budget of each rule name they have in common, and
    /// must give it the same quota and algorithm: [`build`](Self::build) refuses a rule whose
    /// name another living layer of the same store uses with other numbers.
    pub fn store<T: Store>(self, store: T) -> RateLimitLayerBuilder<T> {
        RateLimitLayerBuilder {
            rules: self.rules,
            key: self.key,
            store: StoreChoice::Given(store),
            headers: self.headers,
            on_denied: self.on_denied,
            on_store_error: self.on_store_error,
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

    /// Checks the configuration and builds the layer.
    pub fn build(self) -> Result<RateLimitLayer<St>, ConfigError> {
        if self.rules.is_empty() {
            return Err(ConfigError::new(
                "no rules; add one with .rule(Rule::new(name, quota))",
            ));
        }
        if self.rules.len() > MAX_RULES {
            return Err(ConfigError::new(format!(
                "{} rules in one layer; use at most {MAX_RULES} (stack layers for more, \
                 knowing that stacked layers are not all-or-nothing)",
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
        let store = match self.store {
            StoreChoice::Given(store) => store,
            StoreChoice::Default(make) => make(),
        };
        let registration = match store.registry() {
            Some(registry) => {
                let token = Arc::new(());
                registry.register(rules.iter().map(|rule| &*rule.spec), &token)?;
                Some(token)
            }
            None => None,
        };
        let fallback = rules
            .iter()
            .any(|rule| rule.on_store_error == FailureMode::Local)
            .then(MemoryStore::new);
        Ok(RateLimitLayer {
            shared: Arc::new(Shared {
                missing_key_hints: rules.iter().map(|_| [Once::new(), Once::new()]).collect(),
                answers: Answers::new(&rules, self.headers, self.on_denied),
                rules,
                store,
                fallback,
                warned_store_error: Every::default(),
                _registration: registration,
            }),
        })
    }
}
