//! Streams as topics: create, describe, delete.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use async_trait::async_trait;
use onceflow_core::{
    AdminBackend, Error, ErrorKind, PartitionLag, Position, Result, TopicDescription,
    TopicPartition, TopicSpec,
};

use crate::consumer::{durable_lag, end_of};
use crate::convert::nats_err;
use crate::naming::{self, PARTITIONS_METADATA};
use crate::Shared;

/// How many messages the stream holds on `subject` (stream info with a subjects filter).
async fn messages_on(stream: &async_nats::jetstream::stream::Stream, subject: &str) -> Result<u64> {
    use futures::TryStreamExt;
    let mut counts = stream
        .info_with_subjects(subject)
        .await
        .map_err(|e| nats_err(format!("messages of subject '{subject}'"), e))?;
    while let Some((s, n)) = counts
        .try_next()
        .await
        .map_err(|e| nats_err(format!("messages of subject '{subject}'"), e))?
    {
        if s == subject {
            return Ok(n as u64);
        }
    }
    Ok(0)
}

/// Stream administration (`$JS.API.STREAM.*`, <https://docs.nats.io/nats-concepts/jetstream/streams>).
pub struct JetStreamAdmin {
    pub(crate) shared: Arc<Shared>,
}

/// The stream configuration onceflow creates for a topic spec. Options: `duplicate_window_ms`,
/// `allow_atomic`, `storage` (`file` / `memory`), `replicas`, `max_msg_size`.
pub(crate) fn stream_config(shared: &Shared, spec: &TopicSpec) -> Result<StreamConfig> {
    naming::check_topic(&spec.name)?;
    if spec.compacted {
        return Err(Error::unsupported(format!(
            "topic '{}': compaction by key is not supported on JetStream (max_msgs_per_subject \
             keeps the newest message per subject, not per key)",
            spec.name
        )));
    }
    let mut cfg = StreamConfig {
        name: spec.name.clone(),
        subjects: naming::stream_subjects(&spec.name, spec.partitions),
        allow_direct: true,
        allow_atomic_publish: shared.options.allow_atomic,
        storage: if shared.options.memory_storage {
            StorageType::Memory
        } else {
            StorageType::File
        },
        ..Default::default()
    };
    if let Some(w) = shared.options.duplicate_window {
        cfg.duplicate_window = w;
    }
    if let Some(ms) = spec.retention_ms {
        cfg.max_age = Duration::from_millis(ms);
    }
    if let Some(b) = spec.retention_bytes {
        // JetStream limits bytes per stream; onceflow's retention is per partition.
        cfg.max_bytes = (b.saturating_mul(u64::from(spec.partitions))).min(i64::MAX as u64) as i64;
    }
    cfg.metadata
        .insert(PARTITIONS_METADATA.to_string(), spec.partitions.to_string());
    for (k, v) in &spec.options {
        let bad = |what: &str| Error::config(format!("stream option '{k}={v}': expected {what}"));
        match k.as_str() {
            "duplicate_window_ms" => {
                cfg.duplicate_window =
                    Duration::from_millis(v.parse().map_err(|_| bad("milliseconds"))?)
            }
            "allow_atomic" => {
                cfg.allow_atomic_publish = v.parse().map_err(|_| bad("true/false"))?
            }
            "storage" => {
                cfg.storage = match v.as_str() {
                    "file" => StorageType::File,
                    "memory" => StorageType::Memory,
                    _ => return Err(bad("file or memory")),
                }
            }
            "replicas" => cfg.num_replicas = v.parse().map_err(|_| bad("a replica count"))?,
            "max_msg_size" => cfg.max_message_size = v.parse().map_err(|_| bad("bytes"))?,
            _ => {
                return Err(Error::config(format!(
                    "unknown stream option '{k}': expected duplicate_window_ms, allow_atomic, \
                     storage, replicas or max_msg_size"
                )))
            }
        }
    }
    Ok(cfg)
}

#[async_trait]
impl AdminBackend for JetStreamAdmin {
    async fn create_topic(&self, spec: &TopicSpec) -> Result<()> {
        let cfg = stream_config(&self.shared, spec)?;
        self.shared.js.create_stream(cfg).await.map_err(|e| {
            let err = nats_err(format!("creating stream '{}'", spec.name), e);
            if err.message().contains("10058") || err.message().contains("already in use") {
                Error::config(format!(
                    "stream '{}' exists with other settings: {}",
                    spec.name,
                    err.message()
                ))
            } else {
                err
            }
        })?;
        self.shared.forget_topic(&spec.name);
        Ok(())
    }

    async fn describe_topic(&self, name: &str) -> Result<TopicDescription> {
        naming::check_topic(name)?;
        let stream = self.shared.get_stream(name).await?;
        let info = stream.cached_info().clone();
        let partitions = crate::partitions_of(&info.config);
        let mut watermarks = Vec::with_capacity(partitions as usize);
        if partitions <= 1 {
            let s = &info.state;
            let end = Some(Position::Sequence(s.last_sequence + 1));
            let first = (s.messages > 0).then_some(Position::Sequence(s.first_sequence));
            watermarks.push((first, end));
        } else {
            for p in 0..partitions as i32 {
                let subject = naming::subject(name, partitions, p);
                let first = stream
                    .get_first_raw_message_by_subject(&subject, 0)
                    .await
                    .ok()
                    .map(|m| Position::Sequence(m.sequence));
                let last = stream
                    .get_last_raw_message_by_subject(&subject)
                    .await
                    .ok()
                    .map(|m| Position::Sequence(m.sequence + 1));
                watermarks.push((first, last));
            }
        }
        let c = &info.config;
        let mut options = BTreeMap::new();
        options.insert(
            "duplicate_window_ms".to_string(),
            c.duplicate_window.as_millis().to_string(),
        );
        options.insert(
            "allow_atomic".to_string(),
            c.allow_atomic_publish.to_string(),
        );
        options.insert("subjects".to_string(), c.subjects.join(","));
        options.insert(
            "storage".to_string(),
            match c.storage {
                StorageType::Memory => "memory",
                StorageType::File => "file",
            }
            .to_string(),
        );
        options.insert("replicas".to_string(), c.num_replicas.to_string());
        // What an ack promises (see JetStreamPlatform::durability).
        let durability = self.shared.check_durability(name, false).await?;
        options.insert("sync".to_string(), durability.sync.to_string());
        options.insert(
            "durable_on_ack".to_string(),
            match durability.durable_on_ack {
                Some(true) => "true",
                Some(false) => "false",
                None => "unknown",
            }
            .to_string(),
        );
        options.insert("messages".to_string(), info.state.messages.to_string());
        Ok(TopicDescription {
            name: name.to_string(),
            partitions,
            retention_ms: (!c.max_age.is_zero()).then_some(c.max_age.as_millis() as u64),
            retention_bytes: (c.max_bytes > 0).then(|| c.max_bytes as u64 / u64::from(partitions)),
            compacted: false,
            watermarks,
            options,
        })
    }

    /// Each partition's durable of `group` (`<group>-<partition>`, made when the group first
    /// consumed the topic), read from its [consumer info] without joining the group, as the
    /// consumer's own `lag()`: `num_pending` (not delivered yet) + `num_ack_pending`
    /// (delivered, not acked) messages, committed at the ack floor + 1. A partition without a
    /// durable counts every message of its subject; a group with no durable on the topic is
    /// `NotFound`.
    ///
    /// [consumer info]: https://docs.nats.io/nats-concepts/jetstream/consumers
    async fn group_lag(&self, group: &str, topic: &str) -> Result<Vec<PartitionLag>> {
        naming::check_topic(topic)?;
        let stream = self.shared.get_stream(topic).await?;
        let partitions = crate::partitions_of(&stream.cached_info().config);
        let mut out = Vec::with_capacity(partitions as usize);
        let mut durables = 0;
        for p in 0..partitions as i32 {
            let tp = TopicPartition::new(topic, p);
            let subject = naming::subject(topic, partitions, p);
            let durable = naming::durable(group, p);
            match durable_lag(&stream, &tp, &subject, &durable).await? {
                Some(lag) => {
                    durables += 1;
                    out.push(lag);
                }
                None => out.push(PartitionLag {
                    partition: tp,
                    committed: None,
                    high_watermark: end_of(&stream, &subject).await,
                    messages: messages_on(&stream, &subject).await?,
                    millis: None,
                }),
            }
        }
        if durables == 0 {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!(
                    "group '{group}' has no durable consumer on topic '{topic}' (expected \
                     '{}' and the like): it has not consumed the topic",
                    naming::durable(group, 0)
                ),
            ));
        }
        Ok(out)
    }

    async fn delete_topic(&self, name: &str) -> Result<()> {
        naming::check_topic(name)?;
        self.shared.forget_topic(name);
        match self.shared.js.delete_stream(name).await {
            Ok(_) => Ok(()),
            Err(e) => {
                let err = nats_err(format!("deleting stream '{name}'"), e);
                if err.kind() == ErrorKind::NotFound {
                    Err(Error::new(
                        ErrorKind::NotFound,
                        format!("topic '{name}' does not exist (no stream of that name)"),
                    ))
                } else {
                    Err(err)
                }
            }
        }
    }
}
