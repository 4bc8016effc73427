//! Log throttling: a hint given once, or at most once per period, so that a condition that
//! comes back (a store outage) does not flood the log.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// A hint given the first time only.
#[derive(Debug, Default)]
pub(crate) struct Once(AtomicBool);

impl Once {
    pub(crate) const fn new() -> Self {
        Once(AtomicBool::new(false))
    }

    /// Whether the hint was given already (a cheap check before looking for its condition).
    pub(crate) fn done(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// True exactly once, for the first caller.
    pub(crate) fn first(&self) -> bool {
        !self.0.load(Ordering::Relaxed) && !self.0.swap(true, Ordering::Relaxed)
    }
}

/// A hint given at most once per period, for conditions that come back (a store outage).
#[derive(Debug, Default)]
pub(crate) struct Every {
    last_micros: AtomicU64,
}

impl Every {
    pub(crate) const fn new() -> Self {
        Every {
            last_micros: AtomicU64::new(0),
        }
    }

    /// True for one caller when `period_micros` passed since the last true (and the first time).
    pub(crate) fn due(&self, now_micros: u64, period_micros: u64) -> bool {
        let last = self.last_micros.load(Ordering::Relaxed);
        (last == 0 || now_micros.saturating_sub(last) >= period_micros)
            && self
                .last_micros
                .compare_exchange(
                    last,
                    now_micros.max(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
    }
}

/// Says when concurrency slots could not be given back (at most once every 10 s: an outage
/// would say it for every request): they are free when their hold expires.
pub(crate) fn report_give_back(result: Result<(), crate::error::StoreError>) {
    static WARNED: Every = Every::new();
    if let Err(error) = result
        && WARNED.due(crate::clock::unix_micros(), 10_000_000)
    {
        tracing::warn!(%error, "tollgate: could not give concurrency slots back; they are free when their hold expires (said at most every 10 s)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn once_is_true_once_and_every_once_per_period() {
        let once = Once::new();
        assert!(once.first());
        assert!(!once.first());
        let every = Every::default();
        assert!(every.due(1_000, 60));
        assert!(!every.due(1_030, 60));
        assert!(every.due(1_060, 60));
        assert!(!every.due(1_061, 60));
    }
}
