//! Completions handed to the asyncio loop in bursts.
//!
//! pyo3-async-runtimes resolves every awaitable from the tokio worker that finished it: the
//! worker takes the GIL and calls `loop.call_soon_threadsafe`. While the asyncio thread is busy
//! (a producer sending in a loop), each of those waits for the interpreter's switch interval
//! (5 ms), which caps a stream of single `send`s at a few thousand per second.
//!
//! Here a finished Rust future never touches Python: its result goes into a queue of the loop it
//! belongs to, and the first result of a burst writes one byte to a socket pair the loop watches
//! (`loop.add_reader`). The loop thread then drains the queue in one callback, converting every
//! result and resolving its `asyncio.Future` with the GIL it already holds. One wake-up per
//! burst, no GIL taken on the runtime's threads.
//!
//! A loop that cannot carry the queue (no attribute dict, as on some third-party loops) and
//! non-Unix platforms use pyo3-async-runtimes' path instead.

use std::future::Future;

use pyo3::prelude::*;

/// Turns a Rust result into the Python value an awaitable resolves to (or raises), on the loop
/// thread.
pub type Convert<R> = fn(Python<'_>, R) -> PyResult<Py<PyAny>>;

/// An asyncio awaitable that resolves to `convert(fut.await)`. `fut` runs on the bindings'
/// runtime; when `cancellable`, cancelling the awaitable aborts it (leave it off for work that
/// must finish once started, such as a send).
pub fn deliver<'py, F, R>(
    py: Python<'py>,
    fut: F,
    convert: Convert<R>,
    cancellable: bool,
) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = R> + Send + 'static,
    R: Send + 'static,
{
    #[cfg(unix)]
    {
        let event_loop = imp::running_loop(py)?;
        if let Some(waker) = imp::waker_for(py, &event_loop)? {
            return imp::spawn(py, &event_loop, waker, fut, convert, cancellable);
        }
    }
    let _ = cancellable;
    pyo3_async_runtimes::generic::future_into_py::<crate::Rt, _, Py<PyAny>>(py, async move {
        let r = fut.await;
        Python::attach(|py| convert(py, r))
    })
}

#[cfg(unix)]
mod imp {
    use std::future::Future;
    use std::io::{ErrorKind, Read, Write};
    use std::os::unix::io::AsRawFd;
    use std::os::unix::net::UnixStream;
    use std::sync::Arc;

    use futures::FutureExt;
    use parking_lot::Mutex;
    use pyo3::exceptions::PyRuntimeError;
    use pyo3::intern;
    use pyo3::prelude::*;
    use pyo3::sync::PyOnceLock;
    use pyo3::types::PyCFunction;

    use super::Convert;

    /// The attribute of the event loop holding its [`LoopWaker`].
    const ATTR: &str = "_onceflow_waker";

    /// Produces the value (or the exception) of a finished future, on the loop thread.
    type Resolve = Box<dyn FnOnce(Python<'_>) -> PyResult<Py<PyAny>> + Send>;

    /// A finished future's asyncio future and its result.
    type Done = (Py<PyAny>, Resolve);

    struct Shared {
        queue: Mutex<Vec<Done>>,
        tx: UnixStream,
    }

    impl Shared {
        /// Queues a finished result (no GIL needed); the first of a burst wakes the loop.
        fn push(&self, done: Done) {
            let first = {
                let mut q = self.queue.lock();
                q.push(done);
                q.len() == 1
            };
            if first {
                // WouldBlock means the socket already holds unread bytes: the loop will wake.
                let _ = (&self.tx).write(&[1]);
            }
        }
    }

    /// The queue of one event loop, stored on the loop as `_onceflow_waker`.
    #[pyclass(frozen, module = "onceflow._native")]
    pub struct LoopWaker {
        shared: Arc<Shared>,
        rx: UnixStream,
        pid: u32,
    }

    #[pymethods]
    impl LoopWaker {
        /// The loop's reader callback: resolves every queued future.
        fn drain(&self, py: Python<'_>) {
            // Read the wake-up bytes before taking the queue: a result queued after the take
            // then finds the queue empty and writes a new byte, so none is left unwoken.
            let mut buf = [0u8; 512];
            loop {
                match (&self.rx).read(&mut buf) {
                    Ok(n) if n == buf.len() => continue,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    _ => break,
                }
            }
            let items = std::mem::take(&mut *self.shared.queue.lock());
            for (fut, convert) in items {
                let fut = fut.bind(py);
                if let Err(e) = resolve(py, fut, convert) {
                    e.write_unraisable(py, Some(fut));
                }
            }
        }
    }

    fn resolve(py: Python<'_>, fut: &Bound<'_, PyAny>, convert: Resolve) -> PyResult<()> {
        // Cancelled (or otherwise finished) awaitables drop their result.
        if fut.call_method0(intern!(py, "done"))?.is_truthy()? {
            return Ok(());
        }
        match convert(py) {
            Ok(v) => fut.call_method1(intern!(py, "set_result"), (v,))?,
            Err(e) => fut.call_method1(intern!(py, "set_exception"), (e.into_value(py),))?,
        };
        Ok(())
    }

    static GET_RUNNING_LOOP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

    /// `asyncio.get_running_loop()`: a RuntimeError outside a coroutine.
    pub fn running_loop(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        GET_RUNNING_LOOP
            .get_or_try_init(py, || {
                py.import("asyncio")?
                    .getattr("get_running_loop")
                    .map(Bound::unbind)
            })?
            .bind(py)
            .call0()
    }

    /// The loop's waker, created and registered on first use; `None` when the loop cannot
    /// hold one.
    pub fn waker_for(
        py: Python<'_>,
        event_loop: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Py<LoopWaker>>> {
        let pid = std::process::id();
        if let Ok(w) = event_loop.getattr(intern!(py, ATTR)) {
            if let Ok(w) = w.cast_into::<LoopWaker>() {
                if w.get().pid == pid {
                    return Ok(Some(w.unbind()));
                }
            }
        }
        let (tx, rx) = UnixStream::pair()?;
        tx.set_nonblocking(true)?;
        rx.set_nonblocking(true)?;
        let fd = rx.as_raw_fd();
        let waker = Py::new(
            py,
            LoopWaker {
                shared: Arc::new(Shared {
                    queue: Mutex::new(Vec::new()),
                    tx,
                }),
                rx,
                pid,
            },
        )?;
        if event_loop.setattr(intern!(py, ATTR), &waker).is_err() {
            return Ok(None);
        }
        let drain = waker.bind(py).getattr(intern!(py, "drain"))?;
        event_loop.call_method1(intern!(py, "add_reader"), (fd, drain))?;
        Ok(Some(waker))
    }

    pub fn spawn<'py, F, R>(
        py: Python<'py>,
        event_loop: &Bound<'py, PyAny>,
        waker: Py<LoopWaker>,
        fut: F,
        convert: Convert<R>,
        cancellable: bool,
    ) -> PyResult<Bound<'py, PyAny>>
    where
        F: Future<Output = R> + Send + 'static,
        R: Send + 'static,
    {
        let py_fut = event_loop.call_method0(intern!(py, "create_future"))?;
        let shared = waker.get().shared.clone();
        let handle = py_fut.clone().unbind();
        let task = onceflow_bindings::runtime().spawn(async move {
            // A panic must still resolve the awaitable, or its caller would wait forever.
            let done: Resolve = match std::panic::AssertUnwindSafe(fut).catch_unwind().await {
                Ok(r) => Box::new(move |py: Python<'_>| convert(py, r)),
                Err(panic) => {
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    Box::new(move |_: Python<'_>| {
                        Err(PyRuntimeError::new_err(format!(
                            "onceflow: a native task panicked: {what}"
                        )))
                    })
                }
            };
            shared.push((handle, done));
        });
        if cancellable {
            let abort = task.abort_handle();
            let on_done = PyCFunction::new_closure(
                py,
                None,
                None,
                move |args: &Bound<'_, pyo3::types::PyTuple>,
                      _kwargs: Option<&Bound<'_, pyo3::types::PyDict>>|
                      -> PyResult<()> {
                    let py = args.py();
                    let f = args.get_item(0)?;
                    if f.call_method0(intern!(py, "cancelled"))?.is_truthy()? {
                        abort.abort();
                    }
                    Ok(())
                },
            )?;
            py_fut.call_method1(intern!(py, "add_done_callback"), (on_done,))?;
        }
        Ok(py_fut)
    }
}
