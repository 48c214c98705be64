//! Consumer-group membership on a JetStream key-value bucket (JetStream has no group
//! coordinator; [ADR-8](https://github.com/nats-io/nats-architecture-and-design/blob/main/adr/ADR-8.md)
//! describes the KV layer used here).
//!
//! Bucket `onceflow_groups` holds, per group `G` (characters outside `[-_A-Za-z0-9]` become `_`):
//! - `G.m.<member>`: written by each member at every refresh; a member is alive while its entry
//!   is younger than the session timeout (server time of the entry vs. local time, so member
//!   clocks must agree to well within the session timeout);
//! - `G.o.<topic>.<partition>`: the owner of a partition, taken with compare-and-set.
//!
//! Every member computes the same assignment from the sorted live members (partition `i` of the
//! sorted partition list goes to member `i % n`). A member gives up a partition (commit, release
//! the owner key) before another can take it; the owner of a dead member is taken over by
//! revision, and the dead member learns at its next poll that it lost the partition.

use std::time::Duration;

use async_nats::jetstream::kv::{self, Operation, Store};
use async_nats::jetstream::stream::Stream;
use bytes::Bytes;
use futures::StreamExt;
use onceflow_core::{now_ms, Result, TopicPartition};

use crate::convert::nats_err;
use crate::Shared;

/// Name of the KV bucket holding group membership and partition owners.
pub const GROUPS_BUCKET: &str = "onceflow_groups";

fn token(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

pub(crate) struct Membership {
    kv: Store,
    stream: Stream,
    group: String,
    member: String,
    session: Duration,
}

/// Who owns a partition now.
pub(crate) enum Owner {
    Nobody,
    Me(u64),
    Other { member: String, revision: u64 },
}

impl Membership {
    pub(crate) async fn join(
        shared: &Shared,
        group: &str,
        member: &str,
        session: Duration,
    ) -> Result<Membership> {
        let kv = match shared.js.get_key_value(GROUPS_BUCKET).await {
            Ok(kv) => kv,
            Err(_) => match shared
                .js
                .create_key_value(kv::Config {
                    bucket: GROUPS_BUCKET.to_string(),
                    history: 1,
                    ..Default::default()
                })
                .await
            {
                Ok(kv) => kv,
                Err(e) => match shared.js.get_key_value(GROUPS_BUCKET).await {
                    Ok(kv) => kv,
                    Err(_) => return Err(nats_err("creating the group bucket", e)),
                },
            },
        };
        let stream = shared
            .js
            .get_stream(format!("KV_{GROUPS_BUCKET}"))
            .await
            .map_err(|e| nats_err("group bucket stream", e))?;
        let m = Membership {
            kv,
            stream,
            group: token(group),
            member: token(member),
            session,
        };
        m.heartbeat().await?;
        Ok(m)
    }

    pub(crate) fn member(&self) -> &str {
        &self.member
    }

    fn member_key(&self, member: &str) -> String {
        format!("{}.m.{member}", self.group)
    }

    fn owner_key(&self, tp: &TopicPartition) -> String {
        format!("{}.o.{}.{}", self.group, token(&tp.topic), tp.partition)
    }

    pub(crate) async fn heartbeat(&self) -> Result<()> {
        self.kv
            .put(
                self.member_key(&self.member),
                Bytes::from(now_ms().to_string()),
            )
            .await
            .map(|_| ())
            .map_err(|e| nats_err(format!("group '{}' heartbeat", self.group), e))
    }

    /// Live members, sorted.
    pub(crate) async fn live_members(&self) -> Result<Vec<String>> {
        let filter = format!("$KV.{GROUPS_BUCKET}.{}.m.*", self.group);
        let mut subjects = self
            .stream
            .info_with_subjects(&filter)
            .await
            .map_err(|e| nats_err(format!("members of group '{}'", self.group), e))?;
        let prefix = format!("$KV.{GROUPS_BUCKET}.");
        let mut keys = Vec::new();
        while let Some(s) = subjects.next().await {
            let (subject, _) = s.map_err(|e| nats_err("listing group members", e))?;
            if let Some(k) = subject.strip_prefix(&prefix) {
                keys.push(k.to_string());
            }
        }
        let mut live = Vec::new();
        let now = now_ms();
        for k in keys {
            if let Ok(Some(e)) = self.kv.entry(k.clone()).await {
                let created = (e.created.unix_timestamp_nanos() / 1_000_000) as i64;
                if e.operation == Operation::Put && now - created < self.session.as_millis() as i64
                {
                    if let Some(m) = k.rsplit('.').next() {
                        live.push(m.to_string());
                    }
                }
            }
        }
        live.sort();
        live.dedup();
        Ok(live)
    }

    pub(crate) async fn owner(&self, tp: &TopicPartition) -> Result<Owner> {
        let e = self
            .kv
            .entry(self.owner_key(tp))
            .await
            .map_err(|e| nats_err(format!("owner of {tp}"), e))?;
        Ok(match e {
            Some(e) if e.operation == Operation::Put => {
                let member = String::from_utf8_lossy(&e.value).into_owned();
                if member == self.member {
                    Owner::Me(e.revision)
                } else {
                    Owner::Other {
                        member,
                        revision: e.revision,
                    }
                }
            }
            _ => Owner::Nobody,
        })
    }

    /// Takes `tp` if nobody owns it, or its owner `dead_revision` is dead. Returns the revision
    /// of the owner entry, or `None` if someone else got there first.
    pub(crate) async fn claim(
        &self,
        tp: &TopicPartition,
        dead_revision: Option<u64>,
    ) -> Option<u64> {
        let key = self.owner_key(tp);
        let value = Bytes::from(self.member.clone());
        match dead_revision {
            Some(rev) => self.kv.update(key, value, rev).await.ok(),
            None => self.kv.create(key, value).await.ok(),
        }
    }

    /// Gives `tp` up (only if this member still owns it at `revision`).
    pub(crate) async fn release(&self, tp: &TopicPartition, revision: u64) {
        if let Err(e) = self
            .kv
            .delete_expect_revision(self.owner_key(tp), Some(revision))
            .await
        {
            tracing::debug!(error = %e, %tp, "releasing partition ownership");
        }
    }

    /// Leaves the group.
    pub(crate) async fn leave(&self) {
        if let Err(e) = self.kv.delete(self.member_key(&self.member)).await {
            tracing::debug!(error = %e, "leaving the group");
        }
    }
}

/// Partition `i` of the sorted list goes to member `i % n`; the ones for `me`.
pub(crate) fn assignment_for(
    partitions: &[TopicPartition],
    members: &[String],
    me: &str,
) -> Vec<TopicPartition> {
    let Some(idx) = members.iter().position(|m| m == me) else {
        return Vec::new();
    };
    let mut sorted = partitions.to_vec();
    sorted.sort();
    sorted
        .into_iter()
        .enumerate()
        .filter(|(i, _)| i % members.len() == idx)
        .map(|(_, tp)| tp)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assignment_is_a_partition_of_the_partitions() {
        let tps: Vec<_> = (0..5).map(|p| TopicPartition::new("t", p)).collect();
        let members = vec!["a".to_string(), "b".to_string()];
        let a = assignment_for(&tps, &members, "a");
        let b = assignment_for(&tps, &members, "b");
        assert_eq!(a.len() + b.len(), 5);
        assert!(a.iter().all(|t| !b.contains(t)));
        assert!(assignment_for(&tps, &members, "c").is_empty());
    }
}
