"""The gateway's scale loop: hit window, candidate marks, evaluation per model, metrics, admin API."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from gateway.metrics import GatewayMetrics
from gateway.scaling import (
    CandidateMarks,
    HitWindow,
    ScaleConfig,
    ScaleLoop,
    UnknownGroup,
    report_json,
    scale_groups,
)
from gateway.settings import load_settings
from prefix_index.base import ReplicaId
from replicas.model import ReplicaState, ReplicaView
from replicas.scale import ScaleParams
from tests.gateway.test_app_unit import CHAT, A, B, fake_fleet, gateway, ok_completion, settings_for

R1, R2, R3, R4 = (ReplicaId(f"http://r{i}:1") for i in range(1, 5))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeRegistry:
    views: dict[ReplicaId, ReplicaView]
    calls: list[tuple[str, bool]] = field(default_factory=list)

    def set_removal_candidate(self, url: str, flag: bool) -> None:
        rid = ReplicaId(url)
        if rid not in self.views:
            raise KeyError(url)
        self.calls.append((url, flag))
        self.views[rid] = dataclasses.replace(self.views[rid], removal_candidate=flag)

    def list(self) -> list[ReplicaView]:
        return list(self.views.values())


@dataclass
class FakeIndex:
    resident: dict[ReplicaId, int]

    async def resident_tokens(self, now_s: float, window_s: float) -> dict[ReplicaId, int]:
        return dict(self.resident)


def view(rid: ReplicaId, *models: str) -> ReplicaView:
    return ReplicaView(rid, ReplicaState.ACTIVE, device_tokens=1000, host_tokens=1000, models=frozenset(models))


def fleet(*ids: ReplicaId) -> FakeRegistry:
    return FakeRegistry({r: view(r) for r in ids})


def test_hit_window_rolls() -> None:
    clock = Clock()
    hits = HitWindow(10.0, clock)
    hits.record(R1, 100)
    hits.record(R1, None)
    hits.record(R2, 0)
    clock.now += 6
    hits.record(R1, 50)
    assert hits.totals() == {R1: 150}
    clock.now += 5  # the first hit is 11 s old
    assert hits.totals() == {R1: 50}
    clock.now += 10
    assert hits.totals() == {}


def test_marks_merge_auto_and_manual() -> None:
    reg = fleet(R1, R2)
    marks = CandidateMarks(reg)
    advisor = marks.marker("")
    advisor.set_removal_candidate(R1, True)
    marks.set_manual([R1, R2])
    advisor.set_removal_candidate(R1, False)  # still manual: stays marked
    assert reg.calls == [(R1, True), (R2, True)]
    marks.set_manual([])
    assert reg.calls[-2:] == [(R1, False), (R2, False)]
    advisor.set_removal_candidate(R3, True)  # unknown replica: ignored
    assert marks.marked() == {R3}


def test_one_advisor_never_unmarks_anothers_candidate() -> None:
    reg = fleet(R1, R2)
    marks = CandidateMarks(reg)
    old, new = marks.marker(""), marks.marker("m")  # R1 moved from group "" to "m"
    old.set_removal_candidate(R1, True)
    new.set_removal_candidate(R1, True)
    old.set_removal_candidate(R1, False)  # the old group lets go: the new one still marks it
    assert marks.marked() == {R1} and reg.calls == [(R1, True)]
    new.set_removal_candidate(R2, True)
    marks.drop_group("m")  # a group gone takes its marks with it
    assert marks.marked() == set() and reg.calls[-2:] == [(R1, False), (R2, False)]
    assert "m" not in marks.auto


def test_scale_groups_by_served_model() -> None:
    views = [view(R1, "b"), view(R2), view(R3, "b", "a"), view(R4, "a", "b")]
    assert {g: [v.id for v in vs] for g, vs in scale_groups(views).items()} == {"": [R2], "a,b": [R3, R4], "b": [R1]}
    assert scale_groups([]) == {"": ()}  # an empty fleet still has its (fleet-wide) signal


def loop_for(reg: FakeRegistry, resident: dict[ReplicaId, int], **config: float) -> tuple[ScaleLoop, GatewayMetrics]:
    metrics = GatewayMetrics()
    loop = ScaleLoop(ScaleConfig.model_validate(config), reg, reg.list, FakeIndex(resident), 600.0, metrics)
    return loop, metrics


async def test_evaluate_ranks_coldest_first_and_exports_metrics() -> None:
    reg = fleet(R1, R2, R3)
    loop, metrics = loop_for(reg, {R1: 900, R2: 100, R3: 500}, hit_weight=1.0)
    loop.hits.record(R2, 1000)  # recent hits make R2 the hottest
    report = await loop.evaluate()
    data = report_json(report)
    ranking: list[dict[str, object]] = data["ranking"]  # type: ignore[assignment]
    assert [r["url"] for r in ranking] == [R3, R1, R2]
    assert ranking[2]["cache_value_tokens"] == 1100 and ranking[2]["hit_tokens"] == 1000
    assert data["candidate"] == R3 and data["removal_candidates"] == []
    assert data["desired_replicas"] == 3 and data["current_replicas"] == 3
    assert data["models"] == {"": {"desired_replicas": 3, "current_replicas": 3, "candidate": R3,
                                   "reason": "cooldown", "removal_candidates": []}}  # low usage, not long enough
    assert ranking[0]["model"] == ""
    text = metrics.exposition().decode()
    assert 'kvgate_desired_replicas{model=""} 3.0' in text
    assert f'kvgate_replica_cache_value_tokens{{replica="{R1}"}} 900.0' in text
    assert f'kvgate_replica_deletion_cost{{replica="{R1}"}} 0.0' in text  # 900 // 4096


async def test_prepare_removal_marks_the_coldest_and_is_stable() -> None:
    reg = fleet(R1, R2, R3)
    index = {R1: 900, R2: 100, R3: 500}
    loop, _ = loop_for(reg, index)
    data = report_json(await loop.prepare_removal(1))
    assert data["removal_candidates"] == [R2] and data["candidate"] == R2
    assert reg.views[R2].removal_candidate
    index[R3] = 50  # R3 is now colder, but the marked one stays marked
    loop2 = report_json(await loop.prepare_removal(1))
    assert loop2["removal_candidates"] == [R2]
    assert report_json(await loop.prepare_removal(0))["removal_candidates"] == []
    assert not reg.views[R2].removal_candidate


async def test_advisor_marks_after_cooldown() -> None:
    reg = fleet(R1, R2, R3)
    loop, metrics = loop_for(reg, {R1: 10}, cooldown_s=0.0)
    report = await loop.evaluate()
    assert report.advice[""].desired_replicas == 2 and report.advice[""].reason == "low-usage"
    assert report.marked == {R2} or report.marked == {R3}  # the coldest (R2, R3 hold nothing)
    assert 'kvgate_desired_replicas{model=""} 2.0' in metrics.exposition().decode()


async def test_each_model_scales_on_its_own_signal() -> None:
    """Model "hot" (R1, R2) holds 3800 of its 4000 tokens, "cold" (R3, R4) 10: two advisors,
    two series, and the cold model's removal candidate is its own replica, though hot's R2
    is as cold as any (a fleet-wide advisor would mark R2: the fleet is at 48 %)."""
    reg = FakeRegistry({R1: view(R1, "hot"), R2: view(R2, "hot"), R3: view(R3, "cold"), R4: view(R4, "cold")})
    loop, metrics = loop_for(reg, {R1: 3800, R3: 10}, cooldown_s=0.0)
    report = await loop.evaluate()
    hot, cold = report.advice["hot"], report.advice["cold"]
    assert (hot.desired_replicas, hot.current_replicas, hot.reason) == (3, 2, "working-set")
    assert (cold.desired_replicas, cold.current_replicas, cold.reason) == (1, 2, "low-usage")
    assert report.marked == {R4} and reg.views[R4].removal_candidate and not reg.views[R2].removal_candidate
    text = metrics.exposition().decode()
    series = [line for line in text.splitlines() if line.startswith("kvgate_desired_replicas{")]
    assert sorted(series) == ['kvgate_desired_replicas{model="cold"} 1.0', 'kvgate_desired_replicas{model="hot"} 3.0']
    data = report_json(report)
    assert data["desired_replicas"] == 4 and data["current_replicas"] == 4
    models: dict[str, dict[str, object]] = data["models"]  # type: ignore[assignment]
    assert models["cold"]["candidate"] == R4 and models["cold"]["removal_candidates"] == [R4]
    assert models["hot"]["candidate"] == R2 and models["hot"]["removal_candidates"] == []
    assert data["candidate"] == R4 and data["removal_candidates"] == [R4]  # the fleet's: a marked one first
    del reg.views[R3], reg.views[R4]  # the cold pool is gone
    report = await loop.evaluate()
    assert list(report.advice) == ["hot"] and set(loop.advisors) == {"hot"} and report.marked == set()
    series = [line for line in metrics.exposition().decode().splitlines() if line.startswith("kvgate_desired_")]
    assert series == ['kvgate_desired_replicas{model="hot"} 3.0']


async def test_prepare_removal_of_one_model() -> None:
    reg = FakeRegistry({R1: view(R1, "a"), R2: view(R2, "a"), R3: view(R3, "b"), R4: view(R4, "b")})
    loop, _ = loop_for(reg, {R1: 900, R2: 100, R3: 50, R4: 500})
    data = report_json(await loop.prepare_removal(1, "b"))
    assert data["removal_candidates"] == [R3]
    data = report_json(await loop.prepare_removal(1, "a"))  # b's mark stays
    assert data["removal_candidates"] == [R2, R3]
    models: dict[str, dict[str, object]] = data["models"]  # type: ignore[assignment]
    assert models["a"]["candidate"] == R2 and models["b"]["removal_candidates"] == [R3]
    assert report_json(await loop.prepare_removal(0, "b"))["removal_candidates"] == [R2]
    assert report_json(await loop.prepare_removal(1))["removal_candidates"] == [R2]  # the fleet's: R2 kept
    with pytest.raises(UnknownGroup):
        await loop.prepare_removal(1, "c")


def test_scale_config_defaults_and_settings() -> None:
    assert ScaleConfig().params() == ScaleParams()
    s = load_settings(None, {"scale": {"interval_s": 1, "cooldown_s": 60, "annotate_pods": False}})
    assert s.scale.interval_s == 1.0 and s.scale.params().cooldown_s == 60.0


async def test_admin_scale_endpoints_and_hit_feedback() -> None:
    fake = fake_fleet({A: ok_completion, B: ok_completion})
    a, b = fake.urls(A, B)
    async with gateway(fake, settings_for([a, b])) as client:
        r = await client.post("/v1/chat/completions", content=CHAT, headers={"content-type": "application/json"})
        served = r.headers["x-kvgate-replica"]
        scale = (await client.get("/admin/scale")).json()
        prepared = (await client.post("/admin/scale/prepare-removal", json={"count": 1})).json()
        replicas = {v["url"]: v for v in (await client.get("/admin/replicas")).json()["data"]}
        bad = await client.post("/admin/scale/prepare-removal", json={"count": -1})
        unknown = await client.post("/admin/scale/prepare-removal", json={"count": 1, "model": "nope"})
        metrics = (await client.get("/metrics")).text
    hits = {row["url"]: row["hit_tokens"] for row in scale["ranking"]}
    assert hits[served] == 64  # the usage's cached_tokens, recorded by the proxy
    other = b if served == a else a
    assert scale["candidate"] == other and scale["current_replicas"] == 2
    assert prepared["removal_candidates"] == [other] and replicas[other]["removal_candidate"]
    assert bad.status_code == 400
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    assert 'kvgate_desired_replicas{model="m"}' in metrics  # the fake replicas serve "m"


async def test_admin_prepare_removal_of_one_model() -> None:
    fake = fake_fleet({A: ok_completion, B: ok_completion}, models={A: "m1", B: "m2"})
    a, b = fake.urls(A, B)
    async with gateway(fake, settings_for([a, b])) as client:
        scale = (await client.get("/admin/scale")).json()
        prepared = (await client.post("/admin/scale/prepare-removal", json={"count": 1, "model": "m2"})).json()
    assert set(scale["models"]) == {"m1", "m2"} and scale["models"]["m2"]["current_replicas"] == 1
    assert prepared["removal_candidates"] == [b] and prepared["models"]["m1"]["removal_candidates"] == []


async def test_admin_scale_needs_token() -> None:
    fake = fake_fleet({A: ok_completion})
    async with gateway(fake, settings_for(fake.urls(A), admin={"token": "t"})) as client:
        assert (await client.get("/admin/scale")).status_code == 401
        ok = await client.get("/admin/scale", headers={"authorization": "Bearer t"})
    assert ok.status_code == 200 and ok.json()["candidate"] == fake.url(A)
