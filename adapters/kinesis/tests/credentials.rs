//! Where the credentials of a `kinesis://` connection come from, shown on the Kinesis emulator
//! (`tests/brokers/up.sh kinesis`, which accepts any key): a recording reverse proxy on
//! loopback, in front of the emulator, keeps each request's `Authorization` header, so each
//! case shows which access key id signed the put/get round trip and for which region
//! (`Credential=AKID/DATE/REGION/kinesis/aws4_request`).
//!
//! Cases: environment keys; a named profile (`profile=` and `AWS_PROFILE`) of temporary shared
//! config/credentials files; `credential_process`; web identity (IRSA) and an assumed role,
//! whose STS calls go to a loopback fake STS (`AWS_ENDPOINT_URL_STS`) that records the form the
//! SDK sends and answers with well-formed credentials: that checks onceflow's wiring of the
//! SDK's providers, not AWS's STS. Failures (a failing or garbled `credential_process`, a
//! missing profile, no credentials at all, a refused AssumeRole) must be `Auth` errors within
//! seconds, and no test secret may appear in any error, `Debug` output or log line.
//!
//! Runs when `ONCEFLOW_KINESIS_URL` is set; without it each test says it skipped, and with
//! `ONCEFLOW_REQUIRE_BROKERS=1` it fails instead. The environment is process-global: every test
//! holds one lock while it changes `AWS_*` variables, and restores them.

use std::collections::HashMap;
use std::io::Write as _;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use aws_sdk_kinesis::primitives::Blob;
use aws_sdk_kinesis::types::ShardIteratorType;
use onceflow_core::{Error, ErrorKind};
use onceflow_kinesis::KinesisPlatform;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

const URL_VAR: &str = "ONCEFLOW_KINESIS_URL";

/// Every value a test hands the SDK as a secret; none may show anywhere.
const SECRETS: &[&str] = &[
    "env-secret-Qx7",
    "env-session-token-Qx7",
    "profile-secret-Qx7",
    "proc-secret-Qx7",
    "proc-session-token-Qx7",
    "bad-json-secret-Qx7",
    "web-identity-token-Qx7",
    "sts-secret-Qx7",
    "sts-session-token-Qx7",
    "base-secret-Qx7",
    "ext-id-Qx7",
    "container-auth-token-Qx7",
    "container-secret-Qx7",
    "container-session-token-Qx7",
    "imds-secret-Qx7",
    "imds-session-token-Qx7",
    "imds-api-token-Qx7",
];

/// Emulator address, or `None` (skipped) when `ONCEFLOW_KINESIS_URL` is unset.
fn emulator(test: &str) -> Option<SocketAddr> {
    match std::env::var(URL_VAR) {
        Ok(url) if !url.is_empty() => {
            let u = url::Url::parse(&url).expect("ONCEFLOW_KINESIS_URL is a URL");
            let host = u.host_str().expect("ONCEFLOW_KINESIS_URL names a host");
            let host = if host == "localhost" {
                "127.0.0.1"
            } else {
                host
            };
            Some(
                format!("{host}:{}", u.port().unwrap_or(80))
                    .parse()
                    .expect("ONCEFLOW_KINESIS_URL names an IP address and port"),
            )
        }
        _ => {
            assert!(
                std::env::var("ONCEFLOW_REQUIRE_BROKERS").as_deref() != Ok("1"),
                "ONCEFLOW_REQUIRE_BROKERS=1 but {URL_VAR} is not set: start the broker with \
                 tests/brokers/up.sh kinesis"
            );
            eprintln!(
                "SKIPPED {test}: {URL_VAR} is not set: start the broker with tests/brokers/up.sh \
                 kinesis"
            );
            None
        }
    }
}

// ---- environment: one lock, and every AWS_* variable the SDK reads set or cleared ----------

static ENV_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const AWS_VARS: &[&str] = &[
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
    "AWS_ROLE_SESSION_NAME",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_STS",
    "AWS_ENDPOINT_URL_KINESIS",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN",
    "AWS_EC2_METADATA_DISABLED",
    "AWS_EC2_METADATA_SERVICE_ENDPOINT",
    "AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE",
    "AWS_SDK_LOAD_CONFIG",
];

/// The `AWS_*` variables as they were; restored on drop. While it lives, the environment has
/// none of them but empty shared files in a temporary directory (so `~/.aws` of the machine
/// plays no part) and instance metadata disabled (nothing leaves loopback).
struct Env {
    saved: Vec<(&'static str, Option<std::ffi::OsString>)>,
    dir: tempfile::TempDir,
    _lock: tokio::sync::MutexGuard<'static, ()>,
}

impl Env {
    async fn clean() -> Env {
        let lock = ENV_LOCK.lock().await;
        let saved = AWS_VARS.iter().map(|k| (*k, std::env::var_os(k))).collect();
        for k in AWS_VARS {
            std::env::remove_var(k);
        }
        let dir = tempfile::tempdir().unwrap();
        let env = Env {
            saved,
            dir,
            _lock: lock,
        };
        env.write("config", "");
        env.write("credentials", "");
        env.set("AWS_CONFIG_FILE", &env.path("config"));
        env.set("AWS_SHARED_CREDENTIALS_FILE", &env.path("credentials"));
        env.set("AWS_EC2_METADATA_DISABLED", "true");
        env
    }

    fn set(&self, k: &str, v: &str) {
        assert!(
            AWS_VARS.contains(&k),
            "{k} is restored only if listed in AWS_VARS"
        );
        std::env::set_var(k, v);
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    fn write(&self, name: &str, text: &str) -> String {
        let p = self.path(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    /// A shell script that prints `stdout` (and `stderr`) and exits with `code`.
    fn script(&self, name: &str, stdout: &str, stderr: &str, code: i32) -> String {
        let p = self.write(
            name,
            &format!("#!/bin/sh\ncat <<'EOF'\n{stdout}\nEOF\necho '{stderr}' >&2\nexit {code}\n"),
        );
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        for (k, v) in &self.saved {
            match v {
                Some(v) => std::env::set_var(k, v),
                None => std::env::remove_var(k),
            }
        }
    }
}

// ---- logs: everything the SDK and onceflow log at debug (ONCEFLOW_CREDENTIALS_TEST_LOG), kept for the secret check ---------

static LOGS: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct LogWriter;

impl std::io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOGS.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn capture_logs() {
    static INIT: OnceLock<()> = OnceLock::new();
    INIT.get_or_init(|| {
        let sub = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(
                std::env::var("ONCEFLOW_CREDENTIALS_TEST_LOG").unwrap_or_else(|_| "debug".into()),
            ))
            .with_writer(|| LogWriter)
            .with_ansi(false)
            .finish();
        tracing::subscriber::set_global_default(sub).expect("one subscriber");
    });
}

/// Fails if any test secret is in `text` (`what` says where it was found).
fn assert_no_secret(what: &str, text: &str) {
    for s in SECRETS {
        assert!(!text.contains(s), "secret {s} shown in {what}: {text}");
    }
}

/// No test secret in any log line; names every secret found and the target that logged it.
fn assert_logs_clean() {
    let logs = String::from_utf8_lossy(&LOGS.lock().unwrap()).into_owned();
    let mut leaks = Vec::new();
    for s in SECRETS {
        if let Some(line) = logs.lines().find(|l| l.contains(s)) {
            let target = line
                .split(": ")
                .find(|w| w.contains("::") && !w.contains(' '))
                .unwrap_or("?");
            leaks.push(format!("{s} (logged by {target})"));
        }
    }
    assert!(
        leaks.is_empty(),
        "secrets in the logs: {}",
        leaks.join(", ")
    );
}

// ---- the recording reverse proxy ------------------------------------------------------------

/// What the proxy saw of one request.
#[derive(Debug, Clone)]
struct Seen {
    authorization: String,
    security_token: Option<String>,
}

/// A loopback reverse proxy to `upstream` that records the headers of every request.
struct Proxy {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
}

/// Reads one HTTP/1.1 request head (through the blank line) and its `Content-Length` body;
/// `None` at end of stream. Header names in lower case.
async fn read_request<R: tokio::io::AsyncBufRead + Unpin>(
    r: &mut R,
) -> std::io::Result<Option<(Vec<u8>, HashMap<String, String>, Vec<u8>)>> {
    let mut head = Vec::new();
    let mut headers = HashMap::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).await? == 0 {
            return Ok(None);
        }
        head.extend_from_slice(line.as_bytes());
        if line == "\r\n" || line == "\n" {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let len: usize = headers
        .get("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0; len];
    r.read_exact(&mut body).await?;
    Ok(Some((head, headers, body)))
}

impl Proxy {
    async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let record = seen.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let record = record.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut sr, &mut cw).await;
                        let _ = cw.shutdown().await;
                    });
                    let mut cr = BufReader::new(cr);
                    while let Ok(Some((head, headers, body))) = read_request(&mut cr).await {
                        record.lock().unwrap().push(Seen {
                            authorization: headers
                                .get("authorization")
                                .cloned()
                                .unwrap_or_default(),
                            security_token: headers.get("x-amz-security-token").cloned(),
                        });
                        if sw.write_all(&head).await.is_err() || sw.write_all(&body).await.is_err()
                        {
                            break;
                        }
                    }
                    let _ = sw.shutdown().await;
                });
            }
        });
        Proxy { addr, seen }
    }

    fn url(&self, query: &str) -> String {
        format!("kinesis://{}?{query}", self.addr)
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Every request was signed by `akid` for `region` (today's credential scope), carrying
    /// `token` as `X-Amz-Security-Token` when given; returns how many requests.
    fn assert_signed(&self, akid: &str, region: &str, token: Option<&str>) -> usize {
        let seen = self.seen();
        assert!(!seen.is_empty(), "no request reached the proxy");
        let days = [utc_date(0), utc_date(-1)];
        for s in &seen {
            let cred = s
                .authorization
                .split("Credential=")
                .nth(1)
                .and_then(|c| c.split(',').next())
                .unwrap_or_else(|| panic!("no SigV4 Credential in '{}'", s.authorization));
            let parts: Vec<&str> = cred.split('/').collect();
            assert_eq!(
                parts.len(),
                5,
                "credential scope AKID/DATE/REGION/SERVICE/aws4_request: {cred}"
            );
            assert_eq!(parts[0], akid, "signed by the wrong access key id: {cred}");
            assert!(days.iter().any(|d| d == parts[1]), "scope date {cred}");
            assert_eq!(
                &parts[2..],
                [region, "kinesis", "aws4_request"],
                "scope: {cred}"
            );
            assert!(
                s.authorization.starts_with("AWS4-HMAC-SHA256 "),
                "{}",
                s.authorization
            );
            assert_eq!(s.security_token.as_deref(), token, "X-Amz-Security-Token");
        }
        eprintln!(
            "signed: {} request(s) with Credential={akid}/{}/{region}/kinesis/aws4_request",
            seen.len(),
            days[0]
        );
        seen.len()
    }
}

/// The UTC date `offset` days from today, as `YYYYMMDD` (SigV4's scope date).
fn utc_date(offset: i64) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    // Days to civil date (H. Hinnant's algorithm).
    let z = secs.div_euclid(86_400) + offset + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}{m:02}{d:02}")
}

// ---- a loopback fake STS ----------------------------------------------------------------------

/// One STS request as received: its headers and its decoded form.
#[derive(Debug, Clone)]
struct StsCall {
    headers: HashMap<String, String>,
    form: HashMap<String, String>,
}

/// A loopback HTTP server answering STS's query API (`AssumeRole`,
/// `AssumeRoleWithWebIdentity`) with the credentials given, or with `AccessDenied` when
/// `refuse` is set; records each request.
struct FakeSts {
    addr: SocketAddr,
    calls: Arc<Mutex<Vec<StsCall>>>,
}

const STS_AKID: &str = "ASIASTSFAKE00000001";

impl FakeSts {
    async fn start(refuse: bool) -> FakeSts {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let calls: Arc<Mutex<Vec<StsCall>>> = Arc::default();
        let record = calls.clone();
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let record = record.clone();
                tokio::spawn(async move {
                    let (r, mut w) = conn.into_split();
                    let mut r = BufReader::new(r);
                    while let Ok(Some((_, headers, body))) = read_request(&mut r).await {
                        let form: HashMap<String, String> = url::form_urlencoded::parse(&body)
                            .map(|(k, v)| (k.into_owned(), v.into_owned()))
                            .collect();
                        let action = form.get("Action").cloned().unwrap_or_default();
                        record.lock().unwrap().push(StsCall { headers, form });
                        let (status, body) = if refuse {
                            (
                                "403 Forbidden",
                                "<ErrorResponse xmlns=\"https://sts.amazonaws.com/doc/2011-06-15/\">\
                                 <Error><Type>Sender</Type><Code>AccessDenied</Code>\
                                 <Message>User is not authorized to perform: sts:AssumeRole</Message>\
                                 </Error><RequestId>r-1</RequestId></ErrorResponse>"
                                    .to_string(),
                            )
                        } else {
                            ("200 OK", sts_answer(&action))
                        };
                        let resp = format!(
                            "HTTP/1.1 {status}\r\nContent-Type: text/xml\r\nContent-Length: {}\r\n\
                             x-amzn-RequestId: r-1\r\n\r\n{body}",
                            body.len()
                        );
                        if w.write_all(resp.as_bytes()).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        FakeSts { addr, calls }
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn calls(&self) -> Vec<StsCall> {
        self.calls.lock().unwrap().clone()
    }
}

/// A well-formed STS answer to `action` (the shapes of the STS API reference).
fn sts_answer(action: &str) -> String {
    format!(
        "<{action}Response xmlns=\"https://sts.amazonaws.com/doc/2011-06-15/\">\
         <{action}Result>\
         <Credentials><AccessKeyId>{STS_AKID}</AccessKeyId>\
         <SecretAccessKey>sts-secret-Qx7</SecretAccessKey>\
         <SessionToken>sts-session-token-Qx7</SessionToken>\
         <Expiration>2099-01-01T00:00:00Z</Expiration></Credentials>\
         <AssumedRoleUser><AssumedRoleId>AROAFAKE:onceflow</AssumedRoleId>\
         <Arn>arn:aws:sts::000000000000:assumed-role/app/onceflow</Arn></AssumedRoleUser>\
         </{action}Result>\
         <ResponseMetadata><RequestId>r-1</RequestId></ResponseMetadata>\
         </{action}Response>"
    )
}

// ---- a loopback fake of the container and instance metadata credential endpoints -----------

/// One request to a [`FakeHttp`]: method, path and headers (names in lower case).
#[derive(Debug, Clone)]
struct HttpCall {
    method: String,
    path: String,
    headers: HashMap<String, String>,
}

type Handler =
    dyn Fn(&HttpCall) -> (&'static str, String, Vec<(&'static str, String)>) + Send + Sync;

/// A loopback HTTP server answering each request with `handler`'s (status, body, headers),
/// recording the requests.
struct FakeHttp {
    addr: SocketAddr,
    calls: Arc<Mutex<Vec<HttpCall>>>,
}

impl FakeHttp {
    async fn start(handler: Arc<Handler>) -> FakeHttp {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let calls: Arc<Mutex<Vec<HttpCall>>> = Arc::default();
        let record = calls.clone();
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let (record, handler) = (record.clone(), handler.clone());
                tokio::spawn(async move {
                    let (r, mut w) = conn.into_split();
                    let mut r = BufReader::new(r);
                    while let Ok(Some((head, headers, _))) = read_request(&mut r).await {
                        let line = String::from_utf8_lossy(&head);
                        let mut words = line.split_whitespace();
                        let call = HttpCall {
                            method: words.next().unwrap_or_default().to_string(),
                            path: words.next().unwrap_or_default().to_string(),
                            headers,
                        };
                        let (status, body, extra) = handler(&call);
                        record.lock().unwrap().push(call);
                        let mut resp =
                            format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\n", body.len());
                        for (k, v) in extra {
                            resp.push_str(&format!("{k}: {v}\r\n"));
                        }
                        resp.push_str("\r\n");
                        resp.push_str(&body);
                        if w.write_all(resp.as_bytes()).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        FakeHttp { addr, calls }
    }

    fn calls(&self) -> Vec<HttpCall> {
        self.calls.lock().unwrap().clone()
    }
}

// ---- the round trip and the failure check -----------------------------------------------------

fn stream_name(case: &str) -> String {
    let n = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("creds-{case}-{n}")
}

/// Connects to `url`, then PutRecord and GetRecords of one record on a new stream.
async fn round_trip(url: &str, case: &str) -> Arc<KinesisPlatform> {
    let platform = onceflow_kinesis::connect(url)
        .await
        .unwrap_or_else(|e| panic!("{case}: connect to {url}: {e}"));
    assert_no_secret("Debug of the platform", &format!("{platform:?}"));
    assert_no_secret("Debug of the options", &format!("{:?}", platform.options()));
    let stream = stream_name(case);
    let shards = platform.shards(&stream).await.expect("stream created");
    let client = platform.client();
    let payload = format!("hello from {case}");
    client
        .put_record()
        .stream_name(&stream)
        .partition_key("k")
        .data(Blob::new(payload.as_bytes()))
        .send()
        .await
        .expect("PutRecord");
    let it = client
        .get_shard_iterator()
        .stream_name(&stream)
        .shard_id(&shards[0].id)
        .shard_iterator_type(ShardIteratorType::TrimHorizon)
        .send()
        .await
        .expect("GetShardIterator");
    let got = client
        .get_records()
        .shard_iterator(it.shard_iterator().unwrap())
        .send()
        .await
        .expect("GetRecords");
    let data: Vec<&[u8]> = got.records().iter().map(|r| r.data().as_ref()).collect();
    assert_eq!(data, [payload.as_bytes()], "{case}: the record read back");
    let _ = client
        .delete_stream()
        .stream_name(&stream)
        .enforce_consumer_deletion(true)
        .send()
        .await;
    platform
}

/// Connects to `url` and sends one call; expects an `Auth` error within 15 s whose message
/// names `names`, and no secret in its text or Debug. Prints how long it took.
async fn expect_auth(url: &str, case: &str, names: &[&str]) -> Error {
    let t0 = Instant::now();
    let r = match onceflow_kinesis::connect(url).await {
        Ok(p) => p.shards(&stream_name(case)).await.map(|_| ()),
        Err(e) => Err(e),
    };
    let ms = t0.elapsed().as_millis();
    let e = r.expect_err(case);
    eprintln!("AUTH {case} failed in {ms} ms: {e}");
    assert_eq!(e.kind(), ErrorKind::Auth, "{case}: {e}");
    assert!(ms < 15_000, "{case}: took {ms} ms");
    for n in names {
        assert!(e.message().contains(n), "{case}: '{n}' not named in: {e}");
    }
    assert_no_secret("an error", &e.to_string());
    assert_no_secret("an error's Debug", &format!("{e:?}"));
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        assert_no_secret("an error's source", &s.to_string());
        src = s.source();
    }
    e
}

// ---- the cases --------------------------------------------------------------------------------

/// (a) `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`, signed for
/// `region=`; the fixed local keys are not used when the environment has keys, and are used
/// (only) when nothing is configured or `dummy_credentials=true` asks for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environment_credentials() {
    let Some(upstream) = emulator("environment_credentials") else {
        return;
    };
    capture_logs();
    let env = Env::clean().await;
    env.set("AWS_ACCESS_KEY_ID", "AKIAENVTEST00000001");
    env.set("AWS_SECRET_ACCESS_KEY", "env-secret-Qx7");
    env.set("AWS_SESSION_TOKEN", "env-session-token-Qx7");
    let proxy = Proxy::start(upstream).await;
    round_trip(&proxy.url("region=eu-west-1"), "env").await;
    proxy.assert_signed(
        "AKIAENVTEST00000001",
        "eu-west-1",
        Some("env-session-token-Qx7"),
    );

    // AWS_REGION is the region when the URL gives none.
    env.set("AWS_REGION", "ap-northeast-1");
    let proxy = Proxy::start(upstream).await;
    round_trip(&proxy.url("lease_ms=1000"), "env-region").await;
    proxy.assert_signed(
        "AKIAENVTEST00000001",
        "ap-northeast-1",
        Some("env-session-token-Qx7"),
    );

    // dummy_credentials=true: the fixed keys, whatever the environment holds.
    let proxy = Proxy::start(upstream).await;
    round_trip(
        &proxy.url("region=eu-west-1&dummy_credentials=true"),
        "dummy",
    )
    .await;
    proxy.assert_signed("onceflow-local", "eu-west-1", None);

    // Nothing configured at all, loopback endpoint: the fixed keys, us-east-1.
    for k in [
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_REGION",
    ] {
        std::env::remove_var(k);
    }
    let proxy = Proxy::start(upstream).await;
    round_trip(&proxy.url("lease_ms=1000"), "nothing").await;
    proxy.assert_signed("onceflow-local", "us-east-1", None);
    drop(env);
    assert_logs_clean();
}

/// (b) A named profile of temporary shared files: `profile=` (which wins over environment
/// keys, and gives its region) and `AWS_PROFILE`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn profile_credentials() {
    let Some(upstream) = emulator("profile_credentials") else {
        return;
    };
    capture_logs();
    let env = Env::clean().await;
    env.write(
        "config",
        "[default]\nregion = us-west-1\n\n[profile onceflow-test]\nregion = ap-southeast-2\n",
    );
    env.write(
        "credentials",
        "[default]\naws_access_key_id = AKIADEFAULT00000001\naws_secret_access_key = profile-secret-Qx7\n\n\
         [onceflow-test]\naws_access_key_id = AKIAPROFILE00000001\naws_secret_access_key = profile-secret-Qx7\n",
    );
    env.set("AWS_ACCESS_KEY_ID", "AKIAENVNOTUSED00001");
    env.set("AWS_SECRET_ACCESS_KEY", "env-secret-Qx7");
    let proxy = Proxy::start(upstream).await;
    round_trip(&proxy.url("profile=onceflow-test"), "profile").await;
    proxy.assert_signed("AKIAPROFILE00000001", "ap-southeast-2", None);

    // region= beats the profile's region.
    let proxy = Proxy::start(upstream).await;
    round_trip(
        &proxy.url("profile=onceflow-test&region=eu-north-1"),
        "profile-region",
    )
    .await;
    proxy.assert_signed("AKIAPROFILE00000001", "eu-north-1", None);

    // AWS_PROFILE, no environment keys: the chain's profile step, and its region.
    std::env::remove_var("AWS_ACCESS_KEY_ID");
    std::env::remove_var("AWS_SECRET_ACCESS_KEY");
    env.set("AWS_PROFILE", "onceflow-test");
    let proxy = Proxy::start(upstream).await;
    round_trip(&proxy.url("lease_ms=1000"), "aws-profile").await;
    proxy.assert_signed("AKIAPROFILE00000001", "ap-southeast-2", None);

    // Neither: the default profile, before the fixed keys.
    std::env::remove_var("AWS_PROFILE");
    let proxy = Proxy::start(upstream).await;
    round_trip(&proxy.url("lease_ms=1000"), "default-profile").await;
    proxy.assert_signed("AKIADEFAULT00000001", "us-west-1", None);
    drop(env);
    assert_logs_clean();
}

/// (c) `credential_process` in a profile: a script written here prints the credentials JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credential_process() {
    let Some(upstream) = emulator("credential_process") else {
        return;
    };
    capture_logs();
    let env = Env::clean().await;
    let script = env.script(
        "creds.sh",
        r#"{"Version": 1, "AccessKeyId": "AKIAPROCESS00000001", "SecretAccessKey": "proc-secret-Qx7", "SessionToken": "proc-session-token-Qx7", "Expiration": "2099-01-01T00:00:00Z"}"#,
        "",
        0,
    );
    env.write(
        "config",
        &format!("[profile proc]\nregion = ca-central-1\ncredential_process = {script}\n"),
    );
    let proxy = Proxy::start(upstream).await;
    round_trip(&proxy.url("profile=proc&region=us-west-2"), "process").await;
    proxy.assert_signed(
        "AKIAPROCESS00000001",
        "us-west-2",
        Some("proc-session-token-Qx7"),
    );
    drop(env);
    assert_logs_clean();
}

/// (d) Web identity (IRSA: `AWS_WEB_IDENTITY_TOKEN_FILE` + `AWS_ROLE_ARN`) and an assumed
/// role (`role_arn=`), their STS calls answered by a loopback fake STS named by
/// `AWS_ENDPOINT_URL_STS`: this checks the request the SDK sends through onceflow's wiring
/// and that the returned credentials sign the Kinesis calls, not AWS's STS itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn web_identity_and_assumed_role() {
    let Some(upstream) = emulator("web_identity_and_assumed_role") else {
        return;
    };
    capture_logs();
    let env = Env::clean().await;

    // Web identity.
    let sts = FakeSts::start(false).await;
    let token = env.write("token", "web-identity-token-Qx7");
    env.set("AWS_WEB_IDENTITY_TOKEN_FILE", &token);
    env.set("AWS_ROLE_ARN", "arn:aws:iam::000000000000:role/irsa");
    env.set("AWS_ROLE_SESSION_NAME", "onceflow-irsa");
    env.set("AWS_ENDPOINT_URL_STS", &sts.endpoint());
    let proxy = Proxy::start(upstream).await;
    round_trip(&proxy.url("region=eu-central-1"), "web-identity").await;
    proxy.assert_signed(STS_AKID, "eu-central-1", Some("sts-session-token-Qx7"));
    let calls = sts.calls();
    assert_eq!(calls.len(), 1, "one AssumeRoleWithWebIdentity: {calls:?}");
    let f = &calls[0].form;
    assert_eq!(f["Action"], "AssumeRoleWithWebIdentity");
    assert_eq!(f["Version"], "2011-06-15");
    assert_eq!(f["RoleArn"], "arn:aws:iam::000000000000:role/irsa");
    assert_eq!(f["RoleSessionName"], "onceflow-irsa");
    assert_eq!(f["WebIdentityToken"], "web-identity-token-Qx7");
    eprintln!("STS web identity form keys: {:?}", {
        let mut k: Vec<_> = f.keys().collect();
        k.sort();
        k
    });
    for k in [
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_ROLE_ARN",
        "AWS_ROLE_SESSION_NAME",
    ] {
        std::env::remove_var(k);
    }

    // Assumed role, the caller's credentials from the environment.
    let sts = FakeSts::start(false).await;
    env.set("AWS_ENDPOINT_URL_STS", &sts.endpoint());
    env.set("AWS_ACCESS_KEY_ID", "AKIABASE00000000001");
    env.set("AWS_SECRET_ACCESS_KEY", "base-secret-Qx7");
    let proxy = Proxy::start(upstream).await;
    round_trip(
        &proxy.url(
            "region=eu-central-1&role_arn=arn:aws:iam::000000000000:role/app\
             &role_session_name=onceflow-assume&external_id=ext-id-Qx7&role_duration_s=900",
        ),
        "assume-role",
    )
    .await;
    proxy.assert_signed(STS_AKID, "eu-central-1", Some("sts-session-token-Qx7"));
    let calls = sts.calls();
    assert_eq!(calls.len(), 1, "one AssumeRole: {calls:?}");
    let f = &calls[0].form;
    assert_eq!(f["Action"], "AssumeRole");
    assert_eq!(f["Version"], "2011-06-15");
    assert_eq!(f["RoleArn"], "arn:aws:iam::000000000000:role/app");
    assert_eq!(f["RoleSessionName"], "onceflow-assume");
    assert_eq!(f["ExternalId"], "ext-id-Qx7");
    assert_eq!(f["DurationSeconds"], "900");
    let auth = calls[0]
        .headers
        .get("authorization")
        .cloned()
        .unwrap_or_default();
    let scope = format!(
        "Credential=AKIABASE00000000001/{}/eu-central-1/sts/aws4_request",
        utc_date(0)
    );
    assert!(
        auth.contains(&scope),
        "AssumeRole signed with the caller's keys: {auth}"
    );
    eprintln!("STS AssumeRole signed with {scope}");

    // STS refuses: an Auth error naming the role, quickly.
    let sts = FakeSts::start(true).await;
    env.set("AWS_ENDPOINT_URL_STS", &sts.endpoint());
    let proxy = Proxy::start(upstream).await;
    expect_auth(
        &proxy.url("region=eu-central-1&role_arn=arn:aws:iam::000000000000:role/app"),
        "assume-role-refused",
        &["arn:aws:iam::000000000000:role/app"],
    )
    .await;
    drop(env);
    assert_logs_clean();
}

/// (e) Credentials that fail: each an `Auth` error within seconds, naming the profile or
/// provider, with no secret in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credential_failures() {
    let Some(upstream) = emulator("credential_failures") else {
        return;
    };
    capture_logs();
    let env = Env::clean().await;
    let failing = env.script("fail.sh", "", "token expired: run the login tool", 3);
    let garbled = env.script(
        "garbled.sh",
        r#"{"Version": 1, "AccessKeyId": "AKIABAD", "SecretAccessKey": "bad-json-secret-Qx7""#,
        "",
        0,
    );
    let no_version = env.script(
        "noversion.sh",
        r#"{"AccessKeyId": "AKIABAD", "SecretAccessKey": "bad-json-secret-Qx7"}"#,
        "",
        0,
    );
    env.write(
        "config",
        &format!(
            "[profile failing]\ncredential_process = {failing}\n\n\
             [profile garbled]\ncredential_process = {garbled}\n\n\
             [profile noversion]\ncredential_process = {no_version}\n"
        ),
    );
    let proxy = Proxy::start(upstream).await;
    let e = expect_auth(
        &proxy.url("profile=failing"),
        "process-exits-3",
        &["profile 'failing'"],
    )
    .await;
    assert!(
        e.message().contains("token expired"),
        "the process's stderr: {e}"
    );
    expect_auth(
        &proxy.url("profile=garbled"),
        "process-bad-json",
        &["profile 'garbled'"],
    )
    .await;
    expect_auth(
        &proxy.url("profile=noversion"),
        "process-no-version",
        &["profile 'noversion'"],
    )
    .await;
    expect_auth(
        &proxy.url("profile=nope"),
        "missing-profile",
        &["profile 'nope'", "nope"],
    )
    .await;

    // AWS_PROFILE naming a missing profile is an error, not a reason for the fixed keys.
    env.set("AWS_PROFILE", "nope-env");
    expect_auth(
        &proxy.url("lease_ms=1000"),
        "missing-aws-profile",
        &["nope-env"],
    )
    .await;
    std::env::remove_var("AWS_PROFILE");

    // No credentials anywhere, and the fixed keys refused (dummy_credentials=false).
    expect_auth(
        &proxy.url("dummy_credentials=false"),
        "no-credentials",
        &["default credential chain"],
    )
    .await;

    // An access key id without its secret: an error, not the fixed keys.
    env.set("AWS_ACCESS_KEY_ID", "AKIAHALF00000000001");
    expect_auth(
        &proxy.url("lease_ms=1000"),
        "env-key-without-secret",
        &["AWS_ACCESS_KEY_ID"],
    )
    .await;
    std::env::remove_var("AWS_ACCESS_KEY_ID");

    let seen = proxy.seen();
    assert!(
        seen.is_empty(),
        "nothing was sent unsigned or with other keys: {seen:?}"
    );
    drop(env);
    assert_logs_clean();
    let mut out = std::io::stderr();
    let _ = out.flush();
}

/// The container (ECS / EKS Pod Identity: `AWS_CONTAINER_CREDENTIALS_FULL_URI` +
/// `AWS_CONTAINER_AUTHORIZATION_TOKEN`) and instance metadata (IMDSv2,
/// `AWS_EC2_METADATA_SERVICE_ENDPOINT`) steps of the chain, each answered by a loopback fake
/// of that endpoint (the shapes the AWS SDK reference gives): this checks that the chain asks
/// them and signs with what they return, not the real ECS agent or IMDS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_and_instance_metadata() {
    let Some(upstream) = emulator("container_and_instance_metadata") else {
        return;
    };
    capture_logs();
    let env = Env::clean().await;

    // Container credentials.
    let creds = |akid: &str, secret: &str, token: &str| {
        format!(
            r#"{{"Code": "Success", "Type": "AWS-HMAC", "LastUpdated": "2024-01-01T00:00:00Z", "AccessKeyId": "{akid}", "SecretAccessKey": "{secret}", "Token": "{token}", "Expiration": "2099-01-01T00:00:00Z"}}"#
        )
    };
    let body = creds(
        "ASIACONTAINER000001",
        "container-secret-Qx7",
        "container-session-token-Qx7",
    );
    let ecs = FakeHttp::start(Arc::new(move |_| ("200 OK", body.clone(), vec![]))).await;
    env.set(
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        &format!("http://{}/v2/credentials/onceflow", ecs.addr),
    );
    env.set(
        "AWS_CONTAINER_AUTHORIZATION_TOKEN",
        "container-auth-token-Qx7",
    );
    let proxy = Proxy::start(upstream).await;
    round_trip(&proxy.url("region=sa-east-1"), "container").await;
    proxy.assert_signed(
        "ASIACONTAINER000001",
        "sa-east-1",
        Some("container-session-token-Qx7"),
    );
    let calls = ecs.calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(
        (calls[0].method.as_str(), calls[0].path.as_str()),
        ("GET", "/v2/credentials/onceflow")
    );
    assert_eq!(
        calls[0].headers.get("authorization").map(String::as_str),
        Some("container-auth-token-Qx7")
    );
    std::env::remove_var("AWS_CONTAINER_CREDENTIALS_FULL_URI");
    std::env::remove_var("AWS_CONTAINER_AUTHORIZATION_TOKEN");

    // Instance metadata (IMDSv2): a session token, the role's name, its credentials. Only
    // with dummy_credentials=false for a loopback Kinesis endpoint (the full default chain).
    let body = creds(
        "ASIAINSTANCE0000001",
        "imds-secret-Qx7",
        "imds-session-token-Qx7",
    );
    let imds = FakeHttp::start(Arc::new(move |c: &HttpCall| {
        let token_ok = c
            .headers
            .get("x-aws-ec2-metadata-token")
            .map(String::as_str)
            == Some("imds-api-token-Qx7");
        match (c.method.as_str(), c.path.as_str()) {
            ("PUT", "/latest/api/token") => (
                "200 OK",
                "imds-api-token-Qx7".to_string(),
                vec![("x-aws-ec2-metadata-token-ttl-seconds", "21600".to_string())],
            ),
            ("GET", "/latest/meta-data/iam/security-credentials/") if token_ok => {
                ("200 OK", "onceflow-role".to_string(), vec![])
            }
            ("GET", "/latest/meta-data/iam/security-credentials/onceflow-role") if token_ok => {
                ("200 OK", body.clone(), vec![])
            }
            _ => ("404 Not Found", String::new(), vec![]),
        }
    }))
    .await;
    std::env::remove_var("AWS_EC2_METADATA_DISABLED");
    env.set(
        "AWS_EC2_METADATA_SERVICE_ENDPOINT",
        &format!("http://{}/", imds.addr),
    );
    let proxy = Proxy::start(upstream).await;
    round_trip(
        &proxy.url("region=us-east-2&dummy_credentials=false"),
        "imds",
    )
    .await;
    proxy.assert_signed(
        "ASIAINSTANCE0000001",
        "us-east-2",
        Some("imds-session-token-Qx7"),
    );
    let paths: Vec<String> = imds
        .calls()
        .iter()
        .map(|c| format!("{} {}", c.method, c.path))
        .collect();
    eprintln!("IMDS requests: {paths:?}");
    assert_eq!(paths[0], "PUT /latest/api/token", "{paths:?}");
    assert!(
        paths.contains(&"GET /latest/meta-data/iam/security-credentials/onceflow-role".to_string()),
        "{paths:?}"
    );

    // Without dummy_credentials=false a loopback endpoint does not ask instance metadata:
    // with nothing else configured, the fixed local keys sign.
    let before = imds.calls().len();
    let proxy = Proxy::start(upstream).await;
    round_trip(&proxy.url("region=us-east-2"), "imds-not-asked").await;
    proxy.assert_signed("onceflow-local", "us-east-2", None);
    assert_eq!(
        imds.calls().len(),
        before,
        "instance metadata asked for a loopback endpoint"
    );
    drop(env);
    assert_logs_clean();
}
