//! Sliding window log: the time of every admitted unit of the last period.

use std::collections::VecDeque;

use super::{Limits, Outcome};

/// The largest quota of a [`SlidingWindowLog`](crate::Algorithm::SlidingWindowLog) rule: the log
/// keeps one entry per admitted cost unit (8 bytes in memory, a list element in Redis), and a
/// request can cost at most the quota, so one key never holds more than this many entries and one
/// request never writes more. A larger quota is a [`ConfigError`](crate::ConfigError): use the
/// sliding window counter (two numbers per key, whatever the quota) or a shorter period.
pub const MAX_LOG_ENTRIES: u64 = 10_000;

/// The state of one sliding-log key: one timestamp per admitted cost unit, oldest first.
///
/// Never longer than the quota: a unit is only added when it fits.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlidingWindowLogState {
    /// Microseconds on the store's clock, ascending.
    pub entries: VecDeque<u64>,
}

/// The sliding window log algorithm: a unit charged at `t` counts while `now < t + period`.
///
/// `limit` = quota; `remaining` = quota minus the units of the last period; `reset` = time until
/// the newest unit leaves the window; `retry_after` = time until enough old units have left;
/// `window` = time until the oldest unit leaves (a period when the log is empty).
#[derive(Clone, Copy, Debug)]
pub struct SlidingWindowLog;

impl SlidingWindowLog {
    /// Index of the first entry still inside the window at `now` (of a concurrency key: the
    /// first slot still held).
    pub(crate) fn first_live(limits: &Limits, entries: &VecDeque<u64>, now: u64) -> usize {
        entries.partition_point(|&t| t + limits.period <= now)
    }

    /// Checks a request of `cost` at `now`.
    #[inline]
    pub fn check(
        limits: &Limits,
        state: Option<&SlidingWindowLogState>,
        now: u64,
        cost: u64,
    ) -> Outcome {
        let empty = VecDeque::new();
        let entries = state.map_or(&empty, |s| &s.entries);
        let first = Self::first_live(limits, entries, now);
        let count = (entries.len() - first) as u64;
        // The oldest unit leaves first; an empty log fills from now.
        let oldest = entries.get(first).copied().unwrap_or(now);
        let window = (oldest + limits.period).saturating_sub(now).max(1);
        if count + cost <= limits.limit {
            Self::admitted(limits, entries.back().copied(), now, count, cost, window)
        } else {
            // The `must_leave`-th oldest live entry has to leave the window first.
            let must_leave = (count + cost - limits.limit) as usize;
            let reset = entries
                .back()
                .map_or(0, |&t| (t + limits.period).saturating_sub(now));
            let retry_after = match must_leave
                .checked_sub(1)
                .and_then(|i| entries.get(first + i))
            {
                Some(&leaving) if must_leave as u64 <= count => leaving + limits.period - now,
                // A cost above the quota never fits.
                _ => u64::MAX,
            };
            Self::denied(limits, count, reset, retry_after, window)
        }
    }

    /// The outcome of `cost` units admitted where `count` are live, the newest of them (of those
    /// kept) taken at `newest`: the budget is full again a period after the newest unit, the
    /// one taken now included. Shared with [`Concurrency`](super::Concurrency).
    #[inline]
    pub(crate) fn admitted(
        limits: &Limits,
        newest: Option<u64>,
        now: u64,
        count: u64,
        cost: u64,
        window: u64,
    ) -> Outcome {
        let newest = match (newest, cost) {
            (Some(t), 0) => Some(t),
            (Some(t), _) => Some(t.max(now)),
            (None, 0) => None,
            (None, _) => Some(now),
        };
        Outcome {
            allowed: true,
            limit: limits.limit,
            remaining: limits.limit - count - cost,
            reset: newest.map_or(0, |t| (t + limits.period).saturating_sub(now)),
            retry_after: 0,
            window,
        }
    }

    /// The outcome of a request denied where `count` units are live. Shared with
    /// [`Concurrency`](super::Concurrency).
    #[inline]
    pub(crate) fn denied(
        limits: &Limits,
        count: u64,
        reset: u64,
        retry_after: u64,
        window: u64,
    ) -> Outcome {
        Outcome {
            allowed: false,
            limit: limits.limit,
            remaining: limits.limit.saturating_sub(count),
            reset,
            retry_after,
            window,
        }
    }

    /// Drops the units that left the window and adds `cost` units at `now`; `None` when the log
    /// is left empty.
    #[inline]
    pub fn commit(
        limits: &Limits,
        state: Option<SlidingWindowLogState>,
        now: u64,
        cost: u64,
    ) -> Option<SlidingWindowLogState> {
        let mut state = state.unwrap_or_default();
        let first = Self::first_live(limits, &state.entries, now);
        state.entries.drain(..first);
        // Keep the log sorted even if the clock stepped back.
        let at = state.entries.back().map_or(now, |&t| t.max(now));
        state.entries.extend(std::iter::repeat_n(at, cost as usize));
        (!state.entries.is_empty()).then_some(state)
    }
}
