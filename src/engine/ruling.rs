//! The shapes of a decision: what a decided request comes to ([`Ruling`]: call the inner
//! service with what the request carries to its response, [`Admitted`], or answer for it), and
//! a decision made at once or still to be waited for ([`Decide`], [`Pending`]).

use pin_project_lite::pin_project;

use super::check::{Check, DeferredCheck, Stopwatch};
use super::meter::Meter;
use super::settle::Settle;
use super::slots::Slots;
use crate::Decision;
use crate::policy::snapshot::Listing;
use crate::policy::{AppliedRules, Resolution, RuleIndices, TenantFuture};
use crate::response::Refusal;

/// What an admitted request carries to its response: the decision whose budget the response
/// reports (none when no rule limited it) and the rules it is of, the charges to settle once
/// its head is there, and the concurrency slots it holds until its body ends.
#[derive(Default)]
pub(crate) struct Admitted {
    pub(crate) decision: Option<Decision>,
    pub(crate) applied: RuleIndices,
    pub(crate) settle: Option<Box<Settle>>,
    pub(crate) slots: Option<Slots>,
    /// The budget its response streams from, when a rule meters it.
    pub(crate) meter: Option<Meter>,
}

impl Admitted {
    /// Whether the request holds slots or has charges to settle after its response.
    #[cfg_attr(not(feature = "tonic"), allow(dead_code))]
    pub(crate) fn holds_or_settles(&self) -> bool {
        self.slots.is_some() || self.settle.is_some() || self.meter.is_some()
    }
}

/// What a decided request comes to.
pub(crate) enum Ruling {
    /// Call the inner service, then add the budget of the decision to its response, settle
    /// what needs the response, and hold the slots until the response body ends.
    Call(Admitted),
    /// Answer for the inner service: a denial, a refusal (deny list, load shedding, a store
    /// failure when a rule fails closed), in its gRPC form for a gRPC call.
    Answer { refusal: Refusal, grpc: bool },
}

/// A request's decision: made at once, or to be waited for (by a
/// [`Driver`](super::Driver)). `C` is the store's check future.
pub(crate) enum Decide<C> {
    /// Decided without waiting (the store answered at once, or no rule applied).
    Ready(Ruling),
    /// Something must be waited for first.
    Waiting(Pending<C>),
}

/// What a decision waits for, and what it knows meanwhile.
pub(crate) struct Pending<C> {
    pub(super) wait: Wait<C>,
    /// The rules asked about.
    pub(super) applied: RuleIndices,
    /// The keys, kept only when they may be needed again (local fallback, shadow and delay
    /// rules, the rejection log's digest).
    pub(super) keys: Option<Box<AppliedRules>>,
    /// Where the request stands in the policy, once its rules are resolved.
    pub(super) resolution: Option<Resolution>,
    /// A second check (the enforced rules alone, after a shadow rule's denial), not a lookup
    /// or the store's first answer.
    pub(super) recheck: bool,
}

impl<C> Pending<C> {
    /// Whether this waits for a second check only, which a store that decides at once
    /// answers at its first poll (the interceptor drives nothing else).
    #[cfg_attr(not(feature = "tonic"), allow(dead_code))]
    pub(crate) fn is_recheck(&self) -> bool {
        self.recheck
    }
}

pin_project! {
    /// What a request waits for before it is decided.
    #[project = WaitProj]
    pub(crate) enum Wait<C> {
        // The tenant is looked up; then the lists and the rules follow.
        Tenant { future: TenantFuture, listing: Listing },
        // The store was asked.
        Store { #[pin] check: Check<C>, stopwatch: Stopwatch },
        // Key lookups then the store, or a second check.
        Deferred { check: DeferredCheck },
    }
}

impl<C> Decide<C> {
    /// Waits for `wait`, knowing no more than where the request stands in the policy, if its
    /// rules were resolved.
    pub(super) fn waiting(wait: Wait<C>, resolution: Option<Resolution>) -> Self {
        Decide::Waiting(Pending {
            wait,
            applied: RuleIndices::new(),
            keys: None,
            resolution,
            recheck: false,
        })
    }

    /// Checks again (`check`): the rules asked about so far are `applied`, the request stands
    /// at `resolution`; `recheck` for the second check after a shadow rule's denial (not a
    /// delay rule's wait).
    pub(super) fn again(
        check: DeferredCheck,
        applied: RuleIndices,
        resolution: Resolution,
        recheck: bool,
    ) -> Self {
        Decide::Waiting(Pending {
            wait: Wait::Deferred { check },
            applied,
            keys: None,
            resolution: Some(resolution),
            recheck,
        })
    }

    /// Calls the inner service.
    pub(super) fn call(admitted: Admitted) -> Self {
        Decide::Ready(Ruling::Call(admitted))
    }

    /// Answers for the inner service.
    pub(super) fn answer(refusal: Refusal, grpc: bool) -> Self {
        Decide::Ready(Ruling::Answer { refusal, grpc })
    }
}
