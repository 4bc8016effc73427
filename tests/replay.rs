//! Replay: recorded traffic through a real layer, its report held against a brute-force count
//! of the same rules, and the errors of bad traffic.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::time::Duration;

use tollgate::RateLimitLayer;
use tollgate::clock::ManualClock;
use tollgate::policy::{Policy, Tenant, TenantFromHeader};
use tollgate::replay::{Arrival, Counts, Format, Replay, ReplayError, Traffic};
use tollgate::store::MemoryStore;

const TIERS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/tiers.toml");

/// The tenants of `examples/tiers.rs`: `free-N` and `pro-N` are tenants of their tier,
/// `acme-N` all the tenant `acme`; other keys are no tenant.
fn tenant_of_api_key(key: &str) -> Option<Tenant> {
    let (prefix, rest) = key.split_once('-')?;
    if rest.is_empty() {
        return None;
    }
    match prefix {
        "free" | "pro" => Some(Tenant::new(key).with_tier(prefix)),
        "acme" => Some(Tenant::new("acme")),
        _ => None,
    }
}

fn replay_of_tiers(clock: &ManualClock) -> Replay<MemoryStore> {
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .build()
        .expect("store");
    let builder = RateLimitLayer::builder()
        .policy(Policy::from_file(TIERS).expect("examples/tiers.toml"))
        .tenant(TenantFromHeader::new("x-api-key").lookup(tenant_of_api_key))
        .store(store);
    Replay::new(builder).clock(clock.clone()).routes(["/"])
}

/// A seeded generator (xorshift64*): the same file on every run.
struct Seeded(u64);

impl Seeded {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// A JSON-lines file of `lines` requests over about half an hour: free, pro and acme keys,
/// unknown keys and no key (by client IP), on `/`, `/search` and a path no route serves.
fn recorded_file(lines: usize) -> PathBuf {
    let path = std::env::temp_dir().join(format!("tollgate-replay-{}.jsonl", std::process::id()));
    let mut file = std::io::BufWriter::new(std::fs::File::create(&path).expect("temp file"));
    let mut random = Seeded(0x5eed_1234_abcd_0001);
    let mut millis: u64 = 1_796_292_000_000;
    for _ in 0..lines {
        // Gaps of 0 to 36 ms, some at the same millisecond.
        millis += random.below(37);
        let key = match random.below(10) {
            0..=3 => Some(format!("free-{}", random.below(200))),
            // A few busy pro tenants: most requests on 5 keys.
            4..=6 => Some(format!("pro-{}", random.below(5) * random.below(10))),
            7 => Some(format!("acme-{}", random.below(5))),
            8 => Some(format!("other-{}", random.below(3))),
            _ => None,
        };
        let path = match random.below(4) {
            0 | 1 => "/search?q=x",
            2 => "/",
            _ => "/unrouted",
        };
        let method = if random.below(8) == 0 { "POST" } else { "GET" };
        let ip = format!("198.51.100.{}", random.below(250));
        let seconds = format!("{}.{:03}", millis / 1000, millis % 1000);
        let key = key.map_or(String::new(), |k| format!(", \"key\": \"{k}\""));
        writeln!(
            file,
            "{{\"time\": {seconds}, \"ip\": \"{ip}\", \"method\": \"{method}\", \"path\": \"{path}\"{key}}}"
        )
        .expect("write");
    }
    file.flush().expect("flush");
    path
}

/// The token bucket of the rules file, counted another way: a level of microseconds that
/// fills at one per microsecond up to `burst × interval`; a request takes `interval`.
struct Bucket {
    level: u64,
    at: u64,
}

/// What the rules of `examples/tiers.toml` make of the file, counted by brute force.
#[derive(Default)]
struct Expected {
    total: Counts,
    rules: BTreeMap<String, Counts>,
    tiers: BTreeMap<String, Counts>,
    tenants: BTreeMap<String, Counts>,
    routes: BTreeMap<String, Counts>,
}

fn count(map: &mut BTreeMap<String, Counts>, name: &str, admitted: bool) {
    let counts = map.entry(name.to_owned()).or_default();
    counts.requests += 1;
    counts.admitted += u64::from(admitted);
    counts.denied += u64::from(!admitted);
}

fn brute_force(arrivals: &[Arrival]) -> Expected {
    let mut buckets: BTreeMap<(String, &str), Bucket> = BTreeMap::new();
    let mut expected = Expected::default();
    for arrival in arrivals {
        let micros = u64::try_from(arrival.at.as_micros()).unwrap();
        let tenant = arrival.key.as_deref().and_then(tenant_of_api_key);
        let route = arrival.path.split('?').next().unwrap();
        let (tier, rule, identity, per_minute) = match &tenant {
            Some(t) if t.id() == "acme" && route == "/search" => {
                ("pro", "acme-search", "acme".to_owned(), 2)
            }
            Some(t) if t.id() == "acme" => ("pro", "pro", "acme".to_owned(), 50),
            Some(t) if t.id().starts_with("pro-") => ("pro", "pro", t.id().to_owned(), 50),
            Some(t) => ("free", "free", t.id().to_owned(), 5),
            None => ("free", "free", arrival.ip.unwrap().to_string(), 5),
        };
        let interval = 60_000_000 / per_minute;
        let full = per_minute * interval;
        let bucket = buckets.entry((identity, rule)).or_insert(Bucket {
            level: full,
            at: micros,
        });
        bucket.level = (bucket.level + (micros - bucket.at)).min(full);
        bucket.at = micros;
        let admitted = bucket.level >= interval;
        if admitted {
            bucket.level -= interval;
        }

        expected.total.requests += 1;
        expected.total.admitted += u64::from(admitted);
        expected.total.denied += u64::from(!admitted);
        count(&mut expected.rules, rule, admitted);
        count(&mut expected.tiers, tier, admitted);
        if let Some(tenant) = &tenant {
            count(&mut expected.tenants, tenant.id(), admitted);
        }
        if route != "/unrouted" {
            count(&mut expected.routes, route, admitted);
        }
    }
    expected
}

#[tokio::test]
async fn a_recorded_file_of_100000_lines_replays_to_the_brute_force_count() {
    let path = recorded_file(100_000);
    let arrivals: Vec<Arrival> = Traffic::open(&path)
        .expect("open")
        .collect::<Result<_, _>>()
        .expect("every line reads");
    assert_eq!(arrivals.len(), 100_000);
    let expected = brute_force(&arrivals);

    let clock = ManualClock::default();
    let report = replay_of_tiers(&clock)
        .run_traffic(Traffic::open(&path).expect("open"))
        .await
        .expect("replay");
    std::fs::remove_file(&path).ok();

    // The traffic tests something: every rule admits and denies.
    for rule in ["free", "pro", "acme-search"] {
        let counts = expected.rules[rule];
        assert!(
            counts.admitted > 50 && counts.denied > 50,
            "{rule}: {counts:?} of {:?}",
            expected.rules
        );
    }
    assert_eq!(report.total, expected.total, "{report}");
    assert_eq!(report.rules, expected.rules, "{report}");
    assert_eq!(report.tiers, expected.tiers, "{report}");
    assert_eq!(report.tenants, expected.tenants);
    assert_eq!(report.routes, expected.routes, "{report}");
    assert_eq!(report.verdicts["allowed"], expected.total.admitted);
    assert_eq!(report.verdicts["denied"], expected.total.denied);
}

#[tokio::test]
async fn the_same_traffic_gives_the_same_decisions_twice() {
    let traffic: Vec<Arrival> = (0..400u64)
        .map(|n| {
            Arrival::get(Duration::from_millis(n * 250), "/search")
                .ip(IpAddr::V4(Ipv4Addr::new(192, 0, 2, (n % 7) as u8)))
                .key(format!("acme-{}", n % 3))
        })
        .collect();
    let mut runs = Vec::new();
    for _ in 0..2 {
        let clock = ManualClock::default();
        let report = replay_of_tiers(&clock)
            .keep_decisions(true)
            .run(traffic.clone())
            .await
            .expect("replay");
        let decisions: Vec<(u16, bool, Duration)> = report
            .decisions
            .iter()
            .map(|d| (d.status.as_u16(), d.admitted, d.at))
            .collect();
        runs.push(decisions);
    }
    assert_eq!(runs[0], runs[1]);
    // 100 s of acme searches at 2 a minute: a burst of 2, then one every 30 s.
    let admitted = runs[0].iter().filter(|d| d.1).count();
    assert_eq!(admitted, 2 + 3);
    assert!(runs[0].iter().all(|d| d.0 == 200 || d.0 == 429));
}

#[tokio::test]
async fn a_malformed_line_stops_the_replay_with_its_line_number() {
    let text = "{\"time\": 1, \"path\": \"/\"}\n{\"time\": 2, \"path\": \"/\"}\n\n{\"time\": 3, \"path\": \"/\", \"ip\": \"300.1.1.1\"}\n{\"time\": 4, \"path\": \"/\"}\n";
    let clock = ManualClock::default();
    let error = replay_of_tiers(&clock)
        .run_traffic(Traffic::new(text.as_bytes(), Format::JsonLines))
        .await
        .unwrap_err();
    match &error {
        ReplayError::Traffic(e) => assert_eq!(e.line, Some(4), "{error}"),
        other => panic!("not a traffic error: {other}"),
    }
    assert!(error.to_string().contains("line 4"), "{error}");
    assert!(error.to_string().contains("300.1.1.1"), "{error}");
}

#[tokio::test]
async fn traffic_out_of_time_order_is_an_error_naming_the_line() {
    let text = "time,path\n10,/\n12,/\n11.5,/\n";
    let clock = ManualClock::default();
    let error = replay_of_tiers(&clock)
        .run_traffic(Traffic::new(text.as_bytes(), Format::Csv))
        .await
        .unwrap_err();
    assert!(
        matches!(&error, ReplayError::OutOfOrder { place, by } if place == "line 4" && *by == Duration::from_millis(500)),
        "{error}"
    );
}

#[tokio::test]
async fn an_access_log_replays_by_client_ip() {
    // Seven requests from one client within a minute (free: 5 a minute), one from another.
    let mut log = String::new();
    for second in 0..7 {
        log.push_str(&format!(
            "203.0.113.7 - - [03/Dec/2026:10:00:{second:02} +0000] \"GET /search?q={second} HTTP/1.1\" 200 12 \"-\" \"curl/8\"\n"
        ));
    }
    log.push_str("203.0.113.8 - - [03/Dec/2026:10:00:09 +0000] \"GET / HTTP/1.1\" 200 12\n");
    let clock = ManualClock::default();
    let report = replay_of_tiers(&clock)
        .keep_decisions(true)
        .run_traffic(Traffic::new(log.as_bytes(), Format::AccessLog))
        .await
        .expect("replay");
    assert_eq!(report.rule("free").admitted, 6);
    assert_eq!(report.rule("free").denied, 2);
    assert_eq!(report.route("/search").denied, 2);
    assert_eq!(report.route("/").admitted, 1);
    let denied_lines: Vec<_> = report
        .decisions
        .iter()
        .filter(|d| !d.admitted)
        .map(|d| d.line)
        .collect();
    assert_eq!(denied_lines, [Some(6), Some(7)]);
    assert!(report.tenants.is_empty());
}

#[tokio::test]
async fn a_route_axum_refuses_is_an_error_not_a_panic() {
    let clock = ManualClock::default();
    let error = replay_of_tiers(&clock)
        .routes(["no-slash"])
        .run([Arrival::get(Duration::ZERO, "/")])
        .await
        .unwrap_err();
    assert!(
        matches!(&error, ReplayError::Route { route, .. } if route == "no-slash"),
        "{error}"
    );
}

#[tokio::test]
async fn delay_rules_on_a_moved_clock_are_refused_by_name() {
    let clock = ManualClock::default();
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .build()
        .expect("store");
    let builder = RateLimitLayer::builder()
        .rule(
            tollgate::Rule::new("smooth", tollgate::Quota::per_second(5))
                .delay(Duration::from_secs(1)),
        )
        .store(store);
    let error = Replay::new(builder)
        .clock(clock)
        .run([Arrival::get(Duration::ZERO, "/")])
        .await
        .unwrap_err();
    assert!(
        matches!(&error, ReplayError::Config(_)) && error.to_string().contains("\"smooth\""),
        "{error}"
    );
}

#[tokio::test]
async fn fixed_windows_begin_where_they_began_in_service() {
    // 60 requests from 10:00:59.5 to 10:01:00.5 against 50 a minute in fixed windows: in service
    // they fall in two windows and all pass. Replayed on a clock moved to another origin, they
    // would fall in one and 10 would be denied.
    let start = 1_796_292_059_500u64; // 2026-12-03T10:00:59.500Z, in milliseconds
    let traffic: Vec<Arrival> = (0..60u64)
        .map(|n| {
            Arrival::get(Duration::from_millis(start + n * 1000 / 60), "/")
                .ip(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)))
        })
        .collect();
    let clock = ManualClock::default();
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .build()
        .expect("store");
    let builder = RateLimitLayer::builder()
        .rule(
            tollgate::Rule::new("fixed", tollgate::Quota::per_minute(50))
                .algorithm(tollgate::Algorithm::FixedWindow),
        )
        .store(store);
    let report = Replay::new(builder)
        .clock(clock)
        .run(traffic)
        .await
        .expect("replay");
    assert_eq!(report.total.admitted, 60, "{report}");
}

#[tokio::test]
async fn an_access_log_out_of_order_within_the_window_replays_in_time_order() {
    // Lines written when each request ended: the slow one (10:00:00) after two later ones.
    let log = "203.0.113.7 - - [03/Dec/2026:10:00:01 +0000] \"GET / HTTP/1.1\" 200 1\n\
               203.0.113.7 - - [03/Dec/2026:10:00:02 +0000] \"GET / HTTP/1.1\" 200 1\n\
               203.0.113.7 - - [03/Dec/2026:10:00:00 +0000] \"GET /search HTTP/1.1\" 200 1\n\
               203.0.113.7 - - [03/Dec/2026:10:00:03 +0000] \"GET / HTTP/1.1\" 200 1\n";
    let clock = ManualClock::default();
    let report = replay_of_tiers(&clock)
        .reorder_within(Duration::from_secs(2))
        .keep_decisions(true)
        .run_traffic(Traffic::new(log.as_bytes(), Format::AccessLog))
        .await
        .expect("replay");
    let lines: Vec<_> = report.decisions.iter().map(|d| d.line).collect();
    assert_eq!(lines, [Some(3), Some(1), Some(2), Some(4)]);

    // Further back than the window: an error naming the line.
    let clock = ManualClock::default();
    let error = replay_of_tiers(&clock)
        .reorder_within(Duration::from_secs(1))
        .run_traffic(Traffic::new(log.as_bytes(), Format::AccessLog))
        .await
        .unwrap_err();
    assert!(
        matches!(&error, ReplayError::OutOfOrder { place, by } if place == "line 3" && *by == Duration::from_secs(2)),
        "{error}"
    );
}

/// A replay of `rule` alone, on a memory store of its own and a clock it moves.
fn replay_of(rule: tollgate::Rule) -> Replay<MemoryStore> {
    let clock = ManualClock::default();
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .build()
        .expect("store");
    let builder = RateLimitLayer::builder().rule(rule).store(store);
    Replay::new(builder).clock(clock)
}

#[tokio::test]
async fn a_login_rule_is_predicted_with_the_statuses_the_service_answered() {
    // 10 logins from one address within a second, recorded as the service answered them with 5
    // failed logins allowed a minute: 5 wrong passwords (401), then 5 refused (429).
    let start = 1_796_292_000_000u64;
    let mut log = String::new();
    for n in 0..10u64 {
        let status = if n < 5 { 401 } else { 429 };
        log.push_str(&format!(
            "{{\"time\": {}.{:03}, \"ip\": \"203.0.113.7\", \"method\": \"POST\", \"path\": \"/login\", \"status\": {status}}}\n",
            (start + n * 100) / 1000,
            (start + n * 100) % 1000,
        ));
    }
    let failed_logins = tollgate::Rule::new("failed-logins", tollgate::Quota::per_minute(5))
        .algorithm(tollgate::Algorithm::FixedWindow)
        .charge_on_status([401]);
    let report = replay_of(failed_logins)
        .keep_decisions(true)
        .run_traffic(Traffic::new(log.as_bytes(), Format::JsonLines))
        .await
        .expect("replay");
    assert_eq!(report.rule("failed-logins").denied, 5, "{report}");
    assert_eq!(report.total.admitted, 5, "{report}");
    // Each request answered as it was in service.
    let statuses: Vec<u16> = report.decisions.iter().map(|d| d.status.as_u16()).collect();
    assert_eq!(statuses, [401, 401, 401, 401, 401, 429, 429, 429, 429, 429]);
}

#[tokio::test]
async fn an_arrival_recorded_as_refused_is_answered_ok_when_the_new_rules_admit_it() {
    // Recorded as refused by the limits of the day, admitted by looser rules: what the service
    // would have answered is not in the record, so it is answered 200 and its charge kept.
    let logins =
        tollgate::Rule::new("logins", tollgate::Quota::per_minute(100)).charge_on_status([200]);
    let report = replay_of(logins)
        .keep_decisions(true)
        .run((0..3u64).map(|n| {
            Arrival::get(Duration::from_millis(n), "/login")
                .ip(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)))
                .status(429)
        }))
        .await
        .expect("replay");
    let statuses: Vec<u16> = report.decisions.iter().map(|d| d.status.as_u16()).collect();
    assert_eq!(statuses, [200, 200, 200]);
    assert_eq!(report.total.admitted, 3);
}

#[tokio::test]
async fn a_settle_rule_is_charged_the_recorded_cost() {
    // An estimate of 10 per request, 100 a minute; each request really cost 40. In service the
    // third leaves the key 20 in debt, and the next two are refused. At the estimate, all five
    // would pass.
    let arrivals = || {
        (0..5u64).map(|n| {
            Arrival::get(Duration::from_millis(1_796_292_000_000 + n), "/complete")
                .ip(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)))
                .actual_cost(40)
        })
    };
    let quota = || tollgate::Quota::per_minute(100).burst(100);
    let by_extension = tollgate::Rule::new("tokens", quota()).cost(10).settle();
    let report = replay_of(by_extension)
        .run(arrivals())
        .await
        .expect("replay");
    assert_eq!(
        (report.total.admitted, report.total.denied),
        (3, 2),
        "{report}"
    );

    let by_header = tollgate::Rule::new("tokens", quota())
        .cost(10)
        .settle_from_header(http::HeaderName::from_static("x-tokens-used"));
    let report = replay_of(by_header).run(arrivals()).await.expect("replay");
    assert_eq!(
        (report.total.admitted, report.total.denied),
        (3, 2),
        "{report}"
    );

    // The cost read from a file's `actual_cost` field.
    let lines = "{\"time\": 1796292000, \"path\": \"/\", \"ip\": \"192.0.2.1\", \"actual_cost\": 60}\n\
                 {\"time\": 1796292001, \"path\": \"/\", \"ip\": \"192.0.2.1\", \"actual_cost\": 60}\n\
                 {\"time\": 1796292002, \"path\": \"/\", \"ip\": \"192.0.2.1\"}\n";
    let rule = tollgate::Rule::new("tokens", quota()).cost(10).settle();
    let report = replay_of(rule)
        .run_traffic(Traffic::new(lines.as_bytes(), Format::JsonLines))
        .await
        .expect("replay");
    assert_eq!(
        (report.total.admitted, report.total.denied),
        (2, 1),
        "{report}"
    );
    assert_eq!(report.at_estimate, 0);

    // Admitted without a recorded cost: at the estimate, and counted as such.
    let rule = tollgate::Rule::new("tokens", quota()).cost(10).settle();
    let report = replay_of(rule)
        .run([Arrival::get(Duration::ZERO, "/").ip(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)))])
        .await
        .expect("replay");
    assert_eq!(
        (report.total.admitted, report.at_estimate),
        (1, 1),
        "{report}"
    );
    assert!(
        report.to_string().contains("charged at the estimate"),
        "{report}"
    );
}

#[tokio::test]
async fn metered_and_concurrency_rules_are_refused_as_not_predicted() {
    for (rule, name) in [
        (
            tollgate::Rule::new("tokens", tollgate::Quota::per_minute(10_000)).meter(500),
            "\"tokens\"",
        ),
        (tollgate::Rule::concurrent("in-flight", 5), "\"in-flight\""),
    ] {
        let error = replay_of(rule)
            .run([Arrival::get(Duration::ZERO, "/")])
            .await
            .unwrap_err();
        assert!(
            matches!(&error, ReplayError::Config(_))
                && error.to_string().contains(name)
                && error.to_string().contains("not predicted by a replay"),
            "{error}"
        );
    }

    // Let in, they are named in the report.
    let rule = tollgate::Rule::new("tokens", tollgate::Quota::per_minute(10_000)).meter(500);
    let report = replay_of(rule)
        .allow_unpredicted(true)
        .run([Arrival::get(Duration::ZERO, "/")])
        .await
        .expect("replay");
    assert_eq!(report.unpredicted, ["\"tokens\" (metered)"]);
    assert!(
        report
            .to_string()
            .contains("not predicted by a replay: \"tokens\" (metered)"),
        "{report}"
    );
}
