//! Helpers shared by the Kafka adapter's real-broker tests.

use std::io::Write;

/// The broker URL's environment variable (`tests/brokers/up.sh kafka` prints it).
pub const URL_VAR: &str = "ONCEFLOW_KAFKA_URL";

/// The broker URL, or `None` (the test is skipped, said on stderr) when [`URL_VAR`] is not
/// set. With `ONCEFLOW_REQUIRE_BROKERS=1` (CI) a missing URL fails the test instead.
#[allow(dead_code)] // not every test binary reads the URL through it
pub fn url(test: &str) -> Option<String> {
    match std::env::var(URL_VAR) {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var("ONCEFLOW_REQUIRE_BROKERS").as_deref() != Ok("1"),
                "ONCEFLOW_REQUIRE_BROKERS=1 but {URL_VAR} is not set"
            );
            // Straight to stderr, past the test harness's capture, so the skip is seen.
            let _ = writeln!(
                std::io::stderr(),
                "onceflow-kafka: SKIPPED {test}: {URL_VAR} is not set (start a broker with \
                 tests/brokers/up.sh kafka)"
            );
            None
        }
    }
}

/// A unique name (topic, group, transactional id) starting with `prefix`.
pub fn name(prefix: &str) -> String {
    format!("{prefix}-{:016x}", rand::random::<u64>())
}
