//! The engines' view of the dedup store: every call that fails with a retriable error (the
//! store's server restarting, a connection reset, a reply that did not come back in time) is
//! waited out with the engine's backoff and made again, so an idempotent consumer or a pipeline
//! waits for its store and resumes instead of ending its run (issue #28).
//!
//! Making a call again is safe whether or not the failed one took effect, by the
//! [`DedupStore`] contract: a claim by the key's holder claims it again with a higher token; a
//! completion or release whose token is stale answers `false` and leaves the key as it is (a
//! refused completion is handled as a lost lease: the input is read again and found done);
//! renew and get change nothing the next call depends on.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::dedup::{ClaimOutcome, ClaimRequest, Completion, DedupStore, FencingToken, KeyState};
use crate::error::{ErrorKind, Result};

/// A [`DedupStore`] whose retriable failures are retried with a doubling backoff from `min` to
/// `max`, for as long as they last; any other error is returned at once.
pub(crate) struct Retrying {
    inner: Arc<dyn DedupStore>,
    min: Duration,
    max: Duration,
}

impl Retrying {
    pub(crate) fn wrap(
        inner: Arc<dyn DedupStore>,
        min: Duration,
        max: Duration,
    ) -> Arc<dyn DedupStore> {
        Arc::new(Retrying { inner, min, max })
    }

    async fn again<T, F, Fut>(&self, op: &'static str, f: F) -> Result<T>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let mut failures: u32 = 0;
        loop {
            match f().await {
                Ok(v) => {
                    if failures > 0 {
                        tracing::info!(
                            store = self.inner.name(),
                            op,
                            failures,
                            "dedup store answers again"
                        );
                    }
                    return Ok(v);
                }
                Err(e)
                    if e.is_retriable()
                        && !matches!(e.kind(), ErrorKind::Fenced | ErrorKind::Closed) =>
                {
                    let wait = self
                        .min
                        .max(Duration::from_millis(1))
                        .saturating_mul(1 << failures.min(16))
                        .min(self.max.max(Duration::from_millis(1)));
                    failures += 1;
                    tracing::warn!(
                        store = self.inner.name(),
                        op,
                        error = %e,
                        ?wait,
                        failures,
                        "dedup store call failed; waiting and trying again"
                    );
                    tokio::time::sleep(wait).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

#[async_trait]
impl DedupStore for Retrying {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn window(&self) -> Duration {
        self.inner.window()
    }

    async fn claim(&self, requests: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>> {
        self.again("claim", || self.inner.claim(requests)).await
    }

    async fn renew(&self, claims: &[(String, FencingToken)], lease: Duration) -> Result<Vec<bool>> {
        self.again("renew", || self.inner.renew(claims, lease))
            .await
    }

    async fn complete(&self, completions: &[Completion]) -> Result<Vec<bool>> {
        self.again("complete", || self.inner.complete(completions))
            .await
    }

    async fn release(&self, claims: &[(String, FencingToken)]) -> Result<Vec<bool>> {
        self.again("release", || self.inner.release(claims)).await
    }

    async fn get(&self, keys: &[String]) -> Result<Vec<Option<KeyState>>> {
        self.again("get", || self.inner.get(keys)).await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;
    use crate::dedup::memory::MemoryStore;
    use crate::error::Error;

    /// A memory store whose next `fail` calls fail with `error` (before reaching the store).
    struct Flaky {
        inner: MemoryStore,
        fail: AtomicU32,
        error: fn() -> Error,
        calls: AtomicU32,
    }

    impl Flaky {
        fn check(&self) -> Result<()> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self
                .fail
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err((self.error)());
            }
            Ok(())
        }
    }

    #[async_trait]
    impl DedupStore for Flaky {
        fn name(&self) -> &'static str {
            "flaky"
        }
        fn window(&self) -> Duration {
            self.inner.window()
        }
        async fn claim(&self, r: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>> {
            self.check()?;
            self.inner.claim(r).await
        }
        async fn renew(&self, c: &[(String, FencingToken)], l: Duration) -> Result<Vec<bool>> {
            self.check()?;
            self.inner.renew(c, l).await
        }
        async fn complete(&self, c: &[Completion]) -> Result<Vec<bool>> {
            self.check()?;
            self.inner.complete(c).await
        }
        async fn release(&self, c: &[(String, FencingToken)]) -> Result<Vec<bool>> {
            self.check()?;
            self.inner.release(c).await
        }
        async fn get(&self, k: &[String]) -> Result<Vec<Option<KeyState>>> {
            self.check()?;
            self.inner.get(k).await
        }
    }

    fn flaky(fail: u32, error: fn() -> Error) -> Arc<Flaky> {
        Arc::new(Flaky {
            inner: MemoryStore::new(Duration::from_secs(60), 1000),
            fail: AtomicU32::new(fail),
            error,
            calls: AtomicU32::new(0),
        })
    }

    fn request() -> ClaimRequest {
        ClaimRequest {
            key: "k".into(),
            owner: "w".into(),
            lease: Duration::from_secs(10),
            fingerprint: None,
        }
    }

    #[tokio::test]
    async fn retriable_failures_are_waited_out() {
        let inner = flaky(3, || Error::dedup_store("connection reset").retriable(true));
        let store = Retrying::wrap(
            inner.clone(),
            Duration::from_millis(1),
            Duration::from_millis(4),
        );
        let out = store.claim(&[request()]).await.unwrap();
        assert!(matches!(out[0], ClaimOutcome::Claimed { .. }), "{out:?}");
        assert_eq!(inner.calls.load(Ordering::SeqCst), 4);
    }

    #[tokio::test]
    async fn other_failures_are_returned_at_once() {
        let inner = flaky(3, || Error::dedup_store("bad stored value"));
        let store = Retrying::wrap(
            inner.clone(),
            Duration::from_millis(1),
            Duration::from_millis(4),
        );
        let e = store.claim(&[request()]).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::DedupStore);
        assert_eq!(inner.calls.load(Ordering::SeqCst), 1);
    }

    /// A claim whose answer was lost took effect: claimed again by its holder, it is claimed
    /// with a higher token, so the retried call gives the caller a claim it can complete.
    #[tokio::test]
    async fn a_claim_made_again_by_its_holder_is_claimed() {
        let inner = flaky(0, || Error::dedup_store("unused"));
        let store = Retrying::wrap(
            inner.clone(),
            Duration::from_millis(1),
            Duration::from_millis(4),
        );
        let first = store.claim(&[request()]).await.unwrap();
        let again = store.claim(&[request()]).await.unwrap();
        match (&first[0], &again[0]) {
            (ClaimOutcome::Claimed { token: a }, ClaimOutcome::Claimed { token: b }) => {
                assert!(b > a)
            }
            other => panic!("{other:?}"),
        }
        let ClaimOutcome::Claimed { token } = again[0] else {
            unreachable!()
        };
        let done = store
            .complete(&[Completion {
                key: "k".into(),
                token,
                result: None,
            }])
            .await
            .unwrap();
        assert_eq!(done, vec![true]);
    }
}
