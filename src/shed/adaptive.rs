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

use super::latencies::Latencies;
use crate::ConfigError;

/// The longest a measurement of the no-load latency lasts from its first request: past it, the
/// samples taken decide.
const LONGEST_PROBE: Duration = Duration::from_secs(1);

/// The longest a measurement lasts from its start (the warm-up: from the first request). Past
/// it, a measurement that no request could join (requests held in flight by others: streams,
/// critical ones) is given up, the base standing; at the warm-up, requests join it whatever is
/// in flight.
const PROBE_DEADLINE: Duration = Duration::from_secs(2);

/// The latency a window and a measurement are summed up by: their 90th percentile.
const QUANTILE: f64 = 0.9;

/// The fewest latencies an update judges: a quieter window waits for more.
const MIN_WINDOW: u64 = 10;

/// How a [`Shedding`](super::Shedding) learns its capacity: the settings of its controller.
///
/// Every [`update_every`](Self::update_every) (50 ms), the controller compares the 90th
/// percentile latency of the requests that ended meanwhile (`sample`, once at least ten have)
/// with the no-load latency (`base`, the same percentile):
///
/// ```text
/// gradient  = clamp(base × (1 + tolerance) / sample, 0.5, 2)
/// capacity' = clamp(gradient × capacity, min, max)   (at least one more when gradient > 1)
/// ```
///
/// While latency stays within the tolerance of its no-load level (25 %), the capacity grows
/// (by about that much at each update where latency is at its floor); when requests queue and
/// latency rises, it falls in proportion. It settles where the 90th percentile is about
/// `1.25 s` for a backend whose requests take `s`: every worker busy and a short queue (in
/// `cargo bench --bench shedding`, 11–14 in flight for 8 workers, 24–28 for 16). The
/// percentile, rather than a mean, is what queued requests move first (a queue that one
/// request in eight waits in barely moves a mean), and what one slow request does not move.
/// A fall needs two windows in a row above the tolerance, or one at twice the tolerated
/// latency (a backend that lost half its workers), and the window after a slow one does not
/// grow it: one window in many is slow for reasons of its own (a pause of the process, a
/// neighbour). From the warm-up until latency first passes the tolerance, the capacity
/// doubles at each update instead (a slow start, as TCP's). It grows only while it is in use
/// (half of it in flight, or the `low` share if smaller), so that a quiet hour does not leave
/// it at its maximum. Latencies are read from a histogram whose buckets are 6.25 % wide: a
/// tolerance below that counts a neighbouring bucket as slow.
///
/// **The no-load latency** is measured at the start (the warm-up: the capacity is `min` until
/// then) and again every [`base_every`](Self::base_every) (30 s): for
/// [`probe_requests`](Self::probe_requests) requests (50, within a second of the first at
/// most) the capacity is held at `min`, and the 90th percentile latency of the requests let
/// in meanwhile is the new base. Measuring it again keeps the base from creeping up under
/// lasting load (a base read from queued requests would let the queue grow), and lets it
/// follow a backend whose own latency changed (a slower dependency). Each measurement holds
/// `low` and `normal` requests at `min` for as long as the requests in flight take to drain,
/// then up to a second: a few percent of the time where requests are slow. One that no
/// request could join within 2 s (more than `min` held in flight by streams or critical
/// requests) is given up, the base standing; at the warm-up, requests join it then whatever is
/// in flight. `min` should not exceed the backend's workers, or the no-load latency includes a
/// queue. The gauges have no label: give one process one adaptive `Shedding` (clones share
/// it).
///
/// **Bounds**: the capacity stays between `min` (default 4; at least 2) and the `Shedding`'s
/// capacity, its maximum. The priority shares apply to the learned capacity (`low` up to 50 %,
/// `normal` up to 80 %); `critical` requests are bounded by the maximum only: they are shed
/// only when the maximum is in flight, whatever was learned.
///
/// **What is measured**: from when a request is let in until the inner service answers (the
/// response's head), and only requests it answered (not those the layer refused, nor those
/// whose client left first). A client reading slowly, or a stream, is not a queue; it holds its
/// place in flight until its body ends, though, so give long-lived routes a layer of their
/// own. Every answer counts, errors too: a route whose fast errors (or a client's cheap
/// requests) make up a large share of the traffic teaches the shedder their latency.
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
    /// The defaults: at least 4 in flight, a tolerance of 25 %, an update every 50 ms, the
    /// no-load latency measured every 30 s over 50 requests.
    pub const fn new() -> Self {
        Adaptive {
            min: 4,
            tolerance_percent: 25,
            update_every: Duration::from_millis(50),
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

    /// How often the capacity is updated (default 50 ms; 10 ms to 10 s). An update waits for
    /// ten requests to have ended since the last.
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
    /// The latencies of the requests that ended in this update's window (µs).
    window: Latencies,
    /// The most in flight seen in this window.
    peak: AtomicUsize,
    next_update: AtomicU64,
    /// The no-load latency (0: not measured yet), and the latest window's, both their 90th
    /// percentile (µs).
    base: AtomicU64,
    recent: AtomicU64,
    /// A measurement of the base is under way: its number, else 0.
    probing: AtomicU64,
    /// When the measurement under way is given up ([`PROBE_DEADLINE`]; `u64::MAX` until the
    /// warm-up's first request).
    probe_deadline: AtomicU64,
    probe: Mutex<Probe>,
    next_probe: AtomicU64,
    /// Whether an update is being made.
    updating: AtomicBool,
    /// From the warm-up until latency first passes the tolerance, the capacity doubles at each
    /// update (a slow start, as TCP's): a server that starts under load reaches its level in a
    /// few updates rather than a few dozen.
    starting: AtomicBool,
    /// Whether the last window judged was above the tolerance: a fall needs two in a row.
    above: AtomicBool,
    /// The share of the capacity in flight at which it is in use (and may grow), in percent:
    /// half, or the `low` class's share if smaller, which `low` requests alone fill.
    in_use_percent: AtomicUsize,
}

impl Gradient {
    pub(crate) fn new(settings: Adaptive, max: usize) -> Self {
        let min = settings.min.clamp(1, max.max(1));
        Gradient {
            origin: tokio::time::Instant::now(),
            settings,
            max,
            capacity: AtomicUsize::new(min),
            window: Latencies::new(),
            peak: AtomicUsize::new(0),
            next_update: AtomicU64::new(0),
            base: AtomicU64::new(0),
            recent: AtomicU64::new(0),
            // The warm-up: the first measurement starts with the first request.
            probing: AtomicU64::new(1),
            probe_deadline: AtomicU64::new(u64::MAX),
            probe: Mutex::new(Probe {
                id: 1,
                started: u64::MAX,
                ..Probe::default()
            }),
            next_probe: AtomicU64::new(u64::MAX),
            updating: AtomicBool::new(false),
            starting: AtomicBool::new(true),
            above: AtomicBool::new(false),
            in_use_percent: AtomicUsize::new(50),
        }
    }

    /// Microseconds since the controller was made (Tokio's clock, which tests may pause).
    pub(crate) fn now(&self) -> u64 {
        micros(self.origin.elapsed())
    }

    /// The share of the least class (`low`), in percent: in flight up to it, the capacity is in
    /// use.
    pub(crate) fn set_least_share(&self, percent: u8) {
        self.in_use_percent
            .store(usize::from(percent).clamp(1, 50), Ordering::Release);
    }

    /// How many in flight make `capacity` in use: its `in_use_percent`, rounded down (what the
    /// least class may fill), at least one.
    fn in_use(&self, capacity: usize) -> usize {
        (capacity.saturating_mul(self.in_use_percent.load(Ordering::Acquire)) / 100).max(1)
    }

    /// The settings.
    pub(crate) fn settings(&self) -> &Adaptive {
        &self.settings
    }

    /// The capacity now: `min` while the no-load latency is measured (a measurement past its
    /// deadline given up here, where every request asks, even those shed).
    pub(crate) fn capacity(&self) -> usize {
        if self.probing.load(Ordering::Acquire) == 0 {
            return self.capacity.load(Ordering::Acquire);
        }
        self.capacity_at(self.now())
    }

    /// [`capacity`](Self::capacity) at `now`.
    fn capacity_at(&self, now: u64) -> usize {
        let probe = self.probing.load(Ordering::Acquire);
        if probe == 0 {
            return self.capacity.load(Ordering::Acquire);
        }
        if self.base.load(Ordering::Acquire) != 0
            && now >= self.probe_deadline.load(Ordering::Acquire)
        {
            let mut p = self.probe.lock().unwrap_or_else(|e| e.into_inner());
            if p.id == probe && self.probing.load(Ordering::Acquire) == probe {
                self.end_probe(&mut p, now);
            }
            return self.capacity.load(Ordering::Acquire);
        }
        self.settings.min
    }

    /// The no-load latency and the latest window's, in microseconds (0: not yet).
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
            // The warm-up's deadline runs from its first request.
            let _ = self.probe_deadline.compare_exchange(
                u64::MAX,
                now.saturating_add(micros(PROBE_DEADLINE)),
                Ordering::AcqRel,
                Ordering::Acquire,
            );
            if in_flight > self.settings.min && now < self.probe_deadline.load(Ordering::Acquire) {
                return 0;
            }
            let mut p = self.probe.lock().unwrap_or_else(|e| e.into_inner());
            if p.id != probe {
                return 0;
            }
            if p.started == u64::MAX {
                p.started = now;
            }
        }
        probe
    }

    /// A request let in at `entered` (during measurement `probe`, or 0) ended at `now`: whether
    /// a window was judged (and the capacity perhaps moved).
    pub(crate) fn ended(&self, entered: u64, now: u64, probe: u64) -> bool {
        let latency = now.saturating_sub(entered);
        if probe != 0 && probe == self.probing.load(Ordering::Acquire) {
            let mut p = self.probe.lock().unwrap_or_else(|e| e.into_inner());
            if p.id == probe && self.probing.load(Ordering::Acquire) == probe {
                p.samples.push(latency);
                if p.samples.len() >= self.settings.probe_requests {
                    self.end_probe(&mut p, now);
                }
            }
        } else if probe == 0 {
            self.window.add(latency);
        }
        if now >= self.next_update.load(Ordering::Acquire)
            && !self.updating.swap(true, Ordering::AcqRel)
        {
            let judged = self.update(now);
            self.updating.store(false, Ordering::Release);
            return judged;
        }
        false
    }

    /// Ends the measurement `p` at `now`: its 90th percentile is the base (or the base stands,
    /// without samples), and the capacity is what it was before (at the warm-up, `min`).
    fn end_probe(&self, p: &mut Probe, now: u64) {
        if !p.samples.is_empty() {
            p.samples.sort_unstable();
            let rank =
                ((p.samples.len() as f64 * QUANTILE).ceil() as usize).clamp(1, p.samples.len());
            // Rounded as a window's is read, so that the same latency compares as equal.
            let base = Latencies::rounded(p.samples[rank - 1]).max(1);
            self.base.store(base, Ordering::Release);
        }
        if p.resume != 0 {
            self.capacity.store(p.resume, Ordering::Release);
        }
        p.samples.clear();
        p.started = u64::MAX;
        self.window.clear();
        self.above.store(false, Ordering::Release);
        self.peak.store(0, Ordering::Release);
        self.next_probe.store(
            now.saturating_add(micros(self.settings.base_every)),
            Ordering::Release,
        );
        self.probing.store(0, Ordering::Release);
    }

    /// The update at `now`: ends a measurement that took too long, starts one that is due, or
    /// moves the capacity by the gradient of the window's latency (then `true`).
    fn update(&self, now: u64) -> bool {
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
            return false;
        }
        if now >= self.next_probe.load(Ordering::Acquire) {
            let mut p = self.probe.lock().unwrap_or_else(|e| e.into_inner());
            p.id += 1;
            // Its time counts from its first request: those in flight drain first.
            p.started = u64::MAX;
            p.resume = self.capacity.load(Ordering::Acquire);
            p.samples.clear();
            self.probe_deadline.store(
                now.saturating_add(micros(PROBE_DEADLINE)),
                Ordering::Release,
            );
            self.probing.store(p.id, Ordering::Release);
            return false;
        }
        let base = self.base.load(Ordering::Acquire);
        if base == 0 || self.window.count() < MIN_WINDOW {
            // Too few to judge: the window goes on.
            return false;
        }
        let (sample, _) = self.window.take(QUANTILE);
        let sample = sample.max(1);
        let peak = self.peak.swap(0, Ordering::AcqRel);
        self.recent.store(sample, Ordering::Release);
        let capacity = self.capacity.load(Ordering::Acquire);
        let tolerated = base as f64 * (1.0 + f64::from(self.settings.tolerance_percent) / 100.0);
        let mut gradient = (tolerated / sample as f64).clamp(0.5, 2.0);
        // One window in many is slow for reasons of its own (a pause of the process, a
        // neighbour): a fall needs two in a row above the tolerance, or one at twice the
        // tolerated latency (a backend that lost half its workers).
        // Nor does the window after a slow one grow it: windows slow and fast in turn hold it.
        let was_above = self.above.swap(gradient < 1.0, Ordering::AcqRel);
        if (gradient < 1.0 && gradient > 0.5 && !was_above) || (gradient > 1.0 && was_above) {
            gradient = 1.0;
        }
        if self.starting.load(Ordering::Acquire) {
            if sample as f64 > tolerated {
                self.starting.store(false, Ordering::Release);
            } else if peak >= self.in_use(capacity) {
                gradient = 2.0;
            }
        }
        let scaled = gradient * capacity as f64;
        let mut next = if gradient < 1.0 {
            scaled.floor() as usize
        } else if gradient > 1.0 {
            (scaled.round() as usize).max(capacity.saturating_add(1))
        } else {
            capacity
        };
        if next > capacity && peak < self.in_use(capacity) {
            // Not in use: no reason to grow.
            next = capacity;
        }
        self.capacity
            .store(next.clamp(self.settings.min, self.max), Ordering::Release);
        true
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

    /// Requests of `latency(in flight)`, as many in flight as the capacity allows, until an
    /// update judged them: the capacity after it.
    fn step(g: &Gradient, now: &mut u64, latency: impl Fn(usize) -> u64) -> usize {
        let until = *now + 10_000 * MS;
        while *now < until {
            let c = g.capacity();
            let probe = g.entered(*now, c);
            let l = latency(c);
            let updated = g.ended(*now, *now + l, probe);
            *now += l / c.max(1) as u64 + 1;
            if updated {
                return g.capacity();
            }
        }
        panic!("no update in 10 s");
    }

    fn warmed(latency: u64) -> (Gradient, u64) {
        let g = Gradient::new(Adaptive::new(), 100);
        let mut now = 0;
        assert_eq!(g.capacity(), 4, "min until the base is known");
        run(&g, &mut now, 50, 4, latency);
        assert_eq!(
            g.latencies().0,
            Latencies::rounded(latency),
            "the 90th percentile of the warm-up"
        );
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
        // Latency at 1.25 times its floor: 10 in flight, a queue of one request for every
        // fourth worker.
        assert!(
            late.iter().all(|c| (9..=12).contains(c)),
            "settled within 9..=12: {late:?}"
        );
    }

    #[test]
    fn after_the_warm_up_the_capacity_doubles_until_latency_first_rises() {
        let (g, mut now) = warmed(4 * MS);
        let seen: Vec<usize> = (0..4).map(|_| step(&g, &mut now, |_| 4 * MS)).collect();
        assert_eq!(seen, [8, 16, 32, 64], "doubled at each update");
        // Latency rises: the start is over (the first slow window holds, the second falls),
        // and the capacity grows by the tolerance from then (not in the window right after a
        // slow one).
        assert_eq!(step(&g, &mut now, |_| 8 * MS), 64);
        let fell = step(&g, &mut now, |_| 8 * MS);
        assert!(fell < 64, "fell to {fell}");
        assert_eq!(
            step(&g, &mut now, |_| 4 * MS),
            fell,
            "held after a slow window"
        );
        let grew = step(&g, &mut now, |_| 4 * MS);
        assert!(
            grew > fell && grew <= fell * 5 / 4 + 1,
            "from {fell}, grew to {grew}"
        );
    }

    #[test]
    fn a_tail_of_slow_requests_brings_the_capacity_down_though_the_mean_is_within_tolerance() {
        let (g, mut now) = warmed(4 * MS);
        for _ in 0..6 {
            step(&g, &mut now, |_| 4 * MS);
        }
        let before = g.capacity();
        // One request in eight takes three times as long: a mean of 5 ms, within the 25 %
        // tolerated, but those requests queued.
        let n = std::cell::Cell::new(0u64);
        for _ in 0..3 {
            step(&g, &mut now, |_| {
                n.set(n.get() + 1);
                if n.get().is_multiple_of(8) {
                    12 * MS
                } else {
                    4 * MS
                }
            });
        }
        assert!(
            g.capacity() < before / 2,
            "from {before} to {}",
            g.capacity()
        );
    }

    #[test]
    fn one_slow_request_does_not_move_the_capacity_and_a_quiet_window_waits_for_more() {
        let (g, mut now) = warmed(4 * MS);
        for _ in 0..4 {
            step(&g, &mut now, |_| 4 * MS);
        }
        let before = g.capacity();
        // A stream, as long as the test so far (a hundred times the floor), ends among
        // requests at the floor.
        g.ended(0, now, 0);
        let after = step(&g, &mut now, |_| 4 * MS);
        assert!(after >= before, "fell from {before} to {after}");
        // Five requests in a second, each twice as slow: too few to judge.
        let settled = g.capacity();
        for _ in 0..5 {
            run(&g, &mut now, 1, settled, 8 * MS);
            now += 200 * MS;
        }
        assert_eq!(g.capacity(), settled, "judged on five requests");
        // Judged once there were enough: the first window slow holds, the second falls.
        assert_eq!(step(&g, &mut now, |_| 8 * MS), settled);
        let judged = step(&g, &mut now, |_| 8 * MS);
        assert!(judged < settled, "fell to {judged}");
    }

    #[test]
    fn a_latency_at_its_floor_never_reads_above_a_tolerance_of_one_percent() {
        let g = Gradient::new(Adaptive::new().tolerance(1), 100);
        let mut now = 0;
        // Just above a bucket's start, 3 % below its middle: a base and a window read it alike.
        let floor = 4_100;
        run(&g, &mut now, 50, 4, floor);
        let mut last = g.capacity();
        for _ in 0..30 {
            let c = step(&g, &mut now, |_| floor);
            assert!(c >= last, "fell from {last} to {c} at the floor");
            last = c;
        }
        assert!(last > 30, "grew to {last}");
    }

    #[test]
    fn a_measurement_no_request_can_join_is_given_up_and_the_capacity_resumes() {
        let (g, mut now) = warmed(4 * MS);
        for _ in 0..4 {
            step(&g, &mut now, |_| 4 * MS);
        }
        let before = g.capacity_at(now);
        now += 30_000 * MS;
        run(&g, &mut now, 1, before, 4 * MS);
        assert_eq!(g.capacity_at(now), 4, "measuring");
        // Streams (or critical requests) keep more than `min` in flight: nobody joins.
        for _ in 0..150 {
            assert_eq!(g.entered(now, 10), 0);
            now += 10 * MS;
        }
        assert_eq!(g.capacity_at(now), 4, "still measuring at 1.5 s");
        now += 600 * MS;
        assert_eq!(
            g.capacity_at(now),
            before,
            "given up after 2 s, the base standing"
        );
        assert_eq!(g.latencies().0, Latencies::rounded(4 * MS));
    }

    #[test]
    fn low_requests_alone_grow_an_odd_capacity() {
        let g = Gradient::new(Adaptive::new().min(5), 100);
        g.set_least_share(50);
        let mut now = 0;
        run(&g, &mut now, 50, 2, 4 * MS);
        // `low` requests fill half of it, rounded down: 2 of 5.
        for _ in 0..3 {
            let until = now + 55 * MS;
            while now < until {
                let low = g.capacity_at(now) / 2;
                run(&g, &mut now, 1, low, 4 * MS);
            }
        }
        assert!(g.capacity_at(now) > 5, "stayed at {}", g.capacity_at(now));
    }

    #[test]
    fn windows_slow_and_fast_in_turn_do_not_ratchet_the_capacity() {
        let (g, mut now) = warmed(4 * MS);
        step(&g, &mut now, |_| 8 * MS);
        step(&g, &mut now, |_| 8 * MS);
        let level = g.capacity_at(now);
        for _ in 0..10 {
            step(&g, &mut now, |_| 6 * MS);
            step(&g, &mut now, |_| 4 * MS);
        }
        assert_eq!(g.capacity_at(now), level);
    }

    #[test]
    fn a_fall_needs_two_slow_windows_in_a_row_or_one_at_twice_the_tolerated_latency() {
        let (g, mut now) = warmed(4 * MS);
        for _ in 0..3 {
            step(&g, &mut now, |_| 4 * MS);
        }
        let level = g.capacity();
        // One slow window (6 ms: 20 % above the tolerated 5) among fast ones: held.
        assert_eq!(step(&g, &mut now, |_| 6 * MS), level, "one slow window");
        let level = step(&g, &mut now, |_| 4 * MS);
        assert_eq!(step(&g, &mut now, |_| 6 * MS), level, "held again");
        let fell = step(&g, &mut now, |_| 6 * MS);
        // By the gradient, 5/6 (latencies as their buckets read them: within 1/32).
        let expected = level as f64 * 5.0 / 6.0;
        assert!(
            (fell as f64 - expected).abs() <= expected / 16.0 + 1.0,
            "two in a row: {level} to {fell}"
        );
        // Three times the floor, past twice the tolerated latency: at once, by half.
        let level = step(&g, &mut now, |_| 4 * MS);
        assert_eq!(step(&g, &mut now, |_| 12 * MS), level.div_ceil(2).max(4));
    }

    #[test]
    fn an_unused_capacity_does_not_grow() {
        let (g, mut now) = warmed(4 * MS);
        for _ in 0..20 {
            run(&g, &mut now, 30, 1, 4 * MS);
        }
        assert_eq!(g.capacity(), 4, "grew with one in flight");
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
        assert_eq!(g.latencies().0, Latencies::rounded(6 * MS));
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
        // And past their upper bounds.
        assert!(Adaptive::new().tolerance(1001).validate(100).is_err());
        assert!(
            Adaptive::new()
                .update_every(Duration::from_secs(11))
                .validate(100)
                .is_err()
        );
        assert!(Adaptive::new().probe_requests(1001).validate(100).is_err());
        assert!(
            Adaptive::new()
                .tolerance(1000)
                .update_every(Duration::from_secs(10))
                .probe_requests(1000)
                .min(100)
                .validate(100)
                .is_ok(),
            "the bounds themselves"
        );
    }
}
