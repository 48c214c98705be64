//! The transactional-inbox crash test, shared by the Kafka and JetStream binaries: a consumer
//! process whose side effect is one row per input (written in the inbox's transaction, in a
//! table without a unique key, so a duplicate would show) is SIGKILLed at ≥ 20 random points;
//! a last run finishes the work. Every run uses a new consumer group, so the only memory of
//! progress is what the inbox committed in PostgreSQL. At the end the table holds exactly one
//! row per input.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use onceflow_core::{
    BoxError, Client, ConsumerConfig, Message, PlatformBackend, ProducerConfig, Record, StartFrom,
    TopicSpec,
};
use onceflow_postgres::tokio_postgres::Transaction;
use onceflow_postgres::{InboxConfig, InboxHandler, PostgresStore};

pub const CHILD_VAR: &str = "ONCEFLOW_INBOX_CRASH_CHILD";
const INPUTS: usize = 800;
const PARTITIONS: u32 = 2;
const WINDOW: Duration = Duration::from_secs(3600);

/// Connects a platform URL (the test binary's adapter).
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

/// The child side: runs the inbox with a fresh group until the table holds every input.
pub async fn child(connect: Connect, spec: &str) {
    let [platform_url, topic, store_url, table]: [&str; 4] = spec
        .split('|')
        .collect::<Vec<_>>()
        .try_into()
        .expect("child spec");
    let store = PostgresStore::open(store_url, WINDOW).await.expect("store");
    let client = Client::new(connect(platform_url.to_string()).await.expect("connect"));
    let group = format!(
        "inbox-crash-{:012x}",
        rand::random::<u64>() & 0xffff_ffff_ffff
    );
    let consumer = client
        .consumer(ConsumerConfig::new(group, [topic.to_string()]).start(StartFrom::Earliest))
        .await
        .expect("consumer");
    let mut inbox = store.inbox(
        consumer,
        InboxConfig {
            namespace: Some(format!("crash-{topic}")),
            batch_size: 20,
            ..InboxConfig::default()
        },
    );
    let handler = OneRow {
        table: table.to_string(),
    };
    let pool = store.pool().clone();
    let mut announced = false;
    let mut last_check = Instant::now();
    loop {
        inbox.step(&handler).await.expect("inbox step");
        if !announced && inbox.summary().handled > 0 {
            println!("\n@@started");
            announced = true;
        }
        if last_check.elapsed() > Duration::from_millis(300) {
            last_check = Instant::now();
            let c = pool.get().await.expect("pool");
            let n: i64 = c
                .query_one(
                    &format!("SELECT count(DISTINCT input_key) FROM {table}"),
                    &[],
                )
                .await
                .expect("count")
                .get(0);
            if n as usize >= INPUTS {
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
pub async fn crash_test(connect: Connect, platform_url: &str, store_base: &str, child_test: &str) {
    let t0 = Instant::now();
    let kills: usize = std::env::var("ONCEFLOW_CRASH_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20)
        .max(20);
    let id = format!("{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff);
    let topic = format!("inbox-crash-{id}");
    let schema = format!("inbox_crash_{id}");
    let store_url = format!("{store_base}?schema={schema}&pool_size=2");
    let table = format!("\"{schema}\".effects");

    let client = Client::new(connect(platform_url.to_string()).await.unwrap());
    client
        .admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(&topic, PARTITIONS))
        .await
        .unwrap();
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    let records: Vec<Record> = (0..INPUTS)
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

    let store = PostgresStore::open(&store_url, WINDOW).await.unwrap();
    let pg = store.pool().get().await.unwrap();
    pg.batch_execute(&format!(
        "CREATE TABLE {table} (input_key text NOT NULL, position text NOT NULL)"
    ))
    .await
    .unwrap();
    let spec = format!("{platform_url}|{topic}|{store_url}|{table}");

    let mut at_kill = Vec::new();
    let mut killed = 0;
    while killed < kills {
        let mut child = spawn_child(child_test, &spec);
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                let w = line.trim().to_string();
                if w.starts_with("@@") && tx.send(w).is_err() {
                    return;
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
                let n: i64 = pg
                    .query_one(&format!("SELECT count(*) FROM {table}"), &[])
                    .await
                    .unwrap()
                    .get(0);
                at_kill.push(n);
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
        "inbox crash test: {killed} SIGKILLs, rows at each kill {at_kill:?}, {:?} so far",
        t0.elapsed()
    );
    assert!(
        killed >= kills,
        "only {killed} kills landed before the work was done (rows at each: {at_kill:?})"
    );
    assert!(
        at_kill.iter().any(|n| (*n as usize) < INPUTS),
        "no kill landed before the work was done"
    );

    // The last run, to the end.
    let mut child = spawn_child(child_test, &spec);
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "final child failed: {status}");

    let rows = pg
        .query(
            &format!("SELECT input_key, count(*) FROM {table} GROUP BY input_key"),
            &[],
        )
        .await
        .unwrap();
    let mut seen = std::collections::HashMap::new();
    for r in &rows {
        seen.insert(r.get::<_, String>(0), r.get::<_, i64>(1));
    }
    for i in 0..INPUTS {
        let key = format!("in-{i}");
        assert_eq!(
            seen.get(&key),
            Some(&1),
            "input {key}: {:?} rows after {killed} kills",
            seen.get(&key)
        );
    }
    assert_eq!(seen.len(), INPUTS, "rows for unknown inputs");
    let positions = store
        .inbox(
            client
                .consumer(ConsumerConfig::new(format!("check-{id}"), [topic.clone()]))
                .await
                .unwrap(),
            InboxConfig {
                namespace: Some(format!("crash-{topic}")),
                ..InboxConfig::default()
            },
        )
        .stored_positions()
        .await
        .unwrap();
    assert_eq!(positions.len(), PARTITIONS as usize, "{positions:?}");
    let _ = pg
        .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .await;
    eprintln!("inbox crash test done in {:?}", t0.elapsed());
}
