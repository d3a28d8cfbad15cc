"""`kvgate simulate` end to end on tiny traces with the tiny profile (virtual time)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.cli import main
from tests.fleetsim.support import write_bailian_trace, write_claude_traces, write_mooncake_trace

POLICIES = "cache-aware,round-robin,least-load,session-hash,sglang-cache-aware"
REQUIRED = ("policy", "cache_hit_rate", "cache_hit_rate_device", "cache_hit_rate_host", "ttft_p50_s",
            "ttft_p90_s", "ttft_p99_s", "output_tps_per_user_p50", "throughput_tokens_per_s_per_gpu",
            "imbalance", "requests", "rejected")


def simulate(tmp_path: Path, *extra: str, name: str = "out.json") -> dict[str, Any]:
    out = tmp_path / name
    rc = main(["simulate", "--replicas", "2", "--profile", "tiny", "--json", str(out), *extra])
    assert rc == 0
    doc: dict[str, Any] = orjson.loads(out.read_bytes())
    return doc


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_claude_traces(tmp_path_factory.mktemp("cc") / "cc")


def test_json_fields_and_oracle_bound(tmp_path: Path, traces: Path) -> None:
    doc = simulate(tmp_path, "--trace", str(traces), "--policy", POLICIES, "--sessions-concurrent", "3")
    assert {"config", "oracle", "results"} <= set(doc)
    assert doc["config"]["replicas"] == 2 and doc["config"]["gpus_per_replica"] == 1
    oracle = doc["oracle"]["cache_hit_rate"]
    assert 0.5 < oracle <= 1.0
    assert [r["policy"] for r in doc["results"]] == POLICIES.split(",")
    expected = 6 * 6 + 2  # six sessions of six turns, one subagent of two turns
    for r in doc["results"]:
        assert set(REQUIRED) <= set(r)
        assert r["requests"] == expected and r["rejected"] == 0
        assert r["cache_hit_rate"] <= oracle + 1e-9
        assert r["cache_hit_rate_device"] + r["cache_hit_rate_host"] == pytest.approx(r["cache_hit_rate"])
        assert r["ttft_p50_s"] <= r["ttft_p90_s"] <= r["ttft_p99_s"]
        assert r["throughput_tokens_per_s_per_gpu"] > 0


def test_same_seed_same_results(tmp_path: Path, traces: Path) -> None:
    args = ("--trace", str(traces), "--policy", "cache-aware,least-load", "--seed", "7")
    a = simulate(tmp_path, *args, name="a.json")
    b = simulate(tmp_path, *args, name="b.json")
    assert _timeless(a["results"]) == _timeless(b["results"])
    assert a["oracle"] == b["oracle"]


def _timeless(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in ("wall_s", "cpu_s")} for r in results]


def test_round_robin_spreads_evenly(tmp_path: Path, traces: Path) -> None:
    doc = simulate(tmp_path, "--trace", str(traces), "--policy", "round-robin")
    counts = doc["results"][0]["requests_per_replica"]
    assert max(counts) - min(counts) <= 1


def test_cache_aware_keeps_sessions_home(tmp_path: Path, traces: Path) -> None:
    doc = simulate(tmp_path, "--trace", str(traces), "--policy", "cache-aware,round-robin",
                   "--sessions-concurrent", "2")
    aware, rr = doc["results"]
    assert aware["cache_hit_rate"] > rr["cache_hit_rate"]
    assert aware["reasons"].get("affinity", 0) > 0


def test_bounds_and_think_scale(tmp_path: Path, traces: Path) -> None:
    doc = simulate(tmp_path, "--trace", str(traces), "--policy", "least-load", "--max-requests", "10",
                   "--think-scale", "0.1")
    assert doc["results"][0]["requests"] == 10
    doc = simulate(tmp_path, "--trace", str(traces), "--policy", "least-load", "--sim-duration-s", "5",
                   "--sessions-concurrent", "1", name="d.json")
    assert 0 < doc["results"][0]["requests"] < 10


def test_session_rate_arrivals(tmp_path: Path, traces: Path) -> None:
    doc = simulate(tmp_path, "--trace", str(traces), "--policy", "cache-aware", "--session-rate", "0.5")
    assert doc["results"][0]["requests"] == 38
    assert doc["config"]["pacing"]["session_rate"] == 0.5


def test_mooncake_open_loop(tmp_path: Path) -> None:
    trace = write_mooncake_trace(tmp_path / "mc.jsonl")
    big = tmp_path / "tiny-big.toml"
    text = (Path(__file__).resolve().parents[2] / "loadtest/simulator/profiles/tiny.toml").read_text()
    big.write_text(text.replace("device_tokens = 4096", "device_tokens = 65536"))
    out = tmp_path / "mc.json"
    rc = main(["simulate", "--trace", str(trace), "--format", "mooncake", "--replicas", "2",
               "--profile", str(big), "--policy", "cache-aware,round-robin", "--json", str(out), "--quiet"])
    assert rc == 0
    doc = orjson.loads(out.read_bytes())
    assert doc["config"]["open_loop"] is True
    for r in doc["results"]:
        assert r["requests"] == 30 and r["rejected"] == 0
        assert r["cache_hit_rate"] <= doc["oracle"]["cache_hit_rate"] + 1e-9


def test_bailian_open_loop(tmp_path: Path) -> None:
    trace = write_bailian_trace(tmp_path / "bl.jsonl")
    doc = simulate(tmp_path, "--trace", str(trace), "--policy", "cache-aware,session-hash")
    assert doc["config"]["format"] == "bailian" and doc["config"]["open_loop"] is True
    aware, hashed = doc["results"]
    assert aware["requests"] == hashed["requests"] == 24
    assert aware["cache_hit_rate"] > 0.3 and hashed["cache_hit_rate"] > 0.3
    for r in doc["results"]:
        assert r["cache_hit_rate"] <= doc["oracle"]["cache_hit_rate"] + 1e-9


def test_synthetic_trace(tmp_path: Path) -> None:
    doc = simulate(tmp_path, "--trace", "synthetic", "--synthetic-scale", "0.01", "--limit-sessions", "3",
                   "--policy", "cache-aware", "--max-requests", "40", "--context-length", "8192")
    r = doc["results"][0]
    assert r["requests"] == 40
    assert doc["config"]["format"] == "synthetic"


def test_skip_sessions_and_kv_scale(tmp_path: Path, traces: Path) -> None:
    """--skip-sessions takes another slice of the trace; --kv-scale shrinks the KV pools."""
    base = ("--trace", str(traces), "--policy", "cache-aware", "--sessions-concurrent", "3")
    whole = simulate(tmp_path, *base, name="whole.json")
    sliced = simulate(tmp_path, *base, "--skip-sessions", "2", "--limit-sessions", "3", name="sliced.json")
    assert sliced["config"]["skip_sessions"] == 2 and sliced["config"]["sessions"] == 3
    assert sliced["results"][0]["requests"] < whole["results"][0]["requests"]
    small = simulate(tmp_path, *base, "--kv-scale", "0.3", name="small.json")
    assert small["config"]["kv_scale"] == 0.3 and small["config"]["profile"].endswith("-kv0.3")
    assert small["results"][0]["evicted_tokens"] > whole["results"][0]["evicted_tokens"]
