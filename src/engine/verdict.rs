//! Pure functions of a decision: which verdict a denial is, what an answer shows (shadow
//! rules left out), and how long a request that delay rules denied may wait.

use std::time::Duration;

use crate::observe::Verdict;
use crate::policy::RuleIndices;
use crate::policy::snapshot::Snapshot;
use crate::{Decision, DecisionSource, RuleMode};

/// The verdict of a denial: by the store, or by its deny cache.
pub(super) fn denied(decision: &Decision) -> Verdict {
    if decision.source() == DecisionSource::DenyCache {
        Verdict::CacheDenied
    } else {
        Verdict::Denied
    }
}

/// The decision without its shadow rules, which add nothing to answers; `applied` alike.
pub(super) fn visible(
    snapshot: &Snapshot,
    applied: &mut RuleIndices,
    decision: Decision,
) -> Decision {
    if !snapshot.watches {
        return decision;
    }
    let shadow = |i: u16| snapshot.rules[usize::from(i)].mode == RuleMode::Shadow;
    if !applied.iter().any(|&i| shadow(i)) {
        return decision;
    }
    let kept = Decision::from_outcomes(
        applied
            .iter()
            .zip(decision.outcomes())
            .filter(|(i, _)| !shadow(**i))
            .map(|(_, o)| *o),
    );
    applied.retain(|i| !shadow(*i));
    kept
}

/// How long a denied request may wait for the budget of the delay rules that denied it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Delay {
    pub(super) wait: Duration,
    pub(super) max: Duration,
}

/// The wait of a request that only delay rules denied (shadow rules aside), when it fits within
/// the shortest maximum of those rules; `None` otherwise (it is denied).
pub(super) fn delay_of(snapshot: &Snapshot, applied: &[u16], decision: &Decision) -> Option<Delay> {
    let mut wait = 0;
    let mut max = Duration::MAX;
    for (&i, outcome) in applied.iter().zip(decision.outcomes()) {
        if outcome.allowed {
            continue;
        }
        match snapshot.rules[usize::from(i)].mode {
            RuleMode::Shadow => {}
            RuleMode::Delay { max: rule_max } => {
                if outcome.retry_after == u64::MAX {
                    return None;
                }
                wait = wait.max(outcome.retry_after);
                max = max.min(rule_max);
            }
            _ => return None,
        }
    }
    // At least a millisecond: a store that says "now" and still denies is not asked in a loop.
    let wait = Duration::from_micros(wait).max(Duration::from_millis(1));
    (max != Duration::MAX && wait <= max).then_some(Delay { wait, max })
}
