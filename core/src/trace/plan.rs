//! What a span looks like and which headers carry a trace, decided once for Rust and every
//! binding.
//!
//! The Rust engine starts its spans through the `opentelemetry` crate; Python and Node start
//! theirs through their host's OpenTelemetry API, so that the application's own tracer
//! provider, sampler and exporter see them. Both ask this module what to start: the span's name
//! and kind and its attributes (OpenTelemetry messaging semantic conventions,
//! <https://opentelemetry.io/docs/specs/semconv/messaging/messaging-spans/>), the trace headers
//! the parent comes from (read in any casing, the first non-null value of each name), and how
//! the injected headers replace a record's own. A binding only hands a [`SpanPlan`] to its
//! host's API (`tracer.start_span(name, kind, attributes)`, `propagate.extract(carrier)`), so
//! the spans, headers and parentage are the same in every language.

use crate::model::{Delivery, Headers, Message};

use super::{BAGGAGE, TRACEPARENT, TRACESTATE};

/// The W3C headers that carry a trace: `traceparent`, `tracestate` and `baggage` (lowercase,
/// as W3C Trace Context §3.1 / W3C Baggage name them; matched in any casing).
pub const TRACE_HEADERS: [&str; 3] = [TRACEPARENT, TRACESTATE, BAGGAGE];

/// The kind of a span: `Producer` for a send, `Consumer` for processing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A send (`send {topic}`).
    Producer,
    /// Processing of received messages (`process {topic}`).
    Consumer,
}

impl Kind {
    /// `"producer"` or `"consumer"`, as the hosts' `SpanKind` names them in lowercase.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Producer => "producer",
            Kind::Consumer => "consumer",
        }
    }
}

/// An attribute value: text or a whole number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// A string attribute.
    Str(String),
    /// An integer attribute (`i64`, as OpenTelemetry's).
    Int(i64),
}

/// Attributes in the order they are set.
pub type Attributes = Vec<(&'static str, Value)>;

/// Trace headers as a propagator reads them: lowercase name → value, at most one of each.
pub type Carrier = Vec<(&'static str, String)>;

/// A span to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpanPlan {
    /// `send {topic}` or `process {topic}`.
    pub name: String,
    /// Producer or consumer.
    pub kind: Kind,
    /// The attributes to start it with.
    pub attributes: Attributes,
    /// Where its parent comes from (see [`Parent`]).
    pub parent: Parent,
    /// Contexts to link to (batch processing: one per message that carries a valid trace;
    /// the binding extracts each and keeps the valid ones).
    pub links: Vec<Carrier>,
}

/// Where a span's parent comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parent {
    /// The caller's current context.
    Current,
    /// The caller's current context when its span is valid; else the context these headers
    /// carry when it is valid; else the current context (a new trace). A send whose record
    /// already carries a `traceparent` (forwarded by the caller) continues that trace when the
    /// caller has no span of its own.
    CurrentElse(Carrier),
    /// The context these headers carry (a received message's): the span continues the
    /// producer's trace. Empty: a new trace.
    Headers(Carrier),
}

/// The trace headers among `headers` (name, value; `None` for a null header): for each of
/// [`TRACE_HEADERS`], the first non-null value under that name in any casing, as UTF-8 (a value
/// that is not valid UTF-8 is skipped). Empty when there is none.
pub fn carrier<'a>(headers: impl IntoIterator<Item = (&'a str, Option<&'a [u8]>)>) -> Carrier {
    let mut out: Carrier = Vec::new();
    for (name, value) in headers {
        let Some(known) = TRACE_HEADERS.iter().find(|t| t.eq_ignore_ascii_case(name)) else {
            continue;
        };
        if out.iter().any(|(n, _)| n == known) {
            continue;
        }
        if let Some(v) = value.and_then(|v| std::str::from_utf8(v).ok()) {
            out.push((known, v.to_string()));
        }
    }
    out
}

/// [`carrier`] of a [`Headers`].
pub fn carrier_of(headers: &Headers) -> Carrier {
    carrier(
        headers
            .iter()
            .map(|h| (h.name.as_str(), h.value.as_deref())),
    )
}

/// The trace headers a received `message` carries ([`carrier_of`] its headers): the context its
/// `process` span continues ([`Parent::Headers`]), for a host that wants that context without
/// starting a span. Empty when the message carries none.
pub fn trace_carrier(message: &Message) -> Carrier {
    carrier_of(&message.headers)
}

/// Whether `name` is one of [`TRACE_HEADERS`] in any casing.
pub fn is_trace_header(name: &str) -> bool {
    TRACE_HEADERS.iter().any(|t| t.eq_ignore_ascii_case(name))
}

/// The producer span of a send of `count` records to `topic` on `system` (`kafka`, `nats`,
/// `pulsar`, `aws_kinesis`, `memory`): `send {topic}`; `body_size` is the payload's size in
/// bytes for a single record; a batch (`count` ≠ 1) carries `messaging.batch.message_count`
/// instead. `own` is the trace headers the record itself carries (see
/// [`Parent::CurrentElse`]).
pub fn send(
    system: &str,
    topic: &str,
    count: usize,
    body_size: Option<usize>,
    own: Carrier,
) -> SpanPlan {
    let mut attributes: Attributes = vec![
        ("messaging.system", Value::Str(system.to_string())),
        ("messaging.operation.type", Value::Str("send".into())),
        ("messaging.operation.name", Value::Str("send".into())),
        ("messaging.destination.name", Value::Str(topic.to_string())),
    ];
    if count == 1 {
        if let Some(size) = body_size {
            attributes.push(("messaging.message.body.size", Value::Int(size as i64)));
        }
    } else {
        attributes.push(("messaging.batch.message_count", Value::Int(count as i64)));
    }
    SpanPlan {
        name: format!("send {topic}"),
        kind: Kind::Producer,
        attributes,
        parent: Parent::CurrentElse(own),
        links: Vec::new(),
    }
}

/// The consumer span of processing one message by a member of `group`: `process {topic}`, a
/// child of the context the message carries.
pub fn process(system: &str, group: &str, message: &Message) -> SpanPlan {
    process_of(
        system,
        group,
        &message.topic,
        message.partition,
        &message.position.to_string(),
        message.payload.len(),
        trace_carrier(message),
    )
}

/// [`process`] from a message's parts: its topic, partition, position as text, payload size
/// in bytes and trace headers ([`carrier`]), as the bindings hold them.
pub fn process_of(
    system: &str,
    group: &str,
    topic: &str,
    partition: i32,
    position: &str,
    body_size: usize,
    carrier: Carrier,
) -> SpanPlan {
    SpanPlan {
        name: format!("process {topic}"),
        kind: Kind::Consumer,
        attributes: process_attributes_of(system, group, topic, partition, position, body_size),
        parent: Parent::Headers(carrier),
        links: Vec::new(),
    }
}

/// The attributes of [`process`] (built only for a span that records).
pub fn process_attributes(system: &str, group: &str, message: &Message) -> Attributes {
    process_attributes_of(
        system,
        group,
        &message.topic,
        message.partition,
        &message.position.to_string(),
        message.payload.len(),
    )
}

fn process_attributes_of(
    system: &str,
    group: &str,
    topic: &str,
    partition: i32,
    position: &str,
    body_size: usize,
) -> Attributes {
    vec![
        ("messaging.system", Value::Str(system.to_string())),
        ("messaging.operation.type", Value::Str("process".into())),
        ("messaging.operation.name", Value::Str("process".into())),
        ("messaging.destination.name", Value::Str(topic.to_string())),
        (
            "messaging.destination.partition.id",
            Value::Str(partition.to_string()),
        ),
        (
            "messaging.consumer.group.name",
            Value::Str(group.to_string()),
        ),
        ("messaging.message.id", Value::Str(position.to_string())),
        ("messaging.message.body.size", Value::Int(body_size as i64)),
    ]
}

/// The consumer span of processing `messages` together (a batch handler): one
/// `process {topic}` span, a child of the caller's current context, linked to every message's
/// context (the semantic conventions' rule for batch processing).
pub fn process_batch(system: &str, group: &str, messages: &[Message]) -> SpanPlan {
    let topic = messages.first().map(|m| m.topic.as_str()).unwrap_or("");
    process_batch_of(
        system,
        group,
        topic,
        messages.iter().map(|m| carrier_of(&m.headers)).collect(),
    )
}

/// [`process_batch`] from the batch's topic and each message's trace headers ([`carrier`]).
pub fn process_batch_of(
    system: &str,
    group: &str,
    topic: &str,
    carriers: Vec<Carrier>,
) -> SpanPlan {
    SpanPlan {
        name: format!("process {topic}"),
        kind: Kind::Consumer,
        attributes: vec![
            ("messaging.system", Value::Str(system.to_string())),
            ("messaging.operation.type", Value::Str("process".into())),
            ("messaging.operation.name", Value::Str("process".into())),
            ("messaging.destination.name", Value::Str(topic.to_string())),
            (
                "messaging.consumer.group.name",
                Value::Str(group.to_string()),
            ),
            (
                "messaging.batch.message_count",
                Value::Int(carriers.len() as i64),
            ),
        ],
        parent: Parent::Current,
        links: carriers
            .into_iter()
            .filter(|c| c.iter().any(|(n, _)| *n == TRACEPARENT))
            .collect(),
    }
}

/// The attributes a send span gets when the platform acknowledged the record.
pub fn delivered(delivery: &Delivery) -> Attributes {
    delivered_at(delivery.partition, &delivery.position.to_string())
}

/// [`delivered`] from a delivery's partition and its position as text (`offset:42`, as
/// `Position`'s `Display` writes it: what the bindings' deliveries carry).
pub fn delivered_at(partition: i32, position: &str) -> Attributes {
    vec![
        (
            "messaging.destination.partition.id",
            Value::Str(partition.to_string()),
        ),
        ("messaging.message.id", Value::Str(position.to_string())),
    ]
}

/// The attributes a span gets when its operation failed with the error `code`
/// ([`crate::ErrorKind::code`]); its status is set to error with the error's message.
pub fn failed(code: &str) -> Attributes {
    vec![("error.type", Value::Str(code.to_string()))]
}

/// Whether one send span can be the parent of every record of a batch: they all carry the same
/// trace headers (or none). Records whose own traceparents differ each continue their own
/// trace, one span per record.
pub fn one_span_for_batch(carriers: &[Carrier]) -> bool {
    carriers.windows(2).all(|w| w[0] == w[1])
}

/// Writes the headers a propagator injected into `headers`: `traceparent` and `tracestate` in
/// any casing are removed first (trace state belongs to its traceparent: a record's own
/// `tracestate` must not travel with another trace, W3C Trace Context §3.3), then each injected
/// header replaces any header of its name in any casing, under the lowercase name. An empty
/// `tracestate` is not written (W3C: vendors should not send an empty one). A record's own
/// `baggage` stays unless the propagator injected one.
pub fn apply(headers: &mut Headers, injected: &[(String, String)]) {
    headers.remove_ignore_case(TRACEPARENT);
    headers.remove_ignore_case(TRACESTATE);
    for (name, value) in injected {
        if value.is_empty() && name.eq_ignore_ascii_case(TRACESTATE) {
            continue;
        }
        headers.remove_ignore_case(name);
        headers.insert(name.to_ascii_lowercase(), value.clone().into_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Position;
    use bytes::Bytes;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn carrier_reads_any_casing_and_the_first_non_null_value() {
        let mut h = Headers::new();
        h.insert_null("traceparent");
        h.insert("TraceParent", TP);
        h.insert("traceparent", "later");
        h.insert("Baggage", "k=v");
        h.insert("other", "x");
        assert_eq!(
            carrier_of(&h),
            vec![(TRACEPARENT, TP.to_string()), (BAGGAGE, "k=v".to_string())]
        );
        assert!(is_trace_header("TRACESTATE"));
        assert!(!is_trace_header("trace"));
    }

    #[test]
    fn apply_replaces_in_any_casing_and_keeps_own_baggage() {
        let mut h = Headers::new();
        h.insert("Traceparent", "old");
        h.insert("TraceState", "vendor=1");
        h.insert("baggage", "mine=1");
        h.insert("x", "y");
        apply(
            &mut h,
            &[
                ("traceparent".into(), TP.into()),
                ("tracestate".into(), String::new()),
            ],
        );
        let names: Vec<_> = h.iter().map(|h| h.name.as_str()).collect();
        assert_eq!(names, ["baggage", "x", "traceparent"]);
        assert_eq!(
            h.get("traceparent").flatten().map(|v| &v[..]),
            Some(TP.as_bytes())
        );
    }

    #[test]
    fn plans_name_spans_and_attributes_as_the_conventions_say() {
        let p = send("kafka", "orders", 1, Some(5), Vec::new());
        assert_eq!(p.name, "send orders");
        assert_eq!(p.kind, Kind::Producer);
        assert!(p
            .attributes
            .contains(&("messaging.message.body.size", Value::Int(5))));
        let b = send("kafka", "orders", 3, None, Vec::new());
        assert!(b
            .attributes
            .contains(&("messaging.batch.message_count", Value::Int(3))));
        let mut headers = Headers::new();
        headers.insert("traceparent", TP);
        let m = Message {
            topic: "orders".into(),
            partition: 2,
            position: Position::Offset(7),
            key: None,
            payload: Bytes::from_static(b"abc"),
            headers,
            timestamp: None,
            delivery_count: 1,
        };
        let p = process("kafka", "billing", &m);
        assert_eq!(p.name, "process orders");
        assert_eq!(
            p.parent,
            Parent::Headers(vec![(TRACEPARENT, TP.to_string())])
        );
        // The carrier alone is the one the process span continues.
        assert_eq!(p.parent, Parent::Headers(trace_carrier(&m)));
        assert!(p.attributes.contains(&(
            "messaging.consumer.group.name",
            Value::Str("billing".into())
        )));
        let b = process_batch("kafka", "billing", &[m.clone(), m]);
        assert_eq!(b.links.len(), 2);
        assert_eq!(b.parent, Parent::Current);
    }
}
