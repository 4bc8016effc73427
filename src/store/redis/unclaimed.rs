//! The slots of a reply no request read: a reply that admitted concurrency slots and is
//! dropped before its request read it (the client left, the request stopped waiting at its
//! time budget while the call still ran) gives those slots back, since no request will:
//! nothing is held for the longest hold by a request that is gone. See
//! [`late_reply`](super::late_reply), which calls it.

use crate::store::redis::script::{Prepared, Reply};

/// Gives back the slots of a reply no one read: each refund, with the time its slots were
/// taken on the store's clock.
pub(crate) type GiveBackOrphan = Box<dyn FnOnce(Vec<(u64, Prepared)>) + Send>;

/// The refunds of the slots an admitted reply took, by charge, with when they were taken;
/// none when it admitted nothing.
pub(crate) fn orphaned_slots(reply: &Reply, charges: &[Prepared]) -> Option<Vec<(u64, Prepared)>> {
    if !reply.allowed() {
        return None;
    }
    let at = |i: usize| {
        reply
            .times
            .as_ref()
            .and_then(|times| times.get(i).copied())
            .unwrap_or(reply.now)
    };
    let refunds: Vec<(u64, Prepared)> = charges
        .iter()
        .zip(&reply.taken)
        .enumerate()
        .filter(|(_, (c, units))| c.algorithm.is_concurrency() && **units > 0)
        .map(|(i, (c, &units))| {
            let mut c = c.clone();
            c.cost = units;
            c.lease = 0;
            (at(i), c)
        })
        .collect();
    (!refunds.is_empty()).then_some(refunds)
}
