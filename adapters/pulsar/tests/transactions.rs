//! Pulsar transactions (PIP-31, issue #27) on a real Pulsar standalone with
//! `transactionCoordinatorEnabled=true` (`tests/brokers/up.sh pulsar`, which prints
//! `ONCEFLOW_PULSAR_URL` and `ONCEFLOW_PULSAR_ADMIN_URL`). Without the URLs every test is
//! skipped with that reason; `ONCEFLOW_REQUIRE_BROKERS=1` (set by `make test`) makes a missing
//! broker a failure.
//!
//! - `committed_sends_are_read_and_aborted_ones_never`: what a transaction sent is read once
//!   it commits; what an aborted one sent is never delivered, also to a plain consumer.
//! - `acks_of_an_aborted_transaction_are_void`: inputs acknowledged in an aborted transaction
//!   come again to the group; acknowledged in a committed one, never.
//! - `a_transaction_past_its_timeout_is_aborted`: the coordinator aborts a transaction left
//!   open past `transaction_timeout_ms`; its commit is `Aborted`, its sends never delivered.
//! - `redelivery_after_an_abort_keeps_what_a_later_transaction_committed`: inputs acknowledged
//!   in an aborted transaction come again through `rewind_uncommitted` (what the pipeline
//!   does after an abort), and those a later transaction committed past them never do (a seek
//!   to the committed position would make them unacknowledged again).
//! - `a_member_that_lost_the_partition_cannot_commit`: the failover partition moved to another
//!   member before the commit: `Fenced`, nothing of it read, the inputs go to the new member.
//! - `inputs_of_a_dead_members_open_transaction_come_after_its_timeout`: the next member gets
//!   the inputs a dead member's open transaction acknowledged once the coordinator aborted it.
//! - `shared_an_ack_after_a_committed_one_is_refused`,
//!   `shared_an_ack_while_another_transaction_holds_it_is_refused` and their `key_shared_`
//!   twins: a member's connection is cut while it holds an input, the broker redelivers the
//!   input to another member, which acknowledges it in a transaction; the first member's later
//!   acknowledgement in its own transaction is refused by the broker (`TransactionConflict`,
//!   whether the other transaction committed already or is still open), its commit is
//!   `Aborted`, and the input's output is read once (behind the fault proxy of
//!   `onceflow_conformance::fault_proxy`: `ONCEFLOW_PULSAR_FAULT_URL`,
//!   `ONCEFLOW_PULSAR_FAULT_UPSTREAM`).
//! - `transactions_ending_inside_a_batch_commit`,
//!   `a_batched_input_acknowledged_in_an_aborted_transaction_comes_again` and
//!   `the_rest_of_a_batch_acknowledged_in_an_aborted_transaction_comes_again`: inputs in one
//!   batch (batch-index acknowledgement on), transactions ending inside it, committed or
//!   aborted: each input's output commits once and the pipeline goes on past the batch.
//! - `a_closed_producer_begins_no_transaction`: `begin` after `close` is `Closed`, and no
//!   transaction is opened at the coordinator.
//! - `a_batching_transactional_producer_answers_send`: with `batch_size` and no
//!   `batch_timeout_ms`, a transaction's `send` returns (the batch is sent first) and commits.
//! - `a_batch_partly_committed_by_a_member_that_left_commits_its_rest`: of a batch a member
//!   that left committed part of, the next member gets and commits only the rest (the broker's
//!   ack set on the redelivered entry, which the pulsar crate ignores, read by the bridge).

use std::time::{Duration, Instant};

use onceflow_conformance::fault_proxy::FaultProxy;
use onceflow_core::{
    Client, Consumer, ConsumerConfig, ErrorKind, GroupMetadata, Message, Position, Producer,
    ProducerConfig, Record, StartFrom, TopicPartition, TopicSpec, Transaction,
};

mod common;
use common::{name, require};

/// The broker's URL with transactions on.
fn url() -> Option<String> {
    let service = require("ONCEFLOW_PULSAR_URL")?;
    let admin = require("ONCEFLOW_PULSAR_ADMIN_URL")?;
    Some(format!("{service}?admin={admin}&transactions=true"))
}

fn text(m: &Message) -> String {
    String::from_utf8_lossy(&m.payload).into_owned()
}

/// Reads `topic` as a new group from the earliest message until `last` was read (at most
/// 60 s); returns the payloads read, in order.
async fn read_until(client: &Client, topic: &str, last: &str) -> Vec<String> {
    let c = client
        .consumer(ConsumerConfig::new(name("reader"), [topic]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut out = Vec::new();
    while !out.iter().any(|t| t == last) {
        assert!(
            Instant::now() < deadline,
            "{last} not read within 60 s: {out:?}"
        );
        out.extend(
            c.poll(100, Duration::from_millis(200))
                .await
                .unwrap()
                .iter()
                .map(text),
        );
    }
    c.close().await.unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_sends_are_read_and_aborted_ones_never() {
    let Some(url) = url() else { return };
    let client = connect(&url).await;
    assert!(client.capabilities().transactions);
    let topic = name("txn-out");
    let producer = txn_producer(&client, "txn-producer").await;

    let mut t = producer.begin().await.unwrap();
    for r in t
        .send_batch(
            (0..10)
                .map(|i| Record::new(&topic, format!("a{i}")))
                .collect(),
        )
        .await
    {
        r.unwrap();
    }
    // One transaction at a time per producer, as on Kafka.
    let Err(second) = producer.begin().await else {
        panic!("a transaction is open");
    };
    assert_eq!(second.kind(), ErrorKind::Config, "{second}");
    t.commit().await.unwrap();

    let mut t = producer.begin().await.unwrap();
    for i in 0..10 {
        t.send(Record::new(&topic, format!("x{i}"))).await.unwrap();
    }
    t.abort().await.unwrap();

    // Dropped without commit: aborted as well.
    let mut t = producer.begin().await.unwrap();
    t.send(Record::new(&topic, "dropped")).await.unwrap();
    drop(t);
    // The background abort of the dropped one has to end before the next begins.
    let mut t = begin_after_a_drop(&producer).await;
    for i in 0..10 {
        t.send(Record::new(&topic, format!("b{i}"))).await.unwrap();
    }
    t.commit().await.unwrap();
    // A plain send after the transactions, to know where to stop reading.
    let read = read_to_end(&client, &plain(&client).await, &topic).await;
    let expected: Vec<String> = (0..10)
        .map(|i| format!("a{i}"))
        .chain((0..10).map(|i| format!("b{i}")))
        .chain(["end".to_string()])
        .collect();
    assert_eq!(
        read, expected,
        "committed once each, in order; aborted never"
    );

    // A client without transactions reads the same (the broker filters aborted messages).
    let service = require("ONCEFLOW_PULSAR_URL").unwrap();
    let admin = require("ONCEFLOW_PULSAR_ADMIN_URL").unwrap();
    let plain_client = connect(&format!("{service}?admin={admin}")).await;
    assert_eq!(read_until(&plain_client, &topic, "end").await, expected);
    producer.close().await.unwrap();
}

async fn poll_n(c: &Consumer, n: usize) -> Vec<Message> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut out = Vec::new();
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "{} of {n} within 60 s: {:?}",
            out.len(),
            out.iter().map(text).collect::<Vec<_>>()
        );
        out.extend(
            c.poll(n - out.len(), Duration::from_millis(200))
                .await
                .unwrap(),
        );
    }
    out
}

/// Sends `values` to `input` as one batch ([`send_one_batch`]); a new member of `group` then
/// polls them, and they are asserted to come in order. Returns the member and the messages.
async fn batch_read_by_a_member(
    client: &Client,
    input: &str,
    group: &str,
    values: &[&str],
) -> (Consumer, Vec<Message>) {
    send_one_batch(client, input, values).await;
    let c = member(client, group, input).await;
    let got = poll_n(&c, values.len()).await;
    assert_eq!(texts(&got), values);
    (c, got)
}

/// What a test of a pipeline from an input topic to an output topic starts with.
struct Pipeline {
    /// A client of the broker (transactions on).
    client: Client,
    /// The input topic: `{prefix}-in-…`, a fresh name.
    input: String,
    /// The output topic: `{prefix}-out-…`, a fresh name.
    output: String,
    /// The subscription that reads the input: `{prefix}-group-…`, a fresh name.
    group: String,
    /// The transactional producer of the outputs (transactional id `{producer}-…`).
    producer: Producer,
}

impl Pipeline {
    /// Connects to `url` and names the topics and group after `prefix`; the transactional
    /// producer's id starts with `producer`.
    async fn new(url: &str, prefix: &str, producer: &str) -> Pipeline {
        let client = connect(url).await;
        Pipeline {
            input: name(&format!("{prefix}-in")),
            output: name(&format!("{prefix}-out")),
            group: name(&format!("{prefix}-group")),
            producer: txn_producer(&client, producer).await,
            client,
        }
    }

    /// Sends `value` to the input with `plain`; asserts that the first message a new member
    /// of the group then gets is it (`why` says what that shows: nothing before it comes
    /// again).
    async fn assert_next_is(&self, plain: &Producer, value: &str, why: &str) {
        plain
            .send(Record::new(&self.input, value.to_string()))
            .await
            .unwrap();
        let c = member(&self.client, &self.group, &self.input).await;
        assert_eq!(text(&poll_n(&c, 1).await[0]), value, "{why}");
        c.close().await.unwrap();
    }

    /// Sends `end` to the output with `plain` and reads the output up to it
    /// ([`read_to_end`]).
    async fn read_output(&self, plain: &Producer) -> Vec<String> {
        read_to_end(&self.client, plain, &self.output).await
    }
}

/// Polls `c` until one message comes (at most 60 s), then for 0.5 s more: that message and
/// whatever else of its entry comes with it.
async fn poll_one_and_what_follows(c: &Consumer) -> Vec<Message> {
    let mut got = poll_n(c, 1).await;
    got.extend(c.poll(10, Duration::from_millis(500)).await.unwrap());
    got
}

/// Polls each of `members` in turn (each poll waiting up to `wait`) for 3 s and asserts that
/// no message comes; `what` heads the failure message, which lists what came.
async fn assert_nothing_comes(members: &[&Consumer], wait: Duration, what: &str) {
    let quiet = Instant::now();
    while quiet.elapsed() < Duration::from_secs(3) {
        for c in members {
            let more = c.poll(10, wait).await.unwrap();
            assert!(more.is_empty(), "{what}: {:?}", texts(&more));
        }
    }
}

/// `producer.begin()` once the background abort of a transaction dropped just before has
/// ended (at most 10 s).
async fn begin_after_a_drop(producer: &Producer) -> Transaction {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match producer.begin().await {
            Ok(t) => return t,
            Err(e) if Instant::now() < deadline => {
                eprintln!("begin after a drop: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
}

/// A client of `url` (a `pulsar://` URL with its query).
async fn connect(url: &str) -> Client {
    Client::new(onceflow_pulsar::connect(url).await.unwrap())
}

/// A producer outside any transaction.
async fn plain(client: &Client) -> Producer {
    client.producer(ProducerConfig::new()).await.unwrap()
}

/// Creates `topic` with 2 partitions and sends `n` inputs to each of `partitions` with a plain
/// producer: `in0`.. (`{prefix}{p}-in0`.. when `prefix` is not empty); returns that producer.
async fn two_partitions_with(
    client: &Client,
    topic: &str,
    partitions: &[i32],
    prefix: &str,
    n: usize,
) -> Producer {
    client
        .admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(topic.to_string(), 2))
        .await
        .unwrap();
    let plain = plain(client).await;
    for &p in partitions {
        for i in 0..n {
            let text = if prefix.is_empty() {
                format!("in{i}")
            } else {
                format!("{prefix}{p}-in{i}")
            };
            plain
                .send(Record::new(topic, text).partition(p))
                .await
                .unwrap();
        }
    }
    plain
}

/// A transactional producer whose transactional id is a fresh name starting with `prefix`.
async fn txn_producer(client: &Client, prefix: &str) -> Producer {
    client
        .producer(ProducerConfig::new().transactional_id(name(prefix)))
        .await
        .unwrap()
}

/// Sends `in0`..`in{n-1}` to `topic`, one at a time, with a plain producer; returns that
/// producer.
async fn send_inputs(client: &Client, topic: &str, n: usize) -> Producer {
    let plain = plain(client).await;
    for i in 0..n {
        plain
            .send(Record::new(topic, format!("in{i}")))
            .await
            .unwrap();
    }
    plain
}

/// Sends `values` to `topic` as one batch (a producer batching exactly that many, waiting up
/// to 5 s for them); returns their positions, in order.
async fn send_one_batch(client: &Client, topic: &str, values: &[&str]) -> Vec<Position> {
    let batcher = client
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
    batcher
        .send_batch(records)
        .await
        .into_iter()
        .map(|d| d.unwrap().position)
        .collect()
}

/// A new member of subscription `group` on `topic`, of the default (failover) type, starting
/// at the group's committed position, else at the earliest message.
async fn member(client: &Client, group: &str, topic: &str) -> Consumer {
    client
        .consumer(ConsumerConfig::new(group, [topic]))
        .await
        .unwrap()
}

/// The payloads of `msgs` as text, in order.
fn texts(msgs: &[Message]) -> Vec<String> {
    msgs.iter().map(text).collect()
}

/// `out-<input>` to `output` for each of `msgs`: the outputs the tests' pipeline writes for
/// them.
fn outputs_of(output: &str, msgs: &[Message]) -> Vec<Record> {
    msgs.iter()
        .map(|m| Record::new(output, format!("out-{}", text(m))))
        .collect()
}

/// The positions list for `commit_offsets` that acknowledges `m` (and, on failover, all
/// before it on its partition).
fn upto(m: &Message) -> Vec<(TopicPartition, Position)> {
    vec![(m.topic_partition(), m.position.clone())]
}

/// Begins a transaction on `producer` that sends `outputs`, one at a time, and acknowledges
/// `acked` for the group of `meta`; returns it still open.
async fn begin_processing(
    producer: &Producer,
    meta: &GroupMetadata,
    outputs: Vec<Record>,
    acked: &Message,
) -> Transaction {
    let mut t = producer.begin().await.unwrap();
    for out in outputs {
        t.send(out).await.unwrap();
    }
    t.commit_offsets(meta, &upto(acked)).await.unwrap();
    t
}

/// [`begin_processing`] without outputs: a transaction that only acknowledges `acked`.
async fn begin_acknowledging(
    producer: &Producer,
    meta: &GroupMetadata,
    acked: &Message,
) -> Transaction {
    begin_processing(producer, meta, Vec::new(), acked).await
}

/// Sends `end` to `topic` with `plain`, then reads `topic` as a new group up to it
/// ([`read_until`]).
async fn read_to_end(client: &Client, plain: &Producer, topic: &str) -> Vec<String> {
    plain.send(Record::new(topic, "end")).await.unwrap();
    read_until(client, topic, "end").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_of_an_aborted_transaction_are_void() {
    let Some(url) = url() else { return };
    let p = Pipeline::new(&url, "txn", "txn-pipeline").await;
    let plain = send_inputs(&p.client, &p.input, 10).await;
    let inputs: Vec<String> = (0..10).map(|i| format!("in{i}")).collect();

    // Round 1: outputs sent and inputs acknowledged in a transaction that is aborted.
    // (A new member starts at the group's committed position, else the earliest message.)
    let c = member(&p.client, &p.group, &p.input).await;
    let msgs = poll_n(&c, 10).await;
    assert_eq!(texts(&msgs), inputs);
    let last = msgs.last().unwrap();
    let meta = c.group_metadata().unwrap();
    let t = begin_processing(&p.producer, &meta, outputs_of(&p.output, &msgs), last).await;
    t.abort().await.unwrap();
    // Nothing is committed; the member still holds the inputs (as after an aborted Kafka
    // transaction, it reads them again only after a seek, as the pipeline does).
    assert_eq!(
        c.committed(&[TopicPartition::new(&p.input, last.partition)])
            .await
            .unwrap()[0]
            .next,
        None,
        "an aborted transaction commits no positions"
    );
    c.close().await.unwrap();

    // Round 2: the group gets every input again; this time the transaction commits.
    let c = member(&p.client, &p.group, &p.input).await;
    let again = poll_n(&c, 10).await;
    assert_eq!(
        texts(&again),
        inputs,
        "acknowledged in an aborted transaction: delivered again to the group"
    );
    let meta = c.group_metadata().unwrap();
    let last = again.last().unwrap();
    let t = begin_processing(&p.producer, &meta, outputs_of(&p.output, &again), last).await;
    t.commit().await.unwrap();
    c.close().await.unwrap();

    // Round 3: nothing of the inputs comes again, only what is written after.
    p.assert_next_is(
        &plain,
        "in-after",
        "acknowledged in a committed transaction: never again",
    )
    .await;

    // The output holds round 2's outputs once each, none of round 1's.
    let read = p.read_output(&plain).await;
    let expected: Vec<String> = (0..10)
        .map(|i| format!("out-in{i}"))
        .chain(["end".to_string()])
        .collect();
    assert_eq!(read, expected);
    p.producer.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_past_its_timeout_is_aborted() {
    let Some(url) = url() else { return };
    let client = connect(&format!("{url}&transaction_timeout_ms=1000")).await;
    let topic = name("txn-timeout");
    let producer = txn_producer(&client, "txn-slow").await;
    let mut t = producer.begin().await.unwrap();
    t.send(Record::new(&topic, "late")).await.unwrap();
    // Past the timeout the coordinator's timeout tracker aborts it (the tracker ticks well
    // within a second on the test broker; txn.rs's unit test watches it happen through the
    // admin API); a commit then finds it no longer open.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let e = t.commit().await.expect_err("timed out");
    assert_eq!(e.kind(), ErrorKind::Aborted, "{e}");

    assert_eq!(
        read_to_end(&client, &plain(&client).await, &topic).await,
        vec!["end".to_string()]
    );
}

/// The transactional pipeline whose poll batch takes longer than `transaction_timeout_ms`
/// (400 inputs of 10 ms against 2 s; each input well within it): the transaction commits
/// part-way through the batch when it is due, and every input's output is read once. Before,
/// the transaction lasted the whole batch, the coordinator aborted it under the batch, and the
/// pipeline stopped with no output (h1 break-it, #27).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_batch_longer_than_the_transaction_timeout_commits_part_way() {
    use onceflow_core::{EngineConfig, Pipeline, PipelineConfig, PipelineMode};
    struct Slow(String);
    #[async_trait::async_trait]
    impl onceflow_core::Transform for Slow {
        async fn transform(
            &self,
            m: &Message,
        ) -> std::result::Result<Vec<Record>, onceflow_core::BoxError> {
            tokio::time::sleep(Duration::from_millis(10)).await;
            Ok(vec![Record::new(&self.0, format!("out-{}", text(m)))])
        }
    }
    let Some(url) = url() else { return };
    let client = connect(&format!("{url}&transaction_timeout_ms=2000")).await;
    let (input, output, group) = (name("slow-in"), name("slow-out"), name("slow-g"));
    let n = 400;
    send_inputs(&client, &input, n).await;
    let consumer = client
        .consumer(ConsumerConfig::new(&group, [&input]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let config = PipelineConfig {
        engine: EngineConfig {
            batch_size: n,
            ..EngineConfig::default()
        },
        mode: PipelineMode::Transactional,
        ..PipelineConfig::default()
    };
    let pipeline = Pipeline::with_config(
        consumer.clone(),
        txn_producer(&client, "slow-tx").await,
        None,
        std::sync::Arc::new(Slow(output.clone())),
        config,
    )
    .unwrap();
    let watched = consumer.clone();
    let summary = pipeline
        .run_until(async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            while Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(250)).await;
                if watched
                    .lag()
                    .await
                    .is_ok_and(|lag| !lag.is_empty() && lag.iter().all(|l| l.messages == 0))
                {
                    return;
                }
            }
        })
        .await
        .expect("the pipeline goes on past the transaction timeout");
    assert!(
        summary.metrics.transactions_committed > 1,
        "committed part-way: {:?}",
        summary.metrics
    );
    let mut got = read_to_end(&client, &plain(&client).await, &output).await;
    assert_eq!(got.pop().as_deref(), Some("end"));
    got.sort();
    let mut expected: Vec<String> = (0..n).map(|i| format!("out-in{i}")).collect();
    expected.sort();
    assert_eq!(got, expected, "every input's output once");
}

/// A transaction used after its timeout: the first send to a topic (registered then at the
/// coordinator) and an acknowledgement are refused as `Aborted`, naming the timeout, not
/// `NotFound` (the coordinator's `TransactionNotFound`, which read as a missing topic; the
/// transactional pipeline stopped on it as on any non-retriable send error). h1 break-it, #27.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_or_acknowledgement_after_the_timeout_is_aborted() {
    let Some(url) = url() else { return };
    let client = connect(&format!("{url}&transaction_timeout_ms=1000")).await;
    let topic = name("txn-late");
    let (input, group) = (name("txn-late-in"), name("txn-late-group"));
    let plain = send_inputs(&client, &input, 1).await;
    let c = member(&client, &group, &input).await;
    let got = poll_n(&c, 1).await;
    let producer = txn_producer(&client, "txn-late").await;

    let mut t = producer.begin().await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let e = t
        .send(Record::new(&topic, "late"))
        .await
        .expect_err("timed out");
    assert_eq!(e.kind(), ErrorKind::Aborted, "{e}");
    assert!(e.to_string().contains("transaction_timeout_ms"), "{e}");
    let e = t.commit().await.expect_err("timed out");
    assert_eq!(e.kind(), ErrorKind::Aborted, "{e}");

    let mut t = producer.begin().await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let e = t
        .commit_offsets(&c.group_metadata().unwrap(), &upto(&got[0]))
        .await
        .expect_err("timed out");
    assert_eq!(e.kind(), ErrorKind::Aborted, "{e}");
    assert!(e.to_string().contains("transaction_timeout_ms"), "{e}");
    drop(t);
    c.close().await.unwrap();
    assert_eq!(
        read_to_end(&client, &plain, &topic).await,
        vec!["end".to_string()]
    );
}

/// `begin` right after a transaction was dropped (an error returned with `?` out of the block
/// that held it) opens the next one once the dropped one's background abort ended, as on Kafka;
/// it was refused at once with "a transaction open already: commit or abort it first", which the
/// caller could do neither of. The dropped transaction's records are never read. h1 break-it,
/// #27.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_begin_right_after_a_drop_opens_the_next_transaction() {
    let Some(url) = url() else { return };
    let client = connect(&url).await;
    let topic = name("txn-drop-begin");
    let producer = client
        .producer(
            ProducerConfig::new()
                .transactional_id(name("txn-drop-begin"))
                .option("batch_size", "100")
                .option("batch_timeout_ms", "200"),
        )
        .await
        .unwrap();
    for round in 0..3 {
        let mut t = producer.begin().await.unwrap();
        for i in 0..5 {
            t.send(Record::new(&topic, format!("dropped{round}-{i}")))
                .await
                .unwrap();
        }
        drop(t);
    }
    let mut t = producer.begin().await.expect("begin right after a drop");
    t.send(Record::new(&topic, "next")).await.unwrap();
    t.commit().await.unwrap();
    assert_eq!(
        read_to_end(&client, &plain(&client).await, &topic).await,
        vec!["next".to_string(), "end".to_string()]
    );
}

/// A batching producer keeps each batch within the broker's `maxMessageSize`: 600 records of
/// 10 KiB with `batch_size=1000` (about 6 MiB a batch), and, in a transaction, two records of
/// 3 MiB and a small one. The crate checks its batch limits only after adding a record, so
/// such batches went out whole, the broker refused them, and every record of them failed
/// after the operation timeout with a retriable `Timeout` (none of the 600 delivered; a
/// pipeline writing them would abort and retry for ever). h1 break-it, #27.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_stay_within_the_message_size_limit() {
    let Some(url) = url() else { return };
    let client = connect(&format!("{url}&operation_timeout_ms=10000")).await;
    let topic = name("txn-big-batches");
    let batching = ProducerConfig::new()
        .option("batch_size", "1000")
        .option("batch_timeout_ms", "200");
    let records = (0..600)
        .map(|i| {
            let mut p = format!("r{i}-").into_bytes();
            p.extend((0..10 * 1024).map(|_| rand::random::<u8>()));
            Record::new(&topic, p)
        })
        .collect();
    let sent = client
        .producer(batching.clone())
        .await
        .unwrap()
        .send_batch(records)
        .await;
    let failed: Vec<String> = sent
        .iter()
        .filter_map(|r| r.as_ref().err().map(|e| e.to_string()))
        .collect();
    assert!(
        failed.is_empty(),
        "{} failed: {:?}",
        failed.len(),
        failed.first()
    );

    let producer = client
        .producer(batching.transactional_id(name("txn-big-batches")))
        .await
        .unwrap();
    let big = |tag: &str| {
        let mut p = format!("{tag}-").into_bytes();
        p.resize(3 * 1024 * 1024, b'y');
        Record::new(&topic, p)
    };
    let mut t = producer.begin().await.unwrap();
    for r in t
        .send_batch(vec![big("t1"), big("t2"), Record::new(&topic, "t3")])
        .await
    {
        r.unwrap();
    }
    t.commit().await.unwrap();
    let read: Vec<String> = read_to_end(&client, &plain(&client).await, &topic)
        .await
        .into_iter()
        .map(|v| v.split('-').next().unwrap_or_default().to_string())
        .collect();
    let mut expected: Vec<String> = (0..600).map(|i| format!("r{i}")).collect();
    expected.extend(["t1", "t2", "t3", "end"].map(String::from));
    assert_eq!(read, expected);
}

/// A member whose partition moved to another member cannot commit the positions it
/// acknowledged there in a transaction: the commit is `Fenced`, the transaction aborted,
/// nothing it wrote is read. (Failover on a partitioned topic: partition `i` goes to the
/// member at `i % members` in the members sorted by name, so a second member named before the
/// first takes partition 0.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_lost_the_partition_cannot_commit() {
    let Some(url) = url() else { return };
    let client = connect(&url).await;
    let input = name("txn-moved-in");
    let output = name("txn-moved-out");
    let group = name("txn-moved");
    let plain = two_partitions_with(&client, &input, &[0], "", 3).await;
    let old = client
        .consumer(ConsumerConfig::new(&group, [input.as_str()]).client_id("member-b"))
        .await
        .unwrap();
    let got = poll_n(&old, 3).await;
    let last = got.last().unwrap();
    let tp = TopicPartition::new(&input, 0);
    assert_eq!(last.topic_partition(), tp);
    let producer = txn_producer(&client, "txn-moved").await;
    let t = begin_processing(
        &producer,
        &old.group_metadata().unwrap(),
        vec![Record::new(&output, "from-the-old-member")],
        last,
    )
    .await;
    // A member named before the first joins: partition 0 becomes its.
    let heir = client
        .consumer(ConsumerConfig::new(&group, [input.as_str()]).client_id("member-a"))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !heir.assignment().contains(&tp) {
        assert!(Instant::now() < deadline, "partition 0 never moved");
        heir.poll(10, Duration::from_millis(200)).await.unwrap();
    }
    let e = t.commit().await.expect_err("the partition moved");
    assert_eq!(e.kind(), ErrorKind::Fenced, "{e}");
    assert_eq!(
        read_to_end(&client, &plain, &output).await,
        vec!["end".to_string()],
        "the fenced transaction's output is never read"
    );
    // The heir gets the inputs: none was acknowledged.
    assert_eq!(texts(&poll_n(&heir, 3).await), vec!["in0", "in1", "in2"]);
    heir.close().await.unwrap();
    old.close().await.unwrap();
}

/// A hole in the acknowledgements: transaction 1 acknowledges in0..in2 and stays open while
/// transaction 2 acknowledges in3..in5 and commits; then transaction 1 aborts. What the pipeline
/// does after an abort, `rewind_uncommitted`, gives out in0..in2 and in6..in9 again, in
/// order, and never in3..in5: a seek to the committed position (in0, the cursor's mark-delete
/// position + 1) resets the cursor and makes in3..in5 unacknowledged again, and a pipeline whose
/// commit marker for transaction 2 was lost with a killed process wrote them twice (#27).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redelivery_after_an_abort_keeps_what_a_later_transaction_committed() {
    let Some(url) = url() else { return };
    let client = connect(&url).await;
    let input = name("txn-hole-in");
    let group = name("txn-hole-group");
    let _plain = send_inputs(&client, &input, 10).await;
    let first = txn_producer(&client, "txn-first").await;
    let second = txn_producer(&client, "txn-second").await;
    let c = member(&client, &group, &input).await;
    let msgs = poll_n(&c, 10).await;
    let meta = c.group_metadata().unwrap();
    let t1 = begin_acknowledging(&first, &meta, &msgs[2]).await;
    let t2 = begin_acknowledging(&second, &meta, &msgs[5]).await;
    t2.commit().await.unwrap();
    t1.abort().await.unwrap();

    let tp = TopicPartition::new(&input, msgs[0].partition);
    let left = c.rewind_uncommitted(&[tp]).await.unwrap();
    assert!(left.is_empty(), "Pulsar redelivers every partition itself");
    let again = poll_n(&c, 7).await;
    let expected: Vec<String> = [0, 1, 2, 6, 7, 8, 9]
        .iter()
        .map(|i| format!("in{i}"))
        .collect();
    assert_eq!(
        texts(&again),
        expected,
        "the aborted transaction's inputs and the undelivered rest, in order"
    );
    // Nothing else comes: in3..in5 stay acknowledged.
    assert_nothing_comes(
        &[&c],
        Duration::from_millis(200),
        "delivered again although committed or still held",
    )
    .await;
    c.close().await.unwrap();
    // A new member of the group gets the same, from the broker's cursor.
    let c = member(&client, &group, &input).await;
    assert_eq!(texts(&poll_n(&c, 7).await), expected);
    c.close().await.unwrap();
    first.close().await.unwrap();
    second.close().await.unwrap();
}

/// A member that dies with a transaction open (its acknowledgements pending in it): the next
/// member of the group gets those inputs once the coordinator has aborted the transaction at
/// its timeout, and every other input at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inputs_of_a_dead_members_open_transaction_come_after_its_timeout() {
    let Some(url) = url() else { return };
    let client = connect(&format!("{url}&transaction_timeout_ms=5000")).await;
    let input = name("txn-dead-in");
    let group = name("txn-dead-group");
    let _plain = send_inputs(&client, &input, 10).await;
    let producer = txn_producer(&client, "txn-dead").await;
    let c = member(&client, &group, &input).await;
    let msgs = poll_n(&c, 10).await;
    let meta = c.group_metadata().unwrap();
    let t = begin_acknowledging(&producer, &meta, &msgs[4]).await;
    // The member dies: its transaction is never ended, its consumer goes away.
    std::mem::forget(t);
    c.close().await.unwrap();
    let opened = Instant::now();

    let c = member(&client, &group, &input).await;
    let mut got: Vec<(u128, String)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while got.len() < 10 {
        assert!(Instant::now() < deadline, "within 60 s only {got:?}");
        for m in c.poll(10, Duration::from_millis(200)).await.unwrap() {
            got.push((opened.elapsed().as_millis(), text(&m)));
        }
    }
    eprintln!("next member got: {got:?}");
    let mut names: Vec<String> = got.iter().map(|(_, t)| t.clone()).collect();
    names.sort();
    let mut expected: Vec<String> = (0..10).map(|i| format!("in{i}")).collect();
    expected.sort();
    assert_eq!(names, expected, "every input once");
    c.close().await.unwrap();
}

/// Inputs m, n and o in one batch, each processed in a transaction of its own (the pipeline's
/// transactions end wherever its interval falls, inside batches too): each commits, each
/// output is read once, and the entry is acknowledged whole in the end. The second
/// transaction's acknowledgement was refused (`TransactionConflict`, "already acked before"):
/// its ack set cleared m as well, which the first had acknowledged; the third's, a whole-entry
/// acknowledgement, too ("in pending ack status"), and the pipeline stalled at that batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_ending_inside_a_batch_commit() {
    let Some(url) = url() else { return };
    let p = Pipeline::new(&url, "txn-inside", "txn-inside").await;
    let (c, got) = batch_read_by_a_member(&p.client, &p.input, &p.group, &["m", "n", "o"]).await;
    let meta = c.group_metadata().unwrap();
    for m in &got {
        let outputs = outputs_of(&p.output, std::slice::from_ref(m));
        let t = begin_processing(&p.producer, &meta, outputs, m).await;
        t.commit()
            .await
            .unwrap_or_else(|e| panic!("the transaction of {}: {e}", text(m)));
    }
    c.close().await.unwrap();
    let plain = plain(&p.client).await;
    p.assert_next_is(&plain, "after", "nothing of the batch again")
        .await;
    assert_eq!(
        p.read_output(&plain).await,
        vec!["out-m", "out-n", "out-o", "end"]
    );
    p.producer.close().await.unwrap();
}

/// A batch of 3 000 inputs (one ledger entry, as a Java producer writes them) read by a member
/// whose receiver queue holds 100: a transaction acknowledging the first 50 commits. The
/// pulsar crate's consumer engine hands the entry's messages to its bounded stream and writes
/// acknowledgements from the same loop; with the member not polling while its transaction
/// waited for the acknowledgements' answers, that loop stood still on the stream, the
/// acknowledgements were never written, and the commit was aborted after the operation
/// timeout (30 s): a pipeline on batched input committed nothing past its first batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_commits_while_a_large_batch_waits_to_be_read() {
    let Some(url) = url() else { return };
    let p = Pipeline::new(&url, "txn-large", "txn-large").await;
    let values: Vec<String> = (0..3000).map(|i| format!("in{i}")).collect();
    let refs: Vec<&str> = values.iter().map(String::as_str).collect();
    send_one_batch(&p.client, &p.input, &refs).await;
    let c = p
        .client
        .consumer(
            ConsumerConfig::new(&p.group, [p.input.as_str()]).option("receiver_queue_size", "100"),
        )
        .await
        .unwrap();
    let got = poll_n(&c, 50).await;
    assert_eq!(texts(&got), refs[..50]);
    let meta = c.group_metadata().unwrap();
    let outputs = outputs_of(&p.output, &got);
    let t = begin_processing(&p.producer, &meta, outputs, got.last().unwrap()).await;
    let started = Instant::now();
    t.commit().await.unwrap_or_else(|e| {
        panic!(
            "the transaction acknowledging 50 of 3 000 batched inputs, after {:?}: {e}",
            started.elapsed()
        )
    });
    c.close().await.unwrap();
    let plain = plain(&p.client).await;
    let read = p.read_output(&plain).await;
    assert_eq!(read.len(), 51, "the 50 outputs and the end marker");
    p.producer.close().await.unwrap();
}

/// Inputs m and n in one batch (one ledger entry; the broker has batch-index acknowledgement
/// on, PIP-54): a transaction acknowledges m and aborts. After the pipeline's rewind both come
/// again, and a later transaction commits them. m's settled bit in onceflow's batch state
/// outlived the abort: the redelivered m was taken for a message whose acknowledgement was
/// still under way, acknowledged again outside any transaction (lost: its output never
/// committed), and the rewind, waiting for m, dropped n and everything after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_input_acknowledged_in_an_aborted_transaction_comes_again() {
    let Some(url) = url() else { return };
    let p = Pipeline::new(&url, "txn-batch", "txn-batch").await;
    let receipts = send_one_batch(&p.client, &p.input, &["m", "n"]).await;
    let entry = |p: &Position| match p {
        Position::MessageId { ledger, entry, .. } => (*ledger, *entry),
        other => panic!("{other:?}"),
    };
    assert_eq!(entry(&receipts[0]), entry(&receipts[1]), "one batch");
    let c = member(&p.client, &p.group, &p.input).await;
    let got = poll_n(&c, 2).await;
    assert_eq!(texts(&got), vec!["m", "n"]);
    let tp = got[0].topic_partition();
    let meta = c.group_metadata().unwrap();

    let aborted = vec![Record::new(&p.output, "out-m-aborted")];
    let t1 = begin_processing(&p.producer, &meta, aborted, &got[0]).await;
    t1.abort().await.unwrap();
    let left = c
        .rewind_uncommitted(std::slice::from_ref(&tp))
        .await
        .unwrap();
    assert!(left.is_empty(), "Pulsar redelivers every partition itself");
    let again = poll_n(&c, 2).await;
    assert_eq!(
        texts(&again),
        vec!["m", "n"],
        "the aborted transaction's input and its batch sibling, in order"
    );

    let t2 = begin_processing(&p.producer, &meta, outputs_of(&p.output, &again), &again[1]).await;
    t2.commit().await.unwrap();
    c.close().await.unwrap();

    // Nothing of the batch comes to the group again, only what is written after.
    let plain = plain(&p.client).await;
    p.assert_next_is(&plain, "after", "nothing of the batch again")
        .await;
    assert_eq!(
        p.read_output(&plain).await,
        vec!["out-m", "out-n", "end"],
        "each input's output once, none of the aborted transaction's"
    );
    p.producer.close().await.unwrap();
}

/// Inputs m and n in one batch: transaction T0 commits m (its acknowledgement carries an ack
/// set, PIP-54), T1 acknowledges n, which settles the batch, and aborts. After the rewind only
/// n comes again (the broker's redelivery of the entry holds m too), and T2 commits it. The
/// batch's state was forgotten when T1 settled it: m reached the application again, and every
/// later transaction's acknowledgement of the entry was refused (`TransactionConflict`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rest_of_a_batch_acknowledged_in_an_aborted_transaction_comes_again() {
    let Some(url) = url() else { return };
    let p = Pipeline::new(&url, "txn-rest", "txn-rest").await;
    let (c, got) = batch_read_by_a_member(&p.client, &p.input, &p.group, &["m", "n"]).await;
    let tp = got[0].topic_partition();
    let meta = c.group_metadata().unwrap();
    let t0 = begin_processing(
        &p.producer,
        &meta,
        vec![Record::new(&p.output, "out-m")],
        &got[0],
    )
    .await;
    t0.commit().await.unwrap();
    let aborted = vec![Record::new(&p.output, "out-n-aborted")];
    let t1 = begin_processing(&p.producer, &meta, aborted, &got[1]).await;
    t1.abort().await.unwrap();
    assert!(c
        .rewind_uncommitted(std::slice::from_ref(&tp))
        .await
        .unwrap()
        .is_empty());
    let again = poll_one_and_what_follows(&c).await;
    assert_eq!(
        texts(&again),
        vec!["n"],
        "only the aborted transaction's input"
    );
    let t2 = begin_processing(
        &p.producer,
        &meta,
        vec![Record::new(&p.output, "out-n")],
        &again[0],
    )
    .await;
    t2.commit().await.unwrap();
    c.close().await.unwrap();
    let plain = plain(&p.client).await;
    p.assert_next_is(&plain, "after", "nothing of the batch again")
        .await;
    assert_eq!(p.read_output(&plain).await, vec!["out-m", "out-n", "end"]);
    p.producer.close().await.unwrap();
}

/// Inputs m and n in one batch: member A commits m's output and acknowledgement in a
/// transaction (with an ack set, PIP-54) and goes away; the broker gives the entry to member B
/// with the ack set of what is left (n). B gets n only, and commits it. The pulsar crate
/// ignores `CommandMessage.ack_set` and handed B m as well; B's transaction acknowledged m
/// again and the broker refused it (`TransactionConflict`, "already acked before") in this and
/// every later attempt: the group was stuck at that entry (no output duplicated). The bridge
/// now reads the ack set and the consumer drops what it marks acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_partly_committed_by_a_member_that_left_commits_its_rest() {
    let Some(url) = url() else { return };
    let p = Pipeline::new(&url, "txn-half", "txn-half").await;
    let (a, got) = batch_read_by_a_member(&p.client, &p.input, &p.group, &["m", "n"]).await;
    let meta = a.group_metadata().unwrap();
    let t = begin_processing(
        &p.producer,
        &meta,
        vec![Record::new(&p.output, "out-m")],
        &got[0],
    )
    .await;
    t.commit().await.unwrap();
    a.close().await.unwrap();

    let b = member(&p.client, &p.group, &p.input).await;
    let rest = poll_one_and_what_follows(&b).await;
    let last = rest.last().unwrap();
    let meta = b.group_metadata().unwrap();
    let t = begin_processing(&p.producer, &meta, outputs_of(&p.output, &rest), last).await;
    let committed = t.commit().await;
    assert_eq!(
        texts(&rest),
        vec!["n"],
        "only what the broker has no acknowledgement for (its commit: {committed:?})"
    );
    committed.unwrap();
    // A replay (a seek resets the cursor) gives the whole batch again: the entry comes without
    // an ack set now, and what the earlier one marked is forgotten.
    b.seek(&last.topic_partition(), &StartFrom::Earliest)
        .await
        .unwrap();
    let replay = poll_n(&b, 2).await;
    assert_eq!(texts(&replay), vec!["m", "n"], "the replayed batch, whole");
    b.close().await.unwrap();
    assert_eq!(
        p.read_output(&plain(&p.client).await).await,
        vec!["out-m", "out-n", "end"]
    );
}

/// The fault proxy listens on the port the broker advertises for its `fault` listener, so the
/// tests behind it take turns.
static PROXY_PORT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A fault proxy on the broker's advertised fault address (`ONCEFLOW_PULSAR_FAULT_URL`, relaying
/// to `ONCEFLOW_PULSAR_FAULT_UPSTREAM`), and the URL with transactions on that goes through it.
async fn fault_proxy() -> Option<(FaultProxy, String)> {
    let service = require("ONCEFLOW_PULSAR_FAULT_URL")?;
    let upstream = require("ONCEFLOW_PULSAR_FAULT_UPSTREAM")?;
    let admin = require("ONCEFLOW_PULSAR_ADMIN_URL")?;
    let listen = service.trim_start_matches("pulsar://").to_string();
    // A proxy of another test binary may still hold the port for a moment.
    let proxy = FaultProxy::start_when_free(&listen, &upstream, Duration::from_secs(30)).await;
    Some((proxy, format!("{service}?admin={admin}&transactions=true")))
}

/// The consumer names of subscription `group` on (non-partitioned) `topic` in the namespace
/// `public/default`, from the admin REST topic stats.
async fn subscribers(topic: &str, group: &str) -> Vec<String> {
    let admin = require("ONCEFLOW_PULSAR_ADMIN_URL").unwrap();
    let stats: serde_json::Value = reqwest::get(format!(
        "{admin}/admin/v2/persistent/public/default/{topic}/stats"
    ))
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    stats["subscriptions"][group]["consumers"]
        .as_array()
        .map(|cs| {
            cs.iter()
                .filter_map(|c| c["consumerName"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// When the second acknowledgement of a message comes.
#[derive(Debug, Clone, Copy)]
enum Second {
    /// After the first one's transaction committed.
    AfterCommit,
    /// While the first one's transaction is open.
    WhileOpen,
}

/// How many open transactions hold acknowledgements on subscription `group` of (non-partitioned)
/// `topic` in `public/default` (`ongoingTxnSize` of the admin REST pending-ack stats); `None`
/// while the broker has no pending-ack state for it.
async fn pending_ack_transactions(topic: &str, group: &str) -> Option<u64> {
    let admin = require("ONCEFLOW_PULSAR_ADMIN_URL").unwrap();
    let r = reqwest::get(format!(
        "{admin}/admin/v3/transactions/pendingAckStats/public/default/{topic}/{group}"
    ))
    .await
    .unwrap();
    if !r.status().is_success() {
        eprintln!("pending-ack stats: {}", r.status());
        return None;
    }
    let stats: serde_json::Value = r.json().await.unwrap();
    stats["ongoingTxnSize"].as_u64()
}

/// Issue #27, shared and key_shared subscriptions: member c1 holds input m (delivered, not yet
/// acknowledged) when its connection is cut; the broker redelivers m to member c2, which
/// writes m's output and acknowledges m in transaction T2 (committed, or still open: see
/// [`Second`]). c1's connection comes back and c1, unaware, writes its own output for m and
/// acknowledges m in transaction T1: the broker refuses that acknowledgement
/// (`TransactionConflict`: the subscription's cursor has m deleted, or m is pending in T2),
/// T1's commit is `Aborted`, T2's (if open) succeeds, and a reader of the output sees m's
/// output once, T2's. m comes to no member again.
async fn second_ack_after_a_redelivery_is_refused(sub: &str, second: Second) {
    let Some(url) = url() else { return };
    let _turn = PROXY_PORT.lock().await;
    let Some((proxy, fault_url)) = fault_proxy().await else {
        return;
    };
    let direct = connect(&url).await;
    // Its own client: c1's connections, and its transactions', go through the proxy.
    let behind = connect(&fault_url).await;
    let input = name("txn-redelivered-in");
    let output = name("txn-redelivered-out");
    let group = name("txn-redelivered");
    let plain = plain(&direct).await;
    plain.send(Record::new(&input, "m").key("k")).await.unwrap();
    let config = |id: &str| {
        ConsumerConfig::new(&group, [input.as_str()])
            .client_id(id)
            .option("subscription_type", sub)
    };
    let c1 = behind.consumer(config("c1")).await.unwrap();
    let got1 = poll_n(&c1, 1).await;
    assert_eq!(text(&got1[0]), "m", "{sub}");
    // c2 joins while c1 holds m, then c1's connections are cut and held unanswered: the broker
    // puts m back and dispatches it to c2, the only member left.
    let c2 = direct.consumer(config("c2")).await.unwrap();
    proxy.isolate();
    let got2 = poll_n(&c2, 1).await;
    assert_eq!(text(&got2[0]), "m", "{sub}");
    assert_eq!(
        got2[0].position, got1[0].position,
        "{sub}: the same message"
    );
    // On failover c2 is the active member only while c1 is away: it commits before c1 is
    // back (then c1, first in name order, is active again: c2's commit would be `Fenced`).
    let failover = sub == "failover";
    if !failover {
        proxy.heal();
    }

    // c2 processes m: its output and its acknowledgement in T2, committed before c1
    // acknowledges, or still open.
    let p2 = txn_producer(&direct, "txn-c2").await;
    let t2 = begin_processing(
        &p2,
        &c2.group_metadata().unwrap(),
        vec![Record::new(&output, "out-m-by-c2")],
        &got2[0],
    )
    .await;
    let mut t2 = match second {
        Second::AfterCommit => {
            t2.commit().await.unwrap();
            None
        }
        Second::WhileOpen => {
            // T2's acknowledgement is at the broker (pending in T2) before c1's is written.
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let ongoing = pending_ack_transactions(&input, &group).await;
                if ongoing == Some(1) {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "{sub}: T2's acknowledgement not pending within 60 s ({ongoing:?})"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Some(t2)
        }
    };
    if failover {
        proxy.heal();
    }

    // c1 is a member again (the crate reconnected its consumer through the proxy) before it
    // acknowledges: an acknowledgement written while it was away would be lost, not refused.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let names = subscribers(&input, &group).await;
        if names.len() == 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{sub}: c1 not back within 60 s: {names:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let p1 = txn_producer(&behind, "txn-c1").await;
    let t1 = begin_processing(
        &p1,
        &c1.group_metadata().unwrap(),
        vec![Record::new(&output, "out-m-by-c1")],
        &got1[0],
    )
    .await;
    let e = t1
        .commit()
        .await
        .expect_err("m was acknowledged by another transaction already");
    eprintln!("{sub}, {second:?}: T1's commit: {e}");
    assert_eq!(e.kind(), ErrorKind::Aborted, "{sub}, {second:?}: {e}");
    assert!(
        e.message().contains("TransactionConflict"),
        "{sub}, {second:?}: the broker refused the acknowledgement: {e}"
    );
    if let Some(t2) = t2.take() {
        t2.commit().await.unwrap();
    }

    assert_eq!(
        read_to_end(&direct, &plain, &output).await,
        vec!["out-m-by-c2".to_string(), "end".to_string()],
        "{sub}: m's output once, from the committed transaction"
    );
    // After the abort the pipeline rewinds (on shared and key_shared: a negative ack of what
    // the member holds); the broker has m acknowledged and gives it to no member again
    // (polled for 3 s).
    let left = c1
        .rewind_uncommitted(&[got1[0].topic_partition()])
        .await
        .unwrap();
    assert!(left.is_empty(), "{sub}");
    assert_nothing_comes(
        &[&c1, &c2],
        Duration::from_millis(100),
        &format!("{sub}: delivered again"),
    )
    .await;
    // And the group goes on: a later input reaches a member. On failover c1, active again,
    // asked the broker to rewind to m, which never comes again; it dropped everything after
    // m until it asked again (the crash test stalled there).
    plain.send(Record::new(&input, "after")).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut later = Vec::new();
    while !later.iter().any(|t| t == "after") {
        assert!(
            Instant::now() < deadline,
            "{sub}, {second:?}: a later input did not reach a member within 60 s: {later:?}"
        );
        for c in [&c1, &c2] {
            later.extend(texts(
                &c.poll(10, Duration::from_millis(100)).await.unwrap(),
            ));
        }
    }
    assert_eq!(later, vec!["after".to_string()], "{sub}, {second:?}");
    c1.close().await.unwrap();
    c2.close().await.unwrap();
    p1.close().await.unwrap();
    p2.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_an_ack_after_a_committed_one_is_refused() {
    second_ack_after_a_redelivery_is_refused("failover", Second::AfterCommit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_an_ack_after_a_committed_one_is_refused() {
    second_ack_after_a_redelivery_is_refused("shared", Second::AfterCommit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_an_ack_while_another_transaction_holds_it_is_refused() {
    second_ack_after_a_redelivery_is_refused("shared", Second::WhileOpen).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_shared_an_ack_after_a_committed_one_is_refused() {
    second_ack_after_a_redelivery_is_refused("key_shared", Second::AfterCommit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_shared_an_ack_while_another_transaction_holds_it_is_refused() {
    second_ack_after_a_redelivery_is_refused("key_shared", Second::WhileOpen).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_producer_begins_no_transaction() {
    let Some(url) = url() else { return };
    let client = connect(&url).await;
    let producer = txn_producer(&client, "closed-txn").await;
    producer.close().await.unwrap();
    let Err(e) = producer.begin().await else {
        panic!("begin on a closed producer opened a transaction");
    };
    assert_eq!(e.kind(), ErrorKind::Closed, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batching_transactional_producer_answers_send() {
    let Some(url) = url() else { return };
    let client = connect(&url).await;
    let topic = name("txn-batching");
    let producer = client
        .producer(
            ProducerConfig::new()
                .transactional_id(name("txn-batching"))
                .option("batch_size", "100"),
        )
        .await
        .unwrap();
    let mut t = producer.begin().await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), t.send(Record::new(&topic, "t0")))
        .await
        .expect("a transaction's send to a batching producer returned within 30 s")
        .unwrap();
    tokio::time::timeout(
        Duration::from_secs(30),
        t.send_batch(vec![Record::new(&topic, "t1")]),
    )
    .await
    .expect("a transaction's send_batch to a batching producer returned within 30 s")
    .pop()
    .unwrap()
    .unwrap();
    t.commit().await.unwrap();
    assert_eq!(read_until(&client, &topic, "t1").await, ["t0", "t1"]);
    producer.close().await.unwrap();
}

/// A position given for another partition than its message's is refused, in a transaction and
/// in a plain commit, before anything is acknowledged: ledger and entry ids are per partition,
/// so such a position acknowledged within the named partition either nothing or every message
/// delivered there up to an unrelated id (#27 break-it: `commit_offsets` accepted it and
/// acknowledged nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_position_of_another_partition_is_refused() {
    let Some(url) = url() else { return };
    let client = connect(&url).await;
    let input = name("txn-wrong-part-in");
    let group = name("txn-wrong-part");
    let _inputs_sent_by = two_partitions_with(&client, &input, &[0, 1], "p", 3).await;
    let c = member(&client, &group, &input).await;
    let got = poll_n(&c, 6).await;
    let last_of = |p: i32| got.iter().rev().find(|m| m.partition == p).unwrap().clone();
    let (m0, m1) = (last_of(0), last_of(1));
    let (tp0, tp1) = (m0.topic_partition(), m1.topic_partition());
    let swapped = vec![
        (tp0.clone(), m0.position.clone()),
        (tp1, m0.position.clone()),
    ];
    let producer = txn_producer(&client, "txn-wrong-part").await;
    let mut t = producer.begin().await.unwrap();
    let e = t
        .commit_offsets(&c.group_metadata().unwrap(), &swapped)
        .await
        .expect_err("a partition-0 position for partition 1");
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(
        e.to_string().contains(&m0.position.to_string()) && e.to_string().contains("partition 0"),
        "names the position and its partition: {e}"
    );
    t.abort().await.unwrap();
    let e = c
        .commit(&[(tp0, m1.position.clone())])
        .await
        .expect_err("a partition-1 position for partition 0");
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    c.close().await.unwrap();
    // Nothing was acknowledged: the next member gets all six again.
    let next = member(&client, &group, &input).await;
    let mut again = texts(&poll_n(&next, 6).await);
    again.sort();
    assert_eq!(
        again,
        ["p0-in0", "p0-in1", "p0-in2", "p1-in0", "p1-in1", "p1-in2"]
    );
    assert_nothing_comes(&[&next], Duration::from_millis(200), "only the six inputs").await;
    next.close().await.unwrap();
}

/// h2 break-it of the partition check (#27): positions of a non-partitioned topic (partition
/// index -1 in the message id, partition 0 in its `TopicPartition`) commit, plainly and in a
/// transaction, as they are delivered and as their text form parses back; a partitioned
/// topic's partition-0 position given for the non-partitioned topic, and a non-partitioned
/// position given for a partitioned topic's partition 0, are refused as `Config` before
/// anything is acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_partitioned_positions_commit_and_foreign_ones_are_refused() {
    let Some(url) = url() else { return };
    let client = connect(&url).await;
    let flat = name("txn-flat-in");
    client
        .admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(flat.clone(), 1))
        .await
        .unwrap();
    let _plain = send_inputs(&client, &flat, 4).await;
    let parted = name("txn-flat-parted");
    let _p2 = two_partitions_with(&client, &parted, &[0], "p", 1).await;
    let group = name("txn-flat");
    let c = member(&client, &group, &flat).await;
    let got = poll_n(&c, 4).await;
    let tp = got[0].topic_partition();
    assert_eq!(tp.partition, 0);
    let cp = member(&client, &group, &parted).await;
    let gp = poll_n(&cp, 1).await;
    let tpp = gp[0].topic_partition();
    // Its own positions, as delivered and parsed back from their text.
    c.commit(&[(tp.clone(), got[0].position.clone())])
        .await
        .unwrap();
    let parsed: Position = got[1].position.to_string().parse().unwrap();
    c.commit(&[(tp.clone(), parsed)]).await.unwrap();
    // Foreign ones.
    let e = c
        .commit(&[(tp.clone(), gp[0].position.clone())])
        .await
        .expect_err("a partitioned topic's position for a non-partitioned one");
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    let e = cp
        .commit(&[(tpp.clone(), got[2].position.clone())])
        .await
        .expect_err("a non-partitioned topic's position for partition 0");
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.to_string().contains("non-partitioned"), "{e}");
    // In a transaction: its own position commits.
    let producer = txn_producer(&client, "txn-flat").await;
    let mut t = producer.begin().await.unwrap();
    t.commit_offsets(
        &c.group_metadata().unwrap(),
        &[(tp.clone(), got[2].position.clone())],
    )
    .await
    .unwrap();
    t.commit().await.unwrap();
    c.close().await.unwrap();
    cp.close().await.unwrap();
    // in3 alone comes again on the flat topic, and p0-in0 on the partitioned one.
    let next = member(&client, &group, &flat).await;
    assert_eq!(texts(&poll_n(&next, 1).await), ["in3"]);
    assert_nothing_comes(&[&next], Duration::from_millis(300), "only in3").await;
    next.close().await.unwrap();
    let nextp = member(&client, &group, &parted).await;
    assert_eq!(texts(&poll_n(&nextp, 1).await), ["p0-in0"]);
    nextp.close().await.unwrap();
}

/// Records a transaction handed to a batching producer that were still batched when it was
/// aborted or dropped are never read: not on their own when the batch times out, and not as
/// part of the next transaction, whose records the same batch would have carried. Before, the
/// bridge stamped a `SEND` with the transaction its producer was bound to when the frame
/// passed: a batch sent after the abort went out without a transaction (read by everyone), or
/// in the next one (committed with it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_still_batched_when_a_transaction_ends_are_never_read() {
    let Some(url) = url() else { return };
    let client = connect(&url).await;
    let topic = name("txn-late-batch");
    let producer = client
        .producer(
            ProducerConfig::new()
                .transactional_id(name("txn-late-batch"))
                .option("batch_size", "1000")
                .option("batch_timeout_ms", "3000"),
        )
        .await
        .unwrap();
    let batch = |prefix: &str| -> Vec<Record> {
        (0..10)
            .map(|i| Record::new(&topic, format!("{prefix}{i}")))
            .collect()
    };
    // Aborted with its records batched, their receipts never awaited; nothing begins after it
    // until the batch's timeout has passed.
    let mut t = producer.begin().await.unwrap();
    drop(t.enqueue_batch(batch("aborted")).await);
    t.abort().await.unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    // Dropped with its records batched; the next transaction begins as soon as it may and
    // commits records of its own.
    let mut t = producer.begin().await.unwrap();
    drop(t.enqueue_batch(batch("dropped")).await);
    drop(t);
    let mut t = begin_after_a_drop(&producer).await;
    for r in t.send_batch(batch("committed")).await {
        r.unwrap();
    }
    t.commit().await.unwrap();
    let read = read_to_end(&client, &plain(&client).await, &topic).await;
    let expected: Vec<String> = batch("committed")
        .iter()
        .map(|r| String::from_utf8_lossy(&r.payload).into_owned())
        .chain(["end".to_string()])
        .collect();
    assert_eq!(read, expected, "only the committed transaction's records");
    producer.close().await.unwrap();
}

/// `END_TXN_RESPONSE` in the binary protocol (PulsarApi.proto).
const END_TXN_RESPONSE: i32 = 57;

/// The coordinator's answer to a commit is lost with its connection (the fault proxy cuts it):
/// the commit is retried on a new connection and reports success or an unknown outcome, never
/// a failure; `settle_transactions` then returns once the outcome is final. The transaction did
/// commit (its `END_TXN` reached the coordinator): its outputs are read once, its inputs come
/// neither to the member that acknowledged them nor to a new one, and the producer goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_answer_is_lost_is_settled_as_committed() {
    use onceflow_conformance::fault_proxy::{pulsar_command_type, Action, Direction};
    let Some(url) = url() else { return };
    let _turn = PROXY_PORT.lock().await;
    let Some((proxy, fault_url)) = fault_proxy().await else {
        return;
    };
    let direct = connect(&url).await;
    let behind = connect(&format!("{fault_url}&operation_timeout_ms=5000")).await;
    let p = Pipeline::new(&url, "txn-lost-answer", "txn-lost-answer").await;
    let plain = send_inputs(&direct, &p.input, 10).await;
    let c = member(&behind, &p.group, &p.input).await;
    let got = poll_n(&c, 10).await;
    assert_eq!(texts(&got).len(), 10);
    let producer = txn_producer(&behind, "txn-lost-answer").await;
    let t = begin_processing(
        &producer,
        &c.group_metadata().unwrap(),
        outputs_of(&p.output, &got),
        &got[9],
    )
    .await;
    proxy.once(
        Direction::ToClient,
        |f| pulsar_command_type(f) == Some(END_TXN_RESPONSE),
        Action::Cut,
    );
    let committed = t.commit().await;
    assert_eq!(proxy.fired(), 1, "the commit's answer was cut");
    if let Err(e) = &committed {
        assert!(
            e.outcome_unknown(),
            "a commit whose answer was lost is not a failure: {e} ({:?})",
            e.kind()
        );
    }
    producer.settle_transactions().await.unwrap();
    assert_nothing_comes(
        &[&c],
        Duration::from_secs(3),
        "inputs of the committed transaction",
    )
    .await;
    c.close().await.unwrap();
    // The producer goes on.
    let mut t = producer.begin().await.unwrap();
    t.send(Record::new(&p.output, "after")).await.unwrap();
    t.commit().await.unwrap();
    let mut expected: Vec<String> = (0..10).map(|i| format!("out-in{i}")).collect();
    expected.extend(["after".to_string(), "end".to_string()]);
    assert_eq!(
        read_to_end(&direct, &plain, &p.output).await,
        expected,
        "outputs once"
    );
    p.assert_next_is(
        &plain,
        "next",
        "the acknowledged inputs are not given to a new member",
    )
    .await;
}

/// Outputs `out-<input>` to the topic it names.
struct Out(String);

#[async_trait::async_trait]
impl onceflow_core::Transform for Out {
    async fn transform(
        &self,
        m: &Message,
    ) -> std::result::Result<Vec<Record>, onceflow_core::BoxError> {
        Ok(vec![Record::new(&self.0, format!("out-{}", text(m)))])
    }
}

/// The engine's transactional pipeline, its commits' answers cut by the fault proxy (the first
/// two of each round): whatever the commit reported (an unknown outcome, settled before work is
/// redone), every input's output is read once, without a dedup store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_whose_commit_answers_are_lost_writes_each_output_once() {
    use onceflow_conformance::fault_proxy::{pulsar_command_type, Action, Direction};
    use onceflow_core::{EngineConfig, Pipeline as EnginePipeline, PipelineConfig};
    let Some(url) = url() else { return };
    let _turn = PROXY_PORT.lock().await;
    let Some((proxy, fault_url)) = fault_proxy().await else {
        return;
    };
    let direct = connect(&url).await;
    let behind = connect(&format!("{fault_url}&operation_timeout_ms=5000")).await;
    const INPUTS: usize = 60;
    for round in 0..3 {
        let input = name("txn-lost-answers-in");
        let output = name("txn-lost-answers-out");
        let group = name("txn-lost-answers");
        let plain = send_inputs(&direct, &input, INPUTS).await;
        proxy.clear();
        let fired = proxy.fired();
        for _ in 0..2 {
            proxy.once(
                Direction::ToClient,
                |f| pulsar_command_type(f) == Some(END_TXN_RESPONSE),
                Action::Cut,
            );
        }
        let p = EnginePipeline::with_config(
            member(&behind, &group, &input).await,
            txn_producer(&behind, "txn-lost-answers").await,
            None,
            std::sync::Arc::new(Out(output.clone())),
            PipelineConfig {
                engine: EngineConfig {
                    commit_interval: Duration::from_millis(100),
                    batch_size: 5 + round * 3,
                    ..Default::default()
                },
                max_transaction_inputs: 10 + round * 7,
                transaction_interval: Duration::from_millis(100),
                ..Default::default()
            },
        )
        .unwrap();
        let m = p.metrics();
        let started = Instant::now();
        // Until every input was processed (some twice, if the pipeline redid work) and two
        // seconds passed without a transaction ending.
        p.run_until(async {
            let mut ended = (0, Instant::now());
            while Instant::now() < started + Duration::from_secs(60) {
                let s = m.snapshot();
                let now = s.transactions_committed + s.transactions_aborted;
                if now != ended.0 {
                    ended = (now, Instant::now());
                }
                if s.processed >= INPUTS as u64 && ended.1.elapsed() > Duration::from_secs(2) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await
        .unwrap();
        eprintln!(
            "round {round}: {:?} after {:?}",
            m.snapshot(),
            started.elapsed()
        );
        assert_eq!(proxy.fired(), fired + 2, "round {round}: two answers cut");
        let read = read_to_end(&direct, &plain, &output).await;
        let mut got = read.clone();
        got.pop();
        got.sort();
        let mut expected: Vec<String> = (0..INPUTS).map(|i| format!("out-in{i}")).collect();
        expected.sort();
        assert_eq!(
            got,
            expected,
            "round {round}: each output once ({:?})",
            m.snapshot()
        );
    }
}

/// A commit whose `END_TXN` is held past the operation timeout (then delivered: the commit lands
/// late) fails with its outcome unknown, and its error says so and names the transaction: it
/// said only "no answer from the Pulsar broker at … within 3000 ms" (h1 break-it, #27). The
/// late commit's outputs are read once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_held_past_the_timeout_says_its_outcome_is_unknown() {
    use onceflow_conformance::fault_proxy::{pulsar_command_type, Action, Direction};
    const END_TXN: i32 = 56;
    let Some(url) = url() else { return };
    let _turn = PROXY_PORT.lock().await;
    let Some((proxy, fault_url)) = fault_proxy().await else {
        return;
    };
    let direct = connect(&url).await;
    let behind = connect(&format!("{fault_url}&operation_timeout_ms=2000")).await;
    let topic = name("txn-held-commit");
    let producer = txn_producer(&behind, "txn-held-commit").await;
    let mut t = producer.begin().await.unwrap();
    t.send(Record::new(&topic, "late")).await.unwrap();
    proxy.once(
        Direction::ToBroker,
        |f| pulsar_command_type(f) == Some(END_TXN),
        Action::Delay(Duration::from_millis(3500)),
    );
    let e = t.commit().await.expect_err("no answer within the timeout");
    assert_eq!(proxy.fired(), 1, "the commit was held");
    assert!(e.outcome_unknown(), "{e}");
    assert!(
        e.to_string()
            .contains("outcome of the commit of Pulsar transaction"),
        "{e}"
    );
    producer.settle_transactions().await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        read_to_end(&direct, &plain(&direct).await, &topic).await,
        vec!["late".to_string(), "end".to_string()]
    );
}

/// A `begin` cancelled while it waits for the coordinator (its future dropped by a timeout)
/// leaves the producer free to begin again; before, the producer said "a transaction open
/// already" for ever (h1 break-it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_begin_leaves_the_producer_free_to_begin() {
    let Some(url) = url() else { return };
    let client = connect(&url).await;
    let producer = txn_producer(&client, "txn-cancelled-begin").await;
    // Warm: the coordinators are known, so the cancelled begin waits on NEW_TXN itself.
    producer.begin().await.unwrap().abort().await.unwrap();
    let cancelled = tokio::time::timeout(Duration::from_micros(1), producer.begin()).await;
    assert!(
        cancelled.is_err(),
        "the begin was cancelled before it ended"
    );
    let mut t = producer.begin().await.unwrap();
    let topic = name("txn-cancelled-begin");
    t.send(Record::new(&topic, "after")).await.unwrap();
    t.commit().await.unwrap();
    assert_eq!(
        read_to_end(&client, &plain(&client).await, &topic).await,
        ["after", "end"]
    );
}
