//! The transactional inbox: each message handled inside one database transaction that also
//! records its idempotency key and the consumer's position, so the handler's own rows, the key
//! and the position become durable together or not at all.
//!
//! Two stores have one:
//! - the embedded (SQLite) store: [`EmbeddedInbox`], made by
//!   [`EmbeddedStore::inbox`](crate::dedup::EmbeddedStore::inbox); the handler
//!   ([`EmbeddedInboxHandler`]) gets a `rusqlite` transaction on the store's database file;
//! - the PostgreSQL store: `onceflow_postgres::Inbox`, made by `PostgresStore::inbox`; the
//!   handler gets a `tokio_postgres` transaction.
//!
//! Both run the same loop ([`InboxLoop`]) over the same settings ([`InboxConfig`]) and report
//! the same [`InboxSummary`]; a store only supplies its [`InboxDatabase`]: how to read the
//! stored positions and how to run one message's transaction.
//!
//! ## What the loop guarantees
//! - **Exactly once per key**: the transaction first records the key (see [`inbox_key`]) as
//!   completed; a key already completed within the store's window is a duplicate, the handler
//!   does not run (the position is still recorded). Two transactions racing on one key
//!   serialise on the key's row: the second sees the first's once it commits and skips.
//! - **Resume from the database**: when the loop first sees a partition (on assignment or with
//!   its first message) it reads the stored position and seeks the consumer right after it;
//!   messages at or before the stored position are never handled again, whatever the broker's
//!   committed offset says (counted in [`InboxSummary::behind_position`]). The broker's group
//!   offset is also committed, after the database and at most every
//!   [`InboxConfig::broker_commit_interval`], so lag tools keep working, but the loop never
//!   relies on it.
//! - **Keyed by namespace, not by consumer group**: keys and positions are stored under the
//!   inbox's namespace ([`InboxConfig::namespace`], default [`DEFAULT_NAMESPACE`]), never
//!   under the group name, so a new consumer group on the same database (renamed, or
//!   created to re-read a topic) handles nothing twice. Applications that share a database
//!   and read the same topics with different handlers each set their own namespace.
//! - **Failures**: a handler error rolls the transaction back and is retried with backoff
//!   (doubling from [`InboxConfig::backoff`], at most 5 s) while the error is retriable; after
//!   [`InboxConfig::max_attempts`] the loop stops with the error, of kind
//!   [`ErrorKind::Handler`] for a handler's own error. Nothing of that
//!   message is committed, so the next start handles it again.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;

use crate::client::Consumer;
use crate::engine::KeyStrategy;
use crate::error::{Error, ErrorKind, Result};
use crate::model::{Message, Position, StartFrom, TopicPartition};
use crate::RebalanceListener;

pub mod embedded;

pub use embedded::{EmbeddedInbox, EmbeddedInboxHandler, EmbeddedInboxPositions};

/// The namespace of an inbox whose [`InboxConfig::namespace`] is not set: `"default"`.
pub const DEFAULT_NAMESPACE: &str = "default";

/// Settings of a transactional inbox (the same for every store).
#[derive(Debug, Clone)]
pub struct InboxConfig {
    /// Where a message's idempotency key comes from (default: the `idempotency-key` header,
    /// else the message's coordinates).
    pub key: KeyStrategy,
    /// Names this inbox's keys and positions in the database (default
    /// [`DEFAULT_NAMESPACE`], `"default"`). It is the inbox's identity in its database, and
    /// it does **not** follow the consumer group: a new group (a renamed group, a group whose
    /// broker offsets were reset or lost) with the same namespace on the same database
    /// resumes after the stored positions and skips every key already completed, so it
    /// handles nothing twice. Two inboxes with the same namespace share keys and positions:
    /// give each *application* (each handler whose rows are its own) that shares a database
    /// and reads the same topics its own namespace (`"billing"`, `"shipping"`), and keep it
    /// stable across deployments. Earlier versions defaulted to the consumer group name: an
    /// inbox that ran with that default keeps its keys and positions by setting `namespace`
    /// to that group name.
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
    /// Whether the handler runs inside a `process {topic}` span (default true): kind
    /// `Consumer`, a child of the trace context the message carries (its `traceparent`), with
    /// the attributes of the idempotent consumer's process spans (OpenTelemetry messaging
    /// semantic conventions, see [`crate::trace::plan::process`]), one span per attempt, failed
    /// with the handler's error. A key already handled (a duplicate) runs no handler and starts
    /// no span. The Python and Node packages turn it off and start the same span through their
    /// host's OpenTelemetry API instead.
    pub tracing: bool,
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
            tracing: true,
        }
    }
}

/// What a run of a transactional inbox did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InboxSummary {
    /// Messages whose handler ran and committed.
    pub handled: u64,
    /// Messages skipped because their key was already completed.
    pub duplicates: u64,
    /// Messages skipped because the stored position was already past them.
    pub behind_position: u64,
}

/// What one committed inbox transaction did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InboxOutcome {
    /// The key was new (or had no key): the handler ran; its rows, the key and the position
    /// are committed.
    Handled,
    /// The key was already completed within the window: the handler did not run; the position
    /// is committed.
    Duplicate,
}

/// Starts the process span of an inbox's handler (see [`InboxConfig::tracing`]) for the
/// stores: made by [`InboxLoop::handler_spans`], used by an [`InboxDatabase`] right before it
/// calls the handler (after the key was found new), so a duplicate starts no span.
#[derive(Debug, Clone)]
pub struct HandlerSpans {
    system: &'static str,
    group: String,
}

impl HandlerSpans {
    /// Runs the handler's future `work` for `m` inside its process span, and ends the span with
    /// the outcome. A handler's error comes back of kind [`ErrorKind::Handler`].
    pub async fn run<T>(
        spans: Option<&HandlerSpans>,
        m: &Message,
        work: impl Future<Output = std::result::Result<T, crate::BoxError>>,
    ) -> Result<T> {
        use opentelemetry::trace::FutureExt;
        let Some(s) = spans else {
            return work.await.map_err(Error::handler);
        };
        let cx = crate::trace::process_context(s.system, &s.group, m);
        let r = work.with_context(cx.clone()).await.map_err(Error::handler);
        crate::trace::end(&cx, r.as_ref().err());
        r
    }

    /// [`run`](Self::run) for a handler that runs on the calling thread (the embedded store's,
    /// on a blocking thread): the span's context is attached to the thread while `work` runs.
    pub fn run_sync<T>(
        spans: Option<&HandlerSpans>,
        m: &Message,
        work: impl FnOnce() -> std::result::Result<T, crate::BoxError>,
    ) -> Result<T> {
        let Some(s) = spans else {
            return work().map_err(Error::handler);
        };
        let cx = crate::trace::process_context(s.system, &s.group, m);
        let r = {
            let _attached = cx.clone().attach();
            work().map_err(Error::handler)
        };
        crate::trace::end(&cx, r.as_ref().err());
        r
    }
}

/// The key an inbox records for a message whose idempotency key is `key`:
/// `inbox:{namespace}:{key}`. It lives in the store's dedup table, so the store's own `get`
/// sees it as a completed key.
pub fn inbox_key(namespace: &str, key: &str) -> String {
    format!("inbox:{namespace}:{key}")
}

/// Parses a position read back from an inbox's position table (stored as
/// [`Position`]'s `Display`). `store` names the store in the error (for example
/// `embedded store '/var/lib/app/dedup.db'`); a value that does not parse is an error of kind
/// [`ErrorKind::DedupStore`].
pub fn parse_stored_position(store: &str, namespace: &str, stored: &str) -> Result<Position> {
    stored.parse().map_err(|_| {
        Error::new(
            ErrorKind::DedupStore,
            format!(
                "{store}: stored inbox position '{stored}' of namespace '{namespace}' does not \
                 parse as a position"
            ),
        )
    })
}

/// The database side of a transactional inbox: what a store implements (usually on a value
/// borrowing the store and the application's handler) to be driven by [`InboxLoop`].
#[async_trait]
pub trait InboxDatabase: Send + Sync {
    /// The positions stored for `namespace`, for those of `partitions` that have one (the last
    /// message handled or skipped and committed, per partition).
    async fn load_positions(
        &self,
        namespace: &str,
        partitions: &[TopicPartition],
    ) -> Result<Vec<(TopicPartition, Position)>>;

    /// Runs one message's transaction and commits it: records `key` (already namespaced by
    /// [`inbox_key`]; `None`: the message has no key and is always handled) as completed
    /// unless it is completed within the window, runs the handler if it was not, records the
    /// message's position for `namespace`, commits.
    ///
    /// On any error nothing of the message may be committed. A handler's error is returned as
    /// [`Error::handler`] (retriable); a store error is retriable when retrying can help.
    async fn transact(
        &self,
        namespace: &str,
        key: Option<&str>,
        message: &Message,
    ) -> Result<InboxOutcome>;
}

/// Stored positions of the partitions the loop has loaded, kept up to date by the backend's
/// rebalance events.
#[derive(Default)]
struct Listener {
    /// Per partition: `None` loaded with nothing stored; absent: not loaded yet.
    positions: Mutex<HashMap<TopicPartition, Option<Position>>>,
}

/// `std::sync::Mutex` with poisoning ignored (a panic elsewhere must not stop the inbox).
#[derive(Default)]
struct Mutex<T>(std::sync::Mutex<T>);

impl<T> Mutex<T> {
    fn lock(&self) -> std::sync::MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
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

/// The consumer side of a transactional inbox, the same for every store: polls, loads and
/// seeks to the stored positions, skips what the database already holds, runs each message's
/// transaction through an [`InboxDatabase`] with retries, and commits the broker's group
/// offset. See the [module docs](self) for the guarantees.
///
/// Stores wrap it (`EmbeddedInbox`, `onceflow_postgres::Inbox`); use it directly only to give
/// another database an inbox.
pub struct InboxLoop {
    consumer: Consumer,
    config: InboxConfig,
    namespace: String,
    listener: Arc<Listener>,
    summary: InboxSummary,
    last_broker_commit: Instant,
    uncommitted: HashMap<TopicPartition, Position>,
}

impl std::fmt::Debug for InboxLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboxLoop")
            .field("namespace", &self.namespace)
            .field("consumer", &self.consumer)
            .field("summary", &self.summary)
            .finish()
    }
}

impl InboxLoop {
    /// A loop over `consumer`; registers itself as the consumer's rebalance listener (it
    /// replaces one set before). The namespace is [`InboxConfig::namespace`], else
    /// [`DEFAULT_NAMESPACE`] (never the consumer group: see [`InboxConfig::namespace`]).
    pub fn new(consumer: Consumer, config: InboxConfig) -> Self {
        let listener = Arc::new(Listener::default());
        consumer.backend().set_rebalance_listener(listener.clone());
        let namespace = config
            .namespace
            .clone()
            .unwrap_or_else(|| DEFAULT_NAMESPACE.to_string());
        InboxLoop {
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

    /// The consumer it reads.
    pub fn consumer(&self) -> &Consumer {
        &self.consumer
    }

    /// The settings.
    pub fn config(&self) -> &InboxConfig {
        &self.config
    }

    /// What a store needs to start the handler's process spans: `None` when
    /// [`InboxConfig::tracing`] is off.
    pub fn handler_spans(&self) -> Option<HandlerSpans> {
        self.config.tracing.then(|| HandlerSpans {
            system: self.consumer.platform(),
            group: self.consumer.group().to_string(),
        })
    }

    /// Loads the stored positions of partitions not seen yet; returns the partitions moved
    /// (sought) to just after their stored position.
    async fn load_positions<D: InboxDatabase + ?Sized>(
        &mut self,
        db: &D,
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
        let mut found: HashMap<TopicPartition, Position> = db
            .load_positions(&self.namespace, &missing)
            .await?
            .into_iter()
            .collect();
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

    /// Polls once and handles what came through `db`; returns the number of messages polled.
    ///
    /// Errors: the consumer's poll error, a store error reading positions, or the error of a
    /// message whose transaction failed [`InboxConfig::max_attempts`] times (or once with an
    /// error that is not retriable); messages of the batch after it are not handled and come
    /// again on the next start.
    pub async fn step<D: InboxDatabase + ?Sized>(&mut self, db: &D) -> Result<usize> {
        let messages = self.poll().await?;
        let n = messages.len();
        let never = std::pin::pin!(std::future::pending::<()>());
        self.handle_batch(db, messages, never).await?;
        Ok(n)
    }

    async fn poll(&self) -> Result<Vec<Message>> {
        self.consumer
            .poll(self.config.batch_size, self.config.poll_timeout)
            .await
    }

    /// Handles one polled batch in order. See [`step`](Self::step). Returns `false` when
    /// `shutdown` completed while a message waited to be retried: no transaction is in flight
    /// then, and that message and the rest of the batch come again on the next start.
    async fn handle_batch<D: InboxDatabase + ?Sized, S: Future<Output = ()> + ?Sized>(
        &mut self,
        db: &D,
        messages: Vec<Message>,
        mut shutdown: Pin<&mut S>,
    ) -> Result<bool> {
        let mut tps: HashSet<TopicPartition> =
            messages.iter().map(|m| m.topic_partition()).collect();
        tps.extend(self.consumer.assignment());
        // Partitions sought just now: their messages in this batch were fetched before the
        // seek; the consumer delivers them again after it.
        let sought = self.load_positions(db, tps).await?;
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
            if !self.handle_one(db, &m, shutdown.as_mut()).await? {
                return Ok(false);
            }
            self.listener
                .positions
                .lock()
                .insert(tp.clone(), Some(m.position.clone()));
            self.uncommitted.insert(tp, m.position.clone());
        }
        if self.last_broker_commit.elapsed() >= self.config.broker_commit_interval {
            self.commit_broker().await;
        }
        Ok(true)
    }

    /// Brings the broker's group offset up to the positions committed in the database (best
    /// effort: the inbox resumes from the database).
    pub async fn commit_broker(&mut self) {
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

    /// Handles `m` in one transaction, retried while its error is retriable; `false` when
    /// `shutdown` completed while a retry waited (nothing of `m` committed).
    async fn handle_one<D: InboxDatabase + ?Sized, S: Future<Output = ()> + ?Sized>(
        &mut self,
        db: &D,
        m: &Message,
        mut shutdown: Pin<&mut S>,
    ) -> Result<bool> {
        let key = self
            .config
            .key
            .key_of(m)
            .map(|k| inbox_key(&self.namespace, &k));
        let mut attempt = 0;
        let mut delay = self.config.backoff;
        loop {
            attempt += 1;
            match db.transact(&self.namespace, key.as_deref(), m).await {
                Ok(InboxOutcome::Handled) => {
                    self.summary.handled += 1;
                    return Ok(true);
                }
                Ok(InboxOutcome::Duplicate) => {
                    self.summary.duplicates += 1;
                    return Ok(true);
                }
                Err(e) if attempt < self.config.max_attempts && e.is_retriable() => {
                    tracing::debug!(attempt, error = %e, "inbox handler retry");
                    tokio::select! {
                        biased;
                        _ = shutdown.as_mut() => return Ok(false),
                        _ = tokio::time::sleep(delay) => {}
                    }
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

    /// Runs [`step`](Self::step) until `shutdown` completes or an error stops it; then commits
    /// the broker offsets and returns what it did. Does not close the consumer.
    ///
    /// `shutdown` stops a poll that is waiting, or a retry that is waiting (no transaction is in
    /// flight then; that message and the rest of its batch come again on the next start);
    /// otherwise a batch already polled is handled to its end first, so every transaction the
    /// database committed is counted in the summary.
    pub async fn run_until<D: InboxDatabase + ?Sized>(
        mut self,
        db: &D,
        shutdown: impl Future<Output = ()>,
    ) -> Result<InboxSummary> {
        tokio::pin!(shutdown);
        loop {
            let messages = tokio::select! {
                biased;
                _ = &mut shutdown => break,
                r = self.poll() => r?,
            };
            if !self.handle_batch(db, messages, shutdown.as_mut()).await? {
                break;
            }
        }
        self.commit_broker().await;
        Ok(self.summary.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_namespaced() {
        assert_eq!(inbox_key("billing", "k1"), "inbox:billing:k1");
    }

    #[test]
    fn a_stored_position_that_does_not_parse_names_the_store_and_value() {
        let e = parse_stored_position("embedded store 'x.db'", "ns", "garbage").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::DedupStore);
        assert!(e.message().contains("x.db"), "{e}");
        assert!(e.message().contains("'garbage'"), "{e}");
        let p = Position::Offset(41);
        assert_eq!(parse_stored_position("s", "ns", &p.to_string()).unwrap(), p);
    }
}
