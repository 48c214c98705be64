//! Consume-transform-produce with the strongest mechanism the platform offers.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use opentelemetry::context::FutureExt as _;

use super::claims::conflict_error;
use super::idempotent::{drive, Core, RunSummary};
use super::{dead_letter_record, EngineConfig, Handler, OnFailure};
use crate::backend::Guarantee;
use crate::client::{Consumer, Producer, Transaction};
use crate::dedup::{ClaimOutcome, Completion, DedupStore, DedupStoreExt, FencingToken, KeyState};
use crate::error::{BoxError, Error, ErrorKind, Result};
use crate::metrics::{Metric, Metrics};
use crate::model::{Message, Position, Record, StartFrom, TopicPartition};

/// Turns one input message into zero or more output records.
///
/// In every mode the pipeline runs the transform inside a `process {topic}` span (kind
/// `Consumer`, a child of the producer span whose context the input carries; see
/// [`crate::trace`]) and sends the outputs as children of that span, whatever trace headers
/// the transform put on them (a copy of the input's headers, say): the transform's work and
/// its outputs stay in the input's trace, one hop further.
#[async_trait]
pub trait Transform: Send + Sync {
    /// The outputs of `message`. Errors are retried with backoff (see
    /// [`EngineConfig::max_attempts`]). Output idempotency keys are set by the pipeline
    /// (`{input key}:{index}`); any set here are replaced.
    async fn transform(&self, message: &Message) -> std::result::Result<Vec<Record>, BoxError>;

    /// [`Transform::transform`], plus the trace context the outputs are sent as children of.
    /// The default calls `transform` and names none: the outputs are children of the
    /// pipeline's process span. A transform that runs in a span of its own, recorded by
    /// another tracer (a binding's `process` span in Python's or JavaScript's OpenTelemetry),
    /// returns that span's context here so that the outputs are its children instead.
    async fn transform_traced(
        &self,
        message: &Message,
    ) -> std::result::Result<TransformOutput, BoxError> {
        Ok(TransformOutput {
            records: self.transform(message).await?,
            parent: None,
        })
    }
}

/// What [`Transform::transform_traced`] returns.
#[derive(Debug, Default)]
pub struct TransformOutput {
    /// The output records.
    pub records: Vec<Record>,
    /// The context the outputs' producer spans are children of; `None`: the pipeline's
    /// process span for the input.
    pub parent: Option<opentelemetry::Context>,
}

#[async_trait]
impl<F> Transform for F
where
    F: Fn(&Message) -> std::result::Result<Vec<Record>, BoxError> + Send + Sync,
{
    async fn transform(&self, message: &Message) -> std::result::Result<Vec<Record>, BoxError> {
        self(message)
    }
}

/// Which mechanism a pipeline uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PipelineMode {
    /// Transactions when producer and consumer support them, else idempotent output ids.
    #[default]
    Auto,
    /// Platform transactions: outputs and input positions committed atomically
    /// ([`Guarantee::ExactlyOnce`]). Errors at construction where unavailable.
    Transactional,
    /// Deterministic output ids (`{input key}:{index}`) plus the dedup store; outputs of one
    /// input are written atomically where the platform has atomic batches.
    Idempotent,
}

/// The text forms: `auto`, `transactional` or `idempotent`; [`std::fmt::Display`] writes the
/// same. Errors: [`crate::ErrorKind::Config`] naming the text.
impl std::str::FromStr for PipelineMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(PipelineMode::Auto),
            "transactional" => Ok(PipelineMode::Transactional),
            "idempotent" => Ok(PipelineMode::Idempotent),
            _ => Err(Error::config(format!(
                "pipeline mode '{}': expected auto, transactional or idempotent",
                crate::shown(s)
            ))),
        }
    }
}

impl std::fmt::Display for PipelineMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PipelineMode::Auto => "auto",
            PipelineMode::Transactional => "transactional",
            PipelineMode::Idempotent => "idempotent",
        })
    }
}

/// Pipeline settings.
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    /// Engine settings (keys, leases, retries, commits, polling).
    pub engine: EngineConfig,
    /// Mechanism choice.
    pub mode: PipelineMode,
    /// Transactional mode: commit a transaction at least this often. Default 100 ms. Checked
    /// before each input, so a poll batch of slow transforms is split over several
    /// transactions: keep it well below the platform's transaction timeout (Kafka
    /// `transaction.timeout.ms`, Pulsar `transaction_timeout_ms`); one input's transform
    /// longer than that timeout still aborts its transaction.
    pub transaction_interval: Duration,
    /// Transactional mode: ... or after this many inputs (also checked before each input).
    /// Default 10 000.
    pub max_transaction_inputs: usize,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        PipelineConfig {
            engine: EngineConfig::default(),
            mode: PipelineMode::Auto,
            transaction_interval: Duration::from_millis(100),
            max_transaction_inputs: 10_000,
        }
    }
}

/// Consume-transform-produce. In transactional mode each transaction carries the outputs of a
/// run of inputs and those inputs' positions (Kafka EOS v2, KIP-447); an abort rewinds the
/// consumer to the committed positions. In idempotent mode each input is claimed in the dedup
/// store, its outputs get deterministic ids `{input key}:{index}` (so a platform that
/// deduplicates by id — JetStream `Nats-Msg-Id` — drops the rewrite of a replay), and its
/// position is committed after the outputs are acknowledged.
///
/// With a dedup store, redeliveries are skipped in both modes. In transactional mode the keys
/// of a transaction are completed just before it commits, each with the input position that
/// claimed it as its stored result; a key found completed whose input position the group never
/// committed (a crash or an abort between the two) is processed again when that very input
/// is read again and its transaction left no commit marker (a key `onceflow.tx/…` written to
/// the store after each commit that completed keys — one more entry per transaction in the
/// dedup window, to count in a bounded `memory://` store's capacity — so an offset reset that
/// re-reads committed work still skips it), and any other copy of the key is skipped: a crash after the commit cannot leave a key
/// claimed for outputs already committed, and one before it loses nothing.
/// [`Pipeline::guarantee`] and
/// [`Pipeline::mechanism`] say what runs.
pub struct Pipeline {
    core: Arc<Core>,
    producer: Producer,
    transform: Arc<dyn Transform>,
    config: PipelineConfig,
    transactional: bool,
}

struct OutputHandler {
    producer: Producer,
    transform: Arc<dyn Transform>,
    key: super::KeyStrategy,
    atomic: bool,
    /// The engine's counters (set once the engine exists), for `produced`.
    metrics: Arc<std::sync::OnceLock<Metrics>>,
}

/// First line of the result a transactional pipeline stores with a completed key: the origin
/// (group, topic, partition, position) of the input that claimed it follows, one per line.
const ORIGIN_TAG: &str = "onceflow-origin/1";

/// The stored result naming `msg`, read in transaction `tx` of group `group`, as the origin of
/// its key's completion. The position is an offset as a bare number (Kafka, `memory://`; the
/// form stores written before other positions were kept), any other position in its
/// `Display` form (`pulsar:LEDGER:ENTRY:PARTITION:BATCH`).
fn origin_of(group: &str, tx: &str, msg: &Message) -> Bytes {
    let position = match msg.position.as_offset() {
        Some(offset) => offset.to_string(),
        None => msg.position.to_string(),
    };
    Bytes::from(format!(
        "{ORIGIN_TAG}\n{group}\n{}\n{}\n{position}\n{tx}",
        msg.topic, msg.partition
    ))
}

/// A completion's origin, as written by [`origin_of`].
struct Origin<'a> {
    group: &'a str,
    tp: TopicPartition,
    position: Position,
    tx: &'a str,
}

fn parse_origin(result: &[u8]) -> Option<Origin<'_>> {
    let text = std::str::from_utf8(result).ok()?;
    let mut lines = text.split('\n');
    if lines.next()? != ORIGIN_TAG {
        return None;
    }
    let group = lines.next()?;
    let topic = lines.next()?;
    let partition = lines.next()?.parse().ok()?;
    let position = lines.next()?;
    let position = match position.parse::<i64>() {
        Ok(offset) => Position::Offset(offset),
        Err(_) => position.parse().ok()?,
    };
    let tx = lines.next()?;
    Some(Origin {
        group,
        tp: TopicPartition::new(topic, partition),
        position,
        tx,
    })
}

/// Gives output `i` of an input with idempotency key `k` the key `k:i` (the same on every
/// replay of the input). The last output takes `k`'s own allocation.
fn set_output_ids(input_key: Option<String>, outputs: &mut [Record]) {
    use std::fmt::Write as _;
    let Some(mut k) = input_key else { return };
    let n = outputs.len();
    for (i, r) in outputs.iter_mut().enumerate() {
        let mut id = if i + 1 == n {
            std::mem::take(&mut k)
        } else {
            let mut id = String::with_capacity(k.len() + 8);
            id.push_str(&k);
            id
        };
        let _ = write!(id, ":{i}");
        r.idempotency_key = Some(id);
    }
}

#[async_trait]
impl Handler for OutputHandler {
    async fn handle(&self, message: &Message) -> std::result::Result<Option<Bytes>, BoxError> {
        // Runs inside the engine's process span (the current context): the outputs are its
        // children unless the transform names another parent.
        let TransformOutput {
            records: mut outputs,
            parent,
        } = self.transform.transform_traced(message).await?;
        set_output_ids(super::output_key(&self.key, message), &mut outputs);
        if outputs.is_empty() {
            return Ok(None);
        }
        let n = outputs.len() as u64;
        let parent = parent.unwrap_or_else(opentelemetry::Context::current);
        if self.atomic && outputs.len() > 1 {
            self.producer
                .send_atomic(outputs)
                .with_context(parent)
                .await?;
        } else {
            for r in self.producer.send_batch(outputs).with_context(parent).await {
                r?;
            }
        }
        if let Some(m) = self.metrics.get() {
            m.add(Metric::Produced, n);
        }
        Ok(None)
    }
}

struct NoHandler;

#[async_trait]
impl Handler for NoHandler {
    async fn handle(&self, _message: &Message) -> std::result::Result<Option<Bytes>, BoxError> {
        Err("the transactional pipeline runs its transform directly".into())
    }
}

impl Pipeline {
    /// A pipeline from `consumer` through `transform` to `producer`, deduplicating inputs in
    /// `store` if given, with default settings (mode [`PipelineMode::Auto`]).
    pub fn new(
        consumer: Consumer,
        producer: Producer,
        store: Option<Arc<dyn DedupStore>>,
        transform: impl Transform + 'static,
    ) -> Result<Self> {
        Self::with_config(
            consumer,
            producer,
            store,
            Arc::new(transform),
            PipelineConfig::default(),
        )
    }

    /// A pipeline with explicit settings.
    ///
    /// Errors: [`ErrorKind::Config`] for invalid settings or [`PipelineMode::Transactional`]
    /// without a transactional producer; [`ErrorKind::Unsupported`] where the platform has no
    /// transactions.
    pub fn with_config(
        consumer: Consumer,
        producer: Producer,
        store: Option<Arc<dyn DedupStore>>,
        transform: Arc<dyn Transform>,
        config: PipelineConfig,
    ) -> Result<Self> {
        config.engine.validate()?;
        let can_tx =
            producer.guarantee() == Guarantee::ExactlyOnce && consumer.group_metadata().is_some();
        let transactional = match config.mode {
            PipelineMode::Auto => can_tx,
            PipelineMode::Idempotent => false,
            PipelineMode::Transactional => {
                if !producer.capabilities().transactions {
                    return Err(Error::unsupported(format!(
                        "transactional pipeline: this {} producer has no transactions (Kafka \
                         has them; Pulsar with transactions=true on its URL; JetStream and \
                         Kinesis have none: use the idempotent mode)",
                        producer.platform()
                    )));
                }
                if !can_tx {
                    return Err(Error::config(
                        "transactional pipeline needs a producer with a transactional id and a consumer group",
                    ));
                }
                true
            }
        };
        let output_metrics = Arc::new(std::sync::OnceLock::new());
        let handler: Arc<dyn Handler> = if transactional {
            Arc::new(NoHandler)
        } else {
            Arc::new(OutputHandler {
                producer: producer.clone(),
                transform: transform.clone(),
                key: config.engine.key.clone(),
                atomic: producer.capabilities().atomic_batch,
                metrics: output_metrics.clone(),
            })
        };
        let dlq =
            matches!(config.engine.on_failure, OnFailure::DeadLetter(_)).then(|| producer.clone());
        let core = Core::new(
            consumer,
            store,
            handler,
            config.engine.clone(),
            dlq,
            transactional,
        );
        let _ = output_metrics.set(core.metrics.clone());
        Ok(Pipeline {
            core: Arc::new(core),
            producer,
            transform,
            config,
            transactional,
        })
    }

    /// The guarantee this pipeline runs with.
    pub fn guarantee(&self) -> Guarantee {
        if self.transactional {
            Guarantee::ExactlyOnce
        } else if self.producer.capabilities().dedup_by_id {
            Guarantee::EffectivelyOnce
        } else {
            Guarantee::AtLeastOnce
        }
    }

    /// The mechanism, in words, for reports.
    pub fn mechanism(&self) -> &'static str {
        let caps = self.producer.capabilities();
        match (
            self.transactional,
            caps.dedup_by_id,
            caps.atomic_batch,
            self.core.store.is_some(),
        ) {
            (true, _, _, true) => {
                "transactions (outputs + input positions atomic) + dedup store for redeliveries"
            }
            (true, _, _, false) => "transactions (outputs + input positions atomic)",
            (false, true, true, _) => {
                "atomic batch per input + deterministic message ids deduplicated by the platform"
            }
            (false, true, false, _) => "deterministic message ids deduplicated by the platform",
            (false, false, _, true) => {
                "dedup store + deterministic output ids (readers deduplicate by idempotency-key)"
            }
            (false, false, _, false) => "at-least-once (no transactions, no dedup)",
        }
    }

    /// Counters (live).
    pub fn metrics(&self) -> Metrics {
        self.core.metrics.clone()
    }

    /// Runs until an error stops it or `shutdown` resolves, then drains, commits and closes.
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) -> Result<RunSummary> {
        let guarantee = self.guarantee();
        let core = self.core.clone();
        let drained = if self.transactional {
            let tx = TxLoop {
                core: &core,
                producer: &self.producer,
                transform: self.transform.as_ref(),
                config: &self.config,
                state: tokio::sync::Mutex::new(TxState::default()),
                incarnation: rand::random(),
                read_ahead: !core.consumer.capabilities().per_message_nack,
            };
            tx.run(shutdown).await?
        } else {
            drive(&core, shutdown, |c| Box::pin(c.step())).await?
        };
        Ok(RunSummary {
            metrics: core.metrics.snapshot(),
            guarantee,
            drained,
        })
    }

    /// Runs until an error stops it.
    pub async fn run(self) -> Result<RunSummary> {
        self.run_until(std::future::pending()).await
    }
}

#[derive(Default)]
struct TxState {
    tx: Option<Transaction>,
    started: Option<Instant>,
    inputs: usize,
    /// Last input position per partition in the open transaction.
    positions: HashMap<TopicPartition, Position>,
    /// First position per partition polled in the open transaction, processed or not (rewind
    /// target where nothing is committed).
    first: HashMap<TopicPartition, Position>,
    claims: Vec<Completion>,
    /// Outputs of the current batch not sent yet, each with the context its producer span is
    /// a child of (its input's process span; `None` without tracing).
    pending: Vec<(Record, Option<opentelemetry::Context>)>,
    /// Delivery reports of outputs enqueued in the open transaction and not awaited yet: the
    /// next batch is read while they are in flight; all are awaited before the commit.
    in_flight: Vec<crate::backend::DeliveriesFuture>,
    /// Keys of inputs in the open transaction.
    inflight: HashMap<String, Option<u128>>,
    /// Sequence number of the open (or last) transaction of this run.
    tx_seq: u64,
    /// Process spans of the batch being processed (the global tracer as the batch began): one
    /// tracer lookup per batch, and no span per input when the tracer records nothing (a
    /// quarter of the loop's CPU time in K4 went to spans per input nothing recorded).
    spans: Option<crate::trace::ProcessSpans>,
    /// The next batch: polled on a task of its own while the step processes the batch before
    /// it, and joined before the step ends (see [`TxLoop::step`]).
    prefetch: Option<Prefetch>,
}

impl TxState {
    /// Records the first position polled of each partition of `msgs` (runs of one
    /// partition's inputs: one map entry per run), where a rewind seeks back to when nothing
    /// is committed there.
    fn note_first(&mut self, msgs: &[Message]) {
        let mut last: Option<(&str, i32)> = None;
        for m in msgs {
            if last != Some((m.topic.as_str(), m.partition)) {
                last = Some((m.topic.as_str(), m.partition));
                self.first
                    .entry(m.topic_partition())
                    .or_insert_with(|| m.position.clone());
            }
        }
    }
}

/// The next batch, polled while the loop processes the one before: without it the loop waited
/// for each poll (the consumer's fetch queue, one message at a time, and each message's
/// conversion) and the poll thread for the loop, one after the other (K4).
enum Prefetch {
    /// The poll is running.
    Running(tokio::task::JoinHandle<Result<Vec<Message>>>),
    /// The poll has ended; its batch is the next step's.
    Ready(Result<Vec<Message>>),
}

impl Prefetch {
    /// The polled batch, once the poll has ended.
    async fn batch(self) -> Result<Vec<Message>> {
        match self {
            Prefetch::Running(task) => task.await.unwrap_or_else(|e| {
                Err(Error::new(
                    ErrorKind::Platform,
                    format!("poll task failed: {e}"),
                ))
            }),
            Prefetch::Ready(batch) => batch,
        }
    }
}

/// An input of a batch being processed: `msgs[i]`, in the run of one partition's inputs that
/// starts at `msgs[run_start]`.
#[derive(Clone, Copy)]
struct At<'m> {
    msgs: &'m [Message],
    i: usize,
    run_start: usize,
}

impl<'m> At<'m> {
    fn msg(&self) -> &'m Message {
        &self.msgs[self.i]
    }
}

struct TxLoop<'a> {
    core: &'a Arc<Core>,
    producer: &'a Producer,
    transform: &'a dyn Transform,
    config: &'a PipelineConfig,
    state: tokio::sync::Mutex<TxState>,
    /// Names this run's transactions in the dedup store (with `TxState::tx_seq`).
    incarnation: u64,
    /// Poll the next batch while one is processed: only where the consumer gives messages
    /// out in position order (see [`TxLoop::step`]).
    read_ahead: bool,
}

impl TxLoop<'_> {
    async fn run(&self, shutdown: impl Future<Output = ()>) -> Result<bool> {
        let mut shutdown = std::pin::pin!(shutdown);
        let deadline = self.config.engine.shutdown_deadline;
        let mut drained = true;
        let result: Result<()> = loop {
            let mut step = std::pin::pin!(self.step());
            let r = tokio::select! {
                biased;
                r = &mut step => r,
                _ = &mut shutdown => {
                    // Stop fetching: finish the step in flight and commit the open transaction
                    // (its inputs are processed), all within the deadline.
                    let finish = async {
                        step.await?;
                        self.commit_open().await
                    };
                    match tokio::time::timeout(deadline, finish).await {
                        Ok(r) => break r,
                        Err(_) => { drained = false; break Ok(()) }
                    }
                }
            };
            if let Err(e) = r {
                break Err(e);
            }
        };
        let mut st = self.state.lock().await;
        if let Some(tx) = st.tx.take() {
            let _ = tx.abort().await;
            self.release(&mut st).await;
        }
        // A batch polled ahead is not processed: nothing commits it, and the consumer closes
        // after its poll ends.
        if let Some(next) = st.prefetch.take() {
            let _ = next.batch().await;
        }
        drop(st);
        if !matches!(&result, Err(e) if e.kind() == ErrorKind::Closed) {
            let close = self.core.consumer.close().await;
            result?;
            close?;
        } else {
            result?;
        }
        Ok(drained)
    }

    async fn commit_open(&self) -> Result<()> {
        let mut st = self.state.lock().await;
        self.commit(&mut st).await
    }

    async fn step(&self) -> Result<()> {
        let core = self.core;
        let cfg = &core.config;
        let ahead = self.state.lock().await.prefetch.take();
        let msgs = match ahead {
            Some(next) => next.batch().await?,
            None => core.poll().await?,
        };
        let mut st = self.state.lock().await;
        // Every partition of the batch is rewound with the transaction, not only those whose
        // inputs were processed: a batch abandoned part-way (a failed transform, a revocation)
        // leaves the consumer past its unprocessed inputs, which a later commit would cover.
        st.note_first(&msgs);
        if core.tracker.take_revoked_flag() && st.tx.is_some() {
            // Partitions moved while a transaction was open: its positions may belong to
            // another member now. Abort and re-read what we still own.
            self.abort_and_rewind(&mut st, "partitions revoked").await?;
            return Ok(());
        }
        st.spans = None;
        if !msgs.is_empty() {
            // The next batch is read while this one is processed; the poll is joined before
            // this step ends ([`TxLoop::join_prefetch`]), so no poll runs while a transaction
            // commits, and a rewind drops its batch ([`TxLoop::drop_prefetch`]).
            //
            // Not where the consumer gives single messages out again behind newer ones
            // (`per_message_nack`: Pulsar shared / key_shared, JetStream): a transaction
            // acknowledges, per partition, every message given out up to the highest position
            // it processed, so a redelivered input at a lower position in the batch read
            // ahead was acknowledged with it, unprocessed, and lost for good when the
            // transaction that then processed it aborted (test
            // `a_redelivered_input_polled_ahead_is_not_acknowledged_by_the_commit_before_it`).
            if self.read_ahead {
                let next = core.clone();
                st.prefetch = Some(Prefetch::Running(tokio::spawn(
                    async move { next.poll().await },
                )));
            }
            core.metrics.add(Metric::Consumed, msgs.len() as u64);
            if st.tx.is_none() {
                self.begin_tx(&mut st).await?;
            }
            // Store keys are only needed with a store: without one, no key is claimed, and
            // formatting one per input was a sixth of the pipeline's own CPU time (K4).
            let mut keys: Vec<Option<String>> = if core.needs_keys() {
                msgs.iter().map(|m| core.store_key(m)).collect()
            } else {
                vec![None; msgs.len()]
            };
            // Keys already in the open transaction (a redelivery of an input in flight) or
            // repeated in this batch are duplicates: if the transaction commits, so does the
            // input; if it aborts, the rewind reads it again.
            let claims = core
                .claim_batch(&msgs, &mut keys, Some(&st.inflight))
                .await?;
            for &(i, fp) in &claims.first {
                let k = keys[i].clone().expect("first copies have keys");
                st.inflight.insert(k, fp);
            }
            let outcomes = claims.outcomes;
            // The claims this batch took, by input: where the batch ends early (an abort, a
            // failed input's commit, a stop), those of the inputs not reached are released
            // (`TxLoop::release_unreached`), else the partition's next reader (a restarted
            // process, another member) waits out their lease.
            let taken: Vec<(usize, String, FencingToken)> = outcomes
                .iter()
                .enumerate()
                .filter_map(|(i, o)| match o {
                    Some(ClaimOutcome::Claimed { token }) => Some((i, keys[i].clone()?, *token)),
                    _ => None,
                })
                .collect();
            let redo = self.redo(&msgs, &outcomes).await?;
            // Where the run of one partition's inputs that `msgs[i]` belongs to starts.
            let mut run_start = 0;
            for (i, (((msg, key), mut outcome), redo)) in
                msgs.iter().zip(&keys).zip(outcomes).zip(redo).enumerate()
            {
                if i > 0
                    && (msgs[i - 1].partition != msg.partition || msgs[i - 1].topic != msg.topic)
                {
                    run_start = i;
                }
                let at = At {
                    msgs: &msgs,
                    i,
                    run_start,
                };
                // A batch of slow transforms can outlast the transaction: commit what is done
                // once it is due, and go on with the rest of the batch in the next one.
                if i > 0 && self.due(&st) {
                    let rest = &keys[i..];
                    match self.commit_mid_batch(&mut st, at, rest).await {
                        Ok(true) => {}
                        other => {
                            self.release_unreached(&taken, i - 1).await;
                            return other.map(drop);
                        }
                    }
                }
                if redo {
                    // This very input was completed by a transaction that did not commit (a
                    // crash or an abort after the completion): not a duplicate.
                    tracing::debug!(
                        key = key.as_deref().unwrap_or_default(),
                        at = %msg.position,
                        "completed by a transaction that did not commit; processing it"
                    );
                    outcome = None;
                }
                if matches!(outcome, Some(ClaimOutcome::InProgress { .. })) {
                    // Another worker holds the key: wait it out, unless the partition moves
                    // away meanwhile (then the transaction aborts and the input is the next
                    // owner's).
                    let tp = msg.topic_partition();
                    let generation = core.tracker.generation(&tp);
                    let still_ours = || core.tracker.generation(&tp) == generation;
                    let k = || key.clone().expect("in-progress implies a key");
                    outcome = core.wait_out(outcome, k, msg, still_ours).await?;
                    // Completed meanwhile by the worker that held it: that worker completes
                    // its keys before its transaction commits, and the transaction may have
                    // aborted since (fenced by the rebalance that brought this partition
                    // here). Skipped as a duplicate, the input's output was lost once this
                    // transaction committed past it (h2 break-it, #27: 8 inputs of a
                    // partition). The check `redo` makes for inputs read again applies.
                    if matches!(outcome, Some(ClaimOutcome::Duplicate { .. }))
                        && self
                            .redo(std::slice::from_ref(msg), std::slice::from_ref(&outcome))
                            .await?[0]
                    {
                        tracing::debug!(
                            key = key.as_deref().unwrap_or_default(),
                            at = %msg.position,
                            "completed by a transaction that did not commit while waited out; processing it"
                        );
                        outcome = None;
                    }
                    if matches!(outcome, Some(ClaimOutcome::InProgress { .. })) {
                        core.tracker.take_revoked_flag();
                        let r = self.abort_and_rewind(&mut st, "partitions revoked").await;
                        self.release_unreached(&taken, i).await;
                        return r;
                    }
                }
                match outcome {
                    Some(ClaimOutcome::Duplicate { .. }) => {
                        core.metrics.add(Metric::DuplicateSkipped, 1);
                    }
                    Some(ClaimOutcome::Mismatch { stored, given }) => {
                        let err =
                            conflict_error(key.as_deref().unwrap_or_default(), msg, stored, given);
                        // Routed like a transform that failed for good; never a stop by itself.
                        tracing::warn!(error = %err, "payload conflicts with its key's fingerprint; routed by on_failure");
                        if !self
                            .reached(
                                &taken,
                                i,
                                self.give_up(&mut st, at, err, 1, None, false).await,
                            )
                            .await?
                        {
                            return Ok(());
                        }
                    }
                    Some(ClaimOutcome::Claimed { token }) => {
                        let k = key.clone().expect("claimed implies key");
                        let tx = self.tx_name(st.tx_seq);
                        st.claims.push(Completion {
                            key: k,
                            token,
                            result: Some(origin_of(core.consumer.group(), &tx, msg)),
                        });
                        if !self
                            .reached(&taken, i, self.process(&mut st, at, key.as_deref()).await)
                            .await?
                        {
                            return Ok(());
                        }
                    }
                    Some(ClaimOutcome::InProgress { .. }) => unreachable!("waited out above"),
                    None if key.is_none() && cfg.require_key => {
                        let err = super::missing_key_error(&cfg.key, msg);
                        tracing::warn!(error = %err, "keyless message refused; routed by on_failure");
                        if !self
                            .reached(
                                &taken,
                                i,
                                self.give_up(&mut st, at, err, 1, None, false).await,
                            )
                            .await?
                        {
                            return Ok(());
                        }
                    }
                    None => {
                        if key.is_none() && core.store.is_some() {
                            core.metrics.add(Metric::Keyless, 1);
                        }
                        if !self
                            .reached(&taken, i, self.process(&mut st, at, key.as_deref()).await)
                            .await?
                        {
                            return Ok(());
                        }
                    }
                }
                // A batch holds runs of one partition's inputs: the position to commit is the
                // highest of the run (one map entry per run, not per input; a redelivery can
                // come behind newer inputs, see `Position::highest`).
                let run_ends = msgs
                    .get(i + 1)
                    .is_none_or(|next| next.partition != msg.partition || next.topic != msg.topic);
                if run_ends {
                    raise_position(&mut st, msg, &msgs[run_start..=i]);
                }
                st.inputs += 1;
            }
        }
        if !self.flush(&mut st).await? {
            return Ok(());
        }
        self.join_prefetch(&mut st).await;
        if st.tx.is_none() && msgs.is_empty() {
            // Idle with every input committed: commit past what the platform skipped (Kafka:
            // markers and aborted records after the last input), or lag never reaches 0.
            core.maybe_commit_skipped().await?;
        }
        if self.due(&st) {
            self.commit(&mut st).await?;
        }
        Ok(())
    }

    /// Whether the open transaction is due to commit: it holds
    /// [`PipelineConfig::max_transaction_inputs`] inputs, or began
    /// [`PipelineConfig::transaction_interval`] ago.
    fn due(&self, st: &TxState) -> bool {
        st.tx.is_some()
            && (st.inputs >= self.config.max_transaction_inputs
                || st
                    .started
                    .is_some_and(|s| s.elapsed() >= self.config.transaction_interval))
    }

    /// The open transaction is due part-way through a batch, before input `at.i`: commits the
    /// inputs finished so far (their outputs and positions) and begins the next transaction
    /// for the rest of the batch (`rest_keys`: their store keys). Checked only at the end of
    /// a batch, a transaction lasted a whole batch (`batch_size` × the transform's time),
    /// and one longer than the platform's transaction timeout was aborted by its coordinator
    /// under it: the pipeline failed, every time, with no output (h1 break-it, #27: 500
    /// inputs of 15 ms against Pulsar's `transaction_timeout_ms=5000`).
    ///
    /// Where the commit would acknowledge an input of the rest (see
    /// [`TxLoop::commit_before`]), the batch goes on in the same transaction. `Ok(false)`:
    /// the commit failed and the consumer was rewound; the rest of the batch is abandoned.
    async fn commit_mid_batch(
        &self,
        st: &mut TxState,
        at: At<'_>,
        rest_keys: &[Option<String>],
    ) -> Result<bool> {
        raise_to_run_so_far(st, at);
        let rest = &at.msgs[at.i..];
        if !commits_none_of(st, rest) {
            return Ok(true);
        }
        // The keys of the rest stay in flight: a redelivery of one in a later batch is a
        // duplicate of the input still to come, not a claim to wait out.
        let inflight: Vec<(String, Option<u128>)> = rest_keys
            .iter()
            .flatten()
            .filter_map(|k| st.inflight.get(k).map(|fp| (k.clone(), *fp)))
            .collect();
        tracing::debug!(at = %at.msg().position, "transaction due part-way through a batch; committing the inputs before it");
        if !self.commit_tx(st).await? {
            return Ok(false);
        }
        // A rewind of the next transaction seeks back to the rest where nothing is committed.
        st.note_first(rest);
        st.inflight.extend(inflight);
        self.begin_tx(st).await?;
        Ok(true)
    }

    /// Begins the next transaction of this run.
    async fn begin_tx(&self, st: &mut TxState) -> Result<()> {
        st.tx = Some(self.producer.begin().await?);
        st.tx_seq += 1;
        st.started = Some(Instant::now());
        Ok(())
    }

    /// Waits for the poll running ahead, if any, and keeps its batch for the next step. After
    /// this no poll runs until the next step starts one, so the consumer's group generation
    /// and assignment stay as they are while a transaction commits. A poll serves rebalances
    /// (librdkafka runs the rebalance callback in it): one running while the commit reads the
    /// group metadata could hand it the new generation's, and the broker would then accept
    /// offsets of a partition revoked while the transaction was open (KIP-447 fences only an
    /// old generation) that its new owner was already reading from the older offset.
    async fn join_prefetch(&self, st: &mut TxState) {
        // A batch already in (`Ready`) stays as it is: dropping it here would lose it, as the
        // consumer has moved past its inputs.
        st.prefetch = match st.prefetch.take() {
            Some(running @ Prefetch::Running(_)) => Some(Prefetch::Ready(running.batch().await)),
            other => other,
        };
    }

    /// Waits for the batch polled ahead, if any, and drops it unprocessed, adding its
    /// partitions to those a rewind seeks back: the consumer is past its inputs, and no seek
    /// may race a poll.
    async fn drop_prefetch(&self, st: &mut TxState) {
        let Some(next) = st.prefetch.take() else {
            return;
        };
        if let Ok(msgs) = next.batch().await {
            st.note_first(&msgs);
        }
    }

    /// Transforms `msg` and sends its outputs in the open transaction. `Ok(false)` when the
    /// transaction was aborted (the batch is abandoned and re-read).
    async fn process(&self, st: &mut TxState, at: At<'_>, key: Option<&str>) -> Result<bool> {
        let core = self.core;
        let msg = at.msg();
        // Built on the first failure only: the backoff's builder was a per-input cost.
        let mut delays = None;
        let mut attempt = 1u32;
        let (outputs, parent) = loop {
            // Each attempt in a process span of its own, as the idempotent mode's handler runs.
            let (result, cx) = core
                .in_process_span_of(&mut st.spans, msg, self.transform.transform_traced(msg))
                .await;
            match result {
                Ok(o) => break (o.records, o.parent.or(cx)),
                Err(e) => {
                    core.metrics.add(Metric::HandlerError, 1);
                    match delays.get_or_insert_with(|| core.config.backoff()).next() {
                        Some(d) if e.is_retriable() => {
                            core.metrics.add(Metric::Retry, 1);
                            attempt += 1;
                            tokio::time::sleep(d).await;
                        }
                        _ => {
                            let _ = key;
                            return self.give_up(st, at, e, attempt, cx, true).await;
                        }
                    }
                }
            }
        };
        let mut outputs = outputs;
        set_output_ids(super::output_key(&core.config.key, msg), &mut outputs);
        let n = outputs.len() as u64;
        // Sent with the rest of the batch (pipelined) by `flush`, before positions commit, each
        // as a child of this input's process span.
        st.pending
            .extend(outputs.into_iter().map(|r| (r, parent.clone())));
        core.metrics.add(Metric::Produced, n);
        core.metrics.add(Metric::Processed, 1);
        Ok(true)
    }

    /// `msg` failed for good with `e` after `attempts` (a transform, a payload conflicting with
    /// its key's fingerprint, a keyless message refused by `require_key`): dead-lettered in the
    /// transaction when a dead-letter topic is set (`Ok(true)`: go on with the batch);
    /// otherwise the transaction commits the inputs finished before `msg` (see
    /// [`TxLoop::commit_before`]; where it cannot, it is aborted) and the consumer is rewound
    /// to `msg`, and then an error with [`OnFailure::Stop`], or a wait of the redelivery delay
    /// and `Ok(false)` (the rest of the batch, from `msg` on, is read again).
    async fn give_up(
        &self,
        st: &mut TxState,
        at: At<'_>,
        e: Error,
        attempts: u32,
        cx: Option<opentelemetry::Context>,
        claimed: bool,
    ) -> Result<bool> {
        let core = self.core;
        let msg = at.msg();
        if self.dead_letter(st, msg, &e, attempts, cx).await? {
            // Finished by the dead-letter record in this transaction; free the key (if `msg`
            // claimed it: a conflicting copy did not) so a later replay of the message runs
            // again.
            if claimed {
                self.release_claim_of(st, msg).await?;
            }
            return Ok(true);
        }
        self.commit_before(st, at, claimed).await?;
        if core.config.on_failure == OnFailure::Stop {
            return Err(e.context(format!(
                "{} {} after {attempts} attempt(s)",
                msg.topic_partition(),
                msg.position
            )));
        }
        core.metrics.add(Metric::RedeliveryRequested, 1);
        tokio::time::sleep(core.config.redelivery_delay).await;
        Ok(false)
    }

    /// Enqueues the outputs gathered so far in the open transaction; their delivery reports
    /// are awaited by [`TxLoop::settle`] before the transaction commits, so the next batch is
    /// read while they are in flight. `Ok(false)` when a report already failed and the
    /// transaction was aborted and rewound.
    async fn flush(&self, st: &mut TxState) -> Result<bool> {
        if st.pending.is_empty() {
            return Ok(true);
        }
        // Drained, not taken: `pending` keeps its capacity for the next batch (regrowing a
        // batch's worth of records each time showed in K4's profile), and the two vectors
        // handed on are allocated once at their size.
        let n = st.pending.len();
        let (mut records, mut parents) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for (r, p) in st.pending.drain(..) {
            records.push(r);
            parents.push(p);
        }
        let tx = st
            .tx
            .as_mut()
            .expect("pending outputs imply an open transaction");
        let reports = tx.enqueue_batch_in(records, &parents).await;
        st.in_flight.push(reports);
        Ok(true)
    }

    /// Awaits every delivery report of the open transaction. `Ok(false)` when a send failed
    /// and the transaction was aborted and rewound.
    async fn settle(&self, st: &mut TxState) -> Result<bool> {
        let mut failed = None;
        for reports in std::mem::take(&mut st.in_flight) {
            if failed.is_none() {
                failed = reports.await.into_iter().find_map(|r| r.err());
            }
        }
        match failed {
            None => Ok(true),
            Some(e) => {
                self.abort_and_rewind(st, "send failed").await?;
                if e.kind() == ErrorKind::Fenced || !e.is_retriable() {
                    return Err(e);
                }
                Ok(false)
            }
        }
    }

    /// The name of transaction `seq` of this run, in origins and commit markers.
    fn tx_name(&self, seq: u64) -> String {
        format!("{:016x}-{seq}", self.incarnation)
    }

    /// The dedup-store key recording that transaction `tx` committed.
    fn tx_marker(&self, tx: &str) -> String {
        format!("{}/onceflow.tx/{tx}", self.core.namespace)
    }

    /// For each message of a batch, whether its key, found completed, must be processed again:
    /// the completion names this very input as its origin, the group has not committed that
    /// position, and the transaction that completed it left no commit marker (so an offset
    /// reset that re-reads committed work still skips it). Any other copy of a key is a
    /// duplicate: its origin is committed, or is an input this group reads again (or is still
    /// processing) and writes once. One committed-positions lookup and one marker read per
    /// batch, none when no duplicate names itself.
    async fn redo(&self, msgs: &[Message], outcomes: &[Option<ClaimOutcome>]) -> Result<Vec<bool>> {
        let core = self.core;
        let group = core.consumer.group();
        let mut candidates: Vec<(usize, TopicPartition, Position, &str)> = Vec::new();
        for (i, (m, o)) in msgs.iter().zip(outcomes).enumerate() {
            if let Some(ClaimOutcome::Duplicate { result: Some(r) }) = o {
                if let Some(origin) = parse_origin(r) {
                    if origin.group == group
                        && origin.tp.topic == m.topic
                        && origin.tp.partition == m.partition
                        && m.position == origin.position
                    {
                        candidates.push((i, origin.tp, origin.position, origin.tx));
                    }
                }
            }
        }
        let mut redo = vec![false; msgs.len()];
        if candidates.is_empty() {
            return Ok(redo);
        }
        let mut tps: Vec<TopicPartition> = Vec::new();
        for (_, tp, ..) in &candidates {
            if !tps.contains(tp) {
                tps.push(tp.clone());
            }
        }
        let committed: HashMap<TopicPartition, Option<Position>> = core
            .consumer
            .committed(&tps)
            .await?
            .into_iter()
            .map(|c| (c.partition, c.next))
            .collect();
        // Kept: inputs whose position the group has not committed (next to read ≤ position).
        candidates.retain(|(_, tp, position, _)| {
            committed
                .get(tp)
                .and_then(|p| p.as_ref())
                .is_none_or(|next| {
                    !matches!(
                        next.partial_cmp(position),
                        Some(std::cmp::Ordering::Greater)
                    )
                })
        });
        if candidates.is_empty() {
            return Ok(redo);
        }
        let store = core.store.as_ref().expect("duplicates imply a store");
        let markers: Vec<String> = candidates.iter().map(|c| self.tx_marker(c.3)).collect();
        let found = store.get(&markers).await?;
        for ((i, ..), marker) in candidates.iter().zip(found) {
            redo[*i] = !matches!(marker, Some(KeyState::Completed { .. }));
        }
        Ok(redo)
    }

    /// Records in the dedup store that transaction `seq` of this run committed (read by
    /// [`TxLoop::redo`]). A failure is logged, not returned: the transaction is committed
    /// either way, and only an offset reset that re-reads its inputs would write them again.
    async fn mark_committed(&self, seq: u64) {
        let Some(store) = &self.core.store else {
            return;
        };
        let key = self.tx_marker(&self.tx_name(seq));
        let req = crate::dedup::ClaimRequest {
            key: key.clone(),
            owner: self.core.config.worker_id.clone(),
            lease: self.core.config.lease,
            fingerprint: None,
        };
        let r = async {
            if let ClaimOutcome::Claimed { token } = store.claim_one(req).await? {
                store.complete_one(&key, token, None).await?;
            }
            Ok::<_, Error>(())
        }
        .await;
        if let Err(e) = r {
            tracing::warn!(error = %e, %key, "recording a committed transaction in the dedup store failed");
        }
    }

    /// Sends `msg` to the dead-letter topic inside the transaction if one is configured, as a
    /// child of `parent` (the failed attempt's process span) when given.
    async fn dead_letter(
        &self,
        st: &mut TxState,
        msg: &Message,
        err: &Error,
        attempts: u32,
        parent: Option<opentelemetry::Context>,
    ) -> Result<bool> {
        let OnFailure::DeadLetter(topic) = &self.core.config.on_failure else {
            return Ok(false);
        };
        st.pending
            .push((dead_letter_record(topic, msg, err, attempts), parent));
        self.core.metrics.add(Metric::DeadLettered, 1);
        Ok(true)
    }

    async fn commit(&self, st: &mut TxState) -> Result<()> {
        self.commit_tx(st).await.map(drop)
    }

    /// Commits the open transaction: `Ok(true)` when it committed (or none was open);
    /// `Ok(false)` when it was aborted and the consumer rewound to the committed positions.
    async fn commit_tx(&self, st: &mut TxState) -> Result<bool> {
        let core = self.core;
        if !self.flush(st).await? || !self.settle(st).await? {
            return Ok(false);
        }
        // No poll may run from here to the end of the commit, and a revocation that a poll
        // served while the transaction was open aborts it: its inputs may be another member's
        // now (see `join_prefetch`).
        self.join_prefetch(st).await;
        if st.tx.is_some() && core.tracker.take_revoked_flag() {
            self.abort_and_rewind(st, "partitions revoked").await?;
            return Ok(false);
        }
        // The keys are completed before the transaction commits, each with the position of
        // the input that claimed it: a crash between the two leaves keys completed by a
        // transaction that did not commit, which `origin_committed` tells from real
        // duplicates by the group's committed positions. (Completing after the commit left a
        // window where a crash kept keys claimed although their outputs were committed, and
        // a later duplicate send of one was processed again.)
        let mut completed = false;
        if let Some(store) = &core.store {
            if !st.claims.is_empty() {
                completed = true;
                let claims = std::mem::take(&mut st.claims);
                let ok = store.complete(&claims).await?;
                let refused = ok.iter().filter(|b| !**b).count();
                if refused > 0 {
                    // Another worker took over a key (its lease ran out): its outputs are
                    // theirs to write. Abort and re-read.
                    core.metrics.add(Metric::Fenced, refused as u64);
                    self.abort_and_rewind(st, "claims taken over before the commit")
                        .await?;
                    return Ok(false);
                }
            }
        }
        let Some(mut tx) = st.tx.take() else {
            return Ok(true);
        };
        let positions: Vec<(TopicPartition, Position)> = st
            .positions
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let result = async {
            if !positions.is_empty() {
                let md = core.consumer.group_metadata().ok_or_else(|| {
                    Error::new(
                        ErrorKind::Fenced,
                        "consumer has no group metadata (left the group)",
                    )
                })?;
                tx.commit_offsets(&md, &positions).await?;
            }
            tx.commit().await
        }
        .await;
        match result {
            Ok(()) => {
                core.metrics.add(Metric::TransactionCommitted, 1);
                core.metrics.add(Metric::Commit, 1);
                if completed {
                    self.mark_committed(st.tx_seq).await;
                }
                st.claims.clear();
                st.inflight.clear();
                st.positions.clear();
                st.first.clear();
                st.inputs = 0;
                st.started = None;
                Ok(true)
            }
            Err(e) => {
                core.metrics.add(Metric::TransactionAborted, 1);
                if e.kind() == ErrorKind::Fenced {
                    core.metrics.add(Metric::Fenced, 1);
                }
                tracing::warn!(error = %e, "transaction commit failed; rewinding");
                self.release(st).await;
                if e.outcome_unknown() {
                    // It may still commit: settle it (a new producer epoch) before the rewind
                    // reads the committed positions, or the batch is redone after a commit that
                    // lands late and is written twice.
                    self.settle_unknown_outcome().await?;
                }
                self.rewind(st).await?;
                // A retriable `Fenced` is group fencing (KIP-447: the group's generation moved
                // on during the transaction): the transaction is lost, not the producer, so
                // go on from the committed positions like any aborted transaction.
                if e.kind() == ErrorKind::Fenced && !e.is_retriable() {
                    Err(e)
                } else if e.is_retriable() || e.outcome_unknown() || e.kind() == ErrorKind::Aborted
                {
                    Ok(false)
                } else {
                    Err(e)
                }
            }
        }
    }

    /// Settles an unknown commit outcome ([`Producer::settle_transactions`]), retrying with the
    /// engine's backoff while the platform cannot be reached; then fails the pipeline (a restart
    /// settles it on its first transaction) rather than redo work that may be committed.
    async fn settle_unknown_outcome(&self) -> Result<()> {
        let mut delays = self.core.config.backoff();
        loop {
            match self.producer.settle_transactions().await {
                Ok(()) => return Ok(()),
                Err(e) if e.is_retriable() => match delays.next() {
                    Some(wait) => {
                        tracing::warn!(error = %e, ?wait, "settling a transaction of unknown outcome failed; retrying");
                        tokio::time::sleep(wait).await;
                    }
                    // Stop rather than redo work whose earlier outcome is unknown.
                    None => return Err(e.context("settling a transaction of unknown outcome")),
                },
                Err(e) => return Err(e),
            }
        }
    }

    async fn release(&self, st: &mut TxState) {
        if let Some(store) = &self.core.store {
            let claims: Vec<(String, FencingToken)> =
                st.claims.drain(..).map(|c| (c.key, c.token)).collect();
            if !claims.is_empty() {
                if let Err(e) = store.release(&claims).await {
                    tracing::warn!(error = %e, "releasing claims after an abort failed; they expire with their lease");
                }
            }
        }
        st.claims.clear();
    }

    /// `at.msg()` failed for good: commits what the open transaction finished before it (the
    /// inputs of earlier batches and of this batch before `msg`, their outputs and positions)
    /// and rewinds the consumer to `msg`, so that one failing input costs its own redelivery,
    /// not the work of the whole transaction. (Aborting it all made a transform failing now
    /// and then, with `max_attempts=1`, redo every transaction of a backlog: none of a few
    /// hundred inputs committed, #27.) `claimed`: `msg` holds its key's claim, released here,
    /// not completed.
    ///
    /// A commit acknowledges, per partition, every input given out up to the position it
    /// commits; where an input not finished (`msg`, or one after it in the batch: single
    /// redeliveries come behind newer inputs on Pulsar shared / key_shared) sits at or below
    /// that position, the transaction is aborted instead and everything re-read.
    async fn commit_before(&self, st: &mut TxState, at: At<'_>, claimed: bool) -> Result<()> {
        let msg = at.msg();
        if claimed {
            if let Err(e) = self.release_claim_of(st, msg).await {
                tracing::warn!(error = %e, "releasing a failed input's claim failed; it expires with its lease");
            }
        }
        raise_to_run_so_far(st, at);
        if !commits_none_of(st, &at.msgs[at.i..]) {
            return self.abort_and_rewind(st, "input failed").await;
        }
        // The rewind after the commit seeks back every partition this transaction read, the
        // whole batch's included (the commit forgets them).
        let first = st.first.clone();
        tracing::debug!(at = %msg.position, "input failed; committing the inputs before it");
        if self.commit_tx(st).await? {
            st.first = first;
            self.rewind(st).await?;
        }
        Ok(())
    }

    /// `r`: whether the batch goes on after input `i` (`Ok(true)`); where it does not
    /// (`Ok(false)`: aborted or rewound; an error: the pipeline stops), the claims `taken` of
    /// the inputs after `i` are released, and `r` returned.
    async fn reached(
        &self,
        taken: &[(usize, String, FencingToken)],
        i: usize,
        r: Result<bool>,
    ) -> Result<bool> {
        if !matches!(r, Ok(true)) {
            self.release_unreached(taken, i).await;
        }
        r
    }

    /// Releases the claims `taken` by a batch for its inputs after `i`, which the batch never
    /// reached: claimed with the batch, neither completed nor in the transaction's claims.
    async fn release_unreached(&self, taken: &[(usize, String, FencingToken)], i: usize) {
        let Some(store) = &self.core.store else {
            return;
        };
        let claims: Vec<(String, FencingToken)> = taken
            .iter()
            .filter(|(j, _, _)| *j > i)
            .map(|(_, k, t)| (k.clone(), *t))
            .collect();
        if claims.is_empty() {
            return;
        }
        if let Err(e) = store.release(&claims).await {
            tracing::warn!(error = %e, "releasing the claims of inputs not reached failed; they expire with their lease");
        }
    }

    /// Takes `msg`'s claim out of the open transaction's claims and releases it in the store
    /// (not completed: the input is not finished), if the transaction holds one.
    async fn release_claim_of(&self, st: &mut TxState, msg: &Message) -> Result<()> {
        let (Some(store), Some(k)) = (&self.core.store, self.core.store_key(msg)) else {
            return Ok(());
        };
        if let Some(i) = st.claims.iter().position(|c| c.key == k) {
            let c = st.claims.remove(i);
            store.release_one(&c.key, c.token).await?;
        }
        Ok(())
    }

    async fn abort_and_rewind(&self, st: &mut TxState, why: &str) -> Result<()> {
        tracing::debug!(why, "aborting transaction");
        if let Some(tx) = st.tx.take() {
            let r = tx.abort().await;
            self.core.metrics.add(Metric::TransactionAborted, 1);
            if let Err(e) = r {
                if e.kind() == ErrorKind::Fenced {
                    return Err(e);
                }
                tracing::warn!(error = %e, "abort failed");
            }
        }
        self.release(st).await;
        self.rewind(st).await
    }

    /// Gives out again every input of the aborted transaction, from the group's committed
    /// position ([`Consumer::rewind_uncommitted`](crate::Consumer::rewind_uncommitted)), or,
    /// where none is committed, from the transaction's first input.
    async fn rewind(&self, st: &mut TxState) -> Result<()> {
        self.drop_prefetch(st).await;
        let consumer = &self.core.consumer;
        let assigned = consumer.assignment();
        let tps: Vec<TopicPartition> = st
            .first
            .keys()
            .filter(|tp| assigned.contains(tp))
            .cloned()
            .collect();
        self.core.tracker.rewind_all();
        for tp in consumer.rewind_uncommitted(&tps).await? {
            consumer
                .seek(&tp, &StartFrom::Position(st.first[&tp].clone()))
                .await?;
        }
        st.positions.clear();
        st.first.clear();
        st.inflight.clear();
        st.pending.clear();
        st.in_flight.clear();
        st.inputs = 0;
        st.started = None;
        Ok(())
    }
}

/// Raises the open transaction's position of `at.msg()`'s partition to the highest input of
/// its run finished before it (`at.run_start..at.i`; a run's position is otherwise added at
/// the run's end).
fn raise_to_run_so_far(st: &mut TxState, at: At<'_>) {
    raise_position(st, at.msg(), &at.msgs[at.run_start..at.i]);
}

/// Raises the open transaction's position of `of`'s partition to the highest of `done` (inputs
/// of that partition's run, finished); nothing when `done` is empty.
fn raise_position(st: &mut TxState, of: &Message, done: &[Message]) {
    if let Some(highest) = Position::highest(done.iter().map(|m| &m.position)) {
        match st.positions.entry(of.topic_partition()) {
            Entry::Occupied(mut e) => e.get_mut().raise_to(highest),
            Entry::Vacant(e) => {
                e.insert(highest.clone());
            }
        }
    }
}

/// Whether committing the open transaction now acknowledges none of `rest` (inputs read and
/// not finished): it acknowledges, per partition, every input given out up to the position it
/// commits, and single redeliveries come behind newer inputs (Pulsar shared / key_shared).
/// False when the transaction holds no input.
fn commits_none_of(st: &TxState, rest: &[Message]) -> bool {
    st.inputs > 0
        && rest.iter().all(|m| {
            st.positions
                .get(&m.topic_partition())
                .is_none_or(|p| p.partial_cmp(&m.position) == Some(std::cmp::Ordering::Less))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_ids_are_the_input_key_and_the_output_index() {
        let mut outputs: Vec<Record> = (0..3).map(|_| Record::new("out", "x")).collect();
        set_output_ids(Some("@in/2/offset:7".to_string()), &mut outputs);
        let ids: Vec<_> = outputs
            .iter()
            .map(|r| r.idempotency_key.clone().unwrap())
            .collect();
        assert_eq!(
            ids,
            ["@in/2/offset:7:0", "@in/2/offset:7:1", "@in/2/offset:7:2"]
        );
        let mut one = vec![Record::new("out", "x")];
        set_output_ids(Some("k".to_string()), &mut one);
        assert_eq!(one[0].idempotency_key.as_deref(), Some("k:0"));
        let mut none = vec![Record::new("out", "x")];
        set_output_ids(None, &mut none);
        assert_eq!(none[0].idempotency_key, None);
        set_output_ids(Some("k".to_string()), &mut []);
    }

    #[test]
    fn origins_keep_any_position_and_read_the_old_offset_form() {
        let mut m = Message {
            topic: "in".into(),
            partition: 2,
            position: Position::Offset(7),
            key: None,
            payload: Bytes::from_static(b"v"),
            headers: Default::default(),
            timestamp: None,
            delivery_count: 1,
        };
        let kafka = origin_of("g", "tx-1", &m);
        assert_eq!(
            &kafka[..],
            b"onceflow-origin/1\ng\nin\n2\n7\ntx-1".as_slice()
        );
        let o = parse_origin(&kafka).unwrap();
        assert_eq!(
            (o.group, o.position, o.tx),
            ("g", Position::Offset(7), "tx-1")
        );
        m.position = Position::MessageId {
            ledger: 12,
            entry: 3,
            partition: 2,
            batch: -1,
        };
        let pulsar = origin_of("g", "tx-2", &m);
        let o = parse_origin(&pulsar).unwrap();
        assert_eq!(
            o.position, m.position,
            "a Pulsar message id is kept, not dropped"
        );
        assert_eq!(o.tp, TopicPartition::new("in", 2));
        assert!(parse_origin(b"onceflow-origin/1\ng\nin\n2\nnot-a-position\ntx").is_none());
    }
}
