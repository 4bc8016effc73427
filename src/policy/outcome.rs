//! Charges that follow the response: [`ChargeWhen`] (count only some responses) and
//! [`ActualCost`] (a cost known once the handler is done).
//!
//! ```
//! use axum::{Router, Extension, routing::post};
//! use tollgate::{ActualCost, Quota, RateLimitLayer, Rule};
//!
//! // 5 failed logins per minute per client: a login that succeeds gives its unit back.
//! let failed_logins = Rule::new("failed-logins", Quota::per_minute(5)).charge_on_status([401, 403]);
//! // 10,000 tokens per minute, 500 reserved per request and settled at what was used.
//! let tokens = Rule::new("tokens", Quota::per_minute(10_000)).cost(500).settle();
//! let layer = RateLimitLayer::builder().rule(failed_logins).rule(tokens).build()?;
//! let app: Router = Router::new()
//!     .route("/complete", post(|| async { (Extension(ActualCost(1_200)), "done") }))
//!     .layer(layer);
//! # Ok::<(), tollgate::ConfigError>(())
//! ```
//!
//! A request of such a rule **reserves** its cost when it is admitted, like any other, so that
//! concurrent requests are counted exactly (50 concurrent failing logins against a limit of 5
//! admit 5). Once the response head is there, the layer gives the units back when the response
//! does not match [`ChargeWhen`], or settles the difference with the [`ActualCost`] the handler
//! reported: it charges the rest (a debt, when the budget has not as much left: the next
//! requests wait for it) or gives back what was not used, in one store call that the response
//! waits for (the memory store answers at once; on Redis it is one more round trip, so that the
//! client's next request sees it). A response that never comes (the inner service failed, the
//! client left before it) keeps its charge; so does one whose settle call fails (it is
//! logged). A client that leaves while its charge is settled does not undo it: the settle
//! finishes on its own.
//!
//! - The response's `RateLimit` field says what remains after the settle (`r`); its `t` is
//!   the one of the check.
//! - A request decided by the local fallback (the store failed, [`FailureMode::Local`]) is
//!   settled there too.
//! - A debt is bounded: a token bucket or GCRA key is never empty longer than
//!   [`MAX_DEBT_MICROS`](crate::algorithm::MAX_DEBT_MICROS) (about 20 years), a window never
//!   counts more than `u32::MAX`.
//! - gRPC: a tonic error travels in a `200 OK` response (its `grpc-status` in the head, or in
//!   the trailers of a streamed answer), so [`charge_on_status`](crate::Rule::charge_on_status)
//!   sees 200; [`ChargeWhen::from_fn`] can read a `grpc-status` header in the head.
//!
//! [`FailureMode::Local`]: crate::FailureMode::Local

use std::fmt;
use std::sync::Arc;

use http::response::Parts;

/// Which responses a rule charges; the others get their units back.
#[derive(Clone)]
pub struct ChargeWhen(pub(crate) Arc<dyn Fn(&Parts) -> bool + Send + Sync>);

impl ChargeWhen {
    /// Responses `f` says yes to.
    pub fn from_fn<F>(f: F) -> Self
    where
        F: Fn(&Parts) -> bool + Send + Sync + 'static,
    {
        ChargeWhen(Arc::new(f))
    }

    /// Responses of these statuses.
    pub fn status(statuses: impl IntoIterator<Item = u16>) -> Self {
        let statuses: Vec<u16> = statuses.into_iter().collect();
        ChargeWhen::from_fn(move |parts| statuses.contains(&parts.status.as_u16()))
    }

    /// Whether a response with this head is charged.
    pub fn charges(&self, parts: &Parts) -> bool {
        (self.0)(parts)
    }
}

impl fmt::Debug for ChargeWhen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ChargeWhen(..)")
    }
}

/// What a request really cost, set by the handler as a response extension, for rules that
/// [`settle`](crate::Rule::settle): the layer charges the difference with the cost it reserved.
///
/// ```
/// use axum::{Extension, response::IntoResponse};
/// use tollgate::ActualCost;
///
/// async fn complete() -> impl IntoResponse {
///     let used = 1_234; // the tokens the model used
///     (Extension(ActualCost(used)), "the answer")
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ActualCost(pub u64);

/// Where a settled rule reads what a request really cost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum SettleFrom {
    /// The response's [`ActualCost`] extension.
    Extension,
    /// A response header holding a number, which the layer removes.
    Header(http::HeaderName),
}

/// What a rule does once the response head is there.
#[derive(Clone, Debug, Default)]
pub(crate) struct After {
    pub(crate) when: Option<ChargeWhen>,
    pub(crate) settle: Option<SettleFrom>,
}

impl After {
    pub(crate) fn is_empty(&self) -> bool {
        self.when.is_none() && self.settle.is_none()
    }

    /// Whether two rules do the same once the response is there: the same [`ChargeWhen`] (the
    /// same closure, as a reloaded policy that keeps the rule has) and the same [`SettleFrom`].
    pub(crate) fn same_as(&self, other: &After) -> bool {
        let same_when = match (&self.when, &other.when) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(&a.0, &b.0),
            _ => false,
        };
        same_when && self.settle == other.settle
    }

    /// The header the real cost is read from, which the layer removes.
    pub(crate) fn header(&self) -> Option<&http::HeaderName> {
        match &self.settle {
            Some(SettleFrom::Header(name)) => Some(name),
            _ => None,
        }
    }

    /// What the response really cost a request that reserved `cost`: nothing when it does
    /// not match, what it reports when the rule settles, else `cost`.
    pub(crate) fn actual(&self, parts: &Parts, cost: u64) -> u64 {
        if let Some(when) = &self.when
            && !when.charges(parts)
        {
            return 0;
        }
        match &self.settle {
            None => cost,
            Some(SettleFrom::Extension) => parts
                .extensions
                .get::<ActualCost>()
                .map_or(cost, |actual| actual.0),
            Some(SettleFrom::Header(name)) => parts
                .headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(cost),
        }
    }
}
