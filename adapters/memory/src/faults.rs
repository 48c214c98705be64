//! Fault injection for engine tests: redeliveries, dropped commits, consumers that crash around a
//! commit and producers killed with a transaction open.

use std::sync::Arc;

use crate::broker::Broker;

/// Where an injected consumer crash happens relative to its next commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashPoint {
    /// The commit is not applied, then the consumer dies.
    BeforeCommit,
    /// The commit is applied, then the consumer dies (the caller still sees an error, as a
    /// process killed right after its commit never sees the acknowledgement).
    AfterCommit,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Redeliver {
    Off,
    EveryNth(u64),
    Probability(f64),
}

/// Fault state, kept in the broker under its lock.
pub(crate) struct FaultState {
    pub redeliver: Redeliver,
    counter: u64,
    rng: u64,
    pub redelivered: u64,
    pub drop_commits: u64,
    pub dropped: u64,
    pub crashes: Vec<(String, CrashPoint)>,
}

impl Default for FaultState {
    fn default() -> Self {
        FaultState {
            redeliver: Redeliver::Off,
            counter: 0,
            rng: 0,
            redelivered: 0,
            drop_commits: 0,
            dropped: 0,
            crashes: Vec::new(),
        }
    }
}

impl FaultState {
    /// Whether the message just delivered is delivered a second time right after it.
    #[inline]
    pub fn should_redeliver(&mut self) -> bool {
        match self.redeliver {
            Redeliver::Off => false,
            Redeliver::EveryNth(n) => {
                self.counter += 1;
                self.counter.is_multiple_of(n)
            }
            Redeliver::Probability(p) => {
                // splitmix64: small, seeded, deterministic.
                self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = self.rng;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                z ^= z >> 31;
                ((z >> 11) as f64 / (1u64 << 53) as f64) < p
            }
        }
    }

    /// Takes the crash armed for `group`, if any.
    pub fn take_crash(&mut self, group: &str) -> Option<CrashPoint> {
        let i = self.crashes.iter().position(|(g, _)| g == group)?;
        Some(self.crashes.remove(i).1)
    }
}

/// Fault injection on one `memory://` broker, from [`crate::MemoryPlatform::faults`]. Faults
/// apply to every handle of the broker (use a broker of its own per test).
#[derive(Clone)]
pub struct Faults {
    pub(crate) broker: Arc<Broker>,
}

impl Faults {
    /// Every `n`th message returned by a `poll` (over the whole broker) is delivered a second
    /// time right after itself, with a higher `delivery_count`. `0` turns redelivery off.
    pub fn redeliver_every(&self, n: u64) {
        let mut st = self.broker.state.lock();
        st.faults.redeliver = if n == 0 {
            Redeliver::Off
        } else {
            Redeliver::EveryNth(n)
        };
        st.faults.counter = 0;
    }

    /// Each message returned by a `poll` is delivered a second time right after itself with
    /// probability `p` (0.0 to 1.0), drawn from a generator seeded with `seed`.
    pub fn redeliver_with_probability(&self, p: f64, seed: u64) {
        let mut st = self.broker.state.lock();
        st.faults.redeliver = if p > 0.0 {
            Redeliver::Probability(p.min(1.0))
        } else {
            Redeliver::Off
        };
        st.faults.rng = seed;
    }

    /// Stops injected redeliveries.
    pub fn stop_redelivery(&self) {
        self.broker.state.lock().faults.redeliver = Redeliver::Off;
    }

    /// How many messages were delivered a second time by injection so far.
    pub fn redelivered(&self) -> u64 {
        self.broker.state.lock().faults.redelivered
    }

    /// The next `n` consumer commits (`ConsumerBackend::commit`, any group) return `Ok` but are
    /// not applied, as if the broker lost them. Transactional offset commits are never dropped.
    pub fn drop_commits(&self, n: u64) {
        self.broker.state.lock().faults.drop_commits = n;
    }

    /// How many commits were dropped by injection so far.
    pub fn dropped_commits(&self) -> u64 {
        self.broker.state.lock().faults.dropped
    }

    /// The next `ConsumerBackend::commit` by a member of `group` fails with
    /// [`onceflow_core::ErrorKind::Closed`] without applying its positions, and that consumer
    /// dies: every later call fails `Closed`, and it leaves the group at once without committing
    /// and without calling its rebalance listener, as a killed process would.
    pub fn crash_before_commit(&self, group: &str) {
        self.arm(group, CrashPoint::BeforeCommit);
    }

    /// Like [`Faults::crash_before_commit`], but the positions are applied before the consumer
    /// dies (the caller still gets `Closed`).
    pub fn crash_after_commit(&self, group: &str) {
        self.arm(group, CrashPoint::AfterCommit);
    }

    fn arm(&self, group: &str, point: CrashPoint) {
        self.broker
            .state
            .lock()
            .faults
            .crashes
            .push((group.to_string(), point));
    }

    /// Kills the live producer holding `transactional_id`: every later call on it (and on its
    /// open transaction) fails [`onceflow_core::ErrorKind::Closed`], and its open transaction, if
    /// any, stays open (blocking read-committed readers at its first record) until a new producer
    /// with the same transactional id fences it and aborts it, as on Kafka. Returns whether such
    /// a producer existed.
    pub fn crash_producer(&self, transactional_id: &str) -> bool {
        let mut st = self.broker.state.lock();
        match st.producers.get_mut(transactional_id) {
            Some(p) => {
                p.crashed = true;
                true
            }
            None => false,
        }
    }

    /// Transactions of `transactional_id` the broker has aborted so far, whoever ended them:
    /// the producer, the drop of an unfinished transaction, or fencing by a newer producer with
    /// the same id (Kafka's InitProducerId). 0 for an unknown id.
    pub fn aborted_transactions(&self, transactional_id: &str) -> u64 {
        let st = self.broker.state.lock();
        st.producers.get(transactional_id).map_or(0, |p| p.aborted)
    }

    /// Clears every armed fault (counters are kept).
    pub fn clear(&self) {
        let mut st = self.broker.state.lock();
        st.faults.redeliver = Redeliver::Off;
        st.faults.drop_commits = 0;
        st.faults.crashes.clear();
    }
}

impl std::fmt::Debug for Faults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Faults")
            .field("broker", &self.broker.name)
            .finish()
    }
}
