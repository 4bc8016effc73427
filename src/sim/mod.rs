//! The fleet simulation: K replicas of a real [`RateLimitLayer`](crate::RateLimitLayer), each
//! with the Redis store's own replica logic, over a simulated network of servers that run
//! tollgate's real Lua in an embedded Lua 5.1 (as Redis does), on one thread and a paused
//! clock, from a seed: the plan ([`plan`]) chooses the topology, rules, replicas, clients and
//! faults; the fleet ([`fleet`]) runs it; the invariants ([`invariants`]) judge it.
//!
//! `cargo test --lib sim` runs the regression seeds and [`CI_SEEDS`] new ones; more with
//! `TOLLGATE_SIM_SEEDS=<count>` (from `TOLLGATE_SIM_FIRST=<seed>`), or for as long as asked
//! with `TOLLGATE_SIM_SECONDS=<seconds>`. One seed alone: `TOLLGATE_SIM_SEED=<seed>`. A run
//! that fails prints its seed, the violations, and its plan shrunk to what still fails.
mod audit;
mod facts;
mod fleet;
mod handler;
mod invariants;
mod network;
mod plan;
mod rng;
mod rules;
mod server;
mod time;

use std::time::{Duration, Instant};

use invariants::{Violation, check};
use plan::Plan;

/// The seeds run by every `cargo test`, beyond the regressions.
const CI_SEEDS: u64 = 40;

/// Seeds that once failed, kept: each found a defect, now fixed.
const REGRESSIONS: &[u64] = &[
    // The local fallback checked a charge costlier than the share at the whole rule (a
    // sliding log, cost 36 of 183 a minute, 8 replicas): budget.
    13,
    // The local fallback took a metered chunk (87) at the whole rule and gave units back at
    // the share's limits, refilling it (a token bucket of 348 a minute, 6 replicas): budget.
    66,
    // Streams metered by their usage trailer, left by their clients or ended without it,
    // were charged nothing (fixed window, sliding counter, token bucket): budget.
    57, 73, 89, 97, 115, 120, 131, 17,
];

/// Runs `plan`: the violations, and a line of what it did.
fn judge(plan: &Plan) -> (Vec<Violation>, String) {
    let outcome = fleet::run(plan);
    if let Some(refused) = &outcome.refused {
        return (
            Vec::new(),
            format!("seed {}: rules refused ({refused})", plan.seed),
        );
    }
    let line = format!(
        "seed {}: {} replicas{}{}, {:?}, {} requests {:?}",
        plan.seed,
        plan.replicas,
        if plan.cluster { " (cluster)" } else { "" },
        if plan.policy.is_some() {
            ", rules from a policy"
        } else {
            ""
        },
        plan.length,
        outcome.requests,
        outcome.statuses
    );
    (check(plan, &outcome), line)
}

/// Shrinks a failing `plan`: drops faults, clients and rules one at a time while the same
/// invariant still fails, within `runs` runs.
fn shrink(mut plan: Plan, invariant: &'static str, mut runs: usize) -> Plan {
    let fails = |candidate: &Plan| {
        let (violations, _) = judge(candidate);
        violations.iter().any(|v| v.invariant == invariant)
    };
    let mut progress = true;
    while progress && runs > 0 {
        progress = false;
        for part in 0..3 {
            let len = match part {
                0 => plan.faults.len(),
                1 => plan.clients.len(),
                _ => plan.rules.len(),
            };
            let mut index = 0;
            while index
                < len.min(match part {
                    0 => plan.faults.len(),
                    1 => plan.clients.len(),
                    _ => plan.rules.len(),
                })
                && runs > 0
            {
                let mut candidate = plan.clone();
                match part {
                    0 => {
                        candidate.faults.remove(index);
                    }
                    1 if candidate.clients.len() > 1 => {
                        candidate.clients.remove(index);
                    }
                    2 if candidate.rules.len() > 1 => {
                        candidate.rules.remove(index);
                    }
                    _ => {
                        index += 1;
                        continue;
                    }
                }
                runs -= 1;
                if fails(&candidate) {
                    plan = candidate;
                    progress = true;
                } else {
                    index += 1;
                }
            }
        }
    }
    plan
}

/// Runs `seeds`, and fails with the first failing seed's violations and shrunk plan.
fn run_seeds(seeds: impl Iterator<Item = u64>, deadline: Option<Instant>) {
    let started = Instant::now();
    let mut fleet_seconds = 0f64;
    let mut count = 0;
    let mut failures = Vec::new();
    for seed in seeds {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        let plan = Plan::from_seed(seed);
        let (violations, line) = judge(&plan);
        count += 1;
        fleet_seconds += plan.length.as_secs_f64() * f64::from(plan.replicas);
        eprintln!("{line}");
        if !violations.is_empty() {
            for violation in &violations {
                eprintln!(
                    "  FAILED seed {seed}: {}: {}",
                    violation.invariant, violation.detail
                );
            }
            failures.push((plan, violations));
        }
    }
    eprintln!(
        "{count} seeds, {:.2} simulated fleet-hours, in {:.1} s",
        fleet_seconds / 3600.0,
        started.elapsed().as_secs_f64()
    );
    if let Some((plan, violations)) = failures.first() {
        let seeds: Vec<u64> = failures.iter().map(|(p, _)| p.seed).collect();
        let shrunk = shrink(plan.clone(), violations[0].invariant, 30);
        panic!(
            "the fleet simulation broke an invariant with seeds {seeds:?}; seed {} (run it alone: \
             TOLLGATE_SIM_SEED={} cargo test --all-features --lib sim::):\n{violations:#?}\n\
             shrunk plan:\n{shrunk:#?}",
            plan.seed, plan.seed
        );
    }
}

fn number(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.parse().ok()
}

/// The regression seeds and the CI seeds (or those the environment asks for) keep every
/// guarantee.
#[test]
fn every_guarantee_holds_on_the_seeds() {
    if let Some(seed) = number("TOLLGATE_SIM_SEED") {
        return run_seeds(std::iter::once(seed), None);
    }
    let first = number("TOLLGATE_SIM_FIRST").unwrap_or(1);
    match number("TOLLGATE_SIM_SECONDS") {
        Some(seconds) => run_seeds(
            REGRESSIONS.iter().copied().chain(first..),
            Some(Instant::now() + Duration::from_secs(seconds)),
        ),
        None => {
            let count = number("TOLLGATE_SIM_SEEDS").unwrap_or(CI_SEEDS);
            run_seeds(
                REGRESSIONS.iter().copied().chain(first..first + count),
                None,
            )
        }
    }
}

/// A seed draws the same plan twice, and its run keeps the same verdict: a failure replayed by
/// its seed is the failure that was seen. (The calls themselves are not yet the same in every
/// run: seed 13's diverge in a call's timing from about its 40th call on, from a source not
/// found yet; not the tables' hash seeds, nor the heartbeat's member names.)
#[test]
fn a_seed_keeps_its_plan_and_its_verdict() {
    for seed in [REGRESSIONS[0], REGRESSIONS[2], 3] {
        let plan = Plan::from_seed(seed);
        assert_eq!(format!("{plan:?}"), format!("{:?}", Plan::from_seed(seed)));
        let verdict = || {
            let (violations, _) = judge(&plan);
            violations.iter().map(|v| v.invariant).collect::<Vec<_>>()
        };
        assert_eq!(verdict(), verdict(), "seed {seed}");
    }
}
