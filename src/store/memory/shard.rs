//! [`Shard`]: one shard of the memory store's keys, their [`Entry`]s (a rule's state for a key, and
//! when it expires), and how expired keys are swept.

use hashbrown::HashTable;

use crate::algorithm::{MICROS_PER_SECOND, State};
use crate::key::Key;
use crate::store::Charge;

/// How often each shard drops its expired keys, in microseconds.
pub(super) const SWEEP_INTERVAL: u64 = MICROS_PER_SECOND;

#[derive(Default)]
pub(super) struct Shard {
    pub(super) table: HashTable<Entry>,
    pub(super) next_sweep: u64,
    /// The keys last counted in the process's `tollgate_memory_store_keys`.
    #[cfg(feature = "metrics")]
    pub(super) counted: usize,
}

#[cfg(feature = "metrics")]
impl Shard {
    /// Brings the process's key count up to date with this shard.
    pub(super) fn count_keys(&mut self) {
        let now = self.table.len();
        if now != self.counted {
            let delta = now as i64 - self.counted as i64;
            self.counted = now;
            crate::telemetry::memory_keys(delta);
        }
    }
}

#[cfg(feature = "metrics")]
impl Drop for Shard {
    fn drop(&mut self) {
        if self.counted > 0 {
            crate::telemetry::memory_keys(-(self.counted as i64));
        }
    }
}

/// One cache line per key: a lookup touches one line of the table's data.
#[repr(align(64))]
pub(super) struct Entry {
    pub(super) rule: u64,
    pub(super) key: Key,
    /// When the state is equivalent to no state at all.
    pub(super) expires_at: u64,
    /// `None` once the key expired and a check cleared it, until a charge or a sweep: reads as
    /// no state, like an expired key.
    pub(super) state: Option<State>,
}

impl Shard {
    /// Whether the table has an entry for the charge's key, expired or not.
    pub(super) fn holds(&self, hash: u64, charge: &Charge<'_>) -> bool {
        let rule = charge.rule.id();
        self.table
            .find(hash, |e| e.rule == rule && e.key == *charge.key)
            .is_some()
    }

    pub(super) fn find(&self, hash: u64, charge: &Charge<'_>, now: u64) -> Option<&State> {
        self.table
            .find(hash, |e| e.rule == charge.rule.id() && e.key == *charge.key)
            .filter(|e| e.expires_at > now)
            .and_then(|e| e.state.as_ref())
    }

    pub(super) fn maybe_sweep(&mut self, now: u64) {
        if now >= self.next_sweep {
            self.sweep(now);
        }
    }

    pub(super) fn sweep(&mut self, now: u64) {
        self.table.retain(|e| e.expires_at > now);
        self.next_sweep = now + SWEEP_INTERVAL;
        #[cfg(feature = "metrics")]
        self.count_keys();
    }
}
