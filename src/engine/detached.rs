//! Store operations nobody waits for (slots given back, a charge settled, after their request
//! or its body went away): made at once by a store that never waits, else finished on a Tokio
//! runtime — the request's own when the thread that drops it runs none (a future or a body
//! handed to another executor).
//!
//! ```text
//! let origin = Origin::here();   // where the request is served
//! // ... its body is handed to another executor, and dropped there:
//! engine.finish_adjust(on_fallback, &adjustments, report, "released outside a Tokio runtime", &origin);
//! ```

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use super::state::Engine;
use crate::store::{Adjustment, Store, StoreError, StoreFuture};

/// The Tokio runtime a request was served on, if any: where what it leaves to the store
/// finishes when it is dropped on a thread that runs none. It holds the runtime's shared state
/// (not its threads) as long as it lives, as every handle of the runtime does.
#[derive(Clone, Default)]
pub(crate) struct Origin(Option<tokio::runtime::Handle>);

impl Origin {
    /// The current thread's runtime, if it runs one.
    pub(crate) fn here() -> Origin {
        Origin(tokio::runtime::Handle::try_current().ok())
    }
}

impl<St: Store> Engine<St> {
    /// Makes `adjustments` for a request that went away, where
    /// [`adjust_where`](Self::adjust_where) makes them: at once when that store never waits
    /// (the memory store, the fallback limiter); else its future finishes on the runtime this
    /// thread runs, else on `origin`'s (the future is not polled here: a Redis store refuses a
    /// call polled where no runtime runs). Each outcome is told to `report`; with no runtime
    /// at all, what did not finish is said as a failure saying `outside`.
    pub(crate) fn finish_adjust(
        &self,
        on_fallback: bool,
        adjustments: &[Adjustment<'_>],
        report: fn(Result<(), StoreError>),
        outside: &'static str,
        origin: &Origin,
    ) {
        if let Some(result) = self.try_adjust_now_where(on_fallback, adjustments) {
            return report(result);
        }
        let future = self.adjust_where(on_fallback, adjustments);
        let runtime = tokio::runtime::Handle::try_current()
            .ok()
            .or_else(|| origin.0.clone());
        detach(future, report, outside, runtime);
    }
}

/// Finishes a store operation a request started on `origin`'s runtime and then left (its
/// timers are that runtime's: it finishes there, never polled here), as
/// [`Engine::finish_adjust`] does.
pub(crate) fn finish_started(
    future: StoreFuture<()>,
    report: fn(Result<(), StoreError>),
    outside: &'static str,
    origin: &Origin,
) {
    let runtime = origin
        .0
        .clone()
        .or_else(|| tokio::runtime::Handle::try_current().ok());
    detach(future, report, outside, runtime);
}

/// Finishes `future` on `runtime`; with none, polls it once here (a store that needs no
/// runtime may answer) and says what did not finish as a failure saying `outside`.
fn detach(
    mut future: StoreFuture<()>,
    report: fn(Result<(), StoreError>),
    outside: &'static str,
    runtime: Option<tokio::runtime::Handle>,
) {
    match runtime {
        Some(runtime) => {
            runtime.spawn(Detached {
                future: Some(future),
                report,
            });
        }
        None => {
            let mut context = Context::from_waker(std::task::Waker::noop());
            match future.as_mut().poll(&mut context) {
                Poll::Ready(result) => report(result),
                Poll::Pending => report(Err(StoreError::Unavailable(outside.into()))),
            }
        }
    }
}

/// An operation left to a runtime: its outcome is told to `report` when it ends, or as a
/// failure when the runtime drops it first (it shut down).
struct Detached {
    future: Option<StoreFuture<()>>,
    report: fn(Result<(), StoreError>),
}

impl Future for Detached {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if let Some(future) = &mut this.future {
            let result = ready!(future.as_mut().poll(cx));
            this.future = None;
            (this.report)(result);
        }
        Poll::Ready(())
    }
}

impl Drop for Detached {
    fn drop(&mut self) {
        if self.future.take().is_some() {
            (self.report)(Err(StoreError::Unavailable(
                "the Tokio runtime it was left to shut down first".into(),
            )));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// An operation that needs a runtime, as a Redis store's does: refused when polled where
    /// none runs, else finished after a turn of the runtime.
    fn needs_runtime() -> StoreFuture<()> {
        Box::pin(async {
            if tokio::runtime::Handle::try_current().is_err() {
                return Err(StoreError::Unavailable("polled without a runtime".into()));
            }
            tokio::task::yield_now().await;
            Ok(())
        })
    }

    /// Each test's reports, by the test's number.
    static REPORTS: [Mutex<Vec<String>>; 3] = [const { Mutex::new(Vec::new()) }; 3];

    fn reports(test: usize) -> Vec<String> {
        REPORTS[test].lock().unwrap().clone()
    }

    fn record(test: usize, result: Result<(), StoreError>) {
        REPORTS[test].lock().unwrap().push(format!("{result:?}"));
    }

    #[test]
    fn left_where_no_runtime_runs_it_finishes_on_its_origin() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let origin = runtime.block_on(async { Origin::here() });
        finish_started(needs_runtime(), |r| record(0, r), "outside", &origin);
        assert!(reports(0).is_empty(), "not polled here");
        runtime.block_on(async {
            for _ in 0..1000 {
                if !reports(0).is_empty() {
                    break;
                }
                tokio::task::yield_now().await;
            }
        });
        assert_eq!(reports(0), ["Ok(())"]);
    }

    #[test]
    fn with_no_runtime_at_all_what_did_not_finish_is_said() {
        let none = Origin::default();
        // Refused here: the store's own error.
        finish_started(needs_runtime(), |r| record(1, r), "outside", &none);
        // Waiting for something that never comes: said as `outside`.
        let pending = Box::pin(std::future::pending());
        finish_started(pending, |r| record(1, r), "outside", &none);
        // Answered at once.
        let ready = Box::pin(std::future::ready(Ok(())));
        finish_started(ready, |r| record(1, r), "outside", &none);
        assert_eq!(
            reports(1),
            [
                r#"Err(Unavailable("polled without a runtime"))"#,
                r#"Err(Unavailable("outside"))"#,
                "Ok(())",
            ]
        );
    }

    #[test]
    fn left_to_a_runtime_that_shut_down_it_is_said_without_a_panic() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let origin = runtime.block_on(async { Origin::here() });
        drop(runtime);
        let sleeping: StoreFuture<()> = Box::pin(async {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            Ok(())
        });
        finish_started(sleeping, |r| record(2, r), "outside", &origin);
        assert_eq!(
            reports(2),
            [r#"Err(Unavailable("the Tokio runtime it was left to shut down first"))"#]
        );
    }
}
