//! What a binding's `commit()` without arguments commits: per partition, the highest position
//! of the messages the binding handed to its user (redeliveries can come behind newer messages).
//!
//! A binding polls batches and hands their messages out one by one (an iterator) or whole
//! (`poll()`, a batch iterator). It keeps only its [`Progress`]: the number of the latest batch
//! it received ([`Yielded::polled`] returns it) and how far into that batch it has handed
//! messages out. It gives that to [`Yielded::polled`] with the next poll and to
//! [`Yielded::positions`] when the user commits; the tracker works out the positions, once per
//! batch rather than once per message. The batch number keeps a commit made while a poll is
//! completing (another task's periodic commit) from applying the host's count to a batch the
//! host has not received yet.

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

/// What the host knows: the number of the latest batch it received (0 before the first) and
/// how far into it it has handed messages out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// The batch's number, as [`Yielded::polled`] returned it.
    pub batch: u64,
    /// How much of it was handed out.
    pub handed: HandedOut,
}

impl Progress {
    /// From a host's batch number and optional count (none: the whole batch).
    pub fn new(batch: u64, count: Option<usize>) -> Self {
        Progress {
            batch,
            handed: HandedOut::from_count(count),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// The latest batch's runs of one partition: the index of the run's first message, the
    /// index one past its last, and the partition.
    runs: Vec<(usize, usize, TopicPartition)>,
    /// The position of each message of the latest batch.
    positions: Vec<Position>,
    /// The latest batch's number (0: none yet).
    batch: u64,
    /// Per partition, the last message handed out before the part of the latest batch
    /// that `runs` still holds.
    settled: HashMap<TopicPartition, Position>,
}

impl State {
    /// The last message handed out of each run of the latest batch, `handed` saying how far
    /// the user got: a run cut short counts up to its last message handed out.
    fn handed_out(&self, progress: Progress) -> impl Iterator<Item = (&TopicPartition, &Position)> {
        // A count about another batch says nothing was handed out of this one: the host has
        // not received it yet.
        let handed = if progress.batch == self.batch {
            progress.handed
        } else {
            HandedOut::First(0)
        };
        let end = self.end_of(handed);
        // The highest position handed out of each run, not its last: a redelivery can come
        // behind newer messages (see `Position::highest`).
        self.runs
            .iter()
            .filter(move |(start, _, _)| *start < end)
            .map(move |(start, run_end, tp)| {
                let handed = &self.positions[*start..(*run_end).min(end)];
                (
                    tp,
                    Position::highest(handed).expect("a run cut short keeps one message"),
                )
            })
    }

    /// One past the last message of the latest batch handed out, by `progress`.
    fn end(&self, progress: Progress) -> usize {
        if progress.batch == self.batch {
            self.end_of(progress.handed)
        } else {
            0
        }
    }

    fn end_of(&self, handed: HandedOut) -> usize {
        match handed {
            HandedOut::All => self.positions.len(),
            HandedOut::First(n) => n.min(self.positions.len()),
        }
    }

    /// Moves what was handed out of the latest batch into `settled`.
    fn settle(&mut self, progress: Progress) {
        let done: Vec<_> = self
            .handed_out(progress)
            .map(|(tp, p)| (tp.clone(), p.clone()))
            .collect();
        raise(&mut self.settled, done);
    }
}

/// The lowest of `positions` (of one partition), `None` if there are none.
fn lowest(positions: &[Position]) -> Option<&Position> {
    positions.iter().reduce(|a, b| if b < a { b } else { a })
}

/// Raises each partition's position in `to` to the one in `from` where that is higher.
fn raise(
    to: &mut HashMap<TopicPartition, Position>,
    from: impl IntoIterator<Item = (TopicPartition, Position)>,
) {
    for (tp, p) in from {
        match to.get_mut(&tp) {
            Some(at) => at.raise_to(&p),
            None => {
                to.insert(tp, p);
            }
        }
    }
}

/// The per-consumer tracker; one per binding consumer object, shared by its methods.
#[derive(Debug, Default)]
pub struct Yielded {
    state: Mutex<State>,
}

impl Yielded {
    /// A new batch arrived; `previous` is the host's progress through the batch before it.
    /// Returns the batch's number, for the host's [`Progress`]. An empty batch changes nothing
    /// (the previous batch stays the latest, and its number is returned).
    pub fn polled(&self, batch: &[Message], previous: Progress) -> u64 {
        let mut s = self.state.lock();
        if batch.is_empty() {
            return s.batch;
        }
        s.settle(previous);
        s.batch += 1;
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
        s.batch
    }

    /// The positions `commit()` commits: per partition, the highest message handed out, `latest`
    /// saying how far the host got, but always below every message of the latest batch not
    /// handed out yet: JetStream and Pulsar acknowledge every held message at or below a
    /// committed position, so a position above one the user has not seen would acknowledge it
    /// unhandled (a redelivery batch `[3, 5]` after 8 was committed, with only 3 handed out,
    /// commits 3, not 8). A partition with nothing to commit below its first message not
    /// handed out is left out. Sorted by topic and partition.
    pub fn positions(&self, latest: Progress) -> Vec<(TopicPartition, Position)> {
        let s = self.state.lock();
        let mut out = s.settled.clone();
        raise(
            &mut out,
            s.handed_out(latest).map(|(tp, p)| (tp.clone(), p.clone())),
        );
        // Per partition of the latest batch: its messages handed out, and the lowest not.
        let end = s.end(latest);
        let mut parts: HashMap<&TopicPartition, (Vec<&Position>, Option<&Position>)> =
            HashMap::new();
        for (start, run_end, tp) in &s.runs {
            let cut = (*run_end).min(end).max(*start);
            let (handed, floor) = parts.entry(tp).or_default();
            handed.extend(&s.positions[*start..cut]);
            if let Some(l) = lowest(&s.positions[cut..*run_end]) {
                *floor = Some(floor.map_or(l, |f| if l < f { l } else { f }));
            }
        }
        for (tp, (handed, floor)) in parts {
            let Some(floor) = floor else { continue };
            let below = |p: &&Position| *p < floor;
            let settled = s.settled.get(tp).filter(below);
            match Position::highest(handed.into_iter().filter(below).chain(settled)) {
                Some(p) => {
                    out.insert(tp.clone(), p.clone());
                }
                None => {
                    out.remove(tp);
                }
            }
        }
        let mut out: Vec<_> = out.into_iter().collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Forgets `partition`: after a seek, what was handed out before it is not what the
    /// user processes next. (Partitions revoked in a rebalance are not forgotten: a commit
    /// of one this member no longer owns is the platform's to refuse or to take.)
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

    fn first(batch: u64, n: usize) -> Progress {
        Progress::new(batch, Some(n))
    }

    #[test]
    fn commit_takes_the_last_message_handed_out_of_each_partition() {
        let y = Yielded::default();
        assert!(y.positions(Progress::new(0, None)).is_empty());
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
        let b1 = y.polled(&batch, Progress::new(0, None));
        assert_eq!(at(&y.positions(first(b1, 0))), vec![]);
        assert_eq!(at(&y.positions(first(b1, 4))), vec![(0, 2), (1, 0)]);
        assert_eq!(at(&y.positions(first(b1, 6))), vec![(0, 3), (1, 1)]);
        assert_eq!(
            at(&y.positions(Progress::new(b1, None))),
            vec![(0, 4), (1, 1)]
        );
        // The next batch settles what was handed out of this one; an empty poll changes
        // nothing.
        assert_eq!(y.polled(&[], first(b1, 1)), b1);
        let b2 = y.polled(&[m(1, 2), m(2, 0)], first(b1, 4));
        assert_ne!(b1, b2);
        assert_eq!(at(&y.positions(first(b2, 0))), vec![(0, 2), (1, 0)]);
        assert_eq!(at(&y.positions(first(b2, 1))), vec![(0, 2), (1, 2)]);
        assert_eq!(
            at(&y.positions(Progress::new(b2, None))),
            vec![(0, 2), (1, 2), (2, 0)]
        );
        // More than the batch holds is the whole batch.
        assert_eq!(at(&y.positions(first(b2, 99))).len(), 3);
    }

    /// A redelivery behind newer messages (JetStream after `ack_wait`, a Pulsar nack) does not
    /// lower what commit() commits: committing the last message handed out would leave the
    /// newer ones unacknowledged for ever.
    #[test]
    fn commit_takes_the_highest_position_handed_out_when_a_batch_is_out_of_order() {
        let y = Yielded::default();
        let b1 = y.polled(&[m(0, 6)], Progress::new(0, None));
        let b2 = y.polled(
            &[m(0, 7), m(0, 8), m(0, 1), m(0, 2)],
            Progress::new(b1, None),
        );
        // Nothing below the unseen 1 and 2 yet: committing 6 or 8 would acknowledge them.
        assert_eq!(at(&y.positions(first(b2, 0))), vec![]);
        assert_eq!(at(&y.positions(first(b2, 3))), vec![(0, 1)]);
        assert_eq!(at(&y.positions(Progress::new(b2, None))), vec![(0, 8)]);
        let b3 = y.polled(&[m(0, 3)], Progress::new(b2, None));
        assert_eq!(at(&y.positions(Progress::new(b3, None))), vec![(0, 8)]);
    }

    /// A commit never names a position at or above a message of the latest batch the user
    /// has not been handed: JetStream and Pulsar would acknowledge it unhandled.
    #[test]
    fn commit_stays_below_every_message_not_handed_out() {
        let y = Yielded::default();
        let b1 = y.polled(&[m(0, 6), m(0, 7), m(0, 8)], Progress::new(0, None));
        let b2 = y.polled(&[m(0, 3), m(0, 5)], Progress::new(b1, None));
        assert_eq!(at(&y.positions(first(b2, 0))), vec![], "nothing below 3");
        assert_eq!(
            at(&y.positions(first(b2, 1))),
            vec![(0, 3)],
            "not 8: 5 is unseen"
        );
        assert_eq!(at(&y.positions(Progress::new(b2, None))), vec![(0, 8)]);
        // Pulsar-like order: a nacked message behind newer ones.
        let y = Yielded::default();
        let b1 = y.polled(
            &[m(1, 7), m(1, 8), m(1, 1), m(1, 2)],
            Progress::new(0, None),
        );
        assert_eq!(
            at(&y.positions(first(b1, 3))),
            vec![(1, 1)],
            "not 8: 2 is unseen"
        );
        assert_eq!(at(&y.positions(Progress::new(b1, None))), vec![(1, 8)]);
    }

    #[test]
    fn a_count_about_an_earlier_batch_hands_out_nothing_of_a_batch_the_host_has_not_seen() {
        let y = Yielded::default();
        let b1 = y.polled(&[m(0, 0), m(0, 1)], Progress::new(0, None));
        // The host handed all of batch 1 out, then polled again; batch 2 arrived natively
        // while another task committed with the host's progress, still about batch 1.
        let _b2 = y.polled(&[m(0, 2), m(0, 3)], Progress::new(b1, None));
        assert_eq!(at(&y.positions(Progress::new(b1, None))), vec![(0, 1)]);
        // A batch whose poll the host never received (a cancelled await) is not committed
        // either when the host polls again.
        let b3 = y.polled(&[m(0, 4)], Progress::new(b1, None));
        assert_eq!(at(&y.positions(Progress::new(b3, None))), vec![(0, 4)]);
        assert_eq!(at(&y.positions(first(b3, 0))), vec![(0, 1)]);
    }

    #[test]
    fn a_forgotten_partition_is_not_committed_from_earlier_batches_or_the_latest() {
        let y = Yielded::default();
        let b1 = y.polled(&[m(0, 0), m(1, 0)], Progress::new(0, None));
        let b2 = y.polled(&[m(0, 1), m(1, 1), m(0, 2)], Progress::new(b1, None));
        y.forget(&TopicPartition::new("t", 0));
        assert_eq!(at(&y.positions(Progress::new(b2, None))), vec![(1, 1)]);
        assert_eq!(at(&y.positions(first(b2, 1))), vec![(1, 0)]);
    }
}
