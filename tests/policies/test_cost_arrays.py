"""`ttft_cost.estimate_arrays` (every candidate at once, numpy) equals the scalar pass
`ttft_cost.candidate_costs` bit for bit, and the one-pass decision equals the framework's
array and dict paths, on inputs the frozen legacy model (`test_cost_equivalence.py`)
knows nothing of: requests held by admission (``ReplicaView.held_prefill``), matches
stated by KV events (``ExactMatch``: a lost home), and larger fleets."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from policies import cache_aware, ttft_cost
from policies.base import RequestContext, RoutingInputs
from policies.routing import ExactMatch
from tests.policies.test_cost_equivalence import PARAMS, decide_or_none, fleets

HELD = st.lists(st.integers(0, 300_000), max_size=4).map(tuple)


@st.composite
def held_fleets(draw: st.DrawFn) -> tuple[RequestContext, RoutingInputs]:
    c, inputs = draw(fleets(max_replicas=30))
    views = []
    for v in inputs.replicas:
        held = draw(HELD)
        views.append(dataclasses.replace(v, held_prefill=held, pending_prefill_tokens=v.pending_prefill_tokens
                                         + sum(held)))
    exact = draw(st.sets(st.sampled_from([v.id for v in views])))  # these matches come from KV events
    if inputs.session is not None and draw(st.booleans()):
        exact.add(inputs.session.replica)  # often the home: a lost home, or one known to hold the session
    matches = {r: ExactMatch(m.device_blocks, m.host_blocks) if r in exact else m for r, m in inputs.matches.items()}
    if inputs.session is not None and inputs.session.replica in exact and inputs.session.replica not in matches:
        matches[inputs.session.replica] = ExactMatch(0, 0)
    return c, dataclasses.replace(inputs, replicas=tuple(views), matches=matches)


WEIGHTS = [None, {"new-session": 0.0}, {"ttft": 0.0}, {"new-session": 2.0}]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(scenario=held_fleets(), params=st.sampled_from(PARAMS), weights=st.sampled_from(WEIGHTS),
       seed=st.integers(0, 2**32))
def test_the_array_model_equals_the_scalar_one(
    scenario: tuple[RequestContext, RoutingInputs], params: dict[str, float], weights: dict[str, float] | None,
    seed: int,
) -> None:
    c, inputs = scenario
    p = ttft_cost.CacheAwareParams(**params)  # type: ignore[arg-type]
    homes = {None, *(v.id for v in inputs.replicas[:2])}
    if inputs.session is not None:
        homes.add(inputs.session.replica)
    for home in homes:
        arrays = ttft_cost.estimate_arrays(c, inputs, inputs.replicas, home, p)
        costs = ttft_cost.candidate_costs(c, inputs, inputs.replicas, home, p)
        assert costs.terms == arrays.terms
        assert costs.replicas == arrays.replicas
        assert costs.cached_tokens == arrays.cached_tokens.tolist()
        assert costs.uncached_tokens == arrays.uncached_tokens.tolist()
        assert costs.prefill_s == arrays.prefill_s.tolist()
        assert costs.total_s == arrays.total_s.tolist()
    # and the one-pass decision is the framework's, on its array path and on its dict path
    policy_params: dict[str, Any] = {**params, "weights": weights}
    decisions = []
    for array_min in (None, 0):
        policy = cache_aware.build(policy_params, seed)
        policy.array_min = array_min
        decisions.append(decide_or_none(policy, c, inputs, seed))
    policy.array_min = None  # the plugins one by one, over dicts
    decisions.append(decide_or_none(policy, c, inputs, seed, plugins=True))
    assert decisions[1:] == decisions[:1] * 2
