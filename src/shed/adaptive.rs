//! [`Adaptive`]: a load shedder's capacity learned from measured latency — a gradient
//! controller over a no-load latency measured again at intervals (Envoy's adaptive concurrency
//! filter).
//!
//! ```
//! use tollgate::{Adaptive, Shedding};
//!
//! // Never more than 256 in flight; below that, as many as keep latency near its no-load level.
//! let shedding = Shedding::new(256).adaptive(Adaptive::new().min(8));
//! assert_eq!(shedding.capacity_now(), 8); // until the first measurement
//! ```

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use crate::ConfigError;

/// The longest a measurement of the no-load latency lasts from its first request: past it, the
/// samples taken decide.
const LONGEST_PROBE: Duration = Duration::from_secs(1);

/// A request's latency counts at most this many times the no-load latency.
const MAX_SAMPLE_TIMES: u64 = 10;

/// The bits of a window's count, and the most its sum of microseconds holds.
const COUNT_BITS: u32 = 20;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;
const MAX_WINDOW_SUM: u64 = (1 << (64 - COUNT_BITS)) - 1;

/// How a [`Shedding`](super::Shedding) learns its capacity: the settings of its controller.
///
/// Every [`update_every`](Self::update_every) (100 ms), the controller compares the mean
/// latency of the requests that ended meanwhile (`sample`) with the no-load latency (`base`):
///
/// ```text
/// gradient  = clamp(base × (1 + tolerance) / sample, 0.5, 2)
/// capacity' = clamp(gradient × capacity + √(gradient × capacity), min, max)
/// ```
///
/// While latency stays within the tolerance of its no-load level (25 %), the capacity grows
/// (by its square root at least: the queue a backend can take without waiting); when requests
/// queue and latency rises, it falls in proportion. A backend of `W` workers each taking `s`
/// settles near `1.25 W + √(1.25 W)` in flight, and latency near `1.25 s` to `1.5 s`: every
/// worker busy, a short queue. The capacity grows only while at least half of it is in use, so
/// that a quiet hour does not leave it at its maximum.
///
/// **The no-load latency** is measured at the start (the warm-up: the capacity is `min` until
/// then) and again every [`base_every`](Self::base_every) (30 s): for
/// [`probe_requests`](Self::probe_requests) requests (50, within a second of the first at
/// most) the capacity is held at `min`, and the mean latency of the requests let in meanwhile
/// is the new base. Only requests the inner service answered are measured (not those the
/// layer refused, nor those whose client left first), and a request counts at most ten times
/// the base (ten times the median, in a measurement), so that a slow reader or a stream does
/// not stand for a queue.
/// Measuring it again keeps the base from creeping up under lasting load (a base read from
/// queued requests would let the queue grow), and lets it follow a backend whose own latency
/// changed (a slower dependency). Each measurement holds `low` and `normal` requests at `min`
/// for as long as the requests in flight take to drain, then up to a second: a few percent of
/// the time where requests are slow. The gauges have no label: give one process one adaptive
/// `Shedding` (clones share it).
///
/// **Bounds**: the capacity stays between `min` (default 4; at least 2) and the `Shedding`'s
/// capacity, its maximum. The priority shares apply to the learned capacity (`low` up to 50 %,
/// `normal` up to 80 %); `critical` requests are bounded by the maximum only: they are shed
/// only when the maximum is in flight, whatever was learned.
///
/// Latency is measured from when a request is let in until its response body ends (or is
/// dropped): a stream is one long request. Give long-lived routes a layer of their own, or no
/// adaptive shedding.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adaptive {
    min: usize,
    tolerance_percent: u32,
    update_every: Duration,
    base_every: Duration,
    probe_requests: usize,
}

impl Default for Adaptive {
    fn default() -> Self {
        Self::new()
    }
}

impl Adaptive {
    /// The defaults: at least 4 in flight, a tolerance of 25 %, an update every 100 ms, the
    /// no-load latency measured every 30 s over 50 requests.
    pub const fn new() -> Self {
        Adaptive {
            min: 4,
            tolerance_percent: 25,
            update_every: Duration::from_millis(100),
            base_every: Duration::from_secs(30),
            probe_requests: 50,
        }
    }

    /// The least capacity (default 4, at least 2): where the controller starts, and what it
    /// holds while it measures the no-load latency.
    pub const fn min(mut self, min: usize) -> Self {
        self.min = min;
        self
    }

    /// How far above its no-load level latency may rise before the capacity falls, in percent
    /// (default 25; 1 to 1,000).
    pub const fn tolerance(mut self, percent: u32) -> Self {
        self.tolerance_percent = percent;
        self
    }

    /// How often the capacity is updated (default 100 ms; 10 ms to 10 s).
    pub const fn update_every(mut self, every: Duration) -> Self {
        self.update_every = every;
        self
    }

    /// How often the no-load latency is measured again (default 30 s; at least a second).
    pub const fn base_every(mut self, every: Duration) -> Self {
        self.base_every = every;
        self
    }

    /// How many requests a measurement of the no-load latency takes (default 50; 5 to 1,000).
    pub const fn probe_requests(mut self, requests: usize) -> Self {
        self.probe_requests = requests;
        self
    }

    pub(crate) fn validate(&self, max: usize) -> Result<(), ConfigError> {
        let fail = |what: String| Err(ConfigError::new(format!("adaptive shedding: {what}")));
        if self.min < 2 || self.min > max {
            return fail(format!(
                "a least capacity of {} with a capacity of {max}; use 2 <= min <= capacity",
                self.min
            ));
        }
        if !(1..=1000).contains(&self.tolerance_percent) {
            return fail(format!(
                "a tolerance of {} %; use 1 to 1000",
                self.tolerance_percent
            ));
        }
        if !(Duration::from_millis(10)..=Duration::from_secs(10)).contains(&self.update_every) {
            return fail(format!(
                "an update every {:?}; use 10 ms to 10 s",
                self.update_every
            ));
        }
        if self.base_every < Duration::from_secs(1) {
            return fail(format!(
                "the no-load latency measured every {:?}; use at least a second",
                self.base_every
            ));
        }
        if !(5..=1000).contains(&self.probe_requests) {
            return fail(format!(
                "{} requests per measurement of the no-load latency; use 5 to 1000",
                self.probe_requests
            ));
        }
        Ok(())
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// A measurement of the no-load latency under way.
#[derive(Debug, Default)]
struct Probe {
    /// Its number: requests let in during it carry it.
    id: u64,
    started: u64,
    /// The capacity to come back to (0: the first, the warm-up).
    resume: usize,
    samples: Vec<u64>,
}

/// The controller of one adaptive shedder: its capacity, and the latencies it learns from.
/// Times are microseconds on the caller's clock.
#[derive(Debug)]
pub(crate) struct Gradient {
    /// Where its clock starts.
    origin: tokio::time::Instant,
    settings: Adaptive,
    max: usize,
    capacity: AtomicUsize,
    /// The latencies of the requests that ended in this update's window (µs, each at most
    /// [`MAX_SAMPLE_TIMES`] the base) in the high 44 bits, how many in the low 20: one word, so
    /// that a sum is never read without its count.
    window: AtomicU64,
    /// The most in flight seen in this window.
    peak: AtomicUsize,
    next_update: AtomicU64,
    /// The no-load latency (0: not measured yet), and the latest window's mean.
    base: AtomicU64,
    recent: AtomicU64,
    /// A measurement of the base is under way: its number, else 0.
    probing: AtomicU64,
    probe: Mutex<Probe>,
    next_probe: AtomicU64,
    /// Whether an update is being made.
    updating: AtomicBool,
}

impl Gradient {
    pub(crate) fn new(settings: Adaptive, max: usize) -> Self {
        let min = settings.min.clamp(1, max.max(1));
        Gradient {
            origin: tokio::time::Instant::now(),
            settings,
            max,
            capacity: AtomicUsize::new(min),
            window: AtomicU64::new(0),
            peak: AtomicUsize::new(0),
            next_update: AtomicU64::new(0),
            base: AtomicU64::new(0),
            recent: AtomicU64::new(0),
            // The warm-up: the first measurement starts with the first request.
            probing: AtomicU64::new(1),
            probe: Mutex::new(Probe {
                id: 1,
                started: u64::MAX,
                ..Probe::default()
            }),
            next_probe: AtomicU64::new(u64::MAX),
            updating: AtomicBool::new(false),
        }
    }

    /// Microseconds since the controller was made (Tokio's clock, which tests may pause).
    pub(crate) fn now(&self) -> u64 {
        micros(self.origin.elapsed())
    }

    /// The settings.
    pub(crate) fn settings(&self) -> &Adaptive {
        &self.settings
    }

    /// The capacity now: `min` while the no-load latency is measured.
    pub(crate) fn capacity(&self) -> usize {
        if self.probing.load(Ordering::Acquire) != 0 {
            self.settings.min
        } else {
            self.capacity.load(Ordering::Acquire)
        }
    }

    /// The no-load latency and the latest window's mean, in microseconds (0: not yet).
    #[cfg_attr(not(any(test, feature = "metrics")), allow(dead_code))]
    pub(crate) fn latencies(&self) -> (u64, u64) {
        (
            self.base.load(Ordering::Acquire),
            self.recent.load(Ordering::Acquire),
        )
    }

    /// A request was let in at `now` with `in_flight` in flight (itself included): the number
    /// of the measurement it belongs to (0: none; a request let in while more than `min` were
    /// in flight, a critical one, would measure their queue).
    pub(crate) fn entered(&self, now: u64, in_flight: usize) -> u64 {
        // Written only when it grows: most requests only read the line.
        if in_flight > self.peak.load(Ordering::Relaxed) {
            self.peak.fetch_max(in_flight, Ordering::AcqRel);
        }
        let probe = self.probing.load(Ordering::Acquire);
        if probe != 0 {
            if in_flight > self.settings.min {
                return 0;
            }
            let mut p = self.probe.lock().unwrap_or_else(|e| e.into_inner());
            if p.id == probe && p.started == u64::MAX {
                p.started = now;
            }
        }
        probe
    }

    /// A request let in at `entered` (during measurement `probe`, or 0) ended at `now`: whether
    /// the capacity was updated.
    pub(crate) fn ended(&self, entered: u64, now: u64, probe: u64) -> bool {
        let latency = now.saturating_sub(entered);
        if probe != 0 && probe == self.probing.load(Ordering::Acquire) {
            let mut p = self.probe.lock().unwrap_or_else(|e| e.into_inner());
            if p.id == probe {
                p.samples.push(latency);
                if p.samples.len() >= self.settings.probe_requests {
                    self.end_probe(&mut p, now);
                }
            }
        } else if probe == 0 {
            // A slow reader, or one stream, counts as a few requests' time at most.
            let base = self.base.load(Ordering::Acquire);
            let latency = match base {
                0 => latency,
                base => latency.min(base.saturating_mul(MAX_SAMPLE_TIMES)),
            };
            let word = (latency.min(MAX_WINDOW_SUM) << COUNT_BITS) | 1;
            // Past its count's or its sum's room (a million requests, or 200 days, in one
            // window), a window stops counting.
            let _ = self
                .window
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                    let (sum, count) = (w >> COUNT_BITS, w & COUNT_MASK);
                    (count < COUNT_MASK && sum + (word >> COUNT_BITS) <= MAX_WINDOW_SUM)
                        .then_some(w + word)
                });
        }
        if now >= self.next_update.load(Ordering::Acquire)
            && !self.updating.swap(true, Ordering::AcqRel)
        {
            self.update(now);
            self.updating.store(false, Ordering::Release);
            return true;
        }
        false
    }

    /// Ends the measurement `p` at `now`: its median is the base (or the base stands, without
    /// samples), and the capacity is what it was before (at the warm-up, `min`).
    fn end_probe(&self, p: &mut Probe, now: u64) {
        if !p.samples.is_empty() {
            // The mean, as the windows are measured, of samples capped as theirs are (at ten
            // times the median: a straggler does not make the base).
            p.samples.sort_unstable();
            let cap = p.samples[p.samples.len() / 2]
                .max(1)
                .saturating_mul(MAX_SAMPLE_TIMES);
            let sum: u64 = p.samples.iter().map(|s| (*s).min(cap)).sum();
            let base = (sum / p.samples.len() as u64).max(1);
            self.base.store(base, Ordering::Release);
        }
        if p.resume != 0 {
            self.capacity.store(p.resume, Ordering::Release);
        }
        p.samples.clear();
        p.started = u64::MAX;
        self.window.store(0, Ordering::Release);
        self.peak.store(0, Ordering::Release);
        self.next_probe.store(
            now.saturating_add(micros(self.settings.base_every)),
            Ordering::Release,
        );
        self.probing.store(0, Ordering::Release);
    }

    /// The update at `now`: ends a measurement that took too long, starts one that is due, or
    /// moves the capacity by the gradient of the window's latency.
    fn update(&self, now: u64) {
        self.next_update.store(
            now.saturating_add(micros(self.settings.update_every)),
            Ordering::Release,
        );
        if self.probing.load(Ordering::Acquire) != 0 {
            let mut p = self.probe.lock().unwrap_or_else(|e| e.into_inner());
            let started = p.started;
            if started != u64::MAX
                && now.saturating_sub(started) >= micros(LONGEST_PROBE)
                && (!p.samples.is_empty() || self.base.load(Ordering::Acquire) != 0)
            {
                self.end_probe(&mut p, now);
            }
            return;
        }
        if now >= self.next_probe.load(Ordering::Acquire) {
            let mut p = self.probe.lock().unwrap_or_else(|e| e.into_inner());
            p.id += 1;
            // Its time counts from its first request: those in flight drain first.
            p.started = u64::MAX;
            p.resume = self.capacity.load(Ordering::Acquire);
            p.samples.clear();
            self.probing.store(p.id, Ordering::Release);
            return;
        }
        let window = self.window.swap(0, Ordering::AcqRel);
        let (sum, count) = (window >> COUNT_BITS, window & COUNT_MASK);
        let peak = self.peak.swap(0, Ordering::AcqRel);
        let base = self.base.load(Ordering::Acquire);
        if count == 0 || base == 0 {
            return;
        }
        let sample = (sum / count).max(1);
        self.recent.store(sample, Ordering::Release);
        let capacity = self.capacity.load(Ordering::Acquire);
        let tolerated = base as f64 * (1.0 + f64::from(self.settings.tolerance_percent) / 100.0);
        let gradient = (tolerated / sample as f64).clamp(0.5, 2.0);
        let scaled = gradient * capacity as f64;
        let mut next = (scaled + scaled.sqrt()).round() as usize;
        if next > capacity && peak < capacity.div_ceil(2) {
            // Not in use: no reason to grow.
            next = capacity;
        }
        self.capacity
            .store(next.clamp(self.settings.min, self.max), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1000;

    /// `requests` requests of `latency` each, `in_flight` at a time, from `*now` on.
    fn run(g: &Gradient, now: &mut u64, requests: usize, in_flight: usize, latency: u64) {
        for _ in 0..requests {
            let probe = g.entered(*now, in_flight);
            g.ended(*now, *now + latency, probe);
            *now += latency / in_flight.max(1) as u64 + 1;
        }
    }

    /// Requests of `latency(in flight)`, as many in flight as the capacity allows, for one
    /// update window and a little more: the capacity after it.
    fn step(g: &Gradient, now: &mut u64, latency: impl Fn(usize) -> u64) -> usize {
        let until = *now + 110 * MS;
        while *now < until {
            let c = g.capacity();
            run(g, now, 1, c, latency(c));
        }
        g.capacity()
    }

    fn warmed(latency: u64) -> (Gradient, u64) {
        let g = Gradient::new(Adaptive::new(), 100);
        let mut now = 0;
        assert_eq!(g.capacity(), 4, "min until the base is known");
        run(&g, &mut now, 50, 4, latency);
        assert_eq!(g.latencies().0, latency, "the median of the warm-up");
        (g, now)
    }

    #[test]
    fn the_capacity_grows_while_latency_stays_at_its_floor_and_stays_within_bounds() {
        let (g, mut now) = warmed(4 * MS);
        let mut last = g.capacity();
        for _ in 0..40 {
            let c = step(&g, &mut now, |_| 4 * MS);
            assert!(c >= last, "never falls at the floor");
            last = c;
        }
        assert_eq!(last, 100, "up to the maximum");
    }

    #[test]
    fn the_capacity_falls_when_latency_doubles_and_comes_back_when_it_recovers() {
        let (g, mut now) = warmed(4 * MS);
        for _ in 0..10 {
            step(&g, &mut now, |_| 4 * MS);
        }
        let high = g.capacity();
        assert!(high > 30, "grew to {high}");
        // Twice the latency: the gradient is 0.625; a few updates bring it down.
        for _ in 0..5 {
            step(&g, &mut now, |_| 8 * MS);
        }
        let low = g.capacity();
        assert!(low < high / 3, "fell from {high} to {low}");
        assert!(low >= 4);
        for _ in 0..5 {
            step(&g, &mut now, |_| 4 * MS);
        }
        assert!(g.capacity() > low * 2, "came back: {}", g.capacity());
    }

    #[test]
    fn a_backend_of_w_workers_settles_near_its_workers_and_a_short_queue() {
        // A backend of 8 workers of 4 ms: latency is 4 ms up to 8 in flight, then grows with
        // the queue.
        let (g, mut now) = warmed(4 * MS);
        let latency = |in_flight: usize| 4 * MS * (in_flight.max(8) as u64) / 8;
        let mut seen = Vec::new();
        for _ in 0..100 {
            seen.push(step(&g, &mut now, latency));
        }
        let late = &seen[50..];
        assert!(
            late.iter().all(|c| (9..=20).contains(c)),
            "settled within 9..=20: {late:?}"
        );
    }

    #[test]
    fn an_unused_capacity_does_not_grow() {
        let (g, mut now) = warmed(4 * MS);
        for _ in 0..20 {
            run(&g, &mut now, 30, 1, 4 * MS);
        }
        assert!(
            g.capacity() <= 8,
            "grew to {} with one in flight",
            g.capacity()
        );
    }

    #[test]
    fn the_base_is_measured_again_at_min_and_the_capacity_resumes() {
        let (g, mut now) = warmed(4 * MS);
        for _ in 0..10 {
            step(&g, &mut now, |_| 4 * MS);
        }
        let before = g.capacity();
        // 30 s later, the next update starts a measurement: min meanwhile.
        now += 30_000 * MS;
        run(&g, &mut now, 1, before, 4 * MS);
        assert_eq!(g.capacity(), 4, "held at min while measuring");
        // The backend is slower now (a dependency): its new base is 6 ms.
        run(&g, &mut now, 50, 4, 6 * MS);
        assert_eq!(g.latencies().0, 6 * MS);
        assert_eq!(g.capacity(), before, "resumed");
    }

    #[test]
    fn bad_settings_are_refused() {
        assert!(Adaptive::new().validate(100).is_ok());
        assert!(Adaptive::new().min(1).validate(100).is_err());
        assert!(Adaptive::new().min(200).validate(100).is_err());
        assert!(Adaptive::new().tolerance(0).validate(100).is_err());
        assert!(
            Adaptive::new()
                .update_every(Duration::from_millis(1))
                .validate(100)
                .is_err()
        );
        assert!(
            Adaptive::new()
                .base_every(Duration::from_millis(10))
                .validate(100)
                .is_err()
        );
        assert!(Adaptive::new().probe_requests(1).validate(100).is_err());
    }
}
