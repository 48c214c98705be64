//! The engine from Python: `IdempotentConsumer` and `Pipeline`, with Python callables as the
//! [`Handler`] and the [`Transform`]. A callable is called (with the GIL) for each message and
//! must return an awaitable; the awaitable runs on the asyncio loop that called `run()`, and
//! the engine awaits it from the tokio runtime without holding the GIL.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use onceflow::{
    BoxError, EngineConfig, Error, ErrorKind, Handler, MetricsSnapshot, Record, RunSummary,
    Transform, TransformOutput,
};
use onceflow_bindings::settings::{self, Language, OwnNames, Value};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyString, PyTuple};
use pyo3_async_runtimes::TaskLocals;

use crate::client::{Consumer, DedupStore, Producer};
use crate::convert::{self, Lag, Message, MessageBatch};
use crate::errors::py_box;
use crate::{awaitable, current_locals};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<IdempotentConsumer>()?;
    m.add_class::<Pipeline>()?;
    Ok(())
}

/// The asyncio loop (and contextvars) Python callables run on: set by `run()` / `step()`.
type Locals = Arc<Mutex<Option<TaskLocals>>>;

fn locals_of(l: &Locals) -> Result<TaskLocals, BoxError> {
    l.lock()
        .clone()
        .ok_or_else(|| "no asyncio loop: call run() or step() from a coroutine".into())
}

/// Calls `func(message)` and awaits the awaitable it returns on the loop in `locals`.
async fn call(
    func: &Py<PyAny>,
    locals: &Locals,
    message: &onceflow::Message,
) -> Result<Py<PyAny>, BoxError> {
    let locals = locals_of(locals)?;
    let fut = Python::attach(|py| {
        let msg = Message::single(message.clone());
        let aw = func.bind(py).call1((msg,))?;
        pyo3_async_runtimes::into_future_with_locals(&locals, aw)
    })
    .map_err(py_box)?;
    fut.await.map_err(py_box)
}

/// Calls `func(batch)` with the run of messages as a `MessageBatch` and awaits the awaitable it
/// returns on the loop in `locals`: one boundary crossing for the whole run of messages.
async fn call_batch(
    func: &Py<PyAny>,
    locals: &Locals,
    messages: &[onceflow::Message],
) -> Result<Py<PyAny>, BoxError> {
    let locals = locals_of(locals)?;
    let fut = Python::attach(|py| {
        let batch = MessageBatch::new(messages.to_vec());
        let aw = func.bind(py).call1((batch,))?;
        pyo3_async_runtimes::into_future_with_locals(&locals, aw)
    })
    .map_err(py_box)?;
    fut.await.map_err(py_box)
}

/// A handler's return value: `None` or bytes.
fn handler_result(out: &Bound<'_, PyAny>) -> Result<Option<Bytes>, BoxError> {
    if out.is_none() {
        Ok(None)
    } else if let Ok(b) = out.cast::<PyBytes>() {
        Ok(Some(Bytes::copy_from_slice(b.as_bytes())))
    } else {
        Err(format!(
            "handler returned {}: expected None or bytes",
            out.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        )
        .into())
    }
}

/// A batch handler's return value: `None` (no result for any message) or one `None`/bytes per
/// message, in order.
fn batch_results(out: &Bound<'_, PyAny>, n: usize) -> Result<Vec<Option<Bytes>>, BoxError> {
    if out.is_none() {
        return Ok(vec![None; n]);
    }
    let items = out.try_iter().map_err(|_| {
        format!(
            "batch handler returned {}: expected None or a list with one None/bytes per message",
            out.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        )
    })?;
    items.map(|i| handler_result(&i.map_err(py_box)?)).collect()
}

struct PyHandler {
    func: Py<PyAny>,
    locals: Locals,
    /// `func` takes a list of messages (see [`Handler::handle_batch`]).
    batch: bool,
}

#[async_trait]
impl Handler for PyHandler {
    async fn handle(&self, message: &onceflow::Message) -> Result<Option<Bytes>, BoxError> {
        if self.batch {
            let mut out = self.handle_batch(std::slice::from_ref(message)).await?;
            return Ok(out.pop().flatten());
        }
        let out = call(&self.func, &self.locals, message).await?;
        Python::attach(|py| handler_result(out.bind(py)))
    }

    fn batched(&self) -> bool {
        self.batch
    }

    async fn handle_batch(
        &self,
        messages: &[onceflow::Message],
    ) -> Result<Vec<Option<Bytes>>, BoxError> {
        if !self.batch {
            let mut out = Vec::with_capacity(messages.len());
            for m in messages {
                out.push(self.handle(m).await?);
            }
            return Ok(out);
        }
        let out = call_batch(&self.func, &self.locals, messages).await?;
        Python::attach(|py| batch_results(out.bind(py), messages.len()))
    }
}

struct PyTransform {
    func: Py<PyAny>,
    locals: Locals,
}

/// The parent context named by `(name, value)` trace headers (Python's process span), if valid.
fn parent_of(trace: &Bound<'_, PyAny>) -> PyResult<Option<onceflow::trace::Context>> {
    if trace.is_none() {
        return Ok(None);
    }
    let mut headers = onceflow::Headers::new();
    for (name, value) in trace.extract::<Vec<(String, Vec<u8>)>>()? {
        headers.insert(name, value);
    }
    Ok(onceflow::trace::extract_parent(&headers))
}

#[async_trait]
impl Transform for PyTransform {
    async fn transform(&self, message: &onceflow::Message) -> Result<Vec<Record>, BoxError> {
        Ok(self.transform_traced(message).await?.records)
    }

    /// The callable returns `None` or records, or `(records or None, trace headers or None)`:
    /// the second item, the W3C headers of the Python `process` span the transform ran in, is
    /// the parent the outputs are sent as children of.
    async fn transform_traced(
        &self,
        message: &onceflow::Message,
    ) -> Result<TransformOutput, BoxError> {
        let out = call(&self.func, &self.locals, message).await?;
        Python::attach(|py| {
            let out = out.bind(py);
            let (records, parent) = match out.cast::<PyTuple>() {
                Ok(t) if t.len() == 2 => (t.get_item(0)?, parent_of(&t.get_item(1)?)?),
                _ => (out.clone(), None),
            };
            let records = if records.is_none() {
                Vec::new()
            } else {
                convert::records(&records)?
            };
            Ok::<_, PyErr>(TransformOutput { records, parent })
        })
        .map_err(py_box)
    }
}

/// The keyword arguments `onceflow.IdempotentConsumer` takes besides the settings: named in
/// the error about an unknown one.
const IDEMPOTENT_OWN: OwnNames<'static> = &["store", "window", "dead_letter_producer", "batch"];

/// The same for `onceflow.Pipeline`.
const PIPELINE_OWN: OwnNames<'static> = &["store", "window"];

/// A Python value as a setting's value: `None` keeps the default; a `datetime.timedelta` is
/// its seconds.
pub(crate) fn setting_value(v: &Bound<'_, PyAny>) -> PyResult<Value> {
    Ok(if v.is_none() {
        Value::Absent
    } else if let Ok(b) = v.cast::<PyBool>() {
        Value::Bool(b.is_true())
    } else if let Ok(t) = v.cast::<PyString>() {
        Value::Text(t.to_str()?.to_string())
    } else if let Some(s) = convert::timedelta_seconds(v)? {
        Value::Number(s)
    } else if let Ok(n) = v.extract::<f64>() {
        // int, float and what converts to one (numpy scalars, Decimal).
        Value::Number(n)
    } else {
        Value::Other(v.get_type().name()?.to_string())
    })
}

/// The `(name, value)` pairs of a settings dict (its keys must be strings).
fn setting_entries(config: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<(String, Value)>> {
    let Some(d) = config else {
        return Ok(Vec::new());
    };
    d.iter()
        .map(|(k, v)| Ok((k.extract::<String>()?, setting_value(&v)?)))
        .collect()
}

/// A settings table result as Python raises it: a value of the wrong type is a `TypeError`
/// (as for any argument), a bad value a `ConfigError`.
pub(crate) fn settings_result<T>(r: onceflow::Result<T>) -> PyResult<T> {
    r.map_err(|e| {
        if settings::is_wrong_type(&e) {
            pyo3::exceptions::PyTypeError::new_err(e.message().to_string())
        } else {
            Python::attach(|py| crate::errors::to_pyerr(py, &e))
        }
    })
}

/// Engine settings from a dict, by the bindings' one settings table; unknown names, wrong
/// types TypeErrors, out-of-range values ConfigErrors, each naming the setting.
fn engine_config(config: Option<&Bound<'_, PyDict>>) -> PyResult<EngineConfig> {
    settings_result(settings::engine_config(
        Language::Python,
        setting_entries(config)?,
        IDEMPOTENT_OWN,
    ))
}

fn metrics_dict(py: Python<'_>, m: MetricsSnapshot) -> PyResult<Py<PyAny>> {
    let d = PyDict::new(py);
    for (name, value) in m.fields() {
        d.set_item(name, value)?;
    }
    Ok(d.into_any().unbind())
}

fn summary_dict(s: RunSummary) -> PyResult<Py<PyAny>> {
    Python::attach(|py| {
        let d = PyDict::new(py);
        d.set_item("metrics", metrics_dict(py, s.metrics)?)?;
        d.set_item("guarantee", s.guarantee.to_string())?;
        d.set_item("drained", s.drained)?;
        Ok(d.into_any().unbind())
    })
}

fn already_ran() -> Error {
    Error::new(
        ErrorKind::Closed,
        "this engine already ran: create a new one",
    )
}

/// Stop signal shared by `stop()` and the running engine.
fn stop_channel() -> (
    tokio::sync::watch::Sender<bool>,
    tokio::sync::watch::Receiver<bool>,
) {
    tokio::sync::watch::channel(false)
}

async fn stopped(mut rx: tokio::sync::watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// Runs an engine future as its own task on the runtime, so that cancelling the Python
/// awaitable does not drop the engine mid-batch (the Python side calls `stop()` instead).
async fn run_detached<F>(fut: F) -> onceflow::Result<RunSummary>
where
    F: std::future::Future<Output = onceflow::Result<RunSummary>> + Send + 'static,
{
    onceflow_bindings::runtime()
        .spawn(fut)
        .await
        .map_err(|e| Error::new(ErrorKind::Platform, format!("engine task failed: {e}")))?
}

/// At-least-once consumption plus a dedup store: `handler` runs once per idempotency key.
#[pyclass(frozen, module = "onceflow._native")]
pub struct IdempotentConsumer {
    engine: Arc<tokio::sync::Mutex<Option<onceflow::IdempotentConsumer>>>,
    metrics: onceflow::Metrics,
    consumer: onceflow::Consumer,
    guarantee: String,
    locals: Locals,
    stop: tokio::sync::watch::Sender<bool>,
}

#[pymethods]
impl IdempotentConsumer {
    /// `handler(message)` returns an awaitable of `None` or bytes; with `batch=True`,
    /// `handler(batch)` gets consecutive messages of one partition as a `MessageBatch` and returns an
    /// awaitable of `None` or one `None`/bytes per message. A batch handler that raises fails
    /// every message of the call: retried, then each given up (redelivered) as `on_failure`
    /// says.
    #[new]
    #[pyo3(signature = (consumer, handler, store=None, *, config=None, dead_letter_producer=None, batch=false))]
    fn new(
        consumer: &Consumer,
        handler: Py<PyAny>,
        store: Option<&DedupStore>,
        config: Option<&Bound<'_, PyDict>>,
        dead_letter_producer: Option<&Producer>,
        batch: bool,
    ) -> PyResult<Self> {
        let locals: Locals = Arc::default();
        let h = PyHandler {
            func: handler,
            locals: locals.clone(),
            batch,
        };
        let engine = crate::errors::py_result(onceflow::IdempotentConsumer::with_config(
            consumer.inner.clone(),
            store.map(|s| s.inner.clone()),
            Arc::new(h),
            engine_config(config)?,
            dead_letter_producer.map(|p| p.inner.clone()),
        ))?;
        Ok(IdempotentConsumer {
            metrics: engine.metrics(),
            guarantee: engine.guarantee().to_string(),
            engine: Arc::new(tokio::sync::Mutex::new(Some(engine))),
            consumer: consumer.inner.clone(),
            locals,
            stop: stop_channel().0,
        })
    }

    /// `effectively-once` with a store, `at-least-once` without.
    #[getter]
    fn guarantee(&self) -> String {
        self.guarantee.clone()
    }

    /// Counters, live.
    fn metrics(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        metrics_dict(py, self.metrics.snapshot())
    }

    /// Lag per assigned partition.
    fn lag<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let c = self.consumer.clone();
        awaitable(py, async move {
            c.lag()
                .await
                .map(|v| v.into_iter().map(Lag::from).collect::<Vec<_>>())
        })
    }

    /// Polls once and handles what arrived; resolves to the number of messages polled.
    fn step<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        *self.locals.lock() = Some(current_locals(py)?);
        let engine = self.engine.clone();
        awaitable(py, async move {
            let guard = engine.lock().await;
            guard.as_ref().ok_or_else(already_ran)?.step().await
        })
    }

    /// Runs until `stop()` or an error, then drains, commits and closes the consumer;
    /// resolves to `{metrics, guarantee, drained}`.
    fn run<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        *self.locals.lock() = Some(current_locals(py)?);
        let engine = self.engine.clone();
        let rx = self.stop.subscribe();
        crate::awaitable_py(py, async move {
            let ic = crate::errors::py_result(engine.lock().await.take().ok_or_else(already_ran))?;
            let summary = crate::errors::py_result(run_detached(ic.run_until(stopped(rx))).await)?;
            summary_dict(summary)
        })
    }

    /// Asks a running `run()` to stop: it finishes work in flight, commits and returns.
    fn stop(&self) {
        self.stop.send_replace(true);
    }
}

/// Consume-transform-produce with the strongest mechanism the platform offers.
#[pyclass(frozen, module = "onceflow._native")]
pub struct Pipeline {
    engine: Arc<tokio::sync::Mutex<Option<onceflow::Pipeline>>>,
    metrics: onceflow::Metrics,
    guarantee: String,
    mechanism: &'static str,
    locals: Locals,
    stop: tokio::sync::watch::Sender<bool>,
}

#[pymethods]
impl Pipeline {
    #[new]
    #[pyo3(signature = (consumer, producer, transform, store=None, *, mode="auto", config=None, transaction_interval=None, max_transaction_inputs=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        consumer: &Consumer,
        producer: &Producer,
        transform: Py<PyAny>,
        store: Option<&DedupStore>,
        mode: &str,
        config: Option<&Bound<'_, PyDict>>,
        transaction_interval: Option<&Bound<'_, PyAny>>,
        max_transaction_inputs: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut entries = setting_entries(config)?;
        entries.extend([
            ("mode".to_string(), Value::Text(mode.to_string())),
            (
                "transaction_interval".to_string(),
                transaction_interval.map_or(Ok(Value::Absent), setting_value)?,
            ),
            (
                "max_transaction_inputs".to_string(),
                max_transaction_inputs.map_or(Ok(Value::Absent), setting_value)?,
            ),
        ]);
        let pc = settings_result(settings::pipeline_config(
            Language::Python,
            entries,
            PIPELINE_OWN,
        ))?;
        let locals: Locals = Arc::default();
        let t = PyTransform {
            func: transform,
            locals: locals.clone(),
        };
        let engine = crate::errors::py_result(onceflow::Pipeline::with_config(
            consumer.inner.clone(),
            producer.inner.clone(),
            store.map(|s| s.inner.clone()),
            Arc::new(t),
            pc,
        ))?;
        Ok(Pipeline {
            metrics: engine.metrics(),
            guarantee: engine.guarantee().to_string(),
            mechanism: engine.mechanism(),
            engine: Arc::new(tokio::sync::Mutex::new(Some(engine))),
            locals,
            stop: stop_channel().0,
        })
    }

    /// The guarantee this pipeline runs with.
    #[getter]
    fn guarantee(&self) -> String {
        self.guarantee.clone()
    }

    /// The mechanism, in words.
    #[getter]
    fn mechanism(&self) -> &'static str {
        self.mechanism
    }

    /// Counters, live.
    fn metrics(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        metrics_dict(py, self.metrics.snapshot())
    }

    /// Runs until `stop()` or an error; resolves to `{metrics, guarantee, drained}`.
    fn run<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        *self.locals.lock() = Some(current_locals(py)?);
        let engine = self.engine.clone();
        let rx = self.stop.subscribe();
        crate::awaitable_py(py, async move {
            let p = crate::errors::py_result(engine.lock().await.take().ok_or_else(already_ran))?;
            let summary = crate::errors::py_result(run_detached(p.run_until(stopped(rx))).await)?;
            summary_dict(summary)
        })
    }

    /// Asks a running `run()` to stop.
    fn stop(&self) {
        self.stop.send_replace(true);
    }
}
