"""`prefix_index.compact_store.RowStore` against a plain model: recency lists per row through
appends (moves included), deletes, compactions, rehashes and growth; and the compact
index against the embedded one on a larger fleet than the contract suite uses (the
vectorized paths: grouped search, k-ary fallback, scalar probes)."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_index import compact
from prefix_index.base import ReplicaCapacity, ReplicaId
from prefix_index.compact import CompactPrefixIndex
from prefix_index.compact_store import RowStore
from prefix_index.memory import MemoryPrefixIndex

KEYS = st.integers(0, 40) | st.integers(2**63, 2**63 + 3) | st.just(2**64 - 1)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["append", "delete"]), st.integers(0, 2),
                              st.lists(KEYS, max_size=12, unique=True)), max_size=60))
def test_row_store_keeps_each_rows_recency_list(ops: list[tuple[str, int, list[int]]]) -> None:
    cap = 16
    store = RowStore(cap, rows=1)
    store.add_rows(3)
    model: dict[int, list[int]] = {r: [] for r in range(3)}  # most recent first
    for op, r, keys in ops:
        arr = np.array(keys, dtype=np.uint64)
        if op == "append":
            if len([k for k in model[r] if k not in keys]) + len(keys) > cap:
                store.delete(r, np.array(model[r][cap // 2:], dtype=np.uint64))  # make room
                model[r] = model[r][:cap // 2]
                if len([k for k in model[r] if k not in keys]) + len(keys) > cap:
                    continue  # the caller keeps a row within capacity
            store.append(r, arr)
            model[r] = [*reversed(keys), *(k for k in model[r] if k not in keys)]
        else:
            store.delete(r, arr)
            model[r] = [k for k in model[r] if k not in keys]
        for row in range(3):
            assert store.recency(row).tolist() == model[row]
            probe = np.array(range(41), dtype=np.uint64)
            held = store.positions(np.full(41, row, dtype=np.int64), probe) >= 0
            assert held.tolist() == [k in model[row] for k in range(41)]
            assert [store.position1(row, k) >= 0 for k in range(41)] == held.tolist()


def test_reshaped_store_keeps_order_and_drops_the_oldest() -> None:
    store = RowStore(8, rows=2)
    store.append(1, np.arange(1, 9, dtype=np.uint64))
    bigger = store.reshaped(100)
    assert bigger.recency(1).tolist() == list(range(8, 0, -1))
    smaller = store.reshaped(3)
    assert smaller.recency(1).tolist() == [8, 7, 6]


@pytest.mark.parametrize("groups", [compact.GROUPS, 0])
def test_compact_index_equals_the_embedded_one_on_a_fleet(monkeypatch: pytest.MonkeyPatch, groups: int) -> None:
    """40 replicas, shared prefixes and own chains, truncations and resizes; every match
    and the stats agree with ``MemoryPrefixIndex`` (groups=0: the k-ary search alone)."""
    monkeypatch.setattr(compact, "GROUPS", groups)

    async def run() -> None:
        rng = random.Random(7)
        cap = ReplicaCapacity(60, 40)
        a, b = CompactPrefixIndex(default_capacity=cap), MemoryPrefixIndex(default_capacity=cap)
        reps = [ReplicaId(f"r{i}") for i in range(40)]
        base = [rng.getrandbits(64) for _ in range(300)]
        for it in range(600):
            r, n = rng.choice(reps), rng.randint(1, 150)
            chain = base[:n] if rng.random() < 0.6 else base[:8] + [rng.getrandbits(64) for _ in range(n)]
            op = rng.random()
            if op < 0.85:
                await a.record(r, chain)
                await b.record(r, chain)
            elif op < 0.93:
                keep = rng.randint(0, n)
                await a.truncate(r, chain, keep)
                await b.truncate(r, chain, keep)
            else:
                c = ReplicaCapacity(rng.randint(0, 120), rng.randint(0, 60))
                await a.set_capacity(r, c)
                await b.set_capacity(r, c)
            probe = base[: rng.randint(1, 300)]
            assert await a.match(probe, reps) == await b.match(probe, reps), it
        assert await a.stats() == await b.stats()

    asyncio.run(run())
