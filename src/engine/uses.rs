//! The uses of a layer's rules besides the layer: checked per message of a gRPC stream, or
//! by a tonic interceptor. Each refuses the rules it cannot keep.

use std::sync::atomic::AtomicBool;

use crate::ConfigError;
use crate::RuleMode;
use crate::policy::snapshot::Snapshot;

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
    pub(super) const ALL: [Use; 2] = [Use::PerMessage, Use::Interceptor];

    /// Why `snapshot` cannot serve this use, if it cannot.
    pub(crate) fn refuses(self, snapshot: &Snapshot) -> Option<ConfigError> {
        match self {
            Use::PerMessage => (snapshot.holds || snapshot.settles || snapshot.meters).then(|| {
                ConfigError::new(
                    "concurrency limits, charges by outcome, settled costs and metered rules act \
                     after a response, which a message has not: they cannot be checked per \
                     message; use them on a layer of their own",
                )
            }),
            Use::Interceptor => {
                let delays = snapshot
                    .rules
                    .iter()
                    .any(|rule| matches!(rule.mode, RuleMode::Delay { .. }));
                (snapshot.holds || snapshot.settles || snapshot.meters || delays).then(|| {
                    ConfigError::new(
                        "a tonic interceptor neither sees the response nor waits: concurrency \
                         limits, charges by outcome, settled costs, metered rules and delay \
                         rules need the layer on the service \
                         (layer.layer(MyServiceServer::new(service)))",
                    )
                })
            }
        }
    }

    pub(super) fn flag(self, uses: &Uses) -> &AtomicBool {
        match self {
            Use::PerMessage => &uses.per_message,
            Use::Interceptor => &uses.interceptor,
        }
    }
}
