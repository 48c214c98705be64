//! PostgreSQL restarted mid-run (`tests/brokers/postgres/restart.sh`: fast shutdown, start on
//! the same data) loses no completed key. Its own test binary: the restart would disturb other
//! tests running beside it.

mod redis_postgres;

use std::sync::Arc;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread")]
async fn store_restart_mid_run_loses_no_completed_key() {
    let Some(base) = redis_postgres::service_url("ONCEFLOW_POSTGRES_URL", "postgres") else {
        return;
    };
    let url = format!("{base}?schema=restart_{}", redis_postgres::rand_hex());
    let store = onceflow_postgres::PostgresStore::open(&url, Duration::from_secs(3600))
        .await
        .unwrap();
    redis_postgres::restart_mid_run(
        Arc::new(store),
        &redis_postgres::broker_script("postgres/restart.sh"),
    )
    .await;
}
