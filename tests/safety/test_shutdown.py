"""SIGTERM: readiness false first, streams get the grace, a stream cut at its end is told so.

Finding 5 of issue 10: streams were cut at a hard-coded 30 s with no SSE error event and
no ``[DONE]``. Now ``server.shutdown_grace_s`` bounds the wait; ``/ready`` answers 503 at
once while new connections are still served; a stream still open at the end gets
``data: {"error": {... "type": "server_shutdown"}}`` then ``data: [DONE]``.
"""
from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import Gateway, start_gateway

pytestmark = pytest.mark.safety

# the tiny simulated replica streams ~100 tokens/s with ignore_eos: 2000 tokens ~8 s
LONG = {"model": "tiny", "messages": [{"role": "user", "content": "tell me"}], "max_tokens": 2000,
        "ignore_eos": True, "stream": True}
SHORT = LONG | {"max_tokens": 150}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    with SimFleet(1, profile="tiny", time_scale=1.0, seed=5, log_dir=tmp_path_factory.mktemp("sim")) as f:
        yield f


def _stream_after_sigterm(gw: Gateway, body: dict[str, object],
                          path: str = "/v1/chat/completions") -> tuple[list[str], int, dict[str, object]]:
    """Start a stream, SIGTERM the gateway after its first event, read to the end; also
    what /ready answered on a new connection right after the signal."""
    ready: dict[str, object] = {}
    with httpx.Client(timeout=30.0) as client, \
            client.stream("POST", gw.url + path, json=body) as r:
        lines = r.iter_lines()
        events = [next(line for line in lines if line)]
        gw.proc.signal(signal.SIGTERM)
        # the signal is handled asynchronously: poll (bounded) until readiness turns
        probe = httpx.get(gw.url + "/ready", timeout=5.0)
        deadline = time.monotonic() + 5.0
        while probe.status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.02)
            probe = httpx.get(gw.url + "/ready", timeout=5.0)
        ready = probe.json()
        events += [line for line in lines if line]
        status = probe.status_code
    return events, status, ready


def _sigterm_during_stream(fleet: SimFleet, log: Path, grace_s: float, body: dict[str, object],
                           path: str = "/v1/chat/completions") -> tuple[list[str], int, dict[str, object], str]:
    gw = start_gateway(fleet.urls, log, "--set", f"server.shutdown_grace_s={grace_s}")
    try:
        events, ready_status, ready = _stream_after_sigterm(gw, body, path)
        gw.proc.popen.wait(15.0)
    finally:
        gw.proc.stop()
    return events, ready_status, ready, gw.proc.output()


def test_stream_longer_than_the_grace_ends_with_an_error_event(fleet: SimFleet, tmp_path: Path) -> None:
    events, ready_status, ready, log = _sigterm_during_stream(fleet, tmp_path / "gw.log", 1.5, LONG)
    assert ready_status == 503 and ready["draining"] is True  # readiness first, listener still open
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["error"]["type"] == "server_shutdown" and last["error"]["message"]
    assert 1 < len(events) < 2000 // 2  # cut well before its end
    assert "cutting 1 request(s)" in log


def test_anthropic_stream_cut_at_shutdown_ends_with_its_error_event(fleet: SimFleet, tmp_path: Path) -> None:
    """A /v1/messages stream ends in Anthropic's grammar: ``event: error`` (overloaded)."""
    body = {"model": "tiny", "max_tokens": 2000, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "tell me"}]}
    events, _, _, log = _sigterm_during_stream(fleet, tmp_path / "gw.log", 1.5, body, "/v1/messages")
    assert events[-2] == "event: error", events[-3:]
    last = json.loads(events[-1].removeprefix("data: "))
    assert last["type"] == "error" and last["error"]["type"] == "overloaded_error", last
    assert "data: [DONE]" not in events
    assert "cutting 1 request(s)" in log


def test_stream_shorter_than_the_grace_completes(fleet: SimFleet, tmp_path: Path) -> None:
    events, ready_status, _, log = _sigterm_during_stream(fleet, tmp_path / "gw.log", 30, SHORT)
    assert ready_status == 503
    assert events[-1] == "data: [DONE]"
    assert not any('"server_shutdown"' in e for e in events)
    assert any('"finish_reason":"length"' in e.replace(" ", "") for e in events)
    assert "cutting" not in log


def test_non_streaming_request_cut_at_the_end_gets_503_json(fleet: SimFleet, tmp_path: Path) -> None:
    gw = start_gateway(fleet.urls, tmp_path / "gw.log", "--set", "server.shutdown_grace_s=1")
    answer: dict[str, httpx.Response] = {}

    def call() -> None:
        answer["r"] = httpx.post(gw.url + "/v1/chat/completions", json=LONG | {"stream": False}, timeout=30.0)

    caller = threading.Thread(target=call)
    try:
        caller.start()
        _wait_in_flight(gw)
        gw.proc.signal(signal.SIGTERM)
        caller.join(20.0)
    finally:
        gw.proc.stop()
    r = answer["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown"


def _wait_in_flight(gw: Gateway) -> None:
    for _ in range(200):
        if any(v["in_flight"] for v in gw.replicas().values()):
            return
        threading.Event().wait(0.02)
    raise TimeoutError("the request never reached a replica")
