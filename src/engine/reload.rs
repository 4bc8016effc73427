//! The reload wiring: the uses of a layer's rules besides the layer (per message, an
//! interceptor) that refuse rules they cannot keep, and the check every reload passes before
//! its snapshot is installed.

use std::sync::atomic::{AtomicBool, Ordering};

use super::state::{Engine, PolicyInForce};
use crate::ConfigError;
use crate::RuleMode;
use crate::policy::Registrar;
use crate::policy::snapshot::Snapshot;
use crate::store::Store;

/// Which of the [`Use`]s a layer's rules serve.
#[derive(Default)]
pub(crate) struct Uses {
    per_message: AtomicBool,
    interceptor: AtomicBool,
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

    fn flag(self, uses: &Uses) -> &AtomicBool {
        match self {
            Use::PerMessage => &uses.per_message,
            Use::Interceptor => &uses.interceptor,
        }
    }
}

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
