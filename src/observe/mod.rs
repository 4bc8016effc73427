//! What the layer tells about its decisions: metrics (feature `metrics`), a `tracing` span per
//! checked request, the rejection log, and the decision hook.
//!
//! ```
//! use tollgate::observe::DecisionHook;
//! use tollgate::{Quota, RateLimitLayer};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tollgate::ConfigError> {
//! // Every decision, shipped elsewhere without ever slowing a request: when the channel is
//! // full, events are dropped and counted.
//! let (hook, mut events) = DecisionHook::channel(10_000);
//! let layer = RateLimitLayer::builder()
//!     .rule(tollgate::Rule::new("api", Quota::per_minute(100)))
//!     .decision_hook(hook)
//!     .build()?;
//! tokio::spawn(async move {
//!     while let Some(event) = events.recv().await {
//!         let _ = (event.verdict, event.route, event.rules); // to a queue, a data warehouse…
//!     }
//! });
//! # let _ = layer;
//! # Ok(())
//! # }
//! ```
//!
//! # Metrics
//!
//! With the feature `metrics`, the layer and the stores record through the
//! [`metrics`](https://docs.rs/metrics) facade; install any recorder (for Prometheus,
//! `metrics-exporter-prometheus`). Label values are bounded: rule names, route patterns
//! (axum's `MatchedPath`, and gRPC methods that the policy names; other requests have the
//! route label `""`), tier names (a layer built from rules, without a policy, has the tier
//! label `""`), layer names, outcomes, store kinds and server addresses; never a client's
//! key, address, tenant or email (a test sends requests from 10,000 clients and checks that no
//! series is added). Without the feature, nothing is recorded and nothing is paid.
//!
//! | metric | type | labels | meaning |
//! |---|---|---|---|
//! | `tollgate_requests_total` | counter | `route`, `tier`, `outcome` (and `layer`, for a named layer) | every request the layer sees, once per layer (two stacked layers count a request twice): `allowed`, `denied` (the 429s), `shadow_denied` (admitted, a shadow rule would have denied), `delayed` (admitted after waiting), `failed_open`, `failed_closed`, `local_allowed`, `local_denied` (store down), `listed_allowed`, `listed_denied`, `not_limited` (every rule skips requests without a key), `cancelled` (the client left before the decision), `cache_denied` (denied by a Redis store's deny cache), `lease_allowed` (admitted from leased units), `shed` (load shedding: the process had too many requests in flight) |
//! | `tollgate_rule_decisions_total` | counter | `rule`, `route`, `tier`, `outcome` (and `layer`) | what each rule made of each request: as above, plus `not_charged` (it admitted, another rule denied) |
//! | `tollgate_store_check_duration_seconds` | histogram | `store`, `result` | each store check (`memory`, `redis`, `redis_cluster`, or a store's own `kind`), `ok` or `error`; a check the circuit breaker refused is not timed |
//! | `tollgate_store_errors_total` | counter | `store`, `kind` | failed checks: `timeout`, `unavailable`, `protocol`, `circuit_open` |
//! | `tollgate_circuit_breaker_open` | gauge | `store`, `server` | 1 while a Redis server's (a cluster node's) breaker is open |
//! | `tollgate_store_replicas` | gauge | `store` | the replicas of a Redis store's prefix, as its heartbeat last counted them |
//! | `tollgate_memory_store_keys` | gauge | | keys held by the process's memory stores, counted as they come and go |
//! | `tollgate_memory_store_evictions_total` | counter | | keys evicted from a full memory store |
//! | `tollgate_policy_reloads_total` | counter | `result` | policies offered to live layers: `installed` or `rejected` |
//! | `tollgate_delayed_requests` | gauge | | requests waiting for a delay rule |
//! | `tollgate_shed_requests_total` | counter | `priority` | requests shed by load shedding: `low`, `normal`, `critical` |
//! | `tollgate_shed_capacity` | gauge | | the capacity an adaptive load shedder learned (`Shedding::adaptive`) |
//! | `tollgate_shed_latency_seconds` | gauge | `estimate` | an adaptive load shedder's no-load latency (`base`) and its latest window's mean (`recent`) |
//! | `tollgate_metered_units_granted_total` | counter | `rule`, `tier` (and `layer`) | units the store granted [metered](crate::Rule::meter) responses: each admission's first chunk and the chunks taken as they streamed |
//! | `tollgate_metered_units_spent_total` | counter | `rule`, `tier` (and `layer`) | units metered responses were charged when they ended or were dropped (granted less spent went back; spent past granted is a debt) |
//! | `tollgate_metered_streams_ended_total` | counter | `rule`, `tier`, `reason` (and `layer`) | metered responses ended early: `budget` (the store refused the next chunk) or `store_error` (the store failed and the rule does not fail open) |
//! | `tollgate_decision_events_dropped_total` | counter | | decision events dropped because the hook's channel was full |
//! | `tollgate_denial_log_suppressed_total` | counter | | denials the rejection log did not write (over its lines per second) |
//!
//! With `metrics-exporter-prometheus`, give the latency histogram buckets
//! (`PrometheusBuilder::set_buckets_for_metric(Matcher::Full("tollgate_store_check_duration_seconds".into()), &[..])`,
//! as `examples/metrics.rs` does): without them it is rendered as a summary, which the
//! dashboard's percentile panels and the latency alert cannot aggregate.
//!
//! `examples/metrics/grafana-dashboard.json` is a Grafana dashboard of these (rate limited by
//! route, rule and tier, the share of 429s per route, shadow rules' would-be denials, store
//! latency percentiles, store errors, failures and fallbacks, breakers, memory store, reloads):
//! in Grafana, *Dashboards → New → Import*, upload the file and pick your Prometheus data
//! source. `examples/metrics/alerts.yml` holds Prometheus alerting rules (a route whose share of
//! 429s is high or triples, a failing or slow store, an open breaker, requests passing unlimited
//! because the store fails, a rejected rules file, a memory store that evicts, metered streams
//! cut because the store fails): add it to
//! `rule_files` in `prometheus.yml`; `promtool check rules examples/metrics/alerts.yml`
//! validates it.
//!
//! Each layer counts the requests it checks: a request that passes two stacked layers is
//! counted twice in `tollgate_requests_total`, once by each. Give each layer a
//! [`name`](crate::RateLimitLayerBuilder::name) and its series carry it as the label `layer`
//! (`sum without (layer)` is then requests times layers; count one layer's series for
//! requests). One layer with rules for every tier
//! ([`Policy::all_tiers`](crate::policy::Policy::all_tiers)) counts a request once, and checks
//! all its rules all or nothing.
//!
//! # The span
//!
//! Each checked request opens a span at `debug` (target `tollgate`, name `tollgate.check`) that
//! closes when the request is decided, with the fields `rules`, `verdict`, `retry_after_s` and
//! `store_latency_us`: a `tracing` subscriber, and OpenTelemetry through
//! `tracing-opentelemetry`, see it with no code. With no subscriber that takes `debug`, no span
//! is made (it is not described to the `log` crate through `tracing`'s `log` feature).
//!
//! # The rejection log
//!
//! Every denial is logged at `info`, target `tollgate::denied`, with the rules that denied, the
//! route, the tier, and short keyed digests of the key and of the tenant's id (the same client
//! gives the same digest within one process, and the digest cannot be turned back into an
//! address, an email or an API key); the raw key and tenant id only with
//! [`log_raw_keys`](crate::RateLimitLayerBuilder::log_raw_keys). At most
//! [`denial_log_per_second`](crate::RateLimitLayerBuilder::denial_log_per_second) lines a second
//! (default 10); then one line says how many were not logged. Shadow rules log what they would
//! deny at `info`, target `tollgate::shadow`; rules files that are not installed are logged at
//! `error`, target `tollgate::policy`. tollgate logs only through `tracing`: install a
//! subscriber (`tracing-subscriber`) to see anything.

mod hook;
mod log;
#[cfg(feature = "metrics")]
pub(crate) mod metrics;

pub use hook::{DecisionEvent, DecisionHook, DecisionReceiver, RuleEvent};

pub(crate) use log::DenialLog;

use std::fmt;
use std::time::Duration;

use http::{Extensions, HeaderMap, Uri};

use crate::Decision;
use crate::key::Route;
use crate::policy::AppliedRules;
use crate::policy::snapshot::Snapshot;
use crate::policy::{FailureMode, Resolution, RuleMode, Tenant};

/// What became of a request, as metrics, logs and the hook name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Verdict {
    /// Every rule admitted it.
    Allowed,
    /// A rule denied it (429, gRPC `RESOURCE_EXHAUSTED`).
    Denied,
    /// Admitted, though a shadow rule would have denied it.
    ShadowDenied,
    /// Admitted after waiting for a delay rule's budget.
    Delayed,
    /// The store failed and the rules let it through.
    FailedOpen,
    /// The store failed and a rule refused it (503, gRPC `UNAVAILABLE`).
    FailedClosed,
    /// The store failed and the local limiter admitted it.
    LocalAllowed,
    /// The store failed and the local limiter denied it.
    LocalDenied,
    /// On the allow list: not limited.
    ListedAllowed,
    /// On the deny list: refused (403, gRPC `PERMISSION_DENIED`).
    ListedDenied,
    /// No rule applied (every rule skips requests without a key).
    NotLimited,
    /// The client went away before the request was decided.
    Cancelled,
    /// Denied by a remote store's local deny cache: the store denied the same request moments
    /// ago, until a time not yet come (429, as from the store).
    CacheDenied,
    /// Admitted from units a remote store leased to this replica.
    LeaseAllowed,
    /// Shed before any rule was checked: the process had too many requests in flight for its
    /// priority class (503, gRPC `UNAVAILABLE`).
    Shed,
}

impl Verdict {
    /// The label value: `allowed`, `denied`, `shadow_denied`, `delayed`, `failed_open`,
    /// `failed_closed`, `local_allowed`, `local_denied`, `listed_allowed`, `listed_denied`,
    /// `not_limited`, `cancelled`, `cache_denied`, `lease_allowed`, `shed`.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Allowed => "allowed",
            Verdict::Denied => "denied",
            Verdict::ShadowDenied => "shadow_denied",
            Verdict::Delayed => "delayed",
            Verdict::FailedOpen => "failed_open",
            Verdict::FailedClosed => "failed_closed",
            Verdict::LocalAllowed => "local_allowed",
            Verdict::LocalDenied => "local_denied",
            Verdict::ListedAllowed => "listed_allowed",
            Verdict::ListedDenied => "listed_denied",
            Verdict::NotLimited => "not_limited",
            Verdict::Cancelled => "cancelled",
            Verdict::CacheDenied => "cache_denied",
            Verdict::Shed => "shed",
            Verdict::LeaseAllowed => "lease_allowed",
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one rule made of a request, as the per-rule metric names it.
pub(crate) fn rule_outcome(
    verdict: Verdict,
    mode: RuleMode,
    failure: FailureMode,
    allowed: Option<bool>,
) -> &'static str {
    match (verdict, allowed) {
        (Verdict::FailedOpen | Verdict::FailedClosed, _) => match failure {
            FailureMode::Closed if mode != RuleMode::Shadow => "failed_closed",
            _ => "failed_open",
        },
        (Verdict::LocalAllowed | Verdict::LocalDenied, Some(false)) => "local_denied",
        (Verdict::LocalAllowed | Verdict::LocalDenied, _) => "local_allowed",
        (_, Some(false)) if mode == RuleMode::Shadow => "shadow_denied",
        (Verdict::CacheDenied, Some(false)) => "cache_denied",
        (_, Some(false)) => "denied",
        (Verdict::Denied | Verdict::CacheDenied, _) => "not_charged",
        (Verdict::LeaseAllowed, _) => "lease_allowed",
        (Verdict::Delayed, _) if matches!(mode, RuleMode::Delay { .. }) => "delayed",
        _ => "allowed",
    }
}

/// The parts of a request that events read: its route, tenant and kind.
#[derive(Clone, Copy)]
pub(crate) struct Head<'a> {
    pub(crate) uri: &'a Uri,
    pub(crate) headers: &'a HeaderMap,
    pub(crate) extensions: &'a Extensions,
}

impl<'a> Head<'a> {
    pub(crate) fn of_parts(parts: &'a http::request::Parts) -> Self {
        Head {
            uri: &parts.uri,
            headers: &parts.headers,
            extensions: &parts.extensions,
        }
    }

    pub(crate) fn is_grpc(&self) -> bool {
        crate::wire::is_grpc(self.headers)
    }

    /// The route label: for a gRPC call, the method the policy names (a client chooses the
    /// method path it sends; inside a tonic server, which routes with axum, the matched path is
    /// the service's wildcard), else axum's route pattern; for other requests, axum's route
    /// pattern, else the route the policy names; `""` otherwise. `route` is the request's
    /// route as its rules were resolved by.
    pub(crate) fn route_label<'s>(&self, snapshot: &'s Snapshot, route: Option<u16>) -> &'s str
    where
        'a: 's,
    {
        let known = route.map(|route| snapshot.resolver.route_name(route));
        #[cfg(feature = "axum")]
        let matched = self
            .extensions
            .get::<axum::extract::MatchedPath>()
            .map(|matched| matched.as_str());
        #[cfg(not(feature = "axum"))]
        let matched: Option<&str> = None;
        if self.is_grpc() {
            known.or(matched).unwrap_or("")
        } else {
            matched.or(known).unwrap_or("")
        }
    }

    /// Where a request decided before its rules were resolved stands in the policy.
    fn place(&self, snapshot: &Snapshot) -> Resolution {
        snapshot.resolver.place(
            self.tenant(),
            Route::route_in(self.uri, self.headers, self.extensions),
        )
    }

    pub(crate) fn tenant(&self) -> Option<&'a Tenant> {
        self.extensions.get::<Tenant>()
    }
}

/// What a layer tells about its decisions: shared by its services.
pub(crate) struct Observer {
    /// Unique per layer in the process.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) id: u64,
    pub(crate) log: DenialLog,
    pub(crate) hook: Option<DecisionHook>,
    /// The store's kind, for metric labels.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) store: &'static str,
}

impl Decided<'_> {
    /// The `Retry-After` of a denial, in seconds: shadow rules, which never deny, left out.
    pub(crate) fn retry_after_seconds(&self) -> Option<u64> {
        if !matches!(
            self.verdict,
            Verdict::Denied | Verdict::LocalDenied | Verdict::CacheDenied
        ) {
            return None;
        }
        let decision = self.decision?;
        let wait = self
            .applied
            .iter()
            .zip(decision.outcomes())
            .filter(|(i, o)| {
                !o.allowed && self.snapshot.rules[usize::from(**i)].mode != RuleMode::Shadow
            })
            .map(|(_, o)| o.retry_after)
            .max()?;
        (wait != u64::MAX).then(|| wait.div_ceil(1_000_000).max(1))
    }

    /// The rules that denied (shadow rules left out).
    pub(crate) fn denying(&self) -> smallvec::SmallVec<[u16; 2]> {
        match self.decision {
            Some(decision) => self
                .applied
                .iter()
                .zip(decision.outcomes())
                .filter(|(i, o)| {
                    !o.allowed && self.snapshot.rules[usize::from(**i)].mode != RuleMode::Shadow
                })
                .map(|(&i, _)| i)
                .collect(),
            None => self.applied.iter().copied().collect(),
        }
    }
}

impl Observer {
    /// A new layer's observer.
    pub(crate) fn new(log: DenialLog, hook: Option<DecisionHook>, store: &'static str) -> Self {
        static IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Observer {
            id: IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            log,
            hook,
            store,
        }
    }
}

/// One decided request, as events see it.
pub(crate) struct Decided<'a> {
    pub(crate) snapshot: &'a Snapshot,
    pub(crate) head: Head<'a>,
    /// Where the request stands in the policy, when its rules were resolved.
    pub(crate) resolution: Option<Resolution>,
    pub(crate) applied: &'a [u16],
    pub(crate) decision: Option<&'a Decision>,
    pub(crate) keys: Option<&'a AppliedRules>,
    pub(crate) verdict: Verdict,
    pub(crate) store_latency: Option<Duration>,
}

impl Observer {
    /// Tells everyone who listens about a decided request: metrics, the span, the rejection
    /// log and the hook.
    pub(crate) fn decided(&self, decided: &Decided<'_>, span: &tracing::Span) {
        if !span.is_disabled() {
            record_span(span, decided);
        }
        let log = matches!(
            decided.verdict,
            Verdict::Denied | Verdict::LocalDenied | Verdict::CacheDenied
        ) && self.log.enabled();
        if !(cfg!(feature = "metrics") || log || self.hook.is_some()) {
            return;
        }
        let resolution = decided
            .resolution
            .unwrap_or_else(|| decided.head.place(decided.snapshot));
        let route = decided.head.route_label(decided.snapshot, resolution.route);
        let tenant = decided.head.tenant();
        let tier = resolution.tier;
        #[cfg(feature = "metrics")]
        metrics::decided(decided, route, tier);
        let tier_name = decided.snapshot.resolver.tier_name(tier);
        if log {
            self.log.denied(decided, route, tier_name, tenant);
        }
        if let Some(hook) = &self.hook {
            hook.send(decided, route, tier_name, tenant);
        }
    }

    /// Shadow rules that would have denied a request that is admitted (and checked again
    /// without them): counted as such by the per-rule metric.
    pub(crate) fn shadowed(
        &self,
        snapshot: &Snapshot,
        head: Head<'_>,
        resolution: Resolution,
        rules: &[u16],
    ) {
        #[cfg(feature = "metrics")]
        {
            let route = head.route_label(snapshot, resolution.route);
            metrics::shadowed(snapshot, rules, route, resolution.tier);
        }
        #[cfg(not(feature = "metrics"))]
        let _ = (snapshot, head, resolution, rules);
    }

    /// One check of the store, answered or failed after `latency`.
    pub(crate) fn store_checked(
        &self,
        latency: Option<Duration>,
        result: &Result<crate::Decision, crate::store::StoreError>,
    ) {
        #[cfg(feature = "metrics")]
        if let Some(latency) = latency {
            match result {
                // Not asked: no latency to tell.
                Err(crate::store::StoreError::CircuitOpen) => {}
                Ok(_) => crate::telemetry::store_latency(self.id, self.store, "ok", latency),
                Err(_) => crate::telemetry::store_latency(self.id, self.store, "error", latency),
            }
        }
        #[cfg(not(feature = "metrics"))]
        let _ = (latency, result);
    }
}

/// The span of a checked request: opened when it starts, given its fields when decided; none
/// when no subscriber takes `debug` spans (without one, `tracing`'s `log` compatibility would
/// otherwise describe an empty span to the `log` crate on every request).
pub(crate) fn span() -> tracing::Span {
    if tracing::Level::DEBUG > tracing::level_filters::LevelFilter::current() {
        return tracing::Span::none();
    }
    tracing::debug_span!(
        target: "tollgate",
        "tollgate.check",
        rules = tracing::field::Empty,
        verdict = tracing::field::Empty,
        retry_after_s = tracing::field::Empty,
        store_latency_us = tracing::field::Empty,
    )
}

fn record_span(span: &tracing::Span, decided: &Decided<'_>) {
    let names = RuleNames {
        snapshot: decided.snapshot,
        applied: decided.applied,
    };
    span.record("rules", tracing::field::display(&names));
    span.record("verdict", decided.verdict.as_str());
    if let Some(seconds) = decided.retry_after_seconds() {
        span.record("retry_after_s", seconds);
    }
    if let Some(latency) = decided.store_latency {
        span.record("store_latency_us", latency.as_micros() as u64);
    }
}

/// The names of some rules of a snapshot: `a,b`.
pub(crate) struct RuleNames<'a> {
    pub(crate) snapshot: &'a Snapshot,
    pub(crate) applied: &'a [u16],
}

impl fmt::Display for RuleNames<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (n, &i) in self.applied.iter().enumerate() {
            if n > 0 {
                f.write_str(",")?;
            }
            f.write_str(self.snapshot.rules[usize::from(i)].spec.name())?;
        }
        Ok(())
    }
}
