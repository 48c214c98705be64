//! The backend registry through the facade (`onceflow::PLATFORMS`, `onceflow::STORES`): every
//! platform and store of this build is reached by its scheme on the real services, and a
//! Kinesis lease table on Redis or PostgreSQL is opened at connect through the registry's
//! openers (a wrong store URL fails the connect, not the first consumer).

use std::time::Duration;

use onceflow::{registry, ErrorKind};
use onceflow_conformance::harness::broker_url;

#[test]
fn every_platform_and_store_is_registered_once() {
    let names: Vec<&str> = onceflow::PLATFORMS.iter().map(|p| p.name).collect();
    assert_eq!(names, ["memory", "kafka", "jetstream", "pulsar", "kinesis"]);
    let stores: Vec<&str> = onceflow::STORES.iter().map(|s| s.name).collect();
    assert_eq!(stores, ["redis", "postgres"]);
    let schemes = onceflow::supported_schemes();
    let mut unique = schemes.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(
        unique.len(),
        schemes.len(),
        "a scheme registered twice: {schemes:?}"
    );
    for s in [
        "memory://",
        "kafka://",
        "nats://",
        "tls://",
        "pulsar://",
        "pulsar+ssl://",
        "kinesis://",
    ] {
        assert!(schemes.contains(&s), "{s} missing from {schemes:?}");
    }
    assert_eq!(
        onceflow::supported_stores(),
        ["memory://", "embedded", "redis://", "postgres://"]
    );
    assert!(
        registry::platform_for(onceflow::PLATFORMS, "TLS").is_some_and(|p| p.name == "jetstream")
    );
    assert!(
        registry::store_for(onceflow::STORES, "postgresql").is_some_and(|s| s.name == "postgres")
    );
}

#[tokio::test]
async fn an_unknown_scheme_names_itself_and_what_is_supported() {
    let e = onceflow::connect("amqp://u:S3CR3T@h:1").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.message().contains("'amqp://'"), "{e}");
    assert!(e.message().contains("kinesis://"), "{e}");
    assert!(!e.message().contains("S3CR3T"), "{e}");
}

#[tokio::test]
async fn shared_stores_open_by_scheme() {
    for (var, service) in [
        ("ONCEFLOW_REDIS_URL", "redis"),
        ("ONCEFLOW_POSTGRES_URL", "postgres"),
    ] {
        let Ok(url) = broker_url(var, service) else {
            continue;
        };
        let store = onceflow::dedup_store(&url, Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(store.name(), service);
        onceflow::checkpoint_store(&url).await.unwrap();
    }
}

#[tokio::test]
async fn a_kinesis_lease_table_on_a_shared_store_is_opened_at_connect() {
    let Ok(kinesis) = broker_url("ONCEFLOW_KINESIS_URL", "kinesis") else {
        return;
    };
    let sep = if kinesis.contains('?') { '&' } else { '?' };
    // Nothing listens on port 1: the connect fails, naming the store, before any consumer.
    let bad = format!("{kinesis}{sep}checkpoint_store=redis://127.0.0.1:1");
    let e = onceflow::connect(&bad).await.unwrap_err();
    assert!(e.message().contains("127.0.0.1:1"), "{e}");
    for (var, service) in [
        ("ONCEFLOW_REDIS_URL", "redis"),
        ("ONCEFLOW_POSTGRES_URL", "postgres"),
    ] {
        let Ok(store) = broker_url(var, service) else {
            continue;
        };
        let query: String = url::form_urlencoded::byte_serialize(store.as_bytes()).collect();
        let good = format!("{kinesis}{sep}checkpoint_store={query}");
        let client = onceflow::connect(&good).await.unwrap();
        assert_eq!(client.platform(), "kinesis");
    }
}
