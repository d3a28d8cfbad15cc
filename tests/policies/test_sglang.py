"""The `sglang-cache-aware` baseline reproduces SGLang router 0.3.2's rule and its hot-spotting."""

from __future__ import annotations

import dataclasses
import random

from policies.framework import Pipeline
from policies.registry import make_policy
from prefix_index.memory import MemoryPrefixIndex
from tests.policies.support import Fleet, ctx, inputs, rid, view


def rand_text(seed: str, n: int, alphabet: str = "abcdefghij klmnop") -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(alphabet) for _ in range(n))


SYSTEM = rand_text("system", 12_000)


async def _route(
    policy: Pipeline, fleet: Fleet, index: MemoryPrefixIndex, text: str, key: str, now_s: float
) -> str:
    c = ctx(len(text) // 4, session=key, request_id=f"{key}@{now_s}", routing_text=text)
    d = fleet.route(policy, c, random.Random(0))
    await policy.on_routed(c, d, index, now_s)
    return d.replica


async def test_shared_system_prompt_hot_spots_on_one_worker() -> None:
    """24 concurrent sessions x 4 turns sharing a 12k-char system prompt: all 96 on one worker."""
    policy = make_policy("sglang-cache-aware")
    index = MemoryPrefixIndex()
    picks = []
    for turn in range(4):
        fleet = Fleet.of(3)  # each session has one request in flight at a time: 24 concurrent
        for s in range(24):
            text = SYSTEM + f" session {s} " + f"turn {turn} user asks something new. " * (turn + 1)
            picks.append(await _route(policy, fleet, index, text, f"s{s}", float(turn * 24 + s)))
    assert len(picks) == 96 and set(picks) == {rid(0)}


async def test_sequential_distinct_sessions_all_land_on_first_worker() -> None:
    policy = make_policy("sglang-cache-aware")
    index = MemoryPrefixIndex()
    picks = set()
    for s in range(30):
        fleet = Fleet.of(3)  # each request finished before the next: no load anywhere
        text = rand_text(f"text{s}", 2_000, "qrstuvwxyz")
        picks.add(await _route(policy, fleet, index, text, f"s{s}", float(s)))
    assert picks == {rid(0)}


def test_imbalance_routes_to_least_loaded() -> None:
    policy = make_policy("sglang-cache-aware")
    snap = inputs([view(0, in_flight=100), view(1, in_flight=20), view(2, in_flight=30)])
    d = policy.decide(ctx(100, routing_text="x" * 400), snap, random.Random(0))
    assert (d.replica, d.reason) == (rid(1), "balance")


async def test_prefix_rule_and_tree_learns_only_in_hook() -> None:
    policy = make_policy("sglang-cache-aware")
    fleet, index = Fleet.of(3), MemoryPrefixIndex()
    fleet.views[rid(0)] = dataclasses.replace(fleet.views[rid(0)], in_flight=5)
    text = SYSTEM + " hello"
    c = ctx(3_000, routing_text=text)
    first = policy.decide(c, inputs(list(fleet.views.values())), random.Random(0))
    assert first.replica == rid(
        1
    )  # empty tree: least in-flight, first in registry order among ties
    again = policy.decide(c, inputs(list(fleet.views.values())), random.Random(0))
    assert again.replica == rid(1)  # decide did not learn anything
    await policy.on_routed(c, first, index, 0.0)
    fleet.views[rid(1)] = dataclasses.replace(fleet.views[rid(1)], in_flight=9)
    d = policy.decide(
        ctx(3_000, request_id="r2", routing_text=SYSTEM + " other"),
        inputs(list(fleet.views.values())),
        random.Random(0),
    )
    assert (d.replica, d.reason) == (rid(1), "prefix")


async def test_tree_is_trimmed_every_interval_and_forgets_removed_workers() -> None:
    policy = make_policy("sglang-cache-aware", {"max_tree_chars": 5_000, "eviction_interval_s": 60})
    index = MemoryPrefixIndex()
    for s in range(10):  # sequential: all land on the first worker
        text = rand_text(f"text{s}", 1_000, "abcdefgh")
        await _route(policy, Fleet.of(2), index, text, f"s{s}", float(s))
    tree = policy.hooks[0].tree  # type: ignore[attr-defined]
    assert tree.tenant_chars(rid(0)) >= 9_000
    await _route(policy, Fleet.of(2), index, "z" * 100, "late", 61.0)
    assert tree.tenant_chars(rid(0)) <= 5_000
    policy.on_replica_removed(rid(0))
    assert tree.tenant_chars(rid(0)) == 0
