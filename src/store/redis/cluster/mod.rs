//! [`RedisClusterStore`]: a Redis (or Valkey) Cluster, one multiplexed connection and one circuit
//! breaker per node, routed by tollgate's own slot map.

mod node;
mod topology;

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use futures_util::future::{join_all, try_join_all};
use redis::{ConnectionAddr, ConnectionInfo, ErrorKind, RedisError, ServerErrorKind, Value};
use smallvec::SmallVec;
use tokio::sync::Notify;

use self::node::Node;
use self::topology::Topology;
use crate::ConfigError;
use crate::algorithm::Outcome;
use crate::store::redis::access::{self, Access};
use crate::store::redis::error::{ConnectError, breaks_connection, is_server_answer, store_error};
use crate::store::redis::forget;
use crate::store::redis::keys;
use crate::store::redis::remote::{self, Parts, Remote, Transport, store_by_remote};
use crate::store::redis::script::{self, Mode, Prepared, Reply, Request};
use crate::store::redis::startup::{FIRST_RETRY_DELAY, MAX_RETRY_DELAY, Running};
use crate::store::redis::{Settings, late_reply_wait, redact};
use crate::store::{Charge, StoreError};

/// The most redirections (`MOVED`, `ASK`, `TRYAGAIN`) one call follows.
const MAX_REDIRECTIONS: usize = 5;

/// The shortest time between two reads of the slot map.
const REFRESH_INTERVAL: Duration = Duration::from_millis(100);

/// The longest time between two reads of the slot map that checks ask for: reads that find the
/// same map space out up to this (a failover takes a second or two to show in the map).
const MAX_REFRESH_INTERVAL: Duration = Duration::from_millis(500);

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
/// The store reads the slot map (`CLUSTER SLOTS`) itself and keeps one multiplexed connection per
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
            parts: Parts::new(self.settings),
            topology: RwLock::new(None),
            nodes: Mutex::new(HashMap::new()),
            refresh: Arc::new(Notify::new()),
        });
        let remote = Remote::started(transport);
        Ok(RedisClusterStore { remote })
    }

    /// Builds the store and waits until it has read the slot map and loaded its script on every
    /// primary, at most twice the connect timeout: for services that must not start without the
    /// cluster. The error names the nodes (without passwords).
    pub async fn connect(self) -> Result<RedisClusterStore, ConnectError> {
        let store = self.build()?;
        let inner = store.remote.transport();
        let budget = inner.parts.settings.connect_timeout * 2;
        let started = Instant::now();
        inner.parts.connected_within(budget, &inner.servers).await?;
        let topology = inner.topology().ok_or(StoreError::Timeout)?;
        let loads = topology.primaries().iter().map(|node| async move {
            let (mut conn, _) = node.connection().await?;
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
        Ok(store)
    }
}

impl Cluster {
    fn topology(&self) -> Option<Arc<Topology>> {
        self.topology
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The node at `addr`, made when first seen.
    fn node(&self, addr: &str) -> Result<Arc<Node>, StoreError> {
        let mut nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(node) = nodes.get(addr) {
            return Ok(node.clone());
        }
        let node = Arc::new(Node::new(
            addr,
            &self.template,
            self.parts.settings.connect_timeout,
            self.parts.settings.response_timeout,
            self.parts.settings.breaker,
        )?);
        nodes.insert(addr.to_owned(), node.clone());
        Ok(node)
    }

    /// Reads the slot map from the first node that answers: the known primaries whose breaker
    /// is closed, then the nodes given to the builder. True when the map changed.
    async fn read_slot_map(&self) -> Result<bool, StoreError> {
        let mut candidates: Vec<String> = Vec::new();
        if let Some(topology) = self.topology() {
            let mut known: Vec<&Arc<Node>> = topology.primaries().iter().collect();
            known.sort_by_key(|node| node.breaker().is_open());
            candidates.extend(known.into_iter().map(|node| node.addr().to_owned()));
        }
        for seed in &self.seeds {
            if !candidates.contains(seed) {
                candidates.push(seed.clone());
            }
        }
        let mut last_error = None;
        for addr in candidates {
            let node = match self.node(&addr) {
                Ok(node) => node,
                Err(error) => {
                    last_error = Some(error);
                    continue;
                }
            };
            let ask = async {
                let (mut conn, _) = node.connection().await?;
                redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query_async::<Value>(&mut conn)
                    .await
                    .map_err(|e| store_error(node.server(), e))
            };
            let reply = tokio::time::timeout(self.parts.settings.connect_timeout, ask)
                .await
                .unwrap_or(Err(StoreError::Timeout));
            let host = addr
                .rsplit_once(':')
                .map_or(addr.as_str(), |(host, _)| host);
            let topology = reply.and_then(|reply| {
                Topology::from_cluster_slots(reply, host, |addr| self.node(addr))
            });
            match topology {
                Ok(topology) => {
                    let mut current = self.topology.write().unwrap_or_else(|p| p.into_inner());
                    let changed = !current.as_ref().is_some_and(|old| old.same_as(&topology));
                    *current = Some(Arc::new(topology));
                    return Ok(changed);
                }
                Err(error) => last_error = Some(error),
            }
        }
        Err(last_error.unwrap_or_else(|| StoreError::Unavailable("no node to ask".into())))
    }

    /// Asks the background task to read the slot map again (at most every 100 ms).
    fn refresh_soon(&self) {
        self.refresh.notify_one();
    }

    /// One call of the script on the primary of `slot`, sent at most once: only answers that
    /// say the script did not run (`MOVED`, `ASK`, `TRYAGAIN`, `NOSCRIPT`) are followed by
    /// another send. `deadline` bounds the whole call.
    async fn call(
        &self,
        slot: u16,
        mode: Mode,
        now: Option<u64>,
        charges: &[&Prepared],
        deadline: Deadline,
    ) -> Result<Value, StoreError> {
        let Deadline {
            budget,
            late: deadline,
        } = deadline;
        let requests = [Request { now, charges }];
        let topology = self
            .topology()
            .ok_or_else(|| self.parts.startup.not_connected(&self.servers))?;
        let Some(mut node) = topology.primary(slot).cloned() else {
            self.refresh_soon();
            return Err(StoreError::Unavailable(
                format!("{}: no primary serves slot {slot}", self.servers).into(),
            ));
        };
        let program = self.parts.program;
        let mut asking = false;
        for _ in 0..=MAX_REDIRECTIONS {
            // A script queued on a multiplexed connection runs, whatever the caller does next:
            // with no budget left it is not sent at all (nor sent again after a redirection).
            if budget <= Instant::now() {
                return Err(StoreError::Timeout);
            }
            let Some(permit) = node.breaker().admit() else {
                self.refresh_soon();
                return Err(StoreError::CircuitOpen);
            };
            // `in_use` tells which connection a time-out caught.
            let mut in_use = None;
            let attempt = async {
                let (mut conn, health) = node.connection().await?;
                in_use = Some(health.clone());
                let cmd = program.command(node.form().get(), mode, &requests);
                let mut result = Node::send(&mut conn, &cmd, asking).await;
                if let Err(e) = &result
                    && script::not_run(e)
                {
                    // The node lost the code (a restart, a failover), or has no functions: it
                    // did not run.
                    result = match program.reload(&mut conn, node.form(), e).await {
                        Ok(form) => {
                            let cmd = program.command(form, mode, &requests);
                            Node::send(&mut conn, &cmd, asking).await
                        }
                        Err(e) => Err(e),
                    };
                }
                match &result {
                    Err(e) if e.is_timeout() => health.timed_out(),
                    Err(e) if breaks_connection(e) => health.broke(),
                    _ => health.answered(),
                }
                Ok::<_, StoreError>(result)
            };
            let left = deadline.saturating_duration_since(Instant::now());
            let result = match tokio::time::timeout(left, attempt).await {
                Ok(Ok(result)) => result,
                Ok(Err(error)) => {
                    self.failed(&node, permit, &error);
                    return Err(error);
                }
                Err(_) => {
                    if let Some(health) = in_use {
                        health.timed_out();
                    }
                    self.failed(&node, permit, &StoreError::Timeout);
                    return Err(StoreError::Timeout);
                }
            };
            let error = match result {
                Ok(value) if Instant::now() > budget => {
                    // Answered after a check's budget (a call that waits longer for its reply):
                    // for the breaker and the connection, a time-out.
                    if let Some(health) = in_use {
                        health.timed_out();
                    }
                    self.failed(&node, permit, &StoreError::Timeout);
                    return Ok(value);
                }
                Ok(value) => {
                    node.breaker().success(permit);
                    return Ok(value);
                }
                Err(error) => error,
            };
            match redirection(&error) {
                Some(Redirection::Moved(addr)) => {
                    node.breaker().success(permit);
                    let target = self.node(&addr)?;
                    self.moved(slot, target.clone());
                    self.refresh_soon();
                    node = target;
                    asking = false;
                }
                Some(Redirection::Ask(addr)) => {
                    node.breaker().success(permit);
                    node = self.node(&addr)?;
                    asking = true;
                }
                Some(Redirection::TryAgain) => {
                    node.breaker().success(permit);
                    let pause = Duration::from_millis(10)
                        .min(deadline.saturating_duration_since(Instant::now()));
                    tokio::time::sleep(pause).await;
                }
                None if is_server_answer(&error) => {
                    // The node answered at once (`CLUSTERDOWN` while a primary fails over,
                    // `LOADING`…): its breaker has nothing to spare; the slot map may be
                    // changing.
                    node.breaker().success(permit);
                    self.refresh_soon();
                    return Err(store_error(node.server(), error));
                }
                None => {
                    let error = store_error(node.server(), error);
                    self.failed(&node, permit, &error);
                    return Err(error);
                }
            }
        }
        Err(StoreError::Unavailable(
            format!(
                "{}: more than {MAX_REDIRECTIONS} redirections for slot {slot}",
                self.servers
            )
            .into(),
        ))
    }

    /// A call to `node` failed: its breaker learns of it, and the slot map is read again (the
    /// node may have failed over).
    fn failed(&self, node: &Arc<Node>, permit: crate::store::breaker::Permit, error: &StoreError) {
        if node.breaker().failure(permit) {
            tracing::error!(
                server = &**node.server(),
                %error,
                "tollgate: a Redis Cluster node keeps failing; its circuit breaker opened: \
                 checks of its slots are decided by each rule's FailureMode until a probe \
                 succeeds, the other slots as usual"
            );
            node.probe_in_background();
        }
        self.refresh_soon();
    }

    /// Records that `slot` moved to `node`, until the next read of the slot map.
    fn moved(&self, slot: u16, node: Arc<Node>) {
        let mut topology = self.topology.write().unwrap_or_else(|p| p.into_inner());
        if let Some(current) = topology.as_ref() {
            *topology = Some(Arc::new(current.moved(slot, node)));
        }
    }

    async fn reply(
        &self,
        slot: u16,
        mode: Mode,
        now: Option<u64>,
        charges: &[&Prepared],
        deadline: Deadline,
    ) -> Result<Reply, StoreError> {
        let value = self.call(slot, mode, now, charges, deadline).await?;
        let requests = [Request { now, charges }];
        let mut replies = script::decode(value, &requests)?;
        replies
            .pop()
            .ok_or_else(|| StoreError::Protocol("the rate-limit code answered no request".into()))
    }

    async fn check_slots(
        &self,
        prepared: &[Prepared],
        now: Option<u64>,
        deadline: Deadline,
    ) -> Result<Reply, StoreError> {
        let Some(first) = prepared.first() else {
            return Ok(Reply {
                now: now.unwrap_or(0),
                outcomes: SmallVec::new(),
                taken: SmallVec::new(),
                times: None,
            });
        };
        let slot = first.slot();
        if prepared.iter().all(|p| p.slot() == slot) {
            let charges: Vec<&Prepared> = prepared.iter().collect();
            return self
                .reply(slot, Mode::Charge, now, &charges, deadline)
                .await;
        }
        self.check_across_slots(prepared, now, deadline).await
    }

    /// Charges in several slots: check all, charge all, refund on a lost race.
    async fn check_across_slots(
        &self,
        prepared: &[Prepared],
        now: Option<u64>,
        deadline: Deadline,
    ) -> Result<Reply, StoreError> {
        let groups = groups(prepared);
        let group_charges: Vec<Vec<&Prepared>> = groups
            .iter()
            .map(|(_, indices)| indices.iter().map(|&i| &prepared[i]).collect())
            .collect();

        // 1. Check every group without charging: a denied request charges nothing. A group that
        // denies decides, even when another could not answer.
        let peeks = join_all(
            groups
                .iter()
                .zip(&group_charges)
                .map(|((slot, _), charges)| self.reply(*slot, Mode::Peek, now, charges, deadline)),
        )
        .await;
        if peeks.iter().any(|r| r.as_ref().is_ok_and(|r| !r.allowed())) {
            return Ok(denial(prepared, &groups, &group_charges, peeks));
        }
        let peeks = peeks
            .into_iter()
            .collect::<Result<Vec<Reply>, StoreError>>()?;

        // A check out of budget charges nothing more: its request is decided without it.
        if Instant::now() >= deadline.budget {
            return Err(StoreError::Timeout);
        }

        // 2. Charge every group, each atomically.
        let charged = join_all(
            groups
                .iter()
                .zip(&group_charges)
                .map(|((slot, _), charges)| {
                    self.reply(*slot, Mode::Charge, now, charges, deadline)
                }),
        )
        .await;
        if charged.iter().all(|r| r.as_ref().is_ok_and(Reply::allowed)) {
            let replies: Vec<Reply> = charged.into_iter().flatten().collect();
            return Ok(scatter(prepared.len(), &groups, &replies));
        }

        // 3. A group denied (a concurrent request took the last units) or failed: give back what
        // the other groups took (a lease, all it took). The refunds get a budget of their own:
        // they repair.
        let refund_deadline = Instant::now() + self.parts.settings.response_timeout;
        let to_refund: Vec<(u16, u64, Vec<Prepared>)> = groups
            .iter()
            .zip(&group_charges)
            .zip(&charged)
            .filter_map(|(((slot, _), charges), reply)| match reply {
                Ok(reply) if reply.allowed() => Some((
                    *slot,
                    reply.now,
                    charges
                        .iter()
                        .zip(&reply.taken)
                        .map(|(charge, &taken)| Prepared {
                            cost: taken,
                            lease: 0,
                            ..(*charge).clone()
                        })
                        .collect(),
                )),
                _ => None,
            })
            .collect();
        let refunds = to_refund.iter().map(|(slot, at, charges)| async move {
            let charges: Vec<&Prepared> = charges.iter().collect();
            self.call(
                *slot,
                Mode::Refund(*at),
                now,
                &charges,
                refund_deadline.into(),
            )
            .await
        });
        for result in join_all(refunds).await {
            if let Err(e) = result {
                tracing::warn!(
                    error = %e,
                    "tollgate: could not refund a cross-slot charge; it stays until its key expires"
                );
            }
        }
        // Denied by a group: every rule reports its budget uncharged (the groups that were
        // charged and refunded report what their peek saw). Without a denial, a failure.
        if !charged
            .iter()
            .any(|r| r.as_ref().is_ok_and(|r| !r.allowed()))
        {
            let error = charged.into_iter().find_map(Result::err);
            return Err(error.unwrap_or(StoreError::Timeout));
        }
        let replies = charged
            .into_iter()
            .zip(peeks)
            .map(|(reply, peek)| match reply {
                Ok(reply) if reply.allowed() => Ok(peek),
                other => other,
            })
            .collect();
        Ok(denial(prepared, &groups, &group_charges, replies))
    }
}

impl Cluster {
    /// One call of `mode` per slot of `charges` (each stands alone: adjustments, resets).
    async fn each_slot(
        &self,
        mode: Mode,
        now: Option<u64>,
        charges: &[Prepared],
    ) -> Result<(), StoreError> {
        if !self.parts.startup.is_connected() {
            return Err(self.parts.startup.not_connected(&self.servers));
        }
        // Every slot is tried at once, whatever the others answer: each change stands alone.
        let deadline = Instant::now() + self.parts.settings.response_timeout;
        let groups: Vec<(u16, Vec<&Prepared>)> = groups(charges)
            .into_iter()
            .map(|(slot, indices)| (slot, indices.iter().map(|&i| &charges[i]).collect()))
            .collect();
        let results = join_all(
            groups
                .iter()
                .map(|(slot, group)| self.call(*slot, mode, now, group, deadline.into())),
        )
        .await;
        results.into_iter().collect::<Result<Vec<_>, _>>().map(drop)
    }
}

/// The decision of a request that a group denied. A group that could not answer reports its
/// rules as if their keys were new: the request is denied whatever they say.
fn denial(
    prepared: &[Prepared],
    groups: &[(u16, Vec<usize>)],
    group_charges: &[Vec<&Prepared>],
    replies: Vec<Result<Reply, StoreError>>,
) -> Reply {
    let replies: Vec<Reply> = replies
        .into_iter()
        .zip(group_charges)
        .map(|(reply, charges)| {
            reply.unwrap_or_else(|_| Reply {
                now: 0,
                outcomes: charges
                    .iter()
                    .map(|p| p.algorithm.check(&p.limits, None, 0, 0))
                    .collect(),
                taken: smallvec::smallvec![0; charges.len()],
                times: None,
            })
        })
        .collect();
    scatter(prepared.len(), groups, &replies)
}

/// What an error answer asks of the client when the script did not run.
enum Redirection {
    /// The slot lives on another node now: send it there, and read the slot map again.
    Moved(String),
    /// The slot is migrating: send this one there, after `ASKING`.
    Ask(String),
    /// The keys are migrating: try again in a moment.
    TryAgain,
}

fn redirection(error: &RedisError) -> Option<Redirection> {
    // `MOVED 3999 127.0.0.1:6381`: the slot, then the node's `host:port`.
    let target = || error.redirect_node().map(|(addr, _slot)| addr.to_owned());
    match error.kind() {
        ErrorKind::Server(ServerErrorKind::Moved) => target().map(Redirection::Moved),
        ErrorKind::Server(ServerErrorKind::Ask) => target().map(Redirection::Ask),
        ErrorKind::Server(ServerErrorKind::TryAgain) => Some(Redirection::TryAgain),
        _ => None,
    }
}

/// The background task: reads the slot map until it has one, then again whenever a check asks
/// (a redirection, a failure): at most every 100 ms while the map changes, spacing out to every
/// 500 ms while it does not. Ends when the store is dropped.
async fn read_slot_map_in_background(
    store: Weak<Cluster>,
    refresh: Arc<Notify>,
    _running: Running,
) {
    let mut delay = FIRST_RETRY_DELAY;
    let mut pace = REFRESH_INTERVAL;
    loop {
        let Some(inner) = store.upgrade() else {
            return;
        };
        let retry = match inner.read_slot_map().await {
            Ok(changed) => {
                if !inner.parts.startup.is_connected() {
                    inner.parts.startup.connected();
                    tracing::info!(
                        servers = &*inner.servers,
                        "tollgate: read the Redis Cluster slot map"
                    );
                    let clients = inner
                        .seeds
                        .iter()
                        .filter_map(|seed| inner.node(seed).ok())
                        .map(|node| node.client().clone())
                        .collect();
                    inner.parts.listen(clients);
                }
                delay = FIRST_RETRY_DELAY;
                pace = if changed {
                    REFRESH_INTERVAL
                } else {
                    (pace * 2).min(MAX_REFRESH_INTERVAL)
                };
                None
            }
            Err(error) => {
                if inner.parts.connect_failed(&error) {
                    tracing::warn!(
                        servers = &*inner.servers,
                        %error,
                        "tollgate: cannot read the Redis Cluster slot map; retrying in the \
                         background (reported at most once a minute)"
                    );
                }
                let wait = delay;
                delay = (delay * 2).min(MAX_RETRY_DELAY);
                Some(wait)
            }
        };
        drop(inner);
        match retry {
            Some(wait) => tokio::time::sleep(wait).await,
            None => refresh.notified().await,
        }
        tokio::time::sleep(pace).await;
    }
}

/// When a call gives up: `late` for its answer; `budget`, the check's own time, for sending
/// anything (a first call, a redirection, a second phase) and for the breaker (an answer after
/// it is a time-out). The same for every call but those that take concurrency slots.
#[derive(Clone, Copy, Debug)]
struct Deadline {
    budget: Instant,
    late: Instant,
}

impl From<Instant> for Deadline {
    fn from(at: Instant) -> Self {
        Deadline {
            budget: at,
            late: at,
        }
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

/// The outcomes of each group's reply (and the units each charge took), back in the order of
/// the charges; the time of the first group.
fn scatter(len: usize, groups: &[(u16, Vec<usize>)], replies: &[Reply]) -> Reply {
    let mut outcomes: SmallVec<[Outcome; 2]> = smallvec::smallvec![Outcome::default(); len];
    let mut taken: SmallVec<[u64; 2]> = smallvec::smallvec![0; len];
    // Each node has its own clock: the time of each charge is its node's.
    let mut times = vec![0; len];
    for ((_, indices), reply) in groups.iter().zip(replies) {
        for ((&i, outcome), &units) in indices.iter().zip(&reply.outcomes).zip(&reply.taken) {
            outcomes[i] = *outcome;
            taken[i] = units;
            times[i] = reply.now;
        }
    }
    Reply {
        now: replies.first().map_or(0, |r| r.now),
        outcomes,
        taken,
        times: Some(times.into()),
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
            .spawn(|running| read_slot_map_in_background(weak, refresh, running));
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

    fn decide(
        self: Arc<Self>,
        prepared: Vec<Prepared>,
        now: Option<u64>,
    ) -> impl Future<Output = Result<Reply, StoreError>> + Send {
        let deadline = Instant::now() + self.parts.settings.response_timeout;
        let runtime = match tokio::runtime::Handle::try_current() {
            Ok(runtime) if self.runs_alone(&prepared) => runtime,
            _ => {
                return futures_util::future::Either::Left(async move {
                    let deadline = Instant::now() + self.parts.settings.response_timeout;
                    self.check_slots(&prepared, now, deadline.into()).await
                });
            }
        };
        // The request waits until its deadline; a call that takes slots, a while longer for
        // its reply.
        let late = if prepared.iter().any(|p| p.algorithm.is_concurrency()) {
            Instant::now() + late_reply_wait(self.parts.settings.response_timeout)
        } else {
            deadline
        };
        let (answer, answered) = remote::channel(now);
        drop(runtime.spawn(async move {
            let budget = Deadline {
                budget: deadline,
                late,
            };
            let reply = self.check_slots(&prepared, now, budget).await;
            answer.send(&self, reply, prepared);
        }));
        futures_util::future::Either::Right(remote::wait(answered, deadline.into(), || {
            StoreError::Unavailable("the check's task ended without an answer".into())
        }))
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
