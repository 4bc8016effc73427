//! Rules files: a [`Policy`] written in TOML.
//!
//! ```
//! use tollgate::policy::Policy;
//!
//! let policy = Policy::from_toml(r#"
//! version = "2026-12-01"
//! default_tier = "free"
//!
//! [tiers.free]
//! rules = [{ name = "free", limit = 5, per = "minute" }]
//!
//! [tiers.pro]
//! rules = [{ name = "pro", limit = 50, per = "minute" }]
//!
//! [tenants.acme]
//! tier = "pro"
//! routes."/search".rules = [{ name = "acme-search", limit = 2, per = "minute" }]
//! "#, "tiers.toml")?;
//! assert_eq!(policy.version(), "2026-12-01");
//! # Ok::<(), tollgate::ConfigError>(())
//! ```
//!
//! The format is described in the README ("Tiers, tenants and routes"). Errors name the file,
//! the line and the column, and what to change.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use super::key_spec::KeySpec;
use super::model::{Listed, Origin, Policy, Region, Subject, TenantRules, Tier};
use super::{FailureMode, Quota, Rule};
use crate::{Algorithm, ConfigError};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileDef {
    version: Spanned<String>,
    default_tier: Option<Spanned<String>>,
    #[serde(default)]
    defaults: DefaultsDef,
    /// Rules of every tier: the same form as a tier.
    all_tiers: Option<Spanned<TierDef>>,
    #[serde(default)]
    tiers: BTreeMap<String, Spanned<TierDef>>,
    #[serde(default)]
    tenants: BTreeMap<String, Spanned<TenantDef>>,
    #[serde(default)]
    lists: ListsDef,
    region: Option<Spanned<RegionDef>>,
}

/// Options of every rule that does not set its own.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct DefaultsDef {
    algorithm: Option<Spanned<String>>,
    key: Option<Spanned<String>>,
    on_store_error: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TierDef {
    #[serde(default)]
    rules: Vec<Spanned<RuleDef>>,
    #[serde(default)]
    routes: BTreeMap<String, Spanned<RouteDef>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantDef {
    tier: Option<String>,
    #[serde(default)]
    routes: BTreeMap<String, Spanned<RouteDef>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteDef {
    rules: Vec<Spanned<RuleDef>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleDef {
    name: String,
    limit: u64,
    per: Spanned<String>,
    burst: Option<u64>,
    algorithm: Option<Spanned<String>>,
    cost: Option<u64>,
    key: Option<Spanned<String>>,
    on_store_error: Option<Spanned<String>>,
    mode: Option<Spanned<String>>,
    max_delay: Option<Spanned<String>>,
    #[serde(default)]
    skip_unidentified: bool,
    lease: Option<u64>,
    lease_ttl: Option<Spanned<String>>,
    split: Option<u16>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListsDef {
    #[serde(default)]
    allow: Vec<Spanned<String>>,
    #[serde(default)]
    deny: Vec<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RegionDef {
    name: String,
    share: f64,
}

/// Line and column (from 1) of a byte offset.
struct Lines<'a> {
    text: &'a str,
    starts: Vec<usize>,
}

impl<'a> Lines<'a> {
    fn new(text: &'a str) -> Self {
        let starts = std::iter::once(0)
            .chain(text.match_indices('\n').map(|(i, _)| i + 1))
            .collect();
        Lines { text, starts }
    }

    fn place(&self, offset: usize) -> (usize, usize) {
        let offset = offset.min(self.text.len());
        let line = self.starts.partition_point(|&s| s <= offset).max(1);
        let start = self.starts[line - 1];
        let column = self.text[start..offset].chars().count() + 1;
        (line, column)
    }
}

/// Reads a policy file's text; `origin` (the file's path) names it in errors.
pub(crate) fn parse(text: &str, origin: &str) -> Result<Policy, ConfigError> {
    let lines = Lines::new(text);
    let at = |span: Range<usize>, message: String| {
        let (line, column) = lines.place(span.start);
        ConfigError::new(message).at(origin, line, column)
    };
    let file: FileDef = toml::from_str(text).map_err(|e| {
        let message = e.message().trim().to_owned();
        match e.span() {
            Some(span) => at(span, message),
            None => ConfigError::new(message).at_file(origin),
        }
    })?;

    let mut places = HashMap::new();
    let mut place = |subject: Subject, span: Range<usize>| {
        let subject = match subject {
            // A name defined again: where a conflict between the two is shown.
            Subject::Rule(name) if places.contains_key(&Subject::Rule(name.clone())) => {
                Subject::RuleAgain(name)
            }
            subject => subject,
        };
        places
            .entry(subject)
            .or_insert_with(|| lines.place(span.start));
    };
    place(Subject::Version, file.version.span());
    if let Some(default_tier) = &file.default_tier {
        place(Subject::DefaultTier, default_tier.span());
    }

    let defaults = Defaults {
        algorithm: match &file.defaults.algorithm {
            Some(a) => Some(algorithm(a.get_ref()).map_err(|m| at(a.span(), m))?),
            None => None,
        },
        key: match &file.defaults.key {
            Some(k) => Some(KeySpec::parse(k.get_ref()).map_err(|e| at_error(&at, k.span(), e))?),
            None => None,
        },
        on_store_error: match &file.defaults.on_store_error {
            Some(f) => Some(failure_mode(f.get_ref()).map_err(|m| at(f.span(), m))?),
            None => None,
        },
    };
    let rule = |def: &Spanned<RuleDef>, places: &mut dyn FnMut(Subject, Range<usize>)| {
        places(Subject::Rule(def.get_ref().name.clone()), def.span());
        rule_of(def, &defaults, &at)
    };

    let mut policy = Policy::new(file.version.get_ref().clone());
    if let Some(default_tier) = &file.default_tier {
        policy = policy.default_tier(default_tier.get_ref().clone());
    }
    for (name, def) in &file.tiers {
        place(Subject::Tier(name.clone()), def.span());
        let mut tier = Tier::new(name.clone());
        for r in &def.get_ref().rules {
            tier = tier.rule(rule(r, &mut place)?);
        }
        for (route, rules) in routes_of(&def.get_ref().routes, |r| rule(r, &mut place))? {
            tier = tier.route(route, rules);
        }
        policy = policy.tier(tier);
    }
    if let Some(def) = &file.all_tiers {
        place(Subject::AllTiers, def.span());
        let mut rules = Vec::with_capacity(def.get_ref().rules.len());
        for r in &def.get_ref().rules {
            rules.push(rule(r, &mut place)?);
        }
        if !rules.is_empty() {
            policy = policy.all_tiers(rules);
        }
        for (route, rules) in routes_of(&def.get_ref().routes, |r| rule(r, &mut place))? {
            policy = policy.all_tiers_route(route, rules);
        }
    }
    for (id, def) in &file.tenants {
        place(Subject::Tenant(id.clone()), def.span());
        let mut tenant = TenantRules::new(id.clone());
        if let Some(tier) = &def.get_ref().tier {
            tenant = tenant.tier(tier.clone());
        }
        for (route, rules) in routes_of(&def.get_ref().routes, |r| rule(r, &mut place))? {
            tenant = tenant.route(route, rules);
        }
        policy = policy.tenant(tenant);
    }
    let listed = |entry: &Spanned<String>| {
        entry
            .get_ref()
            .parse::<Listed>()
            .map_err(|e| at_error(&at, entry.span(), e))
    };
    for entry in &file.lists.allow {
        policy = policy.allow(listed(entry)?);
    }
    for entry in &file.lists.deny {
        policy = policy.deny(listed(entry)?);
    }
    if let Some(region) = &file.region {
        place(Subject::Region, region.span());
        let def = region.get_ref();
        policy = policy.region(Region::new(def.name.clone(), def.share));
    }
    policy.origin = Some(Arc::new(Origin {
        name: origin.to_owned(),
        places,
    }));
    Ok(policy)
}

/// The rules of each route of a tier or a tenant.
fn routes_of(
    routes: &BTreeMap<String, Spanned<RouteDef>>,
    mut rule: impl FnMut(&Spanned<RuleDef>) -> Result<Rule, ConfigError>,
) -> Result<Vec<(String, Vec<Rule>)>, ConfigError> {
    let mut all = Vec::with_capacity(routes.len());
    for (route, def) in routes {
        let rules = def
            .get_ref()
            .rules
            .iter()
            .map(&mut rule)
            .collect::<Result<_, _>>()?;
        all.push((route.clone(), rules));
    }
    Ok(all)
}

/// A [`ConfigError`]'s message, placed at `span`.
fn at_error(
    at: &impl Fn(Range<usize>, String) -> ConfigError,
    span: Range<usize>,
    error: ConfigError,
) -> ConfigError {
    at(span, error.message().to_owned())
}

struct Defaults {
    algorithm: Option<Algorithm>,
    key: Option<KeySpec>,
    on_store_error: Option<FailureMode>,
}

fn rule_of(
    def: &Spanned<RuleDef>,
    defaults: &Defaults,
    at: &impl Fn(Range<usize>, String) -> ConfigError,
) -> Result<Rule, ConfigError> {
    let span = def.span();
    let def = def.get_ref();
    let in_rule =
        |span: Range<usize>, problem: String| at(span, format!("rule \"{}\": {problem}", def.name));
    let period = period(def.per.get_ref()).map_err(|m| in_rule(def.per.span(), m))?;
    let mut quota = Quota::new(def.limit, period);
    if let Some(burst) = def.burst {
        quota = quota.burst(burst);
    }
    let mut rule = Rule::new(def.name.clone(), quota);
    let algorithm_value = match &def.algorithm {
        Some(a) => Some(algorithm(a.get_ref()).map_err(|m| in_rule(a.span(), m))?),
        None => defaults.algorithm,
    };
    if let Some(a) = algorithm_value {
        rule = rule.algorithm(a);
    }
    if let Some(cost) = def.cost {
        rule = rule.cost(cost);
    }
    rule.key_spec = match &def.key {
        Some(k) => Some(
            KeySpec::parse(k.get_ref()).map_err(|e| in_rule(k.span(), e.message().to_owned()))?,
        ),
        None => defaults.key.clone(),
    };
    let failure = match &def.on_store_error {
        Some(f) => Some(failure_mode(f.get_ref()).map_err(|m| in_rule(f.span(), m))?),
        None => defaults.on_store_error,
    };
    if let Some(failure) = failure {
        rule = rule.on_store_error(failure);
    }
    let max_delay = match &def.max_delay {
        Some(d) => Some((
            duration(d.get_ref()).map_err(|m| in_rule(d.span(), m))?,
            d.span(),
        )),
        None => None,
    };
    let mode_span = def.mode.as_ref().map_or(span.clone(), Spanned::span);
    match (def.mode.as_ref().map(|m| m.get_ref().as_str()), max_delay) {
        (Some("delay"), Some((max, _))) => rule = rule.delay(max),
        (Some("delay"), None) => {
            return Err(in_rule(
                mode_span,
                "mode \"delay\" needs max_delay, the longest a request waits (max_delay = \"2s\")"
                    .into(),
            ));
        }
        (None | Some("enforce" | "shadow"), Some((_, delay_span))) => {
            return Err(in_rule(
                delay_span,
                "max_delay is for mode = \"delay\"; remove it or set the mode".into(),
            ));
        }
        (None | Some("enforce"), None) => {}
        (Some("shadow"), None) => rule = rule.shadow(),
        (Some(other), _) => {
            return Err(in_rule(
                mode_span,
                format!("mode {other:?} is not a mode; use \"enforce\", \"shadow\" or \"delay\""),
            ));
        }
    }
    if def.skip_unidentified {
        rule = rule.skip_unidentified();
    }
    match (def.lease, &def.lease_ttl) {
        (Some(units), ttl) => {
            rule = rule.lease(units);
            if let Some(ttl) = ttl {
                rule = rule.lease_ttl(duration(ttl.get_ref()).map_err(|m| in_rule(ttl.span(), m))?);
            }
        }
        (None, Some(ttl)) => {
            return Err(in_rule(
                ttl.span(),
                "lease_ttl is for a leased rule; remove it or add lease = <units>".into(),
            ));
        }
        (None, None) => {}
    }
    if let Some(parts) = def.split {
        rule = rule.split(parts);
    }
    Ok(rule)
}

fn algorithm(name: &str) -> Result<Algorithm, String> {
    Ok(match name {
        "token-bucket" => Algorithm::TokenBucket,
        "gcra" => Algorithm::Gcra,
        "fixed-window" => Algorithm::FixedWindow,
        "sliding-window-log" => Algorithm::SlidingWindowLog,
        "sliding-window-counter" => Algorithm::SlidingWindowCounter,
        "concurrency" => Algorithm::Concurrency,
        _ => {
            return Err(format!(
                "algorithm {name:?} is not one of \"token-bucket\", \"gcra\", \"fixed-window\", \
                 \"sliding-window-log\", \"sliding-window-counter\", \"concurrency\""
            ));
        }
    })
}

fn failure_mode(name: &str) -> Result<FailureMode, String> {
    Ok(match name {
        "open" => FailureMode::Open,
        "closed" => FailureMode::Closed,
        "local" => FailureMode::Local,
        _ => {
            return Err(format!(
                "on_store_error {name:?} is not one of \"open\", \"closed\", \"local\""
            ));
        }
    })
}

/// `second`, `minute`, `hour`, `day`, or a duration (`30s`, `15m`).
fn period(text: &str) -> Result<Duration, String> {
    match text {
        "second" => Ok(Duration::from_secs(1)),
        "minute" => Ok(Duration::from_secs(60)),
        "hour" => Ok(Duration::from_secs(3600)),
        "day" => Ok(Duration::from_secs(86_400)),
        _ => duration(text).map_err(|_| {
            format!(
                "per = {text:?} is not a period; write \"second\", \"minute\", \"hour\", \"day\" \
                 or a duration such as \"30s\", \"15m\", \"2h\", \"7d\""
            )
        }),
    }
}

/// A number and a unit: `250ms`, `30s`, `15m`, `2h`, `7d`.
fn duration(text: &str) -> Result<Duration, String> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let invalid = || {
        format!(
            "{text:?} is not a duration; write a whole number and a unit: \"250ms\", \"30s\", \"15m\", \"2h\", \"7d\""
        )
    };
    let n: u64 = number.parse().map_err(|_| invalid())?;
    let millis = match unit {
        "ms" => Some(n),
        "s" => n.checked_mul(1000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        "d" => n.checked_mul(86_400_000),
        _ => return Err(invalid()),
    }
    .ok_or_else(invalid)?;
    Ok(Duration::from_millis(millis))
}

impl Policy {
    /// Reads a policy written in TOML; `origin` (a file's path) names it in errors, which give
    /// the line and the column and say what to change.
    pub fn from_toml(text: &str, origin: &str) -> Result<Policy, ConfigError> {
        parse(text, origin)
    }

    /// Reads a rules file.
    pub fn from_file(path: impl AsRef<std::path::Path>) -> Result<Policy, ConfigError> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::new(format!("cannot read the rules file {name}: {e}")))?;
        parse(&text, &name)
    }
}
