//! Consumers: one pulsar crate consumer per partition of each subscribed topic, all on the
//! subscription named after the group.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use onceflow_core::{
    Capabilities, ConsumerBackend, ConsumerConfig, Error, ErrorKind, GroupMetadata, Message,
    PartitionLag, Position, RebalanceListener, Result, StartFrom, TimestampMs, TopicPartition,
};
use parking_lot::Mutex;
use pulsar::consumer::{DeadLetterPolicy, InitialPosition};
use pulsar::message::proto::command_subscribe::SubType;
use pulsar::message::proto::MessageIdData;
use pulsar::{ConsumerOptions, TokioExecutor};
use tokio::sync::{mpsc, oneshot, Notify};

use crate::admin::{committed_from_cursor, TopicShape};
use crate::config::{check_topic, PulsarOptions, SubscriptionType};
use crate::convert::{self, pos_key, pulsar_err, PosKey};
use crate::Shared;

type RawConsumer = pulsar::Consumer<Vec<u8>, TokioExecutor>;

/// A message read by a partition task: its raw id (with `batch_size` set for a message of a
/// batch) and the converted message.
struct Fetched {
    id: MessageIdData,
    key: PosKey,
    message: Message,
}

/// The settled messages (committed, or skipped after a seek) of one batch not yet acknowledged
/// whole: a bit per message of the batch.
struct BatchAcks {
    size: u32,
    settled: Vec<u64>,
}

impl BatchAcks {
    fn new(size: u32) -> Self {
        BatchAcks {
            size,
            settled: vec![0; size.div_ceil(64) as usize],
        }
    }

    /// A batch of `size` messages, every one settled.
    fn settled(size: u32) -> Self {
        let mut b = BatchAcks::new(size);
        for i in 0..size as i32 {
            b.settle(i);
        }
        b
    }

    fn is_settled(&self, index: i32) -> bool {
        let i = index as usize;
        self.settled
            .get(i / 64)
            .is_some_and(|w| w & (1 << (i % 64)) != 0)
    }

    fn settle(&mut self, index: i32) {
        let i = index as usize;
        if let Some(w) = self.settled.get_mut(i / 64) {
            *w |= 1 << (i % 64);
        }
    }

    /// `index` is pending again (its acknowledgement was in a transaction that aborted).
    fn unsettle(&mut self, index: i32) {
        let i = index as usize;
        if let Some(w) = self.settled.get_mut(i / 64) {
            *w &= !(1 << (i % 64));
        }
    }

    fn complete(&self) -> bool {
        (0..self.size as i32).all(|i| self.is_settled(i))
    }

    /// PIP-54's ack set: the batch's bits as little-endian 64-bit words (Java's
    /// `BitSet.toLongArray`), 1 for each message not yet acknowledged; the broker ANDs it into
    /// what it keeps for the entry and deletes the entry once no bit is left.
    fn ack_set(&self) -> Vec<i64> {
        let mut words: Vec<i64> = self.settled.iter().map(|w| !w as i64).collect();
        let tail = self.size % 64;
        if tail != 0 {
            if let Some(last) = words.last_mut() {
                *last &= ((1u64 << tail) - 1) as i64;
            }
        }
        words
    }
}

/// First wait for the crate consumer's close in a partition task; doubled on each retry (see
/// `close_after_acks`). Long enough that a close the crate's engine is merely slow to reach
/// (acks ahead of it, a loaded machine, the mTLS bridge's extra hop) is not given up: the
/// crate logs an ERROR for every close request it answers after its caller gave up ("consumer
/// requested the engine's connection but dropped the channel before receiving"), and with
/// 100 ms that happened at the end of ordinary runs.
const CLOSE_STEP: Duration = Duration::from_secs(1);
/// How long `close_after_acks` reads what the engine had ahead of the close at most, before it
/// asks for the close.
const CLOSE_DRAIN: Duration = Duration::from_millis(500);

/// How long a failover / exclusive partition waits for the message it asked the broker to
/// rewind to (dropping what comes after it, fetched before the rewind) before it asks again
/// from the earliest message dropped meanwhile: that message may have been acknowledged by
/// another member's transaction since it was delivered here, and the broker never sends it
/// again (the crash test stalled on it).
const REWIND_WAIT: Duration = Duration::from_secs(5);

/// Commands to a partition task, which owns the crate consumer.
enum Cmd {
    Ack(Vec<MessageIdData>),
    Nack(MessageIdData),
    Seek {
        id: Option<MessageIdData>,
        time: Option<u64>,
        done: oneshot::Sender<Result<()>>,
    },
    /// Close within the duration, after the acks queued before.
    Close(Duration, oneshot::Sender<()>),
    /// While on, keep reading the crate consumer into the task's queue even when the
    /// application is not polling (see [`PulsarConsumer::draining`]).
    Drain(bool),
}

/// Where this member is with one partition.
#[derive(Default)]
struct PartState {
    /// This member reads the partition (failover: it is the active consumer).
    assigned: bool,
    paused: bool,
    /// Delivered by `poll`, neither committed nor nacked.
    pending: BTreeMap<PosKey, MessageIdData>,
    /// Nacked on a failover / exclusive subscription: the messages after this one that were
    /// fetched before the broker rewound are dropped until it comes again.
    rewind: Option<PosKey>,
    /// When the broker was last asked to rewind to `rewind`.
    rewind_asked: Option<std::time::Instant>,
    /// The earliest message dropped while waiting for `rewind` (see [`REWIND_WAIT`]).
    rewind_dropped: Option<(PosKey, MessageIdData)>,
    /// Nacked on a shared / key_shared subscription and expected back.
    nacked: BTreeSet<PosKey>,
    /// Batches (by ledger and entry) some of whose messages are settled and which are not yet
    /// acknowledged whole (see `settle`); at most twice the receiver queue, at least 1000: the
    /// oldest is forgotten first, and its entry is redelivered.
    batches: BTreeMap<(u64, u64), BatchAcks>,
    /// Deliveries to this member, for `Message::delivery_count`.
    deliveries: HashMap<PosKey, u32>,
    /// After a seek to a position: messages before it (the rest of its batch) are skipped.
    skip_below: Option<PosKey>,
    /// After a seek to a time: messages with an earlier timestamp are skipped until the first
    /// one at or after it.
    skip_before: Option<TimestampMs>,
    /// The position after the last commit, where known locally.
    committed_next: Option<Position>,
    /// Last committed position.
    committed: Option<PosKey>,
    /// Messages acknowledged by committed transactions (the most recent, at most twice the
    /// receiver queue, at least 1000). Those acknowledgements were answered before the commit,
    /// so the broker has them: a copy of such a message can only come from a redelivery the
    /// broker started before the commit took effect (a rewind right after a commit), and is
    /// not given out again.
    txn_acked: BTreeSet<PosKey>,
}

impl PartState {
    /// Failover / exclusive: the broker is asked (by a negative acknowledgement of the message
    /// at `key`) to redeliver the partition from its mark-delete position, in order; every
    /// pending message from `key` on is given out again, and what was fetched before the
    /// broker rewound is dropped until `key` comes back.
    fn rewind_to(&mut self, key: PosKey) {
        drop(self.pending.split_off(&key));
        self.rewind = Some(self.rewind.map_or(key, |r| r.min(key)));
        self.rewind_asked = Some(std::time::Instant::now());
        self.rewind_dropped = None;
    }

    /// A rewind that waited [`REWIND_WAIT`] for its message in vain asks again, from the
    /// earliest message dropped since (it may have been the broker's redelivery): that
    /// message's id, to negatively acknowledge. `rewind`'s message may never come again:
    /// another member's transaction acknowledged it after it was delivered here (one killed
    /// while its commit was under way), or holds it.
    fn rewind_again(&mut self) -> Option<MessageIdData> {
        self.rewind?;
        if self.rewind_asked?.elapsed() < REWIND_WAIT {
            return None;
        }
        let (key, id) = self.rewind_dropped.take()?;
        self.rewound();
        self.rewind_to(key);
        Some(id)
    }

    /// The rewind is over: `rewind` came back.
    fn rewound(&mut self) {
        self.rewind = None;
        self.rewind_asked = None;
        self.rewind_dropped = None;
    }

    fn reset(&mut self) {
        self.pending.clear();
        self.rewound();
        self.nacked.clear();
        self.batches.clear();
        self.deliveries.clear();
        self.committed_next = None;
        self.committed = None;
        self.txn_acked.clear();
    }
}

struct Part {
    tp: TopicPartition,
    /// Admin REST path of the partition's topic.
    path: String,
    /// Partition index in message ids (`-1` for a non-partitioned topic).
    index: i32,
    /// Commands to the partition task, which owns the crate consumer. Dropped with the
    /// consumer, it ends the task, which closes the crate consumer first (never aborted
    /// mid-request: the crate logs an ERROR for a request whose caller is gone).
    cmd: mpsc::UnboundedSender<Cmd>,
    rx: Mutex<mpsc::Receiver<Fetched>>,
    state: Mutex<PartState>,
    /// Set by the partition task when resubscribing after its crate consumer ended failed
    /// (a retriable `Connect` error); taken by the next `poll`.
    failure: Arc<Mutex<Option<Error>>>,
}

impl Part {
    /// `Closed` for this partition (its task has ended with the consumer).
    fn closed(&self) -> Error {
        Error::new(
            ErrorKind::Closed,
            format!("{}: the consumer is closed", self.tp),
        )
    }

    /// Sends a command to the partition task.
    fn send(&self, cmd: Cmd) -> Result<()> {
        self.cmd.send(cmd).map_err(|_| self.closed())
    }
}

/// What a partition task needs to subscribe again once its crate consumer has ended (the
/// crate gives up reconnecting after `connection_max_retries`): the same subscription name,
/// type, consumer name and options.
struct Resubscribe {
    shared: Arc<Shared>,
    options: PulsarOptions,
    config: ConsumerConfig,
    member: String,
    /// Full topic name of the partition.
    name: String,
}

/// First wait before subscribing again after a failed attempt; doubled up to
/// [`RESUBSCRIBE_MAX`].
const RESUBSCRIBE_STEP: Duration = Duration::from_millis(200);
const RESUBSCRIBE_MAX: Duration = Duration::from_secs(5);

type Subscribing = std::pin::Pin<Box<dyn std::future::Future<Output = Result<RawConsumer>> + Send>>;

impl Resubscribe {
    /// Subscribes after `delay`, within the operation timeout.
    fn attempt(self: &Arc<Self>, delay: Duration) -> Subscribing {
        let this = self.clone();
        Box::pin(async move {
            tokio::time::sleep(delay).await;
            subscribe_within(
                &this.shared,
                &this.options,
                &this.config,
                &this.member,
                &this.name,
            )
            .await
        })
    }

    /// The retriable `Connect` error `poll` reports while subscribing again fails.
    fn failed(&self, topic: &str, partition: i32, e: &Error, retry_in: Duration) -> Error {
        Error::new(
            ErrorKind::Connect,
            format!(
                "the Pulsar consumer of {topic}[{partition}] (subscription '{}') lost its \
                 connection to the broker at {} and cannot subscribe again: {}; retrying in {} ms",
                self.config.group,
                onceflow_core::redact_credentials(&self.options.service_url),
                e.message(),
                retry_in.as_millis()
            ),
        )
        .retriable(true)
    }
}

/// A member of a consumer group (a Pulsar subscription) on Pulsar (see the crate docs).
pub struct PulsarConsumer {
    /// This consumer, for the group metadata a transaction acknowledges through.
    me: std::sync::Weak<PulsarConsumer>,
    shared: Arc<Shared>,
    group: String,
    member: String,
    options: PulsarOptions,
    sub_type: SubscriptionType,
    /// Acknowledge single messages of a batch with ack sets (PIP-54), else hold a batch's
    /// acknowledgements until all its messages are settled.
    batch_index_ack: bool,
    /// Topics with their shape and admin path.
    topics: Vec<(String, String, TopicShape)>,
    parts: Vec<Part>,
    listener: Mutex<Option<Arc<dyn RebalanceListener>>>,
    last_refresh: Mutex<Option<tokio::time::Instant>>,
    rebalancing: tokio::sync::Mutex<()>,
    closed: AtomicBool,
    notify: Arc<Notify>,
    rotate: AtomicUsize,
}

/// Messages of one partition a transaction acknowledged up to `key` (see
/// [`PulsarConsumer::txn_ack`]).
pub(crate) struct TxnTaken {
    tp: TopicPartition,
    key: PosKey,
    taken: Vec<(PosKey, MessageIdData)>,
}

/// After a commit up to `key`: the committed position, and the next one where known locally
/// (the first message still pending).
fn note_committed(st: &mut PartState, key: PosKey, index: i32) {
    st.committed = Some(st.committed.map_or(key, |c| c.max(key)));
    st.committed_next = st.pending.keys().next().map(|k| Position::MessageId {
        ledger: k.0,
        entry: k.1,
        partition: index,
        batch: k.2,
    });
}

/// What a Pulsar consumer's [`GroupMetadata::native`] holds: the consumer, through which a
/// transaction of the same connection acknowledges (`PulsarTransaction::commit_offsets`).
pub(crate) struct TxnAcks {
    pub(crate) consumer: std::sync::Weak<PulsarConsumer>,
}

fn sub_type(t: SubscriptionType) -> SubType {
    match t {
        SubscriptionType::Failover => SubType::Failover,
        SubscriptionType::Exclusive => SubType::Exclusive,
        SubscriptionType::Shared => SubType::Shared,
        SubscriptionType::KeyShared => SubType::KeyShared,
    }
}

/// Earliest unless the start (or its fallback) is `Latest`.
fn initial_position(start: &StartFrom) -> InitialPosition {
    match start {
        StartFrom::Committed { fallback } => initial_position(fallback),
        StartFrom::Latest => InitialPosition::Latest,
        _ => InitialPosition::Earliest,
    }
}

impl PulsarConsumer {
    pub(crate) async fn join(shared: Arc<Shared>, config: ConsumerConfig) -> Result<Arc<Self>> {
        let mut options = shared.options.clone();
        options.apply(&config.options)?;
        options.validate()?;
        if config.group.is_empty() {
            return Err(Error::config(
                "consumer group is empty: expected a Pulsar subscription name",
            ));
        }
        if config.topics.is_empty() {
            return Err(Error::config(
                "no topics to subscribe to: expected at least one",
            ));
        }
        let member = config
            .client_id
            .clone()
            .unwrap_or_else(|| format!("member-{:016x}", rand::random::<u64>()));
        let mut topics = Vec::new();
        let mut parts = Vec::new();
        let notify = Arc::new(Notify::new());
        for topic in &config.topics {
            check_topic(topic)?;
            let path = options.admin_path(topic);
            let mut shape = shared.shape(topic).await?;
            if shape == TopicShape::Missing {
                shape = TopicShape::NonPartitioned;
            }
            let existing = match &config.start {
                StartFrom::Committed { fallback }
                    if matches!(**fallback, StartFrom::Position(_) | StartFrom::Timestamp(_)) =>
                {
                    shared
                        .rest
                        .subscription_stats(&path, shape, &config.group)
                        .await
                        .unwrap_or_default()
                }
                StartFrom::Earliest | StartFrom::Latest => shared
                    .rest
                    .subscription_stats(&path, shape, &config.group)
                    .await
                    .unwrap_or_default(),
                _ => Vec::new(),
            };
            let full = options.full_topic(topic);
            let n = shape.partitions();
            for i in 0..n {
                let (name, ppath, index) = match shape {
                    TopicShape::Partitioned(_) => (
                        format!("{full}-partition-{i}"),
                        format!("{path}-partition-{i}"),
                        i as i32,
                    ),
                    _ => (full.clone(), path.clone(), -1),
                };
                let raw = subscribe_within(&shared, &options, &config, &member, &name).await?;
                let (cmd, cmd_rx) = mpsc::unbounded_channel();
                let (tx, rx) = mpsc::channel(options.receiver_queue_size.max(1) as usize);
                let tp = TopicPartition::new(topic.clone(), i as i32);
                let failure = Arc::new(Mutex::new(None));
                let again = Arc::new(Resubscribe {
                    shared: shared.clone(),
                    options: options.clone(),
                    config: config.clone(),
                    member: member.clone(),
                    name: name.clone(),
                });
                tokio::spawn(run_partition(
                    shared.client.clone(),
                    raw,
                    again,
                    Link {
                        topic: topic.clone(),
                        partition: i as i32,
                        index,
                        tx,
                        notify: notify.clone(),
                        failure: failure.clone(),
                    },
                    cmd_rx,
                ));
                let part = Part {
                    tp,
                    path: ppath,
                    index,
                    cmd,
                    rx: Mutex::new(rx),
                    state: Mutex::new(PartState::default()),
                    failure,
                };
                let existed = existing
                    .get(i as usize)
                    .map(|s| s.is_some())
                    .unwrap_or(false);
                let seek_to = match &config.start {
                    StartFrom::Position(p) => Some(StartFrom::Position(p.clone())),
                    StartFrom::Timestamp(t) => Some(StartFrom::Timestamp(*t)),
                    StartFrom::Earliest | StartFrom::Latest if existed => {
                        Some(config.start.clone())
                    }
                    StartFrom::Committed { fallback } if !existed => match &**fallback {
                        s @ (StartFrom::Position(_) | StartFrom::Timestamp(_)) => Some(s.clone()),
                        _ => None,
                    },
                    _ => None,
                };
                parts.push((part, seek_to));
            }
            topics.push((topic.clone(), path, shape));
        }
        let batch_index_ack = shared.capabilities(&options).batch_index_ack;
        let consumer = Arc::new(PulsarConsumer {
            me: std::sync::Weak::new(),
            shared,
            group: config.group,
            member,
            sub_type: options.subscription_type,
            batch_index_ack,
            options,
            topics,
            parts: Vec::new(),
            listener: Mutex::new(None),
            last_refresh: Mutex::new(None),
            rebalancing: tokio::sync::Mutex::new(()),
            closed: AtomicBool::new(false),
            notify,
            rotate: AtomicUsize::new(0),
        });
        let mut consumer = Arc::try_unwrap(consumer).unwrap_or_else(|_| unreachable!());
        let mut seeks = Vec::new();
        for (i, (part, seek)) in parts.into_iter().enumerate() {
            consumer.parts.push(part);
            if let Some(s) = seek {
                seeks.push((i, s));
            }
        }
        let consumer = Arc::new_cyclic(|me| {
            consumer.me = me.clone();
            consumer
        });
        for (i, s) in seeks {
            let tp = consumer.parts[i].tp.clone();
            consumer
                .seek_part(&consumer.parts[i], &s)
                .await
                .map_err(|e| e.context(format!("starting {tp}")))?;
        }
        if !consumer.sub_type.single_active() || consumer.sub_type == SubscriptionType::Exclusive {
            for p in &consumer.parts {
                p.state.lock().assigned = true;
            }
        }
        Ok(consumer)
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            Err(Error::new(ErrorKind::Closed, "the consumer is closed"))
        } else {
            Ok(())
        }
    }

    fn part(&self, tp: &TopicPartition) -> Result<&Part> {
        self.parts.iter().find(|p| &p.tp == tp).ok_or_else(|| {
            Error::new(
                ErrorKind::Fenced,
                format!("{tp} is not read by this member of group '{}'", self.group),
            )
        })
    }

    fn listener(&self) -> Option<Arc<dyn RebalanceListener>> {
        self.listener.lock().clone()
    }

    /// Failover: reads which partitions this member is the active consumer of (topic stats,
    /// `activeConsumerName`) and runs the listener for the changes. A partition given up is
    /// committed first (what `on_revoked` returns), then forgotten: what it fetched and did
    /// not deliver is dropped (the broker redelivers it to the new active consumer).
    async fn refresh(&self, force: bool) -> Result<()> {
        if self.sub_type != SubscriptionType::Failover {
            return Ok(());
        }
        {
            let mut last = self.last_refresh.lock();
            let now = tokio::time::Instant::now();
            if !force && last.is_some_and(|l| now - l < self.options.refresh) {
                return Ok(());
            }
            *last = Some(now);
        }
        let Ok(_guard) = self.rebalancing.try_lock() else {
            return Ok(());
        };
        let active = self.active_consumers(|_| true).await?;
        let mut gained = Vec::new();
        let mut lost = Vec::new();
        for p in &self.parts {
            let now = active
                .get(&p.tp)
                .is_some_and(|a| a.as_deref() == Some(self.member.as_str()));
            let was = p.state.lock().assigned;
            if now && !was {
                gained.push(p.tp.clone());
            } else if !now && was {
                lost.push(p.tp.clone());
            }
        }
        if !lost.is_empty() {
            let commits = self
                .listener()
                .map(|l| l.on_revoked(&lost))
                .unwrap_or_default();
            if !commits.is_empty() {
                if let Err(e) = self.commit_inner(&commits, &mut |_, _, _| {}, None) {
                    tracing::warn!(error = %e, group = %self.group, "commit on revocation failed");
                }
            }
            for tp in &lost {
                if let Ok(p) = self.part(tp) {
                    let mut st = p.state.lock();
                    st.assigned = false;
                    st.reset();
                    let mut rx = p.rx.lock();
                    while rx.try_recv().is_ok() {}
                }
            }
        }
        if !gained.is_empty() {
            for tp in &gained {
                if let Ok(p) = self.part(tp) {
                    let mut st = p.state.lock();
                    st.reset();
                    st.assigned = true;
                }
            }
            if let Some(l) = self.listener() {
                l.on_assigned(&gained);
            }
        }
        Ok(())
    }

    /// Whether `f`, a message of a batch, came with its entry marked acknowledged already by
    /// the broker (see [`crate::bridge::TxnFrames::acknowledged_before`]; read with
    /// transactions, where the bridge reads the consumers' frames).
    fn acknowledged_before(&self, part: &Part, f: &Fetched) -> bool {
        if f.id.batch_size.unwrap_or(0) <= 1 {
            return false;
        }
        let Some(frames) = self
            .shared
            .txn_frames
            .as_ref()
            .filter(|_| self.options.transactions)
        else {
            return false;
        };
        frames.acknowledged_before(&|| self.partition_topic(&part.tp, part), &self.group, &f.id)
    }

    /// Decides whether a fetched message goes to the application, and records it.
    fn admit(&self, st: &mut PartState, f: &Fetched) -> Admit {
        if let Some(min) = st.skip_below {
            if f.key < min {
                return Admit::Skip;
            }
            st.skip_below = None;
        }
        if let Some(t) = st.skip_before {
            if f.message.timestamp.unwrap_or(i64::MAX) < t {
                return Admit::Skip;
            }
            st.skip_before = None;
        }
        // The application holds it: its commit acknowledges it (on whatever connection the
        // consumer has then).
        if st.pending.contains_key(&f.key) {
            return Admit::Drop;
        }
        // Settled, in a batch not yet acknowledged whole (the broker redelivered the entry for
        // a sibling): held, its acknowledgement goes out with the batch's; with ack sets it
        // was sent and is sent again (it may have been lost with a connection).
        if st
            .batches
            .get(&(f.key.0, f.key.1))
            .is_some_and(|b| b.is_settled(f.key.2))
        {
            return if self.batch_index_ack {
                Admit::Skip
            } else {
                Admit::Drop
            };
        }
        // Acknowledged by a committed transaction (a copy from a redelivery asked for before the
        // commit; a batch's is known as such by `batches` only until the batch is complete):
        // given out again, it would be processed twice and the next transaction would
        // acknowledge it again, which the broker refuses ("already acked before"), aborting
        // that transaction. On failover / exclusive a rewind would then wait for it forever
        // (the broker never redelivers it); on shared / key_shared the broker also forgot the
        // other batches that refused acknowledgement named (see `TxnFrames::inject_acks`).
        if st.txn_acked.contains(&f.key) {
            return Admit::Drop;
        }
        if self.sub_type.single_active() {
            if let Some(r) = st.rewind {
                if f.key > r {
                    // Fetched before the broker rewound: it comes again after `r`.
                    if st.rewind_dropped.as_ref().is_none_or(|(k, _)| f.key < *k) {
                        st.rewind_dropped = Some((f.key, f.id.clone()));
                    }
                    return match st.rewind_again() {
                        Some(id) => Admit::Rewind(id),
                        None => Admit::Drop,
                    };
                }
                if f.key == r {
                    st.rewound();
                }
            }
        } else {
            st.nacked.remove(&f.key);
        }
        // Anything else is a message the broker has no acknowledgement for: new, or
        // redelivered after a reconnect although committed (the pulsar crate drops the acks it
        // could not write to a broken connection). No high-water mark or set of acknowledged
        // positions survives that here: the application gets it, and its dedup store skips
        // what was finished.
        Admit::Deliver
    }

    /// Settles messages (committed, or skipped after a seek) and returns the acknowledgements
    /// to send. A message outside a batch is acknowledged as it is. A message of a batch
    /// (`batch_size` > 1 in its id) is recorded in `batches`; once every message of the batch
    /// is settled the whole entry is acknowledged (no batch index, no ack set). Before that,
    /// with batch-index acknowledgement (PIP-54) the entry's ack set goes out (1 for each
    /// message not settled), and without it nothing does: an acknowledgement without an ack
    /// set would acknowledge the unsettled siblings too.
    ///
    /// In a transaction (`txn`) with batch-index acknowledgement, the ack set clears only the
    /// messages settled by this call, also when it completes the batch: the broker refuses
    /// (`TransactionConflict`, "already acked before") a transactional ack set that clears a
    /// message an earlier transaction acknowledged, and a whole-entry acknowledgement of a
    /// batch part of which a transaction acknowledged ("in pending ack status"), so a
    /// pipeline whose transactions ended inside a batch stalled there (test
    /// `transactions_ending_inside_a_batch_commit`).
    fn settle(
        &self,
        st: &mut PartState,
        ids: impl IntoIterator<Item = MessageIdData>,
        txn: bool,
    ) -> Vec<MessageIdData> {
        let mut out = Vec::new();
        let mut touched: BTreeMap<(u64, u64), MessageIdData> = BTreeMap::new();
        // With `txn`: the messages of each batch settled by this call.
        let mut mine: BTreeMap<(u64, u64), BatchAcks> = BTreeMap::new();
        for id in ids {
            let size = id.batch_size.unwrap_or(0);
            let Some(index) = id.batch_index.filter(|i| *i >= 0 && size > 1) else {
                out.push(id);
                continue;
            };
            let entry = (id.ledger_id, id.entry_id);
            st.batches
                .entry(entry)
                .or_insert_with(|| BatchAcks::new(size as u32))
                .settle(index);
            if txn && self.batch_index_ack {
                mine.entry(entry)
                    .or_insert_with(|| BatchAcks::new(size as u32))
                    .settle(index);
            }
            touched.insert(entry, id);
        }
        for (entry, id) in touched {
            let Some(batch) = st.batches.get(&entry) else {
                continue;
            };
            if let Some(own) = mine.get(&entry) {
                if batch.complete() {
                    st.batches.remove(&entry);
                }
                out.push(MessageIdData {
                    ack_set: own.ack_set(),
                    ..id
                });
            } else if batch.complete() {
                st.batches.remove(&entry);
                out.push(MessageIdData {
                    ledger_id: id.ledger_id,
                    entry_id: id.entry_id,
                    partition: id.partition,
                    ..Default::default()
                });
            } else if self.batch_index_ack {
                out.push(MessageIdData {
                    ack_set: batch.ack_set(),
                    ..id
                });
            }
        }
        let keep = (self.options.receiver_queue_size as usize * 2).max(1000);
        while st.batches.len() > keep {
            st.batches.pop_first();
        }
        out
    }

    /// Acknowledges, for each partition, what was delivered up to the position (see
    /// `commit`); returns how many message ids went to the crate consumers. `before_send`
    /// sees each partition's message ids (with the partition's topic name) before they go.
    fn commit_inner(
        &self,
        positions: &[(TopicPartition, Position)],
        before_send: &mut dyn FnMut(&TopicPartition, &str, &[MessageIdData]),
        mut in_txn: Option<&mut Vec<TxnTaken>>,
    ) -> Result<u64> {
        self.check_positions(positions)?;
        let mut sent = 0;
        for (tp, pos) in positions {
            let part = self.part(tp)?;
            let key = pos_key(pos)?;
            let ids: Vec<MessageIdData> = {
                let mut st = part.state.lock();
                if !st.assigned {
                    return Err(Error::new(
                        ErrorKind::Fenced,
                        format!(
                            "{tp} is no longer assigned to this member of group '{}'",
                            self.group
                        ),
                    ));
                }
                let rest = st
                    .pending
                    .split_off(&(key.0, key.1, key.2.saturating_add(1)));
                let taken = std::mem::replace(&mut st.pending, rest);
                match in_txn.as_deref_mut() {
                    // Committed once the transaction commits (`txn_settled`).
                    Some(list) => list.push(TxnTaken {
                        tp: tp.clone(),
                        key,
                        taken: taken.iter().map(|(k, id)| (*k, id.clone())).collect(),
                    }),
                    None => {
                        for k in taken.keys() {
                            st.deliveries.remove(k);
                        }
                    }
                }
                let acks = self.settle(&mut st, taken.into_values(), in_txn.is_some());
                if in_txn.is_none() {
                    note_committed(&mut st, key, part.index);
                }
                acks
            };
            if ids.is_empty() {
                continue;
            }
            sent += ids.len() as u64;
            before_send(tp, &self.partition_topic(tp, part), &ids);
            part.send(Cmd::Ack(ids))?;
        }
        Ok(sent)
    }

    /// The (partition topic, subscription) of each position's partition, as a transaction
    /// registers them (`ADD_SUBSCRIPTION_TO_TXN`). `Fenced` for a partition this member does
    /// not read.
    pub(crate) fn txn_subscriptions(
        &self,
        positions: &[(TopicPartition, Position)],
    ) -> Result<Vec<(String, String)>> {
        self.check_positions(positions)?;
        let mut out = Vec::new();
        for (tp, _) in positions {
            let part = self.part(tp)?;
            let s = (self.partition_topic(tp, part), self.group.clone());
            if !out.contains(&s) {
                out.push(s);
            }
        }
        Ok(out)
    }

    /// Refuses, before anything is acknowledged, positions that are not Pulsar positions
    /// (`Config`), of partitions this member does not read (`Fenced`), or of a message of
    /// another partition than the one they are given for (`Config`): ledger and entry ids are
    /// per partition, so such a position acknowledged, within the named partition, either
    /// nothing or every message delivered there up to an unrelated id, processed or not.
    fn check_positions(&self, positions: &[(TopicPartition, Position)]) -> Result<()> {
        for (tp, pos) in positions {
            let part = self.part(tp)?;
            pos_key(pos)?;
            if let Position::MessageId { partition, .. } = pos {
                if *partition != part.index {
                    let of = if *partition < 0 {
                        "a non-partitioned topic".to_string()
                    } else {
                        format!("partition {partition}")
                    };
                    return Err(Error::config(format!(
                        "position {pos} is a message of {of}, not of {tp}: commit each partition with a position it delivered"
                    )));
                }
            }
        }
        Ok(())
    }

    /// The full topic name of a partition (`persistent://…[-partition-N]`).
    fn partition_topic(&self, tp: &TopicPartition, part: &Part) -> String {
        let full = self.options.full_topic(&tp.topic);
        if part.index >= 0 {
            format!("{full}-partition-{}", part.index)
        } else {
            full
        }
    }

    /// Acknowledges inside a transaction: as `commit`, with `expect(topic, subscription, ids)`
    /// told each partition's message ids before they go (the bridge then puts the
    /// transaction's id on their acknowledgements). Returns how many message ids.
    /// What this member believes committed changes only with [`PulsarConsumer::txn_settled`];
    /// `taken` gets what the acknowledgements cover.
    pub(crate) fn txn_ack(
        &self,
        positions: &[(TopicPartition, Position)],
        expect: &mut dyn FnMut(&str, &str, &[MessageIdData]),
        taken: &mut Vec<TxnTaken>,
    ) -> Result<u64> {
        self.check_open()?;
        let group = self.group.clone();
        self.commit_inner(
            positions,
            &mut |_, topic, ids| expect(topic, &group, ids),
            Some(taken),
        )
    }

    /// Before a transaction that acknowledged `taken` commits: `Fenced` when one of those
    /// partitions is no longer this member's (failover: the broker's active consumer of the
    /// partition, read now from the topic stats, is another member), as Kafka refuses the
    /// offsets of a member the group removed. Shared and key_shared members read every
    /// partition; there the acknowledgements themselves conflict (`TransactionConflict`).
    pub(crate) async fn txn_check_active(&self, taken: &[TxnTaken]) -> Result<()> {
        for t in taken {
            let part = self.part(&t.tp)?;
            if !part.state.lock().assigned {
                return Err(self.moved(&t.tp, None));
            }
        }
        if self.sub_type != SubscriptionType::Failover {
            return Ok(());
        }
        let active = self
            .active_consumers(|topic| taken.iter().any(|t| t.tp.topic == topic))
            .await?;
        for t in taken {
            let now = active.get(&t.tp).cloned().flatten();
            if now.as_deref() != Some(self.member.as_str()) {
                return Err(self.moved(&t.tp, now));
            }
        }
        Ok(())
    }

    /// The broker's active consumer (failover) of each partition of the topics `wanted`
    /// picks, from the topic stats (`activeConsumerName`); `None` where it names none.
    async fn active_consumers(
        &self,
        wanted: impl Fn(&str) -> bool,
    ) -> Result<HashMap<TopicPartition, Option<String>>> {
        let mut active = HashMap::new();
        for (topic, path, shape) in self.topics.iter().filter(|(t, ..)| wanted(t)) {
            let stats = self
                .shared
                .rest
                .subscription_stats(path, *shape, &self.group)
                .await?;
            for (i, s) in stats.into_iter().enumerate() {
                active.insert(
                    TopicPartition::new(topic.clone(), i as i32),
                    s.and_then(|s| s.active_consumer),
                );
            }
        }
        Ok(active)
    }

    fn moved(&self, tp: &TopicPartition, to: Option<String>) -> Error {
        Error::new(
            ErrorKind::Fenced,
            format!(
                "{tp} is no longer read by this member of group '{}' (its active consumer is \
                 {}): the transaction may not commit positions there",
                self.group,
                to.as_deref().unwrap_or("another member")
            ),
        )
    }

    /// The transaction that acknowledged `taken` ended: committed, what this member believes
    /// committed moves past them (as a plain `commit` does at once); aborted, its
    /// acknowledgements are void and the messages are pending again: this member still holds
    /// them, a later commit acknowledges them, and the broker's redelivery of them (it puts an
    /// aborted transaction's acknowledged messages back as unacknowledged) is not delivered
    /// twice.
    pub(crate) fn txn_settled(&self, taken: &[TxnTaken], committed: bool) {
        for t in taken {
            let Ok(part) = self.part(&t.tp) else { continue };
            let mut st = part.state.lock();
            if committed {
                for (k, _) in &t.taken {
                    st.deliveries.remove(k);
                    st.txn_acked.insert(*k);
                }
                let keep = (self.options.receiver_queue_size as usize * 2).max(1000);
                while st.txn_acked.len() > keep {
                    st.txn_acked.pop_first();
                }
                note_committed(&mut st, t.key, part.index);
            } else {
                // Not settled in their batches any more. A settled message of a batch is one
                // whose acknowledgement is under way, so its redelivery (the pipeline's rewind
                // after the abort) was skipped and acknowledged again outside any transaction
                // (the input lost: its output never committed), and on failover / exclusive
                // the rewind waiting for it dropped everything after it (test
                // `a_batched_input_acknowledged_in_an_aborted_transaction_comes_again`).
                // A batch the transaction completed was forgotten then (its last
                // acknowledgement sent): its other messages are settled still, and must be
                // known as such when the broker redelivers the entry (test
                // `the_rest_of_a_batch_acknowledged_in_an_aborted_transaction_comes_again`).
                for (k, id) in &t.taken {
                    let size = id.batch_size.unwrap_or(0);
                    if k.2 < 0 || size <= 1 {
                        continue;
                    }
                    st.batches
                        .entry((k.0, k.1))
                        .or_insert_with(|| BatchAcks::settled(size as u32))
                        .unsettle(k.2);
                }
                if st.assigned {
                    for (k, id) in &t.taken {
                        st.pending.entry(*k).or_insert_with(|| id.clone());
                    }
                }
            }
        }
    }

    /// While on (counted: each `true` is undone by one `false`), every partition task keeps
    /// reading from its crate consumer into its own queue although the application is not
    /// polling. The pulsar crate's consumer engine writes acknowledgements from the same loop
    /// that hands messages to its bounded stream: a batch larger than the room left there (a
    /// Java producer's 1000 messages, say) stops that loop until the stream is read, and a
    /// transaction waiting for its acknowledgements' answers before committing, with the
    /// application waiting for the commit instead of polling, waited until its timeout and
    /// aborted (benchmark P2: every transaction past the first batch). A transaction is on for
    /// as long as it waits for those answers.
    pub(crate) fn draining(&self, on: bool) {
        for part in &self.parts {
            let _ = part.cmd.send(Cmd::Drain(on));
        }
    }

    /// Seeks one partition (the broker resets the subscription's cursor; every consumer of the
    /// subscription on that partition is disconnected and reconnects).
    async fn seek_part(&self, part: &Part, to: &StartFrom) -> Result<()> {
        let partitioned = part.index >= 0;
        let (id, time, skip_below, skip_before) = match to {
            StartFrom::Committed { fallback } => {
                let committed = self.committed_of(part).await?;
                return match committed {
                    Some(p) => Box::pin(self.seek_part(part, &StartFrom::Position(p))).await,
                    None => Box::pin(self.seek_part(part, fallback)).await,
                };
            }
            // Pulsar's earliest and latest message ids.
            StartFrom::Earliest => (
                Some(MessageIdData {
                    ledger_id: u64::MAX,
                    entry_id: u64::MAX,
                    ..Default::default()
                }),
                None,
                None,
                None,
            ),
            StartFrom::Latest => (
                Some(MessageIdData {
                    ledger_id: i64::MAX as u64,
                    entry_id: i64::MAX as u64,
                    ..Default::default()
                }),
                None,
                None,
                None,
            ),
            StartFrom::Position(p) => {
                let key = pos_key(p)?;
                let mut id = convert::message_id(p, partitioned)?;
                // The broker seeks to entries; the rest of a batch before the position is
                // skipped here.
                id.batch_index = None;
                (Some(id), None, Some(key), None)
            }
            StartFrom::Timestamp(t) => {
                // The broker seeks by publish time; a message's time here is its event time
                // (the record's timestamp), which is not later than its publish time, so the
                // broker's position is at or before the wanted one and the messages still
                // earlier are skipped here.
                (None, Some((*t).max(0) as u64), None, Some(*t))
            }
        };
        let (done, wait) = oneshot::channel();
        part.send(Cmd::Seek { id, time, done })?;
        wait.await.map_err(|_| part.closed())??;
        let mut st = part.state.lock();
        {
            let mut rx = part.rx.lock();
            while rx.try_recv().is_ok() {}
        }
        let assigned = st.assigned;
        st.reset();
        st.assigned = assigned;
        st.skip_below = skip_below;
        st.skip_before = skip_before;
        Ok(())
    }

    async fn committed_of(&self, part: &Part) -> Result<Option<Position>> {
        if let Some(p) = part.state.lock().committed_next.clone() {
            return Ok(Some(p));
        }
        committed_from_cursor(
            &self.shared,
            &part.path,
            &self.group,
            (part.index >= 0).then_some(part.index),
        )
        .await
    }
}

#[derive(Debug)]
enum Admit {
    /// Give it to the application.
    Deliver,
    /// Not for the application: held already, or coming again.
    Drop,
    /// Before the start of a seek: acknowledged and skipped.
    Skip,
    /// Not for the application: the broker is asked to rewind again, to this message.
    Rewind(MessageIdData),
}

/// [`subscribe`] within `operation_timeout_ms`. The broker answers a subscribe it cannot take
/// now with `ConsumerBusy`: an exclusive subscription that has a consumer, or a subscription
/// that exists with consumers of another type. The pulsar crate retries that every 5 s with no
/// limit, so unbounded the caller waited for ever (the Java client fails it at once with
/// `ConsumerBusyException`); bounded, it gets a retriable `Connect` error naming the
/// subscription, its type and the likely cause. The bound leaves the broker time to let go of
/// a consumer whose connection just died.
async fn subscribe_within(
    shared: &Shared,
    options: &PulsarOptions,
    config: &ConsumerConfig,
    member: &str,
    topic: &str,
) -> Result<RawConsumer> {
    let bound = options.operation_timeout;
    match tokio::time::timeout(bound, subscribe(shared, options, config, member, topic)).await {
        Ok(r) => r,
        Err(_) => {
            let (group, kind) = (&config.group, options.subscription_type.name());
            Err(Error::new(
                ErrorKind::Connect,
                format!(
                    "subscribing '{member}' to '{topic}' as '{group}' ({kind}): not subscribed \
                     within {} ms (operation_timeout_ms): the broker did not answer, or kept \
                     answering ConsumerBusy: subscription '{group}' already has a consumer and \
                     is exclusive, or it has consumers of another type than {kind}",
                    bound.as_millis()
                ),
            )
            .retriable(true))
        }
    }
}

async fn subscribe(
    shared: &Shared,
    options: &PulsarOptions,
    config: &ConsumerConfig,
    member: &str,
    topic: &str,
) -> Result<RawConsumer> {
    let copts = ConsumerOptions {
        initial_position: initial_position(&config.start),
        // The crate's queue between its consumer engine and us.
        receiver_queue_size: Some(options.receiver_queue_size),
        metadata: options.metadata.clone(),
        durable: Some(true),
        ..Default::default()
    };
    let mut b = shared
        .client
        .consumer()
        .with_topic(topic)
        .with_subscription(&config.group)
        .with_subscription_type(sub_type(options.subscription_type))
        .with_consumer_name(member)
        // The flow permits the crate gives the broker (its `batch_size`, 1000 unless set): the
        // messages the broker may push ahead. The crate's consumer engine handles our acks
        // only behind the messages it has received, so this also bounds how far acks lag.
        .with_batch_size(options.receiver_queue_size)
        .with_options(copts)
        .with_unacked_message_resend_delay(options.ack_timeout);
    if let Some(dlq) = &options.dead_letter {
        b = b.with_dead_letter_policy(DeadLetterPolicy {
            max_redeliver_count: options.max_redeliver,
            dead_letter_topic: options.full_topic(dlq),
        });
    }
    b.build::<Vec<u8>>().await.map_err(|e| {
        let err = pulsar_err(
            format!("subscribing '{member}' to '{topic}' as '{}'", config.group),
            e,
        );
        if err.message().contains("ConsumerBusy") || err.message().contains("Exclusive") {
            Error::new(ErrorKind::Fenced, err.message().to_string())
        } else {
            err
        }
    })
}

/// Converts a message of the crate consumer, taking its payload over (no copy).
fn convert_message(
    topic: &str,
    partition: i32,
    index: i32,
    m: pulsar::consumer::Message<Vec<u8>>,
) -> Fetched {
    let mut id = m.message_id().clone();
    let meta = m.metadata();
    if id.batch_index.is_some_and(|i| i >= 0) {
        // The size of its batch, for `settle` (the crate leaves it out).
        id.batch_size = meta.num_messages_in_batch;
    }
    let position = convert::position(&id, index);
    let key = pos_key(&position).unwrap_or_default();
    let record_key = convert::read_key(&m);
    let headers = convert::read_headers(&meta.properties);
    let timestamp = Some(convert::read_timestamp(meta));
    let message = Message {
        topic: topic.to_string(),
        partition,
        position,
        key: record_key,
        payload: Bytes::from(m.payload.data),
        headers,
        timestamp,
        delivery_count: 1,
    };
    Fetched { id, key, message }
}

/// Closes the crate consumer after the acks queued to it have been written to the connection,
/// within `deadline`.
///
/// The crate's consumer engine handles acks and the close request (it asks the engine for its
/// connection) in order with the messages the broker pushed before them, and it waits while
/// its queue to us is full. Closing without reading would leave the acks queued behind those
/// messages: the close timed out, the consumer was dropped, and the acks were lost (a new
/// member of the group got messages committed long before). So the queue to us is emptied
/// (those messages were never delivered; the broker redelivers them to the next consumer)
/// before each wait for the close, and the wait is retried, longer each time, while the engine
/// still had more ahead of the request than the queue holds.
async fn close_after_acks(c: &mut RawConsumer, topic: &str, partition: i32, deadline: Duration) {
    let until = tokio::time::Instant::now() + deadline;
    let mut step = CLOSE_STEP;
    // What the engine has ahead of the close reaches us as soon as there is room: read until
    // two reads 10 ms apart find nothing (at most CLOSE_DRAIN), so that the close request is
    // not queued behind more than the queue holds and its first wait is enough.
    let drain_until = tokio::time::Instant::now() + CLOSE_DRAIN.min(deadline / 2);
    let mut quiet = 0;
    while quiet < 2 && tokio::time::Instant::now() < drain_until {
        let mut any = false;
        while let Some(Some(_)) = c.next().now_or_never() {
            any = true;
        }
        quiet = if any { 0 } else { quiet + 1 };
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    loop {
        while let Some(Some(_)) = c.next().now_or_never() {}
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        match tokio::time::timeout(step.min(left), c.close()).await {
            Ok(Ok(())) => return,
            Ok(Err(e)) => {
                // After an earlier wait that ran out once the request had gone out, the
                // broker has closed the consumer already.
                tracing::debug!(error = %e, %topic, partition, "closing the Pulsar consumer");
                return;
            }
            Err(_) if left <= step => {
                tracing::warn!(
                    %topic,
                    partition,
                    "the Pulsar consumer did not close in {deadline:?}: acknowledgements still \
                     queued in the client are dropped, and the broker redelivers those messages"
                );
                return;
            }
            Err(_) => step *= 2,
        }
    }
}

/// A partition task's ends towards the consumer: where its messages go, and where it reports
/// that it cannot subscribe again.
struct Link {
    topic: String,
    partition: i32,
    index: i32,
    tx: mpsc::Sender<Fetched>,
    notify: Arc<Notify>,
    failure: Arc<Mutex<Option<Error>>>,
}

/// Hands what `held` has, in order, to the poller's queue, as much as it has room for;
/// whether anything went (the caller notifies the poller once).
fn hand_over(held: &mut VecDeque<Fetched>, tx: &mpsc::Sender<Fetched>) -> bool {
    let mut sent = false;
    while let Some(f) = held.pop_front() {
        match tx.try_send(f) {
            Ok(()) => sent = true,
            Err(mpsc::error::TrySendError::Full(f) | mpsc::error::TrySendError::Closed(f)) => {
                held.push_front(f);
                break;
            }
        }
    }
    sent
}

/// The next message of the crate consumer; never, while there is none (resubscribing).
async fn next_of(
    c: &mut Option<RawConsumer>,
) -> Option<std::result::Result<pulsar::consumer::Message<Vec<u8>>, pulsar::Error>> {
    match c {
        Some(c) => c.next().await,
        None => futures::future::pending().await,
    }
}

/// The task owning one partition's crate consumer: forwards messages (held only up to the room
/// in the poller's queue, so the broker's flow control bounds what is fetched) and runs acks,
/// nacks, seeks and close.
///
/// When the crate consumer's stream ends (the crate gave up reconnecting to the broker after
/// `connection_max_retries`), the task subscribes again with the same subscription name, type,
/// consumer name and options, with a backoff from 200 ms to 5 s while the broker cannot be
/// reached, and sets [`Part::failure`] to a retriable `Connect` error after each failed
/// attempt. The broker then redelivers, from the subscription's cursor, every message not
/// acknowledged: what `poll` delivered and was not committed stays pending (its commit
/// acknowledges it on the new consumer; its redelivered copy is dropped), and what was
/// committed but whose acknowledgement the crate lost with the connection comes again (the
/// dedup store skips it). Acknowledgements asked for while there is no consumer are sent once
/// there is one again.
async fn run_partition(
    client: pulsar::Pulsar<TokioExecutor>,
    raw: RawConsumer,
    again: Arc<Resubscribe>,
    link: Link,
    mut cmds: mpsc::UnboundedReceiver<Cmd>,
) {
    let Link {
        topic,
        partition,
        index,
        tx,
        notify,
        failure,
    } = link;
    let mut c = Some(raw);
    // Read from the crate consumer, not yet handed to `tx`: at most what `tx` has room for
    // (so the broker's flow control bounds what is fetched), or more while `draining`.
    let mut held: VecDeque<Fetched> = VecDeque::new();
    let mut draining: u32 = 0;
    let mut resubscribing: Option<Subscribing> = None;
    let mut backoff = RESUBSCRIBE_STEP;
    // Acknowledgements asked for while there is no crate consumer.
    let mut deferred: Vec<MessageIdData> = Vec::new();
    loop {
        tokio::select! {
            biased;
            cmd = cmds.recv() => match cmd {
                None => break,
                Some(Cmd::Ack(ids)) => {
                    let Some(c) = c.as_mut() else {
                        deferred.extend(ids);
                        continue;
                    };
                    // Queued to the crate's consumer engine, which writes them to the
                    // connection in order with everything else it handles (see `commit`).
                    for id in ids {
                        if let Err(e) = c.ack_with_id(&topic, id).await {
                            tracing::warn!(error = %e, %topic, partition, "ack failed");
                        }
                    }
                }
                Some(Cmd::Nack(id)) => {
                    // Without a consumer, the message comes again anyway once subscribed.
                    if let Some(c) = c.as_mut() {
                        if let Err(e) = c.nack_with_id(&topic, id).await {
                            tracing::warn!(error = %e, %topic, partition, "negative ack failed");
                        }
                    }
                }
                Some(Cmd::Drain(on)) => draining = if on { draining + 1 } else { draining.saturating_sub(1) },
                Some(Cmd::Seek { id, time, done }) => {
                    held.clear();
                    let r = match c.as_mut() {
                        Some(c) => c
                            .seek(None, id, time, client.clone())
                            .await
                            .map_err(|e| pulsar_err(format!("seeking {topic}[{partition}]"), e)),
                        None => Err(Error::new(
                            ErrorKind::Connect,
                            format!(
                                "seeking {topic}[{partition}]: the consumer is subscribing again \
                                 after losing its connection to the broker at {}",
                                onceflow_core::redact_credentials(&again.options.service_url)
                            ),
                        )
                        .retriable(true)),
                    };
                    let _ = done.send(r);
                }
                Some(Cmd::Close(deadline, done)) => {
                    // What this task holds was not delivered: the broker redelivers it.
                    if let Some(c) = c.as_mut() {
                        close_after_acks(c, &topic, partition, deadline).await;
                    }
                    let _ = done.send(());
                    return;
                }
            },
            permit = tx.reserve(), if !held.is_empty() => match permit {
                Ok(p) => {
                    if let Some(f) = held.pop_front() {
                        p.send(f);
                    }
                    hand_over(&mut held, &tx);
                    notify.notify_one();
                }
                Err(_) => break,
            },
            r = async { resubscribing.as_mut().expect("guarded").await }, if resubscribing.is_some() => {
                resubscribing = None;
                match r {
                    Ok(mut fresh) => {
                        tracing::info!(%topic, partition, "Pulsar consumer subscribed again");
                        for id in deferred.drain(..) {
                            if let Err(e) = fresh.ack_with_id(&topic, id).await {
                                tracing::warn!(error = %e, %topic, partition, "ack failed");
                            }
                        }
                        c = Some(fresh);
                        backoff = RESUBSCRIBE_STEP;
                        *failure.lock() = None;
                    }
                    Err(e) => {
                        let err = again.failed(&topic, partition, &e, backoff);
                        tracing::warn!(error = %err, "subscribing again failed");
                        *failure.lock() = Some(err);
                        notify.notify_one();
                        resubscribing = Some(again.attempt(backoff));
                        backoff = (backoff * 2).min(RESUBSCRIBE_MAX);
                    }
                }
            },
            m = next_of(&mut c), if (held.is_empty() || draining > 0) && c.is_some() => {
                // With the message that woke the task, what the crate consumer has ready
                // besides, up to the room in `tx` (so what the task holds stays within the
                // queue's bound, as one message at a time did), is taken in this one round and
                // handed over together with one notification: one select round and one
                // wake-up of the poller per burst, not per message.
                let mut next = Some(m);
                while let Some(m) = next.take() {
                    match m {
                        Some(Ok(m)) => held.push_back(convert_message(&topic, partition, index, m)),
                        Some(Err(e)) => {
                            tracing::debug!(error = %e, %topic, partition, "Pulsar consumer error");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            break;
                        }
                        None => {
                            tracing::warn!(
                                %topic,
                                partition,
                                "the Pulsar consumer's connection to the broker is gone for good \
                                 (the client stopped reconnecting); subscribing again"
                            );
                            c = None;
                            resubscribing = Some(again.attempt(Duration::ZERO));
                            break;
                        }
                    }
                    if held.len() >= tx.capacity().max(1) {
                        break;
                    }
                    next = c.as_mut().and_then(|c| c.next().now_or_never());
                }
                if hand_over(&mut held, &tx) {
                    notify.notify_one();
                }
            },
        }
    }
    // The consumer was dropped without `close` (its commands and queue are gone): the crate
    // consumer is closed here all the same, after the acks queued before, as `close` does.
    if let Some(c) = c.as_mut() {
        close_after_acks(c, &topic, partition, again.options.operation_timeout).await;
    }
}

#[async_trait]
impl ConsumerBackend for PulsarConsumer {
    fn capabilities(&self) -> Capabilities {
        self.shared.capabilities(&self.options)
    }

    fn set_rebalance_listener(&self, listener: Arc<dyn RebalanceListener>) {
        *self.listener.lock() = Some(listener);
    }

    async fn poll(&self, max: usize, timeout: Duration) -> Result<Vec<Message>> {
        self.check_open()?;
        let deadline = tokio::time::Instant::now() + timeout;
        let k = self.parts.len();
        let mut out = Vec::new();
        loop {
            if let Err(e) = self.refresh(false).await {
                tracing::warn!(error = %e, group = %self.group, "reading the active partitions failed; retrying");
            }
            let start = self.rotate.fetch_add(1, Ordering::Relaxed) % k.max(1);
            for j in 0..k {
                let part = &self.parts[(start + j) % k];
                let mut skipped = Vec::new();
                {
                    let mut st = part.state.lock();
                    if !st.assigned || st.paused {
                        continue;
                    }
                    if let Some(id) = st.rewind_again() {
                        let _ = part.cmd.send(Cmd::Nack(id));
                    }
                    let mut rx = part.rx.lock();
                    while out.len() < max {
                        let Ok(f) = rx.try_recv() else { break };
                        if self.acknowledged_before(part, &f) {
                            tracing::debug!(
                                target: "onceflow_pulsar::frames",
                                tp = %part.tp,
                                key = ?f.key,
                                "poll: acknowledged before, skipped"
                            );
                            // Settled (by whoever acknowledged it), never delivered again; a
                            // rewind to it is over.
                            if st.rewind == Some(f.key) {
                                st.rewound();
                            }
                            let size = f.id.batch_size.unwrap_or(0) as u32;
                            st.batches
                                .entry((f.key.0, f.key.1))
                                .or_insert_with(|| BatchAcks::new(size))
                                .settle(f.key.2);
                            continue;
                        }
                        let verdict = self.admit(&mut st, &f);
                        tracing::debug!(
                            target: "onceflow_pulsar::frames",
                            tp = %part.tp,
                            key = ?f.key,
                            verdict = ?verdict,
                            "poll: admit"
                        );
                        match verdict {
                            Admit::Deliver => {
                                let n = st.deliveries.entry(f.key).or_insert(0);
                                *n += 1;
                                let mut m = f.message;
                                m.delivery_count = *n;
                                st.pending.insert(f.key, f.id);
                                out.push(m);
                            }
                            Admit::Drop => {}
                            Admit::Skip => skipped.push(f.id),
                            Admit::Rewind(id) => {
                                let _ = part.cmd.send(Cmd::Nack(id));
                            }
                        }
                    }
                }
                if !skipped.is_empty() {
                    let acks = self.settle(&mut part.state.lock(), skipped, false);
                    if !acks.is_empty() {
                        let _ = part.cmd.send(Cmd::Ack(acks));
                    }
                }
                if out.len() >= max {
                    break;
                }
            }
            // A partition that lost its consumer (subscribing again after an outage) is an
            // error only when no other partition had anything to give.
            if out.is_empty() {
                if let Some(e) = self.parts.iter().find_map(|p| p.failure.lock().take()) {
                    return Err(e);
                }
            }
            let now = tokio::time::Instant::now();
            if !out.is_empty() || now >= deadline {
                return Ok(out);
            }
            let wait = (deadline - now).min(self.options.refresh);
            let _ = tokio::time::timeout(wait, self.notify.notified()).await;
        }
    }

    /// Acknowledges, individually, every message of the partition delivered by `poll` up to the
    /// position and not nacked. A message of a batch is acknowledged with an ack set
    /// (batch-index acknowledgement, PIP-54, where
    /// [`Capabilities::batch_index_ack`](onceflow_core::Capabilities::batch_index_ack) is on),
    /// else only once every message of its batch is settled (see `settle`).
    ///
    /// Returns once the acknowledgements are queued, in order, to the partition's Pulsar
    /// consumer; it does not wait for the broker. Pulsar acknowledgements are one-way commands
    /// with no reply (the broker answers an acknowledgement only when the client asks for ack
    /// receipts, `isAckReceiptEnabled` in the Java client, which the `pulsar` crate has not;
    /// the Java client by default even groups acknowledgements for 100 ms,
    /// `acknowledgmentGroupTime`), see
    /// <https://pulsar.apache.org/docs/next/concepts-messaging/#acknowledgment>. The `pulsar`
    /// crate writes them to the consumer's connection behind the messages the broker pushed to
    /// it before (at most `receiver_queue_size` per partition), so they reach the broker as the
    /// application reads on. [`close`](ConsumerBackend::close) sends every acknowledgement
    /// queued before it and then closes the consumer on the same connection, which the broker
    /// handles in that order: after `commit` and `close`, the group resumes after the committed
    /// position. A process that dies between `commit` and `close` may get the last committed
    /// messages again (at-least-once; the dedup store skips them).
    async fn commit(&self, positions: &[(TopicPartition, Position)]) -> Result<()> {
        self.check_open()?;
        self.commit_inner(positions, &mut |_, _, _| {}, None)
            .map(drop)
    }

    async fn committed(
        &self,
        partitions: &[TopicPartition],
    ) -> Result<Vec<(TopicPartition, Option<Position>)>> {
        let mut out = Vec::with_capacity(partitions.len());
        for tp in partitions {
            let pos = match self.parts.iter().find(|p| &p.tp == tp) {
                Some(p) => self.committed_of(p).await?,
                None => {
                    let path = self.options.admin_path(&tp.topic);
                    let shape = self.shared.shape(&tp.topic).await?;
                    let (ppath, idx) = match shape {
                        TopicShape::Partitioned(_) => (
                            format!("{path}-partition-{}", tp.partition),
                            Some(tp.partition),
                        ),
                        _ => (path, None),
                    };
                    committed_from_cursor(&self.shared, &ppath, &self.group, idx).await?
                }
            };
            out.push((tp.clone(), pos));
        }
        Ok(out)
    }

    /// Resets the subscription's cursor on the partition (Pulsar seek by message id, or by
    /// publish time for a timestamp, refined by the messages' event times).
    async fn seek(&self, partition: &TopicPartition, to: &StartFrom) -> Result<()> {
        self.check_open()?;
        let part = self.part(partition)?;
        self.seek_part(part, to).await
    }

    /// Negative acknowledgements, at once, of what was delivered and not committed, instead of
    /// a seek: a seek resets the subscription's cursor, which makes every message past the
    /// position unacknowledged again, including those a committed transaction acknowledged past
    /// a hole (a message of an open or aborted transaction); they would be processed twice.
    /// Failover / exclusive: one, of the earliest such message; the broker then rewinds its
    /// read position to the mark-delete position and redelivers, in order, every message not
    /// acknowledged (individual acknowledgements stay). Shared / key_shared: each such message.
    /// A partition with nothing delivered and uncommitted needs nothing. Every partition of
    /// this consumer is handled.
    ///
    /// Errors: `Closed` once closed; `Fenced` for a partition this member does not read
    /// (checked for all before any is rewound).
    async fn redeliver_uncommitted(
        &self,
        partitions: &[TopicPartition],
    ) -> Result<Vec<TopicPartition>> {
        self.check_open()?;
        for tp in partitions {
            self.part(tp)?;
        }
        let mut handled = Vec::with_capacity(partitions.len());
        for tp in partitions {
            let part = self.part(tp)?;
            let nacks: Vec<MessageIdData> = {
                let mut st = part.state.lock();
                if self.sub_type.single_active() {
                    let first = st.pending.first_key_value().map(|(k, id)| (*k, id.clone()));
                    first
                        .map(|(key, id)| {
                            st.rewind_to(key);
                            id
                        })
                        .into_iter()
                        .collect()
                } else {
                    let pending = std::mem::take(&mut st.pending);
                    st.nacked.extend(pending.keys().copied());
                    pending.into_values().collect()
                }
            };
            for id in nacks {
                part.send(Cmd::Nack(id))?;
            }
            handled.push(tp.clone());
        }
        Ok(handled)
    }

    async fn pause(&self, partitions: &[TopicPartition]) -> Result<()> {
        for tp in partitions {
            self.part(tp)?.state.lock().paused = true;
        }
        Ok(())
    }

    async fn resume(&self, partitions: &[TopicPartition]) -> Result<()> {
        for tp in partitions {
            self.part(tp)?.state.lock().paused = false;
        }
        self.notify.notify_one();
        Ok(())
    }

    fn assignment(&self) -> Vec<TopicPartition> {
        if self.closed.load(Ordering::Acquire) {
            return Vec::new();
        }
        self.parts
            .iter()
            .filter(|p| p.state.lock().assigned)
            .map(|p| p.tp.clone())
            .collect()
    }

    /// `msgBacklog` of the subscription on each assigned partition (admin REST topic stats).
    async fn lag(&self) -> Result<Vec<PartitionLag>> {
        let mut out = Vec::new();
        for (topic, path, shape) in &self.topics {
            let stats = self
                .shared
                .rest
                .subscription_stats(path, *shape, &self.group)
                .await?;
            for (i, s) in stats.into_iter().enumerate() {
                let tp = TopicPartition::new(topic.clone(), i as i32);
                let Some(part) = self.parts.iter().find(|p| p.tp == tp) else {
                    continue;
                };
                if !part.state.lock().assigned {
                    continue;
                }
                out.push(PartitionLag {
                    committed: self.committed_of(part).await?,
                    partition: tp,
                    high_watermark: None,
                    messages: s.map(|s| s.backlog).unwrap_or(0),
                    millis: None,
                });
            }
        }
        Ok(out)
    }

    fn group_metadata(&self) -> Option<GroupMetadata> {
        Some(GroupMetadata {
            group: self.group.clone(),
            generation: 0,
            member_id: self.member.clone(),
            native: Some(Arc::new(TxnAcks {
                consumer: self.me.clone(),
            })),
        })
    }

    /// Negative ack after `delay` (the crate's nack is immediate, so onceflow waits first).
    /// Shared / key_shared: that message alone comes again. Failover / exclusive: the broker
    /// redelivers every unacked message of the partition in order, so onceflow drops what it
    /// fetches until the nacked message is back, and still holds the earlier ones.
    async fn nack(&self, message: &Message, delay: Duration) -> Result<()> {
        self.check_open()?;
        let Ok(part) = self.part(&message.topic_partition()) else {
            return Ok(());
        };
        let key = pos_key(&message.position)?;
        let id = {
            let mut st = part.state.lock();
            let Some(id) = st.pending.remove(&key) else {
                tracing::debug!(tp = %part.tp, position = %message.position, "nack of a message not pending");
                return Ok(());
            };
            if self.sub_type.single_active() {
                // Everything after it comes again too.
                st.rewind_to(key);
            } else {
                st.nacked.insert(key);
            }
            id
        };
        let cmd = part.cmd.clone();
        if delay.is_zero() {
            let _ = cmd.send(Cmd::Nack(id));
        } else {
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let _ = cmd.send(Cmd::Nack(id));
            });
        }
        Ok(())
    }

    /// Closes the crate consumers after the acknowledgements queued by `commit` have been sent
    /// (see `commit`), within the operation timeout. The subscription stays, with its
    /// acknowledgements; what was delivered and not committed is redelivered to the next active
    /// consumer.
    async fn close(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let mut waits = Vec::new();
        for p in &self.parts {
            let (tx, rx) = oneshot::channel();
            if p.cmd
                .send(Cmd::Close(self.options.operation_timeout, tx))
                .is_ok()
            {
                waits.push(rx);
            }
        }
        for w in waits {
            let _ = tokio::time::timeout(self.options.operation_timeout + CLOSE_STEP, w).await;
        }
        for p in &self.parts {
            p.state.lock().assigned = false;
        }
        Ok(())
    }
}
