//! The deny cache: the denials Redis made moments ago, answered on this replica, aged by the time
//! since, until the sooner of their retry-after and their window. The rules that admitted such
//! a request keep their numbers with it: while the denial stands when they can be aged exactly
//! (token bucket, GCRA), else until their own next unit.

use std::sync::atomic::Ordering;

use smallvec::SmallVec;

use super::Replica;
use super::denial::{Denial, aged_entry, exact_limits};
use super::table::Table;
use crate::algorithm::{Limits, Outcome};
use crate::key::Key;
use crate::store::Charge;
use crate::{Decision, DecisionSource};

impl Replica {
    pub(super) fn cached_denial(&self, charges: &[Charge<'_>]) -> Option<Decision> {
        let now = self.now();
        let mut outcomes = SmallVec::<[Outcome; 2]>::new();
        let mut denied = false;
        for charge in charges {
            let key = (charge.rule.fingerprint(), charge.key.clone());
            let exact = exact_limits(charge.rule);
            let (outcome, denies) = self.standing(&key, charge, exact.as_ref(), now)?;
            denied |= denies;
            outcomes.push(outcome);
        }
        denied.then(|| Decision::from_outcomes(outcomes).made_by(DecisionSource::DenyCache))
    }

    /// A charge's outcome at `now` in a request answered from the deny cache, and whether it
    /// denies: a denying entry's, aged; for a leased rule that admits, what its lease here
    /// would report (as when it pays the request: the numbers the replica gives without the
    /// cache); else an admitting entry's, aged. `None` when none stands: Redis decides.
    pub(super) fn standing(
        &self,
        key: &(u64, Key),
        charge: &Charge<'_>,
        exact: Option<&Limits>,
        now: u64,
    ) -> Option<(Outcome, bool)> {
        let entry = self.live_denial(key, charge, now);
        if let Some(entry) = entry.filter(|e| e.denies) {
            return Some((
                aged_entry(&entry, now, exact, charge.rule.algorithm()),
                true,
            ));
        }
        // A leased rule that admits: its lease's numbers here are fresher than any kept.
        if let Some(outcome) = self.leased_numbers(charge, now) {
            return Some((outcome, false));
        }
        entry.map(|e| (aged_entry(&e, now, exact, charge.rule.algorithm()), false))
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

impl Table<Denial> {
    /// Keeps a charge of a denied request. The numbers of a rule that admitted it live as long
    /// as the longest denial they serve: a rule stacked over many keys (a global one) is shared
    /// by the denials of all of them.
    pub(super) fn keep(&self, key: (u64, Key), mut denial: Denial, now: u64) {
        let mut shard = self.shard(&key);
        if !denial.denies
            && let Some(kept) = shard.get(&key)
            && !kept.denies
            && kept.cost == denial.cost
        {
            denial.until = denial.until.max(kept.until);
            // Numbers Redis gave later (an admission settled first) stay.
            if kept.at > denial.at {
                denial.outcome = kept.outcome;
                denial.at = kept.at;
            }
        }
        if self.room(&mut shard, &key, now, |d| d.until <= now)
            && shard.insert(key, denial).is_none()
        {
            self.len.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Redis admitted `cost` of `key` at `at`: a denial of it is over; the numbers kept of it
    /// (it admitted a denied request) are these now, fresher: whatever the cost when `exact`
    /// (they hold the rule's state and age exactly), else for the same cost, until their own
    /// next unit.
    pub(super) fn admitted(
        &self,
        key: (u64, Key),
        cost: u64,
        outcome: &Outcome,
        at: u64,
        exact: bool,
    ) {
        let mut shard = self.shard(&key);
        let Some(kept) = shard.get_mut(&key) else {
            return;
        };
        if kept.denies {
            shard.remove(&key);
            self.len.fetch_sub(1, Ordering::Relaxed);
        } else if (exact || kept.cost == cost) && at >= kept.at {
            // Numbers that age exactly hold the rule's state, whatever the cost that brought
            // them; the others are those of one cost.
            kept.outcome = *outcome;
            kept.at = at;
            if !exact {
                kept.until = kept.until.min(at.saturating_add(outcome.window));
            }
        }
    }
}
