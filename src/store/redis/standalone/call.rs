//! One call to the server within a check's time budget, and what the connection's health and the
//! circuit breaker learn from it.

use std::sync::Arc;

use ::redis::Value;

use super::Standalone;
use crate::store::StoreError;
use crate::store::breaker::Permit;
use crate::store::redis::error::{breaks_connection, is_demoted, is_server_answer, store_error};
use crate::store::redis::probe;
use crate::store::redis::remote::Transport;
use crate::store::redis::script::{Mode, Prepared, Request};

impl Standalone {
    /// Sends `requests` in one call within the time budget of a check, and tells the
    /// connection's health and the breaker how it went.
    pub(super) async fn run(
        &self,
        mode: Mode,
        requests: &[Request<'_, Prepared>],
        permit: Permit,
        deadline: tokio::time::Instant,
    ) -> Result<Value, StoreError> {
        self.run_until(mode, requests, permit, deadline, deadline)
            .await
    }

    /// [`run`](Self::run), waiting for the answer until `late`: one that comes after `budget`
    /// is returned, and told to the breaker and the connection's health as a time-out (the
    /// server did not answer within a check's budget).
    pub(super) async fn run_until(
        &self,
        mode: Mode,
        requests: &[Request<'_, Prepared>],
        permit: Permit,
        budget: tokio::time::Instant,
        deadline: tokio::time::Instant,
    ) -> Result<Value, StoreError> {
        // One timer for the whole check; `in_use` tells which connection a time-out caught.
        let mut in_use = None;
        let attempt = async {
            let (mut conn, health) = self.connection().await?;
            in_use = Some(health.clone());
            let result = self
                .parts
                .program
                .call(&mut conn, &self.form, mode, requests)
                .await;
            let answered = match &result {
                Err(e) if e.is_timeout() => {
                    health.timed_out();
                    false
                }
                Err(e) if breaks_connection(e) => {
                    health.broke();
                    false
                }
                Ok(_) => true,
                Err(e) if is_demoted(e) => {
                    // The server became a replica (a failover behind a DNS name or a proxy):
                    // a new connection finds the primary.
                    health.broke();
                    true
                }
                Err(e) => is_server_answer(e),
            };
            if answered {
                health.answered();
            }
            Ok((result.map_err(|e| store_error(&self.server, e)), answered))
        };
        let result = tokio::time::timeout_at(deadline, attempt).await;
        let (result, answered) = match result {
            Ok(Ok(sent)) => sent,
            Ok(Err(error)) => (Err(error), false),
            Err(_elapsed) => {
                if let Some(health) = &in_use {
                    health.timed_out();
                }
                (Err(StoreError::Timeout), false)
            }
        };
        if deadline > budget && tokio::time::Instant::now() > budget {
            // Answered late: for the breaker, a time-out, whatever the answer.
            if answered && let Some(health) = &in_use {
                health.timed_out();
            }
            self.report(permit, false, &Err(StoreError::Timeout));
        } else {
            self.report(permit, answered, &result);
        }
        result
    }

    /// Tells the breaker how a check went (a server that answered, even with an error, is up),
    /// and says so when it opens.
    pub(super) fn report(
        &self,
        permit: Permit,
        answered: bool,
        result: &Result<Value, StoreError>,
    ) {
        let Err(error) = result else {
            return self.breaker.success(permit);
        };
        if answered {
            self.breaker.success(permit);
        } else if self.breaker.failure(permit) {
            tracing::error!(
                server = &*self.server,
                %error,
                "tollgate: Redis keeps failing; its circuit breaker opened: requests are \
                 decided by each rule's FailureMode until a probe succeeds"
            );
            self.probe_in_background();
        }
    }

    /// Probes the server once per cooldown while the breaker is open (see [`probe`]).
    pub(super) fn probe_in_background(&self) {
        if let Some(me) = self.me.upgrade() {
            probe::in_background(&me, u32::MAX);
        }
    }

    /// One call of `charges` outside the batches (peeks, adjustments, resets), within a
    /// check's time budget.
    pub(super) async fn direct(
        self: &Arc<Self>,
        mode: Mode,
        now: Option<u64>,
        charges: &[Prepared],
    ) -> Result<Value, StoreError> {
        self.start();
        if let Some(error) = self.unsendable() {
            return Err(error);
        }
        let Some(permit) = self.breaker.admit() else {
            return Err(StoreError::CircuitOpen);
        };
        let requests = [Request { now, charges }];
        let deadline = tokio::time::Instant::now() + self.parts.settings.response_timeout;
        self.run(mode, &requests, permit, deadline).await
    }
}
