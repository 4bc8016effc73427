//! Refunds give back the units of the charge they name, and no other request's: on the memory
//! store and on Redis, for the sliding log, whose entries record when each unit was charged.

mod support;

use std::time::Duration;

use tollgate::Algorithm;
use tollgate::algorithm::Limits;
use tollgate::clock::ManualClock;
use tollgate::key::Key;
use tollgate::store::{
    Adjustment, Change, Charge, MemoryStore, RedisClusterStore, RedisStore, RuleSpec, Store,
};

const START: u64 = 1_700_000_000_000_000;

/// Two requests of a sliding log of 2 per 10 s, 5 s apart; the first one's unit is refunded at
/// 6 s (charged at 0 s). At 11.5 s the first one's entry would have left the window anyway, and
/// the second one's is still in it: with the one taken at 6 s, the log is full. A refund that
/// dropped the newest entry (the second request's) instead admits a third request there.
async fn refund_of_an_earlier_request<S: Store>(store: &S, clock: &ManualClock) {
    let rule = RuleSpec::new(
        "log",
        Algorithm::SlidingWindowLog,
        Limits::new(2, 10_000_000, 2).unwrap(),
    )
    .unwrap();
    let key = Key::text("refunded");
    let charge = [Charge {
        rule: &rule,
        key: &key,
        cost: 1,
    }];
    let first = store.check(&charge).await.unwrap();
    assert!(first.allowed());
    let first_at = first.made_at();
    clock.advance(Duration::from_secs(5));
    assert!(store.check(&charge).await.unwrap().allowed());
    clock.advance(Duration::from_secs(1));
    let refund = [Adjustment {
        rule: &rule,
        key: &key,
        change: Change::Refund(1),
        charged_at: first_at,
    }];
    store.adjust(&refund).await.unwrap();
    assert!(
        store.check(&charge).await.unwrap().allowed(),
        "the refunded unit"
    );
    clock.advance(Duration::from_millis(5_500));
    assert!(
        !store.check(&charge).await.unwrap().allowed(),
        "the second request's entry is still in the window"
    );
}

#[tokio::test]
async fn a_sliding_log_refund_drops_its_own_entry_memory() {
    let clock = ManualClock::new(START);
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    refund_of_an_earlier_request(&store, &clock).await;
}

#[tokio::test]
async fn a_sliding_log_refund_drops_its_own_entry_redis() {
    let clock = ManualClock::new(START);
    let store = RedisStore::builder(support::standalone().url())
        .prefix(support::unique_prefix("refund"))
        .clock(clock.clone())
        .connect()
        .await
        .unwrap();
    refund_of_an_earlier_request(&store, &clock).await;
}

#[tokio::test]
async fn a_sliding_log_refund_drops_its_own_entry_cluster() {
    let clock = ManualClock::new(START);
    let store = RedisClusterStore::builder(support::cluster().urls())
        .prefix(support::unique_prefix("refund"))
        .clock(clock.clone())
        .connect()
        .await
        .unwrap();
    refund_of_an_earlier_request(&store, &clock).await;
}
