"""Fault injection: errors before the first byte, hangs, connections dropped mid-stream,
a process that dies mid-stream; set by CLI flags or at run time (POST /_sim/faults)."""
from __future__ import annotations

from collections.abc import Callable

import httpx
import orjson
import pytest

from loadtest.simulator.fleet import SimFleet

HEADERS = {"content-type": "application/json"}
STREAM = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 50, "ignore_eos": True, "stream": True})
WHOLE = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def test_error_rate_from_cli(sim_fleet: Callable[..., SimFleet]) -> None:
    fleet = sim_fleet(extra_args=("--error-rate", "1", "--error-status", "502"))
    with httpx.Client(base_url=fleet.urls[0], timeout=10.0, trust_env=False) as client:
        r = client.post("/v1/chat/completions", content=WHOLE, headers=HEADERS)
        assert r.status_code == 502 and r.json()["code"] == 502
        assert client.get("/health").status_code == 200  # probes stay truthful


def test_runtime_faults(client: httpx.Client) -> None:
    assert client.get("/_sim/faults").json()["error_rate"] == 0.0
    try:
        assert client.post("/_sim/faults", json={"error_rate": 1.0}).status_code == 200
        assert client.post("/v1/chat/completions", content=WHOLE, headers=HEADERS).status_code == 503
        assert client.post("/_sim/faults", json={"error_rate": 2.0}).status_code == 400
        assert client.post("/_sim/faults", json={"bogus": 1}).status_code == 400
        assert client.post("/_sim/faults", json={"latency_s": 0.01}).status_code == 200
        assert client.post("/v1/chat/completions", content=WHOLE, headers=HEADERS).status_code == 200
        client.post("/_sim/faults", json={"hang_rate": 1.0})
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/chat/completions", content=WHOLE, headers=HEADERS, timeout=0.5)
        client.post("/_sim/faults", json={"die_after_chunks": 3})
        received = b""
        with pytest.raises(httpx.RemoteProtocolError):  # noqa: SIM117
            with client.stream("POST", "/v1/chat/completions", content=STREAM, headers=HEADERS) as s:
                for chunk in s.iter_bytes():
                    received += chunk
        assert received.count(b"data: ") == 3 and b"[DONE]" not in received
    finally:
        client.post("/_sim/faults", json={})
    assert client.post("/v1/chat/completions", content=WHOLE, headers=HEADERS).status_code == 200


def test_die_mid_stream_exits_process(sim_fleet: Callable[..., SimFleet]) -> None:
    fleet = sim_fleet(extra_args=("--die-after-chunks", "2", "--die-mode", "exit"))
    with httpx.Client(base_url=fleet.urls[0], timeout=10.0, trust_env=False) as client:
        received = b""
        with pytest.raises(httpx.RemoteProtocolError):  # noqa: SIM117
            with client.stream("POST", "/v1/chat/completions", content=STREAM, headers=HEADERS) as s:
                for chunk in s.iter_bytes():
                    received += chunk
    assert received.count(b"data: ") == 2
    assert fleet.procs[0].wait(timeout=10) != 0
