//! Helpers shared by the JetStream adapter's real-server tests.

#![allow(dead_code)] // each test binary uses some of them

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use onceflow_core::{ConsumerBackend, Message, PlatformBackend, TopicSpec};
use onceflow_jetstream::JetStreamPlatform;

/// The server URL's environment variable (`tests/brokers/up.sh nats` prints it).
pub const URL_VAR: &str = "ONCEFLOW_NATS_URL";

/// A connection to the server at [`URL_VAR`], or `None` (the test is skipped, said on stderr)
/// when it is not set. With `ONCEFLOW_REQUIRE_BROKERS=1` (CI) a missing URL fails the test.
pub async fn platform(test: &str) -> Option<Arc<JetStreamPlatform>> {
    match std::env::var(URL_VAR) {
        Ok(url) if !url.is_empty() => Some(
            onceflow_jetstream::connect(&url)
                .await
                .unwrap_or_else(|e| panic!("{URL_VAR}='{url}': {e}")),
        ),
        _ => {
            assert!(
                std::env::var("ONCEFLOW_REQUIRE_BROKERS").as_deref() != Ok("1"),
                "ONCEFLOW_REQUIRE_BROKERS=1 but {URL_VAR} is not set (tests/brokers/up.sh nats)"
            );
            // Straight to stderr (not captured by the test harness): a skip is never silent.
            let _ = writeln!(
                std::io::stderr(),
                "{}: SKIPPED {test}: {URL_VAR} is not set (start a server with \
                 tests/brokers/up.sh nats)",
                env!("CARGO_CRATE_NAME")
            );
            None
        }
    }
}

/// `prefix` and 16 random hex digits: a name no other test run uses.
pub fn name(prefix: &str) -> String {
    format!("{prefix}-{:016x}", rand::random::<u64>())
}

/// A new topic (a stream) named after `prefix`, with `partitions` subjects.
pub async fn topic(p: &JetStreamPlatform, prefix: &str, partitions: u32) -> String {
    let t = name(prefix);
    p.admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(t.clone(), partitions))
        .await
        .unwrap();
    t
}

/// Polls `c` until `n` messages arrived; fails after 60 s.
pub async fn take(c: &dyn ConsumerBackend, n: usize) -> Vec<Message> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut out = Vec::new();
    while out.len() < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "expected {n} messages, got {}",
            out.len()
        );
        out.extend(c.poll(1000, Duration::from_millis(200)).await.unwrap());
    }
    out
}

/// A nats-server of this test's own on a free loopback port (the binary the harness installs,
/// `tests/brokers/nats/up.sh`), so restarting it disturbs no other test. Killed on drop.
pub struct PrivateServer {
    bin: std::path::PathBuf,
    port: u16,
    dir: std::path::PathBuf,
    child: Option<std::process::Child>,
}

impl PrivateServer {
    /// `None` (the test skips, said on stderr) when the harness' binary is not installed.
    pub fn new(test: &str) -> Option<PrivateServer> {
        let cache = std::env::var("ONCEFLOW_CACHE_DIR").unwrap_or_else(|_| {
            format!(
                "{}/.cache/onceflow",
                std::env::var("HOME").unwrap_or_else(|_| "/tmp".into())
            )
        });
        let bin = std::path::PathBuf::from(cache).join("venv-nats/bin/nats-server");
        if !bin.exists() {
            eprintln!(
                "SKIPPED {test}: no {} (tests/brokers/up.sh nats installs it)",
                bin.display()
            );
            return None;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(name("onceflow-nats"));
        Some(PrivateServer {
            bin,
            port,
            dir,
            child: None,
        })
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts the server, with JetStream (on its store directory) or without, and waits
    /// until it accepts connections.
    pub async fn start(&mut self, jetstream: bool) {
        let mut cmd = std::process::Command::new(&self.bin);
        cmd.args(["-a", "127.0.0.1", "-p", &self.port.to_string()]);
        if jetstream {
            cmd.args(["-js", "-sd"]).arg(&self.dir);
        }
        cmd.stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        self.child = Some(cmd.spawn().unwrap());
        for _ in 0..100 {
            if tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                .await
                .is_ok()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("private nats-server on port {} did not start", self.port);
    }

    /// SIGSTOP (`freeze: true`) or SIGCONT: a server that hangs with its connections open,
    /// which a client notices only by what stops coming (idle heartbeats, pings).
    pub fn freeze(&self, freeze: bool) {
        let pid = self.child.as_ref().expect("the server runs").id();
        let sig = if freeze { "-STOP" } else { "-CONT" };
        let status = std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill {sig} {pid}");
    }

    /// SIGKILL, as a crash.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Waits until the client is connected again after a server restart.
pub async fn reconnected(p: &JetStreamPlatform) {
    for _ in 0..200 {
        if p.nats_client().connection_state() == async_nats::connection::State::Connected {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the client did not reconnect");
}
