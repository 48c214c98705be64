//! The Lua scripts of the Redis store, for what a native command cannot decide alone. Each
//! handles a chunk of keys (`KEYS`), one after the other, atomically.
//!
//! A claim of a key that does not exist is no script: it is a native `SET key value NX GET PX
//! ms` (see the crate docs), and a claim of a completed key is decided by the client from
//! that command's reply. [`CLAIM`] runs only for the keys that exist and are not completed
//! (held, released, lease ran out). Completion, renewal, release and reads are scripts; each
//! key costs a `GET` and, when the key changes, one write (`SET` or `PEXPIRE`).
//!
//! Stored value, one Redis string per key (format 1):
//! `'1' STATE TOKEN '|' FP '|' REST` — STATE `0` released, `1` in progress, `2` completed;
//! TOKEN decimal; FP 32 lowercase hex digits or empty; REST `WINDOW_MS '|' OWNER` in
//! progress, empty when released, empty (no result) or `'=' RESULT` when completed. The
//! scripts read no clock: a lease's end is the key's expiry minus the `WINDOW_MS` stored with
//! it (`PTTL`, the server's clock).

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

/// Prefix of the error a script returns for a value not in format 1 (the client maps it to a
/// `DedupStore` error naming the prefix).
pub(crate) const FORMAT_ERROR: &str = "ONCEFLOW_FORMAT";

macro_rules! script {
    ($body:expr) => {
        concat!(
            r#"
-- A value's state, token, fingerprint and the position of the '|' that ends the fingerprint;
-- nil if it is not a format-1 value.
local function parse(v)
  if string.byte(v, 1) ~= 49 then return nil end
  local st = string.sub(v, 2, 2)
  if st ~= '0' and st ~= '1' and st ~= '2' then return nil end
  local a = string.find(v, '|', 3, true)
  local b = a and string.find(v, '|', a + 1, true)
  if not b then return nil end
  local tok, sf = string.sub(v, 3, a - 1), string.sub(v, a + 1, b - 1)
  -- A token is 1-15 digits (exact in a Lua number); a fingerprint is empty or 32 hex digits.
  if #tok == 0 or #tok > 15 or string.find(tok, '%D') then return nil end
  if sf ~= '' and (#sf ~= 32 or string.find(sf, '[^0-9a-f]')) then return nil end
  return st, tok, sf, b
end
-- The window (ms) stored after the fingerprint's '|' at b, and the '|' that ends it; nil if
-- it is not a number.
local function window_at(v, b)
  local c = string.find(v, '|', b + 1, true)
  local w = c and tonumber(string.sub(v, b + 1, c - 1))
  return w, c
end
local function bad(k)
  return redis.error_reply('ONCEFLOW_FORMAT key ' .. k .. ' does not hold a format-1 value')
end
"#,
            $body
        )
    };
}

/// ARGV: window_ms, then per key: owner, lease_ms, fingerprint (hex, '' = none).
/// Reply: three flat slots per key, in order: `0, token, nil` claimed, `1, result|nil, nil`
/// duplicate, `2, owner, ms_left` in progress, `3, stored_fingerprint_hex, nil` mismatch.
pub(crate) static CLAIM: Script = Script::new(
    "claim",
    script!(
        r#"
local window = ARGV[1]
local w = tonumber(window)
local out, j = {}, 0
for i, k in ipairs(KEYS) do
  local owner, lease, fp = ARGV[3*i-1], tonumber(ARGV[3*i]), ARGV[3*i+1]
  local v = redis.call('GET', k)
  local st, tok, sf, b = '0', '0', '', 0
  if v then
    st, tok, sf, b = parse(v)
    if not st then return bad(k) end
  end
  local live, left, holder = st == '2', 0, nil
  if st == '1' then
    local kw, c = window_at(v, b)
    if not kw then return bad(k) end
    left = redis.call('PTTL', k) - kw
    holder = string.sub(v, c + 1)
    live = left > 0
  end
  if live and sf ~= '' and fp ~= '' and sf ~= fp then
    out[j+1], out[j+2], out[j+3] = 3, sf, false
  elseif st == '2' then
    local r = false
    if b < #v then r = string.sub(v, b + 2) end
    out[j+1], out[j+2], out[j+3] = 1, r, false
  elseif live and holder ~= owner then
    out[j+1], out[j+2], out[j+3] = 2, holder, left
  else
    -- New, released, lease ran out, or its holder claiming again (which keeps the stored
    -- fingerprint).
    local t = tonumber(tok) + 1
    if live and sf ~= '' then fp = sf end
    redis.call('SET', k, '11' .. t .. '|' .. fp .. '|' .. window .. '|' .. owner, 'PX', lease + w)
    out[j+1], out[j+2], out[j+3] = 0, t, false
  end
  j = j + 3
end
return out
"#
    ),
);

/// ARGV: lease_ms, then one token per key. Reply per key: 1 renewed, 0 stale.
pub(crate) static RENEW: Script = Script::new(
    "renew",
    script!(
        r#"
local lease = tonumber(ARGV[1])
local out = {}
for i, k in ipairs(KEYS) do
  out[i] = 0
  local v = redis.call('GET', k)
  if v then
    local p = '11' .. ARGV[1+i] .. '|'
    local n = #p
    if string.sub(v, 1, n) == p then
      local b = string.find(v, '|', n + 1, true)
      local kw = b and window_at(v, b)
      if not kw then return bad(k) end
      redis.call('PEXPIRE', k, lease + kw)
      out[i] = 1
    elseif string.byte(v, 1) ~= 49 then
      return bad(k)
    end
  end
end
return out
"#
    ),
);

/// ARGV: window_ms, then per key: token, result ('' = none, else '=' followed by the bytes).
/// Reply per key: 1 done (now or by an earlier completion with the same token), 0 stale.
pub(crate) static COMPLETE: Script = Script::new(
    "complete",
    script!(
        r#"
local w = ARGV[1]
local out = {}
for i, k in ipairs(KEYS) do
  out[i] = 0
  local v = redis.call('GET', k)
  if v then
    local tok = ARGV[2*i]
    local p = '11' .. tok .. '|'
    local n = #p
    local head = string.sub(v, 1, n)
    if head == p then
      local b = string.find(v, '|', n + 1, true)
      if not b then return bad(k) end
      redis.call('SET', k, '12' .. string.sub(v, 3, b) .. ARGV[2*i+1], 'PX', w)
      out[i] = 1
    elseif head == '12' .. tok .. '|' then
      out[i] = 1
    elseif string.byte(v, 1) ~= 49 then
      return bad(k)
    end
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
  out[i] = 0
  local v = redis.call('GET', k)
  local p = '11' .. ARGV[i] .. '|'
  if v and string.sub(v, 1, #p) == p then
    redis.call('SET', k, '10' .. ARGV[i] .. '||', 'KEEPTTL')
    out[i] = 1
  elseif v and string.byte(v, 1) ~= 49 then
    return bad(k)
  end
end
return out
"#
    ),
);

/// No ARGV. Reply per key: {0} unknown or released, {1, owner, token, ms_left, fp_hex} in
/// progress, {2, token, result|nil, fp_hex} completed.
pub(crate) static GET: Script = Script::new(
    "get",
    script!(
        r#"
local out = {}
for i, k in ipairs(KEYS) do
  local v = redis.call('GET', k)
  out[i] = {0}
  if v then
    local st, tok, sf, b = parse(v)
    if not st then return bad(k) end
    if st == '1' then
      local kw, c = window_at(v, b)
      if not kw then return bad(k) end
      local left = redis.call('PTTL', k) - kw
      if left < 0 then left = 0 end
      out[i] = {1, string.sub(v, c + 1), tok, left, sf}
    elseif st == '2' then
      local r = false
      if b < #v then r = string.sub(v, b + 2) end
      out[i] = {2, tok, r, sf}
    end
  end
end
return out
"#
    ),
);

/// Every script, for `SCRIPT LOAD`.
pub(crate) static ALL: [&Script; 5] = [&CLAIM, &RENEW, &COMPLETE, &RELEASE, &GET];
