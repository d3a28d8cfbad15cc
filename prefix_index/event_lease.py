"""Precise mode with several gateways on one Redis: each replica's KV events consumed once.

One gateway per replica holds a *lease* (``{prefix}:kvlease:{replica}`` = its owner id,
with a TTL of ``index.event_lease_ttl_s``, renewed every third of it). The holder alone
subscribes to the replica's ZMQ stream; it applies each batch to its own embedded
``EventBlockIndex`` and *relays* it into a Redis stream (``{prefix}:kvevents:{replica}``,
capped at ``RELAY_MAXLEN`` entries); every other gateway reads that stream and applies
the same batches to its own index. When the holder dies its lease lapses and another
gateway takes it over: it first drains the relay stream, then subscribes with its
sequence tracker set after the last relayed seq per DP rank, so a batch lost in the
hand-over is a *gap* (replayed when the replica advertises replay, else the replica is
uncertain), never a silent hole.

Entries: ``{"seq", "rank", "kind": "batch"|"lost"|"restart", "payload": msgpack}``.

What is *not* shared: the index itself (each gateway keeps an embedded copy: the stream
keeps the copies equal, and a gateway that joins late rebuilds from the stream's retained
history, which the deepest-page match tolerates).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger("kvgate.precise.lease")
RELAY_MAXLEN = 100_000
READ_BLOCK_MS = 500

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True, slots=True)
class RelayEntry:
    id: str
    kind: str  # "batch" | "lost" | "restart"
    rank: int
    seq: int
    payload: bytes


class EventLease:
    """The per-replica lease and relay stream of one gateway (``owner``) on a Redis."""

    def __init__(self, client: aioredis.Redis, owner: str, *, key_prefix: str = "kvgate",
                 ttl_s: float = 5.0) -> None:
        self.client = client
        self.owner = owner
        self.key_prefix = key_prefix
        self.ttl_ms = max(int(ttl_s * 1000), 1)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    @classmethod
    def from_url(cls, url: str, owner: str, *, key_prefix: str = "kvgate", ttl_s: float = 5.0) -> EventLease:
        return cls(aioredis.Redis.from_url(url), owner, key_prefix=key_prefix, ttl_s=ttl_s)

    def _lease_key(self, replica: str) -> str:
        return f"{self.key_prefix}:kvlease:{replica}"

    def _stream_key(self, replica: str) -> str:
        return f"{self.key_prefix}:kvevents:{replica}"

    @property
    def renew_interval_s(self) -> float:
        return self.ttl_ms / 3000

    async def hold(self, replica: str) -> bool:
        """Take or renew the replica's lease; True when this gateway holds it (False on Redis errors)."""
        try:
            return bool(await self._renew(keys=[self._lease_key(replica)], args=[self.owner, self.ttl_ms]))
        except RedisError as exc:
            log.warning("event lease for %s: %s", replica, exc)
            return False

    async def release(self, replica: str) -> None:
        try:
            await self._release(keys=[self._lease_key(replica)], args=[self.owner])
        except RedisError as exc:
            log.warning("event lease release for %s: %s", replica, exc)

    async def holder(self, replica: str) -> str | None:
        value = await self.client.get(self._lease_key(replica))
        return value.decode() if isinstance(value, bytes) else None

    async def relay(self, replica: str, kind: str, rank: int, seq: int, payload: bytes = b"") -> None:
        """Append one entry to the replica's relay stream (errors logged: followers see a gap)."""
        fields: Any = {"kind": kind, "rank": rank, "seq": seq, "payload": payload}
        try:
            await self.client.xadd(self._stream_key(replica), fields, maxlen=RELAY_MAXLEN, approximate=True)
        except RedisError as exc:
            log.warning("event relay for %s: %s", replica, exc)

    async def read(self, replica: str, after: str, block_ms: int | None = READ_BLOCK_MS,
                   count: int = 1000) -> list[RelayEntry]:
        """Entries after id ``after`` ("0-0": from the start), waiting up to ``block_ms``."""
        reply: Any = await self.client.xread({self._stream_key(replica): after}, count=count, block=block_ms)
        out: list[RelayEntry] = []
        for _key, entries in reply or []:
            for entry_id, fields in entries:
                out.append(RelayEntry(entry_id.decode(), fields[b"kind"].decode(), int(fields[b"rank"]),
                                      int(fields[b"seq"]), bytes(fields[b"payload"])))
        return out

    async def clear(self, replica: str) -> None:
        """The replica left the fleet: drop its relay stream."""
        try:
            await self.client.delete(self._stream_key(replica))
        except RedisError as exc:
            log.warning("event relay clear for %s: %s", replica, exc)

    async def close(self) -> None:
        await self.client.aclose()


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds``; True when ``stop`` was set meanwhile."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        return False
    return True
