//! Replica heartbeats: how many replicas share a store's prefix, counted off the request path,
//! so that a local fallback knows its share of a fleet-wide quota while Redis is away.
//!
//! Every store keeps its replica in the sorted set `<prefix>:replicas`, a member per replica
//! whose score is when it lapses on the server's clock. Once a
//! [`heartbeat`](crate::store::RedisStoreBuilder::heartbeat) interval (default 1 s) a task of
//! the store reads the server's `TIME`, then in one pipeline drops the lapsed members (and any
//! whose time is further than a replica could have set), renews its own for three intervals,
//! and reads how many are left: the replicas alive in the last three intervals, itself
//! included. Each member lapses by its own score, so replicas of different intervals count
//! each other; the key itself expires three of the longest interval (three minutes) after the
//! last beat of any replica. The count last read is kept while Redis cannot be asked. The ACL user needs
//! `+time +zadd +zremrangebyscore +zcard +pexpire` on the key.
//!
//! It counts the **stores of a prefix**: give each service its own prefix (two services on the
//! default one count each other's replicas), and each process one store per prefix, its clones
//! shared by its layers (two stores of one prefix in a process count as two replicas).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tollgate::ConfigError> {
//! use std::time::Duration;
//! use tollgate::store::{RedisStore, Store};
//!
//! let store = RedisStore::builder("redis://127.0.0.1:1")
//!     .heartbeat(Duration::from_millis(500))
//!     .build()?;
//! // Nothing counted yet: the store has not reached Redis.
//! assert_eq!(store.replicas(), None);
//! # Ok(())
//! # }
//! ```

use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use super::connection::Connection;
use super::error::store_error;
use crate::store::StoreError;

/// The heartbeat interval of a store that says nothing.
pub(crate) const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(1);

/// A member lapses after this many intervals without a beat.
const LAPSE_AFTER: u32 = 3;

/// The longest a member can live: three of the longest interval (a minute).
const LONGEST_LAPSE_MS: u64 = 3 * 60_000;

/// This replica among those of its prefix: its member, its interval, and the count last read.
pub(crate) struct Fleet {
    /// `<prefix>:replicas`.
    pub(crate) key: String,
    /// This store's member: random, so that two stores of one process count as two.
    member: String,
    /// Zero: no heartbeat.
    every: Duration,
    /// The replicas last counted (0: never).
    counted: AtomicU32,
    /// Whether the heartbeat task was started.
    started: AtomicBool,
}

impl Fleet {
    /// The fleet of `prefix`, beating every `every` (zero: never).
    pub(crate) fn new(prefix: &str, every: Duration) -> Self {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        hasher.write_u64(crate::clock::unix_micros());
        Fleet {
            key: format!("{prefix}:replicas"),
            member: format!("{:016x}", hasher.finish()),
            every,
            counted: AtomicU32::new(0),
            started: AtomicBool::new(false),
        }
    }

    /// Tells whether this replica counts the fleet (it has a heartbeat).
    pub(crate) fn counts(&self) -> bool {
        !self.every.is_zero()
    }

    /// The replicas last counted, this one included; `None` before the first count.
    pub(crate) fn replicas(&self) -> Option<u32> {
        match self.counted.load(Ordering::Acquire) {
            0 => None,
            n => Some(n),
        }
    }

    /// Records the replicas a beat counted.
    pub(crate) fn counted(&self, replicas: u32) {
        self.counted.store(replicas.max(1), Ordering::Release);
    }

    /// The heartbeat interval (zero: none), unless the heartbeat was started already: the
    /// caller starts it.
    pub(crate) fn to_start(&self) -> Option<Duration> {
        (!self.every.is_zero() && !self.started.swap(true, Ordering::AcqRel)).then_some(self.every)
    }

    /// Lets the heartbeat be started again (there was no runtime to start it on).
    pub(crate) fn not_started(&self) {
        self.started.store(false, Ordering::Release);
    }

    /// How long a member lives without a beat, in milliseconds.
    fn lapse_ms(&self) -> u64 {
        u64::try_from((self.every * LAPSE_AFTER).as_millis()).unwrap_or(u64::MAX)
    }
}

/// Beats once on the connection `connection` brings (to `server`), within `budget`: the
/// replicas counted.
pub(crate) async fn beat_within(
    connection: impl Future<Output = Result<Connection, StoreError>>,
    server: &Arc<str>,
    fleet: &Fleet,
    budget: Duration,
) -> Result<u64, StoreError> {
    let beat = async {
        let mut conn = connection.await?;
        let (seconds, micros): (u64, u64) = redis::cmd("TIME")
            .query_async(&mut conn)
            .await
            .map_err(|e| store_error(server, e))?;
        let now = seconds.saturating_mul(1000).saturating_add(micros / 1000);
        let lapse = fleet.lapse_ms();
        let (count,): (u64,) = redis::pipe()
            .cmd("ZREMRANGEBYSCORE")
            .arg(&fleet.key)
            .arg("-inf")
            .arg(now)
            .ignore()
            // A member no replica could have written (it would lapse after the longest
            // interval's three): not counted, whoever wrote it.
            .cmd("ZREMRANGEBYSCORE")
            .arg(&fleet.key)
            .arg(format!("({}", now.saturating_add(LONGEST_LAPSE_MS)))
            .arg("+inf")
            .ignore()
            .cmd("ZADD")
            .arg(&fleet.key)
            .arg(now.saturating_add(lapse))
            .arg(&fleet.member)
            .ignore()
            // The key outlives every member, whatever its replica's interval: one that beats
            // often must not erase, by expiring the key, the members of those that beat seldom.
            .cmd("PEXPIRE")
            .arg(&fleet.key)
            .arg(LONGEST_LAPSE_MS)
            .ignore()
            .cmd("ZCARD")
            .arg(&fleet.key)
            .query_async(&mut conn)
            .await
            .map_err(|e| store_error(server, e))?;
        Ok(count)
    };
    tokio::time::timeout(budget, beat)
        .await
        .unwrap_or(Err(StoreError::Timeout))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_stores_of_one_prefix_are_two_members_of_one_key() {
        let (a, b) = (
            Fleet::new("shop", DEFAULT_HEARTBEAT),
            Fleet::new("shop", DEFAULT_HEARTBEAT),
        );
        assert_eq!(a.key, "shop:replicas");
        assert_eq!(a.key, b.key);
        assert_ne!(a.member, b.member);
        assert_eq!(a.lapse_ms(), 3000);
        assert_eq!(a.replicas(), None);
    }
}
