//! Type conversions between Python and onceflow's model: records in, messages, deliveries
//! and lag out. No logic beyond conversion.

use std::sync::Arc;

use bytes::Bytes;
use onceflow::{
    Delivery as RsDelivery, Headers, Message as RsMessage, PartitionLag, Position, Record,
    TopicPartition,
};
use pyo3::exceptions::{PyIndexError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PySlice, PyString, PyTuple};

use crate::errors::{config_err, py_result};

/// The name of `v`'s type, for error messages.
/// `v` as a `String`; a `TypeError` naming `what` and the type given otherwise (pyo3's own
/// message names the argument only from CPython 3.11, in an exception note).
pub fn text(what: &str, v: &Bound<'_, PyAny>, expected: &str) -> PyResult<String> {
    v.extract::<String>().map_err(|_| {
        PyTypeError::new_err(format!("{what}: expected {expected}, got {}", type_name(v)))
    })
}

fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default()
}

/// Bytes from `bytes`, `bytearray`, `memoryview` or `str` (UTF-8).
pub fn to_bytes(what: &str, v: &Bound<'_, PyAny>) -> PyResult<Bytes> {
    if let Ok(b) = v.cast::<PyBytes>() {
        return Ok(Bytes::copy_from_slice(b.as_bytes()));
    }
    if let Ok(s) = v.cast::<PyString>() {
        return Ok(Bytes::copy_from_slice(s.to_cow()?.as_bytes()));
    }
    match v.extract::<Vec<u8>>() {
        Ok(b) if !v.is_instance_of::<PyList>() => Ok(Bytes::from(b)),
        _ => Err(PyTypeError::new_err(format!(
            "{what}: expected bytes or str, got {}",
            type_name(v)
        ))),
    }
}

fn opt_bytes(what: &str, v: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Bytes>> {
    match v {
        None => Ok(None),
        Some(v) if v.is_none() => Ok(None),
        Some(v) => to_bytes(what, v).map(Some),
    }
}

/// Headers from `None`, a dict `{name: value}` or a sequence of `(name, value)`; values are
/// bytes, str or None (a null header).
pub fn to_headers(v: Option<&Bound<'_, PyAny>>) -> PyResult<Headers> {
    let mut h = Headers::new();
    let Some(v) = v else { return Ok(h) };
    if v.is_none() {
        return Ok(h);
    }
    let mut push = |name: String, value: &Bound<'_, PyAny>| -> PyResult<()> {
        if value.is_none() {
            h.insert_null(name);
        } else {
            let b = to_bytes(&format!("header '{name}'"), value)?;
            h.insert(name, b);
        }
        Ok(())
    };
    if let Ok(d) = v.cast::<PyDict>() {
        for (k, val) in d.iter() {
            push(k.extract::<String>()?, &val)?;
        }
    } else {
        for item in v.try_iter()? {
            let item = item?;
            let (k, val): (String, Bound<'_, PyAny>) = item.extract().map_err(|_| {
                PyTypeError::new_err(
                    "headers: expected a dict or a sequence of (name, value) pairs",
                )
            })?;
            push(k, &val)?;
        }
    }
    Ok(h)
}

/// An optional int argument named `what`: `None` (or absent) is `None`; an int in
/// `min..=max` is kept; an int out of that range raises `ConfigError` and anything else
/// `TypeError`, both naming `what` (Python's own `OverflowError` names neither).
pub fn opt_int(
    what: &str,
    v: Option<&Bound<'_, PyAny>>,
    min: i64,
    max: i64,
) -> PyResult<Option<i64>> {
    let Some(v) = v.filter(|v| !v.is_none()) else {
        return Ok(None);
    };
    match v.extract::<i64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(Some(n)),
        Err(e) if !e.is_instance_of::<pyo3::exceptions::PyOverflowError>(v.py()) => {
            Err(PyTypeError::new_err(format!(
                "{what}: expected int or None, got {}",
                type_name(v)
            )))
        }
        _ => Err(config_err(format!(
            "{what} {}: expected an int from {min} to {max}",
            onceflow::shown(&v.str()?.to_cow()?)
        ))),
    }
}

/// A `partition` argument: `None` or an int from 0 to 2 147 483 647.
pub fn opt_partition(v: Option<&Bound<'_, PyAny>>) -> PyResult<Option<i32>> {
    Ok(opt_int("partition", v, 0, i64::from(i32::MAX))?.map(|n| n as i32))
}

/// A `timestamp` argument (ms since the Unix epoch): `None` or an int from 0 to 2^63 - 1.
pub fn opt_timestamp(v: Option<&Bound<'_, PyAny>>) -> PyResult<Option<i64>> {
    opt_int("timestamp", v, 0, i64::MAX)
}

/// A record from its fields (the order of `onceflow.Record`).
#[allow(clippy::too_many_arguments)]
pub fn record(
    topic: &Bound<'_, PyAny>,
    payload: &Bound<'_, PyAny>,
    key: Option<&Bound<'_, PyAny>>,
    headers: Option<&Bound<'_, PyAny>>,
    partition: Option<&Bound<'_, PyAny>>,
    timestamp: Option<&Bound<'_, PyAny>>,
    idempotency_key: Option<&Bound<'_, PyAny>>,
    requeue: Option<&Bound<'_, PyAny>>,
) -> PyResult<Record> {
    let idempotency_key = match idempotency_key.filter(|k| !k.is_none()) {
        Some(k) => Some(text("idempotency_key", k, "str or None")?),
        None => None,
    };
    let topic = text("topic", topic, "str")?;
    let r = build(
        topic,
        payload,
        key,
        headers,
        partition,
        timestamp,
        idempotency_key,
    )?;
    with_requeue(r, "requeue", requeue)
}

/// `r` requeued as generation `v` of its idempotency key (`None` or 0: as it is).
fn with_requeue(r: Record, what: &str, v: Option<&Bound<'_, PyAny>>) -> PyResult<Record> {
    Ok(match opt_int(what, v, 0, i64::from(u32::MAX))? {
        Some(n) if n > 0 => r.requeue(n as u32),
        _ => r,
    })
}

/// A record of a topic and idempotency key already converted.
fn build(
    topic: String,
    payload: &Bound<'_, PyAny>,
    key: Option<&Bound<'_, PyAny>>,
    headers: Option<&Bound<'_, PyAny>>,
    partition: Option<&Bound<'_, PyAny>>,
    timestamp: Option<&Bound<'_, PyAny>>,
    idempotency_key: Option<String>,
) -> PyResult<Record> {
    Ok(Record {
        topic,
        payload: to_bytes("payload", payload)?,
        key: opt_bytes("key", key)?,
        headers: to_headers(headers)?,
        partition: opt_partition(partition)?,
        timestamp: opt_timestamp(timestamp)?,
        idempotency_key,
    })
}

/// A record from a tuple `(topic, payload, key=None, headers=None, partition=None,
/// timestamp=None, idempotency_key=None, requeue=0)`; `onceflow.Record` is such a tuple.
pub fn record_from_tuple(v: &Bound<'_, PyAny>) -> PyResult<Record> {
    let t = v.cast::<PyTuple>().map_err(|_| {
        PyTypeError::new_err(format!(
            "record: expected onceflow.Record or a tuple (topic, payload, key, headers, partition, timestamp, idempotency_key, requeue), got {}",
            type_name(v)
        ))
    })?;
    let n = t.len();
    if !(2..=8).contains(&n) {
        return Err(PyTypeError::new_err(format!(
            "record: expected 2 to 8 fields (topic, payload, ...), got {n}"
        )));
    }
    let get =
        |i: usize| -> Option<Bound<'_, PyAny>> { (i < n).then(|| t.get_item(i).ok()).flatten() };
    let none_or = |i: usize| get(i).filter(|x| !x.is_none());
    let topic = text("record topic", &t.get_item(0)?, "str")?;
    let idempotency_key = match none_or(6) {
        None => None,
        Some(k) => Some(text("record idempotency_key", &k, "str or None")?),
    };
    let r = build(
        topic,
        &t.get_item(1)?,
        get(2).as_ref(),
        get(3).as_ref(),
        get(4).as_ref(),
        get(5).as_ref(),
        idempotency_key,
    )?;
    with_requeue(r, "record requeue", none_or(7).as_ref())
}

/// Records from any iterable of record tuples.
pub fn records(v: &Bound<'_, PyAny>) -> PyResult<Vec<Record>> {
    let mut out = Vec::with_capacity(v.len().unwrap_or(0));
    for item in v.try_iter()? {
        out.push(record_from_tuple(&item?)?);
    }
    Ok(out)
}

/// A position from its text (`offset:42`, `seq:7`, ...).
pub fn position(text: &str) -> PyResult<Position> {
    py_result(text.parse::<Position>())
}

/// `(topic, partition, position)` triples → positions to commit.
pub fn positions(v: Vec<(String, i32, String)>) -> PyResult<Vec<(TopicPartition, Position)>> {
    v.into_iter()
        .map(|(t, p, pos)| Ok((TopicPartition::new(t, p), position(&pos)?)))
        .collect()
}

/// A received message: a view of one message of a [`MessageBatch`] (the batch's messages are
/// shared, not copied). Fields convert to Python objects when read.
#[pyclass(frozen, module = "onceflow._native")]
pub struct Message {
    batch: Arc<Vec<RsMessage>>,
    index: usize,
}

impl Message {
    /// A message on its own (a batch of one).
    pub fn single(m: RsMessage) -> Self {
        Message {
            batch: Arc::new(vec![m]),
            index: 0,
        }
    }

    fn inner(&self) -> &RsMessage {
        &self.batch[self.index]
    }

    /// The Rust message (for the span plans of `crate::trace`).
    pub(crate) fn rs(&self) -> &RsMessage {
        self.inner()
    }
}

#[pymethods]
impl Message {
    /// Topic / stream / subject.
    #[getter]
    fn topic(&self) -> &str {
        &self.inner().topic
    }
    /// Partition (shard) number.
    #[getter]
    fn partition(&self) -> i32 {
        self.inner().partition
    }
    /// Position in its partition, as text (`offset:42`, `seq:7`, ...).
    #[getter]
    fn position(&self) -> String {
        self.inner().position.to_string()
    }
    /// Key bytes, if any.
    #[getter]
    fn key<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.inner().key.as_ref().map(|k| PyBytes::new(py, k))
    }
    /// Payload bytes.
    #[getter]
    fn payload<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner().payload)
    }
    /// Headers in order: `(name, value)`, value `None` for a null header.
    #[getter]
    fn headers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let items: Vec<(String, Option<Bound<'py, PyBytes>>)> = self
            .inner()
            .headers
            .iter()
            .map(|h| {
                (
                    h.name.clone(),
                    h.value.as_ref().map(|v| PyBytes::new(py, v)),
                )
            })
            .collect();
        PyList::new(py, items)
    }
    /// Headers as a dict; for a repeated name, the first value.
    #[getter]
    fn headers_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for h in self.inner().headers.iter() {
            if !d.contains(&h.name)? {
                d.set_item(&h.name, h.value.as_ref().map(|v| PyBytes::new(py, v)))?;
            }
        }
        Ok(d)
    }
    /// The first value of header `name` (`None` if absent or null).
    fn header<'py>(&self, py: Python<'py>, name: &str) -> Option<Bound<'py, PyBytes>> {
        self.inner()
            .headers
            .get(name)
            .flatten()
            .map(|v| PyBytes::new(py, v))
    }
    /// Every value of header `name`, in order (`None` for a null one; an empty list when
    /// absent). Names match exactly, as `header` does.
    fn header_all<'py>(&self, py: Python<'py>, name: &str) -> Vec<Option<Bound<'py, PyBytes>>> {
        self.inner()
            .headers
            .get_all(name)
            .map(|v| v.map(|v| PyBytes::new(py, v)))
            .collect()
    }
    /// Milliseconds since the epoch, if the platform has a timestamp.
    #[getter]
    fn timestamp(&self) -> Option<i64> {
        self.inner().timestamp
    }
    /// How many times the platform delivered this message (1 on first delivery).
    #[getter]
    fn delivery_count(&self) -> u32 {
        self.inner().delivery_count
    }
    fn __repr__(&self) -> String {
        format!(
            "Message(topic={:?}, partition={}, position={:?}, payload=<{} bytes>)",
            self.inner().topic,
            self.inner().partition,
            self.inner().position.to_string(),
            self.inner().payload.len()
        )
    }
}

/// The messages of one poll, in the order they were read: a sequence of [`Message`] (`len`,
/// indexing, slicing, iteration) whose message objects are made only when accessed, plus
/// column accessors that build one Python list for the whole batch without a `Message` object
/// per message.
#[pyclass(frozen, sequence, module = "onceflow._native")]
pub struct MessageBatch {
    messages: Arc<Vec<RsMessage>>,
    /// The batch's number for what `commit()` commits (onceflow-bindings' `yielded`; 0 when
    /// it was not polled by a consumer): the latest batch's again when this one is empty.
    #[pyo3(get, name = "_batch")]
    number: u64,
}

impl MessageBatch {
    /// The Rust messages, in order (for the span plans of `crate::trace`).
    pub(crate) fn rs_messages(&self) -> &[RsMessage] {
        &self.messages
    }

    /// A batch of `messages`, in order.
    pub fn new(messages: Vec<RsMessage>) -> Self {
        Self::numbered(messages, 0)
    }

    /// A polled batch with its number.
    pub fn numbered(messages: Vec<RsMessage>, number: u64) -> Self {
        MessageBatch {
            messages: Arc::new(messages),
            number,
        }
    }

    fn at(&self, index: usize) -> Message {
        Message {
            batch: self.messages.clone(),
            index,
        }
    }
}

#[pymethods]
impl MessageBatch {
    fn __len__(&self) -> usize {
        self.messages.len()
    }

    /// The messages from `start` on, as a batch of their own (no batch number): the rest of a
    /// batch an iterator was left in.
    fn _tail(&self, start: usize) -> MessageBatch {
        let start = start.min(self.messages.len());
        MessageBatch::new(self.messages[start..].to_vec())
    }

    /// `batch[i]` is a `Message` (negative `i` counts from the end); `batch[a:b:c]` a list of
    /// them.
    fn __getitem__<'py>(
        &self,
        py: Python<'py>,
        index: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        sequence_item(py, self.messages.len(), index, "message", |i| {
            Ok(Bound::new(py, self.at(i))?.into_any())
        })
    }

    fn __iter__(&self) -> MessageIter {
        MessageIter {
            messages: self.messages.clone(),
            next: 0,
        }
    }

    /// Every message's payload, in order: `list[bytes]`.
    fn payloads<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(
            py,
            self.messages.iter().map(|m| PyBytes::new(py, &m.payload)),
        )
    }

    /// Every message's key, in order: `list[bytes | None]`.
    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(
            py,
            self.messages
                .iter()
                .map(|m| m.key.as_ref().map(|k| PyBytes::new(py, k))),
        )
    }

    /// Every message's position as text (`offset:42`, ...), in order: `list[str]`.
    fn positions<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.messages.iter().map(|m| m.position.to_string()))
    }

    /// Every message's topic, in order: `list[str]`.
    fn topics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.messages.iter().map(|m| m.topic.as_str()))
    }

    /// Every message's partition, in order: `list[int]`.
    fn partitions<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.messages.iter().map(|m| m.partition))
    }

    /// Every message's timestamp (ms since the epoch, `None` where the platform has none), in
    /// order: `list[int | None]`.
    fn timestamps<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.messages.iter().map(|m| m.timestamp))
    }

    /// `(topic, partition, position)` of the last message of each partition among the first
    /// `count` messages (all when `None`), in order of first appearance: what
    /// `Consumer.commit` takes to commit them.
    #[pyo3(signature = (count=None))]
    fn last_positions(&self, count: Option<usize>) -> Vec<(String, i32, String)> {
        let n = count.map_or(self.messages.len(), |c| c.min(self.messages.len()));
        // Index of the last message per partition; positions are formatted for those only.
        let mut last: Vec<usize> = Vec::new();
        for (i, m) in self.messages[..n].iter().enumerate() {
            let same = |j: &&mut usize| {
                let o = &self.messages[**j];
                o.partition == m.partition && o.topic == m.topic
            };
            match last.iter_mut().find(same) {
                Some(j) => *j = i,
                None => last.push(i),
            }
        }
        last.into_iter()
            .map(|i| {
                let m = &self.messages[i];
                (m.topic.clone(), m.partition, m.position.to_string())
            })
            .collect()
    }

    fn __repr__(&self) -> String {
        format!("MessageBatch(<{} messages>)", self.messages.len())
    }
}

/// Iterates a [`MessageBatch`]'s messages.
#[pyclass(module = "onceflow._native")]
pub struct MessageIter {
    messages: Arc<Vec<RsMessage>>,
    next: usize,
}

#[pymethods]
impl MessageIter {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&mut self) -> Option<Message> {
        let i = self.next;
        (i < self.messages.len()).then(|| {
            self.next += 1;
            Message {
                batch: self.messages.clone(),
                index: i,
            }
        })
    }
}

/// Where a sent record landed.
#[pyclass(frozen, module = "onceflow._native")]
pub struct Delivery {
    /// Topic written to.
    #[pyo3(get)]
    pub topic: String,
    /// Partition written to.
    #[pyo3(get)]
    pub partition: i32,
    /// Position assigned by the platform; `position` gives it as text, formatted when read
    /// (most deliveries of a stream of sends are never read).
    pub position: Position,
    /// Timestamp assigned, ms since the epoch, if known.
    #[pyo3(get)]
    pub timestamp: Option<i64>,
    /// The platform recognised the record as a duplicate of one already written.
    #[pyo3(get)]
    pub duplicate: bool,
    /// How many times the record was sent: 1 when the first attempt was acknowledged. JetStream
    /// publishes again after an ack timeout (same message id) and Kinesis puts again what a
    /// partial failure or throttling refused; Kafka and Pulsar resend inside their client
    /// library without saying so, so it is always 1 there. Each resend is also counted in the
    /// OpenTelemetry counter `onceflow.send_retries`.
    #[pyo3(get)]
    pub attempts: u32,
}

#[pymethods]
impl Delivery {
    /// Position assigned by the platform, as text (`offset:42`, `seq:42`, ...).
    #[getter]
    fn position(&self) -> String {
        self.position.to_string()
    }

    fn __repr__(&self) -> String {
        format!(
            "Delivery(topic={:?}, partition={}, position={:?}, duplicate={}, attempts={})",
            self.topic,
            self.partition,
            self.position.to_string(),
            if self.duplicate { "True" } else { "False" },
            self.attempts
        )
    }
}

impl From<RsDelivery> for Delivery {
    fn from(d: RsDelivery) -> Self {
        Delivery {
            topic: d.topic,
            partition: d.partition,
            position: d.position,
            timestamp: d.timestamp,
            duplicate: d.duplicate,
            attempts: d.attempts,
        }
    }
}

/// Lag of one partition.
#[pyclass(frozen, get_all, module = "onceflow._native")]
pub struct Lag {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The group's committed position (next to read), as text.
    pub committed: Option<String>,
    /// End of the partition, as text.
    pub high_watermark: Option<String>,
    /// Messages between the committed position and the end.
    pub messages: u64,
    /// Milliseconds behind the newest message, where the platform reports it.
    pub millis: Option<u64>,
}

#[pymethods]
impl Lag {
    fn __repr__(&self) -> String {
        format!(
            "Lag(topic={:?}, partition={}, messages={})",
            self.topic, self.partition, self.messages
        )
    }
}

impl From<PartitionLag> for Lag {
    fn from(l: PartitionLag) -> Self {
        Lag {
            topic: l.partition.topic,
            partition: l.partition.partition,
            committed: l.committed.map(|p| p.to_string()),
            high_watermark: l.high_watermark.map(|p| p.to_string()),
            messages: l.messages,
            millis: l.millis,
        }
    }
}

/// A duration argument in seconds: an `int`, a `float` or a `datetime.timedelta` (its
/// `total_seconds()`); anything else is a `TypeError` saying so. The range is checked by
/// [`seconds`].
#[derive(Debug, Clone, Copy)]
pub struct Seconds(pub f64);

impl<'a, 'py> FromPyObject<'a, 'py> for Seconds {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match timedelta_seconds(&obj)? {
            Some(s) => Ok(Seconds(s)),
            None => obj.extract::<f64>().map(Seconds).map_err(|_| {
                PyTypeError::new_err(format!(
                    "expected int, float or datetime.timedelta (seconds), got {}",
                    obj.get_type()
                        .name()
                        .map(|n| n.to_string())
                        .unwrap_or_else(|_| "?".into())
                ))
            }),
        }
    }
}

/// `value.total_seconds()` when `value` is a `datetime.timedelta`.
pub fn timedelta_seconds(value: &Bound<'_, PyAny>) -> PyResult<Option<f64>> {
    if value.is_instance_of::<pyo3::types::PyFloat>()
        || value.is_instance_of::<pyo3::types::PyInt>()
    {
        return Ok(None);
    }
    let timedelta = value.py().import("datetime")?.getattr("timedelta")?;
    if value.is_instance(&timedelta)? {
        return Ok(Some(value.call_method0("total_seconds")?.extract()?));
    }
    Ok(None)
}

/// Seconds (float) → Duration: 0 to 100 years (3 155 760 000 s); refuses negatives, NaN and
/// larger values with a `ConfigError` naming `what` and the value (the bindings' one rule).
pub fn seconds(what: &str, s: f64) -> PyResult<std::time::Duration> {
    crate::errors::py_result(onceflow_bindings::settings::Language::Python.duration(what, s))
}

/// `seq[index]` of a sequence of `n` items made on access by `item`: an int (a negative one
/// counts from the end; `IndexError` naming `what` when out of range) or a slice (a list).
pub(crate) fn sequence_item<'py>(
    py: Python<'py>,
    n: usize,
    index: &Bound<'py, PyAny>,
    what: &str,
    item: impl Fn(usize) -> PyResult<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    if let Ok(slice) = index.cast::<PySlice>() {
        let ix = slice.indices(n as isize)?;
        let mut out = Vec::with_capacity(ix.slicelength);
        let mut i = ix.start;
        for _ in 0..ix.slicelength {
            out.push(item(i as usize)?);
            i += ix.step;
        }
        return Ok(PyList::new(py, out)?.into_any());
    }
    let i: isize = index.extract()?;
    let j = if i < 0 { i + n as isize } else { i };
    if j < 0 || j as usize >= n {
        return Err(PyIndexError::new_err(format!(
            "{what} index {i} out of range for a batch of {n}"
        )));
    }
    item(j as usize)
}
