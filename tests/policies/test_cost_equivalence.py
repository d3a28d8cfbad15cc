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

from policies import cache_aware, framework, ttft_cost
from policies.base import Decision, NoRoutableReplica, RequestContext, RoutingInputs
from policies.framework import Pipeline
from prefix_index.base import PrefixMatch, SessionEntry
from tests.policies.legacy_cost import cache_aware as old_cache_aware
from tests.policies.legacy_cost import ttft_cost as old_ttft_cost
from tests.policies.support import ctx, rid, view
from tests.policies.test_properties import replica_views

PARAMS = [{}, {"spread_weight": 0.0}, {"spread_weight": 3.0, "placement_max_shared_tokens": 1_000_000},
          {"tie_tolerance": 0.0, "move_margin_s": 0.0}, {"parent_prefix_fraction": 1.0, "abandon_weight": 0.0}]


@st.composite
def fleets(draw: st.DrawFn, max_replicas: int = 12, min_replicas: int = 1) -> tuple[RequestContext, RoutingInputs]:
    n = draw(st.integers(min_replicas, max_replicas))
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
        costs = ttft_cost.candidate_costs(c, inputs, inputs.replicas, home, p_new)
        arrays = ttft_cost.estimate_arrays(c, inputs, inputs.replicas, home, p_new).as_list()
        for i, (v, a) in enumerate(zip(inputs.replicas, arrays, strict=True)):
            ref = old_ttft_cost.estimate(c, inputs, v, home, p_old)
            assert dataclasses.astuple(a) == dataclasses.astuple(ref)
            assert dataclasses.astuple(ttft_cost.estimate(c, inputs, v, home, p_new)) == dataclasses.astuple(ref)
            assert (costs.replicas[i], costs.cached_tokens[i], costs.uncached_tokens[i], costs.prefill_s[i],
                    costs.total_s[i]) == (ref.replica, ref.cached_tokens, ref.uncached_tokens, ref.prefill_s,
                                          ref.total_s)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(scenario=fleets(max_replicas=40, min_replicas=13), params=st.sampled_from(PARAMS), seed=st.integers(0, 2**32))
def test_larger_fleets_decide_as_the_old_formula_on_both_paths(
    scenario: tuple[RequestContext, RoutingInputs], params: dict[str, float], seed: int
) -> None:
    """13-40 replicas; the pipeline's array path (`score_array`, `pick_index`) and its dict
    path (`score`, `pick`) both return the old model's decision."""
    c, inputs = scenario
    decisions = []
    for build, arrays in ((old_cache_aware.build, False), (cache_aware.build, True), (cache_aware.build, False)):
        policy = build(params, seed)
        policy.array_min = 0 if arrays else None
        decisions.append(decide_or_none(policy, c, inputs, seed))
    assert decisions[1] == decisions[0] and decisions[2] == decisions[0]


def decide_or_none(policy: Pipeline, c: RequestContext, inputs: RoutingInputs, seed: int,
                   plugins: bool = False) -> Decision | None:
    """The policy's decision with a fresh rng of ``seed``; None when nothing is routable.
    ``plugins``: the framework's own `Pipeline.decide` (its plugins called one by one),
    whatever the policy's class decides otherwise."""
    decide = Pipeline.decide if plugins else type(policy).decide
    try:
        return decide(policy, c, inputs, random.Random(seed))
    except NoRoutableReplica:
        return None


def test_a_decision_evaluates_the_model_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """One decision evaluates the cost model once per candidate (N, not 2N+1): one
    `candidate_costs` pass on the one-pass path, and one on the framework's dict path,
    where the explainer takes the scorer's estimates back."""
    views = [view(i, in_flight=i) for i in range(3)]
    inputs = RoutingInputs(tuple(views), {v.id: PrefixMatch() for v in views}, None, None, {}, 1.0)
    calls: list[list[str]] = []
    real = ttft_cost.candidate_costs

    def counting(*args: Any, **kw: Any) -> ttft_cost.Costs:
        calls.append([c.id for c in args[2]])
        return real(*args, **kw)

    monkeypatch.setattr(cache_aware, "candidate_costs", counting)
    policy = cache_aware.build({}, 0)
    one_pass = policy.decide(ctx(10_000, session="s"), inputs, random.Random(0))
    assert calls == [[v.id for v in views]]
    calls.clear()
    plugins = Pipeline.decide(policy, ctx(10_000, session="s"), inputs, random.Random(0))
    assert calls == [[v.id for v in views]]
    assert plugins == one_pass


def test_a_large_fleet_evaluates_the_model_once_over_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    """From ``array_min_candidates`` on, one evaluation over every candidate at once, shared
    by the scorer and the explainer, and never replica by replica."""
    views = [view(i, in_flight=i) for i in range(framework.ARRAY_MIN_CANDIDATES)]
    inputs = RoutingInputs(tuple(views), {v.id: PrefixMatch() for v in views}, None, None, {}, 1.0)
    calls: list[list[str]] = []
    real = ttft_cost.estimate_arrays

    def counting(*args: Any, **kw: Any) -> ttft_cost.EstimateArrays:
        calls.append([c.id for c in args[2]])
        return real(*args, **kw)

    def scalar(*args: Any, **kw: Any) -> ttft_cost.Costs:
        raise AssertionError("a decision evaluated the scalar model")

    monkeypatch.setattr(cache_aware, "estimate_arrays", counting)
    monkeypatch.setattr(cache_aware, "candidate_costs", scalar)
    cache_aware.build({}, 0).decide(ctx(10_000, session="s"), inputs, random.Random(0))
    assert calls == [[v.id for v in views]]
