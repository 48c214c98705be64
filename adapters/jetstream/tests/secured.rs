//! Secured connections on real nats-servers (`tests/brokers/up.sh nats-secure`, issue #23): TLS
//! with the test CA, user + password, NKey (seed file and inline seed), token with mutual TLS and
//! TLS-first, and `.creds` (JWT) in operator mode. For each: a produce / consume round trip, an
//! atomic batch (ADR-50) and the idempotent consumer. Refused credentials and certificates are
//! `Auth` errors within seconds (each test prints how long). Every error text, `Debug` output
//! and log line (async-nats' included, at TRACE) is searched for the test secrets.
//!
//! Runs when `ONCEFLOW_NATS_SECURE_URL` is set (`set -a; eval "$(tests/brokers/up.sh
//! nats-secure)"; set +a`); otherwise each test prints that it skipped, and with
//! `ONCEFLOW_REQUIRE_BROKERS=1` that is a failure.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use onceflow_core::dedup::MemoryStore;
use onceflow_core::{
    handler_fn, Client, ConsumerConfig, EngineConfig, ErrorKind, IdempotentConsumer,
    PlatformBackend, ProducerConfig, Record, IDEMPOTENCY_KEY_HEADER,
};
use onceflow_jetstream::JetStreamPlatform;

mod common;
use common::{name, take, topic};

/// What `tests/brokers/nats-secure/up.sh` prints.
struct Env {
    url: String,
    ca: String,
    other_ca: String,
    user: String,
    password: String,
    nkey_seed_file: String,
    unknown_nkey_seed_file: String,
    token_url: String,
    token: String,
    client_cert: String,
    client_key: String,
    creds_url: String,
    creds: String,
    bad_creds: String,
}

const URL_VAR: &str = "ONCEFLOW_NATS_SECURE_URL";

fn var(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set (tests/brokers/up.sh nats-secure)"))
}

/// The servers' settings, or `None` (said on stderr) when they are not started.
fn env(test: &str) -> Option<Env> {
    match std::env::var(URL_VAR) {
        Ok(u) if !u.is_empty() => {}
        _ => {
            assert!(
                std::env::var("ONCEFLOW_REQUIRE_BROKERS").as_deref() != Ok("1"),
                "ONCEFLOW_REQUIRE_BROKERS=1 but {URL_VAR} is not set (tests/brokers/up.sh \
                 nats-secure)"
            );
            let _ = writeln!(
                std::io::stderr(),
                "secured: SKIPPED {test}: {URL_VAR} is not set (start the servers with \
                 tests/brokers/up.sh nats-secure)"
            );
            return None;
        }
    }
    onceflow_conformance::logs::capture();
    Some(Env {
        url: var(URL_VAR),
        ca: var("ONCEFLOW_NATS_SECURE_CA"),
        other_ca: var("ONCEFLOW_NATS_SECURE_OTHER_CA"),
        user: var("ONCEFLOW_NATS_SECURE_USER"),
        password: var("ONCEFLOW_NATS_SECURE_PASSWORD"),
        nkey_seed_file: var("ONCEFLOW_NATS_SECURE_NKEY_SEED_FILE"),
        unknown_nkey_seed_file: var("ONCEFLOW_NATS_SECURE_UNKNOWN_NKEY_SEED_FILE"),
        token_url: var("ONCEFLOW_NATS_SECURE_TOKEN_URL"),
        token: var("ONCEFLOW_NATS_SECURE_TOKEN"),
        client_cert: var("ONCEFLOW_NATS_SECURE_CLIENT_CERT"),
        client_key: var("ONCEFLOW_NATS_SECURE_CLIENT_KEY"),
        creds_url: var("ONCEFLOW_NATS_SECURE_CREDS_URL"),
        creds: var("ONCEFLOW_NATS_SECURE_CREDS"),
        bad_creds: var("ONCEFLOW_NATS_SECURE_BAD_CREDS"),
    })
}

/// `tls://host:port` of `url` with `user_info@` inserted.
fn with_user_info(url: &str, user_info: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    format!("{scheme}://{user_info}@{rest}")
}

/// The seed line of a seed or creds file.
fn seed_in(path: &str) -> String {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("SU"))
        .unwrap_or_else(|| panic!("no seed in {path}"))
        .to_string()
}

/// The user JWT of a creds file.
fn jwt_in(path: &str) -> String {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("eyJ"))
        .unwrap_or_else(|| panic!("no JWT in {path}"))
        .to_string()
}

impl Env {
    /// Every secret of the test servers: none may appear in any output.
    fn secrets(&self) -> Vec<(&'static str, String)> {
        let key = std::fs::read_to_string(&self.client_key).unwrap();
        let key_line = key
            .lines()
            .find(|l| !l.starts_with("-----") && l.len() > 40)
            .unwrap()
            .to_string();
        vec![
            ("password", self.password.clone()),
            ("token", self.token.clone()),
            ("nkey seed", seed_in(&self.nkey_seed_file)),
            ("unknown nkey seed", seed_in(&self.unknown_nkey_seed_file)),
            ("creds seed", seed_in(&self.creds)),
            ("creds JWT", jwt_in(&self.creds)),
            ("bad creds seed", seed_in(&self.bad_creds)),
            ("bad creds JWT", jwt_in(&self.bad_creds)),
            ("client key", key_line),
        ]
    }

    /// Fails when any secret appears in `texts` or in the log lines captured so far.
    fn assert_no_secrets(&self, test: &str, texts: &[String]) {
        let logs = onceflow_conformance::logs::captured();
        assert!(!logs.is_empty(), "no log line was captured");
        for (what, secret) in self.secrets() {
            for t in texts {
                assert!(!t.contains(&secret), "{test}: the {what} appears in: {t}");
            }
            assert!(
                !logs.contains(&secret),
                "{test}: the {what} appears in the logs"
            );
        }
    }

    fn password_url(&self) -> String {
        format!(
            "{}?tls_ca={}",
            with_user_info(&self.url, &format!("{}:{}", self.user, self.password)),
            self.ca
        )
    }

    fn token_url(&self, token: &str) -> String {
        format!(
            "{}?tls_ca={}&tls_cert={}&tls_key={}&tls_first=true",
            with_user_info(&self.token_url, token),
            self.ca,
            self.client_cert,
            self.client_key
        )
    }
}

/// Connects to `url`, printing how long it took.
async fn connect(test: &str, url: &str) -> Arc<JetStreamPlatform> {
    let t0 = Instant::now();
    let p = onceflow_jetstream::connect(url)
        .await
        .unwrap_or_else(|e| panic!("{test}: {e}"));
    eprintln!("CONNECT {test} in {} ms", t0.elapsed().as_millis());
    // async-nats' CONNECT line (credentials redacted by it) reached the captured logs: the
    // secret check below reads what async-nats logs at TRACE.
    assert!(
        onceflow_conformance::logs::captured().contains("write operation: CONNECT"),
        "async-nats' TRACE lines are not captured"
    );
    p
}

/// Connecting to `url` fails with `kind` within 15 s (printed as `ONCEFLOW_AUTH <test> failed
/// in <ms> ms`); returns the error's text and `Debug`.
async fn refused(test: &str, url: &str, kind: ErrorKind, says: &str) -> Vec<String> {
    let t0 = Instant::now();
    let e = onceflow_jetstream::connect(url)
        .await
        .expect_err("the connection is refused");
    let ms = t0.elapsed().as_millis();
    eprintln!("{} {test} failed in {ms} ms: {e}", e.kind().code());
    assert_eq!(e.kind(), kind, "{test}: {e}");
    assert!(ms < 15_000, "{test}: {ms} ms is no quick failure");
    assert!(e.message().contains(says), "{test}: {e}");
    vec![e.to_string(), format!("{e:?}")]
}

/// A produce / consume round trip, an atomic batch and the idempotent consumer (3 keys, 2
/// duplicates) on `p`; returns the `Debug` of the platform for the secret check.
async fn round_trip(test: &str, p: Arc<JetStreamPlatform>) -> Vec<String> {
    // Produce, consume, commit.
    let t = topic(&p, "sec", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    for i in 0..3 {
        prod.send(Record::new(t.clone(), format!("m{i}")).idempotency_key(format!("{t}-{i}")))
            .await
            .unwrap();
    }
    // Atomic batch: stored together.
    let batch = prod
        .send_atomic(
            (0..3)
                .map(|i| Record::new(t.clone(), format!("b{i}")))
                .collect(),
        )
        .await
        .unwrap_or_else(|e| panic!("{test}: atomic batch: {e}"));
    assert_eq!(batch.len(), 3);
    let c = p
        .consumer(ConsumerConfig::new(name("g"), [t.clone()]))
        .await
        .unwrap();
    let got = take(c.as_ref(), 6).await;
    let values: Vec<_> = got.iter().map(|m| m.payload.clone()).collect();
    let expected: Vec<Bytes> = ["m0", "m1", "m2", "b0", "b1", "b2"]
        .iter()
        .map(|s| Bytes::from(*s))
        .collect();
    assert_eq!(values, expected, "{test}");
    let last = got.last().unwrap();
    c.commit(&[(last.topic_partition(), last.position.clone())])
        .await
        .unwrap();
    c.close().await.unwrap();

    // The idempotent consumer: each key handled once.
    let t2 = topic(&p, "sec-idem", 1).await;
    for k in ["k0", "k1", "k2", "k0", "k1"] {
        prod.send(Record::new(t2.clone(), k).header(IDEMPOTENCY_KEY_HEADER, k))
            .await
            .unwrap();
    }
    let client = Client::new(p.clone());
    let consumer = client
        .consumer(ConsumerConfig::new(name("g"), [t2.clone()]))
        .await
        .unwrap();
    let handled = Arc::new(Mutex::new(Vec::new()));
    let seen = handled.clone();
    let handler = handler_fn(move |m: onceflow_core::Message| {
        let seen = seen.clone();
        async move {
            seen.lock().unwrap().push(m.payload.clone());
            Ok(None)
        }
    });
    let engine = IdempotentConsumer::with_config(
        consumer,
        Some(Arc::new(MemoryStore::new(Duration::from_secs(600), 1000))),
        Arc::new(handler),
        EngineConfig::default(),
        None,
    )
    .unwrap();
    let metrics = engine.metrics();
    let watched = metrics.clone();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let summary = engine
        .run_until(async move {
            while watched.snapshot().consumed < 5 && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .unwrap();
    let mut handled = handled.lock().unwrap().clone();
    handled.sort();
    assert_eq!(handled, vec!["k0", "k1", "k2"], "{test}: each key once");
    assert_eq!(summary.metrics.duplicates_skipped, 2, "{test}");
    for topic in [&t, &t2] {
        let _ = p.admin().await.unwrap().delete_topic(topic).await;
    }
    eprintln!("ROUND TRIP {test}: ok");
    vec![format!("{p:?}"), format!("{:?}", p.options())]
}

#[tokio::test]
async fn user_and_password_in_the_url_user_info() {
    let test = "user_and_password_in_the_url_user_info";
    let Some(env) = env(test) else { return };
    let url = env.password_url();
    let p = connect(test, &url).await;
    assert!(p.options().tls);
    let mut out = round_trip(test, p).await;
    out.push(format!("{:?}", onceflow_jetstream::parse_url(&url)));
    out.push(onceflow_core::redact_credentials(&url));
    env.assert_no_secrets(test, &out);
}

#[tokio::test]
async fn user_and_password_as_query_keys_over_nats_tls_true_and_two_servers() {
    let test = "user_and_password_as_query_keys_over_nats_tls_true_and_two_servers";
    let Some(env) = env(test) else { return };
    // A second server that does not answer (port 1 refuses at once) next to the real one: the
    // connection goes to the one that answers.
    let hostport = env.url.strip_prefix("tls://").unwrap();
    let url = format!(
        "nats://{hostport},127.0.0.1:1?tls=true&tls_ca={}&user={}&password={}",
        env.ca, env.user, env.password
    );
    let p = connect(test, &url).await;
    let t = topic(&p, "sec", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    prod.send(Record::new(t.clone(), "x")).await.unwrap();
    let c = p
        .consumer(ConsumerConfig::new(name("g"), [t.clone()]))
        .await
        .unwrap();
    assert_eq!(take(c.as_ref(), 1).await[0].payload, Bytes::from("x"));
    c.close().await.unwrap();
    let mut out = vec![format!("{p:?}"), format!("{:?}", p.options())];
    out.push(onceflow_core::redact_credentials(&url));
    env.assert_no_secrets(test, &out);
}

#[tokio::test]
async fn nkey_seed_file() {
    let test = "nkey_seed_file";
    let Some(env) = env(test) else { return };
    let url = format!(
        "{}?tls_ca={}&nkey_seed_file={}",
        env.url, env.ca, env.nkey_seed_file
    );
    let p = connect(test, &url).await;
    let out = round_trip(test, p).await;
    env.assert_no_secrets(test, &out);
}

#[tokio::test]
async fn nkey_seed_in_the_url() {
    let test = "nkey_seed_in_the_url";
    let Some(env) = env(test) else { return };
    let seed = seed_in(&env.nkey_seed_file);
    let url = format!("{}?tls_ca={}&nkey_seed={seed}", env.url, env.ca);
    let p = connect(test, &url).await;
    let t = topic(&p, "sec", 1).await;
    let prod = p.producer(ProducerConfig::default()).await.unwrap();
    prod.send(Record::new(t.clone(), "x")).await.unwrap();
    let mut out = vec![format!("{p:?}"), format!("{:?}", p.options())];
    out.push(format!("{:?}", onceflow_jetstream::parse_url(&url)));
    out.push(onceflow_core::redact_credentials(&url));
    out.push(onceflow_core::redact_url(&url));
    env.assert_no_secrets(test, &out);
}

#[tokio::test]
async fn token_with_mutual_tls_and_tls_first() {
    let test = "token_with_mutual_tls_and_tls_first";
    let Some(env) = env(test) else { return };
    let url = env.token_url(&env.token);
    let p = connect(test, &url).await;
    assert!(p.options().tls_first);
    let mut out = round_trip(test, p).await;
    // The token as a query key works the same.
    let url = format!(
        "{}?tls_ca={}&tls_cert={}&tls_key={}&tls_first=true&token={}",
        env.token_url, env.ca, env.client_cert, env.client_key, env.token
    );
    let p = connect(test, &url).await;
    out.push(format!("{p:?}"));
    out.push(onceflow_core::redact_credentials(&url));
    env.assert_no_secrets(test, &out);
}

#[tokio::test]
async fn creds_file_in_operator_mode() {
    let test = "creds_file_in_operator_mode";
    let Some(env) = env(test) else { return };
    let url = format!("{}?tls_ca={}&creds={}", env.creds_url, env.ca, env.creds);
    let p = connect(test, &url).await;
    let out = round_trip(test, p).await;
    env.assert_no_secrets(test, &out);
}

#[tokio::test]
async fn wrong_password_is_an_auth_error_at_once() {
    let test = "wrong_password_is_an_auth_error_at_once";
    let Some(env) = env(test) else { return };
    let url = format!(
        "{}?tls_ca={}",
        with_user_info(&env.url, &format!("{}:not-{}", env.user, env.password)),
        env.ca
    );
    let mut out = refused(test, &url, ErrorKind::Auth, "authorization violation").await;
    let e = onceflow_jetstream::connect(&url).await.unwrap_err();
    assert!(e.message().contains(&format!("user '{}'", env.user)), "{e}");
    // With two servers in the URL, too.
    let two = format!(
        "{},127.0.0.1:1?tls_ca={}",
        with_user_info(&env.url, &format!("{}:not-{}", env.user, env.password)),
        env.ca
    );
    out.extend(refused(test, &two, ErrorKind::Auth, "authorization violation").await);
    // The wrong password itself is not shown either.
    let wrong = format!("not-{}", env.password);
    for t in &out {
        assert!(!t.contains(&wrong), "{t}");
    }
    env.assert_no_secrets(test, &out);
}

#[tokio::test]
async fn no_credentials_where_the_server_requires_them_is_an_auth_error() {
    let test = "no_credentials_where_the_server_requires_them_is_an_auth_error";
    let Some(env) = env(test) else { return };
    let url = format!("{}?tls_ca={}", env.url, env.ca);
    let out = refused(test, &url, ErrorKind::Auth, "without credentials").await;
    env.assert_no_secrets(test, &out);
}

#[tokio::test]
async fn wrong_token_is_an_auth_error_at_once() {
    let test = "wrong_token_is_an_auth_error_at_once";
    let Some(env) = env(test) else { return };
    let wrong = format!("x{}", env.token);
    let url = env.token_url(&wrong);
    let out = refused(test, &url, ErrorKind::Auth, "authorization violation").await;
    for t in &out {
        assert!(!t.contains(&wrong), "{t}");
    }
    env.assert_no_secrets(test, &out);
}

#[tokio::test]
async fn unknown_nkey_is_an_auth_error_at_once() {
    let test = "unknown_nkey_is_an_auth_error_at_once";
    let Some(env) = env(test) else { return };
    let url = format!(
        "{}?tls_ca={}&nkey_seed_file={}",
        env.url, env.ca, env.unknown_nkey_seed_file
    );
    let out = refused(test, &url, ErrorKind::Auth, "NKey user U").await;
    env.assert_no_secrets(test, &out);
}

#[tokio::test]
async fn creds_of_an_unknown_account_are_an_auth_error_at_once() {
    let test = "creds_of_an_unknown_account_are_an_auth_error_at_once";
    let Some(env) = env(test) else { return };
    let url = format!(
        "{}?tls_ca={}&creds={}",
        env.creds_url, env.ca, env.bad_creds
    );
    let out = refused(test, &url, ErrorKind::Auth, "authorization violation").await;
    env.assert_no_secrets(test, &out);
}

#[tokio::test]
async fn a_server_certificate_of_another_ca_is_an_auth_error_at_once() {
    let test = "a_server_certificate_of_another_ca_is_an_auth_error_at_once";
    let Some(env) = env(test) else { return };
    let url = format!(
        "{}?tls_ca={}",
        with_user_info(&env.url, &format!("{}:{}", env.user, env.password)),
        env.other_ca
    );
    let out = refused(
        test,
        &url,
        ErrorKind::Auth,
        "not signed by the CA in tls_ca",
    )
    .await;
    // The system's roots do not know the test CA either.
    let url = with_user_info(&env.url, &format!("{}:{}", env.user, env.password));
    let mut more = refused(test, &url, ErrorKind::Auth, "system's root CAs").await;
    more.extend(out);
    env.assert_no_secrets(test, &more);
}

#[tokio::test]
async fn a_missing_client_certificate_is_an_auth_error_at_once() {
    let test = "a_missing_client_certificate_is_an_auth_error_at_once";
    let Some(env) = env(test) else { return };
    let url = format!(
        "{}?tls_ca={}&tls_first=true",
        with_user_info(&env.token_url, &env.token),
        env.ca
    );
    let out = refused(test, &url, ErrorKind::Auth, "client certificate").await;
    env.assert_no_secrets(test, &out);
}

#[tokio::test]
async fn without_tls_first_a_handshake_first_server_says_so() {
    let test = "without_tls_first_a_handshake_first_server_says_so";
    let Some(env) = env(test) else { return };
    let url = format!(
        "{}?tls_ca={}&tls_cert={}&tls_key={}",
        with_user_info(&env.token_url, &env.token),
        env.ca,
        env.client_cert,
        env.client_key
    );
    let out = refused(test, &url, ErrorKind::Connect, "tls_first=true").await;
    env.assert_no_secrets(test, &out);
}

#[tokio::test]
async fn unreadable_files_are_config_errors_naming_the_option() {
    let test = "unreadable_files_are_config_errors_naming_the_option";
    let Some(env) = env(test) else { return };
    let missing = "/nonexistent/onceflow-test.pem";
    let mut out = Vec::new();
    for (url, says) in [
        (format!("{}&tls_ca={missing}", env.password_url()), "tls_ca"),
        (
            format!(
                "{}&tls_cert={missing}&tls_key={}",
                env.password_url(),
                env.client_key
            ),
            "tls_cert",
        ),
        (
            format!("{}?tls_ca={}&nkey_seed_file={missing}", env.url, env.ca),
            "nkey_seed_file",
        ),
        (
            format!("{}?tls_ca={}&creds={missing}", env.creds_url, env.ca),
            "credentials file",
        ),
        // A file that holds no seed (the CA certificate).
        (
            format!("{}?tls_ca={}&nkey_seed_file={}", env.url, env.ca, env.ca),
            "not an NKey seed",
        ),
    ] {
        out.extend(refused(test, &url, ErrorKind::Config, says).await);
    }
    env.assert_no_secrets(test, &out);
}
