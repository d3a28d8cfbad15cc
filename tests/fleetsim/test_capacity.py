"""Capacity at SLO: the bisection (fake runner), the SLO test, the report and the chart."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from loadtest.fleetsim.capacity import (
    Point,
    Slo,
    add_capacity_arguments,
    capacity_doc,
    capacity_lines,
    find_capacity,
    write_chart,
)

SLO = Slo(ttft_p99_s=3.0, tps_p50=200.0)


def fake_summary(c: int, knee: int) -> dict[str, Any]:
    """TTFT p99 grows with load and crosses 3 s just above ``knee`` sessions."""
    return {"ttft_p99_s": 3.0 * c / knee, "output_tps_per_user_p50": 300.0 - c / 10,
            "throughput_tokens_per_s_per_gpu": c * 0.5, "cache_hit_rate": 0.9}


class FakeRunner:
    def __init__(self, knee: int) -> None:
        self.knee = knee
        self.calls: list[int] = []

    def __call__(self, c: int) -> Point:
        self.calls.append(c)
        return Point.of(c, fake_summary(c, self.knee), SLO)


@pytest.mark.parametrize("knee", [9, 37, 64, 100, 199])
def test_bisection_finds_the_largest_concurrency_within_the_slo(knee: int) -> None:
    runner = FakeRunner(knee)
    cap = find_capacity("p", runner, 8, 200, step=1)
    assert cap.best is not None and cap.best.concurrency == knee
    assert cap.best.within_slo and not cap.below_min and not cap.at_max
    assert len(runner.calls) == len(set(runner.calls))  # every concurrency run once
    assert len(runner.calls) <= 2 + 8  # ends + log2(192)
    assert [p.concurrency for p in cap.points] == sorted(runner.calls)


def test_step_bounds_the_precision_and_the_runs() -> None:
    runner = FakeRunner(70)
    cap = find_capacity("p", runner, 8, 256, step=8)
    assert cap.best is not None and 62 < cap.best.concurrency <= 70
    assert len(runner.calls) <= 2 + 5


def test_bracket_ends() -> None:
    low = find_capacity("p", FakeRunner(4), 8, 64)
    assert low.best is None and low.below_min and [p.concurrency for p in low.points] == [8]
    high = find_capacity("p", FakeRunner(500), 8, 64)
    assert high.best is not None and high.best.concurrency == 64 and high.at_max


def test_interactivity_floor_is_part_of_the_slo() -> None:
    slow = {"ttft_p99_s": 1.0, "output_tps_per_user_p50": 150.0}
    assert not SLO.met(slow)
    assert SLO.met({"ttft_p99_s": 3.0, "output_tps_per_user_p50": 200.0})
    assert not SLO.met({"ttft_p99_s": None, "output_tps_per_user_p50": 250.0})


def test_bad_bracket_is_an_error() -> None:
    with pytest.raises(ValueError):
        find_capacity("p", FakeRunner(10), 0, 10)
    with pytest.raises(ValueError):
        find_capacity("p", FakeRunner(10), 20, 10)


def test_report_json_and_chart(tmp_path: Path) -> None:
    caps = [find_capacity("a", FakeRunner(50), 8, 128, 4), find_capacity("b", FakeRunner(4), 8, 128, 4)]
    doc = capacity_doc(SLO, caps, {"replicas": 8})
    assert [c["sessions"] for c in doc["capacity"]] == [caps[0].best.concurrency if caps[0].best else -1, 0]
    assert doc["capacity"][1]["below_min"] is True
    lines = capacity_lines(SLO, caps)
    assert lines[1].startswith("  a: ") and "below the bracket" in lines[2]
    png = write_chart(tmp_path / "cap.png", SLO, caps)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_arguments_defaults() -> None:
    p = argparse.ArgumentParser()
    add_capacity_arguments(p)
    add_capacity_arguments(p)  # a second call (kvgate simulate's parser has them) is harmless
    args = p.parse_args(["--capacity", "--chart", "c.png"])
    assert args.capacity and args.slo_ttft_p99 == 3.0 and args.slo_tps_p50 == 200.0
    assert args.chart == "c.png" and args.capacity_min <= args.capacity_max


def test_run_capacity_end_to_end_on_tiny_traces(tmp_path: Path) -> None:
    """The whole search over real simulations (tiny profile, six sessions), JSON and chart."""
    import orjson

    from loadtest.simulate_cmd import add_arguments
    from loadtest.simulate_cmd import run as simulate
    from tests.fleetsim.support import write_claude_traces

    traces = write_claude_traces(tmp_path / "cc")
    p = argparse.ArgumentParser()
    add_arguments(p)  # includes the capacity arguments
    out, chart = tmp_path / "cap.json", tmp_path / "cap.png"
    args = p.parse_args(["--trace", str(traces), "--profile", "tiny", "--replicas", "2",
                         "--policy", "cache-aware,round-robin", "--capacity", "--capacity-min", "1",
                         "--capacity-max", "6", "--capacity-step", "1", "--slo-ttft-p99", "60",
                         "--slo-tps-p50", "1", "--json", str(out), "--chart", str(chart)])
    assert simulate(args) == 0  # kvgate simulate --capacity
    doc = orjson.loads(out.read_bytes())
    assert [c["policy"] for c in doc["capacity"]] == ["cache-aware", "round-robin"]
    for c in doc["capacity"]:  # a generous SLO: every concurrency up to the bracket's top
        assert c["sessions"] == 6 and c["at_max"] and c["at_capacity"]["within_slo"]
        assert c["at_capacity"]["tokens_per_s_per_gpu"] > 0
    assert chart.exists()
