//! The server's connections: at most `pool_size`, the first that keeps up taking the checks;
//! one that breaks is dropped and another opened in its place, in the background, or by the
//! checks themselves when none is left.

use std::sync::Weak;
use std::sync::atomic::Ordering;

use super::Standalone;
use crate::clock::unix_micros;
use crate::store::StoreError;
use crate::store::redis::access;
use crate::store::redis::connection::{self, Checks, Connection, Job, Owner};
use crate::store::redis::error::AtServer;
use crate::store::redis::opening::Done;
use crate::store::redis::settings::late_reply_wait;

/// The least time between two attempts of the background to open a connection after one failed.
const FILL_RETRY_MICROS: u64 = 1_000_000;

/// Opens a connection for the checks waiting (see `Standalone::open`), adds it to the pool, and
/// tells them.
async fn open_for_checks(store: Weak<Standalone>, done: Done<Connection>) {
    let Some(inner) = store.upgrade() else {
        return;
    };
    let opened = inner
        .open_connection()
        .await
        .inspect(|conn| inner.add(conn.clone()));
    inner
        .opening
        .end(done, opened.map_err(|e| access::explained(&e)));
}

impl Standalone {
    /// Opens one connection, whose checks go in calls of at most `max_batch`, within the
    /// connect timeout.
    pub(super) async fn open_connection(&self) -> redis::RedisResult<Connection> {
        let owner: Weak<dyn Owner> = self.me.clone();
        let checks = Checks {
            program: self.parts.program,
            form: self.form.clone(),
            max_batch: self.max_batch,
            max_calls: self.calls_per_connection,
            late_wait: late_reply_wait(self.parts.settings.response_timeout),
            owner,
        };
        let settings = &self.parts.settings;
        let open = connection::open(
            &self.target,
            self.server.clone(),
            settings.response_timeout,
            Some(checks),
        );
        tokio::time::timeout(settings.connect_timeout, open)
            .await
            .unwrap_or_else(|_| {
                Err(
                    std::io::Error::new(std::io::ErrorKind::TimedOut, "connecting timed out")
                        .into(),
                )
            })
    }

    /// Adds `conn` to the pool, unless it is full.
    pub(super) fn add(&self, conn: Connection) {
        let mut connections = self.connections.lock().unwrap_or_else(|p| p.into_inner());
        connections.retain(|c| !c.is_broken());
        if connections.len() < self.pool_size as usize {
            connections.push(conn);
        }
    }

    /// A connection that works, if any: the first whose queue holds less than a call's worth
    /// of checks (so that checks go together in as few calls as keep up), else the one with
    /// the fewest. Broken ones are dropped, and a connection is opened in the background while
    /// the pool is not full.
    pub(super) fn pick(&self) -> Option<Connection> {
        let mut connections = self.connections.lock().unwrap_or_else(|p| p.into_inner());
        if connections.iter().any(Connection::is_broken) {
            connections.retain(|c| !c.is_broken());
        }
        let picked = connections
            .iter()
            .find(|c| c.queued() < self.max_batch)
            .or_else(|| connections.iter().min_by_key(|c| c.queued()))
            .cloned();
        let full = connections.len() >= self.pool_size as usize;
        drop(connections);
        if !full {
            self.fill();
        }
        picked
    }

    /// Microseconds since the store was built, on the runtime's clock.
    fn since_origin(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Opens a connection in the background for the pool, unless one is being opened, the last
    /// attempt failed less than a second ago, or the store has not connected yet (its first
    /// connection comes first). A failure is logged at most once a minute.
    fn fill(&self) {
        let failed_at = self.fill_failed_at.load(Ordering::Relaxed);
        if !self.parts.startup.is_connected()
            || (failed_at != 0 && self.since_origin().saturating_sub(failed_at) < FILL_RETRY_MICROS)
            || self.filling.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let (Some(me), Ok(runtime)) = (self.me.upgrade(), tokio::runtime::Handle::try_current())
        else {
            self.filling.store(false, Ordering::Release);
            return;
        };
        runtime.spawn(async move {
            match me.open_connection().await {
                Ok(conn) => me.add(conn),
                Err(error) => {
                    me.fill_failed_at
                        .store(me.since_origin().saturating_add(1), Ordering::Relaxed);
                    if me.fill_warned.due(unix_micros(), 60_000_000) {
                        tracing::warn!(
                            server = &*me.server,
                            error = %access::explained(&error),
                            "tollgate: cannot open another connection to Redis (reported at most \
                             once a minute)"
                        );
                    }
                }
            }
            me.filling.store(false, Ordering::Release);
        });
    }

    /// A connection: one of the pool's, or, when none works, one opened now. A server that
    /// refuses it is an answer at once, where waiting for the pool would cost the whole budget.
    pub(super) async fn connection(&self) -> Result<Connection, StoreError> {
        match self.pick() {
            Some(conn) => Ok(conn),
            None => self.open().await,
        }
    }

    /// Opens a connection for a check when the pool has none, and adds it to the pool. One
    /// attempt at a time, in a task of its own bounded by the connect timeout, not by a check's
    /// budget (on a slow network an attempt that every check cut short would never end); the
    /// checks that need it wait for it within their own budgets.
    pub(super) async fn open(&self) -> Result<Connection, StoreError> {
        self.opening
            .join(|done| drop(tokio::spawn(open_for_checks(self.me.clone(), done))))
            .await
            .map_err(|error| StoreError::Unavailable(Box::new(AtServer::new(&self.server, error))))
    }
}

impl Owner for Standalone {
    fn report(
        &self,
        permit: crate::store::breaker::Permit,
        answered: bool,
        error: Option<&StoreError>,
    ) {
        Standalone::report(self, permit, answered, error);
    }

    fn give_back(
        &self,
        now: Option<u64>,
    ) -> Option<crate::store::redis::late_reply::GiveBackOrphan> {
        let me = self.me.upgrade()?;
        Some(crate::store::redis::remote::give_back_orphan(me, now))
    }

    fn retry(&self, jobs: Vec<Job>) -> Vec<Job> {
        let mut left = Vec::new();
        for job in jobs {
            match self.pick() {
                Some(conn) => {
                    if let Err(job) = conn.check(job) {
                        left.push(job);
                    }
                }
                None => left.push(job),
            }
        }
        left
    }
}
