//! The Kafka producer's batch path (`enqueue_all` / `enqueue_run` in `src/producer.rs`): runs of
//! up to 1 024 "plain" records (one topic, no partition, timestamp or headers) go through
//! librdkafka's `rd_kafka_produce_batch`, every other record through `rd_kafka_producev`. On a
//! real broker, each test compares what a consumer reads with what was sent, record by record:
//!
//! - `mixed_batches_round_trip_record_by_record`: runs of 1, 1 023, 1 024, 1 025 and 2 049 plain
//!   records between records with headers, a partition or a timestamp, two topics alternating
//!   record by record, keys `None` / empty / non-empty and empty payloads: every delivery's
//!   partition, offset and timestamp is what the consumer reads there, with the record's key
//!   (null stays null, empty stays empty), payload and headers; offsets rise in input order per
//!   partition; a plain record's CreateTime lies within its send call.
//! - `keys_choose_the_same_partition_on_both_paths`: a key goes to the same partition through
//!   `rd_kafka_produce_batch` (a plain record in a batch), `rd_kafka_producev` (a single send,
//!   and a record with a header in a batch), with the default partitioner and with
//!   `partitioner=murmur2_random`, also when the batch path makes the topic handle first.
//! - `null_and_empty_keys_and_payloads_reach_a_raw_consumer`: with rdkafka's own consumer, a
//!   batch-path record's empty payload is an empty value (not a null, a tombstone) and its
//!   `None` / empty key a null / empty key, as on the per-record path.
//! - `full_local_queue_by_count_and_by_size_keeps_each_batch_in_order`: a local queue of 10
//!   messages, and one of 1 KiB (records of different sizes, so a large one waits while the
//!   run stops at it), concurrent mixed batches of 1 025: each batch's records exactly once and
//!   in input order.
//! - `enqueued_batches_leave_in_call_order`: five mixed batches handed to a plain producer's
//!   `enqueue_batch` one after another, their reports awaited afterwards in reverse order:
//!   every record delivered, the batches' offsets in call order on the one partition, each
//!   record read back once, in order.
//! - `transactions_on_the_batch_path`: aborted `send_batch` records are invisible to a
//!   read_committed reader; committed `enqueue_batch` and two-topic `send_batch` records are
//!   read exactly once, in order; a send dropped while waiting for room in a full queue inside
//!   a transaction, then the transaction aborted, leaves nothing visible and the next one
//!   commits.
//! - `a_record_that_never_fits_the_local_queue_fails_alone`: with
//!   `queue.buffering.max.kbytes=1`, a 2 000-byte record can never enter librdkafka's local
//!   queue and fails with QueueFull after the wait for room; the records after it fit and are
//!   delivered, on both paths (the batch path once failed the rest of its run with it).
//! - `new_topics_inside_transactions`: a transaction's mixed batches to names nobody created:
//!   the committed one read exactly once in order by a read_committed reader, nothing of the
//!   aborted one.
//! - `log_append_time_deliveries_carry_the_brokers_timestamp`: on a topic with
//!   `message.timestamp.type=LogAppendTime`, every delivery's timestamp (plain, with headers,
//!   with its own timestamp) is the one the broker wrote, as a consumer reads it.
//! - `a_topic_that_does_not_exist_yet`: a mixed batch to a name nobody created (the broker
//!   creates it): every record delivered, read back exactly once, in order.
//!
//! Every test body runs under a hang guard (a generous timeout that only turns a hang into a
//! failure; nothing here asserts a duration). Runs when `ONCEFLOW_KAFKA_URL` is set.

mod common;

use common::{
    guarded, name, offset, payload, platform, producer, read_topics, topic, url, with_option,
};
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::FutureExt;
use onceflow_core::{
    Delivery, Message, PlatformBackend, ProducerConfig, Record, Result, TopicSpec,
};

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// What a record of a mixed batch is, by the path it takes.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Shape {
    /// No partition, timestamp or headers: `rd_kafka_produce_batch`.
    Plain,
    /// A header: `rd_kafka_producev`.
    Header,
    /// An explicit partition 0: `rd_kafka_producev`.
    Partition,
    /// An explicit timestamp: `rd_kafka_producev`.
    Timestamp,
}

/// A fixed timestamp for [`Shape::Timestamp`] records (2023-11-14).
const FIXED_TS: i64 = 1_700_000_000_000;

/// Record `i` of batch `tag`: key `None`, empty or `k{i % 97}` by turns, payload empty every
/// fifth record, else `"{tag}-{i:05}"` (padded to `pad` bytes when `pad` > 0).
fn record(topic: &str, tag: &str, i: usize, shape: Shape, pad: usize) -> Record {
    let body = if i % 5 == 4 {
        Vec::new()
    } else {
        let mut b = format!("{tag}-{i:05}").into_bytes();
        if b.len() < pad {
            b.resize(pad, b'.');
        }
        b
    };
    let mut r = Record::new(topic.to_string(), body);
    match i % 3 {
        0 => {}
        1 => r.key = Some(Bytes::new()),
        _ => r = r.key(format!("k{}", i % 97)),
    }
    match shape {
        Shape::Plain => {}
        Shape::Header => r = r.header("h", format!("v{i}")).header("empty", Vec::new()),
        Shape::Partition => r = r.partition(0),
        Shape::Timestamp => r.timestamp = Some(FIXED_TS + i as i64),
    }
    r
}

/// A batch of segments `(topic, shape, count)`, in order.
fn batch(tag: &str, segments: &[(&str, Shape, usize)], pad: usize) -> Vec<Record> {
    let mut out = Vec::new();
    for (topic, shape, count) in segments {
        for _ in 0..*count {
            let i = out.len();
            out.push(record(topic, tag, i, *shape, pad));
        }
    }
    out
}

/// Checks that every result is a delivery to its record's topic and that offsets rise in input
/// order within each (topic, partition). Returns the deliveries.
fn delivered(what: &str, records: &[Record], results: Vec<Result<Delivery>>) -> Vec<Delivery> {
    assert_eq!(
        results.len(),
        records.len(),
        "{what}: one result per record"
    );
    let mut last: HashMap<(String, i32), i64> = HashMap::new();
    let mut out = Vec::with_capacity(records.len());
    for (i, (r, res)) in records.iter().zip(results).enumerate() {
        let d = res.unwrap_or_else(|e| panic!("{what}: record {i}: {e}"));
        assert_eq!(d.topic, r.topic, "{what}: record {i}");
        if let Some(p) = r.partition {
            assert_eq!(
                d.partition, p,
                "{what}: record {i}: the partition asked for"
            );
        }
        let o = offset(&d);
        if let Some(prev) = last.insert((d.topic.clone(), d.partition), o) {
            assert!(
                o > prev,
                "{what}: record {i} ({:?}): offset {o} after {prev} in {}[{}]",
                r.payload,
                d.topic,
                d.partition
            );
        }
        out.push(d);
    }
    out
}

/// Compares what was read with what was sent: exactly one message per record, at its
/// delivery's (topic, partition, offset), with its key, payload and headers; the delivery's
/// timestamp is the message's; a record with a timestamp keeps it, one without gets a
/// CreateTime within `[sent_from, sent_to]` (wall clock before and after its send call).
fn compare(what: &str, sent: &[(Record, Delivery, i64, i64)], got: &[Message]) {
    let mut by_pos: HashMap<(String, i32, i64), &Message> = HashMap::new();
    for m in got {
        let at = (
            m.topic.clone(),
            m.partition,
            m.position.as_offset().expect("a Kafka offset"),
        );
        assert!(
            by_pos.insert(at.clone(), m).is_none(),
            "{what}: {at:?} read twice"
        );
    }
    assert_eq!(
        got.len(),
        sent.len(),
        "{what}: the topics hold exactly the records sent"
    );
    for (i, (r, d, from, to)) in sent.iter().enumerate() {
        let at = (d.topic.clone(), d.partition, offset(d));
        let m = by_pos
            .get(&at)
            .unwrap_or_else(|| panic!("{what}: record {i}: nothing read at {at:?}"));
        assert_eq!(m.key, r.key, "{what}: record {i} at {at:?}: key");
        assert_eq!(
            m.payload, r.payload,
            "{what}: record {i} at {at:?}: payload"
        );
        assert_eq!(
            m.headers, r.headers,
            "{what}: record {i} at {at:?}: headers"
        );
        assert_eq!(
            d.timestamp, m.timestamp,
            "{what}: record {i} at {at:?}: the delivery's timestamp is the message's"
        );
        let ts = m.timestamp.expect("a Kafka timestamp");
        match r.timestamp {
            Some(t) => assert_eq!(ts, t, "{what}: record {i}: its own timestamp"),
            None => assert!(
                (*from..=*to).contains(&ts),
                "{what}: record {i} ({:?}) at {at:?}: CreateTime {ts} outside its send call \
                 [{from}, {to}]",
                r.payload
            ),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_batches_round_trip_record_by_record() {
    let Some(url) = url("mixed_batches_round_trip_record_by_record") else {
        return;
    };
    guarded("mixed_batches_round_trip_record_by_record", async {
        let p = platform(&url);
        let a = topic(&p, 1).await;
        let b = topic(&p, 3).await;
        let producer = producer(&p).await;
        use Shape::*;
        let mut segments: Vec<(&str, Shape, usize)> = vec![
            (&a, Plain, 1),
            (&a, Header, 1),
            (&a, Plain, 1023),
            (&a, Partition, 1),
            (&a, Plain, 1024),
            (&a, Timestamp, 1),
            (&a, Plain, 1025),
            (&b, Plain, 1024),
            (&a, Plain, 2049),
            (&b, Header, 2),
            (&b, Plain, 3),
            (&a, Partition, 3),
        ];
        // Two topics alternating record by record: runs of one.
        for k in 0..200 {
            let t: &str = if k % 2 == 0 { &a } else { &b };
            segments.push((t, Plain, 1));
        }
        // Alternating shapes within one topic.
        for k in 0..200 {
            let s = [Plain, Header, Plain, Timestamp, Plain, Partition][k % 6];
            segments.push((&a, s, 1));
        }
        segments.push((&a, Plain, 1024));
        let mut sent = Vec::new();
        for round in 0..3 {
            let records = batch(&format!("m{round}"), &segments, 0);
            let from = now_ms();
            let out = producer.send_batch(records.clone()).await;
            let to = now_ms();
            let ds = delivered(&format!("batch {round}"), &records, out);
            sent.extend(records.into_iter().zip(ds).map(|(r, d)| (r, d, from, to)));
        }
        // Exactly 1 024 and 1 025 plain records alone.
        for (round, n) in [1024usize, 1025, 1, 0].into_iter().enumerate() {
            let records = batch(&format!("n{round}"), &[(&a, Plain, n)], 0);
            let from = now_ms();
            let out = producer.send_batch(records.clone()).await;
            let to = now_ms();
            let ds = delivered(&format!("plain batch of {n}"), &records, out);
            sent.extend(records.into_iter().zip(ds).map(|(r, d)| (r, d, from, to)));
        }
        let got = read_topics(&p, &[&a, &b], sent.len()).await;
        compare("mixed batches", &sent, &got);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_choose_the_same_partition_on_both_paths() {
    let Some(url) = url("keys_choose_the_same_partition_on_both_paths") else {
        return;
    };
    guarded("keys_choose_the_same_partition_on_both_paths", async {
        const KEYS: usize = 300;
        let plain = platform(&url);
        // The default partitioner, and the Java client's (a topic-level property: the
        // produce_batch path's topic handle must have it too).
        for option in [None, Some("partitioner=murmur2_random")] {
            let p = match option {
                Some(o) => platform(&with_option(&url, o)),
                None => plain.clone(),
            };
            let t = topic(&plain, 7).await;
            let producer = producer(&p).await;
            let key = |k: usize| format!("key-{k}");
            // The per-record path first, one send per key: it also settles the metadata.
            let mut single = Vec::with_capacity(KEYS);
            for k in 0..KEYS {
                let d = producer
                    .send(Record::new(t.clone(), format!("single-{k}")).key(key(k)))
                    .await
                    .unwrap();
                single.push(d.partition);
            }
            assert!(
                single
                    .iter()
                    .collect::<std::collections::HashSet<_>>()
                    .len()
                    > 1,
                "{option:?}: {KEYS} keys spread over more than one of 7 partitions"
            );
            // Plain records (runs), and the same keys with a header (per record).
            let plain_records: Vec<Record> = (0..KEYS)
                .map(|k| Record::new(t.clone(), format!("plain-{k}")).key(key(k)))
                .collect();
            let out = producer.send_batch(plain_records.clone()).await;
            let plain_ds = delivered("plain", &plain_records, out);
            let headed: Vec<Record> = (0..KEYS)
                .map(|k| {
                    Record::new(t.clone(), format!("headed-{k}"))
                        .key(key(k))
                        .header("h", "v")
                })
                .collect();
            let out = producer.send_batch(headed.clone()).await;
            let headed_ds = delivered("headed", &headed, out);
            for k in 0..KEYS {
                assert_eq!(
                    plain_ds[k].partition, single[k],
                    "{option:?}: key {k}: rd_kafka_produce_batch and rd_kafka_producev disagree"
                );
                assert_eq!(headed_ds[k].partition, single[k], "{option:?}: key {k}");
            }
            // A fresh producer whose first records for the topic go through produce_batch
            // (its topic handle is created there, not by rd_kafka_producev).
            let fresh = self::producer(&p).await;
            let out = fresh.send_batch(plain_records.clone()).await;
            let fresh_ds = delivered("fresh", &plain_records, out);
            for k in 0..KEYS {
                assert_eq!(
                    fresh_ds[k].partition, single[k],
                    "{option:?}: key {k}: a topic handle made by the batch path partitions \
                     otherwise"
                );
            }
        }
    })
    .await;
}

/// A record's key, payload and whether it has a header (then it takes the per-record path).
type Case = (Option<&'static [u8]>, &'static [u8], bool);

/// A raw consumer's key and value, `None` for null.
type Raw = (Option<Vec<u8>>, Option<Vec<u8>>);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn null_and_empty_keys_and_payloads_reach_a_raw_consumer() {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::Message as _;
    let Some(url) = url("null_and_empty_keys_and_payloads_reach_a_raw_consumer") else {
        return;
    };
    guarded(
        "null_and_empty_keys_and_payloads_reach_a_raw_consumer",
        async {
            let p = platform(&url);
            let t = topic(&p, 1).await;
            let producer = producer(&p).await;
            // (key, payload, header?): the batch path for those without a header.
            let cases: Vec<Case> = vec![
                (None, b"", false),
                (Some(b""), b"", false),
                (Some(b"k"), b"", false),
                (None, b"p", false),
                (Some(b""), b"p", false),
                (None, b"", true),
                (Some(b""), b"", true),
                (Some(b"k"), b"p", true),
            ];
            let records: Vec<Record> = cases
                .iter()
                .map(|(k, v, h)| {
                    let mut r = Record::new(t.clone(), v.to_vec());
                    r.key = k.map(Bytes::copy_from_slice);
                    if *h {
                        r = r.header("h", "v");
                    }
                    r
                })
                .collect();
            let out = producer.send_batch(records.clone()).await;
            let ds = delivered("cases", &records, out);
            assert!(ds.iter().enumerate().all(|(i, d)| offset(d) == i as i64));

            let bootstrap = url
                .trim_start_matches("kafka://")
                .split('?')
                .next()
                .unwrap()
                .to_string();
            let t2 = t.clone();
            let n = cases.len();
            let got: Vec<Raw> = tokio::task::spawn_blocking(move || {
                let c: BaseConsumer = rdkafka::ClientConfig::new()
                    .set("bootstrap.servers", &bootstrap)
                    .set("group.id", name("kafka-batch-raw"))
                    .set("enable.auto.commit", "false")
                    .create()
                    .unwrap();
                let mut tpl = rdkafka::TopicPartitionList::new();
                tpl.add_partition_offset(&t2, 0, rdkafka::Offset::Beginning)
                    .unwrap();
                c.assign(&tpl).unwrap();
                let mut got = Vec::new();
                let since = std::time::Instant::now();
                while got.len() < n && since.elapsed() < Duration::from_secs(60) {
                    if let Some(m) = c.poll(Duration::from_millis(250)) {
                        let m = m.unwrap();
                        got.push((m.key().map(<[u8]>::to_vec), m.payload().map(<[u8]>::to_vec)));
                    }
                }
                got
            })
            .await
            .unwrap();
            assert_eq!(got.len(), n);
            for (i, ((k, v, h), (gk, gv))) in cases.iter().zip(&got).enumerate() {
                let path = if *h { "producev" } else { "produce_batch" };
                assert_eq!(gk.as_deref(), *k, "case {i} ({path}): key");
                assert_eq!(
                    gv.as_deref(),
                    Some(*v),
                    "case {i} ({path}): payload (an empty payload must not become a null value)"
                );
            }
        },
    )
    .await;
}

/// Each batch's records, by tag, read exactly once and in input order (payload
/// `"{tag}-{i:05}"`; empty payloads carry no index and are only counted).
fn check_batches_in_order(what: &str, got: &[Message], batches: &BTreeMap<String, Vec<Record>>) {
    let mut seen: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    let mut empty = 0;
    for m in got {
        let s = payload(m);
        if s.is_empty() {
            empty += 1;
            continue;
        }
        let (tag, rest) = s.split_once('-').expect("tag-index");
        let i: usize = rest[..5].parse().expect("index");
        seen.entry(tag.to_string()).or_default().push(i);
    }
    let mut want_empty = 0;
    for (tag, records) in batches {
        let want: Vec<usize> = records
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.payload.is_empty())
            .map(|(i, _)| i)
            .collect();
        want_empty += records.len() - want.len();
        assert_eq!(
            seen.get(tag).map(Vec::as_slice).unwrap_or_default(),
            &want[..],
            "{what}: batch {tag}: each record once, in order"
        );
    }
    assert_eq!(seen.len(), batches.len(), "{what}: no other batch");
    assert_eq!(empty, want_empty, "{what}: records with empty payloads");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_local_queue_by_count_and_by_size_keeps_each_batch_in_order() {
    let Some(url) = url("full_local_queue_by_count_and_by_size_keeps_each_batch_in_order") else {
        return;
    };
    guarded(
        "full_local_queue_by_count_and_by_size_keeps_each_batch_in_order",
        async {
            let plain = platform(&url);
            for (option, pad) in [
                ("queue.buffering.max.messages=10", 0),
                // 1 KiB of payloads in the queue: records of 17 to 700 bytes, so the queue is
                // full for a large one while a small one would still fit.
                ("queue.buffering.max.kbytes=1", 700),
            ] {
                let tiny = platform(&with_option(&url, option));
                let t = topic(&plain, 1).await;
                let producer = producer(&tiny).await;
                use Shape::*;
                let segments: Vec<(&str, Shape, usize)> = vec![
                    (&t, Plain, 1025),
                    (&t, Header, 1),
                    (&t, Plain, 1024),
                    (&t, Timestamp, 1),
                    (&t, Plain, 300),
                ];
                let mut batches = BTreeMap::new();
                let tasks: Vec<_> = (0..4)
                    .map(|task| {
                        let tag = format!("q{task}");
                        // Every third record large (when `pad`), the others small.
                        let mut records = batch(&tag, &segments, 0);
                        if pad > 0 {
                            for (i, r) in records.iter_mut().enumerate() {
                                if i % 3 == 0 && !r.payload.is_empty() {
                                    let mut b = r.payload.to_vec();
                                    b.resize(pad, b'.');
                                    r.payload = b.into();
                                }
                            }
                        }
                        batches.insert(tag, records.clone());
                        let producer = producer.clone();
                        tokio::spawn(async move {
                            let out = producer.send_batch(records.clone()).await;
                            delivered(&format!("task {task}"), &records, out);
                        })
                    })
                    .collect();
                for task in tasks {
                    task.await.unwrap();
                }
                let n = batches.values().map(Vec::len).sum();
                let got = read_topics(&plain, &[&t], n).await;
                assert_eq!(got.len(), n, "{option}: exactly the records sent");
                check_batches_in_order(option, &got, &batches);
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueued_batches_leave_in_call_order() {
    let Some(url) = url("enqueued_batches_leave_in_call_order") else {
        return;
    };
    guarded("enqueued_batches_leave_in_call_order", async {
        let p = platform(&url);
        let t = topic(&p, 1).await;
        let producer = producer(&p).await;
        use Shape::*;
        let shapes: [&[(&str, Shape, usize)]; 5] = [
            &[(&t, Plain, 1)],
            &[(&t, Plain, 1000), (&t, Header, 2), (&t, Plain, 25)],
            &[(&t, Timestamp, 1), (&t, Plain, 2)],
            &[(&t, Plain, 2049)],
            &[(&t, Partition, 3), (&t, Plain, 4)],
        ];
        let mut batches = BTreeMap::new();
        let mut pending = Vec::new();
        for (k, segments) in shapes.iter().enumerate() {
            let tag = format!("e{k}");
            let records = batch(&tag, segments, 0);
            batches.insert(tag.clone(), records.clone());
            pending.push((tag, records.clone(), producer.enqueue_batch(records).await));
        }
        let mut sent = Vec::new();
        while let Some((tag, records, reports)) = pending.pop() {
            sent.push((tag.clone(), delivered(&tag, &records, reports.await)));
        }
        sent.reverse();
        for pair in sent.windows(2) {
            let (before, after) = (&pair[0], &pair[1]);
            let last = before.1.last().map(offset).unwrap();
            let first = after.1.first().map(offset).unwrap();
            assert!(
                first > last,
                "batch {} starts at offset {first}, not after batch {}'s last, {last}",
                after.0,
                before.0
            );
        }
        let n = batches.values().map(Vec::len).sum();
        let got = read_topics(&p, &[&t], n).await;
        assert_eq!(got.len(), n, "exactly the records enqueued");
        check_batches_in_order("enqueued batches", &got, &batches);
        producer.close().await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_on_the_batch_path() {
    let Some(url) = url("transactions_on_the_batch_path") else {
        return;
    };
    guarded("transactions_on_the_batch_path", async {
        let p = platform(&url);
        let a = topic(&p, 2).await;
        let b = topic(&p, 1).await;
        let producer = p
            .producer(ProducerConfig {
                transactional_id: Some(name("kafka-batch-tx")),
                ..Default::default()
            })
            .await
            .unwrap();
        use Shape::*;
        let segs_a: Vec<(&str, Shape, usize)> = vec![
            (&a, Plain, 1100),
            (&a, Header, 2),
            (&a, Plain, 500),
            (&a, Partition, 1),
            (&a, Plain, 30),
        ];
        let segs_ab: Vec<(&str, Shape, usize)> = vec![
            (&a, Plain, 700),
            (&b, Plain, 1025),
            (&a, Timestamp, 1),
            (&b, Header, 1),
            (&a, Plain, 10),
        ];
        let mut committed = BTreeMap::new();

        // Aborted: sent, then aborted.
        let mut tx = producer.begin().await.unwrap();
        let records = batch("abortedsend", &segs_a, 0);
        let out = tx.send_batch(records.clone()).await;
        delivered("aborted send_batch", &records, out);
        tx.abort().await.unwrap();

        // Committed: enqueued, awaited, committed.
        let mut tx = producer.begin().await.unwrap();
        let records = batch("enqueued", &segs_a, 0);
        let pending = tx.enqueue_batch(records.clone()).await;
        let records2 = batch("enqueuedtoo", &segs_ab, 0);
        let pending2 = tx.enqueue_batch(records2.clone()).await;
        delivered("enqueue_batch", &records, pending.await);
        delivered("enqueue_batch 2", &records2, pending2.await);
        tx.commit().await.unwrap();
        committed.insert("enqueued".to_string(), records);
        committed.insert("enqueuedtoo".to_string(), records2);

        // Aborted again, with enqueued batches never awaited before the abort.
        let mut tx = producer.begin().await.unwrap();
        let records = batch("abortedenq", &segs_ab, 0);
        let len = records.len();
        let pending = tx.enqueue_batch(records).await;
        tx.abort().await.unwrap();
        assert_eq!(pending.await.len(), len, "one result per record");

        // Committed: two topics in one send_batch.
        let mut tx = producer.begin().await.unwrap();
        let records = batch("sent", &segs_ab, 0);
        let out = tx.send_batch(records.clone()).await;
        delivered("committed send_batch", &records, out);
        tx.commit().await.unwrap();
        committed.insert("sent".to_string(), records);

        let n: usize = committed.values().map(Vec::len).sum();
        let got = read_topics(&p, &[&a, &b], n).await;
        assert_eq!(
            got.len(),
            n,
            "read_committed: exactly the committed records"
        );
        // Order per topic and batch (each batch spans partitions: compare per topic-partition
        // through the payload tags).
        let mut per: BTreeMap<(String, i32), Vec<Message>> = BTreeMap::new();
        for m in got {
            per.entry((m.topic.clone(), m.partition))
                .or_default()
                .push(m);
        }
        let mut all = Vec::new();
        for ms in per.values() {
            let mut last: HashMap<String, usize> = HashMap::new();
            for m in ms {
                let s = payload(m);
                if s.is_empty() {
                    continue;
                }
                let (tag, rest) = s.split_once('-').unwrap();
                assert!(
                    committed.contains_key(tag),
                    "an aborted record is visible to read_committed: {s}"
                );
                let i: usize = rest[..5].parse().unwrap();
                if let Some(prev) = last.insert(tag.to_string(), i) {
                    assert!(
                        i > prev,
                        "{s} after index {prev} in {}[{}]",
                        m.topic,
                        m.partition
                    );
                }
            }
            all.extend(ms.iter().cloned());
        }
        check_batches_in_order_any_partition(&all, &committed);
    })
    .await;
}

/// Like [`check_batches_in_order`] without the order (records spread over partitions): every
/// committed record exactly once.
fn check_batches_in_order_any_partition(got: &[Message], batches: &BTreeMap<String, Vec<Record>>) {
    let mut seen: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for m in got {
        let s = payload(m);
        if let Some((tag, rest)) = s.split_once('-') {
            seen.entry(tag.to_string())
                .or_default()
                .push(rest[..5].parse().unwrap());
        }
    }
    for (tag, records) in batches {
        let mut got = seen.remove(tag).unwrap_or_default();
        got.sort_unstable();
        let want: Vec<usize> = records
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.payload.is_empty())
            .map(|(i, _)| i)
            .collect();
        assert_eq!(got, want, "batch {tag}: each committed record exactly once");
    }
    assert!(
        seen.is_empty(),
        "records of other batches: {:?}",
        seen.keys()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_dropped_in_a_full_queue_inside_a_transaction() {
    let Some(url) = url("a_send_dropped_in_a_full_queue_inside_a_transaction") else {
        return;
    };
    guarded(
        "a_send_dropped_in_a_full_queue_inside_a_transaction",
        async {
            let plain = platform(&url);
            let tiny = platform(&with_option(&url, "queue.buffering.max.messages=10"));
            let t = topic(&plain, 1).await;
            let producer = tiny
                .producer(ProducerConfig {
                    transactional_id: Some(name("kafka-batch-tx-drop")),
                    ..Default::default()
                })
                .await
                .unwrap();
            for round in 0..5 {
                let mut tx = producer.begin().await.unwrap();
                let records = batch(&format!("dropped{round}"), &[(&t, Shape::Plain, 3000)], 0);
                assert!(
                    tx.send_batch(records).now_or_never().is_none(),
                    "3 000 records cannot all be reported through a queue of 10 in one poll"
                );
                tx.abort().await.unwrap();
            }
            let mut committed = BTreeMap::new();
            let mut tx = producer.begin().await.unwrap();
            let records = batch(
                "kept",
                &[
                    (&t, Shape::Plain, 2000),
                    (&t, Shape::Header, 1),
                    (&t, Shape::Plain, 5),
                ],
                0,
            );
            let out = tx.send_batch(records.clone()).await;
            delivered("after the dropped sends", &records, out);
            tx.commit().await.unwrap();
            committed.insert("kept".to_string(), records);
            let got = read_topics(&plain, &[&t], 2006).await;
            check_batches_in_order("after dropped sends", &got, &committed);
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_that_does_not_exist_yet() {
    let Some(url) = url("a_topic_that_does_not_exist_yet") else {
        return;
    };
    guarded("a_topic_that_does_not_exist_yet", async {
        let p = platform(&url);
        let producer = producer(&p).await;
        let mut sent = Vec::new();
        let mut topics = Vec::new();
        for round in 0..3 {
            // Nobody created it: the broker does, on the producer's metadata request.
            let t = name("kafka-batch-new");
            use Shape::*;
            let segments: Vec<(&str, Shape, usize)> = vec![
                (&t, Plain, 1500),
                (&t, Header, 1),
                (&t, Plain, 700),
                (&t, Timestamp, 2),
                (&t, Plain, 1025),
            ];
            let records = batch(&format!("new{round}"), &segments, 0);
            let from = now_ms();
            let out = producer.send_batch(records.clone()).await;
            let to = now_ms();
            let ds = delivered(&format!("new topic {round}"), &records, out);
            sent.extend(records.into_iter().zip(ds).map(|(r, d)| (r, d, from, to)));
            topics.push(t);
        }
        let topics: Vec<&str> = topics.iter().map(String::as_str).collect();
        let got = read_topics(&p, &topics, sent.len()).await;
        compare("new topics", &sent, &got);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_that_never_fits_the_local_queue_fails_alone() {
    let Some(url) = url("a_record_that_never_fits_the_local_queue_fails_alone") else {
        return;
    };
    guarded(
        "a_record_that_never_fits_the_local_queue_fails_alone",
        async {
            let plain = platform(&url);
            // librdkafka's local queue holds at most 1 KiB of payloads: a record of 2 000 bytes
            // never fits (`rd_kafka_curr_msgs_add`), whatever is drained.
            let tiny = platform(&with_option(&url, "queue.buffering.max.kbytes=1"));
            let t = topic(&plain, 1).await;
            let producer = producer(&tiny).await;
            let batch = |header: bool| -> Vec<Record> {
                (0..6)
                    .map(|i| {
                        let body = if i == 1 {
                            vec![b'x'; 2000]
                        } else {
                            format!("r{i}").into_bytes()
                        };
                        let r = Record::new(t.clone(), body);
                        if header {
                            r.header("h", "v")
                        } else {
                            r
                        }
                    })
                    .collect()
            };
            // Both paths concurrently (each waits for room for the large record, in vain).
            let per_record = {
                let producer = producer.clone();
                let records = batch(true);
                tokio::spawn(async move { producer.send_batch(records).await })
            };
            let batched = producer.send_batch(batch(false)).await;
            let per_record = per_record.await.unwrap();
            for (path, out) in [
                ("rd_kafka_producev", &per_record),
                ("produce_batch", &batched),
            ] {
                assert_eq!(out.len(), 6, "{path}");
                let e = out[1].as_ref().expect_err("never fits the local queue");
                assert!(e.message().contains("Queue full"), "{path}: {e}");
                let failed: Vec<String> = out
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i != 1)
                    .filter_map(|(i, r)| r.as_ref().err().map(|e| format!("record {i}: {e}")))
                    .collect();
                assert!(
                    failed.is_empty(),
                    "{path}: records that fit the local queue failed with the one that never \
                 does: {failed:#?}"
                );
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_append_time_deliveries_carry_the_brokers_timestamp() {
    let Some(url) = url("log_append_time_deliveries_carry_the_brokers_timestamp") else {
        return;
    };
    guarded(
        "log_append_time_deliveries_carry_the_brokers_timestamp",
        async {
            let p = platform(&url);
            let t = name("kafka-batch-lat");
            let mut spec = TopicSpec::new(t.clone(), 2);
            spec.options.insert(
                "message.timestamp.type".to_string(),
                "LogAppendTime".to_string(),
            );
            p.admin().await.unwrap().create_topic(&spec).await.unwrap();
            let producer = producer(&p).await;
            use Shape::*;
            let segments: Vec<(&str, Shape, usize)> = vec![
                (&t, Plain, 1030),
                (&t, Header, 2),
                (&t, Timestamp, 2),
                (&t, Plain, 10),
            ];
            let mut sent = Vec::new();
            for round in 0..2 {
                let records = batch(&format!("l{round}"), &segments, 0);
                let from = now_ms();
                let out = producer.send_batch(records.clone()).await;
                let to = now_ms();
                let ds = delivered(&format!("round {round}"), &records, out);
                sent.extend(ds.into_iter().map(|d| (d, from, to)));
            }
            let got = read_topics(&p, &[&t], sent.len()).await;
            assert_eq!(got.len(), sent.len(), "exactly the records sent");
            let by_pos: HashMap<(i32, i64), &Message> = got
                .iter()
                .map(|m| ((m.partition, m.position.as_offset().unwrap()), m))
                .collect();
            for (i, (d, from, to)) in sent.iter().enumerate() {
                let m = by_pos[&(d.partition, offset(d))];
                assert_eq!(
                    d.timestamp, m.timestamp,
                    "record {i}: the broker's timestamp"
                );
                let ts = m.timestamp.unwrap();
                assert!(
                    (*from..=*to).contains(&ts),
                    "record {i}: LogAppendTime {ts} outside its send call [{from}, {to}]"
                );
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_topics_inside_transactions() {
    let Some(url) = url("new_topics_inside_transactions") else {
        return;
    };
    guarded("new_topics_inside_transactions", async {
        let p = platform(&url);
        let producer = p
            .producer(ProducerConfig {
                transactional_id: Some(name("kafka-batch-tx-new")),
                ..Default::default()
            })
            .await
            .unwrap();
        let kept = name("kafka-batch-new-kept");
        let dropped = name("kafka-batch-new-aborted");
        use Shape::*;
        // One transaction writes both new topics and aborts; the next writes `kept` again
        // and commits.
        let mut tx = producer.begin().await.unwrap();
        let aborted = batch(
            "aborted",
            &[
                (&dropped, Plain, 1500),
                (&kept, Plain, 700),
                (&dropped, Header, 1),
            ],
            0,
        );
        let out = tx.send_batch(aborted.clone()).await;
        delivered("aborted", &aborted, out);
        tx.abort().await.unwrap();
        let mut tx = producer.begin().await.unwrap();
        let records = batch(
            "committed",
            &[
                (&kept, Plain, 1100),
                (&kept, Header, 1),
                (&kept, Plain, 300),
            ],
            0,
        );
        let pending = tx.enqueue_batch(records.clone()).await;
        delivered("committed", &records, pending.await);
        tx.commit().await.unwrap();
        let mut committed = BTreeMap::new();
        committed.insert("committed".to_string(), records);
        let got = read_topics(&p, &[&kept, &dropped], 1401).await;
        check_batches_in_order("new topics in transactions", &got, &committed);
    })
    .await;
}
