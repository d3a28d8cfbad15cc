"""Prefix index: which replica holds which chained prefix block.

This package imports nothing else from the project. `base` holds the contract every
backend implements; `memory` is the embedded default, `redis_backend` the shared one.
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
