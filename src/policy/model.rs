//! [`Policy`], [`Tier`] and [`TenantRules`]: which rules apply to which request, as data.

use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use super::Rule;
use crate::key::Key;

/// Rules by tier, tenant and route, with a version: what a layer enforces, and what a rules file
/// or another [`PolicySource`](super::PolicySource) produces.
///
/// ```
/// use tollgate::policy::{Policy, TenantRules, Tier};
/// use tollgate::{Quota, RateLimitLayer, Rule};
///
/// let policy = Policy::new("2026-12-01")
///     .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(5))))
///     .tier(
///         Tier::new("pro")
///             .rule(Rule::new("pro", Quota::per_minute(50)))
///             .route("POST /search", [Rule::new("pro-search", Quota::per_minute(10))]),
///     )
///     .default_tier("free")
///     .tenant(
///         TenantRules::new("acme")
///             .tier("pro")
///             .route("/search", [Rule::new("acme-search", Quota::per_minute(2))]),
///     );
/// let layer = RateLimitLayer::builder().policy(policy).build()?;
/// # let _ = layer;
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
///
/// # Which rules apply
///
/// For each request, the most specific set that has rules wins:
///
/// 1. the tenant's exception for this route ([`TenantRules::route`]);
/// 2. the rules of the tenant's tier for this route ([`Tier::route`]);
/// 3. the tenant's tier's own rules ([`Tier::rule`]);
/// 4. the default tier's rules for this route, then the default tier's own rules.
///
/// A request without a tenant, or whose tenant the policy does not know and whose extractor gave
/// no known tier, gets the default tier. The default tier must have rules of its own (or the
/// policy rules for every tier), so no request is ever unlimited (a policy without one does not
/// build). The rules of the winning set are checked together, all or nothing, as a layer's
/// rules are.
///
/// # Rules for every tier
///
/// [`Policy::all_tiers`] and [`Policy::all_tiers_route`] add rules to whichever set wins, in
/// every tier and for every tenant: "100 per minute per IP for everyone, plus the tier's
/// limits" is one policy, and one layer. They are checked in the same atomic step as the
/// winning set: a request that one rule denies is charged to none, so a client that spends its
/// tier's quota does not drain the all-tier budget with its refused requests, nor the reverse
/// (two stacked layers are not all or nothing). On a Redis Cluster, rules that count different
/// callers (an IP and a tenant) live in different slots, and the store checks them all before
/// it charges any, as it does for any such set (see [the store's
/// docs](crate::store#cluster-rules-of-different-callers)).
///
/// ```
/// use std::time::Duration;
/// use tollgate::key::ClientIp;
/// use tollgate::policy::{Policy, Tenant, TenantFromHeader, Tier};
/// use tollgate::{Algorithm, Quota, RateLimitLayer, Rule};
///
/// let client_ip = ClientIp::new().parse_trusted_proxies(["10.0.0.0/8"])?;
/// let policy = Policy::new("v1")
///     .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(10))))
///     .tier(Tier::new("pro").rule(Rule::new("pro", Quota::per_minute(1000))))
///     .default_tier("free")
///     // Every request, whatever its tier: 100 a minute per client IP.
///     .all_tiers([Rule::new("per-ip", Quota::per_minute(100)).key(client_ip.clone())])
///     // And on this route, in every tier: 5 attempts per 15 minutes per IP.
///     .all_tiers_route(
///         "POST /login",
///         [Rule::new("login", Quota::new(5, Duration::from_secs(15 * 60)))
///             .algorithm(Algorithm::FixedWindow)
///             .key(client_ip.clone())],
///     );
/// let layer = RateLimitLayer::builder()
///     .policy(policy)
///     .tenant(TenantFromHeader::new("x-api-key").hashed().lookup(|key: &str| {
///         let (tier, _) = key.split_once('-')?;
///         Some(Tenant::new(key).with_tier(tier))
///     }))
///     // Requests without a tenant go by the client, not by the proxy.
///     .key(client_ip)
///     .build()?;
/// # let _ = layer;
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
///
/// A rule for every tier counts by its own key, or like any rule without one: per tenant when
/// the layer finds tenants, else by the layer's key. "Per IP" needs the key said: the layer's
/// key (`key = "ip"` in a rules file) when the layer's key is the client's address, or a
/// [`ClientIp`](crate::key::ClientIp) of its own. A rule for every tier that also appears in the
/// winning set is checked once (it is one budget). With them, a request is still checked against at most
/// [`MAX_RULES`](crate::MAX_RULES) rules: a set that would exceed it does not build.
///
/// A route is an axum route pattern (`/users/{id}`, from `MatchedPath`) or a gRPC method
/// (`/package.Service/Method`), optionally after an HTTP method (`GET /users/{id}`); a rule set
/// for a route and method wins over one for the route alone.
///
/// # Rule names are budgets
///
/// A rule's name is its budget in the store. A name may appear in several places of a policy
/// when it is the same rule (cloned, or written the same in a file): then those places share one
/// budget. Two different rules with one name do not build.
#[derive(Clone, Debug, Default)]
pub struct Policy {
    pub(crate) version: String,
    pub(crate) tiers: Vec<Tier>,
    pub(crate) default_tier: Option<String>,
    pub(crate) tenants: Vec<TenantRules>,
    pub(crate) allow: Vec<Listed>,
    pub(crate) deny: Vec<Listed>,
    pub(crate) region: Option<Region>,
    /// Rules added to every winning set.
    pub(crate) all_tiers: Vec<Rule>,
    /// Rules added to every winning set of a route.
    pub(crate) all_tiers_routes: Vec<(String, Vec<Rule>)>,
    /// The one tier of a layer built from rules, not from a policy: it has no name to report.
    pub(crate) untiered: bool,
    /// Where the policy was read from, to place its errors.
    pub(crate) origin: Option<Arc<Origin>>,
}

/// Where a policy was read from: a name (a file's path) and where each of its parts is written.
#[derive(Debug, Default)]
pub(crate) struct Origin {
    pub(crate) name: String,
    /// Line and column (from 1) of each part.
    pub(crate) places: std::collections::HashMap<Subject, (usize, usize)>,
}

/// A part of a policy that an error can be about.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Subject {
    Version,
    DefaultTier,
    Region,
    AllTiers,
    Tier(String),
    Tenant(String),
    Rule(String),
    /// The second definition of a rule's name.
    RuleAgain(String),
}

impl Origin {
    /// `error`, prefixed with the file, line and column of `subject` when they are known.
    pub(crate) fn place(&self, subject: &Subject, error: crate::ConfigError) -> crate::ConfigError {
        match self.places.get(subject) {
            Some(&(line, column)) => error.at(&self.name, line, column),
            None => error.at_file(&self.name),
        }
    }
}

impl Policy {
    /// An empty policy with a version, such as a date or a release number: answered by
    /// [`PolicyHandle::version`](super::PolicyHandle::version) so that you can tell which one
    /// is in force.
    pub fn new(version: impl Into<String>) -> Self {
        Policy {
            version: version.into(),
            ..Policy::default()
        }
    }

    /// Adds a tier.
    pub fn tier(mut self, tier: Tier) -> Self {
        self.tiers.push(tier);
        self
    }

    /// The tier of requests without a tenant, of unknown tenants, and of tenants whose tier the
    /// policy does not have.
    pub fn default_tier(mut self, name: impl Into<String>) -> Self {
        self.default_tier = Some(name.into());
        self
    }

    /// Adds a tenant's tier and exceptions.
    pub fn tenant(mut self, tenant: TenantRules) -> Self {
        self.tenants.push(tenant);
        self
    }

    /// Adds rules that apply in every tier: to every request the policy limits, whatever its
    /// tier, tenant and route, on top of the rules of its tier (see [Rules for every
    /// tier](Policy#rules-for-every-tier)). Checked in the same atomic step: all or nothing.
    pub fn all_tiers(mut self, rules: impl IntoIterator<Item = Rule>) -> Self {
        self.all_tiers.extend(rules);
        self
    }

    /// Adds rules that apply in every tier to one route (`POST /login`, `/search`,
    /// `/package.Service/Method`), on top of the rules of the request's tier for it and of
    /// [`all_tiers`](Self::all_tiers). A route and method is matched as in a tier: a request
    /// `POST /login` gets the rules of `"POST /login"` if given, else those of `"/login"`.
    pub fn all_tiers_route(
        mut self,
        route: impl Into<String>,
        rules: impl IntoIterator<Item = Rule>,
    ) -> Self {
        self.all_tiers_routes
            .push((route.into(), rules.into_iter().collect()));
        self
    }

    /// Lets requests that match `entry` through without checking any rule.
    pub fn allow(mut self, entry: Listed) -> Self {
        self.allow.push(entry);
        self
    }

    /// Refuses requests that match `entry` with `403 Forbidden` (gRPC `PERMISSION_DENIED`). The
    /// deny list is checked before the allow list.
    pub fn deny(mut self, entry: Listed) -> Self {
        self.deny.push(entry);
        self
    }

    /// Gives this deployment's region a share of every quota (see [`Region`]).
    pub fn region(mut self, region: Region) -> Self {
        self.region = Some(region);
        self
    }

    /// The policy's version.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// Lists every rule the policy names: its tiers' and their routes', its tenants'
    /// exceptions, and the rules of every tier.
    pub(crate) fn every_rule(&self) -> impl Iterator<Item = &Rule> {
        let tiers = self.tiers.iter().flat_map(|tier| {
            let routes = tier.routes.iter().flat_map(|(_, rules)| rules);
            tier.rules.iter().chain(routes)
        });
        let tenants = self
            .tenants
            .iter()
            .flat_map(|tenant| tenant.routes.iter().flat_map(|(_, rules)| rules));
        let everywhere = self
            .all_tiers_routes
            .iter()
            .flat_map(|(_, rules)| rules)
            .chain(&self.all_tiers);
        tiers.chain(tenants).chain(everywhere)
    }
}

/// A tier (a plan: free, pro, enterprise…): its own rules, and rules for some routes.
#[derive(Clone, Debug)]
pub struct Tier {
    pub(crate) name: String,
    pub(crate) rules: Vec<Rule>,
    pub(crate) routes: Vec<(String, Vec<Rule>)>,
}

impl Tier {
    /// A tier with no rules yet.
    pub fn new(name: impl Into<String>) -> Self {
        Tier {
            name: name.into(),
            rules: Vec::new(),
            routes: Vec::new(),
        }
    }

    /// Adds a rule for every route that has no rules of its own in this tier.
    pub fn rule(mut self, rule: Rule) -> Self {
        self.rules.push(rule);
        self
    }

    /// Adds several rules.
    pub fn rules(mut self, rules: impl IntoIterator<Item = Rule>) -> Self {
        self.rules.extend(rules);
        self
    }

    /// The rules of this tier for one route (`/search`, `GET /users/{id}`,
    /// `/package.Service/Method`), instead of the tier's own.
    pub fn route(
        mut self,
        route: impl Into<String>,
        rules: impl IntoIterator<Item = Rule>,
    ) -> Self {
        self.routes
            .push((route.into(), rules.into_iter().collect()));
        self
    }

    /// The tier's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// One tenant's place in a policy: its tier, and its exceptions on some routes.
#[derive(Clone, Debug)]
pub struct TenantRules {
    pub(crate) id: String,
    pub(crate) tier: Option<String>,
    pub(crate) routes: Vec<(String, Vec<Rule>)>,
}

impl TenantRules {
    /// The tenant with this id (as its [`Tenant`](super::Tenant) names it).
    pub fn new(id: impl Into<String>) -> Self {
        TenantRules {
            id: id.into(),
            tier: None,
            routes: Vec::new(),
        }
    }

    /// The tenant's tier, whatever its extractor says.
    pub fn tier(mut self, tier: impl Into<String>) -> Self {
        self.tier = Some(tier.into());
        self
    }

    /// An exception: the rules of this tenant on one route, instead of its tier's.
    pub fn route(
        mut self,
        route: impl Into<String>,
        rules: impl IntoIterator<Item = Rule>,
    ) -> Self {
        self.routes
            .push((route.into(), rules.into_iter().collect()));
        self
    }
}

/// An entry of an allow or deny list.
///
/// ```
/// use tollgate::policy::Listed;
///
/// let office: Listed = "203.0.113.0/24".parse()?;
/// let partner: Listed = "tenant:partner-co".parse()?;
/// let bot: Listed = "key:9f86d081884c7d65".parse()?;
/// # let _ = (office, partner, bot);
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub enum Listed {
    /// Clients whose IP (the IP of the layer's key: the peer, or [`ClientIp`](crate::key::ClientIp)
    /// behind proxies) is in this network. An IPv4 client, IPv4-mapped (`::ffff:192.0.2.7`)
    /// included, is held as its IPv4 address: IPv4 networks list it, and so do IPv4-mapped
    /// networks of /96 or longer (as their IPv4 network); a wider IPv6 network (`::/0`) does not.
    /// A client behind NAT64 (`64:ff9b::93.184.216.34`) is held as its IPv4 address when that
    /// address is global: list the IPv4 network (an entry of `64:ff9b::/96` is refused).
    Network(IpNet),
    /// A tenant, by id.
    Tenant(Arc<str>),
    /// A key of the layer's extractor, as [`Key::text`] makes it (for a hashed API key, the text
    /// of its digest).
    Key(Key),
}

impl std::str::FromStr for Listed {
    type Err = crate::ConfigError;

    /// `10.0.0.0/8`, `2001:db8::/32`, `192.0.2.7` (one address), `tenant:<id>` or `key:<text>`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(id) = s.strip_prefix("tenant:") {
            if id.is_empty() {
                return Err(crate::ConfigError::new(
                    "list entry \"tenant:\" names no tenant; write tenant:<id>",
                ));
            }
            return Ok(Listed::Tenant(id.into()));
        }
        if let Some(text) = s.strip_prefix("key:") {
            if text.is_empty() {
                return Err(crate::ConfigError::new(
                    "list entry \"key:\" names no key; write key:<text>",
                ));
            }
            return Ok(Listed::Key(Key::text(text)));
        }
        if let Ok(net) = s.parse::<IpNet>() {
            return Ok(Listed::Network(net.trunc()));
        }
        if let Ok(ip) = s.parse::<IpAddr>() {
            return Ok(Listed::Network(IpNet::from(ip)));
        }
        Err(crate::ConfigError::new(format!(
            "list entry {s:?} is not an IP, a network (10.0.0.0/8), tenant:<id> or key:<text>"
        )))
    }
}

impl fmt::Debug for Listed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Listed::Network(net) => write!(f, "{net}"),
            Listed::Tenant(id) => write!(f, "tenant:{id}"),
            Listed::Key(key) => write!(f, "key:{key}"),
        }
    }
}

/// This deployment's region and its share of every quota, for fleets that span regions.
///
/// Checking one store from every region would put a cross-region round trip on each request.
/// Instead, each region enforces its share of the global quota in its own store (its own Redis,
/// or its own key prefix on a shared one: `RedisStore::builder(url).prefix("tollgate:eu-west")`),
/// and the layer scales every rule of the policy by the share: with a share of 0.25, "100 per
/// minute" becomes 25 per minute in this region (rounded down, at least 1; bursts alike).
///
/// The trade-off: the fleet as a whole admits at most the global quota (when the shares add up
/// to 1), but a client whose traffic all lands in one region gets only that region's share; a
/// region that sees no traffic leaves its share unused. Set shares from each region's share of
/// the traffic.
#[derive(Clone, Debug, PartialEq)]
pub struct Region {
    pub(crate) name: String,
    pub(crate) share: f64,
}

impl Region {
    /// The region `name` with `share` (greater than 0, at most 1) of each quota.
    pub fn new(name: impl Into<String>, share: f64) -> Self {
        Region {
            name: name.into(),
            share,
        }
    }

    /// The region's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The region's share of each quota.
    pub fn share(&self) -> f64 {
        self.share
    }
}
