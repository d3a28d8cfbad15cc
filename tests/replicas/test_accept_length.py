"""Speculative accept length (issue 44): parsed from `/v1/loads` (``include=core,spec``),
smoothed and bounded per replica (`AcceptEstimate`), folded into the learned decode step
once (`ReplicaSpeed.decode_step_s`), carried by the registry's views."""

from __future__ import annotations

import math

import pytest

from replicas.probe import ReportedLoad, fetch_loads, parse_loads
from replicas.speed import (
    ACCEPT_BOUNDS,
    DECODE_TOKENS_PER_STEP,
    FLEET_DECODE_STEP_S,
    AcceptEstimate,
    ReplicaSpeed,
)
from tests.replicas.fakes import FakeFleet
from tests.replicas.test_registry import A, B, harness


def _rank(**extra: object) -> dict[str, object]:
    return {"dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 0, "num_waiting_uncached_tokens": 0,
            "token_usage": 0.1, "max_running_requests": 48, **extra}


def test_parses_the_speculative_section_as_sglang_sends_it() -> None:
    body = {"loads": [_rank(speculative={"accept_length": 2.9, "accept_rate": 0.63}),
                      _rank(dp_rank=1, speculative={"accept_length": 3.1, "accept_rate": 0.7})]}
    assert parse_loads(body) == ReportedLoad(running=4, token_usage=0.1, max_running_requests=96,
                                             spec_accept_length=pytest.approx(3.0))


@pytest.mark.parametrize("spec", [None, {}, {"accept_length": None}, {"accept_length": "x"},
                                  {"accept_length": 0}, {"accept_length": -2.0}, {"accept_length": math.nan},
                                  "garbage"])
def test_no_usable_accept_length_is_none(spec: object) -> None:
    rank = _rank() if spec is None else _rank(speculative=spec)
    load = parse_loads({"loads": [rank]})
    assert load is not None and load.spec_accept_length is None and load.running == 2


def test_only_the_ranks_that_report_one_count() -> None:
    load = parse_loads({"loads": [_rank(speculative={"accept_length": 4.0}), _rank(dp_rank=1)]})
    assert load is not None and load.spec_accept_length == 4.0


def test_the_estimate_takes_its_first_reading_then_moves_in_bounded_steps() -> None:
    a = AcceptEstimate()
    a.observe(None)
    assert a.value is None and a.samples == 0
    a.observe(5.0)
    assert a.value == 5.0
    a.observe(3.5)  # a real drop: followed, a bounded step per poll
    assert 5.0 / 1.25 < a.value < 5.0 and a.value == pytest.approx(5.0 - 0.25 * (5.0 - 4.0))
    for _ in range(60):
        a.observe(3.5)
    assert a.value == pytest.approx(3.5, rel=1e-3)


@pytest.mark.parametrize("outlier", [1e9, math.inf, 0.0, -1.0, math.nan, 1e-9])
def test_an_outlier_reading_is_clipped(outlier: float) -> None:
    a = AcceptEstimate()
    a.observe(5.0)
    a.observe(outlier)
    assert 5.0 / 1.25 * 0.95 < a.value <= 5.0 * (1 + 0.25 * 0.25)  # type: ignore[operator]
    fresh = AcceptEstimate()
    fresh.observe(outlier)
    assert fresh.value is None or ACCEPT_BOUNDS[0] <= fresh.value <= ACCEPT_BOUNDS[1]


def test_a_stalling_replica_keeps_its_last_figure() -> None:
    """Polls that fail or answer without the section (a stalled or restarting replica)
    leave the figure as it was; it never drifts to a bound."""
    s = ReplicaSpeed()
    for _ in range(10):
        s.observe_accept(3.5)
    before = s.spec_accept_length
    for _ in range(100):
        s.observe_accept(None)
    assert s.spec_accept_length == before


def test_the_accept_length_enters_the_decode_step_once() -> None:
    """Streams at 3.5 tokens per 15 ms step: without the accept length the per-stream rate
    gives 5 tokens in 21.4 ms; with it, the learned step is 15 ms and the decode step the
    same 21.4 ms (not 21.4 x 5/3.5: no double counting)."""
    step, accept = 0.015, 3.5
    stream_s = 100 * step / accept  # 100 tokens after the first
    plain, read = ReplicaSpeed(), ReplicaSpeed()
    for _ in range(10):
        read.observe_accept(accept)
    for _ in range(400):  # the expectile follows slower streams slowly (a bounded step down each)
        plain.observe(None, None, None, 101, stream_s)
        read.observe(None, None, None, 101, stream_s)
    expected = DECODE_TOKENS_PER_STEP * step / accept
    assert plain.decode_step_s == pytest.approx(expected, rel=0.02)
    assert read.decode_step_s == pytest.approx(expected, rel=0.02)
    assert 1.0 / read.decode.value == pytest.approx(step, rel=0.02)  # the step rate itself


def test_a_drop_in_accept_length_is_priced_at_the_next_polls() -> None:
    """The upper expectile resists slower streams (it takes them for queueing); a drop in
    the reported accept length moves the decode step within a few polls."""
    read, plain = ReplicaSpeed(), ReplicaSpeed(read_accept=False)
    for s in (read, plain):
        for _ in range(20):
            s.observe_accept(5.0)
            s.observe(None, None, None, 101, 100 * 0.015 / 5.0)
    for s in (read, plain):
        for _ in range(10):
            s.observe_accept(3.5)
            s.observe(None, None, None, 101, 100 * 0.015 / 3.5)
    assert read.decode_step_s > 0.015 * 5.0 / 3.5 * 0.9
    assert plain.decode_step_s < 0.015 * 1.2 and plain.spec_accept_length is None


async def test_the_registry_reads_each_replica_s_accept_length_from_its_loads() -> None:
    fleet = FakeFleet()
    fleet.add(A).loads = {"loads": [_rank(speculative={"accept_length": 3.5, "accept_rate": 0.17})]}
    fleet.add(B)  # no speculative section: behaves as before
    async with harness(A, B, fleet=fleet) as h:
        await h.reg.poll_loads()
        a, b = h.reg.get(A), h.reg.get(B)
        assert a is not None and b is not None
        assert a.spec_accept_length == 3.5
        assert a.decode_step_s == pytest.approx(FLEET_DECODE_STEP_S * DECODE_TOKENS_PER_STEP / 3.5)
        assert b.spec_accept_length is None and b.decode_step_s == pytest.approx(FLEET_DECODE_STEP_S)
    off = FakeFleet()
    off.add(A).loads = {"loads": [_rank(speculative={"accept_length": 3.5})]}
    async with harness(A, fleet=off, learn_speeds=False) as h:
        await h.reg.poll_loads()
        v = h.reg.get(A)
        assert v is not None and v.spec_accept_length is None and v.decode_step_s is None


async def test_one_get_asks_for_core_and_spec() -> None:
    asked: list[tuple[str, float]] = []

    class Get:
        async def __call__(self, url: str, timeout_s: float) -> tuple[int, bytes]:
            asked.append((url, timeout_s))
            return 200, b'{"loads": [{"num_running_reqs": 1, "speculative": {"accept_length": 5.84}}]}'

        async def close(self) -> None:
            pass

    load = await fetch_loads(Get(), "http://r", 1.0)
    assert load is not None and load.spec_accept_length == 5.84 and load.running == 1
    assert asked == [("http://r/v1/loads?include=core,spec", 1.0)]
