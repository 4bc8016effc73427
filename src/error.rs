//! The errors every part of tollgate returns: [`ConfigError`] for mistakes found when something is
//! built, [`StoreError`] for a store that could not decide.

use std::fmt;

/// A configuration mistake, found when a layer or a store is built. The message says what to
/// change.
///
/// ```
/// use tollgate::{Quota, RateLimitLayer};
///
/// let error = RateLimitLayer::new(Quota::per_second(0)).unwrap_err();
/// assert!(error.to_string().contains("use at least 1"));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct ConfigError {
    message: String,
}

impl ConfigError {
    pub(crate) fn new(message: impl Into<String>) -> Self {
        ConfigError {
            message: message.into(),
        }
    }

    /// The message, without the crate's prefix.
    pub(crate) fn message(&self) -> &str {
        &self.message
    }

    /// The error, placed at a line and column of a file.
    pub(crate) fn at(self, file: &str, line: usize, column: usize) -> Self {
        ConfigError::new(format!("{file}:{line}:{column}: {}", self.message))
    }

    /// The error, placed in a file.
    pub(crate) fn at_file(self, file: &str) -> Self {
        ConfigError::new(format!("{file}: {}", self.message))
    }

    pub(crate) fn in_rule(rule: &str, problem: impl fmt::Display) -> Self {
        ConfigError::new(format!("rule \"{rule}\": {problem}"))
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tollgate configuration: {}", self.message)
    }
}

/// The message, as `Display` writes it: `main` returning a `ConfigError` prints what to change,
/// not a struct.
impl fmt::Debug for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for ConfigError {}

/// Why a store could not decide.
#[derive(Debug)]
#[non_exhaustive]
pub enum StoreError {
    /// The store did not answer within its time budget.
    Timeout,
    /// The store could not be reached or refused the command.
    Unavailable(Box<dyn std::error::Error + Send + Sync>),
    /// The store answered something the client did not expect.
    Protocol(String),
    /// The store was not asked: it failed repeatedly and its circuit breaker is open.
    CircuitOpen,
    /// The store cannot do this (a store of your own that implements only
    /// [`check`](crate::store::Store::check)); names the operation.
    Unsupported(&'static str),
}

impl StoreError {
    /// The same error again, for each check of a batch that failed together (the cause is kept
    /// as its message).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn duplicate(&self) -> StoreError {
        match self {
            StoreError::Timeout => StoreError::Timeout,
            StoreError::Unavailable(e) => StoreError::Unavailable(e.to_string().into()),
            StoreError::Protocol(e) => StoreError::Protocol(e.clone()),
            StoreError::CircuitOpen => StoreError::CircuitOpen,
            StoreError::Unsupported(what) => StoreError::Unsupported(what),
        }
    }
}

/// A store error that its store has logged itself (a Redis store that has not connected yet
/// says so when it starts and while it retries), so the layer does not log it again.
#[derive(Debug)]
pub(crate) struct Reported(pub(crate) String);

impl fmt::Display for Reported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Reported {}

impl StoreError {
    /// Whether the store has logged this error itself.
    pub(crate) fn is_reported(&self) -> bool {
        matches!(self, StoreError::Unavailable(e) if e.is::<Reported>())
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Timeout => f.write_str("rate-limit store timed out"),
            StoreError::Unavailable(e) => write!(f, "rate-limit store unavailable: {e}"),
            StoreError::Protocol(e) => write!(f, "rate-limit store answered unexpectedly: {e}"),
            StoreError::CircuitOpen => {
                f.write_str("rate-limit store not asked: its circuit breaker is open")
            }
            StoreError::Unsupported(what) => {
                write!(
                    f,
                    "rate-limit store cannot {what}: implement it on the store"
                )
            }
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StoreError::Unavailable(e) => Some(e.as_ref()),
            _ => None,
        }
    }
}
