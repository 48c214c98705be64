//! The stored format on a real server (`ONCEFLOW_REDIS_URL`, `tests/brokers/up.sh redis`;
//! skipped without it): the values a claim and a completion leave, and a clear `DedupStore`
//! error for keys of the older hash format.

use std::time::Duration;

use bytes::Bytes;
use onceflow_core::dedup::{ClaimOutcome, ClaimRequest, DedupStoreExt};
use onceflow_core::ErrorKind;

mod common;

fn prefix() -> String {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("format-test-{n:x}:")
}

async fn raw(base: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(base)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

#[tokio::test]
async fn values_are_format_1_strings_with_expiry() {
    let Some(base) = common::base("stored_format") else {
        return;
    };
    let p = prefix();
    let store =
        onceflow_redis::RedisStore::open(&format!("{base}?prefix={p}"), Duration::from_secs(600))
            .await
            .unwrap();
    let mut conn = raw(&base).await;
    let claim = ClaimRequest {
        key: "k".into(),
        owner: "w".into(),
        lease: Duration::from_secs(60),
        fingerprint: Some(0x0102),
    };
    assert_eq!(
        store.claim_one(claim).await.unwrap(),
        ClaimOutcome::Claimed { token: 1 }
    );
    let key = format!("{p}k");
    let fp = format!("{:032x}", 0x0102u128);
    let v: String = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(v, format!("111|{fp}|600000|w"));
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(ttl > 650_000 && ttl <= 660_000, "{ttl}");
    assert!(store
        .complete_one("k", 1, Some(Bytes::from_static(b"r|=")))
        .await
        .unwrap());
    let v: String = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(v, format!("121|{fp}|=r|="));
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(ttl > 590_000 && ttl <= 600_000, "{ttl}");
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
}

#[tokio::test]
async fn old_hash_keys_are_a_clear_dedup_store_error() {
    let Some(base) = common::base("stored_format") else {
        return;
    };
    let p = prefix();
    let store =
        onceflow_redis::RedisStore::open(&format!("{base}?prefix={p}"), Duration::from_secs(600))
            .await
            .unwrap();
    let mut conn = raw(&base).await;
    // A key as onceflow-redis wrote it before format 1, and a string of another program.
    let (old, other) = (format!("{p}old"), format!("{p}other"));
    let _: () = redis::cmd("HSET")
        .arg(&old)
        .arg(&["s", "2", "t", "1", "e", "99999999999999"])
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg(&other)
        .arg("hello")
        .query_async(&mut conn)
        .await
        .unwrap();
    let claim = |key: &str| ClaimRequest {
        key: key.into(),
        owner: "w".into(),
        lease: Duration::from_secs(60),
        fingerprint: None,
    };
    for key in ["old", "other"] {
        let e = store.claim_one(claim(key)).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::DedupStore, "{e}");
        assert!(e.message().contains("format 1"), "{e}");
        assert!(e.message().contains(&p), "{e}");
        let e = store.complete_one(key, 1, None).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::DedupStore, "{e}");
        assert!(e.message().contains("format 1"), "{e}");
        let e = store.get_one(key).await.unwrap_err();
        assert!(e.message().contains("format 1"), "{e}");
    }
    // Format-1 look-alikes that are not: a window that is no number, tokens past 15 digits
    // (released and completed), a state that does not exist, a fingerprint that is no hex.
    let bad = [
        ("window", "111||notanumber|w"),
        ("released", "1099999999999999999999999||"),
        ("completed", "1299999999999999999999999999||"),
        ("state", "171||"),
        ("fingerprint", "121|zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz|"),
    ];
    for (key, value) in bad {
        let _: () = redis::cmd("SET")
            .arg(format!("{p}{key}"))
            .arg(value)
            .query_async(&mut conn)
            .await
            .unwrap();
        let e = store.claim_one(claim(key)).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::DedupStore, "{key}: {e}");
        assert!(e.message().contains("format 1"), "{key}: {e}");
        assert!(e.message().contains(&p), "{key}: {e}");
        let e = store.get_one(key).await.unwrap_err();
        assert!(e.message().contains("format 1"), "{key}: {e}");
        let _: () = redis::cmd("DEL")
            .arg(format!("{p}{key}"))
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let _: () = redis::cmd("DEL")
        .arg(&old)
        .arg(&other)
        .query_async(&mut conn)
        .await
        .unwrap();
}
