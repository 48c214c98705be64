//! The transactional inbox on the embedded (SQLite) store with the in-process `memory://`
//! backend: duplicates skipped, handler errors rolled back and retried, a new consumer resuming
//! from the positions stored in the file (also after the store is reopened), a poison message
//! stopping the inbox with nothing of it committed, the dedup store usable alongside.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use onceflow_core::dedup::{DedupStore, EmbeddedStore, KeyState};
use onceflow_core::inbox::{inbox_key, EmbeddedInbox, EmbeddedInboxHandler, InboxConfig};
use onceflow_core::rusqlite::{Connection, Transaction};
use onceflow_core::{
    BoxError, Client, ConsumerConfig, ErrorKind, Message, ProducerConfig, Record, StartFrom,
    TopicSpec,
};

struct Rows {
    flaky_left: AtomicUsize,
}

impl EmbeddedInboxHandler for Rows {
    fn handle(&self, tx: &mut Transaction<'_>, m: &Message) -> Result<(), BoxError> {
        let payload = String::from_utf8_lossy(&m.payload).into_owned();
        tx.execute("INSERT INTO rows (payload) VALUES (?1)", [&payload])?;
        if payload == "flaky" && self.flaky_left.load(Ordering::SeqCst) > 0 {
            self.flaky_left.fetch_sub(1, Ordering::SeqCst);
            return Err("flaky handler fails (its row must be rolled back)".into());
        }
        if payload == "poison" {
            return Err("poison message".into());
        }
        Ok(())
    }
}

fn count(path: &std::path::Path, sql: &str) -> i64 {
    Connection::open(path)
        .unwrap()
        .query_row(sql, [], |r| r.get(0))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_skips_duplicates_rolls_back_failures_and_resumes_from_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let window = Duration::from_secs(3600);
    let store = EmbeddedStore::open(&path, window).await.unwrap();
    Connection::open(&path)
        .unwrap()
        .execute_batch("CREATE TABLE rows (payload TEXT NOT NULL)")
        .unwrap();

    let id = format!("{:08x}", rand::random::<u32>());
    let client = Client::new(onceflow_memory::connect(&format!("memory://inbox-{id}")).unwrap());
    let topic = "orders";
    client
        .admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(topic, 2))
        .await
        .unwrap();
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    // 30 distinct keys, 10 redeliveries of earlier keys, one flaky message.
    let mut records: Vec<Record> = (0..30)
        .map(|i| Record::new(topic, format!("p{i}")).idempotency_key(format!("k{i}")))
        .collect();
    records.extend(
        (0..10).map(|i| Record::new(topic, format!("p{i}")).idempotency_key(format!("k{i}"))),
    );
    records.push(Record::new(topic, "flaky").idempotency_key("k-flaky"));
    for r in producer.send_batch(records).await {
        r.unwrap();
    }
    let handler = Arc::new(Rows {
        flaky_left: AtomicUsize::new(2),
    });
    let config = InboxConfig {
        namespace: Some("billing".into()),
        backoff: Duration::from_millis(10),
        ..InboxConfig::default()
    };
    let consumer = client
        .consumer(ConsumerConfig::new("g1", [topic]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let mut inbox = store.inbox(consumer, config.clone()).await.unwrap();
    assert_eq!(inbox.namespace(), "billing");
    for _ in 0..50 {
        inbox.step(&handler).await.unwrap();
        let s = inbox.summary();
        if s.handled + s.duplicates == 41 {
            break;
        }
    }
    assert_eq!(inbox.summary().handled, 31, "{:?}", inbox.summary());
    assert_eq!(inbox.summary().duplicates, 10, "{:?}", inbox.summary());
    assert_eq!(count(&path, "SELECT count(*) FROM rows"), 31);
    assert_eq!(count(&path, "SELECT count(DISTINCT payload) FROM rows"), 31);
    assert_eq!(
        handler.flaky_left.load(Ordering::SeqCst),
        0,
        "flaky was not retried"
    );
    let stored = inbox.stored_positions().await.unwrap();
    assert_eq!(stored.len(), 2, "{stored:?}");
    // The inbox's keys are completed keys of the dedup store on the same file.
    let got = store
        .get(&[inbox_key("billing", "k3"), inbox_key("billing", "nope")])
        .await
        .unwrap();
    assert!(
        matches!(got[0], Some(KeyState::Completed { .. })),
        "{got:?}"
    );
    assert_eq!(got[1], None);
    drop(inbox);

    // The store reopened, a new consumer group from the earliest message: the inbox resumes
    // from the file.
    drop(store);
    let store = EmbeddedStore::open(&path, window).await.unwrap();
    let consumer = client
        .consumer(ConsumerConfig::new("g2", [topic]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let mut again = store.inbox(consumer, config.clone()).await.unwrap();
    for _ in 0..10 {
        again.step(&handler).await.unwrap();
    }
    assert_eq!(again.summary().handled, 0, "{:?}", again.summary());
    assert_eq!(again.stored_positions().await.unwrap(), stored);
    assert_eq!(count(&path, "SELECT count(*) FROM rows"), 31);

    // A poison message: the inbox stops with the handler's error, nothing of it committed.
    producer
        .send(Record::new(topic, "poison").idempotency_key("k-poison"))
        .await
        .unwrap();
    let mut failed = None;
    for _ in 0..20 {
        if let Err(e) = again.step(&handler).await {
            failed = Some(e);
            break;
        }
    }
    let e = failed.expect("the poison message did not stop the inbox");
    assert_eq!(e.kind(), ErrorKind::Handler, "{e}");
    assert!(e.message().contains("poison"), "{e}");
    assert_eq!(
        count(&path, "SELECT count(*) FROM rows WHERE payload = 'poison'"),
        0
    );
    assert_eq!(
        count(
            &path,
            "SELECT count(*) FROM onceflow_dedup WHERE key = 'inbox:billing:k-poison'"
        ),
        0
    );
    assert_eq!(again.stored_positions().await.unwrap(), stored);
}

/// An inbox (`config`) in a fresh file whose database has `table_sql` run, reading topic `t`
/// (`partitions`) of a fresh memory:// platform from the start, after `records` were sent to it.
async fn inbox_over(
    table_sql: &str,
    partitions: u32,
    records: Vec<Record>,
    config: InboxConfig,
) -> (tempfile::TempDir, std::path::PathBuf, EmbeddedInbox) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let store = EmbeddedStore::open(&path, Duration::from_secs(3600))
        .await
        .unwrap();
    Connection::open(&path)
        .unwrap()
        .execute_batch(table_sql)
        .unwrap();
    let id = format!("{:08x}", rand::random::<u32>());
    let client = Client::new(onceflow_memory::connect(&format!("memory://run-{id}")).unwrap());
    client
        .admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new("t", partitions))
        .await
        .unwrap();
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    for r in producer.send_batch(records).await {
        r.unwrap();
    }
    let consumer = client
        .consumer(ConsumerConfig::new("g", ["t"]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let inbox = store.inbox(consumer, config).await.unwrap();
    (dir, path, inbox)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_until_with_a_closure_handles_every_message_once() {
    let (_dir, path, inbox) = inbox_over(
        "CREATE TABLE seen (payload TEXT NOT NULL, position TEXT NOT NULL)",
        3,
        (0..200)
            .map(|i| Record::new("t", format!("{i}")).key(format!("{}", i % 5)))
            .collect(),
        InboxConfig::default(),
    )
    .await;
    let done_path = path.clone();
    let summary = inbox
        .run_until(
            |tx: &mut Transaction<'_>, m: &Message| -> Result<(), BoxError> {
                tx.execute(
                    "INSERT INTO seen (payload, position) VALUES (?1, ?2)",
                    [
                        String::from_utf8_lossy(&m.payload).into_owned(),
                        m.position.to_string(),
                    ],
                )?;
                Ok(())
            },
            async move {
                while count(&done_path, "SELECT count(*) FROM seen") < 200 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
        )
        .await
        .unwrap();
    assert_eq!(summary.handled, 200, "{summary:?}");
    assert_eq!(
        count(&path, "SELECT count(DISTINCT payload) FROM seen"),
        200
    );
}

/// A shutdown that completes while a batch is being handled lets that batch finish: the summary
/// counts every transaction the file committed (it once dropped the step mid-batch, after a
/// commit whose count was then lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_during_a_batch_counts_every_committed_transaction() {
    let (_dir, path, inbox) = seen(50, InboxConfig::default()).await;
    let first = Arc::new(tokio::sync::Notify::new());
    let signal = first.clone();
    let summary = inbox
        .run_until(
            move |tx: &mut Transaction<'_>, m: &Message| -> Result<(), BoxError> {
                insert_seen(tx, m)?;
                // Shut down while this transaction (and the rest of the batch) is in flight.
                signal.notify_one();
                std::thread::sleep(Duration::from_millis(2));
                Ok(())
            },
            async move { first.notified().await },
        )
        .await
        .unwrap();
    let committed = count(&path, "SELECT count(*) FROM seen");
    assert!(committed >= 1, "{committed}");
    assert_eq!(summary.handled, committed as u64, "{summary:?}");
}

/// The handlers' write: the message's payload into `seen`.
fn insert_seen(tx: &mut Transaction<'_>, m: &Message) -> onceflow_core::rusqlite::Result<usize> {
    tx.execute(
        "INSERT INTO seen (payload) VALUES (?1)",
        [String::from_utf8_lossy(&m.payload).into_owned()],
    )
}

/// [`inbox_over`] with a `seen` table and one partition holding `n` messages "0".."n-1".
async fn seen(
    n: usize,
    config: InboxConfig,
) -> (tempfile::TempDir, std::path::PathBuf, EmbeddedInbox) {
    inbox_over(
        "CREATE TABLE seen (payload TEXT NOT NULL)",
        1,
        (0..n).map(|i| Record::new("t", format!("{i}"))).collect(),
        config,
    )
    .await
}

/// A shutdown stops a handler that is being retried: the retry waits for no transaction, so
/// nothing is lost by stopping there (the message comes again on the next start). Before, a
/// handler failing with a retriable error under a large `max_attempts` kept `run_until` going
/// long after the shutdown (here 8 attempts, in production until the database came back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_a_handler_that_is_being_retried() {
    let (_dir, path, inbox) = seen(
        3,
        InboxConfig {
            max_attempts: u32::MAX,
            backoff: Duration::from_millis(1),
            ..InboxConfig::default()
        },
    )
    .await;
    let first = Arc::new(tokio::sync::Notify::new());
    let signal = first.clone();
    let calls = Arc::new(AtomicUsize::new(0));
    let seen_calls = calls.clone();
    let summary = inbox
        .run_until(
            move |tx: &mut Transaction<'_>, m: &Message| -> Result<(), BoxError> {
                insert_seen(tx, m)?;
                signal.notify_one();
                // The database is down for the first 8 attempts.
                if seen_calls.fetch_add(1, Ordering::SeqCst) < 8 {
                    return Err("database unavailable (retriable)".into());
                }
                Ok(())
            },
            async move { first.notified().await },
        )
        .await
        .unwrap();
    let committed = count(&path, "SELECT count(*) FROM seen");
    assert_eq!(summary.handled, committed as u64, "{summary:?}");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the handler was retried after the shutdown completed ({summary:?})"
    );
}

/// A handler error after the shutdown fired, in the same batch: `run_until` returns the error,
/// the messages before it are committed with their position, nothing of it or after it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_after_shutdown_in_the_batch_is_returned_and_commits_only_what_came_before() {
    let (_dir, path, inbox) = seen(
        10,
        InboxConfig {
            max_attempts: 1,
            ..InboxConfig::default()
        },
    )
    .await;
    let first = Arc::new(tokio::sync::Notify::new());
    let signal = first.clone();
    let e = inbox
        .run_until(
            move |tx: &mut Transaction<'_>, m: &Message| -> Result<(), BoxError> {
                let payload = String::from_utf8_lossy(&m.payload).into_owned();
                tx.execute("INSERT INTO seen (payload) VALUES (?1)", [&payload])?;
                signal.notify_one();
                if payload == "3" {
                    return Err("poison".into());
                }
                Ok(())
            },
            async move { first.notified().await },
        )
        .await
        .expect_err("the poison message's error");
    assert_eq!(e.kind(), ErrorKind::Handler, "{e}");
    assert!(e.message().contains("poison"), "{e}");
    assert_eq!(count(&path, "SELECT count(*) FROM seen"), 3);
    assert_eq!(
        count(
            &path,
            "SELECT count(*) FROM seen WHERE payload IN ('0','1','2')"
        ),
        3
    );
    // The position stored with the last committed message, in the same file.
    let stored: String = Connection::open(&path)
        .unwrap()
        .query_row("SELECT position FROM onceflow_inbox_position", [], |r| {
            r.get(0)
        })
        .unwrap();
    assert_eq!(stored, "offset:2");
}

/// A shutdown already complete when `run_until` starts: nothing is polled or handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_complete_at_the_start_handles_nothing() {
    let (_dir, path, inbox) = seen(5, InboxConfig::default()).await;
    let summary = inbox
        .run_until(
            |tx: &mut Transaction<'_>, m: &Message| -> Result<(), BoxError> {
                insert_seen(tx, m)?;
                Ok(())
            },
            std::future::ready(()),
        )
        .await
        .unwrap();
    assert_eq!(summary.handled, 0, "{summary:?}");
    assert_eq!(count(&path, "SELECT count(*) FROM seen"), 0);
}
