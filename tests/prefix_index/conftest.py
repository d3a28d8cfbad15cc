"""Fixtures: one ``index`` fixture parametrized over every backend (real redis-server)."""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import pytest
import redis

from prefix_index.base import (
    BlockHash,
    IndexStats,
    PrefixIndex,
    PrefixMatch,
    ReplicaId,
    SessionEntry,
)
from prefix_index.compact import CompactPrefixIndex
from prefix_index.config import IndexConfig
from prefix_index.local_index import FleetSizedIndex, embedded_index
from prefix_index.redis_backend import RedisPrefixIndex
from tests.support.redis_server import redis_server

BACKENDS = ["memory", "memory-walk", "memory-large", "compact", "redis", "redis-exact", "redis-write-behind"]
MakeIndex = Callable[..., Awaitable[PrefixIndex]]


class FlushingIndex:
    """A write-behind Redis index whose reads first wait for queued writes (``flush``)."""

    def __init__(self, inner: RedisPrefixIndex) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def match(self, hashes: Sequence[BlockHash], replicas: Sequence[ReplicaId]) -> dict[ReplicaId, PrefixMatch]:
        await self.inner.flush()
        return await self.inner.match(hashes, replicas)

    async def get_session(self, key: str) -> SessionEntry | None:
        await self.inner.flush()
        return await self.inner.get_session(key)

    async def resident_tokens(self, now_s: float, window_s: float) -> dict[ReplicaId, int]:
        await self.inner.flush()
        return await self.inner.resident_tokens(now_s, window_s)

    async def stats(self) -> IndexStats:
        await self.inner.flush()
        return await self.inner.stats()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """One real redis-server for the whole session (tests FLUSHDB before use)."""
    with redis_server() as url:
        yield url


@pytest.fixture(params=BACKENDS)
async def make_index(request: pytest.FixtureRequest) -> AsyncIterator[MakeIndex]:
    """``await make_index(**IndexConfig overrides)`` -> a fresh index of this backend."""
    backend: str = request.param
    made: list[PrefixIndex] = []

    async def make(**overrides: Any) -> PrefixIndex:
        cfg = IndexConfig(**overrides)
        index: PrefixIndex
        if backend in ("memory", "memory-walk"):  # memory: as the factory builds it (the segment index)
            index = embedded_index(cfg, chains=backend == "memory")
        elif backend == "memory-large":  # the default index past its fleet-size threshold (at once)
            index = FleetSizedIndex(cfg.session_ttl_s, cfg.default_capacity, max_sessions=cfg.max_sessions,
                                    compact_from=1)
        elif backend == "compact":
            index = CompactPrefixIndex(cfg.session_ttl_s, cfg.default_capacity, max_sessions=cfg.max_sessions)
        else:
            url = request.getfixturevalue("redis_url")
            redis.Redis.from_url(url).flushdb()
            cfg = cfg.model_copy(update={
                "redis_url": url, "backend": "redis", "redis_timeout_s": 2.0,
                "redis_write_behind": backend == "redis-write-behind",
                "redis_exact_match": backend == "redis-exact",
            })
            inner = RedisPrefixIndex(cfg)
            index = FlushingIndex(inner) if cfg.redis_write_behind else inner
        made.append(index)
        return index

    yield make
    for index in made:
        await index.close()


@pytest.fixture
async def index(make_index: MakeIndex) -> PrefixIndex:
    return await make_index()
