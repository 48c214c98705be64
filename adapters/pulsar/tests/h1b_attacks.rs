//! Break-it attacks (helper h1, second pass, #27) on Pulsar transactions, real broker: a
//! transaction used after the coordinator timed it out (sends, acknowledgements, a drop), and
//! records at and past the size limit inside a transaction.

use std::time::{Duration, Instant};

use onceflow_core::{
    Client, Consumer, ConsumerConfig, Message, Producer, ProducerConfig, Record, StartFrom,
    TopicPartition,
};

mod common;
use common::{name, require};

fn url() -> Option<String> {
    let service = require("ONCEFLOW_PULSAR_URL")?;
    let admin = require("ONCEFLOW_PULSAR_ADMIN_URL")?;
    Some(format!("{service}?admin={admin}&transactions=true"))
}

fn text(m: &Message) -> String {
    String::from_utf8_lossy(&m.payload).into_owned()
}

async fn connect(url: &str) -> Client {
    Client::new(onceflow_pulsar::connect(url).await.unwrap())
}

async fn plain(client: &Client) -> Producer {
    client.producer(ProducerConfig::new()).await.unwrap()
}

async fn txn_producer(client: &Client, extra: ProducerConfig) -> Producer {
    client
        .producer(extra.transactional_id(name("h1b")))
        .await
        .unwrap()
}

/// Sends `end` with a plain producer, then reads `topic` from the earliest message as a new
/// group until `end` (60 s at most: a stalled topic fails here).
async fn read_to_end(client: &Client, topic: &str) -> Vec<String> {
    plain(client)
        .await
        .send(Record::new(topic, "end"))
        .await
        .unwrap();
    let c = client
        .consumer(ConsumerConfig::new(name("reader"), [topic]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut out: Vec<String> = Vec::new();
    while !out.iter().any(|t| t == "end") {
        assert!(
            Instant::now() < deadline,
            "end not read within 60 s: {out:?}"
        );
        out.extend(
            c.poll(100, Duration::from_millis(200))
                .await
                .unwrap()
                .iter()
                .map(|m| text(m).chars().take(40).collect::<String>()),
        );
    }
    c.close().await.unwrap();
    out
}

async fn poll_n(c: &Consumer, n: usize, secs: u64) -> Vec<Message> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut out = Vec::new();
    while out.len() < n && Instant::now() < deadline {
        out.extend(
            c.poll(n - out.len(), Duration::from_millis(200))
                .await
                .unwrap(),
        );
    }
    out
}

fn show<T: std::fmt::Debug>(what: &str, r: &onceflow_core::Result<T>, t0: Instant) {
    match r {
        Ok(v) => eprintln!("H1B {what}: Ok({v:?}) after {:?}", t0.elapsed()),
        Err(e) => eprintln!(
            "H1B {what}: Err kind={:?} retriable={} outcome_unknown={} after {:?}: {e}",
            e.kind(),
            e.is_retriable(),
            e.outcome_unknown(),
            t0.elapsed()
        ),
    }
}

/// A transaction timed out by the coordinator after one send, then used again: a second send
/// to the same topic, and a commit. Nothing of it may be read, the topic must not stall, and
/// the producer's next transaction must commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "h1 break-it harness (#27): run by hand with -- --ignored --nocapture"]
async fn h1b_send_after_timeout() {
    let Some(url) = url() else { return };
    let client = connect(&format!("{url}&transaction_timeout_ms=1000")).await;
    let topic = name("h1b-late");
    let producer = txn_producer(&client, ProducerConfig::new()).await;
    let mut t = producer.begin().await.unwrap();
    t.send(Record::new(&topic, "a")).await.unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let t0 = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(40), t.send(Record::new(&topic, "b"))).await;
    eprintln!(
        "H1B late send (same topic) returned after {:?}",
        t0.elapsed()
    );
    if let Ok(r) = &r {
        show("late send", r, t0);
    } else {
        eprintln!("H1B late send: HUNG 40 s");
    }
    let t0 = Instant::now();
    let c = t.commit().await;
    show("commit", &c, t0);
    // Next transaction on the same producer.
    let t0 = Instant::now();
    let next = tokio::time::timeout(Duration::from_secs(40), async {
        let mut t = producer.begin().await?;
        t.send(Record::new(&topic, "c")).await?;
        t.commit().await
    })
    .await;
    match &next {
        Ok(r) => show("next transaction", r, t0),
        Err(_) => eprintln!("H1B next transaction: HUNG 40 s"),
    }
    let out = read_to_end(&client, &topic).await;
    eprintln!("H1B read: {out:?}");
    assert!(
        !out.contains(&"a".to_string()),
        "a of the timed-out txn read: {out:?}"
    );
    assert!(
        !out.contains(&"b".to_string()),
        "b of the timed-out txn read: {out:?}"
    );
}

/// The first send of a transaction comes after its timeout (the partition is added to a
/// transaction the coordinator already aborted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "h1 break-it harness (#27): run by hand with -- --ignored --nocapture"]
async fn h1b_first_send_after_timeout() {
    let Some(url) = url() else { return };
    let client = connect(&format!("{url}&transaction_timeout_ms=1000")).await;
    let topic = name("h1b-first-late");
    let producer = txn_producer(&client, ProducerConfig::new()).await;
    let mut t = producer.begin().await.unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let t0 = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(40), t.send(Record::new(&topic, "a"))).await;
    match &r {
        Ok(r) => show("first send after timeout", r, t0),
        Err(_) => eprintln!("H1B first send after timeout: HUNG 40 s"),
    }
    let t0 = Instant::now();
    let c = t.commit().await;
    show("commit", &c, t0);
    let out = read_to_end(&client, &topic).await;
    eprintln!("H1B read: {out:?}");
    assert_eq!(out, vec!["end".to_string()]);
}

/// Acknowledgements made in a transaction after its timeout: the commit must fail and the
/// inputs must come again (to the member, after a rewind, or to a new member).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "h1 break-it harness (#27): run by hand with -- --ignored --nocapture"]
async fn h1b_ack_after_timeout() {
    let Some(url) = url() else { return };
    let client = connect(&format!("{url}&transaction_timeout_ms=1000")).await;
    let input = name("h1b-in");
    let output = name("h1b-out");
    let group = name("h1b-g");
    let p = plain(&client).await;
    for i in 0..5 {
        p.send(Record::new(&input, format!("in{i}"))).await.unwrap();
    }
    let c = client
        .consumer(ConsumerConfig::new(&group, [&input]))
        .await
        .unwrap();
    let got = poll_n(&c, 5, 30).await;
    assert_eq!(got.len(), 5);
    let producer = txn_producer(&client, ProducerConfig::new()).await;
    let mut t = producer.begin().await.unwrap();
    for m in &got {
        t.send(Record::new(&output, format!("out-{}", text(m))))
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    let last = got.last().unwrap();
    let pos: Vec<(TopicPartition, _)> = vec![(last.topic_partition(), last.position.clone())];
    let t0 = Instant::now();
    let r = t.commit_offsets(&c.group_metadata().unwrap(), &pos).await;
    show("commit_offsets after timeout", &r, t0);
    let t0 = Instant::now();
    let r = t.commit().await;
    show("commit", &r, t0);
    c.close().await.unwrap();
    let c2 = client
        .consumer(ConsumerConfig::new(&group, [&input]))
        .await
        .unwrap();
    let again = poll_n(&c2, 5, 20).await;
    eprintln!(
        "H1B new member got: {:?}",
        again.iter().map(text).collect::<Vec<_>>()
    );
    c2.close().await.unwrap();
    let out = read_to_end(&client, &output).await;
    eprintln!("H1B output read: {out:?}");
    assert_eq!(out, vec!["end".to_string()]);
    assert_eq!(
        again.len(),
        5,
        "inputs of the timed-out transaction come again"
    );
}

/// A batching transactional producer whose transaction times out while records wait in its
/// batch; then the transaction is dropped and a new one commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "h1 break-it harness (#27): run by hand with -- --ignored --nocapture"]
async fn h1b_batched_drop_after_timeout() {
    let Some(url) = url() else { return };
    let client = connect(&format!("{url}&transaction_timeout_ms=1000")).await;
    let topic = name("h1b-batch");
    let producer = txn_producer(
        &client,
        ProducerConfig::new()
            .option("batch_size", "100")
            .option("batch_timeout_ms", "100"),
    )
    .await;
    let mut t = producer.begin().await.unwrap();
    for i in 0..10 {
        t.send(Record::new(&topic, format!("x{i}"))).await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    for i in 10..20 {
        let t0 = Instant::now();
        let r = tokio::time::timeout(
            Duration::from_secs(20),
            t.send(Record::new(&topic, format!("x{i}"))),
        )
        .await;
        match &r {
            Ok(r) => {
                if i == 10 || r.is_err() {
                    show(&format!("send x{i}"), r, t0)
                }
            }
            Err(_) => eprintln!("H1B send x{i}: HUNG 20 s"),
        }
    }
    drop(t);
    let t0 = Instant::now();
    let next = tokio::time::timeout(Duration::from_secs(40), async {
        let mut t = producer.begin().await?;
        for i in 0..10 {
            t.send(Record::new(&topic, format!("y{i}"))).await?;
        }
        t.commit().await
    })
    .await;
    match &next {
        Ok(r) => show("next transaction", r, t0),
        Err(_) => eprintln!("H1B next transaction: HUNG 40 s"),
    }
    let out = read_to_end(&client, &topic).await;
    eprintln!("H1B read: {out:?}");
    assert!(out.iter().all(|v| !v.starts_with('x')), "{out:?}");
}

/// Records at and past the broker's size limit inside a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "h1 break-it harness (#27): run by hand with -- --ignored --nocapture"]
async fn h1b_huge_records_in_a_transaction() {
    let Some(url) = url() else { return };
    let client = connect(&url).await;
    let topic = name("h1b-huge");
    let producer = txn_producer(&client, ProducerConfig::new()).await;
    let mut t = producer.begin().await.unwrap();
    let max = 5 * 1024 * 1024 - 16 * 1024;
    let mut sizes = vec![max - 100, max, max + 1, 5 * 1024 * 1024, 6 * 1024 * 1024];
    sizes.dedup();
    for n in sizes {
        let mut payload = format!("huge-{n}-").into_bytes();
        payload.resize(n, b'z');
        let t0 = Instant::now();
        let r = tokio::time::timeout(
            Duration::from_secs(40),
            t.send(Record::new(&topic, payload).header("k", "v")),
        )
        .await;
        match &r {
            Ok(r) => show(&format!("send {n} bytes"), r, t0),
            Err(_) => eprintln!("H1B send {n} bytes: HUNG 40 s"),
        }
    }
    t.send(Record::new(&topic, "small")).await.unwrap();
    let t0 = Instant::now();
    let r = t.commit().await;
    show("commit", &r, t0);
    let out = read_to_end(&client, &topic).await;
    eprintln!("H1B read: {out:?}");
}

/// `out-<input>` to the topic it names, after sleeping `1` per input.
struct Slow(String, Duration);

#[async_trait::async_trait]
impl onceflow_core::Transform for Slow {
    async fn transform(
        &self,
        m: &Message,
    ) -> std::result::Result<Vec<Record>, onceflow_core::BoxError> {
        tokio::time::sleep(self.1).await;
        Ok(vec![Record::new(&self.0, format!("out-{}", text(m)))])
    }
}

/// A batching producer given records that fit the limit one by one but not together (two of
/// 3 MiB in one batch of the crate): plain, then in a transaction. Every send must end (a
/// delivery or an error), and what is delivered must be read once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "h1 break-it harness (#27): run by hand with -- --ignored --nocapture"]
async fn h1b_batch_of_records_over_the_limit_together() {
    let Some(url) = url() else { return };
    let client = connect(&url).await;
    let topic = name("h1b-bigbatch");
    let big = |tag: &str| {
        let mut p = format!("{tag}-").into_bytes();
        p.resize(3 * 1024 * 1024, b'y');
        Record::new(&topic, p)
    };
    let batching = ProducerConfig::new()
        .option("batch_size", "10")
        .option("batch_timeout_ms", "200");
    let plain_batching = client.producer(batching.clone()).await.unwrap();
    let t0 = Instant::now();
    let r = tokio::time::timeout(
        Duration::from_secs(60),
        plain_batching.send_batch(vec![big("p1"), big("p2"), Record::new(&topic, "p3")]),
    )
    .await;
    match r {
        Ok(v) => {
            for (i, d) in v.iter().enumerate() {
                show(&format!("plain batch record {i}"), d, t0);
            }
        }
        Err(_) => eprintln!("H1B plain batch: HUNG 60 s"),
    }
    let producer = txn_producer(&client, batching).await;
    let mut t = producer.begin().await.unwrap();
    let t0 = Instant::now();
    let r = tokio::time::timeout(
        Duration::from_secs(60),
        t.send_batch(vec![big("t1"), big("t2"), Record::new(&topic, "t3")]),
    )
    .await;
    match r {
        Ok(v) => {
            for (i, d) in v.iter().enumerate() {
                show(&format!("txn batch record {i}"), d, t0);
            }
        }
        Err(_) => eprintln!("H1B txn batch: HUNG 60 s"),
    }
    let t0 = Instant::now();
    let c = tokio::time::timeout(Duration::from_secs(60), t.commit()).await;
    match &c {
        Ok(r) => show("commit", r, t0),
        Err(_) => eprintln!("H1B commit: HUNG 60 s"),
    }
    let out = read_to_end(&client, &topic).await;
    eprintln!("H1B read: {out:?}");
}

/// The engine's transactional pipeline behind the fault proxy, the `END_TXN` requests of its
/// first commits held past the operation timeout (then delivered: the commit lands late),
/// without a dedup store: every input's output must be read once. Uses the shared fault port
/// (`ONCEFLOW_PULSAR_FAULT_URL`): not while another run uses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "h1 break-it harness (#27): run by hand with -- --ignored --nocapture"]
async fn h1b_pipeline_whose_commits_land_late_writes_each_output_once() {
    use onceflow_conformance::fault_proxy::{pulsar_command_type, Action, Direction, FaultProxy};
    use onceflow_core::{EngineConfig, Pipeline, PipelineConfig};
    const END_TXN: i32 = 56;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let Some(url) = url() else { return };
    let Some(service) = require("ONCEFLOW_PULSAR_FAULT_URL") else {
        return;
    };
    let upstream = require("ONCEFLOW_PULSAR_FAULT_UPSTREAM").unwrap();
    let admin = require("ONCEFLOW_PULSAR_ADMIN_URL").unwrap();
    let listen = service.trim_start_matches("pulsar://").to_string();
    let proxy = FaultProxy::start_when_free(&listen, &upstream, Duration::from_secs(30)).await;
    let fault_url = format!("{service}?admin={admin}&transactions=true");
    let direct = connect(&url).await;
    let behind = connect(&format!(
        "{fault_url}&operation_timeout_ms=3000&transaction_timeout_ms=20000"
    ))
    .await;
    let inputs: usize = std::env::var("H1B_INPUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    let held: u64 = std::env::var("H1B_HOLD_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4500);
    for round in 0..3usize {
        let input = name("h1b-late-in");
        let output = name("h1b-late-out");
        let group = name("h1b-late");
        let p = plain(&direct).await;
        for i in 0..inputs {
            p.send(Record::new(&input, format!("in{i}"))).await.unwrap();
        }
        proxy.clear();
        let fired = proxy.fired();
        for _ in 0..2 {
            proxy.once(
                Direction::ToBroker,
                |f| pulsar_command_type(f) == Some(END_TXN),
                Action::Delay(Duration::from_millis(held)),
            );
        }
        let consumer = behind
            .consumer(ConsumerConfig::new(&group, [&input]).start(StartFrom::Earliest))
            .await
            .unwrap();
        let pl = Pipeline::with_config(
            consumer,
            txn_producer(&behind, ProducerConfig::new()).await,
            None,
            std::sync::Arc::new(Slow(output.clone(), Duration::from_millis(1))),
            PipelineConfig {
                engine: EngineConfig {
                    commit_interval: Duration::from_millis(100),
                    batch_size: 5 + round * 3,
                    ..Default::default()
                },
                max_transaction_inputs: 10 + round * 7,
                transaction_interval: Duration::from_millis(100),
                ..Default::default()
            },
        )
        .unwrap();
        let m = pl.metrics();
        let started = Instant::now();
        let r = pl
            .run_until(async {
                let mut ended = (0, Instant::now());
                while Instant::now() < started + Duration::from_secs(90) {
                    let s = m.snapshot();
                    let now = s.transactions_committed + s.transactions_aborted;
                    if now != ended.0 {
                        ended = (now, Instant::now());
                    }
                    if s.processed >= inputs as u64 && ended.1.elapsed() > Duration::from_secs(8) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
            .await;
        eprintln!(
            "H1B round {round}: run {:?}; {:?} after {:?}; proxy fired {}",
            r.as_ref().map(|_| ()).map_err(|e| e.to_string()),
            m.snapshot(),
            started.elapsed(),
            proxy.fired() - fired
        );
        let read = read_to_end(&direct, &output).await;
        let mut got = read.clone();
        got.pop();
        let mut counts = std::collections::BTreeMap::new();
        for g in &got {
            *counts.entry(g.clone()).or_insert(0) += 1;
        }
        let dups: Vec<_> = counts.iter().filter(|(_, &c)| c > 1).collect();
        let missing: Vec<String> = (0..inputs)
            .map(|i| format!("out-in{i}"))
            .filter(|o| !counts.contains_key(o))
            .collect();
        eprintln!(
            "H1B round {round}: read {} dups {dups:?} missing {missing:?}",
            got.len()
        );
        assert!(dups.is_empty() && missing.is_empty(), "round {round}");
    }
}
