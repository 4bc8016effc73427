//! [`Account`]: one metered rule's account of a streamed response — the units the store
//! granted, the free ones, the last chunks charged — and what settles it at the units spent.

use smallvec::SmallVec;

use crate::key::Key;
use crate::store::Change;

/// One metered rule's account.
pub(super) struct Account {
    pub(super) rule: u16,
    pub(super) key: Key,
    pub(super) chunk: u64,
    /// Units granted by the store so far.
    pub(super) taken: u64,
    /// Of those, units granted while the store failed and the rule fails open: never charged.
    pub(super) free: u64,
    /// The last chunks charged (units, when on the store's clock; 0: not known), newest last:
    /// unspent units go back to the window of the chunk they came from.
    pub(super) recent: SmallVec<[(u64, u64); 2]>,
    /// What the store said was left when it refused a chunk, enough for the units needed: the
    /// next chunk asked for is at most this (a stream is cut at the budget, not a chunk before
    /// it). Cleared when a chunk is granted.
    pub(super) left: Option<u64>,
}

/// Chunks an account remembers: the unspent units of a stream lie in its last two (the one
/// being spent and the one taken ahead of need), a few more when clones spend at once.
const RECENT_CHUNKS: usize = 4;

impl Account {
    /// The units the account is charged when it settles at `spent`: the charged units are
    /// spent first, then the free ones, then a debt past both.
    pub(super) fn owed(&self, spent: u64) -> u64 {
        spent.min(self.taken - self.free) + spent.saturating_sub(self.taken)
    }

    /// `units` granted by the store, charged `at`.
    pub(super) fn charged(&mut self, units: u64, at: u64) {
        self.taken = self.taken.saturating_add(units);
        self.left = None;
        if self.recent.len() == RECENT_CHUNKS {
            self.recent.remove(0);
        }
        self.recent.push((units, at));
    }

    /// `units` granted while the store failed and the rule fails open: not charged.
    pub(super) fn free(&mut self, units: u64) {
        self.taken = self.taken.saturating_add(units);
        self.free = self.free.saturating_add(units);
    }

    /// The changes that settle the account at `spent`: units spent past the charged ones (and
    /// the free ones) charged as a debt; the charged ones not spent given back, newest chunk
    /// first, each to the time it was charged.
    pub(super) fn settle(&self, spent: u64) -> SmallVec<[(Change, u64); 2]> {
        let charged = self.taken - self.free;
        let owed = self.owed(spent);
        let mut changes = SmallVec::new();
        if owed > charged {
            changes.push((Change::Charge(owed - charged), 0));
        }
        let mut back = charged.saturating_sub(owed);
        for &(units, at) in self.recent.iter().rev() {
            if back == 0 {
                break;
            }
            let part = back.min(units);
            changes.push((Change::Refund(part), at));
            back -= part;
        }
        if back > 0 {
            // Older than the chunks remembered: to the oldest of them.
            let at = self.recent.first().map_or(0, |&(_, at)| at);
            changes.push((Change::Refund(back), at));
        }
        changes
    }
}
