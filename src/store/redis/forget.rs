//! What every replica learns when one of them gives budget back: the keys reset or refunded
//! anywhere, over Redis pub/sub, so that no replica keeps answering a denial that Redis would
//! no longer make.
//!
//! A reset or an adjustment made through a store is followed by a `PUBLISH` of each key's name
//! on the channel `<prefix>:forget` (on a cluster, classic pub/sub reaches every node). Every
//! store of that prefix listens on a connection of its own; a name it hears is a *tombstone*: a
//! denial cached before it was heard is not answered again (the next request of that key asks
//! Redis). While the listening connection is down, a message may be missed: when it is back,
//! every cached denial is dropped, and a cached denial never lives longer than its cap
//! ([`deny_cache_max_age`](crate::store::RedisStoreBuilder::deny_cache_max_age), default 5 s),
//! whatever the retry-after Redis computed.
//!
//! So after a reset or refund on replica A returns, replica B admits what Redis admits as soon
//! as the message reaches it (one hop through Redis: well under a millisecond on a LAN), and at
//! the latest after the cap when it was lost.

use std::sync::Weak;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, PushKind};

use super::local::Local;
use super::startup::{FIRST_RETRY_DELAY, MAX_RETRY_DELAY};

/// The channel of a prefix's forgotten keys.
pub(crate) fn channel(prefix: &str) -> String {
    format!("{prefix}:forget")
}

/// Publishes `names` (Redis key names) on `channel`, in one pipeline, on `conn`.
pub(crate) async fn publish(
    conn: &mut MultiplexedConnection,
    channel: &str,
    names: &[String],
) -> redis::RedisResult<()> {
    if names.is_empty() {
        return Ok(());
    }
    let mut pipe = redis::pipe();
    for name in names {
        pipe.cmd("PUBLISH").arg(channel).arg(name).ignore();
    }
    pipe.query_async::<()>(conn).await
}

/// Listens on `channel` for as long as `local` lives, through the first of `clients` that
/// answers (the next one when it goes away), and tells `local` each name it hears.
pub(crate) fn listen(
    local: Weak<Local>,
    clients: Vec<Client>,
    channel: String,
    connect_timeout: Duration,
) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        let mut delay = FIRST_RETRY_DELAY;
        let mut heard_before = false;
        for client in clients.iter().cycle() {
            if local.strong_count() == 0 {
                return;
            }
            let (pushes, mut heard) = tokio::sync::mpsc::unbounded_channel();
            let config = AsyncConnectionConfig::new()
                .set_connection_timeout(Some(connect_timeout))
                .set_push_sender(pushes);
            let subscribed = async {
                let mut conn = client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await?;
                conn.subscribe(&channel).await?;
                Ok::<_, redis::RedisError>(conn)
            };
            let Ok(Ok(conn)) = tokio::time::timeout(connect_timeout, subscribed).await else {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(MAX_RETRY_DELAY);
                continue;
            };
            delay = FIRST_RETRY_DELAY;
            if heard_before {
                // Messages sent while no connection listened are lost: what is cached may be.
                match local.upgrade() {
                    Some(local) => local.forget_everything(),
                    None => return,
                }
            }
            heard_before = true;
            loop {
                let push = tokio::select! {
                    push = heard.recv() => push,
                    // Looks now and then whether the store is still there.
                    () = tokio::time::sleep(Duration::from_secs(5)) => {
                        if local.strong_count() == 0 {
                            return;
                        }
                        continue;
                    }
                };
                let Some(push) = push else { break };
                match push.kind {
                    PushKind::Message => {
                        let Some(local) = local.upgrade() else {
                            return;
                        };
                        // [channel, name]
                        if let Some(redis::Value::BulkString(name)) = push.data.get(1) {
                            local.forgotten(name);
                        }
                    }
                    PushKind::Disconnection => break,
                    _ => {}
                }
            }
            drop(conn);
        }
    });
}
