//! A producer whose last reference is dropped on a thread outside any tokio runtime (Python or
//! Node freeing it at exit, an application dropping it after its runtime's `block_on`) closes
//! without a panic: the pulsar crate's producer spawns its close on tokio when dropped, which
//! panicked with "there is no reactor running" there. Real Pulsar standalone
//! (`tests/brokers/up.sh pulsar`, `ONCEFLOW_PULSAR_URL`, `ONCEFLOW_PULSAR_ADMIN_URL`); skipped without it unless
//! `ONCEFLOW_REQUIRE_BROKERS=1`.

use onceflow_core::{ProducerConfig, Record};

fn url() -> Option<String> {
    match (
        std::env::var("ONCEFLOW_PULSAR_URL"),
        std::env::var("ONCEFLOW_PULSAR_ADMIN_URL"),
    ) {
        (Ok(v), Ok(admin)) if !v.is_empty() => Some(format!("{v}?admin={admin}")),
        _ => {
            assert!(
                std::env::var("ONCEFLOW_REQUIRE_BROKERS").as_deref() != Ok("1"),
                "ONCEFLOW_REQUIRE_BROKERS=1 but ONCEFLOW_PULSAR_URL is not set (tests/brokers/up.sh pulsar)"
            );
            None
        }
    }
}

#[test]
fn a_producer_dropped_outside_the_runtime_does_not_panic() {
    let Some(url) = url() else { return };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let producer = rt.block_on(async {
        let client = onceflow_core::Client::new(onceflow_pulsar::connect(&url).await.unwrap());
        let producer = client.producer(ProducerConfig::new()).await.unwrap();
        let topic = format!("drop-outside-{}", std::process::id());
        producer.send(Record::new(topic, "x")).await.unwrap();
        producer
    });
    // The runtime lives on (as the bindings' does); the drop happens on a thread of its own.
    let dropped = std::thread::spawn(move || drop(producer)).join();
    assert!(
        dropped.is_ok(),
        "dropping the producer outside the runtime panicked"
    );
    drop(rt);
}
