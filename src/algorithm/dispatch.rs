//! The reference model's entry points: [`Algorithm`]'s checks, charges and refunds, each
//! handed to the algorithm of the rule.

use super::kind::Algorithm;
use super::*;

impl Algorithm {
    /// Checks a request of `cost` against `state` at `now` (microseconds) without changing it.
    ///
    /// A state of another algorithm (a rule whose algorithm changed) counts as no state.
    ///
    /// A `cost` above [`capacity`](Algorithm::capacity) can never be admitted: it is denied with
    /// `retry_after == u64::MAX`.
    #[inline]
    pub fn check(self, limits: &Limits, state: Option<&State>, now: u64, cost: u64) -> Outcome {
        if cost > self.capacity(limits) {
            return Outcome {
                allowed: false,
                retry_after: u64::MAX,
                ..self.check(limits, state, now, 0)
            };
        }
        match self {
            Algorithm::TokenBucket => {
                TokenBucket::check(limits, state.and_then(State::token_bucket), now, cost)
            }
            Algorithm::Gcra => Gcra::check(limits, state.and_then(State::gcra), now, cost),
            Algorithm::FixedWindow => {
                FixedWindow::check(limits, state.and_then(State::fixed_window), now, cost)
            }
            Algorithm::SlidingWindowLog => {
                SlidingWindowLog::check(limits, state.and_then(State::sliding_log), now, cost)
            }
            Algorithm::SlidingWindowCounter => SlidingWindowCounter::check(
                limits,
                state.and_then(State::sliding_counter),
                now,
                cost,
            ),
            Algorithm::Concurrency => {
                Concurrency::check(limits, state.and_then(State::concurrency), now, cost)
            }
        }
    }

    /// Charges `cost` at `now`, updating `state` in place; leaves `None` when the new state is
    /// the same as no state at all (the key can be removed).
    ///
    /// Call it only after [`check`](Algorithm::check) admitted the request.
    #[inline]
    pub fn commit(self, limits: &Limits, state: &mut Option<State>, now: u64, cost: u64) {
        let old = state.take();
        *state = match self {
            Algorithm::TokenBucket => TokenBucket::commit(
                limits,
                old.as_ref().and_then(State::token_bucket),
                now,
                cost,
            )
            .map(State::TokenBucket),
            Algorithm::Gcra => {
                Gcra::commit(limits, old.as_ref().and_then(State::gcra), now, cost).map(State::Gcra)
            }
            Algorithm::FixedWindow => FixedWindow::commit(
                limits,
                old.as_ref().and_then(State::fixed_window),
                now,
                cost,
            )
            .map(State::FixedWindow),
            Algorithm::SlidingWindowLog => {
                let log = match old {
                    Some(State::SlidingWindowLog(log)) => Some(*log),
                    _ => None,
                };
                SlidingWindowLog::commit(limits, log, now, cost)
                    .map(|log| State::SlidingWindowLog(Box::new(log)))
            }
            Algorithm::SlidingWindowCounter => SlidingWindowCounter::commit(
                limits,
                old.as_ref().and_then(State::sliding_counter),
                now,
                cost,
            )
            .map(State::SlidingWindowCounter),
            Algorithm::Concurrency => {
                let held = match old {
                    Some(State::Concurrency(held)) => Some(*held),
                    _ => None,
                };
                Concurrency::commit(limits, held, now, cost)
                    .map(|held| State::Concurrency(Box::new(held)))
            }
        };
    }
}

impl Algorithm {
    /// [`check`](Algorithm::check), then [`commit`](Algorithm::commit) when the request is
    /// admitted: the one-step form for a store that holds the state in place. Decides exactly as
    /// the two steps do.
    ///
    /// The two hot algorithms are written into the caller (the memory store's decision), the
    /// others called: a call's own cost (saving and restoring registers, passing the state) was
    /// about a fifth of a token bucket's admission.
    #[inline(always)]
    pub fn admit(self, limits: &Limits, state: &mut Option<State>, now: u64, cost: u64) -> Outcome {
        // The two hot algorithms in one piece, so that the compiler computes their refill once.
        match (self, &*state) {
            (Algorithm::TokenBucket, None | Some(State::TokenBucket(_)))
                if cost <= limits.burst =>
            {
                let old = state.as_ref().and_then(State::token_bucket);
                let (outcome, after) = TokenBucket::admit(limits, old, now, cost);
                if outcome.allowed {
                    match (state.as_mut(), after) {
                        // In place: nothing to drop.
                        (Some(State::TokenBucket(bucket)), Some(after)) => *bucket = after,
                        (_, after) => *state = after.map(State::TokenBucket),
                    }
                }
                outcome
            }
            (Algorithm::Gcra, None | Some(State::Gcra(_))) if cost <= limits.burst => {
                let old = state.as_ref().and_then(State::gcra).copied();
                let outcome = Gcra::check(limits, old.as_ref(), now, cost);
                if outcome.allowed {
                    match (
                        state.as_mut(),
                        Gcra::commit(limits, old.as_ref(), now, cost),
                    ) {
                        // In place: nothing to drop.
                        (Some(State::Gcra(gcra)), Some(after)) => *gcra = after,
                        (_, after) => *state = after.map(State::Gcra),
                    }
                }
                outcome
            }
            _ => self.admit_in_two_steps(limits, state, now, cost),
        }
    }

    /// [`admit`](Algorithm::admit) for any algorithm: [`check`](Algorithm::check), then
    /// [`commit`](Algorithm::commit) when the request is admitted.
    #[inline(never)]
    fn admit_in_two_steps(
        self,
        limits: &Limits,
        state: &mut Option<State>,
        now: u64,
        cost: u64,
    ) -> Outcome {
        let outcome = self.check(limits, state.as_ref(), now, cost);
        if outcome.allowed {
            self.commit(limits, state, now, cost);
        }
        outcome
    }
}

impl Algorithm {
    /// The outcome of a rule for a request that is **not** charged (another rule of the request
    /// denied it, or a store only looks): `allowed` and `retry_after` say whether `cost` fits, and
    /// the numbers describe the budget as it stands, before any charge.
    #[inline]
    pub fn uncharged(self, limits: &Limits, state: Option<&State>, now: u64, cost: u64) -> Outcome {
        let outcome = self.check(limits, state, now, cost);
        if !outcome.allowed || cost == 0 {
            return outcome;
        }
        Outcome {
            allowed: true,
            retry_after: 0,
            ..self.check(limits, state, now, 0)
        }
    }
}

impl Algorithm {
    /// The units a lease of up to `lease` takes for a request of `cost`: every unit there is
    /// now, at most `lease`, at least `cost` (then checked and charged as the cost of the
    /// request: denied when fewer than `cost` are there). `cost` itself when `lease` is 0, or
    /// when `cost` is above the capacity. At cost 0 (a refill ahead of need, for a request
    /// already paid), every unit there is up to `lease`, possibly none: always admitted.
    ///
    /// ```
    /// use tollgate::Algorithm;
    /// use tollgate::algorithm::Limits;
    ///
    /// let limits = Limits::new(100, 3_600_000_000, 100).unwrap();
    /// // A full bucket of 100: a lease of 10 for a request of 1 takes 10.
    /// assert_eq!(Algorithm::TokenBucket.lease_take(&limits, None, 0, 1, 10), 10);
    /// // Ahead of need: what there is, up to the lease.
    /// assert_eq!(Algorithm::TokenBucket.lease_take(&limits, None, 0, 0, 10), 10);
    /// ```
    #[inline]
    pub fn lease_take(
        self,
        limits: &Limits,
        state: Option<&State>,
        now: u64,
        cost: u64,
        lease: u64,
    ) -> u64 {
        if lease == 0 || cost > self.capacity(limits) {
            return cost;
        }
        // What a check at cost 0 leaves is exactly the largest cost it would admit now.
        let available = self.check(limits, state, now, 0).remaining;
        lease.min(available).max(cost)
    }
}

impl Algorithm {
    /// Whether units a lease took and left unspent go back to the shared budget when it
    /// expires ([`refund`](Algorithm::refund)ed at the time they were charged): exactly, for
    /// the fixed window and the sliding counter, whose units go back into the count of the
    /// window they were taken from, never spent (and nothing when that window no longer
    /// counts). Not for the others: a token bucket's or GCRA's units given back after the
    /// bucket filled up again would be units that never were (and over-admit); the sliding
    /// log's refund drops its newest entries, which need not be the lease's.
    ///
    /// ```
    /// use tollgate::Algorithm;
    ///
    /// assert!(Algorithm::FixedWindow.lease_gives_back());
    /// assert!(!Algorithm::TokenBucket.lease_gives_back());
    /// ```
    #[inline]
    pub fn lease_gives_back(self) -> bool {
        matches!(
            self,
            Algorithm::FixedWindow | Algorithm::SlidingWindowCounter
        )
    }
}
