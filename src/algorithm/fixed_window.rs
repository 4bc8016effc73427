//! Fixed window: a counter per calendar window.

use super::{Limits, Outcome};

/// The state of one fixed-window key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FixedWindowState {
    /// Start of the counted window (a multiple of the period since the Unix epoch).
    pub start: u64,
    /// Cost admitted in that window.
    pub count: u64,
}

/// The fixed window algorithm: windows are aligned to multiples of the period on the store's
/// clock, so every replica and the Redis store agree on where a window starts.
///
/// `limit` = quota; `remaining` = quota left in this window; `reset`, `retry_after` and `window` =
/// time until the next window starts (`reset` is 0 when nothing is counted).
#[derive(Clone, Copy, Debug)]
pub struct FixedWindow;

impl FixedWindow {
    fn count(limits: &Limits, state: Option<&FixedWindowState>, now: u64) -> (u64, u64) {
        let start = now - now % limits.period;
        let count = match state {
            Some(s) if s.start == start => s.count,
            _ => 0,
        };
        (start, count)
    }

    /// Checks a request of `cost` at `now`.
    #[inline]
    pub fn check(
        limits: &Limits,
        state: Option<&FixedWindowState>,
        now: u64,
        cost: u64,
    ) -> Outcome {
        let (start, count) = Self::count(limits, state, now);
        let until_next = start + limits.period - now;
        let allowed = count + cost <= limits.limit;
        let used = if allowed { count + cost } else { count };
        Outcome {
            allowed,
            limit: limits.limit,
            remaining: limits.limit.saturating_sub(used),
            reset: if used == 0 { 0 } else { until_next },
            retry_after: if allowed { 0 } else { until_next },
            window: until_next,
        }
    }

    /// Charges `cost` at `now`; `None` when nothing is counted.
    #[inline]
    pub fn commit(
        limits: &Limits,
        state: Option<&FixedWindowState>,
        now: u64,
        cost: u64,
    ) -> Option<FixedWindowState> {
        let (start, count) = Self::count(limits, state, now);
        let count = count + cost;
        (count > 0).then_some(FixedWindowState { start, count })
    }
}
