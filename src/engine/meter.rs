//! [`Meter`]: the budget a streamed response spends as it is produced, taken from the store a
//! chunk at a time and settled to what was spent when the response ends.
//!
//! ```
//! use tollgate::{Meter, Spend};
//!
//! // In a handler: the producer spends as it generates, and stops when the budget is gone.
//! async fn generate(meter: Option<Meter>, tokens: u64) -> u64 {
//!     let mut produced = 0;
//!     for _ in 0..tokens {
//!         if let Some(meter) = &meter {
//!             if meter.spend(1).await == Spend::Exhausted {
//!                 break; // the layer ends the response with the refusal
//!             }
//!         }
//!         produced += 1; // ...and yield the token
//!     }
//!     produced
//! }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use http::HeaderName;

use smallvec::SmallVec;

use super::account::Account;
use super::local::Counted;
use crate::key::Key;
use crate::policy::RuleIndices;
use crate::policy::metering::{FrameUnits, Metering};
use crate::policy::snapshot::Snapshot;
use crate::response::Refusal;
use crate::runtime::Origin;
use crate::store::{Change, StoreError, StoreFuture};
use crate::{Decision, FailureMode};

/// A spend waiting for the next chunk.
pub(crate) type SpendFuture = Pin<Box<dyn Future<Output = Spend> + Send>>;

/// What [`Meter::spend`] answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spend {
    /// The units are within the budget: go on.
    Holds,
    /// The budget is spent (or the store refused the next chunk): stop producing. The layer
    /// ends the response at its next frame with the refusal.
    Exhausted,
}

/// The budget of one streamed response, for the rules that [meter](crate::Rule::meter) it:
/// found in the request's extensions (`Option<Extension<Meter>>` in axum) when such a rule
/// applies. Clones share one budget.
///
/// The producer calls [`spend`](Meter::spend) with the units it is about to generate (or
/// [`record`](Meter::record) with units it already has). The meter holds the units the store
/// granted (the admission's chunk first) and takes the next chunk ahead of need, in the
/// background, when less than half a chunk is left (a producer waits for the store only when
/// it outruns that); when the store refuses a chunk the producer needs, it is told
/// [`Spend::Exhausted`] and should stop: its units are what the budget protects. The layer
/// ends the response at its next frame (or at its end, if the producer ends it), in the form
/// the client reads:
///
/// - **server-sent events** (`text/event-stream`): a final event, `event: error`, whose data is
///   the `quota-exceeded` problem document (type, title, status 429, `violated-policies`, and
///   `retry-after`: the seconds a refused request's `Retry-After` gives), with the event
///   stream's `retry` field (the same time in milliseconds), then the end of the stream;
/// - **gRPC** (`application/grpc`): trailers with `grpc-status: 8` (`RESOURCE_EXHAUSTED`),
///   `grpc-retry-pushback-ms` and `google.rpc.RetryInfo`, as a refused call's;
/// - **other bodies**: trailers with `Retry-After` and the budget fields, then the end of the
///   body. An HTTP/2 client reads them; an HTTP/1.1 client reads trailers only if it asked for
///   them (`TE: trailers`), else it sees a body that ends early.
///
/// Once the budget is spent, the layer passes on at most 64 more data frames (those the
/// producer made before it was told, which it paid for when it spent before each) and then
/// ends the response; frames still queued past those are spent and not delivered. A response
/// whose rule [counts its frames](crate::Rule::meter_frames) passes none: its frames are
/// counted as they pass.
///
/// When the response ends, or is dropped (the client disconnected), and the last clone of the
/// meter is gone, the charge is settled to the units spent, in one store call: units taken and
/// not spent go back, units spent past what was taken are charged (the key is in debt). A
/// client that leaves mid-stream pays for what was produced for it, not for the chunk. A rule
/// settled by a [usage trailer](crate::Rule::meter_usage_trailer) keeps the units taken until
/// the trailer is read: without it, the charge is the units taken or spent, the more.
///
/// Behind two metered layers (a tenant's budget around a route's), the handler's meter spends
/// from both: a spend holds when every layer's budget holds it, and a spend refused by one
/// layer, or dropped while one waits for its chunk, is counted by none.
///
/// When less than a chunk is left, the store grants what is left: a request is admitted with
/// it, and a stream that needs more than it holds takes it; a stream is cut when the store has
/// nothing left for the units it needs.
#[derive(Clone)]
pub struct Meter {
    /// This layer's budget (its body's).
    own: Arc<Metered>,
    /// The budgets of the metered layers around it, outermost first (none, usually).
    outer: Vec<Arc<Metered>>,
}

impl std::fmt::Debug for Meter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Meter")
            .field("spent", &self.spent())
            .field("exhausted", &self.is_exhausted())
            .finish_non_exhaustive()
    }
}

/// Where a meter takes its chunks and settles: the layer's store (or its fallback limiter).
pub(crate) trait Spender: Send + Sync {
    /// Takes `charges` (rule index, key, units) in one check: answered at once where that
    /// check never waits (the memory store, the fallback limiter), wherever it is asked; else
    /// the store's future, not polled yet.
    fn take(
        &self,
        snapshot: &Snapshot,
        charges: &[(u16, Key, u64)],
        on_fallback: Option<Counted>,
    ) -> Taking;

    /// Settles the meter's charges. Never blocks: a store that cannot answer at once finishes
    /// on the runtime (on `origin`, when this thread runs none).
    fn settle_meter(
        &self,
        snapshot: &Snapshot,
        changes: &[(u16, Key, Change, u64)],
        on_fallback: Option<Counted>,
        origin: &Origin,
    );
}

/// A chunk's check: answered, or the store's future to wait for.
pub(crate) enum Taking {
    Now(Result<Decision, StoreError>),
    Later(StoreFuture<Decision>),
}

/// One layer's budget of one response.
struct Metered {
    spender: Arc<dyn Spender>,
    snapshot: Arc<Snapshot>,
    /// Holds the count of replicas the fallback limiter admitted the request at, when it did:
    /// every chunk is taken there (at that share, or a smaller one if the fleet grew) and
    /// settled there at that share.
    on_fallback: Option<Counted>,
    /// The request's tier, for the metrics.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    tier: u16,
    /// The runtime the request was served on: chunks a store must wait for are taken there, and
    /// the settle finishes there, wherever the body is read or the meter ends.
    origin: Origin,
    state: Mutex<State>,
    /// Held while a chunk is fetched: one fetch at a time, which every spend that needs units
    /// waits for before it asks again (held by the fetch itself, so that a spend dropped while
    /// it waits leaves the fetch to finish and be counted).
    fetching: Arc<tokio::sync::Mutex<()>>,
}

struct State {
    accounts: SmallVec<[Account; 1]>,
    spent: u64,
    /// The refusal that ended the budget.
    exhausted: Option<Arc<Refusal>>,
    /// The body waiting for a frame, woken when the budget ends.
    body: Option<Waker>,
    /// A chunk asked for ahead of need was refused: none is asked for ahead again until one
    /// asked for when needed is granted (that one decides whether the budget ends).
    ahead_refused: bool,
    /// A rule settles to a usage trailer that has not been read: until it is, the units taken
    /// are kept (settled to the units spent or taken, the more), as a reserved charge that the
    /// trailer corrects.
    awaits_usage: bool,
}

impl State {
    /// The chunks `wanted` (rule, key, units), granted by `decision`: charged to their accounts.
    fn granted(&mut self, wanted: &[(u16, Key, u64)], decision: &Decision) {
        for (position, (rule, _, units)) in wanted.iter().enumerate() {
            if let Some(account) = self.accounts.iter_mut().find(|a| a.rule == *rule) {
                account.charged(*units, decision.charged_at(position));
            }
        }
    }

    /// Whether `decision`, which refused the chunks `wanted`, left part of a chunk for every
    /// rule that refused, enough for the units each needs: then each is asked for that part
    /// next (less each time; a refusal of what is needed ends the budget).
    fn part_left(&mut self, wanted: &[(u16, Key, u64)], decision: &Decision) -> bool {
        let spent = self.spent;
        let refused = || {
            wanted
                .iter()
                .zip(decision.outcomes())
                .filter(|(_, outcome)| !outcome.allowed)
        };
        let fits = refused().all(|((rule, _, units), outcome)| {
            let needed = self
                .accounts
                .iter()
                .find(|a| a.rule == *rule)
                .map_or(u64::MAX, |a| spent.saturating_sub(a.taken));
            outcome.remaining < *units && outcome.remaining >= needed.max(1)
        });
        if !fits || refused().next().is_none() {
            return false;
        }
        for ((rule, _, _), outcome) in refused() {
            if let Some(account) = self.accounts.iter_mut().find(|a| a.rule == *rule) {
                account.left = Some(outcome.remaining);
            }
        }
        true
    }
}

impl Metered {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Tells the metrics that the store granted the chunks `wanted`.
    fn told_granted(&self, wanted: &[(u16, Key, u64)]) {
        for (rule, _, units) in wanted {
            self.told_units(*rule, Units::Granted, *units);
        }
    }

    /// Tells the metrics `units` of `rule` granted or spent (feature `metrics`).
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    fn told_units(&self, rule: u16, what: Units, units: u64) {
        #[cfg(feature = "metrics")]
        crate::observe::metrics::metered_units(&self.snapshot, rule, self.tier, what, units);
    }

    /// Tells the metrics that `rule` ended the stream, for `reason` (feature `metrics`).
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    fn told_ended(&self, rule: u16, reason: &'static str) {
        #[cfg(feature = "metrics")]
        crate::observe::metrics::metered_ended(&self.snapshot, rule, self.tier, reason);
    }
}

#[cfg(feature = "metrics")]
use crate::observe::metrics::MeteredUnits as Units;

/// What a metered response's units did (the metrics' `MeteredUnits`, without the feature).
#[cfg(not(feature = "metrics"))]
#[derive(Clone, Copy)]
enum Units {
    Granted,
    Spent,
}

impl Meter {
    /// The meter of an admitted request of `tier`: `charges` (rule index, key, units, when
    /// charged) are the admission's chunks.
    pub(crate) fn new(
        spender: Arc<dyn Spender>,
        snapshot: Arc<Snapshot>,
        charges: impl IntoIterator<Item = (u16, Key, u64, u64)>,
        on_fallback: Option<Counted>,
        tier: u16,
    ) -> Meter {
        let accounts: SmallVec<[Account; 1]> = charges
            .into_iter()
            .map(|(rule, key, units, charged_at)| Account {
                chunk: snapshot.rules[usize::from(rule)]
                    .meter
                    .as_ref()
                    .map_or(units, |m| m.chunk)
                    .max(1),
                rule,
                key,
                taken: units,
                free: 0,
                recent: smallvec::smallvec![(units, charged_at)],
                left: None,
            })
            .collect();
        let awaits_usage = accounts.iter().any(|a| {
            snapshot.rules[usize::from(a.rule)]
                .meter
                .as_ref()
                .is_some_and(|m| m.usage_trailer.is_some())
        });
        let metered = Arc::new(Metered {
            spender,
            snapshot,
            on_fallback,
            tier,
            origin: Origin::here(),
            state: Mutex::new(State {
                accounts,
                spent: 0,
                exhausted: None,
                body: None,
                ahead_refused: false,
                awaits_usage,
            }),
            fetching: Arc::new(tokio::sync::Mutex::new(())),
        });
        for account in &metered.state().accounts {
            metered.told_units(account.rule, Units::Granted, account.taken);
        }
        Meter {
            own: metered,
            outer: Vec::new(),
        }
    }

    /// This meter, inside `outer`'s (an outer layer's): the request's handler spends from both.
    pub(crate) fn within(&self, outer: &Meter) -> Meter {
        Meter {
            own: self.own.clone(),
            outer: outer.parts().cloned().collect(),
        }
    }

    /// Every budget the handler spends from, outermost first, this layer's last.
    fn parts(&self) -> impl Iterator<Item = &Arc<Metered>> {
        self.outer.iter().chain(std::iter::once(&self.own))
    }

    /// Asks for `units` the producer is about to generate: [`Spend::Holds`] when they fit (they
    /// are counted as spent), [`Spend::Exhausted`] when the budget is spent (they are not
    /// counted: do not generate them). Takes the next chunk from the store (one call) when the
    /// units held run out; otherwise answers at once.
    pub async fn spend(&self, units: u64) -> Spend {
        // The layers that held the units give them back unless every layer holds them: when
        // a layer refuses them, or when this spend is dropped while a layer fetches its chunk.
        let mut held = Held {
            meter: self,
            parts: 0,
            units,
        };
        for part in self.parts() {
            if Metered::ask(part, units, false).await == Spend::Exhausted {
                return Spend::Exhausted;
            }
            held.parts += 1;
        }
        held.parts = 0;
        Spend::Holds
    }

    /// Records `units` already generated (a frame that exists, a usage figure reported after
    /// the fact): counted whatever the budget, past it as a debt, and answers whether the
    /// budget still holds for more.
    pub async fn record(&self, units: u64) -> Spend {
        let mut spend = Spend::Holds;
        for part in self.parts() {
            if Metered::ask(part, units, true).await == Spend::Exhausted {
                spend = Spend::Exhausted;
            }
        }
        spend
    }
}

/// Takes back `units` counted by the first `parts` layers of a spend that did not happen
/// (another layer refused them, or the spend was dropped before its answer), on drop.
struct Held<'a> {
    meter: &'a Meter,
    parts: usize,
    units: u64,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        for part in self.meter.parts().take(self.parts) {
            part.unspend(self.units);
        }
    }
}

/// Takes back `units` counted by a spend that did not happen (dropped before its answer, or
/// refused), on drop.
struct Unspend<'a> {
    metered: &'a Metered,
    units: u64,
}

impl Drop for Unspend<'_> {
    fn drop(&mut self) {
        self.metered.unspend(self.units);
    }
}

impl Metered {
    fn unspend(&self, units: u64) {
        let mut state = self.state();
        state.spent = state.spent.saturating_sub(units);
    }

    /// Counts `units` and answers whether this budget holds them, taking the next chunk when
    /// they go past the units held. `produced`: they exist, and stay counted whatever the
    /// answer.
    async fn ask(self: &Arc<Self>, units: u64, produced: bool) -> Spend {
        // The usual case, under one lock: the units are held.
        let low = {
            let mut state = self.state();
            if state.exhausted.is_some() && !produced {
                return Spend::Exhausted;
            }
            state.spent = state.spent.saturating_add(units);
            let spent = state.spent;
            if state.exhausted.is_none() && state.accounts.iter().all(|a| a.taken >= spent) {
                Some(
                    state
                        .accounts
                        .iter()
                        .any(|a| a.taken - spent < a.chunk.div_ceil(2)),
                )
            } else {
                None
            }
        };
        if let Some(low) = low {
            if low {
                self.ahead();
            }
            return Spend::Holds;
        }
        // A spend dropped before its answer, or refused, did not happen.
        let unspend = (!produced).then_some(Unspend {
            metered: self,
            units,
        });
        loop {
            if self.state().exhausted.is_some() {
                return Spend::Exhausted;
            }
            if self.wanted().is_empty() {
                std::mem::forget(unspend);
                self.ahead();
                return Spend::Holds;
            }
            // One fetch at a time: the one before may have brought what this spend needs.
            let fetching = self.fetching.clone().lock_owned().await;
            let wanted = self.wanted();
            if wanted.is_empty() || self.state().exhausted.is_some() {
                continue;
            }
            let taking = match self.spender.take(&self.snapshot, &wanted, self.on_fallback) {
                // A store that never waits answers here, runtime or not.
                Taking::Now(answer) => {
                    self.granted(&wanted, answer);
                    drop(fetching);
                    continue;
                }
                Taking::Later(taking) => taking,
            };
            let metered = self.clone();
            let asked = wanted.clone();
            let fetch = async move {
                metered.granted(&asked, taking.await);
                drop(fetching);
            };
            // On the request's runtime (the store's timers are set where it is polled, and a body
            // read by another executor has none; that runtime must be running), the fetch
            // finishes (and its chunk is counted) even if this spend is dropped meanwhile.
            match self.origin.runtime() {
                Some(runtime) => {
                    if runtime.spawn(fetch).await.is_err() {
                        // Dropped unfinished (the runtime shut down, or the check panicked):
                        // the store is out of reach, as for a call that failed.
                        self.granted(
                            &wanted,
                            Err(StoreError::Unavailable(
                                "the Tokio runtime of a metered response shut down".into(),
                            )),
                        );
                    }
                }
                None => fetch.await,
            }
        }
    }

    /// Takes the next chunk ahead of need, in the background, when an account holds less than
    /// half a chunk and no fetch is out: the producer seldom waits for the store. A refusal
    /// ends nothing (the units held are still good); the next chunk asked for when needed
    /// decides, so that a stream is cut within one chunk of the budget.
    fn ahead(self: &Arc<Self>) {
        // A fetch out (ahead or needed) brings units already.
        let Ok(fetching) = self.fetching.clone().try_lock_owned() else {
            return;
        };
        let wanted: SmallVec<[(u16, Key, u64); 1]> = {
            let state = self.state();
            if state.exhausted.is_some() || state.ahead_refused {
                return;
            }
            let spent = state.spent;
            state
                .accounts
                .iter()
                .filter(|a| a.taken.saturating_sub(spent) < a.chunk.div_ceil(2))
                .map(|a| (a.rule, a.key.clone(), a.chunk))
                .collect()
        };
        if wanted.is_empty() {
            return;
        }
        let Some(runtime) = self.origin.runtime() else {
            return;
        };
        let taking = match self.spender.take(&self.snapshot, &wanted, self.on_fallback) {
            Taking::Now(answer) => return self.ahead_granted(&wanted, answer),
            Taking::Later(taking) => taking,
        };
        let metered = self.clone();
        runtime.spawn(async move {
            metered.ahead_granted(&wanted, taking.await);
            drop(fetching);
        });
    }

    /// Records the store's answer to a chunk taken ahead of need.
    fn ahead_granted(&self, wanted: &[(u16, Key, u64)], answer: Result<Decision, StoreError>) {
        let mut state = self.state();
        match answer {
            Ok(decision) if decision.allowed() => {
                state.granted(wanted, &decision);
                self.told_granted(wanted);
            }
            // Refused, or the store failed: the chunk asked for when needed decides.
            _ => state.ahead_refused = true,
        }
    }

    /// The units each account needs from the store for what is spent: none when it holds them.
    fn wanted(&self) -> SmallVec<[(u16, Key, u64); 1]> {
        let state = self.state();
        let spent = state.spent;
        state
            .accounts
            .iter()
            .filter(|a| a.taken < spent)
            .map(|a| {
                let needed = spent - a.taken;
                let chunk = a.left.map_or(a.chunk, |left| a.chunk.min(left));
                (a.rule, a.key.clone(), chunk.max(needed))
            })
            .collect()
    }

    /// Records the store's answer to a chunk.
    fn granted(&self, wanted: &[(u16, Key, u64)], answer: Result<Decision, StoreError>) {
        let snapshot = &self.snapshot;
        let mut state = self.state();
        match answer {
            Ok(decision) if decision.allowed() => {
                state.granted(wanted, &decision);
                state.ahead_refused = false;
                self.told_granted(wanted);
            }
            Ok(decision) if state.part_left(wanted, &decision) => {
                // Asked for again (by the spend that waits), the part of a chunk left.
            }
            Ok(decision) => {
                let applied: RuleIndices = wanted.iter().map(|(rule, _, _)| *rule).collect();
                for (&rule, outcome) in applied.iter().zip(decision.outcomes()) {
                    if !outcome.allowed {
                        self.told_ended(rule, "budget");
                    }
                }
                state.exhausted = Some(Arc::new(Refusal::Denied { applied, decision }));
                wake(&mut state);
            }
            Err(error) => {
                let open = wanted.iter().all(|(rule, _, _)| {
                    snapshot.rules[usize::from(*rule)].on_store_error == FailureMode::Open
                });
                tracing::warn!(
                    %error,
                    "tollgate: a metered response could not take its next units; {}",
                    if open { "it goes on (the rule fails open)" } else { "it ends" }
                );
                if open {
                    for (rule, _, units) in wanted {
                        if let Some(account) = state.accounts.iter_mut().find(|a| a.rule == *rule) {
                            account.free(*units);
                        }
                    }
                    return;
                }
                // Units refused: the rules that do not fail open ended the budget.
                let closed = wanted
                    .iter()
                    .map(|(rule, _, _)| *rule)
                    .filter(|&rule| {
                        snapshot.rules[usize::from(rule)].on_store_error != FailureMode::Open
                    })
                    .collect::<RuleIndices>();
                for &rule in &closed {
                    self.told_ended(rule, "store_error");
                }
                state.exhausted = Some(Arc::new(Refusal::Unavailable { closed }));
                wake(&mut state);
            }
        }
    }
}

impl Meter {
    /// Counts `units` of a frame being delivered: a future taking the next chunk when they go
    /// past the units held (its refusal ends the budget; the frame stays counted, a debt of at
    /// most its units), `None` when they are held.
    pub(crate) fn count_frame(&self, units: u64) -> Option<SpendFuture> {
        let held = {
            let mut state = self.own.state();
            state.spent = state.spent.saturating_add(units);
            let spent = state.spent;
            if state.exhausted.is_some() {
                return None;
            }
            state.accounts.iter().all(|a| a.taken >= spent)
        };
        if held {
            self.own.ahead();
            return None;
        }
        let meter = self.own.clone();
        Some(Box::pin(async move { Metered::ask(&meter, 0, true).await }))
    }

    /// The response's own count of what it used (a usage trailer): the charge is settled to it.
    pub(crate) fn settle_to(&self, total: u64) {
        let mut state = self.own.state();
        state.spent = total;
        state.awaits_usage = false;
    }

    /// How each data frame of the response counts, when a metered rule of it says.
    pub(crate) fn frame_units(&self) -> Option<FrameUnits> {
        self.metering().find_map(|m| m.frames.clone())
    }

    /// The trailer holding the response's usage, when a metered rule of it says.
    pub(crate) fn usage_trailer(&self) -> Option<HeaderName> {
        self.metering().find_map(|m| m.usage_trailer.clone())
    }

    fn metering(&self) -> impl Iterator<Item = &Metering> {
        let snapshot = &self.own.snapshot;
        let rules: SmallVec<[u16; 2]> = self.own.state().accounts.iter().map(|a| a.rule).collect();
        rules
            .into_iter()
            .filter_map(move |rule| snapshot.rules[usize::from(rule)].meter.as_ref())
    }

    /// Lists the units the store granted each metered rule so far, by the rule's name (for the
    /// fleet simulation, which cannot see a first chunk cut to what was left otherwise).
    #[cfg(test)]
    pub(crate) fn granted(&self) -> Vec<(String, u64)> {
        let snapshot = &self.own.snapshot;
        self.own
            .state()
            .accounts
            .iter()
            .map(|a| {
                (
                    snapshot.rules[usize::from(a.rule)].spec.name().to_owned(),
                    a.taken,
                )
            })
            .collect()
    }

    /// The units spent so far (of this layer's budget).
    pub fn spent(&self) -> u64 {
        self.own.state().spent
    }

    /// Whether a budget is spent (a spend was answered [`Spend::Exhausted`]).
    pub fn is_exhausted(&self) -> bool {
        self.parts().any(|part| part.state().exhausted.is_some())
    }

    /// The refusal that ended the budget, if it ended; else the body's waker is kept, to be
    /// woken when it does.
    pub(crate) fn poll_exhausted(&self, cx: &mut Context<'_>) -> Poll<Arc<Refusal>> {
        let mut state = self.own.state();
        match &state.exhausted {
            Some(refusal) => Poll::Ready(refusal.clone()),
            None => {
                match &mut state.body {
                    Some(waker) if waker.will_wake(cx.waker()) => {}
                    slot => *slot = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
        }
    }

    /// The refusal that ended the budget, if it ended.
    pub(crate) fn exhausted(&self) -> Option<Arc<Refusal>> {
        self.own.state().exhausted.clone()
    }

    /// The policy the request was decided under.
    pub(crate) fn snapshot(&self) -> &Snapshot {
        &self.own.snapshot
    }
}

fn wake(state: &mut State) {
    if let Some(waker) = state.body.take() {
        waker.wake();
    }
}

impl Drop for Metered {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        let (spent, keep_taken) = (state.spent, state.awaits_usage);
        // No usage trailer read: the chunks taken stay charged.
        let settled = |a: &Account| {
            if keep_taken {
                spent.max(a.taken)
            } else {
                spent
            }
        };
        let owed: SmallVec<[(u16, u64); 1]> = state
            .accounts
            .iter()
            .map(|a| (a.rule, a.owed(settled(a))))
            .collect();
        let changes: SmallVec<[(u16, Key, Change, u64); 2]> = state
            .accounts
            .iter()
            .flat_map(|a| {
                a.settle(settled(a))
                    .into_iter()
                    .map(|(change, at)| (a.rule, a.key.clone(), change, at))
            })
            .collect();
        for (rule, units) in owed {
            self.told_units(rule, Units::Spent, units);
        }
        if !changes.is_empty() {
            self.spender
                .settle_meter(&self.snapshot, &changes, self.on_fallback, &self.origin);
        }
    }
}
