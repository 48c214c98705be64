//! Dedup (idempotency) stores: the [`DedupStore`] trait and the built-in `memory` and
//! `embedded` stores.
//!
//! A key moves through two states. A **claim** takes a key for one worker with a lease (the key
//! is *in progress*); the worker runs its handler, renewing the lease while it runs, then
//! **completes** the key (it is *done* and stays so for the store's dedup window) or
//! **releases** it (the key is free again, so a redelivery runs the handler again). Every claim
//! returns a **fencing token**, strictly increasing per key while the key is stored: renew,
//! complete and release carry it, and the store refuses them when the token is no longer the
//! current holder's (the lease expired and another worker took the key over).
//!
//! Every operation is batched (one round trip for many keys); the single-key helpers on
//! [`DedupStoreExt`] call the batched ones.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use crate::error::{Error, Result};

pub mod embedded;
pub mod memory;

pub use embedded::EmbeddedStore;
pub use memory::MemoryStore;

/// A fingerprint of a payload: 128-bit XXH3 of the bytes. The same key arriving with a different
/// fingerprint is a [`ClaimOutcome::Mismatch`], not a duplicate.
pub type Fingerprint = u128;

/// Computes the [`Fingerprint`] of a payload.
pub fn fingerprint(payload: &[u8]) -> Fingerprint {
    xxhash_rust::xxh3::xxh3_128(payload)
}

/// Fencing token of a claim: strictly increasing per key while the key is stored.
pub type FencingToken = u64;

/// One key to claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRequest {
    /// The idempotency key.
    pub key: String,
    /// The worker asking. A worker may re-claim a key it already holds (after a restart with the
    /// same worker id) and gets a new token.
    pub owner: String,
    /// How long the claim holds without renewal.
    pub lease: Duration,
    /// Payload fingerprint to compare with the stored one, if fingerprints are on.
    pub fingerprint: Option<Fingerprint>,
}

/// Checks the leases given to [`DedupStore::claim`] and [`DedupStore::renew`], as every store
/// does before anything else: a lease under a millisecond (zero included) is refused
/// ([`crate::ErrorKind::Config`]), because stores count leases in whole milliseconds and a
/// claim that ends as it starts would let another worker take the key while the handler runs.
/// A lease too long for a store's clock (up to [`Duration::MAX`]) is not an error: stores
/// saturate it, so the claim holds until completed or released.
pub fn check_lease(lease: Duration) -> Result<()> {
    if lease < Duration::from_millis(1) {
        return Err(Error::config(format!(
            "lease is {lease:?}: expected at least 1 ms (a claim holds its key for its lease, \
             counted in whole milliseconds)"
        )));
    }
    Ok(())
}

/// [`check_lease`] for every request of a claim.
pub fn check_claims(requests: &[ClaimRequest]) -> Result<()> {
    requests.iter().try_for_each(|r| check_lease(r.lease))
}

/// Result of one claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The key is now held by the caller; run the handler, then complete or release with this
    /// token.
    Claimed {
        /// The fencing token of this claim.
        token: FencingToken,
    },
    /// The key was completed before: skip the message. Carries the stored result, if any.
    Duplicate {
        /// Result stored on completion.
        result: Option<Bytes>,
    },
    /// Another worker holds the key and its lease has not expired.
    InProgress {
        /// The holder.
        owner: String,
        /// Time left on its lease.
        expires_in: Duration,
    },
    /// The key is known with a different payload fingerprint.
    Mismatch {
        /// Fingerprint stored with the key.
        stored: Fingerprint,
        /// Fingerprint of this request.
        given: Fingerprint,
    },
}

/// One completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The idempotency key.
    pub key: String,
    /// Token returned by the claim.
    pub token: FencingToken,
    /// Result to return to later duplicates (optional).
    pub result: Option<Bytes>,
}

/// Stored state of a key, as returned by [`DedupStore::get`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyState {
    /// Claimed and not finished.
    InProgress {
        /// Holder.
        owner: String,
        /// Current fencing token.
        token: FencingToken,
        /// Time left on the lease (zero if expired but not yet taken over).
        expires_in: Duration,
        /// Stored fingerprint.
        fingerprint: Option<Fingerprint>,
    },
    /// Completed within the dedup window.
    Completed {
        /// Token of the claim that completed it.
        token: FencingToken,
        /// Stored result.
        result: Option<Bytes>,
        /// Stored fingerprint.
        fingerprint: Option<Fingerprint>,
    },
}

/// A dedup store. Implementations must be linearisable per key: two concurrent claims of one
/// free key give exactly one [`ClaimOutcome::Claimed`].
///
/// Errors are of kind [`crate::ErrorKind::DedupStore`] (or `Connect`/`Timeout` for a store
/// that cannot be reached).
#[async_trait]
pub trait DedupStore: Send + Sync {
    /// Store name for logs and metrics (`memory`, `embedded`, `redis`, `postgres`).
    fn name(&self) -> &'static str;

    /// How long a completed key is remembered.
    fn window(&self) -> Duration;

    /// Claims keys; one outcome per request, in order. A key that is free, whose lease expired,
    /// or that the same owner holds is claimed with a new, higher token.
    ///
    /// Errors: [`crate::ErrorKind::Config`] when a request's lease is under 1 ms
    /// ([`check_claims`]);
    /// then nothing of the batch is claimed. A lease up to [`Duration::MAX`] is held until the
    /// key is completed or released.
    async fn claim(&self, requests: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>>;

    /// Extends leases to `lease` from now. `false` where the token is no longer the holder's.
    ///
    /// Errors: [`crate::ErrorKind::Config`] when `lease` is under 1 ms ([`check_lease`]).
    async fn renew(&self, claims: &[(String, FencingToken)], lease: Duration) -> Result<Vec<bool>>;

    /// Marks keys done (remembered for the window). `false` where the token is stale: the
    /// completion is refused and the key is left as it is.
    async fn complete(&self, completions: &[Completion]) -> Result<Vec<bool>>;

    /// Frees keys so the next claim runs the handler again. `false` where the token is stale.
    async fn release(&self, claims: &[(String, FencingToken)]) -> Result<Vec<bool>>;

    /// Reads keys' states; `None` for unknown or expired keys.
    async fn get(&self, keys: &[String]) -> Result<Vec<Option<KeyState>>>;
}

/// Single-key conveniences over the batched [`DedupStore`] operations.
#[async_trait]
pub trait DedupStoreExt: DedupStore {
    /// Claims one key.
    async fn claim_one(&self, request: ClaimRequest) -> Result<ClaimOutcome> {
        Ok(self.claim(std::slice::from_ref(&request)).await?.remove(0))
    }
    /// Renews one lease.
    async fn renew_one(&self, key: &str, token: FencingToken, lease: Duration) -> Result<bool> {
        Ok(self
            .renew(&[(key.to_string(), token)], lease)
            .await?
            .remove(0))
    }
    /// Completes one key.
    async fn complete_one(
        &self,
        key: &str,
        token: FencingToken,
        result: Option<Bytes>,
    ) -> Result<bool> {
        let c = Completion {
            key: key.to_string(),
            token,
            result,
        };
        Ok(self.complete(std::slice::from_ref(&c)).await?.remove(0))
    }
    /// Releases one key.
    async fn release_one(&self, key: &str, token: FencingToken) -> Result<bool> {
        Ok(self.release(&[(key.to_string(), token)]).await?.remove(0))
    }
    /// Reads one key.
    async fn get_one(&self, key: &str) -> Result<Option<KeyState>> {
        Ok(self.get(&[key.to_string()]).await?.remove(0))
    }
}

impl<T: DedupStore + ?Sized> DedupStoreExt for T {}

/// Shared handle to a store.
pub type SharedDedupStore = Arc<dyn DedupStore>;

/// Bad input (`Config`) when the embedded store's path is a directory or another file that is
/// not a regular file (a device such as `/dev/null`, a FIFO), or lies in a directory that does
/// not exist, whether given as a plain path or as `embedded:///…`: the same mistake gets the
/// same error.
fn check_file_path(path: &str, shown: &str) -> Result<()> {
    if let Ok(meta) = std::fs::metadata(path) {
        if !meta.is_dir() && !meta.is_file() {
            return Err(crate::Error::config(format!(
                "dedup store '{shown}' is not a regular file (a device, FIFO or socket): \
                 expected a database file path such as /var/lib/app/dedup.db"
            )));
        }
    }
    if std::path::Path::new(path).is_dir() {
        return Err(crate::Error::config(format!(
            "dedup store '{shown}' is a directory: expected a file path such as {}/dedup.db \
             (created if missing)",
            path.trim_end_matches('/')
        )));
    }
    if let Some(parent) = std::path::Path::new(path)
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
    {
        if !parent.is_dir() {
            return Err(crate::Error::config(format!(
                "dedup store '{shown}': directory '{}' does not exist or is not a directory: \
                 expected a file path in an existing directory (the file is created if missing, \
                 its directory is not)",
                crate::error::shown(&parent.display().to_string())
            )));
        }
    }
    Ok(())
}

/// Opens a dedup store from a URL, remembering completed keys for `window` (must be > 0).
///
/// - `memory://` or `memory://?capacity=N`: a new, bounded in-process [`MemoryStore`]
///   (default capacity [`memory::DEFAULT_CAPACITY`] keys). Each call creates a new store. When
///   more than N keys arrive within one window, the oldest completed keys are evicted early and
///   their redeliveries run the handler again; the store logs a warning the first time and
///   counts every such eviction ([`MemoryStore::evicted_in_window`]).
/// - `embedded:///absolute/path.db` (percent-escapes decoded) or a plain file path such as
///   `./dedup.db`: an on-disk [`EmbeddedStore`] that survives restarts.
///
/// Other stores (Redis, PostgreSQL) live in their own crates: [`open_with`] opens them through
/// their registry entries (the `onceflow` facade's `onceflow::dedup_store` does).
///
/// Errors: [`crate::ErrorKind::Config`] for any other scheme, a bad option, a zero window or a
/// bare scheme name such as `memory` (a forgotten `://`, not a file to create), naming the
/// value and listing the supported forms, and for an embedded path that is a directory, a
/// device or in a directory that does not exist; [`crate::ErrorKind::DedupStore`] for an
/// embedded path that cannot be opened otherwise (no permission, not a database), naming the
/// path.
pub async fn open(url: &str, window: Duration) -> Result<SharedDedupStore> {
    open_with(url, window, &[]).await
}

/// [`open`], and also the stores of `stores` (the registry entries of the store crates in the
/// build, `onceflow::STORES`): a URL of one of their schemes is opened by its entry, and the
/// errors list their schemes among the supported forms.
///
/// Errors: those of [`open`], and those of the entry that opens the URL.
pub async fn open_with(
    url: &str,
    window: Duration,
    stores: &[&crate::registry::StoreEntry],
) -> Result<SharedDedupStore> {
    // Errors show the URL without its credentials.
    let shown = crate::error::shown(&crate::error::redact_credentials(url));
    use crate::error::Error;
    let supported = crate::registry::forms_with_stores(
        &[
            "memory://[?capacity=N]",
            "embedded:///absolute/path.db",
            "a plain file path",
        ],
        stores,
    );
    if window.is_zero() {
        return Err(Error::config(format!(
            "dedup window for '{shown}' is 0: expected a positive duration (how long completed \
             keys are remembered)"
        )));
    }
    let trimmed = url.trim();
    if trimmed.is_empty() {
        return Err(Error::config(format!(
            "empty dedup store URL: expected one of {supported}"
        )));
    }
    let Some((scheme, rest)) = trimmed.split_once("://") else {
        // A bare scheme name is a forgotten `://`, not a file to create in the working directory.
        let bare = trimmed.trim_end_matches(':').to_ascii_lowercase();
        if ["memory", "embedded"].contains(&&*bare)
            || crate::registry::is_store_scheme(stores, &bare)
        {
            return Err(Error::config(format!(
                "dedup store '{shown}' looks like a URL scheme without '://' (did you mean \
                 '{bare}://'?); to use a file of that name, write ./{trimmed}"
            )));
        }
        // libpq's `host=… user=… password=…` form is not a file name (it would put the
        // password into one).
        if trimmed.contains('=')
            && trimmed.split_whitespace().all(|w| {
                w.split_once('=').is_some_and(|(k, _)| {
                    !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                })
            })
        {
            return Err(Error::config(
                "dedup store looks like a key=value connection string (host=… user=…): write it \
                 as postgres://USER:PASSWORD@HOST:PORT/DB; to use a file of that name, write ./ \
                 before it",
            ));
        }
        check_file_path(trimmed, &shown)?;
        return Ok(Arc::new(EmbeddedStore::open(trimmed, window).await?));
    };
    if let Some(entry) = crate::registry::store_for(stores, scheme) {
        return (entry.dedup)(url.to_string(), window).await;
    }
    match scheme.to_ascii_lowercase().as_str() {
        "memory" => {
            let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
            if !path.is_empty() && path != "/" {
                return Err(Error::config(format!(
                    "memory dedup store URL '{shown}' names '{path}', but a memory store has no \
                     name (every open creates a new one): expected memory:// or \
                     memory://?capacity=N",
                    path = path.rsplit('@').next().unwrap_or(path)
                )));
            }
            let mut capacity = memory::DEFAULT_CAPACITY;
            for (k, v) in url::form_urlencoded::parse(query.as_bytes()) {
                match &*k {
                    "capacity" => {
                        capacity = v.parse().ok().filter(|c| *c > 0).ok_or_else(|| {
                            Error::config(format!(
                                "capacity '{}' in '{shown}' is not a positive whole number of keys",
                                crate::error::shown(&v)
                            ))
                        })?;
                    }
                    other => {
                        return Err(Error::config(format!(
                            "unknown option '{other}' in memory dedup store URL '{shown}': \
                             expected capacity=N"
                        )))
                    }
                }
            }
            Ok(Arc::new(MemoryStore::new(window, capacity)))
        }
        "embedded" => {
            if !rest.starts_with('/') || rest.contains(['?', '#']) {
                return Err(Error::config(format!(
                    "embedded dedup store URL '{shown}' must be embedded:///absolute/path.db \
                     (three slashes, no options), or give a plain file path"
                )));
            }
            let bytes = rest.as_bytes();
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
            let path = String::from_utf8(decoded).map_err(|_| {
                Error::config(format!(
                    "embedded dedup store URL '{shown}' decodes to a path that is not UTF-8"
                ))
            })?;
            check_file_path(&path, &shown)?;
            Ok(Arc::new(EmbeddedStore::open(path, window).await?))
        }
        _ => Err(Error::config(format!(
            "unknown dedup store URL scheme '{}://' in '{}': expected one of {supported}{}",
            crate::error::shown(scheme),
            shown,
            if stores.is_empty() {
                " (stores in their own crates, such as Redis or PostgreSQL, open through \
                 onceflow::dedup_store)"
            } else {
                ""
            }
        ))),
    }
}
