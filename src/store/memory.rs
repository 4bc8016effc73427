//! The in-process store: sharded, bounded, no setup.

use std::future::{Ready, ready};
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use hashbrown::{HashTable, hash_table};
use smallvec::SmallVec;

use super::{Charge, RuleRegistry, Store, StoreError};
use crate::algorithm::{MAX_MICROS, MICROS_PER_SECOND, State};
use crate::clock::{Clock, SystemClock};
use crate::key::Key;
use crate::warn::Every;
use crate::{ConfigError, Decision};

/// How often each shard drops its expired keys, in microseconds.
const SWEEP_INTERVAL: u64 = MICROS_PER_SECOND;

/// When a full shard has nothing expired, it evicts until this fraction (in percent) is free.
const EVICT_TO_FREE_PERCENT: usize = 10;

/// The default bound on the number of keys.
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

/// The in-process store: the default, no setup.
///
/// ```
/// use tollgate::clock::ManualClock;
/// use tollgate::store::MemoryStore;
///
/// let store = MemoryStore::builder()
///     .max_keys(100_000)
///     .clock(ManualClock::default())
///     .build()
///     .unwrap();
/// assert_eq!(store.len(), 0);
/// ```
///
/// * **Concurrent**: keys are spread over independently locked shards; a check locks only the
///   shards of its keys (in a fixed order, so stacked rules never deadlock).
/// * **Atomic**: all rules of a request are checked under their shards' locks and charged only
///   when all admit.
/// * **Expiring**: every key carries the time its budget is full again. A lookup ignores an
///   expired key, and each shard drops its expired keys at most once a second while it is used;
///   no background task and no per-request scan.
/// * **Bounded**: at most [`max_keys`](MemoryStoreBuilder::max_keys) keys (default
///   1,000,000, about 100 bytes each). When a shard is full it first drops expired keys; if that
///   frees nothing, it **evicts the keys whose budget will be full soonest** (those closest to
///   forgetting their client anyway) until a tenth of the shard is free. An evicted client starts
///   again with a full budget, so eviction can only make the limiter more lenient, never deny
///   anyone wrongly. Evictions are counted ([`evictions`](MemoryStore::evictions)) and reported
///   through `tracing` at most once a minute.
///
/// Clones share the same state: give one store to several layers to share budgets across
/// routes (rules with the same name count together).
///
/// Each replica of a service has its own memory store: behind a load balancer the fleet admits
/// the limit once per replica. Use the Redis store to make a limit fleet-wide.
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    registry: RuleRegistry,
    shards: Box<[Mutex<Shard>]>,
    shard_mask: u64,
    per_shard: usize,
    hasher: foldhash::fast::RandomState,
    clock: Arc<dyn Clock>,
    evictions: AtomicU64,
    eviction_warning: Every,
}

#[derive(Default)]
struct Shard {
    table: HashTable<Entry>,
    next_sweep: u64,
}

/// One cache line per key: a lookup touches one line of the table's data.
#[repr(align(64))]
struct Entry {
    rule: u64,
    key: Key,
    /// When the state is equivalent to no state at all.
    expires_at: u64,
    /// `None` once the key expired and a check cleared it, until a charge or a sweep: reads as
    /// no state, like an expired key.
    state: Option<State>,
}

/// Configures a [`MemoryStore`].
#[must_use]
pub struct MemoryStoreBuilder {
    max_keys: usize,
    shards: usize,
    clock: Option<Arc<dyn Clock>>,
}

impl MemoryStore {
    /// A store with the defaults: 1,000,000 keys at most, the system clock.
    pub fn new() -> Self {
        Self::builder()
            .build()
            .unwrap_or_else(|_| unreachable!("the defaults are valid"))
    }

    /// Configures a store.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            max_keys: DEFAULT_MAX_KEYS,
            shards: 64,
            clock: None,
        }
    }

    /// The number of keys held (expired ones that were not swept yet included).
    pub fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| lock(s).table.len()).sum()
    }

    /// Whether the store holds no key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many keys were evicted because the store was full.
    pub fn evictions(&self) -> u64 {
        self.inner.evictions.load(Ordering::Relaxed)
    }

    /// Drops every expired key now (the store also does this by itself as it is used).
    pub fn sweep(&self) {
        let now = self.inner.clock.now_micros();
        for shard in self.inner.shards.iter() {
            lock(shard).sweep(now);
        }
    }

    fn hash(&self, rule: u64, key: &Key) -> u64 {
        let mut hasher = self.inner.hasher.build_hasher();
        rule.hash(&mut hasher);
        key.hash(&mut hasher);
        hasher.finish()
    }

    /// The shard of a hash: bits the hash table does not use for its own buckets or tags.
    fn shard_of(&self, hash: u64) -> usize {
        ((hash >> 32) & self.inner.shard_mask) as usize
    }

    /// Checks and charges `charges` now (the store never waits).
    pub(crate) fn decide(&self, charges: &[Charge<'_>]) -> Decision {
        // Keep every sum of the model below 2^53 whatever a custom clock says.
        let now = self.inner.clock.now_micros().min(MAX_MICROS);
        match charges {
            [] => Decision::default(),
            [charge] => self.check_one(charge, now),
            _ => self.check_many(charges, now),
        }
    }

    /// The common case, one rule: one lock, one probe of the table.
    fn check_one(&self, charge: &Charge<'_>, now: u64) -> Decision {
        let hash = self.hash(charge.rule.id(), charge.key);
        let mut shard = lock(&self.inner.shards[self.shard_of(hash)]);
        shard.maybe_sweep(now);
        if shard.table.len() >= self.inner.per_shard && shard.find(hash, charge, now).is_none() {
            self.make_room(&mut shard, now, 1);
        }
        let (algorithm, limits) = (charge.rule.algorithm(), charge.rule.limits());
        let rule = charge.rule.id();
        // `find_entry` rather than `entry`: a known key (the common case) costs one plain probe.
        let found = shard
            .table
            .find_entry(hash, |e| e.rule == rule && e.key == *charge.key);
        let outcome = match found {
            Ok(mut occupied) => {
                let entry = occupied.get_mut();
                if entry.expires_at <= now {
                    entry.state = None;
                }
                let outcome = algorithm.admit(limits, &mut entry.state, now, charge.cost);
                if outcome.allowed {
                    if entry.state.is_some() {
                        entry.expires_at = now + outcome.reset;
                    } else {
                        occupied.remove();
                    }
                }
                outcome
            }
            Err(absent) => {
                let mut state = None;
                let outcome = algorithm.admit(limits, &mut state, now, charge.cost);
                if outcome.allowed && state.is_some() {
                    let entry = Entry {
                        rule,
                        key: charge.key.clone(),
                        expires_at: now + outcome.reset,
                        state,
                    };
                    absent
                        .into_table()
                        .insert_unique(hash, entry, |e| self.hash(e.rule, &e.key));
                }
                outcome
            }
        };
        Decision::single(outcome)
    }

    /// The table slot of a charge's key.
    fn slot<'s>(
        &self,
        shard: &'s mut Shard,
        hash: u64,
        charge: &Charge<'_>,
    ) -> hash_table::Entry<'s, Entry> {
        let rule = charge.rule.id();
        shard.table.entry(
            hash,
            |e| e.rule == rule && e.key == *charge.key,
            |e| self.hash(e.rule, &e.key),
        )
    }

    fn check_many(&self, charges: &[Charge<'_>], now: u64) -> Decision {
        let located: SmallVec<[(u64, usize); 4]> = charges
            .iter()
            .map(|c| {
                let hash = self.hash(c.rule.id(), c.key);
                (hash, self.shard_of(hash))
            })
            .collect();
        let mut order: SmallVec<[usize; 4]> = located.iter().map(|&(_, s)| s).collect();
        order.sort_unstable();
        order.dedup();
        // Lock in ascending shard order: two requests never wait on each other in a cycle.
        let mut guards: SmallVec<[(usize, MutexGuard<'_, Shard>); 4]> = order
            .iter()
            .map(|&s| {
                let mut guard = lock(&self.inner.shards[s]);
                guard.maybe_sweep(now);
                // Make room before deciding, so that inserting one rule's new key can never
                // evict another rule's key of the same request; only when the shard could
                // overflow, as making room scans it.
                let in_shard = || {
                    charges
                        .iter()
                        .zip(&located)
                        .filter(move |(_, (_, shard))| *shard == s)
                };
                if guard.table.len() + in_shard().count() > self.inner.per_shard {
                    let new = in_shard()
                        .filter(|(charge, (hash, _))| !guard.holds(*hash, charge))
                        .count();
                    if new > 0 && guard.table.len() + new > self.inner.per_shard {
                        self.make_room(&mut guard, now, new);
                    }
                }
                (s, guard)
            })
            .collect();
        let position = |shard: usize, guards: &SmallVec<[(usize, MutexGuard<'_, Shard>); 4]>| {
            guards.iter().position(|(s, _)| *s == shard).unwrap_or(0)
        };
        let mut decision = Decision::default();
        for (charge, &(hash, shard)) in charges.iter().zip(&located) {
            let i = position(shard, &guards);
            let state = guards[i].1.find(hash, charge, now);
            decision.push(charge.rule.algorithm().check(
                charge.rule.limits(),
                state,
                now,
                charge.cost,
            ));
        }
        if decision.allowed() {
            for ((charge, &(hash, shard)), outcome) in
                charges.iter().zip(&located).zip(decision.outcomes())
            {
                let i = position(shard, &guards);
                let slot = self.slot(&mut guards[i].1, hash, charge);
                self.commit(slot, charge, now, outcome.reset);
            }
            return decision;
        }
        // Denied, so nothing is charged: every rule reports its budget as it stands.
        let mut uncharged = Decision::default();
        for ((charge, &(hash, shard)), outcome) in
            charges.iter().zip(&located).zip(decision.outcomes())
        {
            if outcome.allowed && charge.cost > 0 {
                let i = position(shard, &guards);
                let state = guards[i].1.find(hash, charge, now);
                let (algorithm, limits) = (charge.rule.algorithm(), charge.rule.limits());
                uncharged.push(algorithm.uncharged(limits, state, now, charge.cost));
            } else {
                uncharged.push(*outcome);
            }
        }
        uncharged
    }

    /// Charges an admitted request in its slot; `reset` (from its outcome) is how long the new
    /// state lives. Room for a new key was made before the decision.
    fn commit(
        &self,
        slot: hash_table::Entry<'_, Entry>,
        charge: &Charge<'_>,
        now: u64,
        reset: u64,
    ) {
        let (algorithm, limits) = (charge.rule.algorithm(), charge.rule.limits());
        match slot {
            hash_table::Entry::Occupied(mut occupied) => {
                let entry = occupied.get_mut();
                if entry.expires_at <= now {
                    entry.state = None;
                }
                algorithm.commit(limits, &mut entry.state, now, charge.cost);
                if entry.state.is_some() {
                    entry.expires_at = now + reset;
                } else {
                    occupied.remove();
                }
            }
            hash_table::Entry::Vacant(vacant) => {
                let mut state = None;
                algorithm.commit(limits, &mut state, now, charge.cost);
                if state.is_some() {
                    vacant.insert(Entry {
                        rule: charge.rule.id(),
                        key: charge.key.clone(),
                        expires_at: now + reset,
                        state,
                    });
                }
            }
        }
    }

    /// Frees room for `needed` new keys: expired keys first, then the keys closest to a full
    /// budget until a tenth of the shard (and at least `needed`) is free.
    fn make_room(&self, shard: &mut Shard, now: u64, needed: usize) {
        shard.sweep(now);
        let capacity = self.inner.per_shard;
        if shard.table.len() + needed <= capacity {
            return;
        }
        let free = (capacity * EVICT_TO_FREE_PERCENT / 100)
            .max(needed)
            .min(capacity);
        let keep = capacity - free;
        let mut expiries: Vec<u64> = shard.table.iter().map(|e| e.expires_at).collect();
        let evict = expiries.len().saturating_sub(keep);
        if evict == 0 {
            // One request brings more new keys than the whole shard holds (a tiny `max_keys`
            // with stacked rules): it goes over the bound for now, and the next one evicts.
            return;
        }
        let (_, &mut threshold, _) = expiries.select_nth_unstable(evict - 1);
        // Evict everything strictly before the threshold, then entries at it until enough.
        let mut at_threshold = evict - expiries.iter().filter(|&&t| t < threshold).count();
        let before = shard.table.len();
        shard.table.retain(|e| {
            if e.expires_at < threshold {
                false
            } else if e.expires_at == threshold && at_threshold > 0 {
                at_threshold -= 1;
                false
            } else {
                true
            }
        });
        let evicted = (before - shard.table.len()) as u64;
        self.inner.evictions.fetch_add(evicted, Ordering::Relaxed);
        if self.inner.eviction_warning.due(now, 60 * MICROS_PER_SECOND) {
            tracing::warn!(
                evicted,
                max_keys = self.inner.per_shard * self.inner.shards.len(),
                total_evictions = self.inner.evictions.load(Ordering::Relaxed),
                "tollgate memory store is full: evicted the keys closest to a full budget \
                 (those clients start again with a full budget); raise max_keys if this repeats"
            );
        }
    }
}

impl Shard {
    /// Whether the table has an entry for the charge's key, expired or not.
    fn holds(&self, hash: u64, charge: &Charge<'_>) -> bool {
        let rule = charge.rule.id();
        self.table
            .find(hash, |e| e.rule == rule && e.key == *charge.key)
            .is_some()
    }

    fn find(&self, hash: u64, charge: &Charge<'_>, now: u64) -> Option<&State> {
        self.table
            .find(hash, |e| e.rule == charge.rule.id() && e.key == *charge.key)
            .filter(|e| e.expires_at > now)
            .and_then(|e| e.state.as_ref())
    }

    fn maybe_sweep(&mut self, now: u64) {
        if now >= self.next_sweep {
            self.sweep(now);
        }
    }

    fn sweep(&mut self, now: u64) {
        self.table.retain(|e| e.expires_at > now);
        self.next_sweep = now + SWEEP_INTERVAL;
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding a shard cannot leave it half-written (states are replaced whole), so
    // a poisoned lock is still usable.
    shard
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.inner.shards.len())
            .field(
                "max_keys",
                &(self.inner.per_shard * self.inner.shards.len()),
            )
            .finish_non_exhaustive()
    }
}

impl Store for MemoryStore {
    type Future = Ready<Result<Decision, StoreError>>;

    fn check(&self, charges: &[Charge<'_>]) -> Self::Future {
        ready(Ok(self.decide(charges)))
    }

    fn check_now(&self, charges: &[Charge<'_>]) -> Option<Result<Decision, StoreError>> {
        Some(Ok(self.decide(charges)))
    }

    fn registry(&self) -> Option<&RuleRegistry> {
        Some(&self.inner.registry)
    }
}

impl MemoryStoreBuilder {
    /// The most keys the store holds (default 1,000,000). Each rule of each client is one key.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// The number of shards, a power of two (default 64). More shards, less lock contention.
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards;
        self
    }

    /// The clock (default: [`SystemClock`]). Tests use a
    /// [`ManualClock`](crate::clock::ManualClock) instead of sleeping.
    pub fn clock<C: Clock>(mut self, clock: C) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// Builds the store.
    pub fn build(self) -> Result<MemoryStore, ConfigError> {
        if self.shards == 0 || !self.shards.is_power_of_two() || self.shards > 1 << 16 {
            return Err(ConfigError::new(format!(
                "memory store: {} shards; use a power of two between 1 and 65536",
                self.shards
            )));
        }
        if self.max_keys == 0 {
            return Err(ConfigError::new(
                "memory store: max_keys is 0; use at least 1",
            ));
        }
        // Never more shards than keys, and never more keys than asked for in total.
        let most_shards = 1usize << (usize::BITS - 1 - self.max_keys.leading_zeros());
        let shards = self.shards.min(most_shards);
        let per_shard = self.max_keys / shards;
        Ok(MemoryStore {
            inner: Arc::new(Inner {
                registry: RuleRegistry::new(),
                shards: (0..shards).map(|_| Mutex::new(Shard::default())).collect(),
                shard_mask: shards as u64 - 1,
                per_shard,
                hasher: foldhash::fast::RandomState::default(),
                clock: self.clock.unwrap_or_else(|| Arc::new(SystemClock::new())),
                evictions: AtomicU64::new(0),
                eviction_warning: Every::default(),
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_entry_fits_in_64_bytes() {
        assert_eq!(std::mem::size_of::<super::Entry>(), 64);
    }
}
