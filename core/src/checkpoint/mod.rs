//! Lease tables and checkpoints for consumer groups that coordinate themselves: the
//! [`CheckpointStore`] trait and the built-in `memory` and `embedded` stores.
//!
//! A platform without broker-side consumer groups (Kinesis) spreads its shards over the workers
//! of a group through a **lease table**, the way AWS's Kinesis Client Library does with its
//! DynamoDB table (see the KCL documentation, "Use a lease table to track the shards processed by
//! the KCL consumer application"). This module is that table, kept in the same kinds of stores as
//! the dedup store: `memory`, `embedded` (SQLite), and Redis / PostgreSQL in their own crates.
//!
//! # The table
//!
//! Rows are addressed by a **group** (the application name; groups never see each other's rows)
//! and a **lease key** (for Kinesis the shard id, such as `shardId-000000000003`). A row
//! ([`Lease`]) holds:
//!
//! - `owner`: the worker holding the lease, or none.
//! - `counter`: the **lease counter**, a `u64` that starts at 0 when the row is created and is
//!   incremented by one by every successful [`take`](CheckpointStore::take),
//!   [`renew`](CheckpointStore::renew) and [`release`](CheckpointStore::release) (and by nothing
//!   else). Compare-and-set on the counter is the fencing: every mutating call carries the
//!   counter its caller last saw and fails when the counter moved.
//! - the lease's **expiry**, measured on the store's clock where the store has one (Redis
//!   `TIME`, PostgreSQL `now()`, the wall clock of the machine for `embedded`, a monotonic clock
//!   for `memory`). Readers see it as [`Lease::expires_in`], the time left (zero once expired).
//!   Workers never compare their own clocks with the store's.
//! - `checkpoint`: an opaque string, or none: what the platform's consumer stores there is its
//!   own (for Kinesis, `onceflow_kinesis`, the sequence number of the last record handled or its
//!   end-of-shard mark).
//! - `parents`: lease keys this one descends from (resharding). The store only keeps them; the
//!   platform's consumer decides when a child is readable from its parents' checkpoints.
//!
//! # Operations and their exact semantics
//!
//! Every operation works on one group and is **batched** (many keys, one round trip); each item
//! has its own outcome, in the order of the request. Each item is **atomic and linearisable per
//! row**: two concurrent takes of the same row with the same expected counter give exactly one
//! success. Items of one batch need not be atomic together.
//!
//! | operation | succeeds when (checked atomically) | effect |
//! |---|---|---|
//! | [`list`](CheckpointStore::list) | always | every row of the group, by lease key ascending |
//! | [`get`](CheckpointStore::get) | always | the rows asked for (`None`: no row) |
//! | [`create`](CheckpointStore::create) | no row with that key | new row: no owner, counter 0, the given checkpoint and parents; an existing row is left untouched (`false`) |
//! | [`take`](CheckpointStore::take) | the row exists, its counter equals `expected_counter`, and it is unowned, or its lease expired, or its owner is the taker | owner := taker, counter += 1, expiry := now + `lease`; checkpoint and parents unchanged |
//! | [`renew`](CheckpointStore::renew) | the row exists, owner = the caller, counter = the caller's (an expired lease nobody took yet is renewed) | counter += 1, expiry := now + `lease` |
//! | [`release`](CheckpointStore::release) | owner = the caller, counter = the caller's | owner := none, counter += 1, no expiry; checkpoint kept (graceful handoff: another worker can take it at once) |
//! | [`checkpoint`](CheckpointStore::checkpoint) | owner = the caller, counter = the caller's (expiry is not checked: until someone takes the row over, the holder's work is still the only work) | checkpoint := the given string; counter and expiry unchanged |
//! | [`delete`](CheckpointStore::delete) | the row exists | the row is removed |
//!
//! A caller holding a lease keeps the counter returned by its last successful take or renew and
//! passes it to the next renew, checkpoint or release. A `false` / [`None`] outcome on those
//! means the lease is lost: the worker must stop working on that key and drop its in-flight work
//! (anything it writes afterwards is refused by the counter check). Outcomes are values, not
//! errors; errors are for a store that failed.
//!
//! Owners are non-empty strings; the group and key are non-empty strings of any characters.
//! Errors are of kind [`crate::ErrorKind::DedupStore`] (the checkpoint stores are the dedup
//! stores' backends), or `Connect`/`Timeout` for a store that cannot be reached, or `Config` for
//! an empty group, key or owner.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::error::{Error, Result};

pub mod embedded;
pub mod memory;
mod row;

pub use embedded::EmbeddedCheckpointStore;
pub use memory::MemoryCheckpointStore;

/// The lease counter: starts at 0, incremented by every take, renew and release of a row.
pub type LeaseCounter = u64;

/// One row of the lease table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The lease key (for Kinesis the shard id).
    pub key: String,
    /// The worker holding the lease, if any (an expired holder is still shown until someone
    /// takes the lease over; see [`expires_in`](Self::expires_in)).
    pub owner: Option<String>,
    /// The lease counter.
    pub counter: LeaseCounter,
    /// Time left on the lease, measured on the store's clock at the time of the read: zero when
    /// expired or unowned.
    pub expires_in: Duration,
    /// Opaque checkpoint (the platform consumer's own string), if any.
    pub checkpoint: Option<String>,
    /// Keys of the parent leases (resharding), in the order given at creation.
    pub parents: Vec<String>,
}

impl Lease {
    /// Whether a [`take`](CheckpointStore::take) by anyone may succeed at the time of the read:
    /// no owner, or the lease expired.
    pub fn is_available(&self) -> bool {
        self.owner.is_none() || self.expires_in.is_zero()
    }
}

/// A row to create if absent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewLease {
    /// The lease key.
    pub key: String,
    /// Initial checkpoint (usually none: the consumer's start position applies).
    pub checkpoint: Option<String>,
    /// Keys of the parent leases.
    pub parents: Vec<String>,
}

/// One take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakeRequest {
    /// The lease key.
    pub key: String,
    /// The taking worker.
    pub owner: String,
    /// The counter the taker last read; the take fails if the row's counter differs.
    pub expected_counter: LeaseCounter,
    /// How long the lease holds without renewal.
    pub lease: Duration,
}

/// Result of one take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TakeOutcome {
    /// The caller holds the lease, with this (new) counter.
    Taken {
        /// The row's counter after the take (`expected_counter + 1`).
        counter: LeaseCounter,
    },
    /// The take was refused; the row as it is now (`None`: no such row). Refused because the
    /// counter moved, or another worker holds an unexpired lease.
    Refused {
        /// The current row.
        current: Option<Lease>,
    },
}

/// A held lease, as passed to renew and release.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldLease {
    /// The lease key.
    pub key: String,
    /// The holder.
    pub owner: String,
    /// The counter from the holder's last successful take or renew.
    pub counter: LeaseCounter,
}

/// One checkpoint write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointRequest {
    /// The lease key.
    pub key: String,
    /// The holder.
    pub owner: String,
    /// The counter from the holder's last successful take or renew.
    pub counter: LeaseCounter,
    /// The new checkpoint.
    pub checkpoint: String,
}

/// A lease table with checkpoints. Implementations must be linearisable per row; see the
/// [module documentation](self) for the exact semantics of each operation, which every store
/// shares and the conformance suite (`checkpoint_suite!` in `onceflow-conformance`) checks.
#[async_trait]
pub trait CheckpointStore: Send + Sync {
    /// Store name for logs and metrics (`memory`, `embedded`, `redis`, `postgres`).
    fn name(&self) -> &'static str;

    /// Every row of `group`, by lease key ascending (byte order).
    async fn list(&self, group: &str) -> Result<Vec<Lease>>;

    /// The rows for `keys`, in order; `None` where there is no row.
    async fn get(&self, group: &str, keys: &[String]) -> Result<Vec<Option<Lease>>>;

    /// Creates rows that do not exist yet; `true` where this call created the row, `false`
    /// where a row with that key already existed (it is left untouched).
    async fn create(&self, group: &str, leases: &[NewLease]) -> Result<Vec<bool>>;

    /// Takes leases (compare-and-set on the counter; succeeds for an unowned or expired lease,
    /// or one the taker already holds).
    async fn take(&self, group: &str, requests: &[TakeRequest]) -> Result<Vec<TakeOutcome>>;

    /// Renews held leases to `lease` from now; the new counter, or `None` where the lease is
    /// lost (owner or counter differ, or no row).
    async fn renew(
        &self,
        group: &str,
        leases: &[HeldLease],
        lease: Duration,
    ) -> Result<Vec<Option<LeaseCounter>>>;

    /// Gives held leases up (graceful handoff); `false` where the lease was already lost.
    async fn release(&self, group: &str, leases: &[HeldLease]) -> Result<Vec<bool>>;

    /// Writes checkpoints, fenced by owner and counter; `false` where refused (stale holder).
    async fn checkpoint(&self, group: &str, requests: &[CheckpointRequest]) -> Result<Vec<bool>>;

    /// Deletes rows; `true` where a row was deleted.
    async fn delete(&self, group: &str, keys: &[String]) -> Result<Vec<bool>>;
}

/// Single-row conveniences over the batched [`CheckpointStore`] operations.
#[async_trait]
pub trait CheckpointStoreExt: CheckpointStore {
    /// Reads one row.
    async fn get_one(&self, group: &str, key: &str) -> Result<Option<Lease>> {
        Ok(self.get(group, &[key.to_string()]).await?.remove(0))
    }
    /// Creates one row if absent.
    async fn create_one(&self, group: &str, lease: NewLease) -> Result<bool> {
        Ok(self
            .create(group, std::slice::from_ref(&lease))
            .await?
            .remove(0))
    }
    /// Takes one lease.
    async fn take_one(&self, group: &str, request: TakeRequest) -> Result<TakeOutcome> {
        Ok(self
            .take(group, std::slice::from_ref(&request))
            .await?
            .remove(0))
    }
    /// Renews one lease.
    async fn renew_one(
        &self,
        group: &str,
        held: &HeldLease,
        lease: Duration,
    ) -> Result<Option<LeaseCounter>> {
        Ok(self
            .renew(group, std::slice::from_ref(held), lease)
            .await?
            .remove(0))
    }
    /// Releases one lease.
    async fn release_one(&self, group: &str, held: &HeldLease) -> Result<bool> {
        Ok(self
            .release(group, std::slice::from_ref(held))
            .await?
            .remove(0))
    }
    /// Writes one checkpoint.
    async fn checkpoint_one(&self, group: &str, request: CheckpointRequest) -> Result<bool> {
        Ok(self
            .checkpoint(group, std::slice::from_ref(&request))
            .await?
            .remove(0))
    }
    /// Deletes one row.
    async fn delete_one(&self, group: &str, key: &str) -> Result<bool> {
        Ok(self.delete(group, &[key.to_string()]).await?.remove(0))
    }
}

impl<T: CheckpointStore + ?Sized> CheckpointStoreExt for T {}

/// Shared handle to a checkpoint store.
pub type SharedCheckpointStore = Arc<dyn CheckpointStore>;

/// Checks the group and every key / owner of a call: all non-empty. Stores call this first so
/// every store refuses the same input with the same error.
pub fn validate<'a>(
    group: &str,
    keys: impl IntoIterator<Item = &'a str>,
    owners: impl IntoIterator<Item = &'a str>,
) -> Result<()> {
    if group.is_empty() {
        return Err(Error::config(
            "checkpoint store: the group (application name) is empty; expected a non-empty name",
        ));
    }
    if keys.into_iter().any(str::is_empty) {
        return Err(Error::config(format!(
            "checkpoint store: an empty lease key in group '{group}'; expected a shard id such \
             as shardId-000000000000"
        )));
    }
    if owners.into_iter().any(str::is_empty) {
        return Err(Error::config(format!(
            "checkpoint store: an empty owner in group '{group}'; expected a worker id"
        )));
    }
    Ok(())
}

/// Opens a checkpoint store from a URL, in the forms [`crate::dedup::open`] accepts:
///
/// - `memory://`: a new in-process [`MemoryCheckpointStore`] (each call creates a new one).
/// - `embedded:///absolute/path.db` (percent-escapes decoded) or a plain file path such as
///   `./leases.db`: an on-disk [`EmbeddedCheckpointStore`] that survives restarts and can be
///   shared by processes on one machine. It may be the same file as an embedded dedup store
///   (the tables differ).
///
/// Other stores (Redis, PostgreSQL) live in their own crates: [`open_with`] opens them through
/// their registry entries (the `onceflow` facade's `onceflow::checkpoint_store` does).
///
/// Errors: [`crate::ErrorKind::Config`] for any other scheme, an option (none are defined) or a
/// bare scheme name such as `memory`, naming the value and listing the supported forms;
/// [`crate::ErrorKind::DedupStore`] for an embedded path that cannot be opened, naming it.
pub async fn open(url: &str) -> Result<SharedCheckpointStore> {
    open_with(url, &[]).await
}

/// [`open`], and also the stores of `stores` (the registry entries of the store crates in the
/// build, `onceflow::STORES`): a URL of one of their schemes is opened by its entry, and the
/// errors list their schemes among the supported forms.
///
/// Errors: those of [`open`], and those of the entry that opens the URL.
pub async fn open_with(
    url: &str,
    stores: &[&crate::registry::StoreEntry],
) -> Result<SharedCheckpointStore> {
    // Errors show the URL without its credentials.
    let shown = crate::error::redact_credentials(url);
    let supported = crate::registry::forms_with_stores(
        &[
            "memory://",
            "embedded:///absolute/path.db",
            "a plain file path",
        ],
        stores,
    );
    let trimmed = url.trim();
    if trimmed.is_empty() {
        return Err(Error::config(format!(
            "empty checkpoint store URL: expected one of {supported}"
        )));
    }
    let Some((scheme, rest)) = trimmed.split_once("://") else {
        let bare = trimmed.trim_end_matches(':').to_ascii_lowercase();
        if ["memory", "embedded"].contains(&&*bare)
            || crate::registry::is_store_scheme(stores, &bare)
        {
            return Err(Error::config(format!(
                "checkpoint store '{shown}' looks like a URL scheme without '://' (did you mean \
                 '{bare}://'?); to use a file of that name, write ./{trimmed}"
            )));
        }
        return Ok(Arc::new(EmbeddedCheckpointStore::open(trimmed).await?));
    };
    if let Some(entry) = crate::registry::store_for(stores, scheme) {
        return (entry.checkpoint)(url.to_string()).await;
    }
    match scheme.to_ascii_lowercase().as_str() {
        "memory" => {
            if !rest.is_empty() && rest != "/" {
                return Err(Error::config(format!(
                    "memory checkpoint store URL '{shown}' has '{rest}' after the scheme, but a \
                     memory store takes no name or options: expected memory://",
                    rest = rest.rsplit('@').next().unwrap_or(rest)
                )));
            }
            Ok(Arc::new(MemoryCheckpointStore::new()))
        }
        "embedded" => {
            if !rest.starts_with('/') || rest.contains(['?', '#']) {
                return Err(Error::config(format!(
                    "embedded checkpoint store URL '{shown}' must be embedded:///absolute/path.db \
                     (three slashes, no options), or give a plain file path"
                )));
            }
            let path = percent_decode(rest).ok_or_else(|| {
                Error::config(format!(
                    "embedded checkpoint store URL '{shown}' decodes to a path that is not UTF-8"
                ))
            })?;
            Ok(Arc::new(EmbeddedCheckpointStore::open(path).await?))
        }
        _ => Err(Error::config(format!(
            "unknown checkpoint store URL scheme '{scheme}://' in '{shown}': expected one of \
             {supported}{}",
            if stores.is_empty() {
                " (stores in their own crates, such as Redis or PostgreSQL, open through \
                 onceflow::checkpoint_store)"
            } else {
                ""
            }
        ))),
    }
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                decoded.push(b);
                i += 3;
            }
            (b, _) => {
                decoded.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(decoded).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[tokio::test]
    async fn open_parses_urls() {
        assert_eq!(open("memory://").await.unwrap().name(), "memory");
        for (url, kind) in [
            ("", ErrorKind::Config),
            ("memory", ErrorKind::Config),
            ("memory://x", ErrorKind::Config),
            ("embedded://relative.db", ErrorKind::Config),
            ("ftp://x", ErrorKind::Config),
            // Stores of their own crates open through `open_with` and their registry entries.
            ("redis://127.0.0.1", ErrorKind::Config),
            ("postgres://127.0.0.1/db", ErrorKind::Config),
        ] {
            let err = open(url)
                .await
                .err()
                .unwrap_or_else(|| panic!("{url} opened"));
            assert_eq!(err.kind(), kind, "{url}: {err}");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a b.db");
        let url = format!(
            "embedded://{}",
            path.display().to_string().replace(' ', "%20")
        );
        assert_eq!(open(&url).await.unwrap().name(), "embedded");
        assert!(path.exists());
    }

    #[tokio::test]
    async fn empty_names_are_config_errors() {
        let store = MemoryCheckpointStore::new();
        assert_eq!(store.list("").await.unwrap_err().kind(), ErrorKind::Config);
        let err = store
            .take_one(
                "g",
                TakeRequest {
                    key: "k".into(),
                    owner: String::new(),
                    expected_counter: 0,
                    lease: Duration::from_secs(1),
                },
            )
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
    }
}
