"""`kvgate bench` and `kvgate bench peers`: dispatch, target names, replica-side counts,
and one tiny end-to-end run (2 tiny replicas, kvgate and sglang-router; marked ``peers``:
it needs ``bash loadtest/peers/install.sh``)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from rich.console import Console

from gateway.cli import main as kvgate_main
from loadtest.bench_cmd import BENCHES, run_bench
from loadtest.peers.run import PEERS, missing_peers, peer_command
from loadtest.peers.summary import COUNTER, with_replica_side
from loadtest.peers.targets import check_peers, kvgate_checkout, kvgate_policy, parse_targets
from loadtest.results import RequestRecord, RunResult, summarize

METRICS = b"""# HELP sglang:num_requests_total Number of requests processed.
sglang:num_requests_total{engine_type="unified",is_streaming="true",model_name="tiny"} 7.0
sglang:num_requests_total{engine_type="unified",is_streaming="false",model_name="tiny"} 2.0
sglang:prompt_tokens_total{engine_type="unified",is_streaming="true",model_name="tiny"} 1.5e+03
sglang:cached_tokens_total{cache_source="device",engine_type="unified",model_name="tiny"} 600.0
sglang:cached_tokens_total{cache_source="host",engine_type="unified",model_name="tiny"} 150.0
sglang:num_requests_created 1.0
"""


def test_targets() -> None:
    assert parse_targets("kvgate, kvgate-round-robin,sglang-router,smg") == [
        "kvgate",
        "kvgate-round-robin",
        "sglang-router",
        "smg",
    ]
    assert kvgate_policy("kvgate") == "cache-aware"
    assert kvgate_policy("kvgate-session-hash") == "session-hash"
    assert kvgate_policy("smg-least-load") is None
    assert parse_targets("python-floor,python-floor-granian,python-floor-rsgi") == [
        "python-floor", "python-floor-granian", "python-floor-rsgi"]
    assert kvgate_policy("python-floor") is None
    with pytest.raises(ValueError, match="unknown target"):
        parse_targets("kvgate,nginx")
    root = Path(__file__).resolve().parents[2]
    assert parse_targets(f"kvgate,kvgate@{root}") == ["kvgate", f"kvgate@{root}"]
    assert kvgate_policy(f"kvgate@{root}") == "cache-aware" and kvgate_checkout(f"kvgate@{root}") == root
    assert kvgate_checkout("kvgate") is None
    with pytest.raises(ValueError, match="not a kvgate checkout"):
        parse_targets(f"kvgate@{root / 'docs'}")


def test_missing_peers_and_command(tmp_path: Path) -> None:
    console = Console(record=True, width=200)
    assert not check_peers(["kvgate", "smg"], install=False, console=console, root=tmp_path)
    assert "bash loadtest/peers/install.sh" in console.export_text()
    assert check_peers(
        ["kvgate", "kvgate-round-robin"], install=False, console=console, root=tmp_path
    )
    assert missing_peers(["kvgate", "sglang-router", "smg-least-load"], root=tmp_path) == [
        "sglang-router",
        "smg-least-load",
    ]
    cmd = peer_command(PEERS["sglang-router"], 30000, 29000, ["http://127.0.0.1:1"], root=tmp_path)
    for flags in (
        ["--host", "127.0.0.1"],
        ["--prometheus-host", "127.0.0.1"],
        ["--log-level", "warn"],
        ["--policy", "cache_aware", "--cache-threshold", "0.3"],
    ):
        i = cmd.index(flags[0])
        assert cmd[i : i + len(flags)] == flags


def test_counters_and_replica_side() -> None:
    sums: dict[str, float] = {"num_requests": 0.0, "prompt_tokens": 0.0, "cached_tokens": 0.0}
    for name, value in COUNTER.findall(METRICS):
        sums[name.decode()] += float(value)
    assert sums == {"num_requests": 9.0, "prompt_tokens": 1500.0, "cached_tokens": 750.0}
    recs = [
        RequestRecord("s", 0, 0.0, 200, ttft_s=0.1, e2e_s=1.0, output_tokens=4, trace_out_tokens=4)
    ]
    run = RunResult("x", {}, tuple(recs), summarize(recs, replicas=2))
    zero = {"num_requests": 0.0, "prompt_tokens": 0.0, "cached_tokens": 0.0}
    out = with_replica_side(run, [zero, zero], [sums, zero], {})
    assert out.summary.replicas == {"r0": 9, "r1": 0}
    assert out.summary.imbalance == pytest.approx(2.0)
    assert out.config["replica_side"]["hit_rate"] == pytest.approx(0.5)


def test_bench_dispatch_help() -> None:
    assert set(BENCHES) >= {"peers", "gateway", "simulator", "index", "hashing"}
    for name in ("peers", "hashing", "simulator-memory"):  # add_arguments/run and main-only
        with pytest.raises(SystemExit) as e:
            run_bench(name, ["--help"])
        assert e.value.code == 0
    with pytest.raises(SystemExit) as e:
        kvgate_main(["bench", "nope"])
    assert e.value.code == 2


@pytest.mark.peers
def test_tiny_run_kvgate_and_sglang_router(tmp_path: Path) -> None:
    if missing_peers(["sglang-router"]):
        pytest.skip("sglang-router not installed: run bash loadtest/peers/install.sh")
    out = tmp_path / "peers.json"
    code = kvgate_main(
        [
            "bench",
            "peers",
            "--replicas",
            "2",
            "--profile",
            "tiny",
            "--time-scale",
            "20",
            "--synthetic-sessions",
            "4",
            "--synthetic-token-scale",
            "0.02",
            "--sessions-concurrent",
            "4",
            "--duration-s",
            "10",
            "--max-requests",
            "16",
            "--targets",
            "kvgate,sglang-router",
            "--json",
            str(out),
        ]
    )
    runs = orjson.loads(out.read_bytes())["runs"]
    assert [r["config"]["target_label"] for r in runs] == ["kvgate", "sglang-router"]
    for r in runs:
        s = r["summary"]
        assert s["requests"] > 0 and s["errors"] == 0 and s["rejected"] == 0, r["label"]
        assert sum(r["config"]["replica_side"]["requests"]) >= s["requests"]
    assert code == 0


def test_tiny_run_of_the_floors_in_front_of_a_fleet(tmp_path: Path) -> None:
    """The pass-through floors in front of 2 replicas: every request answered, nothing
    routed anywhere but the fleet."""
    out = tmp_path / "peers.json"
    floors = ["python-floor"]
    code = kvgate_main(["bench", "peers", "--replicas", "2", "--profile", "tiny", "--time-scale", "20",
                        "--synthetic-sessions", "4", "--synthetic-token-scale", "0.02", "--sessions-concurrent", "4",
                        "--duration-s", "10", "--max-requests", "16", "--targets", ",".join(floors),
                        "--json", str(out)])
    runs = orjson.loads(out.read_bytes())["runs"]
    assert [r["config"]["target_label"] for r in runs] == floors
    for r in runs:
        s = r["summary"]
        assert s["requests"] > 0 and s["errors"] == 0 and s["rejected"] == 0, r["label"]
        assert sum(r["config"]["replica_side"]["requests"]) >= s["requests"]
    assert code == 0
