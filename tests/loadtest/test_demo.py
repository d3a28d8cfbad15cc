"""`kvgate demo` helpers and one tiny `kvgate loadtest sweep` through real gateway processes."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gateway.cli import main as kvgate_main
from loadtest.demo import TRACE_DIRS, GatewayProcess, _max_prompt, demo_workload, scaled_profile
from loadtest.simulator.profile import load_profile


def test_scaled_profile(tmp_path: Path) -> None:
    assert scaled_profile("tiny", 1.0, tmp_path) == "tiny"
    base = load_profile("kimi-k2.6-b200-tp8")
    scaled = load_profile(scaled_profile("kimi-k2.6-b200-tp8", 0.25, tmp_path))
    assert scaled.device_tokens == base.device_tokens // 4 and scaled.host_tokens == base.host_tokens // 4
    assert scaled.prefill_tokens_per_s == base.prefill_tokens_per_s
    assert scaled.served_model_name == base.served_model_name


def test_time_scaled_replicas_are_priced_at_the_constants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway in front of time-scaled replicas does not learn their (wall-time) speeds."""
    monkeypatch.delenv("KVGATE_REGISTRY__LEARN_SPEEDS", raising=False)
    scaled = GatewayProcess("cache-aware", ["http://127.0.0.1:1"], log_dir=tmp_path, time_scale=10.0)
    assert scaled.env["KVGATE_REGISTRY__LEARN_SPEEDS"] == "false"
    real_time = GatewayProcess("cache-aware", ["http://127.0.0.1:1"], log_dir=tmp_path)
    assert "KVGATE_REGISTRY__LEARN_SPEEDS" not in real_time.env


def test_demo_workload_fits_the_context(tmp_path: Path) -> None:
    real = demo_workload(6, None, 0, 100_000)
    assert len(real.sessions) == 6 and all(_max_prompt(s) <= 100_000 for s in real.sessions)
    if any(d.is_dir() for d in TRACE_DIRS):
        assert real.name == "claude-code"
    fallback = demo_workload(5, tmp_path / "none", 0, 240_000)
    assert fallback.name == "synthetic" and len(fallback.sessions) == 5
    assert all(_max_prompt(s) <= 240_000 for s in fallback.sessions)


def test_sweep_through_real_gateways(tmp_path: Path) -> None:
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    code = kvgate_main(["loadtest", "sweep", "--policies", "round-robin", "--concurrency", "2",
                        "--replicas", "2", "--profile", "tiny", "--synthetic-token-scale", "0.01",
                        "--limit-sessions", "4", "--time-scale", "20", "--max-think-s", "1",
                        "--max-requests", "12", "--json", str(out), "--chart", str(png)])
    assert code == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["config"]["policy"] == "round-robin" and run["config"]["sessions_concurrent"] == 2
    assert run["summary"]["requests"] == 12 and run["summary"]["errors"] == 0
    assert len(run["summary"]["replicas"]) == 2  # x-kvgate-replica seen, both replicas used
    assert png.stat().st_size > 10_000


def test_demo_with_kv_events_predicts_from_the_events(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvgate demo --kv-events`: the simulated replicas publish KV events, the gateway
    routes in precise mode, and its predictions match what the replicas report."""
    out = tmp_path / "demo.json"
    code = kvgate_main(["demo", "--kv-events", "--replicas", "2", "--sessions", "3", "--duration-s", "6",
                        "--ramp-s", "1", "--policies", "cache-aware", "--json", str(out)])
    assert code == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["summary"]["errors"] == 0 and run["summary"]["requests"] > 0
    printed = " ".join(capsys.readouterr().out.split())
    match = re.search(r"precise ([0-9.]+)% within 64 tokens, [^(]*\(of (\d+)\)", printed)
    assert match is not None, printed[-2000:]
    assert int(match[2]) > 0 and float(match[1]) >= 95.0, match[0]
