//! [`Denial`]: one denial Redis made, kept to answer the same request here, and an outcome aged
//! by the time since.

use crate::Algorithm;
use crate::algorithm::{GcraState, Limits, Outcome, State, TokenBucketState};
use crate::store::RuleSpec;

/// One charge of a request Redis denied.
#[derive(Clone, Copy, Debug)]
pub(super) struct Denial {
    pub(super) outcome: Outcome,
    pub(super) cost: u64,
    /// When the check was sent (local microseconds).
    pub(super) at: u64,
    /// Until when the same request is denied here.
    pub(super) until: u64,
    /// Whether this charge denied (the others are kept for their numbers).
    pub(super) denies: bool,
}

/// An outcome `elapsed` microseconds later, nothing else having changed (and no unit come back:
/// callers age an outcome this way at most until its window; [`aged_entry`] ages the others). A full budget's window is a constant of
/// the token bucket, GCRA and sliding log (an interval, a period), not a time that runs out.
pub(super) fn aged(outcome: Outcome, elapsed: u64, algorithm: Algorithm) -> Outcome {
    let constant_window = outcome.remaining >= outcome.limit
        && matches!(
            algorithm,
            Algorithm::TokenBucket | Algorithm::Gcra | Algorithm::SlidingWindowLog
        );
    Outcome {
        reset: outcome.reset.saturating_sub(elapsed),
        retry_after: match outcome.retry_after {
            0 | u64::MAX => outcome.retry_after,
            retry => retry.saturating_sub(elapsed).max(1),
        },
        window: if constant_window {
            outcome.window
        } else {
            outcome.window.saturating_sub(elapsed).max(1)
        },
        ..outcome
    }
}

/// The limits by which a rule's admitting outcome can be aged exactly, past its next unit: a
/// token bucket or GCRA rule (whose outcome holds its whole state), neither leased (its
/// numbers count units held here) nor split (its sub-keys take turns).
pub(super) fn exact_limits(rule: &RuleSpec) -> Option<Limits> {
    (matches!(rule.algorithm(), Algorithm::TokenBucket | Algorithm::Gcra)
        && rule.lease().is_none()
        && rule.parts() == 1)
        .then(|| *rule.limits())
}

/// An entry's outcome at `now`: for a rule that admitted the request and whose outcome holds
/// its state (`exact`), what the reference model gives `now - at` later with nothing charged
/// meanwhile (its units come back as they would in Redis, counted from when the check was
/// sent); else [`aged`].
pub(super) fn aged_entry(
    entry: &Denial,
    now: u64,
    exact: Option<&Limits>,
    algorithm: Algorithm,
) -> Outcome {
    let elapsed = now.saturating_sub(entry.at);
    match exact {
        Some(limits) if entry.outcome.allowed => {
            let outcome = entry.outcome;
            // The state the outcome describes, at a time `t0` far enough from zero; numbers
            // past what the rule can hold (never Redis's) are aged the plain way.
            let horizon = limits
                .burst
                .saturating_add(1)
                .saturating_mul(limits.interval);
            if outcome.reset > horizon || outcome.window > horizon {
                return aged(outcome, elapsed, algorithm);
            }
            let t0 = limits.interval + horizon;
            let state = match algorithm {
                Algorithm::TokenBucket => (outcome.remaining < limits.burst).then(|| {
                    State::TokenBucket(TokenBucketState {
                        tokens: outcome.remaining,
                        updated: t0 + outcome.window - limits.interval,
                    })
                }),
                Algorithm::Gcra => (outcome.reset > 0).then(|| {
                    State::Gcra(GcraState {
                        tat: t0 + outcome.reset,
                    })
                }),
                _ => return aged(outcome, elapsed, algorithm),
            };
            algorithm.uncharged(
                limits,
                state.as_ref(),
                t0.saturating_add(elapsed),
                entry.cost,
            )
        }
        _ => aged(entry.outcome, elapsed, algorithm),
    }
}
