//! Network faults on single-node Pulsar and Kinesis (issue #28): every connection of the
//! producer reset in the middle of a batch of sends, then every connection of an idempotent
//! consumer reset while it acknowledges (Pulsar) or checkpoints (Kinesis, its lease table on
//! Redis behind a proxy too). The clients reach the broker through a fault proxy
//! (`tests/src/fault_proxy.rs`): Pulsar's `fault` listener advertises the proxy
//! (`ONCEFLOW_PULSAR_FAULT_URL`); Kinesis is one HTTP endpoint, so the proxy is its URL.
//!
//! A send that fails is sent again by the caller with the same idempotency key, so the topic
//! may hold a record twice where the platform has no producer deduplication that covers a
//! caller's resend (the figures print how many); through the dedup store every key's handler
//! must run exactly once: `FAULTS … lost=L duplicated=D` counts keys never handled and extra
//! handler runs.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use onceflow_conformance::fault_proxy::FaultProxy;
use onceflow_conformance::faults::{report, soak_minutes, Tally};
use onceflow_conformance::harness::{broker_url, random_suffix};
use onceflow_core::dedup::memory::MemoryStore;
use onceflow_core::{
    handler_fn, Client, ConsumerConfig, EngineConfig, IdempotentConsumer, Message, ProducerConfig,
    Record, StartFrom, TopicSpec,
};

const HANG_GUARD: Duration = Duration::from_secs(600);

/// One proxied platform.
struct Setup {
    direct: Client,
    behind: Client,
    /// Proxies whose connections a fault resets (the broker's, and Kinesis's lease table's).
    proxies: Vec<FaultProxy>,
    /// Partitions (Pulsar) or shards (Kinesis) of the topic.
    partitions: u32,
    /// Consumer options.
    consumer_options: Vec<(String, String)>,
    /// Whether the platform deduplicates a client's own resends (Pulsar: producer name +
    /// sequence id with broker deduplication on, as the test broker runs); then the topic may
    /// hold a second copy only of a record the caller itself sent again. Kinesis has none: a
    /// PutRecords whose answer was lost and that the client sends again is stored twice.
    producer_dedup: bool,
}

fn reset_all(proxies: &[FaultProxy]) {
    for p in proxies {
        p.cut_all();
    }
}

async fn run(test: &str, s: Setup) {
    let started = tokio::time::Instant::now();
    let rounds = match soak_minutes() {
        0 => 1,
        m => 2 * m as usize,
    };
    let keys = 1500 * rounds;
    let send_faults = 3 * rounds;
    let id = random_suffix();
    let topic = format!("faults-{id}");
    s.direct
        .admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(topic.clone(), s.partitions))
        .await
        .unwrap();

    // Sends in batches of 100 behind the proxy; every connection reset a few ms into some of
    // the batches. A failed send is sent again with the same idempotency key.
    let producer = s.behind.producer(ProducerConfig::new()).await.unwrap();
    let mut resent = 0usize;
    let mut injected = 0usize;
    let batches = keys / 100;
    let proxies = Arc::new(s.proxies);
    for b in 0..batches {
        let mut pending: Vec<usize> = (b * 100..(b + 1) * 100).collect();
        if b % (batches / send_faults).max(1) == 1 && injected < send_faults {
            injected += 1;
            let proxies = proxies.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(rand::random_range(1..15))).await;
                reset_all(&proxies);
            });
        }
        let mut attempts = 0;
        while !pending.is_empty() {
            attempts += 1;
            assert!(attempts < 50, "batch {b} still failing after 50 attempts");
            let records = pending
                .iter()
                .map(|i| {
                    Record::new(topic.clone(), format!("v{i}"))
                        .key(format!("k{i}"))
                        .idempotency_key(format!("k{i}"))
                })
                .collect();
            let results = producer.send_batch(records).await;
            let before = pending.len();
            pending = pending
                .into_iter()
                .zip(results)
                .filter_map(|(i, r)| r.is_err().then_some(i))
                .collect();
            if !pending.is_empty() {
                resent += pending.len();
                eprintln!(
                    "batch {b}: {} of {before} sends failed, sending again",
                    pending.len()
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    producer.close().await.unwrap();
    eprintln!(
        "[{:>4} s] {keys} sent, {injected} resets mid-batch, {resent} sends repeated by the caller",
        started.elapsed().as_secs()
    );

    // The idempotent consumer behind the proxy, with a memory dedup store; every connection
    // reset while it runs (it commits every 100 ms, so acks or checkpoints are under way).
    let runs: Arc<Mutex<BTreeMap<String, usize>>> = Arc::default();
    let group = format!("faults-g-{id}");
    let store = Arc::new(MemoryStore::new(Duration::from_secs(3600), 1_000_000));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let restarts = Arc::new(AtomicUsize::new(0));
    let running = {
        let (behind, topic, group, runs, restarts, options) = (
            s.behind.clone(),
            topic.clone(),
            group.clone(),
            runs.clone(),
            restarts.clone(),
            s.consumer_options.clone(),
        );
        tokio::spawn(async move {
            loop {
                let mut config = ConsumerConfig::new(group.clone(), [topic.clone()])
                    .start(StartFrom::committed_or_earliest());
                for (k, v) in &options {
                    config = config.option(k, v);
                }
                let consumer = behind.consumer(config).await.unwrap();
                let runs = runs.clone();
                let handler = handler_fn(move |m: Message| {
                    let runs = runs.clone();
                    async move {
                        let k = String::from_utf8_lossy(m.key.as_deref().unwrap_or_default())
                            .into_owned();
                        *runs.lock().unwrap().entry(k).or_default() += 1;
                        Ok(None)
                    }
                });
                let ic = IdempotentConsumer::with_config(
                    consumer,
                    Some(store.clone()),
                    Arc::new(handler),
                    EngineConfig {
                        commit_interval: Duration::from_millis(100),
                        batch_size: 100,
                        min_backoff: Duration::from_millis(20),
                        max_backoff: Duration::from_millis(500),
                        ..Default::default()
                    },
                    None,
                )
                .unwrap();
                let mut stopped = stopped.clone();
                match ic
                    .run_until(async move {
                        let _ = stopped.wait_for(|s| *s).await;
                    })
                    .await
                {
                    Ok(_) => return,
                    Err(e) => {
                        let n = restarts.fetch_add(1, Ordering::SeqCst) + 1;
                        eprintln!("consumer run {n} ended in an error, starting again: {e}");
                        tokio::time::sleep(Duration::from_millis(300)).await;
                    }
                }
            }
        })
    };
    let handled = || runs.lock().unwrap().len();
    let consume_faults = 3 * rounds;
    for k in 0..consume_faults {
        let at = keys * (k + 1) / (consume_faults + 1);
        while handled() < at {
            assert!(!running.is_finished(), "the consumer task ended early");
            assert!(
                started.elapsed() < HANG_GUARD,
                "stalled at {} of {keys}",
                handled()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        reset_all(&proxies);
        injected += 1;
        eprintln!(
            "[{:>4} s] reset {} while consuming, at {} keys handled",
            started.elapsed().as_secs(),
            k + 1,
            handled()
        );
    }
    while handled() < keys {
        assert!(!running.is_finished(), "the consumer task ended early");
        assert!(
            started.elapsed() < HANG_GUARD,
            "stalled at {} of {keys} after the faults",
            handled()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Redeliveries of the last acks or checkpoints lost come within a few seconds; all must be
    // skipped by the store.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _ = stop.send(true);
    running.await.unwrap();

    // The topic as stored, read directly by a plain consumer.
    let reader = s
        .direct
        .consumer(
            ConsumerConfig::new(format!("faults-reader-{id}"), [topic.clone()])
                .start(StartFrom::Earliest),
        )
        .await
        .unwrap();
    let mut stored: BTreeMap<String, usize> = BTreeMap::new();
    let mut idle = tokio::time::Instant::now();
    while idle.elapsed() < Duration::from_secs(5) {
        let batch = reader.poll(500, Duration::from_millis(300)).await.unwrap();
        if !batch.is_empty() {
            idle = tokio::time::Instant::now();
        }
        for m in batch {
            let k = String::from_utf8_lossy(m.key.as_deref().unwrap_or_default()).into_owned();
            *stored.entry(k).or_default() += 1;
        }
        if stored.len() == keys && stored.values().sum::<usize>() >= keys + resent {
            break;
        }
    }
    reader.close().await.unwrap();

    let expected: Vec<String> = (0..keys).map(|i| format!("k{i}")).collect();
    let handled_runs = runs.lock().unwrap().clone();
    let through_store = Tally::of(&expected, &handled_runs);
    let in_topic = Tally::of(&expected, &stored);
    let tally = Tally {
        lost: through_store.lost.max(in_topic.lost),
        duplicated: through_store.duplicated,
    };
    report(test, injected, tally);
    eprintln!(
        "{test}: {keys} keys, {injected} resets ({send_faults} mid-batch of sends, \
         {consume_faults} while consuming), {resent} sends repeated by the caller; the topic \
         holds {} records ({} copies beyond one per key: sends made again, by the caller or the \
         client's own retries, whose first answer was lost), {} lost from it; handler runs {} for {} keys, {} consumer runs \
         ended in an error, {} s",
        stored.values().sum::<usize>(),
        in_topic.duplicated,
        in_topic.lost,
        handled_runs.values().sum::<usize>(),
        handled_runs.len(),
        restarts.load(Ordering::SeqCst),
        started.elapsed().as_secs()
    );
    assert_eq!(
        tally,
        Tally::default(),
        "every key stored and handled once through the dedup store"
    );
    if s.producer_dedup {
        assert!(
            in_topic.duplicated <= resent,
            "{} copies in the topic beyond the caller's {resent} resends: the producer's own \
             resends must be deduplicated",
            in_topic.duplicated
        );
    }
}

/// The first free-standing proxy listening on `listen`, retried while an earlier test's proxy
/// still holds the port.
async fn proxy_on(listen: &str, upstream: &str) -> FaultProxy {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match FaultProxy::start(listen, upstream).await {
            Ok(p) => return p,
            Err(e) if tokio::time::Instant::now() < deadline => {
                eprintln!("fault proxy on {listen}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("fault proxy on {listen}: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulsar_resets_mid_batch_of_sends_and_of_acks_lose_and_duplicate_nothing() {
    const TEST: &str = "pulsar_resets_mid_batch_of_sends_and_of_acks_lose_and_duplicate_nothing";
    let url = match broker_url("ONCEFLOW_PULSAR_URL", "pulsar") {
        Ok(u) => u,
        Err(reason) => {
            eprintln!("SKIPPED {TEST}: {reason}");
            return;
        }
    };
    let fault_url = std::env::var("ONCEFLOW_PULSAR_FAULT_URL")
        .expect("ONCEFLOW_PULSAR_FAULT_URL (tests/brokers/up.sh pulsar prints it)");
    let upstream = std::env::var("ONCEFLOW_PULSAR_FAULT_UPSTREAM")
        .expect("ONCEFLOW_PULSAR_FAULT_UPSTREAM (tests/brokers/up.sh pulsar prints it)");
    // The admin URL goes with both (topics are created through it).
    let admin = std::env::var("ONCEFLOW_PULSAR_ADMIN_URL").ok();
    let with_admin = |u: &str| match &admin {
        Some(a) => format!("{u}?admin={a}"),
        None => u.to_string(),
    };
    let proxy = proxy_on(fault_url.trim_start_matches("pulsar://"), &upstream).await;
    let direct = Client::new(onceflow_pulsar::connect(&with_admin(&url)).await.unwrap());
    let behind = Client::new(
        onceflow_pulsar::connect(&with_admin(&fault_url))
            .await
            .unwrap(),
    );
    let setup = Setup {
        direct,
        behind,
        proxies: vec![proxy],
        partitions: 2,
        consumer_options: Vec::new(),
        producer_dedup: true,
    };
    tokio::time::timeout(HANG_GUARD, run(TEST, setup))
        .await
        .expect("hung");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kinesis_resets_mid_batch_of_sends_and_of_checkpoints_lose_and_duplicate_nothing() {
    const TEST: &str =
        "kinesis_resets_mid_batch_of_sends_and_of_checkpoints_lose_and_duplicate_nothing";
    let url = match broker_url("ONCEFLOW_KINESIS_URL", "kinesis") {
        Ok(u) => u,
        Err(reason) => {
            eprintln!("SKIPPED {TEST}: {reason}");
            return;
        }
    };
    let redis = match broker_url("ONCEFLOW_REDIS_URL", "redis") {
        Ok(u) => u,
        Err(reason) => {
            eprintln!("SKIPPED {TEST}: {reason}");
            return;
        }
    };
    // kinesis://host:port?..., redis://host:port[/...]
    let host_port = |u: &str| {
        let rest = u.split("://").nth(1).unwrap();
        let rest = rest.rsplit('@').next().unwrap();
        rest.split(['/', '?']).next().unwrap().to_string()
    };
    let kinesis = FaultProxy::start_raw("127.0.0.1:0", &host_port(&url))
        .await
        .unwrap();
    let lease_table = FaultProxy::start_raw("127.0.0.1:0", &host_port(&redis))
        .await
        .unwrap();
    let behind_url = url.replacen(&host_port(&url), &kinesis.addr().to_string(), 1);
    let table_url = format!(
        "{}?prefix=faults-{}:",
        redis.split('?').next().unwrap().replacen(
            &host_port(&redis),
            &lease_table.addr().to_string(),
            1
        ),
        random_suffix()
    );
    let table: String = url::form_urlencoded::byte_serialize(table_url.as_bytes()).collect();
    let sep = if behind_url.contains('?') { '&' } else { '?' };
    let behind_url = format!("{behind_url}{sep}idle_ms=100&checkpoint_store={table}");
    // Through the facade, which opens a redis:// lease table (onceflow-core alone does not).
    let direct = onceflow::connect(&url).await.unwrap();
    let behind = onceflow::connect(&behind_url).await.unwrap();
    let setup = Setup {
        direct,
        behind,
        proxies: vec![kinesis, lease_table],
        partitions: 2,
        consumer_options: Vec::new(),
        producer_dedup: false,
    };
    tokio::time::timeout(HANG_GUARD, run(TEST, setup))
        .await
        .expect("hung");
}
