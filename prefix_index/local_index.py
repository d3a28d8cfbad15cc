"""Which in-process index a kind of hash list gets (the gateway's backend, the Redis
backend's local copy, the fleet simulator), and for chains its representation by fleet size.

``FleetSizedIndex`` is the embedded index for hash chains: the segment index
(``segments.py``: Python objects per recorded chain, the fastest below a few dozen
replicas) until it holds ``COMPACT_FROM_REPLICAS`` replicas, then the compact one
(``compact.py``: flat numpy arrays, ~18 B a held block and a lookup that does not walk
every replica) from then on. The switch happens once, inside the write that adds the
replica reaching the threshold: every replica's recency list, tiers and truncation gaps
are copied over (``SegmentPrefixIndex.lanes`` -> ``CompactPrefixIndex.load``) and the
session table is handed over as it is, so answers are the same before and after. It
never switches back (the compact index serves any fleet size; a fleet that shrinks and
grows again would otherwise pay the copy each time). Why two representations and why 32:
docs/benchmarks.md, "512 replicas on the default index".
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from prefix_index.base import BlockHash, PrefixMatch, ReplicaCapacity, ReplicaId
from prefix_index.compact import CompactPrefixIndex
from prefix_index.config import IndexConfig
from prefix_index.embedded import EmbeddedMethods
from prefix_index.memory import DEFAULT_CAPACITY, MemoryPrefixIndex
from prefix_index.segments import SegmentPrefixIndex
from prefix_index.session_table import DEFAULT_MAX_SESSIONS

COMPACT_FROM_REPLICAS = 32
"""From this many replicas the compact representation is used. Below it the segment index
is several times faster; its memory (~100 B a held block against ~18) and its lookup grow
with every replica, and the one-time conversion copies all it holds, so the threshold is
the smallest fleet at which the compact index is comfortably inside the 5 ms decision
budget (docs/benchmarks.md, section 5.1, "Why two representations, and why 32")."""


class FleetSizedIndex(EmbeddedMethods):
    """The embedded backend for hash chains (default). Implements
    ``prefix_index.base.PrefixIndex``; its representation follows the fleet size
    (module docstring)."""

    def __init__(
        self,
        session_ttl_s: float = 3600.0,
        default_capacity: ReplicaCapacity = DEFAULT_CAPACITY,
        clock: Callable[[], float] = time.monotonic,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        compact_from: int = COMPACT_FROM_REPLICAS,
    ) -> None:
        self._segments: SegmentPrefixIndex | None = SegmentPrefixIndex(
            session_ttl_s, default_capacity, clock, max_sessions=max_sessions)
        self._rep: SegmentPrefixIndex | CompactPrefixIndex = self._segments
        self._compact_args = (session_ttl_s, default_capacity, clock, max_sessions)
        self._compact_from = compact_from
        self.sessions = self._rep.sessions

    @property
    def representation(self) -> str:
        """``segments`` or ``compact``: what holds the blocks now."""
        return "segments" if self._segments is not None else "compact"

    def match_now(self, hashes: Sequence[BlockHash], replicas: Sequence[ReplicaId]) -> dict[ReplicaId, PrefixMatch]:
        return self._rep.match_now(hashes, replicas)

    def record_now(self, replica: ReplicaId, hashes: Sequence[BlockHash]) -> None:
        self._rep.record_now(replica, hashes)
        self._grown()

    def tier_blocks(self) -> dict[ReplicaId, tuple[int, int]]:
        return self._rep.tier_blocks()

    async def truncate(self, replica: ReplicaId, hashes: Sequence[BlockHash], keep_blocks: int) -> None:
        await self._rep.truncate(replica, hashes, keep_blocks)

    async def set_capacity(self, replica: ReplicaId, capacity: ReplicaCapacity) -> None:
        await self._rep.set_capacity(replica, capacity)
        self._grown()

    async def remove_replica(self, replica: ReplicaId) -> None:
        await self._rep.remove_replica(replica)

    def _grown(self) -> None:
        """After a write that may have added a replica: switch at the threshold."""
        segments = self._segments
        if segments is None or segments.replica_count() < self._compact_from:
            return
        ttl_s, default, clock, max_sessions = self._compact_args
        compact = CompactPrefixIndex(ttl_s, default, clock, max_sessions=max_sessions)
        compact.sessions = self.sessions  # the same table: sessions are not copied
        for rid, capacity, blocks, gaps in segments.lanes():
            compact.load(rid, capacity, blocks, gaps)
        self._rep, self._segments = compact, None


EmbeddedIndex = FleetSizedIndex | MemoryPrefixIndex


def embedded_index(config: IndexConfig, chains: bool = True,
                   clock: Callable[[], float] = time.monotonic) -> EmbeddedIndex:
    """The in-process index: for hash chains (block k's hash names blocks 0..k, as the
    gateway's are) the fleet-sized one (segments, then compact from
    ``COMPACT_FROM_REPLICAS`` replicas); for arbitrary hash lists (the Redis backend's
    local copy with ``redis_exact_match``) the per-block walk."""
    if chains:
        return FleetSizedIndex(config.session_ttl_s, config.default_capacity, clock, max_sessions=config.max_sessions)
    return MemoryPrefixIndex(config.session_ttl_s, config.default_capacity, clock, max_sessions=config.max_sessions)
