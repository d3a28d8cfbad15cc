"""The default embedded index (``prefix_index.local_index.FleetSizedIndex``) switches from
the segment representation to the compact one when the fleet reaches its threshold, one
replica per write, and answers exactly as the per-block model does before, during and after
the switch (recency orders, tiers, truncation gaps and sessions carried over)."""
from __future__ import annotations

import random

import pytest

from prefix_index.base import ReplicaCapacity, ReplicaId, SessionEntry
from prefix_index.compact import CompactPrefixIndex
from prefix_index.config import IndexConfig
from prefix_index.factory import make_index
from prefix_index.local_index import COMPACT_FROM_REPLICAS, FleetSizedIndex, embedded_index
from tests.prefix_index.test_memory_speed_equivalence import Reference, _run, apply_write
from tests.prefix_index.test_segments import _random_chain, _trie_chain


def _recency(index: FleetSizedIndex, rid: ReplicaId) -> list[int]:
    """The compact representation's recency list of ``rid``, least recent first."""
    rep = index._compact
    assert isinstance(rep, CompactPrefixIndex) and index.representation == "compact"
    return [int(h) for h in rep._store.recency(rep._replicas[rid].slot)[::-1]]


def _reference_recency(ref: Reference, rid: ReplicaId) -> list[int]:
    st = ref.replicas[rid]
    return list(st.host) + list(st.device)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("compact_from", [None, 8])
def test_random_operations_match_the_per_block_model_across_the_switch(seed: int, compact_from: int | None) -> None:
    """``compact_from`` None: 2, 4 or 6, reached when the whole fleet comes in; 8: all eight
    replicas full when the 8th arrives, so eight writes (and every kind of write among them)
    happen while replicas move over."""
    rng = random.Random(9000 + seed)
    capacity = ReplicaCapacity(rng.randrange(20, 150), rng.randrange(0, 100))
    rids = [ReplicaId(f"r{i}") for i in range(8)]
    threshold = compact_from or rng.choice((2, 4, 6))
    index = FleetSizedIndex(default_capacity=capacity, clock=lambda: 0.0, compact_from=threshold)
    ref = Reference(capacity)
    trunks: list[list[int]] = []
    switched_at = None
    seen = set()
    few = rids[:2] if compact_from is None else rids[:7]  # below the threshold either way
    for step in range(400):
        # few replicas first (the segment representation), then the whole fleet
        rid = rng.choice(few if step < 150 else rids)
        chain = _trie_chain(rng, trunks)
        asked = rng.sample(rids, rng.randrange(1, len(rids) + 1))
        assert index.match_now(chain, asked) == ref.match(chain, asked)
        before = index.representation
        apply_write(rng.random(), rng, index, ref, rid, chain, mix=(0.75, 0.9, 0.97), sizes=(150, 100))
        seen.add(index.representation)
        if before != index.representation:
            switched_at = step
            for t in trunks:  # no step of the switch changes an answer
                assert index.match_now(t, rids) == ref.match(t, rids)
    assert switched_at is not None and index.representation == "compact"
    assert "moving" in seen  # replicas went over one per write
    assert index.tier_blocks() == {r: (len(st.device), len(st.host)) for r, st in ref.replicas.items()}
    for r in ref.replicas:
        assert _recency(index, r) == _reference_recency(ref, r)


def test_the_switch_carries_every_replica_s_recency_and_tiers() -> None:
    rng = random.Random(1)
    capacity = ReplicaCapacity(60, 90)
    index = FleetSizedIndex(default_capacity=capacity, compact_from=3)
    ref = Reference(capacity)
    trunks: list[list[int]] = []
    for _ in range(120):
        rid = ReplicaId(f"r{rng.randrange(2)}")
        chain = _trie_chain(rng, trunks)
        index.record_now(rid, chain)
        ref.record(rid, chain)
    assert index.representation == "segments"
    index.record_now(ReplicaId("r2"), trunks[0])  # the third replica: the first moves over
    ref.record(ReplicaId("r2"), trunks[0])
    assert index.representation == "moving"
    assert index.tier_blocks() == {r: (len(st.device), len(st.host)) for r, st in ref.replicas.items()}
    for chain in trunks:
        assert index.match_now(chain, list(ref.replicas)) == ref.match(chain, list(ref.replicas))
    for _ in range(2):  # one replica per write
        index.record_now(ReplicaId("r2"), trunks[0])
        ref.record(ReplicaId("r2"), trunks[0])
    assert index.representation == "compact"
    for r in ref.replicas:
        assert _recency(index, r) == _reference_recency(ref, r)
    assert index.tier_blocks() == {r: (len(st.device), len(st.host)) for r, st in ref.replicas.items()}


def test_blocks_behind_a_truncation_stay_unreachable_after_the_switch_until_recorded() -> None:
    rng = random.Random(0)
    index = FleetSizedIndex(default_capacity=ReplicaCapacity(1000, 0), compact_from=2)
    shared = _random_chain(rng, 10)
    a, b = shared + _random_chain(rng, 20), shared + _random_chain(rng, 20)
    index.record_now(ReplicaId("r"), b)
    index.record_now(ReplicaId("r"), a)
    _run(index.truncate(ReplicaId("r"), a, keep_blocks=5))
    assert index.match_now(b, ["r"])["r"].device_blocks == 5
    _run(index.set_capacity(ReplicaId("s"), ReplicaCapacity(1000, 0)))  # the switch: r moves first
    _run(index.set_capacity(ReplicaId("s"), ReplicaCapacity(1000, 0)))  # then s
    assert index.representation == "compact"
    assert index.match_now(b, ["r"])["r"].device_blocks == 5
    index.record_now(ReplicaId("r"), shared)
    assert index.match_now(b, ["r"])["r"].device_blocks == 30


async def test_sessions_are_the_same_table_after_the_switch() -> None:
    index = FleetSizedIndex(compact_from=2, clock=lambda: 10.0)
    await index.set_session("s1", SessionEntry(ReplicaId("r0"), 100, 10.0))
    await index.set_capacity(ReplicaId("r0"), ReplicaCapacity(10, 0))
    await index.set_capacity(ReplicaId("r1"), ReplicaCapacity(10, 0))
    assert index.representation == "moving"
    assert await index.get_session("s1") == SessionEntry(ReplicaId("r0"), 100, 10.0)
    await index.set_capacity(ReplicaId("r1"), ReplicaCapacity(10, 0))
    assert index.representation == "compact"
    assert await index.get_session("s1") == SessionEntry(ReplicaId("r0"), 100, 10.0)
    await index.remove_replica(ReplicaId("r0"))  # drops the sessions pointing at it
    assert await index.get_session("s1") is None
    assert (await index.stats()).sessions == 0


async def test_it_never_switches_back() -> None:
    index = FleetSizedIndex(compact_from=2)
    for r in ("a", "b", "b"):
        await index.set_capacity(ReplicaId(r), ReplicaCapacity(10, 0))
    await index.remove_replica(ReplicaId("b"))
    assert index.representation == "compact"
    await index.record(ReplicaId("a"), [1, 2, 3])
    assert (await index.match([1, 2, 3], [ReplicaId("a")]))[ReplicaId("a")].device_blocks == 3


def test_the_default_configuration_builds_it_with_the_threshold() -> None:
    index = make_index(IndexConfig())
    assert isinstance(index, FleetSizedIndex) and index.representation == "segments"
    assert isinstance(embedded_index(IndexConfig()), FleetSizedIndex)
    assert index._compact_from == COMPACT_FROM_REPLICAS
