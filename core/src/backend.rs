//! The traits every platform adapter implements. They are object safe and async; the public
//! handles ([`crate::Producer`], [`crate::Consumer`], [`crate::Admin`]) wrap `Arc<dyn …>` of
//! them and hold every platform-neutral semantic (trace propagation, validation, metrics), so an
//! adapter only translates to its native client.

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::error::{Error, Result};
use crate::model::{Delivery, Message, Position, Record, StartFrom, TimestampMs, TopicPartition};

/// Delivery reports of records in flight: one result per record, in order (see
/// [`TransactionBackend::enqueue_batch`]).
pub type DeliveriesFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Vec<Result<Delivery>>> + Send + 'static>>;

/// What a platform (and its adapter) can do. A capability that is `false` makes the matching
/// operation fail with [`crate::ErrorKind::Unsupported`], and the conformance suite skips the
/// matching test with that reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    /// Multi-message transactions with input positions committed atomically with the outputs
    /// (Kafka EOS v2, KIP-98 / KIP-447).
    pub transactions: bool,
    /// The producer deduplicates its own retries (Kafka `enable.idempotence`, JetStream
    /// `Nats-Msg-Id`, Pulsar producer name + sequence id).
    pub idempotent_producer: bool,
    /// Records with the same [`Record::idempotency_key`] are deduplicated by the platform within
    /// a window (JetStream duplicate window), even across producer restarts.
    pub dedup_by_id: bool,
    /// Several records can be written all-or-nothing without a transaction (JetStream atomic
    /// batch publish, ADR-50).
    pub atomic_batch: bool,
    /// Native message headers (Kinesis has none: onceflow uses an envelope).
    pub native_headers: bool,
    /// Consumer groups that share partitions between members.
    pub consumer_groups: bool,
    /// Seek / start by timestamp.
    pub seek_by_timestamp: bool,
    /// Pause and resume fetching per partition.
    pub pause_resume: bool,
    /// Redeliver one message on request (JetStream nak, Pulsar negative ack); without it a nack
    /// rewinds the partition to the message.
    pub per_message_nack: bool,
    /// Log compaction by key (Kafka `cleanup.policy=compact`).
    pub compaction: bool,
    /// Lag can be reported in milliseconds as well as messages.
    pub lag_ms: bool,
    /// Single messages of a platform batch are acknowledged on their own (Pulsar batch-index
    /// acknowledgement, PIP-54, where the broker has `acknowledgmentAtBatchIndexLevelEnabled`
    /// on). Without it an adapter holds the acknowledgements of a batch until all its messages
    /// are settled, so a nacked or unfinished message is never acknowledged with its siblings.
    pub batch_index_ack: bool,
}

impl Capabilities {
    /// The capabilities the bindings report (Python's `Client.capabilities()` dict, in this
    /// order), by field name: every field but [`Capabilities::batch_index_ack`], an
    /// acknowledgement detail the engine handles for the user.
    pub fn fields(&self) -> [(&'static str, bool); 11] {
        // Destructured without `..`: a capability added to the struct must be decided here.
        let Capabilities {
            transactions,
            idempotent_producer,
            dedup_by_id,
            atomic_batch,
            native_headers,
            consumer_groups,
            seek_by_timestamp,
            pause_resume,
            per_message_nack,
            compaction,
            lag_ms,
            batch_index_ack: _,
        } = *self;
        [
            ("transactions", transactions),
            ("idempotent_producer", idempotent_producer),
            ("dedup_by_id", dedup_by_id),
            ("atomic_batch", atomic_batch),
            ("native_headers", native_headers),
            ("consumer_groups", consumer_groups),
            ("seek_by_timestamp", seek_by_timestamp),
            ("pause_resume", pause_resume),
            ("per_message_nack", per_message_nack),
            ("compaction", compaction),
            ("lag_ms", lag_ms),
        ]
    }
}

/// The delivery guarantee a producer, consumer or pipeline actually runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Guarantee {
    /// A message may be lost, never processed twice.
    AtMostOnce,
    /// Nothing is lost; a message may be processed (and its outputs written) more than once.
    AtLeastOnce,
    /// Nothing is lost; side effects happen once because duplicates are detected by idempotency
    /// keys (dedup store, platform message ids), not by an atomic commit.
    EffectivelyOnce,
    /// Outputs and input positions are committed in one platform transaction.
    ExactlyOnce,
}

impl fmt::Display for Guarantee {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Guarantee::AtMostOnce => "at-most-once",
            Guarantee::AtLeastOnce => "at-least-once",
            Guarantee::EffectivelyOnce => "effectively-once",
            Guarantee::ExactlyOnce => "exactly-once",
        })
    }
}

/// Configuration of a producer. Typed fields plus `options`, passed verbatim to the native
/// client (librdkafka properties, for example).
#[derive(Debug, Clone, Default)]
pub struct ProducerConfig {
    /// Client id / producer name shown by the platform.
    pub client_id: Option<String>,
    /// Transactional id (Kafka `transactional.id`): required for [`ProducerBackend::begin`] on
    /// platforms with transactions. A new producer with the same id fences the old one.
    pub transactional_id: Option<String>,
    /// Platform-level producer idempotence where available (default `true`).
    pub idempotent: Option<bool>,
    /// Raw `key=value` options for the native client.
    pub options: BTreeMap<String, String>,
}

/// Isolation level of a consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Isolation {
    /// Only committed transactional writes are visible (Kafka `read_committed`). Default.
    #[default]
    ReadCommitted,
    /// Records of open and aborted transactions are visible too.
    ReadUncommitted,
}

/// The text forms, Kafka's `isolation.level` values (KIP-98): `read_committed` or
/// `read_uncommitted`; [`fmt::Display`] writes the same. Errors:
/// [`crate::ErrorKind::Config`] naming the text.
impl std::str::FromStr for Isolation {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "read_committed" => Ok(Isolation::ReadCommitted),
            "read_uncommitted" => Ok(Isolation::ReadUncommitted),
            _ => Err(Error::config(format!(
                "isolation '{}': expected read_committed or read_uncommitted",
                crate::shown(s)
            ))),
        }
    }
}

impl fmt::Display for Isolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Isolation::ReadCommitted => "read_committed",
            Isolation::ReadUncommitted => "read_uncommitted",
        })
    }
}

/// Configuration of a consumer.
#[derive(Debug, Clone, Default)]
pub struct ConsumerConfig {
    /// Consumer group (Kafka group id, JetStream durable name, Pulsar subscription, Kinesis
    /// application name).
    pub group: String,
    /// Topics (streams, subjects) to subscribe to.
    pub topics: Vec<String>,
    /// Where to start without a committed position.
    pub start: StartFrom,
    /// Isolation level.
    pub isolation: Isolation,
    /// Member name / client id within the group.
    pub client_id: Option<String>,
    /// Session timeout: a member that does not poll or heartbeat for this long is removed from
    /// the group and its partitions move.
    pub session_timeout: Option<Duration>,
    /// Raw `key=value` options for the native client.
    pub options: BTreeMap<String, String>,
}

/// Opaque group membership metadata a transaction needs to commit input positions with
/// fencing (Kafka `ConsumerGroupMetadata`, KIP-447).
#[derive(Clone)]
pub struct GroupMetadata {
    /// Group id.
    pub group: String,
    /// Generation of the group when this metadata was taken; a transaction that commits
    /// positions with an older generation is fenced.
    pub generation: i64,
    /// Member id.
    pub member_id: String,
    /// The adapter's native metadata (downcast by the same adapter).
    pub native: Option<Arc<dyn Any + Send + Sync>>,
}

impl fmt::Debug for GroupMetadata {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GroupMetadata")
            .field("group", &self.group)
            .field("generation", &self.generation)
            .field("member_id", &self.member_id)
            .finish()
    }
}

/// Lag of one partition for a consumer group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionLag {
    /// The partition.
    pub partition: TopicPartition,
    /// Next position the group will read (its committed position), if any.
    pub committed: Option<Position>,
    /// End of the partition (Kafka high watermark; next position to be written), if known.
    pub high_watermark: Option<Position>,
    /// Messages between the committed position and the end.
    pub messages: u64,
    /// How far behind the newest message the group is, in ms, where the platform reports it
    /// (Kinesis `MillisBehindLatest`).
    pub millis: Option<u64>,
}

/// Callbacks a backend calls, synchronously and from within [`ConsumerBackend::poll`], when its
/// assignment changes. The engine installs one to commit finished work before partitions move.
pub trait RebalanceListener: Send + Sync {
    /// Partitions newly assigned to this member.
    fn on_assigned(&self, partitions: &[TopicPartition]);
    /// Partitions about to be taken away. Returns the positions to commit first (the last
    /// finished message per partition); the backend commits them before completing the
    /// revocation. Work in flight on these partitions is fenced by the listener.
    fn on_revoked(&self, partitions: &[TopicPartition]) -> Vec<(TopicPartition, Position)>;
    /// Partitions lost without a chance to commit (session expired, fenced).
    fn on_lost(&self, partitions: &[TopicPartition]);
}

/// Producer side of a platform.
#[async_trait]
pub trait ProducerBackend: Send + Sync {
    /// What this producer can do.
    fn capabilities(&self) -> Capabilities;

    /// Sends one record and waits for the platform's acknowledgement.
    async fn send(&self, record: Record) -> Result<Delivery>;

    /// Sends records, pipelined, and waits for every acknowledgement; results in input order.
    /// The default sends them one after another.
    async fn send_batch(&self, records: Vec<Record>) -> Vec<Result<Delivery>> {
        let mut out = Vec::with_capacity(records.len());
        for r in records {
            out.push(self.send(r).await);
        }
        out
    }

    /// Enqueues records and returns their delivery reports (one per record, in input order) as
    /// a future that does not borrow the producer, so the caller can hand over its next records
    /// while these are in flight. Records of successive calls are sent in call order. The
    /// default sends now through [`ProducerBackend::send_batch`] and returns the finished
    /// reports; adapters whose client sends in the background (Kafka) override it.
    async fn enqueue_batch(&self, records: Vec<Record>) -> DeliveriesFuture {
        let done = self.send_batch(records).await;
        Box::pin(std::future::ready(done))
    }

    /// Writes all records or none ([`Capabilities::atomic_batch`]).
    async fn send_atomic(&self, records: Vec<Record>) -> Result<Vec<Delivery>> {
        let _ = records;
        Err(Error::unsupported(
            "atomic batch publish is not supported by this platform",
        ))
    }

    /// Starts a transaction ([`Capabilities::transactions`]; needs a transactional id).
    async fn begin(&self) -> Result<Box<dyn TransactionBackend>> {
        Err(Error::unsupported(
            "transactions are not supported by this platform",
        ))
    }

    /// Settles the outcome of a transaction whose commit ended with an unknown outcome
    /// ([`crate::Error::outcome_unknown`]), so that the group's committed positions read
    /// afterwards are final: Kafka re-initialises the transactional producer (InitProducerId
    /// bumps the producer epoch, which fences the old producer and makes the transaction
    /// coordinator finish the old transaction, committed or aborted; KIP-98). Call it before
    /// reading committed positions to redo work; returns once settled, or the error that
    /// prevented it (retry later). Default: nothing to settle.
    async fn settle_transactions(&self) -> Result<()> {
        Ok(())
    }

    /// Waits until everything sent so far is acknowledged, at most `timeout`.
    async fn flush(&self, timeout: Duration) -> Result<()>;

    /// Flushes and releases the producer.
    async fn close(&self) -> Result<()>;
}

/// An open transaction. Dropping it without commit or abort aborts it.
#[async_trait]
pub trait TransactionBackend: Send {
    /// Sends a record inside the transaction (invisible to read-committed readers until commit).
    async fn send(&mut self, record: Record) -> Result<Delivery>;

    /// Sends records inside the transaction, pipelined; one result per record, in order. The
    /// default sends them one after another; adapters whose client pipelines sends (Kafka)
    /// override it.
    async fn send_batch(&mut self, records: Vec<Record>) -> Vec<Result<Delivery>> {
        let mut out = Vec::with_capacity(records.len());
        for r in records {
            out.push(self.send(r).await);
        }
        out
    }

    /// Enqueues records in the transaction and returns their delivery reports as a future that
    /// does not borrow the transaction, so the caller can go on (read the next batch) while the
    /// records are in flight. One result per record, in order. The caller awaits every such
    /// future before [`TransactionBackend::commit_offsets`] and `commit`, and drops them on
    /// abort. The default sends now through [`TransactionBackend::send_batch`] and returns the
    /// finished reports; adapters whose client sends in the background (Kafka) override it.
    async fn enqueue_batch(&mut self, records: Vec<Record>) -> DeliveriesFuture {
        let done = self.send_batch(records).await;
        Box::pin(std::future::ready(done))
    }

    /// Adds the consumer's positions to the transaction: for each partition, the position of the
    /// last message processed; the committed position becomes the next one.
    async fn commit_offsets(
        &mut self,
        group: &GroupMetadata,
        positions: &[(TopicPartition, Position)],
    ) -> Result<()>;

    /// Commits. On [`crate::ErrorKind::Timeout`] with [`Error::outcome_unknown`] the result is
    /// unknown and the producer re-initialises before its next transaction.
    async fn commit(self: Box<Self>) -> Result<()>;

    /// Aborts: nothing sent in this transaction becomes visible.
    async fn abort(self: Box<Self>) -> Result<()>;
}

/// Consumer side of a platform: one member of a consumer group.
#[async_trait]
pub trait ConsumerBackend: Send + Sync {
    /// What this consumer can do.
    fn capabilities(&self) -> Capabilities;

    /// Installs the listener called on assignment changes (replacing any earlier one).
    fn set_rebalance_listener(&self, listener: Arc<dyn RebalanceListener>);

    /// Fetches up to `max` messages, waiting at most `timeout` for the first. Returns an empty
    /// vector on timeout. Rebalance callbacks run inside this call.
    async fn poll(&self, max: usize, timeout: Duration) -> Result<Vec<Message>>;

    /// Commits, for each partition, the position of the last finished message: the group resumes
    /// after it. Partitions no longer assigned are fenced ([`crate::ErrorKind::Fenced`]).
    async fn commit(&self, positions: &[(TopicPartition, Position)]) -> Result<()>;

    /// Commits positions the platform moved past without delivering anything, where everything
    /// delivered before is committed: on Kafka, transaction markers and aborted transactions'
    /// records after the last delivered record, which would otherwise keep the committed offset
    /// short of the end and lag above 0 for ever (KAFKA-6607). The engine calls it when it has
    /// nothing else to commit, at most once per commit interval. Default: nothing to do.
    async fn commit_skipped(&self) -> Result<()> {
        Ok(())
    }

    /// The group's committed position (next to read) for each partition, `None` where nothing is
    /// committed.
    async fn committed(
        &self,
        partitions: &[TopicPartition],
    ) -> Result<Vec<(TopicPartition, Option<Position>)>>;

    /// Moves the fetch position of an assigned partition; messages already fetched but not yet
    /// returned are discarded.
    async fn seek(&self, partition: &TopicPartition, to: &StartFrom) -> Result<()>;

    /// Gives out again, in order and from the group's committed position, every message of
    /// `partitions` that [`poll`](Self::poll) returned and no commit covered (the inputs of an
    /// aborted transaction), without moving the committed position or undoing any
    /// acknowledgement. Returns the partitions it did this for;
    /// [`Consumer::rewind_uncommitted`](crate::Consumer::rewind_uncommitted) seeks the others
    /// to their committed position.
    ///
    /// Default: none. A seek to the committed position is exact where the group commits one
    /// position per partition (Kafka, Kinesis); it is not where single messages past the
    /// committed position can be acknowledged (Pulsar: a seek resets the subscription's
    /// cursor, which makes acknowledged messages past it unacknowledged again).
    async fn redeliver_uncommitted(
        &self,
        partitions: &[TopicPartition],
    ) -> Result<Vec<TopicPartition>> {
        let _ = partitions;
        Ok(Vec::new())
    }

    /// Stops fetching from these partitions.
    async fn pause(&self, partitions: &[TopicPartition]) -> Result<()>;

    /// Resumes fetching from these partitions.
    async fn resume(&self, partitions: &[TopicPartition]) -> Result<()>;

    /// Partitions currently assigned to this member.
    fn assignment(&self) -> Vec<TopicPartition>;

    /// Lag per assigned partition.
    async fn lag(&self) -> Result<Vec<PartitionLag>>;

    /// Group metadata for transactional offset commits; `None` without consumer groups.
    fn group_metadata(&self) -> Option<GroupMetadata>;

    /// Asks for `message` to be delivered again after `delay`. Platforms without per-message
    /// redelivery rewind the partition to the message (later fetched messages of that partition
    /// are delivered again after it).
    async fn nack(&self, message: &Message, delay: Duration) -> Result<()>;

    /// Tells the platform a message is still being worked on (JetStream `+WPI`), so its ack
    /// deadline does not expire. Default: nothing to do.
    async fn in_progress(&self, message: &Message) -> Result<()> {
        let _ = message;
        Ok(())
    }

    /// Leaves the group (partitions move to other members) and releases the consumer. Does not
    /// commit; callers commit first.
    async fn close(&self) -> Result<()>;
}

/// A topic / stream to create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicSpec {
    /// Name.
    pub name: String,
    /// Partitions (Kafka, Pulsar), shards (Kinesis), subject partitions (JetStream); `>= 1`.
    pub partitions: u32,
    /// Retention by age in ms, `None` = the platform's default.
    pub retention_ms: Option<u64>,
    /// Retention by size in bytes per partition, `None` = unlimited / default.
    pub retention_bytes: Option<u64>,
    /// Keep only the newest record per key (Kafka `cleanup.policy=compact`).
    pub compacted: bool,
    /// Raw platform options (topic configs, stream options).
    pub options: BTreeMap<String, String>,
}

impl TopicSpec {
    /// A topic with `partitions` partitions and platform defaults otherwise.
    pub fn new(name: impl Into<String>, partitions: u32) -> Self {
        TopicSpec {
            name: name.into(),
            partitions,
            retention_ms: None,
            retention_bytes: None,
            compacted: false,
            options: BTreeMap::new(),
        }
    }
}

/// What [`AdminBackend::describe_topic`] returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicDescription {
    /// Name.
    pub name: String,
    /// Number of partitions / shards.
    pub partitions: u32,
    /// Retention by age in ms, if set.
    pub retention_ms: Option<u64>,
    /// Retention by size in bytes, if set.
    pub retention_bytes: Option<u64>,
    /// Whether the topic is compacted.
    pub compacted: bool,
    /// Per partition: (earliest retained position, end position = next to be written).
    pub watermarks: Vec<(Option<Position>, Option<Position>)>,
    /// Other settings as reported by the platform.
    pub options: BTreeMap<String, String>,
}

/// Topic administration.
#[async_trait]
pub trait AdminBackend: Send + Sync {
    /// Creates a topic; [`crate::ErrorKind::Config`] if it exists with other settings.
    async fn create_topic(&self, spec: &TopicSpec) -> Result<()>;
    /// Describes a topic; [`crate::ErrorKind::NotFound`] if it does not exist.
    async fn describe_topic(&self, name: &str) -> Result<TopicDescription>;
    /// Deletes a topic; [`crate::ErrorKind::NotFound`] if it does not exist.
    async fn delete_topic(&self, name: &str) -> Result<()>;
    /// Lag of consumer group `group` on every partition of `topic`, read without joining the
    /// group (so the group is not rebalanced).
    async fn group_lag(&self, group: &str, topic: &str) -> Result<Vec<PartitionLag>> {
        let _ = (group, topic);
        Err(Error::unsupported(
            "reading a group's lag without joining it is not supported by this platform",
        ))
    }
}

/// A connected platform: the factory of producers, consumers and the admin handle.
#[async_trait]
pub trait PlatformBackend: Send + Sync {
    /// Platform name: `kafka`, `jetstream`, `pulsar`, `kinesis`, `memory`.
    fn name(&self) -> &'static str;
    /// What the platform can do.
    fn capabilities(&self) -> Capabilities;
    /// Creates a producer.
    async fn producer(&self, config: ProducerConfig) -> Result<Arc<dyn ProducerBackend>>;
    /// Creates a consumer that joins `config.group` and subscribes to `config.topics`.
    async fn consumer(&self, config: ConsumerConfig) -> Result<Arc<dyn ConsumerBackend>>;
    /// The admin handle.
    async fn admin(&self) -> Result<Arc<dyn AdminBackend>>;
    /// Largest record accepted, in bytes (key + payload + headers).
    fn max_record_bytes(&self) -> usize;
    /// Where [`max_record_bytes`](Self::max_record_bytes) comes from, quoted by the error of a
    /// record over it (for example "message.max.bytes on the kafka:// URL"). Default: nothing
    /// named.
    fn max_record_bytes_source(&self) -> Option<&'static str> {
        None
    }
    /// Validates a topic (stream, subject) name for this platform, so a name the platform would
    /// refuse fails before anything is sent. Default: any name that is not empty.
    ///
    /// Errors: [`crate::ErrorKind::Config`] naming the topic and what was expected.
    fn validate_topic(&self, topic: &str) -> Result<()> {
        if topic.is_empty() {
            return Err(Error::config("topic name is empty: expected a topic name"));
        }
        Ok(())
    }
    /// Validates a header for this platform (JetStream header names are tokens without `:` or
    /// whitespace, for example). Default: any name that is not empty.
    fn validate_header(&self, name: &str, value: Option<&[u8]>) -> Result<()> {
        let _ = value;
        if name.is_empty() {
            return Err(Error::config(
                "header name is empty: expected a non-empty name",
            ));
        }
        Ok(())
    }
}

/// Timestamp helper used by adapters when the platform gives none.
pub fn timestamp_or_now(ts: Option<TimestampMs>) -> TimestampMs {
    ts.unwrap_or_else(crate::model::now_ms)
}
