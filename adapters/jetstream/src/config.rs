//! `nats://` URL parsing and the typed options of the adapter.

use std::collections::BTreeMap;
use std::time::Duration;

use onceflow_core::{Error, Result};

/// Options of a `nats://host:port?key=value&…` connection. Every key is listed here; an unknown
/// key is a [`onceflow_core::ErrorKind::Config`] error naming it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JetStreamOptions {
    /// Server address(es) handed to async-nats (`nats://host:port`, comma separated).
    pub servers: String,
    /// `auto_create` (default `true`): producing to, or consuming from, a topic without a stream
    /// creates the stream (with `partitions` partitions). With `false` it is a `NotFound` error.
    pub auto_create: bool,
    /// `partitions` (default 1): partitions of streams created automatically.
    pub partitions: u32,
    /// `publish_timeout_ms` (default 5000): how long a publish waits for its ack before it is
    /// retried with the same `Nats-Msg-Id`.
    pub publish_timeout: Duration,
    /// `publish_retries` (default 3): retries of a publish that timed out (same `Nats-Msg-Id`).
    pub publish_retries: u32,
    /// `request_timeout_ms` (default 5000): JetStream API requests (stream/consumer info, …).
    pub request_timeout: Duration,
    /// `ack_wait_ms` (default 30000): consumer `ack_wait`; a delivered message not acked (or
    /// marked in progress) for this long is redelivered.
    pub ack_wait: Duration,
    /// `max_deliver` (default -1 = unlimited): consumer `max_deliver`.
    pub max_deliver: i64,
    /// `max_ack_pending` (default 10000): consumer `max_ack_pending`.
    pub max_ack_pending: i64,
    /// `backoff_ms` (default none): consumer `backoff`, comma separated ms, used by the server
    /// for redeliveries after `ack_wait` expiries.
    pub backoff: Vec<Duration>,
    /// `duplicate_window_ms` (default: the server's, 2 min): duplicate window of created
    /// streams.
    pub duplicate_window: Option<Duration>,
    /// `allow_atomic` (default `true`): created streams allow atomic batch publish (ADR-50).
    pub allow_atomic: bool,
    /// `storage` (`file` default, or `memory`): storage of created streams.
    pub memory_storage: bool,
    /// `fetch_batch` (default 256): messages asked per pull request.
    pub fetch_batch: usize,
    /// `dead_letter` (default none): a topic; with `max_deliver` > 0 a consumer republishes a
    /// message the server gave up on (its `MAX_DELIVERIES` advisory) to it, with the reason in
    /// headers, and terminates it.
    pub dead_letter: Option<String>,
    /// `user` / `password` / `token` / `creds`: authentication.
    pub user: Option<String>,
    /// See `user`.
    pub password: Option<String>,
    /// See `user`.
    pub token: Option<String>,
    /// Path of a `.creds` file.
    pub creds: Option<String>,
}

impl Default for JetStreamOptions {
    fn default() -> Self {
        JetStreamOptions {
            servers: "nats://127.0.0.1:4222".to_string(),
            auto_create: true,
            partitions: 1,
            publish_timeout: Duration::from_secs(5),
            publish_retries: 3,
            request_timeout: Duration::from_secs(5),
            ack_wait: Duration::from_secs(30),
            max_deliver: -1,
            max_ack_pending: 10_000,
            backoff: Vec::new(),
            duplicate_window: None,
            allow_atomic: true,
            memory_storage: false,
            fetch_batch: 256,
            dead_letter: None,
            user: None,
            password: None,
            token: None,
            creds: None,
        }
    }
}

fn parse_num<T: std::str::FromStr>(key: &str, value: &str, what: &str) -> Result<T> {
    value
        .parse::<T>()
        .map_err(|_| Error::config(format!("'{key}={value}': expected {what}")))
}

fn parse_bool(key: &str, value: &str) -> Result<bool> {
    match value {
        "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" => Ok(false),
        _ => Err(Error::config(format!(
            "'{key}={value}': expected true or false"
        ))),
    }
}

fn ms(key: &str, value: &str) -> Result<Duration> {
    parse_num::<u64>(key, value, "a duration in milliseconds").map(Duration::from_millis)
}

impl JetStreamOptions {
    /// Applies one `key=value` option (URL query or [`onceflow_core::ConsumerConfig::options`]).
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "auto_create" => self.auto_create = parse_bool(key, value)?,
            "partitions" => {
                self.partitions = parse_num(key, value, "a partition count >= 1")?;
                if self.partitions == 0 {
                    return Err(Error::config(format!(
                        "'{key}={value}': expected a partition count >= 1"
                    )));
                }
            }
            "publish_timeout_ms" => self.publish_timeout = ms(key, value)?,
            "publish_retries" => self.publish_retries = parse_num(key, value, "a count")?,
            "request_timeout_ms" => self.request_timeout = ms(key, value)?,
            "ack_wait_ms" => self.ack_wait = ms(key, value)?,
            "max_deliver" => self.max_deliver = parse_num(key, value, "a count or -1")?,
            "max_ack_pending" => self.max_ack_pending = parse_num(key, value, "a count or -1")?,
            "backoff_ms" => {
                self.backoff = value
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(|v| ms(key, v))
                    .collect::<Result<_>>()?
            }
            "duplicate_window_ms" => self.duplicate_window = Some(ms(key, value)?),
            "allow_atomic" => self.allow_atomic = parse_bool(key, value)?,
            "storage" => {
                self.memory_storage = match value {
                    "file" => false,
                    "memory" => true,
                    _ => {
                        return Err(Error::config(format!(
                            "'{key}={value}': expected file or memory"
                        )))
                    }
                }
            }
            "fetch_batch" => {
                self.fetch_batch = parse_num(key, value, "a count >= 1")?;
                if self.fetch_batch == 0 {
                    return Err(Error::config(format!("'{key}={value}': expected >= 1")));
                }
            }
            "dead_letter" => {
                crate::naming::check_topic(value)?;
                self.dead_letter = Some(value.to_string())
            }
            "user" => self.user = Some(value.to_string()),
            "password" => self.password = Some(value.to_string()),
            "token" => self.token = Some(value.to_string()),
            "creds" => self.creds = Some(value.to_string()),
            other => {
                return Err(Error::config(format!(
                    "unknown nats option '{other}': expected one of auto_create, partitions, \
                     publish_timeout_ms, publish_retries, request_timeout_ms, ack_wait_ms, \
                     max_deliver, max_ack_pending, backoff_ms, duplicate_window_ms, allow_atomic, \
                     storage, fetch_batch, dead_letter, user, password, token, creds"
                )))
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
}

/// Parses `nats://host:port[,host:port]?key=value&…`.
pub fn parse_url(url: &str) -> Result<JetStreamOptions> {
    let rest = url.strip_prefix("nats://").ok_or_else(|| {
        Error::config(format!(
            "'{url}' is not a NATS URL: expected nats://host:port?key=value"
        ))
    })?;
    let (hosts, query) = match rest.split_once('?') {
        Some((h, q)) => (h, Some(q)),
        None => (rest, None),
    };
    let hosts = hosts.trim_end_matches('/');
    if hosts.is_empty() {
        return Err(Error::config(format!(
            "'{url}' names no server: expected nats://host:port"
        )));
    }
    let mut opts = JetStreamOptions {
        servers: hosts
            .split(',')
            .map(|h| format!("nats://{h}"))
            .collect::<Vec<_>>()
            .join(","),
        ..Default::default()
    };
    if let Some(q) = query {
        for (k, v) in url::form_urlencoded::parse(q.as_bytes()) {
            opts.set(&k, &v)?;
        }
    }
    Ok(opts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hosts_and_options() {
        let o = parse_url("nats://127.0.0.1:14222?partitions=3&ack_wait_ms=500&backoff_ms=10,20")
            .unwrap();
        assert_eq!(o.servers, "nats://127.0.0.1:14222");
        assert_eq!(o.partitions, 3);
        assert_eq!(o.ack_wait, Duration::from_millis(500));
        assert_eq!(o.backoff.len(), 2);
        let e = parse_url("nats://h:1?bogus=1").unwrap_err();
        assert!(e.message().contains("bogus"));
        assert!(parse_url("kafka://h:1").is_err());
        assert!(parse_url("nats://h:1?partitions=0").is_err());
    }
}
