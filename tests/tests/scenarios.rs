//! The Rust interpreter of the cross-language scenario suite (`tests/scenarios/scenarios.json`,
//! issue #24), through the facade crate `onceflow` as a user's program would: every
//! (scenario, platform) cell of the spec runs against the real broker named by the spec's
//! environment variable and prints `SCENARIO <name> rust <platform> PASS|FAIL` (also written to
//! `$CARGO_TARGET_DIR/scenarios/rust.txt` for `tests/scenarios/check.py`). The Python
//! (`python/tests/test_scenarios.py`) and Node (`node/test/scenarios.test.js`) interpreters run
//! the same file.
//!
//! A test binary of its own without libtest's harness (`harness = false`), so the lines print
//! whether cells pass or fail; it exits non-zero when a cell fails. The cells run concurrently,
//! a few at a time. A platform whose variable is unset is skipped with the reason, or fails
//! with `ONCEFLOW_REQUIRE_BROKERS=1` (set by `make test`).

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use onceflow::{
    handler_fn, Client, ConsumerConfig, EngineConfig, Error, Headers, IdempotentConsumer,
    KeyStrategy, Message, MetricsSnapshot, Pipeline, PipelineConfig, ProducerConfig, Record,
    StartFrom, TopicSpec,
};
use opentelemetry::context::FutureExt as _;
use opentelemetry::trace::{TraceContextExt as _, Tracer as _};
use opentelemetry::{global, Context};
use opentelemetry_sdk::trace::SdkTracerProvider;
use serde_json::Value;
use tokio::sync::Semaphore;
use tokio::time::Instant;

const LANGUAGE: &str = "rust";
const TRACE_HEADERS: [&str; 3] = ["traceparent", "tracestate", "baggage"];
const CELL_TIMEOUT: Duration = Duration::from_secs(120);
const WAIT: Duration = Duration::from_secs(60);
const PARALLEL: usize = 12;

/// Why a cell failed: an onceflow error (its kind may be the documented one) or anything else.
#[derive(Debug)]
enum Fail {
    Onceflow(Error),
    Check(String),
}

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        Fail::Onceflow(e)
    }
}

impl std::fmt::Display for Fail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fail::Onceflow(e) => write!(f, "{e}"),
            Fail::Check(s) => f.write_str(s),
        }
    }
}

type Res<T = ()> = std::result::Result<T, Fail>;

fn fail<T>(msg: impl Into<String>) -> Res<T> {
    Err(Fail::Check(msg.into()))
}

fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Res {
    if cond {
        Ok(())
    } else {
        fail(msg())
    }
}

fn unique(prefix: &str) -> String {
    format!("{prefix}-{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as i64
}

/// A missing broker variable: skipped, or failed with `ONCEFLOW_REQUIRE_BROKERS=1`.
struct MissingEnv(String);

fn env_url(var: &str) -> std::result::Result<String, MissingEnv> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Ok(v),
        _ => Err(MissingEnv(format!(
            "{var} is not set (tests/brokers/up.sh starts the broker)"
        ))),
    }
}

fn str_of<'a>(v: &'a Value, field: &str) -> &'a str {
    v[field]
        .as_str()
        .unwrap_or_else(|| panic!("spec: '{field}' is not a string in {v}"))
}

fn platform_url(spec: &Value, name: &str) -> std::result::Result<String, MissingEnv> {
    let p = &spec["platforms"][name];
    if let Some(url) = p["url"].as_str() {
        return Ok(format!("{url}{}", unique("rs-scn")));
    }
    let mut url = env_url(str_of(p, "env"))?;
    let mut extra = Vec::new();
    if let Some(q) = p["query"].as_str() {
        extra.push(q.to_string());
    }
    if let Some(var) = p["admin_env"].as_str() {
        if let Ok(admin) = std::env::var(var) {
            if !admin.is_empty() && !url.contains("admin=") {
                extra.push(format!("admin={admin}"));
            }
        }
    }
    if !extra.is_empty() {
        url.push(if url.contains('?') { '&' } else { '?' });
        url.push_str(&extra.join("&"));
    }
    Ok(url)
}

fn store_url(spec: &Value, name: &str, tmp: &Path) -> std::result::Result<String, MissingEnv> {
    let s = &spec["stores"][name];
    if let Some(url) = s["url"].as_str() {
        return Ok(url.to_string());
    }
    if s["file"].as_bool() == Some(true) {
        return Ok(tmp
            .join(format!("{}.db", unique("dedup")))
            .display()
            .to_string());
    }
    env_url(str_of(s, "env"))
}

/// A spec value, `hex:…` or `text:…`; JSON null is `None`.
fn value(v: &Value) -> Option<Bytes> {
    let s = v.as_str()?;
    let (kind, rest) = s
        .split_once(':')
        .unwrap_or_else(|| panic!("spec value {s}"));
    Some(match kind {
        "hex" => Bytes::from(
            (0..rest.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&rest[i..i + 2], 16).expect("spec hex"))
                .collect::<Vec<u8>>(),
        ),
        "text" => Bytes::from(rest.to_string()),
        _ => panic!("spec value {s}: expected hex:… or text:…"),
    })
}

fn shown(b: &Option<Bytes>) -> String {
    match b {
        None => "null".into(),
        Some(b) => format!(
            "hex:{}",
            b.iter().map(|x| format!("{x:02x}")).collect::<String>()
        ),
    }
}

fn spec_headers(r: &Value) -> Vec<(String, Option<Bytes>)> {
    r["headers"]
        .as_array()
        .map(|hs| {
            hs.iter()
                .map(|h| {
                    (
                        h[0].as_str().expect("header name").to_string(),
                        value(&h[1]),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn metric(m: &MetricsSnapshot, name: &str) -> u64 {
    match name {
        "consumed" => m.consumed,
        "processed" => m.processed,
        "duplicates_skipped" => m.duplicates_skipped,
        "handler_errors" => m.handler_errors,
        "retries" => m.retries,
        "dead_lettered" => m.dead_lettered,
        "redelivery_requests" => m.redelivery_requests,
        other => panic!("spec: unknown metric '{other}'"),
    }
}

/// Spec engine settings (`*_ms` in milliseconds) on an [`EngineConfig`].
fn engine_config(step: &Value) -> EngineConfig {
    let mut c = EngineConfig {
        poll_timeout: Duration::from_millis(50),
        ..EngineConfig::default()
    };
    if let Some(cfg) = step["config"].as_object() {
        for (k, v) in cfg {
            let n = v.as_u64().expect("spec: engine settings are numbers");
            match k.as_str() {
                "max_attempts" => c.max_attempts = n as u32,
                "redelivery_delay_ms" => c.redelivery_delay = Duration::from_millis(n),
                "commit_interval_ms" => c.commit_interval = Duration::from_millis(n),
                other => panic!("spec: engine setting '{other}' unknown to the Rust interpreter"),
            }
        }
    }
    if let Some(h) = step["key_header"].as_str() {
        c.key = KeyStrategy::Header(h.to_string());
    }
    c
}

/// Polls until `want` messages arrived (or the wait ran out), then `quiet_ms` more.
async fn read(consumer: &onceflow::Consumer, want: usize, quiet_ms: u64) -> Res<Vec<Message>> {
    let mut got: Vec<Message> = Vec::new();
    let deadline = Instant::now() + WAIT;
    while got.len() < want && Instant::now() < deadline {
        got.extend(
            consumer
                .poll(want - got.len(), Duration::from_millis(200))
                .await?,
        );
    }
    let quiet = Instant::now() + Duration::from_millis(quiet_ms);
    while Instant::now() < quiet {
        got.extend(consumer.poll(10, Duration::from_millis(200)).await?);
    }
    Ok(got)
}

/// The payloads of `got` are those of the spec (`expected`, a list), as a multiset.
fn check_payloads(got: &[Message], expected: &Value, what: &str) -> Res {
    let mut actual: Vec<String> = got
        .iter()
        .map(|m| shown(&Some(m.payload.clone())))
        .collect();
    let mut expected: Vec<String> = expected
        .as_array()
        .expect("spec: a list of payloads")
        .iter()
        .map(|p| shown(&value(p)))
        .collect();
    actual.sort();
    expected.sort();
    ensure(actual == expected, || {
        format!("payloads {what}: {actual:?}, expected {expected:?}")
    })
}

async fn wait_until(what: &str, mut pred: impl FnMut() -> bool) -> Res {
    let deadline = Instant::now() + WAIT;
    while !pred() {
        if Instant::now() > deadline {
            return fail(format!("timed out after {WAIT:?} waiting for {what}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

struct Cell<'a> {
    spec: &'a Value,
    scenario: &'a Value,
    store: Option<&'a str>,
    platform: &'a str,
    client: Client,
    tmp: &'a Path,
    topics: BTreeMap<String, String>,
    vars: BTreeMap<String, String>,
}

/// What the inbox handler saw: calls per key, and the table's row count at each call.
#[derive(Debug, Default, Clone)]
struct InboxSeen {
    calls: BTreeMap<String, u64>,
    rows: Vec<i64>,
}

impl InboxSeen {
    fn record(&mut self, key: String, rows: i64) {
        *self.calls.entry(key).or_insert(0) += 1;
        self.rows.push(rows);
    }
}

/// The inbox handler on PostgreSQL: the same statements as the embedded one's closure.
struct PgHandler {
    seen: Arc<Mutex<InboxSeen>>,
    key_header: String,
    create: String,
    count: String,
    insert: String,
}

#[async_trait::async_trait]
impl onceflow::postgres::InboxHandler for PgHandler {
    async fn handle(
        &self,
        tx: &mut onceflow::postgres::tokio_postgres::Transaction<'_>,
        m: &Message,
    ) -> std::result::Result<(), onceflow::BoxError> {
        let k = m
            .headers
            .get_str(&self.key_header)
            .unwrap_or("")
            .to_string();
        tx.execute(self.create.as_str(), &[]).await?;
        let rows: i64 = tx.query_one(self.count.as_str(), &[]).await?.get(0);
        let payload = String::from_utf8_lossy(&m.payload).to_string();
        tx.execute(self.insert.as_str(), &[&k, &payload]).await?;
        self.seen.lock().unwrap().record(k, rows);
        Ok(())
    }
}

/// The trace id a handler call ran in, and the `traceparent` its message carried.
type HandlerTrace = (String, Option<String>);

type StepFuture<'b> = Pin<Box<dyn Future<Output = Res> + Send + 'b>>;

impl Cell<'_> {
    fn topic(&self, step: &Value, field: &str) -> String {
        self.topics[str_of(step, field)].clone()
    }

    async fn store_of(&self, step: &Value) -> Res<Arc<dyn onceflow::DedupStore>> {
        let name = match str_of(step, "store") {
            "$store" => self
                .store
                .expect("spec: $store in a scenario without stores"),
            other => other,
        };
        let url = store_url(self.spec, name, self.tmp).map_err(|e| Fail::Check(e.0))?;
        Ok(onceflow::dedup_store(&url, Duration::from_secs(3600)).await?)
    }

    async fn run(&mut self) -> Res {
        let steps = self.scenario["steps"].as_array().expect("spec: steps");
        for (i, raw) in steps.iter().enumerate() {
            // A platform's documented difference replaces fields of the step ("why" says why).
            let mut step = raw.clone();
            if let Some(o) = raw["overrides"][self.platform].as_object() {
                for (k, v) in o.iter().filter(|(k, _)| k.as_str() != "why") {
                    step[k.as_str()] = v.clone();
                }
            }
            let step = &step;
            let op = str_of(step, "op");
            let unsupported = &step["unsupported"][self.platform];
            let r = self.step(op, step).await;
            match (r, unsupported.is_null()) {
                (Ok(()), true) => {}
                (Ok(()), false) => {
                    return fail(format!(
                        "step {i} ({op}) succeeded on {}, where the spec documents a {} error: {}",
                        self.platform, unsupported["kind"], unsupported["reason"]
                    ))
                }
                (Err(Fail::Onceflow(e)), false)
                    if e.kind().code()
                        == format!("ONCEFLOW_{}", str_of(unsupported, "kind").to_uppercase()) =>
                {
                    // Documented: the rest of the scenario cannot run on this platform.
                    return Ok(());
                }
                (Err(e), _) => return fail(format!("step {i} ({op}): {e}")),
            }
        }
        Ok(())
    }

    fn step<'b>(&'b mut self, op: &'b str, step: &'b Value) -> StepFuture<'b> {
        Box::pin(async move {
            match op {
                "topic" => self.op_topic(step).await,
                "produce" => self.op_produce(step).await,
                "sleep" => {
                    tokio::time::sleep(Duration::from_millis(step["ms"].as_u64().unwrap())).await;
                    Ok(())
                }
                "mark_time" => {
                    self.vars
                        .insert(str_of(step, "as").to_string(), now_ms().to_string());
                    Ok(())
                }
                "consume" => self.op_consume(step).await,
                "transaction" => self.op_transaction(step).await,
                "atomic_batch" => self.op_atomic_batch(step).await,
                "inbox" => self.op_inbox(step).await,
                "idempotent" => self.op_idempotent(step).await,
                "pipeline" => self.op_pipeline(step).await,
                "lag" => self.op_lag(step).await,
                other => panic!("spec: unknown op '{other}'"),
            }
        })
    }

    async fn op_topic(&mut self, step: &Value) -> Res {
        let name = unique("rs-scn");
        let partitions = step["partitions"].as_u64().unwrap_or(1) as u32;
        let admin = self.client.admin().await?;
        admin
            .create_topic(&TopicSpec::new(name.clone(), partitions))
            .await?;
        self.topics.insert(str_of(step, "as").to_string(), name);
        Ok(())
    }

    async fn op_produce(&mut self, step: &Value) -> Res {
        let producer = self.client.producer(ProducerConfig::new()).await?;
        let topic = self.topic(step, "topic");
        let cx = match step["traceparent"].as_str() {
            Some(tp) => {
                let mut h = Headers::new();
                h.insert("traceparent", tp.to_string());
                let parent = onceflow::trace::extract(&h);
                let span = global::tracer("onceflow-scenarios")
                    .start_with_context("scenario produce", &parent);
                parent.with_span(span)
            }
            None => Context::new(),
        };
        let mut duplicates = Vec::new();
        let mut attempts = Vec::new();
        for r in step["records"].as_array().expect("spec: records") {
            let mut record = Record::new(topic.clone(), value(&r["payload"]).unwrap_or_default());
            record.key = value(&r["key"]);
            for (n, v) in spec_headers(r) {
                match v {
                    Some(v) => record.headers.insert(n, v),
                    None => record.headers.insert_null(n),
                };
            }
            if let Some(k) = r["idempotency_key"].as_str() {
                record = record.idempotency_key(k);
            }
            let d = producer.send(record).with_context(cx.clone()).await?;
            duplicates.push(d.duplicate);
            attempts.push(u64::from(d.attempts));
        }
        cx.span().end();
        producer.flush(Duration::from_secs(30)).await?;
        producer.close().await?;
        if let Some(want) = step["expect_attempts"].as_array() {
            let want: Vec<u64> = want.iter().map(|n| n.as_u64().unwrap()).collect();
            ensure(attempts == want, || {
                format!("Delivery::attempts {attempts:?}, expected {want:?}")
            })?;
        }
        if let Some(want) = step["expect_duplicate"].as_array() {
            let want: Vec<bool> = want.iter().map(|b| b.as_bool().unwrap()).collect();
            ensure(duplicates == want, || {
                format!("Delivery::duplicate {duplicates:?}, expected {want:?}")
            })?;
        }
        Ok(())
    }

    async fn op_transaction(&mut self, step: &Value) -> Res {
        let producer = self
            .client
            .producer(ProducerConfig::new().transactional_id(unique("rs-scn-tx")))
            .await?;
        let topic = self.topic(step, "topic");
        let result = async {
            for (records, commit) in [(&step["commit"], true), (&step["abort"], false)] {
                let mut tx = producer.begin().await?;
                for r in records.as_array().expect("spec: records") {
                    tx.send(Record::new(
                        topic.clone(),
                        value(&r["payload"]).unwrap_or_default(),
                    ))
                    .await?;
                }
                if commit {
                    tx.commit().await?;
                } else {
                    tx.abort().await?;
                }
            }
            Ok::<(), Error>(())
        }
        .await;
        producer.close().await?;
        Ok(result?)
    }

    async fn op_atomic_batch(&mut self, step: &Value) -> Res {
        let producer = self.client.producer(ProducerConfig::new()).await?;
        let topic = self.topic(step, "topic");
        let records: Vec<Record> = step["records"]
            .as_array()
            .expect("spec: records")
            .iter()
            .map(|r| Record::new(topic.clone(), value(&r["payload"]).unwrap_or_default()))
            .collect();
        let n = records.len();
        let result = producer.send_atomic(records).await;
        producer.close().await?;
        let deliveries = result?;
        ensure(deliveries.len() == n, || {
            format!("{} deliveries for {n} records", deliveries.len())
        })
    }

    /// The inbox's SQL for this cell's store, its table named uniquely: (create, count, insert).
    fn inbox_sql(&self, step: &Value, table: &str) -> (String, String, String) {
        let store = self.store.expect("spec: the inbox scenario runs per store");
        let sql = &step["sql"];
        let get = |v: &Value| {
            v.as_str()
                .or(v[store].as_str())
                .unwrap_or_else(|| panic!("spec: no SQL for store {store}: {v}"))
                .replace("{table}", table)
        };
        (get(&sql["create"]), get(&sql["count"]), get(&sql["insert"]))
    }

    async fn op_inbox(&mut self, step: &Value) -> Res {
        let consumer = self
            .client
            .consumer(
                ConsumerConfig::new(unique("rs-scn-g"), [self.topic(step, "topic")])
                    .start(StartFrom::Earliest),
            )
            .await?;
        let table = unique("scn_inbox").replace('-', "_");
        let (create, count, insert) = self.inbox_sql(step, &table);
        // Each cell its own namespace: keys are the inbox's per namespace, not per group, and
        // the PostgreSQL database is shared by every cell and run.
        let mut config = onceflow::inbox::InboxConfig {
            poll_timeout: Duration::from_millis(50),
            namespace: Some(unique("scn-ns")),
            ..Default::default()
        };
        if let Some(h) = step["key_header"].as_str() {
            config.key = KeyStrategy::Header(h.to_string());
        }
        let key_header = step["key_header"]
            .as_str()
            .unwrap_or("idempotency-key")
            .to_string();
        let seen: Arc<Mutex<InboxSeen>> = Arc::default();
        let window = Duration::from_secs(3600);
        let expect_calls: BTreeMap<String, u64> = step["expect_calls"]
            .as_object()
            .expect("spec: expect_calls")
            .iter()
            .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
            .collect();
        let want: Vec<(String, u64)> = step["expect_summary"]
            .as_object()
            .expect("spec: expect_summary")
            .iter()
            .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
            .collect();
        let field = |s: &onceflow::inbox::InboxSummary, k: &str| match k {
            "handled" => s.handled,
            "duplicates" => s.duplicates,
            "behind_position" => s.behind_position,
            other => panic!("spec: unknown inbox summary field '{other}'"),
        };
        let deadline = Instant::now() + WAIT;
        let summary = match self.store {
            Some("embedded") => {
                let path =
                    store_url(self.spec, "embedded", self.tmp).map_err(|e| Fail::Check(e.0))?;
                let store = onceflow::dedup::EmbeddedStore::open(&path, window).await?;
                let mut inbox = store.inbox(consumer.clone(), config).await?;
                let handler = {
                    let seen = seen.clone();
                    Arc::new(
                        move |tx: &mut onceflow::rusqlite::Transaction<'_>,
                              m: &Message|
                              -> std::result::Result<(), onceflow::BoxError> {
                            let k = m.headers.get_str(&key_header).unwrap_or("").to_string();
                            tx.execute(&create, [])?;
                            let rows: i64 = tx.query_row(&count, [], |r| r.get(0))?;
                            let payload = String::from_utf8_lossy(&m.payload).to_string();
                            tx.execute(&insert, onceflow::rusqlite::params![k, payload])?;
                            seen.lock().unwrap().record(k, rows);
                            Ok(())
                        },
                    )
                };
                loop {
                    inbox.step(&handler).await?;
                    let s = inbox.summary();
                    if want.iter().all(|(k, v)| field(s, k) >= *v) || Instant::now() > deadline {
                        break s.clone();
                    }
                }
            }
            Some("postgres") => {
                let url =
                    store_url(self.spec, "postgres", self.tmp).map_err(|e| Fail::Check(e.0))?;
                let store = onceflow::postgres::PostgresStore::open(&url, window).await?;
                let mut inbox = store.inbox(consumer.clone(), config);
                let handler = PgHandler {
                    seen: seen.clone(),
                    key_header,
                    create,
                    count,
                    insert,
                };
                loop {
                    inbox.step(&handler).await?;
                    let s = inbox.summary();
                    if want.iter().all(|(k, v)| field(s, k) >= *v) || Instant::now() > deadline {
                        break s.clone();
                    }
                }
            }
            other => panic!("spec: the inbox runs on embedded or postgres, not {other:?}"),
        };
        consumer.close().await?;
        for (k, v) in &want {
            let got = field(&summary, k);
            ensure(got == *v, || {
                format!("inbox summary {k} = {got}, expected {v} ({summary:?})")
            })?;
        }
        let seen = seen.lock().unwrap().clone();
        ensure(seen.calls == expect_calls, || {
            format!("handler calls {:?}, expected {expect_calls:?}", seen.calls)
        })?;
        let rows_want: Vec<i64> = step["expect_rows_seen"]
            .as_array()
            .expect("spec: expect_rows_seen")
            .iter()
            .map(|n| n.as_i64().unwrap())
            .collect();
        ensure(seen.rows == rows_want, || {
            format!(
                "rows seen by each handler call {:?}, expected {rows_want:?}",
                seen.rows
            )
        })
    }

    async fn op_consume(&mut self, step: &Value) -> Res {
        let mut start = step["start"].as_str().unwrap_or("earliest").to_string();
        for (k, v) in &self.vars {
            start = start.replace(&format!("${k}"), v);
        }
        let start: StartFrom = start.parse()?;
        let consumer = self
            .client
            .consumer(
                ConsumerConfig::new(unique("rs-scn-g"), [self.topic(step, "topic")]).start(start),
            )
            .await?;
        let want = step["expect"]
            .as_array()
            .or(step["expect_payloads"].as_array())
            .expect("spec: expect or expect_payloads")
            .len();
        let quiet_ms = step["quiet_ms"].as_u64().unwrap_or(0);
        // Without a seek to follow, `quiet_ms` more after the last expected record: nothing more.
        let seek = step["seek"].as_str();
        let got = read(&consumer, want, if seek.is_some() { 0 } else { quiet_ms }).await?;
        if let Some(expect) = step["expect"].as_array() {
            let show =
                |key: &Option<Bytes>, payload: &Option<Bytes>, hs: Vec<(String, Option<Bytes>)>| {
                    let hs: Vec<String> = hs
                        .iter()
                        .map(|(n, v)| format!("{n}={}", shown(v)))
                        .collect();
                    format!(
                        "key {} payload {} headers [{}]",
                        shown(key),
                        shown(payload),
                        hs.join(", ")
                    )
                };
            let actual: Vec<String> = got
                .iter()
                .map(|m| {
                    let hs = m
                        .headers
                        .iter()
                        .filter(|h| !TRACE_HEADERS.contains(&h.name.to_ascii_lowercase().as_str()))
                        .map(|h| (h.name.clone(), h.value.clone()))
                        .collect();
                    show(&m.key, &Some(m.payload.clone()), hs)
                })
                .collect();
            let expected: Vec<String> = expect
                .iter()
                .map(|r| show(&value(&r["key"]), &value(&r["payload"]), spec_headers(r)))
                .collect();
            ensure(actual == expected, || {
                format!("records read back:\n  {actual:#?}\nexpected:\n  {expected:#?}")
            })?;
        } else {
            check_payloads(&got, &step["expect_payloads"], "read")?;
        }
        if let Some(to) = seek {
            let mut to = to.to_string();
            for (k, v) in &self.vars {
                to = to.replace(&format!("${k}"), v);
            }
            let at: StartFrom = to.parse()?;
            let assignment = consumer.assignment();
            ensure(!assignment.is_empty(), || {
                "no partition assigned after reading".into()
            })?;
            for tp in &assignment {
                consumer.seek(tp, &at).await?;
            }
            let after = &step["expect_after_seek"];
            let again = read(&consumer, after.as_array().unwrap().len(), quiet_ms).await?;
            check_payloads(&again, after, &format!("read after seek to {to}"))?;
        }
        consumer.close().await?;
        Ok(())
    }

    async fn op_idempotent(&mut self, step: &Value) -> Res {
        let consumer = self
            .client
            .consumer(
                ConsumerConfig::new(unique("rs-scn-g"), [self.topic(step, "topic")])
                    .start(StartFrom::Earliest),
            )
            .await?;
        let store = self.store_of(step).await?;
        let key_header = step["key_header"]
            .as_str()
            .unwrap_or("idempotency-key")
            .to_string();
        let fail_first: Vec<String> = step["fail_first"]
            .as_array()
            .map(|a| a.iter().map(|k| k.as_str().unwrap().to_string()).collect())
            .unwrap_or_default();
        let calls: Arc<Mutex<BTreeMap<String, u64>>> = Arc::default();
        let delivery_counts: Arc<Mutex<BTreeMap<String, Vec<u64>>>> = Arc::default();
        let traces: Arc<Mutex<Vec<HandlerTrace>>> = Arc::default();
        let handler = {
            let (calls, traces, key_header) = (calls.clone(), traces.clone(), key_header.clone());
            let delivery_counts = delivery_counts.clone();
            handler_fn(move |m: Message| {
                let delivery_counts = delivery_counts.clone();
                let (calls, traces, key_header, fail_first) = (
                    calls.clone(),
                    traces.clone(),
                    key_header.clone(),
                    fail_first.clone(),
                );
                async move {
                    let k = m.headers.get_str(&key_header).unwrap_or("").to_string();
                    let n = {
                        let mut c = calls.lock().unwrap();
                        let n = c.entry(k.clone()).or_insert(0);
                        *n += 1;
                        *n
                    };
                    delivery_counts
                        .lock()
                        .unwrap()
                        .entry(k.clone())
                        .or_default()
                        .push(u64::from(m.delivery_count));
                    let cx = Context::current();
                    traces.lock().unwrap().push((
                        cx.span().span_context().trace_id().to_string(),
                        m.headers.get_str("traceparent").map(str::to_string),
                    ));
                    if n == 1 && fail_first.contains(&k) {
                        return Err(format!("scenario: the first delivery of {k} fails").into());
                    }
                    Ok(None)
                }
            })
        };
        let engine = IdempotentConsumer::with_config(
            consumer,
            Some(store),
            Arc::new(handler),
            engine_config(step),
            None,
        )?;
        let metrics = engine.metrics();
        let stop = Arc::new(tokio::sync::Notify::new());
        let run = tokio::spawn({
            let stop = stop.clone();
            engine.run_until(async move { stop.notified().await })
        });
        let expect_calls: BTreeMap<String, u64> = step["expect_calls"]
            .as_object()
            .expect("spec: expect_calls")
            .iter()
            .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
            .collect();
        let expect_metrics: Vec<(String, u64)> = step["expect_metrics"]
            .as_object()
            .expect("spec: expect_metrics")
            .iter()
            .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
            .collect();
        let waited = wait_until(
            &format!("handler calls {expect_calls:?} and metrics {expect_metrics:?}"),
            || {
                let m = metrics.snapshot();
                run.is_finished()
                    || (*calls.lock().unwrap() == expect_calls
                        && expect_metrics.iter().all(|(k, v)| metric(&m, k) >= *v))
            },
        )
        .await;
        stop.notify_one();
        let summary = run
            .await
            .map_err(|e| Fail::Check(format!("the engine task panicked: {e}")))??;
        waited?;
        let calls = calls.lock().unwrap().clone();
        ensure(calls == expect_calls, || {
            format!("handler calls {calls:?}, expected {expect_calls:?}")
        })?;
        for (k, v) in &expect_metrics {
            let got = metric(&summary.metrics, k);
            ensure(got == *v, || {
                format!(
                    "metric {k} = {got}, expected {v} (all: {:?})",
                    summary.metrics
                )
            })?;
        }
        if let Some(want) = step["expect_delivery_counts"].as_object() {
            let counts = delivery_counts.lock().unwrap().clone();
            for (k, v) in want {
                let want: Vec<u64> = v
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|n| n.as_u64().unwrap())
                    .collect();
                let got = counts.get(k).cloned().unwrap_or_default();
                ensure(got == want, || {
                    format!("delivery_count of {k} per handler call {got:?}, expected {want:?}")
                })?;
            }
        }
        if let Some(want) = step["expect_trace"].as_object() {
            let trace_id = want["trace_id"].as_str().unwrap();
            let not_span = want["not_span_id"].as_str().unwrap();
            let traces = traces.lock().unwrap().clone();
            ensure(!traces.is_empty(), || "the handler never ran".into())?;
            for (t, tp) in traces {
                ensure(t == trace_id, || {
                    format!("the handler ran in trace {t}, expected {trace_id}")
                })?;
                let tp =
                    tp.ok_or_else(|| Fail::Check("the message carries no traceparent".into()))?;
                let parts: Vec<&str> = tp.split('-').collect();
                ensure(parts.len() == 4 && parts[1] == trace_id, || {
                    format!("traceparent {tp}: another trace")
                })?;
                ensure(parts[2] != not_span, || {
                    format!("traceparent {tp} names the given span, not the producer's")
                })?;
            }
        }
        Ok(())
    }

    async fn op_pipeline(&mut self, step: &Value) -> Res {
        let tx = step["transactional_producer"]
            .as_array()
            .is_some_and(|a| a.iter().any(|p| p.as_str() == Some(self.platform)));
        let mut pc = ProducerConfig::new();
        if tx {
            pc = pc.transactional_id(unique("rs-scn-tx"));
        }
        let producer = self.client.producer(pc).await?;
        let consumer = self
            .client
            .consumer(
                ConsumerConfig::new(unique("rs-scn-g"), [self.topic(step, "in")])
                    .start(StartFrom::Earliest),
            )
            .await?;
        let store = self.store_of(step).await?;
        let out = self.topic(step, "out");
        let suffix = value(&step["suffix"]).unwrap_or_default();
        let transform = move |m: &Message| -> std::result::Result<Vec<Record>, onceflow::BoxError> {
            let mut payload = m.payload.to_vec();
            payload.extend_from_slice(&suffix);
            Ok(vec![Record::new(out.clone(), payload)])
        };
        let config = PipelineConfig {
            engine: EngineConfig {
                poll_timeout: Duration::from_millis(50),
                ..EngineConfig::default()
            },
            ..PipelineConfig::default()
        };
        let pipeline = Pipeline::with_config(
            consumer,
            producer.clone(),
            Some(store),
            Arc::new(transform),
            config,
        )?;
        let guarantee = pipeline.guarantee().to_string();
        let metrics = pipeline.metrics();
        let stop = Arc::new(tokio::sync::Notify::new());
        let run = tokio::spawn({
            let stop = stop.clone();
            pipeline.run_until(async move { stop.notified().await })
        });
        let want = step["expect_processed"].as_u64().unwrap();
        let waited = wait_until(&format!("{want} inputs processed"), || {
            run.is_finished() || metrics.snapshot().processed >= want
        })
        .await;
        stop.notify_one();
        let summary = run
            .await
            .map_err(|e| Fail::Check(format!("the pipeline task panicked: {e}")))??;
        waited?;
        producer.close().await?;
        ensure(summary.metrics.processed == want, || {
            format!("processed {:?}", summary.metrics)
        })?;
        let expected = str_of(&step["expect_guarantee"], self.platform);
        ensure(guarantee == expected, || {
            format!("Pipeline::guarantee() {guarantee}, expected {expected}")
        })?;
        let ran = summary.guarantee.to_string();
        ensure(ran == expected, || {
            format!("the run's guarantee {ran}, expected {expected}")
        })
    }

    async fn op_lag(&mut self, step: &Value) -> Res {
        let consumer = self
            .client
            .consumer(
                ConsumerConfig::new(unique("rs-scn-g"), [self.topic(step, "topic")])
                    .start(StartFrom::Earliest),
            )
            .await?;
        let read_n = step["read"].as_u64().unwrap() as usize;
        let mut taken: Vec<Message> = Vec::new();
        let deadline = Instant::now() + WAIT;
        while taken.len() < read_n {
            ensure(Instant::now() < deadline, || {
                format!("read {} of {read_n}", taken.len())
            })?;
            taken.extend(
                consumer
                    .poll(read_n - taken.len(), Duration::from_millis(200))
                    .await?,
            );
        }
        consumer
            .commit_message(taken.last().expect("read at least one"))
            .await?;
        let want = step["expect_messages"].as_u64().unwrap();
        let deadline = Instant::now() + WAIT;
        let mut previous = None;
        loop {
            // The same figure twice in a row, 300 ms apart: not one seen while a commit lands.
            let lags = consumer.lag().await?;
            let total: u64 = lags.iter().map(|l| l.messages).sum();
            if total == want && previous == Some(want) {
                break;
            }
            previous = Some(total);
            ensure(Instant::now() < deadline, || {
                format!("lag {total} messages ({lags:?}), expected {want}")
            })?;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let assignment = consumer.assignment();
        let committed = consumer.committed(&assignment).await?;
        ensure(
            committed.len() == assignment.len() && committed.iter().all(|c| c.next.is_some()),
            || {
                format!("committed({assignment:?}) = {committed:?}: a next position for every partition expected")
            },
        )?;
        consumer.close().await?;
        if let Some(want) = step.get("expect_resume") {
            let member = self
                .client
                .consumer(
                    ConsumerConfig::new(consumer.group(), [self.topic(step, "topic")])
                        .start(StartFrom::committed_or_earliest()),
                )
                .await?;
            let first = read(&member, 1, 0).await?;
            member.close().await?;
            let got = first.first().map(|m| shown(&Some(m.payload.clone())));
            let want = shown(&value(want));
            ensure(got.as_deref() == Some(want.as_str()), || {
                format!("a new member of the group read {got:?} first, expected {want}")
            })?;
        }
        Ok(())
    }
}

enum Outcome {
    Pass,
    Fail(String),
    Skip(String),
}

async fn run_cell(
    spec: &Value,
    scenario: &Value,
    store: Option<&str>,
    platform: &str,
    tmp: &Path,
) -> Outcome {
    let require = std::env::var("ONCEFLOW_REQUIRE_BROKERS").as_deref() == Ok("1");
    let missing = |e: MissingEnv| {
        if require {
            Outcome::Fail(format!("{} and ONCEFLOW_REQUIRE_BROKERS=1", e.0))
        } else {
            Outcome::Skip(e.0)
        }
    };
    let url = match platform_url(spec, platform) {
        Ok(u) => u,
        Err(e) => return missing(e),
    };
    if let Some(s) = store {
        if let Err(e) = store_url(spec, s, tmp) {
            return missing(e);
        }
    }
    let client = match onceflow::connect(&url).await {
        Ok(c) => c,
        Err(e) => return Outcome::Fail(format!("connect: {e}")),
    };
    let mut cell = Cell {
        spec,
        scenario,
        store,
        platform,
        client,
        tmp,
        topics: BTreeMap::new(),
        vars: BTreeMap::new(),
    };
    match tokio::time::timeout(CELL_TIMEOUT, cell.run()).await {
        Ok(Ok(())) => Outcome::Pass,
        Ok(Err(e)) => Outcome::Fail(e.to_string()),
        Err(_) => Outcome::Fail(format!("the cell took longer than {CELL_TIMEOUT:?}")),
    }
}

fn spec_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/scenarios.json")
}

fn out_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"),
    }
    .join("scenarios")
}

fn main() -> ExitCode {
    // `cargo test -- --list` and filters: this binary has one job, the whole table.
    if std::env::args().any(|a| a == "--list") {
        println!("scenarios: test");
        return ExitCode::SUCCESS;
    }
    global::set_tracer_provider(SdkTracerProvider::builder().build());
    let spec: Value = serde_json::from_str(
        &std::fs::read_to_string(spec_path()).expect("tests/scenarios/scenarios.json"),
    )
    .expect("scenarios.json is JSON");
    let tmp = tempfile::tempdir().expect("a temporary directory");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let spec = Arc::new(spec);
    let tmp_path: Arc<PathBuf> = Arc::new(tmp.path().to_path_buf());
    let results = runtime.block_on(async {
        let gate = Arc::new(Semaphore::new(PARALLEL));
        let mut tasks = Vec::new();
        for (si, scenario) in spec["scenarios"]
            .as_array()
            .expect("spec: scenarios")
            .iter()
            .enumerate()
        {
            let stores: Vec<Option<String>> = match scenario["stores"].as_array() {
                Some(a) => a
                    .iter()
                    .map(|s| Some(s.as_str().unwrap().to_string()))
                    .collect(),
                None => vec![None],
            };
            for store in stores {
                let name = match &store {
                    Some(s) => format!("{}[{s}]", str_of(scenario, "name")),
                    None => str_of(scenario, "name").to_string(),
                };
                for platform in spec["platforms"].as_object().unwrap().keys() {
                    let (spec, tmp, gate, name, store, platform) = (
                        spec.clone(),
                        tmp_path.clone(),
                        gate.clone(),
                        name.clone(),
                        store.clone(),
                        platform.clone(),
                    );
                    tasks.push(tokio::spawn(async move {
                        let _permit = gate.acquire().await.expect("semaphore open");
                        let t0 = Instant::now();
                        let scenario = &spec["scenarios"][si];
                        let outcome =
                            run_cell(&spec, scenario, store.as_deref(), &platform, &tmp).await;
                        let status = match &outcome {
                            Outcome::Pass => "PASS",
                            Outcome::Fail(_) => "FAIL",
                            Outcome::Skip(_) => "SKIP",
                        };
                        println!(
                            "SCENARIO {name} {LANGUAGE} {platform} {status} ({:.1}s)",
                            t0.elapsed().as_secs_f64()
                        );
                        (name, platform, outcome)
                    }));
                }
            }
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.expect("a cell task panicked"));
        }
        out
    });
    let mut lines = Vec::new();
    let mut failed = 0;
    for (name, platform, outcome) in &results {
        match outcome {
            Outcome::Pass => lines.push(format!("SCENARIO {name} {LANGUAGE} {platform} PASS")),
            Outcome::Fail(why) => {
                failed += 1;
                lines.push(format!("SCENARIO {name} {LANGUAGE} {platform} FAIL"));
                eprintln!("---- SCENARIO {name} {LANGUAGE} {platform} FAIL:\n{why}\n");
            }
            Outcome::Skip(why) => {
                eprintln!("SCENARIO {name} {LANGUAGE} {platform} skipped: {why}")
            }
        }
    }
    lines.sort();
    let dir = out_dir();
    std::fs::create_dir_all(&dir).expect("the scenarios output directory");
    std::fs::write(
        dir.join(format!("{LANGUAGE}.txt")),
        lines.iter().map(|l| format!("{l}\n")).collect::<String>(),
    )
    .expect("the scenarios output file");
    println!(
        "scenarios ({LANGUAGE}): {} cells, {} passed, {failed} failed",
        results.len(),
        results
            .iter()
            .filter(|r| matches!(r.2, Outcome::Pass))
            .count()
    );
    if failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
