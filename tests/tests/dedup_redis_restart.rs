//! Redis restarted mid-run (`tests/brokers/redis/restart.sh`: stop, start on the same data)
//! loses no completed key. Its own test binary: the restart would disturb other tests running
//! beside it.

mod redis_postgres;

use std::sync::Arc;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread")]
async fn store_restart_mid_run_loses_no_completed_key() {
    let Some(base) = redis_postgres::service_url("ONCEFLOW_REDIS_URL", "redis") else {
        return;
    };
    let url = format!("{base}?prefix=restart-{}:", redis_postgres::rand_hex());
    let store = onceflow_redis::RedisStore::open(&url, Duration::from_secs(3600))
        .await
        .unwrap();
    redis_postgres::restart_mid_run(
        Arc::new(store),
        &redis_postgres::broker_script("redis/restart.sh"),
    )
    .await;
}
