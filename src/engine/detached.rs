//! Store operations nobody waits for (slots given back, a charge settled, after their request
//! or its body went away): made at once by a store that never waits, else finished on the
//! Tokio runtime the request was served on, wherever it is dropped (a future or a body handed
//! to another executor, or to another runtime).
//!
//! ```text
//! let origin = Origin::here();   // where the request is served
//! // ... its body is handed to another executor, and dropped there:
//! engine.finish_adjust(on_fallback, &adjustments, report, "released outside a Tokio runtime", &origin);
//! ```

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use super::local::Counted;
use super::state::Engine;
use crate::runtime::Origin;
use crate::store::{Adjustment, Store, StoreError, StoreFuture};

impl<St: Store> Engine<St> {
    /// Makes `adjustments` for a request that went away, where
    /// [`adjust_where`](Self::adjust_where) makes them: at once when that store never waits
    /// (the memory store, the fallback limiter), else as [`finish_detached`] finishes their
    /// future: on the request's runtime, where its store's connections and timers are.
    pub(crate) fn finish_adjust(
        &self,
        on_fallback: Option<Counted>,
        adjustments: &[Adjustment<'_>],
        report: fn(Result<(), StoreError>),
        outside: &'static str,
        origin: &Origin,
    ) {
        match self.try_adjust_now_where(on_fallback, adjustments) {
            Some(result) => report(result),
            None => finish_detached(self.store.adjust(adjustments), report, outside, origin),
        }
    }
}

/// Finishes a store operation of a request served on `origin`'s runtime, which nobody waits
/// for; each outcome is told to `report`.
///
/// - On that runtime (or on one, when the request had none), it is polled once here (its call
///   leaves at once) and what is left finishes there.
/// - On another runtime, or where none runs, it goes to `origin`'s unpolled: a call started
///   there keeps that runtime's timers, which another must not poll (it may have shut down);
///   one not started yet would otherwise set its timers and open connections on a runtime that
///   may have no timers or live shorter; a Redis store refuses a call polled where no runtime
///   runs.
/// - With no runtime at all, it is polled once here, and what did not finish is said as a
///   failure saying `outside`.
pub(crate) fn finish_detached(
    future: StoreFuture<()>,
    report: fn(Result<(), StoreError>),
    outside: &'static str,
    origin: &Origin,
) {
    match origin.elsewhere() {
        Some(origin) => spawn(origin, future, report),
        None => poll_here(
            future,
            report,
            outside,
            tokio::runtime::Handle::try_current().ok(),
        ),
    }
}

/// Polls `future` once here (a call leaves at once; a store that answers at once is done),
/// and leaves what is left to `runtime`; with none, says it as a failure saying `outside`.
fn poll_here(
    mut future: StoreFuture<()>,
    report: fn(Result<(), StoreError>),
    outside: &'static str,
    runtime: Option<tokio::runtime::Handle>,
) {
    let mut context = Context::from_waker(std::task::Waker::noop());
    match (future.as_mut().poll(&mut context), runtime) {
        (Poll::Ready(result), _) => report(result),
        (Poll::Pending, Some(runtime)) => spawn(&runtime, future, report),
        (Poll::Pending, None) => report(Err(StoreError::Unavailable(outside.into()))),
    }
}

/// Leaves `future` to `runtime`.
fn spawn(
    runtime: &tokio::runtime::Handle,
    future: StoreFuture<()>,
    report: fn(Result<(), StoreError>),
) {
    runtime.spawn(Detached {
        future: Some(future),
        report,
    });
}

/// An operation left to a runtime: its outcome is told to `report` when it ends, or as a
/// failure when the runtime drops it unfinished (it shut down, or the operation panicked).
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
                "dropped unfinished by the Tokio runtime it was left to (it shut down, or the \
                 operation panicked)"
                    .into(),
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
    static REPORTS: [Mutex<Vec<String>>; 4] = [const { Mutex::new(Vec::new()) }; 4];

    fn reports(test: usize) -> Vec<String> {
        REPORTS[test].lock().unwrap().clone()
    }

    fn record(test: usize, result: Result<(), StoreError>) {
        REPORTS[test].lock().unwrap().push(format!("{result:?}"));
    }

    /// Turns `runtime` until test `test` has a report (a bounded number of turns).
    fn until_reported(runtime: &tokio::runtime::Runtime, test: usize) {
        runtime.block_on(async {
            for _ in 0..1000 {
                if !reports(test).is_empty() {
                    break;
                }
                tokio::task::yield_now().await;
            }
        });
    }

    #[test]
    fn left_where_no_runtime_runs_it_finishes_on_its_origin() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let origin = runtime.block_on(async { Origin::here() });
        finish_detached(needs_runtime(), |r| record(0, r), "outside", &origin);
        assert!(reports(0).is_empty(), "not polled here");
        until_reported(&runtime, 0);
        assert_eq!(reports(0), ["Ok(())"]);
    }

    #[test]
    fn with_no_runtime_at_all_what_did_not_finish_is_said() {
        let none = Origin::default();
        // Refused here: the store's own error.
        finish_detached(needs_runtime(), |r| record(1, r), "outside", &none);
        // Waiting for something that never comes: said as `outside`.
        let pending = Box::pin(std::future::pending());
        finish_detached(pending, |r| record(1, r), "outside", &none);
        // Answered at once.
        let ready = Box::pin(std::future::ready(Ok(())));
        finish_detached(ready, |r| record(1, r), "outside", &none);
        assert_eq!(
            reports(1),
            [
                r#"Err(Unavailable("polled without a runtime"))"#,
                r#"Err(Unavailable("outside"))"#,
                "Ok(())",
            ]
        );
    }

    /// A call started on one runtime (its timer registered there), which then shut down, left
    /// where another runtime runs: not polled there (its timers would assert that their
    /// runtime is gone, a panic in a drop), and said.
    #[test]
    fn started_on_a_runtime_that_shut_down_it_is_said_without_a_panic() {
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let mut sleeping: StoreFuture<()> = Box::pin(async {
            tokio::time::sleep(std::time::Duration::from_secs(60)).await;
            Ok(())
        });
        let origin = first.block_on(async {
            let polled = std::future::poll_fn(|cx| Poll::Ready(sleeping.as_mut().poll(cx))).await;
            assert!(polled.is_pending());
            Origin::here()
        });
        drop(first);
        let second = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        second.block_on(async {
            finish_detached(sleeping, |r| record(2, r), "outside", &origin);
        });
        assert_eq!(
            reports(2),
            [
                r#"Err(Unavailable("dropped unfinished by the Tokio runtime it was left to (it shut down, or the operation panicked)"))"#
            ]
        );
    }

    /// On the request's own runtime, an operation is polled once where it is left (its call
    /// leaves at once), and what is left finishes on that runtime.
    #[test]
    fn on_its_own_runtime_it_is_polled_at_once() {
        static POLLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(async {
            let origin = Origin::here();
            let counted: StoreFuture<()> = Box::pin(async {
                POLLS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::task::yield_now().await;
                Ok(())
            });
            finish_detached(counted, |r| record(3, r), "outside", &origin);
            assert_eq!(
                POLLS.load(std::sync::atomic::Ordering::SeqCst),
                1,
                "polled here"
            );
        });
        until_reported(&runtime, 3);
        assert_eq!(reports(3), ["Ok(())"]);
    }
}
