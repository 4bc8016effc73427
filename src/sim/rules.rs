//! The layer's rules for a plan: each [`RulePlan`] as a [`Rule`], and the plan's rules as a
//! policy of two tiers, in the version a reload asks for.

use http::HeaderName;

use super::plan::{Charged, Kind, Metered, OnError, Plan, PolicyPlan, RulePlan};
use crate::algorithm::kind::Algorithm;
use crate::key::FromHeader;
use crate::policy::{Policy, TenantRules, Tier};
use crate::{FailureMode, Quota, Rule};

/// The trailer by which the handler reports its units.
pub(crate) const USAGE: &str = "x-usage-tokens";

/// Names the header a handler reports a request's real cost in, for the rules that settle by
/// it.
pub(crate) const ACTUAL: &str = "x-actual-cost";

/// Names the status that the rules charging by status charge.
pub(crate) const CHARGED_STATUS: u16 = 401;

/// Builds version `version` of the policy of `plan`: a `base` tier with the plan's rules (the
/// default), a `gold` tier with their gold forms for the tenants the plan names, the rules in
/// the plan's order in even versions and reversed in odd ones.
pub(crate) fn policy(plan: &Plan, tiers: &PolicyPlan, version: u32) -> Policy {
    let mut rules = plan.rules.clone();
    if version % 2 == 1 {
        rules.reverse();
    }
    let mut policy = Policy::new(format!("v{version}"))
        .tier(Tier::new("base").rules(rules.iter().map(rule)))
        .tier(Tier::new("gold").rules(rules.iter().map(|r| rule(&r.gold()))))
        .default_tier("base");
    for key in &tiers.gold {
        policy = policy.tenant(TenantRules::new(format!("t{key}")).tier("gold"));
    }
    policy
}

/// The layer's rule for `plan`.
pub(crate) fn rule(plan: &RulePlan) -> Rule {
    let mut quota = Quota::new(plan.limit, plan.period);
    if let Some(burst) = plan.burst {
        quota = quota.burst(burst);
    }
    let algorithm = match plan.kind {
        Kind::TokenBucket => Algorithm::TokenBucket,
        Kind::Gcra => Algorithm::Gcra,
        Kind::FixedWindow => Algorithm::FixedWindow,
        Kind::SlidingWindowCounter => Algorithm::SlidingWindowCounter,
        Kind::SlidingWindowLog => Algorithm::SlidingWindowLog,
        Kind::Concurrency => Algorithm::Concurrency,
    };
    let mut rule = match plan.kind {
        Kind::Concurrency => Rule::concurrent(plan.name.clone(), plan.limit),
        _ => Rule::new(plan.name.clone(), quota).algorithm(algorithm),
    }
    .key(FromHeader::new("x-key"))
    .on_store_error(match plan.on_error {
        OnError::Open => FailureMode::Open,
        OnError::Closed => FailureMode::Closed,
        OnError::Local => FailureMode::Local,
    });
    if plan.cost > 1 {
        rule = rule.cost(plan.cost);
    }
    if let Some(units) = plan.lease {
        rule = rule.lease(units);
    }
    if let Some(parts) = plan.split {
        rule = rule.split(parts);
    }
    if let Some((chunk, how)) = plan.meter {
        rule = rule.meter(chunk);
        rule = match how {
            Metered::Spends => rule,
            Metered::Frames => rule.meter_frames(|frame: &[u8]| {
                frame.windows(6).filter(|w| w == b"data: ").count() as u64
            }),
            Metered::Trailer => rule.meter_usage_trailer(HeaderName::from_static(USAGE)),
        };
    }
    if plan.shadow {
        rule = rule.shadow();
    }
    if let Some(max) = plan.delay {
        rule = rule.delay(max);
    }
    match plan.charged {
        Some(Charged::Settle) => rule = rule.settle_from_header(HeaderName::from_static(ACTUAL)),
        Some(Charged::OnStatus) => rule = rule.charge_on_status([CHARGED_STATUS]),
        None => {}
    }
    rule
}
