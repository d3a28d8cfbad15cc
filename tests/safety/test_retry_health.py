"""Retry and health semantics over real processes: a poison request does not take the
fleet down, a replica that kills streams is ejected, a hung replica is routed around."""
from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import start_gateway
from tests.safety.raw_replica import POISON, raw_fleet

pytestmark = pytest.mark.safety
JSON = {"content-type": "application/json"}


def _chat(text: str, stream: bool = False) -> bytes:
    return json.dumps({"model": "m", "stream": stream, "messages": [{"role": "user", "content": text}]}).encode()


@dataclass
class Result:
    status: int
    replica: str
    started_s: float  # when the request was sent
    first_s: float | None  # when its first event arrived (streams)
    complete: bool  # a stream ended with [DONE] and no error event


async def _stream(client: httpx.AsyncClient, text: str, session: str) -> Result:
    started, first, complete = time.monotonic(), None, False
    headers = {**JSON, "x-kvgate-session": session}
    async with client.stream("POST", "/v1/chat/completions", content=_chat(text, True), headers=headers) as r:
        events = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                first = first or time.monotonic()
                events.append(line[6:])
        complete = bool(events) and events[-1] == "[DONE]" and not any('"error"' in e for e in events)
        return Result(r.status_code, r.headers.get("x-kvgate-replica", ""), started, first, complete)


def test_poison_requests_fail_alone(tmp_path: Path) -> None:
    """~10 poison/s next to ~5 good/s for ~5 s on 3 replicas: 0 good requests fail, no
    replica ejected or unhealthy, the poison is answered with the replica's own 500."""
    with raw_fleet(3, tmp_path, modes=["poison"] * 3) as fleet:
        gw = start_gateway(fleet.urls, tmp_path / "gateway.log")
        try:
            async def run() -> tuple[list[int], list[int]]:
                async with httpx.AsyncClient(base_url=gw.url, timeout=20.0) as client:
                    async def one(body: bytes) -> int:
                        return (await client.post("/v1/chat/completions", content=body, headers=JSON)).status_code

                    poison, good = [], []
                    for tick in range(50):  # 5 s in 0.1 s ticks
                        poison.append(asyncio.ensure_future(one(POISON)))
                        if tick % 2 == 0:
                            good.append(asyncio.ensure_future(one(_chat(f"good {tick}"))))
                        await asyncio.sleep(0.1)
                    return list(await asyncio.gather(*poison)), list(await asyncio.gather(*good))

            poison, good = asyncio.run(asyncio.wait_for(run(), 60.0))
            views = gw.replicas()
            ejections = gw.metric("kvgate_replica_ejections_total")
            answered = sum(fleet.stats(i)["answered"] for i in range(3))
        finally:
            gw.proc.stop()
    assert good == [200] * 25
    assert poison == [500] * 50
    assert all(v["state"] == "active" and not v["ejected"] for v in views.values()), views
    assert ejections == 0
    assert answered < 2 * 50 + 25  # judged poison once, then no retries for its copies


def test_replica_killing_streams_is_ejected_and_its_sessions_move(tmp_path: Path) -> None:
    with raw_fleet(3, tmp_path, "--events", "4", modes=["echo", "echo", "kill_stream"]) as fleet:
        killer = fleet.urls[2]
        gw = start_gateway(fleet.urls, tmp_path / "gateway.log")
        try:
            async def turns(n: int) -> list[Result]:
                async with httpx.AsyncClient(base_url=gw.url, timeout=20.0) as client:
                    results = []
                    for turn in range(n):
                        results += await asyncio.gather(*(_stream(client, f"s{s} turn {turn}", f"s{s}")
                                                          for s in range(9)))
                    return results

            before = asyncio.run(asyncio.wait_for(turns(3), 60.0))
            view = gw.replicas()[killer]
            after = asyncio.run(asyncio.wait_for(turns(2), 60.0))
        finally:
            gw.proc.stop()
    broken = [r for r in before if not r.complete]
    assert broken and all(r.replica == killer and r.status == 200 for r in broken)
    assert view["ejected"] and not view["routable"]
    assert all(r.complete and r.replica != killer for r in after)


def test_hung_replica_is_routed_around_and_no_request_is_lost(tmp_path: Path) -> None:
    """SIGSTOP one of 3 replicas under streaming load: streams that had not started fail
    over within the head (or first-byte) timeout, the replica leaves routing, later streams
    avoid it."""
    # first_byte_timeout_s: a replica stopped between a stream's head and its first event
    # holds it for that long before it fails over (300 s by default, past the client's 20 s)
    flags = ("--set", "upstream.head_timeout_s=1", "--set", "upstream.first_byte_timeout_s=2",
             "--set", "upstream.stall_timeout_s=2", "--set", "registry.probe_timeout_s=0.5")
    with raw_fleet(3, tmp_path, "--events", "3") as fleet:
        victim = fleet.urls[0]
        gw = start_gateway(fleet.urls, tmp_path / "gateway.log", *flags)
        try:
            async def load() -> tuple[list[Result], float]:
                async with httpx.AsyncClient(base_url=gw.url, timeout=20.0) as client:
                    stop_at = time.monotonic() + 5.0
                    stopped_s = 0.0

                    async def worker(w: int) -> list[Result]:
                        out, i = [], 0
                        while time.monotonic() < stop_at:
                            out.append(await _stream(client, f"w{w} r{i}", f"w{w}-{i}"))
                            i += 1
                        return out

                    tasks = [asyncio.ensure_future(worker(w)) for w in range(6)]
                    await asyncio.sleep(1.0)
                    fleet.procs[0].signal(signal.SIGSTOP)
                    stopped_s = time.monotonic()
                    return [r for t in tasks for r in await t], stopped_s

            results, stopped_s = asyncio.run(asyncio.wait_for(load(), 60.0))
            replicas = gw.replicas()
            view = replicas[victim]
            # for a failure's message: why a request was not retried (budget, ejections)
            seen = {"budget_exhausted": gw.metric("kvgate_retry_budget_exhausted_total"),
                    "replicas": {u: (v["state"], v["ejected"]) for u, v in replicas.items()}}
        finally:
            fleet.procs[0].signal(signal.SIGCONT)
            gw.proc.stop()
    lost = [r for r in results if not r.complete]
    assert all(r.first_s is not None and r.started_s < stopped_s for r in lost), (lost, seen)  # only ones under way
    assert len(lost) <= 6
    assert view["ejected"] or view["state"] == "unhealthy", view
    late = [r for r in results if r.started_s > stopped_s + 3.0]
    assert late and all(r.replica != victim and r.complete for r in late)


def test_phase_timeouts(tmp_path: Path) -> None:
    """A stream with a head but no first chunk fails over; a stream that stalls ends with an
    SSE error event; a non-streaming request the replica holds is never resent (504)."""
    flags = ("--set", "upstream.first_byte_timeout_s=1", "--set", "upstream.stall_timeout_s=1",
             "--set", "upstream.total_timeout_s=1.5", "--set", "policy.name=round-robin")
    with raw_fleet(2, tmp_path, modes=["head_only", "echo"]) as fleet:
        gw = start_gateway(fleet.urls, tmp_path / "gateway.log", *flags)
        try:
            async def streams() -> list[Result]:
                async with httpx.AsyncClient(base_url=gw.url, timeout=20.0) as client:
                    return list(await asyncio.gather(*(_stream(client, f"q{i}", f"s{i}") for i in range(4))))

            results = asyncio.run(asyncio.wait_for(streams(), 30.0))
            retried = gw.metric('kvgate_upstream_retries_total{reason="first_byte_timeout"}')
            stalled = httpx.post(gw.url + "/v1/chat/completions", content=_chat("stall", True), timeout=20.0,
                                 headers={**JSON, "x-raw-mode": "stall"})
            before = sum(fleet.stats(i)["requests"] for i in range(2))
            held = [httpx.post(gw.url + "/v1/chat/completions", content=_chat(f"held {i}"), timeout=20.0,
                               headers={**JSON, "x-raw-mode": "hang"}) for i in range(2)]
            sent = sum(fleet.stats(i)["requests"] for i in range(2)) - before
        finally:
            gw.proc.stop()
    assert all(r.complete and r.replica == fleet.urls[1] for r in results)
    assert retried >= 1
    events = [line[6:] for line in stalled.text.splitlines() if line.startswith("data: ")]
    assert stalled.status_code == 200 and "stalled" in events[-2] and events[-1] == "[DONE]"
    assert [r.status_code for r in held] == [504, 504]
    assert [r.json()["error"]["code"] for r in held] == ["upstream_timeout"] * 2
    assert sent == 2  # the held requests were sent once each, never resent
