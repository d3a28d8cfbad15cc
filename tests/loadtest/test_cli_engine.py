"""`--engine sim|sglang-cpu`, `--api` and `--replica-url` of `kvgate loadtest` / `kvgate bench
peers` (loadtest.sglang_cpu.harness): argument wiring, the tiny-model workload scaling, and a
sweep over running simulated replicas given by URL (no real server: tests/sglang_real has those).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from gateway.cli import main as kvgate_main
from loadtest import bench_peers, synthetic
from loadtest import cli as loadtest_cli
from loadtest.cli import driver_config
from loadtest.sglang_cpu.harness import (
    check_engine_args,
    effective_time_scale,
    engine_workload,
    largest_request,
    scale_workload,
)
from loadtest.simulator.fleet import SimFleet
from loadtest.workload import Session, Turn, Workload


def _session(block: int = 64) -> Session:
    sub = Session("sub", "ns", block, (Turn(0.0, 640, 32, 0, (7, 8)),))
    turns = (Turn(0.0, 1280, 160, 0, tuple(range(20))), Turn(1.0, 2000, 16, 20, (21, 22), subagents=(sub,)))
    return Session("s", "ns", block, turns, system_blocks=4)


def test_scale_workload_keeps_the_prefix_structure() -> None:
    w = scale_workload(Workload("w", (_session(),)), 1 / 16)
    (s,) = w.sessions
    assert s.block_size == 4 and s.system_blocks == 4
    assert [t.in_tokens for t in s.turns] == [80, 125] and [t.out_tokens for t in s.turns] == [10, 1]
    assert [t.new_hash_ids for t in s.turns] == [tuple(range(20)), (21, 22)]  # same ids: same sharing
    (sub,) = s.turns[1].subagents
    assert sub.block_size == 4 and sub.turns[0].in_tokens == 40
    assert largest_request(s) == 126
    assert scale_workload(Workload("w", (_session(),)), 1 / 16, max_request_tokens=100).sessions == ()


def _args(command: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    (loadtest_cli if command == "loadtest" else bench_peers).add_arguments(parser)
    return parser.parse_args(list(argv))


def test_engine_and_api_flags_reach_the_driver_and_the_workload() -> None:
    args = _args("loadtest", "sweep", "--engine", "sglang-cpu", "--api", "messages", "--replicas", "2",
                 "--time-scale", "10")
    assert check_engine_args(args) is None
    assert effective_time_scale(args) == 1.0  # real servers run in real time
    assert driver_config(args, "http://127.0.0.1:1").api == "messages"
    work = synthetic.generate(synthetic.SyntheticParams(sessions=6), 0)
    scaled = engine_workload(args, work)
    assert all(largest_request(s) <= 8192 for s in scaled.sessions)
    assert scaled.sessions and scaled.sessions[0].block_size == 4
    sim = _args("peers", "--api", "responses")
    assert sim.engine == "sim" and sim.api == "responses"
    assert engine_workload(sim, work) is work
    assert effective_time_scale(sim) == 10.0
    too_many = _args("peers", "--engine", "sglang-cpu", "--replicas", "4")
    assert "1..3" in (check_engine_args(too_many) or "")


def test_sweep_over_running_replicas_by_url(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    with SimFleet(2, profile="tiny", time_scale=20.0, seed=4, log_dir=tmp_path) as fleet:
        code = kvgate_main(["loadtest", "sweep", "--policies", "round-robin", "--concurrency", "2",
                            *(a for u in fleet.urls for a in ("--replica-url", u)),
                            "--synthetic-token-scale", "0.01", "--limit-sessions", "4", "--time-scale", "20",
                            "--max-think-s", "1", "--max-requests", "8", "--json", str(out)])
    assert code == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["summary"]["requests"] == 8 and run["summary"]["errors"] == 0
    assert set(run["summary"]["replicas"]) <= set(fleet.urls)
