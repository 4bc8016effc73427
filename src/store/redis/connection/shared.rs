//! What a connection's handles and its driver share: the queue of work, the driver's waker, the
//! connection's health, and how the store it serves sends checks and hears how they went.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::Waker;

use super::job::{Job, Work};
use crate::store::StoreError;
use crate::store::breaker::Permit;
use crate::store::redis::health::Health;
use crate::store::redis::late_reply::GiveBackOrphan;
use crate::store::redis::script::{Program, ServerForm};

/// What a connection tells the store whose checks it sends.
pub(crate) trait Owner: Send + Sync + 'static {
    /// How a call of checks went, for the circuit breaker: the server answered (an error
    /// answer too: `answered`), or it did not in time, or the connection broke; `error` is
    /// the call's error, if it failed.
    fn report(&self, permit: Permit, answered: bool, error: Option<&StoreError>);

    /// What gives back the concurrency slots of a reply no request reads (it came after its
    /// request stopped waiting), made where the reply came; none when the store is gone.
    fn give_back(&self, now: Option<u64>) -> Option<GiveBackOrphan>;

    /// Queues `jobs`, never written, on another connection (theirs ended); the ones no
    /// connection took come back.
    fn retry(&self, jobs: Vec<Job>) -> Vec<Job>;
}

/// How a connection sends checks: the code, the form the server runs it in, the size of a
/// call, and the store to tell.
pub(crate) struct Checks {
    pub(crate) program: &'static Program,
    pub(crate) form: Arc<ServerForm>,
    /// The most checks in one call.
    pub(crate) max_batch: usize,
    /// The most calls of checks out at once: the checks that come meanwhile wait and go
    /// together in the next.
    pub(crate) max_calls: usize,
    /// How long past its checks' deadline the reply of a call that takes concurrency slots is
    /// waited for (a late reply gives them back).
    pub(crate) late_wait: std::time::Duration,
    pub(crate) owner: Weak<dyn Owner>,
}

/// The state of one connection that its handles and its driver share.
pub(crate) struct Shared {
    pub(crate) queue: Mutex<Queue>,
    pub(crate) health: Health,
    /// The handles alive: with none left, the driver ends once nothing it sent is owed (see
    /// the driver's `finished`).
    pub(crate) handles: AtomicUsize,
    /// The driver ended (the stream failed or closed): nothing is queued any more.
    pub(crate) ended: AtomicBool,
    /// Whether the connection sends checks (it was given their settings).
    pub(crate) takes_checks: bool,
    /// Checks in the queue: how far the connection is behind.
    pub(crate) queued: AtomicUsize,
    /// The server's URL without its password, for errors.
    pub(crate) server: Arc<str>,
    /// The database the connection selected.
    pub(crate) db: i64,
}

/// Work waiting for the driver.
#[derive(Default)]
pub(crate) struct Queue {
    pub(crate) work: VecDeque<Work>,
    /// The driver's waker, while it waits for work.
    pub(crate) waker: Option<Waker>,
    /// Whether a new check wakes it (no call of checks is out); a command always does.
    pub(crate) wants_checks: bool,
    /// Commands in `work`.
    pub(crate) commands: usize,
    /// With calls out and room for another, the checks queued that wake it (0: none do).
    pub(crate) wake_at: usize,
}

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `work` for the driver; gives it back when the connection has ended.
    pub(crate) fn push(&self, work: Work) -> Result<(), Work> {
        let mut queue = self.lock();
        if self.ended.load(Ordering::Acquire) {
            return Err(work);
        }
        let wake = match work {
            Work::Check(_) => {
                let queued = self.queued.fetch_add(1, Ordering::Relaxed) + 1;
                queue.wants_checks || queue.wake_at > 0 && queued >= queue.wake_at
            }
            Work::Command(_) => {
                queue.commands += 1;
                true
            }
        };
        queue.work.push_back(work);
        let waker = if wake { queue.waker.take() } else { None };
        drop(queue);
        if let Some(waker) = waker {
            waker.wake();
        }
        Ok(())
    }

    /// Queues `jobs` first (checks sent again after the code was loaded); gives them back when
    /// the connection has ended.
    pub(crate) fn push_front(&self, jobs: Vec<Job>) -> Result<(), Vec<Job>> {
        let mut queue = self.lock();
        if self.ended.load(Ordering::Acquire) {
            return Err(jobs);
        }
        self.queued.fetch_add(jobs.len(), Ordering::Relaxed);
        for job in jobs.into_iter().rev() {
            queue.work.push_front(Work::Check(job));
        }
        let waker = queue.waker.take();
        drop(queue);
        if let Some(waker) = waker {
            waker.wake();
        }
        Ok(())
    }

    /// Counts `n` checks taken out of the queue.
    pub(crate) fn took(&self, n: usize) {
        if n > 0 {
            self.queued.fetch_sub(n, Ordering::Relaxed);
        }
    }

    /// Wakes the driver (a handle went away).
    pub(crate) fn wake(&self) {
        let waker = self.lock().waker.take();
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}
