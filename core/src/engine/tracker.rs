//! Per-partition progress shared between the engine loop and the rebalance listener: the last
//! finished position, the last committed one, and a generation that fences work taken before a
//! revocation or a rewind.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::backend::RebalanceListener;
use crate::metrics::{Metric, Metrics};
use crate::model::{Position, TopicPartition};

#[derive(Debug, Default)]
struct PartitionProgress {
    /// Position of the last message finished (succeeded, dead-lettered, skipped), in order.
    finished: Option<Position>,
    /// Last position handed to a successful commit.
    committed: Option<Position>,
    /// Messages finished since the last commit.
    pending: u64,
    /// A message at or before `finished` was finished again (a per-message redelivery on
    /// JetStream or Pulsar): commit again, so the platform acknowledges the redelivered copy.
    dirty: bool,
}

#[derive(Debug, Default)]
struct Inner {
    partitions: HashMap<TopicPartition, PartitionProgress>,
    /// Bumped per partition on revocation / rewind: work tagged with an older generation is
    /// fenced.
    generations: HashMap<TopicPartition, u64>,
    revoked_since_check: bool,
}

/// Progress of every partition this worker owns.
#[derive(Clone, Debug)]
pub(crate) struct Tracker {
    inner: Arc<Mutex<Inner>>,
    metrics: Metrics,
}

impl Tracker {
    pub(crate) fn new(metrics: Metrics) -> Self {
        Tracker {
            inner: Arc::default(),
            metrics,
        }
    }

    /// The current generation of a partition.
    pub(crate) fn generation(&self, tp: &TopicPartition) -> u64 {
        *self.inner.lock().generations.get(tp).unwrap_or(&0)
    }

    /// Fences work of `tp` taken before now (used on rewind).
    pub(crate) fn bump(&self, tp: &TopicPartition) {
        *self.inner.lock().generations.entry(tp.clone()).or_default() += 1;
    }

    /// Marks `position` finished in `tp`, with `messages` messages finished up to it (they count
    /// toward [`EngineConfig::commit_every`](crate::engine::EngineConfig::commit_every)), unless
    /// work of `generation` has been fenced. Returns whether it was recorded.
    pub(crate) fn finish(
        &self,
        tp: &TopicPartition,
        generation: u64,
        position: Position,
        messages: u64,
    ) -> bool {
        let mut g = self.inner.lock();
        if *g.generations.get(tp).unwrap_or(&0) != generation {
            return false;
        }
        let p = g.partitions.entry(tp.clone()).or_default();
        let newer = match &p.finished {
            Some(f) => position > *f,
            None => true,
        };
        if newer {
            p.finished = Some(position);
        } else {
            p.dirty = true;
        }
        p.pending += messages;
        true
    }

    /// Positions finished but not committed yet, and how many messages they cover.
    pub(crate) fn uncommitted(&self) -> (Vec<(TopicPartition, Position)>, u64) {
        let g = self.inner.lock();
        let mut out = Vec::new();
        let mut n = 0;
        for (tp, p) in &g.partitions {
            if let Some(f) = &p.finished {
                if p.dirty || p.committed.as_ref() != Some(f) {
                    out.push((tp.clone(), f.clone()));
                    n += p.pending;
                }
            }
        }
        (out, n)
    }

    /// Records a successful commit of `positions`.
    pub(crate) fn committed(&self, positions: &[(TopicPartition, Position)]) {
        let mut g = self.inner.lock();
        for (tp, pos) in positions {
            if let Some(p) = g.partitions.get_mut(tp) {
                p.committed = Some(pos.clone());
                if p.finished.as_ref() == Some(pos) {
                    p.pending = 0;
                    p.dirty = false;
                }
            }
        }
    }

    /// Forgets a partition (moved away or fenced) and fences its in-flight work.
    pub(crate) fn forget(&self, tp: &TopicPartition) {
        let mut g = self.inner.lock();
        g.partitions.remove(tp);
        *g.generations.entry(tp.clone()).or_default() += 1;
    }

    /// Forgets every partition's finished-but-uncommitted progress (after a transaction abort the
    /// consumer rewinds to the committed positions).
    pub(crate) fn rewind_all(&self) -> Vec<TopicPartition> {
        let mut g = self.inner.lock();
        let tps: Vec<TopicPartition> = g.partitions.keys().cloned().collect();
        for tp in &tps {
            if let Some(p) = g.partitions.get_mut(tp) {
                p.finished = p.committed.clone();
                p.pending = 0;
                p.dirty = false;
            }
            *g.generations.entry(tp.clone()).or_default() += 1;
        }
        tps
    }

    /// Whether a revocation or loss happened since the last call.
    pub(crate) fn take_revoked_flag(&self) -> bool {
        std::mem::take(&mut self.inner.lock().revoked_since_check)
    }
}

/// Rebalance listener of the idempotent consumer: commits finished work of revoked partitions
/// (the backend commits the positions returned) and fences their in-flight work.
pub(crate) struct CommitOnRevoke {
    pub(crate) tracker: Tracker,
    /// In transactional mode positions are committed only inside transactions, so revocation
    /// returns nothing and the pipeline aborts its open transaction instead.
    pub(crate) transactional: bool,
}

impl RebalanceListener for CommitOnRevoke {
    fn on_assigned(&self, partitions: &[TopicPartition]) {
        self.tracker.metrics.add(Metric::Rebalance, 1);
        // The count and the first few: a list of 100 000 partitions made a 6 MB log line.
        let first = &partitions[..partitions.len().min(8)];
        tracing::debug!(count = partitions.len(), ?first, "partitions assigned");
    }

    fn on_revoked(&self, partitions: &[TopicPartition]) -> Vec<(TopicPartition, Position)> {
        self.tracker.metrics.add(Metric::Rebalance, 1);
        let (uncommitted, _) = self.tracker.uncommitted();
        let mut out = Vec::new();
        {
            let mut g = self.tracker.inner.lock();
            g.revoked_since_check = true;
        }
        for tp in partitions {
            if !self.transactional {
                if let Some((_, pos)) = uncommitted.iter().find(|(t, _)| t == tp) {
                    out.push((tp.clone(), pos.clone()));
                    self.tracker.metrics.add(Metric::Commit, 1);
                }
            }
            self.tracker.forget(tp);
        }
        tracing::debug!(?partitions, committing = out.len(), "partitions revoked");
        out
    }

    fn on_lost(&self, partitions: &[TopicPartition]) {
        self.tracker.metrics.add(Metric::Rebalance, 1);
        self.tracker
            .metrics
            .add(Metric::Fenced, partitions.len() as u64);
        self.tracker.inner.lock().revoked_since_check = true;
        for tp in partitions {
            self.tracker.forget(tp);
        }
        tracing::warn!(
            ?partitions,
            "partitions lost without commit; in-flight work fenced"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commits_in_order_and_recommits_a_redelivered_older_message() {
        let t = Tracker::new(Metrics::new("memory", "g"));
        let tp = TopicPartition::new("t", 0);
        // Two chunks, of 3 and 2 messages: 5 messages toward `commit_every`.
        assert!(t.finish(&tp, 0, Position::Sequence(3), 3));
        assert!(t.finish(&tp, 0, Position::Sequence(5), 2));
        let (u, n) = t.uncommitted();
        assert_eq!(
            (u.clone(), n),
            (vec![(tp.clone(), Position::Sequence(5))], 5)
        );
        t.committed(&u);
        assert!(t.uncommitted().0.is_empty());
        // A nacked message redelivered after a later one was committed: commit again.
        assert!(t.finish(&tp, 0, Position::Sequence(3), 1));
        assert_eq!(t.uncommitted().0, vec![(tp.clone(), Position::Sequence(5))]);
        t.committed(&[(tp.clone(), Position::Sequence(5))]);
        assert!(t.uncommitted().0.is_empty());
        // Fenced work is not recorded.
        t.bump(&tp);
        assert!(!t.finish(&tp, 0, Position::Sequence(9), 1));
    }
}
