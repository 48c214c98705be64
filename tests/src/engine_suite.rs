//! The engine conformance suite: the idempotent consumer and the pipeline, run over a platform
//! backend through the same [`Harness`] as the backend suite, so the engine's guarantees are
//! proven on every platform, not only in process. [`engine_suite!`](crate::engine_suite!)
//! expands to one test per case, run by [`run_on_runtime`](crate::backend_suite::run_on_runtime).
//!
//! Cases: `idempotent_consumer_skips_duplicates`, `failing_handler_is_retried_not_lost`,
//! `exhausted_retries_redeliver_in_order`, `dead_letter_after_retries`,
//! `conflicting_payload_is_an_error`, `malformed_traceparent_does_not_stop_consumption`,
//! `trace_context_continues_into_handler`, `pipeline_outputs_each_input_once`,
//! `pipeline_restart_after_crash`, `member_joining_mid_stream_loses_and_repeats_nothing`,
//! `shutdown_drains_and_commits`, `keyless_messages_write_no_dedup_record_and_are_counted`,
//! `require_key_dead_letters_a_keyless_message`,
//! `conflicting_payload_does_not_stop_consumer_or_pipeline`, `requeued_job_runs_once_more`,
//! `requeued_input_is_transformed_once_more`,
//! `a_transaction_due_mid_batch_commits_there`,
//! `rewind_uncommitted_refuses_partitions_it_does_not_read`,
//! `closed_producer_refuses_sends_and_transactions`.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use onceflow_core::dedup::{ClaimOutcome, MemoryStore};
use onceflow_core::{
    BoxError, Client, ConsumerConfig, DedupStore, DedupStoreExt, EngineConfig, Error, ErrorKind,
    Guarantee, Handler, IdempotentConsumer, Message, Metrics, OnFailure, Pipeline, PipelineConfig,
    Position, ProducerConfig, Record, Result, StartFrom, Transform,
};
use opentelemetry::trace::TraceContextExt;
use tokio::time::Instant;

use crate::backend_suite::{CaseResult, Outcome};
use crate::harness::Harness;

/// Expands to one `#[test]` per engine case, each on its own runtime through
/// [`run_on_runtime`](crate::backend_suite::run_on_runtime).
#[macro_export]
macro_rules! engine_suite {
    ($harness:expr) => {
        $crate::engine_suite!(@cases ($harness)
            idempotent_consumer_skips_duplicates,
            failing_handler_is_retried_not_lost,
            failing_batch_handler_is_retried_not_lost,
            exhausted_retries_redeliver_in_order,
            dead_letter_after_retries,
            conflicting_payload_is_an_error,
            malformed_traceparent_does_not_stop_consumption,
            trace_context_continues_into_handler,
            pipeline_outputs_each_input_once,
            pipeline_restart_after_crash,
            pipeline_redoes_inputs_completed_by_an_uncommitted_transaction,
            member_joining_mid_stream_loses_and_repeats_nothing,
            shutdown_drains_and_commits,
            keyless_messages_write_no_dedup_record_and_are_counted,
            require_key_dead_letters_a_keyless_message,
            conflicting_payload_does_not_stop_consumer_or_pipeline,
            requeued_job_runs_once_more,
            requeued_input_is_transformed_once_more,
            a_failing_input_costs_only_its_own_redelivery,
            a_stopped_pipeline_leaves_no_claim_of_its_batch_behind,
            a_transaction_due_mid_batch_commits_there,
            rewind_uncommitted_refuses_partitions_it_does_not_read,
            closed_producer_refuses_sends_and_transactions,
        );
    };
    (@cases ($harness:expr) $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                $crate::backend_suite::run_on_runtime(concat!("engine::", stringify!($case)), async {
                    let harness = $harness;
                    $crate::backend_suite::run_case(
                        &harness,
                        concat!("engine::", stringify!($case)),
                        $crate::engine_suite::$case(&harness),
                    )
                    .await;
                });
            }
        )*
    };
}

fn store() -> Arc<dyn DedupStore> {
    Arc::new(MemoryStore::new(Duration::from_secs(600), 100_000))
}

fn fast_engine(h: &dyn Harness) -> EngineConfig {
    EngineConfig {
        min_backoff: Duration::from_millis(5),
        max_backoff: Duration::from_millis(50),
        redelivery_delay: Duration::from_millis(10),
        commit_interval: Duration::from_millis(50),
        poll_timeout: h.timings().poll,
        lease: Duration::from_secs(10),
        ..EngineConfig::default()
    }
}

/// An input record whose idempotency key travels only in the `idempotency-key` header, so a
/// platform that deduplicates by message id (JetStream `Nats-Msg-Id`) still delivers the
/// duplicates the cases send on purpose, and the engine has to catch them.
fn record(topic: &str, key: &str, payload: &str) -> Record {
    Record::new(topic.to_string(), payload.as_bytes().to_vec())
        .key(key.as_bytes().to_vec())
        .header(
            onceflow_core::IDEMPOTENCY_KEY_HEADER,
            key.as_bytes().to_vec(),
        )
}

/// `n` records `k0..k{n-1}` with payloads `v0..v{n-1}`, each keyed by its idempotency key.
fn keyed_v(topic: &str, n: usize) -> Vec<Record> {
    (0..n)
        .map(|i| record(topic, &format!("k{i}"), &format!("v{i}")))
        .collect()
}

/// `n` records `k0..k{n-1}` with payload `x`, each keyed by its idempotency key.
fn keyed(topic: &str, n: usize) -> Vec<Record> {
    (0..n)
        .map(|i| record(topic, &format!("k{i}"), "x"))
        .collect()
}

async fn produce(client: &Client, records: Vec<Record>) -> Result<()> {
    let p = client.producer(ProducerConfig::new()).await?;
    for r in p.send_batch(records).await {
        r?;
    }
    p.flush(Duration::from_secs(30)).await
}

fn consumer_config(h: &dyn Harness, group: &str, topic: &str) -> ConsumerConfig {
    ConsumerConfig::new(group.to_string(), [topic.to_string()])
        .start(StartFrom::committed_or_earliest())
        .session_timeout(h.timings().session_timeout)
}

/// Resolves when `done()` holds, or after the harness's wait (then the case's own assertions
/// report what is missing).
fn until(h: &dyn Harness, done: impl Fn() -> bool + Send + 'static) -> impl Future<Output = ()> {
    let deadline = Instant::now() + h.timings().wait;
    async move {
        while !done() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Reads every message of `topic` with a fresh group from the earliest position, until `n`
/// arrived and then for the quiet period (to catch duplicates).
async fn read_all(h: &dyn Harness, client: &Client, topic: &str, n: usize) -> Result<Vec<Message>> {
    let c = client
        .consumer(ConsumerConfig::new(h.group(), [topic.to_string()]).start(StartFrom::Earliest))
        .await?;
    let mut out = Vec::new();
    let deadline = Instant::now() + h.timings().wait;
    while out.len() < n && Instant::now() < deadline {
        out.extend(c.poll(500, h.timings().poll).await?);
    }
    let quiet = Instant::now() + h.timings().quiet;
    while Instant::now() < quiet {
        out.extend(c.poll(500, h.timings().poll).await?);
    }
    c.close().await?;
    Ok(out)
}

/// Asserts that a new member of `group` finds nothing left to read (everything committed).
async fn nothing_left(h: &dyn Harness, client: &Client, group: &str, topic: &str) -> Result<()> {
    let c = client.consumer(consumer_config(h, group, topic)).await?;
    let quiet = Instant::now() + h.timings().quiet.max(h.timings().poll * 4);
    let mut left = Vec::new();
    while Instant::now() < quiet {
        left.extend(c.poll(500, h.timings().poll).await?);
    }
    c.close().await?;
    check(
        left.is_empty(),
        format!(
            "group '{group}' should have committed everything, but a new member read {} message(s) at {:?}",
            left.len(),
            left.iter().map(|m| m.position.to_string()).collect::<Vec<_>>()
        ),
    )
}

fn check(cond: bool, what: impl Into<String>) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(Error::new(ErrorKind::Platform, what.into()))
    }
}

/// Counts successful handler runs per idempotency key; fails per a rule first.
#[derive(Default)]
struct Counting {
    runs: Mutex<HashMap<String, u32>>,
    order: Mutex<Vec<String>>,
    attempts: Mutex<HashMap<String, u32>>,
    /// Fail a key this many times before succeeding.
    fail_times: HashMap<String, u32>,
    /// Keys that always fail.
    always_fail: Vec<String>,
    trace_ids: Mutex<Vec<String>>,
}

impl Counting {
    fn key(m: &Message) -> String {
        m.headers
            .get_str(onceflow_core::IDEMPOTENCY_KEY_HEADER)
            .unwrap_or("")
            .to_string()
    }
    fn distinct(&self) -> usize {
        self.runs.lock().unwrap().len()
    }
}

#[async_trait]
impl Handler for Counting {
    async fn handle(&self, m: &Message) -> std::result::Result<Option<Bytes>, BoxError> {
        let key = Counting::key(m);
        let attempt = {
            let mut a = self.attempts.lock().unwrap();
            let e = a.entry(key.clone()).or_default();
            *e += 1;
            *e
        };
        let tid = opentelemetry::Context::current()
            .span()
            .span_context()
            .trace_id()
            .to_string();
        self.trace_ids.lock().unwrap().push(tid);
        if self.always_fail.contains(&key) {
            return Err(format!("{key} always fails").into());
        }
        if attempt <= *self.fail_times.get(&key).unwrap_or(&0) {
            return Err(format!("{key} fails on attempt {attempt}").into());
        }
        *self.runs.lock().unwrap().entry(key.clone()).or_default() += 1;
        self.order.lock().unwrap().push(key);
        Ok(None)
    }
}

struct Shared(Arc<Counting>);

#[async_trait]
impl Handler for Shared {
    async fn handle(&self, m: &Message) -> std::result::Result<Option<Bytes>, BoxError> {
        self.0.handle(m).await
    }
}

/// [`Counting`] as a batch handler: one call per run of messages, failing as a whole while
/// any of its keys has failures left (before running any of them).
struct Batched(Arc<Counting>, Mutex<u32>);

#[async_trait]
impl Handler for Batched {
    async fn handle(&self, m: &Message) -> std::result::Result<Option<Bytes>, BoxError> {
        self.0.handle(m).await
    }

    fn batched(&self) -> bool {
        true
    }

    async fn handle_batch(
        &self,
        ms: &[Message],
    ) -> std::result::Result<Vec<Option<Bytes>>, BoxError> {
        *self.1.lock().unwrap() += 1;
        let c = &self.0;
        let mut failing = None;
        for m in ms {
            let key = Counting::key(m);
            let mut a = c.attempts.lock().unwrap();
            let e = a.entry(key.clone()).or_default();
            *e += 1;
            if *e <= *c.fail_times.get(&key).unwrap_or(&0) {
                failing = Some(key);
            }
        }
        if let Some(key) = failing {
            return Err(format!("batch with {key} fails").into());
        }
        for m in ms {
            let key = Counting::key(m);
            *c.runs.lock().unwrap().entry(key.clone()).or_default() += 1;
            c.order.lock().unwrap().push(key);
        }
        Ok(vec![None; ms.len()])
    }
}

#[allow(clippy::too_many_arguments)] // test plumbing: each case varies a different one
async fn run_consumer(
    h: &dyn Harness,
    client: &Client,
    group: &str,
    topic: &str,
    handler: Arc<Counting>,
    config: EngineConfig,
    dlq: bool,
    done: impl Fn(&Counting, &Metrics) -> bool + Send + Sync + 'static,
) -> Result<(Metrics, Result<onceflow_core::RunSummary>)> {
    let consumer = client.consumer(consumer_config(h, group, topic)).await?;
    let producer = if dlq {
        Some(client.producer(ProducerConfig::new()).await?)
    } else {
        None
    };
    let ic = IdempotentConsumer::with_config(
        consumer,
        Some(store()),
        Arc::new(Shared(handler.clone())),
        config,
        producer,
    )?;
    let metrics = ic.metrics();
    let m2 = metrics.clone();
    let summary = ic.run_until(until(h, move || done(&handler, &m2))).await;
    Ok((metrics, summary))
}

/// Every key's handler runs once although each key is delivered twice; the duplicates are
/// counted; everything is committed.
pub async fn idempotent_consumer_skips_duplicates(h: &dyn Harness) -> CaseResult {
    let client = Client::new(h.platform());
    let topic = h.topic(3).await?;
    let mut recs: Vec<Record> = (0..30)
        .map(|i| record(&topic, &format!("k{i}"), &format!("v{i}")))
        .collect();
    recs.extend((0..30).map(|i| record(&topic, &format!("k{i}"), &format!("v{i}"))));
    produce(&client, recs).await?;
    let group = h.group();
    let handler = Arc::new(Counting::default());
    let (metrics, summary) = run_consumer(
        h,
        &client,
        &group,
        &topic,
        handler.clone(),
        fast_engine(h),
        false,
        |c, m| c.distinct() == 30 && m.snapshot().duplicates_skipped >= 30,
    )
    .await?;
    let summary = summary?;
    let runs = handler.runs.lock().unwrap().clone();
    check(
        runs.len() == 30,
        format!("30 keys handled, got {}", runs.len()),
    )?;
    check(
        runs.values().all(|n| *n == 1),
        format!("each key once, got {runs:?}"),
    )?;
    let s = metrics.snapshot();
    check(
        s.duplicates_skipped == 30,
        format!("30 duplicates skipped, got {}", s.duplicates_skipped),
    )?;
    check(
        summary.guarantee == Guarantee::EffectivelyOnce,
        "a dedup store gives effectively-once",
    )?;
    nothing_left(h, &client, &group, &topic).await?;
    Ok(Outcome::Passed)
}

/// A handler failing twice for some keys is retried with backoff; each key succeeds once.
pub async fn failing_handler_is_retried_not_lost(h: &dyn Harness) -> CaseResult {
    let client = Client::new(h.platform());
    let topic = h.topic(2).await?;
    produce(&client, keyed(&topic, 20)).await?;
    let handler = Arc::new(Counting {
        fail_times: (0..20).step_by(5).map(|i| (format!("k{i}"), 2)).collect(),
        ..Default::default()
    });
    let group = h.group();
    let (metrics, summary) = run_consumer(
        h,
        &client,
        &group,
        &topic,
        handler.clone(),
        fast_engine(h),
        false,
        |c, _| c.distinct() == 20,
    )
    .await?;
    summary?;
    let runs = handler.runs.lock().unwrap().clone();
    check(
        runs.len() == 20 && runs.values().all(|n| *n == 1),
        format!("each of 20 keys once, got {runs:?}"),
    )?;
    let s = metrics.snapshot();
    check(
        s.retries == 8 && s.handler_errors == 8,
        format!("8 retries after 8 errors, got {s:?}"),
    )?;
    nothing_left(h, &client, &group, &topic).await?;
    Ok(Outcome::Passed)
}

/// A batch handler (one call per run of claimed messages) failing twice for batches holding
/// some keys is retried as a whole; each key succeeds once, in partition order, and everything
/// is committed.
pub async fn failing_batch_handler_is_retried_not_lost(h: &dyn Harness) -> CaseResult {
    let client = Client::new(h.platform());
    let topic = h.topic(2).await?;
    produce(&client, keyed(&topic, 20)).await?;
    let counting = Arc::new(Counting {
        fail_times: (0..20).step_by(5).map(|i| (format!("k{i}"), 2)).collect(),
        ..Default::default()
    });
    let handler = Arc::new(Batched(counting.clone(), Mutex::new(0)));
    let consumer = client
        .consumer(consumer_config(h, &h.group(), &topic))
        .await?;
    let group = consumer.group().to_string();
    let ic = IdempotentConsumer::with_config(
        consumer,
        Some(store()),
        handler.clone(),
        fast_engine(h),
        None,
    )?;
    let metrics = ic.metrics();
    let c2 = counting.clone();
    ic.run_until(until(h, move || c2.distinct() == 20)).await?;
    let runs = counting.runs.lock().unwrap().clone();
    check(
        runs.len() == 20 && runs.values().all(|n| *n == 1),
        format!("each of 20 keys once, got {runs:?}"),
    )?;
    let calls = *handler.1.lock().unwrap();
    let s = metrics.snapshot();
    check(
        s.handler_errors >= 2 && s.retries == s.handler_errors && s.processed == 20,
        format!("whole batches retried, 20 processed, got {s:?}"),
    )?;
    check(
        (calls as u64) <= 20 + s.handler_errors,
        format!("one call per batch, not per message: {calls} calls"),
    )?;
    nothing_left(h, &client, &group, &topic).await?;
    Ok(Outcome::Passed)
}

/// With one attempt per delivery, a failing message is handed back to the platform and runs
/// again on redelivery; nothing is lost, and without per-message nack the partition's order is
/// kept (later messages run after it).
pub async fn exhausted_retries_redeliver_in_order(h: &dyn Harness) -> CaseResult {
    let client = Client::new(h.platform());
    let topic = h.topic(1).await?;
    let keys: Vec<String> = (0..8).map(|i| format!("k{i}")).collect();
    produce(
        &client,
        keys.iter().map(|k| record(&topic, k, "x")).collect(),
    )
    .await?;
    let handler = Arc::new(Counting {
        fail_times: [("k3".to_string(), 2)].into_iter().collect(),
        ..Default::default()
    });
    let cfg = EngineConfig {
        max_attempts: 1,
        on_failure: OnFailure::Redeliver,
        ..fast_engine(h)
    };
    let group = h.group();
    let (metrics, summary) = run_consumer(
        h,
        &client,
        &group,
        &topic,
        handler.clone(),
        cfg,
        false,
        |c, _| c.distinct() == 8,
    )
    .await?;
    summary?;
    let runs = handler.runs.lock().unwrap().clone();
    check(
        runs.len() == 8 && runs.values().all(|n| *n == 1),
        format!("each of 8 keys once, got {runs:?}"),
    )?;
    check(
        metrics.snapshot().redelivery_requests == 2,
        format!("2 redeliveries asked, got {:?}", metrics.snapshot()),
    )?;
    if !client.capabilities().per_message_nack {
        let order = handler.order.lock().unwrap().clone();
        check(order == keys, format!("partition order kept: {order:?}"))?;
    }
    nothing_left(h, &client, &group, &topic).await?;
    Ok(Outcome::Passed)
}

/// A message that fails every attempt goes to the dead-letter topic with the error in headers;
/// the others are handled and the group moves past it.
pub async fn dead_letter_after_retries(h: &dyn Harness) -> CaseResult {
    let client = Client::new(h.platform());
    let topic = h.topic(1).await?;
    let dlq = h.topic(1).await?;
    produce(
        &client,
        (0..5)
            .map(|i| record(&topic, &format!("k{i}"), &format!("payload-{i}")))
            .collect(),
    )
    .await?;
    let handler = Arc::new(Counting {
        always_fail: vec!["k2".to_string()],
        ..Default::default()
    });
    let cfg = EngineConfig {
        max_attempts: 3,
        on_failure: OnFailure::DeadLetter(dlq.clone()),
        ..fast_engine(h)
    };
    let group = h.group();
    let (metrics, summary) = run_consumer(
        h,
        &client,
        &group,
        &topic,
        handler.clone(),
        cfg,
        true,
        |c, m| c.distinct() == 4 && m.snapshot().dead_lettered == 1,
    )
    .await?;
    summary?;
    check(handler.distinct() == 4, "the four good keys handled")?;
    check(
        metrics.snapshot().dead_lettered == 1,
        format!("one dead letter, got {:?}", metrics.snapshot()),
    )?;
    let dead = read_all(h, &client, &dlq, 1).await?;
    check(
        dead.len() == 1,
        format!("one record in the dead-letter topic, got {}", dead.len()),
    )?;
    let d = &dead[0];
    check(
        d.payload.as_ref() == b"payload-2",
        "dead letter keeps the payload",
    )?;
    check(
        d.headers.get_str("onceflow-error-kind") == Some("ONCEFLOW_HANDLER"),
        format!("error kind header, got {:?}", d.headers),
    )?;
    check(
        d.headers.get_str("onceflow-attempts") == Some("3"),
        "attempts header",
    )?;
    check(
        d.headers.get_str("onceflow-source-topic") == Some(topic.as_str()),
        "source topic header",
    )?;
    nothing_left(h, &client, &group, &topic).await?;
    Ok(Outcome::Passed)
}

/// The same idempotency key with another payload is an error of its own kind, not a skip.
pub async fn conflicting_payload_is_an_error(h: &dyn Harness) -> CaseResult {
    let client = Client::new(h.platform());
    let topic = h.topic(1).await?;
    produce(
        &client,
        vec![record(&topic, "k", "first"), record(&topic, "k", "second")],
    )
    .await?;
    let handler = Arc::new(Counting::default());
    let cfg = EngineConfig {
        on_failure: OnFailure::Stop,
        ..fast_engine(h)
    };
    let (_, summary) = run_consumer(
        h,
        &client,
        &h.group(),
        &topic,
        handler.clone(),
        cfg,
        false,
        |_, _| false,
    )
    .await?;
    match summary {
        Err(e) if e.kind() == ErrorKind::Conflict => {}
        other => {
            return Err(Error::new(
                ErrorKind::Platform,
                format!("expected a Conflict error, got {other:?}"),
            ))
        }
    }
    check(handler.distinct() == 1, "the first payload was handled")?;
    Ok(Outcome::Passed)
}

/// A malformed `traceparent` is ignored and counted; the message is handled.
pub async fn malformed_traceparent_does_not_stop_consumption(h: &dyn Harness) -> CaseResult {
    let client = Client::new(h.platform());
    let topic = h.topic(1).await?;
    // Sent through the backend directly: the public producer replaces trace headers.
    let producer = h.platform().producer(ProducerConfig::new()).await?;
    let mut r = record(&topic, "k0", "x");
    r.headers
        .insert(onceflow_core::IDEMPOTENCY_KEY_HEADER, "k0");
    r.headers.insert("traceparent", "00-not-a-trace-01");
    producer.send(r).await?;
    producer.flush(Duration::from_secs(10)).await?;
    let before = onceflow_core::trace::malformed_traceparents();
    let handler = Arc::new(Counting::default());
    let (_, summary) = run_consumer(
        h,
        &client,
        &h.group(),
        &topic,
        handler.clone(),
        fast_engine(h),
        false,
        |c, _| c.distinct() == 1,
    )
    .await?;
    summary?;
    check(handler.distinct() == 1, "the message was handled")?;
    check(
        onceflow_core::trace::malformed_traceparents() > before,
        "the malformed header was counted",
    )?;
    Ok(Outcome::Passed)
}

/// A `traceparent` sent with a message is the trace the handler runs in.
pub async fn trace_context_continues_into_handler(h: &dyn Harness) -> CaseResult {
    let client = Client::new(h.platform());
    let topic = h.topic(1).await?;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let r = record(&topic, "k0", "x").header(
        "traceparent",
        format!("00-{trace_id}-00f067aa0ba902b7-01").into_bytes(),
    );
    produce(&client, vec![r]).await?;
    let handler = Arc::new(Counting::default());
    let (_, summary) = run_consumer(
        h,
        &client,
        &h.group(),
        &topic,
        handler.clone(),
        fast_engine(h),
        false,
        |c, _| c.distinct() == 1,
    )
    .await?;
    summary?;
    let seen = handler.trace_ids.lock().unwrap().clone();
    check(
        seen == vec![trace_id.to_string()],
        format!("handler ran in trace {trace_id}, saw {seen:?}"),
    )?;
    Ok(Outcome::Passed)
}

/// Turns `order-N` into one output record.
struct Echo {
    out: String,
    calls: Arc<AtomicU64>,
    crash_after: Option<(u64, Arc<tokio::sync::Notify>)>,
}

#[async_trait]
impl Transform for Echo {
    async fn transform(&self, m: &Message) -> std::result::Result<Vec<Record>, BoxError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some((at, notify)) = &self.crash_after {
            if n == *at {
                notify.notify_one();
                // Stall so the crash lands with this transaction open.
                tokio::time::sleep(Duration::from_secs(3600)).await;
            }
        }
        Ok(vec![Record::new(self.out.clone(), m.payload.clone())])
    }
}

#[allow(clippy::too_many_arguments)] // test plumbing: each case varies a different one
async fn run_pipeline(
    h: &dyn Harness,
    client: &Client,
    group: &str,
    tx_id: &str,
    input: &str,
    output: &str,
    store: Arc<dyn DedupStore>,
    crash_after: Option<u64>,
    expected_inputs: usize,
) -> Result<(Guarantee, bool, Metrics)> {
    let crash = Arc::new(tokio::sync::Notify::new());
    let echo = Echo {
        out: output.to_string(),
        calls: Arc::new(AtomicU64::new(0)),
        crash_after: crash_after.map(|n| (n, crash.clone())),
    };
    let config = PipelineConfig {
        engine: EngineConfig {
            worker_id: format!("{group}-worker"),
            ..fast_engine(h)
        },
        transaction_interval: Duration::from_millis(50),
        ..PipelineConfig::default()
    };
    let (guarantee, crashed, metrics) = tokio::select! {
        r = run_pipeline_with(h, client, group, tx_id, input, store, Arc::new(echo), config, expected_inputs) => {
            let (guarantee, metrics) = r?;
            (guarantee, false, metrics)
        }
        // Dropped mid-transaction, as a crash would: its guarantee and counters are not read.
        _ = crash.notified() => (Guarantee::AtLeastOnce, true, Metrics::new("crashed", group)),
    };
    Ok((guarantee, crashed, metrics))
}

/// Runs a pipeline of `transform` from `input` with `config` until it has handled at least
/// `expected_inputs` and the group has committed up to the end of every partition (or the
/// harness's wait is over); its guarantee and metrics.
#[allow(clippy::too_many_arguments)] // test plumbing
async fn run_pipeline_with(
    h: &dyn Harness,
    client: &Client,
    group: &str,
    tx_id: &str,
    input: &str,
    store: Arc<dyn DedupStore>,
    transform: Arc<dyn Transform>,
    config: PipelineConfig,
    expected_inputs: usize,
) -> Result<(Guarantee, Metrics)> {
    let consumer = consumer_config(h, group, input);
    run_pipeline_on(
        h,
        client,
        consumer,
        tx_id,
        input,
        store,
        transform,
        config,
        expected_inputs,
    )
    .await
}

/// [`run_pipeline_with`] with the consumer's configuration given.
#[allow(clippy::too_many_arguments)]
async fn run_pipeline_on(
    h: &dyn Harness,
    client: &Client,
    consumer: ConsumerConfig,
    tx_id: &str,
    input: &str,
    store: Arc<dyn DedupStore>,
    transform: Arc<dyn Transform>,
    config: PipelineConfig,
    expected_inputs: usize,
) -> Result<(Guarantee, Metrics)> {
    let consumer = client.consumer(consumer).await?;
    let producer = client
        .producer(ProducerConfig::new().transactional_id(tx_id.to_string()))
        .await?;
    let pipeline =
        Pipeline::with_config(consumer.clone(), producer, Some(store), transform, config)?;
    let guarantee = pipeline.guarantee();
    let metrics = pipeline.metrics();
    let m2 = metrics.clone();
    // Done when this run handled at least `expected_inputs` and the group has committed up to
    // the end of every partition.
    let deadline = Instant::now() + h.timings().wait;
    let partitions = client
        .admin()
        .await?
        .describe_topic(input)
        .await?
        .partitions as usize;
    let done = async move {
        while Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let s = m2.snapshot();
            if ((s.processed + s.duplicates_skipped) as usize) < expected_inputs
                || consumer.assignment().len() < partitions
            {
                continue;
            }
            if let Ok(lag) = consumer.lag().await {
                if lag.len() >= partitions && lag.iter().all(|l| l.messages == 0) {
                    return;
                }
            }
        }
    };
    pipeline.run_until(done).await?;
    Ok((guarantee, metrics))
}

/// A pipeline writes one output per distinct input, even with duplicate sends of inputs, and
/// reports exactly-once where the platform has transactions.
pub async fn pipeline_outputs_each_input_once(h: &dyn Harness) -> CaseResult {
    let client = Client::new(h.platform());
    let input = h.topic(2).await?;
    let output = h.topic(2).await?;
    let mut recs = keyed_v(&input, 40);
    recs.extend(keyed_v(&input, 10));
    produce(&client, recs).await?;
    let (guarantee, _, metrics) = run_pipeline(
        h,
        &client,
        &h.group(),
        &h.transactional_id(),
        &input,
        &output,
        store(),
        None,
        50,
    )
    .await?;
    let expected = if client.capabilities().transactions {
        Guarantee::ExactlyOnce
    } else if client.capabilities().dedup_by_id {
        Guarantee::EffectivelyOnce
    } else {
        Guarantee::AtLeastOnce
    };
    check(
        guarantee == expected,
        format!("guarantee {guarantee}, expected {expected}"),
    )?;
    let out = read_all(h, &client, &output, 40).await?;
    let mut payloads: Vec<String> = out
        .iter()
        .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
        .collect();
    payloads.sort();
    let mut want: Vec<String> = (0..40).map(|i| format!("v{i}")).collect();
    want.sort();
    check(
        payloads == want,
        format!(
            "40 outputs once each, got {} ({:?})",
            payloads.len(),
            metrics.snapshot()
        ),
    )?;
    // Every mode counts what it wrote (one output per processed input here); an aborted
    // transaction's outputs may be counted again when its inputs are re-read.
    let s = metrics.snapshot();
    check(
        s.produced >= 40 && s.produced >= s.processed,
        format!("produced counts the outputs: {s:?}"),
    )?;
    Ok(Outcome::Passed)
}

/// A pipeline dropped mid-transaction (as a crash would) and restarted with the same
/// transactional id and worker id leaves every input in the output exactly once.
pub async fn pipeline_restart_after_crash(h: &dyn Harness) -> CaseResult {
    let client = Client::new(h.platform());
    if !client.capabilities().transactions && !client.capabilities().dedup_by_id {
        return Ok(Outcome::Skipped(
            "neither transactions nor platform dedup by id: outputs may repeat after a crash (readers deduplicate)".into(),
        ));
    }
    let input = h.topic(2).await?;
    let output = h.topic(2).await?;
    produce(&client, keyed_v(&input, 60)).await?;
    let group = h.group();
    let tx_id = h.transactional_id();
    let store = store();
    let (_, crashed, _) = run_pipeline(
        h,
        &client,
        &group,
        &tx_id,
        &input,
        &output,
        store.clone(),
        Some(25),
        60,
    )
    .await?;
    check(crashed, "the first run crashed as planned")?;
    let (_, crashed, metrics) =
        run_pipeline(h, &client, &group, &tx_id, &input, &output, store, None, 1).await?;
    check(!crashed, "the second run finished")?;
    let out = read_all(h, &client, &output, 60).await?;
    let mut counts: HashMap<String, u32> = HashMap::new();
    for m in &out {
        *counts
            .entry(String::from_utf8_lossy(&m.payload).into_owned())
            .or_default() += 1;
    }
    check(
        counts.len() == 60 && counts.values().all(|c| *c == 1),
        format!(
            "60 outputs once each, got {} distinct of {} ({:?})",
            counts.len(),
            out.len(),
            metrics.snapshot()
        ),
    )?;
    Ok(Outcome::Passed)
}

/// A transactional pipeline completes its keys in the dedup store just before the transaction
/// commits, each naming the input that claimed it. A crash between the two leaves a key
/// completed although its outputs were never committed: that input is not a duplicate and is
/// processed; a later duplicate send of it, once its origin is committed, is skipped. A key
/// completed by someone else (no origin of this group), naming another input as its origin, or
/// by a transaction whose commit marker is in the store (offsets reset since), stays a
/// duplicate.
pub async fn pipeline_redoes_inputs_completed_by_an_uncommitted_transaction(
    h: &dyn Harness,
) -> CaseResult {
    let client = Client::new(h.platform());
    if !client.capabilities().transactions {
        return Ok(Outcome::Skipped(
            "no transactions: keys are completed after the outputs are acknowledged".into(),
        ));
    }
    let input = h.topic(1).await?;
    let output = h.topic(1).await?;
    let group = h.group();
    // The inputs' positions, which the seeded origins name (offsets on Kafka, message ids on
    // Pulsar).
    let positions: Vec<Position> = {
        let p = client.producer(ProducerConfig::new()).await?;
        let mut out = Vec::new();
        for r in [
            record(&input, "k0", "v0"),
            record(&input, "k1", "v1"),
            record(&input, "k2", "v2"),
            record(&input, "k3", "v3"),
        ] {
            out.push(p.send(r).await?.position);
        }
        p.flush(Duration::from_secs(30)).await?;
        out
    };
    let store = store();
    // What a crash after the completion and before the commit leaves: k0 completed with the
    // origin of its input (offset 0 of the input, not committed). k1 was completed by another
    // consumer (a result without an origin).
    // Completes `key` (in the store's own key space) as a crashed worker would have.
    let seed = |key: String, payload: Option<&str>, result: Option<Vec<u8>>| {
        let store = store.clone();
        let fingerprint = payload.map(|p| onceflow_core::dedup::fingerprint(p.as_bytes()));
        async move {
            let req = onceflow_core::dedup::ClaimRequest {
                key: key.clone(),
                owner: "crashed-worker".into(),
                lease: Duration::from_secs(60),
                fingerprint,
            };
            let ClaimOutcome::Claimed { token } = store.claim_one(req).await? else {
                return Err(Error::new(ErrorKind::Conflict, "seed claim refused"));
            };
            store
                .complete_one(&key, token, result.map(Bytes::from))
                .await?;
            Ok::<_, Error>(())
        }
    };
    let input_key = |k: &str| format!("{group}/{k}");
    // The origin as the pipeline writes it: an offset as a bare number, another position in
    // its display form.
    let origin = |position: &Position, tx: &str| {
        let position = position
            .as_offset()
            .map_or_else(|| position.to_string(), |o| o.to_string());
        format!("onceflow-origin/1\n{group}\n{input}\n0\n{position}\n{tx}").into_bytes()
    };
    seed(
        input_key("k0"),
        Some("v0"),
        Some(origin(&positions[0], "crashed-1")),
    )
    .await?;
    seed(
        input_key("k1"),
        Some("v1"),
        Some(b"done elsewhere".to_vec()),
    )
    .await?;
    // k2's completion names another input (k3's position, not committed either): that copy
    // is the one to write when it is read again; this one is a duplicate.
    seed(
        input_key("k2"),
        Some("v2"),
        Some(origin(&positions[3], "crashed-1")),
    )
    .await?;
    // k3 was completed by a transaction that committed (its marker is in the store) before
    // the group's offsets were reset: re-reading it is a redelivery, skipped.
    seed(
        input_key("k3"),
        Some("v3"),
        Some(origin(&positions[3], "committed-1")),
    )
    .await?;
    seed(format!("{group}/onceflow.tx/committed-1"), None, None).await?;
    let tx_id = h.transactional_id();
    let (_, _, m1) = run_pipeline(
        h,
        &client,
        &group,
        &tx_id,
        &input,
        &output,
        store.clone(),
        None,
        4,
    )
    .await?;
    // A duplicate send of k0, now that its origin is committed.
    produce(&client, vec![record(&input, "k0", "v0")]).await?;
    let (_, _, m2) =
        run_pipeline(h, &client, &group, &tx_id, &input, &output, store, None, 1).await?;
    let out = read_all(h, &client, &output, 1).await?;
    let payloads: Vec<String> = out
        .iter()
        .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
        .collect();
    check(
        payloads == ["v0"],
        format!(
            "k0 written once, k1, k2 and k3 skipped, got {payloads:?} (first run {:?}, second {:?})",
            m1.snapshot(),
            m2.snapshot()
        ),
    )?;
    check(
        m2.snapshot().duplicates_skipped == 1,
        format!("the duplicate send is skipped: {:?}", m2.snapshot()),
    )?;
    Ok(Outcome::Passed)
}

/// A second member joins while the first is consuming; partitions move; every key is handled
/// exactly once across both and nothing is left uncommitted.
pub async fn member_joining_mid_stream_loses_and_repeats_nothing(h: &dyn Harness) -> CaseResult {
    let client = Client::new(h.platform());
    let topic = h.topic(4).await?;
    let total = 400usize;
    produce(&client, keyed(&topic, total)).await?;
    let group = h.group();
    let store = store();
    let handler = Arc::new(Counting::default());
    let slow = |_: &Message| async { tokio::time::sleep(Duration::from_millis(2)).await };
    let _ = slow;
    let mk = |client: Client,
              group: String,
              topic: String,
              handler: Arc<Counting>,
              store: Arc<dyn DedupStore>| async move {
        let consumer = client.consumer(consumer_config(h, &group, &topic)).await?;
        IdempotentConsumer::with_config(
            consumer,
            Some(store),
            Arc::new(Shared(handler)),
            EngineConfig {
                batch_size: 20,
                ..fast_engine(h)
            },
            None,
        )
    };
    let a = mk(
        client.clone(),
        group.clone(),
        topic.clone(),
        handler.clone(),
        store.clone(),
    )
    .await?;
    let handled = handler.clone();
    let joined = Arc::new(AtomicU32::new(0));
    let a_run = {
        let handled = handled.clone();
        a.run_until(until(h, move || handled.distinct() >= total))
    };
    let b_run = {
        let handled = handled.clone();
        let (client, group, topic, handler, store) = (
            client.clone(),
            group.clone(),
            topic.clone(),
            handler.clone(),
            store.clone(),
        );
        let joined = joined.clone();
        async move {
            // Join once the first member has made progress.
            let deadline = Instant::now() + h.timings().wait;
            while handled.distinct() < total / 4 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let b = mk(client, group, topic, handler, store).await?;
            joined.store(1, Ordering::SeqCst);
            b.run_until(until(h, move || handled.distinct() >= total))
                .await
        }
    };
    let (ra, rb) = tokio::join!(a_run, b_run);
    ra?;
    rb?;
    check(
        joined.load(Ordering::SeqCst) == 1,
        "the second member joined",
    )?;
    let runs = handler.runs.lock().unwrap().clone();
    check(
        runs.len() == total,
        format!("{total} keys handled, got {}", runs.len()),
    )?;
    let twice: Vec<_> = runs.iter().filter(|(_, n)| **n > 1).collect();
    check(
        twice.is_empty(),
        format!("no key handled twice, got {twice:?}"),
    )?;
    nothing_left(h, &client, &group, &topic).await?;
    Ok(Outcome::Passed)
}

/// Shutdown stops fetching, finishes what is in flight, commits and closes.
pub async fn shutdown_drains_and_commits(h: &dyn Harness) -> CaseResult {
    let client = Client::new(h.platform());
    let topic = h.topic(2).await?;
    produce(&client, keyed(&topic, 50)).await?;
    let group = h.group();
    let handler = Arc::new(Counting::default());
    let cfg = EngineConfig {
        // Commits only at shutdown: proves the drain commits.
        commit_interval: Duration::from_secs(3600),
        commit_every: u64::MAX,
        ..fast_engine(h)
    };
    let (metrics, summary) = run_consumer(
        h,
        &client,
        &group,
        &topic,
        handler.clone(),
        cfg,
        false,
        |c, _| c.distinct() == 50,
    )
    .await?;
    let summary = summary?;
    check(summary.drained, "drained within the deadline")?;
    check(metrics.snapshot().commits >= 1, "committed at shutdown")?;
    nothing_left(h, &client, &group, &topic).await?;
    Ok(Outcome::Passed)
}

/// Runs of a handler: `(idempotency key, key generation, payload)` per successful run.
type Runs = Arc<Mutex<Vec<(String, u32, String)>>>;

fn recording(runs: Runs) -> Arc<dyn Handler> {
    Arc::new(onceflow_core::handler_fn(move |m: Message| {
        let runs = runs.clone();
        async move {
            let generation = m
                .headers
                .get_str(onceflow_core::KEY_GENERATION_HEADER)
                .map_or(0, |g| g.parse().unwrap_or(u32::MAX));
            runs.lock().unwrap().push((
                Counting::key(&m),
                generation,
                String::from_utf8_lossy(&m.payload).into_owned(),
            ));
            Ok(None)
        }
    }))
}

/// Messages without an idempotency key (no header) run at-least-once with a store, write no
/// dedup record (they used to write one under their coordinates) and are counted as keyless.
pub async fn keyless_messages_write_no_dedup_record_and_are_counted(h: &dyn Harness) -> CaseResult {
    let client = Client::new(h.platform());
    let topic = h.topic(1).await?;
    let mut recs: Vec<Record> = ["a", "b", "c"]
        .iter()
        .map(|p| Record::new(topic.clone(), p.as_bytes().to_vec()))
        .collect();
    recs.push(record(&topic, "k1", "x"));
    produce(&client, recs).await?;
    let group = h.group();
    let store: Arc<dyn DedupStore> = store();
    let runs: Runs = Arc::default();
    let consumer = client.consumer(consumer_config(h, &group, &topic)).await?;
    let ic = IdempotentConsumer::with_config(
        consumer,
        Some(store.clone()),
        recording(runs.clone()),
        fast_engine(h),
        None,
    )?;
    let metrics = ic.metrics();
    let r2 = runs.clone();
    ic.run_until(until(h, move || r2.lock().unwrap().len() >= 4))
        .await?;
    let runs = runs.lock().unwrap().clone();
    let keyless = runs.iter().filter(|r| r.0.is_empty()).count();
    check(
        keyless == 3 && runs.len() == 4,
        format!("three keyless runs and one keyed, got {runs:?}"),
    )?;
    let s = metrics.snapshot();
    check(s.keyless == 3, format!("keyless counter 3, got {s:?}"))?;
    let read = read_all(h, &client, &topic, 4).await?;
    let coordinate_keys: Vec<String> = read
        .iter()
        .filter(|m| Counting::key(m).is_empty())
        .map(|m| format!("{group}/@{}/{}/{}", m.topic, m.partition, m.position))
        .collect();
    check(
        coordinate_keys.len() == 3,
        "three keyless messages read back",
    )?;
    let rows = store.get(&coordinate_keys).await?;
    check(
        rows.iter().all(Option::is_none),
        format!("no dedup record for keyless messages, found {rows:?} at {coordinate_keys:?}"),
    )?;
    check(
        store.get(&[format!("{group}/k1")]).await?[0].is_some(),
        "the keyed message has its record",
    )?;
    nothing_left(h, &client, &group, &topic).await?;
    Ok(Outcome::Passed)
}

/// With `require_key`, a keyless message is an error naming the header that found nothing,
/// dead-lettered like a failed handler; its handler does not run and the consumer goes on.
pub async fn require_key_dead_letters_a_keyless_message(h: &dyn Harness) -> CaseResult {
    let client = Client::new(h.platform());
    let topic = h.topic(1).await?;
    let dlq = h.topic(1).await?;
    produce(
        &client,
        vec![
            record(&topic, "k0", "x"),
            Record::new(topic.clone(), b"no-key".to_vec()),
            record(&topic, "k1", "y"),
        ],
    )
    .await?;
    let handler = Arc::new(Counting::default());
    let cfg = EngineConfig {
        require_key: true,
        on_failure: OnFailure::DeadLetter(dlq.clone()),
        ..fast_engine(h)
    };
    let group = h.group();
    let (metrics, summary) = run_consumer(
        h,
        &client,
        &group,
        &topic,
        handler.clone(),
        cfg,
        true,
        |c, m| c.distinct() == 2 && m.snapshot().dead_lettered == 1,
    )
    .await?;
    summary?;
    let runs = handler.runs.lock().unwrap().clone();
    check(
        runs.len() == 2 && !runs.contains_key(""),
        format!("k0 and k1 handled, the keyless one not: {runs:?}"),
    )?;
    let s = metrics.snapshot();
    check(
        s.dead_lettered == 1 && s.keyless == 0,
        format!("one dead letter, nothing run keyless: {s:?}"),
    )?;
    let dead = read_all(h, &client, &dlq, 1).await?;
    check(
        dead.len() == 1,
        format!("one dead letter, got {}", dead.len()),
    )?;
    let d = &dead[0];
    check(
        d.payload.as_ref() == b"no-key",
        "dead letter keeps the payload",
    )?;
    let error = d.headers.get_str("onceflow-error").unwrap_or("");
    check(
        error.contains("header 'idempotency-key'") && error.contains("require_key"),
        format!("the error names the header, got '{error}'"),
    )?;
    check(
        d.headers.get_str("onceflow-error-kind") == Some("ONCEFLOW_CONFIG"),
        format!("error kind header, got {:?}", d.headers),
    )?;
    nothing_left(h, &client, &group, &topic).await?;
    Ok(Outcome::Passed)
}

/// A payload conflicting with its key's fingerprint is routed like a failed handler: with
/// `redeliver` (the default) it is handed back to the platform and neither the consumer nor
/// the pipeline stops (both used to stop with the Conflict error).
pub async fn conflicting_payload_does_not_stop_consumer_or_pipeline(h: &dyn Harness) -> CaseResult {
    let client = Client::new(h.platform());
    let topic = h.topic(1).await?;
    produce(
        &client,
        vec![record(&topic, "k", "first"), record(&topic, "k", "second")],
    )
    .await?;
    let handler = Arc::new(Counting::default());
    let (metrics, summary) = run_consumer(
        h,
        &client,
        &h.group(),
        &topic,
        handler.clone(),
        fast_engine(h),
        false,
        |_, m| m.snapshot().redelivery_requests >= 2,
    )
    .await?;
    check(
        summary.is_ok(),
        format!("the consumer goes on after a conflict, got {summary:?}"),
    )?;
    let s = metrics.snapshot();
    check(
        s.redelivery_requests >= 2,
        format!("the conflict was redelivered, got {s:?}"),
    )?;
    check(handler.distinct() == 1, "the first payload was handled")?;

    // The pipeline, transactional where the platform has transactions.
    let output = h.topic(1).await?;
    let group = h.group();
    let consumer = client.consumer(consumer_config(h, &group, &topic)).await?;
    let producer = client
        .producer(ProducerConfig::new().transactional_id(format!("{group}-tx")))
        .await?;
    let echo = Echo {
        out: output.clone(),
        calls: Arc::new(AtomicU64::new(0)),
        crash_after: None,
    };
    let pipeline = Pipeline::with_config(
        consumer,
        producer,
        Some(store()),
        Arc::new(echo),
        PipelineConfig {
            engine: fast_engine(h),
            transaction_interval: Duration::from_millis(50),
            ..PipelineConfig::default()
        },
    )?;
    let pm = pipeline.metrics();
    let pm2 = pm.clone();
    let summary = pipeline
        .run_until(until(h, move || pm2.snapshot().redelivery_requests >= 2))
        .await;
    check(
        summary.is_ok(),
        format!("the pipeline goes on after a conflict, got {summary:?}"),
    )?;
    check(
        pm.snapshot().redelivery_requests >= 2,
        format!(
            "the pipeline redelivered the conflict, got {:?}",
            pm.snapshot()
        ),
    )?;
    Ok(Outcome::Passed)
}

/// A processed job requeued on purpose (`Record::requeue(1)`) runs once more although its
/// idempotency key is the same; a plain re-send (generation 0) and a repeat of generation 1
/// are deduplicated. Where the platform deduplicates by message id (JetStream `Nats-Msg-Id`)
/// it keeps the requeue and drops the repeats itself.
pub async fn requeued_job_runs_once_more(h: &dyn Harness) -> CaseResult {
    let client = Client::new(h.platform());
    let topic = h.topic(1).await?;
    let job = || Record::new(topic.clone(), b"job".to_vec()).idempotency_key("job-1");
    produce(&client, vec![job()]).await?;
    let group = h.group();
    let runs: Runs = Arc::default();
    let consumer = client.consumer(consumer_config(h, &group, &topic)).await?;
    let ic = IdempotentConsumer::with_config(
        consumer,
        Some(store()),
        recording(runs.clone()),
        fast_engine(h),
        None,
    )?;
    let metrics = ic.metrics();
    let r2 = runs.clone();
    let run = tokio::spawn(ic.run_until(until(h, move || {
        r2.lock().unwrap().iter().any(|r| r.0 == "end")
    })));
    let r3 = runs.clone();
    until(h, move || !r3.lock().unwrap().is_empty()).await;
    // After the first run: the same job again, then requeued twice, then an end marker.
    produce(
        &client,
        vec![
            job(),
            job().requeue(1),
            job().requeue(1),
            record(&topic, "end", "end"),
        ],
    )
    .await?;
    run.await
        .map_err(|e| Error::new(ErrorKind::Platform, e.to_string()))??;
    let runs = runs.lock().unwrap().clone();
    let jobs: Vec<u32> = runs
        .iter()
        .filter(|r| r.0 == "job-1")
        .map(|r| r.1)
        .collect();
    check(
        jobs == [0, 1],
        format!("job-1 run for generations 0 and 1 once each, got {runs:?}"),
    )?;
    let read = read_all(h, &client, &topic, 3).await?;
    let kept = read.iter().filter(|m| m.payload.as_ref() == b"job").count();
    if h.platform().name() == "jetstream" {
        check(
            kept == 2,
            format!("JetStream keeps generation 0 and 1 once each, kept {kept}"),
        )?;
    } else {
        let dups = metrics.snapshot().duplicates_skipped;
        check(
            kept == 4 && dups == 2,
            format!("4 sends kept, 2 skipped as duplicates; got {kept} and {dups}"),
        )?;
    }
    nothing_left(h, &client, &group, &topic).await?;
    Ok(Outcome::Passed)
}

/// The payloads read from `output` (at least `n` awaited, then the harness's quiet time),
/// sorted, and the `n` expected ones `v0`..`v{n-1}`, sorted alike.
async fn outputs_of_v(
    h: &dyn Harness,
    client: &Client,
    output: &str,
    n: usize,
) -> Result<(Vec<String>, Vec<String>)> {
    let out = read_all(h, client, output, n).await?;
    let mut payloads: Vec<String> = out
        .iter()
        .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
        .collect();
    payloads.sort();
    let mut want: Vec<String> = (0..n).map(|i| format!("v{i}")).collect();
    want.sort();
    Ok((payloads, want))
}

/// Fails the first attempt at every `every`-th input (`v{i}` with `i % every == every - 1`),
/// echoes the rest; counts its calls.
struct FailsOnceEvery {
    out: String,
    every: usize,
    calls: Arc<AtomicU64>,
    failed: Mutex<std::collections::HashSet<usize>>,
}

#[async_trait]
impl Transform for FailsOnceEvery {
    async fn transform(&self, m: &Message) -> std::result::Result<Vec<Record>, BoxError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let i: usize = std::str::from_utf8(&m.payload)?
            .trim_start_matches('v')
            .parse()?;
        if i % self.every == self.every - 1 && self.failed.lock().unwrap().insert(i) {
            return Err(format!("input {i} fails its first attempt").into());
        }
        Ok(vec![Record::new(self.out.clone(), m.payload.clone())])
    }
}

/// An input whose transform fails for good (`max_attempts=1`, redelivered) costs its own
/// redelivery, not the work done before it: a transactional pipeline commits the inputs
/// before the failing one and reads again from it. (It aborted the whole transaction: every
/// input of it was transformed again, and with a transform failing now and then no
/// transaction of a backlog committed, #27.) Every input's output once.
pub async fn a_failing_input_costs_only_its_own_redelivery(h: &dyn Harness) -> CaseResult {
    const N: usize = 200;
    const EVERY: usize = 20;
    let client = Client::new(h.platform());
    let input = h.topic(1).await?;
    let output = h.topic(1).await?;
    produce(&client, keyed_v(&input, N)).await?;
    let calls = Arc::new(AtomicU64::new(0));
    let transform = FailsOnceEvery {
        out: output.clone(),
        every: EVERY,
        calls: calls.clone(),
        failed: Mutex::default(),
    };
    let group = h.group();
    let config = PipelineConfig {
        engine: EngineConfig {
            worker_id: format!("{group}-worker"),
            max_attempts: 1,
            ..fast_engine(h)
        },
        // Long enough that the backlog's inputs share a transaction or two.
        transaction_interval: Duration::from_secs(1),
        ..PipelineConfig::default()
    };
    let (_, metrics) = run_pipeline_with(
        h,
        &client,
        &group,
        &h.transactional_id(),
        &input,
        store(),
        Arc::new(transform),
        config,
        N,
    )
    .await?;
    let (payloads, want) = outputs_of_v(h, &client, &output, N).await?;
    check(
        payloads == want,
        format!(
            "{N} outputs once each, got {} ({:?})",
            payloads.len(),
            metrics.snapshot()
        ),
    )?;
    // Each input transformed once, the failing ones once more: N + N/EVERY calls. Aborting the
    // whole transaction at each failure transformed the inputs before it again (about
    // N + EVERY * (1 + 2 + .. + N/EVERY) = 1300 calls here).
    let calls = calls.load(Ordering::SeqCst) as usize;
    let bound = N + N / EVERY + N / 4;
    check(
        calls <= bound,
        format!(
            "{calls} transform calls for {N} inputs of which {} fail once: at most {bound} expected ({:?})",
            N / EVERY,
            metrics.snapshot()
        ),
    )?;
    Ok(Outcome::Passed)
}

/// Echoes each input after `delay` (a slow transform).
struct SlowEcho {
    out: String,
    delay: Duration,
}

#[async_trait]
impl Transform for SlowEcho {
    async fn transform(&self, m: &Message) -> std::result::Result<Vec<Record>, BoxError> {
        tokio::time::sleep(self.delay).await;
        Ok(vec![Record::new(self.out.clone(), m.payload.clone())])
    }
}

/// A transaction that becomes due part-way through a poll batch (its `transaction_interval`
/// passed) commits there, and the rest of the batch goes on in the next transaction: one batch
/// of 60 inputs at 5 ms each, against an interval of 50 ms, commits several times, and every
/// input's output is written once. (It was checked only at a batch's end, so a transaction
/// lasted `batch_size` × the transform's time; past the platform's transaction timeout the
/// coordinator aborted it under the batch and the pipeline stopped, h1 break-it of #27.)
pub async fn a_transaction_due_mid_batch_commits_there(h: &dyn Harness) -> CaseResult {
    const N: usize = 60;
    let client = Client::new(h.platform());
    if !client.capabilities().transactions {
        return Ok(Outcome::Skipped(
            "no transactions: the pipeline commits positions, not transactions".into(),
        ));
    }
    let input = h.topic(1).await?;
    let output = h.topic(1).await?;
    produce(&client, keyed_v(&input, N)).await?;
    let group = h.group();
    let config = PipelineConfig {
        engine: EngineConfig {
            worker_id: format!("{group}-worker"),
            batch_size: N,
            ..fast_engine(h)
        },
        transaction_interval: Duration::from_millis(50),
        ..PipelineConfig::default()
    };
    // The batch takes longer than the in-process backend's short session timeout of the
    // suite (the member would be evicted mid-batch, as a Kafka member past
    // max.poll.interval.ms is): this member gets at least 10 s.
    let consumer = consumer_config(h, &group, &input)
        .session_timeout(h.timings().session_timeout.max(Duration::from_secs(10)));
    let (_, metrics) = run_pipeline_on(
        h,
        &client,
        consumer,
        &h.transactional_id(),
        &input,
        store(),
        Arc::new(SlowEcho {
            out: output.clone(),
            delay: Duration::from_millis(5),
        }),
        config,
        N,
    )
    .await?;
    let (payloads, want) = outputs_of_v(h, &client, &output, N).await?;
    let s = metrics.snapshot();
    check(
        payloads == want,
        format!("{N} outputs once each, got {} ({s:?})", payloads.len()),
    )?;
    // N × 5 ms = 300 ms of transforms against 50 ms: about 6 commits; 1 (or 2 with the
    // run's last) when only a batch's end commits.
    check(
        s.transactions_committed >= 3,
        format!("committed part-way through the batch: {s:?}"),
    )?;
    Ok(Outcome::Passed)
}

/// A pipeline stopped by an input that failed for good (`on_failure=stop`) leaves no claim of
/// its batch behind: the inputs after the failing one were claimed with the batch, never
/// processed, and are released, so the next run (a restarted process: another worker id)
/// reads them at once instead of waiting out their lease (h2 break-it of #27: each restart
/// waited the lease, 30 s by default, and its own claims then expired and were fenced).
pub async fn a_stopped_pipeline_leaves_no_claim_of_its_batch_behind(h: &dyn Harness) -> CaseResult {
    const N: usize = 20;
    const EVERY: usize = 10;
    const LEASE: Duration = Duration::from_secs(120);
    let client = Client::new(h.platform());
    let input = h.topic(1).await?;
    let output = h.topic(1).await?;
    produce(&client, keyed_v(&input, N)).await?;
    let calls = Arc::new(AtomicU64::new(0));
    // Inputs 9 and 19 fail once: the first run stops at 9 with 10..19 claimed.
    let transform: Arc<dyn Transform> = Arc::new(FailsOnceEvery {
        out: output.clone(),
        every: EVERY,
        calls: calls.clone(),
        failed: Mutex::default(),
    });
    let group = h.group();
    let tx_id = h.transactional_id();
    let store = store();
    let started = Instant::now();
    let mut stops = 0;
    for run in 0..(N / EVERY + 2) {
        let config = PipelineConfig {
            engine: EngineConfig {
                worker_id: format!("{group}-worker-{run}"),
                max_attempts: 1,
                on_failure: OnFailure::Stop,
                batch_size: N,
                lease: LEASE,
                ..fast_engine(h)
            },
            transaction_interval: Duration::from_millis(200),
            ..PipelineConfig::default()
        };
        match run_pipeline_with(
            h,
            &client,
            &group,
            &tx_id,
            &input,
            store.clone(),
            transform.clone(),
            config,
            1,
        )
        .await
        {
            Ok(_) => break,
            Err(e) if e.to_string().contains("fails its first attempt") => stops += 1,
            Err(e) => return Err(e),
        }
    }
    let took = started.elapsed();
    let (payloads, want) = outputs_of_v(h, &client, &output, N).await?;
    check(
        payloads == want,
        format!(
            "{N} outputs once each after {stops} stop(s) in {took:?}, got {} ({payloads:?})",
            payloads.len()
        ),
    )?;
    check(
        took < LEASE / 2,
        format!("{took:?} for {N} inputs and {stops} stop(s): the restarts waited for claims"),
    )?;
    Ok(Outcome::Passed)
}

/// A requeued input (`Record::requeue(1)`) runs through the pipeline once more and its outputs
/// get ids of their own (`{key}#requeue-1:{index}`), so a platform that deduplicates by
/// message id (JetStream) keeps them; a plain re-send of the input writes nothing again.
pub async fn requeued_input_is_transformed_once_more(h: &dyn Harness) -> CaseResult {
    let client = Client::new(h.platform());
    let input = h.topic(1).await?;
    let output = h.topic(1).await?;
    let job = || Record::new(input.clone(), b"job".to_vec()).idempotency_key("job-1");
    produce(
        &client,
        vec![job(), job(), job().requeue(1), job().requeue(1)],
    )
    .await?;
    let group = h.group();
    let consumer = client.consumer(consumer_config(h, &group, &input)).await?;
    let producer = client
        .producer(ProducerConfig::new().transactional_id(format!("{group}-tx")))
        .await?;
    let calls = Arc::new(AtomicU64::new(0));
    let echo = Echo {
        out: output.clone(),
        calls: calls.clone(),
        crash_after: None,
    };
    let pipeline = Pipeline::with_config(
        consumer,
        producer,
        Some(store()),
        Arc::new(echo),
        PipelineConfig {
            engine: fast_engine(h),
            transaction_interval: Duration::from_millis(50),
            ..PipelineConfig::default()
        },
    )?;
    let c2 = calls.clone();
    pipeline
        .run_until(until(h, move || c2.load(Ordering::SeqCst) >= 2))
        .await?;
    let out = read_all(h, &client, &output, 2).await?;
    let ids: Vec<&str> = out
        .iter()
        .map(|m| {
            m.headers
                .get_str(onceflow_core::IDEMPOTENCY_KEY_HEADER)
                .unwrap_or("")
        })
        .collect();
    check(
        calls.load(Ordering::SeqCst) == 2,
        format!(
            "the transform ran for generations 0 and 1 only, ran {} times",
            calls.load(Ordering::SeqCst)
        ),
    )?;
    check(
        ids == ["job-1:0", "job-1#requeue-1:0"],
        format!("one output per generation with its own id, got {ids:?}"),
    )?;
    Ok(Outcome::Passed)
}

/// `Consumer::rewind_uncommitted` refuses, before doing anything, partitions this member does
/// not read: a number the topic does not have (`Fenced`: not assigned here), -1, an empty topic
/// name and a topic it did not subscribe to (`Config`), each error naming the value; its own
/// assignment is accepted; once closed, even the empty list is `Closed` (issue #27: each of
/// these used to come back as a partition "with nothing committed", and `[]` after close as
/// `Ok`).
pub async fn rewind_uncommitted_refuses_partitions_it_does_not_read(h: &dyn Harness) -> CaseResult {
    use onceflow_core::TopicPartition as Tp;
    let client = Client::new(h.platform());
    let topic = h.topic(2).await?;
    produce(&client, keyed(&topic, 6)).await?;
    let c = client
        .consumer(consumer_config(h, &h.group(), &topic))
        .await?;
    let mut got = Vec::new();
    let deadline = Instant::now() + h.timings().wait;
    while got.len() < 6 && Instant::now() < deadline {
        got.extend(c.poll(100, h.timings().poll).await?);
    }
    check(got.len() == 6, format!("6 inputs read, got {}", got.len()))?;
    let other = format!("{topic}-not-subscribed");
    for (tp, kind, named) in [
        (
            Tp::new(topic.clone(), 7),
            ErrorKind::Fenced,
            format!("{topic}[7]"),
        ),
        (
            Tp::new(topic.clone(), -1),
            ErrorKind::Config,
            "-1".to_string(),
        ),
        (Tp::new(other.clone(), 0), ErrorKind::Config, other.clone()),
        (
            Tp::new("", 0),
            ErrorKind::Config,
            "empty topic name".to_string(),
        ),
    ] {
        match c.rewind_uncommitted(std::slice::from_ref(&tp)).await {
            Ok(left) => {
                return Err(Error::new(
                    ErrorKind::Platform,
                    format!("rewind_uncommitted([{tp}]) accepted, returned {left:?}"),
                ))
            }
            Err(e) => check(
                e.kind() == kind && e.message().contains(&named),
                format!("rewind_uncommitted([{tp}]): expected {kind:?} naming '{named}', got {e}"),
            )?,
        }
    }
    // One bad partition among good ones: refused as a whole.
    let mut mixed = c.assignment();
    mixed.push(Tp::new(topic.clone(), 7));
    check(
        c.rewind_uncommitted(&mixed).await.is_err(),
        "a list with one partition not assigned is refused",
    )?;
    c.rewind_uncommitted(&c.assignment()).await?;
    c.rewind_uncommitted(&[]).await?;
    c.close().await?;
    for list in [Vec::new(), vec![Tp::new(topic.clone(), 0)]] {
        match c.rewind_uncommitted(&list).await {
            Err(e) if e.kind() == ErrorKind::Closed => {}
            other => {
                return Err(Error::new(
                    ErrorKind::Platform,
                    format!(
                        "rewind_uncommitted({list:?}) after close: expected Closed, got {other:?}"
                    ),
                ))
            }
        }
    }
    Ok(Outcome::Passed)
}

/// After `close`, the producer's `send`, `send_batch` (each record), `enqueue_batch`,
/// `send_atomic` and `begin` are `Closed` on every platform (a transactional producer opens no
/// transaction), also through a clone; a second `close` is a no-op.
pub async fn closed_producer_refuses_sends_and_transactions(h: &dyn Harness) -> CaseResult {
    let client = Client::new(h.platform());
    let topic = h.topic(1).await?;
    let p = client.producer(ProducerConfig::new()).await?;
    p.send(Record::new(&topic, "before")).await?;
    let clone = p.clone();
    p.close().await?;
    let closed = |what: &str, r: &Result<onceflow_core::Delivery>| {
        check(
            matches!(r, Err(e) if e.kind() == ErrorKind::Closed),
            format!("{what} after close: Closed, got {r:?}"),
        )
    };
    closed("send", &clone.send(Record::new(&topic, "after")).await)?;
    let sent = p
        .send_batch(vec![Record::new(&topic, "a"), Record::new(&topic, "b")])
        .await;
    check(sent.len() == 2, format!("2 results, got {}", sent.len()))?;
    for r in &sent {
        closed("send_batch", r)?;
    }
    let queued = p.enqueue_batch(vec![Record::new(&topic, "c")]).await.await;
    check(queued.len() == 1, format!("1 result, got {}", queued.len()))?;
    closed("enqueue_batch", &queued[0])?;
    let atomic = p.send_atomic(vec![Record::new(&topic, "d")]).await;
    check(
        matches!(&atomic, Err(e) if e.kind() == ErrorKind::Closed),
        format!("send_atomic after close: Closed, got {atomic:?}"),
    )?;
    p.close().await?;
    if client.capabilities().transactions {
        let tp = client
            .producer(ProducerConfig::new().transactional_id(h.transactional_id()))
            .await?;
        tp.close().await?;
        let begun = tp.begin().await;
        check(
            matches!(&begun, Err(e) if e.kind() == ErrorKind::Closed),
            format!("begin after close: Closed, got {:?}", begun.as_ref().err()),
        )?;
    }
    Ok(Outcome::Passed)
}
