use std::fmt;

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
    /// The store was not asked: it failed repeatedly and the circuit breaker is open.
    CircuitOpen,
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
