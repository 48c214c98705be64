//! In-memory dedup store: bounded, with a TTL window, built on the `quick_cache` crate.
//!
//! Why `quick_cache` and not `moka`: on the D1 benchmark (1M random keys) moka's sync cache
//! with per-entry expiry cost several microseconds per operation and ~600 bytes per key, far
//! from the ≤ 200 ns/op and < 200 MB per 1M keys targets; quick_cache's closure-based `entry`
//! API gives the same per-key atomicity at a fraction of the cost. The figures are in
//! `benches/RESULTS.md`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use opentelemetry::metrics::Counter;
use opentelemetry::{global, KeyValue};
use quick_cache::sync::{Cache, EntryAction, EntryResult};
use quick_cache::{DefaultHashBuilder, Lifecycle, OptionsBuilder, UnitWeighter};

use super::{
    ClaimOutcome, ClaimRequest, Completion, DedupStore, FencingToken, Fingerprint, KeyState,
};
use crate::error::Result;

/// Default dedup window of a [`MemoryStore`]: 24 hours.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(24 * 60 * 60);

/// Default capacity of a [`MemoryStore`]: 10 million keys.
pub const DEFAULT_CAPACITY: u64 = 10_000_000;

/// Number of stripe locks serialising the claims of a key (a power of two).
const STRIPES: usize = 4096;

/// Bounded in-memory dedup store with a TTL window.
///
/// - **Completed** keys are remembered for the store's `window` (wall time since completion),
///   then treated as unknown.
/// - **In-progress** keys hold for their lease (`ClaimRequest::lease`); once the lease has run
///   out, another owner may take the key over and gets a higher fencing token. An expired lease
///   nobody took over still belongs to its holder (its renew/complete succeed); the entry is
///   dropped one `window` after its lease ran out.
/// - **Bounded**: at most `capacity` keys (default [`DEFAULT_CAPACITY`]). When full, the cache's
///   S3-FIFO policy evicts completed keys (least recently and least frequently seen first);
///   keys under a live lease are pinned and never evicted. An evicted completed key is
///   forgotten early: **a redelivery of it runs the handler again**, so the store deduplicates
///   only as far back as its capacity reaches, not its whole window. Size the capacity for the
///   number of keys expected within one window. The store says when this happens: the first
///   eviction of a key still inside its window logs one `tracing` warning per store (naming
///   the capacity and the window), and every such eviction is counted, readable with
///   [`MemoryStore::evicted_in_window`] and exported as the OpenTelemetry counter
///   `onceflow.dedup.evicted_in_window` (attribute `onceflow.dedup.store` = `memory`).
/// - **Atomic per key**: every claim holds one of 4096 stripe locks chosen by the key; a claim
///   that only reads (duplicate, held by another owner, mismatch) decides from a consistent
///   snapshot, and every change of an existing entry runs inside the cache's per-key
///   `entry` closure, so two concurrent claims of one free key give exactly one `Claimed`.
/// - Fencing tokens come from one counter per store, so they increase per key even across a
///   release, an expiry or an eviction.
/// - Expired entries are dropped lazily when touched and by an amortised sweep that runs at most
///   once per `window / 2` (between 100 ms and 5 min), on a blocking thread.
///
/// Time is measured with a monotonic clock ([`Instant`]); nothing survives the process.
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    cache: Cache<String, Entry, UnitWeighter, DefaultHashBuilder, Pinning>,
    /// Shared with the cache's [`Pinning`] lifecycle, which sees every eviction.
    evictions: Arc<Evictions>,
    window: Duration,
    window_ms: u64,
    capacity: u64,
    base: Instant,
    next_token: AtomicU64,
    /// Serialises the claims of one key (see [`Inner::claim_one`]).
    stripes: Box<[parking_lot::Mutex<()>]>,
    /// Store-clock milliseconds at which the next sweep may start.
    next_sweep_ms: AtomicU64,
    sweep_interval_ms: u64,
}

#[derive(Clone)]
struct Entry {
    token: FencingToken,
    /// Held: lease deadline. Done: expiry of the completed key. Store-clock milliseconds.
    deadline_ms: u64,
    /// Fingerprint as two words (an `Option<u128>` would force 16-byte alignment).
    fingerprint: Option<[u64; 2]>,
    state: State,
}

#[derive(Clone)]
enum State {
    Held(Arc<str>),
    Done(Option<Bytes>),
}

impl Entry {
    /// Whether the entry has outlived everything it is kept for (see [`MemoryStore`]).
    fn is_dead(&self, now_ms: u64, window_ms: u64) -> bool {
        match self.state {
            State::Held(_) => self.deadline_ms.saturating_add(window_ms) <= now_ms,
            State::Done(_) => self.deadline_ms <= now_ms,
        }
    }

    /// Whether the entry still decides a claim (completed and within the window, or under a
    /// lease that has not run out).
    fn is_live(&self, now_ms: u64) -> bool {
        self.deadline_ms > now_ms
    }
}

/// Pins entries whose lease is live so capacity eviction never drops an in-progress key, and
/// reports evictions of entries still inside their window (see [`Evictions`]).
#[derive(Clone)]
struct Pinning {
    base: Instant,
    window_ms: u64,
    evictions: Arc<Evictions>,
}

/// Capacity evictions of entries the store was still keeping (a completed key within its
/// window, or an expired lease within the window after it): each one lets a duplicate through.
struct Evictions {
    count: AtomicU64,
    warned: AtomicBool,
    capacity: u64,
    window: Duration,
    otel: Counter<u64>,
    attrs: [KeyValue; 1],
}

impl Evictions {
    fn record(&self) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.otel.add(1, &self.attrs);
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                capacity = self.capacity,
                window = ?self.window,
                "memory dedup store is full (capacity {} keys): it evicted a key still inside its \
                 {:?} dedup window, so a redelivery of an evicted key runs the handler again \
                 (duplicates older than the eviction can now pass); raise capacity= to the keys \
                 expected within one window, or use an embedded store. Logged once per store; \
                 every such eviction is counted (onceflow.dedup.evicted_in_window)",
                self.capacity,
                self.window,
            );
        }
    }
}

impl Lifecycle<String, Entry> for Pinning {
    type RequestState = ();

    fn begin_request(&self) -> Self::RequestState {}

    fn is_pinned(&self, _key: &String, val: &Entry) -> bool {
        matches!(val.state, State::Held(_)) && val.deadline_ms > millis(self.base.elapsed())
    }

    fn on_evict(&self, _state: &mut Self::RequestState, _key: String, val: Entry) {
        // Called for capacity evictions only (not for removals, replacements or the sweep).
        if !val.is_dead(millis(self.base.elapsed()), self.window_ms) {
            self.evictions.record();
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn split_fp(fp: Fingerprint) -> [u64; 2] {
    [(fp >> 64) as u64, fp as u64]
}

fn join_fp(words: [u64; 2]) -> Fingerprint {
    (u128::from(words[0]) << 64) | u128::from(words[1])
}

impl Default for MemoryStore {
    /// A store with a 24 h window ([`DEFAULT_WINDOW`]) and room for 10M keys
    /// ([`DEFAULT_CAPACITY`]).
    fn default() -> Self {
        MemoryStore::new(DEFAULT_WINDOW, DEFAULT_CAPACITY)
    }
}

impl MemoryStore {
    /// A store that remembers completed keys for `window` and holds at most `capacity` keys
    /// (a capacity of 0 is taken as 1). Memory grows with the keys actually stored, roughly
    /// 170 bytes per 32-character key without a stored result (see `benches/RESULTS.md`).
    pub fn new(window: Duration, capacity: u64) -> Self {
        let capacity = capacity.max(1);
        let base = Instant::now();
        // The estimate sizes the ghost (recently evicted keys) table up front; keep it modest so
        // an idle store with a large capacity costs little.
        let estimated = usize::try_from(capacity.min(1 << 16)).unwrap_or(1 << 16);
        let options = OptionsBuilder::new()
            .estimated_items_capacity(estimated)
            .weight_capacity(capacity)
            .build()
            .expect("quick_cache options are valid: capacity ≥ 1");
        let window_ms = millis(window);
        let evictions = Arc::new(Evictions {
            count: AtomicU64::new(0),
            warned: AtomicBool::new(false),
            capacity,
            window,
            otel: global::meter(crate::trace::SCOPE)
                .u64_counter("onceflow.dedup.evicted_in_window")
                .with_description(
                    "Keys a full dedup store evicted while still inside their dedup window \
                     (a redelivery of such a key runs the handler again)",
                )
                .with_unit("{key}")
                .build(),
            attrs: [KeyValue::new("onceflow.dedup.store", "memory")],
        });
        let cache = Cache::with_options(
            options,
            UnitWeighter,
            DefaultHashBuilder::default(),
            Pinning {
                base,
                window_ms,
                evictions: Arc::clone(&evictions),
            },
        );
        MemoryStore {
            inner: Arc::new(Inner {
                cache,
                evictions,
                window,
                window_ms,
                capacity,
                base,
                next_token: AtomicU64::new(1),
                stripes: (0..STRIPES).map(|_| parking_lot::Mutex::new(())).collect(),
                next_sweep_ms: AtomicU64::new(0),
                sweep_interval_ms: (window_ms / 2).clamp(100, 5 * 60 * 1000),
            }),
        }
    }

    /// Maximum number of keys held.
    pub fn capacity(&self) -> u64 {
        self.inner.capacity
    }

    /// How many keys the store evicted, because it was full, while they were still inside their
    /// dedup window (completed keys, or expired leases not yet past the window). Each such
    /// key is forgotten early: its redelivery runs the handler again. Non-zero means the
    /// capacity is too small for the window; the first such eviction is also logged (once per
    /// store).
    pub fn evicted_in_window(&self) -> u64 {
        self.inner.evictions.count.load(Ordering::Relaxed)
    }

    /// Number of keys held right now, including expired ones not dropped yet.
    pub fn len(&self) -> usize {
        self.inner.cache.len()
    }

    /// Whether the store holds no key.
    pub fn is_empty(&self) -> bool {
        self.inner.cache.is_empty()
    }

    /// Drops every expired entry now (the store also does this by itself, amortised). Walks all
    /// keys under the cache's shard locks: O(keys).
    pub fn purge_expired(&self) {
        self.inner.sweep();
    }
}

impl Inner {
    fn now_ms(&self) -> u64 {
        millis(self.base.elapsed())
    }

    fn token(&self) -> FencingToken {
        self.next_token.fetch_add(1, Ordering::Relaxed)
    }

    fn sweep(&self) {
        let now = self.now_ms();
        let window_ms = self.window_ms;
        self.cache.retain(|_, e| !e.is_dead(now, window_ms));
    }

    fn stripe(&self, key: &str) -> parking_lot::MutexGuard<'_, ()> {
        let h = xxhash_rust::xxh3::xxh3_64(key.as_bytes());
        self.stripes[(h as usize) & (STRIPES - 1)].lock()
    }

    /// The outcome of a claim that changes nothing (duplicate, held by another owner,
    /// fingerprint mismatch), decided from a snapshot of a live entry; `None` when the claim
    /// must write.
    fn read_only_outcome(
        e: &Entry,
        owner: &str,
        given: Option<[u64; 2]>,
        now: u64,
    ) -> Option<ClaimOutcome> {
        if !e.is_live(now) {
            return None;
        }
        if let (Some(stored), Some(given)) = (e.fingerprint, given) {
            if stored != given {
                return Some(ClaimOutcome::Mismatch {
                    stored: join_fp(stored),
                    given: join_fp(given),
                });
            }
        }
        match &e.state {
            State::Done(result) => Some(ClaimOutcome::Duplicate {
                result: result.clone(),
            }),
            State::Held(holder) if **holder != *owner => Some(ClaimOutcome::InProgress {
                owner: holder.to_string(),
                expires_in: Duration::from_millis(e.deadline_ms - now),
            }),
            State::Held(_) => None,
        }
    }

    /// Claims one key under the key's stripe lock, so two claims of one key never both insert
    /// it. Outcomes that change nothing are read from a snapshot taken under the cache's
    /// shared lock (consistent, so still linearisable). An unknown key, the common case, costs
    /// two cache lookups (the snapshot and the insert).
    fn claim_one(&self, req: &ClaimRequest, owner: &Arc<str>, now: u64) -> ClaimOutcome {
        let lease_until = now.saturating_add(millis(req.lease));
        let given = req.fingerprint.map(split_fp);
        let key = req.key.as_str();
        let _stripe = self.stripe(key);
        let held = |token| Entry {
            token,
            deadline_ms: lease_until,
            fingerprint: given,
            state: State::Held(owner.clone()),
        };
        match self.cache.peek(key) {
            Some(e) => {
                if let Some(outcome) = Self::read_only_outcome(&e, &req.owner, given, now) {
                    return outcome;
                }
            }
            None => {
                // Unknown key: every claim that inserts it holds this stripe, so a plain insert
                // is safe.
                let token = self.token();
                self.cache.insert(req.key.clone(), held(token));
                return ClaimOutcome::Claimed { token };
            }
        }
        loop {
            let result = self.cache.entry(key, None, |_, e| {
                if let Some(outcome) = Self::read_only_outcome(e, &req.owner, given, now) {
                    return EntryAction::Retain(outcome);
                }
                let token = self.token();
                if e.is_live(now) {
                    // The holder claims again (e.g. after a restart): new token, fresh lease.
                    e.token = token;
                    e.deadline_ms = lease_until;
                    if e.fingerprint.is_none() {
                        e.fingerprint = given;
                    }
                } else {
                    // Completed past its window, or a lease that ran out: take it over.
                    *e = held(token);
                }
                EntryAction::Retain(ClaimOutcome::Claimed { token })
            });
            match result {
                EntryResult::Retained(outcome) => return outcome,
                // Dropped by the sweep or evicted meanwhile.
                EntryResult::Vacant(guard) => {
                    let token = self.token();
                    // Fails only if the placeholder vanished meanwhile; look again.
                    if guard.insert(held(token)).is_ok() {
                        return ClaimOutcome::Claimed { token };
                    }
                }
                // The closure never removes and `None` waits without a timeout.
                EntryResult::Removed(..) | EntryResult::Replaced(..) | EntryResult::Timeout => {}
            }
        }
    }

    /// Runs `f` on the stored entry of `key`; `false` when the key is unknown. One cache
    /// lookup: an unknown key gets a placeholder that the dropped guard removes again, and
    /// holding the key's stripe keeps every claim (the only inserts) away from it meanwhile.
    fn update(&self, key: &str, f: impl FnOnce(&mut Entry) -> EntryAction<bool>) -> bool {
        let _stripe = self.stripe(key);
        match self.cache.entry(key, None, |_, e| f(e)) {
            EntryResult::Retained(ok) => ok,
            EntryResult::Removed(..) => true,
            // Unknown key: dropping the guard removes the placeholder again.
            EntryResult::Vacant(_) | EntryResult::Replaced(..) | EntryResult::Timeout => false,
        }
    }

    fn maybe_sweep(self: &Arc<Self>, now: u64) {
        let due = self.next_sweep_ms.load(Ordering::Relaxed);
        if now < due
            || self
                .next_sweep_ms
                .compare_exchange(
                    due,
                    now + self.sweep_interval_ms,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_err()
        {
            return;
        }
        if due == 0 {
            // First operation: nothing can have expired yet.
            return;
        }
        let inner = Arc::clone(self);
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn_blocking(move || inner.sweep());
            }
            Err(_) => inner.sweep(),
        }
    }
}

#[async_trait]
impl DedupStore for MemoryStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn window(&self) -> Duration {
        self.inner.window
    }

    async fn claim(&self, requests: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>> {
        super::check_claims(requests)?;
        let inner = &self.inner;
        let now = inner.now_ms();
        inner.maybe_sweep(now);
        let mut out = Vec::with_capacity(requests.len());
        // Batches usually come from one worker: share one owner string across the batch.
        let mut owner: Option<Arc<str>> = None;
        for req in requests {
            let o = match &owner {
                Some(o) if **o == *req.owner => o.clone(),
                _ => owner.insert(Arc::from(req.owner.as_str())).clone(),
            };
            out.push(inner.claim_one(req, &o, now));
        }
        Ok(out)
    }

    async fn renew(&self, claims: &[(String, FencingToken)], lease: Duration) -> Result<Vec<bool>> {
        super::check_lease(lease)?;
        let inner = &self.inner;
        let now = inner.now_ms();
        let lease_until = now.saturating_add(millis(lease));
        Ok(claims
            .iter()
            .map(|(key, token)| {
                inner.update(key, |e| {
                    let ok = e.token == *token && matches!(e.state, State::Held(_));
                    if ok {
                        e.deadline_ms = lease_until;
                    }
                    EntryAction::Retain(ok)
                })
            })
            .collect())
    }

    async fn complete(&self, completions: &[Completion]) -> Result<Vec<bool>> {
        let inner = &self.inner;
        let now = inner.now_ms();
        let expires = now.saturating_add(inner.window_ms);
        Ok(completions
            .iter()
            .map(|c| {
                inner.update(&c.key, |e| {
                    if e.token != c.token {
                        return EntryAction::Retain(false);
                    }
                    match e.state {
                        State::Held(_) => {
                            e.state = State::Done(c.result.clone());
                            e.deadline_ms = expires;
                            EntryAction::Retain(true)
                        }
                        // A repeated completion by the same claim: already done.
                        State::Done(_) => EntryAction::Retain(e.is_live(now)),
                    }
                })
            })
            .collect())
    }

    async fn release(&self, claims: &[(String, FencingToken)]) -> Result<Vec<bool>> {
        let inner = &self.inner;
        Ok(claims
            .iter()
            .map(|(key, token)| {
                inner.update(key, |e| {
                    if e.token == *token && matches!(e.state, State::Held(_)) {
                        EntryAction::Remove
                    } else {
                        EntryAction::Retain(false)
                    }
                })
            })
            .collect())
    }

    async fn get(&self, keys: &[String]) -> Result<Vec<Option<KeyState>>> {
        let inner = &self.inner;
        let now = inner.now_ms();
        Ok(keys
            .iter()
            .map(|key| {
                let e = inner.cache.peek(key.as_str())?;
                if e.is_dead(now, inner.window_ms) {
                    return None;
                }
                let fingerprint = e.fingerprint.map(join_fp);
                Some(match e.state {
                    State::Held(owner) => KeyState::InProgress {
                        owner: owner.to_string(),
                        token: e.token,
                        expires_in: Duration::from_millis(e.deadline_ms.saturating_sub(now)),
                        fingerprint,
                    },
                    State::Done(result) => KeyState::Completed {
                        token: e.token,
                        result,
                        fingerprint,
                    },
                })
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dedup::DedupStoreExt;

    fn req(key: &str, owner: &str) -> ClaimRequest {
        ClaimRequest {
            key: key.into(),
            owner: owner.into(),
            lease: Duration::from_secs(30),
            fingerprint: None,
        }
    }

    #[tokio::test]
    async fn fingerprint_round_trips() {
        let fp = crate::dedup::fingerprint(b"payload");
        assert_eq!(join_fp(split_fp(fp)), fp);
    }

    #[tokio::test]
    async fn capacity_evicts_completed_keys_but_never_live_leases() {
        let store = MemoryStore::new(Duration::from_secs(60), 64);
        // Hold 16 leases, then push 1000 completed keys through the cache.
        let mut held = Vec::new();
        for i in 0..16 {
            let key = format!("held-{i}");
            match store.claim_one(req(&key, "w")).await.unwrap() {
                ClaimOutcome::Claimed { token } => held.push((key, token)),
                other => panic!("{other:?}"),
            }
        }
        for i in 0..1000 {
            let key = format!("done-{i}");
            let ClaimOutcome::Claimed { token } = store.claim_one(req(&key, "w")).await.unwrap()
            else {
                panic!("fresh key not claimed")
            };
            assert!(store.complete_one(&key, token, None).await.unwrap());
        }
        assert!(store.len() <= 128, "len {} far above capacity", store.len());
        for (key, token) in held {
            assert!(
                store.complete_one(&key, token, None).await.unwrap(),
                "{key} evicted"
            );
        }
    }

    /// Collects the WARN events logged on this thread, as text (message and fields).
    #[derive(Clone, Default)]
    struct Warnings(Arc<parking_lot::Mutex<Vec<String>>>);

    impl tracing::Subscriber for Warnings {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, event: &tracing::Event<'_>) {
            struct Text(String);
            impl tracing::field::Visit for Text {
                fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                    self.0.push_str(&format!("{}={v:?} ", f.name()));
                }
            }
            if *event.metadata().level() == tracing::Level::WARN {
                let mut text = Text(String::new());
                event.record(&mut text);
                self.0.lock().push(text.0);
            }
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }

    async fn claim_and_complete(store: &MemoryStore, key: &str) {
        let ClaimOutcome::Claimed { token } = store.claim_one(req(key, "w")).await.unwrap() else {
            panic!("{key} not claimed")
        };
        assert!(store.complete_one(key, token, None).await.unwrap());
    }

    /// The break test's finding: `memory://?capacity=1` forgets a completed key inside its
    /// window as soon as a second key arrives, so the redelivery runs the handler again. That
    /// stays so (the store is bounded), but it is no longer silent: counted, and warned once.
    #[tokio::test]
    async fn eviction_inside_the_window_is_counted_and_warned_once() {
        let warnings = Warnings::default();
        let _guard = tracing::subscriber::set_default(warnings.clone());
        let store = MemoryStore::new(Duration::from_secs(3600), 1);
        claim_and_complete(&store, "a").await;
        assert_eq!(store.evicted_in_window(), 0);
        claim_and_complete(&store, "b").await;
        // "a" was evicted inside its window: its redelivery is claimed again, not a duplicate.
        assert!(matches!(
            store.claim_one(req("a", "w")).await.unwrap(),
            ClaimOutcome::Claimed { .. }
        ));
        let after_first = store.evicted_in_window();
        assert!(after_first >= 1, "no eviction counted");
        for i in 0..10 {
            claim_and_complete(&store, &format!("k{i}")).await;
        }
        assert!(store.evicted_in_window() > after_first);
        let logged = warnings.0.lock().clone();
        assert_eq!(
            logged.len(),
            1,
            "expected one warning per store: {logged:?}"
        );
        let text = &logged[0];
        assert!(text.contains("capacity=1 "), "{text}");
        assert!(text.contains("window=3600s"), "{text}");
        assert!(
            text.contains("duplicates older than the eviction can now pass"),
            "{text}"
        );

        // A second store warns on its own.
        let other = MemoryStore::new(Duration::from_secs(60), 1);
        claim_and_complete(&other, "x").await;
        claim_and_complete(&other, "y").await;
        assert!(other.evicted_in_window() >= 1);
        assert_eq!(warnings.0.lock().len(), 2);
    }

    #[tokio::test]
    async fn no_eviction_warning_when_the_capacity_suffices_or_the_key_has_expired() {
        let warnings = Warnings::default();
        let _guard = tracing::subscriber::set_default(warnings.clone());
        let roomy = MemoryStore::new(Duration::from_secs(3600), 1000);
        for i in 0..100 {
            claim_and_complete(&roomy, &format!("k{i}")).await;
        }
        assert_eq!(roomy.evicted_in_window(), 0);

        // A completed key past its window is evicted without loss: not counted.
        let short = MemoryStore::new(Duration::from_millis(1), 1);
        claim_and_complete(&short, "a").await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        let ClaimOutcome::Claimed { .. } = short.claim_one(req("b", "w")).await.unwrap() else {
            panic!("b not claimed")
        };
        assert_eq!(short.evicted_in_window(), 0);
        assert!(warnings.0.lock().is_empty(), "{:?}", warnings.0.lock());
    }

    #[tokio::test]
    async fn sweep_drops_expired_entries() {
        let store = MemoryStore::new(Duration::from_millis(50), 1000);
        for i in 0..10 {
            let key = format!("k{i}");
            let ClaimOutcome::Claimed { token } = store.claim_one(req(&key, "w")).await.unwrap()
            else {
                panic!()
            };
            store.complete_one(&key, token, None).await.unwrap();
        }
        assert_eq!(store.len(), 10);
        tokio::time::sleep(Duration::from_millis(80)).await;
        store.purge_expired();
        assert_eq!(store.len(), 0);
    }
}
