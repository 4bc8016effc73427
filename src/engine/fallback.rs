//! A failed store check: reported (throttled), then decided by each applied rule's
//! [`FailureMode`]: refused (fail closed), let through (fail open), or decided by the fallback
//! limiter (`FailureMode::Local`), an in-process memory store made when first needed.

use smallvec::SmallVec;

use super::local::Counted;
use super::state::Engine;
use crate::clock::unix_micros;
use crate::policy::snapshot::Snapshot;
use crate::policy::{Applied, AppliedRules, RuleIndices};
use crate::store::{Adjustment, Charge, Store, StoreError, StoreFuture};
use crate::{Decision, FailureMode, RuleMode};

impl<St: Store> Engine<St> {
    /// Logs a store failure: at `error` at most once a minute, else at `debug`.
    pub(super) fn report(&self, error: &StoreError) {
        // The clock is read only for a failure that may be logged: with the breaker open, every
        // request comes here.
        #[cfg(feature = "metrics")]
        crate::telemetry::store_error(
            self.observer.id,
            self.observer.store,
            match error {
                StoreError::Timeout => "timeout",
                StoreError::Unavailable(_) => "unavailable",
                StoreError::Protocol(_) => "protocol",
                StoreError::CircuitOpen => "circuit_open",
                StoreError::Unsupported(_) => "unsupported",
            },
        );
        // An open breaker, and a store not connected yet, are logged by the store itself.
        if !matches!(error, StoreError::CircuitOpen)
            && !error.is_reported()
            && self.warned_store_error.due(unix_micros(), 60_000_000)
        {
            tracing::error!(%error, "tollgate: the rate-limit store failed; each rule's FailureMode decides (reported at most once a minute)");
        } else {
            tracing::debug!(%error, "tollgate: the rate-limit store failed");
        }
    }

    /// Makes `adjustments` where their charges were made: on the fallback limiter when
    /// `on_fallback` (and it was made), else on the store.
    pub(super) fn adjust_where(
        &self,
        on_fallback: Option<Counted>,
        adjustments: &[Adjustment<'_>],
    ) -> StoreFuture<()> {
        match self.try_adjust_now_where(on_fallback, adjustments) {
            Some(result) => Box::pin(std::future::ready(result)),
            None => self.store.adjust(adjustments),
        }
    }

    /// Makes `adjustments` at once where [`adjust_where`](Self::adjust_where) makes them, when
    /// that never waits (the fallback limiter, the memory store): `None` when they need the
    /// store's future.
    pub(super) fn try_adjust_now_where(
        &self,
        on_fallback: Option<Counted>,
        adjustments: &[Adjustment<'_>],
    ) -> Option<Result<(), StoreError>> {
        if let Some(Counted(counted)) = on_fallback
            && let Some(()) = self
                .fallback
                .adjust_now(counted, self.store.replicas(), adjustments)
        {
            return Some(Ok(()));
        }
        self.store.try_adjust_now(adjustments)
    }

    /// Decides by each applied rule's [`FailureMode`]; on a decision of the fallback limiter, `applied` becomes the
    /// rules it covers.
    pub(super) fn without_store(
        &self,
        snapshot: &Snapshot,
        applied: &mut RuleIndices,
        keys: Option<&AppliedRules>,
    ) -> WithoutStore {
        // Shadow rules never refuse, and are not checked without the store.
        let mode = |i: &u16| {
            let rule = &snapshot.rules[usize::from(*i)];
            if rule.mode == RuleMode::Shadow {
                FailureMode::Open
            } else {
                rule.on_store_error
            }
        };
        if applied.iter().any(|i| mode(i) == FailureMode::Closed) {
            return WithoutStore::Refuse;
        }
        let Some(keys) = keys.filter(|_| snapshot.uses_fallback) else {
            return WithoutStore::Unlimited;
        };
        let charges: SmallVec<[Charge<'_>; 2]> = keys
            .iter()
            .filter(|Applied { rule: i, .. }| mode(i) == FailureMode::Local)
            .map(|Applied { rule: i, key, cost }| Charge {
                rule: &snapshot.rules[usize::from(*i)].spec,
                key,
                cost: *cost,
            })
            .collect();
        if charges.is_empty() {
            return WithoutStore::Unlimited;
        }
        *applied = keys
            .iter()
            .filter(|Applied { rule: i, .. }| mode(i) == FailureMode::Local)
            .map(|applied| applied.rule)
            .collect();
        let counted = self.store.replicas();
        WithoutStore::Decided(self.fallback.decide(counted, &charges), Counted(counted))
    }
}

/// How a request is decided when the store failed.
pub(super) enum WithoutStore {
    /// A rule fails closed.
    Refuse,
    /// The fallback limiter decided the rules that fall back to it, at the count of replicas
    /// the store had then.
    Decided(Decision, Counted),
    /// Every rule fails open.
    Unlimited,
}
