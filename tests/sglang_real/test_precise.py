"""Precise mode against two REAL SGLang CPU servers publishing KV events (issue 13).

The servers have a KV pool several times smaller than the sessions' working set
(``--max-total-tokens`` 1024 each, page sizes 1 and 4), so the radix caches evict all the
time; the gateway (in-process, with ``gateway.kv_wiring`` attached as the lead's lifespan
lines attach it) subscribes to both event streams. Asserted, per request: the response's
``x-kvgate-expected-cached-tokens`` equals the reported ``cached_tokens`` within one page
for >= 99%; after ``/flush_cache`` the next request there is predicted a miss; after a
restart no stale entry survives. The servers keep SGLang's replay buffer (``replay_endpoint``):
a request served before the gateway subscribed (its batch sent while no subscriber was
connected) is known once the gateway's streams are live. These servers are this module's
own (never more than 2).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

import gateway.app as app_module
from gateway.kv_wiring import PreciseMode, attach_precise
from gateway.settings import load_settings
from loadtest.sglang_cpu.env import SGLangEnv
from loadtest.sglang_cpu.server import (
    AUTO_PORT,
    ServerSpec,
    SGLangServer,
    late_bind_port,
    start_all,
    stop_all,
)
from policies.base import RequestContext, SessionKeys
from prefix_index.base import ReplicaId
from tests.sglang_real.conftest import MODEL

pytestmark = pytest.mark.sglang_real

POOL_TOKENS = 1024
PAGES = (1, 4)
SESSIONS = 6
TURNS = 6
EARLY_PROMPT = "Served before the gateway subscribed to this replica's KV events. " * 6


@pytest.fixture(scope="module")
def servers(sglang_env: SGLangEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SGLangServer]]:
    log_dir = tmp_path_factory.mktemp("sglang-precise")
    started = [SGLangServer(sglang_env, ServerSpec(port=AUTO_PORT, max_total_tokens=POOL_TOKENS, page_size=page,
                                                   kv_events_endpoint=f"tcp://127.0.0.1:{late_bind_port()}",
                                                   kv_events_replay_endpoint=f"tcp://127.0.0.1:{late_bind_port()}"),
                            log_dir / f"sglang-{i}.log") for i, page in enumerate(PAGES)]
    start_all(started)
    yield started
    stop_all(started)


@pytest.fixture(scope="module")
def gateway(servers: list[SGLangServer]) -> Iterator[tuple[TestClient, PreciseMode]]:
    modes: list[PreciseMode] = []
    build = app_module.build_gateway

    def build_with_precise(settings: Any) -> Any:
        gw = build(settings)
        mode = attach_precise(settings.index, gw.client, gw.registry, gw.router, gw.metrics)
        assert mode is not None
        modes.append(mode)
        close = gw.close

        async def close_both() -> None:
            await mode.close()
            await close()

        gw.close = close_both
        return gw

    # served before any gateway subscribed: its events went out to no subscriber (replay buffer only)
    before = httpx.post(servers[0].url + "/v1/chat/completions", trust_env=False, timeout=120,
                        json={"model": MODEL, "max_tokens": 4, "temperature": 0.0,
                              "messages": [{"role": "user", "content": EARLY_PROMPT}]})
    assert before.status_code == 200, before.text
    settings = load_settings(overrides={"registry": {"replicas": [s.url for s in servers], "probe_interval_s": 1.0,
                                                     "unhealthy_after_failures": 2},
                                        "policy": {"seed": 7}})
    patch = pytest.MonkeyPatch()
    patch.setattr(app_module, "build_gateway", build_with_precise)
    try:
        with TestClient(app_module.create_app(settings)) as client:
            wait_for(lambda: len(modes[0].precise_replicas()) == len(servers), 60.0, "both replicas precise")
            yield client, modes[0]
    finally:
        patch.undo()


def wait_for(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s:.0f}s: {what}")
        time.sleep(0.05)


def quiet(mode: PreciseMode, settle_s: float = 0.15, timeout_s: float = 5.0, before: int | None = None,
          first_s: float = 2.0) -> None:
    """Until the event streams stay quiet for ``settle_s`` (a finished request's stores arrived).

    ``before``: the event count before the request; its events are first awaited for up to
    ``first_s`` (under load SGLang's batch can come later than one settle period)."""
    start = time.monotonic()
    while before is not None and mode.sink.events == before and time.monotonic() - start < first_s:
        time.sleep(0.02)
    deadline = time.monotonic() + timeout_s
    last, since = mode.sink.events, time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < settle_s:
        time.sleep(0.02)
        if mode.sink.events != last:
            last, since = mode.sink.events, time.monotonic()


class Chat:
    def __init__(self, n: int) -> None:
        self.sid = f"precise-{n}"
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": f"Session {n} of the precise test. You answer about caches. " * 4}]

    def turn(self, client: TestClient, i: int) -> tuple[str, int, int, int]:
        """(replica, prompt tokens, expected cached (header), reported cached)."""
        self.messages.append({"role": "user", "content": f"Turn {i} of {self.sid}: pages, radix trees, evictions. "
                                                         * 3})
        r = client.post("/v1/chat/completions", headers={"x-kvgate-session": self.sid},
                        json={"model": MODEL, "messages": self.messages, "max_tokens": 6, "temperature": 0.0})
        assert r.status_code == 200, r.text
        body = r.json()
        self.messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"] or ""})
        usage = body["usage"]
        return (r.headers["x-kvgate-replica"], usage["prompt_tokens"],
                int(r.headers["x-kvgate-expected-cached-tokens"]), usage["prompt_tokens_details"]["cached_tokens"])


def page_of(servers: list[SGLangServer], replica: str) -> int:
    return next(s.spec.page_size or 1 for s in servers if s.url == replica)


def test_joining_gateway_knows_what_was_stored_before_it_subscribed(
        gateway: tuple[TestClient, PreciseMode], servers: list[SGLangServer]) -> None:
    _, mode = gateway
    early = ReplicaId(servers[0].url)
    ctx = RequestContext("early", "chat", MODEL, SessionKeys(None), (), 0, 0, 4,
                         payload={"model": MODEL, "messages": [{"role": "user", "content": EARLY_PROMPT}]})
    answer = asyncio.run(mode.lookup(ctx, [early]))
    assert answer is not None and answer.prompt_tokens > 60
    page = page_of(servers, early)
    assert answer.matches[early].device_blocks >= answer.prompt_tokens // page * page - page, answer


def test_predictions_match_reported_cached_tokens_under_eviction(
        gateway: tuple[TestClient, PreciseMode], servers: list[SGLangServer]) -> None:
    client, mode = gateway
    chats = [Chat(n) for n in range(SESSIONS)]
    results = []
    for i in range(TURNS):
        for chat in chats:
            before = mode.sink.events
            results.append(chat.turn(client, i))
            quiet(mode, before=before)
    working_set = sum(r[1] for r in results[-SESSIONS:])
    assert working_set > 2 * POOL_TOKENS, "the workload must overflow the KV pools"
    assert mode.stream_counts()["gaps"] == 0
    exact = [abs(expected - cached) <= page_of(servers, replica) for replica, _, expected, cached in results]
    assert sum(exact) >= 0.99 * len(results), [r for r, ok in zip(results, exact, strict=True) if not ok]
    # the caches hit, and evicted: some later turn found less than its session's previous prompt cached
    previous = {}
    evicted = 0
    for n, (_, prompt, _, cached) in enumerate(results):
        session = n % SESSIONS
        evicted += session in previous and cached < previous[session] - 8
        previous[session] = prompt
    print("precise real:", results)
    assert any(cached > 0 for *_, cached in results) and evicted > 0


def test_flush_then_restart_leave_no_stale_entry(
        gateway: tuple[TestClient, PreciseMode], servers: list[SGLangServer]) -> None:
    client, mode = gateway
    chat = Chat(99)
    replica, _, _, _ = chat.turn(client, 0)
    quiet(mode)
    chat.turn(client, 1)
    quiet(mode)
    rid = ReplicaId(replica)
    assert mode.index.blocks(rid)[0] > 0
    assert httpx.post(replica + "/flush_cache", trust_env=False, timeout=30).status_code == 200
    wait_for(lambda: mode.index.blocks(rid) == (0, 0), 10.0, "AllBlocksCleared applied")
    replica2, _, expected, cached = chat.turn(client, 2)
    if replica2 == replica:
        assert expected == 0 and cached == 0
    else:
        assert abs(expected - cached) <= page_of(servers, replica2)
    # restart the server that holds the session now: its entries must all go
    quiet(mode)
    server = next(s for s in servers if s.url == replica2)
    held = ReplicaId(replica2)
    assert mode.index.blocks(held)[0] > 0
    server.stop()
    server.start()
    server.wait_healthy()
    ctx = RequestContext("check", "chat", MODEL, SessionKeys(None), (), 0, 0, 64,
                         payload={"model": MODEL, "messages": chat.messages})

    def dropped() -> bool:
        answer = asyncio.run(mode.lookup(ctx, [held]))
        return answer is not None and held in answer.matches and answer.matches[held].blocks == 0

    wait_for(dropped, 60.0, "the restarted replica's entries dropped")
    replica3, _, expected, cached = chat.turn(client, 3)
    assert abs(expected - cached) <= page_of(servers, replica3)
