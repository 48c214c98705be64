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
//! A single send ([`send`]) goes further: no tokio task and no `asyncio.Future`. Its Rust future
//! is polled once at the call, on the loop thread inside the runtime's context (the record is
//! handed to the platform client there), and its waker queues it on the same queue, so the
//! loop's drain polls it again and resolves its [`SendFuture`], a native object speaking
//! asyncio's Future protocol.
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
        if let Some(waker) = imp::current(py)? {
            return imp::spawn(py, waker, fut, convert, cancellable);
        }
    }
    let _ = cancellable;
    pyo3_async_runtimes::generic::future_into_py::<crate::Rt, _, Py<PyAny>>(py, async move {
        let r = fut.await;
        Python::attach(|py| convert(py, r))
    })
}

/// The awaitable of one send: a [`SendFuture`](imp::SendFuture) resolving to
/// `convert(fut.await)`. `fut` is polled at once on the calling (loop) thread, inside the
/// bindings' runtime context, so the record is handed to the platform client before this
/// returns (librdkafka's queue for Kafka), as confluent-kafka's `produce` does; what is left
/// (the acknowledgement) is polled on the loop thread again each time it wakes, in the loop's
/// bursts. No tokio task and no `asyncio.Future` per send. Cancelling the awaitable never
/// stops `fut`: the record is sent and its result dropped.
///
/// On loops that cannot hold the queue, and off Unix, this is [`deliver`] (an
/// `asyncio.Future`, uncancellable work).
pub fn send<'py, F, R>(py: Python<'py>, fut: F, convert: Convert<R>) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = R> + Send + 'static,
    R: Send + 'static,
{
    #[cfg(unix)]
    {
        if let Some(waker) = imp::current(py)? {
            return imp::send(py, &waker, fut, convert);
        }
    }
    deliver(py, fut, convert, false)
}

#[cfg(unix)]
pub use imp::{complete_all, pending, untrack, Completion, SendFuture};

/// How many `os.fork()`s this process descends from, as counted since the first call (which
/// starts counting through `os.register_at_fork`): a value taken in a parent differs from the
/// child's. Always 0 off Unix.
pub fn fork_epoch(py: Python<'_>) -> PyResult<u64> {
    #[cfg(unix)]
    {
        imp::watch_forks(py)?;
        Ok(current_fork_epoch())
    }
    #[cfg(not(unix))]
    {
        let _ = py;
        Ok(0)
    }
}

/// [`fork_epoch`] without starting the count (one atomic load).
pub fn current_fork_epoch() -> u64 {
    #[cfg(unix)]
    {
        imp::FORK_EPOCH.load(std::sync::atomic::Ordering::Acquire)
    }
    #[cfg(not(unix))]
    {
        0
    }
}

#[cfg(unix)]
mod imp {
    use std::future::Future;
    use std::io::{ErrorKind, Read, Write};
    use std::os::unix::io::AsRawFd;
    use std::os::unix::net::UnixStream;
    use std::panic::AssertUnwindSafe;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Weak};
    use std::task::{Context, Poll, Wake, Waker};

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

    /// What the loop's drain does with one queued entry.
    enum Item {
        /// A finished future's `asyncio.Future` and its result.
        Done(Py<PyAny>, Resolve),
        /// A send that woke: poll it again (see [`SendTask`]).
        Poll(Arc<dyn Drive>),
        /// Results for `SendFuture`s completed off the loop (see [`complete_all`]).
        Run(Box<dyn FnOnce(Python<'_>) + Send>),
    }

    struct Shared {
        queue: Mutex<Vec<Item>>,
        tx: UnixStream,
        /// The bindings' runtime, entered while sends are polled on the loop thread.
        runtime: tokio::runtime::Handle,
    }

    impl Shared {
        /// Queues an entry (no GIL needed); the first of a burst wakes the loop.
        fn push(&self, item: Item) {
            let first = {
                let mut q = self.queue.lock();
                q.push(item);
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
        /// [`FORK_EPOCH`] when made: a child process makes its own.
        epoch: u64,
        /// `process` is scheduled on the loop and has not started yet.
        scheduled: AtomicBool,
        /// The loop, for its `SendFuture`s.
        loop_ref: LoopRef,
    }

    /// A `SendFuture`'s event loop: a weak reference when the loop takes one, so that results
    /// queued for a loop that closed before taking them (sends not awaited when `asyncio.run`
    /// ends) do not keep the loop, its queue and its socket pair alive. The queue holds the
    /// futures from Rust, where the cycle collector cannot see that cycle. A loop without weak
    /// references is held strongly.
    struct LoopRef {
        obj: Py<PyAny>,
        weak: bool,
    }

    static WEAKREF: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

    impl LoopRef {
        fn new(event_loop: &Bound<'_, PyAny>) -> PyResult<LoopRef> {
            let py = event_loop.py();
            let weakref = WEAKREF.import(py, "weakref", "ref")?;
            Ok(match weakref.call1((event_loop,)) {
                Ok(r) => LoopRef {
                    obj: r.unbind(),
                    weak: true,
                },
                Err(_) => LoopRef {
                    obj: event_loop.clone().unbind(),
                    weak: false,
                },
            })
        }

        fn clone_ref(&self, py: Python<'_>) -> LoopRef {
            LoopRef {
                obj: self.obj.clone_ref(py),
                weak: self.weak,
            }
        }

        /// The loop; `RuntimeError` when it is gone.
        fn get<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
            let obj = self.obj.bind(py);
            if !self.weak {
                return Ok(obj.clone());
            }
            let l = obj.call0()?;
            if l.is_none() {
                return Err(PyRuntimeError::new_err(
                    "onceflow: the event loop of this SendFuture is gone",
                ));
            }
            Ok(l)
        }
    }

    /// Bumped in a child process after `os.fork()` (`os.register_at_fork`), so a loop's waker
    /// made before the fork (its socket pair and runtime are the parent's) is replaced, without
    /// a `getpid` system call per send.
    pub(super) static FORK_EPOCH: AtomicU64 = AtomicU64::new(0);
    static AT_FORK: PyOnceLock<()> = PyOnceLock::new();

    pub(super) fn watch_forks(py: Python<'_>) -> PyResult<()> {
        AT_FORK.get_or_try_init(py, || -> PyResult<()> {
            let bump = PyCFunction::new_closure(
                py,
                None,
                None,
                |_args: &Bound<'_, pyo3::types::PyTuple>,
                 _kwargs: Option<&Bound<'_, pyo3::types::PyDict>>| {
                    FORK_EPOCH.fetch_add(1, Ordering::AcqRel);
                },
            )?;
            let kwargs = pyo3::types::PyDict::new(py);
            kwargs.set_item("after_in_child", bump)?;
            py.import("os")?
                .getattr("register_at_fork")?
                .call((), Some(&kwargs))?;
            Ok(())
        })?;
        Ok(())
    }

    #[pymethods]
    impl LoopWaker {
        /// The loop's reader callback: takes the wake-up bytes and schedules [`process`]
        /// with `loop.call_soon` (once until it starts).
        ///
        /// The queued work is not done here: it resumes tasks, whose code may run the loop
        /// nested (`nest_asyncio`, as in Jupyter), and the nested loop then runs this reader
        /// again, whose handle's context asyncio cannot enter twice: it raised "cannot enter
        /// context" at every turn and the loop spun. A `call_soon` handle has a context of its
        /// own each time.
        ///
        /// [`process`]: LoopWaker::process
        fn drain(slf: &Bound<'_, Self>) -> PyResult<()> {
            let this = slf.get();
            // Read the wake-up bytes before `process` takes the queue: an entry queued after
            // the take then finds the queue empty and writes a new byte, so none is left
            // unwoken.
            let mut buf = [0u8; 512];
            loop {
                match (&this.rx).read(&mut buf) {
                    Ok(n) if n == buf.len() => continue,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    _ => break,
                }
            }
            if this.scheduled.swap(true, Ordering::AcqRel) {
                return Ok(());
            }
            let py = slf.py();
            let scheduled = running_loop(py).and_then(|l| {
                l.call_method1(
                    intern!(py, "call_soon"),
                    (slf.getattr(intern!(py, "process"))?,),
                )
            });
            if scheduled.is_err() {
                this.scheduled.store(false, Ordering::Release);
            }
            scheduled.map(drop)
        }

        /// Resolves every queued future and polls every woken send (scheduled by `drain`).
        fn process(&self, py: Python<'_>) {
            self.scheduled.store(false, Ordering::Release);
            let items = std::mem::take(&mut *self.shared.queue.lock());
            if items.is_empty() {
                return;
            }
            let _entered = self.shared.runtime.enter();
            for item in items {
                match item {
                    Item::Done(fut, convert) => {
                        let fut = fut.bind(py);
                        if let Err(e) = resolve(py, fut, convert) {
                            e.write_unraisable(py, Some(fut));
                        }
                    }
                    Item::Poll(task) => task.drive(py),
                    Item::Run(complete) => complete(py),
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

    /// The running loop's waker as last found on this thread (see [`current`]).
    struct Current {
        /// What identifies the running loop cheaply (see [`current`]); held, so no other object
        /// takes its address.
        key: Py<PyAny>,
        waker: Option<Py<LoopWaker>>,
        /// [`FORK_EPOCH`] when found.
        epoch: u64,
    }

    thread_local! {
        static CURRENT: std::cell::RefCell<Option<Current>> = const { std::cell::RefCell::new(None) };
    }

    /// The waker of this thread's running loop (`None` when the loop cannot hold one; the loop
    /// itself is the waker's `loop_ref`). Raises as [`running_loop`] does outside a coroutine.
    ///
    /// The waker found last on this thread is taken again while the running loop is the same, which is told by an object compared by identity:
    /// - from CPython 3.12, the running loop itself: `asyncio.get_running_loop()` is cheap there;
    /// - on CPython 3.10 and 3.11, whose `get_running_loop()` makes a `getpid` system call per
    ///   call (a tenth of a single send's time on the loop thread), the holder object that
    ///   asyncio's C `_set_running_loop` stores in the thread state dict under
    ///   `__asyncio_running_event_loop__`: it makes a new one each time the running loop is set
    ///   or cleared, nested loops (`nest_asyncio`) included. Without it (asyncio's pure-Python
    ///   fallback), the loop is asked every time.
    ///
    /// A fork bumps [`FORK_EPOCH`], which drops the entry (a child inherits the holder of a loop
    /// that is not running there).
    pub fn current(py: Python<'_>) -> PyResult<Option<Py<LoopWaker>>> {
        let epoch = FORK_EPOCH.load(Ordering::Acquire);
        static CHEAP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let cheap = *CHEAP.get_or_init(|| py.version_info() >= (3, 12));
        let (key, running) = if cheap {
            let l = running_loop(py)?;
            (Some(l.clone()), Some(l))
        } else {
            (running_loop_holder(py), None)
        };
        if let Some(key) = &key {
            let cached = CURRENT.with_borrow(|c| {
                c.as_ref()
                    .filter(|c| c.epoch == epoch && c.key.is(key))
                    .map(|c| c.waker.as_ref().map(|w| w.clone_ref(py)))
            });
            if let Some(waker) = cached {
                return Ok(waker);
            }
        }
        let event_loop = match running {
            Some(l) => l,
            None => running_loop(py)?,
        };
        let waker = waker_for(py, &event_loop)?;
        let entry = key.map(|key| Current {
            key: key.unbind(),
            waker: waker.as_ref().map(|w| w.clone_ref(py)),
            epoch,
        });
        // The entry replaced (or dropped) is released after the borrow ends: its `Drop` may
        // run Python code.
        let old = CURRENT.with_borrow_mut(|c| std::mem::replace(c, entry));
        drop(old);
        Ok(waker)
    }

    /// The running-loop holder of CPython 3.10 / 3.11's C asyncio in this thread's state dict
    /// (see [`current`]), if there is one.
    #[allow(unsafe_code)]
    fn running_loop_holder(py: Python<'_>) -> Option<Bound<'_, PyAny>> {
        // SAFETY: the GIL is held (`py`); the result is a borrowed reference or NULL, taken as
        // a new strong reference at once.
        let dict = unsafe {
            let d = pyo3::ffi::PyThreadState_GetDict();
            if d.is_null() {
                return None;
            }
            Bound::from_borrowed_ptr(py, d)
        };
        dict.cast_into::<pyo3::types::PyDict>()
            .ok()?
            .get_item(intern!(py, "__asyncio_running_event_loop__"))
            .ok()
            .flatten()
    }

    static GET_RUNNING_LOOP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

    /// `asyncio.get_running_loop()`. Outside a coroutine, a RuntimeError that says what to do
    /// instead (asyncio's own "no running event loop" chained as its cause).
    fn running_loop(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        GET_RUNNING_LOOP
            .import(py, "asyncio", "get_running_loop")?
            .call0()
            .map_err(|e| {
                if !e.is_instance_of::<pyo3::exceptions::PyRuntimeError>(py) {
                    return e;
                }
                let err = pyo3::exceptions::PyRuntimeError::new_err(
                    "no running event loop: onceflow's awaitable methods (send, send_batch, \
                     commit, flush, ...) are called from a coroutine under a running asyncio \
                     loop (asyncio.run); without one, use the blocking facade \
                     (from onceflow import sync) or Producer.send_nowait",
                );
                err.set_cause(py, Some(e));
                err
            })
    }

    /// The loop's waker, created and registered on first use; `None` when the loop cannot
    /// hold one.
    fn waker_for(py: Python<'_>, event_loop: &Bound<'_, PyAny>) -> PyResult<Option<Py<LoopWaker>>> {
        let epoch = FORK_EPOCH.load(Ordering::Acquire);
        if let Ok(w) = event_loop.getattr(intern!(py, ATTR)) {
            if let Ok(w) = w.cast_into::<LoopWaker>() {
                if w.get().epoch == epoch {
                    return Ok(Some(w.unbind()));
                }
            }
        }
        watch_forks(py)?;
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
                    runtime: onceflow_bindings::runtime().handle().clone(),
                }),
                rx,
                epoch,
                scheduled: AtomicBool::new(false),
                loop_ref: LoopRef::new(event_loop)?,
            },
        )?;
        if event_loop.setattr(intern!(py, ATTR), &waker).is_err() {
            return Ok(None);
        }
        let drain = waker.bind(py).getattr(intern!(py, "drain"))?;
        event_loop.call_method1(intern!(py, "add_reader"), (fd, drain))?;
        Ok(Some(waker))
    }

    /// An `asyncio.Future` of `waker`'s loop resolved with `convert(fut.await)`, `fut` running
    /// on the bindings' runtime (see [`super::deliver`]).
    pub fn spawn<'py, F, R>(
        py: Python<'py>,
        waker: Py<LoopWaker>,
        fut: F,
        convert: Convert<R>,
        cancellable: bool,
    ) -> PyResult<Bound<'py, PyAny>>
    where
        F: Future<Output = R> + Send + 'static,
        R: Send + 'static,
    {
        let py_fut = waker
            .get()
            .loop_ref
            .get(py)?
            .call_method0(intern!(py, "create_future"))?;
        let shared = waker.get().shared.clone();
        let handle = py_fut.clone().unbind();
        let task = onceflow_bindings::runtime().spawn(async move {
            // A panic must still resolve the awaitable, or its caller would wait forever.
            let done: Resolve = match std::panic::AssertUnwindSafe(fut).catch_unwind().await {
                Ok(r) => Box::new(move |py: Python<'_>| convert(py, r)),
                Err(panic) => {
                    let what = panic_message(panic.as_ref());
                    Box::new(move |_: Python<'_>| Err(panicked(&what)))
                }
            };
            shared.push(Item::Done(handle, done));
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

    fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
        panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default()
    }

    fn panicked(what: &str) -> PyErr {
        PyRuntimeError::new_err(format!("onceflow: a native task panicked: {what}"))
    }

    // ---- The awaitable of one send --------------------------------------------------------

    /// Where a [`SendFuture`] stands.
    enum Outcome {
        Pending,
        /// Its result (a `Delivery`).
        Value(Py<PyAny>),
        /// The exception it raises.
        Failed(Py<PyAny>),
        /// Cancelled, with the optional message of `cancel(msg)`.
        Cancelled(Option<Py<PyAny>>),
    }

    /// The awaitable of one `send`: resolves to the record's `Delivery` once the platform
    /// acknowledged it, or raises the send's `OnceflowError`. It speaks asyncio's Future
    /// protocol (`await`, `done`, `result`, `exception`, `add_done_callback`,
    /// `remove_done_callback`, `cancel`, `cancelled`, `get_loop`), so `asyncio.gather`,
    /// `asyncio.wait`, `asyncio.wait_for` and `asyncio.ensure_future` take it as a future (no
    /// task each). It belongs to the event loop that was running at the `send` call; use it on
    /// that loop's thread. Cancelling it (or the task awaiting it) drops the result only: the
    /// record is sent anyway. Done-callbacks run on the loop thread, each in its context (the
    /// current one at `add_done_callback` unless `context=` is given): called when the result
    /// arrives, in arrival order; scheduled with `loop.call_soon` when the future is already
    /// done or is cancelled, as asyncio's are.
    #[pyclass(module = "onceflow._native")]
    pub struct SendFuture {
        outcome: Outcome,
        /// Done-callbacks with their `contextvars.Context` (most futures get one at most).
        callbacks: Callbacks,
        event_loop: LoopRef,
        /// asyncio's marker of a future-like object; `True` while a task waits on it.
        #[pyo3(get, set, name = "_asyncio_future_blocking")]
        blocking: bool,
    }

    /// A done-callback and the `contextvars.Context` it runs in: `None` when it was registered
    /// where no context variable was set (see [`callback_context`]).
    type Callback = (Py<PyAny>, Option<Py<PyAny>>);

    /// Done-callbacks in registration order: the first without an allocation.
    #[derive(Default)]
    struct Callbacks {
        first: Option<Callback>,
        more: Vec<Callback>,
    }

    impl Callbacks {
        fn push(&mut self, cb: Callback) {
            if self.first.is_none() && self.more.is_empty() {
                self.first = Some(cb);
            } else {
                self.more.push(cb);
            }
        }

        fn is_empty(&self) -> bool {
            self.first.is_none() && self.more.is_empty()
        }

        fn iter(&self) -> impl Iterator<Item = &Callback> {
            self.first.iter().chain(self.more.iter())
        }

        fn take(&mut self) -> impl Iterator<Item = Callback> {
            let first = self.first.take();
            let more = std::mem::take(&mut self.more);
            first.into_iter().chain(more)
        }
    }

    static ASYNCIO_ERRORS: PyOnceLock<(Py<PyAny>, Py<PyAny>)> = PyOnceLock::new();
    static COPY_CONTEXT: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

    /// `(asyncio.CancelledError, asyncio.InvalidStateError)`.
    fn asyncio_errors(py: Python<'_>) -> PyResult<&(Py<PyAny>, Py<PyAny>)> {
        ASYNCIO_ERRORS.get_or_try_init(py, || {
            let m = py.import("asyncio")?;
            Ok((
                m.getattr("CancelledError")?.unbind(),
                m.getattr("InvalidStateError")?.unbind(),
            ))
        })
    }

    fn cancelled_error(py: Python<'_>, msg: &Option<Py<PyAny>>) -> PyErr {
        let made = asyncio_errors(py).and_then(|(cancelled, _)| match msg {
            Some(m) => cancelled.bind(py).call1((m.clone_ref(py),)),
            None => cancelled.bind(py).call0(),
        });
        match made {
            Ok(e) => PyErr::from_value(e),
            Err(e) => e,
        }
    }

    fn invalid_state(py: Python<'_>, what: &str) -> PyErr {
        match asyncio_errors(py).and_then(|(_, invalid)| invalid.bind(py).call1((what,))) {
            Ok(e) => PyErr::from_value(e),
            Err(e) => e,
        }
    }

    /// Takes `obj` out of the cycle collector's lists. Objects that cannot be in a reference
    /// cycle (a `Delivery`, a pending `SendFuture`) then cost nothing at each collection;
    /// with thousands of sends in flight, collections traversing them took a tenth of a
    /// single send's time on the loop thread.
    #[allow(unsafe_code)]
    pub fn untrack(obj: &Bound<'_, PyAny>) {
        // SAFETY: `obj` is a live object of a GC type (every `#[pyclass]`); untracking an
        // untracked object does nothing.
        unsafe { pyo3::ffi::PyObject_GC_UnTrack(obj.as_ptr().cast()) }
    }

    /// Puts `obj` back in the cycle collector's lists (see [`untrack`]).
    #[allow(unsafe_code)]
    fn track(obj: &Bound<'_, PyAny>) {
        // SAFETY: `obj` is a live object of a GC type; tracking a tracked object aborts, so it
        // is checked first (the GIL is held: nothing tracks it meanwhile).
        unsafe {
            if pyo3::ffi::PyObject_GC_IsTracked(obj.as_ptr()) == 0 {
                pyo3::ffi::PyObject_GC_Track(obj.as_ptr().cast());
            }
        }
    }

    fn copy_context(py: Python<'_>) -> PyResult<Py<PyAny>> {
        COPY_CONTEXT
            .import(py, "contextvars", "copy_context")?
            .call0()
            .map(Bound::unbind)
    }

    static CONTEXT_TYPE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

    /// `contextvars.Context()`: a context where no variable is set.
    fn new_empty_context(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        CONTEXT_TYPE.import(py, "contextvars", "Context")?.call0()
    }

    /// The context of a done-callback registered now: `context` when given, else a copy of the
    /// current one, as asyncio's futures take, or `None` when no variable is set in it.
    ///
    /// A callback registered where no variable is set runs in an empty context
    /// ([`run_in_empty_context`]): the same variables (none), without a copy kept per pending
    /// future. Those copies are GC-tracked Python objects the cycle collector cannot be kept
    /// from (CPython's `Context` deallocation expects them tracked); with thousands of sends in
    /// flight, collections traversing them took a seventh of a single send's time on the loop
    /// thread.
    fn callback_context(py: Python<'_>, context: Option<Py<PyAny>>) -> PyResult<Option<Py<PyAny>>> {
        if let Some(c) = context.filter(|c| !c.is_none(py)) {
            return Ok(Some(c));
        }
        let copy = copy_context(py)?;
        Ok((copy.bind(py).len()? > 0).then_some(copy))
    }

    /// An empty context and its bound `run` method.
    struct EmptyContext {
        context: Py<PyAny>,
        run: Py<PyAny>,
    }

    thread_local! {
        /// An empty context for callbacks registered where no variable was set, reused while
        /// the callbacks it ran left it empty.
        static EMPTY_CONTEXT: std::cell::RefCell<Option<EmptyContext>> = const { std::cell::RefCell::new(None) };
    }

    /// Runs `callback(fut)` in an empty context: the thread's kept one (taken out while the
    /// callback runs, so a nested call makes its own), kept again when the callback left no
    /// variable set in it. Each callback thus starts where no variable is set, as in a copy of
    /// an empty context.
    fn run_in_empty_context(
        py: Python<'_>,
        callback: &Py<PyAny>,
        fut: &Bound<'_, SendFuture>,
    ) -> PyResult<()> {
        let kept = EMPTY_CONTEXT.with_borrow_mut(Option::take);
        let empty = match kept {
            Some(e) => e,
            None => {
                let context = new_empty_context(py)?;
                let run = context.getattr(intern!(py, "run"))?.unbind();
                EmptyContext {
                    context: context.unbind(),
                    run,
                }
            }
        };
        let out = empty.run.bind(py).call1((callback, fut)).map(drop);
        if empty.context.bind(py).len().is_ok_and(|n| n == 0) {
            let old = EMPTY_CONTEXT.with_borrow_mut(|c| c.replace(empty));
            drop(old);
        }
        out
    }

    /// `loop.call_soon(callback, fut, context=context)` (a new empty context for `None`).
    fn schedule(
        event_loop: &Bound<'_, PyAny>,
        callback: Py<PyAny>,
        fut: &Bound<'_, SendFuture>,
        context: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        let py = event_loop.py();
        let context = match context {
            Some(c) => c.into_bound(py),
            None => new_empty_context(py)?,
        };
        let kwargs = pyo3::types::PyDict::new(py);
        kwargs.set_item(intern!(py, "context"), context)?;
        event_loop.call_method(intern!(py, "call_soon"), (callback, fut), Some(&kwargs))?;
        Ok(())
    }

    /// Runs a done-callback now, in its context; an exception goes to the loop's exception
    /// handler, as one raised by a `call_soon` callback does.
    fn run_callback(
        event_loop: &LoopRef,
        callback: Py<PyAny>,
        fut: &Bound<'_, SendFuture>,
        context: Option<Py<PyAny>>,
    ) {
        let py = fut.py();
        let ran = match context {
            Some(c) => c
                .bind(py)
                .call_method1(intern!(py, "run"), (&callback, fut))
                .map(drop),
            None => run_in_empty_context(py, &callback, fut),
        };
        let Err(e) = ran else {
            return;
        };
        let report = || -> PyResult<()> {
            let ctx = pyo3::types::PyDict::new(py);
            ctx.set_item(
                "message",
                format!("Exception in callback {}", callback.bind(py).repr()?),
            )?;
            ctx.set_item("exception", e.clone_ref(py).into_value(py))?;
            ctx.set_item("future", fut)?;
            event_loop
                .get(py)?
                .call_method1(intern!(py, "call_exception_handler"), (ctx,))?;
            Ok(())
        };
        if let Err(e2) = report() {
            e2.write_unraisable(py, Some(fut.as_any()));
        }
    }

    /// Sets the result (or exception) of a pending `SendFuture` and runs its callbacks; a
    /// cancelled one drops it.
    fn complete(fut: &Bound<'_, SendFuture>, result: PyResult<Py<PyAny>>) {
        let py = fut.py();
        let (callbacks, event_loop) = {
            let Ok(mut this) = fut.try_borrow_mut() else {
                PyRuntimeError::new_err("onceflow: SendFuture busy while its result arrived")
                    .write_unraisable(py, Some(fut.as_any()));
                return;
            };
            if !matches!(this.outcome, Outcome::Pending) {
                return;
            }
            this.outcome = match result {
                Ok(v) => Outcome::Value(v),
                Err(e) => {
                    // An exception's traceback can lead back here (a frame holding the
                    // future): a cycle only the collector can free.
                    track(fut.as_any());
                    Outcome::Failed(e.into_value(py).into_any())
                }
            };
            if this.callbacks.is_empty() {
                return;
            }
            (this.callbacks.take(), this.event_loop.clone_ref(py))
        };
        for (callback, context) in callbacks {
            run_callback(&event_loop, callback, fut, context);
        }
    }

    impl SendFuture {
        /// A pending future of `waker`'s loop.
        ///
        /// It starts outside the cycle collector's lists ([`untrack`]): while pending, the
        /// references it holds (its loop, its done-callbacks) are given up when it completes,
        /// which every send does, and a `Delivery` holds nothing. It is tracked again when it
        /// gets an exception (or a cancel message), which can hold a cycle back to it.
        fn pending<'py>(py: Python<'py>, waker: &LoopWaker) -> PyResult<Bound<'py, SendFuture>> {
            let fut = Bound::new(
                py,
                SendFuture {
                    outcome: Outcome::Pending,
                    callbacks: Callbacks::default(),
                    event_loop: waker.loop_ref.clone_ref(py),
                    blocking: false,
                },
            )?;
            untrack(fut.as_any());
            Ok(fut)
        }

        fn outcome_result(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
            match &self.outcome {
                Outcome::Pending => Err(invalid_state(py, "Result is not set.")),
                Outcome::Value(v) => Ok(v.clone_ref(py)),
                Outcome::Failed(e) => Err(PyErr::from_value(e.bind(py).clone())),
                Outcome::Cancelled(msg) => Err(cancelled_error(py, msg)),
            }
        }
    }

    #[pymethods]
    impl SendFuture {
        fn __traverse__(&self, visit: pyo3::gc::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
            match &self.outcome {
                Outcome::Value(v) | Outcome::Failed(v) | Outcome::Cancelled(Some(v)) => {
                    visit.call(v)?
                }
                Outcome::Pending | Outcome::Cancelled(None) => {}
            }
            for (callback, context) in self.callbacks.iter() {
                visit.call(callback)?;
                visit.call(context)?;
            }
            visit.call(&self.event_loop.obj)
        }

        /// Breaks a cycle through this future (run by the cycle collector only): drops its
        /// done-callbacks and its exception.
        fn __clear__(&mut self) {
            drop(self.callbacks.take());
            if matches!(
                self.outcome,
                Outcome::Failed(_) | Outcome::Cancelled(Some(_))
            ) {
                self.outcome = Outcome::Cancelled(None);
            }
        }

        /// Whether the send finished (acknowledged or failed) or the future was cancelled.
        fn done(&self) -> bool {
            !matches!(self.outcome, Outcome::Pending)
        }

        /// Whether the future was cancelled (the record is sent regardless).
        fn cancelled(&self) -> bool {
            matches!(self.outcome, Outcome::Cancelled(_))
        }

        /// The `asyncio.CancelledError` (with the `cancel(msg)` message) a cancelled future
        /// raises. Not public API: `asyncio.gather` calls it on a cancelled child (3.10+), and
        /// without it a gather over sends with one cancelled never finished.
        fn _make_cancelled_error(&self, py: Python<'_>) -> Py<PyAny> {
            let msg = match &self.outcome {
                Outcome::Cancelled(msg) => msg.as_ref().map(|m| m.clone_ref(py)),
                _ => None,
            };
            cancelled_error(py, &msg).into_value(py).into_any()
        }

        /// The message given to `cancel(msg)`, or `None` (read by `asyncio.gather` of 3.10 and
        /// 3.11 on a cancelled child).
        #[getter]
        fn _cancel_message(&self, py: Python<'_>) -> Option<Py<PyAny>> {
            match &self.outcome {
                Outcome::Cancelled(msg) => msg.as_ref().map(|m| m.clone_ref(py)),
                _ => None,
            }
        }

        /// The `Delivery`; raises the send's exception, `asyncio.CancelledError` when
        /// cancelled, `asyncio.InvalidStateError` while pending.
        fn result(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
            self.outcome_result(py)
        }

        /// The send's exception (`None` when delivered); raises `asyncio.CancelledError` when
        /// cancelled, `asyncio.InvalidStateError` while pending.
        fn exception(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
            match &self.outcome {
                Outcome::Pending => Err(invalid_state(py, "Exception is not set.")),
                Outcome::Value(_) => Ok(None),
                Outcome::Failed(e) => Ok(Some(e.clone_ref(py))),
                Outcome::Cancelled(msg) => Err(cancelled_error(py, msg)),
            }
        }

        /// Calls `fn(future)` on the loop thread when the future is done (see the class).
        #[pyo3(signature = (r#fn, *, context=None))]
        fn add_done_callback(
            slf: &Bound<'_, Self>,
            r#fn: Py<PyAny>,
            context: Option<Py<PyAny>>,
        ) -> PyResult<()> {
            let py = slf.py();
            let context = callback_context(py, context)?;
            let event_loop = {
                let mut this = slf.borrow_mut();
                if matches!(this.outcome, Outcome::Pending) {
                    this.callbacks.push((r#fn, context));
                    return Ok(());
                }
                this.event_loop.clone_ref(py)
            };
            schedule(&event_loop.get(py)?, r#fn, slf, context)
        }

        /// Removes every registration of `fn`; returns how many were removed.
        fn remove_done_callback(slf: &Bound<'_, Self>, r#fn: &Bound<'_, PyAny>) -> PyResult<usize> {
            let py = slf.py();
            let callbacks: Vec<Callback> = slf.borrow_mut().callbacks.take().collect();
            let before = callbacks.len();
            let mut kept = Vec::with_capacity(before);
            let mut failed = None;
            for (callback, context) in callbacks {
                let same = failed.is_none() && {
                    let cb = callback.bind(py);
                    cb.is(r#fn)
                        || cb.eq(r#fn).unwrap_or_else(|e| {
                            failed = Some(e);
                            false
                        })
                };
                if !same {
                    kept.push((callback, context));
                }
            }
            let removed = before - kept.len();
            // Callbacks added meanwhile (by an `__eq__`) go after the kept ones.
            let mut this = slf.borrow_mut();
            let added: Vec<Callback> = this.callbacks.take().collect();
            for cb in kept.into_iter().chain(added) {
                this.callbacks.push(cb);
            }
            match failed {
                Some(e) => Err(e),
                None => Ok(removed),
            }
        }

        /// Marks the future cancelled and schedules its callbacks; `False` when it was already
        /// done. The record is sent anyway: only its result is dropped.
        #[pyo3(signature = (msg=None))]
        fn cancel(slf: &Bound<'_, Self>, msg: Option<Py<PyAny>>) -> PyResult<bool> {
            let py = slf.py();
            let (callbacks, event_loop) = {
                let mut this = slf.borrow_mut();
                if !matches!(this.outcome, Outcome::Pending) {
                    return Ok(false);
                }
                if msg.is_some() {
                    track(slf.as_any());
                }
                this.outcome = Outcome::Cancelled(msg);
                this.blocking = false;
                (this.callbacks.take(), this.event_loop.clone_ref(py))
            };
            let event_loop = event_loop.get(py)?;
            for (callback, context) in callbacks {
                schedule(&event_loop, callback, slf, context)?;
            }
            Ok(true)
        }

        /// The event loop this future belongs to; `RuntimeError` once it is gone.
        fn get_loop<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
            self.event_loop.get(py)
        }

        /// `SendFuture[Delivery]` in annotations, as `asyncio.Future[T]`.
        #[classmethod]
        fn __class_getitem__(
            cls: &Bound<'_, pyo3::types::PyType>,
            _item: &Bound<'_, PyAny>,
        ) -> Py<pyo3::types::PyType> {
            cls.clone().unbind()
        }

        fn __await__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
            slf
        }

        fn __iter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
            slf
        }

        /// One step of `await`: yields the future itself while it is pending (asyncio's task
        /// then waits for its done-callback), then ends with the result or raises.
        fn __next__(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
            let py = slf.py();
            let mut this = slf.borrow_mut();
            match &this.outcome {
                Outcome::Pending if this.blocking => {
                    Err(PyRuntimeError::new_err("await wasn't used with future"))
                }
                Outcome::Pending => {
                    this.blocking = true;
                    Ok(slf.clone().into_any().unbind())
                }
                Outcome::Value(v) => Err(pyo3::exceptions::PyStopIteration::new_err((
                    v.clone_ref(py),
                ))),
                _ => Err(this.outcome_result(py).err().unwrap_or_else(|| {
                    PyRuntimeError::new_err("onceflow: SendFuture in no state")
                })),
            }
        }

        fn __repr__(&self) -> &'static str {
            match self.outcome {
                Outcome::Pending => "<SendFuture pending>",
                Outcome::Value(_) => "<SendFuture finished>",
                Outcome::Failed(_) => "<SendFuture finished with an exception>",
                Outcome::Cancelled(_) => "<SendFuture cancelled>",
            }
        }
    }

    // ---- Driving a send without a task -----------------------------------------------------

    /// A queued send the loop's drain polls again.
    trait Drive: Send + Sync {
        fn drive(self: Arc<Self>, py: Python<'_>);
        /// The loop's queue is gone: run the send to its end on the runtime, dropping its
        /// result (a send is never undone).
        fn orphan(&self);
    }

    struct Running<F> {
        fut: std::pin::Pin<Box<F>>,
        target: Py<SendFuture>,
    }

    /// One send's future, polled on the loop thread: first in `send`, then by the loop's drain
    /// each time its waker queued it.
    struct SendTask<F: Future> {
        running: Mutex<Option<Running<F>>>,
        convert: Convert<F::Output>,
        shared: Weak<Shared>,
        /// In the loop's queue (or being polled): a wake-up needs no new entry.
        queued: AtomicBool,
    }

    impl<F> SendTask<F>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        /// Polls once (inside the runtime's context, entered by the caller); resolves the
        /// `SendFuture` when the send finished.
        fn poll_once(self: &Arc<Self>, py: Python<'_>) {
            self.queued.store(false, Ordering::Release);
            let waker = Waker::from(self.clone());
            let mut cx = Context::from_waker(&waker);
            let mut slot = self.running.lock();
            let Some(running) = slot.as_mut() else {
                return;
            };
            let polled =
                std::panic::catch_unwind(AssertUnwindSafe(|| running.fut.as_mut().poll(&mut cx)));
            let result = match polled {
                Ok(Poll::Pending) => return,
                Ok(Poll::Ready(r)) => Ok(r),
                Err(panic) => Err(panic_message(panic.as_ref())),
            };
            let Some(Running { fut, target }) = slot.take() else {
                return;
            };
            drop(slot);
            drop(fut);
            let value = match result {
                Ok(r) => (self.convert)(py, r),
                Err(what) => Err(panicked(&what)),
            };
            complete(target.bind(py), value);
        }
    }

    impl<F> Drive for SendTask<F>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        fn drive(self: Arc<Self>, py: Python<'_>) {
            self.poll_once(py);
        }

        fn orphan(&self) {
            if let Some(Running { fut, target }) = self.running.lock().take() {
                drop(target);
                onceflow_bindings::runtime().spawn(async move {
                    let _ = fut.await;
                });
            }
        }
    }

    impl<F> Wake for SendTask<F>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }

        fn wake_by_ref(self: &Arc<Self>) {
            if self.queued.swap(true, Ordering::AcqRel) {
                return;
            }
            match self.shared.upgrade() {
                Some(shared) => shared.push(Item::Poll(self.clone())),
                None => self.orphan(),
            }
        }
    }

    impl Drop for Shared {
        fn drop(&mut self) {
            for item in self.queue.get_mut().drain(..) {
                if let Item::Poll(task) = item {
                    task.orphan();
                }
            }
        }
    }

    pub fn send<'py, F, R>(
        py: Python<'py>,
        waker: &Py<LoopWaker>,
        fut: F,
        convert: Convert<R>,
    ) -> PyResult<Bound<'py, PyAny>>
    where
        F: Future<Output = R> + Send + 'static,
        R: Send + 'static,
    {
        let target = SendFuture::pending(py, waker.get())?;
        let task = Arc::new(SendTask {
            running: Mutex::new(Some(Running {
                fut: Box::pin(fut),
                target: target.clone().unbind(),
            })),
            convert,
            shared: Arc::downgrade(&waker.get().shared),
            queued: AtomicBool::new(true),
        });
        let _entered = waker.get().shared.runtime.enter();
        task.poll_once(py);
        Ok(target.into_any())
    }

    // ---- SendFutures completed off the loop -------------------------------------------------

    /// The completion side of a pending [`SendFuture`] made by [`pending`]: sendable to any
    /// thread, it hands a result to the future's loop through [`complete_all`].
    pub struct Completion {
        target: Py<SendFuture>,
        queue: Weak<Shared>,
    }

    /// A pending `SendFuture` of the running loop and its [`Completion`]; `None` when the loop
    /// cannot hold onceflow's queue (no attribute dict). Raises `RuntimeError` outside a
    /// coroutine (no running loop).
    pub fn pending(py: Python<'_>) -> PyResult<Option<(Bound<'_, PyAny>, Completion)>> {
        let Some(waker) = current(py)? else {
            return Ok(None);
        };
        let target = SendFuture::pending(py, waker.get())?;
        let completion = Completion {
            target: target.clone().unbind(),
            queue: Arc::downgrade(&waker.get().shared),
        };
        Ok(Some((target.into_any(), completion)))
    }

    /// Hands results to their `SendFuture`s: one queue entry per run of futures of the same
    /// loop, so a batch costs its loop one wake-up; the loop's drain converts each result with
    /// `convert` and completes its future (running its done-callbacks). Called from any thread,
    /// without the GIL. Futures whose loop is gone are dropped with their results.
    pub fn complete_all<R: Send + 'static>(done: Vec<(Completion, R)>, convert: Convert<R>) {
        type Run<R> = (Weak<Shared>, Vec<(Py<SendFuture>, R)>);
        let mut runs: Vec<Run<R>> = Vec::new();
        for (c, r) in done {
            match runs.last_mut() {
                Some((queue, items)) if Weak::ptr_eq(queue, &c.queue) => items.push((c.target, r)),
                _ => runs.push((c.queue, vec![(c.target, r)])),
            }
        }
        for (queue, items) in runs {
            if let Some(shared) = queue.upgrade() {
                shared.push(Item::Run(Box::new(move |py: Python<'_>| {
                    for (target, r) in items {
                        complete(target.bind(py), convert(py, r));
                    }
                })));
            }
        }
    }
}
