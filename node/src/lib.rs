//! # onceflow-node
//!
//! The native addon behind the `onceflow` npm package: thin napi-rs wrappers over the
//! `onceflow` facade. Every call that talks to a platform returns a Promise whose work runs on
//! the bindings' tokio runtime ([`onceflow_bindings::runtime`]), so the event loop is never
//! blocked. `index.js` adds what is JavaScript's business: `OnceflowError`, `for await`,
//! `producer.transaction(async tx => ...)` and OpenTelemetry propagation. Conversions only:
//! the behaviour is the Rust crate's.
// napi-derive expands `#[napi]` items into FFI glue that uses `unsafe`.
#![allow(unsafe_code)]

use std::future::Future;

use napi_derive::napi;
use onceflow::{Error, ErrorKind};

mod client;
mod convert;
mod engine;
mod inbox;
mod options;
mod trace;

/// A native error as JavaScript sees it: `index.js` turns a message starting with this
/// marker into an `OnceflowError` from the JSON that follows.
const ERROR_MARKER: &str = "\u{1}onceflow-error:";

/// The JSON description of an onceflow error (kind, code, message, retriable, causes).
pub(crate) fn error_json(e: &Error) -> String {
    let info = onceflow_bindings::error_kind(e.kind());
    let mut causes = Vec::new();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        causes.push(serde_json::Value::String(s.to_string()));
        src = s.source();
    }
    serde_json::json!({
        "kind": info.name,
        "code": info.code,
        "name": info.class,
        "message": onceflow_bindings::error_message(
            onceflow_bindings::settings::Language::Node,
            e.message(),
        ),
        "retriable": e.is_retriable(),
        "outcomeUnknown": e.outcome_unknown(),
        "causes": causes,
    })
    .to_string()
}

/// An onceflow error as a napi error (see [`ERROR_MARKER`]).
pub(crate) fn js_err(e: &Error) -> napi::Error {
    napi::Error::new(
        napi::Status::GenericFailure,
        format!("{ERROR_MARKER}{}", error_json(e)),
    )
}

/// Runs `fut` on the bindings' runtime and converts its error.
pub(crate) async fn on_rt<T, F>(fut: F) -> napi::Result<T>
where
    F: Future<Output = onceflow::Result<T>> + Send + 'static,
    T: Send + 'static,
{
    match onceflow_bindings::runtime().spawn(fut).await {
        Ok(r) => r.map_err(|e| js_err(&e)),
        Err(e) => Err(js_err(&Error::new(
            ErrorKind::Platform,
            format!("onceflow task failed: {e}"),
        ))),
    }
}

/// One error kind as the binding names it.
#[napi(object)]
pub struct ErrorKindInfo {
    /// Lower-case name, e.g. `dedup_store`.
    pub kind: String,
    /// Stable code, e.g. `ONCEFLOW_DEDUP_STORE` (`err.code`).
    pub code: String,
    /// Class-like name, e.g. `DedupStoreError` (`err.name`).
    pub name: String,
}

/// Every error kind, in core's order.
#[napi]
pub fn error_kinds() -> Vec<ErrorKindInfo> {
    onceflow_bindings::error_kinds()
        .into_iter()
        .map(|i| ErrorKindInfo {
            kind: i.name.into(),
            code: i.code.into(),
            name: i.class.into(),
        })
        .collect()
}

/// URL schemes this build can open.
#[napi]
pub fn supported_schemes() -> Vec<String> {
    onceflow::supported_schemes()
        .into_iter()
        .map(String::from)
        .collect()
}

/// The version of the native addon (the Cargo package version).
#[napi]
pub fn native_version() -> String {
    env!("CARGO_PKG_VERSION").to_string()
}
