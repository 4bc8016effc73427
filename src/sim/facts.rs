//! The facts of a run: what happened to each request, and the ledger that notes them as the
//! clients and the handlers see them.

use std::sync::{Arc, Mutex};

use super::time::SimTime;

/// What happened to a request, at a server time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Happened {
    /// The handler was called: every enforcing rule admitted it.
    Admitted { replica: u32 },
    /// The client read one unit of the stream.
    Unit,
    /// The handler's response ended or was dropped (its concurrency slot is free).
    Released,
    /// The handler sent its usage trailer.
    Reported,
    /// The admission's first chunk of metered rule `rule` (its index in the plan): a chunk,
    /// or what was left when that was less.
    Granted { rule: u16, units: u64 },
    /// Replica `replica` answered `429 Too Many Requests`.
    Refused { replica: u32 },
    /// The handler answered with `status` and reported the request's real cost, `actual`
    /// (for the rules that charge by the response).
    Answered { status: u16, actual: u64 },
}

/// One fact of the run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fact {
    pub(crate) at: u64,
    pub(crate) request: u64,
    pub(crate) key: u32,
    pub(crate) happened: Happened,
}

/// The facts of a run as they happen.
#[derive(Clone)]
pub(super) struct Ledger {
    pub(super) facts: Arc<Mutex<Vec<Fact>>>,
    pub(super) time: SimTime,
}

impl Ledger {
    pub(super) fn note(&self, request: u64, key: u32, happened: Happened) {
        let at = self.time.now();
        self.facts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Fact {
                at,
                request,
                key,
                happened,
            });
    }
}

/// Notes [`Happened::Released`] when the response ends or is dropped.
pub(super) struct Hold {
    pub(super) ledger: Ledger,
    pub(super) request: u64,
    pub(super) key: u32,
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.ledger.note(self.request, self.key, Happened::Released);
    }
}
