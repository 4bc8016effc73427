//! [`Connection`]: one connection to a Redis server, driven by a task of its own that sends the
//! checks queued meanwhile together in one call and reads the replies without building them.
//!
//! A check costs its request a place in the connection's queue and one wake-up when its reply
//! is read; the connection's task writes the call (one write for every check that queued while
//! calls were out), reads the replies (one read for as many as have come) and answers each
//! check its own. Everything else a store sends (loading the code, peeks, adjustments, `PING`,
//! `PUBLISH`, `CLUSTER SLOTS`) goes through the same queue as commands, through
//! [`ConnectionLike`].
//!
//! ```text
//! request ─► Connection::check(job) ─► queue ─► driver: one FCALL for the checks queued
//!                                                   ─► write ─► Redis ─► read: integers
//! request ◄── its reply (or Timeout at its deadline) ◄── driver ◄──────────┘
//! ```

mod call;
mod driver;
mod handle;
mod job;
mod shared;
mod stream;
#[cfg(feature = "tls")]
mod tls;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::RedisResult;

pub(crate) use self::handle::Connection;
pub(crate) use self::job::Job;
pub(crate) use self::shared::{Checks, Owner};
use self::shared::{Queue, Shared};
pub(crate) use self::stream::Target;
#[cfg(feature = "tls")]
pub(crate) use self::tls::Tls;
use crate::store::redis::health::Health;

/// Opens a connection to `target` (`server` names it in errors), signed in, whose health
/// reads a silence after time-outs against `response_timeout`; it sends checks as `checks`
/// says, if given. Its task runs on the current Tokio runtime.
pub(crate) async fn open(
    target: &Target,
    server: Arc<str>,
    response_timeout: Duration,
    checks: Option<Checks>,
) -> RedisResult<Connection> {
    let stream = target.open().await?;
    let shared = Arc::new(Shared {
        queue: Mutex::new(Queue {
            work: VecDeque::new(),
            waker: None,
            wants_checks: false,
            wake_at: 0,
            commands: 0,
        }),
        health: Health::new(response_timeout),
        handles: AtomicUsize::new(1),
        ended: AtomicBool::new(false),
        takes_checks: checks.is_some(),
        queued: AtomicUsize::new(0),
        server,
        db: target.db(),
    });
    tokio::spawn(driver::Driver::new(shared.clone(), stream, checks));
    Ok(Connection::from_shared(shared))
}
