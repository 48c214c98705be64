//! # onceflow-python
//!
//! The native module `onceflow._native` behind the `onceflow` Python package: thin pyo3
//! wrappers over the `onceflow` facade. Every method that talks to a platform returns an
//! asyncio awaitable backed by a future on the bindings' tokio runtime (see
//! [`onceflow_bindings::runtime`]), so no call blocks the event loop or holds the GIL while it
//! waits. The pure-Python package adds the sync facade, `async for`, context managers and
//! OpenTelemetry propagation. Conversions only: the behaviour is the Rust crate's.

use std::future::Future;
use std::pin::Pin;

use futures::TryFutureExt;
use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;
use pyo3_async_runtimes::generic::{self, ContextExt, JoinError, Runtime};
use pyo3_async_runtimes::TaskLocals;

mod client;
mod convert;
mod engine;
mod errors;
mod inbox;
mod trace;
mod wake;

/// pyo3-async-runtimes' view of the bindings' runtime (which is rebuilt after `fork()`).
pub struct Rt;

/// A failed task of [`Rt`].
pub struct RtJoinError(tokio::task::JoinError);

impl JoinError for RtJoinError {
    fn is_panic(&self) -> bool {
        self.0.is_panic()
    }
    fn into_panic(self) -> Box<dyn std::any::Any + Send + 'static> {
        self.0.into_panic()
    }
}

tokio::task_local! {
    static LOCALS: std::cell::OnceCell<TaskLocals>;
}

type MapJoin =
    futures::future::MapErr<tokio::task::JoinHandle<()>, fn(tokio::task::JoinError) -> RtJoinError>;

impl Runtime for Rt {
    type JoinError = RtJoinError;
    type JoinHandle = MapJoin;

    fn spawn<F>(fut: F) -> Self::JoinHandle
    where
        F: Future<Output = ()> + Send + 'static,
    {
        onceflow_bindings::runtime()
            .spawn(fut)
            .map_err(RtJoinError as fn(_) -> _)
    }

    fn spawn_blocking<F>(f: F) -> Self::JoinHandle
    where
        F: FnOnce() + Send + 'static,
    {
        onceflow_bindings::runtime()
            .spawn_blocking(f)
            .map_err(RtJoinError as fn(_) -> _)
    }
}

impl ContextExt for Rt {
    fn scope<F, R>(locals: TaskLocals, fut: F) -> Pin<Box<dyn Future<Output = R> + Send>>
    where
        F: Future<Output = R> + Send + 'static,
    {
        let cell = std::cell::OnceCell::new();
        let _ = cell.set(locals);
        Box::pin(LOCALS.scope(cell, fut))
    }

    fn get_task_locals() -> Option<TaskLocals> {
        LOCALS.try_with(|c| c.get().cloned()).unwrap_or_default()
    }
}

fn convert_result<T>(py: Python<'_>, r: onceflow::Result<T>) -> PyResult<Py<PyAny>>
where
    T: for<'a> IntoPyObject<'a>,
{
    errors::py_result(r)?.into_py_any(py)
}

fn convert_py<T>(py: Python<'_>, r: PyResult<T>) -> PyResult<Py<PyAny>>
where
    T: for<'a> IntoPyObject<'a>,
{
    r?.into_py_any(py)
}

/// An asyncio awaitable resolving to the result of `fut` (converted to Python on the loop's
/// thread; onceflow errors become onceflow exceptions). Cancelling it aborts `fut`.
pub fn awaitable<'py, F, T>(py: Python<'py>, fut: F) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = onceflow::Result<T>> + Send + 'static,
    T: for<'a> IntoPyObject<'a> + Send + 'static,
{
    wake::deliver(py, fut, convert_result::<T>, true)
}

/// An asyncio awaitable resolving to the result of `fut`, which reports Python errors itself.
pub fn awaitable_py<'py, F, T>(py: Python<'py>, fut: F) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = PyResult<T>> + Send + 'static,
    T: for<'a> IntoPyObject<'a> + Send + 'static,
{
    wake::deliver(py, fut, convert_py::<T>, true)
}

/// The task locals (event loop and contextvars) of the calling coroutine.
pub fn current_locals(py: Python<'_>) -> PyResult<TaskLocals> {
    generic::get_current_locals::<Rt>(py)
}

/// `[(kind, code, class name)]` for every error kind, in core's order.
#[pyfunction]
fn error_kinds() -> Vec<(&'static str, &'static str, &'static str)> {
    onceflow_bindings::error_kinds()
        .into_iter()
        .map(|i| (i.name, i.code, i.class))
        .collect()
}

/// URL schemes this build can open.
#[pyfunction]
fn supported_schemes() -> Vec<&'static str> {
    onceflow::supported_schemes()
}

/// Stops the runtime (registered with `atexit` by the package): waits up to `timeout` seconds
/// for its tasks with the GIL released.
#[pyfunction]
#[pyo3(signature = (timeout=1.0))]
fn _shutdown(py: Python<'_>, timeout: f64) {
    let timeout = std::time::Duration::from_secs_f64(timeout.clamp(0.0, 60.0));
    py.detach(|| onceflow_bindings::shutdown(timeout));
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    m.add_function(wrap_pyfunction!(error_kinds, m)?)?;
    m.add_function(wrap_pyfunction!(supported_schemes, m)?)?;
    m.add_function(wrap_pyfunction!(_shutdown, m)?)?;
    client::register(m)?;
    engine::register(m)?;
    inbox::register(m)?;
    trace::register(m)?;
    Ok(())
}

/// mimalloc for the extension's Rust allocations. A single `send` allocates a dozen small
/// objects per record, with thousands in flight and freed in bursts, some on librdkafka's
/// threads: glibc's per-thread cache misses and `_int_malloc`'s slow path was ~19 % of the loop
/// thread (PY1, benches/RESULTS.md). `local_dynamic_tls`: the module is `dlopen`ed by Python,
/// where mimalloc's default initial-exec TLS fails ("cannot allocate memory in static TLS
/// block").
///
/// `no_thp`: mimalloc (v3) otherwise asks for transparent huge pages on its own memory
/// (`madvise(MADV_HUGEPAGE)`), so on Linux with THP in `madvise` mode (Debian's default)
/// each first touch of fresh heap zeroes a whole 2 MiB page. Memory it freed and returned to
/// the OS is faulted in again that way, and the extension's traffic keeps doing that: a
/// PutRecords body (~700 KB for 500 Kinesis records) per call, the `pulsar` crate's
/// multi-kilobyte command structs per frame in its channels. The kernel's `clear_page_erms`
/// was 34-40 % of the process's CPU in PY5 produce and PY4 consume (perf, 2026-12-07);
/// without the advice, 10 µs instead of 23-46 µs CPU per Kinesis record. The feature only
/// drops mimalloc's own advice: a system with THP set to `always` still gets huge pages, and
/// nothing process-wide is changed (mimalloc's `allow_thp=0` option would `prctl` THP off for
/// the whole Python process).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
