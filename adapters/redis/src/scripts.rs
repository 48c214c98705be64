//! The Lua scripts of the Redis store. Each handles a chunk of keys (`KEYS`), one after the
//! other, atomically; `now` is the server's clock in ms (`TIME`, read once per call). Each
//! key costs as few `redis.call`s as its case allows (the server's time goes there): a claim of
//! a new key is `HMGET`, `HSET`, `PEXPIREAT`; a duplicate `HMGET` alone; a completion `HMGET`,
//! `HSET`, `HDEL`, `PEXPIREAT`.
//!
//! Hash fields: `s` state (0 released, 1 in progress, 2 completed), `t` token, `o` holder,
//! `l` lease end (ms), `e` end of the dedup window (ms; the hash expires then), `f` fingerprint,
//! `r` result.

use std::sync::OnceLock;

/// One script: its name (for errors), its code and its SHA-1 (for `EVALSHA`).
pub(crate) struct Script {
    pub(crate) name: &'static str,
    pub(crate) code: &'static str,
    sha: OnceLock<String>,
}

impl Script {
    pub(crate) const fn new(name: &'static str, code: &'static str) -> Script {
        Script {
            name,
            code,
            sha: OnceLock::new(),
        }
    }

    /// SHA-1 of the code, hex, as `EVALSHA` takes it.
    pub(crate) fn sha(&self) -> &str {
        self.sha
            .get_or_init(|| redis::Script::new(self.code).get_hash().to_string())
    }
}

macro_rules! script {
    ($body:expr) => {
        concat!(
            "local __t = redis.call('TIME')\n",
            "local now = tonumber(__t[1]) * 1000 + math.floor(tonumber(__t[2]) / 1000)\n",
            $body
        )
    };
}

/// ARGV: window_ms, then per key: owner, lease_ms, fingerprint ('' = none).
/// Reply: three flat slots per key, in order: `0, token, nil` claimed, `1, result|nil, nil`
/// duplicate, `2, owner, ms_left` in progress, `3, stored_fingerprint, nil` mismatch.
pub(crate) static CLAIM: Script = Script::new(
    "claim",
    script!(
        r#"
local window = tonumber(ARGV[1])
local out, j = {}, 0
-- Three reply slots per key, no table per key (a nested reply costs the server more than the
-- key's HMGET). `false` is a nil reply.
local function put(j, c, a, b)
  out[j + 1], out[j + 2], out[j + 3] = c, a, b
  return j + 3
end
for i, k in ipairs(KEYS) do
  local owner, lease, fp = ARGV[3*i-1], tonumber(ARGV[3*i]), ARGV[3*i+1]
  local h = redis.call('HMGET', k, 's', 't', 'o', 'l', 'e', 'f', 'r')
  local s, tok = tonumber(h[1]) or 0, tonumber(h[2]) or 0
  local l, e = tonumber(h[4]) or 0, tonumber(h[5]) or 0
  local lu = now + lease
  local exp = lu + window
  if (s == 2 and e > now) or (s == 1 and l > now) then
    local sf = h[6]
    if sf and fp ~= '' and sf ~= fp then
      j = put(j, 3, sf, false)
    elseif s == 2 then
      j = put(j, 1, h[7], false)
    elseif h[3] ~= owner then
      j = put(j, 2, h[3], l - now)
    else
      tok = tok + 1
      redis.call('HSET', k, 't', tok, 'l', lu, 'e', exp)
      if (not sf) and fp ~= '' then redis.call('HSET', k, 'f', fp) end
      redis.call('PEXPIREAT', k, exp)
      j = put(j, 0, tok, false)
    end
  else
    tok = tok + 1
    -- An old hash (released, lease ran out, completed past its window): drop its fields.
    if h[2] then redis.call('DEL', k) end
    if fp ~= '' then
      redis.call('HSET', k, 's', 1, 't', tok, 'o', owner, 'l', lu, 'e', exp, 'f', fp)
    else
      redis.call('HSET', k, 's', 1, 't', tok, 'o', owner, 'l', lu, 'e', exp)
    end
    redis.call('PEXPIREAT', k, exp)
    j = put(j, 0, tok, false)
  end
end
return out
"#
    ),
);

/// ARGV: window_ms, lease_ms, then one token per key. Reply per key: 1 renewed, 0 stale.
pub(crate) static RENEW: Script = Script::new(
    "renew",
    script!(
        r#"
local window, lease = tonumber(ARGV[1]), tonumber(ARGV[2])
local out = {}
for i, k in ipairs(KEYS) do
  local h = redis.call('HMGET', k, 's', 't')
  if tonumber(h[1]) == 1 and tonumber(h[2]) == tonumber(ARGV[2+i]) then
    local lu = now + lease
    redis.call('HSET', k, 'l', lu, 'e', lu + window)
    redis.call('PEXPIREAT', k, lu + window)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"#
    ),
);

/// ARGV: window_ms, then per key: token, has_result ('1'/'0'), result. Reply per key: 1 done
/// (now or by an earlier completion with the same token), 0 stale.
pub(crate) static COMPLETE: Script = Script::new(
    "complete",
    script!(
        r#"
local exp = now + tonumber(ARGV[1])
local out = {}
for i, k in ipairs(KEYS) do
  local tok, has, res = tonumber(ARGV[3*i-1]), ARGV[3*i], ARGV[3*i+1]
  local h = redis.call('HMGET', k, 's', 't', 'e')
  local s, t, e = tonumber(h[1]) or 0, tonumber(h[2]) or 0, tonumber(h[3]) or 0
  if s == 1 and t == tok then
    if has == '1' then
      redis.call('HSET', k, 's', 2, 'e', exp, 'r', res)
      redis.call('HDEL', k, 'o', 'l')
    else
      redis.call('HSET', k, 's', 2, 'e', exp)
      redis.call('HDEL', k, 'o', 'l', 'r')
    end
    redis.call('PEXPIREAT', k, exp)
    out[i] = 1
  elseif s == 2 and t == tok and e > now then
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"#
    ),
);

/// ARGV: one token per key. Reply per key: 1 released, 0 stale. A released key keeps its
/// token (state 0) until it expires, so the next claim's token is higher.
pub(crate) static RELEASE: Script = Script::new(
    "release",
    script!(
        r#"
local out = {}
for i, k in ipairs(KEYS) do
  local h = redis.call('HMGET', k, 's', 't')
  if tonumber(h[1]) == 1 and tonumber(h[2]) == tonumber(ARGV[i]) then
    redis.call('HSET', k, 's', 0)
    redis.call('HDEL', k, 'o', 'l', 'f', 'r')
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"#
    ),
);

/// No ARGV. Reply per key: {0} unknown, {1, owner, token, ms_left, fp} in progress,
/// {2, token, result, fp} completed.
pub(crate) static GET: Script = Script::new(
    "get",
    script!(
        r#"
local out = {}
for i, k in ipairs(KEYS) do
  local h = redis.call('HMGET', k, 's', 't', 'o', 'l', 'e', 'f', 'r')
  local s, e = tonumber(h[1]) or 0, tonumber(h[5]) or 0
  if e <= now or s == 0 then
    out[i] = {0}
  elseif s == 1 then
    local left = (tonumber(h[4]) or 0) - now
    if left < 0 then left = 0 end
    out[i] = {1, h[3], tonumber(h[2]), left, h[6]}
  else
    out[i] = {2, tonumber(h[2]), h[7], h[6]}
  end
end
return out
"#
    ),
);

/// Every script, for `SCRIPT LOAD`.
pub(crate) static ALL: [&Script; 5] = [&CLAIM, &RENEW, &COMPLETE, &RELEASE, &GET];
