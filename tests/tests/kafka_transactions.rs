//! Kafka transactions seen from both ends, on a real broker (`tests/brokers/up.sh kafka`):
//!
//! - **Transactional input**: every transaction leaves a marker one offset after its records,
//!   and aborted transactions leave records a `read_committed` consumer never gets. Every
//!   commit path (plain commit, the idempotent engine, the exactly-once pipeline, the CLI's
//!   `consume`) must commit past them, or the committed offset stays short of the end and lag
//!   shows 1 or more for ever (KAFKA-6607).
//! - **A commit of unknown outcome**: an EndTxn held back by the fault proxy just past the
//!   commit timeout lands after the client gave up. The pipeline must settle the transaction
//!   (a new producer epoch) before it reads committed positions and redoes work, or the batch
//!   is in the output twice.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use onceflow_conformance::fault_proxy::{kafka_api_key, Action, Direction, FaultProxy};
use onceflow_conformance::harness::{broker_url, random_suffix};
use onceflow_core::{
    BoxError, Client, Consumer, ConsumerConfig, EngineConfig, Handler, IdempotentConsumer,
    Isolation, Message, PartitionLag, Pipeline, PipelineConfig, Position, ProducerConfig, Record,
    StartFrom, TopicSpec, Transform,
};

const HANG_GUARD: Duration = Duration::from_secs(300);

/// One test at a time listens on the fault proxy's port (the broker advertises it).
static FAULT_PORT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The fault proxy on the broker's FAULT listener (hold [`FAULT_PORT`]), and the URL that
/// reaches the broker through it.
async fn fault_proxy() -> (FaultProxy, String) {
    let fault_url = std::env::var("ONCEFLOW_KAFKA_FAULT_URL")
        .expect("ONCEFLOW_KAFKA_FAULT_URL (tests/brokers/up.sh kafka prints it)");
    let upstream = std::env::var("ONCEFLOW_KAFKA_FAULT_UPSTREAM")
        .expect("ONCEFLOW_KAFKA_FAULT_UPSTREAM (tests/brokers/up.sh kafka prints it)");
    let listen = fault_url.trim_start_matches("kafka://");
    let proxy = FaultProxy::start(listen, &upstream).await.unwrap();
    (proxy, fault_url)
}

fn url(test: &str) -> Option<String> {
    match broker_url("ONCEFLOW_KAFKA_URL", "kafka") {
        Ok(u) => Some(u),
        Err(reason) => {
            eprintln!("SKIPPED {test}: {reason}");
            None
        }
    }
}

fn client(url: &str) -> Client {
    Client::new(onceflow_kafka::connect(url).expect("Kafka URL"))
}

fn name(prefix: &str) -> String {
    format!("{prefix}-{}", random_suffix())
}

async fn topic(c: &Client, partitions: u32) -> String {
    let t = name("kafka-txn");
    c.admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(t.clone(), partitions))
        .await
        .unwrap();
    t
}

/// Writes transactions to partition 0 of `topic`: (records, commit?) each, payloads numbered
/// from `first`. Returns the payloads of the committed ones.
async fn write_transactions(
    c: &Client,
    topic: &str,
    first: usize,
    txns: &[(usize, bool)],
) -> Vec<String> {
    let p = c
        .producer(ProducerConfig {
            transactional_id: Some(name("kafka-txn-writer")),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut committed = Vec::new();
    let mut n = first;
    for &(records, commit) in txns {
        let mut tx = p.begin().await.unwrap();
        let mut these = Vec::new();
        for _ in 0..records {
            let payload = format!("in-{n}");
            n += 1;
            tx.send(
                Record::new(topic.to_string(), payload.clone())
                    .key(format!("k{n}"))
                    .partition(0),
            )
            .await
            .unwrap();
            these.push(payload);
        }
        if commit {
            tx.commit().await.unwrap();
            committed.extend(these);
        } else {
            tx.abort().await.unwrap();
        }
    }
    p.close().await.unwrap();
    committed
}

/// One committed, one aborted, one committed, one aborted transaction: the partition ends with
/// aborted records and a marker after the last record a reader gets.
const MIXED: &[(usize, bool)] = &[(5, true), (3, false), (4, true), (2, false)];

/// The group's lag on `topic`, each partition checked at 0 within `within` (commits are
/// asynchronous to the caller in the engine and the pipeline).
async fn assert_lag_zero(c: &Client, group: &str, topic: &str, within: Duration, what: &str) {
    let admin = c.admin().await.unwrap();
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let lag: Vec<PartitionLag> = admin.group_lag(group, topic).await.unwrap();
        if lag
            .iter()
            .all(|l| l.messages == 0 && l.committed == l.high_watermark)
        {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("{what}: lag never reached 0: {lag:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn consumer(c: &Client, group: &str, topic: &str) -> Consumer {
    consumer_with(c, group, topic, BTreeMap::new()).await
}

/// [`consumer`] with client `options` (librdkafka properties).
async fn consumer_with(
    c: &Client,
    group: &str,
    topic: &str,
    options: BTreeMap<String, String>,
) -> Consumer {
    c.consumer(ConsumerConfig {
        group: group.to_string(),
        topics: vec![topic.to_string()],
        isolation: Isolation::ReadCommitted,
        start: StartFrom::committed_or_earliest(),
        options,
        ..Default::default()
    })
    .await
    .unwrap()
}

/// Writes `in-0` .. `in-{inputs - 1}` to `topic`, input `i` to partition `i % partitions`,
/// through a plain producer with client `options`.
async fn write_inputs(
    c: &Client,
    topic: &str,
    inputs: usize,
    partitions: usize,
    options: BTreeMap<String, String>,
) {
    let plain = c
        .producer(ProducerConfig {
            options,
            ..Default::default()
        })
        .await
        .unwrap();
    let records = (0..inputs)
        .map(|i| {
            Record::new(topic.to_string(), format!("in-{i}")).partition((i % partitions) as i32)
        })
        .collect();
    for r in plain.send_batch(records).await {
        r.unwrap();
    }
    plain.close().await.unwrap();
}

/// The outputs `IN-0` .. `IN-{inputs - 1}` missing from `got`.
fn missing_outputs(got: &BTreeMap<String, usize>, inputs: usize) -> Vec<String> {
    (0..inputs)
        .map(|i| format!("IN-{i}"))
        .filter(|w| !got.contains_key(w))
        .collect()
}

/// Polls until `n` messages are in and one more poll came back empty.
async fn poll_all(c: &Consumer, n: usize) -> Vec<Message> {
    let mut out = Vec::new();
    loop {
        let got = c.poll(1000, Duration::from_millis(500)).await.unwrap();
        if got.is_empty() && out.len() >= n {
            return out;
        }
        out.extend(got);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_commit_after_transactional_input_leaves_no_lag() {
    let Some(url) = url("a_plain_commit_after_transactional_input_leaves_no_lag") else {
        return;
    };
    tokio::time::timeout(HANG_GUARD, async {
        let c = client(&url);
        let t = topic(&c, 1).await;
        let want = write_transactions(&c, &t, 0, MIXED).await;
        let group = name("kafka-txn-plain");
        let con = consumer(&c, &group, &t).await;
        let got = poll_all(&con, want.len()).await;
        let payloads: Vec<String> = got
            .iter()
            .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
            .collect();
        assert_eq!(
            payloads, want,
            "read_committed delivers the committed records"
        );
        con.commit_message(got.last().unwrap()).await.unwrap();
        assert_lag_zero(
            &c,
            &group,
            &t,
            Duration::ZERO,
            "plain commit of the last record",
        )
        .await;

        // More input that is only an aborted transaction: nothing is delivered, and the commit
        // of what was skipped moves the group past it.
        write_transactions(&c, &t, 100, &[(3, false)]).await;
        let admin = c.admin().await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let got = con.poll(1000, Duration::from_millis(300)).await.unwrap();
            assert!(got.is_empty(), "aborted records delivered: {got:?}");
            con.commit_skipped().await.unwrap();
            let lag = admin.group_lag(&group, &t).await.unwrap();
            if lag[0].messages == 0 {
                assert_eq!(lag[0].committed, lag[0].high_watermark, "{lag:?}");
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "commit past an aborted transaction: lag stays {lag:?}"
            );
        }

        // A commit of a record before the last delivered one commits exactly after it.
        write_transactions(&c, &t, 200, &[(3, true)]).await;
        let got = poll_all(&con, 3).await;
        con.commit_message(&got[0]).await.unwrap();
        let lag = c
            .admin()
            .await
            .unwrap()
            .group_lag(&group, &t)
            .await
            .unwrap();
        let next = got[0].position.as_offset().unwrap() + 1;
        assert_eq!(lag[0].committed, Some(Position::Offset(next)), "{lag:?}");
        con.close().await.unwrap();
    })
    .await
    .expect("hung");
}

struct Count(Arc<AtomicU64>);

#[async_trait]
impl Handler for Count {
    async fn handle(&self, _m: &Message) -> Result<Option<Bytes>, BoxError> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Ok(None)
    }
}

fn fast_engine() -> EngineConfig {
    EngineConfig {
        commit_interval: Duration::from_millis(200),
        ..Default::default()
    }
}

/// Runs `f` until `done` says so (checked every 100 ms), then 1 s more for a commit interval.
async fn run_until_done<F: std::future::Future>(
    f: impl FnOnce(tokio::sync::oneshot::Receiver<()>) -> F,
    done: impl Fn() -> bool,
) -> F::Output {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let fut = f(rx);
    let watch = async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let _ = tx.send(());
    };
    let (out, ()) = tokio::join!(fut, watch);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_idempotent_engine_commits_past_markers_and_aborted_records() {
    let Some(url) = url("the_idempotent_engine_commits_past_markers_and_aborted_records") else {
        return;
    };
    tokio::time::timeout(HANG_GUARD, async {
        let c = client(&url);
        let t = topic(&c, 1).await;
        let want = write_transactions(&c, &t, 0, MIXED).await;
        let group = name("kafka-txn-engine");
        let handled = Arc::new(AtomicU64::new(0));
        for (round, expect) in [(0, want.len() as u64), (1, want.len() as u64)] {
            if round == 1 {
                // Only an aborted transaction since the last commit: nothing is delivered.
                write_transactions(&c, &t, 100, &[(3, false)]).await;
            }
            let con = consumer(&c, &group, &t).await;
            let engine = IdempotentConsumer::with_config(
                con,
                None,
                Arc::new(Count(handled.clone())),
                fast_engine(),
                None,
            )
            .unwrap();
            let h = handled.clone();
            let started = tokio::time::Instant::now();
            run_until_done(
                |stop| {
                    engine.run_until(async move {
                        let _ = stop.await;
                    })
                },
                move || {
                    h.load(Ordering::Relaxed) >= expect
                        && started.elapsed() > Duration::from_secs(3)
                },
            )
            .await
            .unwrap();
            assert_eq!(handled.load(Ordering::Relaxed), expect, "round {round}");
            assert_lag_zero(
                &c,
                &group,
                &t,
                Duration::ZERO,
                &format!("engine round {round}"),
            )
            .await;
        }
    })
    .await
    .expect("hung");
}

struct Upper(String);

#[async_trait]
impl Transform for Upper {
    async fn transform(&self, m: &Message) -> Result<Vec<Record>, BoxError> {
        Ok(vec![Record::new(
            self.0.clone(),
            m.payload.to_ascii_uppercase(),
        )])
    }
}

async fn pipeline(c: &Client, group: &str, input: &str, output: &str, tx_id: &str) -> Pipeline {
    let con = consumer(c, group, input).await;
    let producer = c
        .producer(ProducerConfig {
            transactional_id: Some(tx_id.to_string()),
            ..Default::default()
        })
        .await
        .unwrap();
    let config = PipelineConfig {
        engine: fast_engine(),
        max_transaction_inputs: 50,
        transaction_interval: Duration::from_millis(200),
        ..Default::default()
    };
    Pipeline::with_config(
        con,
        producer,
        None,
        Arc::new(Upper(output.to_string())),
        config,
    )
    .unwrap()
}

/// Reads `topic` from the start (read_committed) until `n` payloads are in and 3 s pass with
/// nothing new (a duplicate would show).
async fn read_output(c: &Client, topic: &str, n: usize) -> BTreeMap<String, usize> {
    let con = consumer(c, &name("kafka-txn-reader"), topic).await;
    let mut counts = BTreeMap::new();
    let mut total = 0;
    let mut idle = tokio::time::Instant::now();
    while (total < n && idle.elapsed() < Duration::from_secs(30))
        || idle.elapsed() < Duration::from_secs(3)
    {
        let got = con.poll(1000, Duration::from_millis(250)).await.unwrap();
        if !got.is_empty() {
            idle = tokio::time::Instant::now();
        }
        for m in got {
            total += 1;
            *counts
                .entry(String::from_utf8_lossy(&m.payload).into_owned())
                .or_default() += 1;
        }
    }
    con.close().await.unwrap();
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exactly_once_pipeline_commits_past_markers_and_aborted_records() {
    let Some(url) = url("the_exactly_once_pipeline_commits_past_markers_and_aborted_records")
    else {
        return;
    };
    tokio::time::timeout(HANG_GUARD, async {
        let c = client(&url);
        let input = topic(&c, 1).await;
        let output = topic(&c, 1).await;
        let mut want = write_transactions(&c, &input, 0, MIXED).await;
        let group = name("kafka-txn-pipeline");
        let tx_id = name("kafka-txn-pipeline-tx");
        for round in 0..2 {
            if round == 1 {
                write_transactions(&c, &input, 100, &[(3, false)]).await;
            }
            let p = pipeline(&c, &group, &input, &output, &tx_id).await;
            let m = p.metrics();
            // Round 0 consumes every committed input; round 1 has only aborted records.
            let n = if round == 0 { want.len() as u64 } else { 0 };
            let started = tokio::time::Instant::now();
            run_until_done(
                |stop| {
                    p.run_until(async move {
                        let _ = stop.await;
                    })
                },
                move || m.snapshot().consumed >= n && started.elapsed() > Duration::from_secs(3),
            )
            .await
            .unwrap();
            assert_lag_zero(
                &c,
                &group,
                &input,
                Duration::ZERO,
                &format!("pipeline round {round}"),
            )
            .await;
        }
        let got = read_output(&c, &output, want.len()).await;
        want.sort();
        let expected: BTreeMap<String, usize> =
            want.iter().map(|w| (w.to_ascii_uppercase(), 1)).collect();
        assert_eq!(got, expected, "every committed input once in the output");
    })
    .await
    .expect("hung");
}

struct FailOnce {
    output: String,
    failed: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Inputs transformed without failing (at least once).
    succeeded: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
}

#[async_trait]
impl Transform for FailOnce {
    async fn transform(&self, m: &Message) -> Result<Vec<Record>, BoxError> {
        let payload = String::from_utf8_lossy(&m.payload).into_owned();
        if payload.ends_with('7') && self.failed.lock().unwrap().insert(payload.clone()) {
            return Err(format!("{payload}: failing once").into());
        }
        self.succeeded.lock().unwrap().insert(payload);
        Ok(vec![Record::new(
            self.output.clone(),
            m.payload.to_ascii_uppercase(),
        )])
    }
}

/// A transform that fails mid-batch aborts the transaction; every partition of the batch is
/// read again from its committed position, also those whose inputs the batch had not reached
/// (before, they were committed past with the next transaction: 67 of 100 inputs lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transform_failure_mid_batch_reads_every_partition_of_the_batch_again() {
    failing_transforms_lose_nothing(
        "a_transform_failure_mid_batch_reads_every_partition_of_the_batch_again",
        100,
        EngineConfig::default().batch_size,
        Duration::from_secs(60),
    )
    .await;
}

/// The same with batches of 5 inputs, so that the batch polled ahead while one is processed
/// holds other partitions' inputs when a transform fails: the rewind reads those again too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transform_failure_reads_the_batch_polled_ahead_again() {
    failing_transforms_lose_nothing(
        "a_transform_failure_reads_the_batch_polled_ahead_again",
        300,
        5,
        Duration::from_secs(90),
    )
    .await;
}

/// `inputs` on 3 partitions through a pipeline whose transform fails once on every input
/// ending in 7 (no retry), run until every input was transformed once without failing (at most
/// `run_for`; a lost input is never transformed and fails the test then): each is in the output
/// once, and the group's lag ends at 0. The run stops on progress, not after a fixed time, so
/// a loaded machine (the CI's brokers and clusters on 2 cores) only makes it slower.
async fn failing_transforms_lose_nothing(
    test: &str,
    inputs: usize,
    batch_size: usize,
    run_for: Duration,
) {
    let Some(url) = url(test) else {
        return;
    };
    tokio::time::timeout(HANG_GUARD, async {
        let c = client(&url);
        let input = topic(&c, 3).await;
        let output = topic(&c, 1).await;
        write_inputs(&c, &input, inputs, 3, BTreeMap::new()).await;
        let group = name("kafka-txn-failing");
        let con = consumer(&c, &group, &input).await;
        let producer = c
            .producer(ProducerConfig {
                transactional_id: Some(name("kafka-txn-failing-tx")),
                ..Default::default()
            })
            .await
            .unwrap();
        let config = PipelineConfig {
            engine: EngineConfig {
                max_attempts: 1,
                batch_size,
                redelivery_delay: Duration::from_millis(50),
                ..fast_engine()
            },
            transaction_interval: Duration::from_millis(200),
            ..Default::default()
        };
        let succeeded = Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
        let transform = FailOnce {
            output: output.clone(),
            failed: Default::default(),
            succeeded: succeeded.clone(),
        };
        let p = Pipeline::with_config(con, producer, None, Arc::new(transform), config).unwrap();
        let started = tokio::time::Instant::now();
        run_until_done(
            |stop| {
                p.run_until(async move {
                    let _ = stop.await;
                })
            },
            || succeeded.lock().unwrap().len() >= inputs || started.elapsed() > run_for,
        )
        .await
        .unwrap();
        let got = read_output(&c, &output, inputs).await;
        let missing = missing_outputs(&got, inputs);
        assert!(missing.is_empty(), "inputs never transformed: {missing:?}");
        assert!(got.values().all(|n| *n == 1), "an output twice: {got:?}");
        assert_lag_zero(
            &c,
            &group,
            &input,
            Duration::from_secs(5),
            "failing transform",
        )
        .await;
    })
    .await
    .expect("hung");
}

/// [`Upper`] taking `delay` per input, and stalling once for `stall` on the first input after
/// `stall_next` is set, so that a transaction stays open across a rebalance.
struct StallingUpper {
    output: String,
    delay: Duration,
    stall_next: Arc<std::sync::atomic::AtomicBool>,
    stall: Duration,
}

#[async_trait]
impl Transform for StallingUpper {
    async fn transform(&self, m: &Message) -> Result<Vec<Record>, BoxError> {
        if self.stall_next.swap(false, Ordering::SeqCst) {
            tokio::time::sleep(self.stall).await;
        }
        tokio::time::sleep(self.delay).await;
        Ok(vec![Record::new(
            self.output.clone(),
            m.payload.to_ascii_uppercase(),
        )])
    }
}

/// A second pipeline joins the group while the first holds an open transaction with inputs
/// of every partition (no dedup store: only the transaction keeps outputs once). Once the
/// first member's poll gives up partitions (KIP-429: two of its four), the test stalls its
/// transform for 6 s, so that the new owner reads the moved partitions from the group's
/// committed offsets before the transaction commits. The first member must abort instead of
/// sending the moved partitions' offsets with the group's new generation, which the broker
/// accepts (KIP-447 fences only an old generation). Every input is in the output once, and
/// the lag ends at 0. (With a poll running ahead of the loop, 20ca525 / f0a63e6, and no
/// revocation check at the commit: the moved partitions' open inputs twice, 232 of 4000.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_joining_while_a_transaction_is_open_writes_no_output_twice() {
    let Some(url) = url("a_member_joining_while_a_transaction_is_open_writes_no_output_twice")
    else {
        return;
    };
    tokio::time::timeout(HANG_GUARD, async {
        let c = client(&url);
        let input = topic(&c, 4).await;
        let output = topic(&c, 1).await;
        let inputs = 4000usize;
        // Small record batches and fetches of one batch per partition: every poll holds
        // inputs of all four partitions.
        let batch_size = [("batch.size".to_string(), "2048".to_string())].into();
        write_inputs(&c, &input, inputs, 4, batch_size).await;
        let group = name("kafka-txn-joining");
        let member = |tx_id: String, stall_next: Arc<std::sync::atomic::AtomicBool>| {
            let (c, group, input, output) =
                (c.clone(), group.clone(), input.clone(), output.clone());
            async move {
                let fetch = [("max.partition.fetch.bytes".to_string(), "1".to_string())].into();
                let con = consumer_with(&c, &group, &input, fetch).await;
                let producer = c
                    .producer(ProducerConfig {
                        transactional_id: Some(tx_id),
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                let config = PipelineConfig {
                    engine: EngineConfig {
                        batch_size: 100,
                        ..fast_engine()
                    },
                    max_transaction_inputs: 1_000_000,
                    transaction_interval: Duration::from_millis(500),
                    ..Default::default()
                };
                let transform = StallingUpper {
                    output,
                    delay: Duration::from_millis(1),
                    stall_next,
                    stall: Duration::from_secs(6),
                };
                let p =
                    Pipeline::with_config(con.clone(), producer, None, Arc::new(transform), config)
                        .unwrap();
                (p, con)
            }
        };
        let stall_a = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (a, a_consumer) = member(name("kafka-txn-joining-a"), stall_a.clone()).await;
        let a_metrics = a.metrics();
        let (stop_a, stopped_a) = tokio::sync::oneshot::channel::<()>();
        let (stop_b, stopped_b) = tokio::sync::oneshot::channel::<()>();
        let a_run = tokio::spawn(a.run_until(async move {
            let _ = stopped_a.await;
        }));
        while a_metrics.snapshot().processed < 200 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let (b, _) = member(name("kafka-txn-joining-b"), Default::default()).await;
        let b_metrics = b.metrics();
        let b_run = tokio::spawn(b.run_until(async move {
            let _ = stopped_b.await;
        }));
        // The moment the first member's poll gives up partitions, its next input stalls.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while a_consumer.assignment().len() == 4 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no partition ever moved"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        stall_a.store(true, Ordering::SeqCst);
        // Until both members made progress after the rebalance and the group's lag is 0.
        let admin = c.admin().await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let lag = admin.group_lag(&group, &input).await.unwrap();
            if b_metrics.snapshot().processed > 0
                && lag.len() == 4
                && lag
                    .iter()
                    .all(|l| l.messages == 0 && l.committed == l.high_watermark)
            {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "lag never reached 0: {lag:?}"
            );
        }
        let _ = stop_a.send(());
        let _ = stop_b.send(());
        a_run.await.unwrap().unwrap();
        b_run.await.unwrap().unwrap();
        let got = read_output(&c, &output, inputs).await;
        let missing = missing_outputs(&got, inputs);
        assert!(missing.is_empty(), "inputs never transformed: {missing:?}");
        let twice: Vec<(&String, &usize)> = got.iter().filter(|(_, n)| **n > 1).collect();
        assert!(
            twice.is_empty(),
            "{} outputs more than once (of {inputs}; first member {:?}, second {:?}): {:?}",
            twice.len(),
            a_metrics.snapshot(),
            b_metrics.snapshot(),
            &twice[..twice.len().min(20)]
        );
    })
    .await
    .expect("hung");
}

/// The first EndTxn of a pipeline, held by the fault proxy for the commit timeout plus 50 ms
/// to 1.2 s, then delivered: whether the coordinator gets it before the producer's new epoch
/// or after, every input is in the output once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_commit_outcome_is_settled_before_work_is_redone() {
    let Some(url) = url("an_unknown_commit_outcome_is_settled_before_work_is_redone") else {
        return;
    };
    let _turn = FAULT_PORT.lock().await;
    tokio::time::timeout(HANG_GUARD * 2, async {
        let (proxy, fault_url) = fault_proxy().await;
        let timeout_ms = 2000u64;
        let c = client(&url);
        // The pipeline's producer (and consumer) behind the proxy, with a short bound on
        // blocking calls: commit_transaction gives up after it.
        let behind = client(&format!("{fault_url}?onceflow.timeout.ms={timeout_ms}"));
        let inputs = 120usize;
        let rounds = [50u64, 150, 300, 600, 1200];
        let mut tally = onceflow_conformance::faults::Tally::default();
        for extra_ms in rounds {
            let input = topic(&c, 1).await;
            let output = topic(&c, 1).await;
            let plain = c.producer(ProducerConfig::default()).await.unwrap();
            for i in 0..inputs {
                plain
                    .send(Record::new(input.clone(), format!("in-{i}")).key(format!("k{i}")))
                    .await
                    .unwrap();
            }
            plain.close().await.unwrap();
            // The first EndTxn (a commit: the pipeline never aborts unprompted) is held just
            // past the commit timeout, then delivered.
            proxy.clear();
            let fired = proxy.fired();
            proxy.once(
                Direction::ToBroker,
                |f| kafka_api_key(f) == Some(26),
                Action::Delay(Duration::from_millis(timeout_ms + extra_ms)),
            );
            let group = name("kafka-txn-unknown");
            let p = pipeline(
                &behind,
                &group,
                &input,
                &output,
                &name("kafka-txn-unknown-tx"),
            )
            .await;
            let m = p.metrics();
            let started = tokio::time::Instant::now();
            // Once the settled batch is behind it, an aborted transaction on the input: the
            // idle pipeline must commit past it whether the delayed commit landed or not.
            let late_abort = async {
                tokio::time::sleep(Duration::from_secs(8)).await;
                write_transactions(&c, &input, 1000, &[(3, false)]).await;
            };
            let (run, ()) = tokio::join!(
                run_until_done(
                    |stop| {
                        p.run_until(async move {
                            let _ = stop.await;
                        })
                    },
                    || started.elapsed() > Duration::from_secs(14),
                ),
                late_abort
            );
            run.unwrap_or_else(|e| {
                panic!("pipeline with EndTxn delayed {timeout_ms}+{extra_ms} ms: {e}")
            });
            assert_lag_zero(
                &c,
                &group,
                &input,
                Duration::ZERO,
                &format!("EndTxn delayed {timeout_ms}+{extra_ms} ms, then an aborted input"),
            )
            .await;
            assert_eq!(proxy.fired(), fired + 1, "the EndTxn was held back");
            let snap = m.snapshot();
            assert!(
                snap.transactions_aborted >= 1,
                "the delayed commit was reported as failed: {snap:?}"
            );
            let got = read_output(&c, &output, inputs).await;
            let expected: Vec<String> = (0..inputs).map(|i| format!("IN-{i}")).collect();
            let round = onceflow_conformance::faults::Tally::of(&expected, &got);
            tally = tally.plus(round);
            let twice: Vec<_> = got.iter().filter(|(_, n)| **n > 1).collect();
            assert!(
                twice.is_empty(),
                "EndTxn delayed {timeout_ms}+{extra_ms} ms: outputs written twice: {twice:?}"
            );
            assert_eq!(
                got.len(),
                inputs,
                "EndTxn delayed {timeout_ms}+{extra_ms} ms: every input in the output"
            );
        }
        onceflow_conformance::faults::report(
            "an_unknown_commit_outcome_is_settled_before_work_is_redone",
            rounds.len(),
            tally,
        );
    })
    .await
    .expect("hung");
}

/// A transaction used by hand whose EndTxn is held past the commit timeout: `commit` fails with
/// an unknown outcome, and the producer has already taken a new epoch (KIP-98), so the late
/// EndTxn of the old one cannot land after work redone under the new one. After
/// `settle_transactions` the same producer runs the next transaction, and the output holds the
/// first transaction's records all once or not at all, never twice. Last, the EndTxn is
/// black-holed (dropped on a connection that stays open: the coordinator never gets it, the
/// client never gets an answer): the same, and the first transaction is aborted by the new
/// epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_by_hand_with_an_unknown_outcome_is_settled_and_the_producer_goes_on() {
    let Some(url) =
        url("a_transaction_by_hand_with_an_unknown_outcome_is_settled_and_the_producer_goes_on")
    else {
        return;
    };
    let _turn = FAULT_PORT.lock().await;
    tokio::time::timeout(HANG_GUARD, async {
        let (proxy, fault_url) = fault_proxy().await;
        let timeout_ms = 2000u64;
        let c = client(&url);
        let behind = client(&format!("{fault_url}?onceflow.timeout.ms={timeout_ms}"));
        // Held 50 ms or 1.2 s past the timeout, then delivered; or never delivered (None).
        let holds = [Some(50u64), Some(1200), None];
        let mut tally = onceflow_conformance::faults::Tally::default();
        for hold in holds {
            let what = match hold {
                Some(extra_ms) => format!("EndTxn delayed {timeout_ms}+{extra_ms} ms"),
                None => "EndTxn black-holed".to_string(),
            };
            let output = topic(&c, 1).await;
            let producer = behind
                .producer(ProducerConfig {
                    transactional_id: Some(name("kafka-txn-by-hand")),
                    ..Default::default()
                })
                .await
                .unwrap();
            proxy.clear();
            let fired = proxy.fired();
            proxy.once(
                Direction::ToBroker,
                |f| kafka_api_key(f) == Some(26),
                match hold {
                    Some(extra_ms) => Action::Delay(Duration::from_millis(timeout_ms + extra_ms)),
                    None => Action::Drop,
                },
            );
            let mut tx = producer.begin().await.unwrap();
            for i in 0..3 {
                tx.send(Record::new(output.clone(), format!("first-{i}")))
                    .await
                    .unwrap();
            }
            let e = tx
                .commit()
                .await
                .expect_err("a commit whose EndTxn is held past the timeout");
            assert!(e.outcome_unknown(), "{what}: {e} ({:?})", e.kind());
            eprintln!("{what}: the commit failed with kind {:?}: {e}", e.kind());
            assert_eq!(proxy.fired(), fired + 1, "the EndTxn was held back");
            producer.settle_transactions().await.unwrap();
            let mut tx = producer.begin().await.unwrap();
            tx.send(Record::new(output.clone(), "after")).await.unwrap();
            tx.commit()
                .await
                .unwrap_or_else(|e| panic!("{what}: the next transaction: {e}"));
            producer.close().await.unwrap();
            let got = read_output(&c, &output, 1).await;
            assert_eq!(got.get("after"), Some(&1), "{got:?}");
            let first: Vec<usize> = (0..3)
                .map(|i| got.get(&format!("first-{i}")).copied().unwrap_or(0))
                .collect();
            // Lost: a record of the first transaction missing while another is there, or the
            // next transaction's; duplicated: any copy beyond one.
            let present = first.iter().filter(|n| **n > 0).count();
            let round = onceflow_conformance::faults::Tally {
                lost: if present == 0 { 0 } else { 3 - present }
                    + usize::from(!got.contains_key("after")),
                duplicated: first.iter().map(|n| n.saturating_sub(1)).sum::<usize>()
                    + got.get("after").map_or(0, |n| n.saturating_sub(1)),
            };
            tally = tally.plus(round);
            assert!(
                first == [0, 0, 0] || first == [1, 1, 1],
                "{what}: the first transaction's records all once or none: {got:?}"
            );
            if hold.is_none() {
                assert_eq!(
                    first,
                    [0, 0, 0],
                    "{what}: the coordinator never got the commit, the new epoch aborted it"
                );
            }
        }
        onceflow_conformance::faults::report(
            "a_transaction_by_hand_with_an_unknown_outcome_is_settled_and_the_producer_goes_on",
            holds.len(),
            tally,
        );
    })
    .await
    .expect("hung");
}
