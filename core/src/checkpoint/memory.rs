//! The in-process checkpoint store: a lease table in a mutex-guarded map, for tests and for
//! groups whose workers all live in one process.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use parking_lot::Mutex;

use super::row::Row;
use super::{
    validate, CheckpointRequest, CheckpointStore, HeldLease, Lease, LeaseCounter, NewLease,
    TakeOutcome, TakeRequest,
};
use crate::error::Result;

/// In-process [`CheckpointStore`]. Expiry runs on a monotonic clock started with the store.
/// Keeps nothing across a restart; every operation holds one lock, so calls are linearisable.
#[derive(Debug)]
pub struct MemoryCheckpointStore {
    start: Instant,
    groups: Mutex<HashMap<String, BTreeMap<String, Row>>>,
}

impl Default for MemoryCheckpointStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryCheckpointStore {
    /// A new, empty store.
    pub fn new() -> Self {
        MemoryCheckpointStore {
            start: Instant::now(),
            groups: Mutex::new(HashMap::new()),
        }
    }

    fn now(&self) -> i64 {
        super::row::ms(self.start.elapsed())
    }

    fn with_group<R>(
        &self,
        group: &str,
        f: impl FnOnce(&mut BTreeMap<String, Row>, i64) -> R,
    ) -> R {
        let mut groups = self.groups.lock();
        let now = self.now();
        let rows = groups.entry(group.to_string()).or_default();
        let r = f(rows, now);
        if rows.is_empty() {
            groups.remove(group);
        }
        r
    }
}

#[async_trait]
impl CheckpointStore for MemoryCheckpointStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn list(&self, group: &str) -> Result<Vec<Lease>> {
        validate(group, [], [])?;
        Ok(self.with_group(group, |rows, now| {
            rows.iter().map(|(k, r)| r.to_lease(k, now)).collect()
        }))
    }

    async fn get(&self, group: &str, keys: &[String]) -> Result<Vec<Option<Lease>>> {
        validate(group, keys.iter().map(String::as_str), [])?;
        Ok(self.with_group(group, |rows, now| {
            keys.iter()
                .map(|k| rows.get(k).map(|r| r.to_lease(k, now)))
                .collect()
        }))
    }

    async fn create(&self, group: &str, leases: &[NewLease]) -> Result<Vec<bool>> {
        validate(group, leases.iter().map(|l| l.key.as_str()), [])?;
        Ok(self.with_group(group, |rows, _| {
            leases
                .iter()
                .map(|l| {
                    if rows.contains_key(&l.key) {
                        false
                    } else {
                        rows.insert(
                            l.key.clone(),
                            Row::new(l.checkpoint.clone(), l.parents.clone()),
                        );
                        true
                    }
                })
                .collect()
        }))
    }

    async fn take(&self, group: &str, requests: &[TakeRequest]) -> Result<Vec<TakeOutcome>> {
        validate(
            group,
            requests.iter().map(|r| r.key.as_str()),
            requests.iter().map(|r| r.owner.as_str()),
        )?;
        Ok(self.with_group(group, |rows, now| {
            requests
                .iter()
                .map(|req| match rows.get_mut(&req.key) {
                    None => TakeOutcome::Refused { current: None },
                    Some(row) => match row.take(req, now) {
                        Some(counter) => TakeOutcome::Taken { counter },
                        None => TakeOutcome::Refused {
                            current: Some(row.to_lease(&req.key, now)),
                        },
                    },
                })
                .collect()
        }))
    }

    async fn renew(
        &self,
        group: &str,
        leases: &[HeldLease],
        lease: Duration,
    ) -> Result<Vec<Option<LeaseCounter>>> {
        validate(
            group,
            leases.iter().map(|l| l.key.as_str()),
            leases.iter().map(|l| l.owner.as_str()),
        )?;
        Ok(self.with_group(group, |rows, now| {
            leases
                .iter()
                .map(|h| rows.get_mut(&h.key).and_then(|r| r.renew(h, lease, now)))
                .collect()
        }))
    }

    async fn release(&self, group: &str, leases: &[HeldLease]) -> Result<Vec<bool>> {
        validate(
            group,
            leases.iter().map(|l| l.key.as_str()),
            leases.iter().map(|l| l.owner.as_str()),
        )?;
        Ok(self.with_group(group, |rows, _| {
            leases
                .iter()
                .map(|h| rows.get_mut(&h.key).is_some_and(|r| r.release(h)))
                .collect()
        }))
    }

    async fn checkpoint(&self, group: &str, requests: &[CheckpointRequest]) -> Result<Vec<bool>> {
        validate(
            group,
            requests.iter().map(|r| r.key.as_str()),
            requests.iter().map(|r| r.owner.as_str()),
        )?;
        Ok(self.with_group(group, |rows, _| {
            requests
                .iter()
                .map(|c| rows.get_mut(&c.key).is_some_and(|r| r.checkpoint(c)))
                .collect()
        }))
    }

    async fn delete(&self, group: &str, keys: &[String]) -> Result<Vec<bool>> {
        validate(group, keys.iter().map(String::as_str), [])?;
        Ok(self.with_group(group, |rows, _| {
            keys.iter().map(|k| rows.remove(k).is_some()).collect()
        }))
    }
}
