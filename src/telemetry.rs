//! Metric functions over plain values (feature `metrics`): store latency and errors, circuit
//! breakers, memory-store keys and evictions, reloads, waiting and shed requests, and the
//! per-thread cache of metric handles that the decision metrics of `observe` record through.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use metrics::{
    Counter, Histogram, Key, Label, Metadata, Recorder, Unit, counter, describe_counter,
    describe_gauge, describe_histogram, gauge,
};
/// The metadata of tollgate's metrics.
static METADATA: Metadata<'static> =
    Metadata::new("tollgate", metrics::Level::INFO, Some(module_path!()));

/// The most handles a thread keeps; past it, the cache starts again.
const MAX_CACHED: usize = 65_536;

/// What a cached handle counts: integers, so that a lookup hashes a few words.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot {
    /// The recorder the handle was registered with, by address: a recorder installed later
    /// gets its own, unless it lies where one dropped before lay (a local recorder of the same
    /// stack frame, say) and this thread records the same snapshot through both.
    pub(crate) recorder: usize,
    /// The snapshot whose rule and tier indices follow, or for store metrics the layer (both
    /// unique per process, unlike addresses).
    pub(crate) snapshot: u64,
    pub(crate) metric: Metric,
    pub(crate) rule: u16,
    pub(crate) tier: u16,
    /// The outcome label, by address: a static text (two call sites with the same text may get
    /// two handles of the same series, which count as one).
    pub(crate) outcome: OutcomeLabel,
    /// The route label, by address and length (a MatchedPath's, or the policy's own copy):
    /// checked against the stored text on a hit.
    pub(crate) route: (usize, usize),
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Metric {
    Requests,
    RuleDecisions,
    StoreLatency,
    StoreErrors,
    MeteredGranted,
    MeteredSpent,
    MeteredEnded,
}

/// The handles a thread keeps at hand, the last used of each: by metric, and for rule
/// decisions by the rule's index in its policy, modulo 4 (rules 0 and 4 of one request share
/// a place, and find their handles in the map).
const AT_HAND: usize = 16;

impl Slot {
    /// Where the handle of this slot is kept at hand (two slots may share a place: a hit is
    /// checked against the whole slot).
    fn at_hand(&self) -> usize {
        (self.metric as usize * 4 + usize::from(self.rule % 4)) % AT_HAND
    }
}

/// A static outcome label, compared and hashed by address.
#[derive(Clone, Copy)]
pub(crate) struct OutcomeLabel(pub(crate) &'static str);

impl PartialEq for OutcomeLabel {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.0, other.0) && self.0.len() == other.0.len()
    }
}

impl Eq for OutcomeLabel {}

impl std::hash::Hash for Slot {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_usize(self.recorder);
        state.write_u64(self.snapshot);
        state.write_u64(
            (self.metric as u64) << 32 | u64::from(self.rule) << 16 | u64::from(self.tier),
        );
        state.write_usize(self.outcome.0.as_ptr() as usize);
        state.write_usize(self.route.0 ^ self.route.1.rotate_left(48));
    }
}

pub(crate) enum Handle {
    Counter(Counter),
    Histogram(Histogram),
}

struct Cached {
    route: Box<str>,
    handle: Handle,
}

/// A thread's registered handles, and the last used at each place at hand.
struct Handles {
    by_slot: HashMap<Slot, Rc<Cached>, foldhash::fast::FixedState>,
    /// By [`Slot::at_hand`]: the requests of a thread mostly repeat the slots of the one
    /// before, found here without hashing them.
    last: [Option<(Slot, Rc<Cached>)>; AT_HAND],
}

thread_local! {
    /// Registered handles, per thread: a request records through a lookup and an atomic add,
    /// never through the recorder's registry (or an allocation).
    static HANDLES: RefCell<Handles> = const {
        RefCell::new(Handles {
            by_slot: HashMap::with_hasher(foldhash::fast::FixedState::with_seed(11)),
            last: [const { None }; AT_HAND],
        })
    };
}

/// The current recorder's address.
pub(crate) fn recorder() -> usize {
    metrics::with_recorder(|recorder| (recorder as *const dyn Recorder).cast::<()>() as usize)
}

/// Records through the handle of `slot`, registering it with `labels` the first time.
pub(crate) fn record(
    slot: Slot,
    route: &str,
    labels: impl FnOnce() -> (&'static str, Vec<Label>),
    use_handle: impl FnOnce(&Handle),
) {
    let _ = HANDLES.try_with(|handles| {
        // A recorder that records tollgate's metrics from inside a recording: not counted.
        let Ok(mut handles) = handles.try_borrow_mut() else {
            return;
        };
        let handles = &mut *handles;
        let at_hand = slot.at_hand();
        if let Some((at, cached)) = &handles.last[at_hand]
            && *at == slot
            && *cached.route == *route
        {
            use_handle(&cached.handle);
            return;
        }
        if let Some(cached) = handles.by_slot.get(&slot)
            && *cached.route == *route
        {
            use_handle(&cached.handle);
            handles.last[at_hand] = Some((slot, cached.clone()));
            return;
        }
        if handles.by_slot.len() >= MAX_CACHED {
            handles.by_slot.clear();
            handles.last = [const { None }; AT_HAND];
        }
        let (name, labels) = labels();
        let key = Key::from_parts(name, labels);
        let handle = metrics::with_recorder(|recorder| match slot.metric {
            Metric::StoreLatency => Handle::Histogram(recorder.register_histogram(&key, &METADATA)),
            _ => Handle::Counter(recorder.register_counter(&key, &METADATA)),
        });
        use_handle(&handle);
        let cached = Rc::new(Cached {
            route: route.into(),
            handle,
        });
        handles.last[at_hand] = Some((slot, cached.clone()));
        handles.by_slot.insert(slot, cached);
    });
}

pub(crate) fn count(slot: Slot, route: &str, labels: impl FnOnce() -> (&'static str, Vec<Label>)) {
    add(slot, route, labels, 1);
}

/// Adds `n` to the counter of `slot`, registering it with `labels` the first time.
pub(crate) fn add(
    slot: Slot,
    route: &str,
    labels: impl FnOnce() -> (&'static str, Vec<Label>),
    n: u64,
) {
    record(slot, route, labels, |handle| {
        if let Handle::Counter(counter) = handle {
            counter.increment(n);
        }
    });
}

pub(crate) fn label(key: &'static str, value: &str) -> Label {
    Label::new(key, value.to_owned())
}

/// Describes every metric once, for exporters that print help and units.
pub(crate) fn describe() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        describe_counter!(
            "tollgate_requests_total",
            "Requests checked by a tollgate layer, by route pattern, tier and outcome (and layer, \
             when named): stacked layers count a request once each."
        );
        describe_counter!(
            "tollgate_rule_decisions_total",
            "What each rule made of each checked request, by rule, route pattern, tier and outcome \
             (and layer, when named)."
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
            "tollgate_store_replicas",
            "The replicas sharing a Redis store's prefix, as its heartbeat last counted them."
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
            "tollgate_shed_requests_total",
            "Requests shed because the process had too many in flight, by priority."
        );
        describe_gauge!(
            "tollgate_shed_capacity",
            "The capacity an adaptive load shedder learned: the requests low and normal ones share."
        );
        describe_gauge!(
            "tollgate_shed_latency_seconds",
            Unit::Seconds,
            "An adaptive load shedder's latency estimates: the no-load latency (estimate=base) and \
             the latest window's (estimate=recent), both their 90th percentile."
        );
        describe_counter!(
            "tollgate_metered_units_granted_total",
            "Units the store granted metered responses (admissions' chunks and the chunks taken \
             as they streamed), by rule and tier (and layer, when named)."
        );
        describe_counter!(
            "tollgate_metered_units_spent_total",
            "Units metered responses were charged when they ended (settled), by rule and tier \
             (and layer, when named): granted less spent went back to the budget."
        );
        describe_counter!(
            "tollgate_metered_streams_ended_total",
            "Metered responses ended early, by rule, tier and reason: budget (the store refused \
             the next chunk) or store_error (the store failed and the rule does not fail open)."
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

/// The slot of a store metric of `layer`: no rule or tier, the store's name as its route.
#[inline]
fn store_slot(layer: u64, store: &'static str, metric: Metric, outcome: &'static str) -> Slot {
    Slot {
        recorder: recorder(),
        snapshot: layer,
        metric,
        rule: 0,
        tier: 0,
        outcome: OutcomeLabel(outcome),
        route: (store.as_ptr() as usize, store.len()),
    }
}

/// The name and labels a store metric is registered with: the store's, and one of its own
/// (made once, when its handle is first cached).
fn store_labels(
    name: &'static str,
    store: &'static str,
    (label, value): (&'static str, &'static str),
) -> (&'static str, Vec<Label>) {
    (
        name,
        vec![
            Label::from_static_parts("store", store),
            Label::from_static_parts(label, value),
        ],
    )
}

/// One store check that took `latency`: `ok` or `error`.
pub(crate) fn store_latency(
    layer: u64,
    store: &'static str,
    result: &'static str,
    latency: std::time::Duration,
) {
    let slot = store_slot(layer, store, Metric::StoreLatency, result);
    record(
        slot,
        store,
        || {
            store_labels(
                "tollgate_store_check_duration_seconds",
                store,
                ("result", result),
            )
        },
        |handle| {
            if let Handle::Histogram(histogram) = handle {
                histogram.record(latency.as_secs_f64());
            }
        },
    );
}

/// A failed store check, by kind: `timeout`, `unavailable`, `protocol`, `circuit_open`.
pub(crate) fn store_error(layer: u64, store: &'static str, kind: &'static str) {
    count(
        store_slot(layer, store, Metric::StoreErrors, kind),
        store,
        || store_labels("tollgate_store_errors_total", store, ("kind", kind)),
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

/// The replicas a store's heartbeat counted.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn replicas(store: &'static str, count: u32) {
    gauge!("tollgate_store_replicas", "store" => store).set(f64::from(count));
}

/// Keys added to (or, negative, removed from) the process's memory stores.
pub(crate) fn memory_keys(delta: i64) {
    let gauge = gauge!("tollgate_memory_store_keys");
    if delta >= 0 {
        gauge.increment(delta as f64);
    } else {
        gauge.decrement(-delta as f64);
    }
}

/// Keys evicted from a full memory store.
pub(crate) fn evictions(count: u64) {
    counter!("tollgate_memory_store_evictions_total").increment(count);
}

/// A policy offered to a live layer: `installed` or `rejected`.
pub(crate) fn reload(result: &'static str) {
    counter!("tollgate_policy_reloads_total", "result" => result).increment(1);
}

/// A request starts (`true`) or stops waiting for a delay rule.
pub(crate) fn waiting(starts: bool) {
    let gauge = gauge!("tollgate_delayed_requests");
    if starts {
        gauge.increment(1.0);
    } else {
        gauge.decrement(1.0);
    }
}

/// A request shed by load shedding, by its priority.
pub(crate) fn shed(priority: &'static str) {
    counter!("tollgate_shed_requests_total", "priority" => priority).increment(1);
}

/// An adaptive shedder's capacity, and its latency estimates in microseconds (0: not yet).
pub(crate) fn shed_capacity(capacity: usize, base: u64, recent: u64) {
    gauge!("tollgate_shed_capacity").set(capacity as f64);
    gauge!("tollgate_shed_latency_seconds", "estimate" => "base").set(base as f64 / 1e6);
    gauge!("tollgate_shed_latency_seconds", "estimate" => "recent").set(recent as f64 / 1e6);
}

/// Makes the reload counters exist at 0 for a live layer, so that the first rejection is an
/// increase.
pub(crate) fn reloads_start() {
    counter!("tollgate_policy_reloads_total", "result" => "installed").increment(0);
    counter!("tollgate_policy_reloads_total", "result" => "rejected").increment(0);
}

#[cfg(test)]
mod tests {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    use super::*;

    /// The requests counted by route label, as the recorder holds them.
    fn counted(recorder: &DebuggingRecorder) -> Vec<(String, u64)> {
        let mut counts: Vec<(String, u64)> = recorder
            .snapshotter()
            .snapshot()
            .into_vec()
            .into_iter()
            .filter_map(|(key, _, _, value)| {
                let route = key
                    .key()
                    .labels()
                    .find(|l| l.key() == "route")?
                    .value()
                    .to_owned();
                match value {
                    DebugValue::Counter(n) => Some((route, n)),
                    _ => None,
                }
            })
            .collect();
        counts.sort();
        counts
    }

    /// A handle is found again for the slot and the route's text it was registered with, and
    /// only for them: a route at the address of another one gone (the same slot) counts apart,
    /// and a slot in between does not lose the first.
    #[test]
    fn a_handle_is_found_again_only_for_its_slot_and_route() {
        let debugging = DebuggingRecorder::new();
        metrics::with_local_recorder(&debugging, || {
            let mut route = String::from("/a");
            let slot = |route: &str, tier: u16| Slot {
                recorder: recorder(),
                snapshot: u64::MAX,
                metric: Metric::Requests,
                rule: 0,
                tier,
                outcome: OutcomeLabel("allowed"),
                route: (route.as_ptr() as usize, route.len()),
            };
            let registered = std::cell::Cell::new(0);
            let labels = |route: &str| {
                let route = route.to_owned();
                let registered = &registered;
                move || {
                    registered.set(registered.get() + 1);
                    ("test_requests_total", vec![label("route", &route)])
                }
            };
            count(slot(&route, 0), &route, labels(&route));
            count(slot(&route, 0), &route, labels(&route));
            count(slot("/other", 1), "/other", labels("/other"));
            count(slot(&route, 0), &route, labels(&route));
            // Another route's text at the same address, of the same length.
            route.replace_range(.., "/b");
            count(slot(&route, 0), &route, labels(&route));
            count(slot(&route, 0), &route, labels(&route));
            // Registered once for each of the three.
            assert_eq!(registered.get(), 3);
        });
        assert_eq!(
            counted(&debugging),
            [("/a".into(), 3), ("/b".into(), 2), ("/other".into(), 1)]
        );
    }
}
