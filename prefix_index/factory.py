"""Build the configured prefix index backend (the only place that chooses one)."""
from __future__ import annotations

from prefix_index.base import PrefixIndex
from prefix_index.config import IndexConfig
from prefix_index.local_index import embedded_index


def make_index(config: IndexConfig) -> PrefixIndex:
    """Redis when ``backend == "redis"`` or a ``redis_url`` is given, else the embedded one
    (``compact``: its flat-array layout).

    Creating the Redis backend does not connect: the first call does (and degrades to the
    local copy if Redis is not there yet).
    """
    if config.backend == "redis" or config.redis_url:
        from prefix_index.redis_backend import RedisPrefixIndex  # redis is imported only when used

        return RedisPrefixIndex(config)
    if config.backend == "compact":
        from prefix_index.compact import CompactPrefixIndex

        return CompactPrefixIndex(session_ttl_s=config.session_ttl_s, default_capacity=config.default_capacity,
                                  max_sessions=config.max_sessions)
    return embedded_index(config)
