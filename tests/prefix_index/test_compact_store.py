"""`prefix_index.compact_store.RowStore` against a plain model: recency lists per row through
appends (moves included), deletes, compactions and growth, with the probe counts
(``over``) exact after every step; the work of one call bounded under heavy churn (no
rehash); and the compact index against the embedded one on a larger fleet than the
contract suite uses (the vectorized paths: grouped search, k-ary fallback, scalar probes)."""

from __future__ import annotations

import asyncio
import random
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_index import compact, compact_store
from prefix_index.base import ReplicaCapacity, ReplicaId
from prefix_index.compact import CompactPrefixIndex
from prefix_index.compact_store import BUCKET, EMPTY, TIDY_SLOTS, RowStore, as_hashes
from prefix_index.memory import MemoryPrefixIndex

KEYS = st.integers(0, 40) | st.integers(2**63, 2**63 + 3) | st.just(2**64 - 1)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["append", "delete"]), st.integers(0, 2),
                              st.lists(KEYS, max_size=12, unique=True)), max_size=60),
       tail=st.sampled_from([compact_store.SCALAR_TAIL, 0]))
def test_row_store_keeps_each_rows_recency_list(ops: list[tuple[str, int, list[int]]], tail: int) -> None:
    """``tail`` 0: every probe and insert vectorized to the end (else these few go one by one)."""
    with mock.patch.object(compact_store, "SCALAR_TAIL", tail):
        _check_row_store(ops)


def _check_row_store(ops: list[tuple[str, int, list[int]]]) -> None:
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
        assert_probe_counts_exact(store)


def assert_probe_counts_exact(store: RowStore) -> None:
    """``over`` of every bucket is the number of live blocks whose probe passes it."""
    nb = store.S // BUCKET
    want = np.zeros_like(store.over)
    for r in range(store.rows):
        row = store.table[r * store.S:(r + 1) * store.S]
        for slot in np.flatnonzero(row != EMPTY).tolist():
            key = store.log[r * store.L + (int(row[slot]) & store.pos_mask) - 1]
            b = int(store._home(np.array([key], dtype=np.uint64))[0])
            while b != slot // BUCKET:
                want[r * nb + b] += 1
                b = (b + 1) % nb
    assert want.tolist() == store.over.tolist()


def test_one_call_does_bounded_table_work_under_churn() -> None:
    """A row churned far past the old rehash trigger (deleted slots above 80% of the table:
    here over 20 x the table's size in deletes): every call writes one table slot per block
    it inserts, moves or deletes, moves at most ``TIDY_SLOTS`` slots per block (tidying)
    and renumbers at most one row (a log compaction); a miss still reads under 1.5 buckets
    on average (1.35 here; ~2.5 without tidying: probe paths do not lengthen)."""
    rng = np.random.default_rng(5)
    index = CompactPrefixIndex(default_capacity=ReplicaCapacity(1_000, 2_000))
    replica = ReplicaId("r")
    asyncio.run(index.record(replica, [1]))
    store = index._store
    shared = rng.integers(0, 2**64, size=64, dtype=np.uint64, endpoint=False).tolist()
    chains: list[list[int]] = []
    for call in range(400):
        if chains and rng.random() < 0.3:  # a returning session: its chain grows
            chain = chains[int(rng.integers(len(chains)))]
        else:
            chain = list(shared)
            chains.append(chain)
        chain.extend(rng.integers(0, 2**64, size=int(rng.integers(8, 400)), dtype=np.uint64,
                                  endpoint=False).tolist())
        writes, moved, renumbered = store.slot_writes, store.moved, store.renumbered
        asyncio.run(index.record(replica, chain))
        assert store.slot_writes - writes <= 2 * len(chain), call  # inserts + moves, and as many deletes
        assert store.moved - moved <= TIDY_SLOTS * len(chain) + BUCKET, call  # tidying
        assert store.renumbered - renumbered <= store.S, call  # one log compaction at most
    assert store.emptied > 20 * store.S
    assert_probe_counts_exact(store)
    reads = store.bucket_reads
    absent = rng.integers(0, 2**64, size=2_000, dtype=np.uint64, endpoint=False)
    assert (store.positions(np.zeros(absent.size, dtype=np.int64), as_hashes(absent)) < 0).all()
    assert (store.bucket_reads - reads) / absent.size < 1.5


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


def test_a_truncation_listing_a_block_twice_forgets_it_once() -> None:
    async def run() -> None:
        index = CompactPrefixIndex(default_capacity=ReplicaCapacity(8, 8))
        replica = ReplicaId("r")
        await index.record(replica, [1, 2, 3, 4, 5])
        await index.truncate(replica, [1, 2, 3, 3, 4, 4, 5], 2)
        assert (await index.match([1, 2, 3], [replica]))[replica].blocks == 2
        assert (await index.stats()).device_blocks[replica] == 2
        assert_probe_counts_exact(index._store)

    asyncio.run(run())


def test_only_chains_through_a_truncation_gap_are_walked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A truncation leaves gaps on its replica; a lookup walks that replica block by block
    only for a chain holding one of them, and the answers stay those of the per-block model."""
    index = CompactPrefixIndex(default_capacity=ReplicaCapacity(500, 500))
    ref = MemoryPrefixIndex(default_capacity=ReplicaCapacity(500, 500))
    rng = random.Random(11)
    shared = [rng.getrandbits(64) for _ in range(16)]
    reps = [ReplicaId(f"r{i}") for i in range(8)]
    probe = shared + [rng.getrandbits(64) for _ in range(40)]
    walked: list[int] = []
    real_walk = index._walk
    monkeypatch.setattr(index, "_walk", lambda keys, st: walked.append(st.slot) or real_walk(keys, st))

    async def run() -> None:
        for i, r in enumerate(reps):
            for idx in (index, ref):
                await idx.record(r, probe[: 20 + i])
                other = shared + [rng.getrandbits(64) for _ in range(30)]
                await idx.record(r, other)
                await idx.truncate(r, other, 20)  # a gap on a chain the probe does not hold
        assert await index.match(probe, reps) == await ref.match(probe, reps)
        assert walked == []
        for idx in (index, ref):
            await idx.truncate(reps[3], probe, 18)  # a gap on the probe's own chain
        assert await index.match(probe, reps) == await ref.match(probe, reps)
        assert walked == [index._replicas[reps[3]].slot]
        for idx in (index, ref):
            await idx.record(reps[3], probe[:30])  # recorded again: the gap is filled
        walked.clear()
        assert await index.match(probe, reps) == await ref.match(probe, reps)
        assert walked == []

    asyncio.run(run())


def test_a_replicas_gaps_are_bounded_and_it_stays_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Endless truncations do not grow a replica's gaps past its capacity in blocks: past
    the bound it is walked block by block (its gaps dropped), and the answers stay those
    of the per-block model; ``load`` (a conversion) starts it afresh."""
    monkeypatch.setattr(compact, "GAPS_MIN", 4)
    cap = ReplicaCapacity(8, 8)
    index, ref = CompactPrefixIndex(default_capacity=cap), MemoryPrefixIndex(default_capacity=cap)
    replica = ReplicaId("r")
    rng = random.Random(5)
    chains = [[rng.getrandbits(64) for _ in range(6)] for _ in range(40)]

    async def run() -> None:
        for chain in chains:
            for idx in (index, ref):
                await idx.record(replica, chain)
                await idx.truncate(replica, chain, 2)  # 4 gaps a chain
            st_ = index._replicas[replica]
            assert len(st_.gaps) <= max(st_.total, compact.GAPS_MIN)
            assert sum(index._gap_counts.values()) == len(st_.gaps)
        assert index._replicas[replica].walk_all and not index._gap_counts
        for chain in chains[-3:]:
            assert await index.match(chain, [replica]) == await ref.match(chain, [replica])
        index.load(replica, cap, chains[-1][:2], set())
        assert not index._replicas[replica].walk_all

    asyncio.run(run())
