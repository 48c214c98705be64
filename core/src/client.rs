//! Public handles over the backend traits: [`Client`] (a connected platform), [`Producer`],
//! [`Transaction`], [`Consumer`] and [`Admin`]. They hold every platform-neutral rule —
//! validation, the `idempotency-key` header, trace propagation — so adapters stay translations.

use std::sync::Arc;
use std::time::Duration;

use crate::backend::{
    AdminBackend, Capabilities, ConsumerBackend, ConsumerConfig, GroupMetadata, Guarantee,
    PartitionLag, PlatformBackend, ProducerBackend, ProducerConfig, TopicDescription, TopicSpec,
    TransactionBackend,
};
use crate::error::{Error, ErrorKind, Result};
use crate::model::{Delivery, Message, Position, Record, StartFrom, TopicPartition};
use crate::trace;

/// Header that carries a record's idempotency key (see [`Record::idempotency_key`]); the
/// idempotent consumer reads it by default.
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";

/// A connected platform: makes producers, consumers and the admin handle.
#[derive(Clone)]
pub struct Client {
    backend: Arc<dyn PlatformBackend>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("platform", &self.backend.name())
            .finish()
    }
}

impl Client {
    /// Wraps an adapter's platform backend.
    pub fn new(backend: Arc<dyn PlatformBackend>) -> Self {
        Client { backend }
    }

    /// Platform name (`kafka`, `jetstream`, `pulsar`, `kinesis`, `memory`).
    pub fn platform(&self) -> &'static str {
        self.backend.name()
    }

    /// What the platform can do.
    pub fn capabilities(&self) -> Capabilities {
        self.backend.capabilities()
    }

    /// Checks a topic name against the platform's rules without contacting it (Kafka: 1 to
    /// 249 characters of `[a-zA-Z0-9._-]`); every record sent is checked the same way.
    ///
    /// Errors: [`ErrorKind::Config`] naming the topic and what was expected.
    pub fn validate_topic(&self, topic: &str) -> Result<()> {
        self.backend.validate_topic(topic)
    }

    /// The backend, for adapter-specific extensions.
    pub fn backend(&self) -> &Arc<dyn PlatformBackend> {
        &self.backend
    }

    /// Creates a producer.
    ///
    /// Errors: [`ErrorKind::Config`] for invalid options, [`ErrorKind::Connect`] when the
    /// platform cannot be reached.
    pub async fn producer(&self, config: ProducerConfig) -> Result<Producer> {
        let transactional = config.transactional_id.is_some();
        let inner = self.backend.producer(config).await?;
        Ok(Producer {
            inner,
            platform: self.backend.clone(),
            transactional,
            closed: Default::default(),
        })
    }

    /// Creates a consumer that joins `config.group` and subscribes to `config.topics`.
    ///
    /// Errors: [`ErrorKind::Config`] for an empty group or topic list or invalid options.
    pub async fn consumer(&self, config: ConsumerConfig) -> Result<Consumer> {
        if config.group.is_empty() {
            return Err(Error::config(
                "consumer group is empty: expected a group name",
            ));
        }
        if config.topics.is_empty() || config.topics.iter().any(|t| t.is_empty()) {
            return Err(Error::config(format!(
                "topics {:?}: expected at least one non-empty topic name",
                config.topics
            )));
        }
        config.start.validate()?;
        let group = config.group.clone();
        let topics = config.topics.clone();
        let inner = self.backend.consumer(config).await?;
        Ok(Consumer {
            inner,
            system: self.backend.name(),
            group,
            topics: Arc::new(topics),
            closed: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        })
    }

    /// The admin handle.
    pub async fn admin(&self) -> Result<Admin> {
        Ok(Admin {
            inner: self.backend.admin().await?,
        })
    }
}

/// A producer. Cheap to clone; clones share the native producer.
#[derive(Clone)]
pub struct Producer {
    inner: Arc<dyn ProducerBackend>,
    platform: Arc<dyn PlatformBackend>,
    transactional: bool,
    /// [`Producer::close`] was called (on this producer or a clone).
    closed: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("platform", &self.platform.name())
            .field("transactional", &self.transactional)
            .finish()
    }
}

impl Producer {
    /// What this producer can do.
    pub fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    /// Platform name.
    pub fn platform(&self) -> &'static str {
        self.platform.name()
    }

    /// The guarantee a write through this producer has: exactly-once inside transactions,
    /// effectively-once where the platform deduplicates retries (idempotent producer or message
    /// ids), at-least-once otherwise.
    pub fn guarantee(&self) -> Guarantee {
        let caps = self.capabilities();
        if self.transactional && caps.transactions {
            Guarantee::ExactlyOnce
        } else if caps.idempotent_producer || caps.dedup_by_id {
            Guarantee::EffectivelyOnce
        } else {
            Guarantee::AtLeastOnce
        }
    }

    /// The backend, for adapter-specific extensions.
    pub fn backend(&self) -> &Arc<dyn PlatformBackend> {
        &self.platform
    }

    /// Validates a record and writes the platform-neutral headers: `idempotency-key` and
    /// trace context. Returns the send span's context, `None` when the span records nothing.
    fn prepare(&self, record: &mut Record) -> Result<Option<opentelemetry::Context>> {
        prepare_record(self.platform.as_ref(), record)
    }

    /// Sends one record and waits for the platform's acknowledgement.
    ///
    /// Errors: [`ErrorKind::Config`] for an empty topic, a record over the platform's size limit
    /// (naming the size and the limit) or an invalid header; the platform's errors otherwise.
    pub async fn send(&self, mut record: Record) -> Result<Delivery> {
        self.refuse_if_closed()?;
        let cx = self.prepare(&mut record)?;
        let result = self.inner.send(record).await;
        if let Some(cx) = &cx {
            trace::end_send(cx, result.as_ref());
        }
        result
    }

    /// Sends records pipelined; one result per record, in order. A record that fails validation
    /// gets its error without stopping the others.
    pub async fn send_batch(&self, records: Vec<Record>) -> Vec<Result<Delivery>> {
        if self.is_closed() {
            return records.iter().map(|_| Err(closed_error())).collect();
        }
        let (valid, prep) = prepare_batch(self.platform.as_ref(), records);
        let sent = self.inner.send_batch(valid).await;
        merge_results(prep, sent)
    }

    /// Enqueues records and returns their delivery reports (one per record, in order) as a
    /// future that does not borrow the producer: the caller can hand over its next records
    /// while these are in flight, and the records of successive calls are sent in call order
    /// (on Kafka, librdkafka's queue; the idempotent producer keeps their order per
    /// partition). On Kafka the records wait up to `linger.ms` for later ones to join them
    /// until the future is first polled, and leave at once from then. A record that fails
    /// validation gets its error in its slot.
    pub async fn enqueue_batch(&self, records: Vec<Record>) -> crate::backend::DeliveriesFuture {
        if self.is_closed() {
            let refused: Vec<Result<Delivery>> =
                records.iter().map(|_| Err(closed_error())).collect();
            return Box::pin(async move { refused });
        }
        let (valid, prep) = prepare_batch(self.platform.as_ref(), records);
        let sent = self.inner.enqueue_batch(valid).await;
        Box::pin(async move { merge_results(prep, sent.await) })
    }

    /// Writes all records or none (platforms with [`Capabilities::atomic_batch`]).
    pub async fn send_atomic(&self, mut records: Vec<Record>) -> Result<Vec<Delivery>> {
        self.refuse_if_closed()?;
        let mut spans = Vec::new();
        for r in records.iter_mut() {
            spans.extend(self.prepare(r)?);
        }
        let result = self.inner.send_atomic(records).await;
        for cx in &spans {
            trace::end(cx, result.as_ref().err());
        }
        result
    }

    /// Starts a transaction. Needs a producer created with a transactional id on a platform
    /// with transactions; otherwise [`ErrorKind::Unsupported`] or [`ErrorKind::Config`];
    /// [`ErrorKind::Closed`] after [`Producer::close`].
    pub async fn begin(&self) -> Result<Transaction> {
        self.refuse_if_closed()?;
        if !self.capabilities().transactions {
            return Err(Error::unsupported(format!(
                "transactions are not supported on {}",
                self.platform.name()
            )));
        }
        if !self.transactional {
            return Err(Error::config(
                "this producer has no transactional id: create the producer with a transactional id to use transactions",
            ));
        }
        Ok(Transaction {
            inner: Some(self.inner.begin().await?),
            platform: self.platform.clone(),
        })
    }

    /// Settles a transaction whose commit ended with an unknown outcome
    /// ([`Error::outcome_unknown`]): returns once it is committed or aborted for good, so that
    /// committed positions read afterwards are final (Kafka: re-initialises the producer with a
    /// new epoch, KIP-98). A no-op where nothing is unsettled or the platform has no
    /// transactions.
    ///
    /// # Errors
    /// The platform's error when it cannot be reached (retriable: call again), or
    /// [`ErrorKind::Fenced`] when another producer took over the transactional id.
    pub async fn settle_transactions(&self) -> Result<()> {
        self.inner.settle_transactions().await
    }

    /// Waits until everything sent is acknowledged, at most `timeout`.
    pub async fn flush(&self, timeout: Duration) -> Result<()> {
        self.inner.flush(timeout).await
    }

    /// Flushes and releases the producer. From then on `send`, `send_batch`,
    /// `enqueue_batch`, `send_atomic` and `begin` (of this producer and its clones) are
    /// [`ErrorKind::Closed`]; a second `close` is a no-op.
    pub async fn close(&self) -> Result<()> {
        self.closed
            .store(true, std::sync::atomic::Ordering::Release);
        self.inner.close().await
    }

    fn is_closed(&self) -> bool {
        self.closed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// [`ErrorKind::Closed`] once [`Producer::close`] was called.
    fn refuse_if_closed(&self) -> Result<()> {
        if self.is_closed() {
            return Err(closed_error());
        }
        Ok(())
    }
}

/// What a closed producer's operations fail with.
fn closed_error() -> Error {
    Error::new(ErrorKind::Closed, "the producer is closed")
}

/// What [`prepare_batch`] set aside: the records that failed validation and the send spans
/// started, each by its index in the caller's batch, in ascending order.
struct BatchPrep {
    /// Records in the caller's batch.
    len: usize,
    failed: Vec<(usize, Error)>,
    /// Send spans to end (none for records that got no span, see [`trace::SendSpans`]).
    spans: Vec<(usize, opentelemetry::Context)>,
}

/// Validates and prepares records for a batched send, in place: returns the valid records, in
/// order, and what was set aside. No vector per record is made when every record is valid
/// and no span is started (a batch of 20 000 records otherwise paid for three fresh vectors
/// of that length).
fn prepare_batch(platform: &dyn PlatformBackend, records: Vec<Record>) -> (Vec<Record>, BatchPrep) {
    prepare_batch_in(platform, records, &[])
}

/// [`prepare_batch`] where record `i`'s producer span is a child of `parents[i]` when that is
/// given (see [`trace::SendSpans::on_send_in`]); records past the end of `parents`, or with
/// `None`, get the usual parent (the current context, else their own `traceparent`).
fn prepare_batch_in(
    platform: &dyn PlatformBackend,
    mut records: Vec<Record>,
    parents: &[Option<opentelemetry::Context>],
) -> (Vec<Record>, BatchPrep) {
    let len = records.len();
    let mut failed = Vec::new();
    let mut spans = Vec::new();
    let mut send_spans = trace::SendSpans::new(platform.name());
    let limit = platform.max_record_bytes();
    let mut index = 0;
    // The last topic found valid: a batch's records mostly share one.
    let mut valid_topic = String::new();
    records.retain_mut(|r| {
        let i = index;
        index += 1;
        let parent = parents.get(i).and_then(Option::as_ref);
        match prepare_with(platform, limit, &mut valid_topic, r, |r| {
            send_spans.on_send_in(r, parent)
        }) {
            Ok(cx) => {
                if let Some(cx) = cx {
                    spans.push((i, cx));
                }
                true
            }
            Err(e) => {
                failed.push((i, e));
                false
            }
        }
    });
    (records, BatchPrep { len, failed, spans })
}

/// Puts the backend's results for the valid records back between the validation errors, ending
/// each record's send span.
fn merge_results(prep: BatchPrep, sent: Vec<Result<Delivery>>) -> Vec<Result<Delivery>> {
    let missing = || Err(Error::new(ErrorKind::Platform, "missing delivery report"));
    if prep.failed.is_empty() {
        // Every record was sent: the results stay where they are (a copy into a new vector
        // was ~11 % of a 200 000-record batch's page faults).
        let mut sent = sent;
        sent.resize_with(prep.len, missing);
        for (i, cx) in &prep.spans {
            trace::end_send(cx, sent[*i].as_ref());
        }
        return sent;
    }
    let mut sent = sent.into_iter();
    let mut failed = prep.failed.into_iter().peekable();
    let mut spans = prep.spans.into_iter().peekable();
    let mut out = Vec::with_capacity(prep.len);
    for i in 0..prep.len {
        if let Some((_, e)) = failed.next_if(|(f, _)| *f == i) {
            out.push(Err(e));
            continue;
        }
        let r = sent.next().unwrap_or_else(missing);
        if let Some((_, cx)) = spans.next_if(|(s, _)| *s == i) {
            trace::end_send(&cx, r.as_ref());
        }
        out.push(r);
    }
    out
}

pub(crate) fn prepare_record(
    platform: &dyn PlatformBackend,
    record: &mut Record,
) -> Result<Option<opentelemetry::Context>> {
    let limit = platform.max_record_bytes();
    let system = platform.name();
    prepare_with(platform, limit, &mut String::new(), record, |r| {
        trace::on_send(system, r)
    })
}

/// Validates `record` (limit: the platform's `max_record_bytes`), writes the `idempotency-key`
/// header and, through `on_send`, the trace context. `valid_topic` is a topic already found
/// valid: the topic is checked again only when `record`'s differs, and kept once it passes.
fn prepare_with(
    platform: &dyn PlatformBackend,
    limit: usize,
    valid_topic: &mut String,
    record: &mut Record,
    on_send: impl FnOnce(&mut Record) -> Option<opentelemetry::Context>,
) -> Result<Option<opentelemetry::Context>> {
    if record.topic.is_empty() {
        return Err(Error::config(
            "record topic is empty: expected a topic name",
        ));
    }
    if *valid_topic != record.topic {
        platform.validate_topic(&record.topic)?;
        valid_topic.clone_from(&record.topic);
    }
    if let Some(k) = &record.idempotency_key {
        if k.is_empty() {
            return Err(Error::config(
                "record idempotency key is empty: expected a non-empty key or None",
            ));
        }
        record
            .headers
            .set(IDEMPOTENCY_KEY_HEADER, k.clone().into_bytes());
    }
    if record.key_generation()? > 0
        && record
            .headers
            .get_any_case(IDEMPOTENCY_KEY_HEADER)
            .is_none()
    {
        return Err(Error::config(format!(
            "record for topic '{}' is requeued (generation {}) but has no idempotency key: \
             expected an idempotency key to requeue",
            record.topic,
            record.key_generation()?
        )));
    }
    for h in record.headers.iter() {
        platform.validate_header(&h.name, h.value.as_deref())?;
    }
    let cx = on_send(record);
    let size = record.size_bytes();
    if size > limit {
        if let Some(cx) = &cx {
            trace::end(cx, None);
        }
        let source = platform
            .max_record_bytes_source()
            .map(|s| format!(" ({s})"))
            .unwrap_or_default();
        return Err(Error::config(format!(
            "record for topic '{}' is {size} bytes (key + payload + headers): the limit on {} is \
             {limit} bytes{source}",
            record.topic,
            platform.name()
        )));
    }
    Ok(cx)
}

/// An open transaction. Dropping it without [`Transaction::commit`] aborts it.
pub struct Transaction {
    inner: Option<Box<dyn TransactionBackend>>,
    platform: Arc<dyn PlatformBackend>,
}

impl std::fmt::Debug for Transaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transaction")
            .field("open", &self.inner.is_some())
            .finish()
    }
}

/// A `Closed` error (the finished transaction's `e`) for each record of `records`.
fn each_closed(records: &[Record], e: &Error) -> Vec<Result<Delivery>> {
    let msg = e.to_string();
    records
        .iter()
        .map(|_| Err(Error::new(ErrorKind::Closed, msg.clone())))
        .collect()
}

impl Transaction {
    fn inner(&mut self) -> Result<&mut Box<dyn TransactionBackend>> {
        self.inner
            .as_mut()
            .ok_or_else(|| Error::new(ErrorKind::Closed, "transaction already finished"))
    }

    /// Sends a record inside the transaction.
    pub async fn send(&mut self, mut record: Record) -> Result<Delivery> {
        let cx = prepare_record(self.platform.as_ref(), &mut record)?;
        let result = self.inner()?.send(record).await;
        if let Some(cx) = &cx {
            trace::end_send(cx, result.as_ref());
        }
        result
    }

    /// Sends records inside the transaction, pipelined where the platform allows, and waits
    /// for every report; one result per record, in order. A record that fails validation gets
    /// its error; the others are sent.
    ///
    /// Through the platform's [`TransactionBackend::send_batch`], not `enqueue_batch`: a call
    /// that waits for its reports has every record it will send, so the platform sends them
    /// at once (Kafka: without waiting `linger.ms`, which [`Transaction::enqueue_batch`] keeps
    /// so that later batches can join).
    pub async fn send_batch(&mut self, records: Vec<Record>) -> Vec<Result<Delivery>> {
        let (valid, prep) = prepare_batch(self.platform.as_ref(), records);
        let sent = match self.inner() {
            Ok(inner) => inner.send_batch(valid).await,
            Err(e) => each_closed(&valid, &e),
        };
        merge_results(prep, sent)
    }

    /// Enqueues records inside the transaction and returns their delivery reports (one per
    /// record, in order) as a future that does not borrow the transaction: the caller can read
    /// its next batch while the records are in flight. Await every such future before
    /// [`Transaction::commit_offsets`] / [`Transaction::commit`]; a failed report means the
    /// transaction must abort. A record that fails validation gets its error in its slot.
    pub async fn enqueue_batch(
        &mut self,
        records: Vec<Record>,
    ) -> crate::backend::DeliveriesFuture {
        self.enqueue_batch_in(records, &[]).await
    }

    /// [`Transaction::enqueue_batch`] where record `i` is sent as a child of `parents[i]` when
    /// that is given: a pipeline sends the outputs of many inputs in one batch, each output a
    /// child of its input's process span (a `None`, or a record past the end of `parents`, gets
    /// the usual parent: the current context, else its own `traceparent`).
    pub(crate) async fn enqueue_batch_in(
        &mut self,
        records: Vec<Record>,
        parents: &[Option<opentelemetry::Context>],
    ) -> crate::backend::DeliveriesFuture {
        let (valid, prep) = prepare_batch_in(self.platform.as_ref(), records, parents);
        let sent = match self.inner() {
            Ok(inner) => inner.enqueue_batch(valid).await,
            Err(e) => Box::pin(std::future::ready(each_closed(&valid, &e))),
        };
        Box::pin(async move { merge_results(prep, sent.await) })
    }

    /// Commits the consumer's positions (for each partition, the last processed message) with
    /// the transaction (Kafka `send_offsets_to_transaction`, KIP-447).
    ///
    /// Errors: [`crate::ErrorKind::Config`], before anything is sent, for a partition with an
    /// empty topic name or a negative number; [`crate::ErrorKind::Closed`] once the transaction
    /// has ended; the platform's errors otherwise ([`crate::ErrorKind::Fenced`] for a partition
    /// the group's member does not own).
    pub async fn commit_offsets(
        &mut self,
        group: &GroupMetadata,
        positions: &[(TopicPartition, Position)],
    ) -> Result<()> {
        let inner = self.inner()?;
        for (tp, _) in positions {
            check_partition_name("commit_offsets", tp)?;
        }
        inner.commit_offsets(group, positions).await
    }

    /// Commits the transaction.
    ///
    /// # Errors
    /// An error with [`Error::outcome_unknown`] (a commit that timed out) means the transaction
    /// may have committed or may still commit. The producer settles it before this returns
    /// where it can (Kafka: re-initialised with a new epoch, which fences the old producer and
    /// makes the coordinator finish the transaction); where it could not, the message says so
    /// and [`Producer::settle_transactions`] must succeed before the group's committed positions
    /// are read to decide what to redo, or the redone work may be written twice.
    pub async fn commit(mut self) -> Result<()> {
        let inner = self
            .inner
            .take()
            .ok_or_else(|| Error::new(ErrorKind::Closed, "transaction already finished"))?;
        inner.commit().await
    }

    /// Aborts the transaction.
    pub async fn abort(mut self) -> Result<()> {
        match self.inner.take() {
            Some(inner) => inner.abort().await,
            None => Ok(()),
        }
    }
}

/// A `Config` error from `op` for a partition with an empty topic name or a negative number.
fn check_partition_name(op: &str, tp: &TopicPartition) -> Result<()> {
    if tp.topic.is_empty() {
        return Err(Error::config(format!(
            "{op}: partition {} has an empty topic name: expected a topic name",
            tp.partition
        )));
    }
    if tp.partition < 0 {
        return Err(Error::config(format!(
            "{op}: partition {} of topic '{}': expected a partition number of 0 or more",
            tp.partition, tp.topic
        )));
    }
    Ok(())
}

/// A consumer group's committed position in one partition ([`Consumer::committed`]).
///
/// `next` is where the group resumes: the position of the message *after* the last processed
/// one, on every platform, as Kafka's committed offset is the next offset to read. It is not the
/// last processed position that [`Consumer::commit`] takes; passing it there would skip the
/// message at `next`. `None` where the group has committed nothing in the partition (or, on
/// Kinesis and Pulsar, nothing has been written after the committed message yet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Committed {
    /// The partition.
    pub partition: TopicPartition,
    /// The next position the group reads in it, or `None` if nothing is committed.
    pub next: Option<Position>,
}

/// A consumer: one member of a consumer group.
#[derive(Clone)]
pub struct Consumer {
    inner: Arc<dyn ConsumerBackend>,
    system: &'static str,
    group: String,
    /// The topics it subscribed to (for the errors of `rewind_uncommitted`).
    topics: Arc<Vec<String>>,
    /// Set by [`Consumer::close`] (shared by the clones).
    closed: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("platform", &self.system)
            .field("group", &self.group)
            .finish()
    }
}

impl Consumer {
    /// Platform name.
    pub fn platform(&self) -> &'static str {
        self.system
    }

    /// The consumer group.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// The backend (the engine installs its rebalance listener through it).
    pub fn backend(&self) -> &Arc<dyn ConsumerBackend> {
        &self.inner
    }

    /// What this consumer can do.
    pub fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    /// Fetches up to `max` messages, waiting at most `timeout` for the first (empty on timeout).
    pub async fn poll(&self, max: usize, timeout: Duration) -> Result<Vec<Message>> {
        if max == 0 {
            return Err(Error::config("poll max is 0: expected at least 1 message"));
        }
        self.inner.poll(max, timeout).await
    }

    /// Commits, per partition, the position of the last *processed* message: the group resumes
    /// after it. Unlike Kafka's `commitSync(offsets)`, which takes the next offset to read,
    /// this takes the message's own position (as [`Consumer::commit_message`] does); what
    /// [`Consumer::committed`] returns ([`Committed::next`]) is the next one and must not be
    /// passed back here, or the message at it is skipped.
    ///
    /// Of several positions given for one partition the highest is committed, whatever their
    /// order in `positions` (as Kafka users list a batch's messages).
    ///
    /// Errors: [`crate::ErrorKind::Config`], before anything is committed, for a partition
    /// with an empty topic name, a negative number, or of a topic this consumer does not read;
    /// [`crate::ErrorKind::Fenced`] for a partition no longer assigned to this member (or one
    /// the topic does not have).
    pub async fn commit(&self, positions: &[(TopicPartition, Position)]) -> Result<()> {
        if positions
            .iter()
            .any(|(tp, _)| !self.topics.contains(&tp.topic))
        {
            let assigned = self.inner.assignment();
            self.check_read("commit", positions.iter().map(|(tp, _)| tp), &assigned)?;
        } else {
            for (tp, _) in positions {
                check_partition_name("commit", tp)?;
            }
        }
        let mut highest: Vec<(TopicPartition, Position)> = Vec::with_capacity(positions.len());
        for (tp, pos) in positions {
            match highest.iter_mut().find(|(t, _)| t == tp) {
                Some((_, p)) => p.raise_to(pos),
                None => highest.push((tp.clone(), pos.clone())),
            }
        }
        self.inner.commit(&highest).await
    }

    /// Commits, for partitions where everything delivered is committed, the position the
    /// platform moved past without delivering anything (Kafka: transaction markers and aborted
    /// records, KAFKA-6607), so that lag reaches 0 after transactional input. A no-op where
    /// there is nothing such (and on platforms without offsets). Call it when idle; the engine
    /// does so itself.
    pub async fn commit_skipped(&self) -> Result<()> {
        self.inner.commit_skipped().await
    }

    /// Commits everything up to and including `message` in its partition.
    pub async fn commit_message(&self, message: &Message) -> Result<()> {
        self.inner
            .commit(&[(message.topic_partition(), message.position.clone())])
            .await
    }

    /// The group's committed position of each partition, in the order asked: where the group
    /// resumes ([`Committed::next`]), one past the last processed message, as Kafka's committed
    /// offset. It is not what [`Consumer::commit`] takes (the last *processed* position): the
    /// two are different types so that passing one for the other does not compile.
    pub async fn committed(&self, partitions: &[TopicPartition]) -> Result<Vec<Committed>> {
        Ok(self
            .inner
            .committed(partitions)
            .await?
            .into_iter()
            .map(|(partition, next)| Committed { partition, next })
            .collect())
    }

    /// Moves the fetch position of an assigned partition (replay).
    pub async fn seek(&self, partition: &TopicPartition, to: &StartFrom) -> Result<()> {
        to.validate()?;
        self.inner.seek(partition, to).await
    }

    /// After an aborted transaction: gives out again, in order and from the group's committed
    /// position, every message of `partitions` that [`Consumer::poll`] returned and no commit
    /// covered, without undoing any acknowledgement. Where the platform has a redelivery that
    /// keeps acknowledgements (Pulsar) it is used; elsewhere each partition is sought to its
    /// [`Consumer::committed`] position (exact where the group commits one position per
    /// partition, as Kafka and Kinesis do). On Pulsar a seek would be wrong: it resets the
    /// subscription's cursor and makes messages that a committed transaction acknowledged past
    /// the committed position unacknowledged again, so they would be processed twice. The
    /// [`Pipeline`](crate::Pipeline) does this after every aborted transaction; a hand-written
    /// transactional loop must do it after each [`Transaction::abort`] (or failed
    /// [`Transaction::commit`]) before it polls again, usually with [`Consumer::assignment`].
    ///
    /// `partitions` must be partitions assigned to this member now (a subset of
    /// [`Consumer::assignment`]); nothing is done unless every one is.
    ///
    /// Returns the partitions on which the group has committed nothing: they are left as they
    /// are, for the caller to seek (the pipeline seeks them to the transaction's first input).
    ///
    /// # Errors
    /// - [`ErrorKind::Closed`] when the consumer is closed (also for an empty list).
    /// - [`ErrorKind::Config`] for a partition with an empty topic name or a negative number,
    ///   or of a topic this consumer did not subscribe to, naming it.
    /// - [`ErrorKind::Fenced`] for a partition of a subscribed topic that is not assigned to
    ///   this member now (moved to another member, or a number the topic does not have),
    ///   naming it and the assignment.
    /// - The platform's error when the committed positions cannot be read or a seek fails.
    pub async fn rewind_uncommitted(
        &self,
        partitions: &[TopicPartition],
    ) -> Result<Vec<TopicPartition>> {
        self.check_rewindable(partitions)?;
        if partitions.is_empty() {
            return Ok(Vec::new());
        }
        let redelivered = self.inner.redeliver_uncommitted(partitions).await?;
        let rest: Vec<TopicPartition> = partitions
            .iter()
            .filter(|tp| !redelivered.contains(tp))
            .cloned()
            .collect();
        let mut uncommitted = Vec::new();
        if rest.is_empty() {
            return Ok(uncommitted);
        }
        for (tp, next) in self.inner.committed(&rest).await? {
            match next {
                Some(p) => self.inner.seek(&tp, &StartFrom::Position(p)).await?,
                None => uncommitted.push(tp),
            }
        }
        Ok(uncommitted)
    }

    /// `rewind_uncommitted`'s checks, before anything is done: open, and every partition
    /// assigned to this member.
    fn check_rewindable(&self, partitions: &[TopicPartition]) -> Result<()> {
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return Err(Error::new(
                ErrorKind::Closed,
                format!(
                    "rewind_uncommitted: the consumer of group '{}' is closed",
                    self.group
                ),
            ));
        }
        if partitions.is_empty() {
            return Ok(());
        }
        let assigned = self.inner.assignment();
        self.check_read("rewind_uncommitted", partitions.iter(), &assigned)?;
        for tp in partitions {
            if assigned.contains(tp) {
                continue;
            }
            let list = if assigned.is_empty() {
                "none".to_string()
            } else {
                assigned
                    .iter()
                    .map(|t| t.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            return Err(Error::new(
                ErrorKind::Fenced,
                format!(
                    "rewind_uncommitted: {tp} is not assigned to this member of group '{}': \
                     expected one of its partitions now ({list}); a partition moved to another \
                     member, or one the topic does not have, is never assigned here",
                    self.group
                ),
            ));
        }
        Ok(())
    }

    /// `op`'s checks of the partitions it is given, before anything is done: each names a
    /// topic this consumer reads (one it subscribed to, or of a partition in `assigned`) and a
    /// partition number of 0 or more; a `Config` error naming the first that does not. (A
    /// partition of such a name that is not assigned now is the platform's to refuse:
    /// `Fenced`.)
    fn check_read<'a>(
        &self,
        op: &str,
        partitions: impl Iterator<Item = &'a TopicPartition>,
        assigned: &[TopicPartition],
    ) -> Result<()> {
        // A subscription to a pattern (librdkafka reads a topic starting with `^` as a regular
        // expression) reads topics not named here: those are the platform's to judge.
        let patterns = self.topics.iter().any(|t| t.starts_with('^'));
        for tp in partitions {
            check_partition_name(op, tp)?;
            if !patterns
                && !self.topics.contains(&tp.topic)
                && !assigned.iter().any(|a| a.topic == tp.topic)
            {
                return Err(Error::config(format!(
                    "{op}: topic '{}' is not read by this consumer: expected one of the topics \
                     it subscribed to ({})",
                    tp.topic,
                    self.topics.join(", ")
                )));
            }
        }
        Ok(())
    }

    /// Stops fetching from partitions.
    pub async fn pause(&self, partitions: &[TopicPartition]) -> Result<()> {
        self.inner.pause(partitions).await
    }

    /// Resumes fetching from partitions.
    pub async fn resume(&self, partitions: &[TopicPartition]) -> Result<()> {
        self.inner.resume(partitions).await
    }

    /// Partitions assigned to this member now.
    pub fn assignment(&self) -> Vec<TopicPartition> {
        self.inner.assignment()
    }

    /// Lag per assigned partition (high watermark − committed position).
    pub async fn lag(&self) -> Result<Vec<PartitionLag>> {
        self.inner.lag().await
    }

    /// Group metadata for transactional offset commits.
    pub fn group_metadata(&self) -> Option<GroupMetadata> {
        self.inner.group_metadata()
    }

    /// Asks for a message to be delivered again after `delay`.
    pub async fn nack(&self, message: &Message, delay: Duration) -> Result<()> {
        self.inner.nack(message, delay).await
    }

    /// Leaves the group and releases the consumer (does not commit).
    pub async fn close(&self) -> Result<()> {
        self.closed
            .store(true, std::sync::atomic::Ordering::Release);
        self.inner.close().await
    }
}

/// The most partitions a topic can have: partition ids are `i32` (as Kafka's protocol has
/// them), so 2 147 483 647.
pub const MAX_PARTITIONS: u32 = i32::MAX as u32;

/// Topic administration.
#[derive(Clone)]
pub struct Admin {
    inner: Arc<dyn AdminBackend>,
}

impl Admin {
    /// Creates a topic with `spec.partitions` partitions (1 to [`MAX_PARTITIONS`]; a
    /// backend may allow fewer: `memory://` holds at most 100 000 per topic).
    ///
    /// Errors: [`ErrorKind::Config`] for an empty name or a partition count out of range,
    /// naming the value; otherwise what the platform reports.
    pub async fn create_topic(&self, spec: &TopicSpec) -> Result<()> {
        if spec.name.is_empty() {
            return Err(Error::config("topic name is empty: expected a name"));
        }
        if spec.partitions == 0 || spec.partitions > MAX_PARTITIONS {
            return Err(Error::config(format!(
                "topic '{}' with {} partitions: expected 1 to {MAX_PARTITIONS}",
                spec.name, spec.partitions
            )));
        }
        self.inner.create_topic(spec).await
    }

    /// Describes a topic ([`ErrorKind::NotFound`] if missing).
    pub async fn describe_topic(&self, name: &str) -> Result<TopicDescription> {
        self.inner.describe_topic(name).await
    }

    /// Deletes a topic ([`ErrorKind::NotFound`] if missing).
    pub async fn delete_topic(&self, name: &str) -> Result<()> {
        self.inner.delete_topic(name).await
    }

    /// Lag of a consumer group on every partition of a topic, without joining the group.
    pub async fn group_lag(&self, group: &str, topic: &str) -> Result<Vec<PartitionLag>> {
        self.inner.group_lag(group, topic).await
    }
}

impl ProducerConfig {
    /// A producer configuration with platform defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the transactional id.
    pub fn transactional_id(mut self, id: impl Into<String>) -> Self {
        self.transactional_id = Some(id.into());
        self
    }

    /// Adds a raw option for the native client.
    pub fn option(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.options.insert(key.into(), value.into());
        self
    }
}

impl ConsumerConfig {
    /// A consumer of `group` on `topics`, starting from the committed position or the earliest.
    pub fn new<T: Into<String>>(
        group: impl Into<String>,
        topics: impl IntoIterator<Item = T>,
    ) -> Self {
        ConsumerConfig {
            group: group.into(),
            topics: topics.into_iter().map(Into::into).collect(),
            ..Default::default()
        }
    }

    /// Sets where to start.
    pub fn start(mut self, start: StartFrom) -> Self {
        self.start = start;
        self
    }

    /// Sets the member name.
    pub fn client_id(mut self, id: impl Into<String>) -> Self {
        self.client_id = Some(id.into());
        self
    }

    /// Sets the session timeout.
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = Some(timeout);
        self
    }

    /// Adds a raw option for the native client.
    pub fn option(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.options.insert(key.into(), value.into());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivered(position: i64) -> Result<Delivery> {
        Ok(Delivery::new("t", 0, Position::Offset(position)))
    }

    fn offset(r: &Result<Delivery>) -> Option<i64> {
        match r.as_ref().ok()?.position {
            Position::Offset(o) => Some(o),
            _ => None,
        }
    }

    #[test]
    fn merge_puts_validation_errors_back_in_their_slots() {
        // Records 0..5; 1 and 4 failed validation; 2 got a span.
        let prep = BatchPrep {
            len: 5,
            failed: vec![(1, Error::config("one")), (4, Error::config("four"))],
            spans: vec![(2, opentelemetry::Context::new())],
        };
        let out = merge_results(prep, vec![delivered(10), delivered(11), delivered(12)]);
        assert_eq!(out.len(), 5);
        assert_eq!(offset(&out[0]), Some(10));
        assert!(out[1].as_ref().is_err_and(|e| e.message() == "one"));
        assert_eq!(offset(&out[2]), Some(11));
        assert_eq!(offset(&out[3]), Some(12));
        assert!(out[4].as_ref().is_err_and(|e| e.message() == "four"));
    }

    #[test]
    fn merge_reports_missing_results_as_platform_errors() {
        let all_valid = BatchPrep {
            len: 3,
            failed: Vec::new(),
            spans: Vec::new(),
        };
        let out = merge_results(all_valid, vec![delivered(1)]);
        assert_eq!(out.len(), 3);
        assert_eq!(offset(&out[0]), Some(1));
        assert!(out[1..]
            .iter()
            .all(|r| r.as_ref().is_err_and(|e| e.kind() == ErrorKind::Platform)));
        let with_failure = BatchPrep {
            len: 3,
            failed: vec![(0, Error::config("zero"))],
            spans: Vec::new(),
        };
        let out = merge_results(with_failure, vec![delivered(1)]);
        assert!(out[0].is_err() && offset(&out[1]) == Some(1));
        assert!(out[2]
            .as_ref()
            .is_err_and(|e| e.kind() == ErrorKind::Platform));
    }
}
