//! [`Algorithm`]: which model a rule follows.

use std::fmt;

use super::Limits;

/// The rate-limiting algorithm of a rule. Each is a pure function of the
/// [reference model](crate::algorithm), which every store runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Algorithm {
    /// A bucket of `burst` tokens refilled at `limit / period`; each request takes `cost` tokens.
    /// Allows bursts up to the bucket size, then a steady rate. Two numbers per key.
    #[default]
    TokenBucket,
    /// The generic cell rate algorithm: the token bucket expressed as one "theoretical arrival
    /// time". Same decisions as [`TokenBucket`](Algorithm::TokenBucket), one number per key.
    Gcra,
    /// Counts requests per calendar window (aligned to the Unix epoch). Cheap, but lets a client
    /// send up to twice the quota around a window boundary.
    FixedWindow,
    /// Keeps the time of every admitted request of the last `period`: exact, no boundary burst,
    /// but one entry per admitted request (at most `limit` per key, and a quota of at most
    /// [`MAX_LOG_ENTRIES`](crate::algorithm::MAX_LOG_ENTRIES)). For low-volume routes.
    SlidingWindowLog,
    /// Weighs the previous fixed window by how much of it still overlaps the sliding window and
    /// adds the current one. Smooths the boundary burst with two counters per key; approximate.
    SlidingWindowCounter,
    /// Requests in flight: at most `limit` units held at once. A request holds its cost from
    /// admission until its response ends (the layer gives it back), and at most `period`, the
    /// longest hold, after which a unit never given back (a replica that died) is free again.
    /// Made by [`Rule::concurrent`](crate::Rule::concurrent); one entry per held unit, so at
    /// most [`MAX_LOG_ENTRIES`](crate::algorithm::MAX_LOG_ENTRIES).
    Concurrency,
}

impl Algorithm {
    /// All algorithms, in declaration order.
    pub const ALL: [Algorithm; 6] = [
        Algorithm::TokenBucket,
        Algorithm::Gcra,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindowLog,
        Algorithm::SlidingWindowCounter,
        Algorithm::Concurrency,
    ];

    /// A short stable name (`token_bucket`, `gcra`, `fixed_window`, `sliding_log`,
    /// `sliding_counter`, `concurrency`), for logs and messages.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::Gcra => "gcra",
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindowLog => "sliding_log",
            Algorithm::SlidingWindowCounter => "sliding_counter",
            Algorithm::Concurrency => "concurrency",
        }
    }

    /// The most one request may cost: the burst for token bucket and GCRA, the quota otherwise.
    pub const fn capacity(self, limits: &Limits) -> u64 {
        if self.has_burst() {
            limits.burst
        } else {
            limits.limit
        }
    }

    /// Whether the algorithm has a burst separate from its quota (token bucket and GCRA).
    pub const fn has_burst(self) -> bool {
        matches!(self, Algorithm::TokenBucket | Algorithm::Gcra)
    }

    /// Whether the algorithm counts requests in flight rather than a rate
    /// ([`Concurrency`](Algorithm::Concurrency)): its units are given back when a response ends.
    pub const fn is_concurrency(self) -> bool {
        matches!(self, Algorithm::Concurrency)
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
