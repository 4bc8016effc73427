//! [`RateLimitLayer`] and its builder: configuration only.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use tower_layer::Layer;

use crate::engine::{Engine, Local, PolicyInForce};
use crate::key::{Extracted, FirstOfShared, Key, KeyExtractor, PeerIp, SharedExtractor};
use crate::observe::{DecisionHook, DenialLog, Observer};
use crate::policy::MAX_RULES;
use crate::policy::snapshot::{Compiler, Snapshot};
use crate::policy::{
    Live, Policy, PolicyHandle, PolicySource, Registrar, TenantExtractor, TenantKey, Tier,
};
use crate::response::{DeniedHandler, Headers, RateLimited};
use crate::service::RateLimit;
use crate::shed::Shedding;
use crate::store::{MemoryStore, Store};
use crate::throttle::{Every, Once};
use crate::{ConfigError, FailureMode, FallbackShare, Quota, Rule};

/// How many requests of one layer may wait for a delay rule at once, by default.
pub const DEFAULT_MAX_WAITING: usize = 1024;

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
    engine: Arc<Engine<St>>,
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
            policy: None,
            tenant: None,
            key: None,
            store: StoreChoice::Default(MemoryStore::new),
            headers: Headers::default(),
            on_denied: None,
            on_store_error: FailureMode::default(),
            fallback_share: FallbackShare::default(),
            max_waiting: DEFAULT_MAX_WAITING,
            hook: None,
            log_raw_keys: false,
            denial_log_per_second: 10,
            name: None,
            count_preflight: false,
            shed: None,
        }
    }
}

impl<St> RateLimitLayer<St> {
    /// The store the layer checks.
    pub fn store(&self) -> &St {
        &self.engine.store
    }

    /// What the layer's services share.
    #[cfg_attr(not(feature = "tonic"), allow(dead_code))]
    pub(crate) fn engine(&self) -> &Arc<Engine<St>> {
        &self.engine
    }

    /// The layer's budgets from your own code: peek, charge, refund and reset one rule's key,
    /// with the layer's rules and store (see [`Limiter`](crate::Limiter)).
    pub fn limiter(&self) -> crate::Limiter<St> {
        crate::Limiter {
            engine: self.engine.clone(),
        }
    }

    /// The handle of a layer built with a
    /// [`policy_source`](RateLimitLayerBuilder::policy_source): the version in force, reload
    /// counts, and installing a policy from code. `None` for a layer whose rules are fixed.
    pub fn policy_handle(&self) -> Option<PolicyHandle> {
        match &self.engine.policy {
            PolicyInForce::Live(live) => Some(PolicyHandle { live: live.clone() }),
            PolicyInForce::Fixed(_) => None,
        }
    }

    /// The route patterns the policy in force names, each once, in order.
    #[cfg(all(feature = "testing", feature = "axum"))]
    pub(crate) fn routes(&self) -> Vec<String> {
        let snapshot = self.engine.snapshot();
        snapshot.resolver.routes().map(str::to_owned).collect()
    }

    /// The names of the policy's delay rules (their requests wait on tokio's timer).
    #[cfg(all(feature = "testing", feature = "axum"))]
    pub(crate) fn delay_rules(&self) -> Vec<String> {
        let snapshot = self.engine.snapshot();
        snapshot
            .rules
            .iter()
            .filter(|rule| matches!(rule.mode, crate::policy::RuleMode::Delay { .. }))
            .map(|rule| rule.spec.shared_name().to_string())
            .collect()
    }

    /// The policy's rules whose outcome depends on what a replay does not record: metered
    /// rules (what a stream spends, and when) and concurrency rules (how long each request is
    /// in flight), each with what it is.
    #[cfg(all(feature = "testing", feature = "axum"))]
    pub(crate) fn unpredicted_rules(&self) -> Vec<(String, &'static str)> {
        let snapshot = self.engine.snapshot();
        snapshot
            .rules
            .iter()
            .filter_map(|rule| {
                let what = if rule.meter.is_some() {
                    "metered"
                } else if rule.spec.algorithm() == crate::Algorithm::Concurrency {
                    "concurrency"
                } else {
                    return None;
                };
                Some((rule.spec.shared_name().to_string(), what))
            })
            .collect()
    }

    /// The policy's [`settle`](Rule::settle) rules, each with the response header it reads
    /// its cost from ([`Rule::settle_from_header`]), if it reads one.
    #[cfg(all(feature = "testing", feature = "axum"))]
    pub(crate) fn settle_rules(&self) -> Vec<(String, Option<http::HeaderName>)> {
        let snapshot = self.engine.snapshot();
        snapshot
            .rules
            .iter()
            .filter_map(|rule| {
                let after = rule.after.as_ref()?;
                after.settle.as_ref()?;
                Some((rule.spec.shared_name().to_string(), after.header().cloned()))
            })
            .collect()
    }
}

impl<St> Clone for RateLimitLayer<St> {
    fn clone(&self) -> Self {
        RateLimitLayer {
            engine: self.engine.clone(),
        }
    }
}

impl<St> fmt::Debug for RateLimitLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let snapshot = self.engine.snapshot();
        f.debug_struct("RateLimitLayer")
            .field("version", &&*snapshot.version)
            .field(
                "rules",
                &snapshot
                    .rules
                    .iter()
                    .map(|r| r.spec.name())
                    .collect::<Vec<_>>(),
            )
            .field("headers", &snapshot.answers.headers())
            .finish_non_exhaustive()
    }
}

impl<S, St> Layer<S> for RateLimitLayer<St> {
    type Service = RateLimit<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::new(inner, self.engine.clone())
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
    policy: Option<PolicyChoice>,
    tenant: Option<Arc<dyn TenantExtractor>>,
    /// The layer's key, when one was given.
    key: Option<SharedExtractor>,
    store: StoreChoice<St>,
    headers: Headers,
    on_denied: Option<DeniedHandler>,
    on_store_error: FailureMode,
    fallback_share: FallbackShare,
    max_waiting: usize,
    hook: Option<DecisionHook>,
    log_raw_keys: bool,
    denial_log_per_second: u32,
    name: Option<String>,
    count_preflight: bool,
    shed: Option<Shedding>,
}

/// Where the layer's policy comes from.
enum PolicyChoice {
    Fixed(Box<Policy>),
    Source(Box<dyn PolicySource>),
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

    /// Rules by tier, tenant and route (see [`Policy`]), fixed for the life of the layer,
    /// instead of [`rule`](Self::rule)s.
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = Some(PolicyChoice::Fixed(Box::new(policy)));
        self
    }

    /// A live policy: read from `source` now (an error fails [`build`](Self::build)), then
    /// polled for changes and swapped in while serving (see [`PolicySource`]); the layer's
    /// [`policy_handle`](RateLimitLayer::policy_handle) tells which version is in force.
    pub fn policy_source<P: PolicySource>(mut self, source: P) -> Self {
        self.policy = Some(PolicyChoice::Source(Box::new(source)));
        self
    }

    /// Finds each request's tenant, which decides its tier and exceptions in the policy. With a
    /// tenant extractor, rules without a key of their own count per tenant, and requests
    /// without a tenant by the layer's [`key`](Self::key) (behind a proxy, give the layer a
    /// [`ClientIp`](crate::key::ClientIp) key: by default it is the socket peer, the proxy).
    pub fn tenant<T: TenantExtractor>(mut self, extractor: T) -> Self {
        self.tenant = Some(Arc::new(extractor));
        self
    }

    /// How many requests may wait at once for a delay rule's budget (default
    /// [`DEFAULT_MAX_WAITING`]); past it, such requests are denied at once.
    pub fn max_waiting(mut self, max: usize) -> Self {
        self.max_waiting = max;
        self
    }

    /// Sends every decision to `hook`'s channel, never waiting: when it is full, the event is
    /// dropped and counted (see [`DecisionHook`]).
    pub fn decision_hook(mut self, hook: DecisionHook) -> Self {
        self.hook = Some(hook);
        self
    }

    /// Puts the raw key (an IP address, an email) and the raw tenant id in the rejection log
    /// instead of their keyed digests. Off by default: logs travel further than the service,
    /// and a tenant id may be an API key.
    pub fn log_raw_keys(mut self, raw: bool) -> Self {
        self.log_raw_keys = raw;
        self
    }

    /// The layer's name, as the metrics of its requests label them (`layer`): each layer counts
    /// the requests it checks, so with stacked layers, `tollgate_requests_total` counts a
    /// request once per layer, and the label tells their series apart. 1 to 64 characters of
    /// `A-Z a-z 0-9 - _ .`; without a name, the series have no `layer` label.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// How many denials the rejection log (target `tollgate::denied`, level `info`) writes a
    /// second at most (default 10); then one line counts those it did not write.
    pub fn denial_log_per_second(mut self, lines: u32) -> Self {
        self.denial_log_per_second = lines;
        self
    }

    /// Whether a browser's CORS preflight (`OPTIONS` with `Origin` and
    /// `Access-Control-Request-Method`) is limited like any request (default: `false`, it
    /// passes unlimited and uncounted: a browser sends one before many requests, and the
    /// request that follows is counted). Any client can send these headers, so what answers
    /// `OPTIONS` behind the layer must be cheap (a CORS layer answers it before any handler);
    /// count them where it is not.
    pub fn count_preflight(mut self, count: bool) -> Self {
        self.count_preflight = count;
        self
    }

    /// Sheds load: at most so many requests in flight in this process, the lowest priority
    /// classes refused first with a 503 (see [`Shedding`]). Off by default. A layer that sheds
    /// needs no rules: one given none limits nothing else.
    pub fn shed(mut self, shedding: Shedding) -> Self {
        self.shed = Some(shedding);
        self
    }

    /// The extractor of rules that do not name their own (default: [`PeerIp`]).
    ///
    /// Behind a reverse proxy, give it [`ClientIp`](crate::key::ClientIp) with the proxies you
    /// trust: the peer is then the proxy, and every client would share its budget. A layer with
    /// a [`tenant`](Self::tenant) extractor and no key says so once through `tracing` when a
    /// request without a tenant arrives through a proxy (it carries `X-Forwarded-For` or
    /// `Forwarded`).
    pub fn key<K: KeyExtractor>(mut self, extractor: K) -> Self {
        self.key = Some(Arc::new(extractor));
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
            policy: self.policy,
            tenant: self.tenant,
            key: self.key,
            store: StoreChoice::Given(store),
            headers: self.headers,
            on_denied: self.on_denied,
            on_store_error: self.on_store_error,
            fallback_share: self.fallback_share,
            max_waiting: self.max_waiting,
            hook: self.hook,
            log_raw_keys: self.log_raw_keys,
            denial_log_per_second: self.denial_log_per_second,
            name: self.name,
            count_preflight: self.count_preflight,
            shed: self.shed,
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

    /// How much of each rule's quota this replica's local fallback
    /// ([`FailureMode::Local`]) enforces while the store is away (default
    /// [`FallbackShare::per_replica`]: `1 / replicas`, by the count of the store's heartbeat).
    pub fn fallback_share(mut self, share: FallbackShare) -> Self {
        self.fallback_share = share;
        self
    }

    /// Checks the configuration and builds the layer.
    pub fn build(self) -> Result<RateLimitLayer<St>, ConfigError> {
        let layer_key: SharedExtractor = match (self.key, &self.tenant) {
            (Some(key), _) => key,
            (None, Some(_)) => Arc::new(TenantlessPeer::default()),
            (None, None) => Arc::new(PeerIp::new()),
        };
        let default_key: SharedExtractor = match &self.tenant {
            Some(_) => Arc::new(FirstOfShared(vec![Arc::new(TenantKey), layer_key.clone()])),
            None => layer_key.clone(),
        };
        if let Some(name) = &self.name {
            let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
            if name.is_empty() || name.len() > 64 || !name.chars().all(ok) {
                return Err(ConfigError::new(format!(
                    "layer name {name:?} is not allowed; use 1 to 64 characters of \
                     A-Z a-z 0-9 - _ ."
                )));
            }
        }
        let compiler = Compiler {
            default_key,
            layer_key: layer_key.clone(),
            on_store_error: self.on_store_error,
            headers: self.headers,
            on_denied: self.on_denied,
            name: self.name.map(Arc::from),
        };
        let (policy, source) = match (self.policy, self.rules.is_empty()) {
            (Some(_), false) => {
                return Err(ConfigError::new(
                    "both rules and a policy; put the rules in the policy's default tier",
                ));
            }
            (None, _) => (rules_policy(self.rules, self.shed.is_some())?, None),
            (Some(PolicyChoice::Fixed(policy)), true) => (*policy, None),
            (Some(PolicyChoice::Source(mut source)), true) => {
                let policy = source.load().map_err(|e| {
                    // A configuration error of the source's own (a rules file that cannot be
                    // read): its message, without a second prefix.
                    let message = match e.downcast_ref::<ConfigError>() {
                        Some(error) => error.message().to_owned(),
                        None => e.to_string(),
                    };
                    ConfigError::new(format!("the policy source failed: {message}"))
                })?;
                (policy, Some(source))
            }
        };
        self.fallback_share.validate()?;
        self.fallback_share
            .warn_of_chunks_past_shares(policy.every_rule(), self.on_store_error);
        let snapshot = Snapshot::compile(&policy, &compiler)?;
        let shedder = self.shed.map(Shedding::build).transpose()?;
        let policy = match source {
            None => PolicyInForce::Fixed(Arc::new(snapshot)),
            Some(_) => PolicyInForce::Live(Arc::new(Live::new(snapshot, compiler))),
        };
        let store = match self.store {
            StoreChoice::Given(store) => store,
            StoreChoice::Default(make) => make(),
        };
        #[cfg(feature = "metrics")]
        crate::telemetry::describe();
        let observer = Observer::new(
            DenialLog::new(self.denial_log_per_second, self.log_raw_keys),
            self.hook,
            store.kind(),
        );
        let fallback_share = self.fallback_share.for_store(store.counts_replicas());
        let engine = Arc::new(Engine {
            policy,
            observer,
            store,
            layer_key,
            tenant: self.tenant,
            fallback: Local::new(fallback_share),
            warned_store_error: Every::default(),
            waiting: Default::default(),
            max_waiting: self.max_waiting,
            registration: Arc::new(()),
            count_preflight: self.count_preflight,
            shedder,
            uses: Default::default(),
        });
        engine.register(&engine.snapshot())?;
        if let (PolicyInForce::Live(live), Some(source)) = (&engine.policy, source) {
            #[cfg(feature = "metrics")]
            crate::telemetry::reloads_start();
            let registrar: Arc<dyn Registrar> = engine.clone();
            live.connect(Arc::downgrade(&registrar));
            if let Some(interval) = source.interval() {
                live.watch(source, interval);
            }
        }
        Ok(RateLimitLayer { engine })
    }
}

/// The rules of [`RateLimitLayerBuilder::rule`] as a policy of one tier: none only for a
/// layer that sheds load (`sheds`), which then limits nothing else.
fn rules_policy(rules: Vec<Rule>, sheds: bool) -> Result<Policy, ConfigError> {
    if rules.is_empty() && !sheds {
        return Err(ConfigError::new(
            "no rules and no load shedding, so the layer would limit nothing; add a rule with \
             .rule(Rule::new(name, quota)), give a policy, or shed load with \
             .shed(Shedding::new(capacity))",
        ));
    }
    if rules.len() > MAX_RULES {
        return Err(ConfigError::new(format!(
            "{} rules in one layer; use at most {MAX_RULES} (stack layers for more, \
             knowing that stacked layers are not all-or-nothing)",
            rules.len()
        )));
    }
    let mut names = HashSet::new();
    for rule in &rules {
        if !names.insert(rule.name()) {
            return Err(ConfigError::new(format!(
                "two rules are named \"{}\"; give each rule of a layer its own name",
                rule.name()
            )));
        }
    }
    let mut policy = Policy::new("rules")
        .tier(Tier::new("default").rules(rules))
        .default_tier("default");
    // Its tier is no tier of a policy: metrics, logs and events name none.
    policy.untiered = true;
    Ok(policy)
}

/// The key of a layer that finds tenants and was given no key: the socket peer, as
/// [`PeerIp`], and a hint (once per layer) when a request comes through a proxy, whose address
/// every client without a tenant then shares.
#[derive(Default)]
struct TenantlessPeer {
    hinted: Once,
}

impl KeyExtractor for TenantlessPeer {
    fn extract(&self, parts: &http::request::Parts) -> Extracted {
        if !self.hinted.done()
            && (parts.headers.contains_key("x-forwarded-for")
                || parts.headers.contains_key(http::header::FORWARDED))
            && self.hinted.first()
        {
            tracing::warn!(
                "tollgate: this layer finds tenants but was given no key, so requests without a \
                 tenant (and its allow and deny lists) go by the socket peer; a request came \
                 through a proxy (it carries X-Forwarded-For or Forwarded), so every client \
                 without a tenant shares the proxy's budget. Give the layer the client's \
                 address: .key(ClientIp::new().trusted_proxies([..])) on the builder (key = \
                 \"ip\" in a rules file then means it too). Reported once."
            );
        }
        PeerIp::peer_addr(parts)
            .map(|ip| Key::ip_prefix(ip, 64))
            .into()
    }
}
