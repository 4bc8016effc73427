//! [`Job`]: one check waiting for its call, and [`Command`]: commands outside the checks.

use redis::{RedisResult, Value};
use tokio::sync::oneshot;

use crate::store::breaker::Permit;
use crate::store::redis::late_reply::{Answer, Waiting};
use crate::store::redis::script::Prepared;

/// One check: sent with the checks queued beside it in one call, answered through `answer`.
pub(crate) struct Job {
    /// The time given to the code (with an injected clock).
    pub(crate) now: Option<u64>,
    pub(crate) permit: Permit,
    /// When its request stops waiting: it is put in no call after that, and is answered
    /// [`Timeout`](crate::store::StoreError::Timeout) then if its call has not answered.
    pub(crate) deadline: tokio::time::Instant,
    /// Its charges, and where its reply goes: answered once (a reply that comes after its
    /// request was answered gives back the slots it took, if any).
    pub(crate) answer: Answer,
    /// Sent again after the server answered that the code did not run (once at most).
    pub(crate) resent: bool,
}

impl Job {
    /// The check `waiting` waits on, at `now` (with an injected clock), answered by
    /// `deadline`.
    pub(crate) fn new(
        waiting: &Waiting,
        now: Option<u64>,
        permit: Permit,
        deadline: tokio::time::Instant,
    ) -> Self {
        Job {
            now,
            permit,
            deadline,
            answer: waiting.answer(),
            resent: false,
        }
    }

    /// Its charges.
    pub(crate) fn charges(&self) -> &[Prepared] {
        self.answer.charges()
    }
}

/// Commands outside the checks (loading the code, peeks, adjustments, `PING`, `PUBLISH`,
/// `CLUSTER SLOTS`), already written as RESP.
pub(crate) struct Command {
    pub(crate) bytes: Vec<u8>,
    /// The replies to read: `skip` first that are dropped, then `count` answered.
    pub(crate) skip: usize,
    pub(crate) count: usize,
    pub(crate) answer: oneshot::Sender<RedisResult<Vec<Value>>>,
}

/// What a connection sends: a check, batched with its neighbours, or commands.
pub(crate) enum Work {
    Check(Job),
    Command(Command),
}
