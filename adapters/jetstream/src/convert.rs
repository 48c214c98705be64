//! Conversions between onceflow's model and async-nats: headers, messages, errors.

use async_nats::header::{HeaderMap, HeaderName, HeaderValue};
use async_nats::jetstream;
use bytes::Bytes;
use std::collections::HashMap;

use onceflow_core::{Error, ErrorKind, Headers, Message, Position, Record};

use crate::naming::{self, KEY_HEADER, KEY_HEX_HEADER, ORDER_HEADER, TIMESTAMP_HEADER};

/// Checks a header for NATS: the name is a token of printable ASCII without `:` (ADR-4).
/// Any value is accepted: values that are not single-line UTF-8 travel hex-encoded (see
/// [`record_headers`]).
pub(crate) fn validate_header(name: &str, _value: Option<&[u8]>) -> onceflow_core::Result<()> {
    // The rule of async-nats' `HeaderName` parser (printable ASCII, no ':'), checked without
    // building (and allocating) a name that is thrown away.
    if name.is_empty() || name.bytes().any(|b| !b.is_ascii_graphic() || b == b':') {
        return Err(Error::config(format!(
            "header name '{}' is not valid on NATS: expected printable ASCII without ':' or \
             whitespace",
            name.escape_debug()
        )));
    }
    Ok(())
}

fn text(v: &[u8]) -> Option<&str> {
    std::str::from_utf8(v)
        .ok()
        .filter(|s| !s.contains(['\r', '\n']))
}

/// Builds the NATS headers of a record.
///
/// Every header becomes a native NATS header of the same name (case kept), so other clients
/// read them. NATS header values are text lines and async-nats keeps headers in a map, so
/// onceflow also writes `onceflow-headers` (when the record has headers or a message id): the
/// names in their original order, space separated,
/// `name:n` for a null header (sent as an empty value) and `name:x` for a value that is not
/// single-line UTF-8 (sent hex-encoded). The key travels in `onceflow-key` (or hex in
/// `onceflow-key-hex`), the record timestamp in `onceflow-timestamp` (ms), and the message id in
/// `Nats-Msg-Id`.
pub(crate) fn record_headers(
    record: &Record,
    msg_id: Option<&str>,
) -> onceflow_core::Result<HeaderMap> {
    let mut map = HeaderMap::new();
    let mut order = Vec::with_capacity(record.headers.len());
    for h in record.headers.iter() {
        let name: HeaderName = h.name.parse().map_err(|_| {
            Error::config(format!(
                "header name '{}' is not valid on NATS: expected printable ASCII without ':'",
                h.name.escape_debug()
            ))
        })?;
        match &h.value {
            None => {
                map.append(name, "");
                order.push(format!("{}:n", h.name));
            }
            Some(v) => match text(v) {
                Some(t) => {
                    map.append(name, t);
                    order.push(h.name.clone());
                }
                None => {
                    map.append(name, hex::encode(v));
                    order.push(format!("{}:x", h.name));
                }
            },
        }
    }
    // Written whenever the message carries headers of onceflow's (the record's, or a message
    // id): it marks them as onceflow's. A record without either goes out without any header
    // block (a plain `PUB`, which the server stores and acks faster than an `HPUB`); read back,
    // no header means no header either way.
    if !record.headers.is_empty() || msg_id.is_some() {
        map.insert(ORDER_HEADER, order.join(" "));
    }
    if let Some(k) = &record.key {
        match text(k) {
            Some(t) => map.insert(KEY_HEADER, t),
            None => map.insert(KEY_HEX_HEADER, hex::encode(k)),
        }
    }
    if let Some(ts) = record.timestamp {
        map.insert(TIMESTAMP_HEADER, ts.to_string());
    }
    if let Some(id) = msg_id {
        map.insert(async_nats::header::NATS_MESSAGE_ID, id);
    }
    Ok(map)
}

/// Key, headers and record timestamp of a message as onceflow wrote them (see
/// [`record_headers`]); a message from another client gets its native headers sorted by name.
pub(crate) fn read_headers(map: Option<&HeaderMap>) -> (Option<Bytes>, Headers, Option<i64>) {
    let Some(map) = map else {
        return (None, Headers::new(), None);
    };
    let first = |name: &str| map.get(name).map(|v| v.as_str().to_string());
    let key = first(KEY_HEADER)
        .map(|k| Bytes::from(k.into_bytes()))
        .or_else(|| first(KEY_HEX_HEADER).and_then(|h| hex::decode(h).ok().map(Bytes::from)));
    let ts = first(TIMESTAMP_HEADER).and_then(|t| t.parse().ok());
    let mut headers = Headers::new();
    if let Some(order) = first(ORDER_HEADER) {
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for token in order.split(' ').filter(|t| !t.is_empty()) {
            let (name, flag) = match token.rsplit_once(':') {
                Some((n, f)) => (n, Some(f)),
                None => (token, None),
            };
            let i = seen.entry(name).or_default();
            let value = map.get_all(name).nth(*i).map(|v| v.as_str().to_string());
            *i += 1;
            match (flag, value) {
                (Some("n"), _) => {
                    headers.insert_null(name.to_string());
                }
                (Some("x"), Some(v)) => {
                    headers.insert(name.to_string(), hex::decode(v).unwrap_or_default());
                }
                (_, Some(v)) => {
                    headers.insert(name.to_string(), v.into_bytes());
                }
                (_, None) => {}
            }
        }
    } else {
        let mut names: Vec<(&HeaderName, &Vec<HeaderValue>)> = map.iter().collect();
        names.sort_by(|a, b| AsRef::<str>::as_ref(a.0).cmp(AsRef::<str>::as_ref(b.0)));
        for (name, values) in names {
            let n: &str = name.as_ref();
            if [KEY_HEADER, KEY_HEX_HEADER, TIMESTAMP_HEADER].contains(&n) {
                continue;
            }
            for v in values {
                headers.insert(n.to_string(), v.as_str().as_bytes().to_vec());
            }
        }
    }
    (key, headers, ts)
}

/// Converts a delivered JetStream message. Its timestamp is the record's (`onceflow-timestamp`)
/// or else the server's publish time.
pub(crate) fn message(topic: &str, m: &jetstream::Message) -> onceflow_core::Result<Message> {
    let info = m.info().map_err(|e| {
        Error::new(
            ErrorKind::Serialization,
            format!(
                "message on '{}' has no JetStream ack subject: {e}",
                m.subject
            ),
        )
    })?;
    let (key, headers, ts) = read_headers(m.headers.as_ref());
    Ok(Message {
        topic: topic.to_string(),
        partition: naming::partition_of_subject(topic, &m.subject),
        position: Position::Sequence(info.stream_sequence),
        key,
        payload: m.payload.clone(),
        headers,
        timestamp: Some(ts.unwrap_or((info.published.unix_timestamp_nanos() / 1_000_000) as i64)),
        delivery_count: info.delivered.max(1) as u32,
    })
}

/// Maps an async-nats error to onceflow's kinds by what it says (async-nats has one error
/// type per operation; their kinds agree on these words).
pub(crate) fn nats_err<E>(context: impl std::fmt::Display, e: E) -> Error
where
    E: Into<onceflow_core::BoxError>,
{
    let e: onceflow_core::BoxError = e.into();
    let text = e.to_string();
    let lower = text.to_lowercase();
    let kind = if lower.contains("timed out") || lower.contains("timeout") {
        ErrorKind::Timeout
    } else if lower.contains("not found")
        || lower.contains("does not exist")
        || lower.contains("no responders")
        || lower.contains("10059")
        || lower.contains("10014")
    {
        ErrorKind::NotFound
    } else if lower.contains("broken pipe")
        || lower.contains("disconnect")
        || lower.contains("connection")
        || lower.contains("jetstream not enabled")
    {
        ErrorKind::Connect
    } else if lower.contains("already in use") || lower.contains("maximum payload") {
        ErrorKind::Config
    } else {
        ErrorKind::Platform
    };
    Error::new(kind, format!("{context}: {text}")).with_source_box(e)
}
