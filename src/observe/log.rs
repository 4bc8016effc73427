//! [`DenialLog`]: every denial at `info`, target `tollgate::denied`, at most so many lines a
//! second.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use sha2::{Digest, Sha256};

use super::{Decided, RuleNames};
use crate::policy::Tenant;
use crate::warn::unix_micros;

/// The rejection log of one layer.
pub(crate) struct DenialLog {
    per_second: u32,
    raw_keys: bool,
    /// The secret of the key digests: random per process, so a digest names a client within
    /// one process's logs and cannot be looked up in a table of addresses.
    secret: [u8; 16],
    /// The second being counted, lines logged in it, and denials not logged since the last
    /// summary.
    second: AtomicU64,
    logged: AtomicU32,
    suppressed: AtomicU64,
}

impl DenialLog {
    pub(crate) fn new(per_second: u32, raw_keys: bool) -> Self {
        let random = std::collections::hash_map::RandomState::new();
        let mut secret = [0; 16];
        for (i, chunk) in secret.chunks_mut(8).enumerate() {
            let mut hasher = random.build_hasher();
            hasher.write_usize(i);
            chunk.copy_from_slice(&hasher.finish().to_le_bytes());
        }
        DenialLog {
            per_second,
            raw_keys,
            secret,
            second: AtomicU64::new(0),
            logged: AtomicU32::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Whether a subscriber listens to the log.
    pub(crate) fn enabled(&self) -> bool {
        tracing::enabled!(target: "tollgate::denied", tracing::Level::INFO)
    }

    /// Logs a denial, unless this second's lines are spent.
    pub(crate) fn denied(
        &self,
        decided: &Decided<'_>,
        route: Option<&str>,
        tier: &str,
        tenant: Option<&Tenant>,
    ) {
        let second = unix_micros() / 1_000_000;
        let current = self.second.load(Ordering::Relaxed);
        if second != current
            && self
                .second
                .compare_exchange(current, second, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.logged.store(0, Ordering::Relaxed);
            let suppressed = self.suppressed.swap(0, Ordering::Relaxed);
            if suppressed > 0 {
                tracing::info!(
                    target: "tollgate::denied",
                    suppressed,
                    "tollgate: {suppressed} denials were not logged (at most {} lines a second)",
                    self.per_second
                );
            }
        }
        if self.logged.fetch_add(1, Ordering::Relaxed) >= self.per_second {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            #[cfg(feature = "metrics")]
            metrics::counter!("tollgate_denial_log_suppressed_total").increment(1);
            return;
        }
        let denying: smallvec::SmallVec<[u16; 2]> = match decided.decision {
            Some(decision) => decided
                .applied
                .iter()
                .zip(decision.outcomes())
                .filter(|(_, o)| !o.allowed)
                .map(|(&i, _)| i)
                .collect(),
            None => decided.applied.iter().copied().collect(),
        };
        let key = decided.keys.and_then(|keys| {
            keys.iter()
                .find(|(i, _, _)| denying.contains(i))
                .map(|(_, key, _)| key)
        });
        let key = match key {
            Some(key) if self.raw_keys => key.to_string(),
            Some(key) => self.digest(&key.to_string()),
            None => String::new(),
        };
        tracing::info!(
            target: "tollgate::denied",
            rules = %RuleNames { snapshot: decided.snapshot, applied: &denying },
            route = route.unwrap_or(""),
            tier,
            tenant = tenant.map(Tenant::id).unwrap_or(""),
            key = %key,
            retry_after_s = decided.decision.and_then(crate::Decision::retry_after_seconds),
            "tollgate: request denied"
        );
    }

    /// A short keyed digest: 16 hex digits.
    fn digest(&self, key: &str) -> String {
        let mut hash = Sha256::new();
        hash.update(self.secret);
        hash.update(key.as_bytes());
        let out = hash.finalize();
        out[..8].iter().map(|b| format!("{b:02x}")).collect()
    }
}
