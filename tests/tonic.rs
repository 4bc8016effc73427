//! The layer in front of a generated tonic service (the standard health service).
#![cfg(feature = "tonic")]

use tollgate::{Quota, RateLimitLayer, Rule};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

#[tokio::test]
async fn server_builder_layer_wraps_a_generated_service_and_limits_by_peer_ip() {
    let (_reporter, health) = tonic_health::server::health_reporter();
    let limits = RateLimitLayer::builder()
        .rule(Rule::new("grpc", Quota::per_hour(2)))
        .build()
        .unwrap();

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .layer(limits)
            .add_service(health)
            .serve_with_incoming(incoming),
    );

    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = HealthClient::new(channel);
    for _ in 0..2 {
        let reply = client
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await;
        assert!(reply.is_ok(), "{reply:?}");
    }
    // The third call is over the limit: the client sees an error, never a success.
    let denied = client
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await;
    assert!(denied.is_err(), "{denied:?}");
    server.abort();
}
