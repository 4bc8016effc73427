//! [`RouteLabels`]: route patterns as metric label values, bounded.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The most distinct routes that get a label of their own in one layer; later ones share the
/// label `other`. axum's route patterns are bounded by the application, but gRPC method paths
/// are named by the client.
pub const MAX_ROUTE_LABELS: usize = 1_000;

/// Interned route labels: one allocation per distinct route, then a lookup.
#[derive(Default)]
pub(crate) struct RouteLabels {
    seen: Mutex<HashMap<Box<str>, Arc<str>, foldhash::fast::RandomState>>,
    other: OtherLabel,
}

struct OtherLabel(Arc<str>);

impl Default for OtherLabel {
    fn default() -> Self {
        OtherLabel("other".into())
    }
}

impl RouteLabels {
    /// The label of `route`.
    pub(crate) fn label(&self, route: &str) -> Arc<str> {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(label) = seen.get(route) {
            return label.clone();
        }
        if seen.len() >= MAX_ROUTE_LABELS {
            return self.other.0.clone();
        }
        let label: Arc<str> = route.into();
        seen.insert(route.into(), label.clone());
        label
    }
}
