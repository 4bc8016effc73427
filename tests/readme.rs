//! The README's sample answers are the layer's real answers: its quick start (5 per minute,
//! rule "per-minute") is run and every header and body line the README shows is compared.

use std::net::SocketAddr;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::Request;
use http_body_util::BodyExt;
use tollgate::clock::ManualClock;
use tollgate::store::MemoryStore;
use tollgate::{Quota, RateLimitLayer, Rule};
use tower::ServiceExt;

/// A sample answer of the README: status line, headers, body.
struct Sample {
    status: String,
    headers: Vec<(String, String)>,
    body: String,
}

/// Every `text` block of the README that shows an HTTP answer.
fn samples() -> Vec<Sample> {
    let readme = include_str!("../README.md");
    let mut samples = Vec::new();
    for block in readme.split("```text\n").skip(1) {
        let block = &block[..block.find("```").expect("a closed block")];
        let Some(rest) = block.strip_prefix("HTTP/1.1 ") else {
            continue;
        };
        let (head, body) = rest.split_once("\n\n").unwrap_or((rest, ""));
        let mut lines = head.lines();
        let status = lines.next().unwrap().to_owned();
        let headers = lines
            .map(|line| {
                let (name, value) = line.split_once(": ").expect("name: value");
                (name.to_owned(), value.to_owned())
            })
            .collect();
        samples.push(Sample {
            status,
            headers,
            body: body.trim().to_owned(),
        });
    }
    samples
}

async fn send(app: &Router) -> http::Response<Body> {
    let mut request = Request::get("/hello").body(Body::empty()).unwrap();
    request
        .extensions_mut()
        .insert(ConnectInfo(SocketAddr::from(([127, 0, 0, 1], 50_000))));
    app.clone().oneshot(request).await.unwrap()
}

async fn compare(app: &Router, sample: &Sample) {
    let response = send(app).await;
    let status = response.status();
    assert_eq!(
        format!("{} {}", status.as_u16(), status.canonical_reason().unwrap()),
        sample.status
    );
    for (name, value) in &sample.headers {
        assert_eq!(
            response
                .headers()
                .get(name.as_str())
                .map(|v| v.to_str().unwrap()),
            Some(value.as_str()),
            "README header {name}"
        );
    }
    let body = response.into_body().collect().await.unwrap().to_bytes();
    if !sample.body.is_empty() {
        assert_eq!(String::from_utf8_lossy(&body), sample.body, "README body");
    }
}

#[tokio::test]
async fn the_quick_start_samples_are_what_the_layer_answers() {
    let example = include_str!("../examples/quickstart.rs");
    assert!(
        example.contains(r#"Rule::new("per-minute", Quota::per_minute(5))"#),
        "the README samples describe the quickstart example's rule"
    );
    let samples = samples();
    assert_eq!(
        samples.len(),
        2,
        "the README shows an admitted and a denied answer"
    );

    let store = MemoryStore::builder()
        .clock(ManualClock::default())
        .build()
        .unwrap();
    let limits = RateLimitLayer::builder()
        .rule(Rule::new("per-minute", Quota::per_minute(5)))
        .store(store)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/hello", get(|| async { "Hello from behind tollgate!\n" }))
        .layer(limits);

    compare(&app, &samples[0]).await; // the first request
    for _ in 2..=5 {
        assert!(send(&app).await.status().is_success());
    }
    compare(&app, &samples[1]).await; // the sixth
}

/// The README's first block is the two commands a newcomer runs first.
#[test]
fn the_readme_opens_with_the_quick_start_and_the_test_script() {
    let readme = include_str!("../README.md");
    let first = readme.split("```sh\n").nth(1).expect("a sh block");
    let first = &first[..first.find("```").expect("a closed block")];
    let commands: Vec<_> = first
        .lines()
        .map(|line| line.split('#').next().unwrap().trim())
        .collect();
    assert_eq!(
        commands,
        ["cargo run --example quickstart", "./scripts/test.sh"]
    );
}

/// The version of a dependency line: `name = "1.2"` or `name = { version = "1.2", … }`.
fn version_of<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    text.lines().find_map(|line| {
        let rest = line
            .trim()
            .strip_prefix(name)?
            .trim_start()
            .strip_prefix('=')?;
        let rest = rest.trim_start();
        let rest = rest
            .strip_prefix('"')
            .or_else(|| Some(rest.split_once("version = \"")?.1))?;
        rest.split('"').next()
    })
}

/// The install lines say what Cargo.toml says: this crate's version, the metrics exporter the
/// metrics section needs (the one the example and the tests are built with), and every feature
/// with whether it is on by default.
#[test]
fn the_install_lines_match_cargo_toml() {
    let readme = include_str!("../README.md");
    let manifest = include_str!("../Cargo.toml");
    let install: String = readme
        .split("```toml\n")
        .skip(1)
        .map(|block| &block[..block.find("```").expect("a closed block")])
        .filter(|block| block.contains("[dependencies]"))
        .collect();
    assert!(!install.is_empty(), "the README has [dependencies] lines");

    let version = env!("CARGO_PKG_VERSION");
    let tollgate = version_of(&install, "tollgate").expect("a tollgate line");
    assert!(
        version.starts_with(tollgate),
        "README tollgate = {tollgate:?}, Cargo.toml {version}"
    );
    let dev = &manifest[manifest.find("[dev-dependencies]").unwrap()..];
    assert_eq!(
        version_of(&install, "metrics-exporter-prometheus"),
        version_of(dev, "metrics-exporter-prometheus"),
        "the exporter version of the README is the one tollgate is tested with"
    );
    for dependency in ["axum", "tokio"] {
        assert_eq!(
            version_of(&install, dependency),
            version_of(manifest, dependency),
            "{dependency}"
        );
    }

    let features = &manifest[manifest.find("[features]").unwrap()..];
    let features = &features[..features[1..].find("\n[").unwrap()];
    let default = features
        .lines()
        .find_map(|line| line.strip_prefix("default = "))
        .unwrap();
    let mut named = Vec::new();
    for line in features.lines() {
        let Some((name, _)) = line.split_once(" = ") else {
            continue;
        };
        if name == "default" || name.starts_with('#') {
            continue;
        }
        named.push(name);
        let row = readme
            .lines()
            .find(|row| row.starts_with(&format!("| `{name}` |")))
            .unwrap_or_else(|| panic!("the README's feature table has no row for {name}"));
        let on = default.contains(&format!("\"{name}\""));
        assert!(
            row.starts_with(&format!("| `{name}` | {} |", if on { "yes" } else { "no" })),
            "{row}"
        );
    }
    assert_eq!(named.len(), 7, "{named:?}");
}

/// The README's rules file is one the layer reads, with the rule sets its comments name: the
/// free tier for a client without a tenant, its own rules on `/search`, and the pro tier.
#[cfg(all(feature = "toml", feature = "axum"))]
#[tokio::test]
async fn the_readme_rules_file_is_the_policy_it_says() {
    let readme = include_str!("../README.md");
    let rules: Vec<&str> = readme
        .split("```toml\n")
        .skip(1)
        .map(|block| &block[..block.find("```").expect("a closed block")])
        .filter(|block| !block.contains("[dependencies]"))
        .collect();
    assert_eq!(rules.len(), 1, "the README shows one rules file");
    let policy = tollgate::policy::Policy::from_toml(rules[0], "README.md")
        .unwrap_or_else(|error| panic!("the README's rules file: {error}"));
    assert_eq!(policy.version(), "1");
    let store = MemoryStore::builder()
        .clock(ManualClock::default())
        .build()
        .unwrap();
    let limits = RateLimitLayer::builder()
        .policy(policy)
        .store(store)
        .tenant(
            tollgate::policy::TenantFromHeader::new("x-api-key").lookup(|key: &str| {
                key.strip_prefix("pro-")
                    .map(|org| tollgate::policy::Tenant::new(org).with_tier("pro"))
            }),
        )
        .build()
        .unwrap();
    let app = Router::new()
        .route("/hello", get(|| async { "hello" }))
        .route("/search", get(|| async { "found" }))
        .layer(limits);
    // The status and the `RateLimit-Policy` of a request to `path`, with an API key or not,
    // from the client at 127.0.0.`client`.
    let send = |path: &str, key: Option<&str>, client: u8| {
        let mut request = Request::get(path);
        if let Some(key) = key {
            request = request.header("x-api-key", key);
        }
        let mut request = request.body(Body::empty()).unwrap();
        request
            .extensions_mut()
            .insert(ConnectInfo(SocketAddr::from(([127, 0, 0, client], 50_000))));
        let app = app.clone();
        async move {
            let response = app.oneshot(request).await.unwrap();
            let policy = response.headers()["ratelimit-policy"].to_str().unwrap();
            (response.status().as_u16(), policy.to_owned())
        }
    };
    let free = r#""free";q=5;w=60"#.to_owned();
    for _ in 0..5 {
        assert_eq!(send("/hello", None, 1).await, (200, free.clone()));
    }
    assert_eq!(
        send("/hello", None, 1).await,
        (429, free.clone()),
        "the sixth"
    );
    // Without a tenant, per client IP; a route's own rules count apart.
    assert_eq!(send("/hello", None, 2).await, (200, free.clone()));
    let search = r#""free-search";q=2;w=60"#.to_owned();
    assert_eq!(send("/search", None, 1).await, (200, search.clone()));
    assert_eq!(send("/search", None, 1).await, (200, search.clone()));
    assert_eq!(send("/search", None, 1).await, (429, search));
    // A tenant of the pro tier, from any address.
    let pro = r#""pro";q=50;w=60"#.to_owned();
    assert_eq!(send("/hello", Some("pro-acme"), 1).await, (200, pro));
}
