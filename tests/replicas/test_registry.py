"""The registry's state machine over a transport stub and a fake clock."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

import pytest

from replicas import registry as registry_module
from replicas.config import RegistryConfig
from replicas.drain import DrainInfo
from replicas.model import ReplicaState
from replicas.probe import Capacity, ReportedLoad
from replicas.registry import Registry
from tests.replicas.fakes import FakeClock, FakeFleet, FakeReplica, RecordingListener, loads_body

A = "http://127.0.0.1:31001"
B = "http://127.0.0.1:31002"
C = "http://127.0.0.1:31003"


@dataclass
class Harness:
    fleet: FakeFleet
    clock: FakeClock
    reg: Registry
    events: RecordingListener

    def rep(self, url: str) -> FakeReplica:
        return self.fleet.replicas[url]

    def state(self, url: str) -> ReplicaState | None:
        view = self.reg.get(url)
        return view.state if view else None


@contextlib.asynccontextmanager
async def harness(
    *urls: str, fleet: FakeFleet | None = None, **cfg: object
) -> AsyncIterator[Harness]:
    """A registry over a fake fleet (healthy replicas at ``urls`` unless ``fleet`` has
    them already), each added before the test body runs."""
    fleet = fleet or FakeFleet()
    for url in urls:
        if url not in fleet.replicas:
            fleet.add(url)
    clock, events = FakeClock(), RecordingListener()
    async with fleet.client() as client:
        reg = Registry(RegistryConfig.model_validate(cfg), client, clock=clock)
        reg.add_listener(events)
        for url in urls:
            await reg.add(url)
        yield Harness(fleet, clock, reg, events)


def fleet_with(url: str, **kw: object) -> FakeFleet:
    fleet = FakeFleet()
    fleet.add(url, **kw)
    return fleet


async def test_joining_until_first_ok_probe_then_active_with_capacity() -> None:
    async with harness(fleet=fleet_with(A, ready=None)) as h:
        view = await h.reg.add(A + "/")
        assert view.id == A and view.state is ReplicaState.JOINING and view.device_tokens == 0
        for _ in range(5):
            await h.reg.probe_all()
        assert h.state(A) is ReplicaState.JOINING  # a joining replica never turns unhealthy
        h.rep(A).ready = 200
        await h.reg.probe_all()
        v = h.reg.get(A)
        assert v is not None and v.state is ReplicaState.ACTIVE
        assert (v.device_tokens, v.host_tokens, v.page_size) == (600_000, 1_200_000, 64)
        assert v.max_running_requests == 128 and v.added_at_s == h.clock.now
        assert h.reg.models()[0]["id"] == "kimi-k2"
        assert h.events.events == [("added", A, "joining"), ("state", A, "joining->active")]


async def test_hysteresis_unhealthy_after_three_failures_active_after_two_successes() -> None:
    async with harness(A) as h:
        h.rep(A).ready = None
        await h.reg.probe_all()
        for _ in range(10):
            h.reg.report_failure(A, "connect")  # passive failures go to the outlier detector only
        assert h.state(A) is ReplicaState.ACTIVE
        await h.reg.probe_all()
        assert h.state(A) is ReplicaState.ACTIVE
        await h.reg.probe_all()
        assert h.state(A) is ReplicaState.UNHEALTHY
        h.rep(A).ready = 200
        await h.reg.probe_all()
        assert h.state(A) is ReplicaState.UNHEALTHY
        await h.reg.probe_all()
        assert h.state(A) is ReplicaState.ACTIVE
        assert [e for e in h.events.events if e[0] == "state"] == [
            ("state", A, "joining->active"),
            ("state", A, "active->unhealthy"),
            ("state", A, "unhealthy->active"),
        ]


def _routable(h: Harness, url: str) -> bool:
    view = next(v for v in h.reg.views() if v.id == url)
    return view.routable


async def test_passive_failures_eject_an_outlier_for_a_while() -> None:
    async with harness(A, B, C) as h:
        for report in ("fail", "fail", "ok", "fail", "fail", "fail", "fail"):
            if report == "ok":
                h.reg.report_success(A)
            else:
                h.reg.report_failure(A, "disconnect")
        assert _routable(h, A)  # the success reset the streak: 4 in a row so far
        h.reg.report_failure(A, "disconnect")
        view = h.reg.get(A)
        assert view is not None and view.ejected and not view.routable and view.state is ReplicaState.ACTIVE
        assert h.reg.ejections_total == {(A, "consecutive"): 1}
        for _ in range(5):
            h.reg.report_failure(B, "disconnect")
        assert _routable(h, B)  # 50 % of 3 replicas: one ejected at a time
        h.clock.advance(31.0)
        assert _routable(h, A)
        h.reg.report_failure(A, "disconnect")  # still failing: ejected again at once, for longer
        assert not _routable(h, A)
        h.clock.advance(31.0)
        assert not _routable(h, A)
        h.clock.advance(30.0)
        assert _routable(h, A)
        h.reg.report_failure("http://unknown:1", "ignored")


async def test_the_last_routable_replica_is_never_ejected() -> None:
    async with harness(A) as h:
        for _ in range(20):
            h.reg.report_failure(A, "disconnect")
        assert _routable(h, A) and h.reg.ejections_total == {}


async def test_probe_timeout_ejects_at_once_until_a_probe_answers(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with harness(A, B) as h:
        h.rep(A).hung = True
        await h.reg.probe_all()
        assert not _routable(h, A) and h.state(A) is ReplicaState.ACTIVE
        assert h.reg.ejections_total == {(A, "probe_timeout"): 1}
        await h.reg.probe_all()
        h.clock.advance(10.0)
        await h.reg.probe_all()
        assert h.state(A) is ReplicaState.UNHEALTHY  # three failed probes
        h.rep(A).hung = False
        await h.reg.probe_all()
        assert _routable(h, A) is False  # unhealthy until two successes
        await h.reg.probe_all()
        assert _routable(h, A)
    failures = [r for r in caplog.records if "probe of" in r.getMessage() and r.levelname == "WARNING"
                and "failed" in r.getMessage()]
    assert len(failures) == 1  # rate-limited: the first of the streak (the next ones within 30 s)
    assert any("answers again after 3 failure(s)" in r.getMessage() for r in caplog.records)


async def test_falls_back_to_health_when_ready_is_404() -> None:
    async with harness(A, fleet=fleet_with(A, ready=404)) as h:
        assert h.state(A) is ReplicaState.ACTIVE
        h.rep(A).calls.clear()
        await h.reg.probe_all()
        assert h.rep(A).calls == ["/health"]
        h.rep(A).health = 503  # old SGLang: 503 on /health is a failure, not a drain
        for _ in range(3):
            await h.reg.probe_all()
        assert h.state(A) is ReplicaState.UNHEALTHY


async def test_ready_503_drains_then_removed_when_empty() -> None:
    async with harness(A, readd_static_after_self_drain=False) as h:
        lease = h.reg.lease(A, 100)
        h.rep(A).ready = 503  # SIGTERM: SGLang keeps accepting, the gateway must stop sending
        await h.reg.probe_all()
        view = h.reg.get(A)
        assert view is not None and view.state is ReplicaState.DRAINING and not view.routable
        assert view.drain_deadline_s == h.clock.now + 600.0
        lease.first_byte()
        lease.release()
        assert h.reg.get(A) is None and h.reg.views() == ()
        assert h.events.events[-1] == ("removed", A, "")
        lease.release()  # idempotent, even after removal


async def test_self_drain_ends_when_ready_again() -> None:
    async with harness(A) as h:
        lease = h.reg.lease(A, 0)
        h.rep(A).ready = 503  # e.g. /pause_generation
        await h.reg.probe_all()
        assert h.state(A) is ReplicaState.DRAINING
        h.rep(A).ready = 200
        await h.reg.probe_all()
        view = h.reg.get(A)
        assert (
            view is not None and view.state is ReplicaState.ACTIVE and view.drain_deadline_s is None
        )
        lease.release()
        assert h.state(A) is ReplicaState.ACTIVE


async def test_static_replica_rejoins_after_its_self_drain() -> None:
    async with harness(A, replicas=[A]) as h:
        h.rep(A).ready = 503
        await h.reg.probe_all()  # idle: drained and removed at once, then added back as joining
        assert h.state(A) is ReplicaState.JOINING
        assert h.events.events[-2:] == [("removed", A, ""), ("added", A, "joining")]
        await h.reg.probe_all()
        assert h.state(A) is ReplicaState.JOINING  # still 503: not ready yet
        h.rep(A).ready = 200
        await h.reg.probe_all()
        assert h.state(A) is ReplicaState.ACTIVE


async def test_operator_drain_with_deadline_and_undrain() -> None:
    async with harness(A, B) as h:
        lease_a, lease_b = h.reg.lease(A, 10), h.reg.lease(B, 10)
        view = await h.reg.drain(A, deadline_s=30)
        assert view.state is ReplicaState.DRAINING and view.drain_deadline_s == h.clock.now + 30
        await h.reg.probe_all()  # a 200 on /ready does not end an operator's drain
        assert h.state(A) is ReplicaState.DRAINING
        assert (await h.reg.undrain(A)).state is ReplicaState.ACTIVE
        await h.reg.drain(B, deadline_s=30)
        h.clock.advance(29)
        h.reg.check_drains()
        assert h.state(B) is ReplicaState.DRAINING
        h.clock.advance(1)
        h.reg.check_drains()
        assert h.reg.get(B) is None and [v.id for v in h.reg.views()] == [A]
        assert ("removed", B, "") in h.events.events
        lease_b.first_byte()
        lease_b.release()  # the request finished on its own after removal
        lease_a.release()
        assert h.reg.get(A) is not None and h.reg.get(A).in_flight == 0  # type: ignore[union-attr]


async def test_drain_of_an_idle_replica_removes_it_and_unknown_urls_raise() -> None:
    async with harness(A) as h:
        view = await h.reg.drain(A)
        assert view.state is ReplicaState.REMOVED and h.reg.get(A) is None
        for op in (h.reg.drain(A), h.reg.undrain(A), h.reg.remove(A)):
            with pytest.raises(KeyError):
                await op
        with pytest.raises(KeyError):
            h.reg.set_removal_candidate(A, True)


async def test_undrain_of_a_never_probed_replica_returns_to_joining() -> None:
    async with harness(A, fleet=fleet_with(A, ready=None)) as h:
        h.reg.lease(A, 1)
        await h.reg.drain(A)
        assert (await h.reg.undrain(A)).state is ReplicaState.JOINING


async def test_a_draining_replica_is_not_polled_for_its_loads() -> None:
    """A SIGTERM'd SGLang drains (``/ready`` 503) and can hang in its exit on a
    ``/v1/loads`` call: once draining, the gateway stops asking."""
    async with harness(A, fleet=fleet_with(A, loads=loads_body((12, 3, 5000, 0.5)))) as h:
        await h.reg.probe_all()
        lease = h.reg.lease(A, 1)  # in flight: the drain waits for it
        await h.reg.drain(A)
        await h.reg.poll_loads()
        view = h.reg.get(A)
        assert view is not None and view.state is ReplicaState.DRAINING and view.reported_running == 0
        await h.reg.undrain(A)
        await h.reg.poll_loads()
        view = h.reg.get(A)
        assert view is not None and view.reported_running == 12
        lease.release()


async def test_leases_and_reported_load_combine_in_views() -> None:
    async with harness(
        A, fleet=fleet_with(A, loads=loads_body((12, 3, 5000, 0.5), (8, 1, 1000, 0.25)))
    ) as h:
        l1, l2 = h.reg.lease(A, 1000), h.reg.lease(A, 500)
        l2.first_byte()
        await h.reg.poll_loads()
        v = h.reg.get(A)
        assert v is not None
        assert (v.in_flight, v.pending_prefill_tokens, v.decoding) == (2, 1000, 1)
        assert (v.reported_running, v.reported_waiting, v.reported_waiting_uncached_tokens) == (
            20,
            4,
            6000,
        )
        assert v.reported_token_usage == pytest.approx(0.375)
        h.rep(A).ready = None  # health checks never reset load accounting
        for _ in range(3):
            await h.reg.probe_all()
        v = h.reg.get(A)
        assert v is not None and v.state is ReplicaState.UNHEALTHY and v.in_flight == 2
        l1.release()
        l2.release()
        assert h.reg.get(A).in_flight == 0  # type: ignore[union-attr]


async def test_remove_keeps_leases_valid_and_lease_on_unknown_url_is_detached() -> None:
    async with harness(A) as h:
        lease = h.reg.lease(A, 5)
        await h.reg.remove(A)
        assert h.events.events[-1] == ("removed", A, "")
        await h.reg.add(A)
        lease.release()  # counts against the old record, not the new one
        assert h.reg.get(A).in_flight == 0  # type: ignore[union-attr]
        h.reg.lease("http://gone:1", 5).release()


class Broken:
    def on_added(self, view: object) -> None:
        raise RuntimeError("bug in a listener")

    def on_removed(self, replica_id: object) -> None:
        raise RuntimeError("bug in a listener")

    def on_state_changed(self, view: object, old_state: object) -> None:
        raise RuntimeError("bug in a listener")


async def test_removal_candidate_models_union_and_listener_errors() -> None:
    fleet = FakeFleet()
    for url, model in ((A, "m1"), (B, "m1"), (C, "m2")):
        fleet.add(url, model=model)
    async with harness(fleet=fleet) as h:
        h.reg.add_listener(Broken())
        for url in (A, B, C):
            await h.reg.add(url)
        assert [m["id"] for m in h.reg.models()] == ["m1", "m2"]
        h.reg.set_removal_candidate(B, True)
        v = h.reg.get(B)
        assert v is not None and v.removal_candidate and v.routable and not v.accepts_new_sessions
        assert h.events.events[-1] == ("state", B, "active->active")
        assert [v.id for v in h.reg.views()] == [A, B, C]


async def test_start_and_stop_run_the_loops() -> None:
    fleet = fleet_with(A)
    fleet.add(B, ready=None)
    async with fleet.client() as client:
        reg = Registry(
            RegistryConfig(replicas=[A, B], probe_interval_s=0.01, loads_poll_interval_s=0.01),
            client,
            clock=FakeClock(),
        )
        await reg.start()
        assert reg.get(A).state is ReplicaState.ACTIVE  # type: ignore[union-attr]
        assert reg.get(B).state is ReplicaState.JOINING  # type: ignore[union-attr]
        fleet.replicas[B].ready = 200
        async with asyncio.timeout(5):  # the loops probe and poll by themselves
            while reg.get(B).state is not ReplicaState.ACTIVE or reg.get(A).reported_running != 3:  # type: ignore[union-attr]
                await asyncio.sleep(0.01)
        await reg.stop()


async def test_the_drain_loop_removes_at_the_deadline_and_sleeps_when_nothing_drains() -> None:
    fleet = fleet_with(A)
    fleet.add(B)
    clock = FakeClock()
    async with fleet.client() as client:
        reg = Registry(RegistryConfig(replicas=[A, B], drain_check_interval_s=0.01), client, clock=clock)
        await reg.start()
        try:
            assert not reg._draining.is_set()  # nothing drains: the loop waits, no ticks
            lease = reg.lease(A, 0)  # a request in flight keeps A until the deadline
            await reg.drain(A, deadline_s=30)
            assert reg.get(A).state is ReplicaState.DRAINING  # type: ignore[union-attr]
            await asyncio.sleep(0.05)  # the loop ticks: A is still within its deadline
            assert reg.get(A) is not None and reg._draining.is_set()
            clock.advance(31)
            async with asyncio.timeout(5):  # the loop, not a call of ours, removes A
                while reg.get(A) is not None:
                    await asyncio.sleep(0.01)
            async with asyncio.timeout(5):
                while reg._draining.is_set():  # and goes back to sleep
                    await asyncio.sleep(0.01)
            lease.release()
            assert [v.id for v in reg.views()] == [B]
        finally:
            await reg.stop()


async def test_ids_are_the_views_replicas_in_their_order() -> None:
    async with harness(A, B) as h:
        assert h.reg.ids() == tuple(v.id for v in h.reg.views()) and len(h.reg.ids()) == 2


@pytest.mark.parametrize(("replicas", "batch", "batches"), [(40, 16, [16, 16, 8]), (40, 0, [40]), (16, 16, [16])])
async def test_probes_of_a_large_fleet_go_in_batches_spread_over_the_interval(
        monkeypatch: pytest.MonkeyPatch, replicas: int, batch: int, batches: list[int]) -> None:
    """``poll_batch`` replicas at a time, each batch one gap (interval / batches) after the
    previous one's start; 0 (or a fleet that small): all at once, no wait."""
    urls = [f"http://127.0.0.1:{32000 + i}" for i in range(replicas)]
    async with harness(*urls, poll_batch=batch, probe_interval_s=0.3) as h:
        started: list[int] = []  # per replica probed: how many waits came before it
        waits: list[float] = []
        sleep = asyncio.sleep

        async def fake_sleep(delay: float) -> None:
            waits.append(delay)
            await sleep(0)  # (the batch already started runs its first steps)

        def probe(rec: object) -> Coroutine[Any, Any, None]:
            waited = len(waits)  # when the batch is started (its probes run a step later)

            async def run() -> None:
                started.append(waited)
            return run()

        monkeypatch.setattr(registry_module.asyncio, "sleep", fake_sleep)
        await h.reg._spread(0.3, probe, list(h.reg._table.records.values()))
        assert [started.count(i) for i in range(len(batches))] == batches and len(started) == replicas
        gap = 0.3 / len(batches)
        assert len(waits) == len(batches) - 1
        assert all((i + 1) * gap - 0.05 < w <= (i + 1) * gap for i, w in enumerate(waits))
        monkeypatch.undo()
        await h.reg.probe_all()  # the real probes through the same path: every replica answered
        assert all(h.rep(u).calls.count("/ready") == 2 for u in urls)  # (one at add)


async def test_a_replicas_view_is_kept_until_something_it_is_made_of_changes() -> None:
    """``ReplicaRecord.view`` hands out the last view while its inputs are unchanged, and a
    new one, equal to a fresh build, after any change of any of them."""
    async with harness(A) as h:
        rec = h.reg._table.records[h.reg.ids()[0]]
        first = rec.view()
        assert rec.view() is first and h.reg.views()[0] is first
        changes = [
            lambda: setattr(rec.counters, "in_flight", rec.counters.in_flight + 1),
            lambda: setattr(rec.counters, "pending_prefill_tokens", 500),
            lambda: setattr(rec.counters, "decoding", 2),
            lambda: setattr(rec.remote, "in_flight", 3),
            lambda: setattr(rec.remote, "pending_prefill_tokens", 70),
            lambda: setattr(rec.remote, "decoding", 1),
            lambda: setattr(rec, "state", ReplicaState.DRAINING),
            lambda: setattr(rec, "capacity", Capacity(device_tokens=123, host_tokens=456)),
            lambda: setattr(rec, "reported", ReportedLoad(running=9, waiting=4)),
            lambda: setattr(rec, "drain", DrainInfo(deadline_s=99.0, by_operator=True)),
            lambda: setattr(rec, "removal_candidate", True),
            lambda: setattr(rec, "ejected", True),
        ]
        previous = first
        for change in changes:
            change()
            view = rec.view()
            assert view is not previous and view == rec._build_view(())
            assert rec.view() is view  # and kept again
            previous = view
        held = rec.view((300,))
        assert held is not previous and held.held_prefill == (300,)


async def test_served_models_per_view_and_cached_union() -> None:
    fleet = FakeFleet()
    for url, model in ((A, "m1"), (B, "m2")):
        fleet.add(url, model=model)
    async with harness(A, B, fleet=fleet) as h:
        assert h.reg.served_models() == frozenset({"m1", "m2"})
        assert {v.id: v.models for v in h.reg.views()} == {A: frozenset({"m1"}), B: frozenset({"m2"})}
        await h.reg.remove(B)
        assert h.reg.served_models() == frozenset({"m1"})  # a replica leaving: recomputed
        fleet.add(C, model="m3", ready=None)
        await h.reg.add(C)
        assert h.reg.served_models() == frozenset({"m1"})  # not probed yet: its models unknown
        fleet.replicas[C].ready = 200
        await h.reg.probe_all()
        assert h.reg.served_models() == frozenset({"m1", "m3"})


def test_served_cards_fall_back_to_server_info() -> None:
    from replicas.probe import served_cards

    card = {"id": "x"}
    assert served_cards([card], Capacity(served_model_name="y")) == [card]
    assert [c["id"] for c in served_cards(None, Capacity(served_model_name="y"))] == ["y"]
    assert served_cards(None, Capacity()) == []
