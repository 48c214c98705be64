//! The in-process broker: topics of partition logs, consumer groups, transactional producers, the
//! registry of named brokers. Everything lives under one lock; the hot paths (append, fetch) take
//! it once per call, whatever the batch size.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use onceflow_core::{
    now_ms, Delivery, Error, ErrorKind, Headers, Position, Record, Result, TopicPartition,
    TopicSpec,
};
use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::config::{validate_topic_name, MemoryOptions};
use crate::faults::FaultState;
use crate::group::Group;
use crate::partitioner::partition_for_key;

/// A named broker: state under one lock, and a notifier consumers wait on (woken by appends,
/// transaction outcomes and group changes).
pub(crate) struct Broker {
    pub name: String,
    pub state: Mutex<State>,
    pub notify: Notify,
}

impl Broker {
    pub fn new(name: impl Into<String>) -> Arc<Broker> {
        Arc::new(Broker {
            name: name.into(),
            state: Mutex::new(State::default()),
            notify: Notify::new(),
        })
    }

    /// Wakes every consumer waiting in `poll`.
    #[inline]
    pub fn wake(&self) {
        self.notify.notify_waiters();
    }
}

fn registry() -> &'static Mutex<HashMap<String, Arc<Broker>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<String, Arc<Broker>>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// The broker called `name` in this process, created on first use. It lives until
/// [`forget`] (like a broker process, it outlives its clients).
pub(crate) fn named(name: &str) -> Arc<Broker> {
    registry()
        .lock()
        .entry(name.to_string())
        .or_insert_with(|| Broker::new(name))
        .clone()
}

/// Removes a named broker from the registry; handles still open keep using it.
pub(crate) fn forget(name: &str) -> bool {
    registry().lock().remove(name).is_some()
}

/// How a stored record reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EntryState {
    /// Written outside a transaction.
    Plain,
    /// Written by the transaction with this id, still open.
    Open(u64),
    /// Written by a committed transaction.
    Committed,
    /// Written by an aborted transaction: skipped by read-committed readers.
    Aborted,
    /// A transaction marker (commit / abort): takes an offset, never delivered (as on Kafka).
    Control,
}

pub(crate) struct Entry {
    pub key: Option<Bytes>,
    pub payload: Bytes,
    pub headers: Headers,
    pub timestamp: i64,
    pub state: EntryState,
}

/// One partition's log. Offsets start at 0 and equal the index in `entries`.
#[derive(Default)]
pub(crate) struct Log {
    pub entries: Vec<Entry>,
    /// Open transactions with records here: (first offset, transaction id).
    pub open: BTreeSet<(i64, u64)>,
}

impl Log {
    /// High watermark: the next offset to be written.
    #[inline]
    pub fn high_watermark(&self) -> i64 {
        self.entries.len() as i64
    }

    /// Last stable offset: the first record of a still-open transaction, else the high
    /// watermark. Read-committed readers stop here (KIP-98).
    #[inline]
    pub fn last_stable_offset(&self) -> i64 {
        self.open
            .first()
            .map_or_else(|| self.high_watermark(), |(o, _)| *o)
    }

    /// First data record with a timestamp at or after `ts`, else the high watermark (Kafka
    /// `offsetsForTimes`; timestamps need not be monotonic, so this scans).
    pub fn offset_for_timestamp(&self, ts: i64) -> i64 {
        self.entries
            .iter()
            .position(|e| e.state != EntryState::Control && e.timestamp >= ts)
            .map_or_else(|| self.high_watermark(), |i| i as i64)
    }
}

pub(crate) struct Topic {
    /// Changes when a topic is deleted and created again.
    pub incarnation: u64,
    pub spec: TopicSpec,
    pub logs: Vec<Log>,
}

/// What a transactional id holds on the broker (Kafka's transaction coordinator state).
pub(crate) struct TxnIdState {
    /// Producer epoch; a new producer with the same id bumps it and fences the old one.
    pub epoch: u32,
    /// The open transaction of the current epoch.
    pub open: Option<u64>,
    /// The current epoch's producer was killed by fault injection.
    pub crashed: bool,
    /// Transactions of this id aborted so far, whoever ended them (the producer, its drop,
    /// or fencing by a newer epoch).
    pub aborted: u64,
}

/// A group's positions added to a transaction, applied at commit.
pub(crate) struct TxnOffsets {
    pub group: String,
    pub generation: i64,
    pub member: String,
    pub positions: Vec<(TopicPartition, i64)>,
}

pub(crate) struct OpenTxn {
    pub transactional_id: String,
    /// Partitions written: (topic, incarnation, partition, offsets written).
    pub writes: Vec<(String, u64, i32, Vec<i64>)>,
    pub offsets: Vec<TxnOffsets>,
}

#[derive(Default)]
pub(crate) struct State {
    pub topics: HashMap<String, Topic>,
    pub groups: HashMap<String, Group>,
    pub producers: HashMap<String, TxnIdState>,
    pub txns: HashMap<u64, OpenTxn>,
    pub next_id: u64,
    pub faults: FaultState,
}

#[inline]
fn promote(b: &Bytes) {
    drop(b.clone());
}

/// Validation done before taking the lock: size, header names, timestamp.
pub(crate) fn validate_record(record: &Record, max: usize) -> Result<()> {
    if record.topic.is_empty() {
        return Err(Error::config(
            "record has an empty topic: expected a topic name",
        ));
    }
    let size = record.size_bytes();
    if size > max {
        return Err(Error::config(format!(
            "record for topic '{}' is {size} bytes (key + payload + headers), over the limit of \
             {max} bytes (max_record_bytes)",
            record.topic
        )));
    }
    if record.headers.iter().any(|h| h.name.is_empty()) {
        return Err(Error::config(format!(
            "record for topic '{}' has a header with an empty name: expected a non-empty name",
            record.topic
        )));
    }
    if let Some(ts) = record.timestamp {
        if ts < 0 {
            return Err(Error::config(format!(
                "record for topic '{}' has timestamp {ts}: expected ms since the epoch, >= 0",
                record.topic
            )));
        }
    }
    Ok(())
}

impl State {
    pub fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Creates a topic and rebalances the groups subscribed to it.
    pub fn create_topic(&mut self, spec: TopicSpec) {
        let incarnation = self.next_id();
        let name = spec.name.clone();
        let logs = (0..spec.partitions).map(|_| Log::default()).collect();
        self.topics.insert(
            name.clone(),
            Topic {
                incarnation,
                spec,
                logs,
            },
        );
        self.topics_changed(&name);
    }

    /// Deletes a topic: owners lose its partitions, groups forget their positions in it.
    pub fn delete_topic(&mut self, name: &str) -> bool {
        if self.topics.remove(name).is_none() {
            return false;
        }
        for g in self.groups.values_mut() {
            g.forget_topic(name);
        }
        self.topics_changed(name);
        true
    }

    fn topics_changed(&mut self, name: &str) {
        let State { topics, groups, .. } = self;
        for g in groups.values_mut() {
            if g.subscribes(name) {
                g.rebalance(topics);
            }
        }
    }

    /// The partition `record` goes to, creating its topic if allowed.
    pub fn route(
        &mut self,
        options: &MemoryOptions,
        record: &Record,
        rr: &AtomicU32,
    ) -> Result<i32> {
        let partitions = match self.topics.get(&record.topic) {
            Some(t) => t.logs.len() as u32,
            None if options.auto_create => {
                validate_topic_name(&record.topic)?;
                self.create_topic(TopicSpec::new(record.topic.clone(), options.partitions));
                options.partitions
            }
            None => {
                return Err(Error::new(
                    ErrorKind::NotFound,
                    format!(
                        "topic '{}' does not exist (auto_create=false): create it first",
                        onceflow_core::shown(&record.topic)
                    ),
                ))
            }
        };
        match (record.partition, &record.key) {
            (Some(p), _) => {
                if p < 0 || p as u32 >= partitions {
                    Err(Error::config(format!(
                        "partition {p} does not exist in topic '{}': expected 0 to {}",
                        record.topic,
                        partitions - 1
                    )))
                } else {
                    Ok(p)
                }
            }
            (None, Some(key)) => Ok(partition_for_key(key, partitions)),
            (None, None) => Ok((rr.fetch_add(1, Ordering::Relaxed) % partitions) as i32),
        }
    }

    /// Appends a routed record; `txn` marks it as written by an open transaction.
    pub fn append(&mut self, record: Record, partition: i32, txn: Option<u64>) -> Delivery {
        let timestamp = record.timestamp.unwrap_or_else(now_ms);
        let topic = self
            .topics
            .get_mut(&record.topic)
            .expect("append after route: topic exists");
        let incarnation = topic.incarnation;
        let log = &mut topic.logs[partition as usize];
        let offset = log.high_watermark();
        let state = match txn {
            None => EntryState::Plain,
            Some(id) => EntryState::Open(id),
        };
        // `Bytes` built from a `Vec` or `String` allocate their shared header on first clone.
        // Pay that here, once, so every poll only bumps reference counts.
        promote(&record.payload);
        if let Some(k) = &record.key {
            promote(k);
        }
        for h in record.headers.iter() {
            if let Some(v) = &h.value {
                promote(v);
            }
        }
        log.entries.push(Entry {
            key: record.key,
            payload: record.payload,
            headers: record.headers,
            timestamp,
            state,
        });
        if let Some(id) = txn {
            let t = self
                .txns
                .get_mut(&id)
                .expect("append in a live transaction");
            match t
                .writes
                .iter_mut()
                .find(|(n, inc, p, _)| *p == partition && *inc == incarnation && *n == record.topic)
            {
                Some((_, _, _, offsets)) => offsets.push(offset),
                None => {
                    log.open.insert((offset, id));
                    t.writes
                        .push((record.topic.clone(), incarnation, partition, vec![offset]));
                }
            }
        }
        Delivery::new(record.topic, partition, Position::Offset(offset)).timestamp(Some(timestamp))
    }

    /// Ends a transaction: its records become committed or aborted, a control marker is written
    /// to each partition it touched, and on commit its group positions are applied.
    pub fn end_txn(&mut self, id: u64, commit: bool) {
        let Some(txn) = self.txns.remove(&id) else {
            return;
        };
        if let Some(p) = self.producers.get_mut(&txn.transactional_id) {
            if p.open == Some(id) {
                p.open = None;
            }
            if !commit {
                p.aborted += 1;
            }
        }
        let now = now_ms();
        let outcome = if commit {
            EntryState::Committed
        } else {
            EntryState::Aborted
        };
        for (topic, incarnation, partition, offsets) in &txn.writes {
            let Some(t) = self.topics.get_mut(topic) else {
                continue;
            };
            if t.incarnation != *incarnation {
                continue;
            }
            let log = &mut t.logs[*partition as usize];
            for o in offsets {
                log.entries[*o as usize].state = outcome;
            }
            log.open.remove(&(offsets[0], id));
            log.entries.push(Entry {
                key: None,
                payload: Bytes::new(),
                headers: Headers::new(),
                timestamp: now,
                state: EntryState::Control,
            });
        }
        if commit {
            for o in txn.offsets {
                let group = self.groups.entry(o.group).or_insert_with(Group::new);
                for (tp, next) in o.positions {
                    group.set_committed(tp, next);
                }
            }
        }
    }

    /// Aborts the open transaction of a transactional id (fencing, close).
    pub fn abort_open(&mut self, transactional_id: &str) {
        if let Some(id) = self.producers.get(transactional_id).and_then(|p| p.open) {
            self.end_txn(id, false);
        }
    }
}
