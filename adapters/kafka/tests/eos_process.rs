//! The exactly-once pipeline (topic A → transform → topic B) on a real broker, run as child
//! **processes** that die for real:
//!
//! - `sigkill_at_random_points_keeps_exactly_once`: the pipeline process is SIGKILLed at random
//!   points while input keeps arriving (20 kills; `ONCEFLOW_CRASH_KILLS=100` for the long run)
//!   and restarted each time; a read_committed reader of B then sees every input exactly once.
//!   `ONCEFLOW_CRASH_FAIL_PCT=N`: the transform also fails N % of its calls (`max_attempts=1`).
//! - `second_process_joins_and_first_leaves_exactly_once`: a second pipeline process joins the
//!   group mid-stream, then the first leaves; B holds every input exactly once.
//! - `removed_worker_cannot_commit_its_open_transaction`: a worker that stops polling while its
//!   transaction is open is removed from the group; its commit is fenced (KIP-447 group
//!   fencing, counted in `fenced`), the transaction is aborted and its outputs never show.
//!   (The conformance case `tx_removed_member_cannot_commit_offsets` checks the same on the
//!   transaction API: the commit fails with `ErrorKind::Fenced`.)
//!
//! The child process is this test binary itself, started with `ONCEFLOW_EOS_CHILD` set and
//! filtered to `eos_child_process`, which then runs the pipeline instead of returning: no
//! extra binary to build or find. Restarts are fast because the crash-test worker uses static
//! group membership (`group.instance.id`, KIP-345): the restarted process takes its
//! predecessor's partitions back at once instead of waiting for the session timeout, and
//! reuses its `transactional.id`, so `init_transactions` fences the killed process and aborts
//! its open transaction (KIP-98).
//!
//! Runs when `ONCEFLOW_KAFKA_URL` is set (`tests/brokers/up.sh kafka`); without it each test
//! says it skipped, and with `ONCEFLOW_REQUIRE_BROKERS=1` (`make test`) that is a failure.

mod common;

use common::{name, url};
use std::collections::HashMap;
use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use onceflow_core::{
    BoxError, Client, ConsumerConfig, Message, Pipeline, PipelineConfig, ProducerConfig, Record,
    StartFrom, TopicSpec, Transform,
};
use rand::Rng;

/// Set in a child process: the pipeline's settings, tab-separated (see [`ChildSpec`]).
const CHILD_VAR: &str = "ONCEFLOW_EOS_CHILD";
const CHILD_TEST: &str = "eos_child_process";

/// What a child pipeline process runs.
#[derive(Clone, Debug)]
struct ChildSpec {
    url: String,
    input: String,
    output: String,
    group: String,
    transactional_id: String,
    /// `group.instance.id` (static membership) or empty.
    instance: String,
    /// Session timeout in ms, 0 = librdkafka's default.
    session_ms: u64,
}

impl ChildSpec {
    fn encode(&self) -> String {
        [
            self.url.as_str(),
            &self.input,
            &self.output,
            &self.group,
            &self.transactional_id,
            &self.instance,
            &self.session_ms.to_string(),
        ]
        .join("\t")
    }

    fn decode(s: &str) -> ChildSpec {
        let f: Vec<&str> = s.split('\t').collect();
        assert_eq!(f.len(), 7, "bad {CHILD_VAR}: {s:?}");
        ChildSpec {
            url: f[0].into(),
            input: f[1].into(),
            output: f[2].into(),
            group: f[3].into(),
            transactional_id: f[4].into(),
            instance: f[5].into(),
            session_ms: f[6].parse().expect("session ms"),
        }
    }

    /// Starts this test binary as a pipeline process. Its stdin stays open; closing it asks
    /// for a graceful stop (drain, commit, leave the group).
    fn spawn(&self) -> Child {
        Command::new(std::env::current_exe().expect("test binary"))
            .args([CHILD_TEST, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_VAR, self.encode())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the pipeline process")
    }
}

/// Output of input `id`: `out-{id}`; fails `.1` % of the calls (`ONCEFLOW_CRASH_FAIL_PCT`).
struct Tag(String, u64);

#[async_trait]
impl Transform for Tag {
    async fn transform(&self, m: &Message) -> Result<Vec<Record>, BoxError> {
        if self.1 > 0 && rand::rng().random_range(0..100) < self.1 {
            return Err("eos child: injected transform failure".into());
        }
        let mut out = Vec::with_capacity(m.payload.len() + 4);
        out.extend_from_slice(b"out-");
        out.extend_from_slice(&m.payload);
        let mut r = Record::new(self.0.clone(), out);
        if let Some(k) = &m.key {
            r = r.key(k.clone());
        }
        Ok(vec![r])
    }
}

/// The child process's entry point: a no-op in a normal test run; with `ONCEFLOW_EOS_CHILD`
/// set, runs the pipeline until stdin closes (or the process is killed) and exits.
#[test]
fn eos_child_process() {
    let Ok(spec) = std::env::var(CHILD_VAR) else {
        return;
    };
    let spec = ChildSpec::decode(&spec);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let code = rt.block_on(child_main(spec));
    std::process::exit(code);
}

async fn child_main(spec: ChildSpec) -> i32 {
    let client = Client::new(onceflow_kafka::connect(&spec.url).expect("Kafka URL"));
    let mut cc = ConsumerConfig::new(spec.group.clone(), [spec.input.clone()])
        .start(StartFrom::committed_or_earliest());
    if !spec.instance.is_empty() {
        cc = cc
            .option("group.instance.id", spec.instance.clone())
            .client_id(spec.instance.clone());
    }
    if spec.session_ms > 0 {
        cc = cc.session_timeout(Duration::from_millis(spec.session_ms));
    }
    let run = async {
        let consumer = client.consumer(cc).await?;
        let producer = client
            .producer(ProducerConfig::new().transactional_id(spec.transactional_id.clone()))
            .await?;
        // `ONCEFLOW_CRASH_FAIL_PCT`: the transform fails that percent of its calls, with
        // `max_attempts=1` (each failure commits the inputs before it and reads on from the
        // failing one, #27).
        let fail_pct: u64 = std::env::var("ONCEFLOW_CRASH_FAIL_PCT")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let mut config = PipelineConfig::default();
        if fail_pct > 0 {
            config.engine.max_attempts = 1;
            config.engine.redelivery_delay = Duration::from_millis(20);
        }
        let pipeline = Pipeline::with_config(
            consumer,
            producer,
            None,
            Arc::new(Tag(spec.output.clone(), fail_pct)),
            config,
        )?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = std::io::stdin().lock().read_line(&mut line);
            let _ = stop_tx.send(());
        });
        println!("EOS-READY");
        pipeline
            .run_until(async {
                let _ = stop_rx.await;
            })
            .await
    };
    match run.await {
        Ok(s) => {
            println!(
                "EOS-DONE processed={} committed={} aborted={}",
                s.metrics.processed,
                s.metrics.transactions_committed,
                s.metrics.transactions_aborted
            );
            0
        }
        Err(e) => {
            eprintln!("eos child {}: pipeline failed: {e}", spec.transactional_id);
            3
        }
    }
}

/// Kills its child on drop, so a failing test leaves no process behind.
struct Worker(Option<Child>);

impl Worker {
    fn start(spec: &ChildSpec) -> Worker {
        Worker(Some(spec.spawn()))
    }

    /// Waits until the process has its producer (transactions initialised, so its
    /// predecessor is fenced) and consumer, and is about to run the pipeline.
    fn wait_ready(&mut self, within: Duration) {
        let c = self.0.as_mut().expect("running");
        let mut out = std::io::BufReader::new(c.stdout.take().expect("stdout"));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            while out.read_line(&mut line).unwrap_or(0) > 0 {
                if line.contains("EOS-READY") {
                    let _ = tx.send(());
                    // Keep draining so the child never blocks on a full pipe.
                    let _ = std::io::copy(&mut out, &mut std::io::sink());
                    return;
                }
                line.clear();
            }
        });
        rx.recv_timeout(within)
            .expect("the pipeline process started within the time allowed");
    }

    fn sigkill(&mut self) {
        if let Some(mut c) = self.0.take() {
            // std's Child::kill is SIGKILL on Unix.
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Closes stdin (graceful stop) and waits for the exit; returns the `EOS-DONE` line.
    fn stop(&mut self, within: Duration) -> String {
        let mut c = self.0.take().expect("running");
        drop(c.stdin.take());
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = c.try_wait().expect("wait") {
                let mut out = String::new();
                if let Some(mut so) = c.stdout.take() {
                    let _ = std::io::Read::read_to_string(&mut so, &mut out);
                }
                assert!(status.success(), "pipeline process failed: {status}\n{out}");
                return out
                    .lines()
                    .find(|l| l.contains("EOS-DONE"))
                    .unwrap_or_default()
                    .to_string();
            }
            if Instant::now() >= deadline {
                let _ = c.kill();
                panic!("pipeline process did not stop within {within:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.sigkill();
    }
}

/// Writes inputs `0, 1, 2, …` (payload = the decimal id, key = id % 64) to a topic in small
/// batches until stopped, so input keeps arriving while workers die.
struct Feeder {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Feeder {
    fn start(client: &Client, topic: &str, batch: u64, every: Duration) -> Feeder {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let (client, topic) = (client.clone(), topic.to_string());
        let (s, n) = (stop.clone(), sent.clone());
        let task = tokio::spawn(async move {
            let producer = client.producer(ProducerConfig::new()).await.unwrap();
            let mut next = 0u64;
            let mut tick = tokio::time::interval(every);
            while !s.load(Ordering::Acquire) {
                tick.tick().await;
                let records = (next..next + batch)
                    .map(|id| Record::new(topic.clone(), id.to_string()).key((id % 64).to_string()))
                    .collect();
                for r in producer.send_batch(records).await {
                    r.expect("input write");
                }
                next += batch;
                n.store(next, Ordering::Release);
            }
        });
        Feeder { stop, sent, task }
    }

    /// Stops and returns how many inputs were written.
    async fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Release);
        self.task.await.expect("feeder");
        self.sent.load(Ordering::Acquire)
    }
}

async fn create(client: &Client, prefix: &str, partitions: u32) -> String {
    let t = name(prefix);
    client
        .admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new(t.clone(), partitions))
        .await
        .unwrap();
    t
}

/// Reads B (read_committed, new group, from the start) until it holds `n` distinct outputs or
/// `within` passes, then 2 s more for anything extra; returns how often each input id appears.
async fn read_outputs(client: &Client, topic: &str, n: u64, within: Duration) -> HashMap<u64, u32> {
    let c = client
        .consumer(
            ConsumerConfig::new(name("eos-verify"), [topic.to_string()]).start(StartFrom::Earliest),
        )
        .await
        .unwrap();
    let mut seen: HashMap<u64, u32> = HashMap::new();
    let deadline = Instant::now() + within;
    let mut quiet_until: Option<Instant> = None;
    loop {
        for m in c.poll(1000, Duration::from_millis(200)).await.unwrap() {
            let p = std::str::from_utf8(&m.payload).unwrap();
            let id: u64 = p
                .strip_prefix("out-")
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("unexpected output {p:?}"));
            *seen.entry(id).or_default() += 1;
        }
        if seen.len() as u64 >= n && quiet_until.is_none() {
            quiet_until = Some(Instant::now() + Duration::from_secs(2));
        }
        if quiet_until.is_some_and(|q| Instant::now() >= q) || Instant::now() >= deadline {
            break;
        }
    }
    c.close().await.unwrap();
    seen
}

fn assert_exactly_once(seen: &HashMap<u64, u32>, n: u64) {
    let missing: Vec<u64> = (0..n).filter(|id| !seen.contains_key(id)).collect();
    let dup: Vec<(u64, u32)> = seen
        .iter()
        .filter(|(_, c)| **c > 1)
        .map(|(i, c)| (*i, *c))
        .collect();
    let extra: Vec<u64> = seen.keys().filter(|id| **id >= n).copied().collect();
    assert!(
        missing.is_empty() && dup.is_empty() && extra.is_empty(),
        "{n} inputs: {} missing (first {:?}), {} duplicated (first {:?}), {} unknown",
        missing.len(),
        &missing[..missing.len().min(10)],
        dup.len(),
        &dup[..dup.len().min(10)],
        extra.len()
    );
}

/// Inputs whose outputs are committed: the sum of the group's committed offsets on A (read
/// with a plain rdkafka client that never joins the group).
async fn committed_inputs(url: &str, group: &str, input: &str, partitions: i32) -> u64 {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let bootstrap = onceflow_kafka::parse_url(url).unwrap().bootstrap_servers;
    let (group, input) = (group.to_string(), input.to_string());
    tokio::task::spawn_blocking(move || {
        let c: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("group.id", &group)
            // Committed offsets as they are now, without waiting for the killed process's
            // pending transactional ones (KIP-447 require_stable applies to read_committed).
            .set("isolation.level", "read_uncommitted")
            .create()
            .unwrap();
        let mut tpl = rdkafka::TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition(&input, p);
        }
        let got = c.committed_offsets(tpl, Duration::from_secs(10)).unwrap();
        got.elements()
            .iter()
            .filter_map(|e| match e.offset() {
                rdkafka::Offset::Offset(o) if o > 0 => Some(o as u64),
                _ => None,
            })
            .sum()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_random_points_keeps_exactly_once() {
    let Some(url) = url("sigkill_at_random_points_keeps_exactly_once") else {
        return;
    };
    let kills: u32 = std::env::var("ONCEFLOW_CRASH_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let client = Client::new(onceflow_kafka::connect(&url).unwrap());
    let input = create(&client, "eos-crash-in", 4).await;
    let output = create(&client, "eos-crash-out", 4).await;
    let spec = ChildSpec {
        url: url.clone(),
        input: input.clone(),
        output: output.clone(),
        group: name("eos-crash"),
        transactional_id: name("eos-crash-tx"),
        instance: name("eos-crash-worker"),
        session_ms: 0,
    };
    // `ONCEFLOW_CRASH_FEED`: inputs written every 25 ms (50); `ONCEFLOW_CRASH_FINAL_S`: how
    // long the final run has to write the outputs left (120 s).
    let env = |var: &str, default: u64| {
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let feeder = Feeder::start(
        &client,
        &input,
        env("ONCEFLOW_CRASH_FEED", 50),
        Duration::from_millis(25),
    );
    let final_run = Duration::from_secs(env("ONCEFLOW_CRASH_FINAL_S", 120));
    let started = Instant::now();
    let mut progress = Vec::new();
    for _ in 0..kills {
        let mut w = Worker::start(&spec);
        tokio::task::block_in_place(|| w.wait_ready(Duration::from_secs(60)));
        let life = rand::rng().random_range(50..1200);
        tokio::time::sleep(Duration::from_millis(life)).await;
        w.sigkill();
        progress.push(committed_inputs(&url, &spec.group, &input, 4).await);
    }
    let n = feeder.finish().await;
    let before_final = committed_inputs(&url, &spec.group, &input, 4).await;
    let kill_phase = started.elapsed();
    let mut last = Worker::start(&spec);
    let seen = read_outputs(&client, &output, n, final_run).await;
    last.sigkill();
    eprintln!(
        "crash test: {kills} SIGKILLs in {kill_phase:?}; {n} inputs; committed inputs after each \
         kill {progress:?}; {before_final} committed before the final run; outputs read {}",
        seen.values().map(|c| *c as u64).sum::<u64>()
    );
    assert!(
        before_final > 0,
        "the killed processes committed nothing: the test did not exercise restarts"
    );
    assert_exactly_once(&seen, n);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_process_joins_and_first_leaves_exactly_once() {
    let Some(url) = url("second_process_joins_and_first_leaves_exactly_once") else {
        return;
    };
    let client = Client::new(onceflow_kafka::connect(&url).unwrap());
    let input = create(&client, "eos-rebalance-in", 4).await;
    let output = create(&client, "eos-rebalance-out", 4).await;
    let first = ChildSpec {
        url: url.clone(),
        input: input.clone(),
        output: output.clone(),
        group: name("eos-rebalance"),
        transactional_id: name("eos-rebalance-tx1"),
        instance: String::new(),
        session_ms: 0,
    };
    let second = ChildSpec {
        transactional_id: name("eos-rebalance-tx2"),
        ..first.clone()
    };
    let feeder = Feeder::start(&client, &input, 50, Duration::from_millis(25));
    let mut w1 = Worker::start(&first);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut w2 = Worker::start(&second);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let done1 = tokio::task::spawn_blocking(move || w1.stop(Duration::from_secs(30)))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let n = feeder.finish().await;
    let seen = read_outputs(&client, &output, n, Duration::from_secs(60)).await;
    let done2 = tokio::task::spawn_blocking(move || w2.stop(Duration::from_secs(30)))
        .await
        .unwrap();
    eprintln!("rebalance test: {n} inputs; first: {done1}; second: {done2}");
    let processed = |l: &str| -> u64 {
        l.split_whitespace()
            .find_map(|f| f.strip_prefix("processed="))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    assert!(processed(&done1) > 0, "the first process did work: {done1}");
    assert!(
        processed(&done2) > 0,
        "the second process did work: {done2}"
    );
    assert_exactly_once(&seen, n);
}

/// Stalls on its first input for `stall`, so its transaction stays open past the session.
struct Stall {
    output: String,
    stall: Duration,
    stalled: AtomicBool,
}

#[async_trait]
impl Transform for Stall {
    async fn transform(&self, m: &Message) -> Result<Vec<Record>, BoxError> {
        if !self.stalled.swap(true, Ordering::AcqRel) {
            tokio::time::sleep(self.stall).await;
        }
        Tag(self.output.clone(), 0).transform(m).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_worker_cannot_commit_its_open_transaction() {
    let Some(url) = url("removed_worker_cannot_commit_its_open_transaction") else {
        return;
    };
    let client = Client::new(onceflow_kafka::connect(&url).unwrap());
    let input = create(&client, "eos-zombie-in", 1).await;
    let output = create(&client, "eos-zombie-out", 1).await;
    let group = name("eos-zombie");
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    let n = 20u64;
    for r in producer
        .send_batch(
            (0..n)
                .map(|id| Record::new(input.clone(), id.to_string()))
                .collect(),
        )
        .await
    {
        r.unwrap();
    }
    // Kafka's smallest session (group.min.session.timeout.ms, 6 s); the onceflow consumer uses
    // it for max.poll.interval.ms too, so a worker that stops polling leaves the group.
    let session = Duration::from_secs(6);
    let pipeline = |tx: &str, transform: Arc<dyn Transform>| {
        let (client, input, group, tx) =
            (client.clone(), input.clone(), group.clone(), tx.to_string());
        async move {
            let consumer = client
                .consumer(
                    ConsumerConfig::new(group, [input])
                        .start(StartFrom::committed_or_earliest())
                        .session_timeout(session),
                )
                .await
                .unwrap();
            let producer = client
                .producer(ProducerConfig::new().transactional_id(tx))
                .await
                .unwrap();
            Pipeline::with_config(
                consumer,
                producer,
                None,
                transform,
                PipelineConfig::default(),
            )
            .unwrap()
        }
    };
    let zombie = pipeline(
        &name("eos-zombie-tx"),
        Arc::new(Stall {
            output: output.clone(),
            stall: session + Duration::from_secs(4),
            stalled: AtomicBool::new(false),
        }),
    )
    .await;
    let zombie_metrics = zombie.metrics();
    let (stop_zombie, zombie_stopped) = tokio::sync::oneshot::channel::<()>();
    let zombie_run = tokio::spawn(zombie.run_until(async {
        let _ = zombie_stopped.await;
    }));
    // Once the zombie holds an open transaction, the heir joins; it gets the partition when the
    // zombie's session / poll interval expires, and processes everything.
    let deadline = Instant::now() + Duration::from_secs(30);
    while zombie_metrics.snapshot().consumed == 0 {
        assert!(Instant::now() < deadline, "the zombie never read its input");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let heir = pipeline(&name("eos-heir-tx"), Arc::new(Tag(output.clone(), 0))).await;
    let (stop_heir, heir_stopped) = tokio::sync::oneshot::channel::<()>();
    let heir_run = tokio::spawn(heir.run_until(async {
        let _ = heir_stopped.await;
    }));
    // The zombie wakes up after the heir took over and tries to commit: group fencing
    // (KIP-447). Its transaction is aborted, counted as fenced, and the zombie goes on as a
    // fresh member from the committed positions.
    let deadline = Instant::now() + Duration::from_secs(60);
    while zombie_metrics.snapshot().fenced == 0 {
        assert!(
            Instant::now() < deadline,
            "the zombie's commit was never fenced: {:?}",
            zombie_metrics.snapshot()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let z = zombie_metrics.snapshot();
    assert!(z.transactions_aborted >= 1, "{z:?}");
    let seen = read_outputs(&client, &output, n, Duration::from_secs(60)).await;
    let _ = stop_zombie.send(());
    let _ = stop_heir.send(());
    zombie_run.await.unwrap().unwrap();
    heir_run.await.unwrap().unwrap();
    let z = zombie_metrics.snapshot();
    assert_eq!(
        z.transactions_committed, 0,
        "nothing of the zombie's committed: {z:?}"
    );
    assert_exactly_once(&seen, n);
}
