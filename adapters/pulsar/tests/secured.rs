//! Secured Pulsar connections on a real Pulsar standalone with TLS listeners and token
//! authentication (`tests/brokers/up.sh pulsar`, which prints `ONCEFLOW_PULSAR_TLS_URL`,
//! `ONCEFLOW_PULSAR_TLS_ADMIN_URL`, `ONCEFLOW_PULSAR_TLS_CA`, `ONCEFLOW_PULSAR_OTHER_CA`,
//! the token files `ONCEFLOW_PULSAR_TOKEN_FILE`, `_TOKEN_FILE_B`, `_EXPIRED_TOKEN_FILE`,
//! `_OTHER_KEY_TOKEN_FILE` and the broker's HS256 key `ONCEFLOW_PULSAR_TOKEN_SECRET_KEY`).
//! Without them every test is skipped with that reason; `ONCEFLOW_REQUIRE_BROKERS=1` makes a
//! missing broker a failure.
//!
//! - `tls_token_file_round_trip_and_idempotent_consumer`: `pulsar+ssl://` with the test CA and
//!   a token file, admin over `https://` with the same token; the backend suite's round trip
//!   and the engine suite's idempotent consumer pass.
//! - `tls_token_string_round_trip`: `token=` in the URL.
//! - `token_file_is_read_again_after_rotation`: a token about to expire is replaced in its file
//!   by another role's token; after the broker dropped the expired connection the client
//!   reconnects with the new token and goes on; the admin API follows the file too.
//! - `a_fixed_token_that_expired_is_refused_on_reconnect`: the control: with `token=` the
//!   same expiry stops the client.
//! - `wrong_credentials_and_certificates_fail_fast_with_auth`: a token signed with another
//!   key, an expired token, garbage, a wrong CA, no CA, a host name the certificate lacks,
//!   and a wrong token on the plain listener (refused, not taken as anonymous): each an
//!   `Auth` error naming the server within seconds (printed in ms).
//! - `admin_over_https_refuses_an_untrusted_certificate`.
//! - `oauth2_client_credentials_from_a_loopback_token_endpoint`: an OAuth2 token endpoint in
//!   this test (OpenID discovery + client credentials) hands out Pulsar JWTs signed with the
//!   broker's secret key; the client connects with them, the admin API uses them, a wrong
//!   client secret is `Auth`.
//!
//! - `mtls_round_trip_partitioned_topic_and_idempotent_consumer`: a TLS client certificate
//!   (`tls_cert_file` / `tls_key_file`, `ONCEFLOW_PULSAR_CLIENT_CERT` / `_CLIENT_KEY`, role =
//!   its CN) through the loopback bridge: the backend round trip, a partitioned topic (its
//!   lookups are rewritten to bridge listeners) and the idempotent consumer; the admin API over
//!   https with the same certificate.
//! - `mtls_refusals_fail_fast_with_auth`: a client certificate from another CA
//!   (`ONCEFLOW_PULSAR_ROGUE_CLIENT_CERT`), an untrusted broker CA and a host name the broker's
//!   certificate lacks: `Auth` naming the server (printed in ms); the last one connects with
//!   `tls_hostname_verification=false`. A key of another certificate is a `Config` error.
//! - `mtls_bridge_closes_local_connections_without_its_secret`: another local process that
//!   connects to the bridge's loopback port (a CONNECT with a wrong secret, with the `tls`
//!   method, garbage) is closed without an answer and never reaches the broker.
//! - `mtls_consumer_and_producer_go_on_after_the_broker_was_unreachable`: the broker's TLS port
//!   (a relay in front of it, which Pulsar standalone's lookups keep the client on) refuses
//!   connections for 10 s and drops those it had; afterwards the producer and the consumer
//!   go on through the bridge (the bridge answered the crate's reconnects with an ERROR
//!   before, which the crate takes as fatal: its consumer stopped for good).
//!
//! Every error text, `Debug` output and the log lines captured at DEBUG are grepped for the
//! test secrets (tokens, and the base64 lines of the client key).

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine;
use hmac::{KeyInit, Mac};
use onceflow_conformance::backend_suite::{round_trip, run_case};
use onceflow_conformance::engine_suite::idempotent_consumer_skips_duplicates;
use onceflow_conformance::harness::{PlatformHarness, Timings};
use onceflow_core::{
    Client, ConsumerConfig, ErrorKind, PlatformBackend, ProducerConfig, Record, StartFrom,
    TopicSpec,
};

mod common;
use common::name;

/// Upper bound on how long a refused connection may take.
const FAIL_FAST: Duration = Duration::from_secs(15);

struct Env {
    tls_url: String,
    tls_admin: String,
    plain_url: String,
    plain_admin: String,
    ca: String,
    other_ca: String,
    token_file: String,
    token_file_b: String,
    expired_file: String,
    other_key_file: String,
    secret_key: String,
    client_cert: String,
    client_key: String,
    rogue_cert: String,
    rogue_key: String,
}

fn env() -> Option<Env> {
    let get = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    match (
        get("ONCEFLOW_PULSAR_TLS_URL"),
        get("ONCEFLOW_PULSAR_TOKEN_FILE"),
    ) {
        (Some(tls_url), Some(token_file)) => {
            let must = |k: &str| get(k).unwrap_or_else(|| panic!("{k} is not set"));
            Some(Env {
                tls_url,
                tls_admin: must("ONCEFLOW_PULSAR_TLS_ADMIN_URL"),
                plain_url: must("ONCEFLOW_PULSAR_URL"),
                plain_admin: must("ONCEFLOW_PULSAR_ADMIN_URL"),
                ca: must("ONCEFLOW_PULSAR_TLS_CA"),
                other_ca: must("ONCEFLOW_PULSAR_OTHER_CA"),
                token_file,
                token_file_b: must("ONCEFLOW_PULSAR_TOKEN_FILE_B"),
                expired_file: must("ONCEFLOW_PULSAR_EXPIRED_TOKEN_FILE"),
                other_key_file: must("ONCEFLOW_PULSAR_OTHER_KEY_TOKEN_FILE"),
                secret_key: must("ONCEFLOW_PULSAR_TOKEN_SECRET_KEY"),
                client_cert: must("ONCEFLOW_PULSAR_CLIENT_CERT"),
                client_key: must("ONCEFLOW_PULSAR_CLIENT_KEY"),
                rogue_cert: must("ONCEFLOW_PULSAR_ROGUE_CLIENT_CERT"),
                rogue_key: must("ONCEFLOW_PULSAR_ROGUE_CLIENT_KEY"),
            })
        }
        _ => {
            assert!(
                std::env::var("ONCEFLOW_REQUIRE_BROKERS").as_deref() != Ok("1"),
                "ONCEFLOW_REQUIRE_BROKERS=1 but ONCEFLOW_PULSAR_TLS_URL is not set \
                 (tests/brokers/up.sh pulsar)"
            );
            eprintln!(
                "secured: SKIPPED: ONCEFLOW_PULSAR_TLS_URL is not set (start a broker with \
                 tests/brokers/up.sh pulsar)"
            );
            None
        }
    }
}

fn read(path: &str) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .trim()
        .to_string()
}

fn enc(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

/// An HS256 JWT for `sub`, expiring `ttl` from now (none: no expiry), signed with the broker's
/// secret key (the same token Pulsar's `tokens create` makes).
fn jwt(secret_key: &str, sub: &str, ttl: Option<Duration>) -> String {
    let key = std::fs::read(secret_key).unwrap();
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let header = b64.encode(br#"{"alg":"HS256"}"#);
    let claims = match ttl {
        Some(t) => {
            let exp = (SystemTime::now() + t)
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_secs();
            format!(r#"{{"sub":"{sub}","exp":{exp}}}"#)
        }
        None => format!(r#"{{"sub":"{sub}"}}"#),
    };
    let signing = format!("{header}.{}", b64.encode(claims));
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&key).unwrap();
    mac.update(signing.as_bytes());
    let sig = b64.encode(mac.finalize().into_bytes());
    format!("{signing}.{sig}")
}

// --- what the tests saw, for the secrets grep ------------------------------------------------

/// The log lines of this test binary (onceflow's tracing and the pulsar crate's `log`, DEBUG
/// and above).
fn logs() -> &'static Mutex<Vec<u8>> {
    static LOGS: OnceLock<Mutex<Vec<u8>>> = OnceLock::new();
    LOGS.get_or_init(|| Mutex::new(Vec::new()))
}

struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        logs().lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn capture_logs() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(|| LogWriter)
            .try_init();
    });
}

/// Asserts none of `secrets` is in `seen` or in the captured logs.
fn assert_no_secret(seen: &[String], secrets: &[String]) {
    let logs = String::from_utf8_lossy(&logs().lock().unwrap()).to_string();
    // The capture works: the pulsar crate's `log` lines arrive (it logs every connection).
    assert!(
        logs.contains("pulsar"),
        "no log line captured: {} bytes",
        logs.len()
    );
    for s in secrets.iter().filter(|s| s.len() >= 8) {
        for text in seen {
            assert!(!text.contains(s.as_str()), "a secret is in: {text}");
        }
        assert!(!logs.contains(s.as_str()), "a secret is in the logs");
        // The signature part alone (a JWT's secret half) must not be there either.
        if let Some(sig) = s.rsplit('.').next().filter(|x| x.len() >= 16) {
            assert!(!logs.contains(sig), "a token signature is in the logs");
            for text in seen {
                assert!(!text.contains(sig), "a token signature is in: {text}");
            }
        }
    }
}

/// Connects expecting an `Auth` error naming `server`, within [`FAIL_FAST`]; returns the
/// error's Display and Debug.
async fn refused(what: &str, url: &str, server: &str) -> Vec<String> {
    let t0 = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(60), onceflow_pulsar::connect(url))
        .await
        .unwrap_or_else(|_| panic!("{what}: connect hung for 60 s"));
    let ms = t0.elapsed().as_millis();
    let e = match r {
        Ok(_) => panic!("{what}: connected, expected an Auth error"),
        Err(e) => e,
    };
    eprintln!("AUTH {what} failed in {ms} ms: {e}");
    assert_eq!(e.kind(), ErrorKind::Auth, "{what}: {e}");
    assert!(
        t0.elapsed() < FAIL_FAST,
        "{what}: took {ms} ms (bound {FAIL_FAST:?})"
    );
    assert!(
        e.to_string().contains(server),
        "{what}: names no server: {e}"
    );
    vec![e.to_string(), format!("{e:?}")]
}

/// Produces `n` records to `topic` and reads them back with a new group; returns the values.
async fn produce_consume(platform: Arc<dyn PlatformBackend>, topic: &str, n: usize) -> Vec<String> {
    let client = Client::new(platform);
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    for i in 0..n {
        producer
            .send(Record::new(topic.to_string(), format!("v{i}")).key(format!("k{i}")))
            .await
            .unwrap();
    }
    read_all(&client, topic, n).await
}

async fn read_all(client: &Client, topic: &str, n: usize) -> Vec<String> {
    let consumer = client
        .consumer(ConsumerConfig::new(name("g"), [topic.to_string()]).start(StartFrom::Earliest))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = Vec::new();
    while got.len() < n && Instant::now() < deadline {
        for m in consumer
            .poll(100, Duration::from_millis(300))
            .await
            .unwrap()
        {
            got.push(String::from_utf8_lossy(&m.payload).to_string());
        }
    }
    consumer.close().await.unwrap();
    got
}

fn tls_url(env: &Env, creds: &str) -> String {
    format!(
        "{}?admin={}&tls_trust_certs={}&{creds}",
        env.tls_url,
        enc(&env.tls_admin),
        enc(&env.ca)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_token_file_round_trip_and_idempotent_consumer() {
    let Some(env) = env() else { return };
    capture_logs();
    let url = tls_url(&env, &format!("token_file={}", enc(&env.token_file)));
    let platform = onceflow_pulsar::connect(&url).await.unwrap();
    assert!(platform.options().admin_url.starts_with("https://"));
    let debug = format!("{platform:?} {:?}", platform.options());
    let harness = PlatformHarness::new(platform, Timings::broker()).without_read_uncommitted();
    // Topics are created and described through the admin API over https:// with the token.
    run_case(
        &harness,
        "backend::round_trip (TLS + token)",
        round_trip(&harness),
    )
    .await;
    run_case(
        &harness,
        "engine::idempotent_consumer_skips_duplicates (TLS + token)",
        idempotent_consumer_skips_duplicates(&harness),
    )
    .await;
    assert_no_secret(&[debug], &[read(&env.token_file)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_token_string_round_trip() {
    let Some(env) = env() else { return };
    capture_logs();
    let token = read(&env.token_file_b);
    let url = tls_url(&env, &format!("token={}", enc(&token)));
    let platform = onceflow_pulsar::connect(&url).await.unwrap();
    let debug = format!("{platform:?} {:?}", platform.options());
    let topic = name("tls-token");
    let admin = platform.admin().await.unwrap();
    admin
        .create_topic(&TopicSpec::new(topic.clone(), 2))
        .await
        .unwrap();
    let d = admin.describe_topic(&topic).await.unwrap();
    assert_eq!(d.partitions, 2);
    let mut got = produce_consume(platform, &topic, 10).await;
    got.sort();
    let mut want: Vec<String> = (0..10).map(|i| format!("v{i}")).collect();
    want.sort();
    assert_eq!(got, want);
    // The URL itself, shown in an error, loses the token.
    let bad = format!("{url}&bogus=1");
    let e = onceflow_pulsar::connect(&bad).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    let e2 = onceflow_pulsar::parse_url("pulsar+ssl://,?token=abcdefgh12345678").unwrap_err();
    assert_no_secret(
        &[debug, e.to_string(), format!("{e:?}"), e2.to_string()],
        &[token, "abcdefgh12345678".to_string()],
    );
}

/// How long after a token's expiry the client certainly reconnected: the broker looks for
/// expired credentials every second (authenticationRefreshCheckSeconds=1) and closes the
/// connection of a client that cannot refresh (the crate announces no auth refresh).
const AFTER_EXPIRY: Duration = Duration::from_secs(4);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_file_is_read_again_after_rotation() {
    let Some(env) = env() else { return };
    capture_logs();
    let dir = std::env::temp_dir().join(name("onceflow-pulsar-token"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("token");
    let short = jwt(
        &env.secret_key,
        "onceflow-rotated-a",
        Some(Duration::from_secs(3)),
    );
    std::fs::write(&file, &short).unwrap();
    let url = tls_url(
        &env,
        &format!(
            "token_file={}&operation_timeout_ms=10000",
            enc(file.to_str().unwrap())
        ),
    );
    let platform = onceflow_pulsar::connect(&url).await.unwrap();
    let topic = name("rotate");
    let client = Client::new(platform.clone());
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    producer
        .send(Record::new(topic.clone(), "before"))
        .await
        .unwrap();

    // Rotate: another role's token (no expiry) replaces the one about to expire.
    let next = read(&env.token_file_b);
    let tmp = dir.join("token.new");
    std::fs::write(&tmp, &next).unwrap();
    std::fs::rename(&tmp, &file).unwrap();
    tokio::time::sleep(Duration::from_secs(3) + AFTER_EXPIRY).await;

    // The first token has expired and the broker dropped its connection; the client
    // reconnected with the file's new token.
    let t0 = Instant::now();
    producer
        .send(Record::new(topic.clone(), "after"))
        .await
        .unwrap();
    eprintln!(
        "token_file rotation: send after expiry took {} ms",
        t0.elapsed().as_millis()
    );
    let got = read_all(&client, &topic, 2).await;
    assert_eq!(got, vec!["before".to_string(), "after".to_string()]);

    // The admin API reads the file per call: a token the broker refuses is refused there too.
    std::fs::write(&file, read(&env.other_key_file)).unwrap();
    let admin = platform.admin().await.unwrap();
    let e = admin.describe_topic(&topic).await.unwrap_err();
    eprintln!("AUTH admin after rotation to a foreign token: {e}");
    assert_eq!(e.kind(), ErrorKind::Auth, "{e}");
    assert!(e.to_string().contains("401"), "{e}");
    assert_no_secret(
        &[e.to_string(), format!("{e:?}")],
        &[short, next, read(&env.other_key_file)],
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fixed_token_that_expired_is_refused_on_reconnect() {
    let Some(env) = env() else { return };
    capture_logs();
    let short = jwt(
        &env.secret_key,
        "onceflow-fixed",
        Some(Duration::from_secs(3)),
    );
    let url = tls_url(
        &env,
        &format!("token={}&operation_timeout_ms=5000", enc(&short)),
    );
    let platform = onceflow_pulsar::connect(&url).await.unwrap();
    let topic = name("fixed");
    let client = Client::new(platform.clone());
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    producer
        .send(Record::new(topic.clone(), "before"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3) + AFTER_EXPIRY).await;
    let t0 = Instant::now();
    let e = producer
        .send(Record::new(topic.clone(), "after"))
        .await
        .unwrap_err();
    eprintln!(
        "expired fixed token: send failed in {} ms: {e}",
        t0.elapsed().as_millis()
    );
    // A new connection with it is refused as Auth.
    let seen = refused("expired fixed token, reconnect", &url, "127.0.0.1").await;
    let mut all = seen;
    all.push(e.to_string());
    all.push(format!("{e:?}"));
    assert_no_secret(&all, &[short]);
}

/// A TCP relay on 127.0.0.2 (loopback, a name the server certificate lacks) to `upstream`.
async fn relay(upstream: String) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.2:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let upstream = upstream.clone();
            tokio::spawn(async move {
                if let Ok(mut out) = tokio::net::TcpStream::connect(&upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                }
            });
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_and_certificates_fail_fast_with_auth() {
    let Some(env) = env() else { return };
    capture_logs();
    let server = env.tls_url.trim_start_matches("pulsar+ssl://").to_string();
    let foreign = read(&env.other_key_file);
    let expired = read(&env.expired_file);
    let good = read(&env.token_file);
    let mut seen = Vec::new();

    let foreign_url = tls_url(&env, &format!("token={}", enc(&foreign)));
    seen.extend(refused("token signed with another key", &foreign_url, &server).await);
    seen.extend(
        refused(
            "expired token (file)",
            &tls_url(&env, &format!("token_file={}", enc(&env.expired_file))),
            &server,
        )
        .await,
    );
    seen.extend(
        refused(
            "garbage token",
            &tls_url(&env, "token=not-a-jwt-at-all-0123456789"),
            &server,
        )
        .await,
    );
    let token = format!("token_file={}", enc(&env.token_file));
    seen.extend(
        refused(
            "untrusted server certificate (other CA)",
            &format!(
                "{}?admin={}&tls_trust_certs={}&{token}",
                env.tls_url,
                enc(&env.tls_admin),
                enc(&env.other_ca)
            ),
            &server,
        )
        .await,
    );
    seen.extend(
        refused(
            "untrusted server certificate (no CA given)",
            &format!("{}?admin={}&{token}", env.tls_url, enc(&env.tls_admin)),
            &server,
        )
        .await,
    );
    let port = relay(server.clone()).await;
    let mismatch = format!(
        "pulsar+ssl://127.0.0.2:{port}?admin={}&tls_trust_certs={}&{token}",
        enc(&env.tls_admin),
        enc(&env.ca)
    );
    let e = refused(
        "host name mismatch",
        &mismatch,
        &format!("127.0.0.2:{port}"),
    )
    .await;
    assert!(e[0].contains("does not name this host"), "{}", e[0]);
    seen.extend(e);

    // The plain listener lets a client without credentials in as the anonymous role, but a
    // wrong token there is refused, not taken as anonymous.
    let plain_server = env.plain_url.trim_start_matches("pulsar://").to_string();
    let anonymous = format!("{}?admin={}", env.plain_url, enc(&env.plain_admin));
    onceflow_pulsar::connect(&anonymous).await.unwrap();
    seen.extend(
        refused(
            "foreign token on the plain listener",
            &format!("{anonymous}&token={}", enc(&foreign)),
            &plain_server,
        )
        .await,
    );
    seen.extend(
        refused(
            "expired token on the plain listener",
            &format!("{anonymous}&token={}", enc(&expired)),
            &plain_server,
        )
        .await,
    );
    // A valid token on the plain listener works.
    onceflow_pulsar::connect(&format!("{anonymous}&token={}", enc(&good)))
        .await
        .unwrap();
    assert_no_secret(&seen, &[foreign, expired, good]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_over_https_refuses_an_untrusted_certificate() {
    let Some(env) = env() else { return };
    capture_logs();
    // The broker over plain TCP with a valid token, the admin API over https:// with a CA
    // that did not sign its certificate.
    let url = format!(
        "{}?admin={}&tls_trust_certs={}&token_file={}",
        env.plain_url,
        enc(&env.tls_admin),
        enc(&env.other_ca),
        enc(&env.token_file)
    );
    let t0 = Instant::now();
    let e = onceflow_pulsar::connect(&url).await.unwrap_err();
    let ms = t0.elapsed().as_millis();
    eprintln!("AUTH admin https with the other CA failed in {ms} ms: {e}");
    assert_eq!(e.kind(), ErrorKind::Auth, "{e}");
    assert!(t0.elapsed() < FAIL_FAST);
    assert!(e.to_string().contains("127.0.0.1:18443") || e.to_string().contains(&env.tls_admin));
    // With the right CA the same connection works.
    let ok = url.replace(&enc(&env.other_ca), &enc(&env.ca));
    onceflow_pulsar::connect(&ok).await.unwrap();
    assert_no_secret(&[e.to_string(), format!("{e:?}")], &[read(&env.token_file)]);
}

// --- OAuth2 ----------------------------------------------------------------------------------

/// A loopback OAuth2 authorization server: OpenID discovery, an empty JWKS and a
/// client-credentials token endpoint handing out Pulsar JWTs signed with the broker's key.
/// Returns its issuer URL and the count of tokens it issued.
async fn oauth2_server(
    secret_key: String,
    client_id: &'static str,
    client_secret: &'static str,
) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    let issued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = issued.clone();
    // The issuer names its own address, known only once bound.
    let issuer_of = Arc::new(std::sync::OnceLock::<String>::new());
    let iss_cell = issuer_of.clone();
    let addr = onceflow_conformance::http::serve("127.0.0.1:0", move |r| {
        let iss = iss_cell.get().cloned().unwrap_or_default();
        let path = r.path();
        let (status, json) = if path.ends_with("/.well-known/openid-configuration") {
            (
                "200 OK",
                serde_json::json!({
                    "issuer": iss,
                    "authorization_endpoint": format!("{iss}authorize"),
                    "token_endpoint": format!("{iss}token"),
                    "jwks_uri": format!("{iss}jwks"),
                    "response_types_supported": ["code"],
                    "subject_types_supported": ["public"],
                    "id_token_signing_alg_values_supported": ["RS256"],
                }),
            )
        } else if path.ends_with("/jwks") {
            ("200 OK", serde_json::json!({"keys": []}))
        } else if path.ends_with("/token") {
            let form: std::collections::HashMap<String, String> =
                url::form_urlencoded::parse(r.body.as_bytes())
                    .into_owned()
                    .collect();
            let ok = form.get("grant_type").map(String::as_str) == Some("client_credentials")
                && form.get("client_id").map(String::as_str) == Some(client_id)
                && form.get("client_secret").map(String::as_str) == Some(client_secret);
            if ok {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                (
                    "200 OK",
                    serde_json::json!({
                        "access_token": jwt(&secret_key, "onceflow-oauth2", Some(Duration::from_secs(600))),
                        "token_type": "Bearer",
                        "expires_in": 600,
                    }),
                )
            } else {
                (
                    "401 Unauthorized",
                    serde_json::json!({"error": "invalid_client"}),
                )
            }
        } else {
            ("404 Not Found", serde_json::json!({"error": "not_found"}))
        };
        (status, json.to_string())
    })
    .await;
    let issuer = format!("http://{addr}/");
    issuer_of.set(issuer.clone()).unwrap();
    (issuer, issued)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oauth2_client_credentials_from_a_loopback_token_endpoint() {
    let Some(env) = env() else { return };
    capture_logs();
    const SECRET: &str = "oauth2-client-secret-7f3a9c";
    let (issuer, issued) = oauth2_server(env.secret_key.clone(), "onceflow-client", SECRET).await;
    let dir = std::env::temp_dir().join(name("onceflow-pulsar-oauth2"));
    std::fs::create_dir_all(&dir).unwrap();
    let creds = dir.join("key.json");
    std::fs::write(
        &creds,
        format!(r#"{{"client_id":"onceflow-client","client_secret":"{SECRET}"}}"#),
    )
    .unwrap();
    let url = tls_url(
        &env,
        &format!(
            "oauth2_issuer_url={}&oauth2_credentials_file={}&oauth2_audience=urn:pulsar:test",
            enc(&issuer),
            enc(creds.to_str().unwrap())
        ),
    );
    let platform = onceflow_pulsar::connect(&url).await.unwrap();
    assert!(issued.load(std::sync::atomic::Ordering::SeqCst) >= 1);
    let debug = format!("{platform:?} {:?}", platform.options());
    let topic = name("oauth2");
    // Admin over https:// with the OAuth2 access token (the broker refuses a bad one: see the
    // wrong-token cases), then a round trip.
    let admin = platform.admin().await.unwrap();
    admin
        .create_topic(&TopicSpec::new(topic.clone(), 1))
        .await
        .unwrap();
    let got = produce_consume(platform, &topic, 5).await;
    assert_eq!(got.len(), 5);

    // A wrong client secret: the token endpoint refuses it.
    let bad = dir.join("bad.json");
    std::fs::write(
        &bad,
        r#"{"client_id":"onceflow-client","client_secret":"wrong-secret-123456"}"#,
    )
    .unwrap();
    let bad_url = url.replace(&enc(creds.to_str().unwrap()), &enc(bad.to_str().unwrap()));
    let seen = refused("OAuth2 wrong client secret", &bad_url, "127.0.0.1:16651").await;
    let mut all = seen;
    all.push(debug);
    assert_no_secret(
        &all,
        &[SECRET.to_string(), "wrong-secret-123456".to_string()],
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

// --- mTLS (TLS client certificates through the loopback bridge) ------------------------------

fn mtls_url(env: &Env, cert: &str, key: &str) -> String {
    tls_url(
        env,
        &format!("tls_cert_file={}&tls_key_file={}", enc(cert), enc(key)),
    )
}

/// The base64 lines of a PEM private key (what must never be shown).
fn key_lines(path: &str) -> Vec<String> {
    read(path)
        .lines()
        .filter(|l| !l.starts_with("-----") && l.len() >= 16)
        .map(String::from)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_round_trip_partitioned_topic_and_idempotent_consumer() {
    let Some(env) = env() else { return };
    capture_logs();
    let url = mtls_url(&env, &env.client_cert, &env.client_key);
    let t0 = Instant::now();
    let platform = onceflow_pulsar::connect(&url).await.unwrap();
    eprintln!("mTLS connect took {} ms", t0.elapsed().as_millis());
    let debug = format!("{platform:?} {:?}", platform.options());
    let service = env.tls_url.trim_start_matches("pulsar+ssl://").to_string();
    let stats = platform
        .mtls_bridge()
        .expect("a bridge with a client certificate");
    assert!(
        stats.listeners.iter().any(|(up, _)| *up == service),
        "{stats:?}"
    );

    // A partitioned topic: each partition is looked up, and each lookup answer is pointed at a
    // bridge listener; produce and consume across all three.
    let topic = name("mtls-part");
    let admin = platform.admin().await.unwrap();
    admin
        .create_topic(&TopicSpec::new(topic.clone(), 3))
        .await
        .unwrap();
    assert_eq!(admin.describe_topic(&topic).await.unwrap().partitions, 3);
    let mut got = produce_consume(platform.clone(), &topic, 30).await;
    got.sort();
    let mut want: Vec<String> = (0..30).map(|i| format!("v{i}")).collect();
    want.sort();
    assert_eq!(got, want);

    let harness =
        PlatformHarness::new(platform.clone(), Timings::broker()).without_read_uncommitted();
    run_case(&harness, "backend::round_trip (mTLS)", round_trip(&harness)).await;
    run_case(
        &harness,
        "engine::idempotent_consumer_skips_duplicates (mTLS)",
        idempotent_consumer_skips_duplicates(&harness),
    )
    .await;
    // The broker unloads a topic (closes its producer, CLOSE_PRODUCER): the crate looks it
    // up again and reconnects, through the bridge; the producer goes on.
    let topic = name("mtls-unload");
    let client = Client::new(platform.clone());
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    producer
        .send(Record::new(topic.clone(), "before"))
        .await
        .unwrap();
    let lookups = platform.mtls_bridge().unwrap().lookups;
    let unload = tokio::process::Command::new("curl")
        .args(["-sf", "-m", "10", "-X", "PUT", "--cacert", &env.ca])
        .args(["--cert", &env.client_cert, "--key", &env.client_key])
        .args(["-H", "X-Pulsar-Auth-Method-Name: tls"])
        .arg(format!(
            "{}/admin/v2/persistent/public/default/{topic}/unload",
            env.tls_admin
        ))
        .status()
        .await
        .unwrap();
    assert!(unload.success(), "unload: {unload}");
    producer
        .send(Record::new(topic.clone(), "after"))
        .await
        .unwrap();
    assert_eq!(read_all(&client, &topic, 2).await, vec!["before", "after"]);
    let stats = platform.mtls_bridge().unwrap();
    assert!(
        stats.lookups > lookups,
        "no lookup after the unload: {stats:?}"
    );
    eprintln!("mTLS bridge: {stats:?}");
    assert!(stats.relayed >= 1, "{stats:?}");
    // At least one lookup per partition went through the rewrite.
    assert!(stats.lookups >= 3, "{stats:?}");
    assert_eq!(stats.refused_local, 0, "{stats:?}");
    assert_no_secret(&[debug], &key_lines(&env.client_key));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_refusals_fail_fast_with_auth() {
    let Some(env) = env() else { return };
    capture_logs();
    let server = env.tls_url.trim_start_matches("pulsar+ssl://").to_string();
    let mut seen = Vec::new();

    // The broker does not trust our client certificate.
    let e = refused(
        "mTLS: client certificate from another CA",
        &mtls_url(&env, &env.rogue_cert, &env.rogue_key),
        &server,
    )
    .await;
    assert!(e[0].contains("client certificate"), "{}", e[0]);
    seen.extend(e);

    // We do not trust the broker's certificate.
    let cert = format!(
        "tls_cert_file={}&tls_key_file={}",
        enc(&env.client_cert),
        enc(&env.client_key)
    );
    let e = refused(
        "mTLS: untrusted broker certificate (other CA)",
        &format!(
            "{}?admin={}&tls_trust_certs={}&{cert}",
            env.tls_url,
            enc(&env.tls_admin),
            enc(&env.other_ca)
        ),
        &server,
    )
    .await;
    assert!(e[0].contains("issuer is not trusted"), "{}", e[0]);
    seen.extend(e);

    // A host name the broker's certificate lacks (127.0.0.2, relayed to the broker)...
    let port = relay(server.clone()).await;
    let mismatch = format!(
        "pulsar+ssl://127.0.0.2:{port}?admin={}&tls_trust_certs={}&{cert}",
        enc(&env.tls_admin),
        enc(&env.ca)
    );
    let e = refused(
        "mTLS: host name mismatch",
        &mismatch,
        &format!("127.0.0.2:{port}"),
    )
    .await;
    assert!(e[0].contains("does not name this host"), "{}", e[0]);
    seen.extend(e);
    // ... is taken with tls_hostname_verification=false (the chain is still verified).
    let lenient = onceflow_pulsar::connect(&format!("{mismatch}&tls_hostname_verification=false"))
        .await
        .unwrap();
    let topic = name("mtls-lenient");
    assert_eq!(produce_consume(lenient, &topic, 3).await.len(), 3);

    // A key that is not the certificate's: a Config error naming both files, at once.
    let e = onceflow_pulsar::connect(&mtls_url(&env, &env.client_cert, &env.rogue_key))
        .await
        .unwrap_err();
    eprintln!("mTLS: mismatched key: {e}");
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.to_string().contains("does not belong"), "{e}");
    seen.push(e.to_string());
    seen.push(format!("{e:?}"));

    let mut secrets = key_lines(&env.client_key);
    secrets.extend(key_lines(&env.rogue_key));
    assert_no_secret(&seen, &secrets);
}

/// A frame of `cmd` (Pulsar's binary protocol: `[u32 total][u32 command size][command]`).
fn frame(cmd: &pulsar::proto::BaseCommand) -> Vec<u8> {
    use prost::Message;
    let body = cmd.encode_to_vec();
    let mut out = ((4 + body.len()) as u32).to_be_bytes().to_vec();
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

fn connect_command(method: Option<&str>, data: Option<Vec<u8>>) -> Vec<u8> {
    frame(&pulsar::proto::BaseCommand {
        r#type: pulsar::proto::base_command::Type::Connect as i32,
        connect: Some(pulsar::proto::CommandConnect {
            client_version: "intruder".to_string(),
            auth_method_name: method.map(String::from),
            auth_data: data,
            protocol_version: Some(12),
            ..Default::default()
        }),
        ..Default::default()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_bridge_closes_local_connections_without_its_secret() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some(env) = env() else { return };
    capture_logs();
    let platform = onceflow_pulsar::connect(&mtls_url(&env, &env.client_cert, &env.client_key))
        .await
        .unwrap();
    let before = platform.mtls_bridge().unwrap();
    let (_, local) = before.listeners[0].clone();
    // The way another local process would try: the bridge's private method with a guessed
    // secret, the `tls` method a real client certificate would use, and no Pulsar at all.
    let attempts: Vec<(&str, Vec<u8>)> = vec![
        (
            "private method, wrong secret",
            connect_command(Some("onceflow-loopback-mtls-bridge"), Some(vec![0u8; 32])),
        ),
        ("tls method", connect_command(Some("tls"), None)),
        ("no credential", connect_command(None, None)),
        ("not Pulsar", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()),
    ];
    for (what, bytes) in &attempts {
        let mut s = tokio::net::TcpStream::connect(local).await.unwrap();
        s.write_all(bytes).await.unwrap();
        let mut answer = Vec::new();
        let t0 = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer))
            .await
            .unwrap_or_else(|_| panic!("{what}: the bridge kept the connection open"));
        eprintln!(
            "mTLS bridge, {what}: closed after {} ms, {} bytes answered",
            t0.elapsed().as_millis(),
            answer.len()
        );
        // Closed without a word (a reset counts as closed): no CONNECTED, no error from a
        // broker.
        assert!(
            r.is_err() || answer.is_empty(),
            "{what}: answered {answer:?}"
        );
    }
    let after = platform.mtls_bridge().unwrap();
    assert_eq!(
        after.refused_local,
        before.refused_local + attempts.len() as u64,
        "{after:?}"
    );
    // None of them reached a broker: no connection was relayed meanwhile.
    assert_eq!(after.relayed, before.relayed, "{after:?}");
    // The platform itself still works through the same bridge.
    let topic = name("mtls-after-intruders");
    assert_eq!(produce_consume(platform.clone(), &topic, 2).await.len(), 2);
    assert!(platform.mtls_bridge().unwrap().relayed >= after.relayed);
    let logs = String::from_utf8_lossy(&logs().lock().unwrap()).to_string();
    assert!(
        logs.contains("closed a local connection without contacting the broker"),
        "the refusals are logged at debug"
    );
}

/// A TCP relay on 127.0.0.1 (a name the broker's certificate has) to `upstream`, on `port`
/// (0: any); aborting the returned task and `conns` makes the broker unreachable.
fn outage_relay(
    port: u16,
    upstream: String,
    conns: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
) -> (u16, tokio::task::JoinHandle<()>) {
    let listener = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
    let task = tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let upstream = upstream.clone();
            let relayed = tokio::spawn(async move {
                if let Ok(mut out) = tokio::net::TcpStream::connect(&upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                }
            });
            conns.lock().unwrap().push(relayed);
        }
    });
    (port, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_consumer_and_producer_go_on_after_the_broker_was_unreachable() {
    let Some(env) = env() else { return };
    let upstream = env.tls_url.trim_start_matches("pulsar+ssl://").to_string();
    let conns = Arc::new(Mutex::new(Vec::new()));
    let (port, relay) = outage_relay(0, upstream.clone(), conns.clone());
    let url = mtls_url(&env, &env.client_cert, &env.client_key).replacen(
        &env.tls_url,
        &format!("pulsar+ssl://127.0.0.1:{port}"),
        1,
    );
    let platform = onceflow_pulsar::connect(&url).await.unwrap();
    let client = Client::new(platform.clone());
    let topic = name("mtls-outage");
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    let consumer = client
        .consumer(ConsumerConfig::new(name("g"), [topic.clone()]).start(StartFrom::Earliest))
        .await
        .unwrap();
    producer
        .send(Record::new(topic.clone(), "before"))
        .await
        .unwrap();

    // The broker is away for 10 s: its port refuses, its connections are gone.
    relay.abort();
    let _ = relay.await;
    for c in conns.lock().unwrap().drain(..) {
        c.abort();
    }
    let t0 = Instant::now();
    let sending = {
        let (producer, topic) = (producer.clone(), topic.clone());
        tokio::spawn(async move { producer.send(Record::new(topic, "during")).await })
    };
    tokio::time::sleep(Duration::from_secs(10)).await;
    let (_, relay) = outage_relay(port, upstream, conns.clone());
    tokio::time::timeout(Duration::from_secs(60), sending)
        .await
        .expect("the send during the outage hung")
        .unwrap()
        .unwrap();
    eprintln!(
        "mTLS outage: the send made during it was delivered {} ms after it began",
        t0.elapsed().as_millis()
    );
    producer
        .send(Record::new(topic.clone(), "after"))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = Vec::new();
    while got.len() < 3 && Instant::now() < deadline {
        for m in consumer.poll(10, Duration::from_millis(300)).await.unwrap() {
            got.push(String::from_utf8_lossy(&m.payload).to_string());
        }
    }
    eprintln!("mTLS outage: {:?}", platform.mtls_bridge());
    assert_eq!(
        got,
        vec!["before", "during", "after"],
        "the consumer stopped"
    );
    consumer.close().await.unwrap();
    relay.abort();
}

/// Another local process opens 100 idle connections to each of the bridge's loopback ports
/// and sends nothing. They used to be held 5 s each with 64 KiB reserved, uncapped (3000 of
/// them raised the RSS by 25 MB, and at `ulimit -n 256` the process ran out of file
/// descriptors). Now at most 32 per bridge await their CONNECT, for at most 1 s; newer ones
/// displace the oldest, which are closed at once. Meanwhile the broker connection is cut, so the crate has to connect to
/// the bridge again: it gets through, and the producer and consumer go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_bridge_caps_local_connections_awaiting_their_connect() {
    use tokio::io::AsyncReadExt;
    let Some(env) = env() else { return };
    let upstream = env.tls_url.trim_start_matches("pulsar+ssl://").to_string();
    let conns = Arc::new(Mutex::new(Vec::new()));
    let (port, relay) = outage_relay(0, upstream.clone(), conns.clone());
    let url = mtls_url(&env, &env.client_cert, &env.client_key).replacen(
        &env.tls_url,
        &format!("pulsar+ssl://127.0.0.1:{port}"),
        1,
    );
    let platform = onceflow_pulsar::connect(&url).await.unwrap();
    let client = Client::new(platform.clone());
    let topic = name("mtls-flood");
    let producer = client.producer(ProducerConfig::new()).await.unwrap();
    let consumer = client
        .consumer(ConsumerConfig::new(name("g"), [topic.clone()]).start(StartFrom::Earliest))
        .await
        .unwrap();
    producer
        .send(Record::new(topic.clone(), "before"))
        .await
        .unwrap();
    let before = platform.mtls_bridge().unwrap();

    // The flood: 100 idle connections to each listener, each timed until the bridge closes it.
    const IDLE: usize = 100;
    let mut idle = Vec::new();
    for (_, local) in &before.listeners {
        for _ in 0..IDLE {
            let mut s = tokio::net::TcpStream::connect(*local).await.unwrap();
            let t0 = Instant::now();
            idle.push(tokio::spawn(async move {
                let mut buf = [0u8; 64];
                let closed = tokio::time::timeout(Duration::from_secs(10), async {
                    loop {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(_) => {}
                        }
                    }
                })
                .await;
                closed.ok().map(|_| t0.elapsed())
            }));
        }
    }
    // The broker connection is cut (and its port open again at once): the crate connects to
    // the flooded bridge again.
    relay.abort();
    let _ = relay.await;
    for c in conns.lock().unwrap().drain(..) {
        c.abort();
    }
    let (_, relay) = outage_relay(port, upstream, conns.clone());
    let t0 = Instant::now();
    producer
        .send(Record::new(topic.clone(), "after"))
        .await
        .unwrap();
    eprintln!(
        "mTLS flood: the send after the cut was delivered in {} ms",
        t0.elapsed().as_millis()
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = Vec::new();
    let mut retried = 0;
    while got.len() < 2 && Instant::now() < deadline {
        match consumer.poll(10, Duration::from_millis(300)).await {
            Ok(batch) => {
                for m in batch {
                    got.push(String::from_utf8_lossy(&m.payload).to_string());
                }
            }
            // What the engine retries.
            Err(e) if e.is_retriable() => {
                eprintln!("mTLS flood: poll: {e}");
                retried += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(
        got,
        vec!["before", "after"],
        "the platform works on ({retried} retries)"
    );

    let mut times = Vec::new();
    for t in idle {
        times.push(
            t.await
                .unwrap()
                .expect("an idle local connection was held for 10 s"),
        );
    }
    times.sort();
    let at_once = times
        .iter()
        .filter(|t| **t < Duration::from_millis(300))
        .count();
    let slowest = *times.last().unwrap();
    let after = platform.mtls_bridge().unwrap();
    eprintln!(
        "mTLS flood: {} idle connections, {at_once} closed within 300 ms, the last after {} ms; \
         {after:?}",
        times.len(),
        slowest.as_millis()
    );
    let listeners = before.listeners.len();
    assert!(
        at_once >= listeners * (IDLE - 32),
        "beyond 32 awaiting their CONNECT, local connections are closed at once: {at_once}"
    );
    assert!(
        slowest < Duration::from_millis(1500),
        "idle local connections are closed within about 1 s: {slowest:?}"
    );
    assert!(
        after.refused_local >= before.refused_local + (listeners * IDLE) as u64,
        "{after:?}"
    );
    assert!(
        after.relayed > before.relayed,
        "the crate connected again: {after:?}"
    );
    consumer.close().await.unwrap();
    relay.abort();
}
