"""Prefix index: which replica holds which chained prefix block.

This package imports nothing else from the project. `base` holds the contract every
backend implements; `local_index.embedded_index` is the embedded default (`segments` below
32 replicas, `compact` from 32 on), `memory` the per-block reference, `redis_backend` the
shared one.
"""
from __future__ import annotations

from prefix_index.base import (
    BlockHash,
    IndexStats,
    PrefixIndex,
    PrefixMatch,
    ReplicaCapacity,
    ReplicaId,
    SessionEntry,
)

__all__ = [
    "BlockHash",
    "IndexStats",
    "PrefixIndex",
    "PrefixMatch",
    "ReplicaCapacity",
    "ReplicaId",
    "SessionEntry",
]
