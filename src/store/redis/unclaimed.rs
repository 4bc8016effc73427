//! [`Unclaimed`]: a reply on its way to the request that asked for it. A reply that admitted
//! concurrency slots and is dropped before its request read it (the client left, the request
//! stopped waiting at its time budget while the call still ran) gives those slots back, since
//! no request will: nothing is held for the longest hold by a request that is gone.

use crate::store::redis::script::{Prepared, Reply};

/// Gives back the slots of a reply no one read: each refund, with the time its slots were
/// taken on the store's clock.
pub(crate) type GiveBackOrphan = Box<dyn FnOnce(Vec<(u64, Prepared)>) + Send>;

/// A reply, and what to do with its slots if no one reads it.
pub(crate) struct Unclaimed {
    reply: Option<Reply>,
    /// The charges of the reply, with a way to refund them; only for replies with a
    /// concurrency charge.
    orphan: Option<(Vec<Prepared>, GiveBackOrphan)>,
}

impl Unclaimed {
    /// A reply to `charges`: `give_back` runs if it is dropped unread and admitted
    /// concurrency slots. Replies without a concurrency charge carry nothing more.
    pub(crate) fn new(
        reply: Reply,
        charges: Vec<Prepared>,
        give_back: impl FnOnce() -> GiveBackOrphan,
    ) -> Self {
        let orphan = charges
            .iter()
            .any(|c| c.algorithm.is_concurrency())
            .then(|| (charges, give_back()));
        Unclaimed {
            reply: Some(reply),
            orphan,
        }
    }

    /// The reply, read by its request: its slots are the request's now.
    pub(crate) fn claim(mut self) -> Reply {
        self.orphan = None;
        self.reply.take().unwrap_or_else(|| Reply {
            now: 0,
            outcomes: Default::default(),
            taken: Default::default(),
            times: None,
        })
    }
}

impl Drop for Unclaimed {
    fn drop(&mut self) {
        let (Some(reply), Some((charges, give_back))) = (self.reply.take(), self.orphan.take())
        else {
            return;
        };
        if let Some(refunds) = orphaned_slots(&reply, charges) {
            give_back(refunds);
        }
    }
}

/// The refunds of the slots an admitted reply took, by charge, with when they were taken;
/// none when it admitted nothing.
fn orphaned_slots(reply: &Reply, charges: Vec<Prepared>) -> Option<Vec<(u64, Prepared)>> {
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
        .into_iter()
        .zip(&reply.taken)
        .enumerate()
        .filter(|(_, (c, units))| c.algorithm.is_concurrency() && **units > 0)
        .map(|(i, (mut c, &units))| {
            c.cost = units;
            c.lease = 0;
            (at(i), c)
        })
        .collect();
    (!refunds.is_empty()).then_some(refunds)
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::Algorithm;
    use crate::algorithm::{Limits, Outcome};

    fn charge(algorithm: Algorithm, key: &str) -> Prepared {
        Prepared {
            key: key.into(),
            algorithm,
            limits: Limits::new(5, 60_000_000, 5).unwrap(),
            descriptor: Arc::from(""),
            cost: 1,
            lease: 0,
            give_back: None,
        }
    }

    fn reply(allowed: bool) -> Reply {
        let outcome = Outcome {
            allowed,
            ..Outcome::default()
        };
        Reply {
            now: 7,
            outcomes: smallvec::smallvec![outcome, outcome],
            taken: smallvec::smallvec![1, 1],
            times: Some(vec![7, 9].into()),
        }
    }

    #[test]
    fn an_unread_admitting_reply_gives_its_slots_back_at_their_times() {
        let charges = [
            charge(Algorithm::TokenBucket, "rate"),
            charge(Algorithm::Concurrency, "slots"),
        ];
        let given: Arc<Mutex<Vec<(u64, String, u64)>>> = Arc::default();
        let log = given.clone();
        let unread = Unclaimed::new(reply(true), charges.to_vec(), move || {
            Box::new(move |refunds| {
                log.lock().unwrap().extend(
                    refunds
                        .into_iter()
                        .map(|(at, c)| (at, c.key.to_string(), c.cost)),
                );
            })
        });
        drop(unread);
        // Only the concurrency charge, taken on its own node's clock.
        assert_eq!(*given.lock().unwrap(), [(9, "slots".to_owned(), 1)]);
    }

    #[test]
    fn a_read_reply_or_a_denial_gives_nothing_back() {
        let charges = [charge(Algorithm::Concurrency, "slots")];
        let given = Arc::new(Mutex::new(0));
        for (allowed, read) in [(true, true), (false, false)] {
            let count = given.clone();
            let reply = Unclaimed::new(reply(allowed), charges.to_vec(), move || {
                Box::new(move |refunds| *count.lock().unwrap() += refunds.len())
            });
            if read {
                assert_eq!(reply.claim().now, 7);
            }
        }
        assert_eq!(*given.lock().unwrap(), 0);
    }
}
