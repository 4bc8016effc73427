//! The cluster's slot map: read from the first node that answers, again in the background when
//! a check asks (a redirection, a failure), and the nodes it names.

use std::sync::{Arc, Weak};
use std::time::Duration;

use redis::Value;
use tokio::sync::Notify;

use super::Cluster;
use super::node::Node;
use super::topology::Topology;
use crate::store::StoreError;
use crate::store::redis::error::store_error;
use crate::store::redis::remote;
use crate::store::redis::startup::{FIRST_RETRY_DELAY, MAX_RETRY_DELAY, Running};

/// The shortest time between two reads of the slot map.
pub(super) const REFRESH_INTERVAL: Duration = Duration::from_millis(100);

/// The longest time between two reads of the slot map that checks ask for: reads that find the
/// same map space out up to this (a failover takes a second or two to show in the map).
pub(super) const MAX_REFRESH_INTERVAL: Duration = Duration::from_millis(500);

impl Cluster {
    /// The background task: reads the slot map until it has one, then again whenever a check asks
    /// (a redirection, a failure): at most every 100 ms while the map changes, spacing out to every
    /// 500 ms while it does not. Ends when the store is dropped.
    pub(super) async fn read_slot_map_in_background(
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
                        remote::keep_beating(&inner);
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
                    // A store no one holds any more has nothing to say of Redis.
                    if inner.parts.connect_failed(&error) && Arc::strong_count(&inner) > 1 {
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

    pub(super) fn topology(&self) -> Option<Arc<Topology>> {
        self.topology
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The node at `addr`, made when first seen.
    pub(super) fn node(&self, addr: &str) -> Result<Arc<Node>, StoreError> {
        let mut nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(node) = nodes.get(addr) {
            return Ok(node.clone());
        }
        let node = Arc::new(Node::new(
            addr,
            &self.template,
            &self.targets,
            self.parts.settings.connect_timeout,
            self.parts.settings.response_timeout,
            self.parts.settings.breaker,
        )?);
        nodes.insert(addr.to_owned(), node.clone());
        Ok(node)
    }

    /// Reads the slot map from the first node that answers: the known primaries whose breaker
    /// is closed, then the nodes given to the builder. True when the map changed.
    pub(super) async fn read_slot_map(&self) -> Result<bool, StoreError> {
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
                let mut conn = node.connection().await?;
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
    pub(super) fn refresh_soon(&self) {
        self.refresh.notify_one();
    }

    /// Records that `slot` moved to `node`, until the next read of the slot map.
    pub(super) fn moved(&self, slot: u16, node: Arc<Node>) {
        let mut topology = self.topology.write().unwrap_or_else(|p| p.into_inner());
        if let Some(current) = topology.as_ref() {
            *topology = Some(Arc::new(current.moved(slot, node)));
        }
    }
}
