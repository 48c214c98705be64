//! The consumer: one member of a group whose shards are spread through a lease table.

use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_kinesis::primitives::DateTime;
use aws_sdk_kinesis::types::ShardIteratorType;
use bytes::Bytes;
use onceflow_core::checkpoint::{
    CheckpointRequest, HeldLease, Lease, NewLease, SharedCheckpointStore, TakeOutcome, TakeRequest,
};
use onceflow_core::{
    Capabilities, ConsumerBackend, ConsumerConfig, Error, ErrorKind, GroupMetadata, Headers,
    Message, PartitionLag, Position, RebalanceListener, Result, StartFrom, TopicPartition,
};
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::efo::{self, EfoMode};
use crate::envelope;
use crate::shards::{aws_err, list_shards, partition_of_shard, shard_of_partition};
use crate::{Shared, CAPABILITIES};

/// Header set on a message whose envelope is damaged: the error text. The message's payload is
/// then the record's raw data and it has no other headers.
pub const ENVELOPE_ERROR_HEADER: &str = "onceflow-envelope-error";

/// The lease table group of a consumer group on a stream: `<group>/<stream>`.
pub(crate) fn table_group(group: &str, stream: &str) -> String {
    format!("{group}/{stream}")
}

/// Where a shard iterator (or a subscription) starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Spec {
    TrimHorizon,
    Latest,
    At(String),
    After(String),
    /// `AT_TIMESTAMP` (arrival time), then records with a message timestamp before it skipped
    /// until the first one at or after it.
    Time(i64),
}

fn spec_of(start: &StartFrom) -> Result<Spec> {
    Ok(match start {
        StartFrom::Earliest => Spec::TrimHorizon,
        StartFrom::Latest => Spec::Latest,
        StartFrom::Position(Position::SequenceNumber(s)) => Spec::At(s.clone()),
        StartFrom::Position(p) => {
            return Err(Error::config(format!(
                "position {p} is not a Kinesis sequence number (expected kinesis:DIGITS)"
            )))
        }
        StartFrom::Timestamp(ts) => Spec::Time(*ts),
        StartFrom::Committed { fallback } => spec_of(fallback)?,
    })
}

/// One shard this member holds.
struct Owned {
    stream: String,
    shard: String,
    table: String,
    counter: u64,
    buf: VecDeque<Message>,
    paused: bool,
    /// Bumped by seek / nack: records of an older fetch are dropped.
    epoch: u64,
    fetcher: Option<JoinHandle<()>>,
    /// Sequence number of the last message handed out by `poll`.
    delivered: Option<String>,
    /// Sequence numbers handed out by `poll` and not committed yet, in order.
    pending: VecDeque<String>,
    /// Sequence number of the last record fetched.
    fetched: Option<String>,
    /// The checkpoint in the table (as this member wrote or read it).
    checkpoint: Option<String>,
    /// The fetcher read the shard to its end (closed shard).
    ended: bool,
    /// ListShards reported the shard closed (it has an ending sequence number).
    closed: bool,
    millis_behind: Option<u64>,
}

#[derive(Default)]
struct State {
    owned: BTreeMap<TopicPartition, Owned>,
    /// Partitions whose lease the renewer found lost; reported by the next poll.
    lost: Vec<TopicPartition>,
    /// Partitions this member has held before (explicit starts apply only the first time).
    seen: HashSet<TopicPartition>,
    rr: usize,
    /// A fetcher's failure that retrying cannot fix (enhanced fan-out unsupported by the
    /// server), reported by the next `poll`.
    failed: Option<(ErrorKind, String)>,
}

/// A member of a Kinesis consumer group: a consumer library in the manner of AWS's KCL, on a
/// lease table kept in a [`CheckpointStore`](onceflow_core::checkpoint::CheckpointStore)
/// (`checkpoint_store=` in the URL; the group is the application name).
///
/// - **Lease duration**: the consumer's `session_timeout` if set, else the URL's `lease_ms`.
/// - **Leases**: the table group is `<group>/<stream>`, one row per shard (lease key = shard
///   id, parents = the shard's parent shard ids), created when a member first lists the shard.
///   Members register in `<group>/<stream>#workers` (a lease per member, renewed with its shard
///   leases). At every coordination (each `lease / 3`, from `poll`), a member takes unowned and
///   expired leases of readable shards up to its fair share (readable shards / live members,
///   rounded up) and gives back what it holds above it (graceful handoff: the listener's
///   `on_revoked` runs, its positions are checkpointed, the lease is released, and another
///   member takes it at once). A background task renews held leases every `lease / 3`; a
///   renewal refused (the lease was taken over) or the member closing stops that shard's
///   fetching, drops what was fetched, and reports the partition through `on_lost`; the
///   member's later commits for it are refused (`Fenced`) by the lease counter.
/// - **Checkpoints**: `commit` writes the sequence number of the last finished message, fenced
///   by owner and lease counter. When a closed shard has been read to its end and everything
///   handed out is committed, the checkpoint becomes `SHARD_END` and the lease is released.
/// - **Resharding**: a shard with parents is readable only once every parent still in the table
///   is at `SHARD_END`, so per partition key the parent's records are handled before the
///   child's. A child without a checkpoint starts at its trim horizon.
/// - **Start**: a shard with a checkpoint resumes after it (`StartFrom::Committed`); otherwise
///   the start applies: `Earliest` = `TRIM_HORIZON`, `Latest` = `LATEST`, `Position` =
///   `AT_SEQUENCE_NUMBER`, `Timestamp` = `AT_TIMESTAMP` (arrival time) and then the first record
///   whose message timestamp (envelope, else arrival) is at or after it. An explicit start (not
///   `Committed`) applies the first time this member takes the shard.
/// - **Iterators**: an `ExpiredIteratorException` gets a new iterator after the last record
///   fetched (not the last checkpoint). A throttled GetRecords backs off.
/// - **Enhanced fan-out** (`fan_out=efo` or `auto` in the URL, [`FanOut`](crate::FanOut)):
///   when joining, the member registers (or reuses) the stream consumer `efo_consumer=`
///   (default: the group) of each stream and waits until it is `ACTIVE`; each held shard is then
///   read through SubscribeToShard instead of GetRecords, starting where polling would (the
///   checkpoint, `AFTER_SEQUENCE_NUMBER`, or the start above) and subscribing again after the
///   last `ContinuationSequenceNumber` when a subscription ends (5 minutes) or drops. Only the
///   fetching differs: records go through the same buffer, envelope decoding, checkpoints,
///   leases, fencing and parent-before-child order (shard end from `ChildShards`, or confirmed
///   by GetRecords on a closed shard for servers that never send them). A server without
///   enhanced fan-out (e.g. kinesalite: `UnknownOperationException`) makes `efo` fail with
///   `Unsupported` naming the server's answer (at join, or from the next `poll`), and `auto`
///   poll instead, logged once. The registered consumer is kept on close (other members and
///   restarts reuse it; DeregisterStreamConsumer through [`KinesisPlatform::client`](crate::KinesisPlatform::client)).
/// - **Lag**: `millis` is the last `MillisBehindLatest` of the shard (GetRecords or
///   SubscribeToShard event); `messages` is counted by reading the shard after the checkpoint
///   (GetRecords, at most 20 calls of 10 000).
/// - **nack** rewinds the shard to the message; **seek** moves it; **pause** stops handing out
///   (fetching stops once the buffer is full).
pub struct KinesisConsumer {
    shared: Arc<Shared>,
    store: SharedCheckpointStore,
    group: String,
    topics: Vec<String>,
    start: StartFrom,
    owner: String,
    lease: Duration,
    state: Arc<Mutex<State>>,
    data: Arc<Notify>,
    listener: Mutex<Option<Arc<dyn RebalanceListener>>>,
    next_coordination: Mutex<Instant>,
    /// Held while renewing, checkpointing, taking or releasing, so a commit never uses a
    /// counter a concurrent renewal just moved.
    lease_ops: Arc<tokio::sync::Mutex<Counters>>,
    known_shards: Mutex<BTreeMap<String, BTreeSet<String>>>,
    closed: Arc<AtomicBool>,
    renewer: Mutex<Option<JoinHandle<()>>>,
    /// Enhanced fan-out: the mode, and the registered stream consumer's ARN per stream (empty
    /// when polling).
    efo: Arc<EfoMode>,
    efo_arns: BTreeMap<String, String>,
}

/// The member's own registration lease counter, per stream.
#[derive(Default)]
struct Counters {
    worker: BTreeMap<String, u64>,
}

/// The default name of a group's registered stream consumer: the group, with characters AWS
/// does not allow in a consumer name (`[a-zA-Z0-9_.-]`, 1 to 128) replaced by `_`.
fn efo_name(group: &str) -> String {
    group
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_.-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .take(128)
        .collect()
}

fn workers_group(table: &str) -> String {
    format!("{table}#workers")
}

impl KinesisConsumer {
    pub(crate) async fn join(
        shared: Arc<Shared>,
        config: ConsumerConfig,
    ) -> Result<Arc<KinesisConsumer>> {
        if config.group.is_empty() {
            return Err(Error::config(
                "Kinesis consumer: the group (application name) is empty",
            ));
        }
        if config.topics.is_empty() {
            return Err(Error::config("Kinesis consumer: no stream to consume"));
        }
        spec_of(&config.start)?;
        for t in &config.topics {
            shared.ensure_stream(t).await?;
        }
        let efo = Arc::new(EfoMode::new(shared.options.fan_out));
        let mut efo_arns = BTreeMap::new();
        if efo.active() {
            let name = shared
                .options
                .efo_consumer
                .clone()
                .unwrap_or_else(|| efo_name(&config.group));
            for t in &config.topics {
                match efo::stream_consumer(&shared, &efo, t, &name).await? {
                    Some(arn) => {
                        efo_arns.insert(t.clone(), arn);
                    }
                    None => {
                        efo_arns.clear();
                        break;
                    }
                }
            }
        }
        let store = shared.checkpoint_store().await?;
        let owner = config
            .client_id
            .clone()
            .unwrap_or_else(|| format!("{}-{:08x}", std::process::id(), rand::random::<u32>()));
        let c = Arc::new(KinesisConsumer {
            shared: shared.clone(),
            store,
            group: config.group,
            topics: config.topics,
            start: config.start,
            owner,
            lease: config
                .session_timeout
                .filter(|t| *t >= Duration::from_millis(100))
                .unwrap_or(shared.options.lease),
            state: Arc::default(),
            data: Arc::new(Notify::new()),
            listener: Mutex::new(None),
            next_coordination: Mutex::new(Instant::now()),
            lease_ops: Arc::default(),
            known_shards: Mutex::default(),
            closed: Arc::new(AtomicBool::new(false)),
            renewer: Mutex::new(None),
            efo,
            efo_arns,
        });
        let weak = Arc::downgrade(&c);
        let period = c.lease / 3;
        *c.renewer.lock() = Some(tokio::spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                let Some(c) = weak.upgrade() else { return };
                if c.closed.load(Ordering::Acquire) {
                    return;
                }
                if let Err(e) = c.renew().await {
                    tracing::warn!(group = %c.group, "lease renewal failed: {e}");
                }
            }
        }));
        Ok(c)
    }

    fn lease(&self) -> Duration {
        self.lease
    }

    /// Renews every held lease and this member's registration; drops what was lost.
    async fn renew(&self) -> Result<()> {
        let mut counters = self.lease_ops.lock().await;
        let held: Vec<(TopicPartition, String, HeldLease)> = {
            let st = self.state.lock();
            st.owned
                .iter()
                .map(|(tp, o)| {
                    (
                        tp.clone(),
                        o.table.clone(),
                        HeldLease {
                            key: o.shard.clone(),
                            owner: self.owner.clone(),
                            counter: o.counter,
                        },
                    )
                })
                .collect()
        };
        let mut by_table: BTreeMap<String, Vec<(TopicPartition, HeldLease)>> = BTreeMap::new();
        for (tp, table, h) in held {
            by_table.entry(table).or_default().push((tp, h));
        }
        for (table, items) in by_table {
            let leases: Vec<HeldLease> = items.iter().map(|(_, h)| h.clone()).collect();
            let out = self.store.renew(&table, &leases, self.lease()).await?;
            let mut st = self.state.lock();
            for ((tp, _), r) in items.into_iter().zip(out) {
                match r {
                    Some(c) => {
                        if let Some(o) = st.owned.get_mut(&tp) {
                            o.counter = c;
                        }
                    }
                    None => {
                        if let Some(mut o) = st.owned.remove(&tp) {
                            if let Some(f) = o.fetcher.take() {
                                f.abort();
                            }
                            tracing::warn!(partition = %tp, "lease lost: stopped reading the shard");
                            st.lost.push(tp);
                        }
                    }
                }
            }
        }
        for t in &self.topics {
            self.register(&mut counters, &table_group(&self.group, t))
                .await?;
        }
        Ok(())
    }

    /// Keeps this member's registration lease in `<table>#workers` alive.
    async fn register(&self, counters: &mut Counters, table: &str) -> Result<()> {
        let wg = workers_group(table);
        if let Some(c) = counters.worker.get(table).copied() {
            let h = HeldLease {
                key: self.owner.clone(),
                owner: self.owner.clone(),
                counter: c,
            };
            if let Some(n) = self
                .store
                .renew(&wg, std::slice::from_ref(&h), self.lease())
                .await?
                .remove(0)
            {
                counters.worker.insert(table.to_string(), n);
                return Ok(());
            }
        }
        self.store
            .create(
                &wg,
                &[NewLease {
                    key: self.owner.clone(),
                    checkpoint: None,
                    parents: Vec::new(),
                }],
            )
            .await?;
        let row = self
            .store
            .get(&wg, std::slice::from_ref(&self.owner))
            .await?
            .remove(0);
        if let Some(row) = row {
            if let TakeOutcome::Taken { counter } = self
                .store
                .take(
                    &wg,
                    &[TakeRequest {
                        key: self.owner.clone(),
                        owner: self.owner.clone(),
                        expected_counter: row.counter,
                        lease: self.lease(),
                    }],
                )
                .await?
                .remove(0)
            {
                counters.worker.insert(table.to_string(), counter);
            }
        }
        Ok(())
    }

    fn listener(&self) -> Option<Arc<dyn RebalanceListener>> {
        self.listener.lock().clone()
    }

    /// Lists shards (creating rows for new ones), then takes and gives back leases.
    async fn coordinate(&self) -> Result<()> {
        let lost = std::mem::take(&mut self.state.lock().lost);
        if !lost.is_empty() {
            if let Some(l) = self.listener() {
                l.on_lost(&lost);
            }
        }
        self.finish_ended_shards().await?;
        let mut counters = self.lease_ops.lock().await;
        for stream in self.topics.clone() {
            let table = table_group(&self.group, &stream);
            if !counters.worker.contains_key(&table) {
                self.register(&mut counters, &table).await?;
            }
            let shards = list_shards(&self.shared.client, &stream).await?;
            let ids: BTreeSet<String> = shards.iter().map(|s| s.id.clone()).collect();
            {
                let mut st = self.state.lock();
                for s in shards.iter().filter(|s| s.closed) {
                    if let Some(o) = st
                        .owned
                        .get_mut(&TopicPartition::new(stream.clone(), s.partition))
                    {
                        o.closed = true;
                    }
                }
            }
            let changed = self.known_shards.lock().get(&stream) != Some(&ids);
            if changed {
                let news: Vec<NewLease> = shards
                    .iter()
                    .map(|s| NewLease {
                        key: s.id.clone(),
                        checkpoint: None,
                        parents: s.parents.clone(),
                    })
                    .collect();
                self.store.create(&table, &news).await?;
                self.known_shards.lock().insert(stream.clone(), ids.clone());
            }
            let leases: Vec<Lease> = self
                .store
                .list(&table)
                .await?
                .into_iter()
                .filter(|l| ids.contains(&l.key))
                .collect();
            let finished: HashSet<&str> = leases
                .iter()
                .filter(|l| is_shard_end(l))
                .map(|l| l.key.as_str())
                .collect();
            let present: HashSet<&str> = leases.iter().map(|l| l.key.as_str()).collect();
            let readable: Vec<&Lease> = leases
                .iter()
                .filter(|l| {
                    !is_shard_end(l)
                        && l.parents
                            .iter()
                            .all(|p| finished.contains(p.as_str()) || !present.contains(p.as_str()))
                })
                .collect();
            let workers = self
                .store
                .list(&workers_group(&table))
                .await?
                .iter()
                .filter(|w| !w.is_available() || w.key == self.owner)
                .count()
                .max(1);
            let target = readable.len().div_ceil(workers);
            let mine: Vec<TopicPartition> = {
                let st = self.state.lock();
                st.owned
                    .iter()
                    .filter(|(_, o)| o.stream == stream)
                    .map(|(tp, _)| tp.clone())
                    .collect()
            };
            if mine.len() > target {
                let give: Vec<TopicPartition> = mine[target..].to_vec();
                drop(counters);
                self.hand_off(&give).await?;
                counters = self.lease_ops.lock().await;
                continue;
            }
            let want = target - mine.len();
            if want == 0 {
                continue;
            }
            let mut candidates: Vec<&Lease> = readable
                .iter()
                .copied()
                .filter(|l| l.is_available() || l.owner.as_deref() == Some(&self.owner))
                .filter(|l| {
                    !mine
                        .iter()
                        .any(|tp| Some(tp.partition) == partition_of_shard(&l.key))
                })
                .collect();
            // Parents first (lower numbers), so order across a split is kept under load.
            candidates.sort_by_key(|l| partition_of_shard(&l.key));
            candidates.truncate(want);
            if candidates.is_empty() {
                continue;
            }
            let reqs: Vec<TakeRequest> = candidates
                .iter()
                .map(|l| TakeRequest {
                    key: l.key.clone(),
                    owner: self.owner.clone(),
                    expected_counter: l.counter,
                    lease: self.lease(),
                })
                .collect();
            let out = self.store.take(&table, &reqs).await?;
            let mut assigned = Vec::new();
            for (l, o) in candidates.iter().zip(out) {
                if let TakeOutcome::Taken { counter } = o {
                    let tp = TopicPartition::new(
                        stream.clone(),
                        partition_of_shard(&l.key).unwrap_or(-1),
                    );
                    self.start_shard(&stream, &table, l, counter, tp.clone());
                    assigned.push(tp);
                }
            }
            if !assigned.is_empty() {
                tracing::debug!(group = %self.group, owner = %self.owner, ?assigned, "took leases");
                if let Some(l) = self.listener() {
                    l.on_assigned(&assigned);
                }
            }
        }
        Ok(())
    }

    fn start_shard(&self, stream: &str, table: &str, l: &Lease, counter: u64, tp: TopicPartition) {
        let mut st = self.state.lock();
        let first = st.seen.insert(tp.clone());
        let spec = match (&l.checkpoint, &self.start) {
            (Some(cp), StartFrom::Committed { .. }) => Spec::After(cp.clone()),
            (Some(cp), _) if !first => Spec::After(cp.clone()),
            _ if !l.parents.is_empty() && l.checkpoint.is_none() => Spec::TrimHorizon,
            (_, start) => spec_of(start).unwrap_or(Spec::TrimHorizon),
        };
        let mut o = Owned {
            stream: stream.to_string(),
            shard: l.key.clone(),
            table: table.to_string(),
            counter,
            buf: VecDeque::new(),
            paused: false,
            epoch: 0,
            fetcher: None,
            delivered: None,
            pending: VecDeque::new(),
            fetched: None,
            checkpoint: l.checkpoint.clone(),
            ended: false,
            closed: false,
            millis_behind: None,
        };
        o.fetcher = Some(self.spawn_fetcher(tp.clone(), 0, spec));
        st.owned.insert(tp, o);
    }

    /// Starts the fetch of a held shard: SubscribeToShard with enhanced fan-out on, else
    /// GetRecords polling; both feed the shard's [`Pipe`].
    fn spawn_fetcher(&self, tp: TopicPartition, epoch: u64, spec: Spec) -> JoinHandle<()> {
        let pipe = Pipe::new(
            self.shared.clone(),
            self.state.clone(),
            self.data.clone(),
            tp,
            epoch,
            &spec,
        );
        let arn = self
            .efo_arns
            .get(&pipe.tp.topic)
            .filter(|_| self.efo.active())
            .cloned();
        match arn {
            Some(arn) => {
                let efo = self.efo.clone();
                tokio::spawn(async move { efo::run(pipe, spec, arn, &efo).await })
            }
            None => tokio::spawn(poll_shard(pipe, spec)),
        }
    }

    /// Gives leases back: the listener's positions are checkpointed, then the leases released.
    async fn hand_off(&self, give: &[TopicPartition]) -> Result<()> {
        if give.is_empty() {
            return Ok(());
        }
        let positions = match self.listener() {
            Some(l) => l.on_revoked(give),
            None => Vec::new(),
        };
        let positions: Vec<_> = positions
            .into_iter()
            .filter(|(tp, _)| give.contains(tp))
            .collect();
        if let Err(e) = self.commit(&positions).await {
            tracing::warn!("checkpoint before handing leases off failed: {e}");
        }
        let _g = self.lease_ops.lock().await;
        let removed: Vec<Owned> = {
            let mut st = self.state.lock();
            give.iter().filter_map(|tp| st.owned.remove(tp)).collect()
        };
        for mut o in removed {
            if let Some(f) = o.fetcher.take() {
                f.abort();
            }
            let h = HeldLease {
                key: o.shard.clone(),
                owner: self.owner.clone(),
                counter: o.counter,
            };
            self.store
                .release(&o.table, std::slice::from_ref(&h))
                .await?;
        }
        Ok(())
    }

    /// Closed shards read to the end with everything handed out committed: checkpoint
    /// `SHARD_END` and release, so children become readable.
    async fn finish_ended_shards(&self) -> Result<()> {
        let done: Vec<TopicPartition> = {
            let st = self.state.lock();
            st.owned
                .iter()
                .filter(|(_, o)| {
                    o.ended
                        && o.buf.is_empty()
                        && (o.delivered.is_none() || o.delivered == o.checkpoint)
                })
                .map(|(tp, _)| tp.clone())
                .collect()
        };
        if done.is_empty() {
            return Ok(());
        }
        let _g = self.lease_ops.lock().await;
        for tp in done {
            let Some((table, shard, counter)) = self
                .state
                .lock()
                .owned
                .get(&tp)
                .map(|o| (o.table.clone(), o.shard.clone(), o.counter))
            else {
                continue;
            };
            let ok = self
                .store
                .checkpoint(
                    &table,
                    &[CheckpointRequest {
                        key: shard.clone(),
                        owner: self.owner.clone(),
                        counter,
                        checkpoint: SHARD_END.to_string(),
                    }],
                )
                .await?
                .remove(0);
            let o = self.state.lock().owned.remove(&tp);
            if ok {
                self.store
                    .release(
                        &table,
                        &[HeldLease {
                            key: shard,
                            owner: self.owner.clone(),
                            counter,
                        }],
                    )
                    .await?;
                tracing::debug!(partition = %tp, "shard finished: SHARD_END checkpointed");
                if let Some(l) = self.listener() {
                    let _ = l.on_revoked(std::slice::from_ref(&tp));
                }
            } else if o.is_some() {
                self.state.lock().lost.push(tp);
            }
        }
        Ok(())
    }

    fn owned_err(&self, tp: &TopicPartition) -> Error {
        Error::new(
            ErrorKind::Fenced,
            format!(
                "partition {tp} ({}) is not held by member '{}' of group '{}': its lease moved \
                 or was never taken",
                shard_of_partition(tp.partition),
                self.owner,
                self.group
            ),
        )
    }

    /// Re-reads a held shard from `spec`, dropping what was fetched.
    fn restart(&self, tp: &TopicPartition, spec: Spec) -> Result<()> {
        let mut st = self.state.lock();
        let Some(o) = st.owned.get_mut(tp) else {
            return Err(self.owned_err(tp));
        };
        if let Some(f) = o.fetcher.take() {
            f.abort();
        }
        o.epoch += 1;
        o.buf.clear();
        o.pending.clear();
        o.ended = false;
        let epoch = o.epoch;
        drop(st);
        let h = self.spawn_fetcher(tp.clone(), epoch, spec);
        if let Some(o) = self.state.lock().owned.get_mut(tp) {
            o.fetcher = Some(h);
        }
        Ok(())
    }

    async fn table_checkpoints(
        &self,
        partitions: &[TopicPartition],
    ) -> Result<Vec<Option<String>>> {
        let mut out = Vec::with_capacity(partitions.len());
        for tp in partitions {
            let table = table_group(&self.group, &tp.topic);
            let row = self
                .store
                .get(&table, &[shard_of_partition(tp.partition)])
                .await?
                .remove(0);
            out.push(row.and_then(|l| l.checkpoint));
        }
        Ok(out)
    }
}

/// The shared end of a shard's fetch: whichever fetcher reads the shard (GetRecords polling or
/// SubscribeToShard), its records go through here into the shard's buffer: envelope decoding,
/// the `AT_TIMESTAMP` refinement, the last record fetched, `MillisBehindLatest` and shard end.
/// A pipe belongs to one fetch (`epoch`): once the shard is no longer held, or was rewound by
/// seek / nack, it refuses further records and its fetcher stops.
pub(crate) struct Pipe {
    pub(crate) shared: Arc<Shared>,
    state: Arc<Mutex<State>>,
    data: Arc<Notify>,
    pub(crate) tp: TopicPartition,
    pub(crate) shard: String,
    epoch: u64,
    /// `Spec::Time`: records with a message timestamp before it are skipped until the first one
    /// at or after it.
    skip_before: Option<i64>,
    /// When this fetch started (ms): a restarted `LATEST` fetch starts `AT_TIMESTAMP` of it.
    started: i64,
    /// Sequence number of the last record fetched.
    pub(crate) last_fetched: Option<String>,
}

impl Pipe {
    fn new(
        shared: Arc<Shared>,
        state: Arc<Mutex<State>>,
        data: Arc<Notify>,
        tp: TopicPartition,
        epoch: u64,
        spec: &Spec,
    ) -> Pipe {
        Pipe {
            shared,
            state,
            data,
            shard: shard_of_partition(tp.partition),
            tp,
            epoch,
            skip_before: match spec {
                Spec::Time(ts) => Some(*ts),
                _ => None,
            },
            started: onceflow_core::now_ms(),
            last_fetched: None,
        }
    }

    /// Whether this fetch is still current; the buffer's length.
    fn current(&self) -> Option<usize> {
        let st = self.state.lock();
        st.owned
            .get(&self.tp)
            .filter(|o| o.epoch == self.epoch)
            .map(|o| o.buf.len())
    }

    /// Waits while the shard's buffer is full (`buffer=`); `false` once the fetch is no longer
    /// current.
    pub(crate) async fn room(&self) -> bool {
        loop {
            match self.current() {
                None => return false,
                Some(n) if n >= self.shared.options.buffer => {
                    tokio::time::sleep(self.shared.options.idle).await
                }
                Some(_) => return true,
            }
        }
    }

    /// Where a (re)started read begins: after the last record fetched, else `spec` (a `LATEST`
    /// start is used once; later restarts are `AT_TIMESTAMP` of the first, so records written
    /// in between are not skipped).
    pub(crate) fn resume_spec(&self, spec: &mut Spec) -> Spec {
        match (&self.last_fetched, &*spec) {
            (Some(seq), _) => Spec::After(seq.clone()),
            (None, Spec::Latest) => std::mem::replace(spec, Spec::Time(self.started)),
            (None, s) => s.clone(),
        }
    }

    /// Hands fetched records to the shard's buffer (decoded, see [`to_message`]) with the
    /// shard's `MillisBehindLatest` and whether the shard ended with them. `false` when the
    /// fetch is no longer current (nothing was added).
    pub(crate) fn deliver(
        &mut self,
        records: &[aws_sdk_kinesis::types::Record],
        millis: Option<u64>,
        ended: bool,
    ) -> bool {
        let mut msgs = Vec::with_capacity(records.len());
        let mut last = None;
        for r in records {
            last = Some(r.sequence_number().to_string());
            let m = to_message(&self.tp, r);
            if let Some(ts) = self.skip_before {
                if m.timestamp.unwrap_or(i64::MAX) < ts {
                    continue;
                }
                self.skip_before = None;
            }
            msgs.push(m);
        }
        {
            let mut st = self.state.lock();
            let Some(o) = st.owned.get_mut(&self.tp).filter(|o| o.epoch == self.epoch) else {
                return false;
            };
            o.buf.extend(msgs);
            if last.is_some() {
                o.fetched = last.clone();
            }
            if millis.is_some() {
                o.millis_behind = millis;
            }
            if ended {
                o.ended = true;
            }
        }
        if last.is_some() {
            self.last_fetched = last;
        }
        if !records.is_empty() || ended {
            self.data.notify_waiters();
        }
        true
    }

    /// Marks the shard read to its end.
    pub(crate) fn mark_ended(&self) {
        let mut st = self.state.lock();
        if let Some(o) = st.owned.get_mut(&self.tp).filter(|o| o.epoch == self.epoch) {
            o.ended = true;
        }
        drop(st);
        self.data.notify_waiters();
    }

    /// Whether the group's last ListShards reported the shard closed.
    pub(crate) fn closed(&self) -> bool {
        self.state
            .lock()
            .owned
            .get(&self.tp)
            .is_some_and(|o| o.closed)
    }

    /// Reports a failure retrying cannot fix through the next `poll` (when still current).
    pub(crate) fn fail(&self, e: Error) {
        tracing::error!(partition = %self.tp, "{e}");
        let mut st = self.state.lock();
        if st
            .owned
            .get(&self.tp)
            .is_some_and(|o| o.epoch == self.epoch)
        {
            st.failed = Some((e.kind(), e.message().to_string()));
        }
        drop(st);
        self.data.notify_waiters();
    }

    /// Whether a closed shard has nothing after `after` (GetShardIterator
    /// `AFTER_SEQUENCE_NUMBER`, else `TRIM_HORIZON`, then one GetRecords: no record and no
    /// next iterator).
    pub(crate) async fn at_end(&self, after: Option<&str>) -> Result<bool> {
        let spec = match after.or(self.last_fetched.as_deref()) {
            Some(s) => Spec::After(s.to_string()),
            None => Spec::TrimHorizon,
        };
        let Some(it) = self.iterator(&spec).await? else {
            return Ok(true);
        };
        let out = self
            .shared
            .client
            .get_records()
            .shard_iterator(it)
            .limit(1)
            .send()
            .await
            .map_err(|e| aws_err(format!("GetRecords of {}", self.tp), e))?;
        Ok(out.records().is_empty() && out.next_shard_iterator().is_none())
    }

    async fn iterator(&self, spec: &Spec) -> Result<Option<String>> {
        let mut req = self
            .shared
            .client
            .get_shard_iterator()
            .stream_name(&self.tp.topic)
            .shard_id(&self.shard);
        req = match spec {
            Spec::TrimHorizon => req.shard_iterator_type(ShardIteratorType::TrimHorizon),
            Spec::Latest => req.shard_iterator_type(ShardIteratorType::Latest),
            Spec::At(s) => req
                .shard_iterator_type(ShardIteratorType::AtSequenceNumber)
                .starting_sequence_number(s),
            Spec::After(s) => req
                .shard_iterator_type(ShardIteratorType::AfterSequenceNumber)
                .starting_sequence_number(s),
            Spec::Time(ts) => req
                .shard_iterator_type(ShardIteratorType::AtTimestamp)
                .timestamp(DateTime::from_millis(*ts)),
        };
        let r = req.send().await.map_err(|e| {
            aws_err(
                format!("GetShardIterator of {} ({})", self.tp, self.shard),
                e,
            )
        })?;
        Ok(r.shard_iterator().map(String::from))
    }
}

/// Reads one shard with GetShardIterator + GetRecords into its pipe, until the shard ends or
/// the fetch is no longer current. An expired iterator is renewed after the last record
/// fetched; a throttled or failed call backs off (`idle_ms` × failures, at most 20×).
pub(crate) async fn poll_shard(mut pipe: Pipe, mut spec: Spec) {
    let idle = pipe.shared.options.idle;
    let limit = pipe.shared.options.fetch_limit;
    let mut iterator: Option<String> = None;
    let mut failures = 0u32;
    loop {
        if !pipe.room().await {
            return;
        }
        if iterator.is_none() {
            let s = pipe.resume_spec(&mut spec);
            match pipe.iterator(&s).await {
                Ok(Some(it)) => iterator = Some(it),
                Ok(None) => {
                    pipe.mark_ended();
                    return;
                }
                Err(e) => {
                    failures += 1;
                    tracing::warn!(partition = %pipe.tp, "GetShardIterator failed: {e}");
                    tokio::time::sleep(idle * failures.min(20)).await;
                    continue;
                }
            }
        }
        let it = iterator.clone().expect("set above");
        let r = pipe
            .shared
            .client
            .get_records()
            .shard_iterator(it)
            .limit(limit)
            .send()
            .await;
        let out = match r {
            Ok(out) => out,
            Err(e) => {
                let expired = e
                    .as_service_error()
                    .is_some_and(|s| s.is_expired_iterator_exception());
                if expired {
                    tracing::debug!(partition = %pipe.tp, "shard iterator expired: renewing from the last record fetched");
                    iterator = None;
                    continue;
                }
                let err = aws_err(format!("GetRecords of {}", pipe.tp), e);
                failures += 1;
                tracing::warn!(partition = %pipe.tp, "{err}");
                if !err.is_retriable() {
                    iterator = None;
                }
                tokio::time::sleep(idle * failures.min(20)).await;
                continue;
            }
        };
        failures = 0;
        let millis = out
            .millis_behind_latest()
            .and_then(|m| u64::try_from(m).ok());
        let next = out.next_shard_iterator().map(String::from);
        if !pipe.deliver(out.records(), millis, next.is_none()) {
            return;
        }
        match next {
            None => return,
            Some(it) => iterator = Some(it),
        }
        if out.records().is_empty() {
            tokio::time::sleep(idle).await;
        }
    }
}

fn to_message(tp: &TopicPartition, r: &aws_sdk_kinesis::types::Record) -> Message {
    let data = Bytes::from(r.data().as_ref().to_vec());
    let arrival = r
        .approximate_arrival_timestamp()
        .and_then(|t| t.to_millis().ok());
    let pk = Bytes::from(r.partition_key().unwrap_or_default().to_string());
    let position = Position::SequenceNumber(r.sequence_number().to_string());
    match envelope::decode(data.clone()) {
        Ok(d) => {
            let key = if d.envelope.unkeyed {
                None
            } else {
                Some(d.envelope.key.unwrap_or(pk))
            };
            Message {
                topic: tp.topic.clone(),
                partition: tp.partition,
                position,
                key,
                payload: d.payload,
                headers: d.envelope.headers,
                timestamp: d.envelope.timestamp.or(arrival),
                delivery_count: 1,
            }
        }
        Err(e) => {
            let mut headers = Headers::new();
            headers.insert(ENVELOPE_ERROR_HEADER, e.message().to_string());
            Message {
                topic: tp.topic.clone(),
                partition: tp.partition,
                position,
                key: Some(pk),
                payload: data,
                headers,
                timestamp: arrival,
                delivery_count: 1,
            }
        }
    }
}

/// The checkpoint of a shard that was closed (split or merged) and read to its end, in the
/// lease table (the name KCL gives it). Children of the shard are read once all their parents
/// carry it (or their rows are gone).
pub const SHARD_END: &str = "SHARD_END";

/// Whether `lease`'s shard was read to its end ([`SHARD_END`]).
pub(crate) fn is_shard_end(lease: &Lease) -> bool {
    lease.checkpoint.as_deref() == Some(SHARD_END)
}

/// Counts the records after checkpoint `cp` (all of them without one) and the shard's
/// `MillisBehindLatest`, reading at most 20 GetRecords pages of 10 000.
pub(crate) async fn count_after(
    shared: &Shared,
    stream: &str,
    shard: &str,
    cp: Option<&str>,
) -> Result<(u64, Option<u64>)> {
    if cp == Some(SHARD_END) {
        return Ok((0, Some(0)));
    }
    let mut req = shared
        .client
        .get_shard_iterator()
        .stream_name(stream)
        .shard_id(shard);
    req = match cp {
        Some(s) => req
            .shard_iterator_type(ShardIteratorType::AfterSequenceNumber)
            .starting_sequence_number(s),
        None => req.shard_iterator_type(ShardIteratorType::TrimHorizon),
    };
    let mut it = req
        .send()
        .await
        .map_err(|e| aws_err(format!("GetShardIterator of {stream}/{shard}"), e))?
        .shard_iterator()
        .map(String::from);
    let mut count = 0u64;
    let mut millis = None;
    for _ in 0..20 {
        let Some(i) = it.take() else { break };
        let out = shared
            .client
            .get_records()
            .shard_iterator(i)
            .limit(10_000)
            .send()
            .await
            .map_err(|e| aws_err(format!("GetRecords of {stream}/{shard}"), e))?;
        let n = out.records().len();
        count += n as u64;
        if millis.is_none() {
            millis = out
                .millis_behind_latest()
                .and_then(|m| u64::try_from(m).ok());
        }
        if n == 0 {
            break;
        }
        it = out.next_shard_iterator().map(String::from);
    }
    Ok((count, millis))
}

/// The sequence number after `s` (decimal + 1).
fn decimal_succ(s: &str) -> String {
    let mut d: Vec<u8> = s.bytes().collect();
    let mut i = d.len();
    loop {
        if i == 0 {
            d.insert(0, b'1');
            break;
        }
        i -= 1;
        if d[i] == b'9' {
            d[i] = b'0';
        } else {
            d[i] += 1;
            break;
        }
    }
    String::from_utf8(d).unwrap_or_default()
}

#[async_trait]
impl ConsumerBackend for KinesisConsumer {
    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn set_rebalance_listener(&self, listener: Arc<dyn RebalanceListener>) {
        *self.listener.lock() = Some(listener);
    }

    async fn poll(&self, max: usize, timeout: Duration) -> Result<Vec<Message>> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::new(
                ErrorKind::Closed,
                "the Kinesis consumer is closed",
            ));
        }
        let deadline = Instant::now() + timeout;
        loop {
            if let Some((kind, msg)) = self.state.lock().failed.take() {
                return Err(Error::new(kind, msg));
            }
            let due = *self.next_coordination.lock();
            if Instant::now() >= due {
                *self.next_coordination.lock() = Instant::now() + self.lease() / 3;
                self.coordinate().await?;
            }
            let notified = self.data.notified();
            let msgs = {
                let mut st = self.state.lock();
                let keys: Vec<TopicPartition> = st.owned.keys().cloned().collect();
                let mut out = Vec::new();
                if !keys.is_empty() {
                    let start = st.rr % keys.len();
                    st.rr = st.rr.wrapping_add(1);
                    for k in keys.iter().cycle().skip(start).take(keys.len()) {
                        let o = st.owned.get_mut(k).expect("listed");
                        if o.paused {
                            continue;
                        }
                        while out.len() < max {
                            match o.buf.pop_front() {
                                Some(m) => {
                                    let seq = position_str(&m.position);
                                    o.pending.push_back(seq.clone());
                                    o.delivered = Some(seq);
                                    out.push(m);
                                }
                                None => break,
                            }
                        }
                    }
                }
                out
            };
            if !msgs.is_empty() {
                return Ok(msgs);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(Vec::new());
            }
            let next = (*self.next_coordination.lock()).min(deadline);
            let _ = tokio::time::timeout(next.saturating_duration_since(now), notified).await;
        }
    }

    async fn commit(&self, positions: &[(TopicPartition, Position)]) -> Result<()> {
        if positions.is_empty() {
            return Ok(());
        }
        let _g = self.lease_ops.lock().await;
        for (tp, pos) in positions {
            let Position::SequenceNumber(seq) = pos else {
                return Err(Error::config(format!(
                    "position {pos} for {tp} is not a Kinesis sequence number"
                )));
            };
            let Some((table, shard, counter)) = self
                .state
                .lock()
                .owned
                .get(tp)
                .map(|o| (o.table.clone(), o.shard.clone(), o.counter))
            else {
                return Err(self.owned_err(tp));
            };
            let ok = self
                .store
                .checkpoint(
                    &table,
                    &[CheckpointRequest {
                        key: shard,
                        owner: self.owner.clone(),
                        counter,
                        checkpoint: seq.clone(),
                    }],
                )
                .await?
                .remove(0);
            if !ok {
                let mut st = self.state.lock();
                if let Some(mut o) = st.owned.remove(tp) {
                    if let Some(f) = o.fetcher.take() {
                        f.abort();
                    }
                    st.lost.push(tp.clone());
                }
                return Err(self.owned_err(tp));
            }
            if let Some(o) = self.state.lock().owned.get_mut(tp) {
                o.checkpoint = Some(seq.clone());
                let done = Position::SequenceNumber(seq.clone());
                while o
                    .pending
                    .front()
                    .is_some_and(|p| Position::SequenceNumber(p.clone()) <= done)
                {
                    o.pending.pop_front();
                }
            }
        }
        Ok(())
    }

    /// The next position after the checkpoint: the sequence number of the record after it when
    /// there is one, else the checkpoint + 1; `None` without a checkpoint or for a finished
    /// (`SHARD_END`) shard.
    async fn committed(
        &self,
        partitions: &[TopicPartition],
    ) -> Result<Vec<(TopicPartition, Option<Position>)>> {
        let cps = self.table_checkpoints(partitions).await?;
        let mut out = Vec::with_capacity(partitions.len());
        for (tp, cp) in partitions.iter().zip(cps) {
            let next = match cp {
                None => None,
                Some(c) if c == SHARD_END => None,
                Some(c) => {
                    let it = self
                        .shared
                        .client
                        .get_shard_iterator()
                        .stream_name(&tp.topic)
                        .shard_id(shard_of_partition(tp.partition))
                        .shard_iterator_type(ShardIteratorType::AfterSequenceNumber)
                        .starting_sequence_number(&c)
                        .send()
                        .await
                        .map_err(|e| aws_err(format!("GetShardIterator of {tp}"), e))?;
                    let mut seq = None;
                    if let Some(i) = it.shard_iterator() {
                        let r = self
                            .shared
                            .client
                            .get_records()
                            .shard_iterator(i)
                            .limit(1)
                            .send()
                            .await
                            .map_err(|e| aws_err(format!("GetRecords of {tp}"), e))?;
                        seq = r.records().first().map(|r| r.sequence_number().to_string());
                    }
                    Some(Position::SequenceNumber(
                        seq.unwrap_or_else(|| decimal_succ(&c)),
                    ))
                }
            };
            out.push((tp.clone(), next));
        }
        Ok(out)
    }

    async fn seek(&self, partition: &TopicPartition, to: &StartFrom) -> Result<()> {
        let spec = match to {
            StartFrom::Committed { fallback } => {
                match self
                    .table_checkpoints(std::slice::from_ref(partition))
                    .await?
                    .remove(0)
                {
                    Some(c) if c != SHARD_END => Spec::After(c),
                    _ => spec_of(fallback)?,
                }
            }
            other => spec_of(other)?,
        };
        self.restart(partition, spec)
    }

    async fn pause(&self, partitions: &[TopicPartition]) -> Result<()> {
        let mut st = self.state.lock();
        for tp in partitions {
            if let Some(o) = st.owned.get_mut(tp) {
                o.paused = true;
            }
        }
        Ok(())
    }

    async fn resume(&self, partitions: &[TopicPartition]) -> Result<()> {
        let mut st = self.state.lock();
        for tp in partitions {
            if let Some(o) = st.owned.get_mut(tp) {
                o.paused = false;
            }
        }
        drop(st);
        self.data.notify_waiters();
        Ok(())
    }

    fn assignment(&self) -> Vec<TopicPartition> {
        self.state.lock().owned.keys().cloned().collect()
    }

    /// Per held shard: `messages` = records handed out and not committed + records fetched and
    /// not handed out + (only when the shard's last `MillisBehindLatest` is not 0) the records
    /// after the last one fetched, counted by reading; `millis` = the last `MillisBehindLatest`.
    /// A consumer at the tip answers without calling Kinesis.
    async fn lag(&self) -> Result<Vec<PartitionLag>> {
        struct Row {
            tp: TopicPartition,
            shard: String,
            millis: Option<u64>,
            known: u64,
            next: Option<String>,
            fetched: Option<String>,
            checkpoint: Option<String>,
        }
        let rows: Vec<Row> = {
            let st = self.state.lock();
            st.owned
                .iter()
                .map(|(tp, o)| Row {
                    tp: tp.clone(),
                    shard: o.shard.clone(),
                    millis: o.millis_behind,
                    known: (o.pending.len() + o.buf.len()) as u64,
                    next: o
                        .pending
                        .front()
                        .cloned()
                        .or_else(|| o.buf.front().map(|m| position_str(&m.position))),
                    fetched: o.fetched.clone(),
                    checkpoint: o.checkpoint.clone(),
                })
                .collect()
        };
        let mut out = Vec::new();
        for r in rows {
            let (unread, millis) = match (r.millis, &r.fetched) {
                (Some(0), _) => (0, Some(0)),
                (_, Some(f)) => count_after(&self.shared, &r.tp.topic, &r.shard, Some(f)).await?,
                (_, None) => {
                    count_after(&self.shared, &r.tp.topic, &r.shard, r.checkpoint.as_deref())
                        .await?
                }
            };
            let committed = match r.next {
                Some(n) => Some(Position::SequenceNumber(n)),
                // Nothing handed out or fetched after the checkpoint: the position after it.
                None => r
                    .checkpoint
                    .filter(|c| c != SHARD_END)
                    .map(|c| Position::SequenceNumber(decimal_succ(&c))),
            };
            out.push(PartitionLag {
                partition: r.tp,
                committed,
                high_watermark: None,
                messages: r.known + unread,
                millis: r.millis.or(millis),
            });
        }
        Ok(out)
    }

    fn group_metadata(&self) -> Option<GroupMetadata> {
        Some(GroupMetadata {
            group: self.group.clone(),
            generation: 0,
            member_id: self.owner.clone(),
            native: None,
        })
    }

    async fn nack(&self, message: &Message, _delay: Duration) -> Result<()> {
        let Position::SequenceNumber(s) = &message.position else {
            return Err(Error::config(format!(
                "position {} is not a Kinesis sequence number",
                message.position
            )));
        };
        self.restart(&message.topic_partition(), Spec::At(s.clone()))
    }

    /// Stops fetching and releases every held lease (graceful handoff: other members take the
    /// shards at once). Does not checkpoint; callers commit first.
    async fn close(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        if let Some(r) = self.renewer.lock().take() {
            r.abort();
        }
        let mut counters = self.lease_ops.lock().await;
        let owned: Vec<Owned> = std::mem::take(&mut self.state.lock().owned)
            .into_values()
            .collect();
        for mut o in owned {
            if let Some(f) = o.fetcher.take() {
                f.abort();
            }
            let h = HeldLease {
                key: o.shard.clone(),
                owner: self.owner.clone(),
                counter: o.counter,
            };
            self.store
                .release(&o.table, std::slice::from_ref(&h))
                .await?;
        }
        for (table, c) in std::mem::take(&mut counters.worker) {
            let wg = workers_group(&table);
            let h = HeldLease {
                key: self.owner.clone(),
                owner: self.owner.clone(),
                counter: c,
            };
            self.store.release(&wg, std::slice::from_ref(&h)).await?;
            self.store
                .delete(&wg, std::slice::from_ref(&self.owner))
                .await?;
        }
        Ok(())
    }
}

impl Drop for KinesisConsumer {
    fn drop(&mut self) {
        if let Some(r) = self.renewer.lock().take() {
            r.abort();
        }
        for o in self.state.lock().owned.values_mut() {
            if let Some(f) = o.fetcher.take() {
                f.abort();
            }
        }
    }
}

fn position_str(p: &Position) -> String {
    match p {
        Position::SequenceNumber(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn successor_of_decimal() {
        assert_eq!(decimal_succ("129"), "130");
        assert_eq!(decimal_succ("999"), "1000");
    }
}
