"""Hypothesis properties of every policy and picker: valid picks, scores in [0, 1], seeds."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import NoRoutableReplica, RequestContext, RoutingInputs
from policies.pickers import MaxScorePicker, SoftmaxPicker
from policies.registry import POLICY_NAMES, make_policy
from prefix_index.base import PrefixMatch, ReplicaId, SessionEntry
from replicas.model import ReplicaState, ReplicaView
from tests.policies.support import ctx, rid, view


@st.composite
def replica_views(draw: st.DrawFn, i: int) -> ReplicaView:
    return view(
        i,
        state=draw(st.sampled_from(list(ReplicaState))),
        device_tokens=draw(st.integers(0, 1_000_000)),
        host_tokens=draw(st.integers(0, 1_000_000)),
        max_running_requests=draw(st.integers(0, 64)),
        in_flight=draw(st.integers(0, 200)),
        pending_prefill_tokens=draw(st.integers(0, 2_000_000)),
        decoding=draw(st.integers(0, 100)),
        reported_running=draw(st.integers(0, 100)),
        reported_waiting=draw(st.integers(0, 100)),
        reported_waiting_uncached_tokens=draw(st.integers(0, 2_000_000)),
        added_at_s=draw(st.floats(0, 10_000)),
        removal_candidate=draw(st.booleans()),
    )


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[RequestContext, RoutingInputs]:
    n = draw(st.integers(1, 6))
    views = [draw(replica_views(i)) for i in range(n)]
    prompt = draw(st.integers(0, 300_000))
    blocks = prompt // 64
    matches = {}
    for v in views:
        dev = draw(st.integers(0, blocks))
        matches[v.id] = PrefixMatch(dev, draw(st.integers(0, blocks - dev)))
    entry = st.builds(
        SessionEntry,
        st.sampled_from([rid(i) for i in range(n + 1)]),
        st.integers(0, 300_000),
        st.floats(0, 10_000),
    )
    c = ctx(
        prompt,
        session=draw(st.sampled_from([None, "s"])),
        parent=draw(st.sampled_from([None, "p"])),
        routing_text=draw(st.text(alphabet="ab", max_size=40)),
    )
    inputs = RoutingInputs(
        replicas=tuple(views),
        matches=matches,
        session=draw(st.none() | entry),
        parent_session=draw(st.none() | entry),
        resident_tokens={v.id: draw(st.integers(0, 3_000_000)) for v in views},
        now_s=10_000.0,
    )
    return c, inputs


@pytest.mark.parametrize("name", POLICY_NAMES)
@settings(max_examples=60, deadline=None)
@given(scenario=scenarios(), seed=st.integers(0, 2**32))
def test_decide_picks_a_routable_replica_with_scores_in_unit_range(
    name: str, scenario: tuple[RequestContext, RoutingInputs], seed: int
) -> None:
    c, inputs = scenario
    policy = make_policy(name, seed=seed)
    routable = {v.id for v in inputs.replicas if v.routable}
    if not routable:
        with pytest.raises(NoRoutableReplica):
            policy.decide(c, inputs, random.Random(seed))
        return
    d = policy.decide(c, inputs, random.Random(seed))
    assert d.replica in routable and d.replica in d.scores
    assert set(d.scores) <= routable
    assert all(0.0 <= s <= 1.0 for s in d.scores.values())
    assert 0 <= d.predicted_cached_tokens <= max(c.est_prompt_tokens, 0)
    assert d.predicted_cached_tokens + d.predicted_uncached_tokens == c.est_prompt_tokens
    again = make_policy(name, seed=seed).decide(c, inputs, random.Random(seed))
    assert again == d  # a fresh policy with the same seed decides the same


score_maps = st.dictionaries(
    st.sampled_from([ReplicaId(f"r{i}") for i in range(8)]), st.floats(0, 1), min_size=1
)


@given(scores=score_maps, seed=st.integers(0, 2**32), tolerance=st.floats(0, 1))
def test_max_score_picker_returns_a_near_best_input(
    scores: dict[ReplicaId, float], seed: int, tolerance: float
) -> None:
    pick = MaxScorePicker(tolerance).pick(scores, random.Random(seed))
    assert pick in scores
    assert scores[pick] * (1 + tolerance) >= max(scores.values()) - 1e-9
    assert MaxScorePicker(tolerance).pick(scores, random.Random(seed)) == pick


@given(scores=score_maps, seed=st.integers(0, 2**32), temperature=st.floats(0.001, 10))
def test_softmax_picker_returns_an_input(
    scores: dict[ReplicaId, float], seed: int, temperature: float
) -> None:
    pick = SoftmaxPicker(temperature).pick(scores, random.Random(seed))
    assert pick in scores and SoftmaxPicker(temperature).pick(scores, random.Random(seed)) == pick
