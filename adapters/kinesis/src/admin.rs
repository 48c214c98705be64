//! Stream administration: create, describe, delete, and a group's lag read from the lease
//! table.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use aws_sdk_kinesis::types::StreamStatus;
use onceflow_core::{
    AdminBackend, Error, ErrorKind, PartitionLag, Position, Result, TopicDescription,
    TopicPartition, TopicSpec,
};

use crate::shards::{aws_err, list_shards};
use crate::Shared;

/// Admin handle of a Kinesis connection.
pub struct KinesisAdmin {
    pub(crate) shared: Arc<Shared>,
}

#[async_trait]
impl AdminBackend for KinesisAdmin {
    /// Creates a provisioned stream with `partitions` shards and waits until it is `ACTIVE`.
    /// Retention by age is set with IncreaseStreamRetentionPeriod (hours, 24..=8760, rounded
    /// up); retention by size and compaction do not exist on Kinesis (`Config` error).
    async fn create_topic(&self, spec: &TopicSpec) -> Result<()> {
        if spec.compacted {
            return Err(Error::config(format!(
                "stream '{}': Kinesis has no compaction",
                spec.name
            )));
        }
        if spec.retention_bytes.is_some() {
            return Err(Error::config(format!(
                "stream '{}': Kinesis has no retention by size",
                spec.name
            )));
        }
        if spec.partitions < 1 {
            return Err(Error::config(format!(
                "stream '{}': {} shards, expected at least 1",
                spec.name, spec.partitions
            )));
        }
        self.shared
            .create_stream(&spec.name, spec.partitions)
            .await?;
        if let Some(ms) = spec.retention_ms {
            let hours = i32::try_from(ms.div_ceil(3_600_000).max(24)).unwrap_or(8760);
            self.shared
                .client
                .increase_stream_retention_period()
                .stream_name(&spec.name)
                .retention_period_hours(hours)
                .send()
                .await
                .map_err(|e| aws_err(format!("retention of stream '{}'", spec.name), e))?;
            self.shared.wait_active(&spec.name).await?;
        }
        Ok(())
    }

    /// Partitions = open shards; watermarks are not known without reading (None).
    async fn describe_topic(&self, name: &str) -> Result<TopicDescription> {
        let d = self
            .shared
            .client
            .describe_stream_summary()
            .stream_name(name)
            .send()
            .await
            .map_err(|e| aws_err(format!("DescribeStreamSummary of stream '{name}'"), e))?;
        let s = d.stream_description_summary().ok_or_else(|| {
            Error::new(
                ErrorKind::Platform,
                format!("stream '{name}': empty description"),
            )
        })?;
        let partitions = u32::try_from(s.open_shard_count()).unwrap_or(0);
        let mut options = BTreeMap::new();
        options.insert("status".into(), s.stream_status().as_str().to_string());
        Ok(TopicDescription {
            name: name.to_string(),
            partitions,
            retention_ms: Some(u64::try_from(s.retention_period_hours()).unwrap_or(24) * 3_600_000),
            retention_bytes: None,
            compacted: false,
            watermarks: vec![(None, None); partitions as usize],
            options,
        })
    }

    async fn delete_topic(&self, name: &str) -> Result<()> {
        self.shared
            .client
            .delete_stream()
            .stream_name(name)
            .enforce_consumer_deletion(true)
            .send()
            .await
            .map_err(|e| aws_err(format!("DeleteStream '{name}'"), e))?;
        self.shared.forget_stream(name);
        Ok(())
    }

    /// The group's checkpoints from the lease table, and per shard the records after them
    /// (counted by reading, see [`crate::KinesisConsumer`]'s lag).
    async fn group_lag(&self, group: &str, topic: &str) -> Result<Vec<PartitionLag>> {
        let store = self.shared.checkpoint_store().await?;
        let table = crate::consumer::table_group(group, topic);
        let leases = store.list(&table).await?;
        let mut out = Vec::new();
        for s in list_shards(&self.shared.client, topic).await? {
            let cp = leases
                .iter()
                .find(|l| l.key == s.id)
                .and_then(|l| l.checkpoint.clone());
            let (messages, millis) =
                crate::consumer::count_after(&self.shared, topic, &s.id, cp.as_deref()).await?;
            out.push(PartitionLag {
                partition: TopicPartition::new(topic, s.partition),
                committed: cp
                    .filter(|c| c != crate::SHARD_END)
                    .map(Position::SequenceNumber),
                high_watermark: None,
                messages,
                millis,
            });
        }
        Ok(out)
    }
}

pub(crate) fn is_active(status: &StreamStatus) -> bool {
    matches!(status, StreamStatus::Active)
}
