//! The unified message model: [`Message`] (what a consumer reads), [`Record`] (what a producer
//! sends), [`Headers`], [`Position`], [`TopicPartition`], [`Delivery`] and [`StartFrom`].

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};

/// Milliseconds since the Unix epoch (UTC), the unit every platform here can express.
pub type TimestampMs = i64;

/// Current wall-clock time in milliseconds since the Unix epoch.
pub fn now_ms() -> TimestampMs {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// One header: a name and a value that is either absent (`None`, a "null" header) or bytes
/// (possibly empty). Null and empty are distinct.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Header {
    /// Header name, case kept as given.
    pub name: String,
    /// Header value; `None` is a null header, distinct from `Some(empty)`.
    pub value: Option<Bytes>,
}

/// Ordered message headers. Repeated names are kept in order; values are bytes; a null value is
/// distinct from an empty one. Name comparison in [`Headers::get`] is exact (case-sensitive),
/// because Kafka and JetStream headers are case-sensitive.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Headers(Vec<Header>);

impl Headers {
    /// No headers.
    pub fn new() -> Self {
        Headers(Vec::new())
    }

    /// Appends a header with a value, keeping any earlier header of the same name.
    pub fn insert(&mut self, name: impl Into<String>, value: impl Into<Bytes>) -> &mut Self {
        self.0.push(Header {
            name: name.into(),
            value: Some(value.into()),
        });
        self
    }

    /// Appends a null header (no value, distinct from an empty one).
    pub fn insert_null(&mut self, name: impl Into<String>) -> &mut Self {
        self.0.push(Header {
            name: name.into(),
            value: None,
        });
        self
    }

    /// Builder-style [`Headers::insert`].
    pub fn with(mut self, name: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.insert(name, value);
        self
    }

    /// Replaces every header called `name` with exactly one header carrying `value`, at the
    /// position of the first one (or at the end).
    pub fn set(&mut self, name: &str, value: impl Into<Bytes>) -> &mut Self {
        let value = Some(value.into());
        match self.0.iter().position(|h| h.name == name) {
            Some(first) => {
                self.0[first].value = value;
                let mut i = 0;
                self.0.retain(|h| {
                    let keep = i <= first || h.name != name;
                    i += 1;
                    keep
                });
            }
            None => self.0.push(Header {
                name: name.to_string(),
                value,
            }),
        }
        self
    }

    /// Removes every header called `name`; returns how many were removed.
    pub fn remove(&mut self, name: &str) -> usize {
        let before = self.0.len();
        self.0.retain(|h| h.name != name);
        before - self.0.len()
    }

    /// Removes every header whose name is `name` in any ASCII casing (`Traceparent` and
    /// `traceparent` alike); returns how many were removed. For names a specification defines
    /// case-insensitively, such as the W3C trace context headers.
    pub fn remove_ignore_case(&mut self, name: &str) -> usize {
        let before = self.0.len();
        self.0.retain(|h| !h.name.eq_ignore_ascii_case(name));
        before - self.0.len()
    }

    /// The first header called `name`: `None` if absent, `Some(None)` if present and null.
    pub fn get(&self, name: &str) -> Option<Option<&Bytes>> {
        self.0
            .iter()
            .find(|h| h.name == name)
            .map(|h| h.value.as_ref())
    }

    /// [`Headers::get`], or, without a header of exactly that name, the first whose name
    /// matches in any ASCII casing: how onceflow reads its own headers (`idempotency-key`,
    /// `onceflow-key-generation`), which clients that canonicalise names write as
    /// `Idempotency-Key`.
    pub fn get_any_case(&self, name: &str) -> Option<Option<&Bytes>> {
        self.get(name).or_else(|| {
            self.0
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case(name))
                .map(|h| h.value.as_ref())
        })
    }

    /// The first non-null value of `name` as UTF-8 text, if it is valid UTF-8 (a null value
    /// before it is passed over, as the words say; [`Headers::get`] gives the first value
    /// itself).
    pub fn get_str(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .filter(|h| h.name == name)
            .find_map(|h| h.value.as_ref())
            .and_then(|v| std::str::from_utf8(v).ok())
    }

    /// Every value of `name`, in order.
    pub fn get_all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = Option<&'a Bytes>> + 'a {
        self.0
            .iter()
            .filter(move |h| h.name == name)
            .map(|h| h.value.as_ref())
    }

    /// All headers in order.
    pub fn iter(&self) -> std::slice::Iter<'_, Header> {
        self.0.iter()
    }

    /// Number of headers (repeated names counted each time).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are no headers.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Total encoded size in bytes (names plus values), for size limits.
    pub fn size_bytes(&self) -> usize {
        self.0
            .iter()
            .map(|h| h.name.len() + h.value.as_ref().map_or(0, |v| v.len()))
            .sum()
    }
}

impl FromIterator<Header> for Headers {
    fn from_iter<T: IntoIterator<Item = Header>>(iter: T) -> Self {
        Headers(iter.into_iter().collect())
    }
}

impl IntoIterator for Headers {
    type Item = Header;
    type IntoIter = std::vec::IntoIter<Header>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl<'a> IntoIterator for &'a Headers {
    type Item = &'a Header;
    type IntoIter = std::slice::Iter<'a, Header>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

/// Where a message sits in its partition, typed per platform, behind one orderable and
/// serialisable type.
///
/// Positions are ordered only within one partition of one platform: comparing positions of
/// different variants gives `None` from `partial_cmp`.
///
/// The string form (`Display` / `FromStr`) is stable and round-trips:
/// `offset:42`, `seq:42`, `kinesis:49590338271490256608559692538361571095921575989136588898`,
/// `pulsar:LEDGER:ENTRY:PARTITION:BATCH`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Position {
    /// Kafka (and `memory://`) offset, `0..`.
    Offset(i64),
    /// JetStream stream sequence, `1..`.
    Sequence(u64),
    /// Kinesis sequence number: a decimal string of up to 128 digits, compared numerically.
    SequenceNumber(String),
    /// Pulsar `MessageId` (ledger id, entry id, partition index, batch index; `-1` where absent).
    MessageId {
        /// Ledger id.
        ledger: u64,
        /// Entry id within the ledger.
        entry: u64,
        /// Partition index, `-1` for a non-partitioned topic.
        partition: i32,
        /// Index within a batch message, `-1` if not batched.
        batch: i32,
    },
}

impl Position {
    /// The position right after this one, where the platform can compute it (offsets and stream
    /// sequences); `None` for Kinesis sequence numbers and Pulsar message ids.
    pub fn next(&self) -> Option<Position> {
        match self {
            Position::Offset(o) => Some(Position::Offset(o + 1)),
            Position::Sequence(s) => Some(Position::Sequence(s + 1)),
            _ => None,
        }
    }

    /// The Kafka-style offset, if this is one.
    pub fn as_offset(&self) -> Option<i64> {
        match self {
            Position::Offset(o) => Some(*o),
            _ => None,
        }
    }

    /// The JetStream stream sequence, if this is one.
    pub fn as_sequence(&self) -> Option<u64> {
        match self {
            Position::Sequence(s) => Some(*s),
            _ => None,
        }
    }

    /// The highest of `positions` (of one partition), `None` if there are none.
    ///
    /// A batch is not always in position order: JetStream redelivers a message whose `ack_wait`
    /// expired (for example one an earlier owner of the partition held unacked) behind newer
    /// ones, and Pulsar redelivers a negatively acknowledged message after later ones. A commit
    /// of such a batch must name its highest position, not its last, or the newer messages
    /// stay unacknowledged and the partition's lag never reaches 0. Of two positions that do
    /// not compare (different platforms or Pulsar partitions), the later one is kept.
    pub fn highest<'a>(positions: impl IntoIterator<Item = &'a Position>) -> Option<&'a Position> {
        positions
            .into_iter()
            .reduce(|a, b| if a > b { a } else { b })
    }

    /// Replaces `self` with `other` if `other` is higher (or the two do not compare): what a
    /// per-partition "position to commit" does as finished messages arrive, in any order.
    pub fn raise_to(&mut self, other: &Position) {
        if (*self).partial_cmp(other) != Some(Ordering::Greater) {
            other.clone_into(self);
        }
    }
}

fn cmp_decimal(a: &str, b: &str) -> Ordering {
    let a = a.trim_start_matches('0');
    let b = b.trim_start_matches('0');
    a.len().cmp(&b.len()).then_with(|| a.cmp(b))
}

impl PartialOrd for Position {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        match (self, other) {
            (Position::Offset(a), Position::Offset(b)) => Some(a.cmp(b)),
            (Position::Sequence(a), Position::Sequence(b)) => Some(a.cmp(b)),
            (Position::SequenceNumber(a), Position::SequenceNumber(b)) => Some(cmp_decimal(a, b)),
            (
                Position::MessageId {
                    ledger: l1,
                    entry: e1,
                    partition: p1,
                    batch: b1,
                },
                Position::MessageId {
                    ledger: l2,
                    entry: e2,
                    partition: p2,
                    batch: b2,
                },
            ) if p1 == p2 => Some((l1, e1, b1).cmp(&(l2, e2, b2))),
            _ => None,
        }
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Position::Offset(o) => write!(f, "offset:{o}"),
            Position::Sequence(s) => write!(f, "seq:{s}"),
            Position::SequenceNumber(s) => write!(f, "kinesis:{s}"),
            Position::MessageId {
                ledger,
                entry,
                partition,
                batch,
            } => write!(f, "pulsar:{ledger}:{entry}:{partition}:{batch}"),
        }
    }
}

impl FromStr for Position {
    type Err = Error;

    /// Parses the `Display` form. Errors with [`ErrorKind::Config`] naming the input.
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::new(
                ErrorKind::Config,
                format!(
                    "invalid position '{s}': expected offset:N, seq:N, kinesis:DIGITS or \
                     pulsar:LEDGER:ENTRY:PARTITION:BATCH"
                ),
            )
        };
        let (tag, rest) = s.split_once(':').ok_or_else(bad)?;
        match tag {
            "offset" => rest
                .parse::<i64>()
                .ok()
                .filter(|o| *o >= 0)
                .map(Position::Offset)
                .ok_or_else(bad),
            "seq" => rest
                .parse::<u64>()
                .map(Position::Sequence)
                .map_err(|_| bad()),
            "kinesis" => {
                if !rest.is_empty() && rest.len() <= 128 && rest.bytes().all(|b| b.is_ascii_digit())
                {
                    Ok(Position::SequenceNumber(rest.to_string()))
                } else {
                    Err(bad())
                }
            }
            "pulsar" => {
                let parts: Vec<&str> = rest.split(':').collect();
                if parts.len() != 4 {
                    return Err(bad());
                }
                Ok(Position::MessageId {
                    ledger: parts[0].parse().map_err(|_| bad())?,
                    entry: parts[1].parse().map_err(|_| bad())?,
                    partition: parts[2].parse().map_err(|_| bad())?,
                    batch: parts[3].parse().map_err(|_| bad())?,
                })
            }
            _ => Err(bad()),
        }
    }
}

/// A topic (stream) and one of its partitions (Kafka partition, Pulsar partition index, Kinesis
/// shard number — `shardId-000000000007` is 7 —, JetStream partition of a subject-mapped stream,
/// `0` when unpartitioned).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TopicPartition {
    /// Topic, stream or subject name.
    pub topic: String,
    /// Partition number, `0..`.
    pub partition: i32,
}

impl TopicPartition {
    /// `topic`/`partition`.
    pub fn new(topic: impl Into<String>, partition: i32) -> Self {
        TopicPartition {
            topic: topic.into(),
            partition,
        }
    }
}

impl fmt::Display for TopicPartition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[{}]", self.topic, self.partition)
    }
}

/// A message as read by a consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Topic (Kafka, Pulsar), stream (Kinesis) or subject (JetStream) it was read from.
    pub topic: String,
    /// Partition (see [`TopicPartition`]).
    pub partition: i32,
    /// Position within the partition.
    pub position: Position,
    /// Message key (Kafka key, Kinesis partition key, Pulsar key), if any.
    pub key: Option<Bytes>,
    /// Payload bytes.
    pub payload: Bytes,
    /// Headers, in order.
    pub headers: Headers,
    /// Broker or producer timestamp in ms since the epoch, if the platform has one.
    pub timestamp: Option<TimestampMs>,
    /// How many times the platform says it has delivered this message (1 on first delivery),
    /// where it tracks that (JetStream, Pulsar, `memory://`); `1` otherwise.
    pub delivery_count: u32,
}

impl Message {
    /// The message's topic and partition.
    pub fn topic_partition(&self) -> TopicPartition {
        TopicPartition::new(self.topic.clone(), self.partition)
    }
}

/// A message to send.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Record {
    /// Destination topic / stream / subject.
    pub topic: String,
    /// Key: selects the partition by hash unless `partition` is set.
    pub key: Option<Bytes>,
    /// Payload bytes.
    pub payload: Bytes,
    /// Headers, in order (trace context is added on send).
    pub headers: Headers,
    /// Explicit partition; `None` = by key hash (round-robin / sticky without a key).
    pub partition: Option<i32>,
    /// Producer timestamp in ms; `None` = the platform's default.
    pub timestamp: Option<TimestampMs>,
    /// Idempotency key of this record: written to the `idempotency-key` header and used as the
    /// platform's message id where it has one (JetStream `Nats-Msg-Id`). Deterministic ids make
    /// retries and replays deduplicable.
    pub idempotency_key: Option<String>,
}

impl Record {
    /// A record for `topic` with a payload.
    pub fn new(topic: impl Into<String>, payload: impl Into<Bytes>) -> Self {
        Record {
            topic: topic.into(),
            payload: payload.into(),
            ..Default::default()
        }
    }

    /// Sets the key.
    pub fn key(mut self, key: impl Into<Bytes>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Appends a header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.headers.insert(name, value);
        self
    }

    /// Sets the partition explicitly.
    pub fn partition(mut self, partition: i32) -> Self {
        self.partition = Some(partition);
        self
    }

    /// Sets the idempotency key.
    pub fn idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.idempotency_key = Some(key.into());
        self
    }

    /// Requeues a job already processed, on purpose: generation `generation` of its
    /// idempotency key, written to the [`KEY_GENERATION_HEADER`] header (`0` removes it: the
    /// record is the key's first generation, byte for byte what it was without this call).
    ///
    /// A generation `n > 0` makes the record new to both sides of the pipe while its
    /// idempotency key stays the same: the platform's message id becomes `{key}#requeue-{n}`
    /// (see [`Record::message_id`]; JetStream's duplicate window drops only repeats of that
    /// id) and the idempotent consumer's dedup key gets the same suffix, so the handler runs
    /// once more, once per generation. Sending generation `n` twice is deduplicated like any
    /// repeat. Send errors: [`crate::ErrorKind::Config`] when the record has no idempotency
    /// key ([`Record::idempotency_key`] or the `idempotency-key` header).
    pub fn requeue(mut self, generation: u32) -> Self {
        if generation == 0 {
            self.headers.remove(KEY_GENERATION_HEADER);
        } else {
            self.headers
                .set(KEY_GENERATION_HEADER, generation.to_string().into_bytes());
        }
        self
    }

    /// The generation of this record's idempotency key set by [`Record::requeue`]; `0` when
    /// it has none. A header that is not a decimal number from 0 to 4294967295 is a
    /// [`crate::ErrorKind::Config`] naming it.
    pub fn key_generation(&self) -> crate::Result<u32> {
        parse_generation(self.headers.get_any_case(KEY_GENERATION_HEADER).flatten())
    }

    /// The platform message id of this record (JetStream `Nats-Msg-Id`): its idempotency key
    /// for generation 0, `{key}#requeue-{n}` for generation `n` (see [`Record::requeue`]);
    /// `None` without an idempotency key. Adapters take the id from here, never from the key.
    pub fn message_id(&self) -> Option<std::borrow::Cow<'_, str>> {
        let key = self.idempotency_key.as_deref()?;
        match self.headers.get_any_case(KEY_GENERATION_HEADER).flatten() {
            Some(g) if !generation_is_zero(g) => {
                Some(std::borrow::Cow::Owned(with_generation(key.to_string(), g)))
            }
            _ => Some(std::borrow::Cow::Borrowed(key)),
        }
    }

    /// Approximate size in bytes (key + payload + headers), for size limits.
    pub fn size_bytes(&self) -> usize {
        self.key.as_ref().map_or(0, |k| k.len()) + self.payload.len() + self.headers.size_bytes()
    }
}

/// Header carrying the generation of a requeued record's idempotency key (see
/// [`Record::requeue`]): a decimal number, absent for generation 0.
pub const KEY_GENERATION_HEADER: &str = "onceflow-key-generation";

fn generation_is_zero(g: &[u8]) -> bool {
    g.iter().all(|b| *b == b'0')
}

/// The longest part of a malformed generation header that goes into a key.
const MAX_GENERATION_TEXT: usize = 32;

/// `key` of generation `g` (the header's text): `{key}#requeue-{n}` with `n` in canonical
/// decimal (`007` is 7, `00` is generation 0: `key` itself), so the sender's message id and
/// the consumer's dedup key agree on one form. A header that is no number (from another
/// producer) still makes a key of its own, with at most [`MAX_GENERATION_TEXT`] characters
/// of it, so a huge header cannot make a huge key.
pub(crate) fn with_generation(mut key: String, g: &[u8]) -> String {
    if generation_is_zero(g) {
        return key;
    }
    key.push_str("#requeue-");
    match parse_generation(Some(&Bytes::copy_from_slice(g))) {
        Ok(n) => key.push_str(&n.to_string()),
        Err(_) => key.extend(String::from_utf8_lossy(g).chars().take(MAX_GENERATION_TEXT)),
    }
    key
}

pub(crate) fn parse_generation(g: Option<&Bytes>) -> crate::Result<u32> {
    let Some(g) = g else { return Ok(0) };
    std::str::from_utf8(g)
        .ok()
        .filter(|t| t.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|t| t.parse::<u32>().ok())
        .ok_or_else(|| {
            crate::Error::config(format!(
                "header {KEY_GENERATION_HEADER} '{}': expected a whole number from 0 to {}",
                crate::shown(&String::from_utf8_lossy(g)),
                u32::MAX
            ))
        })
}

/// What a successful send returns: where the record landed, and how many attempts it took.
///
/// `#[non_exhaustive]`: adapters build it with [`Delivery::new`] and its setters, so a field
/// added later breaks none of them; every field stays public to read.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Delivery {
    /// Topic written to.
    pub topic: String,
    /// Partition written to.
    pub partition: i32,
    /// Position assigned by the platform.
    pub position: Position,
    /// Timestamp assigned, ms since the epoch, if known.
    pub timestamp: Option<TimestampMs>,
    /// The platform recognised this record as a duplicate of one already written (JetStream
    /// `duplicate` publish ack); the position is the original one. With `attempts` above 1 and
    /// an idempotency key, the copy already written may be this send's own earlier attempt
    /// whose acknowledgement was lost (onceflow cannot tell it from an earlier send of the
    /// key); for a record without a key it always is, and `duplicate` is false.
    pub duplicate: bool,
    /// How many times onceflow sent the record before this acknowledgement: `1` when the
    /// first attempt was acknowledged, `n` after `n - 1` resends. Each resend is also counted
    /// in the OpenTelemetry counter [`crate::metrics::SEND_RETRIES`] (and
    /// [`crate::metrics::send_retries`]), failed sends' resends included. What an attempt is,
    /// per platform:
    ///
    /// - **JetStream**: one publish. A publish whose ack does not come within the producer's
    ///   `publish_timeout_ms` (a lost ack, a slow server) is published again with the same
    ///   `Nats-Msg-Id`, at most `publish_retries` times, and the stream's duplicate window
    ///   stores it once (NATS docs, "JetStream Model Deep Dive", message deduplication). A
    ///   record without a message id (`idempotent=false` and no idempotency key) and an atomic
    ///   batch (ADR-50) are never resent: always `1`.
    /// - **Kinesis**: one PutRecords request carrying the record. Entries that failed in a
    ///   partial failure (`ProvisionedThroughputExceededException`, `InternalFailure`: AWS
    ///   Kinesis API Reference, PutRecords) are put again, at most `put_attempts` requests by
    ///   onceflow; a request the AWS SDK retried itself (its standard retry mode: throttling
    ///   and transient errors of the whole request) counts each of its HTTP attempts.
    /// - **memory**: always `1`.
    /// - **Kafka**: always `1`, the one time onceflow hands the record to librdkafka; its
    ///   resends are not visible. librdkafka resends a failed produce request's messages
    ///   itself (`retries` / `message.send.max.retries`, default 2147483647, bounded by
    ///   `delivery.timeout.ms`: librdkafka CONFIGURATION.md; KIP-91), without duplicates on
    ///   an idempotent producer (KIP-98, onceflow's default), and its delivery report carries
    ///   no count. Its statistics' `txretries` (STATISTICS.md) counts retried protocol
    ///   requests, not these resends (they go back to the partition queue and leave in a new
    ///   produce request), so it is not reported as send retries either.
    /// - **Pulsar**: always `1`, the one time onceflow hands the record to the pulsar crate.
    ///   The crate resends the messages still waiting for a receipt when it re-creates its
    ///   producer after a broken connection or a closed producer (until `operation_timeout`),
    ///   and the send receipt (`CommandSendReceipt`) carries no count; a resend the broker had
    ///   stored already (PIP-6 deduplication) comes back as a [`Delivery::duplicate`].
    pub attempts: u32,
}

impl Delivery {
    /// A delivery to `partition` of `topic` at `position`, acknowledged on the first attempt:
    /// no timestamp, not a duplicate, `attempts` 1.
    pub fn new(topic: impl Into<String>, partition: i32, position: Position) -> Self {
        Delivery {
            topic: topic.into(),
            partition,
            position,
            timestamp: None,
            duplicate: false,
            attempts: 1,
        }
    }

    /// Sets the timestamp the platform assigned (`None`: not known).
    pub fn timestamp(mut self, timestamp: Option<TimestampMs>) -> Self {
        self.timestamp = timestamp;
        self
    }

    /// Marks the record as a duplicate of one already written (or not).
    pub fn duplicate(mut self, duplicate: bool) -> Self {
        self.duplicate = duplicate;
        self
    }

    /// Sets how many attempts the send took (see [`Delivery::attempts`]; at least 1).
    pub fn attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts.max(1);
        self
    }
}

/// Where a consumer starts in a partition that has no committed position (or always, for the
/// explicit variants).
///
/// One exception: on JetStream a group's progress lives in each partition's durable consumer,
/// and an explicit start meeting an existing durable resumes it (with a warning), as Kafka's
/// `auto.offset.reset` would, because starting over means deleting the durable and the
/// group's progress with it; the consumer option `reset=true` asks for that, and
/// `Consumer::seek` always does it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StartFrom {
    /// The group's committed position; where there is none, the fallback.
    Committed {
        /// Where to start without a committed position: `Earliest` or `Latest`.
        fallback: Box<StartFrom>,
    },
    /// The oldest retained message.
    Earliest,
    /// Only messages written after the consumer started.
    Latest,
    /// A given position (inclusive).
    Position(Position),
    /// The first message with a timestamp at or after this time (ms since the epoch); when no
    /// message is that late, the end of the partition.
    Timestamp(TimestampMs),
}

impl StartFrom {
    /// Committed, else earliest: the usual default for a new consumer group.
    pub fn committed_or_earliest() -> Self {
        StartFrom::Committed {
            fallback: Box::new(StartFrom::Earliest),
        }
    }

    /// Committed, else latest.
    pub fn committed_or_latest() -> Self {
        StartFrom::Committed {
            fallback: Box::new(StartFrom::Latest),
        }
    }

    /// Checks what no platform can mean: a timestamp before the epoch (Kafka's ListOffsets
    /// would read -1 as "latest" and -2 as "earliest", KIP-79), or a committed start whose
    /// fallback is not `Earliest`, `Latest` or a valid timestamp or position.
    /// [`ErrorKind::Config`] naming the value otherwise.
    pub fn validate(&self) -> crate::Result<()> {
        match self {
            StartFrom::Timestamp(ms) if *ms < 0 => Err(crate::Error::config(format!(
                "start timestamp {ms}: expected milliseconds since the epoch, >= 0"
            ))),
            StartFrom::Committed { fallback } => match fallback.as_ref() {
                StartFrom::Committed { .. } => Err(crate::Error::config(
                    "start from committed with a committed fallback: expected Earliest, Latest, \
                     a timestamp or a position as the fallback",
                )),
                other => other.validate(),
            },
            _ => Ok(()),
        }
    }
}

/// The text forms of [`StartFrom`], as the CLI and the bindings accept them:
///
/// | text | meaning |
/// |---|---|
/// | `committed` (or `committed-or-earliest`) | the group's committed position, else the earliest |
/// | `committed-or-latest` | the group's committed position, else the latest |
/// | `earliest` / `latest` | the oldest retained message / only new messages |
/// | `timestamp:MS` (or `ts:MS`) | the first message at or after MS milliseconds since the epoch |
/// | a position (`offset:42`, `seq:7`, `kinesis:DIGITS`, `pulsar:L:E:P:B`) | that message, inclusive |
///
/// Errors: [`ErrorKind::Config`] naming the text and the accepted forms (a timestamp before
/// the epoch too, as [`StartFrom::validate`] refuses it).
impl FromStr for StartFrom {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        let start = match text {
            "committed" | "committed-or-earliest" => StartFrom::committed_or_earliest(),
            "committed-or-latest" => StartFrom::committed_or_latest(),
            "earliest" => StartFrom::Earliest,
            "latest" => StartFrom::Latest,
            _ => {
                if let Some(ms) = text
                    .strip_prefix("timestamp:")
                    .or_else(|| text.strip_prefix("ts:"))
                {
                    match ms.parse::<i64>() {
                        Ok(ms) if ms >= 0 => StartFrom::Timestamp(ms),
                        _ => {
                            let shown = crate::shown(text);
                            return Err(Error::config(format!(
                                "start '{shown}': expected ts:MS (or timestamp:MS), MS a whole \
                                 number of milliseconds since the epoch, from 0"
                            )));
                        }
                    }
                } else {
                    text.parse::<Position>()
                        .map(StartFrom::Position)
                        .map_err(|_| {
                            Error::config(format!(
                                "start '{}': expected committed, committed-or-latest, earliest, \
                                 latest, ts:MS (or timestamp:MS, milliseconds since the epoch) \
                                 or a position (offset:N, seq:N, kinesis:DIGITS, \
                                 pulsar:LEDGER:ENTRY:PARTITION:BATCH)",
                                crate::shown(text)
                            ))
                        })?
                }
            }
        };
        Ok(start)
    }
}

impl Default for StartFrom {
    fn default() -> Self {
        StartFrom::committed_or_earliest()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn get_str_takes_the_first_non_null_value() {
        let mut h = Headers::new();
        h.insert_null("k").insert("k", "v1").insert("k", "v2");
        assert_eq!(h.get("k"), Some(None));
        assert_eq!(h.get_str("k"), Some("v1"));
        assert_eq!(h.get_all("k").count(), 3);
        assert_eq!(h.get_str("missing"), None);
    }

    #[test]
    fn starts_parse_from_every_text_form_and_refuse_others_by_name() {
        for (text, want) in [
            ("committed", StartFrom::committed_or_earliest()),
            ("committed-or-earliest", StartFrom::committed_or_earliest()),
            ("committed-or-latest", StartFrom::committed_or_latest()),
            ("earliest", StartFrom::Earliest),
            ("latest", StartFrom::Latest),
            (
                "timestamp:1700000000000",
                StartFrom::Timestamp(1_700_000_000_000),
            ),
            ("ts:5", StartFrom::Timestamp(5)),
            ("offset:42", StartFrom::Position(Position::Offset(42))),
        ] {
            assert_eq!(text.parse::<StartFrom>().unwrap(), want, "{text}");
        }
        for bad in ["timestamp:-1", "timestamp:soon", "oldest", ""] {
            let e = bad.parse::<StartFrom>().unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::Config);
            assert!(e.message().contains(bad), "{bad}: {}", e.message());
        }
    }

    #[test]
    fn starts_before_the_epoch_or_nested_committed_are_config_errors() {
        for ok in [
            StartFrom::Earliest,
            StartFrom::Latest,
            StartFrom::Timestamp(0),
            StartFrom::Position(Position::Offset(3)),
            StartFrom::committed_or_latest(),
            StartFrom::Committed {
                fallback: Box::new(StartFrom::Timestamp(1_700_000_000_000)),
            },
        ] {
            ok.validate().unwrap();
        }
        let e = StartFrom::Timestamp(-1).validate().unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Config);
        assert!(
            e.message().contains("-1") && e.message().contains(">= 0"),
            "{e}"
        );
        let e = StartFrom::Committed {
            fallback: Box::new(StartFrom::Timestamp(-2)),
        }
        .validate()
        .unwrap_err();
        assert!(e.message().contains("-2"), "{e}");
        let nested = StartFrom::Committed {
            fallback: Box::new(StartFrom::committed_or_earliest()),
        };
        assert_eq!(
            nested.validate().unwrap_err().kind(),
            crate::ErrorKind::Config
        );
    }

    #[test]
    fn headers_keep_order_repeats_and_null() {
        let mut h = Headers::new();
        h.insert("a", "1")
            .insert("b", "")
            .insert_null("c")
            .insert("a", "2");
        assert_eq!(h.len(), 4);
        let all: Vec<_> = h.get_all("a").collect();
        assert_eq!(all, vec![Some(&Bytes::from("1")), Some(&Bytes::from("2"))]);
        assert_eq!(h.get("b"), Some(Some(&Bytes::new())));
        assert_eq!(h.get("c"), Some(None));
        assert_eq!(h.get("d"), None);
        h.set("a", "3");
        assert_eq!(h.get_all("a").count(), 1);
        assert_eq!(h.iter().next().unwrap().name, "a");
        assert_eq!(h.get_str("a"), Some("3"));
    }

    #[test]
    fn positions_round_trip_and_order() {
        for s in [
            "offset:0",
            "seq:7",
            "kinesis:49590338271490256608559692538361571095921575989136588898",
            "pulsar:12:3:-1:-1",
        ] {
            let p: Position = s.parse().unwrap();
            assert_eq!(p.to_string(), s);
        }
        assert!(Position::Offset(1) < Position::Offset(2));
        assert!(Position::SequenceNumber("99".into()) < Position::SequenceNumber("100".into()));
        assert_eq!(
            Position::Offset(1).partial_cmp(&Position::Sequence(1)),
            None
        );
        let e = "offset:-3".parse::<Position>().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.message().contains("offset:-3"));
        assert!("kinesis:12a".parse::<Position>().is_err());
    }

    #[test]
    fn a_delivery_is_one_attempt_until_told_otherwise() {
        let d = Delivery::new("t", 2, Position::Offset(7));
        assert_eq!((d.topic.as_str(), d.partition), ("t", 2));
        assert_eq!(d.position, Position::Offset(7));
        assert_eq!((d.timestamp, d.duplicate, d.attempts), (None, false, 1));
        let d = d.timestamp(Some(5)).duplicate(true).attempts(3);
        assert_eq!((d.timestamp, d.duplicate, d.attempts), (Some(5), true, 3));
        assert_eq!(
            d.attempts(0).attempts,
            1,
            "a send takes at least one attempt"
        );
    }
}

#[cfg(test)]
mod requeue_tests {
    use super::*;

    #[test]
    fn generation_zero_keeps_the_key_as_message_id_and_a_requeue_gets_its_own() {
        let r = Record::new("t", "p").idempotency_key("job-1");
        assert!(matches!(
            r.message_id(),
            Some(std::borrow::Cow::Borrowed("job-1"))
        ));
        assert_eq!(r.key_generation().unwrap(), 0);
        let r0 = r.clone().requeue(0);
        assert_eq!(r0.headers, r.headers, "generation 0 adds nothing");
        let r2 = r.clone().requeue(2);
        assert_eq!(r2.message_id().as_deref(), Some("job-1#requeue-2"));
        assert_eq!(r2.key_generation().unwrap(), 2);
        assert_eq!(r2.headers.get_str(KEY_GENERATION_HEADER), Some("2"));
        assert_eq!(r2.requeue(0).headers, r.headers, "back to generation 0");
        // One canonical form on both sides: leading zeros, an all-zero header, a huge header.
        assert_eq!(with_generation("k".into(), b"007"), "k#requeue-7");
        assert_eq!(with_generation("k".into(), b"00"), "k");
        assert_eq!(
            with_generation("k".into(), &[b'x'; 10_000]).len(),
            "k#requeue-".len() + 32
        );
        assert_eq!(Record::new("t", "p").requeue(1).message_id(), None);
    }

    #[test]
    fn a_malformed_generation_header_is_a_config_error_naming_it() {
        let r = Record::new("t", "p").header(KEY_GENERATION_HEADER, "-1");
        let e = r.key_generation().unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Config);
        assert!(e.message().contains("'-1'") && e.message().contains(KEY_GENERATION_HEADER));
    }
}
