//! The `kinesis://` URL and its options.

use std::time::Duration;

use onceflow_core::{Error, Result};

/// Options of a Kinesis connection, from the URL
/// `kinesis://[host:port][?key=value&…]` (see the crate docs for every key and the AWS
/// documentation each follows).
///
/// - `host:port`: endpoint override (a local Kinesis-compatible server such as kinesis-local);
///   without it (and without `endpoint=`) the SDK's regional AWS endpoint is used.
///
/// `Debug` shows no secret: the `checkpoint_store` URL's password and the `external_id` are
/// hidden. Credentials themselves are never options (they come from the AWS credential
/// chain).
#[derive(Clone, PartialEq, Eq)]
pub struct KinesisOptions {
    /// Endpoint override, e.g. `http://127.0.0.1:14567` (from `host:port` with `tls=`, or
    /// `endpoint=`); `None` = AWS's regional endpoint (or the SDK's configured endpoint,
    /// `AWS_ENDPOINT_URL_KINESIS` / `AWS_ENDPOINT_URL`).
    pub endpoint: Option<String>,
    /// AWS region (`region=`); `None` = the SDK's region chain (`AWS_REGION`, the profile's
    /// `region`, and, for AWS's own endpoint only, instance metadata); with an endpoint
    /// override and no region found, `us-east-1`.
    pub region: Option<String>,
    /// Fixed local test keys instead of the credential chain (`dummy_credentials=`):
    /// `Some(true)` = always those keys; `Some(false)` = the SDK's full default chain, never
    /// the keys; `None` (default) = the chain, and only for a loopback endpoint, when the
    /// chain finds no credentials at all (no environment keys, no profile, no web identity,
    /// no container credentials; instance metadata is not asked), the fixed keys.
    pub dummy_credentials: Option<bool>,
    /// Named profile of the shared config and credentials files (`profile=`): credentials
    /// come from that profile only (its static keys, `credential_process`, `role_arn` +
    /// `source_profile`, `web_identity_token_file`, or SSO), not from environment keys, and
    /// its `region` is used when `region=` is absent. `None` = the chain (`AWS_PROFILE` or
    /// `default`).
    pub profile: Option<String>,
    /// Role to assume through STS AssumeRole (`role_arn=`), with the credentials found as
    /// above as the caller's.
    pub role_arn: Option<String>,
    /// `RoleSessionName` of the assumed role (`role_session_name=`, 2-64 characters
    /// `[\w+=,.@-]`); `None` = the SDK's (`assume-role-provider-<time>`).
    pub role_session_name: Option<String>,
    /// `ExternalId` of the assumed role (`external_id=`, 2-1224 characters `[\w+=,.@:/-]`).
    pub external_id: Option<String>,
    /// Lifetime of the assumed role's session (`role_duration_s=`, 900 to 43 200 s); `None` =
    /// STS's default (one hour).
    pub role_duration: Option<Duration>,
    /// Lease table store URL (`checkpoint_store=`): `memory://` (default: one table shared by
    /// the consumers of this connection), `embedded:///path.db` or a file path (shared by the
    /// processes of one machine), or a Redis / PostgreSQL URL where the facade opens them.
    pub checkpoint_store: Option<String>,
    /// How long a shard lease holds without renewal (`lease_ms=`, default 10 000). A worker that
    /// dies loses its shards this long after its last renewal.
    pub lease: Duration,
    /// Shards of a stream created automatically or by `create_topic` without a count
    /// (`shards=`, default 1).
    pub shards: u32,
    /// Create a missing stream on first use (`auto_create=`, default true).
    pub auto_create: bool,
    /// Records asked for per GetRecords call (`fetch_limit=`, 1..=10000, default 1000).
    pub fetch_limit: i32,
    /// Pause after an empty GetRecords on a shard (`idle_ms=`, default 250; AWS allows five
    /// GetRecords per shard and second).
    pub idle: Duration,
    /// Attempts of a PutRecords entry that keeps failing with throttling or an internal error
    /// (`put_attempts=`, default 8), with exponential backoff from 50 ms.
    pub put_attempts: usize,
    /// Records buffered per shard before fetching pauses (`buffer=`, default 10 000).
    pub buffer: usize,
    /// How the consumer reads shards (`fan_out=poll|efo|auto`, default `poll`).
    pub fan_out: FanOut,
    /// Name of the registered stream consumer used for enhanced fan-out (`efo_consumer=`);
    /// `None` = the consumer group's name. One name is one registered consumer per stream (AWS
    /// allows 20), shared by every member of the group.
    pub efo_consumer: Option<String>,
    /// Longest wait for the answer to one Kinesis API call, retries included (`timeout_ms=`,
    /// 100 to 3 600 000, default 10 000): an endpoint that accepts connections but never answers fails with a
    /// `Timeout` error instead of hanging. A [SubscribeToShard] call is bounded only until its
    /// event stream starts; the stream itself runs for its 5 minutes.
    ///
    /// [SubscribeToShard]: https://docs.aws.amazon.com/kinesis/latest/APIReference/API_SubscribeToShard.html
    pub timeout: Duration,
}

impl std::fmt::Debug for KinesisOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KinesisOptions")
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("dummy_credentials", &self.dummy_credentials)
            .field("profile", &self.profile)
            .field("role_arn", &self.role_arn)
            .field("role_session_name", &self.role_session_name)
            .field("external_id", &self.external_id.as_ref().map(|_| "…"))
            .field("role_duration", &self.role_duration)
            .field(
                "checkpoint_store",
                &self
                    .checkpoint_store
                    .as_deref()
                    .map(onceflow_core::redact_url),
            )
            .field("lease", &self.lease)
            .field("shards", &self.shards)
            .field("auto_create", &self.auto_create)
            .field("fetch_limit", &self.fetch_limit)
            .field("idle", &self.idle)
            .field("put_attempts", &self.put_attempts)
            .field("buffer", &self.buffer)
            .field("fan_out", &self.fan_out)
            .field("efo_consumer", &self.efo_consumer)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl KinesisOptions {
    /// Whether the endpoint override names this machine (`localhost`, `127.0.0.0/8`, `::1`):
    /// then instance metadata is not asked for credentials or region, and the fixed local test
    /// keys are the last resort of the credential chain (see
    /// [`dummy_credentials`](Self::dummy_credentials)).
    pub fn endpoint_is_loopback(&self) -> bool {
        self.endpoint
            .as_deref()
            .and_then(|e| url::Url::parse(e).ok())
            .is_some_and(|u| u.host_str().is_some_and(is_loopback))
    }
}

/// How a Kinesis consumer reads its shards.
///
/// - [`FanOut::Poll`]: shared throughput, GetShardIterator + GetRecords (2 MiB/s per shard
///   shared by every polling consumer, five calls per shard and second).
/// - [`FanOut::Efo`]: enhanced fan-out, a registered stream consumer
///   ([RegisterStreamConsumer]) and one [SubscribeToShard] event stream per held shard (a
///   dedicated 2 MiB/s per shard and consumer, records pushed as they arrive). If the server
///   does not implement it, joining the group (or the first subscription) fails with an
///   `Unsupported` error naming what the server answered.
/// - [`FanOut::Auto`]: enhanced fan-out where the server supports it, else polling (logged once
///   with the reason).
///
/// [RegisterStreamConsumer]: https://docs.aws.amazon.com/kinesis/latest/APIReference/API_RegisterStreamConsumer.html
/// [SubscribeToShard]: https://docs.aws.amazon.com/kinesis/latest/APIReference/API_SubscribeToShard.html
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FanOut {
    /// GetRecords polling (`fan_out=poll`, the default).
    #[default]
    Poll,
    /// Enhanced fan-out, or an `Unsupported` error (`fan_out=efo`).
    Efo,
    /// Enhanced fan-out where supported, else polling (`fan_out=auto`).
    Auto,
}

impl Default for KinesisOptions {
    fn default() -> Self {
        KinesisOptions {
            endpoint: None,
            region: None,
            dummy_credentials: None,
            profile: None,
            role_arn: None,
            role_session_name: None,
            external_id: None,
            role_duration: None,
            checkpoint_store: None,
            lease: Duration::from_secs(10),
            shards: 1,
            auto_create: true,
            fetch_limit: 1000,
            idle: Duration::from_millis(250),
            put_attempts: 8,
            buffer: 10_000,
            fan_out: FanOut::Poll,
            efo_consumer: None,
            timeout: Duration::from_secs(10),
        }
    }
}

fn is_loopback(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    h == "localhost"
        || h.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Parses `kinesis://[host:port][?key=value&…]`. Unknown keys and bad values are a `Config`
/// error naming them.
pub fn parse_url(url: &str) -> Result<KinesisOptions> {
    let shown = redact(url);
    let parsed = url::Url::parse(url).map_err(|e| {
        Error::config(format!(
            "invalid Kinesis URL '{shown}': {e}; expected kinesis://[host:port][?region=…]"
        ))
    })?;
    if parsed.scheme() != "kinesis" {
        return Err(Error::config(format!(
            "URL '{shown}' is not a Kinesis URL: expected the scheme kinesis://"
        )));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(Error::config(format!(
            "Kinesis URL '{shown}' carries credentials: use the AWS credential chain \
             (environment, profile, instance role) instead"
        )));
    }
    let mut o = KinesisOptions::default();
    let mut tls: Option<bool> = None;
    let mut endpoint: Option<String> = None;
    let host = parsed
        .host_str()
        .filter(|h| !h.is_empty())
        .map(String::from);
    for (k, v) in parsed.query_pairs() {
        let bad = |what: &str| {
            Error::config(format!(
                "option {k}='{v}' in Kinesis URL '{shown}': expected {what}"
            ))
        };
        let boolean = |v: &str| match v {
            "true" | "1" | "yes" => Ok(true),
            "false" | "0" | "no" => Ok(false),
            _ => Err(bad("true or false")),
        };
        match &*k {
            "region" => {
                if v.is_empty() || v.chars().any(|c| c.is_whitespace() || c.is_control()) {
                    return Err(bad("an AWS region name such as us-east-1"));
                }
                o.region = Some(v.to_string());
            }
            "tls" => tls = Some(boolean(&v)?),
            "endpoint" => endpoint = Some(parse_endpoint(&v, &shown)?),
            "dummy_credentials" => o.dummy_credentials = Some(boolean(&v)?),
            "profile" => {
                if v.is_empty() || v.chars().any(|c| c.is_whitespace() || c.is_control()) {
                    return Err(bad("a profile name (no spaces)"));
                }
                o.profile = Some(v.to_string());
            }
            "role_arn" => {
                // arn:partition:service:region:account:resource, e.g.
                // arn:aws:iam::123456789012:role/name.
                let parts: Vec<&str> = v.splitn(6, ':').collect();
                if parts.len() != 6 || parts[0] != "arn" || parts[2] != "iam" || parts[5].is_empty()
                {
                    return Err(bad("an IAM role ARN, arn:aws:iam::<account>:role/<name>"));
                }
                o.role_arn = Some(v.to_string());
            }
            "role_session_name" => {
                let valid = (2..=64).contains(&v.len())
                    && v.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"_+=,.@-".contains(&b));
                if !valid {
                    return Err(bad(
                        "a session name of 2 to 64 characters [A-Za-z0-9_+=,.@-]",
                    ));
                }
                o.role_session_name = Some(v.to_string());
            }
            "external_id" => {
                let valid = (2..=1224).contains(&v.len())
                    && v.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"_+=,.@:/-".contains(&b));
                if !valid {
                    // The value is not repeated: an external id is best kept out of logs.
                    return Err(Error::config(format!(
                        "option external_id in Kinesis URL '{shown}': expected 2 to 1224 \
                         characters [A-Za-z0-9_+=,.@:/-]"
                    )));
                }
                o.external_id = Some(v.to_string());
            }
            "role_duration_s" => {
                o.role_duration = Some(Duration::from_secs(
                    v.parse()
                        .ok()
                        .filter(|n| (900..=43_200).contains(n))
                        .ok_or_else(|| bad("a session duration in seconds from 900 to 43200"))?,
                ))
            }
            "checkpoint_store" => o.checkpoint_store = Some(v.to_string()),
            "lease_ms" => {
                o.lease = Duration::from_millis(
                    v.parse()
                        .ok()
                        .filter(|n| *n >= 100)
                        .ok_or_else(|| bad("a lease duration in ms of at least 100"))?,
                )
            }
            "shards" => {
                o.shards = v
                    .parse()
                    .ok()
                    .filter(|n| *n >= 1)
                    .ok_or_else(|| bad("a shard count of at least 1"))?
            }
            "auto_create" => o.auto_create = boolean(&v)?,
            "fetch_limit" => {
                o.fetch_limit = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=10_000).contains(n))
                    .ok_or_else(|| bad("a record count from 1 to 10000"))?
            }
            "idle_ms" => {
                o.idle = Duration::from_millis(v.parse().map_err(|_| bad("milliseconds"))?)
            }
            "put_attempts" => {
                o.put_attempts = v
                    .parse()
                    .ok()
                    .filter(|n| *n >= 1)
                    .ok_or_else(|| bad("a number of attempts of at least 1"))?
            }
            "buffer" => {
                o.buffer = v
                    .parse()
                    .ok()
                    .filter(|n| *n >= 1)
                    .ok_or_else(|| bad("a number of records of at least 1"))?
            }
            "fan_out" => {
                o.fan_out = match &*v {
                    "poll" => FanOut::Poll,
                    "efo" => FanOut::Efo,
                    "auto" => FanOut::Auto,
                    _ => return Err(bad("poll, efo or auto")),
                }
            }
            "timeout_ms" => {
                o.timeout = Duration::from_millis(
                    v.parse()
                        .ok()
                        .filter(|n| (100..=3_600_000).contains(n))
                        .ok_or_else(|| bad("a timeout in ms from 100 to 3600000 (1 hour)"))?,
                )
            }
            "efo_consumer" => {
                let valid = (1..=128).contains(&v.len())
                    && v.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
                if !valid {
                    return Err(bad("a consumer name of 1 to 128 characters [a-zA-Z0-9_.-]"));
                }
                o.efo_consumer = Some(v.to_string());
            }
            other => {
                return Err(Error::config(format!(
                    "unknown option '{other}' in Kinesis URL '{shown}': expected region, tls, \
                     endpoint, dummy_credentials, profile, role_arn, role_session_name, \
                     external_id, role_duration_s, checkpoint_store, lease_ms, shards, \
                     auto_create, fetch_limit, idle_ms, put_attempts, buffer, fan_out, \
                     efo_consumer or timeout_ms"
                )))
            }
        }
    }
    if (o.role_session_name.is_some() || o.external_id.is_some() || o.role_duration.is_some())
        && o.role_arn.is_none()
    {
        return Err(Error::config(format!(
            "Kinesis URL '{shown}': role_session_name, external_id and role_duration_s apply \
             to an assumed role: add role_arn="
        )));
    }
    match (&host, endpoint) {
        (Some(_), Some(_)) => {
            return Err(Error::config(format!(
                "Kinesis URL '{shown}' names the endpoint twice (host:port and endpoint=): \
                 give one"
            )))
        }
        (None, Some(e)) => {
            if tls.is_some() {
                return Err(Error::config(format!(
                    "Kinesis URL '{shown}': tls= applies to host:port; with endpoint= the \
                     scheme (http:// or https://) says it"
                )));
            }
            o.endpoint = Some(e);
        }
        (Some(h), None) => {
            let tls = tls.unwrap_or(false);
            let port = parsed.port().unwrap_or(if tls { 443 } else { 80 });
            let scheme = if tls { "https" } else { "http" };
            o.endpoint = Some(format!("{scheme}://{h}:{port}"));
        }
        (None, None) => {}
    }
    Ok(o)
}

/// An `endpoint=` value: an `http://` or `https://` URL with a host and no user info (the
/// endpoint URL of the [AWS SDKs' endpoint configuration]).
///
/// [AWS SDKs' endpoint configuration]: https://docs.aws.amazon.com/sdkref/latest/guide/feature-ss-endpoints.html
fn parse_endpoint(v: &str, shown: &str) -> Result<String> {
    let bad = |why: &str| {
        Error::config(format!(
            "option endpoint='{}' in Kinesis URL '{shown}': {why}",
            onceflow_core::shown(&onceflow_core::redact_url(v))
        ))
    };
    let u = url::Url::parse(v).map_err(|e| bad(&format!("not a URL ({e})")))?;
    if !matches!(u.scheme(), "http" | "https") {
        return Err(bad("expected an http:// or https:// URL"));
    }
    if u.host_str().is_none_or(str::is_empty) {
        return Err(bad("expected a host"));
    }
    if !u.username().is_empty() || u.password().is_some() {
        return Err(bad(
            "an endpoint carries no credentials (use the AWS credential chain)",
        ));
    }
    if u.query().is_some() || u.fragment().is_some() {
        return Err(bad("an endpoint URL has no query or fragment"));
    }
    Ok(v.trim_end_matches('/').to_string())
}

/// Query keys whose values [`redact`] shows: the options that never hold a secret.
const SHOWN_OPTIONS: &[&str] = &[
    "region",
    "tls",
    "dummy_credentials",
    "profile",
    "role_arn",
    "role_session_name",
    "role_duration_s",
    "lease_ms",
    "shards",
    "auto_create",
    "fetch_limit",
    "idle_ms",
    "put_attempts",
    "buffer",
    "fan_out",
    "efo_consumer",
    "timeout_ms",
];

/// The URL without what could be secret: user info in the authority, the `checkpoint_store`
/// value (a store URL may carry a password) and the value of any key that is not a known
/// option (a misplaced `aws_secret_access_key=`, say), each shown as `…`.
pub(crate) fn redact(url: &str) -> String {
    // Credentials in the authority (`user:password@`) are never shown.
    let url = match url.split_once("://") {
        Some((scheme, rest)) => {
            let end = rest.find(['/', '?']).unwrap_or(rest.len());
            match rest[..end].rfind('@') {
                Some(at) => format!("{scheme}://…@{}", &rest[at + 1..]),
                None => url.to_string(),
            }
        }
        None => url.to_string(),
    };
    let url = url.as_str();
    match url.split_once('?') {
        Some((base, q)) => {
            let parts: Vec<String> = q
                .split('&')
                .map(|kv| match kv.split_once('=') {
                    Some((k, _)) if !SHOWN_OPTIONS.contains(&k) => format!("{k}=…"),
                    _ => kv.to_string(),
                })
                .collect();
            format!("{base}?{}", parts.join("&"))
        }
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_local_and_aws_urls() {
        let o = parse_url("kinesis://127.0.0.1:14567?region=us-east-1&lease_ms=500").unwrap();
        assert_eq!(o.endpoint.as_deref(), Some("http://127.0.0.1:14567"));
        assert_eq!(o.region.as_deref(), Some("us-east-1"));
        assert_eq!(o.lease, Duration::from_millis(500));
        assert_eq!(o.fan_out, FanOut::Poll);
        assert_eq!(o.timeout, Duration::from_secs(10));
        assert_eq!(
            parse_url("kinesis://h:1?timeout_ms=2500").unwrap().timeout,
            Duration::from_millis(2500)
        );
        let efo = parse_url("kinesis://h:1?fan_out=efo&efo_consumer=app-1").unwrap();
        assert_eq!(efo.fan_out, FanOut::Efo);
        assert_eq!(efo.efo_consumer.as_deref(), Some("app-1"));
        assert_eq!(
            parse_url("kinesis://h:1?fan_out=auto").unwrap().fan_out,
            FanOut::Auto
        );
        let aws = parse_url("kinesis://?region=eu-west-1").unwrap();
        assert_eq!(aws.endpoint, None);
        assert_eq!(aws.dummy_credentials, None);
        assert!(!aws.endpoint_is_loopback());
        assert!(parse_url("kinesis://127.0.0.1:1")
            .unwrap()
            .endpoint_is_loopback());
        assert!(parse_url("kinesis://localhost:1")
            .unwrap()
            .endpoint_is_loopback());
        assert!(parse_url("kinesis://[::1]:1")
            .unwrap()
            .endpoint_is_loopback());
        assert!(!parse_url("kinesis://10.0.0.1:1")
            .unwrap()
            .endpoint_is_loopback());
        for bad in [
            "kinesis://h:1?nope=1",
            "kafka://h:1",
            "kinesis://h:1?shards=0",
            "kinesis://u:p@h:1",
            "kinesis://h:1?fan_out=push",
            "kinesis://h:1?efo_consumer=a/b",
            "kinesis://h:1?timeout_ms=50",
            "kinesis://h:1?timeout_ms=soon",
            "kinesis://h:1?timeout_ms=3600001",
            "kinesis://h:1?timeout_ms=18446744073709551615",
        ] {
            let e = parse_url(bad).unwrap_err();
            assert_eq!(e.kind(), onceflow_core::ErrorKind::Config, "{bad}");
            assert!(!e.message().contains(":p@"), "secret shown: {e}");
        }
        assert_eq!(
            redact("kinesis://h:1?checkpoint_store=redis://:pw@h&region=x"),
            "kinesis://h:1?checkpoint_store=…&region=x"
        );
        let e = parse_url("kinesis://h:1?region=x&aws_secret_access_key=AKSECRET").unwrap_err();
        assert!(!e.message().contains("AKSECRET"), "secret shown: {e}");
        assert!(e.message().contains("'aws_secret_access_key'"), "{e}");
    }

    #[test]
    fn parses_credential_and_endpoint_options() {
        let o = parse_url(
            "kinesis://?region=eu-west-1&profile=prod&role_arn=arn:aws:iam::123456789012:role/app\
             &role_session_name=onceflow-1&external_id=ext-SECRET-42&role_duration_s=900\
             &endpoint=https://vpce-1.kinesis.eu-west-1.vpce.amazonaws.com/",
        )
        .unwrap();
        assert_eq!(o.profile.as_deref(), Some("prod"));
        assert_eq!(
            o.role_arn.as_deref(),
            Some("arn:aws:iam::123456789012:role/app")
        );
        assert_eq!(o.role_session_name.as_deref(), Some("onceflow-1"));
        assert_eq!(o.external_id.as_deref(), Some("ext-SECRET-42"));
        assert_eq!(o.role_duration, Some(Duration::from_secs(900)));
        assert_eq!(
            o.endpoint.as_deref(),
            Some("https://vpce-1.kinesis.eu-west-1.vpce.amazonaws.com")
        );
        assert!(!o.endpoint_is_loopback());
        let debug = format!("{o:?}");
        assert!(!debug.contains("ext-SECRET-42"), "{debug}");
        assert!(debug.contains("prod"), "{debug}");
        let local = parse_url("kinesis://?endpoint=http://127.0.0.1:4567").unwrap();
        assert!(local.endpoint_is_loopback());
        assert_eq!(
            parse_url("kinesis://h:1?dummy_credentials=false")
                .unwrap()
                .dummy_credentials,
            Some(false)
        );
        let store = parse_url("kinesis://h:1?checkpoint_store=redis://:pw-SECRET@h:6379").unwrap();
        assert!(!format!("{store:?}").contains("pw-SECRET"), "{store:?}");
        for bad in [
            "kinesis://h:1?endpoint=http://h:2",
            "kinesis://?endpoint=ftp://h",
            "kinesis://?endpoint=http://u:pw-SECRET@h",
            "kinesis://?endpoint=nope",
            "kinesis://?endpoint=https://h&tls=true",
            "kinesis://?profile=",
            "kinesis://?role_arn=role/app",
            "kinesis://?role_arn=arn:aws:s3:::bucket",
            "kinesis://?role_session_name=x",
            "kinesis://?role_arn=arn:aws:iam::1:role/a&role_session_name=a%20b",
            "kinesis://?role_arn=arn:aws:iam::1:role/a&external_id=pw-SECRET%20x",
            "kinesis://?role_arn=arn:aws:iam::1:role/a&role_duration_s=60",
            "kinesis://?external_id=pw-SECRET",
            // An empty region was ignored (the SDK then asked instance metadata for one).
            "kinesis://?region=",
            "kinesis://?region=eu%20west",
        ] {
            let e = parse_url(bad).unwrap_err();
            assert_eq!(e.kind(), onceflow_core::ErrorKind::Config, "{bad}");
            assert!(!e.message().contains("pw-SECRET"), "secret shown: {e}");
        }
    }
}
