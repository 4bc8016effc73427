//! One node of a cluster: its multiplexed connection, opened when first needed and replaced when
//! it breaks, and its own circuit breaker.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, Cmd, ConnectionAddr, ConnectionInfo, Value};

use crate::CircuitBreaker;
use crate::store::StoreError;
use crate::store::breaker::Breaker;
use crate::store::redis::access;
use crate::store::redis::error::{AtServer, store_error};
use crate::store::redis::health::Health;
use crate::store::redis::script::ServerForm;

/// A node of the cluster, by address.
pub(crate) struct Node {
    addr: String,
    /// `redis://host:port` (`rediss://` over TLS), to name it in errors.
    server: Arc<str>,
    client: Client,
    config: AsyncConnectionConfig,
    connect_timeout: Duration,
    response_timeout: Duration,
    conn: Mutex<Option<(MultiplexedConnection, Arc<Health>)>>,
    /// One connection attempt at a time.
    connecting: tokio::sync::Mutex<()>,
    breaker: Breaker,
    /// Whether the node runs functions or scripts.
    form: ServerForm,
}

impl Node {
    /// The node at `addr` (`host:port`), with the credentials of `template`, over TLS when it
    /// is (with its certificates).
    pub(super) fn new(
        addr: &str,
        template: &ConnectionInfo,
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
        let client = Client::open(info).map_err(|e| store_error(&server, e))?;
        let breaker = Breaker::new(breaker, "redis_cluster", server.clone());
        Ok(Node {
            addr: addr.to_owned(),
            server,
            client,
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(connect_timeout))
                // Each call has its own deadline; this one only bounds a reply the
                // connection still waits for, as long as a call that takes concurrency slots
                // waits for its own.
                .set_response_timeout(Some(super::super::late_reply_wait(response_timeout))),
            connect_timeout,
            response_timeout,
            conn: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            breaker,
            form: ServerForm::default(),
        })
    }

    pub(super) fn addr(&self) -> &str {
        &self.addr
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

    /// The node's connection, opened when there is none (or it broke).
    pub(super) async fn connection(
        &self,
    ) -> Result<(MultiplexedConnection, Arc<Health>), StoreError> {
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let _one_at_a_time = self.connecting.lock().await;
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let connect = self
            .client
            .get_multiplexed_async_connection_with_config(&self.config);
        let conn = match tokio::time::timeout(self.connect_timeout, connect).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => return Err(access::connect_error(&self.server, e)),
            Err(_) => {
                return Err(StoreError::Unavailable(Box::new(AtServer::new(
                    &self.server,
                    "connecting timed out",
                ))));
            }
        };
        let conn = (conn, Arc::new(Health::new(self.response_timeout)));
        *self.conn.lock().unwrap_or_else(|p| p.into_inner()) = Some(conn.clone());
        Ok(conn)
    }

    /// The current connection, unless it broke (then it is dropped).
    fn current(&self) -> Option<(MultiplexedConnection, Arc<Health>)> {
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if conn.as_ref().is_some_and(|(_, health)| health.is_broken()) {
            *conn = None;
        }
        conn.clone()
    }

    /// Sends `cmd`, preceded by `ASKING` when `asking`.
    pub(super) async fn send(
        conn: &mut MultiplexedConnection,
        cmd: &Cmd,
        asking: bool,
    ) -> redis::RedisResult<Value> {
        if !asking {
            return cmd.query_async::<Value>(conn).await;
        }
        let mut pipe = redis::pipe();
        pipe.cmd("ASKING").ignore().add_command(cmd.clone());
        let mut values: Vec<Value> = pipe.query_async(conn).await?;
        values
            .pop()
            .ok_or_else(|| (redis::ErrorKind::UnexpectedReturnType, "no reply").into())
    }
}
