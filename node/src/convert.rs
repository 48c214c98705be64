//! Type conversions between JavaScript objects and onceflow's model. `index.js` normalises
//! what users pass (strings, header maps) into these shapes before the call crosses.

use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;
use napi::bindgen_prelude::{Buffer, Either, Null};
use napi_derive::napi;
use onceflow::{Headers, Position, Record, TopicPartition};

use crate::js_err;

/// One header: `value` null for a null header, a Buffer otherwise (empty is not null).
#[napi(object)]
pub struct Header {
    /// Header name.
    pub name: String,
    /// Header value; `null` is a null header.
    #[napi(ts_type = "Buffer | null")]
    pub value: Either<Buffer, Null>,
}

/// A record to send, as `index.js` hands it over.
#[napi(object)]
pub struct RecordIn {
    /// Destination topic / stream / subject.
    pub topic: String,
    /// Payload bytes.
    pub payload: Buffer,
    /// Key bytes.
    pub key: Option<Buffer>,
    /// Headers, in order (repeated names kept).
    pub headers: Option<Vec<Header>>,
    /// Explicit partition.
    pub partition: Option<i32>,
    /// Producer timestamp, ms since the epoch.
    pub timestamp: Option<i64>,
    /// Idempotency key (header `idempotency-key`, the platform's message id where it has one).
    pub idempotency_key: Option<String>,
}

fn bytes(b: &Buffer) -> Bytes {
    Bytes::copy_from_slice(b.as_ref())
}

fn buffer(b: &Bytes) -> Buffer {
    Buffer::from(b.to_vec())
}

/// Headers from their JavaScript form.
pub fn headers(h: Option<Vec<Header>>) -> Headers {
    let mut out = Headers::new();
    for Header { name, value } in h.unwrap_or_default() {
        match value {
            Either::A(v) => out.insert(name, bytes(&v)),
            Either::B(_) => out.insert_null(name),
        };
    }
    out
}

/// A record from its JavaScript form.
pub fn record(r: RecordIn) -> Record {
    Record {
        topic: r.topic,
        payload: bytes(&r.payload),
        key: r.key.as_ref().map(bytes),
        headers: headers(r.headers),
        partition: r.partition,
        timestamp: r.timestamp,
        idempotency_key: r.idempotency_key,
    }
}

/// A received message.
#[napi(object)]
pub struct Message {
    /// Topic / stream / subject.
    pub topic: String,
    /// Partition (shard) number.
    pub partition: i32,
    /// Position in its partition, as text (`offset:42`, `seq:7`, ...).
    pub position: String,
    /// Key bytes, or null.
    #[napi(ts_type = "Buffer | null")]
    pub key: Either<Buffer, Null>,
    /// Payload bytes.
    pub payload: Buffer,
    /// Headers in order; a null header has value null.
    pub headers: Vec<Header>,
    /// Milliseconds since the epoch, or null when the platform has none.
    #[napi(ts_type = "number | null")]
    pub timestamp: Either<i64, Null>,
    /// How many times the platform delivered this message (1 on first delivery).
    pub delivery_count: u32,
}

impl From<&onceflow::Message> for Message {
    fn from(m: &onceflow::Message) -> Self {
        Message {
            topic: m.topic.clone(),
            partition: m.partition,
            position: m.position.to_string(),
            key: match &m.key {
                Some(k) => Either::A(buffer(k)),
                None => Either::B(Null),
            },
            payload: buffer(&m.payload),
            headers: m
                .headers
                .iter()
                .map(|h| Header {
                    name: h.name.clone(),
                    value: match &h.value {
                        Some(v) => Either::A(buffer(v)),
                        None => Either::B(Null),
                    },
                })
                .collect(),
            timestamp: match m.timestamp {
                Some(t) => Either::A(t),
                None => Either::B(Null),
            },
            delivery_count: m.delivery_count,
        }
    }
}

/// Where a sent record landed.
#[napi(object)]
pub struct Delivery {
    /// Topic written to.
    pub topic: String,
    /// Partition written to.
    pub partition: i32,
    /// Position assigned by the platform, as text.
    pub position: String,
    /// Timestamp assigned, ms since the epoch, if known.
    pub timestamp: Option<i64>,
    /// The platform recognised the record as a duplicate of one already written.
    pub duplicate: bool,
}

impl From<onceflow::Delivery> for Delivery {
    fn from(d: onceflow::Delivery) -> Self {
        Delivery {
            topic: d.topic,
            partition: d.partition,
            position: d.position.to_string(),
            timestamp: d.timestamp,
            duplicate: d.duplicate,
        }
    }
}

/// The outcome of one record of a batch: `delivery`, or `error` (an encoded OnceflowError
/// that `index.js` decodes).
#[napi(object)]
pub struct SendResult {
    /// Where the record landed.
    pub delivery: Option<Delivery>,
    /// Why it was not written.
    pub error: Option<String>,
}

/// Per-record results of a batch.
pub fn results(rs: Vec<onceflow::Result<onceflow::Delivery>>) -> Vec<SendResult> {
    rs.into_iter()
        .map(|r| match r {
            Ok(d) => SendResult {
                delivery: Some(d.into()),
                error: None,
            },
            Err(e) => SendResult {
                delivery: None,
                error: Some(crate::error_json(&e)),
            },
        })
        .collect()
}

/// A position to commit: the last processed message of a partition.
#[napi(object)]
pub struct PositionIn {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Position text, as in `message.position`.
    pub position: String,
}

/// Positions from their JavaScript form.
pub fn positions(v: Vec<PositionIn>) -> napi::Result<Vec<(TopicPartition, Position)>> {
    v.into_iter()
        .map(|p| {
            let pos = p.position.parse::<Position>().map_err(|e| js_err(&e))?;
            Ok((TopicPartition::new(p.topic, p.partition), pos))
        })
        .collect()
}

/// Lag of one partition.
#[napi(object)]
pub struct Lag {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The group's committed position (next to read), as text.
    pub committed: Option<String>,
    /// End of the partition, as text.
    pub high_watermark: Option<String>,
    /// Messages between the committed position and the end.
    pub messages: f64,
    /// Milliseconds behind the newest message, where the platform reports it.
    pub millis: Option<f64>,
}

impl From<onceflow::PartitionLag> for Lag {
    fn from(l: onceflow::PartitionLag) -> Self {
        Lag {
            topic: l.partition.topic,
            partition: l.partition.partition,
            committed: l.committed.map(|p| p.to_string()),
            high_watermark: l.high_watermark.map(|p| p.to_string()),
            messages: l.messages as f64,
            millis: l.millis.map(|m| m as f64),
        }
    }
}

/// Raw `key=value` options handed to the native client.
pub fn options(o: Option<HashMap<String, String>>) -> BTreeMap<String, String> {
    o.unwrap_or_default().into_iter().collect()
}

/// Milliseconds → Duration, refusing negatives and NaN.
pub fn millis(what: &str, ms: f64) -> napi::Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(ms / 1000.0).map_err(|_| {
        crate::config_err(format!(
            "{what} {ms}: expected a number of milliseconds >= 0"
        ))
    })
}
