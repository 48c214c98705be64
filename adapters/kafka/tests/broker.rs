//! Kafka-specific behaviour on a real broker, beyond the shared conformance suite: topic
//! settings, transactional producer rules, raw option pass-through and the exactly-once
//! pipeline of the engine. Runs when `ONCEFLOW_KAFKA_URL` is set
//! (`tests/brokers/up.sh kafka`); otherwise each test prints that it skipped and why.

mod common;

use common::{name, payload, read, topic};
use std::collections::BTreeSet;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use onceflow_core::{
    BoxError, Client, ConsumerConfig, ErrorKind, Guarantee, Isolation, Message, Pipeline,
    PlatformBackend, ProducerConfig, Record, TopicSpec, Transform,
};
use onceflow_kafka::KafkaPlatform;

const URL_VAR: &str = "ONCEFLOW_KAFKA_URL";

fn platform(test: &str) -> Option<Arc<KafkaPlatform>> {
    match std::env::var(URL_VAR) {
        Ok(url) if !url.is_empty() => Some(onceflow_kafka::connect(&url).expect("Kafka URL")),
        _ => {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_settings_round_trip() {
    let Some(p) = platform("topic_settings_round_trip") else {
        return;
    };
    let admin = p.admin().await.unwrap();
    let t = name("kafka-admin");
    let spec = TopicSpec {
        retention_ms: Some(3_600_000),
        retention_bytes: Some(10 * 1024 * 1024),
        compacted: true,
        ..TopicSpec::new(t.clone(), 2)
    };
    admin.create_topic(&spec).await.unwrap();
    let d = admin.describe_topic(&t).await.unwrap();
    assert_eq!(d.partitions, 2);
    assert_eq!(d.retention_ms, Some(3_600_000));
    assert_eq!(d.retention_bytes, Some(10 * 1024 * 1024));
    assert!(d.compacted);
    assert_eq!(
        d.options.get("cleanup.policy").map(String::as_str),
        Some("compact")
    );
    admin.create_topic(&spec).await.unwrap();
    let e = admin
        .create_topic(&TopicSpec::new(t.clone(), 2))
        .await
        .expect_err("same name, not compacted");
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    let e = admin
        .create_topic(&TopicSpec::new("bad name!", 1))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.message().contains("bad name!"), "{e}");
    admin.delete_topic(&t).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_producer_rules() {
    let Some(p) = platform("transactional_producer_rules") else {
        return;
    };
    let t = topic(&p, 1).await;
    let producer = p
        .producer(ProducerConfig {
            transactional_id: Some(name("kafka-tx")),
            ..Default::default()
        })
        .await
        .unwrap();
    let e = producer
        .send(Record::new(t.clone(), "outside"))
        .await
        .expect_err("a transactional producer writes only inside transactions");
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");

    // A transaction dropped while open is aborted; the producer goes on.
    {
        let mut tx = producer.begin().await.unwrap();
        tx.send(Record::new(t.clone(), "dropped")).await.unwrap();
    }
    let mut tx = producer.begin().await.unwrap();
    tx.send(Record::new(t.clone(), "kept")).await.unwrap();
    tx.commit().await.unwrap();
    let got = read(&p, &t, 1).await;
    assert_eq!(got.iter().map(payload).collect::<Vec<_>>(), ["kept"]);

    let e = p
        .producer(ProducerConfig {
            transactional_id: Some(name("kafka-tx")),
            idempotent: Some(false),
            ..Default::default()
        })
        .await
        .err()
        .expect("transactions need idempotence");
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_options_reach_librdkafka() {
    let Some(p) = platform("raw_options_reach_librdkafka") else {
        return;
    };
    let t = topic(&p, 1).await;
    let mut config = ProducerConfig::default();
    config
        .options
        .insert("compression.type".into(), "lz4".into());
    config.options.insert("linger.ms".into(), "20".into());
    let producer = p.producer(config).await.unwrap();
    let records = (0..50)
        .map(|i| Record::new(t.clone(), format!("m{i}")))
        .collect();
    for r in producer.send_batch(records).await {
        r.unwrap();
    }
    assert_eq!(read(&p, &t, 50).await.len(), 50);

    let mut bad = ProducerConfig::default();
    bad.options
        .insert("compression.type".into(), "nonsense".into());
    let e = p.producer(bad).await.err().expect("invalid property");
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.message().contains("nonsense"), "{e}");
}

/// The engine's pipeline on Kafka runs exactly-once (transactions with the input offsets) and
/// writes every input once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_pipeline() {
    let Some(p) = platform("exactly_once_pipeline") else {
        return;
    };
    let input = topic(&p, 2).await;
    let output = topic(&p, 1).await;
    let client = Client::new(p.clone());
    let plain = client.producer(ProducerConfig::default()).await.unwrap();
    for i in 0..100 {
        plain
            .send(Record::new(input.clone(), format!("in-{i}")).key(format!("k{i}")))
            .await
            .unwrap();
    }
    let consumer = client
        .consumer(ConsumerConfig {
            group: name("kafka-pipeline"),
            topics: vec![input.clone()],
            isolation: Isolation::ReadCommitted,
            ..Default::default()
        })
        .await
        .unwrap();
    let producer = client
        .producer(ProducerConfig {
            transactional_id: Some(name("kafka-pipeline-tx")),
            ..Default::default()
        })
        .await
        .unwrap();
    let out_topic = output.clone();
    let transform = UpperTo(out_topic);
    let pipeline = Pipeline::new(consumer, producer, None, transform).unwrap();
    assert_eq!(pipeline.guarantee(), Guarantee::ExactlyOnce);
    let summary = pipeline
        .run_until(tokio::time::sleep(Duration::from_secs(15)))
        .await
        .unwrap();
    assert_eq!(summary.guarantee, Guarantee::ExactlyOnce);
    let got = read(&p, &output, 100).await;
    let set: BTreeSet<String> = got.iter().map(payload).collect();
    assert_eq!(got.len(), 100, "every input once: {:?}", got.len());
    assert_eq!(set.len(), 100);
    assert!(set.contains("IN-0") && set.contains("IN-99"));
}

struct UpperTo(String);

#[async_trait]
impl Transform for UpperTo {
    async fn transform(&self, m: &Message) -> Result<Vec<Record>, BoxError> {
        Ok(vec![Record::new(
            self.0.clone(),
            m.payload.to_ascii_uppercase(),
        )])
    }
}

/// `delivery.report.only.error=true` would make librdkafka report only failed records, so a
/// successful send would never return (break test: a `send` was still pending after 15 s).
/// Refused at producer creation; needs no broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivery_reports_for_errors_only_are_refused() {
    let p = onceflow_kafka::connect("kafka://127.0.0.1:1?delivery.report.only.error=true").unwrap();
    let e = p
        .producer(ProducerConfig::default())
        .await
        .err()
        .expect("a producer that would never hear of its successful records");
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(
        e.message()
            .contains("delivery.report.only.error=true: expected false"),
        "{e}"
    );
}

/// Bytes of `n` as a zigzag varint (record format v2), counted here independently of the
/// adapter.
fn varint_len(n: usize) -> usize {
    let mut z = (n as u64) << 1;
    let mut len = 1;
    while z >= 0x80 {
        z >>= 7;
        len += 1;
    }
    len
}

/// What librdkafka compares with `message.max.bytes` (36 bytes of framing + key + payload +
/// each header's name, value and their varint lengths).
fn wire_of(r: &Record) -> usize {
    36 + r.key.as_ref().map_or(0, |k| k.len())
        + r.payload.len()
        + r.headers
            .iter()
            .map(|h| {
                let v = h.value.as_ref().map_or(0, |v| v.len());
                h.name.len() + v + varint_len(h.name.len()) + varint_len(v)
            })
            .sum::<usize>()
}

/// Record shapes around the varint boundaries of header lengths (63/64, 8191/8192), with
/// keys, null headers and many headers; each padded with payload to `wire` bytes.
fn shaped_records(topic: &str, wire: usize) -> Vec<(String, Record)> {
    let shapes: Vec<(&str, Record)> = vec![
        ("plain", Record::new(topic, Vec::<u8>::new())),
        (
            "key",
            Record::new(topic, Vec::<u8>::new()).key(vec![b'k'; 300]),
        ),
        (
            "name 63 / value 64",
            Record::new(topic, Vec::<u8>::new()).header("n".repeat(63), vec![b'v'; 64]),
        ),
        (
            "name 64 / value 63",
            Record::new(topic, Vec::<u8>::new()).header("n".repeat(64), vec![b'v'; 63]),
        ),
        (
            "value 8191",
            Record::new(topic, Vec::<u8>::new()).header("a", vec![b'v'; 8191]),
        ),
        (
            "value 8192",
            Record::new(topic, Vec::<u8>::new()).header("a", vec![b'v'; 8192]),
        ),
        ("null headers", {
            let mut r = Record::new(topic, Vec::<u8>::new()).key(vec![b'k'; 5]);
            for i in 0..50 {
                r.headers.insert_null(format!("null-{i}"));
            }
            r
        }),
        ("many headers", {
            let mut r = Record::new(topic, Vec::<u8>::new());
            for _ in 0..1000 {
                r.headers.insert("", Vec::<u8>::new());
            }
            r
        }),
    ];
    shapes
        .into_iter()
        .map(|(what, mut r)| {
            let pad = wire - wire_of(&r);
            r.payload = vec![b'x'; pad].into();
            assert_eq!(wire_of(&r), wire);
            (what.to_string(), r)
        })
        .collect()
}

/// With `message.max.bytes` = N (in the URL or in the producer's options), a record whose
/// librdkafka count is N is delivered, and one byte more is onceflow's Config error naming N
/// (never librdkafka's "Message size too large"), on plain and transactional producers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_max_bytes_is_checked_as_librdkafka_counts() {
    let Some(url) = common::url("message_max_bytes_is_checked_as_librdkafka_counts") else {
        return;
    };
    const N: usize = 20_000;
    let sep = if url.contains('?') { '&' } else { '?' };
    let limited = onceflow_kafka::connect(&format!("{url}{sep}message.max.bytes={N}")).unwrap();
    let plain = onceflow_kafka::connect(&url).unwrap();
    let t = topic(&plain, 1).await;
    let mut in_options = ProducerConfig::default();
    in_options
        .options
        .insert("message.max.bytes".into(), N.to_string());
    let producers = [
        (
            "URL",
            limited.producer(ProducerConfig::default()).await.unwrap(),
        ),
        ("options", plain.producer(in_options.clone()).await.unwrap()),
    ];
    let mut expected = 0;
    for (place, producer) in &producers {
        for (what, r) in shaped_records(&t, N) {
            producer
                .send(r)
                .await
                .unwrap_or_else(|e| panic!("{place}, {what}: at the limit: {e}"));
            expected += 1;
        }
        for (what, r) in shaped_records(&t, N + 1) {
            let e = producer.send(r).await.expect_err(&what);
            assert_eq!(e.kind(), ErrorKind::Config, "{place}, {what}: {e}");
            assert!(e.message().contains(&N.to_string()), "{place}, {what}: {e}");
        }
        let over = shaped_records(&t, N + 1).into_iter().map(|(_, r)| r);
        let at = shaped_records(&t, N).into_iter().map(|(_, r)| r);
        for (i, res) in producer
            .send_batch(over.chain(at).collect())
            .await
            .into_iter()
            .enumerate()
        {
            if i < 8 {
                assert_eq!(
                    res.unwrap_err().kind(),
                    ErrorKind::Config,
                    "{place} batch {i}"
                );
            } else {
                res.unwrap_or_else(|e| panic!("{place} batch {i}: {e}"));
                expected += 1;
            }
        }
    }
    for (place, p, mut config) in [
        ("URL", &limited, ProducerConfig::default()),
        ("options", &plain, in_options),
    ] {
        config.transactional_id = Some(name("kafka-size-tx"));
        let producer = p.producer(config).await.unwrap();
        let mut tx = producer.begin().await.unwrap();
        for (what, r) in shaped_records(&t, N) {
            tx.send(r)
                .await
                .unwrap_or_else(|e| panic!("tx {place}, {what}: at the limit: {e}"));
            expected += 1;
        }
        for (what, r) in shaped_records(&t, N + 1) {
            let e = tx.send(r).await.expect_err(&what);
            assert_eq!(e.kind(), ErrorKind::Config, "tx {place}, {what}: {e}");
            assert!(
                e.message().contains(&N.to_string()),
                "tx {place}, {what}: {e}"
            );
        }
        tx.commit().await.unwrap();
    }
    let got = read(&plain, &t, expected).await;
    assert_eq!(got.len(), expected);
    plain.admin().await.unwrap().delete_topic(&t).await.unwrap();
}

/// Without `message.max.bytes` anywhere, a record at onceflow's default limit (of key +
/// payload + headers) is accepted by onceflow, so it must be delivered by a broker with
/// default settings; if it cannot be, onceflow must refuse it first with its Config error
/// naming the limit. (The break test found the old default of 1 MiB refused by a default Kafka
/// 4.x broker, message.max.bytes = 1048588 for the whole batch, with "Broker: Message size too
/// large", naming no limit.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_at_the_default_limit_is_delivered_or_named() {
    let Some(p) = platform("a_record_at_the_default_limit_is_delivered_or_named") else {
        return;
    };
    let t = topic(&p, 1).await;
    let producer = p.producer(ProducerConfig::default()).await.unwrap();
    let limit = p.max_record_bytes();
    let res = producer
        .send(Record::new(t.clone(), vec![b'x'; limit]))
        .await;
    p.admin().await.unwrap().delete_topic(&t).await.unwrap();
    if let Err(e) = res {
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        assert!(
            e.message().contains(&limit.to_string()),
            "a record of {limit} bytes, accepted by onceflow, refused without naming a limit: {e}"
        );
    }
}

/// `message.max.bytes` spelt the ways librdkafka also reads it (`strtol` with base 0: hex,
/// octal with a leading 0, text after the number ignored) must not leave onceflow checking
/// another limit than librdkafka's 20 000: either the producer is refused naming the property,
/// or a record one byte over librdkafka's limit is onceflow's Config error naming 20000 and
/// one at the limit is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_max_bytes_spelt_as_librdkafka_reads_it_is_the_limit_checked() {
    let Some(url) =
        common::url("message_max_bytes_spelt_as_librdkafka_reads_it_is_the_limit_checked")
    else {
        return;
    };
    const N: usize = 20_000;
    let plain = onceflow_kafka::connect(&url).unwrap();
    let t = topic(&plain, 1).await;
    let sep = if url.contains('?') { '&' } else { '?' };
    let mut failures = Vec::new();
    for (place, value) in [
        ("options", "0x4e20"),
        ("options", "047040"),
        ("options", "20000b"),
        ("URL", "047040"),
        ("URL", "0x4e20"),
        ("URL", "20000b"),
    ] {
        let made = match place {
            "URL" => match onceflow_kafka::connect(&format!("{url}{sep}message.max.bytes={value}"))
            {
                Ok(p) => p.producer(ProducerConfig::default()).await,
                Err(e) => Err(e),
            },
            _ => {
                let mut c = ProducerConfig::default();
                c.options.insert("message.max.bytes".into(), value.into());
                plain.producer(c).await
            }
        };
        let producer = match made {
            Ok(p) => p,
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Config, "{place} {value}: {e}");
                assert!(
                    e.message().contains("message.max.bytes"),
                    "{place} {value}: {e}"
                );
                continue;
            }
        };
        let mut over = Record::new(t.clone(), Vec::<u8>::new());
        over.payload = vec![b'x'; N + 1 - 36].into();
        match producer.send(over).await {
            Err(e) if e.kind() == ErrorKind::Config && e.message().contains("20000") => {}
            other => failures.push(format!("{place} {value}: one byte over: {other:?}")),
        }
        let mut at = Record::new(t.clone(), Vec::<u8>::new());
        at.payload = vec![b'x'; N - 36].into();
        if let Err(e) = producer.send(at).await {
            failures.push(format!("{place} {value}: at the limit: {e}"));
        }
    }
    plain.admin().await.unwrap().delete_topic(&t).await.unwrap();
    assert!(failures.is_empty(), "{failures:#?}");
}

/// `message.max.bytes` raised in [`ProducerConfig::options`] above the connection's is refused
/// when the producer is made, pointing at the URL (onceflow checks records against the
/// connection's limit before they reach a producer; the break test found it refusing a
/// record this producer's librdkafka would take, naming the connection's 1 MiB). On the URL the
/// same limit delivers a 1.5 MB record to a topic whose `max.message.bytes` allows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_max_bytes_raised_in_the_options_is_the_limit() {
    let Some(url) = common::url("message_max_bytes_raised_in_the_options_is_the_limit") else {
        return;
    };
    let p = onceflow_kafka::connect(&url).unwrap();
    let admin = p.admin().await.unwrap();
    let t = name("kafka-test");
    let mut spec = TopicSpec::new(t.clone(), 1);
    spec.options
        .insert("max.message.bytes".into(), "3000000".into());
    admin.create_topic(&spec).await.unwrap();
    let mut config = ProducerConfig::default();
    config
        .options
        .insert("message.max.bytes".into(), "3000000".into());
    let Err(e) = p.producer(config).await else {
        panic!("a producer whose options raise message.max.bytes above the connection's");
    };
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(
        e.message().contains("'3000000'") && e.message().contains("?message.max.bytes=3000000"),
        "{e}"
    );
    // A lower limit in the options is this producer's own.
    let mut config = ProducerConfig::default();
    config
        .options
        .insert("message.max.bytes".into(), "20000".into());
    let lower = p.producer(config).await.unwrap();
    let e = lower
        .send(Record::new(t.clone(), vec![b'x'; 20_000]))
        .await
        .unwrap_err();
    assert!(e.message().contains("message.max.bytes = 20000"), "{e}");
    let sep = if url.contains('?') { '&' } else { '?' };
    let big = onceflow_kafka::connect(&format!("{url}{sep}message.max.bytes=3000000")).unwrap();
    let producer = big.producer(ProducerConfig::default()).await.unwrap();
    let res = producer
        .send(Record::new(t.clone(), vec![b'x'; 1_500_000]))
        .await;
    admin.delete_topic(&t).await.unwrap();
    let d = res.unwrap();
    assert_eq!(d.partition, 0);
}

/// A record within the producer's `message.max.bytes` but over the topic's
/// `max.message.bytes` is the broker's refusal, and its error names the topic's limit (the
/// newcomer found "Broker: Message size too large" naming none). Out-of-range or non-decimal
/// `message.max.bytes` values are refused when given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_over_the_topic_limit_names_it() {
    let Some(url) = common::url("a_record_over_the_topic_limit_names_it") else {
        return;
    };
    let sep = if url.contains('?') { '&' } else { '?' };
    for bad in ["4294987296", "999", "1000000001", "047040", "+20000", ""] {
        let e = onceflow_kafka::connect(&format!("{url}{sep}message.max.bytes={bad}"))
            .err()
            .unwrap_or_else(|| panic!("message.max.bytes={bad} taken"));
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        assert!(
            e.message().contains("from 1000 to 1000000000"),
            "{bad}: {e}"
        );
    }
    let big = onceflow_kafka::connect(&format!("{url}{sep}message.max.bytes=2000000")).unwrap();
    let t = topic(&big, 1).await;
    let producer = big.producer(ProducerConfig::default()).await.unwrap();
    let res = producer
        .send(Record::new(t.clone(), vec![b'x'; 1_500_000]))
        .await;
    big.admin().await.unwrap().delete_topic(&t).await.unwrap();
    let e = res.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(
        e.message().contains("max.message.bytes") && e.message().contains("1048588"),
        "{e}"
    );
}

/// A member that commits a partition back to an earlier offset (to replay it) reads that
/// offset back from `committed()`, and `rewind_uncommitted` takes it there: what this member
/// committed in a transaction counts until the coordinator serves it (#27), but not over a
/// later commit of its own (h2 break-it: `committed()` kept the highest offset this member
/// ever committed, 9 after a commit back to 3, and the rewind skipped the replay).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_back_to_an_earlier_offset_is_what_committed_reports() {
    use onceflow_core::{Position, StartFrom};
    let Some(p) = platform("a_commit_back_to_an_earlier_offset_is_what_committed_reports") else {
        return;
    };
    let input = topic(&p, 1).await;
    let client = Client::new(p.clone());
    let plain = client.producer(ProducerConfig::default()).await.unwrap();
    for i in 0..10 {
        plain
            .send(Record::new(input.clone(), format!("in-{i}")))
            .await
            .unwrap();
    }
    let consumer = client
        .consumer(
            ConsumerConfig::new(name("kafka-commit-back"), [input.clone()])
                .start(StartFrom::Earliest),
        )
        .await
        .unwrap();
    let mut got = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while got.len() < 10 && std::time::Instant::now() < deadline {
        got.extend(
            consumer
                .poll(100, Duration::from_millis(500))
                .await
                .unwrap(),
        );
    }
    assert_eq!(got.len(), 10);
    let tp = got[0].topic_partition();
    consumer
        .commit(&[(tp.clone(), got[8].position.clone())])
        .await
        .unwrap();
    let c = consumer.committed(std::slice::from_ref(&tp)).await.unwrap();
    assert_eq!(c[0].next, Some(Position::Offset(9)));
    // Back to offset 3: the messages from 3 on are to be read again.
    consumer
        .commit(&[(tp.clone(), got[2].position.clone())])
        .await
        .unwrap();
    let c = consumer.committed(std::slice::from_ref(&tp)).await.unwrap();
    assert_eq!(
        c[0].next,
        Some(Position::Offset(3)),
        "committed() after a commit back to offset 2"
    );
    let uncommitted = consumer
        .rewind_uncommitted(std::slice::from_ref(&tp))
        .await
        .unwrap();
    assert!(uncommitted.is_empty());
    let mut again = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while again.is_empty() && std::time::Instant::now() < deadline {
        again.extend(
            consumer
                .poll(100, Duration::from_millis(500))
                .await
                .unwrap(),
        );
    }
    assert_eq!(
        again.first().map(|m| m.position.clone()),
        Some(Position::Offset(3)),
        "the rewind goes back to the committed offset 3"
    );
    consumer.close().await.unwrap();
}

/// Blocks every revocation until released: a close that cannot finish while it is held.
struct HeldRevocation(Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>);

impl onceflow_core::RebalanceListener for HeldRevocation {
    fn on_assigned(&self, _: &[onceflow_core::TopicPartition]) {}
    fn on_revoked(
        &self,
        _: &[onceflow_core::TopicPartition],
    ) -> Vec<(onceflow_core::TopicPartition, onceflow_core::Position)> {
        let (held, released) = &*self.0;
        let mut h = held.lock().unwrap();
        while *h {
            h = released.wait(h).unwrap();
        }
        Vec::new()
    }
    fn on_lost(&self, _: &[onceflow_core::TopicPartition]) {}
}

/// A consumer dropped while its close cannot finish (its last revocation is held) does not keep
/// the runtime from shutting down: the drop waits for the close a bounded time, then leaves it
/// to its own thread. Before, the runtime's shutdown waited for it for ever (a CI run hung on
/// such a close in `tx_removed_member_cannot_commit_offsets`).
#[test]
fn a_close_that_never_ends_does_not_hold_the_runtime() {
    use onceflow_core::{PlatformBackend, StartFrom};
    let Some(p) = platform("a_close_that_never_ends_does_not_hold_the_runtime") else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let hold = Arc::new((std::sync::Mutex::new(true), std::sync::Condvar::new()));
    rt.block_on(async {
        let input = topic(&p, 1).await;
        let producer = p.producer(ProducerConfig::default()).await.unwrap();
        producer
            .send(Record::new(input.clone(), "one"))
            .await
            .unwrap();
        let consumer = p
            .consumer(
                ConsumerConfig::new(name("kafka-held-close"), [input.clone()])
                    .start(StartFrom::Earliest),
            )
            .await
            .unwrap();
        consumer.set_rebalance_listener(Arc::new(HeldRevocation(hold.clone())));
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut got = Vec::new();
        while got.is_empty() && std::time::Instant::now() < deadline {
            got = consumer.poll(10, Duration::from_millis(500)).await.unwrap();
        }
        assert_eq!(got.len(), 1, "the consumer read its partition");
        drop(consumer);
    });
    let limit = Duration::from_secs(120);
    let started = std::time::Instant::now();
    rt.shutdown_timeout(limit);
    let took = started.elapsed();
    // Let the held close finish on its thread.
    *hold.0.lock().unwrap() = false;
    hold.1.notify_all();
    assert!(
        took < Duration::from_secs(60),
        "the runtime's shutdown waited {took:?} for the consumer's close (limit {limit:?})"
    );
}
