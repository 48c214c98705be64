//! The engine conformance suite (idempotent consumer, pipeline) on `memory://`; no case may be
//! skipped.

use onceflow_conformance::harness::{random_suffix, Harness, PlatformHarness, Timings};
use onceflow_memory::MemoryPlatform;

fn memory() -> PlatformHarness {
    let name = format!("engine-{}", random_suffix());
    let platform = onceflow_memory::connect(&format!("memory://{name}")).expect("memory:// URL");
    MemoryPlatform::forget(&name);
    PlatformHarness::new(platform, Timings::in_process()).forbid_skips()
}

onceflow_conformance::engine_suite!(memory());

/// A requeue needs an idempotency key: sending one without is a Config error naming it (#31).
#[tokio::test]
async fn a_requeue_without_an_idempotency_key_is_refused_on_send() {
    let client = onceflow_core::Client::new(memory().platform());
    let producer = client
        .producer(onceflow_core::ProducerConfig::new())
        .await
        .unwrap();
    let err = producer
        .send(onceflow_core::Record::new("orders", "job").requeue(1))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), onceflow_core::ErrorKind::Config);
    assert!(err.message().contains("no idempotency key"), "{err}");
}

/// onceflow's own headers are read in any casing: a client that canonicalises names writes
/// `Idempotency-Key` / `Onceflow-Key-Generation`, and its repeats must still be duplicates (before,
/// both copies ran keyless) and its generations still new (#31).
#[tokio::test]
async fn idempotency_headers_are_read_in_any_casing() {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use onceflow_core::{
        handler_fn, ConsumerConfig, IdempotentConsumer, ProducerConfig, Record, StartFrom,
    };
    let client = onceflow_core::Client::new(memory().platform());
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    let sends = [
        ("job", None),
        ("job", None),
        ("job", Some("1")),
        ("job", Some("1")),
    ];
    for (payload, generation) in sends {
        let mut r = Record::new("orders", payload).header("Idempotency-Key", "order-1");
        if let Some(g) = generation {
            r = r.header("Onceflow-Key-Generation", g);
        }
        producer.send(r).await.unwrap();
    }
    let consumer = client
        .consumer(ConsumerConfig::new("billing", ["orders"]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let store = onceflow_core::dedup::open("memory://", Duration::from_secs(60))
        .await
        .unwrap();
    let ran = Arc::new(Mutex::new(0u32));
    let counted = ran.clone();
    let engine = IdempotentConsumer::new(
        consumer,
        Some(store),
        handler_fn(move |_m| {
            let counted = counted.clone();
            async move {
                *counted.lock().unwrap() += 1;
                Ok(None)
            }
        }),
    );
    let mut seen = 0;
    for _ in 0..50 {
        seen += engine.step().await.unwrap();
        if seen >= 4 {
            break;
        }
    }
    assert_eq!(seen, 4, "all four copies consumed");
    let m = engine.metrics().snapshot();
    assert_eq!(
        *ran.lock().unwrap(),
        2,
        "generation 0 once, generation 1 once: {m:?}"
    );
    assert_eq!(m.duplicates_skipped, 2, "{m:?}");
    assert_eq!(m.keyless, 0, "{m:?}");
}

/// `Consumer::commit` of several positions of one partition commits the highest, whatever
/// their order (before, the last listed: `commit([m2, m1])` moved the group back to m1) (#31).
#[tokio::test]
async fn a_commit_takes_the_highest_position_of_each_partition() {
    use std::time::Duration;

    use onceflow_core::{ConsumerConfig, ProducerConfig, Record, StartFrom};
    let client = onceflow_core::Client::new(memory().platform());
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    for i in 0..3 {
        producer
            .send(Record::new("orders", format!("m{i}")))
            .await
            .unwrap();
    }
    let consumer = client
        .consumer(ConsumerConfig::new("billing", ["orders"]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let got = consumer.poll(10, Duration::from_secs(2)).await.unwrap();
    assert_eq!(got.len(), 3);
    let tp = got[0].topic_partition();
    consumer
        .commit(&[
            (tp.clone(), got[2].position.clone()),
            (tp.clone(), got[1].position.clone()),
        ])
        .await
        .unwrap();
    let committed = consumer.committed(std::slice::from_ref(&tp)).await.unwrap();
    assert_eq!(committed[0].next, got[2].position.next());
}
