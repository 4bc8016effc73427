//! The client layers against real servers on loopback: a client that honours the limit sends
//! no request while the server has said to wait (HTTP and gRPC, tollgate's server and a plain
//! one), and retries spread by jitter, never before the server's delay, within a budget.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use tollgate::client::{ClientError, HonourLimitsLayer, Retry, RetryAfterLayer};
use tollgate::key::Global;
use tollgate::{Quota, RateLimitLayer, Rule};
use tower::{Layer, Service, ServiceExt};

/// Serves `app` on a loopback port, counting every request that reaches the server.
async fn serve(app: Router) -> (SocketAddr, Arc<AtomicUsize>) {
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = seen.clone();
    let app = app.layer(tower::util::MapRequestLayer::new(
        move |request: Request<axum::body::Body>| {
            counter.fetch_add(1, Ordering::SeqCst);
            request
        },
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    (addr, seen)
}

fn get_request(addr: SocketAddr) -> Request<Empty<Bytes>> {
    Request::get(format!("http://{addr}/"))
        .body(Empty::new())
        .unwrap()
}

#[tokio::test]
async fn a_loop_of_100_calls_sends_one_denied_request_per_announced_delay() {
    let limited = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::builder()
            .rule(Rule::new("per-minute", Quota::per_minute(5)).key(Global))
            .build()
            .unwrap(),
    );
    let (addr, seen) = serve(limited).await;
    let mut client = HonourLimitsLayer::new()
        .layer(Client::builder(hyper_util::rt::TokioExecutor::new()).build_http::<Empty<Bytes>>());
    let (mut ok, mut denied, mut local) = (0, 0, Vec::new());
    for _ in 0..100 {
        match client.ready().await.unwrap().call(get_request(addr)).await {
            Ok(response) if response.status() == StatusCode::OK => ok += 1,
            Ok(response) => {
                assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
                denied += 1;
            }
            Err(ClientError::Throttled(throttled)) => local.push(throttled.wait()),
            Err(ClientError::Inner(error)) => panic!("{error}"),
        }
    }
    // The fifth answer said the budget was spent for 12 s (`RateLimit: "per-minute";r=0;t=12`):
    // the client sent nothing more, not even one request to be denied.
    assert_eq!((ok, denied, local.len()), (5, 0, 95));
    assert!(
        local
            .iter()
            .all(|w| *w > Duration::from_secs(11) && *w <= Duration::from_secs(12))
    );
    assert_eq!(
        seen.load(Ordering::SeqCst),
        5,
        "the server saw the 5 admitted only"
    );

    // A client that did not see the budget go: one denied request, then nothing.
    let mut late = HonourLimitsLayer::new()
        .layer(Client::builder(hyper_util::rt::TokioExecutor::new()).build_http::<Empty<Bytes>>());
    let mut statuses = Vec::new();
    for _ in 0..100 {
        match late.ready().await.unwrap().call(get_request(addr)).await {
            Ok(response) => statuses.push(response.status()),
            Err(ClientError::Throttled(_)) => {}
            Err(ClientError::Inner(error)) => panic!("{error}"),
        }
    }
    assert_eq!(statuses, [StatusCode::TOO_MANY_REQUESTS]);
    assert_eq!(
        seen.load(Ordering::SeqCst),
        6,
        "one denied request per announced delay"
    );
}

#[tokio::test]
async fn any_server_that_says_when_is_honoured() {
    // Not tollgate: a 503 with an HTTP-date, then a 200 whose RateLimit policy is spent.
    let date = httpdate_in(Duration::from_secs(30));
    let answers = Arc::new(Mutex::new(vec![
        (200, vec![("ratelimit", r#""hourly";r=0;t=40"#.to_owned())]),
        (503, vec![("retry-after", date)]),
    ]));
    let app = Router::new().route(
        "/",
        get(move || {
            let answers = answers.clone();
            async move {
                let (status, headers) = answers.lock().unwrap().pop().unwrap();
                let mut response = http::Response::builder().status(status);
                for (name, value) in headers {
                    response = response.header(name, value);
                }
                response.body(axum::body::Body::empty()).unwrap()
            }
        }),
    );
    let (addr, seen) = serve(app).await;
    // Whole seconds, and the date was written before the server started: a second's slack.
    for (first, wait) in [(503, 28..=30), (200, 39..=40)] {
        let mut client = HonourLimitsLayer::new().layer(
            Client::builder(hyper_util::rt::TokioExecutor::new()).build_http::<Empty<Bytes>>(),
        );
        let response = client
            .ready()
            .await
            .unwrap()
            .call(get_request(addr))
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), first);
        let Err(ClientError::Throttled(throttled)) =
            client.ready().await.unwrap().call(get_request(addr)).await
        else {
            panic!("sent while the server asked to wait");
        };
        assert!(
            wait.contains(&throttled.wait().as_secs()),
            "{:?}",
            throttled.wait()
        );
    }
    assert_eq!(seen.load(Ordering::SeqCst), 2);
}

/// An IMF-fixdate `after` from now.
fn httpdate_in(after: Duration) -> String {
    let at = std::time::SystemTime::now() + after;
    let secs = at.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Civil date from days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let weekday = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"][(days % 7) as usize];
    let months = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    format!(
        "{weekday}, {day:02} {} {year} {:02}:{:02}:{:02} GMT",
        months[month as usize - 1],
        rest / 3_600,
        rest % 3_600 / 60,
        rest % 60
    )
}

#[tokio::test]
async fn fifty_clients_told_the_same_delay_come_back_spread_and_never_early() {
    // Each client's first request is told to wait 1 s; its next one is served. The server
    // notes when each client was refused and when it came back.
    let refused: Arc<Mutex<std::collections::HashMap<String, Instant>>> = Arc::default();
    let back: Arc<Mutex<Vec<(String, Instant)>>> = Arc::default();
    let (r, b) = (refused.clone(), back.clone());
    let app = Router::new().route(
        "/",
        get(move |headers: http::HeaderMap| {
            let (refused, back) = (r.clone(), b.clone());
            async move {
                let id = headers["x-client"].to_str().unwrap().to_owned();
                let mut refused = refused.lock().unwrap();
                if refused.contains_key(&id) {
                    back.lock().unwrap().push((id, Instant::now()));
                    return http::Response::new(axum::body::Body::from("ok"));
                }
                refused.insert(id, Instant::now());
                http::Response::builder()
                    .status(429)
                    .header("retry-after", "1")
                    .body(axum::body::Body::empty())
                    .unwrap()
            }
        }),
    );
    let (addr, _) = serve(app).await;
    let retry = Retry::new().jitter(0.5, Duration::from_millis(100));
    let clients: Vec<_> = (0..50)
        .map(|n| {
            tokio::spawn(async move {
                let mut client = RetryAfterLayer::new(retry).layer(
                    Client::builder(hyper_util::rt::TokioExecutor::new())
                        .build_http::<Empty<Bytes>>(),
                );
                let request = Request::get(format!("http://{addr}/"))
                    .header("x-client", n.to_string())
                    .body(Empty::<Bytes>::new())
                    .unwrap();
                let response = client.ready().await.unwrap().call(request).await.unwrap();
                assert_eq!(response.status(), StatusCode::OK);
                response.into_body().collect().await.unwrap();
            })
        })
        .collect();
    for client in clients {
        client.await.unwrap();
    }
    let refused = refused.lock().unwrap();
    let back = back.lock().unwrap();
    assert_eq!(back.len(), 50);
    for (id, at) in back.iter() {
        let waited = at.duration_since(refused[id]);
        assert!(
            waited >= Duration::from_secs(1),
            "client {id} came back after {waited:?}"
        );
    }
    // The jitter window is half the delay: 500 ms. The retries span at least half of it.
    let first = back.iter().map(|(_, at)| *at).min().unwrap();
    let last = back.iter().map(|(_, at)| *at).max().unwrap();
    assert!(
        last.duration_since(first) >= Duration::from_millis(250),
        "retries spread over {:?} only",
        last.duration_since(first)
    );
}

#[tokio::test]
async fn the_retry_budget_keeps_retries_from_multiplying_the_load() {
    // A server that always refuses, asking no wait.
    let app = Router::new().route(
        "/",
        get(|| async {
            http::Response::builder()
                .status(503)
                .header("retry-after", "0")
                .body(axum::body::Body::empty())
                .unwrap()
        }),
    );
    let (addr, seen) = serve(app).await;
    let retry = Retry::new()
        .max_retries(5)
        .jitter(0.0, Duration::from_millis(1))
        .budget(0.1, 0.0);
    let mut client = RetryAfterLayer::new(retry)
        .layer(Client::builder(hyper_util::rt::TokioExecutor::new()).build_http::<Empty<Bytes>>());
    for _ in 0..50 {
        let response = client
            .ready()
            .await
            .unwrap()
            .call(get_request(addr))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
    // 50 calls; retries: 0.1 per call, none to start with: at most 5 (5 retries each: 300).
    let seen = seen.load(Ordering::SeqCst);
    assert!((50..=55).contains(&seen), "the server saw {seen} requests");
}

#[cfg(feature = "tonic")]
#[tokio::test]
async fn a_tonic_client_gets_resource_exhausted_and_sends_nothing_while_told_to_wait() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

    let (_reporter, health) = tonic_health::server::health_reporter();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = seen.clone();
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(tower::util::MapRequestLayer::new(
                move |request: Request<_>| {
                    counter.fetch_add(1, Ordering::SeqCst);
                    request
                },
            ))
            .layer(
                RateLimitLayer::builder()
                    .rule(Rule::new("grpc", Quota::per_hour(2)))
                    .build()
                    .unwrap(),
            )
            .add_service(health)
            .serve_with_incoming(incoming),
    );
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let request = || HealthCheckRequest {
        service: String::new(),
    };
    // Another client of the same peer spends the budget.
    let mut other = HealthClient::new(channel.clone());
    for _ in 0..2 {
        other.check(request()).await.unwrap();
    }
    let mut client = HealthClient::new(HonourLimitsLayer::new().layer(channel));
    // Denied by the server: told 30 minutes (2 per hour) by grpc-retry-pushback-ms.
    let denied = client.check(request()).await.unwrap_err();
    assert_eq!(denied.code(), tonic::Code::ResourceExhausted);
    assert!(!denied.message().contains("not sent"), "{denied:?}");
    // Not sent: the same code, said by the client.
    for _ in 0..10 {
        let local = client.check(request()).await.unwrap_err();
        assert_eq!(local.code(), tonic::Code::ResourceExhausted, "{local:?}");
        assert!(local.message().contains("not sent"), "{local:?}");
    }
    assert_eq!(seen.load(Ordering::SeqCst), 3);
}
