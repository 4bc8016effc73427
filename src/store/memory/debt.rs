//! The local fallback's charges in debt: a charge costlier than a replica's share is checked
//! at the share's capacity and the rest of its cost charged as a debt, at the same instant.

use smallvec::SmallVec;

use super::MemoryStore;
use crate::Decision;
use crate::store::Charge;

impl MemoryStore {
    /// Checks and charges `charges` now, a charge costlier than its rule's capacity checked
    /// at the capacity (it passes only when the budget is whole) and the rest of its cost
    /// charged as a debt at the same instant, when every rule admits (the local fallback's
    /// charges at a replica's share).
    pub(crate) fn decide_in_debt(&self, charges: &[Charge<'_>]) -> Decision {
        let capacity = |c: &Charge<'_>| c.rule.algorithm().capacity(c.rule.limits());
        if charges.iter().all(|c| c.cost <= capacity(c)) {
            return self.decide(charges);
        }
        let now = self.now();
        let capped: SmallVec<[Charge<'_>; 2]> = charges
            .iter()
            .map(|c| Charge {
                cost: c.cost.min(capacity(c)),
                ..*c
            })
            .collect();
        let mut decision = match capped.as_slice() {
            [charge] => self.check_one(charge, now),
            _ => self.check_many(&capped, now).made_at_time(now),
        };
        if decision.allowed() {
            for (position, (charge, checked)) in charges.iter().zip(&capped).enumerate() {
                if charge.cost > checked.cost {
                    let (algorithm, limits) = (charge.rule.algorithm(), charge.rule.limits());
                    // The answer tells the debt: when the budget is whole again, and when a
                    // next unit is there, as the state is once it is charged.
                    let after = self.modify(charge, now, |state| {
                        algorithm.force(limits, state, now, charge.cost - checked.cost);
                        algorithm.uncharged(limits, state.as_ref(), now, 1)
                    });
                    if let Some(outcome) = decision.outcome_mut(position) {
                        outcome.remaining = 0;
                        outcome.reset = after.reset;
                        outcome.window = after.window;
                    }
                }
            }
        }
        decision
    }
}
