//! The checkpoint-store (lease table) conformance suite on redis (`ONCEFLOW_REDIS_URL`, started by
//! `tests/brokers/up.sh redis`); each harness opens its own key space.

mod redis_postgres;

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use onceflow_conformance::checkpoint_suite::CheckpointHarness;
use onceflow_core::checkpoint::SharedCheckpointStore;

struct Harness {
    location: String,
    opened: Mutex<bool>,
}

#[async_trait]
impl CheckpointHarness for Harness {
    async fn open(&self) -> SharedCheckpointStore {
        *self.opened.lock().unwrap() = true;
        Arc::new(
            onceflow_redis::RedisCheckpointStore::open(&self.location)
                .await
                .unwrap_or_else(|e| panic!("open {}: {e}", self.location)),
        )
    }

    async fn reopen(&self) -> Option<SharedCheckpointStore> {
        assert!(*self.opened.lock().unwrap(), "reopen before open");
        Some(Arc::new(
            onceflow_redis::RedisCheckpointStore::open(&self.location)
                .await
                .unwrap_or_else(|e| panic!("reopen {}: {e}", self.location)),
        ))
    }
}

/// The harness, or `None` (test skipped) without a URL.
fn harness() -> Option<Harness> {
    let base = redis_postgres::service_url("ONCEFLOW_REDIS_URL", "redis")?;
    Some(Harness {
        location: format!("{base}?prefix=cp-suite-{}:", redis_postgres::rand_hex()),
        opened: Mutex::new(false),
    })
}

onceflow_conformance::checkpoint_suite!(match harness() {
    Some(h) => h,
    None => return,
});

#[tokio::test]
async fn facade_opens_redis_checkpoint_urls() {
    let Some(base) = redis_postgres::service_url("ONCEFLOW_REDIS_URL", "redis") else {
        return;
    };
    let url = format!("{base}?prefix=cp-facade-{}:", redis_postgres::rand_hex());
    let store = onceflow::checkpoint_store(&url).await.unwrap();
    assert_eq!(store.name(), "redis");
    let e = match onceflow::checkpoint_store("redis://u:hunter2@127.0.0.1:1").await {
        Ok(_) => panic!("an unreachable Redis opened"),
        Err(e) => e,
    };
    assert_eq!(e.kind(), onceflow_core::ErrorKind::DedupStore, "{e}");
    assert!(e.message().contains("redis://u:***@127.0.0.1:1"), "{e}");
}
