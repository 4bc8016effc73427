//! The examples, run as a user runs them (the binaries `cargo test` builds) and used over HTTP
//! as their documentation says.

mod support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use support::example::Example;

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

fn client() -> HttpClient {
    Client::builder(hyper_util::rt::TokioExecutor::new()).build_http()
}

/// A GET of `path` with these headers: the status, the `RateLimit-Policy` field and the body.
async fn get(
    client: &HttpClient,
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> (u16, String, String) {
    let mut request = http::Request::get(format!("http://{addr}{path}"));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = client
        .request(request.body(Empty::new()).unwrap())
        .await
        .unwrap();
    let status = response.status().as_u16();
    let policy = response
        .headers()
        .get("ratelimit-policy")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, policy, String::from_utf8(body.to_vec()).unwrap())
}

/// The statuses of `n` GETs.
async fn statuses(
    client: &HttpClient,
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
    n: usize,
) -> Vec<u16> {
    let mut all = Vec::with_capacity(n);
    for _ in 0..n {
        all.push(get(client, addr, path, headers).await.0);
    }
    all
}

#[tokio::test]
async fn the_tiers_example_limits_by_tier_tenant_and_route_and_reloads_its_file() {
    let dir = std::env::temp_dir().join(format!("tollgate-tiers-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rules = dir.join("tiers.toml");
    let original =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/tiers.toml"))
            .unwrap();
    std::fs::write(&rules, &original).unwrap();
    let example = Example::start(
        "tiers",
        "TOLLGATE_ADDR",
        &[("TOLLGATE_RULES", rules.to_str().unwrap())],
    );
    let (client, addr) = (client(), example.addr.clone());

    let (status, _, version) = get(&client, &addr, "/policy", &[]).await;
    assert_eq!((status, version.as_str()), (200, "2026-12-01.1\n"));
    // No key: the default tier, free, by client IP: 5 per minute.
    let mut expected = vec![200; 5];
    expected.push(429);
    assert_eq!(statuses(&client, &addr, "/", &[], 6).await, expected);
    // Through the (trusted, local) proxy, each anonymous client has a budget of its own.
    let proxied = [("x-forwarded-for", "203.0.113.7")];
    assert_eq!(statuses(&client, &addr, "/", &proxied, 6).await, expected);
    let other_client = [("x-forwarded-for", "203.0.113.8")];
    assert_eq!(get(&client, &addr, "/", &other_client).await.0, 200);
    // free-1 is a tenant of its own in tier free: 5 per minute, not the IP's budget.
    let free = [("authorization", "Bearer free-1")];
    assert_eq!(get(&client, &addr, "/", &free).await.1, "\"free\";q=5;w=60");
    assert_eq!(
        statuses(&client, &addr, "/", &free, 5).await,
        [200, 200, 200, 200, 429]
    );
    // pro-1: tier pro, 50 per minute.
    let pro = [("authorization", "Bearer pro-1")];
    let mut expected = vec![200; 50];
    expected.push(429);
    assert_eq!(
        statuses(&client, &addr, "/search", &pro, 51).await,
        expected
    );
    // acme: tier pro, with an exception of 2 per minute on /search.
    let acme = [("authorization", "Bearer acme-1")];
    assert_eq!(
        get(&client, &addr, "/search", &acme).await.1,
        "\"acme-search\";q=2;w=60"
    );
    assert_eq!(
        statuses(&client, &addr, "/search", &acme, 2).await,
        [200, 429]
    );
    assert_eq!(get(&client, &addr, "/", &acme).await.1, "\"pro\";q=50;w=60");
    // /policy is never limited.
    assert!(
        statuses(&client, &addr, "/policy", &[], 20)
            .await
            .iter()
            .all(|s| *s == 200)
    );

    // Edited live: a new version and a new limit for free apply within two seconds.
    let edited = original
        .replace("version = \"2026-12-01.1\"", "version = \"edited\"")
        .replace(
            "{ name = \"free\", limit = 5, per = \"minute\" }",
            "{ name = \"free-2\", limit = 7, per = \"minute\" }",
        );
    assert_ne!(
        edited, original,
        "examples/tiers.toml changed: update this test"
    );
    let temporary = dir.join("tiers.toml.tmp");
    std::fs::write(&temporary, edited).unwrap();
    std::fs::rename(&temporary, &rules).unwrap();
    let written = Instant::now();
    while get(&client, &addr, "/policy", &[]).await.2 != "edited\n" {
        assert!(
            written.elapsed() < Duration::from_secs(2),
            "the edit was not picked up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(get(&client, &addr, "/", &[]).await.1, "\"free-2\";q=7;w=60");
    // A bad edit keeps the policy in force.
    std::fs::write(&temporary, "version = \"broken\"\ndefault_tier = \n").unwrap();
    std::fs::rename(&temporary, &rules).unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(get(&client, &addr, "/policy", &[]).await.2, "edited\n");

    let printed = example.stop();
    // Denials are logged; the API keys that name tenants are not (nor do they reach the store).
    let denials: Vec<&str> = printed
        .lines()
        .filter(|l| l.contains("request denied"))
        .collect();
    assert!(denials.len() >= 3, "{printed}");
    assert!(
        denials
            .iter()
            .all(|l| !l.contains("free-1") && !l.contains("pro-1")),
        "{denials:#?}"
    );
    assert!(
        printed.contains("curl -i -H 'authorization: Bearer acme-1'"),
        "{printed}"
    );
    assert!(printed.contains("/policy"), "{printed}");
    assert!(printed.contains("Edit "), "{printed}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The replicas example against a Redis of the test's own: its three lines, as its documentation
/// gives them.
#[test]
fn the_replicas_example_admits_the_limit_once_on_redis_with_and_without_leases() {
    let server = support::RedisServer::start();
    let output = std::process::Command::new(support::example::binary("replicas"))
        .env("REDIS_URL", server.url())
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let printed = String::from_utf8(output.stdout).unwrap();
    assert_eq!(
        printed.lines().collect::<Vec<_>>(),
        [
            "store=memory replicas=3 limit=100 sent=300 admitted=300",
            "store=redis replicas=3 limit=100 sent=300 admitted=100",
            "store=redis-lease replicas=3 limit=100 lease=10 sent=300 admitted=100",
        ]
    );
}

/// A POST of `body` as JSON with these headers: the status and the `Retry-After`, if any.
async fn post_json(
    client: &Client<HttpConnector, http_body_util::Full<Bytes>>,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, Option<u64>, http::HeaderMap) {
    let mut request = http::Request::post(url).header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = client
        .request(
            request
                .body(http_body_util::Full::new(Bytes::from(body.to_owned())))
                .unwrap(),
        )
        .await
        .unwrap();
    let retry = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    (
        response.status().as_u16(),
        retry,
        response.headers().clone(),
    )
}

fn json_client() -> Client<HttpConnector, http_body_util::Full<Bytes>> {
    Client::builder(hyper_util::rt::TokioExecutor::new()).build_http()
}

#[tokio::test]
async fn the_tokens_example_settles_what_each_request_used() {
    let example = Example::start("tokens", "TOLLGATE_ADDR", &[]);
    let url = format!("http://{}/complete", example.addr);
    let client = json_client();
    let key = [("x-api-key", "demo")];
    let mut statuses = Vec::new();
    let mut last = None;
    for _ in 0..4 {
        let (status, retry, headers) =
            post_json(&client, &url, &key, r#"{"max_tokens": 4000}"#).await;
        assert!(
            headers.get("x-tokens-used").is_none(),
            "the layer reads and removes it"
        );
        statuses.push(status);
        last = retry;
    }
    assert_eq!(statuses, [200, 200, 200, 429]);
    // The debt (12,000 used of 10,000) and the next estimate (500) at 10,000 per minute: 15 s.
    let retry = last.expect("a Retry-After");
    assert!((15..=16).contains(&retry), "Retry-After {retry}");
    // Another key has its own budget.
    let other = [("x-api-key", "other")];
    assert_eq!(
        post_json(&client, &url, &other, r#"{"max_tokens": 100}"#)
            .await
            .0,
        200
    );
    let printed = example.stop();
    assert!(printed.contains("x-api-key: demo"), "{printed}");
}

#[tokio::test]
async fn the_login_example_locks_an_account_out_after_five_failures_and_hides_its_budget() {
    let example = Example::start("login", "TOLLGATE_ADDR", &[]);
    let url = format!("http://{}/login", example.addr);
    let client = json_client();
    let attempt =
        |email: &str, password: &str| format!(r#"{{"email":"{email}","password":"{password}"}}"#);
    // Successful logins do not spend the failed-logins budget, and no answer tells how many
    // guesses remain.
    for _ in 0..6 {
        let (status, _, headers) = post_json(
            &client,
            &url,
            &[],
            &attempt("carol@example.com", "open-sesame"),
        )
        .await;
        assert_eq!(status, 200);
        assert!(headers.get("ratelimit").is_none(), "{headers:?}");
        assert!(headers.get("ratelimit-policy").is_none(), "{headers:?}");
    }
    // Failures do: the sixth in 15 minutes is refused for (about) the whole 15 minutes, not
    // for the 3 minutes a token bucket would give back one guess in.
    let mut statuses = Vec::new();
    let mut last = None;
    for _ in 0..6 {
        let (status, retry, headers) =
            post_json(&client, &url, &[], &attempt("dave@example.com", "x")).await;
        assert!(headers.get("ratelimit").is_none(), "{headers:?}");
        statuses.push(status);
        last = retry;
    }
    assert_eq!(statuses, [401, 401, 401, 401, 401, 429]);
    let retry = last.expect("a denial carries Retry-After");
    assert!((890..=900).contains(&retry), "Retry-After {retry}");
    // The right password is refused too while the account is locked out.
    let (status, _, _) = post_json(
        &client,
        &url,
        &[],
        &attempt("dave@example.com", "open-sesame"),
    )
    .await;
    assert_eq!(status, 429);
    let printed = example.stop();
    assert!(
        printed.contains("5 failed logins per 15 minutes"),
        "{printed}"
    );
}

#[tokio::test]
async fn the_concurrency_example_admits_five_slow_requests_at_once() {
    let example = Example::start("concurrency", "TOLLGATE_ADDR", &[]);
    let (client, addr) = (client(), example.addr.clone());
    // Twenty at once, as `xargs -P 20 curl` sends them: five take the slots, fifteen are told
    // to come back.
    let all: Vec<_> = (0..20)
        .map(|_| {
            let (client, addr) = (client.clone(), addr.clone());
            tokio::spawn(async move {
                let request = http::Request::get(format!("http://{addr}/slow"))
                    .body(Empty::<Bytes>::new())
                    .unwrap();
                let response = client.request(request).await.unwrap();
                let status = response.status().as_u16();
                let header = |name: &str| {
                    response
                        .headers()
                        .get(name)
                        .map(|v| v.to_str().unwrap().to_owned())
                };
                let (policy, retry) = (header("ratelimit-policy"), header("retry-after"));
                response.into_body().collect().await.unwrap();
                (status, policy, retry)
            })
        })
        .collect();
    let mut answers = Vec::new();
    for request in all {
        answers.push(request.await.unwrap());
    }
    let admitted = answers.iter().filter(|(s, ..)| *s == 200).count();
    let denied: Vec<_> = answers.iter().filter(|(s, ..)| *s == 429).collect();
    assert_eq!((admitted, denied.len()), (5, 15), "{answers:?}");
    for (_, policy, retry) in denied {
        assert_eq!(
            policy.as_deref(),
            Some(r#""slow";q=5;qu="concurrent-requests""#)
        );
        assert_eq!(retry.as_deref(), Some("1"));
    }
    // The slots came back with the bodies: five more at once are admitted.
    let again: Vec<_> = (0..5)
        .map(|_| {
            let (client, addr) = (client.clone(), addr.clone());
            tokio::spawn(async move { get(&client, &addr, "/slow", &[]).await.0 })
        })
        .collect();
    for request in again {
        assert_eq!(request.await.unwrap(), 200);
    }
    // `/` is not limited.
    assert_eq!(statuses(&client, &addr, "/", &[], 30).await, vec![200; 30]);

    // `/work`: 50 clients in closed loops, 400 requests in all, against 8 workers of 50 ms.
    let loops: Vec<_> = (0..50)
        .map(|_| {
            let (client, addr) = (client.clone(), addr.clone());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                for _ in 0..8 {
                    seen.push(get(&client, &addr, "/work", &[]).await.0);
                }
                seen
            })
        })
        .collect();
    let mut seen = Vec::new();
    for one in loops {
        seen.extend(one.await.unwrap());
    }
    let served = seen.iter().filter(|s| **s == 200).count();
    let shed = seen.iter().filter(|s| **s == 503).count();
    assert_eq!(served + shed, 400, "only 200s and 503s: {seen:?}");
    assert!(served > 0 && shed > 0, "{served} served, {shed} shed");
    let capacity = get(&client, &addr, "/capacity", &[]).await.2;
    let learned: usize = capacity
        .strip_prefix("capacity ")
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{capacity:?}"));
    assert!((4..=64).contains(&learned), "{capacity}");
    assert!(capacity.ends_with("of 64, 0 in flight\n"), "{capacity:?}");
    let printed = example.stop();
    assert!(printed.contains("xargs -P 20"), "{printed}");
    assert!(printed.contains("/capacity"), "{printed}");
}

#[test]
fn the_client_example_waits_out_the_servers_delays_instead_of_hammering_it() {
    let output = std::process::Command::new(support::example::binary("client"))
        .env("TOLLGATE_CALLS", "5")
        .env_remove("TOLLGATE_URL")
        .output()
        .unwrap();
    let printed = String::from_utf8(output.stdout).unwrap();
    assert!(output.status.success(), "{printed}");
    // 3 per 3 s: the calls past the third wait for their unit; the server denies none.
    assert!(printed.contains("the client received 0 429s"), "{printed}");
    assert!(
        printed.contains("the server served 5 and denied 0"),
        "{printed}"
    );
    assert_eq!(printed.matches("200 OK").count(), 5, "{printed}");
}

#[cfg(feature = "tonic")]
#[tokio::test]
async fn the_grpc_interceptor_example_allows_ten_calls_a_minute_per_peer() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

    let example = Example::start("grpc_interceptor", "TOLLGATE_GRPC_ADDR", &[]);
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", example.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = HealthClient::new(channel);
    let mut codes = Vec::new();
    for _ in 0..11 {
        let reply = client
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await;
        codes.push(reply.map_or_else(|status| status.code(), |_| tonic::Code::Ok));
    }
    let mut expected = vec![tonic::Code::Ok; 10];
    expected.push(tonic::Code::ResourceExhausted);
    assert_eq!(codes, expected);
    let printed = example.stop();
    assert!(printed.contains("grpcurl -plaintext"), "{printed}");
}

/// A streamed POST: the data events of `tokens` and whether it ended with `done`, or the data
/// of its final `error` event.
async fn stream_events(
    client: &Client<HttpConnector, http_body_util::Full<Bytes>>,
    url: &str,
    key: &str,
    max_tokens: u64,
) -> (u16, u64, bool, Option<serde_json::Value>) {
    let request = http::Request::post(url)
        .header("content-type", "application/json")
        .header("x-api-key", key)
        .body(http_body_util::Full::new(Bytes::from(format!(
            "{{\"max_tokens\": {max_tokens}}}"
        ))))
        .unwrap();
    let response = client.request(request).await.unwrap();
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8(body.to_vec()).unwrap();
    let mut tokens = 0;
    let mut done = false;
    let mut error = None;
    for event in text.split("\n\n").filter(|e| !e.is_empty()) {
        if event.starts_with("data: {\"index\"") {
            tokens += 1;
        } else if event.starts_with("event: done") {
            done = true;
        } else if let Some(data) = event.strip_prefix("event: error\ndata: ") {
            // The data line, then the `retry` field.
            let data = data.lines().next().unwrap_or_default();
            error = Some(serde_json::from_str(data).expect("a JSON problem"));
        }
    }
    (status, tokens, done, error)
}

#[tokio::test]
async fn the_stream_example_cuts_the_third_stream_at_the_budget() {
    let example = Example::start("stream", "TOLLGATE_ADDR", &[]);
    let url = format!("http://{}/v1/completions", example.addr);
    let client = json_client();
    let started = Instant::now();
    for stream in 0..2 {
        let (status, tokens, done, error) = stream_events(&client, &url, "demo", 4000).await;
        assert_eq!((status, tokens, done), (200, 4000, true), "stream {stream}");
        assert!(error.is_none());
    }
    let (status, tokens, done, error) = stream_events(&client, &url, "demo", 4000).await;
    // 2,000 left, plus what refilled meanwhile (10,000 a minute), within one chunk of 500.
    let refilled = (started.elapsed().as_secs_f64() * 10_000.0 / 60.0).ceil() as u64;
    assert_eq!(status, 200);
    assert!(!done, "the third stream is cut");
    assert!(
        (1_500..=2_500 + refilled).contains(&tokens),
        "{tokens} tokens, {refilled} refilled"
    );
    let problem = error.expect("a final error event");
    assert_eq!(problem["status"], 429);
    assert_eq!(problem["violated-policies"][0], "tokens");
    // Another key has its own budget.
    let (_, other, done, _) = stream_events(&client, &url, "other", 20).await;
    assert_eq!((other, done), (20, true));
    let printed = example.stop();
    assert!(printed.contains("/v1/completions"), "{printed}");
    assert!(printed.contains("x-api-key: demo"), "{printed}");
}
