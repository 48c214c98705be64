//! The crash-test harness shared by the adapters' `crash_pipeline` tests: the idempotent
//! pipeline runs in a child process (the test binary re-run with [`CHILD_VAR`] set, entering
//! its `crash_child` test) that is SIGKILLed at random points, at least 20 times
//! (`ONCEFLOW_CRASH_KILLS` for more), then runs to the end. Each input's side effect is applied
//! through the embedded dedup store shared by every run; [`check_side_effects`] proves each was
//! applied exactly once. How the output topic is checked is the platform's own (its test).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use onceflow_core::dedup::{ClaimOutcome, ClaimRequest, EmbeddedStore, KeyState};
use onceflow_core::{
    BoxError, Client, ConsumerConfig, DedupStore, DedupStoreExt, EngineConfig, Message, Pipeline,
    PipelineConfig, PipelineMode, ProducerConfig, Record, StartFrom, TopicSpec,
};

/// Set in a child's environment: `url|input|output|group|store path`.
pub const CHILD_VAR: &str = "ONCEFLOW_CRASH_CHILD";
/// Inputs `in-0 … in-499` (payload `v{i}`, key `k{i}`, idempotency key `in-{i}`).
pub const INPUTS: usize = 500;
/// Partitions of the input and output topics.
pub const PARTITIONS: u32 = 2;
/// Same member and worker id in every run: a restarted child resumes its own group membership
/// and dedup claims instead of waiting for the dead one's session and lease to expire.
pub const MEMBER: &str = "crash-worker";

/// One crash test's names and files.
#[derive(Debug, Clone)]
pub struct CrashSpec {
    /// The platform URL.
    pub url: String,
    /// Input topic.
    pub input: String,
    /// Output topic.
    pub output: String,
    /// Consumer group.
    pub group: String,
    /// The embedded dedup store every run shares.
    pub store_path: PathBuf,
}

impl CrashSpec {
    /// Fresh names for a test on `url`, the store in a new temporary folder.
    pub fn new(url: &str) -> CrashSpec {
        let id = format!("{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff);
        let dir = std::env::temp_dir().join(format!("onceflow-crash-{id}"));
        std::fs::create_dir_all(&dir).unwrap();
        CrashSpec {
            url: url.to_string(),
            input: format!("crash-in-{id}"),
            output: format!("crash-out-{id}"),
            group: format!("crash-g-{id}"),
            store_path: dir.join("dedup.db"),
        }
    }

    /// The spec of this child process, `None` in the parent test run.
    pub fn from_env() -> Option<CrashSpec> {
        let spec = std::env::var(CHILD_VAR).ok()?;
        let [url, input, output, group, store_path]: [&str; 5] = spec
            .split('|')
            .collect::<Vec<_>>()
            .try_into()
            .expect("child spec");
        Some(CrashSpec {
            url: url.into(),
            input: input.into(),
            output: output.into(),
            group: group.into(),
            store_path: store_path.into(),
        })
    }

    fn to_env(&self) -> String {
        format!(
            "{}|{}|{}|{}|{}",
            self.url,
            self.input,
            self.output,
            self.group,
            self.store_path.display()
        )
    }

    /// Removes the store's folder and both topics.
    pub async fn clean_up(&self, client: &Client) {
        if let Some(dir) = self.store_path.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
        let admin = client.admin().await.unwrap();
        for t in [&self.input, &self.output] {
            let _ = admin.delete_topic(t).await;
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

/// The child's body: runs the idempotent pipeline (consumer `options` added to its config)
/// until the group has committed every input, printing `@@started` and `@@finished`.
pub async fn run_child(spec: &CrashSpec, client: Client, options: &[(&str, &str)]) {
    run_child_in(spec, client, options, PipelineMode::Idempotent).await
}

/// [`run_child`] with the pipeline in `mode`; `Transactional` gives the producer a
/// transactional id of the spec's group (the same in every child, as a restarted process has).
pub async fn run_child_in(
    spec: &CrashSpec,
    client: Client,
    options: &[(&str, &str)],
    mode: PipelineMode,
) {
    let store: Arc<dyn DedupStore> = Arc::new(
        EmbeddedStore::open(&spec.store_path, Duration::from_secs(3600))
            .await
            .expect("embedded store"),
    );
    let mut config = ConsumerConfig::new(spec.group.clone(), [spec.input.clone()])
        .start(StartFrom::committed_or_earliest())
        .client_id(MEMBER.to_string());
    for (k, v) in options {
        config = config.option(*k, *v);
    }
    let consumer = client.consumer(config).await.expect("consumer");
    let producer_config = match mode {
        PipelineMode::Transactional => {
            ProducerConfig::new().transactional_id(format!("{}-tx", spec.group))
        }
        _ => ProducerConfig::new(),
    };
    let producer = client.producer(producer_config).await.expect("producer");
    let config = PipelineConfig {
        engine: EngineConfig {
            worker_id: MEMBER.to_string(),
            lease: Duration::from_secs(30),
            commit_interval: Duration::from_millis(50),
            poll_timeout: Duration::from_millis(100),
            batch_size: 32,
            ..EngineConfig::default()
        },
        mode,
        ..PipelineConfig::default()
    };
    let pipeline = Pipeline::with_config(
        consumer.clone(),
        producer,
        Some(store.clone()),
        Arc::new(Effectful {
            store,
            output: spec.output.clone(),
        }),
        config,
    )
    .expect("pipeline");
    println!("\n@@started");
    let done = async move {
        let waiting = std::time::Instant::now();
        let mut told = Duration::ZERO;
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if consumer.assignment().len() < PARTITIONS as usize {
                continue;
            }
            if let Ok(lag) = consumer.lag().await {
                if lag.len() == PARTITIONS as usize && lag.iter().all(|l| l.messages == 0) {
                    return;
                }
                // Where a long run stands, for a run that never ends.
                if waiting.elapsed() >= told + Duration::from_secs(30) {
                    told = waiting.elapsed();
                    eprintln!(
                        "crash child: {} s, waiting for no lag: {lag:?}",
                        told.as_secs()
                    );
                }
            }
        }
    };
    pipeline.run_until(done).await.expect("pipeline run");
    println!("\n@@finished");
}

fn spawn_child(spec: &CrashSpec) -> Child {
    Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_VAR, spec.to_env())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn child")
}

/// Waits until the child printed `@@word` (or exited); true if it did.
/// How long the last, uninterrupted run may take before it counts as hung.
const FINAL_RUN_GUARD: Duration = Duration::from_secs(600);

fn wait_for(child: &mut Child, lines: &mut impl Iterator<Item = String>, word: &str) -> bool {
    for line in lines.by_ref() {
        if line.trim() == format!("@@{word}") {
            return true;
        }
    }
    let _ = child.try_wait();
    false
}

/// The parent's run: creates both topics (`topic` adjusts their specs), sends the inputs,
/// SIGKILLs children at random points at least 20 times, then lets a last child finish.
pub async fn kill_and_finish(spec: &CrashSpec, client: &Client, topic: impl Fn(&mut TopicSpec)) {
    let kills: usize = std::env::var("ONCEFLOW_CRASH_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20)
        .max(20);
    let admin = client.admin().await.unwrap();
    for t in [&spec.input, &spec.output] {
        let mut s = TopicSpec::new(t.clone(), PARTITIONS);
        topic(&mut s);
        admin.create_topic(&s).await.unwrap();
    }
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    let records: Vec<Record> = (0..INPUTS)
        .map(|i| {
            Record::new(spec.input.clone(), format!("v{i}"))
                .key(format!("k{i}"))
                .idempotency_key(format!("in-{i}"))
        })
        .collect();
    for r in producer.send_batch(records).await {
        r.unwrap();
    }

    let started = Instant::now();
    let mut killed = 0;
    let mut finished_early = 0;
    while killed < kills {
        let mut child = spawn_child(spec);
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
    // The last run goes to the end, SIGKILLed past a hang guard (its log says where it stood).
    let mut child = spawn_child(spec);
    let stdout = child.stdout.take().unwrap();
    let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let guard = {
        let (pid, ended) = (child.id().to_string(), ended.clone());
        std::thread::spawn(move || {
            let since = Instant::now();
            while since.elapsed() < FINAL_RUN_GUARD {
                if ended.load(std::sync::atomic::Ordering::SeqCst) {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            let _ = Command::new("kill").args(["-9", &pid]).status();
            true
        })
    };
    let mut lines = BufReader::new(stdout).lines().map_while(Result::ok);
    let finished = wait_for(&mut child, &mut lines, "finished");
    let status = child.wait().unwrap();
    ended.store(true, std::sync::atomic::Ordering::SeqCst);
    let hung = guard.join().unwrap();
    assert!(
        !hung,
        "the final run did not finish within {} s (its last lag is in the log)",
        FINAL_RUN_GUARD.as_secs()
    );
    assert!(finished && status.success(), "the final run: {status}");
    eprintln!(
        "crash_pipeline: {killed} SIGKILLs ({finished_early} runs finished first), {:?}",
        started.elapsed()
    );
    assert!(
        killed >= 20 || finished_early > 0,
        "only {killed} kills landed"
    );
}

/// The side effects, through the dedup store shared by every run: each input's applied once,
/// with its output payload as result.
pub async fn check_side_effects(store_path: &Path) {
    let store = EmbeddedStore::open(store_path, Duration::from_secs(3600))
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
}
