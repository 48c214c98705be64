//! `memory://NAME?key=value&…` parsing.

use onceflow_core::{Error, Result};

/// Default largest record accepted (key + payload + headers): 1 MiB, close to Kafka's default
/// `message.max.bytes` (1048588).
pub const DEFAULT_MAX_RECORD_BYTES: usize = 1024 * 1024;

/// Settings of one `memory://` connection (the broker is shared per name; these settings are the
/// connection's: two handles on the same broker may auto-create topics with different defaults).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryOptions {
    /// Partitions of topics created automatically on first produce (URL `partitions`, 1 to
    /// [`crate::MAX_MEMORY_PARTITIONS`], default 1; Kafka's `num.partitions`).
    pub partitions: u32,
    /// Whether producing to a missing topic creates it (URL `auto_create`, default `true`;
    /// Kafka's `auto.create.topics.enable`). When `false` it is a
    /// [`onceflow_core::ErrorKind::NotFound`] error naming the topic.
    pub auto_create: bool,
    /// Largest record accepted, in bytes (key + payload + headers) (URL `max_record_bytes`,
    /// default 1 MiB).
    pub max_record_bytes: usize,
}

impl Default for MemoryOptions {
    fn default() -> Self {
        MemoryOptions {
            partitions: 1,
            auto_create: true,
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
        }
    }
}

/// Name of the broker selected by `memory://` with no name.
pub const DEFAULT_BROKER: &str = "default";

const KNOWN: &str = "partitions, auto_create, max_record_bytes";

/// Parses `memory://NAME?partitions=N&auto_create=BOOL&max_record_bytes=N` into the broker name
/// and the options. Errors are [`onceflow_core::ErrorKind::Config`] naming the value at fault.
pub fn parse_url(url: &str) -> Result<(String, MemoryOptions)> {
    let raw = url;
    // What errors show of the URL: no user info or secret-looking query values.
    let url = &onceflow_core::shown(&onceflow_core::redact_credentials(raw));
    let rest = match raw.split_once("://") {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("memory") => rest,
        Some((scheme, _)) => {
            return Err(Error::config(format!(
                "unsupported URL scheme '{scheme}' in '{url}': the memory backend expects memory://NAME"
            )))
        }
        None => {
            return Err(Error::config(format!(
                "invalid URL '{url}': expected memory://NAME?partitions=N"
            )))
        }
    };
    let (name, query) = match rest.split_once('?') {
        Some((n, q)) => (n, Some(q)),
        None => (rest, None),
    };
    let name = name.trim_end_matches('/');
    let name = if name.is_empty() {
        DEFAULT_BROKER
    } else {
        name
    };
    if name.contains('@') {
        return Err(Error::config(format!(
            "user info in '{url}': the memory backend takes no credentials; expected memory://NAME"
        )));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Err(Error::config(format!(
            "invalid broker name '{}' in '{url}': expected letters, digits, '-', '_' or '.'",
            onceflow_core::shown(name)
        )));
    }
    let mut options = MemoryOptions::default();
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "partitions" => {
                options.partitions = value
                    .parse::<u32>()
                    .ok()
                    .filter(|n| (1..=crate::admin::MAX_MEMORY_PARTITIONS).contains(n))
                    .ok_or_else(|| {
                        Error::config(format!(
                            "invalid partitions '{}' in '{url}': expected an integer from 1 \
                                 to {} (memory:// holds at most that many per topic)",
                            onceflow_core::shown(value),
                            crate::admin::MAX_MEMORY_PARTITIONS
                        ))
                    })?;
            }
            "auto_create" => {
                options.auto_create = match value {
                    "true" | "1" => true,
                    "false" | "0" => false,
                    _ => {
                        return Err(Error::config(format!(
                            "invalid auto_create '{}' in '{url}': expected true or false",
                            onceflow_core::shown(value)
                        )))
                    }
                };
            }
            "max_record_bytes" => {
                options.max_record_bytes = value
                    .parse::<usize>()
                    .ok()
                    .filter(|n| *n >= 1)
                    .ok_or_else(|| {
                        Error::config(format!(
                            "invalid max_record_bytes '{}' in '{url}': expected an integer >= 1",
                            onceflow_core::shown(value)
                        ))
                    })?;
            }
            _ => {
                return Err(Error::config(format!(
                    "unknown parameter '{}' in '{url}': expected one of {KNOWN}",
                    onceflow_core::shown(key)
                )))
            }
        }
    }
    Ok((name.to_string(), options))
}

/// Refuses a producer's or consumer's raw `options` (`what`: "producer" or "consumer"): the
/// memory backend reads none of them, and one ignored in silence (a misspelled or another
/// platform's setting) would look applied. Names every key, never a value (it may be a secret).
pub(crate) fn refuse_client_options(
    what: &str,
    options: &std::collections::BTreeMap<String, String>,
) -> Result<()> {
    if options.is_empty() {
        return Ok(());
    }
    let names: Vec<String> = options
        .keys()
        .map(|k| format!("'{}'", onceflow_core::shown(k)))
        .collect();
    let (noun, them) = if names.len() == 1 {
        ("option", "it")
    } else {
        ("options", "them")
    };
    Err(Error::config(format!(
        "unknown memory:// {what} {noun} {}: the memory backend takes no {what} options, so \
         {them} would be ignored; its settings are URL parameters ({KNOWN})",
        names.join(", ")
    )))
}

/// Kafka's legal topic names: 1 to 249 characters out of `[a-zA-Z0-9._-]`, not `.` or `..`.
pub(crate) fn validate_topic_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 249
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(Error::config(format!(
            "invalid topic name '{}': expected 1 to 249 characters out of letters, digits, \
             '.', '_' and '-' (not '.' or '..')",
            onceflow_core::shown(name)
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use onceflow_core::ErrorKind;

    #[test]
    fn parses_names_and_params() {
        let (n, o) = parse_url("memory://").unwrap();
        assert_eq!(n, "default");
        assert_eq!(o, MemoryOptions::default());
        let (n, o) =
            parse_url("memory://orders?partitions=4&auto_create=false&max_record_bytes=10")
                .unwrap();
        assert_eq!(n, "orders");
        assert_eq!(o.partitions, 4);
        assert!(!o.auto_create);
        assert_eq!(o.max_record_bytes, 10);
        assert_eq!(parse_url("MEMORY://x/").unwrap().0, "x");
    }

    #[test]
    fn bad_params_name_the_value() {
        let e = parse_url("memory://user:s3cret@orders").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(!e.message().contains("s3cret"), "{}", e.message());
        assert!(
            e.message().contains("takes no credentials"),
            "{}",
            e.message()
        );
        for (url, needle) in [
            ("memory://x?partitions=0", "'0'"),
            ("memory://x?partitions=abc", "'abc'"),
            // Past memory://'s per-topic limit: refused here, not an allocation abort later.
            ("memory://x?partitions=2147483647", "'2147483647'"),
            ("memory://x?auto_create=maybe", "'maybe'"),
            ("memory://x?colour=red", "'colour'"),
            ("kafka://x", "'kafka'"),
            ("memory://a b", "'a b'"),
            ("nothing", "'nothing'"),
        ] {
            let e = parse_url(url).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Config, "{url}");
            assert!(e.message().contains(needle), "{url}: {}", e.message());
        }
    }

    #[test]
    fn topic_names_follow_kafka() {
        assert!(validate_topic_name("orders.v1-a_b").is_ok());
        for bad in ["", ".", "..", "a b", "a/b", &"x".repeat(250)] {
            assert_eq!(
                validate_topic_name(bad).unwrap_err().kind(),
                ErrorKind::Config
            );
        }
    }
}
