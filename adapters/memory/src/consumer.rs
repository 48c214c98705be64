//! A member of a consumer group on a `memory://` broker.

use std::collections::HashSet;
use std::sync::atomic::{AtomicI64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use onceflow_core::{
    Capabilities, ConsumerBackend, ConsumerConfig, Error, ErrorKind, GroupMetadata, Isolation,
    Message, PartitionLag, Position, RebalanceListener, Result, StartFrom, TopicPartition,
};
use parking_lot::{Mutex, RwLock};
use tokio::time::Instant;

use crate::broker::{Broker, Entry, EntryState, Log, State};
use crate::faults::CrashPoint;
use crate::group::{Group, Member, Owned};
use crate::CAPABILITIES;

/// Default session timeout, as Kafka's `session.timeout.ms` before 3.0.
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);

const OPEN: u8 = 0;
const CLOSED: u8 = 1;
const DEAD: u8 = 2;

/// One member of a consumer group (see the crate docs for the semantics).
pub struct MemoryConsumer {
    broker: Arc<Broker>,
    group: String,
    member: Mutex<Arc<str>>,
    client_id: String,
    topics: Vec<String>,
    start: StartFrom,
    isolation: Isolation,
    session_timeout: Duration,
    listener: RwLock<Option<Arc<dyn RebalanceListener>>>,
    status: AtomicU8,
    generation: AtomicI64,
    poll_state: tokio::sync::Mutex<PollState>,
}

/// State only the (serialised) poll touches.
#[derive(Default)]
struct PollState {
    /// Partitions this handle has been assigned at some point: explicit start positions
    /// (earliest, latest, position, timestamp) apply the first time only; afterwards the group's
    /// committed position wins.
    seen: HashSet<TopicPartition>,
}

enum Step {
    Lost(Vec<TopicPartition>),
    Revoke(Vec<TopicPartition>),
    Assigned(Vec<TopicPartition>),
    Fetched(Vec<Message>, Option<Instant>),
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
        StartFrom::Position(p) if p.as_offset().is_none() => Err(Error::config(format!(
            "start position '{p}' is not a memory:// offset: expected offset:N"
        ))),
        _ => Ok(()),
    }
}

/// Resolves a start position in `log`. Positions out of range are clamped to the log.
fn resolve(log: &Log, start: &StartFrom, committed: Option<i64>, iso: Isolation) -> i64 {
    let hw = log.high_watermark();
    match start {
        StartFrom::Committed { fallback } => match committed {
            Some(c) => c.clamp(0, hw),
            None => resolve(log, fallback, None, iso),
        },
        StartFrom::Earliest => 0,
        StartFrom::Latest => end_for(log, iso),
        StartFrom::Position(p) => p.as_offset().unwrap_or(0).clamp(0, hw),
        StartFrom::Timestamp(ts) => log.offset_for_timestamp(*ts),
    }
}

/// Where a start position falls back to when nothing is committed.
fn fallback_of(start: &StartFrom) -> &StartFrom {
    match start {
        StartFrom::Committed { fallback } => fallback,
        other => other,
    }
}

#[inline]
fn end_for(log: &Log, iso: Isolation) -> i64 {
    match iso {
        Isolation::ReadCommitted => log.last_stable_offset(),
        Isolation::ReadUncommitted => log.high_watermark(),
    }
}

#[inline]
fn message(topic: &str, partition: i32, offset: i64, e: &Entry, delivery_count: u32) -> Message {
    Message {
        topic: topic.to_string(),
        partition,
        position: Position::Offset(offset),
        key: e.key.clone(),
        payload: e.payload.clone(),
        headers: e.headers.clone(),
        timestamp: Some(e.timestamp),
        delivery_count,
    }
}

fn offset_of(p: &Position) -> Result<i64> {
    p.as_offset().filter(|o| *o >= 0).ok_or_else(|| {
        Error::config(format!(
            "position '{p}' is not a memory:// offset: expected offset:N"
        ))
    })
}

fn not_assigned(tp: &TopicPartition, group: &str) -> Error {
    Error::config(format!(
        "partition {tp} is not assigned to this member of group '{group}': expected one of \
         assignment()"
    ))
}

impl MemoryConsumer {
    /// Joins `config.group` on `broker`.
    pub(crate) fn join(broker: Arc<Broker>, config: ConsumerConfig) -> Result<Arc<MemoryConsumer>> {
        crate::config::refuse_client_options("consumer", &config.options)?;
        if config.group.is_empty() {
            return Err(Error::config(
                "consumer group is empty: expected a group name",
            ));
        }
        if config.topics.is_empty() {
            return Err(Error::config(format!(
                "consumer of group '{}' subscribes to no topic: expected at least one",
                config.group
            )));
        }
        for t in &config.topics {
            crate::config::validate_topic_name(t)?;
        }
        check_start(&config.start)?;
        let session_timeout = config.session_timeout.unwrap_or(DEFAULT_SESSION_TIMEOUT);
        if session_timeout.is_zero() {
            return Err(Error::config(
                "session_timeout of 0: expected a positive duration",
            ));
        }
        let client_id = config
            .client_id
            .clone()
            .unwrap_or_else(|| "consumer".into());
        let mut topics = config.topics.clone();
        topics.sort();
        topics.dedup();
        let member: Arc<str> = {
            let mut st = broker.state.lock();
            let id: Arc<str> = format!("{client_id}-{}", st.next_id()).into();
            for t in &topics {
                if !st.topics.contains_key(t) {
                    tracing::warn!(
                        topic = %t,
                        group = %config.group,
                        "memory: subscribed topic does not exist yet; its partitions are assigned once it is created"
                    );
                }
            }
            let State {
                topics: tmap,
                groups,
                ..
            } = &mut *st;
            let g = groups
                .entry(config.group.clone())
                .or_insert_with(Group::new);
            g.reap(Instant::now(), tmap);
            g.join(
                id.clone(),
                Member::new(topics.clone(), session_timeout, 0),
                tmap,
            );
            id
        };
        broker.wake();
        Ok(Arc::new(MemoryConsumer {
            broker,
            group: config.group,
            member: Mutex::new(member),
            client_id,
            topics,
            start: config.start,
            isolation: config.isolation,
            session_timeout,
            listener: RwLock::new(None),
            status: AtomicU8::new(OPEN),
            generation: AtomicI64::new(0),
            poll_state: tokio::sync::Mutex::new(PollState::default()),
        }))
    }

    /// This member's current id in its group (changes when it rejoins after a session timeout).
    pub fn member_id(&self) -> String {
        self.member.lock().to_string()
    }

    /// The group this consumer belongs to.
    pub fn group(&self) -> &str {
        &self.group
    }

    fn check_open(&self) -> Result<()> {
        match self.status.load(Ordering::Acquire) {
            OPEN => Ok(()),
            DEAD => Err(Error::new(
                ErrorKind::Closed,
                format!(
                    "consumer '{}' of group '{}' crashed (injected fault): it is dead",
                    self.client_id, self.group
                ),
            )),
            _ => Err(self.closed_error()),
        }
    }

    fn closed_error(&self) -> Error {
        Error::new(
            ErrorKind::Closed,
            format!(
                "consumer '{}' of group '{}' is closed",
                self.client_id, self.group
            ),
        )
    }

    fn listener(&self) -> Option<Arc<dyn RebalanceListener>> {
        self.listener.read().clone()
    }

    /// One step of a poll under the broker lock: group maintenance first (expiry, lost,
    /// revocation, assignment: each returned to run the listener outside the lock), then a
    /// fetch.
    fn poll_step(&self, st: &mut State, max: usize, ps: &mut PollState) -> Result<Step> {
        let now = Instant::now();
        let State {
            topics,
            groups,
            faults,
            next_id,
            ..
        } = st;
        let g = groups
            .get_mut(&self.group)
            .ok_or_else(|| self.closed_error())?;
        g.reap(now, topics);
        let me = self.member.lock().clone();
        if !g.members.contains_key(&me) {
            return match g.expelled.remove(&me) {
                Some(lost) => {
                    // Expired while not polling: the partitions are lost; rejoin as a new member.
                    *next_id += 1;
                    let id: Arc<str> = format!("{}-{}", self.client_id, *next_id).into();
                    g.join(
                        id.clone(),
                        Member::new(self.topics.clone(), self.session_timeout, 1),
                        topics,
                    );
                    *self.member.lock() = id;
                    Ok(Step::Lost(lost))
                }
                None => Err(self.closed_error()),
            };
        }
        let expiry = g.next_expiry(&me);
        let Group {
            generation,
            version,
            members,
            target,
            owner,
            parts,
            ..
        } = g;
        let m = members.get_mut(&me).expect("member checked above");
        m.last_seen = now;
        if !m.lost.is_empty() {
            return Ok(Step::Lost(std::mem::take(&mut m.lost)));
        }
        if m.version != *version {
            let revoke: Vec<TopicPartition> = m
                .owned
                .iter()
                .filter(|o| target.get(&o.tp).map(|t| &**t) != Some(&*me))
                .map(|o| o.tp.clone())
                .collect();
            if !revoke.is_empty() {
                return Ok(Step::Revoke(revoke));
            }
            let mut assign: Vec<TopicPartition> = target
                .iter()
                .filter(|(tp, t)| ***t == *me && !owner.contains_key(*tp))
                .map(|(tp, _)| tp.clone())
                .collect();
            m.generation = *generation;
            m.version = *version;
            self.generation.store(*generation, Ordering::Release);
            if !assign.is_empty() {
                assign.sort();
                for tp in &assign {
                    let Some(log) = topics
                        .get(&tp.topic)
                        .and_then(|t| t.logs.get(tp.partition as usize))
                    else {
                        continue;
                    };
                    owner.insert(tp.clone(), me.clone());
                    let gp = parts.entry(tp.clone()).or_default();
                    let first_time = ps.seen.insert(tp.clone());
                    let pos = match (&self.start, first_time) {
                        (StartFrom::Committed { .. }, _) | (_, false) => match gp.committed {
                            Some(c) => c.clamp(0, log.high_watermark()),
                            None => resolve(log, fallback_of(&self.start), None, self.isolation),
                        },
                        (explicit, true) => resolve(log, explicit, None, self.isolation),
                    };
                    m.owned.push(Owned {
                        tp: tp.clone(),
                        pos,
                        paused: false,
                        not_before: None,
                    });
                }
                return Ok(Step::Assigned(assign));
            }
        }

        // Fetch, round-robin over owned partitions, under this one lock.
        let mut wake = expiry;
        let mut out: Vec<Message> = Vec::new();
        let n = m.owned.len();
        let read_committed = self.isolation == Isolation::ReadCommitted;
        for i in 0..n {
            if out.len() >= max {
                break;
            }
            let idx = (m.cursor + i) % n;
            let o = &mut m.owned[idx];
            if o.paused {
                continue;
            }
            if let Some(nb) = o.not_before {
                if now < nb {
                    wake = Some(wake.map_or(nb, |w| w.min(nb)));
                    continue;
                }
                o.not_before = None;
            }
            let Some(log) = topics
                .get(&o.tp.topic)
                .and_then(|t| t.logs.get(o.tp.partition as usize))
            else {
                continue;
            };
            let end = end_for(log, self.isolation);
            if o.pos >= end {
                continue;
            }
            if !parts.contains_key(&o.tp) {
                parts.insert(o.tp.clone(), Default::default());
            }
            let gp = parts.get_mut(&o.tp).expect("inserted above");
            out.reserve(((end - o.pos) as usize).min(max - out.len()));
            while o.pos < end && out.len() < max {
                let off = o.pos;
                let e = &log.entries[off as usize];
                o.pos += 1;
                match e.state {
                    EntryState::Control => continue,
                    EntryState::Aborted if read_committed => continue,
                    _ => {}
                }
                let count = gp.delivered(off);
                out.push(message(&o.tp.topic, o.tp.partition, off, e, count));
                if faults.should_redeliver() {
                    if out.len() < max {
                        let c = gp.delivered(off);
                        out.push(message(&o.tp.topic, o.tp.partition, off, e, c));
                        faults.redelivered += 1;
                    } else {
                        // No room left: it comes again first in the next poll.
                        o.pos = off;
                        faults.redelivered += 1;
                    }
                }
            }
        }
        m.cursor = m.cursor.wrapping_add(1);
        Ok(Step::Fetched(out, wake))
    }

    /// Commits what the listener returned for revoked partitions, then releases them.
    fn finish_revoke(
        &self,
        st: &mut State,
        revoked: &[TopicPartition],
        positions: Vec<(TopicPartition, Position)>,
    ) {
        let me = self.member.lock().clone();
        let Some(g) = st.groups.get_mut(&self.group) else {
            return;
        };
        if !g.members.contains_key(&me) {
            return;
        }
        for (tp, pos) in positions {
            if g.owner.get(&tp).map(|o| &**o) != Some(&*me) {
                continue;
            }
            match pos.as_offset() {
                Some(o) if o >= 0 => g.set_committed(tp, o + 1),
                _ => tracing::warn!(
                    position = %pos,
                    partition = %tp,
                    "memory: on_revoked returned a position that is not an offset; not committed"
                ),
            }
        }
        let m = g.members.get_mut(&me).expect("member checked above");
        m.owned.retain(|o| !revoked.contains(&o.tp));
        for tp in revoked {
            if g.owner.get(tp).map(|o| &**o) == Some(&*me) {
                g.owner.remove(tp);
            }
        }
        g.version += 1;
    }

    /// Dies (injected crash): leaves the group without committing or telling the listener.
    fn die(&self, st: &mut State) {
        self.status.store(DEAD, Ordering::Release);
        let me = self.member.lock().clone();
        let State { topics, groups, .. } = st;
        if let Some(g) = groups.get_mut(&self.group) {
            g.leave(&me, topics);
        }
    }

    fn leave(&self) {
        let me = self.member.lock().clone();
        {
            let mut st = self.broker.state.lock();
            let State { topics, groups, .. } = &mut *st;
            if let Some(g) = groups.get_mut(&self.group) {
                g.leave(&me, topics);
                g.expelled.remove(&me);
            }
        }
        self.broker.wake();
    }

    /// Runs `f` on this member's state, after expiring stale members; `Fenced` if this member
    /// is no longer in the group.
    fn with_member<T>(
        &self,
        f: impl FnOnce(
            &mut Member,
            &mut Group,
            &std::collections::HashMap<String, crate::broker::Topic>,
        ) -> Result<T>,
    ) -> Result<T> {
        self.check_open()?;
        let me = self.member.lock().clone();
        let mut st = self.broker.state.lock();
        let State { topics, groups, .. } = &mut *st;
        let g = groups
            .get_mut(&self.group)
            .ok_or_else(|| self.closed_error())?;
        g.reap(Instant::now(), topics);
        let Some(mut m) = g.members.remove(&me) else {
            return Err(self.fenced(&me, g.generation));
        };
        let r = f(&mut m, g, topics);
        g.members.insert(me, m);
        r
    }

    fn fenced(&self, me: &str, generation: i64) -> Error {
        Error::new(
            ErrorKind::Fenced,
            format!(
                "member '{me}' is no longer in group '{}' (now at generation {generation}): its \
                 session expired; the next poll rejoins",
                self.group
            ),
        )
    }
}

/// Keeps a member alive (exempt from session expiry) while a poll is in progress.
struct PollGuard<'a>(&'a MemoryConsumer);

impl<'a> PollGuard<'a> {
    fn enter(c: &'a MemoryConsumer) -> PollGuard<'a> {
        let me = c.member.lock().clone();
        let mut st = c.broker.state.lock();
        let State { topics, groups, .. } = &mut *st;
        if let Some(g) = groups.get_mut(&c.group) {
            let now = Instant::now();
            g.reap(now, topics);
            if let Some(m) = g.members.get_mut(&me) {
                m.polling += 1;
                m.last_seen = now;
            }
        }
        PollGuard(c)
    }
}

impl Drop for PollGuard<'_> {
    fn drop(&mut self) {
        let me = self.0.member.lock().clone();
        let mut st = self.0.broker.state.lock();
        if let Some(m) = st
            .groups
            .get_mut(&self.0.group)
            .and_then(|g| g.members.get_mut(&me))
        {
            m.polling = m.polling.saturating_sub(1);
            m.last_seen = Instant::now();
        }
    }
}

#[async_trait]
impl ConsumerBackend for MemoryConsumer {
    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn set_rebalance_listener(&self, listener: Arc<dyn RebalanceListener>) {
        *self.listener.write() = Some(listener);
    }

    async fn poll(&self, max: usize, timeout: Duration) -> Result<Vec<Message>> {
        self.check_open()?;
        let mut ps = self.poll_state.lock().await;
        let deadline = Instant::now() + timeout;
        let _alive = PollGuard::enter(self);
        loop {
            let notified = self.broker.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let step = {
                let mut st = self.broker.state.lock();
                self.poll_step(&mut st, max, &mut ps)?
            };
            match step {
                Step::Lost(tps) => {
                    if let Some(l) = self.listener() {
                        l.on_lost(&tps);
                    }
                }
                Step::Revoke(tps) => {
                    let positions = self
                        .listener()
                        .map(|l| l.on_revoked(&tps))
                        .unwrap_or_default();
                    {
                        let mut st = self.broker.state.lock();
                        self.finish_revoke(&mut st, &tps, positions);
                    }
                    self.broker.wake();
                }
                Step::Assigned(tps) => {
                    if let Some(l) = self.listener() {
                        l.on_assigned(&tps);
                    }
                }
                Step::Fetched(msgs, wake) => {
                    if !msgs.is_empty() || Instant::now() >= deadline || max == 0 {
                        return Ok(msgs);
                    }
                    let until = wake.map_or(deadline, |w| w.min(deadline));
                    let _ = tokio::time::timeout_at(until, notified).await;
                }
            }
            self.check_open()?;
        }
    }

    async fn commit(&self, positions: &[(TopicPartition, Position)]) -> Result<()> {
        self.check_open()?;
        let parsed = positions
            .iter()
            .map(|(tp, p)| Ok((tp.clone(), offset_of(p)? + 1)))
            .collect::<Result<Vec<_>>>()?;
        let me = self.member.lock().clone();
        let mut st = self.broker.state.lock();
        let crash = st.faults.take_crash(&self.group);
        let State {
            topics,
            groups,
            faults,
            ..
        } = &mut *st;
        let g = groups
            .get_mut(&self.group)
            .ok_or_else(|| self.closed_error())?;
        g.reap(Instant::now(), topics);
        let check = || -> Result<()> {
            if !g.members.contains_key(&me) {
                return Err(self.fenced(&me, g.generation));
            }
            for (tp, _) in &parsed {
                if g.owner.get(tp).map(|o| &**o) != Some(&*me) {
                    return Err(Error::new(
                        ErrorKind::Fenced,
                        format!(
                            "commit of {tp} by member '{me}' of group '{}' is fenced: the \
                             partition is not assigned to this member (generation {})",
                            self.group, g.generation
                        ),
                    ));
                }
            }
            Ok(())
        };
        let checked = check();
        if let Some(point) = crash {
            if point == CrashPoint::AfterCommit && checked.is_ok() {
                for (tp, next) in parsed {
                    g.set_committed(tp, next);
                }
            }
            self.die(&mut st);
            drop(st);
            self.broker.wake();
            return Err(Error::new(
                ErrorKind::Closed,
                format!(
                    "consumer '{}' of group '{}' crashed {} commit (injected fault)",
                    self.client_id,
                    self.group,
                    match point {
                        CrashPoint::BeforeCommit => "before",
                        CrashPoint::AfterCommit => "after",
                    }
                ),
            ));
        }
        checked?;
        if faults.drop_commits > 0 {
            faults.drop_commits -= 1;
            faults.dropped += 1;
            return Ok(());
        }
        for (tp, next) in parsed {
            g.set_committed(tp, next);
        }
        Ok(())
    }

    async fn committed(
        &self,
        partitions: &[TopicPartition],
    ) -> Result<Vec<(TopicPartition, Option<Position>)>> {
        self.check_open()?;
        let st = self.broker.state.lock();
        let g = st.groups.get(&self.group);
        Ok(partitions
            .iter()
            .map(|tp| {
                (
                    tp.clone(),
                    g.and_then(|g| g.committed(tp)).map(Position::Offset),
                )
            })
            .collect())
    }

    async fn seek(&self, partition: &TopicPartition, to: &StartFrom) -> Result<()> {
        check_start(to)?;
        let iso = self.isolation;
        self.with_member(|m, g, topics| {
            let log = topics
                .get(&partition.topic)
                .and_then(|t| t.logs.get(partition.partition as usize))
                .ok_or_else(|| not_assigned(partition, &self.group))?;
            let committed = g.committed(partition);
            let pos = match to {
                StartFrom::Position(p) => {
                    let o = offset_of(p)?;
                    let hw = log.high_watermark();
                    if o > hw {
                        return Err(Error::config(format!(
                            "cannot seek {partition} to '{p}': expected an offset from 0 to {hw}"
                        )));
                    }
                    o
                }
                other => resolve(log, other, committed, iso),
            };
            let o = m
                .owned_mut(partition)
                .ok_or_else(|| not_assigned(partition, &self.group))?;
            o.pos = pos;
            o.not_before = None;
            Ok(())
        })?;
        self.broker.wake();
        Ok(())
    }

    async fn pause(&self, partitions: &[TopicPartition]) -> Result<()> {
        self.with_member(|m, _, _| {
            if let Some(tp) = partitions.iter().find(|tp| m.owned_mut(tp).is_none()) {
                return Err(not_assigned(tp, &self.group));
            }
            for tp in partitions {
                m.owned_mut(tp).expect("checked").paused = true;
            }
            Ok(())
        })
    }

    async fn resume(&self, partitions: &[TopicPartition]) -> Result<()> {
        self.with_member(|m, _, _| {
            if let Some(tp) = partitions.iter().find(|tp| m.owned_mut(tp).is_none()) {
                return Err(not_assigned(tp, &self.group));
            }
            for tp in partitions {
                m.owned_mut(tp).expect("checked").paused = false;
            }
            Ok(())
        })?;
        self.broker.wake();
        Ok(())
    }

    fn assignment(&self) -> Vec<TopicPartition> {
        let me = self.member.lock().clone();
        let st = self.broker.state.lock();
        let mut out: Vec<TopicPartition> = st
            .groups
            .get(&self.group)
            .and_then(|g| g.members.get(&me))
            .map(|m| m.owned.iter().map(|o| o.tp.clone()).collect())
            .unwrap_or_default();
        out.sort();
        out
    }

    async fn lag(&self) -> Result<Vec<PartitionLag>> {
        self.with_member(|m, g, topics| {
            let mut out: Vec<PartitionLag> = m
                .owned
                .iter()
                .map(|o| {
                    let hw = topics
                        .get(&o.tp.topic)
                        .and_then(|t| t.logs.get(o.tp.partition as usize))
                        .map_or(0, |l| l.high_watermark());
                    let committed = g.committed(&o.tp);
                    PartitionLag {
                        partition: o.tp.clone(),
                        committed: committed.map(Position::Offset),
                        high_watermark: Some(Position::Offset(hw)),
                        messages: (hw - committed.unwrap_or(0)).max(0) as u64,
                        millis: None,
                    }
                })
                .collect();
            out.sort_by(|a, b| a.partition.cmp(&b.partition));
            Ok(out)
        })
    }

    fn group_metadata(&self) -> Option<GroupMetadata> {
        Some(GroupMetadata {
            group: self.group.clone(),
            generation: self.generation.load(Ordering::Acquire),
            member_id: self.member.lock().to_string(),
            native: None,
        })
    }

    async fn nack(&self, message: &Message, delay: Duration) -> Result<()> {
        let offset = offset_of(&message.position)?;
        self.check_open()?;
        let me = self.member.lock().clone();
        {
            let mut st = self.broker.state.lock();
            let Some(m) = st
                .groups
                .get_mut(&self.group)
                .and_then(|g| g.members.get_mut(&me))
            else {
                return Ok(());
            };
            let Some(o) = m
                .owned
                .iter_mut()
                .find(|o| o.tp.partition == message.partition && o.tp.topic == message.topic)
            else {
                // Not ours any more: its new owner reads from the committed position.
                return Ok(());
            };
            o.pos = o.pos.min(offset);
            o.not_before = (!delay.is_zero()).then(|| Instant::now() + delay);
        }
        self.broker.wake();
        Ok(())
    }

    async fn close(&self) -> Result<()> {
        match self
            .status
            .compare_exchange(OPEN, CLOSED, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                self.leave();
                Ok(())
            }
            Err(CLOSED) => Ok(()),
            Err(_) => self.check_open(),
        }
    }
}

impl Drop for MemoryConsumer {
    fn drop(&mut self) {
        if self.status.load(Ordering::Acquire) == OPEN {
            self.leave();
        }
    }
}

impl std::fmt::Debug for MemoryConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryConsumer")
            .field("broker", &self.broker.name)
            .field("group", &self.group)
            .field("member", &*self.member.lock())
            .finish()
    }
}
