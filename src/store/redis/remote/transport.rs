//! [`Transport`]: what differs between the two Redis stores, how a call reaches Redis (one
//! server, or the primaries of a cluster); [`Remote`](super::Remote) does the rest once.

use std::future::Future;
use std::sync::Arc;

use super::super::Settings;
use super::super::local::Local;
use super::super::script::{Mode, Prepared, Reply};
use crate::store::{Charge, RuleRegistry, StoreError};

/// How a Redis store reaches Redis: [`Standalone`](super::super::standalone::Standalone) or
/// [`Cluster`](super::super::cluster::Cluster).
pub(crate) trait Transport: Send + Sync + Sized + 'static {
    /// The store's kind, as [`Store::kind`](crate::store::Store::kind) names it.
    const KIND: &'static str;

    /// What the store is configured with.
    fn settings(&self) -> &Settings;

    /// The denials and leases decided on this replica.
    fn replica(&self) -> &Arc<Local>;

    /// The rules the store was given.
    fn registry(&self) -> &RuleRegistry;

    /// Starts connecting in the background, unless connected (or trying).
    fn start(self: &Arc<Self>);

    /// Why no planned check can be sent now, if none can: the store has not connected yet (on
    /// one server, or its circuit breaker is open).
    fn unsendable(&self) -> Option<StoreError>;

    /// Why the check of `charges` cannot be sent now, if it cannot, asked before it is
    /// planned ([`Store::check_now`](crate::store::Store::check_now)); starts the transport.
    fn refusal(self: &Arc<Self>, charges: &[Charge<'_>]) -> Option<StoreError>;

    /// Whether the check of `prepared` runs to its end whatever its request does, which then
    /// waits for it (it is never answered ahead of its call from leases).
    fn runs_alone(&self, prepared: &[Prepared]) -> bool;

    /// The reply to the check of `prepared` (the store's time, `now`, with an injected clock),
    /// within a check's time budget. Polled on a Tokio runtime; one that
    /// [runs alone](Self::runs_alone) is sent at once, polled or not.
    fn decide(
        self: Arc<Self>,
        prepared: Vec<Prepared>,
        now: Option<u64>,
    ) -> impl Future<Output = Result<Reply, StoreError>> + Send;

    /// The reply to a peek of `prepared` (nothing charged), within a check's time budget.
    fn peek(
        self: Arc<Self>,
        prepared: Vec<Prepared>,
        now: Option<u64>,
    ) -> impl Future<Output = Result<Reply, StoreError>> + Send;

    /// One call of `charges` in `mode` outside the batches (on a cluster, one per slot),
    /// within a check's time budget.
    fn call(
        self: Arc<Self>,
        mode: Mode,
        now: Option<u64>,
        charges: Vec<Prepared>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Tells every replica that the keys of Redis names `names` were forgotten (a `PUBLISH` on
    /// the prefix's channel: [`forget`](super::super::forget)), within a check's time budget.
    fn publish(
        self: Arc<Self>,
        names: Vec<String>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}
