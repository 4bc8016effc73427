use std::fmt;
use std::sync::Arc;

use http::request::Parts;

/// What one request costs under a rule: a fixed number (default 1) or a function of the request.
///
/// ```
/// use tollgate::{Cost, Quota, Rule};
///
/// // Exports cost 10 units of the hourly budget, everything else 1.
/// let rule = Rule::new("hourly", Quota::per_hour(1000)).cost(Cost::from_fn(|parts| {
///     if parts.uri.path().starts_with("/export") { 10 } else { 1 }
/// }));
/// # let _ = rule;
/// ```
///
/// A fixed cost above the rule's capacity is a configuration error. A computed cost above it can
/// never be admitted: the request is denied without a `Retry-After`.
#[derive(Clone)]
pub enum Cost {
    /// The same cost for every request.
    Fixed(u64),
    /// A cost computed from the request head.
    Dynamic(Arc<dyn Fn(&Parts) -> u64 + Send + Sync>),
}

impl Cost {
    /// A cost computed from each request's head.
    pub fn from_fn<F>(f: F) -> Self
    where
        F: Fn(&Parts) -> u64 + Send + Sync + 'static,
    {
        Cost::Dynamic(Arc::new(f))
    }

    /// The cost of one request.
    pub fn of(&self, parts: &Parts) -> u64 {
        match self {
            Cost::Fixed(n) => *n,
            Cost::Dynamic(f) => f(parts),
        }
    }
}

impl Default for Cost {
    fn default() -> Self {
        Cost::Fixed(1)
    }
}

impl From<u64> for Cost {
    fn from(n: u64) -> Self {
        Cost::Fixed(n)
    }
}

impl fmt::Debug for Cost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cost::Fixed(n) => f.debug_tuple("Fixed").field(n).finish(),
            Cost::Dynamic(_) => f.write_str("Dynamic(..)"),
        }
    }
}
