//! The transactional inbox on the embedded (SQLite) store: [`EmbeddedInbox`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use rusqlite::{params, Connection, OptionalExtension, Transaction, TransactionBehavior};

use super::{
    parse_stored_position, HandlerSpans, InboxConfig, InboxDatabase, InboxLoop, InboxOutcome,
    InboxSummary,
};
use crate::client::Consumer;
use crate::dedup::embedded::EmbeddedOptions;
use crate::dedup::embedded::{db_error, ms, now_ms, open_connection, sql_token, token_of};
use crate::error::{BoxError, Error, ErrorKind, Result};
use crate::model::{Message, Position, TopicPartition};

/// A handler of the embedded inbox: gets the open SQLite transaction and the message.
///
/// Runs on a blocking thread (tokio's `spawn_blocking`), never on the async executor, so it
/// may do blocking work; it must not wait on the async runtime. Write the side effects through
/// `tx` (it is a transaction on the store's database file; `tx` derefs to
/// [`rusqlite::Connection`]); return an error to roll everything back (the message is retried).
/// Do not commit or roll back `tx` yourself. A panic rolls the transaction back and stops the
/// inbox with an error of kind [`ErrorKind::Handler`].
///
/// Closures `Fn(&mut Transaction<'_>, &Message) -> Result<(), BoxError>` are handlers too.
pub trait EmbeddedInboxHandler: Send + Sync {
    /// Handles one message inside `tx`.
    fn handle(
        &self,
        tx: &mut Transaction<'_>,
        message: &Message,
    ) -> std::result::Result<(), BoxError>;
}

impl<F> EmbeddedInboxHandler for F
where
    F: Fn(&mut Transaction<'_>, &Message) -> std::result::Result<(), BoxError> + Send + Sync,
{
    fn handle(
        &self,
        tx: &mut Transaction<'_>,
        message: &Message,
    ) -> std::result::Result<(), BoxError> {
        self(tx, message)
    }
}

/// `state` of a completed row in `onceflow_dedup`.
const STATE_COMPLETED: i64 = 2;

const SQL_KEY_ROW: &str = "SELECT token, state, expires_at FROM onceflow_dedup WHERE key = ?1";
/// A fresh fencing token above every token handed out so far (the store's thread hands out
/// tokens below `token_high` only) and above `?1`.
const SQL_TAKE_TOKEN: &str = "UPDATE onceflow_meta SET value = max(value, ?1) + 1 \
     WHERE name = 'token_high' RETURNING value - 1";
const SQL_COMPLETE_KEY: &str = "INSERT INTO onceflow_dedup \
     (key, token, state, owner, lease_until, expires_at, fingerprint, result) \
     VALUES (?1, ?2, 2, NULL, NULL, ?3, NULL, NULL) \
     ON CONFLICT(key) DO UPDATE SET token = excluded.token, state = 2, owner = NULL, \
     lease_until = NULL, expires_at = excluded.expires_at, fingerprint = NULL, result = NULL";
const SQL_SAVE_POSITION: &str = "INSERT INTO onceflow_inbox_position \
     (namespace, topic, partition, position, updated_at) VALUES (?1, ?2, ?3, ?4, ?5) \
     ON CONFLICT(namespace, topic, partition) DO UPDATE SET position = excluded.position, \
     updated_at = excluded.updated_at";
const SQL_LOAD_POSITION: &str = "SELECT position FROM onceflow_inbox_position \
     WHERE namespace = ?1 AND topic = ?2 AND partition = ?3";
const SQL_ALL_POSITIONS: &str = "SELECT topic, partition, position FROM \
     onceflow_inbox_position WHERE namespace = ?1 ORDER BY topic, partition";

/// The inbox's own connection to the store's file.
struct Db {
    conn: std::sync::Mutex<Connection>,
    path: PathBuf,
    window_ms: i64,
}

impl Db {
    fn shown(&self) -> String {
        format!("embedded store '{}'", self.path.display())
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        // A panicking handler leaves the connection usable: its transaction rolled back when
        // dropped during the unwind.
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn load(
        &self,
        namespace: &str,
        partitions: &[TopicPartition],
    ) -> Result<Vec<(TopicPartition, Position)>> {
        let conn = self.conn();
        let read = || -> rusqlite::Result<Vec<(TopicPartition, String)>> {
            let mut stmt = conn.prepare_cached(SQL_LOAD_POSITION)?;
            let mut found = Vec::new();
            for tp in partitions {
                if let Some(p) = stmt
                    .query_row(params![namespace, tp.topic, tp.partition], |r| {
                        r.get::<_, String>(0)
                    })
                    .optional()?
                {
                    found.push((tp.clone(), p));
                }
            }
            Ok(found)
        };
        let found = read().map_err(|e| db_error(&self.path, "inbox: cannot read positions", e))?;
        found
            .into_iter()
            .map(|(tp, p)| Ok((tp, parse_stored_position(&self.shown(), namespace, &p)?)))
            .collect()
    }

    fn all_positions(&self, namespace: &str) -> Result<Vec<(TopicPartition, Position)>> {
        let conn = self.conn();
        let read = || -> rusqlite::Result<Vec<(String, i32, String)>> {
            let mut stmt = conn.prepare_cached(SQL_ALL_POSITIONS)?;
            let rows = stmt.query_map([namespace], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
            rows.collect()
        };
        let rows = read().map_err(|e| db_error(&self.path, "inbox: cannot read positions", e))?;
        rows.into_iter()
            .map(|(topic, partition, p)| {
                Ok((
                    TopicPartition::new(topic, partition),
                    parse_stored_position(&self.shown(), namespace, &p)?,
                ))
            })
            .collect()
    }

    /// One transaction: key, handler, position, commit.
    fn transact<H: EmbeddedInboxHandler + ?Sized>(
        &self,
        handler: &H,
        spans: Option<&HandlerSpans>,
        namespace: &str,
        key: Option<&str>,
        m: &Message,
    ) -> Result<InboxOutcome> {
        let mut conn = self.conn();
        let mut tx = conn
            // IMMEDIATE: take the write lock now, so the transaction never has to upgrade a
            // read lock (which fails with SQLITE_BUSY instead of waiting).
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| db_error(&self.path, "inbox: cannot begin", e))?;
        let now = now_ms();
        let fresh = match key {
            Some(key) => record_key(&tx, key, now, self.window_ms)
                .map_err(|e| db_error(&self.path, "inbox: cannot record the key", e))?,
            None => true,
        };
        if fresh {
            HandlerSpans::run_sync(spans, m, || handler.handle(&mut tx, m))
                .map_err(|e| e.context(format!("inbox '{namespace}'")))?;
        }
        tx.prepare_cached(SQL_SAVE_POSITION)
            .and_then(|mut s| {
                s.execute(params![
                    namespace,
                    m.topic,
                    m.partition,
                    m.position.to_string(),
                    now
                ])
            })
            .map_err(|e| db_error(&self.path, "inbox: cannot record the position", e))?;
        tx.commit()
            .map_err(|e| db_error(&self.path, "inbox: commit failed", e))?;
        Ok(if fresh {
            InboxOutcome::Handled
        } else {
            InboxOutcome::Duplicate
        })
    }
}

/// Records `key` as completed unless it is completed within the window; `Ok(false)` when it
/// is (a duplicate). A claim in progress under the dedup store is taken over, as in the
/// PostgreSQL inbox.
fn record_key(tx: &Transaction<'_>, key: &str, now: i64, window_ms: i64) -> rusqlite::Result<bool> {
    let row: Option<(i64, i64, i64)> = tx
        .prepare_cached(SQL_KEY_ROW)?
        .query_row([key], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .optional()?;
    if let Some((_, state, expires_at)) = row {
        if state == STATE_COMPLETED && expires_at > now {
            return Ok(false);
        }
    }
    let min = row.map_or(1, |(token, _, _)| token_of(token) + 1);
    let token: i64 = tx
        .prepare_cached(SQL_TAKE_TOKEN)?
        .query_row([sql_token(min)], |r| r.get(0))?;
    tx.prepare_cached(SQL_COMPLETE_KEY)?.execute(params![
        key,
        token,
        now.saturating_add(window_ms)
    ])?;
    Ok(true)
}

/// Runs `f` on tokio's blocking pool; a panic in it becomes an error of kind
/// [`ErrorKind::Handler`] (not retriable).
async fn blocking<T: Send + 'static>(
    path: &Path,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => {
            let what = if e.is_panic() {
                let panic = e.into_panic();
                let msg = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".into());
                format!("the transaction panicked: {msg}")
            } else {
                "the transaction was cancelled".into()
            };
            Err(Error::new(
                ErrorKind::Handler,
                format!("embedded inbox on '{}': {what}", path.display()),
            )
            .retriable(false))
        }
    }
}

/// The store side of the loop, borrowing the inbox's connection and the handler.
struct SqliteInboxDb<H: ?Sized> {
    db: Arc<Db>,
    handler: Arc<H>,
    spans: Option<HandlerSpans>,
}

#[async_trait]
impl<H: EmbeddedInboxHandler + ?Sized + 'static> InboxDatabase for SqliteInboxDb<H> {
    async fn load_positions(
        &self,
        namespace: &str,
        partitions: &[TopicPartition],
    ) -> Result<Vec<(TopicPartition, Position)>> {
        let db = self.db.clone();
        let namespace = namespace.to_string();
        let partitions = partitions.to_vec();
        blocking(&self.db.path, move || db.load(&namespace, &partitions)).await
    }

    async fn transact(
        &self,
        namespace: &str,
        key: Option<&str>,
        message: &Message,
    ) -> Result<InboxOutcome> {
        let db = self.db.clone();
        let handler = self.handler.clone();
        let namespace = namespace.to_string();
        let key = key.map(str::to_string);
        let message = message.clone();
        let spans = self.spans.clone();
        blocking(&self.db.path, move || {
            db.transact(
                &*handler,
                spans.as_ref(),
                &namespace,
                key.as_deref(),
                &message,
            )
        })
        .await
    }
}

/// Reads the stored positions of an [`EmbeddedInbox`]'s namespace, also while it runs and
/// after it ran (made by [`EmbeddedInbox::positions_reader`]; cheap to clone).
#[derive(Clone)]
pub struct EmbeddedInboxPositions {
    db: Arc<Db>,
    namespace: String,
}

impl std::fmt::Debug for EmbeddedInboxPositions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedInboxPositions")
            .field("path", &self.db.path)
            .field("namespace", &self.namespace)
            .finish()
    }
}

impl EmbeddedInboxPositions {
    /// Per partition, the last message handled (or skipped) and committed, ordered by topic
    /// and partition. Errors: [`ErrorKind::DedupStore`] when the file cannot be read or a
    /// stored position does not parse.
    pub async fn read(&self) -> Result<Vec<(TopicPartition, Position)>> {
        let db = self.db.clone();
        let namespace = self.namespace.clone();
        blocking(&self.db.path, move || db.all_positions(&namespace)).await
    }
}

/// The transactional inbox on the embedded (SQLite) store, made by
/// [`EmbeddedStore::inbox`](crate::dedup::EmbeddedStore::inbox).
///
/// Each message is handled inside one SQLite transaction on the store's database file that also
/// records its idempotency key (in the store's `onceflow_dedup` table, as a completed key named
/// by [`inbox_key`](super::inbox_key)) and the consumer's position (in
/// `onceflow_inbox_position`). The handler ([`EmbeddedInboxHandler`]) writes its own rows in the
/// same transaction, so the three become durable together or not at all: with the store's
/// default [`Durability::ProcessCrash`](crate::dedup::embedded::Durability::ProcessCrash) a
/// committed message survives a crash of the process, with
/// [`Durability::PowerLoss`](crate::dedup::embedded::Durability::PowerLoss) also power loss.
///
/// - **Exactly once per key, resume from the database, failures**: as every inbox, see the
///   [module docs](super). On start it seeks the consumer to just after the positions stored
///   in the file, so a new consumer group, or a broker whose committed offsets were lost,
///   still handles nothing twice.
/// - **Threads**: every transaction (and the handler in it) runs on tokio's blocking pool
///   through `spawn_blocking`, never on the async executor. The inbox has its own connection
///   to the file; it and the store's thread take SQLite's write lock in turn (`BEGIN
///   IMMEDIATE`, waiting up to 5 s), so the dedup store stays usable alongside.
/// - **Fencing tokens**: a recorded key gets a token from the same reservation the store uses,
///   so tokens stay unique and increasing per key across the store and the inbox.
///
/// ```no_run
/// # async fn demo(client: onceflow_core::Client) -> onceflow_core::Result<()> {
/// use std::time::Duration;
/// use onceflow_core::dedup::EmbeddedStore;
/// use onceflow_core::inbox::InboxConfig;
/// use onceflow_core::rusqlite::Transaction;
/// use onceflow_core::{BoxError, ConsumerConfig, Message};
///
/// let store = EmbeddedStore::open("/var/lib/billing/dedup.db", Duration::from_secs(86_400)).await?;
/// let consumer = client.consumer(ConsumerConfig::new("billing", ["orders"])).await?;
/// let inbox = store.inbox(consumer, InboxConfig::default()).await?;
/// let summary = inbox
///     .run_until(
///         |tx: &mut Transaction<'_>, m: &Message| -> Result<(), BoxError> {
///             tx.execute("INSERT INTO charges (payload) VALUES (?1)", [&m.payload[..]])?;
///             Ok(())
///         },
///         tokio::time::sleep(Duration::from_secs(10)),
///     )
///     .await?;
/// # Ok(()) }
/// ```
pub struct EmbeddedInbox {
    db: Arc<Db>,
    inner: InboxLoop,
}

impl std::fmt::Debug for EmbeddedInbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedInbox")
            .field("path", &self.db.path)
            .field("namespace", &self.inner.namespace())
            .field("consumer", self.inner.consumer())
            .finish()
    }
}

impl EmbeddedInbox {
    pub(crate) async fn open(
        path: PathBuf,
        options: EmbeddedOptions,
        consumer: Consumer,
        config: InboxConfig,
    ) -> Result<Self> {
        let window_ms = ms(options.window);
        let open_path = path.clone();
        let conn = blocking(&path, move || open_connection(&open_path, &options)).await?;
        Ok(EmbeddedInbox {
            db: Arc::new(Db {
                conn: std::sync::Mutex::new(conn),
                path,
                window_ms,
            }),
            inner: InboxLoop::new(consumer, config),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.db.path
    }

    /// How long a recorded key is remembered (the store's window).
    pub fn window(&self) -> Duration {
        Duration::from_millis(u64::try_from(self.db.window_ms).unwrap_or(0))
    }

    /// The namespace of this inbox's keys and positions.
    pub fn namespace(&self) -> &str {
        self.inner.namespace()
    }

    /// What this inbox did so far.
    pub fn summary(&self) -> &InboxSummary {
        self.inner.summary()
    }

    /// The positions stored for this inbox's namespace: per partition, the last message
    /// handled (or skipped) and committed.
    pub async fn stored_positions(&self) -> Result<Vec<(TopicPartition, Position)>> {
        self.positions_reader().read().await
    }

    /// A reader of this inbox's stored positions that outlives it: it keeps the inbox's
    /// connection to the file, so the positions can be read while
    /// [`run_until`](Self::run_until) runs (it takes the inbox) and after it returned.
    pub fn positions_reader(&self) -> EmbeddedInboxPositions {
        EmbeddedInboxPositions {
            db: self.db.clone(),
            namespace: self.namespace().to_string(),
        }
    }

    /// Polls once and handles what came; returns the number of messages polled. See
    /// [`InboxLoop::step`] for the errors.
    pub async fn step<H: EmbeddedInboxHandler + ?Sized + 'static>(
        &mut self,
        handler: &Arc<H>,
    ) -> Result<usize> {
        let db = SqliteInboxDb {
            db: self.db.clone(),
            handler: handler.clone(),
            spans: self.inner.handler_spans(),
        };
        self.inner.step(&db).await
    }

    /// Runs until `shutdown` completes or an error stops it; then commits the broker offsets
    /// and returns what it did. Does not close the consumer.
    ///
    /// `shutdown` stops a poll or a retry that is waiting (that message and the rest of its
    /// batch come again on the next start); otherwise a batch already polled is handled to its
    /// end first, so the summary counts every transaction that committed.
    pub async fn run_until<H: EmbeddedInboxHandler + 'static>(
        self,
        handler: H,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<InboxSummary> {
        let db = SqliteInboxDb {
            db: self.db,
            handler: Arc::new(handler),
            spans: self.inner.handler_spans(),
        };
        self.inner.run_until(&db, shutdown).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dedup::{
        ClaimOutcome, ClaimRequest, DedupStore, DedupStoreExt, EmbeddedStore, KeyState,
    };
    use crate::inbox::inbox_key;
    use crate::model::Headers;
    use bytes::Bytes;

    fn message(partition: i32, offset: i64, payload: &str) -> Message {
        Message {
            topic: "orders".into(),
            partition,
            position: Position::Offset(offset),
            key: None,
            payload: Bytes::from(payload.to_string()),
            headers: Headers::default(),
            timestamp: None,
            delivery_count: 1,
        }
    }

    async fn store_and_db(dir: &tempfile::TempDir) -> (EmbeddedStore, Arc<Db>) {
        let path = dir.path().join("inbox.db");
        let store = EmbeddedStore::open(&path, Duration::from_secs(3600))
            .await
            .unwrap();
        let conn = open_connection(&path, store.options()).unwrap();
        conn.execute_batch("CREATE TABLE rows (payload TEXT NOT NULL)")
            .unwrap();
        let db = Arc::new(Db {
            conn: std::sync::Mutex::new(conn),
            path,
            window_ms: 3_600_000,
        });
        (store, db)
    }

    fn insert_row(tx: &mut Transaction<'_>, m: &Message) -> std::result::Result<(), BoxError> {
        tx.execute(
            "INSERT INTO rows (payload) VALUES (?1)",
            [String::from_utf8_lossy(&m.payload)],
        )?;
        Ok(())
    }

    fn count(db: &Db, sql: &str) -> i64 {
        db.conn().query_row(sql, [], |r| r.get(0)).unwrap()
    }

    #[tokio::test]
    async fn key_rows_and_position_commit_together_and_a_failure_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (store, db) = store_and_db(&dir).await;
        let key = inbox_key("ns", "k1");
        let out = db
            .transact(&insert_row, None, "ns", Some(&key), &message(0, 5, "a"))
            .unwrap();
        assert_eq!(out, InboxOutcome::Handled);
        // The same key again (a redelivery at a later position): not handled, position moves.
        let out = db
            .transact(&insert_row, None, "ns", Some(&key), &message(0, 6, "a"))
            .unwrap();
        assert_eq!(out, InboxOutcome::Duplicate);
        assert_eq!(count(&db, "SELECT count(*) FROM rows"), 1);
        assert_eq!(
            db.all_positions("ns").unwrap(),
            vec![(TopicPartition::new("orders", 0), Position::Offset(6))]
        );
        // The key is a completed key for the dedup store too.
        assert!(matches!(
            store.get(std::slice::from_ref(&key)).await.unwrap()[0],
            Some(KeyState::Completed { .. })
        ));

        // A failing handler: its row, the key and the position are all rolled back.
        let failing =
            |tx: &mut Transaction<'_>, m: &Message| -> std::result::Result<(), BoxError> {
                insert_row(tx, m)?;
                Err("handler fails".into())
            };
        let key2 = inbox_key("ns", "k2");
        let e = db
            .transact(&failing, None, "ns", Some(&key2), &message(0, 7, "b"))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Handler, "{e}");
        assert!(e.is_retriable());
        assert_eq!(count(&db, "SELECT count(*) FROM rows"), 1);
        assert_eq!(store.get(&[key2]).await.unwrap(), vec![None]);
        assert_eq!(
            db.load(
                "ns",
                &[
                    TopicPartition::new("orders", 0),
                    TopicPartition::new("orders", 1)
                ]
            )
            .unwrap(),
            vec![(TopicPartition::new("orders", 0), Position::Offset(6))]
        );
        // No key: always handled.
        for _ in 0..2 {
            let out = db
                .transact(&insert_row, None, "ns", None, &message(1, 0, "c"))
                .unwrap();
            assert_eq!(out, InboxOutcome::Handled);
        }
        assert_eq!(count(&db, "SELECT count(*) FROM rows"), 3);
        // Namespaces are apart.
        assert!(db.all_positions("other").unwrap().is_empty());
    }

    #[tokio::test]
    async fn fencing_tokens_stay_unique_and_increasing_across_the_store_and_the_inbox() {
        let dir = tempfile::tempdir().unwrap();
        let (store, db) = store_and_db(&dir).await;
        let claim = |key: &str, lease: Duration| ClaimRequest {
            key: key.into(),
            owner: "w".into(),
            lease,
            fingerprint: None,
        };
        let ClaimOutcome::Claimed { token: t1 } = store
            .claim_one(claim("a", Duration::from_secs(30)))
            .await
            .unwrap()
        else {
            panic!()
        };
        // A key claimed by the store whose lease ran out: the inbox takes it over with a higher
        // token.
        let taken = inbox_key("ns", "x");
        let ClaimOutcome::Claimed { token: t2 } = store
            .claim_one(claim(&taken, Duration::from_millis(1)))
            .await
            .unwrap()
        else {
            panic!()
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        let out = db
            .transact(&insert_row, None, "ns", Some(&taken), &message(0, 0, "x"))
            .unwrap();
        assert_eq!(out, InboxOutcome::Handled);
        let Some(KeyState::Completed { token: t3, .. }) =
            store.get(std::slice::from_ref(&taken)).await.unwrap()[0]
        else {
            panic!()
        };
        assert!(t3 > t2 && t3 > t1, "{t3} > {t2}, {t1}");
        // The store's next tokens never repeat the inbox's.
        let mut tokens = vec![t1, t2, t3];
        for i in 0..5 {
            let ClaimOutcome::Claimed { token } = store
                .claim_one(claim(&format!("b{i}"), Duration::from_secs(30)))
                .await
                .unwrap()
            else {
                panic!()
            };
            tokens.push(token);
            db.transact(
                &insert_row,
                None,
                "ns",
                Some(&inbox_key("ns", &format!("y{i}"))),
                &message(0, i + 1, "y"),
            )
            .unwrap();
            let Some(KeyState::Completed { token, .. }) = store
                .get(&[inbox_key("ns", &format!("y{i}"))])
                .await
                .unwrap()[0]
            else {
                panic!()
            };
            tokens.push(token);
        }
        let mut unique = tokens.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), tokens.len(), "{tokens:?}");
    }

    #[tokio::test]
    async fn a_panicking_handler_is_a_handler_error_and_rolls_back() {
        let dir = tempfile::tempdir().unwrap();
        let (_store, db) = store_and_db(&dir).await;
        let handler = Arc::new(
            |tx: &mut Transaction<'_>, m: &Message| -> std::result::Result<(), BoxError> {
                insert_row(tx, m)?;
                panic!("boom");
            },
        );
        let inbox_db = SqliteInboxDb {
            db: db.clone(),
            handler,
            spans: None,
        };
        let e = inbox_db
            .transact("ns", Some("inbox:ns:p"), &message(0, 1, "p"))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Handler, "{e}");
        assert!(!e.is_retriable());
        assert!(e.message().contains("boom"), "{e}");
        // The connection is still usable and nothing was committed.
        assert_eq!(count(&db, "SELECT count(*) FROM rows"), 0);
        assert_eq!(
            count(&db, "SELECT count(*) FROM onceflow_inbox_position"),
            0
        );
        let out = SqliteInboxDb {
            db: db.clone(),
            handler: Arc::new(insert_row),
            spans: None,
        }
        .transact("ns", Some("inbox:ns:p"), &message(0, 1, "p"))
        .await
        .unwrap();
        assert_eq!(out, InboxOutcome::Handled);
    }

    #[tokio::test]
    async fn a_version_1_file_gets_the_inbox_table_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v1.db");
        let store = EmbeddedStore::open(&path, Duration::from_secs(60))
            .await
            .unwrap();
        let ClaimOutcome::Claimed { token } = store
            .claim_one(ClaimRequest {
                key: "kept".into(),
                owner: "w".into(),
                lease: Duration::from_secs(30),
                fingerprint: None,
            })
            .await
            .unwrap()
        else {
            panic!()
        };
        assert!(store.complete_one("kept", token, None).await.unwrap());
        drop(store);
        // Turn it into a file as version 1 wrote it.
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch(
            "DROP TABLE onceflow_inbox_position; DELETE FROM onceflow_schema_version; \
             INSERT INTO onceflow_schema_version (version) VALUES (1);",
        )
        .unwrap();
        drop(conn);
        let store = EmbeddedStore::open(&path, Duration::from_secs(60))
            .await
            .unwrap();
        assert!(matches!(
            store.get(&["kept".to_string()]).await.unwrap()[0],
            Some(KeyState::Completed { .. })
        ));
        let conn = Connection::open(&path).unwrap();
        let version: i64 = conn
            .query_row(
                "SELECT max(version) FROM onceflow_schema_version",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(version, crate::dedup::embedded::SCHEMA_VERSION);
        let n: i64 = conn
            .query_row("SELECT count(*) FROM onceflow_inbox_position", [], |r| {
                r.get(0)
            })
            .unwrap();
        assert_eq!(n, 0);
    }
}
