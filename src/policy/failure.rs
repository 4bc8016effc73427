/// What the layer does when the store fails (errs or times out), or when its
/// [`CircuitBreaker`](super::CircuitBreaker) is open.
///
/// ```
/// use tollgate::policy::FailureMode;
/// assert_eq!(FailureMode::default(), FailureMode::Open);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FailureMode {
    /// Let the request through without limiting it (the default): an outage of the store does
    /// not become an outage of the service. Logged through `tracing`.
    #[default]
    Open,
    /// Refuse the request with `503 Service Unavailable` and `Retry-After: 1`: for routes where
    /// an unlimited request costs more than a refused one (logins, expensive exports).
    Closed,
}
