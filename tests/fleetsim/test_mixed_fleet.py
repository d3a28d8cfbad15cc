"""Mixed fleets in `kvgate simulate`: each replica its own profile (capacity, speed), the
policy pricing each replica at the speed learned from its requests, or at the constants."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.cli import main
from loadtest import traces
from loadtest.fleetsim.run import FleetRun, SimConfig
from loadtest.fleetsim.sessions import Pacing
from loadtest.simulate_cmd import fleet_profiles
from loadtest.simulator.profile import load_profile
from tests.fleetsim.support import write_claude_traces


def test_fleet_profile_specs() -> None:
    assert fleet_profiles("kimi-k2.6-b200-tp8") == [("kimi-k2.6-b200-tp8", 0)]
    assert fleet_profiles("a:4, b:2") == [("a", 4), ("b", 2)]
    with pytest.raises(SystemExit):
        fleet_profiles("a:4,b")


def test_each_replica_runs_its_profile_and_learns_its_speed(tmp_path: Path) -> None:
    workload = traces.load([write_claude_traces(tmp_path / "cc", sessions=6, turns=6)])
    tiny = load_profile("tiny")
    fast = tiny.replace(name="tiny-fast", decode_step_base_s=0.004, device_tokens=8192)
    cfg = SimConfig(profile=tiny, replicas=2, gpus_per_replica=1, replica_profiles=(tiny, fast),
                    pacing=Pacing(sessions_concurrent=6))
    run = FleetRun(workload, "cache-aware", cfg)
    assert [s.device_tokens for s in run.router.specs] == [4096, 8192]
    assert [e.profile.name for e in run.engines] == ["tiny", "tiny-fast"]
    res = run.run()
    speeds = res.summary["speeds"]
    assert [s["profile"] for s in speeds] == ["tiny", "tiny-fast"]
    assert speeds[1]["decode_step_s"] < speeds[0]["decode_step_s"]  # learned from the streams
    views = run.router.views(res.summary["span_s"])
    assert views[1].device_tokens == 8192 and views[1].decode_step_s == run.speeds[1].decode_step_s  # type: ignore[index]
    fleet = FleetRun(workload, "cache-aware", SimConfig(profile=tiny, replicas=2, gpus_per_replica=1,
                                                        replica_profiles=(tiny, fast), speeds="fleet"))
    assert fleet.run().summary["speeds"] is None
    assert all(v.prefill_tokens_per_s is None and v.decode_step_s is None for v in fleet.router.views(0.0))


def test_simulate_runs_a_mixed_fleet_from_the_command_line(tmp_path: Path) -> None:
    folder = write_claude_traces(tmp_path / "cc", sessions=4, turns=4)
    out = tmp_path / "out.json"
    assert main(["simulate", "--trace", str(folder), "--profile", "tiny:1,tiny-long:2", "--replicas", "9",
                 "--policy", "cache-aware", "--sessions-concurrent", "3", "--speeds", "fleet", "--json", str(out),
                 "--quiet"]) == 0
    doc: dict[str, Any] = orjson.loads(out.read_bytes())
    assert doc["config"]["replicas"] == 3 and doc["config"]["profile"] == "tiny:1,tiny-long:2"
    assert doc["config"]["speeds"] == "fleet" and doc["results"][0]["requests"] > 0
