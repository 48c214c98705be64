//! The span plans of `onceflow::trace::plan` for `onceflow/_otel.py`: the core decides each
//! span's name, kind, attributes, parent headers and links, and how injected trace headers
//! replace a record's own; the Python side only hands them to the `opentelemetry` API.

use onceflow::trace::plan::{self, Attributes, Carrier, Parent, SpanPlan, Value};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::convert::{to_headers, Message, MessageBatch};

fn attributes<'py>(py: Python<'py>, attrs: Attributes) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in attrs {
        match v {
            Value::Str(s) => d.set_item(k, s)?,
            Value::Int(i) => d.set_item(k, i)?,
        }
    }
    Ok(d)
}

fn carrier<'py>(py: Python<'py>, c: Carrier) -> PyResult<Option<Bound<'py, PyDict>>> {
    if c.is_empty() {
        return Ok(None);
    }
    let d = PyDict::new(py);
    for (k, v) in c {
        d.set_item(k, v)?;
    }
    Ok(Some(d))
}

/// `(name, kind, attributes, parent_mode, parent_carrier, links)`: kind `"producer"` or
/// `"consumer"`; parent_mode `"current"`, `"current_else"` or `"headers"`; the carrier a dict
/// of trace headers or `None`; links a list of carriers.
type PlanTuple<'py> = (
    String,
    &'static str,
    Bound<'py, PyDict>,
    &'static str,
    Option<Bound<'py, PyDict>>,
    Bound<'py, PyList>,
);

fn to_py<'py>(py: Python<'py>, p: SpanPlan) -> PyResult<PlanTuple<'py>> {
    let (mode, c) = match p.parent {
        Parent::Current => ("current", None),
        Parent::CurrentElse(c) => ("current_else", carrier(py, c)?),
        Parent::Headers(c) => ("headers", carrier(py, c)?),
    };
    let links = PyList::empty(py);
    for l in p.links {
        links.append(carrier(py, l)?)?;
    }
    Ok((
        p.name,
        p.kind.as_str(),
        attributes(py, p.attributes)?,
        mode,
        c,
        links,
    ))
}

/// The producer span of a send of `count` records to `topic` (`body_size`: the payload's
/// bytes for one record), whose own trace headers are `headers`.
#[pyfunction]
#[pyo3(signature = (system, topic, count, body_size, headers))]
fn send_span_plan<'py>(
    py: Python<'py>,
    system: &str,
    topic: &str,
    count: usize,
    body_size: Option<usize>,
    headers: Option<&Bound<'py, PyAny>>,
) -> PyResult<PlanTuple<'py>> {
    let own = plan::carrier_of(&to_headers(headers)?);
    to_py(py, plan::send(system, topic, count, body_size, own))
}

/// The consumer span of processing `message` by a member of `group`.
#[pyfunction]
fn process_span_plan<'py>(
    py: Python<'py>,
    message: PyRef<'py, Message>,
    system: &str,
    group: &str,
) -> PyResult<PlanTuple<'py>> {
    to_py(py, plan::process(system, group, message.rs()))
}

/// The trace headers `message` carries (`{name: value}`, names lowercase), or `None`: the
/// context its process span would continue, without planning the span.
#[pyfunction]
fn trace_carrier<'py>(
    py: Python<'py>,
    message: PyRef<'py, Message>,
) -> PyResult<Option<Bound<'py, PyDict>>> {
    carrier(py, plan::trace_carrier(message.rs()))
}

/// The consumer span of processing `batch` together.
#[pyfunction]
fn process_batch_span_plan<'py>(
    py: Python<'py>,
    batch: PyRef<'py, MessageBatch>,
    system: &str,
    group: &str,
) -> PyResult<PlanTuple<'py>> {
    to_py(py, plan::process_batch(system, group, batch.rs_messages()))
}

/// The attributes of a send span whose record the platform acknowledged.
#[pyfunction]
fn delivered_span_attributes<'py>(
    py: Python<'py>,
    partition: i32,
    position: &str,
) -> PyResult<Bound<'py, PyDict>> {
    attributes(py, plan::delivered_at(partition, position))
}

/// The attributes of a span whose operation failed with error code `code`.
#[pyfunction]
fn failed_span_attributes<'py>(py: Python<'py>, code: &str) -> PyResult<Bound<'py, PyDict>> {
    attributes(py, plan::failed(code))
}

/// Whether one send span can parent every record of a batch whose headers are `headers`.
#[pyfunction]
fn one_span_for_batch(headers: Vec<Option<Bound<'_, PyAny>>>) -> PyResult<bool> {
    let carriers = headers
        .iter()
        .map(|h| Ok(plan::carrier_of(&to_headers(h.as_ref())?)))
        .collect::<PyResult<Vec<_>>>()?;
    Ok(plan::one_span_for_batch(&carriers))
}

/// `headers` with the `injected` trace headers applied (see `plan::apply`), as a list of
/// `(name, value)`.
#[pyfunction]
fn apply_trace_headers<'py>(
    py: Python<'py>,
    headers: Option<&Bound<'py, PyAny>>,
    injected: Vec<(String, String)>,
) -> PyResult<Bound<'py, PyList>> {
    let mut h = to_headers(headers)?;
    plan::apply(&mut h, &injected);
    let items: Vec<(String, Option<Bound<'py, PyBytes>>)> = h
        .iter()
        .map(|x| {
            (
                x.name.clone(),
                x.value.as_ref().map(|v| PyBytes::new(py, v)),
            )
        })
        .collect();
    PyList::new(py, items)
}

/// Registers the functions (private: `onceflow._otel` is their only caller).
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(send_span_plan, m)?)?;
    m.add_function(wrap_pyfunction!(process_span_plan, m)?)?;
    m.add_function(wrap_pyfunction!(trace_carrier, m)?)?;
    m.add_function(wrap_pyfunction!(process_batch_span_plan, m)?)?;
    m.add_function(wrap_pyfunction!(delivered_span_attributes, m)?)?;
    m.add_function(wrap_pyfunction!(failed_span_attributes, m)?)?;
    m.add_function(wrap_pyfunction!(one_span_for_batch, m)?)?;
    m.add_function(wrap_pyfunction!(apply_trace_headers, m)?)?;
    Ok(())
}
