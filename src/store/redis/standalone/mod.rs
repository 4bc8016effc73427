//! [`RedisStore`]: one Redis (or Valkey) server, through a few connections whose checks go in batches.

mod call;
mod checks;
mod connect;
mod pool;

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use ::redis::ConnectionInfo;
use futures_util::FutureExt;

use crate::ConfigError;
use crate::store::breaker::Breaker;
use crate::store::redis::access::Access;
use crate::store::redis::access::redact;
use crate::store::redis::connection::{Connection, Target};
use crate::store::redis::error::ConnectError;
use crate::store::redis::late_reply::Waiting;
use crate::store::redis::opening::Opening;
use crate::store::redis::probe::Probed;
use crate::store::redis::remote::{Parts, Remote, Sent, Transport, count_now, store_by_remote};
use crate::store::redis::script::{self, Mode, Prepared, Reply, Request, ServerForm};
use crate::store::redis::settings::{MAX_BATCH, Settings, settings_setters};
use crate::store::redis::{fleet, forget};
use crate::store::{Charge, StoreError};
use crate::throttle::Every;

/// The Redis store: every replica that connects to the same server shares the same budgets.
///
/// ```no_run
/// use std::time::Duration;
/// use tollgate::store::RedisStore;
/// use tollgate::{Quota, RateLimitLayer, Rule};
///
/// # fn run() -> Result<(), tollgate::ConfigError> {
/// let store = RedisStore::builder("redis://10.0.0.5:6379")
///     .prefix("shop")                                // keys: shop:{client}:rule
///     .response_timeout(Duration::from_millis(50))   // the budget of one check
///     .build()?;                                     // connects in the background
/// let layer = RateLimitLayer::builder().rule(Rule::new("api", Quota::per_minute(100))).store(store).build()?;
/// # Ok(())
/// # }
/// ```
///
/// [`build`](RedisStoreBuilder::build) does not wait for Redis: the store connects in the
/// background and keeps retrying (every 100 ms at first, then up to every 2 s), so a replica
/// starts and serves during a Redis outage. Until it has connected, checks fail at once and each
/// rule's [`FailureMode`](crate::FailureMode) decides. To refuse to start without Redis, use
/// [`connect`](RedisStoreBuilder::connect) instead.
///
/// Checks go to the first of the store's connections that keeps up (at most
/// [`pool_size`](RedisStoreBuilder::pool_size), default 2); each connection sends the checks
/// that queue while its call is out together, in one call. Each connection is driven by a task
/// on the Tokio runtime that opened it, which also times its checks out: keep that runtime
/// running while the store is used (a runtime that is dropped ends its connections, and the
/// store opens others; a current-thread runtime left idle outside `block_on` would leave the
/// checks sent through its connections waiting). A connection whose stream fails is replaced; one that runs out of time is kept
/// until nothing has come back on it for a while (three response timeouts, at least a second),
/// as one slow moment of a server times out every check in flight.
/// See [`store`](crate::store#redis-and-redis-cluster) for what a check does, the keys and their
/// values, and the failures. Clones share the pool.
///
/// # TLS and ACL users
///
/// With the feature `tls` (rustls and its ring provider: no system OpenSSL), a `rediss://` URL
/// connects over TLS: to ElastiCache with in-transit encryption, Azure Cache for Redis (port
/// 6380), Redis Cloud, or a server started with `tls-port`. The server's certificate is checked
/// against the system's roots, or against the CA certificates given to
/// `tls_ca` (feature `tls`), and must name the host of the URL;
/// `tls_client_cert` presents a client certificate to a
/// server that asks for one (`tls-auth-clients yes`). [`credentials`](RedisStoreBuilder::credentials)
/// signs in as an ACL user (a URL's `user:password@` works too, escaped).
///
/// ```no_run
/// # #[cfg(feature = "tls")]
/// # fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use tollgate::store::{RedisClusterStore, RedisStore};
///
/// let store = RedisStore::builder("rediss://redis.internal:6380")
///     .credentials("tollgate", std::env::var("REDIS_PASSWORD")?)
///     .tls_ca(std::fs::read("/etc/tollgate/redis-ca.pem")?)   // PEM; default: the system's roots
///     .build()?;
///
/// // The same settings for a cluster: every node it learns is reached over TLS.
/// let cluster = RedisClusterStore::builder(["rediss://cluster.internal:6379"])
///     .credentials("tollgate", std::env::var("REDIS_PASSWORD")?)
///     .tls_ca(std::fs::read("/etc/tollgate/redis-ca.pem")?)
///     .build()?;
/// # let _ = (store, cluster);
/// # Ok(())
/// # }
/// ```
///
/// The ACL user needs only these commands, on the keys of the store's prefix (the test suite
/// runs both stores as this user, over TLS):
///
/// ```text
/// ACL SETUSER tollgate on >PASSWORD ~tollgate:* resetchannels &tollgate:forget -@all
///     +time +get +mget +set +del +pexpire +type +rpush +lindex +linsert +llen +lrem +ltrim
///     +lrange +pttl
///     +evalsha +script|load
///     +ping +publish +subscribe
///     +zadd +zremrangebyscore +zcard
///     +cluster|slots +asking
/// ```
///
/// `~tollgate:*` and `&tollgate:forget` are the default prefix's: give yours. `+mget` reads the
/// keys of a batch at once (a user without it reads them one by one, and `ACL LOG` shows the
/// refused `MGET`). `+ping` checks each connection as it opens, and is the circuit breaker's
/// probe; `+publish +subscribe` on the channel `<prefix>:forget` tell the
/// other replicas of resets and refunds (their deny caches); `+zadd +zremrangebyscore +zcard`
/// on `<prefix>:replicas` are the heartbeat that counts the replicas
/// ([`heartbeat`](RedisStoreBuilder::heartbeat)). The last line is for a cluster
/// only. With
/// `+fcall +function|load` in place of `+evalsha +script|load`, a store runs its code as a
/// function library (Redis 7 and later, Valkey); a user that may not load functions gets the
/// script form, and `ACL LOG` shows the refused `FUNCTION LOAD`. A refused certificate fails
/// with an error that says which side refused it and what to give.
///
/// rustls asks for a process-wide crypto provider: building a TLS store installs ring's unless
/// the application installed one before (`rustls::crypto::CryptoProvider::install_default`).
#[derive(Clone)]
pub struct RedisStore {
    remote: Remote<Standalone>,
}

/// One server: the [`Transport`] of a [`RedisStore`].
pub(crate) struct Standalone {
    /// The store itself, for the tasks it starts.
    me: Weak<Standalone>,
    /// The server's address and credentials, for the listener of forgotten keys.
    info: ConnectionInfo,
    /// Where connections go, and how they sign in.
    target: Target,
    /// The URL without its password, to show.
    server: Arc<str>,
    pool_size: u32,
    /// The most checks in one call.
    max_batch: usize,
    /// Calls of checks out at once per connection.
    calls_per_connection: usize,
    /// Whether the server runs functions or scripts.
    form: Arc<ServerForm>,
    /// The open connections (at most `pool_size`).
    connections: Mutex<Vec<Connection>>,
    /// A connection is being opened in the background to fill the pool.
    filling: AtomicBool,
    /// When the background's last attempt to open one failed (microseconds after `origin`, plus
    /// one; 0: never).
    fill_failed_at: AtomicU64,
    /// When the store was built, on the runtime's clock: what `fill_failed_at` counts from.
    origin: tokio::time::Instant,
    /// When it last said so.
    fill_warned: Every,
    /// The connection being opened for checks (when the pool has none), if any.
    opening: Opening<Connection>,
    breaker: Breaker,
    /// Settings, the replica's denials and leases, rules, startup.
    parts: Parts,
}

/// Configures a [`RedisStore`].
#[must_use]
pub struct RedisStoreBuilder {
    url: String,
    pool_size: u32,
    max_batch: usize,
    settings: Settings,
    access: Access,
}

/// The most checks one call carries, by default.
pub const DEFAULT_MAX_BATCH: usize = 64;

/// Without batching, the most checks out at once per connection (each its own call).
const MAX_PIPELINED: usize = 4096;

/// Calls of checks out at once per connection, at most: a call leaves when none is out, and a
/// second only when half a batch of checks waits (so that Redis has the next one ready when it
/// answers one under a heavy load, while a lighter one's checks wait for the call out and go
/// together: fewer calls, fewer system calls per check; BENCHMARKS.md).
const CALLS_PER_CONNECTION: usize = 2;

impl RedisStore {
    /// Configures a store for the server at `url`: `redis://[user:password@]host:port[/db]`, or
    /// `rediss://` for TLS (feature `tls`; see [TLS and ACL users](#tls-and-acl-users)).
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder {
            url: url.into(),
            pool_size: 2,
            max_batch: DEFAULT_MAX_BATCH,
            settings: Settings::default(),
            access: Access::default(),
        }
    }

    /// A store with the defaults, connected to `url`: [`RedisStoreBuilder::connect`].
    pub async fn connect(url: impl Into<String>) -> Result<Self, ConnectError> {
        Self::builder(url).connect().await
    }

    /// Whether the store has reached Redis (and loaded its script) since it was built. It stays
    /// true during an outage: a health check wants [`is_reachable`](Self::is_reachable).
    pub fn is_connected(&self) -> bool {
        self.remote.transport().parts.startup.is_connected()
    }

    /// Whether the store can decide with Redis now: it has connected, its circuit breaker is
    /// closed, and no call failed in the last cooldown (at least a second). For a readiness check (`/healthz`); while it
    /// is false, requests are decided by each rule's [`FailureMode`](crate::FailureMode).
    ///
    /// ```no_run
    /// # fn run() -> Result<(), tollgate::ConfigError> {
    /// use axum::{Router, http::StatusCode, routing::get};
    /// use tollgate::store::RedisStore;
    ///
    /// let store = RedisStore::builder("redis://127.0.0.1:6379").build()?;
    /// let health = store.clone();
    /// let app: Router = Router::new().route(
    ///     "/healthz",
    ///     get(move || async move {
    ///         if health.is_reachable() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }
    ///     }),
    /// );
    /// # Ok(())
    /// # }
    /// ```
    pub fn is_reachable(&self) -> bool {
        self.remote.transport().parts.startup.is_connected()
            && !self.remote.transport().breaker.is_failing()
    }

    /// The Lua source of the script form of the code (with the server's `TIME` as its clock),
    /// which servers without functions run, for operators who preload scripts (`SCRIPT LOAD`)
    /// or benchmark them. Its check documents its arguments and its answer.
    pub fn script_source() -> &'static str {
        script::SERVER_CLOCK.script_source()
    }

    /// The function library of the code (Redis 7 and later: `FUNCTION LOAD`), and the name of
    /// its function (`FCALL`). The stores load it themselves; see
    /// [`store`](crate::store#one-atomic-step-per-request).
    pub fn function_library() -> (&'static str, &'static str) {
        let program = &*script::SERVER_CLOCK;
        (program.library_source(), program.function_name())
    }
}

impl RedisStoreBuilder {
    settings_setters!();

    /// The most connections (default 2). Checks go to the first connection that keeps up (its
    /// queue holds less than a batch), so that they go together in as few calls as keep up;
    /// the others take the overflow of a load one connection cannot carry (many client
    /// threads), and stand ready when one breaks.
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = size;
        self
    }

    /// The most checks sent to Redis in one call (default [`DEFAULT_MAX_BATCH`]; 1 sends each
    /// check alone, pipelined). A connection sends a call when none of its calls is out; while
    /// one is, the checks that arrive go together in the next (a second call leaves early only
    /// when half a batch waits), each still all or nothing by itself: a busy server gets fewer,
    /// larger calls and an idle one gets each check at once, with no timer.
    pub fn max_batch(mut self, checks: usize) -> Self {
        self.max_batch = checks;
        self
    }

    /// Builds the store without waiting for Redis: it connects in the background, and until it
    /// has, checks fail at once (each rule's [`FailureMode`](crate::FailureMode) decides).
    /// Fails only when the configuration is wrong.
    pub fn build(self) -> Result<RedisStore, ConfigError> {
        self.settings.validate()?;
        if self.pool_size == 0 {
            return Err(ConfigError::new(
                "Redis store: pool_size is 0; use at least 1",
            ));
        }
        if self.max_batch == 0 || self.max_batch > MAX_BATCH {
            return Err(ConfigError::new(format!(
                "Redis store: max_batch is {}; use 1 (no batching) to {MAX_BATCH}",
                self.max_batch
            )));
        }
        let server: Arc<str> = self.access.shown(&self.url).into();
        let info = self.access.connection_info("Redis store", &self.url)?;
        let target = self.access.target(&info)?;
        #[cfg(test)]
        let target = target.through(self.settings.network());
        let breaker = Breaker::new(self.settings.breaker, "redis", server.clone());
        let transport = Arc::new_cyclic(|me| Standalone {
            me: me.clone(),
            info,
            target,
            server,
            pool_size: self.pool_size,
            max_batch: self.max_batch,
            // A few calls out per connection; without batching, every check is its own call,
            // pipelined on the connections.
            calls_per_connection: if self.max_batch == 1 {
                MAX_PIPELINED
            } else {
                CALLS_PER_CONNECTION
            },
            form: Arc::default(),
            connections: Mutex::new(Vec::new()),
            filling: AtomicBool::new(false),
            fill_failed_at: AtomicU64::new(0),
            origin: tokio::time::Instant::now(),
            fill_warned: Every::default(),
            breaker,
            parts: Parts::new(self.settings),
            opening: Opening::default(),
        });
        let remote = Remote::started(transport);
        Ok(RedisStore { remote })
    }

    /// Builds the store and waits until it has connected and loaded its script, at most the
    /// connect timeout, then counts the fleet once (with a heartbeat, so that the local
    /// fallback has a count from the start): for services that must not start without Redis. The error names the
    /// server (without its password).
    pub async fn connect(self) -> Result<RedisStore, ConnectError> {
        let store = self.build()?;
        let server = store.remote.transport();
        let budget = server.parts.settings.connect_timeout;
        server
            .parts
            .connected_within(budget, &server.server)
            .await?;
        count_now(server).await;
        Ok(store)
    }
}

store_by_remote!(RedisStore);

impl Transport for Standalone {
    /// Starts the background connection until it has connected, if there is a runtime to run
    /// it (again, if the runtime that ran it went away).
    fn start(self: &Arc<Self>) {
        if !self.parts.startup.is_connected() {
            let weak = Arc::downgrade(self);
            self.parts
                .startup
                .spawn(|running| Standalone::connect_in_background(weak, running));
        }
    }

    /// The answer of a check that cannot be sent now: not connected yet, or the breaker open.
    fn unsendable(&self) -> Option<StoreError> {
        if !self.parts.startup.is_connected() {
            return Some(self.parts.startup.not_connected(&self.server));
        }
        self.breaker.is_open().then_some(StoreError::CircuitOpen)
    }

    fn refusal(self: &Arc<Self>, charges: &[Charge<'_>]) -> Option<StoreError> {
        // A split key's sub-key is chosen when the check is planned: its cached denial answers
        // there, Redis asked or not.
        if charges.iter().any(|c| c.rule.parts() > 1) {
            return None;
        }
        self.start();
        self.unsendable()
    }

    fn runs_alone(&self, _prepared: &[Prepared]) -> bool {
        // A batch that takes concurrency slots waits for its reply itself.
        false
    }

    fn send(self: &Arc<Self>, waiting: Waiting, now: Option<u64>, _alone: bool) -> Sent {
        self.queue(waiting, now)
    }

    async fn peek(
        self: Arc<Self>,
        prepared: Vec<Prepared>,
        now: Option<u64>,
    ) -> Result<Reply, StoreError> {
        let value = self.direct(Mode::Peek, now, &prepared).await?;
        let requests = [Request {
            now,
            charges: &prepared[..],
        }];
        script::decode(value, &requests)?
            .pop()
            .ok_or_else(|| StoreError::Protocol("no reply to a peek".into()))
    }

    fn call(
        self: Arc<Self>,
        mode: Mode,
        now: Option<u64>,
        charges: Vec<Prepared>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        // The call's answer (a value) says nothing more.
        async move { self.direct(mode, now, &charges).await }.map(|answer| answer.map(drop))
    }

    async fn publish(self: Arc<Self>, names: Vec<String>) -> Result<(), StoreError> {
        if let Some(error) = self.unsendable() {
            return Err(error);
        }
        let (channel, budget) = (&self.parts.channel, self.parts.settings.response_timeout);
        forget::publish_within(self.connection(), &self.server, channel, &names, budget).await
    }

    async fn beat(self: Arc<Self>) -> Result<u64, StoreError> {
        if let Some(error) = self.unsendable() {
            return Err(error);
        }
        let budget = self.parts.settings.response_timeout;
        fleet::beat_within(self.connection(), &self.server, &self.parts.fleet, budget).await
    }

    fn parts(&self) -> &Parts {
        &self.parts
    }

    const KIND: &'static str = "redis";
}

impl Probed for Standalone {
    fn breaker(&self) -> &Breaker {
        &self.breaker
    }

    fn probe_timeout(&self) -> Duration {
        self.parts.settings.response_timeout
    }

    async fn probe_connection(self: Arc<Self>) -> Result<Connection, StoreError> {
        self.connection().await
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let server = self.remote.transport();
        let more: [(&str, &dyn fmt::Debug); 1] = [("pool_size", &server.pool_size)];
        server
            .parts
            .fmt_store(f, "RedisStore", ("server", &server.server), &more)
    }
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStoreBuilder")
            .field("server", &redact(&self.url))
            .field("prefix", &self.settings.prefix)
            .field("pool_size", &self.pool_size)
            .field("access", &self.access)
            .finish_non_exhaustive()
    }
}
