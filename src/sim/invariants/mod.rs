//! The guarantees of tollgate, written once: each invariant judges an [`Outcome`] by its
//! [`Plan`], with the bound the docs state for each mechanism in play.
//!
//! - **Budget** (per rule and key, from the run's start to each moment): the units the fleet
//!   admitted (a request's cost) or delivered (a metered rule's units, as the clients read
//!   them) are at most what the algorithm allows over that span (below, [`allowance`]), plus:
//!   - **the local fallback** (`FailureMode::Local`, [`FallbackShare`](crate::FallbackShare)):
//!     each replica's own allowance at its share — the quota and burst divided by the fewest
//!     replicas it counted (by `until_counted` when it fell back before counting), at least 1
//!     unit — over its life; a request that costs more than a share is admitted only when the
//!     share is whole, as a debt: one such request per window (or per burst refilled);
//!     only while the store can fail (a fault, and 10 s after it);
//!   - **a node restarted without its data**: the state it lost, a burst per restart;
//!   - **frames** (`meter_frames`): the frame that crosses the budget, one unit per stream;
//!   - **usage trailers** (`meter_usage_trailer`): a stream's units past its first chunk until
//!     its trailer is settled (two seconds after its end), for good when it ends without one
//!     (the chunks it took are its charge; the first is what was left when that was less);
//!     once settled, those units are a debt: a token bucket or GCRA repays it at the rule's
//!     rate, a window or log keeps it (the window it was charged in ends past its limit);
//!   - **settled costs** (`settle`): a request's real cost past its estimate until its settle
//!     lands (two seconds after its head), then a debt as a trailer's; for good when the
//!     settle's store call can fail (a fault, and 10 s after it): the estimate stays charged;
//!   - **responses not charged** (`charge_when`): nothing (only the responses of the charged
//!     status are budget; the others' units come back);
//!   - **leases and split keys**: nothing (every unit is charged to Redis before it is spent,
//!     and the sub-keys' shares add up to at most the quota);
//!   - rules that fail open, and shadow rules, have no budget.
//! - **Slots**: a concurrency rule's requests in flight per key are at most its slots (plus
//!   the fallback's shares of them, as above).
//! - **Under-admission** (the deny cache's "may refuse early by: nothing", [`crate::store`]):
//!   a `429` comes only when some enforcing rule's key, in Redis, held less than what the
//!   request needed free (its cost; a slot; a metered rule's chunk, as its docs say) at a moment of the
//!   [`ANSWER_SLACK`] before it (a delay rule's: its longest wait more; a bucket's rounding: one
//!   unit more). A split key's sub-keys each hold their share, and the refusal is the spent
//!   sub-key's; a leased rule may refuse early by `n − 1` units per replica alive, as the
//!   docs' table of precision says (units given back while denials stay cached). Refusals
//!   while the store can fail (as above), and a replica's before it first counted the fleet
//!   (it may not have reached Redis), are its `FailureMode`'s; a refusal within the cap of a
//!   cached denial ([`DENY_CAP`]) after the subscriptions drop may answer a denial whose
//!   refund went unheard, as the docs say.
//! - **Every settle once** (per rule charged by its response, and key): each response that
//!   changes its charge (a real cost other than the estimate, a status not charged) is
//!   settled in Redis by one call made within [`SETTLE_LANDS`] of its head (or later, while
//!   the store can fail: a call a server held lands when it is back), and no call settles
//!   what no response asked. Responses within a second before a span when the store can
//!   fail, or in it, may be settled on the fallback or not at all (the estimate stays, as the
//!   docs say); plans with split keys are left out (their cross-slot give-backs are calls of
//!   the same kind).
//! - **No refund beyond a charge** (per store key): what was given back (compensations,
//!   settles down, slots released) never exceeds what was charged, so no charge is given back
//!   twice and none that never landed.
//! - **No panic**, **no script error**, **every request answered** within 75 s.

use std::collections::{BTreeMap, VecDeque};

use super::facts::Happened;
use super::fleet::Outcome;
use std::time::Duration;

use super::plan::{Charged, Fault, Kind, Metered, OnError, Plan, RulePlan};
use super::rules::CHARGED_STATUS;
use refusals::under_admission;
use settles::settled_once;

mod refusals;
mod settles;

/// How long after its stream's end a trailer's settle is given to land (microseconds).
const SETTLE_LANDS: u64 = 2_000_000;

/// How long after a fault a replica may still fall back (microseconds): the breaker's
/// probe, and calls that started before the fault's end.
const RECOVERY: u64 = 10_000_000;

/// How long a replica may take to count the fleet after it starts before the fallback is
/// taken to have used `until_counted` (microseconds).
const FIRST_COUNT: u64 = 1_000_000;

/// Bounds how long before a refusal the key's state in Redis may justify it (microseconds): on a
/// calm network, an answer's way back (a cached denial's retry-after is counted from its
/// arrival), a refund elsewhere heard (its answer, its `PUBLISH`, the push), a millisecond each, and
/// the timer's millisecond, with room to spare.
const ANSWER_SLACK: u64 = 5_000;

/// Caps how long a cached denial lives (`deny_cache_max_age`'s default, microseconds).
const DENY_CAP: u64 = 5_000_000;

/// An invariant that did not hold.
#[derive(Clone, Debug)]
pub(crate) struct Violation {
    /// The invariant's name.
    pub(crate) invariant: &'static str,
    pub(crate) detail: String,
}

/// Checks every invariant of `outcome`: the violations, first of each.
pub(crate) fn check(plan: &Plan, outcome: &Outcome) -> Vec<Violation> {
    let mut violations = Vec::new();
    if let Some(panic) = outcome.panics.first() {
        violations.push(Violation {
            invariant: "no panic",
            detail: panic.clone(),
        });
    }
    if let Some(error) = outcome.script_errors.first() {
        violations.push(Violation {
            invariant: "no script error",
            detail: error.clone(),
        });
    }
    if outcome.stuck > 0 {
        violations.push(Violation {
            invariant: "every request answered",
            detail: format!("{} requests waited more than 75 s", outcome.stuck),
        });
    }
    if let Some(violation) = refunds(outcome) {
        violations.push(violation);
    }
    if let Some(violation) = under_admission(plan, outcome) {
        violations.push(violation);
    }
    if let Some(violation) = settled_once(plan, outcome) {
        violations.push(violation);
    }
    for (index, rule) in plan.rules.iter().enumerate() {
        if rule.shadow || rule.on_error == OnError::Open {
            continue;
        }
        for key in 0..plan.keys {
            let found = match rule.kind {
                Kind::Concurrency => slots(plan, outcome, &plan.rule_for(index, key), key),
                _ => budget(plan, outcome, index, key),
            };
            if let Some(violation) = found {
                violations.push(violation);
                break;
            }
        }
    }
    violations
}

/// The units `kind` allows from `from` to `to` (microseconds) at `limit` per `period` with
/// `burst`: a token bucket or GCRA its burst and its rate over the span; a fixed window or a
/// sliding counter (whose aligned window never counts more than the limit) the limit for each
/// window the span touches; a sliding log the limit for each period the span covers.
pub(crate) fn allowance(
    kind: Kind,
    limit: u64,
    burst: u64,
    period: u64,
    from: u64,
    to: u64,
) -> f64 {
    let span = to.saturating_sub(from);
    match kind {
        Kind::TokenBucket | Kind::Gcra => burst as f64 + limit as f64 * span as f64 / period as f64,
        Kind::FixedWindow | Kind::SlidingWindowCounter => {
            (limit * (to / period - from / period + 1)) as f64
        }
        Kind::SlidingWindowLog | Kind::Concurrency => (limit * (span / period + 1)) as f64,
    }
}

/// The share of `units` a replica that counted `replicas` takes: at least one unit.
fn share(units: u64, replicas: u32) -> u64 {
    (units / u64::from(replicas.max(1))).max(1)
}

/// The replicas each replica's fallback divides by, by the docs: the fewest it counted, or
/// `until_counted` when it could have fallen back before it counted.
fn divisors(plan: &Plan, outcome: &Outcome) -> BTreeMap<u32, (u64, u64, u32)> {
    outcome
        .lives
        .iter()
        .map(|(id, &(from, until))| {
            let counted = outcome.counted.get(id).copied().flatten();
            let first = outcome.first_counted.get(id).copied();
            let late = first.is_none_or(|at| at > from + FIRST_COUNT);
            let replicas = match (counted, late) {
                (Some(count), false) => count,
                (Some(count), true) => count.min(plan.until_counted),
                (None, _) => plan.until_counted,
            };
            (*id, (from, until.min(outcome.end), replicas.max(1)))
        })
        .collect()
}

/// The spans (server times) when the store may fail a replica: each fault that can fail a
/// call, from its start to [`RECOVERY`] past its end (the breaker's probe, the connections
/// made again).
pub(crate) fn troubled(plan: &Plan, outcome: &Outcome) -> Vec<(u64, u64)> {
    let start = outcome.start;
    let mut spans: Vec<(u64, u64)> = plan
        .faults
        .iter()
        .filter_map(|(at, fault)| {
            let lasting = match fault {
                Fault::Outage { lasting, .. } | Fault::Weather { lasting, .. } => *lasting,
                Fault::Restart { .. } | Fault::DropConnections | Fault::Migrate { .. } => {
                    Duration::ZERO
                }
                Fault::DropSubscriptions
                | Fault::Reload
                | Fault::Crash { .. }
                | Fault::Leave { .. }
                | Fault::Join { .. } => {
                    return None;
                }
            };
            let from = start + at.as_micros() as u64;
            Some((from, from + lasting.as_micros() as u64 + RECOVERY))
        })
        .collect();
    spans.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (from, until) in spans {
        match merged.last_mut() {
            Some(last) if from <= last.1 => last.1 = last.1.max(until),
            _ => merged.push((from, until)),
        }
    }
    merged
}

/// The units of what the fallback allows the fleet by `at`: each replica's allowance at its
/// share over each troubled span of its life (its local budget starts full in each).
fn fallback(
    rule: &RulePlan,
    divisors: &BTreeMap<u32, (u64, u64, u32)>,
    troubled: &[(u64, u64)],
    at: u64,
) -> f64 {
    let period = rule.period.as_micros() as u64;
    let costliest = rule.meter.map_or(rule.cost, |(chunk, _)| chunk).max(1);
    let mut units = 0.0;
    for &(from, until, replicas) in divisors.values() {
        let limit = share(rule.limit, replicas).max(costliest);
        let burst = share(rule.burst(), replicas).max(costliest);
        for &(trouble, calm) in troubled {
            let begin = from.max(trouble);
            let end = until.min(calm).min(at);
            if begin <= end {
                // The replica's clock is off the servers' by its skew: a window more.
                units += allowance(
                    rule.kind,
                    limit,
                    burst,
                    period,
                    begin.saturating_sub(period),
                    end,
                );
            }
        }
    }
    units
}

/// Checks the budget of `rule` for `key`.
fn budget(plan: &Plan, outcome: &Outcome, index: usize, key: u32) -> Option<Violation> {
    let rule = &plan.rule_for(index, key);
    let period = rule.period.as_micros() as u64;
    let divisors = divisors(plan, outcome);
    let troubled = troubled(plan, outcome);
    let wipe = match rule.kind {
        Kind::TokenBucket | Kind::Gcra => rule.burst(),
        _ => rule.limit,
    } as f64;
    let chunk = rule.meter.map_or(0, |(chunk, _)| chunk);
    let how = rule.meter.map(|(_, how)| how);
    let mut delivered = 0u64;
    let mut streams = 0u64;
    // Usage-trailer streams: units read, whether their trailer was sent, their first chunk.
    let mut open: BTreeMap<u64, (u64, bool, u64)> = BTreeMap::new();
    let mut unsettled = 0u64;
    let mut landing: VecDeque<(u64, u64)> = VecDeque::new();
    // Settled trailers' units past the budget, and when it was last repaid.
    let mut debt = Debt::new(rule);
    for fact in outcome.facts.iter().filter(|f| f.key == key) {
        while landing.front().is_some_and(|(at, _)| *at <= fact.at) {
            let (at, excess) = landing.pop_front().expect("a settle");
            unsettled -= excess;
            debt.add(at, excess);
        }
        match fact.happened {
            Happened::Admitted { .. } => {
                if rule.charged.is_some() {
                    // Counted when the response says what it cost.
                } else if rule.meter.is_none() {
                    delivered += rule.cost;
                } else {
                    streams += 1;
                    if how == Some(Metered::Trailer) {
                        open.insert(fact.request, (0, false, chunk));
                    }
                }
            }
            Happened::Unit => {
                if rule.meter.is_none() {
                    continue;
                }
                delivered += 1;
                if let Some((units, _, taken)) = open.get_mut(&fact.request) {
                    *units += 1;
                    if *units > *taken {
                        unsettled += 1;
                    }
                }
            }
            Happened::Reported => {
                if let Some((_, reported, _)) = open.get_mut(&fact.request) {
                    *reported = true;
                }
            }
            Happened::Granted {
                rule: granted,
                units,
            } => {
                // The first chunk may have been what was left, less than a chunk.
                if usize::from(granted) == index
                    && let Some((read, _, taken)) = open.get_mut(&fact.request)
                {
                    unsettled += (*read).min(*taken).saturating_sub(units);
                    *taken = units;
                }
            }
            Happened::Refused { .. } => {}
            Happened::Answered { status, actual } => match rule.charged {
                Some(Charged::Settle) => {
                    delivered += actual;
                    let excess = actual.saturating_sub(rule.cost);
                    unsettled += excess;
                    // A settle the store fails keeps the estimate: its excess is never charged.
                    let failed = troubled
                        .iter()
                        .any(|&(from, until)| from <= fact.at && fact.at <= until);
                    if excess > 0 && !failed {
                        landing.push_back((fact.at + SETTLE_LANDS, excess));
                    }
                }
                Some(Charged::OnStatus) if status == CHARGED_STATUS => delivered += rule.cost,
                Some(Charged::OnStatus) | None => {}
            },
            Happened::Released => {
                if let Some((units, true, taken)) = open.remove(&fact.request) {
                    landing.push_back((fact.at + SETTLE_LANDS, units.saturating_sub(taken)));
                }
            }
        }
        if !matches!(
            fact.happened,
            Happened::Admitted { .. } | Happened::Unit | Happened::Answered { .. }
        ) {
            continue;
        }
        let at = fact.at;
        let own = allowance(
            rule.kind,
            rule.limit,
            rule.burst(),
            period,
            outcome.start,
            at,
        );
        let local = if rule.on_error == OnError::Local {
            fallback(rule, &divisors, &troubled, at)
        } else {
            0.0
        };
        let wiped = outcome.wiped.iter().filter(|w| **w <= at).count() as f64 * wipe;
        let frames = if how == Some(Metered::Frames) {
            streams as f64
        } else {
            0.0
        };
        // The bucket's arithmetic rounds to whole microseconds and units: one unit.
        let rounding = match rule.kind {
            Kind::TokenBucket | Kind::Gcra => 1.0,
            _ => 0.0,
        };
        let owed = debt.at(at);
        let bound = own + local + wiped + frames + unsettled as f64 + owed + rounding;
        if delivered as f64 > bound {
            if std::env::var_os("TOLLGATE_SIM_TRACE").is_some() {
                trace(outcome, key);
            }
            return Some(Violation {
                invariant: "budget",
                detail: format!(
                    "rule {} ({:?}, {} per {:?}, burst {}, cost {}, meter {:?}, on error {:?}) key k{key}: \
                     {delivered} units by {:.3} s, bound {bound:.0} = algorithm {own:.0} + fallback {local:.0} \
                     + wiped {wiped:.0} + frames {frames:.0} + trailers unsettled {unsettled} + debt {owed:.0}",
                    rule.name,
                    rule.kind,
                    rule.limit,
                    rule.period,
                    rule.burst(),
                    rule.cost,
                    rule.meter,
                    rule.on_error,
                    (at - outcome.start) as f64 / 1e6,
                ),
            });
        }
    }
    None
}

/// Checks that no key was given back more than it was charged: at every call, the units a
/// key was refunded so far (cross-slot compensations, settles down, released slots, counted as
/// asked) are at most the units charged to it so far (what checks took, as the key's state
/// shows, and settles up). A charge given back twice, or one that never reached the server,
/// breaks it. Lease give-backs are left out on both sides (their units are within the call).
fn refunds(outcome: &Outcome) -> Option<Violation> {
    let mut keys: BTreeMap<&[u8], (f64, f64)> = BTreeMap::new();
    for audit in outcome.audits.iter().filter(|a| !a.failed) {
        for key in &audit.keys {
            let (charged, refunded) = keys.entry(&key.key).or_default();
            let d = &key.descriptor;
            match audit.mode {
                b'p' | b'x' => {}
                b'r' => *refunded += d.cost as f64,
                b'a' if d.lease == 1 => *charged += d.cost as f64,
                b'a' => *refunded += d.cost as f64,
                _ => *charged += (key.after - key.before).max(0.0),
            }
            // A refund may find the units already refilled: a fraction of a unit of rounding.
            if *refunded > *charged + 0.5 {
                return Some(Violation {
                    invariant: "no refund beyond a charge",
                    detail: format!(
                        "key {} ({}): {refunded:.0} units refunded by {:.3} s, {charged:.1} charged",
                        String::from_utf8_lossy(&key.key),
                        d.algorithm,
                        audit.at.saturating_sub(outcome.start) as f64 / 1e6,
                    ),
                });
            }
        }
    }
    None
}

/// The units settled trailers charged past a rule's budget: a token bucket or GCRA repays
/// them at the rule's rate (its state holds them past the burst, and refills while it does); a
/// window or log keeps them (each is counted in the window it was charged in).
struct Debt {
    /// Units repaid per microsecond.
    rate: f64,
    units: f64,
    since: u64,
}

impl Debt {
    fn new(rule: &RulePlan) -> Debt {
        let rate = match rule.kind {
            Kind::TokenBucket | Kind::Gcra => {
                rule.limit as f64 / rule.period.as_micros().max(1) as f64
            }
            _ => 0.0,
        };
        Debt {
            rate,
            units: 0.0,
            since: 0,
        }
    }

    /// Adds `units` owed from `at` on.
    fn add(&mut self, at: u64, units: u64) {
        self.units = self.at(at) + units as f64;
        self.since = at;
    }

    /// The units still owed at `at`.
    fn at(&self, at: u64) -> f64 {
        (self.units - self.rate * at.saturating_sub(self.since) as f64).max(0.0)
    }
}

/// Checks the slots of concurrency rule `rule` for `key`.
fn slots(plan: &Plan, outcome: &Outcome, rule: &RulePlan, key: u32) -> Option<Violation> {
    let divisors = divisors(plan, outcome);
    let mut in_flight: BTreeMap<u64, ()> = BTreeMap::new();
    for fact in outcome.facts.iter().filter(|f| f.key == key) {
        match fact.happened {
            Happened::Admitted { .. } => {
                in_flight.insert(fact.request, ());
            }
            Happened::Released => {
                in_flight.remove(&fact.request);
                continue;
            }
            _ => continue,
        }
        let local: u64 = if rule.on_error == OnError::Local {
            divisors
                .values()
                .filter(|(from, _, _)| *from <= fact.at)
                .map(|&(_, _, replicas)| share(rule.limit, replicas))
                .sum()
        } else {
            0
        };
        let bound = rule.limit + local;
        if in_flight.len() as u64 > bound {
            return Some(Violation {
                invariant: "slots",
                detail: format!(
                    "rule {} ({} slots, on error {:?}) key k{key}: {} in flight at {:.3} s, bound {bound}",
                    rule.name,
                    rule.limit,
                    rule.on_error,
                    in_flight.len(),
                    (fact.at - outcome.start) as f64 / 1e6
                ),
            });
        }
    }
    None
}

/// Prints the facts of `key` and every audited call, for a person reading a failure.
fn trace(outcome: &Outcome, key: u32) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    let mut first = false;
    ONCE.call_once(|| first = true);
    if !first {
        return;
    }
    for fact in outcome.facts.iter().filter(|f| f.key == key) {
        eprintln!(
            "{:>12} r{} {:?}",
            fact.at - outcome.start,
            fact.request,
            fact.happened
        );
    }
    for (at, event) in &outcome.events {
        eprintln!("{:>12} network: {event}", at.saturating_sub(outcome.start));
    }
    for audit in &outcome.audits {
        for k in &audit.keys {
            eprintln!(
                "{:>12} call {} node {} {} {:?} {:.2} -> {:.2}{}",
                audit.at.saturating_sub(outcome.start),
                char::from(audit.mode),
                audit.node,
                String::from_utf8_lossy(&k.key),
                k.descriptor,
                k.before,
                k.after,
                if audit.failed { " failed" } else { "" }
            );
        }
    }
}

#[cfg(test)]
mod tests;
