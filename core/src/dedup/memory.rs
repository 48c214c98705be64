//! In-memory dedup store (owned by the dedup-store work; see the module docs of `dedup`).

/// Bounded in-memory dedup store with a TTL window.
pub struct MemoryStore;
