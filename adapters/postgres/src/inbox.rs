//! The transactional inbox ([`Inbox`]) on PostgreSQL: the store side of
//! [`onceflow_core::inbox`], whose loop, settings and summary it shares with the embedded
//! (SQLite) store's inbox.

use std::future::Future;
use std::time::Duration;

use async_trait::async_trait;
use onceflow_core::inbox::{
    parse_stored_position, HandlerSpans, InboxDatabase, InboxLoop, InboxOutcome,
};
pub use onceflow_core::inbox::{InboxConfig, InboxSummary};
use onceflow_core::{BoxError, Consumer, Message, Position, Result, TopicPartition};

use crate::Db;

/// A handler of the inbox: gets the open transaction and the message.
///
/// Write the side effects through `tx`; return an error to roll everything back (the message is
/// retried). Do not commit or roll back `tx` yourself.
#[async_trait]
pub trait InboxHandler: Send + Sync {
    /// Handles one message inside `tx`.
    async fn handle(
        &self,
        tx: &mut tokio_postgres::Transaction<'_>,
        message: &Message,
    ) -> std::result::Result<(), BoxError>;
}

/// A transactional inbox over a [`Consumer`] on PostgreSQL, made by [`crate::PostgresStore::inbox`].
///
/// The transactional inbox: each message is handled inside one PostgreSQL transaction that also
/// records its idempotency key (in the store's `dedup` table) and the consumer's position (in
/// `inbox_position`). The handler writes its own rows in the same transaction, so the three
/// become durable together or not at all.
///
/// The loop, its settings ([`InboxConfig`]) and its [`InboxSummary`] are
/// [`onceflow_core::inbox`]'s, shared with the embedded (SQLite) store's inbox
/// ([`onceflow_core::inbox::EmbeddedInbox`]).
///
/// - **Exactly once per key**: the key's row is written first, completed, in the transaction; a
///   key already completed within the window is a duplicate and the handler does not run. Two
///   transactions racing on one key serialise on its primary key: the second sees the first's
///   row once it commits and skips.
/// - **Resume from the database**: when the inbox first sees a partition (on assignment or with
///   its first message) it reads the stored position and seeks the consumer right after it;
///   messages at or before the stored position are never handled again, whatever the broker's
///   committed offset says. The broker's group offset is also committed (after the database)
///   so lag tools keep working, but the inbox never relies on it.
/// - **Failures**: a handler error rolls the transaction back and is retried with backoff; after
///   [`InboxConfig::max_attempts`] the inbox stops with the error (nothing of the message is
///   committed, so the next start handles it again).
///
///
/// ```no_run
/// # async fn demo(client: onceflow_core::Client) -> onceflow_core::Result<()> {
/// use std::time::Duration;
/// use onceflow_core::{ConsumerConfig, Message, BoxError};
/// use onceflow_postgres::{InboxConfig, InboxHandler, PostgresStore, tokio_postgres::Transaction};
///
/// struct Billing;
/// #[async_trait::async_trait]
/// impl InboxHandler for Billing {
///     async fn handle(&self, tx: &mut Transaction<'_>, m: &Message) -> Result<(), BoxError> {
///         tx.execute("INSERT INTO charges (payload) VALUES ($1)", &[&m.payload.to_vec()]).await?;
///         Ok(())
///     }
/// }
///
/// let store = PostgresStore::open("postgres://app:pw@127.0.0.1/app", Duration::from_secs(86400)).await?;
/// let consumer = client.consumer(ConsumerConfig::new("billing", ["orders"])).await?;
/// let summary = store
///     .inbox(consumer, InboxConfig::default())
///     .run_until(Billing, tokio::time::sleep(Duration::from_secs(10)))
///     .await?;
/// # Ok(()) }
/// ```
pub struct Inbox {
    db: Db,
    window: Duration,
    inner: InboxLoop,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox")
            .field("url", &self.db.shown)
            .field("namespace", &self.inner.namespace())
            .field("consumer", self.inner.consumer())
            .finish()
    }
}

impl Inbox {
    pub(crate) fn new(db: Db, window: Duration, consumer: Consumer, config: InboxConfig) -> Self {
        Inbox {
            db,
            window,
            inner: InboxLoop::new(consumer, config),
        }
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

    /// A reader of this inbox's stored positions that outlives it (it shares the store's
    /// connection pool), so the positions can be read while [`run_until`](Self::run_until)
    /// runs (it takes the inbox) and after it returned.
    pub fn positions_reader(&self) -> InboxPositions {
        InboxPositions {
            db: self.db.clone(),
            namespace: self.namespace().to_string(),
        }
    }

    /// Polls once and handles what came; returns the number of messages polled. See
    /// [`InboxLoop::step`] for the errors.
    pub async fn step<H: InboxHandler + ?Sized>(&mut self, handler: &H) -> Result<usize> {
        let db = PgInboxDb {
            db: &self.db,
            window: self.window,
            handler,
            spans: self.inner.handler_spans(),
        };
        self.inner.step(&db).await
    }

    /// Runs until `shutdown` completes or an error stops it; then commits the broker offsets and
    /// returns what it did. Does not close the consumer.
    ///
    /// `shutdown` stops a poll or a retry that is waiting (that message and the rest of its
    /// batch come again on the next start); otherwise a batch already polled is handled to its
    /// end first, so the summary counts every transaction that committed.
    pub async fn run_until<H: InboxHandler>(
        self,
        handler: H,
        shutdown: impl Future<Output = ()>,
    ) -> Result<InboxSummary> {
        let db = PgInboxDb {
            db: &self.db,
            window: self.window,
            handler: &handler,
            spans: self.inner.handler_spans(),
        };
        self.inner.run_until(&db, shutdown).await
    }
}

/// Reads the stored positions of an [`Inbox`]'s namespace, also while it runs and after it ran
/// (made by [`Inbox::positions_reader`]; cheap to clone).
#[derive(Clone)]
pub struct InboxPositions {
    db: Db,
    namespace: String,
}

impl std::fmt::Debug for InboxPositions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboxPositions")
            .field("url", &self.db.shown)
            .field("namespace", &self.namespace)
            .finish()
    }
}

impl InboxPositions {
    /// Per partition, the last message handled (or skipped) and committed, ordered by topic
    /// and partition. Errors: [`onceflow_core::ErrorKind::DedupStore`] when the database
    /// cannot be reached or a stored position does not parse.
    pub async fn read(&self) -> Result<Vec<(TopicPartition, Position)>> {
        const WHAT: &str = "cannot read inbox positions";
        let client = self.db.client().await?;
        let sql = format!(
            "SELECT topic, partition, position FROM {} WHERE consumer_group = $1 \
             ORDER BY topic, partition",
            self.db.t("inbox_position")
        );
        let Some(rows) = self.db.within(client.query(&sql, &[&self.namespace])).await else {
            return Err(self.db.timed_out(WHAT, client));
        };
        let rows = rows.map_err(|e| self.db.error(WHAT, e))?;
        rows.iter()
            .map(|r| {
                let tp = TopicPartition::new(r.get::<_, String>(0), r.get::<_, i32>(1));
                Ok((tp, parse_position(&self.db, &self.namespace, r.get(2))?))
            })
            .collect()
    }
}

fn parse_position(db: &Db, namespace: &str, s: &str) -> Result<Position> {
    parse_stored_position(&format!("PostgreSQL store '{}'", db.shown), namespace, s)
}

/// The store side of the loop for one call, borrowing the pool and the handler.
struct PgInboxDb<'a, H: ?Sized> {
    db: &'a Db,
    window: Duration,
    handler: &'a H,
    spans: Option<HandlerSpans>,
}

#[async_trait]
impl<H: InboxHandler + ?Sized> InboxDatabase for PgInboxDb<'_, H> {
    async fn load_positions(
        &self,
        namespace: &str,
        partitions: &[TopicPartition],
    ) -> Result<Vec<(TopicPartition, Position)>> {
        let client = self.db.client().await?;
        let topics: Vec<&str> = partitions.iter().map(|tp| tp.topic.as_str()).collect();
        let parts: Vec<i32> = partitions.iter().map(|tp| tp.partition).collect();
        const WHAT: &str = "cannot read inbox positions";
        let sql = format!(
            "SELECT p.topic, p.partition, p.position FROM {} AS p \
             JOIN unnest($2::text[], $3::int[]) AS u(topic, partition) \
             ON p.topic = u.topic AND p.partition = u.partition \
             WHERE p.consumer_group = $1",
            self.db.t("inbox_position")
        );
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&namespace, &topics, &parts];
        let Some(rows) = self.db.within(client.query(&sql, &params)).await else {
            return Err(self.db.timed_out(WHAT, client));
        };
        let rows = rows.map_err(|e| self.db.error(WHAT, e))?;
        rows.iter()
            .map(|r| {
                let tp = TopicPartition::new(r.get::<_, String>(0), r.get::<_, i32>(1));
                Ok((tp, parse_position(self.db, namespace, r.get(2))?))
            })
            .collect()
    }

    /// One transaction: key, handler, position, commit. Each of the store's own statements
    /// waits at most the store's `op_timeout` for its answer (then the connection is closed
    /// and the transaction, never committed or of unknown outcome, fails with a retriable
    /// Timeout); the handler's statements are the handler's to bound.
    async fn transact(
        &self,
        namespace: &str,
        key: Option<&str>,
        m: &Message,
    ) -> Result<InboxOutcome> {
        let mut client = self.db.client().await?;
        match self.transact_on(&mut client, namespace, key, m).await? {
            Ok(outcome) => Ok(outcome),
            Err(what) => Err(self.db.timed_out(what, client)),
        }
    }
}

impl<H: InboxHandler + ?Sized> PgInboxDb<'_, H> {
    /// [`InboxDatabase::transact`] on `client`; `Ok(Err(what))` when the statement `what` had
    /// no answer within the operation timeout.
    async fn transact_on(
        &self,
        client: &mut deadpool_postgres::Object,
        namespace: &str,
        key: Option<&str>,
        m: &Message,
    ) -> Result<std::result::Result<InboxOutcome, &'static str>> {
        /// The statement's answer within the operation timeout, its error mapped; past the
        /// timeout, returns `Ok(Err(what))` from the enclosing function.
        macro_rules! bounded {
            ($what:expr, $op:expr) => {
                match self.db.within($op).await {
                    Some(r) => r.map_err(|e| self.db.error($what, e)),
                    None => return Ok(Err($what)),
                }
            };
        }
        let mut tx = bounded!("inbox: cannot begin", client.transaction())?;
        let window = crate::ms(self.window);
        let fresh = match key {
            Some(key) => {
                let d = self.db.t("dedup");
                let now = crate::NOW_MS;
                let sql = format!(
                    "INSERT INTO {d} AS d (key, token, state, expires_at) \
                     VALUES ($1, 1, 2, {now} + $2) \
                     ON CONFLICT (key) DO UPDATE SET token = d.token + 1, state = 2, \
                     owner = NULL, lease_until = NULL, expires_at = excluded.expires_at, \
                     done_until = NULL, \
                     fingerprint = NULL, result = NULL \
                     WHERE NOT (d.state = 2 AND COALESCE(d.done_until, d.expires_at) > {now}) \
                     RETURNING d.token"
                );
                bounded!(
                    "inbox: cannot record the key",
                    tx.query_opt(&sql, &[&key, &window])
                )?
                .is_some()
            }
            None => true,
        };
        if fresh {
            HandlerSpans::run(self.spans.as_ref(), m, self.handler.handle(&mut tx, m))
                .await
                .map_err(|e| e.context(format!("inbox '{namespace}'")))?;
        }
        let sql = format!(
            "INSERT INTO {} (consumer_group, topic, partition, position) \
             VALUES ($1, $2, $3, $4) \
             ON CONFLICT (consumer_group, topic, partition) \
             DO UPDATE SET position = excluded.position, updated_at = now()",
            self.db.t("inbox_position")
        );
        let position = m.position.to_string();
        bounded!(
            "inbox: cannot record the position",
            tx.execute(&sql, &[&namespace, &m.topic, &m.partition, &position])
        )?;
        bounded!("inbox: commit failed", tx.commit())?;
        Ok(Ok(if fresh {
            InboxOutcome::Handled
        } else {
            InboxOutcome::Duplicate
        }))
    }
}
