//! The server's connections: a bb8 pool of multiplexed connections, each borrowed only to clone
//! its handle, and one opened by the checks themselves when the pool has none.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use ::redis::aio::MultiplexedConnection;

use super::Standalone;
use super::manager::{Connection, LogConnectErrors, Manager};
use crate::store::StoreError;
use crate::store::redis::access::{self};
use crate::store::redis::error::{AtServer, store_error};
use crate::store::redis::health::Health;
use crate::store::redis::opening::Done;

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
