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
//! checks one of its requests (every unit there is, up to the lease's size, at least the
//! request's cost: [`Algorithm::lease_take`](crate::Algorithm::lease_take)) and spends the rest
//! here, for at most the lease's time to live, and never past the end of a fixed or
//! sliding-counter window. While a refill is out, other requests of the key that find no unit
//! here are charged to Redis one by one.
//!
//! **A lease follows its key's demand.** A key whose last request here was a time to live ago
//! or more (or never) pays its cost alone: nothing is held, nothing expires. A key seen again
//! sooner is leased: one unit more than the cost at first; twice as many as the last lease took
//! when that ran out before its time; what the last lease spent when that expired; never more
//! than `n`. So at a steady rate a key's leases settle at what it spends per time to live and
//! expire with nothing left; units are left when its demand falls.
//!
//! **Unspent units go back** where that is exact
//! ([`Algorithm::lease_gives_back`](crate::Algorithm::lease_gives_back): a fixed window, a
//! sliding counter). Units that can no longer be spent here (their lease expired; or a reply or
//! a give-back would hold more than `n − 1`) go back to Redis with the key's next call, refunded
//! at the time they were charged: into the count of that window if it still counts, nothing
//! otherwise. Units of two windows never mix: units that would are not given back. A call that
//! fails may or may not have given them back: they are not sent again (never twice). A reset of
//! the key drops those waiting.
//!
//! **Refills ahead of need.** A refill counts the units the key's requests ask for while it is
//! out (paid here or not), `d`; with half as much again, that is the key's low-water mark. Once
//! fewer units than the mark would be left (those waiting included), the request paid here also
//! sends a refill ahead of need: Redis is asked, at cost 0, for every unit there is up to what
//! the lease lacks (`n − 1 −` those left; possibly none, so it never denies). The request is
//! answered at once (on a Tokio runtime: the call goes on in a task of its own, and what the
//! request spent never goes back), and the units the call brings wait until those left are
//! spent; a batch that joins units already waiting lives no longer than they do. So a key with
//! `n ≥ 2 d + 1` keeps units while its refills are out, with one call per round trip at most,
//! and about one per `n − 1.5 d` requests when that is more. A key spent one request at a time
//! (`d = 0`) has no mark and asks Redis once per lease; so has a key whose lease cannot hold
//! twice what is spent in a round trip (`2 d > n − 1`): refilled when it runs out, a whole lease
//! per call, with the requests that find no unit meanwhile sent to Redis one by one, it makes
//! fewer calls than refills ahead that would each bring less than was spent. When Redis cannot
//! be asked (its breaker open, not connected), units held here are spent all the same. When
//! units are left unspent at a lease's expiry, the key's mark goes back to 0. A request that
//! costs more than the units left takes them with those that wait (until
//! the sooner of both times); one that costs a whole lease or more goes to Redis alone. A reset
//! of the key drops its units, and those of a refill sent before it.
//!
//! The bound: every unit spent here was charged to Redis first and is spent once, so the fleet
//! never admits more than the shared budget as counted when the units were charged; a unit is
//! spent up to a lease's time to live after its charge, so over a period the fleet may spend,
//! on top of that period's budget, the units replicas held at its start. Units given back (a
//! request denied by another rule) return only to the lease they came from, while it lives (a
//! key's entry evicted and made again counts its leases apart from the old one's).
//! A replica holds at most `n − cost ≤ n − 1` units of a key after a refill (it asks for
//! `n − held` at most, and spends `cost − held` at once), and at most `n − 1` after a refill
//! ahead of need (it asks for `n − 1 − left` at most; what a reply or a give-back would bring
//! beyond `n − 1` is dropped), and only spends from there, so
//! while R replicas hold units (or, of a fixed window or sliding counter, units of an expired
//! lease that wait to go back with the key's next call) the fleet may refuse a request that the
//! budget would admit by at most `(n − 1) × R` units; plus, for each refill whose reply was lost
//! to a time-out or a client that went away, the units it took; plus, for the token bucket, GCRA
//! and the sliding log, the units that expired unspent (none for a key seen less than once per
//! time to live on a replica, none at a steady rate once its lease has settled; at most `n − 1`
//! each time a key's demand on a replica falls).

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

/// The most keys heard forgotten (by another replica's reset or refund) that are remembered
/// at once, for the cap of a cached denial's life; past it, every cached denial is dropped.
const MAX_TOMBSTONES: usize = 65_536;

/// The shortest life of a tombstone (local microseconds): a minute.
const TOMBSTONE_LIFE: u64 = 60_000_000;

/// The local decisions of one store.
pub(crate) struct Local {
    clock: Arc<dyn Clock>,
    /// The store's key prefix, to name the keys that other replicas forget.
    prefix: Arc<str>,
    /// The longest a denial is answered here (local microseconds), whatever Redis computed.
    max_age: u64,
    denials: Table<Denial>,
    /// Keys forgotten by a replica (heard over pub/sub), by a hash of their Redis name: when
    /// it was heard (local microseconds). Kept for `max_age`, the life of any denial cached
    /// before.
    tombstones: Mutex<HashMap<u64, u64, foldhash::fast::RandomState>>,
    /// How many tombstones there are: none, the common case, is read without a lock.
    tombstone_count: AtomicUsize,
    /// When the tombstones are next pruned (local microseconds).
    next_prune: AtomicU64,
    /// When every key was last taken as forgotten (local microseconds; 0: never).
    forgot_all_at: AtomicU64,
    leases: Table<Held>,
    /// Numbers the lease entries made: an entry's generations start at its number times
    /// 2³², so that one made again after its key's was evicted never counts a generation of
    /// the old one (whose give-backs may still come).
    entries: AtomicU64,
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
    /// The units being spent, until `until`, of lease `generation`.
    units: u64,
    until: u64,
    /// Units of a refill ahead of need that came while `units` were left: spent once those are
    /// gone, until `next_until`.
    next: u64,
    next_until: u64,
    algorithm: Algorithm,
    /// The outcome Redis reported at the last refill, and when it was sent (local microseconds).
    outcome: Outcome,
    at: u64,
    /// A refill is out: requests that find no unit here are charged to Redis one by one
    /// meanwhile.
    refilling: bool,
    /// Fewer units left than this, the next request paid here sends a refill ahead of need:
    /// half as much again as the units the key's requests asked for while its last refill was
    /// out (paid here or not); 0 (no refill ahead) for a key spent one request at a time, for
    /// one that asked for more than `(n − 1) / 2` meanwhile, and after units expired unspent.
    low_water: u64,
    /// The units asked of this lease since its refill went out.
    demand: u64,
    /// The rule's lease: `n`, the most units taken at once (a replica holds at most `n − 1`).
    size: u64,
    /// Counts the resets of the key: a refill sent before one brings no units after it.
    resets: u64,
    /// Counts the leases of this key: units taken from one go back only to it, while it lives.
    generation: u64,
    /// When (local microseconds) the key's last request was seen here: a key seen again
    /// within a lease's time to live is leased, one seen less often pays its cost alone.
    seen: Option<u64>,
    /// The units of the lease being spent, as it came (the next refill of a lease spent
    /// before its time asks for twice as many), and what the last lease that ended spent (the
    /// size of the next after it).
    taken: u64,
    spent: u64,
    /// The rule's period, and when Redis charged [`units`](Held::units) and
    /// [`next`](Held::next) (on its clock), for a fixed or sliding-counter window whose units
    /// were all charged in one window: those left unspent go back into it. None: they are not
    /// given back.
    period: u64,
    charged: Option<u64>,
    next_charged: Option<u64>,
    /// Units that expired unspent here, and when they were charged: given back to Redis with
    /// the key's next call.
    returning: Option<(u64, u64)>,
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

    fn clear(&self) {
        for shard in &self.shards {
            let mut shard = shard.lock().unwrap_or_else(|p| p.into_inner());
            self.len.fetch_sub(shard.len(), Ordering::Relaxed);
            shard.clear();
        }
    }
}

/// Whether a request is paid from this replica's leases alone.
enum Paid {
    Yes(Decision),
    /// The leases hold enough, and paying would send a refill ahead of need.
    AheadDue,
    /// A lease holds too little (or none is here).
    Short,
}

/// What one check of a remote store does with each charge.
pub(crate) struct Plan {
    local: Arc<Local>,
    /// When the check was sent (local microseconds).
    at: u64,
    charges: SmallVec<[Planned; 2]>,
    settled: bool,
    /// The request was answered before the call (paid here): what it spent never goes back.
    detached: bool,
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
    /// Units of this key's leases that expired unspent, and when Redis charged them: this
    /// call gives them back.
    give_back: Option<(u64, u64)>,
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

impl Local {
    /// The local decisions of a store of keys named with `prefix`, on `clock`, with at most
    /// `denials` cached denials (0: none), each answered for at most `max_age`, and `leases`
    /// leased keys.
    pub(crate) fn new(
        clock: Arc<dyn Clock>,
        prefix: Arc<str>,
        denials: usize,
        max_age: std::time::Duration,
        leases: usize,
    ) -> Self {
        Local {
            clock,
            prefix,
            max_age: u64::try_from(max_age.as_micros()).unwrap_or(u64::MAX),
            denials: Table::new(denials),
            tombstones: Mutex::default(),
            tombstone_count: AtomicUsize::new(0),
            next_prune: AtomicU64::new(0),
            forgot_all_at: AtomicU64::new(0),
            parts: Table::new(leases),
            leases: Table::new(leases),
            entries: AtomicU64::new(0),
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
                held.next = 0;
                held.generation = held.generation.wrapping_add(1);
                held.resets += 1;
                // Units charged before a reset never go back into the budget after it.
                held.returning = None;
                held.taken = 0;
            }
        }
    }

    /// How long a tombstone is kept (local microseconds): the cap of a cached denial, and at
    /// least a minute, for the leased units waiting to go back.
    fn tombstone_life(&self) -> u64 {
        self.max_age.max(TOMBSTONE_LIFE)
    }

    /// A replica forgot the key of Redis name `name` (a reset or an adjustment): a denial
    /// cached here before now is not answered again, and leased units charged before now are
    /// not given back.
    pub(crate) fn forgotten(&self, name: &[u8]) {
        // Kept even while no denial is cached (one may be on its way, from a check sent before),
        // and without a deny cache (leased units waiting to go back read them).
        let now = self.now();
        let life = self.tombstone_life();
        let mut tombstones = self.tombstones.lock().unwrap_or_else(|p| p.into_inner());
        // Those heard before their life are no longer needed (pruned now and then, not on
        // every message).
        if tombstones.len() >= MAX_TOMBSTONES || tombstones.len() % 1024 == 1023 {
            tombstones.retain(|_, heard| now.saturating_sub(*heard) < life);
        }
        if tombstones.len() >= MAX_TOMBSTONES {
            // More keys forgotten at once than can be told apart: every key, from now.
            tombstones.clear();
            self.tombstone_count.store(0, Ordering::Relaxed);
            drop(tombstones);
            self.forget_everything();
            return;
        }
        tombstones.insert(name_hash(name), now);
        self.tombstone_count
            .store(tombstones.len(), Ordering::Relaxed);
    }

    /// Forgets every cached denial, and every leased unit waiting to go back: the replica may
    /// have missed what others forgot (its listening connection was down, or too many keys
    /// were forgotten at once to tell apart).
    pub(crate) fn forget_everything(&self) {
        self.forgot_all_at.store(self.now(), Ordering::Relaxed);
        self.denials.clear();
    }

    /// Whether any key may have been forgotten by another replica (cheap: no lock).
    fn may_be_forgotten(&self) -> bool {
        self.tombstone_count.load(Ordering::Relaxed) > 0
            || self.forgot_all_at.load(Ordering::Relaxed) != 0
    }

    /// Whether another replica forgot `charge`'s key after `at` (local microseconds).
    fn forgotten_since(&self, charge: &Charge<'_>, at: u64) -> bool {
        let forgot_all_at = self.forgot_all_at.load(Ordering::Relaxed);
        if forgot_all_at != 0 && forgot_all_at >= at {
            return true;
        }
        if self.tombstone_count.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let name = super::keys::key_name(&self.prefix, charge.key, charge.rule.name());
        let hash = name_hash(name.as_bytes());
        let mut tombstones = self.tombstones.lock().unwrap_or_else(|p| p.into_inner());
        let now = self.now();
        let life = self.tombstone_life();
        if now >= self.next_prune.load(Ordering::Relaxed) {
            // At most once per cap: those heard before their life are no longer needed.
            self.next_prune
                .store(now.saturating_add(self.max_age), Ordering::Relaxed);
            tombstones.retain(|_, heard| now.saturating_sub(*heard) < life);
            self.tombstone_count
                .store(tombstones.len(), Ordering::Relaxed);
        }
        tombstones.get(&hash).is_some_and(|heard| *heard >= at)
    }

    /// The decision of a request that needs no call to Redis: a denial Redis made moments ago,
    /// or every charge paid from this replica's leases. With `ahead`, a request whose payment
    /// would send a refill ahead of need is left to [`plan`](Local::plan); without (Redis
    /// cannot be asked now), it is paid here all the same.
    pub(crate) fn answer(&self, charges: &[Charge<'_>], ahead: bool) -> Option<Decision> {
        // A split key's sub-key is chosen when the check is planned.
        if charges.is_empty() || charges.iter().any(|c| c.rule.parts() > 1) {
            return None;
        }
        // Units held here were charged before Redis denied anything since: spent first.
        if !self.leases.is_empty() && charges.iter().all(|c| c.rule.lease().is_some()) {
            match self.paid_by_leases(charges, ahead) {
                Paid::Yes(decision) => return Some(decision),
                // Paid with a refill ahead of need: planned.
                Paid::AheadDue => return None,
                Paid::Short => {}
            }
        }
        if !self.denials.is_empty() {
            return self.cached_denial(charges);
        }
        None
    }

    /// Whether this replica's leases hold enough for every charge now (all leased).
    fn leases_pay(&self, charges: &[Charge<'_>], now: u64) -> bool {
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

    fn cached_denial(&self, charges: &[Charge<'_>]) -> Option<Decision> {
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
    fn live_denial(&self, key: &(u64, Key), charge: &Charge<'_>, now: u64) -> Option<Denial> {
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

    /// Pays every charge from this replica's leases, all or nothing, in one pass; with `ahead`,
    /// a request whose payment would send a refill ahead of need is left to be planned.
    fn paid_by_leases(&self, charges: &[Charge<'_>], ahead: bool) -> Paid {
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
    fn give_back(&self, key: &(u64, Key), units: u64, generation: u64, now: u64) {
        if let Some(held) = self.leases.shard(key).get_mut(key)
            && held.generation == generation
            && now < held.until
        {
            held.take_back(units);
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
                    give_back: None,
                }
            })
            .collect();
        // Denied moments ago (with a split key's sub-keys now chosen): answered here.
        if !self.denials.is_empty() {
            let entries: Option<SmallVec<[Denial; 2]>> = planned
                .iter()
                .zip(charges)
                .map(|(p, charge)| self.live_denial(&(p.fingerprint, p.key.clone()), charge, at))
                .collect();
            if let Some(entries) = entries
                && entries.iter().any(|d| d.denies)
                && !self.leases_pay(charges, at)
            {
                for (p, d) in planned.iter_mut().zip(entries) {
                    p.how = How::Cached(aged(d.outcome, at.saturating_sub(d.at), p.algorithm));
                }
                return Plan {
                    local: self.clone(),
                    at,
                    charges: planned,
                    settled: false,
                    detached: false,
                };
            }
        }
        for (p, charge) in planned.iter_mut().zip(charges) {
            if let Some(lease) = charge.rule.lease()
                && charge.cost > 0
            {
                (p.how, p.give_back) = self.lease_for(charge, lease, at);
            }
        }
        Plan {
            local: self.clone(),
            at,
            charges: planned,
            settled: false,
            detached: false,
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

    /// The entry of a key of `rule`'s leases of `units`, new.
    fn new_lease(&self, rule: &crate::store::RuleSpec, units: u64) -> Held {
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
    fn expired_give_back(
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
    fn lease_for(
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

impl Held {
    /// Makes current the units that may pay `cost` at `now`: those of an expired lease are
    /// dropped, and a refill's units that wait take over, or join the units left when those
    /// are fewer than `cost` (until the sooner of both times).
    fn roll(&mut self, now: u64, cost: u64) {
        if now < self.until && (self.units >= cost || self.next == 0) {
            return;
        }
        if now >= self.until {
            if self.taken > 0 {
                // What the lease spent: the size of the key's next.
                self.spent = self.taken.saturating_sub(self.units);
                self.taken = 0;
            }
            if self.units > 0 {
                // Units left unspent for a whole time to live: the key is no longer hot.
                self.low_water = 0;
                self.expire(self.units, self.charged);
            }
            self.units = 0;
            self.charged = None;
        }
        if self.next > 0 && now >= self.next_until {
            self.low_water = 0;
            self.expire(self.next, self.next_charged);
            self.next = 0;
        }
        if self.next == 0 {
            if self.units == 0 {
                // What was taken from the lease that ended never comes back.
                self.generation = self.generation.wrapping_add(1);
            }
            return;
        }
        if self.units > 0 {
            self.until = self.until.min(self.next_until);
            self.charged = self.one_window(self.charged, self.next_charged);
        } else {
            // Units taken from the lease that ended never come back to these.
            self.generation = self.generation.wrapping_add(1);
            self.until = self.next_until;
            self.charged = self.next_charged;
        }
        self.units += self.next;
        self.taken += self.next;
        self.next = 0;
    }

    /// Units that can no longer be spent here: given back to Redis with the key's next call,
    /// when they were all charged in one window of a fixed window or sliding counter (then
    /// exact: they go back into the window they were taken from, never spent); dropped
    /// otherwise. Units waiting to go back from another window are dropped.
    fn expire(&mut self, units: u64, charged: Option<u64>) {
        let Some(at) = charged.filter(|_| units > 0) else {
            return;
        };
        self.returning = match self.returning {
            Some((waiting, when)) if self.one_window(Some(when), Some(at)).is_some() => {
                Some((waiting.saturating_add(units), when))
            }
            _ => Some((units, at)),
        };
    }

    /// The time of a charge that stands for both `a` and `b`: one of them, when both were in
    /// one window of the rule.
    fn one_window(&self, a: Option<u64>, b: Option<u64>) -> Option<u64> {
        match (a, b) {
            (Some(a), Some(b)) if a / self.period == b / self.period => Some(a),
            _ => None,
        }
    }

    /// Whether a charge of `cost` is paid from these units at `now` (made current): a lease
    /// pays costs below its size, and a charge of 0 only while it lives.
    fn pays(&mut self, now: u64, cost: u64) -> bool {
        self.roll(now, cost);
        cost < self.size && self.units >= cost && now < self.until
    }

    /// The low-water mark after a refill: what the key's requests asked for while it was out,
    /// and a half more. A lease that cannot hold twice that (more than half of it spent in a
    /// round trip) gets none: refilled when it runs out, a whole lease at a time, it makes
    /// fewer calls than refills ahead that would each bring less than was spent meanwhile.
    fn settle_demand(&mut self) {
        self.low_water = if self.demand.saturating_mul(2) > self.size.saturating_sub(1) {
            0
        } else {
            self.demand + self.demand / 2
        };
    }

    /// Units of a refill ahead of need, spendable until `until`: they wait behind the units
    /// held (joining those already waiting, until the sooner of both times), and take over a
    /// lease that ended; never more than `n − 1` held in all (the rest is dropped).
    fn wait(&mut self, units: u64, until: u64, now: u64, charged: Option<u64>) {
        if now >= self.next_until {
            self.expire(self.next, self.next_charged);
            self.next = 0;
        }
        let live = if now < self.until { self.units } else { 0 };
        let room = self
            .size
            .saturating_sub(1)
            .saturating_sub(live.saturating_add(self.next));
        (self.next_until, self.next_charged) = if self.next > 0 {
            (
                self.next_until.min(until),
                self.one_window(self.next_charged, charged),
            )
        } else {
            (until, charged)
        };
        let kept = units.min(room);
        self.expire(units - kept, charged);
        self.next += kept;
        self.roll(now, 0);
    }

    /// Spends `cost` units of [`units`](Held::units), counted in the demand on a refill out.
    fn pay(&mut self, cost: u64) {
        self.units -= cost;
        if self.refilling {
            self.demand = self.demand.saturating_add(cost);
        }
    }

    /// Units given back to [`units`](Held::units), never past `n − 1` held in all (what would
    /// go beyond is dropped).
    fn take_back(&mut self, units: u64) {
        if self.refilling {
            // Not spent after all: not asked for.
            self.demand = self.demand.saturating_sub(units);
        }
        let room = self
            .size
            .saturating_sub(1)
            .saturating_sub(self.units.saturating_add(self.next));
        let kept = units.min(room);
        self.expire(units - kept, self.charged);
        self.units += kept;
    }

    /// The units a refill ahead of need asks for when a request of `cost` is paid from
    /// [`units`](Held::units) (0: none is due): none is out, and fewer than the low-water mark
    /// would be left (with the units waiting); what the lease then lacks, keeping at most
    /// `n − 1`.
    fn ahead(&self, cost: u64) -> u64 {
        let left = self.units.saturating_sub(cost).saturating_add(self.next);
        if cost == 0 || self.refilling || left >= self.low_water {
            return 0;
        }
        self.size.saturating_sub(1).saturating_sub(left)
    }

    /// The outcome of a request paid from this lease: what Redis reported, aged, with the units
    /// still held here counted as remaining.
    fn spent(&self, now: u64) -> Outcome {
        let mut outcome = aged(self.outcome, now.saturating_sub(self.at), self.algorithm);
        outcome.allowed = true;
        outcome.retry_after = 0;
        outcome.remaining = (outcome.remaining + self.units + self.next).min(outcome.limit);
        outcome
    }
}

/// The key of a rule's leases: its fingerprint and its lease's size (a new size is a new lease).
/// The hash of a Redis key name, the same on every replica.
fn name_hash(name: &[u8]) -> u64 {
    use std::hash::Hasher;
    let mut hasher = foldhash::fast::FixedState::with_seed(0x666f_7267_6f74).build_hasher();
    hasher.write(name);
    hasher.finish()
}

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
            .any(|c| matches!(c.how, How::Sent | How::Refill { .. } | How::Ahead { .. }))
    }

    /// Whether every charge is paid here (from leases), whatever Redis answers: its refills
    /// ahead of need only add units.
    fn paid_here(&self) -> bool {
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
    fn paid_decision(&self) -> Decision {
        let outcomes = self
            .charges
            .iter()
            .filter_map(|planned| match planned.how {
                How::Leased(outcome, _) | How::Ahead { outcome, .. } => Some(outcome),
                _ => None,
            })
            .collect::<SmallVec<[Outcome; 2]>>();
        Decision::from_outcomes(outcomes).made_by(DecisionSource::Lease)
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
                    one.give_back = planned.give_back;
                    match planned.how {
                        How::Sent => {}
                        How::Leased(..) | How::Cached(_) => return None,
                        How::Refill { held, lease, .. } => {
                            // A refill starts below the cost, and what is held never reaches the
                            // lease (it holds at most `lease - cost` after a refill).
                            one.cost = charge.cost.saturating_sub(held);
                            one.lease = lease.saturating_sub(held).max(one.cost);
                        }
                        How::Ahead { ask, .. } => {
                            // Paid here: Redis is asked for units only.
                            one.cost = 0;
                            one.lease = ask;
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
            Some(Err(error)) => return self.failed(error),
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
            // paid here, or a refill ahead of need, says nothing of Redis's budget).
            if !local.denials.is_empty() {
                for planned in &self.charges {
                    if matches!(planned.how, How::Sent | How::Refill { .. }) {
                        local
                            .denials
                            .remove(&(planned.fingerprint, planned.key.clone()));
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
        // Capped: a reset or refund made elsewhere whose message was lost is seen by then.
        let until = self.at.saturating_add(wait.min(local.max_age));
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
    fn undo(&self) {
        self.undo_leased();
        self.end_refills();
    }

    /// Ends this check's refills: a plain refill's units taken here go back to their lease,
    /// while it lives.
    fn end_refills(&self) {
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
    fn failed(mut self, error: StoreError) -> Result<Decision, StoreError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Limits;
    use crate::clock::ManualClock;
    use crate::store::RuleSpec;

    fn local(clock: &ManualClock) -> Arc<Local> {
        Arc::new(Local::new(
            Arc::new(clock.clone()),
            "t".into(),
            1000,
            std::time::Duration::from_secs(3600),
            1000,
        ))
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
        let cached = local.answer(&charges, true).expect("answered here");
        assert_eq!(cached.source(), DecisionSource::DenyCache);
        assert_eq!(cached.outcomes()[0].retry_after, 4_000_000);
        assert_eq!(cached.outcomes()[0].reset, 48_000_000);
        // Another cost is another request.
        let other = [Charge {
            rule: &rule,
            key: &key,
            cost: 2,
        }];
        assert!(local.answer(&other, true).is_none());
        // At the retry-after, Redis decides again.
        clock.advance(std::time::Duration::from_secs(4));
        assert!(local.answer(&charges, true).is_none());
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
        assert!(
            local.answer(&charges, true).is_some(),
            "answered here at once"
        );
        // Once the log's entry has left, its numbers are not known here: Redis answers.
        clock.advance(std::time::Duration::from_millis(2));
        assert!(local.answer(&charges, true).is_none());
    }

    fn admitted(remaining: u64, taken: u64) -> Reply {
        Reply {
            now: 1_000_000,
            outcomes: smallvec::smallvec![Outcome {
                allowed: true,
                limit: 100,
                remaining,
                reset: 1_000_000,
                retry_after: 0,
                window: 36_000_000,
            }],
            taken: smallvec::smallvec![taken],
            times: None,
        }
    }

    /// A rule of 100 leased 10 at a time, on a replica of its own, and its one key.
    struct Hot {
        clock: ManualClock,
        local: Arc<Local>,
        rule: RuleSpec,
        key: Key,
    }

    impl Hot {
        /// The key is seen often: its first refill takes a whole lease.
        fn new() -> Hot {
            let clock = ManualClock::new(1_000_000);
            let hot = Hot {
                local: local(&clock),
                clock,
                rule: RuleSpec::new(
                    "hot",
                    Algorithm::TokenBucket,
                    Limits::new(100, 3_600_000_000, 100).unwrap(),
                )
                .unwrap()
                .with_lease(10, std::time::Duration::from_secs(60))
                .unwrap(),
                key: Key::text("k"),
            };
            warm(&hot.local, &hot.rule, &hot.key);
            hot
        }

        fn charges(&self) -> [Charge<'_>; 1] {
            [Charge {
                rule: &self.rule,
                key: &self.key,
                cost: 1,
            }]
        }

        /// `requests` requests of cost 1, each paid from the lease without a call.
        fn pay(&self, requests: usize) {
            let charges = self.charges();
            for _ in 0..requests {
                assert!(self.local.answer(&charges, true).is_some());
            }
        }

        /// A first refill of 10 (9 held), `dry` requests sent to Redis while it was out: a
        /// mark of `1.5 × dry` (none above 4).
        fn fill(&self, dry: u64) {
            let charges = self.charges();
            let refill = self.local.plan(&charges);
            for i in 0..dry {
                let alone = self.local.plan(&charges);
                assert!(matches!(alone.charges[0].how, How::Sent));
                alone.settle(Some(Ok(admitted(99 - i, 1)))).unwrap();
            }
            let first = refill.settle(Some(Ok(admitted(89 - dry, 10)))).unwrap();
            assert!(first.allowed());
        }
    }

    /// The units asked for while a refill was out set the low-water mark (half as much again);
    /// below it, a request paid here also asks Redis, at cost 0, for what the lease lacks, and
    /// those units wait until the ones left are spent. A replica never holds more than `n - 1`.
    #[test]
    fn a_key_spent_at_once_refills_ahead_of_need() {
        let hot = Hot::new();
        let (local, charges) = (&hot.local, hot.charges());
        // One refill out, three more requests at once: each goes to Redis alone.
        hot.fill(3);
        // 9 held, low water 3 + 1: five requests are paid here without a call.
        for held in (4..9).rev() {
            let decision = local.answer(&charges, true).expect("paid here");
            assert_eq!(decision.outcomes()[0].remaining, 86 + held);
        }
        assert!(
            local.answer(&charges, true).is_none(),
            "a refill ahead is due"
        );
        let ahead = local.plan(&charges);
        let How::Ahead { ask, .. } = ahead.charges[0].how else {
            panic!("{:?}", ahead.charges[0].how);
        };
        assert_eq!(ask, 6, "3 left: the lease lacks 6 of 9");
        let prepared = ahead.prepared("p", &charges);
        assert_eq!((prepared[0].cost, prepared[0].lease), (0, 6));
        // Meanwhile the units left are spent here, and no second refill goes out.
        assert!(local.answer(&charges, true).is_some());
        // Redis had 6: they wait behind the 2 left.
        let decision = ahead.settle(Some(Ok(admitted(80, 6)))).unwrap();
        assert!(decision.allowed());
        assert_eq!(decision.source(), DecisionSource::Lease);
        assert_eq!(decision.outcomes()[0].remaining, 80 + 2 + 6);
        // One unit was asked for while it was out: low water 1. The 2 left, then the refill's
        // units, are spent here until the request that would leave none.
        hot.pay(7);
        assert!(local.answer(&charges, true).is_none());
        assert!(matches!(
            local.plan(&charges).charges[0].how,
            How::Ahead { ask: 9, .. }
        ));
    }

    /// A refill ahead of need whose call fails, or that Redis cannot fill, leaves the request
    /// paid here admitted.
    #[test]
    fn a_request_paid_here_stands_when_its_refill_ahead_fails() {
        let hot = Hot::new();
        let (local, charges) = (&hot.local, hot.charges());
        hot.fill(1);
        // Low water 1: the request that takes the last unit asks for 9.
        hot.pay(8);
        let ahead = local.plan(&charges);
        assert!(matches!(ahead.charges[0].how, How::Ahead { ask: 9, .. }));
        let decision = ahead.settle(Some(Err(StoreError::Timeout))).unwrap();
        assert!(decision.allowed());
        assert_eq!(decision.source(), DecisionSource::Lease);
        // Nothing held, no refill out: the next request refills as usual.
        assert!(local.answer(&charges, true).is_none());
        assert!(matches!(
            local.plan(&charges).charges[0].how,
            How::Refill { held: 0, .. }
        ));
    }

    /// Makes `key` of `rule` a key seen now, whose last lease spent all its units: its next
    /// refill takes a whole lease.
    fn warm(local: &Local, rule: &RuleSpec, key: &Key) {
        let units = rule.lease().unwrap().units;
        let entry = (lease_key(rule), key.clone());
        let mut shard = local.leases.shard(&entry);
        let held = shard
            .entry(entry)
            .or_insert_with(|| local.new_lease(rule, units));
        held.seen = Some(local.now());
        held.spent = units;
    }

    /// Units held and waiting, of the only key of `local`.
    fn held(local: &Local) -> (u64, u64) {
        let shard = local
            .leases
            .shards
            .iter()
            .find(|shard| !shard.lock().unwrap().is_empty())
            .expect("a lease");
        let shard = shard.lock().unwrap();
        let held = shard.values().next().unwrap();
        (held.units, held.next)
    }

    /// A refill ahead of need also goes out while units of the last one still wait, when the
    /// key's requests would leave fewer than the mark in all; a replica then holds `n - 1`.
    #[test]
    fn a_refill_ahead_goes_out_while_units_wait_and_holds_at_most_n_minus_1() {
        let hot = Hot::new();
        let (local, charges) = (&hot.local, hot.charges());
        // Four requests find no unit while the first refill is out: the mark is 6.
        hot.fill(4);
        assert_eq!(held(local), (9, 0));
        hot.pay(3);
        // The next request leaves 5 < 6: it asks for 4, and four more are paid meanwhile.
        let ahead = local.plan(&charges);
        assert!(matches!(ahead.charges[0].how, How::Ahead { ask: 4, .. }));
        hot.pay(4);
        ahead.settle(Some(Ok(admitted(76, 4)))).unwrap();
        assert_eq!(held(local), (1, 4), "the units wait behind the one left");
        // The mark is 6 again: the next request leaves 4 in all, and asks for what the lease
        // lacks while those wait.
        let ahead = local.plan(&charges);
        assert!(matches!(ahead.charges[0].how, How::Ahead { ask: 5, .. }));
        ahead.settle(Some(Ok(admitted(71, 5)))).unwrap();
        assert_eq!(held(local), (0, 9), "9 held in all: n - 1");
    }

    /// A lease that cannot hold twice what its key spends in a round trip gets no mark: it is
    /// refilled when it runs out, a whole lease per call.
    #[test]
    fn a_lease_spent_faster_than_it_can_hold_is_refilled_when_it_runs_out() {
        let hot = Hot::new();
        let (local, charges) = (&hot.local, hot.charges());
        // Five units asked for while the refill was out: more than (10 - 1) / 2.
        hot.fill(5);
        for _ in 0..9 {
            assert!(local.answer(&charges, true).is_some(), "no refill ahead");
        }
        assert!(matches!(
            local.plan(&charges).charges[0].how,
            How::Refill { held: 0, .. }
        ));
    }

    /// A request paid here whose check only refills ahead of need is answered at once; what it
    /// spent never goes back, whatever becomes of the refill's call.
    #[test]
    fn a_detached_request_keeps_what_it_spent() {
        let hot = Hot::new();
        let (local, charges) = (&hot.local, hot.charges());
        hot.fill(1);
        hot.pay(8);
        assert_eq!(held(local), (1, 0));
        let mut ahead = local.plan(&charges);
        let decision = ahead.detach().expect("paid here");
        assert!(decision.allowed());
        assert_eq!(decision.source(), DecisionSource::Lease);
        // The call goes away unanswered: nothing comes back, and refills go out again.
        drop(ahead);
        assert_eq!(held(local), (0, 0));
        assert!(matches!(
            local.plan(&charges).charges[0].how,
            How::Refill { held: 0, .. }
        ));
        // A plan that must hear from Redis is not answered here.
        let other = [Charge {
            rule: &hot.rule,
            key: &Key::text("other"),
            cost: 1,
        }];
        assert!(local.plan(&other).detach().is_none());
    }

    /// A cached denial of a key does not hide the units its lease holds, those that a refill
    /// ahead of need would follow included: they were charged before Redis denied.
    #[test]
    fn units_held_are_spent_before_a_cached_denial() {
        let hot = Hot::new();
        let (local, charges) = (&hot.local, hot.charges());
        let refill = local.plan(&charges);
        let alone = local.plan(&charges);
        refill.settle(Some(Ok(admitted(0, 10)))).unwrap();
        // Redis had nothing left for the request sent meanwhile: a denial, cached.
        let denial = Reply {
            now: 1_000_000,
            outcomes: smallvec::smallvec![denied(36_000_000, 36_000_000)],
            taken: smallvec::smallvec![0],
            times: None,
        };
        assert!(!alone.settle(Some(Ok(denial))).unwrap().allowed());
        for _ in 0..8 {
            let decision = local.answer(&charges, true).expect("paid here");
            assert_eq!(decision.source(), DecisionSource::Lease);
        }
        // The last unit would send a refill ahead of need: planned, not denied here.
        assert!(local.answer(&charges, true).is_none());
        let ahead = local.plan(&charges);
        assert!(matches!(ahead.charges[0].how, How::Ahead { .. }));
        // Redis had nothing for it: the denial stands, and answers the next request.
        assert!(ahead.settle(Some(Ok(admitted(0, 0)))).unwrap().allowed());
        let decision = local.answer(&charges, true).expect("denied here");
        assert!(!decision.allowed());
        assert_eq!(decision.source(), DecisionSource::DenyCache);
    }

    /// A request that costs more than the units left takes the refill's units that wait too
    /// (nothing is dropped); one that costs a whole lease or more goes to Redis alone; one of
    /// cost 0 is answered here only while the lease lives; a reset while a refill is out keeps
    /// none of its units.
    #[test]
    fn costs_a_lease_cannot_pay_and_resets_lose_nothing_and_keep_nothing() {
        let hot = Hot::new();
        let (local, charges) = (&hot.local, hot.charges());
        hot.fill(4);
        hot.pay(3);
        let ahead = local.plan(&charges);
        hot.pay(4);
        ahead.settle(Some(Ok(admitted(76, 4)))).unwrap();
        assert_eq!(held(local), (1, 4));
        let costly = |cost| {
            [Charge {
                rule: &hot.rule,
                key: &hot.key,
                cost,
            }]
        };
        let decision = local
            .answer(&costly(3), false)
            .expect("1 left and 4 waiting");
        assert!(decision.allowed());
        assert_eq!(held(local), (2, 0));
        // A whole lease: Redis decides, and nothing here moves.
        assert!(local.answer(&costly(10), true).is_none());
        assert!(matches!(local.plan(&costly(10)).charges[0].how, How::Sent));
        assert_eq!(held(local), (2, 0));
        // Past the lease's time, a request of cost 0 is not answered from it.
        assert!(local.answer(&costly(0), true).is_some());
        hot.clock.advance(std::time::Duration::from_secs(61));
        assert!(local.answer(&costly(0), true).is_none());
        // A refill out when the key is reset brings no unit.
        warm(local, &hot.rule, &hot.key);
        let refill = local.plan(&charges);
        assert!(matches!(refill.charges[0].how, How::Refill { .. }));
        local.forget(&hot.rule, &hot.key, true);
        assert!(refill.settle(Some(Ok(admitted(90, 10)))).unwrap().allowed());
        assert_eq!(held(local), (0, 0));
    }

    /// A lease of a window's rule lives no longer than the window, on the clock of the node
    /// that charged it: a cluster's charges across slots each have their node's time, and the
    /// first node's time is no one else's.
    #[test]
    fn a_window_lease_ends_with_its_own_nodes_window() {
        let clock = ManualClock::new(1_000_000);
        let local = local(&clock);
        let rule = RuleSpec::new(
            "windowed",
            Algorithm::FixedWindow,
            Limits::new(100, 60_000_000, 100).unwrap(),
        )
        .unwrap()
        .with_lease(10, std::time::Duration::from_secs(60))
        .unwrap();
        let key = Key::text("k");
        let charges = [Charge {
            rule: &rule,
            key: &key,
            cost: 1,
        }];
        warm(&local, &rule, &key);
        let refill = local.plan(&charges);
        assert!(matches!(refill.charges[0].how, How::Refill { .. }));
        // The call's first node says 59 s into the window; the node that charged this key,
        // 1 s into it: the lease lives 59 s, not 1 s.
        let reply = Reply {
            now: 59_000_000,
            times: Some(vec![61_000_000].into()),
            ..admitted(90, 10)
        };
        assert!(refill.settle(Some(Ok(reply))).unwrap().allowed());
        clock.advance(std::time::Duration::from_secs(2));
        assert!(
            local.answer(&charges, true).is_some(),
            "the lease lives on its own node's window"
        );
    }

    /// Units that wait behind those held live until their own time; a batch that joins them
    /// lives no longer, though its own time would run later.
    #[test]
    fn waiting_units_live_no_longer_than_their_time() {
        let hot = Hot::new();
        let (local, charges) = (&hot.local, hot.charges());
        // A mark of 6: four requests asked for units while the first refill was out.
        hot.fill(4);
        hot.pay(3);
        // A refill ahead asks for 4; four more are paid while it is out (the mark stays 6).
        let first = local.plan(&charges);
        hot.pay(4);
        first.settle(Some(Ok(admitted(76, 4)))).unwrap();
        assert_eq!(held(local), (1, 4));
        // 30 s later, another asks for 5, joining the units that wait (their time: 60 s after
        // the first refill ahead was sent).
        hot.clock.advance(std::time::Duration::from_secs(30));
        let second = local.plan(&charges);
        assert!(matches!(second.charges[0].how, How::Ahead { ask: 5, .. }));
        second.settle(Some(Ok(admitted(71, 5)))).unwrap();
        assert_eq!(held(local), (0, 9));
        // Past the first refill ahead's time, though within the second's: nothing is left.
        hot.clock.advance(std::time::Duration::from_secs(31));
        assert!(local.answer(&charges, true).is_none());
        assert!(matches!(
            local.plan(&charges).charges[0].how,
            How::Refill { held: 0, .. }
        ));
    }

    /// A lease entry evicted and made again does not take back the units of a request that
    /// was paid from the entry before it: a give-back of the old entry's lease never lands in
    /// the new one.
    #[test]
    fn a_give_back_of_an_evicted_lease_never_lands_in_the_next() {
        let hot = Hot::new();
        // One leased key per shard.
        let local = Arc::new(Local::new(
            Arc::new(hot.clock.clone()),
            "t".into(),
            1000,
            std::time::Duration::from_secs(3600),
            SHARDS,
        ));
        let strict = RuleSpec::new(
            "strict",
            Algorithm::FixedWindow,
            Limits::new(1, 3_600_000_000, 1).unwrap(),
        )
        .unwrap();
        let both = [
            Charge {
                rule: &hot.rule,
                key: &hot.key,
                cost: 1,
            },
            Charge {
                rule: &strict,
                key: &hot.key,
                cost: 1,
            },
        ];
        // Only the strict rule is sent: it denies.
        let strict_denies = Reply {
            now: 1_000_000,
            outcomes: smallvec::smallvec![denied(3_600_000_000, 3_600_000_000)],
            taken: smallvec::smallvec![0],
            times: None,
        };
        let refill = |local: &Arc<Local>| {
            let charges = hot.charges();
            warm(local, &hot.rule, &hot.key);
            let plan = local.plan(&charges);
            assert!(matches!(plan.charges[0].how, How::Refill { .. }));
            assert!(plan.settle(Some(Ok(admitted(90, 10)))).unwrap().allowed());
        };
        refill(&local);
        // A request paid from the lease, waiting for Redis's answer of its other rule.
        let stale = local.plan(&both);
        assert!(matches!(stale.charges[0].how, How::Leased(..)));
        // The lease expires; a key of the same shard takes its place.
        hot.clock.advance(std::time::Duration::from_secs(61));
        let slot = local.leases.index(&(lease_key(&hot.rule), hot.key.clone()));
        let other = (0..)
            .map(|i| Key::text(format!("other-{i}")))
            .find(|k| local.leases.index(&(lease_key(&hot.rule), k.clone())) == slot)
            .unwrap();
        let theirs = [Charge {
            rule: &hot.rule,
            key: &other,
            cost: 1,
        }];
        drop(local.plan(&theirs));
        // The key comes back: a new entry, a new lease, one unit spent of it.
        local.leases.remove(&(lease_key(&hot.rule), other.clone()));
        refill(&local);
        assert!(local.answer(&hot.charges(), true).is_some());
        assert_eq!(held(&local), (8, 0));
        // The old request is denied by its other rule: its unit is not this lease's.
        assert!(!stale.settle(Some(Ok(strict_denies))).unwrap().allowed());
        assert_eq!(
            held(&local),
            (8, 0),
            "a unit of the evicted lease came back"
        );
    }

    /// Units of a fixed window left unspent when their lease expires ride on the key's next
    /// call, once, with the time they were charged; a token bucket's are dropped; a reset drops
    /// those waiting.
    #[test]
    fn unspent_units_of_a_window_go_back_with_the_next_call_once() {
        let clock = ManualClock::new(1_000_000);
        let local = local(&clock);
        let key = Key::text("k");
        for algorithm in [Algorithm::FixedWindow, Algorithm::TokenBucket] {
            let rule = RuleSpec::new(
                format!("back-{algorithm}"),
                algorithm,
                Limits::new(100, 3_600_000_000, 100).unwrap(),
            )
            .unwrap()
            .with_lease(10, std::time::Duration::from_secs(1))
            .unwrap();
            let charges = [Charge {
                rule: &rule,
                key: &key,
                cost: 1,
            }];
            let lease_then_expire = |reset: bool| {
                warm(&local, &rule, &key);
                let refill = local.plan(&charges);
                assert!(matches!(
                    refill.charges[0].how,
                    How::Refill { lease: 10, .. }
                ));
                let charged = clock.now_micros();
                let mut reply = admitted(90, 10);
                reply.now = charged;
                assert!(refill.settle(Some(Ok(reply))).unwrap().allowed());
                for _ in 0..3 {
                    assert!(local.answer(&charges, true).is_some());
                }
                if reset {
                    local.forget(&rule, &key, true);
                }
                // Seen 2 s ago: the next request pays its cost alone, and carries what is left.
                clock.advance(std::time::Duration::from_secs(2));
                let next = local.plan(&charges);
                assert!(matches!(next.charges[0].how, How::Sent));
                (next, charged)
            };
            let (next, charged) = lease_then_expire(false);
            let sent = next.prepared("p", &charges);
            if algorithm.lease_gives_back() {
                assert_eq!(sent[0].give_back, Some((6, charged)), "{algorithm}");
            } else {
                assert_eq!(sent[0].give_back, None, "{algorithm}");
            }
            // The call fails: whether they went back is not known; they are not sent again.
            assert!(next.settle(Some(Err(StoreError::Timeout))).is_err());
            let again = local.plan(&charges);
            assert_eq!(again.prepared("p", &charges)[0].give_back, None);
            drop(again);
            // A reset drops them.
            let (next, _) = lease_then_expire(true);
            assert_eq!(next.prepared("p", &charges)[0].give_back, None);
        }
    }
}
