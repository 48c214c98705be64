//! M0: the idempotent consumer's overhead per message on `memory://` with the memory dedup
//! store, against a bare loop over the same backend doing one hash-set insert per message
//! (the hand-written dedup a user would start with). Target: ≤ 300 ns/msg added.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use onceflow_core::dedup::MemoryStore;
use onceflow_core::{
    BoxError, Client, ConsumerConfig, EngineConfig, Handler, IdempotentConsumer, Message,
    PlatformBackend, ProducerConfig, Record, StartFrom, TopicPartition, TopicSpec,
};
use onceflow_memory::{MemoryOptions, MemoryPlatform};

const N: usize = 1_000_000;
const PARTITIONS: u32 = 4;
const TARGET_NS: f64 = 300.0;

struct Noop;

#[async_trait::async_trait]
impl Handler for Noop {
    async fn handle(&self, m: &Message) -> Result<Option<Bytes>, BoxError> {
        std::hint::black_box(m.payload.len());
        Ok(None)
    }
}

async fn fill(platform: &Arc<MemoryPlatform>, topic: &str) {
    let admin = platform.admin().await.expect("admin");
    admin
        .create_topic(&TopicSpec::new(topic, PARTITIONS))
        .await
        .expect("create topic");
    let producer = platform
        .producer(ProducerConfig::default())
        .await
        .expect("producer");
    let payload = Bytes::from(vec![b'x'; 100]);
    for chunk in 0..N / 1000 {
        let batch: Vec<Record> = (0..1000)
            .map(|i| {
                let id = chunk * 1000 + i;
                let mut r = Record::new(topic, payload.clone()).key(format!("c{}", id % 997));
                r.headers.insert("idempotency-key", format!("order-{id}"));
                r
            })
            .collect();
        for r in producer.send_batch(batch).await {
            r.expect("send");
        }
    }
}

/// The bare loop: poll, one hash-set insert per message, commit per batch.
async fn baseline(platform: &Arc<MemoryPlatform>, topic: &str) -> Duration {
    let c = platform
        .consumer(ConsumerConfig::new("m0-baseline", [topic]).start(StartFrom::Earliest))
        .await
        .expect("consumer");
    let mut seen: HashSet<Bytes> = HashSet::with_capacity(N);
    let mut n = 0;
    let t = Instant::now();
    while n < N {
        let batch = c.poll(500, Duration::from_millis(100)).await.expect("poll");
        let mut last: Vec<(TopicPartition, onceflow_core::Position)> = Vec::new();
        for m in &batch {
            if let Some(Some(k)) = m.headers.get("idempotency-key") {
                seen.insert(k.clone());
            }
            let tp = m.topic_partition();
            match last.iter_mut().find(|(t, _)| *t == tp) {
                Some((_, p)) => *p = m.position.clone(),
                None => last.push((tp, m.position.clone())),
            }
        }
        n += batch.len();
        if !last.is_empty() {
            c.commit(&last).await.expect("commit");
        }
    }
    let d = t.elapsed();
    assert_eq!(seen.len(), N);
    d
}

async fn engine(platform: &Arc<MemoryPlatform>, topic: &str, tracing: bool) -> Duration {
    let client = Client::new(platform.clone());
    let group = format!("m0-engine-{tracing}");
    let consumer = client
        .consumer(ConsumerConfig::new(group, [topic]).start(StartFrom::Earliest))
        .await
        .expect("consumer");
    let store = Arc::new(MemoryStore::new(Duration::from_secs(3600), 2 * N as u64));
    let config = EngineConfig {
        tracing,
        ..EngineConfig::default()
    };
    let ic = IdempotentConsumer::with_config(consumer, Some(store), Arc::new(Noop), config, None)
        .expect("engine");
    let metrics = ic.metrics();
    let t = Instant::now();
    let done = {
        let metrics = metrics.clone();
        async move {
            while metrics.snapshot().processed < N as u64 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    };
    ic.run_until(done).await.expect("run");
    let d = t.elapsed();
    assert_eq!(metrics.snapshot().processed, N as u64);
    d
}

fn per_msg(d: Duration) -> f64 {
    d.as_nanos() as f64 / N as f64
}

/// Runs `f`, returning (wall, cpu) per message.
async fn measure<F: std::future::Future<Output = Duration>>(f: F) -> (f64, f64) {
    let c0 = crate::cpu::process_cpu();
    let wall = f.await;
    (per_msg(wall), per_msg(crate::cpu::process_cpu() - c0))
}

/// Runs M0 and prints its RATIO lines.
pub fn run() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let platform = MemoryPlatform::isolated(MemoryOptions::default());
        let topic = "m0-orders";
        fill(&platform, topic).await;
        let (base_w, base_c) = measure(baseline(&platform, topic)).await;
        let (on_w, on_c) = measure(engine(&platform, topic, true)).await;
        let (off_w, off_c) = measure(engine(&platform, topic, false)).await;
        println!("M0 {N} msgs, {PARTITIONS} partitions, 100 B payloads; per message, wall / CPU:");
        println!("M0   bare loop (poll + HashSet insert + commit per batch): {base_w:.0} / {base_c:.0} ns");
        println!("M0   idempotent consumer + memory store, tracing on:       {on_w:.0} / {on_c:.0} ns");
        println!("M0   idempotent consumer + memory store, tracing off:      {off_w:.0} / {off_c:.0} ns");
        for (what, v) in [
            ("engine_overhead_cpu_ns_per_msg_tracing_on", on_c - base_c),
            ("engine_overhead_cpu_ns_per_msg_tracing_off", off_c - base_c),
        ] {
            println!(
                "RATIO M0 {what} {v:.0} target <={TARGET_NS:.0} {}",
                if v <= TARGET_NS { "PASS" } else { "MISS" }
            );
        }
    });
}
