"""loadtest/peers/routed_floor.py: kvgate's routing inside the callbacks of the pass-through
on asyncio Protocols (real processes: two simulated replicas, the floor in its own process,
real HTTP). It must route as kvgate does, or its measurement means nothing."""
from __future__ import annotations

import socket
from pathlib import Path

import httpx
import orjson
import pytest

from loadtest.bench_gateway import PROFILE, small_body, with_stream
from loadtest.peers.targets import open_target
from loadtest.simulator.fleet import SimFleet


def test_the_routed_floor_routes_with_kvgates_policy_and_answers_its_errors(tmp_path: Path) -> None:
    with SimFleet(2, profile=PROFILE, time_scale=1e6, seed=1, log_dir=tmp_path) as fleet, \
            open_target("python-floor-protocol-routed", fleet.urls, tmp_path) as (url, _), \
            httpx.Client(base_url=url, timeout=10.0, trust_env=False) as client:
        replicas = {u.rstrip("/") for u in fleet.urls}
        session = {"x-claude-code-session-id": "s-1", "content-type": "application/json"}
        chosen = []
        for stream in (False, True, False):
            r = client.post("/v1/chat/completions", content=with_stream(small_body(), stream, 4), headers=session)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvgate-replica"] in replicas and r.headers["x-kvgate-route-reason"]
            assert ("data: " in r.text) == stream
            chosen.append(r.headers["x-kvgate-replica"])
        assert len(set(chosen)) == 1  # kvgate's cache-aware policy keeps the session where its prefix is
        bad = client.post("/v1/chat/completions", content=b'{"model": "m", "messages": "no"}',
                          headers={"content-type": "application/json"})
        assert bad.status_code == 400 and orjson.loads(bad.content)["error"]["type"] == "invalid_request_error"


def test_the_routed_floor_keeps_the_edges_body_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its per-request timers are there (their cost is what the floor measures): a body that
    stops arriving gets a 408 once ``server.body_timeout_s`` has passed."""
    monkeypatch.setenv("KVGATE_SERVER__BODY_TIMEOUT_S", "0.5")
    with SimFleet(1, profile=PROFILE, time_scale=1e6, seed=1, log_dir=tmp_path) as fleet, \
            open_target("python-floor-protocol-routed", fleet.urls, tmp_path) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5.0) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 100\r\n\r\n{\"model\"")
            answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408 ") and b"request body not received in time" in answer
