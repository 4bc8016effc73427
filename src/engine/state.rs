//! [`Engine`]: what the services of one layer share — the policy in force, the store, the
//! extractors, the fallback, the observer — and how the policy in force is taken.

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

use super::local::Local;
use super::uses::Uses;
use crate::key::SharedExtractor;
use crate::observe::Observer;
use crate::policy::snapshot::Snapshot;
use crate::policy::{Live, SharedTenantExtractor};
use crate::shed::Shedder;
use crate::throttle::Every;

/// The policy of a layer: fixed when it was built, or live (swapped by reloads).
pub(crate) enum PolicyInForce {
    Fixed(Arc<Snapshot>),
    Live(Arc<Live>),
}

/// Everything the services of one layer share: the request path runs on it.
pub(crate) struct Engine<St> {
    pub(crate) policy: PolicyInForce,
    pub(crate) store: St,
    /// The layer's key: rules without their own count by it, and lists match it.
    pub(crate) layer_key: SharedExtractor,
    /// Finds each request's tenant, when the layer has tenants.
    pub(crate) tenant: Option<SharedTenantExtractor>,
    /// The fallback limiter of rules that fall back to one when the store fails.
    pub(crate) fallback: Local,
    pub(crate) warned_store_error: Every,
    /// Requests waiting for a delay rule's budget, and how many may.
    pub(crate) waiting: AtomicUsize,
    pub(crate) max_waiting: usize,
    /// Metrics, the span, the rejection log and the decision hook.
    pub(crate) observer: Observer,
    /// This layer's registration of its rules on the store: while it lives, no other layer may
    /// give one of these rule names another quota on the same store.
    pub(crate) registration: Arc<()>,
    /// Whether CORS preflights are limited.
    pub(crate) count_preflight: bool,
    /// The process's requests in flight, when the layer sheds load.
    pub(crate) shedder: Option<Shedder>,
    /// What else checks the layer's rules: each refuses, when it is made and at every reload,
    /// the rules it cannot keep.
    pub(crate) uses: Uses,
}

impl<St> Drop for Engine<St> {
    fn drop(&mut self) {
        // The thread that polls a live policy's source stops now, not an interval later.
        if let PolicyInForce::Live(live) = &self.policy {
            live.stop();
        }
    }
}

impl<St> Engine<St> {
    /// The policy in force.
    pub(crate) fn snapshot(&self) -> Arc<Snapshot> {
        match &self.policy {
            PolicyInForce::Fixed(snapshot) => snapshot.clone(),
            PolicyInForce::Live(live) => live.current.load_full(),
        }
    }
}
