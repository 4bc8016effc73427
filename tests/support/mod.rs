//! Real Redis servers for the tests: `redis-server` processes on free loopback ports, standalone
//! or as a 3-primary Redis Cluster, stopped when dropped, when the test binary exits or dies.
//!
//! Each process runs under a small `sh` watchdog that holds a pipe from the test process: when the
//! test process goes away (normally, by a panic, or killed), the pipe closes and the watchdog stops
//! the server and removes its directory. Shared servers ([`standalone`], [`cluster`]) live in
//! statics, which are never dropped: the watchdog is what stops them.

#![allow(dead_code)]

pub mod example;
pub mod fault_proxy;
pub mod tls;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Stops `redis-server` when its standard input (a pipe from the test process) closes.
const WATCHDOG: &str = r#"
dir="$1"; shift
exec 3<&0
redis-server "$@" 3<&- </dev/null >/dev/null 2>&1 &
pid=$!
( read -r _ <&3; kill "$pid" 2>/dev/null ) 3<&3 &
wait "$pid"
rm -rf "$dir"
"#;

fn require(program: &str) {
    let found = Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    assert!(
        found,
        "`{program}` was not found on PATH. The Redis tests start their own Redis servers: install \
         Redis (Debian/Ubuntu: apt-get install redis-server redis-tools; macOS: brew install redis) \
         or run ./scripts/test.sh, which installs it."
    );
}

/// A port nobody listens on now (and, for a cluster node, a second one for its bus).
pub fn free_ports<const N: usize>() -> [u16; N] {
    let listeners: Vec<TcpListener> = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind a loopback port"))
        .collect();
    std::array::from_fn(|i| listeners[i].local_addr().unwrap().port())
}

/// One `redis-server` process.
pub struct RedisServer {
    pub port: u16,
    child: Child,
    stdin: Option<ChildStdin>,
    pub dir: PathBuf,
}

impl RedisServer {
    /// A standalone server on a free port.
    pub fn start() -> RedisServer {
        Self::start_with(&[])
    }

    /// A server on a free port, with extra `redis-server` arguments.
    pub fn start_with(extra: &[&str]) -> RedisServer {
        let mut last_error = String::new();
        for _ in 0..5 {
            let [port] = free_ports::<1>();
            match Self::start_on(port, extra) {
                Ok(server) => return server,
                Err(e) => last_error = e,
            }
        }
        panic!("could not start redis-server: {last_error}");
    }

    /// A server on `port` (for a restart on the same port).
    pub fn start_on(port: u16, extra: &[&str]) -> Result<RedisServer, String> {
        require("redis-server");
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tollgate-redis-{}-{}-{port}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let port_text = port.to_string();
        let dir_text = dir.to_string_lossy().into_owned();
        let log = dir.join("redis.log").to_string_lossy().into_owned();
        let mut args: Vec<&str> = vec![
            "--port",
            &port_text,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            &dir_text,
            "--logfile",
            &log,
        ];
        args.extend_from_slice(extra);
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(WATCHDOG)
            .arg("sh")
            .arg(&dir)
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run sh: {e}"))?;
        let stdin = child.stdin.take();
        let mut server = RedisServer {
            port,
            child,
            stdin,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if server.ping() {
                return Ok(server);
            }
            if let Ok(Some(status)) = server.child.try_wait() {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(format!(
                    "redis-server on port {port} exited ({status}): {log}"
                ));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "redis-server on port {port} did not answer PING in 10 s"
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn ping(&self) -> bool {
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
        let mut reply = [0u8; 7];
        stream.write_all(b"PING\r\n").is_ok()
            && stream.read_exact(&mut reply).is_ok()
            && &reply == b"+PONG\r\n"
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A plain (blocking) connection, to look at what the store wrote.
    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .and_then(|c| c.get_connection())
            .expect("connect to the test redis-server")
    }

    /// Stops the server now and waits for it to be gone.
    pub fn stop(mut self) {
        self.shutdown();
    }

    /// Kills the server with SIGKILL, as a crash would: no shutdown, no goodbye to its peers.
    pub fn kill9(&self) {
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query(&mut self.conn())
            .expect("INFO server");
        let pid = info
            .lines()
            .find_map(|line| line.strip_prefix("process_id:"))
            .expect("a process_id in INFO server")
            .trim()
            .to_owned();
        let status = Command::new("kill")
            .args(["-9", &pid])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -9 {pid}");
    }

    fn shutdown(&mut self) {
        // Closing the pipe makes the watchdog stop the server and remove its directory.
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A Redis Cluster of 3 primaries (and optionally a replica each), made with
/// `redis-cli --cluster create`.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// 3 primaries, no replicas, a node timeout of 5 s.
    pub fn start() -> RedisCluster {
        Self::start_with(0, 5000, &[])
    }

    /// 3 primaries with `replicas` replicas each, the given node timeout (how long a primary
    /// may be unreachable before its replica takes over), and extra `redis-server` arguments.
    pub fn start_with(replicas: usize, node_timeout_ms: u32, extra: &[&str]) -> RedisCluster {
        require("redis-cli");
        let mut last_error = String::new();
        for _ in 0..3 {
            match Self::try_start(replicas, node_timeout_ms, extra) {
                Ok(cluster) => return cluster,
                Err(e) => last_error = e,
            }
        }
        panic!("could not start a Redis Cluster: {last_error}");
    }

    fn try_start(
        replicas: usize,
        node_timeout_ms: u32,
        extra: &[&str],
    ) -> Result<RedisCluster, String> {
        let node_timeout = node_timeout_ms.to_string();
        let mut nodes = Vec::new();
        for _ in 0..3 * (1 + replicas) {
            let [port, bus] = free_ports::<2>();
            let bus = bus.to_string();
            let mut args = vec![
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-port",
                &bus,
                "--cluster-node-timeout",
                &node_timeout,
            ];
            args.extend_from_slice(extra);
            nodes.push(RedisServer::start_on(port, &args)?);
        }
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let output = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addresses)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run redis-cli: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        let cluster = RedisCluster { nodes };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !cluster.is_ready() {
            if Instant::now() > deadline {
                return Err("the cluster did not reach cluster_state:ok in 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(cluster)
    }

    /// Every node says `cluster_state:ok`, knows every node and all 16384 slots, and every
    /// replica is in sync with its primary (so that it can take over).
    fn is_ready(&self) -> bool {
        let known = format!("cluster_known_nodes:{}", self.nodes.len());
        self.nodes.iter().all(|node| {
            let mut conn = node.conn();
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query(&mut conn)
                .unwrap_or_default();
            let replication: String = redis::cmd("INFO")
                .arg("replication")
                .query(&mut conn)
                .unwrap_or_default();
            info.contains("cluster_state:ok")
                && info.contains("cluster_slots_assigned:16384")
                && info.contains(&known)
                && (replication.contains("role:master")
                    || replication.contains("master_link_status:up"))
        })
    }

    /// Makes node `i` announce `ports[i]` as its client port (a proxy in front of it), so that
    /// clients reach it only through that proxy; waits until every node tells the new ports.
    pub fn announce_ports(&self, ports: &[u16]) {
        for (node, port) in self.nodes.iter().zip(ports) {
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg("cluster-announce-port")
                .arg(port)
                .query(&mut node.conn())
                .expect("CONFIG SET cluster-announce-port");
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let announced = self.nodes.iter().all(|node| {
                let nodes: String = redis::cmd("CLUSTER")
                    .arg("NODES")
                    .query(&mut node.conn())
                    .unwrap_or_default();
                ports
                    .iter()
                    .all(|port| nodes.contains(&format!("127.0.0.1:{port}@")))
            });
            if announced {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the nodes did not announce their proxies in 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The node (index) that is the primary of `slot` now, by asking the first live node.
    pub fn primary_of(&self, slot: u16) -> Option<usize> {
        for node in &self.nodes {
            let Ok(mut conn) = redis::Client::open(node.url()).and_then(|c| c.get_connection())
            else {
                continue;
            };
            let Ok(slots) = redis::cmd("CLUSTER")
                .arg("SLOTS")
                .query::<redis::Value>(&mut conn)
            else {
                continue;
            };
            return self
                .nodes
                .iter()
                .position(|candidate| owns(&slots, slot, candidate.port));
        }
        None
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// A connection to the primary that holds `key`.
    pub fn conn_for(&self, key: &str) -> redis::Connection {
        let mut first = self.nodes[0].conn();
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut first)
            .expect("CLUSTER KEYSLOT");
        let slots: redis::Value = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query(&mut first)
            .expect("CLUSTER SLOTS");
        let node = self
            .nodes
            .iter()
            .find(|node| owns(&slots, slot, node.port))
            .unwrap_or_else(|| panic!("no node owns slot {slot}"));
        node.conn()
    }

    /// Runs `command` on every node.
    pub fn on_every_node(&self, command: &redis::Cmd) {
        for node in &self.nodes {
            let _: redis::Value = command.query(&mut node.conn()).expect("command on a node");
        }
    }
}

/// Whether the `CLUSTER SLOTS` reply gives `slot` to the node on `port`.
pub fn owns(slots: &redis::Value, slot: u16, port: u16) -> bool {
    let redis::Value::Array(ranges) = slots else {
        return false;
    };
    let int = |v: &redis::Value| match v {
        redis::Value::Int(i) => *i,
        _ => -1,
    };
    ranges.iter().any(|range| {
        let redis::Value::Array(items) = range else {
            return false;
        };
        let (Some(start), Some(end), Some(redis::Value::Array(primary))) =
            (items.first(), items.get(1), items.get(2))
        else {
            return false;
        };
        let node_port = primary.get(1).map(int).unwrap_or(-1);
        int(start) <= i64::from(slot) && i64::from(slot) <= int(end) && node_port == i64::from(port)
    })
}

/// The standalone server shared by the tests of one test binary.
pub fn standalone() -> &'static RedisServer {
    static SERVER: OnceLock<RedisServer> = OnceLock::new();
    SERVER.get_or_init(RedisServer::start)
}

/// The cluster shared by the tests of one test binary.
pub fn cluster() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    CLUSTER.get_or_init(RedisCluster::start)
}

/// A prefix of keys no other test uses.
pub fn unique_prefix(name: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!(
        "t{}-{name}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}
