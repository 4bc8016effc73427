//! What a replica decides without asking Redis: denials Redis made moments ago (the deny cache),
//! and units it leased (token leasing).
//!
//! **The deny cache.** When Redis denies a request, each of its charges is kept with the outcome
//! Redis computed and the local time the check was sent. Until the sooner of the denying rule's
//! retry-after and its window (the time until one more unit is there), the same request (same
//! rules, keys and costs) is denied here, with Redis's outcome aged by the time since: within
//! that time no unit comes back to the denying rule, so Redis would deny it too, with those
//! numbers (other requests only spend; a cluster's cross-slot refund is the exception). The time is counted from when the check was *sent*, before
//! Redis read its clock, so a cached denial never outlives the one Redis computed. A rule whose
//! numbers change is a new rule here (its fingerprint changes), and an admitted request clears
//! the entries of its charges.
//!
//! **Leases.** A rule with a lease of `n` takes up to `n` units from Redis in the call that
//! checks one of its requests (every unit there is, at most `n`, at least the request's cost:
//! [`Algorithm::lease_take`](crate::Algorithm::lease_take)) and spends the rest here, for at
//! most the lease's time to live, and never past the end of a fixed or sliding-counter window.
//! While a refill is out, other requests of the key are charged to Redis one by one. Units
//! left when the lease expires are dropped, not given back.
//!
//! The bound: every unit spent here was charged to Redis first and is spent once, so the fleet
//! never admits more than the shared budget as counted when the units were charged; a unit is
//! spent up to a lease's time to live after its charge, so over a period the fleet may spend,
//! on top of that period's budget, the units replicas held at its start. Units given back (a
//! request denied by another rule) return only to the lease they came from, while it lives.
//! A replica holds at most `n − cost ≤ n − 1` units of a key after a refill (it asks for
//! `n − held` at most, and spends `cost − held` at once), and only spends from there, so while R replicas hold units the fleet may refuse a request that the budget
//! would admit by at most `(n − 1) × R` units (plus, for each refill whose reply was lost to a
//! time-out or a client that went away, the units it took).

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use smallvec::SmallVec;

use super::script::{Prepared, Reply};
use crate::algorithm::Outcome;
use crate::clock::Clock;
use crate::key::Key;
use crate::store::{Charge, StoreError};
use crate::{Algorithm, Decision, DecisionSource};

/// Shards of each table.
const SHARDS: usize = 16;

/// The local decisions of one store.
pub(crate) struct Local {
    clock: Arc<dyn Clock>,
    denials: Table<Denial>,
    leases: Table<Held>,
    /// The next sub-key of each split key.
    parts: Table<u16>,
}

/// Entries by rule fingerprint and key.
type Shard<V> = HashMap<(u64, Key), V, foldhash::fast::RandomState>;

/// A sharded map, bounded, that tells at once when it is empty.
struct Table<V> {
    shards: Box<[Mutex<Shard<V>>]>,
    /// When each shard, full, may be swept for expired entries again (local microseconds): at
    /// most once a second, so that a full shard of live entries is not scanned per insert.
    next_sweep: Box<[AtomicU64]>,
    hasher: foldhash::fast::RandomState,
    len: AtomicUsize,
    max_per_shard: usize,
}

/// One charge of a request Redis denied.
#[derive(Clone, Copy, Debug)]
struct Denial {
    outcome: Outcome,
    cost: u64,
    /// When the check was sent (local microseconds).
    at: u64,
    /// Until when the same request is denied here.
    until: u64,
    /// Whether this charge denied (the others are kept for their numbers).
    denies: bool,
}

/// Units leased to this replica for one key.
#[derive(Clone, Copy, Debug, Default)]
struct Held {
    units: u64,
    algorithm: Algorithm,
    /// The outcome Redis reported when they were taken, and when (local microseconds).
    outcome: Outcome,
    at: u64,
    until: u64,
    /// A refill is out: other requests are charged to Redis one by one meanwhile.
    refilling: bool,
    /// Counts the leases of this key: units taken from one go back only to it, while it lives.
    generation: u64,
}

impl<V> Table<V> {
    fn new(max_entries: usize) -> Self {
        Table {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            next_sweep: (0..SHARDS).map(|_| AtomicU64::new(0)).collect(),
            hasher: foldhash::fast::RandomState::default(),
            len: AtomicUsize::new(0),
            max_per_shard: max_entries.div_ceil(SHARDS),
        }
    }

    fn is_empty(&self) -> bool {
        self.len.load(Ordering::Relaxed) == 0
    }

    fn index(&self, key: &(u64, Key)) -> usize {
        self.hasher.hash_one(key) as usize % SHARDS
    }

    fn shard(&self, key: &(u64, Key)) -> MutexGuard<'_, Shard<V>> {
        self.shards[self.index(key)]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `shard` (of `key`) has room for `key`: when it is full, it drops the entries
    /// `gone` says may go, at most once a second.
    fn room(
        &self,
        shard: &mut Shard<V>,
        key: &(u64, Key),
        now: u64,
        gone: impl Fn(&V) -> bool,
    ) -> bool {
        if shard.len() < self.max_per_shard || shard.contains_key(key) {
            return true;
        }
        let next = &self.next_sweep[self.index(key)];
        if now < next.load(Ordering::Relaxed) {
            return false;
        }
        next.store(now.saturating_add(1_000_000), Ordering::Relaxed);
        let before = shard.len();
        shard.retain(|_, v| !gone(v));
        self.len.fetch_sub(before - shard.len(), Ordering::Relaxed);
        shard.len() < self.max_per_shard
    }

    /// Inserts or replaces, when there is room (see [`room`](Table::room)).
    fn put(&self, key: (u64, Key), value: V, now: u64, gone: impl Fn(&V) -> bool) {
        let mut shard = self.shard(&key);
        if self.room(&mut shard, &key, now, gone) && shard.insert(key, value).is_none() {
            self.len.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn remove(&self, key: &(u64, Key)) {
        if self.shard(key).remove(key).is_some() {
            self.len.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// What one check of a remote store does with each charge.
pub(crate) struct Plan {
    local: Arc<Local>,
    /// When the check was sent (local microseconds).
    at: u64,
    charges: SmallVec<[Planned; 2]>,
    settled: bool,
}

/// One charge of a [`Plan`].
struct Planned {
    /// The rule's fingerprint, mixed with the sub-key of a split rule.
    fingerprint: u64,
    /// The key of its leases, for a leased rule.
    lease_key: u64,
    key: Key,
    cost: u64,
    algorithm: Algorithm,
    period: u64,
    /// The sub-key of a split rule, and how many there are.
    part: Option<(u16, u16)>,
    /// The rule's capacity (a split rule's sub-keys hold less).
    capacity: u64,
    how: How,
}

#[derive(Clone, Copy, Debug)]
enum How {
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
    },
}

impl Local {
    /// The local decisions of a store, on `clock`, with at most `denials` cached denials (0:
    /// none) and `leases` leased keys.
    pub(crate) fn new(clock: Arc<dyn Clock>, denials: usize, leases: usize) -> Self {
        Local {
            clock,
            denials: Table::new(denials),
            parts: Table::new(leases),
            leases: Table::new(leases),
        }
    }

    fn now(&self) -> u64 {
        self.clock.now_micros()
    }

    /// Forgets what is known here of one rule's key after its budget changed in the store: its
    /// cached denial, and after a reset (`leases`) the units it leased, which were taken from
    /// the budget a reset forgets. A refund or a forced charge keeps them: they were charged.
    pub(crate) fn forget(&self, rule: &crate::store::RuleSpec, key: &Key, leases: bool) {
        if !self.denials.is_empty() {
            self.denials.remove(&(rule.fingerprint(), key.clone()));
        }
        if leases && !self.leases.is_empty() && rule.lease().is_some() {
            let key = (lease_key(rule), key.clone());
            if let Some(held) = self.leases.shard(&key).get_mut(&key) {
                held.units = 0;
                held.generation += 1;
            }
        }
    }

    /// The decision of a request that needs no call to Redis: a denial Redis made moments ago,
    /// or every charge paid from this replica's leases.
    pub(crate) fn answer(&self, charges: &[Charge<'_>]) -> Option<Decision> {
        // A split key's sub-key is chosen when the check is planned.
        if charges.is_empty() || charges.iter().any(|c| c.rule.parts() > 1) {
            return None;
        }
        if !self.denials.is_empty()
            && let Some(decision) = self.cached_denial(charges)
        {
            return Some(decision);
        }
        if !self.leases.is_empty() && charges.iter().all(|c| c.rule.lease().is_some()) {
            return self.paid_by_leases(charges);
        }
        None
    }

    fn cached_denial(&self, charges: &[Charge<'_>]) -> Option<Decision> {
        let now = self.now();
        let mut outcomes = SmallVec::<[Outcome; 2]>::new();
        let mut denied = false;
        for charge in charges {
            let key = (charge.rule.fingerprint(), charge.key.clone());
            let entry = *self.denials.shard(&key).get(&key)?;
            if entry.cost != charge.cost || now >= entry.until {
                return None;
            }
            denied |= entry.denies;
            outcomes.push(aged(
                entry.outcome,
                now.saturating_sub(entry.at),
                charge.rule.algorithm(),
            ));
        }
        denied.then(|| Decision::from_outcomes(outcomes).made_by(DecisionSource::DenyCache))
    }

    fn paid_by_leases(&self, charges: &[Charge<'_>]) -> Option<Decision> {
        let now = self.now();
        let mut outcomes = SmallVec::<[Outcome; 2]>::new();
        let mut taken = SmallVec::<[u64; 2]>::new();
        for charge in charges {
            let key = (lease_key(charge.rule), charge.key.clone());
            let paid = {
                let mut shard = self.leases.shard(&key);
                match shard.get_mut(&key) {
                    Some(held) if held.units >= charge.cost && now < held.until => {
                        held.units -= charge.cost;
                        Some((held.spent(now), held.generation))
                    }
                    _ => None,
                }
            };
            match paid {
                Some((outcome, generation)) => {
                    outcomes.push(outcome);
                    taken.push(generation);
                }
                None => {
                    // All or nothing: what the earlier charges took goes back.
                    for (earlier, generation) in charges.iter().zip(taken) {
                        let key = (lease_key(earlier.rule), earlier.key.clone());
                        self.give_back(&key, earlier.cost, generation, now);
                    }
                    return None;
                }
            }
        }
        Some(Decision::from_outcomes(outcomes).made_by(DecisionSource::Lease))
    }

    /// Gives back units taken from a lease of generation `generation`, if it still lives: units
    /// of an expired or refilled lease are dropped, never spent past their time.
    fn give_back(&self, key: &(u64, Key), units: u64, generation: u64, now: u64) {
        if let Some(held) = self.leases.shard(key).get_mut(key)
            && held.generation == generation
            && now < held.until
        {
            held.units += units;
        }
    }

    /// What a check sends and spends: charges of leased rules are paid from this replica's
    /// lease when it holds enough, and otherwise refill it (one refill per key at a time).
    pub(crate) fn plan(self: &Arc<Self>, charges: &[Charge<'_>]) -> Plan {
        let at = self.now();
        let mut planned: SmallVec<[Planned; 2]> = charges
            .iter()
            .map(|charge| {
                let rule = charge.rule;
                let part = (rule.parts() > 1).then(|| (self.next_part(charge), rule.parts()));
                Planned {
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
                    how: How::Sent,
                }
            })
            .collect();
        // Denied moments ago (with a split key's sub-keys now chosen): answered here.
        if !self.denials.is_empty() {
            let entries: Option<SmallVec<[Denial; 2]>> = planned
                .iter()
                .map(|p| {
                    let key = (p.fingerprint, p.key.clone());
                    self.denials
                        .shard(&key)
                        .get(&key)
                        .copied()
                        .filter(|d| d.cost == p.cost && at < d.until)
                })
                .collect();
            if let Some(entries) = entries
                && entries.iter().any(|d| d.denies)
            {
                for (p, d) in planned.iter_mut().zip(entries) {
                    p.how = How::Cached(aged(d.outcome, at.saturating_sub(d.at), p.algorithm));
                }
                return Plan {
                    local: self.clone(),
                    at,
                    charges: planned,
                    settled: false,
                };
            }
        }
        for (p, charge) in planned.iter_mut().zip(charges) {
            if let Some(lease) = charge.rule.lease()
                && charge.cost > 0
            {
                p.how = self.lease_for(charge, lease, at);
            }
        }
        Plan {
            local: self.clone(),
            at,
            charges: planned,
            settled: false,
        }
    }

    /// The sub-key of a split key's next request: each key takes its sub-keys in turn.
    fn next_part(&self, charge: &Charge<'_>) -> u16 {
        let parts = charge.rule.parts();
        let key = (charge.rule.fingerprint(), charge.key.clone());
        let mut shard = self.parts.shard(&key);
        if let Some(next) = shard.get_mut(&key) {
            let part = *next;
            *next = (part + 1) % parts;
            return part;
        }
        if shard.len() >= self.parts.max_per_shard {
            // Full: one key forgets its turn (it starts again at its own first sub-key).
            if let Some(evicted) = shard.keys().next().cloned() {
                shard.remove(&evicted);
                self.parts.len.fetch_sub(1, Ordering::Relaxed);
            }
        }
        // A key starts at a sub-key of its own, so that many keys spread from the start.
        let first = (self.parts.hasher.hash_one(&key) % u64::from(parts)) as u16;
        shard.insert(key, (first + 1) % parts);
        self.parts.len.fetch_add(1, Ordering::Relaxed);
        first
    }

    fn lease_for(&self, charge: &Charge<'_>, lease: crate::store::Lease, now: u64) -> How {
        let ttl = u64::try_from(lease.ttl.as_micros()).unwrap_or(u64::MAX);
        let key = (lease_key(charge.rule), charge.key.clone());
        let mut shard = self.leases.shard(&key);
        // Full: leases that expired, with no refill out, make room; still full, this request is
        // charged to Redis alone.
        if !self.leases.room(&mut shard, &key, now, |held| {
            !held.refilling && now >= held.until
        }) {
            return How::Sent;
        }
        let held = shard.entry(key).or_insert_with(|| {
            self.leases.len.fetch_add(1, Ordering::Relaxed);
            Held {
                algorithm: charge.rule.algorithm(),
                ..Held::default()
            }
        });
        if now >= held.until && held.units > 0 {
            // Expired: what is left is dropped, and what was taken from it cannot come back.
            held.units = 0;
            held.generation += 1;
        }
        if held.units >= charge.cost {
            held.units -= charge.cost;
            return How::Leased(held.spent(now), held.generation);
        }
        if held.refilling {
            return How::Sent;
        }
        held.refilling = true;
        let taken = std::mem::take(&mut held.units);
        How::Refill {
            held: taken,
            lease: lease.units,
            ttl,
            generation: held.generation,
        }
    }
}

impl Held {
    /// The outcome of a request paid from this lease: what Redis reported, aged, with the units
    /// still held here counted as remaining.
    fn spent(&self, now: u64) -> Outcome {
        let mut outcome = aged(self.outcome, now.saturating_sub(self.at), self.algorithm);
        outcome.allowed = true;
        outcome.retry_after = 0;
        outcome.remaining = (outcome.remaining + self.units).min(outcome.limit);
        outcome
    }
}

/// The key of a rule's leases: its fingerprint and its lease's size (a new size is a new lease).
fn lease_key(rule: &crate::store::RuleSpec) -> u64 {
    let units = rule.lease().map_or(0, |lease| lease.units);
    (rule.fingerprint() ^ units.rotate_left(32)).wrapping_mul(0xff51_afd7_ed55_8ccd)
}

/// The fingerprint of one sub-key of a split rule.
fn mix(fingerprint: u64, part: u16) -> u64 {
    (fingerprint ^ u64::from(part).wrapping_add(1)).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// A sub-key's outcome told for the whole key of a rule split in `parts`: the rule's capacity,
/// and the sub-key's remaining times `parts` (the budget left if every sub-key has as much).
fn whole(outcome: Outcome, parts: u16, capacity: u64) -> Outcome {
    Outcome {
        limit: capacity,
        remaining: outcome
            .remaining
            .saturating_mul(u64::from(parts))
            .min(capacity),
        ..outcome
    }
}

/// An outcome `elapsed` microseconds later, nothing else having changed (and no unit come back:
/// callers age an outcome at most until its window). A full budget's window is a constant of
/// the token bucket, GCRA and sliding log (an interval, a period), not a time that runs out.
fn aged(outcome: Outcome, elapsed: u64, algorithm: Algorithm) -> Outcome {
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

impl Plan {
    /// Whether the check needs Redis at all.
    pub(crate) fn sends(&self) -> bool {
        self.charges
            .iter()
            .any(|c| matches!(c.how, How::Sent | How::Refill { .. }))
    }

    /// The charges to send, in order, with the lease of each refill.
    pub(crate) fn prepared(&self, prefix: &str, charges: &[Charge<'_>]) -> Vec<Prepared> {
        let mut all = Vec::with_capacity(charges.len());
        all.extend(
            self.charges
                .iter()
                .zip(charges)
                .filter_map(|(planned, charge)| {
                    let mut one = Prepared::new(prefix, charge);
                    if let Some((part, _)) = planned.part {
                        one = one.of_part(prefix, charge, part);
                    }
                    match planned.how {
                        How::Sent => {}
                        How::Leased(..) | How::Cached(_) => return None,
                        How::Refill { held, lease, .. } => {
                            // A refill starts below the cost, and what is held never reaches the
                            // lease (it holds at most `lease - cost` after a refill).
                            one.cost = charge.cost.saturating_sub(held);
                            one.lease = lease.saturating_sub(held).max(one.cost);
                        }
                    }
                    Some(one)
                }),
        );
        all
    }

    /// The decision of the request from Redis's reply to [`prepared`](Plan::prepared) (none
    /// when nothing was sent): refills become leases, denials are cached, and units taken here
    /// go back when the request is not admitted.
    pub(crate) fn settle(
        mut self,
        reply: Option<Result<Reply, StoreError>>,
    ) -> Result<Decision, StoreError> {
        self.settled = true;
        let local = self.local.clone();
        let reply = match reply {
            None => Reply {
                now: 0,
                outcomes: SmallVec::new(),
                taken: SmallVec::new(),
                times: None,
            },
            Some(Ok(reply)) => reply,
            Some(Err(error)) => {
                self.undo();
                return Err(error);
            }
        };
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
                How::Sent | How::Refill { .. } => match sent.next() {
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
                        self.undo();
                        return Err(StoreError::Protocol(
                            "the rate-limit code answered fewer charges than it was sent".into(),
                        ));
                    }
                },
            };
            outcomes.push(outcome);
            taken.push(units);
        }
        let admitted = outcomes.iter().all(|o| o.allowed);
        for ((planned, outcome), units) in self.charges.iter().zip(outcomes.iter_mut()).zip(taken) {
            let How::Refill {
                held,
                ttl,
                generation,
                ..
            } = planned.how
            else {
                continue;
            };
            let key = (planned.lease_key, planned.key.clone());
            let mut shard = local.leases.shard(&key);
            let Some(lease) = shard.get_mut(&key) else {
                continue;
            };
            lease.refilling = false;
            if !admitted {
                if lease.generation == generation && local.now() < lease.until {
                    lease.units += held;
                }
                continue;
            }
            // What this request did not spend of what it took stays here until it expires,
            // never past the end of a counted window.
            let horizon = match planned.algorithm {
                Algorithm::FixedWindow | Algorithm::SlidingWindowCounter => {
                    planned.period - reply.now % planned.period
                }
                _ => u64::MAX,
            };
            // A new lease: units given back meanwhile to the old one are dropped with it.
            lease.generation += 1;
            lease.units = units.saturating_sub(planned.cost.saturating_sub(held));
            lease.outcome = *outcome;
            lease.at = self.at;
            lease.until = self.at.saturating_add(ttl.min(horizon));
            *outcome = lease.spent(self.at);
        }
        if admitted {
            if !local.denials.is_empty() {
                for planned in &self.charges {
                    local
                        .denials
                        .remove(&(planned.fingerprint, planned.key.clone()));
                }
            }
        } else {
            self.undo_leased();
            if self.sends() {
                self.cache_denial(&outcomes);
            }
        }
        let source = if self.sends() {
            DecisionSource::Store
        } else if self.charges.iter().any(|c| matches!(c.how, How::Cached(_))) {
            DecisionSource::DenyCache
        } else {
            DecisionSource::Lease
        };
        let decision = Decision::from_outcomes(outcomes)
            .made_by(source)
            .made_at_time(reply.now);
        Ok(match times {
            Some(times) => decision.charged_at_times(times),
            None => decision,
        })
    }

    /// Keeps a denial: until the sooner of the denying rules' retry-after and window. Never
    /// one of a request with a concurrency rule: its slots come back when responses end, which
    /// no time here can tell.
    fn cache_denial(&self, outcomes: &[Outcome]) {
        let local = &self.local;
        if local.denials.max_per_shard == 0
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
        let until = self.at.saturating_add(wait);
        for (planned, outcome) in self.charges.iter().zip(outcomes) {
            let denial = Denial {
                outcome: *outcome,
                cost: planned.cost,
                at: self.at,
                // A rule that admits keeps its numbers until its own next unit at most; so does
                // one whose cost never fits (its retry-after is no bound).
                until: if outcome.allowed || outcome.retry_after == u64::MAX {
                    until.min(self.at.saturating_add(outcome.window))
                } else {
                    until
                },
                denies: !outcome.allowed,
            };
            let now = self.at;
            local.denials.put(
                (planned.fingerprint, planned.key.clone()),
                denial,
                now,
                |d| d.until <= now,
            );
        }
    }

    /// Units taken from leases here go back (the request was not admitted), to the leases they
    /// came from while those live.
    fn undo_leased(&self) {
        let now = self.local.now();
        for planned in &self.charges {
            if let How::Leased(_, generation) = planned.how {
                let key = (planned.lease_key, planned.key.clone());
                self.local.give_back(&key, planned.cost, generation, now);
            }
        }
    }

    /// Nothing of this check happened (or it is not known whether it did): leased units go
    /// back and refills end.
    fn undo(&self) {
        self.undo_leased();
        let now = self.local.now();
        for planned in &self.charges {
            if let How::Refill {
                held, generation, ..
            } = planned.how
            {
                let key = (planned.lease_key, planned.key.clone());
                if let Some(lease) = self.local.leases.shard(&key).get_mut(&key) {
                    lease.refilling = false;
                    if lease.generation == generation && now < lease.until {
                        lease.units += held;
                    }
                }
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Limits;
    use crate::clock::ManualClock;
    use crate::store::RuleSpec;

    fn local(clock: &ManualClock) -> Arc<Local> {
        Arc::new(Local::new(Arc::new(clock.clone()), 1000, 1000))
    }

    fn denied(retry: u64, window: u64) -> Outcome {
        Outcome {
            allowed: false,
            limit: 10,
            remaining: 0,
            reset: 50_000_000,
            retry_after: retry,
            window,
        }
    }

    #[test]
    fn a_denial_is_answered_here_until_its_retry_after_aged() {
        let clock = ManualClock::new(1_000_000);
        let local = local(&clock);
        let rule = RuleSpec::new(
            "r",
            Algorithm::TokenBucket,
            Limits::new(10, 60_000_000, 10).unwrap(),
        )
        .unwrap();
        let key = Key::text("k");
        let charges = [Charge {
            rule: &rule,
            key: &key,
            cost: 1,
        }];
        let plan = local.plan(&charges);
        let reply = Reply {
            now: 1_000_000,
            outcomes: smallvec::smallvec![denied(6_000_000, 6_000_000)],
            taken: smallvec::smallvec![0],
            times: None,
        };
        assert!(!plan.settle(Some(Ok(reply))).unwrap().allowed());
        clock.advance(std::time::Duration::from_secs(2));
        let cached = local.answer(&charges).expect("answered here");
        assert_eq!(cached.source(), DecisionSource::DenyCache);
        assert_eq!(cached.outcomes()[0].retry_after, 4_000_000);
        assert_eq!(cached.outcomes()[0].reset, 48_000_000);
        // Another cost is another request.
        let other = [Charge {
            rule: &rule,
            key: &key,
            cost: 2,
        }];
        assert!(local.answer(&other).is_none());
        // At the retry-after, Redis decides again.
        clock.advance(std::time::Duration::from_secs(4));
        assert!(local.answer(&charges).is_none());
    }

    #[test]
    fn a_rule_whose_cost_never_fits_keeps_its_numbers_only_until_its_window() {
        let clock = ManualClock::new(1_000_000);
        let local = local(&clock);
        let log = RuleSpec::new(
            "log",
            Algorithm::SlidingWindowLog,
            Limits::new(7, 1_000_000, 7).unwrap(),
        )
        .unwrap();
        let window = RuleSpec::new(
            "window",
            Algorithm::FixedWindow,
            Limits::new(1, 60_000_000, 1).unwrap(),
        )
        .unwrap();
        let key = Key::text("k");
        let charges = [
            Charge {
                rule: &log,
                key: &key,
                cost: 8,
            },
            Charge {
                rule: &window,
                key: &key,
                cost: 1,
            },
        ];
        let plan = local.plan(&charges);
        // The log's one entry leaves in 1 ms; its cost never fits. The window denies for 30 s.
        let never = Outcome {
            retry_after: u64::MAX,
            window: 1_000,
            remaining: 6,
            limit: 7,
            ..denied(0, 0)
        };
        let reply = Reply {
            now: 1_000_000,
            outcomes: smallvec::smallvec![never, denied(30_000_000, 30_000_000)],
            taken: smallvec::smallvec![0, 0],
            times: None,
        };
        assert!(!plan.settle(Some(Ok(reply))).unwrap().allowed());
        assert!(local.answer(&charges).is_some(), "answered here at once");
        // Once the log's entry has left, its numbers are not known here: Redis answers.
        clock.advance(std::time::Duration::from_millis(2));
        assert!(local.answer(&charges).is_none());
    }
}
