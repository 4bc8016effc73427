//! TLS for the Redis tests: certificates made with the `openssl` command (a CA, a server
//! certificate for 127.0.0.1 and localhost, a client certificate, and a CA that signed neither),
//! `redis-server` processes that also listen for TLS (`--tls-port`), a 3-primary cluster whose
//! nodes tell TLS ports to TLS clients (`--tls-cluster yes`), and ACL users.
//!
//! Each server keeps a plain port on loopback too, for the test's own checks and set-up (its
//! default user has every right there); the stores under test are given only TLS ports.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::{RedisServer, free_ports};

/// PEM text of the certificates and keys the tests use, and the files the servers read.
pub struct Certificates {
    /// The CA that signed the server and client certificates.
    pub ca: Vec<u8>,
    /// A CA that signed nothing the servers present.
    pub other_ca: Vec<u8>,
    /// The client certificate and its key.
    pub client_cert: Vec<u8>,
    pub client_key: Vec<u8>,
    /// The server's files: certificate, key, CA.
    dir: PathBuf,
}

impl Certificates {
    fn path(&self, name: &str) -> String {
        self.dir.join(name).to_string_lossy().into_owned()
    }
}

/// The certificates of this test binary, made once (in the target directory's test space).
pub fn certificates() -> &'static Certificates {
    static CERTIFICATES: OnceLock<Certificates> = OnceLock::new();
    CERTIFICATES.get_or_init(make_certificates)
}

fn openssl(dir: &Path, args: &[&str]) {
    let output = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run `openssl` ({e}): the TLS tests make their certificates with it; \
                 install it (Debian/Ubuntu: apt-get install openssl; macOS: brew install openssl)"
            )
        });
    assert!(
        output.status.success(),
        "openssl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
}

fn make_certificates() -> Certificates {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "tollgate-tls-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    remove_old_certificates(dir.parent().expect("the test space"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the certificates' directory");
    let key = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    for (name, subject) in [
        ("ca", "/CN=tollgate test CA"),
        ("other-ca", "/CN=tollgate other CA"),
    ] {
        let (keyout, out) = (format!("{name}.key"), format!("{name}.crt"));
        let mut args = vec!["req", "-x509"];
        args.extend_from_slice(&key);
        args.extend_from_slice(&[
            "-keyout",
            &keyout,
            "-out",
            &out,
            "-days",
            "2",
            "-subj",
            subject,
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ]);
        openssl(&dir, &args);
    }
    // The server's certificate serves the cluster bus too (nodes present it to each other), so
    // it is good for both ends.
    for (name, subject, usage) in [
        ("server", "/CN=localhost", "serverAuth,clientAuth"),
        ("client", "/CN=tollgate", "clientAuth"),
    ] {
        let mut args = vec!["req"];
        args.extend_from_slice(&key);
        let (keyout, csr) = (format!("{name}.key"), format!("{name}.csr"));
        args.extend_from_slice(&["-keyout", &keyout, "-out", &csr, "-subj", subject]);
        openssl(&dir, &args);
        let extensions = format!(
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
             keyUsage=critical,digitalSignature\nextendedKeyUsage={usage}\n"
        );
        let ext = format!("{name}.ext");
        std::fs::write(dir.join(&ext), extensions).expect("write the extensions");
        openssl(
            &dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                &ext,
                "-out",
                &format!("{name}.crt"),
            ],
        );
    }
    let read = |name: &str| std::fs::read(dir.join(name)).expect("read a certificate");
    Certificates {
        ca: read("ca.crt"),
        other_ca: read("other-ca.crt"),
        client_cert: read("client.crt"),
        client_key: read("client.key"),
        dir,
    }
}

/// Removes the certificates of earlier runs (a day old), which no server reads any more.
fn remove_old_certificates(space: &Path) {
    let Ok(entries) = std::fs::read_dir(space) else {
        return;
    };
    for entry in entries.flatten() {
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|modified| modified.elapsed().ok())
            .is_some_and(|age| age > Duration::from_secs(24 * 3600));
        if old
            && entry
                .file_name()
                .to_string_lossy()
                .starts_with("tollgate-tls-")
        {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Whether clients must present a certificate.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ClientCerts {
    Required,
    Optional,
}

/// The `redis-server` arguments of TLS on `tls_port`.
fn tls_args(certs: &Certificates, tls_port: u16, clients: ClientCerts) -> Vec<String> {
    vec![
        "--tls-port".into(),
        tls_port.to_string(),
        "--tls-cert-file".into(),
        certs.path("server.crt"),
        "--tls-key-file".into(),
        certs.path("server.key"),
        "--tls-ca-cert-file".into(),
        certs.path("ca.crt"),
        "--tls-auth-clients".into(),
        match clients {
            ClientCerts::Required => "yes",
            ClientCerts::Optional => "optional",
        }
        .into(),
    ]
}

/// A server that also listens for TLS.
pub struct TlsServer {
    pub server: RedisServer,
    pub tls_port: u16,
}

impl TlsServer {
    /// A standalone server with TLS on a port of its own.
    pub fn start(clients: ClientCerts) -> TlsServer {
        let certs = certificates();
        let mut last_error = String::new();
        for _ in 0..5 {
            let [port, tls_port] = free_ports::<2>();
            let args = tls_args(certs, tls_port, clients);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            match RedisServer::start_on(port, &args) {
                Ok(server) => return TlsServer { server, tls_port },
                Err(e) => last_error = e,
            }
        }
        panic!("could not start redis-server with TLS: {last_error}");
    }

    /// `rediss://127.0.0.1:<tls port>`, with no user.
    pub fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.tls_port)
    }
}

/// A cluster of 3 primaries whose nodes speak TLS to clients and to each other.
pub struct TlsCluster {
    pub nodes: Vec<TlsServer>,
}

impl TlsCluster {
    pub fn start() -> TlsCluster {
        let mut last_error = String::new();
        for _ in 0..3 {
            match Self::try_start() {
                Ok(cluster) => return cluster,
                Err(e) => last_error = e,
            }
        }
        panic!("could not start a Redis Cluster with TLS: {last_error}");
    }

    fn try_start() -> Result<TlsCluster, String> {
        let certs = certificates();
        let mut nodes = Vec::new();
        for _ in 0..3 {
            let [port, tls_port, bus] = free_ports::<3>();
            let mut args: Vec<String> = [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-port",
                &bus.to_string(),
                "--cluster-node-timeout",
                "5000",
                "--tls-cluster",
                "yes",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            args.extend(tls_args(certs, tls_port, ClientCerts::Optional));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let server = RedisServer::start_on(port, &args)?;
            nodes.push(TlsServer { server, tls_port });
        }
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.server.port))
            .collect();
        let output = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addresses)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
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
        let cluster = TlsCluster { nodes };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !cluster.is_ready() {
            if Instant::now() > deadline {
                return Err("the TLS cluster did not reach cluster_state:ok in 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(cluster)
    }

    fn is_ready(&self) -> bool {
        self.nodes.iter().all(|node| {
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query(&mut node.server.conn())
                .unwrap_or_default();
            info.contains("cluster_state:ok")
                && info.contains("cluster_slots_assigned:16384")
                && info.contains("cluster_known_nodes:3")
        })
    }

    /// The URL of each node's TLS port, with no user.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(TlsServer::url).collect()
    }
}

/// The TLS cluster shared by the tests of one test binary.
pub fn cluster() -> &'static TlsCluster {
    static CLUSTER: OnceLock<TlsCluster> = OnceLock::new();
    CLUSTER.get_or_init(TlsCluster::start)
}

/// Makes (or remakes) the ACL user `name` with `password`, the keys under `prefix:` and only
/// the commands `commands` (ACL rules such as `+evalsha`, `+cluster|slots`), on `server`.
pub fn acl_user(server: &RedisServer, name: &str, password: &str, prefix: &str, commands: &[&str]) {
    let mut cmd = redis::cmd("ACL");
    cmd.arg("SETUSER")
        .arg(name)
        .arg("reset")
        .arg("on")
        .arg(format!(">{password}"))
        .arg(format!("~{prefix}:*"))
        .arg("resetchannels")
        .arg(format!("&{prefix}:forget"))
        .arg("-@all");
    for command in commands {
        cmd.arg(*command);
    }
    let _: () = cmd
        .query(&mut server.conn())
        .unwrap_or_else(|e| panic!("ACL SETUSER {name} {commands:?}: {e}"));
}

/// The connections of user `name` on `server`, each by the local port it reached
/// (`CLIENT LIST`'s `laddr`).
pub fn ports_of_user(server: &RedisServer, name: &str) -> Vec<u16> {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut server.conn())
        .expect("CLIENT LIST");
    list.lines()
        .filter(|line| line.split(' ').any(|field| field == format!("user={name}")))
        .filter_map(|line| {
            line.split(' ')
                .find_map(|field| field.strip_prefix("laddr="))
                .and_then(|addr| addr.rsplit_once(':'))
                .and_then(|(_, port)| port.parse().ok())
        })
        .collect()
}

/// The commands `ACL LOG` says user `name` was refused on `server` (`command|subcommand` or
/// `key`/`channel` refusals, by object).
pub fn refused_for_user(server: &RedisServer, name: &str) -> Vec<String> {
    let log: Vec<redis::Value> = redis::cmd("ACL")
        .arg("LOG")
        .query(&mut server.conn())
        .expect("ACL LOG");
    let text = |value: &redis::Value| match value {
        redis::Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        redis::Value::SimpleString(text) => text.clone(),
        other => format!("{other:?}"),
    };
    log.iter()
        .filter_map(|entry| {
            let redis::Value::Array(fields) = entry else {
                return None;
            };
            let field = |name: &str| {
                fields
                    .chunks(2)
                    .find(|pair| text(&pair[0]) == name)
                    .map(|pair| text(&pair[1]))
            };
            (field("username").as_deref() == Some(name)).then(|| {
                format!(
                    "{} {}",
                    field("reason").unwrap_or_default(),
                    field("object").unwrap_or_default()
                )
            })
        })
        .collect()
}
