//! Keys forgotten (a reset or refund here, or heard from another replica): what ends their
//! cached denials and leases, and the tombstones that remember them.

use std::hash::BuildHasher;
use std::sync::atomic::Ordering;

use super::Replica;
use super::held::lease_key;
use crate::key::Key;
use crate::store::Charge;

/// The most keys heard forgotten (by another replica's reset or refund) that are remembered
/// at once, for the cap of a cached denial's life; past it, every cached denial is dropped.
const MAX_TOMBSTONES: usize = 65_536;

/// The shortest life of a tombstone (local microseconds): a minute.
const TOMBSTONE_LIFE: u64 = 60_000_000;

/// The hash of a Redis key name, the same on every replica.
pub(super) fn name_hash(name: &[u8]) -> u64 {
    use std::hash::Hasher;
    let mut hasher = foldhash::fast::FixedState::with_seed(0x666f_7267_6f74).build_hasher();
    hasher.write(name);
    hasher.finish()
}

impl Replica {
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
    pub(super) fn tombstone_life(&self) -> u64 {
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
    pub(super) fn may_be_forgotten(&self) -> bool {
        self.tombstone_count.load(Ordering::Relaxed) > 0
            || self.forgot_all_at.load(Ordering::Relaxed) != 0
    }

    /// Whether another replica forgot `charge`'s key after `at` (local microseconds).
    pub(super) fn forgotten_since(&self, charge: &Charge<'_>, at: u64) -> bool {
        let forgot_all_at = self.forgot_all_at.load(Ordering::Relaxed);
        if forgot_all_at != 0 && forgot_all_at >= at {
            return true;
        }
        if self.tombstone_count.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let name =
            crate::store::redis::keys::key_name(&self.prefix, charge.key, charge.rule.name());
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
}
