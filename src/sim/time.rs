//! [`SimTime`]: the simulation's clock — the runtime's paused time, as microseconds since the
//! Unix epoch from a start the seed chooses; the servers read it as `TIME`, each replica with
//! its own skew ([`Skewed`]).

use std::sync::Arc;

use tokio::time::Instant;

use crate::clock::Clock;

/// The servers' clock: the runtime's time since `origin`, from `epoch` (microseconds).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SimTime {
    origin: Instant,
    epoch: u64,
}

impl SimTime {
    /// A clock that reads `epoch` now.
    pub(crate) fn starting_at(epoch: u64) -> SimTime {
        SimTime {
            origin: Instant::now(),
            epoch,
        }
    }

    /// Microseconds since the Unix epoch, on the servers' clock.
    pub(crate) fn now(&self) -> u64 {
        self.epoch + u64::try_from(self.origin.elapsed().as_micros()).unwrap_or(u64::MAX)
    }
}

/// A replica's clock: the servers' clock off by a skew (microseconds, either way).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Skewed {
    pub(crate) time: SimTime,
    pub(crate) skew: i64,
}

impl Clock for Skewed {
    fn now_micros(&self) -> u64 {
        self.time.now().saturating_add_signed(self.skew)
    }
}

/// A shared clock, as a [`Clock`] (the memory store takes one by value).
pub(crate) struct SharedClock(pub(crate) Arc<dyn Clock>);

impl Clock for SharedClock {
    fn now_micros(&self) -> u64 {
        self.0.now_micros()
    }
}
