//! Exactness under concurrency: 500 concurrent requests for one key with a limit of 100, sent
//! through several stores (several connections), admit exactly 100; 50 times per algorithm, on
//! a standalone server and on a 3-primary cluster.

#![cfg(feature = "redis")]

mod support;

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tollgate::Algorithm;
use tollgate::algorithm::{Limits, MAX_PERIOD_MICROS};
use tollgate::key::Key;
use tollgate::store::RuleSpec;
use tollgate::store::{Charge, RedisClusterStore, RedisStore, Store};

const REQUESTS: usize = 500;
const LIMIT: u64 = 100;
const REPEATS: usize = 50;
/// Stores (each with its own connections) the requests are spread over.
const STORES: usize = 4;

/// 100 per 366 days: nothing refills during a run, and a fixed window boundary (every 366 days
/// since the epoch) is never crossed in practice.
fn rule(algorithm: Algorithm) -> Arc<RuleSpec> {
    let limits = Limits::new(LIMIT, MAX_PERIOD_MICROS, LIMIT).unwrap();
    Arc::new(RuleSpec::new("exact", algorithm, limits).unwrap())
}

async fn admitted<S: Store + Clone>(stores: &[S], rule: &Arc<RuleSpec>, key: &Key) -> usize {
    let mut tasks = JoinSet::new();
    for i in 0..REQUESTS {
        let store = stores[i % stores.len()].clone();
        let rule = rule.clone();
        let key = key.clone();
        tasks.spawn(async move {
            let charge = [Charge {
                rule: &rule,
                key: &key,
                cost: 1,
            }];
            store.check(&charge).await
        });
    }
    let mut admitted = 0;
    while let Some(result) = tasks.join_next().await {
        let decision = result
            .expect("check task")
            .expect("no check fails under load");
        admitted += usize::from(decision.allowed());
    }
    admitted
}

async fn exactly_the_limit<S: Store + Clone>(stores: &[S], algorithm: Algorithm, name: &str) {
    let rule = rule(algorithm);
    for repeat in 0..REPEATS {
        let key = Key::text(format!("{name}-{repeat}"));
        let admitted = admitted(stores, &rule, &key).await;
        assert_eq!(
            admitted, LIMIT as usize,
            "{algorithm}: repeat {repeat} admitted {admitted} of {REQUESTS}, limit {LIMIT}"
        );
    }
}

async fn standalone_stores(name: &str) -> Vec<RedisStore> {
    let prefix = support::unique_prefix(name);
    let mut stores = Vec::new();
    for _ in 0..STORES {
        stores.push(
            RedisStore::builder(support::standalone().url())
                .prefix(&prefix)
                .pool_size(2)
                .response_timeout(Duration::from_secs(10))
                .connect()
                .await
                .unwrap(),
        );
    }
    stores
}

async fn cluster_stores(name: &str) -> Vec<RedisClusterStore> {
    let prefix = support::unique_prefix(name);
    let mut stores = Vec::new();
    for _ in 0..STORES {
        stores.push(
            RedisClusterStore::builder(support::cluster().urls())
                .prefix(&prefix)
                .response_timeout(Duration::from_secs(10))
                .connect()
                .await
                .unwrap(),
        );
    }
    stores
}

macro_rules! exactness {
    ($standalone:ident, $cluster:ident, $algorithm:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $standalone() {
            let stores = standalone_stores(stringify!($standalone)).await;
            exactly_the_limit(&stores, $algorithm, stringify!($standalone)).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $cluster() {
            let stores = cluster_stores(stringify!($cluster)).await;
            exactly_the_limit(&stores, $algorithm, stringify!($cluster)).await;
        }
    };
}

exactness!(
    standalone_token_bucket_admits_exactly_the_limit,
    cluster_token_bucket_admits_exactly_the_limit,
    Algorithm::TokenBucket
);
exactness!(
    standalone_gcra_admits_exactly_the_limit,
    cluster_gcra_admits_exactly_the_limit,
    Algorithm::Gcra
);
exactness!(
    standalone_fixed_window_admits_exactly_the_limit,
    cluster_fixed_window_admits_exactly_the_limit,
    Algorithm::FixedWindow
);
exactness!(
    standalone_sliding_log_admits_exactly_the_limit,
    cluster_sliding_log_admits_exactly_the_limit,
    Algorithm::SlidingWindowLog
);
exactness!(
    standalone_sliding_counter_admits_exactly_the_limit,
    cluster_sliding_counter_admits_exactly_the_limit,
    Algorithm::SlidingWindowCounter
);
