//! One node of a cluster: its connection, opened when first needed and replaced when it breaks,
//! and its own circuit breaker.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::{Client, ConnectionAddr, ConnectionInfo};

use crate::CircuitBreaker;
use crate::store::StoreError;
use crate::store::breaker::Breaker;
use crate::store::redis::access;
use crate::store::redis::connection::{self, Connection, Target};
use crate::store::redis::error::{AtServer, store_error};
use crate::store::redis::forget;
use crate::store::redis::opening::{Done, Opening};
use crate::store::redis::probe::{self, Probed};
use crate::store::redis::script::ServerForm;

/// The most probes in a row a node's background probe makes before it leaves the node to
/// requests (one cooldown each: 10 minutes at the default cooldown).
const MAX_FAILED_PROBES: u32 = 600;

/// A node of the cluster, by address.
pub(crate) struct Node {
    addr: String,
    /// `redis://host:port` (`rediss://` over TLS), to name it in errors.
    server: Arc<str>,
    /// The node's client (RESP3), for the listener of forgotten keys.
    client: Client,
    /// Where its connection goes.
    target: Target,
    connect_timeout: Duration,
    response_timeout: Duration,
    conn: Mutex<Option<Connection>>,
    /// The connection attempt under way, if any: one at a time, shared by the checks waiting.
    /// (The connection itself is kept in the node.)
    opening: Opening<()>,
    breaker: Breaker,
    /// Whether the node runs functions or scripts.
    form: ServerForm,
}

impl Node {
    /// The node at `addr` (`host:port`), with the credentials of `template`, over TLS when it
    /// is (with its certificates); its connection goes where `targets` (the first node's) does,
    /// at `addr`.
    pub(super) fn new(
        addr: &str,
        template: &ConnectionInfo,
        targets: &Target,
        connect_timeout: Duration,
        response_timeout: Duration,
        breaker: CircuitBreaker,
    ) -> Result<Node, StoreError> {
        let scheme = match template.addr() {
            ConnectionAddr::TcpTls { .. } => "rediss",
            _ => "redis",
        };
        let server: Arc<str> = format!("{scheme}://{addr}").into();
        let (host, port) = addr
            .rsplit_once(':')
            .and_then(|(host, port)| Some((host, port.parse::<u16>().ok()?)))
            .ok_or_else(|| StoreError::Protocol(format!("the node address {addr} has no port")))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let info = template
            .clone()
            .set_addr(access::node_addr(template, host, port));
        let client = forget::client(info).map_err(|e| store_error(&server, e))?;
        let breaker = Breaker::new(breaker, "redis_cluster", server.clone());
        Ok(Node {
            addr: addr.to_owned(),
            server,
            client,
            target: targets.at(host, port),
            connect_timeout,
            response_timeout,
            conn: Mutex::new(None),
            opening: Opening::default(),
            breaker,
            form: ServerForm::default(),
        })
    }

    pub(super) fn addr(&self) -> &str {
        &self.addr
    }

    /// The node's client (RESP3), for a connection of another use (pub/sub).
    pub(super) fn client(&self) -> &Client {
        &self.client
    }

    pub(super) fn server(&self) -> &Arc<str> {
        &self.server
    }

    /// Whether the node runs functions or scripts, as last seen.
    pub(super) fn form(&self) -> &ServerForm {
        &self.form
    }

    pub(super) fn breaker(&self) -> &Breaker {
        &self.breaker
    }

    /// The node's connection, opened when there is none (or it broke). The opening runs in a
    /// task of its own, bounded by the connect timeout and not by the check's budget: on a slow
    /// network, opening a connection and sending a check can take longer than a check may wait,
    /// and an opening cut short by every check in turn would never end.
    pub(super) async fn connection(self: &Arc<Self>) -> Result<Connection, StoreError> {
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let outcome = self
            .opening
            .join(|done| drop(tokio::spawn(self.clone().open(done))))
            .await;
        match outcome {
            Ok(()) => self.current().ok_or_else(|| {
                StoreError::Unavailable(Box::new(AtServer::new(
                    &self.server,
                    "the connection broke as soon as it opened",
                )))
            }),
            Err(error) => Err(StoreError::Unavailable(Box::new(AtServer::new(
                &self.server,
                error,
            )))),
        }
    }

    /// One attempt to open the node's connection, within the connect timeout; its outcome goes
    /// to every check waiting for it.
    async fn open(self: Arc<Self>, done: Done<()>) {
        let connect = connection::open(
            &self.target,
            self.server.clone(),
            self.response_timeout,
            None,
        );
        let outcome = match tokio::time::timeout(self.connect_timeout, connect).await {
            Ok(Ok(conn)) => {
                *self.conn.lock().unwrap_or_else(|p| p.into_inner()) = Some(conn);
                Ok(())
            }
            Ok(Err(e)) => Err(access::explained(&e)),
            Err(_) => Err("connecting timed out".to_owned()),
        };
        self.opening.end(done, outcome);
    }

    /// Probes the node once per cooldown while its breaker is open (see [`probe`]); a node that
    /// failed every probe for so long may be gone from the cluster (its address replaced), and
    /// is left to the requests of its slots, if any.
    pub(super) fn probe_in_background(self: &Arc<Self>) {
        probe::in_background(self, MAX_FAILED_PROBES);
    }

    /// The current connection, unless it broke (then it is dropped).
    fn current(&self) -> Option<Connection> {
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if conn.as_ref().is_some_and(Connection::is_broken) {
            *conn = None;
        }
        conn.clone()
    }
}

impl Probed for Node {
    fn breaker(&self) -> &Breaker {
        &self.breaker
    }

    fn probe_timeout(&self) -> Duration {
        self.response_timeout
    }

    async fn probe_connection(self: Arc<Self>) -> Result<Connection, StoreError> {
        self.connection().await
    }
}
