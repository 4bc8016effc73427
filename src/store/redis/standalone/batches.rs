//! Checks sent together: each waits for its batch's call (sent at once when no call is out), and
//! a call that takes concurrency slots waits longer for its reply than its checks do.

use std::sync::Arc;

use super::Standalone;
use super::job::Job;
use crate::store::StoreError;
use crate::store::breaker::Permit;
use crate::store::redis::batch::Turn;
use crate::store::redis::remote::{self};
use crate::store::redis::script::{self, Mode, Prepared, Reply, Request};
use crate::store::redis::settings::late_reply_wait;

/// Sends `batch`, then whatever queued meanwhile, until the queue is empty. A check whose caller
/// went away (its client left) or has no time left is not sent.
pub(super) async fn send_batches(inner: Arc<Standalone>, mut batch: Vec<Job>, mut turn: Turn<Job>) {
    loop {
        let now = tokio::time::Instant::now();
        batch.retain(|job| !job.answer.is_closed() && job.deadline > now);
        if !batch.is_empty() {
            inner.send(batch).await;
        }
        match turn.next() {
            Some(next) => batch = next,
            None => return,
        }
    }
}

impl Standalone {
    /// Decides one check: queued for the next call to Redis (sent at once when no call is
    /// out), within the check's time budget. Polled on a Tokio runtime.
    pub(super) async fn batched(
        self: &Arc<Self>,
        charges: Vec<Prepared>,
        now: Option<u64>,
        permit: Permit,
    ) -> Result<Reply, StoreError> {
        let (answer, answered) = remote::channel(now);
        let deadline = tokio::time::Instant::now() + self.parts.settings.response_timeout;
        let job = Job {
            charges,
            now,
            permit,
            deadline,
            answer,
        };
        if let Some((batch, turn)) = self.batcher.push(job) {
            // Sent from a task of its own, so that a client that goes away cancels no one
            // else's check of the batch.
            drop(tokio::spawn(send_batches(self.clone(), batch, turn)));
        }
        remote::wait(answered, deadline, || {
            StoreError::Unavailable(
                format!("{}: the check was dropped before it was sent", self.server).into(),
            )
        })
        .await
    }

    /// One call for `batch`, within the time its earliest check has left; each check gets its
    /// own reply, or the call's error. A call that takes concurrency slots waits a while longer
    /// for its reply than its checks do (on its own, so that the next batch need not wait), and
    /// a reply whose check stopped waiting gives those slots back.
    pub(super) async fn send(self: &Arc<Self>, batch: Vec<Job>) {
        let Some(budget) = batch.iter().map(|job| job.deadline).min() else {
            return;
        };
        let late = if batch
            .iter()
            .any(|job| job.charges.iter().any(|c| c.algorithm.is_concurrency()))
        {
            budget.max(
                tokio::time::Instant::now() + late_reply_wait(self.parts.settings.response_timeout),
            )
        } else {
            budget
        };
        let call = Self::call_batch(self.clone(), batch, budget, late);
        if late == budget {
            return call.await;
        }
        let mut call = Box::pin(call);
        if tokio::time::timeout_at(budget, &mut call).await.is_err() {
            // The next batch goes on; this call's replies, or its slots, come back later (a
            // batch is sent by a task of its own, on the runtime).
            drop(tokio::spawn(call));
        }
    }

    /// [`send`](Self::send)'s call: the answer is waited for until `late`, and reported to the
    /// breaker as a time-out when it comes after `budget`.
    pub(super) async fn call_batch(
        self: Arc<Self>,
        batch: Vec<Job>,
        budget: tokio::time::Instant,
        late: tokio::time::Instant,
    ) {
        let Some(permit) = batch.last().map(|job| job.permit) else {
            return;
        };
        let requests: Vec<Request<'_, Prepared>> = batch
            .iter()
            .map(|job| Request {
                now: job.now,
                charges: &job.charges,
            })
            .collect();
        let result = self
            .run_until(Mode::Charge, &requests, permit, budget, late)
            .await
            .and_then(|value| script::decode(value, &requests));
        drop(requests);
        match result {
            Ok(replies) => {
                for (job, reply) in batch.into_iter().zip(replies) {
                    job.answer.send(&self, Ok(reply), job.charges);
                }
            }
            Err(error) => {
                for job in batch {
                    job.answer.send(&self, Err(error.duplicate()), job.charges);
                }
            }
        }
    }
}
