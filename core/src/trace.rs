//! W3C trace context propagation (`traceparent`, `tracestate`, `baggage`) through the
//! OpenTelemetry propagator API, and spans named after the OpenTelemetry messaging semantic
//! conventions (<https://opentelemetry.io/docs/specs/semconv/messaging/messaging-spans/>).
//!
//! - On send, a `send {topic}` span of kind `Producer` is started as a child of the current
//!   context (or, when there is none, of a valid `traceparent` the caller put in the record's
//!   headers), and its context is injected: a record ends up with exactly one `traceparent`.
//! - On receive, the context is extracted from the message headers; a `process {topic}` span of
//!   kind `Consumer` is its child for one-message handling, or carries links to every message's
//!   context for batch handling.
//! - A malformed `traceparent` is ignored and counted ([`malformed_traceparents`] for the
//!   process, [`crate::MetricsSnapshot::malformed_traceparents`] per engine, and the
//!   OpenTelemetry counter [`crate::metrics::MALFORMED_TRACEPARENTS`]); it never stops
//!   consumption.
//! - Header names are matched case-insensitively on read, replace and remove (`Traceparent`,
//!   as some older clients write it, is the same header as `traceparent`; W3C Trace Context
//!   §3.1 and §3.3 name the headers in lowercase and HTTP treats names case-insensitively):
//!   after a send a record carries exactly one `traceparent` and at most one `tracestate`,
//!   both under the lowercase W3C names. A record's own `tracestate` travels on when its own
//!   `traceparent` is the trace continued, and is dropped when another trace (the caller's)
//!   is: trace state belongs to the trace it came with (§3.3, §4.3).
//!
//! Spans go to the globally installed OpenTelemetry tracer provider; without one, no span is
//! recorded but the caller's context still propagates (the no-op tracer keeps parent contexts).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use opentelemetry::baggage::BaggageExt;
use opentelemetry::propagation::{
    Extractor, Injector, TextMapCompositePropagator, TextMapPropagator,
};
use opentelemetry::trace::{Link, Span, SpanKind, TraceContextExt, Tracer};
/// OpenTelemetry's context (re-exported): what [`extract`] returns and
/// [`crate::TransformOutput::parent`] holds, nameable without depending on `opentelemetry`.
pub use opentelemetry::Context;
use opentelemetry::{global, KeyValue};
use opentelemetry_sdk::propagation::{BaggagePropagator, TraceContextPropagator};

use crate::metrics::{Metric, Metrics, MALFORMED_TRACEPARENTS, MALFORMED_TRACEPARENTS_DESCRIPTION};
use crate::model::{Headers, Message, Record};

pub mod plan;

/// The plan's attributes as OpenTelemetry key-values.
fn key_values(attributes: plan::Attributes) -> Vec<KeyValue> {
    attributes
        .into_iter()
        .map(|(k, v)| match v {
            plan::Value::Str(s) => KeyValue::new(k, s),
            plan::Value::Int(i) => KeyValue::new(k, i),
        })
        .collect()
}

/// Header carrying the W3C trace parent.
pub const TRACEPARENT: &str = "traceparent";
/// Header carrying the W3C trace state.
pub const TRACESTATE: &str = "tracestate";
/// Header carrying W3C baggage.
pub const BAGGAGE: &str = "baggage";

/// Instrumentation scope name of onceflow's spans and metrics.
pub const SCOPE: &str = "onceflow";

static MALFORMED: AtomicU64 = AtomicU64::new(0);

/// How many malformed `traceparent` headers were ignored in this process (engines and sends
/// alike; an engine's own count is [`crate::MetricsSnapshot::malformed_traceparents`]).
pub fn malformed_traceparents() -> u64 {
    MALFORMED.load(Ordering::Relaxed)
}

/// Counts one malformed `traceparent`: in the process total, and in `metrics` (the engine that
/// met it, whose OpenTelemetry point carries its system and group) or, outside an engine, in
/// the OpenTelemetry counter without attributes.
fn count_malformed(metrics: Option<&Metrics>) {
    MALFORMED.fetch_add(1, Ordering::Relaxed);
    tracing::debug!("ignoring malformed traceparent header");
    match metrics {
        Some(m) => m.add(Metric::MalformedTraceparent, 1),
        // Rare: the instrument is looked up when needed, so it is the provider installed now.
        None => global::meter(SCOPE)
            .u64_counter(MALFORMED_TRACEPARENTS)
            .with_description(MALFORMED_TRACEPARENTS_DESCRIPTION)
            .with_unit("{message}")
            .build()
            .add(1, &[]),
    }
}

fn propagator() -> &'static TextMapCompositePropagator {
    static P: OnceLock<TextMapCompositePropagator> = OnceLock::new();
    P.get_or_init(|| {
        TextMapCompositePropagator::new(vec![
            Box::new(TraceContextPropagator::new()),
            Box::new(BaggagePropagator::new()),
        ])
    })
}

struct HeaderReader<'a>(&'a Headers);

impl Extractor for HeaderReader<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        // W3C header names are case-insensitive on HTTP; messaging headers are exact, but accept
        // other casings written by other clients. The first non-null UTF-8 value, as
        // `plan::carrier` reads it for the bindings.
        self.0
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case(key))
            .find_map(|h| h.value.as_ref().and_then(|v| std::str::from_utf8(v).ok()))
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|h| h.name.as_str()).collect()
    }
}

struct HeaderWriter<'a>(&'a mut Headers);

impl Injector for HeaderWriter<'_> {
    fn set(&mut self, key: &str, value: String) {
        // An empty `tracestate` carries nothing (W3C: "vendors SHOULD NOT send an empty
        // tracestate"); writing it only costs bytes on every message.
        if value.is_empty() && key == TRACESTATE {
            return;
        }
        replace(self.0, key, value.into_bytes());
    }
}

/// Replaces every header called `name`, in any casing, with one `name` (as the propagator
/// spells it: lowercase) carrying `value`.
fn replace(headers: &mut Headers, name: &str, value: impl Into<bytes::Bytes>) {
    headers.remove_ignore_case(name);
    headers.insert(name, value);
}

/// Removes `traceparent` and `tracestate` in any casing: what [`inject`] replaces.
fn remove_trace_headers(headers: &mut Headers) {
    headers.remove_ignore_case(TRACEPARENT);
    headers.remove_ignore_case(TRACESTATE);
}

fn has_trace_headers(headers: &Headers) -> bool {
    headers
        .iter()
        .any(|h| h.name.eq_ignore_ascii_case(TRACEPARENT) || h.name.eq_ignore_ascii_case(BAGGAGE))
}

/// Extracts the trace context carried by `headers` (W3C trace context and baggage; names in
/// any casing). Returns an empty context when there is none; a malformed `traceparent` is
/// counted (see [`malformed_traceparents`]) and ignored, with the `tracestate` that came
/// with it (W3C Trace Context §4.3: without a valid parent, trace state is discarded).
pub fn extract(headers: &Headers) -> Context {
    extract_counted(headers, None)
}

/// The context `headers` carry when it names a valid span (W3C Trace Context §3.2), `None`
/// otherwise: a parent to send records as children of, such as a binding's `process` span
/// handed to the core as its W3C headers (see [`crate::TransformOutput::parent`]).
pub fn extract_parent(headers: &Headers) -> Option<Context> {
    let cx = extract(headers);
    cx.span().span_context().is_valid().then_some(cx)
}

/// [`extract`], counting a malformed `traceparent` in `metrics` when given.
fn extract_counted(headers: &Headers, metrics: Option<&Metrics>) -> Context {
    if !has_trace_headers(headers) {
        return Context::new();
    }
    let cx = propagator().extract_with_context(&Context::new(), &HeaderReader(headers));
    if HeaderReader(headers).get(TRACEPARENT).is_some() && !cx.span().span_context().is_valid() {
        count_malformed(metrics);
    }
    cx
}

/// Writes `cx` into `headers`, replacing any earlier `traceparent` and `tracestate` (and, when
/// `cx` has baggage, `baggage`), whatever the casing of their names. A context without a valid
/// span writes no `traceparent`, and an empty trace state no `tracestate`.
pub fn inject(cx: &Context, headers: &mut Headers) {
    remove_trace_headers(headers);
    if cx.span().span_context().is_valid() || !cx.baggage().is_empty() {
        propagator().inject_context(cx, &mut HeaderWriter(headers));
    }
}

fn parent_for_send(record: &Record) -> Context {
    let current = Context::current();
    if current.span().span_context().is_valid() {
        return current;
    }
    let from_headers = extract(&record.headers);
    if from_headers.span().span_context().is_valid() {
        from_headers
    } else {
        current
    }
}

/// Starts the producer span for `record` on `system` (`kafka`, `nats`, `pulsar`,
/// `aws_kinesis`, `memory`) and injects its context into the record's headers. Returns the span
/// context to end with [`end_send`] when the send completes, or `None` when the span records
/// nothing: its `end` would do nothing (the no-op tracer of an application without a tracer
/// provider, or a span the sampler dropped), so no context is made to carry it. The headers
/// are the same either way: a sampled-out span's context is still injected (its
/// `traceparent` says "not sampled"), and the no-op tracer's span hands the parent's context
/// through.
pub fn on_send(system: &'static str, record: &mut Record) -> Option<Context> {
    on_send_with(&global::tracer(SCOPE), system, record)
}

fn on_send_with(
    tracer: &global::BoxedTracer,
    system: &'static str,
    record: &mut Record,
) -> Option<Context> {
    let parent = parent_for_send(record);
    send_in(tracer, system, &parent, record).0
}

/// Starts the producer span for `record` as a child of `parent` and injects its context (or,
/// for a span that records nothing, what propagates through it); returns the span context to
/// end, `None` when there is nothing to end.
/// Also returns whether the tracer handed `parent` through (a span that records nothing with
/// exactly the parent's span context: the no-op tracer).
fn send_in(
    tracer: &global::BoxedTracer,
    system: &'static str,
    parent: &Context,
    record: &mut Record,
) -> (Option<Context>, bool) {
    let span = start_span(tracer, system, parent, record);
    if span.is_recording() {
        let cx = parent.with_span(span);
        inject(&cx, &mut record.headers);
        return (Some(cx), false);
    }
    if span.span_context() == parent.span().span_context() {
        inject(parent, &mut record.headers);
        (None, true)
    } else {
        inject(&parent.with_span(span), &mut record.headers);
        (None, false)
    }
}

/// Producer spans for records sent together ([`crate::Producer::send_batch`], a transaction's
/// batches): [`on_send`] per record, with the tracer and the caller's context looked up once.
///
/// The first record whose parent is the caller's context also tells how the installed tracer
/// treats that parent. When its span records nothing and has exactly the parent's span context
/// (the no-op tracer of an application that installed no tracer provider: it hands the parent
/// through; an SDK tracer always gives a span a new span id), every later record with the same
/// parent would get such a span too, so none is started for them: they get the headers that
/// injecting the caller's context writes (nothing without a context, its `traceparent` with
/// one) and no span to end. A record whose own headers choose its parent (`traceparent` or
/// `baggage` without a current span) always takes the [`on_send`] path.
pub struct SendSpans {
    system: &'static str,
    tracer: global::BoxedTracer,
    current: Context,
    current_valid: bool,
    mode: PassThrough,
    /// Whether the tracer hands a given parent through (learnt from the first record sent
    /// with a parent of its own, [`SendSpans::on_send_in`]): then the later ones only inject
    /// their parent, and no span is started for them.
    parent_passes: Option<bool>,
}

enum PassThrough {
    /// No record with the caller's context as parent was seen yet.
    Unknown,
    /// The tracer hands the caller's context through: these headers are what injecting it
    /// writes.
    Yes(Headers),
    No,
}

impl SendSpans {
    /// Spans on `system` (see [`on_send`]) through the global tracer, children of the current
    /// context.
    pub fn new(system: &'static str) -> Self {
        Self::with_tracer(system, global::tracer(SCOPE))
    }

    /// Spans through `tracer`, children of the current context.
    pub fn with_tracer(system: &'static str, tracer: global::BoxedTracer) -> Self {
        let current = Context::current();
        let current_valid = current.span().span_context().is_valid();
        SendSpans {
            system,
            tracer,
            current,
            current_valid,
            mode: PassThrough::Unknown,
            parent_passes: None,
        }
    }

    /// [`on_send`] for one record of the batch: injects its trace context and returns the span
    /// context to end with [`end_send`] when the send completes, or `None` when no span was
    /// started for it (nothing to end).
    pub fn on_send(&mut self, record: &mut Record) -> Option<Context> {
        let parent_is_current = self.current_valid || !has_trace_headers(&record.headers);
        if parent_is_current {
            if let PassThrough::Yes(injected) = &self.mode {
                // What `inject` of the caller's context does to these headers.
                remove_trace_headers(&mut record.headers);
                for h in injected.iter() {
                    replace(
                        &mut record.headers,
                        &h.name,
                        h.value.clone().unwrap_or_default(),
                    );
                }
                return None;
            }
        }
        let parent = if parent_is_current {
            self.current.clone()
        } else {
            parent_for_send(record)
        };
        let cx = start_send(&self.tracer, self.system, &parent, record);
        if parent_is_current && matches!(self.mode, PassThrough::Unknown) {
            let span = cx.span();
            self.mode = if !span.is_recording()
                && span.span_context() == self.current.span().span_context()
            {
                let mut injected = Headers::new();
                inject(&self.current, &mut injected);
                PassThrough::Yes(injected)
            } else {
                PassThrough::No
            };
        }
        inject(&cx, &mut record.headers);
        Some(cx)
    }

    /// [`SendSpans::on_send`] with an explicit parent: the producer span of `record` is a child
    /// of `parent` (a pipeline's process span), whatever the current context or the record's
    /// own trace headers say; those are replaced. `None` as `parent` is [`SendSpans::on_send`].
    pub fn on_send_in(&mut self, record: &mut Record, parent: Option<&Context>) -> Option<Context> {
        match parent {
            Some(parent) if self.parent_passes == Some(true) => {
                // What `send_in` does with a span that has the parent's context.
                inject(parent, &mut record.headers);
                None
            }
            Some(parent) => {
                let (cx, passes) = send_in(&self.tracer, self.system, parent, record);
                self.parent_passes.get_or_insert(passes);
                cx
            }
            None => self.on_send(record),
        }
    }
}

/// Starts the producer span for `record` as a child of `parent`.
fn start_send(
    tracer: &global::BoxedTracer,
    system: &'static str,
    parent: &Context,
    record: &Record,
) -> Context {
    parent.with_span(start_span(tracer, system, parent, record))
}

/// The producer span for `record`, a child of `parent`, with its attributes when it records.
fn start_span(
    tracer: &global::BoxedTracer,
    system: &'static str,
    parent: &Context,
    record: &Record,
) -> global::BoxedSpan {
    // The name and attributes are only built for a span that records: without a tracer
    // provider (or when the sampler drops the span) a send costs no allocation for them.
    let mut span = tracer
        .span_builder("send")
        .with_kind(SpanKind::Producer)
        .start_with_context(tracer, parent);
    if span.is_recording() {
        let plan = plan::send(
            system,
            &record.topic,
            1,
            Some(record.payload.len()),
            Vec::new(),
        );
        span.update_name(plan.name);
        span.set_attributes(key_values(plan.attributes));
    }
    span
}

/// Records the outcome of a send on the span started by [`on_send`] and ends it.
pub fn end_send(cx: &Context, result: Result<&crate::Delivery, &crate::Error>) {
    let span = cx.span();
    if !span.is_recording() {
        span.end();
        return;
    }
    match result {
        Ok(d) => span.set_attributes(key_values(plan::delivered(d))),
        Err(e) => {
            span.set_status(opentelemetry::trace::Status::error(e.to_string()));
            span.set_attributes(key_values(plan::failed(e.kind().code())));
        }
    }
    span.end();
}

fn process_attributes(system: &'static str, message: &Message, group: &str) -> Vec<KeyValue> {
    key_values(plan::process_attributes(system, group, message))
}

/// Starts a `process {topic}` span (kind `Consumer`) as a child of the context the message
/// carries, and returns the context to run the handler in.
pub fn process_context(system: &'static str, group: &str, message: &Message) -> Context {
    process_context_counted(system, group, message, None)
}

/// [`process_context`] for an engine: a malformed `traceparent` is counted in its `metrics`.
/// `process {topic}` spans for the messages of one batch through one tracer
/// ([`process_context_counted`] per message). The first span also tells whether the tracer
/// hands its parent through (the no-op tracer of an application without a tracer provider:
/// a span that records nothing, with exactly the parent's span context); then the later
/// messages' contexts are their extracted parents, and no span is started for them (a fifth
/// of an exactly-once pipeline's own CPU time went to spans nothing recorded).
pub(crate) struct ProcessSpans {
    tracer: global::BoxedTracer,
    parent_passes: Option<bool>,
}

impl ProcessSpans {
    /// Spans through the global tracer as it is now.
    pub(crate) fn new() -> Self {
        ProcessSpans {
            tracer: global::tracer(SCOPE),
            parent_passes: None,
        }
    }

    /// The context `message` is processed in (see [`process_context_counted`]).
    pub(crate) fn start(
        &mut self,
        system: &'static str,
        group: &str,
        message: &Message,
        metrics: Option<&Metrics>,
    ) -> Context {
        let parent = extract_counted(&message.headers, metrics);
        if self.parent_passes == Some(true) {
            return parent;
        }
        let span = self
            .tracer
            .span_builder(format!("process {}", message.topic))
            .with_kind(SpanKind::Consumer)
            .start_with_context(&self.tracer, &parent);
        if span.is_recording() {
            self.parent_passes = Some(false);
            let mut span = span;
            span.set_attributes(process_attributes(system, message, group));
            return parent.with_span(span);
        }
        self.parent_passes
            .get_or_insert(span.span_context() == parent.span().span_context());
        parent.with_span(span)
    }
}

pub(crate) fn process_context_counted(
    system: &'static str,
    group: &str,
    message: &Message,
    metrics: Option<&Metrics>,
) -> Context {
    // Attributes only for spans that are recorded (no cost without a tracer provider or when
    // the sampler drops the span).
    ProcessSpans::new().start(system, group, message, metrics)
}

/// Starts one `process {topic}` span for a batch, with a link to every message's context (the
/// semantic conventions' rule for batch processing), as a child of the current context.
pub fn process_batch_context(system: &'static str, group: &str, messages: &[Message]) -> Context {
    let tracer = global::tracer(SCOPE);
    let links: Vec<Link> = messages
        .iter()
        .filter_map(|m| {
            let sc = extract(&m.headers).span().span_context().clone();
            sc.is_valid().then(|| Link::with_context(sc))
        })
        .collect();
    let plan = plan::process_batch(system, group, messages);
    let span = tracer
        .span_builder(plan.name)
        .with_kind(SpanKind::Consumer)
        .with_links(links)
        .with_attributes(key_values(plan.attributes))
        .start(&tracer);
    Context::current().with_span(span)
}

/// Ends the span of `cx`, marking it failed when `error` is given.
pub fn end(cx: &Context, error: Option<&crate::Error>) {
    let span = cx.span();
    if let Some(e) = error {
        span.set_status(opentelemetry::trace::Status::error(e.to_string()));
        span.set_attributes(key_values(plan::failed(e.kind().code())));
    }
    span.end();
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use opentelemetry::trace::TraceId;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn extract_valid_and_malformed() {
        let h = Headers::new().with(TRACEPARENT, TP);
        let cx = extract(&h);
        assert_eq!(
            cx.span().span_context().trace_id(),
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
        );
        let before = malformed_traceparents();
        let cx = extract(&Headers::new().with(TRACEPARENT, "garbage"));
        assert!(!cx.span().span_context().is_valid());
        assert!(malformed_traceparents() > before);
    }

    #[test]
    fn send_keeps_exactly_one_traceparent() {
        let mut r = Record::new("t", "x")
            .header(TRACEPARENT, TP)
            .header(TRACEPARENT, TP);
        // The no-op tracer's span records nothing: no context to end.
        assert!(on_send("memory", &mut r).is_none());
        assert_eq!(r.headers.get_all(TRACEPARENT).count(), 1);
        // With the no-op tracer the caller's context is what propagates.
        assert!(r
            .headers
            .get_str(TRACEPARENT)
            .unwrap()
            .contains("4bf92f3577b34da6a3ce929d0e0e4736"));
    }

    #[test]
    fn trace_headers_are_replaced_whatever_their_case() {
        let count = |h: &Headers, name: &str| {
            h.iter()
                .filter(|x| x.name.eq_ignore_ascii_case(name))
                .count()
        };
        // No current context: the record's own trace continues, with its trace state.
        let mut r = Record::new("t", "x")
            .header("Traceparent", TP)
            .header("TraceState", "congo=t61rcWkgMzE")
            .header("x", "y");
        on_send("memory", &mut r);
        assert_eq!(count(&r.headers, TRACEPARENT), 1);
        assert_eq!(count(&r.headers, TRACESTATE), 1);
        assert_eq!(r.headers.get_str(TRACEPARENT), Some(TP));
        assert_eq!(r.headers.get_str(TRACESTATE), Some("congo=t61rcWkgMzE"));
        assert_eq!(r.headers.get_str("x"), Some("y"));
        // Inside another trace: its context wins and the record's trace state goes with its
        // trace.
        let other = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let _guard = extract(&Headers::new().with(TRACEPARENT, other)).attach();
        for batch in [false, true] {
            let mut r = Record::new("t", "x")
                .header("TRACEPARENT", TP)
                .header("Tracestate", "congo=t61rcWkgMzE");
            if batch {
                let mut spans = SendSpans::new("memory");
                spans.on_send(&mut Record::new("t", "first"));
                spans.on_send(&mut r);
            } else {
                on_send("memory", &mut r);
            }
            assert_eq!(count(&r.headers, TRACEPARENT), 1, "batch {batch}");
            assert_eq!(r.headers.get_str(TRACEPARENT), Some(other), "batch {batch}");
            assert_eq!(count(&r.headers, TRACESTATE), 0, "batch {batch}");
        }
    }

    #[test]
    fn a_malformed_traceparent_drops_its_tracestate() {
        let mut r = Record::new("t", "x")
            .header("Traceparent", "00-zz-01")
            .header("tracestate", "a=b");
        on_send("memory", &mut r);
        assert!(r.headers.is_empty(), "{:?}", r.headers);
    }

    #[test]
    fn send_without_context_adds_nothing() {
        let mut r = Record::new("t", "x");
        assert!(on_send("memory", &mut r).is_none());
        assert!(r.headers.is_empty());
    }

    fn batch(n: usize, tracer: Option<global::BoxedTracer>) -> (Vec<Record>, Vec<Option<Context>>) {
        let mut spans = match tracer {
            Some(t) => SendSpans::with_tracer("memory", t),
            None => SendSpans::new("memory"),
        };
        let mut records: Vec<Record> = (0..n).map(|_| Record::new("t", "x")).collect();
        let cxs = records.iter_mut().map(|r| spans.on_send(r)).collect();
        (records, cxs)
    }

    #[test]
    fn send_spans_without_context_add_nothing() {
        let (records, cxs) = batch(3, None);
        assert!(records.iter().all(|r| r.headers.is_empty()));
        // The first record tells the no-op tracer apart; the others start no span.
        assert!(cxs[0].is_some() && cxs[1].is_none() && cxs[2].is_none());
    }

    fn message(headers: Headers) -> Message {
        Message {
            topic: "t".into(),
            partition: 0,
            position: crate::Position::Offset(1),
            key: None,
            payload: Bytes::from_static(b"x"),
            headers,
            timestamp: None,
            delivery_count: 1,
        }
    }

    const TP2: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    #[test]
    fn process_spans_hand_each_messages_parent_through_the_no_op_tracer() {
        let msgs = [
            message(Headers::new().with(TRACEPARENT, TP)),
            message(Headers::new()),
            message(Headers::new().with(TRACEPARENT, TP2)),
        ];
        let mut spans = ProcessSpans::new();
        let cxs: Vec<Context> = msgs
            .iter()
            .map(|m| spans.start("memory", "g", m, None))
            .collect();
        // The first span teaches it; the others start none. Each context is its message's.
        assert_eq!(spans.parent_passes, Some(true));
        for (m, cx) in msgs.iter().zip(&cxs) {
            assert_eq!(
                cx.span().span_context(),
                extract(&m.headers).span().span_context()
            );
        }
        let mut out = Record::new("o", "x");
        inject(&cxs[2], &mut out.headers);
        assert_eq!(out.headers.get_str(TRACEPARENT), Some(TP2));
    }

    #[test]
    fn process_spans_start_a_span_per_message_with_a_tracer_provider() {
        let (tracer, exporter) = sdk_tracer(opentelemetry_sdk::trace::Sampler::AlwaysOn);
        let mut spans = ProcessSpans {
            tracer,
            parent_passes: None,
        };
        let m = message(Headers::new().with(TRACEPARENT, TP));
        for _ in 0..3 {
            let cx = spans.start("memory", "g", &m, None);
            let sc = cx.span().span_context().clone();
            // A child of the message's traceparent.
            assert_eq!(sc.trace_id().to_string(), &TP[3..35]);
            assert_ne!(sc.span_id().to_string(), &TP[36..52]);
            end(&cx, None);
        }
        assert_eq!(spans.parent_passes, Some(false));
        let finished = exporter.get_finished_spans().unwrap();
        assert_eq!(finished.len(), 3);
        assert!(finished.iter().all(|s| s.name == "process t"));
    }

    #[test]
    fn send_spans_hand_a_records_parent_through_the_no_op_tracer() {
        let parents = [
            extract(&Headers::new().with(TRACEPARENT, TP)),
            Context::new(),
            extract(&Headers::new().with(TRACEPARENT, TP2)),
        ];
        let mut spans = SendSpans::new("memory");
        let mut records: Vec<Record> = (0..3)
            .map(|_| Record::new("t", "x").header(TRACEPARENT, TP))
            .collect();
        for (r, p) in records.iter_mut().zip(&parents) {
            assert!(spans.on_send_in(r, Some(p)).is_none());
        }
        assert_eq!(spans.parent_passes, Some(true));
        assert_eq!(records[0].headers.get_str(TRACEPARENT), Some(TP));
        // A parent without a span context writes none: the record's own is removed.
        assert_eq!(records[1].headers.get_str(TRACEPARENT), None);
        assert_eq!(records[2].headers.get_str(TRACEPARENT), Some(TP2));
        let (tracer, exporter) = sdk_tracer(opentelemetry_sdk::trace::Sampler::AlwaysOn);
        let mut spans = SendSpans::with_tracer("memory", tracer);
        for r in records.iter_mut() {
            let cx = spans
                .on_send_in(r, Some(&parents[0]))
                .expect("a span per record");
            end(&cx, None);
        }
        assert_eq!(spans.parent_passes, Some(false));
        assert_eq!(exporter.get_finished_spans().unwrap().len(), 3);
    }

    #[test]
    fn send_spans_propagate_the_callers_context() {
        let parent = extract(&Headers::new().with(TRACEPARENT, TP));
        let _guard = parent.attach();
        let mut single = Record::new("t", "x");
        assert!(on_send("memory", &mut single).is_none());
        let (records, cxs) = batch(3, None);
        for r in &records {
            assert_eq!(r.headers, single.headers);
        }
        assert!(single
            .headers
            .get_str(TRACEPARENT)
            .unwrap()
            .contains(&TP[3..35]));
        assert!(cxs[1].is_none());
        // A record's own traceparent is replaced by the current context's, as by `on_send`.
        let mut spans = SendSpans::new("memory");
        let mut plain = Record::new("t", "x");
        spans.on_send(&mut plain);
        let other = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let mut own = Record::new("t", "x").header(TRACEPARENT, other);
        assert!(spans.on_send(&mut own).is_none());
        assert_eq!(own.headers, single.headers);
    }

    #[test]
    fn send_spans_let_record_headers_choose_the_parent() {
        let mut spans = SendSpans::new("memory");
        let mut plain = Record::new("t", "x");
        spans.on_send(&mut plain);
        let mut own = Record::new("t", "x").header(TRACEPARENT, TP);
        let cx = spans.on_send(&mut own);
        assert!(cx.is_some());
        assert_eq!(own.headers.get_str(TRACEPARENT), Some(TP));
        assert!(plain.headers.is_empty());
    }

    #[test]
    fn send_spans_start_a_span_per_record_with_a_tracer_provider() {
        use opentelemetry::trace::TracerProvider as _;
        let exporter = opentelemetry_sdk::trace::InMemorySpanExporter::default();
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let tracer = global::BoxedTracer::new(Box::new(provider.tracer(SCOPE)));
        let (records, cxs) = batch(3, Some(tracer));
        let parents: std::collections::HashSet<_> = records
            .iter()
            .map(|r| r.headers.get_str(TRACEPARENT).unwrap().to_string())
            .collect();
        assert_eq!(parents.len(), 3);
        for cx in cxs {
            end(&cx.expect("a span per record"), None);
        }
        let finished = exporter.get_finished_spans().unwrap();
        assert_eq!(finished.len(), 3);
        assert!(finished.iter().all(|s| s.name == "send t"));
    }

    fn sdk_tracer(
        sampler: opentelemetry_sdk::trace::Sampler,
    ) -> (
        global::BoxedTracer,
        opentelemetry_sdk::trace::InMemorySpanExporter,
    ) {
        use opentelemetry::trace::TracerProvider as _;
        let exporter = opentelemetry_sdk::trace::InMemorySpanExporter::default();
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
            .with_sampler(sampler)
            .with_simple_exporter(exporter.clone())
            .build();
        let tracer = global::BoxedTracer::new(Box::new(provider.tracer(SCOPE)));
        (tracer, exporter)
    }

    #[test]
    fn a_recording_send_span_is_returned_to_end() {
        let (tracer, exporter) = sdk_tracer(opentelemetry_sdk::trace::Sampler::AlwaysOn);
        let mut r = Record::new("t", "x").header(TRACEPARENT, TP);
        let cx = on_send_with(&tracer, "memory", &mut r).expect("a recording span");
        end_send(&cx, Err(&crate::Error::config("x")));
        let tp = r.headers.get_str(TRACEPARENT).unwrap().to_string();
        // A child of the record's traceparent: same trace, a new span id, sampled.
        assert!(tp.contains(&TP[3..35]) && !tp.contains(&TP[36..52]) && tp.ends_with("-01"));
        let finished = exporter.get_finished_spans().unwrap();
        assert_eq!(finished.len(), 1);
        assert_eq!(finished[0].name, "send t");
    }

    #[test]
    fn a_sampled_out_send_span_still_propagates_its_context() {
        let (tracer, exporter) = sdk_tracer(opentelemetry_sdk::trace::Sampler::AlwaysOff);
        let mut r = Record::new("t", "x");
        assert!(on_send_with(&tracer, "memory", &mut r).is_none());
        // The sampler dropped the span, but its context (a new trace, not sampled) is injected
        // for the next hop, as the SDK's own propagation does.
        let tp = r.headers.get_str(TRACEPARENT).expect("traceparent");
        assert!(tp.ends_with("-00"), "{tp}");
        assert!(exporter.get_finished_spans().unwrap().is_empty());
    }
}
