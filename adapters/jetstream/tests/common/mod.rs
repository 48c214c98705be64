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
