//! [`Local`]: the fallback limiter of rules that fall back to one while the store is away — an
//! in-process memory store, made when first needed, that checks each rule at this replica's
//! share of its quota ([`FallbackShare`]).
//!
//! Every operation of the fallback goes through it (checks, chunks of a metered response,
//! settles, slots given back), so that one rule is one budget here at one share.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use smallvec::SmallVec;

use crate::Decision;
use crate::policy::share::{FallbackShare, divided};
use crate::store::{Adjustment, Charge, MemoryStore, RuleSpec};

/// The most divided rules kept; past it, they are divided again as they come.
const MAX_DIVIDED: usize = 4096;

/// The fallback limiter of a layer.
pub(crate) struct Local {
    share: FallbackShare,
    store: OnceLock<MemoryStore>,
    /// The rules as last divided: by how many replicas, and each by its fingerprint.
    divided: Mutex<(u32, HashMap<u64, RuleSpec>)>,
}

impl Local {
    pub(crate) fn new(share: FallbackShare) -> Self {
        Local {
            share,
            store: OnceLock::new(),
            divided: Mutex::new((1, HashMap::new())),
        }
    }

    /// Decides `charges` here, each rule at this replica's share given the store's last count
    /// of replicas (`counted`); makes the limiter when first needed.
    pub(crate) fn decide(&self, counted: Option<u32>, charges: &[Charge<'_>]) -> Decision {
        let store = self.store.get_or_init(MemoryStore::new);
        self.with_charges(counted, charges, |charges| store.decide(charges))
    }

    /// Decides `charges` on the limiter at once, if it was made (a metered response's next
    /// chunk, wherever its body is read).
    pub(crate) fn decide_if_made(
        &self,
        counted: Option<u32>,
        charges: &[Charge<'_>],
    ) -> Option<Decision> {
        let store = self.store.get()?;
        Some(self.with_charges(counted, charges, |charges| store.decide(charges)))
    }

    /// Calls `f` with `charges` as this replica checks them (see [`within`]).
    fn with_charges<R>(
        &self,
        counted: Option<u32>,
        charges: &[Charge<'_>],
        f: impl FnOnce(&[Charge<'_>]) -> R,
    ) -> R {
        self.with_divided(
            counted,
            charges.iter().map(|c| c.rule),
            |specs| match specs {
                None => f(charges),
                Some(specs) => {
                    let charges: SmallVec<[Charge<'_>; 2]> = charges
                        .iter()
                        .zip(specs)
                        .map(|(c, rule)| Charge {
                            rule: within(c, rule),
                            ..*c
                        })
                        .collect();
                    f(&charges)
                }
            },
        )
    }

    /// Makes `adjustments` on the limiter at once, if it was made (settles, slots given back):
    /// `None` when it was not.
    pub(crate) fn adjust_now(
        &self,
        counted: Option<u32>,
        adjustments: &[Adjustment<'_>],
    ) -> Option<()> {
        let store = self.store.get()?;
        self.with_divided(
            counted,
            adjustments.iter().map(|a| a.rule),
            |specs| match specs {
                None => store.adjust_now(adjustments),
                Some(specs) => {
                    let adjustments: SmallVec<[Adjustment<'_>; 2]> = adjustments
                        .iter()
                        .zip(specs)
                        .map(|(a, rule)| Adjustment { rule, ..*a })
                        .collect();
                    store.adjust_now(&adjustments)
                }
            },
        );
        Some(())
    }

    /// Calls `f` with `rules` as this replica checks them: `None` when its share is the whole
    /// quota, else each divided by the replicas.
    fn with_divided<'a, R>(
        &self,
        counted: Option<u32>,
        rules: impl Iterator<Item = &'a RuleSpec>,
        f: impl FnOnce(Option<&[RuleSpec]>) -> R,
    ) -> R {
        let replicas = self.share.replicas(counted);
        if replicas == 1 {
            return f(None);
        }
        let specs: SmallVec<[RuleSpec; 2]> = {
            let mut table = self.divided.lock().unwrap_or_else(|p| p.into_inner());
            if table.0 != replicas || table.1.len() >= MAX_DIVIDED {
                *table = (replicas, HashMap::new());
            }
            rules
                .map(|rule| {
                    table
                        .1
                        .entry(rule.fingerprint())
                        .or_insert_with(|| divided(rule, replicas))
                        .clone()
                })
                .collect()
        };
        f(Some(&specs))
    }
}

/// The rule a charge is checked at: its share, unless the charge costs more than the share
/// holds (a fixed cost or a chunk sized for the whole rule), which the whole rule checks
/// rather than refuse it for the whole outage.
fn within<'a>(charge: &Charge<'a>, divided: &'a RuleSpec) -> &'a RuleSpec {
    if charge.cost > divided.limits().burst {
        charge.rule
    } else {
        divided
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Algorithm;
    use crate::algorithm::Limits;
    use crate::key::Key;

    #[test]
    fn a_share_is_checked_and_a_charge_costlier_than_it_at_the_whole_rule() {
        let local = Local::new(FallbackShare::per_replica());
        // 30 a minute, a burst of 30: 10 each on 3 replicas.
        let rule = RuleSpec::new(
            "api",
            Algorithm::TokenBucket,
            Limits::new(30, 60_000_000, 30).unwrap(),
        )
        .unwrap();
        let key = Key::text("client");
        let one = [Charge {
            rule: &rule,
            key: &key,
            cost: 1,
        }];
        let admitted = (0..20)
            .filter(|_| local.decide(Some(3), &one).allowed())
            .count();
        assert_eq!(admitted, 10, "a third of the burst");
        // A cost of 12 is more than a share holds: the whole rule decides (its 20 units left
        // admit it), where the share would refuse it for the whole outage.
        let other = Key::text("other");
        let twelve = [Charge {
            rule: &rule,
            key: &other,
            cost: 12,
        }];
        assert!(local.decide(Some(3), &twelve).allowed());
    }
}
