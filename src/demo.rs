//! `onceflow demo`: the main job. Produces keyed order events (with duplicate sends mixed in,
//! as a retrying upstream producer would), runs an exactly-once consume-transform-produce
//! pipeline with injected redeliveries and simulated crashes and restarts, then reads the
//! output back and checks that every order is there exactly once.

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use onceflow::{
    BoxError, ConsumerConfig, EngineConfig, Error, Guarantee, Message, Metrics, MetricsSnapshot,
    Pipeline, PipelineConfig, ProducerConfig, Record, Result, StartFrom, TopicSpec, Transform,
};

/// Most orders a demo runs (`--messages`), on any platform: the check at the end keeps one entry
/// per order in memory (about 2.3 GB at this bound), and on a real broker a larger run is a
/// benchmark, not a demo.
pub const MAX_MESSAGES: u64 = 100_000_000;

/// Most orders a demo runs on `memory://`: the in-process broker keeps every input and output
/// record in this process, about 1.5 KB per order (measured: 104 MB of RSS at 50 000 orders,
/// 331 MB at 200 000), so this bound is about 1.5 GB; larger runs aborted out of memory.
pub const MAX_MEMORY_MESSAGES: u64 = 1_000_000;

/// `onceflow demo` options.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Platform URL to run on.
    #[arg(
        long,
        env = "ONCEFLOW_URL",
        hide_env_values = true,
        default_value = "memory://demo"
    )]
    url: String,
    /// A setting added to the URL's query, KEY=VALUE (repeatable), e.g.
    /// `-o security.protocol=SASL_SSL`; prefer ONCEFLOW_URL for secrets.
    #[arg(long = "option", short = 'o', value_name = "KEY=VALUE")]
    options: Vec<String>,
    /// Number of distinct order events to produce: 1 to 100 000 000, and at most 1 000 000 on
    /// memory://, which keeps every record in this process (about 1.5 KB per order).
    #[arg(
        long,
        default_value_t = 100_000,
        allow_negative_numbers = true,
        value_parser = crate::demo_message_count
    )]
    messages: u64,
    /// Dedup store URL: memory://, a file path / embedded:///path, redis://… or postgres://…
    /// (default: an embedded store in a temporary directory). Each run claims its orders under
    /// a fresh namespace and keeps them for the one-hour dedup window, so a file reused by many
    /// runs within an hour grows (about 170 bytes per order) until expired keys are purged.
    #[arg(long)]
    dedup: Option<String>,
    /// Simulate a crash after every K transformed messages, at the earliest once the restarted
    /// run has committed a transaction, so each restart makes progress (0 = never; default: a
    /// third of the messages on memory://, never on a real broker, whose crash tests kill real
    /// processes).
    #[arg(long, allow_negative_numbers = true, value_parser = crate::count)]
    crash_every: Option<u64>,
    /// Partitions of the demo topics (≥ 1; memory:// holds at most 100 000 per topic).
    #[arg(
        long,
        default_value_t = 8,
        allow_negative_numbers = true,
        value_parser = crate::partition_count
    )]
    partitions: u32,
}

fn order_payload(id: u64) -> Vec<u8> {
    let customer = id % 977;
    let amount = 100 + (id * 7919) % 50_000;
    format!(r#"{{"order_id":{id},"customer":"c{customer}","amount_cents":{amount}}}"#).into_bytes()
}

/// Turns an order into its billed total (amount plus 8% tax), keyed by customer.
struct BillOrder {
    out_topic: String,
    processed: Arc<AtomicU64>,
    /// Crash once the transform calls of the whole run reach this...
    crash_at: Option<u64>,
    /// ...and this run has committed at least once (read from the pipeline's metrics, set once
    /// the pipeline exists), so every restart makes progress.
    metrics: Arc<OnceLock<Metrics>>,
    fired: AtomicBool,
    crash: Arc<tokio::sync::Notify>,
}

#[async_trait::async_trait]
impl Transform for BillOrder {
    async fn transform(&self, m: &Message) -> std::result::Result<Vec<Record>, BoxError> {
        let v: serde_json::Value = serde_json::from_slice(&m.payload)?;
        let id = v["order_id"].as_u64().ok_or("order without order_id")?;
        let amount = v["amount_cents"]
            .as_u64()
            .ok_or("order without amount_cents")?;
        let customer = v["customer"].as_str().unwrap_or_default().to_string();
        let n = self.processed.fetch_add(1, Ordering::Relaxed) + 1;
        if self.crash_at.is_some_and(|c| n >= c)
            && self.metrics.get().is_some_and(|m| {
                let s = m.snapshot();
                s.transactions_committed > 0 || s.commits > 0
            })
            && !self.fired.swap(true, Ordering::Relaxed)
        {
            self.crash.notify_one();
        }
        let total = amount + amount * 8 / 100;
        let payload =
            format!(r#"{{"order_id":{id},"customer":"{customer}","total_cents":{total}}}"#);
        Ok(vec![Record::new(
            self.out_topic.clone(),
            payload.into_bytes(),
        )
        .key(customer.into_bytes())])
    }
}

fn add(a: &mut MetricsSnapshot, b: MetricsSnapshot) {
    a.consumed += b.consumed;
    a.processed += b.processed;
    a.duplicates_skipped += b.duplicates_skipped;
    a.transactions_committed += b.transactions_committed;
    a.transactions_aborted += b.transactions_aborted;
    a.rebalances += b.rebalances;
    a.produced += b.produced;
}

/// Runs the demo; exit 0 when every order reached the output exactly once. The steps: the
/// dedup store and the topics ([`store_url`], [`create_topics`]), the orders
/// ([`produce_orders`]), the pipeline with its crashes and restarts ([`run_pipeline`]), the
/// output read back ([`verify_output`]) and the summary ([`Summary::print`]).
pub async fn run(mut a: DemoArgs) -> Result<ExitCode> {
    let started = Instant::now();
    a.url = crate::cli::with_options(&a.url, &a.options)?;
    let n = a.messages;
    check_size(&a)?;
    let names = Names::new();

    // The dedup store first: a bad --dedup is refused before any topic is made on the broker.
    let (_tmp, store_url) = store_url(&a)?;
    let store = onceflow::dedup_store(&store_url, Duration::from_secs(3600)).await?;
    let client = crate::cli::connect(&a.url).await?;
    create_topics(&client, &names, a.partitions).await?;
    warn_line!(
        "onceflow demo on {} ({} partitions), dedup store {} ({})",
        onceflow::shown(&onceflow::redact_credentials(&a.url)),
        a.partitions,
        store.name(),
        onceflow::shown(&onceflow::redact_url(&store_url))
    );

    // 1. Produce the orders, with ~1% sent twice (same idempotency key) like a retrying producer.
    let produced = produce_orders(&client, &names.input, n).await?;

    // 2. Fault injection where the platform allows it (memory://): redeliver ~1 in 50 polls.
    #[cfg(feature = "memory")]
    let faults = if a.url.starts_with("memory://") {
        let f = onceflow::memory::connect(&a.url)?.faults();
        f.redeliver_every(50);
        Some(f)
    } else {
        None
    };

    // 3. Run the pipeline; crash it every K processed messages and restart it.
    let runs = run_pipeline(&a, &client, &names, &store).await?;
    #[cfg(feature = "memory")]
    let redelivered_by_faults = faults.as_ref().map(|f| {
        f.stop_redelivery();
        f.redelivered()
    });
    #[cfg(not(feature = "memory"))]
    let redelivered_by_faults: Option<u64> = None;
    // On memory:// the broker's own tally of aborted transactions also counts those a simulated
    // crash left unfinished (ended when the crashed run was dropped or fenced on restart), which
    // the pipeline's metrics cannot see.
    #[cfg(feature = "memory")]
    let aborted_by_broker = faults
        .as_ref()
        .map(|f| f.aborted_transactions(&names.tx_id));
    #[cfg(not(feature = "memory"))]
    let aborted_by_broker: Option<u64> = None;
    let aborted_by_crashes =
        aborted_by_broker.map_or(0, |b| b.saturating_sub(runs.totals.transactions_aborted));

    // 4. Read the output back (read-committed) and check every order is there exactly once.
    let verified = verify_output(&client, &names, n).await?;
    let exact = Summary {
        url: &a.url,
        platform: client.platform(),
        store: (store.name(), &store_url),
        names: &names,
        n,
        produced,
        runs,
        redelivered_by_faults,
        aborted_by_crashes,
        verified,
        elapsed: started.elapsed(),
    }
    .print();
    Ok(if exact {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Refuses more orders than the in-process broker can hold (`memory://`).
fn check_size(a: &DemoArgs) -> Result<()> {
    let n = a.messages;
    if n > MAX_MEMORY_MESSAGES
        && a.url
            .trim_start()
            .get(..9)
            .is_some_and(|scheme| scheme.eq_ignore_ascii_case("memory://"))
    {
        return Err(Error::config(format!(
            "--messages {n} is more than the demo runs on memory://: at most \
             {MAX_MEMORY_MESSAGES} (the in-process broker keeps every record in this process, \
             about 1.5 KB per order); use a real broker (--url kafka://…, nats://…) for up to \
             {MAX_MESSAGES}"
        )));
    }
    Ok(())
}

/// The demo's topics, groups and ids on the platform, unique per run.
struct Names {
    run_id: String,
    input: String,
    output: String,
    group: String,
    tx_id: String,
    worker: String,
}

impl Names {
    fn new() -> Names {
        let run_id = format!("{:08x}", rand::random::<u32>());
        Names {
            input: format!("orders-{run_id}"),
            output: format!("order-totals-{run_id}"),
            group: format!("billing-{run_id}"),
            tx_id: format!("billing-pipeline-{run_id}"),
            worker: format!("billing-worker-{run_id}"),
            run_id,
        }
    }
}

/// What the demo's temporary store directories are called: this and a random part.
const STORE_DIR_PREFIX: &str = "onceflow-demo-";

/// The file in a store directory whose exclusive lock its demo holds while it runs. The
/// operating system releases the lock when the process ends, however it ends (SIGKILL too), and
/// a lock is seen from every PID namespace sharing the directory, unlike a process id.
const OWNER_LOCK: &str = "owner.lock";

/// How old a store directory without an owner lock (made by a demo before there was one, or
/// being made this instant) must be before it is taken for a leftover.
const UNLOCKED_LEFTOVER_AGE: std::time::Duration = std::time::Duration::from_secs(3600);

/// Removes the store directories in `tmp` that demos left behind when they were killed
/// (SIGKILL runs no destructor; each held about 50 MB): those whose owner lock nobody holds,
/// and those without one that are more than an hour old.
fn remove_stale_store_dirs(tmp: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    for e in entries.flatten() {
        let ours = e
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(STORE_DIR_PREFIX));
        if !ours || !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let path = e.path();
        let stale = match std::fs::File::open(path.join(OWNER_LOCK)) {
            // Taken only when its demo has ended; released again as `lock` drops.
            Ok(lock) => lock.try_lock().is_ok(),
            Err(_) => e
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > UNLOCKED_LEFTOVER_AGE)),
        };
        if stale {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

/// A store directory of this demo: removed when dropped; its owner lock held until then.
struct StoreDir {
    _lock: std::fs::File,
    _dir: tempfile::TempDir,
}

/// Makes a store directory in `tmp` and takes its owner lock. The lock file is locked under
/// another name and then renamed, so no other demo ever finds `owner.lock` unlocked while this
/// one runs.
fn new_store_dir(tmp: &std::path::Path) -> std::io::Result<(StoreDir, std::path::PathBuf)> {
    let dir = tempfile::Builder::new()
        .prefix(STORE_DIR_PREFIX)
        .tempdir_in(tmp)?;
    let locking = dir.path().join(format!("{OWNER_LOCK}.new"));
    let lock = std::fs::File::create(&locking)?;
    lock.try_lock().map_err(std::io::Error::from)?;
    std::fs::rename(&locking, dir.path().join(OWNER_LOCK))?;
    let path = dir.path().to_path_buf();
    Ok((
        StoreDir {
            _lock: lock,
            _dir: dir,
        },
        path,
    ))
}

/// The dedup store's URL: `--dedup`, else a file in a new temporary directory (removed when the
/// returned [`StoreDir`] drops). With `--dedup` none is made, so an unusable TMPDIR does not
/// matter then.
fn store_url(a: &DemoArgs) -> Result<(Option<StoreDir>, String)> {
    if let Some(u) = &a.dedup {
        return Ok((None, u.clone()));
    }
    let tmp = std::env::temp_dir();
    remove_stale_store_dirs(&tmp);
    let (dir, path) = new_store_dir(&tmp).map_err(|e| {
        Error::config(format!(
            "cannot create a temporary directory for the demo's dedup store in '{}': expected \
             a writable TMPDIR, or give --dedup",
            tmp.display()
        ))
        .with_source(e)
    })?;
    let url = path.join("dedup.db").display().to_string();
    Ok((Some(dir), url))
}

/// Creates the input and output topics with `partitions` partitions each.
async fn create_topics(client: &onceflow::Client, names: &Names, partitions: u32) -> Result<()> {
    let admin = client.admin().await?;
    admin
        .create_topic(&TopicSpec::new(&names.input, partitions))
        .await?;
    admin
        .create_topic(&TopicSpec::new(&names.output, partitions))
        .await
}

/// What producing the orders sent.
struct Produced {
    /// Records sent, duplicate sends included.
    total_records: u64,
    /// Duplicate sends the platform dropped itself (JetStream's Nats-Msg-Id window).
    dropped_by_broker: u64,
}

/// Sends orders 1..=`n` to `input` in batches of 1000, every 100th followed by a second send
/// of an earlier order (same idempotency key), and flushes.
async fn produce_orders(client: &onceflow::Client, input: &str, n: u64) -> Result<Produced> {
    let producer = client.producer(ProducerConfig::new()).await?;
    let dup_every = 100u64;
    let total_records = n + n / dup_every;
    let bar = progress(total_records, "produce");
    let mut batch = Vec::with_capacity(1000);
    let mut sent = 0u64;
    let mut dropped_by_broker = 0u64;
    for id in 1..=n {
        let rec = |id: u64| {
            Record::new(input.to_string(), order_payload(id))
                .key(format!("c{}", id % 977).into_bytes())
                .idempotency_key(format!("order-{id}"))
        };
        batch.push(rec(id));
        if id % dup_every == 0 {
            batch.push(rec(id - dup_every / 2));
        }
        if batch.len() >= 1000 || id == n {
            let k = batch.len() as u64;
            for r in producer.send_batch(std::mem::take(&mut batch)).await {
                if r?.duplicate {
                    dropped_by_broker += 1;
                }
            }
            sent += k;
            bar.set_position(sent);
            // The in-process broker answers without ever waiting: yield, so Ctrl-C is seen.
            tokio::task::yield_now().await;
        }
    }
    producer.flush(Duration::from_secs(60)).await?;
    bar.finish_and_clear();
    Ok(Produced {
        total_records,
        dropped_by_broker,
    })
}

/// What the pipeline's runs did, over its crashes and restarts.
struct Runs {
    /// The runs' metrics added up.
    totals: MetricsSnapshot,
    crashes: u64,
    guarantee: Guarantee,
    mechanism: &'static str,
}

/// Runs the pipeline until the group has committed every input, crashing it (dropping the run
/// mid-flight) every K transformed messages and restarting it ([`run_once`]).
///
/// In-process crashes are simulated only on memory:// by default: dropping a live native
/// client (librdkafka keeps heartbeating from its own threads) is not what a killed process
/// does, and the platforms' own crash tests SIGKILL real processes instead.
async fn run_pipeline(
    a: &DemoArgs,
    client: &onceflow::Client,
    names: &Names,
    store: &Arc<dyn onceflow::DedupStore>,
) -> Result<Runs> {
    let n = a.messages;
    let crash_every = a.crash_every.unwrap_or(if a.url.starts_with("memory://") {
        (n / 3).max(1)
    } else {
        0
    });
    let mut runs = Runs {
        totals: MetricsSnapshot::default(),
        crashes: 0,
        guarantee: Guarantee::AtLeastOnce,
        mechanism: "",
    };
    let bar = progress(n, "pipeline");
    let done_total = Arc::new(AtomicU64::new(0));
    // Transform calls over the whole run (replays included): a crash comes every K of them,
    // so every restart makes progress and the run ends.
    let processed = Arc::new(AtomicU64::new(0));
    loop {
        let crash_at = (crash_every > 0).then_some(crash_every * (runs.crashes + 1));
        let once = Once {
            a,
            client,
            names,
            store,
            crash_every,
            crash_at,
            processed: &processed,
            done_total: &done_total,
            bar: &bar,
        };
        let (s, crashed) = once.run(&mut runs).await?;
        add(&mut runs.totals, s);
        if !crashed {
            break;
        }
        // The run future was dropped mid-flight: no commit, no offset commit, no close, like a
        // killed process; the unfinished transaction ends as an abort (dropped, or fenced by the
        // restarted producer with the same transactional id), and the crashed producer is dead.
        runs.crashes += 1;
        #[cfg(feature = "memory")]
        if a.url.starts_with("memory://") {
            onceflow::memory::connect(&a.url)?
                .faults()
                .crash_producer(&names.tx_id);
        }
        note(
            &bar,
            format!(
                "simulated crash #{} after {} transformed messages in all; restarting",
                runs.crashes,
                processed.load(Ordering::Relaxed)
            ),
        );
    }
    bar.finish_and_clear();
    Ok(runs)
}

/// One run of the pipeline (see [`Once::run`]).
struct Once<'a> {
    a: &'a DemoArgs,
    client: &'a onceflow::Client,
    names: &'a Names,
    store: &'a Arc<dyn onceflow::DedupStore>,
    /// Transformed messages between crashes (0: none).
    crash_every: u64,
    /// The transform calls of the whole run at which this run crashes.
    crash_at: Option<u64>,
    processed: &'a Arc<AtomicU64>,
    /// Messages processed by the runs before this one.
    done_total: &'a Arc<AtomicU64>,
    bar: &'a ProgressBar,
}

impl Once<'_> {
    /// Runs a new consumer, transactional producer and pipeline until the group has committed
    /// everything on every partition (`false`) or the transform asks for a crash (`true`, the
    /// run dropped mid-flight). Returns the run's metrics; notes its guarantee in `runs`.
    async fn run(&self, runs: &mut Runs) -> Result<(MetricsSnapshot, bool)> {
        let Once { a, names, .. } = *self;
        let session = if a.url.starts_with("memory://") {
            1_000
        } else {
            6_000
        };
        let mut config = ConsumerConfig::new(names.group.clone(), [names.input.clone()])
            .start(StartFrom::committed_or_earliest())
            .client_id(names.worker.clone())
            .session_timeout(Duration::from_millis(session));
        if a.url.starts_with("kafka://") {
            // Static membership (KIP-345): the restarted worker takes its partitions back at
            // once instead of waiting out the dead member's session.
            config = config.option("group.instance.id", names.worker.clone());
        }
        let consumer = self.client.consumer(config).await?;
        let producer = self
            .client
            .producer(ProducerConfig::new().transactional_id(names.tx_id.clone()))
            .await?;
        let crash = Arc::new(tokio::sync::Notify::new());
        let pipeline_metrics = Arc::new(OnceLock::new());
        let transform = BillOrder {
            out_topic: names.output.clone(),
            processed: self.processed.clone(),
            crash_at: self.crash_at,
            metrics: pipeline_metrics.clone(),
            fired: AtomicBool::new(false),
            crash: crash.clone(),
        };
        let pipeline = Pipeline::with_config(
            consumer.clone(),
            producer,
            Some(self.store.clone()),
            Arc::new(transform),
            self.pipeline_config(),
        )?;
        runs.guarantee = pipeline.guarantee();
        runs.mechanism = pipeline.mechanism();
        let metrics = pipeline.metrics();
        let _ = pipeline_metrics.set(metrics.clone());
        let finished = Arc::new(tokio::sync::Notify::new());
        let watcher = self.watch(consumer, finished.clone(), metrics.clone());
        let run = pipeline.run_until(finished.notified());
        let crashed = tokio::select! {
            r = run => { r?; false }
            _ = crash.notified() => true,
        };
        watcher.abort();
        let s = metrics.snapshot();
        self.done_total.fetch_add(s.processed, Ordering::Relaxed);
        Ok((s, crashed))
    }

    /// The pipeline's settings: this worker's id, short commit intervals and, with crashes,
    /// several transactions per crash period.
    fn pipeline_config(&self) -> PipelineConfig {
        let mut engine = EngineConfig {
            worker_id: self.names.worker.clone(),
            lease: Duration::from_secs(10),
            ..EngineConfig::default()
        };
        engine.commit_interval = Duration::from_millis(200);
        let mut config = PipelineConfig {
            engine,
            ..PipelineConfig::default()
        };
        if self.crash_every > 0 {
            // Several transactions per crash period, so a crash can come after this run's first
            // commit even when the whole run is shorter than one transaction interval.
            config.max_transaction_inputs = (self.crash_every / 4).clamp(1, 10_000) as usize;
            // A transaction ends between polled batches: batches no larger than that.
            config.engine.batch_size = config.engine.batch_size.min(config.max_transaction_inputs);
        }
        config
    }

    /// Watches progress every 100 ms (the bar) and notifies `finished` once the group has
    /// committed everything on every partition.
    fn watch(
        &self,
        consumer: onceflow::Consumer,
        finished: Arc<tokio::sync::Notify>,
        metrics: Metrics,
    ) -> tokio::task::JoinHandle<()> {
        let bar = self.bar.clone();
        let base = self.done_total.load(Ordering::Relaxed);
        let partitions = self.a.partitions as usize;
        let n = self.a.messages;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let s = metrics.snapshot();
                bar.set_position((base + s.processed).min(n));
                if consumer.assignment().len() < partitions {
                    continue;
                }
                if let Ok(lag) = consumer.lag().await {
                    if lag.len() >= partitions && lag.iter().all(|l| l.messages == 0) {
                        finished.notify_one();
                        return;
                    }
                }
            }
        })
    }
}

/// What reading the output back found.
struct Verified {
    /// Output records read.
    physical: u64,
    /// Distinct orders among them.
    distinct: u64,
    /// Orders of 1..=n not among them.
    missing: u64,
    /// Orders read more than once.
    duplicated: u64,
}

/// Reads the output topic from the start (read-committed) with a group of its own until it is
/// quiet, counting each order id.
async fn verify_output(client: &onceflow::Client, names: &Names, n: u64) -> Result<Verified> {
    let verify = client
        .consumer(
            ConsumerConfig::new(format!("verify-{}", names.run_id), [names.output.clone()])
                .start(StartFrom::Earliest),
        )
        .await?;
    let mut seen: HashMap<u64, u32> = HashMap::with_capacity(n as usize);
    let mut physical = 0u64;
    let mut idle = Instant::now();
    while idle.elapsed() < Duration::from_secs(3) {
        let batch = verify.poll(1000, Duration::from_millis(200)).await?;
        if batch.is_empty() {
            if seen.len() as u64 >= n {
                // Everything is there; wait a moment for stragglers that would be duplicates.
                if idle.elapsed() > Duration::from_millis(500) {
                    break;
                }
            }
            continue;
        }
        idle = Instant::now();
        for m in batch {
            physical += 1;
            let v: serde_json::Value = serde_json::from_slice(&m.payload).map_err(|e| {
                Error::new(onceflow::ErrorKind::Serialization, "unreadable output").with_source(e)
            })?;
            if let Some(id) = v["order_id"].as_u64() {
                *seen.entry(id).or_default() += 1;
            }
        }
    }
    verify.close().await?;
    Ok(Verified {
        physical,
        distinct: seen.len() as u64,
        missing: (1..=n).filter(|id| !seen.contains_key(id)).count() as u64,
        duplicated: seen.values().filter(|c| **c > 1).count() as u64,
    })
}

/// Everything the demo's summary reports.
struct Summary<'a> {
    url: &'a str,
    platform: &'a str,
    /// The dedup store's name and URL.
    store: (&'a str, &'a str),
    names: &'a Names,
    /// Orders (distinct inputs).
    n: u64,
    produced: Produced,
    runs: Runs,
    redelivered_by_faults: Option<u64>,
    /// Transactions a simulated crash left unfinished (memory://).
    aborted_by_crashes: u64,
    verified: Verified,
    elapsed: Duration,
}

impl Summary<'_> {
    /// Prints the summary table and the `exactly-once:` line; whether every order reached the
    /// output exactly once (as the guarantee promises).
    fn print(&self) -> bool {
        let Summary {
            url,
            platform,
            store: (store_name, store_url),
            names,
            n,
            ref produced,
            ref runs,
            redelivered_by_faults,
            aborted_by_crashes,
            ref verified,
            elapsed,
        } = *self;
        let Runs {
            totals,
            crashes,
            guarantee,
            mechanism,
        } = *runs;
        let Verified {
            physical,
            distinct,
            missing,
            duplicated,
        } = *verified;
        let redelivered = totals
            .consumed
            .saturating_sub(produced.total_records - produced.dropped_by_broker);
        say!("");
        say!(
            "  onceflow demo — {}",
            onceflow::shown(&onceflow::redact_credentials(url))
        );
        say!("  ───────────────────────────────────────────────────────────────");
        let row = |k: &str, v: String| say!("  {k:<38} {v}");
        row("platform", platform.to_string());
        row("guarantee", guarantee.to_string());
        row("mechanism", mechanism.to_string());
        row(
            "dedup store",
            format!(
                "{store_name} ({})",
                onceflow::shown(&onceflow::redact_url(store_url))
            ),
        );
        row("orders (distinct inputs)", n.to_string());
        row(
            "input records incl. duplicate sends",
            produced.total_records.to_string(),
        );
        if produced.dropped_by_broker > 0 {
            row(
                "  of which dropped by the broker (id)",
                produced.dropped_by_broker.to_string(),
            );
        }
        row("deliveries to the pipeline", totals.consumed.to_string());
        row(
            "redelivered (beyond the first read)",
            redelivered.to_string(),
        );
        if let Some(r) = redelivered_by_faults {
            // Counted by the broker when it sends a message again; a crashed run's deliveries
            // are not in the pipeline's totals, so this is not a part of the row above.
            row("redeliveries injected by the broker", r.to_string());
        }
        row(
            "duplicates skipped (dedup store)",
            totals.duplicates_skipped.to_string(),
        );
        row(
            "simulated crashes / restarts",
            format!("{crashes} / {crashes}"),
        );
        row(
            "transactions committed / aborted",
            if aborted_by_crashes > 0 {
                format!(
                    "{} / {} ({aborted_by_crashes} unfinished at a crash)",
                    totals.transactions_committed,
                    totals.transactions_aborted + aborted_by_crashes
                )
            } else {
                format!(
                    "{} / {}",
                    totals.transactions_committed, totals.transactions_aborted
                )
            },
        );
        row(
            if guarantee == Guarantee::ExactlyOnce {
                "output records read (read_committed)"
            } else {
                "output records read"
            },
            physical.to_string(),
        );
        row("distinct orders in output", distinct.to_string());
        row(
            "missing / duplicated orders",
            format!("{missing} / {duplicated}"),
        );
        row(
            "elapsed",
            format!(
                "{:.2} s ({:.0} orders/s)",
                elapsed.as_secs_f64(),
                n as f64 / elapsed.as_secs_f64()
            ),
        );
        say!("");
        let exact = missing == 0
            && distinct == n
            && (physical == n || guarantee < Guarantee::EffectivelyOnce);
        let verdict = if exact { "OK" } else { "FAILED" };
        if guarantee < Guarantee::EffectivelyOnce {
            // Say what was checked: the output topic may hold copies; each order counted once.
            say!(
                "  {guarantee} output on {platform}: the output topic held {physical} records \
                 for {distinct} orders; every order was processed once (dedup store) and a \
                 reader that keeps each order id once sees each exactly once."
            );
        }
        if platform != "memory" {
            // Left for inspection; named so that they can be found and deleted.
            warn_line!(
                "onceflow: the demo's topics '{}' and '{}' and consumer groups '{}' and \
                 'verify-{}' stay on {}; delete them with the platform's tools when done",
                names.input,
                names.output,
                names.group,
                names.run_id,
                onceflow::shown(&onceflow::redact_credentials(url))
            );
        }
        say!(
            "exactly-once: {verdict} guarantee={guarantee} input={n} output={distinct} \
             output_records={physical} redelivered={redelivered} duplicates_skipped={} \
             crashes={crashes}",
            totals.duplicates_skipped
        );
        exact
    }
}

/// Prints a line above the progress bar, or to stderr when the bar is hidden (stderr is not a
/// terminal), where indicatif's `println` prints nothing.
fn note(bar: &ProgressBar, line: String) {
    if bar.is_hidden() {
        warn_line!("{line}");
    } else {
        bar.println(line);
    }
}

fn progress(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>9} [{bar:40}] {pos}/{len} ({per_sec}, eta {eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(what.to_string());
    bar
}
