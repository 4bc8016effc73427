//! [`Snapshot`]: a policy compiled for the request path, immutable: its rules, its answers
//! rendered once, its resolver and its lists.

use std::sync::Arc;

use http::Method;
use ipnet::IpNet;

pub(crate) use super::lists::Listing;
use super::lists::Lists;
use super::model::{Listed, Policy, Region, Subject};
use super::resolve::{Map, Resolver, RouteEntry, RouteTable, RuleSet, TenantTable, TierTable};
use super::{CompiledRule, Quota, Rule, RuleMode};
use crate::key::SharedExtractor;
use crate::policy::MAX_RULES;
use crate::response::{Answers, DeniedHandler, Headers};
use crate::throttle::Once;
use crate::{ConfigError, FailureMode};

/// What a layer needs to compile a policy: its defaults and its answers.
#[derive(Clone)]
pub(crate) struct Compiler {
    /// The key of rules without their own: the tenant, else the layer's key, when the layer
    /// finds tenants; else the layer's key.
    pub(crate) default_key: SharedExtractor,
    /// The layer's key (`ip` in a rules file).
    pub(crate) layer_key: SharedExtractor,
    pub(crate) on_store_error: FailureMode,
    pub(crate) headers: Headers,
    pub(crate) on_denied: Option<DeniedHandler>,
    /// The layer's name, for the `layer` label of its metrics.
    pub(crate) name: Option<Arc<str>>,
}

/// A policy ready for the request path.
pub(crate) struct Snapshot {
    /// Unique in the process: never reused, unlike an address.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) id: u64,
    pub(crate) version: Arc<str>,
    /// The layer's name, for the `layer` label of its metrics.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) layer_name: Option<Arc<str>>,
    /// Every rule of the policy, once per name.
    pub(crate) rules: Box<[CompiledRule]>,
    /// Per rule: whether the missing-key hint was given, for HTTP and for gRPC requests.
    pub(crate) missing_key_hints: Box<[[Once; 2]]>,
    pub(crate) answers: Answers,
    pub(crate) resolver: Resolver,
    pub(crate) lists: Lists,
    /// Whether a rule falls back to the local limiter when the store fails.
    pub(crate) uses_fallback: bool,
    /// Whether a rule is in shadow or delay mode (its decisions may need a second check).
    pub(crate) watches: bool,
    /// Whether a rule charges by the response or settles its cost after it.
    pub(crate) settles: bool,
    /// Whether a rule is a concurrency limit, whose slots are given back after the response.
    pub(crate) holds: bool,
    /// Whether a rule meters its units while the response streams.
    pub(crate) meters: bool,
    /// The response headers rules read their real cost from: removed from every response,
    /// settled or not (the store failed open, the rule did not apply).
    pub(crate) cost_headers: Box<[http::HeaderName]>,
}

impl Snapshot {
    /// Whether a request's keys must be kept after its check: for the local fallback, for a
    /// second check of shadow and delay rules, or to settle charges after the response.
    pub(crate) fn keeps_keys(&self) -> bool {
        self.uses_fallback || self.watches || self.settles || self.holds || self.meters
    }

    /// Compiles and checks a policy; errors name where they are when the policy was read from
    /// a file.
    pub(crate) fn compile(policy: &Policy, compiler: &Compiler) -> Result<Self, ConfigError> {
        Self::compile_placed(policy, compiler).map_err(|(subject, error)| {
            match (&policy.origin, subject) {
                (Some(origin), Some(subject)) => origin.place(&subject, error),
                (Some(origin), None) => error.at_file(&origin.name),
                (None, _) => error,
            }
        })
    }

    fn compile_placed(
        policy: &Policy,
        compiler: &Compiler,
    ) -> Result<Self, (Option<Subject>, ConfigError)> {
        let at = |subject: Subject| move |error: ConfigError| (Some(subject.clone()), error);
        let version = policy.version.trim();
        if version.is_empty()
            || version.len() > 128
            || !version.chars().all(|c| c.is_ascii_graphic() || c == ' ')
        {
            return Err(at(Subject::Version)(ConfigError::new(format!(
                "policy version {:?} is not allowed; give it 1 to 128 printable ASCII characters \
                 (a date or a release number)",
                policy.version
            ))));
        }
        if let Some(region) = &policy.region {
            check_region(region).map_err(at(Subject::Region))?;
        }
        let mut rules = RuleTable::new(compiler, policy.region.as_ref());

        let mut tiers: Vec<TierTable> = Vec::with_capacity(policy.tiers.len());
        let mut tier_index: Map<Box<str>, u16> = Map::default();
        for tier in &policy.tiers {
            let place = format!("tier \"{}\"", tier.name);
            let here = at(Subject::Tier(tier.name.clone()));
            if tier.name.is_empty() {
                return Err(here(ConfigError::new("a tier has an empty name; name it")));
            }
            if tier_index
                .insert(tier.name.as_str().into(), tiers.len() as u16)
                .is_some()
            {
                return Err(here(ConfigError::new(format!(
                    "two tiers are named \"{}\"; give each its own name",
                    tier.name
                ))));
            }
            if u16::try_from(tiers.len()).is_err() {
                return Err(here(ConfigError::new("a policy holds at most 65535 tiers")));
            }
            let defaults = if tier.rules.is_empty() {
                RuleSet::default()
            } else {
                rules
                    .set(&tier.rules, &place)
                    .map_err(|e| e.or_at(Subject::Tier(tier.name.clone())))?
            };
            let routes = RouteTable::new(&tier.routes, &mut rules, &place)
                .map_err(|e| e.or_at(Subject::Tier(tier.name.clone())))?;
            tiers.push(TierTable { defaults, routes });
        }
        let Some(default_name) = &policy.default_tier else {
            return Err(Placed::unplaced(ConfigError::new(
                "the policy has no default tier, so requests without a known tenant would be \
                 unlimited; name one with Policy::default_tier (default_tier = \"…\" in a file)",
            )));
        };
        let Some(&default_tier) = tier_index.get(default_name.as_str()) else {
            return Err(at(Subject::DefaultTier)(ConfigError::new(format!(
                "the default tier \"{default_name}\" is not a tier of the policy; add it or name \
                 another"
            ))));
        };
        // A layer's own rules were counted where they were given: none only when it sheds.
        if tiers[usize::from(default_tier)].defaults.is_empty()
            && policy.all_tiers.is_empty()
            && !policy.untiered
        {
            return Err(at(Subject::Tier(default_name.clone()))(ConfigError::new(
                format!(
                    "the default tier \"{default_name}\" has no rules of its own, so requests on \
                 routes it does not list would be unlimited; give it at least one rule (or give \
                 the policy rules for every tier)"
                ),
            )));
        }

        let mut tenants: Map<Box<str>, TenantTable> = Map::default();
        for tenant in &policy.tenants {
            let place = format!("tenant \"{}\"", tenant.id);
            let here = at(Subject::Tenant(tenant.id.clone()));
            if tenant.id.is_empty() {
                return Err(here(ConfigError::new(
                    "a tenant has an empty id; give its id",
                )));
            }
            let tier = match &tenant.tier {
                None => None,
                Some(name) => Some(*tier_index.get(name.as_str()).ok_or_else(|| {
                    here(ConfigError::new(format!(
                        "{place} has the tier \"{name}\", which the policy does not have; add the \
                         tier or fix the name"
                    )))
                })?),
            };
            let routes = RouteTable::new(&tenant.routes, &mut rules, &place)
                .map_err(|e| e.or_at(Subject::Tenant(tenant.id.clone())))?;
            if tenants
                .insert(tenant.id.as_str().into(), TenantTable { tier, routes })
                .is_some()
            {
                return Err(here(ConfigError::new(format!(
                    "the tenant \"{}\" is listed twice; merge its entries",
                    tenant.id
                ))));
            }
        }

        // The rules of every tier join each set that can win, so that one check covers them.
        let common = if policy.all_tiers.is_empty() {
            RuleSet::default()
        } else {
            rules
                .set(&policy.all_tiers, "all_tiers")
                .map_err(|e| e.or_at(Subject::AllTiers))?
        };
        let common_routes = RouteTable::new(&policy.all_tiers_routes, &mut rules, "all_tiers")
            .map_err(|e| e.or_at(Subject::AllTiers))?;
        if !common.is_empty() || !common_routes.is_empty() {
            let names: Vec<&str> = policy.tiers.iter().map(|t| t.name.as_str()).collect();
            let widened = Widen {
                common: &common,
                routes: &common_routes,
                default_tier,
            };
            tiers = widened
                .tiers(&tiers, &names)
                .map_err(|e| (Some(Subject::AllTiers), e))?;
            for (id, tenant) in &mut tenants {
                tenant.routes = widened
                    .tenant_routes(&tenant.routes, id)
                    .map_err(|e| (Some(Subject::AllTiers), e))?;
            }
        }

        for entry in policy.allow.iter().chain(&policy.deny) {
            check_listed(entry).map_err(|e| (None, e))?;
        }
        let rules = rules.finish();
        let routed = tiers.iter().any(|t| !t.routes.is_empty())
            || tenants.values().any(|t| !t.routes.is_empty());
        static IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        // Every route some rule set is for, numbered in name order.
        let mut route_names: Vec<Box<str>> = tiers
            .iter()
            .map(|t| &t.routes)
            .chain(tenants.values().map(|t| &t.routes))
            .flat_map(|table| table.routes.keys().cloned())
            .collect();
        route_names.sort();
        route_names.dedup();
        if u16::try_from(route_names.len()).is_err() {
            return Err((
                None,
                ConfigError::new(format!(
                    "a policy names {} routes; it may name at most 65535",
                    route_names.len()
                )),
            ));
        }
        let route_names: Box<[Box<str>]> = route_names.into();
        Ok(Snapshot {
            id: IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            version: version.into(),
            layer_name: compiler.name.clone(),
            missing_key_hints: rules.iter().map(|_| [Once::new(), Once::new()]).collect(),
            answers: Answers::new(
                rules.iter().map(|rule| rule.spec.clone()).collect(),
                compiler.headers,
                compiler.on_denied.clone(),
            ),
            uses_fallback: rules
                .iter()
                .any(|rule| rule.on_store_error == FailureMode::Local),
            watches: rules.iter().any(|rule| rule.mode != RuleMode::Enforce),
            settles: rules.iter().any(|rule| rule.after.is_some()),
            meters: rules.iter().any(|rule| rule.meter.is_some()),
            holds: rules
                .iter()
                .any(|rule| rule.spec.algorithm().is_concurrency()),
            cost_headers: {
                let mut names: Vec<http::HeaderName> = rules
                    .iter()
                    .filter_map(|rule| rule.after.as_ref()?.header().cloned())
                    .collect();
                names.sort_by(|a, b| a.as_str().cmp(b.as_str()));
                names.dedup();
                names.into()
            },
            rules,
            resolver: Resolver {
                known_routes: route_names
                    .iter()
                    .enumerate()
                    .map(|(n, route)| (route.clone(), n as u16))
                    .collect(),
                route_names,
                default_tier,
                tier_names: policy
                    .tiers
                    .iter()
                    .map(|t| Arc::from(if policy.untiered { "" } else { t.name.as_str() }))
                    .collect(),
                tiers: tiers.into(),
                tier_index,
                tenants,
                routed,
            },
            lists: Lists::new(&policy.allow, &policy.deny),
        })
    }
}

/// An error and the part of the policy it is about, when known.
type Placed = (Option<Subject>, ConfigError);

trait PlacedExt {
    fn unplaced(error: ConfigError) -> Self;
    /// Placed at `subject` unless placed already.
    fn or_at(self, subject: Subject) -> Self;
}

impl PlacedExt for Placed {
    fn unplaced(error: ConfigError) -> Self {
        (None, error)
    }

    fn or_at(self, subject: Subject) -> Self {
        (self.0.or(Some(subject)), self.1)
    }
}

/// The rules of a policy, once per name.
struct RuleTable<'a> {
    compiler: &'a Compiler,
    region: Option<&'a Region>,
    given: Vec<Rule>,
    compiled: Vec<CompiledRule>,
    by_name: Map<String, u16>,
}

impl<'a> RuleTable<'a> {
    fn new(compiler: &'a Compiler, region: Option<&'a Region>) -> Self {
        RuleTable {
            compiler,
            region,
            given: Vec::new(),
            compiled: Vec::new(),
            by_name: Map::default(),
        }
    }

    /// The set of `rules`, found in `place` (for errors).
    fn set(&mut self, rules: &[Rule], place: &str) -> Result<RuleSet, Placed> {
        if rules.is_empty() {
            return Err(Placed::unplaced(ConfigError::new(format!(
                "{place} has an empty rule list; give it rules or remove it"
            ))));
        }
        if rules.len() > MAX_RULES {
            return Err(Placed::unplaced(ConfigError::new(format!(
                "{place} has {} rules; one request is checked against at most {MAX_RULES}",
                rules.len()
            ))));
        }
        let mut set = Vec::with_capacity(rules.len());
        for rule in rules {
            let index = self.index(rule)?;
            if set.contains(&index) {
                return Err(Placed::unplaced(ConfigError::new(format!(
                    "{place} lists the rule \"{}\" twice",
                    rule.name()
                ))));
            }
            set.push(index);
        }
        Ok(set.into())
    }

    fn index(&mut self, rule: &Rule) -> Result<u16, Placed> {
        let here = |subject: fn(String) -> Subject| {
            let name = rule.name().to_owned();
            move |error: ConfigError| (Some(subject(name)), error)
        };
        if let Some(&index) = self.by_name.get(rule.name()) {
            if !self.given[usize::from(index)].same_as(rule) {
                return Err(here(Subject::RuleAgain)(ConfigError::in_rule(
                    rule.name(),
                    "defined twice with different settings; a rule's name is its budget, so \
                     give one of them another name (or reuse the same rule, cloned)",
                )));
            }
            return Ok(index);
        }
        let index = u16::try_from(self.compiled.len())
            .ok()
            .filter(|&i| i < u16::MAX)
            .ok_or_else(|| {
                Placed::unplaced(ConfigError::new(
                    "a policy holds at most 65535 distinct rules",
                ))
            })?;
        let mut scaled = rule.clone();
        if let Some(region) = self.region {
            scaled.quota = scale(rule.quota, region.share);
        }
        let compiled = scaled
            .compile(
                &self.compiler.default_key,
                &self.compiler.layer_key,
                self.compiler.on_store_error,
            )
            .map_err(here(Subject::Rule))?;
        self.given.push(rule.clone());
        self.compiled.push(compiled);
        self.by_name.insert(rule.name().to_owned(), index);
        Ok(index)
    }

    fn finish(self) -> Box<[CompiledRule]> {
        self.compiled.into()
    }
}

/// The methods a route of a policy may name, each given its own set when sets are widened.
const METHODS: [Method; 9] = [
    Method::GET,
    Method::POST,
    Method::PUT,
    Method::DELETE,
    Method::PATCH,
    Method::HEAD,
    Method::OPTIONS,
    Method::CONNECT,
    Method::TRACE,
];

/// Adds the rules of every tier to each set that can win: every tier's own set, every route
/// set of a tier or a tenant, and, for the routes of the rules of every tier, a set in every
/// tier made of what would have won there. The request path then still resolves one set.
struct Widen<'a> {
    common: &'a [u16],
    routes: &'a RouteTable,
    default_tier: u16,
}

impl Widen<'_> {
    fn tiers(&self, tiers: &[TierTable], names: &[&str]) -> Result<Vec<TierTable>, ConfigError> {
        let mut widened = Vec::with_capacity(tiers.len());
        for (index, table) in tiers.iter().enumerate() {
            let place = format!("tier \"{}\"", names[index]);
            // A tier without rules of its own falls through to the default tier, widened too.
            let defaults = if !table.defaults.is_empty() || index == usize::from(self.default_tier)
            {
                self.join(&table.defaults, None, &place)?
            } else {
                RuleSet::default()
            };
            let mut routes = RouteTable::default();
            let patterns = table.routes.routes.keys().chain(
                self.routes
                    .routes
                    .keys()
                    .filter(|p| !table.routes.routes.contains_key(*p)),
            );
            for pattern in patterns {
                let base = |method: Option<&Method>| self.base(tiers, index, pattern, method);
                let place = format!("{place}, route \"{pattern}\"");
                let mut entry = RouteEntry {
                    any_method: Some(self.join(base(None), Some((pattern, None)), &place)?),
                    methods: Vec::with_capacity(METHODS.len()),
                };
                for method in &METHODS {
                    let set =
                        self.join(base(Some(method)), Some((pattern, Some(method))), &place)?;
                    entry.methods.push((method.clone(), set));
                }
                routes.routes.insert(pattern.clone(), entry);
            }
            widened.push(TierTable { defaults, routes });
        }
        Ok(widened)
    }

    /// A tenant's exceptions, each with the rules of every tier (for its route).
    fn tenant_routes(&self, table: &RouteTable, id: &str) -> Result<RouteTable, ConfigError> {
        let mut routes = RouteTable::default();
        for pattern in table.routes.keys() {
            let place = format!("tenant \"{id}\", route \"{pattern}\"");
            let join = |method: Option<&Method>| {
                table
                    .lookup(pattern, method)
                    .map(|set| self.join(set, Some((pattern, method)), &place))
                    .transpose()
            };
            let mut entry = RouteEntry {
                any_method: join(None)?,
                methods: Vec::new(),
            };
            for method in &METHODS {
                if let Some(set) = join(Some(method))? {
                    entry.methods.push((method.clone(), set));
                }
            }
            routes.routes.insert(pattern.clone(), entry);
        }
        Ok(routes)
    }

    /// What wins in tier `tier` on `route` before the rules of every tier are added: as
    /// [`Resolver::resolve`] finds it.
    fn base<'t>(
        &self,
        tiers: &'t [TierTable],
        tier: usize,
        route: &str,
        method: Option<&Method>,
    ) -> &'t [u16] {
        let table = &tiers[tier];
        if let Some(set) = table.routes.lookup(route, method) {
            return set;
        }
        if !table.defaults.is_empty() {
            return &table.defaults;
        }
        let default = &tiers[usize::from(self.default_tier)];
        default
            .routes
            .lookup(route, method)
            .unwrap_or(&default.defaults)
    }

    /// `set`, then the rules of every tier, then those of every tier for `route` (each rule
    /// once: a name is one budget).
    fn join(
        &self,
        set: &[u16],
        route: Option<(&str, Option<&Method>)>,
        place: &str,
    ) -> Result<RuleSet, ConfigError> {
        let extra = route
            .and_then(|(route, method)| self.routes.lookup(route, method))
            .unwrap_or_default();
        let mut joined: Vec<u16> = Vec::with_capacity(set.len() + self.common.len() + extra.len());
        for &index in set.iter().chain(self.common).chain(extra) {
            if !joined.contains(&index) {
                joined.push(index);
            }
        }
        if joined.len() > MAX_RULES {
            return Err(ConfigError::new(format!(
                "{place}: with the rules of every tier, a request would be checked against {} \
                 rules; one request is checked against at most {MAX_RULES}",
                joined.len()
            )));
        }
        Ok(joined.into())
    }
}

/// A quota times a region's share: rounded down, at least 1.
fn scale(quota: Quota, share: f64) -> Quota {
    let times = |n: u64| ((n as f64 * share).floor() as u64).max(1);
    let scaled = Quota::new(times(quota.limit()), quota.period());
    match quota.burst_size() {
        Some(burst) => scaled.burst(times(burst)),
        None => scaled,
    }
}

/// Lists are matched against the layer's key, which counts an IPv6 client by its /64: a longer
/// IPv6 entry could never match, unless keys hold its clients as IPv4 ones (an IPv4-mapped
/// network, /96 or longer: see [`canonical_net`](crate::key::canonical_net)). A client behind
/// NAT64 is counted by its IPv4 address when that address is global, by its /64 otherwise: its
/// entry is the IPv4 network.
fn check_listed(entry: &Listed) -> Result<(), ConfigError> {
    let Listed::Network(net) = entry else {
        return Ok(());
    };
    if let Some(v4) = crate::key::nat64_net(*net) {
        return Err(ConfigError::new(format!(
            "list entry {net}: a client behind NAT64 is counted by its IPv4 address (by its IPv6 \
             /64 when that address is not global), so list the IPv4 network ({})",
            v4.trunc()
        )));
    }
    match crate::key::canonical_net(*net) {
        IpNet::V6(net) if net.prefix_len() > 64 => Err(ConfigError::new(format!(
            "list entry {net}: IPv6 clients are counted by their /64 (one host can use all of \
             it), so list /64 networks or shorter ({})",
            ipnet::Ipv6Net::new(net.addr(), 64).map_or(net, |n| n.trunc())
        ))),
        _ => Ok(()),
    }
}

fn check_region(region: &Region) -> Result<(), ConfigError> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if region.name.is_empty() || region.name.len() > 64 || !region.name.chars().all(ok_char) {
        return Err(ConfigError::new(format!(
            "region name {:?} is not allowed; use 1 to 64 characters of A-Z a-z 0-9 - _ .",
            region.name
        )));
    }
    if !(region.share > 0.0 && region.share <= 1.0) {
        return Err(ConfigError::new(format!(
            "region \"{}\" has the share {}; give it a share greater than 0 and at most 1",
            region.name, region.share
        )));
    }
    Ok(())
}

impl RouteTable {
    /// A route table of rule sets, compiled into `rules`.
    fn new(
        routes: &[(String, Vec<Rule>)],
        rules: &mut RuleTable<'_>,
        place: &str,
    ) -> Result<Self, Placed> {
        let mut table = RouteTable::default();
        for (route, route_rules) in routes {
            let (method, pattern) = parse_route(route).map_err(|problem| {
                Placed::unplaced(ConfigError::new(format!(
                    "{place}: route {route:?} {problem}"
                )))
            })?;
            let set = rules.set(route_rules, &format!("{place}, route \"{route}\""))?;
            let entry = table.routes.entry(pattern.into()).or_default();
            let taken = match method {
                None => entry.any_method.replace(set).is_some(),
                Some(method) => {
                    let taken = entry.methods.iter().any(|(m, _)| *m == method);
                    entry.methods.push((method, set));
                    taken
                }
            };
            if taken {
                return Err(Placed::unplaced(ConfigError::new(format!(
                    "{place} lists the route \"{route}\" twice; merge its rules"
                ))));
            }
        }
        Ok(table)
    }
}

/// `/search`, `GET /users/{id}` or `/package.Service/Method`: the method, if any, and the
/// pattern.
fn parse_route(route: &str) -> Result<(Option<Method>, &str), &'static str> {
    let (method, pattern) = match route.split_once(' ') {
        Some((method, pattern)) => (Some(method), pattern.trim_start()),
        None => (None, route),
    };
    if !pattern.starts_with('/') || pattern.contains(char::is_whitespace) {
        return Err(
            "is not a route: write a pattern that starts with / (\"/users/{id}\"), \
                    optionally after a method (\"GET /users/{id}\")",
        );
    }
    let method = match method {
        None => None,
        Some(name) => Some(match name {
            "GET" => Method::GET,
            "POST" => Method::POST,
            "PUT" => Method::PUT,
            "DELETE" => Method::DELETE,
            "PATCH" => Method::PATCH,
            "HEAD" => Method::HEAD,
            "OPTIONS" => Method::OPTIONS,
            "CONNECT" => Method::CONNECT,
            "TRACE" => Method::TRACE,
            _ => {
                return Err(
                    "has a method that is not one of GET POST PUT DELETE PATCH HEAD OPTIONS CONNECT TRACE",
                );
            }
        }),
    };
    Ok((method, pattern))
}
