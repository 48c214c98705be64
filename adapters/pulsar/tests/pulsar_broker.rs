//! Pulsar behaviour onceflow relies on, or refuses to rely on, on a real Pulsar standalone
//! (`tests/brokers/up.sh pulsar`, which prints `ONCEFLOW_PULSAR_URL` and
//! `ONCEFLOW_PULSAR_ADMIN_URL`). Without the URL every test is skipped with that reason;
//! `ONCEFLOW_REQUIRE_BROKERS=1` (set by `make test`) makes a missing broker a failure.
//!
//! - `pulsar_dedup_drops_a_restarted_named_producer`: broker dedup (PIP-6) with a named
//!   producer restarted through the pulsar crate: the new producer's sequence ids start at 0
//!   again, and the broker acknowledges its messages with message id (-1,-1) without storing
//!   them. onceflow reports those sends as errors, never as deliveries.
//! - `a_named_producer_resumes_after_the_brokers_last_sequence_id`: with `producer_name` on
//!   the URL (or `transactions=true`) onceflow's bridge moves the crate's sequence ids past
//!   the broker's last one for the name: 20 restarts of the named producer lose and duplicate
//!   nothing with broker dedup on (issue #27).
//! - `key_shared_keeps_order_per_key_while_members_join_and_leave`.
//! - `dead_letter_after_max_redeliveries` (shared subscription).
//! - `nack_waits_for_the_redelivery_delay` (shared subscription).
//! - `small_polls_with_commits_drain_a_backlog_deeper_than_the_receiver_queue` and
//!   `a_new_member_starts_after_the_last_commit_of_a_closed_one`: acks and close behind the
//!   crate's consumer engine.
//! - `a_batching_producer_without_a_batch_timeout_answers_send_and_send_batch`: with
//!   `batch_size` and no `batch_timeout_ms` the crate holds a record until its batch is full;
//!   a `send` or `send_batch` awaiting its receipts sends the batch first instead of waiting
//!   for ever.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use onceflow_core::{
    Client, Consumer, ConsumerConfig, ErrorKind, ProducerConfig, Record, StartFrom, TopicSpec,
};
use pulsar::message::proto::command_subscribe::SubType;

mod common;
use common::name;

fn url() -> Option<String> {
    match std::env::var("ONCEFLOW_PULSAR_URL") {
        Ok(u) if !u.is_empty() => {
            let sep = if u.contains('?') { '&' } else { '?' };
            Some(match std::env::var("ONCEFLOW_PULSAR_ADMIN_URL") {
                Ok(admin) if !u.contains("admin=") => format!("{u}{sep}admin={admin}"),
                _ => u,
            })
        }
        _ => {
            assert!(
                std::env::var("ONCEFLOW_REQUIRE_BROKERS").as_deref() != Ok("1"),
                "ONCEFLOW_REQUIRE_BROKERS=1 but ONCEFLOW_PULSAR_URL is not set \
                 (tests/brokers/up.sh pulsar)"
            );
            eprintln!(
                "pulsar_broker: SKIPPED: ONCEFLOW_PULSAR_URL is not set (start a broker with \
                 tests/brokers/up.sh pulsar)"
            );
            None
        }
    }
}

async fn drain(c: &Consumer, n: usize, wait: Duration) -> Vec<onceflow_core::Message> {
    let deadline = Instant::now() + wait;
    let mut out = Vec::new();
    while out.len() < n && Instant::now() < deadline {
        out.extend(c.poll(100, Duration::from_millis(200)).await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_producer_resumes_after_the_brokers_last_sequence_id() {
    let Some(url) = url() else { return };
    let topic = name("resume");
    let producer_name = name("resumed-producer");
    let named_url = format!("{url}&producer_name={producer_name}");
    let mut expected = Vec::new();
    for life in 0..20 {
        // A new process each time: a new connection, a new crate producer from sequence 0.
        let client = Client::new(onceflow_pulsar::connect(&named_url).await.unwrap());
        let producer = client.producer(ProducerConfig::new()).await.unwrap();
        for i in 0..2 {
            let v = format!("life{life}-{i}");
            let d = producer
                .send(Record::new(topic.clone(), v.clone()))
                .await
                .unwrap_or_else(|e| panic!("{v}: {e}"));
            assert!(
                !d.duplicate,
                "{v} is stored, not taken for an earlier life's"
            );
            expected.push(v);
        }
        producer.close().await.unwrap();
    }
    let client = Client::new(onceflow_pulsar::connect(&url).await.unwrap());
    let c = client
        .consumer(ConsumerConfig::new(name("g"), [topic.clone()]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let got = drain(&c, expected.len(), Duration::from_secs(30)).await;
    let payloads: Vec<String> = got
        .iter()
        .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
        .collect();
    assert_eq!(
        payloads, expected,
        "every life's records, once each, in order"
    );
    c.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulsar_dedup_drops_a_restarted_named_producer() {
    let Some(url) = url() else { return };
    let platform = onceflow_pulsar::connect(&url).await.unwrap();
    let raw = platform.pulsar_client();
    let topic = name("dedup");
    let full = platform.options().full_topic(&topic);
    let producer_name = name("named-producer");

    // First life of the named producer: three messages, stored.
    let mut first = raw
        .producer()
        .with_topic(&full)
        .with_name(producer_name.clone())
        .build()
        .await
        .unwrap();
    for v in ["a0", "a1", "a2"] {
        let r = first
            .send_non_blocking(v.as_bytes().to_vec())
            .await
            .unwrap()
            .await
            .unwrap();
        let id = r.message_id.unwrap();
        assert_ne!(id.ledger_id, u64::MAX, "first life: {v} stored");
    }
    first.close().await.unwrap();

    // Second life, same name: the crate restarts sequence ids at 0, the broker has stored up to
    // 2, so it acknowledges these with (-1,-1) and drops them.
    let mut second = raw
        .producer()
        .with_topic(&full)
        .with_name(producer_name.clone())
        .build()
        .await
        .unwrap();
    for v in ["b0", "b1", "b2"] {
        let r = second
            .send_non_blocking(v.as_bytes().to_vec())
            .await
            .unwrap()
            .await
            .unwrap();
        let id = r.message_id.unwrap();
        assert_eq!(
            (id.ledger_id, id.entry_id),
            (u64::MAX, u64::MAX),
            "second life: {v} (sequence id {}) is acknowledged as a duplicate",
            r.sequence_id
        );
    }
    // The fourth message of the second life has sequence id 3, above what the broker stored.
    let r = second
        .send_non_blocking(b"b3".to_vec())
        .await
        .unwrap()
        .await
        .unwrap();
    assert_ne!(r.message_id.unwrap().ledger_id, u64::MAX, "b3 is stored");
    second.close().await.unwrap();

    // onceflow with the same name: the dropped sends are errors, not deliveries.
    let client = Client::new(platform.clone());
    let named = client
        .producer(ProducerConfig::new().option("producer_name", producer_name.clone()))
        .await
        .unwrap();
    let e = named
        .send(Record::new(topic.clone(), "c0"))
        .await
        .expect_err("a dropped send is an error");
    assert_eq!(e.kind(), ErrorKind::Platform, "{e}");
    assert!(e.message().contains("deduplication"), "{e}");
    named.close().await.unwrap();
    // Unnamed (the default): a broker-assigned unique name, nothing is dropped.
    let unnamed = client.producer(ProducerConfig::new()).await.unwrap();
    unnamed
        .send(Record::new(topic.clone(), "d0"))
        .await
        .unwrap();

    let c = client
        .consumer(ConsumerConfig::new(name("g"), [topic.clone()]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let got = drain(&c, 6, Duration::from_secs(20)).await;
    let payloads: Vec<String> = got
        .iter()
        .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
        .collect();
    assert_eq!(
        payloads,
        ["a0", "a1", "a2", "b3", "d0"],
        "what the topic holds"
    );
    assert!(drain(&c, 1, Duration::from_secs(2)).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_shared_keeps_order_per_key_while_members_join_and_leave() {
    let Some(url) = url() else { return };
    let platform = onceflow_pulsar::connect(&url).await.unwrap();
    let client = Client::new(platform);
    let topic = name("ks");
    client
        .admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(topic.clone(), 1))
        .await
        .unwrap();
    let group = name("ks-g");
    const KEYS: usize = 8;
    const PER_KEY: usize = 150;
    // (key, seq, member) in processing order, across members.
    let log: Arc<Mutex<Vec<(usize, usize, String)>>> = Arc::default();
    let config = |member: &str| {
        ConsumerConfig::new(group.clone(), [topic.clone()])
            .start(StartFrom::committed_or_earliest())
            .client_id(member.to_string())
            .option("subscription_type", "key_shared")
    };
    let run = |c: Consumer, member: &'static str, stop: Arc<AtomicBool>| {
        let log = log.clone();
        tokio::spawn(async move {
            while !stop.load(Ordering::Acquire) {
                let got = c.poll(50, Duration::from_millis(100)).await.unwrap();
                for m in &got {
                    let text = String::from_utf8_lossy(&m.payload).into_owned();
                    let (k, s) = text.split_once('/').unwrap();
                    log.lock().unwrap().push((
                        k.parse().unwrap(),
                        s.parse().unwrap(),
                        member.to_string(),
                    ));
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                // Commit per message id: key_shared delivers out of position order.
                for m in &got {
                    c.commit(&[(m.topic_partition(), m.position.clone())])
                        .await
                        .unwrap();
                }
            }
            c.close().await.unwrap();
        })
    };
    let stop_a = Arc::new(AtomicBool::new(false));
    let stop_b = Arc::new(AtomicBool::new(false));
    let a = client.consumer(config("member-a")).await.unwrap();
    let task_a = run(a, "member-a", stop_a.clone());

    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    let mut task_b = None;
    for s in 0..PER_KEY {
        let records: Vec<Record> = (0..KEYS)
            .map(|k| Record::new(topic.clone(), format!("{k}/{s}")).key(format!("key-{k}")))
            .collect();
        for r in producer.send_batch(records).await {
            r.unwrap();
        }
        if s == PER_KEY / 3 {
            // B joins while messages flow.
            let b = client.consumer(config("member-b")).await.unwrap();
            task_b = Some(run(b, "member-b", stop_b.clone()));
        }
        if s == 2 * PER_KEY / 3 {
            // A leaves while messages flow; B takes its keys.
            stop_a.store(true, Ordering::Release);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    task_a.await.unwrap();
    // Wait until every message was processed.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let distinct: std::collections::HashSet<(usize, usize)> = log
            .lock()
            .unwrap()
            .iter()
            .map(|(k, s, _)| (*k, *s))
            .collect();
        if distinct.len() == KEYS * PER_KEY {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {} of {} messages processed",
            distinct.len(),
            KEYS * PER_KEY
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop_b.store(true, Ordering::Release);
    task_b.unwrap().await.unwrap();

    let log = log.lock().unwrap().clone();
    let mut per_key: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    let mut members: HashMap<String, usize> = HashMap::new();
    for (k, s, m) in &log {
        per_key.entry(*k).or_default().push(*s);
        *members.entry(m.clone()).or_default() += 1;
    }
    assert!(
        members.len() == 2 && members.values().all(|n| *n > 0),
        "both members processed messages: {members:?}"
    );
    for (k, seqs) in per_key {
        // In processing order, a key's messages never go back: a message is processed only
        // after every earlier message of its key (a repeat would go back).
        let backwards: Vec<_> = seqs.windows(2).filter(|w| w[1] <= w[0]).collect();
        assert!(
            backwards.is_empty(),
            "key {k} out of order or repeated: {backwards:?}"
        );
        assert_eq!(seqs.len(), PER_KEY, "key {k}: every message once");
    }
    eprintln!("key_shared: {} messages, per member {members:?}", log.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_after_max_redeliveries() {
    let Some(url) = url() else { return };
    let platform = onceflow_pulsar::connect(&url).await.unwrap();
    let client = Client::new(platform.clone());
    let topic = name("dl-in");
    let dlq = name("dl-dlq");
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    producer
        .send(Record::new(topic.clone(), "poison").header("traceparent", "x"))
        .await
        .unwrap();
    // Subscribe to the dead-letter topic first so nothing is missed.
    let raw = platform.pulsar_client();
    let mut dl: pulsar::Consumer<Vec<u8>, pulsar::TokioExecutor> = raw
        .consumer()
        .with_topic(platform.options().full_topic(&dlq))
        .with_subscription(name("dl-check"))
        .with_subscription_type(SubType::Exclusive)
        .build()
        .await
        .unwrap();
    let c = client
        .consumer(
            ConsumerConfig::new(name("dl-g"), [topic.clone()])
                .start(StartFrom::Earliest)
                .option("subscription_type", "shared")
                .option("dead_letter", dlq.clone())
                .option("max_redeliver", "2"),
        )
        .await
        .unwrap();
    let mut deliveries = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    let dead = loop {
        for m in c.poll(10, Duration::from_millis(200)).await.unwrap() {
            deliveries += 1;
            c.nack(&m, Duration::ZERO).await.unwrap();
        }
        if let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_millis(50), dl.next()).await {
            break m;
        }
        assert!(
            Instant::now() < deadline,
            "nothing reached the dead-letter topic"
        );
    };
    assert_eq!(dead.payload.data, b"poison");
    assert!(
        (2..=3).contains(&deliveries),
        "delivered {deliveries} times before dead-lettering (max_redeliver=2)"
    );
    assert!(
        drain(&c, 1, Duration::from_secs(2)).await.is_empty(),
        "a dead-lettered message is not delivered again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_waits_for_the_redelivery_delay() {
    let Some(url) = url() else { return };
    let client = Client::new(onceflow_pulsar::connect(&url).await.unwrap());
    let topic = name("nack");
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    for v in ["m0", "m1"] {
        producer.send(Record::new(topic.clone(), v)).await.unwrap();
    }
    let c = client
        .consumer(
            ConsumerConfig::new(name("nack-g"), [topic.clone()])
                .start(StartFrom::Earliest)
                .option("subscription_type", "shared"),
        )
        .await
        .unwrap();
    let got = drain(&c, 2, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 2);
    let nacked_at = Instant::now();
    c.nack(&got[0], Duration::from_millis(1500)).await.unwrap();
    c.commit(&[(got[1].topic_partition(), got[1].position.clone())])
        .await
        .unwrap();
    let again = drain(&c, 1, Duration::from_secs(20)).await;
    let waited = nacked_at.elapsed();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].payload, got[0].payload);
    assert_eq!(again[0].position, got[0].position);
    assert_eq!(again[0].delivery_count, 2);
    assert!(
        waited >= Duration::from_millis(1400),
        "redelivered after {waited:?}, before the 1.5 s delay"
    );
}

/// A client with `receiver_queue_size=queue` and a new topic (named from `prefix`) holding
/// messages `m0`..`m{n-1}`.
async fn filled_topic(url: &str, queue: u32, prefix: &str, n: usize) -> (Client, String) {
    let sep = if url.contains('?') { '&' } else { '?' };
    let client = Client::new(
        onceflow_pulsar::connect(&format!("{url}{sep}receiver_queue_size={queue}"))
            .await
            .unwrap(),
    );
    let topic = name(prefix);
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    let records: Vec<Record> = (0..n)
        .map(|i| Record::new(topic.clone(), format!("m{i}")))
        .collect();
    for r in producer.send_batch(records).await {
        r.unwrap();
    }
    (client, topic)
}

/// A backlog deeper than the receiver queue, read in small polls with a commit after each: the
/// crate's consumer engine blocks while its queue to us is full and handles our acks only
/// behind the messages it pushes, so a commit that waited for a broker round trip without
/// reading deadlocked the partition (the demo with 20 000 orders stalled four of eight
/// partitions for good). Every message must arrive, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_polls_with_commits_drain_a_backlog_deeper_than_the_receiver_queue() {
    let Some(url) = url() else { return };
    let n = 400;
    let (client, topic) = filled_topic(&url, 10, "backlog", n).await;
    let group = name("backlog-g");
    let c = client
        .consumer(ConsumerConfig::new(group.clone(), [topic.clone()]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut got = Vec::new();
    while got.len() < n && Instant::now() < deadline {
        let batch = c.poll(5, Duration::from_millis(200)).await.unwrap();
        if let Some(last) = batch.last() {
            c.commit(&[(last.topic_partition(), last.position.clone())])
                .await
                .unwrap();
        }
        got.extend(batch.into_iter().map(|m| m.payload));
    }
    let want: Vec<bytes::Bytes> = (0..n).map(|i| format!("m{i}").into()).collect();
    assert_eq!(got.len(), n, "stalled after {} of {n} messages", got.len());
    assert_eq!(got, want, "out of order or repeated");
    c.close().await.unwrap();
}

/// Reads the first `commit_upto` of `n` messages with small polls and a commit after each,
/// closes, and returns what a new member of the group receives first.
async fn resume_after_close(url: &str, queue: u32, n: usize, commit_upto: usize) -> Vec<String> {
    let (client, topic) = filled_topic(url, queue, "resume", n).await;
    let group = name("resume-g");
    let config = |member: &str| {
        ConsumerConfig::new(group.clone(), [topic.clone()])
            .start(StartFrom::committed_or_earliest())
            .client_id(member.to_string())
    };
    let c = client.consumer(config("first")).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut got = Vec::new();
    while got.len() < commit_upto && Instant::now() < deadline {
        let want = (commit_upto - got.len()).min(5);
        let batch = c.poll(want, Duration::from_millis(200)).await.unwrap();
        if let Some(last) = batch.last() {
            c.commit(&[(last.topic_partition(), last.position.clone())])
                .await
                .unwrap();
        }
        got.extend(batch.into_iter().map(|m| m.payload));
    }
    assert_eq!(
        got.len(),
        commit_upto,
        "the first member read what it commits"
    );
    c.close().await.unwrap();
    drop(c);

    let next = client.consumer(config("second")).await.unwrap();
    let want = (n - commit_upto).min(20);
    // Nothing left: wait a while for anything that should not come.
    let (count, wait) = if want == 0 { (1, 3) } else { (want, 20) };
    let again = drain(&next, count, Duration::from_secs(wait)).await;
    next.close().await.unwrap();
    again
        .iter()
        .take(20)
        .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
        .collect()
}

/// A commit is not lost when the member closes: a new member of the group (failover) starts
/// right after the last committed message, whatever the receiver queue and whether a backlog
/// is left behind. The crate's consumer engine sends our acks only behind the messages the
/// broker pushed to it before (it had 1000 flow permits whatever `receiver_queue_size` said),
/// and waits while its queue to us is full; `close` did not read, so it timed out after 30 s
/// with the acks still queued, and the new member got every message after the first again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_member_starts_after_the_last_commit_of_a_closed_one() {
    let Some(url) = url() else { return };
    for (queue, n, upto) in [
        (10, 400, 200),
        (1000, 400, 200),
        (10, 400, 400),
        (1000, 400, 400),
    ] {
        let got = resume_after_close(&url, queue, n, upto).await;
        let want: Vec<String> = (upto..n.min(upto + 20)).map(|i| format!("m{i}")).collect();
        assert_eq!(
            got, want,
            "receiver queue {queue}, {upto} of {n} committed: the new member's first messages"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batching_producer_without_a_batch_timeout_answers_send_and_send_batch() {
    let Some(url) = url() else { return };
    let client = Client::new(onceflow_pulsar::connect(&url).await.unwrap());
    let topic = name("batch-no-timeout");
    let producer = client
        .producer(ProducerConfig::new().option("batch_size", "100"))
        .await
        .unwrap();
    let within = Duration::from_secs(30);
    tokio::time::timeout(within, producer.send(Record::new(&topic, "one")))
        .await
        .expect("send of a lone record to a batching producer returned within 30 s")
        .unwrap();
    let batch = tokio::time::timeout(
        within,
        producer.send_batch(vec![
            Record::new(&topic, "two"),
            Record::new(&topic, "three"),
        ]),
    )
    .await
    .expect("send_batch of 2 records to a 100-record batching producer returned within 30 s");
    for r in batch {
        r.unwrap();
    }
    let c = client
        .consumer(ConsumerConfig::new(name("g"), [topic.as_str()]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let read: Vec<String> = drain(&c, 3, Duration::from_secs(30))
        .await
        .iter()
        .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
        .collect();
    assert_eq!(read, ["one", "two", "three"]);
    producer.close().await.unwrap();
    c.close().await.unwrap();
}

/// A second consumer of an exclusive subscription that already has one is refused within
/// `operation_timeout_ms`, with an error naming the subscription, instead of waiting for ever:
/// the broker answers `ConsumerBusy` and the pulsar crate retries that every 5 s with no limit
/// (h1 break-it of #27). The Java client fails such a subscribe at once
/// (`ConsumerBusyException`); here the broker gets the operation timeout to let go of a
/// consumer whose connection just died.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_consumer_of_a_busy_exclusive_subscription_is_refused_in_time() {
    let Some(url) = url() else { return };
    let client = Client::new(
        onceflow_pulsar::connect(&format!("{url}&operation_timeout_ms=3000"))
            .await
            .unwrap(),
    );
    let topic = name("busy");
    let group = name("busy-g");
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    producer
        .send(Record::new(topic.clone(), "x"))
        .await
        .unwrap();
    let config = || {
        ConsumerConfig::new(group.clone(), [topic.clone()])
            .start(StartFrom::Earliest)
            .option("subscription_type", "exclusive")
    };
    let first = client.consumer(config()).await.unwrap();
    let got = drain(&first, 1, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 1);
    let started = Instant::now();
    let second = tokio::time::timeout(Duration::from_secs(30), async {
        let c = client.consumer(config()).await?;
        c.poll(10, Duration::from_millis(500)).await
    })
    .await
    .expect("the second consumer is answered within 30 s, not left waiting");
    let e = second.expect_err("an exclusive subscription with a consumer refuses another");
    let msg = e.to_string();
    assert!(msg.contains(&group), "names the subscription: {msg}");
    assert!(
        msg.contains("exclusive") || msg.contains("ConsumerBusy"),
        "says why: {msg}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "refused after {:?}",
        started.elapsed()
    );
    // The first consumer is not disturbed.
    first.commit_message(&got[0]).await.unwrap();
}
