//! P1: onceflow's Pulsar adapter against the raw `pulsar` crate on the same Pulsar standalone,
//! in the same run (`ONCEFLOW_PULSAR_URL`, default `pulsar://127.0.0.1:16650`, and
//! `ONCEFLOW_PULSAR_ADMIN_URL`, default `http://127.0.0.1:18080`; start one with
//! `tests/brokers/up.sh pulsar`).
//!
//! - **P1 produce**: 1 KiB records with batching (`batch_size=BATCH`, `batch_timeout_ms=5`, no
//!   compression), `WINDOW` sends handed over before waiting for their receipts: onceflow
//!   `send_batch` ≥ 0.95× raw `Producer::send_non_blocking` with the same `ProducerOptions`
//!   (built by the same `onceflow_pulsar::producer_options`).
//! - **P1 consume**: the same messages read back on a failover subscription with individual
//!   acks: onceflow `poll` + `commit` (individual acks up to the position, queued to the crate
//!   consumer like the raw side's) ≥ 0.95× a raw consumer that acks each message.
//!
//! `ONCEFLOW_BENCH_P1_ROUNDS` rounds (default `ROUNDS`), each on fresh topics; the side that
//! runs first alternates between rounds. The verdict is the median of the per-round ratios
//! (the two sides of a ratio ran seconds apart); the best figure of each side and their ratio
//! are printed as `FIGURE` lines.

use std::time::{Duration, Instant};

use crate::stats::median;

use ::pulsar::consumer::InitialPosition;
use ::pulsar::message::proto::command_subscribe::SubType;
use ::pulsar::{ConsumerOptions, TokioExecutor};
use futures::StreamExt;
use onceflow_core::{
    Client, ConsumerConfig, Position, ProducerConfig, Record, StartFrom, TopicPartition,
};

const WINDOW: usize = 1000;
const BATCH: u32 = 1000;
const SIZE: usize = 1024;
const ROUNDS: usize = 11;

fn count() -> usize {
    std::env::var("ONCEFLOW_BENCH_P1_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000)
}

fn ratio(what: &str, value: f64, target: f64) {
    println!(
        "RATIO p1 {what} {value:.3} target >={target} {}",
        if value >= target { "PASS" } else { "MISS" }
    );
}

fn name(prefix: &str) -> String {
    format!("{prefix}{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}

/// Runs P1.
pub fn run() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(p1());
}

async fn p1() {
    let url = std::env::var("ONCEFLOW_PULSAR_URL")
        .unwrap_or_else(|_| "pulsar://127.0.0.1:16650".to_string());
    let admin = std::env::var("ONCEFLOW_PULSAR_ADMIN_URL")
        .unwrap_or_else(|_| "http://127.0.0.1:18080".to_string());
    let sep = if url.contains('?') { '&' } else { '?' };
    let of_url = format!("{url}{sep}admin={admin}&batch_size={BATCH}&batch_timeout_ms=5");
    let platform = onceflow_pulsar::connect(&of_url)
        .await
        .unwrap_or_else(|e| panic!("{url}: {e} (start one with tests/brokers/up.sh pulsar)"));
    let client = Client::new(platform.clone());
    let raw = platform.pulsar_client();
    let opts = platform.options().clone();
    let n = count();
    eprintln!("[bench] pulsar {url}, {n} x {SIZE} B, batch_size={BATCH}, window {WINDOW}");
    let payload = vec![b'x'; SIZE];

    let rounds = rounds();
    // samples[side] per round; side 0 onceflow, 1 raw.
    let mut samples: [Vec<Sample>; 2] = [Vec::new(), Vec::new()];
    for round in 0..rounds {
        // The side that runs first alternates between rounds: the broker's state (JIT, GC,
        // topics created so far) favours neither.
        for k in 0..2 {
            let side = (k + round) % 2;
            let got = if side == 0 {
                onceflow_round(&client, &payload, n).await
            } else {
                raw_round(&raw, &opts, &payload, n).await
            };
            samples[side].push(got);
        }
        let (o, r) = (samples[0][round], samples[1][round]);
        eprintln!(
            "[bench] round {round}: produce onceflow {:.0}/s raw {:.0}/s ({:.3}), client CPU {:.2} \
             vs {:.2} us/msg; consume onceflow {:.0}/s raw {:.0}/s ({:.3})",
            o.0,
            r.0,
            o.0 / r.0,
            o.2,
            r.2,
            o.1,
            r.1,
            o.1 / r.1
        );
    }
    let best =
        |side: usize, f: fn(&Sample) -> f64| samples[side].iter().map(f).fold(0f64, f64::max);
    let (of_p, raw_p) = (best(0, |s| s.0), best(1, |s| s.0));
    let (of_c, raw_c) = (best(0, |s| s.1), best(1, |s| s.1));
    // Ratios of the two sides of the same round (seconds apart), then their median: a round
    // where the machine was busy moves both sides of its ratio, and one such round does not
    // decide the verdict.
    let paired = |f: fn(&Sample) -> f64| {
        median(
            samples[0]
                .iter()
                .zip(&samples[1])
                .map(|(o, r)| f(o) / f(r))
                .collect(),
        )
    };
    let mib = |r: f64| r * SIZE as f64 / (1024.0 * 1024.0);
    println!(
        "FIGURE p1 produce 1KiB batched: onceflow {of_p:.0} msg/s ({:.1} MiB/s), raw pulsar crate {raw_p:.0} msg/s ({:.1} MiB/s)",
        mib(of_p),
        mib(raw_p)
    );
    println!(
        "FIGURE p1 consume 1KiB individual acks: onceflow {of_c:.0} msg/s ({:.1} MiB/s), raw pulsar crate {raw_c:.0} msg/s ({:.1} MiB/s)",
        mib(of_c),
        mib(raw_c)
    );
    let cpu = |side: usize| median(samples[side].iter().map(|s| s.2).collect());
    println!(
        "FIGURE p1 produce client CPU (median of {rounds}): onceflow {:.2} us/msg, raw pulsar \
         crate {:.2} us/msg",
        cpu(0),
        cpu(1)
    );
    println!(
        "FIGURE p1 best-of-{rounds} ratios (information): produce {:.3}, consume {:.3}",
        of_p / raw_p,
        of_c / raw_c
    );
    ratio("produce_1KiB_batched_vs_raw", paired(|s| s.0), 0.95);
    ratio("consume_1KiB_vs_raw", paired(|s| s.1), 0.95);
}

/// One side's round: produce msg/s, consume msg/s, client CPU per produced message (µs).
type Sample = (f64, f64, f64);

fn rounds() -> usize {
    std::env::var("ONCEFLOW_BENCH_P1_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n >= 1)
        .unwrap_or(ROUNDS)
}

/// onceflow's side of one round, on a fresh topic: produce `n` records, then consume them
/// back. Returns (produce, consume) in msg/s and this process's CPU time per produced
/// message in µs.
async fn onceflow_round(client: &Client, payload: &[u8], n: usize) -> Sample {
    let topic = name("bench-p1-of-");
    let producer = client
        .producer(ProducerConfig::new())
        .await
        .expect("producer");
    // Warm up: the topic's producer exists before timing.
    producer
        .send(Record::new(topic.clone(), "warm"))
        .await
        .expect("warm");
    let cpu = crate::cpu::process_cpu();
    let t = Instant::now();
    let mut sent = 0;
    while sent < n {
        let k = WINDOW.min(n - sent);
        let batch: Vec<Record> = (0..k)
            .map(|_| Record::new(topic.clone(), payload.to_vec()))
            .collect();
        for r in producer.send_batch(batch).await {
            r.expect("send");
        }
        sent += k;
    }
    let produce = n as f64 / t.elapsed().as_secs_f64();
    let produce_cpu = (crate::cpu::process_cpu() - cpu).as_secs_f64() * 1e6 / n as f64;
    producer.close().await.ok();

    let consumer = client
        .consumer(ConsumerConfig::new(name("g-"), [topic.clone()]).start(StartFrom::Earliest))
        .await
        .expect("consumer");
    let t = Instant::now();
    let mut got = 0;
    let tp = TopicPartition::new(topic.clone(), 0);
    while got < n + 1 {
        let msgs = consumer
            .poll(WINDOW, Duration::from_secs(5))
            .await
            .expect("poll");
        assert!(!msgs.is_empty(), "onceflow consume stalled at {got}");
        got += msgs.len();
        let last: Position = msgs.last().unwrap().position.clone();
        consumer
            .commit(&[(tp.clone(), last)])
            .await
            .expect("commit");
    }
    // Timed: close sends the acks still queued in the crate and closes the consumer (one
    // round trip), as the raw side ends with one round trip behind its acks.
    consumer.close().await.ok();
    (produce, n as f64 / t.elapsed().as_secs_f64(), produce_cpu)
}

/// The raw `pulsar` crate's side of one round, same options: produce `n` records, then
/// consume them back. Returns (produce, consume) in msg/s and this process's CPU time per
/// produced message in µs.
async fn raw_round(
    raw: &::pulsar::Pulsar<TokioExecutor>,
    opts: &onceflow_pulsar::PulsarOptions,
    payload: &[u8],
    n: usize,
) -> Sample {
    let topic = format!("persistent://public/default/{}", name("bench-p1-raw-"));
    let mut p = raw
        .producer()
        .with_topic(&topic)
        .with_options(onceflow_pulsar::producer_options(opts))
        .build()
        .await
        .expect("raw producer");
    p.send_non_blocking(b"warm".to_vec())
        .await
        .expect("warm")
        .await
        .expect("warm receipt");
    let cpu = crate::cpu::process_cpu();
    let t = Instant::now();
    let mut sent = 0;
    while sent < n {
        let k = WINDOW.min(n - sent);
        let mut fs = Vec::with_capacity(k);
        for _ in 0..k {
            fs.push(p.send_non_blocking(payload.to_vec()).await.expect("send"));
        }
        for r in futures::future::join_all(fs).await {
            r.expect("receipt");
        }
        sent += k;
    }
    let produce = n as f64 / t.elapsed().as_secs_f64();
    let produce_cpu = (crate::cpu::process_cpu() - cpu).as_secs_f64() * 1e6 / n as f64;
    p.close().await.ok();

    let mut c: ::pulsar::Consumer<Vec<u8>, TokioExecutor> = raw
        .consumer()
        .with_topic(&topic)
        .with_subscription(name("g-"))
        .with_subscription_type(SubType::Failover)
        .with_options(ConsumerOptions {
            initial_position: InitialPosition::Earliest,
            receiver_queue_size: Some(opts.receiver_queue_size),
            ..Default::default()
        })
        .build()
        .await
        .expect("raw consumer");
    let t = Instant::now();
    let mut got = 0;
    while got < n + 1 {
        let m = tokio::time::timeout(Duration::from_secs(5), c.next())
            .await
            .expect("raw consume stalled")
            .expect("stream")
            .expect("message");
        c.ack(&m).await.expect("ack");
        got += 1;
    }
    let _ = c.get_last_message_id().await;
    let consume = n as f64 / t.elapsed().as_secs_f64();
    c.close().await.ok();
    (produce, consume, produce_cpu)
}
