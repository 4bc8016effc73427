//! The one driver of a decision: [`Engine::decide`] decides a request at once
//! ([`Decide::Ready`]) or gives a [`Driver`] that waits for what it could not decide (a tenant
//! or key lookup, the store, a second check) and comes to a [`Ruling`]: call the inner service,
//! or answer for it. The response future, the tonic interceptor and the per-message checks all
//! drive their decisions through it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::request::Parts;
use pin_project_lite::pin_project;

use super::check::{Check, Checked, Ctx, DeferredCheck, Phase, Stopwatch};
use super::next::{Admitted, Next, Start};
use super::state::Engine;
use crate::observe::Head;
use crate::policy::snapshot::{Listing, Snapshot};
use crate::policy::{Applied, FoundKeys, Resolution, TenantFuture};
use crate::response::Refusal;
use crate::shed::Priority;
use crate::store::Store;

/// What a decided request comes to.
pub(crate) enum Ruling {
    /// Call the inner service, then add the budget of the decision to its response, settle
    /// what needs the response, and hold the slots until the response body ends.
    Call(Admitted),
    /// Answer for the inner service: a denial, a refusal (deny list, load shedding, a store
    /// failure when a rule fails closed), in its gRPC form for a gRPC call.
    Answer { refusal: Refusal, grpc: bool },
}

/// A request's decision: made at once, or to be waited for with its [`Driver`].
pub(crate) enum Decide<St: Store> {
    /// Decided without waiting (the store answered at once, or no rule applied).
    Ready(Ruling),
    /// Something must be waited for first.
    Waiting(Driver<St>),
}

pin_project! {
    /// What a request waits for before it is decided.
    #[project = WaitProj]
    enum Wait<C> {
        // The tenant is looked up; then the lists and the rules follow.
        Tenant { future: TenantFuture, listing: Listing },
        // The store was asked.
        Store { #[pin] check: Check<C>, stopwatch: Stopwatch },
        // Key lookups then the store, or a second check.
        Deferred { check: DeferredCheck },
    }
}

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
        applied: Applied,
        // The keys, kept only when they may be needed again (local fallback, shadow and delay
        // rules, the rejection log's digest).
        keys: Option<Box<FoundKeys>>,
        // Where the request stands in the policy, once its rules are resolved.
        resolution: Option<Resolution>,
    }
}

impl<St: Store> Engine<St> {
    /// Takes the policy in force and decides the request under it: at once when it can, else
    /// with a [`Driver`]. `span` stays open until the request is decided.
    pub(crate) fn decide(
        self: &Arc<Self>,
        parts: &mut Parts,
        span: tracing::Span,
    ) -> (Arc<Snapshot>, Decide<St>) {
        let (snapshot, start) = self.start(parts, &span);
        let decide = self.decide_from(&snapshot, start, span);
        (snapshot, decide)
    }

    /// A request shed before any check: answered at once.
    pub(crate) fn decide_shed(
        self: &Arc<Self>,
        parts: &Parts,
        span: &tracing::Span,
        priority: Priority,
        share: usize,
    ) -> (Arc<Snapshot>, Decide<St>) {
        let (snapshot, start) = self.shed(parts, span, priority, share);
        let decide = self.decide_from(&snapshot, start, tracing::Span::none());
        (snapshot, decide)
    }

    fn decide_from(
        self: &Arc<Self>,
        snapshot: &Arc<Snapshot>,
        start: Start<St::Future>,
        span: tracing::Span,
    ) -> Decide<St> {
        let mut resolution = None;
        let (wait, applied, keys) = match start {
            Start::Decided { next } => match next {
                Next::Call(admitted) => return Decide::Ready(Ruling::Call(admitted)),
                Next::Answer { refusal, grpc } => {
                    return Decide::Ready(Ruling::Answer { refusal, grpc });
                }
                Next::Again(check) => (Wait::Deferred { check }, Applied::new(), None),
            },
            Start::Checking {
                check,
                applied,
                keys,
                stopwatch,
                resolution: resolved,
            } => {
                resolution = Some(resolved);
                (Wait::Store { check, stopwatch }, applied, keys)
            }
            Start::Deferred(check) => (Wait::Deferred { check }, Applied::new(), None),
            Start::Tenant { future, listing } => {
                (Wait::Tenant { future, listing }, Applied::new(), None)
            }
        };
        Decide::Waiting(Driver {
            wait,
            engine: self.clone(),
            snapshot: snapshot.clone(),
            span,
            applied,
            keys,
            resolution,
        })
    }
}

impl<St: Store> Driver<St> {
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
                    let start = this.engine.with_tenant(
                        this.snapshot,
                        tenant.into(),
                        *listing,
                        parts,
                        this.span,
                    );
                    match start {
                        Start::Decided { next } => match next {
                            Next::Call(admitted) => {
                                return Poll::Ready(this.decided(Ruling::Call(admitted)));
                            }
                            Next::Answer { refusal, grpc } => {
                                return Poll::Ready(this.decided(Ruling::Answer { refusal, grpc }));
                            }
                            Next::Again(check) => this.wait.set(Wait::Deferred { check }),
                        },
                        Start::Checking {
                            check,
                            applied,
                            keys,
                            stopwatch,
                            resolution,
                        } => {
                            *this.applied = applied;
                            *this.keys = keys;
                            *this.resolution = Some(resolution);
                            this.wait.set(Wait::Store { check, stopwatch });
                        }
                        Start::Deferred(check) => this.wait.set(Wait::Deferred { check }),
                        // The tenant is known now: not looked up again.
                        Start::Tenant { future, listing } => {
                            this.wait.set(Wait::Tenant { future, listing })
                        }
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
                resolution: this.resolution.unwrap_or_default(),
            };
            let next = this.engine.after_check(
                this.snapshot,
                this.applied,
                this.keys.as_deref(),
                result,
                &ctx,
            );
            match next {
                Next::Call(admitted) => return Poll::Ready(this.decided(Ruling::Call(admitted))),
                Next::Answer { refusal, grpc } => {
                    return Poll::Ready(this.decided(Ruling::Answer { refusal, grpc }));
                }
                Next::Again(check) => this.wait.set(Wait::Deferred { check }),
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
}
