//! The under-admission invariant: a refusal only while Redis held less than the request needed
//! (see the module above for the bound).

use std::collections::BTreeMap;

use super::super::facts::Happened;
use super::super::fleet::Outcome;
use super::super::plan::{Fault, Kind, Plan, RulePlan};
use super::{ANSWER_SLACK, DENY_CAP, RECOVERY, Violation, trace, troubled};

/// Checks that no request was refused while Redis held every enforcing rule's cost free for
/// its key (see the module's docs for the plans it judges and the refusals it leaves out).
pub(super) fn under_admission(plan: &Plan, outcome: &Outcome) -> Option<Violation> {
    if plan.rules.iter().all(|r| r.shadow) {
        return None;
    }
    let mut troubled = troubled(plan, outcome);
    // Refunds published while the listeners resubscribe are not heard: cached denials end by
    // their cap.
    troubled.extend(plan.faults.iter().filter_map(|(at, fault)| {
        let from = outcome.start + at.as_micros() as u64;
        matches!(fault, Fault::DropSubscriptions).then_some((from, from + DENY_CAP + RECOVERY))
    }));
    // Each store key's calls, in order: their time, the units in use before and after, and the
    // microseconds one unit takes to refill.
    let mut calls: BTreeMap<&[u8], Vec<Call>> = BTreeMap::new();
    for audit in outcome.audits.iter().filter(|a| !a.failed) {
        for key in &audit.keys {
            calls.entry(&key.key).or_default().push(Call {
                at: audit.at,
                before: key.before,
                after: key.after,
                interval: key.descriptor.interval,
                period: key.descriptor.period,
            });
        }
    }
    for fact in &outcome.facts {
        let Happened::Refused { replica } = fact.happened else {
            continue;
        };
        let at = fact.at;
        let in_trouble = troubled
            .iter()
            .any(|&(from, until)| from <= at && at <= until);
        let unready = outcome
            .first_counted
            .get(&replica)
            .is_none_or(|&counted| counted > at);
        if in_trouble || unready {
            continue;
        }
        let enforcing: Vec<RulePlan> = (0..plan.rules.len())
            .map(|index| plan.rule_for(index, fact.key))
            .filter(|r| !r.shadow)
            .collect();
        let free: Vec<(f64, &RulePlan)> = enforcing
            .iter()
            .map(|rule| {
                let from = at
                    .saturating_sub(ANSWER_SLACK + rule.delay.map_or(0, |d| d.as_micros() as u64));
                // The spent sub-key's, for a split key: each holds its share.
                let parts = rule.split.unwrap_or(1);
                let names: Vec<String> = match rule.split {
                    None => vec![format!("tollgate:{{k{}}}:{}", fact.key, rule.name)],
                    Some(parts) => (0..parts)
                        .map(|part| format!("tollgate:{{k{}~{part}}}:{}", fact.key, rule.name))
                        .collect(),
                };
                let used = names
                    .iter()
                    .map(|name| {
                        let calls = calls.get(name.as_bytes()).map_or(&[][..], Vec::as_slice);
                        most_in_use(rule.kind, calls, from, at)
                    })
                    .fold(0.0, f64::max);
                ((rule.burst() / u64::from(parts)) as f64 - used, rule)
            })
            .collect();
        // The replicas alive: each may hold a lease's units.
        let alive = outcome
            .lives
            .values()
            .filter(|(from, until)| *from <= at && at < *until)
            .count() as u64;
        let admissible = free.iter().all(|(free, rule)| {
            let rounding = match rule.kind {
                Kind::TokenBucket | Kind::Gcra => 1.0,
                _ => 0.0,
            };
            // The docs' "(n − 1) units per replica holding some": units a lease gave back
            // while the other replicas' denials stay cached.
            let leased = rule.lease.map_or(0, |n| (n - 1) * alive);
            // A metered request starts with what one check said was left, when that is less
            // than a chunk: another request may take part of it before that is checked, so
            // it may be refused with up to a chunk less one left (the bound `Rule::meter`
            // states).
            let needed = match (rule.kind, rule.meter) {
                (Kind::Concurrency, _) => 1,
                (_, Some((chunk, _))) => chunk,
                _ => rule.cost,
            };
            *free >= (needed + leased) as f64 + rounding
        });
        if admissible {
            if std::env::var_os("TOLLGATE_SIM_TRACE").is_some() {
                trace(outcome, fact.key);
            }
            let free: Vec<String> = free
                .iter()
                .map(|(free, rule)| {
                    format!(
                        "{} ({:?}, {} per {:?}, burst {}, cost {}) {free:.1} free",
                        rule.name,
                        rule.kind,
                        rule.limit,
                        rule.period,
                        rule.burst(),
                        rule.cost
                    )
                })
                .collect();
            return Some(Violation {
                invariant: "under-admission",
                detail: format!(
                    "request r{} of key k{} refused by replica {replica} at {:.3} s, though Redis \
                     held for the {} ms before it: {}",
                    fact.request,
                    fact.key,
                    (at - outcome.start) as f64 / 1e6,
                    ANSWER_SLACK / 1000,
                    free.join("; "),
                ),
            });
        }
    }
    None
}

/// Holds one call's effect on one key, for [`under_admission`].
#[derive(Clone, Copy, Debug)]
struct Call {
    at: u64,
    before: f64,
    after: f64,
    /// The microseconds one unit takes to refill (a token bucket's or GCRA's).
    interval: u64,
    /// The rule's period (a window's, a log's, a slot's hold).
    period: u64,
}

/// Finds the most units in use on a key of algorithm `kind` from `from` to `to`, by its `calls` (in
/// order): what the last call before `from` left, refilled (a bucket) or expired (a window, a
/// log, a slot's hold) by `from` — for a sliding counter or log, at most what it left — and
/// what each call within the span found and left.
fn most_in_use(kind: Kind, calls: &[Call], from: u64, to: u64) -> f64 {
    let mut most = match calls.iter().rev().find(|c| c.at < from) {
        Some(call) => {
            let period = call.period.max(1);
            let windows = from / period - call.at / period;
            match kind {
                Kind::TokenBucket | Kind::Gcra => {
                    (call.after - (from - call.at) as f64 / call.interval.max(1) as f64).max(0.0)
                }
                Kind::FixedWindow if windows == 0 => call.after,
                Kind::SlidingWindowCounter if windows <= 1 => call.after,
                Kind::SlidingWindowLog | Kind::Concurrency if from - call.at < period => call.after,
                _ => 0.0,
            }
        }
        None => 0.0,
    };
    for call in calls.iter().filter(|c| (from..=to).contains(&c.at)) {
        most = most.max(call.before).max(call.after);
    }
    most
}
