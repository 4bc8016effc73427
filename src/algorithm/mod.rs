//! The reference model: each algorithm as a pure state transition.
//!
//! ```
//! use tollgate::algorithm::{Limits, TokenBucket};
//!
//! // 2 requests per second, burst of 2; times are microseconds on the store's clock.
//! let limits = Limits::new(2, 1_000_000, 2).unwrap();
//! let mut bucket = None;
//! let now = 10_000_000;
//! for _ in 0..2 {
//!     let outcome = TokenBucket::check(&limits, bucket.as_ref(), now, 1);
//!     assert!(outcome.allowed);
//!     bucket = TokenBucket::commit(&limits, bucket.as_ref(), now, 1);
//! }
//! let denied = TokenBucket::check(&limits, bucket.as_ref(), now, 1);
//! assert!(!denied.allowed);
//! assert_eq!(denied.retry_after, 500_000); // one token every 0.5 s
//! ```
//!
//! Nothing here does I/O or reads a clock: `now` is given in microseconds by the store, which
//! takes it from its own clock (Redis `TIME`, or the memory store's [`Clock`](crate::clock::Clock)).
//! Every algorithm is split in two steps, [`check`](TokenBucket::check) (what would happen) and
//! [`commit`](TokenBucket::commit) (charge it), so that a store can check every rule of a request
//! first and charge them only when all of them admit it.
//!
//! The Lua scripts of the Redis store mirror these functions line by line, with the same integer
//! arithmetic (all values stay below 2^53, so Lua's doubles compute them exactly), and a
//! differential test holds the two together.
//!
//! # What the numbers mean
//!
//! Every check returns an [`Outcome`]:
//!
//! * `limit`: the most a client can spend at once (the burst for token bucket and GCRA, the quota
//!   for the window algorithms);
//! * `remaining`: what is left after this request (when denied: what is left now);
//! * `reset`: microseconds until the key is back to its full budget, which is also how long the
//!   store keeps the key;
//! * `retry_after`: for a denied request, microseconds until the same request would be admitted
//!   (exact: a retry at `now + retry_after` is admitted, one a microsecond earlier is not);
//! * `window`: the effective window of draft-ietf-httpapi-ratelimit-headers-11: microseconds
//!   until `remaining + 1` units would be admitted, so the client can use no more than
//!   `remaining` within it. A denied request's `retry_after` is never shorter than its `window`,
//!   so a `Retry-After` never points before the end of a denying policy's window.
//!
//! A denied request is charged nothing, so the outcome of every rule it was checked against,
//! denying or not, describes the budget as it stands ([`Algorithm::uncharged`]).
//!
//! # Debts
//!
//! [`Algorithm::force`] charges whatever the budget (a cost settled after the fact), and
//! [`Algorithm::refund`] gives units back. What a charge beyond the budget leaves, by algorithm:
//!
//! * token bucket and GCRA: the time the bucket is full again moves further out, so the next
//!   requests wait until the debt has refilled too;
//! * fixed window: the window's count goes past the quota; the window's end forgives it;
//! * sliding window counter: the current window's count goes past the quota; it weighs on the
//!   next window too, as a previous window does;
//! * sliding window log: one entry per unit, so it holds a debt only as entries, at most
//!   [`MAX_LOG_ENTRIES`] in all; the layer refuses to settle rules of this algorithm.
//! * concurrency: units held beyond the limit, at most [`MAX_LOG_ENTRIES`], until they are
//!   given back or their hold expires. Its refund gives back the units taken at `at`, and only
//!   those: a unit whose hold expired is free already.
//!
//! [`Algorithm::uncharged`]: crate::Algorithm::uncharged
//! [`Algorithm::force`]: crate::Algorithm::force
//! [`Algorithm::refund`]: crate::Algorithm::refund

mod adjust;
mod concurrency;
pub(crate) mod decision;
mod dispatch;
mod fixed_window;
mod gcra;
pub(crate) mod kind;
mod sliding_counter;
mod sliding_log;
mod token_bucket;

pub use adjust::MAX_DEBT_MICROS;
pub use concurrency::{CONCURRENCY_RETRY_MICROS, Concurrency, ConcurrencyState};
pub use fixed_window::{FixedWindow, FixedWindowState};
pub use gcra::{Gcra, GcraState};
pub use sliding_counter::{SlidingWindowCounter, SlidingWindowCounterState};
pub use sliding_log::{MAX_LOG_ENTRIES, SlidingWindowLog, SlidingWindowLogState};
pub use token_bucket::{TokenBucket, TokenBucketState};

use std::fmt;

/// Microseconds in one second.
pub const MICROS_PER_SECOND: u64 = 1_000_000;

/// The largest time value (in microseconds) the model works with: 2^53, the range in which Lua's
/// doubles hold integers exactly. Periods and bursts are validated to keep all sums below it.
pub const MAX_MICROS: u64 = 1 << 53;

/// The longest period a quota may have: 366 days.
pub const MAX_PERIOD_MICROS: u64 = 366 * 24 * 3600 * MICROS_PER_SECOND;

/// The longest time a bucket may take to refill from empty (`burst × interval`): ten periods of
/// the longest length. It keeps every time sum of the model far below 2^53.
pub const MAX_REFILL_MICROS: u64 = 10 * MAX_PERIOD_MICROS;

/// The validated numbers of one rule, in microseconds. Made only by [`Limits::new`], which checks
/// them (the fields are readable, not writable from outside the crate).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Limits {
    /// Requests (cost units) per period.
    pub limit: u64,
    /// The period, in microseconds.
    pub period: u64,
    /// The bucket size of token bucket and GCRA (equal to `limit` unless set).
    pub burst: u64,
    /// Microseconds between two tokens: `period / limit`, rounded up so that the rate is never
    /// higher than the quota says.
    pub interval: u64,
}

/// Why a set of numbers cannot be a [`Limits`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LimitsError {
    /// The quota is zero.
    ZeroLimit,
    /// The period is zero (or shorter than a microsecond).
    ZeroPeriod,
    /// The burst is zero.
    ZeroBurst,
    /// The period is longer than [`MAX_PERIOD_MICROS`].
    PeriodTooLong,
    /// More than one request per microsecond.
    RateTooHigh,
    /// The burst times the interval is longer than [`MAX_REFILL_MICROS`].
    BurstTooLarge,
}

impl fmt::Display for LimitsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LimitsError::ZeroLimit => "the quota is 0 requests; use at least 1",
            LimitsError::ZeroPeriod => "the period is shorter than one microsecond; use a longer one",
            LimitsError::ZeroBurst => "the burst is 0; use at least 1 (or leave it unset)",
            LimitsError::PeriodTooLong => "the period is longer than 366 days; use a shorter one",
            LimitsError::RateTooHigh => {
                "the quota allows more than one request per microsecond; lower it or lengthen the period"
            }
            LimitsError::BurstTooLarge => {
                "the burst takes longer than 3660 days to refill; lower the burst or raise the rate"
            }
        })
    }
}

impl std::error::Error for LimitsError {}

impl Limits {
    /// Validates `limit` requests per `period` microseconds with a bucket of `burst`.
    pub fn new(limit: u64, period: u64, burst: u64) -> Result<Self, LimitsError> {
        if limit == 0 {
            return Err(LimitsError::ZeroLimit);
        }
        if period == 0 {
            return Err(LimitsError::ZeroPeriod);
        }
        if burst == 0 {
            return Err(LimitsError::ZeroBurst);
        }
        if period > MAX_PERIOD_MICROS {
            return Err(LimitsError::PeriodTooLong);
        }
        if limit > period {
            return Err(LimitsError::RateTooHigh);
        }
        let interval = period.div_ceil(limit);
        match burst.checked_mul(interval) {
            Some(full) if full <= MAX_REFILL_MICROS => {}
            _ => return Err(LimitsError::BurstTooLarge),
        }
        Ok(Limits {
            limit,
            period,
            burst,
            interval,
        })
    }
}

/// The result of checking one rule for one request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Whether this rule admits the request.
    pub allowed: bool,
    /// The most that can be spent at once (burst, or quota for window algorithms).
    pub limit: u64,
    /// What is left after this request if admitted, what is left now if denied.
    pub remaining: u64,
    /// Microseconds until the budget is full again (and the key may expire).
    pub reset: u64,
    /// Microseconds until this request would be admitted; 0 when admitted.
    pub retry_after: u64,
    /// The effective window (draft-ietf-httpapi-ratelimit-headers-11 §4.1.2, the `t` of the
    /// `RateLimit` field): microseconds within which the client can use no more than
    /// `remaining`, which is the time until `remaining + 1` units would be admitted. When
    /// nothing is spent (`remaining == limit`), the time within which a full budget cannot be
    /// exceeded: one interval for token bucket and GCRA, the rest of the window for the window
    /// algorithms, a period for the sliding log. Never 0.
    pub window: u64,
}

/// The state of one key under any algorithm, as the memory store keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// See [`TokenBucket`].
    TokenBucket(TokenBucketState),
    /// See [`Gcra`].
    Gcra(GcraState),
    /// See [`FixedWindow`].
    FixedWindow(FixedWindowState),
    /// See [`SlidingWindowLog`] (boxed: the log is the one state that grows).
    SlidingWindowLog(Box<SlidingWindowLogState>),
    /// See [`SlidingWindowCounter`].
    SlidingWindowCounter(SlidingWindowCounterState),
    /// See [`Concurrency`] (boxed: one entry per held unit).
    Concurrency(Box<ConcurrencyState>),
}

impl State {
    fn token_bucket(&self) -> Option<&TokenBucketState> {
        match self {
            State::TokenBucket(s) => Some(s),
            _ => None,
        }
    }
    fn gcra(&self) -> Option<&GcraState> {
        match self {
            State::Gcra(s) => Some(s),
            _ => None,
        }
    }
    fn fixed_window(&self) -> Option<&FixedWindowState> {
        match self {
            State::FixedWindow(s) => Some(s),
            _ => None,
        }
    }
    fn sliding_log(&self) -> Option<&SlidingWindowLogState> {
        match self {
            State::SlidingWindowLog(s) => Some(s),
            _ => None,
        }
    }
    fn sliding_counter(&self) -> Option<&SlidingWindowCounterState> {
        match self {
            State::SlidingWindowCounter(s) => Some(s),
            _ => None,
        }
    }
    fn concurrency(&self) -> Option<&ConcurrencyState> {
        match self {
            State::Concurrency(s) => Some(s),
            _ => None,
        }
    }
}
