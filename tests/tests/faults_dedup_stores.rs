//! The idempotent consumer over a Redis or PostgreSQL dedup store that fails under it (issue
//! #28): the store's server restarted mid-run, the store's connections cut while a claim is in
//! flight (the claim reached the server, its answer never came back), and every connection
//! reset. The store is a private server the test starts (`tests/brokers/{redis,postgres}/up.sh`
//! on a free port in a run directory of its own, restarted by their `restart.sh` and stopped
//! by `down.sh`), never the shared one, reached through a fault proxy
//! (`tests/src/fault_proxy.rs`, raw framing). The input is a `memory://` topic, so the faults
//! are the store's alone.
//!
//! The consumer waits for its store and goes on: no run may end in an error (a supervisor
//! loop starts one again if it does, and counts it, so the figures are still printed).
//! Checked: every key's handler finished (`lost`); no handler ran for a key the store already
//! held as completed (`duplicated`: a second run of a key whose first completion was never
//! confirmed is what at-least-once allows, and is counted apart); and no key was ever
//! completed in the store before its handler finished (sampled every 200 ms while the faults
//! run, and at the end).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use onceflow_conformance::fault_proxy::{Action, Direction, FaultProxy};
use onceflow_conformance::faults::{report, soak_minutes, Tally};
use onceflow_conformance::harness::random_suffix;
use onceflow_core::dedup::{
    ClaimOutcome, ClaimRequest, Completion, DedupStore, FencingToken, KeyState, SharedDedupStore,
};
use onceflow_core::{
    BoxError, Client, ConsumerConfig, EngineConfig, ErrorKind, Handler, IdempotentConsumer,
    Message, ProducerConfig, Record, StartFrom,
};

const HANG_GUARD: Duration = Duration::from_secs(600);
const PARTITIONS: u32 = 4;

/// A store server of the test's own: `tests/brokers/<name>/up.sh` in a run directory and on a
/// port nobody else uses; stopped (by its pid file) when dropped.
struct PrivateServer {
    name: &'static str,
    run_dir: PathBuf,
    port_var: &'static str,
    port: u16,
    url: String,
}

fn brokers_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("brokers")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl PrivateServer {
    async fn start(name: &'static str, port_var: &'static str, url_var: &str) -> PrivateServer {
        // World-readable: PostgreSQL runs as its own user and must reach its data below it.
        let run_dir =
            std::env::temp_dir().join(format!("onceflow-faults-{name}-{}", random_suffix()));
        std::fs::create_dir_all(&run_dir).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&run_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut s = PrivateServer {
            name,
            run_dir,
            port_var,
            port: free_port(),
            url: String::new(),
        };
        let out = s.script("up.sh", &[]).await;
        let line = out
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{url_var}=")))
            .unwrap_or_else(|| panic!("{name}/up.sh printed no {url_var}"));
        s.url = line.to_string();
        s
    }

    /// Runs `tests/brokers/<name>/<script>` (or `tests/brokers/<script>` for down.sh) with
    /// this server's run directory and port; returns its stdout.
    async fn script(&self, script: &str, args: &[&str]) -> String {
        let path = if script == "down.sh" {
            brokers_dir().join(script)
        } else {
            brokers_dir().join(self.name).join(script)
        };
        let mut cmd = std::process::Command::new("bash");
        cmd.arg(&path)
            .args(args)
            .env("ONCEFLOW_RUN_DIR", &self.run_dir)
            .env(self.port_var, self.port.to_string());
        let out = tokio::task::spawn_blocking(move || cmd.output())
            .await
            .unwrap()
            .expect("run a broker script");
        assert!(
            out.status.success(),
            "{} failed: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Stops the server and starts it again on its data (its `restart.sh`).
    async fn restart(&self) {
        self.script("restart.sh", &[]).await;
    }

    fn upstream(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        let _ = std::process::Command::new("bash")
            .arg(brokers_dir().join("down.sh"))
            .arg(self.name)
            .env("ONCEFLOW_RUN_DIR", &self.run_dir)
            .output();
        let _ = std::fs::remove_dir_all(&self.run_dir);
    }
}

/// What the handler saw.
#[derive(Default)]
struct Ledger {
    /// Key → handler runs that finished.
    finished: Mutex<HashMap<String, usize>>,
    /// Runs of a handler for a key the store already held as completed.
    ran_for_completed: AtomicUsize,
    /// Handler attempts that failed on purpose (every 7th key's first attempt).
    failed_on_purpose: AtomicUsize,
}

struct Checked {
    ledger: Arc<Ledger>,
    /// The same store, reached directly (not through the proxy): what it holds now.
    direct: SharedDedupStore,
    namespace: String,
    /// Whether a handler waits for the store to answer its check (else it skips the check
    /// while the store cannot answer, counted in `unchecked`): a handler that waits holds the
    /// consumer off its store for as long as the store cannot serve.
    wait_for_store: bool,
    unchecked: AtomicUsize,
}

impl Checked {
    async fn completed_in_store(&self, key: &str) -> bool {
        let k = format!("{}/{key}", self.namespace);
        // The store may be restarting: ask until it answers.
        for _ in 0..600 {
            match self.direct.get(std::slice::from_ref(&k)).await {
                Ok(v) => return matches!(v.first(), Some(Some(KeyState::Completed { .. }))),
                Err(_) if !self.wait_for_store => {
                    self.unchecked.fetch_add(1, Ordering::SeqCst);
                    return false;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        panic!("the store did not answer for 60 s");
    }
}

#[async_trait]
impl Handler for Checked {
    async fn handle(&self, m: &Message) -> Result<Option<Bytes>, BoxError> {
        let key = String::from_utf8_lossy(m.key.as_deref().unwrap_or_default()).into_owned();
        if self.completed_in_store(&key).await {
            self.ledger.ran_for_completed.fetch_add(1, Ordering::SeqCst);
        }
        let n: usize = key.trim_start_matches('k').parse().unwrap_or(0);
        let seen = self.ledger.finished.lock().unwrap().contains_key(&key);
        if n.is_multiple_of(7) && !seen && rand::random::<bool>() {
            self.ledger.failed_on_purpose.fetch_add(1, Ordering::SeqCst);
            return Err(format!("{key}: failing on purpose").into());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        *self.ledger.finished.lock().unwrap().entry(key).or_default() += 1;
        Ok(Some(Bytes::from_static(b"ok")))
    }
}

/// A fault injected under the running consumer.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// The store's server stopped and started again on its data.
    Restart,
    /// The connection carrying the next claim cut after the claim reached the server, before
    /// its answer came back.
    ClaimInFlight,
    /// Every store connection reset.
    Reset,
    /// The store's network goes silent: connections stay open, no answer comes back, until
    /// the store has timed out one operation (its `op_timeout` on an open connection, or the
    /// connect timeout on a new one).
    BlackHole,
}

/// Operations of the store under test that ended in an [`ErrorKind::Timeout`].
static STORE_TIMEOUTS: AtomicUsize = AtomicUsize::new(0);

/// A store that counts its [`ErrorKind::Timeout`] failures in [`STORE_TIMEOUTS`].
struct CountingTimeouts(SharedDedupStore);

impl CountingTimeouts {
    fn seen<T>(r: onceflow_core::Result<T>) -> onceflow_core::Result<T> {
        if let Err(e) = &r {
            if e.kind() == ErrorKind::Timeout {
                STORE_TIMEOUTS.fetch_add(1, Ordering::SeqCst);
                eprintln!("store timeout: {e}");
            }
        }
        r
    }
}

#[async_trait]
impl DedupStore for CountingTimeouts {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn window(&self) -> Duration {
        self.0.window()
    }
    async fn claim(&self, r: &[ClaimRequest]) -> onceflow_core::Result<Vec<ClaimOutcome>> {
        Self::seen(self.0.claim(r).await)
    }
    async fn renew(
        &self,
        c: &[(String, FencingToken)],
        lease: Duration,
    ) -> onceflow_core::Result<Vec<bool>> {
        Self::seen(self.0.renew(c, lease).await)
    }
    async fn complete(&self, c: &[Completion]) -> onceflow_core::Result<Vec<bool>> {
        Self::seen(self.0.complete(c).await)
    }
    async fn release(&self, c: &[(String, FencingToken)]) -> onceflow_core::Result<Vec<bool>> {
        Self::seen(self.0.release(c).await)
    }
    async fn get(&self, k: &[String]) -> onceflow_core::Result<Vec<Option<KeyState>>> {
        Self::seen(self.0.get(k).await)
    }
}

/// Runs the consumer over `server` through a fault proxy while `base` is injected (in a loop
/// with random picks under a soak); asserts every key handled once and none early; returns
/// how many runs ended in an error (and were started again).
async fn run(
    test: &str,
    server: &PrivateServer,
    open: Opener,
    base: &[Fault],
    wait_for_store: bool,
) -> usize {
    let started = tokio::time::Instant::now();
    let proxy = FaultProxy::start_raw("127.0.0.1:0", &server.upstream())
        .await
        .unwrap();
    let through = server
        .url
        .replace(&server.upstream(), &proxy.addr().to_string());
    assert_ne!(through, server.url, "the URL names the server's port");
    let window = Duration::from_secs(3600);
    let store = open(through, window).await;
    let direct = open(server.url.clone(), window).await;

    let faults: Vec<Fault> = match soak_minutes() {
        0 => base.to_vec(),
        m => {
            use rand::seq::IndexedRandom;
            (0..6 * m)
                .map(|_| *base.choose(&mut rand::rng()).unwrap())
                .collect()
        }
    };
    let keys = 1000 * (faults.len() + 1);

    let id = random_suffix();
    let platform_name = format!("faults-store-{id}");
    let platform = onceflow_memory::connect(&format!("memory://{platform_name}")).unwrap();
    onceflow_memory::MemoryPlatform::forget(&platform_name);
    let c = Client::new(platform);
    let topic = format!("in-{id}");
    c.admin()
        .await
        .unwrap()
        .create_topic(&onceflow_core::TopicSpec::new(topic.clone(), PARTITIONS))
        .await
        .unwrap();
    // Every key once, and a third of them again later (redeliveries the store must skip).
    let producer = c.producer(ProducerConfig::new()).await.unwrap();
    let mut records: Vec<Record> = (0..keys)
        .map(|i| {
            Record::new(topic.clone(), format!("v{i}"))
                .key(format!("k{i}"))
                .idempotency_key(format!("k{i}"))
        })
        .collect();
    records.extend((0..keys).step_by(3).map(|i| {
        Record::new(topic.clone(), format!("v{i}"))
            .key(format!("k{i}"))
            .idempotency_key(format!("k{i}"))
    }));
    for r in producer.send_batch(records).await {
        r.unwrap();
    }
    producer.close().await.unwrap();

    let group = format!("faults-store-g-{id}");
    let worker = format!("faults-worker-{id}");
    let ledger = Arc::new(Ledger::default());
    let handler = Arc::new(Checked {
        ledger: ledger.clone(),
        direct: direct.clone(),
        namespace: group.clone(),
        wait_for_store,
        unchecked: AtomicUsize::new(0),
    });
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let restarts = Arc::new(AtomicUsize::new(0));
    let running = {
        let (c, topic, group, worker, store, handler, restarts) = (
            c.clone(),
            topic.clone(),
            group.clone(),
            worker.clone(),
            store.clone(),
            handler.clone(),
            restarts.clone(),
        );
        tokio::spawn(async move {
            loop {
                let consumer = c
                    .consumer(
                        ConsumerConfig::new(group.clone(), [topic.clone()])
                            .start(StartFrom::committed_or_earliest()),
                    )
                    .await
                    .unwrap();
                let config = EngineConfig {
                    worker_id: worker.clone(),
                    lease: Duration::from_secs(3),
                    batch_size: 50,
                    max_attempts: 5,
                    min_backoff: Duration::from_millis(10),
                    max_backoff: Duration::from_millis(100),
                    commit_interval: Duration::from_millis(100),
                    ..Default::default()
                };
                let ic = IdempotentConsumer::with_config(
                    consumer,
                    Some(store.clone()),
                    handler.clone(),
                    config,
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
                        eprintln!(
                            "run {n} ended in an error ({:?}), starting again: {e}",
                            e.kind()
                        );
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        })
    };

    // Sampled while the faults run: a key completed in the store has a finished handler run.
    let all_keys: Vec<String> = (0..keys).map(|i| format!("{group}/k{i}")).collect();
    let early_completions = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (direct, ledger, all_keys, early) = (
            direct.clone(),
            ledger.clone(),
            all_keys.clone(),
            early_completions.clone(),
        );
        tokio::spawn(async move {
            loop {
                // Completed keys first, then the ledger: a completion must follow its run.
                if let Ok(states) = direct.get(&all_keys).await {
                    let finished = ledger.finished.lock().unwrap();
                    for (k, s) in all_keys.iter().zip(states) {
                        if matches!(s, Some(KeyState::Completed { .. }))
                            && !finished.contains_key(k.rsplit('/').next().unwrap())
                        {
                            eprintln!("{k} completed in the store before its handler finished");
                            early.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };

    let finished_count = || ledger.finished.lock().unwrap().len();
    for (k, fault) in faults.iter().enumerate() {
        let at = keys * (k + 1) / (faults.len() + 1);
        while finished_count() < at {
            assert!(!running.is_finished(), "the consumer task ended early");
            assert!(
                started.elapsed() < HANG_GUARD,
                "stalled at {} of {keys} keys",
                finished_count()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        eprintln!(
            "[{:>4} s] fault {}: {fault:?} at {} keys finished",
            started.elapsed().as_secs(),
            k + 1,
            finished_count()
        );
        match fault {
            Fault::Restart => server.restart().await,
            Fault::Reset => proxy.cut_all(),
            Fault::BlackHole => {
                let before = STORE_TIMEOUTS.load(Ordering::SeqCst);
                let since = tokio::time::Instant::now();
                proxy.always(
                    Direction::ToClient,
                    |_| true,
                    Action::Delay(Duration::from_secs(3600)),
                );
                while STORE_TIMEOUTS.load(Ordering::SeqCst) == before {
                    // A hang guard, 60 times the store's op_timeout (2 s).
                    assert!(
                        since.elapsed() < Duration::from_secs(120),
                        "the store's network was silent for 120 s and no operation timed out"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                proxy.clear();
            }
            Fault::ClaimInFlight => {
                // A chunk to the server holding the worker's id is a claim (claims alone carry
                // the owner): the next chunk back, its answer, is never delivered.
                let armed = Arc::new(AtomicBool::new(false));
                let before = proxy.fired();
                let (a, w) = (armed.clone(), worker.clone().into_bytes());
                proxy.once(
                    Direction::ToBroker,
                    move |chunk| {
                        if chunk.windows(w.len()).any(|x| x == w) {
                            a.store(true, Ordering::SeqCst);
                        }
                        false
                    },
                    Action::Cut,
                );
                let a = armed.clone();
                proxy.once(
                    Direction::ToClient,
                    move |_| a.load(Ordering::SeqCst),
                    Action::Cut,
                );
                while proxy.fired() == before && finished_count() < keys {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                proxy.clear();
            }
        }
    }
    eprintln!(
        "[{:>4} s] faults done, waiting for every key",
        started.elapsed().as_secs()
    );
    while finished_count() < keys {
        assert!(!running.is_finished(), "the consumer task ended early");
        assert!(
            started.elapsed() < HANG_GUARD,
            "stalled at {} of {keys} keys after the faults",
            finished_count()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Every key completed in the store (the last completions may still be on their way).
    let mut incomplete = keys;
    for _ in 0..300 {
        let states = direct.get(&all_keys).await.unwrap();
        incomplete = states
            .iter()
            .filter(|s| !matches!(s, Some(KeyState::Completed { .. })))
            .count();
        if incomplete == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Let the redeliveries behind the last keys come through (they must all be skipped).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let _ = stop.send(true);
    running.await.unwrap();
    sampler.abort();

    let finished = ledger.finished.lock().unwrap().clone();
    let expected: Vec<String> = (0..keys).map(|i| format!("k{i}")).collect();
    // Runs again for a key whose completion never landed are what at-least-once allows: the
    // duplicates counted are runs for a key already completed (below).
    let seen: std::collections::BTreeMap<String, usize> =
        finished.keys().map(|k| (k.clone(), 1)).collect();
    let mut tally = Tally::of(&expected, &seen);
    let ran_for_completed = ledger.ran_for_completed.load(Ordering::SeqCst);
    let early = early_completions.load(Ordering::SeqCst);
    tally.duplicated += ran_for_completed;
    tally.lost += incomplete + early;
    let rerun: usize = finished.values().map(|n| n - 1).sum();
    report(test, faults.len(), tally);
    eprintln!(
        "{test}: {keys} keys (+{} redeliveries), {} faults, {} runs restarted after an error, \
         {rerun} handler runs again for a key whose completion was never confirmed, \
         {ran_for_completed} runs for a key already completed, {early} keys completed before \
         their handler finished, {incomplete} not completed at the end, {} failures on \
         purpose, {} handler runs not checked against the store (it could not answer), {} s",
        keys.div_ceil(3),
        faults.len(),
        restarts.load(Ordering::SeqCst),
        ledger.failed_on_purpose.load(Ordering::SeqCst),
        handler.unchecked.load(Ordering::SeqCst),
        started.elapsed().as_secs()
    );
    assert_eq!(
        tally,
        Tally::default(),
        "every key handled once, none early"
    );
    restarts.load(Ordering::SeqCst)
}

/// Every fault.
const ALL_FAULTS: &[Fault] = &[
    Fault::Restart,
    Fault::ClaimInFlight,
    Fault::Reset,
    Fault::ClaimInFlight,
];

type Opener = fn(
    String,
    Duration,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = SharedDedupStore> + Send>>;

fn open_redis(
    url: String,
    window: Duration,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = SharedDedupStore> + Send>> {
    Box::pin(async move {
        Arc::new(
            onceflow_redis::RedisStore::open(&url, window)
                .await
                .unwrap_or_else(|e| panic!("open the Redis store: {e}")),
        ) as SharedDedupStore
    })
}

fn open_postgres(
    url: String,
    window: Duration,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = SharedDedupStore> + Send>> {
    Box::pin(async move {
        Arc::new(
            onceflow_postgres::PostgresStore::open(&url, window)
                .await
                .unwrap_or_else(|e| panic!("open the PostgreSQL store: {e}")),
        ) as SharedDedupStore
    })
}

/// [`open_postgres`] with `op_timeout=2` (seconds), counting its timeouts.
fn open_postgres_op_timeout_2(
    url: String,
    window: Duration,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = SharedDedupStore> + Send>> {
    Box::pin(async move {
        let sep = if url.contains('?') { '&' } else { '?' };
        let store = open_postgres(format!("{url}{sep}op_timeout=2"), window).await;
        Arc::new(CountingTimeouts(store)) as SharedDedupStore
    })
}

fn enabled(test: &str, tool: &str) -> bool {
    let found = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!(
            "command -v {tool} || ls /usr/lib/postgresql/*/bin/{tool}"
        ))
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !found && std::env::var("ONCEFLOW_REQUIRE_BROKERS").as_deref() != Ok("1") {
        eprintln!("SKIPPED {test}: {tool} is not installed");
        return false;
    }
    true
}

/// Redis: its server restarted, a claim's answer cut off, every connection reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_faults_lose_nothing_and_run_no_completed_key_again() {
    const TEST: &str = "redis_store_faults_lose_nothing_and_run_no_completed_key_again";
    if !enabled(TEST, "redis-server") {
        return;
    }
    let server = PrivateServer::start("redis", "ONCEFLOW_REDIS_PORT", "ONCEFLOW_REDIS_URL").await;
    tokio::time::timeout(HANG_GUARD, run(TEST, &server, open_redis, ALL_FAULTS, true))
        .await
        .expect("hung");
}

/// PostgreSQL: its server restarted, a claim's answer cut off, every connection reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_faults_lose_nothing_and_run_no_completed_key_again() {
    const TEST: &str = "postgres_store_faults_lose_nothing_and_run_no_completed_key_again";
    if !enabled(TEST, "initdb") {
        return;
    }
    let server = PrivateServer::start(
        "postgres",
        "ONCEFLOW_POSTGRES_PORT",
        "ONCEFLOW_POSTGRES_URL",
    )
    .await;
    tokio::time::timeout(
        HANG_GUARD,
        run(TEST, &server, open_postgres, ALL_FAULTS, true),
    )
    .await
    .expect("hung");
}

/// Redis restarted on a dataset that takes it seconds to load: while it loads it answers
/// `LOADING` to every command (<https://redis.io/docs/latest/develop/reference/protocol-spec/#simple-errors>),
/// which the consumer must wait out like an unreachable server, not end its run on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_restarted_while_loading_its_dataset_run_does_not_end() {
    const TEST: &str = "redis_store_restarted_while_loading_its_dataset_run_does_not_end";
    if !enabled(TEST, "redis-cli") {
        return;
    }
    let server = PrivateServer::start("redis", "ONCEFLOW_REDIS_PORT", "ONCEFLOW_REDIS_URL").await;
    // A million 64-byte values in the append-only file: about 2 s of LOADING on this machine.
    let fill = "for i = 1, 1000000 do redis.call('SET', 'fill:' .. i, string.rep('x', 64)) end \
                return redis.call('DBSIZE')";
    let port = server.port.to_string();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("redis-cli")
            .args(["-p", &port, "eval", fill, "0"])
            .output()
    })
    .await
    .unwrap()
    .expect("run redis-cli");
    let size = String::from_utf8_lossy(&out.stdout);
    assert!(
        size.trim().parse::<u64>().unwrap_or(0) >= 1_000_000,
        "the fill did not take: {size} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ended = tokio::time::timeout(
        HANG_GUARD,
        run(
            TEST,
            &server,
            open_redis,
            &[Fault::Restart, Fault::Restart],
            // Handlers go on while Redis loads, so the consumer meets LOADING.
            false,
        ),
    )
    .await
    .expect("hung");
    assert_eq!(ended, 0, "no run ends while Redis loads its dataset");
}

/// A Redis server that is a replica (`REPLICAOF`, its primary unreachable: `role:slave`, every
/// write `READONLY`): opening a dedup or checkpoint store on it is a Config error naming the
/// role, not a store that retries `READONLY` for ever (#28).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_refuses_a_replica_at_open() {
    const TEST: &str = "redis_store_refuses_a_replica_at_open";
    if !enabled(TEST, "redis-cli") {
        return;
    }
    let server = PrivateServer::start("redis", "ONCEFLOW_REDIS_PORT", "ONCEFLOW_REDIS_URL").await;
    let port = server.port.to_string();
    let primary = free_port().to_string();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("redis-cli")
            .args(["-p", &port, "replicaof", "127.0.0.1", &primary])
            .output()
    })
    .await
    .unwrap()
    .expect("run redis-cli");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "OK");
    let dedup = onceflow_redis::RedisStore::open(&server.url, Duration::from_secs(60))
        .await
        .expect_err("a replica");
    let checkpoint = onceflow_redis::RedisCheckpointStore::open(&server.url)
        .await
        .expect_err("a replica");
    for e in [dedup, checkpoint] {
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        assert!(!e.is_retriable(), "{e}");
        assert!(e.message().contains("replica"), "{e}");
    }
}

/// PostgreSQL behind a network that goes silent (connections open, nothing answered): the
/// store times its operation out (`op_timeout`), closes the connection and the consumer goes
/// on, instead of waiting for as long as the kernel keeps the socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_silent_network_times_out_and_run_goes_on() {
    const TEST: &str = "postgres_store_silent_network_times_out_and_run_goes_on";
    if !enabled(TEST, "initdb") {
        return;
    }
    let server = PrivateServer::start(
        "postgres",
        "ONCEFLOW_POSTGRES_PORT",
        "ONCEFLOW_POSTGRES_URL",
    )
    .await;
    let ended = tokio::time::timeout(
        HANG_GUARD,
        run(
            TEST,
            &server,
            open_postgres_op_timeout_2,
            &[Fault::BlackHole, Fault::BlackHole],
            true,
        ),
    )
    .await
    .expect("hung");
    assert_eq!(ended, 0, "no run ends on a store timeout: it is waited out");
}

/// A raw fault proxy in front of the shared PostgreSQL server (`ONCEFLOW_POSTGRES_URL`) and
/// that URL pointed at the proxy; `None` (said on stderr) without the server.
async fn shared_postgres_through_a_proxy() -> Option<(FaultProxy, url::Url)> {
    let Ok(url) = std::env::var("ONCEFLOW_POSTGRES_URL") else {
        assert!(
            std::env::var("ONCEFLOW_REQUIRE_BROKERS").as_deref() != Ok("1"),
            "ONCEFLOW_POSTGRES_URL is not set"
        );
        eprintln!("SKIPPED: ONCEFLOW_POSTGRES_URL is not set");
        return None;
    };
    let mut through = url::Url::parse(&url).unwrap();
    let upstream = format!(
        "{}:{}",
        through.host_str().unwrap(),
        through.port().unwrap_or(5432)
    );
    let proxy = FaultProxy::start_raw("127.0.0.1:0", &upstream)
        .await
        .unwrap();
    through.set_host(Some("127.0.0.1")).unwrap();
    through.set_port(Some(proxy.addr().port())).unwrap();
    Some((proxy, through))
}

/// A PostgreSQL server whose network is silent when the store connects (the fault proxy holds
/// new connections unanswered): the error names the connect timeout in words, not the pool
/// library's "Timeout occurred while creating a new object".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_silent_at_connect_names_the_connect_timeout() {
    let Some((proxy, mut through)) = shared_postgres_through_a_proxy().await else {
        return;
    };
    proxy.isolate();
    through
        .query_pairs_mut()
        .append_pair("connect_timeout", "1");
    let e = onceflow_postgres::PostgresStore::open(through.as_str(), Duration::from_secs(60))
        .await
        .expect_err("a silent server");
    // The URL's value bounds the whole connection (TLS, authentication, session start), not
    // only the TCP connect that the proxy completes at once: the error names it (#28).
    assert!(
        e.message().contains("connect timeout of 1 s")
            && e.is_retriable()
            && e.kind() == ErrorKind::Timeout,
        "unclear: {e}"
    );
    assert!(!e.message().contains("new object"), "pool words: {e}");
}

/// The transactional inbox's handler for the silent-network test: records nothing of its own.
struct NoteHandled(AtomicUsize);

#[async_trait]
impl onceflow_postgres::InboxHandler for NoteHandled {
    async fn handle(
        &self,
        _: &mut onceflow_postgres::tokio_postgres::Transaction<'_>,
        _: &Message,
    ) -> Result<(), BoxError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// The PostgreSQL checkpoint store (Kinesis lease table) and the transactional inbox behind a
/// network that goes silent on open connections: each of their operations ends with a
/// retriable Timeout within the URL's `op_timeout` instead of waiting for as long as the kernel
/// keeps the socket (before, only the dedup store was bounded, #28); once the network is back
/// they work on new connections and the inbox handles its message once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_checkpoint_store_and_inbox_time_out_on_a_silent_network() {
    use onceflow_core::checkpoint::{CheckpointStore, NewLease};
    let Some((proxy, mut through)) = shared_postgres_through_a_proxy().await else {
        return;
    };
    through
        .query_pairs_mut()
        .append_pair("schema", &format!("silent_{}", random_suffix()))
        .append_pair("op_timeout", "1");
    let silence = || {
        proxy.always(
            Direction::ToClient,
            |_| true,
            Action::Delay(Duration::from_secs(3600)),
        )
    };
    let timed_out = |what: &str, r: onceflow_core::Result<()>| {
        let e = r.expect_err(what);
        assert!(
            e.kind() == ErrorKind::Timeout
                && e.is_retriable()
                && e.message().contains("op_timeout"),
            "{what}: {e}"
        );
    };

    let leases = onceflow_postgres::PostgresCheckpointStore::open(through.as_str())
        .await
        .unwrap();
    let lease = |key: &str| NewLease {
        key: key.into(),
        checkpoint: None,
        parents: Vec::new(),
    };
    leases.create("g", &[lease("shard-0")]).await.unwrap();
    silence();
    tokio::time::timeout(HANG_GUARD, async {
        timed_out("list", leases.list("g").await.map(drop));
        timed_out("get", leases.get("g", &["shard-0".into()]).await.map(drop));
        timed_out(
            "create",
            leases.create("g", &[lease("shard-1")]).await.map(drop),
        );
        timed_out(
            "delete",
            leases.delete("g", &["shard-1".into()]).await.map(drop),
        );
    })
    .await
    .expect("a checkpoint store operation hung on a silent network");
    proxy.clear();
    assert_eq!(leases.list("g").await.unwrap().len(), 1, "works again");

    let store = onceflow_postgres::PostgresStore::open(through.as_str(), Duration::from_secs(60))
        .await
        .unwrap();
    let client = Client::new(
        onceflow_memory::connect(&format!("memory://silent-inbox-{}", random_suffix())).unwrap(),
    );
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    producer
        .send(Record::new("orders", "o1").idempotency_key("k1"))
        .await
        .unwrap();
    let consumer = client
        .consumer(ConsumerConfig::new("g", ["orders"]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let config = onceflow_postgres::InboxConfig {
        max_attempts: 1,
        ..onceflow_postgres::InboxConfig::default()
    };
    let mut inbox = store.inbox(consumer, config);
    let positions = inbox.positions_reader();
    let handler = NoteHandled(AtomicUsize::new(0));
    silence();
    tokio::time::timeout(HANG_GUARD, async {
        timed_out("positions", positions.read().await.map(drop));
        timed_out("step", inbox.step(&handler).await.map(drop));
    })
    .await
    .expect("an inbox operation hung on a silent network");
    proxy.clear();
    // A failed step ends that inbox's run; its message comes again on the next start.
    drop(inbox);
    let consumer = client
        .consumer(ConsumerConfig::new("g", ["orders"]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let mut inbox = store.inbox(consumer, onceflow_postgres::InboxConfig::default());
    for _ in 0..20 {
        if inbox.summary().handled == 1 {
            break;
        }
        inbox.step(&handler).await.unwrap();
    }
    assert_eq!(inbox.summary().handled, 1, "{:?}", inbox.summary());
    assert_eq!(positions.read().await.unwrap().len(), 1);
}

/// `connect_timeout=0.0001` (a tenth of a millisecond, positive) against a PostgreSQL server
/// whose network is silent: the user asked for a very short bound, so the open must end (a
/// Config error for a value below what the store can honour, as `op_timeout` below 1 ms is, or
/// a Timeout). A break-it pass found it read as "wait indefinitely" (0's meaning in libpq):
/// the open never ends. The outer guard only detects that hang (#28).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_connect_timeout_below_a_millisecond_does_not_wait_for_ever() {
    let Some((proxy, mut through)) = shared_postgres_through_a_proxy().await else {
        return;
    };
    proxy.isolate();
    through
        .query_pairs_mut()
        .append_pair("connect_timeout", "0.0001");
    let opened = tokio::time::timeout(
        // Far above any connect bound the store applies (its default is 5 s).
        Duration::from_secs(120),
        onceflow_postgres::PostgresStore::open(through.as_str(), Duration::from_secs(60)),
    )
    .await
    .expect("connect_timeout=0.0001 waited indefinitely on a silent server, as 0 would");
    let e = opened.expect_err("a silent server");
    assert!(
        matches!(e.kind(), ErrorKind::Config | ErrorKind::Timeout),
        "unexpected: {e}"
    );
    assert!(e.message().contains("connect_timeout"), "unnamed: {e}");
}
