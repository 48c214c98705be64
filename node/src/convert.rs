//! Type conversions between JavaScript objects and onceflow's model. `index.js` normalises
//! what users pass (strings, header maps) into these shapes before the call crosses.

use bytes::Bytes;
use napi::bindgen_prelude::{
    Buffer, Either, Float64Array, Int32Array, Null, Object, Uint32Array, Unknown,
};
use napi::ValueType;
use napi_derive::napi;
use onceflow::{Headers, Position, Record, TopicPartition};
use onceflow_bindings::settings::{Language, Value};

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
    /// Requeue generation of the idempotency key (`Record::requeue`); 0 or absent: none.
    pub requeue: Option<u32>,
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
    let record = Record {
        topic: r.topic,
        payload: bytes(&r.payload),
        key: r.key.as_ref().map(bytes),
        headers: headers(r.headers),
        partition: r.partition,
        timestamp: r.timestamp,
        idempotency_key: r.idempotency_key,
    };
    match r.requeue {
        Some(n) if n > 0 => record.requeue(n),
        _ => record,
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

/// A polled batch in columns, the form in which `Consumer.poll` crosses: `index.js` builds the
/// message objects (the shape of [`Message`]) from one Buffer, a few typed arrays and the
/// strings, instead of N-API making an object, an external Buffer and its strings for every
/// message. Per-message columns are in message order.
#[napi(object)]
pub struct MessageColumns {
    /// The distinct topics of the batch.
    pub topics: Vec<String>,
    /// Per message: its topic, as an index into `topics`.
    pub topic: Uint32Array,
    /// Per message: partition (shard) number.
    pub partition: Int32Array,
    /// Per message: position text (`offset:42`, `seq:7`, ...).
    pub position: Vec<String>,
    /// Per message: milliseconds since the epoch, NaN when the platform has none.
    pub timestamp: Float64Array,
    /// Per message: how many times the platform delivered it.
    pub delivery_count: Uint32Array,
    /// Per message: its number of headers.
    pub header_count: Uint32Array,
    /// Every header name, message after message, in order.
    pub header_names: Vec<String>,
    /// Byte lengths, message after message: the key (-1: no key), the payload, then each header
    /// value (-1: a null header).
    pub lengths: Int32Array,
    /// The bytes `lengths` describes, back to back, in the same order.
    pub data: Buffer,
    /// The batch's number for what `commit()` commits (onceflow-bindings' `yielded`): the
    /// latest batch's again when this one is empty.
    pub batch: f64,
}

fn len_i32(n: usize) -> i32 {
    // No platform carries a field of 2 GiB; saturate rather than wrap.
    i32::try_from(n).unwrap_or(i32::MAX)
}

impl From<&[onceflow::Message]> for MessageColumns {
    fn from(ms: &[onceflow::Message]) -> Self {
        let n = ms.len();
        let mut topics: Vec<String> = Vec::new();
        let mut topic = Vec::with_capacity(n);
        let mut partition = Vec::with_capacity(n);
        let mut position = Vec::with_capacity(n);
        let mut timestamp = Vec::with_capacity(n);
        let mut delivery_count = Vec::with_capacity(n);
        let mut header_count = Vec::with_capacity(n);
        let mut header_names = Vec::new();
        let mut lengths = Vec::with_capacity(2 * n);
        let size: usize = ms
            .iter()
            .map(|m| {
                m.payload.len()
                    + m.key.as_ref().map_or(0, |k| k.len())
                    + m.headers
                        .iter()
                        .map(|h| h.value.as_ref().map_or(0, |v| v.len()))
                        .sum::<usize>()
            })
            .sum();
        let mut data = Vec::with_capacity(size);
        for m in ms {
            let t = match topics.iter().position(|t| *t == m.topic) {
                Some(i) => i,
                None => {
                    topics.push(m.topic.clone());
                    topics.len() - 1
                }
            };
            topic.push(t as u32);
            partition.push(m.partition);
            position.push(m.position.to_string());
            timestamp.push(m.timestamp.map_or(f64::NAN, |t| t as f64));
            delivery_count.push(m.delivery_count);
            match &m.key {
                Some(k) => {
                    lengths.push(len_i32(k.len()));
                    data.extend_from_slice(k);
                }
                None => lengths.push(-1),
            }
            lengths.push(len_i32(m.payload.len()));
            data.extend_from_slice(&m.payload);
            header_count.push(m.headers.len() as u32);
            for h in m.headers.iter() {
                header_names.push(h.name.clone());
                match &h.value {
                    Some(v) => {
                        lengths.push(len_i32(v.len()));
                        data.extend_from_slice(v);
                    }
                    None => lengths.push(-1),
                }
            }
        }
        MessageColumns {
            topics,
            topic: Uint32Array::new(topic),
            partition: Int32Array::new(partition),
            position,
            timestamp: Float64Array::new(timestamp),
            delivery_count: Uint32Array::new(delivery_count),
            header_count: Uint32Array::new(header_count),
            header_names,
            lengths: Int32Array::new(lengths),
            data: Buffer::from(data),
            batch: 0.0,
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
    /// How many times the record was sent: 1 when the first attempt was acknowledged.
    /// JetStream publishes again after an ack timeout (same message id) and Kinesis puts again
    /// what a partial failure or throttling refused; Kafka and Pulsar resend inside their
    /// client library without saying so, so it is always 1 there. Each resend is also counted
    /// in the OpenTelemetry counter `onceflow.send_retries`.
    pub attempts: u32,
}

impl From<onceflow::Delivery> for Delivery {
    fn from(d: onceflow::Delivery) -> Self {
        Delivery {
            topic: d.topic,
            partition: d.partition,
            position: d.position.to_string(),
            timestamp: d.timestamp,
            duplicate: d.duplicate,
            attempts: d.attempts,
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

/// Milliseconds → Duration: 0 to 100 years; refuses negatives, NaN and larger values with a
/// config error naming `what` and the value (the bindings' one rule).
pub fn millis(what: &str, ms: f64) -> napi::Result<std::time::Duration> {
    Language::Node.duration(what, ms).map_err(|e| js_err(&e))
}

/// The `(name, value)` pairs of an options object for the bindings' settings table:
/// `undefined` and `null` keep a setting's default; a value of another JavaScript type is
/// named by its `typeof` in the table's error.
pub fn settings(options: Option<&Object>) -> napi::Result<Vec<(String, Value)>> {
    let Some(o) = options else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for name in Object::keys(o)? {
        let value = match o.get::<Unknown>(&name)? {
            None => Value::Absent,
            Some(v) => match v.get_type()? {
                ValueType::Undefined | ValueType::Null => Value::Absent,
                ValueType::Boolean => Value::Bool(o.get::<bool>(&name)?.unwrap_or_default()),
                ValueType::Number => Value::Number(o.get::<f64>(&name)?.unwrap_or_default()),
                ValueType::String => Value::Text(o.get::<String>(&name)?.unwrap_or_default()),
                other => Value::Other(crate::options::type_name(other).into()),
            },
        };
        out.push((name, value));
    }
    Ok(out)
}
