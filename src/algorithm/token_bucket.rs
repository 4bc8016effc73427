//! Token bucket: `burst` tokens, one more every `interval` microseconds.

use super::{Limits, Outcome};

/// The state of one token-bucket key: the tokens in the bucket at `updated`.
///
/// `updated` advances in whole intervals while the bucket fills, so no fraction of a token is
/// ever lost or invented; once the bucket is full it is reset to the time it was last seen full.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenBucketState {
    /// Whole tokens in the bucket at `updated`.
    pub tokens: u64,
    /// Microseconds on the store's clock.
    pub updated: u64,
}

/// The token bucket algorithm (the default).
///
/// * `limit` = burst; `remaining` = whole tokens left;
/// * `reset` = time until the bucket is full again;
/// * `retry_after` = time until `cost` tokens are in the bucket;
/// * `window` = time until the next token (one interval when the bucket is full).
#[derive(Clone, Copy, Debug)]
pub struct TokenBucket;

impl TokenBucket {
    /// The bucket as it is at `now`: refilled by whole intervals, capped at the burst.
    #[inline]
    pub fn refill(limits: &Limits, state: Option<&TokenBucketState>, now: u64) -> TokenBucketState {
        let Some(state) = state else {
            return TokenBucketState {
                tokens: limits.burst,
                updated: now,
            };
        };
        let elapsed = now.saturating_sub(state.updated);
        // Busy keys are seen many times per interval: skip the division then.
        let added = if elapsed < limits.interval {
            0
        } else {
            elapsed / limits.interval
        };
        let tokens = state.tokens.saturating_add(added);
        if tokens >= limits.burst {
            TokenBucketState {
                tokens: limits.burst,
                updated: now,
            }
        } else {
            TokenBucketState {
                tokens,
                updated: state.updated + added * limits.interval,
            }
        }
    }

    /// Time from `now` until `bucket` (as refilled at `now`) holds `wanted` tokens.
    fn time_until(limits: &Limits, bucket: &TokenBucketState, now: u64, wanted: u64) -> u64 {
        if bucket.tokens >= wanted {
            return 0;
        }
        (bucket.updated + (wanted - bucket.tokens) * limits.interval).saturating_sub(now)
    }

    /// Time from `now` until the next token of `bucket` (as refilled at `now`): its `updated` is
    /// never a whole interval behind `now`, and is `now` when the bucket is full.
    fn next_token(limits: &Limits, bucket: &TokenBucketState, now: u64) -> u64 {
        (bucket.updated + limits.interval)
            .saturating_sub(now)
            .max(1)
    }

    /// Checks a request of `cost` at `now`.
    #[inline]
    pub fn check(
        limits: &Limits,
        state: Option<&TokenBucketState>,
        now: u64,
        cost: u64,
    ) -> Outcome {
        Self::outcome(limits, &Self::refill(limits, state, now), now, cost)
    }

    /// Takes `cost` tokens at `now`; `None` when the bucket is left full (no state needed).
    #[inline]
    pub fn commit(
        limits: &Limits,
        state: Option<&TokenBucketState>,
        now: u64,
        cost: u64,
    ) -> Option<TokenBucketState> {
        Self::taken(limits, &Self::refill(limits, state, now), cost)
    }

    /// [`check`](Self::check), and the state [`commit`](Self::commit) leaves when it admits (for
    /// a denial, the second is meaningless), with the bucket refilled once: the memory store's
    /// every decision.
    #[inline]
    pub(crate) fn admit(
        limits: &Limits,
        state: Option<&TokenBucketState>,
        now: u64,
        cost: u64,
    ) -> (Outcome, Option<TokenBucketState>) {
        let bucket = Self::refill(limits, state, now);
        (
            Self::outcome(limits, &bucket, now, cost),
            Self::taken(limits, &bucket, cost),
        )
    }

    /// The outcome of a request of `cost` for `bucket` (as refilled at `now`).
    #[inline]
    fn outcome(limits: &Limits, bucket: &TokenBucketState, now: u64, cost: u64) -> Outcome {
        if bucket.tokens >= cost {
            let after = TokenBucketState {
                tokens: bucket.tokens - cost,
                updated: bucket.updated,
            };
            Outcome {
                allowed: true,
                limit: limits.burst,
                remaining: after.tokens,
                reset: Self::time_until(limits, &after, now, limits.burst),
                retry_after: 0,
                window: Self::next_token(limits, bucket, now),
            }
        } else {
            Outcome {
                allowed: false,
                limit: limits.burst,
                remaining: bucket.tokens,
                reset: Self::time_until(limits, bucket, now, limits.burst),
                retry_after: Self::time_until(limits, bucket, now, cost),
                window: Self::next_token(limits, bucket, now),
            }
        }
    }

    /// `bucket` (as refilled) after `cost` tokens are taken; `None` when it is left full.
    #[inline]
    fn taken(limits: &Limits, bucket: &TokenBucketState, cost: u64) -> Option<TokenBucketState> {
        let tokens = bucket.tokens.saturating_sub(cost);
        (tokens < limits.burst).then_some(TokenBucketState {
            tokens,
            updated: bucket.updated,
        })
    }
}
