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
    BoxError, Client, ConsumerConfig, EngineConfig, Guarantee, Message, Pipeline, PipelineConfig,
    PipelineMode, ProducerConfig, Record, StartFrom, TopicSpec, Transform,
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
