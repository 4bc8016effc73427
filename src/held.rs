//! [`Held`]: the concurrency slots an admitted request holds, given back when it is dropped.
//!
//! A request of a [concurrency rule](crate::Rule::concurrent) takes its slots when it is
//! admitted; they travel with it: in the response future while the inner service works, then
//! in the response body until its last frame. Whichever way the request ends (the body ends,
//! is dropped, the client leaves, the inner service fails or panics), the one `Held` is
//! dropped once, and gives the slots back in one store call.

use std::sync::Arc;

use smallvec::SmallVec;

use crate::key::Key;
use crate::policy::snapshot::Snapshot;

/// Where slots go back to: the layer's store, or its local fallback for slots it took.
pub(crate) trait GiveBack: Send + Sync {
    /// Gives back `held`'s slots. Never blocks: a store that cannot answer at once finishes
    /// on the runtime.
    fn give_back(&self, held: &Held);
}

/// The slots one request holds, per concurrency rule: the rule's index, the key, the units,
/// and when they were taken on the store's clock.
pub(crate) struct Held {
    pub(crate) giver: Arc<dyn GiveBack>,
    /// The policy the request was decided under (its rules' numbers).
    pub(crate) snapshot: Arc<Snapshot>,
    pub(crate) slots: SmallVec<[(u16, Key, u64, u64); 1]>,
    /// Taken by the local fallback (the store failed): given back there.
    pub(crate) local: bool,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.giver.give_back(self);
    }
}
