//! Property tests of the reference model: every algorithm against a brute-force oracle over
//! random timelines, plus the promises each one makes (bounds, exact retry-after, reset).

use proptest::prelude::*;
use tollgate::Algorithm;
use tollgate::algorithm::{CONCURRENCY_RETRY_MICROS, Limits, State};

const EPOCH: u64 = 1_704_067_200_000_000; // 2024-01-01 in µs

/// One request of a timeline: wait `gap` µs, then ask for `cost`.
#[derive(Clone, Debug)]
struct Step {
    gap: u64,
    cost: u64,
}

#[derive(Clone, Debug)]
struct Case {
    limits: Limits,
    steps: Vec<Step>,
}

fn limits() -> impl Strategy<Value = Limits> {
    (
        1u64..20,
        prop_oneof![
            1u64..50,
            50u64..5_000,
            Just(1_000_000u64),
            1_000u64..10_000_000
        ],
        1u64..30,
    )
        .prop_filter_map("valid limits", |(limit, period, burst)| {
            Limits::new(limit, period.max(limit), burst).ok()
        })
}

fn case() -> impl Strategy<Value = Case> {
    limits().prop_flat_map(|limits| {
        let p = limits.period;
        let gap = prop_oneof![
            4 => Just(0u64),
            8 => 0..=(p / 10).max(1),
            4 => 0..=p,
            1 => 0..=(3 * p),
        ];
        let cost = prop_oneof![1 => Just(0u64), 12 => Just(1u64), 3 => 1u64..=4];
        let steps = prop::collection::vec(
            (gap, cost).prop_map(|(gap, cost)| Step { gap, cost }),
            1..150,
        );
        (Just(limits), steps).prop_map(|(limits, steps)| Case { limits, steps })
    })
}

/// What the model decided at each step: (time, cost, admitted).
fn run_model(alg: Algorithm, case: &Case, start: u64) -> Vec<(u64, u64, bool)> {
    let mut state: Option<State> = None;
    let mut now = start;
    let mut out = Vec::new();
    for step in &case.steps {
        now += step.gap;
        let outcome = alg.check(&case.limits, state.as_ref(), now, step.cost);
        if outcome.allowed {
            alg.commit(&case.limits, &mut state, now, step.cost);
        }
        out.push((now, step.cost, outcome.allowed));
    }
    out
}

fn capacity(alg: Algorithm, l: &Limits) -> u64 {
    alg.capacity(l)
}

/// Brute-force oracles: each decides from the full history of admitted requests, in a form
/// different from the model's.
fn oracle_admits(alg: Algorithm, l: &Limits, history: &[(u64, u64)], now: u64, cost: u64) -> bool {
    if cost > capacity(alg, l) {
        return false;
    }
    match alg {
        Algorithm::FixedWindow => {
            let start = now - now % l.period;
            let used: u64 = history
                .iter()
                .filter(|(t, _)| *t >= start)
                .map(|(_, c)| c)
                .sum();
            used + cost <= l.limit
        }
        // Without units given back, a concurrency limit holds each unit for its period: a
        // sliding log.
        Algorithm::SlidingWindowLog | Algorithm::Concurrency => {
            let used: u64 = history
                .iter()
                .filter(|(t, _)| t + l.period > now)
                .map(|(_, c)| c)
                .sum();
            used + cost <= l.limit
        }
        Algorithm::SlidingWindowCounter => {
            let start = now - now % l.period;
            let current: u64 = history
                .iter()
                .filter(|(t, _)| *t >= start)
                .map(|(_, c)| c)
                .sum();
            let previous: u64 = history
                .iter()
                .filter(|(t, _)| *t < start && *t + l.period >= start)
                .map(|(_, c)| c)
                .sum();
            let elapsed = now - start;
            let weighted = (previous as f64) * ((l.period - elapsed) as f64) / (l.period as f64);
            weighted.floor() as u64 + current + cost <= l.limit
        }
        Algorithm::TokenBucket | Algorithm::Gcra => {
            // A continuous bucket counted in 1/interval token units (exact integers): it fills by
            // one unit per µs up to burst × interval; a request needs cost × interval units.
            let full = l.burst * l.interval;
            let mut level = full;
            let mut last = None::<u64>;
            for &(t, c) in history {
                if let Some(prev) = last {
                    level = (level + (t - prev)).min(full);
                }
                level -= c * l.interval;
                last = Some(t);
            }
            if let Some(prev) = last {
                level = (level + (now - prev)).min(full);
            }
            level >= cost * l.interval
        }
        other => unreachable!("{other} has no oracle yet"),
    }
}

fn check_against_oracle(alg: Algorithm, case: &Case) -> Result<(), TestCaseError> {
    let mut history: Vec<(u64, u64)> = Vec::new();
    for (now, cost, admitted) in run_model(alg, case, EPOCH) {
        let expected = oracle_admits(alg, &case.limits, &history, now, cost);
        prop_assert_eq!(
            admitted,
            expected,
            "{} at {} cost {} after {:?}",
            alg,
            now,
            cost,
            history
        );
        if admitted && cost > 0 {
            history.push((now, cost));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn every_algorithm_agrees_with_its_oracle(case in case()) {
        for alg in Algorithm::ALL {
            check_against_oracle(alg, &case)?;
        }
    }

    #[test]
    fn window_algorithms_never_admit_more_than_the_quota(case in case()) {
        for alg in [Algorithm::FixedWindow, Algorithm::SlidingWindowLog, Algorithm::SlidingWindowCounter] {
            let decisions = run_model(alg, &case, EPOCH);
            let admitted: Vec<(u64, u64)> =
                decisions.iter().filter(|d| d.2).map(|d| (d.0, d.1)).collect();
            let p = case.limits.period;
            for &(t, _) in &admitted {
                // Every calendar window (all three), and for the log every sliding window too.
                let start = t - t % p;
                let in_calendar: u64 =
                    admitted.iter().filter(|(u, _)| *u >= start && *u < start + p).map(|(_, c)| c).sum();
                prop_assert!(in_calendar <= case.limits.limit, "{alg}: {in_calendar} in one window");
                if alg == Algorithm::SlidingWindowLog {
                    let sliding: u64 =
                        admitted.iter().filter(|(u, _)| *u <= t && *u + p > t).map(|(_, c)| c).sum();
                    prop_assert!(sliding <= case.limits.limit, "log: {sliding} in (t - period, t]");
                }
            }
        }
    }

    #[test]
    fn buckets_never_exceed_burst_plus_rate_times_elapsed(case in case()) {
        for alg in [Algorithm::TokenBucket, Algorithm::Gcra] {
            let decisions = run_model(alg, &case, EPOCH);
            let admitted: Vec<(u64, u64)> =
                decisions.iter().filter(|d| d.2).map(|d| (d.0, d.1)).collect();
            let l = &case.limits;
            for i in 0..admitted.len() {
                let mut total = 0;
                for &(t, c) in &admitted[i..] {
                    total += c;
                    let elapsed = t - admitted[i].0;
                    // The exact rate is limit/period; the model's interval rounds it down.
                    let bound = l.burst as u128 * l.period as u128 + elapsed as u128 * l.limit as u128;
                    prop_assert!(total as u128 * l.period as u128 <= bound,
                        "{alg}: {total} admitted within {elapsed} µs, burst {}", l.burst);
                }
            }
        }
    }

    #[test]
    fn admit_decides_and_charges_as_check_then_commit(case in case()) {
        for alg in Algorithm::ALL {
            let (mut two_steps, mut one_step): (Option<State>, Option<State>) = (None, None);
            let mut now = EPOCH;
            for step in &case.steps {
                now += step.gap;
                let expected = alg.check(&case.limits, two_steps.as_ref(), now, step.cost);
                if expected.allowed {
                    alg.commit(&case.limits, &mut two_steps, now, step.cost);
                }
                let outcome = alg.admit(&case.limits, &mut one_step, now, step.cost);
                prop_assert_eq!(outcome, expected, "{} at {}", alg, now);
                prop_assert_eq!(&one_step, &two_steps, "{} at {}", alg, now);
            }
        }
    }

    #[test]
    fn token_bucket_and_gcra_decide_alike(case in case()) {
        let a = run_model(Algorithm::TokenBucket, &case, EPOCH);
        let b = run_model(Algorithm::Gcra, &case, EPOCH);
        prop_assert_eq!(a, b);
    }

    #[test]
    fn retry_after_is_exact_and_reset_restores_the_budget(case in case()) {
        for alg in Algorithm::ALL {
            let mut state: Option<State> = None;
            let mut now = EPOCH;
            for step in &case.steps {
                now += step.gap;
                let outcome = alg.check(&case.limits, state.as_ref(), now, step.cost);
                if outcome.allowed {
                    alg.commit(&case.limits, &mut state, now, step.cost);
                    prop_assert_eq!(outcome.retry_after, 0);
                    // `remaining` more unit requests fit right now, and not one more.
                    let mut probe = state.clone();
                    for _ in 0..outcome.remaining {
                        prop_assert!(alg.check(&case.limits, probe.as_ref(), now, 1).allowed, "{alg}: remaining");
                        alg.commit(&case.limits, &mut probe, now, 1);
                    }
                    prop_assert!(!alg.check(&case.limits, probe.as_ref(), now, 1).allowed, "{alg}: remaining + 1");
                    // At `now + reset` the key is as good as new.
                    let later = alg.check(&case.limits, state.as_ref(), now + outcome.reset, 0);
                    prop_assert_eq!(later.remaining, alg.capacity(&case.limits), "{}: reset", alg);
                    prop_assert_eq!(outcome.reset == 0, state.is_none(), "{}: no state iff nothing to reset", alg);
                } else {
                    let wait = outcome.retry_after;
                    if step.cost > alg.capacity(&case.limits) {
                        prop_assert_eq!(wait, u64::MAX, "{}: a cost above capacity never fits", alg);
                        continue;
                    }
                    prop_assert!(wait > 0, "{alg}: a denial must say to wait");
                    let at = now + wait;
                    // A concurrency limit's wait is an estimate, at most a second: exact only
                    // when the units that must expire do so sooner (nothing else here gives
                    // units back).
                    let exact = !alg.is_concurrency() || wait < CONCURRENCY_RETRY_MICROS;
                    prop_assert!(!exact || alg.check(&case.limits, state.as_ref(), at, step.cost).allowed,
                        "{alg}: denied at now + retry_after ({wait})");
                    prop_assert!(!alg.check(&case.limits, state.as_ref(), at - 1, step.cost).allowed,
                        "{alg}: admitted before now + retry_after ({wait})");
                }
            }
        }
    }

    #[test]
    fn the_effective_window_is_exact_and_never_after_retry_after(case in case()) {
        // draft-ietf-httpapi-ratelimit-headers-11: within `t` the client can use no more than
        // `r`, and Retry-After never points before the end of a denying policy's `t`.
        for alg in Algorithm::ALL {
            let mut state: Option<State> = None;
            let mut now = EPOCH;
            let capacity = alg.capacity(&case.limits);
            for step in &case.steps {
                now += step.gap;
                let outcome = alg.check(&case.limits, state.as_ref(), now, step.cost);
                if outcome.allowed {
                    alg.commit(&case.limits, &mut state, now, step.cost);
                }
                let window = outcome.window;
                prop_assert!(window > 0, "{alg}: a window of 0");
                if !outcome.allowed && outcome.retry_after != u64::MAX {
                    prop_assert!(outcome.retry_after >= window,
                        "{alg}: retry after {} before the window {window} ends", outcome.retry_after);
                }
                if outcome.remaining >= capacity {
                    continue;
                }
                // The outcome describes `state` now (charged when admitted, as it stands when
                // denied): one unit more than `remaining` fits exactly at the window's end.
                let more = outcome.remaining + 1;
                prop_assert!(!alg.check(&case.limits, state.as_ref(), now + window - 1, more).allowed,
                    "{alg}: {more} fit before the window ({window}) ends");
                // A concurrency limit's window is an estimate of at most a second, as its wait.
                let exact = !alg.is_concurrency() || window < CONCURRENCY_RETRY_MICROS;
                prop_assert!(!exact || alg.check(&case.limits, state.as_ref(), now + window, more).allowed,
                    "{alg}: {more} do not fit when the window ({window}) ends");
            }
        }
    }

    #[test]
    fn a_request_that_is_not_charged_reports_the_budget_as_it_stands(case in case()) {
        for alg in Algorithm::ALL {
            let mut state: Option<State> = None;
            let mut now = EPOCH;
            for step in &case.steps {
                now += step.gap;
                let uncharged = alg.uncharged(&case.limits, state.as_ref(), now, step.cost);
                let charged = alg.check(&case.limits, state.as_ref(), now, step.cost);
                let looked = alg.check(&case.limits, state.as_ref(), now, 0);
                prop_assert_eq!(uncharged.allowed, charged.allowed);
                prop_assert_eq!(uncharged.retry_after, charged.retry_after);
                prop_assert_eq!(
                    (uncharged.remaining, uncharged.reset, uncharged.window),
                    (looked.remaining, looked.reset, looked.window),
                    "{}", alg
                );
                if charged.allowed {
                    alg.commit(&case.limits, &mut state, now, step.cost);
                }
            }
        }
    }

    /// A lease takes what the budget holds, at most the lease: at least the cost, and admitted
    /// exactly when the cost alone would be; at cost 0 (a refill ahead of need) possibly
    /// nothing, and always admitted.
    #[test]
    fn a_lease_takes_what_there_is_up_to_the_lease_and_admits_as_the_cost_would(
        case in case(),
        lease in 2u64..40,
    ) {
        for alg in Algorithm::ALL {
            if alg.is_concurrency() {
                continue;
            }
            let mut state: Option<State> = None;
            let mut now = EPOCH;
            for step in &case.steps {
                now += step.gap;
                let available = alg.check(&case.limits, state.as_ref(), now, 0).remaining;
                let take = alg.lease_take(&case.limits, state.as_ref(), now, step.cost, lease);
                let alone = alg.check(&case.limits, state.as_ref(), now, step.cost);
                let taken = alg.check(&case.limits, state.as_ref(), now, take);
                prop_assert_eq!(taken.allowed, alone.allowed, "{} take {}", alg, take);
                if step.cost > capacity(alg, &case.limits) {
                    prop_assert_eq!(take, step.cost);
                    continue;
                }
                prop_assert!(take >= step.cost && take <= lease.max(step.cost), "{}", alg);
                if step.cost == 0 {
                    prop_assert!(taken.allowed && take <= available, "{}", alg);
                }
                if taken.allowed && take < lease {
                    // Every unit there is: one more would not be admitted.
                    let more = alg.check(&case.limits, state.as_ref(), now, take + 1);
                    prop_assert!(!more.allowed, "{} took {} of {}", alg, take, available);
                }
                if taken.allowed {
                    alg.commit(&case.limits, &mut state, now, take);
                }
            }
        }
    }
}

#[test]
fn a_cost_above_capacity_is_never_admitted() {
    let limits = Limits::new(5, 1_000_000, 5).unwrap();
    for alg in Algorithm::ALL {
        let outcome = alg.check(&limits, None, EPOCH, 6);
        assert!(!outcome.allowed, "{alg}");
        assert_eq!(outcome.retry_after, u64::MAX, "{alg}");
        assert_eq!(outcome.remaining, 5, "{alg}");
    }
}

#[test]
fn fixed_window_allows_the_documented_boundary_burst() {
    // 100 per minute: 100 at 12:00:59 and 100 more at 12:01:00 are all admitted.
    let limits = Limits::new(100, 60_000_000, 100).unwrap();
    let alg = Algorithm::FixedWindow;
    let minute = EPOCH; // aligned to a minute
    let mut state = None;
    for t in [minute + 59_000_000, minute + 60_000_000] {
        for _ in 0..100 {
            assert!(alg.check(&limits, state.as_ref(), t, 1).allowed);
            alg.commit(&limits, &mut state, t, 1);
        }
        assert!(!alg.check(&limits, state.as_ref(), t, 1).allowed);
    }
}

#[test]
fn invalid_limits_are_refused_with_a_reason() {
    assert!(
        Limits::new(0, 1_000_000, 1)
            .unwrap_err()
            .to_string()
            .contains("at least 1")
    );
    assert!(Limits::new(1, 0, 1).is_err());
    assert!(Limits::new(1, 1_000_000, 0).is_err());
    assert!(
        Limits::new(2_000_000, 1_000_000, 1)
            .unwrap_err()
            .to_string()
            .contains("microsecond")
    );
    assert!(Limits::new(1, 400 * 86_400_000_000, 1).is_err());
    // A period near the longest, with a quota that does not divide it: the rounded-up interval
    // must not make the default burst (= quota) invalid.
    let longest = tollgate::algorithm::MAX_PERIOD_MICROS;
    assert!(Limits::new(7, longest, 7).is_ok());
    assert!(
        Limits::new(1, 1_000_000, 4_000 * 86_400)
            .unwrap_err()
            .to_string()
            .contains("burst")
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// A concurrency limit against the plain list of what is held: each admitted request holds
    /// its cost until it is given back (at its own time) or its hold expires; a unit given back
    /// after it expired frees nothing else.
    #[test]
    fn concurrency_holds_what_was_taken_and_not_given_back(
        case in case(),
        releases in prop::collection::vec((any::<bool>(), any::<prop::sample::Index>()), 150),
    ) {
        let alg = Algorithm::Concurrency;
        let l = &case.limits;
        let mut state: Option<State> = None;
        // (taken at, cost) of every admitted request not given back yet.
        let mut held: Vec<(u64, u64)> = Vec::new();
        let mut now = EPOCH;
        for (step, (release, which)) in case.steps.iter().zip(&releases) {
            now += step.gap;
            if *release && !held.is_empty() {
                let (at, cost) = held.remove(which.index(held.len()));
                alg.refund(l, &mut state, now, cost, at);
            }
            let live: u64 = held.iter().filter(|(t, _)| t + l.period > now).map(|(_, c)| c).sum();
            let outcome = alg.check(l, state.as_ref(), now, step.cost);
            let fits = step.cost <= l.limit && live + step.cost <= l.limit;
            prop_assert_eq!(outcome.allowed, fits, "at {} cost {} holding {:?}", now, step.cost, held);
            prop_assert_eq!(outcome.remaining, l.limit.saturating_sub(live + if fits { step.cost } else { 0 }));
            if outcome.allowed {
                alg.commit(l, &mut state, now, step.cost);
                if step.cost > 0 {
                    held.push((now, step.cost));
                }
            } else if step.cost <= l.limit {
                prop_assert!(outcome.retry_after > 0 && outcome.retry_after <= CONCURRENCY_RETRY_MICROS);
            }
        }
    }
}
