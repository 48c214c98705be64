//! Bad input (issue 7): an unreachable server, wrong credentials (an `Auth` error, issue 23), a
//! schema from a newer onceflow and malformed URLs give clear errors of a kind that name the store URL **without
//! its password** (in the user info or in a secret query key such as `sslpassword`), for the
//! dedup store and the checkpoint store. The cases that need a server use
//! `ONCEFLOW_POSTGRES_URL` (`tests/brokers/up.sh postgres`) and skip without it.

use std::time::Duration;

use onceflow_core::{Error, ErrorKind};
use onceflow_postgres::{PostgresCheckpointStore, PostgresStore};

mod common;
use common::base;

const SECRET: &str = "s3cret-pw-7";

/// `e` has `kind`, names `shown` and shows `secret` nowhere (message, Display, Debug).
fn check(e: &Error, kind: ErrorKind, shown: &str, secret: &str) {
    assert_eq!(e.kind(), kind, "{e}");
    assert!(e.message().contains(shown), "{shown} not named in: {e}");
    for text in [e.to_string(), format!("{e:?}")] {
        assert!(!text.contains(secret), "password shown: {text}");
    }
}

async fn open_both(url: &str) -> (Error, Error) {
    let d = PostgresStore::open(url, Duration::from_secs(60))
        .await
        .expect_err(url);
    let c = PostgresCheckpointStore::open(url).await.expect_err(url);
    (d, c)
}

fn schema() -> String {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("bad_input_{n:x}")
}

#[tokio::test]
async fn unreachable_server_is_a_dedup_store_error_without_the_password() {
    for (url, shown) in [
        (
            format!("postgres://user:{SECRET}@127.0.0.1:1/db"),
            "postgres://user:***@127.0.0.1:1/db".to_string(),
        ),
        // The password in a query key, other options kept (`sslpassword`, which tokio-postgres
        // does not take, is in the malformed cases).
        (
            format!("postgres://user@127.0.0.1:1/db?password={SECRET}&connect_timeout=2"),
            "postgres://user@127.0.0.1:1/db?password=***&connect_timeout=2".to_string(),
        ),
    ] {
        let (d, c) = open_both(&url).await;
        check(&d, ErrorKind::DedupStore, &shown, SECRET);
        check(&c, ErrorKind::DedupStore, &shown, SECRET);
        assert!(d.is_retriable(), "{d}");
    }
}

#[tokio::test]
async fn wrong_password_is_an_auth_error_without_the_password() {
    let Some(base) = base("bad_input") else {
        return;
    };
    let mut u = url::Url::parse(&base).unwrap();
    u.set_password(Some(SECRET)).unwrap();
    let wrong = u.to_string();
    let shown = wrong.replace(SECRET, "***");
    let (d, c) = open_both(&wrong).await;
    for e in [&d, &c] {
        check(e, ErrorKind::Auth, &shown, SECRET);
        assert!(
            e.message().contains("password authentication failed"),
            "not an authentication error: {e}"
        );
        // Wrong credentials do not get better by retrying.
        assert!(!e.is_retriable(), "{e}");
    }
}

#[tokio::test]
async fn schema_from_a_newer_version_is_a_dedup_store_error_without_the_password() {
    let Some(base) = base("bad_input") else {
        return;
    };
    let password = url::Url::parse(&base)
        .unwrap()
        .password()
        .map(str::to_string);
    let schema = schema();
    let location = format!("{base}?schema={schema}&pool_size=1");
    let store = PostgresStore::open(&location, Duration::from_secs(60))
        .await
        .unwrap();
    let client = store.pool().get().await.unwrap();
    client
        .execute(
            &format!(
                "UPDATE {}.onceflow_schema_version SET version = 99",
                store.schema()
            ),
            &[],
        )
        .await
        .unwrap();
    let shown = onceflow_postgres::redact_url(&location);
    let (d, c) = open_both(&location).await;
    for e in [&d, &c] {
        assert_eq!(e.kind(), ErrorKind::DedupStore, "{e}");
        assert!(e.message().contains(&shown), "{shown} not named in: {e}");
        assert!(
            e.message().contains("version 99") && e.message().contains("newer"),
            "{e}"
        );
        if let Some(p) = &password {
            assert!(
                !e.message().contains(&format!(":{p}@")),
                "password shown: {e}"
            );
        }
    }
    client
        .batch_execute(&format!("DROP SCHEMA {} CASCADE", store.schema()))
        .await
        .unwrap();
}

#[tokio::test]
async fn malformed_urls_are_config_errors_without_the_password() {
    for (url, shown) in [
        (
            format!("postgres://u:{SECRET}@127.0.0.1:1/db?pool_size=0"),
            "postgres://u:***@127.0.0.1:1/db?pool_size=0".to_string(),
        ),
        (
            format!("postgres://u:{SECRET}@127.0.0.1:1/db?schema=no-dash"),
            "postgres://u:***@127.0.0.1:1/db?schema=no-dash".to_string(),
        ),
        (
            format!("postgres://u@127.0.0.1:1/db?sslpassword={SECRET}&bogus_option=1"),
            "postgres://u@127.0.0.1:1/db?sslpassword=***&bogus_option=1".to_string(),
        ),
        (
            format!("postgres://u:{SECRET}@[::1/db"),
            "postgres://***@[::1/db".to_string(),
        ),
        (
            format!("postgres://u:{SECRET}@127.0.0.1:1/db?sslmode=verify_full"),
            "postgres://u:***@127.0.0.1:1/db?sslmode=verify_full".to_string(),
        ),
        (
            format!("postgres://u:{SECRET}@127.0.0.1:1/db?sslmode=verify-ca&sslrootcert=/nonexistent.pem"),
            "postgres://u:***@127.0.0.1:1/db?sslmode=verify-ca&sslrootcert=/nonexistent.pem".to_string(),
        ),
        (
            format!("postgres://u:{SECRET}@127.0.0.1:1/db?sslkey=/k.pem"),
            "postgres://u:***@127.0.0.1:1/db?sslkey=/k.pem".to_string(),
        ),
        // libpq's key=value form is not a URL; its password is hidden all the same.
        (
            format!("host=127.0.0.1 port=1 user=u password={SECRET} dbname=db"),
            "host=127.0.0.1 port=1 user=u password=*** dbname=db".to_string(),
        ),
        (
            format!("host=127.0.0.1 password = '{SECRET} x' dbname=db"),
            "host=127.0.0.1 password = *** dbname=db".to_string(),
        ),
    ] {
        let (d, c) = open_both(&url).await;
        check(&d, ErrorKind::Config, &shown, SECRET);
        check(&c, ErrorKind::Config, &shown, SECRET);
    }
    let e = PostgresStore::open(
        &format!("postgres://u:{SECRET}@127.0.0.1:1/db"),
        Duration::ZERO,
    )
    .await
    .unwrap_err();
    check(
        &e,
        ErrorKind::Config,
        "postgres://u:***@127.0.0.1:1/db",
        SECRET,
    );
}
