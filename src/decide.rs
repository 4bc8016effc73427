//! The decision: from a request's head to what follows it.
//!
//! 0. The policy in force is taken (a [`Snapshot`]: no lock), the allow and deny lists are
//!    checked, the tenant is found, and the policy resolves which rules apply.
//! 1. Each rule's extractor finds the request's key ([`Shared::start`]); a rule whose extractor
//!    finds none counts the request under the shared [`Key::unidentified`] key, unless the rule
//!    skips such requests.
//! 2. The store checks every key in one atomic step ([`Check`]).
//! 3. Its answer becomes what follows ([`Shared::after_check`]): call the inner service (and add
//!    the budget to its response), or answer for it (429, gRPC `RESOURCE_EXHAUSTED`, or 503 when
//!    the store failed and a rule fails closed). A store failure is decided by each rule's
//!    [`FailureMode`]. A denial by shadow rules only admits the request (its enforced rules
//!    are checked again alone), and one by delay rules waits and checks again ([`Next::Again`]).
//!
//! Nothing here knows about `Service` or futures of the inner service: `service.rs` calls
//! [`Shared::start`], `future.rs` waits for what it could not decide at once.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Response;
use http::request::Parts;
use pin_project_lite::pin_project;
use smallvec::SmallVec;

use crate::clock::unix_micros;
use crate::held::{GiveBack, Held};
use crate::key::{Extracted, Key, KeyFuture, SharedExtractor};
use crate::observe::{Decided, Head, Observer, Verdict};
use crate::policy::snapshot::{Listing, Snapshot};
use crate::policy::{Found, Tenant, TenantFuture};
use crate::policy::{Live, Registrar, SharedTenantExtractor};
use crate::shed::{Priority, Shedder};
use crate::store::{Adjustment, Change, Charge, MemoryStore, Store, StoreError};
use crate::throttle::Every;
use crate::wire::is_grpc;
use crate::{ConfigError, Decision, DecisionSource, FailureMode, RuleMode};

/// Indices of the rules that applied to one request, in rule order.
pub(crate) type Applied = SmallVec<[u16; 4]>;

/// Keys found for a request: the rule's index, the key, the cost.
pub(crate) type FoundKeys = SmallVec<[(u16, Key, u64); 2]>;

/// Keys that need a lookup: the rule's index, the lookup, the cost.
type PendingKeys = SmallVec<[(u16, KeyFuture, u64); 1]>;

/// The store's answer to a check that needed waiting: the rules that applied, their keys when
/// they are kept (see [`Snapshot::keeps_keys`]), and the answer.
pub(crate) struct Checked {
    pub(crate) applied: Applied,
    pub(crate) keys: Option<Box<FoundKeys>>,
    pub(crate) result: Result<Decision, StoreError>,
    /// How the request got to this check.
    pub(crate) phase: Phase,
    /// How long the store took, when measured.
    pub(crate) latency: Option<Duration>,
}

/// How a request got to a check: after a delay rule's wait (it is not delayed again), or
/// after a shadow rule would have denied it.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Phase {
    pub(crate) delayed: bool,
    pub(crate) shadowed: bool,
}

/// What [`Shared::after_check`] knows of a request besides the store's answer.
pub(crate) struct Ctx<'a> {
    pub(crate) head: Head<'a>,
    pub(crate) span: &'a tracing::Span,
    pub(crate) latency: Option<Duration>,
    pub(crate) phase: Phase,
}

/// The start of a store check, when its latency is measured: with the feature `metrics`, or
/// when the request's span is recorded.
pub(crate) fn stopwatch(span: &tracing::Span) -> Option<Instant> {
    (cfg!(feature = "metrics") || !span.is_disabled()).then(Instant::now)
}

/// A check that needs asynchronous work: key lookups, or a second check.
pub(crate) type DeferredCheck = Pin<Box<dyn Future<Output = Checked> + Send>>;

/// The policy of a layer: fixed when it was built, or live (swapped by reloads).
pub(crate) enum Policies {
    Fixed(Arc<Snapshot>),
    Live(Arc<Live>),
}

/// Everything the services of one layer share.
pub(crate) struct Shared<St> {
    pub(crate) policy: Policies,
    pub(crate) store: St,
    /// The layer's key: rules without their own count by it, and lists match it.
    pub(crate) layer_key: SharedExtractor,
    /// Finds each request's tenant, when the layer has tenants.
    pub(crate) tenant: Option<SharedTenantExtractor>,
    /// The local limiter of rules that fall back to one when the store fails, made when first
    /// needed.
    pub(crate) fallback: OnceLock<MemoryStore>,
    pub(crate) warned_store_error: Every,
    /// Requests waiting for a delay rule's budget, and how many may.
    pub(crate) waiting: AtomicUsize,
    pub(crate) max_waiting: usize,
    /// Metrics, the span, the rejection log and the decision hook.
    pub(crate) observer: Observer,
    /// This layer's registration of its rules on the store: while it lives, no other layer may
    /// give one of these rule names another quota on the same store.
    pub(crate) registration: Arc<()>,
    /// Whether CORS preflights are limited.
    pub(crate) count_preflight: bool,
    /// The process's requests in flight, when the layer sheds load.
    pub(crate) shedder: Option<Shedder>,
    /// What else checks the layer's rules: each refuses, when it is made and at every reload,
    /// the rules it cannot keep.
    pub(crate) uses: Uses,
}

/// Which of the [`Use`]s a layer's rules serve.
#[derive(Default)]
pub(crate) struct Uses {
    per_message: std::sync::atomic::AtomicBool,
    interceptor: std::sync::atomic::AtomicBool,
}

/// A use of a layer's rules besides the layer, which cannot keep every rule.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(feature = "tonic"), allow(dead_code))]
pub(crate) enum Use {
    /// Checked per message of a gRPC stream: a message has no response.
    PerMessage,
    /// Checked by a tonic interceptor, which neither waits nor sees the response.
    Interceptor,
}

impl Use {
    const ALL: [Use; 2] = [Use::PerMessage, Use::Interceptor];

    /// Why `snapshot` cannot serve this use, if it cannot.
    pub(crate) fn refuses(self, snapshot: &Snapshot) -> Option<ConfigError> {
        match self {
            Use::PerMessage => (snapshot.holds || snapshot.settles).then(|| {
                ConfigError::new(
                    "concurrency limits and charges by outcome or settled costs act after a \
                     response, which a message has not: they cannot be checked per message; use \
                     them on a layer of their own",
                )
            }),
            Use::Interceptor => {
                let delays = snapshot
                    .rules
                    .iter()
                    .any(|rule| matches!(rule.mode, RuleMode::Delay { .. }));
                (snapshot.holds || snapshot.settles || delays).then(|| {
                    ConfigError::new(
                        "a tonic interceptor neither sees the response nor waits: concurrency \
                         limits, charges by outcome or settled costs and delay rules need the \
                         layer on the service (layer.layer(MyServiceServer::new(service)))",
                    )
                })
            }
        }
    }

    fn flag(self, uses: &Uses) -> &std::sync::atomic::AtomicBool {
        match self {
            Use::PerMessage => &uses.per_message,
            Use::Interceptor => &uses.interceptor,
        }
    }
}

impl<St> Drop for Shared<St> {
    fn drop(&mut self) {
        // The thread that polls a live policy's source stops now, not an interval later.
        if let Policies::Live(live) = &self.policy {
            live.stop();
        }
    }
}

impl<St: Store> Registrar for Shared<St> {
    fn register(&self, snapshot: &Snapshot) -> Result<(), ConfigError> {
        // A reload may not bring in rules that a use made of the layer cannot keep.
        for use_ in Use::ALL {
            if use_.flag(&self.uses).load(Ordering::Acquire)
                && let Some(error) = use_.refuses(snapshot)
            {
                let by = match use_ {
                    Use::PerMessage => "per message (RateLimitLayer::per_message)",
                    Use::Interceptor => "by a tonic interceptor (RateLimitLayer::interceptor)",
                };
                return Err(ConfigError::new(format!(
                    "this layer's rules are also checked {by}, so the policy cannot bring in \
                     such rules: {}",
                    error.message()
                )));
            }
        }
        match self.store.registry() {
            Some(registry) => {
                registry.replace(snapshot.rules.iter().map(|r| &*r.spec), &self.registration)
            }
            None => Ok(()),
        }
    }

    fn splits_keys(&self) -> bool {
        // The memory store keeps a split rule's key whole.
        self.store.kind() != "memory"
    }
}

/// Charges to settle once the response head is there: the rules that charge by the response
/// or settle their cost, their keys and what they reserved, and when.
pub(crate) struct Settle {
    /// The rule, the key, the units reserved and when they were charged (0: not known).
    pub(crate) charges: SmallVec<[(u16, Key, u64, u64); 1]>,
    /// Decided by the local limiter (the store failed): settled there too.
    pub(crate) local: bool,
}

/// What an admitted request carries to its response: the decision whose budget the response
/// reports (none when no rule limited it), the charges to settle once its head is there, and
/// the concurrency slots it holds until its body ends.
#[derive(Default)]
pub(crate) struct Admitted {
    pub(crate) decision: Option<Decision>,
    pub(crate) settle: Option<Box<Settle>>,
    pub(crate) held: Option<Held>,
}

impl Admitted {
    /// Whether the request holds slots or has charges to settle after its response.
    #[cfg_attr(not(feature = "tonic"), allow(dead_code))]
    pub(crate) fn holds_or_settles(&self) -> bool {
        self.held.is_some() || self.settle.is_some()
    }
}

/// What follows a request's check.
pub(crate) enum Next {
    /// Call the inner service, then add the budget headers of the decision, settle what needs
    /// the response, and hold the slots until the response body ends.
    Call(Admitted),
    /// Answer for the inner service: a denial, or a refusal when the store failed.
    Answer(Response<Bytes>),
    /// Check again first: the enforced rules alone after a shadow rule's denial, or after a
    /// delay rule's wait.
    Again(DeferredCheck),
}

/// How far [`Shared::start`] got.
pub(crate) enum Start<C> {
    /// Decided at once (the store answered without waiting, or no rule applied).
    Decided { next: Next, applied: Applied },
    /// The store is asked; its answer comes through `check`.
    Checking {
        check: Check<C>,
        applied: Applied,
        /// The keys, kept only when they may be needed again.
        keys: Option<Box<FoundKeys>>,
        /// When the store was asked, when the latency is measured.
        asked_at: Option<Instant>,
    },
    /// Some keys need a lookup before the store can be asked.
    Deferred(DeferredCheck),
    /// The tenant needs a lookup; then [`Shared::with_tenant`] goes on, with what the lists
    /// said of the layer's key.
    Tenant {
        future: TenantFuture,
        listing: Listing,
    },
}

pin_project! {
    /// The store's answer, or an answer made without asking it.
    #[project = CheckProj]
    pub(crate) enum Check<C> {
        Store { #[pin] future: C },
        Decided { result: Option<Result<Decision, StoreError>> },
    }
}

impl<C> Check<C> {
    /// Asks the store, unless no rule applies.
    fn ask<St: Store<Future = C>>(store: &St, charges: &[Charge<'_>]) -> Self {
        if charges.is_empty() {
            return Check::Decided {
                result: Some(Ok(Decision::default())),
            };
        }
        match store.check_now(charges) {
            Some(result) => Check::Decided {
                result: Some(result),
            },
            None => Check::Store {
                future: store.check(charges),
            },
        }
    }

    /// The answer, when it was known without waiting.
    // The pending check goes back by value, once per request: no copy worth a box.
    #[allow(clippy::result_large_err)]
    fn into_decided(self) -> Result<Result<Decision, StoreError>, Self> {
        match self {
            Check::Decided {
                result: Some(result),
            } => Ok(result),
            pending => Err(pending),
        }
    }
}

impl<C> Future for Check<C>
where
    C: Future<Output = Result<Decision, StoreError>>,
{
    type Output = Result<Decision, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            CheckProj::Store { future } => future.poll(cx),
            // Polled again after it answered: never by the layer's own future.
            CheckProj::Decided { result } => Poll::Ready(
                result
                    .take()
                    .unwrap_or(Err(StoreError::Protocol("check polled twice".into()))),
            ),
        }
    }
}

impl<St> Shared<St> {
    /// The policy in force.
    pub(crate) fn snapshot(&self) -> Arc<Snapshot> {
        match &self.policy {
            Policies::Fixed(snapshot) => snapshot.clone(),
            Policies::Live(live) => live.current.load_full(),
        }
    }

    /// Takes on `use_`: refused when the policy in force has rules it cannot keep, and from
    /// then on, so is every reload that would bring such rules in.
    #[cfg_attr(not(feature = "tonic"), allow(dead_code))]
    pub(crate) fn adopt(&self, use_: Use) -> Result<(), ConfigError> {
        let adopt = || match use_.refuses(&self.snapshot()) {
            Some(error) => Err(error),
            None => {
                use_.flag(&self.uses).store(true, Ordering::Release);
                Ok(())
            }
        };
        match &self.policy {
            // No reload can slip in between the check and the flag.
            Policies::Live(live) => live.while_installing(adopt),
            Policies::Fixed(_) => adopt(),
        }
    }
}

impl<St: Store> Shared<St> {
    /// Takes the policy in force, finds the request's tenant, rules and keys, and asks the
    /// store, deciding at once when it can. The request finishes under this policy.
    pub(crate) fn start(
        self: &Arc<Self>,
        parts: &mut Parts,
        span: &tracing::Span,
    ) -> (Arc<Snapshot>, Start<St::Future>) {
        let snapshot = self.snapshot();
        let start = self.begin(&snapshot, parts, span);
        (snapshot, start)
    }

    fn begin(
        self: &Arc<Self>,
        snapshot: &Arc<Snapshot>,
        parts: &mut Parts,
        span: &tracing::Span,
    ) -> Start<St::Future> {
        let mut listing = Listing::Unlisted;
        if snapshot.lists.has_key_entries() {
            // A key that needs a lookup is not listed: lists are for keys known at once.
            if let Some(key) = self.layer_key.extract(parts).found() {
                listing = snapshot.lists.key(&key);
                if listing == Listing::Denied {
                    return self.forbidden(snapshot, parts, span);
                }
            }
        }
        let tenant = match &self.tenant {
            None => Found::None,
            Some(extractor) => match extractor.tenant(parts) {
                Found::Pending(future) => return Start::Tenant { future, listing },
                found => found,
            },
        };
        self.with_tenant(snapshot, tenant, listing, parts, span)
    }

    /// Goes on once the tenant is known: its lists (a denied tenant is refused even from an
    /// allowed address: deny wins), then the rules the policy resolves for it. `listing` is what
    /// the lists said of the layer's key.
    pub(crate) fn with_tenant(
        self: &Arc<Self>,
        snapshot: &Arc<Snapshot>,
        tenant: Found,
        mut listing: Listing,
        parts: &mut Parts,
        span: &tracing::Span,
    ) -> Start<St::Future> {
        // The tenant found lives in the request's extensions: for the tenant's key, for
        // handlers, and read from there without a copy.
        let has_tenant = match tenant {
            Found::Tenant(tenant) => {
                if parts.extensions.get::<Tenant>() != Some(&tenant) {
                    parts.extensions.insert(tenant);
                }
                true
            }
            Found::InExtensions => true,
            Found::None | Found::Pending(_) => false,
        };
        let parts = &*parts;
        let tenant = if has_tenant {
            parts.extensions.get::<Tenant>()
        } else {
            None
        };
        if let Some(tenant) = tenant
            && snapshot.lists.has_tenant_entries()
        {
            match snapshot.lists.tenant(tenant) {
                Listing::Denied => return self.forbidden(snapshot, parts, span),
                Listing::Allowed => listing = Listing::Allowed,
                Listing::Unlisted => {}
            }
        }
        if listing == Listing::Allowed {
            self.emit_listed(snapshot, parts, span, Verdict::ListedAllowed);
            return nothing_applies();
        }
        // After the lists: a denied client is refused whatever it sends.
        if !self.count_preflight && is_preflight(parts) {
            self.emit_listed(snapshot, parts, span, Verdict::NotLimited);
            return nothing_applies();
        }
        let rules = snapshot.resolver.resolve(tenant, parts).rules;
        self.check_rules(snapshot, rules, parts, span)
    }

    /// Finds the keys of `rules` and asks the store.
    fn check_rules(
        self: &Arc<Self>,
        snapshot: &Arc<Snapshot>,
        rules: &[u16],
        parts: &Parts,
        span: &tracing::Span,
    ) -> Start<St::Future> {
        if let [index] = *rules {
            // The common case, one rule: no lists to build.
            let rule = &snapshot.rules[usize::from(index)];
            let cost = rule.cost.of(parts);
            let key = match rule.key.extract(parts) {
                Extracted::Found(key) => key,
                Extracted::Missing => match missing_key(snapshot, index, RequestKind::of(parts)) {
                    Some(key) => key,
                    None => {
                        self.emit_listed(snapshot, parts, span, Verdict::NotLimited);
                        return nothing_applies();
                    }
                },
                Extracted::Pending(future) => {
                    let mut pending = PendingKeys::new();
                    pending.push((index, future, cost));
                    return Start::Deferred(self.deferred(
                        snapshot,
                        FoundKeys::new(),
                        pending,
                        parts,
                    ));
                }
            };
            let asked_at = stopwatch(span);
            let check = Check::ask(
                &self.store,
                &[Charge {
                    rule: &rule.spec,
                    key: &key,
                    cost,
                }],
            );
            let applied = Applied::from_buf_and_len([index, 0, 0, 0], 1);
            let mut keys = FoundKeys::new();
            keys.push((index, key, cost));
            return self.respond(snapshot, check, applied, keys, parts, span, asked_at);
        }

        let mut keys = FoundKeys::new();
        let mut pending = PendingKeys::new();
        for &index in rules {
            let rule = &snapshot.rules[usize::from(index)];
            match rule.key.extract(parts) {
                Extracted::Found(key) => keys.push((index, key, rule.cost.of(parts))),
                Extracted::Missing => {
                    if let Some(key) = missing_key(snapshot, index, RequestKind::of(parts)) {
                        keys.push((index, key, rule.cost.of(parts)));
                    }
                }
                Extracted::Pending(future) => pending.push((index, future, rule.cost.of(parts))),
            }
        }
        if !pending.is_empty() {
            return Start::Deferred(self.deferred(snapshot, keys, pending, parts));
        }
        let asked_at = stopwatch(span);
        let (check, applied) = self.ask(snapshot, &keys);
        self.respond(snapshot, check, applied, keys, parts, span, asked_at)
    }

    /// A request shed before any check: 503 (gRPC `UNAVAILABLE`).
    pub(crate) fn shed(
        &self,
        parts: &Parts,
        span: &tracing::Span,
        priority: Priority,
        share: usize,
    ) -> (Arc<Snapshot>, Start<St::Future>) {
        let snapshot = self.snapshot();
        tracing::debug!(%priority, "tollgate: request shed");
        #[cfg(feature = "metrics")]
        crate::telemetry::shed(priority.as_str());
        self.emit_listed(&snapshot, parts, span, Verdict::Shed);
        let start = Start::Decided {
            next: Next::Answer(
                snapshot
                    .answers
                    .shed(Head::of_parts(parts).is_grpc(), share),
            ),
            applied: Applied::new(),
        };
        (snapshot, start)
    }

    /// A listed request refused: 403 (gRPC `PERMISSION_DENIED`).
    fn forbidden(
        &self,
        snapshot: &Snapshot,
        parts: &Parts,
        span: &tracing::Span,
    ) -> Start<St::Future> {
        tracing::debug!("tollgate: request refused by the deny list");
        self.emit_listed(snapshot, parts, span, Verdict::ListedDenied);
        Start::Decided {
            next: Next::Answer(snapshot.answers.forbidden(Head::of_parts(parts).is_grpc())),
            applied: Applied::new(),
        }
    }

    /// Decides at once when the store answered without waiting.
    #[allow(clippy::too_many_arguments)]
    fn respond(
        self: &Arc<Self>,
        snapshot: &Arc<Snapshot>,
        check: Check<St::Future>,
        mut applied: Applied,
        keys: FoundKeys,
        parts: &Parts,
        span: &tracing::Span,
        asked_at: Option<Instant>,
    ) -> Start<St::Future> {
        match check.into_decided() {
            Ok(result) => {
                let latency = asked_at
                    .filter(|_| !applied.is_empty())
                    .map(|at| at.elapsed());
                self.observer.store_checked(latency, &result);
                let ctx = Ctx {
                    head: Head::of_parts(parts),
                    span,
                    latency,
                    phase: Phase::default(),
                };
                let next = self.after_check(snapshot, &mut applied, Some(&keys), result, &ctx);
                Start::Decided { next, applied }
            }
            Err(check) => Start::Checking {
                check,
                applied,
                // Kept for a second check, and for the rejection log's digest.
                keys: (snapshot.keeps_keys() || self.observer.log.enabled())
                    .then(|| Box::new(keys)),
                asked_at,
            },
        }
    }

    /// A denied request: told to events, then answered (shadow rules left out of the answer).
    fn deny(
        &self,
        snapshot: &Snapshot,
        ctx: &Ctx<'_>,
        applied: &mut Applied,
        keys: Option<&FoundKeys>,
        decision: Decision,
        verdict: Verdict,
    ) -> Next {
        self.emit(snapshot, ctx, applied, Some(&decision), keys, verdict);
        denied_answer(snapshot, applied, decision, ctx.head.is_grpc())
    }

    /// A request whose client went away before it was decided, to events.
    pub(crate) fn cancelled(
        &self,
        snapshot: &Snapshot,
        head: Head<'_>,
        applied: &[u16],
        span: &tracing::Span,
    ) {
        let ctx = Ctx {
            head,
            span,
            latency: None,
            phase: Phase::default(),
        };
        self.emit(snapshot, &ctx, applied, None, None, Verdict::Cancelled);
    }

    /// A request decided without asking the store (listed, or no rule applies), to events.
    fn emit_listed(
        &self,
        snapshot: &Snapshot,
        parts: &Parts,
        span: &tracing::Span,
        verdict: Verdict,
    ) {
        let ctx = Ctx {
            head: Head::of_parts(parts),
            span,
            latency: None,
            phase: Phase::default(),
        };
        self.emit(snapshot, &ctx, &[], None, None, verdict);
    }

    /// A decided request, to events.
    fn emit(
        &self,
        snapshot: &Snapshot,
        ctx: &Ctx<'_>,
        applied: &[u16],
        decision: Option<&Decision>,
        keys: Option<&FoundKeys>,
        verdict: Verdict,
    ) {
        self.observer.decided(
            &Decided {
                snapshot,
                head: ctx.head,
                applied,
                decision,
                keys,
                verdict,
                store_latency: ctx.latency,
            },
            ctx.span,
        );
    }

    /// Waits for the keys that need a lookup, then asks the store.
    fn deferred(
        self: &Arc<Self>,
        snapshot: &Arc<Snapshot>,
        mut keys: FoundKeys,
        pending: PendingKeys,
        parts: &Parts,
    ) -> DeferredCheck {
        let shared = self.clone();
        let snapshot = snapshot.clone();
        // What a missing key's hint needs to know of the request, copied: the future cannot
        // borrow it.
        let kind = RequestKind::of(parts);
        let measure = cfg!(feature = "metrics")
            || tracing::enabled!(target: "tollgate", tracing::Level::DEBUG);
        let log = self.observer.log.enabled();
        Box::pin(async move {
            for (index, future, cost) in pending {
                let key = match future.await {
                    Some(key) => Some(key),
                    None => missing_key(&snapshot, index, kind),
                };
                if let Some(key) = key {
                    keys.push((index, key, cost));
                }
            }
            keys.sort_unstable_by_key(|(i, _, _)| *i);
            let asked_at = measure.then(Instant::now).filter(|_| !keys.is_empty());
            let (check, applied) = shared.ask(&snapshot, &keys);
            let result = check.await;
            let latency = asked_at.map(|at| at.elapsed());
            shared.observer.store_checked(latency, &result);
            let keys = (snapshot.keeps_keys() || log).then(|| Box::new(keys));
            Checked {
                applied,
                keys,
                result,
                phase: Phase::default(),
                latency,
            }
        })
    }

    /// Asks the store about every rule that has a key, in rule order.
    fn ask(&self, snapshot: &Snapshot, keys: &FoundKeys) -> (Check<St::Future>, Applied) {
        let charges: SmallVec<[Charge<'_>; 2]> = keys
            .iter()
            .map(|(i, key, cost)| Charge {
                rule: &snapshot.rules[usize::from(*i)].spec,
                key,
                cost: *cost,
            })
            .collect();
        let applied = keys.iter().map(|(i, _, _)| *i).collect();
        (Check::ask(&self.store, &charges), applied)
    }

    /// Turns the store's answer into what follows: a denial becomes the answer (or a second
    /// check, for shadow and delay rules), and a store failure is decided by each applied rule's
    /// [`FailureMode`]. Every final decision is told to the layer's events.
    pub(crate) fn after_check(
        self: &Arc<Self>,
        snapshot: &Arc<Snapshot>,
        applied: &mut Applied,
        keys: Option<&FoundKeys>,
        result: Result<Decision, StoreError>,
        ctx: &Ctx<'_>,
    ) -> Next {
        let grpc = || ctx.head.is_grpc();
        match result {
            Ok(decision) if decision.allowed() => {
                let verdict = if applied.is_empty() {
                    Verdict::NotLimited
                } else if ctx.phase.shadowed {
                    Verdict::ShadowDenied
                } else if ctx.phase.delayed {
                    Verdict::Delayed
                } else if decision.source() == DecisionSource::Lease {
                    Verdict::LeaseAllowed
                } else {
                    Verdict::Allowed
                };
                self.emit(snapshot, ctx, applied, Some(&decision), keys, verdict);
                self.admitted(snapshot, applied, keys, decision, false)
            }
            Ok(decision) if snapshot.watches => {
                self.watched_denial(snapshot, applied, keys, decision, ctx)
            }
            Ok(decision) => {
                let verdict = denied(&decision);
                self.deny(snapshot, ctx, applied, keys, decision, verdict)
            }
            Err(error) => {
                self.report(&error);
                match self.without_store(snapshot, applied, keys) {
                    WithoutStore::Refuse => {
                        self.emit(snapshot, ctx, applied, None, keys, Verdict::FailedClosed);
                        Next::Answer(
                            snapshot
                                .answers
                                .unavailable(&snapshot.rules, applied, grpc()),
                        )
                    }
                    WithoutStore::Decided(decision) if !decision.allowed() => {
                        self.deny(snapshot, ctx, applied, keys, decision, Verdict::LocalDenied)
                    }
                    WithoutStore::Decided(decision) => {
                        self.emit(
                            snapshot,
                            ctx,
                            applied,
                            Some(&decision),
                            keys,
                            Verdict::LocalAllowed,
                        );
                        // Decided by the local limiter: settled there, slots given back there.
                        self.admitted(snapshot, applied, keys, decision, true)
                    }
                    WithoutStore::Unlimited => {
                        self.emit(snapshot, ctx, applied, None, keys, Verdict::FailedOpen);
                        Next::Call(Admitted::default())
                    }
                }
            }
        }
    }

    /// A denial in a policy with shadow or delay rules.
    fn watched_denial(
        self: &Arc<Self>,
        snapshot: &Arc<Snapshot>,
        applied: &mut Applied,
        keys: Option<&FoundKeys>,
        decision: Decision,
        ctx: &Ctx<'_>,
    ) -> Next {
        let mode = |i: u16| snapshot.rules[usize::from(i)].mode;
        let denying = || {
            applied
                .iter()
                .zip(decision.outcomes())
                .filter(|(_, o)| !o.allowed)
        };
        let enforced_denial = denying().any(|(i, _)| mode(*i) != RuleMode::Shadow);
        let Some(keys) = keys else {
            // Kept for every policy with shadow or delay rules: not reached.
            let verdict = denied(&decision);
            return self.deny(snapshot, ctx, applied, keys, decision, verdict);
        };
        if !enforced_denial {
            let shadow: SmallVec<[u16; 2]> = denying()
                .filter(|(i, _)| mode(**i) == RuleMode::Shadow)
                .map(|(&i, _)| i)
                .collect();
            for (&i, outcome) in denying().filter(|(i, _)| mode(**i) == RuleMode::Shadow) {
                tracing::info!(
                    target: "tollgate::shadow",
                    rule = snapshot.rules[usize::from(i)].spec.name(),
                    retry_after_s = outcome.retry_after.div_ceil(1_000_000),
                    "tollgate: a shadow rule would deny this request; admitted"
                );
            }
            // Only shadow rules denied, so nothing was charged: the other rules are checked
            // again, alone, as if the shadow rules were not there.
            if applied.iter().all(|&i| mode(i) == RuleMode::Shadow) {
                self.emit(
                    snapshot,
                    ctx,
                    applied,
                    Some(&decision),
                    Some(keys),
                    Verdict::ShadowDenied,
                );
                // Only shadow rules denied: nothing was charged, nothing to settle.
                return Next::Call(Admitted::default());
            }
            self.observer.shadowed(snapshot, ctx.head, &shadow);
            let enforced: FoundKeys = keys
                .iter()
                .filter(|(i, _, _)| mode(*i) != RuleMode::Shadow)
                .cloned()
                .collect();
            // A delayed request stays settled: it is never delayed twice.
            let phase = Phase {
                shadowed: true,
                ..ctx.phase
            };
            return Next::Again(self.check_again(snapshot, enforced, None, phase));
        }
        if !ctx.phase.delayed
            && let Some(wait) = delay_of(snapshot, applied, &decision)
        {
            let phase = Phase {
                delayed: true,
                ..ctx.phase
            };
            return Next::Again(self.check_again(
                snapshot,
                keys.clone(),
                Some((wait, decision)),
                phase,
            ));
        }
        let verdict = denied(&decision);
        self.deny(snapshot, ctx, applied, Some(keys), decision, verdict)
    }

    /// Checks `keys` again: at once (`delay` is `None`), or after waiting for a delay rule's
    /// budget, as long as the delay allows, in a bounded number of waiting requests.
    fn check_again(
        self: &Arc<Self>,
        snapshot: &Arc<Snapshot>,
        keys: FoundKeys,
        delay: Option<(Delay, Decision)>,
        phase: Phase,
    ) -> DeferredCheck {
        let shared = self.clone();
        let snapshot = snapshot.clone();
        let measure = cfg!(feature = "metrics")
            || tracing::enabled!(target: "tollgate", tracing::Level::DEBUG);
        Box::pin(async move {
            let Some((mut delay, denied)) = delay else {
                let asked_at = measure.then(Instant::now).filter(|_| !keys.is_empty());
                let (check, applied) = shared.ask(&snapshot, &keys);
                let result = check.await;
                let latency = asked_at.map(|at| at.elapsed());
                shared.observer.store_checked(latency, &result);
                return Checked {
                    applied,
                    keys: Some(Box::new(keys)),
                    result,
                    phase,
                    latency,
                };
            };
            let applied: Applied = keys.iter().map(|(i, _, _)| *i).collect();
            let denied_now = |applied, keys| Checked {
                applied,
                keys: Some(Box::new(keys)),
                result: Ok(denied),
                phase,
                latency: None,
            };
            // Waiting needs tokio's timer; without a runtime the request is denied, not a panic.
            if tokio::runtime::Handle::try_current().is_err() {
                tracing::debug!("tollgate: a delay rule needs a tokio runtime to wait; denied");
                return denied_now(applied, keys);
            }
            let Some(_slot) = WaitSlot::take(&shared.waiting, shared.max_waiting) else {
                tracing::debug!("tollgate: too many requests wait for a delay rule; denied");
                return denied_now(applied, keys);
            };
            let start = tokio::time::Instant::now();
            let mut deadline = start + delay.max;
            loop {
                tokio::time::sleep(delay.wait).await;
                let asked_at = measure.then(Instant::now);
                let (check, applied) = shared.ask(&snapshot, &keys);
                let result = check.await;
                let latency = asked_at.map(|at| at.elapsed());
                shared.observer.store_checked(latency, &result);
                if let Ok(decision) = &result
                    && !decision.allowed()
                    && let Some(next) = delay_of(&snapshot, &applied, decision)
                {
                    // The strictest maximum of the rules that denied, counted from the start.
                    deadline = deadline.min(start + next.max);
                    if tokio::time::Instant::now() + next.wait <= deadline {
                        delay.wait = next.wait;
                        continue;
                    }
                }
                return Checked {
                    applied,
                    keys: Some(Box::new(keys)),
                    result,
                    phase,
                    latency,
                };
            }
        })
    }

    /// Settles what a response's head says of the charges it reserved: units back for the
    /// responses a rule does not charge, the difference for a cost known now, in one store
    /// call. The response waits for it (so that the next request sees it), unless the store
    /// answered at once: the store's future is returned when it did not.
    pub(crate) fn settle<B>(
        &self,
        snapshot: &Snapshot,
        settle: &Settle,
        response: Response<B>,
        answer: Option<(&mut Decision, &[u16])>,
    ) -> (Response<B>, Option<crate::store::StoreFuture<()>>) {
        let (parts, body) = response.into_parts();
        let mut adjustments: SmallVec<[Adjustment<'_>; 1]> = SmallVec::new();
        // Which rule each adjustment is of, by index.
        let mut of_rule: SmallVec<[u16; 1]> = SmallVec::new();
        for (i, key, cost, charged_at) in &settle.charges {
            let rule = &snapshot.rules[usize::from(*i)];
            let Some(after) = &rule.after else {
                continue;
            };
            let actual = after.actual(&parts, *cost);
            let change = match actual.cmp(cost) {
                std::cmp::Ordering::Equal => continue,
                std::cmp::Ordering::Greater => Change::Charge(actual - cost),
                std::cmp::Ordering::Less => Change::Refund(cost - actual),
            };
            adjustments.push(Adjustment {
                rule: &rule.spec,
                key,
                change,
                charged_at: *charged_at,
            });
            of_rule.push(*i);
        }
        // The answer's budget is the settled one: what came back is there again, what was
        // charged on top is not.
        if let Some((decision, applied)) = answer {
            for (a, i) in adjustments.iter().zip(&of_rule) {
                let outcome = applied
                    .iter()
                    .position(|j| j == i)
                    .and_then(|position| decision.outcome_mut(position));
                if let Some(outcome) = outcome {
                    outcome.remaining = match a.change {
                        Change::Refund(units) => (outcome.remaining + units).min(outcome.limit),
                        Change::Charge(units) => outcome.remaining.saturating_sub(units),
                    };
                }
            }
        }
        let pending = (!adjustments.is_empty())
            .then(|| match self.fallback.get().filter(|_| settle.local) {
                Some(fallback) => fallback.adjust(&adjustments),
                None => self.store.adjust(&adjustments),
            })
            .and_then(poll_once);
        (Response::from_parts(parts, body), pending)
    }

    /// What an admitted request carries to its response: the charges it settles after, the
    /// slots it holds (taken by the store, or by the local fallback when `local`), and the
    /// decision its answer reports.
    fn admitted(
        self: &Arc<Self>,
        snapshot: &Arc<Snapshot>,
        applied: &mut Applied,
        keys: Option<&FoundKeys>,
        decision: Decision,
        local: bool,
    ) -> Next {
        let rule = |i: u16| &snapshot.rules[usize::from(i)];
        let settle = if snapshot.settles {
            let charges = charges_of(applied, keys, &decision, |i| rule(i).after.is_some());
            (!charges.is_empty()).then(|| Box::new(Settle { charges, local }))
        } else {
            None
        };
        let held = if snapshot.holds {
            let mut slots = charges_of(applied, keys, &decision, |i| {
                rule(i).spec.algorithm().is_concurrency()
            });
            // A request that cost nothing holds nothing.
            slots.retain(|(_, _, units, _)| *units > 0);
            (!slots.is_empty()).then(|| Held {
                giver: self.clone(),
                snapshot: snapshot.clone(),
                slots,
                local,
            })
        } else {
            None
        };
        Next::Call(Admitted {
            decision: Some(visible(snapshot, applied, decision)),
            settle,
            held,
        })
    }

    /// Logs a store failure: at `error` at most once a minute, else at `debug`.
    fn report(&self, error: &StoreError) {
        // The clock is read only for a failure that may be logged: with the breaker open, every
        // request comes here.
        #[cfg(feature = "metrics")]
        crate::telemetry::store_error(
            self.observer.id,
            self.observer.store,
            match error {
                StoreError::Timeout => "timeout",
                StoreError::Unavailable(_) => "unavailable",
                StoreError::Protocol(_) => "protocol",
                StoreError::CircuitOpen => "circuit_open",
                StoreError::Unsupported(_) => "unsupported",
            },
        );
        // An open breaker, and a store not connected yet, are logged by the store itself.
        if !matches!(error, StoreError::CircuitOpen)
            && !error.is_reported()
            && self.warned_store_error.due(unix_micros(), 60_000_000)
        {
            tracing::error!(%error, "tollgate: the rate-limit store failed; each rule's FailureMode decides (reported at most once a minute)");
        } else {
            tracing::debug!(%error, "tollgate: the rate-limit store failed");
        }
    }

    /// Decides by each applied rule's [`FailureMode`]; on a local decision, `applied` becomes the
    /// rules it covers.
    fn without_store(
        &self,
        snapshot: &Snapshot,
        applied: &mut Applied,
        keys: Option<&FoundKeys>,
    ) -> WithoutStore {
        // Shadow rules never refuse, and are not checked without the store.
        let mode = |i: &u16| {
            let rule = &snapshot.rules[usize::from(*i)];
            if rule.mode == RuleMode::Shadow {
                FailureMode::Open
            } else {
                rule.on_store_error
            }
        };
        if applied.iter().any(|i| mode(i) == FailureMode::Closed) {
            return WithoutStore::Refuse;
        }
        let Some(keys) = keys.filter(|_| snapshot.uses_fallback) else {
            return WithoutStore::Unlimited;
        };
        let local: SmallVec<[Charge<'_>; 2]> = keys
            .iter()
            .filter(|(i, _, _)| mode(i) == FailureMode::Local)
            .map(|(i, key, cost)| Charge {
                rule: &snapshot.rules[usize::from(*i)].spec,
                key,
                cost: *cost,
            })
            .collect();
        if local.is_empty() {
            return WithoutStore::Unlimited;
        }
        *applied = keys
            .iter()
            .filter(|(i, _, _)| mode(i) == FailureMode::Local)
            .map(|(i, _, _)| *i)
            .collect();
        let fallback = self.fallback.get_or_init(MemoryStore::new);
        WithoutStore::Decided(fallback.decide(&local))
    }
}

impl<St: Store> GiveBack for Shared<St> {
    fn give_back(&self, held: &Held) {
        let adjustments: SmallVec<[Adjustment<'_>; 1]> = held
            .slots
            .iter()
            .map(|(i, key, units, at)| Adjustment {
                rule: &held.snapshot.rules[usize::from(*i)].spec,
                key,
                change: Change::Refund(*units),
                charged_at: *at,
            })
            .collect();
        let future = match self.fallback.get().filter(|_| held.local) {
            Some(fallback) => fallback.adjust(&adjustments),
            None => self.store.adjust(&adjustments),
        };
        let mut future = future;
        // A memory store answers at once; a Redis store outside a runtime refuses at once.
        let mut context = Context::from_waker(std::task::Waker::noop());
        match future.as_mut().poll(&mut context) {
            Poll::Ready(result) => report_give_back(result),
            Poll::Pending => match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(async move { report_give_back(future.await) });
                }
                Err(_) => report_give_back(Err(StoreError::Unavailable(
                    "released outside a Tokio runtime".into(),
                ))),
            },
        }
    }
}

/// Says when slots could not be given back (at most once every 10 s: an outage would say it
/// for every request): they are free when their hold expires.
pub(crate) fn report_give_back(result: Result<(), StoreError>) {
    static WARNED: Every = Every::new();
    if let Err(error) = result
        && WARNED.due(unix_micros(), 10_000_000)
    {
        tracing::warn!(%error, "tollgate: could not give concurrency slots back; they are free when their hold expires (said at most every 10 s)");
    }
}

/// A store's future of an operation, polled once: `None` when it is done (a store that answers
/// at once, as the memory store does), else the future to wait for.
fn poll_once(mut future: crate::store::StoreFuture<()>) -> Option<crate::store::StoreFuture<()>> {
    let mut context = Context::from_waker(std::task::Waker::noop());
    match future.as_mut().poll(&mut context) {
        Poll::Ready(result) => {
            report_settle(result);
            None
        }
        Poll::Pending => Some(future),
    }
}

/// Says when a settle failed: the reserved units stay charged.
pub(crate) fn report_settle(result: Result<(), StoreError>) {
    if let Err(error) = result {
        tracing::warn!(%error, "tollgate: could not settle a charge; the reserved units stay");
    }
}

/// The charges of `applied` rules that `wanted` picks, with when each was made (0 when the
/// store did not say: "now" on its clock, when they are adjusted).
fn charges_of(
    applied: &Applied,
    keys: Option<&FoundKeys>,
    decision: &Decision,
    wanted: impl Fn(u16) -> bool,
) -> SmallVec<[(u16, Key, u64, u64); 1]> {
    let Some(keys) = keys else {
        return SmallVec::new();
    };
    keys.iter()
        .filter(|(i, _, _)| wanted(*i))
        .filter_map(|(i, key, cost)| {
            let position = applied.iter().position(|j| j == i)?;
            Some((*i, key.clone(), *cost, decision.charged_at(position)))
        })
        .collect()
}

/// The verdict of a denial: by the store, or by its deny cache.
fn denied(decision: &Decision) -> Verdict {
    if decision.source() == DecisionSource::DenyCache {
        Verdict::CacheDenied
    } else {
        Verdict::Denied
    }
}

/// Whether a request is a browser's CORS preflight: `OPTIONS` with `Origin` and
/// `Access-Control-Request-Method` (the Fetch standard's definition). Any client can send
/// these headers, and such a request is not counted (the deny lists still apply): what answers
/// `OPTIONS` behind the layer must be cheap (a CORS layer answers it before the handlers).
fn is_preflight(parts: &Parts) -> bool {
    parts.method == http::Method::OPTIONS
        && parts.headers.contains_key(http::header::ORIGIN)
        && parts
            .headers
            .contains_key(http::header::ACCESS_CONTROL_REQUEST_METHOD)
}

/// No rule applies to this request: it goes through, with no budget to report.
fn nothing_applies<C>() -> Start<C> {
    Start::Decided {
        next: Next::Call(Admitted::default()),
        applied: Applied::new(),
    }
}

/// The answer to a denied request (shadow rules left out of it).
fn denied_answer(
    snapshot: &Snapshot,
    applied: &mut Applied,
    decision: Decision,
    grpc: bool,
) -> Next {
    // Told to the rejection log (target `tollgate::denied`) by `Shared::emit`.
    let decision = visible(snapshot, applied, decision);
    Next::Answer(
        snapshot
            .answers
            .denied(&snapshot.rules, applied, &decision, grpc),
    )
}

/// The decision without its shadow rules, which add nothing to answers; `applied` alike.
fn visible(snapshot: &Snapshot, applied: &mut Applied, decision: Decision) -> Decision {
    if !snapshot.watches {
        return decision;
    }
    let shadow = |i: u16| snapshot.rules[usize::from(i)].mode == RuleMode::Shadow;
    if !applied.iter().any(|&i| shadow(i)) {
        return decision;
    }
    let kept = Decision::from_outcomes(
        applied
            .iter()
            .zip(decision.outcomes())
            .filter(|(i, _)| !shadow(**i))
            .map(|(_, o)| *o),
    );
    applied.retain(|i| !shadow(*i));
    kept
}

/// How long a denied request may wait for the budget of the delay rules that denied it.
#[derive(Clone, Copy, Debug)]
struct Delay {
    wait: Duration,
    max: Duration,
}

/// The wait of a request that only delay rules denied (shadow rules aside), when it fits within
/// the shortest maximum of those rules; `None` otherwise (it is denied).
fn delay_of(snapshot: &Snapshot, applied: &[u16], decision: &Decision) -> Option<Delay> {
    let mut wait = 0;
    let mut max = Duration::MAX;
    for (&i, outcome) in applied.iter().zip(decision.outcomes()) {
        if outcome.allowed {
            continue;
        }
        match snapshot.rules[usize::from(i)].mode {
            RuleMode::Shadow => {}
            RuleMode::Delay { max: rule_max } => {
                if outcome.retry_after == u64::MAX {
                    return None;
                }
                wait = wait.max(outcome.retry_after);
                max = max.min(rule_max);
            }
            _ => return None,
        }
    }
    // At least a millisecond: a store that says "now" and still denies is not asked in a loop.
    let wait = Duration::from_micros(wait).max(Duration::from_millis(1));
    (max != Duration::MAX && wait <= max).then_some(Delay { wait, max })
}

/// One of the bounded places of requests waiting for a delay rule; given back when dropped.
struct WaitSlot<'a>(&'a AtomicUsize);

impl<'a> WaitSlot<'a> {
    fn take(waiting: &'a AtomicUsize, max: usize) -> Option<Self> {
        let before = waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        #[cfg(feature = "metrics")]
        crate::telemetry::waiting(true);
        let _ = before;
        Some(WaitSlot(waiting))
    }
}

impl Drop for WaitSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
        #[cfg(feature = "metrics")]
        crate::telemetry::waiting(false);
    }
}

/// The key of a request whose extractor found none for rule `rule`: the shared
/// "unidentified" key, or none when the rule skips such requests. Says so once.
fn missing_key(snapshot: &Snapshot, rule: u16, kind: RequestKind) -> Option<Key> {
    let compiled = &snapshot.rules[usize::from(rule)];
    let hint = &snapshot.missing_key_hints[usize::from(rule)][kind as usize];
    if hint.first() {
        let counted = if compiled.skip_unidentified {
            "this rule does not limit such requests (Rule::skip_unidentified)"
        } else {
            "such requests share one budget under the key \"unidentified\" \
             (Rule::skip_unidentified() lets them through instead)"
        };
        tracing::warn!(
            rule = compiled.spec.name(),
            "tollgate: the key extractor found no key for a request; {counted}. If the rule \
             counts by the peer or client IP: {} Otherwise chain a fallback extractor with \
             .or(..). Reported once per rule.",
            kind.fix()
        );
    }
    (!compiled.skip_unidentified).then(Key::unidentified)
}

/// How a request is decided when the store failed.
enum WithoutStore {
    /// A rule fails closed.
    Refuse,
    /// The local limiter decided the rules that fall back to it.
    Decided(Decision),
    /// Every rule fails open.
    Unlimited,
}

/// Which kind of server a request came through, for the missing-key hint.
#[derive(Clone, Copy, Debug)]
enum RequestKind {
    Http = 0,
    Grpc = 1,
}

impl RequestKind {
    fn of(parts: &Parts) -> Self {
        if is_grpc(&parts.headers) {
            RequestKind::Grpc
        } else {
            RequestKind::Http
        }
    }

    /// How to give the layer the peer address on this kind of server.
    fn fix(self) -> &'static str {
        match self {
            RequestKind::Http => {
                "with axum, serve with app.into_make_service_with_connect_info::<SocketAddr>(); \
                 with hyper or another server, insert the peer's SocketAddr as a request \
                 extension."
            }
            RequestKind::Grpc => {
                "with tonic, serve with tonic::transport::Server (it records the peer address, \
                 which tollgate reads through its `tonic` feature, on by default; tollgate reads \
                 tonic 0.14's TcpConnectInfo, so another tonic version needs a SocketAddr \
                 extension inserted by an interceptor or layer)."
            }
        }
    }
}
