//! The stores and the inbox over TLS with password authentication (issue 23), on the server
//! `tests/brokers/up.sh postgres-secure` starts (ssl=on, `hostssl` lines only: scram-sha-256
//! for user onceflow, `cert` for the client certificate's CN); skipped without
//! `ONCEFLOW_POSTGRES_SECURE_URL` unless `ONCEFLOW_REQUIRE_BROKERS=1`.
//!
//! The dedup store's claim / complete / duplicate / get, the checkpoint store's lease cycle
//! and the transactional inbox over `sslmode=verify-full`; the password from the URL, from
//! `PGPASSWORD` and from a password file; a client certificate instead of a password. The
//! refusals are [`ErrorKind::Auth`] errors within seconds (the time is printed) that name the
//! server: a wrong password, an untrusted CA, a certificate that does not name the host
//! (verify-full; verify-ca lets it through), a connection without TLS, no password at all, a
//! password file others may read. Every error's text and `Debug`, and the stores' `Debug`,
//! are searched for the password.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use onceflow_conformance::logs::{capture as capture_logs, captured as logs};
use onceflow_core::{
    BoxError, Client, ConsumerConfig, Error, ErrorKind, Message, ProducerConfig, Record, StartFrom,
    TopicSpec,
};
use onceflow_postgres::tokio_postgres::Transaction;
use onceflow_postgres::{InboxConfig, InboxHandler, PostgresCheckpointStore, PostgresStore};

/// Upper bound for a refusal (the connect timeout is 5 s).
const FAST: Duration = Duration::from_secs(15);

/// What `tests/brokers/postgres-secure/up.sh` printed.
struct Secure {
    url: String,
    host: String,
    port: u16,
    db: String,
    user: String,
    password: String,
    ca: String,
    other_ca: String,
    client_user: String,
    client_cert: String,
    client_key: String,
}

fn var(name: &str) -> String {
    std::env::var(name)
        .unwrap_or_else(|_| panic!("{name} is not set (tests/brokers/up.sh postgres-secure)"))
}

/// The secured server, or `None` (the test skips) without one.
fn secure(what: &str) -> Option<Secure> {
    capture_logs();
    let url = std::env::var("ONCEFLOW_POSTGRES_SECURE_URL")
        .ok()
        .filter(|u| !u.is_empty());
    let Some(url) = url else {
        assert!(
            std::env::var("ONCEFLOW_REQUIRE_BROKERS").as_deref() != Ok("1"),
            "ONCEFLOW_REQUIRE_BROKERS=1 but ONCEFLOW_POSTGRES_SECURE_URL is not set \
             (tests/brokers/up.sh postgres-secure)"
        );
        eprintln!("{what}: SKIPPED: ONCEFLOW_POSTGRES_SECURE_URL is not set");
        return None;
    };
    Some(Secure {
        url,
        host: var("ONCEFLOW_POSTGRES_SECURE_HOST"),
        port: var("ONCEFLOW_POSTGRES_SECURE_PORT").parse().unwrap(),
        db: var("ONCEFLOW_POSTGRES_SECURE_DB"),
        user: var("ONCEFLOW_POSTGRES_SECURE_USER"),
        password: var("ONCEFLOW_POSTGRES_SECURE_PASSWORD"),
        ca: var("ONCEFLOW_POSTGRES_SECURE_CA"),
        other_ca: var("ONCEFLOW_POSTGRES_SECURE_OTHER_CA"),
        client_user: var("ONCEFLOW_POSTGRES_SECURE_CLIENT_USER"),
        client_cert: var("ONCEFLOW_POSTGRES_SECURE_CLIENT_CERT"),
        client_key: var("ONCEFLOW_POSTGRES_SECURE_CLIENT_KEY"),
    })
}

fn unique(what: &str) -> String {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{what}_{n:x}")
}

impl Secure {
    /// `postgres://USER[:PASSWORD]@HOST:PORT/DB?QUERY` (no password when `password` is empty).
    fn url_for(&self, host: &str, user: &str, password: &str, query: &str) -> String {
        let auth = if password.is_empty() {
            user.to_string()
        } else {
            format!("{user}:{password}")
        };
        format!("postgres://{auth}@{host}:{}/{}?{query}", self.port, self.db)
    }

    fn url_with(&self, password: &str, query: &str) -> String {
        self.url_for(&self.host, &self.user, password, query)
    }

    fn verify_full(&self) -> String {
        format!("sslmode=verify-full&sslrootcert={}", self.ca)
    }

    fn assert_no_secret(&self, text: &str) {
        assert!(
            !text.contains(&self.password),
            "the password is shown: {text}"
        );
    }

    /// No secret in the log lines captured so far.
    fn assert_no_secret_logged(&self) {
        let logs = logs();
        assert!(
            !logs.contains(&self.password) && !logs.contains("not-the-password"),
            "a password is in the logs"
        );
    }
}

async fn drop_schema(store: &PostgresStore) {
    store
        .pool()
        .get()
        .await
        .unwrap()
        .batch_execute(&format!("DROP SCHEMA {} CASCADE", store.schema()))
        .await
        .unwrap();
}

/// The session is encrypted (`pg_stat_ssl`).
async fn assert_tls(store: &PostgresStore) {
    let row = store
        .pool()
        .get()
        .await
        .unwrap()
        .query_one(
            "SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap();
    let (ssl, version): (bool, Option<String>) = (row.get(0), row.get(1));
    assert!(ssl, "the session is not encrypted");
    eprintln!("session over {}", version.unwrap_or_default());
}

#[tokio::test]
async fn dedup_and_checkpoint_stores_over_verify_full() {
    let Some(s) = secure("secured") else { return };
    let schema = unique("sec");
    let url = format!("{}&schema={schema}&pool_size=2", s.url);
    let t = Instant::now();
    let store = PostgresStore::open(&url, Duration::from_secs(600))
        .await
        .unwrap();
    eprintln!(
        "verify-full dedup store opened in {} ms",
        t.elapsed().as_millis()
    );
    s.assert_no_secret(&format!("{store:?}"));
    assert_tls(&store).await;
    onceflow_conformance::dedup_suite::round_trip(&store).await;
    let cp = PostgresCheckpointStore::open(&url).await.unwrap();
    s.assert_no_secret(&format!("{cp:?}"));
    onceflow_conformance::checkpoint_suite::lease_round_trip(&cp).await;
    // `localhost` is in the certificate too.
    let local = format!(
        "{}&schema={schema}",
        s.url_for("localhost", &s.user, &s.password, &s.verify_full())
    );
    onceflow_conformance::dedup_suite::round_trip(
        &PostgresStore::open(&local, Duration::from_secs(600))
            .await
            .unwrap(),
    )
    .await;
    // require without a root certificate: encrypted, the certificate not checked (libpq).
    let require = format!(
        "{}&schema={schema}",
        s.url_with(&s.password, "sslmode=require")
    );
    let st = PostgresStore::open(&require, Duration::from_secs(600))
        .await
        .unwrap();
    assert_tls(&st).await;
    // No sslmode: prefer, and this server only lets TLS in.
    let prefer = format!("{}&schema={schema}", s.url_with(&s.password, ""));
    let st = PostgresStore::open(&prefer, Duration::from_secs(600))
        .await
        .unwrap();
    assert_tls(&st).await;
    drop_schema(&store).await;
    s.assert_no_secret_logged();
}

struct Rows {
    table: String,
    calls: AtomicUsize,
}

#[async_trait]
impl InboxHandler for Rows {
    async fn handle(&self, tx: &mut Transaction<'_>, m: &Message) -> Result<(), BoxError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        tx.execute(
            &format!("INSERT INTO {} (payload) VALUES ($1)", self.table),
            &[&String::from_utf8_lossy(&m.payload).into_owned()],
        )
        .await?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_over_verify_full() {
    let Some(s) = secure("secured") else { return };
    let schema = unique("inbox_sec");
    let store = PostgresStore::open(
        &format!("{}&schema={schema}&pool_size=2", s.url),
        Duration::from_secs(600),
    )
    .await
    .unwrap();
    let table = format!("\"{schema}\".rows");
    store
        .pool()
        .get()
        .await
        .unwrap()
        .batch_execute(&format!("CREATE TABLE {table} (payload text NOT NULL)"))
        .await
        .unwrap();
    let client = Client::new(onceflow_memory::connect(&format!("memory://{schema}")).unwrap());
    client
        .admin()
        .await
        .unwrap()
        .create_topic(&TopicSpec::new("orders", 1))
        .await
        .unwrap();
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    // 5 keys, 2 of them twice.
    let records: Vec<Record> = [0, 1, 2, 3, 4, 0, 1]
        .iter()
        .map(|i| Record::new("orders", format!("p{i}")).idempotency_key(format!("k{i}")))
        .collect();
    for r in producer.send_batch(records).await {
        r.unwrap();
    }
    let consumer = client
        .consumer(ConsumerConfig::new("g", ["orders"]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let config = InboxConfig {
        namespace: Some("sec".into()),
        ..InboxConfig::default()
    };
    let mut inbox = store.inbox(consumer, config);
    s.assert_no_secret(&format!("{inbox:?}"));
    let handler = Rows {
        table: table.clone(),
        calls: AtomicUsize::new(0),
    };
    for _ in 0..50 {
        inbox.step(&handler).await.unwrap();
        let sum = inbox.summary();
        if sum.handled + sum.duplicates == 7 {
            break;
        }
    }
    assert_eq!(inbox.summary().handled, 5, "{:?}", inbox.summary());
    assert_eq!(inbox.summary().duplicates, 2, "{:?}", inbox.summary());
    let n: i64 = store
        .pool()
        .get()
        .await
        .unwrap()
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 5);
    assert_eq!(inbox.stored_positions().await.unwrap().len(), 1);
    drop_schema(&store).await;
    s.assert_no_secret_logged();
}

/// Opens both stores at `url`, expecting [`ErrorKind::Auth`] errors within [`FAST`] that name
/// the server and show no secret; returns the dedup store's error.
async fn refused(s: &Secure, case: &str, url: &str) -> Error {
    let t = Instant::now();
    let d = PostgresStore::open(url, Duration::from_secs(60))
        .await
        .expect_err(case);
    let ms = t.elapsed().as_millis();
    eprintln!("AUTH postgres {case}: dedup store refused in {ms} ms: {d}");
    let t = Instant::now();
    let c = PostgresCheckpointStore::open(url).await.expect_err(case);
    let cms = t.elapsed().as_millis();
    eprintln!("AUTH postgres {case}: checkpoint store refused in {cms} ms: {c}");
    for (e, took) in [(&d, ms), (&c, cms)] {
        assert_eq!(e.kind(), ErrorKind::Auth, "{case}: {e}");
        assert!(!e.is_retriable(), "{case}: {e}");
        assert!(took < FAST.as_millis(), "{case}: {took} ms");
        assert!(
            e.message().contains(&format!(":{}", s.port)),
            "{case}: server not named: {e}"
        );
        s.assert_no_secret(&format!("{e} {e:?}"));
    }
    d
}

#[tokio::test]
async fn wrong_password_untrusted_ca_and_host_mismatch_are_auth_errors() {
    let Some(s) = secure("secured") else { return };
    let e = refused(
        &s,
        "wrong password",
        &s.url_with("not-the-password", &s.verify_full()),
    )
    .await;
    assert!(e.message().contains("28P01"), "{e}");
    assert!(e.message().contains("password from the URL"), "{e}");
    assert!(!e.message().contains("not-the-password"), "{e}");

    let other = format!("sslmode=verify-full&sslrootcert={}", s.other_ca);
    let e = refused(&s, "untrusted CA", &s.url_with(&s.password, &other)).await;
    assert!(e.message().contains("not signed by a CA we trust"), "{e}");
    // require with a root certificate checks the chain too (libpq).
    let other = format!("sslmode=require&sslrootcert={}", s.other_ca);
    refused(
        &s,
        "untrusted CA, sslmode=require",
        &s.url_with(&s.password, &other),
    )
    .await;

    // Connect to the server's address under a name its certificate does not have.
    let name = "not-in-the-certificate.invalid";
    let mismatch = |mode: &str| {
        format!(
            "{}&hostaddr={}",
            s.url_for(
                name,
                &s.user,
                &s.password,
                &format!("sslmode={mode}&sslrootcert={}", s.ca)
            ),
            s.host
        )
    };
    let e = refused(&s, "host name mismatch", &mismatch("verify-full")).await;
    assert!(e.message().contains("does not name the host"), "{e}");
    // verify-ca checks the chain only.
    let st = PostgresStore::open(
        &format!("{}&schema={}", mismatch("verify-ca"), unique("ca_only")),
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    assert_tls(&st).await;
    drop_schema(&st).await;
    s.assert_no_secret_logged();
}

#[tokio::test]
async fn plain_connections_are_refused_by_a_hostssl_only_server() {
    let Some(s) = secure("secured") else { return };
    let e = refused(
        &s,
        "sslmode=disable",
        &s.url_with(&s.password, "sslmode=disable"),
    )
    .await;
    assert!(e.message().contains("28000"), "{e}");
    assert!(e.message().contains("no encryption"), "{e}");
    // sslmode=require on a server without TLS (the plain test server, when it runs).
    if let Some(plain) = std::env::var("ONCEFLOW_POSTGRES_URL")
        .ok()
        .filter(|u| !u.is_empty())
    {
        let url = format!("{plain}?sslmode=require");
        let t = Instant::now();
        let e = PostgresStore::open(&url, Duration::from_secs(60))
            .await
            .unwrap_err();
        eprintln!(
            "AUTH postgres require on a server without TLS: refused in {} ms: {e}",
            t.elapsed().as_millis()
        );
        assert_eq!(e.kind(), ErrorKind::Auth, "{e}");
        assert!(e.message().contains("does not accept TLS"), "{e}");
    }
    s.assert_no_secret_logged();
}

#[tokio::test]
async fn client_certificate_instead_of_a_password() {
    let Some(s) = secure("secured") else { return };
    let schema = unique("cert");
    let q = format!(
        "{}&sslcert={}&sslkey={}&schema={schema}",
        s.verify_full(),
        s.client_cert,
        s.client_key
    );
    let url = s.url_for(&s.host, &s.client_user, "", &q);
    let store = PostgresStore::open(&url, Duration::from_secs(600))
        .await
        .unwrap();
    onceflow_conformance::dedup_suite::round_trip(&store).await;
    onceflow_conformance::checkpoint_suite::lease_round_trip(
        &PostgresCheckpointStore::open(&url).await.unwrap(),
    )
    .await;
    drop_schema(&store).await;
    // The same user without the certificate: `cert` authentication refuses it.
    let e = refused(
        &s,
        "no client certificate",
        &s.url_for(&s.host, &s.client_user, "", &s.verify_full()),
    )
    .await;
    assert!(e.message().contains("28000"), "{e}");
    // sslcert without sslkey.
    let e = PostgresStore::open(
        &s.url_with(
            &s.password,
            &format!("{}&sslcert={}", s.verify_full(), s.client_cert),
        ),
        Duration::from_secs(60),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    s.assert_no_secret(&format!("{e} {e:?}"));
    // verify-full needs a root certificate (unless ~/.postgresql/root.crt exists).
    let home_root = std::env::var_os("HOME")
        .map(|h| {
            std::path::Path::new(&h)
                .join(".postgresql/root.crt")
                .exists()
        })
        .unwrap_or(false);
    if !home_root {
        let e = PostgresStore::open(
            &s.url_with(&s.password, "sslmode=verify-full"),
            Duration::from_secs(60),
        )
        .await
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        assert!(e.message().contains("sslrootcert"), "{e}");
        s.assert_no_secret(&format!("{e} {e:?}"));
    }
    s.assert_no_secret_logged();
}

/// Sets or removes environment variables for the rest of the test (one test changes them).
fn set_env(name: &str, value: Option<&str>) {
    // Only `password_from_pgpassword_and_password_files` changes the environment, and the
    // stores read it only while opening; the other tests give the password in the URL (used
    // before either variable) or authenticate with a client certificate.
    match value {
        Some(v) => std::env::set_var(name, v),
        None => std::env::remove_var(name),
    }
}

#[tokio::test]
async fn password_from_pgpassword_and_password_files() {
    let Some(s) = secure("secured") else { return };
    let schema = unique("pw");
    let no_pw = format!("{}&schema={schema}", s.url_with("", &s.verify_full()));
    let dir = std::env::temp_dir().join(unique("pgpass"));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("none");
    let mut texts = Vec::new();

    // PGPASSWORD.
    set_env("PGPASSFILE", Some(missing.to_str().unwrap()));
    set_env("PGPASSWORD", Some(&s.password));
    let store = PostgresStore::open(&no_pw, Duration::from_secs(600))
        .await
        .unwrap();
    onceflow_conformance::dedup_suite::round_trip(&store).await;
    texts.push(format!("{store:?}"));
    set_env("PGPASSWORD", Some("not-the-password"));
    let e = refused(&s, "wrong PGPASSWORD", &no_pw).await;
    assert!(e.message().contains("password from PGPASSWORD"), "{e}");
    texts.push(format!("{e} {e:?}"));

    // No password anywhere.
    set_env("PGPASSWORD", None);
    let e = refused(&s, "no password", &no_pw).await;
    assert!(e.message().contains("none was given"), "{e}");
    assert!(e.message().contains("no password file"), "{e}");
    texts.push(format!("{e} {e:?}"));

    // PGPASSFILE: comment, a line for another port, then a wildcard line with escapes in
    // another user's password.
    let file = dir.join("pgpass");
    let content = format!(
        "# test\n{host}:1:*:*:wrong\nlocalhost:{port}:*:other\\:user:x\\:y\n*:{port}:{db}:{user}:{pw}\n",
        host = s.host,
        port = s.port,
        db = s.db,
        user = s.user,
        pw = s.password
    );
    std::fs::write(&file, content).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    set_env("PGPASSFILE", Some(file.to_str().unwrap()));
    let store = PostgresStore::open(&no_pw, Duration::from_secs(600))
        .await
        .unwrap();
    onceflow_conformance::dedup_suite::round_trip(&store).await;
    let cp = PostgresCheckpointStore::open(&no_pw).await.unwrap();
    onceflow_conformance::checkpoint_suite::lease_round_trip(&cp).await;
    texts.push(format!("{store:?} {cp:?}"));
    // The URL's passfile= wins over PGPASSFILE.
    set_env("PGPASSFILE", Some(missing.to_str().unwrap()));
    let via_option = format!("{no_pw}&passfile={}", file.display());
    PostgresStore::open(&via_option, Duration::from_secs(600))
        .await
        .unwrap();
    // A password file its group or others may read is ignored, as libpq does.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = refused(&s, "password file readable by others", &via_option).await;
        assert!(e.message().contains("group or world access"), "{e}");
        texts.push(format!("{e} {e:?}"));
        // The warning libpq would print is logged (and the logs are captured).
        assert!(
            logs().contains("group or world access"),
            "no warning logged"
        );
    }
    // A file without a matching line.
    std::fs::write(&file, "otherhost:1:db:u:pw\n").unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let e = refused(&s, "no matching password-file line", &via_option).await;
    assert!(e.message().contains("no line for"), "{e}");
    texts.push(format!("{e} {e:?}"));
    set_env("PGPASSFILE", None);
    for t in &texts {
        s.assert_no_secret(t);
        assert!(!t.contains("not-the-password"), "{t}");
    }
    drop_schema(&store).await;
    std::fs::remove_dir_all(&dir).unwrap();
    s.assert_no_secret_logged();
}
