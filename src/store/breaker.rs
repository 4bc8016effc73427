//! The circuit breaker of a remote store: stop paying the time budget on every request while a
//! server is down.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::ConfigError;

/// When a Redis store stops asking a server that keeps failing, and for how long.
///
/// ```no_run
/// use std::time::Duration;
/// use tollgate::CircuitBreaker;
/// use tollgate::store::RedisStore;
///
/// // After 3 failures in a row, decide without Redis (by each rule's FailureMode) for 5 s,
/// // then let one request try it again.
/// let store = RedisStore::builder("redis://127.0.0.1:6379")
///     .circuit_breaker(CircuitBreaker::after_failures(3).cooldown(Duration::from_secs(5)))
///     .build()?;
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
///
/// The default opens after 5 consecutive failures (errors or time-outs) for 1 second. While it is
/// open, requests are decided at once by each rule's [`FailureMode`](crate::FailureMode), as if
/// the store had failed, without waiting for it. After the cooldown the store asks the server
/// itself (a `PING`, in a task of its own, within one check's time budget): no request waits
/// for the probe. A success closes the breaker (and is logged once), a failure opens it for
/// another cooldown. Only if no probe came for a whole cooldown more (the runtime that ran it
/// went away) does a request probe instead.
///
/// The standalone store has one breaker; the cluster store has one per node, so that a primary
/// that is down (or failing over) is not waited for while the other primaries answer as usual.
/// A check that started before its breaker opened cannot close it when it succeeds late.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CircuitBreaker {
    failures: u32,
    cooldown: Duration,
}

impl CircuitBreaker {
    /// The longest cooldown: one day. A server that is down longer is probed once a day.
    pub const MAX_COOLDOWN: Duration = Duration::from_secs(86_400);

    /// Opens after `failures` consecutive failures (default 5), for the default cooldown of 1 s.
    /// A failure is a call to the server that failed: a batch of checks that fails together
    /// (see [`max_batch`](crate::store::RedisStoreBuilder::max_batch)) counts once.
    pub const fn after_failures(failures: u32) -> Self {
        CircuitBreaker {
            failures,
            cooldown: Duration::from_secs(1),
        }
    }

    /// How long the breaker stays open before a probe (default 1 s; at most
    /// [`MAX_COOLDOWN`](CircuitBreaker::MAX_COOLDOWN): longer values are cut to it).
    pub const fn cooldown(mut self, cooldown: Duration) -> Self {
        self.cooldown = if cooldown.as_secs() >= Self::MAX_COOLDOWN.as_secs() {
            Self::MAX_COOLDOWN
        } else {
            cooldown
        };
        self
    }

    /// Never opens: every request asks the server and waits for its time budget.
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

/// A breaker's state, shared by every check of one server.
#[derive(Debug)]
pub(crate) struct Breaker {
    config: CircuitBreaker,
    origin: Instant,
    consecutive_failures: AtomicU32,
    /// When the last call failed (microseconds since `origin`), until a call succeeds; 0: none.
    /// A health check reads it for a cooldown (at least a second), then forgets it: with no
    /// traffic, nothing would ever clear it.
    failed_at: AtomicU64,
    /// Microseconds since `origin` until which the breaker is open; 0 when closed.
    open_until: AtomicU64,
    /// When the current probe started (microseconds since `origin`); 0 when none.
    probe_started: AtomicU64,
    /// Counts the times the breaker opened: a check reports only into the period it started in.
    epoch: AtomicU64,
    /// Serialises the changes of state (opening, closing), so that a success checked against
    /// an epoch cannot undo an opening that happened after the check.
    changing: Mutex<()>,
    /// The store's kind and the server, for the `tollgate_circuit_breaker_open` gauge and the
    /// log of a recovery.
    label: (&'static str, Arc<str>),
}

/// The right of one check to ask the server, and to report how it went.
#[derive(Clone, Copy, Debug)]
#[must_use]
pub(crate) struct Permit {
    epoch: u64,
}

impl Breaker {
    /// The breaker of `server` of a store of `kind`.
    pub(crate) fn new(config: CircuitBreaker, kind: &'static str, server: Arc<str>) -> Self {
        // The gauge exists, closed, from the start.
        #[cfg(feature = "metrics")]
        crate::telemetry::breaker(kind, &server, false);
        Breaker {
            label: (kind, server),
            config,
            origin: Instant::now(),
            consecutive_failures: AtomicU32::new(0),
            failed_at: AtomicU64::new(0),
            open_until: AtomicU64::new(0),
            probe_started: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
            changing: Mutex::new(()),
        }
    }

    fn now(&self) -> u64 {
        // Never 0, which means "not set".
        u64::try_from(self.origin.elapsed().as_micros())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    fn cooldown_micros(&self) -> u64 {
        u64::try_from(self.config.cooldown.as_micros())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// Whether a request's check would be refused now, without taking the probe's turn.
    pub(crate) fn is_open(&self) -> bool {
        let open_until = self.open_until.load(Ordering::Relaxed);
        open_until != 0 && {
            let now = self.now();
            now < open_until.saturating_add(self.cooldown_micros()) || {
                let started = self.probe_started.load(Ordering::Relaxed);
                started != 0 && now.saturating_sub(started) < self.cooldown_micros()
            }
        }
    }

    /// A permit for a request's check to ask the server, or `None` while the breaker is open.
    /// Closed: always, without reading a clock. Requests do not probe: the store's background
    /// probe does ([`admit_probe`](Self::admit_probe)), once per cooldown; only when it is a
    /// cooldown late (its runtime went away) does a request take its turn.
    pub(crate) fn admit(&self) -> Option<Permit> {
        self.admit_at(|| self.now(), self.cooldown_micros())
    }

    /// The background probe's permit, once the cooldown is over (one probe at a time).
    pub(crate) fn admit_probe(&self) -> Option<Permit> {
        self.admit_at(|| self.now(), 0)
    }

    /// The cooldown.
    pub(crate) fn cooldown(&self) -> Duration {
        self.config.cooldown
    }

    /// How long until the background probe may go; `None` when the breaker is closed.
    pub(crate) fn until_probe(&self) -> Option<Duration> {
        let open_until = self.open_until.load(Ordering::Relaxed);
        (open_until != 0).then(|| Duration::from_micros(open_until.saturating_sub(self.now())))
    }

    fn admit_at(&self, now: impl FnOnce() -> u64, slack: u64) -> Option<Permit> {
        let epoch = self.epoch.load(Ordering::Acquire);
        let open_until = self.open_until.load(Ordering::Relaxed);
        if open_until == 0 {
            return Some(Permit { epoch });
        }
        let now = now();
        if now < open_until.saturating_add(slack) {
            return None;
        }
        // Half open: one probe at a time; a probe that never reported (its request was dropped)
        // is replaced after a cooldown.
        let started = self.probe_started.load(Ordering::Relaxed);
        let turn = (started == 0 || now.saturating_sub(started) >= self.cooldown_micros())
            && self
                .probe_started
                .compare_exchange(started, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok();
        turn.then_some(Permit { epoch })
    }

    /// Whether the breaker is open, or the last call to the server failed (it did not answer)
    /// within the last cooldown (at least a second): for a health check.
    pub(crate) fn is_failing(&self) -> bool {
        let failed_at = self.failed_at.load(Ordering::Relaxed);
        self.is_open()
            || failed_at != 0
                && self.now().saturating_sub(failed_at) < self.cooldown_micros().max(1_000_000)
    }

    /// The server answered the check of `permit`. Closes the breaker, unless the check started
    /// before it last opened; the closing is logged once.
    pub(crate) fn success(&self, permit: Permit) {
        // Closed with no failure counted: the common case, without a lock.
        if self.consecutive_failures.load(Ordering::Relaxed) == 0
            && self.open_until.load(Ordering::Relaxed) == 0
            && self.failed_at.load(Ordering::Relaxed) == 0
        {
            return;
        }
        self.failed_at.store(0, Ordering::Relaxed);
        let _changing = self.changing.lock().unwrap_or_else(|p| p.into_inner());
        if permit.epoch != self.epoch.load(Ordering::Acquire) {
            return;
        }
        self.consecutive_failures.store(0, Ordering::Relaxed);
        let was_open = self.open_until.swap(0, Ordering::Relaxed) != 0;
        self.probe_started.store(0, Ordering::Relaxed);
        if was_open {
            #[cfg(feature = "metrics")]
            crate::telemetry::breaker(self.label.0, &self.label.1, false);
            tracing::info!(
                server = &*self.label.1,
                "tollgate: the store answers again; its circuit breaker closed"
            );
        }
    }

    /// The check of `permit` failed; true when this failure opened the breaker. A check that
    /// started before the breaker last opened is not counted.
    pub(crate) fn failure(&self, permit: Permit) -> bool {
        self.failure_at(permit, self.now())
    }

    fn failure_at(&self, permit: Permit, now: u64) -> bool {
        self.failed_at.store(now, Ordering::Relaxed);
        if self.config.failures == 0 || permit.epoch != self.epoch.load(Ordering::Acquire) {
            return false;
        }
        let failures = self
            .consecutive_failures
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        if failures < self.config.failures {
            return false;
        }
        let _changing = self.changing.lock().unwrap_or_else(|p| p.into_inner());
        if permit.epoch != self.epoch.load(Ordering::Acquire) {
            // Another failure of the same period opened it meanwhile.
            return false;
        }
        // Open (or, for a failed probe, open again): later reports of checks admitted before
        // this point belong to the old period.
        let was_open = self.open_until.swap(
            now.saturating_add(self.cooldown_micros()),
            Ordering::Relaxed,
        ) != 0;
        self.probe_started.store(0, Ordering::Relaxed);
        self.epoch.fetch_add(1, Ordering::AcqRel);
        #[cfg(feature = "metrics")]
        if !was_open {
            crate::telemetry::breaker(self.label.0, &self.label.1, true);
        }
        !was_open
    }
}

/// A store or a cluster node that goes away takes its breaker's state with it.
#[cfg(feature = "metrics")]
impl Drop for Breaker {
    fn drop(&mut self) {
        if self.open_until.load(Ordering::Relaxed) != 0 {
            crate::telemetry::breaker(self.label.0, &self.label.1, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Breaker {
        fn admit_at_probe(&self, now: impl FnOnce() -> u64) -> Option<Permit> {
            self.admit_at(now, 0)
        }
    }

    /// A breaker of `config` for a server of its own.
    fn breaker_of(config: CircuitBreaker) -> Breaker {
        Breaker::new(config, "test", Arc::from("server"))
    }

    #[test]
    fn requests_leave_the_probe_to_the_background_unless_it_is_late() {
        let breaker =
            breaker_of(CircuitBreaker::after_failures(1).cooldown(Duration::from_micros(1000)));
        let p = breaker.admit_at(|| 10, 1000).unwrap();
        assert!(breaker.failure_at(p, 10));
        // Cooldown over: the probe's turn, not a request's.
        assert!(breaker.admit_at(|| 1010, 1000).is_none());
        assert!(breaker.admit_at(|| 2009, 1000).is_none());
        // A cooldown later, no probe came: a request probes.
        assert!(breaker.admit_at(|| 2010, 1000).is_some());
    }

    #[test]
    fn opens_after_consecutive_failures_probes_after_the_cooldown_and_closes_on_success() {
        let breaker =
            breaker_of(CircuitBreaker::after_failures(3).cooldown(Duration::from_micros(1000)));
        let p = breaker.admit_at_probe(|| 10).unwrap();
        assert!(!breaker.failure_at(p, 10));
        assert!(!breaker.failure_at(p, 11));
        breaker.success(p); // a success in between starts the count again
        assert!(!breaker.failure_at(p, 12));
        assert!(!breaker.failure_at(p, 13));
        assert!(
            breaker.failure_at(p, 14),
            "the third failure in a row opens it"
        );
        assert!(breaker.admit_at_probe(|| 500).is_none());
        assert!(breaker.admit_at_probe(|| 1013).is_none());
        // Cooldown over: exactly one probe.
        let probe = breaker.admit_at_probe(|| 1014).unwrap();
        assert!(breaker.admit_at_probe(|| 1015).is_none());
        // The probe fails: open again for a cooldown.
        assert!(!breaker.failure_at(probe, 1020));
        assert!(breaker.admit_at_probe(|| 2019).is_none());
        let probe = breaker.admit_at_probe(|| 2020).unwrap();
        // This probe never reports (its request was dropped): another may go after a cooldown.
        assert!(breaker.admit_at_probe(|| 2500).is_none());
        let probe_again = breaker.admit_at_probe(|| 3020).unwrap();
        let _ = probe;
        breaker.success(probe_again);
        assert!(breaker.admit_at_probe(|| 3021).is_some());
        assert!(breaker.admit_at_probe(|| 3022).is_some());
    }

    #[test]
    fn a_check_that_started_before_the_breaker_opened_cannot_close_it() {
        let breaker =
            breaker_of(CircuitBreaker::after_failures(2).cooldown(Duration::from_micros(1000)));
        let early = breaker.admit_at_probe(|| 10).unwrap();
        let failing = breaker.admit_at_probe(|| 10).unwrap();
        assert!(!breaker.failure_at(failing, 11));
        assert!(breaker.failure_at(failing, 12));
        // The early check (say, on a healthy shard of the same server) answers late.
        breaker.success(early);
        assert!(breaker.admit_at_probe(|| 13).is_none(), "still open");
        assert!(!breaker.failure_at(early, 14), "nor do its failures count");
        assert!(breaker.admit_at_probe(|| 500).is_none());
    }

    #[test]
    fn a_disabled_breaker_never_opens() {
        let breaker = breaker_of(CircuitBreaker::disabled());
        for t in 1..100 {
            let p = breaker.admit_at_probe(|| t).unwrap();
            assert!(!breaker.failure_at(p, t));
        }
    }

    #[test]
    fn a_huge_cooldown_is_capped_and_never_overflows() {
        let config = CircuitBreaker::after_failures(1).cooldown(Duration::MAX);
        assert_eq!(
            config,
            CircuitBreaker::after_failures(1).cooldown(CircuitBreaker::MAX_COOLDOWN)
        );
        let breaker = breaker_of(config);
        let p = breaker.admit_at_probe(|| u64::MAX - 5).unwrap();
        assert!(breaker.failure_at(p, u64::MAX - 5));
        assert!(breaker.admit_at_probe(|| u64::MAX - 1).is_none());
        assert!(breaker.is_open());
    }
}
