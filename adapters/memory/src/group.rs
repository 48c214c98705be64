//! Consumer groups: membership, sticky balanced assignment, cooperative (incremental)
//! rebalancing, session timeouts, committed positions and KIP-447 fencing.
//!
//! Assignment is kept as a *target* (who should own each partition) and an *owner* map (who owns
//! it now). A rebalance only changes the target and bumps the generation. A partition whose
//! target moves stays with its owner until that owner's next `poll` revokes it (listener
//! `on_revoked`, positions committed, ownership released); only then can the new target take it
//! at its own `poll` (`on_assigned`). This is Kafka's cooperative-sticky protocol (KIP-429): a
//! partition never has two owners, and partitions that do not move are never revoked.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use onceflow_core::{Error, ErrorKind, GroupMetadata, Result, TopicPartition};
use tokio::time::Instant;

use crate::broker::Topic;

/// A group's state for one partition.
#[derive(Default)]
pub(crate) struct GroupPartition {
    /// Next offset to read (last finished + 1).
    pub committed: Option<i64>,
    /// One past the highest offset ever delivered to this group: anything below is a redelivery.
    pub delivered_end: i64,
    /// Delivery counts of offsets delivered more than once (only redelivered offsets are kept).
    pub redelivered: HashMap<i64, u32>,
}

impl GroupPartition {
    /// Counts one delivery of `offset` and returns its delivery count (1 on first delivery).
    #[inline]
    pub fn delivered(&mut self, offset: i64) -> u32 {
        if offset >= self.delivered_end {
            self.delivered_end = offset + 1;
            1
        } else {
            let c = self.redelivered.entry(offset).or_insert(1);
            *c += 1;
            *c
        }
    }
}

/// A partition owned by a member, with its fetch state.
pub(crate) struct Owned {
    pub tp: TopicPartition,
    /// Next offset to fetch.
    pub pos: i64,
    pub paused: bool,
    /// Fetching waits until then (nack with a delay).
    pub not_before: Option<Instant>,
}

pub(crate) struct Member {
    pub topics: Vec<String>,
    pub session_timeout: Duration,
    pub last_seen: Instant,
    /// Polls in progress: a member inside `poll` is alive (Kafka heartbeats meanwhile).
    pub polling: u32,
    /// Generation this member last synced to (at its poll).
    pub generation: i64,
    /// Group version this member last looked at (skips assignment work when unchanged).
    pub version: u64,
    pub owned: Vec<Owned>,
    /// Round-robin start of the next fetch over owned partitions.
    pub cursor: usize,
    /// Partitions taken away without a revocation (topic deleted), reported at the next poll.
    pub lost: Vec<TopicPartition>,
}

impl Member {
    pub fn new(topics: Vec<String>, session_timeout: Duration, polling: u32) -> Member {
        Member {
            topics,
            session_timeout,
            last_seen: Instant::now(),
            polling,
            generation: 0,
            version: 0,
            owned: Vec::new(),
            cursor: 0,
            lost: Vec::new(),
        }
    }

    pub fn subscribes(&self, topic: &str) -> bool {
        self.topics.iter().any(|t| t == topic)
    }

    pub fn owned_mut(&mut self, tp: &TopicPartition) -> Option<&mut Owned> {
        self.owned.iter_mut().find(|o| o.tp == *tp)
    }
}

pub(crate) struct Group {
    /// Bumped by every rebalance (join, leave, expiry, subscribed topic created or deleted).
    pub generation: i64,
    /// Bumped by every change of target or ownership.
    pub version: u64,
    pub members: BTreeMap<Arc<str>, Member>,
    pub target: HashMap<TopicPartition, Arc<str>>,
    pub owner: HashMap<TopicPartition, Arc<str>>,
    pub parts: HashMap<TopicPartition, GroupPartition>,
    /// Members removed by session timeout, with what they lost; told at their next poll.
    pub expelled: HashMap<Arc<str>, Vec<TopicPartition>>,
}

impl Group {
    pub fn new() -> Group {
        Group {
            generation: 0,
            version: 0,
            members: BTreeMap::new(),
            target: HashMap::new(),
            owner: HashMap::new(),
            parts: HashMap::new(),
            expelled: HashMap::new(),
        }
    }

    pub fn subscribes(&self, topic: &str) -> bool {
        self.members.values().any(|m| m.subscribes(topic))
    }

    pub fn committed(&self, tp: &TopicPartition) -> Option<i64> {
        self.parts.get(tp).and_then(|p| p.committed)
    }

    pub fn set_committed(&mut self, tp: TopicPartition, next: i64) {
        let p = self.parts.entry(tp).or_default();
        p.committed = Some(next);
        if !p.redelivered.is_empty() {
            p.redelivered.retain(|o, _| *o >= next);
        }
    }

    /// Adds a member and rebalances.
    pub fn join(&mut self, id: Arc<str>, member: Member, topics: &HashMap<String, Topic>) {
        self.members.insert(id, member);
        self.rebalance(topics);
    }

    /// Removes a member, freeing what it owns (no revocation, no commit), and rebalances.
    pub fn leave(&mut self, id: &str, topics: &HashMap<String, Topic>) -> Option<Member> {
        let m = self.members.remove(id)?;
        for o in &m.owned {
            self.owner.remove(&o.tp);
        }
        self.rebalance(topics);
        Some(m)
    }

    /// Removes members that have not polled for their session timeout; their partitions are
    /// lost for them and move. Returns whether anyone was removed.
    pub fn reap(&mut self, now: Instant, topics: &HashMap<String, Topic>) -> bool {
        let expired: Vec<Arc<str>> = self
            .members
            .iter()
            .filter(|(_, m)| m.polling == 0 && now >= m.last_seen + m.session_timeout)
            .map(|(id, _)| id.clone())
            .collect();
        if expired.is_empty() {
            return false;
        }
        for id in expired {
            if let Some(m) = self.members.remove(&id) {
                let lost: Vec<TopicPartition> = m.owned.into_iter().map(|o| o.tp).collect();
                for tp in &lost {
                    self.owner.remove(tp);
                }
                tracing::debug!(member = %id, "memory: member expired (session timeout)");
                self.expelled.insert(id, lost);
            }
        }
        self.rebalance(topics);
        true
    }

    /// When the next member (other than `except`) would expire, if it keeps not polling.
    pub fn next_expiry(&self, except: &str) -> Option<Instant> {
        self.members
            .iter()
            .filter(|(id, m)| m.polling == 0 && &***id != except)
            .map(|(_, m)| m.last_seen + m.session_timeout)
            .min()
    }

    /// Forgets a deleted topic: owners lose its partitions, positions are dropped.
    pub fn forget_topic(&mut self, name: &str) {
        self.parts.retain(|tp, _| tp.topic != name);
        self.owner.retain(|tp, _| tp.topic != name);
        self.target.retain(|tp, _| tp.topic != name);
        for m in self.members.values_mut() {
            let mut i = 0;
            while i < m.owned.len() {
                if m.owned[i].tp.topic == name {
                    let o = m.owned.remove(i);
                    m.lost.push(o.tp);
                } else {
                    i += 1;
                }
            }
        }
        self.version += 1;
    }

    /// New generation and a new target assignment: balanced (member counts differ by at most
    /// one where subscriptions allow), sticky (a partition keeps its target or owner when that
    /// member is still subscribed, and moves only to even out counts).
    pub fn rebalance(&mut self, topics: &HashMap<String, Topic>) {
        self.generation += 1;
        self.version += 1;
        let names: BTreeSet<&str> = self
            .members
            .values()
            .flat_map(|m| m.topics.iter().map(String::as_str))
            .collect();
        let mut universe = Vec::new();
        for name in names {
            if let Some(t) = topics.get(name) {
                for p in 0..t.logs.len() {
                    universe.push(TopicPartition::new(name, p as i32));
                }
            }
        }
        let members = &self.members;
        let eligible = |id: &Arc<str>, tp: &TopicPartition| {
            members.get(id).is_some_and(|m| m.subscribes(&tp.topic))
        };
        let mut counts: BTreeMap<Arc<str>, usize> =
            members.keys().map(|k| (k.clone(), 0)).collect();
        let mut target: HashMap<TopicPartition, Arc<str>> = HashMap::new();
        let mut unassigned = Vec::new();
        for tp in universe {
            let keep = self
                .target
                .get(&tp)
                .filter(|m| eligible(m, &tp))
                .or_else(|| self.owner.get(&tp).filter(|m| eligible(m, &tp)))
                .cloned();
            match keep {
                Some(m) => {
                    *counts.get_mut(&m).expect("member counted") += 1;
                    target.insert(tp, m);
                }
                None => unassigned.push(tp),
            }
        }
        for tp in unassigned {
            let best = counts
                .iter()
                .filter(|(id, _)| eligible(id, &tp))
                .min_by_key(|(_, c)| **c)
                .map(|(id, _)| id.clone());
            if let Some(m) = best {
                *counts.get_mut(&m).expect("member counted") += 1;
                target.insert(tp, m);
            }
        }
        // Even out: move one partition at a time from the most loaded member to the least loaded
        // one that can take it, until counts differ by at most one. Each member's partitions are
        // kept in order, so a move finds its partition (the highest that `to` can take) without
        // scanning the whole assignment: a rebalance of P partitions was O(P²) with that scan.
        let mut owned: HashMap<Arc<str>, BTreeSet<TopicPartition>> = HashMap::new();
        for (tp, m) in &target {
            owned.entry(m.clone()).or_default().insert(tp.clone());
        }
        loop {
            let mut order: Vec<(usize, Arc<str>)> =
                counts.iter().map(|(k, c)| (*c, k.clone())).collect();
            order.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
            let mut step = None;
            'find: for (cf, from) in &order {
                for (ct, to) in order.iter().rev() {
                    if *cf <= ct + 1 {
                        break;
                    }
                    let candidate = owned
                        .get(from)
                        .and_then(|tps| tps.iter().rev().find(|tp| eligible(to, tp)));
                    if let Some(tp) = candidate {
                        step = Some((tp.clone(), from.clone(), to.clone()));
                        break 'find;
                    }
                }
            }
            let Some((tp, from, to)) = step else { break };
            *counts.get_mut(&from).expect("member counted") -= 1;
            *counts.get_mut(&to).expect("member counted") += 1;
            if let Some(tps) = owned.get_mut(&from) {
                tps.remove(&tp);
            }
            owned.entry(to.clone()).or_default().insert(tp.clone());
            target.insert(tp, to);
        }
        self.target = target;
    }

    /// KIP-447 zombie fencing of a transactional offset commit: a commit whose generation is
    /// older than the group's fails when a partition in it is no longer owned by that member.
    pub fn check_txn_offsets(
        group: Option<&Group>,
        md: &GroupMetadata,
        positions: &[(TopicPartition, i64)],
    ) -> Result<()> {
        let fenced = |why: String| {
            Error::new(
                ErrorKind::Fenced,
                format!(
                    "transactional offset commit for group '{}' by member '{}' (generation {}) is \
                     fenced: {why}",
                    md.group, md.member_id, md.generation
                ),
            )
        };
        let Some(g) = group else {
            return if md.generation < 0 {
                Ok(())
            } else {
                Err(fenced("the group has no members".into()))
            };
        };
        if md.generation < 0 {
            return if g.members.is_empty() {
                Ok(())
            } else {
                Err(fenced("the group has active members".into()))
            };
        }
        if md.generation > g.generation {
            return Err(fenced(format!(
                "the group is only at generation {}",
                g.generation
            )));
        }
        if md.generation < g.generation {
            for (tp, _) in positions {
                if g.owner.get(tp).map(|m| &**m) != Some(md.member_id.as_str()) {
                    return Err(fenced(format!(
                        "the group is at generation {} and {tp} is no longer owned by this member",
                        g.generation
                    )));
                }
            }
        }
        Ok(())
    }
}
