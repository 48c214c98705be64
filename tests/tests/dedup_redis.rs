//! The dedup-store conformance suite on Redis (`ONCEFLOW_REDIS_URL`, started by
//! `tests/brokers/up.sh redis`), each case under its own key prefix; plus two processes racing
//! over one store and clear errors for unusable URLs.

mod redis_postgres;

use std::sync::Arc;
use std::time::Duration;

use onceflow_core::ErrorKind;
use redis_postgres::{rand_hex, service_url, Opener, UrlHarness};

const VAR: &str = "ONCEFLOW_REDIS_URL";

fn opener() -> Opener {
    |url, window| {
        Box::pin(async move {
            let store = onceflow_redis::RedisStore::open(&url, window).await?;
            Ok(Arc::new(store) as onceflow_core::dedup::SharedDedupStore)
        })
    }
}

fn fresh(base: &str) -> String {
    format!("{base}?prefix=suite-{}:", rand_hex())
}

/// The harness, or `None` (test skipped) without a Redis URL.
fn harness() -> Option<UrlHarness> {
    let base = service_url(VAR, "redis")?;
    let port = url::Url::parse(&base)
        .ok()
        .and_then(|u| u.port())
        .unwrap_or(6379);
    Some(UrlHarness {
        unusable: vec![
            // Nothing listens there.
            "redis://127.0.0.1:1".to_string(),
            // A database number the server does not have.
            format!("redis://127.0.0.1:{port}/999"),
        ],
        base,
        fresh_location: fresh,
        opener: opener(),
        last: Default::default(),
    })
}

onceflow_conformance::dedup_suite!(match harness() {
    Some(h) => h,
    None => return,
});

#[tokio::test(flavor = "multi_thread")]
async fn two_processes_race_each_key_exactly_once() {
    let location = match std::env::var(redis_postgres::RACE_CHILD_ENV) {
        Ok(l) => l,
        Err(_) => match service_url(VAR, "redis") {
            Some(base) => fresh(&base),
            None => return,
        },
    };
    redis_postgres::race_two_processes(
        opener(),
        location,
        "two_processes_race_each_key_exactly_once",
    )
    .await;
}

#[tokio::test]
async fn wrong_password_and_unreachable_name_the_url_without_password() {
    let Some(base) = service_url(VAR, "redis") else {
        return;
    };
    let mut u = url::Url::parse(&base).unwrap();
    u.set_username("onceflow").unwrap();
    u.set_password(Some("not-the-password")).unwrap();
    let wrong = u.to_string();
    let shown = wrong.replace("not-the-password", "***");
    let e = onceflow_redis::RedisStore::open(&wrong, Duration::from_secs(60))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Auth, "{e}");
    assert!(e.message().contains(&shown), "{e}");
    assert!(!e.to_string().contains("not-the-password"), "{e}");
    assert!(!format!("{e:?}").contains("not-the-password"), "{e:?}");
    // The right password for that ACL user works.
    u.set_password(Some("onceflow")).unwrap();
    onceflow_redis::RedisStore::open(u.as_str(), Duration::from_secs(60))
        .await
        .unwrap();
    // Unreachable, with a password in the URL.
    let e = onceflow_redis::RedisStore::open(
        "redis://user:hunter2@127.0.0.1:1",
        Duration::from_secs(60),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::DedupStore, "{e}");
    assert!(e.message().contains("redis://user:***@127.0.0.1:1"), "{e}");
    assert!(!format!("{e:?}").contains("hunter2"), "{e:?}");
}

#[tokio::test]
async fn facade_opens_redis_urls() {
    let Some(base) = service_url(VAR, "redis") else {
        return;
    };
    let store = onceflow::dedup_store(&fresh(&base), Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(store.name(), "redis");
}
