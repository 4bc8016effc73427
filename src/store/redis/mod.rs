//! Fleet-wide limits: the Redis and Redis Cluster stores.
//!
//! ```no_run
//! use std::net::SocketAddr;
//! use std::time::Duration;
//! use axum::{Router, routing::get};
//! use tollgate::store::RedisStore;
//! use tollgate::{Algorithm, Quota, RateLimitLayer, Rule};
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Every replica connects to the same Redis: "100 per minute" means 100 per minute in total.
//! let store = RedisStore::builder("redis://127.0.0.1:6379")
//!     .prefix("shop")                            // keys are shop:{client}:rule
//!     .response_timeout(Duration::from_millis(50)) // the budget of one check
//!     .build()
//!     .await?;                                   // connects and loads the script: fails fast
//! let layer = RateLimitLayer::builder()
//!     .rule(Rule::new("burst", Quota::per_second(10).burst(20)))
//!     .rule(Rule::new("hourly", Quota::per_hour(1000)).algorithm(Algorithm::SlidingWindowCounter))
//!     .store(store)
//!     .build()?;
//! let app = Router::new().route("/", get(|| async { "hello" })).layer(layer);
//!
//! let listener = tokio::net::TcpListener::bind("0.0.0.0:3000").await?;
//! axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
//! # Ok(())
//! # }
//! ```
//!
//! For a Redis Cluster, use [`RedisClusterStore::builder`] with the URLs of some of its nodes
//! instead; everything else is the same. Valkey works as Redis does (Redis 6.2 or newer, or any
//! Valkey).
//!
//! # One atomic step per request
//!
//! A check is one `EVALSHA` of one Lua script that reads the server's `TIME` once, checks every
//! rule of the request and, only when all of them admit it, charges them all. Nothing can run
//! between the read and the write, so concurrent requests from any number of replicas are counted
//! exactly, and a request denied by one rule is charged to none. The script mirrors the reference
//! model of [`algorithm`](crate::algorithm) decision for decision (a differential test holds them
//! together). When the server lost the script (restart, failover, `SCRIPT FLUSH`), the store loads
//! it again and retries, unseen by the caller.
//!
//! # Keys and values
//!
//! Each rule of each caller is one key, `prefix:{identity}:rule`: the identity (the sanitized
//! text of a [`Key`](crate::key::Key)) is the Redis Cluster hash tag, so all rules of one caller
//! live in one slot and one script can check them all. The prefix (default `tollgate`) lets
//! several applications or regions share one Redis. Every key expires when its budget is full
//! again (`PEXPIRE`, rounded up to the millisecond), and a key whose state is the same as no state
//! is deleted: memory follows active callers. Values are compact:
//!
//! | algorithm | value |
//! |---|---|
//! | token bucket | one integer: minus the time the bucket is full again |
//! | GCRA | one integer: the theoretical arrival time |
//! | fixed window | `start:count` |
//! | sliding window counter | `start:previous:current` |
//! | sliding window log | a list of at most `limit` times (one per admitted unit) |
//!
//! A rule whose algorithm changed finds the old value unreadable and starts from no state, as the
//! model does. A token-bucket value holds the bucket as the model would have it at any time not
//! before its last charge; if the server's clock steps back, the tokens refilled since are not
//! counted until the clock catches up (the bucket is, briefly, stricter than the model).
//!
//! # Cluster: rules of different callers
//!
//! When the rules of one request count different identities (a per-client rule and a
//! [`Global`](crate::key::Global) one), their keys can live in different slots, where no script
//! can reach them together. [`RedisClusterStore`] then groups the charges by slot and:
//!
//! 1. checks every group without charging (in parallel); if any rule denies, the request is denied
//!    and **nothing is charged**, as on one node;
//! 2. otherwise charges every group (in parallel), each group atomically;
//! 3. if a group now denies (another request took the last units between steps 1 and 2), the
//!    groups already charged are refunded, and the request is denied.
//!
//! So a denied request never keeps a charge, except when the check fails or times out between
//! steps 2 and 3: then the charges made stay until their keys expire. Requests whose rules all
//! count the same identity (or identities that hash to one slot) take the one-script path. The
//! standalone [`RedisStore`] always runs one script for all keys.
//!
//! # Failures and time
//!
//! Each check has a strict budget, [`response_timeout`](RedisStoreBuilder::response_timeout)
//! (default 100 ms): past it the check ends with [`StoreError::Timeout`](crate::store::StoreError)
//! (the script may still have run on the server). A refused or dropped connection, a cluster that
//! is down or a read-only replica give [`StoreError::Unavailable`](crate::store::StoreError).
//! Errors are told apart by their kind, never by their text. The layer's
//! [`FailureMode`](crate::FailureMode) decides what a request gets then.
//!
//! # Connections
//!
//! [`RedisStore`] keeps a [bb8](https://docs.rs/bb8) pool of multiplexed connections
//! ([`pool_size`](RedisStoreBuilder::pool_size), default 2): a check borrows a connection only to
//! clone its handle, so every connection pipelines any number of concurrent checks, and the pool
//! replaces a connection that broke (without a `PING` per check). [`RedisClusterStore`] uses one
//! redis-rs cluster connection, which is itself multiplexed: one connection per node, pipelined,
//! following `MOVED` / `ASK` and refreshing the slot map (pooling several measured no faster; see
//! `BENCHMARKS.md`).

/// The settings both store builders share: prefix, timeouts and the test clock.
macro_rules! settings_setters {
    () => {
        /// The first part of every key (default `tollgate`): give each application or region
        /// that shares the Redis its own. 1 to 64 characters, no braces, spaces or control
        /// characters.
        pub fn prefix(mut self, prefix: impl AsRef<str>) -> Self {
            self.settings.prefix = prefix.as_ref().into();
            self
        }

        /// The time allowed to open a connection (default 1 s).
        pub fn connect_timeout(mut self, timeout: Duration) -> Self {
            self.settings.connect_timeout = timeout;
            self
        }

        /// The budget of one check, from the call to the decision, redirections and retries
        /// included (default 100 ms). Past it the check fails with [`StoreError::Timeout`].
        pub fn response_timeout(mut self, timeout: Duration) -> Self {
            self.settings.response_timeout = timeout;
            self
        }

        /// Takes the time from `clock` instead of the server's `TIME`. **For tests and
        /// simulations only**: replicas with different clocks disagree, and keys still expire on
        /// the server's clock (with an hour of slack, so that they outlive simulated time).
        #[doc(hidden)]
        pub fn clock_for_testing<C: Clock>(mut self, clock: C) -> Self {
            self.settings.clock = Some(Arc::new(clock));
            self
        }
    };
}

mod cluster;
mod error;
mod keys;
mod script;
mod standalone;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

pub use cluster::{RedisClusterStore, RedisClusterStoreBuilder};
pub use error::BuildError;
pub use keys::DEFAULT_PREFIX;
pub use standalone::{RedisStore, RedisStoreBuilder};

use crate::clock::Clock;
use crate::decision::Decision;
use crate::store::StoreError;

/// The default budget of one check.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_millis(100);

/// The default time allowed to open a connection.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// The future of a Redis check.
pub type CheckFuture = Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send + 'static>>;

/// The Lua source of the script the stores run (with the server's `TIME` as its clock), for
/// operators who preload scripts (`SCRIPT LOAD`) or benchmark them. Its header documents its
/// arguments and its answer.
pub fn script_source() -> &'static str {
    script::SERVER_CLOCK_SOURCE
}

/// What both stores are configured with.
#[derive(Clone)]
struct Settings {
    prefix: Arc<str>,
    connect_timeout: Duration,
    response_timeout: Duration,
    clock: Option<Arc<dyn Clock>>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            prefix: DEFAULT_PREFIX.into(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
            clock: None,
        }
    }
}

impl Settings {
    fn validate(&self) -> Result<(), crate::policy::ConfigError> {
        keys::validate_prefix(&self.prefix)?;
        for (name, value) in [
            ("connect_timeout", self.connect_timeout),
            ("response_timeout", self.response_timeout),
        ] {
            if value.is_zero() {
                return Err(crate::policy::ConfigError::new(format!(
                    "Redis store: {name} is 0; use at least a millisecond"
                )));
            }
        }
        Ok(())
    }

    /// The script to run: the production one, or the one that takes the injected clock's time.
    fn script(&self) -> script::Script {
        script::Script::new(if self.clock.is_some() {
            script::ARGUMENT_CLOCK_SOURCE
        } else {
            script::SERVER_CLOCK_SOURCE
        })
    }

    /// The time to pass to the script: only with an injected clock.
    fn now(&self) -> Option<u64> {
        self.clock.as_ref().map(|c| c.now_micros())
    }
}

/// Runs `future` within `budget`, or gives [`StoreError::Timeout`].
async fn within<T>(
    budget: Duration,
    future: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(budget, future)
        .await
        .unwrap_or(Err(StoreError::Timeout))
}
