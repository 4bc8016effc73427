//! From Redis errors to [`StoreError`], by kind (never by message text), and [`BuildError`].

use std::fmt;

use redis::{ErrorKind, RedisError};

use crate::policy::ConfigError;
use crate::store::StoreError;

/// Why a Redis store could not be built.
#[derive(Debug)]
#[non_exhaustive]
pub enum BuildError {
    /// The configuration is wrong (the message says what to change).
    Config(ConfigError),
    /// Redis could not be reached, or refused to load the script.
    Store(StoreError),
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BuildError::Config(e) => e.fmt(f),
            BuildError::Store(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for BuildError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            BuildError::Config(e) => Some(e),
            BuildError::Store(e) => Some(e),
        }
    }
}

impl From<ConfigError> for BuildError {
    fn from(e: ConfigError) -> Self {
        BuildError::Config(e)
    }
}

impl From<StoreError> for BuildError {
    fn from(e: StoreError) -> Self {
        BuildError::Store(e)
    }
}

/// Maps a Redis error: I/O time-outs to [`StoreError::Timeout`], answers the client cannot read to
/// [`StoreError::Protocol`], everything else (refused or dropped connections, cluster down,
/// loading, read-only replica, permissions, script errors) to [`StoreError::Unavailable`].
pub(crate) fn store_error(error: RedisError) -> StoreError {
    if error.is_timeout() {
        return StoreError::Timeout;
    }
    match error.kind() {
        ErrorKind::Parse | ErrorKind::UnexpectedReturnType => {
            StoreError::Protocol(error.to_string())
        }
        _ => StoreError::Unavailable(Box::new(error)),
    }
}

/// Whether a connection that returned this error must be replaced.
pub(crate) fn breaks_connection(error: &RedisError) -> bool {
    error.is_unrecoverable_error() || error.is_connection_dropped()
}
