"""The gateway's scale loop: hit window, candidate marks, evaluation, metrics, admin API."""
from __future__ import annotations

from dataclasses import dataclass, field

from gateway.metrics import GatewayMetrics
from gateway.scaling import CandidateMarks, HitWindow, ScaleConfig, ScaleLoop, report_json
from gateway.settings import load_settings
from prefix_index.base import ReplicaId
from replicas.model import ReplicaState, ReplicaView
from replicas.scale import ScaleParams
from tests.gateway.test_app_unit import CHAT, A, B, fake_fleet, gateway, ok_completion, settings_for

R1, R2, R3 = ReplicaId("http://r1:1"), ReplicaId("http://r2:1"), ReplicaId("http://r3:1")


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
        self.views[rid] = ReplicaView(rid, self.views[rid].state, removal_candidate=flag,
                                      device_tokens=1000, host_tokens=1000)

    def list(self) -> list[ReplicaView]:
        return list(self.views.values())


@dataclass
class FakeIndex:
    resident: dict[ReplicaId, int]

    async def resident_tokens(self, now_s: float, window_s: float) -> dict[ReplicaId, int]:
        return dict(self.resident)


def fleet(*ids: ReplicaId) -> FakeRegistry:
    return FakeRegistry({r: ReplicaView(r, ReplicaState.ACTIVE, device_tokens=1000, host_tokens=1000) for r in ids})


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
    marks.set_removal_candidate(R1, True)
    marks.set_manual([R1, R2])
    marks.set_removal_candidate(R1, False)  # still manual: stays marked
    assert reg.calls == [(R1, True), (R2, True)]
    marks.set_manual([])
    assert reg.calls[-2:] == [(R1, False), (R2, False)]
    marks.set_removal_candidate(R3, True)  # unknown replica: ignored
    assert marks.marked() == {R3}


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
    assert data["desired_replicas"] == 3 and data["reason"] == "cooldown"  # low usage, not long enough
    text = metrics.exposition().decode()
    assert "kvgate_desired_replicas 3.0" in text
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
    assert report.advice.desired_replicas == 2 and report.advice.reason == "low-usage"
    assert report.marked == {R2} or report.marked == {R3}  # the coldest (R2, R3 hold nothing)
    assert "kvgate_desired_replicas 2.0" in metrics.exposition().decode()


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
        metrics = (await client.get("/metrics")).text
    hits = {row["url"]: row["hit_tokens"] for row in scale["ranking"]}
    assert hits[served] == 64  # the usage's cached_tokens, recorded by the proxy
    other = b if served == a else a
    assert scale["candidate"] == other and scale["current_replicas"] == 2
    assert prepared["removal_candidates"] == [other] and replicas[other]["removal_candidate"]
    assert bad.status_code == 400
    assert "kvgate_desired_replicas" in metrics


async def test_admin_scale_needs_token() -> None:
    fake = fake_fleet({A: ok_completion})
    async with gateway(fake, settings_for(fake.urls(A), admin={"token": "t"})) as client:
        assert (await client.get("/admin/scale")).status_code == 401
        ok = await client.get("/admin/scale", headers={"authorization": "Bearer t"})
    assert ok.status_code == 200 and ok.json()["candidate"] == fake.url(A)
