"""Property tests: a backend behaves like a tiny reference model (a recency list per replica).

Two input shapes: arbitrary hash lists (repeats, holes) for the exact algorithms (memory,
Redis with ``redis_exact_match``), and real chains (paths in a small trie, as
``gateway.prefix_hash`` produces) for every backend, including Redis's default search.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefix_index.base import PrefixIndex, PrefixMatch, ReplicaCapacity, ReplicaId
from prefix_index.compact import CompactPrefixIndex
from prefix_index.config import IndexConfig
from prefix_index.memory import MemoryPrefixIndex
from prefix_index.redis_backend import RedisPrefixIndex

REPLICAS = [ReplicaId(f"http://r{i}") for i in range(3)]
DEFAULT = ReplicaCapacity(device_blocks=6, host_blocks=2)


@dataclass
class Model:
    """Per replica: blocks most recent first; device = the first ``d``, host = the next ``h``."""

    order: dict[ReplicaId, list[int]] = field(default_factory=dict)
    caps: dict[ReplicaId, ReplicaCapacity] = field(default_factory=dict)

    def _trim(self, r: ReplicaId) -> None:
        cap = self.caps.setdefault(r, DEFAULT)
        del self.order.setdefault(r, [])[cap.device_blocks + cap.host_blocks:]

    def record(self, r: ReplicaId, hashes: Sequence[int]) -> None:
        lst = self.order.setdefault(r, [])
        for h in reversed(hashes):
            if h in lst:
                lst.remove(h)
            lst.insert(0, h)
        self._trim(r)

    def truncate(self, r: ReplicaId, hashes: Sequence[int], keep: int) -> None:
        if r in self.order:
            drop = set(hashes[keep:])
            self.order[r] = [h for h in self.order[r] if h not in drop]

    def set_capacity(self, r: ReplicaId, cap: ReplicaCapacity) -> None:
        self.caps[r] = cap
        self._trim(r)

    def remove(self, r: ReplicaId) -> None:
        self.order.pop(r, None)
        self.caps.pop(r, None)

    def match(self, hashes: Sequence[int], r: ReplicaId) -> PrefixMatch:
        lst = self.order.get(r, [])
        rank = {h: i for i, h in enumerate(lst)}
        n = 0
        while n < len(hashes) and hashes[n] in rank:
            n += 1
        d = self.caps.get(r, DEFAULT).device_blocks
        device = sum(1 for h in hashes[:n] if rank[h] < d)
        return PrefixMatch(device_blocks=device, host_blocks=n - device)


def _as_chain(labels: list[int]) -> list[int]:
    """Block k's hash names the labels 0..k (a path in a trie), like a real chain."""
    return [xxhash.xxh3_64_intdigest(bytes(labels[: k + 1])) for k in range(len(labels))]


replica_st = st.sampled_from(REPLICAS)
cap_st = st.builds(ReplicaCapacity, st.integers(0, 8), st.integers(0, 4))
hashes_st = st.lists(st.integers(min_value=0, max_value=12), min_size=0, max_size=10)
chain_st = st.lists(st.integers(min_value=0, max_value=2), min_size=0, max_size=10).map(_as_chain)


def _ops(h: st.SearchStrategy[list[int]]) -> st.SearchStrategy[tuple[object, ...]]:
    return st.one_of(
        st.tuples(st.just("record"), replica_st, h),
        st.tuples(st.just("truncate"), replica_st, h, st.integers(0, 10)),
        st.tuples(st.just("capacity"), replica_st, cap_st),
        st.tuples(st.just("remove"), replica_st),
    )


op_st, chain_op_st = _ops(hashes_st), _ops(chain_st)


async def _apply(index: PrefixIndex, model: Model, ops: list[tuple[object, ...]], probes: list[list[int]]) -> None:
    for op in ops:
        kind, r = op[0], ReplicaId(str(op[1]))
        if kind == "record":
            model.record(r, op[2])  # type: ignore[arg-type]
            await index.record(r, op[2])  # type: ignore[arg-type]
        elif kind == "truncate":
            model.truncate(r, op[2], op[3])  # type: ignore[arg-type]
            await index.truncate(r, op[2], op[3])  # type: ignore[arg-type]
        elif kind == "capacity":
            model.set_capacity(r, op[2])  # type: ignore[arg-type]
            await index.set_capacity(r, op[2])  # type: ignore[arg-type]
        else:
            model.remove(r)
            await index.remove_replica(r)
        for probe in probes:
            got = await index.match(probe, REPLICAS)
            assert got == {r2: model.match(probe, r2) for r2 in REPLICAS}, (op, probe)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op_st, max_size=25), probes=st.lists(hashes_st, min_size=1, max_size=3))
def test_memory_backend_behaves_like_the_model(ops: list[tuple[object, ...]], probes: list[list[int]]) -> None:
    asyncio.run(_apply(MemoryPrefixIndex(default_capacity=DEFAULT), Model(), ops, probes))


def _run_redis(redis_url: str, ops: list[tuple[object, ...]], probes: list[list[int]], exact: bool) -> None:
    redis.Redis.from_url(redis_url).flushdb()
    cfg = IndexConfig(
        backend="redis", redis_url=redis_url, redis_timeout_s=2.0, redis_exact_match=exact,
        default_device_blocks=DEFAULT.device_blocks, default_host_blocks=DEFAULT.host_blocks,
        redis_write_behind=False,  # the scripts themselves: every write awaited, then read back
    )

    async def run() -> None:
        index = RedisPrefixIndex(cfg)
        try:
            await _apply(index, Model(), ops, probes)
            assert not index.degraded
        finally:
            await index.close()

    asyncio.run(run())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op_st, max_size=15), probes=st.lists(hashes_st, min_size=1, max_size=2))
def test_redis_exact_match_behaves_like_the_model(
    redis_url: str, ops: list[tuple[object, ...]], probes: list[list[int]]
) -> None:
    _run_redis(redis_url, ops, probes, exact=True)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(chain_op_st, max_size=25), probes=st.lists(chain_st, min_size=1, max_size=3))
def test_memory_backend_on_chains(ops: list[tuple[object, ...]], probes: list[list[int]]) -> None:
    asyncio.run(_apply(MemoryPrefixIndex(default_capacity=DEFAULT), Model(), ops, probes))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(chain_op_st, max_size=15), probes=st.lists(chain_st, min_size=1, max_size=2))
def test_redis_chain_search_behaves_like_the_model(
    redis_url: str, ops: list[tuple[object, ...]], probes: list[list[int]]
) -> None:
    _run_redis(redis_url, ops, probes, exact=False)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op_st, max_size=25), probes=st.lists(hashes_st, min_size=1, max_size=3))
def test_compact_backend_walk_behaves_like_the_model(ops: list[tuple[object, ...]], probes: list[list[int]]) -> None:
    asyncio.run(_apply(CompactPrefixIndex(default_capacity=DEFAULT, assume_chains=False), Model(), ops, probes))


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(chain_op_st, max_size=25), probes=st.lists(chain_st, min_size=1, max_size=3))
def test_compact_backend_on_chains(ops: list[tuple[object, ...]], probes: list[list[int]]) -> None:
    asyncio.run(_apply(CompactPrefixIndex(default_capacity=DEFAULT), Model(), ops, probes))
