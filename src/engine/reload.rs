//! The reload wiring: the check every snapshot passes before it is installed (the uses made
//! of the layer's rules, the store's registry of rule names), and how a use is taken on.

use std::sync::atomic::Ordering;

use super::state::{Engine, PolicyInForce};
use super::uses::Use;
use crate::ConfigError;
use crate::policy::Registrar;
use crate::policy::snapshot::Snapshot;
use crate::store::Store;

impl<St: Store> Registrar for Engine<St> {
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

impl<St> Engine<St> {
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
            PolicyInForce::Live(live) => live.while_installing(adopt),
            PolicyInForce::Fixed(_) => adopt(),
        }
    }
}
