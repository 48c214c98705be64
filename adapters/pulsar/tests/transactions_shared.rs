//! The transactional pipeline on a **shared** Pulsar subscription, on a real Pulsar standalone
//! (`tests/brokers/up.sh pulsar`), issue #27, with no dedup store: nothing but the
//! transactions keeps an output from being lost or written twice.
//!
//! `a_redelivered_input_polled_ahead_is_not_acknowledged_by_the_commit_before_it`: found by
//! the attack harness (`transactions_attacks.rs`, `H7_SUB=shared H7_FAIL_PCT=5`: inputs lost
//! in 2 of 7 runs). A shared subscription gives out an aborted transaction's inputs again
//! behind newer ones (negative acknowledgements, not a rewind of the partition), and the
//! pipeline polled its next batch while it processed one. A transaction acknowledges, per
//! partition, every message given out up to the highest position it processed; a redelivered
//! input at a lower position in the batch polled ahead was acknowledged with it, unprocessed,
//! and when the transaction that then processed it aborted, the broker never gave it out again
//! (acknowledged): its output was lost.
//!
//! Without the URLs the test is skipped with that reason; `ONCEFLOW_REQUIRE_BROKERS=1` (set by
//! `make test`) makes a missing broker a failure.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use onceflow_core::{
    BoxError, Client, Consumer, ConsumerConfig, EngineConfig, Guarantee, Message, Pipeline,
    PipelineConfig, PipelineMode, Position, Producer, ProducerConfig, Record, StartFrom,
    TopicPartition, TopicSpec, Transform,
};

mod common;
use common::{name, require};

const INPUTS: usize = 10;

/// `v{i}` → `out-v{i}`; `v0` fails its first two calls (each aborts the transaction).
struct FailsV0Twice {
    output: String,
    calls: Mutex<HashMap<String, u32>>,
}

#[async_trait]
impl Transform for FailsV0Twice {
    async fn transform(&self, m: &Message) -> Result<Vec<Record>, BoxError> {
        let payload = String::from_utf8_lossy(&m.payload).into_owned();
        let n = {
            let mut calls = self.calls.lock().unwrap();
            let n = calls.entry(payload.clone()).or_default();
            *n += 1;
            *n
        };
        if payload == "v0" && n <= 2 {
            return Err(format!("v0: failure {n} of 2 (on purpose)").into());
        }
        Ok(vec![Record::new(
            self.output.clone(),
            format!("out-{payload}"),
        )])
    }
}

/// Inputs `v0..v9` on one partition; the pipeline reads 2 at a time and commits every 2
/// inputs. `v0` fails twice: after the first abort the subscription gives out `v0`, `v1` again
/// behind `v2..v9`, so they came in the batch polled ahead while `v8`, `v9` were committed;
/// that commit acknowledged them, and when `v0` failed again they were gone for good (found:
/// `out-v0` and `out-v1` missing, 8 outputs for 10 inputs). Every output must be there once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_input_polled_ahead_is_not_acknowledged_by_the_commit_before_it() {
    let Some(service) = require("ONCEFLOW_PULSAR_URL") else {
        return;
    };
    let Some(admin) = require("ONCEFLOW_PULSAR_ADMIN_URL") else {
        return;
    };
    let url = format!("{service}?admin={admin}&transactions=true&subscription_type=shared");
    let client = Client::new(onceflow_pulsar::connect(&url).await.unwrap());
    let input = name("txs-in");
    let output = name("txs-out");
    let topics = client.admin().await.unwrap();
    topics
        .create_topic(&TopicSpec::new(input.clone(), 1))
        .await
        .unwrap();
    topics
        .create_topic(&TopicSpec::new(output.clone(), 1))
        .await
        .unwrap();
    let plain = client.producer(ProducerConfig::new()).await.unwrap();
    for r in plain
        .send_batch(
            (0..INPUTS)
                .map(|i| Record::new(&input, format!("v{i}")).key(format!("k{i}")))
                .collect(),
        )
        .await
    {
        r.unwrap();
    }
    let group = name("txs-g");
    let consumer = client
        .consumer(
            ConsumerConfig::new(group.clone(), [input.clone()])
                .start(StartFrom::committed_or_earliest()),
        )
        .await
        .unwrap();
    let producer = client
        .producer(ProducerConfig::new().transactional_id(format!("{group}-tx")))
        .await
        .unwrap();
    let transform = Arc::new(FailsV0Twice {
        output: output.clone(),
        calls: Mutex::new(HashMap::new()),
    });
    let config = PipelineConfig {
        engine: EngineConfig {
            batch_size: 2,
            max_attempts: 1,
            poll_timeout: Duration::from_millis(200),
            min_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(50),
            redelivery_delay: Duration::from_millis(10),
            ..EngineConfig::default()
        },
        mode: PipelineMode::Transactional,
        transaction_interval: Duration::from_secs(60),
        max_transaction_inputs: 2,
    };
    let pipeline =
        Pipeline::with_config(consumer.clone(), producer, None, transform.clone(), config).unwrap();
    assert_eq!(pipeline.guarantee(), Guarantee::ExactlyOnce);
    // Until every input is acknowledged (the subscription's backlog is 0), at most 60 s: a
    // lost input ends the run early, with its output missing.
    let watched = consumer.clone();
    let done = async move {
        let started = Instant::now();
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if started.elapsed() > Duration::from_secs(60) {
                return;
            }
            if let Ok(lag) = watched.lag().await {
                if !lag.is_empty() && lag.iter().all(|l| l.messages == 0) {
                    return;
                }
            }
        }
    };
    pipeline.run_until(done).await.unwrap();
    let reader = client
        .consumer(
            ConsumerConfig::new(name("txs-check"), [output.clone()]).start(StartFrom::Earliest),
        )
        .await
        .unwrap();
    let mut seen: HashMap<String, u32> = HashMap::new();
    let started = Instant::now();
    let mut quiet = Instant::now();
    while (seen.len() < INPUTS || quiet.elapsed() < Duration::from_secs(3))
        && started.elapsed() < Duration::from_secs(30)
    {
        let got = reader.poll(100, Duration::from_millis(200)).await.unwrap();
        if !got.is_empty() {
            quiet = Instant::now();
        }
        for m in got {
            *seen
                .entry(String::from_utf8_lossy(&m.payload).into_owned())
                .or_default() += 1;
        }
    }
    reader.close().await.unwrap();
    let mut want: Vec<(String, u32)> = (0..INPUTS).map(|i| (format!("out-v{i}"), 1)).collect();
    want.sort();
    let mut got: Vec<(String, u32)> = seen.into_iter().collect();
    got.sort();
    assert_eq!(got, want, "every input's output once");
    let v0_calls = transform.calls.lock().unwrap().get("v0").copied();
    assert!(
        v0_calls.is_some_and(|n| n >= 3),
        "v0 failed twice and then passed (calls: {v0_calls:?})"
    );
}

/// Polls until `want` messages came or `limit` passed, at most `max` per poll.
async fn poll_n(c: &Consumer, max: usize, want: usize, limit: Duration) -> Vec<Message> {
    let mut got = Vec::new();
    let t0 = Instant::now();
    while got.len() < want && t0.elapsed() < limit {
        got.extend(c.poll(max, Duration::from_millis(200)).await.unwrap());
    }
    got
}

fn payloads(ms: &[Message]) -> Vec<String> {
    ms.iter()
        .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
        .collect()
}

/// How batch E0 is committed in [`stale_copy_scenario`].
#[derive(Clone, Copy, PartialEq)]
enum CommitE0 {
    InATransaction,
    Plainly,
}

/// Commits `pos` of partition 0 of the consumer's topic in a transaction of `producer`.
async fn commit_in_txn(
    producer: &Producer,
    c: &Consumer,
    tp: &TopicPartition,
    pos: Position,
) -> onceflow_core::Result<()> {
    let mut t = producer.begin().await?;
    t.commit_offsets(&c.group_metadata().unwrap(), &[(tp.clone(), pos)])
        .await?;
    t.commit().await
}

/// Batches E0 = v0..v2 and E1 = v3..v5 on one partition, on a key_shared subscription with
/// transactions. E0 is redelivered twice (two negative acknowledgements, the second once the
/// first copy is here), E0 is committed whole (`how`; plainly: v0 in a transaction, then v1,
/// v2 plainly), then the second copy of E0 (asked for
/// before that commit) is polled: the returned messages. Then E1 is committed in a
/// transaction, which acknowledges whatever of that copy was given out too; after a refusal
/// the transaction is aborted, the partition rewound (`rewind_uncommitted`) and what comes
/// again committed, at most 3 rounds. Returns the copy's messages and whether E1 was
/// committed, after checking that nothing is left in the backlog when it was.
async fn stale_copy_scenario(how: CommitE0) -> Option<(Vec<String>, bool)> {
    let service = require("ONCEFLOW_PULSAR_URL")?;
    let admin = require("ONCEFLOW_PULSAR_ADMIN_URL")?;
    let base = format!("{service}?admin={admin}&transactions=true&subscription_type=key_shared");
    let client = Client::new(onceflow_pulsar::connect(&base).await.unwrap());
    let input = name("txk-in");
    client
        .admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(input.clone(), 1))
        .await
        .unwrap();
    let batcher = Client::new(
        onceflow_pulsar::connect(&format!("{base}&batch_size=3&batch_timeout_ms=50"))
            .await
            .unwrap(),
    );
    let p = batcher.producer(ProducerConfig::new()).await.unwrap();
    let records = (0..6)
        .map(|i| Record::new(input.clone(), format!("v{i}")))
        .collect();
    for r in p.send_batch(records).await {
        r.unwrap();
    }
    let c = client
        .consumer(ConsumerConfig::new(name("txk-g"), [input.clone()]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let producer = client
        .producer(ProducerConfig::new().transactional_id(name("txk-tx")))
        .await
        .unwrap();
    let tp = TopicPartition::new(input.clone(), 0);
    let first = poll_n(&c, 6, 6, Duration::from_secs(20)).await;
    assert_eq!(payloads(&first), ["v0", "v1", "v2", "v3", "v4", "v5"]);
    let entry = |m: &Message| match &m.position {
        Position::MessageId { ledger, entry, .. } => (*ledger, *entry),
        other => panic!("not a Pulsar position: {other:?}"),
    };
    assert_eq!(entry(&first[0]), entry(&first[2]), "v0..v2 one batch");
    assert_ne!(entry(&first[0]), entry(&first[3]), "two batches");
    if how == CommitE0::Plainly {
        // v0 in a transaction first: the broker's pending-ack handle of the subscription keeps
        // its positions from its first transactional acknowledgement on (before that, the
        // refusal below takes nothing out of the consumer's pending acknowledgements).
        commit_in_txn(&producer, &c, &tp, first[0].position.clone())
            .await
            .unwrap();
    }
    // v2's negative acknowledgement redelivers E0; once that copy is here (and E0 pending on
    // this consumer again), v1's redelivers it once more.
    c.nack(&first[2], Duration::ZERO).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    c.nack(&first[1], Duration::ZERO).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // The first copy gives out v1, v2 again (v0 is held still, or committed).
    let again = poll_n(&c, 2, 2, Duration::from_secs(10)).await;
    assert_eq!(payloads(&again), ["v1", "v2"]);
    match how {
        CommitE0::InATransaction => commit_in_txn(&producer, &c, &tp, again[1].position.clone())
            .await
            .unwrap(),
        CommitE0::Plainly => {
            c.commit(&[(tp.clone(), again[1].position.clone())])
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    let stale = poll_n(&c, 10, 1, Duration::from_secs(3)).await;
    let mut e1 = first[3..].to_vec();
    let mut committed = false;
    for _ in 0..3 {
        match commit_in_txn(&producer, &c, &tp, e1.last().unwrap().position.clone()).await {
            Ok(()) => {
                committed = true;
                break;
            }
            Err(e) => {
                eprintln!("the commit of E1 failed: {e}");
                c.rewind_uncommitted(std::slice::from_ref(&tp))
                    .await
                    .unwrap();
                e1 = poll_n(&c, 10, 3, Duration::from_secs(10)).await;
                eprintln!("given out again after the abort: {:?}", payloads(&e1));
                if e1.is_empty() {
                    break;
                }
            }
        }
    }
    if committed {
        let t0 = Instant::now();
        loop {
            let lag = c.lag().await.unwrap();
            if lag.iter().all(|l| l.messages == 0) {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "backlog left: {lag:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    c.close().await.unwrap();
    Some((payloads(&stale), committed))
}

/// #27 (h7 break-it: key_shared, batched inputs, a failing transform and killed members; ~1
/// run in 4 stalled, a batch left unacknowledged after its redelivery was asked for). The
/// refusal that started it: a batch this member had completed in a committed transaction came
/// again (a copy from a redelivery asked for before the commit; its messages were known as
/// settled only while the batch was incomplete) and was given out again, processed twice, and
/// acknowledged by the next transaction, which the broker refused ("already acked before").
/// Found: `["v0", "v1", "v2"]` given out again (and the stall below). Now the copy is dropped
/// and E1 is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_committed_in_a_transaction_is_not_given_out_again() {
    let Some((stale, committed)) = stale_copy_scenario(CommitE0::InATransaction).await else {
        return;
    };
    assert_eq!(stale, Vec::<String>::new(), "E0's copy given out again");
    assert!(committed, "E1 not committed");
}

/// #27, the stall itself. Pulsar (4.2) takes every message id of a transactional `ACK`
/// command out of the consumer's pending acknowledgements also when it refuses the command
/// (`Consumer.individualAckWithTransaction`: `checkIsCanDeleteConsumerPendingAck` is true for
/// a position no transaction holds), none of them acknowledged, and then ignores their
/// `REDELIVER_UNACKNOWLEDGED_MESSAGES` (it redelivers only what is pending on the consumer):
/// a batch acknowledged in the same command as a refused one never came again while the
/// member stayed. Here E0 is committed plainly (a plain commit is at-least-once: its copy may
/// be given out again), so E1's transaction acknowledges E0's copy too and is refused.
/// Found: after the abort and the rewind nothing came again (E1 stranded: `[]`). Now each message id goes in its own `ACK`: E1's are accepted, the abort
/// redelivers them, and the next transaction commits them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_transactional_acknowledgement_strands_no_other_batch() {
    let Some((stale, committed)) = stale_copy_scenario(CommitE0::Plainly).await else {
        return;
    };
    assert!(!stale.is_empty(), "the scenario: E0's copy given out again");
    assert!(
        committed,
        "E1 was never given out again after its transaction aborted"
    );
}
