//! On-disk checkpoint store: the lease table in one SQLite file (WAL mode), driven by a
//! dedicated thread, the way the embedded dedup store is.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use rusqlite::{params, Connection, ErrorCode, OpenFlags, OptionalExtension, TransactionBehavior};
use tokio::sync::oneshot;

use super::row::Row;
use super::{
    validate, CheckpointRequest, CheckpointStore, HeldLease, Lease, LeaseCounter, NewLease,
    TakeOutcome, TakeRequest,
};
use crate::error::{Error, Result};

/// Schema version of the lease table this build writes and reads.
pub const SCHEMA_VERSION: i64 = 1;

/// Embedded on-disk [`CheckpointStore`]: one SQLite database file that survives restarts.
///
/// - **Durability**: every call is committed before it returns, in SQLite WAL mode with
///   `synchronous=NORMAL`: a committed checkpoint survives a crash of the process; power loss
///   may lose the last commits.
/// - **Sharing**: several processes on one machine may open the same file; every call is one
///   `BEGIN IMMEDIATE` transaction, so rows stay linearisable across processes (a writer waits
///   up to 5 s for another's lock).
/// - **Clock**: expiry uses the machine's wall clock (ms since the Unix epoch), shared by every
///   process on it; a clock stepping backwards lengthens leases.
/// - **Threads**: database work runs on one dedicated thread, never on the async executor.
/// - **File**: the tables are `onceflow_leases` and `onceflow_leases_schema`; the file may also
///   hold an embedded dedup store or any other tables, which are left alone.
///
/// A path that cannot be used is an error of kind [`crate::ErrorKind::DedupStore`] naming it.
pub struct EmbeddedCheckpointStore {
    path: PathBuf,
    jobs: Option<mpsc::Sender<Job>>,
    worker: Option<JoinHandle<()>>,
}

type Job = Box<dyn FnOnce(&mut Connection) + Send>;

impl std::fmt::Debug for EmbeddedCheckpointStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedCheckpointStore")
            .field("path", &self.path)
            .finish()
    }
}

fn db_error(path: &Path, what: &str, e: rusqlite::Error) -> Error {
    let busy = matches!(
        e.sqlite_error_code(),
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked)
    );
    let hint = match e.sqlite_error_code() {
        Some(ErrorCode::NotADatabase) => " (the file exists but is not an SQLite database)",
        Some(ErrorCode::CannotOpen) => " (check that the path is a writable file location)",
        Some(ErrorCode::ReadOnly) => " (the file or its directory is read-only)",
        _ => "",
    };
    Error::dedup_store(format!(
        "embedded checkpoint store '{}': {what}: {e}{hint}",
        path.display()
    ))
    .with_source(e)
    .retriable(busy)
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

const SQL_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS onceflow_leases_schema (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS onceflow_leases (
    grp         TEXT NOT NULL,
    key         TEXT NOT NULL,
    owner       TEXT,
    counter     INTEGER NOT NULL,
    lease_until INTEGER NOT NULL,  -- ms since the Unix epoch; 0 when unowned
    checkpoint  TEXT,
    parents     TEXT NOT NULL,     -- JSON array of lease keys
    PRIMARY KEY (grp, key)
) WITHOUT ROWID;
";

fn open_conn(path: &Path) -> Result<Connection> {
    let shown = path.display().to_string();
    if path.as_os_str().is_empty() {
        return Err(Error::dedup_store(
            "embedded checkpoint store: the path is empty; expected a file path such as /var/lib/app/leases.db",
        ));
    }
    if path.is_dir() {
        return Err(Error::dedup_store(format!(
            "embedded checkpoint store '{shown}': is a directory; expected a database file path"
        )));
    }
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        if !parent.is_dir() {
            return Err(Error::dedup_store(format!(
                "embedded checkpoint store '{shown}': directory '{}' does not exist or is not a directory",
                parent.display()
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
    conn.busy_timeout(Duration::from_secs(5))
        .map_err(|e| db_error(path, "cannot set the busy timeout", e))?;
    // Retried while other connections create the same file (see `switch_to_wal`).
    let mode = crate::dedup::embedded::switch_to_wal(&conn)
        .map_err(|e| db_error(path, "cannot switch to WAL mode", e))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(Error::dedup_store(format!(
            "embedded checkpoint store '{shown}': SQLite refused WAL mode (journal mode is '{mode}')"
        )));
    }
    conn.pragma_update(None, "synchronous", "NORMAL")
        .map_err(|e| db_error(path, "cannot set synchronous", e))?;
    let mut conn = conn;
    let version = (|| -> rusqlite::Result<Option<i64>> {
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.execute_batch(SQL_SCHEMA)?;
        let v: Option<i64> =
            tx.query_row("SELECT max(version) FROM onceflow_leases_schema", [], |r| {
                r.get(0)
            })?;
        if v.is_none() {
            tx.execute(
                "INSERT INTO onceflow_leases_schema (version) VALUES (?1)",
                [SCHEMA_VERSION],
            )?;
        }
        tx.commit()?;
        Ok(v)
    })()
    .map_err(|e| db_error(path, "cannot create or read the schema", e))?;
    if let Some(v) = version.filter(|v| *v > SCHEMA_VERSION) {
        return Err(Error::dedup_store(format!(
            "embedded checkpoint store '{shown}': schema version {v} was written by a newer \
             onceflow; this build reads schema version {SCHEMA_VERSION} at most"
        )));
    }
    conn.set_prepared_statement_cache_capacity(16);
    Ok(conn)
}

fn read_row(tx: &Connection, group: &str, key: &str) -> rusqlite::Result<Option<Row>> {
    tx.prepare_cached(
        "SELECT owner, counter, lease_until, checkpoint, parents FROM onceflow_leases \
         WHERE grp = ?1 AND key = ?2",
    )?
    .query_row(params![group, key], |r| {
        let parents: String = r.get(4)?;
        Ok(Row {
            owner: r.get(0)?,
            counter: u64::try_from(r.get::<_, i64>(1)?).unwrap_or(0),
            lease_until: r.get(2)?,
            checkpoint: r.get(3)?,
            parents: serde_json::from_str(&parents).unwrap_or_default(),
        })
    })
    .optional()
}

/// For each item: reads its row, applies `change` (the result, and whether the row changed),
/// writes a changed row back; `missing` for an item whose row does not exist.
fn change_rows<T, R: Clone>(
    tx: &Connection,
    group: &str,
    items: &[T],
    key: impl Fn(&T) -> &str,
    missing: R,
    mut change: impl FnMut(&mut Row, &T) -> (R, bool),
) -> rusqlite::Result<Vec<R>> {
    items
        .iter()
        .map(|item| {
            let Some(mut row) = read_row(tx, group, key(item))? else {
                return Ok(missing.clone());
            };
            let (result, changed) = change(&mut row, item);
            if changed {
                write_row(tx, group, key(item), &row)?;
            }
            Ok(result)
        })
        .collect()
}

fn write_row(tx: &Connection, group: &str, key: &str, row: &Row) -> rusqlite::Result<()> {
    let parents = serde_json::to_string(&row.parents).unwrap_or_else(|_| "[]".into());
    tx.prepare_cached(
        "INSERT INTO onceflow_leases (grp, key, owner, counter, lease_until, checkpoint, parents) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) \
         ON CONFLICT(grp, key) DO UPDATE SET owner = excluded.owner, counter = excluded.counter, \
         lease_until = excluded.lease_until, checkpoint = excluded.checkpoint, \
         parents = excluded.parents",
    )?
    .execute(params![
        group,
        key,
        row.owner,
        i64::try_from(row.counter).unwrap_or(i64::MAX),
        row.lease_until,
        row.checkpoint,
        parents
    ])?;
    Ok(())
}

impl EmbeddedCheckpointStore {
    /// Opens (creating if needed) the store at `path`. The parent directory must exist.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let (ready_tx, ready_rx) = oneshot::channel();
        let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
        let worker_path = path.clone();
        let worker = std::thread::Builder::new()
            .name("onceflow-checkpoint-embedded".into())
            .spawn(move || match open_conn(&worker_path) {
                Ok(mut conn) => {
                    let _ = ready_tx.send(Ok(()));
                    while let Ok(job) = jobs_rx.recv() {
                        job(&mut conn);
                    }
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| {
                Error::dedup_store(format!(
                    "embedded checkpoint store '{}': cannot start its thread",
                    path.display()
                ))
                .with_source(e)
            })?;
        let opened = ready_rx.await.unwrap_or_else(|_| {
            Err(Error::dedup_store(format!(
                "embedded checkpoint store '{}': its thread stopped while opening",
                path.display()
            )))
        });
        if let Err(e) = opened {
            let _ = worker.join();
            return Err(e);
        }
        Ok(EmbeddedCheckpointStore {
            path,
            jobs: Some(jobs_tx),
            worker: Some(worker),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` in one `BEGIN IMMEDIATE` transaction on the database thread, with the clock
    /// reading taken inside the transaction.
    async fn tx<R: Send + 'static>(
        &self,
        what: &'static str,
        f: impl FnOnce(&Connection, i64) -> rusqlite::Result<R> + Send + 'static,
    ) -> Result<R> {
        let (reply, rx) = oneshot::channel();
        let path = self.path.clone();
        let job: Job = Box::new(move |conn: &mut Connection| {
            let r = (|| {
                let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
                let r = f(&tx, now_ms())?;
                tx.commit()?;
                Ok(r)
            })()
            .map_err(|e| db_error(&path, what, e));
            let _ = reply.send(r);
        });
        let stopped = || {
            Error::dedup_store(format!(
                "embedded checkpoint store '{}': its thread has stopped",
                self.path.display()
            ))
        };
        self.jobs
            .as_ref()
            .ok_or_else(stopped)?
            .send(job)
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }
}

impl Drop for EmbeddedCheckpointStore {
    /// Lets the thread finish the calls already queued, close the database, and waits for it.
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

#[async_trait]
impl CheckpointStore for EmbeddedCheckpointStore {
    fn name(&self) -> &'static str {
        "embedded"
    }

    async fn list(&self, group: &str) -> Result<Vec<Lease>> {
        validate(group, [], [])?;
        let group = group.to_string();
        self.tx("cannot list leases", move |tx, now| {
            let mut stmt =
                tx.prepare_cached("SELECT key FROM onceflow_leases WHERE grp = ?1 ORDER BY key")?;
            let keys = stmt
                .query_map([&group], |r| r.get::<_, String>(0))?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            let mut out = Vec::with_capacity(keys.len());
            for k in keys {
                if let Some(row) = read_row(tx, &group, &k)? {
                    out.push(row.to_lease(&k, now));
                }
            }
            // SQLite's TEXT order is byte order (BINARY collation): the documented order.
            Ok(out)
        })
        .await
    }

    async fn get(&self, group: &str, keys: &[String]) -> Result<Vec<Option<Lease>>> {
        validate(group, keys.iter().map(String::as_str), [])?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let (group, keys) = (group.to_string(), keys.to_vec());
        self.tx("cannot read leases", move |tx, now| {
            keys.iter()
                .map(|k| Ok(read_row(tx, &group, k)?.map(|r| r.to_lease(k, now))))
                .collect()
        })
        .await
    }

    async fn create(&self, group: &str, leases: &[NewLease]) -> Result<Vec<bool>> {
        validate(group, leases.iter().map(|l| l.key.as_str()), [])?;
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let (group, leases) = (group.to_string(), leases.to_vec());
        self.tx("cannot create leases", move |tx, _| {
            leases
                .iter()
                .map(|l| {
                    if read_row(tx, &group, &l.key)?.is_some() {
                        return Ok(false);
                    }
                    write_row(
                        tx,
                        &group,
                        &l.key,
                        &Row::new(l.checkpoint.clone(), l.parents.clone()),
                    )?;
                    Ok(true)
                })
                .collect()
        })
        .await
    }

    async fn take(&self, group: &str, requests: &[TakeRequest]) -> Result<Vec<TakeOutcome>> {
        validate(
            group,
            requests.iter().map(|r| r.key.as_str()),
            requests.iter().map(|r| r.owner.as_str()),
        )?;
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let (group, requests) = (group.to_string(), requests.to_vec());
        self.tx("cannot take leases", move |tx, now| {
            requests
                .iter()
                .map(|req| {
                    let Some(mut row) = read_row(tx, &group, &req.key)? else {
                        return Ok(TakeOutcome::Refused { current: None });
                    };
                    Ok(match row.take(req, now) {
                        Some(counter) => {
                            write_row(tx, &group, &req.key, &row)?;
                            TakeOutcome::Taken { counter }
                        }
                        None => TakeOutcome::Refused {
                            current: Some(row.to_lease(&req.key, now)),
                        },
                    })
                })
                .collect()
        })
        .await
    }

    async fn renew(
        &self,
        group: &str,
        leases: &[HeldLease],
        lease: Duration,
    ) -> Result<Vec<Option<LeaseCounter>>> {
        validate(
            group,
            leases.iter().map(|l| l.key.as_str()),
            leases.iter().map(|l| l.owner.as_str()),
        )?;
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let (group, leases) = (group.to_string(), leases.to_vec());
        self.tx("cannot renew leases", move |tx, now| {
            change_rows(
                tx,
                &group,
                &leases,
                |h| &h.key,
                None,
                |row, h| {
                    let c = row.renew(h, lease, now);
                    let changed = c.is_some();
                    (c, changed)
                },
            )
        })
        .await
    }

    async fn release(&self, group: &str, leases: &[HeldLease]) -> Result<Vec<bool>> {
        validate(
            group,
            leases.iter().map(|l| l.key.as_str()),
            leases.iter().map(|l| l.owner.as_str()),
        )?;
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let (group, leases) = (group.to_string(), leases.to_vec());
        self.tx("cannot release leases", move |tx, _| {
            change_rows(
                tx,
                &group,
                &leases,
                |h| &h.key,
                false,
                |row, h| {
                    let ok = row.release(h);
                    (ok, ok)
                },
            )
        })
        .await
    }

    async fn checkpoint(&self, group: &str, requests: &[CheckpointRequest]) -> Result<Vec<bool>> {
        validate(
            group,
            requests.iter().map(|r| r.key.as_str()),
            requests.iter().map(|r| r.owner.as_str()),
        )?;
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let (group, requests) = (group.to_string(), requests.to_vec());
        self.tx("cannot write checkpoints", move |tx, _| {
            change_rows(
                tx,
                &group,
                &requests,
                |c| &c.key,
                false,
                |row, c| {
                    let ok = row.checkpoint(c);
                    (ok, ok)
                },
            )
        })
        .await
    }

    async fn delete(&self, group: &str, keys: &[String]) -> Result<Vec<bool>> {
        validate(group, keys.iter().map(String::as_str), [])?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let (group, keys) = (group.to_string(), keys.to_vec());
        self.tx("cannot delete leases", move |tx, _| {
            keys.iter()
                .map(|k| {
                    Ok(tx
                        .prepare_cached("DELETE FROM onceflow_leases WHERE grp = ?1 AND key = ?2")?
                        .execute(params![group, k])?
                        > 0)
                })
                .collect()
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Processes or threads opening the same new file at once: SQLite answers the switch to
    /// WAL mode with "database is locked" at once where waiting could deadlock, so the open
    /// retries it (shared with the embedded dedup store). Every open must succeed.
    #[test]
    fn concurrent_opens_of_one_new_file_all_succeed() {
        const THREADS: usize = 8;
        for round in 0..20 {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("checkpoints.db");
            let start = std::sync::Arc::new(std::sync::Barrier::new(THREADS));
            let opens: Vec<_> = (0..THREADS)
                .map(|_| {
                    let (path, start) = (path.clone(), start.clone());
                    std::thread::spawn(move || {
                        start.wait();
                        futures::executor::block_on(EmbeddedCheckpointStore::open(&path)).map(drop)
                    })
                })
                .collect();
            for (i, open) in opens.into_iter().enumerate() {
                if let Err(e) = open.join().unwrap() {
                    panic!("round {round}, thread {i}: {e}");
                }
            }
        }
    }
}
