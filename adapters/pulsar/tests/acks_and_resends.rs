//! Acknowledgements of batches, redeliveries after a connection reset and resends the broker
//! already stored, on a real Pulsar standalone (`tests/brokers/up.sh pulsar`, which prints
//! `ONCEFLOW_PULSAR_URL`, `ONCEFLOW_PULSAR_ADMIN_URL` and, for the tests behind the fault proxy
//! of `onceflow_conformance::fault_proxy`, `ONCEFLOW_PULSAR_FAULT_URL` and
//! `ONCEFLOW_PULSAR_FAULT_UPSTREAM`). Without the URLs every test is skipped with that reason;
//! `ONCEFLOW_REQUIRE_BROKERS=1` (set by `make test`) makes a missing broker a failure.
//!
//! Issue #30, points 3 to 5:
//! - `a_nacked_entry_of_a_batch_comes_again` and `a_commit_inside_a_batch_keeps_the_rest_of_it`:
//!   acknowledging some messages of a batch must not acknowledge the others (batch-index
//!   acknowledgement, PIP-54, where the broker has it; else the batch's acks are held until all
//!   its messages are settled).
//! - `redeliveries_after_a_reset_during_acks_reach_the_application`: a connection cut while
//!   acks are under way; what the broker redelivers reaches the application and the backlog
//!   drains.
//! - `a_resend_the_broker_stored_already_is_a_duplicate_delivery`: a receipt lost with the
//!   connection; the crate's resend is answered as a duplicate, which is a delivery.

use std::time::{Duration, Instant};

use onceflow_conformance::fault_proxy::{pulsar_command_type, Action, Direction, FaultProxy};
use onceflow_core::{
    Client, Consumer, ConsumerConfig, ErrorKind, Message, ProducerConfig, Record, StartFrom,
};

mod common;
use common::{name, require};

/// Pulsar command types (PulsarApi.proto, `BaseCommand.Type`).
const ACK: i32 = 10;
const SEND_RECEIPT: i32 = 7;

/// The fault proxy listens on the port the broker advertises for its `fault` listener, so the
/// tests that use it take turns.
static PROXY_PORT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn with_admin(service: &str) -> Option<String> {
    let admin = require("ONCEFLOW_PULSAR_ADMIN_URL")?;
    Some(format!("{service}?admin={admin}"))
}

/// The broker's URL (direct).
fn url() -> Option<String> {
    with_admin(&require("ONCEFLOW_PULSAR_URL")?)
}

/// A fault proxy on the broker's advertised fault address, and the URL that goes through it.
async fn proxy() -> Option<(FaultProxy, String)> {
    let service = require("ONCEFLOW_PULSAR_FAULT_URL")?;
    let upstream = require("ONCEFLOW_PULSAR_FAULT_UPSTREAM")?;
    let listen = service.trim_start_matches("pulsar://").to_string();
    // The previous test's proxy stops listening once its accept task is dropped.
    let proxy = FaultProxy::start_when_free(&listen, &upstream, Duration::from_secs(10)).await;
    Some((proxy, with_admin(&service)?))
}

async fn client(url: &str) -> Client {
    Client::new(onceflow_pulsar::connect(url).await.unwrap())
}

fn text(m: &Message) -> String {
    String::from_utf8_lossy(&m.payload).into_owned()
}

/// Polls until `n` messages came or `wait` passed.
async fn drain(c: &Consumer, n: usize, wait: Duration) -> Vec<Message> {
    let deadline = Instant::now() + wait;
    let mut out = Vec::new();
    while out.len() < n && Instant::now() < deadline {
        out.extend(c.poll(100, Duration::from_millis(200)).await.unwrap());
    }
    out
}

/// Writes `values` to `topic` as one batch (the producer batches up to `values.len()`).
async fn write_batch(client: &Client, topic: &str, values: &[&str]) {
    let producer = client
        .producer(
            ProducerConfig::new()
                .option("batch_size", values.len().to_string())
                .option("batch_timeout_ms", "5000"),
        )
        .await
        .unwrap();
    let records = values
        .iter()
        .map(|v| Record::new(topic, v.to_string()))
        .collect();
    for d in producer.send_batch(records).await {
        d.unwrap();
    }
    producer.close().await.unwrap();
}

/// The consumer options of one acknowledgement mode: `None` lets the adapter use batch-index
/// acknowledgement when the broker has it on (the test broker does), `off` holds a batch's acks.
fn ack_mode(config: ConsumerConfig, mode: Option<&str>) -> ConsumerConfig {
    match mode {
        Some(m) => config.option("batch_index_ack", m),
        None => config,
    }
}

/// Point 3: on a shared subscription, the other messages of a batch are committed and one is
/// nacked; the nacked one must come again. Acking a message of a batch without an ack set
/// acknowledged the whole entry at the broker, so the redelivery of the nacked one never came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nacked_entry_of_a_batch_comes_again() {
    let Some(url) = url() else { return };
    let client = client(&url).await;
    for mode in [None, Some("off")] {
        let topic = name("batch-nack");
        write_batch(&client, &topic, &["b0", "b1", "b2"]).await;
        let group = name("batch-nack-g");
        let c = client
            .consumer(ack_mode(
                ConsumerConfig::new(group.clone(), [topic.clone()])
                    .start(StartFrom::Earliest)
                    .option("subscription_type", "shared"),
                mode,
            ))
            .await
            .unwrap();
        assert_eq!(
            c.capabilities().batch_index_ack,
            mode.is_none(),
            "mode {mode:?}: Capabilities::batch_index_ack"
        );
        let got = drain(&c, 3, Duration::from_secs(20)).await;
        assert_eq!(
            got.iter().map(text).collect::<Vec<_>>(),
            ["b0", "b1", "b2"],
            "mode {mode:?}"
        );
        let entries: Vec<(u64, u64, i32)> = got
            .iter()
            .map(|m| match m.position {
                onceflow_core::Position::MessageId {
                    ledger,
                    entry,
                    batch,
                    ..
                } => (ledger, entry, batch),
                ref other => panic!("not a Pulsar position: {other}"),
            })
            .collect();
        assert!(
            entries
                .iter()
                .all(|&(l, e, b)| (l, e) == (entries[0].0, entries[0].1) && b >= 0),
            "mode {mode:?}: the three messages are one batch: {entries:?}"
        );
        // The nack goes out after the acks of its siblings.
        c.nack(&got[1], Duration::from_millis(500)).await.unwrap();
        c.commit(&[(got[2].topic_partition(), got[2].position.clone())])
            .await
            .unwrap();
        let again = drain(&c, 1, Duration::from_secs(15)).await;
        assert_eq!(
            again.iter().map(text).collect::<Vec<_>>(),
            ["b1"],
            "mode {mode:?}: the nacked message of the batch comes again, and only it"
        );
        c.commit(&[(again[0].topic_partition(), again[0].position.clone())])
            .await
            .unwrap();
        c.close().await.unwrap();
        // Everything is settled now: a new member of the group gets nothing.
        let next = client
            .consumer(
                ConsumerConfig::new(group, [topic.clone()])
                    .start(StartFrom::committed_or_earliest())
                    .option("subscription_type", "shared"),
            )
            .await
            .unwrap();
        let rest = drain(&next, 3, Duration::from_secs(3)).await;
        assert!(
            rest.is_empty(),
            "mode {mode:?}: left after all were committed: {:?}",
            rest.iter().map(text).collect::<Vec<_>>()
        );
        next.close().await.unwrap();
    }
}

/// Point 3, the general form: a commit up to a message inside a batch (failover, the default)
/// must not acknowledge the rest of the batch. The member closes after committing the first
/// message; the next member must get the other two (at least once: with batch-index
/// acknowledgement the broker redelivers the entry, and the crate hands out its acknowledged
/// message too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_inside_a_batch_keeps_the_rest_of_it() {
    let Some(url) = url() else { return };
    let client = client(&url).await;
    for mode in [None, Some("off")] {
        let topic = name("batch-commit");
        write_batch(&client, &topic, &["c0", "c1", "c2"]).await;
        let group = name("batch-commit-g");
        let config = || {
            ack_mode(
                ConsumerConfig::new(group.clone(), [topic.clone()])
                    .start(StartFrom::committed_or_earliest()),
                mode,
            )
        };
        let c = client.consumer(config()).await.unwrap();
        let got = drain(&c, 3, Duration::from_secs(20)).await;
        assert_eq!(got.len(), 3, "mode {mode:?}");
        c.commit(&[(got[0].topic_partition(), got[0].position.clone())])
            .await
            .unwrap();
        c.close().await.unwrap();
        drop(c);

        let next = client.consumer(config()).await.unwrap();
        let again: Vec<String> = drain(&next, 3, Duration::from_secs(10))
            .await
            .iter()
            .map(text)
            .collect();
        next.close().await.unwrap();
        assert!(
            again == ["c1", "c2"] || again == ["c0", "c1", "c2"],
            "mode {mode:?}: after a commit of c0 the next member got {again:?}, expected c1 \
             and c2 (c0 again at most)"
        );
    }
}

/// Point 4: the connection is cut when the first acknowledgement of a commit passes, so the
/// acks of that commit are lost. The broker redelivers the messages on the new connection; they
/// must reach the application (which commits them again) and the backlog must drain. A
/// high-water mark of delivered positions (failover) and a set of acked positions (shared) that
/// survived the reconnect dropped every redelivery, and the backlog stayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redeliveries_after_a_reset_during_acks_reach_the_application() {
    let Some(url) = url() else { return };
    let _turn = PROXY_PORT.lock().await;
    let Some((proxy, fault_url)) = proxy().await else {
        return;
    };
    let direct = client(&url).await;
    let behind = client(&fault_url).await;
    for sub in ["failover", "shared"] {
        let topic = name("reset-acks");
        let producer = direct.producer(ProducerConfig::new()).await.unwrap();
        let n = 20;
        for i in 0..n {
            producer
                .send(Record::new(topic.clone(), format!("r{i}")))
                .await
                .unwrap();
        }
        producer.close().await.unwrap();
        let c = behind
            .consumer(
                ConsumerConfig::new(name("reset-acks-g"), [topic.clone()])
                    .start(StartFrom::Earliest)
                    .option("subscription_type", sub),
            )
            .await
            .unwrap();
        let got = drain(&c, n, Duration::from_secs(20)).await;
        assert_eq!(got.len(), n, "{sub}");
        let cuts = proxy.fired();
        proxy.once(
            Direction::ToBroker,
            |f| pulsar_command_type(f) == Some(ACK),
            Action::Cut,
        );
        let last = got.last().unwrap();
        c.commit(&[(last.topic_partition(), last.position.clone())])
            .await
            .unwrap();
        // Redeliveries come on the new connection; commit them as they come, until the
        // subscription's backlog is empty.
        let deadline = Instant::now() + Duration::from_secs(45);
        let mut redelivered = Vec::new();
        let mut backlog = u64::MAX;
        while Instant::now() < deadline {
            let batch = c.poll(100, Duration::from_millis(500)).await.unwrap();
            if let Some(m) = batch.last() {
                c.commit(&[(m.topic_partition(), m.position.clone())])
                    .await
                    .unwrap();
            }
            redelivered.extend(batch.iter().map(text));
            backlog = c.lag().await.unwrap().iter().map(|l| l.messages).sum();
            if backlog == 0 && !redelivered.is_empty() {
                break;
            }
        }
        assert_eq!(proxy.fired(), cuts + 1, "{sub}: the cut happened");
        assert!(
            !redelivered.is_empty(),
            "{sub}: nothing reached the application after the reset (backlog {backlog})"
        );
        assert_eq!(
            backlog, 0,
            "{sub}: the backlog did not drain; redelivered: {redelivered:?}"
        );
        c.close().await.unwrap();
    }
}

/// The payloads of `topic` from the start (up to `max`, 5 s at most), read by a new group
/// named after `group`.
async fn read_all(client: &Client, group: &str, topic: &str, max: usize) -> Vec<String> {
    let c = client
        .consumer(ConsumerConfig::new(name(group), [topic.to_string()]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let got = drain(&c, max, Duration::from_secs(5))
        .await
        .iter()
        .map(text)
        .collect();
    c.close().await.unwrap();
    got
}

/// Point 5: the connection is cut when the broker's receipt of a stored message passes to the
/// client. The crate re-creates the producer and resends the message with its sequence id; the
/// broker (dedup on) answers with message id (-1,-1). That is our own message, stored once:
/// `send` succeeds with `duplicate` set. It failed with a non-retriable error blaming a reused
/// producer name, and a caller retrying on it wrote the record twice. Unnamed producers (the
/// broker assigns a unique name) and a named one after a first stored message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resend_the_broker_stored_already_is_a_duplicate_delivery() {
    let Some(url) = url() else { return };
    let _turn = PROXY_PORT.lock().await;
    let Some((proxy, fault_url)) = proxy().await else {
        return;
    };
    let direct = client(&url).await;
    let behind = client(&fault_url).await;
    for named in [false, true] {
        let topic = name("resend");
        let mut config = ProducerConfig::new();
        if named {
            config = config.option("producer_name", name("resend-p"));
        }
        let producer = behind.producer(config).await.unwrap();
        let first = producer
            .send(Record::new(topic.clone(), "first"))
            .await
            .unwrap();
        assert!(!first.duplicate, "named {named}");
        let cuts = proxy.fired();
        proxy.once(
            Direction::ToClient,
            |f| pulsar_command_type(f) == Some(SEND_RECEIPT),
            Action::Cut,
        );
        let second = producer.send(Record::new(topic.clone(), "second")).await;
        assert_eq!(proxy.fired(), cuts + 1, "named {named}: the cut happened");
        let second = second.unwrap_or_else(|e| {
            panic!("named {named}: a resend the broker had stored failed: {e}")
        });
        assert!(second.duplicate, "named {named}: {second:?}");
        let third = producer
            .send(Record::new(topic.clone(), "third"))
            .await
            .unwrap();
        assert!(!third.duplicate, "named {named}");
        producer.close().await.unwrap();

        let got = read_all(&direct, "resend-g", &topic, 4).await;
        assert_eq!(
            got,
            ["first", "second", "third"],
            "named {named}: the topic holds each record once"
        );
    }
}

/// Point 5, the case the broker's answer cannot settle: a named producer whose very first
/// record's receipt is lost. The broker stored it, and its (-1,-1) answer to the resend looks
/// like the answer to a name reused from an earlier life (that record dropped). The error said
/// the name was reused, certain that nothing was stored; it now says the outcome is unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_producers_first_resend_is_an_unknown_outcome() {
    let Some(url) = url() else { return };
    let _turn = PROXY_PORT.lock().await;
    let Some((proxy, fault_url)) = proxy().await else {
        return;
    };
    let direct = client(&url).await;
    let behind = client(&fault_url).await;
    let topic = name("resend-first");
    let producer = behind
        .producer(ProducerConfig::new().option("producer_name", name("resend-first-p")))
        .await
        .unwrap();
    let cuts = proxy.fired();
    proxy.once(
        Direction::ToClient,
        |f| pulsar_command_type(f) == Some(SEND_RECEIPT),
        Action::Cut,
    );
    let first = producer.send(Record::new(topic.clone(), "first")).await;
    assert_eq!(proxy.fired(), cuts + 1, "the cut happened");
    let e = first.expect_err("a (-1,-1) answer before anything is stored is not a delivery");
    assert_eq!(e.kind(), ErrorKind::Platform, "{e}");
    assert!(e.outcome_unknown(), "the record may be stored: {e}");
    assert!(e.message().contains("unknown"), "{e}");
    let second = producer
        .send(Record::new(topic.clone(), "second"))
        .await
        .unwrap();
    assert!(!second.duplicate);
    producer.close().await.unwrap();
    let got = read_all(&direct, "resend-first-g", &topic, 3).await;
    assert_eq!(
        got,
        ["first", "second"],
        "the first record was stored, once"
    );
}
