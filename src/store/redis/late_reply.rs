//! The way a reply reaches its request when it may come after the request stopped waiting (a
//! call that takes concurrency slots waits longer than its checks): over a channel, as an
//! [`Unclaimed`] reply that gives its slots back when no request reads it.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::sync::oneshot;

use super::unclaimed::{GiveBackOrphan, Unclaimed};
use crate::store::StoreError;
use crate::store::redis::script::{Prepared, Reply};

/// Where the reply of one check goes.
pub(crate) struct Answer {
    sender: oneshot::Sender<Result<Unclaimed, StoreError>>,
}

/// What the request of a check waits on: its [`Answer`].
pub(crate) type Answered = oneshot::Receiver<Result<Unclaimed, StoreError>>;

/// The answer of a check, and what its request waits on.
pub(crate) fn channel() -> (Answer, Answered) {
    let (sender, answered) = oneshot::channel();
    (Answer { sender }, answered)
}

impl Answer {
    /// Whether the request stopped waiting (its client left, or its budget ran out).
    pub(crate) fn is_closed(&self) -> bool {
        self.sender.is_closed()
    }

    /// Gives `reply` (to `charges`) to the request; one it no longer waits for gives the slots
    /// it took back, with what `give_back` makes.
    pub(crate) fn send(
        self,
        reply: Result<Reply, StoreError>,
        charges: Vec<Prepared>,
        give_back: impl FnOnce() -> GiveBackOrphan,
    ) {
        let reply = reply.map(|reply| Unclaimed::new(reply, charges, give_back));
        // Not read: dropped here, and its slots go back.
        let _ = self.sender.send(reply);
    }

    /// Fails the request with `error` (its call did not answer in time).
    pub(crate) fn fail(self, error: StoreError) {
        let _ = self.sender.send(Err(error));
    }
}

/// Gives back the slots `reply` took for `charges`, with what `give_back` makes: a reply that
/// came after its request stopped waiting.
pub(crate) fn orphan(
    reply: Reply,
    charges: Vec<Prepared>,
    give_back: impl FnOnce() -> GiveBackOrphan,
) {
    drop(Unclaimed::new(reply, charges, give_back));
}

/// The reply of `answered`, which its connection answers by the check's deadline (with
/// [`StoreError::Timeout`] then), whatever it waits for (a reply, the code loaded again), as
/// long as the runtime that runs the connection runs.
pub(crate) fn received(
    answered: Pin<&mut Answered>,
    cx: &mut Context<'_>,
) -> Poll<Result<Reply, StoreError>> {
    answered.poll(cx).map(|answer| match answer {
        Ok(result) => result.map(Unclaimed::claim),
        Err(_) => Err(StoreError::Unavailable(
            "the connection went away before it answered the check".into(),
        )),
    })
}

/// The reply of `answered` if it comes by `deadline`; `dropped` when its answer went away
/// without one.
pub(crate) async fn wait(
    answered: Answered,
    deadline: tokio::time::Instant,
    dropped: impl FnOnce() -> StoreError,
) -> Result<Reply, StoreError> {
    match tokio::time::timeout_at(deadline, answered).await {
        Ok(Ok(result)) => result.map(Unclaimed::claim),
        Ok(Err(_)) => Err(dropped()),
        Err(_) => Err(StoreError::Timeout),
    }
}
