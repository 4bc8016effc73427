//! A decided request told to the layer's events (metrics, the span, the rejection log, the
//! hook): what the engine hands the observer.

use http::request::Parts;

use super::check::{Ctx, Phase};
use super::state::Engine;
use crate::Decision;
use crate::observe::{Decided, Head, Verdict};
use crate::policy::FoundKeys;
use crate::policy::snapshot::Snapshot;

impl<St> Engine<St> {
    /// A request whose client went away before it was decided, to events.
    pub(crate) fn cancelled(
        &self,
        snapshot: &Snapshot,
        head: Head<'_>,
        applied: &[u16],
        span: &tracing::Span,
    ) {
        let ctx = Ctx {
            head,
            span,
            latency: None,
            phase: Phase::default(),
        };
        self.emit(snapshot, &ctx, applied, None, None, Verdict::Cancelled);
    }

    /// A request decided without asking the store (listed, or no rule applies), to events.
    pub(super) fn emit_listed(
        &self,
        snapshot: &Snapshot,
        parts: &Parts,
        span: &tracing::Span,
        verdict: Verdict,
    ) {
        let ctx = Ctx {
            head: Head::of_parts(parts),
            span,
            latency: None,
            phase: Phase::default(),
        };
        self.emit(snapshot, &ctx, &[], None, None, verdict);
    }

    /// A decided request, to events.
    pub(super) fn emit(
        &self,
        snapshot: &Snapshot,
        ctx: &Ctx<'_>,
        applied: &[u16],
        decision: Option<&Decision>,
        keys: Option<&FoundKeys>,
        verdict: Verdict,
    ) {
        self.observer.decided(
            &Decided {
                snapshot,
                head: ctx.head,
                applied,
                decision,
                keys,
                verdict,
                store_latency: ctx.latency,
            },
            ctx.span,
        );
    }
}
