"""Cache-aware scale-in ranking, the desired-replica signal with hysteresis, deletion costs
and their annotation on pods (against the local API server of fake_api.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_index.base import ReplicaId
from replicas.kube import ApiServer
from replicas.model import ReplicaState, ReplicaView
from replicas.scale import (
    DELETION_COST,
    INT32_MAX,
    FleetSignal,
    PodDeletionCostAnnotator,
    ScaleAdvisor,
    ScaleParams,
    deletion_costs,
    desired_replicas,
    rank_for_scale_in,
)
from tests.replicas_k8s.fake_api import FakeApi, Served, make_tls, service_account
from tests.support.procs import free_port

CAP = 1_000_000  # device + host tokens per replica


def view(n: int, state: ReplicaState = ReplicaState.ACTIVE, in_flight: int = 0, waiting: int = 0) -> ReplicaView:
    return ReplicaView(id=ReplicaId(f"http://10.0.0.{n}:30000"), state=state, device_tokens=CAP // 3,
                       host_tokens=CAP - CAP // 3, in_flight=in_flight, reported_waiting=waiting)


def rid(n: int) -> ReplicaId:
    return ReplicaId(f"http://10.0.0.{n}:30000")


def test_rank_coldest_first_non_active_before_active() -> None:
    views = [view(1), view(2, in_flight=2), view(3), view(4, ReplicaState.UNHEALTHY), view(5, ReplicaState.JOINING)]
    resident = {rid(1): 50_000, rid(2): 1_000, rid(3): 10_000, rid(4): 900_000}
    hits = {rid(3): 5_000}
    order = [h.url for h in rank_for_scale_in(views, resident, hits)]
    # 4 unhealthy, 5 joining; then active by value: 3 (15k), 2 (1k + 2*8192), 1 (50k)
    assert order == [rid(4), rid(5), rid(3), rid(2), rid(1)]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10**12), st.integers(0, 10**9), st.integers(0, 50)), min_size=1, max_size=8))
def test_costs_follow_ranking_and_fit_int32(rows: list[tuple[int, int, int]]) -> None:
    views = [view(i, in_flight=f) for i, (_, _, f) in enumerate(rows)]
    resident = {rid(i): r for i, (r, _, _) in enumerate(rows)}
    hits = {rid(i): h for i, (_, h, _) in enumerate(rows)}
    ranking = rank_for_scale_in(views, resident, hits)
    costs = deletion_costs(ranking)
    ordered = [costs[h.url] for h in ranking]
    assert ordered == sorted(ordered)
    assert all(0 <= c <= INT32_MAX for c in ordered)
    assert sorted(h.url for h in ranking) == sorted(v.id for v in views)


def test_desired_replicas_watermarks_and_queueing() -> None:
    p = ScaleParams(min_replicas=1, max_replicas=10)
    assert desired_replicas(FleetSignal(4, int(0.7 * 4 * CAP), 4 * CAP, 0), p) == (4, "hold")
    # above 85%: to the size that puts the working set at the middle (67.5%), at least +1
    assert desired_replicas(FleetSignal(4, int(0.9 * 4 * CAP), 4 * CAP, 0), p) == (6, "working-set")
    assert desired_replicas(FleetSignal(4, 0, 4 * CAP, 17), p) == (5, "queueing")
    # below 50%: one step at a time
    assert desired_replicas(FleetSignal(4, int(0.1 * 4 * CAP), 4 * CAP, 0), p) == (3, "low-usage")
    # below 50% but one fewer replica would sit above the middle: hold
    assert desired_replicas(FleetSignal(2, int(0.45 * 2 * CAP), 2 * CAP, 0), p) == (2, "hold")
    assert desired_replicas(FleetSignal(10, 10 * CAP, 10 * CAP, 0), p) == (10, "bounds")
    assert desired_replicas(FleetSignal(0, 0, 0, 0), p) == (1, "queueing")


class Marker:
    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    async def set_removal_candidate(self, url: ReplicaId, flag: bool) -> None:
        self.calls.append((url, flag))


async def test_advisor_cooldown_marks_coldest_then_unmarks() -> None:
    now = [0.0]
    marker = Marker()
    advisor = ScaleAdvisor(ScaleParams(cooldown_s=100.0), marker, clock=lambda: now[0])
    views = [view(1), view(2), view(3)]
    low = {rid(1): 100_000, rid(2): 10_000, rid(3): 50_000}
    advice = await advisor.tick(views, low, {})
    assert (advice.desired_replicas, advice.reason, advice.removal_candidates) == (3, "cooldown", ())
    now[0] = 99.0
    assert (await advisor.tick(views, low, {})).reason == "cooldown"
    now[0] = 100.0
    advice = await advisor.tick(views, low, {})
    assert (advice.desired_replicas, advice.reason, advice.removal_candidates) == (2, "low-usage", (rid(2),))
    assert advice.deletion_costs[rid(2)] < advice.deletion_costs[rid(3)] < advice.deletion_costs[rid(1)]
    # the load comes back: hold, the candidate is unmarked, the cooldown restarts
    busy = {rid(1): 700_000, rid(2): 700_000, rid(3): 700_000}
    advice = await advisor.tick(views, busy, {})
    assert (advice.desired_replicas, advice.removal_candidates) == (3, ())
    now[0] = 150.0
    assert (await advisor.tick(views, low, {})).reason == "cooldown"
    assert marker.calls == [(rid(2), True), (rid(2), False)]


async def test_annotator_patches_changed_pods_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against the local API server over HTTPS, as in a pod (tests/replicas_k8s/fake_api.py)."""
    tls = make_tls(tmp_path)
    pods = {"sglang-a": ("10.0.0.1", "5"), "sglang-b": ("10.0.0.2", None), "sglang-c": ("10.0.0.3", None)}
    api = FakeApi(pods=[{"metadata": {"name": n, "annotations": {DELETION_COST: c, "keep": "me"} if c else {}},
                         "status": {"podIP": ip}} for n, (ip, c) in pods.items()])
    port = free_port()
    service_account(tmp_path, tls, port, monkeypatch, token="sa-token", namespace="llm")
    annotator = PodDeletionCostAnnotator(ApiServer.in_cluster(), "app.kubernetes.io/name=sglang")
    async with Served(api, tls, port):
        try:
            patched = await annotator.apply({rid(1): 5, rid(2): 7, rid(9): 1})
            again = await annotator.apply({rid(1): 5, rid(2): 7})  # nothing changed since
        finally:
            await annotator.aclose()
    assert (patched, again) == (["sglang-b"], [])
    assert api.patches == [("sglang-b", "application/strategic-merge-patch+json",
                            {"metadata": {"annotations": {DELETION_COST: "7"}}})]
    assert api.auth == {"Bearer sa-token"}
