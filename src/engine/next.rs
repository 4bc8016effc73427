//! What follows a request's check: the store's answer becomes a call of the inner service
//! (with what the request carries to its response), an answer for it, or a second check
//! (shadow and delay rules); a store failure goes to the fallback.

use std::sync::Arc;

use smallvec::SmallVec;

use super::check::{Ctx, Phase};
use super::fallback::WithoutStore;
use super::local::Counted;
use super::meter::Meter;
use super::ruling::{Admitted, Decide};
use super::settle::{Settle, charges_of};
use super::slots::{Slots, Taken};
use super::state::Engine;
use super::verdict::{delay_of, denied, visible};
use crate::observe::Verdict;
use crate::policy::snapshot::Snapshot;
use crate::policy::{Applied, AppliedRules, RuleIndices};
use crate::response::Refusal;
use crate::runtime::Origin;
use crate::store::{Store, StoreError};
use crate::{Decision, DecisionSource, FailureMode, RuleMode};

impl<St: Store> Engine<St> {
    /// Turns the store's answer into what follows: a denial becomes the answer (or a second
    /// check, for shadow and delay rules), and a store failure is decided by each applied rule's
    /// [`FailureMode`]. Every final decision is told to the layer's events.
    pub(crate) fn after_check(
        self: &Arc<Self>,
        snapshot: &Arc<Snapshot>,
        applied: &mut RuleIndices,
        keys: Option<&AppliedRules>,
        result: Result<Decision, StoreError>,
        ctx: &Ctx<'_>,
    ) -> Decide<St::Future> {
        let grpc = || ctx.head.is_grpc();
        if snapshot.meters
            && let Ok(decision) = &result
            && !decision.allowed()
            && let Some(first) = first_chunks(snapshot, applied, keys, decision)
        {
            // Only metered rules denied, each with part of its chunk left: checked again with
            // that as the first chunk.
            let check =
                self.check_again(snapshot, first, None, ctx.phase, ctx.resolution, ctx.span);
            return Decide::again(check, std::mem::take(applied), ctx.resolution, true);
        }
        match result {
            Ok(decision) if decision.allowed() => {
                let verdict = if applied.is_empty() {
                    Verdict::NotLimited
                } else if ctx.phase.shadowed {
                    Verdict::ShadowDenied
                } else if ctx.phase.delayed {
                    Verdict::Delayed
                } else if decision.source() == DecisionSource::Lease {
                    Verdict::LeaseAllowed
                } else {
                    Verdict::Allowed
                };
                self.emit(snapshot, ctx, applied, Some(&decision), keys, verdict);
                self.admitted(snapshot, applied, keys, decision, None, ctx.resolution.tier)
            }
            Ok(decision) if snapshot.watches => {
                self.watched_denial(snapshot, applied, keys, decision, ctx)
            }
            Ok(decision) => {
                let verdict = denied(&decision);
                self.deny(snapshot, ctx, applied, keys, decision, verdict)
            }
            Err(error) => {
                self.report(&error);
                match self.without_store(snapshot, applied, keys) {
                    WithoutStore::Refuse => {
                        self.emit(snapshot, ctx, applied, None, keys, Verdict::FailedClosed);
                        Decide::answer(
                            Refusal::Unavailable {
                                closed: closed(snapshot, applied).collect(),
                            },
                            grpc(),
                        )
                    }
                    WithoutStore::Decided(decision, _) if !decision.allowed() => {
                        self.deny(snapshot, ctx, applied, keys, decision, Verdict::LocalDenied)
                    }
                    WithoutStore::Decided(decision, counted) => {
                        self.emit(
                            snapshot,
                            ctx,
                            applied,
                            Some(&decision),
                            keys,
                            Verdict::LocalAllowed,
                        );
                        // Decided by the fallback limiter: settled there, slots given back there.
                        let tier = ctx.resolution.tier;
                        self.admitted(snapshot, applied, keys, decision, Some(counted), tier)
                    }
                    WithoutStore::Unlimited => {
                        self.emit(snapshot, ctx, applied, None, keys, Verdict::FailedOpen);
                        Decide::call(Admitted::default())
                    }
                }
            }
        }
    }

    /// A denial in a policy with shadow or delay rules.
    fn watched_denial(
        self: &Arc<Self>,
        snapshot: &Arc<Snapshot>,
        applied: &mut RuleIndices,
        keys: Option<&AppliedRules>,
        decision: Decision,
        ctx: &Ctx<'_>,
    ) -> Decide<St::Future> {
        let mode = |i: u16| snapshot.rules[usize::from(i)].mode;
        let denying = || {
            applied
                .iter()
                .zip(decision.outcomes())
                .filter(|(_, o)| !o.allowed)
        };
        let enforced_denial = denying().any(|(i, _)| mode(*i) != RuleMode::Shadow);
        let Some(keys) = keys else {
            // Kept for every policy with shadow or delay rules: not reached.
            let verdict = denied(&decision);
            return self.deny(snapshot, ctx, applied, keys, decision, verdict);
        };
        if !enforced_denial {
            let shadow: SmallVec<[u16; 2]> = denying()
                .filter(|(i, _)| mode(**i) == RuleMode::Shadow)
                .map(|(&i, _)| i)
                .collect();
            for (&i, outcome) in denying().filter(|(i, _)| mode(**i) == RuleMode::Shadow) {
                tracing::info!(
                    target: "tollgate::shadow",
                    rule = snapshot.rules[usize::from(i)].spec.name(),
                    retry_after_s = outcome.retry_after.div_ceil(1_000_000),
                    "tollgate: a shadow rule would deny this request; admitted"
                );
            }
            // Only shadow rules denied, so nothing was charged: the other rules are checked
            // again, alone, as if the shadow rules were not there.
            if applied.iter().all(|&i| mode(i) == RuleMode::Shadow) {
                self.emit(
                    snapshot,
                    ctx,
                    applied,
                    Some(&decision),
                    Some(keys),
                    Verdict::ShadowDenied,
                );
                // Only shadow rules denied: nothing was charged, nothing to settle.
                return Decide::call(Admitted::default());
            }
            self.observer
                .shadowed(snapshot, ctx.head, ctx.resolution, &shadow);
            let enforced: AppliedRules = keys
                .iter()
                .filter(|Applied { rule: i, .. }| mode(*i) != RuleMode::Shadow)
                .cloned()
                .collect();
            // A delayed request stays settled: it is never delayed twice.
            let phase = Phase {
                shadowed: true,
                ..ctx.phase
            };
            let check = self.check_again(snapshot, enforced, None, phase, ctx.resolution, ctx.span);
            return Decide::again(check, std::mem::take(applied), ctx.resolution, true);
        }
        if !ctx.phase.delayed
            && let Some(wait) = delay_of(snapshot, applied, &decision)
        {
            let phase = Phase {
                delayed: true,
                ..ctx.phase
            };
            let check = self.check_again(
                snapshot,
                keys.clone(),
                Some((wait, decision)),
                phase,
                ctx.resolution,
                ctx.span,
            );
            return Decide::again(check, std::mem::take(applied), ctx.resolution, false);
        }
        let verdict = denied(&decision);
        self.deny(snapshot, ctx, applied, Some(keys), decision, verdict)
    }

    /// What an admitted request carries to its response: the charges it settles after, the
    /// slots it holds (taken by the store, or by the fallback limiter when `on_fallback`), and the
    /// decision its answer reports.
    fn admitted(
        self: &Arc<Self>,
        snapshot: &Arc<Snapshot>,
        applied: &mut RuleIndices,
        keys: Option<&AppliedRules>,
        decision: Decision,
        on_fallback: Option<Counted>,
        tier: u16,
    ) -> Decide<St::Future> {
        let rule = |i: u16| &snapshot.rules[usize::from(i)];
        let settle = if snapshot.settles {
            let charges = charges_of(applied, keys, &decision, |i| rule(i).after.is_some());
            (!charges.is_empty()).then(|| {
                Box::new(Settle {
                    charges,
                    on_fallback,
                })
            })
        } else {
            None
        };
        let slots = if snapshot.holds {
            let mut slots = charges_of(applied, keys, &decision, |i| {
                rule(i).spec.algorithm().is_concurrency()
            });
            // A request that cost nothing holds nothing.
            slots.retain(|(_, _, units, _)| *units > 0);
            (!slots.is_empty()).then(|| {
                Slots::new(Taken {
                    giver: self.clone(),
                    snapshot: snapshot.clone(),
                    taken: slots,
                    on_fallback,
                    origin: Origin::here(),
                })
            })
        } else {
            None
        };
        let meter = if snapshot.meters {
            let charges = charges_of(applied, keys, &decision, |i| rule(i).meter.is_some());
            (!charges.is_empty())
                .then(|| Meter::new(self.clone(), snapshot.clone(), charges, on_fallback, tier))
        } else {
            None
        };
        let decision = visible(snapshot, applied, decision);
        Decide::call(Admitted {
            decision: Some(decision),
            applied: std::mem::take(applied),
            settle,
            slots,
            meter,
        })
    }

    /// A denied request: told to events, then answered (shadow rules left out of the answer).
    fn deny(
        &self,
        snapshot: &Snapshot,
        ctx: &Ctx<'_>,
        applied: &mut RuleIndices,
        keys: Option<&AppliedRules>,
        decision: Decision,
        verdict: Verdict,
    ) -> Decide<St::Future> {
        self.emit(snapshot, ctx, applied, Some(&decision), keys, verdict);
        denied_answer(snapshot, applied, decision, ctx.head.is_grpc())
    }
}

/// The answer to a denied request (shadow rules left out of it).
fn denied_answer<C>(
    snapshot: &Snapshot,
    applied: &mut RuleIndices,
    decision: Decision,
    grpc: bool,
) -> Decide<C> {
    // Told to the rejection log (target `tollgate::denied`) by `Engine::emit`.
    let decision = visible(snapshot, applied, decision);
    Decide::answer(
        Refusal::Denied {
            applied: std::mem::take(applied),
            decision,
        },
        grpc,
    )
}

/// The keys of a request again, each metered rule's charge cut to what is left of its budget,
/// when only metered rules denied it and each of them asked for its whole chunk with part of
/// one left: a metered request starts with `min(chunk, remaining)` (the `r` it was shown). A
/// check with a cut chunk denied is not cut again.
fn first_chunks(
    snapshot: &Snapshot,
    applied: &RuleIndices,
    keys: Option<&AppliedRules>,
    decision: &Decision,
) -> Option<AppliedRules> {
    let keys = keys?;
    let mut first = keys.clone();
    let mut cut = false;
    for (&i, outcome) in applied.iter().zip(decision.outcomes()) {
        if outcome.allowed {
            continue;
        }
        let rule = &snapshot.rules[usize::from(i)];
        let applied = first.iter_mut().find(|a| a.rule == i)?;
        let chunk = rule.meter.as_ref()?.chunk;
        if rule.mode != RuleMode::Enforce || applied.cost != chunk || outcome.remaining == 0 {
            return None;
        }
        applied.cost = outcome.remaining.min(chunk);
        cut |= applied.cost < chunk;
    }
    cut.then_some(first)
}

/// The rules of `applied` that fail closed, by index.
fn closed<'a>(snapshot: &'a Snapshot, applied: &'a [u16]) -> impl Iterator<Item = u16> + 'a {
    applied
        .iter()
        .copied()
        .filter(|&i| snapshot.rules[usize::from(i)].on_store_error == FailureMode::Closed)
}
