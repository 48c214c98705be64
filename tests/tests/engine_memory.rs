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
