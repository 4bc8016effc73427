//! GCRA: the token bucket as one "theoretical arrival time".

use super::{Limits, Outcome};

/// The state of one GCRA key: the theoretical arrival time, in microseconds on the store's clock.
///
/// The bucket is empty at `tat` minus nothing and full at `tat`: it holds
/// `(now + burst × interval − tat) / interval` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GcraState {
    /// Theoretical arrival time: when the bucket will be full again.
    pub tat: u64,
}

/// The generic cell rate algorithm.
///
/// Decisions equal the [`TokenBucket`](super::TokenBucket)'s; the meaning of the numbers too:
/// `limit` = burst, `remaining` = whole tokens left, `reset` = `tat − now`, `retry_after` = time
/// until `cost` tokens fit, `window` = time until `remaining + 1` tokens fit.
#[derive(Clone, Copy, Debug)]
pub struct Gcra;

impl Gcra {
    fn start(state: Option<&GcraState>, now: u64) -> u64 {
        state.map_or(now, |s| s.tat.max(now))
    }

    /// Checks a request of `cost` at `now`.
    #[inline]
    pub fn check(limits: &Limits, state: Option<&GcraState>, now: u64, cost: u64) -> Outcome {
        let tat = Self::start(state, now);
        let capacity_end = now + limits.burst * limits.interval;
        let new_tat = tat + cost * limits.interval;
        // The time until `remaining + 1` tokens fit after a theoretical arrival time `after`.
        let window = |after: u64, remaining: u64| {
            (after + (remaining + 1) * limits.interval).saturating_sub(capacity_end)
        };
        if new_tat <= capacity_end {
            let remaining = (capacity_end - new_tat) / limits.interval;
            Outcome {
                allowed: true,
                limit: limits.burst,
                remaining,
                reset: new_tat - now,
                retry_after: 0,
                window: window(new_tat, remaining),
            }
        } else {
            let remaining = capacity_end.saturating_sub(tat) / limits.interval;
            Outcome {
                allowed: false,
                limit: limits.burst,
                remaining,
                reset: tat - now,
                retry_after: new_tat - capacity_end,
                window: window(tat, remaining),
            }
        }
    }

    /// Charges `cost` at `now`; `None` when the bucket is left full.
    #[inline]
    pub fn commit(
        limits: &Limits,
        state: Option<&GcraState>,
        now: u64,
        cost: u64,
    ) -> Option<GcraState> {
        let tat = Self::start(state, now) + cost * limits.interval;
        (tat > now).then_some(GcraState { tat })
    }
}
