//! A TCP proxy between a store and its Redis, to add latency or cut the connection.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Forwards loopback connections to a Redis port. Stops with the runtime that started it.
pub struct FaultProxy {
    pub port: u16,
    delay_micros: Arc<AtomicU64>,
    cut: watch::Sender<bool>,
    forwarded: Arc<AtomicU64>,
}

impl FaultProxy {
    /// A proxy to `127.0.0.1:target` on a free port.
    pub async fn start(target: u16) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let port = listener.local_addr().unwrap().port();
        let delay_micros = Arc::new(AtomicU64::new(0));
        let forwarded = Arc::new(AtomicU64::new(0));
        let (cut, cut_rx) = watch::channel(false);
        let (delay, count) = (delay_micros.clone(), forwarded.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if *cut_rx.borrow() {
                    continue; // dropped: refused as soon as it was accepted
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await else {
                    continue;
                };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(pump(
                    client_read,
                    server_write,
                    delay.clone(),
                    count.clone(),
                    cut_rx.clone(),
                ));
                tokio::spawn(pump(
                    server_read,
                    client_write,
                    delay.clone(),
                    Arc::default(),
                    cut_rx.clone(),
                ));
            }
        });
        FaultProxy {
            port,
            delay_micros,
            cut,
            forwarded,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Delays every chunk of bytes, in both directions.
    pub fn set_delay(&self, delay: Duration) {
        self.delay_micros
            .store(delay.as_micros() as u64, Ordering::SeqCst);
    }

    /// Closes every connection and refuses new ones (`true`), or lets them through again.
    pub fn set_cut(&self, cut: bool) {
        self.cut.send_replace(cut);
    }

    /// `EVALSHA` commands delivered to Redis so far (rate-limit checks).
    pub fn checks_delivered(&self) -> u64 {
        self.forwarded.load(Ordering::SeqCst)
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay_micros: Arc<AtomicU64>,
    count: Arc<AtomicU64>,
    mut cut: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    // Mark the current value seen, so that `changed` waits for the next cut.
    if *cut.borrow_and_update() {
        return;
    }
    loop {
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            _ = cut.changed() => return,
        };
        let delay = delay_micros.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_micros(delay)).await;
        }
        if *cut.borrow() || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
        let checks = buf[..n].windows(7).filter(|w| w == b"EVALSHA").count();
        count.fetch_add(checks as u64, Ordering::SeqCst);
    }
}
