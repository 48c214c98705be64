//! The transactional-inbox crash test, shared by the Kafka and JetStream binaries and by both
//! stores with an inbox (PostgreSQL, [`Store::Postgres`], and the embedded SQLite store,
//! [`Store::Embedded`]): a consumer process whose side effect is one row per input (written in
//! the inbox's transaction, in a table without a unique key, so a duplicate would show) is
//! SIGKILLed at ≥ 20 random points; a last run finishes the work. Every run uses a new consumer
//! group, so the only memory of progress is what the inbox committed in the store's database.
//! At the end the table holds exactly one row per input.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use onceflow_core::dedup::EmbeddedStore;
use onceflow_core::inbox::{EmbeddedInbox, EmbeddedInboxHandler, InboxConfig, InboxSummary};
use onceflow_core::rusqlite;
use onceflow_core::{
    BoxError, Client, Consumer, ConsumerConfig, Message, PlatformBackend, Position, ProducerConfig,
    Record, StartFrom, TopicPartition, TopicSpec,
};
use onceflow_postgres::tokio_postgres::Transaction;
use onceflow_postgres::{Inbox, InboxHandler, PostgresStore};

pub const CHILD_VAR: &str = "ONCEFLOW_INBOX_CRASH_CHILD";
/// Inputs per kill landed before the work is done: a run lives 20–320 ms after its first
/// message, and handles up to ~60 messages in it (the embedded store) — enough inputs that the
/// kills always land mid-work.
const INPUTS_PER_KILL: usize = 60;
/// Fewest inputs.
const MIN_INPUTS: usize = 1200;
const PARTITIONS: u32 = 2;
const WINDOW: Duration = Duration::from_secs(3600);

/// A platform being opened from its URL.
pub type Connected =
    futures::future::BoxFuture<'static, onceflow_core::Result<Arc<dyn PlatformBackend>>>;

/// Opens the platform under test from its URL.
pub type Connect = fn(String) -> Connected;

/// One row per input, in the inbox's transaction.
struct OneRow {
    table: String,
}

#[async_trait]
impl InboxHandler for OneRow {
    async fn handle(&self, tx: &mut Transaction<'_>, m: &Message) -> Result<(), BoxError> {
        let key = m
            .headers
            .get_str(onceflow_core::IDEMPOTENCY_KEY_HEADER)
            .ok_or("input without an idempotency key")?
            .to_string();
        tx.execute(
            &format!(
                "INSERT INTO {} (input_key, position) VALUES ($1, $2)",
                self.table
            ),
            &[&key, &m.position.to_string()],
        )
        .await?;
        // Some work inside the transaction, so kills land on every step of it.
        tokio::time::sleep(Duration::from_millis(6)).await;
        Ok(())
    }
}

/// One row per input, in the embedded inbox's SQLite transaction (runs on a blocking thread).
struct OneRowSqlite;

impl EmbeddedInboxHandler for OneRowSqlite {
    fn handle(&self, tx: &mut rusqlite::Transaction<'_>, m: &Message) -> Result<(), BoxError> {
        let key = m
            .headers
            .get_str(onceflow_core::IDEMPOTENCY_KEY_HEADER)
            .ok_or("input without an idempotency key")?;
        tx.execute(
            "INSERT INTO effects (input_key, position) VALUES (?1, ?2)",
            [key, &m.position.to_string()],
        )?;
        // Some work inside the transaction, so kills land on every step of it.
        std::thread::sleep(Duration::from_millis(6));
        Ok(())
    }
}

/// The store whose inbox is under test.
#[derive(Debug, Clone)]
pub enum Store {
    /// PostgreSQL at this base URL; the test makes a fresh schema in it.
    Postgres(String),
    /// The embedded SQLite store; the test makes a fresh file in this directory.
    Embedded(PathBuf),
}

impl Store {
    /// The store of one test: a fresh schema or file named after `id`, as the child spec's
    /// `kind|location|table`.
    fn fresh(&self, id: &str) -> (&'static str, String, String) {
        match self {
            Store::Postgres(base) => {
                let schema = format!("inbox_crash_{id}");
                (
                    "postgres",
                    format!("{base}?schema={schema}&pool_size=2"),
                    format!("\"{schema}\".effects"),
                )
            }
            Store::Embedded(dir) => (
                "embedded",
                dir.join(format!("inbox-crash-{id}.db"))
                    .to_str()
                    .expect("a UTF-8 temporary path")
                    .to_string(),
                "effects".to_string(),
            ),
        }
    }
}

/// The store of one test, opened by the parent to set up and check the effects table.
enum Opened {
    Postgres {
        store: PostgresStore,
        schema: String,
        table: String,
    },
    Embedded {
        store: EmbeddedStore,
    },
}

impl Opened {
    async fn open(kind: &str, location: &str, table: &str) -> Opened {
        match kind {
            "postgres" => Opened::Postgres {
                store: PostgresStore::open(location, WINDOW).await.unwrap(),
                schema: location
                    .split("schema=")
                    .nth(1)
                    .and_then(|s| s.split('&').next())
                    .unwrap()
                    .to_string(),
                table: table.to_string(),
            },
            _ => Opened::Embedded {
                store: EmbeddedStore::open(location, WINDOW).await.unwrap(),
            },
        }
    }

    async fn create_table(&self) {
        match self {
            Opened::Postgres { store, table, .. } => store
                .pool()
                .get()
                .await
                .unwrap()
                .batch_execute(&format!(
                    "CREATE TABLE {table} (input_key text NOT NULL, position text NOT NULL)"
                ))
                .await
                .unwrap(),
            Opened::Embedded { store } => sqlite(store.path())
                .execute_batch(
                    "CREATE TABLE effects (input_key TEXT NOT NULL, position TEXT NOT NULL)",
                )
                .unwrap(),
        }
    }

    /// Rows of the effects table per input key.
    async fn rows_per_key(&self) -> std::collections::HashMap<String, i64> {
        let sql_of =
            |table: &str| format!("SELECT input_key, count(*) FROM {table} GROUP BY input_key");
        match self {
            Opened::Postgres { store, table, .. } => store
                .pool()
                .get()
                .await
                .unwrap()
                .query(&sql_of(table), &[])
                .await
                .unwrap()
                .iter()
                .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
                .collect(),
            Opened::Embedded { store } => {
                let conn = sqlite(store.path());
                let mut stmt = conn.prepare(&sql_of("effects")).unwrap();
                stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
                    .unwrap()
                    .collect::<rusqlite::Result<_>>()
                    .unwrap()
            }
        }
    }

    async fn row_count(&self) -> i64 {
        self.rows_per_key().await.values().sum()
    }

    async fn stored_positions(
        &self,
        consumer: Consumer,
        config: InboxConfig,
    ) -> Vec<(TopicPartition, Position)> {
        match self {
            Opened::Postgres { store, .. } => store
                .inbox(consumer, config)
                .stored_positions()
                .await
                .unwrap(),
            Opened::Embedded { store } => store
                .inbox(consumer, config)
                .await
                .unwrap()
                .stored_positions()
                .await
                .unwrap(),
        }
    }

    async fn drop_data(self) {
        if let Opened::Postgres { store, schema, .. } = self {
            let _ = store
                .pool()
                .get()
                .await
                .unwrap()
                .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
                .await;
        }
    }
}

fn sqlite(path: &Path) -> rusqlite::Connection {
    let conn = rusqlite::Connection::open(path).expect("open the embedded store's file");
    conn.busy_timeout(Duration::from_secs(10)).unwrap();
    conn
}

/// The inbox a child runs, with its handler.
enum ChildInbox {
    Postgres(Box<Inbox>, OneRow, PostgresStore),
    Embedded(EmbeddedInbox, Arc<OneRowSqlite>, PathBuf),
}

impl ChildInbox {
    async fn step(&mut self) {
        match self {
            ChildInbox::Postgres(inbox, handler, _) => inbox.step(handler).await,
            ChildInbox::Embedded(inbox, handler, _) => inbox.step(handler).await,
        }
        .expect("inbox step");
    }

    fn summary(&self) -> &InboxSummary {
        match self {
            ChildInbox::Postgres(inbox, ..) => inbox.summary(),
            ChildInbox::Embedded(inbox, ..) => inbox.summary(),
        }
    }

    /// Inputs with a row in the effects table.
    async fn inputs_done(&self) -> usize {
        let n: i64 = match self {
            ChildInbox::Postgres(_, handler, store) => store
                .pool()
                .get()
                .await
                .expect("pool")
                .query_one(
                    &format!("SELECT count(DISTINCT input_key) FROM {}", handler.table),
                    &[],
                )
                .await
                .expect("count")
                .get(0),
            ChildInbox::Embedded(_, _, path) => {
                let path = path.clone();
                tokio::task::spawn_blocking(move || {
                    sqlite(&path)
                        .query_row("SELECT count(DISTINCT input_key) FROM effects", [], |r| {
                            r.get(0)
                        })
                        .expect("count")
                })
                .await
                .unwrap()
            }
        };
        n as usize
    }
}

/// The child side: runs the inbox with a fresh group until the table holds every input.
pub async fn child(connect: Connect, spec: &str) {
    let [platform_url, topic, kind, location, table, inputs]: [&str; 6] = spec
        .split('|')
        .collect::<Vec<_>>()
        .try_into()
        .expect("child spec");
    let inputs: usize = inputs.parse().expect("child spec: inputs");
    let client = Client::new(connect(platform_url.to_string()).await.expect("connect"));
    let group = format!(
        "inbox-crash-{:012x}",
        rand::random::<u64>() & 0xffff_ffff_ffff
    );
    let consumer = client
        .consumer(ConsumerConfig::new(group, [topic.to_string()]).start(StartFrom::Earliest))
        .await
        .expect("consumer");
    let config = InboxConfig {
        namespace: Some(format!("crash-{topic}")),
        batch_size: 20,
        ..InboxConfig::default()
    };
    // Kept open for the whole run, as an application would.
    let mut _embedded_store = None;
    let mut inbox = match kind {
        "postgres" => {
            let store = PostgresStore::open(location, WINDOW).await.expect("store");
            let handler = OneRow {
                table: table.to_string(),
            };
            ChildInbox::Postgres(Box::new(store.inbox(consumer, config)), handler, store)
        }
        _ => {
            let store = EmbeddedStore::open(location, WINDOW).await.expect("store");
            let inbox = store.inbox(consumer, config).await.expect("inbox");
            let path = store.path().to_path_buf();
            _embedded_store = Some(store);
            ChildInbox::Embedded(inbox, Arc::new(OneRowSqlite), path)
        }
    };
    let mut announced = false;
    let mut last_check = Instant::now();
    loop {
        inbox.step().await;
        if !announced && inbox.summary().handled > 0 {
            println!("\n@@started");
            announced = true;
        }
        if last_check.elapsed() > Duration::from_millis(300) {
            last_check = Instant::now();
            if inbox.inputs_done().await >= inputs {
                println!("\n@@finished {:?}", inbox.summary());
                return;
            }
        }
    }
}

fn spawn_child(test: &str, spec: &str) -> Child {
    Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD_VAR, spec)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn child")
}

/// The parent side: produces the inputs, kills `kills` children at random points, runs a last
/// child to the end and checks the table.
pub async fn crash_test(connect: Connect, platform_url: &str, store: Store, child_test: &str) {
    let t0 = Instant::now();
    let kills: usize = std::env::var("ONCEFLOW_CRASH_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20)
        .max(20);
    let inputs = (kills * INPUTS_PER_KILL).max(MIN_INPUTS);
    let id = format!("{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff);
    let topic = format!("inbox-crash-{id}");
    let (kind, location, table) = store.fresh(&id);

    let client = Client::new(connect(platform_url.to_string()).await.unwrap());
    client
        .admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(&topic, PARTITIONS))
        .await
        .unwrap();
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    let records: Vec<Record> = (0..inputs)
        .map(|i| {
            Record::new(&topic, format!("{i}"))
                .key(format!("k{}", i % 7))
                .idempotency_key(format!("in-{i}"))
        })
        .collect();
    for r in producer.send_batch(records).await {
        r.expect("produce an input");
    }
    producer.flush(Duration::from_secs(30)).await.unwrap();

    let opened = Opened::open(kind, &location, &table).await;
    opened.create_table().await;
    let spec = format!("{platform_url}|{topic}|{kind}|{location}|{table}|{inputs}");

    let mut at_kill = Vec::new();
    let mut killed = 0;
    while killed < kills {
        let mut child = spawn_child(child_test, &spec);
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // Reads to the end even when nobody listens any more: a closed pipe would fail the
            // child's next write (and a child that finished would exit with an error).
            for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                let w = line.trim().to_string();
                if w.starts_with("@@") {
                    let _ = tx.send(w);
                }
            }
        });
        let first = tokio::task::spawn_blocking(move || {
            let r = rx.recv_timeout(Duration::from_secs(60));
            (r, rx)
        })
        .await
        .unwrap()
        .0;
        match first {
            Ok(w) if w == "@@started" => {
                let wait = 20 + rand::random::<u64>() % 300;
                tokio::time::sleep(Duration::from_millis(wait)).await;
                child.kill().unwrap();
                let status = child.wait().unwrap();
                #[cfg(unix)]
                {
                    use std::os::unix::process::ExitStatusExt;
                    if status.signal() != Some(9) {
                        // It finished before the kill: all inputs are done.
                        assert!(status.success(), "child failed: {status}");
                        break;
                    }
                }
                killed += 1;
                at_kill.push(opened.row_count().await);
            }
            Ok(w) if w.starts_with("@@finished") => {
                let _ = child.wait();
                break;
            }
            other => {
                let _ = child.kill();
                panic!("child did not start: {other:?}");
            }
        }
    }
    eprintln!(
        "inbox crash test ({kind} store): {killed} SIGKILLs, rows at each kill {at_kill:?}, {:?} so far",
        t0.elapsed()
    );
    assert!(
        killed >= kills,
        "only {killed} kills landed before the work was done (rows at each: {at_kill:?})"
    );
    assert!(
        at_kill.iter().any(|n| (*n as usize) < inputs),
        "no kill landed before the work was done"
    );

    // The last run, to the end.
    let mut child = spawn_child(child_test, &spec);
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "final child failed: {status}");

    let seen = opened.rows_per_key().await;
    for i in 0..inputs {
        let key = format!("in-{i}");
        assert_eq!(
            seen.get(&key),
            Some(&1),
            "input {key}: {:?} rows after {killed} kills",
            seen.get(&key)
        );
    }
    assert_eq!(seen.len(), inputs, "rows for unknown inputs");
    let positions = opened
        .stored_positions(
            client
                .consumer(ConsumerConfig::new(format!("check-{id}"), [topic.clone()]))
                .await
                .unwrap(),
            InboxConfig {
                namespace: Some(format!("crash-{topic}")),
                ..InboxConfig::default()
            },
        )
        .await;
    assert_eq!(positions.len(), PARTITIONS as usize, "{positions:?}");
    opened.drop_data().await;
    eprintln!("inbox crash test ({kind} store) done in {:?}", t0.elapsed());
}
