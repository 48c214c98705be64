//! Conversions between onceflow's model and the pulsar crate: properties, keys, message ids,
//! errors.

use std::collections::HashMap;

use bytes::Bytes;
use onceflow_core::{Error, ErrorKind, Headers, Position, Record, TimestampMs};
use pulsar::message::proto::{KeyValue, MessageIdData};

/// Property holding the exact header list (order, repeats, null, binary) as JSON: an array of
/// `[name]` (null), `[name, text]` or `[name, hex, "x"]` (a value that is not UTF-8).
pub const HEADERS_PROPERTY: &str = "onceflow-headers";

/// Message properties for a record's headers.
///
/// Pulsar properties are a map of UTF-8 strings (the pulsar crate keeps them in a `HashMap`), so
/// every header whose value is UTF-8 also becomes a native property of the same name (the
/// first value when a name repeats; a null header is an empty string) — other clients read
/// `traceparent` and friends there. The exact list travels in `onceflow-headers` (on a record
/// with headers; one without has no properties at all): a JSON array
/// of `[name]` (null), `[name, text]` or `[name, hex, "x"]` (a value that is not UTF-8), from
/// which onceflow rebuilds the headers exactly.
pub(crate) fn record_properties(record: &Record) -> HashMap<String, String> {
    if record.headers.is_empty() {
        // Nothing to rebuild: without `onceflow-headers` a message reads back with its
        // properties (none) as headers, the same empty list.
        return HashMap::new();
    }
    let mut props = HashMap::with_capacity(record.headers.len() + 1);
    let mut exact = Vec::with_capacity(record.headers.len());
    for h in record.headers.iter() {
        match &h.value {
            None => {
                props.entry(h.name.clone()).or_insert_with(String::new);
                exact.push(serde_json::json!([h.name]));
            }
            Some(v) => match std::str::from_utf8(v) {
                Ok(t) => {
                    props.entry(h.name.clone()).or_insert_with(|| t.to_string());
                    exact.push(serde_json::json!([h.name, t]));
                }
                Err(_) => {
                    exact.push(serde_json::json!([h.name, hex::encode(v), "x"]));
                }
            },
        }
    }
    // Always written, even empty: it marks the message as onceflow's.
    props.insert(
        HEADERS_PROPERTY.to_string(),
        serde_json::Value::Array(exact).to_string(),
    );
    props
}

/// Headers of a delivered message: rebuilt exactly from `onceflow-headers` when present, else
/// the native properties in their wire order (messages from other clients).
pub(crate) fn read_headers(props: &[KeyValue]) -> Headers {
    let mut headers = Headers::new();
    if let Some(kv) = props.iter().find(|kv| kv.key == HEADERS_PROPERTY) {
        if let Ok(serde_json::Value::Array(items)) = serde_json::from_str(&kv.value) {
            for item in items {
                let serde_json::Value::Array(parts) = item else {
                    continue;
                };
                let name = parts.first().and_then(|v| v.as_str()).unwrap_or_default();
                match (
                    parts.get(1).and_then(|v| v.as_str()),
                    parts.get(2).and_then(|v| v.as_str()),
                ) {
                    (None, _) => {
                        headers.insert_null(name.to_string());
                    }
                    (Some(h), Some("x")) => {
                        headers.insert(name.to_string(), hex::decode(h).unwrap_or_default());
                    }
                    (Some(t), _) => {
                        headers.insert(name.to_string(), t.as_bytes().to_vec());
                    }
                }
            }
            return headers;
        }
    }
    for kv in props {
        headers.insert(kv.key.clone(), kv.value.clone().into_bytes());
    }
    headers
}

/// Our position of a message id: the partition field is the partition index of a partitioned
/// topic and `-1` for a non-partitioned one, the batch index `-1` when not batched.
pub(crate) fn position(id: &MessageIdData, partition: i32) -> Position {
    Position::MessageId {
        ledger: id.ledger_id,
        entry: id.entry_id,
        partition,
        batch: id.batch_index.filter(|b| *b >= 0).unwrap_or(-1),
    }
}

/// The message id of a position (for seeks).
pub(crate) fn message_id(
    pos: &Position,
    partitioned: bool,
) -> onceflow_core::Result<MessageIdData> {
    match pos {
        Position::MessageId {
            ledger,
            entry,
            partition,
            batch,
        } => Ok(MessageIdData {
            ledger_id: *ledger,
            entry_id: *entry,
            partition: partitioned.then_some(*partition),
            batch_index: (*batch >= 0).then_some(*batch),
            ..Default::default()
        }),
        other => Err(Error::config(format!(
            "position {other} is not a Pulsar position: expected pulsar:LEDGER:ENTRY:PARTITION:BATCH"
        ))),
    }
}

/// Sort key of a position within one partition: (ledger, entry, batch).
pub(crate) type PosKey = (u64, u64, i32);

/// The sort key of a Pulsar position.
pub(crate) fn pos_key(pos: &Position) -> onceflow_core::Result<PosKey> {
    match pos {
        Position::MessageId {
            ledger,
            entry,
            batch,
            ..
        } => Ok((*ledger, *entry, *batch)),
        other => Err(Error::config(format!(
            "position {other} is not a Pulsar position: expected pulsar:LEDGER:ENTRY:PARTITION:BATCH"
        ))),
    }
}

/// Key of a delivered message (partition key, Base64-decoded when flagged so).
pub(crate) fn read_key<T>(m: &pulsar::consumer::Message<T>) -> Option<Bytes> {
    match m.key_bytes() {
        Ok(k) => k.map(Bytes::from),
        Err(_) => m.key().map(|k| Bytes::from(k.into_bytes())),
    }
}

/// Timestamp of a delivered message: its event time (the record's timestamp), else the
/// publish time.
pub(crate) fn read_timestamp(meta: &pulsar::message::proto::MessageMetadata) -> TimestampMs {
    match meta.event_time {
        Some(t) if t > 0 => t as i64,
        _ => meta.publish_time as i64,
    }
}

/// Maps a pulsar crate error to onceflow's kinds.
pub(crate) fn pulsar_err(context: impl std::fmt::Display, e: pulsar::Error) -> Error {
    use pulsar::error::{ConnectionError, ConsumerError, ProducerError};
    let text = e.to_string();
    let lower = text.to_lowercase();
    let conn_kind = |c: &ConnectionError| match c {
        ConnectionError::Io(_)
        | ConnectionError::Disconnected
        | ConnectionError::Shutdown
        | ConnectionError::Canceled
        | ConnectionError::NotFound
        | ConnectionError::Tls(_) => ErrorKind::Connect,
        ConnectionError::SlowDown => ErrorKind::Timeout,
        _ => ErrorKind::Platform,
    };
    let kind = match &e {
        pulsar::Error::Connection(c) => conn_kind(c),
        pulsar::Error::Producer(ProducerError::Connection(c)) => conn_kind(c),
        pulsar::Error::Consumer(ConsumerError::Connection(c)) => conn_kind(c),
        pulsar::Error::ServiceDiscovery(_) => ErrorKind::Connect,
        _ if lower.contains("timeout") || lower.contains("timed out") => ErrorKind::Timeout,
        _ if lower.contains("not found") || lower.contains("topicnotfound") => ErrorKind::NotFound,
        _ => ErrorKind::Platform,
    };
    let retriable = matches!(kind, ErrorKind::Connect | ErrorKind::Timeout)
        || lower.contains("timeout")
        || lower.contains("servicenotready");
    let kind = if kind == ErrorKind::Platform && lower.contains("timeout") {
        ErrorKind::Timeout
    } else {
        kind
    };
    Error::new(kind, format!("{context}: {text}"))
        .with_source(e)
        .retriable(retriable)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_exactly() {
        let mut h = Headers::new();
        h.insert("traceparent", "00-abc-def-01")
            .insert("bin", Bytes::from_static(&[0, 0xff]))
            .insert_null("null")
            .insert("empty", Bytes::new())
            .insert("rep", "1")
            .insert("rep", "2");
        let r = Record {
            headers: h.clone(),
            ..Default::default()
        };
        let props = record_properties(&r);
        assert_eq!(props["traceparent"], "00-abc-def-01");
        assert_eq!(props["rep"], "1");
        assert!(!props.contains_key("bin"));
        let kv: Vec<KeyValue> = props
            .into_iter()
            .map(|(key, value)| KeyValue { key, value })
            .collect();
        assert_eq!(read_headers(&kv), h);
        let foreign = vec![KeyValue {
            key: "traceparent".into(),
            value: "x".into(),
        }];
        assert_eq!(read_headers(&foreign).get_str("traceparent"), Some("x"));
    }
}
