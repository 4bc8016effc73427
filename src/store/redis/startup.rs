//! A store that starts without its server: it connects in the background, retrying, while checks
//! fail at once (each rule's `FailureMode` decides) until the first connection is made.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use crate::store::StoreError;

/// The first wait between two connection attempts; it doubles up to [`MAX_RETRY_DELAY`].
pub(crate) const FIRST_RETRY_DELAY: Duration = Duration::from_millis(100);

/// The longest wait between two connection attempts.
pub(crate) const MAX_RETRY_DELAY: Duration = Duration::from_secs(2);

/// Where a store is in starting up.
#[derive(Debug, Default)]
pub(crate) struct Startup {
    /// The background task is alive (false again if its runtime went away).
    running: Arc<AtomicBool>,
    /// The store reached its server once (and loaded the script).
    connected: AtomicBool,
    /// Woken when it does.
    notify: Notify,
    /// Why the last attempt failed.
    last_error: Mutex<Option<String>>,
}

/// Held by the background task: when the task ends, or is dropped with its runtime, the store
/// knows it has to start another.
pub(crate) struct Running(Arc<AtomicBool>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl Startup {
    /// Spawns `task` on the current Tokio runtime unless one is alive; false when there is no
    /// runtime yet (the store was built outside one: the first check, which runs on one,
    /// spawns it).
    pub(crate) fn spawn<F>(&self, task: impl FnOnce(Running) -> F) -> bool
    where
        F: Future<Output = ()> + Send + 'static,
    {
        if self.running.load(Ordering::Acquire) {
            return true;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return false;
        };
        if !self.running.swap(true, Ordering::AcqRel) {
            runtime.spawn(task(Running(self.running.clone())));
        }
        true
    }

    pub(crate) fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }

    pub(crate) fn connected(&self) {
        self.connected.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }

    /// Records a failed attempt; true for the first one (worth a log line).
    pub(crate) fn failed(&self, error: &StoreError) -> bool {
        let mut last = self.last_error.lock().unwrap_or_else(|p| p.into_inner());
        let first = last.is_none();
        *last = Some(error.to_string());
        first
    }

    /// The error of a check made before the store first connected.
    pub(crate) fn not_connected(&self, server: &str) -> StoreError {
        let last = self.last_error.lock().unwrap_or_else(|p| p.into_inner());
        let why = match &*last {
            Some(error) => format!("not connected yet (last attempt: {error})"),
            None => "not connected yet".to_owned(),
        };
        StoreError::Unavailable(Box::new(crate::error::Reported(format!("{server}: {why}"))))
    }

    /// Waits until the store is connected, at most `timeout`; false when it is not.
    pub(crate) async fn wait(&self, timeout: Duration) -> bool {
        let wait = async {
            loop {
                let notified = self.notify.notified();
                if self.is_connected() {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(timeout, wait).await.is_ok()
    }
}
