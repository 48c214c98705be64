//! W3C trace context through pipelines and sends on real brokers, with an OpenTelemetry SDK
//! tracer provider and meter provider installed globally (a binary of its own, so the
//! providers disturb no other test; every span and metric point is told apart by its topic or
//! consumer group, so the tests may share the providers).
//!
//! - A pipeline, in every mode, runs its transform inside a `process {input}` span that is the
//!   child of the producer span the input carries, and sends its outputs as children of that
//!   process span — also when the transform copies the input's headers (its `traceparent`)
//!   onto its outputs. Kafka exactly-once (transactions) and JetStream effectively-once
//!   (message ids) are the two mechanisms tested here (issue #30, point 6).
//! - A record carrying trace headers under other casings (`Traceparent`, `Tracestate`, as older
//!   clients write them) is stored with exactly one `traceparent` and at most one `tracestate`;
//!   the record's `tracestate` is kept when its trace is the one continued and dropped
//!   otherwise (W3C Trace Context §3.3 and §4.3; issue #30, point 8).
//! - Malformed `traceparent` headers an engine meets are counted in its `MetricsSnapshot` and
//!   exported as the OpenTelemetry counter `onceflow.malformed_traceparents` (issue #30,
//!   point 9).
//!
//! Runs when `ONCEFLOW_KAFKA_URL` / `ONCEFLOW_NATS_URL` are set (`tests/brokers/up.sh kafka
//! nats`); without one, its tests print that they skipped and why.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use onceflow_conformance::harness::{broker_url, env_harness, Harness, PlatformHarness, Timings};
use onceflow_core::{
    Client, ConsumerConfig, EngineConfig, Message, Pipeline, PipelineConfig, PipelineMode,
    ProducerConfig, Record, StartFrom,
};
use opentelemetry::context::FutureExt as _;
use opentelemetry::trace::{SpanId, TraceContextExt as _, TraceId, Tracer as _};
use opentelemetry::{global, Context};
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tokio::time::Instant;

struct Telemetry {
    spans: InMemorySpanExporter,
    metrics: InMemoryMetricExporter,
    meters: SdkMeterProvider,
}

/// The global providers, installed once for the binary (before any engine is built, so the
/// engines' instruments are the SDK's).
fn telemetry() -> &'static Telemetry {
    static T: OnceLock<Telemetry> = OnceLock::new();
    T.get_or_init(|| {
        let spans = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(spans.clone())
            .build();
        global::set_tracer_provider(provider);
        let metrics = InMemoryMetricExporter::default();
        let meters = SdkMeterProvider::builder()
            .with_reader(PeriodicReader::builder(metrics.clone()).build())
            .build();
        global::set_meter_provider(meters.clone());
        Telemetry {
            spans,
            metrics,
            meters,
        }
    })
}

fn kafka() -> PlatformHarness {
    env_harness(
        "ONCEFLOW_KAFKA_URL",
        "kafka",
        |url| Ok(onceflow_kafka::connect(url)?),
        "kafka://127.0.0.1:9",
    )
}

async fn jetstream() -> Option<PlatformHarness> {
    match broker_url("ONCEFLOW_NATS_URL", "nats") {
        Ok(url) => {
            let sep = if url.contains('?') { '&' } else { '?' };
            let url = format!("{url}{sep}storage=memory&ack_wait_ms=2000");
            let platform = onceflow_jetstream::connect(&url)
                .await
                .unwrap_or_else(|e| panic!("ONCEFLOW_NATS_URL='{url}': cannot connect: {e}"));
            Some(PlatformHarness::new(platform, Timings::broker()))
        }
        Err(reason) => {
            eprintln!("trace_pipeline: SKIPPED on jetstream: {reason}");
            None
        }
    }
}

/// `h`, or `None` (printing why) when its broker is not configured.
fn ready(h: PlatformHarness) -> Option<PlatformHarness> {
    match Harness::skip_all(&h) {
        Some(reason) => {
            eprintln!(
                "trace_pipeline: SKIPPED on {}: {reason}",
                h.platform().name()
            );
            None
        }
        None => Some(h),
    }
}

fn spans() -> Vec<SpanData> {
    telemetry().spans.get_finished_spans().unwrap()
}

fn span_by_id(all: &[SpanData], id: SpanId) -> Option<&SpanData> {
    all.iter().find(|s| s.span_context.span_id() == id)
}

/// Trace and span id of a `traceparent` value (version 00).
fn parse_tp(tp: &str) -> (TraceId, SpanId) {
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "traceparent '{tp}'");
    (
        TraceId::from_hex(parts[1]).unwrap(),
        SpanId::from_hex(parts[2]).unwrap(),
    )
}

/// Values of every header whose name is `name` in any casing.
fn all_any_case(m: &Message, name: &str) -> Vec<String> {
    m.headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case(name))
        .map(|h| String::from_utf8_lossy(h.value.as_deref().unwrap_or_default()).into_owned())
        .collect()
}

/// Reads `n` messages of `topic` from the start with a new group.
async fn read(h: &dyn Harness, client: &Client, topic: &str, n: usize) -> Vec<Message> {
    let c = client
        .consumer(
            ConsumerConfig::new(h.group(), [topic.to_string()])
                .start(StartFrom::committed_or_earliest()),
        )
        .await
        .unwrap();
    let deadline = Instant::now() + h.timings().wait;
    let mut out = Vec::new();
    while out.len() < n && Instant::now() < deadline {
        out.extend(c.poll(100, h.timings().poll).await.unwrap());
    }
    c.close().await.unwrap();
    assert_eq!(out.len(), n, "messages read from {topic}");
    out
}

/// Sends `n` inputs to a new topic, each inside an `upstream` span of its own (so each input
/// carries the `traceparent` of its send span), runs a pipeline in `mode` that writes one
/// output per input (odd inputs: the transform copies the input's headers onto its output, as
/// forwarding code does), and checks every output's trace: output → `send {output}` span →
/// `process {input}` span → the input's `send {input}` span, all in the input's trace.
async fn pipeline_outputs_are_children_of_the_process_span(
    h: &PlatformHarness,
    mode: PipelineMode,
    n: usize,
) {
    telemetry();
    let client = Client::new(h.platform());
    let input = h.topic(1).await.unwrap();
    let output = h.topic(1).await.unwrap();
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    let tracer = global::tracer("test");
    for i in 0..n {
        let up = Context::current_with_span(tracer.start("upstream"));
        producer
            .send(Record::new(input.clone(), format!("v{i}")).idempotency_key(format!("k{i}")))
            .with_context(up.clone())
            .await
            .unwrap();
        up.span().end();
    }
    producer.flush(Duration::from_secs(30)).await.unwrap();
    let inputs = read(h, &client, &input, n).await;

    let consumer = client
        .consumer(
            ConsumerConfig::new(h.group(), [input.clone()])
                .start(StartFrom::committed_or_earliest()),
        )
        .await
        .unwrap();
    let out_producer = client
        .producer(ProducerConfig::new().transactional_id(h.transactional_id()))
        .await
        .unwrap();
    let out_topic = output.clone();
    let transform = move |m: &Message| {
        let odd = m.payload.last().is_some_and(|b| (b - b'0') % 2 == 1);
        let mut r = Record::new(out_topic.clone(), m.payload.clone());
        if odd {
            r.headers = m.headers.clone();
            r.headers.remove(onceflow_core::IDEMPOTENCY_KEY_HEADER);
        }
        Ok(vec![r])
    };
    let config = PipelineConfig {
        engine: EngineConfig {
            poll_timeout: h.timings().poll,
            commit_interval: Duration::from_millis(50),
            ..EngineConfig::default()
        },
        mode,
        transaction_interval: Duration::from_millis(50),
        ..PipelineConfig::default()
    };
    let pipeline =
        Pipeline::with_config(consumer, out_producer, None, Arc::new(transform), config).unwrap();
    let metrics = pipeline.metrics();
    let deadline = Instant::now() + h.timings().wait;
    let m2 = metrics.clone();
    let done = async move {
        while Instant::now() < deadline && (m2.snapshot().processed as usize) < n {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Let the last transaction commit before the shutdown drains.
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    pipeline.run_until(done).await.unwrap();
    let outputs = read(h, &client, &output, n).await;

    let all = spans();
    for out in &outputs {
        let payload = String::from_utf8_lossy(&out.payload).into_owned();
        let inp = inputs
            .iter()
            .find(|m| m.payload == out.payload)
            .expect("an input per output");
        let (in_trace, in_send) = parse_tp(inp.headers.get_str("traceparent").unwrap());
        let tps = all_any_case(out, "traceparent");
        assert_eq!(
            tps.len(),
            1,
            "output {payload}: one traceparent, got {tps:?}"
        );
        let (out_trace, out_span) = parse_tp(&tps[0]);
        assert_eq!(
            out_trace, in_trace,
            "output {payload} continues its input's trace"
        );
        let send = span_by_id(&all, out_span)
            .unwrap_or_else(|| panic!("output {payload}: its traceparent names no exported span"));
        assert_eq!(send.name, format!("send {output}"));
        let process = span_by_id(&all, send.parent_span_id).unwrap_or_else(|| {
            panic!(
                "output {payload}: the parent of its send span ({}) is no exported span",
                send.parent_span_id
            )
        });
        assert_eq!(
            process.name,
            format!("process {input}"),
            "output {payload}: its send span is a child of the process span"
        );
        assert_eq!(process.span_kind, opentelemetry::trace::SpanKind::Consumer);
        assert_eq!(
            process.parent_span_id, in_send,
            "output {payload}: the process span is a child of the input's send span"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_exactly_once_pipeline_outputs_are_children_of_the_process_span() {
    let Some(h) = ready(kafka()) else { return };
    pipeline_outputs_are_children_of_the_process_span(&h, PipelineMode::Transactional, 6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_effectively_once_pipeline_outputs_are_children_of_the_process_span() {
    let Some(h) = jetstream().await else { return };
    pipeline_outputs_are_children_of_the_process_span(&h, PipelineMode::Idempotent, 6).await;
}

const USER_TP: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
const USER_TS: &str = "congo=t61rcWkgMzE";

/// A record with `Traceparent` / `Tracestate` (capitalised) is stored with one `traceparent`
/// and one `tracestate`: without a current span its own trace is continued and its trace
/// state kept; inside a caller's span the caller's trace wins and the record's trace state
/// (which belongs to the other trace) is dropped. Single sends, batches and transactions.
async fn trace_headers_are_replaced_whatever_their_case(h: &PlatformHarness) {
    telemetry();
    let client = Client::new(h.platform());
    let topic = h.topic(1).await.unwrap();
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    let rec = |i: u32| {
        Record::new(topic.clone(), format!("m{i}"))
            .header("Traceparent", USER_TP)
            .header("Tracestate", USER_TS)
            .header("x", "y")
    };
    producer.send(rec(0)).await.unwrap();
    for r in producer.send_batch(vec![rec(1), rec(2)]).await {
        r.unwrap();
    }
    let caller = Context::current_with_span(global::tracer("test").start("caller"));
    let caller_trace = caller.span().span_context().trace_id();
    producer
        .send(rec(3))
        .with_context(caller.clone())
        .await
        .unwrap();
    for r in producer
        .send_batch(vec![rec(4)])
        .with_context(caller.clone())
        .await
    {
        r.unwrap();
    }
    producer.flush(Duration::from_secs(30)).await.unwrap();
    let mut got = read(h, &client, &topic, 5).await;
    got.sort_by(|a, b| a.payload.cmp(&b.payload));
    for (i, m) in got.iter().enumerate() {
        let tps = all_any_case(m, "traceparent");
        let tss = all_any_case(m, "tracestate");
        assert_eq!(tps.len(), 1, "m{i}: exactly one traceparent, got {tps:?}");
        assert_eq!(
            m.headers.get_all("traceparent").count(),
            1,
            "m{i}: stored under the W3C name"
        );
        assert_eq!(
            m.headers.get_str("x"),
            Some("y"),
            "m{i}: other headers kept"
        );
        let (trace, _) = parse_tp(&tps[0]);
        if i < 3 {
            assert_eq!(
                trace,
                parse_tp(USER_TP).0,
                "m{i}: the record's trace continues"
            );
            assert_eq!(tss, vec![USER_TS.to_string()], "m{i}: its tracestate kept");
        } else {
            assert_eq!(trace, caller_trace, "m{i}: the caller's trace wins");
            assert!(
                tss.is_empty(),
                "m{i}: the record's tracestate belongs to another trace and is dropped, got {tss:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_trace_headers_are_replaced_whatever_their_case() {
    let Some(h) = ready(kafka()) else { return };
    trace_headers_are_replaced_whatever_their_case(&h).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_trace_headers_are_replaced_whatever_their_case() {
    let Some(h) = jetstream().await else { return };
    trace_headers_are_replaced_whatever_their_case(&h).await;
}

/// The value of the `onceflow.malformed_traceparents` counter for consumer group `group`, as
/// the SDK exported it last.
fn malformed_metric(group: &str) -> Option<u64> {
    let t = telemetry();
    t.meters.force_flush().unwrap();
    let mut found = None;
    for rm in t.metrics.get_finished_metrics().unwrap() {
        for sm in rm.scope_metrics() {
            for m in sm.metrics() {
                if m.name() != "onceflow.malformed_traceparents" {
                    continue;
                }
                if let AggregatedMetrics::U64(MetricData::Sum(sum)) = m.data() {
                    for p in sum.data_points() {
                        if p.attributes().any(|kv| {
                            kv.key.as_str() == "messaging.consumer.group.name"
                                && kv.value.as_str() == group
                        }) {
                            found = Some(p.value());
                        }
                    }
                }
            }
        }
    }
    found
}

/// A Kafka exactly-once pipeline meeting inputs with malformed `traceparent`s processes them
/// and counts each in its snapshot and in the OpenTelemetry counter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_pipeline_counts_malformed_traceparents_in_snapshot_and_metric() {
    let Some(h) = ready(kafka()) else { return };
    telemetry();
    let client = Client::new(h.platform());
    let input = h.topic(1).await.unwrap();
    let output = h.topic(1).await.unwrap();
    // Through the backend: the public producer replaces trace headers.
    let raw = h.platform().producer(ProducerConfig::new()).await.unwrap();
    for (i, tp) in ["00-not-a-trace-01", USER_TP, "garbage"].iter().enumerate() {
        let mut r = Record::new(input.clone(), format!("v{i}"));
        r.headers.insert("traceparent", *tp);
        raw.send(r).await.unwrap();
    }
    raw.flush(Duration::from_secs(30)).await.unwrap();
    let group = h.group();
    let consumer = client
        .consumer(
            ConsumerConfig::new(group.clone(), [input.clone()])
                .start(StartFrom::committed_or_earliest()),
        )
        .await
        .unwrap();
    let out_producer = client
        .producer(ProducerConfig::new().transactional_id(h.transactional_id()))
        .await
        .unwrap();
    let out = output.clone();
    let transform = move |m: &Message| Ok(vec![Record::new(out.clone(), m.payload.clone())]);
    let config = PipelineConfig {
        engine: EngineConfig {
            poll_timeout: h.timings().poll,
            ..EngineConfig::default()
        },
        mode: PipelineMode::Transactional,
        transaction_interval: Duration::from_millis(50),
        ..PipelineConfig::default()
    };
    let pipeline =
        Pipeline::with_config(consumer, out_producer, None, Arc::new(transform), config).unwrap();
    let metrics = pipeline.metrics();
    let m2 = metrics.clone();
    let deadline = Instant::now() + h.timings().wait;
    let done = async move {
        while Instant::now() < deadline && m2.snapshot().processed < 3 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let summary = pipeline.run_until(done).await.unwrap();
    assert_eq!(summary.metrics.processed, 3);
    assert_eq!(
        summary.metrics.malformed_traceparents, 2,
        "two inputs with a malformed traceparent"
    );
    assert_eq!(metrics.snapshot().malformed_traceparents, 2);
    assert_eq!(
        malformed_metric(&group),
        Some(2),
        "exported as onceflow.malformed_traceparents for group {group}"
    );
}

/// The transactional inbox's handler (embedded store, Rust) runs inside a `process {topic}`
/// span per attempt, the child of the producer span the message carries, with the idempotent
/// consumer's attributes; the failed first attempt's span is marked failed; a repeated key (a
/// duplicate) starts no span (issue #24).
async fn inbox_handler_runs_in_a_process_span_per_attempt(h: &PlatformHarness) {
    use onceflow_core::inbox::InboxConfig;
    use onceflow_core::{dedup::EmbeddedStore, KeyStrategy};
    use std::sync::atomic::{AtomicUsize, Ordering};

    telemetry();
    let client = Client::new(h.platform());
    let topic = h.topic(1).await.unwrap();
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    let tracer = global::tracer("test");
    let up = Context::current_with_span(tracer.start("upstream"));
    for _ in 0..2 {
        producer
            .send(Record::new(topic.clone(), "order").header("order-id", "o1"))
            .with_context(up.clone())
            .await
            .unwrap();
    }
    up.span().end();
    producer.flush(Duration::from_secs(30)).await.unwrap();

    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(dir.path().join("inbox.db"), Duration::from_secs(3600))
        .await
        .unwrap();
    let consumer = client
        .consumer(ConsumerConfig::new(h.group(), [topic.clone()]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let config = InboxConfig {
        key: KeyStrategy::Header("order-id".into()),
        backoff: Duration::from_millis(10),
        ..InboxConfig::default()
    };
    let mut inbox = store.inbox(consumer, config).await.unwrap();
    let attempts = Arc::new(AtomicUsize::new(0));
    let seen = attempts.clone();
    let handler = Arc::new(
        move |_tx: &mut onceflow_core::rusqlite::Transaction<'_>,
              _m: &Message|
              -> Result<(), onceflow_core::BoxError> {
            // The handler runs with the process span current on its (blocking) thread.
            assert!(Context::current().span().span_context().is_valid());
            if seen.fetch_add(1, Ordering::SeqCst) == 0 {
                return Err("first attempt fails".into());
            }
            Ok(())
        },
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while inbox.summary().handled + inbox.summary().duplicates < 2 {
        assert!(Instant::now() < deadline, "{:?}", inbox.summary());
        inbox.step(&handler).await.unwrap();
    }
    assert_eq!(inbox.summary().handled, 1, "{:?}", inbox.summary());
    assert_eq!(inbox.summary().duplicates, 1, "{:?}", inbox.summary());
    assert_eq!(attempts.load(Ordering::SeqCst), 2);

    let all = spans();
    let name = format!("process {topic}");
    let process: Vec<&SpanData> = all.iter().filter(|s| s.name == name).collect();
    assert_eq!(process.len(), 2, "two attempts, none for the duplicate");
    let sends: Vec<SpanId> = all
        .iter()
        .filter(|s| s.name == format!("send {topic}"))
        .map(|s| s.span_context.span_id())
        .collect();
    for p in &process {
        assert_eq!(p.span_kind, opentelemetry::trace::SpanKind::Consumer);
        assert_eq!(
            p.span_context.trace_id(),
            up.span().span_context().trace_id()
        );
        assert!(sends.contains(&p.parent_span_id), "a child of a send span");
        let keys: std::collections::BTreeSet<&str> =
            p.attributes.iter().map(|kv| kv.key.as_str()).collect();
        assert!(keys.contains("messaging.consumer.group.name"), "{keys:?}");
        assert!(keys.contains("messaging.message.id"), "{keys:?}");
    }
    let failed = process
        .iter()
        .filter(|p| matches!(p.status, opentelemetry::trace::Status::Error { .. }))
        .count();
    assert_eq!(failed, 1, "the failed attempt's span is marked failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_inbox_handler_runs_in_a_process_span_per_attempt() {
    let Some(h) = ready(kafka()) else { return };
    inbox_handler_runs_in_a_process_span_per_attempt(&h).await;
}
