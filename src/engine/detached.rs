//! Store operations nobody waits for (slots given back, a charge settled after its request or
//! body went away): finished at once by a store that answers at once, else on a Tokio runtime,
//! the request's own when it is dropped on a thread that runs none.
//!
//! ```text
//! let origin = Origin::here();            // where the request is served
//! // ... the request's body is handed to another executor, and dropped there:
//! finish_detached(future, report, "released outside a Tokio runtime", &origin);
//! ```

use std::task::{Context, Poll};

use crate::store::{StoreError, StoreFuture};

/// The Tokio runtime a request was served on, if any: where what it leaves to finish (slots to
/// give back, a charge to settle) finishes when it is dropped on a thread that runs none (a
/// future or a body handed to another executor).
#[derive(Clone, Default)]
pub(crate) struct Origin(Option<tokio::runtime::Handle>);

impl Origin {
    /// The current thread's runtime, if it runs one.
    pub(crate) fn here() -> Origin {
        Origin(tokio::runtime::Handle::try_current().ok())
    }
}

/// Finishes a store operation nobody waits for; each outcome is told to `report`.
///
/// - On a runtime, it is polled once here (a store that answers at once, as the memory store
///   does, is done), else it finishes on that runtime.
/// - On a thread without a runtime, it goes to the runtime of `origin` unpolled: a Redis store
///   refuses an operation polled where no runtime runs, and the memory store did its part when
///   the operation was made. A runtime that shut down drops it, as it drops every task.
/// - With neither, it is polled once here, and what did not finish is `report`ed as a failure
///   saying `outside`.
pub(crate) fn finish_detached(
    mut future: StoreFuture<()>,
    report: fn(Result<(), StoreError>),
    outside: &'static str,
    origin: &Origin,
) {
    let mut context = Context::from_waker(std::task::Waker::noop());
    let runtime = match (tokio::runtime::Handle::try_current(), &origin.0) {
        (Ok(runtime), _) => match future.as_mut().poll(&mut context) {
            Poll::Ready(result) => return report(result),
            Poll::Pending => runtime,
        },
        (Err(_), Some(runtime)) => runtime.clone(),
        (Err(_), None) => {
            return match future.as_mut().poll(&mut context) {
                Poll::Ready(result) => report(result),
                Poll::Pending => report(Err(StoreError::Unavailable(outside.into()))),
            };
        }
    };
    runtime.spawn(async move { report(future.await) });
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

    static ON_ORIGIN: Mutex<Vec<Result<(), StoreError>>> = Mutex::new(Vec::new());

    fn on_origin(result: Result<(), StoreError>) {
        ON_ORIGIN.lock().unwrap().push(result);
    }

    #[test]
    fn dropped_where_no_runtime_runs_it_finishes_on_its_origin() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let origin = runtime.block_on(async { Origin::here() });
        finish_detached(needs_runtime(), on_origin, "outside", &origin);
        assert!(ON_ORIGIN.lock().unwrap().is_empty(), "not polled here");
        runtime.block_on(async {
            while ON_ORIGIN.lock().unwrap().is_empty() {
                tokio::task::yield_now().await;
            }
        });
        let reports = ON_ORIGIN.lock().unwrap();
        assert!(matches!(reports[..], [Ok(())]), "{reports:?}");
    }

    static NOWHERE: Mutex<Vec<Result<(), StoreError>>> = Mutex::new(Vec::new());

    fn nowhere(result: Result<(), StoreError>) {
        NOWHERE.lock().unwrap().push(result);
    }

    #[test]
    fn with_no_runtime_at_all_what_did_not_finish_is_said() {
        // Refused here: the store's own error.
        finish_detached(needs_runtime(), nowhere, "outside", &Origin::default());
        // Waiting for something that never comes: said as `outside`.
        finish_detached(
            Box::pin(std::future::pending()),
            nowhere,
            "outside",
            &Origin::default(),
        );
        // Answered at once, as the memory store does.
        finish_detached(
            Box::pin(std::future::ready(Ok(()))),
            nowhere,
            "outside",
            &Origin::default(),
        );
        let reports: Vec<String> = NOWHERE
            .lock()
            .unwrap()
            .iter()
            .map(|r| format!("{r:?}"))
            .collect();
        assert_eq!(
            reports,
            [
                r#"Err(Unavailable("polled without a runtime"))"#,
                r#"Err(Unavailable("outside"))"#,
                "Ok(())",
            ]
        );
    }
}
