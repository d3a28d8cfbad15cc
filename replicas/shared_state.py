"""Replica state shared by several gateway processes through Redis.

Keys (``P`` = ``SharedStateConfig.key_prefix``):

    P epoch              random id written once; a new id means Redis lost its data
    P members            hash url -> wall time it was added (registration order)
    P drain              hash url -> wall-clock drain deadline (operator drains only)
    P candidates         set of urls marked as scale-in removal candidates
    P gateways           zset gateway id -> wall time its load lease expires
    P load:<gateway id>  hash "<url>|i" in flight, "<url>|p" pending prefill tokens,
                         "<url>|d" decoding; PEXPIRE lease_ttl_s, rewritten every sync

Each gateway calls ``sync()`` every ``sync_interval_s``: one Lua script rewrites its own
load hash (refreshing its TTL and its entry in ``gateways``), drops expired gateways and
returns membership, drains, candidates and every *other* live gateway's load. A gateway
that dies stops refreshing, so its load disappears by itself within ``lease_ttl_s``.

``reserve()`` is the anti-herding primitive (choose-and-reserve, one Lua script, so it
is atomic against every other gateway): given candidates in preference order it sums the
shared in-flight count of each over all live gateways, picks the first whose count is
at most the minimum plus ``reserve_slack_requests``, and increments that replica's
in-flight and pending-prefill counts in the caller's load hash at once, so the next
gateway's reserve (or sync) already sees it.

Scripts read keys they compute (the gateways' load hashes): fine on a single Redis or a
replica set, not on Redis Cluster. Wall-clock times are used in Redis because monotonic
clocks differ between hosts; the registry converts deadlines to remaining seconds.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from replicas.config import SharedStateConfig
from replicas.load import LoadCounters

_SYNC = """
local p, gw = ARGV[1], ARGV[2]
local now, ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
local epoch = redis.call('GET', p .. 'epoch')
if not epoch then epoch = ARGV[5]; redis.call('SET', p .. 'epoch', epoch) end
local lk = p .. 'load:' .. gw
redis.call('DEL', lk)
if #ARGV > 5 then
  for i = 6, #ARGV, 1000 do  -- chunks: Lua's unpack has a stack limit
    redis.call('HSET', lk, unpack(ARGV, i, math.min(i + 999, #ARGV)))
  end
  redis.call('PEXPIRE', lk, ttl)
end
redis.call('ZADD', p .. 'gateways', now + ttl / 1000, gw)
redis.call('ZREMRANGEBYSCORE', p .. 'gateways', '-inf', now)
local loads = {}
for _, g in ipairs(redis.call('ZRANGE', p .. 'gateways', 0, -1)) do
  if g ~= gw then loads[#loads + 1] = redis.call('HGETALL', p .. 'load:' .. g) end
end
return {epoch, redis.call('HGETALL', p .. 'members'), redis.call('HGETALL', p .. 'drain'),
        redis.call('SMEMBERS', p .. 'candidates'), loads}
"""

_RESERVE = """
local p, gw = ARGV[1], ARGV[2]
local now, ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
local predicted, slack = tonumber(ARGV[5]), tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', p .. 'gateways', '-inf', now)
local gws = redis.call('ZRANGE', p .. 'gateways', 0, -1)
local own = false
for _, g in ipairs(gws) do if g == gw then own = true end end
if not own then gws[#gws + 1] = gw end
local n = #ARGV - 6
local load = {}
for j = 1, n do
  load[j] = 0
  for _, g in ipairs(gws) do
    local v = redis.call('HGET', p .. 'load:' .. g, ARGV[6 + j] .. '|i')
    if v then load[j] = load[j] + tonumber(v) end
  end
end
local least = load[1]
for j = 2, n do if load[j] < least then least = load[j] end end
local pick = 1
for j = 1, n do if load[j] <= least + slack then pick = j; break end end
local url = ARGV[6 + pick]
local lk = p .. 'load:' .. gw
redis.call('HINCRBY', lk, url .. '|i', 1)
redis.call('HINCRBY', lk, url .. '|p', predicted)
redis.call('PEXPIRE', lk, ttl)
redis.call('ZADD', p .. 'gateways', now + ttl / 1000, gw)
return url
"""


@dataclass(frozen=True, slots=True)
class SharedSnapshot:
    """What one sync read: the fleet's shared view, other gateways' load summed."""

    epoch: str
    members: tuple[str, ...]  # in the order they were added
    drains: Mapping[str, float]  # url -> seconds left until the drain deadline
    candidates: frozenset[str]
    remote_load: Mapping[str, LoadCounters] = field(default_factory=dict)


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pairs(flat: Sequence[Any]) -> list[tuple[str, str]]:
    return [(_s(flat[i]), _s(flat[i + 1])) for i in range(0, len(flat) - 1, 2)]


def _sum_loads(per_gateway: Sequence[Sequence[Any]]) -> dict[str, LoadCounters]:
    totals: dict[str, LoadCounters] = {}
    for flat in per_gateway:
        for key, value in _pairs(flat):
            url, _, kind = key.rpartition("|")
            c = totals.setdefault(url, LoadCounters())
            n = int(value)
            if kind == "i":
                c.in_flight += n
            elif kind == "p":
                c.pending_prefill_tokens += n
            elif kind == "d":
                c.decoding += n
    return totals


class SharedState:
    """One gateway's handle on the shared state. Raises Redis/OS errors: the registry
    decides how to degrade. A client passed in belongs to the caller; one made by
    ``from_url`` belongs to this object and is closed by ``aclose()`` (the registry
    calls it at ``stop()``)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        config: SharedStateConfig,
        *,
        gateway_id: str | None = None,
        wall_clock: Callable[[], float] = time.time,
        owns_client: bool = False,
    ) -> None:
        """``owns_client``: ``aclose`` closes ``redis`` too (the client ``from_url`` made)."""
        self.redis = redis
        self.config = config
        self.gateway_id = gateway_id or secrets.token_hex(6)
        self._wall = wall_clock
        self._p = config.key_prefix
        self._sync = redis.register_script(_SYNC)
        self._reserve = redis.register_script(_RESERVE)
        self._owns_client = owns_client

    @classmethod
    def from_url(cls, config: SharedStateConfig, *, gateway_id: str | None = None) -> SharedState:
        if not config.redis_url:
            raise ValueError("SharedStateConfig.redis_url is not set")
        timeout = max(config.sync_budget_s, config.op_budget_s)
        # one retry on a fresh connection when a pooled one is dead (a restarted Redis
        # closed it), as the prefix index does: no flap per stale connection after a restart
        pool = aioredis.BlockingConnectionPool.from_url(
            config.redis_url, max_connections=32, timeout=timeout, socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        client = aioredis.Redis.from_pool(pool)
        return cls(client, config, gateway_id=gateway_id, owns_client=True)

    async def aclose(self) -> None:
        if self._owns_client:
            await self.redis.aclose()

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.config.lease_ttl_s * 1000))

    async def sync(self, local_load: Mapping[str, LoadCounters]) -> SharedSnapshot:
        """Publish this gateway's load (refreshing its lease) and read the shared view."""
        flat: list[str | int] = []
        for url, c in local_load.items():
            for kind, n in zip("ipd", c.as_tuple()):
                if n:
                    flat += [f"{url}|{kind}", n]
        now = self._wall()
        raw = await self._sync(
            args=[self._p, self.gateway_id, now, self.ttl_ms, secrets.token_hex(8), *flat]
        )
        epoch, members, drains, candidates, loads = raw
        ordered = sorted(_pairs(members), key=lambda kv: (float(kv[1]), kv[0]))
        return SharedSnapshot(
            epoch=_s(epoch),
            members=tuple(url for url, _ in ordered),
            drains={url: float(deadline) - now for url, deadline in _pairs(drains)},
            candidates=frozenset(_s(c) for c in candidates),
            remote_load=_sum_loads(loads),
        )

    async def reserve(self, candidates: Sequence[str], predicted_tokens: int) -> str:
        """Atomically choose among ``candidates`` (preference order) and count it."""
        if not candidates:
            raise ValueError("reserve() needs at least one candidate")
        args: list[str | int | float] = [
            self._p,
            self.gateway_id,
            self._wall(),
            self.ttl_ms,
            max(0, int(predicted_tokens)),
            max(0, self.config.reserve_slack_requests),
            *candidates,
        ]
        return _s(await self._reserve(args=args))

    async def add_member(self, url: str) -> None:
        await self.redis.hsetnx(self._p + "members", url, repr(self._wall()))

    async def remove_member(self, url: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self._p + "members", url)
            pipe.hdel(self._p + "drain", url)
            pipe.srem(self._p + "candidates", url)
            await pipe.execute()

    async def set_drain(self, url: str, remaining_s: float) -> None:
        await self.redis.hset(self._p + "drain", url, repr(self._wall() + remaining_s))

    async def clear_drain(self, url: str) -> None:
        await self.redis.hdel(self._p + "drain", url)

    async def set_candidate(self, url: str, flag: bool) -> None:
        if flag:
            await self.redis.sadd(self._p + "candidates", url)
        else:
            await self.redis.srem(self._p + "candidates", url)

    async def republish(
        self, members: Sequence[str], drains: Mapping[str, float], candidates: Sequence[str]
    ) -> None:
        """After Redis lost its data (or came back): put this gateway's view back."""
        now = self._wall()
        async with self.redis.pipeline(transaction=True) as pipe:
            for url in members:
                pipe.hsetnx(self._p + "members", url, repr(now))
            for url, remaining in drains.items():
                pipe.hsetnx(self._p + "drain", url, repr(now + remaining))
            if candidates:
                pipe.sadd(self._p + "candidates", *candidates)
            await pipe.execute()

    async def forget_gateway(self) -> None:
        """Graceful stop: this gateway's load goes away now instead of at lease expiry."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._p + "load:" + self.gateway_id)
            pipe.zrem(self._p + "gateways", self.gateway_id)
            await pipe.execute()
