//! What a binding's `commit()` without arguments commits: per partition, the position of the
//! last message the binding handed to its user.
//!
//! A binding polls batches and hands their messages out one by one (an iterator) or whole
//! (`poll()`, a batch iterator). It keeps only a count, how far into the latest batch it has
//! handed messages out, and gives that count to [`Yielded::polled`] with the next batch and to
//! [`Yielded::positions`] when the user commits; the tracker works out the positions, once per
//! batch rather than once per message.

use std::collections::HashMap;

use onceflow::{Message, Position, TopicPartition};
use parking_lot::Mutex;

/// How far into the latest batch the user got: `All` for a batch handed out whole (`poll()`,
/// a batch iterator), `First(n)` for the first `n` messages of an iterator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandedOut {
    /// Every message of the batch.
    All,
    /// The first `n` messages.
    First(usize),
}

impl HandedOut {
    /// From a host's optional count: none means the whole batch.
    pub fn from_count(count: Option<usize>) -> Self {
        count.map_or(HandedOut::All, HandedOut::First)
    }
}

#[derive(Debug, Default)]
struct State {
    /// The latest batch's runs of one partition: the index of the run's first message, the
    /// index one past its last, and the partition.
    runs: Vec<(usize, usize, TopicPartition)>,
    /// The position of each message of the latest batch.
    positions: Vec<Position>,
    /// Per partition, the last message handed out before the part of the latest batch
    /// that `runs` still holds.
    settled: HashMap<TopicPartition, Position>,
}

impl State {
    /// The last message handed out of each run of the latest batch, `handed` saying how far
    /// the user got: a run cut short counts up to its last message handed out.
    fn handed_out(&self, handed: HandedOut) -> impl Iterator<Item = (&TopicPartition, &Position)> {
        let end = match handed {
            HandedOut::All => self.positions.len(),
            HandedOut::First(n) => n.min(self.positions.len()),
        };
        self.runs
            .iter()
            .filter(move |(start, _, _)| *start < end)
            .map(move |(_, run_end, tp)| (tp, &self.positions[(*run_end).min(end) - 1]))
    }

    /// Moves what was handed out of the latest batch into `settled`.
    fn settle(&mut self, handed: HandedOut) {
        let done: Vec<_> = self
            .handed_out(handed)
            .map(|(tp, p)| (tp.clone(), p.clone()))
            .collect();
        self.settled.extend(done);
    }
}

/// The per-consumer tracker; one per binding consumer object, shared by its methods.
#[derive(Debug, Default)]
pub struct Yielded {
    state: Mutex<State>,
}

impl Yielded {
    /// A new batch arrived; `previous` is how much of the batch before it was handed out.
    /// An empty batch changes nothing (the previous batch stays the latest).
    pub fn polled(&self, batch: &[Message], previous: HandedOut) {
        if batch.is_empty() {
            return;
        }
        let mut s = self.state.lock();
        s.settle(previous);
        s.runs.clear();
        s.positions.clear();
        let mut start = 0;
        for (i, m) in batch.iter().enumerate() {
            let next = batch.get(i + 1);
            if next.is_none_or(|n| n.partition != m.partition || n.topic != m.topic) {
                s.runs.push((start, i + 1, m.topic_partition()));
                start = i + 1;
            }
            s.positions.push(m.position.clone());
        }
    }

    /// The positions `commit()` commits: per partition, the last message handed out, `latest`
    /// saying how much of the latest batch was. Sorted by topic and partition.
    pub fn positions(&self, latest: HandedOut) -> Vec<(TopicPartition, Position)> {
        let s = self.state.lock();
        let mut out = s.settled.clone();
        out.extend(s.handed_out(latest).map(|(tp, p)| (tp.clone(), p.clone())));
        let mut out: Vec<_> = out.into_iter().collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Forgets `partition`: after a seek, what was handed out before it is not what the
    /// user processes next; after a revocation, the partition is another member's.
    pub fn forget(&self, partition: &TopicPartition) {
        let mut s = self.state.lock();
        s.settled.remove(partition);
        s.runs.retain(|(_, _, tp)| tp != partition);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(partition: i32, offset: i64) -> Message {
        Message {
            topic: "t".into(),
            partition,
            position: Position::Offset(offset),
            key: None,
            payload: Default::default(),
            headers: Default::default(),
            timestamp: None,
            delivery_count: 1,
        }
    }

    fn at(v: &[(TopicPartition, Position)]) -> Vec<(i32, i64)> {
        v.iter()
            .map(|(tp, p)| match p {
                Position::Offset(o) => (tp.partition, *o),
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn commit_takes_the_last_message_handed_out_of_each_partition() {
        let y = Yielded::default();
        assert!(y.positions(HandedOut::All).is_empty());
        // p0 0..3, p1 0..2, p0 3..5: an iterator stopped after 4 messages handed out p0's
        // first run and half of p1's.
        let batch = [
            m(0, 0),
            m(0, 1),
            m(0, 2),
            m(1, 0),
            m(1, 1),
            m(0, 3),
            m(0, 4),
        ];
        y.polled(&batch, HandedOut::All);
        assert_eq!(at(&y.positions(HandedOut::First(0))), vec![]);
        assert_eq!(at(&y.positions(HandedOut::First(4))), vec![(0, 2), (1, 0)]);
        assert_eq!(at(&y.positions(HandedOut::First(6))), vec![(0, 3), (1, 1)]);
        assert_eq!(at(&y.positions(HandedOut::All)), vec![(0, 4), (1, 1)]);
        // The next batch settles what was handed out of this one; an empty poll changes
        // nothing.
        y.polled(&[], HandedOut::First(1));
        y.polled(&[m(1, 2), m(2, 0)], HandedOut::First(4));
        assert_eq!(at(&y.positions(HandedOut::First(0))), vec![(0, 2), (1, 0)]);
        assert_eq!(at(&y.positions(HandedOut::First(1))), vec![(0, 2), (1, 2)]);
        assert_eq!(
            at(&y.positions(HandedOut::All)),
            vec![(0, 2), (1, 2), (2, 0)]
        );
        // More than the batch holds is the whole batch.
        assert_eq!(at(&y.positions(HandedOut::First(99))).len(), 3);
    }

    #[test]
    fn a_forgotten_partition_is_not_committed_from_earlier_batches_or_the_latest() {
        let y = Yielded::default();
        y.polled(&[m(0, 0), m(1, 0)], HandedOut::All);
        y.polled(&[m(0, 1), m(1, 1), m(0, 2)], HandedOut::All);
        y.forget(&TopicPartition::new("t", 0));
        assert_eq!(at(&y.positions(HandedOut::All)), vec![(1, 1)]);
        assert_eq!(at(&y.positions(HandedOut::First(1))), vec![(1, 0)]);
    }
}
