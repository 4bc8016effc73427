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
//!
//! Every reset or refund publishes, whether or not some replica cached a denial of that key: no
//! replica can know that without a mark that every denial writes to Redis, a write on the very
//! path a flood of denials takes. What the messages cost is bounded instead: a replica keeps the
//! tombstones of 65,536 keys for at least a minute (about 1,090 keys forgotten a second, fleet
//! wide); past that it drops every cached denial at once. That is safe: the next request of each
//! denied key asks Redis again, so it costs calls to Redis, never budget. A listener that cannot
//! subscribe (a user without the channel in its ACL: `NOPERM`) says so, with the server's
//! reason, at most once a minute; its replica's cached denials then end by their cap.

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

pub(crate) use super::push::Push;
use redis::{AsyncConnectionConfig, Client, ConnectionInfo, ProtocolVersion, PushInfo, PushKind};

use super::connection::Connection;
use super::error::{is_server_answer, store_error};
use super::replica::Replica;
use super::startup::{FIRST_RETRY_DELAY, MAX_RETRY_DELAY};
use crate::store::StoreError;
use crate::throttle::Every;

/// The channel of a prefix's forgotten keys.
pub(crate) fn channel(prefix: &str) -> String {
    format!("{prefix}:forget")
}

/// The client of a listening connection to the server of `info`: RESP3, whose push messages
/// carry what the channel hears (Redis 6 and later, Valkey).
pub(crate) fn client(info: ConnectionInfo) -> redis::RedisResult<Client> {
    let redis = info
        .redis_settings()
        .clone()
        .set_protocol(ProtocolVersion::RESP3);
    Client::open(info.set_redis_settings(redis))
}

/// Publishes `names` on `channel` on the connection `connection` brings (to `server`), within
/// `budget`.
pub(crate) async fn publish_within(
    connection: impl Future<Output = Result<Connection, StoreError>>,
    server: &Arc<str>,
    channel: &str,
    names: &[String],
    budget: Duration,
) -> Result<(), StoreError> {
    let publish = async {
        let mut conn = connection.await?;
        publish(&mut conn, channel, names)
            .await
            .map_err(|e| store_error(server, e))
    };
    tokio::time::timeout(budget, publish)
        .await
        .unwrap_or(Err(StoreError::Timeout))
}

/// Publishes `names` (Redis key names) on `channel`, in one pipeline, on `conn`.
async fn publish(conn: &mut Connection, channel: &str, names: &[String]) -> redis::RedisResult<()> {
    if names.is_empty() {
        return Ok(());
    }
    let mut pipe = redis::pipe();
    for name in names {
        pipe.cmd("PUBLISH").arg(channel).arg(name).ignore();
    }
    pipe.query_async::<()>(conn).await
}

/// The most messages waiting to be read; past it, every cached denial is dropped (as if the
/// listener had missed them).
const WAITING: usize = 4096;

/// A listening connection that broke sooner than this after it subscribed waits before the
/// next (a server that drops subscribers at once is not asked in a loop).
const SETTLED: Duration = Duration::from_secs(10);

/// Says why a subscription was not made.
#[derive(Debug)]
pub(crate) enum NotSubscribed {
    /// The server did not answer (the store's own calls say so already).
    Unreachable,
    /// The server answered with a refusal, such as `NOPERM` for a user without the channel:
    /// the server's words.
    Refused(String),
}

/// A way to subscribe to the channel: redis-rs's pub/sub (or, in tests, a simulated network).
pub(crate) trait Subscriber: Send + Sync + 'static {
    /// A subscribed connection.
    type Link: Send;

    /// Subscribes to `channel` through the `attempt`-th way there is (they are tried in turn),
    /// within `timeout`: the link, the pushes it hears, and a flag set when some were lost
    /// (more waited than the receiver holds).
    fn subscribe(
        &self,
        attempt: usize,
        channel: &str,
        timeout: Duration,
    ) -> impl Future<Output = Result<(Self::Link, Heard), NotSubscribed>> + Send;

    /// Whether `link` still answers, within `timeout`.
    fn ping(&self, link: &mut Self::Link, timeout: Duration) -> impl Future<Output = bool> + Send;
}

/// The pushes a subscribed link hears, and whether some were lost.
pub(crate) struct Heard {
    pub(crate) pushes: tokio::sync::mpsc::Receiver<Push>,
    pub(crate) overflowed: Arc<AtomicBool>,
}

/// redis-rs's pub/sub, through each of its clients in turn.
struct Clients(Vec<Client>);

impl Subscriber for Clients {
    type Link = redis::aio::MultiplexedConnection;

    async fn subscribe(
        &self,
        attempt: usize,
        channel: &str,
        timeout: Duration,
    ) -> Result<(Self::Link, Heard), NotSubscribed> {
        let client = self
            .0
            .get(attempt % self.0.len().max(1))
            .ok_or(NotSubscribed::Unreachable)?;
        let (pushes, heard) = tokio::sync::mpsc::channel(WAITING);
        let overflowed = Arc::new(AtomicBool::new(false));
        let full = overflowed.clone();
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_push_sender(move |push: PushInfo| -> Result<(), Infallible> {
                let push = match push.kind {
                    PushKind::Message => match push.data.get(1) {
                        // [channel, name]
                        Some(redis::Value::BulkString(name)) => Push::Message(name.clone()),
                        _ => Push::Other,
                    },
                    PushKind::Disconnection => Push::Disconnected,
                    _ => Push::Other,
                };
                if pushes.try_send(push).is_err() {
                    full.store(true, Ordering::Relaxed);
                }
                Ok(())
            });
        let subscribed = async {
            let mut conn = client
                .get_multiplexed_async_connection_with_config(&config)
                .await?;
            conn.subscribe(channel).await?;
            Ok::<_, redis::RedisError>(conn)
        };
        match tokio::time::timeout(timeout, subscribed).await {
            Ok(Ok(conn)) => Ok((
                conn,
                Heard {
                    pushes: heard,
                    overflowed,
                },
            )),
            Ok(Err(error)) if is_server_answer(&error) => {
                Err(NotSubscribed::Refused(error.to_string()))
            }
            _ => Err(NotSubscribed::Unreachable),
        }
    }

    async fn ping(&self, link: &mut Self::Link, timeout: Duration) -> bool {
        let ping = redis::cmd("PING");
        let pong = ping.query_async::<redis::Value>(link);
        matches!(tokio::time::timeout(timeout, pong).await, Ok(Ok(_)))
    }
}

/// Listens on `channel` for as long as `replica` lives, through the first of `clients` that
/// answers (the next one when it goes away), and tells `replica` each name it hears. The
/// connection is pinged every 5 s (a link that vanished without a reset tells nothing else);
/// one that does not answer within the connect timeout is replaced.
pub(crate) fn listen(
    replica: Weak<Replica>,
    clients: Vec<Client>,
    channel: String,
    connect_timeout: Duration,
) {
    if clients.is_empty() {
        return;
    }
    listen_through(replica, Clients(clients), channel, connect_timeout);
}

/// [`listen`], through `subscriber`.
pub(crate) fn listen_through<S: Subscriber>(
    replica: Weak<Replica>,
    subscriber: S,
    channel: String,
    connect_timeout: Duration,
) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        let mut delay = FIRST_RETRY_DELAY;
        let mut heard_before = false;
        let warned = Every::new();
        for attempt in 0.. {
            if replica.strong_count() == 0 {
                return;
            }
            let (mut link, mut heard) = match subscriber
                .subscribe(attempt, &channel, connect_timeout)
                .await
            {
                Ok(subscribed) => subscribed,
                Err(not) => {
                    if let NotSubscribed::Refused(reason) = not
                        && warned.due(crate::clock::unix_micros(), 60_000_000)
                    {
                        tracing::warn!(
                            %reason,
                            channel = %channel,
                            "tollgate: cannot listen for the keys other replicas reset or refund; \
                             this replica's cached denials of them end by their cap \
                             (deny_cache_max_age) (said at most once a minute)"
                        );
                    }
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(MAX_RETRY_DELAY);
                    continue;
                }
            };
            let since = tokio::time::Instant::now();
            if heard_before {
                // Messages sent while no connection listened are lost: what is cached may be.
                match replica.upgrade() {
                    Some(replica) => replica.forget_everything(),
                    None => return,
                }
            }
            heard_before = true;
            loop {
                let Ok(push) =
                    tokio::time::timeout(Duration::from_secs(5), heard.pushes.recv()).await
                else {
                    // Quiet for 5 s: the store still there, and the link still answering?
                    if replica.strong_count() == 0 {
                        return;
                    }
                    if subscriber.ping(&mut link, connect_timeout).await {
                        continue;
                    }
                    break;
                };
                let Some(push) = push else { break };
                let Some(replica) = replica.upgrade() else {
                    return;
                };
                if heard.overflowed.swap(false, Ordering::Relaxed) {
                    replica.forget_everything();
                }
                match push {
                    Push::Message(name) => replica.forgotten(name.as_slice()),
                    Push::Disconnected => break,
                    Push::Other => {}
                }
            }
            drop(link);
            if since.elapsed() < SETTLED {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(MAX_RETRY_DELAY);
            } else {
                delay = FIRST_RETRY_DELAY;
            }
        }
    });
}

#[cfg(test)]
impl Subscriber for super::simulated::Subscribing {
    type Link = ();

    async fn subscribe(
        &self,
        attempt: usize,
        channel: &str,
        timeout: std::time::Duration,
    ) -> Result<((), Heard), NotSubscribed> {
        let (host, port) = self
            .servers
            .get(attempt % self.servers.len().max(1))
            .ok_or(NotSubscribed::Unreachable)?;
        let subscribed = self.network.subscribe(host, *port, channel);
        match tokio::time::timeout(timeout, subscribed).await {
            Ok(Ok(pushes)) => Ok((
                (),
                Heard {
                    pushes,
                    overflowed: Arc::default(),
                },
            )),
            _ => Err(NotSubscribed::Unreachable),
        }
    }

    async fn ping(&self, _link: &mut (), _timeout: std::time::Duration) -> bool {
        // A simulated link that drops ends its receiver: one that is still there answers.
        true
    }
}
