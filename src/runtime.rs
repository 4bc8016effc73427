//! [`Origin`]: the Tokio runtime a piece of a request's work was made on, and where what it
//! leaves behind (a give-back, a settle, a metered body's next chunk) runs when it is dropped
//! or polled elsewhere.
//!
//! ```text
//! let origin = Origin::here();             // where the request is served
//! // ... later, on whatever thread drops or polls what it left:
//! if let Some(runtime) = origin.runtime() {
//!     runtime.spawn(work);                 // on the request's runtime, where its store's
//! }                                        // timers and connections are
//! ```

use tokio::runtime::Handle;

/// The Tokio runtime a request was served on, if any. It holds the runtime's shared state (not
/// its threads: its driver, its queues) as long as it lives, as every handle of the runtime
/// does: a response body kept long after its runtime was dropped keeps that.
#[derive(Clone, Default)]
pub(crate) struct Origin(Option<Handle>);

impl Origin {
    /// The current thread's runtime, if it runs one.
    pub(crate) fn here() -> Origin {
        Origin(Handle::try_current().ok())
    }

    /// Where the request's work runs from wherever it is polled: its own runtime, else (it had
    /// none) the current thread's.
    pub(crate) fn runtime(&self) -> Option<Handle> {
        self.0.clone().or_else(|| Handle::try_current().ok())
    }

    /// The request's runtime when the current thread runs another one, or none: work started
    /// there must go back unpolled (its timers are that runtime's, and one not started would
    /// set its timers and open connections on a runtime that may have no timers, or live
    /// shorter). `None` on the request's own runtime, or when it had none.
    pub(crate) fn elsewhere(&self) -> Option<&Handle> {
        let origin = self.0.as_ref()?;
        match Handle::try_current() {
            // Ids of runtimes that run are unique; Tokio takes them from a process-wide counter
            // (of 64 bits where the target has 64-bit atomics), so one that ended is not
            // mistaken for a new one in practice.
            Ok(current) if current.id() == origin.id() => None,
            _ => Some(origin),
        }
    }
}
