"""`ttft_cost.estimate_arrays` (every candidate at once, numpy) equals the scalar
`ttft_cost.estimate` field by field, bit for bit, on inputs the frozen legacy model
(`test_cost_equivalence.py`) knows nothing of: requests held by admission
(``ReplicaView.held_prefill``), and on larger fleets."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from policies import cache_aware, ttft_cost
from policies.base import RequestContext, RoutingInputs
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
    return c, dataclasses.replace(inputs, replicas=tuple(views))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(scenario=held_fleets(), params=st.sampled_from(PARAMS), seed=st.integers(0, 2**32))
def test_the_array_model_equals_the_scalar_one(
    scenario: tuple[RequestContext, RoutingInputs], params: dict[str, float], seed: int
) -> None:
    c, inputs = scenario
    p = ttft_cost.CacheAwareParams(**params)  # type: ignore[arg-type]
    homes = {None, *(v.id for v in inputs.replicas[:2])}
    if inputs.session is not None:
        homes.add(inputs.session.replica)
    for home in homes:
        arrays = ttft_cost.estimate_arrays(c, inputs, inputs.replicas, home, p)
        for i, v in enumerate(inputs.replicas):
            want = dataclasses.astuple(ttft_cost.estimate(c, inputs, v, home, p))
            assert dataclasses.astuple(arrays.one(i)) == want
            assert float(arrays.total_s[i]) == ttft_cost.estimate(c, inputs, v, home, p).total_s
    # and the pipeline's array path decides as its dict path does
    fast, slow = cache_aware.build(params, seed), cache_aware.build(params, seed)
    fast.array_min, slow.array_min = 0, None
    assert decide_or_none(fast, c, inputs, seed) == decide_or_none(slow, c, inputs, seed)
