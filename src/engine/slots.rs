//! [`Slots`]: the concurrency slots an admitted request holds, given back when it is dropped.
//!
//! A request of a [concurrency rule](crate::Rule::concurrent) takes its slots when it is
//! admitted; they travel with it: in the response future while the inner service works, then
//! in the response body until its last frame. Whichever way the request ends (the body ends,
//! is dropped, the client leaves, the inner service fails or panics), the one `Slots` is
//! dropped once, and gives the slots back in one store call.

use std::sync::Arc;

use smallvec::SmallVec;

use super::local::Counted;
use super::state::Engine;
use crate::key::Key;
use crate::policy::snapshot::Snapshot;
use crate::runtime::Origin;
use crate::store::{Adjustment, Change, Store};
use crate::throttle::report_give_back;

/// Where slots go back to: the layer's store, or its fallback limiter for slots it took.
pub(crate) trait GiveBack: Send + Sync {
    /// Gives back `slots`. Never blocks: a store that cannot answer at once finishes on the
    /// runtime (the one the request was served on, when this thread runs none).
    fn give_back(&self, slots: &Taken);
}

/// The slots one request holds (see [`Taken`]), boxed: they travel with the request in its
/// future and its response body, each moved several times on the way, and most requests hold
/// none, so that a request that holds none carries one word for them.
pub(crate) struct Slots(Box<Taken>);

/// The slots one request holds, per concurrency rule: the rule's index, the key, the units,
/// and when they were taken on the store's clock.
pub(crate) struct Taken {
    pub(crate) giver: Arc<dyn GiveBack>,
    /// The policy the request was decided under (its rules' numbers).
    pub(crate) snapshot: Arc<Snapshot>,
    pub(crate) taken: SmallVec<[(u16, Key, u64, u64); 1]>,
    /// Holds the count of replicas the fallback limiter took the slots at, when it did (the
    /// store failed): they are given back there, at the same share.
    pub(crate) on_fallback: Option<Counted>,
    /// The runtime the request was served on: the give-back finishes there when the slots are
    /// dropped on a thread that runs none.
    pub(crate) origin: Origin,
}

impl Slots {
    /// The slots of `taken`, given back when dropped.
    pub(crate) fn new(taken: Taken) -> Self {
        Slots(Box::new(taken))
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        self.0.giver.give_back(&self.0);
    }
}

impl<St: Store> GiveBack for Engine<St> {
    fn give_back(&self, slots: &Taken) {
        let adjustments: SmallVec<[Adjustment<'_>; 1]> = slots
            .taken
            .iter()
            .map(|(i, key, units, at)| Adjustment {
                rule: &slots.snapshot.rules[usize::from(*i)].spec,
                key,
                change: Change::Refund(*units),
                charged_at: *at,
            })
            .collect();
        self.finish_adjust(
            slots.on_fallback,
            &adjustments,
            report_give_back,
            "released outside a Tokio runtime",
            &slots.origin,
        );
    }
}
