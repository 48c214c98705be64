//! How topics, partitions and groups map to streams, subjects and durable consumers.

use onceflow_core::{Error, Result};

/// Stream metadata key holding the partition count of a stream created by onceflow.
pub const PARTITIONS_METADATA: &str = "onceflow.partitions";

/// Header carrying [`onceflow_core::Record::key`] (JetStream messages have no key).
pub const KEY_HEADER: &str = "onceflow-key";

/// Header carrying a key that is not single-line UTF-8, hex-encoded.
pub const KEY_HEX_HEADER: &str = "onceflow-key-hex";

/// Header carrying [`onceflow_core::Record::timestamp`] in ms (JetStream stamps messages with
/// the server's time only).
pub const TIMESTAMP_HEADER: &str = "onceflow-timestamp";

/// Header listing the record's header names in order, with null (`:n`) and hex (`:x`) marks.
pub const ORDER_HEADER: &str = "onceflow-headers";

/// Checks that `topic` can be a stream name (no whitespace, `.`, `*`, `>`, `/`, `\`; see
/// <https://docs.nats.io/running-a-nats-service/nats_admin/jetstream_admin/naming>).
pub fn check_topic(topic: &str) -> Result<()> {
    if topic.is_empty()
        || topic.len() > 255
        || topic
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || ".*>/\\".contains(c))
    {
        return Err(Error::config(format!(
            "topic '{}' cannot be a JetStream stream name: expected 1-255 characters \
             without whitespace, '.', '*', '>', '/' or '\\'",
            onceflow_core::shown(topic)
        )));
    }
    Ok(())
}

/// The subject of `partition` of `topic` with `partitions` partitions: the topic itself when
/// unpartitioned, `topic.<partition>` otherwise.
pub fn subject(topic: &str, partitions: u32, partition: i32) -> String {
    if partitions <= 1 {
        topic.to_string()
    } else {
        format!("{topic}.{partition}")
    }
}

/// The stream subjects of a topic with `partitions` partitions.
pub fn stream_subjects(topic: &str, partitions: u32) -> Vec<String> {
    if partitions <= 1 {
        vec![topic.to_string()]
    } else {
        vec![format!("{topic}.*")]
    }
}

/// The partition a message subject belongs to (`topic.<n>` → n, anything else → 0).
pub fn partition_of_subject(topic: &str, subject: &str) -> i32 {
    subject
        .strip_prefix(topic)
        .and_then(|s| s.strip_prefix('.'))
        .and_then(|s| s.parse::<i32>().ok())
        .unwrap_or(0)
}

/// The durable consumer name of `group` for one partition: `<group>-<partition>`, with
/// characters a consumer name cannot hold (whitespace, `.`, `*`, `>`, `/`, `\`) replaced by `_`.
pub fn durable(group: &str, partition: i32) -> String {
    let g: String = group
        .chars()
        .map(|c| {
            if c.is_whitespace() || c.is_control() || ".*>/\\".contains(c) {
                '_'
            } else {
                c
            }
        })
        .collect();
    format!("{g}-{partition}")
}

/// Partition of a keyed record: xxh3 of the key modulo the partition count (stable across
/// processes and languages that implement xxh3-64).
pub fn partition_for_key(key: &[u8], partitions: u32) -> i32 {
    (xxhash_rust::xxh3::xxh3_64(key) % u64::from(partitions.max(1))) as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapping() {
        assert_eq!(subject("orders", 1, 0), "orders");
        assert_eq!(subject("orders", 4, 3), "orders.3");
        assert_eq!(partition_of_subject("orders", "orders.3"), 3);
        assert_eq!(partition_of_subject("orders", "orders"), 0);
        assert_eq!(durable("g.1 x", 2), "g_1_x-2");
        assert!(check_topic("a.b").is_err());
        assert!(check_topic("orders-1_x").is_ok());
        assert!(partition_for_key(b"k", 4) < 4);
    }
}
