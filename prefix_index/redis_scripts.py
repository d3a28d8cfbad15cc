"""The Lua scripts of the Redis prefix index (loaded once per client, called with EVALSHA).

Two layouts share the membership hash ``P:t:<replica>`` (block -> ``d`` | ``h``) that the
match scripts read, and differ in how they keep recency (see docs/redis.md):

- **chain** (default, ``CHAIN_SCRIPTS``): recency per *segment*. A segment is a run of
  consecutive blocks of one chain recorded together, kept as one 8-bytes-a-block string in
  ``P:g:<replica>`` (keyed by its first block) and ranked in ``P:zd:<replica>`` (device) or
  ``P:zh:<replica>`` (host) by ``T * 2^20 - depth of its first block``. Recording a chain
  touches one entry per segment on its path; per-block work is only for blocks that are new,
  evicted, or cross the device/host boundary. Right for chain-shaped input (a block's hash
  names its whole prefix), which is what the gateway sends.
- **exact** (``EXACT_SCRIPTS``, ``redis_exact_match``): one recency entry per block in the
  ZSET ``P:r:<replica>``; right for any hash list, ~10x dearer to record a long chain.

Every script gets ``ARGV[1] = P`` (the key prefix) and builds key names from it, so this
targets a standalone Redis, not a Cluster.
"""
from __future__ import annotations

_LUA_COMMON = """
local P = ARGV[1]
local function blocks(blob)
  local m = {}
  for i = 1, #blob / 8 do m[i] = string.sub(blob, i * 8 - 7, i * 8) end
  return m
end
local function chunked(cmd, key, items, step)
  for i = 1, #items, step do
    redis.call(cmd, key, unpack(items, i, math.min(#items, i + step - 1)))
  end
end
local function set_tier(tkey, members, tier)  -- HSET tkey m1 tier m2 tier ...
  local args = {}
  for _, b in ipairs(members) do args[#args + 1] = b; args[#args + 1] = tier end
  chunked('HSET', tkey, args, 2000)
end
local function mark(key, tkey, from, to, tier)  -- blocks at recency ranks from..to get tier
  if to >= from then set_tier(tkey, redis.call('ZREVRANGE', key, from, to), tier) end
end
local function trim(key, tkey, cap)  -- drop the least recent blocks beyond cap
  local card = redis.call('ZCARD', key)
  if card > cap then
    chunked('HDEL', tkey, redis.call('ZRANGE', key, 0, card - cap - 1), 1000)
    redis.call('ZREMRANGEBYRANK', key, 0, card - cap - 1)
  end
end
local function replica_list()  -- ARGV[3]: replica ids joined by newlines (one argument, not 64)
  local out = {}
  for rid in string.gmatch(ARGV[3], '[^\\n]+') do out[#out + 1] = rid end
  return out
end
local function caps(rid, dd, dh)
  local c = redis.call('HMGET', P .. ':m:' .. rid, 'd', 'h')
  return tonumber(c[1]) or tonumber(dd), tonumber(c[2]) or tonumber(dh)
end
"""

# ARGV: P, chain blob, replicas joined by newlines -> flat [replica, device, host]*. Exact for any input:
# checks every block up to each replica's match (O(sum of matched lengths)).
_MATCH = """
local blob, m = ARGV[2], {}  -- blocks are cut from the blob only as far as some replica matches
local n = #blob / 8
local out, live = {}, {}
for _, rid in ipairs(replica_list()) do live[#live + 1] = {rid, P .. ':t:' .. rid, 0, 0} end
local start, size = 1, 16
while start <= n and #live > 0 do
  local stop = math.min(n, start + size - 1)
  for i = start, stop do m[i] = string.sub(blob, i * 8 - 7, i * 8) end
  local nxt = {}
  for _, e in ipairs(live) do
    local t = redis.call('HMGET', e[2], unpack(m, start, stop))
    local got = 0
    while got < #t and t[got + 1] do
      got = got + 1
      if t[got] == 'h' then e[4] = e[4] + 1 end
    end
    e[3] = e[3] + got
    if got == #t then nxt[#nxt + 1] = e
    elseif e[3] > 0 then out[#out + 1] = e[1]; out[#out + 1] = e[3] - e[4]; out[#out + 1] = e[4] end
  end
  live, start, size = nxt, stop + 1, math.min(size * 4, 1024)
end
for _, e in ipairs(live) do
  if e[3] > 0 then out[#out + 1] = e[1]; out[#out + 1] = e[3] - e[4]; out[#out + 1] = e[4] end
end
return out
"""

# ARGV: P, chain blob, replicas joined by newlines -> flat [replica, device, host]*. Assumes what chained
# hashes guarantee: holding block k implies holding blocks 0..k-1, and along a chain the
# blocks are ever less recent (so host blocks are a suffix). Eviction and truncation only
# ever remove suffixes, so the index keeps that shape; then both boundaries can be found by
# search: first probe block 1 and the lengths earlier replicas matched (L, L+1: replicas
# sharing a system prompt resolve in one HMGET), else gallop (2L, 4L, ..., n) and narrow
# 8-way: a few HMGETs per replica instead of one lookup per matched block.
_MATCH_CHAIN = """
local blob, m = ARGV[2], {}
local n = #blob / 8
local function probe(tkey, idx)
  local args = {}
  for q, i in ipairs(idx) do
    if not m[i] then m[i] = string.sub(blob, i * 8 - 7, i * 8) end
    args[q] = m[i]
  end
  return redis.call('HMGET', tkey, unpack(args))
end
-- (lo, hi): pred holds at lo (0 = nowhere known), fails at hi; narrow to hi = lo + 1
local function narrow(tkey, lo, hi, pred, seen)
  while hi - lo > 1 do
    local step, idx = math.max(1, math.floor((hi - lo) / 8)), {}
    for i = lo + step, hi - 1, step do idx[#idx + 1] = i end
    local v, top = probe(tkey, idx), hi
    for q, i in ipairs(idx) do
      seen[i] = v[q]
      if pred(v[q]) then lo = i else top = i; break end
    end
    hi = top
  end
  return lo
end
local function present(v) return v ~= false end
local function device(v) return v == 'd' end
local out, hints = {}, {}  -- hints: match lengths other replicas had (a shared system prompt)
local function search(tkey, seen)  -- general case: hints, then gallop, then narrow
  local idx = {1}
  for _, L in ipairs(hints) do idx[#idx + 1] = L; idx[#idx + 1] = math.min(L + 1, n) end
  local v, lo, hi = probe(tkey, idx), 0, n + 1
  for q, i in ipairs(idx) do
    seen[i] = v[q]
    if not v[q] and i < hi then hi = i end
  end
  for i, t in pairs(seen) do if t and i < hi and i > lo then lo = i end end
  if hi == n + 1 and lo < n then  -- nothing missing seen yet: gallop up
    idx = {}
    local p = lo * 2
    while p < n do idx[#idx + 1] = p; p = p * 2 end
    idx[#idx + 1] = n
    v = probe(tkey, idx)
    for q, i in ipairs(idx) do
      seen[i] = v[q]
      if v[q] then lo = i else hi = i; break end
    end
  end
  return narrow(tkey, lo, hi, present, seen)
end
for _, rid in ipairs(replica_list()) do
  local tkey, seen, len = P .. ':t:' .. rid, {}, nil
  local L = hints[1]
  if L then  -- fast path: the length the previous replica matched (one HMGET of two fields)
    local v = probe(tkey, {L, math.min(L + 1, n)})
    seen[L] = v[1]
    if v[1] and (L == n or not v[2]) then len = L end
  end
  len = len or search(tkey, seen)
  if len > 0 then
    local host = 0
    if seen[len] == 'h' then  -- find the first host block: largest known 'd' .. smallest known 'h'
      local dlo, hhi = 0, len
      for i, t in pairs(seen) do
        if i <= len and t == 'd' and i > dlo then dlo = i end
        if i <= len and t == 'h' and i < hhi then hhi = i end
      end
      host = len - narrow(tkey, dlo, hhi, device, seen)
    end
    out[#out + 1] = rid; out[#out + 1] = len - host; out[#out + 1] = host
    for k, H in ipairs(hints) do if H == len then table.remove(hints, k); break end end
    table.insert(hints, 1, len); hints[5] = nil  -- most recent first
  end
end
return out
"""

# Exact layout (per-block recency ZSET). ARGV: P, replica, chain blob, default d, default h, ttl ms
_RECORD_EXACT = """
local rid = ARGV[2]
local key, tkey, meta = P .. ':r:' .. rid, P .. ':t:' .. rid, P .. ':m:' .. rid
local m = blocks(ARGV[3])
local d, h = caps(rid, ARGV[4], ARGV[5])
redis.call('HSET', meta, 'd', d, 'h', h)
if #m > 0 then
  local top = redis.call('INCRBY', P .. ':clock', #m)
  local args = {}
  for i = #m, 1, -1 do  -- block 1 gets the highest score; a repeated block keeps its best
    args[#args + 1] = top - i + 1
    args[#args + 1] = m[i]
  end
  -- blocks already on device stay 'd'; the others (k of them) push k device blocks down
  -- to ranks d .. d+k-1: only those can have crossed the boundary
  local fresh = {}
  for i = 1, #m, 1000 do
    local cur = redis.call('HMGET', tkey, unpack(m, i, math.min(#m, i + 999)))
    for q = 1, #cur do if cur[q] ~= 'd' then fresh[#fresh + 1] = m[i + q - 1] end end
  end
  chunked('ZADD', key, args, 2000)
  set_tier(tkey, fresh, 'd')
  mark(key, tkey, d, d + #fresh - 1, 'h')
  trim(key, tkey, d + h)
  redis.call('PEXPIRE', key, ARGV[6]); redis.call('PEXPIRE', tkey, ARGV[6])
end
redis.call('PEXPIRE', meta, ARGV[6])
redis.call('SADD', P .. ':replicas', rid)
redis.call('PEXPIRE', P .. ':replicas', ARGV[6])
redis.call('SET', P .. ':alive', '1')
return 1
"""

# ARGV: P, replica, blob of the blocks to forget, default d, default h
_TRUNCATE_EXACT = """
local rid = ARGV[2]
local key, tkey = P .. ':r:' .. rid, P .. ':t:' .. rid
local m = blocks(ARGV[3])
local removed = 0
for i = 1, #m, 1000 do
  removed = removed + redis.call('ZREM', key, unpack(m, i, math.min(#m, i + 999)))
end
if removed > 0 then
  chunked('HDEL', tkey, m, 1000)
  local d = caps(rid, ARGV[4], ARGV[5])
  mark(key, tkey, math.max(d - removed, 0), d - 1, 'd')  -- host blocks that moved up
end
return removed
"""

# ARGV: P, replica, d, h, ttl ms
_CAPACITY_EXACT = """
local rid = ARGV[2]
local key, tkey, meta = P .. ':r:' .. rid, P .. ':t:' .. rid, P .. ':m:' .. rid
local old = redis.call('HMGET', meta, 'd', 'h')
local d, h = tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('HSET', meta, 'd', d, 'h', h)
redis.call('PEXPIRE', meta, ARGV[5])
redis.call('SADD', P .. ':replicas', rid)
redis.call('PEXPIRE', P .. ':replicas', ARGV[5])
trim(key, tkey, d + h)
if tonumber(old[1]) ~= d then  -- the boundary moved: re-mark every block
  mark(key, tkey, 0, d - 1, 'd')
  mark(key, tkey, d, -1 + redis.call('ZCARD', key), 'h')
end
return 1
"""

# ARGV: P, replica
_REMOVE = """
local rid = ARGV[2]
redis.call('DEL', P .. ':r:' .. rid, P .. ':t:' .. rid, P .. ':m:' .. rid, P .. ':g:' .. rid, P .. ':zd:' .. rid, P .. ':zh:' .. rid)
redis.call('SREM', P .. ':replicas', rid)
local all = redis.call('HGETALL', P .. ':sh')
for i = 1, #all, 2 do
  if string.sub(all[i + 1], 1, #rid + 1) == rid .. '\\n' then
    redis.call('HDEL', P .. ':sh', all[i]); redis.call('ZREM', P .. ':sz', all[i])
    redis.call('DEL', P .. ':s:' .. all[i])
  end
end
return 1
"""

# ARGV: P, key, value, last_seen, ttl ms, max sessions, feed length -> sessions evicted by the bound.
# Every write is also appended to the session feed P:sx (redis_sessions.py), trimmed ~ARGV[7].
# The bound: P:sz ranks sessions by last_seen (their last use); beyond max, expired ones
# (last_seen older than this one's minus the TTL) go first, then the least recent are popped
# with their P:sh field and P:s key, and counted in P:sev.
_SESSION = """
local sz, sh = P .. ':sz', P .. ':sh'
redis.call('SET', P .. ':s:' .. ARGV[2], ARGV[3], 'PX', ARGV[5])
redis.call('HSET', sh, ARGV[2], ARGV[3])
redis.call('ZADD', sz, ARGV[4], ARGV[2])
redis.call('PEXPIRE', sh, ARGV[5]); redis.call('PEXPIRE', sz, ARGV[5])
redis.call('XADD', P .. ':sx', 'MAXLEN', '~', ARGV[7], '*', 'k', ARGV[2], 'v', ARGV[3])
redis.call('PEXPIRE', P .. ':sx', ARGV[5])
local cutoff = '(' .. (tonumber(ARGV[4]) - tonumber(ARGV[5]) / 1000)
local function drop_expired(n)  -- expired sessions' P:sz/P:sh entries (their P:s key expired by itself)
  local old = redis.call('ZRANGEBYSCORE', sz, '-inf', cutoff, 'LIMIT', 0, n)
  if #old > 0 then chunked('ZREM', sz, old, 1000); chunked('HDEL', sh, old, 1000) end
  return #old
end
drop_expired(8)  -- a few per write: the table prunes itself without a full scan
local over = redis.call('ZCARD', sz) - tonumber(ARGV[6])
if over <= 0 then return 0 end
over = over - drop_expired(over)
if over <= 0 then return 0 end
local popped = redis.call('ZPOPMIN', sz, over)
local keys, fields = {}, {}
for i = 1, #popped, 2 do fields[#fields + 1] = popped[i]; keys[#keys + 1] = P .. ':s:' .. popped[i] end
chunked('HDEL', sh, fields, 1000)
for i = 1, #keys, 1000 do redis.call('DEL', unpack(keys, i, math.min(#keys, i + 999))) end
redis.call('INCRBY', P .. ':sev', #fields)
return #fields
"""

# ARGV: P, window start, ttl cutoff -> flat [replica, tokens]*
_RESIDENT = """
local old = redis.call('ZRANGEBYSCORE', P .. ':sz', '-inf', '(' .. ARGV[3])
if #old > 0 then chunked('ZREM', P .. ':sz', old, 1000); chunked('HDEL', P .. ':sh', old, 1000) end
local keys = redis.call('ZRANGEBYSCORE', P .. ':sz', ARGV[2], '+inf')
local sums, order = {}, {}
for i = 1, #keys, 1000 do
  local vals = redis.call('HMGET', P .. ':sh', unpack(keys, i, math.min(#keys, i + 999)))
  for _, v in ipairs(vals) do
    if v then
      local a = string.find(v, '\\n', 1, true)
      local b = string.find(v, '\\n', a + 1, true)
      local rid = string.sub(v, 1, a - 1)
      if not sums[rid] then sums[rid] = 0; order[#order + 1] = rid end
      sums[rid] = sums[rid] + tonumber(string.sub(v, a + 1, b - 1))
    end
  end
end
local out = {}
for _, rid in ipairs(order) do out[#out + 1] = rid; out[#out + 1] = sums[rid] end
return out
"""


# --- Chain layout (the default): recency kept per *segment*, not per block ----------------
_SEG_COMMON = """
local S = 1048576  -- a segment's score: T * S - (depth of its first block); T counts records
local function rkeys(rid)
  return {t = P .. ':t:' .. rid, g = P .. ':g:' .. rid, d = P .. ':zd:' .. rid, h = P .. ':zh:' .. rid,
          m = P .. ':m:' .. rid}
end
local function zkey(K, tier) if tier == 'd' then return K.d end return K.h end
local function seg_put(K, blob, tier, score)  -- a segment is keyed by its first block
  local key = string.sub(blob, 1, 8)
  redis.call('HSET', K.g, key, blob)
  redis.call('ZADD', zkey(K, tier), score, key)
end
local function seg_del(K, key, tier)
  redis.call('HDEL', K.g, key)
  redis.call('ZREM', zkey(K, tier), key)
end
local function seg_caps(K, dd, dh)
  local c = redis.call('HMGET', K.m, 'd', 'h', 'nd', 'nh')
  return tonumber(c[1]) or tonumber(dd), tonumber(c[2]) or tonumber(dh), tonumber(c[3]) or 0, tonumber(c[4]) or 0
end
local function expire_all(K, ttl)
  for _, k in ipairs({K.t, K.g, K.d, K.h, K.m}) do redis.call('PEXPIRE', k, ttl) end
  redis.call('SADD', P .. ':replicas', ARGV[2])
  redis.call('PEXPIRE', P .. ':replicas', ttl)
end
-- How many leading blocks of seg equal the chain's blocks j, j+1, ... Chains never rejoin
-- (block k's hash names blocks 0..k), so comparing one 8-byte block at k tells whether all
-- k agree: a binary search of single-block comparisons, no copy of the 12 KB strings.
local function agree(seg, chain, j)
  local n = math.floor(math.min(#seg, #chain - j * 8) / 8)
  local function same(k)
    return string.sub(seg, k * 8 - 7, k * 8) == string.sub(chain, (j + k) * 8 - 7, (j + k) * 8)
  end
  if same(n) then return n end
  local lo, hi = 1, n  -- block 1 is the key, so equal
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    if same(mid) then lo = mid else hi = mid end
  end
  return lo
end
local function held_after(K, chain, j, n)  -- first index > j whose block the replica holds (n: none)
  for i = j + 1, n - 1, 1000 do
    local args = {}
    for q = i, math.min(n - 1, i + 999) do args[#args + 1] = string.sub(chain, q * 8 + 1, q * 8 + 8) end
    local v = redis.call('HMGET', K.t, unpack(args))
    for q = 1, #v do if v[q] then return i + q - 1 end end
  end
  return n
end
-- The chain's blocks the replica holds, as pieces {key, seg, tier, score, g, from}: the first g
-- blocks of segment `key` are the chain's blocks from .. from+g-1. A held block whose parent is
-- not in its segment starts a segment, so pieces are found by key, one HGET per segment on the
-- path. `fresh`: indices of the blocks not held (usually the few a new turn adds).
local function walk(K, chain, n)
  local pieces, fresh, j = {}, {}, 0
  while j < n do
    local key = string.sub(chain, j * 8 + 1, j * 8 + 8)
    local seg = redis.call('HGET', K.g, key)
    if seg then
      local tier, score = 'd', redis.call('ZSCORE', K.d, key)
      if not score then tier, score = 'h', redis.call('ZSCORE', K.h, key) end
      local g = agree(seg, chain, j)
      pieces[#pieces + 1] = {key = key, seg = seg, tier = tier, score = tonumber(score) or 0, g = g, from = j}
      j = j + g
    else
      local nxt = held_after(K, chain, j, n)
      for i = j, nxt - 1 do fresh[#fresh + 1] = i end
      j = nxt
    end
  end
  return pieces, fresh
end
local function lru_end(K, z, most)  -- key, blob, score of a tier's least (most) recent segment
  local r = redis.call(most and 'ZREVRANGE' or 'ZRANGE', z, 0, 0, 'WITHSCORES')
  if not r[1] then return nil end
  return r[1], redis.call('HGET', K.g, r[1]) or '', tonumber(r[2])
end
-- Restore the tiers: at most d + h blocks (drop the least recent: segment tails), device = the
-- most recent d. Per-block work only for blocks that leave or cross the device boundary.
local function rebalance(K, d, h, nd, nh)
  local over = nd + nh - d - h
  while over > 0 do
    local z = K.h
    if nh <= 0 then z = K.d end
    local key, seg = lru_end(K, z, false)
    if not key then if z == K.h then nh = 0 else nd = 0 end; break end
    local len = #seg / 8
    local cut = math.min(len, over)
    chunked('HDEL', K.t, blocks(string.sub(seg, (len - cut) * 8 + 1)), 1000)
    if cut == len then redis.call('HDEL', K.g, key); redis.call('ZREM', z, key)
    else redis.call('HSET', K.g, key, string.sub(seg, 1, (len - cut) * 8)) end
    if z == K.h then nh = nh - cut else nd = nd - cut end
    over = nd + nh - d - h
  end
  while nd > d do  -- device overflow: the least recent device blocks move to host
    local key, seg, score = lru_end(K, K.d, false)
    if not key then nd = 0; break end
    local len = #seg / 8
    local cut = math.min(len, nd - d)
    set_tier(K.t, blocks(string.sub(seg, (len - cut) * 8 + 1)), 'h')
    if cut == len then redis.call('ZREM', K.d, key); redis.call('ZADD', K.h, score, key)
    else
      redis.call('HSET', K.g, key, string.sub(seg, 1, (len - cut) * 8))
      seg_put(K, string.sub(seg, (len - cut) * 8 + 1), 'h', score - (len - cut))
    end
    nd, nh = nd - cut, nh + cut
  end
  while nd < d and nh > 0 do  -- device room: the most recent host blocks count as device
    local key, seg, score = lru_end(K, K.h, true)
    if not key then nh = 0; break end
    local len = #seg / 8
    local cut = math.min(len, d - nd)
    set_tier(K.t, blocks(string.sub(seg, 1, cut * 8)), 'd')
    redis.call('ZREM', K.h, key); redis.call('ZADD', K.d, score, key)
    if cut < len then
      redis.call('HSET', K.g, key, string.sub(seg, 1, cut * 8))
      seg_put(K, string.sub(seg, cut * 8 + 1), 'h', score - cut)
    end
    nd, nh = nd + cut, nh - cut
  end
  redis.call('HSET', K.m, 'd', d, 'h', h, 'nd', nd, 'nh', nh)
end
"""

# ARGV: P, replica, chain blob, default d, default h, ttl ms -> 0 if the capacity was unknown.
# The chain becomes one segment at
# the most recent end; the parts of older segments it does not cover keep their recency.
_RECORD = """
local K = rkeys(ARGV[2])
local chain = ARGV[3]
local n = #chain / 8
local sized = redis.call('HEXISTS', K.m, 'd')  -- 0: capacity unknown (new, expired, Redis restarted)
local d, h, nd, nh = seg_caps(K, ARGV[4], ARGV[5])
if n > 0 then
  local T = redis.call('INCR', P .. ':clock')
  local pieces, fresh = walk(K, chain, n)
  local marks = {}  -- blocks that become device: the chain's host blocks and its new blocks
  for _, p in ipairs(pieces) do
    seg_del(K, p.key, p.tier)
    if p.g < #p.seg / 8 then seg_put(K, string.sub(p.seg, p.g * 8 + 1), p.tier, p.score - p.g) end
    if p.tier == 'h' then
      for i = 1, p.g do marks[#marks + 1] = string.sub(p.seg, i * 8 - 7, i * 8) end
      nd, nh = nd + p.g, nh - p.g
    end
  end
  for _, i in ipairs(fresh) do marks[#marks + 1] = string.sub(chain, i * 8 + 1, i * 8 + 8) end
  nd = nd + #fresh
  set_tier(K.t, marks, 'd')
  seg_put(K, chain, 'd', T * S)
end
rebalance(K, d, h, nd, nh)
expire_all(K, ARGV[6])
redis.call('SET', P .. ':alive', '1')
return sized
"""

# ARGV: P, replica, chain blob, keep, default d, default h -> blocks forgotten
_TRUNCATE = """
local K = rkeys(ARGV[2])
if redis.call('EXISTS', K.m) == 0 then return 0 end
local chain, keep = ARGV[3], tonumber(ARGV[4])
local d, h, nd, nh = seg_caps(K, ARGV[5], ARGV[6])
local pieces = walk(K, chain, #chain / 8)
local removed = 0
for _, p in ipairs(pieces) do
  local u = math.max(keep - p.from, 0)  -- the piece's blocks from u on are forgotten
  if u < p.g then
    chunked('HDEL', K.t, blocks(string.sub(p.seg, u * 8 + 1, p.g * 8)), 1000)
    seg_del(K, p.key, p.tier)
    if u > 0 then seg_put(K, string.sub(p.seg, 1, u * 8), p.tier, p.score) end
    if p.g < #p.seg / 8 then seg_put(K, string.sub(p.seg, p.g * 8 + 1), p.tier, p.score - p.g) end
    if p.tier == 'd' then nd = nd - (p.g - u) else nh = nh - (p.g - u) end
    removed = removed + p.g - u
  end
end
if removed > 0 then rebalance(K, d, h, nd, nh) end
return removed
"""

# ARGV: P, replica, d, h, ttl ms
_CAPACITY = """
local K = rkeys(ARGV[2])
local _, _, nd, nh = seg_caps(K, 0, 0)
rebalance(K, tonumber(ARGV[3]), tonumber(ARGV[4]), nd, nh)
expire_all(K, ARGV[5])
return 1
"""

# ARGV: P -> [sessions, session evictions, (replica, device, host)*] (both layouts)
_STATS = """
local out = {redis.call('HLEN', P .. ':sh'), tonumber(redis.call('GET', P .. ':sev') or '0')}
for _, rid in ipairs(redis.call('SMEMBERS', P .. ':replicas')) do
  local c = redis.call('HMGET', P .. ':m:' .. rid, 'd', 'nd', 'nh')
  local d = tonumber(c[1])
  if not d then
    redis.call('SREM', P .. ':replicas', rid)  -- expired replica
  elseif c[2] then
    out[#out + 1] = rid; out[#out + 1] = tonumber(c[2]); out[#out + 1] = tonumber(c[3])
  else
    local n = redis.call('ZCARD', P .. ':r:' .. rid)
    out[#out + 1] = rid; out[#out + 1] = math.min(n, d); out[#out + 1] = math.max(n - d, 0)
  end
end
return out
"""

_SHARED = {"match": _MATCH, "match_chain": _MATCH_CHAIN, "remove": _REMOVE, "session": _SESSION,
           "resident": _RESIDENT, "stats": _STATS}
CHAIN_SCRIPTS: dict[str, str] = {
    **{name: _LUA_COMMON + body for name, body in _SHARED.items()},
    **{name: _LUA_COMMON + _SEG_COMMON + body
       for name, body in {"record": _RECORD, "truncate": _TRUNCATE, "capacity": _CAPACITY}.items()},
}
"""Scripts of the default (chain) layout, keyed by the name the backend calls."""

EXACT_SCRIPTS: dict[str, str] = {
    **{name: _LUA_COMMON + body for name, body in _SHARED.items()},
    **{name: _LUA_COMMON + body
       for name, body in {"record": _RECORD_EXACT, "truncate": _TRUNCATE_EXACT, "capacity": _CAPACITY_EXACT}.items()},
}
"""Scripts of the exact layout (``redis_exact_match``): one recency entry per block."""
