//! Where the memory store gets the time.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::clock::{Clock, ManualClock};
//!
//! let clock = ManualClock::new(1_000_000);
//! let start = clock.now_micros();
//! clock.advance(Duration::from_millis(1500));
//! assert_eq!(clock.now_micros() - start, 1_500_000);
//! ```
//!
//! Time is counted in microseconds since the Unix epoch, the unit of Redis `TIME`, so that windows
//! line up across the memory and Redis stores. The Redis store never uses a [`Clock`]: it reads
//! the server's `TIME` inside its script, so every replica agrees.

/// Wall-clock microseconds since the Unix epoch (0 if the clock is before it): the time of log
/// throttling and of Unix-time header values, never of a decision.
pub(crate) fn unix_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// The months' English abbreviations, as HTTP dates and access logs write them.
pub(crate) const MONTHS: [&str; 12] = [
    "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
];

/// Seconds since the Unix epoch of a UTC date and time of the proleptic Gregorian calendar
/// (Howard Hinnant's `days_from_civil`): none for a date that does not exist (30 February), a
/// time outside 00:00:00 to 23:59:60, or a year outside 1970 to 9999.
pub(crate) fn unix_seconds(
    year: u64,
    month: u64,
    day: u64,
    hour: u64,
    minute: u64,
    second: u64,
) -> Option<u64> {
    let leap = year.is_multiple_of(4) && (!year.is_multiple_of(100) || year.is_multiple_of(400));
    let days_in_month = match month {
        2 if leap => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        1..=12 => 31,
        _ => return None,
    };
    if !(1970..=9999).contains(&year)
        || !(1..=days_in_month).contains(&day)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    // Years from March, so that the leap day ends the year.
    let (y, m) = if month <= 2 {
        (year - 1, month + 9)
    } else {
        (year, month - 3)
    };
    let era = y / 400;
    let year_of_era = y - era * 400;
    let day_of_year = (153 * m + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    let days = era * 146_097 + day_of_era - 719_468;
    Some(days * 86_400 + hour * 3_600 + minute * 60 + second)
}

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A source of time in microseconds since the Unix epoch.
pub trait Clock: Send + Sync + 'static {
    /// The current time.
    fn now_micros(&self) -> u64;
}

/// Wall-clock time that never steps backwards: the wall time when it was created plus the
/// monotonic time elapsed since, read from the CPU's time-stamp counter where it is reliable
/// (through `quanta`, which falls back to the OS monotonic clock elsewhere). Created once per
/// store, never per request.
#[derive(Clone, Debug)]
pub struct SystemClock {
    clock: quanta::Clock,
    origin_raw: u64,
    origin_micros: u64,
}

impl SystemClock {
    /// Reads the wall clock once.
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        let origin_raw = clock.raw();
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        SystemClock {
            clock,
            origin_raw,
            origin_micros: since_epoch.as_micros() as u64,
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    #[inline]
    fn now_micros(&self) -> u64 {
        // `delta_as_nanos` is 0, never negative, if another core's counter reads behind.
        let elapsed_nanos = self.clock.delta_as_nanos(self.origin_raw, self.clock.raw());
        self.origin_micros + elapsed_nanos / 1_000
    }
}

/// A clock that only moves when told to: for tests and simulations. Clones share the time.
#[derive(Clone, Debug)]
pub struct ManualClock {
    micros: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock showing `micros` microseconds since the Unix epoch.
    pub fn new(micros: u64) -> Self {
        ManualClock {
            micros: Arc::new(AtomicU64::new(micros)),
        }
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        self.micros
            .fetch_add(by.as_micros() as u64, Ordering::SeqCst);
    }

    /// Sets the clock to `micros` microseconds since the Unix epoch.
    pub fn set(&self, micros: u64) {
        self.micros.store(micros, Ordering::SeqCst);
    }
}

impl Default for ManualClock {
    /// Starts at 2024-01-01T00:00:00Z.
    fn default() -> Self {
        ManualClock::new(1_704_067_200 * 1_000_000)
    }
}

impl Clock for ManualClock {
    fn now_micros(&self) -> u64 {
        self.micros.load(Ordering::SeqCst)
    }
}
