//! The transactional inbox on the in-process `memory://` backend with a real PostgreSQL
//! (`ONCEFLOW_POSTGRES_URL`): duplicates skipped, handler errors rolled back and retried, a
//! new consumer resuming from the positions stored in the database, a poison message stopping
//! the inbox with nothing of it committed.

mod redis_postgres;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use onceflow_core::{
    BoxError, Client, ConsumerConfig, ErrorKind, Message, ProducerConfig, Record, StartFrom,
    TopicSpec,
};
use onceflow_postgres::tokio_postgres::Transaction;
use onceflow_postgres::{InboxConfig, InboxHandler, PostgresStore};

struct Rows {
    table: String,
    flaky_left: AtomicUsize,
}

#[async_trait]
impl InboxHandler for Rows {
    async fn handle(&self, tx: &mut Transaction<'_>, m: &Message) -> Result<(), BoxError> {
        let payload = String::from_utf8_lossy(&m.payload).into_owned();
        tx.execute(
            &format!("INSERT INTO {} (payload) VALUES ($1)", self.table),
            &[&payload],
        )
        .await?;
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

async fn count(store: &PostgresStore, sql: &str) -> i64 {
    store
        .pool()
        .get()
        .await
        .unwrap()
        .query_one(sql, &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_skips_duplicates_rolls_back_failures_and_resumes_from_the_database() {
    let Some(pg) = redis_postgres::service_url("ONCEFLOW_POSTGRES_URL", "postgres") else {
        return;
    };
    let id = redis_postgres::rand_hex();
    let schema = format!("inbox_{id}");
    let store = PostgresStore::open(
        &format!("{pg}?schema={schema}&pool_size=2"),
        Duration::from_secs(3600),
    )
    .await
    .unwrap();
    let table = format!("\"{schema}\".rows");
    store
        .pool()
        .get()
        .await
        .unwrap()
        .batch_execute(&format!("CREATE TABLE {table} (payload text NOT NULL)"))
        .await
        .unwrap();

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
    let handler = Rows {
        table: table.clone(),
        flaky_left: AtomicUsize::new(2),
    };
    let config = InboxConfig {
        namespace: Some("billing".into()),
        backoff: Duration::from_millis(10),
        ..InboxConfig::default()
    };
    let consumer = client
        .consumer(ConsumerConfig::new("g1", [topic]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let mut inbox = store.inbox(consumer, config.clone());
    for _ in 0..50 {
        inbox.step(&handler).await.unwrap();
        let s = inbox.summary();
        if s.handled + s.duplicates == 41 {
            break;
        }
    }
    assert_eq!(inbox.summary().handled, 31, "{:?}", inbox.summary());
    assert_eq!(inbox.summary().duplicates, 10, "{:?}", inbox.summary());
    assert_eq!(
        count(&store, &format!("SELECT count(*) FROM {table}")).await,
        31
    );
    assert_eq!(
        count(
            &store,
            &format!("SELECT count(DISTINCT payload) FROM {table}")
        )
        .await,
        31
    );
    assert_eq!(
        handler.flaky_left.load(Ordering::SeqCst),
        0,
        "flaky was not retried"
    );
    let stored = inbox.stored_positions().await.unwrap();
    assert_eq!(stored.len(), 2, "{stored:?}");

    // A new consumer group, from the earliest message: the inbox resumes from the database.
    let consumer = client
        .consumer(ConsumerConfig::new("g2", [topic]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let mut again = store.inbox(consumer, config.clone());
    for _ in 0..10 {
        again.step(&handler).await.unwrap();
    }
    assert_eq!(again.summary().handled, 0, "{:?}", again.summary());
    assert_eq!(
        count(&store, &format!("SELECT count(*) FROM {table}")).await,
        31
    );

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
        count(
            &store,
            &format!("SELECT count(*) FROM {table} WHERE payload = 'poison'")
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &store,
            &format!(
                "SELECT count(*) FROM \"{schema}\".dedup WHERE key = 'inbox:billing:k-poison'"
            )
        )
        .await,
        0
    );
}
