//! [`Table`]: the bounded, sharded table of the stores (the memory store's keys; a Redis
//! replica's deny cache, leases and split keys' turns): entries spread over independently locked
//! shards by a hash of their key, each shard bounded. What a shard holds, and how its entries
//! expire, is the user's: `S`, monomorphised (no allocation, lock or dyn beyond its shard's).

use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Mutex, MutexGuard};

/// Shards of `S`, each behind its own lock, with the hasher that spreads keys over them.
pub(crate) struct Table<S> {
    shards: Box<[Mutex<S>]>,
    /// The shard count less one (a power of two).
    mask: u64,
    hasher: foldhash::fast::RandomState,
    /// The most entries a shard holds.
    per_shard: usize,
}

impl<S: Default> Table<S> {
    /// `shards` shards (a power of two) of at most `per_shard` entries each.
    pub(crate) fn new(shards: usize, per_shard: usize) -> Self {
        debug_assert!(shards.is_power_of_two());
        Table {
            shards: (0..shards).map(|_| Mutex::default()).collect(),
            mask: shards as u64 - 1,
            hasher: foldhash::fast::RandomState::default(),
            per_shard,
        }
    }
}

impl<S> Table<S> {
    /// The hash of `key`, which picks its shard (and finds it there).
    #[inline]
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn hash(&self, key: impl Hash) -> u64 {
        self.hasher.hash_one(key)
    }

    /// A hasher of the table's seed, for a key written in parts: hashing them one by one gives
    /// the [`hash`](Self::hash) of the tuple of them.
    #[inline]
    pub(crate) fn hasher(&self) -> impl Hasher {
        self.hasher.build_hasher()
    }

    /// The shard of an entry whose key hashes to `hash`.
    #[inline]
    pub(crate) fn shard_of(&self, hash: u64) -> usize {
        ((hash >> 32) & self.mask) as usize
    }

    /// Locks shard `index`. A panic while holding a shard cannot leave it half-written (its
    /// users replace entries whole), so a poisoned lock is still usable.
    #[inline]
    pub(crate) fn lock(&self, index: usize) -> MutexGuard<'_, S> {
        self.shards[index]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Each shard, locked in turn.
    pub(crate) fn each(&self) -> impl Iterator<Item = MutexGuard<'_, S>> {
        (0..self.shards.len()).map(|index| self.lock(index))
    }

    /// How many shards there are.
    pub(crate) fn shards(&self) -> usize {
        self.shards.len()
    }

    /// The most entries a shard holds.
    #[inline]
    pub(crate) fn per_shard(&self) -> usize {
        self.per_shard
    }
}
