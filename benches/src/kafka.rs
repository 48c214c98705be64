//! K1, K3, K4: onceflow on a real Kafka broker against the raw clients, same run, same broker
//! (`ONCEFLOW_KAFKA_URL`, default `kafka://127.0.0.1:19092`; start it with
//! `tests/brokers/up.sh kafka`).
//!
//! - **K1** produce 100 B and 1 KiB records: onceflow's producer (`send_batch`) vs rdkafka's
//!   `BaseProducer` (produce + poll, then poll until every report is in) and `FutureProducer`
//!   (every delivery future awaited), all idempotent with librdkafka's defaults otherwise.
//!   Target ≥ 0.95× BaseProducer. Also printed (info): the raw `ThreadedProducer`, the client
//!   under onceflow's producer, against `BaseProducer`.
//!
//! K1 and K3 time the steady state: every producer has delivered one record before its clock
//! starts (connected, ProducerID acquired: a new idempotent librdkafka producer otherwise
//! spends up to 500 ms on that, see the Kafka adapter's producer).
//! - **K3** onceflow's transactional producer committing every 100 ms vs the same loop without
//!   transactions, with up to 8 chunks of 1000 records in flight. Target ≥ 0.90×. Also printed
//!   (info): the same loop stop-and-wait (each chunk's reports awaited before the next), and
//!   raw rdkafka's own ratio, transactions every 100 ms vs none, on a `BaseProducer`.
//!
//! Every topic a measurement made is deleted after it (a K3 run writes ~3 GB).
//! - **K4** onceflow's exactly-once `Pipeline` A → B vs a hand-written rdkafka
//!   consume-transform-produce transactional loop (target ≥ 0.95×) and vs the same loop in
//!   confluent-kafka-python (`benches/kafka_eos_loop.py`, target ≥ 3×), each on its own copy of
//!   the same pre-filled input, each committing every 100 ms.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use onceflow_core::{
    BoxError, Client, ConsumerConfig, Message as OfMessage, Pipeline, PipelineConfig,
    ProducerConfig, Record, StartFrom, TopicSpec, Transform,
};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{
    BaseProducer, BaseRecord, FutureProducer, FutureRecord, Producer, ThreadedProducer,
};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

const PARTITIONS: u32 = 4;

/// Runs `k1`, `k3` or `k4` (they need a broker, so they are not in the default list).
pub fn run(id: &str) {
    match id {
        "k1" => k1(),
        "k3" => k3(),
        _ => k4(),
    }
}

fn url() -> String {
    std::env::var("ONCEFLOW_KAFKA_URL").unwrap_or_else(|_| "kafka://127.0.0.1:19092".into())
}

fn bootstrap() -> String {
    onceflow_kafka::parse_url(&url())
        .expect("ONCEFLOW_KAFKA_URL")
        .bootstrap_servers
}

fn name(prefix: &str) -> String {
    format!("bench-{prefix}-{:016x}", rand::random::<u64>())
}

fn ratio(id: &str, what: &str, value: f64, target: f64) {
    println!(
        "RATIO {id} {what} {value:.3} target >={target} {}",
        if value >= target { "PASS" } else { "MISS" }
    );
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

async fn client() -> Client {
    Client::new(onceflow_kafka::connect(&url()).expect("Kafka URL"))
}

/// Topics made by [`topic`] and not yet deleted by [`delete_topics`].
static CREATED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

async fn topic(c: &Client, prefix: &str) -> String {
    let t = name(prefix);
    c.admin()
        .await
        .expect("admin")
        .create_topic(&TopicSpec::new(t.clone(), PARTITIONS))
        .await
        .expect("create topic");
    CREATED.lock().expect("topic list").push(t.clone());
    t
}

/// Deletes every topic [`topic`] made so far, once its measurement is over: a K3 run writes
/// ~3 GB (twelve loops of 2M records), and a few runs filled the broker's disk.
async fn delete_topics(c: &Client) {
    let topics = std::mem::take(&mut *CREATED.lock().expect("topic list"));
    let admin = c.admin().await.expect("admin");
    for t in topics {
        if let Err(e) = admin.delete_topic(&t).await {
            eprintln!("bench: could not delete topic '{t}': {e}");
        }
    }
}

fn raw_producer(extra: &[(&str, &str)]) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", bootstrap())
        .set("enable.idempotence", "true");
    for (k, v) in extra {
        c.set(*k, *v);
    }
    c
}

/// One K1 measurement: messages per second, and process CPU time per record in µs (every
/// thread of this process: the caller, librdkafka's threads, the runtime's workers; the broker
/// is another process). On a shared machine the CPU figure moves less than the rate does.
#[derive(Clone, Copy, Default)]
struct Run {
    rate: f64,
    cpu_us: f64,
}

impl Run {
    fn measure(n: usize, start: Instant, cpu_start: Duration) -> Run {
        Run {
            rate: n as f64 / start.elapsed().as_secs_f64(),
            cpu_us: (crate::cpu::process_cpu() - cpu_start).as_secs_f64() * 1e6 / n as f64,
        }
    }

    /// The best of two runs: the higher rate, the lower CPU per record.
    fn best(self, other: Run) -> Run {
        Run {
            rate: self.rate.max(other.rate),
            cpu_us: if self.cpu_us == 0.0 {
                other.cpu_us
            } else {
                self.cpu_us.min(other.cpu_us)
            },
        }
    }
}

/// Hands one record of `payload` for `topic` to a raw producer's `send` (which gives a refused
/// record back), running `on_full` (a poll, or a sleep while the producer's own thread polls)
/// while librdkafka's local queue is full.
fn produce_raw<'a>(
    topic: &'a str,
    payload: &'a [u8],
    send: impl Fn(BaseRecord<'a, (), [u8]>) -> Option<BaseRecord<'a, (), [u8]>>,
    on_full: impl Fn(),
) {
    let mut rec = BaseRecord::to(topic).payload(payload);
    while let Some(back) = send(rec) {
        rec = back;
        on_full();
    }
}

/// rdkafka's `BaseProducer`: produce everything (polling when the local queue is full), then
/// flush.
fn k1_base(topic: &str, warm: &str, payload: &[u8], n: usize) -> Run {
    let p: BaseProducer = raw_producer(&[]).create().expect("BaseProducer");
    p.send(BaseRecord::<(), [u8]>::to(warm).payload(payload))
        .expect("warm-up record");
    drain(&p);
    let cpu = crate::cpu::process_cpu();
    let start = Instant::now();
    for _ in 0..n {
        produce_raw(
            topic,
            payload,
            |r| p.send(r).err().map(|(_, back)| back),
            || p.poll(Duration::from_millis(1)),
        );
        p.poll(Duration::ZERO);
    }
    drain(&p);
    Run::measure(n, start, cpu)
}

/// Polls `p` until every record it produced has its delivery report (each checked). Not
/// `Producer::flush`: rust-rdkafka's flush serves the reports in polls of up to 100 ms, which
/// added up to 100 ms to a measurement of ~200 ms.
fn drain(p: &BaseProducer) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while p.in_flight_count() > 0 {
        assert!(
            Instant::now() < deadline,
            "BaseProducer: reports missing after 60 s"
        );
        p.poll(Duration::from_millis(1));
    }
}

/// rdkafka's `ThreadedProducer` (the client under onceflow's producer): every record enqueued
/// from this thread, the reports served by its own poll thread; done when none is in flight.
fn k1_threaded(topic: &str, warm: &str, payload: &[u8], n: usize) -> Run {
    let p: ThreadedProducer<rdkafka::producer::DefaultProducerContext> =
        raw_producer(&[]).create().expect("ThreadedProducer");
    p.send(BaseRecord::<(), [u8]>::to(warm).payload(payload))
        .expect("warm-up record");
    wait_delivered(&p);
    let cpu = crate::cpu::process_cpu();
    let start = Instant::now();
    for _ in 0..n {
        produce_raw(
            topic,
            payload,
            |r| p.send(r).err().map(|(_, back)| back),
            || std::thread::sleep(Duration::from_millis(1)),
        );
    }
    wait_delivered(&p);
    Run::measure(n, start, cpu)
}

/// Waits (checking every 0.2 ms) until `p`'s poll thread has served every report.
fn wait_delivered<C: rdkafka::producer::ProducerContext + 'static>(p: &ThreadedProducer<C>) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while p.in_flight_count() > 0 {
        assert!(
            Instant::now() < deadline,
            "ThreadedProducer: reports missing after 60 s"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// rdkafka's `FutureProducer`: every record enqueued, every delivery future awaited.
async fn k1_future(topic: &str, warm: &str, payload: &[u8], n: usize) -> Run {
    let p: FutureProducer = raw_producer(&[]).create().expect("FutureProducer");
    p.send(
        FutureRecord::<(), [u8]>::to(warm).payload(payload),
        Duration::from_secs(30),
    )
    .await
    .expect("warm-up record");
    let cpu = crate::cpu::process_cpu();
    let start = Instant::now();
    let mut futures = Vec::with_capacity(n);
    for _ in 0..n {
        let mut rec: FutureRecord<'_, (), [u8]> = FutureRecord::to(topic).payload(payload);
        loop {
            match p.send_result(rec) {
                Ok(f) => break futures.push(f),
                Err((_, back)) => {
                    rec = back;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
    }
    for f in futures {
        f.await.expect("delivery").expect("delivered");
    }
    Run::measure(n, start, cpu)
}

/// onceflow's producer: one `send_batch` of every record.
async fn k1_onceflow(c: &Client, topic: &str, warm: &str, payload: &bytes::Bytes, n: usize) -> Run {
    let p = c.producer(ProducerConfig::new()).await.expect("producer");
    p.send(Record::new(warm.to_string(), payload.clone()))
        .await
        .expect("warm-up record");
    let records: Vec<Record> = (0..n)
        .map(|_| Record::new(topic.to_string(), payload.clone()))
        .collect();
    let cpu = crate::cpu::process_cpu();
    let start = Instant::now();
    for r in p.send_batch(records).await {
        r.expect("delivered");
    }
    Run::measure(n, start, cpu)
}

/// Per-round ratios as printed: `0.912, 1.004, …`.
fn per_round(ratios: &[f64]) -> String {
    ratios
        .iter()
        .map(|r| format!("{r:.3}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// K1: `ONCEFLOW_K1_ROUNDS` rounds (default 5) of every client, a fresh topic per measurement.
/// The figure is the median of the rounds' onceflow / `BaseProducer` ratios (the rates of one
/// client moved by ±30 % between runs minutes apart); rates and CPU are the best of the rounds.
/// 1 000 000 records of 100 B and 200 000 of 1 KiB per measurement (~0.5 s each): with 200 000
/// and 50 000 (~0.1 s) one hiccup of the broker's disk moved a round's ratio by 20 %.
fn k1() {
    let rounds: usize = std::env::var("ONCEFLOW_K1_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5)
        .max(1);
    // For profiling onceflow's producer alone (`perf record`): no raw client runs, no ratio.
    let only_onceflow = std::env::var("ONCEFLOW_K1_ONLY").is_ok_and(|v| v == "onceflow");
    let rt = rt();
    rt.block_on(async {
        let c = client().await;
        let warm = topic(&c, "k1-warm").await;
        // Kept for every round; deleted at the end.
        CREATED.lock().expect("topic list").clear();
        for (label, size, n) in [("100B", 100usize, 1_000_000usize), ("1KiB", 1024, 200_000)] {
            let payload = bytes::Bytes::from(vec![b'x'; size]);
            let (mut base, mut fut, mut of) = (Run::default(), Run::default(), Run::default());
            let mut threaded = Run::default();
            // Each round's onceflow / BaseProducer ratio: the figure is their median.
            let mut ratios = Vec::new();
            for round in 0..rounds {
                if only_onceflow {
                    let t = topic(&c, "k1").await;
                    of = of.best(k1_onceflow(&c, &t, &warm, &payload, n).await);
                    delete_topics(&c).await;
                    continue;
                }
                // The four clients in turn, starting one later each round, so that none is
                // always measured first after a topic deletion or always last.
                let (mut of_run, mut base_run) = (Run::default(), Run::default());
                for k in 0..4 {
                    let t = topic(&c, "k1").await;
                    let (pl, w) = (payload.clone(), warm.clone());
                    match (round + k) % 4 {
                        0 => {
                            base_run = tokio::task::spawn_blocking(move || k1_base(&t, &w, &pl, n))
                                .await
                                .expect("base");
                            base = base.best(base_run);
                        }
                        1 => {
                            threaded = threaded.best(
                                tokio::task::spawn_blocking(move || k1_threaded(&t, &w, &pl, n))
                                    .await
                                    .expect("threaded"),
                            );
                        }
                        2 => fut = fut.best(k1_future(&t, &w, &pl, n).await),
                        _ => {
                            of_run = k1_onceflow(&c, &t, &w, &pl, n).await;
                            of = of.best(of_run);
                        }
                    }
                }
                ratios.push(of_run.rate / base_run.rate);
                delete_topics(&c).await;
            }
            if only_onceflow {
                println!(
                    "K1 {label}: onceflow {:.0} msg/s, {:.2} us/record (best of {rounds}; alone)",
                    of.rate, of.cpu_us
                );
                continue;
            }
            println!(
                "K1 {label}: onceflow {:.0} msg/s, BaseProducer {:.0} msg/s, \
                 FutureProducer {:.0} msg/s (best of {rounds})",
                of.rate, base.rate, fut.rate
            );
            println!(
                "K1 {label} CPU: onceflow {:.2} us/record, BaseProducer {:.2}, FutureProducer \
                 {:.2} (lowest of {rounds})",
                of.cpu_us, base.cpu_us, fut.cpu_us
            );
            println!(
                "K1 {label}: onceflow / BaseProducer per round {}",
                per_round(&ratios)
            );
            ratio(
                "K1",
                &format!("produce-{label}-vs-BaseProducer"),
                crate::stats::median(ratios),
                0.95,
            );
            println!(
                "RATIO K1 produce-{label}-vs-FutureProducer {:.3} target (info) INFO",
                of.rate / fut.rate
            );
            println!(
                "K1 {label}: raw ThreadedProducer {:.0} msg/s, {:.2} us/record (best of {rounds})",
                threaded.rate, threaded.cpu_us
            );
            println!(
                "RATIO K1 produce-{label}-ThreadedProducer-vs-BaseProducer {:.3} target (info) INFO",
                threaded.rate / base.rate
            );
            println!(
                "RATIO K1 cpu-per-record-{label}-BaseProducer-vs-onceflow {:.3} target (info) INFO",
                base.cpu_us / of.cpu_us
            );
        }
        CREATED.lock().expect("topic list").push(warm);
        delete_topics(&c).await;
    });
}

/// How K3 hands its chunks of 1000 records over.
#[derive(Clone, Copy, PartialEq)]
enum K3Mode {
    /// Each chunk's reports are awaited before the next chunk is sent.
    StopAndWait,
    /// Up to [`K3_WINDOW`] chunks in flight: a chunk's reports are awaited only when the window
    /// is full (and, with transactions, before each commit).
    Pipelined,
}

/// One chunk's delivery reports, to be awaited.
type InFlight = std::pin::Pin<
    Box<
        dyn std::future::Future<Output = Vec<onceflow_core::Result<onceflow_core::Delivery>>>
            + Send,
    >,
>;

/// Chunks in flight in [`K3Mode::Pipelined`], unless `ONCEFLOW_K3_WINDOW` says otherwise:
/// 32 000 records, as the raw loop ([`k3_raw`]) keeps up to librdkafka's local queue (100 000
/// records) in flight. With 8 the onceflow loops were bound by the round trip: waiting for the
/// window's oldest chunk took 50-100 ms of each 100 ms transaction.
const K3_WINDOW: usize = 32;

fn k3_window() -> usize {
    std::env::var("ONCEFLOW_K3_WINDOW")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|w| *w > 0)
        .unwrap_or(K3_WINDOW)
}

/// The same loop with and without transactions: chunks of 1000 records; with transactions, a
/// commit whenever 100 ms have passed. Without transactions each chunk is a `send_batch` call
/// polled once at once (its records are enqueued then) and awaited later; with them, a
/// `Transaction::enqueue_batch` future. Either way one task builds and enqueues every chunk.
async fn k3_loop(c: &Client, transactional: bool, mode: K3Mode, n: usize) -> f64 {
    let t = topic(c, "k3").await;
    let config = if transactional {
        ProducerConfig::new().transactional_id(name("k3-tx"))
    } else {
        ProducerConfig::new()
    };
    let p = c.producer(config).await.expect("producer");
    let payload = bytes::Bytes::from(vec![b'x'; 100]);
    // Warm-up: one record delivered (in a committed transaction for the transactional
    // producer) before the clock starts, so neither side's figure holds its start-up.
    let warm = Record::new(t.clone(), payload.clone());
    if transactional {
        let mut tx = p.begin().await.expect("begin");
        tx.send(warm).await.expect("warm-up record");
        tx.commit().await.expect("commit");
    } else {
        p.send(warm).await.expect("warm-up record");
    }
    let window = match mode {
        K3Mode::StopAndWait => 1,
        K3Mode::Pipelined => k3_window(),
    };
    let chunk = 1000;
    let start = Instant::now();
    let mut tx = None;
    let mut tx_started = Instant::now();
    let mut in_flight: std::collections::VecDeque<InFlight> = std::collections::VecDeque::new();
    let mut sent = 0;
    while sent < n {
        let records: Vec<Record> = (0..chunk)
            .map(|_| Record::new(t.clone(), payload.clone()))
            .collect();
        if in_flight.len() >= window {
            for r in in_flight.pop_front().expect("in flight").await {
                r.expect("delivered");
            }
        }
        if transactional {
            if tx.is_none() {
                tx = Some(p.begin().await.expect("begin"));
                tx_started = Instant::now();
            }
            let open = tx.as_mut().expect("open");
            in_flight.push_back(open.enqueue_batch(records).await);
        } else {
            // Polled once here, so that its records are enqueued now, by this task, as
            // `enqueue_batch` does with transactions; awaited later.
            let p = p.clone();
            let mut send: InFlight = Box::pin(async move { p.send_batch(records).await });
            let early = std::future::poll_fn(|cx| {
                std::task::Poll::Ready(match send.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => Some(v),
                    std::task::Poll::Pending => None,
                })
            })
            .await;
            in_flight.push_back(match early {
                Some(v) => Box::pin(std::future::ready(v)),
                None => send,
            });
        }
        if mode == K3Mode::StopAndWait {
            for r in in_flight.pop_front().expect("in flight").await {
                r.expect("delivered");
            }
        }
        sent += chunk;
        if transactional && tx_started.elapsed() >= Duration::from_millis(100) {
            for f in in_flight.drain(..) {
                for r in f.await {
                    r.expect("delivered");
                }
            }
            tx.take().expect("open").commit().await.expect("commit");
        }
    }
    for f in in_flight.drain(..) {
        for r in f.await {
            r.expect("delivered");
        }
    }
    if let Some(open) = tx.take() {
        open.commit().await.expect("commit");
    }
    let rate = sent as f64 / start.elapsed().as_secs_f64();
    delete_topics(c).await;
    rate
}

/// The pipelined K3 loop on raw rdkafka (`BaseProducer`, polled on this thread), for the
/// platform's own cost of transactions: records produced in chunks of 1000 without waiting for
/// reports (only for room when the local queue is full); with transactions, every report is in
/// before each commit (every 100 ms). Run on a blocking thread. (No stop-and-wait variant:
/// `BaseProducer::poll` with a timeout always lasts that long, which would set its pace.)
fn k3_raw(transactional: bool, topic: &str, n: usize) -> f64 {
    let id = name("k3-raw-tx");
    let mut config = raw_producer(&[]);
    if transactional {
        config.set("transactional.id", &id);
    }
    let p: BaseProducer = config.create().expect("BaseProducer");
    let payload = [b'x'; 100];
    if transactional {
        p.init_transactions(Duration::from_secs(30))
            .expect("init_transactions");
        p.begin_transaction().expect("begin");
    }
    p.send(BaseRecord::<(), [u8]>::to(topic).payload(&payload[..]))
        .expect("warm-up record");
    drain(&p);
    if transactional {
        p.commit_transaction(Duration::from_secs(30))
            .expect("commit");
    }
    let chunk = 1000;
    let start = Instant::now();
    let mut open = false;
    let mut tx_started = Instant::now();
    let mut sent = 0;
    while sent < n {
        if transactional && !open {
            p.begin_transaction().expect("begin");
            open = true;
            tx_started = Instant::now();
        }
        for _ in 0..chunk {
            produce_raw(
                topic,
                &payload,
                |r| p.send(r).err().map(|(_, back)| back),
                || p.poll(Duration::from_millis(1)),
            );
            p.poll(Duration::ZERO);
        }
        sent += chunk;
        if open && tx_started.elapsed() >= Duration::from_millis(100) {
            // Reports first (see `drain`): rust-rdkafka's commit would flush in polls of up to
            // 100 ms.
            drain(&p);
            p.commit_transaction(Duration::from_secs(30))
                .expect("commit");
            open = false;
        }
    }
    drain(&p);
    if open {
        p.commit_transaction(Duration::from_secs(30))
            .expect("commit");
    }
    sent as f64 / start.elapsed().as_secs_f64()
}

/// [`k3_raw`] pipelined, `rounds` paired rounds (no transactions, then transactions; the order
/// swapped every other round): (best no-transaction rate, best transaction rate, each round's
/// ratio).
async fn k3_raw_rounds(c: &Client, n: usize, rounds: usize) -> (f64, f64, Vec<f64>) {
    let (mut plain, mut txn, mut ratios) = (0f64, 0f64, Vec::new());
    for round in 0..rounds {
        let (mut p, mut t) = (0f64, 0f64);
        let order = if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for transactional in order {
            let topic = topic(c, "k3-raw").await;
            let r = tokio::task::spawn_blocking(move || k3_raw(transactional, &topic, n))
                .await
                .expect("raw K3");
            if transactional {
                t = r;
            } else {
                p = r;
            }
            delete_topics(c).await;
        }
        plain = plain.max(p);
        txn = txn.max(t);
        ratios.push(t / p);
    }
    (plain, txn, ratios)
}

/// K3: `ONCEFLOW_K3_ROUNDS` paired rounds (default 9; the order of the two loops swapped every
/// other round), pipelined (the figure: the median of the rounds' ratios) and stop-and-wait
/// (info, two rounds). Paired because the rates move by ±30 % between runs minutes apart on
/// this machine (the broker's disk writes back GBs per run); a ratio of two runs side by side
/// moves less. A round's ratio still ranges over 0.75–1.16 here, so the median is taken over
/// nine of them (with five, 4 of 5 runs' medians were ≥ 0.90).
fn k3() {
    rt().block_on(async {
        let c = client().await;
        // Long enough for tens of transactions: with 200 000 records (~0.25 s, two or three
        // commits) one slow commit (librdkafka retries a partition registration that meets the
        // previous transaction's markers after a fixed 20 ms) decided the figure.
        let n: usize = std::env::var("ONCEFLOW_K3_MESSAGES")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|n| *n > 0)
            .unwrap_or(2_000_000);
        let rounds: usize = std::env::var("ONCEFLOW_K3_ROUNDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|n| *n > 0)
            .unwrap_or(9);
        for (mode, label, rounds) in [
            (K3Mode::Pipelined, "pipelined", rounds),
            (K3Mode::StopAndWait, "stop-and-wait", 2),
        ] {
            let (mut plain, mut txn, mut ratios) = (0f64, 0f64, Vec::new());
            for round in 0..rounds {
                let (p, t) = if round % 2 == 0 {
                    let p = k3_loop(&c, false, mode, n).await;
                    (p, k3_loop(&c, true, mode, n).await)
                } else {
                    let t = k3_loop(&c, true, mode, n).await;
                    (k3_loop(&c, false, mode, n).await, t)
                };
                plain = plain.max(p);
                txn = txn.max(t);
                ratios.push(t / p);
            }
            println!(
                "K3 {label}: transactions every 100 ms {txn:.0} msg/s, no transactions \
                 {plain:.0} msg/s (best of {rounds}); ratio per round {}",
                per_round(&ratios)
            );
            if mode == K3Mode::Pipelined {
                println!(
                    "K3 {label}: window of {} chunks of 1000 records",
                    k3_window()
                );
                let (raw_plain, raw_txn, raw_ratios) = k3_raw_rounds(&c, n, rounds).await;
                println!(
                    "K3 {label} raw rdkafka: transactions every 100 ms {raw_txn:.0} msg/s, no \
                     transactions {raw_plain:.0} msg/s (best of {rounds}); ratio per round {}",
                    per_round(&raw_ratios)
                );
                println!(
                    "RATIO K3 raw-rdkafka-tx-every-100ms-vs-no-tx {:.3} target (info) INFO",
                    crate::stats::median(raw_ratios)
                );
                ratio(
                    "K3",
                    "tx-every-100ms-vs-no-tx",
                    crate::stats::median(ratios),
                    0.90,
                );
            } else {
                println!(
                    "RATIO K3 tx-every-100ms-vs-no-tx-stop-and-wait {:.3} target (info) INFO",
                    crate::stats::median(ratios)
                );
            }
        }
    });
}

/// The transform every K4 contender applies: the payload, keyed as the input.
struct Copy(String);

#[async_trait::async_trait]
impl Transform for Copy {
    async fn transform(&self, m: &OfMessage) -> Result<Vec<Record>, BoxError> {
        let mut r = Record::new(self.0.clone(), m.payload.clone());
        if let Some(k) = &m.key {
            r = r.key(k.clone());
        }
        Ok(vec![r])
    }
}

async fn k4_onceflow(c: &Client, input: &str, n: u64) -> f64 {
    let output = topic(c, "k4-out").await;
    let start = Instant::now();
    let consumer = c
        .consumer(
            ConsumerConfig::new(name("k4-of"), [input.to_string()])
                .start(StartFrom::committed_or_earliest()),
        )
        .await
        .expect("consumer");
    let producer = c
        .producer(ProducerConfig::new().transactional_id(name("k4-of-tx")))
        .await
        .expect("producer");
    let pipeline = Pipeline::with_config(
        consumer,
        producer,
        None,
        Arc::new(Copy(output)),
        // Commits every 100 ms, as the raw loops do (the default also commits after 10 000
        // inputs, which at this rate is every ~30 ms).
        PipelineConfig {
            max_transaction_inputs: usize::MAX,
            ..PipelineConfig::default()
        },
    )
    .expect("pipeline");
    let metrics = pipeline.metrics();
    // The clock stops when the last input is processed, as the raw loops' does; the drain (the
    // last commit) and the consumer's close (leaving the group) come after, unmeasured.
    let done = Arc::new(std::sync::OnceLock::new());
    let done_at = done.clone();
    let summary = pipeline
        .run_until(async move {
            // Besides the rate: when the first input was processed (group join, first fetch)
            // and the rate from the tenth input in ten to the last (the steady state).
            let (mut first, mut tenth) = (None, None);
            loop {
                let processed = metrics.snapshot().processed;
                if first.is_none() && processed > 0 {
                    first = Some(start.elapsed());
                }
                if tenth.is_none() && processed >= n / 10 {
                    tenth = Some((start.elapsed(), processed));
                }
                if processed >= n {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let (at, from) = tenth.expect("the tenth input was seen");
            println!(
                "INFO K4 pipeline-first-input-ms {:.0}",
                first.expect("an input was seen").as_secs_f64() * 1e3
            );
            println!(
                "INFO K4 pipeline-steady-msg-per-s {:.0}",
                (n - from) as f64 / (start.elapsed() - at).as_secs_f64()
            );
            let _ = done_at.set(start.elapsed());
        })
        .await
        .expect("pipeline run");
    assert!(summary.metrics.processed >= n);
    n as f64
        / done
            .get()
            .expect("stopped after the last input")
            .as_secs_f64()
}

/// The hand-written rdkafka loop: `BaseConsumer` (read_committed, manual commit) and a
/// transactional `FutureProducer`; records are enqueued as they are read, and every 100 ms the
/// deliveries are awaited, the next offsets sent with `send_offsets_to_transaction` and the
/// transaction committed.
fn k4_rdkafka(input: &str, output: &str, n: u64) -> f64 {
    let start = Instant::now();
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .set("group.id", name("k4-raw"))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("isolation.level", "read_committed")
        .create()
        .expect("consumer");
    consumer.subscribe(&[input]).expect("subscribe");
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap())
        .set("transactional.id", name("k4-raw-tx"))
        .create()
        .expect("producer");
    let timeout = Duration::from_secs(30);
    producer.init_transactions(timeout).expect("init");
    producer.begin_transaction().expect("begin");
    let mut tx_started = Instant::now();
    let mut pending = Vec::new();
    let mut next: HashMap<i32, i64> = HashMap::new();
    let mut done = 0u64;
    let commit = |pending: &mut Vec<rdkafka::producer::DeliveryFuture>,
                  next: &mut HashMap<i32, i64>| {
        for f in pending.drain(..) {
            futures::executor::block_on(f)
                .expect("delivery")
                .expect("delivered");
        }
        if !next.is_empty() {
            let mut tpl = TopicPartitionList::new();
            for (p, o) in next.drain() {
                tpl.add_partition_offset(input, p, Offset::Offset(o))
                    .expect("offset");
            }
            let md = consumer.group_metadata().expect("group metadata");
            producer
                .send_offsets_to_transaction(&tpl, &md, timeout)
                .expect("send offsets");
        }
        producer.commit_transaction(timeout).expect("commit");
    };
    let pending_commit = |pending: &mut Vec<rdkafka::producer::DeliveryFuture>,
                          next: &mut HashMap<i32, i64>| {
        commit(pending, next);
        producer.begin_transaction().expect("begin");
    };
    while done < n {
        if let Some(m) = consumer.poll(Duration::from_millis(100)) {
            let m = m.expect("message");
            let mut rec: FutureRecord<'_, [u8], [u8]> =
                FutureRecord::to(output).payload(m.payload().unwrap_or_default());
            if let Some(k) = m.key() {
                rec = rec.key(k);
            }
            loop {
                match producer.send_result(rec) {
                    Ok(f) => break pending.push(f),
                    Err((_, back)) => {
                        rec = back;
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
            next.insert(m.partition(), m.offset() + 1);
            done += 1;
        }
        if tx_started.elapsed() >= Duration::from_millis(100) {
            pending_commit(&mut pending, &mut next);
            tx_started = Instant::now();
        }
    }
    // As for the pipeline, the clock stops at the last input; the final commit is unmeasured.
    let elapsed = start.elapsed();
    commit(&mut pending, &mut next);
    n as f64 / elapsed.as_secs_f64()
}

/// The same loop in confluent-kafka-python (`benches/kafka_eos_loop.py`), in the venv the
/// interop tests use.
fn k4_python(input: &str, output: &str, n: u64) -> Option<f64> {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let env = std::process::Command::new("bash")
        .arg(repo.join("tests/interop/kafka-env.sh"))
        .output()
        .ok()?;
    let python = String::from_utf8_lossy(&env.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("PYTHON=").map(str::to_string))?;
    let out = std::process::Command::new(python)
        .arg(repo.join("benches/kafka_eos_loop.py"))
        .args([
            bootstrap(),
            input.to_string(),
            output.to_string(),
            n.to_string(),
            name("k4-py"),
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!(
            "K4 python loop failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()?
        .trim()
        .parse()
        .ok()
}

/// K4: one pre-filled input, read by each contender with its own group.
fn k4() {
    let rt = rt();
    // Inputs per run (`ONCEFLOW_K4_MESSAGES`, default 1 000 000). Each contender's clock
    // includes its group join and the first fetches: with 100 000 inputs (0.3–0.9 s a run)
    // those decided the figure, and the raw loops swung 2.5× between runs.
    let n: u64 = std::env::var("ONCEFLOW_K4_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let input = rt.block_on(async {
        let c = client().await;
        let input = topic(&c, "k4-in").await;
        let p = c.producer(ProducerConfig::new()).await.expect("producer");
        let payload = bytes::Bytes::from(vec![b'x'; 100]);
        let records = (0..n)
            .map(|i| Record::new(input.clone(), payload.clone()).key(format!("k{}", i % 1000)))
            .collect();
        for r in p.send_batch(records).await {
            r.expect("input");
        }
        input
    });
    // `ONCEFLOW_K4_ONLY=onceflow` runs the pipeline alone (for profiling; no RATIO lines).
    let only_onceflow = std::env::var("ONCEFLOW_K4_ONLY").is_ok_and(|v| v == "onceflow");
    let (mut of, mut raw) = (0f64, 0f64);
    for _ in 0..2 {
        let i = input.clone();
        let o = rt.block_on(async { topic(&client().await, "k4-out").await });
        if !only_onceflow {
            raw = raw.max(
                std::thread::spawn(move || k4_rdkafka(&i, &o, n))
                    .join()
                    .expect("rdkafka loop"),
            );
        }
        of = of.max(rt.block_on(async {
            let c = client().await;
            k4_onceflow(&c, &input, n).await
        }));
    }
    if only_onceflow {
        println!("K4: onceflow pipeline {of:.0} msg/s (alone)");
        rt.block_on(async { delete_topics(&client().await).await });
        return;
    }
    let o = rt.block_on(async { topic(&client().await, "k4-out").await });
    let py = k4_python(&input, &o, n);
    println!(
        "K4: onceflow pipeline {of:.0} msg/s, rdkafka loop {raw:.0} msg/s, confluent-kafka-python \
         loop {} msg/s",
        py.map(|v| format!("{v:.0}"))
            .unwrap_or_else(|| "n/a".into())
    );
    rt.block_on(async { delete_topics(&client().await).await });
    ratio("K4", "eos-pipeline-vs-rdkafka-loop", of / raw, 0.95);
    match py {
        Some(py) => ratio("K4", "eos-pipeline-vs-confluent-kafka-python", of / py, 3.0),
        None => println!("RATIO K4 eos-pipeline-vs-confluent-kafka-python n/a target >=3 MISS"),
    }
}
