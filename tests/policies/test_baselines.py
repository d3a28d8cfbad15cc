"""Baselines: round-robin, random, least-load, session-hash (CHWBL)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from policies.registry import make_policy
from prefix_index.memory import MemoryPrefixIndex
from replicas.model import ReplicaState
from tests.policies.support import Fleet, ctx, inputs, rid, view


async def test_round_robin_cycles_through_candidates_via_its_hook() -> None:
    policy = make_policy("round-robin")
    index = MemoryPrefixIndex()
    snap = inputs([view(0), view(1), view(2, state=ReplicaState.DRAINING), view(3)])
    picks = []
    for i in range(6):
        c = ctx(1_000, request_id=f"r{i}")
        d = policy.decide(c, snap, random.Random(0))
        assert policy.decide(c, snap, random.Random(1)).replica == d.replica  # decide is pure
        await policy.on_routed(c, d, index, 1.0)
        picks.append(d.replica)
    assert picks == [rid(0), rid(1), rid(3)] * 2


def test_random_is_seeded_and_covers_all() -> None:
    policy = make_policy("random")
    snap = inputs([view(i) for i in range(4)])
    a = [policy.decide(ctx(100), snap, r).replica for r in [random.Random(5)] for _ in range(200)]
    b = [policy.decide(ctx(100), snap, r).replica for r in [random.Random(5)] for _ in range(200)]
    assert a == b and set(a) == {rid(i) for i in range(4)}


def test_least_load_picks_fewest_in_flight() -> None:
    policy = make_policy("least-load")
    snap = inputs(
        [view(0, in_flight=3), view(1, in_flight=1), view(2, in_flight=1), view(3, in_flight=7)]
    )
    picks = {policy.decide(ctx(100), snap, random.Random(s)).replica for s in range(30)}
    assert picks == {rid(1), rid(2)}


def test_session_hash_is_sticky_when_balanced() -> None:
    policy = make_policy("session-hash")
    snap = inputs([view(i) for i in range(4)])
    homes = {
        policy.decide(ctx(100, session=f"s{i}"), snap, random.Random(0)).replica for i in range(40)
    }
    assert len(homes) > 1
    for i in range(40):
        first = policy.decide(ctx(100, session=f"s{i}"), snap, random.Random(1)).replica
        assert all(
            policy.decide(ctx(100, session=f"s{i}"), snap, random.Random(s)).replica == first
            for s in range(3)
        )


@pytest.mark.parametrize("n", [2, 3, 5])
def test_session_hash_respects_the_load_bound(n: int) -> None:
    policy = make_policy("session-hash", {"load_factor": 1.25})
    fleet = Fleet.of(n)
    rng = random.Random(0)
    for i in range(120):
        total = sum(v.in_flight for v in fleet.views.values())
        bound = math.ceil(1.25 * (total + 1) / n)
        d = fleet.route(
            policy, ctx(100, session=f"hot{i % 3}"), rng
        )  # 3 hot keys: the bound must spill
        assert fleet.views[d.replica].in_flight <= bound


def test_session_hash_ring_follows_membership_hooks() -> None:
    policy = make_policy("session-hash")
    views = [view(i) for i in range(3)]
    for v in views:
        policy.on_replica_added(v.id)
    before = {
        i: policy.decide(ctx(100, session=f"s{i}"), inputs(views), random.Random(0)).replica
        for i in range(60)
    }
    policy.on_replica_removed(rid(2))
    after = {
        i: policy.decide(ctx(100, session=f"s{i}"), inputs(views[:2]), random.Random(0)).replica
        for i in range(60)
    }
    moved = [i for i in before if before[i] != after[i]]
    assert moved and all(before[i] == rid(2) for i in moved)  # only the removed replica's keys move


def test_unknown_params_are_rejected() -> None:
    with pytest.raises(ValueError):
        make_policy("round-robin", {"foo": 1})
    with pytest.raises(ValueError):
        make_policy("session-hash", {"load_factor": 0.5})
    with pytest.raises(ValueError):
        make_policy("nope")
    p = make_policy("cache-aware", {"move_margin_s": "0.5", "weights": {"new-session": 0}})
    assert p.name == "cache-aware"
    with pytest.raises(ValueError):
        make_policy("cache-aware", {"weights": {"bogus": 1}})


def test_baselines_skip_draining_replicas() -> None:
    fleet = Fleet.of(3)
    fleet.views[rid(1)] = dataclasses.replace(fleet.views[rid(1)], state=ReplicaState.DRAINING)
    for name in ("round-robin", "random", "least-load", "session-hash", "sglang-cache-aware"):
        policy = make_policy(name, seed=0)
        picks = {
            policy.decide(
                ctx(100, session=f"s{i}"), inputs(list(fleet.views.values())), random.Random(i)
            ).replica
            for i in range(20)
        }
        assert rid(1) not in picks, name
