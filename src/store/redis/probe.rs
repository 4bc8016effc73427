//! The circuit breaker's probe: while a server's breaker is open, the store itself sends a
//! `PING` once per cooldown, in a task of its own, until one is answered; no request waits for
//! it. The standalone store probes its server, the cluster store each node whose breaker opened.
//! Only an answer a check would take closes the breaker: a `PONG` (or `NOPERM`, a user not
//! allowed `PING`), not `LOADING` or `BUSY`, which refuse the checks as well.

use std::future::Future;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::connection::Connection;
use super::error::breaks_connection;
use crate::store::StoreError;
use crate::store::breaker::Breaker;

/// Whether `error` refuses the probe's `PING` alone: a user whose ACL lacks `+ping`
/// (`NOPERM`); the checks' own commands have their own permissions, and the server answers.
fn refuses_only_the_ping(error: &redis::RedisError) -> bool {
    matches!(
        error.kind(),
        redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm)
    )
}

/// A server whose breaker can be probed: a standalone store's, or a cluster node's.
pub(crate) trait Probed: Send + Sync + 'static {
    fn breaker(&self) -> &Breaker;

    /// The time a probe may take (a check's budget).
    fn probe_timeout(&self) -> Duration;

    /// A connection to the server (opened when there is none).
    fn probe_connection(
        self: Arc<Self>,
    ) -> impl Future<Output = Result<Connection, StoreError>> + Send;
}

/// Probes `target` once per cooldown while its breaker is open, until a probe is answered, the
/// target is dropped, or `max_failures` probes in a row failed (then requests probe, a cooldown
/// late: `Breaker::admit`).
pub(crate) fn in_background<P: Probed>(target: &Arc<P>, max_failures: u32) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let target: Weak<P> = Arc::downgrade(target);
    runtime.spawn(async move {
        let mut failed = 0;
        while failed < max_failures {
            let Some(wait) = target.upgrade().and_then(|t| t.breaker().until_probe()) else {
                return;
            };
            tokio::time::sleep(wait).await;
            let Some(probed) = target.upgrade() else {
                return;
            };
            let Some(permit) = probed.breaker().admit_probe() else {
                // Another probe is out (or a request took the turn): its time first.
                let cooldown = probed.breaker().cooldown();
                drop(probed);
                tokio::time::sleep(cooldown).await;
                continue;
            };
            let mut in_use = None;
            let ping = async {
                let mut conn = probed.clone().probe_connection().await?;
                in_use = Some(conn.clone());
                let pong = redis::cmd("PING").query_async::<()>(&mut conn).await;
                match &pong {
                    Err(e) if e.is_timeout() => conn.health().timed_out(),
                    Err(e) if breaks_connection(e) => conn.health().broke(),
                    _ => conn.health().answered(),
                }
                Ok::<_, StoreError>(pong)
            };
            match tokio::time::timeout(probed.probe_timeout(), ping).await {
                Ok(Ok(Ok(()))) => probed.breaker().success(permit),
                Ok(Ok(Err(e))) if refuses_only_the_ping(&e) => probed.breaker().success(permit),
                // A server that answers at once but refuses every command (`LOADING` while it
                // reads its data, `BUSY` while a script runs past its time) would refuse the
                // checks too: it is not back, and its breaker stays open.
                Ok(_) => {
                    failed += 1;
                    probed.breaker().failure(permit);
                }
                Err(_) => {
                    // A connection that stays silent is retired, as a check's would be.
                    if let Some(conn) = in_use {
                        conn.health().timed_out();
                    }
                    failed += 1;
                    probed.breaker().failure(permit);
                }
            }
        }
    });
}
