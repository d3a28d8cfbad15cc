"""A burst of new sessions sharing a long system prompt spreads (real processes).

18 coding-agent sessions start at once on 3 simulated replicas behind a real
``kvgate serve``, all with the same ~2,000-word system prompt (the ``tiny`` profile's
context is 8,192 tokens). Predict-on-route records the prompt on the first session's
replica, so every later new session sees its cheapest first turn there; the placement
term of ``cache-aware`` (`policies.placement`) must still spread them: no replica gets
more than half, in every run, whatever ``policy.seed``. A 10-turn session started
afterwards stays on one replica (affinity is untouched).
"""
from __future__ import annotations

import asyncio
import random
from collections import Counter

import openai
from openai.types.chat import ChatCompletionMessageParam

from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import Gateway, GatewayFactory

SESSIONS = 18
SEEDS = (1, 2, 3, 4)
WORDS = ("repository", "function", "always", "never", "tests", "module", "return", "style",
         "review", "commit", "branch", "typed", "docstring", "refactor", "async", "timeout")


def system_prompt(seed: int, words: int = 2_000) -> str:
    rng = random.Random(seed)
    return "You are a coding agent. " + " ".join(rng.choice(WORDS) for _ in range(words))


def client(gw: Gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60.0)


async def _turn(oa: openai.AsyncOpenAI, messages: list[ChatCompletionMessageParam],
                session: str) -> tuple[str, str, str]:
    raw = await oa.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=4, extra_headers={"x-kvgate-session": session})
    reply = raw.parse().choices[0].message.content or ""
    return raw.headers["x-kvgate-replica"], raw.headers["x-kvgate-route-reason"], reply


async def _burst(gw: Gateway, seed: int) -> tuple[list[str], list[str]]:
    """18 concurrent first turns, then a 10-turn session; the replicas each was sent to."""
    system: ChatCompletionMessageParam = {"role": "system", "content": system_prompt(seed)}
    oa = client(gw)
    try:
        first = await asyncio.gather(*(
            _turn(oa, [system, {"role": "user", "content": f"task {i}: fix the failing test"}],
                  f"burst-{seed}-{i}")
            for i in range(SESSIONS)))
        messages: list[ChatCompletionMessageParam] = [system]
        long_session: list[str] = []
        for turn in range(10):
            messages.append({"role": "user", "content": f"step {turn}: run the tests again"})
            replica, _, reply = await _turn(oa, messages, f"long-{seed}")
            long_session.append(replica)
            messages.append({"role": "assistant", "content": reply})
    finally:
        await oa.close()
    return [r for r, _, _ in first], long_session


def test_burst_of_new_sessions_spreads_and_long_session_sticks(
    fleet3: SimFleet, make_gateway: GatewayFactory
) -> None:
    for seed in SEEDS:
        gw = make_gateway(fleet3.urls, "--set", f"policy.seed={seed}")
        try:
            burst, long_session = asyncio.run(_burst(gw, seed))
        finally:
            gw.proc.stop()
        counts = Counter(burst)
        assert len(burst) == SESSIONS
        assert max(counts.values()) <= SESSIONS // 2, f"seed {seed}: {dict(counts)}"
        assert len(set(long_session)) == 1, f"seed {seed}: {long_session}"
