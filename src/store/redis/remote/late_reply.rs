//! The way a reply reaches its request when it may come after the request stopped waiting (a
//! call that takes concurrency slots waits longer than its checks): over a channel, as an
//! [`Unclaimed`] reply that gives its slots back when no request reads it.

use std::sync::Arc;

use tokio::sync::oneshot;

use super::changes;
use super::transport::Transport;
use super::unclaimed::Unclaimed;
use crate::store::StoreError;
use crate::store::redis::script::{Prepared, Reply};

/// Where the reply of one check goes.
pub(crate) struct Answer {
    sender: oneshot::Sender<Result<Unclaimed, StoreError>>,
    /// The time passed to the script (with an injected clock), for the slots' give-back.
    now: Option<u64>,
}

/// What the request of a check waits on: its [`Answer`].
pub(crate) type Answered = oneshot::Receiver<Result<Unclaimed, StoreError>>;

/// The answer of a check whose script gets the time `now`, and what its request waits on.
pub(crate) fn channel(now: Option<u64>) -> (Answer, Answered) {
    let (sender, answered) = oneshot::channel();
    (Answer { sender, now }, answered)
}

impl Answer {
    /// Whether the request stopped waiting (its client left, or its budget ran out).
    pub(crate) fn is_closed(&self) -> bool {
        self.sender.is_closed()
    }

    /// Gives `reply` (to `charges`) to the request; one it no longer waits for gives the slots
    /// it took back, through `transport`.
    pub(crate) fn send<T: Transport>(
        self,
        transport: &Arc<T>,
        reply: Result<Reply, StoreError>,
        charges: Vec<Prepared>,
    ) {
        let now = self.now;
        let reply = reply.map(|reply| {
            Unclaimed::new(reply, charges, || {
                let transport = transport.clone();
                Box::new(move |refunds| changes::give_back_orphan(transport, now, refunds))
            })
        });
        // Not read: dropped here, and its slots go back.
        let _ = self.sender.send(reply);
    }
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
