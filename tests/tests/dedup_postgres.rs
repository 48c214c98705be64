//! The dedup-store conformance suite on PostgreSQL (`ONCEFLOW_POSTGRES_URL`, started by
//! `tests/brokers/up.sh postgres`), each case in its own PostgreSQL schema; plus two processes
//! racing over one store and clear errors for unusable URLs and newer schemas.

mod redis_postgres;

use std::sync::Arc;
use std::time::Duration;

use onceflow_core::ErrorKind;
use redis_postgres::{rand_hex, service_url, Opener, UrlHarness};

const VAR: &str = "ONCEFLOW_POSTGRES_URL";

fn opener() -> Opener {
    |url, window| {
        Box::pin(async move {
            let store = onceflow_postgres::PostgresStore::open(&url, window).await?;
            Ok(Arc::new(store) as onceflow_core::dedup::SharedDedupStore)
        })
    }
}

fn fresh(base: &str) -> String {
    format!("{base}?schema=suite_{}&pool_size=4", rand_hex())
}

fn without_password(base: &str) -> url::Url {
    let mut u = url::Url::parse(base).unwrap();
    u.set_password(None).unwrap();
    u
}

/// The harness, or `None` (test skipped) without a PostgreSQL URL.
fn harness() -> Option<UrlHarness> {
    let base = service_url(VAR, "postgres")?;
    Some(UrlHarness {
        // (A location without its password is an Auth error, and one with it is not named
        // verbatim: both in wrong_password_and_unreachable_name_the_url_without_password.)
        unusable: vec![
            // Nothing listens there.
            "postgres://onceflow@127.0.0.1:1/onceflow".to_string(),
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
        Err(_) => match service_url(VAR, "postgres") {
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
    let Some(base) = service_url(VAR, "postgres") else {
        return;
    };
    let mut u = url::Url::parse(&base).unwrap();
    u.set_password(Some("not-the-password")).unwrap();
    let wrong = u.to_string();
    let shown = wrong.replace("not-the-password", "***");
    let e = onceflow_postgres::PostgresStore::open(&wrong, Duration::from_secs(60))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Auth, "{e}");
    assert!(e.message().contains(&shown), "{e}");
    assert!(
        e.message().contains("password authentication failed"),
        "{e}"
    );
    assert!(!format!("{e:?}").contains("not-the-password"), "{e:?}");
    // No password (none in PGPASSWORD or a password file either): refused the same way.
    let e = onceflow_postgres::PostgresStore::open(
        without_password(&base).as_str(),
        Duration::from_secs(60),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Auth, "{e}");
    // A database the server does not have.
    let mut no_db = url::Url::parse(&base).unwrap();
    no_db.set_path("/no_such_database");
    let e = onceflow_postgres::PostgresStore::open(no_db.as_str(), Duration::from_secs(60))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::DedupStore, "{e}");
    assert!(
        e.message()
            .contains(&onceflow_postgres::redact_url(no_db.as_str())),
        "{e}"
    );
    let e = onceflow_postgres::PostgresStore::open(
        "postgres://user:hunter2@127.0.0.1:1/db",
        Duration::from_secs(60),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::DedupStore, "{e}");
    assert!(
        e.message().contains("postgres://user:***@127.0.0.1:1/db"),
        "{e}"
    );
    assert!(!format!("{e:?}").contains("hunter2"), "{e:?}");
}

#[tokio::test]
async fn schema_from_a_newer_version_is_refused() {
    let Some(base) = service_url(VAR, "postgres") else {
        return;
    };
    let location = fresh(&base);
    let store = onceflow_postgres::PostgresStore::open(&location, Duration::from_secs(60))
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
    drop(client);
    let e = onceflow_postgres::PostgresStore::open(&location, Duration::from_secs(60))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::DedupStore, "{e}");
    assert!(e.message().contains("version 99"), "{e}");
    let shown = onceflow_postgres::redact_url(&location);
    assert!(e.message().contains(&shown), "{e}");
    assert!(!e.message().contains(":onceflow@"), "password shown: {e}");
}

#[tokio::test]
async fn facade_opens_postgres_urls() {
    let Some(base) = service_url(VAR, "postgres") else {
        return;
    };
    let store = onceflow::dedup_store(&fresh(&base), Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(store.name(), "postgres");
    let alt = fresh(&base).replacen("postgres://", "postgresql://", 1);
    let store = onceflow::dedup_store(&alt, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(store.name(), "postgres");
}

/// The one-statement claim and the completion on a table that already holds many keys (their
/// reads are primary-key lookups, whatever the planner would choose): a batch mixing new keys,
/// keys done, a key asked twice and a repeated completion by the same claim.
#[tokio::test(flavor = "multi_thread")]
async fn batches_on_a_filled_table_and_repeated_completions() {
    use onceflow_core::dedup::{ClaimOutcome, ClaimRequest, Completion, DedupStore};
    let Some(base) = service_url(VAR, "postgres") else {
        return;
    };
    let store = onceflow_postgres::PostgresStore::open(&fresh(&base), Duration::from_secs(600))
        .await
        .unwrap();
    let req = |key: &str| ClaimRequest {
        key: key.to_string(),
        owner: "w".into(),
        lease: Duration::from_secs(60),
        fingerprint: None,
    };
    let claim_all = |keys: Vec<String>| {
        let store = &store;
        async move {
            let reqs: Vec<ClaimRequest> = keys.iter().map(|k| req(k)).collect();
            let out = store.claim(&reqs).await.unwrap();
            let done: Vec<Completion> = out
                .iter()
                .zip(&keys)
                .map(|(o, k)| match o {
                    ClaimOutcome::Claimed { token } => Completion {
                        key: k.clone(),
                        token: *token,
                        result: Some(bytes::Bytes::from(k.clone())),
                    },
                    other => panic!("{k}: {other:?}"),
                })
                .collect();
            assert!(store.complete(&done).await.unwrap().iter().all(|b| *b));
            // The same completions again: done by the same claims.
            assert!(store.complete(&done).await.unwrap().iter().all(|b| *b));
            done
        }
    };
    let mut all = Vec::new();
    for round in 0..10 {
        let keys: Vec<String> = (0..1000).map(|i| format!("fill-{round}-{i}")).collect();
        all.extend(claim_all(keys).await);
    }
    let mut reqs: Vec<ClaimRequest> = (0..500).map(|i| req(&format!("new-{i}"))).collect();
    reqs.extend(all.iter().step_by(20).map(|c| req(&c.key)));
    reqs.push(req("new-7"));
    let out = store.claim(&reqs).await.unwrap();
    for (o, r) in out.iter().zip(&reqs) {
        if r.key.starts_with("new-") {
            assert!(
                matches!(o, ClaimOutcome::Claimed { .. }),
                "{}: {o:?}",
                r.key
            );
        } else {
            assert_eq!(
                *o,
                ClaimOutcome::Duplicate {
                    result: Some(bytes::Bytes::from(r.key.clone()))
                },
                "{}",
                r.key
            );
        }
    }
    // "new-7" asked twice in one batch by its holder: the second claim gets a higher token.
    let (ClaimOutcome::Claimed { token: t1 }, ClaimOutcome::Claimed { token: t2 }) =
        (&out[7], out.last().unwrap())
    else {
        panic!("{:?} {:?}", out[7], out.last())
    };
    assert!(t2 > t1, "{t2} > {t1}");
    // A completion with the first (superseded) token is refused, the second's accepted.
    let done = store
        .complete(&[
            Completion {
                key: "new-7".into(),
                token: *t1,
                result: None,
            },
            Completion {
                key: "new-7".into(),
                token: *t2,
                result: None,
            },
        ])
        .await
        .unwrap();
    assert_eq!(done, vec![false, true]);
}
