//! The invariants judged on outcomes made by hand: each fails where it should.

use super::super::audit::{Audit, Descriptor, KeyAudit};
use super::super::facts::Fact;
use super::*;

/// A plain rule `r0` of `kind`: 10 a second, cost 1, failing closed.
fn ten_a_second(kind: Kind) -> RulePlan {
    RulePlan {
        name: "r0".to_owned(),
        kind,
        limit: 10,
        period: Duration::from_secs(1),
        burst: None,
        cost: 1,
        lease: None,
        split: None,
        meter: None,
        on_error: OnError::Closed,
        shadow: false,
        delay: None,
        charged: None,
    }
}

fn call(mode: u8, lease: u64, cost: u64, before: f64, after: f64) -> Audit {
    Audit {
        at: 0,
        node: 0,
        mode,
        keys: vec![KeyAudit {
            key: b"tollgate:{k0}:r0".to_vec(),
            descriptor: Descriptor {
                algorithm: "tb".to_owned(),
                limit: 10,
                period: 1_000_000,
                burst: 10,
                interval: 100_000,
                cost,
                lease,
                give_back: None,
            },
            before,
            after,
        }],
        failed: false,
    }
}

#[test]
fn a_charge_given_back_twice_breaks_the_refund_invariant() {
    let mut outcome = Outcome {
        audits: vec![call(b'c', 0, 3, 0.0, 3.0), call(b'a', 0, 3, 3.0, 0.0)],
        ..Outcome::default()
    };
    assert!(refunds(&outcome).is_none());
    outcome.audits.push(call(b'r', 0, 3, 0.0, 0.0));
    let violation = refunds(&outcome).expect("a second give-back is seen");
    assert_eq!(violation.invariant, "no refund beyond a charge");
    // A settle up is a charge: what it charged may be given back.
    outcome.audits.insert(2, call(b'a', 1, 3, 0.0, 3.0));
    assert!(refunds(&outcome).is_none());
}

#[test]
fn a_refusal_while_redis_held_the_cost_free_is_under_admission() {
    let mut plan = Plan::from_seed(1);
    plan.rules = vec![ten_a_second(Kind::TokenBucket)];
    plan.faults.clear();
    plan.policy = None;
    let start = 1_000_000_000;
    let at = |micros: u64, audit: Audit| Audit {
        at: start + micros,
        ..audit
    };
    let refused = |micros: u64| Fact {
        at: start + micros,
        request: 1,
        key: 0,
        happened: Happened::Refused { replica: 0 },
    };
    // The tenth unit charged at 1 s: the bucket is empty.
    let mut outcome = Outcome {
        start,
        end: start + 10_000_000,
        first_counted: [(0, start)].into(),
        audits: vec![at(1_000_000, call(b'c', 0, 1, 9.0, 10.0))],
        facts: vec![refused(1_001_000)],
        ..Outcome::default()
    };
    assert!(
        under_admission(&plan, &outcome).is_none(),
        "refused when spent"
    );
    // 600 ms later six units are back: a refusal then is early.
    outcome.facts.push(refused(1_600_000));
    let violation = under_admission(&plan, &outcome).expect("an early refusal is seen");
    assert_eq!(violation.invariant, "under-admission");
    // Within a troubled span, the rule's FailureMode answers.
    plan.faults = vec![(Duration::from_millis(1_500), Fault::DropConnections)];
    assert!(
        under_admission(&plan, &outcome).is_none(),
        "a fault's refusal"
    );
}

#[test]
fn a_settle_lost_or_made_twice_breaks_the_settle_invariant() {
    let mut plan = Plan::from_seed(1);
    plan.rules = vec![RulePlan {
        charged: Some(Charged::OnStatus),
        ..ten_a_second(Kind::TokenBucket)
    }];
    plan.faults.clear();
    plan.policy = None;
    plan.keys = 1;
    let start = 1_000_000_000;
    let fact = |happened| Fact {
        at: start + 1_000_000,
        request: 7,
        key: 0,
        happened,
    };
    let settle = Audit {
        at: start + 1_001_000,
        ..call(b'a', 0, 1, 1.0, 0.0)
    };
    // A 200 of a rule that charges 401s only: its unit comes back, in one call.
    let mut outcome = Outcome {
        start,
        end: start + 10_000_000,
        first_counted: [(0, start)].into(),
        facts: vec![
            fact(Happened::Admitted { replica: 0 }),
            fact(Happened::Answered {
                status: 200,
                actual: 0,
            }),
        ],
        ..Outcome::default()
    };
    let lost = settled_once(&plan, &outcome).expect("a settle never made is seen");
    assert_eq!(lost.invariant, "every settle once");
    outcome.audits.push(settle.clone());
    assert!(settled_once(&plan, &outcome).is_none(), "{outcome:?}");
    outcome.audits.push(settle);
    let twice = settled_once(&plan, &outcome).expect("a settle made twice is seen");
    assert!(twice.detail.contains("no response"), "{twice:?}");
}

#[test]
fn a_settled_debt_is_repaid_at_the_rate_of_a_bucket_and_kept_by_a_window() {
    let mut bucket = Debt::new(&ten_a_second(Kind::TokenBucket));
    bucket.add(1_000_000, 20);
    assert_eq!(bucket.at(1_500_000), 15.0);
    assert_eq!(bucket.at(4_000_000), 0.0);
    let mut window = Debt::new(&ten_a_second(Kind::FixedWindow));
    window.add(1_000_000, 20);
    assert_eq!(window.at(9_000_000), 20.0);
}
