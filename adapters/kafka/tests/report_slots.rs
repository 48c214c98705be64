//! The Kafka producer's delivery report slots (`Reports`, `SlotRef` in `src/producer.rs`) under
//! stress on a real broker: every record's librdkafka opaque points into its batch's one
//! allocation, which the records in flight keep alive between them. These tests drive every
//! way a slot is filled or given back and check what each caller gets:
//!
//! - `concurrent_batches_deliver_every_record`: 16 tasks × 20 batches × 500 records on one
//!   producer: every result is a delivery, offsets are unique and contiguous per partition, in
//!   order within a batch, and the topic holds exactly the records sent.
//! - `oversized_and_refused_records_fail_at_their_index`: batches mixing records over
//!   `message.max.bytes` (never handed to librdkafka) and records librdkafka refuses at once
//!   (unknown partition, a topic name with a NUL) with valid ones: each failure at its index,
//!   the others delivered in order; all-failed and empty batches return at once.
//! - `records_refused_inside_a_produce_batch_run_fail_at_their_index`: records for a topic name
//!   the broker refuses, between valid ones, in three batches: librdkafka refuses the later
//!   ones inside `rd_kafka_produce_batch`; each fails at its index, the others are delivered.
//! - `full_local_queue_delivers_everything`: `queue.buffering.max.messages=10`, so enqueueing
//!   waits for room over and over: a 5 000-record batch, then concurrent batches and single
//!   sends, all delivered.
//! - `cancelled_sends_then_a_new_producer`: sends dropped after one poll (after enqueueing, and
//!   while waiting for room in a full queue), many times; what was enqueued is still written,
//!   and after the producers are dropped a new one sends normally.
//! - `producer_dropped_with_records_in_flight`: the producer's last handle goes with a send in
//!   flight (the send owns it), with a send dropped mid-flight, and with a transaction's
//!   enqueued batch: no crash, and a caller that waits gets one result per record.
//! - `report_slots_are_freed`: with a counting global allocator, batches (delivered, mixed with
//!   failures) and cancelled sends leave nothing allocated once their records are reported.
//! - `dropped_producer_frees_its_report_slots`: the same when producers are dropped with their
//!   records in flight (librdkafka purges them and reports them as such).
//!
//! Every test body runs under a hang guard (a generous timeout that only turns a hang into a
//! failure; nothing here asserts a duration). Runs when `ONCEFLOW_KAFKA_URL` is set; without it
//! each test says it skipped, and with `ONCEFLOW_REQUIRE_BROKERS=1` (`make test`) that is a
//! failure.

mod common;

use common::{guarded, name, offset, payload, platform, producer, read, topic, url, with_option};
use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Duration;

use futures::FutureExt;
use onceflow_core::{Delivery, ErrorKind, PlatformBackend, ProducerConfig, Record, Result};

/// Bound of a producer flush before its handles are dropped.
const FLUSH: Duration = Duration::from_secs(120);

/// Live bytes of the Rust heap, for [`report_slots_are_freed`].
static LIVE: AtomicIsize = AtomicIsize::new(0);

/// The system allocator, counting live bytes in [`LIVE`].
struct Counting;

// SAFETY: every call is forwarded unchanged to `System`; the counter only observes sizes.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (so from `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from this allocator (so from `System`) with `layout`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The other tests hold it shared; [`report_slots_are_freed`] holds it alone, so no other
/// test's allocations fall into its measurement.
static HEAP: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// Checks one batch's results: one per record, each a delivery to `topic` with a partition in
/// `0..partitions` and an offset ≥ 0, and within each partition offsets rising in input order.
/// Returns the (partition, offset) pairs.
fn check_batch(
    what: &str,
    results: Vec<Result<Delivery>>,
    len: usize,
    topic: &str,
    partitions: i32,
) -> Vec<(i32, i64)> {
    assert_eq!(results.len(), len, "{what}: one result per record");
    let mut last: BTreeMap<i32, i64> = BTreeMap::new();
    let mut out = Vec::with_capacity(len);
    for (i, r) in results.into_iter().enumerate() {
        let d = r.unwrap_or_else(|e| panic!("{what}: record {i}: {e}"));
        assert_eq!(d.topic, topic, "{what}: record {i}");
        assert!(
            (0..partitions).contains(&d.partition),
            "{what}: record {i}: partition {}",
            d.partition
        );
        let o = offset(&d);
        assert!(o >= 0, "{what}: record {i}: offset {o}");
        if let Some(prev) = last.insert(d.partition, o) {
            assert!(
                o > prev,
                "{what}: record {i}: offset {o} after {prev} in partition {}",
                d.partition
            );
        }
        out.push((d.partition, o));
    }
    out
}

/// Every partition's offsets are exactly 0..count (a new topic written only by idempotent,
/// non-transactional producers).
fn assert_contiguous(what: &str, pairs: &[(i32, i64)]) {
    let mut per: BTreeMap<i32, Vec<i64>> = BTreeMap::new();
    for (p, o) in pairs {
        per.entry(*p).or_default().push(*o);
    }
    for (p, mut offsets) in per {
        offsets.sort_unstable();
        let n = offsets.len() as i64;
        assert!(
            offsets.iter().copied().eq(0..n),
            "{what}: partition {p}: offsets are not 0..{n} (first {:?}, last {:?})",
            offsets.first(),
            offsets.last()
        );
    }
}

fn keyed(topic: &str, key: usize, payload: String) -> Record {
    Record::new(topic.to_string(), payload).key(format!("k{key}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_deliver_every_record() {
    let Some(url) = url("concurrent_batches_deliver_every_record") else {
        return;
    };
    let _heap = HEAP.read().await;
    guarded("concurrent_batches_deliver_every_record", async {
        const TASKS: usize = 16;
        const BATCHES: usize = 20;
        const RECORDS: usize = 500;
        const PARTITIONS: i32 = 4;
        let p = platform(&url);
        let t = topic(&p, PARTITIONS as u32).await;
        let producer = producer(&p).await;
        let tasks: Vec<_> = (0..TASKS)
            .map(|task| {
                let producer = producer.clone();
                let t = t.clone();
                tokio::spawn(async move {
                    let mut pairs = Vec::with_capacity(BATCHES * RECORDS);
                    for batch in 0..BATCHES {
                        let records = (0..RECORDS)
                            .map(|i| keyed(&t, i % 64, format!("t{task}-b{batch}-r{i}")))
                            .collect();
                        let out = producer.send_batch(records).await;
                        let what = format!("task {task} batch {batch}");
                        pairs.extend(check_batch(&what, out, RECORDS, &t, PARTITIONS));
                    }
                    pairs
                })
            })
            .collect();
        let mut pairs = Vec::with_capacity(TASKS * BATCHES * RECORDS);
        for task in tasks {
            pairs.extend(task.await.unwrap());
        }
        let total = TASKS * BATCHES * RECORDS;
        let unique: HashSet<_> = pairs.iter().copied().collect();
        assert_eq!(unique.len(), total, "every record has its own offset");
        assert_contiguous("concurrent batches", &pairs);

        let got = read(&p, &t, total).await;
        let payloads: HashSet<String> = got.iter().map(payload).collect();
        assert_eq!(got.len(), total, "the topic holds exactly the records sent");
        assert_eq!(payloads.len(), total, "each record once");
        assert!(payloads.contains("t0-b0-r0") && payloads.contains("t15-b19-r499"));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_and_refused_records_fail_at_their_index() {
    let Some(url) = url("oversized_and_refused_records_fail_at_their_index") else {
        return;
    };
    let _heap = HEAP.read().await;
    guarded("oversized_and_refused_records_fail_at_their_index", async {
        const RECORDS: usize = 400;
        const BATCHES: usize = 8;
        let plain = platform(&url);
        let small = platform(&with_option(&url, "message.max.bytes=2048"));
        assert_eq!(small.max_record_bytes(), 2048);
        let t = topic(&plain, 1).await;
        let producer = producer(&small).await;
        // A first delivery, so the producer knows the topic's partitions for the refusals below.
        let first = producer
            .send(Record::new(t.clone(), "first"))
            .await
            .unwrap();
        assert_eq!((first.partition, offset(&first)), (0, 0));

        // Too large at 0, at every 7th index and at the end; valid records between them, some
        // of 1 900 bytes (near the limit; librdkafka's own `message.max.bytes` check counts the
        // record's framing too, and so does onceflow's: a record of exactly 2 048 bytes is
        // refused before librdkafka sees it, with the same error kind and limit).
        let too_large = |i: usize| i == 0 || i % 7 == 3 || i == RECORDS - 1;
        let batch = |b: usize| -> Vec<Record> {
            (0..RECORDS)
                .map(|i| {
                    if too_large(i) {
                        Record::new(t.clone(), vec![b'x'; 2049 + i])
                    } else if i % 50 == 10 {
                        let mut body = format!("b{b}-{i:04}-").into_bytes();
                        body.resize(1900, b'.');
                        Record::new(t.clone(), body)
                    } else {
                        Record::new(t.clone(), format!("b{b}-{i:04}-"))
                    }
                })
                .collect()
        };
        let tasks: Vec<_> = (0..BATCHES)
            .map(|b| {
                let producer = producer.clone();
                let records = batch(b);
                tokio::spawn(async move { producer.send_batch(records).await })
            })
            .collect();
        let mut valid = 0;
        for (b, task) in tasks.into_iter().enumerate() {
            let out = task.await.unwrap();
            assert_eq!(out.len(), RECORDS, "batch {b}: one result per record");
            let mut last = -1;
            for (i, r) in out.into_iter().enumerate() {
                if too_large(i) {
                    let e = r.expect_err("over message.max.bytes");
                    assert_eq!(e.kind(), ErrorKind::Config, "batch {b} record {i}: {e}");
                    assert!(e.message().contains("2048"), "batch {b} record {i}: {e}");
                } else {
                    let d = r.unwrap_or_else(|e| panic!("batch {b} record {i}: {e}"));
                    assert_eq!(d.partition, 0);
                    assert!(offset(&d) > last, "batch {b} record {i}: in order");
                    last = offset(&d);
                    valid += 1;
                }
            }
        }

        // Refused by librdkafka's produce call itself: the slot handed out comes back and
        // counts itself out. An unknown partition, and a topic name with a NUL byte (refused
        // before the opaque is handed over).
        let records = vec![
            Record::new(t.clone(), "refused-0").partition(5),
            Record::new(t.clone(), "kept-1"),
            Record::new(format!("{t}\0x"), "refused-2"),
            Record::new(t.clone(), "kept-3"),
            Record::new(t.clone(), vec![b'x'; 4096]),
            Record::new(t.clone(), "kept-5"),
            Record::new(t.clone(), "refused-6").partition(1),
        ];
        let out = producer.send_batch(records).await;
        assert_eq!(out.len(), 7);
        for (i, r) in out.iter().enumerate() {
            match i {
                1 | 3 | 5 => assert!(r.is_ok(), "record {i}: {r:?}"),
                4 => assert_eq!(r.as_ref().unwrap_err().kind(), ErrorKind::Config),
                _ => assert!(r.is_err(), "record {i} should fail: {r:?}"),
            }
        }
        valid += 3;

        // Nothing handed out: the batch's reports are complete once it is enqueued.
        let all_bad: Vec<_> = (0..20)
            .map(|_| Record::new(t.clone(), vec![b'y'; 3000]))
            .collect();
        let out = producer.send_batch(all_bad).await;
        assert_eq!(out.len(), 20);
        assert!(out
            .iter()
            .all(|r| r.as_ref().is_err_and(|e| e.kind() == ErrorKind::Config)));
        assert!(producer.send_batch(Vec::new()).await.is_empty());
        let e = producer
            .send(Record::new(t.clone(), vec![b'z'; 2049]))
            .await
            .expect_err("over message.max.bytes");
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        producer
            .send(Record::new(t.clone(), "refused").partition(3))
            .await
            .expect_err("unknown partition");

        // The topic holds the first record and each batch's valid records, in input order.
        let got = read(&plain, &t, 1 + valid).await;
        assert_eq!(got.len(), 1 + valid, "exactly the valid records");
        let mut per_batch: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for m in &got[1..] {
            let s = payload(m);
            if let Some((b, rest)) = s.split_once('-') {
                if let Some(i) = rest.get(..4).and_then(|i| i.parse().ok()) {
                    per_batch.entry(b.to_string()).or_default().push(i);
                }
            }
        }
        let expected: Vec<usize> = (0..RECORDS).filter(|i| !too_large(*i)).collect();
        assert_eq!(per_batch.len(), BATCHES);
        for (b, indices) in per_batch {
            assert_eq!(indices, expected, "batch {b}: valid records, in order");
        }
        let last: Vec<String> = got[got.len() - 3..].iter().map(payload).collect();
        assert_eq!(last, ["kept-1", "kept-3", "kept-5"]);
    })
    .await;
}

#[tokio::test]
async fn records_refused_inside_a_produce_batch_run_fail_at_their_index() {
    let Some(url) = url("records_refused_inside_a_produce_batch_run_fail_at_their_index") else {
        return;
    };
    let _heap = HEAP.read().await;
    guarded(
        "records_refused_inside_a_produce_batch_run_fail_at_their_index",
        async {
            let plain = platform(&url);
            let t = topic(&plain, 1).await;
            let producer = producer(&plain).await;
            // A name the broker refuses (a space is not a legal topic character): librdkafka
            // learns that from the first batch's metadata, and refuses every later record for
            // it inside `rd_kafka_produce_batch` itself.
            let bad = format!("{t} refused");
            let batch = |round: usize| -> Vec<Record> {
                (0..12)
                    .map(|i| {
                        let topic = if (4..8).contains(&i) { &bad } else { &t };
                        Record::new(topic.clone(), format!("r{round}-{i:02}"))
                    })
                    .collect()
            };
            let mut kept = 0;
            for round in 0..3 {
                let out = producer.send_batch(batch(round)).await;
                assert_eq!(out.len(), 12, "round {round}: one result per record");
                let mut last = -1;
                for (i, r) in out.into_iter().enumerate() {
                    if (4..8).contains(&i) {
                        let e = r.expect_err("a topic the broker refuses");
                        assert!(e.message().contains(&bad), "round {round} record {i}: {e}");
                    } else {
                        let d = r.unwrap_or_else(|e| panic!("round {round} record {i}: {e}"));
                        assert!(offset(&d) > last, "round {round} record {i}: in order");
                        last = offset(&d);
                        kept += 1;
                    }
                }
            }
            let got = read(&plain, &t, kept).await;
            let want: Vec<String> = (0..3)
                .flat_map(|round| {
                    (0..12)
                        .filter(|i| !(4..8).contains(i))
                        .map(move |i| format!("r{round}-{i:02}"))
                })
                .collect();
            assert_eq!(got.iter().map(payload).collect::<Vec<_>>(), want);
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_local_queue_delivers_everything() {
    let Some(url) = url("full_local_queue_delivers_everything") else {
        return;
    };
    let _heap = HEAP.read().await;
    guarded("full_local_queue_delivers_everything", async {
        const PARTITIONS: i32 = 2;
        let plain = platform(&url);
        let tiny = platform(&with_option(&url, "queue.buffering.max.messages=10"));
        let t = topic(&plain, PARTITIONS as u32).await;
        let producer = producer(&tiny).await;

        let records = (0..5_000)
            .map(|i| keyed(&t, i % 8, format!("big-{i}")))
            .collect();
        let out = producer.send_batch(records).await;
        let mut pairs = check_batch("5 000-record batch", out, 5_000, &t, PARTITIONS);

        // Batches and single sends competing for the ten places.
        let batches: Vec<_> = (0..4)
            .map(|b| {
                let producer = producer.clone();
                let records = (0..1_000)
                    .map(|i| keyed(&t, i % 8, format!("c{b}-{i}")))
                    .collect();
                tokio::spawn(async move { producer.send_batch(records).await })
            })
            .collect();
        let singles: Vec<_> = (0..100)
            .map(|i| {
                let producer = producer.clone();
                let r = keyed(&t, i % 8, format!("s-{i}"));
                tokio::spawn(async move { producer.send(r).await })
            })
            .collect();
        for (b, task) in batches.into_iter().enumerate() {
            let what = format!("concurrent batch {b}");
            pairs.extend(check_batch(
                &what,
                task.await.unwrap(),
                1_000,
                &t,
                PARTITIONS,
            ));
        }
        for (i, task) in singles.into_iter().enumerate() {
            let d = task
                .await
                .unwrap()
                .unwrap_or_else(|e| panic!("single send {i}: {e}"));
            pairs.push((d.partition, offset(&d)));
        }
        let total = 5_000 + 4 * 1_000 + 100;
        assert_eq!(pairs.iter().collect::<HashSet<_>>().len(), total);
        assert_contiguous("full queue", &pairs);
        let got = read(&plain, &t, total).await;
        assert_eq!(got.len(), total, "the topic holds exactly the records sent");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_sends_then_a_new_producer() {
    let Some(url) = url("cancelled_sends_then_a_new_producer") else {
        return;
    };
    let _heap = HEAP.read().await;
    guarded("cancelled_sends_then_a_new_producer", async {
        const ROUNDS: usize = 100;
        // Per round 2 × ROOMY + 1 records stay enqueued: under librdkafka's default queue of
        // 100 000 messages in all, so these sends never wait for room.
        const ROOMY: usize = 250;
        const CRAMPED: usize = 1_000;
        let plain = platform(&url);
        let tiny = platform(&with_option(&url, "queue.buffering.max.messages=10"));
        let roomy_topic = topic(&plain, 2).await;
        let tiny_topic = topic(&plain, 1).await;
        let roomy = producer(&plain).await;
        let cramped = producer(&tiny).await;

        let mut finished = 0;
        for round in 0..ROUNDS {
            // Room for the whole batch: enqueued on the first poll, dropped waiting for reports.
            let records = (0..ROOMY)
                .map(|i| keyed(&roomy_topic, i, format!("r{round}-{i}")))
                .collect();
            if let Some(out) = roomy.send_batch(records).now_or_never() {
                check_batch("roomy batch", out, ROOMY, &roomy_topic, 2);
                finished += 1;
            }
            let single = Record::new(roomy_topic.clone(), format!("r{round}-single"));
            if let Some(r) = roomy.send(single).now_or_never() {
                r.unwrap();
                finished += 1;
            }
            // The same, dropped by a zero timeout: at the timer's next tick, wherever the send
            // is by then (a batch already reported finishes instead).
            let records = (0..ROOMY)
                .map(|i| keyed(&roomy_topic, i, format!("z{round}-{i}")))
                .collect();
            if let Ok(out) = tokio::time::timeout(Duration::ZERO, roomy.send_batch(records)).await {
                check_batch("timed-out batch", out, ROOMY, &roomy_topic, 2);
                finished += 1;
            }
            // No room after the first ten records: dropped while waiting for room.
            let records = (0..CRAMPED)
                .map(|i| Record::new(tiny_topic.clone(), format!("q{round}-{i}")))
                .collect();
            assert!(
                cramped.send_batch(records).now_or_never().is_none(),
                "1 000 records cannot all be reported through a queue of 10 in one poll"
            );
            let single = Record::new(tiny_topic.clone(), format!("q{round}-single"));
            if let Some(r) = cramped.send(single).now_or_never() {
                r.unwrap();
                finished += 1;
            }
            tokio::task::yield_now().await;
        }
        let _ = writeln!(
            std::io::stderr(),
            "cancelled_sends_then_a_new_producer: {finished} sends finished within one poll"
        );
        roomy.flush(FLUSH).await.unwrap();
        cramped.flush(FLUSH).await.unwrap();
        drop(roomy);
        drop(cramped);

        // New producers on the same connections send as before.
        let roomy = producer(&plain).await;
        let cramped = producer(&tiny).await;
        let records = (0..1_000)
            .map(|i| keyed(&roomy_topic, i, format!("after-{i}")))
            .collect();
        check_batch(
            "after, roomy",
            roomy.send_batch(records).await,
            1_000,
            &roomy_topic,
            2,
        );
        let records = (0..1_000)
            .map(|i| Record::new(tiny_topic.clone(), format!("after-{i}")))
            .collect();
        check_batch(
            "after, cramped",
            cramped.send_batch(records).await,
            1_000,
            &tiny_topic,
            1,
        );

        // A batch enqueued before its send was dropped is still written, whole.
        let total = ROUNDS * (2 * ROOMY + 1) + 1_000;
        let got = read(&plain, &roomy_topic, total).await;
        assert_eq!(
            got.len(),
            total,
            "every record enqueued by a dropped send, and the new producer's"
        );
        // A send dropped while waiting for room wrote a prefix of its batch at most.
        let got = read(&plain, &tiny_topic, 1_000).await;
        let after = got
            .iter()
            .filter(|m| payload(m).starts_with("after-"))
            .count();
        assert_eq!(after, 1_000, "the new producer's batch, whole");
        assert!(got.len() <= ROUNDS * (CRAMPED + 1) + 1_000);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_dropped_with_records_in_flight() {
    let Some(url) = url("producer_dropped_with_records_in_flight") else {
        return;
    };
    let _heap = HEAP.read().await;
    guarded("producer_dropped_with_records_in_flight", async {
        const RECORDS: usize = 20_000;
        let p = platform(&url);
        let t = topic(&p, 3).await;
        let records = |tag: &str| -> Vec<Record> {
            (0..RECORDS)
                .map(|i| keyed(&t, i, format!("{tag}-{i}")))
                .collect()
        };

        // The spawned send holds the producer's only handle: it goes when the send ends.
        for round in 0..5 {
            let producer = producer(&p).await;
            let batch = records(&format!("owned{round}"));
            let task = tokio::spawn(async move { producer.send_batch(batch).await });
            let out = task.await.unwrap();
            check_batch("send owning the producer", out, RECORDS, &t, 3);
        }

        // The send, and with it the producer, dropped after enqueueing: librdkafka is torn
        // down with the records in flight (purged, or delivered, and reported either way).
        for round in 0..5 {
            let producer = producer(&p).await;
            let batch = records(&format!("dropped{round}"));
            let mut send = Box::pin(async move { producer.send_batch(batch).await });
            assert!(futures::poll!(&mut send).is_pending());
            tokio::task::spawn_blocking(move || drop(send))
                .await
                .unwrap();
        }

        // Aborted mid-flight on the runtime, the producer's last handle inside.
        for round in 0..5 {
            let producer = producer(&p).await;
            let batch = records(&format!("aborted{round}"));
            let task = tokio::spawn(async move { producer.send_batch(batch).await });
            // A chance for the task to enqueue first (the outcome is checked either way).
            tokio::time::sleep(Duration::from_millis(2)).await;
            task.abort();
            match task.await {
                Ok(out) => {
                    check_batch("send finished before abort", out, RECORDS, &t, 3);
                }
                Err(e) => assert!(e.is_cancelled(), "{e}"),
            }
        }

        // A transaction's enqueued batch, awaited after the transaction and the producer are
        // dropped: one result per record (delivered, or an error), never a hang.
        for round in 0..3 {
            let producer = p
                .producer(ProducerConfig {
                    transactional_id: Some(name("kafka-slots-tx")),
                    ..Default::default()
                })
                .await
                .unwrap();
            let mut tx = producer.begin().await.unwrap();
            let pending = tx.enqueue_batch(records(&format!("tx{round}"))).await;
            drop(tx);
            drop(producer);
            let out = pending.await;
            assert_eq!(out.len(), RECORDS);
            let delivered = out.iter().filter(|r| r.is_ok()).count();
            for d in out.iter().flatten() {
                assert!(offset(d) >= 0 && (0..3).contains(&d.partition), "{d:?}");
            }
            let _ = writeln!(
                std::io::stderr(),
                "producer_dropped_with_records_in_flight: transaction {round}: {delivered} of \
                 {RECORDS} delivered before the abort"
            );
        }

        // And a new producer afterwards sends as before.
        let producer = producer(&p).await;
        check_batch(
            "new producer",
            producer.send_batch(records("after")).await,
            RECORDS,
            &t,
            3,
        );
    })
    .await;
}

/// Live heap bytes once the runtime's pending work has run.
async fn live_bytes() -> isize {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    LIVE.load(Ordering::SeqCst)
}

/// Heap growth since `before`, once it is under `limit` or after 30 s of waiting for it to
/// get there (memory released by background work: blocking tasks that hold a native producer,
/// delivery reports still being served). Not a speed assertion: the caller checks the size.
async fn growth_after(before: isize, limit: isize) -> isize {
    let since = tokio::time::Instant::now();
    loop {
        let growth = live_bytes().await - before;
        if growth < limit || since.elapsed() > Duration::from_secs(30) {
            return growth;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_slots_are_freed() {
    let Some(url) = url("report_slots_are_freed") else {
        return;
    };
    let _heap = HEAP.write().await;
    guarded("report_slots_are_freed", async {
        const ROUNDS: usize = 100;
        const RECORDS: usize = 3_000;
        // Anything this size or more is a leak: a `Reports` per batch (its slots alone are
        // over 8 bytes a record) never freed would be ROUNDS × RECORDS × 8 bytes or more.
        const LIMIT: isize = 1 << 20;
        let plain = platform(&url);
        let small = platform(&with_option(&url, "message.max.bytes=2048"));
        let tiny = platform(&with_option(&url, "queue.buffering.max.messages=10"));
        let t = topic(&plain, 1).await;

        // Delivered batches, with too-large and refused records among them.
        let producer = producer(&small).await;
        producer
            .send(Record::new(t.clone(), "warm-up"))
            .await
            .unwrap();
        producer.flush(FLUSH).await.unwrap();
        let before = live_bytes().await;
        for round in 0..ROUNDS / 10 {
            let records = (0..RECORDS)
                .map(|i| match i % 100 {
                    7 => Record::new(t.clone(), vec![b'x'; 4096]),
                    8 => Record::new(t.clone(), "refused").partition(9),
                    _ => Record::new(t.clone(), format!("d{round}-{i}")),
                })
                .collect();
            let out = producer.send_batch(records).await;
            assert_eq!(out.iter().filter(|r| r.is_err()).count(), 2 * RECORDS / 100);
            drop(out);
            producer
                .send(Record::new(t.clone(), format!("d{round}")))
                .await
                .unwrap();
        }
        producer.flush(FLUSH).await.unwrap();
        let delivered_growth = growth_after(before, LIMIT).await;

        // Sends dropped while waiting for room in a full local queue.
        let producer = self::producer(&tiny).await;
        producer
            .send(Record::new(t.clone(), "warm-up"))
            .await
            .unwrap();
        producer.flush(FLUSH).await.unwrap();
        let before = live_bytes().await;
        for round in 0..ROUNDS {
            let records = (0..RECORDS)
                .map(|i| Record::new(t.clone(), format!("c{round}-{i}")))
                .collect();
            assert!(producer.send_batch(records).now_or_never().is_none());
            let single = Record::new(t.clone(), format!("c{round}"));
            let _ = producer.send(single).now_or_never();
        }
        producer.flush(FLUSH).await.unwrap();
        let cancelled_growth = growth_after(before, LIMIT).await;
        let _ = writeln!(
            std::io::stderr(),
            "report_slots_are_freed: heap growth {delivered_growth} bytes after {} delivered \
             batches, {cancelled_growth} bytes after {ROUNDS} batches dropped while enqueueing",
            ROUNDS / 10
        );
        assert!(
            delivered_growth < LIMIT,
            "{delivered_growth} bytes still allocated after {} delivered batches of {RECORDS}",
            ROUNDS / 10
        );
        assert!(
            cancelled_growth < LIMIT,
            "{cancelled_growth} bytes still allocated after {ROUNDS} batches of {RECORDS} \
             dropped while waiting for room in the local queue, every record since reported: \
             their report slots are never freed"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_producer_frees_its_report_slots() {
    let Some(url) = url("dropped_producer_frees_its_report_slots") else {
        return;
    };
    let _heap = HEAP.write().await;
    guarded("dropped_producer_frees_its_report_slots", async {
        const ROUNDS: usize = 10;
        const RECORDS: usize = 20_000;
        // Far less than the slots of the records dropped in flight (ROUNDS × RECORDS × 8
        // bytes or more).
        const LIMIT: isize = 1 << 20;
        // The native producer can outlive the dropped send for a while (the early ProducerID
        // request's blocking task holds it too), hence `growth_after`.
        let p = platform(&url);
        let t = topic(&p, 3).await;
        let warm = producer(&p).await;
        warm.send(Record::new(t.clone(), "warm-up")).await.unwrap();
        drop(warm);
        let before = live_bytes().await;
        for round in 0..ROUNDS {
            let producer = producer(&p).await;
            let batch: Vec<Record> = (0..RECORDS)
                .map(|i| keyed(&t, i, format!("d{round}-{i}")))
                .collect();
            // The send owns the producer's last handle: dropping it after the batch is
            // enqueued tears librdkafka down with the records in flight, and every record's
            // slot must still be given back (reported as purged, or delivered).
            let mut send = Box::pin(async move { producer.send_batch(batch).await });
            assert!(futures::poll!(&mut send).is_pending());
            tokio::task::spawn_blocking(move || drop(send))
                .await
                .unwrap();
        }
        let growth = growth_after(before, LIMIT).await;
        let _ = writeln!(
            std::io::stderr(),
            "dropped_producer_frees_its_report_slots: heap growth {growth} bytes after \
             {ROUNDS} producers dropped with {RECORDS} records in flight"
        );
        assert!(
            growth < LIMIT,
            "{growth} bytes still allocated after {ROUNDS} producers were dropped with \
             {RECORDS} records in flight each"
        );
    })
    .await;
}
