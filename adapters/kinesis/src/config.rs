//! The `kinesis://` URL and its options.

use std::time::Duration;

use onceflow_core::{Error, Result};

/// Options of a Kinesis connection, from the URL
/// `kinesis://[host:port][?key=value&…]`.
///
/// - `host:port`: endpoint override (a local Kinesis-compatible server such as kinesis-local);
///   without it the SDK's regional AWS endpoint is used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KinesisOptions {
    /// Endpoint override, e.g. `http://127.0.0.1:14567`; `None` = AWS's regional endpoint.
    pub endpoint: Option<String>,
    /// AWS region (`region=`); `None` = the SDK's default chain (`AWS_REGION`, profile).
    pub region: Option<String>,
    /// Use fixed dummy credentials instead of the standard credential chain (`dummy_credentials=`;
    /// default: on for a loopback endpoint when `AWS_ACCESS_KEY_ID` is unset, off otherwise).
    pub dummy_credentials: bool,
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
            dummy_credentials: false,
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
    let mut tls = false;
    let mut dummy: Option<bool> = None;
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
            "region" => o.region = Some(v.to_string()).filter(|r| !r.is_empty()),
            "tls" => tls = boolean(&v)?,
            "dummy_credentials" => dummy = Some(boolean(&v)?),
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
                     dummy_credentials, checkpoint_store, lease_ms, shards, auto_create, \
                     fetch_limit, idle_ms, put_attempts, buffer, fan_out, efo_consumer or \
                     timeout_ms"
                )))
            }
        }
    }
    if let Some(h) = &host {
        let port = parsed.port().unwrap_or(if tls { 443 } else { 80 });
        let scheme = if tls { "https" } else { "http" };
        o.endpoint = Some(format!("{scheme}://{h}:{port}"));
    }
    o.dummy_credentials = dummy.unwrap_or_else(|| {
        host.as_deref().is_some_and(is_loopback) && std::env::var_os("AWS_ACCESS_KEY_ID").is_none()
    });
    Ok(o)
}

/// Query keys whose values [`redact`] shows: the options that never hold a secret.
const SHOWN_OPTIONS: &[&str] = &[
    "region",
    "tls",
    "dummy_credentials",
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
        assert!(!aws.dummy_credentials);
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
}
