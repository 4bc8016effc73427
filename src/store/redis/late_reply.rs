//! The way a check's charges reach its connection and its reply reaches its request, when the
//! reply may come after the request stopped waiting (a call that takes concurrency slots waits
//! longer than its checks): one shared block, the check's [`Exchange`], that holds both. A
//! reply that admitted concurrency slots and that no request reads gives them back.
//!
//! ```text
//! request:    Answered::new(charges) ─ send ─> the connection: Job { charges: Sending, answer }
//!             Answered::poll_reply   <─ reply ─ Answer::send
//! ```

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use super::unclaimed::{GiveBackOrphan, orphaned_slots};
use crate::store::StoreError;
use crate::store::redis::script::{Charges, Prepared, Reply};

/// One check's charges, and the place its reply goes: one allocation, shared by the request
/// that waits ([`Answered`]) and the connection that sends the check ([`Sending`], [`Answer`]).
struct Exchange {
    charges: Charges,
    slot: Mutex<Slot>,
}

#[derive(Default)]
struct Slot {
    reply: Option<Result<Reply, StoreError>>,
    /// Gives back the slots of `reply` if no request reads it (a reply that admitted
    /// concurrency charges).
    give_back: Option<GiveBackOrphan>,
    waker: Option<Waker>,
    /// The request stopped waiting: its [`Answered`] is gone.
    request_gone: bool,
    /// The connection answered, or dropped its [`Answer`] without one.
    answered: bool,
}

impl Exchange {
    fn lock(&self) -> MutexGuard<'_, Slot> {
        // Nothing panics while it is held.
        self.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn has_concurrency(&self) -> bool {
        self.charges.iter().any(|c| c.algorithm.is_concurrency())
    }
}

/// What the request of a check holds: its charges, and its reply when it comes.
pub(crate) struct Answered(Arc<Exchange>);

/// Where the reply of one check goes, held by the connection that sends it.
pub(crate) struct Answer(Arc<Exchange>);

/// The charges of one check, as the connection that sends it reads them.
pub(crate) struct Sending(Arc<Exchange>);

impl Answered {
    /// A check of `charges`, not sent yet.
    pub(crate) fn new(charges: Charges) -> Self {
        Answered(Arc::new(Exchange {
            charges,
            slot: Mutex::default(),
        }))
    }

    /// The charges.
    pub(crate) fn charges(&self) -> &[Prepared] {
        &self.0.charges
    }

    /// The answer of this check and its charges, for the one connection (or task) that sends
    /// it: taken once.
    pub(crate) fn answer(&self) -> (Answer, Sending) {
        (Answer(self.0.clone()), Sending(self.0.clone()))
    }

    /// The reply, once it came; `None` when the connection dropped the check without one.
    pub(crate) fn poll_reply(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Reply, StoreError>>> {
        let mut slot = self.0.lock();
        if let Some(reply) = slot.reply.take() {
            // Read: its slots are the request's now.
            slot.give_back = None;
            return Poll::Ready(Some(reply));
        }
        if slot.answered {
            return Poll::Ready(None);
        }
        match &slot.waker {
            Some(waker) if waker.will_wake(cx.waker()) => {}
            _ => slot.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

impl Drop for Answered {
    fn drop(&mut self) {
        let (reply, give_back) = {
            let mut slot = self.0.lock();
            slot.request_gone = true;
            slot.waker = None;
            (slot.reply.take(), slot.give_back.take())
        };
        // A reply that came and was not read gives its slots back.
        if let (Some(Ok(reply)), Some(give_back)) = (reply, give_back) {
            give_back_unread(&reply, &self.0.charges, give_back);
        }
    }
}

impl std::ops::Deref for Sending {
    type Target = [Prepared];

    fn deref(&self) -> &[Prepared] {
        &self.0.charges
    }
}

impl Answer {
    /// Whether the request stopped waiting (its client left, or its budget ran out).
    pub(crate) fn is_closed(&self) -> bool {
        self.0.lock().request_gone
    }

    /// Gives `reply` to the request; one it no longer waits for, or never reads, gives the
    /// concurrency slots it took back with what `give_back` makes.
    pub(crate) fn send(
        self,
        reply: Result<Reply, StoreError>,
        give_back: impl FnOnce() -> GiveBackOrphan,
    ) {
        // Made before the lock is taken: only a reply that may hold slots needs it.
        let give_back =
            (reply.as_ref().is_ok_and(Reply::allowed) && self.0.has_concurrency()).then(give_back);
        self.put(reply, give_back);
    }

    /// Fails the request with `error` (its call did not answer in time).
    pub(crate) fn fail(self, error: StoreError) {
        self.put(Err(error), None);
    }

    fn put(&self, reply: Result<Reply, StoreError>, give_back: Option<GiveBackOrphan>) {
        let mut slot = self.0.lock();
        slot.answered = true;
        if slot.request_gone {
            drop(slot);
            if let (Ok(reply), Some(give_back)) = (reply, give_back) {
                give_back_unread(&reply, &self.0.charges, give_back);
            }
            return;
        }
        slot.reply = Some(reply);
        slot.give_back = give_back;
        let waker = slot.waker.take();
        drop(slot);
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl Drop for Answer {
    /// An answer dropped without a reply wakes its request, which fails.
    fn drop(&mut self) {
        let waker = {
            let mut slot = self.0.lock();
            if slot.answered {
                return;
            }
            slot.answered = true;
            slot.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// Gives back the slots `reply` took for `charges`, with `give_back`: a reply that came after
/// its request stopped waiting.
fn give_back_unread(reply: &Reply, charges: &[Prepared], give_back: GiveBackOrphan) {
    if let Some(refunds) = orphaned_slots(reply, charges) {
        give_back(refunds);
    }
}

/// Gives back the slots `reply` took for `charges`, with what `give_back` makes: a reply whose
/// request had been answered already (it timed out).
pub(crate) fn orphan(
    reply: Result<Reply, StoreError>,
    charges: &[Prepared],
    give_back: impl FnOnce() -> GiveBackOrphan,
) {
    if let Ok(reply) = reply
        && let Some(refunds) = orphaned_slots(&reply, charges)
    {
        give_back()(refunds);
    }
}

/// The reply of `answered`, which its connection answers by the check's deadline (with
/// [`StoreError::Timeout`] then), whatever it waits for (a reply, the code loaded again), as
/// long as the runtime that runs the connection runs.
pub(crate) fn received(
    answered: &mut Answered,
    cx: &mut Context<'_>,
) -> Poll<Result<Reply, StoreError>> {
    answered.poll_reply(cx).map(|reply| {
        reply.unwrap_or_else(|| {
            Err(StoreError::Unavailable(
                "the connection went away before it answered the check".into(),
            ))
        })
    })
}

/// The reply of `answered` if it comes by `deadline`; `dropped` when its answer went away
/// without one.
pub(crate) async fn wait(
    mut answered: Answered,
    deadline: tokio::time::Instant,
    dropped: impl FnOnce() -> StoreError,
) -> Result<Reply, StoreError> {
    let reply = std::future::poll_fn(|cx| answered.poll_reply(cx));
    match tokio::time::timeout_at(deadline, reply).await {
        Ok(Some(reply)) => reply,
        Ok(None) => Err(dropped()),
        Err(_) => Err(StoreError::Timeout),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Poll, Waker};

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

    type Given = Arc<Mutex<Vec<(u64, String, u64)>>>;

    /// A `give_back` that records each refund: its time, key and units.
    fn recorder(given: &Given) -> impl FnOnce() -> GiveBackOrphan + use<> {
        let log = given.clone();
        move || {
            Box::new(move |refunds| {
                log.lock().unwrap().extend(
                    refunds
                        .into_iter()
                        .map(|(at, c)| (at, c.key.to_string(), c.cost)),
                );
            })
        }
    }

    fn both() -> Charges {
        smallvec::smallvec![
            charge(Algorithm::TokenBucket, "rate"),
            charge(Algorithm::Concurrency, "slots"),
        ]
    }

    fn poll(answered: &mut Answered) -> Poll<Option<Result<Reply, StoreError>>> {
        answered.poll_reply(&mut Context::from_waker(Waker::noop()))
    }

    #[test]
    fn an_unread_admitting_reply_gives_its_slots_back_at_their_times() {
        let given = Given::default();
        let answered = Answered::new(both());
        let (answer, sending) = answered.answer();
        assert_eq!(sending.len(), 2);
        answer.send(Ok(reply(true)), recorder(&given));
        assert!(
            given.lock().unwrap().is_empty(),
            "the request may still read it"
        );
        drop(answered);
        // Only the concurrency charge, taken on its own node's clock.
        assert_eq!(*given.lock().unwrap(), [(9, "slots".to_owned(), 1)]);
    }

    #[test]
    fn a_reply_to_a_request_gone_gives_its_slots_back_at_once() {
        let given = Given::default();
        let answered = Answered::new(both());
        let (answer, _sending) = answered.answer();
        drop(answered);
        assert!(answer.is_closed());
        answer.send(Ok(reply(true)), recorder(&given));
        assert_eq!(*given.lock().unwrap(), [(9, "slots".to_owned(), 1)]);
        // And a reply to a request answered already (timed out) the same way.
        orphan(Ok(reply(true)), &both(), recorder(&given));
        assert_eq!(given.lock().unwrap().len(), 2);
    }

    #[test]
    fn a_read_reply_or_a_denial_gives_nothing_back() {
        let given = Given::default();
        for (allowed, read) in [(true, true), (false, false)] {
            let mut answered = Answered::new(both());
            let (answer, _sending) = answered.answer();
            assert!(poll(&mut answered).is_pending());
            answer.send(Ok(reply(allowed)), recorder(&given));
            if read {
                let Poll::Ready(Some(Ok(reply))) = poll(&mut answered) else {
                    panic!("the reply was sent");
                };
                assert_eq!(reply.now, 7);
            }
        }
        orphan(Ok(reply(false)), &both(), recorder(&given));
        assert!(given.lock().unwrap().is_empty());
    }

    #[test]
    fn an_answer_dropped_without_a_reply_or_failed_ends_the_wait() {
        let mut answered = Answered::new(both());
        let (answer, sending) = answered.answer();
        drop(answer);
        assert!(matches!(poll(&mut answered), Poll::Ready(None)));
        // The charges stay readable for a reply that comes late.
        assert_eq!(sending[1].key.to_string(), "slots");

        let mut answered = Answered::new(both());
        answered.answer().0.fail(StoreError::Timeout);
        assert!(matches!(
            poll(&mut answered),
            Poll::Ready(Some(Err(StoreError::Timeout)))
        ));
    }
}
