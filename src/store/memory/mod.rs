//! The in-process store: sharded, bounded, no setup.

mod debt;
mod shard;

use std::future::{Ready, ready};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, MutexGuard};

use smallvec::SmallVec;

use self::shard::{Entry, Shard};
use super::table::Table;
use super::{Adjustment, Change, Charge, RuleRegistry, Store, StoreError, StoreFuture};
use crate::algorithm::{MAX_MICROS, MICROS_PER_SECOND, Outcome, State};
use crate::clock::{Clock, SystemClock};
use crate::key::Key;
use crate::throttle::Every;
use crate::{ConfigError, Decision};

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
    /// The keys, in shards of at most `per_shard` each.
    table: Table<Shard>,
    clock: StoreClock,
    evictions: AtomicU64,
    eviction_warning: Every,
}

/// The clock a store reads on every decision: the system clock, called without a virtual call,
/// or one given to the builder.
enum StoreClock {
    System(SystemClock),
    Given(Arc<dyn Clock>),
}

impl StoreClock {
    #[inline]
    fn now_micros(&self) -> u64 {
        match self {
            StoreClock::System(clock) => clock.now_micros(),
            StoreClock::Given(clock) => clock.now_micros(),
        }
    }
}

/// How to put back one charge of a request that another rule denied.
enum Undo {
    /// The key was there: its state and expiry before the charge.
    Restore {
        state: Option<State>,
        expires_at: u64,
    },
    /// A sliding log that was there: take back the `cost` entries the charge added (the
    /// entries the charge dropped had left the window).
    Unlog { cost: u64, expires_at: u64 },
    /// The key was new: remove it.
    Remove,
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
        self.inner.table.each().map(|s| s.table.len()).sum()
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
        for mut shard in self.inner.table.each() {
            shard.sweep(now);
        }
    }

    #[inline(always)]
    fn hash(&self, rule: u64, key: &Key) -> u64 {
        // What `table.hash((rule, key))` gives, with the key's hash inlined: on every decision.
        let mut hasher = self.inner.table.hasher();
        hasher.write_u64(rule);
        key.hash(&mut hasher);
        hasher.finish()
    }

    /// The shard of a hash: bits the hash table does not use for its own buckets or tags.
    fn shard_of(&self, hash: u64) -> usize {
        self.inner.table.shard_of(hash)
    }

    /// Checks and charges `charges` now (the store never waits).
    pub(crate) fn decide(&self, charges: &[Charge<'_>]) -> Decision {
        let now = self.now();
        match charges {
            [] => Decision::default().made_at_time(now),
            [charge] => self.check_one(charge, now),
            _ => self.check_many(charges, now).made_at_time(now),
        }
    }

    fn now(&self) -> u64 {
        // Keep every sum of the model below 2^53 whatever a custom clock says.
        self.inner.clock.now_micros().min(MAX_MICROS)
    }

    /// Applies `change` to the state of one rule's key (made when missing), under its shard's
    /// lock, and returns what `change` returns: the key then lives until its new state is the
    /// same as no state.
    fn modify<R>(
        &self,
        charge: &Charge<'_>,
        now: u64,
        change: impl FnOnce(&mut Option<State>) -> R,
    ) -> R {
        let (algorithm, limits) = (charge.rule.algorithm(), charge.rule.limits());
        let rule = charge.rule.id();
        let hash = self.hash(rule, charge.key);
        let mut shard = self.inner.table.lock(self.shard_of(hash));
        shard.maybe_sweep(now);
        if shard.table.len() >= self.inner.table.per_shard()
            && shard.find(hash, charge, now).is_none()
        {
            self.make_room(&mut shard, now, 1);
        }
        let out = match shard
            .table
            .find_entry(hash, |e| e.rule == rule && e.key == *charge.key)
        {
            Ok(mut occupied) => {
                let entry = occupied.get_mut();
                if entry.expires_at <= now {
                    entry.state = None;
                }
                let out = change(&mut entry.state);
                match &entry.state {
                    // Never sooner than it was: the change may come from a request decided
                    // under an older policy, whose numbers do not tell how long others hold.
                    Some(state) => {
                        entry.expires_at = entry
                            .expires_at
                            .max(now + algorithm.check(limits, Some(state), now, 0).reset);
                    }
                    None => {
                        occupied.remove();
                    }
                }
                out
            }
            Err(absent) => {
                let mut state = None;
                let out = change(&mut state);
                if let Some(state) = state {
                    let expires_at = now + algorithm.check(limits, Some(&state), now, 0).reset;
                    let entry = Entry {
                        rule,
                        key: charge.key.clone(),
                        expires_at,
                        state: Some(state),
                    };
                    absent
                        .into_table()
                        .insert_unique(hash, entry, |e| self.hash(e.rule, &e.key));
                }
                out
            }
        };
        #[cfg(feature = "metrics")]
        shard.count_keys();
        out
    }

    /// [`Store::adjust`], at once.
    pub fn adjust_now(&self, adjustments: &[Adjustment<'_>]) {
        let now = self.now();
        for a in adjustments {
            let (algorithm, limits) = (a.rule.algorithm(), a.rule.limits());
            let at = if a.charged_at == 0 { now } else { a.charged_at };
            let charge = Charge {
                rule: a.rule,
                key: a.key,
                cost: 0,
            };
            self.modify(&charge, now, |state| match a.change {
                Change::Charge(units) => algorithm.force(limits, state, now, units),
                Change::Refund(units) => algorithm.refund(limits, state, now, units, at),
            });
        }
    }

    /// [`Store::peek`], at once: every charge's outcome, uncharged.
    pub fn peek_now(&self, charges: &[Charge<'_>]) -> Decision {
        let now = self.now();
        let outcomes = charges.iter().map(|charge| {
            let hash = self.hash(charge.rule.id(), charge.key);
            let shard = self.inner.table.lock(self.shard_of(hash));
            let state = shard.find(hash, charge, now);
            charge
                .rule
                .algorithm()
                .uncharged(charge.rule.limits(), state, now, charge.cost)
        });
        Decision::from_outcomes(outcomes.collect::<SmallVec<[_; 2]>>()).made_at_time(now)
    }

    /// [`Store::reset`], at once.
    pub fn reset_now(&self, charges: &[Charge<'_>]) {
        for charge in charges {
            let rule = charge.rule.id();
            let hash = self.hash(rule, charge.key);
            let mut shard = self.inner.table.lock(self.shard_of(hash));
            if let Ok(occupied) = shard
                .table
                .find_entry(hash, |e| e.rule == rule && e.key == *charge.key)
            {
                occupied.remove();
            }
            #[cfg(feature = "metrics")]
            shard.count_keys();
        }
    }

    /// Forgets every key of every rule: as new (for tests, between cases).
    pub fn clear(&self) {
        for mut shard in self.inner.table.each() {
            shard.table.clear();
            #[cfg(feature = "metrics")]
            shard.count_keys();
        }
    }

    /// The common case, one rule: one lock, one probe of the table.
    fn check_one(&self, charge: &Charge<'_>, now: u64) -> Decision {
        let hash = self.hash(charge.rule.id(), charge.key);
        let mut shard = self.inner.table.lock(self.shard_of(hash));
        shard.maybe_sweep(now);
        if shard.table.len() >= self.inner.table.per_shard()
            && shard.find(hash, charge, now).is_none()
        {
            self.make_room(&mut shard, now, 1);
        }
        let outcome = self.charge::<false>(&mut shard, hash, charge, now, &mut None);
        #[cfg(feature = "metrics")]
        shard.count_keys();
        Decision::single_at(outcome, now)
    }

    /// Several rules: their shards locked in ascending order, then each rule checked and charged
    /// in turn, as one rule would be, remembering what it was; when one denies, the ones
    /// already charged are put back as they were and nothing is charged. Denials are the rare
    /// case, so a request that every rule admits costs about what its rules cost one by one.
    fn check_many(&self, charges: &[Charge<'_>], now: u64) -> Decision {
        // Lists on the stack, sized for the request (a layer sends at most `MAX_RULES`).
        match charges.len() {
            0..=2 => self.check_on_stack::<2>(charges, now),
            3..=4 => self.check_on_stack::<4>(charges, now),
            5..=8 => self.check_on_stack::<8>(charges, now),
            n => {
                let mut located = vec![(0, 0, 0); n];
                let mut undo: Vec<Option<Undo>> = (0..n).map(|_| None).collect();
                self.check_stacked(charges, now, &mut located, &mut undo)
            }
        }
    }

    fn check_on_stack<const N: usize>(&self, charges: &[Charge<'_>], now: u64) -> Decision {
        let mut located = [(0, 0, 0); N];
        let mut undo = [const { None }; N];
        let n = charges.len();
        self.check_stacked(charges, now, &mut located[..n], &mut undo[..n])
    }

    /// [`check_many`](Self::check_many) with a list per charge for where its key lives
    /// (`located`: hash, shard, position of the shard's guard) and how to put its charge back
    /// (`undo`).
    fn check_stacked(
        &self,
        charges: &[Charge<'_>],
        now: u64,
        located: &mut [(u64, usize, usize)],
        undo: &mut [Option<Undo>],
    ) -> Decision {
        for (charge, l) in charges.iter().zip(located.iter_mut()) {
            let hash = self.hash(charge.rule.id(), charge.key);
            *l = (hash, self.shard_of(hash), 0);
        }
        // Lock each shard once, in ascending order: two requests never wait on each other in a
        // cycle.
        let mut guards: SmallVec<[MutexGuard<'_, Shard>; 4]> = SmallVec::new();
        let mut previous = None;
        while let Some(shard) = located
            .iter()
            .map(|l| l.1)
            .filter(|&s| previous.is_none_or(|p| s > p))
            .min()
        {
            previous = Some(shard);
            let mut guard = self.inner.table.lock(shard);
            guard.maybe_sweep(now);
            // Make room before deciding, so that inserting one rule's new key can never evict
            // another rule's key of the same request; only when the shard could overflow, as
            // making room scans it.
            let arriving = located.iter().filter(|l| l.1 == shard).count();
            if guard.table.len() + arriving > self.inner.table.per_shard() {
                let new = charges
                    .iter()
                    .zip(located.iter())
                    .filter(|(charge, l)| l.1 == shard && !guard.holds(l.0, charge))
                    .count();
                if new > 0 && guard.table.len() + new > self.inner.table.per_shard() {
                    self.make_room(&mut guard, now, new);
                }
            }
            for l in located.iter_mut().filter(|l| l.1 == shard) {
                l.2 = guards.len();
            }
            guards.push(guard);
        }

        let mut decision = Decision::default();
        for (i, (charge, &(hash, _, guard))) in charges.iter().zip(located.iter()).enumerate() {
            let outcome = self.charge::<true>(&mut guards[guard], hash, charge, now, &mut undo[i]);
            decision.push(outcome);
            if !outcome.allowed {
                return self.deny(charges, located, &mut guards, undo, now);
            }
        }
        // Keys as they come: the gauge follows each request, not only the sweeps.
        #[cfg(feature = "metrics")]
        for guard in &mut guards {
            guard.count_keys();
        }
        decision
    }

    /// Checks and, when it admits, charges one rule in `shard`; with `UNDO`, sets `undo` to how
    /// to put it back (a single rule has nothing to put back). A known key (the common case)
    /// costs one plain probe (`find_entry`, not `entry`).
    #[inline]
    fn charge<const UNDO: bool>(
        &self,
        shard: &mut Shard,
        hash: u64,
        charge: &Charge<'_>,
        now: u64,
        undo: &mut Option<Undo>,
    ) -> Outcome {
        let (algorithm, limits) = (charge.rule.algorithm(), charge.rule.limits());
        let rule = charge.rule.id();
        let found = shard
            .table
            .find_entry(hash, |e| e.rule == rule && e.key == *charge.key);
        match found {
            Ok(mut occupied) => {
                let entry = occupied.get_mut();
                let live = if entry.expires_at > now {
                    entry.state.as_ref()
                } else {
                    None
                };
                if charge.cost == 0 {
                    // Only looks: nothing to charge, nothing to put back.
                    return algorithm.check(limits, live, now, 0);
                }
                let before = if !UNDO {
                    None
                } else {
                    Some(match live {
                        // A log may hold thousands of entries: rather than a copy, what the charge
                        // adds is taken back (the entries it drops had left the window anyway). Only
                        // when this rule keeps a log: a rule that changed algorithm replaces it.
                        Some(State::SlidingWindowLog(_))
                            if algorithm == crate::Algorithm::SlidingWindowLog =>
                        {
                            Undo::Unlog {
                                cost: charge.cost,
                                expires_at: entry.expires_at,
                            }
                        }
                        _ => Undo::Restore {
                            state: live.cloned(),
                            expires_at: entry.expires_at,
                        },
                    })
                };
                if entry.expires_at <= now {
                    entry.state = None;
                }
                let outcome = algorithm.admit(limits, &mut entry.state, now, charge.cost);
                if outcome.allowed {
                    *undo = before;
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
                    if UNDO {
                        *undo = Some(Undo::Remove);
                    }
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
        }
    }

    /// A rule denied: the rules charged before it are put back as they were (in reverse order,
    /// so that a key charged twice ends as it started), and every rule reports its budget as it
    /// stands, uncharged.
    fn deny(
        &self,
        charges: &[Charge<'_>],
        located: &[(u64, usize, usize)],
        guards: &mut [MutexGuard<'_, Shard>],
        undo: &mut [Option<Undo>],
        now: u64,
    ) -> Decision {
        let steps = charges.iter().zip(located).zip(undo.iter_mut()).rev();
        for ((charge, &(hash, _, guard)), step) in steps {
            let Some(step) = step.take() else {
                continue;
            };
            let rule = charge.rule.id();
            let table = &mut guards[guard].table;
            let found = table.find_entry(hash, |e| e.rule == rule && e.key == *charge.key);
            match (step, found) {
                (Undo::Remove, Ok(occupied)) => {
                    occupied.remove();
                }
                (Undo::Restore { state, expires_at }, Ok(mut occupied)) => {
                    let entry = occupied.get_mut();
                    entry.state = state;
                    entry.expires_at = expires_at;
                }
                (Undo::Restore { state, expires_at }, Err(absent)) => {
                    // The charge emptied it (it was removed): it comes back.
                    let entry = Entry {
                        rule,
                        key: charge.key.clone(),
                        expires_at,
                        state,
                    };
                    absent
                        .into_table()
                        .insert_unique(hash, entry, |e| self.hash(e.rule, &e.key));
                }
                (Undo::Unlog { cost, expires_at }, Ok(mut occupied)) => {
                    let entry = occupied.get_mut();
                    if let Some(State::SlidingWindowLog(log)) = &mut entry.state {
                        let keep = log.entries.len().saturating_sub(cost as usize);
                        log.entries.truncate(keep);
                        if log.entries.is_empty() {
                            entry.state = None;
                        }
                    }
                    entry.expires_at = expires_at;
                }
                (Undo::Remove | Undo::Unlog { .. }, Err(_)) => {}
            }
        }
        let mut decision = Decision::default();
        for (charge, &(hash, _, guard)) in charges.iter().zip(located) {
            let state = guards[guard].find(hash, charge, now);
            let (algorithm, limits) = (charge.rule.algorithm(), charge.rule.limits());
            decision.push(algorithm.uncharged(limits, state, now, charge.cost));
        }
        decision
    }

    /// Frees room for `needed` new keys: expired keys first, then the keys closest to a full
    /// budget until a tenth of the shard (and at least `needed`) is free.
    fn make_room(&self, shard: &mut Shard, now: u64, needed: usize) {
        shard.sweep(now);
        let capacity = self.inner.table.per_shard();
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
        #[cfg(feature = "metrics")]
        {
            crate::telemetry::evictions(evicted);
            shard.count_keys();
        }
        if self.inner.eviction_warning.due(now, 60 * MICROS_PER_SECOND) {
            tracing::warn!(
                evicted,
                max_keys = self.inner.table.per_shard() * self.inner.table.shards(),
                total_evictions = self.inner.evictions.load(Ordering::Relaxed),
                "tollgate memory store is full: evicted the keys closest to a full budget \
                 (those clients start again with a full budget); raise max_keys if this repeats"
            );
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.inner.table.shards())
            .field(
                "max_keys",
                &(self.inner.table.per_shard() * self.inner.table.shards()),
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

    fn adjust(&self, adjustments: &[Adjustment<'_>]) -> StoreFuture<()> {
        self.adjust_now(adjustments);
        Box::pin(std::future::ready(Ok(())))
    }

    fn try_adjust_now(&self, adjustments: &[Adjustment<'_>]) -> Option<Result<(), StoreError>> {
        self.adjust_now(adjustments);
        Some(Ok(()))
    }

    fn peek(&self, charges: &[Charge<'_>]) -> StoreFuture<Decision> {
        let decision = self.peek_now(charges);
        Box::pin(std::future::ready(Ok(decision)))
    }

    fn reset(&self, charges: &[Charge<'_>]) -> StoreFuture<()> {
        self.reset_now(charges);
        Box::pin(std::future::ready(Ok(())))
    }

    fn registry(&self) -> Option<&RuleRegistry> {
        Some(&self.inner.registry)
    }

    fn kind(&self) -> &'static str {
        "memory"
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
                table: Table::new(shards, per_shard),
                clock: self
                    .clock
                    .map_or_else(|| StoreClock::System(SystemClock::new()), StoreClock::Given),
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
