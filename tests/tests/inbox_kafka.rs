//! Transactional inbox crash test on Kafka (`ONCEFLOW_KAFKA_URL`) with PostgreSQL
//! (`ONCEFLOW_POSTGRES_URL`) and with
//! the embedded SQLite store: see `inbox_crash/mod.rs`.

mod inbox_crash;
mod redis_postgres;

fn connect(url: String) -> inbox_crash::Connected {
    Box::pin(async move { onceflow_kafka::connect(&url).map(|p| p as _) })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_child() {
    let Ok(spec) = std::env::var(inbox_crash::CHILD_VAR) else {
        return; // Only a child started by the crash test runs.
    };
    inbox_crash::child(connect, &spec).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_row_per_input_after_sigkill_at_random_points() {
    if std::env::var(inbox_crash::CHILD_VAR).is_ok() {
        return;
    }
    let Some(kafka) = redis_postgres::service_url("ONCEFLOW_KAFKA_URL", "kafka") else {
        return;
    };
    let Some(pg) = redis_postgres::service_url("ONCEFLOW_POSTGRES_URL", "postgres") else {
        return;
    };
    inbox_crash::crash_test(
        connect,
        &kafka,
        inbox_crash::Store::Postgres(pg),
        "inbox_child",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_store_one_row_per_input_after_sigkill_at_random_points() {
    if std::env::var(inbox_crash::CHILD_VAR).is_ok() {
        return;
    }
    let Some(kafka) = redis_postgres::service_url("ONCEFLOW_KAFKA_URL", "kafka") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    inbox_crash::crash_test(
        connect,
        &kafka,
        inbox_crash::Store::Embedded(dir.path().to_path_buf()),
        "inbox_child",
    )
    .await;
}
