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
/// binary search, exact); `window` = the earliest time `remaining + 1` fits (the rest of the
/// current window when nothing is counted).
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

    /// The time from `now` until a request of `cost` (at most the quota) fits `state`: the first
    /// microsecond at which [`admits`](Self::admits) holds. The estimate never grows while
    /// nothing is charged, so that time is found from where the weighted count crosses the
    /// threshold, computed exactly in integers, then stepped to the microsecond with the
    /// floating-point test itself (the model and the Lua script compute the same test the same
    /// way, so they agree bit for bit).
    fn time_until_fits(
        limits: &Limits,
        state: Option<&SlidingWindowCounterState>,
        now: u64,
        cost: u64,
    ) -> u64 {
        let c = Self::counters(limits, state, now);
        let period = limits.period;
        let end = c.start + period;
        // `floor(weight × x / period) <= allowed` holds for every x up to the returned one,
        // where x is the time left until the weight's window ends.
        let largest_x = |weight: u64, allowed: u64| -> u64 {
            if weight == 0 {
                return u64::MAX;
            }
            let bound = (u128::from(allowed) + 1) * u128::from(period);
            u64::try_from(bound.div_ceil(u128::from(weight)) - 1).unwrap_or(u64::MAX)
        };
        let guess = if c.current + cost <= limits.limit {
            // Within this window: the previous window's weight has to decay.
            let x = largest_x(c.previous, limits.limit - c.current - cost);
            end.saturating_sub(x).max(now)
        } else {
            // Only once this window is the previous one.
            let x = largest_x(c.current, limits.limit - cost).min(period);
            end + period - x
        };
        let fits = |t: u64| Self::admits(limits, state, t, cost);
        first_fit(now, c.start + 2 * period, guess, fits) - now
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
            Self::time_until_fits(limits, state, now, cost)
        };
        let remaining = limits
            .limit
            .saturating_sub(estimate + if allowed { cost } else { 0 });
        let window = if remaining >= limits.limit {
            // Nothing counted: a full budget cannot be exceeded before the window ends.
            c.start + limits.period - now
        } else {
            // The state this outcome describes: charged when admitted.
            let after = SlidingWindowCounterState {
                start: c.start,
                previous: u32::try_from(c.previous).unwrap_or(u32::MAX),
                current: u32::try_from(current).unwrap_or(u32::MAX),
            };
            Self::time_until_fits(limits, Some(&after), now, remaining + 1).max(1)
        };
        Outcome {
            allowed,
            limit: limits.limit,
            remaining,
            reset,
            retry_after,
            window,
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

/// The first `t` in `from..=to` for which `fits(t)` holds, where `fits` is false then true and
/// holds at `to`. `guess` is expected within a few microseconds of it: a few steps from there,
/// else a binary search.
fn first_fit(from: u64, to: u64, guess: u64, fits: impl Fn(u64) -> bool) -> u64 {
    const STEPS: u32 = 8;
    let mut t = guess.clamp(from, to);
    if fits(t) {
        for _ in 0..STEPS {
            if t == from || !fits(t - 1) {
                return t;
            }
            t -= 1;
        }
        binary_search(from, t, fits)
    } else {
        for _ in 0..STEPS {
            t += 1;
            if fits(t) {
                return t;
            }
        }
        binary_search(t, to, fits)
    }
}

/// The first `t` in `low..=high` for which `fits(t)` holds (it holds at `high`).
fn binary_search(mut low: u64, mut high: u64, fits: impl Fn(u64) -> bool) -> u64 {
    while low < high {
        let mid = low + (high - low) / 2;
        if fits(mid) {
            high = mid;
        } else {
            low = mid + 1;
        }
    }
    low
}
