//! [`Denial`]: one denial Redis made, kept to answer the same request here, and an outcome aged
//! by the time since.

use crate::Algorithm;
use crate::algorithm::Outcome;

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
/// callers age an outcome at most until its window). A full budget's window is a constant of
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
