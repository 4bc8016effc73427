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
use tollgate::client::{ClientError, HonourLimitsLayer, Pacing, Retry, RetryAfterLayer};
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

// ----- What a wait covers -----

/// A scripted server: each path answers its queued `(status, headers)` in turn (the last one
/// again once the queue is down to it), and every request that reaches it is counted by path.
#[derive(Clone, Default)]
struct Script {
    answers: Arc<Mutex<std::collections::HashMap<String, Vec<Answer>>>>,
    seen: Arc<Mutex<Vec<String>>>,
}

type Answer = (u16, Vec<(&'static str, String)>);

impl Script {
    fn answer(&self, path: &str, answers: Vec<Answer>) -> &Self {
        self.answers
            .lock()
            .unwrap()
            .insert(path.to_owned(), answers.into_iter().rev().collect());
        self
    }

    fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }

    /// The scripted server as an axum router on `paths`.
    fn router(&self, paths: &[&str]) -> Router {
        let mut router = Router::new();
        for path in paths {
            let script = self.clone();
            let path = (*path).to_owned();
            let route = path.clone();
            router = router.route(
                &route,
                get(move || {
                    let script = script.clone();
                    let path = path.clone();
                    async move { script.respond(&path).map(|_| axum::body::Body::empty()) }
                }),
            );
        }
        router
    }

    fn respond(&self, path: &str) -> http::Response<()> {
        self.seen.lock().unwrap().push(path.to_owned());
        let mut answers = self.answers.lock().unwrap();
        let queue = answers.get_mut(path).expect("a scripted path");
        let (status, headers) = if queue.len() > 1 {
            queue.pop().unwrap()
        } else {
            queue[0].clone()
        };
        let mut response = http::Response::builder().status(status);
        for (name, value) in headers {
            response = response.header(name, value);
        }
        response.body(()).unwrap()
    }
}

fn ok_with(limits: &[&str]) -> Answer {
    (
        200,
        limits
            .iter()
            .map(|l| ("ratelimit", (*l).to_owned()))
            .collect(),
    )
}

fn get_path(addr: SocketAddr, path: &str) -> Request<Empty<Bytes>> {
    Request::get(format!("http://{addr}{path}"))
        .body(Empty::new())
        .unwrap()
}

/// The status of a call, or `None` when the layer did not send it.
async fn status_of<S, B, E>(client: &mut S, request: Request<Empty<Bytes>>) -> Option<u16>
where
    S: Service<Request<Empty<Bytes>>, Response = http::Response<B>, Error = ClientError<E>>,
    E: std::fmt::Display,
{
    call_of(client, request).await.ok()
}

/// The status of a call, or the wait told when the layer did not send it.
async fn call_of<S, B, E>(client: &mut S, request: Request<Empty<Bytes>>) -> Result<u16, Duration>
where
    S: Service<Request<Empty<Bytes>>, Response = http::Response<B>, Error = ClientError<E>>,
    E: std::fmt::Display,
{
    let ready = match client.ready().await {
        Ok(ready) => ready,
        Err(error) => panic!("{error}"),
    };
    match ready.call(request).await {
        Ok(response) => Ok(response.status().as_u16()),
        Err(ClientError::Throttled(throttled)) => Err(throttled.wait()),
        Err(ClientError::Inner(error)) => panic!("{error}"),
    }
}

/// `/export` is limited to 1 per hour on its own; `/health` shares only a `global` policy.
fn export_and_health() -> Script {
    let script = Script::default();
    script
        .answer(
            "/export",
            vec![
                ok_with(&[r#""global";r=98;t=60"#, r#""export";r=0;t=3600"#]),
                (
                    429,
                    vec![
                        ("retry-after", "3600".to_owned()),
                        ("ratelimit", r#""export";r=0;t=3600"#.to_owned()),
                    ],
                ),
            ],
        )
        .answer("/health", vec![ok_with(&[r#""global";r=97;t=60"#])]);
    script
}

#[tokio::test]
async fn the_200_that_spends_a_route_policy_blocks_that_route_and_not_the_server() {
    let script = export_and_health();
    let (addr, _) = serve(script.router(&["/export", "/health"])).await;
    let mut client = HonourLimitsLayer::new()
        .layer(Client::builder(hyper_util::rt::TokioExecutor::new()).build_http::<Empty<Bytes>>());
    assert_eq!(
        status_of(&mut client, get_path(addr, "/health")).await,
        Some(200)
    );
    assert_eq!(
        status_of(&mut client, get_path(addr, "/export")).await,
        Some(200)
    );
    // `export` is spent for an hour: `/health` never carried it.
    for _ in 0..3 {
        assert_eq!(
            status_of(&mut client, get_path(addr, "/health")).await,
            Some(200),
            "/health was not sent: the wait of `export` covered the whole server"
        );
    }
    // `/export` carried it: not sent, the wait of an hour told.
    let Err(ClientError::Throttled(throttled)) = client
        .ready()
        .await
        .unwrap()
        .call(get_path(addr, "/export?format=csv"))
        .await
    else {
        panic!("/export sent while its policy is spent");
    };
    assert!(throttled.wait() > Duration::from_secs(3590));
    assert_eq!(
        script.seen(),
        ["/health", "/export", "/health", "/health", "/health"]
    );
}

#[tokio::test]
async fn a_retrying_client_neither_sleeps_nor_fails_on_another_routes_spent_policy() {
    let script = export_and_health();
    let (addr, _) = serve(script.router(&["/export", "/health"])).await;
    let mut client = RetryAfterLayer::new(Retry::new())
        .layer(Client::builder(hyper_util::rt::TokioExecutor::new()).build_http::<Empty<Bytes>>());
    assert_eq!(
        status_of(&mut client, get_path(addr, "/export")).await,
        Some(200)
    );
    assert_eq!(
        status_of(&mut client, get_path(addr, "/health")).await,
        Some(200),
        "/health was not sent: the wait of `export` covered the whole server"
    );
    // An hour is past the longest wait worth waiting (30 s): `/export` fails at once.
    assert_eq!(
        status_of(&mut client, get_path(addr, "/export")).await,
        None
    );
    assert_eq!(script.seen(), ["/export", "/health"]);
}

#[tokio::test]
async fn a_429s_retry_after_covers_the_calls_target_only() {
    let script = Script::default();
    script
        .answer("/a", vec![(429, vec![("retry-after", "600".to_owned())])])
        .answer("/b", vec![(200, vec![])]);
    let (addr, _) = serve(script.router(&["/a", "/b"])).await;
    for retrying in [false, true] {
        let inner =
            Client::builder(hyper_util::rt::TokioExecutor::new()).build_http::<Empty<Bytes>>();
        let statuses = if retrying {
            let mut client = RetryAfterLayer::new(Retry::new()).layer(inner);
            [
                status_of(&mut client, get_path(addr, "/a")).await,
                status_of(&mut client, get_path(addr, "/a?page=2")).await,
                status_of(&mut client, get_path(addr, "/b")).await,
            ]
        } else {
            let mut client = HonourLimitsLayer::new().layer(inner);
            [
                status_of(&mut client, get_path(addr, "/a")).await,
                status_of(&mut client, get_path(addr, "/a?page=2")).await,
                status_of(&mut client, get_path(addr, "/b")).await,
            ]
        };
        // The query is not part of the target: `/a?page=2` is `/a`.
        assert_eq!(
            statuses,
            [Some(429), None, Some(200)],
            "retrying: {retrying}"
        );
    }
    assert_eq!(script.seen(), ["/a", "/b", "/a", "/b"]);
}

#[tokio::test]
async fn a_later_answer_shortens_or_ends_a_policys_wait_and_an_earlier_one_does_not() {
    let script = Script::default();
    script
        .answer(
            "/a",
            vec![
                ok_with(&[r#""shared";r=1;t=600"#]),
                ok_with(&[r#""shared";r=0;t=600"#]),
            ],
        )
        .answer("/b", vec![ok_with(&[r#""shared";r=5;t=600"#])])
        .answer("/c", vec![ok_with(&[r#""shared";r=0;t=5"#])])
        .answer("/d", vec![ok_with(&[r#""shared";r=2;t=5"#])]);
    let (addr, _) = serve(script.router(&["/a", "/b", "/c", "/d"])).await;
    let mut client = HonourLimitsLayer::new()
        .layer(Client::builder(hyper_util::rt::TokioExecutor::new()).build_http::<Empty<Bytes>>());
    for path in ["/b", "/a", "/a"] {
        assert_eq!(call_of(&mut client, get_path(addr, path)).await, Ok(200));
    }
    // `shared` is spent for 600 s: `/a` and `/b` carried it.
    for path in ["/a", "/b"] {
        let wait = call_of(&mut client, get_path(addr, path))
            .await
            .unwrap_err();
        assert!(wait > Duration::from_secs(590), "{path}: {wait:?}");
    }
    // A request sent since, to a path not known to carry it, says 5 s: the wait is 5 s.
    assert_eq!(call_of(&mut client, get_path(addr, "/c")).await, Ok(200));
    for path in ["/a", "/b", "/c"] {
        let wait = call_of(&mut client, get_path(addr, path))
            .await
            .unwrap_err();
        assert!(wait <= Duration::from_secs(5), "{path}: {wait:?}");
    }
    // Then one says the policy has budget again: no wait.
    assert_eq!(call_of(&mut client, get_path(addr, "/d")).await, Ok(200));
    assert_eq!(call_of(&mut client, get_path(addr, "/a")).await, Ok(200));
    assert_eq!(script.seen(), ["/b", "/a", "/a", "/c", "/d", "/a"]);
}

#[tokio::test]
async fn an_answer_to_a_request_sent_before_a_wait_was_learned_does_not_end_it() {
    // A mock server whose answers the test releases: `/slow` is answered after `/a`'s.
    let (release, held) = tokio::sync::oneshot::channel::<()>();
    let held = Arc::new(Mutex::new(Some(held)));
    let inner = tower::service_fn(move |request: Request<Empty<Bytes>>| {
        let held = held.clone();
        async move {
            let limit = if request.uri().path() == "/slow" {
                let held = held.lock().unwrap().take().unwrap();
                held.await.unwrap();
                r#""shared";r=9;t=600"#
            } else {
                r#""shared";r=0;t=600"#
            };
            Ok::<_, std::convert::Infallible>(
                http::Response::builder()
                    .header("ratelimit", limit)
                    .body(Empty::<Bytes>::new())
                    .unwrap(),
            )
        }
    });
    let layer = HonourLimitsLayer::new();
    let mut slow_client = layer.layer(inner.clone());
    let mut client = layer.layer(inner);
    let slow = tokio::spawn(async move {
        let request = Request::get("http://api.test/slow")
            .body(Empty::new())
            .unwrap();
        slow_client
            .ready()
            .await
            .unwrap()
            .call(request)
            .await
            .is_ok()
    });
    tokio::task::yield_now().await;
    let request = || {
        Request::get("http://api.test/a")
            .body(Empty::new())
            .unwrap()
    };
    assert!(client.ready().await.unwrap().call(request()).await.is_ok());
    release.send(()).unwrap();
    assert!(slow.await.unwrap());
    // `/slow`'s r=9 may have been counted before `/a`'s r=0: the wait stays.
    let Err(ClientError::Throttled(_)) = client.ready().await.unwrap().call(request()).await else {
        panic!("an earlier request's answer ended the wait");
    };
}

/// A trailers-only gRPC answer, or one whose status comes in the trailers.
struct GrpcBody {
    trailers: Option<http::HeaderMap>,
}

impl http_body::Body for GrpcBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(
            self.trailers
                .take()
                .map(|t| Ok(http_body::Frame::trailers(t))),
        )
    }
}

fn grpc_status(status: &str, pushback_ms: Option<&str>) -> http::HeaderMap {
    let mut headers = http::HeaderMap::new();
    headers.insert("content-type", "application/grpc".parse().unwrap());
    headers.insert("grpc-status", status.parse().unwrap());
    if let Some(ms) = pushback_ms {
        headers.insert("grpc-retry-pushback-ms", ms.parse().unwrap());
    }
    headers
}

#[tokio::test]
async fn grpc_pushback_covers_the_calls_method_only() {
    // `Export` is pushed back for a minute, in the head (trailers-only) or in the trailers;
    // `Health` answers OK.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    let inner = tower::service_fn(move |request: Request<Empty<Bytes>>| {
        let path = request.uri().path().to_owned();
        s.lock().unwrap().push(path.clone());
        let (head, trailers) = match path.as_str() {
            "/api.Jobs/Export" => (grpc_status("8", Some("60000")), None),
            "/api.Jobs/Stream" => {
                let mut head = http::HeaderMap::new();
                head.insert("content-type", "application/grpc".parse().unwrap());
                (head, Some(grpc_status("14", Some("60000"))))
            }
            _ => (grpc_status("0", None), None),
        };
        let mut response = http::Response::new(GrpcBody { trailers });
        *response.headers_mut() = head;
        std::future::ready(Ok::<_, std::convert::Infallible>(response))
    });
    let call = |method: &str| {
        Request::post(format!("http://api.test/api.Jobs/{method}"))
            .header("content-type", "application/grpc")
            .body(Empty::<Bytes>::new())
            .unwrap()
    };
    let mut client = HonourLimitsLayer::new().layer(inner);
    let mut send = async |method: &str| match client.ready().await.unwrap().call(call(method)).await
    {
        Ok(response) => {
            response.into_body().collect().await.unwrap();
            true
        }
        Err(ClientError::Throttled(throttled)) => {
            assert!(throttled.wait() > Duration::from_secs(55));
            false
        }
        Err(ClientError::Inner(error)) => match error {},
    };
    assert!(send("Export").await);
    assert!(send("Stream").await);
    assert!(!send("Export").await, "Export sent while pushed back");
    assert!(!send("Stream").await, "Stream sent while pushed back");
    assert!(
        send("Health").await,
        "Health not sent: the pushback covered the server"
    );
    assert!(send("Health").await);
    assert_eq!(
        *seen.lock().unwrap(),
        [
            "/api.Jobs/Export",
            "/api.Jobs/Stream",
            "/api.Jobs/Health",
            "/api.Jobs/Health"
        ]
    );
}

#[tokio::test]
async fn the_waits_remembered_are_bounded_and_the_latest_kept() {
    use tollgate::client::MAX_TARGETS;
    // Each target is told to wait 10 minutes; once `quiet`, the server answers 200 alone (a
    // target sent then teaches nothing).
    let quiet = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let q = quiet.clone();
    let inner = tower::service_fn(move |_: Request<Empty<Bytes>>| {
        let mut response = http::Response::builder();
        if !q.load(Ordering::SeqCst) {
            response = response.status(429).header("retry-after", "600");
        }
        std::future::ready(Ok::<_, std::convert::Infallible>(
            response.body(Empty::<Bytes>::new()).unwrap(),
        ))
    });
    let mut client = HonourLimitsLayer::new().layer(inner);
    let request = |n: usize| {
        Request::get(format!("http://api.test/item/{n}"))
            .body(Empty::new())
            .unwrap()
    };
    let targets = MAX_TARGETS + 500;
    for n in 0..targets {
        let response = client
            .ready()
            .await
            .unwrap()
            .call(request(n))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    }
    quiet.store(true, Ordering::SeqCst);
    let mut remembered = Vec::new();
    for n in 0..targets {
        if let Err(ClientError::Throttled(_)) = client.ready().await.unwrap().call(request(n)).await
        {
            remembered.push(n);
        }
    }
    assert!(
        remembered.len() <= MAX_TARGETS && remembered.len() >= MAX_TARGETS / 2,
        "{} targets remembered",
        remembered.len()
    );
    // Those forgotten are the waits that end first: the latest are all there.
    assert!(remembered.windows(2).all(|w| w[1] == w[0] + 1));
    assert_eq!(remembered.last(), Some(&(targets - 1)));
}

/// A clock that follows tokio's (paused) time, so that the server's budget and the client's
/// pace agree.
#[derive(Clone)]
struct TokioClock(tokio::time::Instant);

impl tollgate::clock::Clock for TokioClock {
    fn now_micros(&self) -> u64 {
        1_000_000_000 + self.0.elapsed().as_micros() as u64
    }
}

/// A server in process on tokio's clock: 100 a minute, all clients on one key.
fn hundred_a_minute() -> Router {
    let store = tollgate::store::MemoryStore::builder()
        .clock(TokioClock(tokio::time::Instant::now()))
        .build()
        .unwrap();
    Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::builder()
            .rule(Rule::new("api", Quota::per_minute(100)).key(Global))
            .store(store)
            .build()
            .unwrap(),
    )
}

/// A client loop of `calls` calls through `layer` over `app`: a call not sent waits what its
/// `Throttled` says and goes again. The 429s it received.
async fn client_loop(app: Router, layer: HonourLimitsLayer, calls: usize) -> usize {
    let mut client = layer.layer(app);
    let (mut done, mut denied) = (0, 0);
    while done < calls {
        let request = Request::get("/").body(axum::body::Body::empty()).unwrap();
        let ready = ServiceExt::<Request<axum::body::Body>>::ready(&mut client)
            .await
            .unwrap();
        match ready.call(request).await {
            Ok(response) => {
                done += 1;
                if response.status() == StatusCode::TOO_MANY_REQUESTS {
                    denied += 1;
                }
                let _ = response.into_body().collect().await;
            }
            Err(ClientError::Throttled(throttled)) => tokio::time::sleep(throttled.wait()).await,
            Err(ClientError::Inner(error)) => panic!("{error}"),
        }
    }
    denied
}

#[tokio::test(start_paused = true)]
async fn a_paced_client_sends_a_thousand_calls_without_a_429_near_the_ideal_time() {
    let start = tokio::time::Instant::now();
    let denied = client_loop(
        hundred_a_minute(),
        HonourLimitsLayer::new().pace(Pacing::new()),
        1000,
    )
    .await;
    let took = start.elapsed();
    // The burst of 100 at once, then one every 0.6 s: (1,000 - 100) × 0.6 s.
    let ideal = Duration::from_secs(540);
    eprintln!("1,000 paced calls: {denied} 429s, {took:?} (ideal {ideal:?})");
    assert_eq!(denied, 0, "no call denied");
    assert!(took >= ideal, "{took:?}: never faster than the budget");
    assert!(
        took <= ideal.mul_f64(1.1),
        "{took:?}: within 1.1 × {ideal:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn ten_paced_clients_sharing_a_key_get_far_fewer_429s_than_unpaced_ones() {
    let app = hundred_a_minute();
    let run = |pacing: Option<Pacing>| {
        let app = app.clone();
        async move {
            let clients: Vec<_> = (0..10)
                .map(|_| {
                    let layer = match pacing {
                        Some(pacing) => HonourLimitsLayer::new().pace(pacing),
                        None => HonourLimitsLayer::new(),
                    };
                    tokio::spawn(client_loop(app.clone(), layer, 100))
                })
                .collect();
            let mut denied = 0;
            for client in clients {
                denied += client.await.unwrap();
            }
            denied
        }
    };
    let unpaced = run(None).await;
    // A new minute's budget for the paced ones.
    tokio::time::sleep(Duration::from_secs(120)).await;
    let paced = run(Some(Pacing::new())).await;
    eprintln!("10 clients × 100 calls on one key: {unpaced} 429s unpaced, {paced} paced");
    assert!(paced * 4 < unpaced, "{paced} 429s paced, {unpaced} unpaced");
}

// ----- Malformed fields -----

/// A spent policy followed by a rest that RFC 9651 does not parse, each form once; the last
/// two put the spent policy and the malformed rest on two lines of one field.
const MALFORMED: [&[&str]; 13] = [
    &[r#""p";r=0;t=60,"#],                  // a trailing comma
    &[r#""p";r=0;t=60;"#],                  // a trailing semicolon
    &[r#""p";r=0;t=60, , "q";r=1"#],        // an empty member
    &[r#""p";r=0;t=60, "q"#],               // an unterminated string
    &[r#""p";r=0;t=60, ("q" "r""#],         // an unterminated inner list
    &[r#""p";r=0;t=60, "q\x""#],            // a bad escape
    &[r#""p";r=0;t=60, ?2"#],               // a Boolean neither ?0 nor ?1
    &[r#""p";r=0;t=60, 1234567890123456"#], // an Integer of 16 digits
    &[r#""p";r=0;t=60, 1.2345"#],           // a Decimal of 4 fractional digits
    &[r#""p";r=0;t=60, "q";=1"#],           // an empty parameter key
    &[r#""p";r=0;t=60, "q";r="#],           // a parameter with `=` and no value
    &[r#""p";r=0;t=60"#, r#""q";r=1;"#],    // a second line, malformed
    &[r#""p";r=0;t=60"#, ""],               // an empty second line: a trailing comma joined
];

#[tokio::test]
async fn a_malformed_ratelimit_field_is_ignored_whole() {
    for (form, lines) in MALFORMED.iter().enumerate() {
        let path = format!("/{form}");
        let script = Script::default();
        let headers = lines
            .iter()
            .map(|line| ("ratelimit", (*line).to_owned()))
            .collect();
        script.answer(&path, vec![(200, headers)]);
        let (addr, _) = serve(script.router(&[&path])).await;
        let mut client = HonourLimitsLayer::new().layer(
            Client::builder(hyper_util::rt::TokioExecutor::new()).build_http::<Empty<Bytes>>(),
        );
        for _ in 0..2 {
            assert_eq!(
                call_of(&mut client, get_path(addr, &path)).await,
                Ok(200),
                "the malformed field {lines:?} was obeyed"
            );
        }
        assert_eq!(script.seen().len(), 2);
    }
    // The same spent policy, well-formed, is obeyed: on one line and joined from two.
    for lines in [
        &[r#""p";r=0;t=60, "q";r=1"#][..],
        &[r#""q";r=1"#, r#""p";r=0;t=60"#],
    ] {
        let script = Script::default();
        let headers = lines
            .iter()
            .map(|line| ("ratelimit", (*line).to_owned()))
            .collect();
        script.answer("/ok", vec![(200, headers)]);
        let (addr, _) = serve(script.router(&["/ok"])).await;
        let mut client = HonourLimitsLayer::new().layer(
            Client::builder(hyper_util::rt::TokioExecutor::new()).build_http::<Empty<Bytes>>(),
        );
        assert_eq!(call_of(&mut client, get_path(addr, "/ok")).await, Ok(200));
        let wait = call_of(&mut client, get_path(addr, "/ok")).await;
        assert!(
            wait.is_err_and(|wait| wait > Duration::from_secs(59)),
            "{lines:?}: {wait:?}"
        );
    }
}

// ----- What a retrying client retried -----

#[tokio::test]
async fn a_retrying_client_counts_and_reports_the_refusals_it_retried() {
    let script = Script::default();
    script.answer(
        "/",
        vec![
            (429, vec![("retry-after", "0".to_owned())]),
            (503, vec![("retry-after", "0".to_owned())]),
            (200, vec![]),
        ],
    );
    let (addr, _) = serve(script.router(&["/"])).await;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let reported = seen.clone();
    let retry = Retry::new()
        .jitter(0.0, Duration::from_millis(1))
        .budget(1.0, 1.0);
    let layer = RetryAfterLayer::new(retry).on_retry(move |retried| {
        reported
            .lock()
            .unwrap()
            .push((retried.status(), retried.attempt(), retried.wait()));
    });
    assert_eq!(layer.retries(), 0);
    let mut client = layer
        .clone()
        .layer(Client::builder(hyper_util::rt::TokioExecutor::new()).build_http::<Empty<Bytes>>());
    assert_eq!(call_of(&mut client, get_path(addr, "/")).await, Ok(200));
    // Seen by the layer, its clones and the services it made alike.
    assert_eq!(layer.retries(), 2);
    assert_eq!(client.retries(), 2);
    assert_eq!(
        *seen.lock().unwrap(),
        [
            (StatusCode::TOO_MANY_REQUESTS, 1, Duration::ZERO),
            (StatusCode::SERVICE_UNAVAILABLE, 2, Duration::ZERO)
        ]
    );
    // A call served at once retries nothing.
    assert_eq!(call_of(&mut client, get_path(addr, "/")).await, Ok(200));
    assert_eq!(layer.retries(), 2);
    assert_eq!(script.seen().len(), 4);
}
