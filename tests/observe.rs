//! Metrics through a recorder: exact counters and labels for known traffic (allowed, denied,
//! the store down in each failure mode), bounded label values, the decision hook, and the
//! example's `/metrics` read by a Prometheus exposition-format parser.

mod support;

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::{Request, StatusCode};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tollgate::observe::{DecisionHook, Verdict};
use tollgate::store::{Charge, Store, StoreError};
use tollgate::{Decision, FailureMode, Quota, RateLimitLayer, Rule};
use tower::{Service, ServiceExt};

fn request(path: &str, ip: [u8; 4]) -> Request<Body> {
    let mut req = Request::get(path).body(Body::empty()).unwrap();
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::from((ip, 50_000))));
    req
}

async fn send(app: &mut Router, req: Request<Body>) -> StatusCode {
    app.as_service()
        .ready()
        .await
        .unwrap()
        .call(req)
        .await
        .unwrap()
        .status()
}

/// Runs `traffic` on this thread with a recorder of its own; every counter and histogram it
/// recorded, as `name{label="value",…}` (labels sorted) → value (histograms: their count).
fn recorded<F: std::future::Future<Output = ()>>(
    traffic: impl FnOnce() -> F,
) -> BTreeMap<String, u64> {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(traffic())
    });
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| {
            let key = key.key();
            let mut labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}=\"{}\"", l.key(), l.value()))
                .collect();
            labels.sort();
            let name = format!("{}{{{}}}", key.name(), labels.join(","));
            match value {
                DebugValue::Counter(n) => Some((name, n)),
                DebugValue::Histogram(values) => Some((name, values.len() as u64)),
                DebugValue::Gauge(_) => None,
            }
        })
        .collect()
}

fn expect(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

#[test]
fn allowed_and_denied_requests_are_counted_by_rule_route_tier_and_outcome() {
    let metrics = recorded(|| async {
        let layer = RateLimitLayer::builder()
            .rule(Rule::new("per-minute", Quota::per_minute(2)))
            .build()
            .unwrap();
        let mut app = Router::new()
            .route("/hello", get(|| async { "ok" }))
            .layer(layer);
        let statuses = [
            send(&mut app, request("/hello", [10, 0, 0, 1])).await,
            send(&mut app, request("/hello", [10, 0, 0, 1])).await,
            send(&mut app, request("/hello", [10, 0, 0, 1])).await,
            send(&mut app, request("/hello", [10, 0, 0, 2])).await,
        ];
        assert_eq!(statuses.map(|s| s.as_u16()), [200, 200, 429, 200]);
    });
    assert_eq!(
        metrics,
        expect(&[
            (
                "tollgate_requests_total{outcome=\"allowed\",route=\"/hello\",tier=\"\"}",
                3
            ),
            (
                "tollgate_requests_total{outcome=\"denied\",route=\"/hello\",tier=\"\"}",
                1
            ),
            (
                "tollgate_rule_decisions_total{outcome=\"allowed\",route=\"/hello\",rule=\"per-minute\",tier=\"\"}",
                3
            ),
            (
                "tollgate_rule_decisions_total{outcome=\"denied\",route=\"/hello\",rule=\"per-minute\",tier=\"\"}",
                1
            ),
            (
                "tollgate_store_check_duration_seconds{result=\"ok\",store=\"memory\"}",
                4
            ),
        ])
    );
}

/// A store that always times out.
struct Down;

impl Store for Down {
    type Future = std::future::Ready<Result<Decision, StoreError>>;

    fn check(&self, _: &[Charge<'_>]) -> Self::Future {
        std::future::ready(Err(StoreError::Timeout))
    }

    fn kind(&self) -> &'static str {
        "down"
    }
}

#[test]
fn a_store_that_is_down_is_counted_in_each_failure_mode() {
    let metrics = recorded(|| async {
        for (name, mode) in [
            ("open", FailureMode::Open),
            ("closed", FailureMode::Closed),
            ("local", FailureMode::Local),
        ] {
            let layer = RateLimitLayer::builder()
                .rule(Rule::new(name, Quota::per_minute(1)).on_store_error(mode))
                .store(Down)
                .build()
                .unwrap();
            let mut app = Router::new()
                .route(&format!("/{name}"), get(|| async { "ok" }))
                .layer(layer);
            for _ in 0..2 {
                send(&mut app, request(&format!("/{name}"), [10, 0, 0, 1])).await;
            }
        }
    });
    let r = |rule: &str, outcome: &str| {
        format!(
            "tollgate_rule_decisions_total{{outcome=\"{outcome}\",route=\"/{rule}\",rule=\"{rule}\",tier=\"\"}}"
        )
    };
    let q = |route: &str, outcome: &str| {
        format!("tollgate_requests_total{{outcome=\"{outcome}\",route=\"/{route}\",tier=\"\"}}")
    };
    let mut expected = BTreeMap::new();
    expected.insert(q("open", "failed_open"), 2);
    expected.insert(r("open", "failed_open"), 2);
    expected.insert(q("closed", "failed_closed"), 2);
    expected.insert(r("closed", "failed_closed"), 2);
    // The local limiter: one per minute.
    expected.insert(q("local", "local_allowed"), 1);
    expected.insert(r("local", "local_allowed"), 1);
    expected.insert(q("local", "local_denied"), 1);
    expected.insert(r("local", "local_denied"), 1);
    expected.insert(
        "tollgate_store_errors_total{kind=\"timeout\",store=\"down\"}".to_owned(),
        6,
    );
    expected.insert(
        "tollgate_store_check_duration_seconds{result=\"error\",store=\"down\"}".to_owned(),
        6,
    );
    assert_eq!(metrics, expected);
}

#[test]
fn label_values_never_grow_with_clients() {
    let series = |clients: u32| {
        recorded(move || async move {
            let layer = RateLimitLayer::builder()
                .rule(Rule::new("per-minute", Quota::per_minute(1)))
                .build()
                .unwrap();
            let mut app = Router::new()
                .route("/users/{id}", get(|| async { "ok" }))
                .layer(layer);
            for n in 0..clients {
                let ip = n.to_be_bytes();
                // Two requests each: one allowed, one denied; and a new user id each time.
                for _ in 0..2 {
                    send(
                        &mut app,
                        request(&format!("/users/{n}"), [10, ip[1], ip[2], ip[3]]),
                    )
                    .await;
                }
            }
        })
        .into_keys()
        .collect::<HashSet<String>>()
    };
    let few = series(3);
    let many = series(10_000);
    assert_eq!(few, many, "the series of 3 clients and of 10,000 clients");
    assert!(
        many.iter()
            .all(|s| !s.contains("10.0.") && !s.contains("/users/1")),
        "{many:?}"
    );
}

#[tokio::test]
async fn the_decision_hook_never_blocks_and_counts_what_it_drops() {
    let (hook, mut events) = DecisionHook::channel(2);
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("per-minute", Quota::per_minute(1)))
        .decision_hook(hook.clone())
        .build()
        .unwrap();
    let mut app = Router::new()
        .route("/hello", get(|| async { "ok" }))
        .layer(layer);
    let statuses = [
        send(&mut app, request("/hello", [10, 0, 0, 1])).await,
        send(&mut app, request("/hello", [10, 0, 0, 1])).await,
        send(&mut app, request("/hello", [10, 0, 0, 1])).await,
        send(&mut app, request("/hello", [10, 0, 0, 1])).await,
    ];
    assert_eq!(statuses.map(|s| s.as_u16()), [200, 429, 429, 429]);
    assert_eq!(hook.dropped(), 2);
    let first = events.recv().await.unwrap();
    assert_eq!(first.verdict, Verdict::Allowed);
    assert_eq!(first.route.as_deref(), Some("/hello"));
    // A layer without a policy has no tier: not "default", which a policy may name otherwise.
    assert_eq!(first.tier.as_deref(), None);
    assert_eq!(&*first.rules[0].name, "per-minute");
    assert_eq!(first.rules[0].outcome, "allowed");
    let second = events.recv().await.unwrap();
    assert_eq!(second.verdict, Verdict::Denied);
    assert_eq!(second.rules[0].outcome, "denied");
    assert!(second.rules[0].retry_after.unwrap() > Duration::ZERO);
    // Room again: the next decision is sent.
    send(&mut app, request("/hello", [10, 0, 0, 2])).await;
    assert_eq!(events.recv().await.unwrap().verdict, Verdict::Allowed);
    assert_eq!(hook.dropped(), 2);
}

#[tokio::test]
async fn the_example_metrics_are_prometheus_text_that_counts_its_denials() {
    let example = support::example::Example::start("metrics", "TOLLGATE_ADDR", &[]);
    let addr = example.addr.clone();
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    let get = |path: &str| client.get(format!("http://{addr}{path}").parse().unwrap());
    let mut statuses = Vec::new();
    for _ in 0..7 {
        statuses.push(get("/hello").await.unwrap().status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429, 429]);
    let body = get("/metrics").await.unwrap().into_body();
    let text = String::from_utf8(
        http_body_util::BodyExt::collect(body)
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap();
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).unwrap();
    let value = |name: &str, outcome: &str| {
        scrape
            .samples
            .iter()
            .filter(|s| {
                s.metric == name
                    && s.labels.get("outcome") == Some(outcome)
                    && s.labels.get("route") == Some("/hello")
            })
            .map(|s| match s.value {
                prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => v,
                ref other => panic!("{name} is not a counter: {other:?}"),
            })
            .sum::<f64>()
    };
    assert_eq!(value("tollgate_requests_total", "denied"), 2.0, "{text}");
    assert_eq!(value("tollgate_requests_total", "allowed"), 5.0, "{text}");
    assert_eq!(
        value("tollgate_rule_decisions_total", "denied"),
        2.0,
        "{text}"
    );
    assert!(
        scrape
            .samples
            .iter()
            .any(|s| s.metric == "tollgate_store_check_duration_seconds"),
        "{text}"
    );
    assert!(
        scrape.docs.contains_key("tollgate_requests_total"),
        "{text}"
    );
}

#[test]
fn the_dashboard_and_the_alerts_name_only_metrics_that_exist() {
    let known = [
        "tollgate_requests_total",
        "tollgate_rule_decisions_total",
        "tollgate_store_check_duration_seconds_bucket",
        "tollgate_store_errors_total",
        "tollgate_circuit_breaker_open",
        "tollgate_memory_store_keys",
        "tollgate_memory_store_evictions_total",
        "tollgate_policy_reloads_total",
        "tollgate_metered_streams_ended_total",
    ];
    for file in ["grafana-dashboard.json", "alerts.yml"] {
        let path = format!("{}/examples/metrics/{file}", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).unwrap();
        let mut named = 0;
        for word in text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if word.starts_with("tollgate_") {
                assert!(
                    known.contains(&word),
                    "{file} names {word}, which tollgate does not record"
                );
                named += 1;
            }
        }
        assert!(named > 5, "{file}");
    }
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!(
            "{}/examples/metrics/grafana-dashboard.json",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap(),
    )
    .unwrap();
    assert!(dashboard["panels"].as_array().unwrap().len() >= 8);
}

#[test]
fn every_request_is_counted_once_whatever_becomes_of_it() {
    use tollgate::key::Global;
    use tollgate::policy::{Policy, Tenant, TenantFromHeader, Tier};

    let metrics = recorded(|| async {
        let policy = Policy::new("v1")
            .tier(
                Tier::new("free")
                    .rule(Rule::new("free", Quota::per_minute(100)))
                    .route(
                        "/dark",
                        [Rule::new("dark", Quota::per_minute(1)).key(Global).shadow()],
                    )
                    .route(
                        "/anonymous",
                        [Rule::new("users", Quota::per_minute(1))
                            .key(|_: &http::request::Parts| None)
                            .skip_unidentified()],
                    ),
            )
            .default_tier("free")
            .allow("10.9.0.0/16".parse().unwrap())
            .deny("10.6.0.0/16".parse().unwrap());
        let layer = RateLimitLayer::builder()
            .policy(policy)
            .tenant(
                TenantFromHeader::new("x-slow").lookup_async(|_key: String| async {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    Some(Tenant::new("late"))
                }),
            )
            .build()
            .unwrap();
        let ok = || async { "ok" };
        let mut app = Router::new()
            .route("/", get(ok))
            .route("/dark", get(ok))
            .route("/anonymous", get(ok))
            .layer(layer);
        assert_eq!(
            send(&mut app, request("/", [10, 9, 0, 1])).await,
            StatusCode::OK
        );
        assert_eq!(
            send(&mut app, request("/", [10, 6, 0, 1])).await,
            StatusCode::FORBIDDEN
        );
        assert_eq!(
            send(&mut app, request("/anonymous", [10, 0, 0, 1])).await,
            StatusCode::OK
        );
        for _ in 0..2 {
            assert_eq!(
                send(&mut app, request("/dark", [10, 0, 0, 1])).await,
                StatusCode::OK
            );
        }
        // A client that leaves while its tenant is looked up.
        let mut slow = request("/", [10, 0, 0, 1]);
        slow.headers_mut().insert("x-slow", "key".parse().unwrap());
        let mut service = app.as_service::<Body>();
        let future = service.ready().await.unwrap().call(slow);
        assert!(
            tokio::time::timeout(Duration::from_millis(20), future)
                .await
                .is_err()
        );
    });
    let requests: BTreeMap<&str, u64> = metrics
        .iter()
        .filter(|(k, _)| k.starts_with("tollgate_requests_total"))
        .map(|(k, v)| {
            let outcome = k
                .split("outcome=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap();
            (outcome, *v)
        })
        .fold(BTreeMap::new(), |mut all, (outcome, n)| {
            *all.entry(outcome).or_default() += n;
            all
        });
    assert_eq!(
        requests,
        BTreeMap::from([
            ("allowed", 1),
            ("cancelled", 1),
            ("listed_allowed", 1),
            ("listed_denied", 1),
            ("not_limited", 1),
            ("shadow_denied", 1),
        ]),
        "{metrics:#?}"
    );
    // The shadow rule's would-be denial, by rule.
    assert_eq!(
        metrics
            .get("tollgate_rule_decisions_total{outcome=\"shadow_denied\",route=\"/dark\",rule=\"dark\",tier=\"free\"}"),
        Some(&1),
        "{metrics:#?}"
    );
}

#[test]
fn policy_reloads_are_counted_by_result_once_per_bad_version() {
    use tollgate::policy::{Policy, Tier};

    let policy = |version: &str, limit: u64| {
        Policy::new(version)
            .tier(Tier::new("free").rule(Rule::new("api", Quota::per_minute(limit))))
            .default_tier("free")
    };
    let metrics = recorded(|| async {
        let layer = RateLimitLayer::builder()
            .policy_source(policy("v1", 10))
            .build()
            .unwrap();
        let handle = layer.policy_handle().unwrap();
        handle.install(policy("v2", 20)).unwrap();
        // A policy without a default tier does not build, however many times it is offered.
        let bad =
            Policy::new("bad").tier(Tier::new("free").rule(Rule::new("api", Quota::per_minute(5))));
        for _ in 0..3 {
            assert!(handle.install(bad.clone()).is_err());
        }
        handle.install(policy("v3", 30)).unwrap();
        assert_eq!((handle.installed(), handle.rejected()), (2, 1));
        assert_eq!(handle.version(), "v3");
    });
    assert_eq!(
        metrics,
        expect(&[
            ("tollgate_policy_reloads_total{result=\"installed\"}", 2),
            ("tollgate_policy_reloads_total{result=\"rejected\"}", 1),
        ])
    );
}

#[test]
fn label_values_never_grow_with_tenants_api_keys_or_grpc_paths() {
    use tollgate::policy::{Policy, Tenant, TenantFromHeader, Tier};

    let series = |clients: u32| {
        recorded(move || async move {
            let policy = Policy::new("v1")
                .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(1))))
                .tier(
                    Tier::new("pro")
                        .rule(Rule::new("pro", Quota::per_minute(1)))
                        .route(
                            "/pkg.Search/Find",
                            [Rule::new("find", Quota::per_minute(1))],
                        ),
                )
                .default_tier("free");
            let layer = RateLimitLayer::builder()
                .policy(policy)
                // Every key is a tenant, and claims a tier of its own choosing.
                .tenant(TenantFromHeader::new("x-api-key").lookup(|key: &str| {
                    let (tier, id) = key.split_once('-')?;
                    Some(Tenant::new(id.to_owned()).with_tier(tier.to_owned()))
                }))
                .build()
                .unwrap();
            let mut service = tower::Layer::layer(
                &layer,
                tower::service_fn(|_: Request<Body>| async {
                    Ok::<_, std::convert::Infallible>(http::Response::new(Body::empty()))
                }),
            );
            for n in 0..clients {
                let tier = ["free", "pro", &format!("tier{n}")][n as usize % 3].to_owned();
                let key = format!("{tier}-tenant{n}");
                let grpc_path = if n % 2 == 0 {
                    "/pkg.Search/Find".to_owned()
                } else {
                    format!("/pkg.Invented{n}/Method{n}")
                };
                for path in [format!("/unmatched/{n}"), grpc_path] {
                    for _ in 0..2 {
                        let mut req = request(&path, [10, 1, (n >> 8) as u8, n as u8]);
                        req.headers_mut().insert("x-api-key", key.parse().unwrap());
                        if path.starts_with("/pkg.") {
                            req.headers_mut()
                                .insert("content-type", "application/grpc".parse().unwrap());
                        }
                        service.ready().await.unwrap().call(req).await.unwrap();
                    }
                }
            }
        })
        .into_keys()
        .collect::<HashSet<String>>()
    };
    let few = series(6);
    let many = series(3_000);
    assert_eq!(few, many, "the series of 6 tenants and of 3,000 tenants");
    assert!(
        many.iter().all(|s| !s.contains("tenant")
            && !s.contains("Invented")
            && !s.contains("/unmatched")
            && !s.contains("tier1")),
        "{many:#?}"
    );
    // The gRPC method the policy names is a route; the tiers a client claims that the policy
    // does not have are counted as the default tier.
    assert!(
        many.iter()
            .any(|s| s.contains("route=\"/pkg.Search/Find\"")),
        "{many:#?}"
    );
    assert!(
        many.iter().all(|s| !s.contains("tier=")
            || s.contains("tier=\"free\"")
            || s.contains("tier=\"pro\"")),
        "{many:#?}"
    );
}

/// A store that answers from its deny cache, or from leases.
struct Answering(tollgate::DecisionSource, bool);

impl Store for Answering {
    type Future = std::future::Ready<Result<Decision, StoreError>>;

    fn check(&self, charges: &[Charge<'_>]) -> Self::Future {
        let outcomes = charges.iter().map(|_| tollgate::algorithm::Outcome {
            allowed: self.1,
            limit: 10,
            remaining: if self.1 { 5 } else { 0 },
            reset: 1_000_000,
            retry_after: if self.1 { 0 } else { 1_000_000 },
            window: 1_000_000,
        });
        std::future::ready(Ok(Decision::from_outcomes(outcomes).made_by(self.0)))
    }

    fn kind(&self) -> &'static str {
        "answering"
    }
}

#[test]
fn denials_from_a_deny_cache_and_admissions_from_leases_are_counted_as_such() {
    use tollgate::DecisionSource;

    let metrics = recorded(|| async {
        for (source, allowed, expected) in [
            (
                DecisionSource::DenyCache,
                false,
                StatusCode::TOO_MANY_REQUESTS,
            ),
            (DecisionSource::Lease, true, StatusCode::OK),
        ] {
            let layer = RateLimitLayer::builder()
                .rule(Rule::new("hot", Quota::per_minute(10)))
                .store(Answering(source, allowed))
                .build()
                .unwrap();
            let mut app = Router::new()
                .route("/hot", get(|| async { "ok" }))
                .layer(layer);
            assert_eq!(
                send(&mut app, request("/hot", [10, 0, 0, 1])).await,
                expected
            );
        }
    });
    for (name, outcome) in [
        ("tollgate_requests_total", "cache_denied"),
        ("tollgate_requests_total", "lease_allowed"),
        ("tollgate_rule_decisions_total", "cache_denied"),
        ("tollgate_rule_decisions_total", "lease_allowed"),
    ] {
        assert!(
            metrics.iter().any(|(k, v)| k.starts_with(name)
                && k.contains(&format!("outcome=\"{outcome}\""))
                && *v == 1),
            "{name} {outcome}: {metrics:#?}"
        );
    }
}

/// `tollgate_memory_store_keys` follows the keys as they come and go, from the first request
/// (a dashboard's panel is not empty until the first sweep).
#[test]
fn the_memory_store_counts_its_keys_as_they_come_and_go() {
    use tollgate::Algorithm;
    use tollgate::algorithm::Limits;
    use tollgate::key::Key;
    use tollgate::store::{MemoryStore, RuleSpec};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let keys = || {
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .find_map(|(key, _, _, value)| match value {
                DebugValue::Gauge(v) if key.key().name() == "tollgate_memory_store_keys" => {
                    Some(v.into_inner())
                }
                _ => None,
            })
    };
    metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let store = MemoryStore::new();
        let rule = RuleSpec::new(
            "keys",
            Algorithm::FixedWindow,
            Limits::new(10, 60_000_000, 10).unwrap(),
        )
        .unwrap();
        let clients: Vec<Key> = (0..3).map(|i| Key::text(format!("client-{i}"))).collect();
        for key in &clients {
            let charge = [Charge {
                rule: &rule,
                key,
                cost: 1,
            }];
            runtime.block_on(store.check(&charge)).unwrap();
        }
        let charge = [Charge {
            rule: &rule,
            key: &clients[0],
            cost: 1,
        }];
        runtime.block_on(store.reset(&charge)).unwrap();
        // (A snapshot drains what it reads: one, at the end.)
        assert_eq!(
            keys(),
            Some(2.0),
            "three keys counted as they came, one reset"
        );
    });
}

#[test]
fn stacked_layers_count_a_request_once_each_under_their_names() {
    let metrics = recorded(|| async {
        let layer = |name: &str, limit: u64| {
            RateLimitLayer::builder()
                .rule(Rule::new(name, Quota::per_minute(limit)))
                .name(name)
                .build()
                .unwrap()
        };
        let mut app = Router::new()
            .route("/hello", get(|| async { "ok" }))
            .layer(layer("inner", 1))
            .layer(layer("outer", 10));
        let statuses = [
            send(&mut app, request("/hello", [10, 0, 0, 1])).await,
            send(&mut app, request("/hello", [10, 0, 0, 1])).await,
        ];
        assert_eq!(statuses.map(|s| s.as_u16()), [200, 429]);
    });
    let requests: BTreeMap<&str, u64> = metrics
        .iter()
        .filter(|(name, _)| name.starts_with("tollgate_requests_total"))
        .map(|(name, n)| (name.as_str(), *n))
        .collect();
    assert_eq!(
        requests,
        BTreeMap::from([
            (
                "tollgate_requests_total{layer=\"inner\",outcome=\"allowed\",route=\"/hello\",tier=\"\"}",
                1
            ),
            (
                "tollgate_requests_total{layer=\"inner\",outcome=\"denied\",route=\"/hello\",tier=\"\"}",
                1
            ),
            // The outer layer admitted both: it counts each request too.
            (
                "tollgate_requests_total{layer=\"outer\",outcome=\"allowed\",route=\"/hello\",tier=\"\"}",
                2
            ),
        ])
    );
    let error = RateLimitLayer::builder()
        .rule(Rule::new("r", Quota::per_minute(1)))
        .name("edge layer")
        .build()
        .unwrap_err();
    assert!(error.to_string().contains("layer name"), "{error}");
}

/// A memory store that fails every check while `down` is set.
#[derive(Clone, Default)]
struct Failing {
    store: tollgate::store::MemoryStore,
    down: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Store for Failing {
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<Decision, StoreError>> + Send>>;

    fn check(&self, charges: &[Charge<'_>]) -> Self::Future {
        if self.down.load(std::sync::atomic::Ordering::SeqCst) {
            return Box::pin(std::future::ready(Err(StoreError::Timeout)));
        }
        Box::pin(self.store.check(charges))
    }

    fn adjust(
        &self,
        adjustments: &[tollgate::store::Adjustment<'_>],
    ) -> tollgate::store::StoreFuture<()> {
        self.store.adjust(adjustments)
    }
}

/// Metered streams count the units the store granted them and the units they were charged,
/// and the streams that their budget or a failing store ended, by rule and tier.
#[test]
fn metered_streams_count_their_units_and_why_they_ended() {
    use axum::routing::post;
    use tollgate::{Meter, Spend};

    let metrics = recorded(|| async {
        let store = Failing::default();
        let layer = RateLimitLayer::builder()
            .rule(
                Rule::new("tokens", Quota::per_minute(1_000))
                    .key(tollgate::key::FromHeader::new("x-api-key"))
                    .on_store_error(FailureMode::Closed)
                    .meter(100),
            )
            .store(store.clone())
            .build()
            .unwrap();
        let down = store.down.clone();
        // Streams `x-tokens` tokens, each spent first; with `x-fail`, the store fails once the
        // stream is admitted.
        let app = Router::new()
            .route(
                "/",
                post(
                    move |axum::Extension(meter): axum::Extension<Meter>,
                          headers: http::HeaderMap| {
                        let down = down.clone();
                        async move {
                            let tokens: u64 =
                                headers["x-tokens"].to_str().unwrap().parse().unwrap();
                            if headers.contains_key("x-fail") {
                                down.store(true, std::sync::atomic::Ordering::SeqCst);
                            }
                            let events = futures_util::stream::unfold(0, move |n| {
                                let meter = meter.clone();
                                async move {
                                    if n == tokens || meter.spend(1).await == Spend::Exhausted {
                                        return None;
                                    }
                                    Some((Ok::<_, std::convert::Infallible>("data: t\n\n"), n + 1))
                                }
                            });
                            Body::from_stream(events)
                        }
                    },
                ),
            )
            .layer(layer);
        let stream = |key: &'static str, tokens: u64, fail: bool| {
            let app = app.clone();
            async move {
                let mut request = Request::post("/")
                    .header("x-api-key", key)
                    .header("x-tokens", tokens.to_string());
                if fail {
                    request = request.header("x-fail", "1");
                }
                let response = app
                    .oneshot(request.body(Body::empty()).unwrap())
                    .await
                    .unwrap();
                axum::body::to_bytes(response.into_body(), usize::MAX)
                    .await
                    .unwrap()
            }
        };
        // 600 of 1,000 streamed; then a stream of 1,000 ended by the budget at 400; another
        // key's stream ended by the store at its admission's chunk.
        stream("a", 600, false).await;
        stream("a", 1_000, false).await;
        stream("b", 1_000, true).await;
    });
    let at = |name: &str| {
        metrics
            .get(name)
            .copied()
            .unwrap_or_else(|| panic!("{name} not in {metrics:#?}"))
    };
    assert_eq!(
        at("tollgate_metered_units_spent_total{rule=\"tokens\",tier=\"\"}"),
        600 + 400 + 100
    );
    let granted = at("tollgate_metered_units_granted_total{rule=\"tokens\",tier=\"\"}");
    assert!(
        (1_100..=1_100 + 3 * 100).contains(&granted),
        "{granted} granted"
    );
    assert_eq!(
        at("tollgate_metered_streams_ended_total{reason=\"budget\",rule=\"tokens\",tier=\"\"}"),
        1
    );
    assert_eq!(
        at(
            "tollgate_metered_streams_ended_total{reason=\"store_error\",rule=\"tokens\",tier=\"\"}"
        ),
        1
    );
}
