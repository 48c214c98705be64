//! # onceflow-redis
//!
//! A [`DedupStore`] on Redis, shared by every consumer of a fleet: [`RedisStore`]; and the
//! lease table with checkpoints the Kinesis consumer uses
//! ([`CheckpointStore`](onceflow_core::checkpoint::CheckpointStore)): [`RedisCheckpointStore`].
//!
//! - **Atomic on the server**: every operation on a key is one server-side step that no other
//!   client can interleave with: a native `SET … NX GET` for a claim of a new key, otherwise a
//!   Lua script run by `EVALSHA` (claim of an existing key, renew, complete, release, get).
//!   Leases and expiry use the server's clock (relative expiries, `PX` / `PEXPIRE` / `PTTL`),
//!   never the caller's.
//! - **Batched**: a claim of N keys is N `SET key value NX GET PX ms`; only the keys that
//!   already existed and are not completed (held, released, lease ran out) go on to the claim
//!   script, in a second round trip. The other operations make one script call per chunk of
//!   at most [`SCRIPT_CHUNK`] keys. Either way a batch is sent as pipelines of
//!   [`SCRIPT_CHUNK`] keys back to back, without waiting in between (one round trip for the
//!   batch; the server works on the first while the next are encoded).
//! - **Standalone Redis only**: one script call takes a whole chunk of keys (`KEYS`), which
//!   Redis Cluster refuses unless all of them hash to one slot (`CROSSSLOT`); the store is
//!   meant for a standalone server (with or without replicas; the URL names the primary).
//!   [`RedisStore::open`] refuses a server whose `INFO server` says `redis_mode:cluster` (or
//!   `sentinel`) with an [`ErrorKind::Unsupported`] error.
//! - **Data** (stored format 1): one Redis string per key, named `PREFIX + key` (default
//!   prefix `onceflow:dedup:`), holding `'1' STATE TOKEN '|' FP '|' REST`: the format
//!   version `1`; STATE `0` released, `1` in progress, `2` completed; TOKEN the fencing token
//!   in decimal; FP the 16-byte fingerprint as 32 lowercase hex digits (big-endian), or
//!   empty; REST `WINDOW_MS '|' OWNER` in progress (the claimer's dedup window in ms, then the
//!   holder), empty when released, and when completed empty (no result) or `=` followed by
//!   the result's bytes. The key's expiry carries the times: in progress it expires at lease
//!   end + `WINDOW_MS` (so the lease ends at its expiry minus `WINDOW_MS`), completed one
//!   window after completion, released when its last lease would have ended + window; Redis
//!   drops forgotten keys by itself. A new key claimed by owner `w` with a 60 s lease, a
//!   600 s window and no fingerprint is `SET PREFIX+key "111||600000|w" NX GET PX 660000`;
//!   completed with result `r` it becomes `"121||=r"`, expiring in 600 s.
//! - **Older data**: onceflow-redis before format 1 stored each key as a hash; a key of
//!   another type or value under the prefix makes the call fail with a
//!   [`ErrorKind::DedupStore`] error naming the prefix (use a new prefix, or let the old keys
//!   expire after their window).
//! - **Fencing tokens** start at 1 for a key that is not stored and increase by one per claim
//!   of a key; a released key keeps its token (state 0, until it expires), so the next claim
//!   gets a higher one. Requires Redis ≥ 7.0 (`SET` with both `NX` and `GET`).
//! - **Durability** is Redis's: with `appendonly yes` (as `tests/brokers/redis/up.sh` runs it)
//!   a completed key is in the append-only file before the reply is sent, so it survives a
//!   restart of redis-server; `appendfsync everysec` may lose the last second on power loss.
//! - **Connection**: one multiplexed connection
//!   ([`redis::aio::ConnectionManager`]) that reconnects by itself; calls
//!   that fail while the server is away return a retriable [`ErrorKind::Connect`] error.
//!
//! URLs: `redis://[user[:password]@]host[:port][/db][?prefix=P]`, or over TLS
//! `rediss://[user[:password]@]host[:port][/db][?prefix=P&ca=PATH&cert=PATH&key=PATH][#insecure]`.
//! Errors name the URL with its password replaced by `***`.
//!
//! ## TLS and credentials
//! - **`rediss://`** connects over TLS ([rustls](https://docs.rs/rustls), no system OpenSSL)
//!   and verifies the server's certificate chain and that it names the URL's host (a DNS name
//!   or an IP address in its subjectAltName). Without `ca=` the trusted roots are the
//!   system's (`rustls-native-certs`); `ca=PATH` trusts the CA certificates in that PEM file
//!   instead (and only them). Redis's own TLS setup: <https://redis.io/docs/latest/operate/oss_and_stack/management/security/encryption/>.
//! - **Client certificate** (mTLS, for a server with `tls-auth-clients yes` or `optional`):
//!   `cert=PATH` (PEM certificate chain) and `key=PATH` (its PEM private key: PKCS#8, PKCS#1
//!   or SEC1), both or neither.
//! - **`#insecure`** (the redis crate's URL fragment) turns certificate and host name checks
//!   off: for a throwaway test server only; the traffic is still encrypted but anyone in the
//!   middle can read it.
//! - **ACL user and password**: `rediss://user:password@host` sends `AUTH user password`
//!   (Redis 6 ACLs, <https://redis.io/docs/latest/operate/oss_and_stack/management/security/acl/>);
//!   `rediss://:password@host` authenticates the `default` user (`requirepass`). Percent-encode
//!   `@`, `:` and `/` in a password.
//! - **Refusals** are [`ErrorKind::Auth`] errors, not retriable, within the connect timeout
//!   (5 s by default): a wrong user or password (`WRONGPASS`), a server that needs
//!   credentials the URL lacks (`NOAUTH`), an ACL that denies the store's commands or keys
//!   (`NOPERM`), a server certificate that is not trusted or does not name the host, and a
//!   client certificate the server does not accept. The message names the URL (password
//!   `***`) and what was refused. A server that is not reachable stays a retriable
//!   [`ErrorKind::DedupStore`] error.
//! - The crypto provider: rustls needs a process-wide default when several are compiled in;
//!   unless the application installed one first, opening a `rediss://` store installs
//!   *ring*'s (`rustls::crypto::ring::default_provider().install_default()`).
//!
//! ```no_run
//! # async fn demo() -> onceflow_core::Result<()> {
//! use std::time::Duration;
//! let store = onceflow_redis::RedisStore::open("redis://127.0.0.1:6379", Duration::from_secs(3600)).await?;
//! # Ok(()) }
//! ```

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use onceflow_core::dedup::{
    ClaimOutcome, ClaimRequest, Completion, DedupStore, FencingToken, Fingerprint, KeyState,
};
use onceflow_core::{Error, ErrorKind, Result};
use redis::aio::ConnectionManager;
use redis::Value;

mod checkpoint;
mod scripts;
mod tls;

pub use checkpoint::{RedisCheckpointStore, DEFAULT_CHECKPOINT_PREFIX};

/// Keys per script call, and per pipeline of native claims; a batch is cut into chunks of
/// this many, all sent back to back (one round trip).
pub const SCRIPT_CHUNK: usize = 200;

/// Default prefix of the Redis keys of a [`RedisStore`].
pub const DEFAULT_PREFIX: &str = "onceflow:dedup:";

/// Options of a [`RedisStore`].
#[derive(Debug, Clone)]
pub struct RedisOptions {
    /// How long a completed key is remembered (must be > 0).
    pub window: Duration,
    /// Prefix of every Redis key the store writes (default [`DEFAULT_PREFIX`]; the URL option
    /// `prefix=` overrides it). Stores with different prefixes never see each other's keys.
    pub prefix: String,
    /// Longest wait for a TCP connection and the handshake (default 5 s).
    pub connect_timeout: Duration,
    /// Longest wait for one reply (default 10 s); a call over it fails with
    /// [`ErrorKind::Timeout`].
    pub response_timeout: Duration,
}

impl RedisOptions {
    /// Options with the given window and the defaults otherwise.
    pub fn new(window: Duration) -> Self {
        RedisOptions {
            window,
            prefix: DEFAULT_PREFIX.to_string(),
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(10),
        }
    }
}

pub use onceflow_core::redact_url;

/// A connection to Redis and what it needs to call the store's scripts.
#[derive(Clone)]
pub(crate) struct Conn {
    pub(crate) conn: ConnectionManager,
    /// The URL as errors show it (password redacted).
    pub(crate) shown: String,
}

impl Conn {
    /// Connects, checks the connection (authentication included) and loads the scripts.
    /// Returns the connection and the options found in the URL's query (`prefix`).
    pub(crate) async fn open(
        url: &str,
        connect_timeout: Duration,
        response_timeout: Duration,
        allowed: &[&str],
    ) -> Result<(Conn, Vec<(String, String)>)> {
        let shown = onceflow_core::redact_credentials(url);
        let mut parsed = url::Url::parse(url.trim()).map_err(|e| {
            Error::config(format!(
                "Redis store URL '{shown}' is not a URL ({e}): expected \
                 redis://[user[:password]@]host[:port][/db][?prefix=P]"
            ))
        })?;
        if !matches!(parsed.scheme(), "redis" | "rediss") {
            return Err(Error::config(format!(
                "Redis store URL '{shown}' has scheme '{}': expected redis:// or rediss://",
                parsed.scheme()
            )));
        }
        let tls = parsed.scheme() == "rediss";
        let mut options = Vec::new();
        let mut files = tls::TlsFiles::default();
        for (k, v) in parsed.query_pairs() {
            if tls::TLS_OPTIONS.contains(&&*k) {
                files.set(&k, v.into_owned());
                continue;
            }
            if !allowed.contains(&&*k) {
                let mut known: Vec<&str> = allowed.to_vec();
                known.extend(tls::TLS_OPTIONS);
                return Err(Error::config(format!(
                    "unknown option '{k}' in Redis store URL '{shown}': expected {}",
                    known.join(", ")
                )));
            }
            options.push((k.into_owned(), v.into_owned()));
        }
        if files.any() && !tls {
            return Err(Error::config(format!(
                "Redis store URL '{shown}': ca=, cert= and key= are TLS options: use rediss://"
            )));
        }
        parsed.set_query(None);
        let client = if tls {
            tls::ensure_crypto_provider();
            let certificates = files.load(&shown)?;
            redis::Client::build_with_tls(parsed.as_str(), certificates)
        } else {
            redis::Client::open(parsed.as_str())
        }
        .map_err(|e| {
            Error::config(format!(
                "Redis store URL '{shown}' is not valid for the Redis client: {e}"
            ))
        })?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(connect_timeout)
            .set_response_timeout(response_timeout)
            .set_number_of_retries(1)
            .set_max_delay(1000);
        let conn = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(|e| redis_error(&shown, "cannot connect", e))?;
        let conn = Conn { conn, shown };
        let pong: String = redis::cmd("PING")
            .query_async(&mut conn.conn.clone())
            .await
            .map_err(|e| redis_error(&conn.shown, "PING failed", e))?;
        if pong != "PONG" {
            return Err(Error::dedup_store(format!(
                "Redis store '{}' answered PING with '{pong}'",
                conn.shown
            )));
        }
        conn.refuse_replica().await?;
        conn.load_scripts().await?;
        Ok((conn, options))
    }

    /// A [`ErrorKind::Config`] error when the server is a replica (`INFO replication` says
    /// `role:slave`): every write there fails with `READONLY`, which at run time is a
    /// failover to wait out, so a store opened on a replica would retry for ever; and a
    /// replica made writable (`replica-read-only no`) keeps writes only until its next resync
    /// (<https://redis.io/docs/latest/operate/oss_and_stack/management/replication/#read-only-replica>).
    async fn refuse_replica(&self) -> Result<()> {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| redis_error(&self.shown, "INFO replication failed", e))?;
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
        };
        if field("role") == Some("slave") {
            return Err(Error::config(format!(
                "Redis store URL '{}': the server is a replica of {}:{} (INFO replication \
                 role:slave); the store writes every claim and completion: give it the \
                 primary's URL",
                self.shown,
                field("master_host").unwrap_or("?"),
                field("master_port").unwrap_or("?"),
            )));
        }
        Ok(())
    }

    async fn load_scripts(&self) -> Result<()> {
        let mut pipe = redis::pipe();
        for s in scripts::ALL.iter().chain(checkpoint::ALL.iter()) {
            pipe.cmd("SCRIPT").arg("LOAD").arg(s.code);
        }
        let _: Vec<String> = pipe
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| redis_error(&self.shown, "SCRIPT LOAD failed", e))?;
        Ok(())
    }

    /// Sends `pipes` (`n` commands in all) back to back without waiting between them and
    /// returns the `n` replies in order. Several pipelines rather than one: the server works
    /// on the first while the next ones are encoded, and their replies are read while it works
    /// on the rest.
    pub(crate) async fn query(
        &self,
        pipes: &[redis::Pipeline],
        n: usize,
        what: &str,
    ) -> Result<Vec<Value>> {
        let parts = futures::future::try_join_all(pipes.iter().map(|p| {
            let mut conn = self.conn.clone();
            async move { p.query_async::<Vec<Value>>(&mut conn).await }
        }))
        .await
        .map_err(|e| redis_error(&self.shown, what, e))?;
        let v: Vec<Value> = parts.into_iter().flatten().collect();
        if v.len() != n {
            return Err(Error::dedup_store(format!(
                "Redis store '{}': {} replies to {n} {what} commands",
                self.shown,
                v.len()
            )));
        }
        Ok(v)
    }

    /// Runs `script` once per chunk (keys, args), pipelined; reloads the scripts once if the
    /// server lost them (a restart without persistence of its script cache).
    pub(crate) async fn eval_chunks(
        &self,
        script: &scripts::Script,
        chunks: &[(Vec<String>, Vec<Vec<u8>>)],
    ) -> Result<Vec<Value>> {
        if chunks.is_empty() {
            return Ok(Vec::new());
        }
        // One call per chunk, all sent back to back (see `query`).
        let pipes: Vec<redis::Pipeline> = chunks
            .iter()
            .map(|(keys, args)| {
                let mut pipe = redis::pipe();
                let c = pipe.cmd("EVALSHA").arg(script.sha()).arg(keys.len());
                for k in keys {
                    c.arg(k);
                }
                for a in args {
                    c.arg(a.as_slice());
                }
                pipe
            })
            .collect();
        let mut reloaded = false;
        loop {
            let sent = futures::future::try_join_all(pipes.iter().map(|p| {
                let mut conn = self.conn.clone();
                async move { p.query_async::<Vec<Value>>(&mut conn).await }
            }))
            .await;
            match sent {
                Ok(parts) => {
                    let v: Vec<Value> = parts.into_iter().flatten().collect();
                    if v.len() == chunks.len() {
                        return Ok(v);
                    }
                    return Err(Error::dedup_store(format!(
                        "Redis store '{}': {} replies to {} script calls",
                        self.shown,
                        v.len(),
                        chunks.len()
                    )));
                }
                Err(e) if e.kind() == redis::ErrorKind::NoScriptError && !reloaded => {
                    reloaded = true;
                    self.load_scripts().await?;
                }
                Err(e) => return Err(redis_error(&self.shown, script.name, e)),
            }
        }
    }
}

/// Maps a Redis client error to onceflow's kinds, naming the (redacted) URL.
pub(crate) fn redis_error(shown: &str, what: &str, e: redis::RedisError) -> Error {
    if let Some(auth) = tls::auth_error(shown, what, &e) {
        return auth.with_source(e);
    }
    if let Some(why) = transient_server_state(&e) {
        // A server answering but not serving yet (a restart loading its dataset, a failover
        // under way): the store is the thing that failed, for a while; retriable.
        return Error::dedup_store(format!("Redis store '{shown}': {what}: {why}; retrying"))
            .retriable(true)
            .with_source(e);
    }
    // A TLS client on a plaintext port: the server takes the ClientHello for a command and
    // answers nothing a TLS client can read, so the handshake times out or fails to parse.
    let hint = if shown.starts_with("rediss://")
        && what == "cannot connect"
        && (e.is_timeout() || e.is_io_error())
    {
        " (no TLS handshake answer: if this port serves plaintext Redis, use redis://)"
    } else {
        ""
    };
    let msg = format!("Redis store '{shown}': {what}: {e}{hint}");
    let err = if e.is_timeout() {
        Error::new(ErrorKind::Timeout, msg).with_outcome_unknown()
    } else if e.is_connection_refusal() || e.is_io_error() || e.is_connection_dropped() {
        // The dedup store is the thing that failed: its kind, retriable.
        Error::dedup_store(msg).retriable(true)
    } else {
        Error::dedup_store(msg)
    };
    err.with_source(e)
}

/// The server's answer when it is up but cannot serve for a while, in the user's words with the
/// server's error code; `None` for any other error. Redis answers `LOADING` while it loads its
/// dataset after a restart, and `MASTERDOWN`, `READONLY`, `TRYAGAIN` or `CLUSTERDOWN` while a
/// failover is under way (<https://redis.io/docs/latest/develop/reference/protocol-spec/#simple-errors>,
/// `replica-serve-stale-data`, Redis Cluster specification): each ends when the server is ready.
fn transient_server_state(e: &redis::RedisError) -> Option<&'static str> {
    Some(match e.kind() {
        redis::ErrorKind::BusyLoadingError => {
            "the server is loading its dataset after a restart (LOADING)"
        }
        redis::ErrorKind::MasterDown => {
            "the server is a replica that lost its primary (MASTERDOWN)"
        }
        redis::ErrorKind::ReadOnly => {
            "the server is a read-only replica, a failover may be under way (READONLY)"
        }
        redis::ErrorKind::TryAgain => "the server asks to try again (TRYAGAIN)",
        redis::ErrorKind::ClusterDown => "the cluster is down (CLUSTERDOWN)",
        _ => return None,
    })
}

/// A dedup store on Redis. Cheap to clone (clones share the connection).
#[derive(Clone)]
pub struct RedisStore {
    conn: Conn,
    prefix: String,
    window: Duration,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &self.conn.shown)
            .field("prefix", &self.prefix)
            .field("window", &self.window)
            .finish()
    }
}

impl RedisStore {
    /// Connects to the Redis server at `url` (`redis://[user[:password]@]host[:port][/db]`,
    /// or `rediss://…` over TLS with the `ca=`, `cert=`, `key=` options and `#insecure` of
    /// the [crate docs](crate#tls-and-credentials); optional `?prefix=P`), remembering
    /// completed keys for `window`.
    ///
    /// Errors: [`ErrorKind::Config`] for a malformed URL, an unknown option, a zero window, a
    /// certificate file that cannot be read or a server that is a replica (`role:slave`); [`ErrorKind::Unsupported`] for a server older
    /// than Redis 7.0 or one that is not standalone (Redis Cluster, Sentinel);
    /// [`ErrorKind::Auth`] when the server refuses the credentials or a TLS certificate (ours
    /// or its own); [`ErrorKind::DedupStore`] (retriable) when the server cannot be reached or
    /// is loading its dataset (`LOADING`).
    /// Every message names the URL without its password.
    pub async fn open(url: &str, window: Duration) -> Result<Self> {
        Self::open_with(url, RedisOptions::new(window)).await
    }

    /// Connects with `options`; a `prefix=` in the URL overrides `options.prefix`.
    pub async fn open_with(url: &str, options: RedisOptions) -> Result<Self> {
        if options.window.is_zero() {
            return Err(Error::config(format!(
                "dedup window for '{}' is 0: expected a positive duration",
                onceflow_core::redact_credentials(url)
            )));
        }
        let (conn, query) = Conn::open(
            url,
            options.connect_timeout,
            options.response_timeout,
            &["prefix"],
        )
        .await?;
        // `SET` with both `NX` and `GET` (the claim of a new key) needs Redis 7.0.
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut conn.conn.clone())
            .await
            .map_err(|e| redis_error(&conn.shown, "INFO server failed", e))?;
        let version = info
            .lines()
            .find_map(|l| l.strip_prefix("redis_version:"))
            .map(str::trim)
            .unwrap_or("");
        let major = version
            .split('.')
            .next()
            .and_then(|m| m.parse::<u32>().ok());
        if major.is_some_and(|m| m < 7) {
            return Err(Error::unsupported(format!(
                "Redis store '{}': the server is Redis {version}; the store needs Redis 7.0 or \
                 later (SET with NX and GET)",
                conn.shown
            )));
        }
        // One script call takes a chunk of keys: Redis Cluster refuses that (`CROSSSLOT`).
        if let Some(mode) = info.lines().find_map(|l| l.strip_prefix("redis_mode:")) {
            if mode.trim() != "standalone" {
                return Err(Error::unsupported(format!(
                    "Redis store '{}': the server runs in {} mode; the store needs a standalone \
                     Redis server (its scripts take many keys per call, which Redis Cluster \
                     refuses across hash slots)",
                    conn.shown,
                    mode.trim()
                )));
            }
        }
        let mut prefix = options.prefix;
        for (k, v) in query {
            if k == "prefix" {
                prefix = v;
            }
        }
        Ok(RedisStore {
            conn,
            prefix,
            window: options.window,
        })
    }

    /// The URL with its password replaced by `***`.
    pub fn url(&self) -> &str {
        &self.conn.shown
    }

    /// The prefix of this store's Redis keys.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The Lua source of the completion script, for benchmarks that run the same commands
    /// through the bare Redis client (ARGV: window_ms, then per key the token and the result,
    /// `''` for none or `'='` followed by its bytes; reply: 1 or 0 per key). A claim of a new
    /// key is the native `SET` shown in the crate docs.
    #[doc(hidden)]
    pub fn bench_complete_script() -> &'static str {
        scripts::COMPLETE.code
    }

    /// A `DedupStore` error for keys under the prefix that are not in format 1 (`WRONGTYPE`:
    /// a hash of an older onceflow-redis, or another program's key), other errors as they are.
    fn format_error(&self, e: Error) -> Error {
        let m = e.message();
        if m.contains("WRONGTYPE") || m.contains(scripts::FORMAT_ERROR) {
            Error::dedup_store(format!(
                "Redis store '{}': a key under prefix '{}' is not in this store's format 1 \
                 (one string per key; onceflow-redis before it stored a hash per key): use \
                 another prefix, or let the old keys expire after their window ({m})",
                self.conn.shown, self.prefix
            ))
        } else {
            e
        }
    }

    /// Parses a format-1 value: state, token, fingerprint and what follows the fingerprint.
    fn parse<'a>(&self, key: &str, v: &'a [u8]) -> Result<Stored<'a>> {
        parse_value(v).ok_or_else(|| self.parse_error(key, v))
    }

    fn parse_error(&self, key: &str, v: &[u8]) -> Error {
        self.format_error(Error::dedup_store(format!(
            "{} key {}{key} holds {:?}",
            scripts::FORMAT_ERROR,
            self.prefix,
            String::from_utf8_lossy(&v[..v.len().min(64)])
        )))
    }

    fn window_ms(&self) -> Vec<u8> {
        ms(self.window).to_string().into_bytes()
    }

    /// Cuts `items` into chunks: Redis keys and script arguments (after `head`).
    fn chunks<T>(
        &self,
        items: &[T],
        head: impl Fn() -> Vec<Vec<u8>>,
        key: impl Fn(&T) -> &str,
        args: impl Fn(&T, &mut Vec<Vec<u8>>),
    ) -> Vec<(Vec<String>, Vec<Vec<u8>>)> {
        items
            .chunks(SCRIPT_CHUNK)
            .map(|chunk| {
                let mut a = head();
                let keys = chunk
                    .iter()
                    .map(|it| {
                        args(it, &mut a);
                        format!("{}{}", self.prefix, key(it))
                    })
                    .collect();
                (keys, a)
            })
            .collect()
    }

    fn protocol(&self, what: &str, v: &Value) -> Error {
        Error::dedup_store(format!(
            "Redis store '{}': unexpected reply to {what}: {v:?}",
            self.conn.shown
        ))
    }

    /// Flattens per-chunk replies into per-item replies (`n` of them; a claim has three per
    /// key).
    fn items(&self, what: &str, replies: Vec<Value>, n: usize) -> Result<Vec<Value>> {
        let mut out = Vec::with_capacity(n);
        for r in replies {
            match r {
                Value::Array(items) => out.extend(items),
                other => return Err(self.protocol(what, &other)),
            }
        }
        if out.len() != n {
            return Err(Error::dedup_store(format!(
                "Redis store '{}': {} reply items to {what}, expected {n}",
                self.conn.shown,
                out.len()
            )));
        }
        Ok(out)
    }

    async fn flags(
        &self,
        script: &scripts::Script,
        chunks: Vec<(Vec<String>, Vec<Vec<u8>>)>,
        n: usize,
    ) -> Result<Vec<bool>> {
        let replies = self
            .conn
            .eval_chunks(script, &chunks)
            .await
            .map_err(|e| self.format_error(e))?;
        self.items(script.name, replies, n)?
            .into_iter()
            .map(|v| match v {
                Value::Int(i) => Ok(i == 1),
                other => Err(self.protocol(script.name, &other)),
            })
            .collect()
    }
}

/// The longest lease or window the store writes: about 1,000 years in milliseconds. Longer
/// durations (up to [`Duration::MAX`]) are clamped to it. The store's Lua scripts add leases and
/// windows as Lua numbers (doubles, exact up to 2^53) and hand the sums to `PEXPIRE`, which
/// takes a 64-bit integer of milliseconds from now; a sum of two clamped values stays an exact
/// integer far inside both limits, so a key claimed "for ever" is held until completed or
/// released.
pub(crate) const MAX_MS: u64 = 1_000 * 365 * 24 * 3600 * 1000;

/// `d` in whole milliseconds, clamped to [`MAX_MS`].
pub(crate) fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).map_or(MAX_MS, |m| m.min(MAX_MS))
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

fn bytes_of(v: &Value) -> Option<Bytes> {
    match v {
        Value::BulkString(b) => Some(Bytes::copy_from_slice(b)),
        _ => None,
    }
}

/// A fingerprint stored as 32 hex digits; `''` is none.
fn hex_fingerprint(v: &Value) -> Option<Fingerprint> {
    match v {
        Value::BulkString(b) if b.len() == 32 => {
            Fingerprint::from_str_radix(std::str::from_utf8(b).ok()?, 16).ok()
        }
        _ => None,
    }
}

/// A format-1 value, parsed (see the crate docs).
struct Stored<'a> {
    state: u8,
    fingerprint: Option<Fingerprint>,
    /// What follows the fingerprint's closing `|`.
    rest: &'a [u8],
}

fn parse_value(v: &[u8]) -> Option<Stored<'_>> {
    let (&version, v) = v.split_first()?;
    let (&state, v) = v.split_first()?;
    if version != b'1' || !matches!(state, b'0' | b'1' | b'2') {
        return None;
    }
    let a = v.iter().position(|&c| c == b'|')?;
    let (token, v) = (&v[..a], &v[a + 1..]);
    // 1-15 digits: what the scripts compute with exactly (a Lua number is a double).
    if token.is_empty() || token.len() > 15 || !token.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let b = v.iter().position(|&c| c == b'|')?;
    let fingerprint = match &v[..b] {
        [] => None,
        hex if hex.len() == 32 => {
            Some(Fingerprint::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?)
        }
        _ => return None,
    };
    Some(Stored {
        state,
        fingerprint,
        rest: &v[b + 1..],
    })
}

/// The value a claim of a new key stores (state 1, token 1).
fn claim_value(owner: &str, fingerprint: Option<Fingerprint>, window_ms: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(40 + window_ms.len() + owner.len());
    v.extend_from_slice(b"111|");
    if let Some(f) = fingerprint {
        v.extend_from_slice(format!("{f:032x}").as_bytes());
    }
    v.push(b'|');
    v.extend_from_slice(window_ms.as_bytes());
    v.push(b'|');
    v.extend_from_slice(owner.as_bytes());
    v
}

fn fingerprint_arg(f: Option<Fingerprint>) -> Vec<u8> {
    f.map(|f| format!("{f:032x}").into_bytes())
        .unwrap_or_default()
}

fn token(v: &Value) -> Option<FencingToken> {
    int(v).and_then(|i| u64::try_from(i).ok())
}

#[async_trait]
impl DedupStore for RedisStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn window(&self) -> Duration {
        self.window
    }

    async fn claim(&self, requests: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>> {
        onceflow_core::dedup::check_claims(requests)?;
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        // One native command per key: sets a new key (state 1, token 1) or returns the stored
        // value untouched.
        let window = ms(self.window);
        let window_s = window.to_string();
        let pipes: Vec<redis::Pipeline> = requests
            .chunks(SCRIPT_CHUNK)
            .map(|chunk| {
                let mut pipe = redis::pipe();
                for r in chunk {
                    pipe.cmd("SET")
                        .arg(format!("{}{}", self.prefix, r.key))
                        .arg(claim_value(&r.owner, r.fingerprint, &window_s))
                        .arg("NX")
                        .arg("GET")
                        .arg("PX")
                        .arg(ms(r.lease).saturating_add(window));
                }
                pipe
            })
            .collect();
        let replies = self
            .conn
            .query(&pipes, requests.len(), "claim")
            .await
            .map_err(|e| self.format_error(e))?;
        let mut out: Vec<Option<ClaimOutcome>> = Vec::with_capacity(requests.len());
        // Existing keys that are not completed: decided by the claim script.
        let mut again: Vec<usize> = Vec::new();
        for (i, (v, r)) in replies.iter().zip(requests).enumerate() {
            match v {
                Value::Nil => out.push(Some(ClaimOutcome::Claimed { token: 1 })),
                Value::BulkString(b) => {
                    let st = self.parse(&r.key, b)?;
                    if st.state != b'2' {
                        again.push(i);
                        out.push(None);
                        continue;
                    }
                    out.push(Some(match (st.fingerprint, r.fingerprint) {
                        (Some(stored), Some(given)) if stored != given => {
                            ClaimOutcome::Mismatch { stored, given }
                        }
                        _ => ClaimOutcome::Duplicate {
                            result: match st.rest {
                                [] => None,
                                [b'=', result @ ..] => Some(Bytes::copy_from_slice(result)),
                                _ => return Err(self.parse_error(&r.key, b)),
                            },
                        },
                    }));
                }
                other => return Err(self.protocol("claim", other)),
            }
        }
        if !again.is_empty() {
            let pending: Vec<&ClaimRequest> = again.iter().map(|&i| &requests[i]).collect();
            let chunks = self.chunks(
                &pending,
                || vec![window_s.clone().into_bytes()],
                |r| &r.key,
                |r, a| {
                    a.push(r.owner.clone().into_bytes());
                    a.push(ms(r.lease).to_string().into_bytes());
                    a.push(fingerprint_arg(r.fingerprint));
                },
            );
            let replies = self
                .conn
                .eval_chunks(&scripts::CLAIM, &chunks)
                .await
                .map_err(|e| self.format_error(e))?;
            // Three slots per key (see the script).
            let items = self.items("claim", replies, again.len() * 3)?;
            for (a, &i) in items.chunks(3).zip(&again) {
                let req = &requests[i];
                let bad = || self.protocol("claim", &Value::Array(a.to_vec()));
                out[i] = Some(match a.first().and_then(int) {
                    Some(0) => ClaimOutcome::Claimed {
                        token: a.get(1).and_then(token).ok_or_else(bad)?,
                    },
                    Some(1) => ClaimOutcome::Duplicate {
                        result: a.get(1).and_then(bytes_of),
                    },
                    Some(2) => ClaimOutcome::InProgress {
                        owner: a
                            .get(1)
                            .and_then(bytes_of)
                            .map(|b| String::from_utf8_lossy(&b).into_owned())
                            .unwrap_or_default(),
                        expires_in: Duration::from_millis(
                            a.get(2).and_then(int).unwrap_or(0).max(0) as u64,
                        ),
                    },
                    Some(3) => ClaimOutcome::Mismatch {
                        stored: a.get(1).and_then(hex_fingerprint).ok_or_else(bad)?,
                        given: req.fingerprint.ok_or_else(bad)?,
                    },
                    _ => return Err(bad()),
                });
            }
        }
        Ok(out.into_iter().flatten().collect())
    }

    async fn renew(&self, claims: &[(String, FencingToken)], lease: Duration) -> Result<Vec<bool>> {
        onceflow_core::dedup::check_lease(lease)?;
        let chunks = self.chunks(
            claims,
            || vec![ms(lease).to_string().into_bytes()],
            |c| &c.0,
            |c, a| a.push(c.1.to_string().into_bytes()),
        );
        self.flags(&scripts::RENEW, chunks, claims.len()).await
    }

    async fn complete(&self, completions: &[Completion]) -> Result<Vec<bool>> {
        let chunks = self.chunks(
            completions,
            || vec![self.window_ms()],
            |c| &c.key,
            |c, a| {
                a.push(c.token.to_string().into_bytes());
                a.push(match &c.result {
                    Some(r) => {
                        let mut v = Vec::with_capacity(r.len() + 1);
                        v.push(b'=');
                        v.extend_from_slice(r);
                        v
                    }
                    None => Vec::new(),
                });
            },
        );
        self.flags(&scripts::COMPLETE, chunks, completions.len())
            .await
    }

    async fn release(&self, claims: &[(String, FencingToken)]) -> Result<Vec<bool>> {
        let chunks = self.chunks(
            claims,
            Vec::new,
            |c| &c.0,
            |c, a| a.push(c.1.to_string().into_bytes()),
        );
        self.flags(&scripts::RELEASE, chunks, claims.len()).await
    }

    async fn get(&self, keys: &[String]) -> Result<Vec<Option<KeyState>>> {
        let chunks = self.chunks(keys, Vec::new, |k| k, |_, _| {});
        let replies = self
            .conn
            .eval_chunks(&scripts::GET, &chunks)
            .await
            .map_err(|e| self.format_error(e))?;
        let items = self.items("get", replies, keys.len())?;
        items
            .iter()
            .map(|v| {
                let Value::Array(a) = v else {
                    return Err(self.protocol("get", v));
                };
                let bad = || self.protocol("get", v);
                Ok(match a.first().and_then(int) {
                    Some(0) => None,
                    Some(1) => Some(KeyState::InProgress {
                        owner: a
                            .get(1)
                            .and_then(bytes_of)
                            .map(|b| String::from_utf8_lossy(&b).into_owned())
                            .unwrap_or_default(),
                        token: a.get(2).and_then(token).ok_or_else(bad)?,
                        expires_in: Duration::from_millis(
                            a.get(3).and_then(int).unwrap_or(0).max(0) as u64,
                        ),
                        fingerprint: a.get(4).and_then(hex_fingerprint),
                    }),
                    Some(2) => Some(KeyState::Completed {
                        token: a.get(1).and_then(token).ok_or_else(bad)?,
                        result: a.get(2).and_then(bytes_of),
                        fingerprint: a.get(3).and_then(hex_fingerprint),
                    }),
                    _ => return Err(bad()),
                })
            })
            .collect()
    }
}

/// This crate's entry in the backend registry (`onceflow_core::registry`): the schemes
/// `redis://`, `rediss://`, opening a [`RedisStore`] (dedup) or a [`RedisCheckpointStore`] (lease table). The
/// `onceflow` facade lists it.
pub const STORE: onceflow_core::registry::StoreEntry = onceflow_core::registry::StoreEntry {
    name: "redis",
    schemes: &["redis://", "rediss://"],
    dedup: |url, window| {
        onceflow_core::registry::boxed(async move {
            let store: onceflow_core::dedup::SharedDedupStore =
                std::sync::Arc::new(RedisStore::open(url.trim(), window).await?);
            Ok(store)
        })
    },
    checkpoint: |url| {
        onceflow_core::registry::boxed(async move {
            let store: onceflow_core::checkpoint::SharedCheckpointStore =
                std::sync::Arc::new(RedisCheckpointStore::open(url.trim()).await?);
            Ok(store)
        })
    },
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_hides_the_password_only() {
        assert_eq!(
            redact_url("redis://user:s3cret@127.0.0.1:6379/0"),
            "redis://user:***@127.0.0.1:6379/0"
        );
        assert_eq!(redact_url("redis://127.0.0.1:1"), "redis://127.0.0.1:1");
        assert!(!redact_url("redis://:pw@host:1").contains("pw"));
        assert!(!redact_url("not a url ://x:pw@y").contains("pw"));
    }

    #[test]
    fn values_parse_back() {
        let v = claim_value("w|x", Some(0xab), "600000");
        assert_eq!(
            v,
            b"111|000000000000000000000000000000ab|600000|w|x".to_vec()
        );
        let st = parse_value(&v).unwrap();
        assert_eq!(
            (st.state, st.fingerprint, st.rest),
            (b'1', Some(0xab), &b"600000|w|x"[..])
        );
        let st = parse_value(b"127||=r").unwrap();
        assert_eq!(
            (st.state, st.fingerprint, st.rest),
            (b'2', None, &b"=r"[..])
        );
        for bad in [
            &b""[..],
            b"1",
            b"2111||",
            b"13||",
            b"11|x|",
            b"11a||",
            b"111|abc|",
            b"111|",
        ] {
            assert!(
                parse_value(bad).is_none(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[tokio::test]
    async fn bad_urls_are_config_errors_naming_them() {
        for (url, kind) in [
            ("redis://127.0.0.1:1?bogus=1", ErrorKind::Config),
            ("http://127.0.0.1:1", ErrorKind::Config),
            // TLS options need rediss://.
            ("redis://127.0.0.1:1?ca=/ca.pem", ErrorKind::Config),
            (
                "rediss://127.0.0.1:1?ca=/nonexistent/ca.pem",
                ErrorKind::Config,
            ),
            ("rediss://127.0.0.1:1?cert=/c.pem", ErrorKind::Config),
        ] {
            let e = RedisStore::open(url, Duration::from_secs(1))
                .await
                .unwrap_err();
            assert_eq!(e.kind(), kind, "{url}: {e}");
            assert!(e.message().contains(url), "{url}: {e}");
        }
        let e = RedisStore::open("redis://127.0.0.1:1", Duration::ZERO)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
    }
}
