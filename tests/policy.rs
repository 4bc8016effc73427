//! Policies: which rule set wins for a request, tenants and their tiers, shadow and delay rules,
//! allow and deny lists, regions, and rules files (their errors, and a property test that a file
//! and the same policy built in code decide alike).

mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use proptest::prelude::*;
use tollgate::clock::{Clock, ManualClock};
use tollgate::key::Global;
use tollgate::policy::{
    Listed, Policy, Region, Tenant, TenantFromExtension, TenantFromHeader, TenantRules, Tier,
};
use tollgate::store::{MemoryStore, RedisClusterStore, RedisStore, Store};
use tollgate::{Algorithm, Quota, RateLimitLayer, Rule, RuleMode};
use tower::{Service, ServiceExt};

fn manual_store() -> (ManualClock, MemoryStore) {
    let clock = ManualClock::default();
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    (clock, store)
}

fn request(method: &str, path: &str, ip: [u8; 4], api_key: Option<&str>) -> Request<Body> {
    let mut builder = Request::builder().method(method).uri(path);
    if let Some(key) = api_key {
        builder = builder.header("x-api-key", key);
    }
    let mut req = builder.body(Body::empty()).unwrap();
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::from((ip, 50_000))));
    req
}

async fn send(app: &mut Router, req: Request<Body>) -> Response<Body> {
    app.as_service()
        .ready()
        .await
        .unwrap()
        .call(req)
        .await
        .unwrap()
}

fn header<'a>(res: &'a Response<Body>, name: &str) -> Option<&'a str> {
    res.headers().get(name).map(|v| v.to_str().unwrap())
}

/// The name of the one rule whose budget an answer reports: `"name";q=..` → `name`.
fn policy_name(res: &Response<Body>) -> String {
    let policy = header(res, "ratelimit-policy").expect("a RateLimit-Policy field");
    policy.split('"').nth(1).unwrap().to_owned()
}

/// API keys `<tier>-…` and `acme-…`, as the tiers example reads them.
fn tenant_of(key: &str) -> Option<Tenant> {
    let (prefix, _) = key.split_once('-')?;
    match prefix {
        "acme" => Some(Tenant::new("acme")),
        tier => Some(Tenant::new(key).with_tier(tier)),
    }
}

fn app(layer: RateLimitLayer) -> Router {
    let ok = || async { "ok" };
    Router::new()
        .route("/", get(ok))
        .route("/search", get(ok).post(ok))
        .route("/users/{id}", get(ok))
        .layer(layer)
}

/// One rule per level, each with its own name, so that answers tell which level won.
fn levels() -> Policy {
    let rule = |name: &str| Rule::new(name, Quota::per_minute(100));
    Policy::new("levels")
        .tier(
            Tier::new("free")
                .rule(rule("free-default"))
                .route("/search", [rule("free-search")]),
        )
        .tier(
            Tier::new("pro")
                .rule(rule("pro-default"))
                .route("/search", [rule("pro-search")])
                .route("POST /search", [rule("pro-search-post")])
                .route("/users/{id}", [rule("pro-users")]),
        )
        // A tier with no rules of its own: its tenants fall through to the default tier.
        .tier(Tier::new("bare").route("/users/{id}", [rule("bare-users")]))
        .default_tier("free")
        .tenant(
            TenantRules::new("acme")
                .tier("pro")
                .route("/search", [rule("acme-search")]),
        )
}

#[tokio::test]
async fn the_most_specific_rule_set_wins() {
    let layer = RateLimitLayer::builder()
        .policy(levels())
        .tenant(TenantFromHeader::new("x-api-key").lookup(tenant_of))
        .build()
        .unwrap();
    let mut app = app(layer);
    let cases = [
        // The tenant's exception for the route.
        ("GET", "/search", Some("acme-1"), "acme-search"),
        // The tenant's tier, for a route the tenant has no exception for.
        ("GET", "/users/7", Some("acme-1"), "pro-users"),
        // The tenant's tier's own rules.
        ("GET", "/", Some("acme-1"), "pro-default"),
        // A tier's rules for a route and method win over the route alone.
        ("POST", "/search", Some("pro-1"), "pro-search-post"),
        ("GET", "/search", Some("pro-1"), "pro-search"),
        ("GET", "/users/1", Some("pro-1"), "pro-users"),
        ("GET", "/", Some("pro-1"), "pro-default"),
        // A tier without rules of its own: its route rules, then the default tier.
        ("GET", "/users/1", Some("bare-1"), "bare-users"),
        ("GET", "/search", Some("bare-1"), "free-search"),
        ("GET", "/", Some("bare-1"), "free-default"),
        // No tenant, and a tenant whose tier the policy does not have: the default tier.
        ("GET", "/search", None, "free-search"),
        ("GET", "/", None, "free-default"),
        ("GET", "/", Some("platinum-1"), "free-default"),
        ("GET", "/search", Some("platinum-1"), "free-search"),
    ];
    for (method, path, key, expected) in cases {
        let res = send(&mut app, request(method, path, [10, 0, 0, 1], key)).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(
            policy_name(&res),
            expected,
            "{method} {path} with key {key:?}"
        );
    }
}

#[tokio::test]
async fn each_tenant_has_its_own_budget_and_no_tenant_is_counted_by_ip() {
    let policy = Policy::new("v1")
        .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(2))))
        .default_tier("free");
    let layer = RateLimitLayer::builder()
        .policy(policy)
        .tenant(TenantFromHeader::new("x-api-key").lookup(tenant_of))
        .build()
        .unwrap();
    let mut app = app(layer);
    let status = |res: Response<Body>| res.status();
    for _ in 0..2 {
        assert_eq!(
            status(send(&mut app, request("GET", "/", [10, 0, 0, 1], Some("free-a"))).await),
            200
        );
    }
    assert_eq!(
        status(send(&mut app, request("GET", "/", [10, 0, 0, 1], Some("free-a"))).await),
        429
    );
    // Another tenant from the same IP, and the same IP without a tenant: budgets of their own.
    assert_eq!(
        status(send(&mut app, request("GET", "/", [10, 0, 0, 1], Some("free-b"))).await),
        200
    );
    for _ in 0..2 {
        assert_eq!(
            status(send(&mut app, request("GET", "/", [10, 0, 0, 1], None)).await),
            200
        );
    }
    assert_eq!(
        status(send(&mut app, request("GET", "/", [10, 0, 0, 1], None)).await),
        429
    );
    assert_eq!(
        status(send(&mut app, request("GET", "/", [10, 0, 0, 2], None)).await),
        200
    );
}

#[tokio::test]
async fn tenants_from_an_extension_and_from_an_async_lookup_reach_the_handler() {
    let policy = Policy::new("v1")
        .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(1))))
        .tier(Tier::new("pro").rule(Rule::new("pro", Quota::per_minute(100))))
        .default_tier("free");
    let handler = || {
        async |tenant: Option<axum::Extension<Tenant>>| {
            tenant.map_or("none".to_owned(), |t| t.id().to_owned())
        }
    };
    // From an extension an authentication layer inserted.
    let layer = RateLimitLayer::builder()
        .policy(policy.clone())
        .tenant(TenantFromExtension)
        .build()
        .unwrap();
    let mut app = Router::new().route("/", get(handler())).layer(layer);
    let mut req = request("GET", "/", [10, 0, 0, 1], None);
    req.extensions_mut()
        .insert(Tenant::new("t1").with_tier("pro"));
    let res = send(&mut app, req).await;
    assert_eq!(policy_name(&res), "pro");
    assert_eq!(
        &res.into_body().collect().await.unwrap().to_bytes()[..],
        b"t1"
    );

    // From a header looked up asynchronously.
    let lookups = Arc::new(Mutex::new(Vec::new()));
    let seen = lookups.clone();
    let layer = RateLimitLayer::builder()
        .policy(policy)
        .tenant(
            TenantFromHeader::new("x-api-key").lookup_async(move |key: String| {
                let seen = seen.clone();
                async move {
                    tokio::task::yield_now().await;
                    seen.lock().unwrap().push(key.clone());
                    (key == "secret").then(|| Tenant::new("acme").with_tier("pro"))
                }
            }),
        )
        .build()
        .unwrap();
    let mut app = Router::new().route("/", get(handler())).layer(layer);
    let res = send(&mut app, request("GET", "/", [10, 0, 0, 1], Some("secret"))).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(policy_name(&res), "pro");
    assert_eq!(
        &res.into_body().collect().await.unwrap().to_bytes()[..],
        b"acme"
    );
    // An unknown key: no tenant, the default tier (1 per minute), by IP.
    let res = send(&mut app, request("GET", "/", [10, 0, 0, 1], Some("guess"))).await;
    assert_eq!(policy_name(&res), "free");
    assert_eq!(
        &res.into_body().collect().await.unwrap().to_bytes()[..],
        b"none"
    );
    let res = send(&mut app, request("GET", "/", [10, 0, 0, 1], Some("guess2"))).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(*lookups.lock().unwrap(), ["secret", "guess", "guess2"]);
}

#[test]
fn a_policy_that_could_leave_requests_unlimited_does_not_build() {
    let free = || Tier::new("free").rule(Rule::new("free", Quota::per_minute(5)));
    let build = |policy: Policy| {
        RateLimitLayer::builder()
            .policy(policy)
            .build()
            .unwrap_err()
            .to_string()
    };
    assert!(build(Policy::new("v").tier(free())).contains("no default tier"));
    assert!(
        build(Policy::new("v").tier(free()).default_tier("gold"))
            .contains("\"gold\" is not a tier")
    );
    let bare = Tier::new("free").route("/a", [Rule::new("a", Quota::per_minute(5))]);
    assert!(
        build(Policy::new("v").tier(bare).default_tier("free")).contains("no rules of its own")
    );
    let unknown_tier = Policy::new("v")
        .tier(free())
        .default_tier("free")
        .tenant(TenantRules::new("acme").tier("gold"));
    assert!(build(unknown_tier).contains("tenant \"acme\" has the tier \"gold\""));
    let two_quotas = Policy::new("v")
        .tier(free())
        .tier(Tier::new("pro").rule(Rule::new("free", Quota::per_minute(50))))
        .default_tier("free");
    assert!(build(two_quotas).contains("defined twice with different settings"));
    let bad_route = Policy::new("v")
        .tier(free().route("search", [Rule::new("s", Quota::per_minute(1))]))
        .default_tier("free");
    assert!(build(bad_route).contains("is not a route"));
    let rules_and_policy = RateLimitLayer::builder()
        .rule(Rule::new("r", Quota::per_minute(1)))
        .policy(Policy::new("v").tier(free()).default_tier("free"))
        .build()
        .unwrap_err()
        .to_string();
    assert!(rules_and_policy.contains("both rules and a policy"));
}

#[test]
fn a_policy_of_more_than_65535_routes_does_not_build() {
    let routes = |n: usize| {
        (0..n).fold(
            Tier::new("free").rule(Rule::new("free", Quota::per_minute(5))),
            |tier, i| tier.route(format!("/r{i}"), [Rule::new("r", Quota::per_minute(1))]),
        )
    };
    let build = |n| {
        RateLimitLayer::builder()
            .policy(Policy::new("v").tier(routes(n)).default_tier("free"))
            .build()
    };
    assert!(build(65_535).is_ok());
    let error = build(65_536).unwrap_err().to_string();
    assert!(
        error.contains("65536 routes; it may name at most 65535"),
        "{error}"
    );
}

#[test]
fn one_rule_in_several_places_is_one_budget() {
    let shared = Rule::new("daily", Quota::per_day(1000));
    let policy = Policy::new("v")
        .tier(Tier::new("free").rules([Rule::new("free", Quota::per_minute(5)), shared.clone()]))
        .tier(Tier::new("pro").rules([Rule::new("pro", Quota::per_minute(50)), shared]))
        .default_tier("free");
    RateLimitLayer::builder().policy(policy).build().unwrap();
}

#[tokio::test]
async fn a_tier_of_shadow_rules_only_admits_everything() {
    let policy = Policy::new("v")
        .tier(Tier::new("all").rule(Rule::new("dark", Quota::per_minute(1)).key(Global).shadow()))
        .default_tier("all");
    let layer = RateLimitLayer::builder().policy(policy).build().unwrap();
    let mut app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    for _ in 0..3 {
        let res = send(&mut app, request("GET", "/", [10, 0, 0, 1], None)).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert!(header(&res, "ratelimit").is_none());
    }
}

#[tokio::test]
async fn allow_and_deny_lists() {
    let policy = Policy::new("v")
        .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(1))))
        .default_tier("free")
        .allow("10.1.0.0/16".parse::<Listed>().unwrap())
        .allow("tenant:partner".parse().unwrap())
        .deny("192.0.2.0/24".parse().unwrap())
        .deny("10.1.2.3".parse().unwrap())
        .deny("tenant:abuser".parse().unwrap());
    let layer = RateLimitLayer::builder()
        .policy(policy)
        .tenant(TenantFromHeader::new("x-api-key").lookup(|k: &str| Some(Tenant::new(k))))
        .build()
        .unwrap();
    let mut app = app(layer);
    // Allowed networks and tenants are never limited and carry no budget.
    for _ in 0..3 {
        let res = send(&mut app, request("GET", "/", [10, 1, 9, 9], None)).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert!(header(&res, "ratelimit").is_none());
        let res = send(
            &mut app,
            request("GET", "/", [10, 2, 0, 1], Some("partner")),
        )
        .await;
        assert_eq!(res.status(), StatusCode::OK);
    }
    // Denied networks, addresses (even inside an allowed network) and tenants get 403.
    for (ip, key) in [
        ([192, 0, 2, 1], None),
        ([10, 1, 2, 3], None),
        ([10, 3, 0, 1], Some("abuser")),
    ] {
        let res = send(&mut app, request("GET", "/", ip, key)).await;
        assert_eq!(res.status(), StatusCode::FORBIDDEN, "{ip:?} {key:?}");
        assert_eq!(
            header(&res, "content-type"),
            Some("application/problem+json")
        );
        let body: serde_json::Value =
            serde_json::from_slice(&res.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!(body["status"], 403);
    }
    // Everyone else is limited.
    assert_eq!(
        send(&mut app, request("GET", "/", [10, 3, 0, 2], None))
            .await
            .status(),
        200
    );
    assert_eq!(
        send(&mut app, request("GET", "/", [10, 3, 0, 2], None))
            .await
            .status(),
        429
    );
}

#[tokio::test]
async fn key_entries_match_the_layers_text_key() {
    use tollgate::key::FromHeader;

    let policy = Policy::new("v")
        .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(1))))
        .default_tier("free")
        .allow("key:internal-job".parse().unwrap())
        .deny("key:scraper-7".parse().unwrap());
    // The layer's key is a header: list entries name its values.
    let layer = RateLimitLayer::builder()
        .policy(policy)
        .key(FromHeader::new("x-client"))
        .build()
        .unwrap();
    let mut app = app(layer);
    let with_client = |client: &str| {
        let mut req = request("GET", "/", [10, 0, 0, 1], None);
        req.headers_mut()
            .insert("x-client", client.parse().unwrap());
        req
    };
    for _ in 0..3 {
        let res = send(&mut app, with_client("internal-job")).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert!(
            header(&res, "ratelimit").is_none(),
            "an allowed key carries no budget"
        );
    }
    assert_eq!(
        send(&mut app, with_client("scraper-7")).await.status(),
        StatusCode::FORBIDDEN
    );
    // A key that only resembles a listed one is limited as usual.
    assert_eq!(
        send(&mut app, with_client("scraper-70")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&mut app, with_client("scraper-70")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// A source of policies pushed by a test, as a configuration service would be.
struct Pushed(Arc<Mutex<Vec<Result<Policy, String>>>>);

impl tollgate::policy::PolicySource for Pushed {
    fn load(&mut self) -> Result<Policy, Box<dyn std::error::Error + Send + Sync>> {
        Ok(one_rule("first", 1))
    }

    fn poll(&mut self) -> Result<Option<Policy>, Box<dyn std::error::Error + Send + Sync>> {
        match self.0.lock().unwrap().pop() {
            None => Ok(None),
            Some(Ok(policy)) => Ok(Some(policy)),
            Some(Err(error)) => Err(error.into()),
        }
    }

    fn interval(&self) -> Option<Duration> {
        Some(Duration::from_millis(10))
    }
}

fn one_rule(version: &str, limit: u64) -> Policy {
    Policy::new(version)
        .tier(Tier::new("free").rule(Rule::new("api", Quota::per_minute(limit))))
        .default_tier("free")
}

#[tokio::test]
async fn a_source_of_your_own_feeds_the_layer_and_its_errors_keep_the_policy() {
    let queue = Arc::new(Mutex::new(Vec::new()));
    let layer = RateLimitLayer::builder()
        .policy_source(Pushed(queue.clone()))
        .build()
        .unwrap();
    let handle = layer.policy_handle().unwrap();
    let mut app = app(layer);
    assert_eq!(handle.version(), "first");
    let wait_for = |handle: &tollgate::policy::PolicyHandle,
                    done: &dyn Fn(&tollgate::policy::PolicyHandle) -> bool| {
        let start = std::time::Instant::now();
        while !done(handle) {
            assert!(start.elapsed() < Duration::from_secs(5), "{handle:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    queue.lock().unwrap().push(Ok(one_rule("second", 3)));
    wait_for(&handle, &|h| h.version() == "second");
    let res = send(&mut app, request("GET", "/", [10, 0, 0, 1], None)).await;
    assert_eq!(header(&res, "ratelimit-policy"), Some("\"api\";q=3;w=60"));
    // The service is down: an error, the policy in force stays.
    queue
        .lock()
        .unwrap()
        .push(Err("configuration service unreachable".into()));
    wait_for(&handle, &|h| h.rejected() == 1);
    assert_eq!(handle.version(), "second");
    // A policy that does not build: refused too.
    queue.lock().unwrap().push(Ok(Policy::new("no-default")
        .tier(Tier::new("free").rule(Rule::new("api", Quota::per_minute(9))))));
    wait_for(&handle, &|h| h.rejected() == 2);
    assert_eq!(handle.version(), "second");
    queue.lock().unwrap().push(Ok(one_rule("third", 4)));
    wait_for(&handle, &|h| h.version() == "third");
    assert_eq!(handle.installed(), 2);
}

#[tokio::test]
async fn a_region_enforces_its_share_of_each_quota() {
    let policy = Policy::new("v")
        .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(10).burst(4))))
        .default_tier("free")
        .region(Region::new("eu-west", 0.5));
    let layer = RateLimitLayer::builder().policy(policy).build().unwrap();
    let mut app = app(layer);
    let res = send(&mut app, request("GET", "/", [10, 0, 0, 1], None)).await;
    // Half of 10 per minute with a burst of 4: 5 per minute, a burst of 2 (refilled in 24 s).
    assert_eq!(header(&res, "ratelimit-policy"), Some("\"free\";q=2;w=24"));
    // Its share is enforced: a burst of 2 in this region.
    let statuses: Vec<u16> = {
        let mut all = Vec::new();
        for _ in 0..2 {
            all.push(
                send(&mut app, request("GET", "/", [10, 0, 0, 1], None))
                    .await
                    .status()
                    .as_u16(),
            );
        }
        all
    };
    assert_eq!(statuses, [200, 429]);
    // Two regions, each with its own store and a share of 0.5: the fleet admits the global
    // burst of 4, and a client that reaches one region only gets that region's 2.
    let regional = |name: &str| {
        let policy = Policy::new("v")
            .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(10).burst(4))))
            .default_tier("free")
            .region(Region::new(name, 0.5));
        crate::app(
            RateLimitLayer::builder()
                .policy(policy)
                .store(MemoryStore::new())
                .build()
                .unwrap(),
        )
    };
    let (mut eu, mut us) = (regional("eu"), regional("us"));
    let mut admitted = 0;
    for _ in 0..5 {
        for region in [&mut eu, &mut us] {
            if send(region, request("GET", "/", [10, 0, 0, 2], None))
                .await
                .status()
                == StatusCode::OK
            {
                admitted += 1;
            }
        }
    }
    assert_eq!(admitted, 4, "the fleet admits the global burst");
    let mut only_eu = regional("eu");
    let mut admitted = 0;
    for _ in 0..5 {
        if send(&mut only_eu, request("GET", "/", [10, 0, 0, 3], None))
            .await
            .status()
            == StatusCode::OK
        {
            admitted += 1;
        }
    }
    assert_eq!(
        admitted, 2,
        "a client that reaches one region gets its share"
    );
    let bad = Policy::new("v")
        .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(10))))
        .default_tier("free")
        .region(Region::new("eu", 1.5));
    let error = RateLimitLayer::builder()
        .policy(bad)
        .build()
        .unwrap_err()
        .to_string();
    assert!(error.contains("greater than 0 and at most 1"), "{error}");
}

/// A clock that follows tokio's (paused) time, so that a delay rule's wait and the store agree.
#[derive(Clone)]
struct TokioClock(tokio::time::Instant);

impl Clock for TokioClock {
    fn now_micros(&self) -> u64 {
        1_000_000_000 + self.0.elapsed().as_micros() as u64
    }
}

fn delay_app(quota: Quota, max: Duration, max_waiting: usize) -> Router {
    let store = MemoryStore::builder()
        .clock(TokioClock(tokio::time::Instant::now()))
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("smooth", quota).key(Global).delay(max))
        .store(store)
        .max_waiting(max_waiting)
        .build()
        .unwrap();
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
}

#[tokio::test(start_paused = true)]
async fn a_delayed_request_is_admitted_when_the_model_says() {
    assert_eq!(
        Rule::new("x", Quota::per_second(1))
            .delay(Duration::from_secs(2))
            .mode(),
        RuleMode::Delay {
            max: Duration::from_secs(2)
        }
    );
    // One per second, no burst: requests sent together go through one second apart.
    let app = delay_app(Quota::per_second(1), Duration::from_secs(3), 16);
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    for i in 0..3u64 {
        let mut app = app.clone();
        tasks.push(tokio::spawn(async move {
            // Sent in order, 1 ms apart.
            tokio::time::sleep(Duration::from_millis(i)).await;
            let res = send(&mut app, request("GET", "/", [10, 0, 0, 1], None)).await;
            (res.status(), start.elapsed())
        }));
    }
    let mut done = Vec::new();
    for task in tasks {
        done.push(task.await.unwrap());
    }
    // The model: the first unit at once, the second at 1 s, the third at 2 s (the two waiting
    // requests wake together at 1 s: either may take the second unit).
    done.sort_by_key(|(_, at)| *at);
    let second = |s: u64| (StatusCode::OK, Duration::from_secs(s));
    assert_eq!(done, [second(0), second(1), second(2)]);
}

#[tokio::test(start_paused = true)]
async fn a_request_that_would_wait_past_the_maximum_is_denied_at_once() {
    // One per 5 seconds, at most 2 s of waiting.
    let mut app = delay_app(
        Quota::new(1, Duration::from_secs(5)),
        Duration::from_secs(2),
        16,
    );
    let start = tokio::time::Instant::now();
    assert_eq!(
        send(&mut app, request("GET", "/", [10, 0, 0, 1], None))
            .await
            .status(),
        200
    );
    let res = send(&mut app, request("GET", "/", [10, 0, 0, 1], None)).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(header(&res, "retry-after"), Some("5"));
}

#[tokio::test(start_paused = true)]
async fn waiting_requests_are_bounded_and_a_cancelled_one_gives_its_place_back() {
    let app = delay_app(Quota::per_second(1), Duration::from_secs(10), 1);
    let mut first = app.clone();
    assert_eq!(
        send(&mut first, request("GET", "/", [10, 0, 0, 1], None))
            .await
            .status(),
        200
    );
    // The one place is taken by a request that waits...
    let mut waiting = app.clone();
    let waiter = tokio::spawn(async move {
        send(&mut waiting, request("GET", "/", [10, 0, 0, 1], None))
            .await
            .status()
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    // ...so the next is denied at once.
    let start = tokio::time::Instant::now();
    let mut third = app.clone();
    assert_eq!(
        send(&mut third, request("GET", "/", [10, 0, 0, 1], None))
            .await
            .status(),
        429
    );
    assert_eq!(start.elapsed(), Duration::ZERO);
    // Cancelling the waiting request frees its place.
    waiter.abort();
    let _ = waiter.await;
    let mut fourth = app.clone();
    let start = tokio::time::Instant::now();
    assert_eq!(
        send(&mut fourth, request("GET", "/", [10, 0, 0, 1], None))
            .await
            .status(),
        200
    );
    assert!(start.elapsed() > Duration::ZERO, "it waited for its unit");
}

#[test]
fn rules_file_errors_name_the_file_line_and_column() {
    let error = |text: &str| {
        Policy::from_toml(text, "tiers.toml")
            .unwrap_err()
            .to_string()
    };
    let build = |text: &str| {
        let policy = Policy::from_toml(text, "tiers.toml").unwrap();
        RateLimitLayer::builder()
            .policy(policy)
            .build()
            .unwrap_err()
            .to_string()
    };
    let syntax = error("version = \"1\"\ndefault_tier = \n");
    assert!(
        syntax.starts_with("tollgate configuration: tiers.toml:2:"),
        "{syntax}"
    );
    let unknown = error("version = \"1\"\nversoin = \"2\"\n");
    assert!(
        unknown.contains("tiers.toml:2:1:") && unknown.contains("verso"),
        "{unknown}"
    );
    let period = error(
        "version = \"1\"\n[tiers.free]\nrules = [{ name = \"f\", limit = 5, per = \"fortnight\" }]\n",
    );
    assert!(
        period.contains("tiers.toml:3:") && period.contains("\"fortnight\" is not a period"),
        "{period}"
    );
    let mode = error(
        "version = \"1\"\n[tiers.free]\nrules = [{ name = \"f\", limit = 5, per = \"minute\", mode = \"delay\" }]\n",
    );
    assert!(mode.contains("needs max_delay"), "{mode}");
    let list = error("version = \"1\"\n[lists]\nallow = [\"10.0.0.0/33\"]\n");
    assert!(list.contains("tiers.toml:3:10:"), "{list}");
    let no_default = build(
        "version = \"1\"\n[tiers.free]\nrules = [{ name = \"f\", limit = 5, per = \"minute\" }]\n",
    );
    assert!(
        no_default.contains("tiers.toml: ") && no_default.contains("no default tier"),
        "{no_default}"
    );
    let tenant_tier = build(
        "version = \"1\"\ndefault_tier = \"free\"\n[tiers.free]\nrules = [{ name = \"f\", limit = 5, per = \"minute\" }]\n\n[tenants.acme]\ntier = \"gold\"\n",
    );
    assert!(
        tenant_tier.contains("tiers.toml:6:") && tenant_tier.contains("\"gold\""),
        "{tenant_tier}"
    );
    let burst = build(
        "version = \"1\"\ndefault_tier = \"free\"\n[tiers.free]\nrules = [\n  { name = \"f\", limit = 5, per = \"minute\", burst = 2, algorithm = \"fixed-window\" },\n]\n",
    );
    assert!(
        burst.contains("tiers.toml:5:3:") && burst.contains("has no burst"),
        "{burst}"
    );
}

#[test]
fn the_example_rules_file_builds() {
    let policy =
        Policy::from_file(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/tiers.toml")).unwrap();
    RateLimitLayer::builder().policy(policy).build().unwrap();
}

/// A generated policy, to be written both as a rules file and in code.
#[derive(Clone, Debug)]
struct GenRule {
    limit: u64,
    per_minute: bool,
    algorithm: usize,
    burst: Option<u64>,
    key: usize,
    shadow: bool,
}

#[derive(Clone, Debug)]
struct GenTier {
    rules: Vec<GenRule>,
    search: Option<Vec<GenRule>>,
    post_search: Option<Vec<GenRule>>,
}

#[derive(Clone, Debug)]
struct GenTenant {
    tier: Option<usize>,
    search: Option<Vec<GenRule>>,
}

#[derive(Clone, Debug)]
struct GenPolicy {
    tiers: Vec<GenTier>,
    tenants: Vec<GenTenant>,
    /// The rules of every tier: their own, for `/search`, for `POST /search`.
    all: GenTier,
}

const ALGORITHMS: [(&str, Algorithm); 5] = [
    ("token-bucket", Algorithm::TokenBucket),
    ("gcra", Algorithm::Gcra),
    ("fixed-window", Algorithm::FixedWindow),
    ("sliding-window-log", Algorithm::SlidingWindowLog),
    ("sliding-window-counter", Algorithm::SlidingWindowCounter),
];
const KEYS: [&str; 5] = ["", "ip", "global", "tenant", "route"];
const TENANTS: [&str; 2] = ["acme", "zen"];

fn gen_rule() -> impl Strategy<Value = GenRule> {
    (
        1u64..5,
        any::<bool>(),
        0usize..5,
        0u64..4,
        0usize..5,
        prop::bool::weighted(0.2),
    )
        .prop_map(
            |(limit, per_minute, algorithm, burst, key, shadow)| GenRule {
                limit,
                per_minute,
                algorithm,
                // Only token bucket and GCRA have a burst.
                burst: (algorithm < 2 && burst > 0).then_some(burst),
                key,
                shadow,
            },
        )
}

fn gen_rules() -> impl Strategy<Value = Vec<GenRule>> {
    prop::collection::vec(gen_rule(), 1..3)
}

fn gen_policy() -> impl Strategy<Value = GenPolicy> {
    let tier = (
        prop::option::of(gen_rules()),
        prop::option::of(gen_rules()),
        prop::option::of(gen_rules()),
    );
    (
        gen_rules(),
        prop::collection::vec(tier, 0..3),
        prop::collection::vec(
            (prop::option::of(0usize..3), prop::option::of(gen_rules())),
            0..=2,
        ),
        (
            prop::option::of(gen_rules()),
            prop::option::of(gen_rules()),
            prop::option::of(gen_rules()),
        ),
    )
        .prop_map(|(default_rules, others, tenants, all)| {
            let mut tiers = vec![GenTier {
                rules: default_rules,
                search: None,
                post_search: None,
            }];
            for (rules, search, post_search) in others {
                tiers.push(GenTier {
                    rules: rules.unwrap_or_default(),
                    search,
                    post_search,
                });
            }
            let n = tiers.len();
            let tenants = tenants
                .into_iter()
                .map(|(tier, search)| GenTenant {
                    tier: tier.map(|t| t % n),
                    search,
                })
                .collect();
            GenPolicy {
                tiers,
                tenants,
                all: GenTier {
                    rules: all.0.unwrap_or_default(),
                    search: all.1,
                    post_search: all.2,
                },
            }
        })
        .prop_filter("some rule set", |p| !p.tiers.is_empty())
}

impl GenPolicy {
    /// Every rule set, in a fixed order, each rule named by its position.
    fn sets(&self) -> Vec<(String, &Vec<GenRule>)> {
        let mut sets = Vec::new();
        for (t, tier) in self.tiers.iter().enumerate() {
            if !tier.rules.is_empty() {
                sets.push((format!("t{t}"), &tier.rules));
            }
            if let Some(rules) = &tier.search {
                sets.push((format!("t{t}-search"), rules));
            }
            if let Some(rules) = &tier.post_search {
                sets.push((format!("t{t}-post-search"), rules));
            }
        }
        for (n, tenant) in self.tenants.iter().enumerate() {
            if let Some(rules) = &tenant.search {
                sets.push((format!("{}-search", TENANTS[n]), rules));
            }
        }
        if !self.all.rules.is_empty() {
            sets.push(("all".to_owned(), &self.all.rules));
        }
        sets
    }

    fn toml(&self) -> String {
        let rule = |set: &str, i: usize, r: &GenRule| {
            let mut line = format!(
                "{{ name = \"{set}-{i}\", limit = {}, per = \"{}\", algorithm = \"{}\"",
                r.limit,
                if r.per_minute { "minute" } else { "second" },
                ALGORITHMS[r.algorithm].0
            );
            if let Some(burst) = r.burst {
                line += &format!(", burst = {burst}");
            }
            if !KEYS[r.key].is_empty() {
                line += &format!(", key = \"{}\"", KEYS[r.key]);
            }
            if r.shadow {
                line += ", mode = \"shadow\"";
            }
            line + " }"
        };
        let rules = |set: &str, rules: &[GenRule]| {
            let items: Vec<String> = rules
                .iter()
                .enumerate()
                .map(|(i, r)| rule(set, i, r))
                .collect();
            format!("rules = [{}]\n", items.join(", "))
        };
        let mut text = String::from("version = \"generated\"\ndefault_tier = \"t0\"\n");
        for (t, tier) in self.tiers.iter().enumerate() {
            text += &format!("\n[tiers.t{t}]\n");
            if !tier.rules.is_empty() {
                text += &rules(&format!("t{t}"), &tier.rules);
            }
            if let Some(r) = &tier.search {
                text += &format!("[tiers.t{t}.routes.\"/search\"]\n");
                text += &rules(&format!("t{t}-search"), r);
            }
            if let Some(r) = &tier.post_search {
                text += &format!("[tiers.t{t}.routes.\"POST /search\"]\n");
                text += &rules(&format!("t{t}-post-search"), r);
            }
        }
        for (n, tenant) in self.tenants.iter().enumerate() {
            text += &format!("\n[tenants.{}]\n", TENANTS[n]);
            if let Some(tier) = tenant.tier {
                text += &format!("tier = \"t{tier}\"\n");
            }
            if let Some(r) = &tenant.search {
                text += &format!("[tenants.{}.routes.\"/search\"]\n", TENANTS[n]);
                text += &rules(&format!("{}-search", TENANTS[n]), r);
            }
        }
        text += "\n[all_tiers]\n";
        if !self.all.rules.is_empty() {
            text += &rules("all", &self.all.rules);
        }
        if let Some(r) = &self.all.search {
            text += "[all_tiers.routes.\"/search\"]\n";
            text += &rules("all-search", r);
        }
        if let Some(r) = &self.all.post_search {
            text += "[all_tiers.routes.\"POST /search\"]\n";
            text += &rules("all-post-search", r);
        }
        text
    }

    fn code(&self) -> Policy {
        let rules = |set: &str, rules: &[GenRule]| -> Vec<Rule> {
            rules
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    let period = if r.per_minute { 60 } else { 1 };
                    let mut quota = Quota::new(r.limit, Duration::from_secs(period));
                    if let Some(burst) = r.burst {
                        quota = quota.burst(burst);
                    }
                    let mut rule =
                        Rule::new(format!("{set}-{i}"), quota).algorithm(ALGORITHMS[r.algorithm].1);
                    rule = match KEYS[r.key] {
                        "ip" => rule.key(tollgate::key::PeerIp::new()),
                        "global" => rule.key(Global),
                        "tenant" => rule.key(tollgate::policy::TenantKey),
                        "route" => rule.key(tollgate::key::Route::new()),
                        _ => rule,
                    };
                    if r.shadow {
                        rule = rule.shadow();
                    }
                    rule
                })
                .collect()
        };
        let mut policy = Policy::new("generated").default_tier("t0");
        for (t, tier) in self.tiers.iter().enumerate() {
            let mut built = Tier::new(format!("t{t}")).rules(rules(&format!("t{t}"), &tier.rules));
            if let Some(r) = &tier.search {
                built = built.route("/search", rules(&format!("t{t}-search"), r));
            }
            if let Some(r) = &tier.post_search {
                built = built.route("POST /search", rules(&format!("t{t}-post-search"), r));
            }
            policy = policy.tier(built);
        }
        for (n, tenant) in self.tenants.iter().enumerate() {
            let mut built = TenantRules::new(TENANTS[n]);
            if let Some(tier) = tenant.tier {
                built = built.tier(format!("t{tier}"));
            }
            if let Some(r) = &tenant.search {
                built = built.route("/search", rules(&format!("{}-search", TENANTS[n]), r));
            }
            policy = policy.tenant(built);
        }
        if !self.all.rules.is_empty() {
            policy = policy.all_tiers(rules("all", &self.all.rules));
        }
        if let Some(r) = &self.all.search {
            policy = policy.all_tiers_route("/search", rules("all-search", r));
        }
        if let Some(r) = &self.all.post_search {
            policy = policy.all_tiers_route("POST /search", rules("all-post-search", r));
        }
        policy
    }
}

/// A request of the property test: who, where, and how long after the previous one.
#[derive(Clone, Debug)]
struct GenRequest {
    api_key: Option<&'static str>,
    post: bool,
    search: bool,
    ip: u8,
    after_ms: u64,
}

fn gen_request() -> impl Strategy<Value = GenRequest> {
    let keys = prop::sample::select(vec![
        None,
        Some("acme-1"),
        Some("zen-1"),
        Some("t1-x"),
        Some("t2-y"),
        Some("t9-z"),
    ]);
    (keys, any::<bool>(), any::<bool>(), 1u8..3, 0u64..700).prop_map(
        |(api_key, post, search, ip, after_ms)| GenRequest {
            api_key,
            post,
            search,
            ip,
            after_ms,
        },
    )
}

/// Every answer's status and budget fields, request by request.
async fn answers(
    policy: Policy,
    requests: &[GenRequest],
) -> Vec<(u16, Option<String>, Option<String>)> {
    let (clock, store) = manual_store();
    let layer = RateLimitLayer::builder()
        .policy(policy)
        .store(store)
        .tenant(TenantFromHeader::new("x-api-key").lookup(|key: &str| {
            let (prefix, _) = key.split_once('-')?;
            Some(match prefix {
                "acme" | "zen" => Tenant::new(prefix),
                tier => Tenant::new(key).with_tier(tier),
            })
        }))
        .build()
        .unwrap();
    let mut app = app(layer);
    let mut seen = Vec::new();
    for r in requests {
        clock.advance(Duration::from_millis(r.after_ms));
        let path = if r.search { "/search" } else { "/" };
        let method = if r.post && r.search { "POST" } else { "GET" };
        let res = send(&mut app, request(method, path, [10, 0, 0, r.ip], r.api_key)).await;
        seen.push((
            res.status().as_u16(),
            header(&res, "ratelimit").map(str::to_owned),
            header(&res, "ratelimit-policy").map(str::to_owned),
        ));
    }
    seen
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn a_rules_file_and_the_same_policy_in_code_decide_alike(
        policy in gen_policy(),
        requests in prop::collection::vec(gen_request(), 1..40),
    ) {
        let text = policy.toml();
        let from_file = Policy::from_toml(&text, "generated.toml")
            .unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert!(!policy.sets().is_empty());
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (file, code) = runtime.block_on(async {
            (answers(from_file, &requests).await, answers(policy.code(), &requests).await)
        });
        prop_assert_eq!(file, code, "{}", text);
    }
}

#[test]
fn ipv6_list_entries_longer_than_the_key_prefix_are_refused() {
    let policy = |entry: &str| {
        Policy::new("v")
            .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(1))))
            .default_tier("free")
            .deny(entry.parse().unwrap())
    };
    let error = RateLimitLayer::builder()
        .policy(policy("2001:db8::1"))
        .build()
        .unwrap_err()
        .to_string();
    assert!(error.contains("2001:db8::/64"), "{error}");
    RateLimitLayer::builder()
        .policy(policy("2001:db8::/64"))
        .build()
        .unwrap();
    RateLimitLayer::builder()
        .policy(policy("::ffff:192.0.2.1"))
        .build()
        .unwrap();
    // A network whose clients keys hold as IPv4 ones: IPv4-mapped.
    RateLimitLayer::builder()
        .policy(policy("::ffff:10.0.0.0/104"))
        .build()
        .unwrap();
    let error = RateLimitLayer::builder()
        .policy(policy("2001:db8::/96"))
        .build()
        .unwrap_err()
        .to_string();
    assert!(error.contains("2001:db8::/64"), "{error}");
    // A client behind NAT64 is counted by its IPv4 address (if global), never by a /96: the
    // error names the IPv4 network to list.
    for (entry, v4) in [
        ("64:ff9b::93.184.216.0/120", "93.184.216.0/24"),
        ("64:ff9b::93.184.216.34", "93.184.216.34/32"),
        ("64:ff9b::/96", "0.0.0.0/0"),
    ] {
        let error = RateLimitLayer::builder()
            .policy(policy(entry))
            .build()
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("NAT64") && error.contains(v4),
            "{entry}: {error}"
        );
    }
}

#[tokio::test]
async fn ipv4_mapped_entries_match_their_ipv4_clients() {
    let policy = Policy::new("v")
        .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(1))))
        .default_tier("free")
        .deny("::ffff:192.0.2.1".parse().unwrap())
        .deny("::ffff:198.51.100.0/120".parse().unwrap());
    let mut app = app(RateLimitLayer::builder().policy(policy).build().unwrap());
    for (client, status) in [
        ([192, 0, 2, 1], StatusCode::FORBIDDEN),
        ([198, 51, 100, 77], StatusCode::FORBIDDEN),
        ([203, 0, 113, 1], StatusCode::OK),
    ] {
        let res = send(&mut app, request("GET", "/", client, None)).await;
        assert_eq!(res.status(), status, "{client:?}");
    }
}

#[tokio::test]
async fn a_head_request_gets_the_rules_of_get() {
    let policy = Policy::new("v")
        .tier(
            Tier::new("free")
                .rule(Rule::new("free", Quota::per_minute(100)))
                .route(
                    "GET /search",
                    [Rule::new("get-search", Quota::per_minute(1))],
                ),
        )
        .default_tier("free");
    let mut app = app(RateLimitLayer::builder().policy(policy).build().unwrap());
    let res = send(&mut app, request("HEAD", "/search", [10, 0, 0, 1], None)).await;
    assert_eq!(policy_name(&res), "get-search");
    let res = send(&mut app, request("GET", "/search", [10, 0, 0, 1], None)).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
}

/// A store that always fails.
struct Down;

impl tollgate::store::Store for Down {
    type Future = std::future::Ready<Result<tollgate::Decision, tollgate::store::StoreError>>;

    fn check(&self, _: &[tollgate::store::Charge<'_>]) -> Self::Future {
        std::future::ready(Err(tollgate::store::StoreError::Timeout))
    }
}

#[tokio::test]
async fn a_shadow_rule_never_refuses_when_the_store_fails() {
    use tollgate::FailureMode;
    let policy = Policy::new("v")
        .tier(
            Tier::new("all").rules([
                Rule::new("enforced", Quota::per_minute(5)).on_store_error(FailureMode::Open),
                Rule::new("dark", Quota::per_minute(1))
                    .on_store_error(FailureMode::Closed)
                    .shadow(),
                Rule::new("dark-local", Quota::per_minute(1))
                    .on_store_error(FailureMode::Local)
                    .shadow(),
            ]),
        )
        .default_tier("all");
    let layer = RateLimitLayer::builder()
        .policy(policy)
        .store(Down)
        .build()
        .unwrap();
    let mut app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    for _ in 0..3 {
        let res = send(&mut app, request("GET", "/", [10, 0, 0, 1], None)).await;
        assert_eq!(res.status(), StatusCode::OK);
    }
}

#[tokio::test(start_paused = true)]
async fn a_slow_tenant_lookup_times_out_into_the_default_tier() {
    let policy = Policy::new("v")
        .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(5))))
        .tier(Tier::new("pro").rule(Rule::new("pro", Quota::per_minute(50))))
        .default_tier("free");
    let layer = RateLimitLayer::builder()
        .policy(policy)
        .tenant(
            TenantFromHeader::new("x-api-key")
                .lookup_async(|key: String| async move {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    Some(Tenant::new(key).with_tier("pro"))
                })
                .timeout(Duration::from_millis(100)),
        )
        .build()
        .unwrap();
    let mut app = app(layer);
    let start = tokio::time::Instant::now();
    let res = send(&mut app, request("GET", "/", [10, 0, 0, 1], Some("slow"))).await;
    assert_eq!(start.elapsed(), Duration::from_millis(100));
    assert_eq!(policy_name(&res), "free");
}

#[test]
fn a_rule_defined_twice_is_shown_where_it_is_defined_again() {
    let text = "version = \"1\"\ndefault_tier = \"free\"\n[tiers.free]\n\
                rules = [{ name = \"a\", limit = 5, per = \"minute\" }]\n[tiers.pro]\n\
                rules = [{ name = \"a\", limit = 6, per = \"minute\" }]\n";
    let policy = Policy::from_toml(text, "tiers.toml").unwrap();
    let error = RateLimitLayer::builder()
        .policy(policy)
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("tiers.toml:6:10:") && error.contains("defined twice"),
        "{error}"
    );
}

#[tokio::test]
async fn a_rules_file_sets_a_concurrency_limit_per_route() {
    let text = r#"
version = "1"
default_tier = "free"

[tiers.free]
rules = [{ name = "free", limit = 100, per = "minute" }]

# 2 searches in flight per client, a slot held 30 s at most.
[tiers.free.routes."/search"]
rules = [{ name = "searches", limit = 2, per = "30s", algorithm = "concurrency" }]
"#;
    let policy = Policy::from_toml(text, "tiers.toml").unwrap();
    let app = app(RateLimitLayer::builder().policy(policy).build().unwrap());
    let ip = [198, 51, 100, 7];
    let first = app
        .clone()
        .oneshot(request("GET", "/search", ip, None))
        .await
        .unwrap();
    let second = app
        .clone()
        .oneshot(request("GET", "/search", ip, None))
        .await
        .unwrap();
    assert_eq!(
        header(&first, "ratelimit-policy"),
        Some(r#""searches";q=2;qu="concurrent-requests""#)
    );
    assert_eq!(header(&second, "ratelimit"), Some(r#""searches";r=0"#));
    let third = app
        .clone()
        .oneshot(request("GET", "/search", ip, None))
        .await
        .unwrap();
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
    // Other routes count by rate, whatever is in flight on /search.
    let other = app
        .clone()
        .oneshot(request("GET", "/", ip, None))
        .await
        .unwrap();
    assert_eq!(other.status(), StatusCode::OK);
    // A body read to its end gives its slot back.
    first.into_body().collect().await.unwrap();
    let fourth = app
        .clone()
        .oneshot(request("GET", "/search", ip, None))
        .await
        .unwrap();
    assert_eq!(fourth.status(), StatusCode::OK);
    drop(second);

    // Options a concurrency rule cannot have are refused, naming the line.
    let lease = Policy::from_toml(
        "version = \"1\"\ndefault_tier = \"free\"\n[tiers.free]\nrules = [\n  { name = \"c\", limit = 2, per = \"minute\", algorithm = \"concurrency\", lease = 2 },\n]\n",
        "tiers.toml",
    )
    .map(|policy| RateLimitLayer::builder().policy(policy).build());
    let message = match lease {
        Err(error) | Ok(Err(error)) => error.to_string(),
        Ok(Ok(_)) => panic!("a leased concurrency rule built"),
    };
    assert!(message.contains("tiers.toml:5:"), "{message}");
}

#[test]
fn a_missing_rules_file_is_said_once_with_its_path() {
    let path = std::env::temp_dir().join(format!("tollgate-missing-{}.toml", std::process::id()));
    let error = RateLimitLayer::builder()
        .policy_source(tollgate::policy::FileSource::new(&path))
        .build()
        .unwrap_err()
        .to_string();
    assert_eq!(
        error.matches("tollgate configuration").count(),
        1,
        "the prefix once: {error}"
    );
    assert!(
        error.contains("cannot read the rules file") && error.contains(&*path.to_string_lossy()),
        "{error}"
    );
}

/// The names of every rule whose budget an answer reports, in order.
fn policy_names(res: &Response<Body>) -> Vec<String> {
    let policy = header(res, "ratelimit-policy").expect("a RateLimit-Policy field");
    policy
        .split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn rules_for_every_tier_join_whichever_set_wins() {
    let rule = |name: &str| Rule::new(name, Quota::per_minute(100));
    let policy = levels()
        .all_tiers([rule("everyone")])
        .all_tiers_route("POST /search", [rule("everyone-post-search")])
        .all_tiers_route("/users/{id}", [rule("everyone-users")]);
    let layer = RateLimitLayer::builder()
        .policy(policy)
        .tenant(TenantFromHeader::new("x-api-key").lookup(tenant_of))
        .build()
        .unwrap();
    let mut app = app(layer);
    let cases: [(&str, &str, Option<&str>, &[&str]); 14] = [
        // The tenant's exception, and the rules of every tier.
        (
            "GET",
            "/search",
            Some("acme-1"),
            &["acme-search", "everyone"],
        ),
        (
            "POST",
            "/search",
            Some("acme-1"),
            &["acme-search", "everyone", "everyone-post-search"],
        ),
        (
            "GET",
            "/users/7",
            Some("acme-1"),
            &["pro-users", "everyone", "everyone-users"],
        ),
        ("GET", "/", Some("pro-1"), &["pro-default", "everyone"]),
        (
            "POST",
            "/search",
            Some("pro-1"),
            &["pro-search-post", "everyone", "everyone-post-search"],
        ),
        ("GET", "/search", Some("pro-1"), &["pro-search", "everyone"]),
        // A route of the rules of every tier that the tier does not list: its own rules.
        (
            "GET",
            "/users/1",
            None,
            &["free-default", "everyone", "everyone-users"],
        ),
        // HEAD gets the rules of GET.
        (
            "HEAD",
            "/users/1",
            Some("pro-1"),
            &["pro-users", "everyone", "everyone-users"],
        ),
        // A tier without rules of its own falls through to the default tier's, widened too.
        (
            "GET",
            "/users/1",
            Some("bare-1"),
            &["bare-users", "everyone", "everyone-users"],
        ),
        (
            "GET",
            "/search",
            Some("bare-1"),
            &["free-search", "everyone"],
        ),
        (
            "POST",
            "/search",
            Some("bare-1"),
            &["free-search", "everyone", "everyone-post-search"],
        ),
        ("GET", "/", Some("bare-1"), &["free-default", "everyone"]),
        ("GET", "/", None, &["free-default", "everyone"]),
        (
            "POST",
            "/search",
            Some("platinum-1"),
            &["free-search", "everyone", "everyone-post-search"],
        ),
    ];
    for (method, path, key, expected) in cases {
        let res = send(&mut app, request(method, path, [10, 0, 0, 1], key)).await;
        assert_eq!(res.status(), StatusCode::OK, "{method} {path} {key:?}");
        assert_eq!(
            policy_names(&res),
            expected,
            "{method} {path} with key {key:?}"
        );
    }
}

/// A policy whose tiers count per tenant and whose rules for every tier count per IP.
fn per_ip_for_everyone(tier_limit: u64, ip_limit: u64, login_limit: u64) -> Policy {
    Policy::new("v1")
        .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(tier_limit))))
        .default_tier("free")
        .all_tiers([
            Rule::new("per-ip", Quota::per_minute(ip_limit)).key(tollgate::key::PeerIp::new())
        ])
        .all_tiers_route(
            "POST /search",
            [Rule::new("search-per-ip", Quota::per_minute(login_limit))
                .key(tollgate::key::PeerIp::new())],
        )
}

async fn statuses(
    app: &mut Router,
    n: usize,
    method: &str,
    path: &str,
    ip: u8,
    key: &str,
) -> Vec<u16> {
    let mut statuses = Vec::with_capacity(n);
    for _ in 0..n {
        let res = send(app, request(method, path, [10, 0, 0, ip], Some(key))).await;
        statuses.push(res.status().as_u16());
    }
    statuses
}

/// The app of [`app`], limited by `policy` on `store`, with tenants from `x-api-key`.
fn app_on<St: Store + Clone>(store: &St, policy: Policy) -> Router {
    let layer = RateLimitLayer::builder()
        .policy(policy)
        .tenant(TenantFromHeader::new("x-api-key").lookup(tenant_of))
        .store(store.clone())
        .build()
        .unwrap();
    let ok = || async { "ok" };
    Router::new()
        .route("/", get(ok))
        .route("/search", get(ok).post(ok))
        .layer(layer)
}

/// Tier rules count per tenant, the rules of every tier per IP: keys of different callers,
/// which a Redis Cluster keeps in different slots.
async fn all_or_nothing_with_the_tiers<St: Store + Clone>(store: St) {
    // A tier rule that denies charges nothing to the rule of every tier.
    let mut app = app_on(&store, per_ip_for_everyone(1, 3, 100));
    assert_eq!(
        statuses(&mut app, 5, "GET", "/", 1, "free-a").await,
        [200, 429, 429, 429, 429]
    );
    // Four refusals later, the address still has 2 of its 3.
    assert_eq!(statuses(&mut app, 1, "GET", "/", 1, "free-b").await, [200]);
    assert_eq!(statuses(&mut app, 1, "GET", "/", 1, "free-c").await, [200]);
    assert_eq!(statuses(&mut app, 1, "GET", "/", 1, "free-d").await, [429]);

    // And the reverse: the rule of every tier that denies charges nothing to the tier.
    // One layer at a time: layers of one store agree on each rule name's quota.
    drop(app);
    let mut app = app_on(&store, per_ip_for_everyone(5, 2, 100));
    assert_eq!(
        statuses(&mut app, 5, "GET", "/", 2, "free-e").await,
        [200, 200, 429, 429, 429]
    );
    // From other addresses, the tenant has the 3 left of its 5.
    assert_eq!(
        statuses(&mut app, 2, "GET", "/", 3, "free-e").await,
        [200, 200]
    );
    assert_eq!(
        statuses(&mut app, 2, "GET", "/", 4, "free-e").await,
        [200, 429]
    );

    // Per route: the route's rule denies, and nothing is charged to the rule of every tier,
    // nor to the tier.
    // One layer at a time: layers of one store agree on each rule name's quota.
    drop(app);
    let mut app = app_on(&store, per_ip_for_everyone(100, 4, 1));
    assert_eq!(
        statuses(&mut app, 4, "POST", "/search", 5, "free-f").await,
        [200, 429, 429, 429]
    );
    // Another method of the route is not the route's rule's: 3 of 4 left for the address.
    assert_eq!(
        statuses(&mut app, 4, "GET", "/search", 5, "free-f").await,
        [200, 200, 200, 429]
    );
    // The rule of every tier denies: the route's rule is not charged either.
    // One layer at a time: layers of one store agree on each rule name's quota.
    drop(app);
    let mut app = app_on(&store, per_ip_for_everyone(100, 1, 2));
    assert_eq!(statuses(&mut app, 1, "GET", "/", 6, "free-g").await, [200]);
    assert_eq!(
        statuses(&mut app, 3, "POST", "/search", 6, "free-g").await,
        [429, 429, 429]
    );
}

#[tokio::test]
async fn rules_for_every_tier_are_all_or_nothing_with_the_tiers_in_memory() {
    all_or_nothing_with_the_tiers(MemoryStore::new()).await;
}

#[tokio::test]
async fn rules_for_every_tier_are_all_or_nothing_with_the_tiers_on_redis() {
    let store = RedisStore::builder(support::standalone().url())
        .prefix(support::unique_prefix("all-tiers"))
        .connect()
        .await
        .unwrap();
    all_or_nothing_with_the_tiers(store).await;
}

#[tokio::test]
async fn rules_for_every_tier_are_all_or_nothing_with_the_tiers_on_a_cluster() {
    let store = RedisClusterStore::builder(support::cluster().urls())
        .prefix(support::unique_prefix("all-tiers"))
        .response_timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    all_or_nothing_with_the_tiers(store).await;
}

#[tokio::test]
async fn a_reload_keeps_the_rules_for_every_tier_and_their_counts() {
    let policy = |version: &str, ip_limit: u64| {
        Policy::new(version)
            .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(100))))
            .default_tier("free")
            .all_tiers([Rule::new("per-ip", Quota::per_minute(ip_limit))
                .algorithm(Algorithm::FixedWindow)
                .key(tollgate::key::PeerIp::new())])
    };
    let layer = RateLimitLayer::builder()
        .policy_source(policy("v1", 3))
        .tenant(TenantFromHeader::new("x-api-key").lookup(tenant_of))
        .build()
        .unwrap();
    let handle = layer.policy_handle().unwrap();
    let mut app = app(layer);
    assert_eq!(
        statuses(&mut app, 2, "GET", "/", 1, "free-a").await,
        [200, 200]
    );
    handle.install(policy("v2", 4)).unwrap();
    // 2 of the 4 are spent: the window's count survived.
    assert_eq!(
        statuses(&mut app, 3, "GET", "/", 1, "free-b").await,
        [200, 200, 429]
    );

    // From a rules file too.
    let file = |version: &str| {
        format!(
            "version = \"{version}\"\ndefault_tier = \"free\"\n\n\
             [tiers.free]\nrules = [{{ name = \"free\", limit = 100, per = \"minute\" }}]\n\n\
             [all_tiers]\nrules = [{{ name = \"per-ip\", limit = 4, per = \"minute\", key = \"ip\", \
             algorithm = \"fixed-window\" }}]\n"
        )
    };
    handle
        .install(Policy::from_toml(&file("v3"), "tiers.toml").unwrap())
        .unwrap();
    assert_eq!(handle.version(), "v3");
    assert_eq!(statuses(&mut app, 1, "GET", "/", 1, "free-c").await, [429]);
    assert_eq!(
        statuses(&mut app, 5, "GET", "/", 2, "free-c").await,
        [200, 200, 200, 200, 429]
    );
}

#[test]
fn rules_for_every_tier_in_a_file_are_the_same_as_in_code() {
    let text = r#"
version = "v1"
default_tier = "free"

[tiers.free]
rules = [{ name = "free", limit = 10, per = "minute" }]

[all_tiers]
rules = [{ name = "per-ip", limit = 100, per = "minute", key = "ip" }]
routes."POST /login".rules = [
  { name = "login", limit = 5, per = "15m", key = "ip", algorithm = "fixed-window" },
]
"#;
    let policy = Policy::from_toml(text, "tiers.toml").unwrap();
    let layer = RateLimitLayer::builder().policy(policy).build().unwrap();
    let mut app = Router::new()
        .route("/login", axum::routing::post(|| async { "ok" }))
        .layer(layer);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let res = runtime.block_on(send(
        &mut app,
        request("POST", "/login", [10, 0, 0, 1], None),
    ));
    assert_eq!(policy_names(&res), ["free", "per-ip", "login"]);
    // An empty list, and a route that is not one, are refused where they are written.
    for (bad, expected) in [
        ("[all_tiers]\nroutes.\"/x\".rules = []\n", "empty rule list"),
        (
            "[all_tiers]\nroutes.\"x\".rules = [{ name = \"x\", limit = 1, per = \"second\" }]\n",
            "is not a route",
        ),
    ] {
        let text = format!(
            "version = \"v1\"\ndefault_tier = \"free\"\n[tiers.free]\n\
             rules = [{{ name = \"free\", limit = 10, per = \"minute\" }}]\n{bad}"
        );
        let error = RateLimitLayer::builder()
            .policy(Policy::from_toml(&text, "tiers.toml").unwrap())
            .build()
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("tiers.toml:") && error.contains(expected),
            "{error}"
        );
    }
}

#[test]
fn a_default_tier_without_rules_builds_when_every_tier_has_rules() {
    let policy = Policy::new("v1")
        .tier(Tier::new("free"))
        .default_tier("free")
        .all_tiers([Rule::new("per-ip", Quota::per_minute(100))]);
    assert!(RateLimitLayer::builder().policy(policy).build().is_ok());
    // Too many rules for one request, once the rules of every tier join a set.
    let many = |prefix: &str, n: usize| {
        (0..n)
            .map(|i| Rule::new(format!("{prefix}{i}"), Quota::per_minute(100)))
            .collect::<Vec<_>>()
    };
    let policy = Policy::new("v1")
        .tier(Tier::new("free").rules(many("tier-", 20)))
        .default_tier("free")
        .all_tiers(many("all-", 20));
    let error = RateLimitLayer::builder()
        .policy(policy)
        .build()
        .unwrap_err()
        .to_string();
    assert!(error.contains("at most 32"), "{error}");
}

#[tokio::test]
async fn a_hashed_tenant_reaches_the_handler_by_its_digest_in_the_default_tier_too() {
    let policy = Policy::new("v1")
        .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(5))))
        .tier(Tier::new("pro").rule(Rule::new("pro", Quota::per_minute(100))))
        .default_tier("free");
    let handler = async |tenant: Option<axum::Extension<Tenant>>| {
        tenant.map_or("none".to_owned(), |t| {
            format!("{} {}", t.id(), t.tier().unwrap_or("-"))
        })
    };
    let body = async |res: Response<Body>| {
        String::from_utf8(res.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
    };
    let layer = RateLimitLayer::builder()
        .policy(policy.clone())
        .tenant(
            TenantFromHeader::new("x-api-key")
                .hashed()
                .lookup(tenant_of),
        )
        .build()
        .unwrap();
    let limiter = layer.limiter();
    let mut app = Router::new().route("/", get(handler)).layer(layer);
    // A tier the policy does not have: the default tier's rules, and the tenant's extension.
    let res = send(&mut app, request("GET", "/", [10, 0, 0, 1], Some("gold-1"))).await;
    assert_eq!(policy_name(&res), "free");
    let hashed = Tenant::new("gold-1").hashed();
    assert_eq!(body(res).await, format!("{} gold", hashed.id()));
    // No tenant: the default tier too, and no extension.
    let res = send(&mut app, request("GET", "/", [10, 0, 0, 1], None)).await;
    assert_eq!(policy_name(&res), "free");
    assert_eq!(body(res).await, "none");
    // An admin endpoint reads the tenant's budget with no request: one of 5 spent.
    let budget = limiter.peek("free", &hashed.key()).await.unwrap();
    assert_eq!(budget.remaining, 4);
    assert_eq!(
        limiter
            .peek("free", &Tenant::new("gold-1").key())
            .await
            .unwrap()
            .remaining,
        5,
        "the raw id is not the tenant's key"
    );

    // An asynchronous lookup is hashed too.
    let layer = RateLimitLayer::builder()
        .policy(policy)
        .tenant(
            TenantFromHeader::new("x-api-key")
                .hashed()
                .lookup_async(async |key: String| tenant_of(&key)),
        )
        .build()
        .unwrap();
    let mut app = Router::new().route("/", get(handler)).layer(layer);
    let res = send(&mut app, request("GET", "/", [10, 0, 0, 1], Some("pro-7"))).await;
    assert_eq!(policy_name(&res), "pro");
    assert_eq!(
        body(res).await,
        format!("{} pro", Tenant::new("pro-7").hashed().id())
    );
}
