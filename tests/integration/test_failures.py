"""Failures over real processes: a replica killed mid-load, 5xx answers, a stream that
dies after its first byte. Before the first byte the gateway retries elsewhere (the
client never knows); after it, the client gets an SSE error event, never a truncation."""
from __future__ import annotations

import asyncio
import json
import signal
from dataclasses import dataclass

import httpx
import openai

from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import Gateway, GatewayFactory, set_faults, wait_until


@dataclass
class Result:
    ok: bool
    started: bool  # the client had received at least one chunk
    error: str = ""


async def _stream_one(oa: openai.AsyncOpenAI, i: int, max_tokens: int) -> Result:
    started = False
    try:
        stream = await oa.chat.completions.create(
            model="tiny", stream=True, max_tokens=max_tokens,
            messages=[{"role": "user", "content": f"request {i}: " + "tell me a story. " * 30}],
            extra_headers={"x-kvgate-session": f"kill-{i}"}, extra_body={"ignore_eos": True})
        async for _chunk in stream:
            started = True
        return Result(True, started)
    except openai.APIError as e:
        return Result(False, started, repr(e))


def _busiest(gw: Gateway, fleet: SimFleet) -> int:
    loads = {url: v["in_flight"] for url, v in gw.replicas().items()}
    return max(range(fleet.n), key=lambda i: loads.get(fleet.urls[i], -1))


async def _load_and_kill(gw: Gateway, fleet: SimFleet) -> tuple[list[Result], int]:
    """36 streams, 6 at a time; the replica with the most streams in flight is killed."""
    oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60.0)
    sem = asyncio.Semaphore(6)

    async def limited(i: int) -> Result:
        async with sem:
            return await _stream_one(oa, i, max_tokens=200)

    try:
        tasks = [asyncio.create_task(limited(i)) for i in range(36)]
        await asyncio.sleep(0.5)
        victim = await asyncio.to_thread(_busiest, gw, fleet)
        fleet.signal(victim, signal.SIGKILL)
        return list(await asyncio.gather(*tasks)), victim
    finally:
        await oa.close()


def test_killed_replica_costs_no_request_that_had_not_started(fleet3: SimFleet, make_gateway: GatewayFactory) -> None:
    gw = make_gateway(fleet3.urls)
    results, victim = asyncio.run(_load_and_kill(gw, fleet3))
    failed = [r for r in results if not r.ok]
    assert all(r.started for r in failed), failed  # only streams already under way may fail
    assert len(failed) <= 6, failed  # at most the concurrency
    assert sum(r.ok for r in results) >= 30
    wait_until(lambda: all(v["in_flight"] == 0 for v in gw.replicas().values()), 15.0, "leases released")
    wait_until(lambda: gw.replicas().get(fleet3.urls[victim], {}).get("state") != "active", 15.0,
               "the killed replica leaves routing")


def test_5xx_replica_is_retried_elsewhere(fleet3: SimFleet, make_gateway: GatewayFactory) -> None:
    gw = make_gateway(fleet3.urls)
    set_faults(fleet3.urls[0], error_rate=1.0, error_status=503)
    direct = httpx.post(fleet3.urls[0] + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                        timeout=10.0)
    assert direct.status_code == 503  # the fault is on (else the port is not our replica's)
    oa = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30.0)
    for i in range(12):
        raw = oa.completions.with_raw_response.create(model="tiny", prompt=f"prompt number {i} " * 10, max_tokens=2)
        assert raw.headers["x-kvgate-replica"] != fleet3.urls[0], (i, raw.status_code, raw.headers, raw.text)
    metrics = httpx.get(gw.url + "/metrics", timeout=5.0).text
    assert 'kvgate_upstream_retries_total{reason="status_503"}' in metrics or \
        gw.replicas()[fleet3.urls[0]]["state"] == "unhealthy"


def test_stream_dying_after_first_byte_ends_with_error_event(fleet3: SimFleet, make_gateway: GatewayFactory) -> None:
    gw = make_gateway([fleet3.urls[2]])
    set_faults(fleet3.urls[2], die_after_chunks=3, die_mode="close")
    events: list[str] = []
    with httpx.stream("POST", gw.url + "/v1/chat/completions", timeout=30.0, json={
            "model": "tiny", "stream": True, "max_tokens": 40, "ignore_eos": True,
            "messages": [{"role": "user", "content": "a long answer please"}]}) as r:
        assert r.status_code == 200 and r.headers["x-kvgate-replica"] == fleet3.urls[2]
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    assert "error" in json.loads(events[-2])
    assert len(events) >= 3  # the replica's first events were relayed before the error
    wait_until(lambda: gw.replicas()[fleet3.urls[2]]["in_flight"] == 0, 10.0, "lease released")
