//! [`Report`]: what a replay admitted and denied, in all and by rule, tier, tenant and route.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use http::StatusCode;

use crate::observe::DecisionEvent;

/// Requests counted by what became of them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Counts {
    /// Requests (for a rule: requests it applied to).
    pub requests: u64,
    /// Requests the layer let through to the service.
    pub admitted: u64,
    /// Requests the layer answered itself (429, 403, 503); for a rule: requests it denied.
    pub denied: u64,
    /// Requests admitted though a shadow rule would have denied them (for a rule: that it
    /// would have denied).
    pub shadow_denied: u64,
}

impl Counts {
    /// `denied / requests` (0 without requests).
    pub fn denied_share(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.denied as f64 / self.requests as f64
        }
    }

    fn add(&mut self, admitted: bool, denied: bool, shadow_denied: bool) {
        self.requests += 1;
        self.admitted += u64::from(admitted);
        self.denied += u64::from(denied);
        self.shadow_denied += u64::from(shadow_denied);
    }
}

/// One replayed request and what the layer made of it (kept when
/// [`Replay::keep_decisions`](super::Replay::keep_decisions) is on).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Replayed {
    /// Its place in the traffic, counted from 0.
    pub index: usize,
    /// The line of the file it came from.
    pub line: Option<u64>,
    /// When it was sent, from the first arrival.
    pub at: Duration,
    /// The status it was answered with.
    pub status: StatusCode,
    /// Whether the service was called.
    pub admitted: bool,
    /// The layer's decision: verdict, tier, tenant, route and each rule's outcome.
    pub event: DecisionEvent,
}

/// What a replay admitted and denied.
///
/// Requests without a tenant are not counted by tenant, and those without a route pattern not
/// by route; every request is counted by tier when the layer has a policy, and by each rule
/// that applied to it.
///
/// A shadow rule that would have denied a request is counted under its name only when it was
/// the only rule that denied: when enforced rules applied too, they are checked again without
/// it and the decision names them alone, so the request counts as shadow-denied in all and by
/// tier, tenant and route, not by that rule.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct Report {
    /// Every request.
    pub total: Counts,
    /// By rule name: the requests each rule applied to, and those it denied.
    pub rules: BTreeMap<String, Counts>,
    /// By tier.
    pub tiers: BTreeMap<String, Counts>,
    /// By tenant id.
    pub tenants: BTreeMap<String, Counts>,
    /// By route pattern (`/users/{id}`).
    pub routes: BTreeMap<String, Counts>,
    /// Requests by verdict (`allowed`, `denied`, `shadow_denied`, `listed_denied`...).
    pub verdicts: BTreeMap<&'static str, u64>,
    /// Each request and its decision, in order, when asked for.
    pub decisions: Vec<Replayed>,
    /// Requests of a replay in real time sent more than 5 ms after their time (the store did
    /// not keep up): their decisions may differ from those at their recorded times.
    pub late: u64,
    /// Requests admitted under a [`settle`](crate::Rule::settle) rule without a recorded
    /// [`Arrival::actual_cost`](super::Arrival::actual_cost): charged at the estimate.
    pub at_estimate: u64,
    /// The rules replayed though a replay does not predict them, each with what it is
    /// (`"tokens" (metered)`): empty unless
    /// [`Replay::allow_unpredicted`](super::Replay::allow_unpredicted) let them in.
    pub unpredicted: Vec<String>,
}

impl Report {
    /// A rule's counts (zero if it never applied).
    pub fn rule(&self, name: &str) -> Counts {
        self.rules.get(name).copied().unwrap_or_default()
    }

    /// A tier's counts.
    pub fn tier(&self, name: &str) -> Counts {
        self.tiers.get(name).copied().unwrap_or_default()
    }

    /// A tenant's counts.
    pub fn tenant(&self, id: &str) -> Counts {
        self.tenants.get(id).copied().unwrap_or_default()
    }

    /// A route's counts.
    pub fn route(&self, pattern: &str) -> Counts {
        self.routes.get(pattern).copied().unwrap_or_default()
    }

    /// Counts one request.
    pub(super) fn count(&mut self, event: &DecisionEvent, admitted: bool) {
        let denied = !admitted;
        let shadow = event.verdict == crate::observe::Verdict::ShadowDenied;
        self.total.add(admitted, denied, shadow);
        *self.verdicts.entry(event.verdict.as_str()).or_default() += 1;
        for (map, name) in [
            (&mut self.tiers, &event.tier),
            (&mut self.tenants, &event.tenant),
            (&mut self.routes, &event.route),
        ] {
            if let Some(name) = name {
                counts_of(map, name).add(admitted, denied, shadow);
            }
        }
        for rule in &event.rules {
            let rule_denied = matches!(
                rule.outcome,
                "denied" | "cache_denied" | "local_denied" | "failed_closed"
            );
            counts_of(&mut self.rules, &rule.name).add(
                admitted,
                rule_denied,
                rule.outcome == "shadow_denied",
            );
        }
    }
}

fn counts_of<'a>(map: &'a mut BTreeMap<String, Counts>, name: &str) -> &'a mut Counts {
    if !map.contains_key(name) {
        map.insert(name.to_owned(), Counts::default());
    }
    map.get_mut(name).expect("inserted above")
}

/// A table: the totals, then by tier, route and rule (tenants by number only).
impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn row(f: &mut fmt::Formatter<'_>, name: &str, c: &Counts) -> fmt::Result {
            writeln!(
                f,
                "  {name:<24} {:>10} {:>10} {:>10} {:>8.2}% {:>10}",
                c.requests,
                c.admitted,
                c.denied,
                c.denied_share() * 100.0,
                c.shadow_denied
            )
        }
        writeln!(
            f,
            "  {:<24} {:>10} {:>10} {:>10} {:>9} {:>10}",
            "", "requests", "admitted", "denied", "denied %", "shadow"
        )?;
        row(f, "all", &self.total)?;
        for (title, map) in [
            ("tier", &self.tiers),
            ("route", &self.routes),
            ("rule", &self.rules),
        ] {
            for (name, counts) in map {
                row(f, &format!("{title} {name}"), counts)?;
            }
        }
        let denied = self.tenants.values().filter(|c| c.denied > 0).count();
        writeln!(
            f,
            "  tenants: {}, {denied} of them denied at least once",
            self.tenants.len()
        )?;
        if self.at_estimate > 0 {
            writeln!(
                f,
                "  {} admitted under a settle rule with no recorded cost: charged at the estimate",
                self.at_estimate
            )?;
        }
        if !self.unpredicted.is_empty() {
            writeln!(
                f,
                "  not predicted by a replay: {}",
                self.unpredicted.join(", ")
            )?;
        }
        Ok(())
    }
}
