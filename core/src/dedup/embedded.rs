//! On-disk embedded dedup store: one SQLite file (WAL mode), driven by a dedicated thread.
//!
//! Why SQLite (bundled, through `rusqlite`) and not redb: on the D1 benchmark SQLite in WAL mode
//! with `synchronous=NORMAL` keeps a committed key across a process crash without an fsync per
//! commit, where redb needs a durable (fsync'd) commit to survive one; and the transactional
//! inbox ([`EmbeddedStore::inbox`], [`crate::inbox::EmbeddedInbox`]) hands the application a
//! database transaction on the same file, which SQLite gives for free. The figures are in
//! `benches/RESULTS.md`.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use rusqlite::{params, Connection, ErrorCode, OpenFlags, OptionalExtension};
use tokio::sync::oneshot;

use super::{
    ClaimOutcome, ClaimRequest, Completion, DedupStore, FencingToken, Fingerprint, KeyState,
};
use crate::client::Consumer;
use crate::error::{Error, Result};
use crate::inbox::{EmbeddedInbox, InboxConfig};

/// Schema version this build writes and reads. A file with a higher version was written by a
/// newer onceflow and is refused. Version 1 holds the dedup table; version 2 adds the
/// transactional inbox's position table (`onceflow_inbox_position`), created when a version-1
/// file is opened.
pub const SCHEMA_VERSION: i64 = 2;

/// Fencing tokens are reserved in the file in blocks of this many, so a token is never handed
/// out twice, even across a crash, at the cost of one small write per block.
const TOKEN_BLOCK: u64 = 10_000;

/// Most jobs (batched calls) folded into one transaction.
const MAX_GROUP_JOBS: usize = 64;

/// WAL size, in pages, that triggers a checkpoint (~40 MiB with 4 KiB pages).
const WAL_AUTOCHECKPOINT_PAGES: i64 = 10_000;

/// Most expired rows dropped by one purge transaction (keeps each one short).
const PURGE_CHUNK: i64 = 5_000;

/// What a committed key survives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// A committed key survives a crash of the process (SIGKILL, panic, OOM kill): SQLite WAL
    /// with `synchronous=NORMAL`, no fsync per commit. The last commits may be lost if the
    /// machine itself loses power or the OS crashes. The default.
    #[default]
    ProcessCrash,
    /// A committed key also survives power loss and OS crashes: `synchronous=FULL`, one fsync
    /// per transaction (much slower for small batches).
    PowerLoss,
}

/// Options of an [`EmbeddedStore`].
#[derive(Debug, Clone)]
pub struct EmbeddedOptions {
    /// How long a completed key is remembered.
    pub window: Duration,
    /// What a committed key survives (default [`Durability::ProcessCrash`]).
    pub durability: Durability,
    /// SQLite page cache, in MiB (default 64).
    pub cache_mib: u32,
}

impl EmbeddedOptions {
    /// Options with the given window and the defaults otherwise.
    pub fn new(window: Duration) -> Self {
        EmbeddedOptions {
            window,
            durability: Durability::default(),
            cache_mib: 64,
        }
    }

    /// Sets the durability.
    pub fn durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }
}

/// Embedded on-disk dedup store that survives restarts: one SQLite database file.
///
/// - **Durability**: a completed key is committed before `complete` returns. With the default
///   [`Durability::ProcessCrash`] it survives a crash of the process (SQLite WAL,
///   `synchronous=NORMAL`); power loss or an OS crash may lose the last commits unless
///   [`Durability::PowerLoss`] is chosen. Keys survive a restart: open the same path again.
/// - **Window**: completed keys are treated as unknown `window` after completion (checked on
///   read) and deleted by a purge that runs at most every `window / 2` (between 100 ms and
///   5 min), in chunks, through an index on the expiry time. A claim whose lease ran out
///   without being taken over is deleted one `window` after the lease ended.
/// - **Threads**: all database work runs on one dedicated thread, never on the async executor;
///   calls that arrive while it is busy are committed together in one transaction (group
///   commit). Calls are linearisable per key.
/// - **Clock**: leases and expiry use the wall clock (milliseconds since the Unix epoch), so they
///   hold across restarts; a clock stepping backwards lengthens them.
/// - **Schema**: the file records its schema version ([`SCHEMA_VERSION`]); a file written by a
///   newer onceflow is refused with an error naming it, an older one is migrated on open. The
///   tables are `onceflow_dedup`, `onceflow_meta`, `onceflow_schema_version` and
///   `onceflow_inbox_position` (the inbox's positions). Other tables in the same file (an inbox
///   handler's own) are left alone.
/// - **Transactional inbox**: [`EmbeddedStore::inbox`] runs a consumer whose handler writes its
///   rows in the same SQLite transaction that records the key and the consumer's position.
///
/// Opening a path that cannot be used (a missing directory, a directory, a file that is not a
/// database, no permission) is an error of kind [`crate::ErrorKind::DedupStore`] naming the
/// path. Several processes or threads may open one file, a new one included, at the same time:
/// an open waits up to 5 s for the others (busy timeout, and retries of the switch to WAL mode,
/// which SQLite refuses at once while another connection holds the file) before failing with
/// that error, marked retriable.
pub struct EmbeddedStore {
    path: PathBuf,
    window: Duration,
    options: EmbeddedOptions,
    jobs: Option<mpsc::Sender<Job>>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for EmbeddedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedStore")
            .field("path", &self.path)
            .field("window", &self.window)
            .finish()
    }
}

enum Op {
    Claim(Vec<ClaimRequest>),
    Renew(Vec<(String, FencingToken)>, Duration),
    Complete(Vec<Completion>),
    Release(Vec<(String, FencingToken)>),
    Get(Vec<String>),
    Purge,
}

enum Reply {
    Claim(Vec<ClaimOutcome>),
    Flags(Vec<bool>),
    Get(Vec<Option<KeyState>>),
    Purged(u64),
}

struct Job {
    op: Op,
    reply: oneshot::Sender<Result<Reply>>,
}

impl EmbeddedStore {
    /// Opens (creating if needed) the store at `path`, remembering completed keys for `window`,
    /// with the default options. The parent directory must exist.
    pub async fn open(path: impl AsRef<Path>, window: Duration) -> Result<Self> {
        Self::open_with(path, EmbeddedOptions::new(window)).await
    }

    /// Opens (creating if needed) the store at `path` with `options`.
    pub async fn open_with(path: impl AsRef<Path>, options: EmbeddedOptions) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let (ready_tx, ready_rx) = oneshot::channel();
        let (jobs_tx, jobs_rx) = mpsc::channel();
        let worker_path = path.clone();
        let worker_options = options.clone();
        let worker = std::thread::Builder::new()
            .name("onceflow-dedup-embedded".into())
            .spawn(move || match Worker::open(worker_path, &worker_options) {
                Ok(worker) => {
                    let _ = ready_tx.send(Ok(()));
                    worker.run(jobs_rx);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| {
                Error::dedup_store(format!(
                    "embedded dedup store '{}': cannot start its thread",
                    shown_path(&path)
                ))
                .with_source(e)
            })?;
        let opened = ready_rx.await.unwrap_or_else(|_| {
            Err(Error::dedup_store(format!(
                "embedded dedup store '{}': its thread stopped while opening",
                shown_path(&path)
            )))
        });
        if let Err(e) = opened {
            let _ = worker.join();
            return Err(e);
        }
        Ok(EmbeddedStore {
            path,
            window: options.window,
            options,
            jobs: Some(jobs_tx),
            worker: Some(worker),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The options it was opened with.
    pub fn options(&self) -> &EmbeddedOptions {
        &self.options
    }

    /// A transactional inbox over `consumer` that keeps its keys and positions in this store's
    /// database file, on a connection of its own (see [`EmbeddedInbox`]).
    ///
    /// Errors: the file cannot be opened again (kind [`crate::ErrorKind::DedupStore`], naming
    /// the path).
    pub async fn inbox(&self, consumer: Consumer, config: InboxConfig) -> Result<EmbeddedInbox> {
        EmbeddedInbox::open(self.path.clone(), self.options.clone(), consumer, config).await
    }

    /// Deletes every expired row now (the store also does this by itself, amortised). Returns
    /// the number of rows deleted.
    pub async fn purge_expired(&self) -> Result<u64> {
        match self.call(Op::Purge).await? {
            Reply::Purged(n) => Ok(n),
            _ => Err(self.protocol_error()),
        }
    }

    async fn call(&self, op: Op) -> Result<Reply> {
        let (reply, rx) = oneshot::channel();
        let stopped = || {
            Error::dedup_store(format!(
                "embedded dedup store '{}': its thread has stopped",
                shown_path(&self.path)
            ))
        };
        self.jobs
            .as_ref()
            .ok_or_else(stopped)?
            .send(Job { op, reply })
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }

    fn protocol_error(&self) -> Error {
        Error::dedup_store(format!(
            "embedded dedup store '{}': unexpected reply from its thread",
            shown_path(&self.path)
        ))
    }
}

impl Drop for EmbeddedStore {
    /// Lets the thread finish the calls already queued, close the database, and waits for it.
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

#[async_trait]
impl DedupStore for EmbeddedStore {
    fn name(&self) -> &'static str {
        "embedded"
    }

    fn window(&self) -> Duration {
        self.window
    }

    async fn claim(&self, requests: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>> {
        super::check_claims(requests)?;
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        match self.call(Op::Claim(requests.to_vec())).await? {
            Reply::Claim(v) => Ok(v),
            _ => Err(self.protocol_error()),
        }
    }

    async fn renew(&self, claims: &[(String, FencingToken)], lease: Duration) -> Result<Vec<bool>> {
        super::check_lease(lease)?;
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        match self.call(Op::Renew(claims.to_vec(), lease)).await? {
            Reply::Flags(v) => Ok(v),
            _ => Err(self.protocol_error()),
        }
    }

    async fn complete(&self, completions: &[Completion]) -> Result<Vec<bool>> {
        if completions.is_empty() {
            return Ok(Vec::new());
        }
        match self.call(Op::Complete(completions.to_vec())).await? {
            Reply::Flags(v) => Ok(v),
            _ => Err(self.protocol_error()),
        }
    }

    async fn release(&self, claims: &[(String, FencingToken)]) -> Result<Vec<bool>> {
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        match self.call(Op::Release(claims.to_vec())).await? {
            Reply::Flags(v) => Ok(v),
            _ => Err(self.protocol_error()),
        }
    }

    async fn get(&self, keys: &[String]) -> Result<Vec<Option<KeyState>>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        match self.call(Op::Get(keys.to_vec())).await? {
            Reply::Get(v) => Ok(v),
            _ => Err(self.protocol_error()),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The database thread.

/// `state` of a completed row (1 is in progress).
const STATE_COMPLETED: i64 = 2;

const SQL_SELECT: &str = "SELECT token, state, owner, lease_until, expires_at, fingerprint, \
     result FROM onceflow_dedup WHERE key = ?1";
const SQL_CLAIM: &str = "INSERT INTO onceflow_dedup \
     (key, token, state, owner, lease_until, expires_at, fingerprint, result) \
     VALUES (?1, ?2, 1, ?3, ?4, ?5, ?6, NULL) \
     ON CONFLICT(key) DO UPDATE SET token = excluded.token, state = 1, owner = excluded.owner, \
     lease_until = excluded.lease_until, expires_at = excluded.expires_at, \
     fingerprint = excluded.fingerprint, result = NULL";
const SQL_RECLAIM: &str = "UPDATE onceflow_dedup SET token = ?2, lease_until = ?3, \
     expires_at = ?4, fingerprint = COALESCE(fingerprint, ?5) WHERE key = ?1";
const SQL_RENEW: &str = "UPDATE onceflow_dedup SET lease_until = ?3, expires_at = ?4 \
     WHERE key = ?1 AND token = ?2 AND state = 1";
const SQL_COMPLETE: &str = "UPDATE onceflow_dedup SET state = 2, owner = NULL, \
     lease_until = NULL, expires_at = ?3, result = ?4 WHERE key = ?1 AND token = ?2 AND state = 1";
const SQL_COMPLETED_BY: &str =
    "SELECT expires_at FROM onceflow_dedup WHERE key = ?1 AND token = ?2 AND state = 2";
const SQL_RELEASE: &str = "DELETE FROM onceflow_dedup WHERE key = ?1 AND token = ?2 AND state = 1";
const SQL_PURGE: &str = "DELETE FROM onceflow_dedup WHERE key IN \
     (SELECT key FROM onceflow_dedup WHERE expires_at <= ?1 LIMIT ?2)";

const SQL_SCHEMA: &str = "
CREATE TABLE onceflow_meta (
    name  TEXT PRIMARY KEY NOT NULL,
    value INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE onceflow_dedup (
    key         TEXT PRIMARY KEY NOT NULL,
    token       INTEGER NOT NULL,
    state       INTEGER NOT NULL,  -- 1 in progress, 2 completed
    owner       TEXT,              -- holder, while in progress
    lease_until INTEGER,           -- ms since the Unix epoch, while in progress
    expires_at  INTEGER NOT NULL,  -- ms since the Unix epoch: the row is dropped after this
    fingerprint BLOB,              -- 16 bytes, big-endian
    result      BLOB
) WITHOUT ROWID;
CREATE INDEX onceflow_dedup_expires_at ON onceflow_dedup (expires_at);
INSERT INTO onceflow_meta (name, value) VALUES ('token_high', 1);
";

/// Migration 2: the transactional inbox's positions (see [`crate::inbox::EmbeddedInbox`]).
const SQL_INBOX_SCHEMA: &str = "
CREATE TABLE onceflow_inbox_position (
    namespace  TEXT NOT NULL,
    topic      TEXT NOT NULL,
    partition  INTEGER NOT NULL,
    position   TEXT NOT NULL,     -- onceflow Position, as displayed (Position::from_str)
    updated_at INTEGER NOT NULL,  -- ms since the Unix epoch
    PRIMARY KEY (namespace, topic, partition)
) WITHOUT ROWID;
";

/// Migrations, in order; migration `i` brings the schema to version `i + 1`.
const MIGRATIONS: [&str; SCHEMA_VERSION as usize] = [SQL_SCHEMA, SQL_INBOX_SCHEMA];

struct Row {
    token: i64,
    state: i64,
    owner: Option<String>,
    lease_until: Option<i64>,
    expires_at: i64,
    fingerprint: Option<Vec<u8>>,
    result: Option<Vec<u8>>,
}

impl Row {
    /// Whether the row still decides a claim: completed within the window, or under a live
    /// lease.
    fn is_live(&self, now: i64) -> bool {
        match self.state {
            STATE_COMPLETED => self.expires_at > now,
            _ => self.lease_until.unwrap_or(0) > now,
        }
    }
}

/// Runs `f` over `items` in key order (a stable sort: one key's items keep their order) and
/// returns the results in the order of `items`. Visiting keys in order walks the B-tree
/// sequentially instead of jumping between random pages.
fn in_key_order<T, R>(
    items: &[T],
    key: impl Fn(&T) -> &str,
    mut f: impl FnMut(&T) -> rusqlite::Result<R>,
) -> rusqlite::Result<Vec<R>> {
    if items.len() < 2 {
        return items.iter().map(f).collect();
    }
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by(|a, b| key(&items[*a]).cmp(key(&items[*b])));
    let mut out: Vec<Option<R>> = std::iter::repeat_with(|| None).take(items.len()).collect();
    for i in order {
        out[i] = Some(f(&items[i])?);
    }
    Ok(out.into_iter().flatten().collect())
}

pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

pub(crate) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn fp_to_blob(fp: Fingerprint) -> [u8; 16] {
    fp.to_be_bytes()
}

fn fp_from_blob(blob: &[u8]) -> Option<Fingerprint> {
    Some(Fingerprint::from_be_bytes(blob.try_into().ok()?))
}

pub(crate) fn token_of(v: i64) -> FencingToken {
    u64::try_from(v).unwrap_or(0)
}

pub(crate) fn sql_token(t: FencingToken) -> i64 {
    i64::try_from(t).unwrap_or(i64::MAX)
}

pub(crate) fn db_error(path: &Path, what: &str, e: rusqlite::Error) -> Error {
    let busy = is_busy(&e);
    let hint = match e.sqlite_error_code() {
        Some(ErrorCode::NotADatabase) => " (the file exists but is not an SQLite database)",
        Some(ErrorCode::CannotOpen) => " (check that the path is a writable file location)",
        Some(ErrorCode::ReadOnly) => " (the file or its directory is read-only)",
        Some(ErrorCode::PermissionDenied) => " (permission denied)",
        _ => "",
    };
    Error::dedup_store(format!(
        "embedded dedup store '{}': {what}: {e}{hint}",
        shown_path(path)
    ))
    .with_source(e)
    .retriable(busy)
}

struct Worker {
    conn: Connection,
    path: PathBuf,
    window_ms: i64,
    tokens: Tokens,
    purge_interval: Duration,
    next_purge: i64,
}

/// Hands out fencing tokens from blocks reserved in `onceflow_meta`.
struct Tokens {
    next: u64,
    /// End (exclusive) of the block reserved by this process; 0: none.
    high: u64,
}

impl Tokens {
    /// A token ≥ `min`, reserving a new block in the current transaction when needed.
    fn take(&mut self, conn: &Connection, min: u64) -> rusqlite::Result<FencingToken> {
        let mut t = self.next.max(min).max(1);
        if t >= self.high {
            let stored: i64 = conn.query_row(
                "SELECT value FROM onceflow_meta WHERE name = 'token_high'",
                [],
                |r| r.get(0),
            )?;
            t = t.max(token_of(stored));
            self.high = t + TOKEN_BLOCK;
            conn.execute(
                "UPDATE onceflow_meta SET value = ?1 WHERE name = 'token_high'",
                [sql_token(self.high)],
            )?;
        }
        self.next = t + 1;
        Ok(t)
    }
}

/// Opens a connection to the store's file with the store's settings (WAL, `synchronous` per
/// [`Durability`], busy timeout, cache size); the schema is not touched. Used by the store's
/// thread and by the transactional inbox.
pub(crate) fn open_connection(path: &Path, options: &EmbeddedOptions) -> Result<Connection> {
    let shown = shown_path(path);
    if path.as_os_str().is_empty() {
        return Err(Error::dedup_store(
                "embedded dedup store: the path is empty; expected a file path such as /var/lib/app/dedup.db",
            ));
    }
    if path.is_dir() {
        return Err(Error::dedup_store(format!(
            "embedded dedup store '{shown}': is a directory; expected a database file path"
        )));
    }
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        if !parent.is_dir() {
            return Err(Error::dedup_store(format!(
                    "embedded dedup store '{shown}': directory '{}' does not exist or is not a directory",
                    shown_path(parent)
                )));
        }
    }
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| db_error(path, "cannot open", e))?;
    let setup = |what: &str, r: rusqlite::Result<()>| r.map_err(|e| db_error(path, what, e));
    setup(
        "cannot set the busy timeout",
        conn.busy_timeout(Duration::from_secs(5)),
    )?;
    let mode = switch_to_wal(&conn).map_err(|e| db_error(path, "cannot switch to WAL mode", e))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(Error::dedup_store(format!(
            "embedded dedup store '{shown}': SQLite refused WAL mode (journal mode is '{mode}')"
        )));
    }
    let sync = match options.durability {
        Durability::ProcessCrash => "NORMAL",
        Durability::PowerLoss => "FULL",
    };
    setup(
        "cannot set synchronous",
        conn.pragma_update(None, "synchronous", sync),
    )?;
    setup(
        "cannot set the cache size",
        conn.pragma_update(None, "cache_size", -(i64::from(options.cache_mib) * 1024)),
    )?;
    // A batch of random keys dirties about one page per key; checkpointing every 1000 pages
    // (SQLite's default) meant a checkpoint, and its fsync, after nearly every batch.
    setup(
        "cannot set wal_autocheckpoint",
        conn.pragma_update(None, "wal_autocheckpoint", WAL_AUTOCHECKPOINT_PAGES),
    )?;
    setup(
        "cannot set journal_size_limit",
        conn.pragma_update(None, "journal_size_limit", 64 * 1024 * 1024),
    )?;
    conn.set_prepared_statement_cache_capacity(32);
    Ok(conn)
}

/// How long opening keeps retrying the switch to WAL mode while other connections hold the file.
const WAL_SWITCH_PATIENCE: Duration = Duration::from_secs(5);

/// Switches the connection to WAL mode, retrying while the file is busy for at most
/// [`WAL_SWITCH_PATIENCE`]. The switch needs the file to itself, and where waiting for it could
/// deadlock (another connection holds a lock it wants to upgrade, as when several processes
/// create the same new file at once) SQLite answers busy at once instead of calling the busy
/// handler, so the busy timeout alone does not cover it. Returns the journal mode in effect.
pub(crate) fn switch_to_wal(conn: &Connection) -> rusqlite::Result<String> {
    let deadline = std::time::Instant::now() + WAL_SWITCH_PATIENCE;
    let mut pause_ms = 1u64;
    loop {
        match conn.pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get::<_, String>(0)) {
            Err(e) if is_busy(&e) && std::time::Instant::now() < deadline => {
                // Jittered so connections that collided do not collide again in step.
                let jitter = rand::random::<u64>() % (pause_ms + 1);
                std::thread::sleep(Duration::from_millis(pause_ms + jitter));
                pause_ms = (pause_ms * 2).min(50);
            }
            r => return r,
        }
    }
}

fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked)
    )
}

impl Worker {
    fn open(path: PathBuf, options: &EmbeddedOptions) -> Result<Worker> {
        let conn = open_connection(&path, options)?;
        Self::migrate(&conn, &path)?;
        let window_ms = ms(options.window);
        Ok(Worker {
            conn,
            path,
            window_ms,
            tokens: Tokens { next: 1, high: 0 },
            purge_interval: Duration::from_millis(
                u64::try_from((window_ms / 2).clamp(100, 5 * 60 * 1000)).unwrap_or(100),
            ),
            next_purge: 0,
        })
    }

    /// Creates the schema in a new file, or checks the version of an existing one.
    fn migrate(conn: &Connection, path: &Path) -> Result<()> {
        let shown = shown_path(path);
        let run = || -> rusqlite::Result<std::result::Result<(), i64>> {
            conn.execute_batch("BEGIN IMMEDIATE")?;
            let inner = || -> rusqlite::Result<std::result::Result<(), i64>> {
                conn.execute_batch(
                    "CREATE TABLE IF NOT EXISTS onceflow_schema_version (version INTEGER NOT NULL)",
                )?;
                let version: Option<i64> = conn.query_row(
                    "SELECT max(version) FROM onceflow_schema_version",
                    [],
                    |r| r.get(0),
                )?;
                match version {
                    Some(v) if v > SCHEMA_VERSION => Ok(Err(v)),
                    Some(v) if v == SCHEMA_VERSION => Ok(Ok(())),
                    found => {
                        let from = found.unwrap_or(0);
                        for (i, sql) in MIGRATIONS.iter().enumerate() {
                            if i as i64 + 1 > from {
                                conn.execute_batch(sql)?;
                            }
                        }
                        conn.execute(
                            "INSERT INTO onceflow_schema_version (version) VALUES (?1)",
                            [SCHEMA_VERSION],
                        )?;
                        Ok(Ok(()))
                    }
                }
            };
            match inner() {
                Ok(r) => {
                    conn.execute_batch(if r.is_ok() { "COMMIT" } else { "ROLLBACK" })?;
                    Ok(r)
                }
                Err(e) => {
                    let _ = conn.execute_batch("ROLLBACK");
                    Err(e)
                }
            }
        };
        match run().map_err(|e| db_error(path, "cannot create or read the schema", e))? {
            Ok(()) => Ok(()),
            Err(v) => Err(Error::dedup_store(format!(
                "embedded dedup store '{shown}': schema version {v} was written by a newer \
                 onceflow; this build reads schema version {SCHEMA_VERSION} at most (upgrade \
                 onceflow or use another file)"
            ))),
        }
    }

    fn run(mut self, jobs: mpsc::Receiver<Job>) {
        loop {
            let first = match jobs.recv_timeout(self.purge_interval) {
                Ok(job) => job,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    self.purge_if_due();
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            };
            let mut group = vec![first];
            while group.len() < MAX_GROUP_JOBS {
                match jobs.try_recv() {
                    Ok(job) => group.push(job),
                    Err(_) => break,
                }
            }
            self.run_group(group);
            self.purge_if_due();
        }
    }

    /// Runs the jobs in one transaction; if it fails, runs each alone so one bad job does not
    /// fail the others.
    fn run_group(&mut self, group: Vec<Job>) {
        if group.len() > 1 && !group.iter().any(|j| matches!(j.op, Op::Purge)) {
            let now = now_ms();
            let ops: Vec<&Op> = group.iter().map(|j| &j.op).collect();
            if let Ok(replies) = self.transaction(|w| {
                ops.iter()
                    .map(|op| w.apply(op, now))
                    .collect::<rusqlite::Result<Vec<_>>>()
            }) {
                for (job, reply) in group.into_iter().zip(replies) {
                    let _ = job.reply.send(Ok(reply));
                }
                return;
            }
        }
        for job in group {
            let now = now_ms();
            let reply = if matches!(job.op, Op::Purge) {
                self.purge_all(now)
            } else {
                self.transaction(|w| w.apply(&job.op, now))
                    .map_err(|e| db_error(&self.path, "transaction failed", e))
            };
            let _ = job.reply.send(reply);
        }
    }

    fn transaction<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> rusqlite::Result<T>,
    ) -> rusqlite::Result<T> {
        self.conn.execute_batch("BEGIN IMMEDIATE")?;
        let r = f(self).and_then(|v| self.conn.execute_batch("COMMIT").map(|()| v));
        if r.is_err() {
            let _ = self.conn.execute_batch("ROLLBACK");
            // Tokens of the rolled-back block reservation are not recorded: reserve again.
            self.tokens.high = 0;
        }
        r
    }

    fn apply(&mut self, op: &Op, now: i64) -> rusqlite::Result<Reply> {
        Ok(match op {
            Op::Claim(reqs) => {
                Reply::Claim(in_key_order(reqs, |r| &r.key, |r| self.claim(r, now))?)
            }
            Op::Renew(claims, lease) => {
                let until = now.saturating_add(ms(*lease));
                let expires = until.saturating_add(self.window_ms);
                let mut stmt = self.conn.prepare_cached(SQL_RENEW)?;
                Reply::Flags(
                    claims
                        .iter()
                        .map(|(k, t)| {
                            Ok(stmt.execute(params![k, sql_token(*t), until, expires])? == 1)
                        })
                        .collect::<rusqlite::Result<_>>()?,
                )
            }
            Op::Complete(completions) => {
                let expires = now.saturating_add(self.window_ms);
                let mut update = self.conn.prepare_cached(SQL_COMPLETE)?;
                let mut done_by = self.conn.prepare_cached(SQL_COMPLETED_BY)?;
                Reply::Flags(in_key_order(
                    completions,
                    |c| &c.key,
                    |c| {
                        let token = sql_token(c.token);
                        let result = c.result.as_deref();
                        Ok(update.execute(params![c.key, token, expires, result])? == 1
                            // A repeated completion by the same claim: already done.
                            || done_by
                                .query_row(params![c.key, token], |r| r.get::<_, i64>(0))
                                .optional()?
                                .is_some_and(|exp| exp > now))
                    },
                )?)
            }
            Op::Release(claims) => {
                let mut stmt = self.conn.prepare_cached(SQL_RELEASE)?;
                Reply::Flags(
                    claims
                        .iter()
                        .map(|(k, t)| Ok(stmt.execute(params![k, sql_token(*t)])? == 1))
                        .collect::<rusqlite::Result<_>>()?,
                )
            }
            Op::Get(keys) => Reply::Get(
                keys.iter()
                    .map(|k| self.get(k, now))
                    .collect::<rusqlite::Result<_>>()?,
            ),
            Op::Purge => Reply::Purged(0),
        })
    }

    fn select(&self, key: &str) -> rusqlite::Result<Option<Row>> {
        self.conn
            .prepare_cached(SQL_SELECT)?
            .query_row([key], |r| {
                Ok(Row {
                    token: r.get(0)?,
                    state: r.get(1)?,
                    owner: r.get(2)?,
                    lease_until: r.get(3)?,
                    expires_at: r.get(4)?,
                    fingerprint: r.get(5)?,
                    result: r.get(6)?,
                })
            })
            .optional()
    }

    fn claim(&mut self, req: &ClaimRequest, now: i64) -> rusqlite::Result<ClaimOutcome> {
        let lease_until = now.saturating_add(ms(req.lease));
        let expires = lease_until.saturating_add(self.window_ms);
        let fp_blob = req.fingerprint.map(fp_to_blob);
        let row = self.select(&req.key)?;
        if let Some(row) = row.as_ref().filter(|r| r.is_live(now)) {
            let stored = row.fingerprint.as_deref().and_then(fp_from_blob);
            if let (Some(stored), Some(given)) = (stored, req.fingerprint) {
                if stored != given {
                    return Ok(ClaimOutcome::Mismatch { stored, given });
                }
            }
            if row.state == STATE_COMPLETED {
                return Ok(ClaimOutcome::Duplicate {
                    result: row.result.clone().map(Bytes::from),
                });
            }
            let holder = row.owner.clone().unwrap_or_default();
            if holder != req.owner {
                return Ok(ClaimOutcome::InProgress {
                    owner: holder,
                    expires_in: Duration::from_millis(
                        u64::try_from(row.lease_until.unwrap_or(now) - now).unwrap_or(0),
                    ),
                });
            }
            // The holder claims again (e.g. after a restart): new token, fresh lease.
            let token = self.tokens.take(&self.conn, token_of(row.token) + 1)?;
            self.conn.prepare_cached(SQL_RECLAIM)?.execute(params![
                req.key,
                sql_token(token),
                lease_until,
                expires,
                fp_blob.as_ref().map(|b| &b[..])
            ])?;
            return Ok(ClaimOutcome::Claimed { token });
        }
        // Unknown, completed past its window, or a lease that ran out: take it.
        let min = row.map_or(1, |r| token_of(r.token) + 1);
        let token = self.tokens.take(&self.conn, min)?;
        self.conn.prepare_cached(SQL_CLAIM)?.execute(params![
            req.key,
            sql_token(token),
            req.owner,
            lease_until,
            expires,
            fp_blob.as_ref().map(|b| &b[..])
        ])?;
        Ok(ClaimOutcome::Claimed { token })
    }

    fn get(&self, key: &str, now: i64) -> rusqlite::Result<Option<KeyState>> {
        let Some(row) = self.select(key)? else {
            return Ok(None);
        };
        if row.expires_at <= now {
            return Ok(None);
        }
        let fingerprint = row.fingerprint.as_deref().and_then(fp_from_blob);
        Ok(Some(if row.state == STATE_COMPLETED {
            KeyState::Completed {
                token: token_of(row.token),
                result: row.result.map(Bytes::from),
                fingerprint,
            }
        } else {
            KeyState::InProgress {
                owner: row.owner.unwrap_or_default(),
                token: token_of(row.token),
                expires_in: Duration::from_millis(
                    u64::try_from(row.lease_until.unwrap_or(now) - now).unwrap_or(0),
                ),
                fingerprint,
            }
        }))
    }

    /// Deletes one chunk of expired rows if a purge is due.
    fn purge_if_due(&mut self) {
        let now = now_ms();
        if now < self.next_purge {
            return;
        }
        match self.purge_chunk(now) {
            // A full chunk: more may be waiting, go on after the next calls.
            Ok(n) if n == PURGE_CHUNK as u64 => {}
            Ok(_) => self.next_purge = now + ms(self.purge_interval),
            Err(e) => {
                tracing::warn!(error = %db_error(&self.path, "purge failed", e), "dedup purge");
                self.next_purge = now + ms(self.purge_interval);
            }
        }
    }

    fn purge_chunk(&mut self, now: i64) -> rusqlite::Result<u64> {
        let n = self
            .conn
            .prepare_cached(SQL_PURGE)?
            .execute(params![now, PURGE_CHUNK])?;
        Ok(n as u64)
    }

    fn purge_all(&mut self, now: i64) -> Result<Reply> {
        let mut total = 0;
        loop {
            let n = self
                .purge_chunk(now)
                .map_err(|e| db_error(&self.path, "purge failed", e))?;
            total += n;
            if n < PURGE_CHUNK as u64 {
                self.next_purge = now + ms(self.purge_interval);
                return Ok(Reply::Purged(total));
            }
        }
    }
}

/// `path` for an error message: cut past 80 characters and control characters escaped
/// ([`crate::error::shown`]).
fn shown_path(path: &Path) -> String {
    crate::error::shown(&path.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dedup::DedupStoreExt;
    use crate::ErrorKind;

    fn req(key: &str, owner: &str) -> ClaimRequest {
        ClaimRequest {
            key: key.into(),
            owner: owner.into(),
            lease: Duration::from_secs(30),
            fingerprint: None,
        }
    }

    #[tokio::test]
    async fn newer_schema_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dedup.db");
        drop(
            EmbeddedStore::open(&path, Duration::from_secs(60))
                .await
                .unwrap(),
        );
        let conn = Connection::open(&path).unwrap();
        conn.execute("UPDATE onceflow_schema_version SET version = 99", [])
            .unwrap();
        drop(conn);
        let err = EmbeddedStore::open(&path, Duration::from_secs(60))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::DedupStore);
        assert!(err.message().contains(&path.display().to_string()), "{err}");
        assert!(err.message().contains("schema version 99"), "{err}");
    }

    #[tokio::test]
    async fn tokens_keep_increasing_across_reopen_and_release() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dedup.db");
        let store = EmbeddedStore::open(&path, Duration::from_secs(60))
            .await
            .unwrap();
        let ClaimOutcome::Claimed { token: t1 } = store.claim_one(req("k", "a")).await.unwrap()
        else {
            panic!()
        };
        assert!(store.release_one("k", t1).await.unwrap());
        drop(store);
        let store = EmbeddedStore::open(&path, Duration::from_secs(60))
            .await
            .unwrap();
        let ClaimOutcome::Claimed { token: t2 } = store.claim_one(req("k", "a")).await.unwrap()
        else {
            panic!()
        };
        assert!(t2 > t1, "{t2} > {t1}");
    }

    /// The break test's finding: processes or threads opening the same new file at the same
    /// time failed now and then with "cannot switch to WAL mode: database is locked" (SQLite
    /// answers busy at once, without its busy handler, where waiting could deadlock). Every
    /// open must succeed, and every store must work on the shared file.
    #[test]
    fn concurrent_opens_of_one_new_file_all_succeed() {
        const THREADS: usize = 8;
        for round in 0..20 {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("dedup.db");
            let start = std::sync::Arc::new(std::sync::Barrier::new(THREADS));
            let opens: Vec<_> = (0..THREADS)
                .map(|i| {
                    let (path, start) = (path.clone(), start.clone());
                    std::thread::spawn(move || {
                        start.wait();
                        futures::executor::block_on(async {
                            let store = EmbeddedStore::open(&path, Duration::from_secs(60)).await?;
                            let key = format!("k{i}");
                            match store.claim_one(req(&key, "w")).await? {
                                ClaimOutcome::Claimed { token } => {
                                    store.complete_one(&key, token, None).await
                                }
                                other => panic!("{key}: {other:?}"),
                            }
                        })
                    })
                })
                .collect();
            for (i, open) in opens.into_iter().enumerate() {
                match open.join().unwrap() {
                    Ok(done) => assert!(done, "round {round}, thread {i}: completion refused"),
                    Err(e) => panic!("round {round}, thread {i}: {e}"),
                }
            }
            let conn = Connection::open(&path).unwrap();
            let done: i64 = conn
                .query_row("SELECT count(*) FROM onceflow_dedup", [], |r| r.get(0))
                .unwrap();
            assert_eq!(done, THREADS as i64, "round {round}");
        }
    }

    #[tokio::test]
    async fn purge_deletes_expired_rows() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path().join("d.db"), Duration::from_millis(50))
            .await
            .unwrap();
        for i in 0..20 {
            let key = format!("k{i}");
            let ClaimOutcome::Claimed { token } = store.claim_one(req(&key, "a")).await.unwrap()
            else {
                panic!()
            };
            assert!(store.complete_one(&key, token, None).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(80)).await;
        // Some may already have gone by the amortised purge.
        let purged = store.purge_expired().await.unwrap();
        assert!(purged <= 20);
        let conn = Connection::open(store.path()).unwrap();
        let left: i64 = conn
            .query_row("SELECT count(*) FROM onceflow_dedup", [], |r| r.get(0))
            .unwrap();
        assert_eq!(left, 0);
    }
}
