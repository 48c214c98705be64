//! Kafka behind TLS and SASL (#23), on the secured listeners of the test broker that
//! `tests/brokers/up.sh kafka` starts (a throwaway CA made at start, a user whose password is
//! made at start):
//!
//! - `sasl_ssl_with_each_mechanism`: SASL_SSL with PLAIN, SCRAM-SHA-256 and SCRAM-SHA-512, the
//!   broker's certificate checked against the test CA (`ssl.ca.location`): the backend suite's
//!   round trip, a transaction committing consumed offsets with its outputs, and the
//!   idempotent consumer's duplicate pass, each on a real broker.
//! - `sasl_plaintext_with_scram`: SASL_PLAINTEXT with SCRAM-SHA-256.
//! - `mtls_with_pem_files_and_in_memory_pem`: SSL with a client certificate the broker requires
//!   (`ssl.client.auth=required`), from PEM files and from in-memory PEM (`ssl.*.pem`).
//! - `oauthbearer_with_the_oidc_client_credentials_flow`: librdkafka's own OIDC client
//!   (`sasl.oauthbearer.method=oidc`, KIP-768) asks a token endpoint on loopback for a token with
//!   the client id and secret; the broker's unsecured JWS validator takes it (KIP-255).
//! - `every_compression_codec`: gzip, snappy, lz4 and zstd round trips.
//! - `refusals_are_quick_errors_that_name_no_secret`: a wrong password (PLAIN and SCRAM), an
//!   untrusted CA, a missing client certificate, a token endpoint that refuses the client, a
//!   plaintext client at a TLS listener and a TLS client at a plaintext one: each fails
//!   `onceflow_kafka::open` with the right kind within seconds (printed as `AUTH <case> <ms>`),
//!   and no error text or `Debug` output holds the password, the key or the client secret.
//!
//! Runs when `ONCEFLOW_KAFKA_SASL_SSL_URL` (and the other variables `up.sh kafka` prints) are
//! set; `ONCEFLOW_REQUIRE_BROKERS=1` makes their absence a failure.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use onceflow_conformance::backend_suite::{self, run_case};
use onceflow_conformance::engine_suite;
use onceflow_conformance::harness::{broker_url, PlatformHarness, Timings};
use onceflow_core::ErrorKind;

/// The secured listeners and credentials `up.sh kafka` printed, or `None` (skip) without them.
struct Env {
    sasl_ssl: String,
    ssl: String,
    sasl_plaintext: String,
    plaintext: String,
    ca: String,
    other_ca: String,
    cert: String,
    key: String,
    user: String,
    password: String,
}

fn env() -> Option<Env> {
    let sasl_ssl = match broker_url("ONCEFLOW_KAFKA_SASL_SSL_URL", "kafka") {
        Ok(url) => url,
        Err(reason) => {
            eprintln!("secured_kafka: SKIPPED: {reason}");
            return None;
        }
    };
    let var = |n: &str| std::env::var(n).unwrap_or_else(|_| panic!("{n} is not set"));
    Some(Env {
        sasl_ssl,
        ssl: var("ONCEFLOW_KAFKA_SSL_URL"),
        sasl_plaintext: var("ONCEFLOW_KAFKA_SASL_PLAINTEXT_URL"),
        plaintext: var("ONCEFLOW_KAFKA_URL"),
        ca: var("ONCEFLOW_KAFKA_CA"),
        other_ca: var("ONCEFLOW_KAFKA_OTHER_CA"),
        cert: var("ONCEFLOW_KAFKA_CLIENT_CERT"),
        key: var("ONCEFLOW_KAFKA_CLIENT_KEY"),
        user: var("ONCEFLOW_KAFKA_SASL_USERNAME"),
        password: var("ONCEFLOW_KAFKA_SASL_PASSWORD"),
    })
}

/// `base` with `options` as URL query parameters (form-encoded: PEM text and passwords pass).
fn url(base: &str, options: &[(&str, &str)]) -> String {
    let query: String = url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(options)
        .finish();
    format!("{base}?{query}")
}

impl Env {
    fn sasl(&self, base: &str, protocol: &str, mechanism: &str) -> String {
        let mut options = vec![
            ("security.protocol", protocol),
            ("sasl.mechanism", mechanism),
            ("sasl.username", self.user.as_str()),
            ("sasl.password", self.password.as_str()),
        ];
        if protocol == "SASL_SSL" {
            options.push(("ssl.ca.location", self.ca.as_str()));
        }
        url(base, &options)
    }
}

/// The round trip, a transaction committing consumed offsets, and the idempotent consumer's
/// duplicate pass, on `url` (opened with the connection check).
async fn passes(label: &str, url: &str) {
    let started = Instant::now();
    let platform = onceflow_kafka::open(url)
        .await
        .unwrap_or_else(|e| panic!("{label}: open failed: {e}"));
    let h = PlatformHarness::new(platform, Timings::broker()).forbid_skips();
    run_case(&h, "round_trip", backend_suite::round_trip(&h)).await;
    run_case(
        &h,
        "tx_commit_offsets_with_the_transaction",
        backend_suite::tx_commit_offsets_with_the_transaction(&h),
    )
    .await;
    run_case(
        &h,
        "engine::idempotent_consumer_skips_duplicates",
        engine_suite::idempotent_consumer_skips_duplicates(&h),
    )
    .await;
    eprintln!(
        "SECURED {label}: round trip, transaction and idempotent consumer passed in {} ms",
        started.elapsed().as_millis()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sasl_ssl_with_each_mechanism() {
    let Some(e) = env() else { return };
    for mechanism in ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] {
        let u = e.sasl(&e.sasl_ssl, "SASL_SSL", mechanism);
        passes(&format!("SASL_SSL {mechanism}"), &u).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sasl_plaintext_with_scram() {
    let Some(e) = env() else { return };
    let u = e.sasl(&e.sasl_plaintext, "SASL_PLAINTEXT", "SCRAM-SHA-256");
    passes("SASL_PLAINTEXT SCRAM-SHA-256", &u).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_with_pem_files_and_in_memory_pem() {
    let Some(e) = env() else { return };
    let files = url(
        &e.ssl,
        &[
            ("security.protocol", "SSL"),
            ("ssl.ca.location", &e.ca),
            ("ssl.certificate.location", &e.cert),
            ("ssl.key.location", &e.key),
        ],
    );
    passes("SSL mTLS, PEM files", &files).await;
    let read = |p: &str| std::fs::read_to_string(p).unwrap();
    let (ca, cert, key) = (read(&e.ca), read(&e.cert), read(&e.key));
    let in_memory = url(
        &e.ssl,
        &[
            ("security.protocol", "SSL"),
            ("ssl.ca.pem", &ca),
            ("ssl.certificate.pem", &cert),
            ("ssl.key.pem", &key),
        ],
    );
    passes("SSL mTLS, in-memory PEM", &in_memory).await;
}

/// A JWS with `alg: none` (what Kafka's unsecured validator takes, KIP-255) for `sub`.
fn unsecured_jwt(sub: &str) -> String {
    use base64::Engine;
    let b64 = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let header = b64(br#"{"alg":"none"}"#);
    let claims = b64(format!(r#"{{"sub":"{sub}","iat":{now},"exp":{}}}"#, now + 3600).as_bytes());
    format!("{header}.{claims}.")
}

/// An OAuth 2.0 token endpoint on loopback (RFC 6749 §4.4, client credentials): answers a
/// request whose Basic credentials are `client_id:client_secret` with an unsecured JWT for
/// `sub`, and any other with 401. Keeps each request's text for the test to read.
async fn token_endpoint(
    client_id: &'static str,
    client_secret: &'static str,
) -> (String, Arc<Mutex<Vec<String>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let expected = format!(
        "Basic {}",
        base64::Engine::encode(
            &base64::engine::general_purpose::STANDARD,
            format!("{client_id}:{client_secret}")
        )
    );
    let addr = onceflow_conformance::http::serve("127.0.0.1:0", move |r| {
        log.lock()
            .unwrap()
            .push(format!("{}\r\n\r\n{}", r.head, r.body));
        if r.header("authorization") == Some(expected.as_str()) {
            let body = format!(
                r#"{{"access_token":"{}","token_type":"bearer","expires_in":3600}}"#,
                unsecured_jwt("onceflow-oidc")
            );
            ("200 OK", body)
        } else {
            (
                "401 Unauthorized",
                r#"{"error":"invalid_client"}"#.to_string(),
            )
        }
    })
    .await;
    (format!("http://{addr}/oauth2/token"), seen)
}

const OIDC_CLIENT: &str = "onceflow-test-client";
const OIDC_SECRET: &str = "oidc-client-secret-5d1f";

fn oidc_url(e: &Env, endpoint: &str, secret: &str) -> String {
    url(
        &e.sasl_ssl,
        &[
            ("security.protocol", "SASL_SSL"),
            ("ssl.ca.location", &e.ca),
            ("sasl.mechanism", "OAUTHBEARER"),
            ("sasl.oauthbearer.method", "oidc"),
            ("sasl.oauthbearer.client.id", OIDC_CLIENT),
            ("sasl.oauthbearer.client.secret", secret),
            ("sasl.oauthbearer.token.endpoint.url", endpoint),
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oauthbearer_with_the_oidc_client_credentials_flow() {
    let Some(e) = env() else { return };
    let (endpoint, seen) = token_endpoint(OIDC_CLIENT, OIDC_SECRET).await;
    passes(
        "SASL_SSL OAUTHBEARER (OIDC)",
        &oidc_url(&e, &endpoint, OIDC_SECRET),
    )
    .await;
    let requests = seen.lock().unwrap().clone();
    assert!(
        !requests.is_empty(),
        "librdkafka never asked the token endpoint"
    );
    let first = &requests[0];
    assert!(first.starts_with("POST /oauth2/token"), "{first}");
    assert!(first.contains("grant_type=client_credentials"), "{first}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_compression_codec() {
    let Some(e) = env() else { return };
    for codec in ["gzip", "snappy", "lz4", "zstd"] {
        let u = url(&e.plaintext, &[("compression.type", codec)]);
        let platform = onceflow_kafka::open(&u).await.unwrap();
        let h = PlatformHarness::new(platform, Timings::broker()).forbid_skips();
        run_case(&h, "round_trip", backend_suite::round_trip(&h)).await;
        run_case(
            &h,
            "send_batch_results_in_order",
            backend_suite::send_batch_results_in_order(&h),
        )
        .await;
        eprintln!("SECURED compression.type={codec}: round trip passed");
    }
}

/// Opens `url`, expects `kind` within 15 s, prints the time, and checks that neither the error
/// nor its `Debug` holds any of `secrets`.
async fn refused(case: &str, url: &str, kind: ErrorKind, secrets: &[&str]) {
    let started = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(60), onceflow_kafka::open(url))
        .await
        .unwrap_or_else(|_| panic!("{case}: open hung for 60 s"));
    let ms = started.elapsed().as_millis();
    let err = match result {
        Ok(_) => panic!("{case}: open succeeded"),
        Err(err) => err,
    };
    eprintln!("AUTH {case} {ms} ms: {err}");
    assert_eq!(err.kind(), kind, "{case}: {err}");
    assert!(ms < 15_000, "{case}: took {ms} ms");
    let shown = format!("{err} {err:?} {}", err.message());
    for s in secrets {
        assert!(
            !shown.contains(s),
            "{case}: the error shows a secret: {shown}"
        );
    }
    if let Ok(p) = onceflow_kafka::connect(url) {
        let debug = format!("{p:?}");
        for s in secrets {
            assert!(!debug.contains(s), "{case}: Debug shows a secret: {debug}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_quick_errors_that_name_no_secret() {
    let Some(e) = env() else { return };
    let wrong = "not-the-password-71c3";
    let secrets = [wrong, e.password.as_str()];
    for mechanism in ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] {
        let u = url(
            &e.sasl_ssl,
            &[
                ("security.protocol", "SASL_SSL"),
                ("sasl.mechanism", mechanism),
                ("sasl.username", &e.user),
                ("sasl.password", wrong),
                ("ssl.ca.location", &e.ca),
            ],
        );
        refused(
            &format!("wrong password {mechanism}"),
            &u,
            ErrorKind::Auth,
            &secrets,
        )
        .await;
    }
    let untrusted = url(
        &e.sasl_ssl,
        &[
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanism", "SCRAM-SHA-256"),
            ("sasl.username", &e.user),
            ("sasl.password", &e.password),
            ("ssl.ca.location", &e.other_ca),
        ],
    );
    refused("untrusted CA", &untrusted, ErrorKind::Auth, &secrets).await;
    let key = std::fs::read_to_string(&e.key).unwrap();
    let key_body = key.lines().nth(1).unwrap().to_string();
    let no_client_cert = url(
        &e.ssl,
        &[("security.protocol", "SSL"), ("ssl.ca.location", &e.ca)],
    );
    refused(
        "no client certificate",
        &no_client_cert,
        ErrorKind::Auth,
        &secrets,
    )
    .await;
    let untrusted_mtls = url(
        &e.ssl,
        &[
            ("security.protocol", "SSL"),
            ("ssl.ca.location", &e.other_ca),
            ("ssl.certificate.location", &e.cert),
            ("ssl.key.pem", &key),
        ],
    );
    refused(
        "mTLS with an untrusted CA",
        &untrusted_mtls,
        ErrorKind::Auth,
        &[key_body.as_str()],
    )
    .await;
    let (endpoint, _) = token_endpoint(OIDC_CLIENT, OIDC_SECRET).await;
    let wrong_secret = "wrong-oidc-secret-9a2e";
    refused(
        "token endpoint refuses the client",
        &oidc_url(&e, &endpoint, wrong_secret),
        ErrorKind::Auth,
        &[wrong_secret, OIDC_SECRET],
    )
    .await;
    let plaintext_at_tls = e.sasl(&e.sasl_ssl, "SASL_PLAINTEXT", "SCRAM-SHA-256");
    refused(
        "SASL_PLAINTEXT client at the SASL_SSL listener",
        &plaintext_at_tls,
        ErrorKind::Connect,
        &secrets,
    )
    .await;
    let tls_at_plaintext = e.sasl(&e.plaintext, "SASL_SSL", "SCRAM-SHA-256");
    refused(
        "SASL_SSL client at the PLAINTEXT listener",
        &tls_at_plaintext,
        ErrorKind::Connect,
        &secrets,
    )
    .await;
}
