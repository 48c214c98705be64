//! The lease table and checkpoints ([`CheckpointStore`]) on Redis: [`RedisCheckpointStore`].
//!
//! Each row is a hash `PREFIX + "row:" + len(group) + ":" + group + ":" + key` with fields `o`
//! (owner), `c` (counter), `l` (lease end, ms on the server's clock, 0 when unowned), `k`
//! (checkpoint) and `p` (parents, length-prefixed); a sorted set
//! `PREFIX + "idx:" + len(group) + ":" + group` lists the group's keys in byte order (`ZRANGE …
//! BYLEX`). Every operation is one Lua script over a batch, atomic on the server. Rows never
//! expire: they live until deleted.

use std::time::Duration;

use async_trait::async_trait;
use onceflow_core::checkpoint::{
    self, CheckpointRequest, CheckpointStore, HeldLease, Lease, LeaseCounter, NewLease,
    TakeOutcome, TakeRequest,
};
use onceflow_core::{Error, Result};
use redis::Value;

use crate::scripts::Script;
use crate::{ms, Conn};

/// Default prefix of the Redis keys of a [`RedisCheckpointStore`].
pub const DEFAULT_CHECKPOINT_PREFIX: &str = "onceflow:leases:";

/// A lease table with checkpoints on Redis. Cheap to clone.
#[derive(Clone)]
pub struct RedisCheckpointStore {
    conn: Conn,
    prefix: String,
}

impl std::fmt::Debug for RedisCheckpointStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisCheckpointStore")
            .field("url", &self.conn.shown)
            .field("prefix", &self.prefix)
            .finish()
    }
}

macro_rules! cp_script {
    ($name:expr, $body:expr) => {
        Script::new(
            $name,
            concat!(
                "local __t = redis.call('TIME')\n",
                "local now = tonumber(__t[1]) * 1000 + math.floor(tonumber(__t[2]) / 1000)\n",
                r#"
local function row(k)
  local h = redis.call('HMGET', k, 'o', 'c', 'l', 'k', 'p')
  if not h[2] then return false end
  local left = 0
  if h[1] then left = tonumber(h[3]) - now; if left < 0 then left = 0 end end
  return {h[1], tonumber(h[2]), left, h[4], h[5]}
end
"#,
                $body
            ),
        )
    };
}

/// KEYS[1] index; ARGV[1] row-key prefix. Reply: {{key, row}...} by key.
static LIST: Script = cp_script!(
    "checkpoint list",
    r#"
local out = {}
for i, key in ipairs(redis.call('ZRANGE', KEYS[1], '-', '+', 'BYLEX')) do
  out[i] = {key, row(ARGV[1] .. key)}
end
return out
"#
);

/// KEYS rows. Reply: row or false per key.
static GET: Script = cp_script!(
    "checkpoint get",
    r#"
local out = {}
for i, k in ipairs(KEYS) do out[i] = row(k) end
return out
"#
);

/// KEYS[1] index, KEYS[2..] rows; ARGV per row: key, has_checkpoint, checkpoint, parents.
static CREATE: Script = cp_script!(
    "checkpoint create",
    r#"
local out = {}
for i = 2, #KEYS do
  local k, a = KEYS[i], 4 * (i - 2)
  if redis.call('EXISTS', k) == 1 then
    out[i - 1] = 0
  else
    redis.call('HSET', k, 'c', 0, 'l', 0, 'p', ARGV[a + 4])
    if ARGV[a + 2] == '1' then redis.call('HSET', k, 'k', ARGV[a + 3]) end
    redis.call('ZADD', KEYS[1], 0, ARGV[a + 1])
    out[i - 1] = 1
  end
end
return out
"#
);

/// KEYS rows; ARGV per row: owner, expected counter, lease ms. Reply: {1, counter} or
/// {0, row|false}.
static TAKE: Script = cp_script!(
    "checkpoint take",
    r#"
local out = {}
for i, k in ipairs(KEYS) do
  local owner, expected, lease = ARGV[3*i-2], tonumber(ARGV[3*i-1]), tonumber(ARGV[3*i])
  local h = redis.call('HMGET', k, 'o', 'c', 'l')
  if not h[2] then
    out[i] = {0, false}
  else
    local free = (not h[1]) or h[1] == owner or tonumber(h[3]) <= now
    if free and tonumber(h[2]) == expected then
      local c = expected + 1
      redis.call('HSET', k, 'o', owner, 'c', c, 'l', now + lease)
      out[i] = {1, c}
    else
      out[i] = {0, row(k)}
    end
  end
end
return out
"#
);

/// KEYS rows; ARGV[1] op ('renew' | 'release' | 'checkpoint'), ARGV[2] lease ms, then per row:
/// owner, counter, checkpoint. Reply per row: new counter (renew), 1 (release / checkpoint),
/// or -1 when refused.
static HELD: Script = cp_script!(
    "checkpoint held",
    r#"
local op, lease = ARGV[1], tonumber(ARGV[2])
local out = {}
for i, k in ipairs(KEYS) do
  local owner, counter, cp = ARGV[3*i], tonumber(ARGV[3*i+1]), ARGV[3*i+2]
  local h = redis.call('HMGET', k, 'o', 'c')
  if h[2] and h[1] == owner and tonumber(h[2]) == counter then
    if op == 'renew' then
      redis.call('HSET', k, 'c', counter + 1, 'l', now + lease)
      out[i] = counter + 1
    elseif op == 'release' then
      redis.call('HSET', k, 'c', counter + 1, 'l', 0)
      redis.call('HDEL', k, 'o')
      out[i] = 1
    else
      redis.call('HSET', k, 'k', cp)
      out[i] = 1
    end
  else
    out[i] = -1
  end
end
return out
"#
);

/// KEYS[1] index, KEYS[2..] rows; ARGV keys. Reply per row: 1 deleted, 0 none.
static DELETE: Script = cp_script!(
    "checkpoint delete",
    r#"
local out = {}
for i = 2, #KEYS do
  out[i - 1] = redis.call('DEL', KEYS[i])
  redis.call('ZREM', KEYS[1], ARGV[i - 1])
end
return out
"#
);

/// Every checkpoint script, for `SCRIPT LOAD`.
pub(crate) static ALL: [&Script; 6] = [&LIST, &GET, &CREATE, &TAKE, &HELD, &DELETE];

/// Parents as one string: each parent as `len:value`.
fn encode_parents(parents: &[String]) -> Vec<u8> {
    let mut out = Vec::new();
    for p in parents {
        out.extend_from_slice(format!("{}:", p.len()).as_bytes());
        out.extend_from_slice(p.as_bytes());
    }
    out
}

fn decode_parents(mut b: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(colon) = b.iter().position(|c| *c == b':') {
        let Some(len) = std::str::from_utf8(&b[..colon])
            .ok()
            .and_then(|s| s.parse::<usize>().ok())
        else {
            break;
        };
        let rest = &b[colon + 1..];
        if rest.len() < len {
            break;
        }
        out.push(String::from_utf8_lossy(&rest[..len]).into_owned());
        b = &rest[len..];
    }
    out
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        _ => None,
    }
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        _ => None,
    }
}

impl RedisCheckpointStore {
    /// Connects to Redis at `url` (`redis://[user[:password]@]host[:port][/db]`, or
    /// `rediss://…` over TLS as in the [crate docs](crate#tls-and-credentials); optional
    /// `?prefix=P`, default [`DEFAULT_CHECKPOINT_PREFIX`]).
    ///
    /// Errors: [`onceflow_core::ErrorKind::Config`] for a malformed URL, an unknown option or
    /// a certificate file that cannot be read; [`onceflow_core::ErrorKind::Auth`] when the
    /// server refuses the credentials or a TLS certificate; [`onceflow_core::ErrorKind::DedupStore`]
    /// (retriable) when the server cannot be reached. Messages name the URL without its
    /// password.
    pub async fn open(url: &str) -> Result<Self> {
        let (conn, query) = Conn::open(
            url,
            Duration::from_secs(5),
            Duration::from_secs(10),
            &["prefix"],
        )
        .await?;
        let mut prefix = DEFAULT_CHECKPOINT_PREFIX.to_string();
        for (k, v) in query {
            if k == "prefix" {
                prefix = v;
            }
        }
        Ok(RedisCheckpointStore { conn, prefix })
    }

    fn group_part(group: &str) -> String {
        format!("{}:{group}", group.len())
    }

    fn index(&self, group: &str) -> String {
        format!("{}idx:{}", self.prefix, Self::group_part(group))
    }

    fn row_prefix(&self, group: &str) -> String {
        format!("{}row:{}:", self.prefix, Self::group_part(group))
    }

    fn bad(&self, what: &str, v: &Value) -> Error {
        Error::dedup_store(format!(
            "Redis checkpoint store '{}': unexpected reply to {what}: {v:?}",
            self.conn.shown
        ))
    }

    async fn eval(
        &self,
        script: &Script,
        keys: Vec<String>,
        args: Vec<Vec<u8>>,
    ) -> Result<Vec<Value>> {
        let mut replies = self.conn.eval_chunks(script, &[(keys, args)]).await?;
        match replies.pop() {
            Some(Value::Array(items)) => Ok(items),
            Some(other) => Err(self.bad(script.name, &other)),
            None => Err(self.bad(script.name, &Value::Nil)),
        }
    }

    fn lease(&self, key: &str, v: &Value) -> Result<Option<Lease>> {
        match v {
            Value::Nil => Ok(None),
            Value::Array(a) => Ok(Some(Lease {
                key: key.to_string(),
                owner: a.first().and_then(text),
                counter: a
                    .get(1)
                    .and_then(int)
                    .and_then(|c| u64::try_from(c).ok())
                    .ok_or_else(|| self.bad("a row", v))?,
                expires_in: Duration::from_millis(a.get(2).and_then(int).unwrap_or(0).max(0) as u64),
                checkpoint: a.get(3).and_then(text),
                parents: match a.get(4) {
                    Some(Value::BulkString(b)) => decode_parents(b),
                    _ => Vec::new(),
                },
            })),
            other => Err(self.bad("a row", other)),
        }
    }

    async fn held(
        &self,
        group: &str,
        op: &str,
        lease: Duration,
        items: Vec<(String, String, LeaseCounter, String)>,
    ) -> Result<Vec<i64>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let rp = self.row_prefix(group);
        let keys = items.iter().map(|i| format!("{rp}{}", i.0)).collect();
        let mut args = vec![op.as_bytes().to_vec(), ms(lease).to_string().into_bytes()];
        for (_, owner, counter, cp) in &items {
            args.push(owner.clone().into_bytes());
            args.push(counter.to_string().into_bytes());
            args.push(cp.clone().into_bytes());
        }
        let out = self.eval(&HELD, keys, args).await?;
        out.iter()
            .map(|v| int(v).ok_or_else(|| self.bad("checkpoint held", v)))
            .collect()
    }
}

#[async_trait]
impl CheckpointStore for RedisCheckpointStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    async fn list(&self, group: &str) -> Result<Vec<Lease>> {
        checkpoint::validate(group, [], [])?;
        let out = self
            .eval(
                &LIST,
                vec![self.index(group)],
                vec![self.row_prefix(group).into_bytes()],
            )
            .await?;
        let mut leases = Vec::with_capacity(out.len());
        for v in &out {
            let Value::Array(pair) = v else {
                return Err(self.bad("checkpoint list", v));
            };
            let key = pair
                .first()
                .and_then(text)
                .ok_or_else(|| self.bad("checkpoint list", v))?;
            if let Some(l) = self.lease(&key, pair.get(1).unwrap_or(&Value::Nil))? {
                leases.push(l);
            }
        }
        Ok(leases)
    }

    async fn get(&self, group: &str, keys: &[String]) -> Result<Vec<Option<Lease>>> {
        checkpoint::validate(group, keys.iter().map(String::as_str), [])?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let rp = self.row_prefix(group);
        let out = self
            .eval(
                &GET,
                keys.iter().map(|k| format!("{rp}{k}")).collect(),
                Vec::new(),
            )
            .await?;
        keys.iter()
            .zip(out.iter())
            .map(|(k, v)| self.lease(k, v))
            .collect()
    }

    async fn create(&self, group: &str, leases: &[NewLease]) -> Result<Vec<bool>> {
        checkpoint::validate(group, leases.iter().map(|l| l.key.as_str()), [])?;
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let rp = self.row_prefix(group);
        let mut keys = vec![self.index(group)];
        let mut args = Vec::new();
        for l in leases {
            keys.push(format!("{rp}{}", l.key));
            args.push(l.key.clone().into_bytes());
            args.push(if l.checkpoint.is_some() {
                b"1".to_vec()
            } else {
                b"0".to_vec()
            });
            args.push(l.checkpoint.clone().unwrap_or_default().into_bytes());
            args.push(encode_parents(&l.parents));
        }
        let out = self.eval(&CREATE, keys, args).await?;
        out.iter()
            .map(|v| {
                int(v)
                    .map(|i| i == 1)
                    .ok_or_else(|| self.bad("checkpoint create", v))
            })
            .collect()
    }

    async fn take(&self, group: &str, requests: &[TakeRequest]) -> Result<Vec<TakeOutcome>> {
        checkpoint::validate(
            group,
            requests.iter().map(|r| r.key.as_str()),
            requests.iter().map(|r| r.owner.as_str()),
        )?;
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let rp = self.row_prefix(group);
        let keys = requests.iter().map(|r| format!("{rp}{}", r.key)).collect();
        let mut args = Vec::new();
        for r in requests {
            args.push(r.owner.clone().into_bytes());
            args.push(r.expected_counter.to_string().into_bytes());
            args.push(ms(r.lease).to_string().into_bytes());
        }
        let out = self.eval(&TAKE, keys, args).await?;
        requests
            .iter()
            .zip(out.iter())
            .map(|(r, v)| {
                let Value::Array(a) = v else {
                    return Err(self.bad("checkpoint take", v));
                };
                match a.first().and_then(int) {
                    Some(1) => Ok(TakeOutcome::Taken {
                        counter: a
                            .get(1)
                            .and_then(int)
                            .and_then(|c| u64::try_from(c).ok())
                            .ok_or_else(|| self.bad("checkpoint take", v))?,
                    }),
                    Some(0) => Ok(TakeOutcome::Refused {
                        current: self.lease(&r.key, a.get(1).unwrap_or(&Value::Nil))?,
                    }),
                    _ => Err(self.bad("checkpoint take", v)),
                }
            })
            .collect()
    }

    async fn renew(
        &self,
        group: &str,
        leases: &[HeldLease],
        lease: Duration,
    ) -> Result<Vec<Option<LeaseCounter>>> {
        checkpoint::validate(
            group,
            leases.iter().map(|l| l.key.as_str()),
            leases.iter().map(|l| l.owner.as_str()),
        )?;
        let items = leases
            .iter()
            .map(|l| (l.key.clone(), l.owner.clone(), l.counter, String::new()))
            .collect();
        Ok(self
            .held(group, "renew", lease, items)
            .await?
            .into_iter()
            .map(|c| u64::try_from(c).ok())
            .collect())
    }

    async fn release(&self, group: &str, leases: &[HeldLease]) -> Result<Vec<bool>> {
        checkpoint::validate(
            group,
            leases.iter().map(|l| l.key.as_str()),
            leases.iter().map(|l| l.owner.as_str()),
        )?;
        let items = leases
            .iter()
            .map(|l| (l.key.clone(), l.owner.clone(), l.counter, String::new()))
            .collect();
        Ok(self
            .held(group, "release", Duration::ZERO, items)
            .await?
            .into_iter()
            .map(|c| c == 1)
            .collect())
    }

    async fn checkpoint(&self, group: &str, requests: &[CheckpointRequest]) -> Result<Vec<bool>> {
        checkpoint::validate(
            group,
            requests.iter().map(|r| r.key.as_str()),
            requests.iter().map(|r| r.owner.as_str()),
        )?;
        let items = requests
            .iter()
            .map(|r| {
                (
                    r.key.clone(),
                    r.owner.clone(),
                    r.counter,
                    r.checkpoint.clone(),
                )
            })
            .collect();
        Ok(self
            .held(group, "checkpoint", Duration::ZERO, items)
            .await?
            .into_iter()
            .map(|c| c == 1)
            .collect())
    }

    async fn delete(&self, group: &str, keys: &[String]) -> Result<Vec<bool>> {
        checkpoint::validate(group, keys.iter().map(String::as_str), [])?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let rp = self.row_prefix(group);
        let mut rkeys = vec![self.index(group)];
        rkeys.extend(keys.iter().map(|k| format!("{rp}{k}")));
        let args = keys.iter().map(|k| k.clone().into_bytes()).collect();
        let out = self.eval(&DELETE, rkeys, args).await?;
        out.iter()
            .map(|v| {
                int(v)
                    .map(|i| i == 1)
                    .ok_or_else(|| self.bad("checkpoint delete", v))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parents_round_trip() {
        for p in [
            vec![],
            vec!["shardId-1".to_string()],
            vec!["a:b".to_string(), "".to_string(), "12:x".to_string()],
        ] {
            assert_eq!(decode_parents(&encode_parents(&p)), p);
        }
    }
}
