//! What both Redis stores are configured with ([`Settings`]), its checks, defaults and bounds,
//! and the builder methods that set it (`settings_setters!`).

use std::sync::Arc;
use std::time::Duration;

use crate::ConfigError;
use crate::clock::Clock;
use crate::store::breaker::CircuitBreaker;
use crate::store::redis::{fleet, keys, replica, script};

/// The settings both store builders share: prefix, timeouts, circuit breaker, credentials and
/// TLS, the test clock.
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

        /// The budget of one check, from the call to the decision, redirections included
        /// (default 100 ms). Past it the check fails with
        /// [`StoreError::Timeout`](crate::store::StoreError::Timeout).
        pub fn response_timeout(mut self, timeout: Duration) -> Self {
            self.settings.response_timeout = timeout;
            self
        }

        /// When to stop asking a server that keeps failing (default: after 5 failures in a row,
        /// for 1 s). See [`CircuitBreaker`](crate::CircuitBreaker).
        pub fn circuit_breaker(mut self, breaker: crate::CircuitBreaker) -> Self {
            self.settings.breaker = breaker;
            self
        }

        /// The most keys whose denials this replica keeps, to answer their next requests itself
        /// until the retry-after Redis computed (default 100,000; 0 turns the deny cache off).
        /// See [`store`](crate::store#the-deny-cache).
        pub fn deny_cache(mut self, max_keys: usize) -> Self {
            self.settings.deny_cache = max_keys;
            self
        }

        /// The longest this replica answers a denial itself (default 5 s), whatever the
        /// retry-after Redis computed: the backstop for a reset or refund made on another
        /// replica whose message this one missed (it hears them over pub/sub; see
        /// [`store`](crate::store#the-deny-cache)). Zero is refused: turn the cache off with
        /// `deny_cache(0)`.
        pub fn deny_cache_max_age(mut self, max_age: Duration) -> Self {
            self.settings.deny_cache_max_age = max_age;
            self
        }

        /// How often this replica counts itself among the replicas of its prefix (default 1 s;
        /// zero turns it off): `TIME` and a pipeline of four commands per interval, off the
        /// request path, on a key of its own, `<prefix>:replicas`. A replica lapses three intervals after its last
        /// beat. While Redis is away, the count last read gives each replica its share of a
        /// rule that falls back to the local limiter (see
        /// [`FallbackShare`](crate::FallbackShare)). At least 100 ms, at most a minute.
        pub fn heartbeat(mut self, every: Duration) -> Self {
            self.settings.heartbeat = every;
            self
        }

        /// Signs in as the ACL user `username` with `password` (`AUTH username password`),
        /// in place of a user and password in the URL, which would need any `/`, `?`, `#` or
        /// `@` of the password escaped. For the password of the default user (`requirepass`),
        /// `"default"`. The password is never shown in errors or `Debug`. See
        /// [`RedisStore`](crate::store::RedisStore#tls-and-acl-users) for the commands it needs.
        pub fn credentials(
            mut self,
            username: impl Into<String>,
            password: impl Into<String>,
        ) -> Self {
            self.access.credentials = Some((username.into(), password.into()));
            self
        }

        /// Trusts the CA certificates in `pem` (PEM text, one or more) for a `rediss://`
        /// server (feature `tls`), in place of the system's roots: for a server whose
        /// certificate a private CA signed (self-hosted Redis, Redis Cloud's CA). A server
        /// whose certificate none of them signed is refused.
        #[cfg(feature = "tls")]
        pub fn tls_ca(mut self, pem: impl Into<Vec<u8>>) -> Self {
            self.access.ca = Some(pem.into());
            self
        }

        /// Presents this client certificate (PEM, the chain from the client's certificate up)
        /// and its private key (PEM, unencrypted) to a `rediss://` server that asks for one
        /// (`tls-auth-clients yes`; feature `tls`).
        #[cfg(feature = "tls")]
        pub fn tls_client_cert(
            mut self,
            cert_pem: impl Into<Vec<u8>>,
            key_pem: impl Into<Vec<u8>>,
        ) -> Self {
            self.access.client_cert = Some((cert_pem.into(), key_pem.into()));
            self
        }

        /// Takes the time from `clock` instead of the server's `TIME` (feature `testing`):
        /// **for tests and simulations only**. Replicas with different clocks disagree, and keys
        /// still expire on the server's clock (with an hour of slack, so that they outlive
        /// simulated time).
        #[cfg(feature = "testing")]
        pub fn clock<C: crate::clock::Clock>(mut self, clock: C) -> Self {
            self.settings.clock = Some(Arc::new(clock));
            self
        }

        /// Reaches the servers through a simulated network, the replica on its own clock
        /// (tests only: the fleet simulation).
        #[cfg(test)]
        pub(crate) fn simulated(
            mut self,
            simulated: crate::store::redis::simulated::Simulated,
        ) -> Self {
            self.settings.simulated = Some(simulated);
            self
        }
    };
}
pub(crate) use settings_setters;

/// How long a call that takes concurrency slots waits for its reply, past its checks' time
/// budget (`response_timeout`): four budgets, at least a second. A reply that comes after its
/// check stopped waiting gives its slots back; one that never comes leaves them until their
/// longest hold.
pub(crate) fn late_reply_wait(response_timeout: std::time::Duration) -> std::time::Duration {
    (response_timeout * 4).max(std::time::Duration::from_secs(1))
}

/// The longest connect or response timeout.
const MAX_TIMEOUT: Duration = Duration::from_secs(3600);

/// The most checks one call may carry.
pub(crate) const MAX_BATCH: usize = 1024;

/// The most keys whose denials a store keeps, by default.
pub const DEFAULT_DENY_CACHE: usize = 100_000;

/// The longest a replica answers a denial itself, by default.
const DEFAULT_DENY_CACHE_MAX_AGE: Duration = Duration::from_secs(5);

/// The most keys a store holds leased units for.
const MAX_LEASED_KEYS: usize = 100_000;

/// What both stores are configured with.
#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) prefix: Arc<str>,
    pub(crate) connect_timeout: Duration,
    pub(crate) response_timeout: Duration,
    pub(crate) breaker: CircuitBreaker,
    pub(crate) clock: Option<Arc<dyn Clock>>,
    /// The most cached denials (0: none).
    pub(crate) deny_cache: usize,
    /// The longest a cached denial is answered.
    pub(crate) deny_cache_max_age: Duration,
    /// How often the replica counts itself (zero: never).
    pub(crate) heartbeat: Duration,
    /// The simulated network and the replica's clock, in the fleet simulation.
    #[cfg(test)]
    pub(crate) simulated: Option<super::simulated::Simulated>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            prefix: keys::DEFAULT_PREFIX.into(),
            connect_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_millis(100),
            breaker: CircuitBreaker::default(),
            clock: None,
            deny_cache: DEFAULT_DENY_CACHE,
            deny_cache_max_age: DEFAULT_DENY_CACHE_MAX_AGE,
            heartbeat: fleet::DEFAULT_HEARTBEAT,
            #[cfg(test)]
            simulated: None,
        }
    }
}

impl Settings {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        keys::validate_prefix(&self.prefix)?;
        for (name, value) in [
            ("connect_timeout", self.connect_timeout),
            ("response_timeout", self.response_timeout),
            ("deny_cache_max_age", self.deny_cache_max_age),
        ] {
            if value.is_zero() {
                return Err(ConfigError::new(format!(
                    "Redis store: {name} is 0; use at least a millisecond"
                )));
            }
            if value > MAX_TIMEOUT {
                return Err(ConfigError::new(format!(
                    "Redis store: {name} is {value:?}; use at most an hour (a rate limiter that \
                     waits longer for its store has stopped limiting)"
                )));
            }
        }
        if !self.heartbeat.is_zero()
            && !(Duration::from_millis(100)..=Duration::from_secs(60)).contains(&self.heartbeat)
        {
            return Err(ConfigError::new(format!(
                "Redis store: heartbeat is {:?}; use 100 ms to 60 s (or zero to turn it off)",
                self.heartbeat
            )));
        }
        self.breaker.validate()
    }

    /// The code to run: the production one, or the one that takes the injected clock's time.
    pub(crate) fn program(&self) -> &'static script::Program {
        if self.clock.is_some() {
            &script::ARGUMENT_CLOCK
        } else {
            &script::SERVER_CLOCK
        }
    }

    /// The replica-side decisions of a store: on the injected clock when there is one, else on
    /// this machine's monotonic clock.
    pub(crate) fn replica(&self) -> Arc<replica::Replica> {
        #[cfg(test)]
        let simulated = self.simulated.as_ref().map(|s| s.clock.clone());
        #[cfg(not(test))]
        let simulated = None;
        let clock: Arc<dyn Clock> = match (&self.clock, simulated) {
            (Some(clock), _) => clock.clone(),
            (None, Some(clock)) => clock,
            (None, None) => Arc::new(crate::clock::SystemClock::new()),
        };
        Arc::new(replica::Replica::new(
            clock,
            self.prefix.clone(),
            self.deny_cache,
            self.deny_cache_max_age,
            MAX_LEASED_KEYS,
        ))
    }

    /// The simulated network connections go through, if any (tests only).
    #[cfg(test)]
    pub(crate) fn network(&self) -> Option<Arc<dyn super::simulated::Network>> {
        self.simulated.as_ref().map(|s| s.network.clone())
    }

    /// The time to pass to the script: only with an injected clock.
    pub(crate) fn now(&self) -> Option<u64> {
        self.clock.as_ref().map(|c| c.now_micros())
    }
}
