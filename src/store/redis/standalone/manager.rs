//! The pool's connections: multiplexed, RESP3, each with the health the store reads, and what
//! the pool says when it cannot open one.

use std::sync::Arc;
use std::time::Duration;

use ::redis::aio::MultiplexedConnection;
use ::redis::{AsyncConnectionConfig, Client, ConnectionInfo, RedisError, RedisResult};

use crate::clock::unix_micros;
use crate::store::redis::access::{self};
use crate::store::redis::health::{self, Health};
use crate::store::redis::settings::late_reply_wait;
use crate::throttle::Every;

/// A connection, and its health.
pub(super) type Connection = (MultiplexedConnection, Arc<Health>);

/// Connection errors of the pool (bb8 keeps them from the caller, who sees a time-out): logged,
/// at most once a minute.
#[derive(Debug, Clone)]
pub(super) struct LogConnectErrors {
    pub(super) server: Arc<str>,
    pub(super) every: Arc<Every>,
}

impl bb8::ErrorSink<RedisError> for LogConnectErrors {
    fn sink(&self, error: RedisError) {
        if self.every.due(unix_micros(), 60_000_000) {
            let error = access::explained(&error);
            tracing::warn!(
                server = &*self.server,
                %error,
                "tollgate: cannot open a connection to Redis (reported at most once a minute)"
            );
        }
    }

    fn boxed_clone(&self) -> Box<dyn bb8::ErrorSink<RedisError>> {
        Box::new(self.clone())
    }
}

/// The pool's connections: multiplexed, RESP3, each with the health the store reads, marked
/// broken when the connection fails or the server closes it (instead of a `PING` on every
/// check-out).
pub(super) struct Manager {
    pub(super) client: Client,
    pub(super) config: AsyncConnectionConfig,
    pub(super) response_timeout: Duration,
}

impl Manager {
    pub(super) fn new(
        info: ConnectionInfo,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> RedisResult<Self> {
        let info = health::resp3(info);
        Ok(Manager {
            client: Client::open(info)?,
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(connect_timeout))
                // Each call has its own deadline (`run`); this one only bounds a reply the
                // connection still waits for, as long as a call that takes concurrency slots
                // waits for its own.
                .set_response_timeout(Some(late_reply_wait(response_timeout))),
            response_timeout,
        })
    }
}

pub(super) struct Pooled {
    pub(super) conn: MultiplexedConnection,
    pub(super) health: Arc<Health>,
}

impl bb8::ManageConnection for Manager {
    type Connection = Pooled;
    type Error = RedisError;

    async fn connect(&self) -> Result<Pooled, RedisError> {
        let health = Arc::new(Health::new(self.response_timeout));
        let conn = self
            .client
            .get_multiplexed_async_connection_with_config(&health::watched(&self.config, &health))
            .await?;
        Ok(Pooled { conn, health })
    }

    async fn is_valid(&self, conn: &mut Pooled) -> Result<(), RedisError> {
        redis::cmd("PING").query_async::<()>(&mut conn.conn).await
    }

    fn has_broken(&self, conn: &mut Pooled) -> bool {
        conn.health.is_broken()
    }
}
