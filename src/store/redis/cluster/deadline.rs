//! [`Deadline`]: when a call gives up, on its answer and on sending anything more.

use tokio::time::Instant;

/// When a call gives up: `late` for its answer; `budget`, the check's own time, for sending
/// anything (a first call, a redirection, a second phase) and for the breaker (an answer after
/// it is a time-out). The same for every call but those that take concurrency slots.
#[derive(Clone, Copy, Debug)]
pub(super) struct Deadline {
    pub(super) budget: Instant,
    pub(super) late: Instant,
}

impl From<Instant> for Deadline {
    fn from(at: Instant) -> Self {
        Deadline {
            budget: at,
            late: at,
        }
    }
}
