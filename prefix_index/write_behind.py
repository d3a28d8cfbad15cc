"""Write-behind for a remote index: its writes leave the path to the first byte.

Why: with the Redis backend every routed request awaited ``record`` and ``set_session``
(two round trips, plus Redis's own time for the chain) before the proxy sent it
upstream. With write-behind (``index.redis_write_behind``) the backend queues the remote
write and returns; one task sends the queue in order, pipelined, while the request is
already on its way.

What stays synchronous: the *local* effect of a decision, so that concurrent decisions
still see the earlier ones (no herding on a stale index):

- the backend's local copy (a ``MemoryPrefixIndex``) takes every write at once, as it
  always did (it answers while Redis is down);
- ``PendingWrites``: the writes queued or in flight. The backend's ``match`` answers, per
  replica, the longer of Redis's match and the pending chains' (as the record will leave
  it: device first, within the replica's capacity), and ``get_session`` answers a
  pending session without asking Redis. So a session's next request arriving while the
  previous one's write is still queued goes the same way, and new sessions sharing a
  prefix see each other's placement. Other gateways see a write once it is flushed
  (``redis_flush_interval_s`` plus one round trip later).

The queue (``WriteQueue``):

- bounded (``index.redis_queue_max``): one write more drops the oldest queued write,
  counted in ``dropped_total`` (and by the backend as degraded). It never blocks the
  caller and never grows past the bound.
- one drain task at a time, started by a write when none runs, ending when the queue is
  empty (an idle index holds no task): it waits ``delay_s`` so a batch gathers, then hands up to ``batch`` writes, oldest first, to ``send`` (one
  pipeline). ``send`` answers one result per write (an exception instance for a write
  that failed alone), or None when the batch was not delivered (Redis down or slow): the
  batch is counted in ``failed_total`` and dropped (the local copy has it; Redis is a cache).
- each write's ``done`` callback gets its result (None when dropped or failed): the
  backend clears the pending entry there, and resends a capacity Redis forgot.
- ``flush()`` returns once every write queued before it has been sent; ``close()``
  flushes within ``timeout_s`` and stops the task. The gateway's shutdown closes the index.
- ``settled(timeout_s)`` waits until every write queued before the call has left the
  queue (sent, failed or dropped), at most ``timeout_s``; it cuts the drain task's
  ``delay_s`` short (a response is waiting: no batch is worth that) but sends nothing
  itself. The gateway awaits it before a response's last byte (``RedisPrefixIndex.published``).
  Writes leave the queue in FIFO order, so one counter (``finished_total``) says which
  have: write n (counting from 1) has left once ``finished_total >= n``.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prefix_index.base import BlockHash, ReplicaId, SessionEntry, common_chain_prefix

log = logging.getLogger("kvgate.index.write_behind")

Done = Callable[[object | None], None]


@dataclass(frozen=True, slots=True)
class QueuedWrite:
    """One remote write: an operation name (the Redis script), its arguments, a callback."""

    name: str
    args: Sequence[Any]
    done: Done | None = None


Send = Callable[[Sequence[QueuedWrite]], Awaitable[Sequence[object] | None]]


def common_prefix(a: Sequence[BlockHash], b: Sequence[BlockHash], b_len: int, chains: bool) -> int:
    """How many leading blocks of ``a`` the chain ``b[:b_len]`` holds.

    With ``chains`` (chained hashes: block k equal implies blocks 0..k equal) a binary
    search for the first differing block; otherwise (exact match: any hash list) the
    leading blocks of ``a`` that are anywhere in ``b[:b_len]``, as the exact-match script
    counts them."""
    if chains:
        return common_chain_prefix(a, b, b_len)
    held = set(b[:b_len])
    k = 0
    while k < len(a) and a[k] in held:
        k += 1
    return k


class PendingWrites:
    """The chains and sessions this process wrote that the remote index may not hold yet.

    Entries carry a sequence number; ``chain_done`` / ``session_done`` remove exactly the
    entry they were given, so a newer pending write of the same key stays."""

    def __init__(self, chains: bool = True) -> None:
        self._assume_chains = chains
        self._seq = 0
        self._chains: dict[ReplicaId, dict[int, tuple[Sequence[BlockHash], int]]] = {}
        self._sessions: dict[str, tuple[int, SessionEntry]] = {}

    def __len__(self) -> int:
        return sum(len(c) for c in self._chains.values()) + len(self._sessions)

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def add_chain(self, replica: ReplicaId, hashes: Sequence[BlockHash]) -> int:
        seq = self._next()
        self._chains.setdefault(replica, {})[seq] = (hashes, len(hashes))
        return seq

    def chain_done(self, replica: ReplicaId, seq: int) -> None:
        chains = self._chains.get(replica)
        if chains is not None:
            chains.pop(seq, None)
            if not chains:
                del self._chains[replica]

    def truncate(self, replica: ReplicaId, hashes: Sequence[BlockHash], keep_blocks: int) -> None:
        """A pending chain sharing more than ``keep_blocks`` with ``hashes`` is cut there."""
        keep = max(keep_blocks, 0)
        for seq, (chain, length) in list(self._chains.get(replica, {}).items()):
            if common_prefix(hashes, chain, length, self._assume_chains) > keep:
                self._chains[replica][seq] = (chain, keep)

    def add_session(self, key: str, entry: SessionEntry) -> int:
        seq = self._next()
        self._sessions[key] = (seq, entry)
        return seq

    def session_done(self, key: str, seq: int) -> None:
        current = self._sessions.get(key)
        if current is not None and current[0] == seq:
            del self._sessions[key]

    def session(self, key: str) -> SessionEntry | None:
        current = self._sessions.get(key)
        return current[1] if current is not None else None

    def forget_replica(self, replica: ReplicaId) -> None:
        self._chains.pop(replica, None)
        for key in [k for k, (_, e) in self._sessions.items() if e.replica == replica]:
            del self._sessions[key]

    def longest(self, hashes: Sequence[BlockHash], replicas: Sequence[ReplicaId]) -> dict[ReplicaId, int]:
        """Per replica with pending chains, the longest prefix of ``hashes`` they hold."""
        out: dict[ReplicaId, int] = {}
        if not self._chains or not hashes:
            return out
        for rid in replicas:
            chains = self._chains.get(rid)
            if chains:
                best = max(common_prefix(hashes, c, n, self._assume_chains) for c, n in chains.values())
                if best:
                    out[rid] = best
        return out


class WriteQueue:
    """A bounded FIFO of remote writes drained by one task, in batches (see module doc)."""

    def __init__(self, send: Send, max_items: int, delay_s: float, batch: int = 256) -> None:
        self._send = send
        self._max = max(max_items, 1)
        self._delay_s = delay_s
        self._batch = max(batch, 1)
        self._queue: deque[QueuedWrite] = deque()
        self._lock = asyncio.Lock()  # one batch in flight at a time: FIFO order holds
        self._task: asyncio.Task[None] | None = None
        self.queued_total = 0
        self.sent_total = 0
        self.dropped_total = 0  # beyond the bound
        self.failed_total = 0  # not delivered (a failed batch, or a write that failed alone)
        self.finished_total = 0  # left the queue, in FIFO order: sent, failed or dropped
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()  # (mark, waiter), marks ascending
        self._kick = asyncio.Event()  # a waiter is waiting: send now, do not wait for a batch to gather

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, write: QueuedWrite) -> None:
        """Queue ``write`` (never blocks); when full, the oldest queued write is dropped."""
        if len(self._queue) >= self._max:
            self.dropped_total += 1
            self._finished(self._queue.popleft(), None)
            self._wake()
        self._queue.append(write)
        self.queued_total += 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain(), name="index-write-behind")

    async def flush(self) -> None:
        """Return once every write queued before this call has been sent (or failed)."""
        while self._queue:
            await self._send_batch()
        async with self._lock:  # a batch the drain task has in flight
            pass

    async def settled(self, timeout_s: float) -> bool:
        """Wait until every write queued before this call has left the queue (sent, failed
        or dropped), at most ``timeout_s``; False if it had not by then. Returns at once,
        without suspending, when they already have (the usual case)."""
        mark = self.queued_total
        if self.finished_total >= mark:
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((mark, waiter))
        self._kick.set()
        try:
            async with asyncio.timeout(timeout_s):
                await waiter
        except TimeoutError:
            return False
        finally:
            if not waiter.done():
                waiter.cancel()  # (pruned by the next _wake)
        return True

    def _finished(self, write: QueuedWrite, result: object | None) -> None:
        self.finished_total += 1
        _finish(write, result)

    def _wake(self) -> None:
        """Release the waiters whose writes have all left the queue (and drop cancelled ones)."""
        waiters = self._waiters
        while waiters and (waiters[0][0] <= self.finished_total or waiters[0][1].done()):
            _, waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    async def close(self, timeout_s: float) -> None:
        """Flush within ``timeout_s`` (what is left then is dropped, counted), stop the task."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.flush()
        except TimeoutError:
            left = len(self._queue)
            log.warning("index write-behind: %d write(s) not flushed within %.1fs at shutdown", left, timeout_s)
            while self._queue:
                self.dropped_total += 1
                self._finished(self._queue.popleft(), None)
            self._wake()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _drain(self) -> None:
        """Runs while there is something to send, then ends (``put`` starts the next one):
        an idle index holds no task, so nothing is left pending at shutdown."""
        if not self._kick.is_set():  # let a batch gather, unless someone waits for it
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._delay_s):
                    await self._kick.wait()
        while self._queue:
            self._kick.clear()
            await self._send_batch()
        self._kick.clear()

    async def _send_batch(self) -> None:
        async with self._lock:
            if not self._queue:
                return
            batch = [self._queue.popleft() for _ in range(min(self._batch, len(self._queue)))]
            try:
                results = await self._send(batch)
            except Exception:  # a bug in send: count the batch as failed, keep draining
                log.exception("index write-behind: sending %d write(s) failed", len(batch))
                results = None
            if results is None:
                self.failed_total += len(batch)
                for write in batch:
                    self._finished(write, None)
            else:
                for write, result in zip(batch, results, strict=True):
                    if isinstance(result, Exception):
                        self.failed_total += 1
                        log.warning("index write %s failed: %s: %s", write.name, type(result).__name__, result)
                        result = None
                    else:
                        self.sent_total += 1
                    self._finished(write, result)
            self._wake()


def _finish(write: QueuedWrite, result: object | None) -> None:
    if write.done is None:
        return
    try:
        write.done(result)
    except Exception:  # a callback's bug must not stop the queue
        log.exception("index write-behind: callback of %s failed", write.name)
