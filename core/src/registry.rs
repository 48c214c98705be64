//! The backend registry: each platform adapter and each shared store crate describes itself
//! once (its URL schemes and how to open it), and the `onceflow` facade, the CLI and the
//! bindings ask the registry instead of matching scheme strings. Adding a platform is its own
//! crate plus one line in the facade's list (see `docs/adding-a-platform.md`).
//!
//! Core itself names no platform: the entries live in the adapter crates
//! (`onceflow_kafka::PLATFORM`, `onceflow_redis::STORE`, …).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::checkpoint::SharedCheckpointStore;
use crate::client::Client;
use crate::dedup::SharedDedupStore;
use crate::error::Result;

/// A boxed, sendable future of a `Result`: what a registry entry's openers return.
pub type Opening<T> = Pin<Box<dyn Future<Output = Result<T>> + Send>>;

/// What a platform's `connect` may need from the rest of the build: the checkpoint stores it
/// can open (a Kinesis consumer group's lease table may be on Redis or PostgreSQL, whose crates
/// the adapter does not depend on).
#[derive(Clone, Copy)]
pub struct Openers {
    /// Opens a checkpoint store by URL, through every store this build registers.
    pub checkpoint_store: fn(String) -> Opening<SharedCheckpointStore>,
}

/// A platform adapter's entry.
pub struct PlatformEntry {
    /// The platform's name as [`Client::platform`] reports it (`kafka`, `jetstream`, …).
    pub name: &'static str,
    /// The URL schemes it opens, with `://` (`nats://` and `tls://` for JetStream).
    pub schemes: &'static [&'static str],
    /// Connects to the platform named by a URL of one of its schemes.
    pub connect: fn(url: String, openers: Openers) -> Opening<Client>,
}

/// A shared store crate's entry (dedup store and checkpoint store on one server kind).
pub struct StoreEntry {
    /// The store's name (`redis`, `postgres`).
    pub name: &'static str,
    /// The URL schemes it opens, with `://` (`redis://` and `rediss://`).
    pub schemes: &'static [&'static str],
    /// Opens a dedup store remembering completed keys for the window.
    pub dedup: fn(url: String, window: Duration) -> Opening<SharedDedupStore>,
    /// Opens a checkpoint store (lease table).
    pub checkpoint: fn(url: String) -> Opening<SharedCheckpointStore>,
}

/// The scheme of `url` (before `://`), lowercased; `None` without `://`.
pub fn scheme_of(url: &str) -> Option<String> {
    url.trim()
        .split_once("://")
        .map(|(s, _)| s.to_ascii_lowercase())
}

/// Whether `schemes` (`kafka://`, …) holds `scheme` (without `://`, any case).
fn holds(schemes: &[&str], scheme: &str) -> bool {
    schemes.iter().any(|s| {
        s.strip_suffix("://")
            .is_some_and(|s| s.eq_ignore_ascii_case(scheme))
    })
}

/// The entry among `entries` that opens `scheme` (without `://`).
pub fn platform_for<'a>(entries: &[&'a PlatformEntry], scheme: &str) -> Option<&'a PlatformEntry> {
    entries.iter().copied().find(|e| holds(e.schemes, scheme))
}

/// The entry among `entries` that opens `scheme` (without `://`).
pub fn store_for<'a>(entries: &[&'a StoreEntry], scheme: &str) -> Option<&'a StoreEntry> {
    entries.iter().copied().find(|e| holds(e.schemes, scheme))
}

/// Whether `name` (without `://`, any case) is a scheme of one of `stores`: a bare `redis` is a
/// forgotten `://` when a registered store opens `redis://`.
pub fn is_store_scheme(stores: &[&StoreEntry], name: &str) -> bool {
    store_for(stores, name).is_some()
}

/// An opener's catalogue of the URL forms it accepts, for its errors: its own `forms`, then
/// each of `stores`' first scheme (`redis://…`), as `a, b, c or d`.
pub fn forms_with_stores(forms: &[&str], stores: &[&StoreEntry]) -> String {
    let mut all: Vec<String> = forms.iter().map(|f| f.to_string()).collect();
    all.extend(
        stores
            .iter()
            .filter_map(|e| e.schemes.first())
            .map(|s| format!("{s}…")),
    );
    match all.split_last() {
        None => String::new(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
    }
}

/// An opener for [`PlatformEntry::connect`] / [`StoreEntry`] from an async function: boxes its
/// future.
pub fn boxed<T, F>(f: F) -> Opening<T>
where
    F: Future<Output = Result<T>> + Send + 'static,
{
    Box::pin(f)
}

/// A [`Client`] from an adapter's platform backend (for [`PlatformEntry::connect`]).
pub fn client<P: crate::backend::PlatformBackend + 'static>(p: Arc<P>) -> Client {
    Client::new(p)
}
