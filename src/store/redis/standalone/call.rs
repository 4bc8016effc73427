//! One call outside the batches (peeks, adjustments, resets) within a check's time budget, and
//! what the circuit breaker learns from calls.

use std::sync::Arc;

use ::redis::Value;

use super::Standalone;
use crate::store::StoreError;
use crate::store::breaker::Permit;
use crate::store::redis::error::{
    breaks_connection, is_demoted, is_server_answer, refuses_every_command, store_error,
};
use crate::store::redis::probe;
use crate::store::redis::remote::Transport;
use crate::store::redis::script::{Mode, Prepared, Request};

impl Standalone {
    /// Tells the breaker how a call went (a server that answered, even with an error, is up),
    /// and says so when it opens.
    pub(super) fn report(&self, permit: Permit, answered: bool, error: Option<&StoreError>) {
        let Some(error) = error else {
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
        // `in_use` tells which connection a time-out caught.
        let mut in_use = None;
        let attempt = async {
            let conn = self.connection().await?;
            in_use = Some(conn.clone());
            let result = conn
                .call(self.parts.program, &self.form, mode, &requests, false)
                .await;
            let answered = match &result {
                Err(e) if e.is_timeout() => {
                    conn.health().timed_out();
                    false
                }
                Err(e) if breaks_connection(e) => {
                    conn.health().broke();
                    false
                }
                Ok(_) => true,
                Err(e) if is_demoted(e) => {
                    // The server became a replica (a failover behind a DNS name or a proxy):
                    // a new connection finds the primary.
                    conn.health().broke();
                    true
                }
                Err(e) => is_server_answer(e),
            };
            if answered {
                conn.health().answered();
            }
            // The connection is sound, but a server that refuses every command is not back.
            let answered = answered && !matches!(&result, Err(e) if refuses_every_command(e));
            Ok((result.map_err(|e| store_error(&self.server, e)), answered))
        };
        let (result, answered) = match tokio::time::timeout_at(deadline, attempt).await {
            Ok(Ok(sent)) => sent,
            Ok(Err(error)) => (Err(error), false),
            Err(_elapsed) => {
                if let Some(conn) = &in_use {
                    conn.health().timed_out();
                }
                (Err(StoreError::Timeout), false)
            }
        };
        self.report(permit, answered, result.as_ref().err());
        result
    }
}
