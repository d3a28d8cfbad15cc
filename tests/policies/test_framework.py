"""The pipeline: filters, weighted scorers, picker, explainer, timings, hook fan-out."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from policies.base import NoRoutableReplica, RequestContext, RoutingInputs
from policies.baselines import LeastLoadScorer, UniformScorer
from policies.filters import NewSessionFilter, RoutableFilter, ScaleInFilter, is_new_session
from policies.framework import Pipeline
from policies.hooks import NoopHook
from policies.pickers import MaxScorePicker
from prefix_index.base import PrefixMatch, ReplicaId, SessionEntry
from replicas.model import ReplicaState, ReplicaView
from tests.policies.support import ctx, inputs, rid, view


class Fixed:
    """A scorer returning fixed scores (out-of-range values are clamped by the pipeline)."""

    def __init__(self, name: str, values: dict[ReplicaId, float]) -> None:
        self.name = name
        self.values = values

    def score(
        self, ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView]
    ) -> dict[ReplicaId, float]:
        return {c.id: self.values.get(c.id, 0.0) for c in candidates}


def test_weighted_scores_decide_and_are_clamped() -> None:
    a = Fixed("a", {rid(0): 1.0, rid(1): 0.0})
    b = Fixed("b", {rid(0): 0.0, rid(1): 5.0})  # clamped to 1
    snap = inputs([view(0), view(1)])
    heavy_b = Pipeline("t", filters=[], scorers=[(a, 1.0), (b, 3.0)], picker=MaxScorePicker())
    d = heavy_b.decide(ctx(100), snap, random.Random(0))
    assert d.replica == rid(1) and d.scores == {rid(0): 0.25, rid(1): 0.75}
    heavy_a = Pipeline("t", filters=[], scorers=[(a, 3.0), (b, 1.0)], picker=MaxScorePicker())
    assert heavy_a.decide(ctx(100), snap, random.Random(0)).replica == rid(0)
    with pytest.raises(ValueError):
        Pipeline("t", filters=[], scorers=[(a, 0.0)], picker=MaxScorePicker())


def test_framework_times_every_plugin() -> None:
    p = Pipeline(
        "t",
        filters=[RoutableFilter()],
        scorers=[(UniformScorer(), 1.0), (LeastLoadScorer(), 1.0)],
        picker=MaxScorePicker(),
    )
    for _ in range(3):
        p.decide(ctx(100), inputs([view(0), view(1)]), random.Random(0))
    t = p.timings()
    assert {k: v.calls for k, v in t.items()} == {
        "filter/routable": 3,
        "scorer/uniform": 3,
        "scorer/least-load": 3,
        "picker/max-score": 3,
        "explainer/prefix": 3,
    }
    assert all(v.total_s >= 0 for v in t.values())


def test_default_explainer_reasons() -> None:
    p = Pipeline(
        "t",
        filters=[RoutableFilter()],
        scorers=[(Fixed("f", {rid(1): 1.0}), 1.0)],
        picker=MaxScorePicker(),
    )
    held = {rid(1): PrefixMatch(device_blocks=3)}
    d = p.decide(ctx(1_000), inputs([view(0), view(1)], matches=held), random.Random(0))
    assert (d.reason, d.predicted_cached_tokens, d.predicted_uncached_tokens) == (
        "prefix",
        192,
        808,
    )
    assert p.decide(ctx(1_000), inputs([view(0), view(1)]), random.Random(0)).reason == "balance"
    assert p.decide(ctx(1_000), inputs([view(1)]), random.Random(0)).reason == "only-one"


def test_filters() -> None:
    views = [
        view(0, state=ReplicaState.JOINING),
        view(1, removal_candidate=True),
        view(2),
        view(3, state=ReplicaState.DRAINING),
    ]
    new = inputs(views)
    assert [v.id for v in RoutableFilter().filter(ctx(1), new, views)] == [rid(1), rid(2)]
    assert [v.id for v in ScaleInFilter().filter(ctx(1), new, views[1:3])] == [rid(2)]
    assert [v.id for v in ScaleInFilter().filter(ctx(1), new, views[1:2])] == [
        rid(1)
    ]  # soft: never empties
    assert is_new_session(new)
    assert [v.id for v in NewSessionFilter().filter(ctx(1), new, views[1:3])] == [rid(2)]
    known = inputs(views, session=SessionEntry(rid(1), 10, 0.0))
    assert not is_new_session(known)
    assert len(NewSessionFilter().filter(ctx(1), known, views[1:3])) == 2
    assert not is_new_session(inputs(views, matches={rid(2): PrefixMatch(1)}))


async def test_hooks_fan_out_in_order() -> None:
    seen: list[str] = []

    class Rec(NoopHook):
        def __init__(self, name: str) -> None:
            self.name = name

        def on_replica_added(self, replica: ReplicaId) -> None:
            seen.append(f"{self.name}+{replica}")

        def on_replica_removed(self, replica: ReplicaId) -> None:
            seen.append(f"{self.name}-{replica}")

    p = Pipeline(
        "t",
        filters=[],
        scorers=[(UniformScorer(), 1.0)],
        picker=MaxScorePicker(),
        hooks=[Rec("a"), Rec("b")],
    )
    p.on_replica_added(rid(0))
    p.on_replica_removed(rid(0))
    assert seen == [f"a+{rid(0)}", f"b+{rid(0)}", f"a-{rid(0)}", f"b-{rid(0)}"]


def test_no_candidate_raises() -> None:
    p = Pipeline(
        "t", filters=[RoutableFilter()], scorers=[(UniformScorer(), 1.0)], picker=MaxScorePicker()
    )
    with pytest.raises(NoRoutableReplica):
        p.decide(ctx(1), inputs([]), random.Random(0))
