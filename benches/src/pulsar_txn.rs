//! P2: onceflow's `Pipeline` A → B on Pulsar with transactions (`transactions=true`, PIP-31),
//! committing every 100 ms, against the same pipeline without transactions (at-least-once:
//! outputs acknowledged by the broker, then the inputs) and against a transaction loop written
//! with the official Apache Pulsar Java client (`benches/PulsarTxnLoop.java`), on the same
//! Pulsar standalone (`ONCEFLOW_PULSAR_URL`, default `pulsar://127.0.0.1:16650`, and
//! `ONCEFLOW_PULSAR_ADMIN_URL`, default `http://127.0.0.1:18080`; start it with
//! `tests/brokers/up.sh pulsar`, whose standalone has `transactionCoordinatorEnabled`).
//!
//! One input topic (non-partitioned) is filled once with `ONCEFLOW_BENCH_P2_MESSAGES` (default
//! 200 000) records of 100 B keyed `k0`…`k999`; every contender reads all of it through its own
//! new subscription (failover, from the earliest message) and writes each payload with its key
//! to a new output topic of its own. Producers batch up to 1000 messages or 5 ms on every side.
//! A contender's rate is N / wall time, from before its consumer subscribes to after its last
//! commit (the pipeline: `run_until` returned, the drain's commit and the consumer's close
//! included; the Java loop: its last `commit()` answered, the JVM's start and the client's close
//! not included), counted only when a reader of the output then finds N messages there (N or
//! more for at-least-once; a transactional run with any other count prints a `WARN` line).
//!
//! `ONCEFLOW_BENCH_P2_ROUNDS` rounds (default 3); the contender that runs first rotates between
//! rounds. The verdicts are the medians of the per-round ratios; the best rate of each side is
//! printed too. The Java loop is compiled with `javac` on first use into
//! `target/p2-java/` against the jars of `ONCEFLOW_PULSAR_JAVA_LIBS` (default: the Pulsar broker's
//! jars from Maven Central that `tests/brokers/pulsar/up.sh` caches, which hold
//! `pulsar-client-original`), and run with `java` (`ONCEFLOW_PULSAR_JAVA`, else `java` on PATH;
//! `javac` next to it). Without Java the ratio against it is printed as `n/a … MISS`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use onceflow_core::{
    BoxError, Client, ConsumerConfig, Message, Pipeline, PipelineConfig, PipelineMode,
    ProducerConfig, Record, StartFrom, Transform,
};

use crate::stats::median;

const SIZE: usize = 100;
const ROUNDS: usize = 3;

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n >= 1)
        .unwrap_or(default)
}

fn ratio(what: &str, value: Option<f64>, target: f64) {
    match value {
        Some(v) => println!(
            "RATIO P2 {what} {v:.3} target >={target} {}",
            if v >= target { "PASS" } else { "MISS" }
        ),
        None => println!("RATIO P2 {what} n/a target >={target} MISS"),
    }
}

fn name(prefix: &str) -> String {
    format!("{prefix}{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}

/// Runs P2.
pub fn run() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(p2());
}

/// The transform of every contender: the payload, keyed as the input.
struct Copy(String);

#[async_trait::async_trait]
impl Transform for Copy {
    async fn transform(&self, m: &Message) -> Result<Vec<Record>, BoxError> {
        let mut r = Record::new(self.0.clone(), m.payload.clone());
        if let Some(k) = &m.key {
            r = r.key(k.clone());
        }
        Ok(vec![r])
    }
}

/// The three contenders (`ONCEFLOW_BENCH_P2_SIDES` numbers them 0, 1, 2 in this order).
const SIDES: [&str; 3] = ["txn-pipeline", "at-least-once-pipeline", "java-txn-loop"];

async fn p2() {
    let url = std::env::var("ONCEFLOW_PULSAR_URL")
        .unwrap_or_else(|_| "pulsar://127.0.0.1:16650".to_string());
    let admin = std::env::var("ONCEFLOW_PULSAR_ADMIN_URL")
        .unwrap_or_else(|_| "http://127.0.0.1:18080".to_string());
    let sep = if url.contains('?') { '&' } else { '?' };
    // The producers' options on onceflow's URL (`ONCEFLOW_BENCH_P2_PRODUCER`, may be empty for
    // the crate's defaults).
    let producer_opts = std::env::var("ONCEFLOW_BENCH_P2_PRODUCER")
        .unwrap_or_else(|_| "batch_size=1000&batch_timeout_ms=5".to_string());
    let base = if producer_opts.is_empty() {
        format!("{url}{sep}admin={admin}")
    } else {
        format!("{url}{sep}admin={admin}&{producer_opts}")
    };
    eprintln!("[bench] P2: onceflow producer options '{producer_opts}'");
    let connect = |u: String| async move {
        onceflow_pulsar::connect(&u)
            .await
            .unwrap_or_else(|e| panic!("{u}: {e} (start one with tests/brokers/up.sh pulsar)"))
    };
    let plain = Client::new(connect(base.clone()).await);
    let txn = Client::new(connect(format!("{base}&transactions=true")).await);
    let n = env_usize("ONCEFLOW_BENCH_P2_MESSAGES", 200_000);
    let rounds = env_usize("ONCEFLOW_BENCH_P2_ROUNDS", ROUNDS);
    // `ONCEFLOW_BENCH_P2_SIDES=0,2` runs only those contenders (0 txn pipeline, 1 at-least-once
    // pipeline, 2 Java loop), for profiling one of them.
    let sides: Vec<usize> = std::env::var("ONCEFLOW_BENCH_P2_SIDES")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![0, 1, 2]);
    // The Java client takes the service URL alone (no onceflow options).
    let service_url = url.split('?').next().unwrap_or(&url).to_string();
    let java = java_loop();
    if let Err(why) = &java {
        eprintln!("[bench] P2: no Java loop: {why}");
    }

    let input = name("bench-p2-in-");
    let t = Instant::now();
    fill(&plain, &input, n).await;
    eprintln!(
        "[bench] P2: pulsar {url}, {n} x {SIZE} B in '{input}' ({:.1} s to fill), {rounds} rounds",
        t.elapsed().as_secs_f64()
    );

    let mut rates: Vec<[Option<f64>; 3]> = Vec::new();
    for round in 0..rounds {
        let mut got = [None; 3];
        for k in 0..3 {
            let side = (k + round) % 3;
            if !sides.contains(&side) {
                continue;
            }
            let load = load();
            let output = name("bench-p2-out-");
            let rate = match side {
                0 => pipeline(&txn, &input, &output, n, true).await,
                1 => pipeline(&plain, &input, &output, n, false).await,
                _ => match &java {
                    Ok(j) => j.run(&service_url, &input, &output, n).await,
                    Err(_) => None,
                },
            };
            let rate = match rate {
                Some(r) => verify(&plain, &output, n, side != 1).await.then_some(r),
                None => None,
            };
            eprintln!(
                "[bench] P2 round {round}: {} {} msg/s (load {load})",
                SIDES[side],
                rate.map(|r| format!("{r:.0}"))
                    .unwrap_or_else(|| "n/a".into())
            );
            got[side] = rate;
        }
        rates.push(got);
    }

    let best = |side: usize| {
        rates
            .iter()
            .filter_map(|r| r[side])
            .fold(None, |b: Option<f64>, r| Some(b.map_or(r, |b| b.max(r))))
    };
    let shown = |r: Option<f64>| r.map_or_else(|| "n/a".to_string(), |r| format!("{r:.0}"));
    println!(
        "P2: onceflow txn pipeline {} msg/s, at-least-once pipeline {} msg/s, Java txn loop {} \
         msg/s (best of {rounds}; {n} x {SIZE} B, commits every 100 ms)",
        shown(best(0)),
        shown(best(1)),
        shown(best(2))
    );
    for (i, r) in rates.iter().enumerate() {
        println!(
            "P2 round {i}: txn pipeline {}, at-least-once pipeline {}, Java txn loop {} msg/s",
            shown(r[0]),
            shown(r[1]),
            shown(r[2])
        );
    }
    // The median of the rounds' ratios (each ratio's two sides ran seconds apart).
    let paired = |other: usize| {
        let rs: Vec<f64> = rates
            .iter()
            .filter_map(|r| Some(r[0]? / r[other]?))
            .collect();
        (!rs.is_empty()).then(|| median(rs))
    };
    ratio("txn-pipeline-vs-at-least-once", paired(1), 0.85);
    ratio("txn-pipeline-vs-java-txn-loop", paired(2), 1.0);
    if let Ok(admin) = plain.admin().await {
        let _ = admin.delete_topic(&input).await;
    }
}

/// The machine's load average (1, 5, 15 min), as `uptime` shows it.
fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// Writes `n` records of [`SIZE`] bytes to `topic`, keyed `k0`…`k999`.
async fn fill(client: &Client, topic: &str, n: usize) {
    let p = client
        .producer(ProducerConfig::new())
        .await
        .expect("producer");
    let payload = bytes::Bytes::from(vec![b'x'; SIZE]);
    let mut sent = 0;
    while sent < n {
        let k = 10_000.min(n - sent);
        let batch: Vec<Record> = (sent..sent + k)
            .map(|i| Record::new(topic, payload.clone()).key(format!("k{}", i % 1000)))
            .collect();
        for r in p.send_batch(batch).await {
            r.expect("input");
        }
        sent += k;
    }
    p.close().await.ok();
}

/// One pipeline run over `input` into `output` with a new subscription; returns msg/s, or
/// `None` (with a `WARN` line) when it had not processed `n` inputs after
/// `ONCEFLOW_BENCH_P2_DEADLINE_S` (default 300).
/// `transactional`: transactions every 100 ms (no cap on inputs per transaction, as K4), else
/// the idempotent mode without a dedup store, which is at-least-once.
async fn pipeline(
    client: &Client,
    input: &str,
    output: &str,
    n: usize,
    transactional: bool,
) -> Option<f64> {
    let start = Instant::now();
    let consumer = client
        .consumer(
            ConsumerConfig::new(name("bench-p2-sub-"), [input.to_string()])
                .start(StartFrom::committed_or_earliest()),
        )
        .await
        .expect("consumer");
    let producer = if transactional {
        ProducerConfig::new().transactional_id(name("bench-p2-tx-"))
    } else {
        ProducerConfig::new()
    };
    let producer = client.producer(producer).await.expect("producer");
    let pipeline = Pipeline::with_config(
        consumer,
        producer,
        None,
        Arc::new(Copy(output.to_string())),
        PipelineConfig {
            mode: if transactional {
                PipelineMode::Transactional
            } else {
                PipelineMode::Idempotent
            },
            transaction_interval: Duration::from_millis(100),
            max_transaction_inputs: usize::MAX,
            ..PipelineConfig::default()
        },
    )
    .expect("pipeline");
    let metrics = pipeline.metrics();
    let target = n as u64;
    let deadline = Duration::from_secs(env_usize("ONCEFLOW_BENCH_P2_DEADLINE_S", 300) as u64);
    let run = pipeline.run_until(async move {
        // Progress every 10 s, so that a stalled run says where it stands.
        let mut shown = Instant::now();
        loop {
            let m = metrics.snapshot();
            if m.processed >= target {
                break;
            }
            if start.elapsed() >= deadline {
                eprintln!(
                    "[bench] P2 pipeline: stopped at the deadline ({} s), {} of {target} \
                         processed, {} transactions committed, {} aborted",
                    deadline.as_secs(),
                    m.processed,
                    m.transactions_committed,
                    m.transactions_aborted
                );
                break;
            }
            if shown.elapsed() >= Duration::from_secs(10) {
                shown = Instant::now();
                eprintln!(
                    "[bench] P2 pipeline: {} consumed, {} processed, {} transactions \
                         committed, {} aborted",
                    m.consumed, m.processed, m.transactions_committed, m.transactions_aborted
                );
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
    // The drain may wait on a stalled commit too.
    let summary = match tokio::time::timeout(deadline + Duration::from_secs(60), run).await {
        Ok(r) => r.expect("pipeline run"),
        Err(_) => {
            println!("WARN P2 pipeline did not stop within 60 s of its deadline");
            return None;
        }
    };
    let elapsed = start.elapsed();
    let m = &summary.metrics;
    eprintln!(
        "[bench] P2 {} pipeline: {} processed, {} produced, {} transactions committed, {} \
         aborted, {} commits, {:.3} s",
        if transactional {
            "txn"
        } else {
            "at-least-once"
        },
        m.processed,
        m.produced,
        m.transactions_committed,
        m.transactions_aborted,
        m.commits,
        elapsed.as_secs_f64()
    );
    if m.processed < target {
        println!(
            "WARN P2 {} pipeline: {} of {n} inputs in {:.0} s ({:.0} msg/s), stopped at \
             ONCEFLOW_BENCH_P2_DEADLINE_S",
            if transactional {
                "txn"
            } else {
                "at-least-once"
            },
            m.processed,
            elapsed.as_secs_f64(),
            m.processed as f64 / elapsed.as_secs_f64()
        );
        return None;
    }
    Some(n as f64 / elapsed.as_secs_f64())
}

/// Reads `topic` from the earliest message and says whether it holds `n` messages (`exact`),
/// or at least `n`; prints a `WARN` line otherwise.
async fn verify(client: &Client, topic: &str, n: usize, exact: bool) -> bool {
    let c = client
        .consumer(
            ConsumerConfig::new(name("bench-p2-check-"), [topic.to_string()])
                .start(StartFrom::Earliest),
        )
        .await
        .expect("check consumer");
    let mut got = 0;
    loop {
        // A short wait once all are in: only extra copies would still come.
        let wait = if got >= n {
            Duration::from_millis(500)
        } else {
            Duration::from_secs(5)
        };
        let msgs = c.poll(1000, wait).await.expect("check poll");
        if msgs.is_empty() {
            break;
        }
        got += msgs.len();
    }
    c.close().await.ok();
    if let Ok(admin) = client.admin().await {
        let _ = admin.delete_topic(topic).await;
    }
    let ok = if exact { got == n } else { got >= n };
    if !ok {
        println!(
            "WARN P2 output '{topic}' holds {got} messages, expected {}{n}",
            if exact { "" } else { ">= " }
        );
    }
    ok
}

/// The compiled Java loop and how to run it.
struct JavaLoop {
    java: PathBuf,
    classpath: String,
}

/// Compiles `benches/PulsarTxnLoop.java` into `target/p2-java` when the class is missing or
/// older than the source.
fn java_loop() -> Result<JavaLoop, String> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let libs = match std::env::var_os("ONCEFLOW_PULSAR_JAVA_LIBS") {
        Some(l) => PathBuf::from(l),
        None => std::env::var_os("ONCEFLOW_CACHE_DIR")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/onceflow")))
            .ok_or("neither ONCEFLOW_PULSAR_JAVA_LIBS nor HOME is set")?
            .join("pulsar/libs"),
    };
    let has_client = std::fs::read_dir(&libs)
        .map_err(|e| format!("{}: {e}", libs.display()))?
        .filter_map(|e| e.ok())
        .any(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("pulsar-client-original-")
        });
    if !has_client {
        return Err(format!(
            "{}: no pulsar-client-original jar (run tests/brokers/up.sh pulsar)",
            libs.display()
        ));
    }
    let java = std::env::var_os("ONCEFLOW_PULSAR_JAVA")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("java"));
    let javac = match java.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.join("javac"),
        _ => PathBuf::from("javac"),
    };
    let src = repo.join("benches/PulsarTxnLoop.java");
    let classes = repo.join("target/p2-java");
    let class = classes.join("PulsarTxnLoop.class");
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    if modified(&class).is_none() || modified(&class) < modified(&src) {
        let out = std::process::Command::new(&javac)
            .arg("-cp")
            .arg(libs.join("*"))
            .arg("-d")
            .arg(&classes)
            .arg(&src)
            .output()
            .map_err(|e| format!("{}: {e}", javac.display()))?;
        if !out.status.success() {
            return Err(format!(
                "javac {}: {}",
                src.display(),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
    Ok(JavaLoop {
        java,
        classpath: format!("{}:{}", classes.display(), libs.join("*").display()),
    })
}

impl JavaLoop {
    /// Runs the loop over `input` into `output` with a new subscription; its msg/s.
    async fn run(&self, url: &str, input: &str, output: &str, n: usize) -> Option<f64> {
        let mut cmd = std::process::Command::new(&self.java);
        cmd.arg("-cp")
            .arg(&self.classpath)
            .arg("PulsarTxnLoop")
            .args([url, input, output, &name("bench-p2-java-"), &n.to_string()]);
        let out = tokio::task::spawn_blocking(move || cmd.output())
            .await
            .ok()?
            .ok()?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            eprintln!("[bench] P2 Java loop failed: {stderr}");
            return None;
        }
        if let Some(line) = stderr
            .lines()
            .rev()
            .find(|l| l.starts_with("java txn loop"))
        {
            eprintln!("[bench] P2 {line}");
        }
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()?
            .trim()
            .parse()
            .ok()
    }
}
