"""The contract of a prefix index backend (embedded and Redis implement the same one).

Vocabulary
- A *block* is a run of the request's canonical text of ``block_chars`` characters
  (~64 tokens' worth). Its ``BlockHash`` is chained: block k's hash covers blocks 0..k,
  so "replica R holds block k" implies "R holds the whole prefix up to k".
- Per replica the index keeps an LRU of blocks split into two estimated tiers, device
  (GPU KV pool) and host (HiCache), sized from what the replica reports. Recording a
  chain puts it at the device MRU end; device overflow demotes LRU blocks to host; host
  overflow drops them.
- The *session table* maps a session key (header or ``user``) to the replica that
  served its last turn, with the turn's size, so policies can honour affinity and
  account for each replica's resident working set (sessions between turns).

All methods are async so the Redis backend can implement them without blocking; the
embedded backend answers without awaiting anything. Backends never raise on unknown
replicas or sessions: they return empty answers.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType, Protocol, runtime_checkable

ReplicaId = NewType("ReplicaId", str)
"""A replica's URL exactly as configured (e.g. ``http://127.0.0.1:31001``)."""

BlockHash = int
"""Unsigned 64-bit chained block hash."""


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of a request's block chain one replica holds, as a contiguous prefix.

    ``device_blocks + host_blocks`` is the length of the longest matched prefix; of
    those, ``host_blocks`` are estimated to sit in the host tier (load cost instead of
    recompute).
    """

    device_blocks: int = 0
    host_blocks: int = 0

    @property
    def blocks(self) -> int:
        return self.device_blocks + self.host_blocks


@dataclass(frozen=True, slots=True)
class ReplicaCapacity:
    """Capacity of one replica's cache, in blocks (the gateway converts from tokens)."""

    device_blocks: int
    host_blocks: int = 0


@dataclass(frozen=True, slots=True)
class SessionEntry:
    """The last routing of a session: where, how big (in estimated tokens), when."""

    replica: ReplicaId
    tokens: int
    last_seen_s: float  # wall-clock seconds (time.time()) so several processes agree


@dataclass(frozen=True, slots=True)
class IndexStats:
    """Sizes for metrics: blocks held per replica (device, host), the session count and
    the cumulative number of sessions the table's size bound evicted (not expiries)."""

    device_blocks: dict[ReplicaId, int] = field(default_factory=dict)
    host_blocks: dict[ReplicaId, int] = field(default_factory=dict)
    sessions: int = 0
    session_evictions: int = 0


@runtime_checkable
class PrefixIndex(Protocol):
    """One interface, two backends; one contract test suite runs against both."""

    #: True when reads wait on the network (Redis): callers then run independent reads
    #: concurrently. In-process backends answer without waiting (False).
    concurrent_reads: bool

    async def match(
        self, hashes: Sequence[BlockHash], replicas: Sequence[ReplicaId]
    ) -> dict[ReplicaId, PrefixMatch]:
        """Longest matched prefix of ``hashes`` for each of ``replicas``.

        ``hashes`` is a chain: holding block k implies holding blocks 0..k-1 (backends
        may rely on it to search instead of checking every block).

        Every replica asked for appears in the answer (``PrefixMatch()`` when nothing
        matches). Pure read: does not touch LRU order.
        """
        ...

    async def record(self, replica: ReplicaId, hashes: Sequence[BlockHash]) -> None:
        """The replica now holds this chain (called after routing: predict-on-route).

        Moves the chain to the device MRU end, demoting/evicting per capacity.
        """
        ...

    async def truncate(self, replica: ReplicaId, hashes: Sequence[BlockHash], keep_blocks: int) -> None:
        """Feedback: the replica really held only ``keep_blocks`` of this chain.

        Forget this replica's blocks ``hashes[keep_blocks:]``.
        """
        ...

    async def set_capacity(self, replica: ReplicaId, capacity: ReplicaCapacity) -> None:
        """Size (or resize) a replica's LRU; evicts if it shrank. Adds the replica."""
        ...

    async def remove_replica(self, replica: ReplicaId) -> None:
        """Forget everything about a replica (its blocks and the sessions pointing at it)."""
        ...

    async def get_session(self, key: str) -> SessionEntry | None:
        """The session's last routing, or None (unknown or expired)."""
        ...

    async def set_session(self, key: str, entry: SessionEntry) -> None:
        """Remember a session's routing (expires after the backend's session TTL).

        The table holds at most the backend's ``max_sessions``: one more evicts the least
        recently set session (counted in ``IndexStats.session_evictions``).
        """
        ...

    async def resident_tokens(self, now_s: float, window_s: float) -> dict[ReplicaId, int]:
        """Per replica, the summed ``tokens`` of sessions seen within ``window_s``.

        The *resident working set*: KV of sessions between turns that will come back.
        """
        ...

    async def stats(self) -> IndexStats:
        ...

    async def close(self) -> None:
        ...


def common_chain_prefix(a: Sequence[BlockHash] | Sequence[int], b: Sequence[BlockHash] | Sequence[int],
                        b_len: int | None = None) -> int:
    """Length of the common prefix of two chains of block hashes (of ``b[:b_len]`` when
    given). Chained hashes: equal at block k means equal at every block before, so a
    binary search for the first differing block is exact."""
    n = min(len(a), len(b) if b_len is None else min(b_len, len(b)))
    return bisect_left(range(n), True, key=lambda k: a[k] != b[k])
