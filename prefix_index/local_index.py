"""Which in-process index a kind of hash list gets (the gateway's backend, the Redis
backend's local copy, the fleet simulator)."""
from __future__ import annotations

import time
from collections.abc import Callable

from prefix_index.config import IndexConfig
from prefix_index.memory import MemoryPrefixIndex
from prefix_index.segments import SegmentPrefixIndex

EmbeddedIndex = SegmentPrefixIndex | MemoryPrefixIndex


def embedded_index(config: IndexConfig, chains: bool = True,
                   clock: Callable[[], float] = time.monotonic) -> EmbeddedIndex:
    """The in-process index: for hash chains (block k's hash names blocks 0..k, as the
    gateway's are) the segment index, which keeps recency per recorded chain and follows
    a chain's held prefix segment by segment; for arbitrary hash lists (the Redis
    backend's local copy with ``redis_exact_match``) the per-block walk."""
    if chains:
        return SegmentPrefixIndex(config.session_ttl_s, config.default_capacity, clock, max_sessions=config.max_sessions)
    return MemoryPrefixIndex(config.session_ttl_s, config.default_capacity, clock, max_sessions=config.max_sessions)
