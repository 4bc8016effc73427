/// What the layer does when the store fails (errs or times out, or its circuit breaker is open):
/// set for the layer
/// ([`on_store_error`](crate::RateLimitLayerBuilder::on_store_error)) and, where one rule needs
/// another, for the rule ([`Rule::on_store_error`](crate::Rule::on_store_error)).
///
/// ```
/// use tollgate::FailureMode;
/// use tollgate::{Quota, RateLimitLayer, Rule};
///
/// assert_eq!(FailureMode::default(), FailureMode::Open);
/// let layer = RateLimitLayer::builder()
///     .rule(Rule::new("login", Quota::per_minute(5)).on_store_error(FailureMode::Closed))
///     .rule(Rule::new("api", Quota::per_second(50)).on_store_error(FailureMode::Local))
///     .build()?;
/// # let _ = layer;
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
///
/// When the store fails for a request, its rules decide together: if any applied rule is
/// `Closed`, the request is refused (503, or gRPC `UNAVAILABLE`); otherwise the `Local` rules are
/// checked in the local limiter (all or nothing, with budget headers for them), and the `Open`
/// rules are skipped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailureMode {
    /// Let the request through without limiting it (the default): an outage of the store does
    /// not become an outage of the service. Logged through `tracing`.
    #[default]
    Open,
    /// Refuse the request with `503 Service Unavailable` and `Retry-After: 1`: for routes where
    /// an unlimited request costs more than a refused one (logins, expensive exports).
    Closed,
    /// Check the rule in a local, in-process limiter instead (a [`MemoryStore`] of the layer),
    /// with the usual answers: limits still hold while the shared store is away. Each replica
    /// checks its share of the quota: `1 / replicas`, by the count of the Redis store's
    /// heartbeat before the outage, so that the fleet keeps close to the quota (100 a minute
    /// on 3 replicas: 33 each). See [`FallbackShare`](crate::FallbackShare) for the count
    /// assumed before any was read, and for the whole quota on every replica instead.
    ///
    /// [`MemoryStore`]: crate::store::MemoryStore
    Local,
}
