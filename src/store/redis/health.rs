//! When a multiplexed connection is replaced: on an I/O error at once, and after several time-outs
//! in a row. One time-out says little about a connection that many checks share: a server that
//! stalls for a moment (a fork, an fsync) times out every check in flight, and replacing the
//! connection then would only add reconnects to the stall. A link that vanished without a reset
//! (a cut cable, a dead proxy) times out every check, so a few in a row retire it.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

/// Time-outs in a row after which a connection is replaced.
pub(crate) const TIMEOUTS_BEFORE_REPLACING: u32 = 3;

/// The health of one multiplexed connection, shared by every check that uses it.
#[derive(Debug, Default)]
pub(crate) struct Health {
    broken: AtomicBool,
    timeouts_in_a_row: AtomicU32,
}

impl Health {
    /// The connection answered.
    pub(crate) fn answered(&self) {
        if self.timeouts_in_a_row.load(Ordering::Relaxed) != 0 {
            self.timeouts_in_a_row.store(0, Ordering::Relaxed);
        }
    }

    /// A check on it ran out of time.
    pub(crate) fn timed_out(&self) {
        let in_a_row = self.timeouts_in_a_row.fetch_add(1, Ordering::Relaxed) + 1;
        if in_a_row >= TIMEOUTS_BEFORE_REPLACING {
            self.broken.store(true, Ordering::Relaxed);
        }
    }

    /// Its stream failed: it must be replaced.
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
    fn a_connection_is_replaced_after_time_outs_in_a_row_only() {
        let health = Health::default();
        health.timed_out();
        health.timed_out();
        health.answered();
        health.timed_out();
        health.timed_out();
        assert!(!health.is_broken(), "an answer between time-outs keeps it");
        health.timed_out();
        assert!(health.is_broken());
        let health = Health::default();
        health.broke();
        assert!(health.is_broken());
    }
}
