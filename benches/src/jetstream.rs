//! N1 and N2: onceflow's JetStream adapter against raw async-nats on the same nats-server, in
//! the same run (`ONCEFLOW_NATS_URL`, default `nats://127.0.0.1:14222`; start one with
//! `tests/brokers/up.sh nats`).
//!
//! - **N1** async publish of 128 B and 1 KiB records with at most `WINDOW` publishes awaiting
//!   their ack (a sliding window, `buffered(WINDOW)`, on both sides): onceflow without
//!   `Nats-Msg-Id` (`idempotent(false)`) ≥ 0.95× raw `jetstream::Context::publish`; onceflow
//!   with a `Nats-Msg-Id` per record (its idempotency key) ≥ 0.9× onceflow without.
//! - **N2** pull consume with explicit acks: onceflow `poll` + `commit` (a double ack per
//!   message) ≥ 0.9× a raw pull consumer (one request at a time, `BATCH` messages) that
//!   double-acks each message — the same guarantee; the ratio against a raw consumer with plain
//!   (fire-and-forget) acks is printed for information.
//!
//! Streams use memory storage so the figures measure the clients, not the disk. N2 takes the
//! best of `ROUNDS` alternating rounds (the machine is shared). N1 runs
//! `ONCEFLOW_BENCH_N1_ROUNDS` rounds (default 7) of five measurements; every measurement gets a
//! new, empty stream of the same config, the order rotates between rounds, and both sides
//! borrow their handle (`&Context`, `&Producer`) in the publish futures. Its verdict is the
//! median of the per-round ratios (the two sides of a ratio ran seconds apart), printed with
//! their spread and this process's CPU time per message for each side.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::stats::median;

use async_nats::jetstream::{self, consumer::pull, stream};
use bytes::Bytes;
use futures::StreamExt;
use onceflow_core::{
    Client, ConsumerConfig, Position, ProducerConfig, Record, StartFrom, TopicPartition,
};

const WINDOW: usize = 256;
const BATCH: usize = 256;
const ROUNDS: usize = 3;

fn publish_count() -> usize {
    std::env::var("ONCEFLOW_BENCH_N1_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000)
}

fn consume_count() -> usize {
    std::env::var("ONCEFLOW_BENCH_N2_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000)
}

fn ratio(id: &str, what: &str, value: f64, target: f64) {
    println!(
        "RATIO {id} {what} {value:.3} target >={target} {}",
        if value >= target { "PASS" } else { "MISS" }
    );
}

fn name(prefix: &str) -> String {
    format!("{prefix}{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}

/// Runs N1 or N2 (`id` is `n1` or `n2`).
pub fn run(id: &str) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let url = std::env::var("ONCEFLOW_NATS_URL")
            .unwrap_or_else(|_| "nats://127.0.0.1:14222".to_string());
        let sep = if url.contains('?') { '&' } else { '?' };
        let of_url = format!("{url}{sep}storage=memory");
        let platform = onceflow_jetstream::connect(&of_url)
            .await
            .unwrap_or_else(|e| panic!("{url}: {e} (start one with tests/brokers/up.sh nats)"));
        let js = jetstream::new(platform.nats_client());
        let version = platform.nats_client().server_info().version;
        eprintln!("[bench] nats-server {version}, {url}");
        match id {
            "n1" => n1(&platform, &js).await,
            _ => n2(&platform, &js).await,
        }
    });
}

async fn stream_for(js: &jetstream::Context, name: &str) {
    js.create_stream(stream::Config {
        name: name.to_string(),
        subjects: vec![name.to_string()],
        storage: stream::StorageType::Memory,
        ..Default::default()
    })
    .await
    .expect("create stream");
}

async fn raw_publish(js: &jetstream::Context, subject: &str, payload: Bytes, n: usize) -> f64 {
    let start = Instant::now();
    let acks = futures::stream::iter(0..n)
        .map(|_| {
            let payload = payload.clone();
            let subject = subject.to_string();
            async move { js.publish(subject, payload).await?.await }
        })
        .buffered(WINDOW);
    futures::pin_mut!(acks);
    while let Some(a) = acks.next().await {
        a.expect("raw publish");
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// Raw publish with a `Nats-Msg-Id` per message (what the server's deduplication costs without
/// onceflow), for locating the Msg-Id cost: printed for information.
async fn raw_publish_msg_id(
    js: &jetstream::Context,
    subject: &str,
    payload: Bytes,
    n: usize,
) -> f64 {
    let run = name("");
    let start = Instant::now();
    let acks = futures::stream::iter(0..n)
        .map(|i| {
            let message = jetstream::message::PublishMessage::build()
                .payload(payload.clone())
                .message_id(format!("{run}-{i}"));
            let subject = subject.to_string();
            async move { js.send_publish(subject, message).await?.await }
        })
        .buffered(WINDOW);
    futures::pin_mut!(acks);
    while let Some(a) = acks.next().await {
        a.expect("raw publish with Msg-Id");
    }
    n as f64 / start.elapsed().as_secs_f64()
}

async fn onceflow_publish(
    client: &Client,
    topic: &str,
    payload: Bytes,
    n: usize,
    msg_id: bool,
) -> f64 {
    let config = ProducerConfig {
        idempotent: Some(msg_id),
        ..ProducerConfig::new()
    };
    let producer = client.producer(config).await.expect("producer");
    let run = name("");
    let start = Instant::now();
    let acks = futures::stream::iter(0..n)
        .map(|i| {
            let mut r = Record::new(topic.to_string(), payload.clone());
            if msg_id {
                r = r.idempotency_key(format!("{run}-{i}"));
            }
            let p = &producer;
            async move { p.send(r).await }
        })
        .buffered(WINDOW);
    futures::pin_mut!(acks);
    while let Some(a) = acks.next().await {
        a.expect("onceflow publish");
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// The adapter's producer without the facade (no spans, no trace injection), for locating the
/// cost: printed for information.
async fn backend_publish(
    platform: &Arc<onceflow_jetstream::JetStreamPlatform>,
    topic: &str,
    payload: Bytes,
    n: usize,
) -> f64 {
    use onceflow_core::PlatformBackend;
    let config = ProducerConfig {
        idempotent: Some(false),
        ..ProducerConfig::new()
    };
    let producer = platform.producer(config).await.expect("producer");
    let start = Instant::now();
    let acks = futures::stream::iter(0..n)
        .map(|_| {
            let r = Record::new(topic.to_string(), payload.clone());
            let p = &producer;
            async move { p.send(r).await }
        })
        .buffered(WINDOW);
    futures::pin_mut!(acks);
    while let Some(a) = acks.next().await {
        a.expect("backend publish");
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// One N1 measurement: messages per second, and this process's CPU time per message in µs
/// (the client's own cost, which other processes' load does not change much).
#[derive(Clone, Copy, Default)]
struct Sample {
    rate: f64,
    cpu_us: f64,
}

async fn measure(n: usize, run: impl std::future::Future<Output = f64>) -> Sample {
    let cpu = crate::cpu::process_cpu();
    let rate = run.await;
    Sample {
        rate,
        cpu_us: (crate::cpu::process_cpu() - cpu).as_secs_f64() * 1e6 / n as f64,
    }
}

fn spread(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(*x), hi.max(*x)))
}

fn n1_rounds() -> usize {
    std::env::var("ONCEFLOW_BENCH_N1_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n >= 1)
        .unwrap_or(7)
}

/// The five N1 measurements of one round.
const N1_KINDS: [&str; 5] = [
    "raw",
    "onceflow",
    "onceflow+Msg-Id",
    "adapter without the facade",
    "raw+Msg-Id",
];

async fn n1(platform: &Arc<onceflow_jetstream::JetStreamPlatform>, js: &jetstream::Context) {
    let client = Client::new(platform.clone());
    let n = publish_count();
    let rounds = n1_rounds();
    for size in [128usize, 1024] {
        let payload = Bytes::from(vec![b'x'; size]);
        // samples[kind][round]
        let mut samples = vec![Vec::with_capacity(rounds); N1_KINDS.len()];
        for round in 0..rounds {
            // Each measurement publishes into a new, empty stream (same config), and the order
            // rotates between rounds, so no side always runs first or into a fuller stream.
            let mut got = [Sample::default(); 5];
            for k in 0..5 {
                let s = name("benchn1");
                stream_for(js, &s).await;
                let payload = payload.clone();
                let kind = (k + round) % 5;
                got[kind] = match kind {
                    0 => measure(n, raw_publish(js, &s, payload, n)).await,
                    1 => measure(n, onceflow_publish(&client, &s, payload, n, false)).await,
                    2 => measure(n, onceflow_publish(&client, &s, payload, n, true)).await,
                    3 => measure(n, backend_publish(platform, &s, payload, n)).await,
                    _ => measure(n, raw_publish_msg_id(js, &s, payload, n)).await,
                };
                let _ = js.delete_stream(&s).await;
            }
            for (kind, g) in got.iter().enumerate() {
                samples[kind].push(*g);
            }
        }
        let rates = |k: usize| samples[k].iter().map(|s| s.rate).collect::<Vec<_>>();
        // Ratios of measurements of the same round (seconds apart), then their median: a
        // round where the machine was busy moves both sides of its ratio.
        let paired = |a: usize, b: usize| {
            samples[a]
                .iter()
                .zip(&samples[b])
                .map(|(x, y)| x.rate / y.rate)
                .collect::<Vec<_>>()
        };
        for (k, what) in N1_KINDS.iter().enumerate() {
            let r = rates(k);
            let (lo, hi) = spread(&r);
            let cpu = median(samples[k].iter().map(|s| s.cpu_us).collect());
            eprintln!(
                "[bench] N1 {size} B, window {WINDOW}, {n} msgs, {rounds} rounds: {what}: median \
                 {:.0}/s ({lo:.0}-{hi:.0}), client CPU {cpu:.2} us/msg",
                median(r.clone())
            );
        }
        let report = |what: String, a: usize, b: usize, target: Option<f64>| {
            let v = paired(a, b);
            let (lo, hi) = spread(&v);
            let m = median(v);
            eprintln!("[bench] N1 {what}: per-round ratios {lo:.3}-{hi:.3}, median {m:.3}");
            match target {
                Some(t) => ratio("N1", &what, m, t),
                None => println!("RATIO N1 {what} {m:.3} target (info) INFO"),
            }
        };
        let cpu = |k: usize| median(samples[k].iter().map(|s| s.cpu_us).collect());
        println!(
            "RATIO N1 publish-{size}B-client-cpu-per-msg-vs-async-nats {:.3} target (info) INFO",
            cpu(1) / cpu(0)
        );
        report(
            format!("publish-{size}B-raw-msgid-vs-raw-without"),
            4,
            0,
            None,
        );
        report(
            format!("publish-{size}B-adapter-only-vs-async-nats"),
            3,
            0,
            None,
        );
        report(format!("publish-{size}B-vs-async-nats"), 1, 0, Some(0.95));
        report(format!("publish-{size}B-msgid-vs-without"), 2, 1, Some(0.9));
    }
}

/// Raw pull consumer: one request at a time of `BATCH` messages, each message acked.
async fn raw_consume(js: &jetstream::Context, s: &str, n: usize, double: bool) -> f64 {
    let stream = js.get_stream(s).await.expect("stream");
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(name("raw")),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            max_ack_pending: 10_000,
            ..Default::default()
        })
        .await
        .expect("consumer");
    let start = Instant::now();
    let mut got = 0;
    while got < n {
        let mut batch = consumer
            .batch()
            .max_messages(BATCH)
            .expires(Duration::from_millis(500))
            .messages()
            .await
            .expect("pull");
        let mut msgs = Vec::with_capacity(BATCH);
        while let Some(m) = batch.next().await {
            msgs.push(m.expect("message"));
        }
        got += msgs.len();
        if double {
            futures::future::join_all(msgs.iter().map(|m| m.double_ack()))
                .await
                .into_iter()
                .for_each(|r| r.expect("double ack"));
        } else {
            for m in &msgs {
                m.ack().await.expect("ack");
            }
        }
    }
    n as f64 / start.elapsed().as_secs_f64()
}

async fn onceflow_consume(client: &Client, s: &str, n: usize) -> f64 {
    let c = client
        .consumer(
            ConsumerConfig::new(name("of"), [s.to_string()])
                .start(StartFrom::Earliest)
                .option("fetch_batch", BATCH.to_string()),
        )
        .await
        .expect("consumer");
    let start = Instant::now();
    let mut got = 0;
    while got < n {
        let msgs = c.poll(500, Duration::from_millis(500)).await.expect("poll");
        if let Some(last) = msgs.last() {
            let pos: Position = last.position.clone();
            c.commit(&[(TopicPartition::new(s.to_string(), 0), pos)])
                .await
                .expect("commit");
        }
        got += msgs.len();
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    c.close().await.expect("close");
    rate
}

async fn n2(platform: &Arc<onceflow_jetstream::JetStreamPlatform>, js: &jetstream::Context) {
    let client = Client::new(platform.clone());
    let n = consume_count();
    let s = name("benchn2");
    stream_for(js, &s).await;
    let payload = Bytes::from(vec![b'x'; 128]);
    raw_publish(js, &s, payload, n).await;
    let (mut raw_double, mut raw_plain, mut of) = (0f64, 0f64, 0f64);
    for _ in 0..ROUNDS {
        raw_double = raw_double.max(raw_consume(js, &s, n, true).await);
        raw_plain = raw_plain.max(raw_consume(js, &s, n, false).await);
        of = of.max(onceflow_consume(&client, &s, n).await);
    }
    let _ = js.delete_stream(&s).await;
    eprintln!(
        "[bench] N2 128 B, {n} msgs: raw double-ack {raw_double:.0}/s, raw ack {raw_plain:.0}/s, \
         onceflow poll+commit {of:.0}/s"
    );
    ratio(
        "N2",
        "consume-vs-async-nats-double-ack",
        of / raw_double,
        0.9,
    );
    println!(
        "RATIO N2 consume-vs-async-nats-plain-ack {:.3} target (info) INFO",
        of / raw_plain
    );
}
