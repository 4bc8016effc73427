//! Charges settled once the response head is there: units given back for the responses a
//! rule does not charge, the difference for a cost known after the response, in one store
//! call (on the fallback limiter for what it decided).

use std::task::{Context, Poll};

use http::Response;
use smallvec::SmallVec;

use super::local::Counted;
use super::state::Engine;
use crate::Decision;
use crate::key::Key;
use crate::policy::snapshot::Snapshot;
use crate::policy::{Applied, AppliedRules, RuleIndices};
use crate::store::{Adjustment, Change, Store, StoreError, StoreFuture};
use crate::throttle::Every;

/// Charges to settle once the response head is there: the rules that charge by the response
/// or settle their cost, their keys and what they reserved, and when.
pub(crate) struct Settle {
    /// The rule, the key, the units reserved and when they were charged (0: not known).
    pub(crate) charges: SmallVec<[(u16, Key, u64, u64); 1]>,
    /// Holds the count of replicas the fallback limiter decided the request at, when it did
    /// (the store failed): it is settled there too, at the same share.
    pub(crate) on_fallback: Option<Counted>,
}

impl<St: Store> Engine<St> {
    /// Settles what a response's head says of the charges it reserved: units back for the
    /// responses a rule does not charge, the difference for a cost known now, in one store
    /// call. The response waits for it (so that the next request sees it), unless the store
    /// answered at once: the store's future is returned when it did not.
    pub(crate) fn settle<B>(
        &self,
        snapshot: &Snapshot,
        settle: &Settle,
        response: Response<B>,
        answer: Option<(&mut Decision, &[u16])>,
    ) -> (Response<B>, Option<StoreFuture<()>>) {
        let (parts, body) = response.into_parts();
        let mut adjustments: SmallVec<[Adjustment<'_>; 1]> = SmallVec::new();
        // Which rule each adjustment is of, by index.
        let mut of_rule: SmallVec<[u16; 1]> = SmallVec::new();
        for (i, key, cost, charged_at) in &settle.charges {
            let rule = &snapshot.rules[usize::from(*i)];
            let Some(after) = &rule.after else {
                continue;
            };
            let actual = after.actual(&parts, *cost);
            let change = match actual.cmp(cost) {
                std::cmp::Ordering::Equal => continue,
                std::cmp::Ordering::Greater => Change::Charge(actual - cost),
                std::cmp::Ordering::Less => Change::Refund(cost - actual),
            };
            adjustments.push(Adjustment {
                rule: &rule.spec,
                key,
                change,
                charged_at: *charged_at,
            });
            of_rule.push(*i);
        }
        // The answer's budget is the settled one: what came back is there again, what was
        // charged on top is not.
        if let Some((decision, applied)) = answer {
            for (a, i) in adjustments.iter().zip(&of_rule) {
                let outcome = applied
                    .iter()
                    .position(|j| j == i)
                    .and_then(|position| decision.outcome_mut(position));
                if let Some(outcome) = outcome {
                    outcome.remaining = match a.change {
                        Change::Refund(units) => (outcome.remaining + units).min(outcome.limit),
                        Change::Charge(units) => outcome.remaining.saturating_sub(units),
                    };
                }
            }
        }
        let pending = (!adjustments.is_empty())
            .then(|| self.adjust_where(settle.on_fallback, &adjustments))
            .and_then(poll_once);
        (Response::from_parts(parts, body), pending)
    }
}

/// A store's future of an operation, polled once: `None` when it is done (a store that answers
/// at once, as the memory store does), else the future to wait for.
fn poll_once(mut future: StoreFuture<()>) -> Option<StoreFuture<()>> {
    let mut context = Context::from_waker(std::task::Waker::noop());
    match future.as_mut().poll(&mut context) {
        Poll::Ready(result) => {
            report_settle(result);
            None
        }
        Poll::Pending => Some(future),
    }
}

/// Says when a settle failed (at most once every 10 s: an outage, or a runtime shutting down
/// with settles left to it, would say it for every request): the reserved units stay charged.
pub(crate) fn report_settle(result: Result<(), StoreError>) {
    static WARNED: Every = Every::new();
    if let Err(error) = result
        && WARNED.due(crate::clock::unix_micros(), 10_000_000)
    {
        tracing::warn!(
            %error,
            "tollgate: could not settle a charge; the reserved units stay (said at most every 10 s)"
        );
    }
}

/// The charges of `applied` rules that `wanted` picks, with when each was made (0 when the
/// store did not say: "now" on its clock, when they are adjusted).
pub(super) fn charges_of(
    applied: &RuleIndices,
    keys: Option<&AppliedRules>,
    decision: &Decision,
    wanted: impl Fn(u16) -> bool,
) -> SmallVec<[(u16, Key, u64, u64); 1]> {
    let Some(keys) = keys else {
        return SmallVec::new();
    };
    keys.iter()
        .filter(|Applied { rule: i, .. }| wanted(*i))
        .filter_map(|Applied { rule: i, key, cost }| {
            let position = applied.iter().position(|j| j == i)?;
            Some((*i, key.clone(), *cost, decision.charged_at(position)))
        })
        .collect()
}
