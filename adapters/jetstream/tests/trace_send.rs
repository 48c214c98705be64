//! Producer spans of single sends through the facade (`Client::producer` then `send`) with an
//! OpenTelemetry SDK tracer provider installed globally: a binary of its own, so the provider
//! disturbs no other test. One provider for all tests here: its sampler is `Sampler::AlwaysOff`
//! on a thread that set [`OFF`] (each test runs on a thread of its own) and `AlwaysOn` elsewhere.
//! (It cannot go by the topic: the sampler sees the span before it is named after it.)
//! Runs when `ONCEFLOW_NATS_URL` is set; without it each test prints that it skipped and why.

use std::sync::{Arc, OnceLock};

use onceflow_core::{Client, ProducerConfig, Record};
use onceflow_jetstream::JetStreamPlatform;
use opentelemetry::context::FutureExt as _;
use opentelemetry::trace::{Link, SpanKind, TraceContextExt as _, TraceId, Tracer as _};
use opentelemetry::{global, Context, KeyValue};
use opentelemetry_sdk::trace::{
    InMemorySpanExporter, Sampler, SamplingResult, SdkTracerProvider, ShouldSample, SpanData,
};

mod common;
use common::topic;

thread_local! {
    /// Whether spans started on this thread are dropped by the sampler.
    static OFF: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// `AlwaysOff` on a thread that set [`OFF`], `AlwaysOn` elsewhere.
#[derive(Debug, Clone)]
struct ByName;

impl ShouldSample for ByName {
    fn should_sample(
        &self,
        parent: Option<&Context>,
        trace_id: TraceId,
        name: &str,
        kind: &SpanKind,
        attributes: &[KeyValue],
        links: &[Link],
    ) -> SamplingResult {
        let inner = if OFF.with(|off| off.get()) {
            Sampler::AlwaysOff
        } else {
            Sampler::AlwaysOn
        };
        inner.should_sample(parent, trace_id, name, kind, attributes, links)
    }
}

fn exporter() -> &'static InMemorySpanExporter {
    static EXPORTER: OnceLock<InMemorySpanExporter> = OnceLock::new();
    EXPORTER.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_sampler(ByName)
            .with_simple_exporter(exporter.clone())
            .build();
        global::set_tracer_provider(provider);
        exporter
    })
}

/// The exported spans of sends to `topic`.
fn sends_to(topic: &str) -> Vec<SpanData> {
    exporter()
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| s.name == format!("send {topic}"))
        .collect()
}

/// [`common::platform`], with the SDK tracer provider installed first.
async fn platform(test: &str) -> Option<Arc<JetStreamPlatform>> {
    exporter();
    common::platform(test).await
}

/// The `traceparent` values of the stored message at `seq`, as any NATS client reads them.
async fn traceparents(p: &JetStreamPlatform, t: &str, seq: u64) -> Vec<String> {
    let js = async_nats::jetstream::new(p.nats_client());
    let raw = js
        .get_stream(t)
        .await
        .unwrap()
        .get_raw_message(seq)
        .await
        .unwrap();
    raw.headers
        .get_all("traceparent")
        .map(|v| v.as_str().to_string())
        .collect()
}

/// The exported span whose context is the sampled `traceparent` `tp`.
fn span_of<'a>(spans: &'a [SpanData], tp: &str) -> &'a SpanData {
    spans
        .iter()
        .find(|s| {
            tp == format!(
                "00-{}-{}-01",
                s.span_context.trace_id(),
                s.span_context.span_id()
            )
        })
        .unwrap_or_else(|| panic!("no exported span for {tp}"))
}

fn seq(d: &onceflow_core::Delivery) -> u64 {
    d.position.as_sequence().unwrap()
}

const RECORD_TP: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
/// The sampled-out test's: a trace of its own, so no span of the other test is taken for one.
const RECORD_TP_OFF: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

#[tokio::test]
async fn a_recorded_send_exports_one_span_per_send_a_child_of_the_callers_context() {
    let Some(p) =
        platform("a_recorded_send_exports_one_span_per_send_a_child_of_the_callers_context").await
    else {
        return;
    };
    let t = topic(&p, "js-trace-on", 1).await;
    let client = Client::new(p.clone());
    let producer = client.producer(ProducerConfig::default()).await.unwrap();
    // The first send looks the topic up (the async path), the next ones take the direct path.
    let caller = global::tracer("test").start("caller");
    let caller_cx = Context::current_with_span(caller);
    let caller_sc = caller_cx.span().span_context().clone();
    let mut deliveries = Vec::new();
    for i in 0..3 {
        let d = producer
            .send(Record::new(t.clone(), format!("c{i}")).idempotency_key(format!("c{i}")))
            .with_context(caller_cx.clone())
            .await
            .unwrap();
        deliveries.push(d);
    }
    // A record carrying a traceparent of its own, no current context.
    let own = producer
        .send(Record::new(t.clone(), "r").header("traceparent", RECORD_TP))
        .await
        .unwrap();
    // Neither: a root span.
    let root = producer.send(Record::new(t.clone(), "n")).await.unwrap();

    let spans = sends_to(&t);
    assert_eq!(spans.len(), 5, "one span per send");
    for d in &deliveries {
        let tps = traceparents(&p, &t, seq(d)).await;
        assert_eq!(tps.len(), 1, "{tps:?}");
        let span = span_of(&spans, &tps[0]);
        assert_eq!(span.span_context.trace_id(), caller_sc.trace_id());
        assert_eq!(span.parent_span_id, caller_sc.span_id());
        assert_eq!(span.span_kind, SpanKind::Producer);
    }
    let tps = traceparents(&p, &t, seq(&own)).await;
    assert_eq!(tps.len(), 1, "{tps:?}");
    assert_ne!(
        tps[0], RECORD_TP,
        "the send's own span, a child of the record's"
    );
    let span = span_of(&spans, &tps[0]);
    assert_eq!(span.span_context.trace_id().to_string(), RECORD_TP[3..35]);
    assert_eq!(span.parent_span_id.to_string(), RECORD_TP[36..52]);
    let tps = traceparents(&p, &t, seq(&root)).await;
    assert_eq!(tps.len(), 1, "{tps:?}");
    assert!(spans.iter().any(|s| {
        tps[0]
            == format!(
                "00-{}-{}-01",
                s.span_context.trace_id(),
                s.span_context.span_id()
            )
            && s.parent_span_id == opentelemetry::trace::SpanId::INVALID
    }));
}

#[tokio::test]
async fn a_sampled_out_send_propagates_a_not_sampled_context_and_exports_nothing() {
    let Some(p) =
        platform("a_sampled_out_send_propagates_a_not_sampled_context_and_exports_nothing").await
    else {
        return;
    };
    let t = topic(&p, "js-trace-off", 1).await;
    OFF.with(|off| off.set(true));
    let client = Client::new(p.clone());
    let producer = client.producer(ProducerConfig::default()).await.unwrap();
    let mut plain = Vec::new();
    for i in 0..3 {
        plain.push(
            producer
                .send(Record::new(t.clone(), format!("p{i}")))
                .await
                .unwrap(),
        );
    }
    let own = producer
        .send(Record::new(t.clone(), "r").header("traceparent", RECORD_TP_OFF))
        .await
        .unwrap();
    let caller = global::tracer("test").start("caller");
    let caller_cx = Context::current_with_span(caller);
    let caller_trace = caller_cx.span().span_context().trace_id();
    let in_caller = producer
        .send(Record::new(t.clone(), "c").idempotency_key("c"))
        .with_context(caller_cx.clone())
        .await
        .unwrap();
    assert!(
        sends_to(&t).is_empty(),
        "a sampled-out span is not exported"
    );
    let mut traces = vec![caller_trace.to_string(), RECORD_TP_OFF[3..35].to_string()];
    for d in &plain {
        let tps = traceparents(&p, &t, seq(d)).await;
        assert_eq!(tps.len(), 1, "{tps:?}");
        assert!(
            tps[0].starts_with("00-") && tps[0].ends_with("-00"),
            "{tps:?}"
        );
        traces.push(tps[0][3..35].to_string());
    }
    // Nor under any name: no exported span is of these traces.
    for s in exporter().get_finished_spans().unwrap() {
        let trace = s.span_context.trace_id().to_string();
        assert!(!traces.contains(&trace), "exported: {s:?}");
    }
    let tps = traceparents(&p, &t, seq(&own)).await;
    assert_eq!(tps.len(), 1, "{tps:?}");
    assert!(
        tps[0].contains(&RECORD_TP_OFF[3..35]),
        "the record's trace: {tps:?}"
    );
    assert!(
        !tps[0].contains(&RECORD_TP_OFF[36..52]),
        "a span of its own: {tps:?}"
    );
    assert!(tps[0].ends_with("-00"), "{tps:?}");
    let tps = traceparents(&p, &t, seq(&in_caller)).await;
    assert_eq!(tps.len(), 1, "{tps:?}");
    assert!(tps[0].contains(&caller_trace.to_string()), "{tps:?}");
    assert!(tps[0].ends_with("-00"), "{tps:?}");
}
