//! Topic administration on a `memory://` broker.

use std::sync::Arc;

use async_trait::async_trait;
use onceflow_core::{
    AdminBackend, Error, ErrorKind, PartitionLag, Position, Result, TopicDescription,
    TopicPartition, TopicSpec,
};

use crate::broker::Broker;
use crate::config::validate_topic_name;

/// The most partitions a `memory://` topic can have: each partition is a log in this
/// process's memory, made when the topic is created.
pub const MAX_MEMORY_PARTITIONS: u32 = 100_000;

/// Creates, describes and deletes topics.
pub struct MemoryAdmin {
    pub(crate) broker: Arc<Broker>,
}

fn not_found(name: &str) -> Error {
    Error::new(
        ErrorKind::NotFound,
        format!("topic '{}' does not exist", onceflow_core::shown(name)),
    )
}

#[async_trait]
impl AdminBackend for MemoryAdmin {
    async fn create_topic(&self, spec: &TopicSpec) -> Result<()> {
        validate_topic_name(&spec.name)?;
        if spec.partitions < 1 || spec.partitions > MAX_MEMORY_PARTITIONS {
            return Err(Error::config(format!(
                "topic '{}' with {} partitions: memory:// holds 1 to {MAX_MEMORY_PARTITIONS} \
                 partitions per topic",
                spec.name, spec.partitions
            )));
        }
        if spec.compacted {
            return Err(Error::unsupported(format!(
                "topic '{}': compaction is not supported by memory://",
                spec.name
            )));
        }
        {
            let mut st = self.broker.state.lock();
            if let Some(t) = st.topics.get(&spec.name) {
                return if t.spec == *spec {
                    Ok(())
                } else {
                    Err(Error::config(format!(
                        "topic '{}' already exists with other settings ({} partitions, retention \
                         {:?} ms / {:?} bytes); requested {} partitions, retention {:?} ms / {:?} \
                         bytes",
                        spec.name,
                        t.spec.partitions,
                        t.spec.retention_ms,
                        t.spec.retention_bytes,
                        spec.partitions,
                        spec.retention_ms,
                        spec.retention_bytes
                    )))
                };
            }
            st.create_topic(spec.clone());
        }
        self.broker.wake();
        Ok(())
    }

    async fn describe_topic(&self, name: &str) -> Result<TopicDescription> {
        let st = self.broker.state.lock();
        let t = st.topics.get(name).ok_or_else(|| not_found(name))?;
        Ok(TopicDescription {
            name: name.to_string(),
            partitions: t.logs.len() as u32,
            retention_ms: t.spec.retention_ms,
            retention_bytes: t.spec.retention_bytes,
            compacted: false,
            watermarks: t
                .logs
                .iter()
                .map(|l| {
                    (
                        Some(Position::Offset(0)),
                        Some(Position::Offset(l.high_watermark())),
                    )
                })
                .collect(),
            options: t.spec.options.clone(),
        })
    }

    async fn group_lag(&self, group: &str, topic: &str) -> Result<Vec<PartitionLag>> {
        let st = self.broker.state.lock();
        let t = st.topics.get(topic).ok_or_else(|| not_found(topic))?;
        let g = st.groups.get(group);
        Ok(t.logs
            .iter()
            .enumerate()
            .map(|(p, log)| {
                let tp = TopicPartition::new(topic, p as i32);
                let hw = log.high_watermark();
                let committed = g.and_then(|g| g.committed(&tp));
                PartitionLag {
                    partition: tp,
                    committed: committed.map(Position::Offset),
                    high_watermark: Some(Position::Offset(hw)),
                    messages: (hw - committed.unwrap_or(0)).max(0) as u64,
                    millis: None,
                }
            })
            .collect())
    }

    async fn delete_topic(&self, name: &str) -> Result<()> {
        let deleted = self.broker.state.lock().delete_topic(name);
        if !deleted {
            return Err(not_found(name));
        }
        self.broker.wake();
        Ok(())
    }
}
