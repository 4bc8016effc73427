//! [`Remote`]: a Redis store whatever its [`Transport`]: the [`Store`] methods (checks, peeks,
//! adjustments, resets) and the replies no request read, written once for both.

mod beating;
mod changes;
mod checking;
mod future;
mod transport;

use std::sync::Arc;

use self::checking::Checking;
use crate::Decision;
use crate::store::redis::late_reply::Waiting;
use crate::store::{Adjustment, Charge, RuleRegistry, Store, StoreError, StoreFuture};

pub(crate) use beating::{count_now, keep_beating};
pub(crate) use changes::give_back_orphan;
pub(crate) use future::CheckFuture;
pub(crate) use transport::{Parts, Sent, Transport, runtime};

/// A Redis store over the transport `T`; clones share it.
pub(crate) struct Remote<T>(Arc<T>);

impl<T> Clone for Remote<T> {
    fn clone(&self) -> Self {
        Remote(self.0.clone())
    }
}

impl<T: Transport> Remote<T> {
    /// The store over `transport`, which starts connecting.
    pub(crate) fn started(transport: Arc<T>) -> Self {
        transport.start();
        Remote(transport)
    }

    /// The transport.
    pub(crate) fn transport(&self) -> &Arc<T> {
        &self.0
    }
}

impl<T: Transport> Store for Remote<T> {
    type Future = CheckFuture;

    fn check(&self, charges: &[Charge<'_>]) -> CheckFuture {
        if charges.is_empty() {
            return Box::pin(async { Ok(Decision::default()) });
        }
        if charges.len() > 1
            && let Some(error) = repeated(charges)
        {
            return Box::pin(std::future::ready(Err(error)));
        }
        let transport = &self.0;
        let mut plan = transport.parts().replica.plan(charges);
        if !plan.sends() {
            return Box::pin(std::future::ready(plan.settle(None)));
        }
        transport.start();
        if let Some(error) = transport.unsendable() {
            // Units held here are spent all the same.
            return Box::pin(std::future::ready(plan.settle(Some(Err(error)))));
        }
        let waiting = Waiting::new(plan.prepared(&transport.parts().settings.prefix, charges));
        let now = transport.parts().settings.now();
        let alone = transport.runs_alone(waiting.charges());
        if alone {
            // On its way already: its request waits for it.
            return Box::pin(Checking::new(transport.clone(), plan, waiting, now, true));
        }
        // A request paid from this replica's leases that only refills them ahead of need is
        // answered now, on a Tokio runtime, its call going on in a task of its own. (The plan
        // goes straight into its future: it is a few hundred bytes, and each move copies it.)
        if plan.paid_here()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
            && let Some(decision) = plan.detach()
        {
            let call = Checking::new(transport.clone(), plan, waiting, now, false);
            drop(runtime.spawn(call));
            return Box::pin(std::future::ready(Ok(decision)));
        }
        Box::pin(Checking::new(transport.clone(), plan, waiting, now, false))
    }

    /// Answers at once a check decided here (a denial Redis made moments ago, units leased to
    /// this replica), or one that cannot be sent: the store has not connected yet, or the
    /// circuit breaker of the server that holds every key of the check is open.
    fn check_now(&self, charges: &[Charge<'_>]) -> Option<Result<Decision, StoreError>> {
        if charges.is_empty() {
            return None;
        }
        let replica = &self.0.parts().replica;
        if let Some(decision) = replica.answer(charges, true) {
            return Some(Ok(decision));
        }
        let error = self.0.refusal(charges)?;
        // Redis cannot be asked: units held here are spent all the same.
        Some(replica.answer(charges, false).ok_or(error))
    }

    fn registry(&self) -> Option<&RuleRegistry> {
        Some(&self.0.parts().registry)
    }

    fn kind(&self) -> &'static str {
        T::KIND
    }

    fn replicas(&self) -> Option<u32> {
        self.0.parts().fleet.replicas()
    }

    fn counts_replicas(&self) -> bool {
        self.0.parts().fleet.counts()
    }

    fn adjust(&self, adjustments: &[Adjustment<'_>]) -> StoreFuture<()> {
        changes::adjust(&self.0, adjustments)
    }

    fn peek(&self, charges: &[Charge<'_>]) -> StoreFuture<Decision> {
        if let Some(error) = changes::peek_refusal(charges) {
            return Box::pin(std::future::ready(Err(error)));
        }
        let transport = self.0.clone();
        let prepared = changes::prepared(&transport.parts().settings.prefix, charges);
        let now = transport.parts().settings.now();
        Box::pin(async move {
            runtime()?;
            let reply = transport.peek(prepared, now).await?;
            Ok(Decision::from_outcomes(reply.outcomes).made_at_time(reply.now))
        })
    }

    fn reset(&self, charges: &[Charge<'_>]) -> StoreFuture<()> {
        changes::reset(&self.0, charges)
    }
}

/// The [`Store`] of a public Redis store type whose field `remote` is its [`Remote`], and its
/// `prefix` and `key_name`.
macro_rules! store_by_remote {
    ($store:ty) => {
        impl $store {
            /// The key prefix.
            pub fn prefix(&self) -> &str {
                &$crate::store::redis::remote::Transport::parts(&**self.remote.transport())
                    .settings
                    .prefix
            }

            /// The Redis key that holds `rule`'s state for `identity`: `prefix:{identity}:rule`.
            pub fn key_name(&self, rule: &str, identity: &$crate::key::Key) -> String {
                $crate::store::redis::keys::key_name(self.prefix(), identity, rule)
            }
        }

        impl $crate::store::Store for $store {
            type Future = $crate::store::redis::remote::CheckFuture;

            fn check(&self, charges: &[$crate::store::Charge<'_>]) -> Self::Future {
                $crate::store::Store::check(&self.remote, charges)
            }

            /// Answers at once a check decided here (a denial Redis made moments ago, units
            /// leased to this replica), or one that cannot be sent: the store has not connected
            /// yet, or the circuit breaker of the server that holds every key of the check is
            /// open.
            fn check_now(
                &self,
                charges: &[$crate::store::Charge<'_>],
            ) -> Option<Result<$crate::Decision, $crate::store::StoreError>> {
                $crate::store::Store::check_now(&self.remote, charges)
            }

            fn registry(&self) -> Option<&$crate::store::RuleRegistry> {
                $crate::store::Store::registry(&self.remote)
            }

            fn kind(&self) -> &'static str {
                $crate::store::Store::kind(&self.remote)
            }

            fn replicas(&self) -> Option<u32> {
                $crate::store::Store::replicas(&self.remote)
            }

            fn counts_replicas(&self) -> bool {
                $crate::store::Store::counts_replicas(&self.remote)
            }

            fn adjust(
                &self,
                adjustments: &[$crate::store::Adjustment<'_>],
            ) -> $crate::store::StoreFuture<()> {
                $crate::store::Store::adjust(&self.remote, adjustments)
            }

            fn peek(
                &self,
                charges: &[$crate::store::Charge<'_>],
            ) -> $crate::store::StoreFuture<$crate::Decision> {
                $crate::store::Store::peek(&self.remote, charges)
            }

            fn reset(
                &self,
                charges: &[$crate::store::Charge<'_>],
            ) -> $crate::store::StoreFuture<()> {
                $crate::store::Store::reset(&self.remote, charges)
            }
        }
    };
}
pub(crate) use store_by_remote;

/// The error of a check that charges one rule for one key twice: one call checks each charge
/// against the state before the request, so the two would not add up. Layers never do (their
/// rule names are unique); merge the costs.
fn repeated(charges: &[Charge<'_>]) -> Option<StoreError> {
    for (i, a) in charges.iter().enumerate() {
        if let Some(b) = charges[i + 1..]
            .iter()
            .find(|b| b.rule.name() == a.rule.name() && b.key == a.key)
        {
            return Some(StoreError::Protocol(format!(
                "a check charges rule \"{}\" for key {} twice; charge it once with the sum \
                 of the costs",
                b.rule.name(),
                b.key
            )));
        }
    }
    None
}
