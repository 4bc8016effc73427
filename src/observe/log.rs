//! [`DenialLog`]: every denial at `info`, target `tollgate::denied`, at most so many lines a
//! second.

use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

use super::{Decided, RuleNames};
use crate::clock::unix_micros;
use crate::policy::{Applied, Tenant};

/// The rejection log of one layer.
pub(crate) struct DenialLog {
    per_second: u32,
    /// Raw keys and tenant ids in the lines, instead of their keyed digests.
    raw_keys: bool,
    /// The second being counted (high 40 bits) and the lines written in it (low 24 bits), in
    /// one word: one compare-and-swap moves both, so a second never writes more than its lines.
    window: AtomicU64,
    /// Denials not written since the last line that counted them.
    suppressed: AtomicU64,
}

const COUNT_BITS: u32 = 24;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;

/// The secret of the key digests: random, one per process, so that a digest names one client in
/// every layer's lines and cannot be looked up in a table of addresses or emails.
fn secret() -> &'static [u8; 16] {
    static SECRET: OnceLock<[u8; 16]> = OnceLock::new();
    SECRET.get_or_init(|| {
        let random = std::collections::hash_map::RandomState::new();
        let mut secret = [0; 16];
        for (i, chunk) in secret.chunks_mut(8).enumerate() {
            let mut hasher = random.build_hasher();
            hasher.write_usize(i);
            hasher.write_u64(unix_micros());
            chunk.copy_from_slice(&hasher.finish().to_le_bytes());
        }
        secret
    })
}

impl DenialLog {
    pub(crate) fn new(per_second: u32, raw_keys: bool) -> Self {
        DenialLog {
            per_second: per_second.min(COUNT_MASK as u32),
            raw_keys,
            window: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Whether a subscriber listens to the log.
    pub(crate) fn enabled(&self) -> bool {
        tracing::enabled!(target: "tollgate::denied", tracing::Level::INFO)
    }

    /// Takes one of this second's lines; the first of a second also reports what the seconds
    /// before did not write.
    fn take_line(&self) -> bool {
        let second = unix_micros() / 1_000_000;
        let mut current = self.window.load(Ordering::Relaxed);
        loop {
            let (window_second, count) = (current >> COUNT_BITS, current & COUNT_MASK);
            let (next, new_second) = if window_second != second {
                ((second << COUNT_BITS) | 1, true)
            } else if count < u64::from(self.per_second) {
                (current + 1, false)
            } else {
                self.suppressed.fetch_add(1, Ordering::Relaxed);
                #[cfg(feature = "metrics")]
                metrics::counter!("tollgate_denial_log_suppressed_total").increment(1);
                return false;
            };
            match self.window.compare_exchange_weak(
                current,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    if new_second {
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
                    return self.per_second > 0;
                }
                Err(actual) => current = actual,
            }
        }
    }

    /// Logs a denial, unless this second's lines are spent.
    pub(crate) fn denied(
        &self,
        decided: &Decided<'_>,
        route: &str,
        tier: &str,
        tenant: Option<&Tenant>,
    ) {
        if !self.take_line() {
            return;
        }
        let denying = decided.denying();
        let key = decided.keys.and_then(|keys| {
            keys.iter()
                .find(|Applied { rule: i, .. }| denying.contains(i))
                .map(|applied| &applied.key)
        });
        let key = match key {
            Some(key) if self.raw_keys => key.to_string(),
            Some(key) => digest(&key.to_string()),
            None => String::new(),
        };
        // A tenant id may be an API key or an email, as a key may: a digest too, unless asked.
        let tenant = match tenant.map(Tenant::id) {
            Some(id) if self.raw_keys => id.to_owned(),
            Some(id) => digest(id),
            None => String::new(),
        };
        tracing::info!(
            target: "tollgate::denied",
            rules = %RuleNames { snapshot: decided.snapshot, applied: &denying },
            route,
            tier,
            tenant = tenant.as_str(),
            key = %key,
            retry_after_s = decided.retry_after_seconds(),
            verdict = decided.verdict.as_str(),
            "tollgate: request denied"
        );
    }
}

/// A short keyed digest: 16 hex digits.
fn digest(key: &str) -> String {
    let mut hash = Sha256::new();
    hash.update(secret());
    hash.update(key.as_bytes());
    let out = hash.finalize();
    out[..8].iter().map(|b| format!("{b:02x}")).collect()
}
