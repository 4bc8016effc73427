//! [`Job`]: one check waiting for its batch.

use crate::store::breaker::Permit;
use crate::store::redis::remote::Answer;
use crate::store::redis::script::Prepared;

/// One check waiting for its batch.
pub(super) struct Job {
    pub(super) charges: Vec<Prepared>,
    pub(super) now: Option<u64>,
    pub(super) permit: Permit,
    /// When its caller stops waiting: it is not sent after that, and its call ends by then.
    pub(super) deadline: tokio::time::Instant,
    pub(super) answer: Answer,
}
