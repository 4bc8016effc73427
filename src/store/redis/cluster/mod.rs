//! [`RedisClusterStore`]: a Redis (or Valkey) Cluster, one pipelined connection and one circuit
//! breaker per node, routed by tollgate's own slot map.

mod cross_slot;
mod deadline;
mod groups;
mod node;
mod routing;
mod slot_map;
mod topology;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::time::Instant;

use futures_util::future::try_join_all;
use redis::{ConnectionAddr, ConnectionInfo};
use tokio::sync::Notify;

use self::deadline::Deadline;
use self::groups::{groups, scatter};
use self::node::Node;
use self::topology::Topology;
use crate::ConfigError;
use crate::store::redis::access::redact;
use crate::store::redis::access::{self, Access};
use crate::store::redis::connection::Target;
use crate::store::redis::error::{ConnectError, store_error};
use crate::store::redis::keys;
use crate::store::redis::late_reply::{self, Waiting};
use crate::store::redis::remote::{self, Parts, Remote, Sent, Transport, store_by_remote};
use crate::store::redis::script::{Mode, Prepared, Reply};
use crate::store::redis::settings::{Settings, late_reply_wait, settings_setters};
use crate::store::redis::{fleet, forget};
use crate::store::{Charge, StoreError};

/// The Redis Cluster store: all rules of one caller share a hash slot, so one script checks them
/// atomically; rules that count different callers across slots are handled as
/// [`store`](crate::store#cluster-rules-of-different-callers) describes.
///
/// ```no_run
/// use tollgate::store::RedisClusterStore;
///
/// # fn run() -> Result<(), tollgate::ConfigError> {
/// let store = RedisClusterStore::builder([
///     "redis://10.0.0.1:6379",
///     "redis://10.0.0.2:6379",
///     "redis://10.0.0.3:6379",
/// ])
/// .prefix("shop")
/// .build()?;
/// # let _ = store;
/// # Ok(())
/// # }
/// ```
///
/// The store reads the slot map (`CLUSTER SLOTS`) itself and keeps one pipelined connection per
/// primary, opened when first needed. Each check goes to the primary of its slot, and is sent at
/// most once: a `MOVED` or `ASK` answer (the script did not run) is followed, at most 5 times per
/// check; a connection that fails or a check that runs out of time is never sent again, since
/// the script may have run. Each node has its own [`CircuitBreaker`](crate::CircuitBreaker):
/// while one primary is down or failing over, checks for its slots are decided at once by each
/// rule's [`FailureMode`](crate::FailureMode), and every other slot answers as usual. The slot
/// map is read again in the background after a redirection or a failure (at most every 100 ms),
/// so a replica promoted by a failover is found without waiting for a request to time out.
///
/// Like [`RedisStore`](super::RedisStore), it starts without waiting for the cluster (see
/// [`connect`](RedisClusterStoreBuilder::connect) to wait). Clones share the connections.
#[derive(Clone)]
pub struct RedisClusterStore {
    remote: Remote<Cluster>,
}

/// A cluster: the [`Transport`] of a [`RedisClusterStore`].
pub(crate) struct Cluster {
    /// The `host:port` of each node given to the builder.
    seeds: Vec<String>,
    /// The node URLs as given, without passwords, to show.
    servers: Arc<str>,
    /// The credentials of the first URL (or those given to the builder), and whether and how
    /// to speak TLS, for every node.
    template: ConnectionInfo,
    /// Where the first node's connections go, and how (a node's go to its own address).
    targets: Target,
    topology: RwLock<Option<Arc<Topology>>>,
    /// Every node seen, by address: connections and breakers outlive a new slot map.
    nodes: Mutex<HashMap<String, Arc<Node>>>,
    /// Asks the background task to read the slot map again.
    refresh: Arc<Notify>,
    /// Settings, the replica's denials and leases, rules, startup.
    parts: Parts,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Wakes the background reader, which then finds the store gone and ends.
        self.refresh.notify_one();
    }
}

/// Configures a [`RedisClusterStore`].
#[must_use]
pub struct RedisClusterStoreBuilder {
    nodes: Vec<String>,
    settings: Settings,
    access: Access,
}

impl RedisClusterStore {
    /// Configures a store for the cluster that these nodes belong to (one is enough; the others
    /// are found from it; more are tried in turn if the first is down). `redis://` URLs, or
    /// `rediss://` for TLS to every node (feature `tls`; see
    /// [TLS and ACL users](super::RedisStore#tls-and-acl-users)); the credentials of the first
    /// are used for every node.
    pub fn builder<I, S>(nodes: I) -> RedisClusterStoreBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisClusterStoreBuilder {
            nodes: nodes.into_iter().map(Into::into).collect(),
            settings: Settings::default(),
            access: Access::default(),
        }
    }

    /// Whether the store has read the cluster's slot map since it was built. It stays true
    /// during an outage: a health check wants [`is_reachable`](Self::is_reachable).
    pub fn is_connected(&self) -> bool {
        self.remote.transport().parts.startup.is_connected()
    }

    /// Whether the store can decide with the cluster now: it has read the slot map, no
    /// primary's circuit breaker is open, and no call to a primary failed in the last cooldown
    /// (at least a second). For a
    /// readiness check (`/healthz`); while it is false, the rules whose primary is away are
    /// decided by their [`FailureMode`](crate::FailureMode).
    pub fn is_reachable(&self) -> bool {
        self.remote.transport().parts.startup.is_connected()
            && self.remote.transport().topology().is_some_and(|topology| {
                topology
                    .primaries()
                    .iter()
                    .all(|node| !node.breaker().is_failing())
            })
    }
}

impl RedisClusterStoreBuilder {
    settings_setters!();

    /// Builds the store without waiting for the cluster: it reads the slot map in the
    /// background, and until it has, checks fail at once (each rule's
    /// [`FailureMode`](crate::FailureMode) decides). Fails only when the configuration is wrong.
    pub fn build(self) -> Result<RedisClusterStore, ConfigError> {
        self.settings.validate()?;
        if self.nodes.is_empty() {
            return Err(ConfigError::new(
                "Redis Cluster store: no node URL; give at least one, e.g. redis://10.0.0.1:6379",
            ));
        }
        let mut seeds = Vec::new();
        let first = &self.nodes[0];
        let template = self.access.connection_info("Redis Cluster store", first)?;
        let targets = self.access.target(&template)?;
        #[cfg(test)]
        let targets = targets.through(self.settings.network());
        for url in &self.nodes {
            if access::is_tls(url) != access::is_tls(first) {
                return Err(ConfigError::new(format!(
                    "Redis Cluster store: the node URLs {} and {} mix redis:// and rediss://; \
                     every node is reached the same way, so give them all the same scheme",
                    redact(first),
                    redact(url)
                )));
            }
            let info = if url == first {
                template.clone()
            } else {
                self.access.connection_info("Redis Cluster store", url)?
            };
            let (ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. }) =
                info.addr()
            else {
                return Err(ConfigError::new(format!(
                    "Redis Cluster store: the node URL {} is not a TCP address; use \
                     redis://host:port or rediss://host:port",
                    redact(url)
                )));
            };
            seeds.push(format!("{host}:{port}"));
        }
        let servers = self
            .nodes
            .iter()
            .map(|url| self.access.shown(url))
            .collect::<Vec<_>>()
            .join(", ");
        let transport = Arc::new(Cluster {
            seeds,
            servers: format!("Redis Cluster ({servers})").into(),
            template,
            targets,
            parts: Parts::new(self.settings),
            topology: RwLock::new(None),
            nodes: Mutex::new(HashMap::new()),
            refresh: Arc::new(Notify::new()),
        });
        let remote = Remote::started(transport);
        Ok(RedisClusterStore { remote })
    }

    /// Builds the store and waits until it has read the slot map and loaded its script on every
    /// primary, at most twice the connect timeout, then counts the fleet once (with a heartbeat,
    /// so that the local fallback has a count from the start): for services that must not
    /// start without the cluster. The error names the nodes (without passwords).
    pub async fn connect(self) -> Result<RedisClusterStore, ConnectError> {
        let store = self.build()?;
        let inner = store.remote.transport();
        let budget = inner.parts.settings.connect_timeout * 2;
        let started = Instant::now();
        inner.parts.connected_within(budget, &inner.servers).await?;
        let topology = inner.topology().ok_or(StoreError::Timeout)?;
        let loads = topology.primaries().iter().map(|node| async move {
            let mut conn = node.connection().await?;
            let form = inner
                .parts
                .program
                .load(&mut conn)
                .await
                .map_err(|e| store_error(node.server(), e))?;
            node.form().set(form);
            Ok::<_, StoreError>(())
        });
        let left = budget.saturating_sub(started.elapsed());
        tokio::time::timeout(left, try_join_all(loads))
            .await
            .map_err(|_| StoreError::Timeout)??;
        remote::count_now(inner).await;
        Ok(store)
    }
}

store_by_remote!(RedisClusterStore);

impl Transport for Cluster {
    /// Starts the background reader of the slot map, if there is a runtime to run it (again,
    /// if the runtime that ran it went away).
    fn start(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let refresh = self.refresh.clone();
        self.parts
            .startup
            .spawn(|running| Cluster::read_slot_map_in_background(weak, refresh, running));
    }

    fn unsendable(&self) -> Option<StoreError> {
        (!self.parts.startup.is_connected())
            .then(|| self.parts.startup.not_connected(&self.servers))
    }

    /// Why a check cannot be sent now, if it cannot: the store has not read the slot map yet,
    /// or the breaker of the node that holds every key of the check is open.
    fn refusal(self: &Arc<Self>, charges: &[Charge<'_>]) -> Option<StoreError> {
        let first = charges.first()?;
        self.start();
        if !self.parts.startup.is_connected() {
            return Some(self.parts.startup.not_connected(&self.servers));
        }
        // A split key's sub-key (and so its node) is chosen when the check is planned.
        if charges.iter().any(|c| c.rule.parts() > 1) {
            return None;
        }
        let topology = self.topology()?;
        // The common case, every breaker closed, costs a load per primary.
        if !topology.primaries().iter().any(|n| n.breaker().is_open()) {
            return None;
        }
        let slot_of = |c: &Charge<'_>| {
            let mut key = String::with_capacity(64);
            keys::write_key(&mut key, &self.parts.settings.prefix, c.key, c.rule.name());
            keys::slot(key.as_bytes())
        };
        let node = topology.primary(slot_of(first))?;
        let one_node = charges[1..].iter().all(|c| {
            topology
                .primary(slot_of(c))
                .is_some_and(|n| Arc::ptr_eq(n, node))
        });
        (one_node && node.breaker().is_open()).then(|| {
            self.refresh_soon();
            StoreError::CircuitOpen
        })
    }

    /// A check that takes concurrency slots runs to its end on its own: one whose request
    /// goes away meanwhile gives them back, instead of holding them for the longest hold.
    /// So does one across slots: a request that goes away after some slots were charged
    /// still gives them back when another slot denied.
    fn runs_alone(&self, prepared: &[Prepared]) -> bool {
        prepared.iter().any(|p| p.algorithm.is_concurrency())
            || prepared
                .first()
                .is_some_and(|first| prepared.iter().any(|p| p.slot() != first.slot()))
    }

    fn send(self: &Arc<Self>, waiting: Waiting, now: Option<u64>, alone: bool) -> Sent {
        let me = self.clone();
        let runtime = match tokio::runtime::Handle::try_current() {
            Ok(runtime) if alone => runtime,
            _ => {
                return Sent::Deciding(Box::pin(async move {
                    let deadline = Instant::now() + me.parts.settings.response_timeout;
                    me.check_slots(waiting.charges(), now, deadline.into())
                        .await
                }));
            }
        };
        let deadline = Instant::now() + self.parts.settings.response_timeout;
        // The request waits until its deadline; a call that takes slots, a while longer for
        // its reply.
        let late = if waiting.holds_slots() {
            Instant::now() + late_reply_wait(self.parts.settings.response_timeout)
        } else {
            deadline
        };
        let mut answer = waiting.answer();
        drop(runtime.spawn(async move {
            let budget = Deadline {
                budget: deadline,
                late,
            };
            let reply = me.check_slots(answer.charges(), now, budget).await;
            answer.send(reply, || Some(remote::give_back_orphan(me.clone(), now)));
        }));
        Sent::Deciding(Box::pin(late_reply::wait(waiting, deadline, || {
            StoreError::Unavailable("the check's task ended without an answer".into())
        })))
    }

    async fn peek(
        self: Arc<Self>,
        prepared: Vec<Prepared>,
        now: Option<u64>,
    ) -> Result<Reply, StoreError> {
        let deadline = Instant::now() + self.parts.settings.response_timeout;
        let groups = groups(&prepared);
        let mut replies = Vec::with_capacity(groups.len());
        for (slot, indices) in &groups {
            let charges: Vec<&Prepared> = indices.iter().map(|&i| &prepared[i]).collect();
            replies.push(
                self.reply(*slot, Mode::Peek, now, &charges, deadline.into())
                    .await?,
            );
        }
        Ok(scatter(prepared.len(), &groups, &replies))
    }

    /// One call per slot of `charges`, each standing alone.
    async fn call(
        self: Arc<Self>,
        mode: Mode,
        now: Option<u64>,
        charges: Vec<Prepared>,
    ) -> Result<(), StoreError> {
        self.each_slot(mode, now, &charges).await
    }

    async fn publish(self: Arc<Self>, names: Vec<String>) -> Result<(), StoreError> {
        // Any node: classic pub/sub reaches every node of the cluster.
        let Some(first) = names.first() else {
            return Ok(());
        };
        let node = self
            .topology()
            .and_then(|topology| topology.primary(keys::slot(first.as_bytes())).cloned())
            .ok_or_else(|| self.parts.startup.not_connected(&self.servers))?;
        if node.breaker().is_open() {
            return Err(StoreError::CircuitOpen);
        }
        let budget = self.parts.settings.response_timeout;
        let channel = &self.parts.channel;
        forget::publish_within(node.connection(), node.server(), channel, &names, budget).await
    }

    async fn beat(self: Arc<Self>) -> Result<u64, StoreError> {
        let fleet = &self.parts.fleet;
        let node = self
            .topology()
            .and_then(|topology| topology.primary(keys::slot(fleet.key.as_bytes())).cloned())
            .ok_or_else(|| self.parts.startup.not_connected(&self.servers))?;
        if node.breaker().is_open() {
            return Err(StoreError::CircuitOpen);
        }
        let budget = self.parts.settings.response_timeout;
        let beat = fleet::beat_within(node.connection(), node.server(), fleet, budget).await;
        if beat.is_err() {
            // The key's slot may have moved: the next beat asks a fresh slot map.
            self.refresh_soon();
        }
        beat
    }

    fn parts(&self) -> &Parts {
        &self.parts
    }

    const KIND: &'static str = "redis_cluster";
}

impl fmt::Debug for RedisClusterStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cluster = self.remote.transport();
        let servers = ("servers", &*cluster.servers);
        cluster
            .parts
            .fmt_store(f, "RedisClusterStore", servers, &[])
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
