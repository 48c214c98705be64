//! The transactional inbox for the bindings: [`Inbox`] opens core's inbox on PostgreSQL or on
//! the embedded (SQLite) store from a store URL, and lets a handler written in the host
//! language run its SQL in the message's database transaction through an [`InboxTx`].
//!
//! ## How a borrowed transaction reaches an async host handler
//! Rust's inbox handlers borrow the open transaction for the length of one call
//! (`onceflow::postgres::InboxHandler` gets a `&mut tokio_postgres::Transaction`,
//! `onceflow::inbox::EmbeddedInboxHandler` a `&mut rusqlite::Transaction` on a blocking
//! thread). A Python coroutine or a JavaScript Promise cannot hold that borrow, so the handler
//! call here:
//! 1. makes a channel and an [`InboxTx`] holding its sending end, and starts the host's handler
//!    ([`InboxCallback::call`]) with the message and that `InboxTx`, as a task of the runtime;
//! 2. serves the statements the handler sends through the `InboxTx` ([`InboxTx::execute`],
//!    [`InboxTx::query`]) on the borrowed transaction, one at a time, in order, until the
//!    handler's task reports it finished;
//! 3. closes the `InboxTx`: a statement sent after the handler returned fails with an error of
//!    kind [`ErrorKind::Closed`] ("the inbox transaction is over: use it only while the
//!    handler runs").
//!
//! A statement that fails (a SQL error, a parameter the column type cannot take) fails the
//! message's transaction even if the handler catches the error and returns normally: the
//! transaction rolls back and the message is retried like one whose handler failed (on
//! PostgreSQL a failed statement aborts the transaction anyway; the embedded store behaves
//! the same so a handler works alike on both).
//!
//! ## Values
//! Parameters and row values are [`SqlValue`]s: null, boolean, 64-bit integer, float, text,
//! bytes. PostgreSQL parameters are `$1, $2, …`, each converted to the type the server infers
//! for its placeholder: an integer to `int2`/`int4`/`int8` (refused when out of range) or
//! `float4`/`float8`, a float to `float4`/`float8`, text to `text`/`varchar`/`char`/`name`,
//! bytes to `bytea`, a boolean to `bool`, null to anything. Another pairing is an error of kind
//! [`ErrorKind::Serialization`] naming the parameter (`params[1] ($2)`) and both types; cast
//! the placeholder in SQL (`$1::text::uuid`, `CAST($1 AS bigint)::numeric`). Result columns
//! of types other than boolean, integers, floats, text and `bytea` are refused the same way,
//! with a hint to cast them (`created::text`). SQLite parameters are `?` or `?1, ?2, …`;
//! booleans are stored as 0/1, every SQLite value reads back as null, integer, float, text or
//! bytes.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use onceflow::inbox::{EmbeddedInbox, EmbeddedInboxHandler, InboxConfig, InboxSummary};
use onceflow::{BoxError, Consumer, Error, ErrorKind, Message, Position, Result, TopicPartition};
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};

/// One SQL parameter or row value, the same for both stores.
#[derive(Debug, Clone, PartialEq)]
pub enum SqlValue {
    /// SQL `NULL` (Python `None`, JavaScript `null`/`undefined`).
    Null,
    /// A boolean (SQLite stores 0/1).
    Bool(bool),
    /// A 64-bit integer.
    Int(i64),
    /// A 64-bit float.
    Float(f64),
    /// Text.
    Text(String),
    /// Bytes (`bytea` / `BLOB`).
    Bytes(Vec<u8>),
}

impl SqlValue {
    /// The value's kind in words, for errors.
    pub fn kind_name(&self) -> &'static str {
        match self {
            SqlValue::Null => "null",
            SqlValue::Bool(_) => "boolean",
            SqlValue::Int(_) => "integer",
            SqlValue::Float(_) => "float",
            SqlValue::Text(_) => "text",
            SqlValue::Bytes(_) => "bytes",
        }
    }
}

/// What a query returned: the column names and the rows, each with one value per column.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SqlRows {
    /// Column names, in order.
    pub columns: Vec<String>,
    /// Rows, each with `columns.len()` values.
    pub rows: Vec<Vec<SqlValue>>,
}

/// Which database an [`Inbox`] (and so its [`InboxTx`]) runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InboxStore {
    /// PostgreSQL: placeholders `$1, $2, …`.
    Postgres,
    /// The embedded (SQLite) store: placeholders `?` or `?1, ?2, …`.
    Embedded,
}

impl InboxStore {
    /// `"postgres"` or `"embedded"`.
    pub fn name(self) -> &'static str {
        match self {
            InboxStore::Postgres => "postgres",
            InboxStore::Embedded => "embedded",
        }
    }
}

enum Request {
    Execute(String, Vec<SqlValue>, oneshot::Sender<Result<u64>>),
    Query(String, Vec<SqlValue>, oneshot::Sender<Result<SqlRows>>),
}

enum Msg {
    Statement(Request),
    Done(std::result::Result<(), BoxError>),
}

/// The handler's view of the message's open database transaction, valid only while the
/// handler runs (see the [module docs](self)). Cheap to clone; every clone closes together.
#[derive(Clone)]
pub struct InboxTx {
    sender: Arc<Mutex<Option<mpsc::UnboundedSender<Msg>>>>,
    store: InboxStore,
}

impl std::fmt::Debug for InboxTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboxTx")
            .field("store", &self.store)
            .field("open", &self.is_open())
            .finish()
    }
}

fn closed() -> Error {
    Error::new(
        ErrorKind::Closed,
        "the inbox transaction is over: use it only while the handler runs (its statements \
         commit or roll back with the message)",
    )
}

impl InboxTx {
    /// The database this transaction is on.
    pub fn store(&self) -> InboxStore {
        self.store
    }

    /// Whether the handler is still running (statements are accepted).
    pub fn is_open(&self) -> bool {
        self.sender.lock().is_some()
    }

    fn send(&self, r: Request) -> Result<()> {
        let guard = self.sender.lock();
        let s = guard.as_ref().ok_or_else(closed)?;
        s.send(Msg::Statement(r)).map_err(|_| closed())
    }

    /// Runs one statement in the transaction; resolves to the number of rows it changed.
    ///
    /// Errors: [`ErrorKind::Closed`] after the handler returned; [`ErrorKind::DedupStore`] for
    /// a SQL error (the database's message); [`ErrorKind::Serialization`] for a parameter the
    /// placeholder's type cannot take (naming its index). Either fails the message.
    pub async fn execute(&self, sql: String, params: Vec<SqlValue>) -> Result<u64> {
        let (tx, rx) = oneshot::channel();
        self.send(Request::Execute(sql, params, tx))?;
        rx.await.map_err(|_| closed())?
    }

    /// Runs one query in the transaction; resolves to its columns and rows. Errors as
    /// [`execute`](Self::execute).
    pub async fn query(&self, sql: String, params: Vec<SqlValue>) -> Result<SqlRows> {
        let (tx, rx) = oneshot::channel();
        self.send(Request::Query(sql, params, tx))?;
        rx.await.map_err(|_| closed())?
    }
}

/// The future a host handler returns: resolves when the host's handler finished (its error,
/// as text or a boxed error, fails the message).
pub type HandlerFuture = Pin<Box<dyn Future<Output = std::result::Result<(), BoxError>> + Send>>;

/// A handler in the host language: starts the host's handler for `message` with `tx`.
pub trait InboxCallback: Send + Sync + 'static {
    /// Calls the host's handler; the future resolves when it finished.
    fn call(&self, message: Message, tx: InboxTx) -> HandlerFuture;
}

/// One handler call's channel: starts the host handler as a task and hands back what serves it.
struct Call {
    tx: InboxTx,
    rx: mpsc::UnboundedReceiver<Msg>,
    /// A statement failed: the message fails even if the handler swallowed the error.
    failed: Option<String>,
}

impl Call {
    fn start(
        cb: &dyn InboxCallback,
        store: InboxStore,
        message: &Message,
        rt: &tokio::runtime::Handle,
    ) -> Call {
        let (sender, rx) = mpsc::unbounded_channel();
        let tx = InboxTx {
            sender: Arc::new(Mutex::new(Some(sender.clone()))),
            store,
        };
        let fut = cb.call(message.clone(), tx.clone());
        rt.spawn(async move {
            let r = fut.await;
            let _ = sender.send(Msg::Done(r));
        });
        Call {
            tx,
            rx,
            failed: None,
        }
    }

    /// The handler's outcome once it finished; closes the `InboxTx`.
    fn finish(
        &mut self,
        r: std::result::Result<(), BoxError>,
    ) -> std::result::Result<(), BoxError> {
        self.tx.sender.lock().take();
        r?;
        match self.failed.take() {
            Some(e) => Err(format!(
                "a statement of the handler failed, so the message's transaction rolled back: {e}"
            )
            .into()),
            None => Ok(()),
        }
    }

    fn note<T>(&mut self, r: &Result<T>) {
        if let Err(e) = r {
            if self.failed.is_none() {
                self.failed = Some(e.message().to_string());
            }
        }
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        self.tx.sender.lock().take();
    }
}

/// SQL errors as the handler sees them: the database's message, kind `DedupStore`.
fn sql_error(store: InboxStore, e: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorKind::DedupStore,
        format!("SQL error ({} store): {e}", store.name()),
    )
}

// ---------------------------------------------------------------- embedded (SQLite)

mod sqlite {
    use super::*;
    use onceflow::rusqlite::types::{Value, ValueRef};
    use onceflow::rusqlite::Transaction;

    fn param(v: &SqlValue) -> Value {
        match v {
            SqlValue::Null => Value::Null,
            SqlValue::Bool(b) => Value::Integer(i64::from(*b)),
            SqlValue::Int(i) => Value::Integer(*i),
            SqlValue::Float(f) => Value::Real(*f),
            SqlValue::Text(t) => Value::Text(t.clone()),
            SqlValue::Bytes(b) => Value::Blob(b.clone()),
        }
    }

    fn value(v: ValueRef<'_>) -> SqlValue {
        match v {
            ValueRef::Null => SqlValue::Null,
            ValueRef::Integer(i) => SqlValue::Int(i),
            ValueRef::Real(f) => SqlValue::Float(f),
            ValueRef::Text(t) => SqlValue::Text(String::from_utf8_lossy(t).into_owned()),
            ValueRef::Blob(b) => SqlValue::Bytes(b.to_vec()),
        }
    }

    pub(super) fn execute(tx: &Transaction<'_>, sql: &str, params: &[SqlValue]) -> Result<u64> {
        let p: Vec<Value> = params.iter().map(param).collect();
        tx.execute(sql, onceflow::rusqlite::params_from_iter(p))
            .map(|n| n as u64)
            .map_err(|e| sql_error(InboxStore::Embedded, e))
    }

    pub(super) fn query(tx: &Transaction<'_>, sql: &str, params: &[SqlValue]) -> Result<SqlRows> {
        let run = || -> onceflow::rusqlite::Result<SqlRows> {
            let mut stmt = tx.prepare(sql)?;
            let columns: Vec<String> = stmt.column_names().map(|c| c.to_string()).collect();
            let n = columns.len();
            let p: Vec<Value> = params.iter().map(param).collect();
            let mut rows = stmt.query(onceflow::rusqlite::params_from_iter(p))?;
            let mut out = Vec::new();
            while let Some(r) = rows.next()? {
                let mut row = Vec::with_capacity(n);
                for i in 0..n {
                    row.push(value(r.get_ref(i)?));
                }
                out.push(row);
            }
            Ok(SqlRows { columns, rows: out })
        };
        run().map_err(|e| sql_error(InboxStore::Embedded, e))
    }
}

/// The embedded inbox's handler: serves the host handler's statements on the blocking thread
/// that holds the SQLite transaction.
struct EmbeddedBridge {
    cb: Arc<dyn InboxCallback>,
}

impl EmbeddedInboxHandler for EmbeddedBridge {
    fn handle(
        &self,
        tx: &mut onceflow::rusqlite::Transaction<'_>,
        message: &Message,
    ) -> std::result::Result<(), BoxError> {
        // On tokio's blocking pool: the runtime's handle is current.
        let rt = tokio::runtime::Handle::current();
        let mut call = Call::start(&*self.cb, InboxStore::Embedded, message, &rt);
        loop {
            match call.rx.blocking_recv() {
                Some(Msg::Statement(Request::Execute(sql, params, reply))) => {
                    let r = sqlite::execute(tx, &sql, &params);
                    call.note(&r);
                    let _ = reply.send(r);
                }
                Some(Msg::Statement(Request::Query(sql, params, reply))) => {
                    let r = sqlite::query(tx, &sql, &params);
                    call.note(&r);
                    let _ = reply.send(r);
                }
                Some(Msg::Done(r)) => return call.finish(r),
                None => {
                    return call.finish(Err("the handler's task ended without a result".into()))
                }
            }
        }
    }
}

// ---------------------------------------------------------------- PostgreSQL

#[cfg(feature = "postgres")]
mod pg {
    use super::*;
    use onceflow::postgres::tokio_postgres::types::{to_sql_checked, IsNull, ToSql, Type};
    use onceflow::postgres::tokio_postgres::{Row, Transaction};

    /// A parameter converted to the type the server inferred for its placeholder.
    #[derive(Debug)]
    struct Param<'a> {
        index: usize,
        value: &'a SqlValue,
    }

    type ToSqlResult = std::result::Result<IsNull, Box<dyn std::error::Error + Sync + Send>>;

    /// A parameter its placeholder's type cannot take, naming both.
    #[derive(Debug)]
    struct ParamError(String);

    impl std::fmt::Display for ParamError {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(&self.0)
        }
    }

    impl std::error::Error for ParamError {}

    impl ToSql for Param<'_> {
        fn to_sql(&self, ty: &Type, out: &mut bytes::BytesMut) -> ToSqlResult {
            let wrong = || -> Box<dyn std::error::Error + Sync + Send> {
                let sent = match self.value {
                    SqlValue::Int(_) => "bigint",
                    SqlValue::Float(_) => "float8",
                    SqlValue::Bool(_) => "boolean",
                    SqlValue::Bytes(_) => "bytea",
                    _ => "text",
                };
                Box::new(ParamError(format!(
                    "params[{i}] (${n}): cannot send a value of kind {kind} as PostgreSQL type \
                     {ty}: send a value of that type, or convert in SQL \
                     (CAST(${n} AS {sent})::{ty})",
                    i = self.index,
                    n = self.index + 1,
                    kind = self.value.kind_name(),
                    ty = ty.name(),
                )))
            };
            let range = |_| -> Box<dyn std::error::Error + Sync + Send> {
                let v = match self.value {
                    SqlValue::Int(i) => i.to_string(),
                    other => other.kind_name().to_string(),
                };
                Box::new(ParamError(format!(
                    "params[{}] (${}): {v} is out of range for PostgreSQL type {}",
                    self.index,
                    self.index + 1,
                    ty.name()
                )))
            };
            match (self.value, ty) {
                (SqlValue::Null, _) => Ok(IsNull::Yes),
                (SqlValue::Bool(b), &Type::BOOL) => b.to_sql(ty, out),
                (SqlValue::Int(i), &Type::INT2) => {
                    i16::try_from(*i).map_err(range)?.to_sql(ty, out)
                }
                (SqlValue::Int(i), &Type::INT4) => {
                    i32::try_from(*i).map_err(range)?.to_sql(ty, out)
                }
                (SqlValue::Int(i), &Type::INT8) => i.to_sql(ty, out),
                (SqlValue::Int(i), &Type::FLOAT4) => (*i as f32).to_sql(ty, out),
                (SqlValue::Int(i), &Type::FLOAT8) => (*i as f64).to_sql(ty, out),
                (SqlValue::Float(f), &Type::FLOAT4) => (*f as f32).to_sql(ty, out),
                (SqlValue::Float(f), &Type::FLOAT8) => f.to_sql(ty, out),
                (
                    SqlValue::Text(t),
                    &Type::TEXT | &Type::VARCHAR | &Type::BPCHAR | &Type::NAME | &Type::UNKNOWN,
                ) => t.as_str().to_sql(ty, out),
                (SqlValue::Bytes(b), &Type::BYTEA) => b.as_slice().to_sql(ty, out),
                _ => Err(wrong()),
            }
        }

        fn accepts(_: &Type) -> bool {
            true
        }

        to_sql_checked!();
    }

    fn params(values: &[SqlValue]) -> Vec<Param<'_>> {
        values
            .iter()
            .enumerate()
            .map(|(index, value)| Param { index, value })
            .collect()
    }

    fn refs<'a>(p: &'a [Param<'a>]) -> Vec<&'a (dyn ToSql + Sync)> {
        p.iter().map(|p| p as &(dyn ToSql + Sync)).collect()
    }

    /// A `tokio_postgres` error with the server's message (not only "db error"); a parameter
    /// the placeholder's type cannot take ([`ParamError`]) is kind `Serialization`.
    fn db_error(e: onceflow::postgres::tokio_postgres::Error) -> Error {
        use std::error::Error as _;
        if let Some(p) = e.source().and_then(|s| s.downcast_ref::<ParamError>()) {
            return Error::new(ErrorKind::Serialization, p.0.clone());
        }
        let text = match (e.as_db_error(), e.source()) {
            (Some(db), _) => format!("{}: {}", db.severity(), db.message()),
            (None, Some(s)) => format!("{e}: {s}"),
            (None, None) => e.to_string(),
        };
        sql_error(InboxStore::Postgres, text)
    }

    fn value(row: &Row, i: usize) -> Result<SqlValue> {
        let col = &row.columns()[i];
        let ty = col.type_();
        let get = |e: onceflow::postgres::tokio_postgres::Error| db_error(e);
        Ok(match *ty {
            Type::BOOL => row
                .try_get::<_, Option<bool>>(i)
                .map_err(get)?
                .map(SqlValue::Bool),
            Type::INT2 => row
                .try_get::<_, Option<i16>>(i)
                .map_err(get)?
                .map(|v| SqlValue::Int(v.into())),
            Type::INT4 => row
                .try_get::<_, Option<i32>>(i)
                .map_err(get)?
                .map(|v| SqlValue::Int(v.into())),
            Type::INT8 => row
                .try_get::<_, Option<i64>>(i)
                .map_err(get)?
                .map(SqlValue::Int),
            Type::OID => row
                .try_get::<_, Option<u32>>(i)
                .map_err(get)?
                .map(|v| SqlValue::Int(v.into())),
            Type::FLOAT4 => row
                .try_get::<_, Option<f32>>(i)
                .map_err(get)?
                .map(|v| SqlValue::Float(v.into())),
            Type::FLOAT8 => row
                .try_get::<_, Option<f64>>(i)
                .map_err(get)?
                .map(SqlValue::Float),
            Type::TEXT | Type::VARCHAR | Type::BPCHAR | Type::NAME | Type::UNKNOWN => row
                .try_get::<_, Option<String>>(i)
                .map_err(get)?
                .map(SqlValue::Text),
            Type::BYTEA => row
                .try_get::<_, Option<Vec<u8>>>(i)
                .map_err(get)?
                .map(SqlValue::Bytes),
            _ => {
                return Err(Error::new(
                    ErrorKind::Serialization,
                    format!(
                        "column {i} ('{}') has PostgreSQL type {}: the inbox transaction returns \
                         booleans, integers, floats, text and bytea; cast it in SQL \
                         (for example {}::text)",
                        col.name(),
                        ty.name(),
                        col.name()
                    ),
                ))
            }
        }
        .unwrap_or(SqlValue::Null))
    }

    pub(super) async fn execute(
        tx: &Transaction<'_>,
        sql: &str,
        values: &[SqlValue],
    ) -> Result<u64> {
        let p = params(values);
        tx.execute(sql, &refs(&p)).await.map_err(db_error)
    }

    pub(super) async fn query(
        tx: &Transaction<'_>,
        sql: &str,
        values: &[SqlValue],
    ) -> Result<SqlRows> {
        let p = params(values);
        let stmt = tx.prepare(sql).await.map_err(db_error)?;
        let columns = stmt
            .columns()
            .iter()
            .map(|c| c.name().to_string())
            .collect();
        let rows = tx.query(&stmt, &refs(&p)).await.map_err(db_error)?;
        let rows = rows
            .iter()
            .map(|r| {
                (0..r.len())
                    .map(|i| value(r, i))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(SqlRows { columns, rows })
    }

    /// The PostgreSQL inbox's handler: serves the host handler's statements on the borrowed
    /// transaction.
    pub(super) struct PgBridge {
        pub(super) cb: Arc<dyn InboxCallback>,
    }

    #[async_trait::async_trait]
    impl onceflow::postgres::InboxHandler for PgBridge {
        async fn handle(
            &self,
            tx: &mut Transaction<'_>,
            message: &Message,
        ) -> std::result::Result<(), BoxError> {
            let rt = tokio::runtime::Handle::current();
            let mut call = Call::start(&*self.cb, InboxStore::Postgres, message, &rt);
            loop {
                match call.rx.recv().await {
                    Some(Msg::Statement(Request::Execute(sql, params, reply))) => {
                        let r = execute(tx, &sql, &params).await;
                        call.note(&r);
                        let _ = reply.send(r);
                    }
                    Some(Msg::Statement(Request::Query(sql, params, reply))) => {
                        let r = query(tx, &sql, &params).await;
                        call.note(&r);
                        let _ = reply.send(r);
                    }
                    Some(Msg::Done(r)) => return call.finish(r),
                    None => {
                        return call.finish(Err("the handler's task ended without a result".into()))
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------- the inbox

enum Kind {
    #[cfg(feature = "postgres")]
    Postgres(onceflow::postgres::Inbox, Arc<pg::PgBridge>),
    Embedded(EmbeddedInbox, Arc<EmbeddedBridge>),
}

/// A transactional inbox on PostgreSQL or on the embedded store, with a host-language handler
/// (see the [module docs](self)).
pub struct Inbox {
    kind: Kind,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox")
            .field("store", &self.store())
            .field("namespace", &self.namespace())
            .finish()
    }
}

/// Where a store URL points.
enum Target {
    Postgres,
    Embedded(PathBuf),
}

fn target(url: &str) -> Result<Target> {
    let trimmed = url.trim();
    let shown = onceflow::shown(&onceflow::redact_url(trimmed));
    let expected = "expected postgres://… (or postgresql://…), embedded:///absolute/path.db or \
                    a file path";
    if trimmed.is_empty() {
        return Err(Error::config(format!("empty inbox store: {expected}")));
    }
    match trimmed.split_once("://") {
        Some((scheme, rest)) => match scheme.to_ascii_lowercase().as_str() {
            "postgres" | "postgresql" => Ok(Target::Postgres),
            "embedded" if !rest.is_empty() => Ok(Target::Embedded(PathBuf::from(rest))),
            _ => Err(Error::config(format!(
                "inbox store '{shown}': the transactional inbox runs on PostgreSQL or the \
                 embedded store (its rows, key and position in one database transaction): \
                 {expected}"
            ))),
        },
        None => Ok(Target::Embedded(PathBuf::from(trimmed))),
    }
}

/// Reads an inbox's stored positions, also while it runs and after it ran (made by
/// [`Inbox::positions_reader`]; cheap to clone).
#[derive(Debug, Clone)]
pub struct InboxPositions(PositionsKind);

#[derive(Debug, Clone)]
enum PositionsKind {
    #[cfg(feature = "postgres")]
    Postgres(onceflow::postgres::InboxPositions),
    Embedded(onceflow::inbox::EmbeddedInboxPositions),
}

impl InboxPositions {
    /// Per partition, the last message handled (or skipped) and committed, ordered by topic
    /// and partition; the store's error when it cannot be read.
    pub async fn read(&self) -> Result<Vec<(TopicPartition, Position)>> {
        match &self.0 {
            #[cfg(feature = "postgres")]
            PositionsKind::Postgres(p) => p.read().await,
            PositionsKind::Embedded(p) => p.read().await,
        }
    }
}

impl Inbox {
    /// Opens the store at `url` (`postgres://…`, `postgresql://…`, `embedded:///path.db` or a
    /// file path; keys remembered for `window`) and makes an inbox over `consumer` whose
    /// handler is `cb`.
    ///
    /// Errors: [`ErrorKind::Config`] for another scheme (`memory://`, `redis://`, …) or a zero
    /// window; the store's errors opening it (naming it without its password).
    pub async fn open(
        consumer: Consumer,
        url: &str,
        window: Duration,
        config: InboxConfig,
        cb: Arc<dyn InboxCallback>,
    ) -> Result<Inbox> {
        if window.is_zero() {
            return Err(Error::config(
                "inbox window is 0: expected a positive duration (how long keys are remembered)",
            ));
        }
        // The host starts the handler's process span through its own OpenTelemetry API (the
        // plan of `onceflow::trace::plan::process`), as for the idempotent consumer.
        let config = InboxConfig {
            tracing: false,
            ..config
        };
        let kind = match target(url)? {
            #[cfg(feature = "postgres")]
            Target::Postgres => {
                let store = onceflow::postgres::PostgresStore::open(url.trim(), window).await?;
                Kind::Postgres(store.inbox(consumer, config), Arc::new(pg::PgBridge { cb }))
            }
            #[cfg(not(feature = "postgres"))]
            Target::Postgres => {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    "this build has no PostgreSQL store",
                ))
            }
            Target::Embedded(path) => {
                let store = onceflow::dedup::EmbeddedStore::open(&path, window).await?;
                let inbox = store.inbox(consumer, config).await?;
                Kind::Embedded(inbox, Arc::new(EmbeddedBridge { cb }))
            }
        };
        Ok(Inbox { kind })
    }

    /// The database the inbox runs on (its placeholder style).
    pub fn store(&self) -> InboxStore {
        match &self.kind {
            #[cfg(feature = "postgres")]
            Kind::Postgres(..) => InboxStore::Postgres,
            Kind::Embedded(..) => InboxStore::Embedded,
        }
    }

    /// The namespace of the inbox's keys and positions.
    pub fn namespace(&self) -> &str {
        match &self.kind {
            #[cfg(feature = "postgres")]
            Kind::Postgres(i, _) => i.namespace(),
            Kind::Embedded(i, _) => i.namespace(),
        }
    }

    /// What the inbox did so far.
    pub fn summary(&self) -> InboxSummary {
        match &self.kind {
            #[cfg(feature = "postgres")]
            Kind::Postgres(i, _) => i.summary().clone(),
            Kind::Embedded(i, _) => i.summary().clone(),
        }
    }

    /// The positions stored for the namespace, per partition.
    pub async fn stored_positions(&self) -> Result<Vec<(TopicPartition, Position)>> {
        self.positions_reader().read().await
    }

    /// A reader of the stored positions that outlives the inbox: the bindings keep it so
    /// `stored_positions()` answers while `run()` holds the inbox and after it returned.
    pub fn positions_reader(&self) -> InboxPositions {
        InboxPositions(match &self.kind {
            #[cfg(feature = "postgres")]
            Kind::Postgres(i, _) => PositionsKind::Postgres(i.positions_reader()),
            Kind::Embedded(i, _) => PositionsKind::Embedded(i.positions_reader()),
        })
    }

    /// Polls once and handles what came; the number of messages polled.
    pub async fn step(&mut self) -> Result<usize> {
        match &mut self.kind {
            #[cfg(feature = "postgres")]
            Kind::Postgres(i, h) => i.step(&**h).await,
            Kind::Embedded(i, h) => i.step(h).await,
        }
    }

    /// Runs until `shutdown` completes or an error stops it (core's `run_until`).
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) -> Result<InboxSummary> {
        match self.kind {
            #[cfg(feature = "postgres")]
            Kind::Postgres(i, h) => {
                let h = pg::PgBridge { cb: h.cb.clone() };
                i.run_until(h, shutdown).await
            }
            Kind::Embedded(i, h) => {
                let h = EmbeddedBridge { cb: h.cb.clone() };
                i.run_until(h, shutdown).await
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_urls_pick_the_database() {
        assert!(matches!(
            target("postgres://u:pw@h/db"),
            Ok(Target::Postgres)
        ));
        assert!(
            matches!(target("embedded:///tmp/x.db"), Ok(Target::Embedded(p)) if p == std::path::Path::new("/tmp/x.db"))
        );
        assert!(matches!(target("./x.db"), Ok(Target::Embedded(_))));
        let e = target("redis://u:secret@h").err().unwrap();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(!e.message().contains("secret"), "{e}");
    }
}
