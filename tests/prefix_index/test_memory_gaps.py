"""The embedded index's truncation gaps (chain mode) are bounded: cleared once nothing
held at the truncation can still sit behind them, capped otherwise."""
from __future__ import annotations

import asyncio
import random

from prefix_index.base import ReplicaCapacity
from prefix_index.memory import MAX_GAPS_MIN, MemoryPrefixIndex


def _chain(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(63) for _ in range(n)]


def test_gaps_are_cleared_once_the_blocks_held_at_the_truncation_are_gone() -> None:
    rng = random.Random(0)
    index = MemoryPrefixIndex(default_capacity=ReplicaCapacity(50, 50), assume_chains=True)
    shared = _chain(rng, 10)
    a, b = shared + _chain(rng, 20), shared + _chain(rng, 20)
    index.record_now("r", a)
    index.record_now("r", b)
    asyncio.run(index.truncate("r", a, keep_blocks=5))  # b's blocks 5.. lose their parents
    st = index._replicas["r"]
    assert st.gaps and index.match_now(b, ["r"])["r"].device_blocks == 5  # walked: exact
    for _ in range(5):  # 150 blocks of other chains: everything held at the truncation is gone
        index.record_now("r", _chain(rng, 30))
    assert not st.gaps
    assert index.match_now(b, ["r"])["r"].device_blocks == 0


def test_recording_the_chain_again_fills_its_gaps() -> None:
    rng = random.Random(1)
    index = MemoryPrefixIndex(default_capacity=ReplicaCapacity(1000, 0), assume_chains=True)
    a = _chain(rng, 40)
    index.record_now("r", a)
    asyncio.run(index.truncate("r", a, keep_blocks=10))
    assert index._replicas["r"].gaps
    index.record_now("r", a)
    assert not index._replicas["r"].gaps and index.match_now(a, ["r"])["r"].device_blocks == 40


def test_gaps_stay_within_the_cap_under_endless_truncation() -> None:
    rng = random.Random(2)
    capacity = ReplicaCapacity(600, 600)
    index = MemoryPrefixIndex(default_capacity=capacity, assume_chains=True)
    trunk = _chain(rng, 20)
    peak = 0
    for _ in range(2000):  # sessions that end right after a truncation: never recorded again
        chain = trunk + _chain(rng, 30)
        index.record_now("r", chain)
        asyncio.run(index.truncate("r", chain, keep_blocks=rng.randrange(0, 20)))
        peak = max(peak, len(index._replicas["r"].gaps))
    assert 0 < peak <= max(capacity.device_blocks + capacity.host_blocks, MAX_GAPS_MIN)
