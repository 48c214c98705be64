//! The backend conformance suite: written once against the backend traits, run for every
//! platform adapter through a [`Harness`] and the [`backend_suite!`](crate::backend_suite!)
//! macro, which expands to one test per case, each on its own multi-thread tokio runtime
//! ([`run_on_runtime`]):
//!
//! ```ignore
//! // tests/backend_memory.rs
//! onceflow_conformance::backend_suite!(my_harness());
//! // A harness built asynchronously works too:
//! onceflow_conformance::backend_suite!(KafkaHarness::connect().await);
//! ```
//!
//! The crate using the macro needs `tokio` (features `macros`, `rt-multi-thread`) as a
//! dependency. Every case makes its own topics, groups and transactional ids with random
//! suffixes, so cases never share state, even on a shared broker.
//!
//! A case needing a capability the backend lacks ([`Capabilities`]) is skipped, and the skip is
//! printed with its reason on stderr (uncaptured, so `cargo test` shows it); a harness may
//! [forbid skips](Harness::forbid_skips). Cases assert real outcomes and wait in poll loops up
//! to the harness's deadlines, so they are fast in process and tolerant of broker latency.
//!
//! Cases: `round_trip`, `same_key_same_partition_in_order`, `send_batch_results_in_order`,
//! `enqueue_batch_in_call_order`, `plain_sends_take_one_attempt`, `oversized_record_rejected`,
//! `group_members_share_partitions`,
//! `commit_then_new_member_resumes`, `start_from_earliest`, `start_from_latest`,
//! `start_from_position`, `start_from_timestamp`, `seek`, `pause_resume`, `lag`,
//! `committed_positions`, `nack_redelivers`, `tx_commit_makes_records_visible`,
//! `tx_abort_hides_records`, `tx_commit_offsets_with_the_transaction`,
//! `tx_same_transactional_id_fences_the_old_producer`, `tx_removed_member_cannot_commit_offsets`,
//! `tx_empty_transaction_commits`, `admin_create_describe_delete`, `atomic_batch_all_or_nothing`.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use onceflow_core::{
    now_ms, Capabilities, ConsumerBackend, ConsumerConfig, Error, ErrorKind, Headers, Isolation,
    Message, Position, ProducerBackend, ProducerConfig, RebalanceListener, Record, Result,
    StartFrom, TopicPartition, TopicSpec,
};
use tokio::time::Instant;

use crate::harness::{Harness, Timings};

/// How a case ended when it did not fail (failures panic with what was expected).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every assertion held.
    Passed,
    /// The case does not apply to this backend, for this reason.
    Skipped(String),
}

/// What a case returns; an `Err` fails the case.
pub type CaseResult = Result<Outcome>;

/// Runs one case: skips (printing why) or fails (panicking with the error) as needed.
pub async fn run_case<F>(harness: &dyn Harness, name: &str, case: F)
where
    F: Future<Output = CaseResult>,
{
    let platform = harness.platform().name();
    let skipped = |reason: &str| {
        // Straight to stderr (libtest captures only the print macros), in one write so the line
        // does not interleave with libtest's own output.
        let line = format!("backend_suite: SKIPPED {name} on {platform}: {reason}\n");
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
        assert!(
            !harness.forbid_skips(),
            "case {name} on {platform} was skipped ({reason}), but this harness forbids skips"
        );
    };
    if let Some(reason) = harness.skip_all() {
        skipped(&reason);
        return;
    }
    let limit = harness.timings().case_timeout;
    match tokio::time::timeout(limit, case).await {
        Err(_) => panic!("case {name} on {platform} did not finish within {limit:?}"),
        Ok(Err(e)) => panic!("case {name} on {platform} failed: {e} ({e:?})"),
        Ok(Ok(Outcome::Passed)) => {}
        Ok(Ok(Outcome::Skipped(reason))) => skipped(&reason),
    }
}

/// How long a case's runtime may take to shut down after the case ended: its blocking tasks
/// (a Kafka consumer leaving its group on drop, a file store flushing) must be done by then.
pub const SHUTDOWN_LIMIT: Duration = Duration::from_secs(120);

/// Runs `case` to completion on a fresh multi-thread tokio runtime (two workers, all drivers),
/// then shuts the runtime down waiting at most [`SHUTDOWN_LIMIT`] for its blocking tasks.
///
/// `#[tokio::test]` drops its runtime, which waits for every blocking task without limit: a
/// close that never ends (seen once: rdkafka's consumer drop waiting for its group to be left)
/// then hung the whole test binary past CI's limit. Here it fails the case, naming it.
///
/// # Panics
/// With the case's own panic (resumed after the shutdown), or when the shutdown took the whole
/// [`SHUTDOWN_LIMIT`].
pub fn run_on_runtime(name: &str, case: impl Future<Output = ()>) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime for the case");
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rt.block_on(case)));
    let started = std::time::Instant::now();
    rt.shutdown_timeout(SHUTDOWN_LIMIT);
    if let Err(panic) = ran {
        std::panic::resume_unwind(panic);
    }
    assert!(
        started.elapsed() < SHUTDOWN_LIMIT,
        "case {name}: its runtime still had blocking work running {SHUTDOWN_LIMIT:?} after the \
         case ended (a close or drop that never finished)"
    );
}

/// Expands to one `#[test]` per case of the backend suite, run by [`run_on_runtime`] on a
/// multi-thread runtime with two workers, each evaluating `$harness` (an expression giving a
/// [`Harness`]; it may `.await`) afresh.
#[macro_export]
macro_rules! backend_suite {
    ($harness:expr) => {
        $crate::backend_suite!(@cases ($harness)
            round_trip,
            same_key_same_partition_in_order,
            send_batch_results_in_order,
            enqueue_batch_in_call_order,
            plain_sends_take_one_attempt,
            oversized_record_rejected,
            group_members_share_partitions,
            commit_then_new_member_resumes,
            start_from_earliest,
            start_from_latest,
            start_from_position,
            start_from_timestamp,
            seek,
            pause_resume,
            lag,
            committed_positions,
            nack_redelivers,
            tx_commit_makes_records_visible,
            tx_abort_hides_records,
            tx_commit_offsets_with_the_transaction,
            tx_same_transactional_id_fences_the_old_producer,
            tx_removed_member_cannot_commit_offsets,
            tx_empty_transaction_commits,
            admin_create_describe_delete,
            atomic_batch_all_or_nothing,
        );
    };
    (@cases ($harness:expr) $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                $crate::backend_suite::run_on_runtime(stringify!($case), async {
                    let harness = $harness;
                    $crate::backend_suite::run_case(
                        &harness,
                        stringify!($case),
                        $crate::backend_suite::$case(&harness),
                    )
                    .await;
                });
            }
        )*
    };
}

// ---------------------------------------------------------------------------------------------
// Helpers

fn skip(reason: impl Into<String>) -> CaseResult {
    Ok(Outcome::Skipped(reason.into()))
}

fn caps(h: &dyn Harness) -> Capabilities {
    h.platform().capabilities()
}

fn text(b: &Bytes) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn payloads(msgs: &[Message]) -> Vec<String> {
    msgs.iter().map(|m| text(&m.payload)).collect()
}

fn timeout(what: String) -> Error {
    Error::new(ErrorKind::Timeout, what)
}

async fn producer(h: &dyn Harness) -> Result<Arc<dyn ProducerBackend>> {
    h.platform().producer(ProducerConfig::default()).await
}

async fn tx_producer(h: &dyn Harness, id: &str) -> Result<Arc<dyn ProducerBackend>> {
    h.platform()
        .producer(ProducerConfig {
            transactional_id: Some(id.to_string()),
            ..Default::default()
        })
        .await
}

fn config(group: &str, topic: &str, start: StartFrom) -> ConsumerConfig {
    ConsumerConfig {
        group: group.to_string(),
        topics: vec![topic.to_string()],
        start,
        ..Default::default()
    }
}

/// Sends `payloads` to partition `partition` of `topic`, one by one.
async fn send_all(
    p: &dyn ProducerBackend,
    topic: &str,
    partition: Option<i32>,
    payloads: impl IntoIterator<Item = String>,
) -> Result<()> {
    for v in payloads {
        let mut r = Record::new(topic, v);
        r.partition = partition;
        p.send(r).await?;
    }
    Ok(())
}

fn names(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

/// A consumer with a buffer, so waiting for an assignment never loses messages.
struct Reader {
    c: Arc<dyn ConsumerBackend>,
    buf: Vec<Message>,
    t: Timings,
}

impl Reader {
    async fn new(h: &dyn Harness, config: ConsumerConfig) -> Result<Reader> {
        Ok(Reader {
            c: h.platform().consumer(config).await?,
            buf: Vec::new(),
            t: h.timings(),
        })
    }

    async fn fill(&mut self) -> Result<()> {
        let got = self.c.poll(500, self.t.poll).await?;
        self.buf.extend(got);
        Ok(())
    }

    /// Polls until `n` messages arrived; returns exactly the first `n`.
    async fn take(&mut self, n: usize) -> Result<Vec<Message>> {
        let deadline = Instant::now() + self.t.wait;
        while self.buf.len() < n {
            if Instant::now() >= deadline {
                return Err(timeout(format!(
                    "expected {n} messages within {:?}, got {}: {:?}",
                    self.t.wait,
                    self.buf.len(),
                    payloads(&self.buf)
                )));
            }
            self.fill().await?;
        }
        Ok(self.buf.drain(..n).collect())
    }

    /// Polls for the quiet period and returns everything that arrived (usually nothing).
    async fn quiet(&mut self) -> Result<Vec<Message>> {
        let until = Instant::now() + self.t.quiet;
        while Instant::now() < until {
            self.fill().await?;
        }
        Ok(std::mem::take(&mut self.buf))
    }

    /// Polls until this member is assigned `n` partitions.
    async fn assigned(&mut self, n: usize) -> Result<()> {
        let deadline = Instant::now() + self.t.wait;
        while self.c.assignment().len() < n {
            if Instant::now() >= deadline {
                return Err(timeout(format!(
                    "expected {n} assigned partitions within {:?}, have {:?}",
                    self.t.wait,
                    self.c.assignment()
                )));
            }
            self.fill().await?;
        }
        Ok(())
    }
}

/// A rebalance listener that records what it is told and, on revocation, returns the last
/// finished position of each revoked partition.
#[derive(Default)]
struct Tracking {
    assigned: Mutex<Vec<TopicPartition>>,
    revoked: Mutex<Vec<TopicPartition>>,
    lost: Mutex<Vec<TopicPartition>>,
    finished: Mutex<HashMap<TopicPartition, Position>>,
}

impl Tracking {
    fn finish(&self, m: &Message) {
        self.finished
            .lock()
            .unwrap()
            .insert(m.topic_partition(), m.position.clone());
    }
}

impl RebalanceListener for Tracking {
    fn on_assigned(&self, partitions: &[TopicPartition]) {
        self.assigned.lock().unwrap().extend_from_slice(partitions);
    }

    fn on_revoked(&self, partitions: &[TopicPartition]) -> Vec<(TopicPartition, Position)> {
        self.revoked.lock().unwrap().extend_from_slice(partitions);
        let finished = self.finished.lock().unwrap();
        partitions
            .iter()
            .filter_map(|tp| finished.get(tp).map(|p| (tp.clone(), p.clone())))
            .collect()
    }

    fn on_lost(&self, partitions: &[TopicPartition]) {
        self.lost.lock().unwrap().extend_from_slice(partitions);
    }
}

/// A timestamp in the recent past, so time-based retention never removes test records.
fn base_timestamp() -> i64 {
    now_ms() - 10 * 60 * 1000
}

// ---------------------------------------------------------------------------------------------
// Producing

/// Key, binary payload, binary header values, null vs empty headers, repeated header names in
/// order, and the record's timestamp survive a produce/consume round trip.
pub async fn round_trip(h: &dyn Harness) -> CaseResult {
    let topic = h.topic(1).await?;
    let p = producer(h).await?;
    let mut headers = Headers::new();
    headers
        .insert("bin", Bytes::from_static(&[0, 1, 0x7f, 0x80, 0xff]))
        .insert_null("null")
        .insert("empty", Bytes::new())
        .insert("rep", "1")
        .insert("other", "x")
        .insert("rep", "2")
        .insert("rep", "3");
    let ts = base_timestamp();
    let full = Record {
        topic: topic.clone(),
        key: Some(Bytes::from_static(b"key\x00\xff")),
        payload: Bytes::from_static(b"\x00payload\xff"),
        headers: headers.clone(),
        timestamp: Some(ts),
        ..Default::default()
    };
    let d = p.send(full.clone()).await?;
    assert_eq!(d.topic, topic);
    assert_eq!(d.partition, 0);
    if let Some(dts) = d.timestamp {
        assert_eq!(dts, ts, "delivery timestamp is the record's");
    }
    let bare = Record::new(topic.clone(), Bytes::new());
    let d2 = p.send(bare).await?;

    let mut r = Reader::new(h, config(&h.group(), &topic, StartFrom::Earliest)).await?;
    let got = r.take(2).await?;
    let m = &got[0];
    assert_eq!(m.topic, topic);
    assert_eq!(m.partition, 0);
    assert_eq!(
        m.position, d.position,
        "position matches the delivery report"
    );
    assert_eq!(m.key, full.key, "key");
    assert_eq!(m.payload, full.payload, "payload");
    assert_eq!(
        m.headers, headers,
        "headers: values, null vs empty, repeats in order"
    );
    assert_eq!(
        m.headers.get_all("rep").collect::<Vec<_>>(),
        vec![
            Some(&Bytes::from("1")),
            Some(&Bytes::from("2")),
            Some(&Bytes::from("3"))
        ]
    );
    assert_eq!(m.headers.get("null"), Some(None), "null header stays null");
    assert_eq!(
        m.headers.get("empty"),
        Some(Some(&Bytes::new())),
        "empty header stays empty"
    );
    assert_eq!(m.timestamp, Some(ts), "record timestamp");
    assert!(m.delivery_count >= 1);
    let m2 = &got[1];
    assert_eq!(m2.position, d2.position);
    assert_eq!(m2.key, None, "no key stays no key");
    assert!(m2.payload.is_empty());
    assert!(m2.headers.is_empty());
    assert!(
        m2.timestamp.is_some(),
        "a record without timestamp gets one"
    );
    Ok(Outcome::Passed)
}

/// Records with the same key land on the same partition and keep their order there.
pub async fn same_key_same_partition_in_order(h: &dyn Harness) -> CaseResult {
    let topic = h.topic(4).await?;
    let p = producer(h).await?;
    let mut partition_of: HashMap<String, i32> = HashMap::new();
    for i in 0..5 {
        for k in 0..8 {
            let key = format!("key-{k}");
            let d = p
                .send(Record::new(topic.clone(), format!("{key}/{i}")).key(key.clone()))
                .await?;
            let first = *partition_of.entry(key.clone()).or_insert(d.partition);
            assert_eq!(d.partition, first, "{key} moved partitions");
        }
    }
    let mut r = Reader::new(h, config(&h.group(), &topic, StartFrom::Earliest)).await?;
    let got = r.take(40).await?;
    let mut seen: HashMap<String, Vec<usize>> = HashMap::new();
    for m in &got {
        let key = text(m.key.as_ref().expect("keyed"));
        assert_eq!(
            m.partition, partition_of[&key],
            "{key} read from another partition"
        );
        let v = text(&m.payload);
        let i: usize = v.rsplit('/').next().unwrap().parse().unwrap();
        seen.entry(key).or_default().push(i);
    }
    for (key, order) in seen {
        assert_eq!(order, vec![0, 1, 2, 3, 4], "order of {key}");
    }
    Ok(Outcome::Passed)
}

/// `send_batch` returns one result per record, in input order.
pub async fn send_batch_results_in_order(h: &dyn Harness) -> CaseResult {
    let topic = h.topic(3).await?;
    let p = producer(h).await?;
    let records: Vec<Record> = (0..12)
        .map(|i| Record::new(topic.clone(), format!("b{i}")).partition(i % 3))
        .collect();
    let results = p.send_batch(records).await;
    assert_eq!(results.len(), 12);
    let mut last: HashMap<i32, Position> = HashMap::new();
    for (i, r) in results.into_iter().enumerate() {
        let d = r?;
        assert_eq!(d.topic, topic);
        assert_eq!(d.partition, i as i32 % 3, "result {i} is for record {i}");
        if let Some(prev) = last.insert(d.partition, d.position.clone()) {
            assert!(prev < d.position, "positions grow within a partition");
        }
    }
    let mut r = Reader::new(h, config(&h.group(), &topic, StartFrom::Earliest)).await?;
    let got = r.take(12).await?;
    for part in 0..3 {
        let order: Vec<String> = got
            .iter()
            .filter(|m| m.partition == part)
            .map(|m| text(&m.payload))
            .collect();
        let want: Vec<String> = (0..12)
            .filter(|i| i % 3 == part)
            .map(|i| format!("b{i}"))
            .collect();
        assert_eq!(order, want);
    }
    Ok(Outcome::Passed)
}

/// `enqueue_batch` keeps call order: three batches enqueued one after another, their reports
/// awaited afterwards (the last batch's first), are delivered and read in call order, one
/// result per record.
pub async fn enqueue_batch_in_call_order(h: &dyn Harness) -> CaseResult {
    let topic = h.topic(1).await?;
    let p = producer(h).await?;
    let mut pending = Vec::new();
    for b in 0..3 {
        let records: Vec<Record> = (0..5)
            .map(|i| Record::new(topic.clone(), format!("e{b}-{i}")))
            .collect();
        pending.push(p.enqueue_batch(records).await);
    }
    let mut batches = Vec::new();
    while let Some(reports) = pending.pop() {
        batches.push(reports.await);
    }
    batches.reverse();
    let mut last: Option<Position> = None;
    for (b, results) in batches.into_iter().enumerate() {
        assert_eq!(results.len(), 5, "batch {b}: one result per record");
        for (i, r) in results.into_iter().enumerate() {
            let d = r?;
            assert_eq!(d.topic, topic);
            if let Some(prev) = last.replace(d.position.clone()) {
                assert!(
                    prev < d.position,
                    "batch {b}, record {i}: position {} not after {prev}",
                    d.position
                );
            }
        }
    }
    let mut r = Reader::new(h, config(&h.group(), &topic, StartFrom::Earliest)).await?;
    let got: Vec<String> = r.take(15).await?.iter().map(|m| text(&m.payload)).collect();
    let want: Vec<String> = (0..3)
        .flat_map(|b| (0..5).map(move |i| format!("e{b}-{i}")))
        .collect();
    assert_eq!(got, want, "read in call order");
    Ok(Outcome::Passed)
}

/// A send the platform acknowledges at once reports one attempt, whatever the path: `send`,
/// `send_batch`, `enqueue_batch`, and where the platform has them a transaction's sends and an
/// atomic batch. (Resends are tested per platform where onceflow makes them: JetStream after
/// a lost ack, Kinesis after throttling, in `tests/send_retries.rs`.)
pub async fn plain_sends_take_one_attempt(h: &dyn Harness) -> CaseResult {
    let topic = h.topic(2).await?;
    let p = producer(h).await?;
    let mut deliveries = vec![("send", p.send(Record::new(topic.clone(), "s")).await?)];
    for r in p
        .send_batch(vec![
            Record::new(topic.clone(), "b0").key("k"),
            Record::new(topic.clone(), "b1").partition(1),
        ])
        .await
    {
        deliveries.push(("send_batch", r?));
    }
    for r in p
        .enqueue_batch(vec![Record::new(topic.clone(), "e0")])
        .await
        .await
    {
        deliveries.push(("enqueue_batch", r?));
    }
    if caps(h).transactions {
        let tp = tx_producer(h, &h.transactional_id()).await?;
        let mut tx = tp.begin().await?;
        deliveries.push((
            "transaction send",
            tx.send(Record::new(topic.clone(), "t")).await?,
        ));
        for r in tx.send_batch(vec![Record::new(topic.clone(), "tb")]).await {
            deliveries.push(("transaction send_batch", r?));
        }
        tx.commit().await?;
    }
    if caps(h).atomic_batch {
        let batch = vec![
            Record::new(topic.clone(), "a0").partition(0),
            Record::new(topic.clone(), "a1").partition(0),
        ];
        for d in p.send_atomic(batch).await? {
            deliveries.push(("send_atomic", d));
        }
    }
    for (how, d) in &deliveries {
        assert_eq!(d.attempts, 1, "{how}: {d:?}");
        assert!(!d.duplicate, "{how}: {d:?}");
    }
    Ok(Outcome::Passed)
}

/// A record over the platform's limit is a `Config` error naming its size and the limit; the
/// producer keeps working and nothing of the oversized record is written.
pub async fn oversized_record_rejected(h: &dyn Harness) -> CaseResult {
    let topic = h.topic(1).await?;
    let p = producer(h).await?;
    let max = h.platform().max_record_bytes();
    let e = p
        .send(Record::new(topic.clone(), vec![b'x'; max + 1]))
        .await
        .expect_err("an oversized record must be refused");
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(
        e.message().contains(&(max + 1).to_string()) && e.message().contains(&max.to_string()),
        "the error names the size and the limit: {e}"
    );
    p.send(Record::new(topic.clone(), "small")).await?;
    let mut r = Reader::new(h, config(&h.group(), &topic, StartFrom::Earliest)).await?;
    assert_eq!(payloads(&r.take(1).await?), ["small"]);
    assert!(r.quiet().await?.is_empty());
    Ok(Outcome::Passed)
}

// ---------------------------------------------------------------------------------------------
// Consumer groups

/// Two members share the partitions; the first is told what it gives up and commits what it
/// finished, so every message is consumed by exactly one member.
pub async fn group_members_share_partitions(h: &dyn Harness) -> CaseResult {
    if !caps(h).consumer_groups {
        return skip("no consumer groups (Capabilities::consumer_groups = false)");
    }
    let topic = h.topic(4).await?;
    let group = h.group();
    let p = producer(h).await?;
    for i in 0..20 {
        p.send(Record::new(topic.clone(), format!("a{i}")).partition(i % 4))
            .await?;
    }
    let la = Arc::new(Tracking::default());
    let lb = Arc::new(Tracking::default());
    let mut a = Reader::new(
        h,
        config(&group, &topic, StartFrom::committed_or_earliest()),
    )
    .await?;
    a.c.set_rebalance_listener(la.clone());
    let mut count: HashMap<String, usize> = HashMap::new();
    for m in a.take(20).await? {
        la.finish(&m);
        *count.entry(text(&m.payload)).or_default() += 1;
    }
    assert_eq!(
        a.c.assignment().len(),
        4,
        "a single member owns every partition"
    );

    let mut b = Reader::new(
        h,
        config(&group, &topic, StartFrom::committed_or_earliest()),
    )
    .await?;
    b.c.set_rebalance_listener(lb.clone());
    let deadline = Instant::now() + h.timings().wait;
    loop {
        a.fill().await?;
        b.fill().await?;
        let (sa, sb): (BTreeSet<_>, BTreeSet<_>) = (
            a.c.assignment().into_iter().collect(),
            b.c.assignment().into_iter().collect(),
        );
        if !sa.is_empty() && !sb.is_empty() && sa.is_disjoint(&sb) && sa.len() + sb.len() == 4 {
            break;
        }
        if Instant::now() >= deadline {
            return Err(timeout(format!(
                "members never shared the partitions: a={sa:?} b={sb:?}"
            )));
        }
    }
    assert!(
        !la.revoked.lock().unwrap().is_empty(),
        "the first member was told what it gave up"
    );
    assert!(
        !lb.assigned.lock().unwrap().is_empty(),
        "the second member was told what it got"
    );
    let total = |a: &Reader, b: &Reader| a.buf.len() + b.buf.len();
    assert_eq!(
        total(&a, &b),
        0,
        "nothing is read twice after a rebalance: a={:?} b={:?}",
        payloads(&a.buf),
        payloads(&b.buf)
    );
    for i in 0..20 {
        p.send(Record::new(topic.clone(), format!("b{i}")).partition(i % 4))
            .await?;
    }
    let deadline = Instant::now() + h.timings().wait;
    while total(&a, &b) < 20 && Instant::now() < deadline {
        a.fill().await?;
        b.fill().await?;
    }
    for _ in 0..2 {
        a.fill().await?;
        b.fill().await?;
    }
    assert!(
        !a.buf.is_empty() && !b.buf.is_empty(),
        "both members consume"
    );
    for m in a.buf.iter().chain(&b.buf) {
        *count.entry(text(&m.payload)).or_default() += 1;
    }
    let sa: BTreeSet<i32> = a.buf.iter().map(|m| m.partition).collect();
    let sb: BTreeSet<i32> = b.buf.iter().map(|m| m.partition).collect();
    assert!(sa.is_disjoint(&sb), "a partition is read by one member");
    assert_eq!(count.len(), 40, "every message consumed");
    let twice: Vec<_> = count.iter().filter(|(_, c)| **c != 1).collect();
    assert!(twice.is_empty(), "consumed more than once: {twice:?}");
    Ok(Outcome::Passed)
}

/// After a commit, a new member of the same group resumes right after the committed message.
pub async fn commit_then_new_member_resumes(h: &dyn Harness) -> CaseResult {
    let topic = h.topic(1).await?;
    let group = h.group();
    let p = producer(h).await?;
    send_all(&*p, &topic, None, names("m", 10)).await?;
    let mut first = Reader::new(
        h,
        config(&group, &topic, StartFrom::committed_or_earliest()),
    )
    .await?;
    let got = first.take(10).await?;
    first
        .c
        .commit(&[(got[4].topic_partition(), got[4].position.clone())])
        .await?;
    first.c.close().await?;
    drop(first);
    let mut second = Reader::new(
        h,
        config(&group, &topic, StartFrom::committed_or_earliest()),
    )
    .await?;
    let rest = second.take(5).await?;
    assert_eq!(payloads(&rest), names("m", 10)[5..]);
    assert_eq!(rest[0].position, got[5].position);
    Ok(Outcome::Passed)
}

/// `StartFrom::Earliest` reads from the first record.
pub async fn start_from_earliest(h: &dyn Harness) -> CaseResult {
    let topic = h.topic(1).await?;
    let p = producer(h).await?;
    send_all(&*p, &topic, None, names("m", 3)).await?;
    let mut r = Reader::new(h, config(&h.group(), &topic, StartFrom::Earliest)).await?;
    assert_eq!(payloads(&r.take(3).await?), names("m", 3));
    Ok(Outcome::Passed)
}

/// `StartFrom::Latest` reads only what is written after the consumer was assigned.
pub async fn start_from_latest(h: &dyn Harness) -> CaseResult {
    let topic = h.topic(1).await?;
    let p = producer(h).await?;
    send_all(&*p, &topic, None, names("old", 3)).await?;
    let mut r = Reader::new(h, config(&h.group(), &topic, StartFrom::Latest)).await?;
    r.assigned(1).await?;
    send_all(&*p, &topic, None, names("new", 2)).await?;
    assert_eq!(payloads(&r.take(2).await?), names("new", 2));
    assert!(r.quiet().await?.is_empty());
    Ok(Outcome::Passed)
}

/// `StartFrom::Position` starts at that message (inclusive).
pub async fn start_from_position(h: &dyn Harness) -> CaseResult {
    let topic = h.topic(1).await?;
    let p = producer(h).await?;
    send_all(&*p, &topic, None, names("m", 5)).await?;
    let mut first = Reader::new(h, config(&h.group(), &topic, StartFrom::Earliest)).await?;
    let all = first.take(5).await?;
    let mut r = Reader::new(
        h,
        config(
            &h.group(),
            &topic,
            StartFrom::Position(all[2].position.clone()),
        ),
    )
    .await?;
    let got = r.take(3).await?;
    assert_eq!(payloads(&got), names("m", 5)[2..]);
    assert_eq!(got[0].position, all[2].position);
    Ok(Outcome::Passed)
}

/// `StartFrom::Timestamp` starts at the first record at or after the time; a time after the last
/// record starts at the end (new records only), never at the beginning.
pub async fn start_from_timestamp(h: &dyn Harness) -> CaseResult {
    if !caps(h).seek_by_timestamp {
        return skip("no start by timestamp (Capabilities::seek_by_timestamp = false)");
    }
    let topic = h.topic(1).await?;
    let p = producer(h).await?;
    let base = base_timestamp();
    for i in 0..4 {
        let mut r = Record::new(topic.clone(), format!("m{i}"));
        r.timestamp = Some(base + i * 1000);
        p.send(r).await?;
    }
    let mut r = Reader::new(
        h,
        config(&h.group(), &topic, StartFrom::Timestamp(base + 1500)),
    )
    .await?;
    assert_eq!(payloads(&r.take(2).await?), ["m2", "m3"]);
    let mut exact = Reader::new(
        h,
        config(&h.group(), &topic, StartFrom::Timestamp(base + 1000)),
    )
    .await?;
    assert_eq!(payloads(&exact.take(3).await?), ["m1", "m2", "m3"]);

    let mut late = Reader::new(
        h,
        config(&h.group(), &topic, StartFrom::Timestamp(base + 60_000)),
    )
    .await?;
    late.assigned(1).await?;
    assert!(
        late.quiet().await?.is_empty(),
        "a time after the last record starts at the end"
    );
    p.send(Record::new(topic.clone(), "after")).await?;
    assert_eq!(payloads(&late.take(1).await?), ["after"]);
    Ok(Outcome::Passed)
}

/// `seek` moves an assigned partition to a position, the earliest record or a time.
pub async fn seek(h: &dyn Harness) -> CaseResult {
    let topic = h.topic(1).await?;
    let p = producer(h).await?;
    let base = base_timestamp();
    for i in 0..5 {
        let mut r = Record::new(topic.clone(), format!("m{i}"));
        r.timestamp = Some(base + i * 1000);
        p.send(r).await?;
    }
    let mut r = Reader::new(h, config(&h.group(), &topic, StartFrom::Earliest)).await?;
    let all = r.take(5).await?;
    let tp = all[0].topic_partition();
    r.c.seek(&tp, &StartFrom::Position(all[1].position.clone()))
        .await?;
    assert_eq!(payloads(&r.take(4).await?), names("m", 5)[1..]);
    r.c.seek(&tp, &StartFrom::Earliest).await?;
    assert_eq!(payloads(&r.take(5).await?), names("m", 5));
    if caps(h).seek_by_timestamp {
        r.c.seek(&tp, &StartFrom::Timestamp(base + 3000)).await?;
        assert_eq!(payloads(&r.take(2).await?), ["m3", "m4"]);
    }
    r.c.seek(&tp, &StartFrom::Latest).await?;
    assert!(r.quiet().await?.is_empty());
    Ok(Outcome::Passed)
}

/// A paused partition delivers nothing until it is resumed.
pub async fn pause_resume(h: &dyn Harness) -> CaseResult {
    if !caps(h).pause_resume {
        return skip("no pause/resume (Capabilities::pause_resume = false)");
    }
    let topic = h.topic(1).await?;
    let p = producer(h).await?;
    let mut r = Reader::new(h, config(&h.group(), &topic, StartFrom::Earliest)).await?;
    r.assigned(1).await?;
    let tp = TopicPartition::new(topic.clone(), 0);
    r.c.pause(std::slice::from_ref(&tp)).await?;
    send_all(&*p, &topic, None, names("m", 3)).await?;
    assert!(
        r.quiet().await?.is_empty(),
        "a paused partition delivers nothing"
    );
    r.c.resume(std::slice::from_ref(&tp)).await?;
    assert_eq!(payloads(&r.take(3).await?), names("m", 3));
    Ok(Outcome::Passed)
}

/// Lag is the messages between the committed position and the end of the partition.
pub async fn lag(h: &dyn Harness) -> CaseResult {
    let topic = h.topic(1).await?;
    let p = producer(h).await?;
    send_all(&*p, &topic, None, names("m", 10)).await?;
    let mut r = Reader::new(h, config(&h.group(), &topic, StartFrom::Earliest)).await?;
    let got = r.take(10).await?;
    let tp = got[0].topic_partition();
    r.c.commit(&[(tp.clone(), got[2].position.clone())]).await?;
    let deadline = Instant::now() + h.timings().wait;
    loop {
        let lag = r.c.lag().await?;
        let mine = lag.iter().find(|l| l.partition == tp);
        if let Some(l) = mine {
            if l.messages == 7 {
                assert_eq!(l.committed.as_ref(), Some(&got[3].position));
                break;
            }
        }
        if Instant::now() >= deadline {
            return Err(timeout(format!(
                "lag never reached 10 produced - 3 committed = 7: {lag:?}"
            )));
        }
        r.fill().await?;
    }
    Ok(Outcome::Passed)
}

/// `committed` is `None` before a commit and the next position after it, per partition.
pub async fn committed_positions(h: &dyn Harness) -> CaseResult {
    let topic = h.topic(2).await?;
    let p = producer(h).await?;
    send_all(&*p, &topic, Some(0), names("m", 3)).await?;
    let mut r = Reader::new(h, config(&h.group(), &topic, StartFrom::Earliest)).await?;
    let got = r.take(3).await?;
    let p0 = TopicPartition::new(topic.clone(), 0);
    let p1 = TopicPartition::new(topic.clone(), 1);
    let both = [p0.clone(), p1.clone()];
    let before = r.c.committed(&both).await?;
    assert_eq!(before, vec![(p0.clone(), None), (p1.clone(), None)]);
    r.c.commit(&[(p0.clone(), got[0].position.clone())]).await?;
    let after = r.c.committed(&both).await?;
    assert_eq!(
        after,
        vec![(p0, Some(got[1].position.clone())), (p1, None)],
        "the committed position is the next one to read"
    );
    Ok(Outcome::Passed)
}

/// `nack` delivers the message again (with the rest of its partition where the platform has no
/// per-message redelivery).
pub async fn nack_redelivers(h: &dyn Harness) -> CaseResult {
    let topic = h.topic(1).await?;
    let p = producer(h).await?;
    send_all(&*p, &topic, None, names("m", 5)).await?;
    let mut r = Reader::new(h, config(&h.group(), &topic, StartFrom::Earliest)).await?;
    let got = r.take(5).await?;
    r.c.nack(&got[2], Duration::ZERO).await?;
    if caps(h).per_message_nack {
        let again = r.take(1).await?;
        assert_eq!(payloads(&again), ["m2"]);
        assert_eq!(again[0].position, got[2].position);
    } else {
        let again = r.take(3).await?;
        assert_eq!(
            payloads(&again),
            ["m2", "m3", "m4"],
            "the partition rewinds"
        );
        assert_eq!(again[0].position, got[2].position);
    }
    Ok(Outcome::Passed)
}

// ---------------------------------------------------------------------------------------------
// Transactions

fn no_tx(h: &dyn Harness) -> Option<CaseResult> {
    (!caps(h).transactions).then(|| skip("no transactions (Capabilities::transactions = false)"))
}

/// Records of an open transaction are invisible to read-committed readers until commit.
pub async fn tx_commit_makes_records_visible(h: &dyn Harness) -> CaseResult {
    if let Some(s) = no_tx(h) {
        return s;
    }
    let topic = h.topic(1).await?;
    let mut r = Reader::new(h, config(&h.group(), &topic, StartFrom::Earliest)).await?;
    r.assigned(1).await?;
    let p = tx_producer(h, &h.transactional_id()).await?;
    let mut tx = p.begin().await?;
    for v in names("t", 3) {
        tx.send(Record::new(topic.clone(), v)).await?;
    }
    assert!(
        r.quiet().await?.is_empty(),
        "open transaction's records are invisible"
    );
    tx.commit().await?;
    assert_eq!(payloads(&r.take(3).await?), names("t", 3));
    Ok(Outcome::Passed)
}

/// Aborted records are never seen by read-committed readers (read-uncommitted readers see them
/// where the platform has that isolation level).
pub async fn tx_abort_hides_records(h: &dyn Harness) -> CaseResult {
    if let Some(s) = no_tx(h) {
        return s;
    }
    let topic = h.topic(1).await?;
    let p = tx_producer(h, &h.transactional_id()).await?;
    let mut tx = p.begin().await?;
    for v in names("aborted", 2) {
        tx.send(Record::new(topic.clone(), v)).await?;
    }
    tx.abort().await?;
    let mut tx = p.begin().await?;
    tx.send(Record::new(topic.clone(), "committed")).await?;
    tx.commit().await?;
    let mut rc = Reader::new(h, config(&h.group(), &topic, StartFrom::Earliest)).await?;
    assert_eq!(payloads(&rc.take(1).await?), ["committed"]);
    assert!(rc.quiet().await?.is_empty());
    if h.read_uncommitted() {
        let mut ru = Reader::new(
            h,
            ConsumerConfig {
                isolation: Isolation::ReadUncommitted,
                ..config(&h.group(), &topic, StartFrom::Earliest)
            },
        )
        .await?;
        assert_eq!(
            payloads(&ru.take(3).await?),
            ["aborted0", "aborted1", "committed"]
        );
    }
    Ok(Outcome::Passed)
}

/// Positions added with `commit_offsets` are committed with the transaction, and not at all
/// when it aborts.
pub async fn tx_commit_offsets_with_the_transaction(h: &dyn Harness) -> CaseResult {
    if let Some(s) = no_tx(h) {
        return s;
    }
    let input = h.topic(1).await?;
    let output = h.topic(1).await?;
    let group = h.group();
    let plain = producer(h).await?;
    send_all(&*plain, &input, None, names("in", 5)).await?;
    let mut c = Reader::new(
        h,
        config(&group, &input, StartFrom::committed_or_earliest()),
    )
    .await?;
    let got = c.take(5).await?;
    let tp = got[0].topic_partition();
    let md = c.c.group_metadata().expect("consumer groups have metadata");
    let p = tx_producer(h, &h.transactional_id()).await?;

    let mut tx = p.begin().await?;
    tx.send(Record::new(output.clone(), "nope")).await?;
    tx.commit_offsets(&md, &[(tp.clone(), got[1].position.clone())])
        .await?;
    tx.abort().await?;
    assert_eq!(
        c.c.committed(std::slice::from_ref(&tp)).await?[0].1,
        None,
        "an aborted transaction commits no positions"
    );

    let mut tx = p.begin().await?;
    for m in &got {
        tx.send(Record::new(
            output.clone(),
            format!("out-{}", text(&m.payload)),
        ))
        .await?;
    }
    tx.commit_offsets(&md, &[(tp.clone(), got[4].position.clone())])
        .await?;
    assert_eq!(
        c.c.committed(std::slice::from_ref(&tp)).await?[0].1,
        None,
        "positions wait for the commit"
    );
    tx.commit().await?;
    let deadline = Instant::now() + h.timings().wait;
    loop {
        let now = c.c.committed(std::slice::from_ref(&tp)).await?[0].1.clone();
        if now.is_some() {
            if let Some(next) = got[4].position.next() {
                assert_eq!(now, Some(next), "committed = after the last processed");
            }
            break;
        }
        if Instant::now() >= deadline {
            return Err(timeout("transactional positions never committed".into()));
        }
        tokio::time::sleep(h.timings().poll).await;
    }
    let mut out = Reader::new(h, config(&h.group(), &output, StartFrom::Earliest)).await?;
    let outs = out.take(5).await?;
    assert_eq!(
        payloads(&outs),
        names("in", 5)
            .iter()
            .map(|v| format!("out-{v}"))
            .collect::<Vec<_>>()
    );
    assert!(
        out.quiet().await?.is_empty(),
        "the aborted output stays hidden"
    );
    Ok(Outcome::Passed)
}

/// A new producer with the same transactional id fences the old one: the old one's open
/// transaction cannot commit and never becomes visible; the new one works.
pub async fn tx_same_transactional_id_fences_the_old_producer(h: &dyn Harness) -> CaseResult {
    if let Some(s) = no_tx(h) {
        return s;
    }
    if !h.transactional_id_fencing() {
        return skip("a transactional id fences no older producer here (no producer epochs)");
    }
    let topic = h.topic(1).await?;
    let id = h.transactional_id();
    let old = tx_producer(h, &id).await?;
    let mut tx = old.begin().await?;
    tx.send(Record::new(topic.clone(), "zombie")).await?;
    let new = tx_producer(h, &id).await?;
    let e = match tx.send(Record::new(topic.clone(), "zombie-2")).await {
        Err(e) => e,
        Ok(_) => tx
            .commit()
            .await
            .expect_err("a fenced producer's transaction must not commit"),
    };
    assert_eq!(e.kind(), ErrorKind::Fenced, "{e}");
    let mut tx = new.begin().await?;
    tx.send(Record::new(topic.clone(), "fresh")).await?;
    tx.commit().await?;
    let mut r = Reader::new(h, config(&h.group(), &topic, StartFrom::Earliest)).await?;
    assert_eq!(payloads(&r.take(1).await?), ["fresh"]);
    assert!(
        r.quiet().await?.is_empty(),
        "the zombie's records stay hidden"
    );
    Ok(Outcome::Passed)
}

/// A member removed from its group (session timeout) while its transaction is open cannot
/// commit its positions: the commit is fenced (KIP-447) and nothing of it becomes visible.
pub async fn tx_removed_member_cannot_commit_offsets(h: &dyn Harness) -> CaseResult {
    if let Some(s) = no_tx(h) {
        return s;
    }
    if !caps(h).consumer_groups {
        return skip("no consumer groups (Capabilities::consumer_groups = false)");
    }
    if !h.session_timeout_removal() {
        return skip("a connected member that stops polling keeps its partitions here");
    }
    let input = h.topic(1).await?;
    let output = h.topic(1).await?;
    let group = h.group();
    let plain = producer(h).await?;
    send_all(&*plain, &input, None, names("in", 2)).await?;
    let mut zombie = Reader::new(
        h,
        ConsumerConfig {
            session_timeout: Some(h.timings().session_timeout),
            ..config(&group, &input, StartFrom::committed_or_earliest())
        },
    )
    .await?;
    let got = zombie.take(2).await?;
    let tp = got[0].topic_partition();
    let md = zombie.c.group_metadata().expect("group metadata");
    let p = tx_producer(h, &h.transactional_id()).await?;
    let mut tx = p.begin().await?;
    tx.send(Record::new(output.clone(), "zombie-output"))
        .await?;
    tx.commit_offsets(&md, &[(tp.clone(), got[1].position.clone())])
        .await?;

    // The zombie stops polling; another member takes over once its session expires.
    let mut heir = Reader::new(
        h,
        config(&group, &input, StartFrom::committed_or_earliest()),
    )
    .await?;
    let deadline = Instant::now() + h.timings().wait + h.timings().session_timeout;
    while !heir.c.assignment().contains(&tp) {
        if Instant::now() >= deadline {
            return Err(timeout(format!(
                "{tp} never moved to the new member after the session timeout"
            )));
        }
        heir.fill().await?;
    }
    let e = tx
        .commit()
        .await
        .expect_err("a removed member's transaction must not commit its positions");
    assert_eq!(e.kind(), ErrorKind::Fenced, "{e}");
    assert_eq!(
        heir.c.committed(std::slice::from_ref(&tp)).await?[0].1,
        None,
        "the zombie's positions were not committed"
    );
    let redelivered = heir.take(2).await?;
    assert_eq!(payloads(&redelivered), names("in", 2), "the heir re-reads");
    let mut out = Reader::new(h, config(&h.group(), &output, StartFrom::Earliest)).await?;
    assert!(
        out.quiet().await?.is_empty(),
        "the zombie's output stays hidden"
    );
    Ok(Outcome::Passed)
}

/// An empty transaction commits (and aborts) fine; `begin` without a transactional id is a
/// `Config` error.
pub async fn tx_empty_transaction_commits(h: &dyn Harness) -> CaseResult {
    if let Some(s) = no_tx(h) {
        return s;
    }
    let p = tx_producer(h, &h.transactional_id()).await?;
    p.begin().await?.commit().await?;
    p.begin().await?.abort().await?;
    p.begin().await?.commit().await?;
    let plain = producer(h).await?;
    let e = plain
        .begin()
        .await
        .err()
        .expect("begin needs a transactional id");
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    Ok(Outcome::Passed)
}

// ---------------------------------------------------------------------------------------------
// Admin and atomic batches

/// Create (idempotent with the same settings, `Config` with others), describe, delete;
/// `NotFound` naming the topic.
pub async fn admin_create_describe_delete(h: &dyn Harness) -> CaseResult {
    let admin = h.platform().admin().await?;
    let name = h.unique_name("suite-admin");
    let spec = TopicSpec::new(name.clone(), 3);
    admin.create_topic(&spec).await?;
    let deadline = Instant::now() + h.timings().wait;
    let d = loop {
        match admin.describe_topic(&name).await {
            Ok(d) => break d,
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(h.timings().poll).await,
        }
    };
    assert_eq!(d.name, name);
    assert_eq!(d.partitions, 3);
    assert_eq!(d.watermarks.len(), 3);
    assert!(!d.compacted);
    admin.create_topic(&spec).await?;
    let e = admin
        .create_topic(&TopicSpec::new(name.clone(), 5))
        .await
        .expect_err("same name, other settings");
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.message().contains(&name), "names the topic: {e}");

    let missing = h.unique_name("suite-missing");
    let e = admin.describe_topic(&missing).await.expect_err("missing");
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert!(e.message().contains(&missing), "names the topic: {e}");
    let e = admin.delete_topic(&missing).await.expect_err("missing");
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");

    admin.delete_topic(&name).await?;
    let deadline = Instant::now() + h.timings().wait;
    loop {
        match admin.describe_topic(&name).await {
            Err(e) if e.kind() == ErrorKind::NotFound => break,
            _ if Instant::now() >= deadline => {
                return Err(timeout(format!(
                    "topic '{name}' still described after delete"
                )))
            }
            _ => tokio::time::sleep(h.timings().poll).await,
        }
    }
    Ok(Outcome::Passed)
}

/// `send_atomic` writes every record (deliveries in input order) or none.
pub async fn atomic_batch_all_or_nothing(h: &dyn Harness) -> CaseResult {
    if !caps(h).atomic_batch {
        return skip("no atomic batch publish (Capabilities::atomic_batch = false)");
    }
    let topic = h.topic(2).await?;
    let p = producer(h).await?;
    let batch = vec![
        Record::new(topic.clone(), "a0").partition(0),
        Record::new(topic.clone(), "a1").partition(1),
        Record::new(topic.clone(), "a2").partition(0),
    ];
    let ds = p.send_atomic(batch).await?;
    assert_eq!(
        ds.iter().map(|d| d.partition).collect::<Vec<_>>(),
        [0, 1, 0]
    );
    assert!(ds[0].position < ds[2].position);
    let max = h.platform().max_record_bytes();
    let bad = vec![
        Record::new(topic.clone(), "b0").partition(0),
        Record::new(topic.clone(), vec![b'x'; max + 1]).partition(1),
    ];
    let e = p.send_atomic(bad).await.expect_err("one record is too big");
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    let mut r = Reader::new(h, config(&h.group(), &topic, StartFrom::Earliest)).await?;
    let mut got = payloads(&r.take(3).await?);
    got.sort();
    assert_eq!(got, ["a0", "a1", "a2"]);
    assert!(r.quiet().await?.is_empty(), "nothing of the failed batch");
    Ok(Outcome::Passed)
}
