//! A client-certificate (mTLS) Pulsar connection, through onceflow's loopback bridge, on the
//! real Pulsar standalone of `tests/brokers/up.sh pulsar` (`ONCEFLOW_PULSAR_TLS_URL`,
//! `_TLS_ADMIN_URL`, `_TLS_CA`, `_CLIENT_CERT`, `_CLIENT_KEY`, `_ROGUE_CLIENT_CERT`,
//! `_ROGUE_CLIENT_KEY`), with every log line captured (`onceflow_conformance::logs`): a run
//! ends without an ERROR line, whichever way its producers and consumers end (closed, or
//! dropped), what the pulsar crate logs names the broker, and a refused certificate is said
//! once, by onceflow's error. The tests of this binary run one at a time: each reads the lines
//! logged while it ran.

use std::time::{Duration, Instant};

use onceflow_conformance::harness::broker_url;
use onceflow_conformance::logs;
use onceflow_core::{Client, ConsumerConfig, ErrorKind, ProducerConfig, Record, StartFrom};
use onceflow_core::{PlatformBackend, TopicSpec};

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Env {
    url: String,
    admin: String,
    ca: String,
    cert: String,
    key: String,
    rogue_cert: String,
    rogue_key: String,
}

fn env() -> Option<Env> {
    let url = match broker_url("ONCEFLOW_PULSAR_TLS_URL", "pulsar") {
        Ok(u) => u,
        Err(reason) => {
            eprintln!("pulsar_mtls_quiet: SKIPPED: {reason}");
            return None;
        }
    };
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"));
    Some(Env {
        url,
        admin: var("ONCEFLOW_PULSAR_TLS_ADMIN_URL"),
        ca: var("ONCEFLOW_PULSAR_TLS_CA"),
        cert: var("ONCEFLOW_PULSAR_CLIENT_CERT"),
        key: var("ONCEFLOW_PULSAR_CLIENT_KEY"),
        rogue_cert: var("ONCEFLOW_PULSAR_ROGUE_CLIENT_CERT"),
        rogue_key: var("ONCEFLOW_PULSAR_ROGUE_CLIENT_KEY"),
    })
}

fn enc(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

impl Env {
    fn mtls_url(&self, cert: &str, key: &str) -> String {
        format!(
            "{}?admin={}&tls_trust_certs={}&tls_cert_file={}&tls_key_file={}",
            self.url,
            enc(&self.admin),
            enc(&self.ca),
            enc(cert),
            enc(key)
        )
    }

    /// The broker's `host:port`, as the service URL names it.
    fn broker(&self) -> String {
        let u = url::Url::parse(&self.url).unwrap();
        format!("{}:{}", u.host_str().unwrap(), u.port().unwrap_or(6651))
    }
}

/// The ERROR lines among `lines`.
fn errors(lines: &str) -> Vec<&str> {
    lines.lines().filter(|l| l.contains(" ERROR ")).collect()
}

/// Waits (at most 15 s) until `what` is logged after `mark`; the lines since `mark`.
async fn logged(mark: usize, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let lines = logs::captured()[mark..].to_string();
        if lines.contains(what) {
            return lines;
        }
        assert!(
            Instant::now() < deadline,
            "'{what}' not logged within 15 s:\n{lines}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A run over mTLS: a partitioned topic written and read, one consumer closed and one dropped
/// while it holds its partitions, the producer dropped without a close, then the platform.
/// Before, the bridge stopped with the platform, before the pulsar crate had sent the closes
/// of what was dropped (from tasks of its own) and closed its connections: an ERROR line
/// per producer and consumer ("could not close producer …: Disconnected"). The crate's
/// per-attempt "Retry #0 -> connecting …" warning named only the bridge's loopback port; the
/// URL it is given now names the broker too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mtls_run_ends_without_an_error_line() {
    let _serial = SERIAL.lock().await;
    logs::capture();
    let Some(env) = env() else { return };
    let mark = logs::captured().len();
    let platform = onceflow_pulsar::connect(&env.mtls_url(&env.cert, &env.key))
        .await
        .unwrap();
    let topic = format!("mtls-quiet-{:08x}", rand::random::<u32>());
    platform
        .admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(topic.clone(), 4))
        .await
        .unwrap();
    let client = Client::new(platform);
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    for i in 0..40 {
        producer
            .send(Record::new(topic.clone(), format!("v{i}")).key(format!("k{i}")))
            .await
            .unwrap();
    }
    let read = |group: String| {
        let client = client.clone();
        let topic = topic.clone();
        async move {
            let consumer = client
                .consumer(ConsumerConfig::new(group, [topic]).start(StartFrom::Earliest))
                .await
                .unwrap();
            let deadline = Instant::now() + Duration::from_secs(30);
            let mut got = 0;
            while got < 40 && Instant::now() < deadline {
                let batch = consumer
                    .poll(100, Duration::from_millis(300))
                    .await
                    .unwrap();
                got += batch.len();
                let last: Vec<_> = batch
                    .iter()
                    .map(|m| (m.topic_partition(), m.position.clone()))
                    .collect();
                if !last.is_empty() {
                    consumer.commit(&last).await.unwrap();
                }
            }
            assert_eq!(got, 40);
            consumer
        }
    };
    // Closed, then dropped.
    let closed = read(format!("{topic}-closed")).await;
    closed.close().await.unwrap();
    drop(closed);
    // Dropped while it holds its partitions, as a program that ends without closing does.
    let dropped = read(format!("{topic}-dropped")).await;
    drop(dropped);
    drop(producer);
    drop(client);
    logged(mark, "Pulsar bridge: stopped").await;
    // What the crate would log after the bridge stopped has come by now.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let lines = logs::captured()[mark..].to_string();
    assert!(errors(&lines).is_empty(), "{:#?}", errors(&lines));
    let stopped = lines
        .lines()
        .find(|l| l.contains("Pulsar bridge: stopped"))
        .unwrap();
    eprintln!("{stopped}");
    assert!(
        stopped.contains("still_open=0"),
        "the crate had not closed its connections: {stopped}"
    );
    // What the crate logs about its connections names the broker.
    let broker = format!("mtls-bridge-to/{}", env.broker());
    let retries: Vec<&str> = lines.lines().filter(|l| l.contains("Retry #")).collect();
    assert!(!retries.is_empty(), "no 'Retry #' line captured:\n{lines}");
    for l in retries {
        assert!(l.contains(&broker), "{l}");
    }
}

/// A client certificate the broker does not trust is one `Auth` error, found before the
/// pulsar crate connects: no ERROR line of the crate repeating it (before, the crate logged
/// "connection error, not retryable: [… the same text …]" and onceflow returned it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_client_certificate_is_said_once() {
    let _serial = SERIAL.lock().await;
    logs::capture();
    let Some(env) = env() else { return };
    let mark = logs::captured().len();
    let e = onceflow_pulsar::connect(&env.mtls_url(&env.rogue_cert, &env.rogue_key))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Auth, "{e}");
    assert!(e.message().contains(&env.broker()), "{e}");
    // The bridge stops once nothing goes through it any more.
    let lines = logged(mark, "Pulsar bridge: stopped").await;
    assert!(errors(&lines).is_empty(), "{:#?}", errors(&lines));
}
