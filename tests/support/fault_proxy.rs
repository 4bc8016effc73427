//! A TCP proxy between a store and its Redis, to add latency or cut the connection.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// Forwards loopback connections to a Redis port. Stops with the runtime that started it.
pub struct FaultProxy {
    pub port: u16,
    delay_micros: Arc<AtomicU64>,
    connect_delay_micros: Arc<AtomicU64>,
    cut: watch::Sender<bool>,
    forwarded: Arc<AtomicU64>,
    accepted: Arc<AtomicU64>,
    faults: Arc<Faults>,
}

/// The one-shot fault: lose the reply of the next check.
#[derive(Default)]
struct Faults {
    /// Armed: the next call (`FCALL` or `EVALSHA`) is delivered, then the link is cut before its reply returns.
    cut_after_next_check: AtomicBool,
    /// Replies are being dropped (the cut is under way).
    swallowing: AtomicBool,
}

impl FaultProxy {
    /// A proxy to `127.0.0.1:target` on a free port.
    pub async fn start(target: u16) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let port = listener.local_addr().unwrap().port();
        let delay_micros = Arc::new(AtomicU64::new(0));
        let connect_delay_micros = Arc::new(AtomicU64::new(0));
        let connect_delay = connect_delay_micros.clone();
        let forwarded = Arc::new(AtomicU64::new(0));
        let accepted = Arc::new(AtomicU64::new(0));
        let faults = Arc::new(Faults::default());
        let (cut, cut_rx) = watch::channel(false);
        let (delay, count, connections) =
            (delay_micros.clone(), forwarded.clone(), accepted.clone());
        let (cutter, fault) = (cut.clone(), faults.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if *cut_rx.borrow() {
                    continue; // dropped: refused as soon as it was accepted
                }
                connections.fetch_add(1, Ordering::SeqCst);
                let (delay, count, cut_rx, cutter, fault) = (
                    delay.clone(),
                    count.clone(),
                    cut_rx.clone(),
                    cutter.clone(),
                    fault.clone(),
                );
                let connect_delay = connect_delay.load(Ordering::SeqCst);
                tokio::spawn(async move {
                    // A TCP handshake's round trip, where the network is slow.
                    if connect_delay > 0 {
                        tokio::time::sleep(Duration::from_micros(connect_delay)).await;
                    }
                    let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await else {
                        return;
                    };
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    tokio::spawn(pump(
                        client_read,
                        server_write,
                        Direction::ToServer,
                        Link {
                            delay: delay.clone(),
                            count: count.clone(),
                            cut: cut_rx.clone(),
                            cutter: cutter.clone(),
                            faults: fault.clone(),
                        },
                    ));
                    tokio::spawn(pump(
                        server_read,
                        client_write,
                        Direction::ToClient,
                        Link {
                            delay: delay.clone(),
                            count: Arc::default(),
                            cut: cut_rx.clone(),
                            cutter: cutter.clone(),
                            faults: fault.clone(),
                        },
                    ));
                });
            }
        });
        FaultProxy {
            port,
            delay_micros,
            connect_delay_micros,
            cut,
            forwarded,
            accepted,
            faults,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Delays every chunk of bytes, in both directions, by `delay` from when the proxy read it
    /// (a latency: chunks on their way together each wait one delay, not one after another).
    pub fn set_delay(&self, delay: Duration) {
        self.delay_micros
            .store(delay.as_micros() as u64, Ordering::SeqCst);
    }

    /// Delays each new connection before it reaches Redis, as a slow network's TCP handshake
    /// does (the client's connect completes, its first bytes wait).
    pub fn set_connect_delay(&self, delay: Duration) {
        self.connect_delay_micros
            .store(delay.as_micros() as u64, Ordering::SeqCst);
    }

    /// Closes every connection and refuses new ones (`true`), or lets them through again.
    pub fn set_cut(&self, cut: bool) {
        if !cut {
            self.faults.swallowing.store(false, Ordering::SeqCst);
        }
        self.cut.send_replace(cut);
    }

    /// Arms a one-shot fault: the next call (`FCALL` or `EVALSHA`) reaches Redis, then every connection is cut
    /// before its reply comes back (and new ones are refused until [`set_cut`](Self::set_cut)
    /// `(false)`): the check ran, its client never learns how.
    pub fn cut_after_next_check(&self) {
        self.faults
            .cut_after_next_check
            .store(true, Ordering::SeqCst);
    }

    /// Whether the armed fault has struck.
    pub fn has_cut(&self) -> bool {
        *self.cut.borrow()
    }

    /// Connections accepted so far (a reconnect storm shows here).
    pub fn connections_accepted(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }

    /// Calls of tollgate's code (`FCALL`, `EVALSHA`) delivered to Redis so far.
    pub fn checks_delivered(&self) -> u64 {
        self.forwarded.load(Ordering::SeqCst)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    ToServer,
    ToClient,
}

/// What both directions of a proxied connection share.
struct Link {
    delay: Arc<AtomicU64>,
    /// Checks delivered (the client-to-server direction counts them).
    count: Arc<AtomicU64>,
    cut: watch::Receiver<bool>,
    cutter: watch::Sender<bool>,
    faults: Arc<Faults>,
}

/// Forwards `from` to `to`, in order: each chunk is read as soon as it comes and written once
/// the delay set when it was read has passed. The delay is a latency, as on a network, not a
/// queue: chunks on their way together each wait one delay (a heartbeat sent just before a
/// check does not hold the check back by a delay more).
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    to: tokio::net::tcp::OwnedWriteHalf,
    direction: Direction,
    mut link: Link,
) {
    let mut buf = vec![0u8; 16 * 1024];
    // Mark the current value seen, so that `changed` waits for the next cut.
    if *link.cut.borrow_and_update() {
        return;
    }
    let (in_flight, arriving) = mpsc::unbounded_channel();
    let delay = link.delay.clone();
    let mut cut = link.cut.clone();
    tokio::spawn(deliver(arriving, to, direction, link));
    loop {
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            _ = cut.changed() => return,
        };
        let due = Instant::now() + Duration::from_micros(delay.load(Ordering::SeqCst));
        if in_flight.send((due, buf[..n].to_vec())).is_err() {
            return; // the other side's link is gone
        }
    }
}

/// Writes each chunk of `arriving` to `to` when it is due, until the link is cut.
async fn deliver(
    mut arriving: mpsc::UnboundedReceiver<(Instant, Vec<u8>)>,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    direction: Direction,
    mut link: Link,
) {
    while let Some((due, chunk)) = arriving.recv().await {
        tokio::select! {
            () = tokio::time::sleep_until(due) => {}
            _ = link.cut.changed() => return,
        }
        if direction == Direction::ToClient && link.faults.swallowing.load(Ordering::SeqCst) {
            return; // the reply is lost with the link
        }
        let checks = if direction == Direction::ToServer {
            calls_of_code(&chunk)
        } else {
            0
        };
        let strike = direction == Direction::ToServer
            && checks > 0
            && link
                .faults
                .cut_after_next_check
                .swap(false, Ordering::SeqCst);
        if strike {
            link.faults.swallowing.store(true, Ordering::SeqCst);
        }
        if *link.cut.borrow() || to.write_all(&chunk).await.is_err() {
            return;
        }
        link.count.fetch_add(checks as u64, Ordering::SeqCst);
        if strike {
            // Let Redis run it, then cut every link before anything else goes through.
            tokio::time::sleep(Duration::from_millis(50)).await;
            link.cutter.send_replace(true);
            return;
        }
    }
}

/// The calls of tollgate's code in `bytes` sent to Redis: bulk strings `FCALL` (the call of its
/// function) or `EVALSHA` (of its script), as RESP sends a command's name. The words inside a
/// longer argument (the script's own source, which `SCRIPT LOAD` sends, names `EVALSHA`) are not
/// calls.
fn calls_of_code(bytes: &[u8]) -> usize {
    let named = |name: &[u8]| {
        let header = [format!("${}\r\n", name.len()).as_bytes(), name, b"\r\n"].concat();
        bytes
            .windows(header.len())
            .filter(|window| *window == header.as_slice())
            .count()
    };
    named(b"FCALL") + named(b"EVALSHA")
}

/// A cluster whose every node is reached through a fault proxy: each node announces its proxy's
/// port, so that clients (and their redirections) never bypass it.
pub async fn cluster_behind_proxies() -> (super::RedisCluster, Vec<FaultProxy>) {
    let runtime = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        let mut proxies = Vec::new();
        // Called for each node as it starts (again for all of them if a start is retried).
        let cluster = super::RedisCluster::start_announcing(|i, port| {
            let proxy = runtime.block_on(FaultProxy::start(port));
            let to = proxy.port;
            proxies.truncate(i);
            proxies.push(proxy);
            to
        });
        (cluster, proxies)
    })
    .await
    .unwrap()
}
