//! The metrics, through the `metrics` facade (feature `metrics`).

use metrics::Label;

use crate::telemetry::{Metric, OutcomeLabel, Slot, add, count, label, recorder};

use super::{Decided, rule_outcome};

/// `labels`, and the layer's name when it has one.
fn with_layer(snapshot: &crate::policy::snapshot::Snapshot, mut labels: Vec<Label>) -> Vec<Label> {
    if let Some(name) = &snapshot.layer_name {
        labels.push(label("layer", name));
    }
    labels
}

/// A decided request.
pub(crate) fn decided(decided: &Decided<'_>, route: &str, tier: u16) {
    let snapshot = decided.snapshot;
    let recorder = recorder();
    let route_at = (route.as_ptr() as usize, route.len());
    let tier_name = || &**snapshot.resolver.tier_name(tier);
    let outcome = decided.verdict.as_str();
    count(
        Slot {
            recorder,
            snapshot: snapshot.id,
            metric: Metric::Requests,
            rule: 0,
            tier,
            outcome: OutcomeLabel(outcome),
            route: route_at,
        },
        route,
        || {
            (
                "tollgate_requests_total",
                with_layer(
                    snapshot,
                    vec![
                        label("route", route),
                        label("tier", tier_name()),
                        Label::from_static_parts("outcome", outcome),
                    ],
                ),
            )
        },
    );
    let outcomes = decided.decision.map(|d| d.outcomes());
    for (n, &i) in decided.applied.iter().enumerate() {
        let rule = &snapshot.rules[usize::from(i)];
        let allowed = outcomes.and_then(|o| o.get(n)).map(|o| o.allowed);
        rule_decision(
            snapshot,
            recorder,
            i,
            route,
            tier,
            rule_outcome(decided.verdict, rule.mode, rule.on_store_error, allowed),
        );
    }
}

fn rule_decision(
    snapshot: &crate::policy::snapshot::Snapshot,
    recorder: usize,
    rule: u16,
    route: &str,
    tier: u16,
    outcome: &'static str,
) {
    count(
        Slot {
            recorder,
            snapshot: snapshot.id,
            metric: Metric::RuleDecisions,
            rule,
            tier,
            outcome: OutcomeLabel(outcome),
            route: (route.as_ptr() as usize, route.len()),
        },
        route,
        || {
            (
                "tollgate_rule_decisions_total",
                with_layer(
                    snapshot,
                    vec![
                        label("rule", snapshot.rules[usize::from(rule)].spec.name()),
                        label("route", route),
                        label("tier", snapshot.resolver.tier_name(tier)),
                        Label::from_static_parts("outcome", outcome),
                    ],
                ),
            )
        },
    );
}

/// Shadow rules that would have denied an admitted request.
pub(crate) fn shadowed(
    snapshot: &crate::policy::snapshot::Snapshot,
    rules: &[u16],
    route: &str,
    tier: u16,
) {
    let recorder = recorder();
    for &i in rules {
        rule_decision(snapshot, recorder, i, route, tier, "shadow_denied");
    }
}

/// What a metered response's units did, for [`metered_units`].
#[derive(Clone, Copy)]
pub(crate) enum MeteredUnits {
    /// Granted by the store (a chunk).
    Granted,
    /// Charged when the response settled.
    Spent,
}

/// `units` of metered `rule`, granted or spent by a response of `tier`.
pub(crate) fn metered_units(
    snapshot: &crate::policy::snapshot::Snapshot,
    rule: u16,
    tier: u16,
    what: MeteredUnits,
    units: u64,
) {
    if units == 0 {
        return;
    }
    let (metric, name) = match what {
        MeteredUnits::Granted => (
            Metric::MeteredGranted,
            "tollgate_metered_units_granted_total",
        ),
        MeteredUnits::Spent => (Metric::MeteredSpent, "tollgate_metered_units_spent_total"),
    };
    add(
        metered_slot(snapshot, metric, rule, tier, ""),
        "",
        || (name, metered_labels(snapshot, rule, tier, None)),
        units,
    );
}

/// A metered response of `tier` ended early by `rule`, for `reason`: `budget` or `store_error`.
pub(crate) fn metered_ended(
    snapshot: &crate::policy::snapshot::Snapshot,
    rule: u16,
    tier: u16,
    reason: &'static str,
) {
    count(
        metered_slot(snapshot, Metric::MeteredEnded, rule, tier, reason),
        "",
        || {
            (
                "tollgate_metered_streams_ended_total",
                metered_labels(snapshot, rule, tier, Some(reason)),
            )
        },
    );
}

fn metered_slot(
    snapshot: &crate::policy::snapshot::Snapshot,
    metric: Metric,
    rule: u16,
    tier: u16,
    outcome: &'static str,
) -> Slot {
    Slot {
        recorder: recorder(),
        snapshot: snapshot.id,
        metric,
        rule,
        tier,
        outcome: OutcomeLabel(outcome),
        route: (0, 0),
    }
}

fn metered_labels(
    snapshot: &crate::policy::snapshot::Snapshot,
    rule: u16,
    tier: u16,
    reason: Option<&'static str>,
) -> Vec<Label> {
    let mut labels = vec![
        label("rule", snapshot.rules[usize::from(rule)].spec.name()),
        label("tier", snapshot.resolver.tier_name(tier)),
    ];
    if let Some(reason) = reason {
        labels.push(Label::from_static_parts("reason", reason));
    }
    with_layer(snapshot, labels)
}
