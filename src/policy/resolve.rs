//! [`Resolver`]: which rules apply to a request, by tenant, tier, route and method, and the
//! tier and route it resolved them by.

use std::collections::HashMap;
use std::sync::Arc;

use http::Method;
use http::request::Parts;

use super::Tenant;
use crate::key::Route;

/// A map with the crate's fast hasher.
pub(super) type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// A rule set: indices into the snapshot's rules, in the order they were given.
pub(super) type RuleSet = Box<[u16]>;

/// Which rules apply to a request.
pub(crate) struct Resolver {
    /// Every route some rule set is for, by name, and its number.
    pub(super) known_routes: Map<Box<str>, u16>,
    /// Every route some rule set is for, by number.
    pub(super) route_names: Box<[Box<str>]>,
    pub(super) default_tier: u16,
    pub(super) tier_names: Box<[Arc<str>]>,
    pub(super) tiers: Box<[TierTable]>,
    pub(super) tier_index: Map<Box<str>, u16>,
    pub(super) tenants: Map<Box<str>, TenantTable>,
    /// Whether any rule set is for a route (else the route is never looked at).
    pub(super) routed: bool,
}

pub(super) struct TierTable {
    pub(super) defaults: RuleSet,
    pub(super) routes: RouteTable,
}

pub(super) struct TenantTable {
    pub(super) tier: Option<u16>,
    pub(super) routes: RouteTable,
}

/// Rule sets by route pattern, then by method.
#[derive(Default)]
pub(super) struct RouteTable {
    pub(super) routes: Map<Box<str>, RouteEntry>,
}

#[derive(Default)]
pub(super) struct RouteEntry {
    pub(super) any_method: Option<RuleSet>,
    pub(super) methods: Vec<(Method, RuleSet)>,
}

impl RouteTable {
    pub(super) fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }

    /// The rules for `method` on `route` as [`get`](Self::get) finds them, or with no method,
    /// those for a method the route does not name.
    pub(super) fn lookup(&self, route: &str, method: Option<&Method>) -> Option<&[u16]> {
        match method {
            Some(method) => self.get(route, method),
            None => self.routes.get(route)?.any_method.as_deref(),
        }
    }

    /// The rules for `method` on `route`: its own, else (for `HEAD`, which axum serves with the
    /// `GET` handler) those of `GET`, else those of the route for any method.
    pub(super) fn get(&self, route: &str, method: &Method) -> Option<&[u16]> {
        let entry = self.routes.get(route)?;
        let of = |method: &Method| {
            entry
                .methods
                .iter()
                .find(|(m, _)| m == method)
                .map(|(_, set)| &**set)
        };
        of(method)
            .or_else(|| {
                (*method == Method::HEAD)
                    .then(|| of(&Method::GET))
                    .flatten()
            })
            .or(entry.any_method.as_deref())
    }
}

/// Where a request stands in the policy: its tier and, when some rule set is for it, its
/// route (by number). It travels with the request to its events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Resolution {
    pub(crate) tier: u16,
    pub(crate) route: Option<u16>,
}

/// The rules that apply to one request, and where it stands (its tier and route).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Resolved<'a> {
    pub(crate) resolution: Resolution,
    pub(crate) rules: &'a [u16],
}

impl Resolver {
    /// Every route some rule set is for, in name order.
    #[cfg(all(feature = "testing", feature = "axum"))]
    pub(crate) fn routes(&self) -> impl Iterator<Item = &str> {
        self.route_names.iter().map(|route| &**route)
    }

    /// The most specific rule set for a request of `tenant` (see [`Policy`]).
    pub(crate) fn resolve<'a>(&'a self, tenant: Option<&Tenant>, parts: &Parts) -> Resolved<'a> {
        let listed = tenant.and_then(|t| self.tenants.get(t.id()));
        let tier = self.tier_index_of(tenant, listed);
        let route = if self.routed {
            Route::route(parts)
        } else {
            None
        };
        let resolution = Resolution {
            tier,
            route: self.route_number(route),
        };
        let resolved = |rules| Resolved { resolution, rules };
        let method = &parts.method;
        if let (Some(listed), Some(route)) = (listed, route)
            && let Some(rules) = listed.routes.get(route, method)
        {
            return resolved(rules);
        }
        let table = &self.tiers[usize::from(tier)];
        if let Some(rules) = route.and_then(|route| table.routes.get(route, method)) {
            return resolved(rules);
        }
        if !table.defaults.is_empty() {
            return resolved(&table.defaults);
        }
        let default = &self.tiers[usize::from(self.default_tier)];
        if let Some(rules) = route.and_then(|route| default.routes.get(route, method)) {
            return resolved(rules);
        }
        resolved(&default.defaults)
    }
}

impl Resolver {
    /// The tier of a tenant: the policy's entry, else the extractor's tier if the policy has
    /// it, else the default tier.
    fn tier_index_of(&self, tenant: Option<&Tenant>, listed: Option<&TenantTable>) -> u16 {
        listed
            .and_then(|t| t.tier)
            .or_else(|| {
                tenant
                    .and_then(Tenant::tier)
                    .and_then(|name| self.tier_index.get(name).copied())
            })
            .unwrap_or(self.default_tier)
    }

    /// The number of `route`, when some rule set is for it.
    fn route_number(&self, route: Option<&str>) -> Option<u16> {
        self.known_routes.get(route?).copied()
    }

    /// A known route's name, by number.
    pub(crate) fn route_name(&self, route: u16) -> &str {
        &self.route_names[usize::from(route)]
    }

    /// Where a request of `tenant` on `route` stands, for a request decided before its rules
    /// were resolved (listed, shed, not limited, gone before its tenant was found).
    pub(crate) fn place(&self, tenant: Option<&Tenant>, route: Option<&str>) -> Resolution {
        let listed = tenant.and_then(|t| self.tenants.get(t.id()));
        Resolution {
            tier: self.tier_index_of(tenant, listed),
            route: self.route_number(route),
        }
    }

    /// A tier's name.
    pub(crate) fn tier_name(&self, tier: u16) -> &Arc<str> {
        &self.tier_names[usize::from(tier)]
    }
}
