use std::time::Duration;

/// How much: `limit` requests per `period`, and for token bucket and GCRA an optional burst.
///
/// `Quota::per_second(n)` means *n requests per second* (never one request every n seconds).
///
/// ```
/// use std::time::Duration;
/// use tollgate::Quota;
///
/// let quota = Quota::per_minute(100).burst(20);
/// assert_eq!(quota.limit(), 100);
/// assert_eq!(quota.period(), Duration::from_secs(60));
/// assert_eq!(quota.burst_size(), Some(20));
/// assert_eq!(Quota::new(5, Duration::from_secs(10)).limit(), 5);
/// ```
///
/// Values are checked when the layer is built: a zero limit, period or burst is a
/// [`ConfigError`](crate::ConfigError), never a panic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Quota {
    limit: u64,
    period: Duration,
    burst: Option<u64>,
}

impl Quota {
    /// `limit` requests per `period`.
    pub const fn new(limit: u64, period: Duration) -> Self {
        Quota {
            limit,
            period,
            burst: None,
        }
    }

    /// `limit` requests per second.
    pub const fn per_second(limit: u64) -> Self {
        Self::new(limit, Duration::from_secs(1))
    }

    /// `limit` requests per minute.
    pub const fn per_minute(limit: u64) -> Self {
        Self::new(limit, Duration::from_secs(60))
    }

    /// `limit` requests per hour.
    pub const fn per_hour(limit: u64) -> Self {
        Self::new(limit, Duration::from_secs(3600))
    }

    /// `limit` requests per day (24 hours).
    pub const fn per_day(limit: u64) -> Self {
        Self::new(limit, Duration::from_secs(86_400))
    }

    /// The bucket size of token bucket and GCRA: how many requests may arrive at once. Defaults
    /// to `limit`. Window algorithms have no burst; setting one for them is a configuration error.
    pub const fn burst(mut self, burst: u64) -> Self {
        self.burst = Some(burst);
        self
    }

    /// Requests per period.
    pub const fn limit(&self) -> u64 {
        self.limit
    }

    /// The period.
    pub const fn period(&self) -> Duration {
        self.period
    }

    /// The burst, if set.
    pub const fn burst_size(&self) -> Option<u64> {
        self.burst
    }
}
