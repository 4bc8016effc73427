//! From Redis errors to [`StoreError`], by kind (never by message text), naming the server; and
//! [`ConnectError`].

use std::fmt;
use std::sync::Arc;

use redis::{ErrorKind, RedisError, ServerErrorKind};

use crate::ConfigError;
use crate::store::StoreError;

/// Why a Redis store could not be connected by `connect()` (the fail-fast start).
#[derive(Debug)]
#[non_exhaustive]
pub enum ConnectError {
    /// The configuration is wrong (the message says what to change).
    Config(ConfigError),
    /// Redis could not be reached, or refused to load the script.
    Store(StoreError),
}

impl fmt::Display for ConnectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConnectError::Config(e) => e.fmt(f),
            ConnectError::Store(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for ConnectError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConnectError::Config(e) => Some(e),
            ConnectError::Store(e) => Some(e),
        }
    }
}

impl From<ConfigError> for ConnectError {
    fn from(e: ConfigError) -> Self {
        ConnectError::Config(e)
    }
}

impl From<StoreError> for ConnectError {
    fn from(e: StoreError) -> Self {
        ConnectError::Store(e)
    }
}

/// An error and the server it came from (its URL without the password).
#[derive(Debug)]
pub(crate) struct AtServer {
    server: Arc<str>,
    error: Box<dyn std::error::Error + Send + Sync>,
}

impl AtServer {
    pub(crate) fn new(
        server: &Arc<str>,
        error: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        AtServer {
            server: server.clone(),
            error: error.into(),
        }
    }
}

impl fmt::Display for AtServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.server, self.error)
    }
}

impl std::error::Error for AtServer {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.error)
    }
}

/// Maps a Redis error of `server`: I/O time-outs to [`StoreError::Timeout`], answers the client
/// cannot read to [`StoreError::Protocol`], everything else (refused or dropped connections,
/// cluster down, loading, read-only replica, permissions, script errors) to
/// [`StoreError::Unavailable`].
pub(crate) fn store_error(server: &Arc<str>, error: RedisError) -> StoreError {
    if error.is_timeout() {
        return StoreError::Timeout;
    }
    match error.kind() {
        ErrorKind::Parse | ErrorKind::UnexpectedReturnType => {
            StoreError::Protocol(format!("{server}: {error}"))
        }
        _ => StoreError::Unavailable(Box::new(AtServer::new(server, error))),
    }
}

/// Whether a connection that returned this error must be replaced: it is closed or its stream
/// is broken. A slow answer does not break it (see `health`).
pub(crate) fn breaks_connection(error: &RedisError) -> bool {
    error.is_unrecoverable_error()
        || error.is_connection_dropped()
        || error.is_io_error() && !error.is_timeout()
}

/// Whether the server answered this error itself (a refusal such as `CLUSTERDOWN`, `LOADING`
/// or `READONLY`, a script error): the server is reachable and answers at once, so it says
/// nothing against the connection, nor to a circuit breaker, whose purpose is to stop waiting,
/// unless it [refuses every command](refuses_every_command).
pub(crate) fn is_server_answer(error: &RedisError) -> bool {
    matches!(error.kind(), ErrorKind::Server(_) | ErrorKind::Extension)
}

/// Whether the server answered this error to every command it is sent, its probe's `PING`
/// too: it is loading its data (`LOADING`) or a script runs past its time (`BUSY`). Such an
/// answer comes at once, but it is not the server back: a circuit breaker counts it as a
/// failure, as its probe does. `CLUSTERDOWN` and `MASTERDOWN` are not such answers: a `PING`
/// still gets `PONG` (a breaker that counted them would open and close by turns), a
/// `CLUSTERDOWN` may be one slot's, and a demoted server is left for a new connection.
pub(crate) fn refuses_every_command(error: &RedisError) -> bool {
    match error.kind() {
        ErrorKind::Server(ServerErrorKind::BusyLoading) => true,
        ErrorKind::Extension => error.code() == Some("BUSY"),
        _ => false,
    }
}

/// Whether the server says it is no longer a primary (`READONLY`, `MASTERDOWN`): it was demoted
/// by a failover, and a new connection (to the same name) finds the new primary.
pub(crate) fn is_demoted(error: &RedisError) -> bool {
    matches!(
        error.kind(),
        ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
    )
}
