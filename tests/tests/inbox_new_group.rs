//! The transactional inbox's identity in its database does not follow the consumer group: on a
//! real Kafka (`ONCEFLOW_KAFKA_URL`), an inbox with the default settings handles 100 keyed
//! messages, then a *new* consumer group with the default settings reads the same topic from
//! the earliest offset on the same database (PostgreSQL at `ONCEFLOW_POSTGRES_URL`, and the
//! embedded store): it handles none of the 100 again (it resumes after the stored positions),
//! a repeated key is a duplicate, and only the new messages are handled (#24).
//!
//! Before the fix the namespace defaulted to the group name, so the second group handled all
//! 100 again (the table held 200 rows).

mod redis_postgres;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use onceflow_core::dedup::EmbeddedStore;
use onceflow_core::inbox::{InboxConfig, InboxSummary, DEFAULT_NAMESPACE};
use onceflow_core::rusqlite::{Connection, Transaction as SqliteTx};
use onceflow_core::{
    BoxError, Client, ConsumerConfig, Message, ProducerConfig, Record, StartFrom, TopicSpec,
};
use onceflow_postgres::tokio_postgres::Transaction as PgTx;
use onceflow_postgres::{InboxHandler, PostgresStore};

const PARTITIONS: i32 = 3;
const FIRST: usize = 100;

struct PgRows(String);

#[async_trait]
impl InboxHandler for PgRows {
    async fn handle(&self, tx: &mut PgTx<'_>, m: &Message) -> Result<(), BoxError> {
        let key = String::from_utf8_lossy(&m.payload).into_owned();
        tx.execute(&format!("INSERT INTO {} (k) VALUES ($1)", self.0), &[&key])
            .await?;
        Ok(())
    }
}

fn sqlite_row(tx: &mut SqliteTx<'_>, m: &Message) -> Result<(), BoxError> {
    let key = String::from_utf8_lossy(&m.payload).into_owned();
    tx.execute("INSERT INTO rows (k) VALUES (?1)", [&key])?;
    Ok(())
}

/// A fresh topic on Kafka holding `FIRST` keyed messages spread over the partitions.
async fn topic_with_messages(client: &Client) -> String {
    let topic = format!("inbox-new-group-{}", redis_postgres::rand_hex());
    client
        .admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(&topic, PARTITIONS as u32))
        .await
        .unwrap();
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    let records: Vec<Record> = (0..FIRST)
        .map(|i| {
            Record::new(&topic, format!("p{i}"))
                .partition(i as i32 % PARTITIONS)
                .idempotency_key(format!("k{i}"))
        })
        .collect();
    for r in producer.send_batch(records).await {
        r.unwrap();
    }
    producer.close().await.unwrap();
    topic
}

/// After the first group: one new key per partition and one repeat of `k0`, so the second
/// group can be stepped until it reached the end of every partition (no timed wait).
async fn send_more(client: &Client, topic: &str) {
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    let mut records: Vec<Record> = (0..PARTITIONS)
        .map(|p| {
            Record::new(topic, format!("new{p}"))
                .partition(p)
                .idempotency_key(format!("new{p}"))
        })
        .collect();
    records.push(Record::new(topic, "p0").partition(1).idempotency_key("k0"));
    for r in producer.send_batch(records).await {
        r.unwrap();
    }
    producer.close().await.unwrap();
}

async fn consumer(client: &Client, topic: &str) -> onceflow_core::Consumer {
    let group = format!("inbox-new-group-{}", redis_postgres::rand_hex());
    client
        .consumer(ConsumerConfig::new(group, [topic.to_string()]).start(StartFrom::Earliest))
        .await
        .unwrap()
}

fn kafka() -> Option<Client> {
    let url = redis_postgres::service_url("ONCEFLOW_KAFKA_URL", "kafka")?;
    Some(Client::new(onceflow_kafka::connect(&url).unwrap()))
}

/// What the second group must have done: the 3 new keys handled, the repeat of `k0` a
/// duplicate, none of the first 100 handled.
fn check_second(s: &InboxSummary) {
    assert_eq!(s.handled, PARTITIONS as u64, "{s:?}");
    assert_eq!(s.duplicates, 1, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_new_group_with_the_default_namespace_handles_nothing_twice() {
    let Some(client) = kafka() else { return };
    let Some(pg) = redis_postgres::service_url("ONCEFLOW_POSTGRES_URL", "postgres") else {
        return;
    };
    let schema = format!("inbox_ng_{}", redis_postgres::rand_hex());
    let store = PostgresStore::open(
        &format!("{pg}?schema={schema}&pool_size=2"),
        Duration::from_secs(3600),
    )
    .await
    .unwrap();
    let table = format!("\"{schema}\".rows");
    let count = || async {
        let n: i64 = store
            .pool()
            .get()
            .await
            .unwrap()
            .query_one(&format!("SELECT count(*) FROM {table}"), &[])
            .await
            .unwrap()
            .get(0);
        n as usize
    };
    store
        .pool()
        .get()
        .await
        .unwrap()
        .batch_execute(&format!("CREATE TABLE {table} (k text NOT NULL)"))
        .await
        .unwrap();
    let topic = topic_with_messages(&client).await;
    let handler = PgRows(table.clone());

    let first_consumer = consumer(&client, &topic).await;
    let mut first = store.inbox(first_consumer, InboxConfig::default());
    assert_eq!(first.namespace(), DEFAULT_NAMESPACE);
    while first.summary().handled < FIRST as u64 {
        first.step(&handler).await.unwrap();
    }
    assert_eq!(count().await, FIRST);
    drop(first);

    send_more(&client, &topic).await;
    let second_consumer = consumer(&client, &topic).await;
    let mut second = store.inbox(second_consumer, InboxConfig::default());
    assert_eq!(second.namespace(), DEFAULT_NAMESPACE);
    // Stepped until the second group reached the last message of every partition.
    while second.summary().handled + second.summary().duplicates < PARTITIONS as u64 + 1 {
        second.step(&handler).await.unwrap();
    }
    check_second(second.summary());
    assert_eq!(count().await, FIRST + PARTITIONS as usize);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_a_new_group_with_the_default_namespace_handles_nothing_twice() {
    let Some(client) = kafka() else { return };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let store = EmbeddedStore::open(&path, Duration::from_secs(3600))
        .await
        .unwrap();
    Connection::open(&path)
        .unwrap()
        .execute_batch("CREATE TABLE rows (k TEXT NOT NULL)")
        .unwrap();
    let count = || -> usize {
        let n: i64 = Connection::open(&path)
            .unwrap()
            .query_row("SELECT count(*) FROM rows", [], |r| r.get(0))
            .unwrap();
        n as usize
    };
    let topic = topic_with_messages(&client).await;
    let handler = Arc::new(sqlite_row);

    let mut first = store
        .inbox(consumer(&client, &topic).await, InboxConfig::default())
        .await
        .unwrap();
    assert_eq!(first.namespace(), DEFAULT_NAMESPACE);
    while first.summary().handled < FIRST as u64 {
        first.step(&handler).await.unwrap();
    }
    assert_eq!(count(), FIRST);
    drop(first);

    send_more(&client, &topic).await;
    let mut second = store
        .inbox(consumer(&client, &topic).await, InboxConfig::default())
        .await
        .unwrap();
    while second.summary().handled + second.summary().duplicates < PARTITIONS as u64 + 1 {
        second.step(&handler).await.unwrap();
    }
    check_second(second.summary());
    assert_eq!(count(), FIRST + PARTITIONS as usize);
}
