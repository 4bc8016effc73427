//! The circuit breaker: stop paying the store's timeout on every request while it is down.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::ConfigError;

/// When to stop asking a failing store, and for how long.
///
/// ```
/// use std::time::Duration;
/// use tollgate::policy::CircuitBreaker;
/// use tollgate::{Quota, RateLimitLayer, Rule};
///
/// // After 3 failures in a row, decide without the store (by the layer's FailureMode) for 5 s,
/// // then let one request try the store again.
/// let layer = RateLimitLayer::builder()
///     .rule(Rule::new("api", Quota::per_minute(100)))
///     .circuit_breaker(CircuitBreaker::after_failures(3).cooldown(Duration::from_secs(5)))
///     .build()?;
/// # let _ = layer;
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
///
/// The default opens after 5 consecutive failures (errors or timeouts) for 1 second. While it is
/// open, requests are decided at once by the layer's [`FailureMode`](super::FailureMode), as if
/// the store had failed, without waiting for it. After the cooldown one request (the probe) asks
/// the store again: a success closes the breaker, a failure opens it for another cooldown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CircuitBreaker {
    failures: u32,
    cooldown: Duration,
}

impl CircuitBreaker {
    /// Opens after `failures` consecutive failures (default 5), for the default cooldown of 1 s.
    pub const fn after_failures(failures: u32) -> Self {
        CircuitBreaker {
            failures,
            cooldown: Duration::from_secs(1),
        }
    }

    /// How long the breaker stays open before a probe (default 1 s).
    pub const fn cooldown(mut self, cooldown: Duration) -> Self {
        self.cooldown = cooldown;
        self
    }

    /// Never opens: every request asks the store and waits for its time budget.
    pub const fn disabled() -> Self {
        CircuitBreaker {
            failures: 0,
            cooldown: Duration::ZERO,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.failures > 0 && self.cooldown.is_zero() {
            return Err(ConfigError::new(
                "circuit breaker: the cooldown is 0; use a positive duration, or CircuitBreaker::disabled()",
            ));
        }
        Ok(())
    }
}

impl Default for CircuitBreaker {
    fn default() -> Self {
        CircuitBreaker::after_failures(5)
    }
}

/// The breaker's state, shared by every service of a layer.
#[derive(Debug)]
pub(crate) struct Breaker {
    config: CircuitBreaker,
    origin: Instant,
    consecutive_failures: AtomicU32,
    /// Microseconds since `origin` until which the breaker is open; 0 when closed.
    open_until: AtomicU64,
    /// When the current probe started (microseconds since `origin`); 0 when none.
    probe_started: AtomicU64,
}

impl Breaker {
    pub(crate) fn new(config: CircuitBreaker) -> Self {
        Breaker {
            config,
            origin: Instant::now(),
            consecutive_failures: AtomicU32::new(0),
            open_until: AtomicU64::new(0),
            probe_started: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        // Never 0, which means "not set".
        (self.origin.elapsed().as_micros() as u64).max(1)
    }

    fn cooldown_micros(&self) -> u64 {
        (self.config.cooldown.as_micros() as u64).max(1)
    }

    /// Whether this request may ask the store. Closed: always, without reading a clock.
    pub(crate) fn admits(&self) -> bool {
        self.admits_at(|| self.now())
    }

    fn admits_at(&self, now: impl FnOnce() -> u64) -> bool {
        let open_until = self.open_until.load(Ordering::Relaxed);
        if open_until == 0 {
            return true;
        }
        let now = now();
        if now < open_until {
            return false;
        }
        // Half open: one probe at a time; a probe that never reported (its request was dropped)
        // is replaced after a cooldown.
        let started = self.probe_started.load(Ordering::Relaxed);
        (started == 0 || now.saturating_sub(started) >= self.cooldown_micros())
            && self
                .probe_started
                .compare_exchange(started, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// The store answered.
    pub(crate) fn success(&self) {
        if self.consecutive_failures.load(Ordering::Relaxed) != 0
            || self.open_until.load(Ordering::Relaxed) != 0
        {
            self.consecutive_failures.store(0, Ordering::Relaxed);
            self.open_until.store(0, Ordering::Relaxed);
            self.probe_started.store(0, Ordering::Relaxed);
        }
    }

    /// The store failed; true when this failure opened the breaker.
    pub(crate) fn failure(&self) -> bool {
        self.failure_at(self.now())
    }

    fn failure_at(&self, now: u64) -> bool {
        if self.config.failures == 0 {
            return false;
        }
        let failures = self
            .consecutive_failures
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        if failures < self.config.failures {
            return false;
        }
        let was_open = self
            .open_until
            .swap(now + self.cooldown_micros(), Ordering::Relaxed)
            != 0;
        self.probe_started.store(0, Ordering::Relaxed);
        !was_open
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_consecutive_failures_probes_after_the_cooldown_and_closes_on_success() {
        let breaker =
            Breaker::new(CircuitBreaker::after_failures(3).cooldown(Duration::from_micros(1000)));
        assert!(breaker.admits_at(|| 10));
        assert!(!breaker.failure_at(10));
        assert!(!breaker.failure_at(11));
        breaker.success(); // a success in between starts the count again
        assert!(!breaker.failure_at(12));
        assert!(!breaker.failure_at(13));
        assert!(
            breaker.failure_at(14),
            "the third failure in a row opens it"
        );
        assert!(!breaker.admits_at(|| 500));
        assert!(!breaker.admits_at(|| 1013));
        // Cooldown over: exactly one probe.
        assert!(breaker.admits_at(|| 1014));
        assert!(!breaker.admits_at(|| 1015));
        // The probe fails: open again for a cooldown.
        assert!(!breaker.failure_at(1020));
        assert!(!breaker.admits_at(|| 2019));
        assert!(breaker.admits_at(|| 2020));
        // This probe never reports (its request was dropped): another may go after a cooldown.
        assert!(!breaker.admits_at(|| 2500));
        assert!(breaker.admits_at(|| 3020));
        breaker.success();
        assert!(breaker.admits_at(|| 3021));
        assert!(breaker.admits_at(|| 3022));
    }

    #[test]
    fn a_disabled_breaker_never_opens() {
        let breaker = Breaker::new(CircuitBreaker::disabled());
        for t in 1..100 {
            assert!(!breaker.failure_at(t));
            assert!(breaker.admits_at(|| t));
        }
    }
}
