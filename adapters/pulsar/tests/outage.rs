//! A broker outage longer than the pulsar crate's connection retry budget, on a real Pulsar
//! standalone (`tests/brokers/up.sh pulsar`, which prints `ONCEFLOW_PULSAR_URL`,
//! `ONCEFLOW_PULSAR_ADMIN_URL`, `ONCEFLOW_PULSAR_FAULT_URL` and
//! `ONCEFLOW_PULSAR_FAULT_UPSTREAM`). The consumer reaches the broker through the fault proxy
//! of `onceflow_conformance::fault_proxy` on the broker's `fault` listener, which advertises the
//! proxy's address, so every connection of the consumer's client goes through it. Without the
//! URLs the test is skipped with that reason; `ONCEFLOW_REQUIRE_BROKERS=1` (set by `make test`)
//! makes a missing broker a failure.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use onceflow_conformance::fault_proxy::FaultProxy;
use onceflow_core::{Client, ConsumerConfig, ErrorKind, ProducerConfig, Record, StartFrom};

mod common;
use common::{name, require};

/// A fault proxy on `listen` relaying to `upstream`; retried while the port is still taken.
async fn start_proxy(listen: &str, upstream: &str) -> FaultProxy {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match FaultProxy::start(listen, upstream).await {
            Ok(p) => return p,
            Err(e) if Instant::now() < deadline => {
                eprintln!("fault proxy on {listen}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("fault proxy on {listen}: {e}"),
        }
    }
}

/// What both outage tests start from: the fault proxy on the broker's `fault` listener, a
/// writer connected straight to the broker, and a reader behind the proxy whose client gives
/// up reconnecting after 2 retries of at most 200 ms; with the proxy's listen address and its
/// upstream. `None` (test skipped) without the broker's URLs.
struct Outage {
    proxy: FaultProxy,
    writer: Client,
    reader: Client,
    listen: String,
    upstream: String,
}

async fn outage() -> Option<Outage> {
    let direct = require("ONCEFLOW_PULSAR_URL")?;
    let admin = require("ONCEFLOW_PULSAR_ADMIN_URL")?;
    let fault = require("ONCEFLOW_PULSAR_FAULT_URL")?;
    let upstream = require("ONCEFLOW_PULSAR_FAULT_UPSTREAM")?;
    let listen = fault.trim_start_matches("pulsar://").to_string();
    let proxy = start_proxy(&listen, &upstream).await;
    let writer = Client::new(
        onceflow_pulsar::connect(&format!("{direct}?admin={admin}"))
            .await
            .unwrap(),
    );
    let reader = Client::new(
        onceflow_pulsar::connect(&format!(
            "{fault}?admin={admin}&connection_max_retries=2&connection_max_backoff_ms=200\
             &operation_timeout_ms=3000"
        ))
        .await
        .unwrap(),
    );
    Some(Outage {
        proxy,
        writer,
        reader,
        listen,
        upstream,
    })
}

/// The crate's consumer stream ended after it gave up reconnecting (here after 2 retries), and
/// the consumer stopped for good: `poll` returned `[]` for ever. Now it subscribes again once
/// the broker is back, `poll` reports a retriable `Connect` error while it cannot, and every
/// message written before, during and after the outage reaches it, with no backlog left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_subscribes_again_after_an_outage_longer_than_the_retries() {
    let started = Instant::now();
    let Some(Outage {
        proxy,
        writer,
        reader,
        listen,
        upstream,
    }) = outage().await
    else {
        return;
    };
    let topic = name("outage");
    let group = name("outage-g");
    let producer = writer.producer(ProducerConfig::new()).await.unwrap();
    let write = |tag: &'static str| {
        let producer = &producer;
        let topic = &topic;
        async move {
            for i in 0..10 {
                producer
                    .send(Record::new(topic.as_str(), format!("{tag}-{i}")))
                    .await
                    .unwrap();
            }
        }
    };
    let consumer = reader
        .consumer(ConsumerConfig::new(group.clone(), [topic.clone()]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let mut seen = BTreeSet::new();
    let mut connect_errors = 0;
    // Reads (and commits) until `want` distinct messages came or `wait` passed.
    macro_rules! read_until {
        ($want:expr, $wait:expr) => {{
            let deadline = Instant::now() + $wait;
            while seen.len() < $want && Instant::now() < deadline {
                match consumer.poll(100, Duration::from_millis(200)).await {
                    Ok(batch) => {
                        for m in &batch {
                            seen.insert(String::from_utf8_lossy(&m.payload).into_owned());
                            consumer.commit_message(m).await.unwrap();
                        }
                    }
                    Err(e) => {
                        assert_eq!(e.kind(), ErrorKind::Connect, "{e}");
                        assert!(e.is_retriable(), "{e}");
                        assert!(
                            e.message().contains(&topic) && e.message().contains(&listen),
                            "the error names the topic and the broker: {e}"
                        );
                        connect_errors += 1;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }};
    }

    write("before").await;
    read_until!(10, Duration::from_secs(20));
    assert_eq!(seen.len(), 10, "before the outage: {seen:?}");

    // The broker is unreachable (connections refused) for 12 s, far beyond the retry budget
    // (2 retries, backoff at most 200 ms).
    drop(proxy);
    write("during").await;
    let down = Instant::now();
    read_until!(usize::MAX, Duration::from_secs(12));
    eprintln!(
        "down for {:?}: {connect_errors} Connect errors, {} messages seen",
        down.elapsed(),
        seen.len()
    );
    assert!(
        connect_errors > 0,
        "poll surfaced no Connect error while the broker was unreachable"
    );

    let _proxy = start_proxy(&listen, &upstream).await;
    write("after").await;
    read_until!(30, Duration::from_secs(40));
    let want: BTreeSet<String> = ["before", "during", "after"]
        .iter()
        .flat_map(|t| (0..10).map(move |i| format!("{t}-{i}")))
        .collect();
    assert_eq!(
        seen, want,
        "every message before, during and after the outage"
    );

    // The commits reach the broker: no backlog is left.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let lag: u64 = consumer
            .lag()
            .await
            .unwrap()
            .iter()
            .map(|l| l.messages)
            .sum();
        if lag == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "lag still {lag}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    consumer.close().await.unwrap();
    producer.close().await.unwrap();
    eprintln!(
        "outage test took {:?} ({connect_errors} Connect errors in all)",
        started.elapsed()
    );
}

/// The idempotent consumer rides out the same outage: the poll's retriable `Connect` errors
/// (its consumer subscribing again) are waited out with the engine's backoff instead of ending
/// the run (before, `run_until` returned the first one as its error and closed the consumer),
/// and every message written before, during and after is handled once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_idempotent_consumer_rides_out_an_outage_longer_than_the_retries() {
    use std::sync::{Arc, Mutex};

    use onceflow_core::dedup::MemoryStore;
    use onceflow_core::{handler_fn, EngineConfig, IdempotentConsumer};

    let Some(Outage {
        proxy,
        writer,
        reader,
        listen,
        upstream,
    }) = outage().await
    else {
        return;
    };
    let topic = name("outage-engine");
    let producer = writer.producer(ProducerConfig::new()).await.unwrap();
    let write = |tag: &'static str| {
        let (producer, topic) = (&producer, &topic);
        async move {
            for i in 0..10 {
                let payload = format!("{tag}-{i}");
                producer
                    .send(Record::new(topic.as_str(), payload.clone()).idempotency_key(payload))
                    .await
                    .unwrap();
            }
        }
    };
    let consumer = reader
        .consumer(
            ConsumerConfig::new(name("outage-engine-g"), [topic.clone()])
                .start(StartFrom::Earliest),
        )
        .await
        .unwrap();
    let handled = Arc::new(Mutex::new(Vec::<String>::new()));
    let seen = handled.clone();
    let engine = IdempotentConsumer::with_config(
        consumer,
        Some(Arc::new(MemoryStore::new(Duration::from_secs(600), 1000))),
        Arc::new(handler_fn(move |m: onceflow_core::Message| {
            let seen = seen.clone();
            async move {
                seen.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&m.payload).into_owned());
                Ok(None)
            }
        })),
        EngineConfig {
            max_backoff: Duration::from_millis(500),
            ..EngineConfig::default()
        },
        None,
    )
    .unwrap();
    let count = |h: &Arc<Mutex<Vec<String>>>| h.lock().unwrap().len();
    let watched = handled.clone();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(engine.run_until(async move {
        let _ = stop_rx.await;
    }));
    write("before").await;
    let until = |n: usize, wait: Duration| {
        let watched = watched.clone();
        async move {
            let deadline = Instant::now() + wait;
            while count(&watched) < n && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    until(10, Duration::from_secs(20)).await;
    drop(proxy);
    write("during").await;
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert!(
        !run.is_finished(),
        "the run ended during the outage: {:?}",
        run.await
    );
    let _proxy = start_proxy(&listen, &upstream).await;
    write("after").await;
    until(30, Duration::from_secs(40)).await;
    let _ = stop_tx.send(());
    let summary = run
        .await
        .unwrap()
        .expect("the run ends cleanly at shutdown");
    let mut got = handled.lock().unwrap().clone();
    got.sort();
    let want: BTreeSet<String> = ["before", "during", "after"]
        .iter()
        .flat_map(|t| (0..10).map(move |i| format!("{t}-{i}")))
        .collect();
    assert_eq!(
        got,
        want.into_iter().collect::<Vec<_>>(),
        "every message handled once"
    );
    eprintln!("engine outage: {:?}", summary.metrics);
    producer.close().await.unwrap();
}
