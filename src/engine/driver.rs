//! The one driver of a decision: [`Engine::decide`] decides a request at once
//! ([`Decide::Ready`]) or says what it waits for ([`Decide::Waiting`]); a [`Driver`] waits
//! for it (a tenant or key lookup, the store, a second check) and comes to a [`Ruling`]: call
//! the inner service, or answer for it. The response future, the tonic interceptor and the
//! per-message checks all drive their decisions through it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::request::Parts;
use pin_project_lite::pin_project;

use super::check::{Checked, Ctx, Phase};
use super::ruling::{Decide, Pending, Ruling, Wait, WaitProj};
use super::state::Engine;
use crate::observe::Head;
use crate::policy::snapshot::Snapshot;
use crate::policy::{AppliedRules, Resolution, RuleIndices};
use crate::store::Store;

pin_project! {
    /// Drives a decision that needs waiting to its [`Ruling`], under the policy the request
    /// started with.
    #[project = DriverProj]
    pub(crate) struct Driver<St>
    where
        St: Store,
    {
        #[pin]
        wait: Wait<St::Future>,
        engine: Arc<Engine<St>>,
        snapshot: Arc<Snapshot>,
        // Open until the request is decided.
        span: tracing::Span,
        // The rules asked about.
        applied: RuleIndices,
        // The keys, kept only when they may be needed again.
        keys: Option<Box<AppliedRules>>,
        // Where the request stands in the policy, once its rules are resolved.
        resolution: Option<Resolution>,
    }
}

impl<St: Store> Engine<St> {
    /// Takes the policy in force and decides the request under it: at once when it can, else
    /// says what to wait for (with a [`Driver`]). The request finishes under this policy.
    pub(crate) fn decide(
        self: &Arc<Self>,
        parts: &mut Parts,
        span: &tracing::Span,
    ) -> (Arc<Snapshot>, Decide<St::Future>) {
        let snapshot = self.snapshot();
        let decide = self.begin(&snapshot, parts, span);
        (snapshot, decide)
    }
}

impl<St: Store> Driver<St> {
    /// Waits for what `pending` waits for, under `snapshot`; `span` stays open until the
    /// request is decided.
    pub(crate) fn new(
        pending: Pending<St::Future>,
        engine: Arc<Engine<St>>,
        snapshot: Arc<Snapshot>,
        span: tracing::Span,
    ) -> Self {
        Driver {
            wait: pending.wait,
            engine,
            snapshot,
            span,
            applied: pending.applied,
            keys: pending.keys,
            resolution: pending.resolution,
        }
    }

    /// Waits for what the decision needs, then decides. `parts` is the request's head (a
    /// tenant found is written into its extensions).
    pub(crate) fn poll_decide(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        parts: &mut Parts,
    ) -> Poll<Ruling> {
        let mut this = self.project();
        loop {
            let (result, phase, latency) = match this.wait.as_mut().project() {
                WaitProj::Tenant { future, listing } => {
                    let tenant = ready!(future.as_mut().poll(cx));
                    let decide = this.engine.with_tenant(
                        this.snapshot,
                        tenant.into(),
                        *listing,
                        parts,
                        this.span,
                    );
                    match decide {
                        Decide::Ready(ruling) => return Poll::Ready(this.decided(ruling)),
                        Decide::Waiting(pending) => this.wait_for(pending),
                    }
                    continue;
                }
                WaitProj::Store { check, stopwatch } => {
                    let result = ready!(check.poll(cx));
                    let latency = stopwatch.stop(&this.engine.observer, &result);
                    (result, Phase::default(), latency)
                }
                WaitProj::Deferred { check } => {
                    let Checked {
                        applied,
                        keys,
                        result,
                        phase,
                        latency,
                        resolution,
                    } = ready!(check.as_mut().poll(cx));
                    *this.applied = applied;
                    *this.keys = keys;
                    *this.resolution = Some(resolution);
                    (result, phase, latency)
                }
            };
            let ctx = Ctx {
                head: Head::of_parts(parts),
                span: this.span,
                latency,
                phase,
                // Known once the store was asked.
                resolution: this
                    .resolution
                    .unwrap_or_else(|| this.snapshot.resolver.place(None, None)),
            };
            let decide = this.engine.after_check(
                this.snapshot,
                this.applied,
                this.keys.as_deref(),
                result,
                &ctx,
            );
            match decide {
                Decide::Ready(ruling) => return Poll::Ready(this.decided(ruling)),
                Decide::Waiting(pending) => this.wait_for(pending),
            }
        }
    }

    /// Decides now if nothing it waits for is pending (a store that decides at once), for
    /// those that cannot wait: `None` when it would have to.
    #[cfg_attr(not(feature = "tonic"), allow(dead_code))]
    pub(crate) fn decide_now(self: Pin<&mut Self>, parts: &mut Parts) -> Option<Ruling> {
        let mut context = Context::from_waker(std::task::Waker::noop());
        match self.poll_decide(&mut context, parts) {
            Poll::Ready(ruling) => Some(ruling),
            Poll::Pending => None,
        }
    }

    /// Tells events that the request's client went away before it was decided.
    pub(crate) fn cancel(&self, head: Head<'_>) {
        self.engine.cancelled(
            &self.snapshot,
            head,
            &self.applied,
            self.resolution,
            &self.span,
        );
    }
}

impl<St: Store> DriverProj<'_, St> {
    /// The ruling, with the span closed: the request is decided.
    fn decided(&mut self, ruling: Ruling) -> Ruling {
        *self.span = tracing::Span::none();
        ruling
    }

    /// Waits for `pending` next.
    fn wait_for(&mut self, pending: Pending<St::Future>) {
        self.wait.set(pending.wait);
        *self.applied = pending.applied;
        *self.keys = pending.keys;
        if pending.resolution.is_some() {
            *self.resolution = pending.resolution;
        }
    }
}
