//! `connect`, `dedupStore` and the handles: `Client`, `Producer`, `Transaction`, `Consumer`,
//! `Admin`, `DedupStore`.

use std::sync::Arc;

use napi::bindgen_prelude::{Either, Null, Result};
use napi_derive::napi;
use onceflow::{
    ConsumerConfig, Error, ErrorKind, Isolation, ProducerConfig, StartFrom, TopicPartition,
    TopicSpec,
};
use onceflow_bindings::settings::Language;
use onceflow_bindings::yielded::{Progress, Yielded};

use crate::convert::{self, Delivery, Lag, MessageColumns, PositionIn, RecordIn, SendResult};
use crate::options::{Checked, Expect, Known, RawOptions};
use crate::{js_err, on_rt};

/// Connects to the platform named by the URL's scheme (`memory://`, `kafka://`, `nats://`,
/// `tls://`, `pulsar://`, `pulsar+ssl://`, `kinesis://`).
///
/// `options` are added to the URL's query parameters, so credentials can stay out of the URL
/// string: for Kafka they are librdkafka properties, e.g. `{ 'security.protocol': 'SASL_SSL',
/// 'sasl.mechanism': 'SCRAM-SHA-512', 'sasl.username': user, 'sasl.password': password }`.
/// A value is a string, a boolean (sent as `"true"` / `"false"`) or a finite number (`500` as
/// `"500"`, `0.5` as `"0.5"`); another type is an `ONCEFLOW_CONFIG` error naming the key and the
/// type, never the value.
///
/// Rejects with an `ONCEFLOW_CONNECT` error within seconds when no Kafka or Pulsar broker of the
/// URL answers, `ONCEFLOW_AUTH` when the server refuses the credentials or the TLS certificate
/// (the secret is never in the message), and `ONCEFLOW_CONFIG` for a malformed URL or option.
#[napi]
// Only called from JavaScript: the unit-test build of the addon has no caller.
#[cfg_attr(test, allow(dead_code))]
pub async fn connect(
    url: String,
    #[napi(ts_arg_type = "Record<string, string | boolean | number> | undefined | null")]
    options: Option<RawOptions>,
) -> Result<Client> {
    let options = options.unwrap_or_default().0;
    on_rt(async move {
        onceflow::connect_with(&url, options.iter().map(|(k, v)| (k.as_str(), v.as_str()))).await
    })
    .await
    .map(|inner| Client { inner })
}

/// Opens a dedup store by URL: `memory://`, or `embedded:///path/file.db` / a file path;
/// completed keys are remembered for `windowMs` (default one day). Wrapped by index.js's
/// `dedupStore(url, { windowMs })`, which checks the option names.
#[napi(js_name = "_dedupStore")]
// Only called from JavaScript: the unit-test build of the addon has no caller.
#[cfg_attr(test, allow(dead_code))]
pub async fn dedup_store(url: String, window_ms: Option<f64>) -> Result<DedupStore> {
    let window = convert::millis("windowMs", window_ms.unwrap_or(86_400_000.0))?;
    let u = url.clone();
    on_rt(async move { onceflow::dedup_store(&u, window).await })
        .await
        .map(|inner| DedupStore { inner, url })
}

/// A dedup (idempotency) store.
#[napi]
pub struct DedupStore {
    pub(crate) inner: Arc<dyn onceflow::DedupStore>,
    url: String,
}

#[napi]
impl DedupStore {
    /// The URL it was opened with, its password or token shown as `***` (so logging the
    /// store never logs a secret).
    #[napi(getter)]
    pub fn url(&self) -> String {
        onceflow::redact_credentials(&self.url)
    }
}

/// Producer settings.
#[napi(object)]
pub struct ProducerOptions {
    /// Enables `begin()` / `transaction()`.
    pub transactional_id: Option<String>,
    /// Client id shown to the platform.
    pub client_id: Option<String>,
    /// Idempotent producer (default: on where the platform has it).
    pub idempotent: Option<bool>,
    /// Raw `key=value` options for the native client (librdkafka properties, for example):
    /// strings, booleans (`"true"` / `"false"`) or numbers (`500` → `"500"`).
    #[napi(ts_type = "Record<string, string | boolean | number>")]
    pub options: Option<RawOptions>,
}

impl Known for ProducerOptions {
    const WHAT: &'static str = "producer option";
    const KEYS: &'static [(&'static str, Expect)] = &[
        ("transactionalId", Expect::String),
        ("clientId", Expect::String),
        ("idempotent", Expect::Boolean),
        ("options", Expect::RawOptions),
    ];
}

/// Consumer settings.
#[napi(object)]
pub struct ConsumerOptions {
    /// `committed` (default), `committed-or-latest`, `earliest`, `latest`, `timestamp:MS` or a
    /// position such as `offset:42`.
    pub start: Option<String>,
    /// `read_committed` (default) or `read_uncommitted`.
    pub isolation: Option<String>,
    /// Client id shown to the platform.
    pub client_id: Option<String>,
    /// Group session timeout, ms.
    pub session_timeout_ms: Option<f64>,
    /// Raw `key=value` options for the native client (librdkafka properties, for example):
    /// strings, booleans (`"true"` / `"false"`) or numbers (`500` → `"500"`); an unknown key
    /// throws an `OnceflowError` of kind `config` naming it.
    ///
    /// JetStream's consumer options (the durable's settings; reopening a group with other ones
    /// updates the durable where the server allows, else throws naming each):
    /// - `ack_wait_ms` (default 30000): a delivered message not acked for this long is
    ///   redelivered. A handler may run longer: every message delivered and not yet acked is
    ///   signalled in progress within four fifths of it (keep `sessionTimeoutMs` above your
    ///   longest batch of handler calls);
    /// - `max_deliver` (default -1, unlimited), `max_ack_pending`, `backoff_ms` (comma-separated);
    /// - `idle_heartbeat_ms` (0: none, else at least 10): the server's heartbeat on an idle pull
    ///   request, so one lost with a restarting server is made again sooner;
    /// - `pull_expires_ms` (at least 100, default 500): how long one pull request waits;
    /// - `reset` (default false): with an explicit `start` (`earliest`, `latest`, a position or
    ///   a timestamp), deletes the group's existing durables and starts over at `start` (the
    ///   group's progress is forgotten; give it to one run only). Without it an existing
    ///   durable resumes at its ack floor whatever `start` says, as Kafka's
    ///   `auto.offset.reset` applies only to a group without committed offsets.
    #[napi(ts_type = "Record<string, string | boolean | number>")]
    pub options: Option<RawOptions>,
}

impl Known for ConsumerOptions {
    const WHAT: &'static str = "consumer option";
    const KEYS: &'static [(&'static str, Expect)] = &[
        ("start", Expect::String),
        ("isolation", Expect::String),
        ("clientId", Expect::String),
        ("sessionTimeoutMs", Expect::Number),
        ("options", Expect::RawOptions),
    ];
}

/// What the platform can do.
#[napi(object)]
pub struct Capabilities {
    /// Transactions.
    pub transactions: bool,
    /// Idempotent producer.
    pub idempotent_producer: bool,
    /// Broker-side dedup by message id.
    pub dedup_by_id: bool,
    /// Atomic multi-message write.
    pub atomic_batch: bool,
    /// Native headers.
    pub native_headers: bool,
    /// Consumer groups.
    pub consumer_groups: bool,
    /// Seek by timestamp.
    pub seek_by_timestamp: bool,
    /// Pause / resume.
    pub pause_resume: bool,
    /// Per-message nack.
    pub per_message_nack: bool,
    /// Compaction.
    pub compaction: bool,
    /// Lag in milliseconds.
    pub lag_ms: bool,
}

/// A connected platform.
#[napi]
pub struct Client {
    inner: onceflow::Client,
}

#[napi]
impl Client {
    /// Platform name (`memory`, `kafka`, `jetstream`, ...).
    #[napi(getter)]
    pub fn platform(&self) -> String {
        self.inner.platform().to_string()
    }

    /// What the platform can do.
    #[napi]
    pub fn capabilities(&self) -> Capabilities {
        let c = self.inner.capabilities();
        Capabilities {
            transactions: c.transactions,
            idempotent_producer: c.idempotent_producer,
            dedup_by_id: c.dedup_by_id,
            atomic_batch: c.atomic_batch,
            native_headers: c.native_headers,
            consumer_groups: c.consumer_groups,
            seek_by_timestamp: c.seek_by_timestamp,
            pause_resume: c.pause_resume,
            per_message_nack: c.per_message_nack,
            compaction: c.compaction,
            lag_ms: c.lag_ms,
        }
    }

    /// Creates a producer; a `transactionalId` enables transactions.
    #[napi]
    pub async fn producer(
        &self,
        #[napi(ts_arg_type = "ProducerOptions | undefined | null")] options: Option<
            Checked<ProducerOptions>,
        >,
    ) -> Result<Producer> {
        let options = options.map(|c| c.0);
        let o = options.unwrap_or(ProducerOptions {
            transactional_id: None,
            client_id: None,
            idempotent: None,
            options: None,
        });
        let config = ProducerConfig {
            client_id: o.client_id,
            transactional_id: o.transactional_id,
            idempotent: o.idempotent,
            options: o.options.unwrap_or_default().0,
        };
        let client = self.inner.clone();
        on_rt(async move { client.producer(config).await })
            .await
            .map(|inner| Producer { inner })
    }

    /// Creates a consumer of `group` on `topics`.
    #[napi]
    pub async fn consumer(
        &self,
        group: String,
        topics: Vec<String>,
        #[napi(ts_arg_type = "ConsumerOptions | undefined | null")] options: Option<
            Checked<ConsumerOptions>,
        >,
    ) -> Result<Consumer> {
        let o = options.map(|c| c.0).unwrap_or(ConsumerOptions {
            start: None,
            isolation: None,
            client_id: None,
            session_timeout_ms: None,
            options: None,
        });
        let isolation = o
            .isolation
            .as_deref()
            .map_or(Ok(Isolation::default()), str::parse::<Isolation>)
            .map_err(|e| js_err(&e))?;
        let start = o
            .start
            .as_deref()
            .unwrap_or("committed")
            .parse::<StartFrom>()
            .map_err(|e| js_err(&e))?;
        let config = ConsumerConfig {
            group,
            topics,
            start,
            isolation,
            client_id: o.client_id,
            session_timeout: o
                .session_timeout_ms
                .map(|ms| convert::millis("sessionTimeoutMs", ms))
                .transpose()?,
            options: o.options.unwrap_or_default().0,
        };
        let client = self.inner.clone();
        on_rt(async move { client.consumer(config).await })
            .await
            .map(|inner| Consumer {
                inner,
                yielded: Arc::default(),
            })
    }

    /// The admin handle.
    #[napi]
    pub async fn admin(&self) -> Result<Admin> {
        let client = self.inner.clone();
        on_rt(async move { client.admin().await })
            .await
            .map(|inner| Admin { inner })
    }
}

/// A producer.
#[napi]
pub struct Producer {
    pub(crate) inner: onceflow::Producer,
}

#[napi]
impl Producer {
    /// Platform name.
    #[napi(getter)]
    pub fn platform(&self) -> String {
        self.inner.platform().to_string()
    }

    /// The guarantee of a write (`exactly-once`, `effectively-once`, `at-least-once`).
    #[napi(getter)]
    pub fn guarantee(&self) -> String {
        self.inner.guarantee().to_string()
    }

    /// Sends one record; resolves to its delivery.
    #[napi(js_name = "_send")]
    pub async fn send(&self, record: RecordIn) -> Result<Delivery> {
        let record = convert::record(record);
        let p = self.inner.clone();
        on_rt(async move { p.send(record).await })
            .await
            .map(Delivery::from)
    }

    /// Sends records pipelined (one crossing for the batch); one result per record, in order.
    #[napi(js_name = "_sendBatch")]
    pub async fn send_batch(&self, records: Vec<RecordIn>) -> Result<Vec<SendResult>> {
        let records: Vec<_> = records.into_iter().map(convert::record).collect();
        let p = self.inner.clone();
        on_rt(async move { Ok(p.send_batch(records).await) })
            .await
            .map(convert::results)
    }

    /// Writes every record or none, as one atomic batch (`Producer::send_atomic`); resolves to
    /// their deliveries in order.
    #[napi(js_name = "_sendAtomic")]
    pub async fn send_atomic(&self, records: Vec<RecordIn>) -> Result<Vec<Delivery>> {
        let records: Vec<_> = records.into_iter().map(convert::record).collect();
        let p = self.inner.clone();
        on_rt(async move { p.send_atomic(records).await })
            .await
            .map(|ds| ds.into_iter().map(Delivery::from).collect())
    }

    /// Starts a transaction (needs a `transactionalId`).
    #[napi]
    pub async fn begin(&self) -> Result<Transaction> {
        let p = self.inner.clone();
        on_rt(async move { p.begin().await })
            .await
            .map(|tx| Transaction {
                inner: Arc::new(tokio::sync::Mutex::new(Some(tx))),
            })
    }

    /// Waits until everything sent is acknowledged, at most `timeoutMs` (default 30 s).
    #[napi]
    pub async fn flush(&self, timeout_ms: Option<f64>) -> Result<()> {
        let t = convert::millis("timeoutMs", timeout_ms.unwrap_or(30_000.0))?;
        let p = self.inner.clone();
        on_rt(async move { p.flush(t).await }).await
    }

    /// Flushes and releases the producer.
    #[napi]
    pub async fn close(&self) -> Result<()> {
        let p = self.inner.clone();
        on_rt(async move { p.close().await }).await
    }
}

type TxSlot = Arc<tokio::sync::Mutex<Option<onceflow::Transaction>>>;

fn finished() -> Error {
    Error::new(ErrorKind::Closed, "transaction already finished")
}

/// An open transaction; `commit()` or `abort()` ends it. After `abort()` (or a `commit()`
/// that rejected), call `consumer.rewindUncommitted(consumer.assignment())` before reading on,
/// so that the transaction's inputs are given out again.
#[napi]
pub struct Transaction {
    inner: TxSlot,
}

#[napi]
impl Transaction {
    /// Sends a record inside the transaction.
    #[napi(js_name = "_send")]
    pub async fn send(&self, record: RecordIn) -> Result<Delivery> {
        let record = convert::record(record);
        let tx = self.inner.clone();
        on_rt(async move {
            let mut slot = tx.lock().await;
            slot.as_mut().ok_or_else(finished)?.send(record).await
        })
        .await
        .map(Delivery::from)
    }

    /// Sends records inside the transaction; one result per record.
    #[napi(js_name = "_sendBatch")]
    pub async fn send_batch(&self, records: Vec<RecordIn>) -> Result<Vec<SendResult>> {
        let records: Vec<_> = records.into_iter().map(convert::record).collect();
        let tx = self.inner.clone();
        on_rt(async move {
            let mut slot = tx.lock().await;
            Ok(match slot.as_mut() {
                Some(tx) => tx.send_batch(records).await,
                None => records.iter().map(|_| Err(finished())).collect(),
            })
        })
        .await
        .map(convert::results)
    }

    /// Commits `positions` (last processed message per partition) of `consumer`'s group with
    /// the transaction; null: what `consumer` handed out (`batch` and `handedOut` as for its
    /// `_poll`).
    #[napi(js_name = "_commitOffsets")]
    pub async fn commit_offsets(
        &self,
        consumer: &Consumer,
        positions: Option<Vec<PositionIn>>,
        batch: Option<f64>,
        handed_out: Option<u32>,
    ) -> Result<()> {
        let positions = consumer.positions_or_yielded(positions, batch, handed_out)?;
        let group = consumer.inner.group_metadata();
        let tx = self.inner.clone();
        on_rt(async move {
            let group = group.ok_or_else(|| {
                Error::unsupported("this consumer has no group metadata for transactional commits")
            })?;
            let mut slot = tx.lock().await;
            slot.as_mut()
                .ok_or_else(finished)?
                .commit_offsets(&group, &positions)
                .await
        })
        .await
    }

    /// Commits the transaction.
    #[napi]
    pub async fn commit(&self) -> Result<()> {
        let tx = self.inner.clone();
        on_rt(async move { tx.lock().await.take().ok_or_else(finished)?.commit().await }).await
    }

    /// Aborts the transaction; a no-op once finished. Then call
    /// `consumer.rewindUncommitted(consumer.assignment())` before reading on, so that the
    /// transaction's inputs are given out again.
    #[napi]
    pub async fn abort(&self) -> Result<()> {
        let tx = self.inner.clone();
        on_rt(async move {
            match tx.lock().await.take() {
                Some(tx) => tx.abort().await,
                None => Ok(()),
            }
        })
        .await
    }
}

/// A consumer: one member of a consumer group.
#[napi]
pub struct Consumer {
    pub(crate) inner: onceflow::Consumer,
    /// What `commit()` without positions commits.
    yielded: Arc<Yielded>,
}

/// The progress `index.js` keeps: the latest batch's number and how many of its messages it
/// handed out (null: all of them).
fn progress(batch: Option<f64>, handed_out: Option<u32>) -> Progress {
    Progress::new(batch.unwrap_or(0.0) as u64, handed_out.map(|n| n as usize))
}

impl Consumer {
    /// The given positions, or those of the messages handed out.
    fn positions_or_yielded(
        &self,
        positions: Option<Vec<PositionIn>>,
        batch: Option<f64>,
        handed_out: Option<u32>,
    ) -> Result<Vec<(TopicPartition, onceflow::Position)>> {
        match positions {
            Some(p) => convert::positions(p),
            None => Ok(self.yielded.positions(progress(batch, handed_out))),
        }
    }
}

fn tps(v: Vec<TopicPartitionIn>) -> Vec<TopicPartition> {
    v.into_iter()
        .map(|p| TopicPartition::new(p.topic, p.partition))
        .collect()
}

/// A consumer group's committed position in one partition (`Consumer.committed()`).
///
/// `next` is the position the group reads next, not the last processed one that
/// `Consumer.commit()` takes: `commit()` refuses an object with a `next` field.
#[napi(object)]
pub struct Committed {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The next position the group reads (e.g. `offset:42`), or null if nothing is committed
    /// (always present, so `commit()` recognises the entry).
    pub next: Either<String, Null>,
}

/// A topic and partition.
#[napi(object)]
pub struct TopicPartitionIn {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
}

#[napi]
impl Consumer {
    /// Platform name.
    #[napi(getter)]
    pub fn platform(&self) -> String {
        self.inner.platform().to_string()
    }

    /// The consumer group.
    #[napi(getter)]
    pub fn group(&self) -> String {
        self.inner.group().to_string()
    }

    /// Fetches up to `max` messages (default 500), waiting at most `timeoutMs` (default 1000)
    /// for the first; resolves to the batch in columns (no message on timeout), which
    /// `index.js`'s `poll` turns into message objects. One crossing per batch.
    ///
    /// `batch` and `handedOut`: `index.js`'s progress through the latest batch it received
    /// (its `batch` number and how many of its messages it handed to the user, null: all),
    /// for what `commit()` without positions commits.
    #[napi(js_name = "_poll")]
    pub async fn poll(
        &self,
        max: Option<f64>,
        timeout_ms: Option<f64>,
        batch: Option<f64>,
        handed_out: Option<u32>,
    ) -> Result<MessageColumns> {
        let t = convert::millis("timeoutMs", timeout_ms.unwrap_or(1000.0))?;
        let max = Language::Node
            .count("max", max.unwrap_or(500.0), 1)
            .map_err(|e| js_err(&e))? as usize;
        let c = self.inner.clone();
        let yielded = self.yielded.clone();
        on_rt(async move {
            let messages = c.poll(max, t).await?;
            let number = yielded.polled(&messages, progress(batch, handed_out));
            let mut columns = MessageColumns::from(&messages[..]);
            columns.batch = number as f64;
            Ok(columns)
        })
        .await
    }

    /// Commits `positions` (the last processed message of each partition), or, when null,
    /// the last message handed to the user of each partition (`batch` and `handedOut` as for
    /// `_poll`).
    #[napi(js_name = "_commit")]
    pub async fn commit(
        &self,
        positions: Option<Vec<PositionIn>>,
        batch: Option<f64>,
        handed_out: Option<u32>,
    ) -> Result<()> {
        let positions = self.positions_or_yielded(positions, batch, handed_out)?;
        let c = self.inner.clone();
        on_rt(async move { c.commit(&positions).await }).await
    }

    /// The group's committed position of each partition, in the order asked, as
    /// `{ topic, partition, next }`: `next` is where the group resumes, one past the last
    /// processed message (as Kafka's committed offset), or null where it has committed
    /// nothing. Not for `commit()`, which takes processed positions and throws an
    /// `OnceflowError` of kind `config` for an entry of `committed()`.
    #[napi]
    pub async fn committed(&self, partitions: Vec<TopicPartitionIn>) -> Result<Vec<Committed>> {
        let tps = tps(partitions);
        let c = self.inner.clone();
        on_rt(async move { c.committed(&tps).await })
            .await
            .map(|v| {
                v.into_iter()
                    .map(|c| Committed {
                        topic: c.partition.topic,
                        partition: c.partition.partition,
                        next: match c.next {
                            Some(p) => Either::A(p.to_string()),
                            None => Either::B(Null),
                        },
                    })
                    .collect()
            })
    }

    /// Moves the fetch position of an assigned partition: `to` is `earliest`, `latest`,
    /// `timestamp:MS` or a position such as `offset:42` (inclusive).
    #[napi]
    pub async fn seek(&self, topic: String, partition: i32, to: String) -> Result<()> {
        let to = to.parse::<StartFrom>().map_err(|e| js_err(&e))?;
        let tp = TopicPartition::new(topic, partition);
        let c = self.inner.clone();
        let yielded = self.yielded.clone();
        on_rt(async move {
            c.seek(&tp, &to).await?;
            yielded.forget(&tp);
            Ok(())
        })
        .await
    }

    /// After an aborted transaction: gives out again, in order and from the group's committed
    /// position, every message of the partitions that `poll()` returned and no commit covered,
    /// without undoing any acknowledgement. On Pulsar this is the broker's redelivery of
    /// unacknowledged messages (a `seek()` to the committed position would reset the
    /// subscription's cursor and make messages a committed transaction acknowledged past it
    /// unacknowledged again, so they would be processed twice); elsewhere each partition is
    /// sought to its committed position. Resolves to the partitions on which the group has
    /// committed nothing, left as they are for the caller to `seek()`. A transactional loop
    /// calls it after every `abort()` (and after a failed `commit()`) before reading on,
    /// usually with `assignment()`.
    ///
    /// Every partition must be assigned to this consumer now; nothing is done unless all are.
    /// Rejects with an `OnceflowError` of kind `config` for a partition that is not an
    /// integer (1.5, '0'), a negative one, an empty topic or a topic this consumer does not
    /// read, of kind `fenced` for a partition not assigned to it now (moved to another member,
    /// or one the topic does not have), each naming the value, and of kind `closed` once the
    /// consumer is closed, also for an empty array.
    #[napi]
    pub async fn rewind_uncommitted(
        &self,
        partitions: Vec<TopicPartitionIn>,
    ) -> Result<Vec<TopicPartitionIn>> {
        let tps = tps(partitions);
        let c = self.inner.clone();
        let yielded = self.yielded.clone();
        on_rt(async move {
            let left = c.rewind_uncommitted(&tps).await?;
            for tp in &tps {
                yielded.forget(tp);
            }
            Ok(left
                .into_iter()
                .map(|tp| TopicPartitionIn {
                    topic: tp.topic,
                    partition: tp.partition,
                })
                .collect())
        })
        .await
    }

    /// Stops fetching from partitions.
    #[napi]
    pub async fn pause(&self, partitions: Vec<TopicPartitionIn>) -> Result<()> {
        let tps = tps(partitions);
        let c = self.inner.clone();
        on_rt(async move { c.pause(&tps).await }).await
    }

    /// Resumes fetching from partitions.
    #[napi]
    pub async fn resume(&self, partitions: Vec<TopicPartitionIn>) -> Result<()> {
        let tps = tps(partitions);
        let c = self.inner.clone();
        on_rt(async move { c.resume(&tps).await }).await
    }

    /// Partitions assigned to this member now, as `[{topic, partition}]`. Empty until a
    /// `poll()` has joined the group (the group assigns partitions while the consumer polls,
    /// as Kafka's `assignment()`), and after a rebalance took them all away.
    #[napi]
    pub fn assignment(&self) -> Vec<TopicPartitionIn> {
        self.inner
            .assignment()
            .into_iter()
            .map(|tp| TopicPartitionIn {
                topic: tp.topic,
                partition: tp.partition,
            })
            .collect()
    }

    /// Lag per assigned partition.
    #[napi]
    pub async fn lag(&self) -> Result<Vec<Lag>> {
        let c = self.inner.clone();
        on_rt(async move { c.lag().await })
            .await
            .map(|v| v.into_iter().map(Lag::from).collect())
    }

    /// Leaves the group and releases the consumer (does not commit).
    #[napi]
    pub async fn close(&self) -> Result<()> {
        let c = self.inner.clone();
        on_rt(async move { c.close().await }).await
    }
}

/// Topic settings for `createTopic`.
#[napi(object)]
pub struct TopicOptions {
    /// Partitions (default 1).
    pub partitions: Option<u32>,
    /// Retention by time, ms.
    pub retention_ms: Option<f64>,
    /// Retention by size, bytes.
    pub retention_bytes: Option<f64>,
    /// Log compaction.
    pub compacted: Option<bool>,
    /// Raw platform options: strings, booleans (`"true"` / `"false"`) or numbers (`500` →
    /// `"500"`).
    #[napi(ts_type = "Record<string, string | boolean | number>")]
    pub options: Option<RawOptions>,
}

impl Known for TopicOptions {
    const WHAT: &'static str = "topic option";
    const KEYS: &'static [(&'static str, Expect)] = &[
        ("partitions", Expect::Count),
        ("retentionMs", Expect::Number),
        ("retentionBytes", Expect::Number),
        ("compacted", Expect::Boolean),
        ("options", Expect::RawOptions),
    ];
}

/// What `Admin.describeTopic` resolves to.
///
/// The durability fields are read from `options` where the platform reports them
/// (JetStream), and are absent (undefined) elsewhere. With the connection option
/// `require_durable: true` (or `?require_durable=true`), the native client warns once about a
/// JetStream topic whose `durableOnAck` is not `true` when first used, in its Rust `tracing`
/// log, which this package does not forward yet: read `durableOnAck` here to act on it.
#[napi(object)]
pub struct TopicDescription {
    /// Name.
    pub name: String,
    /// Partitions (JetStream: subjects; Kinesis: shards).
    pub partitions: u32,
    /// Retention by time, ms; absent when not set.
    pub retention_ms: Option<f64>,
    /// Retention by size, bytes; absent when not set.
    pub retention_bytes: Option<f64>,
    /// Log compaction.
    pub compacted: bool,
    /// Every setting the platform reports, as text.
    pub options: std::collections::HashMap<String, String>,
    /// `file` or `memory` (a memory stream loses its messages when the server restarts).
    pub storage: Option<String>,
    /// The topic's replica count.
    pub replicas: Option<u32>,
    /// The server's `sync_interval`: `always`, `N ms`, or `unknown` where this client cannot
    /// read it (only a system-account user can).
    pub sync: Option<String>,
    /// `true`: an acknowledged write is synced to disk (file storage, `sync_interval:
    /// always`); `false`: it is not (memory storage, or an interval); absent: cannot be told
    /// (`sync` is `unknown`) or not reported.
    pub durable_on_ack: Option<bool>,
}

/// Topic administration.
#[napi]
pub struct Admin {
    inner: onceflow::Admin,
}

#[napi]
impl Admin {
    /// Creates a topic.
    #[napi]
    pub async fn create_topic(
        &self,
        name: String,
        #[napi(ts_arg_type = "TopicOptions | undefined | null")] options: Option<
            Checked<TopicOptions>,
        >,
    ) -> Result<()> {
        let o = options.map(|c| c.0).unwrap_or(TopicOptions {
            partitions: None,
            retention_ms: None,
            retention_bytes: None,
            compacted: None,
            options: None,
        });
        let spec = TopicSpec {
            name,
            partitions: o.partitions.unwrap_or(1),
            retention_ms: o.retention_ms.map(|v| v as u64),
            retention_bytes: o.retention_bytes.map(|v| v as u64),
            compacted: o.compacted.unwrap_or(false),
            options: o.options.unwrap_or_default().0,
        };
        let a = self.inner.clone();
        on_rt(async move { a.create_topic(&spec).await }).await
    }

    /// Describes a topic, with JetStream's durability report (`storage`, `replicas`, `sync`,
    /// `durableOnAck`). Throws an `OnceflowError` of kind `not_found` when it does not exist.
    #[napi]
    pub async fn describe_topic(&self, name: String) -> Result<TopicDescription> {
        let a = self.inner.clone();
        let d = on_rt(async move { a.describe_topic(&name).await }).await?;
        let durability = onceflow_bindings::durability::Durability::of(&d.options);
        Ok(TopicDescription {
            name: d.name,
            partitions: d.partitions,
            retention_ms: d.retention_ms.map(|v| v as f64),
            retention_bytes: d.retention_bytes.map(|v| v as f64),
            compacted: d.compacted,
            options: d.options.into_iter().collect(),
            storage: durability.storage,
            replicas: durability.replicas,
            sync: durability.sync,
            durable_on_ack: durability.durable_on_ack,
        })
    }

    /// Deletes a topic.
    #[napi]
    pub async fn delete_topic(&self, name: String) -> Result<()> {
        let a = self.inner.clone();
        on_rt(async move { a.delete_topic(&name).await }).await
    }
}
