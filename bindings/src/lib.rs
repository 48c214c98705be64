//! # onceflow-bindings
//!
//! The small, language-neutral layer onceflow's bindings (Python through pyo3, Node through
//! napi-rs) share, so each binding only converts types and errors:
//!
//! - [`runtime`]: the one tokio runtime a binding runs onceflow on. It is built on first use
//!   and built again in a child process after `fork()` (the parent's worker threads do not
//!   exist in the child, so its runtime would hang).
//! - [`settings`]: engine and pipeline settings from a binding's options, one table of names,
//!   kinds and limits spelled per [`settings::Language`].
//! - [`raw_options`]: raw client options (`key=value` for the native client) from strings,
//!   booleans and numbers, by one rule for every binding and every place that takes them.
//! - [`durability`]: the durability fields of a topic description (JetStream's `storage`,
//!   `replicas`, `sync`, `durable_on_ack`), typed.
//! - [`inbox`]: the transactional inbox on PostgreSQL or the embedded store with a handler in
//!   the host language, whose SQL runs in the message's transaction through an [`inbox::InboxTx`].
//! - [`yielded`]: what `commit()` without arguments commits, the last message handed out of
//!   each partition.
//! - [`error_kinds`]: every [`ErrorKind`] with its stable code and the exception/class name a
//!   binding gives it.

pub mod durability;
pub mod inbox;
pub mod raw_options;
pub mod settings;
pub mod yielded;

use std::sync::Arc;

use onceflow::ErrorKind;
use parking_lot::Mutex;

/// The process that built the current runtime, and the runtime.
static RUNTIME: Mutex<Option<(u32, Arc<tokio::runtime::Runtime>)>> = Mutex::new(None);

/// Worker threads of the bindings' runtime: onceflow's work is I/O bound, and the host
/// language's own threads need the cores too.
const WORKER_THREADS: usize = 2;

/// The bindings' tokio runtime (multi-threaded, I/O and timers enabled).
///
/// Safe across `fork()`: a child process gets a new runtime on its first call. The parent's
/// runtime is leaked in the child rather than dropped, because dropping it would wait for
/// worker threads that were not copied by `fork()`.
pub fn runtime() -> Arc<tokio::runtime::Runtime> {
    let pid = std::process::id();
    let mut slot = RUNTIME.lock();
    if let Some((owner, rt)) = slot.as_ref() {
        if *owner == pid {
            return rt.clone();
        }
    }
    if let Some((_, stale)) = slot.take() {
        // Built by the parent before fork(): its threads are gone; never drop it here.
        std::mem::forget(stale);
    }
    let rt = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(WORKER_THREADS)
            .thread_name("onceflow")
            .enable_all()
            .build()
            .expect("building the onceflow tokio runtime"),
    );
    *slot = Some((pid, rt.clone()));
    rt
}

/// Stops the runtime at process exit, waiting at most `timeout` for its tasks, so that no
/// worker thread runs while the host language tears its interpreter down. Call it with the
/// host's lock released (Python's GIL). A later [`runtime`] call builds a new runtime.
pub fn shutdown(timeout: std::time::Duration) {
    let taken = RUNTIME.lock().take();
    if let Some((owner, rt)) = taken {
        if owner != std::process::id() {
            std::mem::forget(rt);
            return;
        }
        match Arc::try_unwrap(rt) {
            Ok(rt) => rt.shutdown_timeout(timeout),
            // Still borrowed by a running call: let it be, the process is ending.
            Err(rt) => std::mem::forget(rt),
        }
    }
}

/// One error kind as the bindings name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorKindInfo {
    /// The kind.
    pub kind: ErrorKind,
    /// Lower-case name, e.g. `dedup_store` (Python's `err.kind`).
    pub name: &'static str,
    /// Stable code, e.g. `ONCEFLOW_DEDUP_STORE` (Node's `err.code`, Python's `err.code`).
    pub code: &'static str,
    /// Exception / class name, e.g. `DedupStoreError`.
    pub class: &'static str,
}

/// Names of one kind: `(name, class)`. Exhaustive over the kinds core has today; a kind added
/// later falls back to `platform` until it is named here (the bindings' tests check none does).
fn names(kind: ErrorKind) -> (&'static str, &'static str) {
    match kind {
        ErrorKind::Config => ("config", "ConfigError"),
        ErrorKind::Auth => ("auth", "AuthError"),
        ErrorKind::Connect => ("connect", "ConnectError"),
        ErrorKind::Timeout => ("timeout", "TimeoutError"),
        ErrorKind::Fenced => ("fenced", "FencedError"),
        ErrorKind::Aborted => ("aborted", "AbortedError"),
        ErrorKind::Serialization => ("serialization", "SerializationError"),
        ErrorKind::DedupStore => ("dedup_store", "DedupStoreError"),
        ErrorKind::Conflict => ("conflict", "ConflictError"),
        ErrorKind::Unsupported => ("unsupported", "UnsupportedError"),
        ErrorKind::NotFound => ("not_found", "NotFoundError"),
        ErrorKind::Handler => ("handler", "HandlerError"),
        ErrorKind::Closed => ("closed", "ClosedError"),
        ErrorKind::Platform => ("platform", "PlatformError"),
        _ => ("platform", "PlatformError"),
    }
}

/// How the bindings name `kind`.
pub fn error_kind(kind: ErrorKind) -> ErrorKindInfo {
    let (name, class) = names(kind);
    ErrorKindInfo {
        kind,
        name,
        code: kind.code(),
        class,
    }
}

/// `message` in `language`'s words: core names the operation that failed in front of its
/// messages as Rust and Python spell it (`rewind_uncommitted: …`, `commit_offsets: …`); for
/// Node that name is spelled as its users call it (`rewindUncommitted: …`). Only the API's
/// operations are renamed: other messages may start with a name the user wrote as it is in
/// every language (a URL option, `tls_trust_certs: …`) or a platform's own call
/// (`commit_transaction: …`).
pub fn error_message(language: settings::Language, message: &str) -> std::borrow::Cow<'_, str> {
    /// The operations of the API whose snake_case names core puts in front of its messages
    /// (`Consumer::rewind_uncommitted`, `Transaction::commit_offsets`).
    const OPERATIONS: &[&str] = &["commit_offsets", "rewind_uncommitted"];
    let Some((op, rest)) = message.split_once(": ") else {
        return message.into();
    };
    if !OPERATIONS.contains(&op) {
        return message.into();
    }
    let spelled = language.spell(op, false);
    if spelled == op {
        return message.into();
    }
    format!("{spelled}: {rest}").into()
}

/// Every error kind, in [`ErrorKind::ALL`] order.
pub fn error_kinds() -> Vec<ErrorKindInfo> {
    ErrorKind::ALL.iter().map(|k| error_kind(*k)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_messages_name_the_operation_as_the_language_spells_it() {
        use settings::Language;
        let m = "rewind_uncommitted: topic 'x' is not read by this consumer";
        assert_eq!(
            error_message(Language::Node, m),
            "rewindUncommitted: topic 'x' is not read by this consumer"
        );
        assert_eq!(error_message(Language::Python, m), m);
        assert_eq!(
            error_message(Language::Node, "commit_offsets: partition -1 of topic 't'"),
            "commitOffsets: partition -1 of topic 't'"
        );
        for kept in [
            "commit: partition -1 of topic 't'",
            "position pulsar:1:2:0:-1 is a message of partition 0: commit_offsets later",
            "no operation here",
            "Snake_Case: not an operation",
            // A URL option, written snake_case in Node's URLs too, and librdkafka's call.
            "tls_trust_certs: cannot read '/nope.pem': No such file or directory",
            "commit_transaction: no answer within 10s",
        ] {
            assert_eq!(error_message(Language::Node, kept), kept);
        }
    }

    #[test]
    fn every_kind_has_its_own_class() {
        let infos = error_kinds();
        let mut classes: Vec<_> = infos.iter().map(|i| i.class).collect();
        classes.sort();
        classes.dedup();
        assert_eq!(classes.len(), ErrorKind::ALL.len());
        let fenced = error_kind(ErrorKind::Fenced);
        assert_eq!(fenced.code, "ONCEFLOW_FENCED");
        assert_eq!(fenced.name, "fenced");
    }

    #[test]
    fn runtime_is_reused_in_one_process() {
        let a = runtime();
        let b = runtime();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(a.block_on(async { 1 + 1 }), 2);
    }
}
