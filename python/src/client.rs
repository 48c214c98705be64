//! `connect`, `dedup_store` and the handles: `Client`, `Producer`, `Transaction`, `Consumer`,
//! `Admin`, `DedupStore`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use onceflow::{
    ConsumerConfig, DedupStore as RsDedupStore, Error, ErrorKind, Isolation, ProducerConfig,
    TopicPartition, TopicSpec,
};
use onceflow_bindings::raw_options::raw_options;
use onceflow_bindings::settings::{Language, Value};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt, PyMapping, PyString};

use crate::convert::{self, Delivery, Lag, Message, MessageBatch, MessageIter, Seconds};
use crate::errors::to_pyerr;
use crate::{awaitable, awaitable_py, wake};
use onceflow_bindings::yielded::{Progress, Yielded};

/// The most messages one `poll` may ask for (a bound for bad input, far above any batch).
const MAX_POLL: i64 = 1_000_000_000;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(connect, m)?)?;
    m.add_function(wrap_pyfunction!(dedup_store, m)?)?;
    m.add_class::<Client>()?;
    m.add_class::<Producer>()?;
    m.add_class::<Transaction>()?;
    m.add_class::<Consumer>()?;
    m.add_class::<Admin>()?;
    m.add_class::<DedupStore>()?;
    m.add_class::<Message>()?;
    m.add_class::<MessageBatch>()?;
    m.add_class::<MessageIter>()?;
    m.add_class::<Delivery>()?;
    m.add_class::<Deliveries>()?;
    m.add_class::<Lag>()?;
    #[cfg(unix)]
    m.add_class::<wake::SendFuture>()?;
    Ok(())
}

/// Connects to the platform named by the URL's scheme (`memory://`, `kafka://`, `nats://`,
/// `tls://`, `pulsar://`, `pulsar+ssl://`, `kinesis://`); awaitable, resolves to a `Client`.
/// `options` are added to the URL's query, so secrets need not be in the URL; a value is a
/// `str`, a `bool` (sent as `"true"` / `"false"`) or a number (`500` as `"500"`), another type a
/// `TypeError` naming the key and the type, never the value.
/// Raises `ConnectError` (code `ONCEFLOW_CONNECT`) within seconds when no Kafka or Pulsar
/// broker of the URL answers, `AuthError` (`ONCEFLOW_AUTH`) when the server refuses the
/// credentials or certificate, and `ConfigError` (`ONCEFLOW_CONFIG`) for a malformed URL.
#[pyfunction]
#[pyo3(signature = (url, options=None))]
fn connect<'py>(
    py: Python<'py>,
    url: String,
    options: Option<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let options = self::options(options.as_ref())?;
    awaitable(py, async move {
        onceflow::connect_with(&url, options.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .await
            .map(|inner| Client { inner })
    })
}

/// Opens a dedup store by URL: `memory://`, or a file path (embedded SQLite).
#[pyfunction]
#[pyo3(signature = (url, window=Seconds(86400.0)))]
fn dedup_store(py: Python<'_>, url: String, window: Seconds) -> PyResult<Bound<'_, PyAny>> {
    let window = convert::seconds("window", window.0)?;
    awaitable(py, async move {
        onceflow::dedup_store(&url, window)
            .await
            .map(|inner| DedupStore { inner, url })
    })
}

/// A dedup (idempotency) store.
#[pyclass(frozen, module = "onceflow._native")]
pub struct DedupStore {
    pub inner: Arc<dyn RsDedupStore>,
    url: String,
}

#[pymethods]
impl DedupStore {
    fn __repr__(&self) -> String {
        // Never the password of a redis:// or postgres:// URL.
        format!("DedupStore({:?})", onceflow::redact_credentials(&self.url))
    }
}

/// A connected platform.
#[pyclass(frozen, module = "onceflow._native")]
pub struct Client {
    inner: onceflow::Client,
}

/// Raw client options from a mapping of `str` keys to `str`, `bool` (`"true"` / `"false"`),
/// `int` (its exact decimal) or `float` values, or a `datetime.timedelta` for a key ending in
/// `_ms` (its whole milliseconds, [`millis_option`]), by the bindings' one rule
/// (`onceflow_bindings::raw_options`). A value of another type (`None`, a list, a dict) is a
/// `TypeError` naming the key and the type, a NaN or infinite float a `ConfigError`; the value
/// itself is never shown (it may be a password).
fn options(o: Option<&Bound<'_, PyAny>>) -> PyResult<BTreeMap<String, String>> {
    let Some(o) = o.filter(|o| !o.is_none()) else {
        return Ok(BTreeMap::new());
    };
    let Ok(map) = o.cast::<PyMapping>() else {
        return Err(PyTypeError::new_err(format!(
            "options: expected a mapping of str to str, bool, int or float, got {}",
            o.get_type().name()?
        )));
    };
    let mut entries = Vec::new();
    for item in map.items()?.iter() {
        let (k, v) = item.extract::<(Bound<'_, PyAny>, Bound<'_, PyAny>)>()?;
        let Ok(key) = k.cast::<PyString>() else {
            return Err(PyTypeError::new_err(format!(
                "options: keys must be str, got {}",
                k.get_type().name()?
            )));
        };
        let key = key.to_str()?.to_string();
        let value = match convert::timedelta_seconds(&v)? {
            Some(seconds) if key.ends_with("_ms") => millis_option(&key, seconds)?,
            _ => option_value(&v)?,
        };
        entries.push((key, value));
    }
    crate::engine::settings_result(raw_options(Language::Python, entries))
}

/// A `datetime.timedelta` given for the raw option `key` ending in `_ms` (JetStream's
/// `ack_wait_ms`, `idle_heartbeat_ms`, ...): its whole milliseconds, so
/// `{"ack_wait_ms": timedelta(seconds=30)}` means 30000. A duration that is negative or not
/// a whole number of milliseconds is a `ConfigError` naming the key. (For another key a
/// timedelta is a `TypeError`, as any other type.)
fn millis_option(key: &str, seconds: f64) -> PyResult<Value> {
    let shown = onceflow::shown(key);
    let ms = seconds * 1000.0;
    let whole = ms.round();
    if !(0.0..=9.0e15).contains(&whole) || (ms - whole).abs() > 1e-6 {
        return Err(crate::errors::config_err(format!(
            "option '{shown}': expected a datetime.timedelta of whole milliseconds from 0, got \
             {seconds} s"
        )));
    }
    Ok(Value::Text(format!("{}", whole as u64)))
}

/// A raw option's value for the bindings' rule. `bool` is checked before `int` (its subclass);
/// an `int` goes as its exact decimal text (as a float it would round past 2**53), which is
/// the text the rule gives a whole number.
fn option_value(v: &Bound<'_, PyAny>) -> PyResult<Value> {
    Ok(if v.is_none() {
        Value::Absent
    } else if let Ok(b) = v.cast::<PyBool>() {
        Value::Bool(b.is_true())
    } else if let Ok(t) = v.cast::<PyString>() {
        Value::Text(t.to_str()?.to_string())
    } else if v.is_instance_of::<PyInt>() {
        Value::Text(
            v.py()
                .get_type::<PyInt>()
                .call_method1("__repr__", (v,))?
                .extract()?,
        )
    } else if v.is_instance_of::<PyFloat>() {
        Value::Number(v.extract::<f64>()?)
    } else {
        Value::Other(v.get_type().name()?.to_string())
    })
}

#[pymethods]
impl Client {
    /// Platform name (`memory`, `kafka`, `jetstream`, ...).
    #[getter]
    fn platform(&self) -> &'static str {
        self.inner.platform()
    }

    /// What the platform can do, as `{capability: bool}`.
    fn capabilities(&self) -> HashMap<&'static str, bool> {
        caps(self.inner.capabilities())
    }

    /// Creates a producer; a `transactional_id` enables `begin()`.
    #[pyo3(signature = (*, transactional_id=None, client_id=None, idempotent=None, options=None))]
    fn producer<'py>(
        &self,
        py: Python<'py>,
        transactional_id: Option<String>,
        client_id: Option<String>,
        idempotent: Option<bool>,
        options: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let client = self.inner.clone();
        let config = ProducerConfig {
            client_id,
            transactional_id,
            idempotent,
            options: self::options(options.as_ref())?,
        };
        let epoch = wake::fork_epoch(py)?;
        awaitable(py, async move {
            client.producer(config).await.map(|inner| Producer {
                inner,
                background: Arc::default(),
                epoch,
            })
        })
    }

    /// Creates a consumer of `group` on `topics`.
    #[pyo3(signature = (group, topics, *, start="committed", isolation="read_committed", client_id=None, session_timeout=None, options=None))]
    #[allow(clippy::too_many_arguments)]
    fn consumer<'py>(
        &self,
        py: Python<'py>,
        group: String,
        topics: Vec<String>,
        start: &str,
        isolation: &str,
        client_id: Option<String>,
        session_timeout: Option<Seconds>,
        options: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let client = self.inner.clone();
        let isolation = crate::errors::py_result(isolation.parse::<Isolation>())?;
        let config = ConsumerConfig {
            group,
            topics,
            start: crate::errors::py_result(start.parse::<onceflow::StartFrom>())?,
            isolation,
            client_id,
            session_timeout: session_timeout
                .map(|s| convert::seconds("session_timeout", s.0))
                .transpose()?,
            options: self::options(options.as_ref())?,
        };
        awaitable(py, async move {
            client.consumer(config).await.map(|inner| Consumer {
                inner,
                yielded: Arc::default(),
            })
        })
    }

    /// The admin handle.
    fn admin<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let client = self.inner.clone();
        awaitable(py, async move {
            client.admin().await.map(|inner| Admin { inner })
        })
    }

    fn __repr__(&self) -> String {
        format!("Client(platform={:?})", self.inner.platform())
    }
}

fn caps(c: onceflow::Capabilities) -> HashMap<&'static str, bool> {
    HashMap::from(c.fields())
}

/// Per-record results as a `Deliveries` sequence. Runs on the event loop's thread, once per
/// batch.
fn results(py: Python<'_>, rs: Vec<onceflow::Result<onceflow::Delivery>>) -> PyResult<Py<PyAny>> {
    Ok(Py::new(py, Deliveries { results: rs })?.into_any())
}

/// The results of a batch send, one per record in order: its `Delivery`, or the exception of
/// a record that failed. A sequence (`len`, indexing, slicing, iteration) whose items are made
/// when read, so a batch's results cost no Python object per record until they are looked at;
/// `failed()` counts the failures without making any.
#[pyclass(frozen, sequence, module = "onceflow._native")]
pub struct Deliveries {
    results: Vec<onceflow::Result<onceflow::Delivery>>,
}

impl Deliveries {
    fn item(&self, py: Python<'_>, i: usize) -> PyResult<Py<PyAny>> {
        Ok(match &self.results[i] {
            Ok(d) => Py::new(py, Delivery::from(d.clone()))?.into_any(),
            Err(e) => to_pyerr(py, e).into_value(py).into_any(),
        })
    }
}

#[pymethods]
impl Deliveries {
    fn __len__(&self) -> usize {
        self.results.len()
    }

    /// `results[i]` is a `Delivery` or an exception (negative `i` counts from the end);
    /// `results[a:b:c]` a list of them.
    fn __getitem__<'py>(
        &self,
        py: Python<'py>,
        index: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        convert::sequence_item(py, self.results.len(), index, "result", |i| {
            Ok(self.item(py, i)?.into_bound(py))
        })
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let items = (0..self.results.len())
            .map(|i| self.item(py, i))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(pyo3::types::PyList::new(py, items)?.try_iter()?.into_any())
    }

    /// How many records failed.
    fn failed(&self) -> usize {
        self.results.iter().filter(|r| r.is_err()).count()
    }

    /// The exception of the first record that failed, `None` when all were delivered.
    fn first_error<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyAny>> {
        self.results
            .iter()
            .find_map(|r| r.as_ref().err())
            .map(|e| to_pyerr(py, e).into_value(py).into_bound(py).into_any())
    }

    fn __repr__(&self) -> String {
        format!(
            "Deliveries(<{} records, {} failed>)",
            self.results.len(),
            self.failed()
        )
    }
}

/// A producer.
#[pyclass(frozen, module = "onceflow._native")]
pub struct Producer {
    pub inner: onceflow::Producer,
    background: Arc<Background>,
    /// [`wake::fork_epoch`] when made: a child process after `os.fork()` refuses it.
    epoch: u64,
}

/// Records handed over by `send` and `send_nowait`: buffered here and sent by one task per
/// producer, in batches through `Producer::enqueue_batch` (so they go out in call order, `send`s
/// and `send_nowait`s together). A `send`'s result goes to its `SendFuture` (a batch costs the
/// loop one wake-up); `send_nowait` failures are kept until `drain` takes them. The loop thread
/// only converts arguments and makes the future: the platform client's per-record work runs on
/// the runtime's threads, beside the Python code.
#[derive(Default)]
struct Background {
    state: parking_lot::Mutex<BackgroundState>,
    /// `pending` went to 0.
    idle: tokio::sync::Notify,
    /// Records were buffered while the send task ran with nothing buffered.
    more: tokio::sync::Notify,
}

#[derive(Default)]
struct BackgroundState {
    /// Records not yet handed to the platform client.
    buf: Vec<onceflow::Record>,
    /// Per record of `buf`: the `SendFuture` it completes (`send`), or `None` (`send_nowait`).
    #[cfg(unix)]
    waiting: Vec<Option<wake::Completion>>,
    /// The send task's other buffers, kept (empty, with their capacity) while the task is not
    /// running.
    spare: Vec<Buffers>,
    /// Records accepted whose send has not finished.
    pending: usize,
    /// Errors of finished sends, not yet taken by `drain`.
    failed: Vec<Error>,
    /// The send task runs.
    running: bool,
}

/// A pair of buffers as `BackgroundState` holds them: records, and the futures they complete.
#[derive(Default)]
struct Buffers {
    records: Vec<onceflow::Record>,
    #[cfg(unix)]
    waiting: Vec<Option<wake::Completion>>,
}

impl BackgroundState {
    /// Swaps the buffered records (and their futures) with `b`'s (empty) buffers.
    fn swap(&mut self, b: &mut Buffers) {
        std::mem::swap(&mut self.buf, &mut b.records);
        #[cfg(unix)]
        std::mem::swap(&mut self.waiting, &mut b.waiting);
    }
}

#[cfg(unix)]
type Waiting<'a> = std::vec::Drain<'a, Option<wake::Completion>>;
#[cfg(not(unix))]
type Waiting<'a> = std::marker::PhantomData<&'a ()>;

/// Batches the send task keeps in flight: while one batch's reports are outstanding, the
/// next is already in the platform client's queue.
const IN_FLIGHT: usize = 2;

/// The results of one batch, the buffers it was taken in, its size.
type Sent = (Vec<onceflow::Result<onceflow::Delivery>>, Buffers, usize);

/// The send task: hands everything buffered to the platform client as one batch
/// (`enqueue_batch`: on Kafka into librdkafka's queue, sent at once rather than after
/// `linger.ms`), takes what was buffered meanwhile as the next batch while the first one's
/// reports are outstanding, settles each batch in order when its reports are in, and ends when
/// nothing is buffered or in flight. A platform without a client-side queue sends each batch
/// before taking the next.
///
/// Buffers take turns: the loop thread fills one while the task sends the records of the
/// others, moved into a batch of their own here, so the buffers keep their capacity. The loop
/// thread's pushes then grow no vector once a few batches went by: growing one there cost a
/// copy of every record so far and, in fresh pages, the kernel zeroing them (a twentieth of a
/// single send's time on the loop thread).
async fn send_buffered(p: onceflow::Producer, bg: Arc<Background>) {
    use futures::stream::{FuturesOrdered, StreamExt};
    let mut free = std::mem::take(&mut bg.state.lock().spare);
    let mut in_flight = FuturesOrdered::new();
    // The largest batch lately (halving over 16 batches): buffers are kept at least twice as
    // large, so a small batch between large ones shrinks none that the loop thread would grow
    // again.
    let mut recent = 0usize;
    loop {
        if in_flight.len() < IN_FLIGHT {
            let mut mine = free.pop().unwrap_or_default();
            let taken = {
                let mut st = bg.state.lock();
                if st.buf.is_empty() {
                    if in_flight.is_empty() {
                        st.running = false;
                        free.push(mine);
                        st.spare = free;
                        return;
                    }
                    false
                } else {
                    st.swap(&mut mine);
                    true
                }
            };
            if taken {
                in_flight.push_back(send_taken(&p, mine).await);
                continue;
            }
            free.push(mine);
        }
        tokio::select! {
            Some((results, mut mine, n)) = in_flight.next() => {
                #[cfg(unix)]
                let waiting = mine.waiting.drain(..);
                #[cfg(not(unix))]
                let waiting = std::marker::PhantomData;
                bg.settle(results, waiting, n);
                recent = n.max(recent - recent / 24);
                // A burst far larger than the batches since gives its memory back.
                if mine.records.capacity() > (1 << 16).max(8 * recent) {
                    mine.records.shrink_to(2 * recent);
                    #[cfg(unix)]
                    mine.waiting.shrink_to(2 * recent);
                }
                free.push(mine);
            }
            _ = bg.more.notified(), if in_flight.len() < IN_FLIGHT => {}
        }
    }
}

/// Enqueues the records of `mine` as one batch; the future of its results. A panic still
/// settles the batch (every record fails), or its futures and `drain` would wait forever.
async fn send_taken(
    p: &onceflow::Producer,
    mut mine: Buffers,
) -> impl std::future::Future<Output = Sent> {
    use futures::FutureExt;
    let n = mine.records.len();
    let batch: Vec<onceflow::Record> = mine.records.drain(..).collect();
    let reports = std::panic::AssertUnwindSafe(p.enqueue_batch(batch))
        .catch_unwind()
        .await;
    async move {
        let results = match reports {
            Ok(reports) => std::panic::AssertUnwindSafe(reports).catch_unwind().await,
            Err(panic) => Err(panic),
        };
        let results = results.unwrap_or_else(|_| {
            (0..n)
                .map(|_| {
                    Err(Error::new(
                        ErrorKind::Platform,
                        "onceflow: the send task panicked",
                    ))
                })
                .collect()
        });
        (results, mine, n)
    }
}

impl Background {
    /// A batch's results are in: completes its `send`s' futures, keeps its `send_nowait`
    /// failures for `drain`.
    fn settle(
        &self,
        results: Vec<onceflow::Result<onceflow::Delivery>>,
        waiting: Waiting<'_>,
        n: usize,
    ) {
        let failed = settle(results, waiting, n);
        let mut st = self.state.lock();
        st.pending -= n;
        st.failed.extend(failed);
        if st.pending == 0 {
            drop(st);
            self.idle.notify_waiters();
        }
    }
}

/// Hands each `send`'s result to its `SendFuture`; returns the failures of the `send_nowait`
/// records. `n` records were sent: a result the backend did not give is a `Platform` error.
#[cfg(unix)]
fn settle(
    results: Vec<onceflow::Result<onceflow::Delivery>>,
    waiting: Waiting<'_>,
    n: usize,
) -> Vec<Error> {
    let mut results = results.into_iter();
    let mut done = Vec::new();
    let mut failed = Vec::new();
    for slot in waiting.take(n) {
        let r = results
            .next()
            .unwrap_or_else(|| Err(Error::new(ErrorKind::Platform, "missing delivery report")));
        match slot {
            Some(c) => done.push((c, r)),
            None => failed.extend(r.err()),
        }
    }
    wake::complete_all(done, delivered);
    failed
}

#[cfg(not(unix))]
fn settle(
    results: Vec<onceflow::Result<onceflow::Delivery>>,
    _waiting: Waiting<'_>,
    _n: usize,
) -> Vec<Error> {
    results.into_iter().filter_map(Result::err).collect()
}

/// A send's result: its `Delivery`, or the onceflow exception it raises.
fn delivered(py: Python<'_>, r: onceflow::Result<onceflow::Delivery>) -> PyResult<Py<PyAny>> {
    let d = crate::errors::py_result(r)?;
    let d = Bound::new(py, Delivery::from(d))?.into_any();
    // A `Delivery` holds no Python object: no cycle for the collector to look for.
    #[cfg(unix)]
    wake::untrack(&d);
    Ok(d.unbind())
}

/// `drain`'s result: the exceptions of the failed records, as a list.
fn failures(py: Python<'_>, r: onceflow::Result<Vec<Error>>) -> PyResult<Py<PyAny>> {
    let errors = crate::errors::py_result(r)?;
    let items = errors
        .iter()
        .map(|e| to_pyerr(py, e).into_value(py).into_any())
        .collect::<Vec<_>>();
    Ok(pyo3::types::PyList::new(py, items)?.into_any().unbind())
}

impl Producer {
    /// `Closed` in a child process after `os.fork()`: the producer's platform client (librdkafka's
    /// threads, the connections) and its send task stayed in the parent, so records handed to it
    /// here would never be sent, and waiting for them would never end.
    fn check_fork(&self, py: Python<'_>) -> PyResult<()> {
        if wake::current_fork_epoch() == self.epoch {
            return Ok(());
        }
        Err(to_pyerr(
            py,
            &Error::new(
                ErrorKind::Closed,
                "this producer was created before os.fork(): its platform client and send task \
                 stayed in the parent process; connect and create a new producer in the child",
            ),
        ))
    }

    /// Queues `record` for the send task (started when it is not running); `waiting` is the
    /// `SendFuture` it completes, if any.
    fn buffer(&self, record: onceflow::Record, #[cfg(unix)] waiting: Option<wake::Completion>) {
        let (spawn, more) = {
            let mut st = self.background.state.lock();
            st.buf.push(record);
            #[cfg(unix)]
            st.waiting.push(waiting);
            st.pending += 1;
            let running = std::mem::replace(&mut st.running, true);
            (!running, running && st.buf.len() == 1)
        };
        if spawn {
            onceflow_bindings::runtime()
                .spawn(send_buffered(self.inner.clone(), self.background.clone()));
        } else if more {
            // The task may wait with room for another batch: at most one wake-up per batch.
            self.background.more.notify_one();
        }
    }
}

#[pymethods]
impl Producer {
    /// Platform name.
    #[getter]
    fn platform(&self) -> &'static str {
        self.inner.platform()
    }

    /// The guarantee of a write through this producer (`exactly-once`, `effectively-once`,
    /// `at-least-once`).
    #[getter]
    fn guarantee(&self) -> String {
        self.inner.guarantee().to_string()
    }

    /// Sends one record: hands it to the producer's send task at once (sent in call order with
    /// the other `send`s and `send_nowait`s of this producer, in batches) and returns a
    /// `SendFuture` that resolves to its `Delivery` when the platform acknowledged it (or
    /// raises the send's exception, a validation error included). Cancelling the future never
    /// un-sends the record. Invalid arguments raise here.
    #[pyo3(signature = (topic, payload, *, key=None, headers=None, partition=None, timestamp=None, idempotency_key=None, requeue=None))]
    #[allow(clippy::too_many_arguments)]
    fn send<'py>(
        &self,
        py: Python<'py>,
        topic: &Bound<'py, PyAny>,
        payload: &Bound<'py, PyAny>,
        key: Option<&Bound<'py, PyAny>>,
        headers: Option<&Bound<'py, PyAny>>,
        partition: Option<&Bound<'py, PyAny>>,
        timestamp: Option<&Bound<'py, PyAny>>,
        idempotency_key: Option<&Bound<'py, PyAny>>,
        requeue: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.check_fork(py)?;
        let record = convert::record(
            topic,
            payload,
            key,
            headers,
            partition,
            timestamp,
            idempotency_key,
            requeue,
        )?;
        #[cfg(unix)]
        if let Some((fut, completion)) = wake::pending(py)? {
            self.buffer(record, Some(completion));
            return Ok(fut);
        }
        let p = self.inner.clone();
        wake::send(py, async move { p.send(record).await }, delivered)
    }

    /// Hands one record over without an awaitable and returns at once: the record is buffered
    /// and sent by a background task with the records buffered around it, in batches, in call
    /// order. Failures are kept until `drain` returns them. Invalid arguments raise
    /// here.
    #[pyo3(signature = (topic, payload, *, key=None, headers=None, partition=None, timestamp=None, idempotency_key=None, requeue=None))]
    #[allow(clippy::too_many_arguments)]
    fn send_nowait<'py>(
        &self,
        topic: &Bound<'py, PyAny>,
        payload: &Bound<'py, PyAny>,
        key: Option<&Bound<'py, PyAny>>,
        headers: Option<&Bound<'py, PyAny>>,
        partition: Option<&Bound<'py, PyAny>>,
        timestamp: Option<&Bound<'py, PyAny>>,
        idempotency_key: Option<&Bound<'py, PyAny>>,
        requeue: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<()> {
        self.check_fork(payload.py())?;
        let record = convert::record(
            topic,
            payload,
            key,
            headers,
            partition,
            timestamp,
            idempotency_key,
            requeue,
        )?;
        #[cfg(unix)]
        self.buffer(record, None);
        #[cfg(not(unix))]
        self.buffer(record);
        Ok(())
    }

    /// Waits, at most `timeout` seconds, until every record given to `send_nowait` so far is
    /// acknowledged or failed; resolves to the exceptions of the records that failed since the
    /// last `drain` (an empty list when none did). Raises `TimeoutError` when records are
    /// still in flight at the timeout.
    #[pyo3(signature = (timeout=Seconds(30.0)))]
    fn drain<'py>(&self, py: Python<'py>, timeout: Seconds) -> PyResult<Bound<'py, PyAny>> {
        self.check_fork(py)?;
        let timeout = convert::seconds("timeout", timeout.0)?;
        let bg = self.background.clone();
        wake::deliver(
            py,
            async move {
                let wait = async {
                    loop {
                        let idle = bg.idle.notified();
                        tokio::pin!(idle);
                        idle.as_mut().enable();
                        if bg.state.lock().pending == 0 {
                            break;
                        }
                        idle.await;
                    }
                };
                if tokio::time::timeout(timeout, wait).await.is_err() {
                    let pending = bg.state.lock().pending;
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!("drain: {pending} records of send_nowait still in flight after {timeout:?}"),
                    ));
                }
                Ok(std::mem::take(&mut bg.state.lock().failed))
            },
            failures,
            true,
        )
    }

    /// Sends records (tuples in `onceflow.Record` order) pipelined; resolves to `Deliveries`:
    /// one result per record, in order, a `Delivery` or the exception of that record.
    fn send_batch<'py>(
        &self,
        py: Python<'py>,
        records: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.check_fork(py)?;
        let records = convert::records(records)?;
        let p = self.inner.clone();
        wake::deliver(
            py,
            async move { p.send_batch(records).await },
            results,
            false,
        )
    }

    /// Writes every record or none, as one atomic batch (`Producer::send_atomic`); resolves to
    /// their deliveries in order.
    fn send_atomic<'py>(
        &self,
        py: Python<'py>,
        records: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.check_fork(py)?;
        let records = convert::records(records)?;
        let p = self.inner.clone();
        awaitable(py, async move {
            p.send_atomic(records)
                .await
                .map(|ds| ds.into_iter().map(Delivery::from).collect::<Vec<_>>())
        })
    }

    /// Starts a transaction (needs a `transactional_id`).
    fn begin<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.check_fork(py)?;
        let p = self.inner.clone();
        awaitable(py, async move {
            p.begin().await.map(|tx| Transaction {
                inner: Arc::new(tokio::sync::Mutex::new(Some(tx))),
            })
        })
    }

    /// Waits until everything sent is acknowledged, at most `timeout` seconds.
    #[pyo3(signature = (timeout=Seconds(30.0)))]
    fn flush<'py>(&self, py: Python<'py>, timeout: Seconds) -> PyResult<Bound<'py, PyAny>> {
        self.check_fork(py)?;
        let timeout = convert::seconds("timeout", timeout.0)?;
        let p = self.inner.clone();
        awaitable(py, async move { p.flush(timeout).await })
    }

    /// Flushes and releases the producer.
    fn close<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.check_fork(py)?;
        let p = self.inner.clone();
        awaitable(py, async move { p.close().await })
    }
}

type TxSlot = Arc<tokio::sync::Mutex<Option<onceflow::Transaction>>>;

fn finished() -> Error {
    Error::new(ErrorKind::Closed, "transaction already finished")
}

/// An open transaction; `commit()` or `abort()` ends it.
#[pyclass(frozen, module = "onceflow._native")]
pub struct Transaction {
    inner: TxSlot,
}

#[pymethods]
impl Transaction {
    /// Sends a record inside the transaction; returns a `SendFuture` (see `Producer.send`).
    #[pyo3(signature = (topic, payload, *, key=None, headers=None, partition=None, timestamp=None, idempotency_key=None, requeue=None))]
    #[allow(clippy::too_many_arguments)]
    fn send<'py>(
        &self,
        py: Python<'py>,
        topic: &Bound<'py, PyAny>,
        payload: &Bound<'py, PyAny>,
        key: Option<&Bound<'py, PyAny>>,
        headers: Option<&Bound<'py, PyAny>>,
        partition: Option<&Bound<'py, PyAny>>,
        timestamp: Option<&Bound<'py, PyAny>>,
        idempotency_key: Option<&Bound<'py, PyAny>>,
        requeue: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let record = convert::record(
            topic,
            payload,
            key,
            headers,
            partition,
            timestamp,
            idempotency_key,
            requeue,
        )?;
        let tx = self.inner.clone();
        let fut = async move {
            let mut slot = tx.lock().await;
            let tx = slot.as_mut().ok_or_else(finished)?;
            tx.send(record).await
        };
        wake::send(py, fut, delivered)
    }

    /// Sends records inside the transaction; one result per record (see `Producer.send_batch`).
    fn send_batch<'py>(
        &self,
        py: Python<'py>,
        records: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let records = convert::records(records)?;
        let tx = self.inner.clone();
        let fut = async move {
            let mut slot = tx.lock().await;
            match slot.as_mut() {
                Some(tx) => tx.send_batch(records).await,
                None => records.iter().map(|_| Err(finished())).collect(),
            }
        };
        wake::deliver(py, fut, results, false)
    }

    /// Commits `positions` (`(topic, partition, position)` of the last processed message per
    /// partition) of `consumer`'s group with the transaction; None: what `consumer` handed
    /// out (`batch` and `handed_out` as for its `commit`).
    #[pyo3(signature = (consumer, positions=None, batch=0, handed_out=None))]
    fn commit_offsets<'py>(
        &self,
        py: Python<'py>,
        consumer: &Consumer,
        positions: Option<Vec<(String, i32, String)>>,
        batch: u64,
        handed_out: Option<usize>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let positions = consumer.positions_or_yielded(positions, batch, handed_out)?;
        let group = consumer.inner.group_metadata();
        let tx = self.inner.clone();
        awaitable(py, async move {
            let group = group.ok_or_else(|| {
                Error::unsupported("this consumer has no group metadata for transactional commits")
            })?;
            let mut slot = tx.lock().await;
            let tx = slot.as_mut().ok_or_else(finished)?;
            tx.commit_offsets(&group, &positions).await
        })
    }

    /// Commits the transaction.
    fn commit<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let tx = self.inner.clone();
        awaitable(py, async move {
            let tx = tx.lock().await.take().ok_or_else(finished)?;
            tx.commit().await
        })
    }

    /// Aborts the transaction (nothing it sent becomes visible). A no-op once finished.
    fn abort<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let tx = self.inner.clone();
        awaitable(py, async move {
            match tx.lock().await.take() {
                Some(tx) => tx.abort().await,
                None => Ok(()),
            }
        })
    }
}

/// A consumer: one member of a consumer group.
#[pyclass(frozen, module = "onceflow._native")]
pub struct Consumer {
    pub inner: onceflow::Consumer,
    /// What `commit()` without positions commits.
    yielded: Arc<Yielded>,
}

impl Consumer {
    /// The given positions, or those of the messages handed out: the host's progress is the
    /// number of the latest batch it received and how many of its messages it handed out
    /// (None: all of them).
    fn positions_or_yielded(
        &self,
        positions: Option<Vec<(String, i32, String)>>,
        batch: u64,
        handed_out: Option<usize>,
    ) -> PyResult<Vec<(TopicPartition, onceflow::Position)>> {
        match positions {
            Some(p) => convert::positions(p),
            None => Ok(self.yielded.positions(Progress::new(batch, handed_out))),
        }
    }
}

#[pymethods]
impl Consumer {
    /// Platform name.
    #[getter]
    fn platform(&self) -> &'static str {
        self.inner.platform()
    }

    /// The consumer group.
    #[getter]
    fn group(&self) -> String {
        self.inner.group().to_string()
    }

    /// Fetches up to `max` messages (default 500), waiting at most `timeout` seconds for the first; resolves
    /// to a `MessageBatch` (empty on timeout). One call crosses the boundary once for the whole
    /// batch; its `Message` objects are made only when accessed.
    ///
    /// Errors: `ConfigError` naming `max` when it is not from 1 to 1 000 000 000 (Python's own
    /// `OverflowError` for -1 named nothing), `TypeError` when it is not an int.
    ///
    /// `batch` and `handed_out`: the wrapper's progress through the latest batch it received
    /// (its `_batch` number and how many of its messages it handed out, None: all), for what
    /// `commit()` without positions commits.
    #[pyo3(signature = (max=None, timeout=Seconds(1.0), batch=0, handed_out=None))]
    fn poll<'py>(
        &self,
        py: Python<'py>,
        max: Option<&Bound<'py, PyAny>>,
        timeout: Seconds,
        batch: u64,
        handed_out: Option<usize>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let max = convert::opt_int("max", max, 1, MAX_POLL)?.unwrap_or(500) as usize;
        let timeout = convert::seconds("timeout", timeout.0)?;
        let c = self.inner.clone();
        let yielded = self.yielded.clone();
        awaitable(py, async move {
            let messages = c.poll(max, timeout).await?;
            let number = yielded.polled(&messages, Progress::new(batch, handed_out));
            Ok(MessageBatch::numbered(messages, number))
        })
    }

    /// Commits `(topic, partition, position)` of the last processed message per partition;
    /// None: the last message handed out of each partition (`batch` and `handed_out` as for
    /// `poll`).
    #[pyo3(signature = (positions=None, batch=0, handed_out=None))]
    fn commit<'py>(
        &self,
        py: Python<'py>,
        positions: Option<Vec<(String, i32, String)>>,
        batch: u64,
        handed_out: Option<usize>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let positions = self.positions_or_yielded(positions, batch, handed_out)?;
        let c = self.inner.clone();
        awaitable(py, async move {
            if positions.is_empty() {
                return Ok(());
            }
            c.commit(&positions).await
        })
    }

    /// The group's committed position (next to read) of each `(topic, partition)`.
    fn committed<'py>(
        &self,
        py: Python<'py>,
        partitions: Vec<(String, i32)>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let tps = tps(partitions);
        let c = self.inner.clone();
        awaitable(py, async move {
            c.committed(&tps).await.map(|v| {
                v.into_iter()
                    .map(|c| {
                        let next = c.next.map(|p| p.to_string());
                        (c.partition.topic, c.partition.partition, next)
                    })
                    .collect::<Vec<_>>()
            })
        })
    }

    /// Moves the fetch position of an assigned partition: `to` is `earliest`, `latest`,
    /// `timestamp:MS` or a position such as `offset:42` (inclusive).
    fn seek<'py>(
        &self,
        py: Python<'py>,
        topic: String,
        partition: i32,
        to: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        let to = crate::errors::py_result(to.parse::<onceflow::StartFrom>())?;
        let tp = TopicPartition::new(topic, partition);
        let c = self.inner.clone();
        let yielded = self.yielded.clone();
        awaitable(py, async move {
            c.seek(&tp, &to).await?;
            yielded.forget(&tp);
            Ok(())
        })
    }

    /// After an aborted transaction: gives out again, in order and from the group's committed
    /// position, every message of the `(topic, partition)`s that `poll` returned and no commit
    /// covered, without undoing any acknowledgement. Returns the `(topic, partition)`s on which
    /// the group has committed nothing (left as they are, for the caller to `seek`).
    fn rewind_uncommitted<'py>(
        &self,
        py: Python<'py>,
        partitions: Vec<(String, i32)>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let tps = tps(partitions);
        let c = self.inner.clone();
        let yielded = self.yielded.clone();
        awaitable(py, async move {
            let left = c.rewind_uncommitted(&tps).await?;
            for tp in &tps {
                yielded.forget(tp);
            }
            Ok(left
                .into_iter()
                .map(|tp| (tp.topic, tp.partition))
                .collect::<Vec<_>>())
        })
    }

    /// Stops fetching from `(topic, partition)`s.
    fn pause<'py>(
        &self,
        py: Python<'py>,
        partitions: Vec<(String, i32)>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let tps = tps(partitions);
        let c = self.inner.clone();
        awaitable(py, async move { c.pause(&tps).await })
    }

    /// Resumes fetching from `(topic, partition)`s.
    fn resume<'py>(
        &self,
        py: Python<'py>,
        partitions: Vec<(String, i32)>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let tps = tps(partitions);
        let c = self.inner.clone();
        awaitable(py, async move { c.resume(&tps).await })
    }

    /// `(topic, partition)`s assigned to this member now.
    fn assignment(&self) -> Vec<(String, i32)> {
        self.inner
            .assignment()
            .into_iter()
            .map(|tp| (tp.topic, tp.partition))
            .collect()
    }

    /// Lag per assigned partition.
    fn lag<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let c = self.inner.clone();
        awaitable(py, async move {
            c.lag()
                .await
                .map(|v| v.into_iter().map(Lag::from).collect::<Vec<_>>())
        })
    }

    /// Leaves the group and releases the consumer (does not commit).
    fn close<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let c = self.inner.clone();
        awaitable(py, async move { c.close().await })
    }
}

/// Topic administration.
#[pyclass(frozen, module = "onceflow._native")]
pub struct Admin {
    inner: onceflow::Admin,
}

#[pymethods]
impl Admin {
    /// Creates a topic.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (name, partitions=1, *, retention_ms=None, retention_bytes=None, compacted=false, options=None))]
    fn create_topic<'py>(
        &self,
        py: Python<'py>,
        name: String,
        partitions: u32,
        retention_ms: Option<u64>,
        retention_bytes: Option<u64>,
        compacted: bool,
        options: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let spec = TopicSpec {
            name,
            partitions,
            retention_ms,
            retention_bytes,
            compacted,
            options: self::options(options.as_ref())?,
        };
        let a = self.inner.clone();
        awaitable(py, async move { a.create_topic(&spec).await })
    }

    /// Describes a topic: `{name, partitions, retention_ms, retention_bytes, compacted,
    /// options, storage, replicas, sync, durable_on_ack}` (`onceflow.TopicDescription`).
    /// `options` holds every setting the platform reports, as text; the last four are read
    /// from it where the platform reports them (JetStream), else `None`.
    fn describe_topic<'py>(&self, py: Python<'py>, name: String) -> PyResult<Bound<'py, PyAny>> {
        let a = self.inner.clone();
        awaitable_py(py, async move {
            let d = crate::errors::py_result(a.describe_topic(&name).await)?;
            let durability = onceflow_bindings::durability::Durability::of(&d.options);
            Python::attach(|py| -> PyResult<Py<PyAny>> {
                let out = pyo3::types::PyDict::new(py);
                out.set_item("name", d.name)?;
                out.set_item("partitions", d.partitions)?;
                out.set_item("retention_ms", d.retention_ms)?;
                out.set_item("retention_bytes", d.retention_bytes)?;
                out.set_item("compacted", d.compacted)?;
                out.set_item("options", d.options)?;
                out.set_item("storage", durability.storage)?;
                out.set_item("replicas", durability.replicas)?;
                out.set_item("sync", durability.sync)?;
                out.set_item("durable_on_ack", durability.durable_on_ack)?;
                Ok(out.into_any().unbind())
            })
        })
    }

    /// Deletes a topic.
    fn delete_topic<'py>(&self, py: Python<'py>, name: String) -> PyResult<Bound<'py, PyAny>> {
        let a = self.inner.clone();
        awaitable(py, async move { a.delete_topic(&name).await })
    }
}

/// `(topic, partition)` pairs as given from Python.
fn tps(partitions: Vec<(String, i32)>) -> Vec<TopicPartition> {
    partitions
        .into_iter()
        .map(|(t, p)| TopicPartition::new(t, p))
        .collect()
}
