//! # onceflow-redis
//!
//! A [`DedupStore`] on Redis, shared by every consumer of a fleet: [`RedisStore`]; and the
//! lease table with checkpoints the Kinesis consumer uses
//! ([`CheckpointStore`](onceflow_core::checkpoint::CheckpointStore)): [`RedisCheckpointStore`].
//!
//! - **Atomic on the server**: every operation on a key (claim, renew, complete, release, get)
//!   is a Lua script run by `EVALSHA`, so it reads and writes the key in one step that no other
//!   client can interleave with. Leases and expiry use the server's clock (`TIME`), never the
//!   caller's.
//! - **Batched**: a batch of N keys is cut into chunks of at most [`SCRIPT_CHUNK`] keys, one
//!   script call per chunk, all chunks sent in one pipeline (one round trip for the batch).
//! - **Data**: one hash per key, named `PREFIX + key` (default prefix `onceflow:dedup:`), with
//!   fields `s` (state: 0 released, 1 in progress, 2 completed), `t` (fencing token), `o`
//!   (holder), `l` (lease end, ms since the epoch on the server's clock), `e` (end of the dedup
//!   window, same clock), `f` (16-byte fingerprint, big-endian) and `r` (stored result). The
//!   hash expires (`PEXPIREAT`) at `e`: a completed key one window after completion, a claim
//!   one window after its lease ended, so Redis drops forgotten keys by itself.
//! - **Fencing tokens** increase by one per claim of a key; a released key keeps its token (the
//!   hash stays, in state 0, until it expires), so the next claim gets a higher one.
//! - **Durability** is Redis's: with `appendonly yes` (as `tests/brokers/redis/up.sh` runs it)
//!   a completed key is in the append-only file before the reply is sent, so it survives a
//!   restart of redis-server; `appendfsync everysec` may lose the last second on power loss.
//! - **Connection**: one multiplexed connection
//!   ([`redis::aio::ConnectionManager`]) that reconnects by itself; calls
//!   that fail while the server is away return a retriable [`ErrorKind::Connect`] error.
//!
//! URLs: `redis://[user[:password]@]host[:port][/db][?prefix=P]`. Errors name the URL with its
//! password replaced by `***`.
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

pub use checkpoint::{RedisCheckpointStore, DEFAULT_CHECKPOINT_PREFIX};

/// Keys per script call; a batch is cut into chunks of this many, pipelined.
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
        let shown = redact_url(url);
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
        if parsed.scheme() == "rediss" {
            return Err(Error::unsupported(format!(
                "Redis store URL '{shown}': TLS (rediss://) is not compiled into onceflow-redis; \
                 use redis:// on a trusted network or a TLS tunnel"
            )));
        }
        let mut options = Vec::new();
        for (k, v) in parsed.query_pairs() {
            if !allowed.contains(&&*k) {
                return Err(Error::config(format!(
                    "unknown option '{k}' in Redis store URL '{shown}': expected {}",
                    if allowed.is_empty() {
                        "no options".to_string()
                    } else {
                        allowed.join(", ")
                    }
                )));
            }
            options.push((k.into_owned(), v.into_owned()));
        }
        parsed.set_query(None);
        let client = redis::Client::open(parsed.as_str()).map_err(|e| {
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
        conn.load_scripts().await?;
        Ok((conn, options))
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
        let mut pipe = redis::pipe();
        for (keys, args) in chunks {
            let c = pipe.cmd("EVALSHA").arg(script.sha()).arg(keys.len());
            for k in keys {
                c.arg(k);
            }
            for a in args {
                c.arg(a.as_slice());
            }
        }
        let mut reloaded = false;
        loop {
            match pipe.query_async::<Vec<Value>>(&mut self.conn.clone()).await {
                Ok(v) if v.len() == chunks.len() => return Ok(v),
                Ok(v) => {
                    return Err(Error::dedup_store(format!(
                        "Redis store '{}': {} replies to {} script calls",
                        self.shown,
                        v.len(),
                        chunks.len()
                    )))
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
    let msg = format!("Redis store '{shown}': {what}: {e}");
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
    /// optional `?prefix=P`), remembering completed keys for `window`.
    ///
    /// Errors: [`ErrorKind::Config`] for a malformed URL, an unknown option or a zero window;
    /// [`ErrorKind::Unsupported`] for `rediss://`; [`ErrorKind::DedupStore`] when the server
    /// cannot be reached or refuses the credentials, naming the URL without its password.
    pub async fn open(url: &str, window: Duration) -> Result<Self> {
        Self::open_with(url, RedisOptions::new(window)).await
    }

    /// Connects with `options`; a `prefix=` in the URL overrides `options.prefix`.
    pub async fn open_with(url: &str, options: RedisOptions) -> Result<Self> {
        if options.window.is_zero() {
            return Err(Error::config(format!(
                "dedup window for '{}' is 0: expected a positive duration",
                redact_url(url)
            )));
        }
        let (conn, query) = Conn::open(
            url,
            options.connect_timeout,
            options.response_timeout,
            &["prefix"],
        )
        .await?;
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

    /// The Lua source of the claim and complete scripts, for benchmarks that run the same
    /// commands through the bare Redis client (argument layouts are in the scripts' comments).
    #[doc(hidden)]
    pub fn bench_scripts() -> (&'static str, &'static str) {
        (scripts::CLAIM.code, scripts::COMPLETE.code)
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
        let replies = self.conn.eval_chunks(script, &chunks).await?;
        self.items(script.name, replies, n)?
            .into_iter()
            .map(|v| match v {
                Value::Int(i) => Ok(i == 1),
                other => Err(self.protocol(script.name, &other)),
            })
            .collect()
    }
}

pub(crate) fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX / 4)
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

fn fingerprint_of(v: &Value) -> Option<Fingerprint> {
    match v {
        Value::BulkString(b) => Some(Fingerprint::from_be_bytes(b.as_slice().try_into().ok()?)),
        _ => None,
    }
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
        let chunks = self.chunks(
            requests,
            || vec![self.window_ms()],
            |r| &r.key,
            |r, a| {
                a.push(r.owner.clone().into_bytes());
                a.push(ms(r.lease).to_string().into_bytes());
                a.push(
                    r.fingerprint
                        .map(|f| f.to_be_bytes().to_vec())
                        .unwrap_or_default(),
                );
            },
        );
        let replies = self.conn.eval_chunks(&scripts::CLAIM, &chunks).await?;
        // Three slots per key (see the script).
        let items = self.items("claim", replies, requests.len() * 3)?;
        items
            .chunks(3)
            .zip(requests)
            .map(|(a, req)| {
                let bad = || self.protocol("claim", &Value::Array(a.to_vec()));
                Ok(match a.first().and_then(int) {
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
                        stored: a.get(1).and_then(fingerprint_of).ok_or_else(bad)?,
                        given: req.fingerprint.ok_or_else(bad)?,
                    },
                    _ => return Err(bad()),
                })
            })
            .collect()
    }

    async fn renew(&self, claims: &[(String, FencingToken)], lease: Duration) -> Result<Vec<bool>> {
        let chunks = self.chunks(
            claims,
            || vec![self.window_ms(), ms(lease).to_string().into_bytes()],
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
                match &c.result {
                    Some(r) => {
                        a.push(b"1".to_vec());
                        a.push(r.to_vec());
                    }
                    None => {
                        a.push(b"0".to_vec());
                        a.push(Vec::new());
                    }
                }
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
        let replies = self.conn.eval_chunks(&scripts::GET, &chunks).await?;
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
                        fingerprint: a.get(4).and_then(fingerprint_of),
                    }),
                    Some(2) => Some(KeyState::Completed {
                        token: a.get(1).and_then(token).ok_or_else(bad)?,
                        result: a.get(2).and_then(bytes_of),
                        fingerprint: a.get(3).and_then(fingerprint_of),
                    }),
                    _ => return Err(bad()),
                })
            })
            .collect()
    }
}

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

    #[tokio::test]
    async fn bad_urls_are_config_errors_naming_them() {
        for (url, kind) in [
            ("redis://127.0.0.1:1?bogus=1", ErrorKind::Config),
            ("http://127.0.0.1:1", ErrorKind::Config),
            ("rediss://127.0.0.1:1", ErrorKind::Unsupported),
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
