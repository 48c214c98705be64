//! D1 for the shared stores: Redis and PostgreSQL (`stores` id).
//!
//! Random 16-byte keys (32 hex characters) are claimed and completed, then replayed (each claim
//! must come back `Duplicate`), in batches of 1, 100 and 1000 keys per call, one caller awaiting
//! each call, against a fresh key space per run (Redis: a new key prefix; PostgreSQL: a new
//! schema). A key counts once for its claim and completion together, once for its replay.
//!
//! Each run is paired with the **raw client** doing the same commands in the same process:
//! for Redis, the same pipelines (per batch: one native `SET key value NX GET PX ms` per key,
//! then the completion's `EVALSHA` chunks) over a bare multiplexed connection of the `redis`
//! crate; for PostgreSQL, the same two statements (the one-statement claim, then the
//! completion), prepared once, over one bare `tokio-postgres` connection with the store's
//! session settings (`plan_cache_mode=force_custom_plan`). Raw and onceflow runs
//! alternate, three times each (raw, onceflow, onceflow, raw, raw, onceflow), and the best
//! of each is kept; before each Redis run the bench waits until redis-server is not rewriting
//! its append-only file. The ratio is onceflow's time over the raw client's (target ≤ 1.1).
//! Printed for information: this process's CPU time per key (client) and, for Redis,
//! redis-server's (`INFO cpu`) for each contender, to show where the time goes.
//!
//! Targets: Redis ≥ 100k keys/s pipelined (batch 1000), PostgreSQL ≥ 30k keys/s at batch 1000.
//! Needs `ONCEFLOW_REDIS_URL` / `ONCEFLOW_POSTGRES_URL` (`tests/brokers/up.sh redis postgres`);
//! a store whose URL is missing is reported as `SKIP`.

use std::time::{Duration, Instant};

use onceflow_core::dedup::{ClaimOutcome, ClaimRequest, Completion, DedupStore};
use redis::Value;

const BATCHES: [usize; 3] = [1, 100, 1000];
/// Short, so the keys a run leaves behind expire by themselves soon after.
const WINDOW: Duration = Duration::from_secs(600);
const LEASE: Duration = Duration::from_secs(60);
const REDIS_TARGET: f64 = 100_000.0;
const POSTGRES_TARGET: f64 = 30_000.0;
const RATIO_TARGET: f64 = 1.1;

/// Keys per run for a store at a batch size (keeps the whole id near three minutes).
fn keys_for(store: &str, batch: usize) -> usize {
    let env = std::env::var("ONCEFLOW_STORES_KEYS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok());
    let default = match (store, batch) {
        ("redis", 1) => 10_000,
        ("redis", _) => 200_000,
        (_, 1) => 2_000,
        (_, 100) => 20_000,
        _ => 100_000,
    };
    env.map_or(default, |n| n.min(default))
}

/// Runs the Redis and PostgreSQL D1 figures.
pub fn run() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async {
        match std::env::var("ONCEFLOW_REDIS_URL") {
            Ok(url) if !url.is_empty() => redis_figures(&url).await,
            _ => {
                println!("SKIP D1 redis: ONCEFLOW_REDIS_URL is not set (tests/brokers/up.sh redis)")
            }
        }
        match std::env::var("ONCEFLOW_POSTGRES_URL") {
            Ok(url) if !url.is_empty() => postgres_figures(&url).await,
            _ => println!(
                "SKIP D1 postgres: ONCEFLOW_POSTGRES_URL is not set (tests/brokers/up.sh postgres)"
            ),
        }
    });
}

fn random_keys(n: usize) -> Vec<String> {
    (0..n)
        .map(|_| hex::encode(rand::random::<[u8; 16]>()))
        .collect()
}

fn suffix() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// Elapsed time of the first phase (claim + complete) and of the replay, and the CPU time this
/// process (the client) and the server spent on both.
#[derive(Debug, Clone, Copy)]
struct Times {
    first: Duration,
    replay: Duration,
    client_cpu: Duration,
    /// Redis only (`INFO cpu` before and after; includes any other client of the server).
    server_cpu: Duration,
}

impl Times {
    fn best(self, other: Times) -> Times {
        Times {
            first: self.first.min(other.first),
            replay: self.replay.min(other.replay),
            client_cpu: self.client_cpu.min(other.client_cpu),
            server_cpu: self.server_cpu.min(other.server_cpu),
        }
    }
}

/// Rounds per contender; the order alternates (raw first in even rounds, onceflow first in odd
/// ones) and the best of each contender is kept.
const ROUNDS: usize = 3;

/// Claims and completes every key, then replays them, through a store.
async fn through_store(store: &dyn DedupStore, keys: &[String], batch: usize) -> Times {
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
    let first = start.elapsed();
    let start = Instant::now();
    for reqs in &claims {
        let outcomes = store.claim(reqs).await.expect("replay claim");
        assert!(
            outcomes
                .iter()
                .all(|o| matches!(o, ClaimOutcome::Duplicate { .. })),
            "a replayed key was not a duplicate"
        );
    }
    Times {
        first,
        replay: start.elapsed(),
        client_cpu: crate::cpu::process_cpu() - cpu,
        server_cpu: Duration::ZERO,
    }
}

fn report(store: &str, batch: usize, n: usize, ours: Times, raw: Times, target: f64) {
    let first = n as f64 / ours.first.as_secs_f64();
    let replay = n as f64 / ours.replay.as_secs_f64();
    let what = |phase: &str| format!("{store}_b{batch}_{phase}_keys_per_s({}k_keys)", n / 1000);
    if batch == 1000 {
        ratio_min(&what("first(claim+complete)"), first, target);
        ratio_min(&what("replay"), replay, target);
    } else {
        info(&what("first(claim+complete)"), first);
        info(&what("replay"), replay);
    }
    info(
        &format!("{store}_b{batch}_raw_first_keys_per_s"),
        n as f64 / raw.first.as_secs_f64(),
    );
    info(
        &format!("{store}_b{batch}_raw_replay_keys_per_s"),
        n as f64 / raw.replay.as_secs_f64(),
    );
    let per_key = |d: Duration| d.as_secs_f64() * 1e6 / (2 * n) as f64;
    info(
        &format!("{store}_b{batch}_client_cpu_ns_per_key_onceflow"),
        per_key(ours.client_cpu) * 1e3,
    );
    info(
        &format!("{store}_b{batch}_client_cpu_ns_per_key_raw"),
        per_key(raw.client_cpu) * 1e3,
    );
    if !ours.server_cpu.is_zero() {
        info(
            &format!("{store}_b{batch}_server_cpu_ns_per_key_onceflow"),
            per_key(ours.server_cpu) * 1e3,
        );
        info(
            &format!("{store}_b{batch}_server_cpu_ns_per_key_raw"),
            per_key(raw.server_cpu) * 1e3,
        );
    }
    let cost = (ours.first + ours.replay).as_secs_f64() / (raw.first + raw.replay).as_secs_f64();
    println!(
        "RATIO D1 {store}_b{batch}_time_vs_raw_client {cost:.3} target <={RATIO_TARGET} {}",
        verdict(cost <= RATIO_TARGET)
    );
}

// ---------------------------------------------------------------------------------------------
// Redis.

async fn redis_figures(url: &str) {
    let complete_lua = onceflow_redis::RedisStore::bench_complete_script();
    let complete_sha = redis::Script::new(complete_lua).get_hash().to_string();
    let client = redis::Client::open(url).expect("redis client");
    let mut raw = client
        .get_multiplexed_async_connection()
        .await
        .expect("raw redis connection");
    let info_line: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut raw)
        .await
        .unwrap_or_default();
    let version = info_line
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("?")
        .trim()
        .to_string();
    println!("INFO D1 redis_server_version {version}");
    // As the store does when it opens (the server may have lost its script cache).
    let _: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(complete_lua)
        .query_async(&mut raw)
        .await
        .expect("SCRIPT LOAD");
    for batch in BATCHES {
        let n = keys_for("redis", batch);
        let mut ours: Option<Times> = None;
        let mut base: Option<Times> = None;
        for round in 0..ROUNDS * 2 {
            // raw, onceflow, onceflow, raw, raw, onceflow
            let raw_turn = (round % 2 == 0) == (round / 2 % 2 == 0);
            let keys = random_keys(n);
            redis_quiesce(&mut raw).await;
            let server = redis_server_cpu(&mut raw).await;
            if raw_turn {
                let prefix = format!("bench-raw-{}:", suffix());
                let mut t = redis_raw(&mut raw, &complete_sha, &prefix, &keys, batch).await;
                t.server_cpu = redis_server_cpu(&mut raw).await.saturating_sub(server);
                base = Some(base.map_or(t, |b| b.best(t)));
                redis_unlink(&mut raw, &prefix, &keys).await;
            } else {
                let prefix = format!("bench-{}:", suffix());
                let store =
                    onceflow_redis::RedisStore::open(&format!("{url}?prefix={prefix}"), WINDOW)
                        .await
                        .expect("open the Redis store");
                let server = redis_server_cpu(&mut raw).await;
                let mut t = through_store(&store, &keys, batch).await;
                t.server_cpu = redis_server_cpu(&mut raw).await.saturating_sub(server);
                ours = Some(ours.map_or(t, |b| b.best(t)));
                redis_unlink(&mut raw, &prefix, &keys).await;
            }
        }
        report(
            "redis",
            batch,
            n,
            ours.unwrap(),
            base.unwrap(),
            REDIS_TARGET,
        );
    }
}

/// redis-server's CPU time so far (user + system, all its threads; `INFO cpu`, µs resolution).
async fn redis_server_cpu(conn: &mut redis::aio::MultiplexedConnection) -> Duration {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(conn)
        .await
        .unwrap_or_default();
    let secs: f64 = info
        .lines()
        .filter_map(|l| {
            l.strip_prefix("used_cpu_sys:")
                .or_else(|| l.strip_prefix("used_cpu_user:"))
        })
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .sum();
    Duration::from_secs_f64(secs)
}

/// Waits (untimed) until redis-server is not rewriting its append-only file: a rewrite forks
/// a child that competes for the same 2 cores and would land on whichever contender runs.
async fn redis_quiesce(conn: &mut redis::aio::MultiplexedConnection) {
    for _ in 0..600 {
        let info: String = redis::cmd("INFO")
            .arg("persistence")
            .query_async(conn)
            .await
            .unwrap_or_default();
        let busy = info.lines().any(|l| {
            matches!(
                l.trim(),
                "aof_rewrite_in_progress:1"
                    | "aof_rewrite_scheduled:1"
                    | "rdb_bgsave_in_progress:1"
            )
        });
        if !busy {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Deletes a run's keys (untimed), so every run starts on the same keyspace: without it the
/// keys of earlier runs (millions, for the window) grow Redis's tables and expire, by Redis's
/// active expiry, in the middle of later runs.
async fn redis_unlink(conn: &mut redis::aio::MultiplexedConnection, prefix: &str, keys: &[String]) {
    for chunk in keys.chunks(50_000) {
        let mut pipe = redis::pipe();
        for c in chunk.chunks(1000) {
            let cmd = pipe.cmd("UNLINK");
            for k in c {
                cmd.arg(format!("{prefix}{k}"));
            }
            cmd.ignore();
        }
        let () = pipe.query_async(conn).await.expect("UNLINK a run's keys");
    }
}

/// The store's commands over a bare connection, in the store's pipelines of
/// `SCRIPT_CHUNK` keys sent back to back: per batch the native claims
/// (`SET key value NX GET PX lease+window`, the value in the store's format 1: state 1, token
/// 1, no fingerprint, the window, the owner), tokens read from the replies (nil: a new key,
/// token 1), then the `EVALSHA complete` chunks; then the replay's claims
/// (every reply must be a completed value).
async fn redis_raw(
    conn: &mut redis::aio::MultiplexedConnection,
    complete_sha: &str,
    prefix: &str,
    keys: &[String],
    batch: usize,
) -> Times {
    let window = (WINDOW.as_millis() as u64).to_string();
    let ttl = (LEASE + WINDOW).as_millis() as u64;
    let value = format!("111||{window}|bench-worker");
    let chunk = onceflow_redis::SCRIPT_CHUNK;
    // As the store sends them: pipelines of `chunk` keys back to back, replies in order.
    let claim_pipe = |batch_keys: &[String]| -> Vec<redis::Pipeline> {
        batch_keys
            .chunks(chunk)
            .map(|c| {
                let mut pipe = redis::pipe();
                for k in c {
                    pipe.cmd("SET")
                        .arg(format!("{prefix}{k}"))
                        .arg(&value)
                        .arg("NX")
                        .arg("GET")
                        .arg("PX")
                        .arg(ttl);
                }
                pipe
            })
            .collect()
    };
    let send = |pipes: Vec<redis::Pipeline>| {
        let conn = conn.clone();
        async move {
            let parts = futures::future::try_join_all(pipes.iter().map(|p| {
                let mut conn = conn.clone();
                async move { p.query_async::<Vec<Value>>(&mut conn).await }
            }))
            .await?;
            Ok::<Vec<Value>, redis::RedisError>(parts.into_iter().flatten().collect())
        }
    };
    let (start, cpu) = (Instant::now(), crate::cpu::process_cpu());
    for b in keys.chunks(batch) {
        let replies = send(claim_pipe(b)).await.expect("raw claim");
        let mut tokens = Vec::with_capacity(b.len());
        for r in &replies {
            match r {
                Value::Nil => tokens.push(1u64),
                other => panic!("raw first claim: {other:?}"),
            }
        }
        let mut pipes = Vec::new();
        for (c, t) in b.chunks(chunk).zip(tokens.chunks(chunk)) {
            let mut pipe = redis::pipe();
            let cmd = pipe.cmd("EVALSHA").arg(complete_sha).arg(c.len());
            for k in c {
                cmd.arg(format!("{prefix}{k}"));
            }
            cmd.arg(&window);
            for tok in t {
                cmd.arg(tok.to_string()).arg("");
            }
            pipes.push(pipe);
        }
        let done = send(pipes).await.expect("raw complete");
        assert_eq!(done.len(), b.len().div_ceil(chunk));
    }
    let first = start.elapsed();
    let start = Instant::now();
    for b in keys.chunks(batch) {
        let replies = send(claim_pipe(b)).await.expect("raw replay");
        for r in &replies {
            assert!(
                matches!(r, Value::BulkString(v) if v.starts_with(b"12")),
                "raw replay: {r:?}"
            );
        }
    }
    Times {
        first,
        replay: start.elapsed(),
        client_cpu: crate::cpu::process_cpu() - cpu,
        server_cpu: Duration::ZERO,
    }
}

// ---------------------------------------------------------------------------------------------
// PostgreSQL.

/// The PostgreSQL store in a schema of its own (named in `schemas`, dropped at the end).
async fn fresh_store(url: &str, schemas: &mut Vec<String>) -> onceflow_postgres::PostgresStore {
    let schema = format!("bench_{}", suffix());
    let store = onceflow_postgres::PostgresStore::open(
        &format!("{url}?schema={schema}&pool_size=2"),
        WINDOW,
    )
    .await
    .expect("open the PostgreSQL store");
    schemas.push(schema);
    store
}

async fn postgres_figures(url: &str) {
    // The store's session settings (sent at connection start; see onceflow-postgres's URL docs).
    let mut config: tokio_postgres::Config = url.parse().expect("PostgreSQL URL");
    config.options("-c plan_cache_mode=force_custom_plan");
    let (raw, conn) = config
        .connect(tokio_postgres::NoTls)
        .await
        .expect("raw PostgreSQL connection");
    tokio::spawn(conn);
    let version: String = raw
        .query_one("SHOW server_version", &[])
        .await
        .map(|r| r.get(0))
        .unwrap_or_default();
    println!("INFO D1 postgres_server_version {version}");
    let mut schemas = Vec::new();
    for batch in BATCHES {
        let n = keys_for("postgres", batch);
        let mut ours: Option<Times> = None;
        let mut base: Option<Times> = None;
        for round in 0..ROUNDS * 2 {
            // raw, onceflow, onceflow, raw, raw, onceflow
            let raw_turn = (round % 2 == 0) == (round / 2 % 2 == 0);
            if !raw_turn {
                let store = fresh_store(url, &mut schemas).await;
                let keys = random_keys(n);
                let t = through_store(&store, &keys, batch).await;
                ours = Some(ours.map_or(t, |b| b.best(t)));
                continue;
            }
            // Raw: a fresh schema made by the store, then only the bare connection uses it.
            let store = fresh_store(url, &mut schemas).await;
            let statements: Vec<String> = store
                .bench_statements()
                .iter()
                .map(|s| s.to_string())
                .collect();
            let keys = random_keys(n);
            let t = postgres_raw(&raw, &statements, &keys, batch).await;
            base = Some(base.map_or(t, |b| b.best(t)));
            drop(store);
        }
        report(
            "postgres",
            batch,
            n,
            ours.unwrap(),
            base.unwrap(),
            POSTGRES_TARGET,
        );
    }
    for s in schemas {
        let _ = raw
            .batch_execute(&format!("DROP SCHEMA \"{s}\" CASCADE"))
            .await;
    }
}

/// The store's statements over a bare connection, prepared once: per batch the claim
/// statement (keys sorted, as the store sends them), tokens read from its rows, then the
/// completion statement; then the replay's claims (every row must come back completed).
async fn postgres_raw(
    client: &tokio_postgres::Client,
    statements: &[String],
    keys: &[String],
    batch: usize,
) -> Times {
    let claim = client.prepare(&statements[0]).await.expect("prepare");
    let complete = client.prepare(&statements[1]).await.expect("prepare");
    let window = WINDOW.as_millis() as i64;
    let lease = LEASE.as_millis() as i64;
    let claim_args = |b: &[String]| {
        let mut sorted: Vec<String> = b.to_vec();
        sorted.sort();
        let owners: Vec<String> = sorted.iter().map(|_| "bench-worker".to_string()).collect();
        let leases: Vec<i64> = sorted.iter().map(|_| lease).collect();
        let fps: Vec<Option<Vec<u8>>> = sorted.iter().map(|_| None).collect();
        (sorted, owners, leases, fps)
    };
    let (start, cpu) = (Instant::now(), crate::cpu::process_cpu());
    for b in keys.chunks(batch) {
        let (sorted, owners, leases, fps) = claim_args(b);
        let rows = client
            .query(&claim, &[&sorted, &owners, &leases, &fps, &window])
            .await
            .expect("raw claim");
        let mut tokens = vec![0i64; sorted.len()];
        for r in &rows {
            let ord: i64 = r.get(0);
            let token: Option<i64> = r.get(1);
            tokens[(ord - 1) as usize] = token.expect("raw first claim: not claimed");
        }
        let results: Vec<Option<Vec<u8>>> = sorted.iter().map(|_| None).collect();
        let done = client
            .query(&complete, &[&sorted, &tokens, &results, &window])
            .await
            .expect("raw complete");
        assert_eq!(done.len(), sorted.len());
    }
    let first = start.elapsed();
    let start = Instant::now();
    for b in keys.chunks(batch) {
        let (sorted, owners, leases, fps) = claim_args(b);
        let rows = client
            .query(&claim, &[&sorted, &owners, &leases, &fps, &window])
            .await
            .expect("raw replay");
        assert_eq!(rows.len(), sorted.len());
        assert!(
            rows.iter()
                .all(|r| r.get::<_, Option<i64>>(1).is_none()
                    && r.get::<_, Option<i16>>(3) == Some(2))
        );
    }
    Times {
        first,
        replay: start.elapsed(),
        client_cpu: crate::cpu::process_cpu() - cpu,
        server_cpu: Duration::ZERO,
    }
}

fn verdict(pass: bool) -> &'static str {
    if pass {
        "PASS"
    } else {
        "MISS"
    }
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
