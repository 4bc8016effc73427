//! Opening a connection: TCP (or TLS over it, feature `tls`) to a server's address, then signing
//! in (`AUTH`), choosing the database (`SELECT`) and a `PING`, answered before anything else is
//! sent: a server that refuses the connection (its client limit, a password it wants) says so
//! while it is being opened.

use std::io;
use std::pin::Pin;
#[cfg(feature = "tls")]
use std::sync::Arc;
use std::task::{Context, Poll};

use redis::{ConnectionAddr, ConnectionInfo, RedisError, RedisResult};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use crate::store::redis::resp::{self, Frame};

/// Where a connection goes and how it signs in.
#[derive(Clone)]
pub(crate) struct Target {
    host: String,
    port: u16,
    username: Option<String>,
    password: Option<String>,
    db: i64,
    /// TLS over the TCP connection, with the settings every connection of the store shares.
    #[cfg(feature = "tls")]
    tls: Option<Arc<super::tls::Tls>>,
    /// The address asks for TLS, which this build cannot speak (the builders refuse such a
    /// URL before): never opened in the clear.
    #[cfg(not(feature = "tls"))]
    wants_tls: bool,
    /// The simulated network that carries the connection instead of TCP (tests only).
    #[cfg(test)]
    network: Option<std::sync::Arc<dyn crate::store::redis::simulated::Network>>,
}

impl Target {
    /// The target of `info` (a TCP address: the builders refuse any other), over TLS with
    /// `tls` when its address asks for it.
    pub(crate) fn new(
        info: &ConnectionInfo,
        #[cfg(feature = "tls")] tls: Option<Arc<super::tls::Tls>>,
    ) -> Self {
        let (host, port, over_tls) = match info.addr() {
            ConnectionAddr::Tcp(host, port) => (host.clone(), *port, false),
            ConnectionAddr::TcpTls { host, port, .. } => (host.clone(), *port, true),
            other => (other.to_string(), 0, false),
        };
        let settings = info.redis_settings();
        Target {
            host,
            port,
            username: settings.username().map(str::to_owned),
            password: settings.password().map(str::to_owned),
            db: settings.db(),
            #[cfg(feature = "tls")]
            tls: tls.filter(|_| over_tls),
            #[cfg(not(feature = "tls"))]
            wants_tls: over_tls,
            #[cfg(test)]
            network: None,
        }
    }

    /// The same target, reached through `network` when one is given (tests only).
    #[cfg(test)]
    pub(crate) fn through(
        mut self,
        network: Option<std::sync::Arc<dyn crate::store::redis::simulated::Network>>,
    ) -> Self {
        self.network = network;
        self
    }

    /// The same target at another `host` and `port` (a node of a cluster).
    pub(crate) fn at(&self, host: &str, port: u16) -> Self {
        Target {
            host: host.to_owned(),
            port,
            ..self.clone()
        }
    }

    /// The database selected after signing in.
    pub(crate) fn db(&self) -> i64 {
        self.db
    }

    /// Connects, signs in, selects the database and pings.
    pub(crate) async fn open(&self) -> RedisResult<Stream> {
        #[cfg(not(feature = "tls"))]
        if self.wants_tls {
            return Err(RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "a rediss:// URL needs tollgate's feature `tls`",
            )));
        }
        #[cfg(test)]
        if let Some(network) = &self.network {
            let stream = Stream::Simulated(network.dial(&self.host, self.port).await?);
            return self.sign_in(stream).await;
        }
        let tcp = TcpStream::connect((self.host.as_str(), self.port)).await?;
        // Checks are small writes that must leave at once.
        tcp.set_nodelay(true)?;
        #[cfg(feature = "tls")]
        let stream = match &self.tls {
            Some(tls) => Stream::Tls(Box::new(tls.connect(&self.host, tcp).await?)),
            None => Stream::Tcp(tcp),
        };
        #[cfg(not(feature = "tls"))]
        let stream = Stream::Tcp(tcp);
        self.sign_in(stream).await
    }

    /// Signs in on `stream`, selects the database and pings.
    async fn sign_in(&self, mut stream: Stream) -> RedisResult<Stream> {
        let mut hello = Vec::new();
        let mut replies = 0;
        if let Some(password) = &self.password {
            let auth: Vec<&[u8]> = match &self.username {
                Some(user) => vec![b"AUTH", user.as_bytes(), password.as_bytes()],
                None => vec![b"AUTH", password.as_bytes()],
            };
            hello.extend(resp::command(&auth));
            replies += 1;
        }
        if self.db != 0 {
            hello.extend(resp::command(&[b"SELECT", self.db.to_string().as_bytes()]));
            replies += 1;
        }
        hello.extend(resp::command(&[b"PING"]));
        replies += 1;
        stream.write_all(&hello).await?;
        let mut buf = Vec::with_capacity(256);
        for _ in 0..replies {
            let frame = read_frame(&mut stream, &mut buf).await?;
            let reply = resp::value(&buf[..frame]);
            buf.drain(..frame);
            reply?.extract_error()?;
        }
        Ok(stream)
    }
}

/// Reads from `stream` into `buf` until it holds a whole reply; its length.
async fn read_frame(stream: &mut Stream, buf: &mut Vec<u8>) -> RedisResult<usize> {
    loop {
        match resp::frame(buf) {
            Ok(Frame::Whole(n)) => return Ok(n),
            Ok(Frame::Partial) => {}
            Err(resp::Malformed) => return Err(malformed()),
        }
        let mut chunk = [0u8; 512];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(closed());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// The error of a stream the server closed.
pub(crate) fn closed() -> RedisError {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the server closed the connection",
    )
    .into()
}

/// The error of a reply that is not RESP.
pub(crate) fn malformed() -> RedisError {
    RedisError::from((
        redis::ErrorKind::Parse,
        "the server's reply is not RESP; the connection is closed",
    ))
}

/// A connection's byte stream: TCP, or TLS over TCP.
pub(crate) enum Stream {
    Tcp(TcpStream),
    #[cfg(feature = "tls")]
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
    /// A simulated server's end of an in-memory pipe (tests only).
    #[cfg(test)]
    Simulated(tokio::io::DuplexStream),
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(tcp) => Pin::new(tcp).poll_read(cx, buf),
            #[cfg(feature = "tls")]
            Stream::Tls(tls) => Pin::new(tls).poll_read(cx, buf),
            #[cfg(test)]
            Stream::Simulated(pipe) => Pin::new(pipe).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(tcp) => Pin::new(tcp).poll_write(cx, buf),
            #[cfg(feature = "tls")]
            Stream::Tls(tls) => Pin::new(tls).poll_write(cx, buf),
            #[cfg(test)]
            Stream::Simulated(pipe) => Pin::new(pipe).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(tcp) => Pin::new(tcp).poll_flush(cx),
            #[cfg(feature = "tls")]
            Stream::Tls(tls) => Pin::new(tls).poll_flush(cx),
            #[cfg(test)]
            Stream::Simulated(pipe) => Pin::new(pipe).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(tcp) => Pin::new(tcp).poll_shutdown(cx),
            #[cfg(feature = "tls")]
            Stream::Tls(tls) => Pin::new(tls).poll_shutdown(cx),
            #[cfg(test)]
            Stream::Simulated(pipe) => Pin::new(pipe).poll_shutdown(cx),
        }
    }
}
