//! The examples, run as a user runs them: the binary `cargo test` built, on a free loopback
//! port, stopped when dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The example binary, next to the test's in the target directory.
pub fn binary(name: &str) -> PathBuf {
    let test = std::env::current_exe().unwrap();
    let dir = test.parent().unwrap().parent().unwrap();
    let binary = dir.join("examples").join(name);
    assert!(
        binary.exists(),
        "{} is missing: `cargo test` builds the examples (or run cargo build --examples --all-features)",
        binary.display()
    );
    binary
}

/// A running example; killed when dropped.
pub struct Example {
    child: Child,
    /// The address it listens on.
    pub addr: String,
}

impl Example {
    /// Starts example `name` with `TOLLGATE_ADDR` (or `addr_variable`) set to a free loopback
    /// port and these other variables, and waits up to 20 s for it to accept connections.
    pub fn start(name: &str, addr_variable: &str, env: &[(&str, &str)]) -> Example {
        let port = super::free_ports::<1>()[0];
        let addr = format!("127.0.0.1:{port}");
        let mut command = Command::new(binary(name));
        command
            .env(addr_variable, &addr)
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        for (name, value) in env {
            command.env(name, value);
        }
        let child = command.spawn().unwrap();
        let example = Example { child, addr };
        let start = Instant::now();
        while std::net::TcpStream::connect(&example.addr).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "the example {name} did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        example
    }

    /// What it printed so far on its standard output, after it is stopped.
    pub fn stop(mut self) -> String {
        let _ = self.child.kill();
        let mut out = String::new();
        if let Some(mut stdout) = self.child.stdout.take() {
            let _ = std::io::Read::read_to_string(&mut stdout, &mut out);
        }
        out
    }
}

impl Drop for Example {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
