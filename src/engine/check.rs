//! One check of the store: [`Check`] (the store's future, or an answer known without
//! asking), the one [`Stopwatch`] that times every check and tells the observer, and what a
//! check that needed waiting comes back with ([`Checked`]).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use pin_project_lite::pin_project;
use smallvec::SmallVec;

use super::state::Engine;
use crate::Decision;
use crate::observe::{Head, Observer};
use crate::policy::snapshot::Snapshot;
use crate::policy::{Applied, AppliedRules, Resolution, RuleIndices};
use crate::store::{Charge, Store, StoreError};

/// The store's answer to a check that needed waiting: the rules that applied, their keys when
/// they are kept (see [`Snapshot::keeps_keys`]), and the answer.
pub(crate) struct Checked {
    pub(crate) applied: RuleIndices,
    pub(crate) keys: Option<Box<AppliedRules>>,
    pub(crate) result: Result<Decision, StoreError>,
    /// How the request got to this check.
    pub(crate) phase: Phase,
    /// How long the store took, when measured.
    pub(crate) latency: Option<Duration>,
    /// Where the request stands in the policy.
    pub(crate) resolution: Resolution,
}

/// How a request got to a check: after a delay rule's wait (it is not delayed again), or
/// after a shadow rule would have denied it.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Phase {
    pub(crate) delayed: bool,
    pub(crate) shadowed: bool,
}

/// What [`Engine::after_check`] knows of a request besides the store's answer.
pub(crate) struct Ctx<'a> {
    pub(crate) head: Head<'a>,
    pub(crate) span: &'a tracing::Span,
    pub(crate) latency: Option<Duration>,
    pub(crate) phase: Phase,
    /// Where the request stands in the policy.
    pub(crate) resolution: Resolution,
}

/// When a store check started, when its latency is measured (with the feature `metrics`, or
/// when the request's span is recorded): every check of the store is timed by one.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Stopwatch(Option<Instant>);

impl Stopwatch {
    /// Whether the checks of a request with this span are timed.
    pub(crate) fn times(span: &tracing::Span) -> bool {
        cfg!(feature = "metrics") || !span.is_disabled()
    }

    /// Started now when `timed`.
    pub(crate) fn start(timed: bool) -> Self {
        Stopwatch(timed.then(Instant::now))
    }

    /// Started now for a request with this span, when its checks are timed.
    pub(crate) fn start_for(span: &tracing::Span) -> Self {
        Stopwatch::start(Stopwatch::times(span))
    }

    /// The latency of the check that answered `result`, told to the observer.
    pub(crate) fn stop(
        self,
        observer: &Observer,
        result: &Result<Decision, StoreError>,
    ) -> Option<Duration> {
        let latency = self.0.map(|at| at.elapsed());
        observer.store_checked(latency, result);
        latency
    }
}

/// A check that needs asynchronous work: key lookups, or a second check.
pub(crate) type DeferredCheck = Pin<Box<dyn Future<Output = Checked> + Send>>;

pin_project! {
    /// The store's answer, or an answer made without asking it.
    #[project = CheckProj]
    pub(crate) enum Check<C> {
        Store { #[pin] future: C },
        Decided { result: Option<Result<Decision, StoreError>> },
    }
}

impl<C> Check<C> {
    /// Asks the store, unless no rule applies.
    pub(crate) fn ask<St: Store<Future = C>>(store: &St, charges: &[Charge<'_>]) -> Self {
        if charges.is_empty() {
            return Check::Decided {
                result: Some(Ok(Decision::default())),
            };
        }
        match store.check_now(charges) {
            Some(result) => Check::Decided {
                result: Some(result),
            },
            None => Check::Store {
                future: store.check(charges),
            },
        }
    }

    /// The answer, when it was known without waiting.
    // The pending check goes back by value, once per request: no copy worth a box.
    #[allow(clippy::result_large_err)]
    pub(crate) fn into_decided(self) -> Result<Result<Decision, StoreError>, Self> {
        match self {
            Check::Decided {
                result: Some(result),
            } => Ok(result),
            pending => Err(pending),
        }
    }
}

impl<C> Future for Check<C>
where
    C: Future<Output = Result<Decision, StoreError>>,
{
    type Output = Result<Decision, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            CheckProj::Store { future } => future.poll(cx),
            // Polled again after it answered: never by the layer's own future.
            CheckProj::Decided { result } => Poll::Ready(
                result
                    .take()
                    .unwrap_or(Err(StoreError::Protocol("check polled twice".into()))),
            ),
        }
    }
}

impl<St: Store> Engine<St> {
    /// Asks the store about every rule that has a key, in rule order.
    pub(crate) fn ask(
        &self,
        snapshot: &Snapshot,
        keys: &AppliedRules,
    ) -> (Check<St::Future>, RuleIndices) {
        let charges: SmallVec<[Charge<'_>; 2]> = keys
            .iter()
            .map(|Applied { rule: i, key, cost }| Charge {
                rule: &snapshot.rules[usize::from(*i)].spec,
                key,
                cost: *cost,
            })
            .collect();
        let applied = keys.iter().map(|applied| applied.rule).collect();
        (Check::ask(&self.store, &charges), applied)
    }

    /// Asks the store about `keys` and waits for its answer, timed when `timed`: the rules
    /// asked about, the answer, and how long the store took.
    pub(crate) async fn check_timed(
        &self,
        snapshot: &Snapshot,
        keys: &AppliedRules,
        timed: bool,
    ) -> (RuleIndices, Result<Decision, StoreError>, Option<Duration>) {
        let stopwatch = Stopwatch::start(timed && !keys.is_empty());
        let (check, applied) = self.ask(snapshot, keys);
        let result = check.await;
        let latency = stopwatch.stop(&self.observer, &result);
        (applied, result, latency)
    }
}
