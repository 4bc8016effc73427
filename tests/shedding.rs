//! Load shedding: the lowest priority classes are shed first, `critical` requests keep their
//! share, a request counts as in flight until its body ends, shed requests are charged to no
//! rule, and the 503 (or gRPC `UNAVAILABLE`) a shed client gets.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tokio::sync::watch;
use tollgate::key::Global;
use tollgate::testing::{Budget, Problem};
use tollgate::{Priority, Quota, RateLimitLayer, Rule, Shedding};
use tower::ServiceExt;

/// The priority a request's `x-priority` header names (`normal` without one).
fn priority(parts: &http::request::Parts) -> Priority {
    match parts.headers.get("x-priority").map(|v| v.as_bytes()) {
        Some(b"critical") => Priority::Critical,
        Some(b"low") => Priority::Low,
        _ => Priority::Normal,
    }
}

fn request(class: &str) -> Request<Body> {
    Request::get("/work")
        .header("x-priority", class)
        .body(Body::empty())
        .unwrap()
}

/// An app whose handler waits until `gate` opens, counting the requests in it.
fn app(shedding: Shedding, gate: watch::Receiver<bool>, inside: Arc<AtomicUsize>) -> Router {
    Router::new()
        .route(
            "/work",
            get(move || {
                let mut gate = gate.clone();
                let inside = inside.clone();
                async move {
                    inside.fetch_add(1, Ordering::SeqCst);
                    let _ = gate.wait_for(|open| *open).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    "done"
                }
            }),
        )
        .layer(unlimited(shedding))
}

/// A layer whose only limit is `shedding`: it has no rules.
fn unlimited(shedding: Shedding) -> RateLimitLayer {
    RateLimitLayer::builder().shed(shedding).build().unwrap()
}

/// Waits until `n` requests are in the handler.
async fn until_inside(inside: &AtomicUsize, n: usize) {
    tokio::time::timeout(Duration::from_secs(10), async {
        while inside.load(Ordering::SeqCst) < n {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{n} requests never reached the handler"));
}

#[tokio::test]
async fn low_requests_are_shed_first_and_critical_ones_keep_their_share() {
    let (open, gate) = watch::channel(false);
    let inside = Arc::new(AtomicUsize::new(0));
    // 20 in flight: low ones up to 10, normal ones up to 16, critical ones all 20.
    let app = app(Shedding::new(20).priority(priority), gate, inside.clone());

    let mut held = Vec::new();
    for _ in 0..10 {
        held.push(tokio::spawn(app.clone().oneshot(request("low"))));
    }
    until_inside(&inside, 10).await;
    // The low share is full: more low requests are shed at once, normal ones are not.
    for _ in 0..5 {
        let shed = app.clone().oneshot(request("low")).await.unwrap();
        assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
    for _ in 0..6 {
        held.push(tokio::spawn(app.clone().oneshot(request("normal"))));
    }
    until_inside(&inside, 16).await;
    let shed = app.clone().oneshot(request("normal")).await.unwrap();
    assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);
    let shed = app.clone().oneshot(request("low")).await.unwrap();
    assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);
    // The last 4 are critical's.
    for _ in 0..4 {
        held.push(tokio::spawn(app.clone().oneshot(request("critical"))));
    }
    until_inside(&inside, 20).await;
    // Now the whole capacity is in use: even a critical request is shed.
    let shed = app.clone().oneshot(request("critical")).await.unwrap();
    assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);

    open.send(true).unwrap();
    for request in held {
        let response = request.await.unwrap().unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            &response.into_body().collect().await.unwrap().to_bytes()[..],
            b"done"
        );
    }
    // Every place is free again.
    let mut again = Vec::new();
    for _ in 0..10 {
        again.push(app.clone().oneshot(request("low")).await.unwrap());
    }
    assert!(again.iter().all(|r| r.status() == StatusCode::OK));
}

#[tokio::test]
async fn a_flood_of_low_and_normal_requests_never_sheds_critical_ones_within_their_share() {
    let (open, gate) = watch::channel(false);
    let inside = Arc::new(AtomicUsize::new(0));
    let app = app(Shedding::new(20).priority(priority), gate, inside.clone());
    // The gate opens and closes while 400 low and normal requests and 4 loops of critical ones
    // (the share kept for them) run at once.
    let flipper = tokio::spawn(async move {
        for n in 0..40 {
            let _ = open.send(n % 2 == 1);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = open.send(true);
    });
    let mut flood = Vec::new();
    for n in 0..400 {
        let class = if n % 3 == 0 { "normal" } else { "low" };
        flood.push(tokio::spawn(app.clone().oneshot(request(class))));
    }
    let critical: Vec<_> = (0..4)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                for _ in 0..25 {
                    let response = app.clone().oneshot(request("critical")).await.unwrap();
                    statuses.push(response.status());
                    response.into_body().collect().await.unwrap();
                }
                statuses
            })
        })
        .collect();
    let mut shed = 0;
    for request in flood {
        match request.await.unwrap().unwrap().status() {
            StatusCode::OK => {}
            StatusCode::SERVICE_UNAVAILABLE => shed += 1,
            other => panic!("unexpected status {other}"),
        }
    }
    for loop_ in critical {
        let statuses = loop_.await.unwrap();
        assert_eq!(statuses.len(), 25);
        assert!(
            statuses.iter().all(|s| *s == StatusCode::OK),
            "a critical request was shed: {statuses:?}"
        );
    }
    flipper.await.unwrap();
    assert!(shed > 0, "the flood was never shed");
    assert_eq!(inside.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_shed_request_gets_503_retry_after_and_a_problem_document_and_costs_no_rule() {
    let (open, gate) = watch::channel(false);
    let inside = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/work",
            get(move || {
                let mut gate = gate.clone();
                let inside = inside.clone();
                async move {
                    inside.fetch_add(1, Ordering::SeqCst);
                    let _ = gate.wait_for(|open| *open).await;
                    "done"
                }
            }),
        )
        .layer(
            RateLimitLayer::builder()
                .rule(Rule::new("api", Quota::per_hour(10)).key(Global))
                .shed(Shedding::new(2).priority(priority))
                .build()
                .unwrap(),
        );
    // One low request fills the low share (50 % of 2).
    let first = tokio::spawn(app.clone().oneshot(request("low")));
    tokio::time::sleep(Duration::from_millis(20)).await;
    let shed = app.clone().oneshot(request("low")).await.unwrap();
    assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(shed.headers()["retry-after"], "1");
    assert_eq!(shed.headers()["content-type"], "application/problem+json");
    // The violated policy is advertised with the share of the request's class (draft-11 §5.2),
    // and no rule's budget: none was checked.
    assert_eq!(
        shed.headers()["ratelimit-policy"],
        r#""load-shedding";q=1;qu="concurrent-requests""#
    );
    assert_eq!(shed.headers()["ratelimit"], r#""load-shedding";r=0"#);
    let body = shed.into_body().collect().await.unwrap().to_bytes();
    let problem = Problem::of(&body).unwrap();
    assert_eq!(
        problem.problem_type,
        "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"
    );
    assert_eq!(problem.status, 503);
    assert_eq!(problem.violated_policies, ["load-shedding"]);

    // A gRPC call is told UNAVAILABLE with a pushback.
    let grpc = app
        .clone()
        .oneshot(
            Request::post("/work")
                .header("content-type", "application/grpc")
                .header("x-priority", "low")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(grpc.status(), StatusCode::OK);
    assert_eq!(grpc.headers()["grpc-status"], "14");
    assert_eq!(grpc.headers()["grpc-retry-pushback-ms"], "1000");

    open.send(true).unwrap();
    first.await.unwrap().unwrap();
    // Two requests were admitted (the first, and this one) of 10: the shed ones cost nothing.
    let next = app.clone().oneshot(request("normal")).await.unwrap();
    assert_eq!(next.status(), StatusCode::OK);
    let budget = Budget::of(next.headers()).unwrap();
    assert_eq!(budget.limit("api").unwrap().remaining, 8);
}

#[tokio::test]
async fn a_request_is_in_flight_until_its_body_ends_or_is_dropped() {
    let app = Router::new()
        .route(
            "/work",
            get(|| async {
                let chunks = futures_util::stream::iter(["a", "b"].map(Ok::<_, std::io::Error>));
                Body::from_stream(chunks)
            }),
        )
        .layer(unlimited(Shedding::new(2).priority(priority)));
    // The handler has answered, but the body is not read: the request is still in flight.
    let unread = app.clone().oneshot(request("low")).await.unwrap();
    assert_eq!(unread.status(), StatusCode::OK);
    let shed = app.clone().oneshot(request("low")).await.unwrap();
    assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);
    // Read to its end, the place is free.
    let body = unread.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"ab");
    let read = app.clone().oneshot(request("low")).await.unwrap();
    assert_eq!(read.status(), StatusCode::OK);
    // Dropped unread (a client that left), the place is free too.
    drop(read);
    let after = app.clone().oneshot(request("low")).await.unwrap();
    assert_eq!(after.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_layer_that_only_sheds_builds_and_sheds() {
    // A route of its own for streams, shed apart from the rest: no rule, only a capacity.
    let (open, gate) = watch::channel(false);
    let inside = Arc::new(AtomicUsize::new(0));
    let app = app(Shedding::new(2).priority(priority), gate, inside.clone());
    let first = tokio::spawn(app.clone().oneshot(request("low")));
    until_inside(&inside, 1).await;
    let shed = app.clone().oneshot(request("low")).await.unwrap();
    assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);
    open.send(true).unwrap();
    let served = first.await.unwrap().unwrap();
    assert_eq!(served.status(), StatusCode::OK);
    // No rule, so no budget to advertise.
    assert!(!served.headers().contains_key("ratelimit"), "{served:?}");

    // Neither rules nor shedding: a layer that would do nothing does not build.
    let Err(error) = RateLimitLayer::builder().build() else {
        panic!("a layer with no rules and no shedding built");
    };
    let message = error.to_string();
    assert!(
        message.contains("no rules") && message.contains(".shed("),
        "{message}"
    );
}

#[test]
fn bad_shedding_settings_fail_the_build() {
    for shedding in [
        Shedding::new(0),
        Shedding::new(10).shares(0, 50),
        Shedding::new(10).shares(60, 50),
        Shedding::new(10).shares(50, 100),
    ] {
        let Err(error) = RateLimitLayer::builder()
            .rule(Rule::new("api", Quota::per_second(10)))
            .shed(shedding)
            .build()
        else {
            panic!("built with bad shedding settings");
        };
        assert!(error.to_string().contains("load shedding"), "{error}");
    }
}

/// A backend of `workers` (some of which `taken` holds back), each request taking 10 ms.
fn backend(shedding: Shedding, workers: Arc<tokio::sync::Semaphore>) -> Router {
    Router::new()
        .route(
            "/work",
            get(move || {
                let workers = workers.clone();
                async move {
                    let _worker = workers.acquire().await.unwrap();
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    "done"
                }
            }),
        )
        .layer(unlimited(shedding))
}

/// Closed loops of each class against `app` until `until`: (served, shed) per class.
async fn load(app: &Router, until: tokio::time::Instant) -> [(u64, u64); 3] {
    let mut tasks = Vec::new();
    for (class, loops) in [("low", 24), ("normal", 12), ("critical", 2)] {
        for _ in 0..loops {
            let app = app.clone();
            tasks.push(tokio::spawn(async move {
                let (mut served, mut shed) = (0, 0);
                while tokio::time::Instant::now() < until {
                    let response = app.clone().oneshot(request(class)).await.unwrap();
                    let status = response.status();
                    let _ = response.into_body().collect().await;
                    match status {
                        StatusCode::OK => served += 1,
                        StatusCode::SERVICE_UNAVAILABLE => {
                            shed += 1;
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        other => panic!("unexpected {other}"),
                    }
                }
                (class, served, shed)
            }));
        }
    }
    let mut out = [(0, 0); 3];
    for task in tasks {
        let (class, served, shed) = task.await.unwrap();
        let i = ["low", "normal", "critical"]
            .iter()
            .position(|c| *c == class)
            .unwrap();
        out[i].0 += served;
        out[i].1 += shed;
    }
    out
}

#[tokio::test(start_paused = true)]
async fn an_adaptive_capacity_falls_when_the_backend_slows_and_sheds_low_requests_first() {
    let workers = Arc::new(tokio::sync::Semaphore::new(16));
    let shedding = Shedding::new(64)
        .adaptive(tollgate::Adaptive::new())
        .priority(priority);
    let app = backend(shedding.clone(), workers.clone());
    assert_eq!(
        shedding.capacity_now(),
        4,
        "its least, until it has measured"
    );

    let start = tokio::time::Instant::now();
    let before = load(&app, start + Duration::from_secs(5)).await;
    let sixteen = shedding.capacity_now();
    // 16 workers of 10 ms: every worker busy, a short queue.
    assert!(
        (17..=40).contains(&sixteen),
        "learned {sixteen} for 16 workers"
    );

    // Half the workers go away: latency doubles at that capacity, and the capacity follows.
    let taken = workers.clone().acquire_many_owned(8).await.unwrap();
    let after = load(&app, tokio::time::Instant::now() + Duration::from_secs(5)).await;
    let eight = shedding.capacity_now();
    // Near the workers: in paused time every request takes exactly 10 ms, and the workers
    // move in lock-step, so that any queue shows at once in the 90th percentile.
    assert!(
        (6..=sixteen * 3 / 4).contains(&eight),
        "learned {eight} for 8 workers, {sixteen} for 16"
    );
    drop(taken);
    load(&app, tokio::time::Instant::now() + Duration::from_secs(5)).await;
    assert!(
        shedding.capacity_now() > eight,
        "came back: {}",
        shedding.capacity_now()
    );

    for (phase, figures) in [("16 workers", before), ("8 workers", after)] {
        let [low, normal, critical] = figures;
        let share = |(served, shed): (u64, u64)| shed as f64 / (served + shed).max(1) as f64;
        assert!(
            share(low) > share(normal),
            "{phase}: low shed first ({low:?} vs {normal:?})"
        );
        assert_eq!(critical.1, 0, "{phase}: no critical request shed");
        assert!(
            critical.0 > 0 && normal.0 > 0,
            "{phase}: served {figures:?}"
        );
    }
    assert_eq!(shedding.in_flight(), 0, "every request counted out");
}
