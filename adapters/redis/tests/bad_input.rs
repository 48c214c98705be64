//! Bad input (issue 7): an unreachable server, wrong credentials (an `Auth` error, issue 23)
//! and malformed URLs give clear errors of a kind that name the store URL **without its
//! password**, for the dedup store, the
//! checkpoint store and core's URL opener. The cases that need a server use
//! `ONCEFLOW_REDIS_URL` (`tests/brokers/up.sh redis`, which also creates the ACL user
//! `onceflow` with password `onceflow`) and skip without it.

use std::time::Duration;

use onceflow_core::{Error, ErrorKind};
use onceflow_redis::{RedisCheckpointStore, RedisStore};

const SECRET: &str = "s3cret-pw-7";

mod common;

/// `e` has `kind`, names `shown` and shows the secret nowhere (message, Display, Debug).
fn check(e: &Error, kind: ErrorKind, shown: &str) {
    assert_eq!(e.kind(), kind, "{e}");
    assert!(e.message().contains(shown), "{shown} not named in: {e}");
    for text in [e.to_string(), format!("{e:?}")] {
        assert!(!text.contains(SECRET), "password shown: {text}");
    }
}

async fn open_both(url: &str) -> (Error, Error) {
    let d = RedisStore::open(url, Duration::from_secs(60))
        .await
        .expect_err(url);
    let c = RedisCheckpointStore::open(url).await.expect_err(url);
    (d, c)
}

#[tokio::test]
async fn unreachable_server_is_a_dedup_store_error_without_the_password() {
    for (url, shown) in [
        (
            format!("redis://user:{SECRET}@127.0.0.1:1"),
            "redis://user:***@127.0.0.1:1".to_string(),
        ),
        // Password only (the default user).
        (
            format!("redis://:{SECRET}@127.0.0.1:1/0"),
            "redis://:***@127.0.0.1:1/0".to_string(),
        ),
        // A user name alone may be a token: hidden too.
        (
            format!("redis://{SECRET}@127.0.0.1:1"),
            "redis://***@127.0.0.1:1".to_string(),
        ),
    ] {
        let (d, c) = open_both(&url).await;
        check(&d, ErrorKind::DedupStore, &shown);
        check(&c, ErrorKind::DedupStore, &shown);
        assert!(d.is_retriable(), "{d}");
    }
}

#[tokio::test]
async fn wrong_password_is_an_auth_error_without_the_password() {
    let Some(base) = common::base("bad_input") else {
        return;
    };
    let mut u = url::Url::parse(&base).unwrap();
    // The ACL user the test server has (password `onceflow`), with a wrong password.
    u.set_username("onceflow").unwrap();
    u.set_password(Some(SECRET)).unwrap();
    let wrong = u.to_string();
    let shown = wrong.replace(SECRET, "***");
    let (d, c) = open_both(&wrong).await;
    for e in [&d, &c] {
        check(e, ErrorKind::Auth, &shown);
        assert!(!e.is_retriable(), "{e}");
        assert!(
            e.message().contains("WRONGPASS")
                || e.message().to_lowercase().contains("authentication failed"),
            "not an authentication error: {e}"
        );
    }
    // The same user with its password opens: the failure above was the password.
    u.set_password(Some("onceflow")).unwrap();
    RedisStore::open(u.as_str(), Duration::from_secs(60))
        .await
        .unwrap();
}

#[tokio::test]
async fn malformed_urls_are_config_errors_without_the_password() {
    for (url, kind, shown) in [
        (
            format!("redis://u:{SECRET}@127.0.0.1:1?bogus=1"),
            ErrorKind::Config,
            "redis://u:***@127.0.0.1:1?bogus=1",
        ),
        (
            format!("redis://u:{SECRET}@127.0.0.1:1?password={SECRET}"),
            ErrorKind::Config,
            "redis://u:***@127.0.0.1:1?password=***",
        ),
        (
            format!("redis://u:{SECRET}@[::1"),
            ErrorKind::Config,
            "redis://***@[::1",
        ),
        // A CA file that is not there.
        (
            format!("rediss://u:{SECRET}@127.0.0.1:1?ca=/nonexistent/ca.pem"),
            ErrorKind::Config,
            "rediss://u:***@127.0.0.1:1?ca=/nonexistent/ca.pem",
        ),
        // TLS options without TLS.
        (
            format!("redis://u:{SECRET}@127.0.0.1:1?ca=/nonexistent/ca.pem"),
            ErrorKind::Config,
            "redis://u:***@127.0.0.1:1?ca=/nonexistent/ca.pem",
        ),
    ] {
        let (d, c) = open_both(&url).await;
        check(&d, kind, shown);
        check(&c, kind, shown);
    }
    let e = RedisStore::open(&format!("redis://u:{SECRET}@127.0.0.1:1"), Duration::ZERO)
        .await
        .unwrap_err();
    check(&e, ErrorKind::Config, "redis://u:***@127.0.0.1:1");
}

/// Core's URL openers: alone, a Redis URL is a scheme they do not know; with this crate's
/// registry entry they open it through the entry. Every error names the URL, redacted.
#[tokio::test]
async fn core_openers_name_redis_urls_without_the_password() {
    let url = format!("redis://u:{SECRET}@127.0.0.1:1");
    let e = onceflow_core::dedup::open(&url, Duration::from_secs(60))
        .await
        .err()
        .unwrap();
    check(&e, ErrorKind::Config, "redis://u:***@127.0.0.1:1");
    let e = onceflow_core::checkpoint::open(&url).await.err().unwrap();
    check(&e, ErrorKind::Config, "redis://u:***@127.0.0.1:1");
    // Through the entry: nothing listens on port 1.
    let stores = [&onceflow_redis::STORE];
    let e = onceflow_core::dedup::open_with(&url, Duration::from_secs(60), &stores)
        .await
        .err()
        .unwrap();
    check(&e, ErrorKind::DedupStore, "redis://u:***@127.0.0.1:1");
    let e = onceflow_core::checkpoint::open_with(&url, &stores)
        .await
        .err()
        .unwrap();
    check(&e, ErrorKind::DedupStore, "redis://u:***@127.0.0.1:1");
    let e = onceflow_core::dedup::open(&url, Duration::ZERO)
        .await
        .err()
        .unwrap();
    check(&e, ErrorKind::Config, "redis://u:***@127.0.0.1:1");
}

/// `rediss://` to a plaintext port: the TLS handshake gets no answer it can read; the error
/// says that the port may be plaintext Redis and names `redis://`.
#[tokio::test]
async fn tls_to_a_plaintext_port_says_so() {
    let Some(base) = common::base("bad_input") else {
        return;
    };
    let mut u = url::Url::parse(&base).unwrap();
    u.set_scheme("rediss").unwrap();
    let tls = u.to_string();
    let e = RedisStore::open(&tls, Duration::from_secs(60))
        .await
        .expect_err(&tls);
    assert!(
        e.message().contains("plaintext Redis, use redis://"),
        "no hint in: {e}"
    );
}
