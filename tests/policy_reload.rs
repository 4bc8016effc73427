//! Live reload on a running server: reloads under load fail no request, a change applies
//! within two seconds of the write, a bad or missing file keeps the policy in force, and counts
//! survive a reload for every rule that keeps its name and algorithm (a reload that changes
//! how a rule's budget is kept says so).

mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use tollgate::policy::{FileSource, Policy, PolicyHandle, Tier};
use tollgate::{Quota, RateLimitLayer, Rule};

/// A rules file with one tier, `limit` per minute under the rule name `rule`.
fn rules(version: &str, rule: &str, limit: u64) -> String {
    format!(
        "version = \"{version}\"\ndefault_tier = \"free\"\n\n[tiers.free]\n\
         rules = [{{ name = \"{rule}\", limit = {limit}, per = \"minute\" }}]\n"
    )
}

/// Replaces the file at once, as a deployment does (write, then rename over it).
fn write(path: &Path, text: &str) {
    let temporary = path.with_extension("tmp");
    std::fs::write(&temporary, text).unwrap();
    std::fs::rename(&temporary, path).unwrap();
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("tollgate-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A server on a free loopback port, limited by the rules in `path`; its address and the
/// layer's policy handle.
async fn serve(path: &Path, interval: Duration) -> (SocketAddr, PolicyHandle) {
    let layer = RateLimitLayer::builder()
        .policy_source(FileSource::new(path).interval(interval))
        .build()
        .unwrap();
    let handle = layer.policy_handle().unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(layer);
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
    (addr, handle)
}

fn client() -> Client<HttpConnector, Empty<Bytes>> {
    Client::builder(hyper_util::rt::TokioExecutor::new()).build_http()
}

/// The status and `RateLimit-Policy` of a GET of `/`.
async fn get_policy(
    client: &Client<HttpConnector, Empty<Bytes>>,
    addr: SocketAddr,
) -> (u16, String) {
    let res = client
        .get(format!("http://{addr}/").parse().unwrap())
        .await
        .unwrap();
    let policy = res
        .headers()
        .get("ratelimit-policy")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (res.status().as_u16(), policy)
}

/// Waits up to `within` for the version in force to become `version`; how long it took.
async fn until_version(handle: &PolicyHandle, version: &str, within: Duration) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < within {
        if handle.version() == version {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

/// The `error` events of target `tollgate::policy`, from every thread (the polling thread
/// logs): a global collector for this test binary, installed once.
#[derive(Clone, Default)]
struct PolicyErrors(Arc<std::sync::Mutex<Vec<String>>>);

impl PolicyErrors {
    fn install() -> PolicyErrors {
        static ERRORS: std::sync::OnceLock<PolicyErrors> = std::sync::OnceLock::new();
        ERRORS
            .get_or_init(|| {
                let errors = PolicyErrors::default();
                let writer = errors.clone();
                let subscriber = tracing_subscriber::fmt()
                    .with_max_level(tracing::Level::ERROR)
                    .with_ansi(false)
                    .with_writer(move || writer.clone())
                    .finish();
                tracing::subscriber::set_global_default(subscriber).unwrap();
                errors
            })
            .clone()
    }

    /// The lines that name `file` (the tests run in parallel, each with its own file).
    fn lines_about(&self, file: &str) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|line| line.contains("tollgate::policy") && line.contains(file))
            .cloned()
            .collect()
    }
}

impl std::io::Write for PolicyErrors {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap()
            .push(String::from_utf8_lossy(bytes).into_owned());
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_reloads_under_load_fail_no_request() {
    let dir = TempDir::new("reload-load");
    let path = dir.0.join("rules.toml");
    write(&path, &rules("v0", "api", 1_000_000));
    let (addr, handle) = serve(&path, Duration::from_millis(20)).await;

    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut load = Vec::new();
    for _ in 0..4 {
        let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
        let client = client();
        load.push(tokio::spawn(async move {
            // Bounded: stops when told, or after 100,000 requests.
            for _ in 0..100_000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                match client.get(format!("http://{addr}/").parse().unwrap()).await {
                    Ok(res) if res.status() == 200 => ok.fetch_add(1, Ordering::Relaxed),
                    _ => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }
    for n in 1..=100 {
        let version = format!("v{n}");
        // Alternate the quota and the rule's name, so that each reload changes the rules.
        let rule = if n % 2 == 0 { "api" } else { "api-odd" };
        write(&path, &rules(&version, rule, 1_000_000 + n));
        assert!(
            until_version(&handle, &version, Duration::from_secs(5))
                .await
                .is_some(),
            "reload {n} was not installed"
        );
    }
    stop.store(true, Ordering::Relaxed);
    for task in load {
        task.await.unwrap();
    }
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    assert_eq!(failed, 0, "{failed} failed requests out of {}", ok + failed);
    assert!(ok > 100, "only {ok} requests flowed during the reloads");
    assert_eq!(handle.installed(), 100);
    assert_eq!(handle.rejected(), 0);
}

#[tokio::test]
async fn a_changed_quota_applies_within_two_seconds_of_the_write() {
    let dir = TempDir::new("reload-quota");
    let path = dir.0.join("rules.toml");
    // A fixed window counts units, so the count kept across the reload is exact.
    let hourly = |version: &str, limit: u64| {
        format!(
            "version = \"{version}\"\ndefault_tier = \"free\"\n[tiers.free]\n\
             rules = [{{ name = \"api\", limit = {limit}, per = \"hour\", algorithm = \"fixed-window\" }}]\n"
        )
    };
    write(&path, &hourly("v1", 100));
    // The default interval, one second.
    let (addr, handle) = serve(&path, Duration::from_secs(1)).await;
    let client = client();
    assert_eq!(
        get_policy(&client, addr).await,
        (200, "\"api\";q=100;w=3600".to_owned())
    );
    write(&path, &hourly("v2", 3));
    let written = Instant::now();
    let mut answers = Vec::new();
    loop {
        let (status, policy) = get_policy(&client, addr).await;
        if policy == "\"api\";q=3;w=3600" {
            break;
        }
        answers.push(status);
        assert!(
            written.elapsed() < Duration::from_secs(2),
            "the new quota did not apply within 2 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(handle.version(), "v2");
    // The client had used some of its 100 under v1: the same rule keeps the count, so under v2
    // it has what is left of 3.
    let used = 1 + answers.len() as u64 + 1;
    let mut admitted = 0;
    for _ in 0..5 {
        if get_policy(&client, addr).await.0 == 200 {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 3u64.saturating_sub(used));
}

#[tokio::test]
async fn a_bad_or_missing_file_keeps_the_policy_in_force_until_a_good_one() {
    let errors = PolicyErrors::install();
    let dir = TempDir::new("reload-bad");
    let path = dir.0.join("rules.toml");
    write(&path, &rules("good-1", "api", 2));
    let interval = Duration::from_millis(20);
    let (addr, handle) = serve(&path, interval).await;
    let client = client();
    let bad_files = [
        ("syntax", "version = \"bad-1\"\ndefault_tier = \n".to_owned()),
        (
            "no default tier",
            "version = \"bad-2\"\n[tiers.free]\nrules = [{ name = \"api\", limit = 50, per = \"minute\" }]\n"
                .to_owned(),
        ),
        ("deleted", String::new()),
    ];
    let mut rejected = 0;
    for (what, text) in bad_files {
        if text.is_empty() {
            std::fs::remove_file(&path).unwrap();
        } else {
            write(&path, &text);
        }
        let start = Instant::now();
        while handle.rejected() == rejected && start.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(interval).await;
        }
        // Ten more polls see the same bad version: it is counted and logged once.
        tokio::time::sleep(interval * 10).await;
        assert_eq!(handle.rejected(), rejected + 1, "{what}: counted once");
        rejected = handle.rejected();
        assert_eq!(
            handle.version(),
            "good-1",
            "{what}: the policy in force changed"
        );
        let (_, policy) = get_policy(&client, addr).await;
        assert_eq!(policy, "\"api\";q=2;w=60", "{what}");
    }
    let logged = errors.lines_about(&path.display().to_string());
    assert_eq!(
        logged.len(),
        3,
        "one error line per bad version: {logged:#?}"
    );
    assert!(
        logged[0].contains("expected"),
        "the syntax error: {}",
        logged[0]
    );
    assert!(
        logged[1].contains("default_tier"),
        "no default tier: {}",
        logged[1]
    );
    assert!(
        logged[2].contains("cannot read"),
        "the deleted file: {}",
        logged[2]
    );
    // The client used 3 of 2 under good-1: limited.
    assert_eq!(get_policy(&client, addr).await.0, 429);
    write(&path, &rules("good-2", "api-2", 10));
    assert!(
        until_version(&handle, "good-2", Duration::from_secs(5))
            .await
            .is_some()
    );
    // A renamed rule is a new budget.
    assert_eq!(
        get_policy(&client, addr).await,
        (200, "\"api-2\";q=10;w=60".to_owned())
    );
}

#[tokio::test]
async fn counts_survive_a_reload_that_keeps_the_rule_and_a_bad_install_is_refused() {
    let policy = |version: &str, limit: u64| {
        Policy::new(version)
            .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(limit))))
            .default_tier("free")
    };
    let layer = RateLimitLayer::builder()
        .policy_source(policy("v1", 5))
        .build()
        .unwrap();
    let handle = layer.policy_handle().unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
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
    let client = client();
    for _ in 0..3 {
        assert_eq!(get_policy(&client, addr).await.0, 200);
    }
    handle.install(policy("v2", 5)).unwrap();
    assert_eq!(handle.version(), "v2");
    let statuses: Vec<u16> = {
        let mut s = Vec::new();
        for _ in 0..3 {
            s.push(get_policy(&client, addr).await.0);
        }
        s
    };
    assert_eq!(statuses, [200, 200, 429]);
    // A policy that does not build is refused, and says why.
    let error = handle
        .install(
            Policy::new("v3").tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(9)))),
        )
        .unwrap_err();
    assert!(error.to_string().contains("no default tier"), "{error}");
    assert_eq!(handle.version(), "v2");
    assert_eq!((handle.installed(), handle.rejected()), (1, 1));
}

/// The `warn` lines logged on this thread while `f` runs.
fn warnings_during(f: impl FnOnce()) -> Vec<String> {
    let lines = PolicyErrors::default();
    let writer = lines.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    let lines = lines.0.lock().unwrap().clone();
    lines
        .into_iter()
        .filter(|line| line.contains("WARN"))
        .collect()
}

fn hot_policy(version: &str, split: Option<u16>) -> Policy {
    let mut rule = Rule::new("hot", Quota::per_minute(100));
    if let Some(parts) = split {
        rule = rule.split(parts);
    }
    Policy::new(version)
        .tier(Tier::new("free").rule(rule))
        .default_tier("free")
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn a_reload_that_adds_or_changes_a_split_says_that_the_budget_starts_again() {
    let store = tollgate::store::RedisStore::builder(support::standalone().url())
        .prefix(support::unique_prefix("split-reload"))
        .connect()
        .await
        .unwrap();
    let layer = RateLimitLayer::builder()
        .policy_source(hot_policy("v1", None))
        .store(store)
        .build()
        .unwrap();
    let handle = layer.policy_handle().unwrap();
    // The same rule again: nothing to say.
    let same = warnings_during(|| handle.install(hot_policy("v2", None)).unwrap());
    assert!(same.is_empty(), "{same:#?}");
    for (version, split, was) in [
        ("v3", Some(4), "not split"),
        ("v4", Some(2), "split into 4"),
        ("v5", None, "split into 2"),
    ] {
        let said = warnings_during(|| handle.install(hot_policy(version, split)).unwrap());
        assert_eq!(handle.version(), version);
        assert_eq!(said.len(), 1, "{said:#?}");
        assert!(
            said[0].contains("\"hot\"") && said[0].contains(was) && said[0].contains("full"),
            "{}",
            said[0]
        );
    }
}

#[tokio::test]
async fn the_memory_store_keeps_a_split_rules_budget_and_says_nothing() {
    let layer = RateLimitLayer::builder()
        .policy_source(hot_policy("v1", None))
        .build()
        .unwrap();
    let handle = layer.policy_handle().unwrap();
    let said = warnings_during(|| handle.install(hot_policy("v2", Some(4))).unwrap());
    assert!(said.is_empty(), "{said:#?}");
}

/// A Kubernetes ConfigMap volume: `rules.toml -> ..data/rules.toml`, `..data -> ..<timestamp>`;
/// an update writes a new directory and renames a new `..data` symlink over the old one.
#[cfg(unix)]
#[tokio::test]
async fn a_configmap_swap_to_a_file_of_the_same_size_and_mtime_is_reloaded() {
    use std::os::unix::fs::symlink;
    let dir = TempDir::new("reload-configmap");
    let modified = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_292_000);
    let version = |name: &str, limit: u64| {
        let data = dir.0.join(name);
        std::fs::create_dir(&data).unwrap();
        let file = data.join("rules.toml");
        std::fs::write(&file, rules("v1", "free", limit)).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&file)
            .unwrap()
            .set_modified(modified)
            .unwrap();
    };
    version("..2026_12_07_10_00_00.1", 5);
    symlink("..2026_12_07_10_00_00.1", dir.0.join("..data")).unwrap();
    symlink("..data/rules.toml", dir.0.join("rules.toml")).unwrap();
    let (addr, _handle) = serve(&dir.0.join("rules.toml"), Duration::from_millis(20)).await;
    let client = client();
    assert_eq!(get_policy(&client, addr).await.1, "\"free\";q=5;w=60");

    // Same version, same size, same modification time; only the limit differs.
    version("..2026_12_07_10_05_00.2", 8);
    let old = std::fs::metadata(dir.0.join("rules.toml")).unwrap();
    let new = std::fs::metadata(dir.0.join("..2026_12_07_10_05_00.2/rules.toml")).unwrap();
    assert_eq!(
        (old.len(), old.modified().unwrap()),
        (new.len(), new.modified().unwrap())
    );
    symlink("..2026_12_07_10_05_00.2", dir.0.join("..data_tmp")).unwrap();
    std::fs::rename(dir.0.join("..data_tmp"), dir.0.join("..data")).unwrap();
    std::fs::remove_dir_all(dir.0.join("..2026_12_07_10_00_00.1")).unwrap();
    let swapped = Instant::now();
    while get_policy(&client, addr).await.1 != "\"free\";q=8;w=60" {
        assert!(
            swapped.elapsed() < Duration::from_secs(2),
            "the swapped file was not reloaded"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
