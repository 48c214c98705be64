//! KI1: onceflow's packed Kinesis producer against the AWS SDK for Rust on the same
//! Kinesis-compatible server, in the same run (`ONCEFLOW_KINESIS_URL`, default
//! `kinesis://127.0.0.1:14567?region=us-east-1`; start one with `tests/brokers/up.sh kinesis`).
//!
//! 1 KiB records with a key (partition key), to a stream of 4 shards:
//! - onceflow `send_batch` (the producer packs PutRecords calls: 500 records / 5 MiB) against
//!   hand-batched raw `PutRecords` of 500 entries, one call at a time: **CPU time per record**
//!   of this process (user + system, `clock_gettime(CLOCK_PROCESS_CPUTIME_ID)`), target ≤ 1.1× raw;
//! - onceflow against one raw `PutRecord` per record, one at a time: **rate**, target ≥ 10×.
//!
//! Each figure is the best of `ROUNDS` alternating rounds (the machine is shared).
//!
//! Also printed: raw hand-batched PutRecords against raw single PutRecord calls (`INFO`): how
//! much any packing producer can gain over single calls on this server, the bound of the rate
//! target. `ONCEFLOW_BENCH_KI1_ONLY` (comma-separated `onceflow`, `adapter`, `raw`, `single`)
//! runs only those contenders and prints their figures without ratios, for profiling one path
//! at a time (`perf record`).

use std::time::Instant;

use aws_sdk_kinesis::primitives::Blob;
use aws_sdk_kinesis::types::PutRecordsRequestEntry;
use bytes::Bytes;
use onceflow_core::{PlatformBackend, ProducerConfig, Record, TopicSpec};

const ROUNDS: usize = 3;
const SHARDS: u32 = 4;

fn count() -> usize {
    std::env::var("ONCEFLOW_BENCH_KI1_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000)
}

struct Figure {
    rate: f64,
    cpu_per_record: f64,
}

async fn measure<F: std::future::Future<Output = ()>>(n: usize, f: F) -> Figure {
    let (c0, t0) = (crate::cpu::process_cpu().as_secs_f64(), Instant::now());
    f.await;
    let (c1, wall) = (
        crate::cpu::process_cpu().as_secs_f64(),
        t0.elapsed().as_secs_f64(),
    );
    Figure {
        rate: n as f64 / wall,
        cpu_per_record: (c1 - c0) / n as f64,
    }
}

/// The contenders to run: all, or those named in `ONCEFLOW_BENCH_KI1_ONLY`.
fn selected() -> [bool; 4] {
    const NAMES: [&str; 4] = ["onceflow", "adapter", "raw", "single"];
    match std::env::var("ONCEFLOW_BENCH_KI1_ONLY") {
        Err(_) => [true; 4],
        Ok(v) => {
            let names: Vec<String> = v
                .split(',')
                .map(|s| s.trim().to_ascii_lowercase())
                .collect();
            for n in &names {
                if !NAMES.contains(&n.as_str()) {
                    eprintln!(
                        "ONCEFLOW_BENCH_KI1_ONLY: unknown contender '{n}': expected a \
                         comma-separated list of {}",
                        NAMES.join(", ")
                    );
                    std::process::exit(2);
                }
            }
            NAMES.map(|c| names.iter().any(|n| n == c))
        }
    }
}

fn records(stream: &str, n: usize, payload: &Bytes) -> Vec<Record> {
    (0..n)
        .map(|i| Record::new(stream.to_string(), payload.clone()).key(format!("key-{}", i % 64)))
        .collect()
}

/// Runs KI1.
pub fn run() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(ki1());
}

async fn ki1() {
    let url = std::env::var("ONCEFLOW_KINESIS_URL")
        .unwrap_or_else(|_| "kinesis://127.0.0.1:14567?region=us-east-1".to_string());
    let platform = onceflow_kinesis::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("{url}: {e} (start one with tests/brokers/up.sh kinesis)"));
    let client = onceflow_core::Client::new(platform.clone());
    let sdk = platform.client();
    let admin = platform.admin().await.unwrap();
    let n = count();
    let singles = (n / 10).max(200);
    let payload = Bytes::from(vec![b'x'; 1024]);
    let (mut packed, mut adapter, mut raw, mut single) = (
        None::<Figure>,
        None::<Figure>,
        None::<Figure>,
        None::<Figure>,
    );
    let best = |slot: &mut Option<Figure>, f: Figure| match slot {
        Some(b) if b.rate >= f.rate => {
            b.cpu_per_record = b.cpu_per_record.min(f.cpu_per_record);
        }
        _ => {
            let cpu = slot
                .as_ref()
                .map_or(f.cpu_per_record, |b| b.cpu_per_record.min(f.cpu_per_record));
            *slot = Some(Figure {
                rate: f.rate,
                cpu_per_record: cpu,
            });
        }
    };
    // Every contender writes to a stream of its own, created empty: the emulator's cost per
    // record grows with the records a stream already holds, so sharing one stream would favour
    // whoever writes first.
    let fresh = || async {
        let stream = format!("benchki1-{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff);
        admin
            .create_topic(&TopicSpec::new(stream.clone(), SHARDS))
            .await
            .expect("create stream");
        stream
    };
    let run = selected();
    for round in 0..ROUNDS {
        let mut streams = Vec::new();

        // onceflow through the facade (trace injection, validation, the adapter's packing).
        if run[0] {
            let stream = fresh().await;
            streams.push(stream.clone());
            let producer = client.producer(ProducerConfig::default()).await.unwrap();
            let recs = records(&stream, n, &payload);
            let f = measure(n, async {
                for r in producer.send_batch(recs).await {
                    r.expect("onceflow send");
                }
            })
            .await;
            best(&mut packed, f);
        }

        // The adapter alone (no facade), for locating costs.
        if run[1] {
            let stream = fresh().await;
            streams.push(stream.clone());
            let backend = platform.producer(ProducerConfig::default()).await.unwrap();
            let recs = records(&stream, n, &payload);
            let f = measure(n, async {
                for r in backend.send_batch(recs).await {
                    r.expect("adapter send");
                }
            })
            .await;
            best(&mut adapter, f);
        }

        // Raw PutRecords, hand-batched by 500, one call at a time.
        if run[2] {
            let stream = fresh().await;
            streams.push(stream.clone());
            let f = measure(n, async {
                for chunk in (0..n).collect::<Vec<_>>().chunks(500) {
                    let entries: Vec<PutRecordsRequestEntry> = chunk
                        .iter()
                        .map(|i| {
                            PutRecordsRequestEntry::builder()
                                .data(Blob::new(payload.to_vec()))
                                .partition_key(format!("key-{}", i % 64))
                                .build()
                                .unwrap()
                        })
                        .collect();
                    let out = sdk
                        .put_records()
                        .stream_name(&stream)
                        .set_records(Some(entries))
                        .send()
                        .await
                        .expect("raw PutRecords");
                    assert_eq!(out.failed_record_count(), Some(0));
                }
            })
            .await;
            best(&mut raw, f);
        }

        // Raw PutRecord, one record per call.
        if run[3] {
            let stream = fresh().await;
            streams.push(stream.clone());
            let f = measure(singles, async {
                for i in 0..singles {
                    sdk.put_record()
                        .stream_name(&stream)
                        .data(Blob::new(payload.to_vec()))
                        .partition_key(format!("key-{}", i % 64))
                        .send()
                        .await
                        .expect("raw PutRecord");
                }
            })
            .await;
            best(&mut single, f);
        }
        for s in &streams {
            let _ = admin.delete_topic(s).await;
        }
        eprintln!("[bench] KI1 round {} done", round + 1);
    }
    let shown = |f: &Option<Figure>| {
        f.as_ref().map_or("not run".to_string(), |f| {
            format!(
                "{:.0}/s {:.1} us CPU/record",
                f.rate,
                f.cpu_per_record * 1e6
            )
        })
    };
    eprintln!(
        "[bench] KI1 1 KiB x {n}: onceflow {}; adapter alone {}; raw PutRecords(500) {}; raw \
         PutRecord x {singles} {}",
        shown(&packed),
        shown(&adapter),
        shown(&raw),
        shown(&single),
    );
    let (Some(packed), Some(adapter), Some(raw), Some(single)) = (packed, adapter, raw, single)
    else {
        eprintln!("[bench] KI1: not every contender ran (ONCEFLOW_BENCH_KI1_ONLY): no ratios");
        return;
    };
    let cpu = packed.cpu_per_record / raw.cpu_per_record;
    println!(
        "RATIO KI1 cpu-per-record-vs-raw-putrecords {cpu:.3} target <=1.1 {}",
        if cpu <= 1.1 { "PASS" } else { "MISS" }
    );
    println!(
        "RATIO KI1 cpu-per-record-adapter-only-vs-raw-putrecords {:.3} target (info) INFO",
        adapter.cpu_per_record / raw.cpu_per_record
    );
    let rate = packed.rate / single.rate;
    println!(
        "RATIO KI1 rate-vs-one-putrecord-per-record {rate:.3} target >=10 {}",
        if rate >= 10.0 { "PASS" } else { "MISS" }
    );
    println!(
        "RATIO KI1 rate-vs-raw-putrecords {:.3} target (info) INFO",
        packed.rate / raw.rate
    );
    // The bound of the rate target on this server: what hand-batching alone gains over single
    // calls, with the same SDK, in the same run.
    println!(
        "RATIO KI1 raw-putrecords-rate-vs-raw-putrecord {:.3} target (info) INFO",
        raw.rate / single.rate
    );
}
