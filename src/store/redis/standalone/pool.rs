//! The server's connections: a bb8 pool of multiplexed connections, each borrowed only to clone
//! its handle, and one opened by the checks themselves when the pool has none.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use ::redis::aio::MultiplexedConnection;
use ::redis::{AsyncConnectionConfig, Client, ConnectionInfo, RedisError, RedisResult};

use super::Standalone;
use crate::clock::unix_micros;
use crate::store::StoreError;
use crate::store::redis::access::{self};
use crate::store::redis::error::{AtServer, store_error};
use crate::store::redis::health::{self, Health};
use crate::store::redis::late_reply_wait;
use crate::store::redis::opening::Done;
use crate::throttle::Every;

/// A connection, and its health.
pub(super) type Connection = (MultiplexedConnection, Arc<Health>);

/// Opens a connection for the checks waiting (see `Standalone::open`), gives it to the pool (a full
/// pool lets it go with its last check), and tells them.
pub(super) async fn open_for_checks(store: Weak<Standalone>, done: Done<Connection>) {
    let Some(inner) = store.upgrade() else {
        return;
    };
    let opened = match inner.manager() {
        Ok(manager) => match bb8::ManageConnection::connect(&manager).await {
            Ok(opened) => {
                let handle = (opened.conn.clone(), opened.health.clone());
                if let Some(pool) = inner.pool.get() {
                    let _ = pool.add(opened);
                }
                Ok(handle)
            }
            Err(e) => Err(access::explained(&e)),
        },
        Err(e) => Err(e.to_string()),
    };
    inner.opening.end(done, opened);
}

/// Connection errors of the pool (bb8 keeps them from the caller, who sees a time-out): logged,
/// at most once a minute.
#[derive(Debug, Clone)]
pub(super) struct LogConnectErrors {
    server: Arc<str>,
    every: Arc<Every>,
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
    fn new(
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

impl Standalone {
    pub(super) fn manager(&self) -> Result<Manager, StoreError> {
        Manager::new(
            self.info.clone(),
            self.parts.settings.connect_timeout,
            self.parts.settings.response_timeout,
        )
        .map_err(|e| store_error(&self.server, e))
    }

    /// The pool, made once the store has connected (bb8 needs a runtime).
    pub(super) fn pool(&self) -> Result<&bb8::Pool<Manager>, StoreError> {
        if let Some(pool) = self.pool.get() {
            return Ok(pool);
        }
        let pool = bb8::Pool::builder()
            .max_size(self.pool_size)
            .min_idle(self.pool_size)
            .test_on_check_out(false)
            .retry_connection(false)
            .connection_timeout(self.parts.settings.connect_timeout)
            .error_sink(Box::new(LogConnectErrors {
                server: self.server.clone(),
                every: Arc::default(),
            }))
            .build_unchecked(self.manager()?);
        Ok(self.pool.get_or_init(|| pool))
    }

    /// A connection of the pool, as a handle of its own: the pool entry goes back at once, so
    /// that each connection pipelines every check that picks it. Broken connections are dropped
    /// (the pool opens new ones). When none is open any more, the check opens one itself: a
    /// server that refuses it is an answer at once, where waiting for the pool would cost the
    /// whole budget.
    pub(super) async fn connection(
        &self,
    ) -> Result<(MultiplexedConnection, Arc<Health>), StoreError> {
        let pool = self.pool()?;
        for _ in 0..=self.pool_size {
            // Until the pool has first filled, its connections are on their way: waited for
            // (so that checks keep their order on one connection). After, none means they broke.
            let open = pool.state().connections;
            if open > 0 {
                self.pool_filled.store(true, Ordering::Relaxed);
            } else if self.pool_filled.load(Ordering::Relaxed) {
                break;
            }
            let pooled = pool.get().await.map_err(|e| match e {
                bb8::RunError::User(e) => store_error(&self.server, e),
                bb8::RunError::TimedOut => StoreError::Timeout,
            })?;
            if !pooled.health.is_broken() {
                return Ok((pooled.conn.clone(), pooled.health.clone()));
            }
        }
        self.open(pool).await
    }

    /// Opens a connection for a check when the pool has none, and gives it to the pool. One
    /// attempt at a time, in a task of its own bounded by the connect timeout, not by a check's
    /// budget (on a slow network an attempt that every check cut short would never end); the
    /// checks that need it wait for it within their own budgets.
    pub(super) async fn open(
        &self,
        pool: &bb8::Pool<Manager>,
    ) -> Result<(MultiplexedConnection, Arc<Health>), StoreError> {
        if pool.state().idle_connections > 0
            && let Ok(pooled) = pool.get().await
            && !pooled.health.is_broken()
        {
            return Ok((pooled.conn.clone(), pooled.health.clone()));
        }
        self.opening
            .join(|done| drop(tokio::spawn(open_for_checks(self.me.clone(), done))))
            .await
            .map_err(|error| StoreError::Unavailable(Box::new(AtServer::new(&self.server, error))))
    }
}
