"""Which replica created each OpenAI Responses id: the pin of ``previous_response_id``.

A Responses request that names a ``previous_response_id`` continues a conversation the
replica that created that response holds in its own store (SGLang
``--enable-response-store``); ``GET``/``DELETE /v1/responses/{id}`` and ``.../cancel``
need the same replica. The gateway records ``response id -> replica`` when a response
is created (its JSON body's ``id``, or the ``response.created`` event of a stream) and
looks it up before routing.

Two backends behind one small Protocol:

- ``MemoryResponsesStore``: a bounded LRU (``responses.max_entries``, default 200,000
  entries, ~150 B each: ~30 MB) whose entries expire ``responses.ttl_s`` after they were
  written (default 24 h: a coding session rarely resumes a response older than a day,
  and a replica restart loses its store anyway). Embedded, per gateway process.
- ``RedisResponsesStore``: the same LRU in front of Redis (``SET <prefix>:resp:<id>
  <replica> EX ttl``), so every gateway on one Redis (``index.redis_url``) sees every
  other's responses. A Redis call gets ``responses.redis_timeout_s`` (0.5 s: a pin is
  worth a slower answer, unlike an index read); a failing Redis degrades to the local
  copy (this gateway's own responses), counted in ``degraded_total`` and logged, never
  failing the request by itself.

``make_responses_store(config, redis_url, key_prefix)`` chooses one.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from pydantic import BaseModel, Field

from prefix_index.base import ReplicaId

log = logging.getLogger("kvgate.responses")


class ResponsesStoreConfig(BaseModel):
    """The ``responses`` section: where the gateway remembers Responses ids."""

    max_entries: int = Field(default=200_000, ge=1, description="response ids kept per gateway (LRU, ~150 B each)")
    ttl_s: float = Field(default=86400.0, gt=0, description="forget a response id this long after it was created")
    redis_timeout_s: float = Field(default=0.5, gt=0, description="Redis budget per call (pins are worth waiting for)")


class ResponsesStore(Protocol):
    async def put(self, response_id: str, replica: ReplicaId) -> None: ...

    async def get(self, response_id: str) -> ReplicaId | None: ...

    async def delete(self, response_id: str) -> None: ...

    async def close(self) -> None: ...


class MemoryResponsesStore:
    """A bounded LRU with expiry (see the module docstring)."""

    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[str, tuple[ReplicaId, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put_local(self, response_id: str, replica: ReplicaId, ttl_s: float | None = None) -> None:
        entries = self._entries
        entries[response_id] = (replica, self.clock() + (self.ttl_s if ttl_s is None else ttl_s))
        entries.move_to_end(response_id)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def get_local(self, response_id: str) -> ReplicaId | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if entry[1] <= self.clock():
            del self._entries[response_id]
            return None
        self._entries.move_to_end(response_id)
        return entry[0]

    async def put(self, response_id: str, replica: ReplicaId) -> None:
        self.put_local(response_id, replica)

    async def get(self, response_id: str) -> ReplicaId | None:
        return self.get_local(response_id)

    async def delete(self, response_id: str) -> None:
        self._entries.pop(response_id, None)

    async def close(self) -> None:
        return None


class RedisResponsesStore:
    """The embedded LRU in front of a shared Redis (see the module docstring)."""

    def __init__(self, url: str, key_prefix: str, config: ResponsesStoreConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        import redis.asyncio as aioredis  # imported only when a Redis is configured

        self.local = MemoryResponsesStore(config.max_entries, config.ttl_s, clock)
        self.redis: Any = aioredis.from_url(url, socket_timeout=config.redis_timeout_s,
                                            socket_connect_timeout=config.redis_timeout_s)
        self.prefix = f"{key_prefix}:resp:"
        self.ttl_s = config.ttl_s
        self.timeout_s = config.redis_timeout_s
        self.degraded_total = 0

    async def _call(self, what: str, op: Callable[[], Any]) -> Any:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await op()
        except Exception as exc:  # noqa: BLE001 - Redis down or slow: the local copy answers
            self.degraded_total += 1
            log.warning("responses store: redis %s failed (%s: %s); using the local copy", what,
                        type(exc).__name__, exc)
            return None

    async def put(self, response_id: str, replica: ReplicaId) -> None:
        self.local.put_local(response_id, replica)
        ttl = max(1, int(self.ttl_s))
        await self._call("set", lambda: self.redis.set(self.prefix + response_id, replica, ex=ttl))

    async def get(self, response_id: str) -> ReplicaId | None:
        mine = self.local.get_local(response_id)
        if mine is not None:
            return mine
        raw = await self._call("get", lambda: self.redis.get(self.prefix + response_id))
        if raw is None:
            return None
        replica = ReplicaId(raw.decode() if isinstance(raw, bytes) else str(raw))
        self.local.put_local(response_id, replica)
        return replica

    async def delete(self, response_id: str) -> None:
        await self.local.delete(response_id)
        await self._call("delete", lambda: self.redis.delete(self.prefix + response_id))

    async def close(self) -> None:
        await self.redis.aclose()


def make_responses_store(config: ResponsesStoreConfig, redis_url: str | None,
                         key_prefix: str) -> MemoryResponsesStore | RedisResponsesStore:
    """Redis-backed when the gateway has a Redis (``index.redis_url``), else embedded."""
    if redis_url:
        return RedisResponsesStore(redis_url, key_prefix, config)
    return MemoryResponsesStore(config.max_entries, config.ttl_s)
