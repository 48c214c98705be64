//! The checkpoint-store (lease table) conformance suite: written once against
//! [`CheckpointStore`](onceflow_core::checkpoint::CheckpointStore), run for every store through a [`CheckpointHarness`] and the
//! [`checkpoint_suite!`](crate::checkpoint_suite!) macro. It checks the semantics documented in
//! `onceflow_core::checkpoint`.
//!
//! ```ignore
//! // tests/checkpoint_embedded.rs: one #[tokio::test] per case.
//! onceflow_conformance::checkpoint_suite!(onceflow_conformance::checkpoint_suite::EmbeddedHarness::new());
//! // A store that keeps nothing across a restart marks the persistence cases ignored:
//! onceflow_conformance::checkpoint_suite!(onceflow_conformance::checkpoint_suite::MemoryHarness, volatile);
//! ```
//!
//! Every case opens its own store and uses its own random group name, so cases never share
//! state, even on a shared server. Expiry cases use leases of 300 ms and sleep past them.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use onceflow_core::checkpoint::{
    CheckpointRequest, CheckpointStoreExt, EmbeddedCheckpointStore, HeldLease, Lease, LeaseCounter,
    MemoryCheckpointStore, NewLease, SharedCheckpointStore, TakeOutcome, TakeRequest,
};
use onceflow_core::ErrorKind;

/// How a store plugs into the suite.
#[async_trait]
pub trait CheckpointHarness: Send + Sync {
    /// Opens a store (a new one, or a connection to a shared server: cases use random groups).
    async fn open(&self) -> SharedCheckpointStore;

    /// Opens the store last returned by [`open`](Self::open) again, as a restarted process
    /// would, or as a second process sharing it would (same data, a new handle / connection).
    /// `None` when the store keeps nothing across a restart.
    async fn reopen(&self) -> Option<SharedCheckpointStore> {
        None
    }
}

/// The in-process [`MemoryCheckpointStore`]. Keeps nothing across a restart: use
/// `checkpoint_suite!(MemoryHarness, volatile)`.
#[derive(Debug, Default, Clone, Copy)]
pub struct MemoryHarness;

#[async_trait]
impl CheckpointHarness for MemoryHarness {
    async fn open(&self) -> SharedCheckpointStore {
        Arc::new(MemoryCheckpointStore::new())
    }
}

/// The on-disk [`EmbeddedCheckpointStore`], one file per [`open`](CheckpointHarness::open) in a
/// temporary directory removed with the harness.
#[derive(Debug, Default)]
pub struct EmbeddedHarness {
    dir: OnceLock<tempfile::TempDir>,
    last: Mutex<Option<PathBuf>>,
}

impl EmbeddedHarness {
    /// A harness; its directory is created on the first open.
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait]
impl CheckpointHarness for EmbeddedHarness {
    async fn open(&self) -> SharedCheckpointStore {
        let dir = self.dir.get_or_init(|| {
            tempfile::Builder::new()
                .prefix("onceflow-checkpoint-suite-")
                .tempdir()
                .expect("create a temporary directory")
        });
        let path = dir
            .path()
            .join(format!("leases-{:016x}.db", rand::random::<u64>()));
        let store = EmbeddedCheckpointStore::open(&path)
            .await
            .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
        *self.last.lock().unwrap() = Some(path);
        Arc::new(store)
    }

    async fn reopen(&self) -> Option<SharedCheckpointStore> {
        let path = self.last.lock().unwrap().clone()?;
        Some(Arc::new(
            EmbeddedCheckpointStore::open(&path)
                .await
                .unwrap_or_else(|e| panic!("reopen {}: {e}", path.display())),
        ))
    }
}

/// Expands to one `#[tokio::test(flavor = "multi_thread")]` per suite case, each evaluating
/// `$harness` anew. With `, volatile`, the cases that need a store surviving a restart are
/// `#[ignore]`d with the reason.
#[macro_export]
macro_rules! checkpoint_suite {
    (@all ($harness:expr) $persistent:ident) => {
        $crate::checkpoint_suite!(@case ($harness) create_is_if_absent_and_list_is_ordered run);
        $crate::checkpoint_suite!(@case ($harness) take_renew_checkpoint_release_cycle run);
        $crate::checkpoint_suite!(@case ($harness) take_with_stale_counter_is_refused run);
        $crate::checkpoint_suite!(@case ($harness) racing_takers_exactly_one_wins run);
        $crate::checkpoint_suite!(@case ($harness) live_lease_is_kept_expired_lease_taken_over run);
        $crate::checkpoint_suite!(@case ($harness) stale_owner_is_fenced_everywhere run);
        $crate::checkpoint_suite!(@case ($harness) expired_but_untaken_lease_renews run);
        $crate::checkpoint_suite!(@case ($harness) release_hands_off_at_once run);
        $crate::checkpoint_suite!(@case ($harness) parents_and_shard_end_are_kept run);
        $crate::checkpoint_suite!(@case ($harness) delete_removes_rows run);
        $crate::checkpoint_suite!(@case ($harness) batched_ops_give_per_item_outcomes_in_order run);
        $crate::checkpoint_suite!(@case ($harness) groups_are_isolated run);
        $crate::checkpoint_suite!(@case ($harness) empty_names_are_config_errors run);
        $crate::checkpoint_suite!(@case ($harness) reopen_keeps_leases_and_checkpoints $persistent);
        $crate::checkpoint_suite!(@case ($harness) two_handles_race_on_one_store $persistent);
    };
    (@case ($harness:expr) $case:ident run) => {
        #[tokio::test(flavor = "multi_thread")]
        async fn $case() {
            let harness = $harness;
            $crate::checkpoint_suite::$case(&harness).await;
        }
    };
    (@case ($harness:expr) $case:ident ignore) => {
        #[tokio::test(flavor = "multi_thread")]
        #[ignore = "this store keeps nothing across a restart (declared volatile)"]
        async fn $case() {
            let harness = $harness;
            $crate::checkpoint_suite::$case(&harness).await;
        }
    };
    ($harness:expr) => {
        $crate::checkpoint_suite!(@all ($harness) run);
    };
    ($harness:expr, volatile) => {
        $crate::checkpoint_suite!(@all ($harness) ignore);
    };
}

// ---------------------------------------------------------------------------------------------
// Helpers.

const LONG: Duration = Duration::from_secs(60);
const SHORT: Duration = Duration::from_millis(300);
/// Sleep that outlasts [`SHORT`] with margin for a store on another clock.
const PAST_SHORT: Duration = Duration::from_millis(600);

fn group() -> String {
    format!("suite-{:016x}", rand::random::<u64>())
}

fn new_lease(key: &str) -> NewLease {
    NewLease {
        key: key.to_string(),
        checkpoint: None,
        parents: Vec::new(),
    }
}

fn take_req(key: &str, owner: &str, expected: LeaseCounter, lease: Duration) -> TakeRequest {
    TakeRequest {
        key: key.to_string(),
        owner: owner.to_string(),
        expected_counter: expected,
        lease,
    }
}

fn held(key: &str, owner: &str, counter: LeaseCounter) -> HeldLease {
    HeldLease {
        key: key.to_string(),
        owner: owner.to_string(),
        counter,
    }
}

fn cp(key: &str, owner: &str, counter: LeaseCounter, checkpoint: &str) -> CheckpointRequest {
    CheckpointRequest {
        key: key.to_string(),
        owner: owner.to_string(),
        counter,
        checkpoint: checkpoint.to_string(),
    }
}

async fn taken(
    store: &SharedCheckpointStore,
    g: &str,
    key: &str,
    owner: &str,
    expected: LeaseCounter,
    lease: Duration,
) -> LeaseCounter {
    match store
        .take_one(g, take_req(key, owner, expected, lease))
        .await
        .expect("take")
    {
        TakeOutcome::Taken { counter } => {
            assert_eq!(counter, expected + 1, "take of {key} by {owner}");
            counter
        }
        other => panic!("take of {key} by {owner} at {expected}: expected Taken, got {other:?}"),
    }
}

async fn row(store: &SharedCheckpointStore, g: &str, key: &str) -> Lease {
    store
        .get_one(g, key)
        .await
        .expect("get")
        .unwrap_or_else(|| panic!("no row for {key}"))
}

// ---------------------------------------------------------------------------------------------
// Cases.

/// Create makes a fresh row (no owner, counter 0, the given checkpoint and parents) only when
/// absent; list returns the group's rows by key in byte order.
pub async fn create_is_if_absent_and_list_is_ordered(h: &dyn CheckpointHarness) {
    let store = h.open().await;
    let g = group();
    assert_eq!(store.list(&g).await.unwrap(), Vec::new());
    let created = store
        .create(
            &g,
            &[
                new_lease("shardId-000000000002"),
                NewLease {
                    key: "shardId-000000000001".into(),
                    checkpoint: Some("4959".into()),
                    parents: vec!["shardId-000000000000".into()],
                },
                new_lease("Z-upper"),
            ],
        )
        .await
        .unwrap();
    assert_eq!(created, vec![true, true, true]);
    let c = taken(&store, &g, "shardId-000000000002", "a", 0, LONG).await;
    assert!(
        !store
            .create_one(&g, new_lease("shardId-000000000002"))
            .await
            .unwrap(),
        "create over an existing row reported true"
    );
    let r = row(&store, &g, "shardId-000000000002").await;
    assert_eq!(
        (r.owner.as_deref(), r.counter),
        (Some("a"), c),
        "create touched an existing row"
    );
    let list = store.list(&g).await.unwrap();
    let keys: Vec<&str> = list.iter().map(|l| l.key.as_str()).collect();
    assert_eq!(
        keys,
        ["Z-upper", "shardId-000000000001", "shardId-000000000002"]
    );
    let fresh = &list[1];
    assert_eq!(fresh.owner, None);
    assert_eq!(fresh.counter, 0);
    assert_eq!(fresh.expires_in, Duration::ZERO);
    assert_eq!(fresh.checkpoint.as_deref(), Some("4959"));
    assert_eq!(fresh.parents, vec!["shardId-000000000000".to_string()]);
    assert!(fresh.is_available());
    assert!(!list[2].is_available());
}

/// The holder's lifecycle: take (counter 0→1, expiry ≈ lease), renew (→2), checkpoint (counter
/// unchanged), release (→3, no owner, checkpoint kept).
pub async fn take_renew_checkpoint_release_cycle(h: &dyn CheckpointHarness) {
    let store = h.open().await;
    let g = group();
    let k = "shardId-000000000000";
    store.create_one(&g, new_lease(k)).await.unwrap();
    let c1 = taken(&store, &g, k, "w1", 0, LONG).await;
    let r = row(&store, &g, k).await;
    assert_eq!(r.owner.as_deref(), Some("w1"));
    assert!(
        r.expires_in > Duration::from_secs(50) && r.expires_in <= LONG,
        "expires_in {:?} for a 60 s lease",
        r.expires_in
    );
    let c2 = store
        .renew_one(&g, &held(k, "w1", c1), LONG)
        .await
        .unwrap()
        .expect("renew refused");
    assert_eq!(c2, c1 + 1);
    assert!(store
        .checkpoint_one(
            &g,
            cp(
                k,
                "w1",
                c2,
                "49590338271490256608559692538361571095921575989136588898"
            )
        )
        .await
        .unwrap());
    let r = row(&store, &g, k).await;
    assert_eq!(r.counter, c2, "checkpoint moved the counter");
    assert_eq!(
        r.checkpoint.as_deref(),
        Some("49590338271490256608559692538361571095921575989136588898")
    );
    assert!(
        !store
            .checkpoint_one(&g, cp(k, "w1", c1, "1"))
            .await
            .unwrap(),
        "checkpoint with the counter before the renew accepted"
    );
    assert!(store.release_one(&g, &held(k, "w1", c2)).await.unwrap());
    let r = row(&store, &g, k).await;
    assert_eq!(r.owner, None);
    assert_eq!(r.counter, c2 + 1);
    assert_eq!(r.expires_in, Duration::ZERO);
    assert_eq!(
        r.checkpoint.as_deref(),
        Some("49590338271490256608559692538361571095921575989136588898"),
        "release lost the checkpoint"
    );
    assert!(!store.release_one(&g, &held(k, "w1", c2)).await.unwrap());
}

/// A take whose expected counter is not the row's is refused and reports the row; a take of a
/// missing row is refused with no row.
pub async fn take_with_stale_counter_is_refused(h: &dyn CheckpointHarness) {
    let store = h.open().await;
    let g = group();
    let k = "k";
    store.create_one(&g, new_lease(k)).await.unwrap();
    for wrong in [1, 7] {
        match store
            .take_one(&g, take_req(k, "a", wrong, LONG))
            .await
            .unwrap()
        {
            TakeOutcome::Refused { current: Some(l) } => {
                assert_eq!((l.owner, l.counter), (None, 0));
            }
            other => panic!("take at counter {wrong}: expected Refused, got {other:?}"),
        }
    }
    assert_eq!(
        store
            .take_one(&g, take_req("missing", "a", 0, LONG))
            .await
            .unwrap(),
        TakeOutcome::Refused { current: None }
    );
    let c = taken(&store, &g, k, "a", 0, LONG).await;
    // The holder taking again (a restart with the same worker id) succeeds at the current
    // counter, not at an old one.
    assert!(matches!(
        store.take_one(&g, take_req(k, "a", 0, LONG)).await.unwrap(),
        TakeOutcome::Refused { .. }
    ));
    taken(&store, &g, k, "a", c, LONG).await;
}

/// 16 workers race to take the same unowned lease with the same expected counter, 20 rounds
/// over 5 keys: exactly one take per key and round succeeds.
pub async fn racing_takers_exactly_one_wins(h: &dyn CheckpointHarness) {
    const WORKERS: usize = 16;
    const KEYS: usize = 5;
    let store = h.open().await;
    let g = group();
    let keys: Vec<String> = (0..KEYS).map(|i| format!("shard-{i}")).collect();
    store
        .create(&g, &keys.iter().map(|k| new_lease(k)).collect::<Vec<_>>())
        .await
        .unwrap();
    for round in 0..20u64 {
        // Every row is unowned at counter 2 * round here.
        let barrier = Arc::new(tokio::sync::Barrier::new(WORKERS));
        let mut tasks = Vec::new();
        for w in 0..WORKERS {
            let (store, g, keys, barrier) =
                (store.clone(), g.clone(), keys.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                let owner = format!("w{w}");
                barrier.wait().await;
                let reqs: Vec<TakeRequest> = keys
                    .iter()
                    .map(|k| take_req(k, &owner, 2 * round, LONG))
                    .collect();
                let out = if w % 2 == 0 {
                    store.take(&g, &reqs).await.unwrap()
                } else {
                    let mut out = Vec::new();
                    for r in reqs {
                        out.push(store.take_one(&g, r).await.unwrap());
                    }
                    out
                };
                (owner, out)
            }));
        }
        let mut winners = vec![Vec::new(); KEYS];
        for t in tasks {
            let (owner, out) = t.await.unwrap();
            assert_eq!(out.len(), KEYS);
            for (i, o) in out.into_iter().enumerate() {
                if let TakeOutcome::Taken { counter } = o {
                    assert_eq!(counter, 2 * round + 1);
                    winners[i].push(owner.clone());
                }
            }
        }
        for (i, w) in winners.iter().enumerate() {
            assert_eq!(w.len(), 1, "round {round}, {}: winners {w:?}", keys[i]);
            let r = row(&store, &g, &keys[i]).await;
            assert_eq!(r.owner.as_deref(), Some(w[0].as_str()));
            assert!(store
                .release_one(&g, &held(&keys[i], &w[0], 2 * round + 1))
                .await
                .unwrap());
        }
    }
}

/// Another worker cannot take a live lease (even at the right counter); once the lease expired
/// (store clock) it can, with the counter it read.
pub async fn live_lease_is_kept_expired_lease_taken_over(h: &dyn CheckpointHarness) {
    let store = h.open().await;
    let g = group();
    let k = "k";
    store.create_one(&g, new_lease(k)).await.unwrap();
    let ca = taken(&store, &g, k, "a", 0, SHORT).await;
    match store
        .take_one(&g, take_req(k, "b", ca, LONG))
        .await
        .unwrap()
    {
        TakeOutcome::Refused { current: Some(l) } => {
            assert_eq!(l.owner.as_deref(), Some("a"));
            assert!(!l.is_available());
            assert!(
                l.expires_in <= SHORT && !l.expires_in.is_zero(),
                "{:?}",
                l.expires_in
            );
        }
        other => panic!("take of a live lease: expected Refused, got {other:?}"),
    }
    tokio::time::sleep(PAST_SHORT).await;
    let r = row(&store, &g, k).await;
    assert_eq!(r.owner.as_deref(), Some("a"), "expired owner still shown");
    assert_eq!(r.expires_in, Duration::ZERO);
    assert!(r.is_available());
    let cb = taken(&store, &g, k, "b", r.counter, LONG).await;
    assert_eq!(cb, ca + 1);
    let r = row(&store, &g, k).await;
    assert_eq!(r.owner.as_deref(), Some("b"));
}

/// After a takeover the old holder's renew, checkpoint and release are all refused and change
/// nothing; a worker naming the right counter but the wrong owner is refused too.
pub async fn stale_owner_is_fenced_everywhere(h: &dyn CheckpointHarness) {
    let store = h.open().await;
    let g = group();
    let k = "k";
    store.create_one(&g, new_lease(k)).await.unwrap();
    let ca = taken(&store, &g, k, "a", 0, SHORT).await;
    assert!(store
        .checkpoint_one(&g, cp(k, "a", ca, "100"))
        .await
        .unwrap());
    tokio::time::sleep(PAST_SHORT).await;
    let cb = taken(&store, &g, k, "b", ca, LONG).await;
    assert!(
        !store
            .checkpoint_one(&g, cp(k, "a", ca, "200"))
            .await
            .unwrap(),
        "stale owner's checkpoint accepted"
    );
    assert!(
        !store
            .checkpoint_one(&g, cp(k, "a", cb, "200"))
            .await
            .unwrap(),
        "checkpoint by a non-owner with the current counter accepted"
    );
    assert_eq!(
        store.renew_one(&g, &held(k, "a", ca), LONG).await.unwrap(),
        None,
        "stale renew accepted"
    );
    assert!(!store.release_one(&g, &held(k, "a", ca)).await.unwrap());
    let r = row(&store, &g, k).await;
    assert_eq!(
        (r.owner.as_deref(), r.counter, r.checkpoint.as_deref()),
        (Some("b"), cb, Some("100")),
        "a refused call changed the row"
    );
    assert!(store
        .checkpoint_one(&g, cp(k, "b", cb, "300"))
        .await
        .unwrap());
    assert_eq!(row(&store, &g, k).await.checkpoint.as_deref(), Some("300"));
}

/// A holder whose lease expired but that nobody took over renews and checkpoints normally (the
/// counter is the fence, not the clock).
pub async fn expired_but_untaken_lease_renews(h: &dyn CheckpointHarness) {
    let store = h.open().await;
    let g = group();
    let k = "k";
    store.create_one(&g, new_lease(k)).await.unwrap();
    let c = taken(&store, &g, k, "a", 0, SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    assert!(store.checkpoint_one(&g, cp(k, "a", c, "7")).await.unwrap());
    let c2 = store
        .renew_one(&g, &held(k, "a", c), LONG)
        .await
        .unwrap()
        .expect("renew of an expired, untaken lease refused");
    let r = row(&store, &g, k).await;
    assert_eq!((r.counter, r.is_available()), (c2, false));
    assert!(matches!(
        store
            .take_one(&g, take_req(k, "b", c2, LONG))
            .await
            .unwrap(),
        TakeOutcome::Refused { .. }
    ));
}

/// A released lease is taken by another worker at once (no waiting for expiry), at the counter
/// after the release; the releaser's counter is stale.
pub async fn release_hands_off_at_once(h: &dyn CheckpointHarness) {
    let store = h.open().await;
    let g = group();
    let k = "k";
    store.create_one(&g, new_lease(k)).await.unwrap();
    let ca = taken(&store, &g, k, "a", 0, LONG).await;
    assert!(store
        .checkpoint_one(&g, cp(k, "a", ca, "42"))
        .await
        .unwrap());
    assert!(store.release_one(&g, &held(k, "a", ca)).await.unwrap());
    let r = row(&store, &g, k).await;
    assert!(r.is_available());
    let cb = taken(&store, &g, k, "b", r.counter, LONG).await;
    assert_eq!(cb, ca + 2);
    assert_eq!(row(&store, &g, k).await.checkpoint.as_deref(), Some("42"));
    assert!(!store
        .checkpoint_one(&g, cp(k, "a", ca, "43"))
        .await
        .unwrap());
}

/// Parents are stored in order, and a checkpoint is kept as given: Kinesis's end-of-shard mark
/// (`onceflow_kinesis::SHARD_END`, which the store does not interpret) on a finished row.
pub async fn parents_and_shard_end_are_kept(h: &dyn CheckpointHarness) {
    const SHARD_END: &str = "SHARD_END";
    let store = h.open().await;
    let g = group();
    let (p0, p1, child) = (
        "shardId-000000000000",
        "shardId-000000000001",
        "shardId-000000000002",
    );
    store
        .create(
            &g,
            &[
                new_lease(p0),
                new_lease(p1),
                NewLease {
                    key: child.into(),
                    checkpoint: None,
                    parents: vec![p1.into(), p0.into()],
                },
            ],
        )
        .await
        .unwrap();
    let c = taken(&store, &g, p0, "a", 0, LONG).await;
    assert!(store
        .checkpoint_one(&g, cp(p0, "a", c, SHARD_END))
        .await
        .unwrap());
    let list = store.list(&g).await.unwrap();
    assert_eq!(list[0].checkpoint.as_deref(), Some(SHARD_END));
    assert_eq!(list[1].checkpoint, None);
    assert_eq!(list[2].parents, vec![p1.to_string(), p0.to_string()]);
}

/// Delete removes rows (true), missing rows are false, and a deleted key can be created anew.
pub async fn delete_removes_rows(h: &dyn CheckpointHarness) {
    let store = h.open().await;
    let g = group();
    store
        .create(&g, &[new_lease("a"), new_lease("b")])
        .await
        .unwrap();
    taken(&store, &g, "a", "w", 0, LONG).await;
    assert_eq!(
        store.delete(&g, &["a".into(), "zz".into()]).await.unwrap(),
        vec![true, false]
    );
    assert_eq!(store.get_one(&g, "a").await.unwrap(), None);
    assert_eq!(store.list(&g).await.unwrap().len(), 1);
    assert!(store.create_one(&g, new_lease("a")).await.unwrap());
    assert_eq!(row(&store, &g, "a").await.counter, 0);
}

/// Batched calls with mixed outcomes give one outcome per item, in request order.
pub async fn batched_ops_give_per_item_outcomes_in_order(h: &dyn CheckpointHarness) {
    let store = h.open().await;
    let g = group();
    let keys: Vec<String> = (0..6).map(|i| format!("k{i}")).collect();
    assert_eq!(
        store
            .create(
                &g,
                &keys[..4].iter().map(|k| new_lease(k)).collect::<Vec<_>>()
            )
            .await
            .unwrap(),
        vec![true; 4]
    );
    // k1 already held by someone else.
    taken(&store, &g, "k1", "other", 0, LONG).await;
    let out = store
        .take(
            &g,
            &keys
                .iter()
                .map(|k| take_req(k, "me", 0, LONG))
                .collect::<Vec<_>>(),
        )
        .await
        .unwrap();
    let won: Vec<bool> = out
        .iter()
        .map(|o| matches!(o, TakeOutcome::Taken { .. }))
        .collect();
    assert_eq!(won, [true, false, true, true, false, false]);
    let got = store.get(&g, &keys).await.unwrap();
    assert_eq!(
        got.iter().map(Option::is_some).collect::<Vec<_>>(),
        [true, true, true, true, false, false]
    );
    let mine = |k: &str, c| held(k, "me", c);
    let renewed = store
        .renew(
            &g,
            &[mine("k0", 1), mine("k1", 1), mine("k2", 9), mine("k5", 1)],
            LONG,
        )
        .await
        .unwrap();
    assert_eq!(renewed, [Some(2), None, None, None]);
    let cps = store
        .checkpoint(
            &g,
            &[
                cp("k0", "me", 2, "a"),
                cp("k2", "me", 1, "b"),
                cp("k3", "me", 5, "c"),
            ],
        )
        .await
        .unwrap();
    assert_eq!(cps, [true, true, false]);
    let rel = store
        .release(&g, &[mine("k3", 1), mine("k0", 1), mine("k2", 1)])
        .await
        .unwrap();
    assert_eq!(rel, [true, false, true]);
    assert_eq!(store.take(&g, &[]).await.unwrap(), Vec::new());
    assert_eq!(store.get(&g, &[]).await.unwrap(), Vec::new());
}

/// Rows of one group are invisible to another, and the same key in two groups is two rows.
pub async fn groups_are_isolated(h: &dyn CheckpointHarness) {
    let store = h.open().await;
    let (g1, g2) = (group(), group());
    store.create_one(&g1, new_lease("s")).await.unwrap();
    assert_eq!(store.list(&g2).await.unwrap(), Vec::new());
    assert!(store.create_one(&g2, new_lease("s")).await.unwrap());
    taken(&store, &g1, "s", "a", 0, LONG).await;
    assert_eq!(row(&store, &g2, "s").await.owner, None);
}

/// An empty group, key or owner is a `Config` error.
pub async fn empty_names_are_config_errors(h: &dyn CheckpointHarness) {
    let store = h.open().await;
    let g = group();
    assert_eq!(store.list("").await.unwrap_err().kind(), ErrorKind::Config);
    assert_eq!(
        store
            .create_one(&g, new_lease(""))
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::Config
    );
    assert_eq!(
        store
            .take_one(&g, take_req("k", "", 0, LONG))
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::Config
    );
}

/// Leases, counters, checkpoints and parents survive closing and reopening the store; the
/// holder's counter still fences after the restart.
pub async fn reopen_keeps_leases_and_checkpoints(h: &dyn CheckpointHarness) {
    let g = group();
    let (c, before) = {
        let store = h.open().await;
        store
            .create(
                &g,
                &[
                    new_lease("p"),
                    NewLease {
                        key: "c".into(),
                        checkpoint: None,
                        parents: vec!["p".into()],
                    },
                ],
            )
            .await
            .unwrap();
        let c = taken(&store, &g, "p", "a", 0, LONG).await;
        assert!(store
            .checkpoint_one(&g, cp("p", "a", c, "12345"))
            .await
            .unwrap());
        (c, store.list(&g).await.unwrap())
    };
    let store = h.reopen().await.expect("a persistent harness reopens");
    let after = store.list(&g).await.unwrap();
    assert_eq!(after.len(), 2);
    for (b, a) in before.iter().zip(&after) {
        assert_eq!(
            (&b.key, &b.owner, b.counter, &b.checkpoint, &b.parents),
            (&a.key, &a.owner, a.counter, &a.checkpoint, &a.parents)
        );
    }
    assert!(!after[1].is_available(), "lease lost its expiry on restart");
    assert!(store
        .checkpoint_one(&g, cp("p", "a", c, "12346"))
        .await
        .unwrap());
    assert!(!store
        .checkpoint_one(&g, cp("p", "a", c - 1, "1"))
        .await
        .unwrap());
}

/// Two handles on the same store (as two processes would have) race takes over 20 keys: each
/// key is won exactly once, and each handle sees the other's writes.
pub async fn two_handles_race_on_one_store(h: &dyn CheckpointHarness) {
    let s1 = h.open().await;
    let s2 = h.reopen().await.expect("a persistent harness reopens");
    let g = group();
    let keys: Vec<String> = (0..20).map(|i| format!("shardId-{i:012}")).collect();
    let created = {
        let news: Vec<NewLease> = keys.iter().map(|k| new_lease(k)).collect();
        let (a, b) = tokio::join!(s1.create(&g, &news), s2.create(&g, &news));
        a.unwrap()
            .into_iter()
            .zip(b.unwrap())
            .filter(|(a, b)| *a ^ *b)
            .count()
    };
    assert_eq!(created, keys.len(), "a row created twice or not at all");
    let race = |s: SharedCheckpointStore, owner: &'static str| {
        let (g, keys) = (g.clone(), keys.clone());
        tokio::spawn(async move {
            let mut won = HashSet::new();
            for k in &keys {
                if let TakeOutcome::Taken { .. } =
                    s.take_one(&g, take_req(k, owner, 0, LONG)).await.unwrap()
                {
                    won.insert(k.clone());
                }
            }
            won
        })
    };
    let (w1, w2) = (race(s1.clone(), "one"), race(s2.clone(), "two"));
    let (w1, w2) = (w1.await.unwrap(), w2.await.unwrap());
    assert!(w1.is_disjoint(&w2), "a key won by both handles");
    assert_eq!(w1.len() + w2.len(), keys.len());
    for l in s1.list(&g).await.unwrap() {
        let expected = if w1.contains(&l.key) { "one" } else { "two" };
        assert_eq!(l.owner.as_deref(), Some(expected), "{}", l.key);
    }
}

/// One store's lease cycle, for a store opened some other way than a suite's harness (over
/// TLS, say): create, take, checkpoint, renew, release.
pub async fn lease_round_trip(store: &dyn onceflow_core::checkpoint::CheckpointStore) {
    let group = format!("g-{}", crate::harness::random_suffix());
    assert!(store
        .create_one(
            &group,
            NewLease {
                key: "shard-1".into(),
                checkpoint: None,
                parents: vec![],
            },
        )
        .await
        .unwrap());
    let lease = store.get_one(&group, "shard-1").await.unwrap().unwrap();
    let counter = match store
        .take_one(
            &group,
            TakeRequest {
                key: "shard-1".into(),
                owner: "w1".into(),
                expected_counter: lease.counter,
                lease: Duration::from_secs(30),
            },
        )
        .await
        .unwrap()
    {
        TakeOutcome::Taken { counter } => counter,
        other => panic!("{other:?}"),
    };
    assert!(store
        .checkpoint_one(
            &group,
            CheckpointRequest {
                key: "shard-1".into(),
                owner: "w1".into(),
                counter,
                checkpoint: "seq-42".into(),
            },
        )
        .await
        .unwrap());
    let held = HeldLease {
        key: "shard-1".into(),
        owner: "w1".into(),
        counter,
    };
    let renewed = store
        .renew_one(&group, &held, Duration::from_secs(30))
        .await
        .unwrap()
        .expect("renewed");
    let held = HeldLease {
        counter: renewed,
        ..held
    };
    assert!(store.release_one(&group, &held).await.unwrap());
    let lease = store.get_one(&group, "shard-1").await.unwrap().unwrap();
    assert_eq!(lease.checkpoint.as_deref(), Some("seq-42"));
    assert!(lease.owner.is_none(), "{lease:?}");
    assert!(store.delete_one(&group, "shard-1").await.unwrap());
}
