"""Which in-process index a kind of hash list gets (the gateway's backend, the Redis
backend's local copy, the fleet simulator), and for chains its representation by fleet size.

``FleetSizedIndex`` is the embedded index for hash chains: the segment index
(``segments.py``: Python objects per recorded chain, the fastest below a few dozen
replicas) until it holds ``COMPACT_FROM_REPLICAS`` replicas, then the compact one
(``compact.py``: flat numpy arrays, ~18 B a held block and a lookup that does not walk
every replica) from then on. The switch starts once, at the write that adds the replica
reaching the threshold, and moves **one replica per write** from then on: its recency
list, tiers and truncation gaps are copied over (``SegmentPrefixIndex.pop_lane`` ->
``CompactPrefixIndex.load``) while each replica is answered by the representation that
holds it (a match asks both for their own replicas; a new replica starts in the compact
one), and the session table is shared as it is, so answers are the same before, during and
after. Copying all 31 full replicas in one write blocked the event loop for 1.6 s; one
replica is ~1/31 of it (docs/benchmarks.md 5.1). It never switches back (the compact index serves any fleet size; a fleet that shrinks and
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
        # replicas not moved yet (None once all are) and the compact index (None before the switch)
        self._segments: SegmentPrefixIndex | None = SegmentPrefixIndex(
            session_ttl_s, default_capacity, clock, max_sessions=max_sessions)
        self._compact: CompactPrefixIndex | None = None
        self._compact_args = (session_ttl_s, default_capacity, clock, max_sessions)
        self._compact_from = compact_from
        self.sessions = self._segments.sessions

    @property
    def representation(self) -> str:
        """``segments``, ``moving`` (replicas going over one per write) or ``compact``."""
        return "segments" if self._compact is None else "compact" if self._segments is None else "moving"

    def _holder(self, replica: ReplicaId) -> SegmentPrefixIndex | CompactPrefixIndex:
        """The representation that holds ``replica`` (a new one: the newer representation)."""
        segments, compact = self._segments, self._compact
        if compact is None or (segments is not None and segments.holds(replica)):
            assert segments is not None
            return segments
        return compact

    def match_now(self, hashes: Sequence[BlockHash], replicas: Sequence[ReplicaId]) -> dict[ReplicaId, PrefixMatch]:
        segments, compact = self._segments, self._compact
        if compact is None:
            assert segments is not None
            return segments.match_now(hashes, replicas)
        if segments is None:
            return compact.match_now(hashes, replicas)
        old: list[ReplicaId] = []
        new: list[ReplicaId] = []
        for r in replicas:
            (old if segments.holds(r) else new).append(r)
        found = segments.match_now(hashes, old) if old else {}
        if new:
            found.update(compact.match_now(hashes, new))
        return {r: found[r] for r in replicas}

    def record_now(self, replica: ReplicaId, hashes: Sequence[BlockHash]) -> None:
        self._holder(replica).record_now(replica, hashes)
        self._grown()

    def tier_blocks(self) -> dict[ReplicaId, tuple[int, int]]:
        segments, compact = self._segments, self._compact
        return {**(segments.tier_blocks() if segments else {}), **(compact.tier_blocks() if compact else {})}

    async def truncate(self, replica: ReplicaId, hashes: Sequence[BlockHash], keep_blocks: int) -> None:
        await self._holder(replica).truncate(replica, hashes, keep_blocks)

    async def set_capacity(self, replica: ReplicaId, capacity: ReplicaCapacity) -> None:
        await self._holder(replica).set_capacity(replica, capacity)
        self._grown()

    async def remove_replica(self, replica: ReplicaId) -> None:
        await self._holder(replica).remove_replica(replica)

    def _grown(self) -> None:
        """After a write: start the switch at the threshold, then move one replica over."""
        segments = self._segments
        if segments is None:
            return
        if self._compact is None:
            if segments.replica_count() < self._compact_from:
                return
            ttl_s, default, clock, max_sessions = self._compact_args
            self._compact = CompactPrefixIndex(ttl_s, default, clock, max_sessions=max_sessions)
            self._compact.sessions = self.sessions  # the same table: sessions are not copied
        if segments.replica_count():
            self._compact.load(*segments.pop_lane())
        if not segments.replica_count():
            self._segments = None


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
