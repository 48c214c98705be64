//! `kafka://` URLs and the typed configuration with its raw librdkafka pass-through.

use std::collections::BTreeMap;
use std::time::Duration;

use onceflow_core::{Error, Result};
use rdkafka::ClientConfig;

/// A Kafka broker's default `message.max.bytes`: the largest record batch it takes (1 MiB + 12
/// bytes; also each topic's `max.message.bytes` unless set).
pub const BROKER_DEFAULT_MESSAGE_MAX_BYTES: usize = 1_048_588;

/// Bytes of a record batch (format v2, KIP-98) before its first record.
pub(crate) const RECORD_BATCH_HEADER: usize = 61;

/// Worst-case framing librdkafka counts for one record before it compares it with
/// `message.max.bytes`: `RD_KAFKAP_MESSAGE_V2_MAX_OVERHEAD` (librdkafka `rdkafka_proto.h`:
/// length, attributes, timestamp delta, offset delta, key length, value length and header count,
/// each at its largest varint size).
pub(crate) const RECORD_FRAMING_MAX: usize = 36;

/// Largest record (key + payload + headers) accepted when `message.max.bytes` is not given:
/// 1 048 491 bytes, what fits alone in a batch under a default broker's limit
/// ([`BROKER_DEFAULT_MESSAGE_MAX_BYTES`] less the batch header and the worst-case record
/// framing). Each header adds its varint lengths to what librdkafka and the broker count.
pub const DEFAULT_MAX_RECORD_BYTES: usize =
    BROKER_DEFAULT_MESSAGE_MAX_BYTES - RECORD_BATCH_HEADER - RECORD_FRAMING_MAX;

/// Default bound of blocking calls (transaction commit, synchronous offset commit, metadata).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Largest `onceflow.timeout.ms`, in milliseconds: one hour. librdkafka takes its call
/// timeouts as 32-bit milliseconds (a larger value would wrap, some into "wait forever"), and a
/// blocking call bounded by more than an hour bounds nothing a caller can wait for.
pub const MAX_TIMEOUT_MS: u64 = 3_600_000;

/// Configuration of a Kafka connection: typed fields plus raw librdkafka properties.
///
/// Its `Debug` output shows `***` for the value of every secret property (`sasl.password`,
/// `ssl.key.password`, `ssl.key.pem`, `sasl.oauthbearer.client.secret`, ...: see
/// [`onceflow_core::is_secret_key`]).
#[derive(Clone, PartialEq, Eq)]
pub struct KafkaConfig {
    /// `bootstrap.servers`: comma-separated `host:port` list.
    pub bootstrap_servers: String,
    /// Raw librdkafka properties applied to every client (producer, consumer, admin). Per-client
    /// options ([`onceflow_core::ProducerConfig::options`], [`onceflow_core::ConsumerConfig::options`])
    /// override them.
    pub properties: BTreeMap<String, String>,
    /// Largest record accepted, in bytes (key + payload + headers); from `message.max.bytes`,
    /// else [`DEFAULT_MAX_RECORD_BYTES`].
    pub max_record_bytes: usize,
    /// Bound of blocking calls; from `onceflow.timeout.ms`.
    pub timeout: Duration,
}

impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let properties: BTreeMap<&str, &str> = self
            .properties
            .iter()
            .map(|(k, v)| {
                let shown = if onceflow_core::is_secret_key(k) {
                    "***"
                } else {
                    v.as_str()
                };
                (k.as_str(), shown)
            })
            .collect();
        f.debug_struct("KafkaConfig")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("properties", &properties)
            .field("max_record_bytes", &self.max_record_bytes)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl KafkaConfig {
    /// A configuration for `bootstrap_servers` with defaults otherwise.
    pub fn new(bootstrap_servers: impl Into<String>) -> Self {
        KafkaConfig {
            bootstrap_servers: bootstrap_servers.into(),
            properties: BTreeMap::new(),
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// Adds a raw librdkafka property (`key=value`) for every client.
    pub fn option(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.properties.insert(key.into(), value.into());
        self
    }

    /// The native client configuration: bootstrap servers, the connection's properties, then
    /// `overrides` (per-client options) on top.
    pub(crate) fn client_config(&self, overrides: &BTreeMap<String, String>) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.bootstrap_servers);
        for (k, v) in self.properties.iter().chain(overrides.iter()) {
            c.set(k, v);
        }
        if c.get("message.max.bytes").is_none() {
            c.set(
                "message.max.bytes",
                self.default_message_max_bytes().to_string(),
            );
        }
        c
    }

    /// The `message.max.bytes` given to librdkafka when none is set: [`Self::max_record_bytes`]
    /// and the worst-case record framing (for the default, a default broker's limit less the
    /// batch header).
    pub(crate) fn default_message_max_bytes(&self) -> usize {
        self.max_record_bytes.saturating_add(RECORD_FRAMING_MAX)
    }

    /// Whether `key` was set on the connection or in `overrides`.
    pub(crate) fn is_set(&self, key: &str, overrides: &BTreeMap<String, String>) -> bool {
        self.properties.contains_key(key) || overrides.contains_key(key)
    }
}

/// librdkafka's range of `message.max.bytes` (CONFIGURATION.md).
const MESSAGE_MAX_BYTES_RANGE: std::ops::RangeInclusive<usize> = 1000..=1_000_000_000;

/// A `message.max.bytes` value given `place` (for the error): plain decimal digits without a
/// leading zero, in librdkafka's range. librdkafka itself would read `0x4e20` or `047040` as
/// 20000, ignore text after the digits and cut a number past a C int to its low 32 bits, so
/// such a spelling would leave onceflow checking another limit than librdkafka's.
/// [`onceflow_core::ErrorKind::Config`] naming the value otherwise.
pub(crate) fn message_max_bytes(v: &str, place: &str) -> Result<usize> {
    let plain = !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) && !v.starts_with('0');
    match v.parse::<usize>() {
        Ok(n) if plain && MESSAGE_MAX_BYTES_RANGE.contains(&n) => Ok(n),
        _ => Err(Error::config(format!(
            "invalid message.max.bytes '{}' {place}: expected a number of bytes from {} to {}, \
             in decimal digits",
            onceflow_core::shown(v),
            MESSAGE_MAX_BYTES_RANGE.start(),
            MESSAGE_MAX_BYTES_RANGE.end()
        ))),
    }
}

/// Parses `kafka://HOST:PORT[,HOST:PORT…][?KEY=VALUE&…]`. [`onceflow_core::ErrorKind::Config`]
/// naming the value for anything else.
pub fn parse_url(url: &str) -> Result<KafkaConfig> {
    // Echoed in errors: without credentials, cut past 80 characters, control characters escaped.
    let shown_url = onceflow_core::shown(&onceflow_core::redact_credentials(url));
    let rest = url.strip_prefix("kafka://").ok_or_else(|| {
        Error::config(format!(
            "invalid Kafka URL '{shown_url}': expected kafka://HOST:PORT[,HOST:PORT][?KEY=VALUE]"
        ))
    })?;
    let (hosts, query) = match rest.split_once('?') {
        Some((h, q)) => (h, q),
        None => (rest, ""),
    };
    let hosts = hosts.trim_end_matches('/');
    if hosts.is_empty() {
        return Err(Error::config(format!(
            "invalid Kafka URL '{shown_url}': no broker given, expected kafka://HOST:PORT"
        )));
    }
    if hosts.contains('@') {
        return Err(Error::config(format!(
            "invalid Kafka URL '{}': credentials do not go in the broker list; give SASL \
             settings as options (?security.protocol=SASL_SSL&sasl.username=...)",
            onceflow_core::redact_credentials(url)
        )));
    }
    for h in hosts.split(',') {
        let ok = h
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !ok {
            return Err(Error::config(format!(
                "invalid broker '{}' in Kafka URL '{shown_url}': expected HOST:PORT",
                onceflow_core::shown(h)
            )));
        }
    }
    let mut config = KafkaConfig::new(hosts);
    for (k, v) in url::form_urlencoded::parse(query.as_bytes()) {
        let (k, v) = (k.into_owned(), v.into_owned());
        match k.as_str() {
            "" => {}
            "onceflow.timeout.ms" => {
                let ms: u64 = v
                    .parse()
                    .ok()
                    .filter(|ms| (1..=MAX_TIMEOUT_MS).contains(ms))
                    .ok_or_else(|| {
                        Error::config(format!(
                            "invalid onceflow.timeout.ms '{}' in Kafka URL: expected \
                             milliseconds, 1 to {MAX_TIMEOUT_MS} (one hour)",
                            onceflow_core::shown(&v)
                        ))
                    })?;
                config.timeout = Duration::from_millis(ms);
            }
            _ => {
                if k == "message.max.bytes" {
                    config.max_record_bytes = message_max_bytes(&v, "in Kafka URL")?;
                }
                config.properties.insert(k, v);
            }
        }
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hosts_and_raw_properties() {
        let c =
            parse_url("kafka://a:1,b:2?linger.ms=5&message.max.bytes=2048&onceflow.timeout.ms=700")
                .unwrap();
        assert_eq!(c.bootstrap_servers, "a:1,b:2");
        assert_eq!(c.properties.get("linger.ms").unwrap(), "5");
        assert_eq!(c.max_record_bytes, 2048);
        assert_eq!(c.timeout, Duration::from_millis(700));
        assert!(!c.properties.contains_key("onceflow.timeout.ms"));
        for bad in ["0", "3600001", "4294967296", "-1", "soon"] {
            let e = parse_url(&format!("kafka://a:1?onceflow.timeout.ms={bad}")).unwrap_err();
            assert!(e.message().contains(&format!("'{bad}'")), "{e}");
            assert!(e.message().contains("1 to 3600000"), "{e}");
        }
        assert_eq!(
            parse_url("kafka://a:1?onceflow.timeout.ms=3600000")
                .unwrap()
                .timeout,
            Duration::from_secs(3600)
        );
        let d = parse_url("kafka://127.0.0.1:19092").unwrap();
        assert_eq!(d.max_record_bytes, DEFAULT_MAX_RECORD_BYTES);
    }

    #[test]
    fn rejects_bad_urls_naming_the_value() {
        for bad in [
            "nats://a:1",
            "kafka://",
            "kafka://host",
            "kafka://h:notaport",
        ] {
            let e = parse_url(bad).unwrap_err();
            assert_eq!(e.kind(), onceflow_core::ErrorKind::Config, "{bad}");
        }
        let e = parse_url("kafka://h:1?message.max.bytes=lots").unwrap_err();
        assert!(e.message().contains("lots"));
    }

    /// Secret properties never show in `Debug` (it reaches logs through `{:?}`).
    #[test]
    fn debug_hides_secret_properties() {
        let c = parse_url(
            "kafka://h:1?security.protocol=SASL_SSL&sasl.username=u&sasl.password=S3cr3t\
             &ssl.key.pem=PEMKEY&sasl.oauthbearer.client.secret=CS1&ssl.key.password=KP1",
        )
        .unwrap();
        let d = format!("{c:?}");
        for secret in ["S3cr3t", "PEMKEY", "CS1", "KP1"] {
            assert!(!d.contains(secret), "{d}");
        }
        assert!(d.contains("SASL_SSL") && d.contains("sasl.username"), "{d}");
    }

    /// A long bad URL is cut in the error (break test: a 100 000-character host was echoed in
    /// full, twice), and its credentials are not echoed.
    #[test]
    fn long_bad_urls_are_cut_and_credentials_not_echoed() {
        let host = "h".repeat(100_000);
        let e = parse_url(&format!("kafka://{host}")).unwrap_err();
        assert!(e.message().len() < 600, "{} bytes", e.message().len());
        assert!(e.message().contains("(100000 characters)"), "{e}");
        let e = parse_url("kafka://user:secret@").unwrap_err();
        assert!(!e.message().contains("secret"), "{e}");
    }
}
