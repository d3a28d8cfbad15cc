"""`kvgate serve` in front of two REAL SGLang CPU servers: a 10-turn session sticks to one
replica with real radix-cache hits, and a `/flush_cache` on that replica is survived;
then SIGTERM drain behaviour, real vs simulated (last: it stops one real server).

Each turn sends the whole history plus new text (``x-kvgate-session`` names the session);
the output text is random (random weights), so only counts and routing are asserted.
"""
from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loadtest.sglang_cpu.server import SGLangServer
from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import Gateway, start_gateway, wait_until
from tests.sglang_real.conftest import MODEL, client

pytestmark = pytest.mark.sglang_real

TURNS = 10


@pytest.fixture(scope="module")
def gateway(real_urls: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = start_gateway(real_urls, tmp_path_factory.mktemp("gw-real") / "gateway.log")
    yield gw
    gw.proc.stop()


class Session:
    """A multi-turn chat through the gateway; remembers each turn's usage and replica."""

    def __init__(self, gw: Gateway, session_id: str) -> None:
        self.http = openai.DefaultHttpxClient(trust_env=False, timeout=60.0)
        self.api = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", http_client=self.http,
                                 default_headers={"x-kvgate-session": session_id}, max_retries=0)
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a terse assistant for the kvgate test suite. " * 8}]
        self.turns: list[tuple[str, int, int]] = []  # (replica, prompt_tokens, cached_tokens)

    def turn(self, i: int) -> tuple[str, int, int]:
        self.messages.append({"role": "user", "content": f"Turn {i}: tell me about pages and radix trees "
                                                         f"in a prefix cache, part {i}. " * 4})
        raw = self.api.chat.completions.with_raw_response.create(
            model=MODEL, messages=self.messages, max_tokens=8, temperature=0.0)  # type: ignore[arg-type]
        completion = raw.parse()
        usage = completion.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        self.messages.append({"role": "assistant", "content": completion.choices[0].message.content or ""})
        record = (raw.headers["x-kvgate-replica"], usage.prompt_tokens, cached)
        self.turns.append(record)
        return record

    def close(self) -> None:
        self.http.close()


def test_ten_turn_session_sticks_with_real_cached_tokens(gateway: Gateway, real_urls: list[str]) -> None:
    session = Session(gateway, "real-sticky-1")
    try:
        for i in range(TURNS):
            session.turn(i)
    finally:
        session.close()
    replicas = {r for r, _, _ in session.turns}
    assert len(replicas) == 1, session.turns
    assert replicas <= {u.rstrip("/") for u in real_urls} or len(replicas) == 1
    for (_, prev_prompt, _), (_, prompt, cached) in zip(session.turns, session.turns[1:]):
        assert prompt > prev_prompt
        assert cached >= 0.95 * prev_prompt, session.turns


def test_flush_cache_then_next_turn(gateway: Gateway, real_urls: list[str], tmp_path: Path) -> None:
    session = Session(gateway, "real-flush-1")
    try:
        replica, _, _ = session.turn(0)
        _, prompt1, cached1 = session.turn(1)
        target = next(u for u in real_urls if u.rstrip("/") == replica.rstrip("/") or replica in u)
        with client(target) as c:
            assert c.post("/flush_cache").status_code == 200
        _, prompt2, cached2 = session.turn(2)  # served, from an empty radix cache
        assert cached2 < 0.5 * prompt1, session.turns  # real: 0 (or a few tokens at most)
        _, _, cached3 = session.turn(3)  # and the cache is warm again
        assert cached3 >= 0.95 * prompt2, session.turns
        assert cached1 >= 0.95 * session.turns[0][1]
    finally:
        session.close()
    assert httpx.get(gateway.url + "/health", timeout=10.0).status_code == 200
    assert gateway.proc.popen.poll() is None


LONG_REQUEST_TIMEOUT_S = 300.0


def drain_observation(url: str, sigterm: Callable[[], None], proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """SIGTERM with a long request in flight: what /health, /ready, a new request and the
    in-flight one see, and whether the process exits once drained."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 600, "ignore_eos": True}
    seen: dict[str, Any] = {}
    with client(url) as c, ThreadPoolExecutor(1) as pool:
        # 600 tokens take 15-30 s on a quiet 2-core machine and over 60 s at load ~10 (a
        # clean-clone run timed out there): its bound is generous, it is not what is tested
        long_request = pool.submit(c.post, "/v1/chat/completions", json=body, timeout=LONG_REQUEST_TIMEOUT_S)
        wait_until(lambda: c.get("/v1/loads").json()["loads"][0]["num_running_reqs"] >= 1, 20.0, "in flight")
        sigterm()
        wait_until(lambda: c.get("/ready").status_code == 503, 20.0, "/ready 503")
        seen["health"] = c.get("/health").status_code
        seen["new_request"] = c.post("/v1/chat/completions", json={**body, "max_tokens": 2}).status_code
        done = long_request.result(timeout=LONG_REQUEST_TIMEOUT_S + 10)
        seen["in_flight"] = (done.status_code, done.json()["usage"]["completion_tokens"])
    seen["exited"] = proc.wait(60) is not None
    return seen


def test_sigterm_drain_matches_the_simulator(real_servers: list[SGLangServer], tmp_path: Path) -> None:
    """Stops real server 1 (no later test may use it; test_two_models.py uses server 0 only):
    SIGTERM to the server's main process, as an orchestrator sends it; health and readiness
    fail at once, requests are still served (new ones too), nothing in flight is lost, then
    the process exits."""
    server = real_servers[1]
    assert server.popen is not None
    popen = server.popen
    real = drain_observation(server.url, lambda: popen.send_signal(signal.SIGTERM), popen)
    with SimFleet(1, profile="tiny-cpu", time_scale=1.0, seed=5, log_dir=tmp_path) as fleet:
        sim = drain_observation(fleet.urls[0], lambda: fleet.signal(0), fleet.procs[0])
    expected = {"health": 503, "new_request": 200, "in_flight": (200, 600), "exited": True}
    assert real == expected, real
    assert sim == expected, sim
