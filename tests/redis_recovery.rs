//! How the Redis stores come back: a server restarted while no request ran, a server that
//! refuses connections, a cluster node reached through a slow network after a blip, and
//! denials forgotten on every replica when one of them resets or refunds a key.

mod support;

use std::time::Duration;

use support::fault_proxy::FaultProxy;
use support::{RedisCluster, RedisServer, unique_prefix};
use tollgate::Algorithm;
use tollgate::CircuitBreaker;
use tollgate::DecisionSource;
use tollgate::algorithm::Limits;
use tollgate::key::Key;
use tollgate::store::{
    Adjustment, Change, Charge, RedisClusterStore, RedisStore, RuleSpec, Store, StoreError,
};

fn hourly(name: &str, limit: u64) -> RuleSpec {
    let hour = Limits::new(limit, 3_600_000_000, limit).unwrap();
    RuleSpec::new(name, Algorithm::FixedWindow, hour).unwrap()
}

/// The index of the node (and of its proxy) that owns the slot of the Redis key `name`.
fn owner_of(cluster: &RedisCluster, name: &str, proxies: &[FaultProxy]) -> usize {
    let mut conn = cluster.nodes[0].conn();
    let slot: u16 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(name)
        .query(&mut conn)
        .unwrap();
    let slots: redis::Value = redis::cmd("CLUSTER").arg("SLOTS").query(&mut conn).unwrap();
    (0..proxies.len())
        .find(|&i| support::owns(&slots, slot, proxies[i].port))
        .expect("a node owns the slot")
}

/// Waits until `server`'s port answers `PING` again (a restart under way).
async fn until_answers(port: u16) {
    for _ in 0..500 {
        if let Ok(mut conn) = redis::Client::open(format!("redis://127.0.0.1:{port}"))
            .and_then(|c| c.get_connection())
            && redis::cmd("PING").query::<String>(&mut conn).is_ok()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the server on port {port} did not come back");
}

/// Redis shut down and started again with no request in between: every connection of the pool
/// was closed by the server, and the store must notice before it sends a check on one (a check
/// sent on a closed connection fails with a broken pipe, and a fail-closed rule answers 503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_restart_fails_no_check() {
    let server = RedisServer::start();
    let port = server.port;
    let store = RedisStore::builder(server.url())
        .prefix(unique_prefix("restart"))
        .pool_size(2)
        .response_timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap();
    let rule = hourly("restart", 1_000);
    let key = Key::text("quiet");
    let charge = [Charge {
        rule: &rule,
        key: &key,
        cost: 1,
    }];
    // Both pooled connections carry checks.
    let (a, b) = tokio::join!(store.check(&charge), store.check(&charge));
    assert!(a.unwrap().allowed() && b.unwrap().allowed());

    server.stop();
    let _again = tokio::task::spawn_blocking(move || RedisServer::start_on(port, &[]))
        .await
        .unwrap()
        .expect("redis-server restarted on the same port");
    until_answers(port).await;
    // The server closed the pool's connections; give the store a moment to see the close (it
    // sees it the moment the connection's stream ends, before anything is sent on it).
    tokio::time::sleep(Duration::from_millis(100)).await;

    for i in 0..10 {
        let decision = store.check(&charge).await;
        assert!(
            decision.as_ref().is_ok_and(|d| d.allowed()),
            "check {i} after a quiet restart: {decision:?}"
        );
    }
}

/// With Redis stopped, a refused connection is an answer: the check fails at once with the
/// refusal, rather than waiting for the pool until its time budget runs out (two stacked layers
/// paid two budgets per request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_fails_the_check_at_once() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .prefix(unique_prefix("refused"))
        .connect_timeout(Duration::from_secs(5))
        .response_timeout(Duration::from_secs(5))
        .circuit_breaker(CircuitBreaker::disabled())
        .connect()
        .await
        .unwrap();
    let rule = hourly("refused", 1_000);
    let key = Key::text("refused");
    let charge = [Charge {
        rule: &rule,
        key: &key,
        cost: 1,
    }];
    assert!(store.check(&charge).await.unwrap().allowed());
    server.stop();
    tokio::time::sleep(Duration::from_millis(100)).await;
    for i in 0..5 {
        match store.check(&charge).await {
            Err(StoreError::Unavailable(error)) => {
                let text = error.to_string();
                assert!(
                    text.contains("refused") || text.contains("closed") || text.contains("broken"),
                    "check {i}: the error says why: {text}"
                );
            }
            other => {
                panic!("check {i} with Redis stopped: expected the refusal at once, got {other:?}")
            }
        }
    }
    assert!(
        !store.is_reachable(),
        "a store whose server is down says so"
    );
}

/// A cluster node reached through a slow network (each new connection waits one round trip
/// before its first bytes, as a TCP handshake does): after a blip cuts its connection, opening
/// a new one and sending a check takes longer than one check's budget. The connection is opened
/// off the check's budget, so the node's slots answer again soon after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_node_recovers_after_a_blip() {
    let (cluster, proxies) = support::fault_proxy::cluster_behind_proxies().await;
    let urls: Vec<String> = proxies.iter().map(FaultProxy::url).collect();
    let store = RedisClusterStore::builder(urls)
        .prefix(unique_prefix("slow-node"))
        .response_timeout(Duration::from_millis(150))
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap();
    let rule = hourly("slow", 1_000_000);
    let key = Key::text("slow-node");
    let charge = [Charge {
        rule: &rule,
        key: &key,
        cost: 1,
    }];
    assert!(store.check(&charge).await.unwrap().allowed());
    let name = store.key_name("slow", &key);
    let owner = owner_of(&cluster, &name, &proxies);

    // One round trip: 2 × 40 ms. A check on an open connection (one round trip) fits the 150 ms
    // budget; a new connection (the handshake's round trip, then HELLO's, then the check's)
    // does not.
    proxies[owner].set_delay(Duration::from_millis(40));
    proxies[owner].set_connect_delay(Duration::from_millis(80));
    assert!(store.check(&charge).await.unwrap().allowed());
    // The blip: every connection to the node is cut, and new ones refused for a moment.
    proxies[owner].set_cut(true);
    tokio::time::sleep(Duration::from_millis(50)).await;
    proxies[owner].set_cut(false);

    let mut answered = 0;
    for _ in 0..40 {
        if store.check(&charge).await.is_ok() {
            answered += 1;
        }
        if answered >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        answered >= 3,
        "the node's slots answer again within 40 checks after the blip (answered {answered})"
    );
    drop(cluster);
}

/// Two replicas (two stores of one prefix): B denies `key` from its deny cache; A resets it.
/// Returns how B answered each of its next checks until it admitted (at most `tries`, 10 ms
/// apart), and whether it did.
async fn b_after_a_forgets<S: Store>(a: &S, b: &S, forget: Forget, tries: usize) -> bool {
    let rule = hourly("login", 5);
    let key = Key::text(format!("user-{forget:?}"));
    let charge = [Charge {
        rule: &rule,
        key: &key,
        cost: 1,
    }];
    for _ in 0..5 {
        assert!(a.check(&charge).await.unwrap().allowed());
    }
    // B asks Redis once, then answers the denial itself.
    assert!(!b.check(&charge).await.unwrap().allowed());
    let cached = b.check(&charge).await.unwrap();
    assert!(!cached.allowed());
    assert_eq!(
        cached.source(),
        DecisionSource::DenyCache,
        "B caches the denial"
    );
    match forget {
        Forget::Reset => a.reset(&charge).await.unwrap(),
        Forget::Refund => {
            let refund = [Adjustment {
                rule: &rule,
                key: &key,
                change: Change::Refund(1),
                charged_at: 0,
            }];
            a.adjust(&refund).await.unwrap();
        }
    }
    for _ in 0..tries {
        if b.check(&charge).await.unwrap().allowed() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

#[derive(Clone, Copy, Debug)]
enum Forget {
    Reset,
    Refund,
}

/// A reset or a refund on replica A reaches replica B's deny cache: B admits within 10 checks
/// 10 ms apart (the message takes one hop through Redis; B's cached denial would otherwise be
/// answered for the rest of the hour).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_or_refund_on_one_replica_reaches_the_deny_cache_of_the_others() {
    let server = support::standalone();
    let prefix = unique_prefix("forget");
    let a = RedisStore::builder(server.url())
        .prefix(&prefix)
        .connect()
        .await
        .unwrap();
    let b = RedisStore::builder(server.url())
        .prefix(&prefix)
        .connect()
        .await
        .unwrap();
    // The listening connections subscribe in the background, once connected.
    tokio::time::sleep(Duration::from_millis(200)).await;
    for forget in [Forget::Reset, Forget::Refund] {
        assert!(
            b_after_a_forgets(&a, &b, forget, 10).await,
            "B admits soon after A's {forget:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_or_refund_on_one_cluster_replica_reaches_the_deny_cache_of_the_others() {
    let cluster = support::cluster();
    let prefix = unique_prefix("forget-cluster");
    let a = RedisClusterStore::builder(cluster.urls())
        .prefix(&prefix)
        .connect()
        .await
        .unwrap();
    let b = RedisClusterStore::builder(cluster.urls())
        .prefix(&prefix)
        .connect()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    for forget in [Forget::Reset, Forget::Refund] {
        assert!(
            b_after_a_forgets(&a, &b, forget, 10).await,
            "B admits soon after A's {forget:?}"
        );
    }
}

/// A key reset behind the stores' backs (no message: a `DEL` by hand, or a message lost) is
/// admitted once the cached denial's cap has passed, not after the hour Redis computed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_denial_lives_no_longer_than_its_cap() {
    let server = support::standalone();
    let store = RedisStore::builder(server.url())
        .prefix(unique_prefix("cap"))
        .deny_cache_max_age(Duration::from_millis(300))
        .connect()
        .await
        .unwrap();
    let rule = hourly("capped", 1);
    let key = Key::text("capped");
    let charge = [Charge {
        rule: &rule,
        key: &key,
        cost: 1,
    }];
    assert!(store.check(&charge).await.unwrap().allowed());
    assert!(!store.check(&charge).await.unwrap().allowed());
    let cached = store.check(&charge).await.unwrap();
    assert_eq!(cached.source(), DecisionSource::DenyCache);
    let _: () = redis::cmd("DEL")
        .arg(store.key_name("capped", &key))
        .query(&mut server.conn())
        .unwrap();
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert!(
        store.check(&charge).await.unwrap().allowed(),
        "the denial was answered past its cap"
    );
}

/// A request whose rules count different callers in different slots is checked in two phases
/// (peek every slot, then charge each). When a slot denies in the second phase (another request
/// took its last unit meanwhile), the slots already charged are refunded, even if the request
/// went away in between: the check runs to its end on its own.
/// The fault proxy's delay is a latency, not a queue: a command sent while another is on its
/// way arrives one delay after it was sent, not one delay after the other arrived.
#[tokio::test]
async fn the_fault_proxys_delay_is_a_latency() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let server = support::standalone();
    let proxy = FaultProxy::start(server.port).await;
    let mut link = tokio::net::TcpStream::connect(("127.0.0.1", proxy.port))
        .await
        .unwrap();
    link.set_nodelay(true).unwrap();
    proxy.set_delay(Duration::from_millis(300));
    let sent = tokio::time::Instant::now();
    link.write_all(b"*1\r\n$4\r\nPING\r\n").await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    link.write_all(b"*1\r\n$4\r\nPING\r\n").await.unwrap();
    let mut replies = Vec::new();
    let mut answered = Vec::new();
    while answered.len() < 2 {
        let mut chunk = [0u8; 64];
        let n = link.read(&mut chunk).await.unwrap();
        assert!(n > 0, "the proxy closed the link");
        replies.extend_from_slice(&chunk[..n]);
        while answered.len() < replies.windows(7).filter(|w| w == b"+PONG\r\n").count() {
            answered.push(sent.elapsed());
        }
    }
    // 600 ms for the first round trip; the second, sent 100 ms later, 700 ms (not 900 ms, as
    // if it waited for the first's delays in each direction).
    assert!(
        answered[1] < Duration::from_millis(800),
        "the second reply came after {:?} (the first after {:?})",
        answered[1],
        answered[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cross_slot_refund_is_made_when_the_request_goes_away() {
    let (cluster, proxies) = support::fault_proxy::cluster_behind_proxies().await;
    let urls: Vec<String> = proxies.iter().map(FaultProxy::url).collect();
    let prefix = unique_prefix("across");
    let store = RedisClusterStore::builder(urls)
        .prefix(&prefix)
        .response_timeout(Duration::from_secs(3))
        .deny_cache(0)
        .connect()
        .await
        .unwrap();
    // Another replica. The cluster announces the proxies' ports, so its calls go through them
    // too, with their delays.
    let direct = RedisClusterStore::builder(cluster.urls())
        .prefix(&prefix)
        .response_timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap();
    let wide = hourly("wide", 100);
    let narrow = hourly("narrow", 1);
    let wide_key = Key::text("caller");
    // A key of the narrow rule on another node than the wide rule's.
    let wide_owner = owner_of(&cluster, &store.key_name("wide", &wide_key), &proxies);
    let narrow_key = (0..100)
        .map(|i| Key::text(format!("route-{i}")))
        .find(|key| owner_of(&cluster, &store.key_name("narrow", key), &proxies) != wide_owner)
        .expect("a key on another node");
    let narrow_owner = owner_of(&cluster, &store.key_name("narrow", &narrow_key), &proxies);
    let both = [
        Charge {
            rule: &wide,
            key: &wide_key,
            cost: 1,
        },
        Charge {
            rule: &narrow,
            key: &narrow_key,
            cost: 1,
        },
    ];
    let narrow_only = [Charge {
        rule: &narrow,
        key: &narrow_key,
        cost: 1,
    }];
    let wide_only = [Charge {
        rule: &wide,
        key: &wide_key,
        cost: 1,
    }];

    // Both stores know every node already (their connections are open).
    assert!(direct.peek(&narrow_only).await.unwrap().allowed());
    assert!(store.peek(&narrow_only).await.unwrap().allowed());
    assert!(store.peek(&wide_only).await.unwrap().allowed());
    // 400 ms each way to the narrow rule's node: its peek is read there at about 400 ms and
    // answers at 800 ms; its charge arrives at 1,200 ms and answers at 1,600 ms. (The delay is
    // a latency: a heartbeat either store sends on its connection to that node meanwhile
    // does not push a call behind it back by another 400 ms.)
    proxies[narrow_owner].set_delay(Duration::from_millis(400));
    let check = tokio::time::timeout(Duration::from_millis(1_400), store.check(&both));
    let race = async {
        // Read at the node at about 900 ms (400 ms through the proxy): after the narrow peek
        // was read, before its charge arrives. (Sent at 800 ms, it raced the charge: both
        // reached the node at 1,200 ms.)
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(direct.check(&narrow_only).await.unwrap().allowed());
    };
    let (gone, ()) = tokio::join!(check, race);
    assert!(
        gone.is_err(),
        "the request went away during the charge phase"
    );
    proxies[narrow_owner].set_delay(Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let wide_now = direct.peek(&wide_only).await.unwrap();
    assert_eq!(
        wide_now.outcomes()[0].remaining,
        100,
        "the wide rule's unit, charged in the second phase, was refunded"
    );
}

/// A split key's denials are cached per sub-key; while Redis cannot be asked (its breaker open)
/// they still answer, as a whole key's do, instead of leaving the request to its failure mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_keys_cached_denial_answers_while_the_breaker_is_open() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .prefix(unique_prefix("split-open"))
        .response_timeout(Duration::from_millis(200))
        .circuit_breaker(CircuitBreaker::after_failures(1).cooldown(Duration::from_secs(60)))
        .connect()
        .await
        .unwrap();
    let rule = RuleSpec::new(
        "split-open",
        Algorithm::FixedWindow,
        Limits::new(8, 3_600_000_000, 8).unwrap(),
    )
    .unwrap()
    .with_parts(4)
    .unwrap();
    let key = Key::text("spent");
    let charge = [Charge {
        rule: &rule,
        key: &key,
        cost: 1,
    }];
    let mut admitted = 0;
    for _ in 0..12 {
        if store.check(&charge).await.unwrap().allowed() {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 8);
    // Another key fails once with Redis gone: the breaker opens.
    server.stop();
    let other = Key::text("opens-the-breaker");
    let fresh = [Charge {
        rule: &rule,
        key: &other,
        cost: 1,
    }];
    assert!(store.check(&fresh).await.is_err());
    assert!(!store.is_reachable());
    for i in 0..8 {
        match store.check_now(&charge) {
            Some(Ok(decision)) => assert!(!decision.allowed(), "request {i}"),
            None => {
                let decision = store.check(&charge).await;
                assert!(
                    decision.as_ref().is_ok_and(|d| !d.allowed()),
                    "request {i}: the cached denial answers, got {decision:?}"
                );
            }
            other => panic!("request {i}: the cached denial answers, got {other:?}"),
        }
    }
}

/// A server that stops answering (its link stalls) opens the breaker; the probes that follow
/// go from the store itself, once per cooldown: no request waits for one (each is refused at
/// once, `CircuitOpen`), and once the server answers again a probe closes the breaker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_do_not_ride_on_requests() {
    let server = support::standalone();
    let proxy = FaultProxy::start(server.port).await;
    let store = RedisStore::builder(proxy.url())
        .prefix(unique_prefix("probe"))
        .response_timeout(Duration::from_millis(150))
        .circuit_breaker(CircuitBreaker::after_failures(1).cooldown(Duration::from_millis(200)))
        .deny_cache(0)
        .connect()
        .await
        .unwrap();
    let rule = hourly("probe", 1_000_000);
    let key = Key::text("probe");
    let charge = [Charge {
        rule: &rule,
        key: &key,
        cost: 1,
    }];
    assert!(store.check(&charge).await.unwrap().allowed());
    proxy.set_delay(Duration::from_secs(5));
    assert!(matches!(
        store.check(&charge).await,
        Err(StoreError::Timeout)
    ));
    // (The call that timed out reports to the breaker from its own task.)
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Five cooldowns of requests, 20 ms apart: each refused at once.
    for i in 0..50 {
        match store.check(&charge).await {
            Err(StoreError::CircuitOpen) => {}
            other => panic!("request {i} while the server stalls: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy.set_delay(Duration::ZERO);
    let mut answered = false;
    for _ in 0..100 {
        if store.check(&charge).await.is_ok() {
            answered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        answered,
        "a probe closed the breaker once the server answered"
    );
}

/// Units a lease left unspent go back into their window with the key's next call; but not
/// after another replica reset the key: given back into the window reset since, they would
/// erase what was charged after the reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_units_do_not_go_back_after_another_replica_reset_the_key() {
    use tollgate::clock::ManualClock;

    let server = support::standalone();
    let prefix = unique_prefix("lease-reset");
    let clock = ManualClock::new(1_700_000_000_000_000);
    let replica = || {
        RedisStore::builder(server.url())
            .prefix(&prefix)
            .clock(clock.clone())
            .response_timeout(Duration::from_secs(2))
            .connect()
    };
    let (a, b) = (replica().await.unwrap(), replica().await.unwrap());
    tokio::time::sleep(Duration::from_millis(200)).await; // the listeners subscribe
    let limits = Limits::new(100, 60_000_000, 100).unwrap();
    let rule = RuleSpec::new("leased", Algorithm::FixedWindow, limits)
        .unwrap()
        .with_lease(10, tollgate::DEFAULT_LEASE_TTL)
        .unwrap();
    let key = Key::text("hot");
    let one = [Charge {
        rule: &rule,
        key: &key,
        cost: 1,
    }];
    // To a second into a window, then 20 requests 10 ms apart on A: its lease grows and
    // leaves units unspent when it expires.
    let now = tollgate::clock::Clock::now_micros(&clock);
    clock.advance(Duration::from_micros(61_000_000 - now % 60_000_000));
    for _ in 0..20 {
        assert!(a.check(&one).await.unwrap().allowed());
        clock.advance(Duration::from_millis(10));
    }
    clock.advance(Duration::from_secs(5));
    // B resets the key and charges 50.
    b.reset(&one).await.unwrap();
    let fifty = [Charge {
        rule: &rule,
        key: &key,
        cost: 50,
    }];
    assert!(b.check(&fifty).await.unwrap().allowed());
    tokio::time::sleep(Duration::from_millis(200)).await; // A hears of the reset
    assert!(a.check(&one).await.unwrap().allowed());
    let left = b.peek(&one).await.unwrap().outcomes()[0].remaining;
    assert_eq!(
        left, 49,
        "51 charged since the reset, none of them given back"
    );
}

/// Whether `buf` starts with a whole RESP command: its length and its name.
fn whole_command(buf: &[u8]) -> Option<(usize, Vec<u8>)> {
    fn line(buf: &[u8], at: usize) -> Option<(usize, usize)> {
        let end = at + buf.get(at..)?.windows(2).position(|w| w == b"\r\n")?;
        let n = std::str::from_utf8(&buf[at + 1..end]).ok()?.parse().ok()?;
        Some((n, end + 2))
    }
    let (parts, mut at) = line(buf, 0)?;
    let mut name = Vec::new();
    for i in 0..parts {
        let (len, start) = line(buf, at)?;
        let part = buf.get(start..start + len)?;
        if i == 0 {
            name = part.to_ascii_uppercase();
        }
        at = start + len + 2;
        buf.get(..at)?;
    }
    Some((at, name))
}

/// A server that answers the `PING` each connection opens with, and the loading of the code,
/// then refuses every later `PING` with `refusal` until `ready` is set (then `PONG`), and
/// closes the connection on any other command (a check fails). `refused` counts the refusals.
async fn refusing_server(
    refusal: &'static str,
    ready: std::sync::Arc<std::sync::atomic::AtomicBool>,
    refused: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> u16 {
    refusing(refusal, ready, refused, false).await
}

/// The server of [`refusing_server`]; with `checks_refused`, it answers the checks' commands
/// with `refusal` too (the connection stays open), as a loading or busy Redis does.
async fn refusing(
    refusal: &'static str,
    ready: std::sync::Arc<std::sync::atomic::AtomicBool>,
    refused: std::sync::Arc<std::sync::atomic::AtomicU64>,
    checks_refused: bool,
) -> u16 {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut link, _)) = listener.accept().await {
            let (ready, refused) = (ready.clone(), refused.clone());
            tokio::spawn(async move {
                let (mut buf, mut pings) = (Vec::new(), 0);
                loop {
                    while let Some((len, name)) = whole_command(&buf) {
                        buf.drain(..len);
                        if name == b"FUNCTION" || name == b"SCRIPT" {
                            // The code loads (its name), so that the store starts.
                            if link.write_all(b"$8\r\ntollgate\r\n").await.is_err() {
                                return;
                            }
                            continue;
                        }
                        if name != b"PING" {
                            if !checks_refused {
                                return; // the connection closes: the check fails
                            }
                            let answer = format!("-{refusal}\r\n");
                            if link.write_all(answer.as_bytes()).await.is_err() {
                                return;
                            }
                            continue;
                        }
                        pings += 1;
                        let answer = if pings == 1 || ready.load(Ordering::SeqCst) {
                            "+PONG\r\n".to_owned()
                        } else {
                            refused.fetch_add(1, Ordering::SeqCst);
                            format!("-{refusal}\r\n")
                        };
                        if link.write_all(answer.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                    let mut chunk = [0u8; 1024];
                    match link.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
            });
        }
    });
    port
}

/// What a loading Redis (`LOADING`) and one running a script past its time (`BUSY`) answer to
/// every command.
const REFUSALS: [&str; 2] = [
    "LOADING Redis is loading the dataset in memory",
    "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
];

/// Begins a store of the server on `port` for the refusal tests: its own prefix, no deny
/// cache and no heartbeat (every check reaches the server), `response_timeout` and `breaker`.
fn refused_store(
    port: u16,
    name: &str,
    response_timeout: Duration,
    breaker: CircuitBreaker,
) -> tollgate::store::RedisStoreBuilder {
    RedisStore::builder(format!("redis://127.0.0.1:{port}"))
        .prefix(unique_prefix(name))
        .response_timeout(response_timeout)
        .circuit_breaker(breaker)
        .deny_cache(0)
        .heartbeat(Duration::ZERO)
}

/// A server that answers the probe at once, but with `LOADING` (it reads its data) or `BUSY`
/// (a script runs past its time), refuses the checks too: the breaker stays open, each request
/// refused at once, until a probe is answered `PONG`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_answered_loading_or_busy_keeps_the_breaker_open() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    for refusal in REFUSALS {
        let (ready, refused) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
        );
        let port = refusing_server(refusal, ready.clone(), refused.clone()).await;
        let store = refused_store(
            port,
            "refused",
            Duration::from_millis(100),
            CircuitBreaker::after_failures(1).cooldown(Duration::from_millis(200)),
        )
        .build()
        .unwrap();
        let rule = hourly("refused", 1_000);
        let key = Key::text("refused");
        let charge = [Charge {
            rule: &rule,
            key: &key,
            cost: 1,
        }];
        let opened = async {
            while !matches!(store.check(&charge).await, Err(StoreError::CircuitOpen)) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), opened)
            .await
            .expect("the failing checks open the breaker");
        // Three probes refused: after each, requests are still refused at once.
        for probe in 1..=3 {
            let answered = async {
                while refused.load(Ordering::SeqCst) < probe {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            };
            tokio::time::timeout(Duration::from_secs(5), answered)
                .await
                .expect("the store probes once per cooldown");
            tokio::time::sleep(Duration::from_millis(50)).await;
            let after = store.check(&charge).await;
            assert!(
                matches!(after, Err(StoreError::CircuitOpen)),
                "after probe {probe} answered `{refusal}`, a check got {after:?}"
            );
        }
        // The server is back: a probe's `PONG` closes the breaker, and checks reach it again.
        ready.store(true, Ordering::SeqCst);
        let closed = async {
            while matches!(store.check(&charge).await, Err(StoreError::CircuitOpen)) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), closed)
            .await
            .expect("a probe answered PONG closes the breaker");
    }
}

/// A check answered `LOADING` or `BUSY` is a failure for the circuit breaker, as the probe's
/// `PING` answered so is: the server answers at once but refuses every command, so it is not
/// back, and a breaker that counted it as a success would close (or never open) on a server
/// that refuses every check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_answered_loading_or_busy_counts_against_the_breaker() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64};

    for refusal in REFUSALS {
        let (ready, refused) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
        );
        let port = refusing(refusal, ready, refused, true).await;
        let store = refused_store(
            port,
            "refused-checks",
            Duration::from_millis(200),
            CircuitBreaker::after_failures(2).cooldown(Duration::from_secs(60)),
        )
        .connect()
        .await
        .unwrap();
        let rule = hourly("refused-checks", 1_000);
        let key = Key::text("refused-checks");
        let charge = [Charge {
            rule: &rule,
            key: &key,
            cost: 1,
        }];
        let mut answers = Vec::new();
        for _ in 0..4 {
            answers.push(store.check(&charge).await);
        }
        assert!(
            matches!(answers[0], Err(StoreError::Unavailable(_))),
            "a check answered `{refusal}` is unavailable: {:?}",
            answers[0]
        );
        assert!(
            matches!(answers[3], Err(StoreError::CircuitOpen)),
            "two checks answered `{refusal}` open a breaker set to open after two failures; \
             the fourth got {:?}",
            answers[3]
        );
    }
}
