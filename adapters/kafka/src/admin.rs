//! Topic administration through librdkafka's Admin API (KIP-4 CreateTopics / DeleteTopics,
//! DescribeConfigs).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use onceflow_core::{
    AdminBackend, Error, ErrorKind, PartitionLag, Position, Result, TopicDescription,
    TopicPartition, TopicSpec,
};
use rdkafka::admin::{
    AdminClient, AdminOptions, ConfigSource, NewTopic, ResourceSpecifier, TopicReplication,
};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::types::RDKafkaRespErr;

use crate::config::KafkaConfig;
use crate::errors;

/// Topic settings onceflow maps to [`TopicSpec`] fields.
const RETENTION_MS: &str = "retention.ms";
const RETENTION_BYTES: &str = "retention.bytes";
const CLEANUP_POLICY: &str = "cleanup.policy";

/// The admin handle of a Kafka cluster.
pub struct KafkaAdmin {
    client: Arc<AdminClient<DefaultClientContext>>,
    timeout: Duration,
    kafka: KafkaConfig,
}

impl std::fmt::Debug for KafkaAdmin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaAdmin").finish()
    }
}

fn not_found(name: &str) -> Error {
    Error::new(
        ErrorKind::NotFound,
        format!("topic '{name}' does not exist"),
    )
}

/// Kafka's rule for topic names (`org.apache.kafka.common.internals.Topic.validate`): 1 to 249
/// characters of `[a-zA-Z0-9._-]`, neither `.` nor `..`.
pub(crate) fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 249
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(Error::config(format!(
            "invalid topic name '{}': expected 1 to 249 characters of [a-zA-Z0-9._-]",
            onceflow_core::shown(name)
        )))
    }
}

impl KafkaAdmin {
    pub(crate) fn new(kafka: KafkaConfig) -> Result<KafkaAdmin> {
        // Producer-only properties would make the admin client warn; keep the connection's.
        let mut config = kafka.client_config(&BTreeMap::new());
        // Describing a missing topic must not create it (brokers with auto.create.topics.enable).
        config.set("allow.auto.create.topics", "false");
        let client = config
            .create::<AdminClient<DefaultClientContext>>()
            .map_err(|e| errors::map(e, "creating the Kafka admin client"))?;
        Ok(KafkaAdmin {
            client: Arc::new(client),
            timeout: kafka.timeout,
            kafka,
        })
    }

    fn options(&self) -> AdminOptions {
        AdminOptions::new().operation_timeout(Some(self.timeout))
    }

    /// Topic configs as the broker reports them (explicitly set or default).
    async fn configs(&self, name: &str) -> Result<BTreeMap<String, (String, bool)>> {
        let res = self
            .client
            .describe_configs(&[ResourceSpecifier::Topic(name)], &self.options())
            .await
            .map_err(|e| errors::map(e, format_args!("describe configs of topic '{name}'")))?;
        let mut out = BTreeMap::new();
        for r in res {
            match r {
                Ok(cr) => {
                    for e in cr.entries {
                        if let Some(v) = e.value {
                            let explicit = matches!(e.source, ConfigSource::DynamicTopic);
                            out.insert(e.name, (v, explicit));
                        }
                    }
                }
                Err(RDKafkaErrorCode::UnknownTopicOrPartition) => return Err(not_found(name)),
                Err(code) => {
                    return Err(Error::new(
                        ErrorKind::Platform,
                        format!("describe configs of topic '{name}': {code}"),
                    ))
                }
            }
        }
        Ok(out)
    }
}

fn spec_matches(spec: &TopicSpec, d: &TopicDescription) -> bool {
    d.partitions == spec.partitions
        && (spec.retention_ms.is_none() || spec.retention_ms == d.retention_ms)
        && (spec.retention_bytes.is_none() || spec.retention_bytes == d.retention_bytes)
        && spec.compacted == d.compacted
}

#[async_trait]
impl AdminBackend for KafkaAdmin {
    /// Committed offsets of `group` (read without joining it, so the group is not rebalanced)
    /// against each partition's high watermark.
    async fn group_lag(&self, group: &str, topic: &str) -> Result<Vec<PartitionLag>> {
        validate_name(topic)?;
        let mut config = self.kafka.client_config(&BTreeMap::new());
        config.set("group.id", group);
        config.set("enable.auto.commit", "false");
        config.set("isolation.level", "read_uncommitted");
        config.set("allow.auto.create.topics", "false");
        let (group, topic, timeout) = (group.to_string(), topic.to_string(), self.timeout);
        tokio::task::spawn_blocking(move || {
            use rdkafka::consumer::{BaseConsumer, Consumer};
            let c: BaseConsumer = config
                .create()
                .map_err(|e| errors::map(e, format_args!("offset reader of group '{group}'")))?;
            let md = c
                .fetch_metadata(Some(&topic), timeout)
                .map_err(|e| errors::map(e, format_args!("metadata of topic '{topic}'")))?;
            let partitions: Vec<i32> = md
                .topics()
                .iter()
                .filter(|t| t.name() == topic && t.error().is_none())
                .flat_map(|t| t.partitions().iter().map(|p| p.id()))
                .collect();
            if partitions.is_empty() {
                return Err(not_found(&topic));
            }
            let mut tpl = rdkafka::TopicPartitionList::new();
            for p in &partitions {
                tpl.add_partition(&topic, *p);
            }
            let committed = c.committed_offsets(tpl, timeout).map_err(|e| {
                errors::map(e, format_args!("committed offsets of group '{group}'"))
            })?;
            let mut out = Vec::with_capacity(partitions.len());
            for p in partitions {
                let (low, high) = c
                    .fetch_watermarks(&topic, p, timeout)
                    .map_err(|e| errors::map(e, format_args!("watermarks of {topic}[{p}]")))?;
                let com = match committed.find_partition(&topic, p).map(|e| e.offset()) {
                    Some(rdkafka::Offset::Offset(o)) if o >= 0 => Some(o),
                    _ => None,
                };
                out.push(PartitionLag {
                    partition: TopicPartition::new(topic.clone(), p),
                    committed: com.map(Position::Offset),
                    high_watermark: Some(Position::Offset(high)),
                    messages: (high - com.unwrap_or(low)).max(0) as u64,
                    millis: None,
                });
            }
            Ok(out)
        })
        .await
        .map_err(|e| Error::new(ErrorKind::Platform, format!("group lag task failed: {e}")))?
    }

    async fn create_topic(&self, spec: &TopicSpec) -> Result<()> {
        validate_name(&spec.name)?;
        if spec.partitions < 1 || spec.partitions > onceflow_core::MAX_PARTITIONS {
            return Err(Error::config(format!(
                "topic '{}' with {} partitions: expected 1 to {}",
                spec.name,
                spec.partitions,
                onceflow_core::MAX_PARTITIONS
            )));
        }
        let mut options = spec.options.clone();
        let replication: i32 = match options.remove("replication.factor") {
            Some(v) => v.parse().map_err(|_| {
                Error::config(format!(
                    "replication.factor '{v}' of topic '{}': expected a number",
                    spec.name
                ))
            })?,
            // KIP-464: -1 = the broker's default.replication.factor.
            None => -1,
        };
        let rms = spec.retention_ms.map(|v| v.to_string());
        let rbytes = spec.retention_bytes.map(|v| v.to_string());
        let mut nt = NewTopic::new(
            &spec.name,
            spec.partitions as i32,
            TopicReplication::Fixed(replication),
        );
        if let Some(v) = &rms {
            nt = nt.set(RETENTION_MS, v);
        }
        if let Some(v) = &rbytes {
            nt = nt.set(RETENTION_BYTES, v);
        }
        if spec.compacted {
            nt = nt.set(CLEANUP_POLICY, "compact");
        }
        for (k, v) in &options {
            nt = nt.set(k, v);
        }
        let res = self
            .client
            .create_topics([&nt], &self.options())
            .await
            .map_err(|e| errors::map(e, format_args!("create topic '{}'", spec.name)))?;
        for r in res {
            match r {
                Ok(_) => {}
                Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {
                    let d = self.describe_topic(&spec.name).await?;
                    if spec_matches(spec, &d) {
                        return Ok(());
                    }
                    return Err(Error::config(format!(
                        "topic '{}' already exists with other settings ({} partitions, retention \
                         {:?} ms / {:?} bytes, compacted {}); requested {} partitions, retention \
                         {:?} ms / {:?} bytes, compacted {}",
                        spec.name,
                        d.partitions,
                        d.retention_ms,
                        d.retention_bytes,
                        d.compacted,
                        spec.partitions,
                        spec.retention_ms,
                        spec.retention_bytes,
                        spec.compacted
                    )));
                }
                Err((name, code)) => {
                    let kind = match code {
                        RDKafkaErrorCode::InvalidTopic
                        | RDKafkaErrorCode::InvalidPartitions
                        | RDKafkaErrorCode::InvalidReplicationFactor
                        | RDKafkaErrorCode::InvalidConfig
                        | RDKafkaErrorCode::InvalidRequest => ErrorKind::Config,
                        _ => ErrorKind::Platform,
                    };
                    return Err(Error::new(kind, format!("create topic '{name}': {code}")));
                }
            }
        }
        // CreateTopics returns before every broker has the metadata; wait until it shows.
        let deadline = tokio::time::Instant::now() + self.timeout;
        loop {
            match self.describe_topic(&spec.name).await {
                Ok(d) if d.partitions == spec.partitions => return Ok(()),
                Ok(_) | Err(_) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Ok(_) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    }

    async fn describe_topic(&self, name: &str) -> Result<TopicDescription> {
        validate_name(name)?;
        // DescribeConfigs first: it answers UNKNOWN_TOPIC_OR_PARTITION without creating anything.
        let configs = self.configs(name).await?;
        let client = self.client.clone();
        let timeout = self.timeout;
        let topic = name.to_string();
        let (partitions, watermarks) = tokio::task::spawn_blocking(move || {
            let inner = client.inner();
            let md = inner
                .fetch_metadata(Some(&topic), timeout)
                .map_err(|e| errors::map(e, format_args!("metadata of topic '{topic}'")))?;
            let Some(t) = md.topics().iter().find(|t| t.name() == topic) else {
                return Err(not_found(&topic));
            };
            match t.error() {
                None => {}
                Some(RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART) => {
                    return Err(not_found(&topic))
                }
                Some(e) => {
                    return Err(Error::new(
                        ErrorKind::Platform,
                        format!("metadata of topic '{topic}': {e:?}"),
                    ))
                }
            }
            let mut ids: Vec<i32> = t.partitions().iter().map(|p| p.id()).collect();
            ids.sort_unstable();
            let mut wm = Vec::with_capacity(ids.len());
            for p in &ids {
                let (low, high) = inner
                    .fetch_watermarks(&topic, *p, timeout)
                    .map_err(|e| errors::map(e, format_args!("watermarks of {topic}[{p}]")))?;
                wm.push((Some(Position::Offset(low)), Some(Position::Offset(high))));
            }
            Ok((ids.len() as u32, wm))
        })
        .await
        .map_err(|e| errors::join(e, "describe topic"))??;
        let num = |k: &str| {
            configs
                .get(k)
                .filter(|(_, explicit)| *explicit)
                .and_then(|(v, _)| v.parse::<i64>().ok())
                .filter(|v| *v >= 0)
                .map(|v| v as u64)
        };
        let compacted = configs
            .get(CLEANUP_POLICY)
            .is_some_and(|(v, _)| v.split(',').any(|p| p.trim() == "compact"));
        let options = configs
            .iter()
            .filter(|(_, (_, explicit))| *explicit)
            .map(|(k, (v, _))| (k.clone(), v.clone()))
            .collect();
        Ok(TopicDescription {
            name: name.to_string(),
            partitions,
            retention_ms: num(RETENTION_MS),
            retention_bytes: num(RETENTION_BYTES),
            compacted,
            watermarks,
            options,
        })
    }

    async fn delete_topic(&self, name: &str) -> Result<()> {
        validate_name(name)?;
        let res = self
            .client
            .delete_topics(&[name], &self.options())
            .await
            .map_err(|e| errors::map(e, format_args!("delete topic '{name}'")))?;
        for r in res {
            match r {
                Ok(_) => {}
                Err((_, RDKafkaErrorCode::UnknownTopicOrPartition)) => return Err(not_found(name)),
                Err((n, code)) => {
                    return Err(Error::new(
                        ErrorKind::Platform,
                        format!("delete topic '{n}': {code}"),
                    ))
                }
            }
        }
        Ok(())
    }
}
