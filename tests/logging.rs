//! What the layer says through `tracing`: every denial at `info` (target `tollgate::denied`), a missing key once, with the
//! fix for the server in use, and what a shadow rule would have denied.
//!
//! Every test here installs its collector first: a callsite first reached with no collector can
//! be cached as disabled for the whole binary.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, StatusCode};
use tollgate::{Quota, RateLimitLayer, Rule};
use tower::{Service, ServiceExt};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

mod support;

/// Collects every event: its level, target and fields; and the fields of every span.
#[derive(Clone, Default)]
struct Events(
    Arc<Mutex<Vec<(Level, String, String)>>>,
    Arc<Mutex<Vec<(String, String)>>>,
);

struct Text(String);

impl Visit for Text {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!("{}={value:?} ", field.name()));
    }
}

impl Subscriber for Events {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, attributes: &Attributes<'_>) -> Id {
        let mut text = Text(String::new());
        attributes.record(&mut text);
        let mut spans = self.1.lock().unwrap();
        spans.push((attributes.metadata().name().to_owned(), text.0));
        Id::from_u64(spans.len() as u64)
    }
    fn record(&self, id: &Id, values: &Record<'_>) {
        let mut text = Text(String::new());
        values.record(&mut text);
        let mut spans = self.1.lock().unwrap();
        if let Some(span) = spans.get_mut(id.into_u64() as usize - 1) {
            span.1.push_str(&text.0);
        }
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut text = Text(String::new());
        event.record(&mut text);
        let meta = event.metadata();
        self.0
            .lock()
            .unwrap()
            .push((*meta.level(), meta.target().to_owned(), text.0));
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

impl Events {
    fn at(&self, level: Level) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(l, _, _)| *l == level)
            .map(|(_, target, text)| format!("{target}: {text}"))
            .collect()
    }
}

async fn send(app: &mut Router, request: Request<Body>) -> StatusCode {
    app.as_service()
        .ready()
        .await
        .unwrap()
        .call(request)
        .await
        .unwrap()
        .status()
}

fn from(ip: [u8; 4]) -> Request<Body> {
    let mut request = Request::get("/").body(Body::empty()).unwrap();
    request
        .extensions_mut()
        .insert(axum::extract::ConnectInfo(SocketAddr::from((ip, 4000))));
    request
}

#[tokio::test]
async fn every_denial_leaves_an_info_line_naming_the_rule() {
    let events = Events::default();
    let _guard = tracing::subscriber::set_default(events.clone());
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("per-minute", Quota::per_minute(1)))
        .build()
        .unwrap();
    let mut app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    assert_eq!(send(&mut app, from([9, 9, 9, 9])).await, StatusCode::OK);
    assert!(
        events
            .at(Level::INFO)
            .iter()
            .all(|e| !e.contains("request denied"))
    );
    for _ in 0..3 {
        assert_eq!(
            send(&mut app, from([9, 9, 9, 9])).await,
            StatusCode::TOO_MANY_REQUESTS
        );
    }
    let denials: Vec<String> = events
        .at(Level::INFO)
        .into_iter()
        .filter(|e| e.starts_with("tollgate::denied: ") && e.contains("request denied"))
        .collect();
    assert_eq!(denials.len(), 3, "{denials:#?}");
    assert!(denials[0].contains("per-minute"), "{}", denials[0]);
    assert!(
        !denials[0].contains("9.9.9.9"),
        "a denial line carries no client address: {}",
        denials[0]
    );
}

#[tokio::test]
async fn a_missing_peer_address_names_the_fix_for_the_server_in_use() {
    // An axum router served without connect info, and a gRPC call with no peer address: each
    // is told its own fix, once.
    let events = Events::default();
    let _guard = tracing::subscriber::set_default(events.clone());
    let layer = RateLimitLayer::new(Quota::per_minute(100)).unwrap();
    let mut app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route(
            "/pkg.Service/Method",
            axum::routing::post(|| async { "ok" }),
        )
        .layer(layer);
    for _ in 0..3 {
        let request = Request::get("/").body(Body::empty()).unwrap();
        send(&mut app, request).await;
    }
    let hints = events.at(Level::WARN);
    assert_eq!(hints.len(), 1, "{hints:#?}");
    assert!(
        hints[0].contains("into_make_service_with_connect_info"),
        "{}",
        hints[0]
    );
    for _ in 0..3 {
        let grpc = Request::post("/pkg.Service/Method")
            .header("content-type", "application/grpc")
            .body(Body::empty())
            .unwrap();
        send(&mut app, grpc).await;
    }
    let hints = events.at(Level::WARN);
    assert_eq!(hints.len(), 2, "{hints:#?}");
    assert!(hints[1].contains("tonic"), "{}", hints[1]);
}

#[tokio::test]
async fn shadow_rules_never_deny_are_charged_and_add_no_fields() {
    use tollgate::key::Global;
    use tollgate::policy::{Policy, Tier};

    let events = Events::default();
    let _guard = tracing::subscriber::set_default(events.clone());
    let policy = Policy::new("v")
        .tier(Tier::new("all").rules([
            Rule::new("enforced", Quota::per_minute(4)).key(Global),
            Rule::new("dark", Quota::per_minute(2)).key(Global).shadow(),
        ]))
        .default_tier("all");
    let layer = RateLimitLayer::builder().policy(policy).build().unwrap();
    let mut app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let mut statuses = Vec::new();
    for _ in 0..6 {
        let response = app
            .as_service()
            .ready()
            .await
            .unwrap()
            .call(from([9, 9, 9, 9]))
            .await
            .unwrap();
        let policy = response
            .headers()
            .get("ratelimit-policy")
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        assert!(
            !policy.contains("dark"),
            "a shadow rule adds no fields: {policy}"
        );
        statuses.push(response.status().as_u16());
    }
    // The enforced rule is charged even when the shadow rule would deny.
    assert_eq!(statuses, [200, 200, 200, 200, 429, 429]);
    // The shadow rule is charged: it would deny the third and fourth requests (the fifth and
    // sixth were denied by the enforced rule, and a denied request is charged nothing).
    let would_deny: Vec<String> = events
        .at(Level::INFO)
        .into_iter()
        .filter(|e| e.starts_with("tollgate::shadow: ") && e.contains("would deny"))
        .collect();
    assert_eq!(would_deny.len(), 2, "{would_deny:#?}");
    assert!(would_deny[0].contains("rule=\"dark\""), "{}", would_deny[0]);
}

#[tokio::test]
async fn every_checked_request_has_a_span_with_its_rules_verdict_and_retry_after() {
    let events = Events::default();
    let _guard = tracing::subscriber::set_default(events.clone());
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("per-minute", Quota::per_minute(1)))
        .build()
        .unwrap();
    let mut app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    assert_eq!(send(&mut app, from([9, 9, 9, 9])).await, StatusCode::OK);
    assert_eq!(
        send(&mut app, from([9, 9, 9, 9])).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    let spans: Vec<(String, String)> = events
        .1
        .lock()
        .unwrap()
        .iter()
        .filter(|(name, _)| name == "tollgate.check")
        .cloned()
        .collect();
    assert_eq!(spans.len(), 2, "{spans:#?}");
    assert!(
        spans[0].1.contains("rules=per-minute") && spans[0].1.contains("verdict=\"allowed\""),
        "{spans:?}"
    );
    assert!(
        spans[1].1.contains("verdict=\"denied\"") && spans[1].1.contains("retry_after_s=60"),
        "{spans:?}"
    );
    assert!(
        spans.iter().all(|(_, f)| f.contains("store_latency_us=")),
        "{spans:?}"
    );
}

#[tokio::test]
async fn the_rejection_log_writes_at_most_n_lines_a_second_and_counts_the_rest() {
    let events = Events::default();
    let _guard = tracing::subscriber::set_default(events.clone());
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("per-minute", Quota::per_minute(1)))
        .denial_log_per_second(5)
        .build()
        .unwrap();
    let mut app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let second = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    };
    let first_second = second();
    send(&mut app, from([9, 9, 9, 9])).await;
    let flood = 2_000;
    for _ in 0..flood {
        send(&mut app, from([9, 9, 9, 9])).await;
    }
    let seconds = second() - first_second + 1;
    let lines = |events: &Events| -> Vec<String> {
        events
            .at(Level::INFO)
            .into_iter()
            .filter(|e| e.starts_with("tollgate::denied: "))
            .collect()
    };
    let denials = lines(&events)
        .into_iter()
        .filter(|l| l.contains("request denied"))
        .count() as u64;
    assert!(
        denials >= 5 && denials <= 5 * seconds,
        "{denials} lines in {seconds} s"
    );
    // The next second: one line says how many were not logged.
    while second() < first_second + seconds {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    send(&mut app, from([9, 9, 9, 9])).await;
    let logged = lines(&events);
    let suppressed: u64 = logged
        .iter()
        .filter_map(|l| l.split("suppressed=").nth(1))
        .map(|n| n.split_whitespace().next().unwrap().parse::<u64>().unwrap())
        .sum();
    let denied_lines = logged
        .iter()
        .filter(|l| l.contains("request denied"))
        .count() as u64;
    // Every denial is a line or counted as suppressed.
    assert_eq!(denied_lines + suppressed, flood + 1, "{logged:#?}");
    // A digest, never the client's address.
    let line = logged
        .iter()
        .find(|l| l.contains("request denied"))
        .unwrap();
    assert!(line.contains("rules=per-minute"), "{line}");
    assert!(!line.contains("9.9.9.9"), "{line}");
    let digest = line
        .split("key=")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap();
    assert_eq!(digest.len(), 16, "{line}");
}

#[tokio::test]
async fn the_rejection_log_names_the_raw_key_only_when_asked() {
    let events = Events::default();
    let _guard = tracing::subscriber::set_default(events.clone());
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("per-minute", Quota::per_minute(1)))
        .log_raw_keys(true)
        .build()
        .unwrap();
    let mut app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    send(&mut app, from([9, 9, 9, 9])).await;
    send(&mut app, from([9, 9, 9, 9])).await;
    let logged = events.at(Level::INFO);
    assert!(
        logged
            .iter()
            .any(|l| l.starts_with("tollgate::denied: ") && l.contains("key=9.9.9.9")),
        "{logged:#?}"
    );
}

/// A Redis that cannot be reached when the service starts is said once, by the store (which
/// retries in the background), not again by the layer for each request it decides without it.
#[tokio::test]
async fn a_redis_unreachable_at_start_is_said_once() {
    let events = Events::default();
    let _guard = tracing::subscriber::set_default(events.clone());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let store = tollgate::store::RedisStore::builder(format!("redis://127.0.0.1:{port}"))
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder()
        .rule(
            Rule::new("per-minute", Quota::per_minute(100))
                .on_store_error(tollgate::FailureMode::Open),
        )
        .store(store)
        .build()
        .unwrap();
    let mut app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    for _ in 0..3 {
        assert_eq!(send(&mut app, from([9, 9, 9, 9])).await, StatusCode::OK);
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    }
    let said: Vec<String> = [Level::ERROR, Level::WARN]
        .into_iter()
        .flat_map(|level| events.at(level))
        .collect();
    assert_eq!(
        said.len(),
        1,
        "one line says Redis cannot be reached: {said:#?}"
    );
    assert!(said[0].contains("cannot reach Redis"), "{said:#?}");
}

/// A layer with tenants named by their API key (`free-bob`, of tier `free`), one request a
/// minute per tenant.
fn layer_with_api_key_tenants(log_raw_keys: bool) -> RateLimitLayer {
    use tollgate::policy::{Policy, Tenant, TenantFromHeader, Tier};
    RateLimitLayer::builder()
        .policy(
            Policy::new("v1")
                .tier(Tier::new("free").rule(Rule::new("per-minute", Quota::per_minute(1))))
                .default_tier("free"),
        )
        .tenant(TenantFromHeader::new("x-api-key").lookup(|key: &str| {
            let (tier, _) = key.split_once('-')?;
            Some(Tenant::new(key).with_tier(tier))
        }))
        .log_raw_keys(log_raw_keys)
        .build()
        .unwrap()
}

fn with_api_key(key: &str) -> Request<Body> {
    let mut request = from([9, 9, 9, 9]);
    request
        .headers_mut()
        .insert("x-api-key", key.parse().unwrap());
    request
}

#[tokio::test]
async fn the_rejection_log_names_a_tenant_by_a_digest_unless_raw_keys_are_asked_for() {
    let events = Events::default();
    let _guard = tracing::subscriber::set_default(events.clone());
    let denial = |events: &Events| {
        events
            .at(Level::INFO)
            .into_iter()
            .find(|l| l.starts_with("tollgate::denied: ") && l.contains("request denied"))
            .expect("a denial line")
    };
    let mut app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer_with_api_key_tenants(false));
    assert_eq!(
        send(&mut app, with_api_key("free-bob")).await,
        StatusCode::OK
    );
    assert_eq!(
        send(&mut app, with_api_key("free-bob")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    let line = denial(&events);
    assert!(!line.contains("free-bob"), "the raw tenant id: {line}");
    let tenant = line
        .split("tenant=")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap();
    assert_eq!(
        tenant.trim_matches('"').len(),
        16,
        "a 16-digit digest: {line}"
    );

    let events = Events::default();
    let _guard = tracing::subscriber::set_default(events.clone());
    let mut app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer_with_api_key_tenants(true));
    send(&mut app, with_api_key("free-bob")).await;
    send(&mut app, with_api_key("free-bob")).await;
    let line = denial(&events);
    assert!(line.contains("tenant=\"free-bob\""), "{line}");
}

#[tokio::test]
async fn a_store_dropped_while_it_connects_says_nothing_of_redis() {
    // A service that exits on a configuration error drops its store while the first connect
    // is still out: a "cannot reach Redis" line then would send its operator the wrong way.
    let events = Events::default();
    let _guard = tracing::subscriber::set_default(events.clone());
    // A server that accepts and never answers: the connect is out until its timeout.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let held = tokio::spawn(async move {
        let mut sockets = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            sockets.push(socket);
        }
    });
    let store = tollgate::store::RedisStore::builder(format!("redis://127.0.0.1:{port}"))
        .connect_timeout(std::time::Duration::from_millis(200))
        .build()
        .unwrap();
    // The background connect is under way.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    drop(store);
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    held.abort();
    let said: Vec<String> = [Level::ERROR, Level::WARN]
        .into_iter()
        .flat_map(|level| events.at(level))
        .collect();
    assert!(said.is_empty(), "a dropped store says nothing: {said:#?}");
}

#[tokio::test]
async fn a_refused_subscription_to_the_forget_channel_is_said_with_its_reason() {
    // Redis 7 gives a new ACL user no channel (`acl-pubsub-default resetchannels`): its checks
    // work, but it cannot hear what other replicas reset or refund. That is said, with the
    // server's reason, at most once a minute, not retried in silence.
    let events = Events::default();
    let _guard = tracing::subscriber::set_default(events.clone());
    let server = support::RedisServer::start();
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("default")
        .arg("resetchannels")
        .query(&mut server.conn())
        .unwrap();
    let store = tollgate::store::RedisStore::builder(server.url())
        .connect()
        .await
        .unwrap();
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("per-minute", Quota::per_minute(100)))
        .store(store)
        .build()
        .unwrap();
    let mut app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    assert_eq!(send(&mut app, from([9, 9, 9, 9])).await, StatusCode::OK);
    // The listener tries again after 0.1, 0.2, 0.4 and 0.8 s.
    tokio::time::sleep(std::time::Duration::from_millis(1_700)).await;
    let said: Vec<String> = events
        .at(Level::WARN)
        .into_iter()
        .filter(|line| line.contains("listen"))
        .collect();
    assert_eq!(said.len(), 1, "said once: {said:#?}");
    assert!(
        said[0].to_lowercase().contains("noperm"),
        "with the reason: {said:#?}"
    );
    assert!(said[0].contains("deny_cache_max_age"), "{said:#?}");
}

#[test]
fn a_metered_chunk_past_the_fallback_share_is_warned_of_in_rules_and_in_a_policy() {
    use tollgate::FailureMode;
    use tollgate::policy::{Policy, Tier};

    // 1,000 a minute over the 8 replicas assumed before a count: a share of 125, and a chunk
    // of 500 is past it.
    let metered = || {
        Rule::new("tokens", Quota::per_minute(1_000))
            .meter(500)
            .on_store_error(FailureMode::Local)
    };
    let warned = |build: &dyn Fn()| {
        let events = Events::default();
        let _guard = tracing::subscriber::set_default(events.clone());
        build();
        events
            .at(Level::WARN)
            .into_iter()
            .filter(|line| line.contains("metered chunk"))
            .count()
    };
    let from_rules = warned(&|| {
        RateLimitLayer::builder().rule(metered()).build().unwrap();
    });
    assert_eq!(from_rules, 1, "a builder's rule");
    let from_policy = warned(&|| {
        let policy = Policy::new("v1")
            .tier(Tier::new("base").rule(metered()))
            .default_tier("base");
        RateLimitLayer::builder().policy(policy).build().unwrap();
    });
    assert_eq!(from_policy, 1, "a policy's rule");
}
