//! The span plans of `onceflow::trace::plan` for `otel.js`: the core decides each span's name,
//! kind, attributes, parent headers and links, and how injected trace headers replace a
//! record's own; the JavaScript side only hands them to `@opentelemetry/api`.

// Only called from JavaScript: the unit-test build of the addon has no caller.
#![cfg_attr(test, allow(dead_code))]

use std::collections::HashMap;

use napi::bindgen_prelude::*;
use napi_derive::napi;
use onceflow::trace::plan::{self, Attributes, Carrier, Parent, SpanPlan as RsPlan, Value};

use crate::convert::{headers, Header};

/// A span to start, as the core plans it.
#[napi(object)]
pub struct SpanPlan {
    /// `send {topic}` or `process {topic}`.
    pub name: String,
    /// `producer` or `consumer`.
    pub kind: String,
    /// Attributes to start the span with (strings and integers).
    #[napi(ts_type = "Record<string, string | number>")]
    pub attributes: HashMap<String, Either<String, i64>>,
    /// Where the parent comes from: `current` (the active context), `current_else` (the
    /// active context when its span is valid, else `carrier`'s when valid, else the active
    /// one) or `headers` (`carrier`'s context; none: a new trace).
    pub parent: String,
    /// Trace headers (lowercase name → value) of the parent, if any.
    pub carrier: Option<HashMap<String, String>>,
    /// Trace headers of the contexts to link to (batch processing).
    pub links: Vec<HashMap<String, String>>,
}

fn attributes(a: Attributes) -> HashMap<String, Either<String, i64>> {
    a.into_iter()
        .map(|(k, v)| {
            let v = match v {
                Value::Str(s) => Either::A(s),
                Value::Int(i) => Either::B(i),
            };
            (k.to_string(), v)
        })
        .collect()
}

fn carrier(c: Carrier) -> HashMap<String, String> {
    c.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

fn to_js(p: RsPlan) -> SpanPlan {
    let (parent, c) = match p.parent {
        Parent::Current => ("current", None),
        Parent::CurrentElse(c) => ("current_else", Some(c)),
        Parent::Headers(c) => ("headers", Some(c)),
    };
    SpanPlan {
        name: p.name,
        kind: p.kind.as_str().to_string(),
        attributes: attributes(p.attributes),
        parent: parent.to_string(),
        carrier: c.filter(|c| !c.is_empty()).map(carrier),
        links: p.links.into_iter().map(carrier).collect(),
    }
}

fn carrier_of(h: Option<Vec<Header>>) -> Carrier {
    plan::carrier_of(&headers(h))
}

/// The trace headers (lowercase name → value) among a received message's `headers`, read in
/// any casing: the context its process span would continue, without planning the span. `null`
/// when there is none.
#[napi(js_name = "_traceCarrier")]
pub fn trace_carrier(headers: Option<Vec<Header>>) -> Option<HashMap<String, String>> {
    Some(carrier_of(headers))
        .filter(|c| !c.is_empty())
        .map(carrier)
}

/// The producer span of a send of `count` records to `topic` (`bodySize`: the payload's bytes
/// for one record) whose own headers are `headers`.
#[napi(js_name = "_sendSpanPlan")]
pub fn send_span_plan(
    system: String,
    topic: String,
    count: u32,
    body_size: Option<u32>,
    headers: Option<Vec<Header>>,
) -> SpanPlan {
    to_js(plan::send(
        &system,
        &topic,
        count as usize,
        body_size.map(|n| n as usize),
        carrier_of(headers),
    ))
}

/// The consumer span of processing one message (its topic, partition, position, payload size
/// in bytes and headers) by a member of `group`.
#[napi(js_name = "_processSpanPlan")]
pub fn process_span_plan(
    system: String,
    group: String,
    topic: String,
    partition: i32,
    position: String,
    body_size: u32,
    headers: Option<Vec<Header>>,
) -> SpanPlan {
    to_js(plan::process_of(
        &system,
        &group,
        &topic,
        partition,
        &position,
        body_size as usize,
        carrier_of(headers),
    ))
}

/// The consumer span of processing a batch of messages of `topic` together, whose headers are
/// `headers` (one list per message).
#[napi(js_name = "_processBatchSpanPlan")]
pub fn process_batch_span_plan(
    system: String,
    group: String,
    topic: String,
    headers: Vec<Option<Vec<Header>>>,
) -> SpanPlan {
    let carriers = headers.into_iter().map(carrier_of).collect();
    to_js(plan::process_batch_of(&system, &group, &topic, carriers))
}

/// The attributes of a send span whose record the platform acknowledged.
#[napi(
    js_name = "_deliveredSpanAttributes",
    ts_return_type = "Record<string, string | number>"
)]
pub fn delivered_span_attributes(
    partition: i32,
    position: String,
) -> HashMap<String, Either<String, i64>> {
    attributes(plan::delivered_at(partition, &position))
}

/// The attributes of a span whose operation failed with error code `code`.
#[napi(
    js_name = "_failedSpanAttributes",
    ts_return_type = "Record<string, string | number>"
)]
pub fn failed_span_attributes(code: String) -> HashMap<String, Either<String, i64>> {
    attributes(plan::failed(&code))
}

/// Whether one send span can parent every record of a batch (one header list per record).
#[napi(js_name = "_oneSpanForBatch")]
pub fn one_span_for_batch(headers: Vec<Option<Vec<Header>>>) -> bool {
    let carriers: Vec<Carrier> = headers.into_iter().map(carrier_of).collect();
    plan::one_span_for_batch(&carriers)
}

/// `headers` with the injected trace headers (name → value) applied by the core's rule.
#[napi(js_name = "_applyTraceHeaders")]
pub fn apply_trace_headers(
    headers: Option<Vec<Header>>,
    injected: HashMap<String, String>,
) -> Vec<Header> {
    let mut h = self::headers(headers);
    let mut injected: Vec<(String, String)> = injected.into_iter().collect();
    // The propagators' order: traceparent, then tracestate, then baggage.
    injected.sort_by_key(|(k, _)| {
        plan::TRACE_HEADERS
            .iter()
            .position(|t| t.eq_ignore_ascii_case(k))
            .unwrap_or(usize::MAX)
    });
    plan::apply(&mut h, &injected);
    h.iter()
        .map(|x| Header {
            name: x.name.clone(),
            value: match &x.value {
                Some(v) => Either::A(Buffer::from(v.to_vec())),
                None => Either::B(Null),
            },
        })
        .collect()
}
