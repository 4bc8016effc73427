//! [`RedisClusterStore`]: a Redis (or Valkey) Cluster, through redis-rs' multiplexed cluster
//! connection.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use ::redis::cluster::ClusterClient;
use ::redis::cluster_async::ClusterConnection;
use ::redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use ::redis::{Cmd, Value};
use futures_util::future::{join_all, try_join_all};

use super::error::{BuildError, store_error};
use super::script::{self, Mode, Prepared, Reply, Script};
use super::{CheckFuture, Settings, keys, within};
use crate::algorithm::Outcome;
use crate::clock::Clock;
use crate::decision::Decision;
use crate::key::Key;
use crate::policy::ConfigError;
use crate::store::{Charge, Store, StoreError};

/// The Redis Cluster store: all rules of one caller share a hash slot, so one script checks them
/// atomically; rules that count different callers across slots are handled as the
/// [module documentation](super#cluster-rules-of-different-callers) describes.
///
/// ```no_run
/// use tollgate::store::RedisClusterStore;
///
/// # async fn run() -> Result<(), tollgate::store::redis::BuildError> {
/// let store = RedisClusterStore::builder([
///     "redis://10.0.0.1:6379",
///     "redis://10.0.0.2:6379",
///     "redis://10.0.0.3:6379",
/// ])
/// .prefix("shop")
/// .build()
/// .await?;
/// # let _ = store;
/// # Ok(())
/// # }
/// ```
///
/// One connection per node, multiplexed: every concurrent check is pipelined on it. The
/// connection follows `MOVED` / `ASK` redirections and refreshes the slot map by itself. Clones
/// share the connection.
#[derive(Clone)]
pub struct RedisClusterStore {
    inner: Arc<Inner>,
}

struct Inner {
    conn: ClusterConnection,
    settings: Settings,
    script: Script,
}

/// Configures a [`RedisClusterStore`].
#[must_use]
pub struct RedisClusterStoreBuilder {
    nodes: Vec<String>,
    settings: Settings,
}

impl RedisClusterStore {
    /// Configures a store for the cluster that these nodes belong to (one is enough; the others
    /// are found from it; more are tried in turn if the first is down).
    pub fn builder<I, S>(nodes: I) -> RedisClusterStoreBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisClusterStoreBuilder {
            nodes: nodes.into_iter().map(Into::into).collect(),
            settings: Settings::default(),
        }
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.inner.settings.prefix
    }

    /// The Redis key that holds `rule`'s state for `identity`: `prefix:{identity}:rule`.
    pub fn key_name(&self, rule: &str, identity: &Key) -> String {
        keys::key_name(&self.inner.settings.prefix, identity, rule)
    }
}

impl RedisClusterStoreBuilder {
    settings_setters!();

    /// Connects, reads the slot map and loads the script on every primary. Fails when the
    /// configuration is wrong or the cluster cannot be reached.
    pub async fn build(self) -> Result<RedisClusterStore, BuildError> {
        self.settings.validate()?;
        if self.nodes.is_empty() {
            return Err(ConfigError::new(
                "Redis Cluster store: no node URL; give at least one, e.g. redis://10.0.0.1:6379",
            )
            .into());
        }
        // No response timeout inside the cluster client: it would retry a command that timed
        // out, and a script that was only slow would then be charged twice. The store's own
        // budget (`within` below) ends the wait instead, without re-sending anything.
        let client = ClusterClient::builder(self.nodes.iter().map(String::as_str))
            .connection_timeout(self.settings.connect_timeout)
            .build()
            .map_err(|e| {
                ConfigError::new(format!(
                    "a Redis Cluster node URL is not valid ({e}); use redis://host:port"
                ))
            })?;
        let connect = async {
            let mut conn = client.get_async_connection().await.map_err(store_error)?;
            // SCRIPT LOAD goes to every primary.
            self.settings
                .script()
                .load_command()
                .query_async::<Value>(&mut conn)
                .await
                .map_err(store_error)?;
            Ok(conn)
        };
        let conn = within(self.settings.connect_timeout * 2, connect).await?;
        Ok(RedisClusterStore {
            inner: Arc::new(Inner {
                conn,
                script: self.settings.script(),
                settings: self.settings,
            }),
        })
    }
}

impl Inner {
    /// One call of the script on the primary of `slot`; on `NOSCRIPT`, loads it there and calls
    /// again.
    async fn call(
        &self,
        slot: u16,
        mode: Mode,
        now: Option<u64>,
        charges: &[&Prepared],
    ) -> Result<Value, StoreError> {
        let route = || {
            RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(
                slot,
                SlotAddr::Master,
            )))
        };
        let command =
            || -> Cmd { script::command(&self.script, mode, now, charges.iter().copied()) };
        let mut conn = self.conn.clone();
        // A routed command answers a server error as a value: extract it.
        match conn
            .route_command(command(), route())
            .await
            .and_then(Value::extract_error)
        {
            Err(e) if script::is_no_script(&e) => {
                conn.route_command(self.script.load_command(), route())
                    .await
                    .and_then(Value::extract_error)
                    .map_err(store_error)?;
                conn.route_command(command(), route())
                    .await
                    .and_then(Value::extract_error)
                    .map_err(store_error)
            }
            result => result.map_err(store_error),
        }
    }

    async fn reply(
        &self,
        slot: u16,
        mode: Mode,
        now: Option<u64>,
        charges: &[&Prepared],
    ) -> Result<Reply, StoreError> {
        let value = self.call(slot, mode, now, charges).await?;
        script::decode(value, charges.iter().copied())
    }

    async fn check(&self, prepared: &[Prepared], now: Option<u64>) -> Result<Decision, StoreError> {
        let Some(first) = prepared.first() else {
            return Ok(Decision::default());
        };
        let slot = first.slot();
        if prepared.iter().all(|p| p.slot() == slot) {
            let charges: Vec<&Prepared> = prepared.iter().collect();
            let reply = self.reply(slot, Mode::Charge, now, &charges).await?;
            return Ok(script::decision(reply.outcomes));
        }
        self.check_across_slots(prepared, now).await
    }

    /// Charges in several slots: check all, charge all, refund on a lost race.
    async fn check_across_slots(
        &self,
        prepared: &[Prepared],
        now: Option<u64>,
    ) -> Result<Decision, StoreError> {
        let groups = groups(prepared);
        let charges_of = |indices: &[usize]| -> Vec<&Prepared> {
            indices.iter().map(|&i| &prepared[i]).collect()
        };
        let group_charges: Vec<Vec<&Prepared>> =
            groups.iter().map(|(_, idx)| charges_of(idx)).collect();

        // 1. Check every group without charging: a denied request charges nothing.
        let peeks = try_join_all(
            groups
                .iter()
                .zip(&group_charges)
                .map(|((slot, _), charges)| self.reply(*slot, Mode::Peek, now, charges)),
        )
        .await?;
        if !peeks.iter().all(Reply::allowed) {
            return Ok(scatter(prepared.len(), &groups, &peeks));
        }

        // 2. Charge every group, each atomically.
        let charged = join_all(
            groups
                .iter()
                .zip(&group_charges)
                .map(|((slot, _), charges)| self.reply(*slot, Mode::Charge, now, charges)),
        )
        .await;
        if charged.iter().all(|r| r.as_ref().is_ok_and(Reply::allowed)) {
            let replies: Vec<Reply> = charged.into_iter().flatten().collect();
            return Ok(scatter(prepared.len(), &groups, &replies));
        }

        // 3. A group denied (a concurrent request took the last units) or failed: give back what
        // the other groups took.
        let refunds = groups.iter().zip(&group_charges).zip(&charged).filter_map(
            |(((slot, _), charges), reply)| match reply {
                Ok(reply) if reply.allowed() => {
                    Some(self.call(*slot, Mode::Refund(reply.now), now, charges))
                }
                _ => None,
            },
        );
        for result in join_all(refunds).await {
            if let Err(e) = result {
                tracing::warn!(
                    error = %e,
                    "tollgate: could not refund a cross-slot charge; it stays until its key expires"
                );
            }
        }
        let mut replies = Vec::with_capacity(charged.len());
        for reply in charged {
            replies.push(reply?);
        }
        Ok(scatter(prepared.len(), &groups, &replies))
    }
}

/// The charges' indices grouped by slot, in slot order.
fn groups(prepared: &[Prepared]) -> Vec<(u16, Vec<usize>)> {
    let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
    for (i, charge) in prepared.iter().enumerate() {
        let slot = charge.slot();
        match groups.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, indices)) => indices.push(i),
            None => groups.push((slot, vec![i])),
        }
    }
    groups.sort_unstable_by_key(|(slot, _)| *slot);
    groups
}

/// The outcomes of each group's reply, back in the order of the charges.
fn scatter(len: usize, groups: &[(u16, Vec<usize>)], replies: &[Reply]) -> Decision {
    let mut outcomes = vec![Outcome::default(); len];
    for ((_, indices), reply) in groups.iter().zip(replies) {
        for (&i, outcome) in indices.iter().zip(&reply.outcomes) {
            outcomes[i] = *outcome;
        }
    }
    script::decision(outcomes)
}

impl Store for RedisClusterStore {
    type Future = CheckFuture;

    fn check(&self, charges: &[Charge<'_>]) -> CheckFuture {
        let inner = self.inner.clone();
        let prepared: Vec<Prepared> = charges
            .iter()
            .map(|c| Prepared::new(&inner.settings.prefix, c))
            .collect();
        let now = inner.settings.now();
        Box::pin(async move {
            within(inner.settings.response_timeout, inner.check(&prepared, now)).await
        })
    }
}

impl fmt::Debug for RedisClusterStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisClusterStore")
            .field("prefix", &self.inner.settings.prefix)
            .field("response_timeout", &self.inner.settings.response_timeout)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for RedisClusterStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisClusterStoreBuilder")
            .field("nodes", &self.nodes.len())
            .field("prefix", &self.settings.prefix)
            .finish_non_exhaustive()
    }
}
