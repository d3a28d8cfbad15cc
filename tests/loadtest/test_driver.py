"""Drivers: SSE parsing, the loopback guard, request shape (stub transport), and real
simulated replicas (tiny profile) for TTFT, cached tokens, bounds and rejections."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.cli import main as kvgate_main
from loadtest.driver import (
    Driver,
    DriverConfig,
    RemoteTargetError,
    check_target,
    drive,
)
from loadtest.simulator.fleet import SimFleet
from loadtest.sse import StreamParser
from loadtest.synthetic import SyntheticParams, generate
from loadtest.traces import load
from loadtest.workload import Session, Turn, Workload

TIME_SCALE = 20.0
SSE = (b'data: {"id":"a","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
       b'data: {"id":"a","choices":[{"index":0,"delta":{"reasoning_content":null,"content":"Hel"}}]}\n\n'
       b'data: {"id":"a","choices":[{"index":0,"delta":{"content":"lo"}}]}\n\n'
       b'data: {"id":"a","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
       b'data: {"id":"a","choices":[],"usage":{"prompt_tokens":1200,"completion_tokens":2,'
       b'"prompt_tokens_details":{"cached_tokens":1024}}}\n\n'
       b"data: [DONE]\n\n")


def test_stream_parser_any_split() -> None:
    for cut in range(1, len(SSE), 7):
        p = StreamParser()
        p.feed(SSE[:cut], 1.0)
        p.feed(SSE[cut:], 2.0)
        assert len(p.times) == 2 and p.done and p.error is None
        assert p.usage is not None and p.usage["prompt_tokens_details"]["cached_tokens"] == 1024


def test_stream_parser_error_event() -> None:
    p = StreamParser()
    p.feed(b'data: {"error":{"message":"queue full","code":503}}\n\ndata: [DONE]\n\n', 0.0)
    assert p.error == "queue full" and p.done and not p.times


def test_loopback_only() -> None:
    for ok in ("http://127.0.0.1:8000", "http://localhost:1/v1", "http://[::1]:80/"):
        assert check_target(ok).startswith("http://")
    assert check_target("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    for bad in ("http://10.0.0.1:8000", "https://api.example.com", "http://0.0.0.0:1"):
        with pytest.raises(RemoteTargetError):
            check_target(bad)
    assert check_target("http://10.0.0.1:8000", allow_remote=True) == "http://10.0.0.1:8000"
    with pytest.raises(ValueError):
        check_target("ftp://127.0.0.1")
    with pytest.raises(RemoteTargetError):
        kvgate_main(["loadtest", "--target", "http://192.0.2.1:1", "--max-requests", "1"])


def _claude_file(tmp_path: Path) -> Path:
    doc = {"block_size": 16, "tool_tokens": 16, "system_tokens": 16, "requests": [
        {"t": 0.0, "type": "n", "in": 40, "out": 3, "hash_ids": [1, 2], "think_time": 0.0, "api_time": 0.1},
        {"t": 1.0, "type": "subagent", "agent_id": "agent_001", "duration_ms": 500, "tool_tokens": 0,
         "system_tokens": 0, "requests": [{"t": 0.0, "type": "n", "in": 20, "out": 2, "hash_ids": [9]}]},
        {"t": 2.0, "type": "n", "in": 60, "out": 4, "hash_ids": [1, 2, 3], "think_time": 0.01}]}
    path = tmp_path / "cc.json"
    path.write_text(json.dumps(doc))
    return path


async def test_request_shape_and_session_headers(tmp_path: Path) -> None:
    seen: list[tuple[dict[str, str], dict[str, object]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((dict(request.headers), json.loads(request.content)))
        return httpx.Response(200, stream=httpx.ByteStream(SSE), headers={"x-kvgate-replica": "r1"})

    workload = load([_claude_file(tmp_path)])
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        driver = Driver(DriverConfig(target="http://127.0.0.1:9", model="m", time_scale=100.0), client)
        records = await driver.run(workload)
    assert len(records) == 3 and all(r.ok and r.replica == "r1" for r in records)
    bodies = [b for _, b in seen]
    assert [b["max_tokens"] for b in bodies] == [3, 2, 4]  # the subagent runs before turn 1
    assert all(b["ignore_eos"] is True and b["stream"] is True for b in bodies)
    assert all(b["stream_options"] == {"include_usage": True} and b["model"] == "m" for b in bodies)
    main_h, sub_h = seen[0][0], seen[1][0]
    sid = workload.sessions[0].id
    assert main_h["x-claude-code-session-id"] == sid and "x-claude-code-agent-id" not in main_h
    assert sub_h["x-claude-code-session-id"] == sid and sub_h["x-claude-code-parent-agent-id"] == sid
    assert records[0].cached_tokens == 1024 and records[0].ttft_s is not None


def _small_workload(sessions: int, seed: int = 5) -> Workload:
    p = SyntheticParams(sessions=sessions, turns_median=4, turns_p90=6, subagent_prob=0.0,
                        block_size=16).scaled(0.02)
    return generate(p, seed)


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet(1, profile="tiny", time_scale=TIME_SCALE, seed=1) as f:
        yield f


def _cfg(fleet: SimFleet, **kw: object) -> DriverConfig:
    args: dict[str, object] = {"max_think_s": 1.0, **kw}
    return DriverConfig(target=fleet.urls[0], time_scale=TIME_SCALE, **args)  # type: ignore[arg-type]


async def test_closed_loop_against_a_simulated_replica(fleet: SimFleet) -> None:
    w = _small_workload(3)
    records, stats = await drive(w, _cfg(fleet, sessions_concurrent=3))
    assert len(records) == w.request_count() and stats["model"] == "tiny"
    assert all(r.ok for r in records), [r.error for r in records if not r.ok]
    assert all(r.ttft_s is not None and r.ttft_s > 0 for r in records)
    assert all(r.output_tokens == r.trace_out_tokens for r in records)
    assert all(r.prompt_tokens is not None and r.prompt_tokens >= r.trace_in_tokens for r in records)
    later = [r for r in records if r.turn > 0]
    assert later and sum(r.cached_tokens or 0 for r in later) > 0.5 * sum(r.prompt_tokens or 0 for r in later)


async def test_open_loop_and_request_bound(fleet: SimFleet) -> None:
    turns = [Turn(0.0, 200, 3, 0, (i, i + 1), arrival_s=0.05 * i) for i in range(8)]
    w = Workload("t", tuple(Session(f"s{i}", "ns", 64, (t,)) for i, t in enumerate(turns)), open_loop=True)
    records, stats = await drive(w, _cfg(fleet, max_requests=5))
    assert len(records) == 5 == stats["sent"] and all(r.ok for r in records)


async def test_rejections_are_recorded(fleet: SimFleet) -> None:
    async with httpx.AsyncClient() as c:
        r = await c.post(fleet.urls[0] + "/_sim/faults", json={"error_rate": 1.0, "error_status": 503})
        assert r.status_code == 200
        try:
            records, _ = await drive(_small_workload(1), _cfg(fleet, max_requests=2))
        finally:
            await c.post(fleet.urls[0] + "/_sim/faults", json={"error_rate": 0.0, "error_status": 503})
    assert len(records) == 2 and all(r.rejected and r.status == 503 and not r.ok for r in records)


def test_cli_run_writes_json_and_chart(fleet: SimFleet, tmp_path: Path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    code = kvgate_main(["loadtest", "--target", fleet.urls[0], "--synthetic-token-scale", "0.01",
                        "--limit-sessions", "2", "--max-requests", "6", "--time-scale", str(TIME_SCALE),
                        "--max-think-s", "1", "--json", str(out), "--chart", str(png)])
    assert code == 0
    doc = json.loads(out.read_text())
    assert len(doc["runs"][0]["records"]) == 6 and doc["runs"][0]["summary"]["requests"] == 6
    assert png.stat().st_size > 10_000


def test_duration_bound(fleet: SimFleet) -> None:
    w = _small_workload(2)
    records, stats = asyncio.run(drive(w, _cfg(fleet, sessions_concurrent=2, duration_s=0.3, grace_s=5.0,
                                               think_scale=50.0, max_think_s=None)))
    assert stats["wall_s"] < 10 and len(records) < w.request_count()


async def test_session_arrivals_poisson_stub() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=httpx.ByteStream(SSE))

    w = _small_workload(4)
    cfg = DriverConfig(target="http://127.0.0.1:9", model="m", session_rate=50.0, sessions_concurrent=2,
                       time_scale=100.0, max_think_s=0.5, seed=3)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        driver = Driver(cfg, client)
        records = await driver.run(w)
    assert len(records) == w.request_count() and driver.counters.max_inflight <= 2
    assert {r.session for r in records} == {s.id for s in w.sessions}
