//! A check: queued on a connection, which sends it with the checks queued beside it in one
//! call, and answers it by its deadline.

use std::sync::Arc;

use super::Standalone;
use crate::store::StoreError;
use crate::store::redis::connection::Job;
use crate::store::redis::late_reply::{self, Waiting};
use crate::store::redis::remote::Sent;

impl Standalone {
    /// Sends one check: queued for the next call of the first connection that keeps up (sent at
    /// once when none of its calls is out), answered within the check's time budget. When no
    /// connection works, one is opened first. Called on a Tokio runtime.
    pub(super) fn queue(self: &Arc<Self>, mut waiting: Waiting, now: Option<u64>) -> Sent {
        let Some(permit) = self.breaker.admit() else {
            return Sent::Deciding(Box::pin(std::future::ready(Err(StoreError::CircuitOpen))));
        };
        let deadline = tokio::time::Instant::now() + self.parts.settings.response_timeout;
        let mut job = Job::new(&waiting, now, permit, deadline);
        if let Some(conn) = self.pick() {
            match conn.check(job) {
                Ok(()) => return Sent::Queued(waiting),
                Err(back) => job = back,
            }
        }
        let me = self.clone();
        Sent::Deciding(Box::pin(async move {
            me.queue_on_new(job).await?;
            std::future::poll_fn(|cx| late_reply::received(&mut waiting, cx)).await
        }))
    }

    /// Queues `job` on a connection when the pool had none that works: one opened now (a
    /// refusal or a time-out is the check's failure, which the breaker hears), or one opened
    /// meanwhile.
    async fn queue_on_new(&self, mut job: Job) -> Result<(), StoreError> {
        let (deadline, permit) = (job.deadline, job.permit);
        for _ in 0..=self.pool_size {
            let conn = match self.pick() {
                Some(conn) => conn,
                None => {
                    let opened = tokio::time::timeout_at(deadline, self.open())
                        .await
                        .unwrap_or(Err(StoreError::Timeout));
                    match opened {
                        Ok(conn) => conn,
                        Err(error) => {
                            self.report(permit, false, Some(&error));
                            return Err(error);
                        }
                    }
                }
            };
            match conn.check(job) {
                Ok(()) => return Ok(()),
                // It ended as the check was queued: the next.
                Err(back) => job = back,
            }
        }
        Err(StoreError::Unavailable(
            format!(
                "{}: every connection closed as the check was sent",
                self.server
            )
            .into(),
        ))
    }
}
