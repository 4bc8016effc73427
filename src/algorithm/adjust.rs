//! Changing a charge after the fact: giving units back ([`Algorithm::refund`]) and charging more
//! than a check would admit ([`Algorithm::force`], a debt). The Lua code mirrors both.
//!
//! ```
//! use tollgate::Algorithm;
//! use tollgate::algorithm::Limits;
//!
//! let limits = Limits::new(10, 60_000_000, 10).unwrap(); // 10 per minute
//! let mut state = None;
//! let now = 1_000_000_000;
//! // A request estimated at 2 units...
//! assert!(Algorithm::TokenBucket.admit(&limits, &mut state, now, 2).allowed);
//! // ...really cost 15: the other 13 are charged though only 8 are left, a debt of 5.
//! Algorithm::TokenBucket.force(&limits, &mut state, now, 13);
//! let next = Algorithm::TokenBucket.check(&limits, state.as_ref(), now, 1);
//! assert!(!next.allowed);
//! assert_eq!(next.retry_after, 6 * 6_000_000); // the debt of 5, then the unit asked for
//! // Giving back the 13 clears the debt.
//! Algorithm::TokenBucket.refund(&limits, &mut state, now, 13, now);
//! assert_eq!(Algorithm::TokenBucket.check(&limits, state.as_ref(), now, 0).remaining, 8);
//! ```
//!
//! How each algorithm holds a debt: see [`algorithm`](crate::algorithm#debts).

use std::collections::VecDeque;

use super::{
    ConcurrencyState, FixedWindowState, GcraState, Limits, MAX_LOG_ENTRIES,
    SlidingWindowCounterState, SlidingWindowLogState, State, TokenBucketState,
};
use crate::Algorithm;

impl Algorithm {
    /// Gives back `cost` units charged at `at` (both on the store's clock): the state as if
    /// they had not been charged, as far as the algorithm can tell. Token bucket and GCRA move
    /// the time their bucket is full again back by the units' refill time; the window
    /// algorithms take them off the count of the window they were charged in (nothing when that
    /// window is gone); the sliding log drops its newest `cost` entries charged at or before
    /// `at` (never a later request's; an entry that left the window gives nothing back); a
    /// concurrency limit
    /// frees up to `cost` of the units taken at `at` still held. Leaves `None` when the state is
    /// the same as no state.
    pub fn refund(self, limits: &Limits, state: &mut Option<State>, now: u64, cost: u64, at: u64) {
        let old = state.take();
        *state = match (self, old) {
            (Algorithm::TokenBucket, Some(State::TokenBucket(s))) => {
                let tat =
                    bucket_full_at(limits, &s).saturating_sub(cost.saturating_mul(limits.interval));
                bucket_at(limits, tat, now)
            }
            (Algorithm::Gcra, Some(State::Gcra(s))) => {
                let tat = s.tat.saturating_sub(cost.saturating_mul(limits.interval));
                (tat > now).then_some(State::Gcra(GcraState { tat }))
            }
            (Algorithm::FixedWindow, Some(State::FixedWindow(s))) => {
                let charged = at - at % limits.period;
                if s.start == charged {
                    let count = s.count.saturating_sub(cost);
                    (count > 0).then_some(State::FixedWindow(FixedWindowState {
                        start: s.start,
                        count,
                    }))
                } else {
                    Some(State::FixedWindow(s))
                }
            }
            (Algorithm::SlidingWindowCounter, Some(State::SlidingWindowCounter(mut s))) => {
                let charged = at - at % limits.period;
                let units = u32::try_from(cost).unwrap_or(u32::MAX);
                if s.start == charged {
                    s.current = s.current.saturating_sub(units);
                } else if s.start == charged + limits.period {
                    s.previous = s.previous.saturating_sub(units);
                }
                (s.current > 0 || s.previous > 0).then_some(State::SlidingWindowCounter(s))
            }
            (Algorithm::SlidingWindowLog, Some(State::SlidingWindowLog(mut log))) => {
                // The newest `cost` entries charged at or before `at`: an entry after it is
                // another request's, which would then leave the window later than it should.
                let last = log.entries.partition_point(|&t| t <= at);
                log.entries.drain(last.saturating_sub(cost as usize)..last);
                (!log.entries.is_empty()).then_some(State::SlidingWindowLog(log))
            }
            (Algorithm::Concurrency, Some(State::Concurrency(held))) => {
                super::Concurrency::give_back(limits, *held, now, cost, at)
                    .map(|held| State::Concurrency(Box::new(held)))
            }
            // No state, or another algorithm's: nothing to give back.
            (_, old) => old,
        };
    }

    /// Charges `cost` units at `now` whatever the budget: a check would be admitted or not, the
    /// units are counted, and a charge beyond the budget is a debt that the next requests wait
    /// for (see [`algorithm`](crate::algorithm#debts) for how each algorithm holds one).
    ///
    /// Debts are bounded: a bucket is never full again later than [`MAX_DEBT_MICROS`] from now,
    /// a fixed window never counts more than [`MAX_MICROS`](super::MAX_MICROS) (2^53), a
    /// sliding window counter's window not more than `u32::MAX`.
    pub fn force(self, limits: &Limits, state: &mut Option<State>, now: u64, cost: u64) {
        let old = state.take();
        // The time a bucket of `tat` is full again after `cost` more, bounded.
        let later = |tat: u64| {
            tat.max(now)
                .saturating_add(cost.saturating_mul(limits.interval))
                .min(now.saturating_add(MAX_DEBT_MICROS))
        };
        *state = match self {
            Algorithm::TokenBucket => {
                let full_at = match &old {
                    Some(State::TokenBucket(s)) => bucket_full_at(limits, s),
                    _ => now,
                };
                bucket_at(limits, later(full_at), now)
            }
            Algorithm::Gcra => {
                let tat = match &old {
                    Some(State::Gcra(s)) => s.tat,
                    _ => now,
                };
                let tat = later(tat);
                (tat > now).then_some(State::Gcra(GcraState { tat }))
            }
            Algorithm::FixedWindow => {
                let start = now - now % limits.period;
                let count = match &old {
                    Some(State::FixedWindow(s)) if s.start == start => s.count,
                    _ => 0,
                }
                .saturating_add(cost)
                .min(super::MAX_MICROS);
                (count > 0).then_some(State::FixedWindow(FixedWindowState { start, count }))
            }
            Algorithm::SlidingWindowCounter => {
                let start = now - now % limits.period;
                let (previous, current) = match &old {
                    Some(State::SlidingWindowCounter(s)) if s.start == start => {
                        (s.previous, s.current)
                    }
                    Some(State::SlidingWindowCounter(s)) if s.start + limits.period == start => {
                        (s.current, 0)
                    }
                    _ => (0, 0),
                };
                let current = current.saturating_add(u32::try_from(cost).unwrap_or(u32::MAX));
                (current > 0 || previous > 0).then_some(State::SlidingWindowCounter(
                    SlidingWindowCounterState {
                        start,
                        previous,
                        current,
                    },
                ))
            }
            Algorithm::SlidingWindowLog => {
                let mut log = match old {
                    Some(State::SlidingWindowLog(log)) => *log,
                    _ => SlidingWindowLogState::default(),
                };
                let room = drain_left(limits, &mut log.entries, now);
                let at = log.entries.back().map_or(now, |&t| t.max(now));
                log.entries
                    .extend(std::iter::repeat_n(at, (cost as usize).min(room)));
                (!log.entries.is_empty()).then(|| State::SlidingWindowLog(Box::new(log)))
            }
            Algorithm::Concurrency => {
                let mut held = match old {
                    Some(State::Concurrency(held)) => *held,
                    _ => ConcurrencyState::default(),
                };
                let room = drain_left(limits, &mut held.taken, now);
                super::Concurrency::insert(&mut held, now, (cost as usize).min(room));
                (!held.taken.is_empty()).then(|| State::Concurrency(Box::new(held)))
            }
        };
    }
}

/// The longest a debt can hold a token bucket or GCRA key empty: twice the longest refill
/// (about 20 years), which keeps every time of the model below 2^53.
pub const MAX_DEBT_MICROS: u64 = 2 * super::MAX_REFILL_MICROS;

/// Drops the entries of a log (or the held units) that left the window by `now`; returns how
/// many more it may hold.
#[inline]
fn drain_left(limits: &Limits, entries: &mut VecDeque<u64>, now: u64) -> usize {
    let first = super::SlidingWindowLog::first_live(limits, entries, now);
    entries.drain(..first);
    (MAX_LOG_ENTRIES as usize).saturating_sub(entries.len())
}

/// The time a token bucket is full again: `updated` plus the refill of the missing tokens.
fn bucket_full_at(limits: &Limits, s: &TokenBucketState) -> u64 {
    s.updated + limits.burst.saturating_sub(s.tokens) * limits.interval
}

/// A token bucket that is full again at `full_at`, as the model holds it: no tokens, counted
/// from `full_at` less the refill of the whole burst (refilled at any time not before the last
/// change, it gives the tokens the bucket has then). `None` when it is full at `now` already.
fn bucket_at(limits: &Limits, full_at: u64, now: u64) -> Option<State> {
    (full_at > now).then(|| {
        State::TokenBucket(TokenBucketState {
            tokens: 0,
            updated: full_at.saturating_sub(limits.burst * limits.interval),
        })
    })
}
