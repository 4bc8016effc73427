//! Load shedding: [`Shedding`], a capacity of requests in flight in this process shared by
//! priority classes, and the count of those in flight.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use http::request::Parts;

use crate::ConfigError;

mod adaptive;
mod latencies;

pub use adaptive::Adaptive;
use adaptive::Gradient;

/// The policy a shed request's problem document names as violated.
pub(crate) const SHED_POLICY: &str = "load-shedding";

/// How much a request matters when the process is busy: the lowest are shed first.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Priority {
    /// Shed first (test traffic, reports, prefetches).
    Low,
    /// Most requests.
    #[default]
    Normal,
    /// Shed last: only once the whole capacity is in use.
    Critical,
}

impl Priority {
    /// The label value: `low`, `normal`, `critical`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Priority::Low => "low",
            Priority::Normal => "normal",
            Priority::Critical => "critical",
        }
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A request's [`Priority`], read from its head.
pub(crate) type PriorityFn = Arc<dyn Fn(&Parts) -> Priority + Send + Sync>;

/// Load shedding: a capacity of requests in flight in this process, shared by priority classes,
/// the lowest shed first and a share always kept for the critical ones.
///
/// ```
/// use tollgate::{Priority, Quota, RateLimitLayer, Rule, Shedding};
///
/// // 200 requests in flight at most; `low` ones only while fewer than 100 are (50 %), `normal`
/// // ones while fewer than 160 are (80 %): the last 40 are kept for `critical` requests.
/// let shedding = Shedding::new(200).priority(|parts: &http::request::Parts| {
///     match parts.uri.path() {
///         "/checkout" => Priority::Critical,
///         path if path.starts_with("/reports") => Priority::Low,
///         _ => Priority::Normal,
///     }
/// });
/// let layer = RateLimitLayer::builder()
///     .rule(Rule::new("api", Quota::per_second(100)))
///     .shed(shedding)
///     .build()?;
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
///
/// A request is in flight from the moment the layer sees it until its response body ends (or
/// is dropped): a long stream (server-sent events, a gRPC stream) or a client that reads
/// slowly holds its place meanwhile, so give such routes a layer of their own. A layer may
/// shed with no rules at all (its rules are then elsewhere, or there are none):
///
/// ```
/// use axum::{Router, routing::get};
/// use tollgate::{RateLimitLayer, Shedding};
///
/// // At most 50 streams in flight, counted apart from the other routes.
/// let streams = RateLimitLayer::builder().shed(Shedding::new(50)).build()?;
/// let app: Router = Router::new().route("/events", get(|| async { "..." }).route_layer(streams));
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
///
/// A request that would pass its class's share is answered at once, before any rule is
/// checked: `503 Service Unavailable` with `Retry-After: 1` and a
/// `temporary-reduced-capacity` problem document (draft-ietf-httpapi-ratelimit-headers-11
/// §5.2) whose violated policy is `"load-shedding"`, advertised as the draft allows with the
/// class's share (`RateLimit-Policy: "load-shedding";q=100;qu="concurrent-requests"` and
/// `RateLimit: "load-shedding";r=0`), or gRPC `UNAVAILABLE` with a one-second pushback. Shedding is the first thing the layer does, before the deny lists, so that a busy
/// process spends nothing on what it sheds. Shed requests are counted as `shed` by
/// `tollgate_requests_total` and by priority in `tollgate_shed_requests_total`.
///
/// The capacity is this process's (Stripe's worker-utilisation shedder): what one replica can
/// work on at once. It is counted per `Shedding`: give clones of one to every layer that
/// shares it (one `route_layer` per route, say). For a cap on a whole fleet's requests in flight, add a
/// [concurrency rule](crate::Rule::concurrent) with a [`Global`](crate::key::Global) key on a
/// shared store (and a per-client one, so that one client cannot hold them all).
///
/// * [`Shedding::shares`]`(low, normal)` sets the two shares (in percent;
///   `0 < low <= normal < 100`); a capacity is at least 2, so that critical requests always keep
///   one place.
/// * Read the priority from what a client cannot choose (the route, an identity your
///   authentication layer put in the extensions), never from a header it sends as it likes.
/// * `cargo bench --bench shedding` measures it under a load that exceeds a server's capacity
///   (figures in `BENCHMARKS.md`).
///
/// One `Shedding` is one count of requests in flight: layers built with clones of it (one per
/// route with `route_layer`, say) share its capacity; layers given separate `Shedding::new`s
/// have one capacity each. Do not nest two layers of one `Shedding` around the same request:
/// it would be counted twice.
#[derive(Clone)]
pub struct Shedding {
    capacity: usize,
    low_percent: u8,
    normal_percent: u8,
    priority: PriorityFn,
    /// The count in flight and an adaptive capacity's controller, shared by clones.
    count: Arc<Count>,
}

/// What the layers of one [`Shedding`] share: the requests in flight, and the controller of an
/// adaptive capacity. One allocation, so that a request in flight holds one reference.
struct Count {
    in_flight: AtomicUsize,
    gradient: Option<Gradient>,
}

impl Shedding {
    /// At most `capacity` requests in flight: `low` ones up to 50 % of it, `normal` ones up to
    /// 80 %, `critical` ones all of it. Every request is `normal` until
    /// [`priority`](Shedding::priority) says otherwise.
    pub fn new(capacity: usize) -> Self {
        Shedding {
            capacity,
            low_percent: 50,
            normal_percent: 80,
            priority: Arc::new(|_: &Parts| Priority::Normal),
            count: Arc::new(Count {
                in_flight: AtomicUsize::new(0),
                gradient: None,
            }),
        }
    }

    /// Learns the capacity from measured latency, between `adaptive`'s least capacity and this
    /// one, its maximum (see [`Adaptive`]): `low` and `normal` requests share the learned
    /// capacity; `critical` ones may fill the maximum.
    ///
    /// ```
    /// use tollgate::{Adaptive, Priority, Quota, RateLimitLayer, Rule, Shedding};
    ///
    /// let shedding = Shedding::new(200)
    ///     .adaptive(Adaptive::new())
    ///     .priority(|parts: &http::request::Parts| match parts.uri.path() {
    ///         "/checkout" => Priority::Critical,
    ///         _ => Priority::Normal,
    ///     });
    /// let layer = RateLimitLayer::builder()
    ///     .rule(Rule::new("api", Quota::per_second(100)))
    ///     .shed(shedding.clone())
    ///     .build()?;
    /// // What it learned: `shedding.capacity_now()`, and the gauge `tollgate_shed_capacity`.
    /// # Ok::<(), tollgate::ConfigError>(())
    /// ```
    ///
    /// Call it before cloning the `Shedding`: it starts a new count, which the clones made
    /// after it share.
    pub fn adaptive(mut self, adaptive: Adaptive) -> Self {
        self.count = Arc::new(Count {
            in_flight: AtomicUsize::new(0),
            gradient: Some(Gradient::new(adaptive, self.capacity)),
        });
        self
    }

    /// The capacity now: the fixed one, or what an adaptive one learned (its least while it
    /// measures the no-load latency). `low` and `normal` requests take their shares of it.
    pub fn capacity_now(&self) -> usize {
        self.count
            .gradient
            .as_ref()
            .map_or(self.capacity, |gradient| gradient.capacity())
    }

    /// The requests in flight now, counted by the layers of this `Shedding` and its clones.
    pub fn in_flight(&self) -> usize {
        self.count.in_flight.load(Ordering::Acquire)
    }

    /// Reads each request's priority from its head. Read it from what a client cannot choose
    /// (the route, an identity an authentication layer put in the extensions), never from a
    /// header the client sends as it likes: every client would be `critical`.
    pub fn priority<F>(mut self, priority: F) -> Self
    where
        F: Fn(&Parts) -> Priority + Send + Sync + 'static,
    {
        self.priority = Arc::new(priority);
        self
    }

    /// The shares of the capacity `low` and `normal` requests may fill, in percent (defaults
    /// 50 and 80). `normal` must stay below 100: what is left is kept for `critical` requests.
    pub fn shares(mut self, low_percent: u8, normal_percent: u8) -> Self {
        self.low_percent = low_percent;
        self.normal_percent = normal_percent;
        self
    }

    /// Checks the settings and makes the shedder.
    pub(crate) fn build(self) -> Result<Shedder, ConfigError> {
        if self.capacity < 2 {
            return Err(ConfigError::new(format!(
                "load shedding with a capacity of {} keeps no share for critical requests; give \
                 it at least 2",
                self.capacity
            )));
        }
        if self.low_percent == 0
            || self.low_percent > self.normal_percent
            || self.normal_percent >= 100
        {
            return Err(ConfigError::new(format!(
                "load shedding shares of {} % (low) and {} % (normal); use 0 < low <= normal < 100, \
                 so that low requests go first and critical ones keep a share",
                self.low_percent, self.normal_percent
            )));
        }
        if let Some(gradient) = &self.count.gradient {
            gradient.settings().validate(self.capacity)?;
            gradient.set_least_share(self.low_percent);
        }
        Ok(Shedder {
            capacity: self.capacity,
            fixed: [
                share(self.capacity, self.low_percent),
                share(self.capacity, self.normal_percent),
            ],
            percents: [self.low_percent, self.normal_percent],
            priority: self.priority,
            count: self.count,
        })
    }
}

impl fmt::Debug for Shedding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shedding")
            .field("capacity", &self.capacity)
            .field("low_percent", &self.low_percent)
            .field("normal_percent", &self.normal_percent)
            .field(
                "adaptive",
                &self.count.gradient.as_ref().map(|g| g.settings()),
            )
            .finish_non_exhaustive()
    }
}

/// A layer's shedder: the requests in flight, and how many each class may join.
pub(crate) struct Shedder {
    /// The most in flight (critical requests may fill it).
    capacity: usize,
    /// The most in flight `low` and `normal` requests join, of the fixed capacity (made once).
    fixed: [usize; 2],
    /// The shares of `low` and `normal` requests, in percent (of a learned capacity).
    percents: [u8; 2],
    priority: PriorityFn,
    count: Arc<Count>,
}

/// The most in flight a request of a class with `percent` of `capacity` joins: at least one,
/// and one less than `capacity`, which critical requests keep.
fn share(capacity: usize, percent: u8) -> usize {
    (capacity.saturating_mul(usize::from(percent)) / 100)
        .clamp(1, capacity.saturating_sub(1).max(1))
}

impl Shedder {
    /// Lets a request in, counted until the returned guard is dropped; `Err` with its priority
    /// and its class's share when that share is full.
    pub(crate) fn enter(&self, parts: &Parts) -> Result<InFlight, (Priority, usize)> {
        let priority = (self.priority)(parts);
        let limit = match priority {
            Priority::Critical => self.capacity,
            class => match &self.count.gradient {
                None => self.fixed[class as usize],
                Some(gradient) => share(gradient.capacity(), self.percents[class as usize]),
            },
        };
        let before = self
            .count
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .map_err(|_| (priority, limit))?;
        let measured = self.count.gradient.as_ref().map(|gradient| {
            let now = gradient.now();
            Measured {
                entered: now,
                probe: gradient.entered(now, before + 1),
            }
        });
        Ok(InFlight {
            count: self.count.clone(),
            measured,
        })
    }

    /// The requests in flight now.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn in_flight(&self) -> usize {
        self.count.in_flight.load(Ordering::Acquire)
    }
}

/// One request in flight: counted out when dropped (its response body ended or was dropped,
/// or it never got that far); its latency, to the response's head, told to an adaptive
/// shedder when the inner service answers.
pub(crate) struct InFlight {
    count: Arc<Count>,
    measured: Option<Measured>,
}

/// When a request of an adaptive shedder was let in. Only a request the inner service answered
/// is a latency of the service: one the layer refused, or whose client left while it was
/// decided, says nothing of it, and would let any client that is refused fast teach the
/// shedder a no-load latency of microseconds.
struct Measured {
    entered: u64,
    probe: u64,
}

impl InFlight {
    /// The inner service answered this request: its latency is learned now, at the response's
    /// head, so that a client reading the body slowly (or a stream) does not stand for a queue.
    /// The request stays in flight until its body ends.
    pub(crate) fn served(mut self) -> Self {
        if let (Some(m), Some(gradient)) = (self.measured.take(), &self.count.gradient) {
            let updated = gradient.ended(m.entered, gradient.now(), m.probe);
            #[cfg(feature = "metrics")]
            if updated {
                let (base, recent) = gradient.latencies();
                crate::telemetry::shed_capacity(gradient.capacity(), base, recent);
            }
            #[cfg(not(feature = "metrics"))]
            let _ = updated;
        }
        self
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.count.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(path: &str) -> Parts {
        http::Request::get(path).body(()).unwrap().into_parts().0
    }

    #[test]
    fn the_lowest_classes_are_shed_first_and_critical_keeps_a_share() {
        let shedder = Shedding::new(10)
            .priority(|p: &Parts| match p.uri.path() {
                "/critical" => Priority::Critical,
                "/low" => Priority::Low,
                _ => Priority::Normal,
            })
            .build()
            .unwrap();
        let mut held = Vec::new();
        for _ in 0..5 {
            held.push(shedder.enter(&parts("/low")).unwrap());
        }
        assert_eq!(
            shedder.enter(&parts("/low")).err().map(|e| e.0),
            Some(Priority::Low)
        );
        for _ in 0..3 {
            held.push(shedder.enter(&parts("/normal")).unwrap());
        }
        assert_eq!(
            shedder.enter(&parts("/normal")).err(),
            Some((Priority::Normal, 8))
        );
        for _ in 0..2 {
            held.push(shedder.enter(&parts("/critical")).unwrap());
        }
        assert_eq!(
            shedder.enter(&parts("/critical")).err(),
            Some((Priority::Critical, 10))
        );
        assert_eq!(shedder.in_flight(), 10);
        held.truncate(4);
        assert_eq!(shedder.in_flight(), 4);
        assert!(shedder.enter(&parts("/low")).is_ok());
    }

    #[test]
    fn critical_requests_keep_a_share_at_the_smallest_capacity_and_clones_share_one_count() {
        let shedding = Shedding::new(2).priority(|p: &Parts| match p.uri.path() {
            "/critical" => Priority::Critical,
            _ => Priority::Normal,
        });
        let (one, two) = (shedding.clone().build().unwrap(), shedding.build().unwrap());
        let held = one.enter(&parts("/normal")).unwrap();
        assert_eq!(
            two.enter(&parts("/normal")).err().map(|e| e.0),
            Some(Priority::Normal)
        );
        let critical = two.enter(&parts("/critical")).unwrap();
        assert_eq!(one.in_flight(), 2);
        drop((held, critical));
        assert_eq!(two.in_flight(), 0);
    }

    #[test]
    fn an_adaptive_shedder_learns_only_from_requests_the_service_answered() {
        let shedding = Shedding::new(64).adaptive(Adaptive::new());
        let shedder = shedding.clone().build().unwrap();
        // Refused by the layer, or left by their client: their microseconds teach nothing.
        for _ in 0..200 {
            drop(shedder.enter(&parts("/")).unwrap());
        }
        let gradient = shedding.count.gradient.as_ref().unwrap();
        assert_eq!(gradient.latencies(), (0, 0), "no sample taken");
        assert_eq!(shedding.capacity_now(), 4, "still measuring");
        // Answered by the service: its latency is learned.
        for _ in 0..60 {
            drop(shedder.enter(&parts("/")).unwrap().served());
        }
        assert_ne!(gradient.latencies().0, 0, "the no-load latency measured");
    }

    #[tokio::test(start_paused = true)]
    async fn a_latency_ends_at_the_response_head_not_at_a_slow_readers_last_byte() {
        let shedding = Shedding::new(64).adaptive(Adaptive::new());
        let shedder = shedding.clone().build().unwrap();
        for _ in 0..50 {
            let entered = shedder.enter(&parts("/")).unwrap();
            tokio::time::advance(std::time::Duration::from_millis(2)).await;
            // Answered after 2 ms; its body then read for a second.
            let body = entered.served();
            tokio::time::advance(std::time::Duration::from_secs(1)).await;
            drop(body);
        }
        let (base, _) = shedding.count.gradient.as_ref().unwrap().latencies();
        assert!((1_900..=2_100).contains(&base), "a base of {base} µs");
        assert_eq!(shedder.in_flight(), 0);
    }

    #[test]
    fn bad_settings_are_refused() {
        assert!(Shedding::new(0).build().is_err());
        assert!(Shedding::new(1).build().is_err());
        assert!(Shedding::new(10).shares(0, 50).build().is_err());
        assert!(Shedding::new(10).shares(60, 50).build().is_err());
        assert!(Shedding::new(10).shares(50, 100).build().is_err());
    }
}
