//! The stores over TLS with an ACL user (issue 23), on the server `tests/brokers/up.sh
//! redis-secure` starts (TLS only, default user off, client certificates checked when given);
//! skipped without `ONCEFLOW_REDIS_SECURE_URL` unless `ONCEFLOW_REQUIRE_BROKERS=1`.
//!
//! The dedup store's claim / complete / duplicate / get and the checkpoint store's create /
//! take / checkpoint / release over `rediss://` with the test CA, with and without a client
//! certificate; and the refusals, each an [`ErrorKind::Auth`] error within seconds (the time
//! is printed) that names the server: wrong password, no credentials, an untrusted CA, a host
//! the certificate does not name, a client certificate from another CA. Every error's text
//! and `Debug`, and the stores' `Debug`, are searched for the password.

use std::time::{Duration, Instant};

use onceflow_conformance::logs::{capture as capture_logs, captured as logs};
use onceflow_core::{Error, ErrorKind};
use onceflow_redis::{RedisCheckpointStore, RedisStore};

/// Upper bound for a refusal (the connect timeout is 5 s).
const FAST: Duration = Duration::from_secs(15);

/// What `tests/brokers/redis-secure/up.sh` printed.
struct Secure {
    host: String,
    port: u16,
    user: String,
    password: String,
    ca: String,
    other_ca: String,
    client_cert: String,
    client_key: String,
    rogue_cert: String,
    rogue_key: String,
    mismatch_host: String,
}

fn var(name: &str) -> String {
    std::env::var(name)
        .unwrap_or_else(|_| panic!("{name} is not set (tests/brokers/up.sh redis-secure)"))
}

/// The secured server, or `None` (the test skips) without one.
fn secure(what: &str) -> Option<Secure> {
    capture_logs();
    let set = std::env::var("ONCEFLOW_REDIS_SECURE_URL")
        .ok()
        .filter(|u| !u.is_empty());
    if set.is_none() {
        assert!(
            std::env::var("ONCEFLOW_REQUIRE_BROKERS").as_deref() != Ok("1"),
            "ONCEFLOW_REQUIRE_BROKERS=1 but ONCEFLOW_REDIS_SECURE_URL is not set \
             (tests/brokers/up.sh redis-secure)"
        );
        eprintln!("{what}: SKIPPED: ONCEFLOW_REDIS_SECURE_URL is not set");
        return None;
    }
    Some(Secure {
        host: var("ONCEFLOW_REDIS_SECURE_HOST"),
        port: var("ONCEFLOW_REDIS_SECURE_PORT").parse().unwrap(),
        user: var("ONCEFLOW_REDIS_SECURE_USER"),
        password: var("ONCEFLOW_REDIS_SECURE_PASSWORD"),
        ca: var("ONCEFLOW_REDIS_SECURE_CA"),
        other_ca: var("ONCEFLOW_REDIS_SECURE_OTHER_CA"),
        client_cert: var("ONCEFLOW_REDIS_SECURE_CLIENT_CERT"),
        client_key: var("ONCEFLOW_REDIS_SECURE_CLIENT_KEY"),
        rogue_cert: var("ONCEFLOW_REDIS_SECURE_ROGUE_CERT"),
        rogue_key: var("ONCEFLOW_REDIS_SECURE_ROGUE_KEY"),
        mismatch_host: var("ONCEFLOW_REDIS_SECURE_MISMATCH_HOST"),
    })
}

fn unique(what: &str) -> String {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{what}-{n:x}")
}

impl Secure {
    /// `rediss://USER:PASSWORD@HOST:PORT/?QUERY`.
    fn url(&self, password: &str, query: &str) -> String {
        self.url_at(&self.host, &self.user, password, query)
    }

    fn url_at(&self, host: &str, user: &str, password: &str, query: &str) -> String {
        let auth = if user.is_empty() && password.is_empty() {
            String::new()
        } else {
            format!("{user}:{password}@")
        };
        format!("rediss://{auth}{host}:{}/?{query}", self.port)
    }

    fn ca_query(&self) -> String {
        format!("ca={}", self.ca)
    }

    /// No secret of the test in `text`.
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

#[tokio::test]
async fn dedup_and_checkpoint_stores_over_tls_with_an_acl_user() {
    let Some(s) = secure("secured") else { return };
    let url = s.url(
        &s.password,
        &format!("{}&prefix={}:", s.ca_query(), unique("tls")),
    );
    let t = Instant::now();
    let store = RedisStore::open(&url, Duration::from_secs(600))
        .await
        .unwrap();
    eprintln!(
        "rediss:// dedup store opened in {} ms",
        t.elapsed().as_millis()
    );
    s.assert_no_secret(&format!("{store:?}"));
    s.assert_no_secret(store.url());
    assert!(store.url().contains("***"), "{}", store.url());
    onceflow_conformance::dedup_suite::round_trip(&store).await;
    let cp = RedisCheckpointStore::open(&s.url(&s.password, &s.ca_query()))
        .await
        .unwrap();
    s.assert_no_secret(&format!("{cp:?}"));
    onceflow_conformance::checkpoint_suite::lease_round_trip(&cp).await;
    // `localhost` is in the certificate too.
    let local = s.url_at("localhost", &s.user, &s.password, &s.ca_query());
    onceflow_conformance::dedup_suite::round_trip(
        &RedisStore::open(&local, Duration::from_secs(600))
            .await
            .unwrap(),
    )
    .await;
    s.assert_no_secret_logged();
}

#[tokio::test]
async fn client_certificate_is_presented_and_checked() {
    let Some(s) = secure("secured") else { return };
    let mtls = format!(
        "{}&cert={}&key={}",
        s.ca_query(),
        s.client_cert,
        s.client_key
    );
    let store = RedisStore::open(&s.url(&s.password, &mtls), Duration::from_secs(600))
        .await
        .unwrap();
    onceflow_conformance::dedup_suite::round_trip(&store).await;
    let cp = RedisCheckpointStore::open(&s.url(&s.password, &mtls))
        .await
        .unwrap();
    onceflow_conformance::checkpoint_suite::lease_round_trip(&cp).await;
    // A certificate from a CA the server does not trust is refused by the server.
    let rogue = format!("{}&cert={}&key={}", s.ca_query(), s.rogue_cert, s.rogue_key);
    let e = refused(&s, "rogue client certificate", &s.url(&s.password, &rogue)).await;
    assert!(e.message().contains("client certificate"), "{e}");
    // cert= without key= is a configuration error.
    let half = format!("{}&cert={}", s.ca_query(), s.client_cert);
    let e = RedisStore::open(&s.url(&s.password, &half), Duration::from_secs(60))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    s.assert_no_secret(&format!("{e} {e:?}"));
    s.assert_no_secret_logged();
}

/// Opens both stores at `url`, expecting [`ErrorKind::Auth`] errors within [`FAST`] that name
/// the server and show no secret; returns the dedup store's error.
async fn refused(s: &Secure, case: &str, url: &str) -> Error {
    let t = Instant::now();
    let d = RedisStore::open(url, Duration::from_secs(60))
        .await
        .expect_err(case);
    let ms = t.elapsed().as_millis();
    eprintln!("AUTH redis {case}: dedup store refused in {ms} ms: {d}");
    let t = Instant::now();
    let c = RedisCheckpointStore::open(url).await.expect_err(case);
    let cms = t.elapsed().as_millis();
    eprintln!("AUTH redis {case}: checkpoint store refused in {cms} ms: {c}");
    for (e, took) in [(&d, ms), (&c, cms)] {
        assert_eq!(e.kind(), ErrorKind::Auth, "{case}: {e}");
        assert!(!e.is_retriable(), "{case}: {e}");
        assert!(took < FAST.as_millis(), "{case}: {took} ms");
        let server = format!(":{}", s.port);
        assert!(
            e.message().contains(&server),
            "{case}: server not named: {e}"
        );
        s.assert_no_secret(&format!("{e} {e:?}"));
        if !s.password.is_empty() && url.contains(&s.password) {
            assert!(e.message().contains("***"), "{case}: {e}");
        }
    }
    d
}

#[tokio::test]
async fn wrong_password_and_missing_credentials_are_auth_errors() {
    let Some(s) = secure("secured") else { return };
    let e = refused(
        &s,
        "wrong password",
        &s.url("not-the-password", &s.ca_query()),
    )
    .await;
    assert!(
        e.message().contains("refused the user name or password"),
        "{e}"
    );
    assert!(!e.message().contains("not-the-password"), "{e}");
    // The default user is off: without credentials the first command is refused (NOAUTH).
    let e = refused(
        &s,
        "no credentials",
        &s.url_at(&s.host, "", "", &s.ca_query()),
    )
    .await;
    assert!(e.message().contains("NOAUTH"), "{e}");
    // A user that does not exist.
    let e = refused(
        &s,
        "unknown user",
        &s.url_at(&s.host, "nobody", &s.password, &s.ca_query()),
    )
    .await;
    assert!(e.message().contains("nobody"), "{e}");
    s.assert_no_secret_logged();
}

#[tokio::test]
async fn untrusted_ca_and_wrong_host_name_are_auth_errors() {
    let Some(s) = secure("secured") else { return };
    let e = refused(
        &s,
        "untrusted CA",
        &s.url(&s.password, &format!("ca={}", s.other_ca)),
    )
    .await;
    assert!(e.message().contains("not signed by a CA we trust"), "{e}");
    // Without ca= the system's roots, which do not hold the test CA.
    let e = refused(&s, "system roots", &s.url(&s.password, "")).await;
    assert!(e.message().contains("TLS"), "{e}");
    // The server listens on 127.0.0.2 too, a name its certificate does not have.
    let mismatch = s.url_at(&s.mismatch_host, &s.user, &s.password, &s.ca_query());
    let e = refused(&s, "host name mismatch", &mismatch).await;
    assert!(e.message().contains("does not name the host"), "{e}");
    // `#insecure` skips both checks (test servers only).
    let insecure = format!(
        "{}#insecure",
        s.url_at(
            &s.mismatch_host,
            &s.user,
            &s.password,
            &format!("ca={}", s.other_ca)
        )
    );
    onceflow_conformance::dedup_suite::round_trip(
        &RedisStore::open(&insecure, Duration::from_secs(600))
            .await
            .unwrap(),
    )
    .await;
    s.assert_no_secret_logged();
}

#[tokio::test]
async fn plain_connection_to_the_tls_port_fails_fast() {
    let Some(s) = secure("secured") else { return };
    let url = format!("redis://{}:{}@{}:{}", s.user, s.password, s.host, s.port);
    let t = Instant::now();
    let e = RedisStore::open(&url, Duration::from_secs(60))
        .await
        .unwrap_err();
    let ms = t.elapsed().as_millis();
    eprintln!("redis:// to the TLS port failed in {ms} ms: {e}");
    assert!(ms < FAST.as_millis(), "{ms} ms");
    assert!(e.message().contains(&format!(":{}", s.port)), "{e}");
    s.assert_no_secret(&format!("{e} {e:?}"));
    s.assert_no_secret_logged();
}
