"""Build the configured prefix index backend (the only place that chooses one)."""
from __future__ import annotations

from prefix_index.base import PrefixIndex, ReplicaCapacity
from prefix_index.config import IndexConfig
from prefix_index.memory import MemoryPrefixIndex


def make_index(config: IndexConfig) -> PrefixIndex:
    """Redis when ``backend == "redis"`` or a ``redis_url`` is given, else the embedded one
    (``compact``: its flat-array layout).

    Creating the Redis backend does not connect: the first call does (and degrades to the
    local copy if Redis is not there yet).
    """
    if config.backend == "redis" or config.redis_url:
        from prefix_index.redis_backend import RedisPrefixIndex  # redis is imported only when used

        return RedisPrefixIndex(config)
    default = ReplicaCapacity(config.default_device_blocks, config.default_host_blocks)
    if config.backend == "compact":
        from prefix_index.compact import CompactPrefixIndex

        return CompactPrefixIndex(session_ttl_s=config.session_ttl_s, default_capacity=default,
                                  max_sessions=config.max_sessions)
    # the gateway's hashes are chains (block k's hash names blocks 0..k): held blocks are a
    # prefix of a chain, so match and record binary-search them instead of walking
    return MemoryPrefixIndex(session_ttl_s=config.session_ttl_s, default_capacity=default,
                             max_sessions=config.max_sessions, assume_chains=True)
