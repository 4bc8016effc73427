//! [`FallbackShare`]: how much of a rule's quota each replica's local fallback enforces while
//! the shared store is away — its share of the fleet the store counted.
//!
//! ```
//! use tollgate::{FailureMode, FallbackShare, Quota, RateLimitLayer, Rule};
//!
//! // While Redis is away, each replica checks "api" locally at 1 / (replicas last counted)
//! // of 100 a minute; a replica that never counted assumes a fleet of 4.
//! let layer = RateLimitLayer::builder()
//!     .rule(Rule::new("api", Quota::per_minute(100)).on_store_error(FailureMode::Local))
//!     .fallback_share(FallbackShare::per_replica().until_counted(4))
//!     .build()?;
//! # let _ = layer;
//! # Ok::<(), tollgate::ConfigError>(())
//! ```

use crate::algorithm::Limits;
use crate::store::RuleSpec;
use crate::{ConfigError, FailureMode};

/// The replicas a replica's fallback assumes before its store counted any: 8 (with a store
/// that counts replicas: the Redis stores with a heartbeat; a store that never counts
/// assumes 1, unless [`until_counted`](FallbackShare::until_counted) says otherwise).
///
/// A replica that starts while the store is away has counted nobody. Assuming it is alone (1)
/// gave each replica restarted during an outage the whole quota, so K restarted replicas
/// admitted K quotas. Assuming 8 bounds a fleet of up to 8 uncounted replicas to the quota (K
/// of them admit K/8 of it), at the price of under-admitting on a fleet smaller than 8 in that
/// case only (2 replicas restarted in an outage admit a quarter of the quota between them):
/// an outage after a cold start is where a limiter should err on the safe side. Set it to
/// the size your deployment runs at.
pub const DEFAULT_UNTIL_COUNTED: u32 = 8;

/// How much of each rule's quota a replica's local fallback
/// ([`FailureMode::Local`](crate::FailureMode::Local)) enforces while the shared store is away:
/// `1 / replicas`, with `replicas` the number of replicas the store last counted.
///
/// A fleet-wide quota is the shared store's; when a replica cannot reach it, the rules that fall
/// back to the local limiter are checked there instead. With the whole quota on each of K
/// replicas, the fleet would admit K times the quota during the outage. So each replica takes
/// its share: the Redis stores count the replicas of their prefix with a heartbeat (a key of
/// their own, refreshed once a [`heartbeat`][heartbeat] interval, default 1 s, off the request
/// path), and a replica that falls back divides each rule's quota and burst by the count it
/// last read, rounded down, at least 1 unit. 100 a minute over 3 replicas is 33 a minute on
/// each: 99 for the fleet.
///
/// * **Before any count** (a replica that starts while Redis is down, or a store that counts
///   nothing, such as a custom one): the fleet is assumed to be
///   [`until_counted`](Self::until_counted) replicas, [8 by default](DEFAULT_UNTIL_COUNTED):
///   set it to the size your deployment usually runs at.
/// * **Bounds**: the count used is kept within [`replicas_between`](Self::replicas_between)
///   (default 1 to 1,024). Members no replica could have written (lapsing later than a
///   heartbeat can set) are dropped; whoever may write the key can still add members, so keep
///   it to the stores' ACL user.
/// * **The count is of stores of a prefix**: give each service its own prefix, and each
///   process one store per prefix.
/// * **What it does not see**: the count is of replicas that reached Redis in the last three
///   heartbeat intervals before the outage. A replica that stopped is counted for up to three
///   intervals (the others' shares are smaller meanwhile); one started during the outage is
///   not counted by the others, and has counted none itself: it takes `1 / until_counted`
///   (an eighth by default), so set `until_counted` where autoscaling adds replicas when
///   latency rises.
/// * **Small quotas and costly requests**: a share is at least 1 unit, so a quota smaller
///   than the replicas (1 a minute over 10) admits up to one per replica. A request that costs
///   more than a share holds (a fixed cost, a metered chunk) is admitted only when the share
///   is whole, and the rest of its cost is a debt the share's next requests wait for: each
///   replica admits at most one such request per window (per burst refilled), so the fleet
///   stays within `Σ max(share, cost)` per window (10 replicas, 100 a minute, cost 20: 200,
///   not 1,000). Units given back are given back at the share they were charged at (a stream's
///   later chunks are taken at the smaller of its admission's share and today's), so a metered
///   stream's unspent units refill no more than it took.
/// * **The bound**: while the store is away, the fleet admits per key and window at most
///   `Σ_replicas max(share_i, cost)` with `share_i` the quota (and burst) divided by what
///   replica `i` counted (by `until_counted` before it counted), on top of what the shared
///   store admitted before the outage. The fleet simulation checks this bound.
/// * **Even traffic**: the split assumes a client's requests are spread over the replicas (a
///   round-robin load balancer); a client pinned to one replica (sticky sessions, IP hash) gets
///   only that replica's share. Local budgets
///   start full, so at the start of the outage each replica may admit its share of the burst
///   whatever the fleet spent before.
/// * **Answers** keep the rule's policy (`RateLimit-Policy: "api";q=100;w=60`: the fleet's
///   quota, which a client behind a load balancer shares); `r` is what this replica has left of
///   its share.
/// * [`FallbackShare::whole`] gives each replica the whole quota, as if it were alone.
///
/// [heartbeat]: https://docs.rs/tollgate/latest/tollgate/store/struct.RedisStoreBuilder.html#method.heartbeat
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FallbackShare {
    /// The replicas assumed before any count: `None` for the default (8 with a store that
    /// counts, 1 with one that never does).
    until_counted: Option<u32>,
    min: u32,
    max: u32,
}

impl Default for FallbackShare {
    fn default() -> Self {
        Self::per_replica()
    }
}

impl FallbackShare {
    /// `1 / replicas` of each quota, with `replicas` the count the store last read (the
    /// default): 8 assumed before any count, the count kept between 1 and 1,024.
    pub const fn per_replica() -> Self {
        FallbackShare {
            until_counted: None,
            min: 1,
            max: 1024,
        }
    }

    /// The whole quota on every replica, whatever the count: a fleet of K replicas may admit
    /// K times the quota while the store is away.
    pub const fn whole() -> Self {
        FallbackShare {
            until_counted: Some(1),
            min: 1,
            max: 1,
        }
    }

    /// The replicas assumed before the store counted any (default [`DEFAULT_UNTIL_COUNTED`],
    /// 8: an eighth of the quota; 1 is the whole quota).
    pub const fn until_counted(mut self, replicas: u32) -> Self {
        self.until_counted = Some(replicas);
        self
    }

    /// Keeps the count used between `min` and `max` replicas (default 1 to 1,024).
    pub const fn replicas_between(mut self, min: u32, max: u32) -> Self {
        self.min = min;
        self.max = max;
        self
    }

    /// The replicas a quota is divided by, given the store's last count.
    pub(crate) fn replicas(&self, counted: Option<u32>) -> u32 {
        counted
            .or(self.until_counted)
            .unwrap_or(DEFAULT_UNTIL_COUNTED)
            .clamp(self.min, self.max)
    }

    /// Warns, once at build time, of each metered rule that falls back to the local limiter
    /// with a chunk larger than a replica's share at the replicas assumed before a count
    /// ([`until_counted`](Self::until_counted)): while the
    /// store is away, such a stream starts only when the share is whole, and its chunk past
    /// the share is a debt.
    pub(crate) fn warn_of_chunks_past_shares<'a>(
        &self,
        rules: impl IntoIterator<Item = &'a crate::Rule>,
        layer: FailureMode,
    ) {
        for rule in rules {
            let Some(metering) = &rule.meter else {
                continue;
            };
            if rule.on_store_error.unwrap_or(layer) != FailureMode::Local {
                continue;
            }
            let quota = rule.quota();
            let burst = quota.burst_size().unwrap_or(quota.limit());
            let replicas = self.replicas(None);
            let share = (burst / u64::from(replicas)).max(1);
            if metering.chunk > share {
                tracing::warn!(
                    rule = rule.name(),
                    chunk = metering.chunk,
                    share,
                    replicas,
                    "the rule's metered chunk is larger than a replica's share of the local \
                     fallback at the replicas assumed before a count: while the store is away, a stream \
                     starts there only when the share is whole, its chunk past the share a \
                     debt; use a smaller chunk, or FallbackShare::until_counted with the \
                     replicas you run"
                );
            }
        }
    }

    /// The share as a layer over a store uses it: with the default `until_counted`, one
    /// replica for a store that never counts (`counts` false: a custom store, a Redis store
    /// without a heartbeat), [`DEFAULT_UNTIL_COUNTED`] for one that does.
    pub(crate) fn for_store(mut self, counts: bool) -> Self {
        if self.until_counted.is_none() && !counts {
            self.until_counted = Some(1);
        }
        self
    }

    /// Checks the settings.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.min == 0 || self.min > self.max || self.until_counted == Some(0) {
            return Err(ConfigError::new(format!(
                "fallback share: replicas between {} and {}, {} until counted; use \
                 1 <= min <= max and at least 1 until counted",
                self.min,
                self.max,
                self.until_counted.unwrap_or(DEFAULT_UNTIL_COUNTED)
            )));
        }
        Ok(())
    }
}

/// `spec` with its quota and burst divided by `replicas`, rounded down, at least 1 unit; the
/// same name (the same budget, for the store) and period.
pub(crate) fn divided(spec: &RuleSpec, replicas: u32) -> RuleSpec {
    let limits = spec.limits();
    let share = |units: u64| (units / u64::from(replicas)).max(1);
    Limits::new(share(limits.limit), limits.period, share(limits.burst))
        .ok()
        .and_then(|limits| RuleSpec::new(spec.shared_name().clone(), spec.algorithm(), limits).ok())
        // Smaller numbers than a valid rule's are valid; keep the rule as it is otherwise.
        .unwrap_or_else(|| spec.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Algorithm;

    #[test]
    fn the_count_is_assumed_until_read_and_kept_within_bounds() {
        let share = FallbackShare::per_replica();
        assert_eq!(
            share.replicas(None),
            8,
            "a store that counts, before its count"
        );
        assert_eq!(
            share.for_store(false).replicas(None),
            1,
            "a store that never counts"
        );
        assert_eq!(share.for_store(true).replicas(None), 8);
        assert_eq!(share.replicas(Some(3)), 3);
        assert_eq!(share.replicas(Some(5000)), 1024);
        let share = share.until_counted(4).replicas_between(2, 8);
        assert_eq!(share.replicas(None), 4);
        assert_eq!(share.replicas(Some(1)), 2);
        assert_eq!(share.replicas(Some(20)), 8);
        assert_eq!(FallbackShare::whole().replicas(Some(10)), 1);
        assert!(FallbackShare::per_replica().validate().is_ok());
        assert!(share.replicas_between(0, 3).validate().is_err());
        assert!(share.replicas_between(4, 3).validate().is_err());
        assert!(share.until_counted(0).validate().is_err());
    }

    #[test]
    fn a_quota_is_divided_rounded_down_and_keeps_a_unit() {
        let limits = Limits::new(100, 60_000_000, 100).unwrap();
        let spec = RuleSpec::new("api", Algorithm::TokenBucket, limits).unwrap();
        let third = divided(&spec, 3);
        assert_eq!(
            (
                third.limits().limit,
                third.limits().burst,
                third.limits().period
            ),
            (33, 33, 60_000_000)
        );
        assert_eq!(third.id(), spec.id(), "the same budget");
        assert_eq!(divided(&spec, 1), spec);
        let tiny = divided(&spec, 1000);
        assert_eq!((tiny.limits().limit, tiny.limits().burst), (1, 1));
    }
}
