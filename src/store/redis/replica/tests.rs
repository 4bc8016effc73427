//! The replica's decisions: the deny cache, leases and their refills, split keys.

use std::sync::Arc;

use super::held::lease_key;
use super::plan::How;
use super::table::SHARDS;
use super::*;
use crate::algorithm::Limits;
use crate::algorithm::Outcome;
use crate::clock::ManualClock;
use crate::key::Key;
use crate::store::RuleSpec;
use crate::store::redis::script::Reply;
use crate::store::{Charge, StoreError};
use crate::{Algorithm, DecisionSource};

fn local(clock: &ManualClock) -> Arc<Replica> {
    replica(clock, 1000)
}

/// A replica on `clock` that keeps at most `leases` leased keys.
fn replica(clock: &ManualClock, leases: usize) -> Arc<Replica> {
    Arc::new(Replica::new(
        Arc::new(clock.clone()),
        "t".into(),
        1000,
        std::time::Duration::from_secs(3600),
        leases,
    ))
}

fn denied(retry: u64, window: u64) -> Outcome {
    Outcome {
        allowed: false,
        limit: 10,
        remaining: 0,
        reset: 50_000_000,
        retry_after: retry,
        window,
    }
}

/// A rule of `limit` per `period` microseconds, as much at once.
fn rule(name: impl Into<Arc<str>>, algorithm: Algorithm, limit: u64, period: u64) -> RuleSpec {
    RuleSpec::new(name, algorithm, Limits::new(limit, period, limit).unwrap()).unwrap()
}

/// One charge of `cost` to `key` of `rule`.
fn one<'a>(rule: &'a RuleSpec, key: &'a Key, cost: u64) -> [Charge<'a>; 1] {
    [Charge { rule, key, cost }]
}

/// Redis's denial of one charge, until `retry` microseconds from its time.
fn denial(retry: u64) -> Reply {
    Reply {
        now: 1_000_000,
        outcomes: smallvec::smallvec![denied(retry, retry)],
        taken: smallvec::smallvec![0],
        times: None,
    }
}

/// The next request of `charges` refills a lease that holds nothing, with no refill out.
fn assert_refills_anew(local: &Arc<Replica>, charges: &[Charge<'_>]) {
    assert!(matches!(
        local.plan(charges).charges[0].how,
        How::Refill { held: 0, .. }
    ));
}

#[test]
fn a_denial_is_answered_here_until_its_retry_after_aged() {
    let clock = ManualClock::new(1_000_000);
    let local = local(&clock);
    let rule = rule("r", Algorithm::TokenBucket, 10, 60_000_000);
    let key = Key::text("k");
    let charges = one(&rule, &key, 1);
    let mut plan = local.plan(&charges);
    let reply = denial(6_000_000);
    assert!(!plan.settle(Some(Ok(reply))).unwrap().allowed());
    clock.advance(std::time::Duration::from_secs(2));
    let cached = local.answer(&charges, true).expect("answered here");
    assert_eq!(cached.source(), DecisionSource::DenyCache);
    assert_eq!(cached.outcomes()[0].retry_after, 4_000_000);
    assert_eq!(cached.outcomes()[0].reset, 48_000_000);
    // Another cost is another request.
    let other = one(&rule, &key, 2);
    assert!(local.answer(&other, true).is_none());
    // At the retry-after, Redis decides again.
    clock.advance(std::time::Duration::from_secs(4));
    assert!(local.answer(&charges, true).is_none());
}

#[test]
fn a_rule_whose_cost_never_fits_keeps_its_numbers_only_until_its_window() {
    let clock = ManualClock::new(1_000_000);
    let local = local(&clock);
    let log = rule("log", Algorithm::SlidingWindowLog, 7, 1_000_000);
    let window = rule("window", Algorithm::FixedWindow, 1, 60_000_000);
    let key = Key::text("k");
    let charges = [
        Charge {
            rule: &log,
            key: &key,
            cost: 8,
        },
        Charge {
            rule: &window,
            key: &key,
            cost: 1,
        },
    ];
    let mut plan = local.plan(&charges);
    // The log's one entry leaves in 1 ms; its cost never fits. The window denies for 30 s.
    let never = Outcome {
        retry_after: u64::MAX,
        window: 1_000,
        remaining: 6,
        limit: 7,
        ..denied(0, 0)
    };
    let reply = Reply {
        now: 1_000_000,
        outcomes: smallvec::smallvec![never, denied(30_000_000, 30_000_000)],
        taken: smallvec::smallvec![0, 0],
        times: None,
    };
    assert!(!plan.settle(Some(Ok(reply))).unwrap().allowed());
    assert!(
        local.answer(&charges, true).is_some(),
        "answered here at once"
    );
    // Once the log's entry has left, its numbers are not known here: Redis answers.
    clock.advance(std::time::Duration::from_millis(2));
    assert!(local.answer(&charges, true).is_none());
}

fn admitted(remaining: u64, taken: u64) -> Reply {
    Reply {
        now: 1_000_000,
        outcomes: smallvec::smallvec![Outcome {
            allowed: true,
            limit: 100,
            remaining,
            reset: 1_000_000,
            retry_after: 0,
            window: 36_000_000,
        }],
        taken: smallvec::smallvec![taken],
        times: None,
    }
}

/// A rule of 100 leased 10 at a time, on a replica of its own, and its one key.
struct Hot {
    clock: ManualClock,
    local: Arc<Replica>,
    rule: RuleSpec,
    key: Key,
}

impl Hot {
    /// The key is seen often: its first refill takes a whole lease.
    fn new() -> Hot {
        let clock = ManualClock::new(1_000_000);
        let hot = Hot {
            local: local(&clock),
            clock,
            rule: rule("hot", Algorithm::TokenBucket, 100, 3_600_000_000)
                .with_lease(10, std::time::Duration::from_secs(60))
                .unwrap(),
            key: Key::text("k"),
        };
        warm(&hot.local, &hot.rule, &hot.key);
        hot
    }

    fn charges(&self) -> [Charge<'_>; 1] {
        one(&self.rule, &self.key, 1)
    }

    /// `requests` requests of cost 1, each paid from the lease without a call.
    fn pay(&self, requests: usize) {
        let charges = self.charges();
        for _ in 0..requests {
            assert!(self.local.answer(&charges, true).is_some());
        }
    }

    /// A first refill of 10 (9 held), `dry` requests sent to Redis while it was out: a
    /// mark of `1.5 × dry` (none above 4).
    fn fill(&self, dry: u64) {
        let charges = self.charges();
        let mut refill = self.local.plan(&charges);
        for i in 0..dry {
            let mut alone = self.local.plan(&charges);
            assert!(matches!(alone.charges[0].how, How::Sent));
            alone.settle(Some(Ok(admitted(99 - i, 1)))).unwrap();
        }
        let first = refill.settle(Some(Ok(admitted(89 - dry, 10)))).unwrap();
        assert!(first.allowed());
    }

    /// A mark of 6 (four requests find no unit while the first refill is out), then a refill
    /// ahead of 4 units while four more are paid here: 1 unit held, 4 waiting behind it.
    fn one_held_four_waiting(&self) {
        let charges = self.charges();
        self.fill(4);
        assert_eq!(held(&self.local), (9, 0));
        self.pay(3);
        // The next request leaves 5 < 6: it asks for 4, and four more are paid meanwhile.
        let mut ahead = self.local.plan(&charges);
        assert!(matches!(ahead.charges[0].how, How::Ahead { ask: 4, .. }));
        self.pay(4);
        ahead.settle(Some(Ok(admitted(76, 4)))).unwrap();
        assert_eq!(
            held(&self.local),
            (1, 4),
            "the units wait behind the one left"
        );
    }
}

/// The units asked for while a refill was out set the low-water mark (half as much again);
/// below it, a request paid here also asks Redis, at cost 0, for what the lease lacks, and
/// those units wait until the ones left are spent. A replica never holds more than `n - 1`.
#[test]
fn a_key_spent_at_once_refills_ahead_of_need() {
    let hot = Hot::new();
    let (local, charges) = (&hot.local, hot.charges());
    // One refill out, three more requests at once: each goes to Redis alone.
    hot.fill(3);
    // 9 held, low water 3 + 1: five requests are paid here without a call.
    for held in (4..9).rev() {
        let decision = local.answer(&charges, true).expect("paid here");
        assert_eq!(decision.outcomes()[0].remaining, 86 + held);
    }
    assert!(
        local.answer(&charges, true).is_none(),
        "a refill ahead is due"
    );
    let mut ahead = local.plan(&charges);
    let How::Ahead { ask, .. } = ahead.charges[0].how else {
        panic!("{:?}", ahead.charges[0].how);
    };
    assert_eq!(ask, 6, "3 left: the lease lacks 6 of 9");
    let prepared = ahead.prepared("p", &charges);
    assert_eq!((prepared[0].cost, prepared[0].lease), (0, 6));
    // Meanwhile the units left are spent here, and no second refill goes out.
    assert!(local.answer(&charges, true).is_some());
    // Redis had 6: they wait behind the 2 left.
    let decision = ahead.settle(Some(Ok(admitted(80, 6)))).unwrap();
    assert!(decision.allowed());
    assert_eq!(decision.source(), DecisionSource::Lease);
    assert_eq!(decision.outcomes()[0].remaining, 80 + 2 + 6);
    // One unit was asked for while it was out: low water 1. The 2 left, then the refill's
    // units, are spent here until the request that would leave none.
    hot.pay(7);
    assert!(local.answer(&charges, true).is_none());
    assert!(matches!(
        local.plan(&charges).charges[0].how,
        How::Ahead { ask: 9, .. }
    ));
}

/// A refill ahead of need whose call fails, or that Redis cannot fill, leaves the request
/// paid here admitted.
#[test]
fn a_request_paid_here_stands_when_its_refill_ahead_fails() {
    let hot = Hot::new();
    let (local, charges) = (&hot.local, hot.charges());
    hot.fill(1);
    // Low water 1: the request that takes the last unit asks for 9.
    hot.pay(8);
    let mut ahead = local.plan(&charges);
    assert!(matches!(ahead.charges[0].how, How::Ahead { ask: 9, .. }));
    let decision = ahead.settle(Some(Err(StoreError::Timeout))).unwrap();
    assert!(decision.allowed());
    assert_eq!(decision.source(), DecisionSource::Lease);
    // Nothing held, no refill out: the next request refills as usual.
    assert!(local.answer(&charges, true).is_none());
    assert_refills_anew(local, &charges);
}

/// Makes `key` of `rule` a key seen now, whose last lease spent all its units: its next
/// refill takes a whole lease.
fn warm(local: &Replica, rule: &RuleSpec, key: &Key) {
    let units = rule.lease().unwrap().units;
    let entry = (lease_key(rule), key.clone());
    let mut shard = local.leases.shard(&entry);
    let held = shard
        .entry(entry)
        .or_insert_with(|| local.new_lease(rule, units));
    held.seen = Some(local.now());
    held.spent = units;
}

/// Units held and waiting, of the only key of `local`.
fn held(local: &Replica) -> (u64, u64) {
    let shard = local
        .leases
        .shards
        .each()
        .find(|shard| !shard.is_empty())
        .expect("a lease");
    let held = shard.values().next().unwrap();
    (held.units, held.next)
}

/// A refill ahead of need also goes out while units of the last one still wait, when the
/// key's requests would leave fewer than the mark in all; a replica then holds `n - 1`.
#[test]
fn a_refill_ahead_goes_out_while_units_wait_and_holds_at_most_n_minus_1() {
    let hot = Hot::new();
    let (local, charges) = (&hot.local, hot.charges());
    hot.one_held_four_waiting();
    // The mark is 6 again: the next request leaves 4 in all, and asks for what the lease
    // lacks while those wait.
    let mut ahead = local.plan(&charges);
    assert!(matches!(ahead.charges[0].how, How::Ahead { ask: 5, .. }));
    ahead.settle(Some(Ok(admitted(71, 5)))).unwrap();
    assert_eq!(held(local), (0, 9), "9 held in all: n - 1");
}

/// A lease that cannot hold twice what its key spends in a round trip gets no mark: it is
/// refilled when it runs out, a whole lease per call.
#[test]
fn a_lease_spent_faster_than_it_can_hold_is_refilled_when_it_runs_out() {
    let hot = Hot::new();
    let (local, charges) = (&hot.local, hot.charges());
    // Five units asked for while the refill was out: more than (10 - 1) / 2.
    hot.fill(5);
    for _ in 0..9 {
        assert!(local.answer(&charges, true).is_some(), "no refill ahead");
    }
    assert_refills_anew(local, &charges);
}

/// A request paid here whose check only refills ahead of need is answered at once; what it
/// spent never goes back, whatever becomes of the refill's call.
#[test]
fn a_detached_request_keeps_what_it_spent() {
    let hot = Hot::new();
    let (local, charges) = (&hot.local, hot.charges());
    hot.fill(1);
    hot.pay(8);
    assert_eq!(held(local), (1, 0));
    let mut ahead = local.plan(&charges);
    let decision = ahead.detach().expect("paid here");
    assert!(decision.allowed());
    assert_eq!(decision.source(), DecisionSource::Lease);
    // The call goes away unanswered: nothing comes back, and refills go out again.
    drop(ahead);
    assert_eq!(held(local), (0, 0));
    assert_refills_anew(local, &charges);
    // A plan that must hear from Redis is not answered here.
    let other_key = Key::text("other");
    let other = one(&hot.rule, &other_key, 1);
    assert!(local.plan(&other).detach().is_none());
}

/// A cached denial of a key does not hide the units its lease holds, those that a refill
/// ahead of need would follow included: they were charged before Redis denied.
#[test]
fn units_held_are_spent_before_a_cached_denial() {
    let hot = Hot::new();
    let (local, charges) = (&hot.local, hot.charges());
    let mut refill = local.plan(&charges);
    let mut alone = local.plan(&charges);
    refill.settle(Some(Ok(admitted(0, 10)))).unwrap();
    // Redis had nothing left for the request sent meanwhile: a denial, cached.
    let denial = denial(36_000_000);
    assert!(!alone.settle(Some(Ok(denial))).unwrap().allowed());
    for _ in 0..8 {
        let decision = local.answer(&charges, true).expect("paid here");
        assert_eq!(decision.source(), DecisionSource::Lease);
    }
    // The last unit would send a refill ahead of need: planned, not denied here.
    assert!(local.answer(&charges, true).is_none());
    let mut ahead = local.plan(&charges);
    assert!(matches!(ahead.charges[0].how, How::Ahead { .. }));
    // Redis had nothing for it: the denial stands, and answers the next request.
    assert!(ahead.settle(Some(Ok(admitted(0, 0)))).unwrap().allowed());
    let decision = local.answer(&charges, true).expect("denied here");
    assert!(!decision.allowed());
    assert_eq!(decision.source(), DecisionSource::DenyCache);
}

/// A request that costs more than the units left takes the refill's units that wait too
/// (nothing is dropped); one that costs a whole lease or more goes to Redis alone; one of
/// cost 0 is answered here only while the lease lives; a reset while a refill is out keeps
/// none of its units.
#[test]
fn costs_a_lease_cannot_pay_and_resets_lose_nothing_and_keep_nothing() {
    let hot = Hot::new();
    let (local, charges) = (&hot.local, hot.charges());
    hot.one_held_four_waiting();
    let costly = |cost| one(&hot.rule, &hot.key, cost);
    let decision = local
        .answer(&costly(3), false)
        .expect("1 left and 4 waiting");
    assert!(decision.allowed());
    assert_eq!(held(local), (2, 0));
    // A whole lease: Redis decides, and nothing here moves.
    assert!(local.answer(&costly(10), true).is_none());
    assert!(matches!(local.plan(&costly(10)).charges[0].how, How::Sent));
    assert_eq!(held(local), (2, 0));
    // Past the lease's time, a request of cost 0 is not answered from it.
    assert!(local.answer(&costly(0), true).is_some());
    hot.clock.advance(std::time::Duration::from_secs(61));
    assert!(local.answer(&costly(0), true).is_none());
    // A refill out when the key is reset brings no unit.
    warm(local, &hot.rule, &hot.key);
    let mut refill = local.plan(&charges);
    assert!(matches!(refill.charges[0].how, How::Refill { .. }));
    local.forget(&hot.rule, &hot.key, true);
    assert!(refill.settle(Some(Ok(admitted(90, 10)))).unwrap().allowed());
    assert_eq!(held(local), (0, 0));
}

/// A lease of a window's rule lives no longer than the window, on the clock of the node
/// that charged it: a cluster's charges across slots each have their node's time, and the
/// first node's time is no one else's.
#[test]
fn a_window_lease_ends_with_its_own_nodes_window() {
    let clock = ManualClock::new(1_000_000);
    let local = local(&clock);
    let rule = rule("windowed", Algorithm::FixedWindow, 100, 60_000_000)
        .with_lease(10, std::time::Duration::from_secs(60))
        .unwrap();
    let key = Key::text("k");
    let charges = one(&rule, &key, 1);
    warm(&local, &rule, &key);
    let mut refill = local.plan(&charges);
    assert!(matches!(refill.charges[0].how, How::Refill { .. }));
    // The call's first node says 59 s into the window; the node that charged this key,
    // 1 s into it: the lease lives 59 s, not 1 s.
    let reply = Reply {
        now: 59_000_000,
        times: Some(vec![61_000_000].into()),
        ..admitted(90, 10)
    };
    assert!(refill.settle(Some(Ok(reply))).unwrap().allowed());
    clock.advance(std::time::Duration::from_secs(2));
    assert!(
        local.answer(&charges, true).is_some(),
        "the lease lives on its own node's window"
    );
}

/// Units that wait behind those held live until their own time; a batch that joins them
/// lives no longer, though its own time would run later.
#[test]
fn waiting_units_live_no_longer_than_their_time() {
    let hot = Hot::new();
    let (local, charges) = (&hot.local, hot.charges());
    // A mark of 6; a refill ahead of 4, sent 60 s before the units that wait expire.
    hot.one_held_four_waiting();
    // 30 s later, another asks for 5, joining the units that wait (their time: 60 s after
    // the first refill ahead was sent).
    hot.clock.advance(std::time::Duration::from_secs(30));
    let mut second = local.plan(&charges);
    assert!(matches!(second.charges[0].how, How::Ahead { ask: 5, .. }));
    second.settle(Some(Ok(admitted(71, 5)))).unwrap();
    assert_eq!(held(local), (0, 9));
    // Past the first refill ahead's time, though within the second's: nothing is left.
    hot.clock.advance(std::time::Duration::from_secs(31));
    assert!(local.answer(&charges, true).is_none());
    assert_refills_anew(local, &charges);
}

/// A lease entry evicted and made again does not take back the units of a request that
/// was paid from the entry before it: a give-back of the old entry's lease never lands in
/// the new one.
#[test]
fn a_give_back_of_an_evicted_lease_never_lands_in_the_next() {
    let hot = Hot::new();
    // One leased key per shard.
    let local = replica(&hot.clock, SHARDS);
    let strict = rule("strict", Algorithm::FixedWindow, 1, 3_600_000_000);
    let both = [
        Charge {
            rule: &hot.rule,
            key: &hot.key,
            cost: 1,
        },
        Charge {
            rule: &strict,
            key: &hot.key,
            cost: 1,
        },
    ];
    // Only the strict rule is sent: it denies.
    let strict_denies = denial(3_600_000_000);
    let refill = |local: &Arc<Replica>| {
        let charges = hot.charges();
        warm(local, &hot.rule, &hot.key);
        let mut plan = local.plan(&charges);
        assert!(matches!(plan.charges[0].how, How::Refill { .. }));
        assert!(plan.settle(Some(Ok(admitted(90, 10)))).unwrap().allowed());
    };
    refill(&local);
    // A request paid from the lease, waiting for Redis's answer of its other rule.
    let mut stale = local.plan(&both);
    assert!(matches!(stale.charges[0].how, How::Leased(..)));
    // The lease expires; a key of the same shard takes its place.
    hot.clock.advance(std::time::Duration::from_secs(61));
    let slot = local.leases.index(&(lease_key(&hot.rule), hot.key.clone()));
    let other = (0..)
        .map(|i| Key::text(format!("other-{i}")))
        .find(|k| local.leases.index(&(lease_key(&hot.rule), k.clone())) == slot)
        .unwrap();
    let theirs = one(&hot.rule, &other, 1);
    drop(local.plan(&theirs));
    // The key comes back: a new entry, a new lease, one unit spent of it.
    local.leases.remove(&(lease_key(&hot.rule), other.clone()));
    refill(&local);
    assert!(local.answer(&hot.charges(), true).is_some());
    assert_eq!(held(&local), (8, 0));
    // The old request is denied by its other rule: its unit is not this lease's.
    assert!(!stale.settle(Some(Ok(strict_denies))).unwrap().allowed());
    assert_eq!(
        held(&local),
        (8, 0),
        "a unit of the evicted lease came back"
    );
}

/// Units of a fixed window left unspent when their lease expires ride on the key's next
/// call, once, with the time they were charged; a token bucket's are dropped; a reset drops
/// those waiting.
#[test]
fn unspent_units_of_a_window_go_back_with_the_next_call_once() {
    let clock = ManualClock::new(1_000_000);
    let local = local(&clock);
    let key = Key::text("k");
    for algorithm in [Algorithm::FixedWindow, Algorithm::TokenBucket] {
        let rule = rule(format!("back-{algorithm}"), algorithm, 100, 3_600_000_000)
            .with_lease(10, std::time::Duration::from_secs(1))
            .unwrap();
        let charges = one(&rule, &key, 1);
        let lease_then_expire = |reset: bool| {
            warm(&local, &rule, &key);
            let mut refill = local.plan(&charges);
            assert!(matches!(
                refill.charges[0].how,
                How::Refill { lease: 10, .. }
            ));
            let charged = clock.now_micros();
            let mut reply = admitted(90, 10);
            reply.now = charged;
            assert!(refill.settle(Some(Ok(reply))).unwrap().allowed());
            for _ in 0..3 {
                assert!(local.answer(&charges, true).is_some());
            }
            if reset {
                local.forget(&rule, &key, true);
            }
            // Seen 2 s ago: the next request pays its cost alone, and carries what is left.
            clock.advance(std::time::Duration::from_secs(2));
            let next = local.plan(&charges);
            assert!(matches!(next.charges[0].how, How::Sent));
            (next, charged)
        };
        let (mut next, charged) = lease_then_expire(false);
        let sent = next.prepared("p", &charges);
        if algorithm.lease_gives_back() {
            assert_eq!(sent[0].give_back, Some((6, charged)), "{algorithm}");
        } else {
            assert_eq!(sent[0].give_back, None, "{algorithm}");
        }
        // The call fails: whether they went back is not known; they are not sent again.
        assert!(next.settle(Some(Err(StoreError::Timeout))).is_err());
        let again = local.plan(&charges);
        assert_eq!(again.prepared("p", &charges)[0].give_back, None);
        drop(again);
        // A reset drops them.
        let (next, _) = lease_then_expire(true);
        assert_eq!(next.prepared("p", &charges)[0].give_back, None);
    }
}

/// The numbers of a rule that admitted a denied request age as the reference model's do: a
/// token bucket's or GCRA's units come back in the cached answer as they would in Redis.
#[test]
fn an_admitting_rules_numbers_age_as_the_model_does() {
    use super::denial::{Denial, aged_entry, exact_limits};
    use crate::algorithm::State;
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
        let limits = Limits::new(10, 1_000_000, 4).unwrap();
        let spec = RuleSpec::new("r", algorithm, limits).unwrap();
        let exact = exact_limits(&spec).expect("ages exactly");
        // Spend the bucket down at various times, then age its outcome and compare.
        let mut state: Option<State> = None;
        let mut now = 5_000_000u64;
        for step in 0..40u64 {
            now += (step * 37_001) % 250_000;
            if algorithm.check(&limits, state.as_ref(), now, 1).allowed {
                algorithm.commit(&limits, &mut state, now, 1);
            }
            // The numbers kept: of a denied request (uncharged), or of one admitted (charged,
            // then the state is the one after its charge), at costs 1 and 2.
            let cost = 1 + step % 2;
            let (outcome, after) =
                if step % 3 == 0 && algorithm.check(&limits, state.as_ref(), now, cost).allowed {
                    let outcome = algorithm.check(&limits, state.as_ref(), now, cost);
                    let mut after = state.clone();
                    algorithm.commit(&limits, &mut after, now, cost);
                    (outcome, after)
                } else {
                    (
                        algorithm.uncharged(&limits, state.as_ref(), now, cost),
                        state.clone(),
                    )
                };
            if !outcome.allowed {
                continue;
            }
            let entry = Denial {
                outcome,
                cost,
                at: now,
                until: u64::MAX,
                denies: false,
            };
            for later in [1, 99_999, 100_000, 250_001, 400_000, 2_000_000] {
                assert_eq!(
                    aged_entry(&entry, now + later, Some(&exact), algorithm),
                    algorithm.uncharged(&limits, after.as_ref(), now + later, cost),
                    "{algorithm}, step {step}, {later} µs later"
                );
            }
        }
    }
    // A split or leased rule's numbers are not Redis's whole key's: they do not age so.
    let limits = Limits::new(10, 1_000_000, 10).unwrap();
    let split = RuleSpec::new("s", Algorithm::TokenBucket, limits)
        .unwrap()
        .with_parts(2)
        .unwrap();
    assert!(exact_limits(&split).is_none());
    let log = RuleSpec::new("l", Algorithm::SlidingWindowLog, limits).unwrap();
    assert!(exact_limits(&log).is_none());
}

/// A kept rule's numbers never go back to older ones (a denial settled after a later
/// admission), live as long as the longest denial they serve, are refreshed by an admission
/// (of any cost when they age exactly), and a denying entry ends with an admission.
#[test]
fn kept_numbers_never_go_back_and_a_denial_ends_with_an_admission() {
    use super::denial::Denial;
    use super::table::Table;
    let table: Table<Denial> = Table::new(64);
    let key = (1u64, Key::text("global"));
    let numbers = |remaining| Outcome {
        allowed: true,
        limit: 10,
        remaining,
        reset: 0,
        retry_after: 0,
        window: 1,
    };
    let admitting = |remaining, at, until| Denial {
        outcome: numbers(remaining),
        cost: 1,
        at,
        until,
        denies: false,
    };
    let kept = |table: &Table<Denial>| table.shard(&key).get(&key).copied();
    table.keep(key.clone(), admitting(5, 200, 1_000), 200);
    table.keep(key.clone(), admitting(7, 100, 5_000), 300);
    let entry = kept(&table).unwrap();
    assert_eq!(
        (entry.outcome.remaining, entry.at, entry.until),
        (5, 200, 5_000)
    );
    // Numbers that do not age exactly are those of one cost: another cost's admission leaves
    // them; numbers that do (the rule's whole state) are refreshed by any.
    table.admitted(key.clone(), 2, &numbers(1), 400, false);
    assert_eq!(kept(&table).unwrap().outcome.remaining, 5);
    table.admitted(key.clone(), 2, &numbers(4), 400, true);
    assert_eq!(kept(&table).unwrap().outcome.remaining, 4);
    table.admitted(key.clone(), 1, &numbers(3), 400, true);
    assert_eq!(kept(&table).unwrap().outcome.remaining, 3);
    // Numbers that cannot age exactly last until their next unit after a refresh.
    table.admitted(key.clone(), 1, &numbers(2), 450, false);
    assert_eq!(kept(&table).unwrap().until, 451);
    let denying = Denial {
        outcome: Outcome {
            allowed: false,
            retry_after: 1_000,
            ..numbers(0)
        },
        cost: 1,
        at: 500,
        until: 1_500,
        denies: true,
    };
    table.keep(key.clone(), denying, 500);
    assert!(kept(&table).unwrap().denies);
    table.admitted(key.clone(), 1, &numbers(9), 600, true);
    assert!(kept(&table).is_none(), "a denial ends with an admission");
}

/// A check whose charges all went to Redis as they are is settled in one pass: the same
/// decision (outcomes, source, time, each charge's time) and the same denials kept as when it
/// is settled charge by charge, admitted or denied, on one clock or on a cluster's several.
#[test]
fn a_check_sent_as_it_is_settles_as_charge_by_charge() {
    let a = rule("a", Algorithm::TokenBucket, 10, 60_000_000);
    let b = rule("b", Algorithm::Gcra, 5, 1_000_000);
    let key = Key::text("k");
    let charges = [one(&a, &key, 1)[0], one(&b, &key, 2)[0]];
    let allowing = Outcome {
        allowed: true,
        limit: 10,
        remaining: 7,
        reset: 3_000_000,
        retry_after: 0,
        window: 6_000_000,
    };
    for (allowed, times) in [(true, false), (true, true), (false, false), (false, true)] {
        let reply = || Reply {
            now: 2_000_000,
            outcomes: if allowed {
                smallvec::smallvec![allowing, allowing]
            } else {
                smallvec::smallvec![allowing, denied(4_000_000, 8_000_000)]
            },
            taken: if allowed {
                smallvec::smallvec![1, 2]
            } else {
                smallvec::smallvec![0, 0]
            },
            times: times.then(|| vec![2_000_000, 2_000_700].into()),
        };
        let clock = ManualClock::new(1_000_000);
        let (fast, general) = (local(&clock), local(&clock));
        // Denied a while ago on both: an admission ends the denial, and keeps its numbers.
        for replica in [&fast, &general] {
            let mut plan = replica.plan(&charges);
            let denial = Reply {
                now: 1_000_000,
                outcomes: smallvec::smallvec![allowing, denied(500_000, 500_000)],
                taken: smallvec::smallvec![0, 0],
                times: None,
            };
            assert!(!plan.settle_charge_by_charge(denial).unwrap().allowed());
        }
        clock.advance(std::time::Duration::from_secs(1));
        let mut plan = fast.plan(&charges);
        assert!(plan.charges.iter().all(|c| matches!(c.how, How::Sent)));
        let one_pass = plan.settle(Some(Ok(reply()))).unwrap();
        let by_charge = general
            .plan(&charges)
            .settle_charge_by_charge(reply())
            .unwrap();
        assert_eq!(one_pass, by_charge);
        assert_eq!(one_pass.allowed(), allowed);
        assert_eq!(one_pass.source(), by_charge.source());
        assert_eq!(one_pass.made_at(), by_charge.made_at());
        for i in 0..2 {
            assert_eq!(one_pass.charged_at(i), by_charge.charged_at(i));
        }
        // What each replica answers next, from its deny cache or not at all.
        clock.advance(std::time::Duration::from_millis(100));
        let next = |replica: &Arc<Replica>| {
            replica
                .answer(&charges, true)
                .map(|d| (d.outcomes().to_vec(), d.source()))
        };
        assert_eq!(next(&fast), next(&general));
        assert_eq!(next(&fast).is_some(), !allowed);
    }
}
