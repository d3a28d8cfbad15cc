"""Fleets of REAL SGLang CPU servers (issue 11, item 4): the peers register real servers,
new sessions with a shared long system prompt spread through `kvgate serve` and then stick
with real radix-cache hits, and a real server SIGKILLed mid-load costs no request that had
not started.

The two shared servers of the package fixture are never killed here: the failover test
uses a third real server of its own (started when this module starts, so it warms up while
the other tests run; ~2.1 GB, at most three servers at once). The output text is random
(random weights): only status codes, token counts and routing are asserted.
"""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from loadtest.peers.run import running_peer
from loadtest.sglang_cpu.env import SGLangEnv
from loadtest.sglang_cpu.server import AUTO_PORT, ServerSpec, SGLangServer
from tests.integration.conftest import Gateway, start_gateway, wait_until
from tests.sglang_real.conftest import MAX_TOTAL_TOKENS, MODEL, client
from tests.sglang_real.test_routing import Session

pytestmark = pytest.mark.sglang_real

SHARED_SYSTEM = ("You are the coding agent of the kvgate test suite. Follow the project's conventions, "
                 "keep answers short, cite files by path and never invent results. ") * 24
SESSIONS = 8
TURNS = 4
SPARE_MIN_FREE_KB = 3 * 1024 * 1024  # a real server takes ~2.1 GB RSS


def mem_available_kb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    raise RuntimeError("no MemAvailable in /proc/meminfo")


@pytest.fixture(scope="module", autouse=True)
def spare_server(sglang_env: SGLangEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    """A third real server for the failover test, started (not waited for) at module start."""
    free_kb = mem_available_kb()
    if free_kb < SPARE_MIN_FREE_KB:
        pytest.fail(f"not enough memory for a third real SGLang server: {free_kb // 1024} MB available")
    server = SGLangServer(sglang_env, ServerSpec(port=AUTO_PORT, max_total_tokens=MAX_TOTAL_TOKENS),
                          tmp_path_factory.mktemp("sglang-spare") / "sglang-spare.log")
    server.start()
    yield server
    server.stop()


def chat_body(user: str, max_tokens: int = 8) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.0,
            "messages": [{"role": "system", "content": SHARED_SYSTEM}, {"role": "user", "content": user}]}


@pytest.mark.parametrize("kind", ["sglang-router", "smg"])
def test_peer_registers_real_servers(kind: str, real_urls: list[str], tmp_path: Path) -> None:
    """The peer loads the tokenizer from the real servers' local `model_path`, registers both,
    and relays real usage: the repeat of a request is (almost) entirely cached."""
    body = chat_body(f"{kind}: explain a radix tree over token pages in three short points.")
    with running_peer(kind, real_urls, log_dir=tmp_path, ready_timeout_s=90.0) as peer, \
            client(peer.url) as c:
        first = c.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        second = c.post("/v1/chat/completions", json=body)
        assert second.status_code == 200, second.text
    usage1, usage2 = first.json()["usage"], second.json()["usage"]
    assert usage1["prompt_tokens"] > 500 and usage2["prompt_tokens"] == usage1["prompt_tokens"]
    assert 0 < usage2["completion_tokens"] <= 8
    cached = (usage2.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert cached >= 0.95 * usage1["prompt_tokens"], (usage1, usage2)


@pytest.fixture(scope="module")
def gateway(real_urls: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = start_gateway(real_urls, tmp_path_factory.mktemp("gw-fleet") / "gateway.log")
    yield gw
    gw.proc.stop()


def shared_prompt_session(gw: Gateway, k: int) -> Session:
    """A new session whose prompt starts with the shared long system prompt, then its own text."""
    session = Session(gw, f"fleet-shared-{k}")
    session.messages[0] = {"role": "system", "content": SHARED_SYSTEM}
    session.messages += [{"role": "user", "content": f"I am session {k}; my task is ticket {k * 37}."},
                         {"role": "assistant", "content": "Understood."}]
    return session


def test_new_sessions_with_a_shared_system_prompt_spread_then_stick(gateway: Gateway,
                                                                    real_urls: list[str]) -> None:
    sessions = [shared_prompt_session(gateway, k) for k in range(SESSIONS)]
    try:
        with ThreadPoolExecutor(SESSIONS) as pool:
            for i in range(TURNS):  # every session's turn i at once
                list(pool.map(Session.turn, sessions, [i] * SESSIONS, timeout=120))
    finally:
        for s in sessions:
            s.close()
    first = [s.turns[0][0] for s in sessions]
    assert set(first) <= {u.rstrip("/") for u in real_urls}, first
    assert len(set(first)) == 2, first  # not all on one replica
    for s in sessions:
        assert {r for r, _, _ in s.turns} == {s.turns[0][0]}, s.turns  # each keeps its replica
        for (_, prev_prompt, _), (_, prompt, cached) in zip(s.turns, s.turns[1:]):
            assert prompt > prev_prompt
            assert cached >= 0.95 * prev_prompt, s.turns


async def _stream(oa: openai.AsyncOpenAI, i: int) -> tuple[bool, bool, str]:
    """(ok, started, error) of one streamed chat of 40 tokens."""
    started = False
    try:
        stream = await oa.chat.completions.create(
            model=MODEL, stream=True, max_tokens=40, messages=chat_body(f"stream {i}: tell a story.")["messages"],
            extra_headers={"x-kvgate-session": f"fleet-kill-{i}"}, extra_body={"ignore_eos": True})
        async for _chunk in stream:
            started = True
        return True, started, ""
    except openai.APIError as e:
        return False, started, repr(e)


async def _load_and_kill(gw: Gateway, victim: SGLangServer, n: int, concurrency: int) -> list[tuple[bool, bool, str]]:
    http = openai.DefaultAsyncHttpxClient(trust_env=False, timeout=120.0)
    oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, http_client=http)
    sem = asyncio.Semaphore(concurrency)

    async def limited(i: int) -> tuple[bool, bool, str]:
        async with sem:
            return await _stream(oa, i)

    try:
        tasks = [asyncio.create_task(limited(i)) for i in range(n)]
        await asyncio.to_thread(wait_until, lambda: gw.replicas()[victim.url]["in_flight"] >= 1, 30.0,
                                "a stream in flight on the victim")
        victim.signal(signal.SIGKILL)  # the whole process tree, as when its machine dies
        return list(await asyncio.gather(*tasks))
    finally:
        await oa.close()


def test_real_server_sigkilled_mid_load(spare_server: SGLangServer, real_urls: list[str], tmp_path: Path) -> None:
    """12 streams, 4 at a time, over shared server 0 and the spare; the spare is SIGKILLed
    once it has a stream in flight: only streams already under way may fail, and the
    killed server leaves routing while server 0 keeps serving."""
    spare_server.wait_healthy()
    survivor = real_urls[0].rstrip("/")
    # A refused connection's retry is outside the retry budget; a stream cut before its first
    # byte is retried within it, so the budget is sized to the concurrency here (the budget
    # itself: tests/gateway/test_proxy_unit.py).
    gw = start_gateway([survivor, spare_server.url], tmp_path / "gateway.log",
                       "--set", "upstream.retry_budget_min=4")
    try:
        results = asyncio.run(_load_and_kill(gw, spare_server, n=12, concurrency=4))
        failed = [r for r in results if not r[0]]
        assert all(started for _, started, _ in failed), failed
        assert len(failed) <= 4, failed
        wait_until(lambda: gw.replicas()[spare_server.url]["state"] != "active", 20.0, "the victim leaves routing")
        wait_until(lambda: all(v["in_flight"] == 0 for v in gw.replicas().values()), 20.0, "leases released")
        with client(gw.url) as c:
            after = c.post("/v1/chat/completions", json=chat_body("after the kill"),
                           headers={"x-kvgate-session": "fleet-after-kill"})
        assert after.status_code == 200, after.text
        assert after.headers["x-kvgate-replica"].rstrip("/") == survivor
    finally:
        gw.proc.stop()
