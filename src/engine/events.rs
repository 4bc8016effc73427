//! A decided request told to the layer's events (metrics, the span, the rejection log, the
//! hook): what the engine hands the observer.

use http::request::Parts;

use super::check::Ctx;
use super::state::Engine;
use crate::Decision;
use crate::observe::{Decided, Head, Verdict};
use crate::policy::snapshot::Snapshot;
use crate::policy::{AppliedRules, Resolution};

impl<St> Engine<St> {
    /// A request whose client went away before it was decided, to events; `resolution` is
    /// where it stands in the policy, when its rules were resolved.
    pub(crate) fn cancelled(
        &self,
        snapshot: &Snapshot,
        head: Head<'_>,
        applied: &[u16],
        resolution: Option<Resolution>,
        span: &tracing::Span,
    ) {
        self.observer.decided(
            &Decided {
                snapshot,
                head,
                resolution,
                applied,
                decision: None,
                keys: None,
                verdict: Verdict::Cancelled,
                store_latency: None,
            },
            span,
        );
    }

    /// A request decided before its rules were resolved (listed, shed, a preflight), or to
    /// which no rule applies, to events.
    pub(super) fn emit_listed(
        &self,
        snapshot: &Snapshot,
        parts: &Parts,
        resolution: Option<Resolution>,
        span: &tracing::Span,
        verdict: Verdict,
    ) {
        self.observer.decided(
            &Decided {
                snapshot,
                head: Head::of_parts(parts),
                resolution,
                applied: &[],
                decision: None,
                keys: None,
                verdict,
                store_latency: None,
            },
            span,
        );
    }

    /// A decided request, to events.
    pub(super) fn emit(
        &self,
        snapshot: &Snapshot,
        ctx: &Ctx<'_>,
        applied: &[u16],
        decision: Option<&Decision>,
        keys: Option<&AppliedRules>,
        verdict: Verdict,
    ) {
        self.observer.decided(
            &Decided {
                snapshot,
                head: ctx.head,
                resolution: Some(ctx.resolution),
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
