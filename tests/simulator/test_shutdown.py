"""SIGTERM drains like SGLang 0.5.23 (§5): health/ready 503 at once, every request served
(in-flight and new ones), the process exits when nothing is in flight."""
from __future__ import annotations

import signal
from collections.abc import Callable

import httpx
import orjson

from loadtest.simulator.fleet import SimFleet

HEADERS = {"content-type": "application/json"}


def _chat(max_tokens: int, stream: bool) -> bytes:
    return orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "drain me"}],
                         "max_tokens": max_tokens, "ignore_eos": True, "stream": stream})


def test_sigterm_drains_and_exits(sim_fleet: Callable[..., SimFleet]) -> None:
    fleet = sim_fleet(time_scale=5.0)  # a 1000-token answer takes ~1 s of wall time
    url, proc = fleet.urls[0], fleet.procs[0]
    with httpx.Client(base_url=url, timeout=30.0, trust_env=False) as client:
        assert client.get("/ready").status_code == 200
        with client.stream("POST", "/v1/chat/completions", content=_chat(1000, True),
                           headers=HEADERS) as stream:
            chunks = stream.iter_bytes()
            received = next(chunks)  # in flight
            fleet.signal(0, signal.SIGTERM)
            for path in ("/health", "/health_generate", "/ready"):
                assert client.get(path).status_code == 503, path
            new = client.post("/v1/chat/completions", content=_chat(4, False), headers=HEADERS)
            assert new.status_code == 200 and new.json()["usage"]["completion_tokens"] == 4
            assert proc.poll() is None  # still serving the stream
            received += b"".join(chunks)
        assert received.rstrip().endswith(b"data: [DONE]")
        assert b'"finish_reason":"length"' in received
    assert proc.wait(timeout=20) == 0
    log = fleet.output(0)
    assert "SIGTERM received" in log
    assert "Gracefully exiting... Remaining number of requests" in log


def test_pause_and_continue(sim_fleet: Callable[..., SimFleet]) -> None:
    fleet = sim_fleet()
    with httpx.Client(base_url=fleet.urls[0], timeout=30.0, trust_env=False) as client:
        r = client.post("/pause_generation", json={"mode": "in_place"})
        assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
        assert client.get("/ready").status_code == 503
        assert client.get("/health").status_code == 200
        with httpx.Client(base_url=fleet.urls[0], timeout=0.5, trust_env=False) as short:
            try:
                short.post("/v1/chat/completions", content=_chat(2, False), headers=HEADERS)
                held = False
            except httpx.ReadTimeout:
                held = True
        assert held, "a request was served while paused"
        assert client.post("/continue_generation", json={}).status_code == 200
        assert client.get("/ready").status_code == 200
        r = client.post("/v1/chat/completions", content=_chat(2, False), headers=HEADERS)
        assert r.status_code == 200
