//! The dedup-store conformance suite: written once against [`DedupStore`], run for every store
//! through a [`StoreHarness`] and the [`dedup_suite!`](crate::dedup_suite!) macro.
//!
//! ```ignore
//! // tests/dedup_embedded.rs: one #[tokio::test] per case.
//! onceflow_conformance::dedup_suite!(onceflow_conformance::dedup_suite::EmbeddedHarness::new());
//! // A store that keeps nothing across a restart marks the persistence cases ignored:
//! onceflow_conformance::dedup_suite!(onceflow_conformance::dedup_suite::MemoryHarness, volatile);
//! ```
//!
//! The crate using the macro needs `tokio` (with `macros` and `rt-multi-thread`) as a
//! dependency. Every case opens its own store and uses its own random key prefix, so cases never
//! share state, even on a shared server.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use onceflow_core::dedup::{
    fingerprint, ClaimOutcome, ClaimRequest, Completion, DedupStoreExt, EmbeddedStore,
    FencingToken, KeyState, MemoryStore, SharedDedupStore,
};
use onceflow_core::{DedupStore, ErrorKind, Result};

/// Environment variable that turns a run of the process-restart case into the child writer; its
/// value is the store location.
pub const CHILD_ENV: &str = "ONCEFLOW_DEDUP_SUITE_CHILD";

/// Line the child writer prints once its keys are committed.
const CHILD_READY: &str = "ONCEFLOW_DEDUP_SUITE_CHILD_READY";

/// Keys the child writer completes before it is killed.
const CHILD_KEYS: usize = 200;

/// How a store plugs into the suite.
#[async_trait]
pub trait StoreHarness: Send + Sync {
    /// Opens a new, empty store that remembers completed keys for `window`.
    async fn open(&self, window: Duration) -> SharedDedupStore;

    /// Opens the store last returned by [`open`](Self::open) again, as a restarted process
    /// would (same data). `None` when the store keeps nothing across a restart.
    async fn reopen(&self) -> Option<SharedDedupStore> {
        None
    }

    /// Where the store last returned by [`open`](Self::open) keeps its data, in a form another
    /// process passes to [`open_location`](Self::open_location). `None` when the store keeps
    /// nothing across a restart.
    fn location(&self) -> Option<String> {
        None
    }

    /// Opens the store at `location` (from [`location`](Self::location) or
    /// [`unusable_locations`](Self::unusable_locations)).
    async fn open_location(&self, location: &str, window: Duration) -> Result<SharedDedupStore> {
        let _ = window;
        Err(onceflow_core::Error::unsupported(format!(
            "this harness cannot open a location ('{location}')"
        )))
    }

    /// Locations that must fail to open with an error of kind `DedupStore` naming them.
    async fn unusable_locations(&self) -> Vec<String> {
        Vec::new()
    }
}

/// The in-process [`MemoryStore`] (capacity 1M keys). Keeps nothing across a restart: use
/// `dedup_suite!(MemoryHarness, volatile)`.
#[derive(Debug, Default, Clone, Copy)]
pub struct MemoryHarness;

#[async_trait]
impl StoreHarness for MemoryHarness {
    async fn open(&self, window: Duration) -> SharedDedupStore {
        Arc::new(MemoryStore::new(window, 1_000_000))
    }
}

/// The on-disk [`EmbeddedStore`], one file per [`open`](StoreHarness::open) in a temporary
/// directory created on first use and removed with the harness.
#[derive(Debug, Default)]
pub struct EmbeddedHarness {
    dir: OnceLock<tempfile::TempDir>,
    last: Mutex<Option<(PathBuf, Duration)>>,
}

impl EmbeddedHarness {
    /// A harness; its directory is created on the first open.
    pub fn new() -> Self {
        Self::default()
    }

    fn dir(&self) -> &std::path::Path {
        self.dir
            .get_or_init(|| {
                tempfile::Builder::new()
                    .prefix("onceflow-dedup-suite-")
                    .tempdir()
                    .expect("create a temporary directory")
            })
            .path()
    }
}

#[async_trait]
impl StoreHarness for EmbeddedHarness {
    async fn open(&self, window: Duration) -> SharedDedupStore {
        let path = self
            .dir()
            .join(format!("store-{:016x}.db", rand::random::<u64>()));
        let store = EmbeddedStore::open(&path, window)
            .await
            .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
        *self.last.lock().unwrap() = Some((path, window));
        Arc::new(store)
    }

    async fn reopen(&self) -> Option<SharedDedupStore> {
        let (path, window) = self.last.lock().unwrap().clone()?;
        Some(Arc::new(
            EmbeddedStore::open(&path, window)
                .await
                .unwrap_or_else(|e| panic!("reopen {}: {e}", path.display())),
        ))
    }

    fn location(&self) -> Option<String> {
        let last = self.last.lock().unwrap();
        last.as_ref().map(|(p, _)| p.display().to_string())
    }

    async fn open_location(&self, location: &str, window: Duration) -> Result<SharedDedupStore> {
        Ok(Arc::new(EmbeddedStore::open(location, window).await?))
    }

    async fn unusable_locations(&self) -> Vec<String> {
        let dir = self.dir();
        // A path below a regular file.
        let file = dir.join("plain-file");
        std::fs::write(&file, b"x").unwrap();
        // A directory where the database file should be.
        let sub = dir.join("a-directory.db");
        std::fs::create_dir_all(&sub).unwrap();
        // A file that is not an SQLite database.
        let junk = dir.join("junk.db");
        std::fs::write(&junk, vec![0x5a_u8; 8192]).unwrap();
        // Permission bits are not tested: the suite may run as root, which ignores them.
        [
            file.join("store.db"),
            sub,
            junk,
            dir.join("missing-dir").join("store.db"),
        ]
        .iter()
        .map(|p| p.display().to_string())
        .collect()
    }
}

/// Which test is running, for cases that re-run themselves in a child process.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    /// `module_path!()` where the macro was expanded.
    pub module_path: &'static str,
    /// The case's function name.
    pub name: &'static str,
}

impl Case {
    /// The test's name as the test binary knows it (module path without the crate name).
    pub fn test_path(&self) -> String {
        match self.module_path.split_once("::") {
            Some((_, rest)) => format!("{rest}::{}", self.name),
            None => self.name.to_string(),
        }
    }
}

/// Expands to one `#[tokio::test(flavor = "multi_thread")]` per suite case, each evaluating
/// `$harness` anew. With `, volatile`, the cases that need a store surviving a restart (or a
/// location on disk) are `#[ignore]`d with the reason.
#[macro_export]
macro_rules! dedup_suite {
    (@all ($harness:expr) $persistent:ident) => {
        $crate::dedup_suite!(@case ($harness) claim_complete_duplicate_returns_stored_result run);
        $crate::dedup_suite!(@case ($harness) release_makes_key_claimable_with_higher_token run);
        $crate::dedup_suite!(@case ($harness) concurrent_workers_handle_each_key_exactly_once run);
        $crate::dedup_suite!(@case ($harness) expired_lease_is_taken_over_and_old_token_fenced run);
        $crate::dedup_suite!(@case ($harness) renew_extends_the_lease run);
        $crate::dedup_suite!(@case ($harness) a_zero_lease_is_refused_and_the_longest_holds run);
        $crate::dedup_suite!(@case ($harness) same_owner_reclaim_gets_new_token run);
        $crate::dedup_suite!(@case ($harness) completed_keys_expire_after_window run);
        $crate::dedup_suite!(@case ($harness) fingerprint_mismatch_and_match run);
        $crate::dedup_suite!(@case ($harness) batched_ops_give_per_item_outcomes_in_order run);
        $crate::dedup_suite!(@case ($harness) get_reports_states run);
        $crate::dedup_suite!(@case ($harness) reopen_keeps_completed_keys $persistent);
        $crate::dedup_suite!(@case ($harness) completed_keys_survive_process_kill $persistent);
        $crate::dedup_suite!(@case ($harness) unusable_location_is_a_clear_error $persistent);
    };
    (@case ($harness:expr) $case:ident run) => {
        #[tokio::test(flavor = "multi_thread")]
        async fn $case() {
            let harness = $harness;
            let case = $crate::dedup_suite::Case {
                module_path: module_path!(),
                name: stringify!($case),
            };
            $crate::dedup_suite::$case(&harness, &case).await;
        }
    };
    (@case ($harness:expr) $case:ident ignore) => {
        #[tokio::test(flavor = "multi_thread")]
        #[ignore = "this store keeps nothing across a restart (declared volatile)"]
        async fn $case() {
            let harness = $harness;
            let case = $crate::dedup_suite::Case {
                module_path: module_path!(),
                name: stringify!($case),
            };
            $crate::dedup_suite::$case(&harness, &case).await;
        }
    };
    ($harness:expr) => {
        $crate::dedup_suite!(@all ($harness) run);
    };
    ($harness:expr, volatile) => {
        $crate::dedup_suite!(@all ($harness) ignore);
    };
}

// ---------------------------------------------------------------------------------------------
// Helpers.

const HOUR: Duration = Duration::from_secs(3600);
const LONG_LEASE: Duration = Duration::from_secs(60);

fn prefix() -> String {
    format!("{:016x}", rand::random::<u64>())
}

fn req(key: &str, owner: &str, lease: Duration) -> ClaimRequest {
    ClaimRequest {
        key: key.to_string(),
        owner: owner.to_string(),
        lease,
        fingerprint: None,
    }
}

fn req_fp(key: &str, owner: &str, payload: &[u8]) -> ClaimRequest {
    ClaimRequest {
        fingerprint: Some(fingerprint(payload)),
        ..req(key, owner, LONG_LEASE)
    }
}

async fn claimed(store: &dyn DedupStore, request: ClaimRequest) -> FencingToken {
    let key = request.key.clone();
    match store.claim_one(request).await.expect("claim") {
        ClaimOutcome::Claimed { token } => token,
        other => panic!("claim of '{key}': expected Claimed, got {other:?}"),
    }
}

async fn claim_and_complete(
    store: &dyn DedupStore,
    key: &str,
    owner: &str,
    result: Option<&'static [u8]>,
) -> FencingToken {
    let token = claimed(store, req(key, owner, LONG_LEASE)).await;
    assert!(
        store
            .complete_one(key, token, result.map(Bytes::from_static))
            .await
            .expect("complete"),
        "completion of '{key}' with its own token refused"
    );
    token
}

// ---------------------------------------------------------------------------------------------
// Cases.

/// Claim, complete, then a second claim is a duplicate carrying the stored result (or none).
pub async fn claim_complete_duplicate_returns_stored_result(h: &dyn StoreHarness, _: &Case) {
    let store = h.open(HOUR).await;
    let p = prefix();
    let (with, without) = (format!("{p}-with"), format!("{p}-without"));
    claim_and_complete(&*store, &with, "a", Some(b"output-1")).await;
    claim_and_complete(&*store, &without, "a", None).await;
    for owner in ["a", "b"] {
        assert_eq!(
            store
                .claim_one(req(&with, owner, LONG_LEASE))
                .await
                .unwrap(),
            ClaimOutcome::Duplicate {
                result: Some(Bytes::from_static(b"output-1"))
            }
        );
        assert_eq!(
            store
                .claim_one(req(&without, owner, LONG_LEASE))
                .await
                .unwrap(),
            ClaimOutcome::Duplicate { result: None }
        );
    }
}

/// A released key is claimable again, by anyone, with a higher token; the released token is
/// stale from then on.
pub async fn release_makes_key_claimable_with_higher_token(h: &dyn StoreHarness, _: &Case) {
    let store = h.open(HOUR).await;
    let key = format!("{}-k", prefix());
    let t1 = claimed(&*store, req(&key, "a", LONG_LEASE)).await;
    assert!(store.release_one(&key, t1).await.unwrap());
    assert!(
        !store.release_one(&key, t1).await.unwrap(),
        "second release with the same token accepted"
    );
    assert_eq!(store.get_one(&key).await.unwrap(), None);
    let t2 = claimed(&*store, req(&key, "b", LONG_LEASE)).await;
    assert!(t2 > t1, "token after release {t2} not above {t1}");
    assert!(
        !store.complete_one(&key, t1, None).await.unwrap(),
        "completion with the released token accepted"
    );
    assert!(store.complete_one(&key, t2, None).await.unwrap());
    assert!(matches!(
        store.claim_one(req(&key, "a", LONG_LEASE)).await.unwrap(),
        ClaimOutcome::Duplicate { .. }
    ));
}

/// 8 workers (tasks on a multi-thread runtime) race over the same 1000 keys, half claiming one
/// key at a time and half in batches of 10: every key's handler runs exactly once and every key
/// ends completed by the worker that ran it.
pub async fn concurrent_workers_handle_each_key_exactly_once(h: &dyn StoreHarness, _: &Case) {
    const WORKERS: usize = 8;
    const KEYS: usize = 1000;
    let store = h.open(HOUR).await;
    let p = prefix();
    let keys: Arc<Vec<String>> = Arc::new((0..KEYS).map(|i| format!("{p}-race-{i}")).collect());
    let handled: Arc<Mutex<HashMap<String, Vec<String>>>> = Arc::default();
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let (store, keys, handled) = (store.clone(), keys.clone(), handled.clone());
        tasks.push(tokio::spawn(async move {
            let order = {
                use rand::seq::SliceRandom;
                let mut order: Vec<usize> = (0..KEYS).collect();
                order.shuffle(&mut rand::rng());
                order
            };
            let owner = format!("worker-{w}");
            let batch = if w % 2 == 0 { 1 } else { 10 };
            for chunk in order.chunks(batch) {
                let reqs: Vec<ClaimRequest> = chunk
                    .iter()
                    .map(|&i| req(&keys[i], &owner, LONG_LEASE))
                    .collect();
                let outcomes = store.claim(&reqs).await.expect("claim");
                assert_eq!(outcomes.len(), reqs.len());
                let mut done = Vec::new();
                for (r, o) in reqs.iter().zip(outcomes) {
                    match o {
                        ClaimOutcome::Claimed { token } => {
                            // The "handler".
                            handled
                                .lock()
                                .unwrap()
                                .entry(r.key.clone())
                                .or_default()
                                .push(owner.clone());
                            tokio::task::yield_now().await;
                            done.push(Completion {
                                key: r.key.clone(),
                                token,
                                result: Some(Bytes::from(owner.clone())),
                            });
                        }
                        ClaimOutcome::Duplicate { .. } | ClaimOutcome::InProgress { .. } => {}
                        other => panic!("{}: unexpected {other:?}", r.key),
                    }
                }
                let ok = store.complete(&done).await.expect("complete");
                assert!(ok.iter().all(|b| *b), "{owner}: a completion was refused");
            }
        }));
    }
    for t in tasks {
        t.await.expect("worker panicked");
    }
    let handled = handled.lock().unwrap().clone();
    assert_eq!(handled.len(), KEYS, "keys never handled");
    for (key, runs) in &handled {
        assert_eq!(runs.len(), 1, "{key} handled by {runs:?}");
    }
    let states = store.get(&keys).await.unwrap();
    for (key, state) in keys.iter().zip(states) {
        match state {
            Some(KeyState::Completed { result, .. }) => {
                assert_eq!(result, Some(Bytes::from(handled[key][0].clone())), "{key}");
            }
            other => panic!("{key}: expected Completed, got {other:?}"),
        }
    }
}

/// A lease that ran out is taken over by another owner with a higher token; the old holder's
/// renew, complete and release are then refused while the new holder's succeed.
pub async fn expired_lease_is_taken_over_and_old_token_fenced(h: &dyn StoreHarness, _: &Case) {
    let store = h.open(HOUR).await;
    let key = format!("{}-k", prefix());
    let lease = Duration::from_millis(300);
    let ta = claimed(&*store, req(&key, "a", lease)).await;
    match store.claim_one(req(&key, "b", LONG_LEASE)).await.unwrap() {
        ClaimOutcome::InProgress { owner, expires_in } => {
            assert_eq!(owner, "a");
            assert!(expires_in <= lease, "expires_in {expires_in:?} > lease");
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    let tb = claimed(&*store, req(&key, "b", LONG_LEASE)).await;
    assert!(tb > ta, "takeover token {tb} not above {ta}");
    assert!(
        !store.renew_one(&key, ta, LONG_LEASE).await.unwrap(),
        "stale renew accepted"
    );
    assert!(
        !store.complete_one(&key, ta, None).await.unwrap(),
        "stale completion accepted"
    );
    assert!(
        !store.release_one(&key, ta).await.unwrap(),
        "stale release accepted"
    );
    match store.get_one(&key).await.unwrap() {
        Some(KeyState::InProgress { owner, token, .. }) => {
            assert_eq!((owner.as_str(), token), ("b", tb));
        }
        other => panic!("expected InProgress by b, got {other:?}"),
    }
    assert!(store.renew_one(&key, tb, LONG_LEASE).await.unwrap());
    assert!(store
        .complete_one(&key, tb, Some(Bytes::from_static(b"by-b")))
        .await
        .unwrap());
    assert_eq!(
        store.claim_one(req(&key, "a", LONG_LEASE)).await.unwrap(),
        ClaimOutcome::Duplicate {
            result: Some(Bytes::from_static(b"by-b"))
        }
    );
}

/// Renewing a lease keeps the key held past the original lease.
pub async fn renew_extends_the_lease(h: &dyn StoreHarness, _: &Case) {
    let store = h.open(HOUR).await;
    let key = format!("{}-k", prefix());
    let t = claimed(&*store, req(&key, "a", Duration::from_millis(300))).await;
    assert!(store.renew_one(&key, t, LONG_LEASE).await.unwrap());
    tokio::time::sleep(Duration::from_millis(500)).await;
    match store.claim_one(req(&key, "b", LONG_LEASE)).await.unwrap() {
        ClaimOutcome::InProgress { owner, expires_in } => {
            assert_eq!(owner, "a");
            assert!(expires_in > Duration::from_secs(30), "{expires_in:?}");
        }
        other => panic!("renewed lease taken over: {other:?}"),
    }
    assert!(store.complete_one(&key, t, None).await.unwrap());
}

/// A zero (or sub-millisecond) lease, in a claim or a renewal, is a config error naming it,
/// and nothing is claimed;
/// `Duration::MAX` is a lease like any other (the store saturates it): the key is held, renewed
/// and completed.
pub async fn a_zero_lease_is_refused_and_the_longest_holds(h: &dyn StoreHarness, _: &Case) {
    let store = h.open(HOUR).await;
    let key = format!("{}-k", prefix());
    let e = store
        .claim(&[
            req(&key, "a", LONG_LEASE),
            req(&format!("{key}-2"), "a", Duration::ZERO),
        ])
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.message().contains("lease is 0"), "{e}");
    assert_eq!(
        store.get(std::slice::from_ref(&key)).await.unwrap(),
        vec![None],
        "a refused batch claims nothing"
    );
    let t = claimed(&*store, req(&key, "a", Duration::MAX)).await;
    let e = store.renew_one(&key, t, Duration::ZERO).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    // Under a millisecond is zero to a store counting whole milliseconds.
    let e = store
        .renew_one(&key, t, Duration::from_micros(999))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    match store.claim_one(req(&key, "b", LONG_LEASE)).await.unwrap() {
        ClaimOutcome::InProgress { owner, expires_in } => {
            assert_eq!(owner, "a");
            assert!(
                expires_in > Duration::from_secs(3600 * 24 * 365),
                "{expires_in:?}"
            );
        }
        other => panic!("a key held for Duration::MAX: {other:?}"),
    }
    assert!(store.renew_one(&key, t, Duration::MAX).await.unwrap());
    assert!(store.complete_one(&key, t, None).await.unwrap());
    assert!(matches!(
        store.claim_one(req(&key, "b", LONG_LEASE)).await.unwrap(),
        ClaimOutcome::Duplicate { .. }
    ));
}

/// The holder claiming its key again gets a new, higher token; the previous one is stale.
pub async fn same_owner_reclaim_gets_new_token(h: &dyn StoreHarness, _: &Case) {
    let store = h.open(HOUR).await;
    let key = format!("{}-k", prefix());
    let t1 = claimed(&*store, req(&key, "a", LONG_LEASE)).await;
    let t2 = claimed(&*store, req(&key, "a", LONG_LEASE)).await;
    assert!(t2 > t1, "re-claim token {t2} not above {t1}");
    assert!(matches!(
        store.claim_one(req(&key, "b", LONG_LEASE)).await.unwrap(),
        ClaimOutcome::InProgress { ref owner, .. } if owner == "a"
    ));
    assert!(
        !store.complete_one(&key, t1, None).await.unwrap(),
        "completion with the superseded token accepted"
    );
    assert!(store.complete_one(&key, t2, None).await.unwrap());
}

/// Completed keys are forgotten once the window (300 ms here) has passed.
pub async fn completed_keys_expire_after_window(h: &dyn StoreHarness, _: &Case) {
    let window = Duration::from_millis(300);
    let store = h.open(window).await;
    assert_eq!(store.window(), window);
    let key = format!("{}-k", prefix());
    claim_and_complete(&*store, &key, "a", Some(b"r")).await;
    assert!(matches!(
        store.claim_one(req(&key, "a", LONG_LEASE)).await.unwrap(),
        ClaimOutcome::Duplicate { .. }
    ));
    assert!(matches!(
        store.get_one(&key).await.unwrap(),
        Some(KeyState::Completed { .. })
    ));
    tokio::time::sleep(window + Duration::from_millis(300)).await;
    assert_eq!(
        store.get_one(&key).await.unwrap(),
        None,
        "key outlived the window"
    );
    claimed(&*store, req(&key, "b", LONG_LEASE)).await;
}

/// The same key with another payload fingerprint is a mismatch (held or completed); the same
/// fingerprint, or none, is not.
pub async fn fingerprint_mismatch_and_match(h: &dyn StoreHarness, _: &Case) {
    let store = h.open(HOUR).await;
    let key = format!("{}-k", prefix());
    let (fa, fb) = (fingerprint(b"payload-a"), fingerprint(b"payload-b"));
    let t = claimed(&*store, req_fp(&key, "a", b"payload-a")).await;
    assert_eq!(
        store
            .claim_one(req_fp(&key, "b", b"payload-b"))
            .await
            .unwrap(),
        ClaimOutcome::Mismatch {
            stored: fa,
            given: fb
        }
    );
    assert!(matches!(
        store
            .claim_one(req_fp(&key, "b", b"payload-a"))
            .await
            .unwrap(),
        ClaimOutcome::InProgress { .. }
    ));
    assert!(store.complete_one(&key, t, None).await.unwrap());
    assert_eq!(
        store
            .claim_one(req_fp(&key, "b", b"payload-b"))
            .await
            .unwrap(),
        ClaimOutcome::Mismatch {
            stored: fa,
            given: fb
        }
    );
    assert_eq!(
        store
            .claim_one(req_fp(&key, "b", b"payload-a"))
            .await
            .unwrap(),
        ClaimOutcome::Duplicate { result: None }
    );
    assert_eq!(
        store.claim_one(req(&key, "b", LONG_LEASE)).await.unwrap(),
        ClaimOutcome::Duplicate { result: None },
        "a claim without fingerprint is compared with nothing"
    );
    match store.get_one(&key).await.unwrap() {
        Some(KeyState::Completed { fingerprint, .. }) => assert_eq!(fingerprint, Some(fa)),
        other => panic!("expected Completed, got {other:?}"),
    }
}

/// Every batched operation answers per item, in request order, over keys in mixed states.
pub async fn batched_ops_give_per_item_outcomes_in_order(h: &dyn StoreHarness, _: &Case) {
    let store = h.open(HOUR).await;
    let p = prefix();
    let k = |s: &str| format!("{p}-{s}");
    claim_and_complete(&*store, &k("done"), "x", Some(b"R")).await;
    let t_held = claimed(&*store, req(&k("held"), "other", LONG_LEASE)).await;
    let t_fp = claimed(&*store, req_fp(&k("fp"), "x", b"A")).await;
    store.complete_one(&k("fp"), t_fp, None).await.unwrap();

    let outcomes = store
        .claim(&[
            req(&k("fresh"), "me", LONG_LEASE),
            req(&k("done"), "me", LONG_LEASE),
            req(&k("held"), "me", LONG_LEASE),
            req_fp(&k("fp"), "me", b"B"),
            req(&k("fresh"), "me", LONG_LEASE),
            req(&k("fresh2"), "me", LONG_LEASE),
        ])
        .await
        .unwrap();
    assert_eq!(outcomes.len(), 6);
    let ClaimOutcome::Claimed { token: t1 } = outcomes[0] else {
        panic!("fresh: {:?}", outcomes[0])
    };
    assert_eq!(
        outcomes[1],
        ClaimOutcome::Duplicate {
            result: Some(Bytes::from_static(b"R"))
        }
    );
    assert!(
        matches!(&outcomes[2], ClaimOutcome::InProgress { owner, .. } if owner == "other"),
        "held: {:?}",
        outcomes[2]
    );
    assert!(
        matches!(outcomes[3], ClaimOutcome::Mismatch { .. }),
        "fp: {:?}",
        outcomes[3]
    );
    let ClaimOutcome::Claimed { token: t2 } = outcomes[4] else {
        panic!("fresh again by its holder: {:?}", outcomes[4])
    };
    assert!(t2 > t1);
    let ClaimOutcome::Claimed { token: t3 } = outcomes[5] else {
        panic!("fresh2: {:?}", outcomes[5])
    };

    let renewed = store
        .renew(
            &[
                (k("fresh"), t1),
                (k("fresh"), t2),
                (k("held"), t_held + 1000),
                (k("unknown"), 1),
                (k("fresh2"), t3),
            ],
            LONG_LEASE,
        )
        .await
        .unwrap();
    assert_eq!(renewed, vec![false, true, false, false, true]);

    let released = store
        .release(&[(k("fresh2"), t3 + 1000), (k("fresh2"), t3), (k("done"), 1)])
        .await
        .unwrap();
    assert_eq!(released, vec![false, true, false]);

    let completed = store
        .complete(&[
            Completion {
                key: k("fresh"),
                token: t1,
                result: None,
            },
            Completion {
                key: k("fresh"),
                token: t2,
                result: Some(Bytes::from_static(b"F")),
            },
            Completion {
                key: k("held"),
                token: t_held + 1000,
                result: None,
            },
            Completion {
                key: k("unknown"),
                token: 1,
                result: None,
            },
        ])
        .await
        .unwrap();
    assert_eq!(completed, vec![false, true, false, false]);

    let states = store
        .get(&[k("fresh"), k("unknown"), k("held"), k("fresh2"), k("done")])
        .await
        .unwrap();
    assert_eq!(states.len(), 5);
    assert!(
        matches!(&states[0], Some(KeyState::Completed { token, result: Some(r), .. }) if *token == t2 && r == "F"),
        "fresh: {:?}",
        states[0]
    );
    assert_eq!(states[1], None);
    assert!(
        matches!(&states[2], Some(KeyState::InProgress { owner, token, .. }) if owner == "other" && *token == t_held),
        "held: {:?}",
        states[2]
    );
    assert_eq!(states[3], None, "released key still stored");
    assert!(matches!(&states[4], Some(KeyState::Completed { .. })));

    // Empty batches are fine.
    assert!(store.claim(&[]).await.unwrap().is_empty());
    assert!(store.get(&[]).await.unwrap().is_empty());
}

/// `get` reports unknown, in-progress (holder, token, time left, fingerprint) and completed
/// (token, result, fingerprint) keys.
pub async fn get_reports_states(h: &dyn StoreHarness, _: &Case) {
    let store = h.open(HOUR).await;
    let key = format!("{}-k", prefix());
    assert_eq!(store.get_one(&key).await.unwrap(), None);
    let lease = Duration::from_secs(30);
    let t = claimed(
        &*store,
        ClaimRequest {
            lease,
            ..req_fp(&key, "a", b"P")
        },
    )
    .await;
    match store.get_one(&key).await.unwrap() {
        Some(KeyState::InProgress {
            owner,
            token,
            expires_in,
            fingerprint: fp,
        }) => {
            assert_eq!(
                (owner.as_str(), token, fp),
                ("a", t, Some(fingerprint(b"P")))
            );
            assert!(expires_in <= lease && expires_in > lease - Duration::from_secs(5));
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
    assert!(store
        .complete_one(&key, t, Some(Bytes::from_static(b"out")))
        .await
        .unwrap());
    assert_eq!(
        store.get_one(&key).await.unwrap(),
        Some(KeyState::Completed {
            token: t,
            result: Some(Bytes::from_static(b"out")),
            fingerprint: Some(fingerprint(b"P")),
        })
    );
}

/// A store opened again on the same data (in this process) still knows completed keys and
/// leases, and its tokens keep increasing.
pub async fn reopen_keeps_completed_keys(h: &dyn StoreHarness, _: &Case) {
    let store = h.open(HOUR).await;
    let p = prefix();
    let done = format!("{p}-done");
    let held = format!("{p}-held");
    let t_done = claim_and_complete(&*store, &done, "a", Some(b"kept")).await;
    let t_held = claimed(&*store, req(&held, "a", LONG_LEASE)).await;
    drop(store);
    let store = h
        .reopen()
        .await
        .expect("a persistent harness reopens its store (else declare it volatile)");
    assert_eq!(
        store.claim_one(req(&done, "b", LONG_LEASE)).await.unwrap(),
        ClaimOutcome::Duplicate {
            result: Some(Bytes::from_static(b"kept"))
        }
    );
    assert!(matches!(
        store.claim_one(req(&held, "b", LONG_LEASE)).await.unwrap(),
        ClaimOutcome::InProgress { ref owner, .. } if owner == "a"
    ));
    let t_again = claimed(&*store, req(&held, "a", LONG_LEASE)).await;
    assert!(t_again > t_held.max(t_done), "token went back after reopen");
}

/// Completed keys survive a real process crash: a child process (this test binary, re-run in
/// writer mode) commits keys and is SIGKILLed; this process then finds every one of them.
pub async fn completed_keys_survive_process_kill(h: &dyn StoreHarness, case: &Case) {
    if let Ok(location) = std::env::var(CHILD_ENV) {
        return child_writer(h, &location).await;
    }
    let store = h.open(HOUR).await;
    let location = h
        .location()
        .expect("a persistent harness gives its store's location (else declare it volatile)");
    drop(store);

    let exe = std::env::current_exe().expect("test binary path");
    let mut child = Command::new(exe)
        .args([
            &case.test_path(),
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &location)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the child writer");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut seen = Vec::new();
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            // libtest may print "test NAME ... " on the same line first.
            if line.trim_end().ends_with(CHILD_READY) {
                let _ = tx.send(Ok(()));
                return;
            }
            seen.push(line);
        }
        let _ = tx.send(Err(seen.join("\n")));
    });
    let ready = tokio::task::spawn_blocking(move || rx.recv_timeout(Duration::from_secs(120)))
        .await
        .unwrap();
    // SIGKILL: no destructor, no clean close of the store.
    child.kill().expect("kill the child");
    let status = child.wait().expect("reap the child");
    match ready {
        Ok(Ok(())) => {}
        Ok(Err(output)) => panic!("child writer ended without committing ({status}):\n{output}"),
        Err(_) => panic!("child writer not ready within 120 s"),
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            status.signal(),
            Some(9),
            "child was not SIGKILLed: {status}"
        );
    }

    let store = h
        .open_location(&location, HOUR)
        .await
        .expect("open the store the child wrote");
    let keys: Vec<String> = (0..CHILD_KEYS).map(|i| format!("restart-{i}")).collect();
    let reqs: Vec<ClaimRequest> = keys.iter().map(|k| req(k, "parent", LONG_LEASE)).collect();
    let outcomes = store.claim(&reqs).await.unwrap();
    for (i, o) in outcomes.iter().enumerate() {
        assert_eq!(
            *o,
            ClaimOutcome::Duplicate {
                result: Some(Bytes::from(format!("result-{i}")))
            },
            "key restart-{i} lost across the crash"
        );
    }
    assert!(
        matches!(
            store.claim_one(req("restart-held", "parent", LONG_LEASE)).await.unwrap(),
            ClaimOutcome::InProgress { ref owner, .. } if owner == "child"
        ),
        "the child's lease was lost across the crash"
    );
}

/// The child side of [`completed_keys_survive_process_kill`]: commits the keys, says so, then
/// waits to be killed.
async fn child_writer(h: &dyn StoreHarness, location: &str) {
    let store = h
        .open_location(location, HOUR)
        .await
        .expect("child: open the store");
    let keys: Vec<String> = (0..CHILD_KEYS).map(|i| format!("restart-{i}")).collect();
    // Half in one batch, half one by one.
    let (batch, single) = keys.split_at(CHILD_KEYS / 2);
    let reqs: Vec<ClaimRequest> = batch.iter().map(|k| req(k, "child", HOUR)).collect();
    let outcomes = store.claim(&reqs).await.unwrap();
    let completions: Vec<Completion> = batch
        .iter()
        .zip(outcomes)
        .enumerate()
        .map(|(i, (key, o))| match o {
            ClaimOutcome::Claimed { token } => Completion {
                key: key.clone(),
                token,
                result: Some(Bytes::from(format!("result-{i}"))),
            },
            other => panic!("child: {key}: {other:?}"),
        })
        .collect();
    assert!(store
        .complete(&completions)
        .await
        .unwrap()
        .iter()
        .all(|b| *b));
    for (i, key) in single.iter().enumerate() {
        let t = claimed(&*store, req(key, "child", HOUR)).await;
        let result = Bytes::from(format!("result-{}", i + batch.len()));
        assert!(store.complete_one(key, t, Some(result)).await.unwrap());
    }
    claimed(&*store, req("restart-held", "child", HOUR)).await;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{CHILD_READY}").unwrap();
    out.flush().unwrap();
    drop(out);
    // Keep the store open: the parent kills this process.
    tokio::time::sleep(Duration::from_secs(300)).await;
    panic!("child: not killed within 300 s");
}

/// Opening a location that cannot hold a store fails with a `DedupStore` error naming it.
pub async fn unusable_location_is_a_clear_error(h: &dyn StoreHarness, _: &Case) {
    let locations = h.unusable_locations().await;
    assert!(
        !locations.is_empty(),
        "a persistent harness lists unusable locations (else declare it volatile)"
    );
    for location in locations {
        match h.open_location(&location, HOUR).await {
            Ok(_) => panic!("opening '{location}' succeeded"),
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::DedupStore, "{location}: {e}");
                assert!(
                    e.message().contains(&location),
                    "error does not name '{location}': {e}"
                );
            }
        }
    }
}

/// One store's round trip, for a store opened some other way than a suite's harness (over
/// TLS, say): claim, complete with a result, the duplicate, get.
pub async fn round_trip(store: &dyn DedupStore) {
    let key = format!("k-{}", crate::harness::random_suffix());
    let claim = |owner: &str| ClaimRequest {
        key: key.clone(),
        owner: owner.into(),
        lease: Duration::from_secs(30),
        fingerprint: Some(7),
    };
    let token = match store.claim_one(claim("w1")).await.unwrap() {
        ClaimOutcome::Claimed { token } => token,
        other => panic!("{other:?}"),
    };
    match store.claim_one(claim("w2")).await.unwrap() {
        ClaimOutcome::InProgress { owner, .. } => assert_eq!(owner, "w1"),
        other => panic!("{other:?}"),
    }
    assert!(store
        .complete_one(&key, token, Some(Bytes::from_static(b"done")))
        .await
        .unwrap());
    assert_eq!(
        store.claim_one(claim("w2")).await.unwrap(),
        ClaimOutcome::Duplicate {
            result: Some(Bytes::from_static(b"done"))
        }
    );
    match store.get_one(&key).await.unwrap() {
        Some(KeyState::Completed {
            token: t, result, ..
        }) => {
            assert_eq!(t, token);
            assert_eq!(result.as_deref(), Some(&b"done"[..]));
        }
        other => panic!("{other:?}"),
    }
}
