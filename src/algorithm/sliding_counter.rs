//! Sliding window counter: the previous window, weighted, plus the current one.

use super::{Limits, Outcome};

/// The state of one sliding-counter key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlidingWindowCounterState {
    /// Start of the current window (a multiple of the period since the Unix epoch).
    pub start: u64,
    /// Cost admitted in the window before `start`.
    pub previous: u32,
    /// Cost admitted since `start`.
    pub current: u32,
}

/// The sliding window counter algorithm.
///
/// The estimate at `now` is `floor(previous × (period − elapsed) / period) + current`, where
/// `elapsed` is the time since the current window started; a request fits when
/// `estimate + cost ≤ quota`. The weighting is computed in `f64` with the same operations as the
/// Lua script, so both give the same answer bit for bit.
///
/// Counters are 32-bit (keeping the memory store at 64 bytes a key): a rule with this algorithm
/// allows at most 4,294,967,295 per window.
///
/// `limit` = quota; `remaining` = quota minus the estimate; `reset` = time until both windows
/// have passed; `retry_after` = the earliest time the estimate has decayed enough (found by
/// binary search, exact).
#[derive(Clone, Copy, Debug)]
pub struct SlidingWindowCounter;

/// The two counters as they stand at some time.
#[derive(Clone, Copy)]
struct Counters {
    start: u64,
    previous: u64,
    current: u64,
}

impl SlidingWindowCounter {
    fn counters(limits: &Limits, state: Option<&SlidingWindowCounterState>, now: u64) -> Counters {
        let start = now - now % limits.period;
        let (previous, current) = match state {
            Some(s) if s.start == start => (u64::from(s.previous), u64::from(s.current)),
            Some(s) if s.start + limits.period == start => (u64::from(s.current), 0),
            _ => (0, 0),
        };
        Counters {
            start,
            previous,
            current,
        }
    }

    /// The weighted count at `now`.
    fn estimate(limits: &Limits, c: &Counters, now: u64) -> u64 {
        let elapsed = now - c.start;
        let weighted =
            (c.previous as f64) * ((limits.period - elapsed) as f64) / (limits.period as f64);
        weighted.floor() as u64 + c.current
    }

    fn admits(
        limits: &Limits,
        state: Option<&SlidingWindowCounterState>,
        at: u64,
        cost: u64,
    ) -> bool {
        let c = Self::counters(limits, state, at);
        Self::estimate(limits, &c, at) + cost <= limits.limit
    }

    /// Checks a request of `cost` at `now`.
    #[inline]
    pub fn check(
        limits: &Limits,
        state: Option<&SlidingWindowCounterState>,
        now: u64,
        cost: u64,
    ) -> Outcome {
        let c = Self::counters(limits, state, now);
        let estimate = Self::estimate(limits, &c, now);
        let allowed = estimate + cost <= limits.limit;
        let current = if allowed { c.current + cost } else { c.current };
        let reset = if current > 0 {
            c.start + 2 * limits.period - now
        } else if c.previous > 0 {
            c.start + limits.period - now
        } else {
            0
        };
        let retry_after = if allowed {
            0
        } else if cost > limits.limit {
            u64::MAX
        } else {
            // The estimate never grows while nothing is charged, so the first admitting time can
            // be found by binary search; two windows on, nothing is left at all.
            let (mut low, mut high) = (now, c.start + 2 * limits.period);
            while low < high {
                let mid = low + (high - low) / 2;
                if Self::admits(limits, state, mid, cost) {
                    high = mid;
                } else {
                    low = mid + 1;
                }
            }
            low - now
        };
        Outcome {
            allowed,
            limit: limits.limit,
            remaining: limits
                .limit
                .saturating_sub(estimate + if allowed { cost } else { 0 }),
            reset,
            retry_after,
        }
    }

    /// Charges `cost` at `now`; `None` when both counters are zero.
    #[inline]
    pub fn commit(
        limits: &Limits,
        state: Option<&SlidingWindowCounterState>,
        now: u64,
        cost: u64,
    ) -> Option<SlidingWindowCounterState> {
        let c = Self::counters(limits, state, now);
        let current = c.current + cost;
        // Counts never pass the quota, which rules keep within u32 for this algorithm.
        (current > 0 || c.previous > 0).then_some(SlidingWindowCounterState {
            start: c.start,
            previous: u32::try_from(c.previous).unwrap_or(u32::MAX),
            current: u32::try_from(current).unwrap_or(u32::MAX),
        })
    }
}
