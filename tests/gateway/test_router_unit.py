"""``Router.snapshot``: the index is read for the replicas of ``ids``; the views, built
once a request, are taken after the reads."""
from __future__ import annotations

import random
from collections.abc import Sequence

from gateway.metrics import GatewayMetrics
from gateway.router import Router
from policies.registry import make_policy
from prefix_index.base import PrefixMatch, ReplicaId
from prefix_index.segments import SegmentPrefixIndex
from replicas.model import ReplicaView
from tests.policies.support import ctx, rid, view


class SeenIndex(SegmentPrefixIndex):
    """Keeps the replicas each match was asked about."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[ReplicaId, ...]] = []

    async def match(self, block_hashes: Sequence[int], replicas: Sequence[ReplicaId]) -> dict[ReplicaId, PrefixMatch]:
        self.asked.append(tuple(replicas))
        return await super().match(block_hashes, replicas)


async def test_snapshot_reads_the_index_for_ids_and_builds_the_views_once() -> None:
    built = 0

    def views() -> tuple[ReplicaView, ...]:
        nonlocal built
        built += 1
        return (view(0), view(1))

    index = SeenIndex()
    router = Router(make_policy("cache-aware", None, 1), index, views, GatewayMetrics(),
                    rng=random.Random(1), clock=lambda: 0.0, ids=lambda: (rid(0), rid(1)))
    inputs = await router.snapshot(ctx(4000, session="s-1", prefix="conv"))
    assert index.asked == [(rid(0), rid(1))] and built == 1
    assert [v.id for v in inputs.replicas] == [rid(0), rid(1)]


async def test_without_ids_the_router_takes_them_from_the_views() -> None:
    index = SeenIndex()
    router = Router(make_policy("cache-aware", None, 1), index, lambda: (view(0), view(2)), GatewayMetrics(),
                    rng=random.Random(1), clock=lambda: 0.0)
    await router.snapshot(ctx(4000, session="s-1", prefix="conv"))
    assert index.asked == [(rid(0), rid(2))]
