//! The transactional inbox from JavaScript: `NativeInbox` over `onceflow_bindings::inbox`, with
//! a JavaScript function as the handler (called on the event loop through a ThreadsafeFunction,
//! returning a Promise) and `NativeInboxCall` as its view of the message's database transaction.
//! Conversions only: the loop is core's, the statement channel the bindings'.

use std::sync::Arc;

use napi::bindgen_prelude::{
    BigInt, Buffer, Either, Either6, Function, Null, Object, Promise, Result,
};
use napi::threadsafe_function::ThreadsafeFunction;
use napi::Status;
use napi_derive::napi;
use onceflow::inbox::InboxSummary as RsInboxSummary;
use onceflow_bindings::inbox::{self, HandlerFuture, InboxCallback, InboxTx, SqlValue};
use onceflow_bindings::settings::{self, Language, OwnNames};

use crate::client::Consumer;
use crate::convert::{self, Message};
use crate::{js_err, on_rt};

/// The option `index.js` takes out of an `Inbox`'s options object before the settings.
#[cfg_attr(test, allow(dead_code))]
const INBOX_OWN: OwnNames<'static> = &["windowMs"];

/// A SQL parameter as JavaScript gives it (null and undefined: SQL NULL). A whole number up to
/// 2^53 is an integer, another number a float; a bigint is a 64-bit integer.
pub type SqlParam = Option<Either<Either<bool, f64>, Either<BigInt, Either<String, Buffer>>>>;

/// A row value as JavaScript gets it: null, boolean, number (integers beyond 2^53 as bigint),
/// string or Buffer.
pub type SqlOut = Either6<Null, bool, f64, BigInt, String, Buffer>;

const MAX_SAFE: f64 = 9_007_199_254_740_991.0;

fn param(i: usize, p: SqlParam) -> Result<SqlValue> {
    Ok(match p {
        None => SqlValue::Null,
        Some(Either::A(Either::A(b))) => SqlValue::Bool(b),
        Some(Either::A(Either::B(n))) => {
            if n.fract() == 0.0 && n.abs() <= MAX_SAFE {
                SqlValue::Int(n as i64)
            } else {
                SqlValue::Float(n)
            }
        }
        Some(Either::B(Either::A(b))) => {
            let (v, lossless) = b.get_i64();
            if !lossless {
                return Err(js_err(&onceflow::Error::config(format!(
                    "params[{i}]: bigint does not fit a 64-bit signed integer"
                ))));
            }
            SqlValue::Int(v)
        }
        Some(Either::B(Either::B(Either::A(s)))) => SqlValue::Text(s),
        Some(Either::B(Either::B(Either::B(b)))) => SqlValue::Bytes(b.to_vec()),
    })
}

fn params(p: Option<Vec<SqlParam>>) -> Result<Vec<SqlValue>> {
    p.unwrap_or_default()
        .into_iter()
        .enumerate()
        .map(|(i, v)| param(i, v))
        .collect()
}

fn out(v: SqlValue) -> SqlOut {
    match v {
        SqlValue::Null => Either6::A(Null),
        SqlValue::Bool(b) => Either6::B(b),
        SqlValue::Int(i) if (i as f64).abs() <= MAX_SAFE => Either6::C(i as f64),
        SqlValue::Int(i) => Either6::D(BigInt::from(i)),
        SqlValue::Float(f) => Either6::C(f),
        SqlValue::Text(t) => Either6::E(t),
        SqlValue::Bytes(b) => Either6::F(b.into()),
    }
}

/// What a query returned.
#[napi(object)]
pub struct QueryResult {
    /// Column names, in order.
    pub columns: Vec<String>,
    /// Rows, each an array with one value per column.
    #[napi(ts_type = "Array<Array<null | boolean | number | bigint | string | Buffer>>")]
    pub rows: Vec<Vec<SqlOut>>,
}

/// One handler call: the message and its open database transaction. `index.js` hands the
/// user's handler the message and an `InboxTransaction` over this object.
#[napi]
pub struct NativeInboxCall {
    message: onceflow::Message,
    tx: InboxTx,
}

#[napi]
impl NativeInboxCall {
    /// The message.
    #[napi(getter)]
    pub fn message(&self) -> Message {
        Message::from(&self.message)
    }

    /// `postgres` (placeholders `$1, $2, …`) or `embedded` (SQLite: `?` or `?1, ?2, …`).
    #[napi(getter)]
    pub fn store(&self) -> String {
        self.tx.store().name().to_string()
    }

    /// Whether the handler still runs (statements are accepted).
    #[napi(getter)]
    pub fn open(&self) -> bool {
        self.tx.is_open()
    }

    /// Runs one statement in the message's transaction; resolves to the rows it changed.
    #[napi]
    pub async fn execute(
        &self,
        sql: String,
        #[napi(
            ts_arg_type = "Array<null | undefined | boolean | number | bigint | string | Buffer>"
        )]
        params: Option<Vec<SqlParam>>,
    ) -> Result<f64> {
        let p = self::params(params)?;
        let tx = self.tx.clone();
        on_rt(async move { tx.execute(sql, p).await })
            .await
            .map(|n| n as f64)
    }

    /// Runs one query in the message's transaction; resolves to its columns and rows.
    #[napi]
    pub async fn query(
        &self,
        sql: String,
        #[napi(
            ts_arg_type = "Array<null | undefined | boolean | number | bigint | string | Buffer>"
        )]
        params: Option<Vec<SqlParam>>,
    ) -> Result<QueryResult> {
        let p = self::params(params)?;
        let tx = self.tx.clone();
        let r = on_rt(async move { tx.query(sql, p).await }).await?;
        Ok(QueryResult {
            columns: r.columns,
            rows: r
                .rows
                .into_iter()
                .map(|row| row.into_iter().map(out).collect())
                .collect(),
        })
    }
}

/// A weak ThreadsafeFunction (it does not keep the process alive) taking one call and
/// returning a Promise.
#[cfg_attr(test, allow(dead_code))]
type JsFn = ThreadsafeFunction<
    NativeInboxCall,
    Promise<Option<bool>>,
    NativeInboxCall,
    Status,
    false,
    true,
>;

#[cfg_attr(test, allow(dead_code))]
struct JsCallback(Arc<JsFn>);

impl InboxCallback for JsCallback {
    fn call(&self, message: onceflow::Message, tx: InboxTx) -> HandlerFuture {
        let f = self.0.clone();
        Box::pin(async move {
            let p = f
                .call_async(NativeInboxCall { message, tx })
                .await
                .map_err(crate::engine::rejected)?;
            p.await.map(|_| ()).map_err(crate::engine::rejected)
        })
    }
}

/// What an inbox did.
#[napi(object)]
pub struct InboxSummary {
    /// Messages whose handler ran and committed.
    pub handled: f64,
    /// Messages skipped because their key was already recorded.
    pub duplicates: f64,
    /// Messages skipped because the stored position was already past them.
    pub behind_position: f64,
}

impl From<RsInboxSummary> for InboxSummary {
    fn from(s: RsInboxSummary) -> Self {
        InboxSummary {
            handled: s.handled as f64,
            duplicates: s.duplicates as f64,
            behind_position: s.behind_position as f64,
        }
    }
}

/// A position the inbox stored: the last message of a partition handled (or skipped) and
/// committed.
#[napi(object)]
pub struct StoredPosition {
    /// Topic / stream.
    pub topic: String,
    /// Partition (shard) number.
    pub partition: i32,
    /// The position, as text (`offset:41`, `seq:7`, …; a message's `position`).
    pub position: String,
}

/// A poisoned lock is still usable (a summary is plain data).
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn already_ran() -> onceflow::Error {
    onceflow::Error::new(
        onceflow::ErrorKind::Closed,
        "this inbox already ran: create a new one",
    )
}

/// A transactional inbox (made by `openInbox`).
#[napi]
pub struct NativeInbox {
    inner: Arc<tokio::sync::Mutex<Option<inbox::Inbox>>>,
    positions: inbox::InboxPositions,
    store: String,
    namespace: String,
    last: Arc<std::sync::Mutex<RsInboxSummary>>,
    stop: tokio::sync::watch::Sender<bool>,
}

/// Opens the store `store` (`postgres://…`, `embedded:///path.db` or a file path; keys kept
/// `windowMs`, default one day) and makes an inbox over `consumer` whose handler is
/// `handler(call)`; `options` are the inbox settings. Resolves to a `NativeInbox`.
// napi registers it for the addon; a test build does not call it.
#[cfg_attr(test, allow(dead_code))]
#[napi]
pub fn open_inbox<'env>(
    env: &'env napi::Env,
    consumer: &Consumer,
    #[napi(ts_arg_type = "(call: NativeInboxCall) => Promise<unknown>")] handler: Function<
        '_,
        NativeInboxCall,
        Promise<Option<bool>>,
    >,
    store: String,
    window_ms: Option<f64>,
    #[napi(ts_arg_type = "InboxOptions")] options: Option<Object>,
) -> Result<napi::bindgen_prelude::PromiseRaw<'env, NativeInbox>> {
    let config = settings::inbox_config(
        Language::Node,
        convert::settings(options.as_ref())?,
        INBOX_OWN,
    )
    .map_err(|e| js_err(&onceflow::Error::config(e.message())))?;
    let window = Language::Node
        .duration("windowMs", window_ms.unwrap_or(86_400_000.0))
        .map_err(|e| js_err(&e))?;
    let f = handler
        .build_threadsafe_function::<NativeInboxCall>()
        .weak::<true>()
        .build()?;
    let consumer = consumer.inner.clone();
    let cb = Arc::new(JsCallback(Arc::new(f)));
    env.spawn_future(async move {
        let ib =
            on_rt(async move { inbox::Inbox::open(consumer, &store, window, config, cb).await })
                .await?;
        Ok(NativeInbox {
            store: ib.store().name().to_string(),
            namespace: ib.namespace().to_string(),
            positions: ib.positions_reader(),
            inner: Arc::new(tokio::sync::Mutex::new(Some(ib))),
            last: Arc::default(),
            stop: tokio::sync::watch::channel(false).0,
        })
    })
}

#[napi]
impl NativeInbox {
    /// `postgres` or `embedded`: the database (and placeholder style) of the handler's SQL.
    #[napi(getter)]
    pub fn store(&self) -> String {
        self.store.clone()
    }

    /// The namespace of the inbox's keys and positions (default `"default"`; never the
    /// consumer group, so a new group on the same database handles nothing twice).
    #[napi(getter)]
    pub fn namespace(&self) -> String {
        self.namespace.clone()
    }

    /// What the inbox did so far.
    #[napi]
    pub fn summary(&self) -> InboxSummary {
        let s = match self.inner.try_lock() {
            Ok(g) => match g.as_ref() {
                Some(i) => i.summary(),
                None => lock(&self.last).clone(),
            },
            Err(_) => lock(&self.last).clone(),
        };
        s.into()
    }

    /// The positions stored for the namespace, per partition; also while `run()` runs and
    /// after it returned.
    #[napi]
    pub async fn stored_positions(&self) -> Result<Vec<StoredPosition>> {
        let positions = self.positions.clone();
        on_rt(async move {
            let ps = positions.read().await?;
            Ok(ps
                .into_iter()
                .map(|(tp, p)| StoredPosition {
                    topic: tp.topic,
                    partition: tp.partition,
                    position: p.to_string(),
                })
                .collect::<Vec<_>>())
        })
        .await
    }

    /// Polls once and handles what came; resolves to the number of messages polled.
    #[napi]
    pub async fn step(&self) -> Result<u32> {
        let inner = self.inner.clone();
        let last = self.last.clone();
        on_rt(async move {
            let mut g = inner.lock().await;
            let ib = g.as_mut().ok_or_else(already_ran)?;
            let r = ib.step().await;
            *lock(&last) = ib.summary();
            r
        })
        .await
        .map(|n| n as u32)
    }

    /// Runs until `stop()` or an error; resolves to the summary. Does not close the consumer.
    #[napi]
    pub async fn run(&self) -> Result<InboxSummary> {
        let inner = self.inner.clone();
        let last = self.last.clone();
        let mut rx = self.stop.subscribe();
        on_rt(async move {
            let ib = inner.lock().await.take().ok_or_else(already_ran)?;
            let s = ib
                .run_until(async move {
                    let _ = rx.wait_for(|s| *s).await;
                })
                .await?;
            *lock(&last) = s.clone();
            Ok(s)
        })
        .await
        .map(InboxSummary::from)
    }

    /// Asks a running `run()` to stop.
    #[napi]
    pub fn stop(&self) {
        self.stop.send_replace(true);
    }
}
