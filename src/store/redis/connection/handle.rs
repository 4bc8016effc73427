//! [`Connection`]: a handle to one open connection, to queue checks and send commands.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use redis::aio::ConnectionLike;
use redis::{Cmd, RedisFuture, RedisResult, Value};
use tokio::sync::oneshot;

use super::job::{Command, Job, Work};
use super::shared::Shared;
use super::stream;
use crate::store::redis::health::Health;

/// A handle to one open connection; clones share it. The connection's task ends when the
/// stream fails or closes, or when no handle is left and nothing it sent is still owed (a call
/// that timed out is waited for a while longer only when it takes concurrency slots).
pub(crate) struct Connection {
    shared: Arc<Shared>,
}

impl Connection {
    /// The first handle of the connection of `shared`.
    pub(super) fn from_shared(shared: Arc<Shared>) -> Connection {
        Connection { shared }
    }

    /// Another handle to the connection of `shared`.
    pub(super) fn handle(shared: &Arc<Shared>) -> Connection {
        shared.handles.fetch_add(1, Ordering::Relaxed);
        Connection {
            shared: shared.clone(),
        }
    }

    /// The connection's health: whether it must be replaced.
    pub(crate) fn health(&self) -> &Health {
        &self.shared.health
    }

    /// Whether it must be replaced: its stream ended, or its health says so.
    pub(crate) fn is_broken(&self) -> bool {
        self.shared.ended.load(Ordering::Acquire) || self.shared.health.is_broken()
    }

    /// The checks queued, not yet sent.
    pub(crate) fn queued(&self) -> usize {
        self.shared.queued.load(Ordering::Relaxed)
    }

    /// Queues `job` for the next call of checks; gives it back when the connection has ended
    /// (or sends no checks).
    pub(crate) fn check(&self, job: Job) -> Result<(), Job> {
        if !self.shared.takes_checks {
            return Err(job);
        }
        self.shared
            .push(Work::Check(job))
            .map_err(|work| match work {
                Work::Check(job) => job,
                Work::Command(_) => unreachable!("a check was pushed"),
            })
    }

    /// Sends `bytes` (commands written as RESP) and reads `skip + count` replies; the last
    /// `count`, as redis-rs reads them (an error answer is a `Value::ServerError`).
    pub(crate) async fn send(
        &self,
        bytes: Vec<u8>,
        skip: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        if skip + count == 0 {
            return Ok(Vec::new());
        }
        let (answer, answered) = oneshot::channel();
        let command = Command {
            bytes,
            skip,
            count,
            answer,
        };
        if self.shared.push(Work::Command(command)).is_err() {
            return Err(stream::closed());
        }
        answered.await.unwrap_or_else(|_| Err(stream::closed()))
    }
}

impl Clone for Connection {
    fn clone(&self) -> Self {
        Connection::handle(&self.shared)
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if self.shared.handles.fetch_sub(1, Ordering::AcqRel) == 1 {
            // The last handle: the task may end.
            self.shared.wake();
        }
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let mut values = self.send(cmd.get_packed_command(), 0, 1).await?;
            values.pop().ok_or_else(stream::malformed)
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            self.send(pipeline.get_packed_pipeline(), offset, count)
                .await
        })
    }

    fn get_db(&self) -> i64 {
        self.shared.db
    }
}
