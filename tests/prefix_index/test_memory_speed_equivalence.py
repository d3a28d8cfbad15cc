"""The embedded index's bulk (C-loop) paths give exactly what per-block code gives.

``Reference`` is the per-block model the embedded backend was first written as (one
``move_to_end``/``popitem`` per block, a match walking the chain block by block). Seeded
random operations, on chains that share prefixes, on arbitrary (non-chain) hash lists,
chains that repeat a block, with truncations and capacity changes, must leave the same
answers, the same LRU orders and the same block -> replicas bits in both.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

import pytest

from prefix_index.base import PrefixMatch, ReplicaCapacity, ReplicaId
from prefix_index.local_index import EmbeddedIndex
from prefix_index.memory import MemoryPrefixIndex


class _Tiers:
    def __init__(self, slot: int, capacity: ReplicaCapacity) -> None:
        self.slot, self.capacity = slot, capacity
        self.device: OrderedDict[int, None] = OrderedDict()
        self.host: OrderedDict[int, None] = OrderedDict()


class Reference:
    """One block at a time: the obviously-correct model."""

    def __init__(self, capacity: ReplicaCapacity) -> None:
        self.default = capacity
        self.owners: dict[int, int] = {}
        self.replicas: dict[ReplicaId, _Tiers] = {}
        self.free: list[int] = []

    def tiers(self, rid: ReplicaId) -> _Tiers:
        if rid not in self.replicas:
            slot = self.free.pop() if self.free else len(self.replicas)
            self.replicas[rid] = _Tiers(slot, self.default)
        return self.replicas[rid]

    def match(self, hashes: Sequence[int], replicas: Sequence[ReplicaId]) -> dict[ReplicaId, PrefixMatch]:
        out = {rid: PrefixMatch() for rid in replicas}
        for rid in replicas:
            st = self.replicas.get(rid)
            if st is None:
                continue
            n = host = 0
            for h in hashes:
                v = self.owners.get(h, 0)
                if not v >> (2 * st.slot) & 1:
                    break
                n += 1
                host += v >> (2 * st.slot + 1) & 1
            if n:
                out[rid] = PrefixMatch(device_blocks=n - host, host_blocks=host)
        return out

    def record(self, rid: ReplicaId, hashes: Sequence[int]) -> None:
        st = self.tiers(rid)
        pbit = 1 << (2 * st.slot)
        for h in reversed(hashes):
            if h in st.device:
                st.device.move_to_end(h)
                continue
            if h in st.host:
                del st.host[h]
                self.owners[h] &= ~(pbit << 1)
            else:
                self.owners[h] = self.owners.get(h, 0) | pbit
            st.device[h] = None
        self.rebalance(st)

    def clear(self, h: int, pbit: int) -> None:
        v = self.owners.get(h, 0) & ~(pbit | pbit << 1)
        if v:
            self.owners[h] = v
        else:
            self.owners.pop(h, None)

    def truncate(self, rid: ReplicaId, hashes: Sequence[int], keep: int) -> None:
        st = self.replicas.get(rid)
        if st is None:
            return
        for h in hashes[max(keep, 0):]:
            if st.device.pop(h, 0) is None or st.host.pop(h, 0) is None:
                self.clear(h, 1 << (2 * st.slot))
        self.rebalance(st)

    def set_capacity(self, rid: ReplicaId, capacity: ReplicaCapacity) -> None:
        st = self.tiers(rid)
        st.capacity = capacity
        self.rebalance(st)

    def remove(self, rid: ReplicaId) -> None:
        st = self.replicas.pop(rid, None)
        if st is not None:
            for h in [*st.device, *st.host]:
                self.clear(h, 1 << (2 * st.slot))
            self.free.append(st.slot)

    def rebalance(self, st: _Tiers) -> None:
        pbit = 1 << (2 * st.slot)
        hbit = pbit << 1
        while len(st.device) > st.capacity.device_blocks:
            h, _ = st.device.popitem(last=False)
            st.host[h] = None
            self.owners[h] |= hbit
        while len(st.device) < st.capacity.device_blocks and st.host:
            h, _ = st.host.popitem(last=True)
            st.device[h] = None
            st.device.move_to_end(h, last=False)
            self.owners[h] &= ~hbit
        while len(st.host) > st.capacity.host_blocks:
            h, _ = st.host.popitem(last=False)
            self.clear(h, pbit)


def _chain(rng: random.Random, trunks: list[list[int]]) -> list[int]:
    """A chain sharing a prefix with an earlier one (or new), sometimes not a chain at all."""
    kind = rng.random()
    if kind < 0.1:
        return [rng.randrange(400) for _ in range(rng.randrange(0, 30))]  # arbitrary, may repeat
    if kind < 0.15 and trunks:
        base = rng.choice(trunks)
        return base + base[: rng.randrange(1, 4)] if base else base  # repeats a block
    base = rng.choice(trunks) if trunks and rng.random() < 0.8 else []
    keep = rng.randrange(len(base) + 1)
    chain = base[:keep] + [rng.getrandbits(64) for _ in range(rng.randrange(0, 40))]
    trunks.append(chain)
    return chain


def _fleet(rng: random.Random, device: int, host: int, sizes: tuple[int, ...]) -> tuple[ReplicaCapacity, list[ReplicaId]]:
    """A random per-replica capacity and a random number of replica ids."""
    capacity = ReplicaCapacity(device_blocks=rng.randrange(0, device), host_blocks=rng.randrange(0, host))
    return capacity, [ReplicaId(f"r{i}") for i in range(rng.choice(sizes))]


Layout = tuple[dict[int, int], dict[ReplicaId, tuple[list[int], list[int]]]]


def _layout(index: MemoryPrefixIndex) -> Layout:
    """Block -> bits, and per replica its device and host LRU orders (the exact state)."""
    return index._owners, {r: (list(st.device), list(st.host)) for r, st in index._replicas.items()}


EVEN_BITS = int("01" * 64, 2)  # the index keeps presence bits only: the tier is in its LRUs


def _reference_layout(ref: Reference) -> Layout:
    return ({h: v & EVEN_BITS for h, v in ref.owners.items()},
            {r: (list(st.device), list(st.host)) for r, st in ref.replicas.items()})


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_match_per_block_model(seed: int) -> None:
    rng = random.Random(seed)
    capacity, rids = _fleet(rng, 120, 80, (1, 3, 5, 20))
    index = MemoryPrefixIndex(default_capacity=capacity, clock=lambda: 0.0)
    ref = Reference(capacity)
    trunks: list[list[int]] = []
    for _ in range(400):
        op = rng.random()
        rid = rng.choice(rids)
        chain = _chain(rng, trunks)
        asked = rng.sample(rids, rng.randrange(1, len(rids) + 1))
        assert index.match_now(chain, asked) == ref.match(chain, asked)
        apply_write(op, rng, index, ref, rid, chain, mix=(0.7, 0.85, 0.95), sizes=(120, 80))
        assert _layout(index) == _reference_layout(ref)


def apply_write(op: float, rng: random.Random, index: EmbeddedIndex, ref: Reference, rid: ReplicaId,
                chain: list[int], mix: tuple[float, float, float], sizes: tuple[int, int]) -> None:
    """The same write to the index and the model, chosen by ``op`` against the thresholds
    ``mix``: record, truncate (a random keep), set a random capacity below ``sizes``
    (device, host), or remove the replica."""
    if op < mix[0]:
        index.record_now(rid, chain)
        ref.record(rid, chain)
    elif op < mix[1]:
        keep = rng.randrange(len(chain) + 1)
        _run(index.truncate(rid, chain, keep))
        ref.truncate(rid, chain, keep)
    elif op < mix[2]:
        cap = ReplicaCapacity(rng.randrange(0, sizes[0]), rng.randrange(0, sizes[1]))
        _run(index.set_capacity(rid, cap))
        ref.set_capacity(rid, cap)
    else:
        _run(index.remove_replica(rid))
        ref.remove(rid)


def _run(coro: object) -> None:
    """Drive a coroutine of the embedded backend (it never suspends)."""
    try:
        coro.send(None)  # type: ignore[attr-defined]
    except StopIteration:
        return
    raise AssertionError("the embedded index suspended")
