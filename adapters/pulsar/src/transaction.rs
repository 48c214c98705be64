//! Pulsar transactions (PIP-31) for onceflow's transactional producer: `begin` opens one at a
//! transaction coordinator (`txn.rs`), sends go out through the pulsar crate's producers with
//! the transaction's id put on them by the loopback bridge ([`crate::bridge::TxnFrames`]),
//! `commit_offsets` acknowledges the consumed messages inside it, `commit` / `abort` end it.
//!
//! - Before the first send to a topic, every partition of it is registered with the
//!   coordinator (`ADD_PARTITION_TO_TXN`), so the commit or abort marker reaches each; before
//!   the first acknowledgement on a subscription, the subscription (`ADD_SUBSCRIPTION_TO_TXN`).
//! - `commit` first waits for every send's receipt and every acknowledgement's answer: a send
//!   or acknowledgement the broker refused (`TransactionConflict`: the message was
//!   acknowledged in another transaction, or the cursor moved past it) aborts the transaction
//!   and is returned as `Aborted`. A commit whose coordinator answer was lost is `Timeout` with
//!   the outcome unknown (see `txn.rs`).
//! - Dropping an open transaction aborts it (in the background); the coordinator would abort it
//!   at its timeout anyway (`transaction_timeout_ms`).
//! - After an abort, the acknowledgements it made are void: the consumer forgets what it
//!   believed committed, so the pipeline's rewind reads the subscription's cursor from the
//!   broker and gets the inputs again.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use async_trait::async_trait;
use onceflow_core::backend::DeliveriesFuture;
use onceflow_core::{
    Delivery, Error, ErrorKind, GroupMetadata, Position, Record, Result, TopicPartition,
    TransactionBackend,
};

use crate::bridge::TxnFrames;
use crate::consumer::{PulsarConsumer, TxnTaken};
use crate::producer::PulsarProducer;
use crate::txn::{Coordinators, TxnEnd, TxnId};

/// An open Pulsar transaction of a [`PulsarProducer`].
pub(crate) struct PulsarTransaction {
    producer: PulsarProducer,
    tcs: Arc<Coordinators>,
    frames: Arc<TxnFrames>,
    id: TxnId,
    /// Topics whose partitions are registered.
    topics: HashSet<String>,
    /// Subscriptions (partition, subscription) registered.
    subscriptions: HashSet<(String, String)>,
    /// Message ids acknowledged in the transaction (by the consumers below).
    acked: u64,
    /// Consumers that acknowledged in it, and what, told when it ends.
    consumers: Vec<(Weak<PulsarConsumer>, Vec<TxnTaken>)>,
    ended: bool,
}

/// Clears a producer's "in a transaction" flag when dropped, unless [`Opening::done`]: a
/// `begin` that did not make its transaction.
struct Opening(Option<Arc<AtomicBool>>);

impl Opening {
    /// The transaction is made: the flag stays set until it ends.
    fn done(mut self) {
        self.0 = None;
    }
}

impl Drop for Opening {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f.store(false, Ordering::Release);
        }
    }
}

impl PulsarTransaction {
    /// Opens a transaction for `producer`: `Unsupported` without `transactions=true` on the
    /// URL or on a cluster without transaction coordinators, `Config` while another
    /// transaction of this producer is open.
    pub(crate) async fn begin(producer: PulsarProducer) -> Result<Box<dyn TransactionBackend>> {
        let Some(frames) = producer
            .shared
            .txn_frames
            .clone()
            .filter(|_| producer.options.transactions)
        else {
            return Err(Error::unsupported(
                "Pulsar transactions need transactions=true on the pulsar:// URL (Java's \
                 enableTransaction)",
            ));
        };
        producer.refuse_if_closed()?;
        let (Some(in_txn), Some(name)) = (producer.in_txn.clone(), producer.name.clone()) else {
            return Err(Error::config(
                "this producer has no transactional id: create the producer with a transactional id to use transactions",
            ));
        };
        // A transaction dropped just before is still being aborted in the background (at
        // most its acknowledgements' answers, its batches and the coordinator's answer, each
        // within the operation timeout): wait for that, as on Kafka a begin after a drop
        // goes on. Only a transaction still open (not dropped) is refused.
        let waited_for_drop = std::time::Instant::now()
            + producer.options.operation_timeout * 3
            + std::time::Duration::from_secs(1);
        while in_txn.swap(true, Ordering::AcqRel) {
            if !producer.txn_dropped.load(Ordering::Acquire) {
                return Err(Error::config(
                    "this producer has a transaction open already: commit or abort it first",
                ));
            }
            if std::time::Instant::now() >= waited_for_drop {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    "this producer's transaction dropped before is still being aborted: \
                     begin again later",
                )
                .retriable(true));
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        // Until the transaction is made: a begin that fails, or is cancelled (dropped at an
        // await), leaves the producer free to begin again.
        let opening = Opening(Some(in_txn.clone()));
        // Records handed to the crate before this transaction are not part of it: what the
        // crate still holds in batches goes now (a batch is one `SEND`, stamped as a whole),
        // and the transaction's own records are stamped only once those have passed the
        // bridge; any still missing then pass plain ([`TxnFrames::bind_producer`]).
        let timeout = producer.options.operation_timeout;
        if let Err(e) = producer.flush_batches(timeout).await {
            tracing::debug!(error = %e, "flushing the batches of a beginning transaction");
        }
        if !frames.sends_passed(&name, timeout).await {
            tracing::warn!(
                producer = %name,
                "Pulsar transaction begins with records sent before it not yet written to the \
                 broker; they are written without it"
            );
        }
        let opened = async {
            let tcs = producer.shared.coordinators().await?;
            let id = tcs.new_txn(producer.options.transaction_timeout).await?;
            Ok::<_, Error>((tcs, id))
        }
        .await;
        let (tcs, id) = opened?;
        frames.bind_producer(&name, id, timeout);
        opening.done();
        tracing::debug!(txn = %id, producer = %name, "Pulsar transaction opened");
        Ok(Box::new(PulsarTransaction {
            producer,
            tcs,
            frames,
            id,
            topics: HashSet::new(),
            subscriptions: HashSet::new(),
            acked: 0,
            consumers: Vec::new(),
            ended: false,
        }))
    }

    /// Registers the partitions of the topics of `records` not registered yet.
    async fn register_topics(&mut self, records: &[Record]) -> Result<()> {
        let mut new: Vec<String> = Vec::new();
        for r in records {
            if !self.topics.contains(&r.topic) && !new.contains(&r.topic) {
                new.push(r.topic.clone());
            }
        }
        if new.is_empty() {
            return Ok(());
        }
        let mut partitions = Vec::new();
        for t in &new {
            crate::config::check_topic(t)?;
            partitions.extend(self.producer.partition_names(t).await?);
        }
        self.tcs.add_partitions(self.id, &partitions).await?;
        self.topics.extend(new);
        Ok(())
    }

    /// Ends the transaction at the coordinator, unbinds it from the bridge and lets the
    /// producer begin the next one.
    async fn end(&mut self, end: TxnEnd) -> Result<()> {
        drain_sends(
            &self.producer,
            &self.frames,
            self.id,
            self.producer.options.operation_timeout,
        )
        .await;
        let r = self.tcs.end(self.id, end).await;
        self.finish();
        r
    }

    fn finish(&mut self) {
        if !self.ended {
            self.ended = true;
            release(
                &self.frames,
                self.id,
                self.producer.in_txn.as_deref(),
                self.producer.options.operation_timeout,
            );
        }
    }

    /// What aborting needs, taken out of the transaction (which counts as ended from now on).
    fn take_abort(&mut self, dropped: bool) -> Abort {
        self.ended = true;
        Abort {
            dropped,
            producer: self.producer.clone(),
            tcs: self.tcs.clone(),
            frames: self.frames.clone(),
            id: self.id,
            acked: self.acked,
            timeout: self.producer.options.operation_timeout,
            consumers: std::mem::take(&mut self.consumers),
            in_txn: self.producer.in_txn.clone(),
        }
    }

    /// The acknowledgements of this transaction are void: each consumer holds the messages
    /// again.
    fn void_acks(&self) {
        settle(&self.consumers, false);
    }

    /// Waits for every acknowledgement's answer; aborts on a refusal.
    async fn settle_acks(&mut self) -> Result<()> {
        let timeout = self.producer.options.operation_timeout;
        match acks_answered(&self.frames, &self.consumers, self.id, self.acked, timeout).await {
            Ok(()) => Ok(()),
            Err(e) => {
                let _ = self.end(TxnEnd::Abort).await;
                self.void_acks();
                Err(Error::new(
                    ErrorKind::Aborted,
                    format!(
                        "Pulsar transaction {} was aborted: {}",
                        self.id,
                        e.message()
                    ),
                )
                .retriable(true))
            }
        }
    }
}

/// Keeps the consumers whose messages a transaction acknowledged reading from the broker while
/// it waits for the acknowledgements' answers (see [`PulsarConsumer::draining`]), until dropped.
struct Draining(Vec<Arc<PulsarConsumer>>);

impl Draining {
    fn new(consumers: &[(Weak<PulsarConsumer>, Vec<TxnTaken>)]) -> Self {
        let on: Vec<Arc<PulsarConsumer>> =
            consumers.iter().filter_map(|(c, _)| c.upgrade()).collect();
        for c in &on {
            c.draining(true);
        }
        Draining(on)
    }
}

impl Drop for Draining {
    fn drop(&mut self) {
        for c in &self.0 {
            c.draining(false);
        }
    }
}

/// Tells each consumer how the transaction its acknowledgements were in ended.
fn settle(consumers: &[(Weak<PulsarConsumer>, Vec<TxnTaken>)], committed: bool) {
    for (c, taken) in consumers {
        if let Some(c) = c.upgrade() {
            c.txn_settled(taken, committed);
        }
    }
}

/// The bridge forgets transaction `id` and the producer may begin the next one.
/// Waits for the answers to the `acked` acknowledgements of transaction `id`
/// ([`TxnFrames::acks_answered`]), the consumers that made them reading from the broker
/// meanwhile ([`Draining`]).
async fn acks_answered(
    frames: &TxnFrames,
    consumers: &[(Weak<PulsarConsumer>, Vec<TxnTaken>)],
    id: TxnId,
    acked: u64,
    timeout: std::time::Duration,
) -> Result<()> {
    let _draining = Draining::new(consumers);
    frames.acks_answered(id, acked, timeout).await
}

/// Sends what `producer` still holds in batches and waits (at most `timeout`) until every
/// message it handed to the crate in transaction `id` passed the bridge, stamped with `id`
/// ([`TxnFrames::sends_passed`]): called before the coordinator ends the transaction, so that
/// none of its records goes out after, outside any transaction or in the producer's next one.
async fn drain_sends(
    producer: &PulsarProducer,
    frames: &TxnFrames,
    id: TxnId,
    timeout: std::time::Duration,
) {
    if let Err(e) = producer.flush_batches(timeout).await {
        tracing::debug!(txn = %id, error = %e, "flushing the batches of an ending transaction");
    }
    let Some(name) = producer.name.as_deref() else {
        return;
    };
    if !frames.sends_passed(name, timeout).await {
        tracing::warn!(
            txn = %id,
            producer = name,
            waited_ms = timeout.as_millis() as u64,
            "Pulsar transaction ends with records of it not yet written to the broker; those \
             written later are sent in it all the same, so the broker never delivers them"
        );
    }
}

fn release(
    frames: &TxnFrames,
    id: TxnId,
    in_txn: Option<&AtomicBool>,
    late_for: std::time::Duration,
) {
    frames.end(id, late_for);
    if let Some(f) = in_txn {
        f.store(false, Ordering::Release);
    }
}

/// An abort, with what it needs owned: run by `abort`, and in the background for a dropped
/// transaction.
struct Abort {
    /// The transaction was dropped: its producer was unbound at once
    /// ([`TxnFrames::unbind`]), so that what it sends from then on goes without it.
    dropped: bool,
    producer: PulsarProducer,
    tcs: Arc<Coordinators>,
    frames: Arc<TxnFrames>,
    id: TxnId,
    acked: u64,
    timeout: std::time::Duration,
    consumers: Vec<(Weak<PulsarConsumer>, Vec<TxnTaken>)>,
    in_txn: Option<Arc<AtomicBool>>,
}

impl Abort {
    /// Waits (at most the operation timeout) until the acknowledgements made in the
    /// transaction were answered, then aborts it at the coordinator, unbinds it and tells the
    /// consumers their acknowledgements are void. An acknowledgement the broker took after
    /// the coordinator ended the transaction would open it again at the subscription (its
    /// pending-ack state) and hold the message until the broker's low-water mark catches up;
    /// those that have not left the bridge when the transaction ends are dropped instead
    /// ([`TxnFrames::end`]).
    async fn run(self) -> Result<()> {
        if self.acked > 0 {
            if let Err(e) = acks_answered(
                &self.frames,
                &self.consumers,
                self.id,
                self.acked,
                self.timeout,
            )
            .await
            {
                tracing::debug!(txn = %self.id, error = %e, "aborting with acknowledgements unanswered");
            }
        }
        if self.dropped {
            // Its records not passed yet are stamped with it when they pass, ahead of the
            // producer's later ones: they go now, and the coordinator ends it after them.
            if let Err(e) = self.producer.flush_batches(self.timeout).await {
                tracing::debug!(txn = %self.id, error = %e, "flushing the batches of a dropped transaction");
            }
            if let Some(name) = self.producer.name.as_deref() {
                if !self.frames.late_passed(name, self.timeout).await {
                    tracing::warn!(txn = %self.id, producer = name, "dropped Pulsar transaction aborted with records of it not yet written to the broker");
                }
            }
        } else {
            drain_sends(&self.producer, &self.frames, self.id, self.timeout).await;
        }
        let r = self.tcs.end(self.id, TxnEnd::Abort).await;
        self.release();
        settle(&self.consumers, false);
        r
    }

    fn release(&self) {
        release(&self.frames, self.id, self.in_txn.as_deref(), self.timeout);
    }
}

impl Drop for PulsarTransaction {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        // What the producer sends from now on is not part of this transaction.
        self.frames
            .unbind(self.id, self.producer.options.operation_timeout);
        let abort = self.take_abort(true);
        match tokio::runtime::Handle::try_current() {
            // As `abort`, in the background; then the producer may begin again.
            Ok(rt) => {
                let dropped = self.producer.txn_dropped.clone();
                dropped.store(true, Ordering::Release);
                rt.spawn(async move {
                    let id = abort.id;
                    if let Err(e) = abort.run().await {
                        tracing::debug!(txn = %id, error = %e, "aborting a dropped Pulsar transaction");
                    }
                    dropped.store(false, Ordering::Release);
                });
            }
            // No runtime to abort on: the coordinator aborts it at its timeout.
            Err(_) => abort.release(),
        }
    }
}

#[async_trait]
impl TransactionBackend for PulsarTransaction {
    async fn send(&mut self, record: Record) -> Result<Delivery> {
        self.send_batch(vec![record])
            .await
            .pop()
            .expect("one result per record")
    }

    async fn send_batch(&mut self, records: Vec<Record>) -> Vec<Result<Delivery>> {
        if let Err(e) = self.register_topics(&records).await {
            return records
                .iter()
                .map(|_| {
                    Err(Error::new(e.kind(), e.message().to_string()).retriable(e.is_retriable()))
                })
                .collect();
        }
        self.producer.send_all(records).await
    }

    /// Hands the records to the crate's producers and returns their receipts as a future, so
    /// the pipeline reads and transforms its next batch while these are in flight (the
    /// default, [`TransactionBackend::send_batch`], waited for every receipt of a batch before
    /// the next one was read). `commit` sends what is still batched and waits for every
    /// receipt anyway.
    async fn enqueue_batch(&mut self, records: Vec<Record>) -> DeliveriesFuture {
        if let Err(e) = self.register_topics(&records).await {
            let failed = records
                .iter()
                .map(|_| {
                    Err(Error::new(e.kind(), e.message().to_string()).retriable(e.is_retriable()))
                })
                .collect();
            return Box::pin(std::future::ready(failed));
        }
        self.producer.enqueue_all(records).await
    }

    /// Acknowledges, inside the transaction, every message the consumer of `group` delivered
    /// up to each position (as its `commit` would; `group` must come from a Pulsar consumer of
    /// this connection).
    async fn commit_offsets(
        &mut self,
        group: &GroupMetadata,
        positions: &[(TopicPartition, Position)],
    ) -> Result<()> {
        let consumer = group
            .native
            .as_ref()
            .and_then(|n| n.clone().downcast::<crate::consumer::TxnAcks>().ok())
            .and_then(|a| a.consumer.upgrade())
            .ok_or_else(|| {
                Error::config(format!(
                    "commit_offsets on a Pulsar transaction needs the group metadata of a \
                     Pulsar consumer (group '{}')",
                    group.group
                ))
            })?;
        let subscriptions = consumer.txn_subscriptions(positions)?;
        let new: Vec<(String, String)> = subscriptions
            .iter()
            .filter(|s| !self.subscriptions.contains(*s))
            .cloned()
            .collect();
        if !new.is_empty() {
            self.tcs.add_subscriptions(self.id, &new).await?;
            self.subscriptions.extend(new);
        }
        let (frames, id) = (self.frames.clone(), self.id);
        let mut taken = Vec::new();
        let sent = consumer.txn_ack(
            positions,
            &mut |topic, sub, ids| frames.expect_acks(id, topic, sub, ids),
            &mut taken,
        );
        self.consumers.push((Arc::downgrade(&consumer), taken));
        self.acked += sent?;
        Ok(())
    }

    async fn commit(mut self: Box<Self>) -> Result<()> {
        // Receipts: the sends were awaited in `send_batch`, or their futures from
        // `enqueue_batch` before this call (its contract); the crate's batches are sent now.
        if let Err(e) = self
            .producer
            .flush_batches(self.producer.options.operation_timeout)
            .await
        {
            let _ = self.end(TxnEnd::Abort).await;
            self.void_acks();
            return Err(e);
        }
        self.settle_acks().await?;
        // A member that lost a partition it acknowledged on commits nothing.
        for (c, taken) in &self.consumers {
            let Some(c) = c.upgrade() else { continue };
            if let Err(e) = c.txn_check_active(taken).await {
                let _ = self.end(TxnEnd::Abort).await;
                self.void_acks();
                return Err(e);
            }
        }
        let id = self.id;
        match self.end(TxnEnd::Commit).await {
            Ok(()) => {
                settle(&self.consumers, true);
                tracing::debug!(txn = %id, "Pulsar transaction committed");
                Ok(())
            }
            Err(e) => {
                if !e.outcome_unknown() {
                    self.void_acks();
                }
                Err(e)
            }
        }
    }

    async fn abort(mut self: Box<Self>) -> Result<()> {
        self.take_abort(false).run().await
    }
}
