//! The gateway fleet on a real Redis Cluster: G gateways, each with its own
//! [`RedisClusterStore`] and [`RateLimitLayer`], driven open-loop from one seeded traffic model,
//! in six configurations; what each costs Redis, and how far each strays from the exact answer.
//!
//! ```text
//! cargo bench --all-features --bench fleet
//! FLEET_GATEWAYS=8 FLEET_RATE=3000 FLEET_SECONDS=30 FLEET_TENANTS=100000 \
//!     cargo bench --all-features --bench fleet
//! ```
//!
//! Settings (environment): `FLEET_GATEWAYS` (default 8), `FLEET_RATE` (requests/s for the
//! whole fleet, default 3,000: what this 2-core machine sustains, gateways and three
//! `redis-server`s together; the output prints the Redis CPU per call measured, a range by
//! configuration),
//! `FLEET_SECONDS` (per configuration, default 30), `FLEET_TENANTS` (default 100,000),
//! `FLEET_SEED` (default 1), `FLEET_ZIPF` (the exponent of tenant popularity, default 1.0),
//! `FLEET_LEASE` (units leased on the hot tenant's rules, default 32), `FLEET_SPLIT` (sub-keys
//! of the hot tenant's split rules, default 8), `FLEET_CONFIGS` (a comma-separated subset of
//! `exact,deny-cache,lease-hot,split-hot,all,all-split`), `FLEET_GLOBAL=0` (no global rule: to
//! see the other mechanisms without it), `FLEET_BUSY_SECONDS` (each configuration's busy
//! phase, default 4).
//!
//! What it does:
//!
//! 1. starts its own 3-primary Redis Cluster (`tests/support`), stopped when the bench ends;
//! 2. draws the traffic once: Poisson arrivals at the rate, one hot tenant at 30 % of them (all
//!    on `/search`, the route the fleet's big tenant hammers, a fifth over its limit), the rest
//!    from `FLEET_TENANTS` tenants of Zipf popularity (each tenant's tier, free / pro /
//!    enterprise, drawn from its rank), on `/search`, `/items` and `/orders`; each arrival goes
//!    to a gateway at random;
//! 3. for each configuration, a rules file (TOML, written by [`policy_text`]): one rule per
//!    tier, a per-route rule on `/search` in every tier, the hot tenant's own contract tier (its
//!    plan `dedicated` and `dedicated-search`), and a stacked global rule (`key = "global"`) on
//!    every request; the configurations are `exact` (every request to Redis, no deny cache),
//!    `deny-cache`, `lease-hot` (the hot tenant's two rules leased), `split-hot` (the hot
//!    tenant's two rules split), `all` (deny cache, the hot tenant's rules and the global rule
//!    leased) and `all-split` (deny cache, the hot tenant's plan and the global rule leased,
//!    its `/search` rule split): a rule is leased or split, never both;
//! 4. places the keys so that each primary measures one class: the global key on one, the hot
//!    tenant's keys on another (tenant names are chosen for their hash slot), every other tenant
//!    on the third;
//! 5. runs the gateways in this process (a Tokio runtime of 2 threads), each an axum `Router`
//!    with the layer, called without sockets, every request sent at its time whatever the
//!    answers (open loop); each gateway's store takes its time from a clock the driver sets to
//!    each request's scheduled time (`clock(..)`, feature `testing`), so Redis decides each
//!    request at exactly the time the oracle does;
//! 6. measures, from the servers: calls (`INFO commandstats`) and CPU (`INFO cpu`) per primary,
//!    and this process's CPU (`/proc/self/stat`), decision latency and schedule lag; then, in a
//!    busy phase, the same arrivals closed-loop (64 in flight per gateway): Redis's CPU per
//!    call when its calls come in batches, as on a busy shard;
//! 7. decides the same arrivals with the reference model (the memory store on a manual clock,
//!    in time order) and compares with it request by request (wrongly allowed, wrongly limited)
//!    and each tenant's admitted count, against the tolerance of the exact configuration
//!    ([`tolerances`]) and each mechanism's bound ([`bound`]), counted only for rules the oracle
//!    shows refusing that tenant; the decisions made locally (no Redis) show which mechanisms
//!    acted;
//! 8. derives the gateway fleet (50 gateways, 200,000 requests/s, 1,000,000 tenants) and ten
//!    times it from the measured calls per request of each class of key and the busy phase's
//!    CPU per call, and writes two SVG
//!    charts to `benches/fleet/`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use tollgate::clock::{Clock, ManualClock};
use tollgate::http::{Request, StatusCode};
use tollgate::policy::{Policy, Tenant, TenantFromExtension};
use tollgate::store::{MemoryStore, RedisClusterStore};
use tollgate::{FailureMode, RateLimitLayer};
use tower::ServiceExt;

/// The key prefix of every gateway's store.
const PREFIX: &str = "fleet";
/// The hot tenant's share of all requests.
const HOT_SHARE: f64 = 0.30;
/// The share of the other tenants' requests that go to `/search`, `/items` (the rest `/orders`).
const SEARCH_SHARE: f64 = 0.2;
const ITEMS_SHARE: f64 = 0.5;
/// Units of the global rule leased to each gateway in the `all` configuration.
const GLOBAL_LEASE: u64 = 1000;
/// The gateway fleet's shard: about 100,000 simple operations/s.
const SEED_SHARD_OPS: f64 = 100_000.0;
/// A shard may run at most this share of a core in the derived tables.
const SHARD_CPU_LIMIT: f64 = 0.5;
/// Redis Cluster hash slots.
const SLOTS: usize = 16384;

// ---------------------------------------------------------------------------------------------
// Settings

#[derive(Clone, Debug)]
struct Settings {
    gateways: usize,
    rate: f64,
    seconds: f64,
    tenants: usize,
    seed: u64,
    zipf: f64,
    lease: u64,
    split: u64,
    configs: Vec<Config>,
    /// Whether the global rule is stacked on every request (`FLEET_GLOBAL=0` leaves it out).
    global: bool,
    /// Seconds of each configuration's busy phase (closed loop), which measures Redis's CPU
    /// per call when its calls come in batches, as on a busy shard.
    busy_seconds: f64,
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> Result<T, String> {
    match std::env::var(name) {
        Ok(value) if !value.trim().is_empty() => value
            .trim()
            .parse()
            .map_err(|_| format!("{name}={value:?} is not a valid value")),
        _ => Ok(default),
    }
}

impl Settings {
    fn from_env() -> Result<Settings, String> {
        let configs = match std::env::var("FLEET_CONFIGS") {
            Ok(list) if !list.trim().is_empty() => list
                .split(',')
                .map(|name| {
                    Config::ALL
                        .into_iter()
                        .find(|c| c.name() == name.trim())
                        .ok_or_else(|| {
                            format!(
                                "FLEET_CONFIGS: {name:?} is not one of exact, deny-cache, \
                                 lease-hot, split-hot, all, all-split"
                            )
                        })
                })
                .collect::<Result<Vec<_>, _>>()?,
            _ => Config::ALL.to_vec(),
        };
        let settings = Settings {
            gateways: env_or("FLEET_GATEWAYS", 8)?,
            rate: env_or("FLEET_RATE", 3_000.0)?,
            seconds: env_or("FLEET_SECONDS", 30.0)?,
            tenants: env_or("FLEET_TENANTS", 100_000)?,
            seed: env_or("FLEET_SEED", 1)?,
            zipf: env_or("FLEET_ZIPF", 1.0)?,
            lease: env_or("FLEET_LEASE", 32)?,
            split: env_or("FLEET_SPLIT", 8)?,
            global: env_or("FLEET_GLOBAL", 1u8)? != 0,
            busy_seconds: env_or("FLEET_BUSY_SECONDS", 4.0)?,
            configs,
        };
        if settings.gateways == 0 || settings.gateways > 1000 {
            return Err("FLEET_GATEWAYS must be between 1 and 1000".into());
        }
        if !(settings.rate >= 10.0 && settings.seconds >= 1.0 && settings.tenants >= 10) {
            return Err(
                "FLEET_RATE must be at least 10, FLEET_SECONDS at least 1, FLEET_TENANTS at \
                 least 10"
                    .into(),
            );
        }
        if settings.busy_seconds.is_nan() || settings.busy_seconds < 1.0 {
            return Err("FLEET_BUSY_SECONDS must be at least 1".into());
        }
        if settings.lease < 2 || !(2..=64).contains(&settings.split) {
            return Err("FLEET_LEASE must be at least 2, FLEET_SPLIT between 2 and 64".into());
        }
        Ok(settings)
    }
}

// ---------------------------------------------------------------------------------------------
// Configurations and rules

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Config {
    Exact,
    DenyCache,
    LeaseHot,
    SplitHot,
    All,
    AllSplit,
}

impl Config {
    const ALL: [Config; 6] = [
        Config::Exact,
        Config::DenyCache,
        Config::LeaseHot,
        Config::SplitHot,
        Config::All,
        Config::AllSplit,
    ];

    fn name(self) -> &'static str {
        match self {
            Config::Exact => "exact",
            Config::DenyCache => "deny-cache",
            Config::LeaseHot => "lease-hot",
            Config::SplitHot => "split-hot",
            Config::All => "all",
            Config::AllSplit => "all-split",
        }
    }

    fn deny_cache(self) -> bool {
        matches!(self, Config::DenyCache | Config::All | Config::AllSplit)
    }

    /// What the hot tenant's plan rule (`dedicated`) and its search rule (`dedicated-search`)
    /// get.
    fn hot(self) -> (Hot, Hot) {
        match self {
            Config::Exact | Config::DenyCache => (Hot::Exact, Hot::Exact),
            Config::LeaseHot | Config::All => (Hot::Lease, Hot::Lease),
            Config::SplitHot => (Hot::Split, Hot::Split),
            Config::AllSplit => (Hot::Lease, Hot::Split),
        }
    }

    /// Whether some hot-tenant rule is split.
    fn hot_split(self) -> bool {
        let (plan, search) = self.hot();
        plan == Hot::Split || search == Hot::Split
    }

    fn global_leased(self) -> bool {
        matches!(self, Config::All | Config::AllSplit)
    }
}

/// What a hot-tenant rule gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hot {
    Exact,
    Lease,
    Split,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tier {
    Free,
    Pro,
    Enterprise,
    Dedicated,
}

impl Tier {
    fn name(self) -> &'static str {
        match self {
            Tier::Free => "free",
            Tier::Pro => "pro",
            Tier::Enterprise => "enterprise",
            Tier::Dedicated => "dedicated",
        }
    }
}

/// One rule's numbers: `limit` per second, `burst`.
#[derive(Clone, Copy, Debug)]
struct Numbers {
    limit: u64,
    burst: u64,
}

/// The numbers of every rule, the hot tenant's and the global one scaled with the rate.
#[derive(Clone, Debug)]
struct Rules {
    tier: HashMap<&'static str, (Numbers, Numbers)>,
    global: Numbers,
}

fn round_up(value: f64, multiple: u64) -> u64 {
    let value = value.max(1.0).ceil() as u64;
    value.div_ceil(multiple) * multiple
}

impl Rules {
    fn new(settings: &Settings) -> Rules {
        let hot_rate = settings.rate * HOT_SHARE;
        // Multiples of the split so that the sub-keys' shares add up to the whole.
        let parts = settings.split;
        let mut tier = HashMap::new();
        let n = |limit, burst| Numbers { limit, burst };
        tier.insert("free", (n(10, 20), n(2, 5)));
        tier.insert("pro", (n(50, 100), n(10, 20)));
        tier.insert("enterprise", (n(500, 1000), n(100, 200)));
        // The hot tenant's contract: its plan twice its traffic, its searches 80 % of it, so
        // that a fifth of its requests are refused.
        let search = round_up(hot_rate * 0.8, parts);
        let plan = round_up(hot_rate * 2.0, parts);
        tier.insert(
            "dedicated",
            (
                n(plan, round_up(plan as f64 / 4.0, parts)),
                n(search, round_up(search as f64 / 4.0, parts)),
            ),
        );
        // Never refuses: four times what the whole fleet asks, each second.
        let global = round_up(settings.rate * 4.0, 100).max(GLOBAL_LEASE);
        Rules {
            tier,
            global: n(global, global),
        }
    }

    /// The refill rates (units/s) of a tenant of `tier`'s rules in `mask` ([`PLAN`],
    /// [`SEARCH`], [`GLOBAL`]): those the oracle saw refusing it.
    fn rates(&self, tier: Tier, mask: u8) -> f64 {
        let (plan, search_rule) = self.tier[tier.name()];
        let pick = |bit: u8, rate: u64| {
            if mask & bit != 0 { rate as f64 } else { 0.0 }
        };
        pick(PLAN, plan.limit) + pick(SEARCH, search_rule.limit) + pick(GLOBAL, self.global.limit)
    }
}

/// The rules file of one configuration.
fn policy_text(config: Config, rules: &Rules, settings: &Settings, hot_id: &str) -> String {
    let extra = |hot: Hot| match hot {
        Hot::Exact => String::new(),
        Hot::Lease => format!(", lease = {}", settings.lease),
        Hot::Split => format!(", split = {}", settings.split),
    };
    let (plan_extra, search_extra) = (extra(config.hot().0), extra(config.hot().1));
    let global_extra = if config.global_leased() {
        format!(", lease = {GLOBAL_LEASE}")
    } else {
        String::new()
    };
    let rule = |name: &str, n: Numbers, extra: &str| {
        format!(
            "{{ name = \"{name}\", limit = {}, per = \"second\", burst = {}{extra} }}",
            n.limit, n.burst
        )
    };
    let mut text = format!(
        "# The fleet's rules ({config}): a plan per tier, a tighter rule on /search in every\n\
         # tier, the hot tenant's own contract, and a global rule stacked on every request.\n\
         version = \"fleet-{config}\"\n\
         default_tier = \"free\"\n\n\
         {global}",
        config = config.name(),
        global = if settings.global {
            format!(
                "[all_tiers]\nrules = [{{ name = \"global\", limit = {g}, per = \"second\", burst = {g}, key = \"global\"{global_extra} }}]\n",
                g = rules.global.limit
            )
        } else {
            String::new()
        },
    );
    for tier in ["free", "pro", "enterprise", "dedicated"] {
        let (plan, search) = rules.tier[tier];
        let (plan_extra, search_extra) = if tier == "dedicated" {
            (&plan_extra[..], &search_extra[..])
        } else {
            ("", "")
        };
        let plan_rule = rule(tier, plan, plan_extra);
        let search_rule = rule(&format!("{tier}-search"), search, search_extra);
        let _ = write!(
            text,
            "\n[tiers.{tier}]\nrules = [{plan_rule}]\nroutes.\"/search\".rules = [\n  {plan_rule},\n  {search_rule},\n]\n"
        );
    }
    let _ = write!(text, "\n[tenants.\"{hot_id}\"]\ntier = \"dedicated\"\n");
    text
}

// ---------------------------------------------------------------------------------------------
// Traffic

/// splitmix64: a small seeded generator, the same sequence on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Search,
    Items,
    Orders,
}

impl Path {
    fn uri(self) -> &'static str {
        match self {
            Path::Search => "/search",
            Path::Items => "/items",
            Path::Orders => "/orders",
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Arrival {
    /// Microseconds from the start.
    at: u64,
    /// 0: the hot tenant; r: the tenant of Zipf rank r.
    tenant: u32,
    path: Path,
    gateway: u16,
}

struct Traffic {
    arrivals: Vec<Arrival>,
    /// Index 0 the hot tenant, then by rank.
    tenants: Vec<Tenant>,
    tiers: Vec<Tier>,
}

/// The tier of the tenant of Zipf rank `rank`: 2 % enterprise, 18 % pro, the rest free.
fn tier_of(seed: u64, rank: u64) -> Tier {
    match mix(seed ^ rank.wrapping_mul(0xA24B_AED4_963E_E407)) % 1000 {
        0..20 => Tier::Enterprise,
        20..200 => Tier::Pro,
        _ => Tier::Free,
    }
}

/// The cumulative Zipf distribution over ranks 1..=n.
fn zipf_cdf(n: usize, s: f64) -> Vec<f64> {
    let mut cdf = Vec::with_capacity(n);
    let mut sum = 0.0;
    for rank in 1..=n {
        sum += (rank as f64).powf(-s);
        cdf.push(sum);
    }
    for c in &mut cdf {
        *c /= sum;
    }
    cdf
}

fn traffic(settings: &Settings, hot_id: &str, tail_name: &dyn Fn(u64) -> String) -> Traffic {
    let mut rng = Rng(settings.seed);
    let cdf = zipf_cdf(settings.tenants, settings.zipf);
    let mut arrivals = Vec::with_capacity((settings.rate * settings.seconds * 1.05) as usize);
    let end = settings.seconds * 1e6;
    let mut t = 0.0;
    loop {
        t += -(1.0 - rng.unit()).ln() / settings.rate * 1e6;
        if t >= end {
            break;
        }
        let (tenant, path) = if rng.unit() < HOT_SHARE {
            (0, Path::Search)
        } else {
            let u = rng.unit();
            let rank = cdf.partition_point(|&c| c < u).min(settings.tenants - 1) + 1;
            let p = rng.unit();
            let path = if p < SEARCH_SHARE {
                Path::Search
            } else if p < SEARCH_SHARE + ITEMS_SHARE {
                Path::Items
            } else {
                Path::Orders
            };
            (rank as u32, path)
        };
        let gateway = (rng.next() % settings.gateways as u64) as u16;
        arrivals.push(Arrival {
            at: t as u64,
            tenant,
            path,
            gateway,
        });
    }
    let mut tenants = Vec::with_capacity(settings.tenants + 1);
    let mut tiers = Vec::with_capacity(settings.tenants + 1);
    tenants.push(Tenant::new(hot_id).with_tier("dedicated"));
    tiers.push(Tier::Dedicated);
    for rank in 1..=settings.tenants as u64 {
        let tier = tier_of(settings.seed, rank);
        tenants.push(Tenant::new(tail_name(rank)).with_tier(tier.name()));
        tiers.push(tier);
    }
    Traffic {
        arrivals,
        tenants,
        tiers,
    }
}

fn request(arrival: &Arrival, tenants: &[Tenant]) -> Request<Body> {
    let mut request = Request::new(Body::empty());
    *request.uri_mut() = tollgate::http::Uri::from_static(arrival.path.uri());
    request
        .extensions_mut()
        .insert(tenants[arrival.tenant as usize].clone());
    request
}

fn router<L>(layer: L) -> Router
where
    L: tower::Layer<axum::routing::Route> + Clone + Send + Sync + 'static,
    L::Service: tower::Service<Request<Body>> + Clone + Send + Sync + 'static,
    <L::Service as tower::Service<Request<Body>>>::Response: axum::response::IntoResponse + 'static,
    <L::Service as tower::Service<Request<Body>>>::Error: Into<std::convert::Infallible> + 'static,
    <L::Service as tower::Service<Request<Body>>>::Future: Send + 'static,
{
    Router::new()
        .route("/search", get(|| async { StatusCode::OK }))
        .route("/items", get(|| async { StatusCode::OK }))
        .route("/orders", get(|| async { StatusCode::OK }))
        .route_layer(layer)
}

// ---------------------------------------------------------------------------------------------
// The cluster, measured

/// Redis Cluster's CRC16 (XMODEM) of a key's hash tag, as the slot of the key.
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The slot of a key name, by its hash tag.
fn slot_of(key: &str) -> usize {
    let bytes = key.as_bytes();
    if let Some(open) = key.find('{')
        && let Some(len) = key[open + 1..].find('}')
        && len > 0
    {
        return usize::from(crc16(&bytes[open + 1..open + 1 + len])) % SLOTS;
    }
    usize::from(crc16(bytes)) % SLOTS
}

/// The slot ranges of each node (index into the cluster's nodes), from `CLUSTER SLOTS`.
fn slot_owners(cluster: &support::RedisCluster) -> Result<Vec<u8>, String> {
    let slots: redis::Value = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query(&mut cluster.nodes[0].conn())
        .map_err(|e| format!("CLUSTER SLOTS: {e}"))?;
    let mut owners = vec![u8::MAX; SLOTS];
    for (i, node) in cluster.nodes.iter().enumerate() {
        let mut slot = 0;
        while slot < SLOTS {
            if support::owns(&slots, slot as u16, node.port) {
                owners[slot] = i as u8;
            }
            slot += 1;
        }
    }
    if owners.contains(&u8::MAX) {
        return Err("CLUSTER SLOTS leaves some slot without a primary".into());
    }
    Ok(owners)
}

#[derive(Clone, Debug, Default)]
struct NodeStats {
    /// Calls of tollgate's code (FCALL, EVALSHA).
    code_calls: f64,
    /// Every other command counted (not this harness's INFO / CONFIG): those tollgate's code
    /// runs inside its calls.
    other_calls: f64,
    /// Those commands by name, cumulative since the last `CONFIG RESETSTAT`.
    others: Vec<(String, f64)>,
    /// µs the server spent in tollgate's code (`INFO commandstats`).
    code_usec: f64,
    /// CPU seconds (user + system), cumulative.
    cpu: f64,
}

fn info(node: &support::RedisServer, section: &str) -> Result<String, String> {
    redis::cmd("INFO")
        .arg(section)
        .query(&mut node.conn())
        .map_err(|e| format!("INFO {section} on port {}: {e}", node.port))
}

fn node_stats(node: &support::RedisServer) -> Result<NodeStats, String> {
    let mut stats = NodeStats::default();
    for line in info(node, "commandstats")?.lines() {
        let Some(rest) = line.strip_prefix("cmdstat_") else {
            continue;
        };
        let Some((command, fields)) = rest.split_once(':') else {
            continue;
        };
        let field = |name: &str| {
            fields
                .split(',')
                .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        match command {
            "fcall" | "fcall_ro" | "evalsha" | "eval" => {
                stats.code_calls += field("calls");
                stats.code_usec += field("usec");
            }
            "info" | "config" | "flushall" | "cluster" | "ping" => {}
            _ => {
                stats.other_calls += field("calls");
                stats.others.push((command.to_owned(), field("calls")));
            }
        }
    }
    let cpu = info(node, "cpu")?;
    let field = |name: &str| {
        cpu.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .ok_or_else(|| format!("no {name} in INFO cpu on port {}", node.port))
    };
    stats.cpu = field("used_cpu_user")? + field("used_cpu_sys")?;
    Ok(stats)
}

fn reset_nodes(cluster: &support::RedisCluster) -> Result<(), String> {
    for node in &cluster.nodes {
        let mut conn = node.conn();
        redis::cmd("FLUSHALL")
            .query::<()>(&mut conn)
            .map_err(|e| format!("FLUSHALL on port {}: {e}", node.port))?;
        redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query::<()>(&mut conn)
            .map_err(|e| format!("CONFIG RESETSTAT on port {}: {e}", node.port))?;
    }
    Ok(())
}

/// This process's CPU seconds (user + system) so far.
fn own_cpu(ticks_per_second: f64) -> f64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| {
            let rest = stat[stat.rfind(')')? + 2..].to_owned();
            let fields: Vec<f64> = rest
                .split_whitespace()
                .map(|f| f.parse().unwrap_or(0.0))
                .collect();
            Some((fields.get(11)? + fields.get(12)?) / ticks_per_second)
        })
        .unwrap_or(f64::NAN)
}

fn clock_ticks() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

// ---------------------------------------------------------------------------------------------
// One run of the fleet

/// What each request got, and when (µs since the run's start).
struct Outcomes {
    /// 0 not answered, 1 admitted, 2 refused (429), 3 anything else (a store error: 503).
    status: Vec<AtomicU8>,
    start: Vec<AtomicU32>,
    end: Vec<AtomicU32>,
    pending: AtomicUsize,
    /// Answers that came back at the first poll, without waiting on Redis: admitted (a lease's
    /// units) and refused (the deny cache, or a lease's local refusal).
    local_ok: AtomicUsize,
    local_denied: AtomicUsize,
    /// Which requests were answered at the first poll.
    at_once: Vec<AtomicU8>,
}

impl Outcomes {
    fn new(n: usize) -> Outcomes {
        Outcomes {
            status: (0..n).map(|_| AtomicU8::new(0)).collect(),
            start: (0..n).map(|_| AtomicU32::new(0)).collect(),
            end: (0..n).map(|_| AtomicU32::new(0)).collect(),
            pending: AtomicUsize::new(0),
            local_ok: AtomicUsize::new(0),
            local_denied: AtomicUsize::new(0),
            at_once: (0..n).map(|_| AtomicU8::new(0)).collect(),
        }
    }

    fn record(&self, index: usize, status: StatusCode, end: u32) {
        let code = match status {
            StatusCode::OK => 1,
            StatusCode::TOO_MANY_REQUESTS => 2,
            _ => 3,
        };
        self.status[index].store(code, Ordering::Relaxed);
        self.end[index].store(end, Ordering::Relaxed);
    }
}

fn micros_since(start: Instant) -> u32 {
    u32::try_from(start.elapsed().as_micros()).unwrap_or(u32::MAX)
}

type RouterFuture = Pin<
    Box<dyn Future<Output = Result<axum::response::Response, std::convert::Infallible>> + Send>,
>;

/// Sends arrival `index` through `router` at its time (`clock` set to it, the request polled
/// once at once so that the layer reads it): its response when it came at once, else the
/// future to wait for.
fn send(
    router: &Router,
    clock: &ManualClock,
    epoch: u64,
    traffic: &Traffic,
    index: usize,
) -> Result<axum::response::Response, RouterFuture> {
    let arrival = &traffic.arrivals[index];
    clock.set(epoch + arrival.at);
    let mut future: RouterFuture =
        Box::pin(router.clone().oneshot(request(arrival, &traffic.tenants)));
    match future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(Ok(response)) => Ok(response),
        Poll::Ready(Err(never)) => match never {},
        Poll::Pending => Err(future),
    }
}

/// One gateway's open-loop driver: each of its arrivals sent at its time, its clock set to that
/// time first; the request is polled once at once (the layer reads the clock and queues its
/// check there), then left to finish in a task of its own.
async fn drive(
    router: Router,
    clock: ManualClock,
    epoch: u64,
    traffic: Arc<Traffic>,
    mine: Vec<u32>,
    start: Instant,
    outcomes: Arc<Outcomes>,
) {
    let mut next = 0;
    while next < mine.len() {
        let due = traffic.arrivals[mine[next] as usize].at;
        let now = start.elapsed().as_micros() as u64;
        if due > now {
            tokio::time::sleep_until((start + Duration::from_micros(due)).into()).await;
            continue;
        }
        while next < mine.len() && traffic.arrivals[mine[next] as usize].at <= now {
            let index = mine[next] as usize;
            next += 1;
            outcomes.start[index].store(micros_since(start), Ordering::Relaxed);
            match send(&router, &clock, epoch, &traffic, index) {
                Ok(response) => {
                    match response.status() {
                        StatusCode::OK => outcomes.local_ok.fetch_add(1, Ordering::Relaxed),
                        StatusCode::TOO_MANY_REQUESTS => {
                            outcomes.local_denied.fetch_add(1, Ordering::Relaxed)
                        }
                        _ => 0,
                    };
                    outcomes.at_once[index].store(1, Ordering::Relaxed);
                    outcomes.record(index, response.status(), micros_since(start));
                }
                Err(future) => {
                    outcomes.pending.fetch_add(1, Ordering::Relaxed);
                    let outcomes = outcomes.clone();
                    tokio::spawn(async move {
                        let Ok(response) = future.await;
                        outcomes.record(index, response.status(), micros_since(start));
                        outcomes.pending.fetch_sub(1, Ordering::Relaxed);
                    });
                }
            }
        }
        // Let the answers in flight run between bursts of sends.
        tokio::task::yield_now().await;
    }
}

/// What one configuration measured.
struct Run {
    config: Config,
    seconds: f64,
    nodes: Vec<NodeStats>,
    gateway_cpu: f64,
    admitted: Vec<u32>,
    status: Vec<u8>,
    start: Vec<u32>,
    end: Vec<u32>,
    /// Decisions answered at once, without Redis: (admitted, refused).
    local: (usize, usize),
    /// Each request: answered at once.
    at_once: Vec<bool>,
}

/// The gateways of one configuration: each its own cluster store (on its clock) and layer.
fn gateways(
    runtime: &tokio::runtime::Runtime,
    cluster: &support::RedisCluster,
    rules: &Rules,
    settings: &Settings,
    hot_id: &str,
    config: Config,
    clocks: &[ManualClock],
) -> Result<Vec<Router>, String> {
    let text = policy_text(config, rules, settings, hot_id);
    let urls = cluster.urls();
    runtime.block_on(async {
        let mut routers = Vec::new();
        for clock in clocks {
            let policy = Policy::from_toml(&text, "fleet.toml")
                .map_err(|e| format!("the rules of {}: {e}", config.name()))?;
            let store = RedisClusterStore::builder(urls.clone())
                .prefix(PREFIX)
                .deny_cache(if config.deny_cache() { 100_000 } else { 0 })
                .response_timeout(Duration::from_secs(1))
                .clock(clock.clone())
                .connect()
                .await
                .map_err(|e| format!("a gateway's store did not connect: {e}"))?;
            let layer = RateLimitLayer::builder()
                .policy(policy)
                .tenant(TenantFromExtension)
                .store(store)
                .on_store_error(FailureMode::Closed)
                .build()
                .map_err(|e| format!("a gateway's layer did not build: {e}"))?;
            routers.push(router(layer));
        }
        Ok::<_, String>(routers)
    })
}

/// A phase's gateways, on clocks of their own, after the cluster was emptied; and each
/// node's statistics from then (the stores' connections and code loading not counted).
#[allow(clippy::type_complexity)]
fn prepare(
    runtime: &tokio::runtime::Runtime,
    cluster: &support::RedisCluster,
    settings: &Settings,
    rules: &Rules,
    hot_id: &str,
    config: Config,
    epoch: u64,
) -> Result<(Vec<ManualClock>, Vec<Router>, Vec<NodeStats>), String> {
    reset_nodes(cluster)?;
    let clocks: Vec<ManualClock> = (0..settings.gateways)
        .map(|_| ManualClock::new(epoch))
        .collect();
    let routers = gateways(runtime, cluster, rules, settings, hot_id, config, &clocks)?;
    for node in &cluster.nodes {
        redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query::<()>(&mut node.conn())
            .map_err(|e| format!("CONFIG RESETSTAT: {e}"))?;
    }
    let before = cluster
        .nodes
        .iter()
        .map(node_stats)
        .collect::<Result<_, _>>()?;
    Ok((clocks, routers, before))
}

/// Each gateway's arrivals, by index.
fn by_gateway(traffic: &Traffic, gateways: usize) -> Vec<Vec<u32>> {
    let mut mine: Vec<Vec<u32>> = vec![Vec::new(); gateways];
    for (i, a) in traffic.arrivals.iter().enumerate() {
        mine[usize::from(a.gateway)].push(i as u32);
    }
    mine
}

/// Each node's statistics since `before` (calls counted from the reset; CPU a difference).
fn since(before: &[NodeStats], after: Vec<NodeStats>) -> Vec<NodeStats> {
    before
        .iter()
        .zip(after)
        .map(|(b, a)| NodeStats {
            cpu: a.cpu - b.cpu,
            ..a
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn run_config(
    runtime: &tokio::runtime::Runtime,
    cluster: &support::RedisCluster,
    settings: &Settings,
    rules: &Rules,
    traffic: &Arc<Traffic>,
    hot_id: &str,
    config: Config,
    epoch: u64,
    ticks: f64,
) -> Result<Run, String> {
    let (clocks, routers, before) =
        prepare(runtime, cluster, settings, rules, hot_id, config, epoch)?;
    let own_before = own_cpu(ticks);
    let n = traffic.arrivals.len();
    let outcomes = Arc::new(Outcomes::new(n));
    let by_gateway = by_gateway(traffic, settings.gateways);
    let started = Instant::now();
    runtime.block_on(async {
        let start = Instant::now();
        let drivers: Vec<_> = routers
            .iter()
            .zip(&clocks)
            .zip(by_gateway)
            .map(|((router, clock), mine)| {
                tokio::spawn(drive(
                    router.clone(),
                    clock.clone(),
                    epoch,
                    traffic.clone(),
                    mine,
                    start,
                    outcomes.clone(),
                ))
            })
            .collect();
        for driver in drivers {
            if let Err(e) = driver.await {
                eprintln!("fleet: a gateway's driver failed: {e}");
            }
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while outcomes.pending.load(Ordering::Relaxed) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    let seconds = started.elapsed().as_secs_f64();
    let own_after = own_cpu(ticks);
    let after: Vec<NodeStats> = cluster
        .nodes
        .iter()
        .map(node_stats)
        .collect::<Result<_, _>>()?;
    runtime.block_on(async move {
        drop(routers);
        tokio::time::sleep(Duration::from_millis(200)).await;
    });
    let unanswered = outcomes.pending.load(Ordering::Relaxed);
    if unanswered > 0 {
        return Err(format!(
            "{}: {unanswered} requests still unanswered 30 s after the last was sent",
            config.name()
        ));
    }
    let nodes = since(&before, after);
    let status: Vec<u8> = outcomes
        .status
        .iter()
        .map(|s| s.load(Ordering::Relaxed))
        .collect();
    let mut admitted = vec![0u32; traffic.tenants.len()];
    for (a, s) in traffic.arrivals.iter().zip(&status) {
        if *s == 1 {
            admitted[a.tenant as usize] += 1;
        }
    }
    let local = (
        outcomes.local_ok.load(Ordering::Relaxed),
        outcomes.local_denied.load(Ordering::Relaxed),
    );
    Ok(Run {
        config,
        local,
        at_once: outcomes
            .at_once
            .iter()
            .map(|s| s.load(Ordering::Relaxed) == 1)
            .collect(),
        seconds,
        nodes,
        gateway_cpu: own_after - own_before,
        admitted,
        status,
        start: outcomes
            .start
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
            .collect(),
        end: outcomes
            .end
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
            .collect(),
    })
}

/// Requests in flight per gateway in the busy phase.
const BUSY_IN_FLIGHT: usize = 64;

/// What one configuration's busy phase measured: each primary's calls and CPU seconds.
struct Busy {
    seconds: f64,
    requests: usize,
    nodes: Vec<NodeStats>,
}

/// The busy phase: the same arrivals sent as fast as each gateway's answers come back
/// ([`BUSY_IN_FLIGHT`] in flight per gateway; each store's clock still set to the arrival's
/// time), for `busy_seconds`. Redis's calls then come in batches, as on a shard near its
/// capacity, and its CPU per call is what a busy shard pays; the open-loop phase's, at this
/// machine's low rate, is mostly waking up for each call.
#[allow(clippy::too_many_arguments)]
fn run_busy(
    runtime: &tokio::runtime::Runtime,
    cluster: &support::RedisCluster,
    settings: &Settings,
    rules: &Rules,
    traffic: &Arc<Traffic>,
    hot_id: &str,
    config: Config,
    epoch: u64,
) -> Result<Busy, String> {
    let (clocks, routers, before) =
        prepare(runtime, cluster, settings, rules, hot_id, config, epoch)?;
    let by_gateway = by_gateway(traffic, settings.gateways);
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(settings.busy_seconds);
    let sent = Arc::new(AtomicUsize::new(0));
    runtime.block_on(async {
        let drivers: Vec<_> = routers
            .iter()
            .zip(&clocks)
            .zip(by_gateway)
            .map(|((router, clock), mine)| {
                let (router, clock, traffic, sent) =
                    (router.clone(), clock.clone(), traffic.clone(), sent.clone());
                tokio::spawn(async move {
                    let window = Arc::new(tokio::sync::Semaphore::new(BUSY_IN_FLIGHT));
                    for index in mine {
                        if Instant::now() >= until {
                            break;
                        }
                        let Ok(permit) = window.clone().acquire_owned().await else {
                            break;
                        };
                        sent.fetch_add(1, Ordering::Relaxed);
                        if let Err(future) = send(&router, &clock, epoch, &traffic, index as usize)
                        {
                            tokio::spawn(async move {
                                let _ = future.await;
                                drop(permit);
                            });
                        }
                    }
                    // Every answer in.
                    let _ = window.acquire_many(BUSY_IN_FLIGHT as u32).await;
                })
            })
            .collect();
        for driver in drivers {
            if let Err(e) = driver.await {
                eprintln!("fleet: a gateway's busy driver failed: {e}");
            }
        }
    });
    let seconds = started.elapsed().as_secs_f64();
    let after: Vec<NodeStats> = cluster
        .nodes
        .iter()
        .map(node_stats)
        .collect::<Result<_, _>>()?;
    runtime.block_on(async move {
        drop(routers);
        tokio::time::sleep(Duration::from_millis(200)).await;
    });
    Ok(Busy {
        seconds,
        requests: sent.load(Ordering::Relaxed),
        nodes: since(&before, after),
    })
}

/// The reference model's answers: the same arrivals, in time order, through the same rules on
/// the memory store, on a manual clock set to each arrival's time.
fn oracle(
    runtime: &tokio::runtime::Runtime,
    text: &str,
    traffic: &Traffic,
    epoch: u64,
) -> Result<Oracle, String> {
    runtime.block_on(async {
        let clock = ManualClock::new(epoch);
        let policy = Policy::from_toml(text, "fleet.toml")
            .map_err(|e| format!("the oracle's rules: {e}"))?;
        let store = MemoryStore::builder()
            .clock(clock.clone())
            .max_keys(4_000_000)
            .build()
            .map_err(|e| format!("the oracle's store: {e}"))?;
        let layer = RateLimitLayer::builder()
            .policy(policy)
            .tenant(TenantFromExtension)
            .store(store)
            .build()
            .map_err(|e| format!("the oracle's layer: {e}"))?;
        let router = router(layer);
        let mut admitted = vec![0u32; traffic.tenants.len()];
        let mut decisions = Vec::with_capacity(traffic.arrivals.len());
        let mut refusing = vec![0u8; traffic.tenants.len()];
        for arrival in &traffic.arrivals {
            clock.set(epoch + arrival.at);
            let Ok(response) = router
                .clone()
                .oneshot(request(arrival, &traffic.tenants))
                .await;
            match response.status() {
                StatusCode::OK => {
                    admitted[arrival.tenant as usize] += 1;
                    decisions.push(1);
                }
                StatusCode::TOO_MANY_REQUESTS => {
                    decisions.push(2);
                    let header = response
                        .headers()
                        .get("ratelimit")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("");
                    refusing[arrival.tenant as usize] |= refusing_rules(header);
                }
                other => return Err(format!("the oracle answered {other}")),
            }
        }
        Ok(Oracle {
            admitted,
            decisions,
            refusing,
        })
    })
}

/// What the reference model decided.
struct Oracle {
    /// Each tenant's admitted count.
    admitted: Vec<u32>,
    /// Each request's decision: 1 admitted, 2 refused.
    decisions: Vec<u8>,
    /// Each tenant's rules that refused it at least once: [`PLAN`], [`SEARCH`], [`GLOBAL`].
    refusing: Vec<u8>,
}

/// A tenant's plan rule (`free`, `pro`, `enterprise`, `dedicated`).
const PLAN: u8 = 1;
/// A tenant's `/search` rule (`<tier>-search`).
const SEARCH: u8 = 2;
/// The global rule.
const GLOBAL: u8 = 4;

/// The rules a 429's `RateLimit` field shows exhausted (`r=0`), as [`PLAN`] | [`SEARCH`] |
/// [`GLOBAL`].
fn refusing_rules(header: &str) -> u8 {
    let mut mask = 0;
    for item in header.split(',') {
        let item = item.trim();
        let Some(rest) = item.strip_prefix('"') else {
            continue;
        };
        let Some((name, params)) = rest.split_once('"') else {
            continue;
        };
        if !params.split(';').any(|p| p.trim() == "r=0") {
            continue;
        }
        mask |= if name == "global" {
            GLOBAL
        } else if name.ends_with("-search") {
            SEARCH
        } else {
            PLAN
        };
    }
    mask
}

// ---------------------------------------------------------------------------------------------
// Accuracy

/// Each tenant's tolerance in the exact configuration: 0 when Redis saw its requests in time
/// order; else one request plus the units refilled during its longest reordering by the rules
/// the oracle saw refusing it (a rule that never refused it cannot change its count). Also the
/// longest reordering gap of any tenant, µs (reported: it is the run's own, not capped).
///
/// Redis decides each request at the time the oracle does (the store's clock), so the only
/// thing that can make them differ is order: two requests of one tenant in flight at once (from
/// two gateways, or the two phases of two cross-slot checks) may reach Redis in the other order.
/// A pair (i before j in time) may have been reversed when j was sent before i's answer came
/// back; the tenant's window is the longest such gap `ts(j) - ts(i)`. Within it the later
/// request can take units the earlier would have had, and Redis, seeing time step back, counts
/// the earlier one on a bucket not refilled at all (`TokenBucket.check` in
/// `src/store/redis/script/token_bucket.lua`: with `now` before the stored time, `added` is 0,
/// so 0 tokens at the stored time: stricter, never looser): at most the units refilled during
/// the window, plus the one request at its edge.
fn tolerances(run: &Run, traffic: &Traffic, rules: &Rules, refusing: &[u8]) -> (Vec<u32>, u64) {
    let mut by_tenant: Vec<Vec<u32>> = vec![Vec::new(); traffic.tenants.len()];
    for (i, a) in traffic.arrivals.iter().enumerate() {
        by_tenant[a.tenant as usize].push(i as u32);
    }
    let mut tolerance = vec![0u32; traffic.tenants.len()];
    let mut longest = 0u64;
    for (tenant, requests) in by_tenant.iter().enumerate() {
        let mut window = 0u64;
        let mut reordered = false;
        let mut errors = 0u32;
        for (k, &j) in requests.iter().enumerate() {
            let j = j as usize;
            if run.status[j] == 3 {
                errors += 1;
            }
            let sent = run.start[j];
            for &i in requests[..k].iter().rev().take(1024) {
                let i = i as usize;
                let gap = traffic.arrivals[j].at - traffic.arrivals[i].at;
                if gap > 5_000_000 {
                    break;
                }
                if run.end[i] > sent {
                    reordered = true;
                    window = window.max(gap);
                }
            }
        }
        if reordered {
            longest = longest.max(window);
            let rate = rules.rates(traffic.tiers[tenant], refusing[tenant]);
            tolerance[tenant] = 1 + (rate * window as f64 / 1e6).ceil() as u32;
        }
        tolerance[tenant] += errors;
    }
    (tolerance, longest)
}

#[derive(Debug, Default)]
struct Accuracy {
    compared: usize,
    differing: usize,
    over: u64,
    under: u64,
    worst: (usize, i64),
    outside_tolerance: usize,
    outside_bound: usize,
    hot: (u32, u32, i64),
    hot_bound: (u64, u64),
    errors: usize,
    /// Requests the fleet admitted that the oracle refused, and the reverse.
    wrongly_allowed: usize,
    wrongly_limited: usize,
    /// Of those (both kinds): the hot tenant's, and those with another request of their tenant
    /// in flight at the same time (sent before the one answered, answered after the other sent).
    wrong_hot: usize,
    wrong_in_flight: usize,
    /// The longest reordering gap behind the exact tolerance, µs.
    gap: u64,
    /// (tenant's oracle admitted, fleet - oracle) of every tenant that differs.
    points: Vec<(u32, i64, bool)>,
}

/// The documented bound on a tenant's under- and over-admission for this configuration, past
/// the exact configuration's tolerance `tolerance`.
fn bound(
    config: Config,
    settings: &Settings,
    tenant: usize,
    tolerance: u32,
    refusing: u8,
) -> (u64, u64) {
    let g = settings.gateways as u64;
    let t = u64::from(tolerance);
    if tenant != 0 {
        // The deny cache never refuses what Redis would admit (store docs), and the global
        // rule, leased or not, never refuses: the exact tolerance.
        return (t, t);
    }
    // Rule::lease: at any moment at most (n - 1) units per replica sit unspent in leases, and
    // never more is admitted than the budget as charged; but a token bucket's lease that
    // expires unspent is lost (refilled over), up to (n - 1) each time demand falls, so over a
    // whole run the documented bound is per moment, not on totals. What is checked here is the
    // run's total shortfall against G × (n - 1), the units that can sit unspent at the run's
    // end, plus the exact tolerance: a proxy, not the documented bound itself. Rule::split:
    // refused at the earliest when about (parts - 1) × R units are left on the other sub-keys;
    // never more than the quota. A rule adds its own only if the oracle saw it refusing the hot
    // tenant (one that never refuses cannot shift its count).
    let (plan, search) = config.hot();
    let early = [(plan, PLAN), (search, SEARCH)]
        .into_iter()
        .filter(|&(_, bit)| refusing & bit != 0)
        .map(|(hot, _)| match hot {
            Hot::Exact => 0,
            Hot::Lease => g * (settings.lease - 1),
            Hot::Split => g * (settings.split - 1),
        })
        .sum::<u64>();
    (t + early, t)
}

fn accuracy(
    run: &Run,
    traffic: &Traffic,
    oracle: &Oracle,
    tolerance: &[u32],
    gap: u64,
    settings: &Settings,
    seen: &[bool],
) -> Accuracy {
    let mut acc = Accuracy {
        errors: run.status.iter().filter(|&&s| s == 3).count(),
        gap,
        ..Accuracy::default()
    };
    let mut by_tenant: Vec<Vec<u32>> = vec![Vec::new(); seen.len()];
    let mut position = Vec::with_capacity(traffic.arrivals.len());
    for (i, a) in traffic.arrivals.iter().enumerate() {
        position.push(by_tenant[a.tenant as usize].len());
        by_tenant[a.tenant as usize].push(i as u32);
    }
    // Whether another request of `j`'s tenant was in flight while `j` was (either way round).
    let in_flight = |j: usize| {
        let requests = &by_tenant[traffic.arrivals[j].tenant as usize];
        let k = position[j];
        let overlaps = |&i: &u32| {
            let i = i as usize;
            run.start[i] <= run.end[j] && run.start[j] <= run.end[i]
        };
        let near = |i: &&u32| {
            traffic.arrivals[**i as usize]
                .at
                .abs_diff(traffic.arrivals[j].at)
                <= 5_000_000
        };
        requests[..k]
            .iter()
            .rev()
            .take(4096)
            .take_while(near)
            .any(&overlaps)
            || requests[k + 1..]
                .iter()
                .take(4096)
                .take_while(near)
                .any(&overlaps)
    };
    for (j, (&fleet, &want)) in run.status.iter().zip(&oracle.decisions).enumerate() {
        let wrong = if fleet == 1 && want != 1 {
            acc.wrongly_allowed += 1;
            true
        } else if fleet != 1 && want == 1 {
            acc.wrongly_limited += 1;
            true
        } else {
            false
        };
        if wrong {
            acc.wrong_hot += usize::from(traffic.arrivals[j].tenant == 0);
            acc.wrong_in_flight += usize::from(in_flight(j));
        }
    }
    let refusing = &oracle.refusing;
    let oracle = &oracle.admitted;
    for tenant in 0..oracle.len() {
        if !seen[tenant] {
            continue;
        }
        acc.compared += 1;
        let fleet = run.admitted[tenant];
        let want = oracle[tenant];
        let delta = i64::from(fleet) - i64::from(want);
        if tenant == 0 {
            acc.hot = (fleet, want, delta);
            acc.hot_bound = bound(run.config, settings, 0, tolerance[0], refusing[0]);
        }
        if delta == 0 {
            continue;
        }
        acc.differing += 1;
        acc.points.push((want, delta, tenant == 0));
        if delta > 0 {
            acc.over += delta as u64;
        } else {
            acc.under += delta.unsigned_abs();
        }
        if delta.abs() > acc.worst.1.abs() {
            acc.worst = (tenant, delta);
        }
        if delta.unsigned_abs() > u64::from(tolerance[tenant]) {
            acc.outside_tolerance += 1;
        }
        let (under, over) = bound(
            run.config,
            settings,
            tenant,
            tolerance[tenant],
            refusing[tenant],
        );
        if (delta < 0 && delta.unsigned_abs() > under) || (delta > 0 && delta as u64 > over) {
            acc.outside_bound += 1;
        }
    }
    acc
}

// ---------------------------------------------------------------------------------------------
// Derived: the gateway fleet

/// Per-request costs of one configuration, split by the key they land on: `tail` per request of
/// a tenant other than the hot one (on that tenant's slot), `global` per request (on the global
/// key's slot), `hot` per hot-tenant request (on its slot, or spread over its sub-keys' slots).
#[derive(Clone, Copy, Debug, Default)]
struct Costs {
    tail: f64,
    global: f64,
    hot: f64,
}

/// Share of the tail's requests on each slot, for `tenants` tenants of Zipf popularity.
fn tail_slot_shares(tenants: usize, s: f64) -> Vec<f64> {
    let mut shares = vec![0.0; SLOTS];
    let mut sum = 0.0;
    let mut name = String::new();
    for rank in 1..=tenants {
        let w = (rank as f64).powf(-s);
        sum += w;
        name.clear();
        let _ = write!(name, "t{rank}");
        shares[usize::from(crc16(name.as_bytes())) % SLOTS] += w;
    }
    for share in &mut shares {
        *share /= sum;
    }
    shares
}

/// A derived fleet: each shard's calls/s and CPU share on `primaries` primaries holding equal
/// slot ranges.
struct Derived {
    calls: Vec<f64>,
    cpu: Vec<f64>,
}

#[allow(clippy::too_many_arguments)]
fn derive(
    calls: Costs,
    cpu_us: Costs,
    rate: f64,
    tail_shares: &[f64],
    global_slot: usize,
    hot_slots: &[usize],
    primaries: usize,
) -> Derived {
    let shard = |slot: usize| slot * primaries / SLOTS;
    let mut requests_tail = vec![0.0; primaries];
    for (slot, share) in tail_shares.iter().enumerate() {
        requests_tail[shard(slot)] += share * rate * (1.0 - HOT_SHARE);
    }
    let mut calls_per = vec![0.0; primaries];
    let mut cpu_per = vec![0.0; primaries];
    for p in 0..primaries {
        calls_per[p] = requests_tail[p] * calls.tail;
        cpu_per[p] = requests_tail[p] * cpu_us.tail / 1e6;
    }
    calls_per[shard(global_slot)] += rate * calls.global;
    cpu_per[shard(global_slot)] += rate * cpu_us.global / 1e6;
    for &slot in hot_slots {
        let part = rate * HOT_SHARE / hot_slots.len() as f64;
        calls_per[shard(slot)] += part * calls.hot;
        cpu_per[shard(slot)] += part * cpu_us.hot / 1e6;
    }
    Derived {
        calls: calls_per,
        cpu: cpu_per,
    }
}

// ---------------------------------------------------------------------------------------------
// Charts

fn chart_redis_cpu(
    path: &std::path::Path,
    runs: &[(Run, Accuracy)],
    labels: &[String],
) -> Result<(), String> {
    use plotters::prelude::*;
    let e = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let root = SVGBackend::new(path, (960, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let cores: Vec<Vec<f64>> = runs
        .iter()
        .map(|(run, _)| {
            run.nodes
                .iter()
                .map(|n| n.cpu / run.seconds * 100.0)
                .collect()
        })
        .collect();
    let top = cores.iter().flatten().copied().fold(1.0, f64::max) * 1.15;
    let names: Vec<&str> = runs.iter().map(|(r, _)| r.config.name()).collect();
    let count = names.len();
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Redis CPU per primary (% of one core), by configuration",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(-0.5f64..(count as f64 - 0.5), 0f64..top)
        .map_err(|x| e(&x))?;
    let label = |x: &f64| {
        let i = x.round();
        if (x - i).abs() < 0.01 && i >= 0.0 && (i as usize) < count {
            names[i as usize].to_owned()
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(count * 4 + 1)
        .x_label_formatter(&label)
        .y_desc("% of one core")
        .draw()
        .map_err(|x| e(&x))?;
    let colors = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
    ];
    let nodes = cores.first().map_or(0, Vec::len);
    for node in 0..nodes {
        let color = colors[node % colors.len()];
        let width = 0.8 / nodes as f64;
        chart
            .draw_series(cores.iter().enumerate().map(|(i, c)| {
                let x0 = i as f64 - 0.4 + node as f64 * width;
                Rectangle::new([(x0, 0.0), (x0 + width * 0.9, c[node])], color.filled())
            }))
            .map_err(|x| e(&x))?
            .label(labels[node].clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))?;
    Ok(())
}

fn chart_admission_error(path: &std::path::Path, runs: &[(Run, Accuracy)]) -> Result<(), String> {
    use plotters::prelude::*;
    let e = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let rows = runs.len();
    let root = SVGBackend::new(path, (960, 180 * rows as u32 + 40)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let (title, body) = root.split_vertically(40);
    title
        .draw_text(
            "Per-tenant admission error (fleet - oracle, requests) by tenant's admitted count; \
             tenants with no error not drawn",
            &("sans-serif", 16).into_font().color(&BLACK),
            (12, 12),
        )
        .map_err(|x| e(&x))?;
    let max_x = runs
        .iter()
        .flat_map(|(_, a)| a.points.iter().map(|p| p.0))
        .max()
        .unwrap_or(10)
        .max(10) as f64
        * 1.5;
    for ((run, acc), area) in runs.iter().zip(body.split_evenly((rows, 1))) {
        let span = acc
            .points
            .iter()
            .map(|p| p.1.unsigned_abs())
            .max()
            .unwrap_or(1)
            .max(1) as f64
            * 1.2;
        let mut chart = ChartBuilder::on(&area)
            .caption(
                format!(
                    "{}: {} of {} tenants differ, over {} / under {}",
                    run.config.name(),
                    acc.differing,
                    acc.compared,
                    acc.over,
                    acc.under
                ),
                ("sans-serif", 14),
            )
            .margin(6)
            .x_label_area_size(24)
            .y_label_area_size(56)
            .build_cartesian_2d((1f64..max_x).log_scale(), -span..span)
            .map_err(|x| e(&x))?;
        chart
            .configure_mesh()
            .x_labels(8)
            .y_labels(5)
            .draw()
            .map_err(|x| e(&x))?;
        let blue = RGBColor(31, 119, 180);
        let red = RGBColor(214, 39, 40);
        chart
            .draw_series(acc.points.iter().map(|&(want, delta, hot)| {
                let style = if hot { red.filled() } else { blue.filled() };
                Circle::new(
                    (f64::from(want.max(1)), delta as f64),
                    if hot { 5 } else { 2 },
                    style,
                )
            }))
            .map_err(|x| e(&x))?;
    }
    root.present().map_err(|x| e(&x))?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Tables

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    f64::from(sorted[i])
}

fn main() {
    if let Err(e) = run() {
        eprintln!("fleet: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let settings = Settings::from_env()?;
    let ticks = clock_ticks();
    let began = Instant::now();
    eprintln!("fleet: starting a 3-primary Redis Cluster");
    let cluster = support::RedisCluster::start();
    let server = support::server().clone();
    let owners = slot_owners(&cluster)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("a Tokio runtime: {e}"))?;

    // The global key, and a hot tenant on another primary (so that the measured loads tell
    // them apart).
    let global_name = runtime.block_on(async {
        let store = RedisClusterStore::builder(cluster.urls())
            .prefix(PREFIX)
            .build()
            .map_err(|e| format!("a store: {e}"))?;
        Ok::<_, String>(store.key_name("global", &tollgate::key::Key::global()))
    })?;
    let global_slot = slot_of(&global_name);
    let check: u16 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(&global_name)
        .query(&mut cluster.nodes[0].conn())
        .map_err(|e| format!("CLUSTER KEYSLOT: {e}"))?;
    if usize::from(check) != global_slot {
        return Err(format!(
            "the harness's CRC16 gives slot {global_slot} for {global_name}, Redis {check}"
        ));
    }
    // One primary per class of key, so that each measures its class alone: the global key's
    // primary (`global_node`), the hot tenant's keys and sub-keys on another (`hot_node`), every
    // other tenant on the third (`tail_node`). Names are chosen for it (a tenant's name is its
    // hash tag); the derived tables spread natural names over their primaries instead.
    let global_node = owners[global_slot];
    let hot_node = (global_node + 1) % 3;
    let tail_node = (global_node + 2) % 3;
    let on = |tag: &str, node: u8| owners[usize::from(crc16(tag.as_bytes())) % SLOTS] == node;
    let hot_fits = |id: &str| {
        let split = (0..settings.split)
            .filter(|i| on(&format!("{id}~{i}"), hot_node))
            .count();
        (on(id, hot_node), split)
    };
    let mut hot_id = String::new();
    let mut best = 0;
    for i in 0..3_000_000u32 {
        let id = format!("hot-{i}");
        let (whole, split) = hot_fits(&id);
        if whole && split > best {
            best = split;
            hot_id = id;
            if best == settings.split as usize {
                break;
            }
        }
    }
    if hot_id.is_empty() {
        return Err("no hot tenant name whose key lands on the hot tenant's primary".into());
    }
    let hot_key = format!("{PREFIX}:{{{hot_id}}}:dedicated");
    let hot_slot: u16 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(&hot_key)
        .query(&mut cluster.nodes[0].conn())
        .map_err(|e| format!("CLUSTER KEYSLOT: {e}"))?;
    if owners[usize::from(hot_slot)] != hot_node {
        return Err(format!("{hot_key} is not on the hot tenant's primary"));
    }
    let mut subs_on = [0usize; 3];
    for i in 0..settings.split {
        subs_on[usize::from(owners[slot_of(&format!("{{{hot_id}~{i}}}"))])] += 1;
    }
    let tail_name = |rank: u64| {
        (0..)
            .map(|k| {
                if k == 0 {
                    format!("t{rank}")
                } else {
                    format!("t{rank}-{k}")
                }
            })
            .find(|name| on(name, tail_node))
            .unwrap_or_default()
    };

    let rules = Rules::new(&settings);
    let traffic = Arc::new(traffic(&settings, &hot_id, &tail_name));
    let n = traffic.arrivals.len();
    let hot_requests = traffic.arrivals.iter().filter(|a| a.tenant == 0).count();
    let mut seen = vec![false; traffic.tenants.len()];
    for a in &traffic.arrivals {
        seen[a.tenant as usize] = true;
    }
    eprintln!(
        "fleet: {} arrivals over {} s ({} tenants seen), {} gateways; {} ({})",
        n,
        settings.seconds,
        seen.iter().filter(|&&s| s).count(),
        settings.gateways,
        server,
        cluster.urls().join(", ")
    );

    // The oracle.
    let epoch = ManualClock::default().now_micros();
    let exact_text = policy_text(Config::Exact, &rules, &settings, &hot_id);
    let oracle_started = Instant::now();
    let oracle = oracle(&runtime, &exact_text, &traffic, epoch)?;
    eprintln!(
        "fleet: oracle decided {n} arrivals in {:.1} s",
        oracle_started.elapsed().as_secs_f64()
    );

    // Idle CPU of each node, to take out of the derived costs.
    let idle_before: Vec<NodeStats> = cluster
        .nodes
        .iter()
        .map(node_stats)
        .collect::<Result<_, _>>()?;
    std::thread::sleep(Duration::from_secs(2));
    let idle: Vec<f64> = cluster
        .nodes
        .iter()
        .zip(&idle_before)
        .map(|(node, b)| node_stats(node).map(|a| (a.cpu - b.cpu) / 2.0))
        .collect::<Result<_, _>>()?;

    let mut runs = Vec::new();
    let mut busies: Vec<Busy> = Vec::new();
    for &config in &settings.configs {
        eprintln!("fleet: {} ...", config.name());
        let run = run_config(
            &runtime, &cluster, &settings, &rules, &traffic, &hot_id, config, epoch, ticks,
        )?;
        let (tolerance, gap) = tolerances(&run, &traffic, &rules, &oracle.refusing);
        let acc = accuracy(&run, &traffic, &oracle, &tolerance, gap, &settings, &seen);
        eprintln!(
            "fleet: {} done in {:.1} s: {} tenants differ, {} outside the bound",
            config.name(),
            run.seconds,
            acc.differing,
            acc.outside_bound
        );
        runs.push((run, acc));
        let busy = run_busy(
            &runtime, &cluster, &settings, &rules, &traffic, &hot_id, config, epoch,
        )?;
        eprintln!(
            "fleet: {} busy: {} requests in {:.1} s",
            config.name(),
            busy.requests,
            busy.seconds
        );
        busies.push(busy);
    }

    // Node labels: which keys each holds.
    let labels: Vec<String> = (0..cluster.nodes.len())
        .map(|i| {
            let what = if i == usize::from(global_node) {
                "the global key".to_owned()
            } else if i == usize::from(hot_node) {
                format!(
                    "the hot tenant: its key and {best}/{} sub-keys",
                    settings.split
                )
            } else {
                format!("the other {} tenants", settings.tenants)
            };
            format!("primary {} ({what})", i + 1)
        })
        .collect();

    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nFleet: {} gateways, {:.0} requests/s offered for {} s per configuration ({} arrivals), \
         {} tenants (Zipf {}), hot tenant `{}` {:.0} % of requests ({} arrivals, all on /search), \
         seed {}; {} on 3 primaries, all on this machine ({} cores); run {}.\n",
        settings.gateways,
        settings.rate,
        settings.seconds,
        n,
        settings.tenants,
        settings.zipf,
        hot_id,
        HOT_SHARE * 100.0,
        hot_requests,
        settings.seed,
        server,
        std::thread::available_parallelism().map_or(0, |p| p.get()),
        utc_now(),
    );
    let _ = writeln!(out, "Keys: {}.\n", labels.join("; "));
    let _ = writeln!(
        out,
        "| configuration | deny cache | hot tenant's plan (`dedicated`) | hot tenant's `/search` rule | global rule |\n|---|---|---|---|---|"
    );
    for &config in &settings.configs {
        let show = |hot: Hot| match hot {
            Hot::Exact => "exact".to_owned(),
            Hot::Lease => format!("lease({})", settings.lease),
            Hot::Split => format!("split({})", settings.split),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} |",
            config.name(),
            if config.deny_cache() { "on" } else { "off" },
            show(config.hot().0),
            show(config.hot().1),
            if config.global_leased() {
                format!("lease({GLOBAL_LEASE})")
            } else {
                "exact".to_owned()
            }
        );
    }
    let _ = writeln!(out);

    // Table 1: cost.
    let _ = writeln!(
        out,
        "| configuration | requests/s | admitted | Redis calls/s | calls/request | commands run by the scripts/request | Redis CPU µs/decision | Redis CPU µs/call | Redis µs in code/decision | hottest primary (of this harness's placement: one class of key per primary): calls, CPU | decided locally: admits / 429s (hot tenant's) | gateway CPU µs/request | p50 µs | p99 µs | lag p99 ms | errors |"
    );
    let _ = writeln!(
        out,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|"
    );
    let mut per_call = (f64::MAX, 0.0f64);
    for (run, acc) in &runs {
        let calls: f64 = run.nodes.iter().map(|x| x.code_calls).sum();
        let cpu: f64 = run.nodes.iter().map(|x| x.cpu).sum();
        let usec: f64 = run.nodes.iter().map(|x| x.code_usec).sum();
        let hottest_calls =
            run.nodes.iter().map(|x| x.code_calls).fold(0.0, f64::max) / calls.max(1.0);
        let (hot_node, hot_cpu) = run
            .nodes
            .iter()
            .enumerate()
            .map(|(i, x)| (i, x.cpu))
            .fold((0, 0.0), |a, b| if b.1 > a.1 { b } else { a });
        let admitted = run.status.iter().filter(|&&s| s == 1).count();
        let mut latency: Vec<u32> = run
            .start
            .iter()
            .zip(&run.end)
            .map(|(s, e)| e.saturating_sub(*s))
            .collect();
        latency.sort_unstable();
        let mut lag: Vec<u32> = run
            .start
            .iter()
            .zip(&traffic.arrivals)
            .map(|(s, a)| (u64::from(*s).saturating_sub(a.at)) as u32)
            .collect();
        lag.sort_unstable();
        let other: f64 = run.nodes.iter().map(|x| x.other_calls).sum();
        let cpu_per_call = cpu * 1e6 / calls.max(1.0);
        per_call = (per_call.0.min(cpu_per_call), per_call.1.max(cpu_per_call));
        let hot_local = |ok: bool| {
            traffic
                .arrivals
                .iter()
                .zip(&run.at_once)
                .zip(&run.status)
                .filter(|&((a, &once), &st)| a.tenant == 0 && once && (st == 1) == ok)
                .count()
        };
        let _ = writeln!(
            out,
            "| {} | {:.0} | {:.1} % | {:.0} | {:.3} | {:.3} | {:.1} | {:.1} | {:.1} | primary {}: {:.0} %, {:.0} % | {} / {} ({} / {}) | {:.1} | {:.0} | {:.0} | {:.1} | {} |",
            run.config.name(),
            n as f64 / run.seconds,
            admitted as f64 / n as f64 * 100.0,
            calls / run.seconds,
            calls / n as f64,
            other / n as f64,
            cpu * 1e6 / n as f64,
            cpu_per_call,
            usec / n as f64,
            hot_node + 1,
            hottest_calls * 100.0,
            hot_cpu / cpu.max(1e-9) * 100.0,
            run.local.0,
            run.local.1,
            hot_local(true),
            hot_local(false),
            run.gateway_cpu * 1e6 / n as f64,
            percentile(&latency, 0.5),
            percentile(&latency, 0.99),
            percentile(&lag, 0.99) / 1000.0,
            acc.errors,
        );
    }
    let _ = writeln!(
        out,
        "\nRedis CPU per script call, all primaries together, in this run: {:.0}–{:.0} µs by configuration. \
         Commands run by the scripts: the GETs and SETs tollgate's code runs inside its calls, \
         which Redis counts apart (no store sends any other command; the harness's own \
         INFO/CONFIG/CLUSTER/PING are left out). Decided locally: answered at the first poll, \
         without waiting on Redis (a lease's local units, the deny cache's 429s).",
        per_call.0, per_call.1
    );
    for (run, _) in &runs {
        let mut by_name: Vec<(String, f64)> = Vec::new();
        for node in &run.nodes {
            for (name, calls) in &node.others {
                match by_name.iter_mut().find(|(n, _)| n == name) {
                    Some(entry) => entry.1 += calls,
                    None => by_name.push((name.clone(), *calls)),
                }
            }
        }
        by_name.sort_by(|a, b| b.1.total_cmp(&a.1));
        let list: Vec<String> = by_name
            .iter()
            .map(|(name, calls)| format!("{name} {:.3}", calls / n as f64))
            .collect();
        let _ = writeln!(
            out,
            "Commands run by the scripts per request, {}: {}.",
            run.config.name(),
            if list.is_empty() {
                "none".to_owned()
            } else {
                list.join(", ")
            }
        );
    }

    // Table 2: per primary.
    let _ = writeln!(out);
    let mut header = "| configuration |".to_owned();
    let mut rule = "|---|".to_owned();
    for i in 0..cluster.nodes.len() {
        let _ = write!(
            header,
            " primary {} calls/s | primary {} CPU % |",
            i + 1,
            i + 1
        );
        rule.push_str("---:|---:|");
    }
    let _ = writeln!(out, "{header}\n{rule}");
    for (run, _) in &runs {
        let _ = write!(out, "| {} |", run.config.name());
        for node in &run.nodes {
            let _ = write!(
                out,
                " {:.0} | {:.1} |",
                node.code_calls / run.seconds,
                node.cpu / run.seconds * 100.0
            );
        }
        let _ = writeln!(out);
    }
    let _ = writeln!(
        out,
        "\nIdle CPU of each primary (no traffic, 2 s): {}.",
        idle.iter()
            .map(|c| format!("{:.2} %", c * 100.0))
            .collect::<Vec<_>>()
            .join(", ")
    );

    // Table 3: accuracy.
    let _ = writeln!(
        out,
        "\nRequest by request (the oracle's decision for each request against the fleet's):\n\n\
         | configuration | requests | wrongly allowed | wrongly limited | wrongly allowed or limited | of which the hot tenant's | of which with another request of their tenant in flight | longest reordering gap behind the exact tolerance |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|"
    );
    for (run, acc) in &runs {
        let pct = |x: usize| x as f64 / n as f64 * 100.0;
        let wrong = acc.wrongly_allowed + acc.wrongly_limited;
        let share = |x: usize| x as f64 / wrong.max(1) as f64 * 100.0;
        let _ = writeln!(
            out,
            "| {} | {} | {} ({:.4} %) | {} ({:.4} %) | {:.4} % | {:.1} % | {:.1} % | {:.1} ms |",
            run.config.name(),
            n,
            acc.wrongly_allowed,
            pct(acc.wrongly_allowed),
            acc.wrongly_limited,
            pct(acc.wrongly_limited),
            pct(wrong),
            share(acc.wrong_hot),
            share(acc.wrong_in_flight),
            acc.gap as f64 / 1000.0,
        );
    }
    let name_of = |bit: u8| match bit {
        PLAN => "its plan `dedicated`",
        SEARCH => "its `/search` rule",
        _ => "the global rule",
    };
    let hot_refused = |bit: u8| oracle.refusing[0] & bit != 0;
    let any_refused_global = oracle.refusing.iter().any(|&m| m & GLOBAL != 0);
    let _ = writeln!(
        out,
        "\nIn the oracle the hot tenant was refused by: {}; the global rule refused {}.",
        [PLAN, SEARCH]
            .into_iter()
            .map(|b| format!(
                "{} {}",
                name_of(b),
                if hot_refused(b) { "yes" } else { "never" }
            ))
            .collect::<Vec<_>>()
            .join(", "),
        if any_refused_global {
            "some tenant"
        } else {
            "no tenant"
        }
    );
    let _ = writeln!(
        out,
        "\nPer tenant, net (fleet's admitted count - oracle's; a tenant's wrong admits and wrong denials cancel here, not in the table above):\n\n\
         | configuration | tenants | differ from oracle | over-admitted | under-admitted | worst tenant | hot tenant: fleet / oracle (Δ) | hot tenant's bound (under / over) | mechanisms and whether they acted | outside exact tolerance | outside bound |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---|---|---|---|---:|---:|");
    for (run, acc) in &runs {
        let mut acted = Vec::new();
        if run.config.deny_cache() {
            acted.push(format!(
                "deny cache: {} ({} local 429s)",
                if run.local.1 > 0 {
                    "exercised"
                } else {
                    "not exercised"
                },
                run.local.1
            ));
        }
        let (plan, search) = run.config.hot();
        for (hot, bit) in [(plan, PLAN), (search, SEARCH)] {
            let what = match hot {
                Hot::Exact => continue,
                Hot::Lease => "lease",
                Hot::Split => "split",
            };
            acted.push(format!(
                "{what} on {}: {}",
                name_of(bit),
                if hot_refused(bit) {
                    "exercised, bound counted"
                } else {
                    "not exercised (the rule never refuses), no bound counted"
                }
            ));
        }
        if run.config.global_leased() {
            acted.push(format!(
                "lease on the global rule: {}",
                if any_refused_global {
                    "exercised"
                } else {
                    "not exercised (never refuses), no bound counted"
                }
            ));
        }
        if acted.is_empty() {
            acted.push("none".to_owned());
        }
        let worst = if acc.worst.1 == 0 {
            "none".to_owned()
        } else {
            format!("{} ({:+})", traffic.tenants[acc.worst.0].id(), acc.worst.1)
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} / {} ({:+}) | {} / {} | {} | {} | {} |",
            run.config.name(),
            acc.compared,
            acc.differing,
            acc.over,
            acc.under,
            worst,
            acc.hot.0,
            acc.hot.1,
            acc.hot.2,
            acc.hot_bound.0,
            acc.hot_bound.1,
            acted.join("; "),
            acc.outside_tolerance,
            acc.outside_bound,
        );
    }
    let _ = writeln!(
        out,
        "\nBounds checked: the exact tolerance per tenant is one request plus the units refilled, \
         during its longest reordering (the gap above, the run's own, not capped), by the rules \
         the oracle saw refusing it. A lease's bound is checked on run totals as G × (n - 1) \
         units short per leased rule that refuses: `Rule::lease` documents (n - 1) per replica at \
         any moment, and for a token bucket adds the units of leases that expire unspent each \
         time demand falls, which a total over the run cannot isolate; so the figure checked is \
         a proxy for the documented bound, not the bound itself. A split's: G × (parts - 1)."
    );
    let total_oracle: u64 = oracle.admitted.iter().map(|&x| u64::from(x)).sum();
    let _ = writeln!(
        out,
        "\nThe oracle admitted {total_oracle} of {n} requests ({:.1} %).",
        total_oracle as f64 / n as f64 * 100.0
    );

    // Derived: per-request costs of each class, from its own primary.
    let tail_requests = (n - hot_requests) as f64;
    let fleets = [
        (
            "the gateway fleet: 50 gateways, 200,000 requests/s, 1,000,000 tenants",
            200_000.0,
            1_000_000usize,
        ),
        (
            "ten times: 500 gateways, 2,000,000 requests/s, 10,000,000 tenants",
            2_000_000.0,
            10_000_000usize,
        ),
    ];
    // Redis's CPU per call when busy: the closed-loop phase, idle CPU taken out.
    let _ = writeln!(
        out,
        "\nRedis busy (each configuration's busy phase: the same arrivals sent closed-loop, {BUSY_IN_FLIGHT} in flight per gateway, for {} s; Redis's calls come in batches, as on a shard near its capacity; idle CPU taken out):\n",
        settings.busy_seconds
    );
    let mut header = "| configuration | requests/s | Redis calls/s |".to_owned();
    let mut rule = "|---|---:|---:|".to_owned();
    for i in 0..cluster.nodes.len() {
        let _ = write!(header, " primary {} CPU % | µs/call |", i + 1);
        rule.push_str("---:|---:|");
    }
    header.push_str(" all primaries µs/call | at the offered rate µs/call |");
    rule.push_str("---:|---:|");
    let _ = writeln!(out, "{header}\n{rule}");
    let busy_per_call: Vec<Vec<f64>> = runs
        .iter()
        .zip(&busies)
        .map(|((run, _), busy)| {
            let cpu = |i: usize| (busy.nodes[i].cpu - idle[i] * busy.seconds).max(0.0);
            let total_cpu: f64 = (0..busy.nodes.len()).map(cpu).sum();
            let total_calls: f64 = busy.nodes.iter().map(|x| x.code_calls).sum();
            let overall = total_cpu * 1e6 / total_calls.max(1.0);
            let per: Vec<f64> = (0..busy.nodes.len())
                .map(|i| {
                    // A primary that saw few calls (the global key's, leased) has no figure of
                    // its own worth the name: it takes the whole cluster's.
                    if busy.nodes[i].code_calls >= 500.0 {
                        cpu(i) * 1e6 / busy.nodes[i].code_calls
                    } else {
                        overall
                    }
                })
                .collect();
            let open_calls: f64 = run.nodes.iter().map(|x| x.code_calls).sum();
            let open_cpu: f64 = run.nodes.iter().map(|x| x.cpu).sum();
            let mut line = format!(
                "| {} | {:.0} | {:.0} |",
                run.config.name(),
                busy.requests as f64 / busy.seconds,
                total_calls / busy.seconds
            );
            for (i, p) in per.iter().enumerate() {
                let _ = write!(line, " {:.1} | {:.1} |", cpu(i) / busy.seconds * 100.0, p);
            }
            let _ = write!(
                line,
                " {overall:.1} | {:.1} |",
                open_cpu * 1e6 / open_calls.max(1.0)
            );
            let _ = writeln!(out, "{line}");
            per.into_iter().chain([overall]).collect()
        })
        .collect();
    let _ = writeln!(
        out,
        "\nA primary's µs/call is its own where it ran at least 500 calls, else all primaries'. The derived tables below use these busy figures: a shard at half its CPU or more is busy, and its calls come in batches."
    );

    let mut costs = Vec::new();
    let _ = writeln!(
        out,
        "\nPer-request costs by class of key (calls: measured in the open-loop run, each class's primary's calls over the requests of the class; Redis CPU at the offered rate: that primary's CPU, its idle taken out, over the same; busy: the calls times the busy µs/call of the class's primary (the hot tenant's sub-keys: their primaries' µs weighted by sub-keys); in the split configurations the hot cost and the others' are estimated, see below the table):\n\n\
         | configuration | calls per other tenant's request | calls on the global slot per request | calls per hot-tenant request | Redis CPU µs per other tenant's request, offered rate / busy | on the global slot per request, offered / busy | per hot-tenant request, offered / busy |\n\
         |---|---:|---:|---:|---:|---:|---:|"
    );
    for (index, (run, _)) in runs.iter().enumerate() {
        let per_call = &busy_per_call[index];
        let node = |i: u8| &run.nodes[usize::from(i)];
        let busy = |i: u8| ((node(i).cpu / run.seconds - idle[usize::from(i)]) * 1e6).max(0.0);
        let calls = |i: u8| node(i).code_calls / run.seconds;
        // A split hot tenant's sub-keys take turns: each carries the same load, so the load of
        // those on the other primaries is that of those on its own, taken out of theirs.
        let costs_of = |load: &dyn Fn(u8) -> f64| {
            let (hot, per_sub) = if run.config.hot_split() {
                let per_sub = load(hot_node) / subs_on[usize::from(hot_node)].max(1) as f64;
                (per_sub * settings.split as f64, per_sub)
            } else {
                (load(hot_node), 0.0)
            };
            let other = |i: u8| (load(i) - per_sub * subs_on[usize::from(i)] as f64).max(0.0);
            Costs {
                tail: other(tail_node) / (tail_requests / run.seconds),
                global: other(global_node) / (n as f64 / run.seconds),
                hot: hot / (hot_requests as f64 / run.seconds),
            }
        };
        let c = costs_of(&calls);
        let u = costs_of(&busy);
        let hot_per_call = if run.config.hot_split() {
            let subs: usize = subs_on.iter().sum();
            subs_on
                .iter()
                .enumerate()
                .map(|(i, &k)| per_call[i] * k as f64)
                .sum::<f64>()
                / subs.max(1) as f64
        } else {
            per_call[usize::from(hot_node)]
        };
        let b = Costs {
            tail: c.tail * per_call[usize::from(tail_node)],
            global: c.global * per_call[usize::from(global_node)],
            hot: c.hot * hot_per_call,
        };
        let _ = writeln!(
            out,
            "| {} | {:.3} | {:.3} | {:.3} | {:.1} / {:.1} | {:.1} / {:.1} | {:.1} / {:.1} |",
            run.config.name(),
            c.tail,
            c.global,
            c.hot,
            u.tail,
            b.tail,
            u.global,
            b.global,
            u.hot,
            b.hot
        );
        costs.push((run.config, c, b));
    }
    let _ = writeln!(
        out,
        "\nThe hot tenant's {} sub-keys lie {} on the three primaries (sub-keys of one name sit at fixed XOR distances of slot, so not all on one). In split-hot and all-split the hot cost is therefore estimated, not measured: its primary's load divided evenly over the sub-keys there, times {}, and the other primaries' loads lose that per-sub-key share; in all-split the hot primary also carries the leased plan's calls, which this even division attributes to the sub-keys.",
        settings.split,
        subs_on
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(" / "),
        settings.split
    );
    // The derived fleets' keys, by their natural names: tenants `t1`.., the hot tenant `hot`.
    let natural_hot = slot_of("{hot}");
    let natural_subs: Vec<usize> = (0..settings.split)
        .map(|i| slot_of(&format!("{{hot~{i}}}")))
        .collect();
    for (title, rate, tenants) in fleets {
        let shares = tail_slot_shares(tenants, settings.zipf);
        let _ = writeln!(
            out,
            "\n{title} (derived: this run's measured per-request costs of each class, applied to the fleet's rate and to the natural hash slots of its tenants' names, on primaries holding equal slot ranges; the 100,000 calls/s columns take the gateway fleet's shard of 100,000 operations/s and count one script call as one operation; the CPU columns use the Redis CPU per call measured busy on this machine, above):\n\n\
             | configuration | Redis calls/s | primaries for every shard < 50 % at 100,000 calls/s a shard | then: calls/s per shard (hottest) | primaries for every shard < 50 % CPU at the busy µs/call | then: CPU % per shard (hottest) |\n\
             |---|---:|---:|---|---:|---|"
        );
        for &(config, c, u) in &costs {
            let hot_slots: Vec<usize> = if config.hot_split() {
                natural_subs.clone()
            } else {
                vec![natural_hot]
            };
            let at = |p: usize| derive(c, u, rate, &shares, global_slot, &hot_slots, p);
            let total_calls: f64 = at(1).calls.iter().sum();
            let spread = |v: &[f64], scale: f64, unit: &str| {
                let max = v.iter().copied().fold(0.0, f64::max);
                if v.len() <= 8 {
                    format!(
                        "{} ({:.0}{unit})",
                        v.iter()
                            .map(|x| format!("{:.0}", x * scale))
                            .collect::<Vec<_>>()
                            .join(" / "),
                        max * scale
                    )
                } else {
                    let min = v.iter().copied().fold(f64::MAX, f64::min);
                    format!(
                        "{:.0}–{:.0}{unit} over {} shards",
                        min * scale,
                        max * scale,
                        v.len()
                    )
                }
            };
            // What keeps a fleet from fitting at any size: the busiest single slot; when that is
            // the hot tenant's, also the busiest of the others, which splitting the hot tenant
            // further would leave as it is.
            let blocker = |load: &dyn Fn(&Derived) -> Vec<f64>, scale: f64, unit: &str| {
                let d = at(SLOTS);
                let v = load(&d);
                let busiest = |skip_hot: bool| {
                    v.iter()
                        .copied()
                        .enumerate()
                        .filter(|(slot, _)| !(skip_hot && hot_slots.contains(slot)))
                        .fold((0, 0.0), |a, b| if b.1 > a.1 { b } else { a })
                };
                let what = |slot: usize| {
                    if slot == global_slot {
                        "the global key's slot".to_owned()
                    } else if hot_slots.contains(&slot) {
                        "the hot tenant's slot".to_owned()
                    } else {
                        match (1..=tenants).find(|r| slot_of(&format!("t{r}")) == slot) {
                            Some(r) => format!("the slot of tenant t{r} (its most popular)"),
                            None => "a tenant's slot".to_owned(),
                        }
                    }
                };
                let (slot, max) = busiest(false);
                let mut text = format!("none: {} alone {:.0}{unit}", what(slot), max * scale);
                if hot_slots.contains(&slot) {
                    let (next, load) = busiest(true);
                    let _ = write!(
                        text,
                        "; with the hot tenant split further, {} alone still {:.0}{unit}",
                        what(next),
                        load * scale
                    );
                }
                text
            };
            let ops = |d: &Derived| d.calls.iter().map(|x| x / SEED_SHARD_OPS).collect();
            let cpu = |d: &Derived| d.cpu.clone();
            let fit = |load: &dyn Fn(&Derived) -> Vec<f64>| {
                (1..=1024).find(|&p| load(&at(p)).iter().all(|&x| x < SHARD_CPU_LIMIT))
            };
            let (ops_p, ops_list) = match fit(&ops) {
                Some(p) => (p.to_string(), spread(&at(p).calls, 1.0, "")),
                None => (blocker(&ops, 100.0, " % of a shard"), "–".to_owned()),
            };
            let (cpu_p, cpu_list) = match fit(&cpu) {
                Some(p) => (p.to_string(), spread(&at(p).cpu, 100.0, " %")),
                None => (blocker(&cpu, 100.0, " % of a core"), "–".to_owned()),
            };
            let _ = writeln!(
                out,
                "| {} | {:.0} | {} | {} | {} | {} |",
                config.name(),
                total_calls,
                ops_p,
                ops_list,
                cpu_p,
                cpu_list
            );
        }
    }

    // Charts.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/fleet");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    chart_redis_cpu(&dir.join("redis_cpu.svg"), &runs, &labels)?;
    chart_admission_error(&dir.join("admission_error.svg"), &runs)?;
    let _ = writeln!(
        out,
        "\nCharts: benches/fleet/redis_cpu.svg, benches/fleet/admission_error.svg. Whole bench: {:.0} s (timed by the harness from the cluster's start to the charts written; the build not included).",
        began.elapsed().as_secs_f64()
    );
    println!("{out}");
    drop(runtime);
    drop(cluster);
    Ok(())
}

/// The time now, UTC, as `YYYY-MM-DD HH:MM`.
fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = secs / 86_400;
    let (h, m) = ((secs % 86_400) / 3600, (secs % 3600) / 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let mo = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(mo <= 2);
    format!("{y}-{mo:02}-{d:02} {h:02}:{m:02} UTC")
}
