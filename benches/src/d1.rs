//! D1: dedup store throughput, and the Memory figure.
//!
//! - **D1**: 1M random 16-byte keys (32 hex characters) are claimed and completed, then the same
//!   1M keys are replayed (each claim must come back `Duplicate`), in batches of 1, 100 and 1000
//!   keys per call, against a fresh store per run. One caller, awaiting each call before the
//!   next. Requests are built before the clock starts; tokens are filled into prebuilt
//!   completions.
//!   - memory store, target ≤ 200 ns per operation at every batch size, where an operation is
//!     one key's claim, completion or replayed claim (a first delivery is two operations);
//!   - embedded store, target ≥ 100k keys/s at batch 1000 (a key counts once for its claim and
//!     completion together, once for its replay). Batches of 1 and 100 are reported as `INFO`;
//!     batch 1 runs on fewer keys to keep the run short, and says so.
//! - **Memory**: RSS growth (VmRSS from `/proc/self/status`) of a memory store holding 1M
//!   completed keys, measured first in the process, before anything else was allocated and freed.
//!   Target < 200 MB.

use std::time::{Duration, Instant};

use onceflow_core::dedup::{
    ClaimOutcome, ClaimRequest, Completion, DedupStore, EmbeddedStore, MemoryStore,
};

const KEYS: usize = 1_000_000;
/// Keys for the embedded store at batch 1 (one transaction per call) and batch 100, to keep
/// the whole run near two minutes on a 2-core machine; the output line says so.
const EMBEDDED_B1_KEYS: usize = 20_000;
const EMBEDDED_B100_KEYS: usize = 200_000;
const BATCHES: [usize; 3] = [1, 100, 1000];
const WINDOW: Duration = Duration::from_secs(24 * 3600);
const LEASE: Duration = Duration::from_secs(60);
const MEMORY_TARGET_NS: f64 = 200.0;
const EMBEDDED_TARGET_KEYS_PER_S: f64 = 100_000.0;
const RSS_TARGET_MB: f64 = 200.0;

/// Runs D1 and the Memory figure; prints one line per figure.
pub fn run() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async {
        let n_keys = env_usize("ONCEFLOW_D1_KEYS").unwrap_or(KEYS);
        let stores =
            std::env::var("ONCEFLOW_D1_STORES").unwrap_or_else(|_| "memory,embedded".into());
        let keys: Vec<String> = (0..n_keys)
            .map(|_| hex::encode(rand::random::<[u8; 16]>()))
            .collect();

        if stores.contains("memory") {
            memory_figure(&keys).await;
            baseline(&keys);
        }

        for batch in BATCHES.into_iter().filter(|_| stores.contains("memory")) {
            let store = MemoryStore::new(WINDOW, 2 * KEYS as u64);
            let r = measure(&store, &keys, batch).await;
            let first_ns = r.first.as_nanos() as f64 / (2 * r.keys) as f64;
            let replay_ns = r.replay.as_nanos() as f64 / r.keys as f64;
            ratio_max(
                &format!("memory_b{batch}_first_ns_per_op(claim|complete)"),
                first_ns,
                MEMORY_TARGET_NS,
            );
            ratio_max(
                &format!("memory_b{batch}_replay_ns_per_op"),
                replay_ns,
                MEMORY_TARGET_NS,
            );
            info(
                &format!("memory_b{batch}_first_cpu_ns_per_op(claim|complete)"),
                r.first_cpu.as_nanos() as f64 / (2 * r.keys) as f64,
            );
            info(
                &format!("memory_b{batch}_replay_cpu_ns_per_op"),
                r.replay_cpu.as_nanos() as f64 / r.keys as f64,
            );
        }

        let dir = tempfile::Builder::new()
            .prefix("onceflow-bench-d1-")
            .tempdir()
            .expect("temporary directory");
        for batch in BATCHES.into_iter().filter(|_| stores.contains("embedded")) {
            let n = match batch {
                1 => EMBEDDED_B1_KEYS.min(n_keys),
                100 => EMBEDDED_B100_KEYS.min(n_keys),
                _ => n_keys,
            };
            let path = dir.path().join(format!("d1-b{batch}.db"));
            let store = EmbeddedStore::open(&path, WINDOW)
                .await
                .expect("open the embedded store");
            let r = measure(&store, &keys[..n], batch).await;
            drop(store);
            let size_mb = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0) as f64 / 1e6;
            let first = r.keys as f64 / r.first.as_secs_f64();
            let replay = r.keys as f64 / r.replay.as_secs_f64();
            let what = |phase: &str| {
                let note = if n < n_keys {
                    format!("({}k_keys_not_{}k)", n / 1000, n_keys / 1000)
                } else {
                    String::new()
                };
                format!("embedded_b{batch}_{phase}_keys_per_s{note}")
            };
            if batch == 1000 {
                ratio_min(
                    &what("first(claim+complete)"),
                    first,
                    EMBEDDED_TARGET_KEYS_PER_S,
                );
                ratio_min(&what("replay"), replay, EMBEDDED_TARGET_KEYS_PER_S);
            } else {
                info(&what("first(claim+complete)"), first);
                info(&what("replay"), replay);
            }
            info(
                &what("first(claim+complete)_cpu"),
                r.keys as f64 / r.first_cpu.as_secs_f64(),
            );
            info(
                &what("replay_cpu"),
                r.keys as f64 / r.replay_cpu.as_secs_f64(),
            );
            info(&format!("embedded_b{batch}_file_MB"), size_mb);
        }
    });
}

/// Calibration: a bare `std::collections::HashSet<String>` over the same keys (insert with a
/// clone, then look up), so the memory store's figures can be read against this machine.
fn baseline(keys: &[String]) {
    let mut set = std::collections::HashSet::new();
    let (start, cpu) = (Instant::now(), crate::cpu::process_cpu());
    for k in keys {
        set.insert(k.clone());
    }
    let (insert, insert_cpu) = (start.elapsed(), crate::cpu::process_cpu() - cpu);
    let (start, cpu) = (Instant::now(), crate::cpu::process_cpu());
    let found = keys.iter().filter(|k| set.contains(*k)).count();
    let (lookup, lookup_cpu) = (start.elapsed(), crate::cpu::process_cpu() - cpu);
    assert_eq!(found, keys.len());
    let per = |d: Duration| d.as_nanos() as f64 / keys.len() as f64;
    info("baseline_std_hashset_insert_ns_per_op", per(insert));
    info("baseline_std_hashset_insert_cpu_ns_per_op", per(insert_cpu));
    info("baseline_std_hashset_lookup_ns_per_op", per(lookup));
    info("baseline_std_hashset_lookup_cpu_ns_per_op", per(lookup_cpu));
}

struct Run {
    keys: usize,
    first: Duration,
    replay: Duration,
    /// Process CPU time (user + system) of each phase.
    first_cpu: Duration,
    replay_cpu: Duration,
}

/// Claims and completes every key, then replays them all, `batch` keys per call.
async fn measure(store: &dyn DedupStore, keys: &[String], batch: usize) -> Run {
    let claims: Vec<Vec<ClaimRequest>> = keys
        .chunks(batch)
        .map(|c| {
            c.iter()
                .map(|k| ClaimRequest {
                    key: k.clone(),
                    owner: "bench-worker".into(),
                    lease: LEASE,
                    fingerprint: None,
                })
                .collect()
        })
        .collect();
    let mut completions: Vec<Vec<Completion>> = keys
        .chunks(batch)
        .map(|c| {
            c.iter()
                .map(|k| Completion {
                    key: k.clone(),
                    token: 0,
                    result: None,
                })
                .collect()
        })
        .collect();

    let (start, cpu) = (Instant::now(), crate::cpu::process_cpu());
    for (reqs, done) in claims.iter().zip(completions.iter_mut()) {
        let outcomes = store.claim(reqs).await.expect("claim");
        for (o, c) in outcomes.iter().zip(done.iter_mut()) {
            match o {
                ClaimOutcome::Claimed { token } => c.token = *token,
                other => panic!("first claim of {}: {other:?}", c.key),
            }
        }
        let ok = store.complete(done).await.expect("complete");
        assert!(ok.iter().all(|b| *b), "a completion was refused");
    }
    let (first, first_cpu) = (start.elapsed(), crate::cpu::process_cpu() - cpu);

    let (start, cpu) = (Instant::now(), crate::cpu::process_cpu());
    for reqs in &claims {
        let outcomes = store.claim(reqs).await.expect("replay claim");
        assert!(
            outcomes
                .iter()
                .all(|o| matches!(o, ClaimOutcome::Duplicate { .. })),
            "a replayed key was not a duplicate"
        );
    }
    let (replay, replay_cpu) = (start.elapsed(), crate::cpu::process_cpu() - cpu);
    Run {
        keys: keys.len(),
        first,
        replay,
        first_cpu,
        replay_cpu,
    }
}

/// RSS growth of a memory store holding every key (claimed and completed, batch 1000).
async fn memory_figure(keys: &[String]) {
    let claims: Vec<Vec<ClaimRequest>> = keys
        .chunks(1000)
        .map(|c| {
            c.iter()
                .map(|k| ClaimRequest {
                    key: k.clone(),
                    owner: "bench-worker".into(),
                    lease: LEASE,
                    fingerprint: None,
                })
                .collect()
        })
        .collect();
    let mut completions: Vec<Vec<Completion>> = keys
        .chunks(1000)
        .map(|c| {
            c.iter()
                .map(|k| Completion {
                    key: k.clone(),
                    token: 0,
                    result: None,
                })
                .collect()
        })
        .collect();
    let before = rss_kib();
    let store = MemoryStore::new(WINDOW, 10_000_000);
    for (reqs, done) in claims.iter().zip(completions.iter_mut()) {
        let outcomes = store.claim(reqs).await.expect("claim");
        for (o, c) in outcomes.iter().zip(done.iter_mut()) {
            if let ClaimOutcome::Claimed { token } = o {
                c.token = *token;
            }
        }
        store.complete(done).await.expect("complete");
    }
    let after = rss_kib();
    assert_eq!(store.len(), keys.len(), "the store lost keys");
    let delta_mb = (after.saturating_sub(before)) as f64 * 1024.0 / 1e6;
    let what = format!("memory_store_{}k_keys_rss_delta_MB", keys.len() / 1000);
    let pass = delta_mb < RSS_TARGET_MB;
    println!(
        "RATIO Memory {what} {delta_mb:.1} target <{RSS_TARGET_MB} {}",
        verdict(pass)
    );
    drop(store);
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// VmRSS of this process, in KiB (0 where /proc is not available).
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn verdict(pass: bool) -> &'static str {
    if pass {
        "PASS"
    } else {
        "MISS"
    }
}

fn ratio_max(what: &str, value: f64, target: f64) {
    println!(
        "RATIO D1 {what} {value:.1} target <={target} {}",
        verdict(value <= target)
    );
}

fn ratio_min(what: &str, value: f64, target: f64) {
    println!(
        "RATIO D1 {what} {value:.0} target >={target} {}",
        verdict(value >= target)
    );
}

fn info(what: &str, value: f64) {
    println!("INFO D1 {what} {value:.0}");
}
