//! Producers: one pulsar crate producer per partition of each topic written to, created on
//! first use.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use onceflow_core::{
    now_ms, Capabilities, Delivery, Error, ErrorKind, ProducerBackend, ProducerConfig, Record,
    Result,
};
use pulsar::compression::{
    Compression, CompressionLz4, CompressionSnappy, CompressionZlib, CompressionZstd,
};
use pulsar::producer::{Message as PulsarMessage, SendFuture};
use pulsar::{ProducerOptions, TokioExecutor};

use crate::admin::TopicShape;
use crate::config::{check_topic, CompressionKind, PulsarOptions};
use crate::convert::{self, pulsar_err};
use crate::Shared;

type RawProducer = pulsar::Producer<TokioExecutor>;

/// The producers of one topic, one per partition (index = partition).
struct TopicProducers {
    parts: Vec<Arc<tokio::sync::Mutex<RawProducer>>>,
    /// Per partition: the lowest sequence id the broker stored for that crate producer in its
    /// life (`u64::MAX` before the first receipt with a message id), see
    /// [`PulsarProducer::complete`].
    stored_from: Vec<Arc<AtomicU64>>,
    /// Per partition, with batching: about how many bytes of messages were handed to the crate
    /// since this producer last sent the partition's batch itself (an upper bound: the crate
    /// also sends batches on its own, by count or time). See [`PulsarProducer::hand_over`].
    batched_bytes: Vec<AtomicUsize>,
    partitioned: bool,
    round_robin: AtomicUsize,
    /// The runtime the producers were made on: dropping a crate producer spawns its close on
    /// tokio, which panics on a thread outside any runtime ("there is no reactor running"),
    /// e.g. when Python or Node frees the last reference at exit. The drop runs inside it.
    runtime: Option<tokio::runtime::Handle>,
}

impl Drop for TopicProducers {
    fn drop(&mut self) {
        let parts = std::mem::take(&mut self.parts);
        match &self.runtime {
            Some(rt) if tokio::runtime::Handle::try_current().is_err() => {
                let _inside = rt.enter();
                drop(parts);
            }
            _ => drop(parts),
        }
    }
}

/// A producer on Pulsar (see the crate docs for the mapping). Clones share everything.
#[derive(Clone)]
pub struct PulsarProducer {
    pub(crate) shared: Arc<Shared>,
    pub(crate) options: Arc<PulsarOptions>,
    pub(crate) name: Option<String>,
    topics: Arc<tokio::sync::Mutex<HashMap<String, Arc<TopicProducers>>>>,
    closed: Arc<AtomicBool>,
    /// With a transactional id on a `transactions=true` connection: a transaction is open
    /// (one at a time, as on Kafka).
    pub(crate) in_txn: Option<Arc<AtomicBool>>,
    /// A transaction of this producer was dropped and is being aborted in the background:
    /// `begin` waits for that abort instead of refusing (the caller can neither commit nor
    /// abort a dropped transaction).
    pub(crate) txn_dropped: Arc<AtomicBool>,
}

/// The pulsar crate's producer options for our options.
pub fn producer_options(o: &PulsarOptions) -> ProducerOptions {
    ProducerOptions {
        batch_size: o.batch_size,
        batch_byte_size: o.batch_bytes,
        batch_timeout: o.batch_timeout,
        compression: Some(match o.compression {
            CompressionKind::None => Compression::None,
            CompressionKind::Lz4 => Compression::Lz4(CompressionLz4::default()),
            CompressionKind::Zlib => Compression::Zlib(CompressionZlib::default()),
            CompressionKind::Zstd => Compression::Zstd(CompressionZstd::default()),
            CompressionKind::Snappy => Compression::Snappy(CompressionSnappy::default()),
        }),
        metadata: o.metadata.clone(),
        // Back-pressure: a full queue waits instead of failing with SlowDown.
        block_queue_if_full: true,
        ..Default::default()
    }
}

/// About how many bytes `msg` takes in a batch: payload, properties, keys and each message's
/// metadata (an upper bound of the uncompressed size; compression only makes it smaller).
fn batched_size(msg: &PulsarMessage) -> usize {
    msg.payload.len()
        + msg
            .properties
            .iter()
            .map(|(k, v)| k.len() + v.len() + 8)
            .sum::<usize>()
        + msg.partition_key.as_ref().map_or(0, |k| k.len())
        + msg.ordering_key.as_ref().map_or(0, |k| k.len())
        + 64
}

/// What a send was handed to: the topic and partition and the receipt to wait for.
struct InFlight {
    topic: String,
    partition: i32,
    partitioned: bool,
    future: SendFuture,
    timestamp: i64,
    /// The partition producer's `TopicProducers::stored_from`.
    stored_from: Arc<AtomicU64>,
}

impl PulsarProducer {
    pub(crate) fn new(shared: Arc<Shared>, config: ProducerConfig) -> Result<Self> {
        let mut options = shared.options.clone();
        options.apply(&config.options)?;
        let transactional = config.transactional_id.is_some() && options.transactions;
        if config.transactional_id.is_some() && !options.transactions {
            tracing::debug!(
                "transactional_id without transactions=true on the pulsar:// URL: this \
                 producer cannot begin transactions"
            );
        }
        let name = match &config.transactional_id {
            // The bridge tells this producer's sends by its name, so it is this producer's
            // alone: the transactional id and a random suffix. (A name of an earlier process
            // would also meet broker deduplication's sequence ids of that process, see
            // `complete`.)
            Some(id) if transactional => Some(format!("{id}-{:016x}", rand::random::<u64>())),
            _ => options.producer_name.clone().or(config.client_id),
        };
        if let (true, Some(frames), Some(n)) = (transactional, &shared.txn_frames, &name) {
            frames.register_producer(n);
        }
        Ok(PulsarProducer {
            shared,
            options: Arc::new(options),
            name,
            topics: Arc::new(tokio::sync::Mutex::new(HashMap::new())),
            closed: Arc::new(AtomicBool::new(false)),
            in_txn: transactional.then(|| Arc::new(AtomicBool::new(false))),
            txn_dropped: Arc::new(AtomicBool::new(false)),
        })
    }

    async fn topic(&self, topic: &str) -> Result<Arc<TopicProducers>> {
        let mut topics = self.topics.lock().await;
        if let Some(t) = topics.get(topic) {
            return Ok(t.clone());
        }
        check_topic(topic)?;
        let shape = self.shared.shape(topic).await?;
        let full = self.options.full_topic(topic);
        let (names, partitioned) = match shape {
            TopicShape::Partitioned(n) => (
                (0..n).map(|i| format!("{full}-partition-{i}")).collect(),
                true,
            ),
            // A missing topic is created by the broker on first use (non-partitioned).
            TopicShape::NonPartitioned | TopicShape::Missing => (vec![full.clone()], false),
        };
        let mut parts = Vec::with_capacity(names.len());
        for n in names {
            let mut b = self
                .shared
                .client
                .producer()
                .with_topic(&n)
                .with_options(producer_options(&self.options));
            if let Some(name) = &self.name {
                b = b.with_name(name.clone());
            }
            let p = b
                .build()
                .await
                .map_err(|e| pulsar_err(format!("creating a producer on '{n}'"), e))?;
            parts.push(Arc::new(tokio::sync::Mutex::new(p)));
        }
        let t = Arc::new(TopicProducers {
            stored_from: (0..parts.len())
                .map(|_| Arc::new(AtomicU64::new(u64::MAX)))
                .collect(),
            batched_bytes: (0..parts.len()).map(|_| AtomicUsize::new(0)).collect(),
            parts,
            partitioned,
            round_robin: AtomicUsize::new(rand::random::<u32>() as usize),
            runtime: tokio::runtime::Handle::try_current().ok(),
        });
        topics.insert(topic.to_string(), t.clone());
        Ok(t)
    }

    /// `Closed` once `close` was called.
    pub(crate) fn refuse_if_closed(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::new(ErrorKind::Closed, "the producer is closed"));
        }
        Ok(())
    }

    fn check(&self, record: &Record) -> Result<()> {
        self.refuse_if_closed()?;
        let max = self.shared.max_record_bytes(&self.options);
        let size = record.size_bytes();
        if size > max {
            return Err(Error::config(format!(
                "record of {size} bytes for topic '{}' exceeds the limit of {max} bytes",
                record.topic
            )));
        }
        Ok(())
    }

    /// The partition `record` goes to (explicit, by key, else round-robin) and its Pulsar
    /// message; the payload is moved into the message, not copied, when nothing else holds it.
    fn message_of(
        &self,
        t: &TopicProducers,
        record: &mut Record,
    ) -> Result<(usize, PulsarMessage)> {
        let n = t.parts.len();
        let partition = match (record.partition, &record.key) {
            (Some(p), _) => {
                if p < 0 || p as usize >= n {
                    return Err(Error::config(format!(
                        "partition {p} of topic '{}' does not exist: expected 0..{}",
                        record.topic,
                        n - 1
                    )));
                }
                p as usize
            }
            (None, Some(k)) if n > 1 => {
                let text = match std::str::from_utf8(k) {
                    Ok(t) => t.to_string(),
                    Err(_) => hex::encode(k),
                };
                pulsar::routing_policy::RoutingPolicy::compute_partition_index_for_key(&text, n)
            }
            _ if n == 1 => 0,
            _ => t.round_robin.fetch_add(1, Ordering::Relaxed) % n,
        };
        let mut msg = PulsarMessage {
            properties: convert::record_properties(record),
            event_time: record.timestamp.filter(|t| *t > 0).map(|t| t as u64),
            payload: Vec::from(std::mem::take(&mut record.payload)),
            ..Default::default()
        };
        if let Some(k) = &record.key {
            match std::str::from_utf8(k) {
                Ok(t) => {
                    msg.partition_key = Some(t.to_string());
                    msg.partition_key_b64_encoded = Some(false);
                }
                Err(_) => {
                    use base64_key::encode;
                    msg.partition_key = Some(encode(k));
                    msg.partition_key_b64_encoded = Some(true);
                }
            }
            msg.ordering_key = Some(k.to_vec());
        }
        Ok((partition, msg))
    }

    /// Hands `msg` to the partition's producer (batched or sent by the crate).
    async fn hand_over(
        &self,
        producer: &mut RawProducer,
        t: &TopicProducers,
        record: Record,
        partition: usize,
        msg: PulsarMessage,
    ) -> Result<InFlight> {
        let timestamp = record.timestamp.unwrap_or_else(now_ms);
        if self.options.batching() {
            // The crate sends a batch once it holds `batch_size` messages or `batch_bytes`
            // bytes, checked after adding one, so one entry can grow past the broker's
            // `maxMessageSize`: the broker then refuses it and every record of it failed after
            // the operation timeout (600 records of 10 KiB with batch_size=1000: none
            // delivered). The partition's batch goes first when this message would take it
            // past the limit.
            let size = batched_size(&msg);
            let held = &t.batched_bytes[partition];
            let limit = self
                .options
                .max_message_bytes
                .saturating_sub(crate::PROPERTY_ROOM);
            if held.load(Ordering::Relaxed) + size > limit {
                // A failed send shows in the receipts of the records it held.
                let _ = tokio::time::timeout(self.options.operation_timeout, producer.send_batch())
                    .await;
                held.store(0, Ordering::Relaxed);
            }
            held.fetch_add(size, Ordering::Relaxed);
        }
        let future = producer.send_non_blocking(msg).await.map_err(|e| {
            pulsar_err(
                format!("sending to '{}' partition {partition}", record.topic),
                e,
            )
        })?;
        if let Some((frames, name)) = self.txn_frames() {
            frames.handed(name);
        }
        Ok(InFlight {
            topic: record.topic,
            partition: partition as i32,
            partitioned: t.partitioned,
            future,
            timestamp,
            stored_from: t.stored_from[partition].clone(),
        })
    }

    /// The bridge's transaction frames and this producer's name, for a transactional producer
    /// (a transactional id on a `transactions=true` connection); `None` otherwise.
    fn txn_frames(&self) -> Option<(&crate::bridge::TxnFrames, &str)> {
        match (&self.shared.txn_frames, &self.name, &self.in_txn) {
            (Some(f), Some(n), Some(_)) => Some((f, n.as_str())),
            _ => None,
        }
    }

    /// Records of a dropped transaction still in the crate's batches would share a `SEND`
    /// (stamped with that transaction as a whole) with the records handed now: those go
    /// first, and this waits (at most the operation timeout) until they passed the bridge.
    async fn after_dropped_transaction(&self) {
        let Some((frames, name)) = self.txn_frames() else {
            return;
        };
        if !frames.late_pending(name) {
            return;
        }
        let timeout = self.options.operation_timeout;
        if let Err(e) = self.flush_batches(timeout).await {
            tracing::debug!(error = %e, "flushing the batches of a dropped transaction");
        }
        frames.late_passed(name, timeout).await;
    }

    /// The partition names of `topic` (`persistent://…[-partition-N]`), its producers made.
    pub(crate) async fn partition_names(&self, topic: &str) -> Result<Vec<String>> {
        let t = self.topic(topic).await?;
        let full = self.options.full_topic(topic);
        Ok(if t.partitioned {
            (0..t.parts.len())
                .map(|i| format!("{full}-partition-{i}"))
                .collect()
        } else {
            vec![full]
        })
    }

    /// Hands one record to its partition's producer.
    async fn enqueue(&self, mut record: Record) -> Result<InFlight> {
        self.after_dropped_transaction().await;
        self.check(&record)?;
        let t = self.topic(&record.topic).await?;
        let (partition, msg) = self.message_of(&t, &mut record)?;
        let mut p = t.parts[partition].lock().await;
        let f = self.hand_over(&mut p, &t, record, partition, msg).await?;
        if self.options.batching() && self.options.batch_timeout.is_none() {
            // Without a batch timeout the crate would hold a lone record until its batch is
            // full: this partition's batch goes now (a failed send shows in the receipt).
            let _ = tokio::time::timeout(self.options.operation_timeout, p.send_batch()).await;
        }
        Ok(f)
    }

    /// Waits for the receipt of a send.
    ///
    /// Broker deduplication (PIP-6) answers a message whose (producer name, sequence id) it
    /// has stored already with message id (-1,-1): not stored again. The pulsar crate resends
    /// the messages waiting for a receipt, with their sequence ids, when it re-creates a
    /// producer after a broken connection or a closed producer; a (-1,-1) answer to such a
    /// resend means our own first send was stored, so the send succeeded:
    /// [`Delivery::duplicate`] is set and the position is (-1,-1) (the broker does not say
    /// where the first copy is). That is certain when the stored message can only be ours:
    /// the producer's name was assigned by the broker (unique, the default), or the broker
    /// stored a lower sequence id of this producer before (a producer of an earlier life of the
    /// name stored nothing above what this one stores, as the crate restarts sequence ids at
    /// 0). Otherwise (a named producer, nothing of it stored yet) the name may have been used
    /// before (a restarted process with `producer_name` or `client_id`; the broker holds an
    /// earlier life's message under this sequence id and dropped this record) or this record's
    /// first receipt may have been lost: a non-retriable `Platform` error naming the producer,
    /// with [`Error::outcome_unknown`] set.
    ///
    /// [`Delivery::attempts`] is 1 either way: the crate's resends are its own, and its receipt
    /// does not say how many there were.
    async fn complete(&self, f: InFlight) -> Result<Delivery> {
        let topic = f.topic;
        let receipt = f.future.await.map_err(|e| {
            pulsar_err(
                format!(
                    "waiting for the receipt of '{topic}' partition {}",
                    f.partition
                ),
                e,
            )
        })?;
        let id = receipt.message_id.unwrap_or_default();
        let partition_index = if f.partitioned { f.partition } else { -1 };
        if id.ledger_id == u64::MAX || id.entry_id == u64::MAX {
            // Through the bridge a named producer's sequence ids start past the broker's last
            // one for the name, so a duplicate answer is to a resend of our own.
            let ours = self.name.is_none()
                || self.shared.txn_frames.is_some()
                || f.stored_from.load(Ordering::Acquire) < receipt.sequence_id;
            if ours {
                tracing::debug!(
                    topic = %topic,
                    partition = f.partition,
                    sequence_id = receipt.sequence_id,
                    "the broker had stored this record already (a resend after a reconnect)"
                );
                return Ok(Delivery::new(
                    topic,
                    f.partition,
                    convert::position(&id, partition_index),
                )
                .timestamp(Some(f.timestamp))
                .duplicate(true));
            }
            // Nothing of this producer is stored yet: either the name was used before (a
            // restarted process) and the broker holds an earlier life's message under this
            // sequence id, or this very record was stored and its receipt lost in a reconnect.
            // The crate does not hand over the broker's last sequence id of the name
            // (`CommandProducerSuccess.last_sequence_id`), which would tell the two apart, so
            // the outcome is reported as unknown: a retry may write the record twice.
            return Err(Error::new(
                ErrorKind::Platform,
                format!(
                    "broker deduplication answered a send to '{topic}' partition {} as already \
                     stored (sequence id {}) before any record of producer '{}' was stored: \
                     either the name was used before (the pulsar crate restarts sequence ids at \
                     0, so this record was dropped) or its receipt was lost in a reconnect (it \
                     is stored); whether it is stored is unknown. A named producer must not be \
                     reused across restarts — use a new name (the default) and a dedup store",
                    f.partition,
                    receipt.sequence_id,
                    self.name.as_deref().unwrap_or("(broker-assigned)"),
                ),
            )
            .retriable(false)
            .with_outcome_unknown());
        }
        f.stored_from
            .fetch_min(receipt.sequence_id, Ordering::AcqRel);
        Ok(
            Delivery::new(topic, f.partition, convert::position(&id, partition_index))
                .timestamp(Some(f.timestamp)),
        )
    }
}

/// Base64 for binary partition keys (Pulsar's `partition_key_b64_encoded`).
mod base64_key {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

    /// Standard Base64 with padding.
    pub(super) fn encode(input: &[u8]) -> String {
        let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
        for chunk in input.chunks(3) {
            let b = [
                chunk[0],
                *chunk.get(1).unwrap_or(&0),
                *chunk.get(2).unwrap_or(&0),
            ];
            let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
            for i in 0..4 {
                if i <= chunk.len() {
                    out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
                } else {
                    out.push('=');
                }
            }
        }
        out
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn encodes() {
            assert_eq!(super::encode(b"key\x00\xff"), "a2V5AP8=");
            assert_eq!(super::encode(b"ab"), "YWI=");
            assert_eq!(super::encode(b""), "");
        }
    }
}

#[async_trait]
impl ProducerBackend for PulsarProducer {
    fn capabilities(&self) -> Capabilities {
        self.shared.capabilities(&self.options)
    }

    /// Hands the record over and waits for its receipt. With batching and no
    /// `batch_timeout_ms`, the crate would hold a lone record until its batch is full, so its
    /// partition's batch is sent first (`enqueue`); with a `batch_timeout_ms`, records sent
    /// concurrently share a batch and a receipt comes at the latest that long after the
    /// batch's first record.
    async fn send(&self, record: Record) -> Result<Delivery> {
        let f = self.enqueue(record).await?;
        self.complete(f).await
    }

    /// Hands every record to its partition's producer first, in order (so the crate batches
    /// them), then waits for the receipts. A run of records for the same topic looks the topic
    /// up once, and a run for the same partition takes its producer's lock once.
    async fn send_batch(&self, records: Vec<Record>) -> Vec<Result<Delivery>> {
        self.send_all(records).await
    }

    /// Hands the records over as `send_batch` does and returns their receipts as a future
    /// (see `PulsarProducer::enqueue_all`), so the caller goes on while they are in flight.
    async fn enqueue_batch(
        &self,
        records: Vec<Record>,
    ) -> onceflow_core::backend::DeliveriesFuture {
        self.enqueue_all(records).await
    }

    async fn begin(&self) -> Result<Box<dyn onceflow_core::TransactionBackend>> {
        crate::transaction::PulsarTransaction::begin(self.clone()).await
    }

    async fn flush(&self, timeout: Duration) -> Result<()> {
        self.flush_batches(timeout).await
    }

    async fn close(&self) -> Result<()> {
        self.close_all().await
    }
}

impl PulsarProducer {
    /// [`ProducerBackend::send_batch`]: hands every record to its partition's producer first,
    /// in order (so the crate batches them), then waits for the receipts.
    /// With batching, what the crate still holds in batches is sent before the receipts are
    /// awaited (else they would come only after `batch_timeout_ms`, or never without one).
    pub(crate) async fn send_all(&self, records: Vec<Record>) -> Vec<Result<Delivery>> {
        self.enqueue_all(records).await.await
    }

    /// Hands every record to its partition's producer, in order (so the crate batches them),
    /// without waiting for receipts: what [`PulsarProducer::receipts`] then waits for. A run of
    /// records for the same topic looks the topic up once, and a run for the same partition
    /// takes its producer's lock once.
    async fn hand_over_all(&self, records: Vec<Record>) -> Vec<Result<InFlight>> {
        self.after_dropped_transaction().await;
        let mut queued = Vec::with_capacity(records.len());
        let mut topic: Option<(String, Arc<TopicProducers>)> = None;
        let mut held: Option<(usize, tokio::sync::OwnedMutexGuard<RawProducer>)> = None;
        for mut r in records {
            let q: Result<InFlight> = async {
                self.check(&r)?;
                let t = match &topic {
                    Some((name, t)) if *name == r.topic => t.clone(),
                    _ => {
                        held = None;
                        let t = self.topic(&r.topic).await?;
                        topic = Some((r.topic.clone(), t.clone()));
                        t
                    }
                };
                let (partition, msg) = self.message_of(&t, &mut r)?;
                if held.as_ref().is_none_or(|(p, _)| *p != partition) {
                    held = None;
                    held = Some((partition, t.parts[partition].clone().lock_owned().await));
                }
                let (_, p) = held.as_mut().expect("held above");
                self.hand_over(p, &t, r, partition, msg).await
            }
            .await;
            queued.push(q);
        }
        queued
    }

    /// The deliveries of records handed over by [`PulsarProducer::hand_over_all`], in order.
    async fn receipts(&self, queued: Vec<Result<InFlight>>) -> Vec<Result<Delivery>> {
        futures::future::join_all(queued.into_iter().map(|q| async move {
            match q {
                Ok(f) => self.complete(f).await,
                Err(e) => Err(e),
            }
        }))
        .await
    }

    /// Hands `records` over as [`PulsarProducer::send_all`] does and returns their deliveries
    /// as a future that owns what it needs, so the caller can go on while they are in flight.
    /// With batching, the future first sends what the crate still holds in batches (so a
    /// caller awaiting it does not wait for `batch_timeout_ms`, or for ever without one), then
    /// waits for the receipts.
    pub(crate) async fn enqueue_all(
        &self,
        records: Vec<Record>,
    ) -> onceflow_core::backend::DeliveriesFuture {
        let queued = self.hand_over_all(records).await;
        let this = self.clone();
        Box::pin(async move {
            if this.options.batching() && queued.iter().any(|q| q.is_ok()) {
                // A failed flush shows in the receipts it concerns.
                let _ = this.flush_batches(this.options.operation_timeout).await;
            }
            this.receipts(queued).await
        })
    }

    /// Sends what the crate holds in batches, at most `timeout`.
    pub(crate) async fn flush_batches(&self, timeout: Duration) -> Result<()> {
        if !self.options.batching() {
            return Ok(());
        }
        let topics: Vec<Arc<TopicProducers>> = self.topics.lock().await.values().cloned().collect();
        let work = async {
            for t in topics {
                for p in &t.parts {
                    p.lock()
                        .await
                        .send_batch()
                        .await
                        .map_err(|e| pulsar_err("flushing a batch", e))?;
                }
            }
            Ok::<(), Error>(())
        };
        tokio::time::timeout(timeout, work).await.map_err(|_| {
            Error::new(
                ErrorKind::Timeout,
                format!("flush did not finish within {timeout:?}"),
            )
        })?
    }

    async fn close_all(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        if let Some((frames, name)) = self.txn_frames() {
            frames.forget_producer(name);
        }
        let topics: Vec<Arc<TopicProducers>> =
            self.topics.lock().await.drain().map(|(_, t)| t).collect();
        for t in topics {
            for p in &t.parts {
                let mut p = p.lock().await;
                if self.options.batching() {
                    let _ = p.send_batch().await;
                }
                if let Err(e) = p.close().await {
                    tracing::debug!(error = %e, "closing a Pulsar producer");
                }
            }
        }
        Ok(())
    }
}
