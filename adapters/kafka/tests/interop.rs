//! Interop with other people's Kafka clients on the same real broker:
//!
//! - `confluent_kafka_trace_continues_in_onceflow`: a Python script with `confluent-kafka` and
//!   `opentelemetry-instrumentation-confluent-kafka` produces messages inside a span; onceflow's
//!   idempotent consumer continues that trace: with an OpenTelemetry SDK tracer provider and an
//!   in-memory exporter here, every `process {topic}` span has the Python trace id and, as
//!   parent, the instrumentation's producer span of its message.
//! - `onceflow_headers_reach_confluent_kafka_and_kafkajs`: records onceflow produces, with
//!   binary header values, null and empty values and repeated names, are read back by
//!   confluent-kafka (Python) and kafkajs (Node) with every header intact, as far as each
//!   client can represent it (see the test).
//!
//! The clients come from PyPI and the npm registry, installed once by
//! `tests/interop/kafka-env.sh` into `~/.cache/onceflow/venv-kafka-interop` and
//! `~/.cache/onceflow/node-kafka-interop`. Runs when `ONCEFLOW_KAFKA_URL` is set; without it
//! each test says it skipped, and with `ONCEFLOW_REQUIRE_BROKERS=1` (`make test`) that is a
//! failure.

mod common;

use common::{name, url};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use onceflow_core::{
    handler_fn, Client, ConsumerConfig, Headers, IdempotentConsumer, ProducerConfig, Record,
    StartFrom, TopicSpec,
};
use opentelemetry::trace::{SpanKind, TraceContextExt};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use serde_json::Value;

fn bootstrap(url: &str) -> String {
    onceflow_kafka::parse_url(url).unwrap().bootstrap_servers
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `PYTHON` and `NODE_PATH` of the cached client environments (created on first use; one
/// test at a time runs the installer).
fn clients() -> &'static BTreeMap<String, String> {
    static ENV: OnceLock<BTreeMap<String, String>> = OnceLock::new();
    ENV.get_or_init(|| {
        let out = Command::new("bash")
            .arg(repo().join("tests/interop/kafka-env.sh"))
            .stderr(std::process::Stdio::inherit())
            .output()
            .expect("run tests/interop/kafka-env.sh");
        assert!(
            out.status.success(),
            "tests/interop/kafka-env.sh failed: {}",
            out.status
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    })
}

/// Runs a client script and parses the JSON it prints last.
fn run_json(mut cmd: Command, what: &str) -> Value {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{what} failed ({}): {}\n{stdout}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{what} printed {last:?}: {e}"))
}

async fn topic(client: &Client, prefix: &str) -> String {
    let t = name(prefix);
    client
        .admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(t.clone(), 1))
        .await
        .unwrap();
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confluent_kafka_trace_continues_in_onceflow() {
    let Some(url) = url("confluent_kafka_trace_continues_in_onceflow") else {
        return;
    };
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    opentelemetry::global::set_tracer_provider(provider.clone());

    let client = Client::new(onceflow_kafka::connect(&url).unwrap());
    let t = topic(&client, "interop-otel").await;
    let n = 5usize;
    let python = clients()["PYTHON"].clone();
    let mut cmd = Command::new(python);
    cmd.arg(repo().join("tests/interop/kafka_otel_produce.py"))
        .args([bootstrap(&url), t.clone(), n.to_string()]);
    let produced = tokio::task::spawn_blocking(move || run_json(cmd, "kafka_otel_produce.py"))
        .await
        .unwrap();
    let py_trace = produced["trace_id"].as_str().unwrap().to_string();
    let py_parent = produced["parent_span_id"].as_str().unwrap().to_string();
    let producer_spans: BTreeSet<String> = produced["producer_spans"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            assert_eq!(s["trace_id"], py_trace.as_str(), "{s}");
            assert_eq!(s["parent"], py_parent.as_str(), "{s}");
            s["span_id"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(producer_spans.len(), n, "one producer span per message");

    let consumer = client
        .consumer(ConsumerConfig::new(name("interop-otel"), [t.clone()]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let handled: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let h = handled.clone();
    let engine = IdempotentConsumer::new(
        consumer,
        None,
        handler_fn(move |m| {
            let h = h.clone();
            async move {
                let cx = opentelemetry::Context::current();
                let sc = cx.span().span_context().clone();
                h.lock().unwrap().push((
                    String::from_utf8_lossy(&m.payload).into_owned(),
                    sc.trace_id().to_string(),
                ));
                Ok(None)
            }
        }),
    );
    let done = handled.clone();
    engine
        .run_until(async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            while done.lock().unwrap().len() < n && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .unwrap();
    let _ = provider.force_flush();
    let handled = handled.lock().unwrap().clone();
    assert_eq!(
        handled.len(),
        n,
        "every Python message handled: {handled:?}"
    );
    assert!(
        handled.iter().all(|(_, tid)| *tid == py_trace),
        "the handler runs in the Python trace {py_trace}: {handled:?}"
    );
    let spans = exporter.get_finished_spans().unwrap();
    let process: Vec<_> = spans
        .iter()
        .filter(|s| s.span_kind == SpanKind::Consumer && s.name == format!("process {t}"))
        .collect();
    assert_eq!(process.len(), n, "one process span per message: {spans:?}");
    let parents: BTreeSet<String> = process
        .iter()
        .map(|s| {
            assert_eq!(s.span_context.trace_id().to_string(), py_trace, "{s:?}");
            s.parent_span_id.to_string()
        })
        .collect();
    assert_eq!(
        parents, producer_spans,
        "each process span's parent is the confluent-kafka producer span of its message"
    );
}

/// The headers under test, in order: binary values, an empty value, a null value, a repeated
/// name interleaved with another, a non-ASCII name.
fn tricky_headers(i: usize) -> Headers {
    let mut h = Headers::new();
    h.insert("bin", vec![0x00, 0xff, 0x80, 0x0a, i as u8]);
    h.insert("empty", Vec::<u8>::new());
    h.insert_null("null");
    h.insert("rep", "first");
    h.insert("mid", "m");
    h.insert("rep", Vec::<u8>::new());
    h.insert("rep", "third");
    h.insert("ünïcode", "välue");
    h
}

fn is_trace_header(name: &str) -> bool {
    matches!(name, "traceparent" | "tracestate" | "baggage")
}

fn hex(v: Option<&[u8]>) -> Value {
    match v {
        Some(b) => Value::String(b.iter().map(|x| format!("{x:02x}")).collect()),
        None => Value::Null,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn onceflow_headers_reach_confluent_kafka_and_kafkajs() {
    let Some(url) = url("onceflow_headers_reach_confluent_kafka_and_kafkajs") else {
        return;
    };
    let client = Client::new(onceflow_kafka::connect(&url).unwrap());
    let t = topic(&client, "interop-headers").await;
    let n = 3usize;
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    for i in 0..n {
        let mut r = Record::new(t.clone(), format!("of-{i}"));
        r.headers = tricky_headers(i);
        producer.send(r).await.unwrap();
    }
    let env = clients();
    let (bs, tt) = (bootstrap(&url), t.clone());
    let mut py = Command::new(&env["PYTHON"]);
    py.arg(repo().join("tests/interop/kafka_read_headers.py"))
        .args([bs.clone(), tt.clone(), n.to_string()]);
    let mut js = Command::new("node");
    js.arg(repo().join("tests/interop/kafka_read_headers.js"))
        .args([bs, tt, n.to_string()])
        .env("NODE_PATH", &env["NODE_PATH"]);
    let (py_out, js_out) = tokio::task::spawn_blocking(move || {
        (
            run_json(py, "kafka_read_headers.py"),
            run_json(js, "kafka_read_headers.js"),
        )
    })
    .await
    .unwrap();

    for i in 0..n {
        let want = tricky_headers(i);
        // confluent-kafka: a list of (name, bytes | None): order, repeats, null vs empty, all
        // kept. Trace headers onceflow adds when a tracer provider is installed (another test
        // of this binary installs one) come after the record's own and are left out here.
        let m = &py_out[i];
        assert_eq!(m["payload"], format!("of-{i}"));
        let got: Vec<Value> = m["headers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|h| !is_trace_header(h[0].as_str().unwrap()))
            .cloned()
            .collect();
        let want_list: Vec<Value> = want
            .iter()
            .map(|h| serde_json::json!([h.name, hex(h.value.as_deref())]))
            .collect();
        assert_eq!(
            got, want_list,
            "confluent-kafka sees onceflow's headers as sent"
        );

        // kafkajs: an object keyed by name; a repeated name is an array of its values in
        // order; null stays null, empty stays empty. It cannot represent the interleaving of
        // different names (rep, mid, rep), only each name's own order.
        let m = &js_out[i];
        assert_eq!(m["payload"], format!("of-{i}"));
        let mut want_obj = serde_json::Map::new();
        let names: Vec<&str> = want.iter().map(|h| h.name.as_str()).collect();
        for n in &names {
            if want_obj.contains_key(*n) {
                continue;
            }
            let vals: Vec<Value> = want.get_all(n).map(|v| hex(v.map(|b| &b[..]))).collect();
            let v = if vals.len() == 1 {
                vals.into_iter().next().unwrap()
            } else {
                Value::Array(vals)
            };
            want_obj.insert(n.to_string(), v);
        }
        let mut got = m["headers"].as_object().unwrap().clone();
        got.retain(|k, _| !is_trace_header(k));
        assert_eq!(got, want_obj, "kafkajs sees onceflow's headers as sent");
    }
}
