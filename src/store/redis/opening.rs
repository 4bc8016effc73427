//! [`Opening`]: one attempt at a time to open a connection, whose outcome every check that
//! waits for it gets. It runs in a task of its own, bounded by the connect timeout and not by a
//! check's budget: on a slow network an attempt that every check cut short would never end.

use std::sync::Mutex;

use tokio::sync::watch;

/// How an attempt went: `O`, or why not.
type Outcome<O> = Option<Result<O, String>>;

/// The attempt under way, if any.
pub(crate) struct Opening<O>(Mutex<Option<watch::Receiver<Outcome<O>>>>);

/// Where an attempt tells its outcome: [`Opening::end`].
pub(crate) type Done<O> = watch::Sender<Outcome<O>>;

impl<O> Default for Opening<O> {
    fn default() -> Self {
        Opening(Mutex::new(None))
    }
}

impl<O: Clone> Opening<O> {
    /// The outcome of the attempt under way, or of one that `start` begins (in a task of its
    /// own, which ends with [`end`](Self::end)).
    pub(crate) async fn join(&self, start: impl FnOnce(Done<O>)) -> Result<O, String> {
        let mut attempt = {
            let mut opening = self.0.lock().unwrap_or_else(|p| p.into_inner());
            match &*opening {
                // An attempt whose task went away (its runtime ended) tells nothing: another.
                Some(attempt) if attempt.has_changed().is_ok() => attempt.clone(),
                _ => {
                    let (done, attempt) = watch::channel(None);
                    *opening = Some(attempt.clone());
                    start(done);
                    attempt
                }
            }
        };
        attempt
            .wait_for(Option::is_some)
            .await
            .map(|outcome| outcome.clone())
            .ok()
            .flatten()
            .unwrap_or_else(|| Err("the connection attempt was dropped".to_owned()))
    }

    /// Ends the attempt under way with `outcome`, told through `done`.
    pub(crate) fn end(&self, done: Done<O>, outcome: Result<O, String>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = None;
        done.send_replace(Some(outcome));
    }
}
