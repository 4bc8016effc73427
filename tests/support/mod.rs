//! Real Redis servers for the tests: `redis-server` processes on free loopback ports, standalone
//! or as a 3-primary Redis Cluster, stopped when dropped, when the test binary exits or dies.
//!
//! The server is `redis-server` on PATH (clusters are made with `redis-cli`), or the programs
//! named by `TOLLGATE_REDIS_SERVER` and `TOLLGATE_REDIS_CLI` (another Redis, or Valkey:
//! `./scripts/servers.sh` runs the suite on each). [`server`] says which server that is, from
//! its `INFO server`; tests of what only some servers have (functions) check the equivalent on
//! the others (scripts).
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

/// Stops the server when its standard input (a pipe from the test process) closes.
const WATCHDOG: &str = r#"
dir="$1"; shift
program="$1"; shift
exec 3<&0
"$program" "$@" 3<&- </dev/null >/dev/null 2>&1 &
pid=$!
( read -r _ <&3; kill "$pid" 2>/dev/null ) 3<&3 &
wait "$pid"
rm -rf "$dir"
"#;

/// The server program: `$TOLLGATE_REDIS_SERVER`, or `redis-server` on PATH.
pub fn server_program() -> String {
    program("TOLLGATE_REDIS_SERVER", "redis-server")
}

/// The client program that makes clusters: `$TOLLGATE_REDIS_CLI`, or `redis-cli` on PATH.
pub fn cli_program() -> String {
    program("TOLLGATE_REDIS_CLI", "redis-cli")
}

fn program(variable: &str, default: &str) -> String {
    match std::env::var(variable) {
        Ok(path) if !path.is_empty() => path,
        _ => default.to_owned(),
    }
}

fn require(variable: &str, program: &str) {
    let found = Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    assert!(
        found,
        "`{program}` could not be run (it comes from ${variable}, or PATH when that is unset). \
         The Redis tests start their own Redis servers: install Redis (Debian/Ubuntu: apt-get \
         install redis-server redis-tools; macOS: brew install redis) or run ./scripts/test.sh, \
         which installs it; or set ${variable} to the program's path."
    );
}

/// Which server the tests run, as its `INFO server` tells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Server {
    /// `redis` or `valkey` (`server_name`, which Redis does not give).
    pub name: String,
    /// The version of that server (`valkey_version` on Valkey, `redis_version` on Redis).
    pub version: (u32, u32, u32),
}

impl Server {
    /// Whether the server has functions (`FUNCTION LOAD`, `FCALL`): Redis 7.0 and later, and
    /// every Valkey. Without them, the stores run the same code as a script (`EVALSHA`).
    pub fn has_functions(&self) -> bool {
        self.name == "valkey" || self.version >= (7, 0, 0)
    }

    /// Whether a cluster node takes `--cluster-port` (Redis 7.0 and later, every Valkey); before,
    /// its bus is always on its port + 10000.
    pub fn has_cluster_port(&self) -> bool {
        self.name == "valkey" || self.version >= (7, 0, 0)
    }

    /// The calls of tollgate's code that `server` ran: `FCALL`s where the server has functions,
    /// `EVALSHA`s where it has not (`INFO commandstats`).
    pub fn code_calls(&self, server: &RedisServer) -> u64 {
        let command = if self.has_functions() {
            "fcall"
        } else {
            "evalsha"
        };
        command_calls(&mut server.conn(), command)
    }

    /// The commands that make `server` lose tollgate's code, as a restart would: `SCRIPT FLUSH`,
    /// and `FUNCTION FLUSH` where the server has functions.
    pub fn flush_code_commands(&self) -> Vec<redis::Cmd> {
        let mut commands = vec![redis::cmd("SCRIPT").arg("FLUSH").clone()];
        if self.has_functions() {
            commands.push(redis::cmd("FUNCTION").arg("FLUSH").clone());
        }
        commands
    }
}

impl std::fmt::Display for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (major, minor, patch) = self.version;
        write!(f, "{} {major}.{minor}.{patch}", self.name)
    }
}

/// The calls of `command` (lower case) the server on `conn` ran, by `INFO commandstats`; 0 when
/// it has run none.
pub fn command_calls(conn: &mut redis::Connection, command: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(conn)
        .expect("INFO commandstats");
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:")))
        .and_then(|l| l.split("calls=").nth(1))
        .and_then(|v| v.split(',').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The server the tests run (see [`server_program`]), asked once per test binary: a server of
/// its own is started and its `INFO server` read.
pub fn server() -> &'static Server {
    static SERVER: OnceLock<Server> = OnceLock::new();
    SERVER.get_or_init(|| {
        let probe = RedisServer::start();
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query(&mut probe.conn())
            .expect("INFO server");
        parse_info_server(&info)
            .unwrap_or_else(|| panic!("no server name and version in INFO server: {info}"))
    })
}

/// The server's name and version from an `INFO server` reply.
fn parse_info_server(info: &str) -> Option<Server> {
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
    };
    let name = field("server_name").unwrap_or("redis").to_ascii_lowercase();
    let version = match name.as_str() {
        "valkey" => field("valkey_version")?,
        _ => field("redis_version")?,
    };
    let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
    let mut next = || parts.next().flatten();
    Some(Server {
        name,
        version: (next()?, next().unwrap_or(0), next().unwrap_or(0)),
    })
}

/// A port nobody listens on now (and, for a cluster node, a second one for its bus).
pub fn free_ports<const N: usize>() -> [u16; N] {
    let listeners: Vec<TcpListener> = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind a loopback port"))
        .collect();
    std::array::from_fn(|i| listeners[i].local_addr().unwrap().port())
}

/// A free port whose cluster bus (the port + 10000, on servers without `--cluster-port`) is
/// free too.
fn free_port_with_bus() -> u16 {
    // Held until the end, so that no two candidates are the same port.
    let mut held = Vec::new();
    for _ in 0..1000 {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let port = listener.local_addr().unwrap().port();
        held.push(listener);
        if let Some(bus) = port.checked_add(10_000)
            && TcpListener::bind(("127.0.0.1", bus)).is_ok()
        {
            return port;
        }
    }
    panic!("no free loopback port whose port + 10000 is free too (for the cluster bus)");
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
        let program = server_program();
        require("TOLLGATE_REDIS_SERVER", &program);
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
            .arg(&program)
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
                return Err(format!("{program} on port {port} exited ({status}): {log}"));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "{program} on port {port} did not answer PING in 10 s"
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
        Self::start_announcing_with(replicas, node_timeout_ms, extra, |_, _| None)
    }

    /// 3 primaries, no replicas, a node timeout of 5 s, each node announcing the client port
    /// `announce(index, port)` gives it (a proxy in front of it, which must forward to `port`),
    /// so that clients reach it only through that port. Set when each node starts, as every
    /// server shows it (Redis before 7.0 shows a port changed at runtime to the other nodes
    /// only); returns once every node tells every announced port.
    pub fn start_announcing(mut announce: impl FnMut(usize, u16) -> u16) -> RedisCluster {
        let mut announced = Vec::new();
        let cluster = Self::start_announcing_with(0, 5000, &[], |i, port| {
            let to = announce(i, port);
            announced.truncate(i);
            announced.push(to);
            Some(to)
        });
        cluster.wait_announced(&announced);
        cluster
    }

    fn start_announcing_with(
        replicas: usize,
        node_timeout_ms: u32,
        extra: &[&str],
        mut announce: impl FnMut(usize, u16) -> Option<u16>,
    ) -> RedisCluster {
        require("TOLLGATE_REDIS_CLI", &cli_program());
        let mut last_error = String::new();
        for _ in 0..3 {
            match Self::try_start(replicas, node_timeout_ms, extra, &mut announce) {
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
        announce: &mut dyn FnMut(usize, u16) -> Option<u16>,
    ) -> Result<RedisCluster, String> {
        let node_timeout = node_timeout_ms.to_string();
        let cluster_port = server().has_cluster_port();
        let mut nodes = Vec::new();
        for i in 0..3 * (1 + replicas) {
            let mut args = vec![
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                &node_timeout,
            ];
            let (port, bus) = if cluster_port {
                let [port, bus] = free_ports::<2>();
                (port, Some(bus.to_string()))
            } else {
                (free_port_with_bus(), None)
            };
            if let Some(bus) = &bus {
                args.extend_from_slice(&["--cluster-port", bus]);
            }
            let announced = announce(i, port).map(|to| to.to_string());
            if let Some(to) = &announced {
                args.extend_from_slice(&["--cluster-announce-port", to]);
            }
            args.extend_from_slice(extra);
            nodes.push(RedisServer::start_on(port, &args)?);
        }
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let output = Command::new(cli_program())
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

    /// Waits until every node tells every one of `ports` as a node's client port.
    fn wait_announced(&self, ports: &[u16]) {
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
