"""Shared prefix index in Redis: the embedded model, kept server-side, one round trip a match.

Keys (``P`` = ``key_prefix``; a replica id is its URL, hashes are 8-byte big-endian):
- ``P:r:<replica>``  ZSET block -> logical clock: the replica's recency list. Its ``d``
  most recent blocks are "device", the next ``h`` "host", the rest are trimmed.
- ``P:t:<replica>``  HASH block -> "d" | "h": membership and tier, what ``match`` reads
  (HMGET is ~3x cheaper than ZMSCORE, which formats every score as a double). Writes keep
  it in step with the ZSET: only blocks whose recency rank crossed ``d`` are re-marked.
- ``P:m:<replica>``  HASH {d, h}: capacity in blocks; ``P:replicas`` SET of replica ids.
- ``P:clock``        INCRBY counter giving every recorded block a unique score.
- ``P:s:<key>``      STRING "replica\\ntokens\\nlast_seen" with PX ``session_ttl_s``;
  ``P:sh`` HASH key -> same value and ``P:sz`` ZSET key -> last_seen, for resident tokens.
Every key but ``P:clock`` and ``P:alive`` carries a TTL (``block_ttl_s`` / ``session_ttl_s``,
refreshed on write). All work is done by the Lua scripts below (loaded once, called with
EVALSHA): a match walks the chain in growing chunks (16, 64, 256, 1024 blocks) with HMGET,
only for replicas still matching, so it costs O(sum of matched lengths) in one round trip.
Keys are built inside the scripts, so this targets a standalone Redis, not a Cluster.

Degrade, don't fail: every call is bounded by ``redis_timeout_s``. On an error or a
timeout the backend answers from a local ``MemoryPrefixIndex`` that mirrors its own
writes, counts ``degraded_total``, logs once, and pings every ``redis_retry_s`` until
Redis answers. If Redis came back empty (restart), answers also consult the local copy
for ``redis_recovery_merge_s``.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from prefix_index.base import (
    BlockHash,
    IndexStats,
    PrefixMatch,
    ReplicaCapacity,
    ReplicaId,
    SessionEntry,
)
from prefix_index.config import IndexConfig
from prefix_index.memory import MemoryPrefixIndex

log = logging.getLogger("kvgate.index.redis")

Arg = bytes | str | int | float

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
local function caps(rid, dd, dh)
  local c = redis.call('HMGET', P .. ':m:' .. rid, 'd', 'h')
  return tonumber(c[1]) or tonumber(dd), tonumber(c[2]) or tonumber(dh)
end
"""

# ARGV: P, chain blob, replica... -> flat [replica, device, host]*. Exact for any input:
# checks every block up to each replica's match (O(sum of matched lengths)).
_MATCH = """
local blob, m = ARGV[2], {}  -- blocks are cut from the blob only as far as some replica matches
local n = #blob / 8
local out, live = {}, {}
for i = 3, #ARGV do live[#live + 1] = {ARGV[i], P .. ':t:' .. ARGV[i], 0, 0} end
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

# ARGV: P, chain blob, replica... -> flat [replica, device, host]*. Assumes what chained
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
for a = 3, #ARGV do
  local tkey, seen, idx = P .. ':t:' .. ARGV[a], {}, {1}
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
  local len = narrow(tkey, lo, hi, present, seen)
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
    out[#out + 1] = ARGV[a]; out[#out + 1] = len - host; out[#out + 1] = host
    local known = false
    for _, L in ipairs(hints) do if L == len then known = true end end
    if not known then table.insert(hints, 1, len); hints[5] = nil end
  end
end
return out
"""

# ARGV: P, replica, chain blob, default d, default h, ttl ms
_RECORD = """
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
_TRUNCATE = """
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
_CAPACITY = """
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
redis.call('DEL', P .. ':r:' .. rid, P .. ':t:' .. rid, P .. ':m:' .. rid)
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

# ARGV: P, key, value, last_seen, ttl ms
_SESSION = """
redis.call('SET', P .. ':s:' .. ARGV[2], ARGV[3], 'PX', ARGV[5])
redis.call('HSET', P .. ':sh', ARGV[2], ARGV[3])
redis.call('ZADD', P .. ':sz', ARGV[4], ARGV[2])
redis.call('PEXPIRE', P .. ':sh', ARGV[5]); redis.call('PEXPIRE', P .. ':sz', ARGV[5])
return 1
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

# ARGV: P -> [sessions, (replica, device, host)*]
_STATS = """
local out = {redis.call('HLEN', P .. ':sh')}
for _, rid in ipairs(redis.call('SMEMBERS', P .. ':replicas')) do
  local d = tonumber(redis.call('HGET', P .. ':m:' .. rid, 'd'))
  if d then
    local n = redis.call('ZCARD', P .. ':r:' .. rid)
    out[#out + 1] = rid; out[#out + 1] = math.min(n, d); out[#out + 1] = math.max(n - d, 0)
  else
    redis.call('SREM', P .. ':replicas', rid)  -- expired replica
  end
end
return out
"""

SCRIPTS: dict[str, str] = {
    name: _LUA_COMMON + body
    for name, body in {
        "match": _MATCH, "match_chain": _MATCH_CHAIN, "record": _RECORD, "truncate": _TRUNCATE, "capacity": _CAPACITY,
        "remove": _REMOVE, "session": _SESSION, "resident": _RESIDENT, "stats": _STATS,
    }.items()
}
"""Every script, with the shared helpers prepended; keyed by the name ``_call`` uses."""


def pack_hashes(hashes: Sequence[BlockHash]) -> bytes:
    """The chain as one binary string (8 bytes a block): one argument instead of 1,500."""
    return struct.pack(f">{len(hashes)}Q", *hashes)


def _session_value(entry: SessionEntry) -> str:
    return f"{entry.replica}\n{entry.tokens}\n{entry.last_seen_s!r}"


def _parse_session(raw: bytes) -> SessionEntry:
    replica, tokens, seen = raw.decode().split("\n")
    return SessionEntry(ReplicaId(replica), int(tokens), float(seen))


class _Unavailable(Exception):
    """Redis did not answer within budget (internal: callers use the local copy)."""


class RedisPrefixIndex:
    """The Redis backend. Implements ``prefix_index.base.PrefixIndex``.

    ``degraded`` is True while Redis is considered down; ``degraded_total`` counts the
    operations answered (or written) locally because of that.
    """

    def __init__(self, config: IndexConfig, client: Redis | None = None) -> None:
        if client is None:
            if not config.redis_url:
                raise ValueError("the Redis index needs index.redis_url")
            budget = max(config.redis_timeout_s, 0.001)
            client = Redis.from_url(config.redis_url, socket_timeout=budget * 4, socket_connect_timeout=budget * 4)
        self._redis = client
        self._cfg = config
        self._p = config.key_prefix
        self._block_ttl_ms = max(int(config.block_ttl_s * 1000), 1)
        default = ReplicaCapacity(config.default_device_blocks, config.default_host_blocks)
        self._local = MemoryPrefixIndex(config.session_ttl_s, default)
        self._scripts = {name: client.register_script(src) for name, src in SCRIPTS.items()}
        self.degraded = False
        self.degraded_total = 0
        self.dropped_writes_total = 0
        self._merge_until = 0.0
        self._recovery: asyncio.Task[None] | None = None
        self._queue: deque[tuple[str, list[Arg]]] = deque(maxlen=config.redis_queue_max)
        self._flusher: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._flush_lock = asyncio.Lock()

    @property
    def local(self) -> MemoryPrefixIndex:
        """The local copy used while degraded (tests and metrics read it)."""
        return self._local

    # -- reads -------------------------------------------------------------------
    async def match(self, hashes: Sequence[BlockHash], replicas: Sequence[ReplicaId]) -> dict[ReplicaId, PrefixMatch]:
        if not hashes or not replicas:
            return {rid: PrefixMatch() for rid in replicas}
        try:
            script = "match" if self._cfg.redis_exact_match else "match_chain"
            flat = await self._call(script, [self._p, pack_hashes(hashes), *replicas])
        except _Unavailable:
            return self._local.match_now(hashes, replicas)
        out = {rid: PrefixMatch() for rid in replicas}
        for i in range(0, len(flat), 3):
            out[ReplicaId(flat[i].decode())] = PrefixMatch(int(flat[i + 1]), int(flat[i + 2]))
        if self._merging():
            for rid, local in self._local.match_now(hashes, replicas).items():
                if local.blocks > out[rid].blocks:
                    out[rid] = local
        return out

    async def get_session(self, key: str) -> SessionEntry | None:
        try:
            raw = await self._guard(self._redis.get(f"{self._p}:s:{key}"))
        except _Unavailable:
            return await self._local.get_session(key)
        if raw is None:
            return await self._local.get_session(key) if self._merging() else None
        return _parse_session(raw)

    async def resident_tokens(self, now_s: float, window_s: float) -> dict[ReplicaId, int]:
        args: list[Arg] = [self._p, repr(now_s - window_s), repr(now_s - self._cfg.session_ttl_s)]
        try:
            flat = await self._call("resident", args)
        except _Unavailable:
            return await self._local.resident_tokens(now_s, window_s)
        return {ReplicaId(flat[i].decode()): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def stats(self) -> IndexStats:
        try:
            flat = await self._call("stats", [self._p])
        except _Unavailable:
            return await self._local.stats()
        rows = flat[1:]
        device = {ReplicaId(rows[i].decode()): int(rows[i + 1]) for i in range(0, len(rows), 3)}
        host = {ReplicaId(rows[i].decode()): int(rows[i + 2]) for i in range(0, len(rows), 3)}
        return IndexStats(device_blocks=device, host_blocks=host, sessions=int(flat[0]))

    # -- writes ------------------------------------------------------------------
    async def record(self, replica: ReplicaId, hashes: Sequence[BlockHash]) -> None:
        self._local.record_now(replica, hashes)
        cfg = self._cfg
        args: list[Arg] = [
            self._p, replica, pack_hashes(hashes), cfg.default_device_blocks, cfg.default_host_blocks,
            self._block_ttl_ms,
        ]
        await self._write("record", args)

    async def truncate(self, replica: ReplicaId, hashes: Sequence[BlockHash], keep_blocks: int) -> None:
        await self._local.truncate(replica, hashes, keep_blocks)
        cfg = self._cfg
        blob = pack_hashes(hashes[max(keep_blocks, 0):])
        await self._write("truncate", [self._p, replica, blob, cfg.default_device_blocks, cfg.default_host_blocks])

    async def set_capacity(self, replica: ReplicaId, capacity: ReplicaCapacity) -> None:
        await self._local.set_capacity(replica, capacity)
        args: list[Arg] = [self._p, replica, capacity.device_blocks, capacity.host_blocks, self._block_ttl_ms]
        await self._write("capacity", args)

    async def remove_replica(self, replica: ReplicaId) -> None:
        await self._local.remove_replica(replica)
        await self._write("remove", [self._p, replica])

    async def set_session(self, key: str, entry: SessionEntry) -> None:
        await self._local.set_session(key, entry)
        ttl_ms = max(int(self._cfg.session_ttl_s * 1000), 1)
        args: list[Arg] = [self._p, key, _session_value(entry), repr(entry.last_seen_s), ttl_ms]
        await self._write("session", args)

    async def flush(self) -> None:
        """Wait until every queued write (write-behind mode) has been sent."""
        while self._queue:
            await self._flush_batch()
        async with self._flush_lock:  # wait for a batch the background task has in flight
            pass

    async def close(self) -> None:
        if not self.degraded:
            await self.flush()
        for task in (self._flusher, self._recovery):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._flusher = self._recovery = None
        await self._redis.aclose()

    # -- internals -----------------------------------------------------------------
    async def _write(self, script: str, args: list[Arg]) -> None:
        if not self._cfg.redis_write_behind:
            with contextlib.suppress(_Unavailable):  # the local copy has it; Redis is a cache
                await self._call(script, args)
            return
        if self.degraded:
            self.degraded_total += 1
            return
        if len(self._queue) == self._queue.maxlen:
            self.dropped_writes_total += 1
        self._queue.append((script, args))
        self._wake.set()
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self._cfg.redis_flush_interval_s)  # let a batch gather
            while self._queue:
                await self._flush_batch()

    async def _flush_batch(self, max_batch: int = 256) -> None:
        async with self._flush_lock:
            if not self._queue:
                return
            pipe = self._redis.pipeline(transaction=False)
            for _ in range(min(max_batch, len(self._queue))):
                name, args = self._queue.popleft()
                await self._scripts[name](args=args, client=pipe)
            try:
                await self._guard(pipe.execute(), scale=4.0)
            except _Unavailable:
                self.dropped_writes_total += len(self._queue)
                self._queue.clear()  # the local copy has them; Redis is a cache

    async def _call(self, script: str, args: list[Arg]) -> Any:
        return await self._guard(self._scripts[script](args=args))

    async def _guard(self, awaitable: Any, scale: float = 1.0) -> Any:
        """Await a Redis call within budget; on failure enter degraded mode."""
        if self.degraded:
            awaitable.close()  # never started: do not leave a coroutine un-awaited
            self.degraded_total += 1
            raise _Unavailable
        try:
            async with asyncio.timeout(self._cfg.redis_timeout_s * scale):  # no extra Task, unlike wait_for
                return await awaitable
        except (RedisError, OSError) as exc:  # TimeoutError is an OSError
            self._enter_degraded(exc)
            raise _Unavailable from exc

    def _enter_degraded(self, exc: BaseException) -> None:
        self.degraded_total += 1
        if self.degraded:
            return
        self.degraded = True
        log.warning("Redis index unavailable (%s: %s); routing on the local copy until it answers",
                    type(exc).__name__, exc)
        self._recovery = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        key = f"{self._p}:alive"  # set by every record: gone means Redis lost its data
        while True:
            await asyncio.sleep(self._cfg.redis_retry_s)
            try:
                async with asyncio.timeout(self._cfg.redis_timeout_s * 4):
                    marker = await self._redis.get(key)
                    await self._redis.set(key, b"1")
            except (RedisError, OSError):
                continue
            if marker is None:  # a restart: the local copy fills the gap while Redis refills
                self._merge_until = time.monotonic() + self._cfg.redis_recovery_merge_s
            self.degraded = False
            log.warning("Redis index available again%s", "" if marker else " (it came back empty)")
            return

    def _merging(self) -> bool:
        return self._merge_until > 0.0 and time.monotonic() < self._merge_until
