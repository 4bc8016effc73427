//! The Redis stores' behaviour on real servers: stacked rules, cross-slot requests, expiry, script
//! cache loss, key slots, time-outs, outages, compact values, and replicas sharing one budget.

#![cfg(feature = "redis")]

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, StatusCode};
use tokio::task::JoinSet;
use tollgate::Algorithm;
use tollgate::Decision;
use tollgate::algorithm::{Limits, MAX_PERIOD_MICROS};
use tollgate::key::{Global, Key};
use tollgate::store::ConnectError;
use tollgate::store::RuleSpec;
use tollgate::store::{Charge, MemoryStore, RedisClusterStore, RedisStore, Store, StoreError};
use tollgate::{Quota, RateLimitLayer, Rule};
use tower::ServiceExt;

use support::{RedisServer, unique_prefix};

const TEST_TIMEOUT: Duration = Duration::from_secs(10);

async fn standalone_store(prefix: &str) -> RedisStore {
    RedisStore::builder(support::standalone().url())
        .prefix(prefix)
        .response_timeout(TEST_TIMEOUT)
        .connect()
        .await
        .unwrap()
}

async fn cluster_store(prefix: &str) -> RedisClusterStore {
    RedisClusterStore::builder(support::cluster().urls())
        .prefix(prefix)
        .response_timeout(TEST_TIMEOUT)
        .connect()
        .await
        .unwrap()
}

fn spec(name: &str, algorithm: Algorithm, limit: u64, period: u64) -> RuleSpec {
    RuleSpec::new(name, algorithm, Limits::new(limit, period, limit).unwrap()).unwrap()
}

async fn check<S: Store>(store: &S, charges: &[(&RuleSpec, &Key)]) -> Decision {
    let charges: Vec<Charge<'_>> = charges
        .iter()
        .map(|&(rule, key)| Charge { rule, key, cost: 1 })
        .collect();
    store.check(&charges).await.expect("check")
}

// ---------------------------------------------------------------------------------------------
// Stacked rules

/// A per-second burst of 2 and a daily quota of 100: once the burst denies, the daily quota is
/// not charged, whatever the number of denied requests.
async fn denied_request_charges_no_other_rule<S: Store>(store: &S) {
    let burst = spec("burst", Algorithm::TokenBucket, 2, MAX_PERIOD_MICROS);
    let daily = spec("daily", Algorithm::FixedWindow, 100, MAX_PERIOD_MICROS);
    let key = Key::text("stacked-client");
    for _ in 0..2 {
        assert!(
            check(store, &[(&burst, &key), (&daily, &key)])
                .await
                .allowed()
        );
    }
    for _ in 0..10 {
        let denied = check(store, &[(&burst, &key), (&daily, &key)]).await;
        assert!(!denied.allowed());
        assert!(!denied.outcomes()[0].allowed, "the burst denies");
        assert!(denied.outcomes()[1].allowed, "the daily quota would admit");
        // Nothing is charged for a denied request: it reports what is left, 100 - 2.
        assert_eq!(
            denied.outcomes()[1].remaining,
            98,
            "and was charged only twice"
        );
    }
    let look = store
        .check(&[Charge {
            rule: &daily,
            key: &key,
            cost: 0,
        }])
        .await
        .unwrap();
    assert_eq!(look.outcomes()[0].remaining, 98);
    // The other way round: a rule that denies first in order charges none after it.
    let tiny = spec("tiny", Algorithm::Gcra, 1, MAX_PERIOD_MICROS);
    let other = Key::text("stacked-other");
    assert!(
        check(store, &[(&tiny, &other), (&daily, &other)])
            .await
            .allowed()
    );
    for _ in 0..5 {
        assert!(
            !check(store, &[(&tiny, &other), (&daily, &other)])
                .await
                .allowed()
        );
    }
    let look = store
        .check(&[Charge {
            rule: &daily,
            key: &other,
            cost: 0,
        }])
        .await
        .unwrap();
    assert_eq!(look.outcomes()[0].remaining, 99);
}

#[tokio::test]
async fn standalone_denied_request_charges_no_other_rule() {
    let store = standalone_store(&unique_prefix("stacked")).await;
    denied_request_charges_no_other_rule(&store).await;
    // And in Redis itself: the daily key counts 2.
    let key = store.key_name("daily", &Key::text("stacked-client"));
    let value: String = redis::cmd("GET")
        .arg(&key)
        .query(&mut support::standalone().conn())
        .unwrap();
    assert!(value.ends_with(":2"), "{key} = {value}");
}

#[tokio::test]
async fn cluster_denied_request_charges_no_other_rule() {
    let store = cluster_store(&unique_prefix("stacked")).await;
    denied_request_charges_no_other_rule(&store).await;
    let key = store.key_name("daily", &Key::text("stacked-client"));
    let value: String = redis::cmd("GET")
        .arg(&key)
        .query(&mut support::cluster().conn_for(&key))
        .unwrap();
    assert!(value.ends_with(":2"), "{key} = {value}");
}

/// A per-client rule and a global rule live in different slots: a request the client's rule
/// denies still charges nothing globally.
#[tokio::test]
async fn cluster_denied_request_across_slots_charges_no_other_rule() {
    let store = cluster_store(&unique_prefix("cross")).await;
    let client = spec("client", Algorithm::SlidingWindowLog, 2, MAX_PERIOD_MICROS);
    let global = spec("global", Algorithm::FixedWindow, 1000, MAX_PERIOD_MICROS);
    let user = Key::text("cross-user");
    let everyone = Key::global();
    let slot = |key: &str| -> u16 {
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut support::cluster().nodes[0].conn())
            .unwrap()
    };
    assert_ne!(
        slot(&store.key_name("client", &user)),
        slot(&store.key_name("global", &everyone)),
        "the test needs two slots"
    );
    for _ in 0..2 {
        assert!(
            check(&store, &[(&client, &user), (&global, &everyone)])
                .await
                .allowed()
        );
    }
    for _ in 0..5 {
        let denied = check(&store, &[(&client, &user), (&global, &everyone)]).await;
        assert!(!denied.allowed());
        // Uncharged: 1000 minus the 2 admitted.
        assert_eq!(denied.outcomes()[1].remaining, 998);
    }
    // The global rule denying, with a fresh client each time: no client is charged.
    let full = spec("full", Algorithm::TokenBucket, 1, MAX_PERIOD_MICROS);
    assert!(
        check(&store, &[(&client, &Key::text("c0")), (&full, &everyone)])
            .await
            .allowed()
    );
    for i in 1..5 {
        let user = Key::text(format!("c{i}"));
        let denied = check(&store, &[(&client, &user), (&full, &everyone)]).await;
        assert!(!denied.allowed());
        assert!(denied.outcomes()[0].allowed);
        let key = store.key_name("client", &user);
        let exists: bool = redis::cmd("EXISTS")
            .arg(&key)
            .query(&mut support::cluster().conn_for(&key))
            .unwrap();
        assert!(!exists, "{key} was charged by a denied request");
    }
}

/// Many concurrent requests of 5 clients against a per-client and a global rule in other
/// slots: the global limit is never exceeded, and after the races every stored count equals
/// what was admitted (refunds leave no charge behind).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_concurrent_cross_slot_requests_never_over_admit_nor_leak() {
    let store = cluster_store(&unique_prefix("race")).await;
    let client = Arc::new(spec(
        "client",
        Algorithm::FixedWindow,
        60,
        MAX_PERIOD_MICROS,
    ));
    let global = Arc::new(spec(
        "global",
        Algorithm::FixedWindow,
        200,
        MAX_PERIOD_MICROS,
    ));
    let users: Vec<Key> = (0..5).map(|i| Key::text(format!("racer-{i}"))).collect();
    let mut tasks = JoinSet::new();
    for i in 0..500 {
        let (store, client, global) = (store.clone(), client.clone(), global.clone());
        let user = users[i % users.len()].clone();
        tasks.spawn(async move {
            let everyone = Key::global();
            let charges = [
                Charge {
                    rule: &client,
                    key: &user,
                    cost: 1,
                },
                Charge {
                    rule: &global,
                    key: &everyone,
                    cost: 1,
                },
            ];
            (i % 5, store.check(&charges).await.unwrap().allowed())
        });
    }
    let mut per_user = [0u64; 5];
    while let Some(result) = tasks.join_next().await {
        let (user, allowed) = result.unwrap();
        per_user[user] += u64::from(allowed);
    }
    let total: u64 = per_user.iter().sum();
    assert!(total <= 200, "admitted {total} with a global limit of 200");
    assert!(total >= 150, "admitted only {total}: far below the limit");
    let count = |key: &str| -> u64 {
        let value: Option<String> = redis::cmd("GET")
            .arg(key)
            .query(&mut support::cluster().conn_for(key))
            .unwrap();
        value.map_or(0, |v| v.rsplit(':').next().unwrap().parse().unwrap())
    };
    assert_eq!(count(&store.key_name("global", &Key::global())), total);
    for (i, user) in users.iter().enumerate() {
        assert!(per_user[i] <= 60);
        assert_eq!(count(&store.key_name("client", user)), per_user[i]);
    }
}

// ---------------------------------------------------------------------------------------------
// Expiry

/// Each algorithm's key gets a PEXPIRE of its reset, and is gone from Redis after it. A look
/// (cost 0) at a client without state writes nothing.
async fn keys_expire<S: Store>(
    store: &S,
    name_of: impl Fn(&str, &Key) -> String,
    conn: impl Fn(&str) -> redis::Connection,
) {
    // Long enough that a slow connection to the key's node (a test beside this one may hold the
    // CPU) reads its PTTL before it expires.
    let period = 1_000_000; // 1 s
    let key = Key::text("expiring");
    let mut longest = 0;
    for algorithm in Algorithm::ALL {
        let rule = spec(algorithm.name(), algorithm, 2, period);
        let decision = check(store, &[(&rule, &key)]).await;
        assert!(decision.allowed());
        let reset_ms = decision.outcomes()[0].reset.div_ceil(1000);
        longest = longest.max(reset_ms);
        let name = name_of(algorithm.name(), &key);
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&name)
            .query(&mut conn(&name))
            .unwrap();
        assert!(
            ttl > 0 && ttl as u64 <= reset_ms,
            "{algorithm}: PTTL {ttl} ms, reset {reset_ms} ms"
        );
        // A look at an unknown client leaves no key.
        let ghost = Key::text("never-charged");
        let look = store
            .check(&[Charge {
                rule: &rule,
                key: &ghost,
                cost: 0,
            }])
            .await
            .unwrap();
        assert!(look.allowed());
        let ghost_name = name_of(algorithm.name(), &ghost);
        let exists: bool = redis::cmd("EXISTS")
            .arg(&ghost_name)
            .query(&mut conn(&ghost_name))
            .unwrap();
        assert!(!exists, "{algorithm}: a look wrote {ghost_name}");
    }
    tokio::time::sleep(Duration::from_millis(longest + 100)).await;
    for algorithm in Algorithm::ALL {
        let name = name_of(algorithm.name(), &key);
        let exists: bool = redis::cmd("EXISTS")
            .arg(&name)
            .query(&mut conn(&name))
            .unwrap();
        assert!(!exists, "{algorithm}: {name} outlived its reset");
    }
}

#[tokio::test]
async fn standalone_keys_expire_after_their_reset() {
    let store = standalone_store(&unique_prefix("expiry")).await;
    let names = store.clone();
    keys_expire(
        &store,
        |rule, key| names.key_name(rule, key),
        |_| support::standalone().conn(),
    )
    .await;
}

#[tokio::test]
async fn cluster_keys_expire_after_their_reset() {
    let store = cluster_store(&unique_prefix("expiry")).await;
    let names = store.clone();
    keys_expire(
        &store,
        |rule, key| names.key_name(rule, key),
        |name| support::cluster().conn_for(name),
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// Script cache loss

async fn survives_script_flush<S: Store>(store: &S, flush: impl Fn()) {
    let rule = spec("flushed", Algorithm::Gcra, 10, MAX_PERIOD_MICROS);
    let key = Key::text("flush-client");
    for i in 0..15 {
        flush();
        let decision = store
            .check(&[Charge {
                rule: &rule,
                key: &key,
                cost: 1,
            }])
            .await
            .expect("a lost script is loaded again, unseen");
        assert_eq!(decision.allowed(), i < 10, "request {i}");
    }
}

// Each on a server of its own: a flush between another test's reload of the code and its call
// would fail that test's check.
#[tokio::test]
async fn standalone_script_flush_is_recovered() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .response_timeout(TEST_TIMEOUT)
        .connect()
        .await
        .unwrap();
    survives_script_flush(&store, || {
        let mut conn = server.conn();
        for flush in support::server().flush_code_commands() {
            let _: () = flush.query(&mut conn).unwrap();
        }
    })
    .await;
}

#[tokio::test]
async fn cluster_script_flush_is_recovered() {
    let cluster = tokio::task::spawn_blocking(support::RedisCluster::start)
        .await
        .unwrap();
    let store = RedisClusterStore::builder(cluster.urls())
        .response_timeout(TEST_TIMEOUT)
        .connect()
        .await
        .unwrap();
    survives_script_flush(&store, || {
        for flush in support::server().flush_code_commands() {
            cluster.on_every_node(&flush);
        }
    })
    .await;
}

/// The calls of tollgate's code a server ran, by command: `FCALL`, `EVALSHA`.
fn calls(conn: &mut redis::Connection) -> (u64, u64) {
    (
        support::command_calls(conn, "fcall"),
        support::command_calls(conn, "evalsha"),
    )
}

/// Redis 7 runs the code as a function, loaded once; a server without functions (Redis 6.2, or
/// one that renamed `FUNCTION` and `FCALL` away) runs the same code as a script, and decides
/// alike. On a server without functions, both servers are of that kind (there is nothing to
/// rename away) and both run the script.
#[tokio::test]
async fn functions_where_the_server_has_them_and_the_script_where_it_does_not() {
    let rule = spec("forms", Algorithm::SlidingWindowLog, 3, MAX_PERIOD_MICROS);
    let key = Key::text("forms-client");
    let functions = support::server().has_functions();
    let with = support::RedisServer::start();
    let without = if functions {
        support::RedisServer::start_with(&[
            "--rename-command",
            "FUNCTION",
            "",
            "--rename-command",
            "FCALL",
            "",
        ])
    } else {
        support::RedisServer::start()
    };
    let with_expected = if functions { (4, 0) } else { (0, 4) };
    // Five checks, four calls: the fifth is denied by the deny cache, as the fourth was by Redis.
    for (server, expected) in [(&with, with_expected), (&without, (0, 4))] {
        let store = RedisStore::builder(server.url())
            .response_timeout(TEST_TIMEOUT)
            .connect()
            .await
            .unwrap();
        let mut allowed = Vec::new();
        for _ in 0..5 {
            allowed.push(check(&store, &[(&rule, &key)]).await.allowed());
        }
        assert_eq!(allowed, [true, true, true, false, false]);
        assert_eq!(
            calls(&mut server.conn()),
            expected,
            "(FCALL, EVALSHA) calls"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Keys

/// The slot the store computes for its keys is the server's, and all rules of one caller share
/// one slot, whatever the identity.
#[tokio::test]
async fn cluster_all_rules_of_one_caller_share_a_slot() {
    let store = cluster_store("tollgate").await;
    let mut conn = support::cluster().nodes[0].conn();
    let identities = [
        Key::text("alice"),
        Key::text("a{b}c"),
        Key::text(""),
        Key::text("x".repeat(300)),
        Key::ip("203.0.113.7".parse().unwrap()),
        Key::ip_prefix("2001:db8::1".parse().unwrap(), 64),
        Key::global(),
    ];
    for identity in &identities {
        let slots: Vec<u16> = ["burst", "daily", "x.y-z"]
            .iter()
            .map(|rule| {
                redis::cmd("CLUSTER")
                    .arg("KEYSLOT")
                    .arg(store.key_name(rule, identity))
                    .query(&mut conn)
                    .unwrap()
            })
            .collect();
        assert!(
            slots.iter().all(|&s| s == slots[0]),
            "{identity:?}: {slots:?}"
        );
        let name = store.key_name("burst", identity);
        assert!(
            name.starts_with("tollgate:{") && name.ends_with("}:burst"),
            "{name}"
        );
    }
}

/// Two prefixes on one server keep two budgets.
#[tokio::test]
async fn standalone_prefixes_keep_budgets_apart() {
    let a = standalone_store(&unique_prefix("app-a")).await;
    let b = standalone_store(&unique_prefix("app-b")).await;
    let rule = spec("shared-name", Algorithm::TokenBucket, 1, MAX_PERIOD_MICROS);
    let key = Key::text("same-client");
    assert!(check(&a, &[(&rule, &key)]).await.allowed());
    assert!(!check(&a, &[(&rule, &key)]).await.allowed());
    assert!(check(&b, &[(&rule, &key)]).await.allowed());
}

// ---------------------------------------------------------------------------------------------
// Failures

/// A server that does not answer within the budget gives `StoreError::Timeout`.
#[tokio::test]
async fn standalone_slow_server_is_a_timeout() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .response_timeout(Duration::from_millis(50))
        .connect()
        .await
        .unwrap();
    let rule = spec("slow", Algorithm::TokenBucket, 10, MAX_PERIOD_MICROS);
    let key = Key::text("slow-client");
    assert!(check(&store, &[(&rule, &key)]).await.allowed());
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(500)
        .arg("WRITE")
        .query(&mut server.conn())
        .unwrap();
    let started = Instant::now();
    let result = store
        .check(&[Charge {
            rule: &rule,
            key: &key,
            cost: 1,
        }])
        .await;
    assert!(matches!(result, Err(StoreError::Timeout)), "{result:?}");
    assert!(started.elapsed() < Duration::from_millis(400));
}

/// Nothing listening: building fails, as unavailable.
#[tokio::test]
async fn connect_fails_fast_on_an_unreachable_server_and_names_it_without_its_password() {
    let [port] = support::free_ports::<1>();
    let url = format!("redis://app:s3cret@127.0.0.1:{port}/0");
    let result = RedisStore::builder(&url)
        .connect_timeout(Duration::from_millis(300))
        .connect()
        .await;
    let error = result.unwrap_err();
    assert!(
        matches!(error, ConnectError::Store(StoreError::Unavailable(_))),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(
        message.contains(&format!("redis://app:***@127.0.0.1:{port}/0")),
        "{message}"
    );
    assert!(!message.contains("s3cret"), "{message}");
    let result = RedisClusterStore::builder([url])
        .connect_timeout(Duration::from_millis(300))
        .connect()
        .await;
    let message = result.unwrap_err().to_string();
    assert!(message.contains(&format!("127.0.0.1:{port}")), "{message}");
    assert!(!message.contains("s3cret"), "{message}");
}

/// A replica starts while Redis is down, serves under its rules' failure mode, and limits as
/// soon as Redis is up: the store connects in the background.
#[tokio::test]
async fn a_replica_starts_and_serves_without_redis_and_limits_once_it_is_up() {
    let [port] = support::free_ports::<1>();
    let store = RedisStore::builder(format!("redis://127.0.0.1:{port}"))
        .prefix(unique_prefix("late"))
        .build()
        .expect("building needs no Redis");
    assert!(!store.is_connected());
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("late", Quota::per_hour(3)))
        .store(store.clone())
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let send = || {
        let mut request = Request::get("/").body(Body::empty()).unwrap();
        request
            .extensions_mut()
            .insert(axum::extract::ConnectInfo(SocketAddr::from((
                [10, 9, 8, 7],
                1000,
            ))));
        app.clone().oneshot(request)
    };
    // Redis is down: the rule fails open, and nothing is counted.
    for _ in 0..5 {
        let response = send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert!(response.headers().get("ratelimit").is_none());
    }
    // Redis comes up: within the retry delay the store connects and the limit holds.
    let _server = RedisServer::start_on(port, &[]).expect("redis-server on the chosen port");
    let started = Instant::now();
    let first_counted = loop {
        let response = send().await.unwrap();
        if let Some(budget) = response.headers().get("ratelimit") {
            break budget.to_str().unwrap().to_owned();
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the store never connected"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(store.is_connected());
    assert!(first_counted.contains("r=2"), "{first_counted}");
    for _ in 0..2 {
        assert_eq!(send().await.unwrap().status(), StatusCode::OK);
    }
    assert_eq!(
        send().await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// The server goes away: checks fail (unavailable or timed out, never a wrong decision); it
/// comes back empty on the same port (no script, no state): checks succeed again.
#[tokio::test]
async fn standalone_recovers_after_a_server_restart() {
    let server = RedisServer::start();
    let port = server.port;
    let store = RedisStore::builder(server.url())
        .pool_size(2)
        .response_timeout(Duration::from_millis(500))
        .connect()
        .await
        .unwrap();
    let rule = spec("restart", Algorithm::TokenBucket, 100, MAX_PERIOD_MICROS);
    let key = Key::text("restart-client");
    let charge = [Charge {
        rule: &rule,
        key: &key,
        cost: 1,
    }];
    assert!(store.check(&charge).await.unwrap().allowed());
    server.stop();
    for _ in 0..3 {
        let result = store.check(&charge).await;
        assert!(
            matches!(
                result,
                Err(StoreError::Unavailable(_) | StoreError::Timeout)
            ),
            "{result:?}"
        );
    }
    let _server = RedisServer::start_on(port, &[]).expect("restart on the same port");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match store.check(&charge).await {
            Ok(decision) => {
                assert!(decision.allowed());
                assert_eq!(decision.outcomes()[0].remaining, 99, "a fresh server");
                break;
            }
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("the store did not recover: {e}"),
        }
    }
}

#[tokio::test]
async fn configuration_mistakes_fail_at_build_time() {
    let url = support::standalone().url();
    for result in [
        RedisStore::builder(&url).prefix("a{b}").connect().await,
        RedisStore::builder(&url).prefix("").connect().await,
        RedisStore::builder(&url).pool_size(0).connect().await,
        RedisStore::builder(&url)
            .response_timeout(Duration::ZERO)
            .connect()
            .await,
        RedisStore::builder("http://not-redis").connect().await,
    ] {
        let error = result.unwrap_err();
        assert!(matches!(error, ConnectError::Config(_)), "{error:?}");
        assert!(error.to_string().contains("use"), "{error}");
    }
    let empty: [&str; 0] = [];
    assert!(matches!(
        RedisClusterStore::builder(empty).connect().await,
        Err(ConnectError::Config(_))
    ));
}

// ---------------------------------------------------------------------------------------------
// Values

/// Token-bucket and GCRA keys hold one integer (`OBJECT ENCODING` int: no string beside the
/// key) and take no more memory (`MEMORY USAGE`) than any key of that name holding that
/// integer with an expiry: 72 bytes for a typical key on Redis 7.0 with jemalloc, which the test
/// checks where the server uses jemalloc (the figure depends on the server and its allocator:
/// 56 bytes on Valkey 8.1, 80 on Redis 6.2 built with libc malloc). A sliding log never holds
/// more entries than its limit.
#[tokio::test]
async fn standalone_values_are_compact() {
    // Its own server: the test uses the default prefix.
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .response_timeout(TEST_TIMEOUT)
        .connect()
        .await
        .unwrap();
    let mut conn = server.conn();
    let memory: String = redis::cmd("INFO").arg("memory").query(&mut conn).unwrap();
    let jemalloc = memory.contains("mem_allocator:jemalloc");
    let client = Key::ip("203.0.113.7".parse().unwrap());
    // The typical key: default prefix, an IPv4 client, a short rule name.
    for algorithm in Algorithm::ALL {
        let rule = spec("burst", algorithm, 100, 3_600_000_000);
        for _ in 0..10 {
            assert!(check(&store, &[(&rule, &client)]).await.allowed());
        }
        let key = store.key_name("burst", &client);
        assert_eq!(key, "tollgate:{203.0.113.7}:burst");
        let bytes: u64 = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(&key)
            .query(&mut conn)
            .unwrap();
        println!("{algorithm}: {key} {bytes} bytes");
        if algorithm.has_burst() {
            let encoding: String = redis::cmd("OBJECT")
                .arg("ENCODING")
                .arg(&key)
                .query(&mut conn)
                .unwrap();
            assert_eq!(encoding, "int", "{algorithm}: {key} holds one integer");
            // The same integer under a name of the same length, with an expiry.
            let value: String = redis::cmd("GET").arg(&key).query(&mut conn).unwrap();
            let reference = "r".repeat(key.len());
            let _: () = redis::cmd("SET")
                .arg(&reference)
                .arg(&value)
                .arg("PX")
                .arg(3_600_000)
                .query(&mut conn)
                .unwrap();
            let least: u64 = redis::cmd("MEMORY")
                .arg("USAGE")
                .arg(&reference)
                .query(&mut conn)
                .unwrap();
            let _: () = redis::cmd("DEL").arg(&reference).query(&mut conn).unwrap();
            assert!(
                bytes <= least,
                "{algorithm}: {key} takes {bytes} bytes, an integer key of its name {least}"
            );
            if jemalloc {
                assert!(bytes <= 72, "{algorithm}: {key} takes {bytes} bytes");
            }
        }
        let _: () = redis::cmd("DEL").arg(&key).query(&mut conn).unwrap();
    }

    let log = spec("bounded-log", Algorithm::SlidingWindowLog, 7, 3_600_000_000);
    let key = Key::text("log-client");
    for cost in [3, 3, 3, 1, 1, 2, 7] {
        let _ = store
            .check(&[Charge {
                rule: &log,
                key: &key,
                cost,
            }])
            .await
            .unwrap();
        let len: u64 = redis::cmd("LLEN")
            .arg(store.key_name("bounded-log", &key))
            .query(&mut conn)
            .unwrap();
        assert!(len <= 7, "the log holds {len} entries, limit 7");
    }
}

// ---------------------------------------------------------------------------------------------
// Replicas

async fn replicas_admit<S: Store + Clone>(stores: [S; 3], limit: u64) -> u64 {
    let apps: Vec<Router> = stores
        .into_iter()
        .map(|store| {
            let layer = RateLimitLayer::builder()
                .rule(Rule::new("replicas", Quota::per_hour(limit)).key(Global))
                .store(store)
                .build()
                .unwrap();
            Router::new()
                .route("/", get(|| async { "hello" }))
                .layer(layer)
        })
        .collect();
    let mut admitted = 0;
    for i in 0..3 * limit {
        let request = Request::builder()
            .uri("/")
            .extension(axum::extract::ConnectInfo(SocketAddr::from((
                [127, 0, 0, 1],
                9,
            ))))
            .body(Body::empty())
            .unwrap();
        let response = apps[(i % 3) as usize]
            .clone()
            .oneshot(request)
            .await
            .unwrap();
        match response.status() {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("unexpected {other}"),
        }
    }
    admitted
}

/// Three replicas, each with its own store handle, behind a round-robin client: with memory
/// stores they admit three times the limit, with Redis exactly the limit.
#[tokio::test]
async fn three_replicas_share_one_budget_in_redis() {
    let memory = replicas_admit(
        [MemoryStore::new(), MemoryStore::new(), MemoryStore::new()],
        20,
    )
    .await;
    assert_eq!(memory, 60);
    let prefix = unique_prefix("replicas");
    let redis = replicas_admit(
        [
            standalone_store(&prefix).await,
            standalone_store(&prefix).await,
            standalone_store(&prefix).await,
        ],
        20,
    )
    .await;
    assert_eq!(redis, 20);
    let prefix = unique_prefix("replicas");
    let cluster = replicas_admit(
        [
            cluster_store(&prefix).await,
            cluster_store(&prefix).await,
            cluster_store(&prefix).await,
        ],
        20,
    )
    .await;
    assert_eq!(cluster, 20);
}

/// A check polled where no Tokio runtime runs (another executor) is an error of the store,
/// decided by the rule's failure mode, not a panic: its call needs the runtime's tasks and timers.
#[test]
fn a_check_polled_outside_a_tokio_runtime_is_an_error() {
    let server = RedisServer::start();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let prefix = unique_prefix("no-runtime");
    let standalone = runtime
        .block_on(
            RedisStore::builder(server.url())
                .prefix(&prefix)
                .response_timeout(TEST_TIMEOUT)
                .connect(),
        )
        .unwrap();
    let cluster = runtime.block_on(cluster_store(&prefix));
    polled_outside_a_runtime(&runtime, standalone);
    polled_outside_a_runtime(&runtime, cluster);
}

fn polled_outside_a_runtime<S: Store + Sync>(runtime: &tokio::runtime::Runtime, store: S)
where
    S::Future: Unpin + Send,
{
    let key = Key::text("no-runtime-client");
    for algorithm in [Algorithm::TokenBucket, Algorithm::Concurrency] {
        let rule = spec("no-runtime", algorithm, 10, MAX_PERIOD_MICROS);
        let charge = [Charge {
            rule: &rule,
            key: &key,
            cost: 1,
        }];
        // Made on the runtime, polled elsewhere; and made and polled elsewhere. Peeks and
        // resets too.
        let (made_inside, peek, reset) = {
            let _entered = runtime.enter();
            (
                store.check(&charge),
                store.peek(&charge),
                store.reset(&charge),
            )
        };
        let polled = std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
                    let (mut made_inside, mut peek, mut reset) = (made_inside, peek, reset);
                    let mut made_outside = store.check(&charge);
                    let errors = |poll: std::task::Poll<Result<(), StoreError>>| match poll {
                        std::task::Poll::Ready(result) => result.err(),
                        std::task::Poll::Pending => None,
                    };
                    [
                        errors(
                            std::pin::Pin::new(&mut made_inside)
                                .poll(&mut context)
                                .map(|r| r.map(drop)),
                        ),
                        errors(
                            std::pin::Pin::new(&mut made_outside)
                                .poll(&mut context)
                                .map(|r| r.map(drop)),
                        ),
                        errors(peek.as_mut().poll(&mut context).map(|r| r.map(drop))),
                        errors(reset.as_mut().poll(&mut context)),
                    ]
                })
                .join()
                .expect("polling outside a runtime does not panic")
        });
        for (what, error) in ["check made inside", "check", "peek", "reset"]
            .iter()
            .zip(polled)
        {
            match error {
                Some(StoreError::Unavailable(why)) => {
                    assert!(why.to_string().contains("outside a Tokio runtime"), "{why}")
                }
                other => panic!(
                    "{} ({algorithm}): a {what} outside a runtime answered {other:?}",
                    store.kind()
                ),
            }
        }
        // Inside the runtime the same store decides.
        assert!(runtime.block_on(store.check(&charge)).unwrap().allowed());
    }
}

/// The runtime that started a store's background connection may go away (a setup runtime, a
/// test's own): the next check, on another runtime, starts it again.
#[test]
fn a_store_whose_first_runtime_went_away_still_connects() {
    let [port] = support::free_ports::<1>();
    let first = tokio::runtime::Runtime::new().unwrap();
    let store = first.block_on(async {
        RedisStore::builder(format!("redis://127.0.0.1:{port}"))
            .prefix(unique_prefix("runtime"))
            .build()
            .unwrap()
    });
    drop(first);
    let _server = RedisServer::start_on(port, &[]).expect("redis-server on the chosen port");
    let second = tokio::runtime::Runtime::new().unwrap();
    second.block_on(async {
        let rule = spec("runtime", Algorithm::TokenBucket, 10, MAX_PERIOD_MICROS);
        let key = Key::text("runtime-client");
        let started = Instant::now();
        loop {
            let charge = [Charge {
                rule: &rule,
                key: &key,
                cost: 1,
            }];
            if store.check(&charge).await.is_ok() {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the store never connected"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
}

/// Tenants named by their API key, hashed: the key is in no Redis key name, its digest is.
#[tokio::test]
async fn a_hashed_tenant_from_a_header_keeps_the_api_key_out_of_redis() {
    use tollgate::policy::{Policy, Tenant, TenantFromHeader, Tier};
    let prefix = unique_prefix("hashed-tenant");
    let layer = RateLimitLayer::builder()
        .policy(
            Policy::new("v1")
                .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(5))))
                .default_tier("free"),
        )
        .tenant(
            TenantFromHeader::new("authorization")
                .hashed()
                .lookup(|value: &str| {
                    let key = value.strip_prefix("Bearer ")?;
                    let (tier, _) = key.split_once('-')?;
                    Some(Tenant::new(key).with_tier(tier))
                }),
        )
        .store(standalone_store(&prefix).await)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let mut request = Request::get("/")
        .header("authorization", "Bearer free-bob")
        .body(Body::empty())
        .unwrap();
    request
        .extensions_mut()
        .insert(axum::extract::ConnectInfo(SocketAddr::from((
            [9, 9, 9, 9],
            4000,
        ))));
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let names: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query(&mut support::standalone().conn())
        .unwrap();
    let hashed = Tenant::new("free-bob").hashed();
    assert!(names.iter().all(|n| !n.contains("bob")), "{names:?}");
    assert!(
        names
            .iter()
            .any(|n| n.contains(&hashed.id()["sha256:".len()..])),
        "the digest of the key names its budget: {names:?}"
    );
}
