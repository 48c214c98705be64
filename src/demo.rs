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

/// Runs the demo; exit 0 when every order reached the output exactly once.
pub async fn run(mut a: DemoArgs) -> Result<ExitCode> {
    let started = Instant::now();
    a.url = crate::cli::with_options(&a.url, &a.options)?;
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
    let run_id = format!("{:08x}", rand::random::<u32>());
    let input = format!("orders-{run_id}");
    let output = format!("order-totals-{run_id}");
    let group = format!("billing-{run_id}");
    let tx_id = format!("billing-pipeline-{run_id}");
    let worker = format!("billing-worker-{run_id}");

    // The dedup store first: a bad --dedup is refused before any topic is made on the broker.
    // A temporary directory only for the default store (removed when `_tmp` drops): with
    // `--dedup` none is made, so an unusable TMPDIR does not matter then.
    let (_tmp, store_url) = match &a.dedup {
        Some(u) => (None, u.clone()),
        None => {
            let tmp = tempfile::Builder::new()
                .prefix("onceflow-demo-")
                .tempdir()
                .map_err(|e| {
                    Error::config(format!(
                        "cannot create a temporary directory for the demo's dedup store in \
                         '{}': expected a writable TMPDIR, or give --dedup",
                        std::env::temp_dir().display()
                    ))
                    .with_source(e)
                })?;
            let url = tmp.path().join("dedup.db").display().to_string();
            (Some(tmp), url)
        }
    };
    let store = onceflow::dedup_store(&store_url, Duration::from_secs(3600)).await?;

    let client = crate::cli::connect(&a.url).await?;
    let admin = client.admin().await?;
    admin
        .create_topic(&TopicSpec::new(&input, a.partitions))
        .await?;
    admin
        .create_topic(&TopicSpec::new(&output, a.partitions))
        .await?;

    warn_line!(
        "onceflow demo on {} ({} partitions), dedup store {} ({})",
        onceflow::shown(&onceflow::redact_credentials(&a.url)),
        a.partitions,
        store.name(),
        onceflow::shown(&onceflow::redact_url(&store_url))
    );

    // 1. Produce the orders, with ~1% sent twice (same idempotency key) like a retrying producer.
    let producer = client.producer(ProducerConfig::new()).await?;
    let dup_every = 100u64;
    let total_records = n + n / dup_every;
    let bar = progress(total_records, "produce");
    let mut batch = Vec::with_capacity(1000);
    let mut sent = 0u64;
    // Duplicate sends the platform dropped itself (JetStream's Nats-Msg-Id window).
    let mut dropped_by_broker = 0u64;
    for id in 1..=n {
        let rec = |id: u64| {
            Record::new(input.clone(), order_payload(id))
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
    // In-process crashes are simulated only on memory:// by default: dropping a live native
    // client (librdkafka keeps heartbeating from its own threads) is not what a killed process
    // does, and the platforms' own crash tests SIGKILL real processes instead.
    let crash_every = a.crash_every.unwrap_or(if a.url.starts_with("memory://") {
        (n / 3).max(1)
    } else {
        0
    });
    let session = if a.url.starts_with("memory://") {
        1_000
    } else {
        6_000
    };
    let mut totals = MetricsSnapshot::default();
    let mut crashes = 0u64;
    let mut report: Option<(Guarantee, &'static str)>;
    let bar = progress(n, "pipeline");
    let done_total = Arc::new(AtomicU64::new(0));
    // Transform calls over the whole run (replays included): a crash comes every K of them,
    // so every restart makes progress and the run ends.
    let processed = Arc::new(AtomicU64::new(0));
    loop {
        let mut config = ConsumerConfig::new(group.clone(), [input.clone()])
            .start(StartFrom::committed_or_earliest())
            .client_id(worker.clone())
            .session_timeout(Duration::from_millis(session));
        if a.url.starts_with("kafka://") {
            // Static membership (KIP-345): the restarted worker takes its partitions back at
            // once instead of waiting out the dead member's session.
            config = config.option("group.instance.id", worker.clone());
        }
        let consumer = client.consumer(config).await?;
        let producer = client
            .producer(ProducerConfig::new().transactional_id(tx_id.clone()))
            .await?;
        let crash = Arc::new(tokio::sync::Notify::new());
        let pipeline_metrics = Arc::new(OnceLock::new());
        let transform = BillOrder {
            out_topic: output.clone(),
            processed: processed.clone(),
            crash_at: (crash_every > 0).then_some(crash_every * (crashes + 1)),
            metrics: pipeline_metrics.clone(),
            fired: AtomicBool::new(false),
            crash: crash.clone(),
        };
        let mut engine = EngineConfig {
            worker_id: worker.clone(),
            lease: Duration::from_secs(10),
            ..EngineConfig::default()
        };
        engine.commit_interval = Duration::from_millis(200);
        let mut config = PipelineConfig {
            engine,
            ..PipelineConfig::default()
        };
        if crash_every > 0 {
            // Several transactions per crash period, so a crash can come after this run's first
            // commit even when the whole run is shorter than one transaction interval.
            config.max_transaction_inputs = (crash_every / 4).clamp(1, 10_000) as usize;
            // A transaction ends between polled batches: batches no larger than that.
            config.engine.batch_size = config.engine.batch_size.min(config.max_transaction_inputs);
        }
        let pipeline = Pipeline::with_config(
            consumer.clone(),
            producer,
            Some(store.clone()),
            Arc::new(transform),
            config,
        )?;
        report = Some((pipeline.guarantee(), pipeline.mechanism()));
        let metrics = pipeline.metrics();
        let _ = pipeline_metrics.set(metrics.clone());
        let finished = Arc::new(tokio::sync::Notify::new());
        // Watch progress: done when the group has committed everything on every partition.
        let watcher = {
            let consumer = consumer.clone();
            let finished = finished.clone();
            let bar = bar.clone();
            let metrics = metrics.clone();
            let base = done_total.load(Ordering::Relaxed);
            let partitions = a.partitions as usize;
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
        };
        let run = pipeline.run_until(finished.notified());
        let crashed = tokio::select! {
            r = run => { r?; false }
            _ = crash.notified() => true,
        };
        watcher.abort();
        let s = metrics.snapshot();
        done_total.fetch_add(s.processed, Ordering::Relaxed);
        add(&mut totals, s);
        if !crashed {
            break;
        }
        // The run future was dropped mid-flight: no commit, no offset commit, no close, like a
        // killed process; the unfinished transaction ends as an abort (dropped, or fenced by the
        // restarted producer with the same transactional id), and the crashed producer is dead.
        crashes += 1;
        #[cfg(feature = "memory")]
        if a.url.starts_with("memory://") {
            onceflow::memory::connect(&a.url)?
                .faults()
                .crash_producer(&tx_id);
        }
        note(
            &bar,
            format!(
                "simulated crash #{crashes} after {} transformed messages in all; restarting",
                processed.load(Ordering::Relaxed)
            ),
        );
    }
    bar.finish_and_clear();
    let (guarantee, mechanism) = report.unwrap_or((Guarantee::AtLeastOnce, ""));
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
    let aborted_by_broker = faults.as_ref().map(|f| f.aborted_transactions(&tx_id));
    #[cfg(not(feature = "memory"))]
    let aborted_by_broker: Option<u64> = None;
    let aborted_by_crashes =
        aborted_by_broker.map_or(0, |b| b.saturating_sub(totals.transactions_aborted));

    // 4. Read the output back (read-committed) and check every order is there exactly once.
    let verify = client
        .consumer(
            ConsumerConfig::new(format!("verify-{run_id}"), [output.clone()])
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
    let distinct = seen.len() as u64;
    let missing = (1..=n).filter(|id| !seen.contains_key(id)).count() as u64;
    let duplicated = seen.values().filter(|c| **c > 1).count() as u64;
    let redelivered = totals
        .consumed
        .saturating_sub(total_records - dropped_by_broker);

    let elapsed = started.elapsed();
    say!("");
    say!(
        "  onceflow demo — {}",
        onceflow::shown(&onceflow::redact_credentials(&a.url))
    );
    say!("  ───────────────────────────────────────────────────────────────");
    let row = |k: &str, v: String| say!("  {k:<38} {v}");
    row("platform", client.platform().to_string());
    row("guarantee", guarantee.to_string());
    row("mechanism", mechanism.to_string());
    row(
        "dedup store",
        format!(
            "{} ({})",
            store.name(),
            onceflow::shown(&onceflow::redact_url(&store_url))
        ),
    );
    row("orders (distinct inputs)", n.to_string());
    row(
        "input records incl. duplicate sends",
        total_records.to_string(),
    );
    if dropped_by_broker > 0 {
        row(
            "  of which dropped by the broker (id)",
            dropped_by_broker.to_string(),
        );
    }
    row("deliveries to the pipeline", totals.consumed.to_string());
    row(
        "redelivered (beyond the first read)",
        redelivered.to_string(),
    );
    if let Some(r) = redelivered_by_faults {
        // Counted by the broker when it sends a message again; a crashed run's deliveries are
        // not in the pipeline's totals, so this is not a part of the row above.
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
    let exact =
        missing == 0 && distinct == n && (physical == n || guarantee < Guarantee::EffectivelyOnce);
    let verdict = if exact { "OK" } else { "FAILED" };
    if guarantee < Guarantee::EffectivelyOnce {
        // Say what was checked: the output topic may hold copies; each order counted once.
        say!(
            "  {guarantee} output on {}: the output topic held {physical} records for {distinct} \
             orders; every order was processed once (dedup store) and a reader that keeps each \
             order id once sees each exactly once.",
            client.platform()
        );
    }
    if client.platform() != "memory" {
        // Left for inspection; named so that they can be found and deleted.
        warn_line!(
            "onceflow: the demo's topics '{input}' and '{output}' and consumer groups \
             '{group}' and 'verify-{run_id}' stay on {}; delete them with the platform's tools \
             when done",
            onceflow::shown(&onceflow::redact_credentials(&a.url))
        );
    }
    say!(
        "exactly-once: {verdict} guarantee={guarantee} input={n} output={} output_records={physical} \
         redelivered={redelivered} duplicates_skipped={} crashes={crashes}",
        distinct, totals.duplicates_skipped
    );
    Ok(if exact {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
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
