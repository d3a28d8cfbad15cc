"""The once-per-replica cost model decides exactly as the old 2N+1-evaluation one did.

`tests/policies/legacy_cost/` is a frozen copy of the cost model before the restructuring
(`policies/ttft_cost.py`, `placement.py`, `cache_aware.py`). Over seeded Hypothesis
inputs (replica loads, matches, sessions, parents, working sets, fleet sizes up to 12),
both pipelines, driven by equally seeded rngs, return equal decisions (replica, reason,
predicted tokens, every score bit for bit) and every estimate is equal field by field.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import cache_aware, ttft_cost
from policies.base import NoRoutableReplica, RequestContext, RoutingInputs
from prefix_index.base import PrefixMatch, SessionEntry
from tests.policies.legacy_cost import cache_aware as old_cache_aware
from tests.policies.legacy_cost import ttft_cost as old_ttft_cost
from tests.policies.support import ctx, rid, view
from tests.policies.test_properties import replica_views

PARAMS = [{}, {"spread_weight": 0.0}, {"spread_weight": 3.0, "placement_max_shared_tokens": 1_000_000},
          {"tie_tolerance": 0.0, "move_margin_s": 0.0}, {"parent_prefix_fraction": 1.0, "abandon_weight": 0.0}]


@st.composite
def fleets(draw: st.DrawFn) -> tuple[RequestContext, RoutingInputs]:
    n = draw(st.integers(1, 12))
    views = [draw(replica_views(i)) for i in range(n)]
    prompt = draw(st.integers(0, 200_000))
    blocks = prompt // 64
    shared = draw(st.integers(0, blocks))  # a common prefix: equal matches make ties
    matches = {}
    for v in views:
        kind = draw(st.sampled_from(["none", "shared", "random"]))
        dev = {"none": 0, "shared": shared, "random": draw(st.integers(0, blocks))}[kind]
        matches[v.id] = PrefixMatch(dev, draw(st.integers(0, blocks - dev)) if kind == "random" else 0)
    entry = st.builds(SessionEntry, st.sampled_from([rid(i) for i in range(n + 1)]),
                      st.integers(0, 300_000), st.floats(0, 10_000))
    c = ctx(prompt, session=draw(st.sampled_from([None, "s"])), parent=draw(st.sampled_from([None, "p"])),
            max_tokens=draw(st.sampled_from([None, 0, 256, 4096])))
    resident = {v.id: draw(st.integers(0, 3_000_000)) for v in views if draw(st.booleans())}
    return c, RoutingInputs(replicas=tuple(views), matches=matches, session=draw(st.none() | entry),
                            parent_session=draw(st.none() | entry), resident_tokens=resident,
                            now_s=10_000.0)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(scenario=fleets(), params=st.sampled_from(PARAMS), seed=st.integers(0, 2**32))
def test_decisions_and_estimates_equal_the_old_formula(
    scenario: tuple[RequestContext, RoutingInputs], params: dict[str, float], seed: int
) -> None:
    c, inputs = scenario
    new = cache_aware.build(params, seed)
    old = old_cache_aware.build(params, seed)
    try:
        want = old.decide(c, inputs, random.Random(seed))
    except NoRoutableReplica:
        want = None
    try:
        got = new.decide(c, inputs, random.Random(seed))
    except NoRoutableReplica:
        got = None
    assert got == want
    p_new = ttft_cost.CacheAwareParams(**params)  # type: ignore[arg-type]
    p_old = old_ttft_cost.CacheAwareParams(**params)  # type: ignore[arg-type]
    for home in {None, *(v.id for v in inputs.replicas[:2])}:
        shared = ttft_cost.estimates(c, inputs, inputs.replicas, home, p_new)
        for v, e in zip(inputs.replicas, shared, strict=True):
            ref = dataclasses.astuple(old_ttft_cost.estimate(c, inputs, v, home, p_old))
            assert dataclasses.astuple(e) == ref
            assert dataclasses.astuple(ttft_cost.estimate(c, inputs, v, home, p_new)) == ref


def test_the_explainer_reuses_the_scorer_estimates(monkeypatch: pytest.MonkeyPatch) -> None:
    """One decision evaluates the cost model once per candidate (N, not 2N+1)."""
    views = [view(i, in_flight=i) for i in range(3)]
    inputs = RoutingInputs(tuple(views), {v.id: PrefixMatch() for v in views}, None, None, {}, 1.0)
    calls: list[str] = []
    real = ttft_cost.estimate

    def counting(*args: Any, **kw: Any) -> ttft_cost.TtftEstimate:
        calls.append(args[2].id)
        return real(*args, **kw)

    monkeypatch.setattr(ttft_cost, "estimate", counting)
    cache_aware.build({}, 0).decide(ctx(10_000, session="s"), inputs, random.Random(0))
    assert sorted(calls) == sorted(v.id for v in views)
