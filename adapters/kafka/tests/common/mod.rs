//! Helpers shared by the Kafka adapter's real-broker tests. Each test binary uses some of them.
#![allow(dead_code)]

use std::future::Future;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use onceflow_core::{
    ConsumerConfig, Delivery, Message, PlatformBackend, ProducerBackend, ProducerConfig, StartFrom,
    TopicSpec,
};
use onceflow_kafka::KafkaPlatform;

/// The broker URL's environment variable (`tests/brokers/up.sh kafka` prints it).
pub const URL_VAR: &str = "ONCEFLOW_KAFKA_URL";

/// The broker URL, or `None` (the test is skipped, said on stderr) when [`URL_VAR`] is not
/// set. With `ONCEFLOW_REQUIRE_BROKERS=1` (CI) a missing URL fails the test instead.
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

/// Turns a hang into a failure; not a speed assertion.
pub const HANG_GUARD: Duration = Duration::from_secs(300);

/// Runs `body` under [`HANG_GUARD`].
pub async fn guarded<F: Future<Output = ()>>(test: &str, body: F) {
    tokio::time::timeout(HANG_GUARD, body)
        .await
        .unwrap_or_else(|_| panic!("{test} hung: no result after {HANG_GUARD:?}"));
}

/// `url` with one more `KEY=VALUE` option.
pub fn with_option(url: &str, option: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{option}")
}

/// The platform of a Kafka URL.
pub fn platform(url: &str) -> Arc<KafkaPlatform> {
    onceflow_kafka::connect(url).expect("Kafka URL")
}

/// A new topic with `partitions` partitions.
pub async fn topic(p: &KafkaPlatform, partitions: u32) -> String {
    let t = name("kafka-test");
    p.admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(t.clone(), partitions))
        .await
        .unwrap();
    t
}

/// A producer with the default configuration.
pub async fn producer(p: &KafkaPlatform) -> Arc<dyn ProducerBackend> {
    p.producer(ProducerConfig::default()).await.unwrap()
}

/// Reads `topic` from the start with a new group (read_committed), see [`read_topics`].
pub async fn read(p: &KafkaPlatform, topic: &str, n: usize) -> Vec<Message> {
    read_topics(p, &[topic], n).await
}

/// Reads `topics` from the start with a new group (read_committed) until `n` messages are in,
/// or nothing new came for 30 s; then whatever more shows up within 3 s (a duplicate, or an
/// aborted record, would).
pub async fn read_topics(p: &KafkaPlatform, topics: &[&str], n: usize) -> Vec<Message> {
    let c = p
        .consumer(ConsumerConfig {
            group: name("kafka-test-reader"),
            topics: topics.iter().map(|t| t.to_string()).collect(),
            start: StartFrom::Earliest,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut out = Vec::new();
    let mut idle_since = tokio::time::Instant::now();
    while out.len() < n && idle_since.elapsed() < Duration::from_secs(30) {
        let got = c.poll(10_000, Duration::from_millis(250)).await.unwrap();
        if !got.is_empty() {
            idle_since = tokio::time::Instant::now();
        }
        out.extend(got);
    }
    out.extend(c.poll(10_000, Duration::from_secs(3)).await.unwrap());
    c.close().await.unwrap();
    out
}

/// A message's payload as text.
pub fn payload(m: &Message) -> String {
    String::from_utf8_lossy(&m.payload).into_owned()
}

/// A delivery's Kafka offset.
pub fn offset(d: &Delivery) -> i64 {
    d.position.as_offset().expect("a Kafka offset")
}
