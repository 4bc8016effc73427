//! [`Table`]: a replica's entries (deny cache, leases, split keys' turns) by rule fingerprint and
//! key, in the stores' [bounded sharded table](crate::store::table::Table), telling at once when
//! it is empty.

use std::collections::HashMap;
use std::sync::MutexGuard;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::key::Key;
use crate::store::table;

/// Shards of each table.
pub(super) const SHARDS: usize = 16;
const _: () = assert!(
    SHARDS.is_power_of_two(),
    "the table picks a shard by a hash's bits"
);

/// Entries by rule fingerprint and key.
pub(super) type Shard<V> = HashMap<(u64, Key), V, foldhash::fast::RandomState>;

/// A sharded map, bounded, that tells at once when it is empty.
pub(super) struct Table<V> {
    pub(super) shards: table::Table<Shard<V>>,
    /// When each shard, full, may be swept for expired entries again (local microseconds): at
    /// most once a second, so that a full shard of live entries is not scanned per insert.
    pub(super) next_sweep: Box<[AtomicU64]>,
    pub(super) len: AtomicUsize,
}

impl<V> Table<V> {
    pub(super) fn new(max_entries: usize) -> Self {
        Table {
            shards: table::Table::new(SHARDS, max_entries.div_ceil(SHARDS)),
            next_sweep: (0..SHARDS).map(|_| AtomicU64::new(0)).collect(),
            len: AtomicUsize::new(0),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len.load(Ordering::Relaxed) == 0
    }

    pub(super) fn index(&self, key: &(u64, Key)) -> usize {
        self.shards.shard_of(self.shards.hash(key))
    }

    pub(super) fn shard(&self, key: &(u64, Key)) -> MutexGuard<'_, Shard<V>> {
        self.shards.lock(self.index(key))
    }

    /// Whether `shard` (of `key`) has room for `key`: when it is full, it drops the entries
    /// `gone` says may go, at most once a second.
    pub(super) fn room(
        &self,
        shard: &mut Shard<V>,
        key: &(u64, Key),
        now: u64,
        gone: impl Fn(&V) -> bool,
    ) -> bool {
        let most = self.shards.per_shard();
        if shard.len() < most || shard.contains_key(key) {
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
        shard.len() < most
    }

    pub(super) fn remove(&self, key: &(u64, Key)) {
        if self.shard(key).remove(key).is_some() {
            self.len.fetch_sub(1, Ordering::Relaxed);
        }
    }

    pub(super) fn clear(&self) {
        for mut shard in self.shards.each() {
            self.len.fetch_sub(shard.len(), Ordering::Relaxed);
            shard.clear();
        }
    }
}
