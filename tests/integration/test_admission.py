"""Prefill admission over real processes: a warm turn overtakes a cold one held behind a prefill.

One simulated replica (``tiny`` profile, slowed down so a ~2,500-token prefill takes
about a second) behind a real ``kvgate serve``. A cold request A starts prefilling; then a
second cold request B and, a little later, a short request C arrive. The replica serves
first come, first served, so without admission C's first token comes after B's whole
prefill. With admission (a budget of 16 tokens: one request at a time) both wait in the
gateway while A prefills and C, the smaller, is released first. The test compares the
order of first tokens (not their times) with admission on and off.

Each request is sent only once the one before it has been seen where it waits (the
replica's /v1/loads counts it, or the gateway's ``kvgate_admission_held`` does), not after
a fixed sleep: on a loaded machine B could otherwise reach the replica after C (CI run of
stop 21: ``['A', 'C', 'B']`` without admission).

Without admission C can still share B's last prefill chunk (the simulated scheduler's
chunks span requests, as SGLang's do): both first tokens then come from the same step and
reach the client in either order. That is not an overtaking, so the check without
admission is that C's first token came no earlier than B's step (``SAME_STEP_S``, far
below one 512-token chunk, ~0.2 s here); with admission C comes a whole prefill earlier.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import openai

from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import Gateway, GatewayFactory
from tests.support.profiles import tiny_not_memory_bound

SAME_STEP_S = 0.05  # first tokens of one prefill step, as the client sees them
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


def prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def _first_token(oa: openai.AsyncOpenAI, name: str, text: str, order: list[tuple[str, float]]) -> None:
    stream = await oa.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=2, stream=True)
    async for _chunk in stream:
        order.append((name, time.monotonic()))
        break
    async for _chunk in stream:
        pass


async def _until(what: str, seen: Callable[[], Awaitable[bool]], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await seen():
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen within {timeout_s} s: {what}")
        await asyncio.sleep(0.02)


async def _race(gw: Gateway, replica: str, seed: int) -> list[tuple[str, float]]:
    """The first tokens of A, B and C: (name, when the client saw it), in arrival order."""
    oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60.0)
    order: list[tuple[str, float]] = []
    async with httpx.AsyncClient(timeout=10.0) as http:
        async def at_replica() -> int:
            load = (await http.get(replica + "/v1/loads")).json()["loads"][0]
            return int(load["num_running_reqs"]) + int(load["num_waiting_reqs"])

        async def held() -> float:
            text = (await http.get(gw.url + "/metrics")).text
            return sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("kvgate_admission_held{"))

        async def waiting(n: int) -> bool:  # n requests at the replica or held by the gateway
            return await at_replica() + await held() >= n

        try:
            a = asyncio.create_task(_first_token(oa, "A", prompt(seed, 2_400), order))
            await _until("A at the replica", lambda: waiting(1))
            b = asyncio.create_task(_first_token(oa, "B", prompt(seed + 1, 2_400), order))
            await _until("B queued at the replica or held by the gateway", lambda: waiting(2))
            assert order == [], "A's prefill ended before C was sent: the race did not happen"
            c = asyncio.create_task(_first_token(oa, "C", prompt(seed + 2, 40), order))
            await asyncio.wait_for(asyncio.gather(a, b, c), 60)
        finally:
            await oa.close()
    return order


def _waits(gw: Gateway) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith('kvgate_admission_wait_seconds_count{released_by="budget"}'))


def test_a_short_turn_overtakes_a_cold_one_only_with_admission(make_gateway: GatewayFactory, tmp_path: Path) -> None:
    with SimFleet(1, profile=str(tiny_not_memory_bound(tmp_path)), time_scale=0.25, seed=5, log_dir=tmp_path) as fleet:
        fifo = make_gateway(fleet.urls, "--set", "admission.enabled=false")
        try:
            order = asyncio.run(_race(fifo, fleet.urls[0], 1))
        finally:
            fifo.proc.stop()
        at = dict(order)
        assert len(order) == 3 and order[0][0] == "A", order
        assert at["C"] >= at["B"] - SAME_STEP_S, order  # C did not overtake B's prefill
        gated = make_gateway(fleet.urls, "--set", "admission.budget_tokens=16")
        order = asyncio.run(_race(gated, fleet.urls[0], 11))
        assert [name for name, _ in order] == ["A", "C", "B"], order
        at = dict(order)
        assert at["B"] - at["C"] > SAME_STEP_S, order  # a whole prefill earlier, not the same step
        assert _waits(gated) >= 2  # B and C were held, and released by the budget


def test_a_memory_bound_replica_is_first_come_first_served(make_gateway: GatewayFactory, tmp_path: Path) -> None:
    """The bundled ``tiny`` replica serves 8,192-token contexts on a 4,096-token KV pool (its
    /v1/models ``max_model_len`` against /server_info's pool): the gateway holds nothing for
    it, whatever the budget, and the short turn does not overtake."""
    with SimFleet(1, profile="tiny", time_scale=0.25, seed=5, log_dir=tmp_path) as fleet:
        gated = make_gateway(fleet.urls, "--set", "admission.budget_tokens=16")
        order = asyncio.run(_race(gated, fleet.urls[0], 21))
        at = dict(order)
        assert len(order) == 3 and order[0][0] == "A", order
        assert at["C"] >= at["B"] - SAME_STEP_S, order
        text = httpx.get(gated.url + "/metrics", timeout=10).text
        assert not [line for line in text.splitlines()
                    if line.startswith("kvgate_admission_wait_seconds_count{") and float(line.split()[-1]) > 0]
