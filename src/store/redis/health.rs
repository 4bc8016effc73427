//! When a connection is replaced: on an I/O error at once, and on a time-out only
//! when nothing has come back on it for a while. One time-out says little about a connection
//! that many checks share: a server that stalls for a moment (a fork, an fsync) times out every
//! check in flight, and replacing the connection then would only add reconnects to the stall. A
//! link that vanished without a reset (a cut cable, a dead proxy) answers nothing at all, so a
//! time-out after a long silence retires it. A connection the server closed (a restart, an idle
//! time-out, a failover) is retired the moment its stream ends, before a check is sent on it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// The shortest silence after which a time-out replaces a connection.
pub(crate) const MIN_SILENCE: Duration = Duration::from_secs(1);

/// The health of one connection, shared by every check that uses it.
#[derive(Debug)]
pub(crate) struct Health {
    broken: AtomicBool,
    origin: Instant,
    /// Microseconds after `origin` when it last answered (it counts as answering when opened).
    last_answer: AtomicU64,
    /// How long it may stay silent before a time-out replaces it.
    silence: u64,
}

impl Health {
    /// A new connection, replaced on a time-out after `3 × response_timeout` (at least a second)
    /// without an answer.
    pub(crate) fn new(response_timeout: Duration) -> Self {
        let silence = (response_timeout * 3).max(MIN_SILENCE);
        Health {
            broken: AtomicBool::new(false),
            origin: Instant::now(),
            last_answer: AtomicU64::new(0),
            silence: u64::try_from(silence.as_micros()).unwrap_or(u64::MAX),
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// The connection answered.
    pub(crate) fn answered(&self) {
        self.answered_at(self.now());
    }

    fn answered_at(&self, now: u64) {
        self.last_answer.fetch_max(now, Ordering::Relaxed);
    }

    /// A check on it ran out of time.
    pub(crate) fn timed_out(&self) {
        self.timed_out_at(self.now());
    }

    fn timed_out_at(&self, now: u64) {
        let silent_for = now.saturating_sub(self.last_answer.load(Ordering::Relaxed));
        if silent_for >= self.silence {
            self.broken.store(true, Ordering::Relaxed);
        }
    }

    /// Its stream failed (or it no longer talks to a primary): it must be replaced.
    pub(crate) fn broke(&self) {
        self.broken.store(true, Ordering::Relaxed);
    }

    /// Whether it must be replaced.
    pub(crate) fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_is_replaced_after_a_silence_not_after_a_stall() {
        let health = Health::new(Duration::from_millis(100)); // silence: 1 s
        // A stall of 200 ms times out many checks at once: kept.
        for _ in 0..50 {
            health.timed_out_at(200_000);
        }
        assert!(!health.is_broken());
        health.answered_at(300_000);
        health.timed_out_at(1_200_000);
        assert!(!health.is_broken(), "it answered 0.9 s ago");
        // Nothing back for a second: the link is gone.
        health.timed_out_at(1_300_000);
        assert!(health.is_broken());
        let health = Health::new(Duration::from_millis(100));
        health.broke();
        assert!(health.is_broken());
    }
}
