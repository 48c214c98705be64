//! Producers and transactions on a `memory://` broker.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use onceflow_core::{
    Capabilities, Delivery, Error, ErrorKind, GroupMetadata, Position, ProducerBackend,
    ProducerConfig, Record, Result, TopicPartition, TransactionBackend,
};
use tokio::time::Instant;

use crate::broker::{validate_record, Broker, OpenTxn, State, TxnIdState, TxnOffsets};
use crate::config::MemoryOptions;
use crate::group::Group;
use crate::CAPABILITIES;

struct Inner {
    broker: Arc<Broker>,
    options: MemoryOptions,
    client_id: String,
    transactional_id: Option<String>,
    epoch: u32,
    rr: AtomicU32,
    closed: AtomicBool,
}

/// A producer on a `memory://` broker. With a transactional id it is a transactional producer
/// (Kafka semantics): it writes only inside transactions, and a newer producer with the same id
/// fences it.
pub struct MemoryProducer {
    inner: Arc<Inner>,
}

impl Inner {
    /// Checks that this producer may act; returns the open transaction of its transactional id.
    fn check(&self, st: &State) -> Result<Option<u64>> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::new(
                ErrorKind::Closed,
                format!("producer '{}' is closed", self.client_id),
            ));
        }
        let Some(txid) = &self.transactional_id else {
            return Ok(None);
        };
        let s = st
            .producers
            .get(txid)
            .expect("a transactional id stays registered");
        if s.epoch != self.epoch {
            return Err(Error::new(
                ErrorKind::Fenced,
                format!(
                    "producer with transactional id '{txid}' (epoch {}) was fenced by a newer \
                     producer with the same id (epoch {})",
                    self.epoch, s.epoch
                ),
            ));
        }
        if s.crashed {
            return Err(Error::new(
                ErrorKind::Closed,
                format!(
                    "producer with transactional id '{txid}' crashed (injected fault): it is dead"
                ),
            ));
        }
        Ok(s.open)
    }

    /// The transaction plain sends belong to: none for a plain producer; the open one for a
    /// transactional producer, which must have one (as on Kafka).
    fn plain_send_txn(&self, st: &State) -> Result<Option<u64>> {
        let open = self.check(st)?;
        match (&self.transactional_id, open) {
            (Some(txid), None) => Err(Error::config(format!(
                "producer with transactional id '{txid}' has no open transaction: a \
                 transactional producer writes inside transactions (call begin() first)"
            ))),
            (_, open) => Ok(open),
        }
    }
}

impl MemoryProducer {
    pub(crate) fn new(
        broker: Arc<Broker>,
        options: MemoryOptions,
        config: ProducerConfig,
    ) -> Result<MemoryProducer> {
        crate::config::refuse_client_options("producer", &config.options)?;
        let mut epoch = 0;
        if let Some(txid) = &config.transactional_id {
            if txid.is_empty() {
                return Err(Error::config(
                    "transactional_id is empty: expected a non-empty id or none",
                ));
            }
            let mut st = broker.state.lock();
            // Kafka InitProducerId: bump the epoch, abort what the previous epoch left open.
            st.abort_open(txid);
            let s = st.producers.entry(txid.clone()).or_insert(TxnIdState {
                epoch: 0,
                open: None,
                crashed: false,
                aborted: 0,
            });
            s.epoch += 1;
            s.crashed = false;
            epoch = s.epoch;
            drop(st);
            broker.wake();
        }
        Ok(MemoryProducer {
            inner: Arc::new(Inner {
                broker,
                options,
                client_id: config.client_id.unwrap_or_else(|| "producer".into()),
                transactional_id: config.transactional_id,
                epoch,
                rr: AtomicU32::new(0),
                closed: AtomicBool::new(false),
            }),
        })
    }

    /// The producer epoch of its transactional id (0 without one).
    pub fn epoch(&self) -> u32 {
        self.inner.epoch
    }
}

#[async_trait]
impl ProducerBackend for MemoryProducer {
    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    async fn send(&self, record: Record) -> Result<Delivery> {
        let inner = &*self.inner;
        validate_record(&record, inner.options.max_record_bytes)?;
        let d = {
            let mut st = inner.broker.state.lock();
            let txn = inner.plain_send_txn(&st)?;
            let p = st.route(&inner.options, &record, &inner.rr)?;
            st.append(record, p, txn)
        };
        inner.broker.wake();
        Ok(d)
    }

    async fn send_batch(&self, records: Vec<Record>) -> Vec<Result<Delivery>> {
        let inner = &*self.inner;
        let checked: Vec<(Record, Result<()>)> = records
            .into_iter()
            .map(|r| {
                let v = validate_record(&r, inner.options.max_record_bytes);
                (r, v)
            })
            .collect();
        let out = {
            let mut st = inner.broker.state.lock();
            let txn = inner.plain_send_txn(&st);
            checked
                .into_iter()
                .map(|(r, v)| {
                    v?;
                    let txn = txn.as_ref().map_err(clone_error)?;
                    let p = st.route(&inner.options, &r, &inner.rr)?;
                    Ok(st.append(r, p, *txn))
                })
                .collect()
        };
        inner.broker.wake();
        out
    }

    async fn send_atomic(&self, records: Vec<Record>) -> Result<Vec<Delivery>> {
        let inner = &*self.inner;
        let n = records.len();
        for (i, r) in records.iter().enumerate() {
            validate_record(r, inner.options.max_record_bytes)
                .map_err(|e| e.context(format!("atomic batch record {} of {n}", i + 1)))?;
        }
        let out = {
            let mut st = inner.broker.state.lock();
            let txn = inner.plain_send_txn(&st)?;
            let mut parts = Vec::with_capacity(n);
            for (i, r) in records.iter().enumerate() {
                parts.push(
                    st.route(&inner.options, r, &inner.rr)
                        .map_err(|e| e.context(format!("atomic batch record {} of {n}", i + 1)))?,
                );
            }
            records
                .into_iter()
                .zip(parts)
                .map(|(r, p)| st.append(r, p, txn))
                .collect()
        };
        inner.broker.wake();
        Ok(out)
    }

    async fn begin(&self) -> Result<Box<dyn TransactionBackend>> {
        let inner = &self.inner;
        let Some(txid) = &inner.transactional_id else {
            return Err(Error::config(format!(
                "producer '{}' has no transactional id: create the producer with a transactional \
                 id to use transactions",
                inner.client_id
            )));
        };
        let mut st = inner.broker.state.lock();
        if inner.check(&st)?.is_some() {
            return Err(Error::config(format!(
                "producer with transactional id '{txid}' already has an open transaction: commit \
                 or abort it first"
            )));
        }
        let id = st.next_id();
        st.txns.insert(
            id,
            OpenTxn {
                transactional_id: txid.clone(),
                writes: Vec::new(),
                offsets: Vec::new(),
            },
        );
        st.producers.get_mut(txid).expect("registered").open = Some(id);
        Ok(Box::new(MemoryTransaction {
            inner: inner.clone(),
            id,
            done: false,
        }))
    }

    async fn flush(&self, _timeout: Duration) -> Result<()> {
        let st = self.inner.broker.state.lock();
        self.inner.check(&st).map(|_| ())
    }

    async fn close(&self) -> Result<()> {
        let inner = &self.inner;
        if inner.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        if let Some(txid) = &inner.transactional_id {
            let mut st = inner.broker.state.lock();
            let live = st
                .producers
                .get(txid)
                .is_some_and(|s| s.epoch == inner.epoch && !s.crashed);
            if live {
                st.abort_open(txid);
            }
            drop(st);
            inner.broker.wake();
        }
        Ok(())
    }
}

fn clone_error(e: &Error) -> Error {
    Error::new(e.kind(), e.message().to_string())
}

/// An open transaction of a [`MemoryProducer`]. Records are appended at send time with their
/// offsets (as on Kafka) and stay invisible to read-committed readers until commit.
struct MemoryTransaction {
    inner: Arc<Inner>,
    id: u64,
    done: bool,
}

impl MemoryTransaction {
    fn check(&self, st: &State) -> Result<()> {
        match self.inner.check(st)? {
            Some(id) if id == self.id => Ok(()),
            _ => Err(Error::new(
                ErrorKind::Aborted,
                "the transaction is no longer open (it was aborted)",
            )),
        }
    }
}

fn reap_group(st: &mut State, group: &str) {
    let State { topics, groups, .. } = st;
    if let Some(g) = groups.get_mut(group) {
        g.reap(Instant::now(), topics);
    }
}

#[async_trait]
impl TransactionBackend for MemoryTransaction {
    async fn send(&mut self, record: Record) -> Result<Delivery> {
        validate_record(&record, self.inner.options.max_record_bytes)?;
        let d = {
            let mut st = self.inner.broker.state.lock();
            self.check(&st)?;
            let p = st.route(&self.inner.options, &record, &self.inner.rr)?;
            st.append(record, p, Some(self.id))
        };
        self.inner.broker.wake();
        Ok(d)
    }

    async fn commit_offsets(
        &mut self,
        group: &GroupMetadata,
        positions: &[(TopicPartition, Position)],
    ) -> Result<()> {
        let parsed = positions
            .iter()
            .map(|(tp, p)| match p.as_offset() {
                Some(o) if o >= 0 => Ok((tp.clone(), o + 1)),
                _ => Err(Error::config(format!(
                    "position '{p}' of {tp} is not a memory:// offset: expected offset:N"
                ))),
            })
            .collect::<Result<Vec<_>>>()?;
        let mut st = self.inner.broker.state.lock();
        self.check(&st)?;
        reap_group(&mut st, &group.group);
        Group::check_txn_offsets(st.groups.get(&group.group), group, &parsed)?;
        let txn = st.txns.get_mut(&self.id).expect("checked open");
        txn.offsets.push(TxnOffsets {
            group: group.group.clone(),
            generation: group.generation,
            member: group.member_id.clone(),
            positions: parsed,
        });
        Ok(())
    }

    async fn commit(mut self: Box<Self>) -> Result<()> {
        self.done = true;
        let mut st = self.inner.broker.state.lock();
        self.check(&st)?;
        // KIP-447: the group positions are fenced at commit against the group as it is now.
        let groups: Vec<String> = st.txns[&self.id]
            .offsets
            .iter()
            .map(|o| o.group.clone())
            .collect();
        for g in &groups {
            reap_group(&mut st, g);
        }
        let verdict = st.txns[&self.id].offsets.iter().try_for_each(|o| {
            let md = GroupMetadata {
                group: o.group.clone(),
                generation: o.generation,
                member_id: o.member.clone(),
                native: None,
            };
            Group::check_txn_offsets(st.groups.get(&o.group), &md, &o.positions)
        });
        let commit = verdict.is_ok();
        st.end_txn(self.id, commit);
        drop(st);
        self.inner.broker.wake();
        verdict.map_err(|e| e.context("transaction aborted"))
    }

    async fn abort(mut self: Box<Self>) -> Result<()> {
        self.done = true;
        {
            let mut st = self.inner.broker.state.lock();
            self.check(&st)?;
            st.end_txn(self.id, false);
        }
        self.inner.broker.wake();
        Ok(())
    }
}

impl Drop for MemoryTransaction {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut st = self.inner.broker.state.lock();
        // A crashed producer leaves its transaction open; a fenced one was already aborted.
        if self.check(&st).is_ok() {
            st.end_txn(self.id, false);
            drop(st);
            self.inner.broker.wake();
        }
    }
}

impl std::fmt::Debug for MemoryProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryProducer")
            .field("broker", &self.inner.broker.name)
            .field("client_id", &self.inner.client_id)
            .field("transactional_id", &self.inner.transactional_id)
            .field("epoch", &self.inner.epoch)
            .finish()
    }
}
