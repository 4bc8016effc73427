//! The delay loop: a request that only delay rules denied waits for their budget and is
//! checked again, as long as the rules' maximum allows, in a bounded number of waiting
//! requests ([`WaitSlot`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::check::{Checked, DeferredCheck, Phase, Stopwatch};
use super::state::Engine;
use super::verdict::{Delay, delay_of};
use crate::Decision;
use crate::policy::snapshot::Snapshot;
use crate::policy::{AppliedRules, Resolution, RuleIndices};
use crate::store::Store;

impl<St: Store> Engine<St> {
    /// Checks `keys` again: at once (`delay` is `None`), or after waiting for a delay rule's
    /// budget, as long as the delay allows, in a bounded number of waiting requests.
    pub(super) fn check_again(
        self: &Arc<Self>,
        snapshot: &Arc<Snapshot>,
        keys: AppliedRules,
        delay: Option<(Delay, Decision)>,
        phase: Phase,
        resolution: Resolution,
        span: &tracing::Span,
    ) -> DeferredCheck {
        let engine = self.clone();
        let snapshot = snapshot.clone();
        let timed = Stopwatch::times(span);
        Box::pin(async move {
            let checked = |applied, keys, result, latency| Checked {
                applied,
                keys: Some(Box::new(keys)),
                result,
                phase,
                latency,
                resolution,
            };
            let Some((mut delay, denied)) = delay else {
                let (applied, result, latency) = engine.check_timed(&snapshot, &keys, timed).await;
                return checked(applied, keys, result, latency);
            };
            let applied: RuleIndices = keys.iter().map(|applied| applied.rule).collect();
            let denied_now = |applied, keys| checked(applied, keys, Ok(denied), None);
            // Waiting needs tokio's timer; without a runtime the request is denied, not a panic.
            if tokio::runtime::Handle::try_current().is_err() {
                tracing::debug!("tollgate: a delay rule needs a tokio runtime to wait; denied");
                return denied_now(applied, keys);
            }
            let Some(_slot) = WaitSlot::take(&engine.waiting, engine.max_waiting) else {
                tracing::debug!("tollgate: too many requests wait for a delay rule; denied");
                return denied_now(applied, keys);
            };
            let start = tokio::time::Instant::now();
            let mut deadline = start + delay.max;
            loop {
                tokio::time::sleep(delay.wait).await;
                let (applied, result, latency) = engine.check_timed(&snapshot, &keys, timed).await;
                if let Ok(decision) = &result
                    && !decision.allowed()
                    && let Some(next) = delay_of(&snapshot, &applied, decision)
                {
                    // The strictest maximum of the rules that denied, counted from the start.
                    deadline = deadline.min(start + next.max);
                    if tokio::time::Instant::now() + next.wait <= deadline {
                        delay.wait = next.wait;
                        continue;
                    }
                }
                return checked(applied, keys, result, latency);
            }
        })
    }
}

/// One of the bounded places of requests waiting for a delay rule; given back when dropped.
struct WaitSlot<'a>(&'a AtomicUsize);

impl<'a> WaitSlot<'a> {
    fn take(waiting: &'a AtomicUsize, max: usize) -> Option<Self> {
        let before = waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        #[cfg(feature = "metrics")]
        crate::telemetry::waiting(true);
        let _ = before;
        Some(WaitSlot(waiting))
    }
}

impl Drop for WaitSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
        #[cfg(feature = "metrics")]
        crate::telemetry::waiting(false);
    }
}
