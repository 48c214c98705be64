//! Crash test on a real Pulsar standalone: the idempotent pipeline runs in a child process (this
//! test binary, re-run with `ONCEFLOW_CRASH_CHILD` set, entering [`crash_child`]) that is
//! SIGKILLed at random points, at least 20 times (`ONCEFLOW_CRASH_KILLS` for more), then runs to
//! the end. Pulsar (through the pulsar crate) has no transactions and onceflow does not rely on
//! broker dedup, so the output topic may hold an output more than once after a crash; read
//! through a dedup store (by its idempotency key) it holds every input exactly once, nothing
//! lost, and the side effect of every input, applied through the embedded dedup store shared by
//! all the runs, is recorded exactly once. The raw repeats are counted and printed.
//!
//! Runs when `ONCEFLOW_PULSAR_URL` is set (`tests/brokers/up.sh pulsar`, which also sets
//! `ONCEFLOW_PULSAR_ADMIN_URL`); `ONCEFLOW_REQUIRE_BROKERS=1` (set by `make test`) turns a
//! missing broker into a failure.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use onceflow_core::dedup::{ClaimOutcome, ClaimRequest, EmbeddedStore, KeyState, MemoryStore};
use onceflow_core::{
    BoxError, Client, ConsumerConfig, DedupStore, DedupStoreExt, EngineConfig, Message, Pipeline,
    PipelineConfig, PipelineMode, ProducerConfig, Record, StartFrom, TopicSpec,
};

const URL_VAR: &str = "ONCEFLOW_PULSAR_URL";
const CHILD_VAR: &str = "ONCEFLOW_CRASH_CHILD";
const INPUTS: usize = 500;
const PARTITIONS: u32 = 2;
/// Same consumer name and worker id in every run: a restarted child takes its partitions back
/// at once (the broker drops a killed consumer when its connection closes) and resumes its own
/// dedup claims instead of waiting for the dead one's lease to expire.
const MEMBER: &str = "crash-worker";

fn url() -> Option<String> {
    match std::env::var(URL_VAR) {
        Ok(u) if !u.is_empty() => {
            let sep = if u.contains('?') { '&' } else { '?' };
            Some(match std::env::var("ONCEFLOW_PULSAR_ADMIN_URL") {
                Ok(admin) if !u.contains("admin=") => format!("{u}{sep}admin={admin}"),
                _ => u,
            })
        }
        _ => {
            assert!(
                std::env::var("ONCEFLOW_REQUIRE_BROKERS").as_deref() != Ok("1"),
                "ONCEFLOW_REQUIRE_BROKERS=1 but {URL_VAR} is not set (tests/brokers/up.sh pulsar)"
            );
            let _ = writeln!(
                std::io::stderr(),
                "crash_pipeline: SKIPPED: {URL_VAR} is not set (start a broker with \
                 tests/brokers/up.sh pulsar)"
            );
            None
        }
    }
}

/// The child's side effect, applied once per input through the dedup store: the key
/// `effect:<input key>` completed with the output payload as its result.
struct Effectful {
    store: Arc<dyn DedupStore>,
    output: String,
}

#[async_trait]
impl onceflow_core::Transform for Effectful {
    async fn transform(&self, m: &Message) -> Result<Vec<Record>, BoxError> {
        let key = m
            .headers
            .get_str(onceflow_core::IDEMPOTENCY_KEY_HEADER)
            .ok_or("input without an idempotency key")?
            .to_string();
        let out = format!("out-{}", String::from_utf8_lossy(&m.payload));
        // Some work, so kills land mid-stream.
        tokio::time::sleep(Duration::from_millis(3)).await;
        let effect = format!("effect:{key}");
        match self
            .store
            .claim_one(ClaimRequest {
                key: effect.clone(),
                owner: MEMBER.to_string(),
                lease: Duration::from_secs(30),
                fingerprint: None,
            })
            .await?
        {
            ClaimOutcome::Claimed { token } => {
                self.store
                    .complete_one(&effect, token, Some(out.clone().into()))
                    .await?;
            }
            ClaimOutcome::Duplicate { .. } => {}
            other => return Err(format!("side effect {effect}: {other:?}").into()),
        }
        Ok(vec![Record::new(self.output.clone(), out)])
    }
}

/// The child: runs the pipeline until the group has committed every input, then exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_child() {
    let Ok(spec) = std::env::var(CHILD_VAR) else {
        return; // Only a child started by `pipeline_survives_sigkill_at_random_points` runs.
    };
    let [url, input, output, group, store_path]: [&str; 5] = spec
        .split('|')
        .collect::<Vec<_>>()
        .try_into()
        .expect("child spec");
    let store: Arc<dyn DedupStore> = Arc::new(
        EmbeddedStore::open(store_path, Duration::from_secs(3600))
            .await
            .expect("embedded store"),
    );
    let client = Client::new(onceflow_pulsar::connect(url).await.expect("connect"));
    let consumer = client
        .consumer(
            ConsumerConfig::new(group.to_string(), [input.to_string()])
                .start(StartFrom::committed_or_earliest())
                .client_id(MEMBER.to_string()),
        )
        .await
        .expect("consumer");
    let producer = client
        .producer(ProducerConfig::new())
        .await
        .expect("producer");
    let config = PipelineConfig {
        engine: EngineConfig {
            worker_id: MEMBER.to_string(),
            lease: Duration::from_secs(30),
            commit_interval: Duration::from_millis(50),
            poll_timeout: Duration::from_millis(100),
            batch_size: 32,
            ..EngineConfig::default()
        },
        mode: PipelineMode::Idempotent,
        ..PipelineConfig::default()
    };
    let pipeline = Pipeline::with_config(
        consumer.clone(),
        producer,
        Some(store.clone()),
        Arc::new(Effectful {
            store,
            output: output.to_string(),
        }),
        config,
    )
    .expect("pipeline");
    println!("\n@@started");
    let done = async move {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if consumer.assignment().len() < PARTITIONS as usize {
                continue;
            }
            if let Ok(lag) = consumer.lag().await {
                if lag.len() == PARTITIONS as usize && lag.iter().all(|l| l.messages == 0) {
                    return;
                }
            }
        }
    };
    pipeline.run_until(done).await.expect("pipeline run");
    println!("\n@@finished");
}

fn spawn_child(spec: &str) -> Child {
    Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_VAR, spec)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn child")
}

/// Waits until the child printed `word` (or exited); true if it did.
fn wait_for(child: &mut Child, lines: &mut impl Iterator<Item = String>, word: &str) -> bool {
    for line in lines.by_ref() {
        if line.trim() == format!("@@{word}") {
            return true;
        }
    }
    let _ = child.try_wait();
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_survives_sigkill_at_random_points() {
    let Some(url) = url() else { return };
    let kills: usize = std::env::var("ONCEFLOW_CRASH_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20)
        .max(20);
    let id = format!("{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff);
    let (input, output, group) = (
        format!("crash-in-{id}"),
        format!("crash-out-{id}"),
        format!("crash-g-{id}"),
    );
    let platform = onceflow_pulsar::connect(&url).await.unwrap();
    let client = Client::new(platform.clone());
    let admin = client.admin().await.unwrap();
    for t in [&input, &output] {
        admin
            .create_topic(&TopicSpec::new(t.clone(), PARTITIONS))
            .await
            .unwrap();
    }
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    let records: Vec<Record> = (0..INPUTS)
        .map(|i| {
            Record::new(input.clone(), format!("v{i}"))
                .key(format!("k{i}"))
                .idempotency_key(format!("in-{i}"))
        })
        .collect();
    for r in producer.send_batch(records).await {
        r.unwrap();
    }
    let dir: PathBuf = std::env::temp_dir().join(format!("onceflow-crash-{id}"));
    std::fs::create_dir_all(&dir).unwrap();
    let store_path = dir.join("dedup.db");
    let spec = format!(
        "{url}|{input}|{output}|{group}|{}",
        store_path.to_str().unwrap()
    );

    let started = Instant::now();
    let mut killed = 0;
    let mut finished_early = 0;
    while killed < kills {
        let mut child = spawn_child(&spec);
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines().map_while(Result::ok);
        assert!(
            wait_for(&mut child, &mut lines, "started"),
            "the child did not start"
        );
        // A random point: anywhere in connecting, claiming, transforming, publishing, acking.
        let delay = Duration::from_millis(50 + rand::random::<u64>() % 700);
        std::thread::sleep(delay);
        match child.try_wait().unwrap() {
            None => {
                child.kill().unwrap(); // SIGKILL
                child.wait().unwrap();
                killed += 1;
            }
            Some(status) => {
                assert!(status.success(), "child failed: {status}");
                finished_early += 1;
                // Everything was processed before this kill point: nothing left to crash.
                break;
            }
        }
    }
    // The last run goes to the end.
    let mut child = spawn_child(&spec);
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines().map_while(Result::ok);
    let finished = wait_for(&mut child, &mut lines, "finished");
    let status = child.wait().unwrap();
    assert!(finished && status.success(), "the final run: {status}");
    eprintln!(
        "crash_pipeline: {killed} SIGKILLs ({finished_early} runs finished first), {:?}",
        started.elapsed()
    );
    assert!(
        killed >= 20 || finished_early > 0,
        "only {killed} kills landed"
    );

    // The output topic, read from the start by a new group and through a dedup store keyed by
    // the outputs' idempotency keys (`{input key}:0`): every input once, nothing else.
    let reader = client
        .consumer(
            ConsumerConfig::new(format!("{group}-check"), [output.clone()])
                .start(StartFrom::Earliest),
        )
        .await
        .unwrap();
    let seen = MemoryStore::new(Duration::from_secs(3600), 1_000_000);
    let mut raw: HashMap<String, u32> = HashMap::new();
    let (mut firsts, mut repeats) = (0usize, 0usize);
    let mut quiet_since = Instant::now();
    let read_started = Instant::now();
    while quiet_since.elapsed() < Duration::from_secs(3) || firsts < INPUTS {
        assert!(
            read_started.elapsed() < Duration::from_secs(120),
            "reading the output took too long: {firsts} distinct outputs of {INPUTS}"
        );
        let got = reader.poll(500, Duration::from_millis(250)).await.unwrap();
        if got.is_empty() {
            continue;
        }
        quiet_since = Instant::now();
        for m in &got {
            let id = m
                .headers
                .get_str(onceflow_core::IDEMPOTENCY_KEY_HEADER)
                .expect("every output has an idempotency key")
                .to_string();
            *raw.entry(id.clone()).or_default() += 1;
            match seen
                .claim_one(ClaimRequest {
                    key: id.clone(),
                    owner: "checker".into(),
                    lease: Duration::from_secs(60),
                    fingerprint: None,
                })
                .await
                .unwrap()
            {
                ClaimOutcome::Claimed { token } => {
                    seen.complete_one(&id, token, None).await.unwrap();
                    firsts += 1;
                }
                _ => repeats += 1,
            }
        }
    }
    reader.close().await.unwrap();
    eprintln!(
        "crash_pipeline: output topic holds {} messages: {firsts} distinct, {repeats} repeats \
         (dropped by the dedup store on read)",
        firsts + repeats
    );
    for i in 0..INPUTS {
        assert!(
            raw.contains_key(&format!("in-{i}:0")),
            "output of in-{i} is missing"
        );
    }
    assert_eq!(
        firsts,
        INPUTS,
        "no other outputs: {:?}",
        raw.keys()
            .filter(|k| !k.starts_with("in-"))
            .collect::<Vec<_>>()
    );

    // The side effects, through the dedup store shared by every run: each applied once.
    let store = EmbeddedStore::open(&store_path, Duration::from_secs(3600))
        .await
        .unwrap();
    let keys: Vec<String> = (0..INPUTS).map(|i| format!("effect:in-{i}")).collect();
    let states = store.get(&keys).await.unwrap();
    for (i, (k, s)) in keys.iter().zip(states).enumerate() {
        match s {
            Some(KeyState::Completed { result, .. }) => assert_eq!(
                result.as_deref(),
                Some(format!("out-v{i}").as_bytes()),
                "{k}"
            ),
            other => panic!("side effect {k} not applied exactly once: {other:?}"),
        }
    }
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
    for t in [&input, &output] {
        let _ = admin.delete_topic(t).await;
    }
}
