//! The claim steps both engines take for a batch of inputs, written once: the idempotent
//! consumer (per partition chunk) and the exactly-once pipeline (per poll batch of an open
//! transaction) call them.
//!
//! 1. [`Core::claim_batch`]: the first copy of each key is claimed in one store call; a later
//!    copy of a key (in the batch, or already in flight in an open transaction) is a duplicate
//!    of the first, or a conflict when the payload fingerprints differ.
//! 2. [`Core::wait_out`]: a key another worker holds is waited out (its completion, release or
//!    the end of its lease) and claimed again, unless the partition moved away meanwhile.
//! 3. [`conflict_error`]: a payload that conflicts with its key's fingerprint becomes an error
//!    of kind `Conflict`, routed like a handler failure by `on_failure`; it never stops a run.

use std::collections::HashMap;

use super::idempotent::{repeat_outcome, Core};
use crate::dedup::{fingerprint, ClaimOutcome, ClaimRequest, DedupStoreExt};
use crate::error::{Error, ErrorKind, Result};
use crate::model::Message;

/// What [`Core::claim_batch`] found for a batch.
pub(crate) struct Claims {
    /// Per message: the store's answer for a first copy, `Duplicate`/`Mismatch` for a repeat,
    /// `None` for a keyless message (or without a store).
    pub(crate) outcomes: Vec<Option<ClaimOutcome>>,
    /// The first copies: message index and payload fingerprint (when fingerprints are on).
    pub(crate) first: Vec<(usize, Option<u128>)>,
}

impl Core {
    /// Claims the keys of `msgs` (`keys[i]`: message `i`'s store key, `None` for a keyless
    /// one) in one store call: the first copy of each key is claimed; a key already in
    /// `in_flight` (key → fingerprint: an open transaction's inputs) or earlier in the batch is
    /// a repeat, answered without the store ([`repeat_outcome`]). The keys move into the
    /// requests and back (no copy per message). Without a store, every outcome is `None`.
    pub(crate) async fn claim_batch(
        &self,
        msgs: &[Message],
        keys: &mut [Option<String>],
        in_flight: Option<&HashMap<String, Option<u128>>>,
    ) -> Result<Claims> {
        let mut outcomes: Vec<Option<ClaimOutcome>> = vec![None; msgs.len()];
        let mut first: Vec<(usize, Option<u128>)> = Vec::new();
        let Some(store) = &self.store else {
            return Ok(Claims { outcomes, first });
        };
        {
            let mut seen: HashMap<&str, Option<u128>, quick_cache::DefaultHashBuilder> =
                HashMap::with_capacity_and_hasher(msgs.len(), Default::default());
            for (i, (m, k)) in msgs.iter().zip(keys.iter()).enumerate() {
                let Some(k) = k else { continue };
                let fp = self.config.fingerprint.then(|| fingerprint(&m.payload));
                let earlier = in_flight
                    .and_then(|f| f.get(k.as_str()))
                    .or_else(|| seen.get(k.as_str()));
                match earlier {
                    Some(first_fp) => outcomes[i] = Some(repeat_outcome(*first_fp, fp)),
                    None => {
                        seen.insert(k.as_str(), fp);
                        first.push((i, fp));
                    }
                }
            }
        }
        if first.is_empty() {
            return Ok(Claims { outcomes, first });
        }
        let reqs: Vec<ClaimRequest> = first
            .iter()
            .map(|&(i, fp)| ClaimRequest {
                key: keys[i].take().expect("first copies have keys"),
                owner: self.config.worker_id.clone(),
                lease: self.config.lease,
                fingerprint: fp,
            })
            .collect();
        let claimed = store.claim(&reqs).await;
        for (&(i, _), r) in first.iter().zip(reqs) {
            keys[i] = Some(r.key);
        }
        for (&(i, _), o) in first.iter().zip(claimed?) {
            outcomes[i] = Some(o);
        }
        Ok(Claims { outcomes, first })
    }

    /// Waits out another worker's claim on `key` (the outcome `InProgress`): sleeps
    /// ([`super::EngineConfig::claim_wait`]: from 20 ms, at most 500 ms and a third of the
    /// lease, so a completion or release is noticed within half a second) and claims again,
    /// until the key is claimed, found completed (`Duplicate`) or conflicting, or `still_ours`
    /// says the input's partition moved away (then the outcome is still `InProgress`: the
    /// input is for the partition's next owner). Any other outcome is returned as it is.
    pub(crate) async fn wait_out(
        &self,
        mut outcome: Option<ClaimOutcome>,
        key: impl Fn() -> String,
        msg: &Message,
        still_ours: impl Fn() -> bool,
    ) -> Result<Option<ClaimOutcome>> {
        let mut asked = 0;
        while let Some(ClaimOutcome::InProgress { expires_in, .. }) = &outcome {
            tokio::time::sleep(self.config.claim_wait(*expires_in, asked)).await;
            asked += 1;
            if !still_ours() {
                break;
            }
            let store = self.store.as_ref().expect("in-progress implies a store");
            outcome = Some(store.claim_one(self.claim_request(key(), msg)).await?);
        }
        Ok(outcome)
    }
}

/// The error of an input whose payload conflicts with the fingerprint stored for its key
/// (kind `Conflict`): names the key, the input's partition and position, and both
/// fingerprints.
pub(crate) fn conflict_error(key: &str, msg: &Message, stored: u128, given: u128) -> Error {
    Error::new(
        ErrorKind::Conflict,
        format!(
            "idempotency key '{key}' at {} {} was seen before with another payload \
             (fingerprint {stored:032x}, this one {given:032x})",
            msg.topic_partition(),
            msg.position
        ),
    )
}
