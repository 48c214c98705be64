//! The consumer: one member of a Kafka consumer group on rdkafka's `BaseConsumer`, with a
//! `ConsumerContext` whose rebalance callback (served inside [`ConsumerBackend::poll`]) drives
//! onceflow's [`RebalanceListener`] with KIP-429 incremental cooperative assignment.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use onceflow_core::{
    Capabilities, ConsumerBackend, ConsumerConfig, Error, ErrorKind, GroupMetadata, Header,
    Headers, Isolation, Message, PartitionLag, Position, RebalanceListener, Result, StartFrom,
    TopicPartition,
};
use parking_lot::{Mutex, RwLock};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::{BorrowedMessage, Headers as _};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Message as _, Offset, TopicPartitionList};

use crate::config::KafkaConfig;
use crate::errors;
use crate::CAPABILITIES;

/// What this member has seen of each assigned partition, so that a commit covers the offsets
/// Kafka never delivers: transaction markers (one offset after every transaction's records)
/// and records of aborted transactions. Committing "last finished + 1" alone leaves the
/// committed offset short of the end for ever after transactional input, and lag at 1 or more
/// (KAFKA-6607; librdkafka moves its application position past a control record when it serves
/// one, since v1.4.0).
///
/// At the end of every poll the delivered offsets and librdkafka's application position
/// (`rd_kafka_position`) are recorded together. Every offset between the highest delivered one
/// and that position was served without being delivered, and every later delivery is at or
/// past it, so where the finished position is the highest delivered one, committing the
/// recorded position skips nothing. A seek resets the position (librdkafka does the same).
#[derive(Default)]
pub(crate) struct Progress {
    parts: Mutex<HashMap<TopicPartition, Seen>>,
    /// Bumped on every seek, assignment and revocation: a poll that started before one does not
    /// record the positions it read.
    epoch: AtomicU64,
}

#[derive(Clone, Copy, Debug, Default)]
struct Seen {
    /// Highest offset delivered since the partition was assigned.
    delivered: Option<i64>,
    /// librdkafka's application position right after the deliveries above (the offset after the
    /// last record or control record it served), since the last seek.
    position: Option<i64>,
    /// The highest next offset known committed in the partition since it was assigned: by
    /// this member (plainly or in a transaction) or read from the group.
    committed: Option<i64>,
    /// The next offset of this member's latest commit of the partition since it was assigned
    /// (plainly or in a transaction), which may be lower than `committed`: a commit back to an
    /// earlier offset, to read from there again.
    own: Option<i64>,
}

impl Progress {
    fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Records a poll's deliveries and the positions read after them, taken in a poll that
    /// started at `epoch`.
    fn observe(&self, epoch: u64, delivered: &[Message], positions: Option<&TopicPartitionList>) {
        // The highest offset per partition first (a poll holds few partitions), then one map
        // entry each.
        let mut highest: Vec<(&str, i32, i64)> = Vec::new();
        for m in delivered {
            let Some(o) = m.position.as_offset() else {
                continue;
            };
            match highest
                .iter_mut()
                .find(|(t, p, _)| *p == m.partition && *t == m.topic)
            {
                Some((_, _, h)) => *h = (*h).max(o),
                None => highest.push((&m.topic, m.partition, o)),
            }
        }
        let mut parts = self.parts.lock();
        for (topic, partition, o) in highest {
            let seen = parts
                .entry(TopicPartition::new(topic, partition))
                .or_default();
            seen.delivered = Some(seen.delivered.map_or(o, |d| d.max(o)));
        }
        if self.epoch() != epoch {
            return;
        }
        for e in positions.map(|p| p.elements()).unwrap_or_default() {
            if let Offset::Offset(o) = e.offset() {
                let tp = TopicPartition::new(e.topic(), e.partition());
                parts.entry(tp).or_default().position = Some(o);
            }
        }
    }

    /// Forgets partitions assigned anew or revoked.
    fn forget(&self, tps: &[TopicPartition]) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        let mut parts = self.parts.lock();
        for tp in tps {
            parts.remove(tp);
        }
    }

    /// After a seek of `tp`: the position recorded before it no longer holds.
    fn sought(&self, tp: &TopicPartition) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        if let Some(seen) = self.parts.lock().get_mut(tp) {
            seen.position = None;
        }
    }

    /// The offset to commit for `tp` when every message up to offset `last` is finished: the
    /// recorded position where nothing delivered lies past `last`, else `last + 1`.
    pub(crate) fn next_offset(&self, tp: &TopicPartition, last: i64) -> i64 {
        match self.parts.lock().get(tp) {
            Some(Seen {
                delivered: Some(d),
                position: Some(p),
                ..
            }) if *d == last && *p > last + 1 => *p,
            _ => last + 1,
        }
    }

    /// Partitions of `assigned` whose recorded position is past what this member committed
    /// while nothing delivered is left uncommitted: only markers and aborted records lie
    /// between (or nothing was delivered since the assignment). Their next offsets.
    fn skipped(&self, assigned: &BTreeSet<TopicPartition>) -> Vec<(TopicPartition, i64)> {
        let parts = self.parts.lock();
        assigned
            .iter()
            .filter_map(|tp| {
                let seen = parts.get(tp)?;
                let p = seen.position?;
                let settled = match seen.delivered {
                    None => true,
                    // Committed past the last delivered record (at its next offset, or
                    // already past markers after it).
                    Some(d) => seen.committed.is_some_and(|c| c > d),
                };
                (settled && seen.committed.is_none_or(|c| p > c)).then(|| (tp.clone(), p))
            })
            .collect()
    }

    /// Records offsets known committed (next offsets), read from the group.
    pub(crate) fn committed(&self, offsets: impl IntoIterator<Item = (TopicPartition, i64)>) {
        let mut parts = self.parts.lock();
        for (tp, next) in offsets {
            let seen = parts.entry(tp).or_default();
            seen.committed = Some(seen.committed.map_or(next, |c| c.max(next)));
        }
    }

    /// Records offsets this member committed (next offsets), plainly or in a transaction.
    pub(crate) fn committed_here(&self, offsets: impl IntoIterator<Item = (TopicPartition, i64)>) {
        let mut parts = self.parts.lock();
        for (tp, next) in offsets {
            let seen = parts.entry(tp).or_default();
            seen.committed = Some(seen.committed.map_or(next, |c| c.max(next)));
            seen.own = Some(next);
        }
    }

    /// The next offset of this member's latest commit in `tp` since it was assigned, if any
    /// (not the highest it ever committed: a commit back to an earlier offset is the one that
    /// holds).
    fn known_committed(&self, tp: &TopicPartition) -> Option<i64> {
        self.parts.lock().get(tp)?.own
    }

    /// The offsets to commit for "last finished" positions.
    fn commit_offsets(
        &self,
        positions: &[(TopicPartition, Position)],
    ) -> Result<Vec<(TopicPartition, i64)>> {
        positions
            .iter()
            .map(|(tp, p)| Ok((tp.clone(), self.next_offset(tp, offset_of(p)?))))
            .collect()
    }
}

/// The Kafka consumer's group metadata as carried in [`GroupMetadata::native`]: librdkafka's
/// metadata for `send_offsets_to_transaction` and the consumer's [`Progress`], so that a
/// transaction commits the same offsets a plain commit would.
pub(crate) struct KafkaGroupMetadata {
    pub(crate) native: rdkafka::consumer::ConsumerGroupMetadata,
    pub(crate) progress: Arc<Progress>,
}

/// State shared between the consumer handle and librdkafka's callbacks.
pub(crate) struct Ctx {
    listener: RwLock<Option<Arc<dyn RebalanceListener>>>,
    start: StartFrom,
    /// Partitions this handle has been assigned before (explicit starts apply once).
    seen: Mutex<HashSet<TopicPartition>>,
    assignment: Mutex<BTreeSet<TopicPartition>>,
    /// Counts assignment changes seen by this member (librdkafka does not expose the group
    /// generation; the broker checks the real one in `send_offsets_to_transaction`).
    generation: AtomicI64,
    timeout: Duration,
    group: String,
    progress: Arc<Progress>,
}

impl ClientContext for Ctx {}

fn tps_of(tpl: &TopicPartitionList) -> Vec<TopicPartition> {
    tpl.elements()
        .iter()
        .map(|e| TopicPartition::new(e.topic(), e.partition()))
        .collect()
}

fn tpl_of(tps: &[TopicPartition]) -> TopicPartitionList {
    let mut tpl = TopicPartitionList::with_capacity(tps.len());
    for tp in tps {
        tpl.add_partition(&tp.topic, tp.partition);
    }
    tpl
}

/// The offset a timestamp resolves to: the first record at or after it, else the end.
fn offset_for_time(
    c: &BaseConsumer<Ctx>,
    tp: &TopicPartition,
    ts: i64,
    timeout: Duration,
) -> KafkaResult<Offset> {
    let mut q = TopicPartitionList::with_capacity(1);
    q.add_partition_offset(&tp.topic, tp.partition, Offset::Offset(ts))?;
    let r = c.offsets_for_times(q, timeout)?;
    Ok(
        match r
            .find_partition(&tp.topic, tp.partition)
            .map(|e| e.offset())
        {
            Some(Offset::Offset(o)) if o >= 0 => Offset::Offset(o),
            _ => Offset::End,
        },
    )
}

/// Resolves a start position; `None` = librdkafka's default (committed, else
/// `auto.offset.reset`).
fn resolve_start(
    c: &BaseConsumer<Ctx>,
    tp: &TopicPartition,
    start: &StartFrom,
    timeout: Duration,
) -> KafkaResult<Option<Offset>> {
    Ok(match start {
        StartFrom::Committed { fallback } => match **fallback {
            StartFrom::Earliest | StartFrom::Latest => None,
            ref f => {
                let committed = c.committed_offsets(tpl_of(std::slice::from_ref(tp)), timeout)?;
                match committed
                    .find_partition(&tp.topic, tp.partition)
                    .map(|e| e.offset())
                {
                    Some(Offset::Offset(_)) => None,
                    _ => resolve_start(c, tp, f, timeout)?,
                }
            }
        },
        StartFrom::Earliest => Some(Offset::Beginning),
        StartFrom::Latest => Some(Offset::End),
        StartFrom::Position(p) => {
            // Past the high watermark librdkafka would reset by `auto.offset.reset` (to 0 by
            // default); like a timestamp with no record at or after it, start at the end.
            let o = p.as_offset().unwrap_or(0);
            let (_, high) = c.fetch_watermarks(&tp.topic, tp.partition, timeout)?;
            Some(if o > high {
                Offset::End
            } else {
                Offset::Offset(o)
            })
        }
        StartFrom::Timestamp(ts) => Some(offset_for_time(c, tp, *ts, timeout)?),
    })
}

impl Ctx {
    fn listener(&self) -> Option<Arc<dyn RebalanceListener>> {
        self.listener.read().clone()
    }

    fn assign(&self, c: &BaseConsumer<Ctx>, tpl: &mut TopicPartitionList) {
        let tps = tps_of(tpl);
        let fresh: Vec<TopicPartition> = {
            let seen = self.seen.lock();
            tps.iter()
                .filter(|tp| !seen.contains(tp))
                .cloned()
                .collect()
        };
        for tp in &fresh {
            match resolve_start(c, tp, &self.start, self.timeout) {
                Ok(Some(o)) => {
                    if let Err(e) = tpl.set_partition_offset(&tp.topic, tp.partition, o) {
                        tracing::warn!(%tp, error = %e, "kafka: cannot set start offset");
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(%tp, error = %e, "kafka: cannot resolve start position, using the committed offset or auto.offset.reset");
                }
            }
        }
        let res = match c.rebalance_protocol() {
            RebalanceProtocol::Cooperative => c.incremental_assign(tpl),
            _ => c.assign(tpl),
        };
        if let Err(e) = res {
            tracing::error!(error = %e, "kafka: assign failed");
            return;
        }
        self.seen.lock().extend(fresh);
        self.progress.forget(&tps);
        self.assignment.lock().extend(tps.iter().cloned());
        self.generation.fetch_add(1, Ordering::AcqRel);
        if let Some(l) = self.listener() {
            l.on_assigned(&tps);
        }
    }

    fn revoke(&self, c: &BaseConsumer<Ctx>, tpl: &TopicPartitionList) {
        let tps = tps_of(tpl);
        if let Some(l) = self.listener() {
            if c.assignment_lost() {
                l.on_lost(&tps);
            } else {
                let positions = l.on_revoked(&tps);
                if !positions.is_empty() {
                    match self
                        .progress
                        .commit_offsets(&positions)
                        .and_then(|o| commit_tpl(&o))
                    {
                        Ok(ctpl) => {
                            if let Err(e) = c.commit(&ctpl, CommitMode::Sync) {
                                tracing::warn!(group = %self.group, error = %e, "kafka: commit on revocation failed");
                            }
                        }
                        Err(e) => {
                            tracing::warn!(group = %self.group, error = %e, "kafka: bad position on revocation");
                        }
                    }
                }
            }
        }
        let res = match c.rebalance_protocol() {
            RebalanceProtocol::Cooperative => c.incremental_unassign(tpl),
            _ => c.unassign(),
        };
        if let Err(e) = res {
            tracing::error!(error = %e, "kafka: unassign failed");
        }
        self.progress.forget(&tps);
        {
            let mut a = self.assignment.lock();
            if matches!(c.rebalance_protocol(), RebalanceProtocol::Cooperative) {
                for tp in &tps {
                    a.remove(tp);
                }
            } else {
                a.clear();
            }
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
    }
}

impl ConsumerContext for Ctx {
    fn rebalance(&self, c: &BaseConsumer<Self>, err: RDKafkaRespErr, tpl: &mut TopicPartitionList) {
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => self.assign(c, tpl),
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => self.revoke(c, tpl),
            other => {
                tracing::error!(group = %self.group, error = ?other, "kafka: rebalance error, dropping the assignment");
                let lost: Vec<TopicPartition> = std::mem::take(&mut *self.assignment.lock())
                    .into_iter()
                    .collect();
                if let Some(l) = self.listener() {
                    if !lost.is_empty() {
                        l.on_lost(&lost);
                    }
                }
                let _ = c.unassign();
                self.generation.fetch_add(1, Ordering::AcqRel);
            }
        }
    }
}

/// The list to commit for next offsets (see [`Progress::commit_offsets`]).
fn commit_tpl(offsets: &[(TopicPartition, i64)]) -> Result<TopicPartitionList> {
    let mut tpl = TopicPartitionList::with_capacity(offsets.len());
    for (tp, next) in offsets {
        tpl.add_partition_offset(&tp.topic, tp.partition, Offset::Offset(*next))
            .map_err(|e| errors::map(e, format_args!("offset {next} of {tp}")))?;
    }
    Ok(tpl)
}

fn offset_of(p: &Position) -> Result<i64> {
    p.as_offset().filter(|o| *o >= 0).ok_or_else(|| {
        Error::config(format!(
            "position '{p}' is not a Kafka offset: expected offset:N"
        ))
    })
}

fn check_start(start: &StartFrom) -> Result<()> {
    match start {
        StartFrom::Committed { fallback } => match **fallback {
            StartFrom::Committed { .. } => Err(Error::config(
                "start position Committed { fallback: Committed { .. } }: expected a fallback of \
                 Earliest, Latest, Position or Timestamp",
            )),
            ref f => check_start(f),
        },
        StartFrom::Position(p) => offset_of(p).map(|_| ()),
        _ => Ok(()),
    }
}

fn convert(m: &BorrowedMessage<'_>) -> Message {
    let headers: Headers = m
        .headers()
        .map(|hs| {
            hs.iter()
                .map(|h| Header {
                    name: h.key.to_string(),
                    value: h.value.map(Bytes::copy_from_slice),
                })
                .collect()
        })
        .unwrap_or_default();
    Message {
        topic: m.topic().to_string(),
        partition: m.partition(),
        position: Position::Offset(m.offset()),
        key: m.key().map(Bytes::copy_from_slice),
        payload: m.payload().map(Bytes::copy_from_slice).unwrap_or_default(),
        headers,
        timestamp: m.timestamp().to_millis(),
        delivery_count: 1,
    }
}

/// The consumer's default `fetch.queue.backoff.ms` (librdkafka's is 1000); see
/// [`KafkaConsumer`]'s construction. A consumer option of that name overrides it.
const FETCH_QUEUE_BACKOFF_MS: &str = "10";

/// A member of a Kafka consumer group.
pub struct KafkaConsumer {
    native: Option<Arc<BaseConsumer<Ctx>>>,
    offsets: Option<Arc<BaseConsumer>>,
    group: String,
    client_id: String,
    timeout: Duration,
    closed: AtomicBool,
}

impl std::fmt::Debug for KafkaConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaConsumer")
            .field("group", &self.group)
            .field("client_id", &self.client_id)
            .finish()
    }
}

impl KafkaConsumer {
    pub(crate) async fn new(kafka: KafkaConfig, config: ConsumerConfig) -> Result<Arc<Self>> {
        if config.group.is_empty() {
            return Err(Error::config(
                "consumer group is empty: expected a group id",
            ));
        }
        if config.topics.is_empty() || config.topics.iter().any(|t| t.is_empty()) {
            return Err(Error::config(format!(
                "consumer of group '{}' with topics {:?}: expected at least one non-empty topic",
                config.group, config.topics
            )));
        }
        check_start(&config.start)?;
        let opts = &config.options;
        let mut c = kafka.client_config(opts);
        let set_default = |c: &mut rdkafka::ClientConfig, k: &str, v: &str| {
            if !kafka.is_set(k, opts) {
                c.set(k, v);
            }
        };
        c.set("group.id", &config.group);
        set_default(&mut c, "enable.auto.commit", "false");
        set_default(&mut c, "enable.auto.offset.store", "false");
        set_default(
            &mut c,
            "partition.assignment.strategy",
            "cooperative-sticky",
        );
        set_default(
            &mut c,
            "isolation.level",
            match config.isolation {
                Isolation::ReadCommitted => "read_committed",
                Isolation::ReadUncommitted => "read_uncommitted",
            },
        );
        let reset = match &config.start {
            StartFrom::Committed { fallback } if **fallback == StartFrom::Latest => "latest",
            StartFrom::Latest => "latest",
            _ => "earliest",
        };
        set_default(&mut c, "auto.offset.reset", reset);
        // librdkafka prefetches until `queued.min.messages` (100 000) are queued, then postpones
        // the partition's next fetch by `fetch.queue.backoff.ms`, 1 s by default. A consumer
        // that drains the queue faster than that (100-byte messages at more than 100k/s) then
        // waits out the rest of the second with an empty queue: reading 1M pre-filled 100 B
        // messages took ~7 s, ~5 s of it in six such stalls (benches/RESULTS.md, PY2). 10 ms
        // keeps the queue filled; a fetcher whose queue stays full (a slow handler) re-checks
        // it 100 times a second instead of once, a wake-up of its thread each.
        set_default(&mut c, "fetch.queue.backoff.ms", FETCH_QUEUE_BACKOFF_MS);
        let client_id = config
            .client_id
            .clone()
            .unwrap_or_else(|| format!("onceflow-{}", config.group));
        set_default(&mut c, "client.id", &client_id);
        if let Some(st) = config.session_timeout {
            // A member that does not poll for this long leaves the group too (librdkafka keeps
            // heartbeating from its own thread, so without this only max.poll.interval.ms, 5
            // minutes by default, would notice).
            let ms = st.as_millis().to_string();
            set_default(&mut c, "session.timeout.ms", &ms);
            set_default(&mut c, "max.poll.interval.ms", &ms);
        }
        // Reads committed offsets without waiting for pending transactional ones (KIP-447
        // `require_stable` applies only to read_committed consumers): `committed()` and `lag()`
        // report what is committed now. It never joins the group.
        let mut oc = kafka.client_config(opts);
        oc.set("group.id", &config.group);
        oc.set("enable.auto.commit", "false");
        oc.set("isolation.level", "read_uncommitted");
        oc.set("client.id", format!("{client_id}-offsets"));
        let offsets: BaseConsumer = oc.create().map_err(|e| {
            errors::map(
                e,
                format_args!("creating offset reader of group '{}'", config.group),
            )
        })?;
        let ctx = Ctx {
            listener: RwLock::new(None),
            start: config.start.clone(),
            seen: Mutex::new(HashSet::new()),
            assignment: Mutex::new(BTreeSet::new()),
            generation: AtomicI64::new(0),
            timeout: kafka.timeout,
            group: config.group.clone(),
            progress: Arc::new(Progress::default()),
        };
        let native: BaseConsumer<Ctx> = c.create_with_context(ctx).map_err(|e| {
            errors::map(
                e,
                format_args!("creating consumer of group '{}'", config.group),
            )
        })?;
        let topics: Vec<&str> = config.topics.iter().map(|s| s.as_str()).collect();
        native.subscribe(&topics).map_err(|e| {
            errors::map(
                e,
                format_args!(
                    "subscribing group '{}' to {:?}",
                    config.group, config.topics
                ),
            )
        })?;
        Ok(Arc::new(KafkaConsumer {
            native: Some(Arc::new(native)),
            offsets: Some(Arc::new(offsets)),
            group: config.group,
            client_id,
            timeout: kafka.timeout,
            closed: AtomicBool::new(false),
        }))
    }

    fn native(&self) -> Result<Arc<BaseConsumer<Ctx>>> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::new(
                ErrorKind::Closed,
                format!(
                    "consumer '{}' of group '{}' is closed",
                    self.client_id, self.group
                ),
            ));
        }
        Ok(self.native.clone().expect("set until drop"))
    }

    fn ctx(&self) -> &Ctx {
        self.native.as_ref().expect("set until drop").context()
    }

    fn check_assigned(&self, tps: &[TopicPartition]) -> Result<()> {
        let a = self.ctx().assignment.lock();
        match tps.iter().find(|tp| !a.contains(tp)) {
            Some(tp) => Err(Error::config(format!(
                "partition {tp} is not assigned to this member of group '{}': expected one of \
                 assignment()",
                self.group
            ))),
            None => Ok(()),
        }
    }

    async fn blocking<T: Send + 'static>(
        &self,
        what: &'static str,
        f: impl FnOnce(&BaseConsumer<Ctx>) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let n = self.native()?;
        tokio::task::spawn_blocking(move || f(&n))
            .await
            .map_err(|e| errors::join(e, what))?
    }

    async fn seek_to(&self, tp: &TopicPartition, to: StartFrom) -> Result<()> {
        let timeout = self.timeout;
        let tp = tp.clone();
        self.blocking("seek", move |c| {
            let offset = match &to {
                StartFrom::Position(p) => {
                    let o = offset_of(p)?;
                    let (low, high) = c
                        .fetch_watermarks(&tp.topic, tp.partition, timeout)
                        .map_err(|e| errors::map(e, format_args!("watermarks of {tp}")))?;
                    if o > high || o < low {
                        return Err(Error::config(format!(
                            "cannot seek {tp} to '{p}': expected an offset from {low} to {high}"
                        )));
                    }
                    Offset::Offset(o)
                }
                StartFrom::Committed { .. } => {
                    match resolve_start(c, &tp, &to, timeout)
                        .map_err(|e| errors::map(e, format_args!("start of {tp}")))?
                    {
                        Some(o) => o,
                        None => {
                            let committed = c
                                .committed_offsets(tpl_of(std::slice::from_ref(&tp)), timeout)
                                .map_err(|e| errors::map(e, format_args!("committed of {tp}")))?;
                            match committed
                                .find_partition(&tp.topic, tp.partition)
                                .map(|e| e.offset())
                            {
                                Some(Offset::Offset(o)) => Offset::Offset(o),
                                _ => match &to {
                                    StartFrom::Committed { fallback }
                                        if **fallback == StartFrom::Latest =>
                                    {
                                        Offset::End
                                    }
                                    _ => Offset::Beginning,
                                },
                            }
                        }
                    }
                }
                other => resolve_start(c, &tp, other, timeout)
                    .map_err(|e| errors::map(e, format_args!("start of {tp}")))?
                    .unwrap_or(Offset::Stored),
            };
            let r = seek_retrying(c, &tp, offset, timeout);
            c.context().progress.sought(&tp);
            r
        })
        .await
    }

    fn progress(&self) -> &Arc<Progress> {
        &self.ctx().progress
    }

    /// Commits next offsets, fenced unless every partition is assigned to this member.
    async fn commit_next(&self, offsets: Vec<(TopicPartition, i64)>) -> Result<()> {
        let tpl = commit_tpl(&offsets)?;
        {
            let a = self.ctx().assignment.lock();
            if let Some((tp, _)) = offsets.iter().find(|(tp, _)| !a.contains(tp)) {
                return Err(Error::new(
                    ErrorKind::Fenced,
                    format!(
                        "commit of {tp} by '{}' of group '{}' is fenced: the partition is not \
                         assigned to this member",
                        self.client_id, self.group
                    ),
                ));
            }
        }
        let group = self.group.clone();
        self.blocking("commit", move |c| {
            c.commit(&tpl, CommitMode::Sync)
                .map_err(|e| errors::map(e, format_args!("commit of group '{group}'")))
        })
        .await?;
        self.progress().committed_here(offsets);
        Ok(())
    }
}

/// `rd_kafka_seek` fails with `_STATE` until the partition's fetcher has started right after an
/// assignment; retry briefly.
fn seek_retrying(
    c: &BaseConsumer<Ctx>,
    tp: &TopicPartition,
    offset: Offset,
    timeout: Duration,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        match c.seek(&tp.topic, tp.partition, offset, timeout) {
            Ok(()) => return Ok(()),
            Err(e) if Instant::now() < deadline && is_state_error(&e) => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                return Err(errors::map(e, format_args!("seek of {tp} to {offset:?}")));
            }
        }
    }
}

fn is_state_error(e: &KafkaError) -> bool {
    matches!(e, KafkaError::Seek(s) if s.contains("state"))
}

#[async_trait]
impl ConsumerBackend for KafkaConsumer {
    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn set_rebalance_listener(&self, listener: Arc<dyn RebalanceListener>) {
        *self.ctx().listener.write() = Some(listener);
    }

    async fn poll(&self, max: usize, timeout: Duration) -> Result<Vec<Message>> {
        let max = max.max(1);
        let group = self.group.clone();
        self.blocking("poll", move |c| {
            let progress = c.context().progress.clone();
            let epoch = progress.epoch();
            let deadline = Instant::now() + timeout;
            let mut out = Vec::with_capacity(max.min(1024));
            while out.len() < max {
                let wait = if out.is_empty() {
                    deadline.saturating_duration_since(Instant::now())
                } else {
                    Duration::ZERO
                };
                match c.poll(wait) {
                    Some(Ok(m)) => out.push(convert(&m)),
                    Some(Err(KafkaError::PartitionEOF(_))) => {}
                    Some(Err(e @ KafkaError::MessageConsumptionFatal(_))) => {
                        return Err(errors::map(e, format_args!("poll of group '{group}'")));
                    }
                    Some(Err(e)) => {
                        tracing::debug!(group = %group, error = %e, "kafka: poll error");
                    }
                    None => {
                        if !out.is_empty() || Instant::now() >= deadline {
                            break;
                        }
                    }
                }
            }
            // After the deliveries: where librdkafka stands past them (see [`Progress`]).
            let positions = c.position().ok();
            progress.observe(epoch, &out, positions.as_ref());
            Ok(out)
        })
        .await
    }

    async fn commit(&self, positions: &[(TopicPartition, Position)]) -> Result<()> {
        if positions.is_empty() {
            return Ok(());
        }
        let offsets = self.progress().commit_offsets(positions)?;
        self.commit_next(offsets).await
    }

    /// Commits the position of partitions where librdkafka served only transaction markers or
    /// aborted records since this member's last commit (KAFKA-6607).
    async fn commit_skipped(&self) -> Result<()> {
        let offsets = {
            let a = self.ctx().assignment.lock();
            self.progress().skipped(&a)
        };
        if offsets.is_empty() {
            return Ok(());
        }
        tracing::debug!(group = %self.group, ?offsets, "kafka: committing past markers and aborted records");
        self.commit_next(offsets).await
    }

    async fn committed(
        &self,
        partitions: &[TopicPartition],
    ) -> Result<Vec<(TopicPartition, Option<Position>)>> {
        let tps = partitions.to_vec();
        let timeout = self.timeout;
        let group = self.group.clone();
        let oc = self.offsets.clone().expect("set until drop");
        let progress = self.progress().clone();
        let committed: Vec<(TopicPartition, Option<Position>)> = self
            .blocking("committed", move |_| {
                let r = oc.committed_offsets(tpl_of(&tps), timeout).map_err(|e| {
                    errors::map(e, format_args!("committed offsets of group '{group}'"))
                })?;
                Ok(tps
                    .into_iter()
                    .map(|tp| {
                        let fetched = match r
                            .find_partition(&tp.topic, tp.partition)
                            .map(|e| e.offset())
                        {
                            Some(Offset::Offset(o)) if o >= 0 => Some(o),
                            _ => None,
                        };
                        // A transaction this member committed is committed, although the
                        // group coordinator may serve the offsets before it until the
                        // transaction's markers are written (this reader does not wait for
                        // them, see `offsets`): a rewind right after such a commit sought back
                        // before it and processed its inputs again.
                        let known = progress.known_committed(&tp);
                        let p = fetched.max(known).map(Position::Offset);
                        (tp, p)
                    })
                    .collect())
            })
            .await?;
        // What the group has committed counts as committed by this member too: a transaction
        // reported as failed may have committed after all (a delayed EndTxn), and only this
        // read tells; without it `commit_skipped` would wait for a commit past the last
        // delivered record that never comes.
        self.progress()
            .committed(committed.iter().filter_map(|(tp, p)| {
                let o = p.as_ref()?.as_offset()?;
                Some((tp.clone(), o))
            }));
        Ok(committed)
    }

    async fn seek(&self, partition: &TopicPartition, to: &StartFrom) -> Result<()> {
        check_start(to)?;
        self.check_assigned(std::slice::from_ref(partition))?;
        self.seek_to(partition, to.clone()).await
    }

    async fn pause(&self, partitions: &[TopicPartition]) -> Result<()> {
        self.check_assigned(partitions)?;
        let tpl = tpl_of(partitions);
        self.native()?
            .pause(&tpl)
            .map_err(|e| errors::map(e, format_args!("pause of {partitions:?}")))
    }

    async fn resume(&self, partitions: &[TopicPartition]) -> Result<()> {
        self.check_assigned(partitions)?;
        let tpl = tpl_of(partitions);
        self.native()?
            .resume(&tpl)
            .map_err(|e| errors::map(e, format_args!("resume of {partitions:?}")))
    }

    fn assignment(&self) -> Vec<TopicPartition> {
        self.ctx().assignment.lock().iter().cloned().collect()
    }

    async fn lag(&self) -> Result<Vec<PartitionLag>> {
        let tps = self.assignment();
        let timeout = self.timeout;
        let oc = self.offsets.clone().expect("set until drop");
        self.blocking("lag", move |c| {
            let committed = oc
                .committed_offsets(tpl_of(&tps), timeout)
                .map_err(|e| errors::map(e, "committed offsets for lag"))?;
            let mut out = Vec::with_capacity(tps.len());
            for tp in tps {
                let (low, high) = c
                    .fetch_watermarks(&tp.topic, tp.partition, timeout)
                    .map_err(|e| errors::map(e, format_args!("watermarks of {tp}")))?;
                let com = match committed
                    .find_partition(&tp.topic, tp.partition)
                    .map(|e| e.offset())
                {
                    Some(Offset::Offset(o)) if o >= 0 => Some(o),
                    _ => None,
                };
                out.push(PartitionLag {
                    partition: tp,
                    committed: com.map(Position::Offset),
                    high_watermark: Some(Position::Offset(high)),
                    messages: (high - com.unwrap_or(low)).max(0) as u64,
                    millis: None,
                });
            }
            Ok(out)
        })
        .await
    }

    fn group_metadata(&self) -> Option<GroupMetadata> {
        let n = self.native.as_ref()?;
        let md = n.group_metadata()?;
        Some(GroupMetadata {
            group: self.group.clone(),
            generation: n.context().generation.load(Ordering::Acquire),
            member_id: self.client_id.clone(),
            native: Some(Arc::new(KafkaGroupMetadata {
                native: md,
                progress: n.context().progress.clone(),
            })),
        })
    }

    async fn nack(&self, message: &Message, delay: Duration) -> Result<()> {
        let offset = offset_of(&message.position)?;
        let tp = message.topic_partition();
        if self.check_assigned(std::slice::from_ref(&tp)).is_err() {
            // Not ours any more: its new owner reads from the committed position.
            return Ok(());
        }
        let native = self.native()?;
        if !delay.is_zero() {
            native
                .pause(&tpl_of(std::slice::from_ref(&tp)))
                .map_err(|e| errors::map(e, format_args!("pause of {tp}")))?;
        }
        self.seek_to(&tp, StartFrom::Position(Position::Offset(offset)))
            .await?;
        if !delay.is_zero() {
            let weak = Arc::downgrade(&native);
            drop(native);
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                if let Some(n) = weak.upgrade() {
                    if n.context().assignment.lock().contains(&tp) {
                        let _ = n.resume(&tpl_of(std::slice::from_ref(&tp)));
                    }
                }
            });
        }
        Ok(())
    }

    async fn close(&self) -> Result<()> {
        let Ok(n) = self.native() else {
            return Ok(());
        };
        self.closed.store(true, Ordering::Release);
        tokio::task::spawn_blocking(move || {
            n.unsubscribe();
            // Serve the revocation so the group hands the partitions on now.
            let deadline = Instant::now() + Duration::from_secs(10);
            while !n.context().assignment.lock().is_empty() && Instant::now() < deadline {
                let _ = n.poll(Duration::from_millis(50));
            }
        })
        .await
        .map_err(|e| errors::join(e, "close"))?;
        Ok(())
    }
}

/// How long dropping a consumer waits for librdkafka's close (leave the group, serve the last
/// revocation) before it stops waiting; see [`close_bounded`].
const CLOSE_WAIT: Duration = Duration::from_secs(30);

impl Drop for KafkaConsumer {
    fn drop(&mut self) {
        // librdkafka's consumer close blocks until the group is left: not on the executor.
        let n = self.native.take();
        let o = self.offsets.take();
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                h.spawn_blocking(move || close_bounded(n, o, CLOSE_WAIT));
            }
            Err(_) => close_bounded(n, o, CLOSE_WAIT),
        }
    }
}

/// Drops the consumer's librdkafka handles on a thread of their own and waits for that at most
/// `limit`.
///
/// rdkafka's `BaseConsumer` drop closes the consumer and polls until librdkafka reports it
/// closed, without a deadline. Once (a member removed from its group by its session timeout,
/// then dropped) that loop never ended, and since the drop ran on the runtime's blocking pool,
/// the runtime's shutdown waited for it for ever. A close that ends in time is waited for as
/// before, so a process that exits still leaves its group at once; one that does not is left to
/// finish on its own thread, with a warning, and the broker removes the member after
/// `session.timeout.ms`.
fn close_bounded(
    native: Option<Arc<BaseConsumer<Ctx>>>,
    offsets: Option<Arc<BaseConsumer>>,
    limit: Duration,
) {
    if native.is_none() && offsets.is_none() {
        return;
    }
    let group = native.as_ref().map(|n| n.context().group.clone());
    let (done, closed) = std::sync::mpsc::sync_channel::<()>(1);
    let closer = std::thread::Builder::new()
        .name("onceflow-kafka-close".into())
        .spawn(move || {
            drop((native, offsets));
            let _ = done.send(());
        });
    if let Err(e) = closer {
        tracing::warn!(error = %e, "kafka: cannot start a thread to close the consumer; it is left open");
        return;
    }
    if closed.recv_timeout(limit).is_err() {
        tracing::warn!(
            group = group.as_deref().unwrap_or(""),
            waited_s = limit.as_secs(),
            "kafka: the consumer did not finish leaving its group in time; not waiting for it \
             longer (the broker removes the member after session.timeout.ms)"
        );
    }
}
