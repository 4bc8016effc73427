//! [`Plan`]: what one check of a remote store sends, spends on this replica and caches, and how
//! it settles with Redis's reply (or without one).

use std::sync::Arc;

use smallvec::SmallVec;

use super::Replica;
use super::denial::{Denial, exact_limits};
use super::held::lease_key;
use super::split::{mix, whole};
use crate::algorithm::{Limits, Outcome};
use crate::key::Key;
use crate::store::redis::script::{Charges, Prepared, Reply};
use crate::store::{Charge, StoreError};
use crate::{Algorithm, Decision, DecisionSource};

/// What one check of a remote store does with each charge.
pub(crate) struct Plan {
    pub(super) local: Arc<Replica>,
    /// When the check was sent (local microseconds).
    pub(super) at: u64,
    /// One held inline: a check of one rule (the common one) allocates nothing here, and the
    /// plan is half the size to move; a check of more takes one block for all of them.
    pub(super) charges: SmallVec<[Planned; 1]>,
    pub(super) settled: bool,
    /// The request was answered before the call (paid here): what it spent never goes back.
    pub(super) detached: bool,
}

/// One charge of a [`Plan`].
pub(super) struct Planned {
    /// The rule's fingerprint, mixed with the sub-key of a split rule.
    pub(super) fingerprint: u64,
    /// The key of its leases, for a leased rule.
    pub(super) lease_key: u64,
    pub(super) key: Key,
    pub(super) cost: u64,
    pub(super) algorithm: Algorithm,
    pub(super) period: u64,
    /// The sub-key of a split rule, and how many there are.
    pub(super) part: Option<(u16, u16)>,
    /// The rule's capacity (a split rule's sub-keys hold less).
    pub(super) capacity: u64,
    /// The limits by which its admitting outcome ages exactly in the deny cache, if it does.
    pub(super) exact: Option<Limits>,
    pub(super) how: How,
    /// Units of this key's leases that expired unspent, and when Redis charged them: this
    /// call gives them back.
    pub(super) give_back: Option<(u64, u64)>,
}

#[derive(Clone, Copy, Debug)]
pub(super) enum How {
    /// Sent to Redis as it is.
    Sent,
    /// Denied here: Redis denied the same request moments ago (a split key's sub-key).
    Cached(Outcome),
    /// Taken from this replica's lease (of that generation), not sent; its outcome as the lease
    /// reports it.
    Leased(Outcome, u64),
    /// Sent as a lease refill: `held` units were taken from the lease here (of generation
    /// `generation`; they are spent on this request too), and Redis is asked for `cost - held`
    /// to `lease - held`.
    Refill {
        held: u64,
        lease: u64,
        ttl: u64,
        generation: u64,
        resets: u64,
    },
    /// Paid from this replica's lease (of that generation), as [`Leased`](How::Leased), and
    /// sent as a refill ahead of need: Redis is asked for every unit there is up to `ask`, at
    /// cost 0.
    Ahead {
        outcome: Outcome,
        ask: u64,
        ttl: u64,
        generation: u64,
        resets: u64,
    },
}

impl Plan {
    /// Whether the check needs Redis at all.
    pub(crate) fn sends(&self) -> bool {
        self.charges
            .iter()
            .any(|c| matches!(c.how, How::Sent | How::Refill { .. } | How::Ahead { .. }))
    }

    /// Whether every charge is paid here (from leases), whatever Redis answers: its refills
    /// ahead of need only add units.
    pub(crate) fn paid_here(&self) -> bool {
        self.charges
            .iter()
            .all(|c| matches!(c.how, How::Leased(..) | How::Ahead { .. }))
    }

    /// The decision of a request paid here, when it sends only refills ahead of need: it is
    /// answered now, and this plan goes on to settle the refills by itself (what the request
    /// spent no longer goes back, whatever becomes of the call).
    pub(crate) fn detach(&mut self) -> Option<Decision> {
        if !self.paid_here() {
            return None;
        }
        self.detached = true;
        Some(self.paid_decision())
    }

    /// The decision of a request paid here: the outcomes its leases reported.
    pub(super) fn paid_decision(&self) -> Decision {
        let outcomes = self.charges.iter().filter_map(|planned| match planned.how {
            How::Leased(outcome, _) | How::Ahead { outcome, .. } => Some(outcome),
            _ => None,
        });
        Decision::from_outcomes(outcomes).made_by(DecisionSource::Lease)
    }

    /// The charges to send, in order, with the lease of each refill.
    pub(crate) fn prepared(&self, prefix: &str, charges: &[Charge<'_>]) -> Charges {
        let mut all = Charges::with_capacity(charges.len());
        for (planned, charge) in self.charges.iter().zip(charges) {
            let (cost, lease) = match planned.how {
                How::Sent => (charge.cost, 0),
                How::Leased(..) | How::Cached(_) => continue,
                // A refill starts below the cost, and what is held never reaches the lease (it
                // holds at most `lease - cost` after a refill).
                How::Refill { held, lease, .. } => {
                    let cost = charge.cost.saturating_sub(held);
                    (cost, lease.saturating_sub(held).max(cost))
                }
                // Paid here: Redis is asked for units only.
                How::Ahead { ask, .. } => (0, ask),
            };
            let mut one = match planned.part {
                Some((part, _)) => Prepared::of_part(prefix, charge, part),
                None => Prepared::new(prefix, charge),
            };
            one.cost = cost;
            one.lease = lease;
            one.give_back = planned.give_back;
            all.push(one);
        }
        all
    }

    /// The decision of the request from Redis's reply to [`prepared`](Plan::prepared) (none
    /// when nothing was sent): refills become leases, denials are cached, and units taken here
    /// go back when the request is not admitted.
    pub(crate) fn settle(
        &mut self,
        reply: Option<Result<Reply, StoreError>>,
    ) -> Result<Decision, StoreError> {
        self.settled = true;
        let reply = match reply {
            None => Reply {
                now: 0,
                outcomes: SmallVec::new(),
                taken: SmallVec::new(),
                times: None,
            },
            Some(Ok(reply)) => reply,
            Some(Err(error)) => return self.failed(error),
        };
        let n = self.charges.len();
        if reply.outcomes.len() == n
            && reply.taken.len() == n
            && reply.times.as_ref().is_none_or(|times| times.len() == n)
            && self
                .charges
                .iter()
                .all(|c| matches!(c.how, How::Sent) && c.part.is_none())
        {
            return Ok(self.settle_sent(reply));
        }
        self.settle_charge_by_charge(reply)
    }

    /// [`settle`](Plan::settle) for any plan: each charge's outcome from the lease here or from
    /// Redis, refills made leases, denials cached, units taken here given back when the request
    /// is not admitted.
    pub(super) fn settle_charge_by_charge(&mut self, reply: Reply) -> Result<Decision, StoreError> {
        self.settled = true;
        let local = self.local.clone();
        // The outcome of each charge: from the lease here, or from Redis (with what it took,
        // and when, when the charges went to several nodes: their times follow the charges
        // sent, and are moved to the charges of the request).
        let mut sent = reply.outcomes.iter().zip(&reply.taken);
        let mut sent_times = reply.times.as_deref().map(|times| times.iter());
        let mut times: Option<Vec<u64>> = sent_times
            .is_some()
            .then(|| Vec::with_capacity(self.charges.len()));
        let mut outcomes = SmallVec::<[Outcome; 2]>::new();
        let mut taken = SmallVec::<[u64; 2]>::new();
        for planned in &self.charges {
            let (outcome, units) = match planned.how {
                How::Leased(outcome, _) | How::Cached(outcome) => {
                    if let Some(times) = &mut times {
                        times.push(reply.now);
                    }
                    (outcome, 0)
                }
                How::Sent | How::Refill { .. } | How::Ahead { .. } => match sent.next() {
                    // A sub-key's outcome, told for the whole key: its capacity, and what is
                    // left of it if every sub-key has what this one has.
                    Some((outcome, units)) => {
                        if let (Some(times), Some(sent_times)) = (&mut times, &mut sent_times) {
                            times.push(sent_times.next().copied().unwrap_or(reply.now));
                        }
                        match planned.part {
                            Some((_, parts)) => (whole(*outcome, parts, planned.capacity), *units),
                            None => (*outcome, *units),
                        }
                    }
                    None => {
                        return self.failed(StoreError::Protocol(
                            "the rate-limit code answered fewer charges than it was sent".into(),
                        ));
                    }
                },
            };
            outcomes.push(outcome);
            taken.push(units);
        }
        // A request paid here stands whatever Redis says of its refills (at cost 0, it admits).
        let admitted = self.paid_here() || outcomes.iter().all(|o| o.allowed);
        for (i, ((planned, outcome), units)) in self
            .charges
            .iter()
            .zip(outcomes.iter_mut())
            .zip(taken)
            .enumerate()
        {
            let (ttl, generation, resets) = match planned.how {
                How::Refill {
                    ttl,
                    generation,
                    resets,
                    ..
                }
                | How::Ahead {
                    ttl,
                    generation,
                    resets,
                    ..
                } => (ttl, generation, resets),
                _ => continue,
            };
            let key = (planned.lease_key, planned.key.clone());
            let mut shard = local.leases.shard(&key);
            let Some(lease) = shard.get_mut(&key) else {
                continue;
            };
            lease.refilling = false;
            if !admitted {
                // A refill's units taken here go back (an ahead refill's cost goes back with
                // the leased charges, below).
                if let How::Refill { held, .. } = planned.how
                    && lease.generation == generation
                    && local.now() < lease.until
                {
                    lease.take_back(held);
                }
                continue;
            }
            // What this request did not spend of what it took stays here until it expires,
            // never past the end of a counted window.
            // On the clock of the node that charged it (a cluster's slots each have their own).
            let charged_at = times
                .as_ref()
                .and_then(|times| times.get(i).copied())
                .unwrap_or(reply.now);
            let horizon = match planned.algorithm {
                Algorithm::FixedWindow | Algorithm::SlidingWindowCounter => {
                    planned.period - charged_at % planned.period
                }
                _ => u64::MAX,
            };
            let until = self.at.saturating_add(ttl.min(horizon));
            // Units taken before a reset of the key are not kept after it.
            let units = if lease.resets == resets { units } else { 0 };
            // When Redis charged them: units of a window left unspent go back into it.
            let charged = planned.algorithm.lease_gives_back().then(|| {
                times
                    .as_ref()
                    .and_then(|t| t.get(i).copied())
                    .unwrap_or(reply.now)
            });
            lease.settle_demand();
            if let How::Refill { held, .. } = planned.how {
                // A new lease: units given back meanwhile to the old one end with it.
                lease.expire(lease.units, lease.charged);
                lease.generation = lease.generation.wrapping_add(1);
                lease.units = units.saturating_sub(planned.cost.saturating_sub(held));
                lease.taken = units + held;
                lease.until = until;
                lease.charged = charged;
            } else {
                lease.wait(units, until, local.now(), charged);
            }
            lease.outcome = *outcome;
            lease.at = self.at;
            *outcome = lease.spent(self.at);
        }
        if admitted {
            // Redis admitted what it was asked to charge: those denials are over (a request
            // paid here, or a refill ahead of need, says nothing of Redis's budget). A rule
            // kept only for its numbers (it admitted a denied request) keeps them, fresher.
            if !local.denials.is_empty() {
                for (planned, outcome) in self.charges.iter().zip(&outcomes) {
                    let key = (planned.fingerprint, planned.key.clone());
                    match planned.how {
                        How::Sent => local.denials.admitted(
                            key,
                            planned.cost,
                            outcome,
                            self.at,
                            planned.exact.is_some(),
                        ),
                        // Its numbers count units held here: not Redis's to keep.
                        How::Refill { .. } => local.denials.remove(&key),
                        _ => {}
                    }
                }
            }
        } else {
            self.undo_leased();
            if self.sends() {
                self.cache_denial(&outcomes);
            }
        }
        let source = if self.paid_here() {
            DecisionSource::Lease
        } else if self.sends() {
            DecisionSource::Store
        } else if self.charges.iter().any(|c| matches!(c.how, How::Cached(_))) {
            DecisionSource::DenyCache
        } else {
            DecisionSource::Lease
        };
        let decision = Decision::of_outcomes(outcomes)
            .made_by(source)
            .made_at_time(reply.now);
        Ok(match times {
            Some(times) => decision.charged_at_times(times),
            None => decision,
        })
    }

    /// The decision of a check whose every charge went to Redis as it is (no lease, no
    /// sub-key, nothing cached), from its reply: [`settle`](Plan::settle) for the common case,
    /// whose outcomes and times are Redis's own, in order.
    fn settle_sent(&self, reply: Reply) -> Decision {
        let local = &self.local;
        if reply.allowed() {
            // Redis admitted it: those denials are over, or keep their numbers, fresher.
            if !local.denials.is_empty() {
                for (planned, outcome) in self.charges.iter().zip(&reply.outcomes) {
                    let key = (planned.fingerprint, planned.key.clone());
                    let exact = planned.exact.is_some();
                    local
                        .denials
                        .admitted(key, planned.cost, outcome, self.at, exact);
                }
            }
        } else {
            // Nothing was taken here to give back.
            self.cache_denial(&reply.outcomes);
        }
        let decision = Decision::of_outcomes(reply.outcomes).made_at_time(reply.now);
        match reply.times {
            Some(times) => decision.charged_at_times(times),
            None => decision,
        }
    }

    /// Keeps a denial: until the sooner of the denying rules' retry-after and window. Never
    /// one of a request with a concurrency rule: its slots come back when responses end, which
    /// no time here can tell.
    pub(super) fn cache_denial(&self, outcomes: &[Outcome]) {
        let local = &self.local;
        if local.denials.shards.per_shard() == 0
            || self.charges.iter().any(|c| c.algorithm.is_concurrency())
        {
            return;
        }
        let until = outcomes
            .iter()
            .filter(|o| !o.allowed && o.retry_after != u64::MAX)
            .map(|o| o.retry_after.min(o.window))
            .min();
        let Some(wait) = until else {
            // Only costs above a rule's capacity: never admitted, nothing to wait for.
            return;
        };
        // Capped: a reset or refund made elsewhere whose message was lost is seen by then.
        let until = self.at.saturating_add(wait.min(local.max_age));
        for (planned, outcome) in self.charges.iter().zip(outcomes) {
            let denial = Denial {
                outcome: *outcome,
                cost: planned.cost,
                at: self.at,
                // A rule that admits is kept for its numbers: while the denial stands when they
                // age exactly (its units come back as in Redis), else until its own next unit;
                // so is one whose cost never fits (its retry-after is no bound).
                until: if (outcome.allowed && planned.exact.is_none())
                    || outcome.retry_after == u64::MAX
                {
                    until.min(self.at.saturating_add(outcome.window))
                } else {
                    until
                },
                denies: !outcome.allowed,
            };
            local
                .denials
                .keep((planned.fingerprint, planned.key.clone()), denial, self.at);
        }
    }

    /// Units taken from leases here go back (the request was not admitted), to the leases they
    /// came from while those live.
    pub(super) fn undo_leased(&self) {
        if self.detached {
            return;
        }
        let now = self.local.now();
        for planned in &self.charges {
            if let How::Leased(_, generation) | How::Ahead { generation, .. } = planned.how {
                let key = (planned.lease_key, planned.key.clone());
                self.local.give_back(&key, planned.cost, generation, now);
            }
        }
    }

    /// Nothing of this check happened (or it is not known whether it did): leased units go
    /// back and refills end.
    pub(super) fn undo(&self) {
        self.undo_leased();
        self.end_refills();
    }

    /// Ends this check's refills: a plain refill's units taken here go back to their lease,
    /// while it lives.
    pub(super) fn end_refills(&self) {
        let now = self.local.now();
        for planned in &self.charges {
            let (held, generation) = match planned.how {
                How::Refill {
                    held, generation, ..
                } => (held, generation),
                How::Ahead { generation, .. } => (0, generation),
                _ => continue,
            };
            let key = (planned.lease_key, planned.key.clone());
            if let Some(lease) = self.local.leases.shard(&key).get_mut(&key) {
                lease.refilling = false;
                if lease.generation == generation && now < lease.until {
                    lease.take_back(held);
                }
            }
        }
    }

    /// The answer of a check whose call failed: a request paid here stands (its refills ahead
    /// of need end without units); any other gives back what it took here, and fails.
    pub(super) fn failed(&mut self, error: StoreError) -> Result<Decision, StoreError> {
        self.settled = true;
        if !self.paid_here() {
            self.undo();
            return Err(error);
        }
        self.end_refills();
        Ok(self.paid_decision())
    }
}

impl Drop for Plan {
    /// A check dropped before its reply (its client went away, it timed out): what it took here
    /// goes back, and its refill ends (the units Redis may have leased for it are lost).
    fn drop(&mut self) {
        if !self.settled {
            self.undo();
        }
    }
}

impl Replica {
    /// What a check sends and spends: charges of leased rules are paid from this replica's
    /// lease when it holds enough, and otherwise refill it (one refill per key at a time).
    pub(crate) fn plan(self: &Arc<Self>, charges: &[Charge<'_>]) -> Plan {
        let at = self.now();
        // Built in place: a plan is a few hundred bytes, and each move copies it.
        let mut plan = Plan {
            local: self.clone(),
            at,
            charges: SmallVec::new(),
            settled: false,
            detached: false,
        };
        if charges.len() > 1 {
            // All of them in one block, not one grown as they come.
            plan.charges.reserve_exact(charges.len());
        }
        // Pushed one by one: `extend` costs more than the loop for the one or two of a check.
        for charge in charges {
            let rule = charge.rule;
            let part = (rule.parts() > 1).then(|| (self.next_part(charge), rule.parts()));
            plan.charges.push(Planned {
                fingerprint: match part {
                    Some((part, _)) => mix(rule.fingerprint(), part),
                    None => rule.fingerprint(),
                },
                lease_key: lease_key(rule),
                key: charge.key.clone(),
                cost: charge.cost,
                algorithm: rule.algorithm(),
                period: rule.limits().period,
                part,
                capacity: rule.algorithm().capacity(rule.limits()),
                exact: exact_limits(rule),
                how: How::Sent,
                give_back: None,
            });
        }
        let planned = &mut plan.charges;
        // Denied moments ago (with a split key's sub-keys now chosen): answered here.
        if !self.denials.is_empty() {
            let standing: Option<SmallVec<[(Outcome, bool); 2]>> = planned
                .iter()
                .zip(charges)
                .map(|(p, charge)| {
                    self.standing(
                        &(p.fingerprint, p.key.clone()),
                        charge,
                        p.exact.as_ref(),
                        at,
                    )
                })
                .collect();
            if let Some(standing) = standing
                && standing.iter().any(|(_, denies)| *denies)
                && !self.leases_pay(charges, at)
            {
                for (p, (outcome, _)) in planned.iter_mut().zip(standing) {
                    p.how = How::Cached(outcome);
                }
                return plan;
            }
        }
        for (p, charge) in planned.iter_mut().zip(charges) {
            if let Some(lease) = charge.rule.lease()
                && charge.cost > 0
            {
                (p.how, p.give_back) = self.lease_for(charge, lease, at);
            }
        }
        plan
    }
}
