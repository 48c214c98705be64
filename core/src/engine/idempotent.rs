//! The idempotent consumer: at-least-once delivery plus a dedup store.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::join_all;
use opentelemetry::context::FutureExt as _;
use parking_lot::Mutex;

use super::claims::conflict_error;
use super::tracker::{CommitOnRevoke, Tracker};
use super::{dead_letter_record, EngineConfig, Handler, KeyStrategy, OnFailure};
use crate::backend::{Guarantee, PartitionLag};
use crate::client::{Consumer, Producer};
use crate::dedup::{
    fingerprint, ClaimOutcome, ClaimRequest, Completion, DedupStore, DedupStoreExt, FencingToken,
};
use crate::error::{Error, ErrorKind, Result};
use crate::metrics::{Metric, Metrics, MetricsSnapshot};
use crate::model::{Message, Position, TopicPartition};
use crate::trace;

/// Claims a chunk holds: the message's index in the chunk (its key is the chunk's `keys[i]`)
/// and the fencing token.
type Held = Mutex<Vec<(usize, FencingToken)>>;

/// The store keys of a chunk's messages (`None`: no key, or no store) and the completions
/// handled but not yet sent to the store: a key moves into its completion (no copy per
/// message), so a held claim's key is in one of the two.
struct ChunkKeys {
    keys: Vec<Option<String>>,
    completions: Vec<Completion>,
    /// Message index of each pending completion.
    completed: Vec<usize>,
}

/// Shared by the handling and the lease renewal of a chunk.
type Keys = Mutex<ChunkKeys>;

/// The store keys of `held` claims, for the store's renew and release calls (pending
/// completions included: they are held until the store has them).
fn held_keys(held: &[(usize, FencingToken)], ck: &ChunkKeys) -> Vec<(String, FencingToken)> {
    held.iter()
        .filter_map(|(i, t)| ck.keys[*i].clone().map(|k| (k, *t)))
        .chain(ck.completions.iter().map(|c| (c.key.clone(), c.token)))
        .collect()
}

/// The claims among a chunk's claim `outcomes`: each claimed message's index and token.
fn claimed(outcomes: &[Option<ClaimOutcome>]) -> Vec<(usize, FencingToken)> {
    outcomes
        .iter()
        .enumerate()
        .filter_map(|(i, o)| match o {
            Some(ClaimOutcome::Claimed { token }) => Some((i, *token)),
            _ => None,
        })
        .collect()
}

/// One partition's chunk while it is handled: the partition and the generation it was polled
/// in, its messages, their keys and the claims it holds (shared with the lease renewal).
#[derive(Clone, Copy)]
struct Chunk<'a> {
    tp: &'a TopicPartition,
    generation: u64,
    msgs: &'a [Message],
    keys: &'a Keys,
    held: &'a Held,
}

/// A handler's result for one message, or its last error and the attempts made.
type HandlerResult = std::result::Result<Option<Bytes>, (Error, u32)>;

/// How a run ended.
#[derive(Debug, Clone)]
pub struct RunSummary {
    /// Counters at the end of the run.
    pub metrics: MetricsSnapshot,
    /// The guarantee the run had.
    pub guarantee: Guarantee,
    /// Whether shutdown finished all work in flight before its deadline.
    pub drained: bool,
}

/// Consumes with at-least-once delivery and runs a [`Handler`] once per idempotency key.
///
/// For every message: a **claim** of its key in the dedup store (with a lease and a fencing
/// token) before the handler; **complete** after the handler succeeds; **release** when it
/// fails for good, so a redelivery runs it again. Duplicates of completed keys are skipped and
/// counted. Leases are renewed while handlers run. Positions are committed per partition, in
/// order, only up to the last message whose work is finished; on revocation finished work is
/// committed first and in-flight work of the partition is fenced.
///
/// Guarantee: [`Guarantee::EffectivelyOnce`] with a store: the handler runs once per key,
/// except when the process dies after a handler's side effect and before the key is completed
/// (then the redelivery runs it again: keep side effects idempotent, or write them in the same
/// transaction as the key with a transactional store). [`Guarantee::AtLeastOnce`] without one.
pub struct IdempotentConsumer {
    core: Arc<Core>,
}

pub(crate) struct Core {
    pub(crate) consumer: Consumer,
    pub(crate) store: Option<Arc<dyn DedupStore>>,
    pub(crate) handler: Arc<dyn Handler>,
    pub(crate) config: EngineConfig,
    pub(crate) dlq: Option<Producer>,
    pub(crate) metrics: Metrics,
    pub(crate) tracker: Tracker,
    pub(crate) namespace: String,
    last_commit: Mutex<Instant>,
    /// Retriable poll failures in a row ([`Core::poll`]'s backoff).
    poll_failures: std::sync::atomic::AtomicU32,
}

impl IdempotentConsumer {
    /// An idempotent consumer over `consumer`, deduplicating through `store` (`None`: plain
    /// at-least-once), running `handler`. Installs its rebalance listener on the consumer.
    pub fn new(
        consumer: Consumer,
        store: Option<Arc<dyn DedupStore>>,
        handler: impl Handler + 'static,
    ) -> Self {
        Self::build(
            consumer,
            store,
            Arc::new(handler),
            EngineConfig::default(),
            None,
        )
        .expect("default engine config is valid")
    }

    /// Like [`IdempotentConsumer::new`] with explicit settings and a producer for the
    /// dead-letter topic (required by [`OnFailure::DeadLetter`]).
    ///
    /// Errors: [`ErrorKind::Config`] for invalid settings.
    pub fn with_config(
        consumer: Consumer,
        store: Option<Arc<dyn DedupStore>>,
        handler: Arc<dyn Handler>,
        config: EngineConfig,
        dead_letter_producer: Option<Producer>,
    ) -> Result<Self> {
        Self::build(consumer, store, handler, config, dead_letter_producer)
    }

    fn build(
        consumer: Consumer,
        store: Option<Arc<dyn DedupStore>>,
        handler: Arc<dyn Handler>,
        config: EngineConfig,
        dlq: Option<Producer>,
    ) -> Result<Self> {
        config.validate()?;
        if matches!(config.on_failure, OnFailure::DeadLetter(_)) && dlq.is_none() {
            return Err(Error::config(
                "on_failure is DeadLetter but no dead-letter producer was given",
            ));
        }
        let core = Core::new(consumer, store, handler, config, dlq, false);
        Ok(IdempotentConsumer {
            core: Arc::new(core),
        })
    }

    /// Counters of this consumer (live: read them while it runs).
    pub fn metrics(&self) -> Metrics {
        self.core.metrics.clone()
    }

    /// The guarantee this consumer runs with.
    pub fn guarantee(&self) -> Guarantee {
        if self.core.store.is_some() {
            Guarantee::EffectivelyOnce
        } else {
            Guarantee::AtLeastOnce
        }
    }

    /// Lag per assigned partition, also recorded on the `onceflow.lag` gauge.
    pub async fn lag(&self) -> Result<Vec<PartitionLag>> {
        let lag = self.core.consumer.lag().await?;
        self.core.metrics.record_lag(&lag);
        Ok(lag)
    }

    /// Polls once, handles what arrived and commits if a commit is due. Returns how many
    /// messages were polled.
    pub async fn step(&self) -> Result<usize> {
        let n = self.core.step().await?;
        self.core.maybe_commit(false).await?;
        Ok(n)
    }

    /// Runs until an error stops it or `shutdown` resolves; then stops fetching, finishes work
    /// in flight (within [`EngineConfig::shutdown_deadline`]), commits and closes the consumer.
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) -> Result<RunSummary> {
        let guarantee = self.guarantee();
        let core = self.core;
        let drained = drive(&core, shutdown, |c| Box::pin(c.step())).await?;
        Ok(RunSummary {
            metrics: core.metrics.snapshot(),
            guarantee,
            drained,
        })
    }

    /// Runs until an error stops it (see [`IdempotentConsumer::run_until`]).
    pub async fn run(self) -> Result<RunSummary> {
        self.run_until(std::future::pending()).await
    }
}

type StepFuture<'a> = std::pin::Pin<Box<dyn Future<Output = Result<usize>> + Send + 'a>>;

/// The run loop shared by the idempotent consumer and the non-transactional pipeline: step until
/// shutdown or error, then drain within the deadline, commit and close.
pub(crate) async fn drive<'a>(
    core: &'a Arc<Core>,
    shutdown: impl Future<Output = ()>,
    step: impl Fn(&'a Core) -> StepFuture<'a>,
) -> Result<bool> {
    let mut shutdown = std::pin::pin!(shutdown);
    let mut stopping = false;
    let mut drained = true;
    let outcome: Result<()> = loop {
        if stopping {
            break Ok(());
        }
        let mut fut = step(core);
        let r = tokio::select! {
            biased;
            r = &mut fut => Some(r),
            _ = &mut shutdown => None,
        };
        let r = match r {
            Some(r) => r,
            None => {
                stopping = true;
                match tokio::time::timeout(core.config.shutdown_deadline, fut).await {
                    Ok(r) => r,
                    Err(_) => {
                        drained = false;
                        tracing::warn!(
                            "shutdown deadline passed with work in flight; it is not committed"
                        );
                        Ok(0)
                    }
                }
            }
        };
        if let Err(e) = r {
            break Err(e);
        }
        if let Err(e) = core.maybe_commit(false).await {
            break Err(e);
        }
    };
    // Commit what is finished, whatever stopped us, unless the consumer itself is gone.
    let closed = matches!(&outcome, Err(e) if e.kind() == ErrorKind::Closed);
    if !closed {
        let commit = core.maybe_commit(true).await;
        let close = core.consumer.close().await;
        outcome?;
        commit?;
        close?;
    } else {
        outcome?;
    }
    Ok(drained)
}

/// What happened to one message.
enum Done {
    /// Finished: handled, skipped as duplicate, or dead-lettered.
    Finished,
    /// Handed back to the platform (nack); on platforms without per-message nack the rest of
    /// the partition's chunk is abandoned.
    Redelivered,
    /// Fenced: lease or partition lost; abandon the chunk.
    Fenced,
}

impl Core {
    pub(crate) fn new(
        consumer: Consumer,
        store: Option<Arc<dyn DedupStore>>,
        handler: Arc<dyn Handler>,
        config: EngineConfig,
        dlq: Option<Producer>,
        transactional: bool,
    ) -> Self {
        let metrics = Metrics::new(consumer.platform(), consumer.group());
        let tracker = Tracker::new(metrics.clone());
        // A store out of reach for a while is waited for, not the end of the run.
        let store = store
            .map(|s| super::store_retry::Retrying::wrap(s, config.min_backoff, config.max_backoff));
        consumer
            .backend()
            .set_rebalance_listener(Arc::new(CommitOnRevoke {
                tracker: tracker.clone(),
                transactional,
            }));
        let namespace = config
            .namespace
            .clone()
            .unwrap_or_else(|| consumer.group().to_string());
        Core {
            consumer,
            store,
            handler,
            config,
            dlq,
            metrics,
            tracker,
            namespace,
            last_commit: Mutex::new(Instant::now()),
            poll_failures: std::sync::atomic::AtomicU32::new(0),
        }
    }

    /// The store key of a message, if it has an idempotency key: `{namespace}/{key}`, with
    /// `#requeue-{n}` for a requeued generation `n` ([`crate::Record::requeue`]).
    pub(crate) fn store_key(&self, m: &Message) -> Option<String> {
        let k = self.store_key_of_generation_zero(m)?;
        Some(
            match m.headers.get_any_case(crate::model::KEY_GENERATION_HEADER) {
                Some(Some(g)) => crate::model::with_generation(k, g),
                _ => k,
            },
        )
    }

    fn store_key_of_generation_zero(&self, m: &Message) -> Option<String> {
        // The common case, a UTF-8 header, costs one allocation.
        if let KeyStrategy::Header(name) = &self.config.key {
            match m.headers.get_any_case(name) {
                Some(Some(v)) if !v.is_empty() => {
                    if let Ok(k) = std::str::from_utf8(v) {
                        let mut s = String::with_capacity(self.namespace.len() + 1 + k.len());
                        s.push_str(&self.namespace);
                        s.push('/');
                        s.push_str(k);
                        return Some(s);
                    }
                }
                // Keyless: no dedup record (it used to fall back to a coordinates key).
                _ => return None,
            }
        }
        if let KeyStrategy::Coordinates = &self.config.key {
            // `KeyStrategy::key_of`'s `@topic/partition/position` written once into the store
            // key, not formatted and then copied behind the namespace.
            use std::fmt::Write as _;
            let mut s = String::with_capacity(self.namespace.len() + m.topic.len() + 40);
            s.push_str(&self.namespace);
            s.push_str("/@");
            s.push_str(&m.topic);
            s.push('/');
            let _ = write!(s, "{}/{}", m.partition, m.position);
            return Some(s);
        }
        self.config
            .key
            .find_key(m)
            .map(|k| format!("{}/{k}", self.namespace))
    }

    /// Whether keys are looked up at all: with a store, or to refuse keyless messages.
    pub(crate) fn needs_keys(&self) -> bool {
        self.store.is_some() || self.config.require_key
    }

    pub(crate) fn claim_request(&self, key: String, m: &Message) -> ClaimRequest {
        ClaimRequest {
            key,
            owner: self.config.worker_id.clone(),
            lease: self.config.lease,
            fingerprint: self.config.fingerprint.then(|| fingerprint(&m.payload)),
        }
    }

    /// Polls a batch. A retriable failure of the poll itself (the platform out of reach for a
    /// while, e.g. a Pulsar consumer subscribing again after an outage: nothing was delivered)
    /// is logged, waited out with the engine's backoff (`min_backoff` doubling up to
    /// `max_backoff`) and reads as an empty batch, so the run goes on once the platform is
    /// back; any other error stops the run.
    pub(crate) async fn poll(&self) -> Result<Vec<Message>> {
        use std::sync::atomic::Ordering::Relaxed;
        match self
            .consumer
            .poll(self.config.batch_size, self.config.poll_timeout)
            .await
        {
            Ok(msgs) => {
                self.poll_failures.store(0, Relaxed);
                Ok(msgs)
            }
            Err(e)
                if e.is_retriable()
                    && !matches!(e.kind(), ErrorKind::Fenced | ErrorKind::Closed) =>
            {
                let n = self.poll_failures.fetch_add(1, Relaxed).min(16);
                let wait = self
                    .config
                    .min_backoff
                    .saturating_mul(1 << n)
                    .min(self.config.max_backoff);
                tracing::warn!(error = %e, ?wait, failures = n + 1, "poll failed; retrying");
                tokio::time::sleep(wait).await;
                Ok(Vec::new())
            }
            Err(e) => Err(e),
        }
    }

    /// Polls once and handles the batch; partitions concurrently, each in order.
    pub(crate) async fn step(&self) -> Result<usize> {
        let msgs = self.poll().await?;
        let n = msgs.len();
        if n == 0 {
            return Ok(0);
        }
        self.metrics.add(Metric::Consumed, n as u64);
        let chunks = split_by_partition(msgs);
        if chunks.len() == 1 {
            let (tp, chunk) = chunks.into_iter().next().expect("one chunk");
            self.process_chunk(tp, chunk).await?;
        } else {
            let results = join_all(
                chunks
                    .into_iter()
                    .map(|(tp, chunk)| self.process_chunk(tp, chunk)),
            )
            .await;
            for r in results {
                r?;
            }
        }
        Ok(n)
    }

    /// Handles one partition's messages in order: claims their keys ([`Core::claim_batch`]),
    /// handles them ([`Core::handle_chunk`]) while renewing the claims held, and releases
    /// whatever claim is still held at the end (not completed: free for the redelivery).
    async fn process_chunk(&self, tp: TopicPartition, msgs: Vec<Message>) -> Result<()> {
        let generation = self.tracker.generation(&tp);
        // Keys only matter with a store (or to refuse keyless messages).
        let mut keys: Vec<Option<String>> = if self.needs_keys() {
            msgs.iter().map(|m| self.store_key(m)).collect()
        } else {
            vec![None; msgs.len()]
        };
        // A key repeated within the chunk (a redelivery arriving with its original) is claimed
        // once; later copies are duplicates of the first.
        let outcomes = self.claim_batch(&msgs, &mut keys, None).await?.outcomes;
        let keys: Keys = Mutex::new(ChunkKeys {
            keys,
            completions: Vec::new(),
            completed: Vec::new(),
        });
        // Claims this chunk holds (renewed while handlers run).
        let held: Held = Mutex::new(claimed(&outcomes));
        let chunk = Chunk {
            tp: &tp,
            generation,
            msgs: &msgs,
            keys: &keys,
            held: &held,
        };
        let work = self.handle_chunk(&chunk, outcomes);
        let result = if held.lock().is_empty() {
            work.await
        } else {
            self.with_renewal(&held, &keys, (&tp, generation), work)
                .await
        };
        // Whatever is still held was not completed: free it for the redelivery.
        let leftover = std::mem::take(&mut *held.lock());
        if let (Some(store), false) = (&self.store, leftover.is_empty()) {
            let claims = held_keys(&leftover, &keys.lock());
            store.release(&claims).await?;
        }
        result
    }

    /// Runs `work` (a chunk's handling), renewing the held claims every third of the lease
    /// until it finishes, so a handler longer than the lease keeps its claims. Once the
    /// partition `(tp, generation)` moved away (or was rewound) it stops renewing: the work is
    /// fenced, and its keys are for the partition's next owner once their leases run out.
    /// (JetStream keeps the messages' ack deadline alive itself while they are delivered and
    /// not acknowledged.)
    async fn with_renewal<T>(
        &self,
        held: &Held,
        keys: &Keys,
        (tp, generation): (&TopicPartition, u64),
        work: impl Future<Output = T>,
    ) -> T {
        let mut work = std::pin::pin!(work);
        if let std::task::Poll::Ready(v) = futures::poll!(&mut work) {
            return v;
        }
        let period = self.config.lease / 3;
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        loop {
            tokio::select! {
                v = &mut work => return v,
                _ = ticker.tick() => {
                    if self.tracker.generation(tp) != generation {
                        continue;
                    }
                    let claims = held_keys(&held.lock(), &keys.lock());
                    let Some(store) = &self.store else { continue };
                    match store.renew(&claims, self.config.lease).await {
                        Ok(ok) => {
                            let lost = ok.iter().filter(|b| !**b).count();
                            if lost > 0 {
                                self.metrics.add(Metric::Fenced, lost as u64);
                                tracing::warn!(lost, "leases lost while handling; completions will be refused");
                            }
                        }
                        Err(e) => tracing::warn!(error = %e, "lease renewal failed"),
                    }
                }
            }
        }
    }

    /// Handles `chunk`'s messages in order, then completes the keys handled and records the
    /// partition's progress. The steps: [`Core::handle_in_order`] runs each message's step
    /// until one stops the chunk; [`Core::redeliver_rest`] asks again for what it left while the
    /// partition is still ours; [`Core::complete_handled`] sends the completions; the tracker
    /// finishes the partition up to the first message not finished.
    async fn handle_chunk(
        &self,
        chunk: &Chunk<'_>,
        outcomes: Vec<Option<ClaimOutcome>>,
    ) -> Result<()> {
        let Chunk {
            tp,
            generation,
            msgs,
            ..
        } = *chunk;
        let per_message_nack = self.consumer.capabilities().per_message_nack;
        let (done_upto, stop) = self
            .handle_in_order(chunk, outcomes, per_message_nack)
            .await?;
        if done_upto < msgs.len() && self.tracker.generation(tp) == generation {
            // Stopped before the end (fenced by a lost lease, an error) with the partition still
            // ours: the rest was not handled. Ask for it again, or a later commit of messages
            // polled after it would cover it unhandled.
            self.redeliver_rest(tp, &msgs[done_upto..], per_message_nack)
                .await;
        }
        let finished_upto = self.complete_handled(chunk, done_upto).await?;
        // The highest position finished, not the last: redeliveries can come behind newer
        // messages in one batch, and committing the last would leave the newer ones unacked.
        if let Some(highest) = Position::highest(msgs[..finished_upto].iter().map(|m| &m.position))
        {
            // Counted in messages: `commit_every` is a message count (it counted chunks, so a
            // batch consumer committed only every `commit_interval`, issue 24).
            self.tracker
                .finish(tp, generation, highest.clone(), finished_upto as u64);
        }
        match stop {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Runs each message's step ([`Core::handle_one`]) in order until one stops the chunk: the
    /// partition moved away, a claim stays another worker's, a redelivery where the platform
    /// cannot nack one message alone, or an error. Returns the index one past the last message
    /// whose work is done (its completion pending) and the error that stopped the chunk; `Err`
    /// when waiting out another worker's claim failed (the chunk ends there, nothing completed).
    async fn handle_in_order(
        &self,
        chunk: &Chunk<'_>,
        mut outcomes: Vec<Option<ClaimOutcome>>,
        per_message_nack: bool,
    ) -> Result<(usize, Option<Error>)> {
        let Chunk {
            tp,
            generation,
            msgs,
            keys,
            held,
        } = *chunk;
        let mut done_upto = 0usize;
        let batched = self.handler.batched();
        // Handler results of a batched run, by message index, taken as the loop reaches them.
        let mut ready: Vec<Option<HandlerResult>> = Vec::new();
        for (i, msg) in msgs.iter().enumerate() {
            let mut outcome = outcomes[i].take();
            if self.tracker.generation(tp) != generation {
                self.metrics.add(Metric::Fenced, 1);
                break;
            }
            // Wait out another worker's claim on this key: its completion, release or the end
            // of its lease.
            if matches!(outcome, Some(ClaimOutcome::InProgress { .. })) {
                let still_ours = || self.tracker.generation(tp) == generation;
                let key = || keys.lock().keys[i].clone().expect("claim implies key");
                outcome = self.wait_out(outcome, key, msg, still_ours).await?;
                if let Some(ClaimOutcome::Claimed { token }) = &outcome {
                    held.lock().push((i, *token));
                }
            }
            if self.tracker.generation(tp) != generation {
                self.metrics.add(Metric::Fenced, 1);
                break;
            }
            if batched
                && self.runnable(keys, i, &outcome)
                && ready.get(i).is_none_or(Option::is_none)
            {
                self.run_batch_from(chunk, i, &outcomes, &mut ready).await;
            }
            let handled = ready.get_mut(i).and_then(Option::take);
            match self.handle_one(chunk, i, outcome, handled).await {
                Ok(Done::Finished) => done_upto = i + 1,
                Ok(Done::Redelivered) if per_message_nack => done_upto = i + 1,
                Ok(Done::Redelivered) | Ok(Done::Fenced) => break,
                Err(e) => return Ok((done_upto, Some(e))),
            }
        }
        Ok((done_upto, None))
    }

    /// Whether message `j`, with claim `outcome`, needs the handler: claimed, or no claim made
    /// (no store) and not a keyless message refused by `require_key`.
    fn runnable(&self, keys: &Keys, j: usize, outcome: &Option<ClaimOutcome>) -> bool {
        match outcome {
            None => !(self.config.require_key && keys.lock().keys[j].is_none()),
            Some(ClaimOutcome::Claimed { .. }) => true,
            _ => false,
        }
    }

    /// A batch handler's one call for the run of messages from `i` that need the handler (up
    /// to the first that does not, by `outcomes`); its results go into `ready` by index.
    async fn run_batch_from(
        &self,
        chunk: &Chunk<'_>,
        i: usize,
        outcomes: &[Option<ClaimOutcome>],
        ready: &mut Vec<Option<HandlerResult>>,
    ) {
        let Chunk {
            tp,
            generation,
            msgs,
            keys,
            ..
        } = *chunk;
        let end = (i + 1..msgs.len())
            .find(|&j| !self.runnable(keys, j, &outcomes[j]))
            .unwrap_or(msgs.len());
        let results = self.run_batch_handler(tp, generation, &msgs[i..end]).await;
        ready.resize_with(msgs.len(), || None);
        for (slot, r) in ready[i..end].iter_mut().zip(results) {
            *slot = Some(r);
        }
    }

    /// Message `i`'s step by its claim `outcome`: a duplicate is skipped, a fingerprint
    /// mismatch or a keyless message refused by `require_key` goes to `on_failure`, a claimed
    /// or unclaimed one runs the handler (or takes its batched result, `handled`) and, claimed,
    /// queues its key's completion; a claim still another worker's fences the chunk.
    async fn handle_one(
        &self,
        chunk: &Chunk<'_>,
        i: usize,
        outcome: Option<ClaimOutcome>,
        handled: Option<HandlerResult>,
    ) -> Result<Done> {
        let Chunk {
            tp,
            generation,
            msgs,
            keys,
            held,
        } = *chunk;
        let msg = &msgs[i];
        // Rare paths read a copy of the key; a completion takes it.
        let key_copy = || keys.lock().keys[i].clone();
        match outcome {
            Some(ClaimOutcome::Duplicate { result }) => {
                self.metrics.add(Metric::DuplicateSkipped, 1);
                self.handler.on_duplicate(msg, result).await;
                Ok(Done::Finished)
            }
            Some(ClaimOutcome::Mismatch { stored, given }) => {
                let err = conflict_error(&key_copy().unwrap_or_default(), msg, stored, given);
                tracing::warn!(error = %err, "payload conflicts with its key's fingerprint; routed by on_failure");
                self.give_up(tp, msg, None, err, 1).await
            }
            Some(ClaimOutcome::Claimed { token }) => {
                let result = match handled {
                    Some(r) => r,
                    None => self.run_handler(tp, generation, msg).await,
                };
                match result {
                    Ok(result) => {
                        let mut ck = keys.lock();
                        let key = ck.keys[i].take().expect("claimed implies key");
                        ck.completed.push(i);
                        ck.completions.push(Completion { key, token, result });
                        Ok(Done::Finished)
                    }
                    Err((err, attempts)) => {
                        let k = key_copy().expect("claimed implies key");
                        self.give_up(tp, msg, Some((i, &k, token, held)), err, attempts)
                            .await
                    }
                }
            }
            Some(ClaimOutcome::InProgress { .. }) => Ok(Done::Fenced),
            None if self.config.require_key && keys.lock().keys[i].is_none() => {
                let err = super::missing_key_error(&self.config.key, msg);
                tracing::warn!(error = %err, "keyless message refused; routed by on_failure");
                self.give_up(tp, msg, None, err, 1).await
            }
            None => {
                if self.store.is_some() && keys.lock().keys[i].is_none() {
                    self.metrics.add(Metric::Keyless, 1);
                }
                let result = match handled {
                    Some(r) => r,
                    None => self.run_handler(tp, generation, msg).await,
                };
                match result {
                    Ok(_) => {
                        self.metrics.add(Metric::Processed, 1);
                        Ok(Done::Finished)
                    }
                    Err((err, attempts)) => self.give_up(tp, msg, None, err, attempts).await,
                }
            }
        }
    }

    /// Sends the chunk's pending completions to the store and drops them from the held claims.
    /// Returns how far the partition is finished: `done_upto`, or the index of the first
    /// completion the store refused (its lease was lost: the partition is rewound to it). On a
    /// store error the keys go back to the chunk (still held, released at its end).
    async fn complete_handled(&self, chunk: &Chunk<'_>, done_upto: usize) -> Result<usize> {
        let Chunk {
            tp,
            msgs,
            keys,
            held,
            ..
        } = *chunk;
        let mut finished_upto = done_upto;
        let (completions, completed) = {
            let mut ck = keys.lock();
            (
                std::mem::take(&mut ck.completions),
                std::mem::take(&mut ck.completed),
            )
        };
        if completions.is_empty() {
            return Ok(finished_upto);
        }
        let store = self.store.as_ref().expect("completions imply a store");
        let ok = match store.complete(&completions).await {
            Ok(ok) => ok,
            Err(e) => {
                // Still held: the keys go back, so the chunk's end releases them.
                let mut ck = keys.lock();
                for (c, &i) in completions.into_iter().zip(&completed) {
                    ck.keys[i] = Some(c.key);
                }
                return Err(e);
            }
        };
        {
            let mut done = vec![false; msgs.len()];
            for &i in &completed {
                done[i] = true;
            }
            held.lock().retain(|(i, _)| !done[*i]);
        }
        if let Some(bad) = ok.iter().position(|b| !*b) {
            let refused = &completions[bad];
            self.metrics.add(Metric::Fenced, 1);
            tracing::warn!(key = %refused.key, "completion refused: lease lost to another worker");
            // Commit only up to the message before the refused one, and rewind to it.
            if let Some(&idx) = completed.get(bad) {
                finished_upto = finished_upto.min(idx);
                self.tracker.bump(tp);
                self.consumer
                    .nack(&msgs[idx], Duration::ZERO)
                    .await
                    .map_err(|e| e.context("rewinding after a refused completion"))?;
            }
        }
        self.metrics
            .add(Metric::Processed, ok.iter().filter(|b| **b).count() as u64);
        Ok(finished_upto)
    }

    /// Runs `work` (a handler's or a transform's call for `msg`) inside a `process {topic}`
    /// span, a child of the context `msg` carries (a malformed `traceparent` counted in the
    /// engine's metrics), and ends the span with the outcome; without tracing, just runs it.
    /// Returns the result (a failure as [`ErrorKind::Handler`]) and the span's context, `None`
    /// without tracing.
    pub(crate) async fn in_process_span<T>(
        &self,
        msg: &Message,
        work: impl Future<Output = std::result::Result<T, crate::BoxError>>,
    ) -> (Result<T>, Option<opentelemetry::Context>) {
        self.in_process_span_of(&mut None, msg, work).await
    }

    /// [`Core::in_process_span`] through the spans of a batch (`spans`, set on first use), so
    /// that the tracer is looked up once and a tracer that records nothing costs nothing.
    pub(crate) async fn in_process_span_of<T>(
        &self,
        spans: &mut Option<trace::ProcessSpans>,
        msg: &Message,
        work: impl Future<Output = std::result::Result<T, crate::BoxError>>,
    ) -> (Result<T>, Option<opentelemetry::Context>) {
        if !self.config.tracing {
            return (work.await.map_err(Error::handler), None);
        }
        let cx = spans.get_or_insert_with(trace::ProcessSpans::new).start(
            self.consumer.platform(),
            self.consumer.group(),
            msg,
            Some(&self.metrics),
        );
        let r = work.with_context(cx.clone()).await.map_err(Error::handler);
        trace::end(&cx, r.as_ref().err());
        (r, Some(cx))
    }

    /// Runs the handler with retries. Err carries the last error and the attempts made.
    async fn run_handler(
        &self,
        tp: &TopicPartition,
        generation: u64,
        msg: &Message,
    ) -> HandlerResult {
        let mut delays = self.config.backoff();
        let mut attempt = 1u32;
        loop {
            let (result, _) = self.in_process_span(msg, self.handler.handle(msg)).await;
            match result {
                Ok(r) => return Ok(r),
                Err(e) => {
                    self.metrics.add(Metric::HandlerError, 1);
                    tracing::debug!(error = %e, %tp, position = %msg.position, attempt, "handler failed");
                    if !e.is_retriable() {
                        return Err((e, attempt));
                    }
                    match delays.next() {
                        Some(d) => {
                            tokio::time::sleep(d).await;
                            if self.tracker.generation(tp) != generation {
                                return Err((
                                    Error::new(
                                        ErrorKind::Fenced,
                                        "partition revoked during retries",
                                    ),
                                    attempt,
                                ));
                            }
                            self.metrics.add(Metric::Retry, 1);
                            attempt += 1;
                        }
                        None => return Err((e, attempt)),
                    }
                }
            }
        }
    }

    /// Runs [`Handler::handle_batch`] on `msgs` with retries: one result per message, in
    /// order. When the call fails for good, every message gets the error (and the attempts).
    async fn run_batch_handler(
        &self,
        tp: &TopicPartition,
        generation: u64,
        msgs: &[Message],
    ) -> Vec<HandlerResult> {
        let mut delays = self.config.backoff();
        let mut attempt = 1u32;
        let err = loop {
            // One span for the call, in the context of its first message.
            let (result, _) = self
                .in_process_span(&msgs[0], self.handler.handle_batch(msgs))
                .await;
            let e = match result {
                Ok(rs) if rs.len() == msgs.len() => return rs.into_iter().map(Ok).collect(),
                Ok(rs) => Error::new(
                    ErrorKind::Handler,
                    format!(
                        "batch handler returned {} results for {} messages",
                        rs.len(),
                        msgs.len()
                    ),
                )
                .retriable(false),
                Err(e) => e,
            };
            self.metrics.add(Metric::HandlerError, 1);
            tracing::debug!(error = %e, %tp, position = %msgs[0].position, count = msgs.len(), attempt, "batch handler failed");
            if !e.is_retriable() {
                break e;
            }
            match delays.next() {
                Some(d) => {
                    tokio::time::sleep(d).await;
                    if self.tracker.generation(tp) != generation {
                        break Error::new(ErrorKind::Fenced, "partition revoked during retries");
                    }
                    self.metrics.add(Metric::Retry, 1);
                    attempt += 1;
                }
                None => break e,
            }
        };
        let mut out = Vec::with_capacity(msgs.len());
        for _ in 1..msgs.len() {
            let copy = Error::new(err.kind(), err.to_string()).retriable(err.is_retriable());
            out.push(Err((copy, attempt)));
        }
        out.insert(0, Err((err, attempt)));
        out
    }

    /// Retries are exhausted (or the failure is not retriable): release the claim and apply
    /// [`EngineConfig::on_failure`].
    /// Asks the platform to deliver `rest` (messages of `tp` not handled, in order) again:
    /// each nacked where the platform nacks per message, otherwise the partition rewound to the
    /// first (work taken before fenced). Failures are logged: the partition may just have moved.
    async fn redeliver_rest(&self, tp: &TopicPartition, rest: &[Message], per_message_nack: bool) {
        let targets = if per_message_nack { rest } else { &rest[..1] };
        if !per_message_nack {
            self.tracker.bump(tp);
        }
        for m in targets {
            if let Err(e) = self.consumer.nack(m, Duration::ZERO).await {
                tracing::warn!(error = %e, %tp, position = %m.position, "asking redelivery of an unhandled message failed");
            }
        }
    }

    async fn give_up(
        &self,
        tp: &TopicPartition,
        msg: &Message,
        claim: Option<(usize, &str, FencingToken, &Held)>,
        err: Error,
        attempts: u32,
    ) -> Result<Done> {
        if err.kind() == ErrorKind::Fenced {
            return Ok(Done::Fenced);
        }
        if let Some((index, key, token, held)) = claim {
            held.lock().retain(|(i, _)| *i != index);
            if let Some(store) = &self.store {
                store.release_one(key, token).await?;
            }
        }
        match &self.config.on_failure {
            OnFailure::DeadLetter(topic) => {
                let producer = self.dlq.as_ref().expect("checked at construction");
                producer
                    .send(dead_letter_record(topic, msg, &err, attempts))
                    .await
                    .map_err(|e| {
                        e.context(format!(
                            "sending {tp} {} to dead-letter topic '{topic}'",
                            msg.position
                        ))
                    })?;
                self.metrics.add(Metric::DeadLettered, 1);
                Ok(Done::Finished)
            }
            OnFailure::Redeliver => {
                self.metrics.add(Metric::RedeliveryRequested, 1);
                if !self.consumer.capabilities().per_message_nack {
                    self.tracker.bump(tp);
                }
                self.consumer
                    .nack(msg, self.config.redelivery_delay)
                    .await
                    .map_err(|e| {
                        e.context(format!("asking redelivery of {tp} {}", msg.position))
                    })?;
                Ok(Done::Redelivered)
            }
            _ => Err(err.context(format!("{tp} {} after {attempts} attempt(s)", msg.position))),
        }
    }

    /// With nothing finished to commit, once per commit interval: commits what the platform
    /// skipped without delivering
    /// ([`ConsumerBackend::commit_skipped`](crate::backend::ConsumerBackend::commit_skipped)).
    pub(crate) async fn maybe_commit_skipped(&self) -> Result<()> {
        {
            let mut last = self.last_commit.lock();
            if last.elapsed() < self.config.commit_interval {
                return Ok(());
            }
            *last = Instant::now();
        }
        match self.consumer.commit_skipped().await {
            Err(e) if e.is_retriable() || e.kind() == ErrorKind::Fenced => {
                tracing::debug!(error = %e, "commit past skipped records failed; retrying later");
                Ok(())
            }
            r => r,
        }
    }

    /// Commits finished positions if due (or always with `force`).
    pub(crate) async fn maybe_commit(&self, force: bool) -> Result<()> {
        let (positions, pending) = self.tracker.uncommitted();
        if positions.is_empty() {
            return self.maybe_commit_skipped().await;
        }
        let due = {
            let mut last = self.last_commit.lock();
            let due = force
                || pending >= self.config.commit_every
                || last.elapsed() >= self.config.commit_interval;
            if due {
                *last = Instant::now();
            }
            due
        };
        if !due {
            return Ok(());
        }
        match self.consumer.commit(&positions).await {
            Ok(()) => {
                self.tracker.committed(&positions);
                self.metrics.add(Metric::Commit, 1);
                Ok(())
            }
            Err(e) if e.kind() == ErrorKind::Fenced => {
                self.metrics.add(Metric::Fenced, 1);
                tracing::warn!(error = %e, "commit fenced: partitions moved; their work is dropped");
                for (tp, _) in &positions {
                    if !self.consumer.assignment().contains(tp) {
                        self.tracker.forget(tp);
                    }
                }
                Ok(())
            }
            Err(e) if e.is_retriable() => {
                tracing::warn!(error = %e, "commit failed; retrying with the next commit");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}

/// Outcome for a key seen again while its first copy is in flight: a duplicate, or a mismatch
/// when fingerprints are on and differ.
pub(crate) fn repeat_outcome(first: Option<u128>, this: Option<u128>) -> ClaimOutcome {
    match (first, this) {
        (Some(stored), Some(given)) if stored != given => ClaimOutcome::Mismatch { stored, given },
        _ => ClaimOutcome::Duplicate { result: None },
    }
}

fn split_by_partition(msgs: Vec<Message>) -> Vec<(TopicPartition, Vec<Message>)> {
    let mut chunks: Vec<(TopicPartition, Vec<Message>)> = Vec::new();
    for m in msgs {
        match chunks
            .iter_mut()
            .find(|(tp, _)| tp.partition == m.partition && tp.topic == m.topic)
        {
            Some((_, v)) => v.push(m),
            None => {
                let tp = m.topic_partition();
                chunks.push((tp, vec![m]));
            }
        }
    }
    chunks
}
