"""The segment index (``prefix_index/segments.py``) is the per-block model on chains.

Seeded random operations on real chains (block k's hash names blocks 0..k, prefixes
shared between chains) with truncations, capacity changes and replicas leaving: the
segment index must answer every match as the per-block model (``Reference``) does, hold
the same blocks in the same recency order in each tier, and keep its own structures
consistent (``_check``)."""
from __future__ import annotations

import random

import pytest

from prefix_index.base import ReplicaCapacity, ReplicaId
from prefix_index.segments import COMPACT_BELOW, COMPACT_MIN, SegmentPrefixIndex, _SegmentLane
from tests.prefix_index.test_memory_speed_equivalence import Reference, _fleet, _run, apply_write

Tiers = tuple[list[int], list[int]]


def _trie_chain(rng: random.Random, trunks: list[list[int]]) -> list[int]:
    """A real chain: block k's hash names blocks 0..k (a path in a trie)."""
    base = rng.choice(trunks) if trunks and rng.random() < 0.85 else []
    keep = rng.randrange(len(base) + 1)
    chain = list(base[:keep])
    for _ in range(rng.randrange(0, 40)):
        chain.append(hash((chain[-1] if chain else 0, rng.randrange(3))) & (2**64 - 1))
    trunks.append(chain)
    return chain


def _tiers(lane: _SegmentLane) -> Tiers:
    """Device and host blocks, least recent first (the per-block model's LRU order)."""
    device: list[int] = []
    host: list[int] = []
    seg = lane.head.newer
    while seg is not lane.head:
        for j in range(seg.hi - 1, seg.lo - 1, -1):
            (device if j < seg.dev else host).append(seg.chain[j - seg.off])
        seg = seg.newer
    return device, host


def _check(lane: _SegmentLane) -> None:
    """Counts, ``where`` and the edge agree with the segments themselves."""
    device, host = _tiers(lane)
    assert (lane.n_dev, lane.n_host) == (len(device), len(host))
    held = {}
    seg, seen_device = lane.head.older, True  # newest first: wholly device, the edge, wholly host
    while seg is not lane.head:
        assert seg.lo < seg.hi and seg.lo <= seg.dev <= seg.hi
        if not seen_device:
            assert seg.dev == seg.lo, "a segment older than a host one has device blocks"
        if seg.dev < seg.hi:
            seen_device = False
        for j in range(seg.lo, seg.hi):
            held[seg.chain[j - seg.off]] = seg
        seg = seg.older
    assert lane.where == held


def _reference_tiers(ref: Reference, rid: ReplicaId) -> Tiers:
    st = ref.replicas[rid]
    return list(st.device), list(st.host)


@pytest.mark.parametrize("seed", range(20))
def test_random_operations_match_per_block_model_on_chains(seed: int) -> None:
    rng = random.Random(5000 + seed)
    capacity, rids = _fleet(rng, 150, 100, (1, 3, 8))
    index = SegmentPrefixIndex(default_capacity=capacity, clock=lambda: 0.0)
    ref = Reference(capacity)
    trunks: list[list[int]] = []
    for _ in range(500):
        op = rng.random()
        rid = rng.choice(rids)
        chain = _trie_chain(rng, trunks)
        asked = rng.sample(rids, rng.randrange(1, len(rids) + 1))
        assert index.match_now(chain, asked) == ref.match(chain, asked)
        apply_write(op, rng, index, ref, rid, chain, mix=(0.7, 0.87, 0.97), sizes=(150, 100))
        assert set(index._lanes) == set(ref.replicas)
        for r, lane in index._lanes.items():
            _check(lane)
            assert _tiers(lane) == _reference_tiers(ref, r)


def _random_chain(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(63) for _ in range(n)]


def test_blocks_behind_a_truncation_come_back_when_it_is_recorded_again() -> None:
    """A truncation in the middle of a shared run: what sits behind it is held but
    unreachable (the walk's answer), and reachable again once the chain is recorded."""
    rng = random.Random(0)
    index = SegmentPrefixIndex(default_capacity=ReplicaCapacity(1000, 0))
    shared = _random_chain(rng, 10)
    a, b = shared + _random_chain(rng, 20), shared + _random_chain(rng, 20)
    index.record_now("r", b)
    index.record_now("r", a)  # a's segment takes the shared 10; b keeps its 20 behind them
    _run(index.truncate("r", a, keep_blocks=5))
    assert index.match_now(b, ["r"])["r"].device_blocks == 5
    index.record_now("r", shared)
    assert index.match_now(b, ["r"])["r"].device_blocks == 30
    _check(index._lanes["r"])


def test_endless_truncations_keep_the_structures_within_the_capacity() -> None:
    """Sessions that end right after a truncation: ``where`` holds only what the tiers
    hold, and no segment keeps much more of a chain alive than its run."""
    rng = random.Random(2)
    capacity = ReplicaCapacity(600, 600)
    index = SegmentPrefixIndex(default_capacity=capacity)
    trunk = _random_chain(rng, 20)
    for _ in range(2000):
        chain = trunk + _random_chain(rng, 30 + rng.randrange(100))
        index.record_now("r", chain)
        _run(index.truncate("r", chain, keep_blocks=rng.randrange(0, 40)))
        lane = index._lanes["r"]
        assert len(lane.where) == lane.n_dev + lane.n_host <= capacity.device_blocks + capacity.host_blocks
    _check(lane)
    seg = lane.head.newer
    while seg is not lane.head:
        run = seg.hi - seg.lo
        assert len(seg.chain) <= max(COMPACT_MIN, run / COMPACT_BELOW)
        seg = seg.newer
