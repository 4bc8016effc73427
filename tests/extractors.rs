//! Every extractor through the layer on real axum routers, and the peer address as axum, a
//! plain `SocketAddr` and tonic record it.

#![cfg(feature = "axum")]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{ConnectInfo, Request};
use axum::middleware::{self, Next};
use axum::routing::get;
use http::StatusCode;
use tollgate::key::{
    ClientIp, FromExtension, FromHeader, Key, KeyExtractor, KeyExtractorExt, Route, async_fn,
    combine, first_of,
};
use tollgate::{Quota, RateLimitLayer, Rule};
use tower::{Service, ServiceExt};

fn request(method: &str, path: &str, ip: [u8; 4], headers: &[(&str, &str)]) -> http::Request<Body> {
    let mut builder = http::Request::builder().method(method).uri(path);
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let mut request = builder.body(Body::empty()).unwrap();
    request
        .extensions_mut()
        .insert(ConnectInfo(SocketAddr::from((ip, 50_000))));
    request
}

async fn status(app: &mut Router, request: http::Request<Body>) -> StatusCode {
    let mut service = app.as_service::<Body>();
    service
        .ready()
        .await
        .unwrap()
        .call(request)
        .await
        .unwrap()
        .status()
}

/// One request and the status it must get: method, path, client IP, headers, status.
type Step<'a> = (
    &'a str,
    &'a str,
    [u8; 4],
    &'a [(&'a str, &'a str)],
    StatusCode,
);

/// Sends each request in turn and checks its status.
async fn expect(app: &mut Router, steps: &[Step<'_>]) {
    for (i, &(method, path, ip, headers, want)) in steps.iter().enumerate() {
        let got = status(app, request(method, path, ip, headers)).await;
        assert_eq!(
            got, want,
            "step {i}: {method} {path} from {ip:?} with {headers:?}"
        );
    }
}

fn one_per_minute(key: impl KeyExtractor) -> RateLimitLayer {
    RateLimitLayer::builder()
        .rule(Rule::new("one", Quota::per_minute(1)).key(key))
        .build()
        .unwrap()
}

fn users_app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route(
            "/users/{id}",
            get(|| async { "user" }).delete(|| async { "gone" }),
        )
        .route("/other", get(|| async { "other" }))
        .route_layer(layer)
}

#[tokio::test]
async fn route_keys_use_the_pattern_not_the_path() {
    let mut app = users_app(one_per_minute(ClientIp::new().and(Route::new())));
    let ip = [192, 0, 2, 1];
    expect(
        &mut app,
        &[
            ("GET", "/users/1", ip, &[], StatusCode::OK),
            // Another id is the same route: no new budget.
            ("GET", "/users/2", ip, &[], StatusCode::TOO_MANY_REQUESTS),
            // Another route, or another client, has its own.
            ("GET", "/other", ip, &[], StatusCode::OK),
            ("GET", "/users/3", [192, 0, 2, 2], &[], StatusCode::OK),
        ],
    )
    .await;
}

#[tokio::test]
async fn route_keys_with_the_method() {
    let mut app = users_app(one_per_minute(Route::new().with_method()));
    let ip = [192, 0, 2, 1];
    expect(
        &mut app,
        &[
            ("GET", "/users/1", ip, &[], StatusCode::OK),
            ("DELETE", "/users/1", ip, &[], StatusCode::OK),
            ("GET", "/users/9", ip, &[], StatusCode::TOO_MANY_REQUESTS),
        ],
    )
    .await;
}

#[derive(Clone)]
struct User(&'static str);

async fn authenticate(mut request: Request, next: Next) -> axum::response::Response {
    if let Some(user) = request
        .headers()
        .get("x-test-user")
        .and_then(|v| v.to_str().ok())
    {
        let user = match user {
            "alice" => User("alice"),
            _ => User("bob"),
        };
        request.extensions_mut().insert(user);
    }
    next.run(request).await
}

#[tokio::test]
async fn user_from_an_extension_else_ip() {
    let layer =
        one_per_minute(FromExtension::new(|u: &User| Some(Key::text(u.0))).or(ClientIp::new()));
    let mut app = users_app(layer).layer(middleware::from_fn(authenticate));
    let alice = [("x-test-user", "alice")];
    expect(
        &mut app,
        &[
            ("GET", "/other", [192, 0, 2, 1], &alice, StatusCode::OK),
            // Alice from another IP: her budget is spent.
            (
                "GET",
                "/other",
                [192, 0, 2, 2],
                &alice,
                StatusCode::TOO_MANY_REQUESTS,
            ),
            // Anonymous requests count by IP; the IP's budget is untouched by Alice.
            ("GET", "/other", [192, 0, 2, 1], &[], StatusCode::OK),
            (
                "GET",
                "/other",
                [192, 0, 2, 1],
                &[],
                StatusCode::TOO_MANY_REQUESTS,
            ),
        ],
    )
    .await;
}

#[tokio::test]
async fn a_header_cannot_name_a_user_or_an_ip_key() {
    // The authenticated user, else an API key header, else the IP.
    let layer = one_per_minute(first_of((
        FromExtension::new(|u: &User| Some(Key::text(u.0))),
        FromHeader::new("x-api-key"),
        ClientIp::new(),
    )));
    let mut app = users_app(layer).layer(middleware::from_fn(authenticate));
    let ip = [192, 0, 2, 1];
    expect(
        &mut app,
        &[
            // An anonymous client sends the user's name and the victim IP as API keys.
            (
                "GET",
                "/other",
                [198, 51, 100, 1],
                &[("x-api-key", "alice")],
                StatusCode::OK,
            ),
            (
                "GET",
                "/other",
                [198, 51, 100, 1],
                &[("x-api-key", "192.0.2.1")],
                StatusCode::OK,
            ),
            // Neither was charged to Alice or to 192.0.2.1.
            (
                "GET",
                "/other",
                ip,
                &[("x-test-user", "alice")],
                StatusCode::OK,
            ),
            ("GET", "/other", ip, &[], StatusCode::OK),
        ],
    )
    .await;
}

#[tokio::test]
async fn asynchronous_lookup_shares_a_tenant_budget() {
    let tenants: Arc<HashMap<&'static str, &'static str>> =
        Arc::new([("k1", "acme"), ("k2", "acme"), ("k3", "globex")].into());
    let by_tenant = async_fn(move |parts: &http::request::Parts| {
        let api_key = parts
            .headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let tenants = tenants.clone();
        async move {
            tokio::task::yield_now().await;
            tenants.get(api_key?.as_str()).map(|t| Key::text(*t))
        }
    });
    let mut app = users_app(one_per_minute(combine((by_tenant, Route::new()))));
    let ip = [192, 0, 2, 1];
    expect(
        &mut app,
        &[
            ("GET", "/other", ip, &[("x-api-key", "k1")], StatusCode::OK),
            (
                "GET",
                "/other",
                ip,
                &[("x-api-key", "k2")],
                StatusCode::TOO_MANY_REQUESTS,
            ),
            ("GET", "/other", ip, &[("x-api-key", "k3")], StatusCode::OK),
            (
                "GET",
                "/users/1",
                ip,
                &[("x-api-key", "k1")],
                StatusCode::OK,
            ),
        ],
    )
    .await;
    // An unknown key has no tenant: such requests share the one "unidentified" budget, found
    // after the lookup as before it.
    let unknown = |key| request("GET", "/other", ip, &[("x-api-key", key)]);
    assert_eq!(status(&mut app, unknown("nope")).await, StatusCode::OK);
    assert_eq!(
        status(&mut app, unknown("other")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn hashed_api_keys() {
    let mut app = users_app(one_per_minute(
        FromHeader::new("x-api-key").hashed().or(ClientIp::new()),
    ));
    let ip = [192, 0, 2, 1];
    expect(
        &mut app,
        &[
            (
                "GET",
                "/other",
                ip,
                &[("x-api-key", "secret")],
                StatusCode::OK,
            ),
            (
                "GET",
                "/other",
                [192, 0, 2, 7],
                &[("x-api-key", " secret ")],
                StatusCode::TOO_MANY_REQUESTS,
            ),
            ("GET", "/other", ip, &[], StatusCode::OK),
        ],
    )
    .await;
}

#[tokio::test]
async fn client_ip_behind_a_trusted_proxy_through_the_layer() {
    let client_ip = ClientIp::new()
        .parse_trusted_proxies(["127.0.0.0/8"])
        .unwrap();
    let mut app = users_app(one_per_minute(client_ip));
    let proxy = [127, 0, 0, 1];
    let from =
        |client: &'static str| request("GET", "/other", proxy, &[("x-forwarded-for", client)]);
    assert_eq!(status(&mut app, from("198.51.100.1")).await, StatusCode::OK);
    // The client rotates spoofed entries to the left: still the same client.
    assert_eq!(
        status(
            &mut app,
            request(
                "GET",
                "/other",
                proxy,
                &[("x-forwarded-for", "1.1.1.1, 198.51.100.1")]
            )
        )
        .await,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(status(&mut app, from("198.51.100.2")).await, StatusCode::OK);
    // A direct client's header is ignored: it is keyed by its own address.
    let direct = request(
        "GET",
        "/other",
        [203, 0, 113, 9],
        &[("x-forwarded-for", "198.51.100.3")],
    );
    assert_eq!(status(&mut app, direct).await, StatusCode::OK);
    assert_eq!(status(&mut app, from("198.51.100.3")).await, StatusCode::OK);
}

#[cfg(feature = "tonic")]
fn peer_of(insert: impl FnOnce(&mut http::Extensions)) -> Option<Key> {
    let (mut parts, ()) = http::Request::new(()).into_parts();
    insert(&mut parts.extensions);
    let peer = tollgate::key::PeerIp::new().extract(&parts).found();
    let client = ClientIp::new().extract(&parts).found();
    assert_eq!(peer, client);
    peer
}

#[cfg(feature = "tonic")]
#[test]
fn peer_addresses_from_axum_plain_and_tonic() {
    let addr = SocketAddr::from(([203, 0, 113, 7], 4000));
    let want = Some(Key::ip(addr.ip()));
    assert_eq!(
        peer_of(|e| {
            e.insert(ConnectInfo(addr));
        }),
        want
    );
    assert_eq!(
        peer_of(|e| {
            e.insert(addr);
        }),
        want
    );
    let info = tonic::transport::server::TcpConnectInfo {
        local_addr: None,
        remote_addr: Some(addr),
    };
    assert_eq!(
        peer_of(|e| {
            e.insert(info);
        }),
        want
    );
    assert_eq!(peer_of(|_| {}), None);
}

#[cfg(feature = "tonic")]
#[test]
fn grpc_route_and_peer_through_trusted_proxy() {
    let (mut parts, ()) = http::Request::post("/helloworld.Greeter/SayHello")
        .header("content-type", "application/grpc")
        .header("x-forwarded-for", "198.51.100.4")
        .body(())
        .unwrap()
        .into_parts();
    parts
        .extensions
        .insert(tonic::transport::server::TcpConnectInfo {
            local_addr: None,
            remote_addr: Some(SocketAddr::from(([10, 0, 0, 2], 5000))),
        });
    let extractor = ClientIp::new()
        .parse_trusted_proxies(["10.0.0.0/8"])
        .unwrap()
        .and(Route::new());
    let tollgate::key::Extracted::Found(key) = extractor.extract(&parts) else {
        panic!("expected a key");
    };
    assert_eq!(key.to_string(), "198.51.100.4|/helloworld.Greeter/SayHello");
}
