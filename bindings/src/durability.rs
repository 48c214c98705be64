//! What a topic description says about the durability of an acknowledged write, read from the
//! settings the platform reports (`describe_topic`'s options), for the bindings' typed fields.
//!
//! JetStream reports `storage` (`file` / `memory`), `replicas`, `sync` (the server's
//! `sync_interval`: `always`, `N ms`, or `unknown` when this client may not read it) and
//! `durable_on_ack` (`true` / `false` / `unknown`). Other platforms report none of them: every
//! field is then `None`.

use std::collections::BTreeMap;

/// The durability fields of a topic description; `None` where the platform does not report
/// the setting (or, for `durable_on_ack`, where it cannot be told from this client).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Durability {
    /// `"file"` or `"memory"` (a memory stream loses its messages on a server restart).
    pub storage: Option<String>,
    /// The topic's replica count.
    pub replicas: Option<u32>,
    /// The server's sync setting: `"always"`, `"N ms"` or `"unknown"`.
    pub sync: Option<String>,
    /// `Some(true)`: an acknowledged write is synced to disk; `Some(false)`: it is not (memory
    /// storage, or a sync interval); `None`: cannot be told (or not reported).
    pub durable_on_ack: Option<bool>,
}

impl Durability {
    /// The durability fields of a description's `options`.
    pub fn of(options: &BTreeMap<String, String>) -> Self {
        Durability {
            storage: options.get("storage").cloned(),
            replicas: options.get("replicas").and_then(|r| r.parse().ok()),
            sync: options.get("sync").cloned(),
            durable_on_ack: match options.get("durable_on_ack").map(String::as_str) {
                Some("true") => Some(true),
                Some("false") => Some(false),
                _ => None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn jetstream_settings_become_typed_fields() {
        let d = Durability::of(&options(&[
            ("storage", "memory"),
            ("replicas", "3"),
            ("sync", "unknown"),
            ("durable_on_ack", "false"),
        ]));
        assert_eq!(d.storage.as_deref(), Some("memory"));
        assert_eq!(d.replicas, Some(3));
        assert_eq!(d.sync.as_deref(), Some("unknown"));
        assert_eq!(d.durable_on_ack, Some(false));
        let d = Durability::of(&options(&[("sync", "always"), ("durable_on_ack", "true")]));
        assert_eq!(d.durable_on_ack, Some(true));
        assert_eq!(
            Durability::of(&options(&[("durable_on_ack", "unknown")])).durable_on_ack,
            None
        );
    }

    #[test]
    fn platforms_that_report_nothing_give_none() {
        assert_eq!(
            Durability::of(&options(&[("status", "ACTIVE")])),
            Durability::default()
        );
    }
}
