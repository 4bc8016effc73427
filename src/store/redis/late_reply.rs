//! The way a check's charges reach its connection and its reply reaches its request, when the
//! reply may come after the request stopped waiting (a call that takes concurrency slots waits
//! longer than its checks): one shared block, the check's `Exchange`, holds both. A reply that
//! admitted concurrency slots and that no request reads gives them back, since no request will:
//! nothing is held for the longest hold by a request that is gone.
//!
//! ```text
//! the request:     Waiting::new(charges) ──answer()──> the connection: Job { Answer }
//!                  Waiting::poll_reply   <──reply───── Answer::send (or fail)
//! ```

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use crate::store::StoreError;
use crate::store::redis::script::{Charges, Prepared, Reply};

/// Gives back the slots of a reply no one read: each refund, with the time its slots were
/// taken on the store's clock.
pub(crate) type GiveBackOrphan = Box<dyn FnOnce(Vec<(u64, Prepared)>) + Send>;

/// One check's charges, and the place its reply goes: one allocation, shared by the request
/// that waits ([`Waiting`]) and the connection that sends the check ([`Answer`]).
struct Exchange {
    charges: Charges,
    /// The request stopped waiting without its reply: its [`Waiting`] is gone unread (one that
    /// read its reply sets nothing: the check was answered). Set under the lock (the reply's
    /// hand-over reads it there); read without it by [`Answer::is_closed`].
    request_gone: AtomicBool,
    /// The check's [`Answer`] was made: until then, no reply can come.
    answer_made: AtomicBool,
    slot: Mutex<Slot>,
}

#[derive(Default)]
struct Slot {
    reply: Option<Result<Reply, StoreError>>,
    /// Gives back the slots of `reply` if no request reads it (a reply that admitted
    /// concurrency charges).
    give_back: Option<GiveBackOrphan>,
    waker: Option<Waker>,
    /// The connection answered, or dropped its [`Answer`] without a reply.
    answered: bool,
}

impl Exchange {
    /// Whether a charge is a concurrency limit's: an admitting reply then holds slots.
    fn holds_slots(&self) -> bool {
        self.charges.iter().any(|c| c.algorithm.is_concurrency())
    }

    fn lock(&self) -> MutexGuard<'_, Slot> {
        // Only a waker's `clone` (and `will_wake`) runs under it besides this module's code;
        // should it panic, nothing was written yet, and the poisoning is ignored.
        self.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What the request of a check holds: its charges, and its reply when it comes.
pub(crate) struct Waiting {
    exchange: Arc<Exchange>,
    /// The reply was read: nothing is left in the exchange for this side to give back or wake.
    read: bool,
}

/// The connection's (or task's) side of one check: its charges, and where its reply goes.
/// Answered once; a reply after that (the request answered at its deadline, its call late)
/// reaches no request, and gives back the slots it took.
pub(crate) struct Answer {
    exchange: Arc<Exchange>,
    /// Not answered yet, and the check's first answer: its reply goes to the request.
    live: bool,
}

impl Waiting {
    /// A check of `charges`, not sent yet.
    pub(crate) fn new(charges: Charges) -> Self {
        Waiting {
            exchange: Arc::new(Exchange {
                charges,
                request_gone: AtomicBool::new(false),
                answer_made: AtomicBool::new(false),
                slot: Mutex::default(),
            }),
            read: false,
        }
    }

    /// The charges.
    pub(crate) fn charges(&self) -> &[Prepared] {
        &self.exchange.charges
    }

    /// Whether a charge is a concurrency limit's.
    pub(crate) fn holds_slots(&self) -> bool {
        self.exchange.holds_slots()
    }

    /// The answer of this check, for the one connection (or task) that sends it. Made once:
    /// another answer is closed from the start, and a reply sent through it reaches no request
    /// (its slots go back).
    pub(crate) fn answer(&self) -> Answer {
        let first = !self.exchange.answer_made.swap(true, Ordering::AcqRel);
        Answer {
            exchange: self.exchange.clone(),
            live: first,
        }
    }

    /// The reply, once it came; `None` when the connection dropped the check without one (or
    /// no connection took it).
    pub(crate) fn poll_reply(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Reply, StoreError>>> {
        let mut slot = self.exchange.lock();
        if let Some(reply) = slot.reply.take() {
            // Read: its slots are the request's now. The connection answered (it took the
            // waker as it gave the reply) and writes nothing more.
            let claimed = slot.give_back.take();
            drop(slot);
            drop(claimed);
            self.read = true;
            return Poll::Ready(Some(reply));
        }
        if slot.answered || !self.exchange.answer_made.load(Ordering::Acquire) {
            return Poll::Ready(None);
        }
        let stale = match &slot.waker {
            Some(waker) if waker.will_wake(cx.waker()) => None,
            _ => slot.waker.replace(cx.waker().clone()),
        };
        drop(slot);
        drop(stale);
        Poll::Pending
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if self.read {
            // Nothing left: no reply to give back, no waker (the connection took it), and no
            // reply to come (the check was answered).
            return;
        }
        let (reply, give_back, waker) = {
            let mut slot = self.exchange.lock();
            self.exchange.request_gone.store(true, Ordering::Release);
            (slot.reply.take(), slot.give_back.take(), slot.waker.take())
        };
        drop(waker);
        // A reply that came and was not read gives its slots back.
        if let Some(reply) = reply {
            give_back_unread(reply, &self.exchange.charges, give_back);
        }
    }
}

impl Answer {
    /// The charges, as the call sends them and its reply is read.
    pub(crate) fn charges(&self) -> &[Prepared] {
        &self.exchange.charges
    }

    /// Whether a charge is a concurrency limit's.
    pub(crate) fn holds_slots(&self) -> bool {
        self.exchange.holds_slots()
    }

    /// Whether no request reads a reply any more: it was answered, or it stopped waiting (its
    /// client left, or its budget ran out).
    pub(crate) fn is_closed(&self) -> bool {
        !self.live || self.exchange.request_gone.load(Ordering::Acquire)
    }

    /// Gives `reply` to the request; one answered already, gone, or that never reads it gives
    /// the concurrency slots it took back with what `give_back` makes (if it makes one).
    pub(crate) fn send(
        &mut self,
        reply: Result<Reply, StoreError>,
        give_back: impl FnOnce() -> Option<GiveBackOrphan>,
    ) {
        // Made before the lock is taken, and only for a reply that may hold slots.
        let give_back = (reply.as_ref().is_ok_and(Reply::allowed) && self.holds_slots())
            .then(give_back)
            .flatten();
        self.put(reply, give_back);
    }

    /// Fails the request with `error` (its call did not answer in time), unless it was
    /// answered already.
    pub(crate) fn fail(&mut self, error: StoreError) {
        if self.live {
            self.put(Err(error), None);
        }
    }

    fn put(&mut self, reply: Result<Reply, StoreError>, give_back: Option<GiveBackOrphan>) {
        if std::mem::replace(&mut self.live, false) {
            let mut slot = self.exchange.lock();
            if !self.exchange.request_gone.load(Ordering::Acquire) {
                slot.answered = true;
                slot.reply = Some(reply);
                slot.give_back = give_back;
                let waker = slot.waker.take();
                drop(slot);
                if let Some(waker) = waker {
                    waker.wake();
                }
                return;
            }
        }
        // No request reads it.
        give_back_unread(reply, &self.exchange.charges, give_back);
    }
}

impl Drop for Answer {
    /// An answer dropped without a reply wakes its request, which fails.
    fn drop(&mut self) {
        if !self.live {
            return;
        }
        let waker = {
            let mut slot = self.exchange.lock();
            slot.answered = true;
            slot.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// Gives back, with `give_back`, the slots `reply` took for `charges`: a reply no request reads.
fn give_back_unread(
    reply: Result<Reply, StoreError>,
    charges: &[Prepared],
    give_back: Option<GiveBackOrphan>,
) {
    if let (Ok(reply), Some(give_back)) = (reply, give_back)
        && let Some(refunds) = orphaned_slots(&reply, charges)
    {
        give_back(refunds);
    }
}

/// The refunds of the slots an admitting reply took, by charge, with when they were taken;
/// none when it admitted nothing.
fn orphaned_slots(reply: &Reply, charges: &[Prepared]) -> Option<Vec<(u64, Prepared)>> {
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

/// The reply of `waiting`, which its connection answers by the check's deadline (with
/// [`StoreError::Timeout`] then), whatever it waits for (a reply, the code loaded again), as
/// long as the runtime that runs the connection runs.
pub(crate) fn received(
    waiting: &mut Waiting,
    cx: &mut Context<'_>,
) -> Poll<Result<Reply, StoreError>> {
    waiting.poll_reply(cx).map(|reply| {
        reply.unwrap_or_else(|| {
            Err(StoreError::Unavailable(
                "the connection went away before it answered the check".into(),
            ))
        })
    })
}

/// The reply of `waiting` if it comes by `deadline`; `dropped` when its answer went away
/// without one.
pub(crate) async fn wait(
    mut waiting: Waiting,
    deadline: tokio::time::Instant,
    dropped: impl FnOnce() -> StoreError,
) -> Result<Reply, StoreError> {
    let reply = std::future::poll_fn(|cx| waiting.poll_reply(cx));
    match tokio::time::timeout_at(deadline, reply).await {
        Ok(Some(reply)) => reply,
        Ok(None) => Err(dropped()),
        Err(_) => Err(StoreError::Timeout),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Poll, Wake, Waker};

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
    fn recorder(given: &Given) -> impl FnOnce() -> Option<GiveBackOrphan> + use<> {
        let log = given.clone();
        move || {
            Some(Box::new(move |refunds: Vec<(u64, Prepared)>| {
                log.lock().unwrap().extend(
                    refunds
                        .into_iter()
                        .map(|(at, c)| (at, c.key.to_string(), c.cost)),
                );
            }) as GiveBackOrphan)
        }
    }

    fn both() -> Charges {
        smallvec::smallvec![
            charge(Algorithm::TokenBucket, "rate"),
            charge(Algorithm::Concurrency, "slots"),
        ]
    }

    /// Counts its wake-ups.
    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn counter() -> (Arc<Count>, Waker) {
        let count = Arc::new(Count::default());
        (count.clone(), Waker::from(count))
    }

    fn poll(waiting: &mut Waiting, waker: &Waker) -> Poll<Option<Result<Reply, StoreError>>> {
        waiting.poll_reply(&mut Context::from_waker(waker))
    }

    #[test]
    fn an_unread_admitting_reply_gives_its_slots_back_at_their_times() {
        let given = Given::default();
        let waiting = Waiting::new(both());
        let mut answer = waiting.answer();
        assert_eq!(answer.charges().len(), 2);
        answer.send(Ok(reply(true)), recorder(&given));
        assert!(
            given.lock().unwrap().is_empty(),
            "the request may still read it"
        );
        drop(waiting);
        // Only the concurrency charge, taken on its own node's clock.
        assert_eq!(*given.lock().unwrap(), [(9, "slots".to_owned(), 1)]);
    }

    #[test]
    fn a_reply_to_a_request_gone_gives_its_slots_back_at_once() {
        let given = Given::default();
        let waiting = Waiting::new(both());
        let mut answer = waiting.answer();
        assert!(!answer.is_closed());
        drop(waiting);
        assert!(answer.is_closed());
        answer.send(Ok(reply(true)), recorder(&given));
        assert_eq!(*given.lock().unwrap(), [(9, "slots".to_owned(), 1)]);
        // And a reply to a request answered already (timed out) the same way.
        let _waiting = Waiting::new(both());
        let mut late = _waiting.answer();
        late.fail(StoreError::Timeout);
        assert!(late.is_closed());
        late.send(Ok(reply(true)), recorder(&given));
        assert_eq!(given.lock().unwrap().len(), 2);
    }

    #[test]
    fn a_read_reply_or_a_denial_gives_nothing_back() {
        let given = Given::default();
        let (_, waker) = counter();
        for (allowed, read) in [(true, true), (false, false)] {
            let mut waiting = Waiting::new(both());
            let mut answer = waiting.answer();
            assert!(poll(&mut waiting, &waker).is_pending());
            answer.send(Ok(reply(allowed)), recorder(&given));
            if read {
                let Poll::Ready(Some(Ok(reply))) = poll(&mut waiting, &waker) else {
                    panic!("the reply was sent");
                };
                assert_eq!(reply.now, 7);
            }
        }
        // A denial that comes after its request was answered at its deadline.
        let _waiting = Waiting::new(both());
        let mut late = _waiting.answer();
        late.fail(StoreError::Timeout);
        late.send(Ok(reply(false)), recorder(&given));
        assert!(given.lock().unwrap().is_empty());
    }

    #[test]
    fn a_reply_an_error_or_an_answer_dropped_wakes_the_latest_waker_once() {
        let given = Given::default();
        for end in ["reply", "fail", "drop"] {
            let mut waiting = Waiting::new(both());
            let mut answer = Some(waiting.answer());
            let (first, first_waker) = counter();
            let (second, second_waker) = counter();
            assert!(poll(&mut waiting, &first_waker).is_pending());
            // Polled again by another task: that one is woken.
            assert!(poll(&mut waiting, &second_waker).is_pending());
            match (end, answer.as_mut()) {
                ("reply", Some(answer)) => answer.send(Ok(reply(true)), recorder(&given)),
                ("fail", Some(answer)) => answer.fail(StoreError::Timeout),
                _ => answer = None,
            }
            assert_eq!(first.0.load(Ordering::SeqCst), 0, "{end}");
            assert_eq!(second.0.load(Ordering::SeqCst), 1, "{end}");
            let polled = poll(&mut waiting, &second_waker);
            match end {
                "reply" => assert!(matches!(polled, Poll::Ready(Some(Ok(_))))),
                "fail" => assert!(matches!(
                    polled,
                    Poll::Ready(Some(Err(StoreError::Timeout)))
                )),
                _ => assert!(matches!(polled, Poll::Ready(None))),
            }
            // The charges stay readable for a reply that comes late.
            if let Some(answer) = &answer {
                assert_eq!(answer.charges()[1].key.to_string(), "slots");
            }
        }
        assert!(given.lock().unwrap().is_empty(), "every reply was read");
    }

    #[test]
    fn a_reply_racing_the_request_going_away_gives_its_slots_back_once() {
        for _ in 0..200 {
            let given = Given::default();
            let waiting = Waiting::new(both());
            let mut answer = waiting.answer();
            let log = given.clone();
            // Both sides start together: the reply and the request's end race.
            let start = Arc::new(std::sync::Barrier::new(2));
            let go = start.clone();
            let sender = std::thread::spawn(move || {
                go.wait();
                answer.send(Ok(reply(true)), recorder(&log));
            });
            start.wait();
            drop(waiting);
            sender.join().unwrap();
            assert_eq!(given.lock().unwrap().len(), 1);
        }
    }

    #[test]
    fn a_check_never_sent_ends_its_wait_and_an_unread_error_gives_nothing_back() {
        let given = Given::default();
        let (_, waker) = counter();
        // No answer made: nothing could reply.
        let mut unsent = Waiting::new(both());
        assert!(matches!(poll(&mut unsent, &waker), Poll::Ready(None)));
        // An error stored and never read holds no slots.
        let waiting = Waiting::new(both());
        let mut answer = waiting.answer();
        answer.send(Err(StoreError::Timeout), recorder(&given));
        drop(waiting);
        assert!(given.lock().unwrap().is_empty());
    }

    #[test]
    fn a_request_that_read_its_reply_leaves_nothing_behind() {
        let given = Given::default();
        let (woken, waker) = counter();
        let mut waiting = Waiting::new(both());
        let mut answer = waiting.answer();
        let mut second = waiting.answer();
        assert!(poll(&mut waiting, &waker).is_pending());
        answer.send(Ok(reply(true)), recorder(&given));
        assert!(matches!(
            poll(&mut waiting, &waker),
            Poll::Ready(Some(Ok(_)))
        ));
        // Read once: polled again, it ends, and keeps no waker.
        let (again, again_waker) = counter();
        assert!(matches!(
            poll(&mut waiting, &again_waker),
            Poll::Ready(None)
        ));
        // Its end touches nothing: the slots read are the request's, and its waker was taken.
        drop(waiting);
        assert_eq!(again.0.load(Ordering::SeqCst), 0);
        assert!(given.lock().unwrap().is_empty());
        assert_eq!(woken.0.load(Ordering::SeqCst), 1);
        assert!(answer.is_closed() && second.is_closed());
        // A reply after it reaches no request: its slots go back.
        second.send(Ok(reply(true)), recorder(&given));
        assert_eq!(given.lock().unwrap().len(), 1);
    }

    #[test]
    fn a_second_answer_is_closed_and_its_reply_reaches_no_request() {
        let given = Given::default();
        let (_, waker) = counter();
        let mut waiting = Waiting::new(both());
        let mut first = waiting.answer();
        let mut second = waiting.answer();
        assert!(second.is_closed() && !first.is_closed());
        second.send(Ok(reply(true)), recorder(&given));
        // Its slots go back; the request still waits for the first answer.
        assert_eq!(given.lock().unwrap().len(), 1);
        assert!(poll(&mut waiting, &waker).is_pending());
        first.send(Ok(reply(false)), recorder(&given));
        assert!(matches!(
            poll(&mut waiting, &waker),
            Poll::Ready(Some(Ok(_)))
        ));
    }
}
