//! The answers follow draft-ietf-httpapi-ratelimit-headers-11 to the letter, on every algorithm:
//! every `RateLimit` and `RateLimit-Policy` field is parsed with an independent Structured Field
//! Values parser (RFC 9651, the `sfv` crate), never with tollgate's own writer, and the relations
//! the draft sets are checked on every response.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use sfv::{BareItem, List, ListEntry, Parser};
use tollgate::clock::ManualClock;
use tollgate::store::MemoryStore;
use tollgate::{Algorithm, Quota, RateLimitLayer, Rule};
use tower::ServiceExt;

const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// Each item of a List field: its name (an sf-string), its integer parameters, and its `qu`
/// parameter (§3.1.2: a String), the only other one tollgate sends.
fn items(field: &str, value: &str) -> Vec<(String, HashMap<String, i64>, Option<String>)> {
    let list: List = Parser::new(value)
        .parse()
        .unwrap_or_else(|e| panic!("{field}: {value:?} is not a Structured Field List: {e}"));
    assert!(!list.is_empty(), "{field}: an empty list");
    list.into_iter()
        .map(|entry| {
            let ListEntry::Item(item) = entry else {
                panic!("{field}: an inner list in {value:?}");
            };
            let BareItem::String(name) = &item.bare_item else {
                panic!("{field}: the policy name is not an sf-string in {value:?}");
            };
            let mut unit = None;
            let mut params = HashMap::new();
            for (key, value) in item.params.iter() {
                if key.as_str() == "qu" {
                    let BareItem::String(qu) = value else {
                        panic!("{field}: qu is not an sf-string in {value:?}");
                    };
                    unit = Some(qu.as_str().to_owned());
                    continue;
                }
                let value = value.as_integer().unwrap_or_else(|| {
                    panic!("{field}: parameter {key:?} is not an integer in {value:?}")
                });
                params.insert(key.as_str().to_owned(), i64::from(value));
            }
            (name.as_str().to_owned(), params, unit)
        })
        .collect()
}

/// Checks one answer against the draft; returns its status.
async fn check_answer(response: Response<Body>) -> StatusCode {
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    check_parts(parts.status, &parts.headers, &body)
}

/// Checks an answer's status, fields and body (read only for a 429) against the draft.
fn check_parts(status: StatusCode, headers: &http::HeaderMap, body: &[u8]) -> StatusCode {
    let header = |name: &str| headers.get(name).map(|v| v.to_str().unwrap().to_owned());

    // §3: RateLimit-Policy, "q" REQUIRED non-negative, "w" a non-zero number of seconds; "qu" a
    // registered unit (§10.3). tollgate gives every policy a window but its concurrency limits:
    // what they hold is not spread over time.
    let policies: HashMap<String, (HashMap<String, i64>, Option<String>)> = items(
        "RateLimit-Policy",
        &header("ratelimit-policy").expect("RateLimit-Policy"),
    )
    .into_iter()
    .map(|(name, params, unit)| (name, (params, unit)))
    .collect();
    for (name, (params, unit)) in &policies {
        assert!(params["q"] >= 0, "{name}: q");
        match unit.as_deref() {
            None => assert!(params["w"] >= 1, "{name}: w"),
            Some("concurrent-requests") => assert!(!params.contains_key("w"), "{name}: w"),
            Some(other) => panic!("{name}: qu={other:?}, a unit tollgate does not use"),
        }
    }
    // §4: RateLimit, "r" REQUIRED non-negative, "t" the effective window: never 0 while r < q
    // (and none for a concurrency limit, which has no window).
    let budgets = items("RateLimit", &header("ratelimit").expect("RateLimit"));
    let mut windows = HashMap::new();
    for (name, params, unit) in &budgets {
        assert!(unit.is_none(), "{name}: qu in RateLimit");
        let (policy, policy_unit) = policies
            .get(name)
            .unwrap_or_else(|| panic!("RateLimit names {name:?}, which RateLimit-Policy does not"));
        let (r, q) = (params["r"], policy["q"]);
        assert!((0..=q).contains(&r), "{name}: r={r} outside 0..={q}");
        if policy_unit.is_some() {
            assert!(
                !params.contains_key("t"),
                "{name}: t for a concurrency limit"
            );
            continue;
        }
        let t = params["t"];
        assert!(t >= 0, "{name}: t");
        if r < q {
            assert!(t >= 1, "{name}: t=0 while r={r} < q={q}");
        }
        windows.insert(name.clone(), t);
    }

    if status == StatusCode::TOO_MANY_REQUESTS {
        // §5.1: the quota-exceeded problem type, with the violated policies.
        assert_eq!(
            header("content-type").as_deref(),
            Some("application/problem+json")
        );
        let problem: serde_json::Value = serde_json::from_slice(body).unwrap();
        assert_eq!(problem["type"], QUOTA_EXCEEDED);
        assert_eq!(problem["status"], 429);
        let violated: Vec<String> = problem["violated-policies"]
            .as_array()
            .expect("a violated-policies array")
            .iter()
            .map(|p| p.as_str().unwrap().to_owned())
            .collect();
        assert!(!violated.is_empty());
        // §6: Retry-After never earlier than the end of a denying policy's effective window.
        let retry_after: i64 = header("retry-after").unwrap().parse().unwrap();
        assert!(retry_after >= 1);
        for name in &violated {
            assert!(
                policies.contains_key(name),
                "{name}: violated, not a policy"
            );
            if let Some(t) = windows.get(name) {
                assert!(
                    retry_after >= *t,
                    "{name}: Retry-After {retry_after} before the end of its window t={t}"
                );
            }
        }
    } else {
        assert_eq!(status, StatusCode::OK);
        assert!(header("retry-after").is_none());
    }
    status
}

fn app(rules: Vec<Rule>, clock: &ManualClock) -> Router {
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let layer = RateLimitLayer::builder()
        .rules(rules)
        .store(store)
        .build()
        .unwrap();
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
}

async fn send(app: &Router) -> Response<Body> {
    let mut request = Request::get("/").body(Body::empty()).unwrap();
    request
        .extensions_mut()
        .insert(ConnectInfo(SocketAddr::from(([192, 0, 2, 1], 1234))));
    app.clone().oneshot(request).await.unwrap()
}

/// Steps of a timeline: bursts and pauses of every length, from a fixed seed.
fn gaps() -> impl Iterator<Item = Duration> {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    std::iter::from_fn(move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let millis = match seed % 10 {
            0..=4 => 0,
            5..=7 => seed % 3_000,
            8 => seed % 20_000,
            _ => seed % 90_000,
        };
        Some(Duration::from_millis(millis))
    })
}

#[tokio::test]
async fn every_answer_of_every_algorithm_follows_draft_11() {
    for algorithm in Algorithm::ALL {
        if algorithm.is_concurrency() {
            // Its slots come back with each body: see the test below.
            continue;
        }
        let clock = ManualClock::default();
        let quota = if algorithm.has_burst() {
            Quota::per_minute(6).burst(3)
        } else {
            Quota::per_minute(6)
        };
        let app = app(vec![Rule::new("only", quota).algorithm(algorithm)], &clock);
        let mut denied = 0;
        for gap in gaps().take(300) {
            clock.advance(gap);
            if check_answer(send(&app).await).await == StatusCode::TOO_MANY_REQUESTS {
                denied += 1;
            }
        }
        assert!(
            denied > 0,
            "{algorithm}: the timeline never reached the limit"
        );
    }
}

#[tokio::test]
async fn concurrency_answers_follow_draft_11() {
    let clock = ManualClock::default();
    let app = app(
        vec![
            Rule::concurrent("slots", 3),
            Rule::new("hourly", Quota::per_hour(40)),
        ],
        &clock,
    );
    // Requests whose bodies are not read yet hold their slots; some are read at each step.
    let mut held = Vec::new();
    let mut statuses = Vec::new();
    for (n, gap) in gaps().take(120).enumerate() {
        clock.advance(gap / 16);
        let response = send(&app).await;
        if response.status() == StatusCode::OK {
            let (parts, body) = response.into_parts();
            statuses.push(check_parts(parts.status, &parts.headers, b""));
            held.push(body);
        } else {
            statuses.push(check_answer(response).await);
        }
        if n % 4 == 3 {
            held.drain(..held.len().min(2));
        }
    }
    assert!(statuses.contains(&StatusCode::OK));
    assert!(statuses.contains(&StatusCode::TOO_MANY_REQUESTS));
}

#[tokio::test]
async fn stacked_policies_of_different_algorithms_follow_draft_11() {
    for (a, b) in [
        (Algorithm::TokenBucket, Algorithm::FixedWindow),
        (Algorithm::Gcra, Algorithm::SlidingWindowCounter),
        (Algorithm::SlidingWindowLog, Algorithm::TokenBucket),
        (Algorithm::FixedWindow, Algorithm::SlidingWindowLog),
    ] {
        let clock = ManualClock::default();
        let burst = if a.has_burst() {
            Quota::per_second(1).burst(2)
        } else {
            Quota::new(2, Duration::from_secs(2))
        };
        let app = app(
            vec![
                Rule::new("burst", burst).algorithm(a),
                Rule::new("hourly", Quota::per_hour(20)).algorithm(b),
            ],
            &clock,
        );
        let mut statuses = Vec::new();
        for gap in gaps().take(200) {
            clock.advance(gap / 8);
            statuses.push(check_answer(send(&app).await).await);
        }
        assert!(
            statuses.contains(&StatusCode::TOO_MANY_REQUESTS),
            "{a} + {b}"
        );
    }
}

#[tokio::test]
async fn the_quick_start_answers_parse_and_agree() {
    // 5 per minute, as in the README: one token every 12 s.
    let clock = ManualClock::default();
    let app = app(vec![Rule::new("per-minute", Quota::per_minute(5))], &clock);
    for _ in 0..5 {
        assert_eq!(check_answer(send(&app).await).await, StatusCode::OK);
    }
    let denied = send(&app).await;
    assert_eq!(denied.headers()["retry-after"], "12");
    assert_eq!(denied.headers()["ratelimit"], "\"per-minute\";r=0;t=12");
    assert_eq!(check_answer(denied).await, StatusCode::TOO_MANY_REQUESTS);
}
