"""Shared prefix index in Redis: the embedded model, kept server-side, one round trip a call.

Every operation is one Lua script (``redis_scripts.py``; loaded once, called with EVALSHA).
Per replica, ``P:t:<replica>`` maps block -> ``d`` | ``h`` (membership and tier: what
``match`` reads, binary-searching the chain); recency is kept per *segment* of a chain (the
default layout) or per block (``redis_exact_match``). Sessions live in ``P:s:<key>`` plus
``P:sh``/``P:sz`` for ``resident_tokens``, ``P:sx`` the session feed (``redis_sessions.py``:
other gateways' sessions copied locally, so an outage keeps their affinity). Every key but ``P:clock`` and ``P:alive`` has a
TTL. The key layout, the algorithms and measured costs are in docs/redis.md.

Degrade, don't fail: every call is bounded by ``redis_timeout_s``. On an error or a
timeout the backend answers from a local embedded index (``prefix_index.local_index.embedded_index``) that mirrors its own
writes, counts ``degraded_total``, logs once, and pings every ``redis_retry_s`` until
Redis answers. If Redis came back empty (restart), answers also consult the local copy
for ``redis_recovery_merge_s``.

Write-behind (``index.redis_write_behind``): ``record``/``truncate``/``set_session``/
``set_capacity``/``remove_replica`` update the local copy and the pending writes at once
and queue the Redis write (``prefix_index/write_behind.py``: bounded, one drain task, one
pipeline a batch, flushed at ``close``), so no round trip precedes the request's first
byte; ``match`` and ``get_session`` merge what is still pending, so this process reads its
own writes. ``degraded_total`` also counts the writes that never reached Redis (dropped at
the bound or failed). ``published`` is the other gateways' side: the proxy awaits it before
a response's last byte (bounded by ``redis_visible_wait_s``), so the next turn, through any
gateway, finds this one's record in Redis.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import Sequence
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
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
from prefix_index.local_index import EmbeddedIndex, embedded_index
from prefix_index.redis_scripts import CHAIN_SCRIPTS, EXACT_SCRIPTS
from prefix_index.redis_sessions import (
    FEED_BATCH,
    SESSION_FEED_MAX,
    SessionFeed,
    parse_session,
    session_value,
)
from prefix_index.write_behind import PendingWrites, QueuedWrite, WriteQueue

log = logging.getLogger("kvgate.index.redis")

Arg = bytes | str | int | float
CLOSE_FLUSH_S = 5.0
"""Write-behind: at ``close`` the queue gets this long to reach Redis (what is left is
dropped, counted): a full queue of 10,000 writes is ~40 pipelines."""

def pack_hashes(hashes: Sequence[BlockHash]) -> bytes:
    """The chain as one binary string (8 bytes a block): one argument instead of 1,500."""
    return struct.pack(f">{len(hashes)}Q", *hashes)


def make_client(url: str, timeout_s: float, max_connections: int) -> Redis:
    """The backend's client: a bounded, blocking pool (a call beyond ``max_connections``
    waits for a connection within its budget instead of failing), and one retry on a
    fresh connection when a pooled one turns out dead (``ConnectionError``: a restarted
    Redis closed it). Timeouts are not retried: a slow Redis degrades at once."""
    budget = max(timeout_s, 0.001)
    pool = BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=budget * 4,
        socket_timeout=budget * 4, socket_connect_timeout=budget * 4,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
    return Redis.from_pool(pool)


class _Unavailable(Exception):
    """Redis did not answer within budget (internal: callers use the local copy)."""


class RedisPrefixIndex:
    """The Redis backend. Implements ``prefix_index.base.PrefixIndex``.

    ``degraded`` is True while Redis is considered down; ``degraded_total`` counts the
    operations answered (or written) locally because of that, and the writes that never
    reached Redis (write-behind: dropped at the queue bound or failed).
    """

    concurrent_reads = True  # reads are round trips to Redis

    def __init__(self, config: IndexConfig, client: Redis | None = None) -> None:
        if client is None:
            if not config.redis_url:
                raise ValueError("the Redis index needs index.redis_url")
            client = make_client(config.redis_url, config.redis_timeout_s, config.redis_max_connections)
        self._redis = client
        self._cfg = config
        self._p = config.key_prefix
        self._block_ttl_ms = max(int(config.block_ttl_s * 1000), 1)
        self._local = embedded_index(config, chains=not config.redis_exact_match)
        scripts = EXACT_SCRIPTS if config.redis_exact_match else CHAIN_SCRIPTS
        self._scripts = {name: client.register_script(src) for name, src in scripts.items()}
        self.degraded = False
        self._degraded_calls = 0
        self._merge_until = 0.0
        self._feed = SessionFeed(f"{self._p}:sx", config.redis_session_sync_s)
        self._caps: dict[ReplicaId, ReplicaCapacity] = {}  # set_capacity calls, resent if Redis forgot
        self._recovery: asyncio.Task[None] | None = None
        self._pending = PendingWrites(chains=not config.redis_exact_match)
        self._queue = WriteQueue(self._send, config.redis_queue_max, config.redis_flush_interval_s)
        self._late_writes = 0

    @property
    def degraded_total(self) -> int:
        return self._degraded_calls + self._queue.dropped_total + self._queue.failed_total + self._late_writes

    @property
    def dropped_writes_total(self) -> int:
        """Write-behind: writes that never reached Redis (dropped at the bound or failed)."""
        return self._queue.dropped_total + self._queue.failed_total

    @property
    def queued_writes(self) -> int:
        """Write-behind: writes waiting for the drain task now."""
        return len(self._queue)

    @property
    def local(self) -> EmbeddedIndex:
        """The local copy used while degraded (tests and metrics read it)."""
        return self._local

    # -- reads -------------------------------------------------------------------
    async def match(self, hashes: Sequence[BlockHash], replicas: Sequence[ReplicaId]) -> dict[ReplicaId, PrefixMatch]:
        if not hashes or not replicas:
            return {rid: PrefixMatch() for rid in replicas}
        # taken before the read: a write pending now counts even if it is confirmed (and
        # cleared) while the read is in flight; one confirmed before ran before the read
        pending = self._pending.longest(hashes, replicas)
        try:
            script = "match" if self._cfg.redis_exact_match else "match_chain"
            flat = await self._call(script, [self._p, pack_hashes(hashes), "\n".join(replicas)])
        except _Unavailable:
            return self._local.match_now(hashes, replicas)
        out = {rid: PrefixMatch() for rid in replicas}
        for i in range(0, len(flat), 3):
            out[ReplicaId(flat[i].decode())] = PrefixMatch(int(flat[i + 1]), int(flat[i + 2]))
        if self._merging():
            for rid, local in self._local.match_now(hashes, replicas).items():
                if local.blocks > out[rid].blocks:
                    out[rid] = local
        for rid, blocks in pending.items():
            if blocks > out[rid].blocks:  # written here, still queued: as the record will leave it
                out[rid] = self._as_recorded(rid, blocks)
        return out

    def _as_recorded(self, replica: ReplicaId, blocks: int) -> PrefixMatch:
        cap = self._caps.get(replica) or self._cfg.default_capacity
        device = min(blocks, cap.device_blocks)
        return PrefixMatch(device, min(blocks - device, cap.host_blocks))

    async def get_session(self, key: str) -> SessionEntry | None:
        pending = self._pending.session(key)
        if pending is not None:  # written here, still queued: what Redis will hold
            return pending
        try:
            if not self.degraded and self._feed.due():  # every redis_session_sync_s, one read follows the feed
                await self.pull_sessions()
            raw = await self._guard(self._redis.get(f"{self._p}:s:{key}"))
        except _Unavailable:
            return await self._local.get_session(key)
        if raw is None:
            return await self._local.get_session(key) if self._merging() else None
        return parse_session(raw)

    async def resident_tokens(self, now_s: float, window_s: float) -> dict[ReplicaId, int]:
        """From the local copy when it follows the session feed (an O(1) incremental sum;
        the ``resident`` script scans every session in the window: ~1 s of Redis at
        100,000, over any budget); else from Redis."""
        if self._cfg.redis_session_sync_s > 0:
            if not self.degraded and self._feed.due():
                with contextlib.suppress(_Unavailable):
                    await self.pull_sessions()
            return await self._local.resident_tokens(now_s, window_s)
        args: list[Arg] = [self._p, repr(now_s - window_s), repr(now_s - self._cfg.session_ttl_s)]
        try:
            flat = await self._call("resident", args)
        except _Unavailable:
            return await self._local.resident_tokens(now_s, window_s)
        return {ReplicaId(flat[i].decode()): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def stats(self) -> IndexStats:
        await self.flush()  # (write-behind) counts what this process wrote; off the request path
        try:
            flat = await self._call("stats", [self._p])
        except _Unavailable:
            return await self._local.stats()
        rows = flat[2:]
        device = {ReplicaId(rows[i].decode()): int(rows[i + 1]) for i in range(0, len(rows), 3)}
        host = {ReplicaId(rows[i].decode()): int(rows[i + 2]) for i in range(0, len(rows), 3)}
        return IndexStats(device_blocks=device, host_blocks=host, sessions=int(flat[0]),
                          session_evictions=int(flat[1]))

    async def pull_sessions(self) -> int:
        """Merge the session writes of every gateway since the last pull into the local
        copy (``redis_sessions.SessionFeed``); how many entries were newer than ours."""
        reply = await self._guard(self._redis.xread({self._feed.key: self._feed.last_id}, count=FEED_BATCH))
        return self._feed.merge(reply, self._local.sessions)

    # -- writes ------------------------------------------------------------------
    async def record(self, replica: ReplicaId, hashes: Sequence[BlockHash]) -> None:
        self._local.record_now(replica, hashes)
        cfg = self._cfg
        args: list[Arg] = [
            self._p, replica, pack_hashes(hashes), cfg.default_device_blocks, cfg.default_host_blocks,
            self._block_ttl_ms,
        ]
        if cfg.redis_write_behind:
            if self._behind():
                seq = self._pending.add_chain(replica, hashes)
                self._queue.put(QueuedWrite("record", args, lambda sized: self._recorded(replica, seq, sized)))
            return
        await self._recorded_now(replica, await self._write("record", args))

    def _recorded(self, replica: ReplicaId, seq: int, sized: object | None) -> None:
        self._pending.chain_done(replica, seq)
        if sized == 0 and replica in self._caps:  # Redis lost the capacity (restart, expiry): resend
            self._enqueue("capacity", self._capacity_args(replica, self._caps[replica]))

    async def _recorded_now(self, replica: ReplicaId, sized: object | None) -> None:
        if sized == 0 and replica in self._caps:
            await self.set_capacity(replica, self._caps[replica])

    async def truncate(self, replica: ReplicaId, hashes: Sequence[BlockHash], keep_blocks: int) -> None:
        await self._local.truncate(replica, hashes, keep_blocks)
        self._pending.truncate(replica, hashes, keep_blocks)
        cfg = self._cfg
        keep = max(keep_blocks, 0)
        defaults = [cfg.default_device_blocks, cfg.default_host_blocks]
        if cfg.redis_exact_match:  # forgets the listed blocks
            await self._write("truncate", [self._p, replica, pack_hashes(hashes[keep:]), *defaults])
        else:  # walks the chain's segments from block 0
            await self._write("truncate", [self._p, replica, pack_hashes(hashes), keep, *defaults])

    async def set_capacity(self, replica: ReplicaId, capacity: ReplicaCapacity) -> None:
        self._caps[replica] = capacity
        await self._local.set_capacity(replica, capacity)
        await self._write("capacity", self._capacity_args(replica, capacity))

    def _capacity_args(self, replica: ReplicaId, capacity: ReplicaCapacity) -> list[Arg]:
        return [self._p, replica, capacity.device_blocks, capacity.host_blocks, self._block_ttl_ms]

    async def remove_replica(self, replica: ReplicaId) -> None:
        self._caps.pop(replica, None)
        await self._local.remove_replica(replica)
        self._pending.forget_replica(replica)
        await self._write("remove", [self._p, replica])

    async def set_session(self, key: str, entry: SessionEntry) -> None:
        await self._local.set_session(key, entry)
        ttl_ms = max(int(self._cfg.session_ttl_s * 1000), 1)
        args: list[Arg] = [self._p, key, session_value(entry), repr(entry.last_seen_s), ttl_ms,
                           self._cfg.max_sessions, SESSION_FEED_MAX]
        if self._cfg.redis_write_behind:
            if self._behind():
                seq = self._pending.add_session(key, entry)
                self._queue.put(QueuedWrite("session", args, lambda _: self._pending.session_done(key, seq)))
            return
        await self._write("session", args)

    async def flush(self) -> None:
        """Wait until every queued write (write-behind mode) has been sent."""
        await self._queue.flush()

    async def published(self) -> bool:
        """Write-behind: wait until every write this process queued before the call has
        reached Redis (or failed), at most ``redis_visible_wait_s``. The gateway awaits it
        before a response's last byte, so a turn's record is visible to every other gateway
        before the client can send its next turn. Returns at once when nothing queued
        before is still waiting (the usual case: the write left 2 ms after routing, long
        before the answer). False when the bound was hit, counted in ``late_writes_total``
        and ``degraded_total``."""
        wait_s = self._cfg.redis_visible_wait_s
        if wait_s <= 0 or await self._queue.settled(wait_s):
            return True
        self._late_writes += 1
        return False

    @property
    def late_writes_total(self) -> int:
        """Responses whose last byte went out before this process's earlier writes reached
        Redis (``published`` hit its bound)."""
        return self._late_writes

    async def close(self) -> None:
        await self._queue.close(CLOSE_FLUSH_S)
        if self._recovery is not None:
            self._recovery.cancel()
            await asyncio.gather(self._recovery, return_exceptions=True)
        self._recovery = None
        await self._redis.aclose()

    # -- internals -----------------------------------------------------------------
    async def _write(self, script: str, args: list[Arg]) -> Any:
        """Run (or, write-behind, enqueue) a write; the script's answer when it ran now."""
        if self._cfg.redis_write_behind:
            self._enqueue(script, args)
            return None
        with contextlib.suppress(_Unavailable):  # the local copy has it; Redis is a cache
            return await self._call(script, args)
        return None

    def _behind(self) -> bool:
        """Write-behind: True if a write should be queued now (not while degraded: counted)."""
        if self.degraded:
            self._degraded_calls += 1
            return False
        return True

    def _enqueue(self, script: str, args: list[Arg]) -> None:
        if self._behind():
            self._queue.put(QueuedWrite(script, args))

    async def _send(self, batch: Sequence[QueuedWrite]) -> Sequence[object] | None:
        """One pipeline for the batch (the drain task's ``send``); None when not delivered."""
        if self.degraded:
            return None
        pipe = self._redis.pipeline(transaction=False)
        for write in batch:
            await self._scripts[write.name](args=write.args, client=pipe)
        try:
            results: list[object] = await self._guard(pipe.execute(raise_on_error=False), scale=4.0)
        except _Unavailable:
            return None
        return results

    async def _call(self, script: str, args: list[Arg]) -> Any:
        return await self._guard(self._scripts[script](args=args))

    async def _guard(self, awaitable: Any, scale: float = 1.0) -> Any:
        """Await a Redis call within budget; on failure enter degraded mode."""
        if self.degraded:
            awaitable.close()  # never started: do not leave a coroutine un-awaited
            self._degraded_calls += 1
            raise _Unavailable
        try:
            async with asyncio.timeout(self._cfg.redis_timeout_s * scale):  # no extra Task, unlike wait_for
                return await awaitable
        except (RedisError, OSError) as exc:  # TimeoutError is an OSError
            self._enter_degraded(exc)
            raise _Unavailable from exc

    def _enter_degraded(self, exc: BaseException) -> None:
        self._degraded_calls += 1
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
                await self._reload_scripts()
            self.degraded = False
            log.warning("Redis index available again%s", "" if marker else " (it came back empty)")
            if marker is None:  # it forgot every replica's capacity too
                for rid, cap in list(self._caps.items()):
                    await self._write("capacity", [self._p, rid, cap.device_blocks, cap.host_blocks, self._block_ttl_ms])
            return

    async def _reload_scripts(self) -> None:
        """A restarted Redis forgot the scripts: load them once here, not once per connection
        (each pooled connection's first EVALSHA would otherwise pay NOSCRIPT + SCRIPT LOAD)."""
        with contextlib.suppress(RedisError, OSError):  # EVALSHA still falls back to loading
            async with asyncio.timeout(self._cfg.redis_timeout_s * 4):
                for script in self._scripts.values():
                    await self._redis.script_load(script.script)

    def _merging(self) -> bool:
        return self._merge_until > 0.0 and time.monotonic() < self._merge_until
