//! Migration 2 → 3 on a schema that already holds keys (issue 7: "schema created on first use,
//! with a documented migration"). Version 3 adds `done_until` and `fillfactor = 50` so that a
//! completion updates its row in place; keys written by a version-2 build must keep their
//! meaning: a completed key inside its window stays a duplicate, one past it is claimable
//! again, a held key stays held. Needs `ONCEFLOW_POSTGRES_URL` (`tests/brokers/up.sh
//! postgres`); skips without it unless `ONCEFLOW_REQUIRE_BROKERS=1`.

use std::time::Duration;

use onceflow_core::dedup::{ClaimOutcome, ClaimRequest, Completion, DedupStore};
use onceflow_postgres::{tokio_postgres, PostgresStore, SCHEMA_VERSION};

mod common;
use common::base;

fn request(key: &str) -> ClaimRequest {
    ClaimRequest {
        key: key.to_string(),
        owner: "worker-new".to_string(),
        lease: Duration::from_secs(30),
        fingerprint: None,
    }
}

#[tokio::test]
async fn a_version_2_schema_with_keys_migrates_to_3_and_keeps_their_meaning() {
    let Some(base) = base("migration") else {
        return;
    };
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let schema = format!("migration_{n:x}");
    let (client, connection) = tokio_postgres::connect(&base, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    // The tables as a version-2 build left them (migrations 1 and 2, dedup part), with keys.
    client
        .batch_execute(&format!(
            "CREATE SCHEMA {schema};
             CREATE TABLE {schema}.onceflow_schema_version (
                 component text PRIMARY KEY, version integer NOT NULL);
             INSERT INTO {schema}.onceflow_schema_version VALUES ('onceflow', 2);
             CREATE TABLE {schema}.dedup (
                 key text PRIMARY KEY, token bigint NOT NULL, state smallint NOT NULL,
                 owner text, lease_until bigint, expires_at bigint NOT NULL,
                 fingerprint bytea, result bytea);
             CREATE INDEX dedup_expires_at ON {schema}.dedup (expires_at);
             CREATE TABLE {schema}.inbox_position (
                 consumer_group text NOT NULL, topic text NOT NULL, partition integer NOT NULL,
                 position text NOT NULL, updated_at timestamptz NOT NULL DEFAULT now(),
                 PRIMARY KEY (consumer_group, topic, partition));
             CREATE TABLE {schema}.lease (
                 grp text NOT NULL, key text NOT NULL, owner text, counter bigint NOT NULL,
                 lease_until bigint NOT NULL, checkpoint text, parents text[] NOT NULL,
                 PRIMARY KEY (grp, key));
             INSERT INTO {schema}.dedup VALUES
               ('done-live', 4, 2, NULL, NULL,
                (extract(epoch from clock_timestamp()) * 1000)::bigint + 600000, NULL, 'r1'),
               ('done-old', 4, 2, NULL, NULL,
                (extract(epoch from clock_timestamp()) * 1000)::bigint - 1000, NULL, NULL),
               ('held', 1, 1, 'worker-old',
                (extract(epoch from clock_timestamp()) * 1000)::bigint + 600000,
                (extract(epoch from clock_timestamp()) * 1000)::bigint + 1200000, NULL, NULL);"
        ))
        .await
        .unwrap();

    let location = format!("{base}?schema={schema}&pool_size=2");
    let store = PostgresStore::open(&location, Duration::from_secs(60))
        .await
        .unwrap();
    let version: i32 = client
        .query_one(
            &format!("SELECT version FROM {schema}.onceflow_schema_version"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(version, SCHEMA_VERSION);
    assert_eq!(SCHEMA_VERSION, 3);
    let options: Vec<String> = client
        .query_one(
            &format!(
                "SELECT COALESCE(reloptions, '{{}}') FROM pg_class \
                 WHERE oid = '{schema}.dedup'::regclass"
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        options.contains(&"fillfactor=50".to_string()),
        "{options:?}"
    );

    let outcomes = store
        .claim(&[
            request("done-live"),
            request("done-old"),
            request("held"),
            request("new"),
        ])
        .await
        .unwrap();
    assert!(
        matches!(&outcomes[0], ClaimOutcome::Duplicate { result: Some(r) } if r.as_ref() == b"r1"),
        "{:?}",
        outcomes[0]
    );
    assert!(
        matches!(outcomes[1], ClaimOutcome::Claimed { token: 5 }),
        "{:?}",
        outcomes[1]
    );
    assert!(
        matches!(&outcomes[2], ClaimOutcome::InProgress { owner, .. } if owner == "worker-old"),
        "{:?}",
        outcomes[2]
    );
    let ClaimOutcome::Claimed { token } = outcomes[3] else {
        panic!("{:?}", outcomes[3]);
    };

    // A completion within the lease keeps `expires_at` (the purge bound, set by the claim to
    // claim time + lease + window) and records the window's end in `done_until`.
    let row = |key: &'static str| {
        let client = &client;
        let schema = &schema;
        async move {
            let r = client
                .query_one(
                    &format!(
                        "SELECT expires_at, done_until, state FROM {schema}.dedup WHERE key = $1"
                    ),
                    &[&key],
                )
                .await
                .unwrap();
            (
                r.get::<_, i64>(0),
                r.get::<_, Option<i64>>(1),
                r.get::<_, i16>(2),
            )
        }
    };
    let (claimed_until, none, _) = row("new").await;
    assert_eq!(none, None);
    let done = store
        .complete(&[Completion {
            key: "new".into(),
            token,
            result: None,
        }])
        .await
        .unwrap();
    assert_eq!(done, vec![true]);
    let (expires_at, done_until, state) = row("new").await;
    assert_eq!(state, 2);
    assert_eq!(
        expires_at, claimed_until,
        "the completion moved the purge bound"
    );
    let done_until = done_until.expect("done_until set by the completion");
    assert!(
        done_until <= expires_at && done_until + 30_000 >= expires_at - 1_000,
        "done_until {done_until} vs expires_at {expires_at}"
    );
    assert!(matches!(
        store.claim(&[request("new")]).await.unwrap()[0],
        ClaimOutcome::Duplicate { .. }
    ));

    drop(store);
    client
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
        .unwrap();
}
