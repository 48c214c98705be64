//! A Kinesis consumer group across processes, on a real Kinesis-compatible server
//! (`tests/brokers/up.sh kinesis`): three worker processes (this test binary re-run in worker
//! mode) run onceflow's idempotent consumer over one stream of six shards, sharing a lease table
//! (embedded checkpoint store) and a dedup store (embedded), both files on this machine. The
//! leases spread two shards per worker. One worker is SIGKILLed while it handles records; after
//! its leases expire (1.5 s) the two others take its shards over and finish its records. The
//! side effects counted through the dedup store are exact: every record's key is completed
//! exactly once, by one worker; a handler that ran again did so only for a record the killed
//! worker had in flight.
//!
//! Runs when `ONCEFLOW_KINESIS_URL` is set; without it the test says it skipped, and with
//! `ONCEFLOW_REQUIRE_BROKERS=1` (`make test`) that is a failure.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use onceflow_conformance::harness::broker_url;
use onceflow_core::checkpoint::{CheckpointStore, EmbeddedCheckpointStore};
use onceflow_core::dedup::{DedupStore, EmbeddedStore, KeyState};
use onceflow_core::{
    handler_fn, Client, ConsumerConfig, EngineConfig, IdempotentConsumer, ProducerConfig, Record,
    StartFrom, TopicSpec,
};

const CHILD_ENV: &str = "ONCEFLOW_KINESIS_GROUP_CHILD";
const SHARDS: u32 = 6;
const RECORDS: usize = 600;
const LEASE_MS: u64 = 1500;

fn url() -> Option<String> {
    match broker_url("ONCEFLOW_KINESIS_URL", "kinesis") {
        Ok(u) => Some(u),
        Err(reason) => {
            eprintln!("group_kinesis: SKIPPED: {reason}");
            None
        }
    }
}

fn platform_url(url: &str, leases: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}lease_ms={LEASE_MS}&idle_ms=100&checkpoint_store={leases}")
}

/// Worker mode: `CHILD_ENV` = `stream|group|leases.db|dedup.db|log|worker`.
async fn worker(spec: &str) {
    let parts: Vec<&str> = spec.split('|').collect();
    let [stream, group, leases, dedup, log, me] = parts[..] else {
        panic!("bad {CHILD_ENV}: {spec}")
    };
    let url = url().expect("worker needs the URL");
    let client = Client::new(
        onceflow_kinesis::connect(&platform_url(&url, leases))
            .await
            .unwrap(),
    );
    let consumer = client
        .consumer(
            ConsumerConfig::new(group, [stream])
                .start(StartFrom::committed_or_earliest())
                .client_id(me),
        )
        .await
        .unwrap();
    let store: Arc<dyn DedupStore> = Arc::new(
        EmbeddedStore::open(dedup, Duration::from_secs(3600))
            .await
            .unwrap(),
    );
    let log = Arc::new(std::sync::Mutex::new(
        std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(log)
            .unwrap(),
    ));
    let me2 = me.to_string();
    let handler = handler_fn(move |m: onceflow_core::Message| {
        let (log, me) = (log.clone(), me2.clone());
        async move {
            let key = m
                .headers
                .get_str("idempotency-key")
                .unwrap_or("?")
                .to_string();
            // The side effect: one line per handler run, written before the key completes.
            // One write(2) per line: the three worker processes append to one file, and
            // `writeln!` on a `File` writes the pieces of its format one call at a time, so
            // lines of different processes interleaved.
            let line = format!("{key} {me}\n");
            log.lock().unwrap().write_all(line.as_bytes()).unwrap();
            tokio::time::sleep(Duration::from_millis(5)).await;
            Ok(Some(bytes::Bytes::from(me)))
        }
    });
    let config = EngineConfig {
        worker_id: me.to_string(),
        lease: Duration::from_secs(3),
        batch_size: 20,
        commit_interval: Duration::from_millis(200),
        ..Default::default()
    };
    let ic =
        IdempotentConsumer::with_config(consumer, Some(store), Arc::new(handler), config, None)
            .unwrap();
    println!("WORKER_READY {me}");
    ic.run().await.unwrap();
}

/// Kills the workers this test started when it ends, passing or not.
struct Workers(Vec<Option<Child>>);

impl Drop for Workers {
    fn drop(&mut self) {
        for c in self.0.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn spawn_worker(spec: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "three_workers_one_killed_side_effects_exact",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, spec)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn a worker")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_workers_one_killed_side_effects_exact() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        return worker(&spec).await;
    }
    let Some(url) = url() else { return };
    let dir = tempfile::tempdir().unwrap();
    let leases = dir.path().join("leases.db").display().to_string();
    let dedup = dir.path().join("dedup.db").display().to_string();
    let log = dir.path().join("effects.log").display().to_string();
    let stream = format!("group-{:016x}", rand::random::<u64>());
    let group = format!("app-{:08x}", rand::random::<u32>());
    let client = Client::new(
        onceflow_kinesis::connect(&platform_url(&url, &leases))
            .await
            .unwrap(),
    );
    client
        .admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(stream.clone(), SHARDS))
        .await
        .unwrap();
    let producer = client.producer(ProducerConfig::default()).await.unwrap();
    let produce = |from: usize, to: usize| {
        let (producer, stream) = (producer.clone(), stream.clone());
        async move {
            let records: Vec<Record> = (from..to)
                .map(|i| {
                    Record::new(stream.clone(), format!("payload-{i}"))
                        .key(format!("pk-{i}"))
                        .idempotency_key(format!("rec-{i}"))
                })
                .collect();
            for r in producer.send_batch(records).await {
                r.expect("send");
            }
        }
    };
    produce(0, RECORDS / 2).await;

    let names = ["w0", "w1", "w2"];
    let mut children = Workers(
        names
            .iter()
            .map(|w| {
                Some(spawn_worker(&format!(
                    "{stream}|{group}|{leases}|{dedup}|{log}|{w}"
                )))
            })
            .collect(),
    );
    let table = format!("{group}/{stream}");
    let lease_store = EmbeddedCheckpointStore::open(&leases).await.unwrap();
    let owners = |ls: &[onceflow_core::checkpoint::Lease]| {
        let mut m: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for l in ls.iter().filter(|l| !l.is_available()) {
            m.entry(l.owner.clone().unwrap())
                .or_default()
                .push(l.key.clone());
        }
        m
    };
    // The six shards spread two per worker.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let spread = loop {
        let o = owners(&lease_store.list(&table).await.unwrap());
        if o.len() == 3 && o.values().all(|s| s.len() == 2) {
            break o;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "leases never spread evenly: {o:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // Kill w0 while it is handling records.
    produce(RECORDS / 2, RECORDS * 3 / 4).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut victim = children.0[0].take().unwrap();
    victim.kill().expect("SIGKILL w0");
    victim.wait().unwrap();
    produce(RECORDS * 3 / 4, RECORDS).await;

    let dedup_store = EmbeddedStore::open(&dedup, Duration::from_secs(3600))
        .await
        .unwrap();
    // The engine keeps keys under its namespace, the consumer group.
    let keys: Vec<String> = (0..RECORDS).map(|i| format!("{group}/rec-{i}")).collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    let states = loop {
        let states = dedup_store.get(&keys).await.unwrap();
        let done = states
            .iter()
            .filter(|s| matches!(s, Some(KeyState::Completed { .. })))
            .count();
        if done == RECORDS {
            break states;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{done} of {RECORDS} keys completed"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // w0's shards moved to the survivors.
    let after = owners(&lease_store.list(&table).await.unwrap());
    for s in &spread["w0"] {
        let holder = after
            .iter()
            .find(|(_, shards)| shards.contains(s))
            .map(|(o, _)| o.clone());
        assert!(
            matches!(holder.as_deref(), Some("w1" | "w2")),
            "{s} of the killed worker is held by {holder:?}: {after:?}"
        );
    }
    drop(children);

    // Exact side effects through the dedup store: each key completed once, by one worker.
    let mut completed_by: HashMap<String, usize> = HashMap::new();
    for s in &states {
        match s {
            Some(KeyState::Completed {
                result: Some(by), ..
            }) => {
                *completed_by
                    .entry(String::from_utf8(by.to_vec()).unwrap())
                    .or_default() += 1
            }
            other => panic!("not completed with its worker: {other:?}"),
        }
    }
    assert_eq!(completed_by.values().sum::<usize>(), RECORDS);
    assert!(
        completed_by.get("w1").copied().unwrap_or(0) > 0
            && completed_by.get("w2").copied().unwrap_or(0) > 0,
        "{completed_by:?}"
    );
    // Handler runs: every key at least once; a key ran twice only if w0 ran it first (it was
    // in flight when w0 died).
    let text = std::fs::read_to_string(&log).unwrap();
    let mut runs: HashMap<&str, Vec<&str>> = HashMap::new();
    for line in text.lines() {
        let (k, w) = line.split_once(' ').unwrap();
        runs.entry(k).or_default().push(w);
    }
    assert_eq!(runs.len(), RECORDS, "a key never ran");
    let again: Vec<_> = runs.iter().filter(|(_, w)| w.len() > 1).collect();
    for (k, ws) in &again {
        assert_eq!(ws[0], "w0", "{k} ran twice without w0 dying: {ws:?}");
    }
    eprintln!(
        "group_kinesis: {RECORDS} keys completed exactly once ({completed_by:?}); {} handler \
         re-runs, all of w0's in-flight records",
        again.len()
    );
    let _ = client.admin().await.unwrap().delete_topic(&stream).await;
}
