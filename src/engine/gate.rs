//! The gate before any rule is checked: the allow and deny lists, the tenant, CORS
//! preflights, and load shedding's refusals. What passes goes on to the rules the policy
//! resolves for the request.

use std::sync::Arc;

use http::request::Parts;

use super::ruling::{Admitted, Decide, Wait};
use super::state::Engine;
use crate::observe::{Head, Verdict};
use crate::policy::snapshot::{Listing, Snapshot};
use crate::policy::{Found, Resolved, Tenant};
use crate::response::Refusal;
use crate::shed::Priority;
use crate::store::Store;

impl<St: Store> Engine<St> {
    /// The gate, then the rules: the request's lists, its tenant, and what follows.
    pub(super) fn begin(
        self: &Arc<Self>,
        snapshot: &Arc<Snapshot>,
        parts: &mut Parts,
        span: &tracing::Span,
    ) -> Decide<St::Future> {
        let mut listing = Listing::Unlisted;
        if snapshot.lists.has_key_entries() {
            // A key that needs a lookup is not listed: lists are for keys known at once.
            if let Some(key) = self.layer_key.extract(parts).found() {
                listing = snapshot.lists.key(&key);
                if listing == Listing::Denied {
                    return self.forbidden(snapshot, parts, span);
                }
            }
        }
        let tenant = match &self.tenant {
            None => Found::None,
            Some(extractor) => match extractor.tenant(parts) {
                Found::Pending(future) => {
                    return Decide::waiting(Wait::Tenant { future, listing }, None);
                }
                found => found,
            },
        };
        self.with_tenant(snapshot, tenant, listing, parts, span)
    }

    /// Goes on once the tenant is known: its lists (a denied tenant is refused even from an
    /// allowed address: deny wins), then the rules the policy resolves for it. `listing` is what
    /// the lists said of the layer's key.
    pub(crate) fn with_tenant(
        self: &Arc<Self>,
        snapshot: &Arc<Snapshot>,
        tenant: Found,
        mut listing: Listing,
        parts: &mut Parts,
        span: &tracing::Span,
    ) -> Decide<St::Future> {
        let (found, in_place) = match tenant {
            Found::Tenant(tenant) => (Some(tenant), false),
            // An authentication layer's tenant: read where it is.
            Found::InExtensions => (None, true),
            Found::None | Found::Pending(_) => (None, false),
        };
        let gate = {
            let tenant = match &found {
                Some(tenant) => Some(tenant),
                None if in_place => parts.extensions.get::<Tenant>(),
                None => None,
            };
            let mut denied = false;
            if let Some(tenant) = tenant
                && snapshot.lists.has_tenant_entries()
            {
                match snapshot.lists.tenant(tenant) {
                    Listing::Denied => denied = true,
                    Listing::Allowed => listing = Listing::Allowed,
                    Listing::Unlisted => {}
                }
            }
            if denied {
                Gate::Forbidden
            } else if listing == Listing::Allowed {
                Gate::Allowed
            } else if !self.count_preflight && is_preflight(parts) {
                // After the lists: a denied client is refused whatever it sends.
                Gate::Preflight
            } else {
                Gate::Rules(snapshot.resolver.resolve(tenant, parts))
            }
        };
        // The tenant found goes into the request's extensions for handlers and for the
        // tenant's key ([`TenantKey`](crate::policy::TenantKey) reads it there), and for the
        // events; the lists and the rules above took it as a value.
        if let Some(tenant) = found
            && parts.extensions.get::<Tenant>() != Some(&tenant)
        {
            parts.extensions.insert(tenant);
        }
        let parts = &*parts;
        match gate {
            Gate::Forbidden => self.forbidden(snapshot, parts, span),
            Gate::Allowed => {
                self.emit_listed(snapshot, parts, None, span, Verdict::ListedAllowed);
                nothing_applies()
            }
            Gate::Preflight => {
                self.emit_listed(snapshot, parts, None, span, Verdict::NotLimited);
                nothing_applies()
            }
            Gate::Rules(resolved) => {
                self.check_rules(snapshot, resolved.rules, resolved.resolution, parts, span)
            }
        }
    }

    /// A request shed before any check, answered at once: 503 (gRPC `UNAVAILABLE`).
    pub(crate) fn shed(
        &self,
        parts: &Parts,
        span: &tracing::Span,
        priority: Priority,
        share: usize,
    ) -> (Arc<Snapshot>, Decide<St::Future>) {
        let snapshot = self.snapshot();
        tracing::debug!(%priority, "tollgate: request shed");
        #[cfg(feature = "metrics")]
        crate::telemetry::shed(priority.as_str());
        self.emit_listed(&snapshot, parts, None, span, Verdict::Shed);
        let grpc = Head::of_parts(parts).is_grpc();
        (snapshot, Decide::answer(Refusal::Shed { share }, grpc))
    }

    /// A listed request refused: 403 (gRPC `PERMISSION_DENIED`).
    fn forbidden(
        &self,
        snapshot: &Snapshot,
        parts: &Parts,
        span: &tracing::Span,
    ) -> Decide<St::Future> {
        tracing::debug!("tollgate: request refused by the deny list");
        self.emit_listed(snapshot, parts, None, span, Verdict::ListedDenied);
        Decide::answer(Refusal::Forbidden, Head::of_parts(parts).is_grpc())
    }
}

/// Whether a request is a browser's CORS preflight: `OPTIONS` with `Origin` and
/// `Access-Control-Request-Method` (the Fetch standard's definition). Any client can send
/// these headers, and such a request is not counted (the deny lists still apply): what answers
/// `OPTIONS` behind the layer must be cheap (a CORS layer answers it before the handlers).
fn is_preflight(parts: &Parts) -> bool {
    parts.method == http::Method::OPTIONS
        && parts.headers.contains_key(http::header::ORIGIN)
        && parts
            .headers
            .contains_key(http::header::ACCESS_CONTROL_REQUEST_METHOD)
}

/// No rule applies to this request: it goes through, with no budget to report.
pub(super) fn nothing_applies<C>() -> Decide<C> {
    Decide::call(Admitted::default())
}

/// What the gate lets through: the rules resolved for the request, or a decision before them.
enum Gate<'a> {
    /// The tenant is on the deny list.
    Forbidden,
    /// The key or the tenant is on the allow list.
    Allowed,
    /// A CORS preflight, not counted.
    Preflight,
    /// The rules that apply, and where the request stands in the policy.
    Rules(Resolved<'a>),
}
