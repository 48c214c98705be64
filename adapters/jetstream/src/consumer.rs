//! Durable pull consumers, one per group and partition.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::message::AckKind;
use async_nats::jetstream::{self, stream::Stream};
use async_trait::async_trait;
use futures::StreamExt;
use onceflow_core::{
    Capabilities, ConsumerBackend, ConsumerConfig, Error, ErrorKind, GroupMetadata, Message,
    PartitionLag, Position, ProducerBackend, ProducerConfig, RebalanceListener, Record, Result,
    StartFrom, TopicPartition,
};
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::task::JoinHandle;

use crate::config::JetStreamOptions;
use crate::convert::{self, nats_err};
use crate::group::{self, Membership};
use crate::naming;
use crate::producer::JetStreamProducer;
use crate::{Shared, CAPABILITIES};

/// The shortest [`ConsumerConfig::session_timeout`] a JetStream group takes: shorter, a member
/// would count itself dead between two of its own heartbeats (every `session_timeout / 4`, at
/// least 100 ms apart) and never own a partition; a `Config` error names it.
pub const MIN_SESSION_TIMEOUT: Duration = Duration::from_millis(500);

/// Session timeout when [`ConsumerConfig::session_timeout`] is not set: a member that does not
/// poll for this long loses its partitions to the others.
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// One partition of the subscribed topics: its durable and, while this member owns it, the
/// fetch task feeding it and the messages delivered by `poll` that are neither committed nor
/// nacked.
struct Partition {
    tp: TopicPartition,
    stream: Stream,
    subject: String,
    durable: String,
    /// Where a durable created on claim starts (the consumer's start, resolved).
    start: StartFrom,
    inner: Mutex<PartitionInner>,
}

#[derive(Default)]
struct PartitionInner {
    /// Set while this member owns the partition.
    fetch: Option<Fetch>,
    /// Revision of this member's owner entry.
    owner_revision: Option<u64>,
    paused: bool,
    /// Delivered by `poll`, not yet acked or nacked, by stream sequence.
    pending: BTreeMap<u64, jetstream::Message>,
    /// When the ack deadline of each pending message runs out, as far as this member knows
    /// (its poll or its last `+WPI`, plus the shortest ack deadline), and whether the server
    /// delivered it again while it was pending: an ack after either is late
    /// ([`JetStreamConsumer::commit`]).
    deadlines: HashMap<u64, Deadline>,
    /// The sequences `pending` held at the last keepalive tick, sorted: those still pending at
    /// the next tick get `+WPI` ([`JetStreamConsumer::keep_alive`]).
    pending_at_tick: Vec<u64>,
    /// Highest stream sequence `poll` returned since this member took the partition (or
    /// sought): a message at or below it that is neither pending nor nacked was committed.
    delivered: u64,
    /// Nacked by this member and expected back from the server, with the last delivery's ack
    /// handle (to terminate one the server gave up on, see `dead_letter`).
    nacked: BTreeMap<u64, jetstream::Message>,
    /// The durable's last delivered stream sequence when this member took the partition: a
    /// message at or below it may have been delivered to an earlier owner (or an earlier run of
    /// this member) without being acked, and the server redelivers it only after `ack_wait`,
    /// possibly after newer messages this member already took. Such a message is new to this
    /// member until it returned it once.
    inherited_upto: u64,
    /// Sequences at or below `inherited_upto` that `poll` returned since this member took the
    /// partition (at most the durable's ack-pending messages then).
    inherited_seen: HashSet<u64>,
}

impl PartitionInner {
    /// Forgets what was delivered (a new owner, a seek): the next fetch starts afresh.
    fn reset(&mut self) {
        self.pending.clear();
        self.deadlines.clear();
        self.pending_at_tick.clear();
        self.delivered = 0;
        self.nacked.clear();
        self.inherited_upto = 0;
        self.inherited_seen.clear();
    }

    /// Whether a fetched message is new to the poller. The server redelivers a message whose
    /// `ack_wait` expired even to the member that still holds it
    /// (<https://docs.nats.io/nats-concepts/jetstream/consumers#ackwait>); onceflow's model is
    /// that a member sees a message again only after it nacked it, sought, or the partition
    /// moved. So a redelivery of a pending message only replaces its ack handle (acks go to
    /// the newest delivery), and a redelivery of one already committed is not returned but
    /// acked again ([`Admit::Committed`]): the ack of the earlier delivery may not have counted
    /// (the redelivery was already on its way when the commit acked the older handle), and a
    /// redelivery dropped without an ack would come back every `ack_wait` and hold the ack
    /// floor (the committed position) back forever. A message the durable had delivered
    /// before this member took the partition (`inherited_upto`) is judged by whether this
    /// member returned it, not by `delivered`: the dead owner's unacked messages come back
    /// only after `ack_wait`, behind newer ones.
    fn admit(&mut self, seq: u64, m: &jetstream::Message) -> Admit {
        if let Some(held) = self.pending.get_mut(&seq) {
            *held = m.clone();
            if let Some(d) = self.deadlines.get_mut(&seq) {
                d.redelivered = true;
            }
            return Admit::Held;
        }
        let nacked = self.nacked.remove(&seq).is_some();
        if seq <= self.inherited_upto {
            if !self.inherited_seen.insert(seq) && !nacked {
                return Admit::Committed;
            }
        } else if seq <= self.delivered && !nacked {
            return Admit::Committed;
        }
        self.delivered = self.delivered.max(seq);
        Admit::New
    }
}

/// The ack deadline of a pending message ([`PartitionInner::deadlines`]).
#[derive(Clone, Copy)]
struct Deadline {
    at: Instant,
    /// The server delivered the message again while this member held it.
    redelivered: bool,
}

/// What [`PartitionInner::admit`] made of a fetched message.
enum Admit {
    /// New to the poller: return it.
    New,
    /// A redelivery of a message the poller holds: its ack handle was replaced.
    Held,
    /// A redelivery of a message already committed: ack it again, don't return it.
    Committed,
}

/// Whether the group still counts this member alive: its last heartbeat is younger than the
/// session timeout. A member past it may have lost its partitions without knowing (it has not
/// polled), so it neither pulls nor keeps messages alive until its next heartbeat: the
/// messages it holds reach the new owner after `ack_wait`.
#[derive(Clone)]
struct Liveness {
    last: Arc<Mutex<Option<Instant>>>,
    session: Duration,
}

impl Liveness {
    fn stale(&self) -> bool {
        self.last
            .lock()
            .is_some_and(|t| t.elapsed() >= self.session)
    }

    /// The last heartbeat reached the group bucket less than `age` ago.
    fn recent(&self, age: Duration) -> bool {
        self.last.lock().is_some_and(|t| t.elapsed() < age)
    }
}

struct Fetch {
    /// How long a stop waits for the pull request in flight to end: its expiry
    /// (`pull_expires_ms`), the grace after which the task gives a silent request up
    /// ([`request_grace`]), and a second to spare. Past it the task is aborted, and what it
    /// held comes back only after `ack_wait`, counting toward `max_deliver`.
    stop_within: Duration,
    rx: mpsc::Receiver<jetstream::Message>,
    task: JoinHandle<Vec<jetstream::Message>>,
    stop: oneshot::Sender<()>,
}

impl Fetch {
    /// Stops the task and waits until its pull request in flight ended (so the server has no
    /// request of ours left before anything we nak is redelivered); returns what it fetched and
    /// nobody polled, in order.
    async fn shutdown(mut self) -> Vec<jetstream::Message> {
        let _ = self.stop.send(());
        let more = match tokio::time::timeout(self.stop_within, &mut self.task).await {
            Ok(Ok(more)) => more,
            _ => {
                self.task.abort();
                Vec::new()
            }
        };
        self.rx.close();
        let mut left = Vec::new();
        while let Ok(m) = self.rx.try_recv() {
            left.push(m);
        }
        left.extend(more);
        left
    }
}

/// A member of a consumer group on JetStream (see the crate docs for the mapping).
pub struct JetStreamConsumer {
    shared: Arc<Shared>,
    group: String,
    options: JetStreamOptions,
    partitions: Vec<Partition>,
    membership: Membership,
    refresh_every: Duration,
    /// The group's session timeout: a member whose last heartbeat is older is dead to the
    /// others, which take its partitions.
    session: Duration,
    last_refresh: Mutex<Option<tokio::time::Instant>>,
    /// When this member's last heartbeat reached the group bucket.
    liveness: Liveness,
    rebalancing: tokio::sync::Mutex<()>,
    listener: Mutex<Option<Arc<dyn RebalanceListener>>>,
    closed: AtomicBool,
    notify: Arc<Notify>,
    rotate: AtomicUsize,
    /// Background tasks, ended on close: the ack-deadline keepalive and, with a `dead_letter`
    /// topic, the listeners for `MAX_DELIVERIES` advisories.
    advisories: Mutex<Vec<JoinHandle<()>>>,
}

fn deliver_policy(start: &StartFrom) -> Result<DeliverPolicy> {
    Ok(match start {
        StartFrom::Committed { fallback } => deliver_policy(fallback)?,
        StartFrom::Earliest => DeliverPolicy::All,
        StartFrom::Latest => DeliverPolicy::New,
        StartFrom::Position(Position::Sequence(s)) => DeliverPolicy::ByStartSequence {
            start_sequence: (*s).max(1),
        },
        StartFrom::Position(p) => {
            return Err(Error::config(format!(
                "position {p} is not a JetStream position: expected seq:N"
            )))
        }
        StartFrom::Timestamp(ms) => DeliverPolicy::ByStartTime {
            start_time: time::OffsetDateTime::from_unix_timestamp_nanos(
                i128::from(*ms) * 1_000_000,
            )
            .map_err(|_| Error::config(format!("timestamp {ms} ms is out of range")))?,
        },
    })
}

impl JetStreamConsumer {
    pub(crate) async fn join(shared: Arc<Shared>, config: ConsumerConfig) -> Result<Arc<Self>> {
        let mut options = shared.options.clone();
        options.apply(&config.options)?;
        if !options.backoff.is_empty()
            && options.max_deliver >= 0
            && options.max_deliver <= options.backoff.len() as i64
        {
            return Err(Error::config(format!(
                "max_deliver={} with {} backoff steps: JetStream needs max_deliver > backoff steps",
                options.max_deliver,
                options.backoff.len()
            )));
        }
        let mut partitions = Vec::new();
        for topic in &config.topics {
            let n = shared.partitions(topic).await?;
            let stream = shared.get_stream(topic).await?;
            for p in 0..n as i32 {
                let subject = naming::subject(topic, n, p);
                let durable = naming::durable(&config.group, p);
                let start = resolve_start(&stream, &subject, &config.start).await?;
                // Created (or, with reset=true and an explicit start, created again) now, or resumed
                // and updated to the options; resumed on claim.
                ensure_durable(&stream, &durable, &subject, &options, &start, options.reset)
                    .await?;
                partitions.push(Partition {
                    tp: TopicPartition::new(topic.clone(), p),
                    stream: stream.clone(),
                    subject,
                    durable,
                    start: match start {
                        StartFrom::Committed { .. } => start,
                        other => StartFrom::Committed {
                            fallback: Box::new(other),
                        },
                    },
                    inner: Mutex::new(PartitionInner::default()),
                });
            }
        }
        let session = config.session_timeout.unwrap_or(DEFAULT_SESSION_TIMEOUT);
        if session < MIN_SESSION_TIMEOUT {
            // A member heartbeats at most every session / 4 and at least 100 ms apart: below
            // this it counts itself dead between two heartbeats and never owns a partition.
            return Err(Error::config(format!(
                "session_timeout of {} ms: expected at least {} ms (members heartbeat every \
                 session_timeout / 4, at least 100 ms apart)",
                session.as_millis(),
                MIN_SESSION_TIMEOUT.as_millis()
            )));
        }
        let member = config
            .client_id
            .unwrap_or_else(|| format!("member-{:016x}", rand::random::<u64>()));
        if options.require_durable {
            for topic in &config.topics {
                shared.check_durability(topic, true).await?;
            }
        }
        let membership = Membership::join(&shared, &config.group, &member, session).await?;
        if options.dead_letter.is_some() && options.max_deliver <= 0 {
            return Err(Error::config(format!(
                "dead_letter={} needs max_deliver > 0 (the server gives a message up after \
                 max_deliver deliveries): got max_deliver={}",
                options.dead_letter.as_deref().unwrap_or_default(),
                options.max_deliver
            )));
        }
        let consumer = Arc::new(JetStreamConsumer {
            shared,
            group: config.group,
            options,
            partitions,
            membership,
            refresh_every: (session / 4).clamp(Duration::from_millis(100), Duration::from_secs(1)),
            session,
            last_refresh: Mutex::new(None),
            liveness: Liveness {
                last: Arc::new(Mutex::new(None)),
                session,
            },
            rebalancing: tokio::sync::Mutex::new(()),
            listener: Mutex::new(None),
            closed: AtomicBool::new(false),
            notify: Arc::new(Notify::new()),
            rotate: AtomicUsize::new(0),
            advisories: Mutex::new(Vec::new()),
        });
        if consumer.options.dead_letter.is_some() {
            consumer.listen_for_max_deliveries().await?;
        }
        let keepalive = tokio::spawn(Self::keep_alive(
            Arc::downgrade(&consumer),
            keepalive_period(&consumer.options),
        ));
        consumer.advisories.lock().push(keepalive);
        Ok(consumer)
    }

    /// Keeps the ack deadline of every message `poll` delivered and nobody acked or nacked yet
    /// from expiring: every `period` it sends `+WPI` (in progress,
    /// <https://docs.nats.io/using-nats/developer/develop_jetstream/consumers#delivery-reliability>)
    /// for each message that was pending at the previous tick too, so a message waits at most
    /// two periods for its signal. The server would otherwise redeliver a message whose handler
    /// (or whose batch's commit) takes longer than `ack_wait`, and every such redelivery counts
    /// toward `max_deliver`, after which the server gives the message up (or dead-letters it).
    /// Messages fetched but not polled yet are kept alive by their fetch task. Ends with the
    /// consumer.
    async fn keep_alive(consumer: std::sync::Weak<Self>, period: Duration) {
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let (due, deadline) = {
                let Some(c) = consumer.upgrade() else { return };
                if c.closed.load(Ordering::Acquire) {
                    return;
                }
                // A member the others consider dead (no heartbeat for the session timeout:
                // it has not polled) may have lost its partitions already: its messages must
                // reach the new owner after ack_wait, so they are no longer kept alive.
                let stale = c.liveness.stale();
                let mut due = Vec::new();
                for (i, part) in c.partitions.iter().enumerate() {
                    let mut guard = part.inner.lock();
                    let inner = &mut *guard;
                    if !stale {
                        for (seq, m) in &inner.pending {
                            if inner.pending_at_tick.binary_search(seq).is_ok() {
                                due.push((i, *seq, m.clone()));
                            }
                        }
                    }
                    inner.pending_at_tick.clear();
                    inner.pending_at_tick.extend(inner.pending.keys());
                }
                (due, ack_deadline(&c.options))
            };
            let sent = Instant::now();
            let results = futures::future::join_all(
                due.iter().map(|(_, _, m)| m.ack_with(AckKind::Progress)),
            )
            .await;
            let Some(c) = consumer.upgrade() else { return };
            for ((i, seq, _), r) in due.iter().zip(results) {
                match r {
                    Ok(()) => {
                        if let Some(d) = c.partitions[*i].inner.lock().deadlines.get_mut(seq) {
                            d.at = sent + deadline;
                        }
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "in-progress signal failed; the server may redeliver after ack_wait");
                    }
                }
            }
            drop(c);
        }
    }

    /// Subscribes to the `MAX_DELIVERIES` advisories of the streams this member reads
    /// (`$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>`,
    /// <https://docs.nats.io/running-a-nats-service/nats_admin/monitoring/monitoring_jetstream>):
    /// the owner of the partition dead-letters the message.
    async fn listen_for_max_deliveries(self: &Arc<Self>) -> Result<()> {
        let mut streams: Vec<&str> = self
            .partitions
            .iter()
            .map(|p| p.tp.topic.as_str())
            .collect();
        streams.dedup();
        for stream in streams {
            let subject = format!("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.*");
            let mut sub = self
                .shared
                .client
                .subscribe(subject.clone())
                .await
                .map_err(|e| {
                    Error::new(ErrorKind::Connect, format!("subscribing to {subject}: {e}"))
                        .with_source(e)
                })?;
            let me = Arc::downgrade(self);
            let task = tokio::spawn(async move {
                while let Some(adv) = sub.next().await {
                    let Some(c) = me.upgrade() else { return };
                    c.dead_letter(&adv.payload).await;
                }
            });
            self.advisories.lock().push(task);
        }
        // The subscriptions reach the server before any message is delivered.
        let _ = self.shared.client.flush().await;
        Ok(())
    }

    /// Handles one `MAX_DELIVERIES` advisory: when this member owns the partition and does
    /// not hold the message (it nacked it, or never saw it), republishes it to the
    /// `dead_letter` topic with `Nats-Msg-Id` `onceflow-dlq:<stream>:<consumer>:<seq>` (so a
    /// repeated advisory writes it once), the reason in `onceflow-error*` headers and the
    /// source in `onceflow-source-*` (as the engine's dead letters), then terminates it
    /// (`+TERM`) so the ack floor moves past it.
    async fn dead_letter(&self, advisory: &[u8]) {
        let Some(dlq) = self.options.dead_letter.clone() else {
            return;
        };
        let text = String::from_utf8_lossy(advisory);
        let (Some(stream), Some(durable), Some(seq)) = (
            json_str(&text, "stream"),
            json_str(&text, "consumer"),
            json_num(&text, "stream_seq"),
        ) else {
            tracing::warn!(advisory = %text, "unreadable MAX_DELIVERIES advisory");
            return;
        };
        let deliveries = json_num(&text, "deliveries").unwrap_or(0);
        let Some(part) = self
            .partitions
            .iter()
            .find(|p| p.tp.topic == stream && p.durable == durable)
        else {
            return;
        };
        let handle = {
            let mut inner = part.inner.lock();
            if inner.fetch.is_none() || inner.pending.contains_key(&seq) {
                // Not ours, or still held by the application (it may commit it yet).
                return;
            }
            inner.nacked.remove(&seq)
        };
        let raw = match part.stream.get_raw_message(seq).await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, %stream, seq, "cannot read a message to dead-letter");
                return;
            }
        };
        let (key, mut headers, ts) = convert::read_headers(Some(&raw.headers));
        let reason = format!(
            "delivered {deliveries} times without an ack (max_deliver={}, JetStream \
             MAX_DELIVERIES advisory of consumer '{durable}')",
            self.options.max_deliver
        );
        headers
            .set("onceflow-error", reason.into_bytes())
            .set("onceflow-error-kind", b"ONCEFLOW_MAX_DELIVER".to_vec())
            .set("onceflow-source-topic", stream.as_bytes().to_vec())
            .set(
                "onceflow-source-partition",
                part.tp.partition.to_string().into_bytes(),
            )
            .set(
                "onceflow-source-position",
                Position::Sequence(seq).to_string().into_bytes(),
            )
            .set("onceflow-attempts", deliveries.to_string().into_bytes());
        let record = Record {
            topic: dlq.clone(),
            key,
            payload: raw.payload.clone(),
            headers,
            timestamp: ts,
            idempotency_key: Some(format!("onceflow-dlq:{stream}:{durable}:{seq}")),
            ..Default::default()
        };
        let sent = match JetStreamProducer::new(self.shared.clone(), ProducerConfig::default()) {
            Ok(p) => p.send(record).await,
            Err(e) => Err(e),
        };
        match sent {
            Ok(_) => {
                tracing::info!(%stream, seq, %dlq, "dead-lettered after max_deliver");
                if let Some(m) = handle {
                    if let Err(e) = m.ack_with(AckKind::Term).await {
                        tracing::warn!(error = %e, %stream, seq, "cannot terminate a dead-lettered message");
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, %stream, seq, %dlq, "cannot dead-letter; keeping it");
                if let Some(m) = handle {
                    part.inner.lock().nacked.insert(seq, m);
                }
            }
        }
    }

    /// Starts fetching a partition this member now owns.
    async fn activate(&self, part: &Partition, revision: u64) -> Result<()> {
        let consumer = ensure_durable(
            &part.stream,
            &part.durable,
            &part.subject,
            &self.options,
            &part.start,
            false,
        )
        .await?;
        // Read before the first pull: what an earlier owner was given and may not have acked.
        let inherited_upto = consumer.cached_info().delivered.stream_sequence;
        let fetch = self.fetch(consumer);
        let old = {
            let mut inner = part.inner.lock();
            inner.owner_revision = Some(revision);
            inner.reset();
            inner.inherited_upto = inherited_upto;
            inner.fetch.replace(fetch)
        };
        if let Some(old) = old {
            old.shutdown().await;
        }
        Ok(())
    }

    /// Starts the fetch task of a partition's durable with this consumer's settings.
    fn fetch(&self, consumer: PullConsumer) -> Fetch {
        spawn_fetch(
            consumer,
            &self.options,
            self.shared.client.clone(),
            self.shared.js.clone(),
            self.notify.clone(),
            self.liveness.clone(),
        )
    }

    /// Stops fetching a partition; returns the owner revision and the messages delivered or
    /// fetched but not acked, in sequence order.
    async fn deactivate(&self, part: &Partition) -> (Option<u64>, Vec<jetstream::Message>) {
        let (rev, mut left, fetch) = {
            let mut inner = part.inner.lock();
            let left: Vec<jetstream::Message> =
                std::mem::take(&mut inner.pending).into_values().collect();
            inner.reset();
            (inner.owner_revision.take(), left, inner.fetch.take())
        };
        if let Some(f) = fetch {
            left.extend(f.shutdown().await);
        }
        (rev, left)
    }

    /// Naks (no delay) in order, so the next owner gets them at once and in order.
    async fn nak_all(messages: &[jetstream::Message]) {
        for m in messages {
            let _ = m.ack_with(AckKind::Nak(None)).await;
        }
    }

    /// Refreshes membership and moves partitions: revoked ones are committed (positions from the
    /// listener), stopped and released before others can take them; lost ones are dropped.
    async fn rebalance(&self, force: bool) -> Result<()> {
        {
            let last = self.last_refresh.lock();
            if !force && last.is_some_and(|t| t.elapsed() < self.refresh_every) {
                return Ok(());
            }
        }
        let Ok(_guard) = self.rebalancing.try_lock() else {
            return Ok(());
        };
        *self.last_refresh.lock() = Some(tokio::time::Instant::now());
        self.membership.heartbeat().await?;
        *self.liveness.last.lock() = Some(Instant::now());
        let live = self.membership.live_members().await?;
        let all: Vec<TopicPartition> = self.partitions.iter().map(|p| p.tp.clone()).collect();
        let desired = group::assignment_for(&all, &live, self.membership.member());
        let listener = self.listener.lock().clone();

        // Lost: someone took over a partition we thought ours (we missed the session timeout).
        let mut lost = Vec::new();
        for part in &self.partitions {
            let rev = part.inner.lock().owner_revision;
            if let Some(rev) = rev {
                match self.membership.owner(&part.tp).await? {
                    group::Owner::Me(r) if r == rev => {}
                    _ => {
                        let _ = self.deactivate(part).await;
                        lost.push(part.tp.clone());
                    }
                }
            }
        }
        if !lost.is_empty() {
            if let Some(l) = &listener {
                l.on_lost(&lost);
            }
        }

        // Revoked: commit what the listener says is finished, then give the partition up.
        let revoked: Vec<TopicPartition> = self
            .assignment()
            .into_iter()
            .filter(|tp| !desired.contains(tp))
            .collect();
        if !revoked.is_empty() {
            let positions = listener
                .as_ref()
                .map(|l| l.on_revoked(&revoked))
                .unwrap_or_default();
            if !positions.is_empty() {
                if let Err(e) = self.commit(&positions).await {
                    tracing::warn!(error = %e, "commit on revocation failed");
                }
            }
            for tp in &revoked {
                if let Some(part) = self.partitions.iter().find(|p| &p.tp == tp) {
                    let (rev, left) = self.deactivate(part).await;
                    Self::nak_all(&left).await;
                    if let Some(rev) = rev {
                        self.membership.release(tp, rev).await;
                    }
                }
            }
        }

        // Assigned: take what is ours and free (or owned by a dead member).
        let mut assigned = Vec::new();
        for part in &self.partitions {
            if !desired.contains(&part.tp) || part.inner.lock().fetch.is_some() {
                continue;
            }
            let revision = match self.membership.owner(&part.tp).await? {
                group::Owner::Nobody => self.membership.claim(&part.tp, None).await,
                group::Owner::Me(r) => Some(r),
                group::Owner::Other { member, revision } if !live.contains(&member) => {
                    self.membership.claim(&part.tp, Some(revision)).await
                }
                group::Owner::Other { .. } => None,
            };
            if let Some(rev) = revision {
                self.activate(part, rev).await?;
                assigned.push(part.tp.clone());
            }
        }
        if !assigned.is_empty() {
            if let Some(l) = &listener {
                l.on_assigned(&assigned);
            }
        }
        Ok(())
    }

    fn partition(&self, tp: &TopicPartition) -> Result<&Partition> {
        self.partitions
            .iter()
            .find(|p| &p.tp == tp && p.inner.lock().fetch.is_some())
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Fenced,
                    format!(
                        "partition {tp} is not assigned to this member of group '{}'",
                        self.group
                    ),
                )
            })
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::new(ErrorKind::Closed, "consumer is closed"));
        }
        Ok(())
    }

    /// Stream sequence of the next message the durable of `partition` resumes at (ack floor +
    /// 1), `None` when it has acked nothing or does not exist.
    async fn committed_of(&self, stream: &Stream, durable: &str) -> Result<Option<Position>> {
        match stream.consumer_info(durable).await {
            Ok(info) => Ok((info.ack_floor.stream_sequence > 0)
                .then(|| Position::Sequence(info.ack_floor.stream_sequence + 1))),
            Err(e) => {
                let err = nats_err(format!("consumer '{durable}'"), e);
                if err.kind() == ErrorKind::NotFound {
                    Ok(None)
                } else {
                    Err(err)
                }
            }
        }
    }
}

/// The lag of the durable `durable` on partition `tp` (subject `subject`) of `stream`, read
/// from its [consumer info](https://docs.nats.io/nats-concepts/jetstream/consumers) without
/// joining the group: `num_pending` (not delivered yet) + `num_ack_pending` (delivered, not
/// acked) messages, the committed position at its ack floor + 1, the end after the subject's
/// last message. `None` when the durable does not exist.
pub(crate) async fn durable_lag(
    stream: &Stream,
    tp: &TopicPartition,
    subject: &str,
    durable: &str,
) -> Result<Option<PartitionLag>> {
    let info = match stream.consumer_info(durable).await {
        Ok(info) => info,
        Err(e) => {
            let err = nats_err(format!("consumer '{durable}' of {tp}"), e);
            return if err.kind() == ErrorKind::NotFound {
                Ok(None)
            } else {
                Err(err)
            };
        }
    };
    Ok(Some(PartitionLag {
        partition: tp.clone(),
        committed: (info.ack_floor.stream_sequence > 0)
            .then(|| Position::Sequence(info.ack_floor.stream_sequence + 1)),
        high_watermark: end_of(stream, subject).await,
        messages: info.num_pending + info.num_ack_pending as u64,
        millis: None,
    }))
}

/// The position after the last message of `subject` (`None` when it has none).
pub(crate) async fn end_of(stream: &Stream, subject: &str) -> Option<Position> {
    stream
        .get_last_raw_message_by_subject(subject)
        .await
        .ok()
        .map(|m| Position::Sequence(m.sequence + 1))
}

/// The string value of `"field":"…"` in a flat JSON advisory (names here have no escapes).
fn json_str(json: &str, field: &str) -> Option<String> {
    let at = json.find(&format!("\"{field}\":"))? + field.len() + 3;
    let rest = json[at..].trim_start().strip_prefix('"')?;
    Some(rest[..rest.find('"')?].to_string())
}

/// The number value of `"field":N` in a flat JSON advisory.
pub(crate) fn json_num(json: &str, field: &str) -> Option<u64> {
    let at = json.find(&format!("\"{field}\":"))? + field.len() + 3;
    let rest = json[at..].trim_start();
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// The first message of `subject` at or after `seq`: (sequence, timestamp ms).
async fn next_at(stream: &Stream, subject: &str, seq: u64) -> Option<(u64, i64)> {
    let m = stream
        .raw_message_builder()
        .sequence(seq)
        .next_by_subject(subject.to_string())
        .send()
        .await
        .ok()?;
    let ts = convert::read_headers(Some(&m.headers))
        .2
        .unwrap_or((m.time.unix_timestamp_nanos() / 1_000_000) as i64);
    Some((m.sequence, ts))
}

/// The stream sequence of the first message of `subject` whose timestamp is at or after `t`
/// (binary search, assuming timestamps grow with the sequence); `None` when none is that late.
async fn sequence_at_time(stream: &Stream, subject: &str, t: i64) -> Result<Option<u64>> {
    let info = stream
        .get_info()
        .await
        .map_err(|e| nats_err(format!("stream info of '{subject}'"), e))?;
    let (mut lo, mut hi) = (
        info.state.first_sequence.max(1),
        info.state.last_sequence + 1,
    );
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        match next_at(stream, subject, mid).await {
            Some((seq, ts)) if seq < hi => {
                if ts >= t {
                    hi = mid;
                } else {
                    lo = seq + 1;
                }
            }
            _ => hi = mid,
        }
    }
    Ok(match next_at(stream, subject, lo).await {
        Some((seq, ts)) if ts >= t => Some(seq),
        _ => None,
    })
}

/// Replaces a timestamp start by the stream sequence it resolves to (or `Latest`).
async fn resolve_start(stream: &Stream, subject: &str, start: &StartFrom) -> Result<StartFrom> {
    Ok(match start {
        StartFrom::Timestamp(t) => match sequence_at_time(stream, subject, *t).await? {
            Some(seq) => StartFrom::Position(Position::Sequence(seq)),
            None => StartFrom::Latest,
        },
        StartFrom::Committed { fallback } => StartFrom::Committed {
            fallback: Box::new(Box::pin(resolve_start(stream, subject, fallback)).await?),
        },
        other => other.clone(),
    })
}

/// Gets the durable (resuming it) or creates it.
///
/// - A durable that exists is resumed at its ack floor, whatever `start` says, unless `reset`
///   is set and `start` is explicit (not `Committed`): then it is deleted and created again
///   with the deliver policy of `start` (JetStream cannot change a durable's deliver policy,
///   <https://docs.nats.io/nats-concepts/jetstream/consumers#deliverpolicy>). An explicit start
///   that does not reset an existing durable is logged as a warning.
/// - A durable resumed with settings other than the requested ones (`ack_wait`,
///   `max_deliver`, `max_ack_pending`, `backoff` where they were given — a setting left at its
///   default keeps the durable's value —, the filter subject) is updated in place
///   (consumer update, nats-server ≥ 2.10,
///   <https://docs.nats.io/nats-concepts/jetstream/consumers#configuration>); a server that
///   refuses is a `Config` error naming each setting, the durable's value and the requested
///   one. The old settings are never kept silently.
async fn ensure_durable(
    stream: &Stream,
    durable: &str,
    subject: &str,
    options: &JetStreamOptions,
    start: &StartFrom,
    reset: bool,
) -> Result<PullConsumer> {
    let config = PullConfig {
        durable_name: Some(durable.to_string()),
        filter_subject: subject.to_string(),
        ack_policy: AckPolicy::Explicit,
        ack_wait: options.ack_wait,
        max_deliver: options.max_deliver,
        max_ack_pending: options.max_ack_pending,
        backoff: options.backoff.clone(),
        deliver_policy: deliver_policy(start)?,
        ..Default::default()
    };
    let explicit = !matches!(start, StartFrom::Committed { .. });
    match stream.get_consumer::<PullConfig>(durable).await {
        Ok(c) if explicit && reset => {
            tracing::info!(durable, start = ?start, "reset: deleting the durable to create it again at the explicit start");
            drop(c);
            if let Err(e) = stream.delete_consumer(durable).await {
                let err = nats_err(format!("deleting consumer '{durable}'"), e);
                if err.kind() != ErrorKind::NotFound {
                    return Err(err);
                }
            }
        }
        Ok(c) => {
            if explicit {
                tracing::warn!(
                    durable,
                    start = ?start,
                    "consumer '{durable}' exists: resuming it at its ack floor; the explicit \
                     start applies to a new durable only (give the consumer option reset=true \
                     to delete it and start over)"
                );
            }
            return reconcile(stream, c, &config, &options.durable_settings_given).await;
        }
        Err(e) => {
            let err = nats_err(format!("consumer '{durable}'"), e);
            if err.kind() != ErrorKind::NotFound {
                return Err(err);
            }
        }
    }
    match stream.create_consumer(config.clone()).await {
        Ok(c) => Ok(c),
        // Another member created it at the same time: use theirs.
        Err(e) => match stream.get_consumer::<PullConfig>(durable).await {
            Ok(c) => reconcile(stream, c, &config, &options.durable_settings_given).await,
            Err(_) => Err(nats_err(format!("creating consumer '{durable}'"), e)),
        },
    }
}

/// The settings of `have` that differ from `want`: (name, durable's value, requested value).
fn config_diff(have: &PullConfig, want: &PullConfig) -> Vec<(&'static str, String, String)> {
    let ms = |d: Duration| format!("{} ms", d.as_millis());
    let list = |b: &[Duration]| {
        let v: Vec<String> = b.iter().map(|d| d.as_millis().to_string()).collect();
        format!("[{}] ms", v.join(","))
    };
    let mut out = Vec::new();
    // With a backoff the server takes its first step as ack_wait.
    let want_wait = want.backoff.first().copied().unwrap_or(want.ack_wait);
    if have.ack_wait != want.ack_wait && have.ack_wait != want_wait {
        out.push(("ack_wait", ms(have.ack_wait), ms(want.ack_wait)));
    }
    if have.max_deliver != want.max_deliver {
        out.push((
            "max_deliver",
            have.max_deliver.to_string(),
            want.max_deliver.to_string(),
        ));
    }
    if have.max_ack_pending != want.max_ack_pending {
        out.push((
            "max_ack_pending",
            have.max_ack_pending.to_string(),
            want.max_ack_pending.to_string(),
        ));
    }
    if have.backoff != want.backoff {
        out.push(("backoff", list(&have.backoff), list(&want.backoff)));
    }
    if have.filter_subject != want.filter_subject {
        out.push((
            "filter_subject",
            have.filter_subject.clone(),
            want.filter_subject.clone(),
        ));
    }
    out
}

/// Brings an existing durable to the requested settings: a consumer update (its deliver
/// policy and start kept), or a `Config` error naming what the server would not change.
async fn reconcile(
    stream: &Stream,
    mut consumer: PullConsumer,
    want: &PullConfig,
    given: &[&str],
) -> Result<PullConsumer> {
    let have = consumer.cached_info().config.clone();
    let have = PullConfig {
        durable_name: have.durable_name,
        name: have.name,
        description: have.description,
        deliver_policy: have.deliver_policy,
        ack_policy: have.ack_policy,
        ack_wait: have.ack_wait,
        max_deliver: have.max_deliver,
        filter_subject: have.filter_subject,
        filter_subjects: have.filter_subjects,
        replay_policy: have.replay_policy,
        rate_limit: have.rate_limit,
        sample_frequency: have.sample_frequency,
        max_waiting: have.max_waiting,
        max_ack_pending: have.max_ack_pending,
        headers_only: have.headers_only,
        max_batch: have.max_batch,
        max_bytes: have.max_bytes,
        max_expires: have.max_expires,
        inactive_threshold: have.inactive_threshold,
        num_replicas: have.num_replicas,
        memory_storage: have.memory_storage,
        metadata: have.metadata,
        backoff: have.backoff,
        ..Default::default()
    };
    // Settings not given keep the durable's values: another member (or the application
    // that made the durable) chose them, and defaults must not overwrite them.
    let want = &PullConfig {
        ack_wait: if given.contains(&"ack_wait_ms") {
            want.ack_wait
        } else {
            have.ack_wait
        },
        max_deliver: if given.contains(&"max_deliver") {
            want.max_deliver
        } else {
            have.max_deliver
        },
        max_ack_pending: if given.contains(&"max_ack_pending") {
            want.max_ack_pending
        } else {
            have.max_ack_pending
        },
        backoff: if given.contains(&"backoff_ms") {
            want.backoff.clone()
        } else {
            have.backoff.clone()
        },
        ..want.clone()
    };
    let diff = config_diff(&have, want);
    if diff.is_empty() {
        return Ok(consumer);
    }
    let name = have.durable_name.clone().unwrap_or_default();
    let update = PullConfig {
        ack_wait: want.ack_wait,
        max_deliver: want.max_deliver,
        max_ack_pending: want.max_ack_pending,
        backoff: want.backoff.clone(),
        filter_subject: want.filter_subject.clone(),
        ..have
    };
    let shown: Vec<String> = diff
        .iter()
        .map(|(k, have, want)| format!("{k}: the durable has {have}, requested {want}"))
        .collect();
    match stream.update_consumer(update).await {
        Ok(c) => {
            tracing::info!(durable = %name, changes = %shown.join("; "), "updated the durable's settings");
            consumer = c;
            Ok(consumer)
        }
        Err(e) => Err(Error::config(format!(
            "consumer '{name}' of stream '{}' exists with other settings and the server refused \
             to update it ({e}): {}; reopen it with its settings, or give the consumer option \
             reset=true with an explicit start to delete and create it again",
            stream.cached_info().config.name,
            shown.join("; ")
        ))
        .with_source(e)),
    }
}

/// How often delivered messages not yet acknowledged get `+WPI`: a fifth of the shortest
/// ack deadline (the consumer's `ack_wait`, or its shortest `backoff` step, which the server
/// uses instead: <https://docs.nats.io/nats-concepts/jetstream/consumers#backoff>). A message is
/// signalled at most two periods after it was fetched or last signalled while it waits to be
/// polled, and two periods after it was polled while it is pending, so within four fifths of
/// the deadline.
fn keepalive_period(options: &JetStreamOptions) -> Duration {
    (ack_deadline(options) / 5).max(Duration::from_millis(10))
}

/// How long a pull request in flight may go without a word from the server before it is
/// taken for dead (its server restarted or hangs, or its connection died silently) and made
/// again:
/// - with an idle heartbeat, two heartbeats (at least 500 ms) since the server last sent it
///   anything. The server sends a heartbeat whenever the request has waited that long without
///   a message, until it ends the request with a status (408 at its expiry) or its last
///   message, so a request that hears nothing for two has lost its server, whatever its
///   expiry ([ADR-37](https://github.com/nats-io/nats-architecture-and-design/blob/main/adr/ADR-37.md)).
///   The floor keeps a busy connection's late heartbeat from being taken for a dead server:
///   messages still sent to a request given up come back only after `ack_wait`.
/// - without, 5 s after the request's expiry (what async-nats' own batch waits): until its
///   expiry the server says nothing to a request it has no message for.
fn request_grace(heartbeat: Option<Duration>) -> Duration {
    match heartbeat {
        Some(hb) => (hb * 2).max(Duration::from_millis(500)),
        None => Duration::from_secs(5),
    }
}

/// What the server sent a pull request's inbox.
enum Reply {
    /// A message of the stream.
    Message(Box<jetstream::Message>),
    /// `100 Idle Heartbeat`: the request waits, the server is alive.
    Heartbeat,
    /// A status that ends the request: `408 Request Timeout` (its expiry) or `404 No
    /// Messages` with `None`, anything else (409 consumer deleted or leadership change, 503 no
    /// responders while JetStream recovers, ...) with its code and description.
    End(Option<String>),
}

impl Reply {
    fn of(m: async_nats::Message, js: &jetstream::Context) -> Reply {
        use async_nats::StatusCode;
        match m.status {
            None | Some(StatusCode::OK) => Reply::Message(Box::new(jetstream::Message {
                message: m,
                context: js.clone(),
            })),
            Some(StatusCode::IDLE_HEARTBEAT) => Reply::Heartbeat,
            Some(StatusCode::TIMEOUT | StatusCode::NOT_FOUND) => Reply::End(None),
            Some(status) => Reply::End(Some(format!(
                "{status} {}",
                m.description.as_deref().unwrap_or_default()
            ))),
        }
    }
}

/// Sends one pull request for up to `batch` messages, expiring after `expires`, with the idle
/// heartbeat if any, to a new inbox; the inbox's subscription (unsubscribed when dropped).
///
/// The replies are read here rather than through async-nats' `Batch`: that stream swallows an
/// idle heartbeat without asking to be woken for the next reply, so once a heartbeat came,
/// the rest of the request (its messages, its 408) was read only when something else woke
/// the task.
async fn pull_request(
    client: &async_nats::Client,
    consumer: &PullConsumer,
    batch: usize,
    expires: Duration,
    heartbeat: Option<Duration>,
) -> std::result::Result<async_nats::Subscriber, async_nats::Error> {
    let inbox = async_nats::Subject::from(client.new_inbox());
    let sub = client.subscribe(inbox.clone()).await?;
    let request = async_nats::jetstream::consumer::pull::BatchConfig {
        batch,
        expires: Some(expires),
        idle_heartbeat: heartbeat.unwrap_or_default(),
        ..Default::default()
    };
    consumer.request_batch(request, inbox).await?;
    Ok(sub)
}

/// The shortest ack deadline the server may give a delivered message: the consumer's
/// `ack_wait`, or its shortest `backoff` step, which the server uses instead
/// (<https://docs.nats.io/nats-concepts/jetstream/consumers#backoff>).
fn ack_deadline(options: &JetStreamOptions) -> Duration {
    options
        .backoff
        .iter()
        .copied()
        .fold(options.ack_wait, Duration::min)
}

/// Starts the task that pulls from `consumer` into a bounded channel: one pull request at a
/// time ([pull consumers](https://docs.nats.io/using-nats/developer/develop_jetstream/consumers#pull-consumers)),
/// up to `fetch_batch` messages, expiring after `pull_expires_ms`. A request ends with the
/// server's status (408 at its expiry) or its last message; one that heard nothing from the
/// server for [`request_grace`] (with `idle_heartbeat_ms`; without, that long after its expiry)
/// died with its server or connection and is given up (said once until the server answers
/// again), and the next one is made once the client is connected. A request's messages are read
/// as they arrive (into `waiting` while the channel is full), so that every message the server
/// delivered and `poll` has not taken yet is known to the task, which sends `+WPI` for those
/// waiting a [`keepalive_period`] or longer: a slow handler does not make the prefetched
/// messages expire and come back (each redelivery counts toward `max_deliver`). On stop the
/// task lets the request in flight end before it returns, so the server has no request of ours
/// left when the caller naks what was fetched (a nak'd message sent to a request nobody listens
/// to would come back out of order, or only after `ack_wait`).
fn spawn_fetch(
    consumer: PullConsumer,
    options: &JetStreamOptions,
    client: async_nats::Client,
    js: jetstream::Context,
    notify: Arc<Notify>,
    liveness: Liveness,
) -> Fetch {
    let batch = options.fetch_batch;
    let expires = options.pull_expires;
    let heartbeat = options.idle_heartbeat;
    let grace = request_grace(heartbeat);
    let period = keepalive_period(options);
    let (stream_name, durable) = {
        let info = consumer.cached_info();
        (info.stream_name.clone(), info.name.clone())
    };
    let (tx, rx) = mpsc::channel(batch);
    let (stop, mut stop_rx) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let mut stopping = false;
        // Read from the request, not in the channel yet (the channel was full), with when each
        // was fetched or last signalled.
        let mut waiting: VecDeque<(jetstream::Message, Instant)> = VecDeque::new();
        // Ack subjects of what went into the channel, newest last, with when each went in or was
        // last signalled; the last `batch - tx.capacity()` of them are still in the channel.
        let mut sent: VecDeque<(async_nats::Subject, Instant)> = VecDeque::new();
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The server stopped answering (a request given up, or one that could not be made):
        // said once, until it answers again.
        let mut unanswered = false;
        while !stopping {
            if liveness.stale()
                || client.connection_state() != async_nats::connection::State::Connected
            {
                // Presumed dead by the group: no pull (the new owner's requests get the
                // messages), and no in-progress signals for what is waiting. Disconnected: a
                // request would wait in the client's buffer and reach the server after the
                // reconnection, next to the one made then.
                tokio::select! {
                    _ = &mut stop_rx => return waiting.into_iter().map(|(m, _)| m).collect(),
                    _ = tokio::time::sleep(Duration::from_millis(50)) => continue,
                }
            }
            let mut replies = match pull_request(&client, &consumer, batch, expires, heartbeat)
                .await
            {
                Ok(sub) => sub,
                Err(e) => {
                    if !std::mem::replace(&mut unanswered, true) {
                        tracing::warn!(error = %e, stream = %stream_name, durable = %durable, "cannot pull; retrying");
                    } else {
                        tracing::debug!(error = %e, stream = %stream_name, durable = %durable, "cannot pull; retrying");
                    }
                    tokio::select! {
                        _ = &mut stop_rx => return waiting.into_iter().map(|(m, _)| m).collect(),
                        _ = tokio::time::sleep(Duration::from_millis(250)) => continue,
                    }
                }
            };
            let mut ended = false;
            // Ended by a status other than the expiry's: wait a little before the next request
            // (a deleted durable answers every request at once).
            let mut refused = false;
            let mut received = 0usize;
            // When the request is taken for dead: `grace` after the server's last word with a
            // heartbeat (pushed back by every reply), `grace` after the expiry without.
            let silent_after = match heartbeat {
                Some(_) => grace,
                None => expires + grace,
            };
            let given_up = tokio::time::sleep(silent_after);
            tokio::pin!(given_up);
            while !ended || (!waiting.is_empty() && !stopping) {
                tokio::select! {
                    biased;
                    _ = &mut stop_rx, if !stopping => stopping = true,
                    permit = tx.reserve(), if !waiting.is_empty() && !stopping => match permit {
                        Ok(p) => {
                            let (m, at) = waiting.pop_front().expect("waiting is not empty");
                            if let Some(reply) = m.reply.clone() {
                                sent.push_back((reply, at));
                            }
                            p.send(m);
                            notify.notify_one();
                        }
                        Err(_) => stopping = true,
                    },
                    // Before the give-up timer: a reply already here is read, not taken for
                    // silence.
                    m = replies.next(), if !ended => {
                        let Some(m) = m else {
                            ended = true;
                            continue;
                        };
                        if std::mem::take(&mut unanswered) {
                            tracing::info!(stream = %stream_name, durable = %durable, "the server answers pull requests again");
                        }
                        if heartbeat.is_some() {
                            given_up
                                .as_mut()
                                .reset(tokio::time::Instant::now() + grace);
                        }
                        match Reply::of(m, &js) {
                            Reply::Message(m) => {
                                waiting.push_back((*m, Instant::now()));
                                received += 1;
                                // The request is complete: the server forgets it.
                                ended = received >= batch;
                            }
                            Reply::Heartbeat => {}
                            Reply::End(None) => ended = true,
                            Reply::End(Some(status)) => {
                                tracing::debug!(%status, stream = %stream_name, durable = %durable, "pull request ended by the server");
                                ended = true;
                                refused = true;
                            }
                        }
                    }
                    _ = &mut given_up, if !ended => {
                        let now = tokio::time::Instant::now();
                        if now > given_up.deadline() + Duration::from_millis(100) {
                            // The timer itself is late: this process stalled (a blocked
                            // runtime), not the server; what it sent meanwhile may not have
                            // been read yet. Listen a grace more.
                            given_up.as_mut().reset(now + grace);
                            continue;
                        }
                        let first = !std::mem::replace(&mut unanswered, true);
                        let grace_ms = grace.as_millis() as u64;
                        let expires_ms = expires.as_millis() as u64;
                        match (heartbeat, first) {
                            (Some(hb), true) => tracing::warn!(
                                stream = %stream_name, durable = %durable, grace_ms,
                                heartbeat_ms = hb.as_millis() as u64,
                                "pull request missed its idle heartbeats: nothing from the \
                                 server for {grace_ms} ms (it restarted or hangs, or the \
                                 connection is gone); pulling again"
                            ),
                            (None, true) => tracing::warn!(
                                stream = %stream_name, durable = %durable, expires_ms, grace_ms,
                                "pull request not ended by the server {grace_ms} ms after its \
                                 expiry (it restarted or hangs, or the connection is gone); \
                                 pulling again"
                            ),
                            (_, false) => tracing::debug!(
                                stream = %stream_name, durable = %durable,
                                "pull request unanswered again; pulling again"
                            ),
                        }
                        ended = true;
                    }
                    _ = ticker.tick(), if !liveness.stale() => {
                        let in_channel = batch.saturating_sub(tx.capacity());
                        let polled = sent.len().saturating_sub(in_channel);
                        sent.drain(..polled);
                        let now = Instant::now();
                        let mut due = Vec::new();
                        for (reply, at) in sent.iter_mut() {
                            if now.duration_since(*at) >= period {
                                *at = now;
                                due.push(reply.clone());
                            }
                        }
                        for (m, at) in waiting.iter_mut() {
                            if now.duration_since(*at) >= period {
                                *at = now;
                                if let Some(reply) = &m.reply {
                                    due.push(reply.clone());
                                }
                            }
                        }
                        for reply in due {
                            if let Err(e) = client.publish(reply, AckKind::Progress.into()).await {
                                tracing::debug!(error = %e, "in-progress signal failed; the server may redeliver after ack_wait");
                            }
                        }
                    }
                }
            }
            drop(replies);
            if refused && !stopping {
                tokio::select! {
                    _ = &mut stop_rx => stopping = true,
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
            }
        }
        waiting.into_iter().map(|(m, _)| m).collect()
    });
    Fetch {
        stop_within: expires + grace + Duration::from_secs(1),
        rx,
        task,
        stop,
    }
}

/// `+ACK` as a request ([AckSync][ack]): `Ok` once the server confirmed it. Unlike
/// async-nats' `double_ack`, which takes any reply for a confirmation, the server's 503 (no
/// responders: the durable is gone) is an error here.
///
/// [ack]: https://docs.nats.io/using-nats/developer/develop_jetstream/consumers#delivery-reliability
async fn confirmed_ack(
    client: &async_nats::Client,
    m: &jetstream::Message,
    timeout: Duration,
) -> std::result::Result<(), async_nats::Error> {
    let reply = m
        .reply
        .clone()
        .ok_or("no reply subject: not a JetStream message")?;
    let request = async_nats::Request::new()
        .payload(bytes::Bytes::from_static(b"+ACK"))
        .timeout(Some(timeout));
    client.send_request(reply, request).await?;
    Ok(())
}

/// Acks one partition's messages (in sequence order) and confirms them with one request: a
/// plain `+ACK` for each but the last, then `+ACK` as a request ([`confirmed_ack`]) for the
/// last; one result per message, in order.
///
/// The server's reply to the last ack confirms the earlier ones too: they went out before it on
/// the same connection, NATS delivers one publisher's messages in the order sent
/// (<https://docs.nats.io/reference/faq#does-nats-guarantee-message-ordering>) and the durable
/// handles its acks in the order received (measured on nats-server 2.14.6: right after the
/// reply to the last of 5 000 acks the ack floor is at the last and nothing is ack-pending). One
/// round trip per partition and commit instead of one reply per message: a commit of 10 000
/// messages took 1–1.7 s of confirmations, during which the engine polled nothing (issue 24,
/// PY3). When the client reconnected while the plain acks were on their way (some may have
/// been lost with the old connection) or one could not be queued, every message is confirmed
/// by its own request, as when the last one's confirmation fails: then none counts as acked
/// (acking an acked message again is answered like the first ack, so a retry is harmless).
async fn ack_in_order(
    client: &async_nats::Client,
    msgs: &[(u64, jetstream::Message)],
    timeout: Duration,
) -> Vec<std::result::Result<(), async_nats::Error>> {
    let each =
        || futures::future::join_all(msgs.iter().map(|(_, m)| confirmed_ack(client, m, timeout)));
    let Some(((_, last), rest)) = msgs.split_last() else {
        return Vec::new();
    };
    if rest.is_empty() || rest.iter().any(|(_, m)| m.reply.is_none()) {
        return each().await;
    }
    let stats = client.statistics();
    let connects = stats.connects.load(Ordering::Relaxed);
    for (_, m) in rest {
        let reply = m.reply.clone().expect("checked above");
        if client
            .publish(reply, bytes::Bytes::from_static(b"+ACK"))
            .await
            .is_err()
        {
            return each().await;
        }
    }
    match confirmed_ack(client, last, timeout).await {
        Ok(()) if stats.connects.load(Ordering::Relaxed) == connects => {
            msgs.iter().map(|_| Ok(())).collect()
        }
        // Reconnected meanwhile: the plain acks may not have reached the server.
        Ok(()) => each().await,
        Err(e) => {
            let text = e.to_string();
            let mut out: Vec<std::result::Result<(), async_nats::Error>> =
                rest.iter().map(|_| Err(text.clone().into())).collect();
            out.push(Err(e));
            out
        }
    }
}

fn ack_err(what: &str, tp: &TopicPartition, seq: u64, e: async_nats::Error) -> Error {
    let text = e.to_string();
    if text.to_lowercase().contains("no responders") {
        // Nobody answered the ack: the durable is gone (deleted, or reset by another member).
        return Error::new(
            ErrorKind::Fenced,
            format!(
                "{what} of {tp} seq:{seq}: no server answered the ack ({text}): the partition's \
                 durable is gone (deleted, or reset by another member)"
            ),
        )
        .with_source_box(e);
    }
    let kind = if text.to_lowercase().contains("timed out") {
        ErrorKind::Timeout
    } else {
        ErrorKind::Platform
    };
    Error::new(kind, format!("{what} of {tp} seq:{seq}: {text}"))
        .with_source_box(e)
        .retriable(true)
}

#[async_trait]
impl ConsumerBackend for JetStreamConsumer {
    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn set_rebalance_listener(&self, listener: Arc<dyn RebalanceListener>) {
        *self.listener.lock() = Some(listener);
    }

    async fn poll(&self, max: usize, timeout: Duration) -> Result<Vec<Message>> {
        self.check_open()?;
        let deadline = tokio::time::Instant::now() + timeout;
        let k = self.partitions.len();
        let mut out = Vec::new();
        let mut reack: Vec<jetstream::Message> = Vec::new();
        loop {
            if let Err(e) = self.rebalance(false).await {
                // A server hiccup must not stop the consumer: keep what it owns, retry at the
                // next refresh (a member that stays cut off loses its partitions by timeout).
                tracing::warn!(error = %e, group = %self.group, "group refresh failed; retrying");
            }
            if k > 0 {
                let start = self.rotate.fetch_add(1, Ordering::Relaxed) % k;
                for j in 0..k {
                    let part = &self.partitions[(start + j) % k];
                    let mut guard = part.inner.lock();
                    let inner = &mut *guard;
                    if inner.paused {
                        continue;
                    }
                    let run_start = out.len();
                    while out.len() < max {
                        let Some(fetch) = inner.fetch.as_mut() else {
                            break;
                        };
                        match fetch.rx.try_recv() {
                            Ok(m) => {
                                let msg = convert::message(&part.tp.topic, &m)?;
                                if let Position::Sequence(s) = msg.position {
                                    match inner.admit(s, &m) {
                                        Admit::New => {}
                                        Admit::Held => continue,
                                        Admit::Committed => {
                                            reack.push(m);
                                            continue;
                                        }
                                    }
                                    inner.pending.insert(s, m);
                                    inner.deadlines.insert(
                                        s,
                                        Deadline {
                                            at: Instant::now() + ack_deadline(&self.options),
                                            redelivered: false,
                                        },
                                    );
                                }
                                out.push(msg);
                            }
                            Err(_) => break,
                        }
                    }
                    // In stream order: the server redelivers a message whose `ack_wait` expired
                    // (one an earlier owner held unacked) behind newer ones already fetched.
                    out[run_start..].sort_by_key(|m| m.position.as_sequence());
                    if out.len() >= max {
                        break;
                    }
                }
            }
            if !reack.is_empty() {
                let msgs = std::mem::take(&mut reack);
                tokio::spawn(async move {
                    for m in msgs {
                        if let Err(e) = m.ack().await {
                            tracing::debug!(error = %e, "re-ack of a committed message failed; the server redelivers it again");
                        }
                    }
                });
            }
            let now = tokio::time::Instant::now();
            if !out.is_empty() || now >= deadline {
                return Ok(out);
            }
            let wait = (deadline - now).min(self.refresh_every);
            let _ = tokio::time::timeout(wait, self.notify.notified()).await;
        }
    }

    /// Acks every message of the partition delivered by `poll` up to the position and not
    /// nacked, confirmed by the server with one double ack
    /// ([`AckSync`](https://docs.nats.io/using-nats/developer/develop_jetstream/consumers#delivery-reliability))
    /// of the last, sent behind the others (see `ack_in_order`: one round trip per partition,
    /// each message confirmed on its own after a reconnection or a failure).
    ///
    /// The server confirms an ack of any delivery of a message it still tracks, however late
    /// (measured on nats-server 2.14: an ack of an expired or already redelivered delivery is
    /// answered like a timely one and moves the ack floor), so lateness is found here:
    /// - **`Fenced`** (nothing acked): the group's owner entry of the partition
    ///   ([`crate::GROUPS_BUCKET`]) no longer names this member's claim: another member took
    ///   it over (this one missed its session timeout) and handles these messages. The next
    ///   poll drops the partition (`on_lost`). The entry is read only when this member's last
    ///   heartbeat is older than half the session timeout (with a younger one nobody can
    ///   have taken over), so a member that polls commits without the extra request. Also `Fenced`: the durable is gone (deleted,
    ///   or reset by another member), the ack had nobody to answer it.
    /// - **`Timeout`**, retriable (acked): a message's ack deadline (`ack_wait`, or the
    ///   shortest `backoff` step) ran out before its ack without an in-progress signal (the
    ///   process or its runtime stalled), or the server delivered it again while it was held:
    ///   the server may have delivered it again, and each delivery counts toward
    ///   `max_deliver`. The error names the sequences; a retry of the commit is a no-op.
    async fn commit(&self, positions: &[(TopicPartition, Position)]) -> Result<()> {
        self.check_open()?;
        let mut first_err = None;
        let mut late_err = None;
        for (tp, pos) in positions {
            let part = self.partition(tp)?;
            let seq = pos.as_sequence().ok_or_else(|| {
                Error::config(format!(
                    "position {pos} of {tp} is not a JetStream position: expected seq:N"
                ))
            })?;
            // Still ours? Another member takes a partition over only from a member whose
            // heartbeat is older than the session timeout, so with a heartbeat younger than
            // half of it the claim stands; otherwise the group bucket says (a member that
            // stalled has not heard yet that another took the partition).
            let claim = part.inner.lock().owner_revision;
            let owner = if self.liveness.recent(self.session / 2) {
                group::Owner::Me(claim.unwrap_or_default())
            } else {
                self.membership.owner(tp).await?
            };
            match owner {
                group::Owner::Me(r) if Some(r) == claim => {}
                other => {
                    // The next poll refreshes the group at once and drops the partition.
                    *self.last_refresh.lock() = None;
                    let now = match other {
                        group::Owner::Other { member, .. } => format!("member '{member}'"),
                        group::Owner::Nobody => "nobody".to_string(),
                        group::Owner::Me(_) => "a newer claim of this member".to_string(),
                    };
                    return Err(Error::new(
                        ErrorKind::Fenced,
                        format!(
                            "commit of {tp} up to {pos} refused: this member of group '{}' lost \
                             the partition (now owned by {now}; it missed its session timeout \
                             of {} ms), its messages are another member's now; nothing acked",
                            self.group,
                            self.session.as_millis()
                        ),
                    ));
                }
            }
            let (msgs, deadlines): (Vec<(u64, jetstream::Message)>, Vec<Option<Deadline>>) = {
                let mut inner = part.inner.lock();
                let rest = inner.pending.split_off(&(seq + 1));
                let taken = std::mem::replace(&mut inner.pending, rest);
                let deadlines = taken.keys().map(|s| inner.deadlines.remove(s)).collect();
                (taken.into_iter().collect(), deadlines)
            };
            let sent = Instant::now();
            let client = &self.shared.client;
            let wait = self.options.request_timeout;
            let results = ack_in_order(client, &msgs, wait).await;
            let mut failed = Vec::new();
            let mut late = Vec::new();
            for (((s, m), r), d) in msgs.into_iter().zip(results).zip(deadlines) {
                match r {
                    Err(e) => {
                        if first_err.is_none() {
                            first_err = Some(ack_err("commit (double ack)", tp, s, e));
                        }
                        failed.push((s, m, d));
                    }
                    Ok(()) => {
                        if let Some(d) = d.filter(|d| d.redelivered || sent > d.at) {
                            late.push((s, d));
                        }
                    }
                }
            }
            if !failed.is_empty() {
                let mut inner = part.inner.lock();
                for (s, m, d) in failed {
                    inner.pending.entry(s).or_insert(m);
                    if let Some(d) = d {
                        inner.deadlines.entry(s).or_insert(d);
                    }
                }
            }
            if !late.is_empty() && late_err.is_none() {
                let shown: Vec<String> = late
                    .iter()
                    .take(10)
                    .map(|(s, d)| {
                        if d.redelivered {
                            format!("seq:{s} (delivered again while held)")
                        } else {
                            format!(
                                "seq:{s} ({} ms after its deadline)",
                                sent.duration_since(d.at).as_millis()
                            )
                        }
                    })
                    .collect();
                late_err = Some(
                    Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "commit of {tp} up to {pos}: acked, but {} message(s) were acked \
                             after their ack deadline ({} ms, ack_wait or the shortest backoff \
                             step) or after the server delivered them again: {}{}; the server \
                             may have delivered them again (each delivery counts toward \
                             max_deliver)",
                            late.len(),
                            ack_deadline(&self.options).as_millis(),
                            shown.join(", "),
                            if late.len() > 10 { ", …" } else { "" }
                        ),
                    )
                    .retriable(true),
                );
            }
        }
        match first_err.or(late_err) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    async fn committed(
        &self,
        partitions: &[TopicPartition],
    ) -> Result<Vec<(TopicPartition, Option<Position>)>> {
        let mut out = Vec::with_capacity(partitions.len());
        for tp in partitions {
            let pos = match self.partitions.iter().find(|p| &p.tp == tp) {
                Some(p) => self.committed_of(&p.stream, &p.durable).await?,
                None => match self.shared.get_stream(&tp.topic).await {
                    Ok(s) => {
                        self.committed_of(&s, &naming::durable(&self.group, tp.partition))
                            .await?
                    }
                    Err(e) if e.kind() == ErrorKind::NotFound => None,
                    Err(e) => return Err(e),
                },
            };
            out.push((tp.clone(), pos));
        }
        Ok(out)
    }

    /// Recreates the partition's durable with the deliver policy of `to` (JetStream cannot
    /// move a durable); `Committed` resumes at the durable's ack floor + 1.
    async fn seek(&self, partition: &TopicPartition, to: &StartFrom) -> Result<()> {
        self.check_open()?;
        let part = self.partition(partition)?;
        let target = match to {
            StartFrom::Committed { fallback } => {
                match self.committed_of(&part.stream, &part.durable).await? {
                    Some(p) => StartFrom::Position(p),
                    None => (**fallback).clone(),
                }
            }
            other => other.clone(),
        };
        let target = resolve_start(&part.stream, &part.subject, &target).await?;
        // Validate before touching the durable.
        deliver_policy(&target)?;
        let target = match target {
            StartFrom::Committed { .. } => StartFrom::Earliest,
            t => t,
        };
        let old = part.inner.lock().fetch.take();
        if let Some(f) = old {
            f.shutdown().await;
        }
        let consumer = ensure_durable(
            &part.stream,
            &part.durable,
            &part.subject,
            &self.options,
            &target,
            true,
        )
        .await?;
        let fetch = self.fetch(consumer);
        let old = {
            let mut inner = part.inner.lock();
            inner.reset();
            inner.fetch.replace(fetch)
        };
        if let Some(old) = old {
            old.shutdown().await;
        }
        Ok(())
    }

    async fn pause(&self, partitions: &[TopicPartition]) -> Result<()> {
        for tp in partitions {
            self.partition(tp)?.inner.lock().paused = true;
        }
        Ok(())
    }

    async fn resume(&self, partitions: &[TopicPartition]) -> Result<()> {
        for tp in partitions {
            self.partition(tp)?.inner.lock().paused = false;
        }
        self.notify.notify_one();
        Ok(())
    }

    fn assignment(&self) -> Vec<TopicPartition> {
        if self.closed.load(Ordering::Acquire) {
            return Vec::new();
        }
        self.partitions
            .iter()
            .filter(|p| p.inner.lock().fetch.is_some())
            .map(|p| p.tp.clone())
            .collect()
    }

    /// `num_pending + num_ack_pending` of each assigned partition's durable
    /// (<https://docs.nats.io/nats-concepts/jetstream/consumers>), as `group_lag` reads it.
    async fn lag(&self) -> Result<Vec<PartitionLag>> {
        let mut out = Vec::with_capacity(self.partitions.len());
        for p in self
            .partitions
            .iter()
            .filter(|p| p.inner.lock().fetch.is_some())
        {
            let lag = durable_lag(&p.stream, &p.tp, &p.subject, &p.durable)
                .await?
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::NotFound,
                        format!(
                            "consumer '{}' of {} is gone (deleted, or reset by another member)",
                            p.durable, p.tp
                        ),
                    )
                })?;
            out.push(lag);
        }
        Ok(out)
    }

    fn group_metadata(&self) -> Option<GroupMetadata> {
        Some(GroupMetadata {
            group: self.group.clone(),
            generation: 0,
            member_id: self.membership.member().to_string(),
            native: None,
        })
    }

    /// `-NAK` with the delay ([ADR-15](https://github.com/nats-io/nats-architecture-and-design/blob/main/adr/ADR-15.md)).
    async fn nack(&self, message: &Message, delay: Duration) -> Result<()> {
        self.check_open()?;
        let Ok(part) = self.partition(&message.topic_partition()) else {
            // Moved away: not acked, so the new owner gets it anyway.
            return Ok(());
        };
        let seq = message.position.as_sequence().ok_or_else(|| {
            Error::config(format!(
                "position {} is not a JetStream position: expected seq:N",
                message.position
            ))
        })?;
        let m = {
            let mut inner = part.inner.lock();
            let m = inner.pending.remove(&seq);
            inner.deadlines.remove(&seq);
            if let Some(m) = &m {
                inner.nacked.insert(seq, m.clone());
            }
            m
        };
        match m {
            Some(m) => {
                let kind = AckKind::Nak((!delay.is_zero()).then_some(delay));
                m.ack_with(kind)
                    .await
                    .map_err(|e| ack_err("nack", &part.tp, seq, e))
            }
            None => {
                tracing::debug!(tp = %part.tp, seq, "nack of a message not pending (already acked or nacked)");
                Ok(())
            }
        }
    }

    /// `+WPI`: restarts the message's `ack_wait`.
    async fn in_progress(&self, message: &Message) -> Result<()> {
        let Ok(part) = self.partition(&message.topic_partition()) else {
            return Ok(());
        };
        let seq = message.position.as_sequence().unwrap_or(0);
        let m = part.inner.lock().pending.get(&seq).cloned();
        match m {
            Some(m) => {
                let sent = Instant::now();
                m.ack_with(AckKind::Progress)
                    .await
                    .map_err(|e| ack_err("in-progress ack", &part.tp, seq, e))?;
                if let Some(d) = part.inner.lock().deadlines.get_mut(&seq) {
                    d.at = sent + ack_deadline(&self.options);
                }
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Stops the fetch tasks, naks (without delay, in order) what was delivered but not
    /// committed and what was fetched but not delivered, gives the partitions up and leaves the
    /// group, so other members take over at once. Durables stay.
    async fn close(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let _guard = self.rebalancing.lock().await;
        for t in self.advisories.lock().drain(..) {
            t.abort();
        }
        for part in &self.partitions {
            let (rev, left) = self.deactivate(part).await;
            Self::nak_all(&left).await;
            if let Some(rev) = rev {
                self.membership.release(&part.tp, rev).await;
            }
        }
        self.membership.leave().await;
        let _ = self.shared.client.flush().await;
        Ok(())
    }
}

impl Drop for JetStreamConsumer {
    fn drop(&mut self) {
        for t in self.advisories.lock().drain(..) {
            t.abort();
        }
        for p in &self.partitions {
            if let Some(f) = p.inner.lock().fetch.take() {
                // Dropping the stop sender ends the task.
                f.task.abort();
            }
        }
    }
}
