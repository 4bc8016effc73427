//! `BodyKeyLayer` on a real axum route in front of the rate limit: keys by the normalised email,
//! hands the handler the identical bytes, holds at most the limit (plus one frame) of a 100 MB
//! streamed body, and falls back to the client IP when there is no usable field.

#![cfg(feature = "axum")]

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::Router;
use axum::body::Body;
use axum::extract::{ConnectInfo, Request};
use axum::routing::post;
use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use http_body::{Body as HttpBody, Frame};
use tollgate::key::{
    BodyFieldKey, BodyKeyLayer, BodyOutcome, BodyScan, ClientIp, DEFAULT_BODY_LIMIT, FromBody, Key,
    KeyExtractorExt,
};
use tollgate::{Quota, RateLimitLayer, Rule};
use tower::{Service, ServiceExt};

/// A body made on the fly: `count` frames from `next`, then trailers or an error. Counts the
/// bytes it produced, so a test can see how much was pulled before the handler ran.
struct Generated {
    next: Box<dyn FnMut(usize) -> Bytes + Send>,
    index: usize,
    count: usize,
    trailers: Option<HeaderMap>,
    fail: bool,
    produced: Arc<AtomicUsize>,
}

impl Generated {
    fn new(count: usize, next: impl FnMut(usize) -> Bytes + Send + 'static) -> Self {
        Generated {
            next: Box::new(next),
            index: 0,
            count,
            trailers: None,
            fail: false,
            produced: Arc::default(),
        }
    }

    fn chunks(chunks: Vec<Bytes>) -> Self {
        let count = chunks.len();
        let mut queue: VecDeque<Bytes> = chunks.into();
        Generated::new(count, move |_| queue.pop_front().unwrap())
    }
}

impl HttpBody for Generated {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let this = &mut *self;
        if this.index < this.count {
            let chunk = (this.next)(this.index);
            this.index += 1;
            this.produced.fetch_add(chunk.len(), Ordering::SeqCst);
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        if this.fail {
            this.fail = false;
            return Poll::Ready(Some(Err(std::io::Error::other("connection reset"))));
        }
        Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }
}

/// What the handler saw.
#[derive(Debug, Default)]
struct Seen {
    /// Bytes the body had produced when the handler started.
    produced_before: usize,
    bytes: Vec<u8>,
    len: usize,
    matches_pattern: bool,
    trailers: Option<HeaderMap>,
    error: bool,
    key: Option<Key>,
    scan: Option<BodyScan>,
}

#[derive(Clone, Default)]
struct Observer {
    seen: Arc<Mutex<Vec<Seen>>>,
    produced: Arc<Mutex<Option<Arc<AtomicUsize>>>>,
}

const PATTERN_LEN: usize = 1 << 20;

fn pattern() -> Bytes {
    Bytes::from(
        (0..PATTERN_LEN)
            .map(|i| (i * 31 % 251) as u8)
            .collect::<Vec<u8>>(),
    )
}

fn app(observer: Observer, quota: Quota, keep_bytes: bool, limit: usize) -> Router {
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("login", quota).key(FromBody.or(ClientIp::new())))
        .build()
        .unwrap();
    let pattern = pattern();
    let handler = move |request: Request| {
        let observer = observer.clone();
        let pattern = pattern.clone();
        async move {
            let produced = observer
                .produced
                .lock()
                .unwrap()
                .as_ref()
                .map(|p| p.load(Ordering::SeqCst));
            let mut seen = Seen {
                produced_before: produced.unwrap_or(0),
                key: request
                    .extensions()
                    .get::<BodyFieldKey>()
                    .map(|k| k.key().clone()),
                scan: request.extensions().get::<BodyScan>().copied(),
                matches_pattern: true,
                ..Seen::default()
            };
            let mut body = request.into_body();
            while let Some(frame) =
                std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
            {
                let Ok(frame) = frame else {
                    seen.error = true;
                    break;
                };
                match frame.into_data() {
                    Ok(data) => {
                        // Compare with the generator's pattern, chunk by chunk (memcmp).
                        let mut offset = 0;
                        while offset < data.len() {
                            let at = (seen.len + offset) % PATTERN_LEN;
                            let n = (PATTERN_LEN - at).min(data.len() - offset);
                            seen.matches_pattern &= data[offset..offset + n] == pattern[at..at + n];
                            offset += n;
                        }
                        seen.len += data.len();
                        if keep_bytes {
                            seen.bytes.extend_from_slice(&data);
                        }
                    }
                    Err(frame) => seen.trailers = frame.into_trailers().ok(),
                }
            }
            observer.seen.lock().unwrap().push(seen);
            "ok"
        }
    };
    Router::new()
        .route("/login", post(handler))
        .route_layer(layer)
        .route_layer(BodyKeyLayer::new("email").limit(limit))
}

fn login(body: Generated, content_type: &str, ip: [u8; 4]) -> http::Request<Body> {
    let mut request = http::Request::post("/login")
        .header("content-type", content_type)
        .body(Body::new(body))
        .unwrap();
    request
        .extensions_mut()
        .insert(ConnectInfo(SocketAddr::from((ip, 50_000))));
    request
}

async fn send(app: &mut Router, request: http::Request<Body>) -> StatusCode {
    let mut service = app.as_service::<Body>();
    let response = service.ready().await.unwrap().call(request).await.unwrap();
    response.status()
}

#[tokio::test]
async fn small_json_body_keys_by_normalised_email_and_reaches_the_handler_intact() {
    let observer = Observer::default();
    let mut app = app(
        observer.clone(),
        Quota::per_minute(100),
        true,
        DEFAULT_BODY_LIMIT,
    );
    let json = br#"{"password": "hunter2", "email": "  Alice@Example.COM ", "remember": true}"#;
    // In 5-byte frames, with trailers, to check that everything is replayed in order.
    let chunks: Vec<Bytes> = json.chunks(5).map(Bytes::copy_from_slice).collect();
    let mut body = Generated::chunks(chunks);
    let mut trailers = HeaderMap::new();
    trailers.insert("x-checksum", "abc".parse().unwrap());
    body.trailers = Some(trailers.clone());

    let status = send(&mut app, login(body, "application/json", [192, 0, 2, 1])).await;
    assert_eq!(status, StatusCode::OK);
    let seen = observer.seen.lock().unwrap().pop().unwrap();
    assert_eq!(seen.bytes, json, "the handler receives identical bytes");
    assert_eq!(seen.trailers, Some(trailers));
    assert_eq!(seen.key, Some(Key::digest("alice@example.com")));
    assert_eq!(
        seen.scan,
        Some(BodyScan {
            outcome: BodyOutcome::Found,
            buffered: json.len()
        })
    );
}

#[tokio::test]
async fn a_100_mb_streamed_body_is_held_only_up_to_the_limit() {
    const CHUNK: usize = 8 * 1024;
    const TOTAL: usize = 100 * 1024 * 1024;
    let observer = Observer::default();
    let mut app = app(
        observer.clone(),
        Quota::per_minute(100),
        false,
        DEFAULT_BODY_LIMIT,
    );
    let pattern = pattern();
    let body = Generated::new(TOTAL / CHUNK, move |i| {
        let at = i * CHUNK % PATTERN_LEN;
        pattern.slice(at..at + CHUNK)
    });
    *observer.produced.lock().unwrap() = Some(body.produced.clone());

    let status = send(&mut app, login(body, "application/json", [192, 0, 2, 1])).await;
    assert_eq!(status, StatusCode::OK);
    let seen = observer.seen.lock().unwrap().pop().unwrap();
    // Bounded: the layer pulled no more than the limit plus one frame before the handler ran.
    assert!(
        seen.produced_before <= DEFAULT_BODY_LIMIT + CHUNK,
        "{}",
        seen.produced_before
    );
    assert_eq!(
        seen.scan,
        Some(BodyScan {
            outcome: BodyOutcome::TooLarge,
            buffered: seen.produced_before
        })
    );
    // Complete: the handler received every byte, in order.
    assert_eq!(seen.len, TOTAL);
    assert!(
        seen.matches_pattern,
        "the handler's bytes differ from the body's"
    );
    assert!(!seen.error);
    assert_eq!(seen.key, None);
}

#[tokio::test]
async fn a_declared_length_over_the_limit_is_not_read_at_all() {
    let observer = Observer::default();
    let mut app = app(observer.clone(), Quota::per_minute(100), true, 32);
    let json = br#"{"email": "a-rather-long-address@example.com", "password": "x"}"#;
    let body = Generated::chunks(vec![Bytes::from_static(json)]);
    *observer.produced.lock().unwrap() = Some(body.produced.clone());
    let mut request = login(body, "application/json", [192, 0, 2, 1]);
    request
        .headers_mut()
        .insert("content-length", json.len().into());
    assert_eq!(send(&mut app, request).await, StatusCode::OK);
    let seen = observer.seen.lock().unwrap().pop().unwrap();
    assert_eq!(seen.produced_before, 0);
    assert_eq!(
        seen.scan,
        Some(BodyScan {
            outcome: BodyOutcome::TooLarge,
            buffered: 0
        })
    );
    assert_eq!(seen.bytes, json);
}

#[tokio::test]
async fn the_email_is_the_budget_whatever_the_ip_and_spelling() {
    let observer = Observer::default();
    let mut app = app(
        observer.clone(),
        Quota::per_minute(2),
        false,
        DEFAULT_BODY_LIMIT,
    );
    let attempt = |email: &str, ip: [u8; 4], form: bool| {
        let (body, ct) = if form {
            (
                format!(
                    "password=x&email={}",
                    email.replace('@', "%40").replace(' ', "+")
                ),
                "application/x-www-form-urlencoded",
            )
        } else {
            (
                format!(r#"{{"email":"{email}","password":"x"}}"#),
                "application/json; charset=utf-8",
            )
        };
        login(Generated::chunks(vec![Bytes::from(body)]), ct, ip)
    };
    assert_eq!(
        send(
            &mut app,
            attempt("alice@example.com", [192, 0, 2, 1], false)
        )
        .await,
        StatusCode::OK
    );
    assert_eq!(
        send(
            &mut app,
            attempt(" ALICE@example.com", [192, 0, 2, 2], true)
        )
        .await,
        StatusCode::OK
    );
    // A third IP, another spelling: the same account, over its budget.
    assert_eq!(
        send(
            &mut app,
            attempt("Alice@Example.Com ", [192, 0, 2, 3], false)
        )
        .await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Another account is not affected.
    assert_eq!(
        send(&mut app, attempt("bob@example.com", [192, 0, 2, 3], true)).await,
        StatusCode::OK
    );
    // The denied request never reached the handler.
    assert_eq!(observer.seen.lock().unwrap().len(), 3);
}

#[tokio::test]
async fn without_a_usable_field_the_client_ip_counts() {
    let observer = Observer::default();
    let mut app = app(
        observer.clone(),
        Quota::per_minute(2),
        true,
        DEFAULT_BODY_LIMIT,
    );
    let cases: [(&[u8], &str, BodyOutcome); 4] = [
        (
            b"email=alice%40example.com",
            "text/plain",
            BodyOutcome::NotChecked,
        ),
        (
            br#"{"user":"alice"}"#,
            "application/json",
            BodyOutcome::Missing,
        ),
        (
            br#"{"email":"alice@example.com""#,
            "application/json",
            BodyOutcome::Missing,
        ),
        (
            b"email=a&email=b",
            "application/x-www-form-urlencoded",
            BodyOutcome::Missing,
        ),
    ];
    for (i, (body, ct, outcome)) in cases.into_iter().enumerate() {
        // Two requests from one IP are admitted; the IP's third is not.
        let ip = [198, 51, 100, i as u8];
        for round in 0..3 {
            let status = send(
                &mut app,
                login(Generated::chunks(vec![Bytes::from_static(body)]), ct, ip),
            )
            .await;
            let want = if round < 2 {
                StatusCode::OK
            } else {
                StatusCode::TOO_MANY_REQUESTS
            };
            assert_eq!(status, want, "case {i} round {round}");
        }
        let seen = observer.seen.lock().unwrap().pop().unwrap();
        assert_eq!(seen.bytes, body, "case {i}");
        assert_eq!(seen.key, None, "case {i}");
        let scan = seen.scan.unwrap();
        assert_eq!(scan.outcome, outcome, "case {i}");
        if outcome == BodyOutcome::NotChecked {
            assert_eq!(scan.buffered, 0);
        }
    }
}

#[tokio::test]
async fn a_body_error_reaches_the_handler_after_the_bytes_before_it() {
    let observer = Observer::default();
    let mut app = app(
        observer.clone(),
        Quota::per_minute(100),
        true,
        DEFAULT_BODY_LIMIT,
    );
    let mut body = Generated::chunks(vec![
        Bytes::from_static(b"{\"email\":"),
        Bytes::from_static(b"\"a@b.c\""),
    ]);
    body.fail = true;
    assert_eq!(
        send(&mut app, login(body, "application/json", [192, 0, 2, 9])).await,
        StatusCode::OK
    );
    let seen = observer.seen.lock().unwrap().pop().unwrap();
    assert_eq!(seen.bytes, b"{\"email\":\"a@b.c\"");
    assert!(seen.error);
    assert_eq!(seen.scan.map(|s| s.outcome), Some(BodyOutcome::Unreadable));
    assert_eq!(seen.key, None);
}

#[tokio::test]
async fn from_body_without_the_layer_finds_nothing() {
    let (parts, ()) = http::Request::post("/login").body(()).unwrap().into_parts();
    assert!(matches!(
        tollgate::key::KeyExtractor::extract(&FromBody, &parts),
        tollgate::key::Extracted::Missing
    ));
}

/// A body whose frames arrive when the test sends them: a slow client.
struct Trickle(tokio::sync::mpsc::Receiver<Bytes>);

impl HttpBody for Trickle {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|c| Ok(Frame::data(c))))
    }
}

#[tokio::test]
async fn a_slow_body_does_not_hold_the_inner_services_readiness() {
    // The inner service admits one request at a time (its readiness is a permit). A client that
    // trickles its body must not hold that permit while the layer reads it.
    let inner = tower::ServiceBuilder::new()
        .concurrency_limit(1)
        .service(tower::service_fn(|request: Request| async move {
            let body = axum::body::to_bytes(request.into_body(), usize::MAX)
                .await
                .unwrap();
            Ok::<_, std::convert::Infallible>(http::Response::new(Body::from(body)))
        }));
    let mut service = tower::Layer::layer(&BodyKeyLayer::new("email"), inner);
    let json = |body: Body| {
        http::Request::post("/login")
            .header("content-type", "application/json")
            .body(body)
            .unwrap()
    };
    let (slow_sender, slow_body) = tokio::sync::mpsc::channel(1);
    slow_sender
        .send(Bytes::from_static(b"{\"email\":"))
        .await
        .unwrap();
    let slow = ServiceExt::<http::Request<Body>>::ready(&mut service)
        .await
        .unwrap()
        .call(json(Body::new(Trickle(slow_body))));
    let slow = tokio::spawn(slow);
    tokio::task::yield_now().await;

    let fast = async {
        ServiceExt::<http::Request<Body>>::ready(&mut service)
            .await
            .unwrap()
            .call(json(Body::from(r#"{"email":"b@example.com"}"#)))
            .await
            .unwrap()
    };
    let fast = tokio::time::timeout(std::time::Duration::from_secs(5), fast)
        .await
        .expect("the second request waited for the first one's slow body");
    assert_eq!(fast.status(), StatusCode::OK);

    slow_sender
        .send(Bytes::from_static(b"\"a@example.com\"}"))
        .await
        .unwrap();
    drop(slow_sender);
    let slow = slow.await.unwrap().unwrap();
    let body = axum::body::to_bytes(slow.into_body(), usize::MAX)
        .await
        .unwrap();
    assert_eq!(body, r#"{"email":"a@example.com"}"#);
}
