//! Shared pieces of the interop tests, which run another client of the same platform (nats-py,
//! pulsar-client, boto3) from a cached Python venv against the real broker: the venv's
//! interpreter, running a script under `tests/interop/`, and an idempotent consumer that records
//! the trace each handler ran in.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use onceflow_core::dedup::MemoryStore;
use onceflow_core::{handler_fn, Consumer, EngineConfig, IdempotentConsumer, Message};
use opentelemetry::trace::TraceContextExt;

use crate::harness::broker_url;

/// The broker URL in `var`, or `None` after printing why `suite`'s `test` skipped (see
/// [`broker_url`]: with `ONCEFLOW_REQUIRE_BROKERS=1` a missing URL fails instead).
pub fn url_or_skip(var: &str, service: &str, suite: &str, test: &str) -> Option<String> {
    match broker_url(var, service) {
        Ok(u) => Some(u),
        Err(reason) => {
            eprintln!("{suite}: SKIPPED {test}: {reason}");
            None
        }
    }
}

/// `prefix-<16 random hex digits>`: a topic, stream or group no earlier run used.
pub fn unique_name(prefix: &str) -> String {
    format!("{prefix}-{:016x}", rand::random::<u64>())
}

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The interpreter of the venv that `tests/interop/<env_script>` creates on first use (it
/// prints `PYTHON=<path>`); one call per script and process.
pub fn python(env_script: &str) -> String {
    static PYTHONS: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    let mut known = PYTHONS.get_or_init(Default::default).lock().unwrap();
    known
        .entry(env_script.to_string())
        .or_insert_with(|| {
            let out = Command::new("bash")
                .arg(repo().join("tests/interop").join(env_script))
                .stderr(Stdio::inherit())
                .output()
                .unwrap_or_else(|e| panic!("run tests/interop/{env_script}: {e}"));
            assert!(out.status.success(), "{env_script} failed: {}", out.status);
            String::from_utf8(out.stdout)
                .unwrap()
                .lines()
                .find_map(|l| l.strip_prefix("PYTHON=").map(String::from))
                .expect("PYTHON= line")
        })
        .clone()
}

/// Runs `tests/interop/<script> args…` with the venv of `env_script`; its stdout. Panics when
/// the script fails (its stderr is passed through).
pub fn run_py(env_script: &str, script: &str, args: &[&str]) -> String {
    let out = Command::new(python(env_script))
        .arg(repo().join("tests/interop").join(script))
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("run {script}: {e}"));
    assert!(
        out.status.success(),
        "{script} {args:?} failed: {}",
        out.status
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs an idempotent consumer (memory dedup store, default engine) on `consumer` until its
/// handler has seen `n` messages or 30 s passed; each message with the trace id (32 hex digits)
/// of the span its handler ran in.
pub async fn handle_in_trace(consumer: Consumer, n: usize) -> Vec<(String, Message)> {
    type Seen = Arc<Mutex<Vec<(String, Message)>>>;
    let seen: Seen = Arc::default();
    let record = seen.clone();
    let handler = handler_fn(move |m: Message| {
        let seen = record.clone();
        async move {
            let trace_id = opentelemetry::Context::current()
                .span()
                .span_context()
                .trace_id()
                .to_string();
            seen.lock().unwrap().push((trace_id, m));
            Ok(None)
        }
    });
    let engine = IdempotentConsumer::with_config(
        consumer,
        Some(Arc::new(MemoryStore::new(Duration::from_secs(600), 1000))),
        Arc::new(handler),
        EngineConfig::default(),
        None,
    )
    .unwrap();
    let watched = seen.clone();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    engine
        .run_until(async move {
            while watched.lock().unwrap().len() < n && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .unwrap();
    let seen = seen.lock().unwrap().clone();
    seen
}
