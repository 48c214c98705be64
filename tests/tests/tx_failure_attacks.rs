//! Break-it attacks (helper h2, #27) on the transactional pipeline's commit of the inputs
//! finished before one whose transform failed for good (`TxLoop::commit_before`): a transform
//! failing at random, members joining and leaving (and dropped without a shutdown, as a crash
//! in-process would), `on_failure=stop` with restarts, with and without a dedup store. Every
//! input's output must be in the committed output exactly once.
//!
//! Ignored (minutes long): run by hand, one platform per test, with the knobs below:
//! `cargo test -p onceflow-conformance --test tx_failure_attacks -- --ignored --nocapture kafka`.
//!
//! Knobs (environment): `TA_INPUTS` (default 2000), `TA_PARTS` (input partitions, 4),
//! `TA_FAIL_PCT` (percent of transform calls failing, 5), `TA_MAX_ATTEMPTS` (1), `TA_BATCH`
//! (batch_size, 100), `TA_STORE` (`none`, `memory` or `embedded`; default none), `TA_STOP=1`
//! (on_failure=stop: each failure stops the member, which is started again), `TA_MEMBERS`
//! (members at once, 1), `TA_CHURN_MS` (0: members run to the end; else each runs a random
//! time up to this, then stops — every other one dropped without a shutdown — and a new one
//! takes its slot), `TA_TX_MS` (transaction_interval, 500), `TA_RUN_S` (longest run, 300),
//! `TA_PULSAR_OPTS` (added to the Pulsar URL besides `transactions=true`), `TA_CONSUMER_OPT`
//! (one `key=value` consumer option, e.g. librdkafka's `fetch.wait.max.ms=50`).

mod pulsar_harness;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use onceflow_conformance::harness::{
    env_harness, random_suffix, Harness, PlatformHarness, Timings,
};
use onceflow_core::dedup::{EmbeddedStore, MemoryStore};
use onceflow_core::{
    BoxError, Client, ConsumerConfig, DedupStore, EngineConfig, Message, OnFailure, Pipeline,
    PipelineConfig, ProducerConfig, Record, StartFrom,
};

fn knob<T: std::str::FromStr>(var: &str, default: T) -> T {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Flaky {
    out: String,
    fail_pct: u64,
    calls: AtomicU64,
    failures: AtomicU64,
    succeeded: Mutex<HashSet<String>>,
}

#[async_trait]
impl onceflow_core::Transform for Flaky {
    async fn transform(&self, m: &Message) -> Result<Vec<Record>, BoxError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if self.fail_pct > 0 && rand::random::<u64>() % 100 < self.fail_pct {
            self.failures.fetch_add(1, Ordering::Relaxed);
            return Err("h2: injected transform failure".into());
        }
        let v = String::from_utf8_lossy(&m.payload).to_string();
        self.succeeded.lock().unwrap().insert(v.clone());
        Ok(vec![Record::new(self.out.clone(), format!("out-{v}"))])
    }
}

#[derive(Default)]
struct Totals {
    committed: AtomicU64,
    aborted: AtomicU64,
    runs: AtomicU64,
    stops: AtomicU64,
    errors: AtomicU64,
}

async fn attack(h: &dyn Harness) {
    let inputs: usize = knob("TA_INPUTS", 2000);
    let parts: u32 = knob("TA_PARTS", 4);
    let fail_pct: u64 = knob("TA_FAIL_PCT", 5);
    let max_attempts: u32 = knob("TA_MAX_ATTEMPTS", 1);
    let batch: usize = knob("TA_BATCH", 100);
    let store_kind: String = knob("TA_STORE", "none".to_string());
    let stop = knob("TA_STOP", 0u8) == 1;
    let members: usize = knob("TA_MEMBERS", 1);
    let churn_ms: u64 = knob("TA_CHURN_MS", 0);
    let tx_ms: u64 = knob("TA_TX_MS", 500);
    let run_s: u64 = knob("TA_RUN_S", 300);

    let client = Client::new(h.platform());
    let input = h.topic(parts).await.unwrap();
    let output = h.topic(1).await.unwrap();
    let group = h.group();
    eprintln!(
        "attack: input {input} output {output} group {group} inputs {inputs} parts {parts} \
         fail {fail_pct}% max_attempts {max_attempts} batch {batch} store {store_kind} \
         stop {stop} members {members} churn {churn_ms} ms"
    );
    {
        let p = client.producer(ProducerConfig::new()).await.unwrap();
        let recs: Vec<Record> = (0..inputs)
            .map(|i| {
                Record::new(input.clone(), format!("v{i}"))
                    .key(format!("k{i}").into_bytes())
                    .header(onceflow_core::IDEMPOTENCY_KEY_HEADER, format!("k{i}"))
            })
            .collect();
        for r in p.send_batch(recs).await {
            r.unwrap();
        }
        p.flush(Duration::from_secs(30)).await.unwrap();
    }
    let store: Option<Arc<dyn DedupStore>> = match store_kind.as_str() {
        "memory" => Some(Arc::new(MemoryStore::new(
            Duration::from_secs(3600),
            1_000_000,
        ))),
        "embedded" => {
            let dir = tempfile::tempdir().unwrap().keep();
            Some(Arc::new(
                EmbeddedStore::open(dir.join("dedup.db"), Duration::from_secs(3600))
                    .await
                    .unwrap(),
            ))
        }
        _ => None,
    };
    let transform = Arc::new(Flaky {
        out: output.clone(),
        fail_pct,
        calls: AtomicU64::new(0),
        failures: AtomicU64::new(0),
        succeeded: Mutex::default(),
    });
    // The committed output, read all along.
    let seen: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let reading = Arc::new(AtomicBool::new(true));
    let reader = {
        let c = client
            .consumer(
                ConsumerConfig::new(format!("{group}-reader"), [output.clone()])
                    .start(StartFrom::Earliest),
            )
            .await
            .unwrap();
        let seen = seen.clone();
        let reading = reading.clone();
        tokio::spawn(async move {
            while reading.load(Ordering::SeqCst) {
                for m in c.poll(500, Duration::from_millis(300)).await.unwrap() {
                    *seen
                        .lock()
                        .unwrap()
                        .entry(String::from_utf8_lossy(&m.payload).to_string())
                        .or_default() += 1;
                }
            }
            let _ = c.close().await;
        })
    };
    let totals = Arc::new(Totals::default());
    let started = Instant::now();
    let done = Arc::new(AtomicBool::new(false));
    let mut slots = Vec::new();
    for slot in 0..members {
        let client = client.clone();
        let input = input.clone();
        let group = group.clone();
        let store = store.clone();
        let transform = transform.clone();
        let totals = totals.clone();
        let done = done.clone();
        let session = h.timings().session_timeout;
        let poll = h.timings().poll;
        let txid = format!("{group}-tx-{slot}");
        let consumer_opt: String = knob("TA_CONSUMER_OPT", String::new());
        slots.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !done.load(Ordering::SeqCst) {
                n += 1;
                totals.runs.fetch_add(1, Ordering::Relaxed);
                let mut cc = ConsumerConfig::new(group.clone(), [input.clone()])
                    .start(StartFrom::committed_or_earliest())
                    .session_timeout(session);
                if let Some((k, v)) = consumer_opt.split_once('=') {
                    cc = cc.option(k, v);
                }
                let con = match client.consumer(cc).await {
                    Ok(c) => c,
                    Err(e) => {
                        eprintln!("slot {slot}: consumer: {e}");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        continue;
                    }
                };
                let producer = match client
                    .producer(ProducerConfig {
                        transactional_id: Some(txid.clone()),
                        ..Default::default()
                    })
                    .await
                {
                    Ok(p) => p,
                    Err(e) => {
                        eprintln!("slot {slot}: producer: {e}");
                        let _ = con.close().await;
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        continue;
                    }
                };
                let config = PipelineConfig {
                    engine: EngineConfig {
                        worker_id: format!("{group}-w{slot}-{n}"),
                        max_attempts,
                        batch_size: batch,
                        min_backoff: Duration::from_millis(5),
                        max_backoff: Duration::from_millis(20),
                        redelivery_delay: Duration::from_millis(20),
                        commit_interval: Duration::from_millis(100),
                        poll_timeout: poll,
                        lease: Duration::from_secs(10),
                        on_failure: if stop {
                            OnFailure::Stop
                        } else {
                            OnFailure::Redeliver
                        },
                        ..EngineConfig::default()
                    },
                    transaction_interval: Duration::from_millis(tx_ms),
                    ..PipelineConfig::default()
                };
                let p = Pipeline::with_config(
                    con,
                    producer,
                    store.clone(),
                    transform.clone() as Arc<dyn onceflow_core::Transform>,
                    config,
                )
                .unwrap();
                let metrics = p.metrics();
                let life = if churn_ms > 0 {
                    Duration::from_millis(rand::random::<u64>() % churn_ms + churn_ms / 4)
                } else {
                    Duration::from_secs(3600)
                };
                let crash = churn_ms > 0 && n.is_multiple_of(2);
                let done2 = done.clone();
                let run = p.run_until(async move {
                    let t = Instant::now();
                    while !done2.load(Ordering::SeqCst) && t.elapsed() < life {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                });
                let r = if crash {
                    // Dropped mid-run, without a shutdown: no commit, no abort.
                    tokio::time::timeout(life, run).await.ok()
                } else {
                    Some(run.await)
                };
                let m = metrics.snapshot();
                totals
                    .committed
                    .fetch_add(m.transactions_committed, Ordering::Relaxed);
                totals
                    .aborted
                    .fetch_add(m.transactions_aborted, Ordering::Relaxed);
                match r {
                    None => eprintln!("slot {slot} run {n}: dropped (crash) after {life:?}: {m:?}"),
                    Some(Ok(_)) => {}
                    Some(Err(e)) => {
                        if stop && e.to_string().contains("injected transform failure") {
                            if knob("TA_VERBOSE", 0u8) == 1 {
                                eprintln!("slot {slot} run {n}: stopped: {m:?}");
                            }
                            totals.stops.fetch_add(1, Ordering::Relaxed);
                        } else {
                            totals.errors.fetch_add(1, Ordering::Relaxed);
                            eprintln!("slot {slot} run {n}: error {e}");
                            tokio::time::sleep(Duration::from_millis(300)).await;
                        }
                    }
                }
            }
        }));
    }
    // Until every input's output is committed once, or the time is up.
    let mut last = Instant::now();
    loop {
        let distinct = seen.lock().unwrap().len();
        if distinct >= inputs || started.elapsed() > Duration::from_secs(run_s) {
            break;
        }
        if last.elapsed() > Duration::from_secs(5) {
            last = Instant::now();
            eprintln!(
                "{:>5.1}s: {distinct} outputs, {} calls, {} failures, {} succeeded, runs {}, stops {}",
                started.elapsed().as_secs_f64(),
                transform.calls.load(Ordering::Relaxed),
                transform.failures.load(Ordering::Relaxed),
                transform.succeeded.lock().unwrap().len(),
                totals.runs.load(Ordering::Relaxed),
                totals.stops.load(Ordering::Relaxed),
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took = started.elapsed();
    done.store(true, Ordering::SeqCst);
    for s in slots {
        s.await.unwrap();
    }
    // Anything written twice shows within a few seconds of the last commit.
    tokio::time::sleep(Duration::from_secs(8)).await;
    reading.store(false, Ordering::SeqCst);
    reader.await.unwrap();
    let seen = seen.lock().unwrap().clone();
    let missing: Vec<usize> = (0..inputs)
        .filter(|i| !seen.contains_key(&format!("out-v{i}")))
        .collect();
    let twice: Vec<(&String, &u32)> = seen.iter().filter(|(_, n)| **n > 1).collect();
    let strays = seen.keys().filter(|k| !k.starts_with("out-v")).count();
    eprintln!(
        "RESULT inputs {inputs} outputs {} distinct {} lost {} duplicated {} strays {strays} \
         calls {} failures {} tx committed {} aborted {} runs {} stops {} errors {} in {:.1}s",
        seen.values().map(|n| *n as u64).sum::<u64>(),
        seen.len(),
        missing.len(),
        twice.len(),
        transform.calls.load(Ordering::Relaxed),
        transform.failures.load(Ordering::Relaxed),
        totals.committed.load(Ordering::Relaxed),
        totals.aborted.load(Ordering::Relaxed),
        totals.runs.load(Ordering::Relaxed),
        totals.stops.load(Ordering::Relaxed),
        totals.errors.load(Ordering::Relaxed),
        took.as_secs_f64(),
    );
    assert!(
        missing.is_empty(),
        "lost {} (first {:?})",
        missing.len(),
        &missing[..missing.len().min(20)]
    );
    assert!(
        twice.is_empty(),
        "duplicated {} (first {:?})",
        twice.len(),
        &twice[..twice.len().min(20)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "break-it harness (h2): minutes long, run by hand with the TA_* knobs"]
async fn kafka() {
    let h = env_harness(
        "ONCEFLOW_KAFKA_URL",
        "kafka",
        |url| Ok(onceflow_kafka::connect(url)?),
        "kafka://127.0.0.1:9",
    );
    attack(&h).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "break-it harness (h2): minutes long, run by hand with the TA_* knobs"]
async fn pulsar() {
    let opts: String = knob("TA_PULSAR_OPTS", String::new());
    let mut o = "transactions=true".to_string();
    if !opts.is_empty() {
        o = format!("{o}&{opts}");
    }
    let h = pulsar_harness::pulsar(&o).await;
    attack(&h).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "break-it harness (h2): run by hand with the TA_* knobs"]
async fn memory() {
    let name = format!("h2-{}", random_suffix());
    let platform = onceflow_memory::connect(&format!("memory://{name}")).expect("memory:// URL");
    let h = PlatformHarness::new(platform, Timings::in_process());
    attack(&h).await;
}
