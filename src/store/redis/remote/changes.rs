//! The changes a Redis store makes outside its checks: adjustments, resets (and telling the
//! other replicas of them), and giving back the slots of a reply no request read. Each
//! [`Transport`] brings its own call (one server, or one call per slot of a cluster).

use std::sync::Arc;

use super::transport::{Transport, runtime};
use crate::clock::unix_micros;
use crate::key::Key;
use crate::runtime::Origin;
use crate::store::redis::keys;
use crate::store::redis::late_reply::GiveBackOrphan;
use crate::store::redis::script::{self, Mode, Prepared};
use crate::store::{Adjustment, Change, Charge, RuleSpec, StoreError, StoreFuture};
use crate::throttle::{Every, report_give_back};

/// Tells the other replicas what `inner` forgot, in a task of its own (the operation's caller
/// does not wait for it); a failure is logged (each replica's cap on a cached denial's life
/// still holds), never the operation's error. Rules whose denials are never cached (concurrency
/// limits) are not told.
fn tell_forgotten<T: Transport>(inner: &Arc<T>, forgotten: &[(RuleSpec, Key)]) {
    let prefix = &inner.parts().settings.prefix;
    let names: Vec<String> = forgotten
        .iter()
        .filter(|(rule, _)| !rule.algorithm().is_concurrency())
        .map(|(rule, key)| keys::key_name(prefix, key, rule.name()))
        .collect();
    if names.is_empty() {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let inner = inner.clone();
    runtime.spawn(async move {
        if let Err(error) = inner.publish(names).await {
            static WARNED: Every = Every::new();
            if WARNED.due(unix_micros(), 60_000_000) {
                tracing::warn!(
                    %error,
                    "tollgate: could not tell the other replicas of a reset or an adjustment; \
                     their cached denials of those keys end by their cap (deny_cache_max_age) \
                     (reported at most once a minute)"
                );
            }
        }
    });
}

/// The refusal of an operation that cannot be made: on one key of a rule split into sub-keys
/// (which sub-key is not known). One polled outside a Tokio runtime is refused when it is
/// polled ([`runtime`]).
fn refusal<'a>(mut rules: impl Iterator<Item = &'a RuleSpec>) -> Option<StoreError> {
    rules
        .any(|r| r.parts() > 1)
        .then_some(StoreError::Unsupported(
            "adjust, peek or reset one key of a split rule",
        ))
}

/// The rules and keys a change forgets here, owned (they outlive the change's call).
fn owned<'a>(changed: impl Iterator<Item = (&'a RuleSpec, &'a Key)>) -> Vec<(RuleSpec, Key)> {
    changed
        .map(|(rule, key)| (rule.clone(), key.clone()))
        .collect()
}

/// [`Store::adjust`](crate::store::Store::adjust): one call per time the units were charged;
/// one that fails does not stop the others.
pub(crate) fn adjust<T: Transport>(
    inner: &Arc<T>,
    adjustments: &[Adjustment<'_>],
) -> StoreFuture<()> {
    if let Some(error) = refusal(adjustments.iter().map(|a| a.rule)) {
        return Box::pin(std::future::ready(Err(error)));
    }
    let inner = inner.clone();
    let forget = owned(adjustments.iter().map(|a| (a.rule, a.key)));
    // Refunds give units back: the other replicas' denials of those keys may be out of date.
    let refunded = owned(
        adjustments
            .iter()
            .filter(|a| matches!(a.change, Change::Refund(units) if units > 0))
            .map(|a| (a.rule, a.key)),
    );
    let calls = script::adjustments(&inner.parts().settings.prefix, adjustments);
    let now = inner.parts().settings.now();
    Box::pin(async move {
        runtime()?;
        let mut result = Ok(());
        for (at, charges) in calls {
            if let Err(error) = inner.clone().call(Mode::Adjust(at), now, charges).await {
                result = result.and(Err(error));
            }
        }
        // Forgotten once the store changed: a denial cached meanwhile goes too.
        for (rule, key) in &forget {
            inner.parts().replica.forget(rule, key, false);
        }
        if result.is_ok() && !refunded.is_empty() {
            tell_forgotten(&inner, &refunded);
        }
        result
    })
}

/// [`Store::reset`](crate::store::Store::reset).
pub(crate) fn reset<T: Transport>(inner: &Arc<T>, charges: &[Charge<'_>]) -> StoreFuture<()> {
    if let Some(error) = refusal(charges.iter().map(|c| c.rule)) {
        return Box::pin(std::future::ready(Err(error)));
    }
    let inner = inner.clone();
    let forget = owned(charges.iter().map(|c| (c.rule, c.key)));
    let prepared = prepared(&inner.parts().settings.prefix, charges);
    let now = inner.parts().settings.now();
    Box::pin(async move {
        runtime()?;
        let result = inner.clone().call(Mode::Reset, now, prepared).await;
        for (rule, key) in &forget {
            inner.parts().replica.forget(rule, key, result.is_ok());
        }
        if result.is_ok() {
            tell_forgotten(&inner, &forget);
        }
        result
    })
}

/// The charges, ready to send, whole keys (a split rule's are refused before).
pub(crate) fn prepared(prefix: &str, charges: &[Charge<'_>]) -> Vec<Prepared> {
    charges.iter().map(|c| Prepared::new(prefix, c)).collect()
}

/// The refusal of a peek of one key of a split rule.
pub(crate) fn peek_refusal(charges: &[Charge<'_>]) -> Option<StoreError> {
    refusal(charges.iter().map(|c| c.rule))
}

/// What gives back the slots of a reply whose request went away, each refund at the time its
/// slots were taken. Made where the reply came: it gives them back on that runtime (where the
/// connection and its timers are), wherever the request is dropped; made where none runs, on
/// the current one. With neither, the slots stay held until their longest hold ends.
pub(crate) fn give_back_orphan<T: Transport>(inner: Arc<T>, now: Option<u64>) -> GiveBackOrphan {
    let origin = Origin::here();
    Box::new(move |refunds| {
        let Some(runtime) = origin.runtime() else {
            return;
        };
        runtime.spawn(async move {
            for (at, refund) in refunds {
                let result = inner
                    .clone()
                    .call(Mode::Adjust(at), now, vec![refund])
                    .await;
                report_give_back(result);
            }
        });
    })
}
