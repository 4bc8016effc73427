//! Both Redis stores over TLS (feature `tls`), signed in as an ACL user that may run only the
//! commands the stores send: a standalone `redis-server --tls-port`, one that requires client
//! certificates, and a 3-primary cluster with `--tls-cluster yes`; servers whose certificate
//! another CA signed are refused with an error that says so.

#![cfg(feature = "tls")]

mod support;

use std::time::Duration;

use tollgate::Algorithm;
use tollgate::algorithm::Limits;
use tollgate::key::Key;
use tollgate::store::{
    Adjustment, Change, Charge, ConnectError, RedisClusterStore, RedisStore, RuleSpec, Store,
};

use support::tls::{self, ClientCerts, TlsServer, certificates};
use support::unique_prefix;

const TEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Room for TLS handshakes on a busy machine.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A password a URL could not carry unescaped.
const PASSWORD: &str = "p/a?s#s@w:rd";

/// What the code itself runs, in either form: the server's clock and the state of each
/// algorithm (strings and lists).
const IN_THE_CODE: &[&str] = &[
    "+time", "+get", "+mget", "+set", "+del", "+pexpire", "+type", "+rpush", "+lindex", "+linsert",
    "+llen", "+lrem", "+ltrim", "+lrange", "+pttl",
];
/// Telling the other replicas of resets and refunds (`<prefix>:forget`), the breaker's probe,
/// and the heartbeat that counts the replicas (`<prefix>:replicas`).
const OUTSIDE_THE_CODE: &[&str] = &[
    "+publish",
    "+subscribe",
    "+ping",
    "+zadd",
    "+zremrangebyscore",
    "+zcard",
];
/// Loading and calling the code as a function library (Redis 7 and later).
const FUNCTIONS: &[&str] = &["+function|load", "+fcall"];
/// Loading and calling the code as a script (every server; the store's choice when the user
/// may not load functions).
const SCRIPTS: &[&str] = &["+script|load", "+evalsha"];
/// Reading the slot map, and following an `ASK` redirection.
const CLUSTER: &[&str] = &["+cluster|slots", "+asking"];

fn commands(parts: &[&[&'static str]]) -> Vec<&'static str> {
    parts.iter().flat_map(|part| part.iter().copied()).collect()
}

fn spec(name: &str, algorithm: Algorithm, limit: u64) -> RuleSpec {
    RuleSpec::new(
        name,
        algorithm,
        Limits::new(limit, 60_000_000, limit).unwrap(),
    )
    .unwrap()
}

/// Every operation of a store on every algorithm, each expected to succeed: checks that admit
/// and deny, a peek, refunds, a forced charge, a reset, and (`across`) one check of keys in
/// different hash slots. What the ACL user must be allowed to do.
async fn every_operation<S: Store>(store: &S, round: &str, across: bool) {
    for algorithm in Algorithm::ALL {
        let rule = spec(&format!("r-{algorithm}"), algorithm, 2);
        let key = Key::text(format!("client-{round}-{algorithm}"));
        let charge = [Charge {
            rule: &rule,
            key: &key,
            cost: 1,
        }];
        let first = store.check(&charge).await.expect("a check over TLS");
        assert!(first.allowed(), "{algorithm}: the first request");
        assert!(store.check(&charge).await.unwrap().allowed(), "{algorithm}");
        assert!(
            !store.check(&charge).await.unwrap().allowed(),
            "{algorithm}: the third of 2 is denied"
        );
        assert!(
            !store.peek(&charge).await.expect("a peek").allowed(),
            "{algorithm}: the peek sees the budget spent"
        );
        let refund = [Adjustment {
            rule: &rule,
            key: &key,
            change: Change::Refund(1),
            charged_at: first.made_at(),
        }];
        store.adjust(&refund).await.expect("a refund");
        assert!(
            store.check(&charge).await.unwrap().allowed(),
            "{algorithm}: the unit given back is spent again"
        );
        if algorithm != Algorithm::Concurrency {
            store.adjust(&refund).await.expect("a refund");
            let force = [Adjustment {
                change: Change::Charge(1),
                charged_at: 0,
                ..refund[0]
            }];
            store.adjust(&force).await.expect("a forced charge");
            assert!(
                !store.check(&charge).await.unwrap().allowed(),
                "{algorithm}: the forced charge spent the unit"
            );
        }
        store.reset(&charge).await.expect("a reset");
        assert!(
            store.check(&charge).await.unwrap().allowed(),
            "{algorithm}: admitted after the reset"
        );
    }
    if across {
        let rule = spec("across", Algorithm::FixedWindow, 1);
        let keys: Vec<Key> = (0..8)
            .map(|i| Key::text(format!("caller-{round}-{i}")))
            .collect();
        let charges: Vec<Charge<'_>> = keys
            .iter()
            .map(|key| Charge {
                rule: &rule,
                key,
                cost: 1,
            })
            .collect();
        assert!(store.check(&charges).await.expect("across slots").allowed());
        assert!(!store.check(&charges).await.unwrap().allowed());
    }
}

/// Nothing the user was refused, but what the store tries and does without: `FUNCTION LOAD`
/// for a user that may only run scripts, and `CLIENT SETINFO` (redis-rs names itself on each
/// connection where the server knows the command, and ignores a refusal).
fn assert_nothing_needed_was_refused(
    server: &support::RedisServer,
    user: &str,
    may_refuse: &[&str],
) {
    let all = tls::refused_for_user(server, user);
    let refused: Vec<String> = all
        .into_iter()
        .filter(|entry| {
            !entry.ends_with("client|setinfo")
                && !may_refuse.iter().any(|allowed| entry.ends_with(allowed))
        })
        .collect();
    assert!(refused.is_empty(), "the ACL user was refused: {refused:?}");
}

/// The ACL user of a test: named after its prefix, so that tests that share a server do not
/// remake each other's.
fn user(prefix: &str) -> String {
    format!("{prefix}-user")
}

fn standalone_builder(server: &TlsServer, prefix: &str) -> tollgate::store::RedisStoreBuilder {
    RedisStore::builder(server.url())
        .prefix(prefix)
        .credentials(user(prefix), PASSWORD)
        .tls_ca(certificates().ca.clone())
        .response_timeout(TEST_TIMEOUT)
        .connect_timeout(CONNECT_TIMEOUT)
        .deny_cache(0)
}

#[tokio::test]
async fn standalone_store_works_over_tls_as_an_acl_user_allowed_only_its_functions_commands() {
    let server = TlsServer::start(ClientCerts::Optional);
    let prefix = unique_prefix("tls-functions");
    let allowed = commands(&[IN_THE_CODE, OUTSIDE_THE_CODE, FUNCTIONS]);
    tls::acl_user(&server.server, &user(&prefix), PASSWORD, &prefix, &allowed);
    let store = standalone_builder(&server, &prefix)
        .connect()
        .await
        .expect("connect over TLS");
    every_operation(&store, "once", false).await;
    assert_nothing_needed_was_refused(&server.server, &user(&prefix), &[]);
    let ports = tls::ports_of_user(&server.server, &user(&prefix));
    assert!(!ports.is_empty(), "the store's connections are the user's");
    assert!(
        ports.iter().all(|&port| port == server.tls_port),
        "every connection of the store reached the TLS port {}: {ports:?}",
        server.tls_port
    );
    let fcalls: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut server.server.conn())
        .unwrap();
    assert!(fcalls.contains("cmdstat_fcall:"), "the functions ran");
}

#[tokio::test]
async fn standalone_store_falls_back_to_scripts_for_an_acl_user_that_may_not_load_functions() {
    let server = TlsServer::start(ClientCerts::Optional);
    let prefix = unique_prefix("tls-scripts");
    let allowed = commands(&[IN_THE_CODE, OUTSIDE_THE_CODE, SCRIPTS]);
    tls::acl_user(&server.server, &user(&prefix), PASSWORD, &prefix, &allowed);
    let store = standalone_builder(&server, &prefix)
        .connect()
        .await
        .expect("connect over TLS");
    every_operation(&store, "first", false).await;
    assert_nothing_needed_was_refused(&server.server, &user(&prefix), &["function|load"]);
    // Lost scripts (a restart, a failover, SCRIPT FLUSH) are loaded again with SCRIPT LOAD.
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut server.server.conn())
        .unwrap();
    every_operation(&store, "after the flush", false).await;
    assert_nothing_needed_was_refused(&server.server, &user(&prefix), &["function|load"]);
}

#[tokio::test]
async fn standalone_store_refuses_a_server_whose_certificate_another_ca_signed() {
    let server = TlsServer::start(ClientCerts::Optional);
    let prefix = unique_prefix("tls-wrong-ca");
    tls::acl_user(
        &server.server,
        &user(&prefix),
        PASSWORD,
        &prefix,
        &commands(&[IN_THE_CODE, OUTSIDE_THE_CODE, FUNCTIONS]),
    );
    let error = standalone_builder(&server, &prefix)
        .tls_ca(certificates().other_ca.clone())
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
        .expect_err("a certificate of another CA is refused");
    assert!(matches!(error, ConnectError::Store(_)), "{error:?}");
    let message = error.to_string();
    assert!(
        message.contains(&format!("127.0.0.1:{}", server.tls_port)),
        "names the server: {message}"
    );
    assert!(
        message.contains("certificate") && message.contains("tls_ca"),
        "says the server's certificate was refused, and what to change: {message}"
    );
    assert!(!message.contains(PASSWORD), "{message}");
    assert!(
        tls::ports_of_user(&server.server, &user(&prefix)).is_empty(),
        "no connection signed in"
    );
}

#[tokio::test]
async fn standalone_store_presents_its_client_certificate_to_a_server_that_requires_one() {
    let server = TlsServer::start(ClientCerts::Required);
    let prefix = unique_prefix("tls-client-cert");
    tls::acl_user(
        &server.server,
        &user(&prefix),
        PASSWORD,
        &prefix,
        &commands(&[IN_THE_CODE, OUTSIDE_THE_CODE, FUNCTIONS]),
    );
    let without = standalone_builder(&server, &prefix)
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await;
    let message = without
        .expect_err("a server that requires a client certificate refuses a client without one")
        .to_string();
    assert!(
        message.contains("tls_client_cert"),
        "says what to change: {message}"
    );
    let certs = certificates();
    let store = standalone_builder(&server, &prefix)
        .tls_client_cert(certs.client_cert.clone(), certs.client_key.clone())
        .connect()
        .await
        .expect("connect with a client certificate");
    every_operation(&store, "once", false).await;
}

#[tokio::test]
async fn credentials_replace_those_of_the_url_and_a_wrong_password_is_named() {
    let server = TlsServer::start(ClientCerts::Optional);
    let prefix = unique_prefix("tls-credentials");
    tls::acl_user(
        &server.server,
        &user(&prefix),
        PASSWORD,
        &prefix,
        &commands(&[IN_THE_CODE, OUTSIDE_THE_CODE, FUNCTIONS]),
    );
    let url = format!("rediss://someone:else@127.0.0.1:{}", server.tls_port);
    let builder = || {
        RedisStore::builder(&url)
            .prefix(&prefix)
            .tls_ca(certificates().ca.clone())
            .response_timeout(TEST_TIMEOUT)
            .connect_timeout(Duration::from_secs(2))
    };
    let store = builder()
        .credentials(user(&prefix), PASSWORD)
        .connect_timeout(CONNECT_TIMEOUT)
        .connect()
        .await
        .expect("the credentials given, not the URL's");
    every_operation(&store, "once", false).await;
    let error = builder()
        .credentials(user(&prefix), "not the password")
        .connect()
        .await
        .expect_err("a wrong password is refused")
        .to_string();
    // RESP3 signs in with HELLO, whose refusal is the server's own WRONGPASS.
    assert!(
        error.contains("authentication failed") || error.contains("WRONGPASS"),
        "{error}"
    );
    assert!(
        error.contains(&format!("{}:***@", user(&prefix))) && !error.contains("someone"),
        "names the user that was refused: {error}"
    );
    assert!(!error.contains("not the password"), "{error}");
}

#[tokio::test]
async fn tls_settings_that_cannot_work_fail_at_build_time() {
    let certs = certificates();
    let error = |result: Result<RedisStore, tollgate::ConfigError>| result.unwrap_err().to_string();
    let message = error(
        RedisStore::builder("redis://127.0.0.1:6390")
            .tls_ca(certs.ca.clone())
            .build(),
    );
    assert!(message.contains("use rediss://"), "{message}");
    let message = error(
        RedisStore::builder("rediss://127.0.0.1:6390")
            .tls_ca("not a certificate")
            .build(),
    );
    assert!(message.contains("tls_ca holds no certificate"), "{message}");
    let message = error(
        RedisStore::builder("rediss://127.0.0.1:6390")
            .tls_client_cert(certs.client_cert.clone(), "not a key")
            .build(),
    );
    assert!(message.contains("tls_client_cert's key"), "{message}");
    let message = RedisClusterStore::builder(["rediss://127.0.0.1:7000", "redis://127.0.0.1:7001"])
        .build()
        .unwrap_err()
        .to_string();
    assert!(message.contains("mix redis:// and rediss://"), "{message}");
}

fn cluster_builder(prefix: &str) -> tollgate::store::RedisClusterStoreBuilder {
    RedisClusterStore::builder(tls::cluster().urls())
        .prefix(prefix)
        .credentials(user(prefix), PASSWORD)
        .tls_ca(certificates().ca.clone())
        .response_timeout(TEST_TIMEOUT)
        .connect_timeout(CONNECT_TIMEOUT)
        .deny_cache(0)
}

/// The ACL user on every node of the TLS cluster, with the commands of `form`.
fn cluster_user(prefix: &str, form: &[&'static str]) {
    let allowed = commands(&[IN_THE_CODE, OUTSIDE_THE_CODE, form, CLUSTER]);
    for node in &tls::cluster().nodes {
        tls::acl_user(&node.server, &user(prefix), PASSWORD, prefix, &allowed);
    }
}

#[tokio::test]
async fn cluster_store_reaches_every_primary_over_tls_as_an_acl_user_allowed_only_its_commands() {
    let prefix = unique_prefix("tls-cluster");
    cluster_user(&prefix, FUNCTIONS);
    let store = cluster_builder(&prefix)
        .connect()
        .await
        .expect("connect to the cluster over TLS");
    every_operation(&store, "once", true).await;
    for node in &tls::cluster().nodes {
        assert_nothing_needed_was_refused(&node.server, &user(&prefix), &[]);
        let ports = tls::ports_of_user(&node.server, &user(&prefix));
        assert!(
            !ports.is_empty(),
            "the store reached the primary on port {}",
            node.tls_port
        );
        assert!(
            ports.iter().all(|&port| port == node.tls_port),
            "every connection to a node it learned from the slot map is TLS, on port {}: \
             {ports:?}",
            node.tls_port
        );
    }
}

#[tokio::test]
async fn cluster_store_works_for_an_acl_user_that_may_only_run_scripts() {
    let prefix = unique_prefix("tls-cluster-scripts");
    cluster_user(&prefix, SCRIPTS);
    let store = cluster_builder(&prefix)
        .connect()
        .await
        .expect("connect to the cluster over TLS");
    every_operation(&store, "once", true).await;
    for node in &tls::cluster().nodes {
        assert_nothing_needed_was_refused(&node.server, &user(&prefix), &["function|load"]);
    }
}

#[tokio::test]
async fn cluster_store_refuses_nodes_whose_certificate_another_ca_signed() {
    let prefix = unique_prefix("tls-cluster-wrong-ca");
    cluster_user(&prefix, FUNCTIONS);
    let error = cluster_builder(&prefix)
        .tls_ca(certificates().other_ca.clone())
        .connect_timeout(Duration::from_secs(1))
        .connect()
        .await
        .expect_err("a certificate of another CA is refused");
    assert!(matches!(error, ConnectError::Store(_)), "{error:?}");
    let message = error.to_string();
    assert!(
        message.contains("certificate") && message.contains("tls_ca"),
        "says the nodes' certificate was refused, and what to change: {message}"
    );
}

/// One command on a node's plain port (the test's own set-up).
fn on_node<T: redis::FromRedisValue>(node: usize, cmd: &redis::Cmd) -> T {
    cmd.query(&mut tls::cluster().nodes[node].server.conn())
        .unwrap_or_else(|e| panic!("{cmd:?} on node {node}: {e}"))
}

/// The hash slot of `identity`'s keys.
fn slot_of(identity: &str) -> u16 {
    on_node(
        0,
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(format!("k:{{{identity}}}:r")),
    )
}

/// A check of a key whose slot is being migrated goes where the `ASK` answer says, preceded by
/// `ASKING`: the ACL user may send it.
#[tokio::test]
async fn cluster_store_follows_ask_during_a_slot_migration_as_the_acl_user() {
    let cluster = tls::cluster();
    let prefix = unique_prefix("tls-cluster-ask");
    cluster_user(&prefix, FUNCTIONS);
    let store = cluster_builder(&prefix)
        .connect()
        .await
        .expect("connect to the cluster over TLS");
    // A slot no other test of the cluster uses (their keys would move with it).
    let others: Vec<u16> = Algorithm::ALL
        .iter()
        .map(|algorithm| format!("client-once-{algorithm}"))
        .chain((0..8).map(|i| format!("caller-once-{i}")))
        .map(|identity| slot_of(&identity))
        .collect();
    let identity = (0..)
        .map(|i| format!("asked-{i}"))
        .find(|identity| !others.contains(&slot_of(identity)))
        .expect("a free slot");
    let slot = slot_of(&identity);
    let slots: redis::Value = on_node(0, redis::cmd("CLUSTER").arg("SLOTS"));
    let source = cluster
        .nodes
        .iter()
        .position(|node| {
            support::owns(&slots, slot, node.server.port)
                || support::owns(&slots, slot, node.tls_port)
        })
        .expect("a primary holds the slot");
    let target = (source + 1) % cluster.nodes.len();
    let id = |node: usize| -> String { on_node(node, redis::cmd("CLUSTER").arg("MYID")) };
    let setslot = |node: usize, state: &str, other: Option<String>| {
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SETSLOT").arg(slot).arg(state);
        if let Some(other) = other {
            cmd.arg(other);
        }
        let () = on_node(node, &cmd);
    };
    setslot(target, "IMPORTING", Some(id(source)));
    setslot(source, "MIGRATING", Some(id(target)));

    let rule = spec("asked", Algorithm::FixedWindow, 1);
    let key = Key::text(&identity);
    let charge = [Charge {
        rule: &rule,
        key: &key,
        cost: 1,
    }];
    let first = store.check(&charge).await;
    let second = store.check(&charge).await;
    let name = store.key_name("asked", &key);
    let moved: i64 = redis::pipe()
        .cmd("ASKING")
        .ignore()
        .cmd("DEL")
        .arg(&name)
        .query::<(i64,)>(&mut cluster.nodes[target].server.conn())
        .expect("DEL on the target")
        .0;
    setslot(source, "STABLE", None);
    setslot(target, "STABLE", None);

    assert!(first.expect("a check sent on by ASK").allowed());
    assert!(!second.expect("a check sent on by ASK").allowed());
    assert_eq!(moved, 1, "the key was made on the node the slot moves to");
    for node in &cluster.nodes {
        assert_nothing_needed_was_refused(&node.server, &user(&prefix), &[]);
    }
}
