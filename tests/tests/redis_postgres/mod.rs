//! Shared by the Redis and PostgreSQL store tests: a [`StoreHarness`] over a store URL, the
//! two-process race and the store-restart run.

#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::io::{BufRead, BufReader, Write};
use std::pin::Pin;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use onceflow_conformance::dedup_suite::StoreHarness;
use onceflow_core::dedup::{ClaimOutcome, ClaimRequest, Completion, KeyState, SharedDedupStore};
use onceflow_core::Result;

/// Opens a store at a location (a URL) with a window.
pub type Opener =
    fn(String, Duration) -> Pin<Box<dyn Future<Output = Result<SharedDedupStore>> + Send>>;

/// The service URL in `var`, or `None` (with a SKIPPED line) when it is not set; with
/// `ONCEFLOW_REQUIRE_BROKERS=1` a missing URL panics.
pub fn service_url(var: &str, service: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(u) if !u.is_empty() => Some(u),
        _ => {
            assert!(
                std::env::var("ONCEFLOW_REQUIRE_BROKERS").as_deref() != Ok("1"),
                "ONCEFLOW_REQUIRE_BROKERS=1 but {var} is not set (tests/brokers/up.sh {service})"
            );
            eprintln!("SKIPPED: {var} is not set (start it with tests/brokers/up.sh {service})");
            None
        }
    }
}

/// A random lowercase hex string.
pub fn rand_hex() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// A harness for a store reached by URL: every `open` makes a fresh location with
/// `fresh_location(base_url)` (a new key prefix or schema).
pub struct UrlHarness {
    pub base: String,
    pub fresh_location: fn(&str) -> String,
    pub opener: Opener,
    pub unusable: Vec<String>,
    pub last: Mutex<Option<(String, Duration)>>,
}

#[async_trait]
impl StoreHarness for UrlHarness {
    async fn open(&self, window: Duration) -> SharedDedupStore {
        let location = (self.fresh_location)(&self.base);
        let store = (self.opener)(location.clone(), window)
            .await
            .unwrap_or_else(|e| panic!("open {location}: {e}"));
        *self.last.lock().unwrap() = Some((location, window));
        store
    }

    async fn reopen(&self) -> Option<SharedDedupStore> {
        let (location, window) = self.last.lock().unwrap().clone()?;
        Some(
            (self.opener)(location.clone(), window)
                .await
                .unwrap_or_else(|e| panic!("reopen {location}: {e}")),
        )
    }

    fn location(&self) -> Option<String> {
        self.last.lock().unwrap().as_ref().map(|l| l.0.clone())
    }

    async fn open_location(&self, location: &str, window: Duration) -> Result<SharedDedupStore> {
        (self.opener)(location.to_string(), window).await
    }

    async fn unusable_locations(&self) -> Vec<String> {
        self.unusable.clone()
    }
}

const HOUR: Duration = Duration::from_secs(3600);
const LEASE: Duration = Duration::from_secs(60);
pub const RACE_CHILD_ENV: &str = "ONCEFLOW_STORE_RACE_CHILD";
const RACE_KEYS: usize = 1000;
const RACE_WORKERS: usize = 8;

/// 2 processes × 8 workers race over the same 1000 keys of one store: every key's handler runs
/// exactly once over both processes, and every key ends completed. `test_path` is the test's
/// name in its binary (the children re-run it with [`RACE_CHILD_ENV`] set).
pub async fn race_two_processes(opener: Opener, location: String, test_path: &str) {
    if let Ok(loc) = std::env::var(RACE_CHILD_ENV) {
        return race_child(opener, loc).await;
    }
    let exe = std::env::current_exe().unwrap();
    let mut children = Vec::new();
    for p in 0..2 {
        let mut child = Command::new(&exe)
            .args([test_path, "--exact", "--nocapture", "--test-threads=1"])
            .env(RACE_CHILD_ENV, &location)
            .env("ONCEFLOW_STORE_RACE_PROCESS", p.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn a racer");
        let out = child.stdout.take().unwrap();
        children.push((
            child,
            std::thread::spawn(move || {
                BufReader::new(out)
                    .lines()
                    .map_while(|l| l.ok())
                    .collect::<Vec<String>>()
            }),
        ));
    }
    let mut handled: HashMap<String, Vec<String>> = HashMap::new();
    for (mut child, lines) in children {
        let lines = tokio::task::spawn_blocking(move || lines.join().unwrap())
            .await
            .unwrap();
        let status = child.wait().unwrap();
        assert!(status.success(), "a racing process failed: {status}");
        for l in lines {
            if let Some(rest) = l.split("HANDLED ").nth(1) {
                let (key, who) = rest.split_once(' ').unwrap();
                handled
                    .entry(key.to_string())
                    .or_default()
                    .push(who.to_string());
            }
        }
    }
    let keys: Vec<String> = (0..RACE_KEYS).map(|i| format!("race-{i}")).collect();
    for k in &keys {
        let who = handled.get(k).cloned().unwrap_or_default();
        assert_eq!(who.len(), 1, "key {k} handled {} times: {who:?}", who.len());
    }
    let procs: HashSet<&str> = handled
        .values()
        .map(|w| w[0].split('/').next().unwrap())
        .collect();
    assert_eq!(
        procs.len(),
        2,
        "only {procs:?} handled keys: no race happened"
    );
    let store = opener(location, HOUR).await.unwrap();
    let states = store.get(&keys).await.unwrap();
    for (k, s) in keys.iter().zip(states) {
        assert!(matches!(s, Some(KeyState::Completed { .. })), "{k}: {s:?}");
    }
}

async fn race_child(opener: Opener, location: String) {
    let store = opener(location, HOUR).await.expect("child: open");
    let proc_id = std::env::var("ONCEFLOW_STORE_RACE_PROCESS").unwrap_or_default();
    let out = Arc::new(Mutex::new(std::io::stdout()));
    let mut tasks = Vec::new();
    for w in 0..RACE_WORKERS {
        let (store, out) = (store.clone(), out.clone());
        let owner = format!("{proc_id}/worker-{w}");
        tasks.push(tokio::spawn(async move {
            let mut order: Vec<usize> = (0..RACE_KEYS).collect();
            {
                use rand::seq::SliceRandom;
                order.shuffle(&mut rand::rng());
            }
            let batch = if w % 2 == 0 { 1 } else { 10 };
            for chunk in order.chunks(batch) {
                let reqs: Vec<ClaimRequest> = chunk
                    .iter()
                    .map(|i| ClaimRequest {
                        key: format!("race-{i}"),
                        owner: owner.clone(),
                        lease: LEASE,
                        fingerprint: None,
                    })
                    .collect();
                let outcomes = store.claim(&reqs).await.expect("claim");
                let mut done = Vec::new();
                for (r, o) in reqs.iter().zip(outcomes) {
                    if let ClaimOutcome::Claimed { token } = o {
                        writeln!(out.lock().unwrap(), "HANDLED {} {owner}", r.key).unwrap();
                        done.push(Completion {
                            key: r.key.clone(),
                            token,
                            result: None,
                        });
                    }
                }
                let ok = store.complete(&done).await.expect("complete");
                assert!(ok.iter().all(|b| *b), "a completion was refused");
            }
        }));
    }
    for t in tasks {
        t.await.expect("worker");
    }
    out.lock().unwrap().flush().unwrap();
}

/// Calls that failed and were retried (while the store restarted).
static RETRIED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Retries `f` until it succeeds (the store is restarting), for at most 60 s.
async fn retry<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) if Instant::now() < deadline => {
                if RETRIED.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                    eprintln!("store unavailable, retrying: {e}");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{what}: still failing after 60 s: {e}"),
        }
    }
}

/// 8 workers claim and complete 3000 keys (batches of 10) while the store's server is
/// restarted by `restart_script` once a third of the keys are done; calls failing meanwhile are
/// retried. Afterwards every key is completed, its handler ran exactly once, and every key
/// completed before the restart is still there.
pub async fn restart_mid_run(store: SharedDedupStore, restart_script: &str) {
    const KEYS: usize = 3000;
    const WORKERS: usize = 8;
    let prefix = rand_hex();
    let keys: Arc<Vec<String>> = Arc::new((0..KEYS).map(|i| format!("{prefix}-{i}")).collect());
    let handled: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let completed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let restart = {
        let (completed, script) = (completed.clone(), restart_script.to_string());
        tokio::spawn(async move {
            while completed.load(std::sync::atomic::Ordering::SeqCst) < KEYS / 3 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let before = completed.load(std::sync::atomic::Ordering::SeqCst);
            let out = tokio::task::spawn_blocking(move || {
                Command::new("bash")
                    .arg(&script)
                    .output()
                    .map(|o| (o, script))
            })
            .await
            .unwrap()
            .expect("run the restart script");
            let (out, script) = out;
            assert!(
                out.status.success(),
                "{script} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            before
        })
    };
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let (store, keys, handled, completed) = (
            store.clone(),
            keys.clone(),
            handled.clone(),
            completed.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let owner = format!("worker-{w}");
            let mut order: Vec<usize> = (0..KEYS).collect();
            {
                use rand::seq::SliceRandom;
                order.shuffle(&mut rand::rng());
            }
            for chunk in order.chunks(10) {
                let reqs: Vec<ClaimRequest> = chunk
                    .iter()
                    .map(|i| ClaimRequest {
                        key: keys[*i].clone(),
                        owner: owner.clone(),
                        lease: LEASE,
                        fingerprint: None,
                    })
                    .collect();
                let outcomes = retry("claim", || store.claim(&reqs)).await;
                let mut done = Vec::new();
                for (r, o) in reqs.iter().zip(outcomes) {
                    if let ClaimOutcome::Claimed { token } = o {
                        *handled.lock().unwrap().entry(r.key.clone()).or_default() += 1;
                        done.push(Completion {
                            key: r.key.clone(),
                            token,
                            result: Some(bytes::Bytes::from(r.key.clone())),
                        });
                    }
                }
                if done.is_empty() {
                    continue;
                }
                let ok = retry("complete", || store.complete(&done)).await;
                assert!(ok.iter().all(|b| *b), "a completion was refused");
                completed.fetch_add(done.len(), std::sync::atomic::Ordering::SeqCst);
            }
        }));
    }
    for t in tasks {
        t.await.expect("worker");
    }
    let before = restart.await.expect("restart task");
    assert!(before < KEYS, "the restart came after the run");
    assert!(
        RETRIED.load(std::sync::atomic::Ordering::SeqCst) > 0,
        "no call failed: the workers never saw the store go away"
    );
    let handled = handled.lock().unwrap().clone();
    for k in keys.iter() {
        assert_eq!(
            handled.get(k),
            Some(&1),
            "key {k} handled {:?} times",
            handled.get(k)
        );
    }
    for chunk in keys.chunks(500) {
        let states = retry("get", || store.get(chunk)).await;
        for (k, s) in chunk.iter().zip(states) {
            match s {
                Some(KeyState::Completed {
                    result: Some(r), ..
                }) if r == k.as_bytes() => {}
                other => panic!("key {k} lost across the restart: {other:?}"),
            }
        }
    }
}

/// Path of a broker script under tests/brokers.
pub fn broker_script(rel: &str) -> String {
    format!("{}/brokers/{rel}", env!("CARGO_MANIFEST_DIR"))
}
