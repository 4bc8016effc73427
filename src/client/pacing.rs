//! [`Pacing`]: a client that spreads its calls to fit the budget a server announces
//! (draft-11's `RateLimit` and `RateLimit-Policy` fields), instead of sending until it is denied.
//!
//! ```
//! use tollgate::client::{HonourLimitsLayer, Pacing, Retry, RetryAfterLayer};
//!
//! // Fails a call that comes before its turn with `Throttled`, which says how long to wait.
//! let fail_fast = HonourLimitsLayer::new().pace(Pacing::new());
//! // Waits for its turn instead.
//! let patient = RetryAfterLayer::new(Retry::new().pace(Pacing::new()));
//! # let _ = (fail_fast, patient);
//! ```

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use smallvec::SmallVec;

use super::fields::Numbers;

/// The least rate a budget is paced at: a unit a day, the longest wait a server may announce
/// (a larger window is a server's mistake, or a hostile one's).
const LEAST_RATE: f64 = 1.0 / 86_400.0;

/// The least share of a policy's rate a client keeps after refusals (1/64).
const LEAST_SCALE: f64 = 1.0 / 64.0;

/// How a client layer paces its calls (see the [module](crate::client#pacing)).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pacing {
    max_delay: Duration,
    jitter: f64,
}

impl Default for Pacing {
    fn default() -> Self {
        Self::new()
    }
}

impl Pacing {
    /// Calls delayed up to 30 s for their turn, with a jitter of up to 10 % of the delay.
    pub const fn new() -> Self {
        Pacing {
            max_delay: Duration::from_secs(30),
            jitter: 0.1,
        }
    }

    /// The longest a [`RetryAfterLayer`](super::RetryAfterLayer) call waits for its turn
    /// (default 30 s, and never more than its `Retry::max_wait`): a turn further away fails
    /// the call with [`Throttled`](super::Throttled) at once, as
    /// [`HonourLimitsLayer`](super::HonourLimitsLayer) fails any call before its turn.
    pub const fn max_delay(mut self, delay: Duration) -> Self {
        self.max_delay = delay;
        self
    }

    /// The longest a call waits for its turn.
    pub(crate) fn longest(&self) -> Duration {
        self.max_delay
    }

    /// A random part added to each delay, up to this fraction of it (default 0.1; 0 to 1), so
    /// that clients told the same budget do not come back at the same instant.
    pub fn jitter(mut self, fraction: f64) -> Self {
        self.jitter = if fraction.is_finite() {
            fraction.clamp(0.0, 1.0)
        } else {
            0.0
        };
        self
    }
}

/// One policy's budget as this client sees it: a token bucket shaped by the server's answers.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
    /// The policy's rate, units a second (`q / w`, or `r / t` without a policy field).
    rate: f64,
    /// The share of it this client takes: its own calls' part of what the budget lost between
    /// two answers (others may spend it: clients on one key), halved by a refusal.
    scale: f64,
    /// The most tokens (`q`, or the largest `r` seen).
    cap: f64,
    /// The number of the request whose answer set the tokens.
    learned: u64,
    /// The numbers of the latest calls sent (32 at most).
    sends: SmallVec<[u64; 8]>,
    /// The latest answer: its `r`, when, and its call's number.
    last: Option<(u64, Instant, u64)>,
    /// When the share was last halved.
    halved: Instant,
}

impl Bucket {
    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate * self.scale).min(self.cap);
        self.at = now;
    }

    /// Seconds until a token is here (a token short by rounding only is here).
    fn need(&self) -> f64 {
        if self.tokens >= 1.0 - 1e-9 {
            0.0
        } else {
            (1.0 - self.tokens) / (self.rate * self.scale)
        }
    }
}

/// The buckets of a layer's policies, by the same keys as their waits.
#[derive(Debug)]
pub(crate) struct Paces {
    pub(crate) pacing: Pacing,
    buckets: Mutex<HashMap<u128, Bucket>>,
}

impl Paces {
    pub(crate) fn new(pacing: Pacing) -> Self {
        Paces {
            pacing,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// The delay before a call paying `policies` may be sent (`unit` in `[0, 1)` draws its
    /// jitter; at least a millisecond, at most a day), or `None` when it may go now: then it
    /// takes a unit of each, as call `number`.
    pub(crate) fn delay(&self, policies: &[u128], number: u64, unit: f64) -> Option<Duration> {
        if policies.is_empty() {
            return None;
        }
        let now = Instant::now();
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        let mut need: f64 = 0.0;
        for policy in policies {
            if let Some(bucket) = buckets.get_mut(policy) {
                bucket.refill(now);
                need = need.max(bucket.need());
            }
        }
        if need > 0.0 {
            let delay = Duration::try_from_secs_f64(need * (1.0 + self.pacing.jitter * unit))
                .unwrap_or(super::MAX_ANNOUNCED_WAIT);
            // At least a millisecond: a wait that passes no time would be asked again at once.
            return Some(delay.clamp(Duration::from_millis(1), super::MAX_ANNOUNCED_WAIT));
        }
        for policy in policies {
            if let Some(bucket) = buckets.get_mut(policy) {
                bucket.tokens -= 1.0;
                if bucket.sends.len() >= 32 {
                    bucket.sends.remove(0);
                }
                bucket.sends.push(number);
            }
        }
        None
    }

    /// Learns what the answer to call `sent` says of `policy`: its numbers (`r` and `t` of
    /// `RateLimit`, `q` and `w` of `RateLimit-Policy`), and whether the call was refused.
    pub(crate) fn learn(&self, policy: u128, sent: u64, refused: bool, numbers: Numbers) {
        let rate = match numbers {
            Numbers {
                q: Some(q),
                w: Some(w),
                ..
            } if q > 0 && w > 0 => Some(((q as f64 / w as f64).max(LEAST_RATE), q as f64)),
            Numbers {
                r: Some(r),
                t: Some(t),
                ..
            } if r > 0 && t > 0 => Some(((r as f64 / t as f64).max(LEAST_RATE), r as f64)),
            _ => None,
        };
        let now = Instant::now();
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if !buckets.contains_key(&policy) {
            let Some((rate, cap)) = rate else {
                return;
            };
            if buckets.len() >= super::MAX_TARGETS {
                forget(&mut buckets);
            }
            buckets.insert(
                policy,
                Bucket {
                    tokens: cap,
                    at: now,
                    rate,
                    scale: 1.0,
                    cap,
                    learned: 0,
                    sends: SmallVec::new(),
                    last: None,
                    halved: now.checked_sub(Duration::from_secs(86_400)).unwrap_or(now),
                },
            );
        }
        let Some(bucket) = buckets.get_mut(&policy) else {
            return;
        };
        bucket.refill(now);
        if let Some((rate, cap)) = rate {
            bucket.rate = rate;
            bucket.cap = if numbers.q.is_some() {
                cap
            } else {
                bucket.cap.max(cap)
            };
        }
        if refused
            && sent >= bucket.learned
            && now.saturating_duration_since(bucket.halved).as_secs_f64()
                >= 1.0 / (bucket.rate * bucket.scale)
        {
            // A refusal where this client's pace saw a unit: others spend this budget too.
            // Once per unit's time at most (calls out together are refused together).
            bucket.scale = (bucket.scale / 2.0).max(LEAST_SCALE);
            bucket.halved = now;
        }
        if sent < bucket.learned {
            return;
        }
        let remaining = match (refused, numbers.r) {
            (true, r) => r.unwrap_or(0),
            (false, Some(r)) => r,
            (false, None) => return,
        };
        if let (false, Some((r, at, number))) = (refused, bucket.last) {
            // Between two answers the budget lost what was spent, less what came back: this
            // client's own calls are its share of that (others may spend it too).
            let spent = r as f64 - remaining as f64
                + now.saturating_duration_since(at).as_secs_f64() * bucket.rate;
            let own = bucket
                .sends
                .iter()
                .filter(|n| **n > number && **n <= sent)
                .count() as f64;
            if spent >= 1.0 && own >= 1.0 {
                let observed = (own / spent).clamp(LEAST_SCALE, 1.0);
                bucket.scale = (bucket.scale + observed) / 2.0;
            } else if spent < 1.0 && own >= 1.0 {
                bucket.scale = (bucket.scale * 1.25).min(1.0);
            }
        }
        // The calls sent after this one are not in its `r`.
        let after = bucket.sends.iter().filter(|n| **n > sent).count() as f64;
        bucket.tokens = (remaining as f64 * bucket.scale - after).min(bucket.cap);
        bucket.learned = sent;
        bucket.last = Some((remaining, now, sent));
    }
}

/// Forgets a quarter of the buckets: those shaped longest ago.
fn forget(buckets: &mut HashMap<u128, Bucket>) {
    let mut ages: Vec<(Instant, u128)> = buckets.iter().map(|(k, b)| (b.at, *k)).collect();
    ages.sort_unstable();
    for (_, key) in ages.into_iter().take(buckets.len() / 4 + 1) {
        buckets.remove(&key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numbers(r: u64, t: u64, q: u64, w: u64) -> Numbers {
        Numbers {
            r: Some(r),
            t: Some(t),
            q: Some(q),
            w: Some(w),
        }
    }

    #[test]
    fn a_budget_is_spent_at_once_then_paced_at_the_quota_s_rate() {
        let paces = Paces::new(Pacing::new().jitter(0.0));
        let p = [7u128];
        assert_eq!(paces.delay(&p, 0, 0.5), None, "nothing known: sent");
        paces.learn(7, 0, false, numbers(3, 1, 100, 60));
        for n in 1..=3 {
            assert_eq!(paces.delay(&p, n, 0.5), None, "a unit left");
        }
        let delay = paces.delay(&p, 4, 0.5).expect("paced");
        assert!(
            delay > Duration::from_millis(590) && delay <= Duration::from_millis(600),
            "{delay:?}: a unit every 0.6 s"
        );
        // An answer to a call sent before the three others: they are not in its `r`.
        paces.learn(7, 0, false, numbers(3, 1, 100, 60));
        assert!(paces.delay(&p, 5, 0.5).is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_halves_the_share_and_answers_showing_no_one_else_grow_it_back() {
        let paces = Paces::new(Pacing::new().jitter(0.0));
        // 60 a minute: a unit a second.
        paces.learn(1, 0, false, numbers(0, 1, 60, 60));
        let one = paces.delay(&[1], 1, 0.0).unwrap();
        assert_eq!(one, Duration::from_secs(1));
        tokio::time::advance(one).await;
        assert_eq!(paces.delay(&[1], 1, 0.0), None, "its turn");
        // Refused all the same: someone else took that unit.
        paces.learn(1, 1, true, numbers(0, 1, 60, 60));
        let two = paces.delay(&[1], 2, 0.0).unwrap();
        assert_eq!(
            two,
            Duration::from_secs(2),
            "half the share: a unit every 2 s"
        );
        // Then each call is all the budget loses (the server's budget, a unit a second, only
        // this client spending it): the share comes back toward the whole.
        let (mut server, mut at) = (0.0_f64, Instant::now());
        let mut number = 2;
        for _ in 0..12 {
            while let Some(wait) = paces.delay(&[1], number, 0.0) {
                tokio::time::advance(wait).await;
            }
            server = (server + at.elapsed().as_secs_f64()).min(60.0) - 1.0;
            at = Instant::now();
            let r = server.max(0.0).floor() as u64;
            paces.learn(1, number, false, numbers(r, 1, 60, 60));
            number += 1;
        }
        let back = paces.delay(&[1], number, 0.0).unwrap();
        assert!(
            back < Duration::from_millis(1100),
            "{back:?}: close to a unit a second again"
        );
    }

    #[test]
    fn a_turn_is_told_in_full_and_jitter_adds_up_to_its_fraction() {
        // One a minute: the next unit in 60 s, told as it is (a `RetryAfterLayer` call fails
        // on a turn further away than its longest wait; `HonourLimitsLayer` tells it).
        let paces = Paces::new(Pacing::new().jitter(0.0).max_delay(Duration::from_secs(1)));
        paces.learn(1, 0, false, numbers(0, 60, 1, 60));
        let turn = paces.delay(&[1], 1, 0.0).unwrap();
        assert!(
            turn > Duration::from_secs(59) && turn <= Duration::from_secs(60),
            "{turn:?}"
        );
        let paces = Paces::new(Pacing::new().jitter(0.5));
        paces.learn(1, 0, false, numbers(0, 1, 100, 60));
        let least = paces.delay(&[1], 1, 0.0).unwrap();
        let most = paces.delay(&[1], 1, 0.999).unwrap();
        assert!(most > least.mul_f64(1.49) && most < least.mul_f64(1.51));
    }
}
