//! `pulsar://` URL parsing and the typed options of the adapter.

use std::collections::BTreeMap;
use std::time::Duration;

use onceflow_core::{Error, Result};

/// Pulsar subscription type of a consumer group
/// (<https://pulsar.apache.org/docs/next/concepts-messaging/#subscription-types>).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SubscriptionType {
    /// `failover` (default): one active consumer per partition, the others stand by; per
    /// partition order is kept. The broker spreads partitions over the members by name.
    #[default]
    Failover,
    /// `exclusive`: one consumer for the whole subscription; a second one is refused.
    Exclusive,
    /// `shared`: messages spread round-robin over the members; no order.
    Shared,
    /// `key_shared`: messages spread by key; per key, order is kept.
    KeyShared,
}

impl SubscriptionType {
    /// Whether one member at a time reads a partition (failover, exclusive): a negative ack
    /// rewinds the partition there, since the broker redelivers every unacked message to keep
    /// the order.
    pub fn single_active(self) -> bool {
        matches!(
            self,
            SubscriptionType::Failover | SubscriptionType::Exclusive
        )
    }

    fn parse(key: &str, value: &str) -> Result<Self> {
        Ok(
            match value.to_ascii_lowercase().replace('-', "_").as_str() {
                "failover" => SubscriptionType::Failover,
                "exclusive" => SubscriptionType::Exclusive,
                "shared" => SubscriptionType::Shared,
                "key_shared" | "keyshared" => SubscriptionType::KeyShared,
                _ => {
                    return Err(Error::config(format!(
                        "'{key}={value}': expected failover, exclusive, shared or key_shared"
                    )))
                }
            },
        )
    }
}

/// How a consumer acknowledges the messages of a batch (`batch_index_ack=`).
///
/// A batch is one entry of the topic's ledger holding several messages. An acknowledgement
/// without an ack set acknowledges the whole entry at the broker, every message of the batch;
/// batch-index acknowledgement (PIP-54,
/// <https://github.com/apache/pulsar/wiki/PIP-54:-Support-acknowledgment-at-batch-index-level>)
/// sends an ack set (a bit set over the batch, 1 for each message still unacknowledged) and
/// acknowledges single messages, where the broker has `acknowledgmentAtBatchIndexLevelEnabled`
/// on (off by default in Pulsar). Either way onceflow never acknowledges a message of a batch
/// in a way that also acknowledges a sibling the application has not settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BatchIndexAck {
    /// `auto` (default): batch-index acknowledgement when the broker has it on (read from the
    /// admin API at connect, `GET /admin/v2/brokers/configuration/runtime`, key
    /// `acknowledgmentAtBatchIndexLevelEnabled`), else as `off`. A broker whose configuration
    /// cannot be read counts as off.
    #[default]
    Auto,
    /// `off`: the acknowledgements of a batch's messages are held until every message of the
    /// batch is settled (committed, or skipped after a seek), then the whole entry is
    /// acknowledged at once. A member that closes or loses the partition before that leaves the
    /// entry to be redelivered whole (at-least-once: the dedup store skips the finished ones).
    Off,
}

/// Producer compression (`compression=`), done by the pulsar crate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CompressionKind {
    /// `none` (default).
    #[default]
    None,
    /// `lz4`.
    Lz4,
    /// `zlib`.
    Zlib,
    /// `zstd`.
    Zstd,
    /// `snappy`.
    Snappy,
}

/// Options of a `pulsar://host:port?key=value&…` connection. Every key is listed here; an
/// unknown key is a [`onceflow_core::ErrorKind::Config`] error naming it. The consumer keys may
/// also be given per consumer in [`onceflow_core::ConsumerConfig::options`], the producer keys
/// per producer in [`onceflow_core::ProducerConfig::options`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PulsarOptions {
    /// Broker service URL handed to the pulsar crate (`pulsar://host:port`).
    pub service_url: String,
    /// `admin` (default `http://<host>:8080`): base URL of the admin REST API (topics,
    /// partitions, retention, backlog).
    pub admin_url: String,
    /// `tenant` (default `public`) and `namespace` (default `default`) of plain topic names.
    pub tenant: String,
    /// See `tenant`.
    pub namespace: String,
    /// `operation_timeout_ms` (default 30000, 1 to 3 600 000): how long a send, a lookup or a subscribe may
    /// take (the crate's operation timeout, like Java's `sendTimeout`).
    pub operation_timeout: Duration,
    /// `batch_size` (default none = no batching): messages per batch.
    pub batch_size: Option<u32>,
    /// `batch_bytes` (default none): bytes per batch.
    pub batch_bytes: Option<usize>,
    /// `batch_timeout_ms` (default none): a batch is sent at the latest this long after its
    /// first message.
    pub batch_timeout: Option<Duration>,
    /// `compression` (`none` default, `lz4`, `zlib`, `zstd`, `snappy`).
    pub compression: CompressionKind,
    /// `producer_name`: name of every producer of this connection (else the
    /// [`onceflow_core::ProducerConfig::client_id`], else a broker-assigned unique one). See
    /// the crate docs: a name reused after a restart has its messages dropped by broker
    /// dedup, which onceflow reports as errors.
    pub producer_name: Option<String>,
    /// `max_message_bytes` (default 5242880, the broker's `maxMessageSize`): largest message;
    /// onceflow keeps 16 KiB of it for the properties it adds.
    pub max_message_bytes: usize,
    /// `subscription_type` (default `failover`).
    pub subscription_type: SubscriptionType,
    /// `receiver_queue_size` (default 1000): messages the broker may push ahead per partition.
    pub receiver_queue_size: u32,
    /// `ack_timeout_ms` (default none): a delivered message not acked for this long is
    /// redelivered (the crate's unacked-message redelivery).
    pub ack_timeout: Option<Duration>,
    /// `dead_letter` (default none): dead-letter topic; with `max_redeliver` the crate moves a
    /// message redelivered that many times there and acks it (shared and key_shared
    /// subscriptions: only their dispatchers count redeliveries).
    pub dead_letter: Option<String>,
    /// `max_redeliver` (default 0 = off): redeliveries before a message is dead-lettered.
    pub max_redeliver: usize,
    /// `batch_index_ack` (`auto` default, `off`): see [`BatchIndexAck`].
    pub batch_index_ack: BatchIndexAck,
    /// `refresh_ms` (default 250): how often a failover member reads which partitions it is
    /// active for (admin REST topic stats). The broker's `activeConsumerFailoverDelayTimeMillis`
    /// (default 1000) must be longer, so a member commits before its partitions move.
    pub refresh: Duration,
    /// `metadata.KEY=VALUE`: producer and consumer metadata passed verbatim to the broker
    /// (shown in topic stats).
    pub metadata: BTreeMap<String, String>,
}

impl Default for PulsarOptions {
    fn default() -> Self {
        PulsarOptions {
            service_url: "pulsar://127.0.0.1:6650".to_string(),
            admin_url: "http://127.0.0.1:8080".to_string(),
            tenant: "public".to_string(),
            namespace: "default".to_string(),
            operation_timeout: Duration::from_secs(30),
            batch_size: None,
            batch_bytes: None,
            batch_timeout: None,
            compression: CompressionKind::None,
            producer_name: None,
            max_message_bytes: 5 * 1024 * 1024,
            subscription_type: SubscriptionType::Failover,
            receiver_queue_size: 1000,
            ack_timeout: None,
            dead_letter: None,
            max_redeliver: 0,
            batch_index_ack: BatchIndexAck::Auto,
            refresh: Duration::from_millis(250),
            metadata: BTreeMap::new(),
        }
    }
}

fn parse_num<T: std::str::FromStr>(key: &str, value: &str, what: &str) -> Result<T> {
    value
        .parse::<T>()
        .map_err(|_| Error::config(format!("'{key}={value}': expected {what}")))
}

/// Largest `operation_timeout_ms`: one hour (an operation bounded by more bounds nothing a
/// caller waits for; a zero bound would fail every operation before it starts).
const MAX_OPERATION_TIMEOUT: Duration = Duration::from_secs(3600);

fn ms(key: &str, value: &str) -> Result<Duration> {
    parse_num::<u64>(key, value, "a duration in milliseconds").map(Duration::from_millis)
}

/// Checks a topic name: `name`, `tenant/namespace/name` or the full
/// `persistent://tenant/namespace/name`, out of letters, digits and `-_.=:`.
/// `non-persistent://` topics are refused: their messages are neither stored nor redelivered,
/// so no guarantee holds on them.
pub(crate) fn check_topic(topic: &str) -> Result<()> {
    if topic.starts_with("non-persistent://") {
        return Err(Error::unsupported(format!(
            "topic '{}' is non-persistent: Pulsar neither stores nor redelivers its messages, \
             so onceflow cannot consume it exactly once; use a persistent:// topic",
            onceflow_core::shown(topic)
        )));
    }
    let (topic, full) = match topic.strip_prefix("persistent://") {
        Some(rest) => (rest, true),
        None => (topic, false),
    };
    let ok = !topic.is_empty()
        && (!full || topic.split('/').count() == 3)
        && topic.split('/').count() <= 3
        && topic.split('/').all(|p| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.=:".contains(c))
        });
    if ok {
        Ok(())
    } else {
        Err(Error::config(format!(
            "topic name '{}' is not valid on Pulsar: expected NAME, TENANT/NAMESPACE/NAME or \
             persistent://TENANT/NAMESPACE/NAME out of letters, digits and -_.=:",
            onceflow_core::shown(topic)
        )))
    }
}

impl PulsarOptions {
    /// Applies one `key=value` option.
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "admin" => {
                let u = url::Url::parse(value).map_err(|e| {
                    Error::config(format!("'admin={value}': expected an http:// URL ({e})"))
                })?;
                if u.scheme() != "http" && u.scheme() != "https" {
                    return Err(Error::config(format!(
                        "'admin={value}': expected an http:// or https:// URL"
                    )));
                }
                self.admin_url = value.trim_end_matches('/').to_string();
            }
            "tenant" => self.tenant = value.to_string(),
            "namespace" => self.namespace = value.to_string(),
            "operation_timeout_ms" => {
                let d = ms(key, value)?;
                if d.is_zero() || d > MAX_OPERATION_TIMEOUT {
                    return Err(Error::config(format!(
                        "'{key}={}': expected milliseconds, 1 to {}",
                        onceflow_core::shown(value),
                        MAX_OPERATION_TIMEOUT.as_millis()
                    )));
                }
                self.operation_timeout = d;
            }
            "batch_size" => {
                let n: u32 = parse_num(key, value, "a message count")?;
                self.batch_size = (n > 0).then_some(n);
            }
            "batch_bytes" => {
                let n: usize = parse_num(key, value, "a byte count")?;
                self.batch_bytes = (n > 0).then_some(n);
            }
            "batch_timeout_ms" => self.batch_timeout = Some(ms(key, value)?),
            "compression" => {
                self.compression = match value {
                    "none" => CompressionKind::None,
                    "lz4" => CompressionKind::Lz4,
                    "zlib" => CompressionKind::Zlib,
                    "zstd" => CompressionKind::Zstd,
                    "snappy" => CompressionKind::Snappy,
                    _ => {
                        return Err(Error::config(format!(
                            "'{key}={value}': expected none, lz4, zlib, zstd or snappy"
                        )))
                    }
                }
            }
            "producer_name" => self.producer_name = Some(value.to_string()),
            "max_message_bytes" => {
                self.max_message_bytes = parse_num(key, value, "a byte count > 16384")?;
                if self.max_message_bytes <= crate::PROPERTY_ROOM {
                    return Err(Error::config(format!(
                        "'{key}={value}': expected a byte count > {}",
                        crate::PROPERTY_ROOM
                    )));
                }
            }
            "subscription_type" => self.subscription_type = SubscriptionType::parse(key, value)?,
            "receiver_queue_size" => {
                self.receiver_queue_size = parse_num(key, value, "a message count >= 1")?;
                if self.receiver_queue_size == 0 {
                    return Err(Error::config(format!("'{key}={value}': expected >= 1")));
                }
            }
            "ack_timeout_ms" => {
                let d = ms(key, value)?;
                self.ack_timeout = (!d.is_zero()).then_some(d);
            }
            "dead_letter" => {
                check_topic(value)?;
                self.dead_letter = Some(value.to_string());
            }
            "max_redeliver" => self.max_redeliver = parse_num(key, value, "a count")?,
            "batch_index_ack" => {
                self.batch_index_ack = match value {
                    "auto" => BatchIndexAck::Auto,
                    "off" => BatchIndexAck::Off,
                    _ => {
                        return Err(Error::config(format!(
                            "'{key}={value}': expected auto or off"
                        )))
                    }
                }
            }
            "refresh_ms" => {
                self.refresh = ms(key, value)?;
                if self.refresh.is_zero() {
                    return Err(Error::config(format!("'{key}={value}': expected > 0")));
                }
            }
            other => {
                if let Some(k) = other.strip_prefix("metadata.") {
                    if !k.is_empty() {
                        self.metadata.insert(k.to_string(), value.to_string());
                        return Ok(());
                    }
                }
                return Err(Error::config(format!(
                    "unknown pulsar option '{other}': expected one of admin, tenant, namespace, \
                     operation_timeout_ms, batch_size, batch_bytes, batch_timeout_ms, \
                     compression, producer_name, max_message_bytes, subscription_type, \
                     receiver_queue_size, ack_timeout_ms, dead_letter, max_redeliver, \
                     batch_index_ack, refresh_ms, metadata.KEY"
                )));
            }
        }
        Ok(())
    }

    /// Applies several options.
    pub fn apply(&mut self, options: &BTreeMap<String, String>) -> Result<()> {
        for (k, v) in options {
            self.set(k, v)?;
        }
        Ok(())
    }

    /// Checks options that only make sense together.
    pub(crate) fn validate(&self) -> Result<()> {
        if self.dead_letter.is_some() != (self.max_redeliver > 0) {
            return Err(Error::config(format!(
                "dead_letter={} with max_redeliver={}: a dead-letter policy needs both a topic \
                 and max_redeliver > 0",
                self.dead_letter.as_deref().unwrap_or("(none)"),
                self.max_redeliver
            )));
        }
        Ok(())
    }

    /// Whether producers batch.
    pub fn batching(&self) -> bool {
        self.batch_size.is_some_and(|n| n > 1)
            || self.batch_bytes.is_some()
            || self.batch_timeout.is_some()
    }

    /// The full topic name: `persistent://tenant/namespace/name`.
    pub fn full_topic(&self, topic: &str) -> String {
        if topic.contains("://") {
            topic.to_string()
        } else if topic.split('/').count() == 3 {
            format!("persistent://{topic}")
        } else {
            format!("persistent://{}/{}/{topic}", self.tenant, self.namespace)
        }
    }

    /// The admin REST path of a topic: `TENANT/NAMESPACE/NAME` (URL-encoded name).
    pub(crate) fn admin_path(&self, topic: &str) -> String {
        let full = self.full_topic(topic);
        let rest = full
            .split_once("://")
            .map(|(_, r)| r)
            .unwrap_or(full.as_str());
        rest.split('/')
            .map(|p| url::form_urlencoded::byte_serialize(p.as_bytes()).collect::<String>())
            .collect::<Vec<_>>()
            .join("/")
    }
}

/// Parses `pulsar://host:port?key=value&…`.
pub fn parse_url(url: &str) -> Result<PulsarOptions> {
    let rest = url.strip_prefix("pulsar://").ok_or_else(|| {
        Error::config(format!(
            "'{url}' is not a Pulsar URL: expected pulsar://host:port?admin=http://host:port"
        ))
    })?;
    let (host, query) = match rest.split_once('?') {
        Some((h, q)) => (h, Some(q)),
        None => (rest, None),
    };
    let host = host.trim_end_matches('/');
    if host.is_empty() || host.contains(',') {
        return Err(Error::config(format!(
            "'{url}' must name one broker: expected pulsar://host:port"
        )));
    }
    let hostname = host.rsplit_once(':').map(|(h, _)| h).unwrap_or(host);
    let mut opts = PulsarOptions {
        service_url: format!("pulsar://{host}"),
        admin_url: format!("http://{hostname}:8080"),
        ..Default::default()
    };
    if let Some(q) = query {
        for (k, v) in url::form_urlencoded::parse(q.as_bytes()) {
            opts.set(&k, &v)?;
        }
    }
    opts.validate()?;
    Ok(opts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_host_admin_and_options() {
        let o = parse_url(
            "pulsar://127.0.0.1:16650?admin=http://127.0.0.1:18080&batch_size=100&compression=lz4&subscription_type=key_shared&metadata.team=a",
        )
        .unwrap();
        assert_eq!(o.service_url, "pulsar://127.0.0.1:16650");
        assert_eq!(o.admin_url, "http://127.0.0.1:18080");
        assert_eq!(o.batch_size, Some(100));
        assert!(o.batching());
        assert_eq!(o.compression, CompressionKind::Lz4);
        assert_eq!(o.subscription_type, SubscriptionType::KeyShared);
        assert_eq!(o.metadata.get("team").map(String::as_str), Some("a"));
        assert_eq!(
            parse_url("pulsar://h:6650").unwrap().admin_url,
            "http://h:8080"
        );
        let e = parse_url("pulsar://h:1?bogus=1").unwrap_err();
        assert!(e.message().contains("bogus"));
        assert!(parse_url("kafka://h:1").is_err());
        assert!(parse_url("pulsar://h:1?subscription_type=nope").is_err());
        assert!(parse_url("pulsar://h:1?dead_letter=dlq").is_err());
        assert!(parse_url("pulsar://h:1?dead_letter=dlq&max_redeliver=3").is_ok());
        for bad in ["0", "3600001", "-5", "soon"] {
            let e = parse_url(&format!("pulsar://h:1?operation_timeout_ms={bad}")).unwrap_err();
            assert!(
                e.message().contains(&format!("operation_timeout_ms={bad}")),
                "{e}"
            );
        }
        assert_eq!(
            parse_url("pulsar://h:1?operation_timeout_ms=3600000")
                .unwrap()
                .operation_timeout,
            Duration::from_secs(3600)
        );
    }

    #[test]
    fn topic_names() {
        let o = PulsarOptions::default();
        assert_eq!(o.full_topic("t"), "persistent://public/default/t");
        assert_eq!(o.full_topic("a/b/t"), "persistent://a/b/t");
        assert_eq!(o.admin_path("t"), "public/default/t");
        assert!(check_topic("ok-name_1").is_ok());
        assert!(check_topic("persistent://public/default/t").is_ok());
        assert!(check_topic("persistent://t").is_err());
        assert_eq!(
            check_topic("non-persistent://public/default/t")
                .unwrap_err()
                .kind(),
            onceflow_core::ErrorKind::Unsupported
        );
        assert!(check_topic("bad name").is_err());
        assert!(check_topic("").is_err());
    }
}
