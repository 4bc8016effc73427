//! [`DecisionHook`]: every decision sent to a bounded channel, never blocking a request.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;

use super::{Decided, Verdict, rule_outcome};
use crate::clock::unix_micros;
use crate::policy::Tenant;

/// The sending side of the decision channel, given to
/// [`RateLimitLayerBuilder::decision_hook`](crate::RateLimitLayerBuilder::decision_hook).
///
/// A request never waits for the channel: when it is full, the event is dropped and counted
/// ([`dropped`](DecisionHook::dropped), and `tollgate_decision_events_dropped_total` with the
/// feature `metrics`).
#[derive(Clone, Debug)]
pub struct DecisionHook {
    sender: mpsc::Sender<DecisionEvent>,
    dropped: Arc<AtomicU64>,
}

/// The receiving side of the decision channel.
pub type DecisionReceiver = mpsc::Receiver<DecisionEvent>;

impl DecisionHook {
    /// A channel of `capacity` events (at least 1).
    pub fn channel(capacity: usize) -> (DecisionHook, DecisionReceiver) {
        let (sender, receiver) = mpsc::channel(capacity.max(1));
        (
            DecisionHook {
                sender,
                dropped: Arc::default(),
            },
            receiver,
        )
    }

    /// How many events were dropped because the channel was full or closed.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    pub(crate) fn send(
        &self,
        decided: &Decided<'_>,
        route: &str,
        tier: &Arc<str>,
        tenant: Option<&Tenant>,
    ) {
        // A full channel costs nothing to find out: no event is built.
        let Ok(permit) = self.sender.try_reserve() else {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            #[cfg(feature = "metrics")]
            metrics::counter!("tollgate_decision_events_dropped_total").increment(1);
            return;
        };
        let outcomes = decided.decision.map(|d| d.outcomes());
        let rules = decided
            .applied
            .iter()
            .enumerate()
            .map(|(n, &i)| {
                let rule = &decided.snapshot.rules[usize::from(i)];
                let outcome = outcomes.and_then(|o| o.get(n));
                RuleEvent {
                    name: rule.spec.shared_name().clone(),
                    outcome: rule_outcome(
                        decided.verdict,
                        rule.mode,
                        rule.on_store_error,
                        outcome.map(|o| o.allowed),
                    ),
                    remaining: outcome.map(|o| o.remaining),
                    retry_after: outcome
                        .filter(|o| !o.allowed && o.retry_after != u64::MAX)
                        .map(|o| Duration::from_micros(o.retry_after)),
                }
            })
            .collect();
        permit.send(DecisionEvent {
            at_unix_micros: unix_micros(),
            verdict: decided.verdict,
            route: (!route.is_empty()).then(|| Arc::from(route)),
            // A layer without a policy has no tier.
            tier: (!tier.is_empty()).then(|| tier.clone()),
            tenant: tenant.map(|t| Arc::from(t.id())),
            rules,
            store_latency: decided.store_latency,
        });
    }
}

/// One decided request.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct DecisionEvent {
    /// When it was decided, in microseconds since the Unix epoch.
    pub at_unix_micros: u64,
    /// What became of it.
    pub verdict: Verdict,
    /// Its route pattern or gRPC method, when it has one.
    pub route: Option<Arc<str>>,
    /// The tier it was limited by (none for a layer without a policy).
    pub tier: Option<Arc<str>>,
    /// Its tenant's id, when it has a tenant.
    pub tenant: Option<Arc<str>>,
    /// Each rule that applied.
    pub rules: Vec<RuleEvent>,
    /// How long the store took to answer, when it was asked (and the feature `metrics` is on).
    pub store_latency: Option<Duration>,
}

/// What one rule made of a request.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RuleEvent {
    /// The rule's name.
    pub name: Arc<str>,
    /// `allowed`, `denied`, `not_charged` (it admitted, another rule denied), `shadow_denied`,
    /// `delayed`, `failed_open`, `failed_closed`, `local_allowed` or `local_denied`.
    pub outcome: &'static str,
    /// What is left of its budget, when the store answered.
    pub remaining: Option<u64>,
    /// For a rule that denied: when it would admit the request.
    pub retry_after: Option<Duration>,
}
