//! Split keys: a hot key's rule split in sub-keys that its requests take in turn, and a
//! sub-key's outcome told for the whole key.

use std::sync::atomic::Ordering;

use super::Replica;
use crate::algorithm::Outcome;
use crate::store::Charge;

/// The fingerprint of one sub-key of a split rule.
pub(super) fn mix(fingerprint: u64, part: u16) -> u64 {
    (fingerprint ^ u64::from(part).wrapping_add(1)).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// A sub-key's outcome told for the whole key of a rule split in `parts`: the rule's capacity,
/// and the sub-key's remaining times `parts` (the budget left if every sub-key has as much).
pub(super) fn whole(outcome: Outcome, parts: u16, capacity: u64) -> Outcome {
    Outcome {
        limit: capacity,
        remaining: outcome
            .remaining
            .saturating_mul(u64::from(parts))
            .min(capacity),
        ..outcome
    }
}

impl Replica {
    /// The sub-key of a split key's next request: each key takes its sub-keys in turn.
    pub(super) fn next_part(&self, charge: &Charge<'_>) -> u16 {
        let parts = charge.rule.parts();
        let key = (charge.rule.fingerprint(), charge.key.clone());
        let mut shard = self.parts.shard(&key);
        if let Some(next) = shard.get_mut(&key) {
            let part = *next;
            *next = (part + 1) % parts;
            return part;
        }
        if shard.len() >= self.parts.shards.per_shard() {
            // Full: one key forgets its turn (it starts again at its own first sub-key).
            if let Some(evicted) = shard.keys().next().cloned() {
                shard.remove(&evicted);
                self.parts.len.fetch_sub(1, Ordering::Relaxed);
            }
        }
        // A key starts at a sub-key of its own, so that many keys spread from the start.
        let first = (self.parts.shards.hash(&key) % u64::from(parts)) as u16;
        shard.insert(key, (first + 1) % parts);
        self.parts.len.fetch_add(1, Ordering::Relaxed);
        first
    }
}
