//! The decision logic every built-in checkpoint store shares: one row, the clock reading `now`
//! (milliseconds on the store's clock), and the rules of the module documentation.

use std::time::Duration;

use super::{CheckpointRequest, HeldLease, Lease, LeaseCounter, TakeRequest};

/// One stored row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Row {
    pub owner: Option<String>,
    pub counter: LeaseCounter,
    /// End of the lease, ms on the store's clock; 0 when unowned.
    pub lease_until: i64,
    pub checkpoint: Option<String>,
    pub parents: Vec<String>,
}

pub(crate) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Row {
    pub fn new(checkpoint: Option<String>, parents: Vec<String>) -> Row {
        Row {
            owner: None,
            counter: 0,
            lease_until: 0,
            checkpoint,
            parents,
        }
    }

    pub fn to_lease(&self, key: &str, now: i64) -> Lease {
        let left = if self.owner.is_some() {
            self.lease_until.saturating_sub(now).max(0)
        } else {
            0
        };
        Lease {
            key: key.to_string(),
            owner: self.owner.clone(),
            counter: self.counter,
            expires_in: Duration::from_millis(u64::try_from(left).unwrap_or(0)),
            checkpoint: self.checkpoint.clone(),
            parents: self.parents.clone(),
        }
    }

    fn holds(&self, owner: &str, counter: LeaseCounter) -> bool {
        self.owner.as_deref() == Some(owner) && self.counter == counter
    }

    /// Applies a take; the new counter if it succeeded.
    pub fn take(&mut self, req: &TakeRequest, now: i64) -> Option<LeaseCounter> {
        let free = match &self.owner {
            None => true,
            Some(o) => o == &req.owner || self.lease_until <= now,
        };
        if !free || self.counter != req.expected_counter {
            return None;
        }
        self.owner = Some(req.owner.clone());
        self.counter += 1;
        self.lease_until = now.saturating_add(ms(req.lease));
        Some(self.counter)
    }

    pub fn renew(&mut self, held: &HeldLease, lease: Duration, now: i64) -> Option<LeaseCounter> {
        if !self.holds(&held.owner, held.counter) {
            return None;
        }
        self.counter += 1;
        self.lease_until = now.saturating_add(ms(lease));
        Some(self.counter)
    }

    pub fn release(&mut self, held: &HeldLease) -> bool {
        if !self.holds(&held.owner, held.counter) {
            return false;
        }
        self.owner = None;
        self.counter += 1;
        self.lease_until = 0;
        true
    }

    pub fn checkpoint(&mut self, req: &CheckpointRequest) -> bool {
        if !self.holds(&req.owner, req.counter) {
            return false;
        }
        self.checkpoint = Some(req.checkpoint.clone());
        true
    }
}
