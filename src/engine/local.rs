//! [`Local`]: the fallback limiter of rules that fall back to one while the store is away — an
//! in-process memory store, made when first needed, that checks each rule at this replica's
//! share of its quota ([`FallbackShare`]).
//!
//! Every operation of the fallback goes through it (checks, chunks of a metered response,
//! settles, slots given back), so that one rule is one budget here: a request's units are given
//! back at the share it was admitted at, and a stream's later charges are made at the smaller
//! of that share and today's, so no give-back refills a share past what was taken.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use smallvec::SmallVec;

use crate::Decision;
use crate::policy::share::{FallbackShare, divided};
use crate::store::{Adjustment, Change, Charge, MemoryStore, RuleSpec};

/// The most divided rules kept; past it, they are divided again as they come.
const MAX_DIVIDED: usize = 4096;

/// Holds the store's count of replicas when the fallback limiter decided a request (`None`: it
/// never counted): what the request gives back later is given back at the same share, whatever
/// the count is by then, so that a refund never refills a share by more than it charged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Counted(pub(crate) Option<u32>);

/// The fallback limiter of a layer.
pub(crate) struct Local {
    share: FallbackShare,
    store: OnceLock<MemoryStore>,
    /// The rules as divided, by how many replicas and their fingerprint (a request decided
    /// before the count changed gives back at its own share while new ones use the new).
    divided: Mutex<HashMap<(u32, u64), RuleSpec>>,
}

impl Local {
    pub(crate) fn new(share: FallbackShare) -> Self {
        Local {
            share,
            store: OnceLock::new(),
            divided: Mutex::new(HashMap::new()),
        }
    }

    /// Makes `store` the limiter (the fleet simulation's, on its replica's clock): ignored
    /// once one was made.
    #[cfg(all(test, feature = "redis"))]
    pub(crate) fn use_store(&self, store: MemoryStore) {
        let _ = self.store.set(store);
    }

    /// Decides `charges` here, each rule at this replica's share given the store's last count
    /// of replicas (`counted`); makes the limiter when first needed.
    pub(crate) fn decide(&self, counted: Option<u32>, charges: &[Charge<'_>]) -> Decision {
        let store = self.store.get_or_init(MemoryStore::new);
        self.decide_on(store, counted, charges)
    }

    /// Returns whichever of two counts gives the smaller share: a metered response's next
    /// chunk is taken at it (at most the share the fleet has now, so a stream admitted before
    /// the fleet grew does not keep a larger share), and its units given back at the count it
    /// was admitted at, which gives back no more than the smaller share took.
    fn smaller_share(&self, admitted: Option<u32>, now: Option<u32>) -> Option<u32> {
        if self.share.replicas(now) > self.share.replicas(admitted) {
            now
        } else {
            admitted
        }
    }

    /// Decides `charges` on the limiter at once, if it was made (a metered response's next
    /// chunk, wherever its body is read), for a request admitted at the count `admitted`: at
    /// the [smaller share](Self::smaller_share) of that and the count `now`.
    pub(crate) fn decide_if_made(
        &self,
        admitted: Option<u32>,
        now: Option<u32>,
        charges: &[Charge<'_>],
    ) -> Option<Decision> {
        let store = self.store.get()?;
        Some(self.decide_on(store, self.smaller_share(admitted, now), charges))
    }

    /// Decides `charges` on `store`, each at its share: a charge costlier than the share's
    /// burst (a fixed cost, a metered chunk) is checked for the whole burst, so it passes only
    /// when the share is whole, and the rest of its cost is charged as a debt the next
    /// requests wait for. A request's adjustments are made at the share it was decided at (a
    /// stream's later charges at the smaller of that and today's), so that units given back
    /// never refill a share past what was taken.
    fn decide_on(
        &self,
        store: &MemoryStore,
        counted: Option<u32>,
        charges: &[Charge<'_>],
    ) -> Decision {
        self.with_divided(
            counted,
            charges.iter().map(|c| c.rule),
            |specs| match specs {
                None => store.decide(charges),
                Some(specs) => {
                    let within: SmallVec<[Charge<'_>; 2]> = charges
                        .iter()
                        .zip(specs)
                        .map(|(c, rule)| Charge { rule, ..*c })
                        .collect();
                    store.decide_in_debt(&within)
                }
            },
        )
    }

    /// Makes `adjustments` on the limiter at once, if it was made (settles, slots given back):
    /// `None` when it was not. Of a request decided at the count `admitted`, units given back
    /// go back at that share, and units charged on top are charged at the
    /// [smaller share](Self::smaller_share) of it and the count `now`: neither refills a share
    /// past what it took.
    pub(crate) fn adjust_now(
        &self,
        admitted: Option<u32>,
        now: Option<u32>,
        adjustments: &[Adjustment<'_>],
    ) -> Option<()> {
        let store = self.store.get()?;
        let charged = self.smaller_share(admitted, now);
        if charged == admitted {
            self.adjust_at(store, admitted, adjustments);
        } else {
            let (charges, refunds): (SmallVec<[_; 1]>, SmallVec<[_; 1]>) = adjustments
                .iter()
                .copied()
                .partition(|a| matches!(a.change, Change::Charge(_)));
            self.adjust_at(store, charged, &charges);
            self.adjust_at(store, admitted, &refunds);
        }
        Some(())
    }

    /// Makes `adjustments` on `store` at the share of `counted`.
    fn adjust_at(&self, store: &MemoryStore, counted: Option<u32>, adjustments: &[Adjustment<'_>]) {
        if adjustments.is_empty() {
            return;
        }
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
            if table.len() >= MAX_DIVIDED {
                table.clear();
            }
            rules
                .map(|rule| {
                    table
                        .entry((replicas, rule.fingerprint()))
                        .or_insert_with(|| divided(rule, replicas))
                        .clone()
                })
                .collect()
        };
        f(Some(&specs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Algorithm;
    use crate::algorithm::Limits;
    use crate::key::Key;
    use crate::store::Change;

    fn bucket(limit: u64) -> RuleSpec {
        RuleSpec::new(
            "api",
            Algorithm::TokenBucket,
            Limits::new(limit, 60_000_000, limit).unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn a_share_is_checked_and_a_charge_costlier_than_it_only_when_the_share_is_whole() {
        let local = Local::new(FallbackShare::per_replica());
        // 30 a minute, a burst of 30: 10 each on 3 replicas.
        let rule = bucket(30);
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
        // A cost of 12 is more than a share holds: admitted when the share is whole, as a
        // debt, then nothing more until the debt is paid.
        let other = Key::text("other");
        let twelve = [Charge {
            rule: &rule,
            key: &other,
            cost: 12,
        }];
        assert!(local.decide(Some(3), &twelve).allowed());
        assert!(!local.decide(Some(3), &twelve).allowed(), "once a share");
        let one_more = [Charge {
            rule: &rule,
            key: &other,
            cost: 1,
        }];
        assert!(!local.decide(Some(3), &one_more).allowed(), "in debt");
    }

    #[test]
    fn the_smaller_share_is_the_one_of_more_replicas() {
        let local = Local::new(FallbackShare::per_replica());
        assert_eq!(
            local.smaller_share(Some(2), Some(4)),
            Some(4),
            "the fleet grew"
        );
        assert_eq!(
            local.smaller_share(Some(4), Some(2)),
            Some(4),
            "the fleet shrank"
        );
        assert_eq!(
            local.smaller_share(None, Some(10)),
            Some(10),
            "more than the 8 assumed"
        );
        assert_eq!(
            local.smaller_share(None, Some(3)),
            None,
            "fewer than the 8 assumed"
        );
    }

    /// An answer admitted in debt tells it: the budget is whole again once the whole cost is
    /// repaid, and a next unit is there once the debt and that unit are.
    #[test]
    fn a_charge_admitted_in_debt_answers_when_its_debt_is_repaid() {
        let local = Local::new(FallbackShare::per_replica());
        // 30 a minute: 10 each on 3 replicas, a unit every 6 s.
        let rule = bucket(30);
        let key = Key::text("client");
        let twelve = [Charge {
            rule: &rule,
            key: &key,
            cost: 12,
        }];
        let decision = local.decide(Some(3), &twelve);
        assert!(decision.allowed());
        let outcome = decision.outcomes()[0];
        assert_eq!(outcome.remaining, 0, "{outcome:?}");
        // 12 units at 6 s each: 72 s until whole, not the 60 s of the 10 the share holds.
        assert!(outcome.reset >= 71_900_000, "{outcome:?}");
        // The debt of 2 and one unit more: 18 s.
        assert!(outcome.window >= 17_900_000, "{outcome:?}");
    }

    /// Ten replicas, 100 a minute, cost 20: each replica's share is 10, so the fleet admits
    /// one request of 20 per replica (200 units: the share's bound), not 100 per replica.
    #[test]
    fn a_fleet_of_costly_charges_stays_within_one_charge_per_replica() {
        let rule = bucket(100);
        let key = Key::text("client");
        let twenty = [Charge {
            rule: &rule,
            key: &key,
            cost: 20,
        }];
        let units: u64 = (0..10)
            .map(|_| {
                let local = Local::new(FallbackShare::per_replica());
                (0..10)
                    .filter(|_| local.decide(Some(10), &twenty).allowed())
                    .count() as u64
                    * 20
            })
            .sum();
        assert_eq!(units, 200);
    }

    /// A metered chunk larger than the share, given back unspent, never refills the share
    /// past what it held: 25 replicas, 10,000 a minute, chunks of 500.
    #[test]
    fn units_given_back_refill_no_more_than_was_taken() {
        let rule = bucket(10_000);
        let key = Key::text("client");
        let chunk = [Charge {
            rule: &rule,
            key: &key,
            cost: 500,
        }];
        let local = Local::new(FallbackShare::per_replica());
        let mut streams = 0;
        for _ in 0..1_000 {
            if !local.decide(Some(25), &chunk).allowed() {
                continue;
            }
            streams += 1;
            // The stream spends 100 of its 500 and gives the rest back.
            let back = [Adjustment {
                rule: &rule,
                key: &key,
                change: Change::Refund(400),
                charged_at: 0,
            }];
            local.adjust_now(Some(25), Some(25), &back);
        }
        // The share is 400: one stream of 100 fits at 500 taken when whole, then 100 of debt
        // paid back only by time (none passes here), so the replica delivers about its share.
        assert!(streams * 100 <= 400 + 100, "{streams} streams of 100 units");
    }

    #[test]
    fn a_replica_that_never_counted_takes_an_eighth() {
        let local = Local::new(FallbackShare::per_replica());
        let rule = bucket(80);
        let key = Key::text("client");
        let one = [Charge {
            rule: &rule,
            key: &key,
            cost: 1,
        }];
        let admitted = (0..100)
            .filter(|_| local.decide(None, &one).allowed())
            .count();
        assert_eq!(admitted, 10);
    }

    /// A clock that moves a microsecond at every reading.
    #[derive(Default)]
    struct Ticking(std::sync::atomic::AtomicU64);

    impl crate::clock::Clock for Ticking {
        fn now_micros(&self) -> u64 {
            1_700_000_000_000_000 + self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        }
    }

    /// A concurrency charge costlier than the share takes its debt at the decision's time, so
    /// the slots given back at that time free all of it (on a clock that moves between
    /// calls, a debt stamped later was never given back).
    #[test]
    fn slots_taken_in_debt_are_given_back_whole() {
        let local = Local::new(FallbackShare::per_replica());
        let store = MemoryStore::builder().clock(Ticking::default()).build();
        local.store.set(store.unwrap()).ok();
        let rule = RuleSpec::new(
            "slots",
            Algorithm::Concurrency,
            Limits::new(3, 60_000_000, 3).unwrap(),
        )
        .unwrap();
        let key = Key::text("client");
        let two = [Charge {
            rule: &rule,
            key: &key,
            cost: 2,
        }];
        // 3 slots over 3 replicas: a share of 1, the request of 2 in debt by 1.
        let decision = local.decide(Some(3), &two);
        assert!(decision.allowed());
        let back = [Adjustment {
            rule: &rule,
            key: &key,
            change: Change::Refund(2),
            charged_at: decision.made_at(),
        }];
        local.adjust_now(Some(3), Some(3), &back);
        let one = [Charge {
            rule: &rule,
            key: &key,
            cost: 1,
        }];
        assert!(
            local.decide(Some(3), &one).allowed(),
            "the share is free again"
        );
    }
}
