//! The decision: from a request's head to what follows it.
//!
//! 1. Each rule's extractor finds the request's key ([`Shared::start`]); a rule whose extractor
//!    finds none counts the request under the shared [`Key::unidentified`] key, unless the rule
//!    skips such requests.
//! 2. The store checks every key in one atomic step ([`Check`]).
//! 3. Its answer becomes what follows ([`Shared::after_check`]): call the inner service (and add
//!    the budget to its response), or answer for it (429, gRPC `RESOURCE_EXHAUSTED`, or 503 when
//!    the store failed and a rule fails closed). A store failure is decided by each rule's
//!    [`FailureMode`].
//!
//! Nothing here knows about `Service` or futures of the inner service: `service.rs` calls
//! [`Shared::start`], `future.rs` waits for what it could not decide at once.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::Response;
use http::request::Parts;
use pin_project_lite::pin_project;
use smallvec::SmallVec;

use crate::key::{Extracted, Key, KeyFuture};
use crate::policy::CompiledRule;
use crate::response::{Answers, is_grpc};
use crate::store::{Charge, MemoryStore, Store, StoreError};
use crate::warn::{Every, Once, unix_micros};
use crate::{Decision, FailureMode};

/// Indices of the rules that applied to one request, in rule order.
pub(crate) type Applied = SmallVec<[u16; 4]>;

/// Keys found for a request: the rule's index, the key, the cost.
pub(crate) type FoundKeys = SmallVec<[(u16, Key, u64); 2]>;

/// Keys that need a lookup: the rule's index, the lookup, the cost.
type PendingKeys = SmallVec<[(u16, KeyFuture, u64); 1]>;

/// The check of a request whose keys needed asynchronous work: the rules that applied, their
/// keys when a local fallback may need them, and the store's answer.
pub(crate) type DeferredCheck = Pin<
    Box<
        dyn Future<
                Output = (
                    Applied,
                    Option<Box<FoundKeys>>,
                    Result<Decision, StoreError>,
                ),
            > + Send,
    >,
>;

/// Everything the services of one layer share.
pub(crate) struct Shared<St> {
    pub(crate) rules: Box<[CompiledRule]>,
    /// Per rule: whether the missing-key hint was given, for HTTP and for gRPC requests.
    pub(crate) missing_key_hints: Box<[[Once; 2]]>,
    /// Every answer the layer writes.
    pub(crate) answers: Answers,
    pub(crate) store: St,
    /// The local limiter of rules that fall back to one when the store fails.
    pub(crate) fallback: Option<MemoryStore>,
    pub(crate) warned_store_error: Every,
    /// Holds this layer's registration of its rules on the store: while it lives, no other
    /// layer may give one of these rule names another quota on the same store.
    pub(crate) _registration: Option<Arc<()>>,
}

/// What follows a request's check.
pub(crate) enum Next {
    /// Call the inner service, then add the budget headers of this decision (none when no
    /// rule limited the request).
    Call(Option<Decision>),
    /// Answer for the inner service: a denial, or a refusal when the store failed.
    Answer(Response<Bytes>),
}

/// How far [`Shared::start`] got.
pub(crate) enum Start<C> {
    /// Decided at once (the store answered without waiting, or no rule applied).
    Decided { next: Next, applied: Applied },
    /// The store is asked; its answer comes through `check`.
    Checking {
        check: Check<C>,
        applied: Applied,
        /// The keys, kept only when a rule may fall back to the local limiter.
        keys: Option<Box<FoundKeys>>,
    },
    /// Some keys need a lookup before the store can be asked.
    Deferred(DeferredCheck),
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

impl<St: Store> Shared<St> {
    /// Finds the request's keys and asks the store, deciding at once when it can.
    pub(crate) fn start(self: &Arc<Self>, parts: &Parts) -> Start<St::Future> {
        if let [rule] = &*self.rules {
            // The common case, one rule: no lists to build.
            let cost = rule.cost.of(parts);
            let key = match rule.key.extract(parts) {
                Extracted::Found(key) => key,
                Extracted::Missing => match self.missing_key(0, parts) {
                    Some(key) => key,
                    None => return self.nothing_applies(),
                },
                Extracted::Pending(future) => {
                    let mut pending = PendingKeys::new();
                    pending.push((0, future, cost));
                    return Start::Deferred(self.deferred(FoundKeys::new(), pending, parts));
                }
            };
            let check = Check::ask(
                &self.store,
                &[Charge {
                    rule: &rule.spec,
                    key: &key,
                    cost,
                }],
            );
            let applied = Applied::from_buf_and_len([0; 4], 1);
            let keys = self.fallback.as_ref().map(|_| {
                let mut keys = FoundKeys::new();
                keys.push((0, key, cost));
                keys
            });
            return self.respond(check, applied, keys, parts);
        }

        let mut keys = FoundKeys::new();
        let mut pending = PendingKeys::new();
        for (i, rule) in self.rules.iter().enumerate() {
            let index = i as u16;
            match rule.key.extract(parts) {
                Extracted::Found(key) => keys.push((index, key, rule.cost.of(parts))),
                Extracted::Missing => {
                    if let Some(key) = self.missing_key(i, parts) {
                        keys.push((index, key, rule.cost.of(parts)));
                    }
                }
                Extracted::Pending(future) => pending.push((index, future, rule.cost.of(parts))),
            }
        }
        if !pending.is_empty() {
            return Start::Deferred(self.deferred(keys, pending, parts));
        }
        let (check, applied) = self.ask(&keys);
        let keys = self.fallback.is_some().then_some(keys);
        self.respond(check, applied, keys, parts)
    }

    /// No rule applies to this request: it goes through, with no budget to report.
    fn nothing_applies(&self) -> Start<St::Future> {
        Start::Decided {
            next: Next::Call(None),
            applied: Applied::new(),
        }
    }

    /// Decides at once when the store answered without waiting.
    fn respond(
        &self,
        check: Check<St::Future>,
        mut applied: Applied,
        keys: Option<FoundKeys>,
        parts: &Parts,
    ) -> Start<St::Future> {
        match check.into_decided() {
            Ok(result) => {
                let grpc = || is_grpc(&parts.headers);
                let next = self.after_check(&mut applied, keys.as_ref(), result, grpc);
                Start::Decided { next, applied }
            }
            Err(check) => Start::Checking {
                check,
                applied,
                keys: keys.map(Box::new),
            },
        }
    }

    /// Waits for the keys that need a lookup, then asks the store.
    fn deferred(
        self: &Arc<Self>,
        mut keys: FoundKeys,
        pending: PendingKeys,
        parts: &Parts,
    ) -> DeferredCheck {
        let shared = self.clone();
        // What a missing key's hint needs to know of the request, copied: the future cannot
        // borrow it.
        let kind = RequestKind::of(parts);
        Box::pin(async move {
            for (index, future, cost) in pending {
                let key = match future.await {
                    Some(key) => Some(key),
                    None => shared.missing_key_of(usize::from(index), kind),
                };
                if let Some(key) = key {
                    keys.push((index, key, cost));
                }
            }
            keys.sort_unstable_by_key(|(i, _, _)| *i);
            let (check, applied) = shared.ask(&keys);
            let result = check.await;
            let keys = shared.fallback.as_ref().map(|_| Box::new(keys));
            (applied, keys, result)
        })
    }

    /// Asks the store about every rule that has a key, in rule order.
    fn ask(&self, keys: &FoundKeys) -> (Check<St::Future>, Applied) {
        let charges: SmallVec<[Charge<'_>; 2]> = keys
            .iter()
            .map(|(i, key, cost)| Charge {
                rule: &self.rules[usize::from(*i)].spec,
                key,
                cost: *cost,
            })
            .collect();
        let applied = keys.iter().map(|(i, _, _)| *i).collect();
        (Check::ask(&self.store, &charges), applied)
    }
}

impl<St> Shared<St> {
    /// The key of a request whose extractor found none for rule `rule`: the shared
    /// "unidentified" key, or none when the rule skips such requests. Says so once.
    fn missing_key(&self, rule: usize, parts: &Parts) -> Option<Key> {
        self.missing_key_of(rule, RequestKind::of(parts))
    }

    fn missing_key_of(&self, rule: usize, kind: RequestKind) -> Option<Key> {
        let compiled = &self.rules[rule];
        let hint = &self.missing_key_hints[rule][kind as usize];
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

    /// Turns the store's answer into what follows: a denial becomes the answer, and a store
    /// failure is decided by each applied rule's [`FailureMode`]. `grpc` tells whether the
    /// request is a gRPC call (asked only to answer).
    pub(crate) fn after_check(
        &self,
        applied: &mut Applied,
        keys: Option<&FoundKeys>,
        result: Result<Decision, StoreError>,
        grpc: impl Fn() -> bool,
    ) -> Next {
        match result {
            Ok(decision) if decision.allowed() => Next::Call(Some(decision)),
            Ok(decision) => self.deny(applied, &decision, grpc()),
            Err(error) => {
                self.report(&error);
                match self.without_store(applied, keys) {
                    WithoutStore::Refuse => {
                        Next::Answer(self.answers.unavailable(&self.rules, applied, grpc()))
                    }
                    WithoutStore::Decided(decision) if !decision.allowed() => {
                        self.deny(applied, &decision, grpc())
                    }
                    WithoutStore::Decided(decision) => Next::Call(Some(decision)),
                    WithoutStore::Unlimited => Next::Call(None),
                }
            }
        }
    }

    fn deny(&self, applied: &[u16], decision: &Decision, grpc: bool) -> Next {
        tracing::debug!(
            violated = %self.answers.violated(&self.rules, applied, decision),
            retry_after_s = decision.retry_after_seconds(),
            grpc,
            "tollgate: request denied"
        );
        Next::Answer(self.answers.denied(&self.rules, applied, decision, grpc))
    }

    /// Logs a store failure: at `error` at most once a minute, else at `debug`.
    fn report(&self, error: &StoreError) {
        // The clock is read only for a failure that may be logged: with the breaker open, every
        // request comes here.
        if !matches!(error, StoreError::CircuitOpen)
            && self.warned_store_error.due(unix_micros(), 60_000_000)
        {
            tracing::error!(%error, "tollgate: the rate-limit store failed; each rule's FailureMode decides (reported at most once a minute)");
        } else {
            tracing::debug!(%error, "tollgate: the rate-limit store failed");
        }
    }

    /// Decides by each applied rule's [`FailureMode`]; on a local decision, `applied` becomes the
    /// rules it covers.
    fn without_store(&self, applied: &mut Applied, keys: Option<&FoundKeys>) -> WithoutStore {
        let mode = |i: &u16| self.rules[usize::from(*i)].on_store_error;
        if applied.iter().any(|i| mode(i) == FailureMode::Closed) {
            return WithoutStore::Refuse;
        }
        let (Some(fallback), Some(keys)) = (&self.fallback, keys) else {
            return WithoutStore::Unlimited;
        };
        let local: SmallVec<[Charge<'_>; 2]> = keys
            .iter()
            .filter(|(i, _, _)| mode(i) == FailureMode::Local)
            .map(|(i, key, cost)| Charge {
                rule: &self.rules[usize::from(*i)].spec,
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
        WithoutStore::Decided(fallback.decide(&local))
    }
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
