"""`kvgate bench polls` and its stub fleet: a real simulated replica's answers replayed on
many ports, and one tiny end-to-end run (two real gateways in front of 24 replica URLs)."""
from __future__ import annotations

import base64
from pathlib import Path

import httpx
import orjson

from gateway.cli import main as kvgate_main
from loadtest.bench_gateway import PROFILE, small_body
from loadtest.simulator.fleet import SimFleet
from loadtest.stub_fleet import CAPTURED_GETS, capture, running


def test_the_stub_fleet_replays_a_simulated_replica_on_every_port(tmp_path: Path) -> None:
    with SimFleet(1, profile=PROFILE, time_scale=1e6, seed=1, log_dir=tmp_path) as sim:
        answers = capture(sim.urls[0], small_body())
    assert {p.split("?")[0] for p in CAPTURED_GETS} | {"/v1/chat/completions"} == set(answers)
    completion = orjson.loads(base64.b64decode(answers["/v1/chat/completions"]["body"]))
    assert answers["/v1/chat/completions"]["status"] == 200 and completion["usage"]["prompt_tokens"] > 0
    with running(answers, 3, tmp_path) as (urls, _pid):
        assert len(set(urls)) == 3
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            for base in urls:
                for _ in range(2):  # keep-alive: the same connection answers again
                    r = client.post(base + "/v1/chat/completions", content=small_body())
                    assert r.status_code == 200 and r.json() == completion
                loads = client.get(base + "/v1/loads?include=core")
                assert loads.content == base64.b64decode(answers["/v1/loads"]["body"])
                assert client.get(base + "/nowhere").status_code == 404


def test_tiny_bench_polls_run(tmp_path: Path) -> None:
    out = tmp_path / "polls.json"
    code = kvgate_main(["bench", "polls", "--replicas", "24", "--batch", "8", "--n", "20", "--idle-s", "1",
                        "--resamples", "20", "--json", str(out)])
    doc = orjson.loads(out.read_bytes())
    assert code == 0 and [r["gateway"] for r in doc["rows"]] == ["batches of 8", "all at once"]
    for r in doc["rows"]:
        assert r["n"] == 20 and r["idle_cpu_ms_per_s"] >= 0 and r["cpu_ms_per_request"] >= 0  # (10 ms ticks)
        assert set(r["added_ms"]) == {"p50", "p90", "p99", "p99.9"}
