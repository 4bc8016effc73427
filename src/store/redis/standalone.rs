//! [`RedisStore`]: one Redis (or Valkey) server, through a bb8 pool of multiplexed connections.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ::redis::aio::MultiplexedConnection;
use ::redis::{Cmd, RedisError, RedisResult, Value};
use bb8_redis::RedisConnectionManager;

use super::error::{BuildError, breaks_connection, store_error};
use super::script::{self, Mode, Prepared, Script};
use super::{CheckFuture, Settings, keys, within};
use crate::clock::Clock;
use crate::decision::Decision;
use crate::key::Key;
use crate::policy::ConfigError;
use crate::store::{Charge, Store, StoreError};

/// The default number of connections of a [`RedisStore`].
pub const DEFAULT_POOL_SIZE: u32 = 2;

/// The Redis store: every replica that connects to the same server shares the same budgets.
///
/// ```no_run
/// use tollgate::store::RedisStore;
///
/// # async fn run() -> Result<(), tollgate::store::redis::BuildError> {
/// let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
/// # let _ = store;
/// # Ok(())
/// # }
/// ```
///
/// See the [module documentation](super) for what a check does, the keys and their values, and
/// the failures. Clones share the pool.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: bb8::Pool<Manager>,
    pool_size: u32,
    settings: Settings,
    script: Script,
}

/// Configures a [`RedisStore`].
#[must_use]
pub struct RedisStoreBuilder {
    url: String,
    pool_size: u32,
    settings: Settings,
}

impl RedisStore {
    /// Configures a store for the server at `url` (`redis://[user:password@]host:port[/db]`, or
    /// `rediss://` for TLS when redis-rs is built with a TLS feature).
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder {
            url: url.into(),
            pool_size: DEFAULT_POOL_SIZE,
            settings: Settings::default(),
        }
    }

    /// A store with the defaults, connected to `url`.
    pub async fn connect(url: impl Into<String>) -> Result<Self, BuildError> {
        Self::builder(url).build().await
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

impl RedisStoreBuilder {
    settings_setters!();

    /// The number of connections (default 2). Each connection pipelines any number of concurrent
    /// checks; more connections spread the work over more client threads.
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = size;
        self
    }

    /// Connects (all `pool_size` connections) and loads the script. Fails when the configuration
    /// is wrong or the server cannot be reached.
    pub async fn build(self) -> Result<RedisStore, BuildError> {
        self.settings.validate()?;
        if self.pool_size == 0 {
            return Err(ConfigError::new("Redis store: pool_size is 0; use at least 1").into());
        }
        let manager = RedisConnectionManager::new(self.url.as_str()).map_err(|e| {
            ConfigError::new(format!(
                "the Redis URL is not valid ({e}); use redis://host:port or redis://host:port/db"
            ))
        })?;
        let manager = Manager {
            inner: manager,
            connect_timeout: self.settings.connect_timeout,
            response_timeout: self.settings.response_timeout,
        };
        let pool = bb8::Pool::builder()
            .max_size(self.pool_size)
            .min_idle(self.pool_size)
            .test_on_check_out(false)
            .retry_connection(false)
            .connection_timeout(self.settings.connect_timeout)
            .build(manager)
            .await
            .map_err(|e| BuildError::Store(store_error(e)))?;
        let script = self.settings.script();
        let inner = Inner {
            pool,
            pool_size: self.pool_size,
            script,
            settings: self.settings,
        };
        let load = async {
            let (mut conn, _) = inner.connection().await?;
            inner
                .script
                .load_command()
                .query_async::<Value>(&mut conn)
                .await
                .map_err(store_error)
        };
        within(inner.settings.connect_timeout, load).await?;
        Ok(RedisStore {
            inner: Arc::new(inner),
        })
    }
}

impl Inner {
    /// A connection of the pool, as a handle of its own: the pool entry goes back at once, so
    /// that each connection pipelines every check that picks it. Broken connections are dropped
    /// (the pool opens new ones).
    async fn connection(&self) -> Result<(MultiplexedConnection, Arc<AtomicBool>), StoreError> {
        for _ in 0..=self.pool_size {
            let pooled = self.pool.get().await.map_err(|e| match e {
                bb8::RunError::User(e) => store_error(e),
                bb8::RunError::TimedOut => StoreError::Timeout,
            })?;
            if !pooled.broken.load(Ordering::Relaxed) {
                return Ok((pooled.conn.clone(), pooled.broken.clone()));
            }
        }
        Err(StoreError::Unavailable(
            "every Redis connection of the pool is broken".into(),
        ))
    }

    /// Runs `cmd` within the check's time budget. A connection that fails, or that does not
    /// answer in time, is marked broken so that the pool replaces it: a connection whose peer
    /// vanished without a reset (a cut link, a dead proxy) would otherwise time out forever.
    async fn run(&self, cmd: &Cmd) -> Result<Value, StoreError> {
        // One timer for the whole check; `in_use` tells which connection a timeout caught.
        let mut in_use = None;
        let attempt = async {
            let (mut conn, broken) = self.connection().await?;
            in_use = Some(broken.clone());
            eval(&mut conn, &self.script, cmd).await.map_err(|e| {
                if breaks_connection(&e) || e.is_timeout() {
                    broken.store(true, Ordering::Relaxed);
                }
                store_error(e)
            })
        };
        let result = tokio::time::timeout(self.settings.response_timeout, attempt).await;
        result.unwrap_or_else(|_elapsed| {
            if let Some(broken) = in_use {
                broken.store(true, Ordering::Relaxed);
            }
            Err(StoreError::Timeout)
        })
    }
}

/// `EVALSHA`; on `NOSCRIPT`, `SCRIPT LOAD` and once more.
async fn eval(conn: &mut MultiplexedConnection, script: &Script, cmd: &Cmd) -> RedisResult<Value> {
    match cmd.query_async::<Value>(conn).await {
        Err(e) if script::is_no_script(&e) => {
            script.load_command().query_async::<Value>(conn).await?;
            cmd.query_async(conn).await
        }
        result => result,
    }
}

impl Store for RedisStore {
    type Future = CheckFuture;

    fn check(&self, charges: &[Charge<'_>]) -> CheckFuture {
        let inner = self.inner.clone();
        let prepared: Vec<Prepared> = charges
            .iter()
            .map(|c| Prepared::new(&inner.settings.prefix, c))
            .collect();
        let now = inner.settings.now();
        Box::pin(async move {
            if prepared.is_empty() {
                return Ok(Decision::default());
            }
            let cmd = script::command(&inner.script, Mode::Charge, now, prepared.iter());
            let value = inner.run(&cmd).await?;
            let reply = script::decode(value, prepared.iter())?;
            Ok(script::decision(reply.outcomes))
        })
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.inner.settings.prefix)
            .field("pool_size", &self.inner.pool_size)
            .field("response_timeout", &self.inner.settings.response_timeout)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStoreBuilder")
            .field("prefix", &self.settings.prefix)
            .field("pool_size", &self.pool_size)
            .finish_non_exhaustive()
    }
}

/// bb8-redis' manager, with a connect timeout, a response timeout, and connections that the
/// store marks broken when they fail (instead of a `PING` on every check-out).
struct Manager {
    inner: RedisConnectionManager,
    connect_timeout: Duration,
    response_timeout: Duration,
}

struct Pooled {
    conn: MultiplexedConnection,
    broken: Arc<AtomicBool>,
}

impl bb8::ManageConnection for Manager {
    type Connection = Pooled;
    type Error = RedisError;

    async fn connect(&self) -> Result<Pooled, RedisError> {
        let connect = tokio::time::timeout(self.connect_timeout, self.inner.connect());
        let mut conn = connect.await.map_err(|_| {
            RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "connecting to Redis timed out",
            ))
        })??;
        conn.set_response_timeout(self.response_timeout);
        Ok(Pooled {
            conn,
            broken: Arc::default(),
        })
    }

    async fn is_valid(&self, conn: &mut Pooled) -> Result<(), RedisError> {
        self.inner.is_valid(&mut conn.conn).await
    }

    fn has_broken(&self, conn: &mut Pooled) -> bool {
        conn.broken.load(Ordering::Relaxed)
    }
}
