//! The keys of a request's rules: each rule's extractor finds the request's key (a rule
//! whose extractor finds none counts it under the shared [`Key::unidentified`] key, unless the
//! rule skips such requests), then the store is asked, at once or after the lookups.

use std::sync::Arc;

use http::request::Parts;
use smallvec::SmallVec;

use super::check::{Check, Checked, Ctx, DeferredCheck, Phase, Stopwatch};
use super::gate::nothing_applies;
use super::ruling::{Decide, Pending, Wait};
use super::state::Engine;
use crate::key::{Extracted, Key, KeyFuture};
use crate::observe::{Head, Verdict};
use crate::policy::snapshot::Snapshot;
use crate::policy::{Applied, AppliedRules, Resolution, RuleIndices};
use crate::store::{Charge, Store};
use crate::wire::is_grpc;

/// Keys that need a lookup: the rule's index, the lookup, the cost.
type PendingKeys = SmallVec<[(u16, KeyFuture, u64); 1]>;

impl<St: Store> Engine<St> {
    /// Finds the keys of `rules` and asks the store.
    pub(super) fn check_rules(
        self: &Arc<Self>,
        snapshot: &Arc<Snapshot>,
        rules: &[u16],
        resolution: Resolution,
        parts: &Parts,
        span: &tracing::Span,
    ) -> Decide<St::Future> {
        let (stopwatch, check, applied, keys) = if let [index] = *rules {
            // The common case, one rule: no lists to build.
            let rule = &snapshot.rules[usize::from(index)];
            let cost = rule.cost.of(parts);
            let key = match rule.key.extract(parts) {
                Extracted::Found(key) => key,
                Extracted::Missing => match missing_key(snapshot, index, RequestKind::of(parts)) {
                    Some(key) => key,
                    None => {
                        self.emit_listed(
                            snapshot,
                            parts,
                            Some(resolution),
                            span,
                            Verdict::NotLimited,
                        );
                        return nothing_applies();
                    }
                },
                Extracted::Pending(future) => {
                    let mut pending = PendingKeys::new();
                    pending.push((index, future, cost));
                    return Decide::waiting(
                        Wait::Deferred {
                            check: self.deferred(
                                snapshot,
                                (AppliedRules::new(), pending),
                                resolution,
                                parts,
                                span,
                            ),
                        },
                        Some(resolution),
                    );
                }
            };
            let stopwatch = Stopwatch::start_for(span);
            let check = Check::ask(
                &self.store,
                &[Charge {
                    rule: &rule.spec,
                    key: &key,
                    cost,
                }],
            );
            let applied = RuleIndices::from_buf_and_len([index, 0, 0, 0], 1);
            let mut keys = AppliedRules::new();
            keys.push(Applied {
                rule: index,
                key,
                cost,
            });
            (stopwatch, check, applied, keys)
        } else {
            let mut keys = AppliedRules::new();
            let mut pending = PendingKeys::new();
            for &index in rules {
                let rule = &snapshot.rules[usize::from(index)];
                let key = match rule.key.extract(parts) {
                    Extracted::Found(key) => Some(key),
                    Extracted::Missing => missing_key(snapshot, index, RequestKind::of(parts)),
                    Extracted::Pending(future) => {
                        pending.push((index, future, rule.cost.of(parts)));
                        None
                    }
                };
                if let Some(key) = key {
                    keys.push(Applied {
                        rule: index,
                        key,
                        cost: rule.cost.of(parts),
                    });
                }
            }
            if !pending.is_empty() {
                return Decide::waiting(
                    Wait::Deferred {
                        check: self.deferred(snapshot, (keys, pending), resolution, parts, span),
                    },
                    Some(resolution),
                );
            }
            let stopwatch = Stopwatch::start_for(span);
            let (check, applied) = self.ask(snapshot, &keys);
            (stopwatch, check, applied, keys)
        };
        self.respond(
            snapshot,
            check,
            (applied, keys),
            resolution,
            parts,
            span,
            stopwatch,
        )
    }

    /// Decides at once when the store answered without waiting.
    #[allow(clippy::too_many_arguments)]
    fn respond(
        self: &Arc<Self>,
        snapshot: &Arc<Snapshot>,
        check: Check<St::Future>,
        (mut applied, keys): (RuleIndices, AppliedRules),
        resolution: Resolution,
        parts: &Parts,
        span: &tracing::Span,
        stopwatch: Stopwatch,
    ) -> Decide<St::Future> {
        match check.into_decided() {
            Ok(result) => {
                let stopwatch = if applied.is_empty() {
                    Stopwatch::default()
                } else {
                    stopwatch
                };
                let latency = stopwatch.stop(&self.observer, &result);
                let ctx = Ctx {
                    head: Head::of_parts(parts),
                    span,
                    latency,
                    phase: Phase::default(),
                    resolution,
                };
                self.after_check(snapshot, &mut applied, Some(&keys), result, &ctx)
            }
            Err(check) => Decide::Waiting(Pending {
                wait: Wait::Store { check, stopwatch },
                applied,
                // Kept for a second check, and for the rejection log's digest.
                keys: (snapshot.keeps_keys() || self.observer.log.enabled())
                    .then(|| Box::new(keys)),
                resolution: Some(resolution),
                recheck: false,
            }),
        }
    }

    /// Waits for the keys that need a lookup, then asks the store.
    fn deferred(
        self: &Arc<Self>,
        snapshot: &Arc<Snapshot>,
        (mut keys, pending): (AppliedRules, PendingKeys),
        resolution: Resolution,
        parts: &Parts,
        span: &tracing::Span,
    ) -> DeferredCheck {
        let engine = self.clone();
        let snapshot = snapshot.clone();
        // What a missing key's hint needs to know of the request, copied: the future cannot
        // borrow it.
        let kind = RequestKind::of(parts);
        let timed = Stopwatch::times(span);
        let log = self.observer.log.enabled();
        Box::pin(async move {
            for (index, future, cost) in pending {
                let key = match future.await {
                    Some(key) => Some(key),
                    None => missing_key(&snapshot, index, kind),
                };
                if let Some(key) = key {
                    keys.push(Applied {
                        rule: index,
                        key,
                        cost,
                    });
                }
            }
            keys.sort_unstable_by_key(|applied| applied.rule);
            let (applied, result, latency) = engine.check_timed(&snapshot, &keys, timed).await;
            let keys = (snapshot.keeps_keys() || log).then(|| Box::new(keys));
            Checked {
                applied,
                keys,
                result,
                phase: Phase::default(),
                latency,
                resolution,
            }
        })
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
