//! [`RedisStore`]: one Redis (or Valkey) server, through a bb8 pool of multiplexed connections.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use ::redis::aio::MultiplexedConnection;
use ::redis::{AsyncConnectionConfig, Client, ConnectionInfo, RedisError, RedisResult, Value};
use futures_util::FutureExt;

use crate::ConfigError;
use crate::clock::unix_micros;
use crate::store::breaker::{Breaker, Permit};
use crate::store::redis::access::{self, Access};
use crate::store::redis::batch::{Batcher, Turn};
use crate::store::redis::error::{
    AtServer, ConnectError, breaks_connection, is_demoted, is_server_answer, store_error,
};
use crate::store::redis::forget;
use crate::store::redis::health::{self, Health};
use crate::store::redis::opening::{Done, Opening};
use crate::store::redis::probe::{self, Probed};
use crate::store::redis::remote::{self, Answer, Parts, Remote, Transport, store_by_remote};
use crate::store::redis::script::{self, Mode, Prepared, Reply, Request, ServerForm};
use crate::store::redis::startup::{FIRST_RETRY_DELAY, MAX_RETRY_DELAY, Running};
use crate::store::redis::{MAX_BATCH, Settings, late_reply_wait, redact};
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
/// A check borrows a pooled connection only to clone its handle: every connection pipelines any
/// number of concurrent checks ([`pool_size`](RedisStoreBuilder::pool_size), default 2). A
/// connection whose stream fails is replaced; one that runs out of time is kept until it has
/// done so three times in a row, as one slow moment of a server times out every check in flight.
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
///     +time +get +set +del +pexpire +type +rpush +lindex +linsert +llen +lrem +ltrim
///     +lrange +pttl
///     +evalsha +script|load
///     +ping +publish +subscribe
///     +cluster|slots +asking
/// ```
///
/// `~tollgate:*` and `&tollgate:forget` are the default prefix's: give yours. `+ping` is the
/// circuit breaker's probe; `+publish +subscribe` on the channel `<prefix>:forget` tell the
/// other replicas of resets and refunds (their deny caches). The last line is for a cluster
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
    /// The server's address, credentials and TLS settings, to connect.
    info: ConnectionInfo,
    /// The URL without its password, to show.
    server: Arc<str>,
    pool_size: u32,
    /// Whether the server runs functions or scripts.
    form: ServerForm,
    /// Checks waiting to go out together.
    batcher: Arc<Batcher<Job>>,
    /// Made by the background task (bb8 needs a runtime).
    pool: OnceLock<bb8::Pool<Manager>>,
    /// Whether the pool has had a connection: an empty pool then means they broke.
    pool_filled: AtomicBool,
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

/// Without batching, the most checks out at once (each its own call).
const MAX_PIPELINED: usize = 4096;

/// Batches out at once per connection: enough that Redis has the next one when it answers one
/// (with one, it waits for the client a quarter of the time), few enough that checks wait to go
/// together (BENCHMARKS.md: 4 in all did best at 64 concurrent checks, fewer for an HTTP server
/// whose own thread is the busiest).
const CALLS_PER_CONNECTION: usize = 2;

/// One check waiting for its batch.
struct Job {
    charges: Vec<Prepared>,
    now: Option<u64>,
    permit: Permit,
    /// When its caller stops waiting: it is not sent after that, and its call ends by then.
    deadline: tokio::time::Instant,
    answer: Answer,
}

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

    /// The number of connections (default 2). Each connection pipelines any number of concurrent
    /// checks; more connections spread the work over more client threads.
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = size;
        self
    }

    /// The most checks sent to Redis in one call (default [`DEFAULT_MAX_BATCH`]; 1 sends each
    /// check alone, pipelined). Two calls per connection are out at a time: checks that
    /// arrive meanwhile go together in the next, each still all or nothing by itself, so a busy
    /// server gets fewer, larger calls and an idle one gets each check at once, with no timer.
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
        let breaker = Breaker::new(self.settings.breaker, "redis", server.clone());
        let transport = Arc::new_cyclic(|me| Standalone {
            me: me.clone(),
            info,
            server,
            pool_size: self.pool_size,
            form: ServerForm::default(),
            batcher: Arc::new(Batcher::new(
                // A few batches out per connection; without batching, every check is its
                // own call, pipelined on the connections.
                if self.max_batch == 1 {
                    MAX_PIPELINED
                } else {
                    CALLS_PER_CONNECTION * self.pool_size as usize
                },
                self.max_batch,
            )),
            breaker,
            parts: Parts::new(self.settings),
            pool: OnceLock::new(),
            opening: Opening::default(),
            pool_filled: AtomicBool::new(false),
        });
        let remote = Remote::started(transport);
        Ok(RedisStore { remote })
    }

    /// Builds the store and waits until it has connected and loaded its script, at most the
    /// connect timeout: for services that must not start without Redis. The error names the
    /// server (without its password).
    pub async fn connect(self) -> Result<RedisStore, ConnectError> {
        let store = self.build()?;
        let server = store.remote.transport();
        let budget = server.parts.settings.connect_timeout;
        server
            .parts
            .connected_within(budget, &server.server)
            .await?;
        Ok(store)
    }
}

impl Standalone {
    fn manager(&self) -> Result<Manager, StoreError> {
        Manager::new(
            self.info.clone(),
            self.parts.settings.connect_timeout,
            self.parts.settings.response_timeout,
        )
        .map_err(|e| store_error(&self.server, e))
    }

    /// The pool, made once the store has connected (bb8 needs a runtime).
    fn pool(&self) -> Result<&bb8::Pool<Manager>, StoreError> {
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

    /// One attempt to reach Redis and load the script, within the connect timeout: on a
    /// connection of its own, so that its error says why (the pool's only say they timed out).
    async fn connect_once(&self) -> Result<(), StoreError> {
        let attempt = async {
            let manager = self.manager()?;
            let mut pooled = bb8::ManageConnection::connect(&manager)
                .await
                .map_err(|e| access::connect_error(&self.server, e))?;
            let form = self
                .parts
                .program
                .load(&mut pooled.conn)
                .await
                .map_err(|e| store_error(&self.server, e))?;
            self.form.set(form);
            self.pool().map(drop)
        };
        tokio::time::timeout(self.parts.settings.connect_timeout, attempt)
            .await
            .unwrap_or(Err(StoreError::Timeout))
    }

    /// A connection of the pool, as a handle of its own: the pool entry goes back at once, so
    /// that each connection pipelines every check that picks it. Broken connections are dropped
    /// (the pool opens new ones). When none is open any more, the check opens one itself: a
    /// server that refuses it is an answer at once, where waiting for the pool would cost the
    /// whole budget.
    async fn connection(&self) -> Result<(MultiplexedConnection, Arc<Health>), StoreError> {
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
    async fn open(
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

    /// Sends `requests` in one call within the time budget of a check, and tells the
    /// connection's health and the breaker how it went.
    async fn run(
        &self,
        mode: Mode,
        requests: &[Request<'_, Prepared>],
        permit: Permit,
        deadline: tokio::time::Instant,
    ) -> Result<Value, StoreError> {
        self.run_until(mode, requests, permit, deadline, deadline)
            .await
    }

    /// [`run`](Self::run), waiting for the answer until `late`: one that comes after `budget`
    /// is returned, and told to the breaker and the connection's health as a time-out (the
    /// server did not answer within a check's budget).
    async fn run_until(
        &self,
        mode: Mode,
        requests: &[Request<'_, Prepared>],
        permit: Permit,
        budget: tokio::time::Instant,
        deadline: tokio::time::Instant,
    ) -> Result<Value, StoreError> {
        // One timer for the whole check; `in_use` tells which connection a time-out caught.
        let mut in_use = None;
        let attempt = async {
            let (mut conn, health) = self.connection().await?;
            in_use = Some(health.clone());
            let result = self
                .parts
                .program
                .call(&mut conn, &self.form, mode, requests)
                .await;
            let answered = match &result {
                Err(e) if e.is_timeout() => {
                    health.timed_out();
                    false
                }
                Err(e) if breaks_connection(e) => {
                    health.broke();
                    false
                }
                Ok(_) => true,
                Err(e) if is_demoted(e) => {
                    // The server became a replica (a failover behind a DNS name or a proxy):
                    // a new connection finds the primary.
                    health.broke();
                    true
                }
                Err(e) => is_server_answer(e),
            };
            if answered {
                health.answered();
            }
            Ok((result.map_err(|e| store_error(&self.server, e)), answered))
        };
        let result = tokio::time::timeout_at(deadline, attempt).await;
        let (result, answered) = match result {
            Ok(Ok(sent)) => sent,
            Ok(Err(error)) => (Err(error), false),
            Err(_elapsed) => {
                if let Some(health) = &in_use {
                    health.timed_out();
                }
                (Err(StoreError::Timeout), false)
            }
        };
        if deadline > budget && tokio::time::Instant::now() > budget {
            // Answered late: for the breaker, a time-out, whatever the answer.
            if answered && let Some(health) = &in_use {
                health.timed_out();
            }
            self.report(permit, false, &Err(StoreError::Timeout));
        } else {
            self.report(permit, answered, &result);
        }
        result
    }

    /// Tells the breaker how a check went (a server that answered, even with an error, is up),
    /// and says so when it opens.
    fn report(&self, permit: Permit, answered: bool, result: &Result<Value, StoreError>) {
        let Err(error) = result else {
            return self.breaker.success(permit);
        };
        if answered {
            self.breaker.success(permit);
        } else if self.breaker.failure(permit) {
            tracing::error!(
                server = &*self.server,
                %error,
                "tollgate: Redis keeps failing; its circuit breaker opened: requests are \
                 decided by each rule's FailureMode until a probe succeeds"
            );
            self.probe_in_background();
        }
    }

    /// Probes the server once per cooldown while the breaker is open (see [`probe`]).
    fn probe_in_background(&self) {
        if let Some(me) = self.me.upgrade() {
            probe::in_background(&me, u32::MAX);
        }
    }
}

/// The background task: connects and loads the script, retrying until it succeeds or the store
/// is dropped.
async fn connect_in_background(store: Weak<Standalone>, _running: Running) {
    let mut delay = FIRST_RETRY_DELAY;
    loop {
        let Some(inner) = store.upgrade() else {
            return;
        };
        match inner.connect_once().await {
            Ok(()) => {
                inner.parts.startup.connected();
                tracing::info!(server = &*inner.server, "tollgate: connected to Redis");
                if let Ok(manager) = inner.manager() {
                    inner.parts.listen(vec![manager.client]);
                }
                return;
            }
            Err(error) => {
                if inner.parts.connect_failed(&error) {
                    tracing::warn!(
                        server = &*inner.server,
                        %error,
                        "tollgate: cannot reach Redis; retrying in the background, and until it \
                         answers each rule's FailureMode decides"
                    );
                }
            }
        }
        drop(inner);
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(MAX_RETRY_DELAY);
    }
}

/// A connection, and its health.
type Connection = (MultiplexedConnection, Arc<Health>);

/// Opens a connection for the checks waiting (see `Standalone::open`), gives it to the pool (a full
/// pool lets it go with its last check), and tells them.
async fn open_for_checks(store: Weak<Standalone>, done: Done<Connection>) {
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
struct LogConnectErrors {
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

impl Standalone {
    /// Decides one check: queued for the next call to Redis (sent at once when no call is
    /// out), within the check's time budget. Polled on a Tokio runtime.
    async fn batched(
        self: &Arc<Self>,
        charges: Vec<Prepared>,
        now: Option<u64>,
        permit: Permit,
    ) -> Result<Reply, StoreError> {
        let (answer, answered) = remote::channel(now);
        let deadline = tokio::time::Instant::now() + self.parts.settings.response_timeout;
        let job = Job {
            charges,
            now,
            permit,
            deadline,
            answer,
        };
        if let Some((batch, turn)) = self.batcher.push(job) {
            // Sent from a task of its own, so that a client that goes away cancels no one
            // else's check of the batch.
            drop(tokio::spawn(send_batches(self.clone(), batch, turn)));
        }
        remote::wait(answered, deadline, || {
            StoreError::Unavailable(
                format!("{}: the check was dropped before it was sent", self.server).into(),
            )
        })
        .await
    }

    /// One call for `batch`, within the time its earliest check has left; each check gets its
    /// own reply, or the call's error. A call that takes concurrency slots waits a while longer
    /// for its reply than its checks do (on its own, so that the next batch need not wait), and
    /// a reply whose check stopped waiting gives those slots back.
    async fn send(self: &Arc<Self>, batch: Vec<Job>) {
        let Some(budget) = batch.iter().map(|job| job.deadline).min() else {
            return;
        };
        let late = if batch
            .iter()
            .any(|job| job.charges.iter().any(|c| c.algorithm.is_concurrency()))
        {
            budget.max(
                tokio::time::Instant::now() + late_reply_wait(self.parts.settings.response_timeout),
            )
        } else {
            budget
        };
        let call = Self::call_batch(self.clone(), batch, budget, late);
        if late == budget {
            return call.await;
        }
        let mut call = Box::pin(call);
        if tokio::time::timeout_at(budget, &mut call).await.is_err() {
            // The next batch goes on; this call's replies, or its slots, come back later (a
            // batch is sent by a task of its own, on the runtime).
            drop(tokio::spawn(call));
        }
    }

    /// [`send`](Self::send)'s call: the answer is waited for until `late`, and reported to the
    /// breaker as a time-out when it comes after `budget`.
    async fn call_batch(
        self: Arc<Self>,
        batch: Vec<Job>,
        budget: tokio::time::Instant,
        late: tokio::time::Instant,
    ) {
        let Some(permit) = batch.last().map(|job| job.permit) else {
            return;
        };
        let requests: Vec<Request<'_, Prepared>> = batch
            .iter()
            .map(|job| Request {
                now: job.now,
                charges: &job.charges,
            })
            .collect();
        let result = self
            .run_until(Mode::Charge, &requests, permit, budget, late)
            .await
            .and_then(|value| script::decode(value, &requests));
        drop(requests);
        match result {
            Ok(replies) => {
                for (job, reply) in batch.into_iter().zip(replies) {
                    job.answer.send(&self, Ok(reply), job.charges);
                }
            }
            Err(error) => {
                for job in batch {
                    job.answer.send(&self, Err(error.duplicate()), job.charges);
                }
            }
        }
    }
}

impl Standalone {
    /// One call of `charges` outside the batches (peeks, adjustments, resets), within a
    /// check's time budget.
    async fn direct(
        self: &Arc<Self>,
        mode: Mode,
        now: Option<u64>,
        charges: &[Prepared],
    ) -> Result<Value, StoreError> {
        self.start();
        if let Some(error) = self.unsendable() {
            return Err(error);
        }
        let Some(permit) = self.breaker.admit() else {
            return Err(StoreError::CircuitOpen);
        };
        let requests = [Request { now, charges }];
        let deadline = tokio::time::Instant::now() + self.parts.settings.response_timeout;
        self.run(mode, &requests, permit, deadline).await
    }
}

/// Sends `batch`, then whatever queued meanwhile, until the queue is empty. A check whose caller
/// went away (its client left) or has no time left is not sent.
async fn send_batches(inner: Arc<Standalone>, mut batch: Vec<Job>, mut turn: Turn<Job>) {
    loop {
        let now = tokio::time::Instant::now();
        batch.retain(|job| !job.answer.is_closed() && job.deadline > now);
        if !batch.is_empty() {
            inner.send(batch).await;
        }
        match turn.next() {
            Some(next) => batch = next,
            None => return,
        }
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
                .spawn(|running| connect_in_background(weak, running));
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

    async fn decide(
        self: Arc<Self>,
        prepared: Vec<Prepared>,
        now: Option<u64>,
    ) -> Result<Reply, StoreError> {
        let permit = self.breaker.admit().ok_or(StoreError::CircuitOpen)?;
        self.batched(prepared, now, permit).await
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

    async fn probe_connection(
        self: Arc<Self>,
    ) -> Result<(MultiplexedConnection, Arc<Health>), StoreError> {
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

/// The pool's connections: multiplexed, RESP3, each with the health the store reads, marked
/// broken when the connection fails or the server closes it (instead of a `PING` on every
/// check-out).
struct Manager {
    client: Client,
    config: AsyncConnectionConfig,
    response_timeout: Duration,
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

struct Pooled {
    conn: MultiplexedConnection,
    health: Arc<Health>,
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
