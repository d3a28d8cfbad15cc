"""Drain and load release over real processes.

Draining a replica under load loses no request and moves its sessions elsewhere; a
client that disconnects mid-stream releases its load (``in_flight`` returns to 0).
"""
from __future__ import annotations

import asyncio
import threading

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam

from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import Gateway, GatewayFactory, wait_until

SESSIONS = 9
TURNS = 6


async def _session(oa: openai.AsyncOpenAI, s: int, seen: dict[int, list[str]], errors: list[str]) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": f"Agent {s}. " + "Follow the house style guide. " * 40}]
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"step {turn}"})
        try:
            raw = await oa.chat.completions.with_raw_response.create(
                model="tiny", messages=messages, max_tokens=40, extra_body={"ignore_eos": True},
                extra_headers={"x-kvgate-session": f"drain-{s}"})
        except openai.APIError as e:
            errors.append(f"session {s} turn {turn}: {e!r}")
            return
        seen[s].append(raw.headers["x-kvgate-replica"])
        messages.append({"role": "assistant", "content": raw.parse().choices[0].message.content or ""})


async def _drive(gw: Gateway, drain_when: threading.Event, seen: dict[int, list[str]]) -> list[str]:
    oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60.0)
    errors: list[str] = []

    async def watcher() -> None:
        while not all(len(v) >= 2 for v in seen.values()):
            await asyncio.sleep(0.02)
        drain_when.set()

    try:
        await asyncio.gather(watcher(), *(_session(oa, s, seen, errors) for s in range(SESSIONS)))
    finally:
        await oa.close()
    return errors


def test_drain_under_load_loses_nothing_and_moves_sessions(fleet3: SimFleet, make_gateway: GatewayFactory) -> None:
    gw = make_gateway(fleet3.urls)
    drain_when = threading.Event()
    drained: dict[str, object] = {}
    seen: dict[int, list[str]] = {s: [] for s in range(SESSIONS)}

    def drain() -> None:
        assert drain_when.wait(60.0)
        loads = gw.replicas()
        victim = max(fleet3.urls, key=lambda u: loads[u]["in_flight"])
        drained["url"] = victim
        started = gw.admin("POST", "/replicas/drain", json={"url": victim, "deadline_s": 30})
        assert started.status_code == 200
        drained["turns_before"] = {s: len(reps) for s, reps in seen.items()}  # the drain is in effect
        drained["reply"] = gw.admin("POST", "/replicas/drain", json={"url": victim, "deadline_s": 30, "wait": True})

    thread = threading.Thread(target=drain)
    thread.start()
    errors = asyncio.run(_drive(gw, drain_when, seen))
    thread.join(60.0)
    assert not errors, errors
    reply = drained["reply"]
    assert isinstance(reply, httpx.Response)
    assert (reply.status_code == 200 and reply.json()["removed"] is True) or reply.status_code == 404  # gone already
    victim = drained["url"]
    assert victim not in gw.replicas()
    before = drained["turns_before"]
    assert isinstance(before, dict)
    # turns sent once the drain was in effect (the one in flight then may have gone there)
    after = {s: reps[before[s] + 1:] for s, reps in seen.items()}
    moved = [s for s, reps in seen.items() if victim in reps[:before[s]] and after[s]]
    assert moved, (victim, seen, before)  # the drained replica had sessions that kept going ...
    assert all(victim not in reps for reps in after.values()), (victim, seen, before)  # ... elsewhere
    assert all(len(reps) == TURNS for reps in seen.values())


def test_client_disconnect_releases_load(fleet3: SimFleet, make_gateway: GatewayFactory) -> None:
    gw = make_gateway(fleet3.urls)
    body = {"model": "tiny", "stream": True, "max_tokens": 4000, "ignore_eos": True,
            "messages": [{"role": "user", "content": "never-ending story"}]}
    with httpx.Client(timeout=30.0) as client, \
            client.stream("POST", gw.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        replica = r.headers["x-kvgate-replica"]
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert gw.replicas()[replica]["in_flight"] == 1
    # leaving the block closed the connection mid-stream
    wait_until(lambda: gw.replicas()[replica]["in_flight"] == 0, 15.0, "the lease of a disconnected client")
    metrics = httpx.get(gw.url + "/metrics", timeout=5.0).text
    assert 'kvgate_requests_total{endpoint="chat",model="tiny",status="499"} 1.0' in metrics
