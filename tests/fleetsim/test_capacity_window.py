"""The steady-state window of a closed-loop run (hand-made records) and its use by --capacity."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import orjson
import pytest

from loadtest.fleetsim.capacity import Point, Slo
from loadtest.fleetsim.metrics import (
    Record,
    Window,
    live_intervals,
    session_roots,
    steady_window,
    tokens_in,
    window_summary,
)
from tests.fleetsim.support import write_claude_traces


def rec(session: str, arrival: float, finish: float | None, *, ttft: float = 0.5, out: int = 11,
        agent: bool = False, rejected: bool = False, prompt: int = 100, cached: int = 50) -> Record:
    r = Record(session, 0, agent, arrival, prompt)
    if rejected:
        r.rejected = True
        r.finish_s = finish
        return r
    r.first_token_s, r.finish_s = arrival + ttft, finish
    r.completion_tokens, r.cached_device = out, cached
    return r


def pool() -> list[Record]:
    """Target 2 over a pool of 3: A lives [0, 10], B [0, 4], C replaces B at 4 and lives to 12."""
    return [rec("A", 0, 3), rec("A", 6, 10), rec("B", 0, 4), rec("C", 4, 8), rec("C", 9, 12)]


def test_window_runs_from_the_target_reached_to_the_first_drop() -> None:
    w = steady_window(pool(), 2)
    assert w == Window(2, 0.0, 10.0) and w.length_s == 10.0  # B's end and C's start at 4 tie


def test_no_window_when_the_target_is_never_live() -> None:
    assert steady_window(pool(), 3) is None
    assert steady_window([], 1) is None


def test_window_starts_after_a_ramp() -> None:
    records = [rec("A", 0, 9), rec("B", 2, 5), rec("C", 5, 7)]  # B starts at 2 (ramp): 2 live
    assert steady_window(records, 2) == Window(2, 2.0, 7.0)


def test_subagents_count_for_their_root_session() -> None:
    records = [rec("A", 0, 6), rec("A/sub", 6.5, 11, agent=True), rec("B", 0, 20)]
    roots = {"A": "A", "A/sub": "A", "B": "B"}
    assert live_intervals(records, roots)["A"] == (0.0, 11.0)
    assert steady_window(records, 2, roots) == Window(2, 0.0, 11.0)
    assert "A/sub" not in live_intervals(records)  # without roots: subagent records left out
    assert steady_window(records, 2) == Window(2, 0.0, 6.0)


def test_a_request_rejected_before_an_engine_ends_at_its_arrival() -> None:
    records = [rec("A", 0, 5), rec("A", 7, None, rejected=True), rec("B", 0, 30)]
    assert live_intervals(records)["A"] == (0.0, 7.0)


def test_tokens_are_spread_from_the_first_token_to_the_finish() -> None:
    r = rec("A", 1.5, 12, ttft=0.5, out=11)  # first token at 2, ten more over [2, 12]
    assert tokens_in(r, 0, 7) == pytest.approx(1 + 10 * 5 / 10)
    assert tokens_in(r, 7, 100) == pytest.approx(5)
    assert tokens_in(r, 0, 100) == pytest.approx(11)
    assert tokens_in(r, 20, 30) == 0
    assert tokens_in(rec("A", 0, None, rejected=True), 0, 10) == 0


def test_window_summary_counts_arrivals_in_it_and_tokens_produced_in_it() -> None:
    records = pool()
    s = window_summary(records, Window(2, 0.0, 10.0), gpus=4)
    assert (s["window_start_s"], s["window_end_s"], s["window_s"]) == (0.0, 10.0, 10.0)
    assert s["requests"] == 5 and s["completed"] == 5  # every arrival is before 10
    expected = sum(tokens_in(r, 0.0, 10.0) for r in records)
    assert s["output_tokens"] == pytest.approx(expected)
    assert s["throughput_tokens_per_s_per_gpu"] == pytest.approx(expected / 10 / 4)
    assert s["ttft_p99_s"] == pytest.approx(0.5) and s["cache_hit_rate"] == pytest.approx(0.5)
    late = window_summary(records, Window(2, 9.5, 10.0), gpus=4)
    assert late["requests"] == 0 and late["ttft_p99_s"] is None  # no arrival: no SLO figure


def test_point_of_a_run_takes_the_window_and_keeps_the_whole_run_beside_it() -> None:
    slo = Slo(3.0, 2.0)
    run = {"ttft_p99_s": 9.0, "output_tps_per_user_p50": 5.0, "throughput_tokens_per_s_per_gpu": 0.01}
    window = window_summary(pool(), Window(2, 0.0, 10.0), gpus=4)
    p = Point.of_run(2, run, window, slo)
    assert p.within_slo and p.ttft_p99_s == pytest.approx(0.5)
    assert p.tokens_per_s_per_gpu == window["throughput_tokens_per_s_per_gpu"]
    assert (p.window_start_s, p.window_end_s, p.window_requests) == (0.0, 10.0, 5)
    assert (p.run_ttft_p99_s, p.run_tokens_per_s_per_gpu) == (9.0, 0.01)
    none = Point.of_run(5, run, None, slo)
    assert not none.within_slo and none.tokens_per_s_per_gpu is None and none.window_start_s is None


def test_session_roots_map_subagents_to_their_session(tmp_path: Path) -> None:
    from loadtest import traces

    workload = traces.load([write_claude_traces(tmp_path / "cc", sessions=2)], None, None, None)
    roots = session_roots(workload.sessions)
    top = {s.id for s in workload.sessions}
    subs = {k for k in roots if k not in top}
    assert len(subs) == 1 and set(roots.values()) == top  # session 0 has one subagent


def capacity(tmp_path: Path, *extra: str) -> dict[str, Any]:
    from loadtest.simulate_cmd import add_arguments
    from loadtest.simulate_cmd import run as simulate

    traces = write_claude_traces(tmp_path / "cc", sessions=12, turns=8)
    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp_path / "cap.json"
    args = p.parse_args(["--trace", str(traces), "--profile", "tiny", "--replicas", "2", "--capacity",
                         "--slo-ttft-p99", "60", "--slo-tps-p50", "1", "--json", str(out), *extra])
    assert simulate(args) == 0
    doc: dict[str, Any] = orjson.loads(out.read_bytes())
    return doc


def test_capacity_json_carries_the_window_and_throughput_grows_with_concurrency(tmp_path: Path) -> None:
    doc = capacity(tmp_path, "--policy", "cache-aware", "--capacity-min", "1", "--capacity-max", "50",
                   "--capacity-step", "1")
    assert "window" in doc["config"]
    (cap,) = doc["capacity"]
    assert cap["sessions"] == 12 and cap["at_max"]  # the bracket is clamped to the 12 sessions
    points = {p["concurrency"]: p for p in cap["points"]}
    assert set(points) == {1, 12}
    for p in points.values():
        assert p["window_start_s"] is not None and p["window_end_s"] > p["window_start_s"]
        assert p["window_requests"] > 0 and p["run_tokens_per_s_per_gpu"] > 0
    one, twelve = points[1], points[12]
    # the whole run's throughput is set by its length; the window's by the sessions it holds
    assert twelve["tokens_per_s_per_gpu"] > 3 * one["tokens_per_s_per_gpu"]


def test_a_saved_document_gives_back_its_results(tmp_path: Path) -> None:
    from loadtest.fleetsim.capacity import capacity_doc, find_capacity, results_of_doc, write_chart

    slo = Slo(3.0, 2.0)
    window = window_summary(pool(), Window(2, 0.0, 10.0), gpus=4)

    def evaluate(c: int) -> Point:
        return Point.of_run(c, {"ttft_p99_s": 1.0}, {**window, "ttft_p99_s": c / 10}, slo)

    results = [find_capacity("a", evaluate, 8, 64, 4), find_capacity("b", evaluate, 40, 64, 4)]
    doc = orjson.loads(orjson.dumps(capacity_doc(slo, results, {})))
    assert results_of_doc(doc) == (slo, results)
    assert write_chart(tmp_path / "c.png", *results_of_doc(doc)).exists()


def test_in_a_simulated_pool_the_window_holds_the_target_until_the_pool_is_empty(tmp_path: Path) -> None:
    from loadtest import traces
    from loadtest.fleetsim.run import SimConfig, run_policy
    from loadtest.fleetsim.sessions import Pacing
    from loadtest.simulator.profile import load_profile

    workload = traces.load([write_claude_traces(tmp_path / "cc", sessions=10)], None, None, None)
    cfg = SimConfig(load_profile("tiny"), replicas=2, gpus_per_replica=1,
                    pacing=Pacing(sessions_concurrent=3))
    roots = session_roots(workload.sessions)
    records = run_policy(workload, "round-robin", cfg).records
    w = steady_window(records, 3, roots)
    assert w is not None and w.start_s == 0.0
    spans = live_intervals(records, roots).values()
    assert len(spans) == 10 and max(a for a, _ in spans) < w.end_s  # every session started in it
    probes = sorted({t for a, b in spans for t in (a, b) if w.start_s <= t < w.end_s})
    for t in probes:  # just after each start or end inside the window, 3 sessions are live
        assert sum(1 for a, b in spans if a <= t < b) == 3
