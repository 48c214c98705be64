//! On-disk embedded dedup store (owned by the dedup-store work; see the module docs of `dedup`).

/// Embedded on-disk dedup store that survives restarts.
pub struct EmbeddedStore;
