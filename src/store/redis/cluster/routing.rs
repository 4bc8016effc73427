//! One call on the primary of a slot: sent at most once, following the answers that say the
//! script did not run (`MOVED`, `ASK`, `TRYAGAIN`, `NOSCRIPT`), within its [`Deadline`].

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use redis::{ErrorKind, RedisError, ServerErrorKind, Value};

use super::Cluster;
use super::deadline::Deadline;
use super::node::Node;
use crate::store::StoreError;
use crate::store::redis::error::{
    breaks_connection, is_server_answer, refuses_every_command, store_error,
};
use crate::store::redis::script::{self, Mode, Prepared, Reply, Request};

/// The most redirections (`MOVED`, `ASK`, `TRYAGAIN`) one call follows.
pub(super) const MAX_REDIRECTIONS: usize = 5;

/// What an error answer asks of the client when the script did not run.
pub(super) enum Redirection {
    /// The slot lives on another node now: send it there, and read the slot map again.
    Moved(String),
    /// The slot is migrating: send this one there, after `ASKING`.
    Ask(String),
    /// The keys are migrating: try again in a moment.
    TryAgain,
}

pub(super) fn redirection(error: &RedisError) -> Option<Redirection> {
    // `MOVED 3999 127.0.0.1:6381`: the slot, then the node's `host:port`.
    let target = || error.redirect_node().map(|(addr, _slot)| addr.to_owned());
    match error.kind() {
        ErrorKind::Server(ServerErrorKind::Moved) => target().map(Redirection::Moved),
        ErrorKind::Server(ServerErrorKind::Ask) => target().map(Redirection::Ask),
        ErrorKind::Server(ServerErrorKind::TryAgain) => Some(Redirection::TryAgain),
        _ => None,
    }
}

impl Cluster {
    /// One call of the script on the primary of `slot`, sent at most once: only answers that
    /// say the script did not run (`MOVED`, `ASK`, `TRYAGAIN`, `NOSCRIPT`) are followed by
    /// another send. `deadline` bounds the whole call.
    pub(super) async fn call(
        &self,
        slot: u16,
        mode: Mode,
        now: Option<u64>,
        charges: &[&Prepared],
        deadline: Deadline,
    ) -> Result<Value, StoreError> {
        let Deadline {
            budget,
            late: deadline,
        } = deadline;
        let requests = [Request { now, charges }];
        let topology = self
            .topology()
            .ok_or_else(|| self.parts.startup.not_connected(&self.servers))?;
        let Some(mut node) = topology.primary(slot).cloned() else {
            self.refresh_soon();
            return Err(StoreError::Unavailable(
                format!("{}: no primary serves slot {slot}", self.servers).into(),
            ));
        };
        let program = self.parts.program;
        let mut asking = false;
        for _ in 0..=MAX_REDIRECTIONS {
            // A script queued on a connection runs, whatever the caller does next:
            // with no budget left it is not sent at all (nor sent again after a redirection).
            if budget <= Instant::now() {
                return Err(StoreError::Timeout);
            }
            let Some(permit) = node.breaker().admit() else {
                self.refresh_soon();
                return Err(StoreError::CircuitOpen);
            };
            // `in_use` tells which connection a time-out caught.
            let mut in_use = None;
            let attempt = async {
                let conn = node.connection().await?;
                in_use = Some(conn.clone());
                // The node lost the code (a restart, a failover), or has no functions: it did
                // not run, and is loaded and sent again.
                let result = conn
                    .call(program, node.form(), mode, &requests, asking)
                    .await;
                match &result {
                    Err(e) if e.is_timeout() => conn.health().timed_out(),
                    Err(e) if breaks_connection(e) => conn.health().broke(),
                    _ => conn.health().answered(),
                }
                Ok::<_, StoreError>(result)
            };
            let left = deadline.saturating_duration_since(Instant::now());
            let result = match tokio::time::timeout(left, attempt).await {
                Ok(Ok(result)) => result,
                Ok(Err(error)) => {
                    self.failed(&node, permit, &error);
                    return Err(error);
                }
                Err(_) => {
                    if let Some(conn) = in_use {
                        conn.health().timed_out();
                    }
                    self.failed(&node, permit, &StoreError::Timeout);
                    return Err(StoreError::Timeout);
                }
            };
            let error = match result {
                Ok(value) if Instant::now() > budget => {
                    // Answered after a check's budget (a call that waits longer for its reply):
                    // for the breaker and the connection, a time-out.
                    if let Some(conn) = in_use {
                        conn.health().timed_out();
                    }
                    self.failed(&node, permit, &StoreError::Timeout);
                    return Ok(value);
                }
                Ok(value) => {
                    node.breaker().success(permit);
                    return Ok(value);
                }
                Err(error) => error,
            };
            match redirection(&error) {
                Some(Redirection::Moved(addr)) => {
                    node.breaker().success(permit);
                    let target = self.node(&addr)?;
                    self.moved(slot, target.clone());
                    self.refresh_soon();
                    node = target;
                    asking = false;
                }
                Some(Redirection::Ask(addr)) => {
                    node.breaker().success(permit);
                    node = self.node(&addr)?;
                    asking = true;
                }
                Some(Redirection::TryAgain) => {
                    node.breaker().success(permit);
                    let pause = Duration::from_millis(10)
                        .min(deadline.saturating_duration_since(Instant::now()));
                    tokio::time::sleep(pause).await;
                }
                None if is_server_answer(&error) && !refuses_every_command(&error) => {
                    // The node answered at once (`CLUSTERDOWN` while a primary fails over, a
                    // script error…): its breaker has nothing to spare; the slot map may be
                    // changing. `LOADING` or `BUSY` refuse every call, so they count against
                    // the breaker below.
                    node.breaker().success(permit);
                    self.refresh_soon();
                    return Err(store_error(node.server(), error));
                }
                None => {
                    let error = store_error(node.server(), error);
                    self.failed(&node, permit, &error);
                    return Err(error);
                }
            }
        }
        Err(StoreError::Unavailable(
            format!(
                "{}: more than {MAX_REDIRECTIONS} redirections for slot {slot}",
                self.servers
            )
            .into(),
        ))
    }

    /// A call to `node` failed: its breaker learns of it, and the slot map is read again (the
    /// node may have failed over).
    pub(super) fn failed(
        &self,
        node: &Arc<Node>,
        permit: crate::store::breaker::Permit,
        error: &StoreError,
    ) {
        if node.breaker().failure(permit) {
            tracing::error!(
                server = &**node.server(),
                %error,
                "tollgate: a Redis Cluster node keeps failing; its circuit breaker opened: \
                 checks of its slots are decided by each rule's FailureMode until a probe \
                 succeeds, the other slots as usual"
            );
            node.probe_in_background();
        }
        self.refresh_soon();
    }

    pub(super) async fn reply(
        &self,
        slot: u16,
        mode: Mode,
        now: Option<u64>,
        charges: &[&Prepared],
        deadline: Deadline,
    ) -> Result<Reply, StoreError> {
        let value = self.call(slot, mode, now, charges, deadline).await?;
        let requests = [Request { now, charges }];
        let mut replies = script::decode(value, &requests)?;
        replies
            .pop()
            .ok_or_else(|| StoreError::Protocol("the rate-limit code answered no request".into()))
    }
}
