//! Conversions between onceflow's model and async-nats: headers, messages, errors.

use async_nats::header::{HeaderMap, HeaderName, HeaderValue};
use async_nats::jetstream;
use bytes::Bytes;
use std::collections::HashMap;

use onceflow_core::{
    trace, Error, ErrorKind, Headers, Message, Position, Record, IDEMPOTENCY_KEY_HEADER,
};

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
    // Written whenever the message carries headers of onceflow's (the record's, or a message
    // id): it marks them as onceflow's. A record without either goes out without any header
    // block (a plain `PUB`, which the server stores and acks faster than an `HPUB`); read back,
    // no header means no header either way.
    let marked = !record.headers.is_empty() || msg_id.is_some();
    if marked {
        let mut order = String::with_capacity(
            record
                .headers
                .iter()
                .map(|h| h.name.len() + 3)
                .sum::<usize>(),
        );
        for (i, h) in record.headers.iter().enumerate() {
            let name = header_name(&h.name)?;
            if i > 0 {
                order.push(' ');
            }
            order.push_str(&h.name);
            match &h.value {
                None => {
                    map.append(name, "");
                    order.push_str(":n");
                }
                Some(v) => match text(v) {
                    Some(t) => map.append(name, t),
                    None => {
                        map.append(name, hex::encode(v));
                        order.push_str(":x");
                    }
                },
            }
        }
        map.insert(ORDER, order);
    }
    if let Some(k) = &record.key {
        match text(k) {
            Some(t) => map.insert(KEY, t),
            None => map.insert(KEY_HEX, hex::encode(k)),
        }
    }
    if let Some(ts) = record.timestamp {
        map.insert(TIMESTAMP, ts.to_string());
    }
    if let Some(id) = msg_id {
        map.insert(async_nats::header::NATS_MESSAGE_ID, id);
    }
    Ok(map)
}

const ORDER: HeaderName = HeaderName::from_static(ORDER_HEADER);
const KEY: HeaderName = HeaderName::from_static(KEY_HEADER);
const KEY_HEX: HeaderName = HeaderName::from_static(KEY_HEX_HEADER);
const TIMESTAMP: HeaderName = HeaderName::from_static(TIMESTAMP_HEADER);

/// The NATS name of a record header: the names onceflow itself writes on most records
/// (`idempotency-key`, W3C trace context) without parsing or allocating, others parsed.
fn header_name(name: &str) -> onceflow_core::Result<HeaderName> {
    const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static(IDEMPOTENCY_KEY_HEADER);
    const TRACEPARENT: HeaderName = HeaderName::from_static(trace::TRACEPARENT);
    const TRACESTATE: HeaderName = HeaderName::from_static(trace::TRACESTATE);
    const BAGGAGE: HeaderName = HeaderName::from_static(trace::BAGGAGE);
    Ok(match name {
        IDEMPOTENCY_KEY_HEADER => IDEMPOTENCY_KEY,
        trace::TRACEPARENT => TRACEPARENT,
        trace::TRACESTATE => TRACESTATE,
        trace::BAGGAGE => BAGGAGE,
        _ => name.parse().map_err(|_| {
            Error::config(format!(
                "header name '{}' is not valid on NATS: expected printable ASCII without ':'",
                name.escape_debug()
            ))
        })?,
    })
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
    // async-nats names the JetStream API's "no responders" "requested JetStream resource
    // does not exist" (`RequestErrorKind::NoResponders`); a stream or consumer that is really
    // missing is the server's answer with code 10059 / 10014 instead.
    if lower.contains("no responders")
        || lower.contains("requested jetstream resource does not exist")
        || lower.contains("temporarily unavailable")
        || lower.contains("10008")
    {
        // Nobody answered the JetStream API (the server is starting, restarting or recovering
        // its streams, or lost its cluster quorum): transient, unlike a stream that is not
        // there (which the server answers with code 10059).
        return Error::new(
            ErrorKind::Connect,
            format!(
                "{context}: {text} (JetStream is not answering: the server may be restarting \
                 or recovering; retry)"
            ),
        )
        .with_source_box(e)
        .retriable(true);
    }
    let kind = if lower.contains("timed out") || lower.contains("timeout") {
        ErrorKind::Timeout
    } else if lower.contains("not found")
        || lower.contains("does not exist")
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The wire format other clients read: header names, values and the order header.
    #[test]
    fn record_headers_wire_format() {
        let mut r = Record::new("t", Bytes::from_static(b"p"))
            .key(Bytes::from_static(b"k1"))
            .idempotency_key("id-1");
        r.timestamp = Some(1_700_000_000_123);
        r.headers.insert("a", b"1".to_vec());
        r.headers.insert_null("b");
        r.headers.insert("c", vec![0xff, 0x00]);
        r.headers.insert("a", b"2".to_vec());
        r.headers.insert(IDEMPOTENCY_KEY_HEADER, b"id-1".to_vec());
        let map = record_headers(&r, Some("id-1")).unwrap();
        let get = |n: &str| {
            map.get_all(n)
                .map(|v| v.as_str().to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(get(ORDER_HEADER), ["a b:n c:x a idempotency-key"]);
        assert_eq!(get("a"), ["1", "2"]);
        assert_eq!(get("b"), [""]);
        assert_eq!(get("c"), ["ff00"]);
        assert_eq!(get(IDEMPOTENCY_KEY_HEADER), ["id-1"]);
        assert_eq!(get("Nats-Msg-Id"), ["id-1"]);
        assert_eq!(get(KEY_HEADER), ["k1"]);
        assert_eq!(get(TIMESTAMP_HEADER), ["1700000000123"]);
        let (key, headers, ts) = read_headers(Some(&map));
        assert_eq!(key.as_deref(), Some(&b"k1"[..]));
        assert_eq!(ts, Some(1_700_000_000_123));
        assert_eq!(headers, r.headers);

        let plain = record_headers(&Record::new("t", Bytes::new()), None).unwrap();
        assert!(plain.is_empty(), "no header block for a plain record");
        let only_id = record_headers(&Record::new("t", Bytes::new()), Some("x")).unwrap();
        assert_eq!(only_id.get(ORDER_HEADER).map(|v| v.as_str()), Some(""));
        assert_eq!(only_id.get("Nats-Msg-Id").map(|v| v.as_str()), Some("x"));
        let hex_key = Record::new("t", Bytes::new()).key(Bytes::from_static(b"\n\xff"));
        let map = record_headers(&hex_key, None).unwrap();
        assert_eq!(map.get(KEY_HEX_HEADER).map(|v| v.as_str()), Some("0aff"));
        assert!(map.get(ORDER_HEADER).is_none());
    }
}
