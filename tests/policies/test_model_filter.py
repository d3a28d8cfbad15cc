"""The one model filter (policies.routing.serving), applied by the routing core before
any policy decides: a request goes only to replicas serving its model."""
from __future__ import annotations

import random

import pytest

from policies.base import NoRoutableReplica, RequestContext, SessionKeys
from policies.registry import make_policy
from policies.routing import ANY_MODEL, RoutingCore, serving
from prefix_index.base import PrefixMatch, ReplicaId, SessionEntry
from replicas.model import ReplicaState, ReplicaView

A, B, C = ReplicaId("http://a"), ReplicaId("http://b"), ReplicaId("http://c")


def view(rid: ReplicaId, *models: str) -> ReplicaView:
    return ReplicaView(rid, ReplicaState.ACTIVE, device_tokens=100_000, max_running_requests=8,
                       models=frozenset(models))


def ctx(model: str, session: str | None = None) -> RequestContext:
    return RequestContext("r", "chat", model, SessionKeys(session), (1, 2, 3), 768, 192, 64)


def test_serving() -> None:
    fleet = (view(A, "m1"), view(B, "m1", "lora"), view(C, "m2"))
    assert [v.id for v in serving(fleet, "m1")] == [A, B]
    assert [v.id for v in serving(fleet, "lora")] == [B]
    assert serving(fleet, "m3") == ()
    assert serving(fleet, ANY_MODEL) == fleet  # a request naming no model
    unknown = (view(A), view(B))
    assert serving(unknown, "anything") == unknown  # no replica reports models: one-model fleet, as before
    pending = (view(A, "m1"), view(B))
    assert [v.id for v in serving(pending, "m1")] == [A]  # B's models not known yet: not eligible


@pytest.mark.parametrize("policy", ["cache-aware", "round-robin", "least-load", "session-hash", "random"])
def test_core_never_routes_to_another_models_replica(policy: str) -> None:
    core = RoutingCore(make_policy(policy, {}, 1), random.Random(1))
    fleet = (view(A, "m1"), view(B, "m1"), view(C, "m2"))
    # the session's last turn, and the best prefix match, are on the other model's replica
    home = SessionEntry(C, 5_000, 0.0)
    for i in range(20):
        c = ctx("m1", "s")
        inputs = core.inputs(c, fleet, {C: PrefixMatch(3, 0)}, home, None, float(i))
        assert {v.id for v in inputs.replicas} == {A, B}
        assert core.decide(c, inputs).replica in (A, B)
    c = ctx("m2", "s")
    assert core.decide(c, core.inputs(c, fleet, {}, SessionEntry(A, 5_000, 0.0), None, 30.0)).replica == C
    with pytest.raises(NoRoutableReplica):
        c = ctx("m3")
        core.decide(c, core.inputs(c, fleet, {}, None, None, 31.0))
