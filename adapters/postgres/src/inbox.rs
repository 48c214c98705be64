//! The transactional inbox ([`Inbox`]).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use onceflow_core::engine::KeyStrategy;
use onceflow_core::{
    BoxError, Consumer, Error, ErrorKind, Message, Position, RebalanceListener, Result, StartFrom,
    TopicPartition,
};

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

/// Settings of an [`Inbox`].
#[derive(Debug, Clone)]
pub struct InboxConfig {
    /// Where a message's idempotency key comes from (default: the `idempotency-key` header,
    /// else the message's coordinates).
    pub key: KeyStrategy,
    /// Names this inbox's keys and positions in the database (default: the consumer group).
    /// Two inboxes with the same namespace share keys and positions.
    pub namespace: Option<String>,
    /// Messages per poll (default 100).
    pub batch_size: usize,
    /// Longest wait of one poll (default 100 ms).
    pub poll_timeout: Duration,
    /// Handler attempts per message before the inbox stops with the error (default 5).
    pub max_attempts: u32,
    /// First retry delay, doubled per attempt (default 100 ms).
    pub backoff: Duration,
    /// How often the broker's group offset is brought up to date (default 1 s).
    pub broker_commit_interval: Duration,
}

impl Default for InboxConfig {
    fn default() -> Self {
        InboxConfig {
            key: KeyStrategy::default(),
            namespace: None,
            batch_size: 100,
            poll_timeout: Duration::from_millis(100),
            max_attempts: 5,
            backoff: Duration::from_millis(100),
            broker_commit_interval: Duration::from_secs(1),
        }
    }
}

/// What a run of an [`Inbox`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InboxSummary {
    /// Messages whose handler ran and committed.
    pub handled: u64,
    /// Messages skipped because their key was already completed.
    pub duplicates: u64,
    /// Messages skipped because the stored position was already past them.
    pub behind_position: u64,
}

/// Assignment changes seen by the backend, handled by the inbox at its next step.
#[derive(Default)]
struct Listener {
    /// Positions stored for partitions the inbox has loaded.
    positions: parking_lot_free::Mutex<HashMap<TopicPartition, Option<Position>>>,
}

/// `std::sync::Mutex` with poisoning ignored (a panic elsewhere must not stop the inbox).
mod parking_lot_free {
    pub struct Mutex<T>(std::sync::Mutex<T>);
    impl<T: Default> Default for Mutex<T> {
        fn default() -> Self {
            Mutex(std::sync::Mutex::new(T::default()))
        }
    }
    impl<T> Mutex<T> {
        pub fn lock(&self) -> std::sync::MutexGuard<'_, T> {
            self.0.lock().unwrap_or_else(|e| e.into_inner())
        }
    }
}

impl RebalanceListener for Listener {
    fn on_assigned(&self, partitions: &[TopicPartition]) {
        // Reload their positions: another member may have moved them on.
        let mut p = self.positions.lock();
        for tp in partitions {
            p.remove(tp);
        }
    }

    fn on_revoked(&self, partitions: &[TopicPartition]) -> Vec<(TopicPartition, Position)> {
        let mut p = self.positions.lock();
        partitions
            .iter()
            .filter_map(|tp| Some((tp.clone(), p.remove(tp)??)))
            .collect()
    }

    fn on_lost(&self, partitions: &[TopicPartition]) {
        let mut p = self.positions.lock();
        for tp in partitions {
            p.remove(tp);
        }
    }
}

/// A transactional inbox over a [`Consumer`], made by [`crate::PostgresStore::inbox`].
///
/// The transactional inbox: each message is handled inside one PostgreSQL transaction that also
/// records its idempotency key (in the store's `dedup` table) and the consumer's position (in
/// `inbox_position`). The handler writes its own rows in the same transaction, so the three
/// become durable together or not at all.
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
    consumer: Consumer,
    config: InboxConfig,
    namespace: String,
    listener: Arc<Listener>,
    summary: InboxSummary,
    last_broker_commit: Instant,
    uncommitted: HashMap<TopicPartition, Position>,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox")
            .field("url", &self.db.shown)
            .field("namespace", &self.namespace)
            .field("consumer", &self.consumer)
            .finish()
    }
}

impl Inbox {
    pub(crate) fn new(db: Db, window: Duration, consumer: Consumer, config: InboxConfig) -> Self {
        let listener = Arc::new(Listener::default());
        consumer.backend().set_rebalance_listener(listener.clone());
        let namespace = config
            .namespace
            .clone()
            .unwrap_or_else(|| consumer.group().to_string());
        Inbox {
            db,
            window,
            consumer,
            config,
            namespace,
            listener,
            summary: InboxSummary::default(),
            last_broker_commit: Instant::now(),
            uncommitted: HashMap::new(),
        }
    }

    /// The namespace of this inbox's keys and positions.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// What this inbox did so far.
    pub fn summary(&self) -> &InboxSummary {
        &self.summary
    }

    /// The positions stored for this inbox's namespace: per partition, the last message
    /// handled (or skipped) and committed.
    pub async fn stored_positions(&self) -> Result<Vec<(TopicPartition, Position)>> {
        let client = self.db.client().await?;
        let rows = client
            .query(
                &format!(
                    "SELECT topic, partition, position FROM {} WHERE consumer_group = $1 \
                     ORDER BY topic, partition",
                    self.db.t("inbox_position")
                ),
                &[&self.namespace],
            )
            .await
            .map_err(|e| self.db.error("cannot read inbox positions", e))?;
        rows.iter()
            .map(|r| {
                let tp = TopicPartition::new(r.get::<_, String>(0), r.get::<_, i32>(1));
                Ok((tp, self.parse_position(r.get(2))?))
            })
            .collect()
    }

    fn parse_position(&self, s: &str) -> Result<Position> {
        s.parse().map_err(|_| {
            Error::new(
                ErrorKind::DedupStore,
                format!(
                    "PostgreSQL store '{}': stored inbox position '{s}' of namespace '{}' does \
                     not parse as a position",
                    self.db.shown, self.namespace
                ),
            )
        })
    }

    /// Loads the stored positions of partitions not seen yet; returns the partitions moved
    /// (sought) to just after their stored position.
    async fn load_positions(
        &mut self,
        partitions: HashSet<TopicPartition>,
    ) -> Result<HashSet<TopicPartition>> {
        let mut sought = HashSet::new();
        let missing: Vec<TopicPartition> = {
            let p = self.listener.positions.lock();
            partitions
                .into_iter()
                .filter(|tp| !p.contains_key(tp))
                .collect()
        };
        if missing.is_empty() {
            return Ok(sought);
        }
        let client = self.db.client().await?;
        let topics: Vec<&str> = missing.iter().map(|tp| tp.topic.as_str()).collect();
        let parts: Vec<i32> = missing.iter().map(|tp| tp.partition).collect();
        let rows = client
            .query(
                &format!(
                    "SELECT p.topic, p.partition, p.position FROM {} AS p \
                     JOIN unnest($2::text[], $3::int[]) AS u(topic, partition) \
                     ON p.topic = u.topic AND p.partition = u.partition \
                     WHERE p.consumer_group = $1",
                    self.db.t("inbox_position")
                ),
                &[&self.namespace, &topics, &parts],
            )
            .await
            .map_err(|e| self.db.error("cannot read inbox positions", e))?;
        let mut found: HashMap<TopicPartition, Position> = HashMap::new();
        for r in &rows {
            let tp = TopicPartition::new(r.get::<_, String>(0), r.get::<_, i32>(1));
            found.insert(tp, self.parse_position(r.get(2))?);
        }
        for tp in missing {
            let stored = found.remove(&tp);
            if let Some(p) = &stored {
                let to = match p.next() {
                    Some(n) => StartFrom::Position(n),
                    None => StartFrom::Position(p.clone()),
                };
                match self.consumer.seek(&tp, &to).await {
                    Ok(()) => {
                        sought.insert(tp.clone());
                    }
                    // Not fatal: messages at or before the stored position are skipped anyway.
                    Err(e) => tracing::debug!(partition = %tp, error = %e, "inbox seek"),
                }
            }
            self.listener.positions.lock().insert(tp, stored);
        }
        Ok(sought)
    }

    /// Polls once and handles what came; returns the number of messages polled.
    pub async fn step<H: InboxHandler + ?Sized>(&mut self, handler: &H) -> Result<usize> {
        let messages = self
            .consumer
            .poll(self.config.batch_size, self.config.poll_timeout)
            .await?;
        let n = messages.len();
        let mut tps: HashSet<TopicPartition> =
            messages.iter().map(|m| m.topic_partition()).collect();
        tps.extend(self.consumer.assignment());
        // Partitions sought just now: their messages in this batch were fetched before the
        // seek; the consumer delivers them again after it.
        let sought = self.load_positions(tps).await?;
        for m in messages {
            let tp = m.topic_partition();
            if sought.contains(&tp) {
                continue;
            }
            let stored = self.listener.positions.lock().get(&tp).cloned().flatten();
            if let Some(s) = &stored {
                if matches!(
                    m.position.partial_cmp(s),
                    Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
                ) {
                    self.summary.behind_position += 1;
                    continue;
                }
            }
            self.handle_one(handler, &m).await?;
            self.listener
                .positions
                .lock()
                .insert(tp.clone(), Some(m.position.clone()));
            self.uncommitted.insert(tp, m.position.clone());
        }
        if self.last_broker_commit.elapsed() >= self.config.broker_commit_interval {
            self.commit_broker().await;
        }
        Ok(n)
    }

    /// Brings the broker's group offset up to the positions committed in the database (best
    /// effort: the inbox resumes from the database).
    async fn commit_broker(&mut self) {
        self.last_broker_commit = Instant::now();
        if self.uncommitted.is_empty() {
            return;
        }
        let assigned: HashSet<TopicPartition> = self.consumer.assignment().into_iter().collect();
        let positions: Vec<(TopicPartition, Position)> = self
            .uncommitted
            .drain()
            .filter(|(tp, _)| assigned.is_empty() || assigned.contains(tp))
            .collect();
        if let Err(e) = self.consumer.commit(&positions).await {
            tracing::debug!(error = %e, "inbox broker commit");
        }
    }

    async fn handle_one<H: InboxHandler + ?Sized>(
        &mut self,
        handler: &H,
        m: &Message,
    ) -> Result<()> {
        let key = self
            .config
            .key
            .key_of(m)
            .map(|k| format!("inbox:{}:{k}", self.namespace));
        let mut attempt = 0;
        let mut delay = self.config.backoff;
        loop {
            attempt += 1;
            match self.try_once(handler, m, key.as_deref()).await {
                Ok(handled) => {
                    if handled {
                        self.summary.handled += 1;
                    } else {
                        self.summary.duplicates += 1;
                    }
                    return Ok(());
                }
                Err(e) if attempt < self.config.max_attempts && e.is_retriable() => {
                    tracing::debug!(attempt, error = %e, "inbox handler retry");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
                Err(e) => {
                    return Err(e.context(format!(
                        "inbox '{}': message at {}/{}/{} after {attempt} attempt(s)",
                        self.namespace, m.topic, m.partition, m.position
                    )))
                }
            }
        }
    }

    /// One transaction: key, handler, position, commit. `Ok(false)` for a duplicate.
    async fn try_once<H: InboxHandler + ?Sized>(
        &self,
        handler: &H,
        m: &Message,
        key: Option<&str>,
    ) -> Result<bool> {
        let mut client = self.db.client().await?;
        let mut tx = client
            .transaction()
            .await
            .map_err(|e| self.db.error("inbox: cannot begin", e))?;
        let window = crate::ms(self.window);
        let fresh = match key {
            Some(key) => {
                let d = self.db.t("dedup");
                let now = crate::NOW_MS;
                tx.query_opt(
                    &format!(
                        "INSERT INTO {d} AS d (key, token, state, expires_at) \
                         VALUES ($1, 1, 2, {now} + $2) \
                         ON CONFLICT (key) DO UPDATE SET token = d.token + 1, state = 2, \
                         owner = NULL, lease_until = NULL, expires_at = excluded.expires_at, \
                         fingerprint = NULL, result = NULL \
                         WHERE NOT (d.state = 2 AND d.expires_at > {now}) \
                         RETURNING d.token"
                    ),
                    &[&key, &window],
                )
                .await
                .map_err(|e| self.db.error("inbox: cannot record the key", e))?
                .is_some()
            }
            None => true,
        };
        if fresh {
            handler
                .handle(&mut tx, m)
                .await
                .map_err(|e| Error::handler(e).context(format!("inbox '{}'", self.namespace)))?;
        }
        tx.execute(
            &format!(
                "INSERT INTO {} (consumer_group, topic, partition, position) \
                 VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (consumer_group, topic, partition) \
                 DO UPDATE SET position = excluded.position, updated_at = now()",
                self.db.t("inbox_position")
            ),
            &[
                &self.namespace,
                &m.topic,
                &m.partition,
                &m.position.to_string(),
            ],
        )
        .await
        .map_err(|e| self.db.error("inbox: cannot record the position", e))?;
        tx.commit()
            .await
            .map_err(|e| self.db.error("inbox: commit failed", e))?;
        Ok(fresh)
    }

    /// Runs until `shutdown` completes or an error stops it; then commits the broker offsets and
    /// returns what it did. Does not close the consumer.
    pub async fn run_until<H: InboxHandler>(
        mut self,
        handler: H,
        shutdown: impl Future<Output = ()>,
    ) -> Result<InboxSummary> {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                biased;
                _ = &mut shutdown => break,
                r = self.step(&handler) => { r?; }
            }
        }
        self.commit_broker().await;
        Ok(self.summary.clone())
    }
}
