"""`kvgate serve` in front of REAL SGLang CPU servers: drain and SIGTERM lose nothing, and
after a `/flush_cache` the gateway learns from the real `cached_tokens` (issue 11, item 4).

- admin drain of a real server under multi-turn load: every turn of every session is
  served, the sessions on the drained server continue elsewhere, the server leaves the fleet;
- SIGTERM of a real server (its main process, as an orchestrator sends it) under
  streamed load through the gateway: 0 requests lost; the gateway stops routing to it and
  the survivor serves the rest. The server is the package's spare (``sigterm_spare`` in
  conftest.py: started with the shared two, so it is warm by now); the package's two
  shared servers are never stopped here;
- `/flush_cache` on the session's real server: the next turn's prediction
  (``x-kvgate-expected-cached-tokens``) still believes the old cache while the server
  reports (almost) nothing cached; the turn after that the prediction has dropped (the
  feedback truncated the index on that replica), and from then on it never exceeds what
  the server really holds by more than the feedback tolerance. (Seen: the drop goes to 0
  although the refilled turn is cached again: the truncation also removes the chain that
  the missed request itself just wrote; the prediction recovers a turn later.)

Output text is random (random weights): only status codes, counts and routing are asserted.
"""
from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from loadtest.sglang_cpu.server import SGLangServer
from tests.integration.conftest import Gateway, start_gateway, wait_until
from tests.sglang_real.conftest import MODEL, client

pytestmark = pytest.mark.sglang_real

SESSIONS = 4
TURNS = 6
BEFORE = 2  # turns every session completes before the drain; the rest follow it
STREAMS = 8
EXPECTED = "x-kvgate-expected-cached-tokens"
Turn = tuple[float, str]  # (monotonic time the turn was sent, the replica that served it)


def async_api(gw: Gateway) -> openai.AsyncOpenAI:
    http = openai.DefaultAsyncHttpxClient(trust_env=False, timeout=120.0)
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, http_client=http)


async def _session(oa: openai.AsyncOpenAI, s: int, seen: dict[int, list[Turn]], errors: list[str],
                   drained: threading.Event) -> None:
    messages: list[Any] = [{"role": "system", "content": f"Agent {s} of the drain test. " * 30}]
    for turn in range(TURNS):
        while turn == BEFORE and not drained.is_set():  # the drain lands between turns, not after the last
            await asyncio.sleep(0.02)
        messages.append({"role": "user", "content": f"step {turn} of session {s}: go on."})
        sent = time.monotonic()
        try:
            raw = await oa.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=16, extra_body={"ignore_eos": True},
                extra_headers={"x-kvgate-session": f"real-drain-{s}"})
        except openai.APIError as e:
            errors.append(f"session {s} turn {turn}: {e!r}")
            drained.set()  # release the others: this session is over
            return
        seen[s].append((sent, raw.headers["x-kvgate-replica"]))
        messages.append({"role": "assistant", "content": raw.parse().choices[0].message.content or ""})


async def _sessions_then(gw: Gateway, seen: dict[int, list[Turn]], ready: threading.Event,
                         drained: threading.Event) -> list[str]:
    oa, errors = async_api(gw), list[str]()

    async def watcher() -> None:
        while not all(len(v) >= BEFORE for v in seen.values()):
            await asyncio.sleep(0.05)
        ready.set()

    try:
        sessions = (_session(oa, s, seen, errors, drained) for s in range(SESSIONS))
        await asyncio.wait_for(asyncio.gather(watcher(), *sessions), timeout=240.0)
    finally:
        await oa.close()
    return errors


def test_admin_drain_of_a_real_server_loses_nothing(real_urls: list[str], tmp_path: Path) -> None:
    gw = start_gateway(real_urls, tmp_path / "gateway.log")
    seen: dict[int, list[Turn]] = {s: [] for s in range(SESSIONS)}
    ready, drained, state = threading.Event(), threading.Event(), dict[str, Any]()

    def drain() -> None:
        if not ready.wait(180.0):
            drained.set()
            return
        # Every session has served BEFORE turns and waits: the victim is the replica that
        # served the most sessions' last turn, so their next turns must move.
        counts = {u: sum(turns[-1][1] == u for turns in seen.values()) for u in real_urls}
        state["victim"] = victim = max(counts, key=lambda u: counts[u])
        # The drain is applied when this answer is sent (wait=False).
        try:
            state["reply"] = gw.admin("POST", "/replicas/drain", json={"url": victim, "deadline_s": 60})
        finally:
            state["applied"] = time.monotonic()
            drained.set()
        try:
            wait_until(lambda: victim not in gw.replicas(), 90.0, "the drained victim removed")
            state["removed"] = True
        except TimeoutError:
            state["removed"] = False

    thread = threading.Thread(target=drain)
    try:
        thread.start()
        errors = asyncio.run(_sessions_then(gw, seen, ready, drained))
        thread.join(120.0)
        assert not errors, errors
        assert all(len(turns) == TURNS for turns in seen.values()), seen
        reply, victim, applied = state["reply"], state["victim"], state["applied"]
        assert reply.status_code == 200, reply.text
        assert state["removed"], (victim, gw.replicas())
        after = {s: [r for sent, r in turns if sent > applied] for s, turns in seen.items()}
        assert all(victim not in reps for reps in after.values()), (victim, applied, seen)
        # a session the victim served before the drain went on elsewhere
        assert any(after[s] and any(r == victim for sent, r in turns if sent < applied)
                   for s, turns in seen.items()), (victim, applied, seen)
    finally:
        gw.proc.stop()


class Turns:
    """A session through the gateway that records (replica, expected, prompt, cached) per turn."""

    def __init__(self, gw: Gateway, key: str) -> None:
        self.c = client(gw.url)
        self.key = key
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": "Flush test, kvgate. " * 40}]
        self.rows: list[tuple[str, int, int, int]] = []

    def turn(self) -> tuple[str, int, int, int]:
        self.messages.append({"role": "user", "content": f"turn {len(self.rows)}: radix trees. " * 12})
        r = self.c.post("/v1/chat/completions", headers={"x-kvgate-session": self.key},
                        json={"model": MODEL, "messages": self.messages, "max_tokens": 8})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        self.messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""})
        row = (r.headers["x-kvgate-replica"], int(r.headers[EXPECTED]), usage["prompt_tokens"],
               (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        self.rows.append(row)
        return row


def test_after_flush_cache_the_gateway_learns_from_cached_tokens(real_urls: list[str], tmp_path: Path) -> None:
    gw = start_gateway(real_urls, tmp_path / "gateway.log")
    session = Turns(gw, "real-flush-learn")
    try:
        replica, _, prompt0, _ = session.turn()
        _, expected1, prompt1, cached1 = session.turn()
        assert cached1 >= 0.95 * prompt0 and expected1 > 0, session.rows  # it predicted the hit
        with client(replica) as c:
            wait_until(lambda: c.post("/flush_cache").status_code == 200, 30.0, "/flush_cache 200")
        _, expected2, _, cached2 = session.turn()
        assert expected2 >= expected1 and cached2 < 0.1 * prompt1, session.rows  # believed; the server had nothing
        _, expected3, _, _ = session.turn()
        assert expected3 < 0.5 * expected2, session.rows  # learned from cached_tokens: the prediction dropped
        for _ in range(2):  # and never predicts more than the server really holds (beyond the tolerance)
            _, expected, _, cached = session.turn()
            assert expected <= cached + max(0.5 * expected, 64), session.rows
        assert session.rows[-1][3] >= 0.95 * session.rows[-2][2], session.rows  # the cache is warm again
        assert {r for r, *_ in session.rows} <= set(real_urls), session.rows
    finally:
        session.c.close()
        gw.proc.stop()


async def _streams(gw: Gateway, spare: SGLangServer, seen: list[tuple[bool, str]]) -> None:
    oa, gate = async_api(gw), asyncio.Semaphore(4)

    async def one(i: int) -> None:
        async with gate:
            try:
                stream = await oa.chat.completions.create(
                    model=MODEL, stream=True, max_tokens=40, extra_body={"ignore_eos": True},
                    messages=[{"role": "user", "content": f"stream {i}: a long story please. " * 10}],
                    extra_headers={"x-kvgate-session": f"real-term-{i}"})
                chunks = [c async for c in stream]
                seen.append((True, str(len(chunks))))
            except openai.APIError as e:
                seen.append((False, repr(e)))

    try:
        tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
        await asyncio.to_thread(wait_until, lambda: gw.replicas()[spare.url]["in_flight"] >= 1, 60.0,
                                "a stream in flight on the spare")
        assert spare.popen is not None
        spare.popen.send_signal(signal.SIGTERM)  # its main process, as an orchestrator does
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=180.0)
    finally:
        await oa.close()


def test_sigterm_of_a_real_server_behind_the_gateway_loses_nothing(
        sigterm_spare: SGLangServer, real_urls: list[str], tmp_path: Path) -> None:
    spare = sigterm_spare
    survivor = real_urls[0]
    gw = start_gateway([survivor, spare.url], tmp_path / "gateway.log", "--policy", "round-robin")
    try:
        seen: list[tuple[bool, str]] = []
        asyncio.run(_streams(gw, spare, seen))
        assert len(seen) == STREAMS and all(ok for ok, _ in seen), seen
        assert spare.popen is not None and spare.popen.wait(60) is not None
        wait_until(lambda: gw.replicas().get(spare.url, {}).get("state") != "active", 20.0, "the spare leaves")
        with client(gw.url) as c:
            after = c.post("/v1/chat/completions", headers={"x-kvgate-session": "real-term-after"},
                           json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert after.status_code == 200, after.text
        assert after.headers["x-kvgate-replica"] == survivor
    finally:
        gw.proc.stop()
