"""Clocks: the virtual-time fleet (deterministic) and the asyncio real-time driver."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from loadtest.simulator.clock import RealtimeDriver, VirtualFleet
from loadtest.simulator.engine import ReplicaEngine, RequestResult, SimRequest
from loadtest.simulator.profile import load_profile

Entry = tuple[str, int, float, list[int]]


def _ids(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 163_840, n).astype(np.uint32)


class Session:
    """A closed-loop session: each turn resends the history plus something new."""

    def __init__(self, fleet: VirtualFleet, index: int, log: list[Entry]) -> None:
        self.fleet, self.index, self.log = fleet, index, log
        self.prompt = _ids(index, 3000)
        self.turn = 0

    def send(self, now_s: float) -> None:
        self.prompt = np.concatenate([self.prompt, _ids(1000 * self.index + self.turn, 200)])
        req = SimRequest(f"s{self.index}t{self.turn}", self.prompt, 64, stream=False, seed=3)
        self.fleet.submit(self.index % 2, req, self)

    def on_tokens(self, rid: str, token_ids: Sequence[int], now_s: float) -> None:
        raise AssertionError("stream=False requests get no on_tokens")

    def on_finish(self, result: RequestResult, now_s: float) -> None:
        assert now_s == self.fleet.now_s
        self.log.append((result.rid, result.cached_tokens, result.finish_s, result.output_ids))
        self.turn += 1
        if self.turn < 5:
            self.fleet.schedule(now_s + 2.0, self.send)


def _run_fleet() -> tuple[list[Entry], float]:
    profile = load_profile("kimi-k2.6-b200-tp8")
    fleet = VirtualFleet([ReplicaEngine(profile, seed=i) for i in range(2)])
    log: list[Entry] = []
    for i in range(6):
        fleet.schedule(0.5 * i, Session(fleet, i, log).send)
    end = fleet.run()
    return log, end


def test_virtual_fleet_is_deterministic_and_ordered() -> None:
    (log_a, end_a), (log_b, end_b) = _run_fleet(), _run_fleet()
    assert log_a == log_b and end_a == end_b
    assert len(log_a) == 30
    finish_times = [entry[2] for entry in log_a]
    assert finish_times == sorted(finish_times)  # callbacks fire in time order
    later_turns = [entry for entry in log_a if not entry[0].endswith("t0")]
    assert all(e[1] >= 3000 for e in later_turns)  # history is cached


def test_virtual_fleet_run_until_and_snapshot() -> None:
    profile = load_profile("tiny")
    fleet = VirtualFleet([ReplicaEngine(profile)])
    fired: list[float] = []
    fleet.schedule(1.0, fired.append)
    fleet.schedule(3.0, fired.append)
    fleet.run_until(2.0)
    assert fired == [1.0] and fleet.now_s == 2.0
    assert fleet.snapshot(0).is_idle
    fleet.run()
    assert fired == [1.0, 3.0]


class Collector:
    def __init__(self) -> None:
        self.tokens = 0
        self.done = asyncio.Event()
        self.result: RequestResult | None = None

    def on_tokens(self, rid: str, token_ids: Sequence[int], now_s: float) -> None:
        self.tokens += len(token_ids)

    def on_finish(self, result: RequestResult, now_s: float) -> None:
        self.result = result
        self.done.set()


async def test_realtime_driver_streams_a_request() -> None:
    engine = ReplicaEngine(load_profile("tiny"))
    driver = RealtimeDriver(engine, time_scale=20.0)
    task = asyncio.create_task(driver.run())
    try:
        await asyncio.sleep(0)
        sink = Collector()
        driver.submit(SimRequest("a", _ids(1, 500), 20, ignore_eos=True), sink)
        await asyncio.wait_for(sink.done.wait(), timeout=30)
        assert sink.result is not None and sink.result.completion_tokens == 20
        assert sink.tokens == 20
        assert sink.result.finish_s <= driver.now_s()
        assert driver.snapshot().is_idle
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
