//! The every-settle-once invariant: each response that changes its charge settled by one call
//! (see the module above for the plans it judges).

use std::collections::BTreeMap;

use super::super::facts::Happened;
use super::super::fleet::Outcome;
use super::super::plan::{Charged, Plan};
use super::super::rules::CHARGED_STATUS;
use super::{SETTLE_LANDS, Violation, trace, troubled};

/// Checks that each response that changes a charge of a rule charged by its response is settled
/// by one call, and that no call settles more (see the module's docs).
pub(super) fn settled_once(plan: &Plan, outcome: &Outcome) -> Option<Violation> {
    if plan.rules.iter().any(|r| r.split.is_some()) {
        return None;
    }
    let troubled = troubled(plan, outcome);
    // Which replica admitted each request: one that has not counted the fleet yet may not
    // have reached Redis, and settles on its fallback.
    let admitted_by: BTreeMap<u64, u32> = outcome
        .facts
        .iter()
        .filter_map(|f| match f.happened {
            Happened::Admitted { replica } => Some((f.request, replica)),
            _ => None,
        })
        .collect();
    let calm = |at: u64, request: u64| {
        let ready = admitted_by
            .get(&request)
            .and_then(|replica| outcome.first_counted.get(replica))
            .is_some_and(|&counted| counted <= at);
        ready
            && !troubled
                .iter()
                .any(|&(from, until)| from.saturating_sub(1_000_000) <= at && at <= until)
    };
    for (index, _) in plan
        .rules
        .iter()
        .enumerate()
        .filter(|(_, r)| r.charged.is_some())
    {
        for key in 0..plan.keys {
            let rule = plan.rule_for(index, key);
            let name = format!("tollgate:{{k{key}}}:{}", rule.name);
            // The responses that change their charge, and whether each must land.
            let asked: Vec<(u64, bool)> = outcome
                .facts
                .iter()
                .filter(|f| f.key == key)
                .filter(|f| match (f.happened, rule.charged) {
                    (Happened::Answered { actual, .. }, Some(Charged::Settle)) => {
                        actual != rule.cost
                    }
                    (Happened::Answered { status, .. }, Some(Charged::OnStatus)) => {
                        status != CHARGED_STATUS
                    }
                    _ => false,
                })
                .map(|f| (f.at, calm(f.at, f.request)))
                .collect();
            let calls: Vec<u64> = outcome
                .audits
                .iter()
                .filter(|a| !a.failed && matches!(a.mode, b'a' | b'r'))
                .filter(|a| a.keys.iter().any(|k| k.key == name.as_bytes()))
                .map(|a| a.at)
                .collect();
            // Each call is the settle of the latest response before it not settled yet (a
            // settle follows its head at once): within SETTLE_LANDS of it, or any time before
            // when the call came while the store could fail (a call held by a server that did
            // not answer lands when it is back). The earliest would pair each call with the one
            // before once a response settled on the fallback, for ever after.
            let mut settled = vec![false; asked.len()];
            for &at in &calls {
                let late = troubled
                    .iter()
                    .any(|&(from, until)| from <= at && at <= until);
                let lands = if late { u64::MAX } else { SETTLE_LANDS };
                let latest = asked.iter().enumerate().rposition(|(i, &(asked_at, _))| {
                    !settled[i] && asked_at <= at && at - asked_at <= lands
                });
                match latest {
                    Some(i) => settled[i] = true,
                    None => {
                        if std::env::var_os("TOLLGATE_SIM_TRACE").is_some() {
                            trace(outcome, key);
                        }
                        return Some(Violation {
                            invariant: "every settle once",
                            detail: format!(
                                "rule {} key k{key}: a settle call at {:.3} s that no response \
                                 asked for ({} responses asked, {} calls)",
                                rule.name,
                                at.saturating_sub(outcome.start) as f64 / 1e6,
                                asked.len(),
                                calls.len()
                            ),
                        });
                    }
                }
            }
            let lost = asked
                .iter()
                .zip(&settled)
                .find(|((_, must), settled)| *must && !**settled);
            if let Some(((at, _), _)) = lost {
                if std::env::var_os("TOLLGATE_SIM_TRACE").is_some() {
                    trace(outcome, key);
                }
                return Some(Violation {
                    invariant: "every settle once",
                    detail: format!(
                        "rule {} key k{key}: the response at {:.3} s was never settled",
                        rule.name,
                        at.saturating_sub(outcome.start) as f64 / 1e6
                    ),
                });
            }
        }
    }
    None
}
