//! The metrics, through the `metrics` facade (feature `metrics`).

use std::cell::RefCell;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Arc;

use hashbrown::HashTable;
use metrics::{
    Key, Label, Metadata, Unit, counter, describe_counter, describe_gauge, describe_histogram,
    gauge,
};

use super::{Decided, Verdict, rule_outcome};

/// The metadata of tollgate's metrics.
static METADATA: Metadata<'static> =
    Metadata::new("tollgate", metrics::Level::INFO, Some(module_path!()));

/// The most keys a thread keeps; past it, the cache starts again.
const MAX_CACHED_KEYS: usize = 8192;

/// A metric's key, built once per label values and thread: the per-request metrics cost a
/// lookup, never an allocation (building a `Key` allocates its labels even when no recorder
/// is installed).
struct CachedKey {
    hash: u64,
    name: &'static str,
    values: Box<[Box<str>]>,
    key: Key,
}

thread_local! {
    static KEYS: RefCell<HashTable<CachedKey>> = const { RefCell::new(HashTable::new()) };
}

fn hash_of(name: &'static str, labels: &[(&'static str, &str)]) -> u64 {
    let mut hasher = foldhash::fast::FixedState::with_seed(7).build_hasher();
    name.hash(&mut hasher);
    for (_, value) in labels {
        value.hash(&mut hasher);
    }
    hasher.finish()
}

/// Calls `f` with the key of metric `name` with `labels` (always the same label names for one
/// metric name).
fn with_key(name: &'static str, labels: &[(&'static str, &str)], f: impl FnOnce(&Key)) {
    let hash = hash_of(name, labels);
    let same = |e: &CachedKey| {
        e.hash == hash
            && e.name == name
            && e.values.len() == labels.len()
            && e.values.iter().zip(labels).all(|(a, (_, b))| **a == **b)
    };
    KEYS.with(|keys| {
        // A recorder that records tollgate's metrics from inside a recording: not counted.
        let Ok(mut keys) = keys.try_borrow_mut() else {
            return;
        };
        if keys.find(hash, same).is_none() {
            if keys.len() >= MAX_CACHED_KEYS {
                keys.clear();
            }
            let key = Key::from_parts(
                name,
                labels
                    .iter()
                    .map(|(k, v)| Label::new(*k, (*v).to_owned()))
                    .collect::<Vec<_>>(),
            );
            keys.insert_unique(
                hash,
                CachedKey {
                    hash,
                    name,
                    values: labels.iter().map(|(_, v)| Box::from(*v)).collect(),
                    key,
                },
                |e| e.hash,
            );
        }
        if let Some(entry) = keys.find(hash, same) {
            f(&entry.key);
        }
    });
}

fn increment(name: &'static str, labels: &[(&'static str, &str)]) {
    with_key(name, labels, |key| {
        metrics::with_recorder(|recorder| recorder.register_counter(key, &METADATA).increment(1))
    });
}

/// Describes every metric once, for exporters that print help and units.
pub(crate) fn describe() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        describe_counter!(
            "tollgate_requests_total",
            "Requests checked by tollgate, by route pattern, tier and outcome."
        );
        describe_counter!(
            "tollgate_rule_decisions_total",
            "What each rule made of each checked request, by rule, route pattern, tier and outcome."
        );
        describe_histogram!(
            "tollgate_store_check_duration_seconds",
            Unit::Seconds,
            "How long one check of the rate-limit store took, by store and result."
        );
        describe_counter!(
            "tollgate_store_errors_total",
            "Failed checks of the rate-limit store, by store and kind."
        );
        describe_gauge!(
            "tollgate_circuit_breaker_open",
            "1 while the circuit breaker of a store's server is open, else 0."
        );
        describe_gauge!(
            "tollgate_memory_store_keys",
            "Keys held by the memory stores of the process (counted at their sweeps)."
        );
        describe_counter!(
            "tollgate_memory_store_evictions_total",
            "Keys evicted because a memory store was full."
        );
        describe_counter!(
            "tollgate_policy_reloads_total",
            "Policies offered to live layers, by result: installed or rejected."
        );
        describe_gauge!(
            "tollgate_delayed_requests",
            "Requests waiting for the budget of a delay rule."
        );
        describe_counter!(
            "tollgate_decision_events_dropped_total",
            "Decision events dropped because the hook's channel was full."
        );
        describe_counter!(
            "tollgate_denial_log_suppressed_total",
            "Denials not logged because the rejection log's lines of the second were spent."
        );
    });
}

/// A decided request.
pub(crate) fn decided(
    store: &'static str,
    decided: &Decided<'_>,
    route: Option<&Arc<str>>,
    tier: &Arc<str>,
) {
    let route = route.map_or("", |r| &**r);
    increment(
        "tollgate_requests_total",
        &[
            ("route", route),
            ("tier", tier),
            ("outcome", decided.verdict.as_str()),
        ],
    );
    let outcomes = decided.decision.map(|d| d.outcomes());
    for (n, &i) in decided.applied.iter().enumerate() {
        let rule = &decided.snapshot.rules[usize::from(i)];
        let allowed = outcomes.and_then(|o| o.get(n)).map(|o| o.allowed);
        increment(
            "tollgate_rule_decisions_total",
            &[
                ("rule", rule.spec.name()),
                ("route", route),
                ("tier", tier),
                (
                    "outcome",
                    rule_outcome(decided.verdict, rule.mode, rule.on_store_error, allowed),
                ),
            ],
        );
    }
    if let Some(latency) = decided.store_latency {
        let result = match decided.verdict {
            Verdict::FailedOpen
            | Verdict::FailedClosed
            | Verdict::LocalAllowed
            | Verdict::LocalDenied => "error",
            _ => "ok",
        };
        with_key(
            "tollgate_store_check_duration_seconds",
            &[("store", store), ("result", result)],
            |key| {
                metrics::with_recorder(|recorder| {
                    recorder
                        .register_histogram(key, &METADATA)
                        .record(latency.as_secs_f64())
                })
            },
        );
    }
}

/// Shadow rules that would have denied an admitted request.
pub(crate) fn shadowed(
    snapshot: &crate::policy::snapshot::Snapshot,
    rules: &[u16],
    route: Option<&Arc<str>>,
    tier: &Arc<str>,
) {
    let route = route.map_or("", |r| &**r);
    for &i in rules {
        increment(
            "tollgate_rule_decisions_total",
            &[
                ("rule", snapshot.rules[usize::from(i)].spec.name()),
                ("route", route),
                ("tier", tier),
                ("outcome", "shadow_denied"),
            ],
        );
    }
}

/// A failed store check, by kind: `timeout`, `unavailable`, `protocol`, `circuit_open`.
pub(crate) fn store_error(store: &'static str, kind: &'static str) {
    increment(
        "tollgate_store_errors_total",
        &[("store", store), ("kind", kind)],
    );
}

/// A circuit breaker opened or closed.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn breaker(store: &'static str, server: &Arc<str>, open: bool) {
    gauge!(
        "tollgate_circuit_breaker_open",
        "store" => store,
        "server" => metrics::SharedString::from(server.clone()),
    )
    .set(if open { 1.0 } else { 0.0 });
}

/// The keys of the process's memory stores.
pub(crate) fn memory_keys(keys: i64) {
    gauge!("tollgate_memory_store_keys").set(keys as f64);
}

/// Keys evicted from a full memory store.
pub(crate) fn evictions(count: u64) {
    counter!("tollgate_memory_store_evictions_total").increment(count);
}

/// A policy offered to a live layer: `installed` or `rejected`.
pub(crate) fn reload(result: &'static str) {
    counter!("tollgate_policy_reloads_total", "result" => result).increment(1);
}

/// Requests waiting for a delay rule.
pub(crate) fn waiting(count: usize) {
    gauge!("tollgate_delayed_requests").set(count as f64);
}
