//! Break-it attacks on Pulsar transactions (issue #27), real broker and fault proxy
//! (`ONCEFLOW_PULSAR_FAULT_URL`, `ONCEFLOW_PULSAR_FAULT_UPSTREAM`).
//!
//! - `sends_resent_after_a_cut_keep_their_aborted_transaction`: a transaction's `SEND` is
//!   lost with its connection; the transaction is aborted (or dropped, and the next one
//!   commits) before the crate reconnects and resends it: the resent message must not be read.
//! - `plain_records_batched_before_begin_stay_plain`: records a transactional producer enqueued
//!   outside a transaction, still in the crate's batch when a transaction begins, are not part
//!   of it: read once even though the transaction aborts.

use std::time::{Duration, Instant};

use onceflow_conformance::fault_proxy::{pulsar_command_type, Action, Direction, FaultProxy};
use onceflow_core::{Client, ConsumerConfig, Producer, ProducerConfig, Record, StartFrom};

mod common;
use common::{name, require};

const SEND: i32 = 6;
const PRODUCER: i32 = 5;

fn url() -> Option<String> {
    let service = require("ONCEFLOW_PULSAR_URL")?;
    let admin = require("ONCEFLOW_PULSAR_ADMIN_URL")?;
    Some(format!("{service}?admin={admin}&transactions=true"))
}

async fn connect(url: &str) -> Client {
    Client::new(onceflow_pulsar::connect(url).await.unwrap())
}

async fn plain(client: &Client) -> Producer {
    client.producer(ProducerConfig::new()).await.unwrap()
}

/// Sends `end`, then reads `topic` from the earliest message as a new group until `end`.
async fn read_to_end(client: &Client, topic: &str) -> Vec<String> {
    plain(client)
        .await
        .send(Record::new(topic, "end"))
        .await
        .unwrap();
    let c = client
        .consumer(ConsumerConfig::new(name("reader"), [topic]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut out: Vec<String> = Vec::new();
    while !out.iter().any(|t| t == "end") {
        assert!(Instant::now() < deadline, "end not read: {out:?}");
        out.extend(
            c.poll(100, Duration::from_millis(200))
                .await
                .unwrap()
                .iter()
                .map(|m| String::from_utf8_lossy(&m.payload).into_owned()),
        );
    }
    out
}

static PROXY_PORT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn fault_proxy() -> Option<(FaultProxy, String)> {
    let service = require("ONCEFLOW_PULSAR_FAULT_URL")?;
    let upstream = require("ONCEFLOW_PULSAR_FAULT_UPSTREAM")?;
    let admin = require("ONCEFLOW_PULSAR_ADMIN_URL")?;
    let listen = service.trim_start_matches("pulsar://").to_string();
    let proxy = FaultProxy::start_when_free(&listen, &upstream, Duration::from_secs(30)).await;
    Some((proxy, format!("{service}?admin={admin}&transactions=true")))
}

#[derive(Debug, Clone, Copy)]
enum End {
    Abort,
    DropThenCommitNext,
}

async fn resent_after_cut(end: End) {
    let Some(url) = url() else { return };
    let _turn = PROXY_PORT.lock().await;
    let Some((proxy, fault_url)) = fault_proxy().await else {
        return;
    };
    let direct = connect(&url).await;
    let behind = connect(&fault_url).await;
    let topic = name("h1-resent");
    let producer = behind
        .producer(ProducerConfig::new().transactional_id(name("h1-resent")))
        .await
        .unwrap();
    // The producer exists (its topic's crate producer is created) before the fault.
    let mut t = producer.begin().await.unwrap();
    t.send(Record::new(&topic, "warm")).await.unwrap();
    t.commit().await.unwrap();

    // The next SEND is lost with its connection; the crate's producer comes back slowly.
    // The last of the three SENDs: all three passed the bridge, so the transaction's wait
    // for its SENDs is over at once.
    let sends = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = sends.clone();
    proxy.once(
        Direction::ToBroker,
        move |f| {
            pulsar_command_type(f) == Some(SEND)
                && seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 2
        },
        Action::Cut,
    );
    proxy.always(
        Direction::ToBroker,
        |f| pulsar_command_type(f) == Some(PRODUCER),
        Action::Delay(Duration::from_secs(2)),
    );
    let mut t = producer.begin().await.unwrap();
    let receipts = t
        .enqueue_batch(
            (0..3)
                .map(|i| Record::new(&topic, format!("lost{i}")))
                .collect(),
        )
        .await;
    let receipts = tokio::spawn(receipts);
    // Give the SEND time to pass the bridge and be cut.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(proxy.fired() >= 1, "the SEND was cut");
    match end {
        End::Abort => t.abort().await.unwrap(),
        End::DropThenCommitNext => {
            drop(t);
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut t2 = loop {
                match producer.begin().await {
                    Ok(t) => break t,
                    Err(e) if Instant::now() < deadline => {
                        eprintln!("begin after a drop: {e}");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Err(e) => panic!("{e}"),
                }
            };
            // The resend (after the slow reconnect) passes while t2 is open.
            tokio::time::sleep(Duration::from_secs(3)).await;
            t2.send(Record::new(&topic, "next")).await.unwrap();
            t2.commit().await.unwrap();
        }
    }
    let r = tokio::time::timeout(Duration::from_secs(60), receipts)
        .await
        .expect("receipts within 60 s")
        .unwrap();
    eprintln!("{end:?}: receipts of the lost sends: {r:?}");
    proxy.clear();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let read = read_to_end(&direct, &topic).await;
    let expected: Vec<&str> = match end {
        End::Abort => vec!["warm", "end"],
        End::DropThenCommitNext => vec!["warm", "next", "end"],
    };
    assert_eq!(
        read, expected,
        "{end:?}: nothing of the aborted transaction"
    );
    producer.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_resent_after_a_cut_keep_their_aborted_transaction() {
    resent_after_cut(End::Abort).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_resent_after_a_cut_keep_their_dropped_transaction() {
    resent_after_cut(End::DropThenCommitNext).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_records_batched_before_begin_stay_plain() {
    let Some(url) = url() else { return };
    let client = connect(&url).await;
    let topic = name("h1-plain-batched");
    let producer = client
        .producer(
            ProducerConfig::new()
                .transactional_id(name("h1-plain-batched"))
                .option("batch_size", "1000")
                .option("batch_timeout_ms", "3000"),
        )
        .await
        .unwrap();
    let plain_receipts = producer
        .enqueue_batch(
            (0..5)
                .map(|i| Record::new(&topic, format!("plain{i}")))
                .collect(),
        )
        .await;
    let mut t = producer.begin().await.unwrap();
    let txn_receipts = t.enqueue_batch(vec![Record::new(&topic, "aborted")]).await;
    let (p, x) = futures::join!(plain_receipts, txn_receipts);
    t.abort().await.unwrap();
    let p_ok = p.iter().filter(|r| r.is_ok()).count();
    eprintln!("plain receipts ok: {p_ok}, txn: {x:?}");
    let read = read_to_end(&client, &topic).await;
    let mut expected: Vec<String> = (0..p_ok).map(|i| format!("plain{i}")).collect();
    expected.push("end".into());
    assert_eq!(
        read, expected,
        "every plain record with an ok receipt, once"
    );
    producer.close().await.unwrap();
}

/// Reads every message of `topics` (each gets a plain `end` first) from the earliest, as a
/// new group, until every `end` was read.
async fn read_all_ends(client: &Client, topics: &[String]) -> Vec<String> {
    let p = plain(client).await;
    for t in topics {
        for part in 0..2 {
            p.send(Record::new(t, "end").partition(part)).await.unwrap();
        }
    }
    let c = client
        .consumer(
            ConsumerConfig::new(name("reader"), topics.iter().map(String::as_str))
                .start(StartFrom::Earliest),
        )
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut out: Vec<String> = Vec::new();
    while out.iter().filter(|t| *t == "end").count() < topics.len() * 2 {
        assert!(Instant::now() < deadline, "ends not read: {}", out.len());
        out.extend(
            c.poll(500, Duration::from_millis(200))
                .await
                .unwrap()
                .iter()
                .map(|m| String::from_utf8_lossy(&m.payload).into_owned()),
        );
    }
    out.retain(|t| t != "end");
    out
}

/// Many batching transactional producers on one client, each running transactions over two
/// topics of two partitions that commit, abort or are dropped (then the next begins at once),
/// their `enqueue_batch` receipts dropped unawaited, with plain sends between: exactly the
/// committed and plain records are read, once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batching_producers_commit_abort_drop() {
    let Some(url) = url() else { return };
    let client = connect(&url).await;
    let admin = client.admin().await.unwrap();
    let topics: Vec<String> = (0..2).map(|_| name("h1-many")).collect();
    for t in &topics {
        admin
            .create_topic(&onceflow_core::TopicSpec::new(t.clone(), 2))
            .await
            .unwrap();
    }
    let producers = 4;
    let rounds = 12;
    let mut tasks = Vec::new();
    for p in 0..producers {
        let client = client.clone();
        let topics = topics.clone();
        tasks.push(tokio::spawn(async move {
            let producer = client
                .producer(
                    ProducerConfig::new()
                        .transactional_id(name(&format!("h1-many-{p}")))
                        .option("batch_size", "100")
                        .option("batch_timeout_ms", if p % 2 == 0 { "2000" } else { "5" }),
                )
                .await
                .unwrap();
            let mut expected = Vec::new();
            for r in 0..rounds {
                let t = loop {
                    match producer.begin().await {
                        Ok(t) => break t,
                        Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                    }
                };
                let mut t = t;
                let records: Vec<Record> = (0..8)
                    .map(|i| {
                        Record::new(&topics[i % 2], format!("p{p}-r{r}-{i}"))
                            .partition((i / 2 % 2) as i32)
                    })
                    .collect();
                let texts: Vec<String> = (0..8).map(|i| format!("p{p}-r{r}-{i}")).collect();
                let half = records.len() / 2;
                let mut records = records;
                let second = records.split_off(half);
                drop(t.enqueue_batch(records).await);
                let f = t.enqueue_batch(second).await;
                match r % 3 {
                    0 => {
                        drop(f);
                        t.commit().await.unwrap();
                        expected.extend(texts);
                    }
                    1 => {
                        drop(f);
                        t.abort().await.unwrap();
                    }
                    _ => {
                        drop(f);
                        drop(t);
                    }
                }
                // A plain record between transactions, its receipt not awaited before the
                // next begin.
                let text = format!("p{p}-r{r}-plain");
                let f = producer
                    .enqueue_batch(vec![Record::new(&topics[0], text.clone()).partition(1)])
                    .await;
                tokio::spawn(async move {
                    for r in f.await {
                        r.unwrap();
                    }
                });
                expected.push(text);
            }
            // The last transaction (maybe dropped) is settled before the reader's `end`s.
            let t = loop {
                match producer.begin().await {
                    Ok(t) => break t,
                    Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                }
            };
            t.commit().await.unwrap();
            producer.close().await.unwrap();
            expected
        }));
    }
    let mut expected = Vec::new();
    for t in tasks {
        expected.extend(t.await.unwrap());
    }
    let mut read = read_all_ends(&client, &topics).await;
    read.sort();
    expected.sort();
    let extra: Vec<&String> = read.iter().filter(|r| !expected.contains(r)).collect();
    let missing: Vec<&String> = expected.iter().filter(|e| !read.contains(e)).collect();
    assert!(
        read == expected,
        "read {} expected {}; extra {extra:?}; missing {missing:?}",
        read.len(),
        expected.len()
    );
}
