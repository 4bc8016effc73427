//! Concurrency: the requests in flight, each holding its units from admission until the layer
//! gives them back, or until the longest hold has passed.

use std::collections::VecDeque;

use super::{Limits, MICROS_PER_SECOND, Outcome};

/// The state of one concurrency key: the time each held unit was taken, oldest first.
///
/// Never longer than the limit, except by a forced charge (at most
/// [`MAX_LOG_ENTRIES`](super::MAX_LOG_ENTRIES) entries).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConcurrencyState {
    /// Microseconds on the store's clock, ascending.
    pub taken: VecDeque<u64>,
}

/// The longest `retry_after` a concurrency limit answers: a slot is usually given back within a
/// request's time, so a client is told to try again within a second, or sooner when a held slot
/// expires sooner.
pub const CONCURRENCY_RETRY_MICROS: u64 = MICROS_PER_SECOND;

/// The concurrency limit: at most `limit` units held at once; a unit taken at `t` is held until
/// it is given back ([`Algorithm::refund`](crate::Algorithm::refund) with `at == t`) or until
/// `t + period` (the longest hold: a holder that never gives it back, a replica that died).
///
/// `limit` = the slots; `remaining` = the free ones; `reset` = the time until the newest held
/// unit expires (how long the store keeps the key); `retry_after` = an estimate, at most
/// [`CONCURRENCY_RETRY_MICROS`] (a slot is given back when a request ends, which no store can
/// foresee), or the time until enough held units expire when that is sooner; `window` the same
/// estimate for one more unit.
#[derive(Clone, Copy, Debug)]
pub struct Concurrency;

impl Concurrency {
    /// Checks a request of `cost` at `now`.
    #[inline]
    pub fn check(
        limits: &Limits,
        state: Option<&ConcurrencyState>,
        now: u64,
        cost: u64,
    ) -> Outcome {
        let empty = VecDeque::new();
        let taken = state.map_or(&empty, |s| &s.taken);
        let first = super::SlidingWindowLog::first_live(limits, taken, now);
        let count = (taken.len() - first) as u64;
        // The oldest held unit expires first.
        let expires = |i: usize| taken[first + i] + limits.period - now;
        let window =
            if count > 0 { expires(0) } else { limits.period }.clamp(1, CONCURRENCY_RETRY_MICROS);
        let newest = taken.back().filter(|_| count > 0).copied();
        if count + cost <= limits.limit {
            // A held unit's hold has not ended: its reset never underflows.
            super::SlidingWindowLog::admitted(limits, newest, now, count, cost, window)
        } else {
            // The `must_leave`-th oldest held unit expires, at the latest.
            let must_leave = count + cost - limits.limit;
            let retry_after = if must_leave <= count {
                expires(must_leave as usize - 1).min(CONCURRENCY_RETRY_MICROS)
            } else {
                // A cost above the limit never fits.
                u64::MAX
            };
            let reset = newest.map_or(0, |t| t + limits.period - now);
            super::SlidingWindowLog::denied(limits, count, reset, retry_after, window)
        }
    }

    /// Drops the units whose hold expired and takes `cost` units at `now` (kept in order, should
    /// the clock step back); `None` when nothing is held.
    #[inline]
    pub fn commit(
        limits: &Limits,
        state: Option<ConcurrencyState>,
        now: u64,
        cost: u64,
    ) -> Option<ConcurrencyState> {
        let mut state = state.unwrap_or_default();
        let first = super::SlidingWindowLog::first_live(limits, &state.taken, now);
        state.taken.drain(..first);
        Self::insert(&mut state, now, cost as usize);
        (!state.taken.is_empty()).then_some(state)
    }

    /// Inserts `n` units taken at `now` after every unit taken no later.
    pub(crate) fn insert(state: &mut ConcurrencyState, now: u64, n: usize) {
        let at = state.taken.partition_point(|&t| t <= now);
        if at == state.taken.len() {
            state.taken.extend(std::iter::repeat_n(now, n));
        } else {
            for _ in 0..n {
                state.taken.insert(at, now);
            }
        }
    }

    /// Gives back up to `cost` units taken at `at`, if they are still there (a unit whose hold
    /// expired may be gone already, and no other holder's unit is ever taken for it). Nothing
    /// else is touched: a give-back may come from a request decided under an older policy,
    /// whose longest hold was not this one.
    pub(crate) fn give_back(
        _limits: &Limits,
        mut state: ConcurrencyState,
        _now: u64,
        cost: u64,
        at: u64,
    ) -> Option<ConcurrencyState> {
        let from = state.taken.partition_point(|&t| t < at);
        let to = state.taken.partition_point(|&t| t <= at);
        let n = (to - from).min(cost as usize);
        state.taken.drain(from..from + n);
        (!state.taken.is_empty()).then_some(state)
    }
}
