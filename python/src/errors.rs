//! onceflow errors as Python exceptions: `onceflow.OnceflowError` and one subclass per
//! [`ErrorKind`], each instance carrying `.kind`, `.code`, `.message`, `.retriable` and
//! `.outcome_unknown`, with the native cause chained as `__cause__`.

use onceflow::{BoxError, Error, ErrorKind};
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

pyo3::create_exception!(
    onceflow,
    OnceflowError,
    PyException,
    "Base class of every error onceflow raises; `.kind`, `.code`, `.retriable`."
);
pyo3::create_exception!(
    onceflow,
    NativeError,
    PyException,
    "A native client's error, chained as the `__cause__` of an OnceflowError."
);

/// One class per kind, in `ErrorKind::ALL` order.
static CLASSES: PyOnceLock<Vec<(ErrorKind, Py<PyType>)>> = PyOnceLock::new();

/// Creates the exception classes and adds them to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let base = py.get_type::<OnceflowError>();
    m.add("OnceflowError", &base)?;
    m.add("NativeError", py.get_type::<NativeError>())?;
    let type_fn = py.import("builtins")?.getattr("type")?;
    let mut classes = Vec::new();
    for info in onceflow_bindings::error_kinds() {
        let ns = PyDict::new(py);
        ns.set_item("__module__", "onceflow")?;
        ns.set_item("kind", info.name)?;
        ns.set_item("code", info.code)?;
        ns.set_item(
            "__doc__",
            format!(
                "onceflow error of kind `{}` (code {}).",
                info.name, info.code
            ),
        )?;
        let cls = type_fn
            .call1((info.class, PyTuple::new(py, [&base])?, ns))?
            .cast_into::<PyType>()?;
        m.add(info.class, &cls)?;
        classes.push((info.kind, cls.unbind()));
    }
    let _ = CLASSES.set(py, classes);
    Ok(())
}

/// A Python exception raised by user code (a handler or a transform), carried through the
/// engine as an error source and re-raised as the `__cause__`.
#[derive(Debug)]
pub struct PyCause(pub PyErr);

impl std::fmt::Display for PyCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        Python::attach(|py| {
            let v = self.0.value(py);
            let name = v
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "Exception".into());
            write!(f, "{name}: {v}")
        })
    }
}

impl std::error::Error for PyCause {}

/// A Python exception as an error source for the engine.
pub fn py_box(e: PyErr) -> BoxError {
    Box::new(PyCause(e))
}

fn class_of(py: Python<'_>, kind: ErrorKind) -> Bound<'_, PyType> {
    CLASSES
        .get(py)
        .and_then(|cs| cs.iter().find(|(k, _)| *k == kind))
        .map(|(_, c)| c.bind(py).clone())
        .unwrap_or_else(|| py.get_type::<OnceflowError>())
}

/// The Python exception for `error`, its source chain as `__cause__`s.
pub fn to_pyerr(py: Python<'_>, error: &Error) -> PyErr {
    match build(py, error) {
        Ok(e) => e,
        Err(e) => e,
    }
}

fn build(py: Python<'_>, error: &Error) -> PyResult<PyErr> {
    let info = onceflow_bindings::error_kind(error.kind());
    let value = class_of(py, error.kind()).call1((error.to_string(),))?;
    value.setattr("kind", info.name)?;
    value.setattr("code", info.code)?;
    value.setattr("message", error.message())?;
    value.setattr("retriable", error.is_retriable())?;
    value.setattr("outcome_unknown", error.outcome_unknown())?;
    let err = PyErr::from_value(value);
    if let Some(src) = std::error::Error::source(error) {
        err.set_cause(py, Some(cause(py, src)));
    }
    Ok(err)
}

/// A native cause: the Python exception itself when user code raised it, an onceflow error
/// when one is nested, else a `NativeError` with the cause's text; chained further down.
fn cause(py: Python<'_>, src: &(dyn std::error::Error + 'static)) -> PyErr {
    if let Some(PyCause(e)) = src.downcast_ref::<PyCause>() {
        return e.clone_ref(py);
    }
    if let Some(e) = src.downcast_ref::<Error>() {
        return to_pyerr(py, e);
    }
    let err = NativeError::new_err(src.to_string());
    if let Some(next) = src.source() {
        err.set_cause(py, Some(cause(py, next)));
    }
    err
}

/// `Result<T, onceflow::Error>` → `PyResult<T>`.
pub fn py_result<T>(r: onceflow::Result<T>) -> PyResult<T> {
    r.map_err(|e| Python::attach(|py| to_pyerr(py, &e)))
}

/// A config error raised from the binding itself (bad argument types are TypeErrors; bad
/// values that onceflow would reject are ConfigErrors).
pub fn config_err(message: impl Into<String>) -> PyErr {
    Python::attach(|py| to_pyerr(py, &Error::config(message)))
}
