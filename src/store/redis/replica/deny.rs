//! The deny cache: the denials Redis made moments ago, answered on this replica, aged by the time
//! since, until the sooner of their retry-after and their window.

use smallvec::SmallVec;

use super::Replica;
use crate::algorithm::Outcome;
use crate::key::Key;
use crate::store::Charge;
use crate::{Algorithm, Decision, DecisionSource};

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

impl Replica {
    pub(super) fn cached_denial(&self, charges: &[Charge<'_>]) -> Option<Decision> {
        let now = self.now();
        let mut outcomes = SmallVec::<[Outcome; 2]>::new();
        let mut denied = false;
        for charge in charges {
            let key = (charge.rule.fingerprint(), charge.key.clone());
            let entry = self.live_denial(&key, charge, now)?;
            denied |= entry.denies;
            outcomes.push(aged(
                entry.outcome,
                now.saturating_sub(entry.at),
                charge.rule.algorithm(),
            ));
        }
        denied.then(|| Decision::from_outcomes(outcomes).made_by(DecisionSource::DenyCache))
    }

    /// The denial cached for `charge` (under `key`: its sub-key's, for a split key), if it
    /// still stands at `now`: same cost, not past its time, and its key not forgotten since by
    /// another replica (then it goes).
    pub(super) fn live_denial(
        &self,
        key: &(u64, Key),
        charge: &Charge<'_>,
        now: u64,
    ) -> Option<Denial> {
        let entry = *self.denials.shard(key).get(key)?;
        if entry.cost != charge.cost || now >= entry.until {
            return None;
        }
        if self.may_be_forgotten() && self.forgotten_since(charge, entry.at) {
            self.denials.remove(key);
            return None;
        }
        Some(entry)
    }
}
