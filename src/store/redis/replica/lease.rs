//! Leases: units this replica took from Redis ahead of its requests and spends itself, their
//! refills (ahead of need too), and the units that go back.

use std::sync::atomic::Ordering;

use smallvec::SmallVec;

use super::Replica;
use super::held::{Held, Paid, lease_key};
use super::plan::How;
use crate::algorithm::Outcome;
use crate::key::Key;
use crate::store::Charge;
use crate::{Decision, DecisionSource};

impl Replica {
    /// Whether this replica's leases hold enough for every charge now (all leased).
    pub(super) fn leases_pay(&self, charges: &[Charge<'_>], now: u64) -> bool {
        !self.leases.is_empty()
            && charges.iter().all(|charge| {
                let key = (lease_key(charge.rule), charge.key.clone());
                charge.rule.lease().is_some()
                    && self
                        .leases
                        .shard(&key)
                        .get_mut(&key)
                        .is_some_and(|held| held.pays(now, charge.cost))
            })
    }

    /// The numbers a leased rule reports for a request whose charge its lease here would pay
    /// (as [`How::Leased`]), without paying it: those of the rule in a request another rule
    /// denies, answered from the deny cache. `None` when it would not pay.
    pub(super) fn leased_numbers(&self, charge: &Charge<'_>, now: u64) -> Option<Outcome> {
        charge.rule.lease()?;
        if charge.cost == 0 {
            return None;
        }
        let key = (lease_key(charge.rule), charge.key.clone());
        let mut shard = self.leases.shard(&key);
        let held = shard.get_mut(&key)?;
        held.pays(now, charge.cost)
            .then(|| held.spent_after(now, charge.cost))
    }

    /// Pays every charge from this replica's leases, all or nothing, in one pass; with `ahead`,
    /// a request whose payment would send a refill ahead of need is left to be planned.
    pub(super) fn paid_by_leases(&self, charges: &[Charge<'_>], ahead: bool) -> Paid {
        let now = self.now();
        let mut outcomes = SmallVec::<[Outcome; 2]>::new();
        // The charges paid, and from which lease.
        let mut taken = SmallVec::<[(&Charge<'_>, u64); 2]>::new();
        let mut due = false;
        for charge in charges {
            let key = (lease_key(charge.rule), charge.key.clone());
            let mut shard = self.leases.shard(&key);
            let Some(held) = shard.get_mut(&key) else {
                due = false;
                break;
            };
            if !held.pays(now, charge.cost) {
                due = false;
                break;
            }
            if ahead && held.ahead(charge.cost) > 0 {
                due = true;
                continue;
            }
            held.pay(charge.cost);
            if charge.cost > 0 {
                held.seen = Some(now);
            }
            outcomes.push(held.spent(now));
            taken.push((charge, held.generation));
        }
        if outcomes.len() == charges.len() {
            return Paid::Yes(Decision::from_outcomes(outcomes).made_by(DecisionSource::Lease));
        }
        // All or nothing: what the charges paid took goes back.
        for (paid, generation) in taken {
            let key = (lease_key(paid.rule), paid.key.clone());
            self.give_back(&key, paid.cost, generation, now);
        }
        if due { Paid::AheadDue } else { Paid::Short }
    }

    /// Gives back units taken from a lease of generation `generation`, if it still lives: units
    /// of an expired or refilled lease are dropped, never spent past their time.
    pub(super) fn give_back(&self, key: &(u64, Key), units: u64, generation: u64, now: u64) {
        if let Some(held) = self.leases.shard(key).get_mut(key)
            && held.generation == generation
            && now < held.until
        {
            held.take_back(units);
        }
    }

    /// The entry of a key of `rule`'s leases of `units`, new.
    pub(super) fn new_lease(&self, rule: &crate::store::RuleSpec, units: u64) -> Held {
        self.leases.len.fetch_add(1, Ordering::Relaxed);
        Held {
            algorithm: rule.algorithm(),
            size: units,
            period: rule.limits().period.max(1),
            generation: self.entries.fetch_add(1, Ordering::Relaxed) << 32,
            ..Held::default()
        }
    }

    /// The units of `held`'s expired lease to give back with this call, unless another
    /// replica reset or refunded the key since they were charged (heard as a tombstone, kept a
    /// minute at least): given back into a window reset since, they would erase charges made
    /// after the reset. A reset heard longer ago than a tombstone lives is not seen: then up to
    /// the units given back (at most `n − 1`) may be admitted once more than the budget.
    pub(super) fn expired_give_back(
        &self,
        charge: &Charge<'_>,
        held: &mut Held,
        ttl: u64,
    ) -> Option<(u64, u64)> {
        let give_back = held.returning.take()?;
        // The expired lease was charged no earlier than this (local time).
        let charged = held.until.saturating_sub(ttl);
        let forgotten = self.may_be_forgotten() && self.forgotten_since(charge, charged);
        (!forgotten).then_some(give_back)
    }

    /// How a charge of a leased rule is paid: from the lease here, by a refill, or by Redis
    /// alone; with the units of the key's expired leases that its call gives back.
    pub(super) fn lease_for(
        &self,
        charge: &Charge<'_>,
        lease: crate::store::Lease,
        now: u64,
    ) -> (How, Option<(u64, u64)>) {
        if charge.cost >= lease.units {
            // More than a replica ever holds: Redis alone decides it.
            return (How::Sent, None);
        }
        let ttl = u64::try_from(lease.ttl.as_micros()).unwrap_or(u64::MAX);
        let key = (lease_key(charge.rule), charge.key.clone());
        let mut shard = self.leases.shard(&key);
        // Full: leases that expired, with no refill out, make room; still full, this request is
        // charged to Redis alone.
        if !self.leases.room(&mut shard, &key, now, |held| {
            !held.refilling && now >= held.until && (held.next == 0 || now >= held.next_until)
        }) {
            return (How::Sent, None);
        }
        let held = shard
            .entry(key)
            .or_insert_with(|| self.new_lease(charge.rule, lease.units));
        // More than one request of the key per time to live here: it is leased.
        let again = held.seen.is_some_and(|seen| now.saturating_sub(seen) < ttl);
        held.seen = Some(now);
        held.roll(now, charge.cost);
        if held.units >= charge.cost {
            let ask = held.ahead(charge.cost);
            held.pay(charge.cost);
            if ask > 0 {
                held.refilling = true;
                held.demand = 0;
                let how = How::Ahead {
                    outcome: held.spent(now),
                    ask,
                    ttl,
                    generation: held.generation,
                    resets: held.resets,
                };
                let give_back = self.expired_give_back(charge, held, ttl);
                return (how, give_back);
            }
            return (How::Leased(held.spent(now), held.generation), None);
        }
        let give_back = self.expired_give_back(charge, held, ttl);
        if held.refilling {
            // No unit here while the refill is out: counted, so that the next goes out sooner.
            held.demand = held.demand.saturating_add(charge.cost);
            return (How::Sent, give_back);
        }
        // The lease follows the key's demand: none for a key seen less than once per time to
        // live; twice the last for one whose lease ran out before its time; what the last
        // spent for one whose lease expired (at least one unit more than the cost).
        let size = if !again {
            charge.cost
        } else if now < held.until {
            held.taken.saturating_mul(2)
        } else {
            held.spent
        }
        .max(charge.cost + u64::from(again))
        .min(lease.units);
        if size <= charge.cost {
            held.spent = 0;
            return (How::Sent, give_back);
        }
        held.refilling = true;
        held.demand = 0;
        let taken = std::mem::take(&mut held.units);
        let how = How::Refill {
            held: taken,
            lease: size,
            ttl,
            generation: held.generation,
            resets: held.resets,
        };
        (how, give_back)
    }
}
