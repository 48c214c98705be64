//! The producer: records packed into PutRecords calls within Kinesis limits, only failed entries
//! retried, throttling backed off.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_kinesis::primitives::Blob;
use aws_sdk_kinesis::types::PutRecordsRequestEntry;
use backon::{BackoffBuilder, ExponentialBuilder};
use bytes::Bytes;
use onceflow_core::{
    Capabilities, Delivery, Error, ErrorKind, Position, ProducerBackend, ProducerConfig, Record,
    Result,
};
use parking_lot::Mutex;
use tokio::sync::{oneshot, Notify};

use crate::envelope::{self, Envelope};
use crate::shards::{aws_err, partition_of_shard};
use crate::{Shared, CAPABILITIES};

/// Most records in one PutRecords call (AWS limit).
pub const MAX_RECORDS_PER_CALL: usize = 500;
/// Most bytes (data + partition keys) in one PutRecords call (AWS limit, 5 MiB).
pub const MAX_BYTES_PER_CALL: usize = 5 * 1024 * 1024;
/// Most bytes (data + partition key) of one record (AWS limit, 1 MiB).
pub const MAX_BYTES_PER_RECORD: usize = 1024 * 1024;
/// Longest partition key, in Unicode scalar values (AWS limit).
pub const MAX_PARTITION_KEY_CHARS: usize = 256;

/// The partition key of a record key: the key itself when it is UTF-8 of 1 to 256 characters,
/// else `hex:` and the hex of its 128-bit XXH3 (deterministic, so one key keeps one shard).
pub fn partition_key_of(key: &[u8]) -> (String, bool) {
    match std::str::from_utf8(key) {
        Ok(s) if !s.is_empty() && s.chars().count() <= MAX_PARTITION_KEY_CHARS => {
            (s.to_string(), true)
        }
        _ => (
            format!("hex:{:032x}", xxhash_rust::xxh3::xxh3_128(key)),
            false,
        ),
    }
}

/// One record ready for PutRecords.
pub(crate) struct Prepared {
    stream: String,
    data: Bytes,
    partition_key: String,
    explicit_hash_key: Option<String>,
    timestamp: Option<i64>,
}

impl Prepared {
    fn size(&self) -> usize {
        self.data.len() + self.partition_key.len()
    }
}

struct Pending {
    rec: Prepared,
    attempt: usize,
    reply: oneshot::Sender<Result<Delivery>>,
}

struct Queue {
    items: Mutex<VecDeque<Pending>>,
    wake: Notify,
    closed: Mutex<bool>,
}

/// The Kinesis producer. Every `send` and `send_batch` goes through one queue drained by one
/// task: each PutRecords call takes, in order, as many queued records of one stream as fit in
/// 500 records and 5 MiB. Calls are made one at a time, so records of one partition key are
/// written in the order they were sent, except that an entry retried after a partial failure
/// lands after entries of the same call that succeeded (as with AWS's KPL).
pub struct KinesisProducer {
    shared: Arc<Shared>,
    queue: Arc<Queue>,
}

impl KinesisProducer {
    pub(crate) fn new(shared: Arc<Shared>, _config: ProducerConfig) -> KinesisProducer {
        let queue = Arc::new(Queue {
            items: Mutex::new(VecDeque::new()),
            wake: Notify::new(),
            closed: Mutex::new(false),
        });
        tokio::spawn(drain(shared.clone(), Arc::downgrade(&queue)));
        KinesisProducer { shared, queue }
    }

    async fn prepare(&self, record: Record) -> Result<Prepared> {
        let max = self.shared.max_record_bytes();
        let size = record.size_bytes();
        if size > max {
            return Err(Error::config(format!(
                "record of {size} bytes (key + payload + headers) for stream '{}' exceeds the \
                 largest record Kinesis accepts through onceflow, {max} bytes",
                record.topic
            )));
        }
        self.shared.ensure_stream(&record.topic).await?;
        let mut env = Envelope {
            timestamp: record.timestamp,
            headers: record.headers,
            ..Default::default()
        };
        let partition_key = match &record.key {
            Some(k) => {
                let (pk, same) = partition_key_of(k);
                if !same {
                    env.key = Some(k.clone());
                }
                pk
            }
            None => {
                env.unkeyed = true;
                format!("{:016x}", rand::random::<u64>())
            }
        };
        let explicit_hash_key = match record.partition {
            Some(p) => Some(self.shared.hash_key_of_partition(&record.topic, p).await?),
            None => None,
        };
        let data = envelope::encode_if_needed(&env, &record.payload);
        let rec = Prepared {
            stream: record.topic,
            data,
            partition_key,
            explicit_hash_key,
            timestamp: record.timestamp,
        };
        if rec.size() > MAX_BYTES_PER_RECORD {
            return Err(Error::config(format!(
                "record for stream '{}' is {} bytes with its envelope and partition key, over \
                 Kinesis's {MAX_BYTES_PER_RECORD}-byte limit per record",
                rec.stream,
                rec.size()
            )));
        }
        Ok(rec)
    }

    fn enqueue(&self, recs: Vec<Prepared>) -> Result<Vec<oneshot::Receiver<Result<Delivery>>>> {
        if *self.queue.closed.lock() {
            return Err(Error::new(
                ErrorKind::Closed,
                "the Kinesis producer is closed",
            ));
        }
        let mut rxs = Vec::with_capacity(recs.len());
        {
            let mut q = self.queue.items.lock();
            for rec in recs {
                let (reply, rx) = oneshot::channel();
                q.push_back(Pending {
                    rec,
                    attempt: 0,
                    reply,
                });
                rxs.push(rx);
            }
        }
        self.queue.wake.notify_one();
        Ok(rxs)
    }
}

fn dropped() -> Error {
    Error::new(
        ErrorKind::Closed,
        "the Kinesis producer stopped before the record was acknowledged",
    )
}

#[async_trait]
impl ProducerBackend for KinesisProducer {
    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    async fn send(&self, record: Record) -> Result<Delivery> {
        let rec = self.prepare(record).await?;
        let rx = self.enqueue(vec![rec])?.remove(0);
        rx.await.unwrap_or_else(|_| Err(dropped()))
    }

    async fn send_batch(&self, records: Vec<Record>) -> Vec<Result<Delivery>> {
        let mut slots: Vec<Option<Result<Delivery>>> = Vec::with_capacity(records.len());
        let mut ready = Vec::new();
        let mut at = Vec::new();
        for r in records {
            match self.prepare(r).await {
                Ok(p) => {
                    at.push(slots.len());
                    slots.push(None);
                    ready.push(p);
                }
                Err(e) => slots.push(Some(Err(e))),
            }
        }
        match self.enqueue(ready) {
            Ok(rxs) => {
                for (i, rx) in at.into_iter().zip(rxs) {
                    slots[i] = Some(rx.await.unwrap_or_else(|_| Err(dropped())));
                }
            }
            Err(e) => {
                for i in at {
                    slots[i] = Some(Err(Error::new(e.kind(), e.message().to_string())));
                }
            }
        }
        slots.into_iter().map(|s| s.expect("filled")).collect()
    }

    async fn flush(&self, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if self.queue.items.lock().is_empty() && !self.shared.put_in_flight() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("Kinesis producer: records still unacknowledged after {timeout:?}"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn close(&self) -> Result<()> {
        let r = self.flush(Duration::from_secs(30)).await;
        *self.queue.closed.lock() = true;
        self.queue.wake.notify_one();
        r
    }
}

impl Drop for KinesisProducer {
    fn drop(&mut self) {
        *self.queue.closed.lock() = true;
        self.queue.wake.notify_one();
    }
}

/// Takes the next call's records: from the front, records of the first record's stream, in
/// order, within the per-call limits.
fn next_batch(q: &mut VecDeque<Pending>) -> Vec<Pending> {
    let Some(stream) = q.front().map(|p| p.rec.stream.clone()) else {
        return Vec::new();
    };
    let mut batch = Vec::new();
    let mut bytes = 0;
    let mut i = 0;
    while i < q.len() && batch.len() < MAX_RECORDS_PER_CALL {
        if q[i].rec.stream != stream {
            i += 1;
            continue;
        }
        let size = q[i].rec.size();
        if bytes + size > MAX_BYTES_PER_CALL {
            break;
        }
        bytes += size;
        batch.push(q.remove(i).expect("index in range"));
    }
    batch
}

async fn drain(shared: Arc<Shared>, queue: std::sync::Weak<Queue>) {
    loop {
        let Some(q) = queue.upgrade() else { return };
        let batch = next_batch(&mut q.items.lock());
        if batch.is_empty() {
            if *q.closed.lock() {
                return;
            }
            // Woken by a send, or checks the closed flag again now and then.
            let _ = tokio::time::timeout(Duration::from_millis(500), q.wake.notified()).await;
            continue;
        }
        shared.set_put_in_flight(true);
        let retry = put(&shared, batch).await;
        shared.set_put_in_flight(false);
        if !retry.is_empty() {
            // Failed entries go back to the front, in their order.
            let mut items = q.items.lock();
            for p in retry.into_iter().rev() {
                items.push_front(p);
            }
        }
    }
}

fn backoff(attempt: usize) -> Duration {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(50))
        .with_max_delay(Duration::from_secs(2))
        .with_factor(2.0)
        .with_jitter()
        .with_max_times(attempt + 1)
        .build()
        .nth(attempt)
        .unwrap_or(Duration::from_secs(2))
}

/// One PutRecords call. Replies to what succeeded or failed for good; returns the entries to
/// retry (after sleeping the backoff of the worst of them).
async fn put(shared: &Shared, batch: Vec<Pending>) -> Vec<Pending> {
    let stream = batch[0].rec.stream.clone();
    let entries: Vec<PutRecordsRequestEntry> = batch
        .iter()
        .map(|p| {
            PutRecordsRequestEntry::builder()
                .data(Blob::new(p.rec.data.to_vec()))
                .partition_key(&p.rec.partition_key)
                .set_explicit_hash_key(p.rec.explicit_hash_key.clone())
                .build()
                .expect("data and partition key are set")
        })
        .collect();
    let attempts = shared.options.put_attempts;
    let resp = shared
        .client
        .put_records()
        .stream_name(&stream)
        .set_records(Some(entries))
        .send()
        .await;
    let mut retry = Vec::new();
    match resp {
        Err(e) => {
            let err = aws_err(format!("PutRecords to stream '{stream}'"), e);
            let worst = batch.iter().map(|p| p.attempt).max().unwrap_or(0);
            for mut p in batch {
                p.attempt += 1;
                if err.is_retriable() && p.attempt < attempts {
                    retry.push(p);
                } else {
                    let _ = p
                        .reply
                        .send(Err(Error::new(err.kind(), err.message().to_string())
                            .retriable(err.is_retriable())));
                }
            }
            if !retry.is_empty() {
                tokio::time::sleep(backoff(worst)).await;
            }
        }
        Ok(out) => {
            let results = out.records();
            let mut worst = 0;
            for (i, mut p) in batch.into_iter().enumerate() {
                let Some(r) = results.get(i) else {
                    let _ = p.reply.send(Err(Error::new(
                        ErrorKind::Platform,
                        format!("PutRecords to stream '{stream}': no result for entry {i}"),
                    )));
                    continue;
                };
                match (r.error_code(), r.sequence_number(), r.shard_id()) {
                    (None, Some(seq), Some(shard)) => {
                        let _ = p.reply.send(Ok(Delivery {
                            topic: stream.clone(),
                            partition: partition_of_shard(shard).unwrap_or(-1),
                            position: Position::SequenceNumber(seq.to_string()),
                            timestamp: p.rec.timestamp,
                            duplicate: false,
                        }));
                    }
                    (code, _, _) => {
                        let code = code.unwrap_or("NoSequenceNumber").to_string();
                        let retriable = matches!(
                            code.as_str(),
                            "ProvisionedThroughputExceededException" | "InternalFailure"
                        );
                        p.attempt += 1;
                        if retriable && p.attempt < attempts {
                            worst = worst.max(p.attempt - 1);
                            retry.push(p);
                        } else {
                            let _ = p.reply.send(Err(Error::new(
                                ErrorKind::Platform,
                                format!(
                                    "PutRecords to stream '{stream}': entry failed after {} \
                                     attempt(s): {code}: {}",
                                    p.attempt,
                                    r.error_message().unwrap_or("")
                                ),
                            )
                            .retriable(retriable)));
                        }
                    }
                }
            }
            if !retry.is_empty() {
                tracing::debug!(
                    stream,
                    failed = retry.len(),
                    "PutRecords partial failure: retrying the failed entries only"
                );
                tokio::time::sleep(backoff(worst)).await;
            }
        }
    }
    retry
}
