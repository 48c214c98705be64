//! The transactional inbox from Python: `Inbox` over `onceflow_bindings::inbox`, with a Python
//! callable as the handler and `InboxTransaction` as its view of the message's database
//! transaction. Conversions only: the loop is core's, the statement channel the bindings'.

use std::sync::Arc;

use onceflow_bindings::inbox::{self, HandlerFuture, InboxCallback, InboxTx, SqlRows, SqlValue};
use onceflow_bindings::settings::{self, Language, OwnNames};
use parking_lot::Mutex;
use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple,
};
use pyo3_async_runtimes::TaskLocals;

use crate::client::Consumer;
use crate::convert::{Message, Seconds};
use crate::errors::{py_box, py_result};
use crate::{awaitable, current_locals};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Inbox>()?;
    m.add_class::<InboxTransaction>()?;
    m.add_function(wrap_pyfunction!(open_inbox, m)?)?;
    Ok(())
}

/// The keyword arguments `onceflow.Inbox` takes besides the settings.
const INBOX_OWN: OwnNames<'static> = &["store", "window"];

type Locals = Arc<Mutex<Option<TaskLocals>>>;

/// A parameter list (a list or tuple) as SQL values; a value of another type is a `TypeError`
/// naming its index and type.
fn params(p: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<SqlValue>> {
    let Some(p) = p.filter(|p| !p.is_none()) else {
        return Ok(Vec::new());
    };
    if !(p.is_instance_of::<PyList>() || p.is_instance_of::<PyTuple>()) {
        return Err(PyTypeError::new_err(format!(
            "params: expected a list or tuple of values, got {}",
            p.get_type().name()?
        )));
    }
    p.try_iter()?
        .enumerate()
        .map(|(i, v)| {
            let v = v?;
            Ok(if v.is_none() {
                SqlValue::Null
            } else if let Ok(b) = v.cast::<PyBool>() {
                SqlValue::Bool(b.is_true())
            } else if v.is_instance_of::<PyInt>() {
                SqlValue::Int(v.extract::<i64>().map_err(|_| {
                    PyOverflowError::new_err(format!(
                        "params[{i}]: {v} does not fit a 64-bit signed integer"
                    ))
                })?)
            } else if let Ok(f) = v.cast::<PyFloat>() {
                SqlValue::Float(f.value())
            } else if let Ok(s) = v.cast::<PyString>() {
                SqlValue::Text(s.to_str()?.to_string())
            } else if let Ok(b) = v.cast::<PyBytes>() {
                SqlValue::Bytes(b.as_bytes().to_vec())
            } else if let Ok(b) = v.cast::<PyByteArray>() {
                SqlValue::Bytes(b.to_vec())
            } else if v.get_type().name()? == "memoryview" {
                SqlValue::Bytes(v.call_method0("tobytes")?.extract::<Vec<u8>>()?)
            } else {
                return Err(PyTypeError::new_err(format!(
                    "params[{i}]: expected str, int, float, bytes, bool or None, got {}",
                    v.get_type().name()?
                )));
            })
        })
        .collect()
}

fn value(py: Python<'_>, v: SqlValue) -> PyResult<Py<PyAny>> {
    use pyo3::IntoPyObjectExt;
    match v {
        SqlValue::Null => Ok(py.None()),
        SqlValue::Bool(b) => b.into_py_any(py),
        SqlValue::Int(i) => i.into_py_any(py),
        SqlValue::Float(f) => f.into_py_any(py),
        SqlValue::Text(t) => t.into_py_any(py),
        SqlValue::Bytes(b) => Ok(PyBytes::new(py, &b).into_any().unbind()),
    }
}

/// Rows as a list of tuples, or of dicts keyed by column name.
fn rows(py: Python<'_>, r: SqlRows, dicts: bool) -> PyResult<Py<PyAny>> {
    let out = PyList::empty(py);
    for row in r.rows {
        if dicts {
            let d = PyDict::new(py);
            for (c, v) in r.columns.iter().zip(row) {
                d.set_item(c, value(py, v)?)?;
            }
            out.append(d)?;
        } else {
            let items = row
                .into_iter()
                .map(|v| value(py, v))
                .collect::<PyResult<Vec<_>>>()?;
            out.append(PyTuple::new(py, items)?)?;
        }
    }
    Ok(out.into_any().unbind())
}

/// The message's open database transaction, given to the inbox handler: its statements commit
/// or roll back with the message's idempotency key and position. Usable only while the handler
/// runs; afterwards every call raises `ClosedError`.
#[pyclass(frozen, module = "onceflow._native")]
pub struct InboxTransaction {
    tx: InboxTx,
}

#[pymethods]
impl InboxTransaction {
    /// `"postgres"` (placeholders `$1, $2, …`) or `"embedded"` (SQLite: `?` or `?1, ?2, …`).
    #[getter]
    fn store(&self) -> &'static str {
        self.tx.store().name()
    }

    /// Whether the handler still runs (statements are accepted).
    #[getter]
    fn open(&self) -> bool {
        self.tx.is_open()
    }

    /// Runs one statement; awaitable of the number of rows it changed.
    #[pyo3(signature = (sql, params=None))]
    fn execute<'py>(
        &self,
        py: Python<'py>,
        sql: String,
        params: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let p = self::params(params)?;
        let tx = self.tx.clone();
        awaitable(py, async move { tx.execute(sql, p).await })
    }

    /// Runs one query; awaitable of a list of tuples (dicts keyed by column with
    /// `as_dicts=True`).
    #[pyo3(signature = (sql, params=None, *, as_dicts=false))]
    fn query<'py>(
        &self,
        py: Python<'py>,
        sql: String,
        params: Option<&Bound<'py, PyAny>>,
        as_dicts: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let p = self::params(params)?;
        let tx = self.tx.clone();
        crate::awaitable_py(py, async move {
            let r = py_result(tx.query(sql, p).await)?;
            Python::attach(|py| rows(py, r, as_dicts))
        })
    }

    /// `execute` that blocks (the GIL released) instead of returning an awaitable: for the
    /// sync API's handlers, which run outside any coroutine.
    #[pyo3(signature = (sql, params=None))]
    fn execute_blocking(
        &self,
        py: Python<'_>,
        sql: String,
        params: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let p = self::params(params)?;
        let tx = self.tx.clone();
        let r = py.detach(move || onceflow_bindings::runtime().block_on(tx.execute(sql, p)));
        py_result(r)
    }

    /// `query` that blocks (the GIL released); see `execute_blocking`.
    #[pyo3(signature = (sql, params=None, *, as_dicts=false))]
    fn query_blocking(
        &self,
        py: Python<'_>,
        sql: String,
        params: Option<&Bound<'_, PyAny>>,
        as_dicts: bool,
    ) -> PyResult<Py<PyAny>> {
        let p = self::params(params)?;
        let tx = self.tx.clone();
        let r = py.detach(move || onceflow_bindings::runtime().block_on(tx.query(sql, p)));
        rows(py, py_result(r)?, as_dicts)
    }

    fn __repr__(&self) -> String {
        format!(
            "InboxTransaction(store={:?}, open={})",
            self.tx.store().name(),
            self.tx.is_open()
        )
    }
}

/// `func(message, transaction)` as the inbox's handler: returns an awaitable that runs on the
/// asyncio loop of `run()` / `step()`.
struct PyCallback {
    func: Py<PyAny>,
    locals: Locals,
}

impl InboxCallback for PyCallback {
    fn call(&self, message: onceflow::Message, tx: InboxTx) -> HandlerFuture {
        let locals = self.locals.lock().clone();
        let fut = Python::attach(|py| -> PyResult<_> {
            let locals = locals.ok_or_else(|| {
                PyErr::new::<pyo3::exceptions::PyRuntimeError, _>(
                    "no asyncio loop: call run() or step() from a coroutine",
                )
            })?;
            let aw = self.func.bind(py).call1((
                Message::single(message),
                Py::new(py, InboxTransaction { tx })?,
            ))?;
            pyo3_async_runtimes::into_future_with_locals(&locals, aw)
        });
        Box::pin(async move {
            let fut = fut.map_err(py_box)?;
            fut.await.map(|_| ()).map_err(py_box)
        })
    }
}

fn already_ran() -> onceflow::Error {
    onceflow::Error::new(
        onceflow::ErrorKind::Closed,
        "this inbox already ran: create a new one",
    )
}

/// A transactional inbox on PostgreSQL or the embedded store (made by `open_inbox`).
#[pyclass(frozen, module = "onceflow._native")]
pub struct Inbox {
    inner: Arc<tokio::sync::Mutex<Option<inbox::Inbox>>>,
    positions: inbox::InboxPositions,
    store: &'static str,
    namespace: String,
    last: Arc<Mutex<onceflow::inbox::InboxSummary>>,
    locals: Locals,
    stop: tokio::sync::watch::Sender<bool>,
}

fn summary_dict(py: Python<'_>, s: &onceflow::inbox::InboxSummary) -> PyResult<Py<PyAny>> {
    let d = PyDict::new(py);
    d.set_item("handled", s.handled)?;
    d.set_item("duplicates", s.duplicates)?;
    d.set_item("behind_position", s.behind_position)?;
    Ok(d.into_any().unbind())
}

/// Opens the store at `store` and makes an inbox over `consumer` whose handler is
/// `handler(message, transaction)` (returning an awaitable); awaitable of an `Inbox`.
#[pyfunction]
#[pyo3(signature = (consumer, handler, store, *, window=Seconds(86400.0), config=None))]
fn open_inbox<'py>(
    py: Python<'py>,
    consumer: &Consumer,
    handler: Py<PyAny>,
    store: String,
    window: Seconds,
    config: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyAny>> {
    let entries = match config {
        None => Vec::new(),
        Some(d) => d
            .iter()
            .map(|(k, v)| Ok((k.extract::<String>()?, crate::engine::setting_value(&v)?)))
            .collect::<PyResult<Vec<_>>>()?,
    };
    let cfg = crate::engine::settings_result(settings::inbox_config(
        Language::Python,
        entries,
        INBOX_OWN,
    ))?;
    let window = crate::engine::settings_result(Language::Python.duration("window", window.0))?;
    let locals: Locals = Arc::default();
    let cb = Arc::new(PyCallback {
        func: handler,
        locals: locals.clone(),
    });
    let consumer = consumer.inner.clone();
    crate::awaitable_py(py, async move {
        let ib = py_result(inbox::Inbox::open(consumer, &store, window, cfg, cb).await)?;
        Ok(Inbox {
            store: ib.store().name(),
            namespace: ib.namespace().to_string(),
            positions: ib.positions_reader(),
            inner: Arc::new(tokio::sync::Mutex::new(Some(ib))),
            last: Arc::default(),
            locals,
            stop: tokio::sync::watch::channel(false).0,
        })
    })
}

#[pymethods]
impl Inbox {
    /// `"postgres"` or `"embedded"`: the database (and placeholder style) of the handler's SQL.
    #[getter]
    fn store(&self) -> &'static str {
        self.store
    }

    /// The namespace of the inbox's keys and positions (default `"default"`; never the
    /// consumer group, so a new group on the same database handles nothing twice).
    #[getter]
    fn namespace(&self) -> String {
        self.namespace.clone()
    }

    /// What the inbox did so far: `{handled, duplicates, behind_position}`.
    fn summary(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let s = match self.inner.try_lock() {
            Ok(g) => match g.as_ref() {
                Some(i) => i.summary(),
                None => self.last.lock().clone(),
            },
            Err(_) => self.last.lock().clone(),
        };
        summary_dict(py, &s)
    }

    /// Awaitable of the stored positions: `[(topic, partition, position)]`, `position` as
    /// text (the last message committed per partition); also while `run()` runs and after it
    /// returned.
    fn stored_positions<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let positions = self.positions.clone();
        awaitable(py, async move {
            let ps = positions.read().await?;
            Ok(ps
                .into_iter()
                .map(|(tp, p)| (tp.topic, tp.partition, p.to_string()))
                .collect::<Vec<_>>())
        })
    }

    /// Polls once and handles what came; awaitable of the number of messages polled.
    fn step<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        *self.locals.lock() = Some(current_locals(py)?);
        let inner = self.inner.clone();
        let last = self.last.clone();
        awaitable(py, async move {
            let mut g = inner.lock().await;
            let ib = g.as_mut().ok_or_else(already_ran)?;
            let r = ib.step().await;
            *last.lock() = ib.summary();
            r
        })
    }

    /// Runs until `stop()` or an error; awaitable of the summary. Does not close the consumer.
    fn run<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        *self.locals.lock() = Some(current_locals(py)?);
        let inner = self.inner.clone();
        let last = self.last.clone();
        let mut rx = self.stop.subscribe();
        crate::awaitable_py(py, async move {
            let ib = py_result(inner.lock().await.take().ok_or_else(already_ran))?;
            let task = onceflow_bindings::runtime().spawn(async move {
                ib.run_until(async move {
                    let _ = rx.wait_for(|s| *s).await;
                })
                .await
            });
            let s = py_result(task.await.unwrap_or_else(|e| {
                Err(onceflow::Error::new(
                    onceflow::ErrorKind::Platform,
                    format!("inbox task failed: {e}"),
                ))
            }))?;
            *last.lock() = s.clone();
            Python::attach(|py| summary_dict(py, &s))
        })
    }

    /// Asks a running `run()` to stop.
    fn stop(&self) {
        self.stop.send_replace(true);
    }

    fn __repr__(&self) -> String {
        format!(
            "Inbox(store={:?}, namespace={:?})",
            self.store,
            onceflow::shown(&self.namespace)
        )
    }
}
