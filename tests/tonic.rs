//! The layer in front of a generated tonic service (the standard health service).
#![cfg(feature = "tonic")]

use tollgate::{Quota, RateLimitLayer, Rule};
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

/// 2 calls per hour per peer.
fn limits() -> RateLimitLayer {
    RateLimitLayer::builder()
        .rule(Rule::new("grpc", Quota::per_hour(2)))
        .build()
        .unwrap()
}

async fn client(addr: std::net::SocketAddr) -> HealthClient<Channel> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    HealthClient::new(channel)
}

fn request() -> HealthCheckRequest {
    HealthCheckRequest {
        service: String::new(),
    }
}

#[tokio::test]
async fn server_builder_layer_wraps_a_generated_service_and_limits_by_peer_ip() {
    let (_reporter, health) = tonic_health::server::health_reporter();
    let limits = limits();

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .layer(limits)
            .add_service(health)
            .serve_with_incoming(incoming),
    );

    let mut client = client(addr).await;
    for _ in 0..2 {
        let reply = client.check(request()).await;
        assert!(reply.is_ok(), "{reply:?}");
    }
    // The third call is over the limit: the client sees an error, never a success.
    let denied = client.check(request()).await;
    assert!(denied.is_err(), "{denied:?}");
    server.abort();
}

/// A connection whose peer address the server does not record (a custom transport).
struct NoPeerAddress(tokio::net::TcpStream);

impl tokio::io::AsyncRead for NoPeerAddress {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for NoPeerAddress {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for NoPeerAddress {
    type ConnectInfo = ();
    fn connect_info(&self) {}
}

#[tokio::test]
async fn a_server_that_records_no_peer_address_is_still_limited() {
    // Without a peer address the default key is missing: the calls share the "unidentified"
    // budget instead of going unlimited.
    let (_reporter, health) = tonic_health::server::health_reporter();
    let limits = limits();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = futures_util::stream::unfold(listener, |listener| async move {
        let accepted = listener
            .accept()
            .await
            .map(|(stream, _)| NoPeerAddress(stream));
        Some((accepted, listener))
    });
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .layer(limits)
            .add_service(health)
            .serve_with_incoming(incoming),
    );
    let mut client = client(addr).await;
    for _ in 0..2 {
        assert!(client.check(request()).await.is_ok());
    }
    let denied = client.check(request()).await.unwrap_err();
    assert_eq!(denied.code(), tonic::Code::ResourceExhausted);
    server.abort();
}
