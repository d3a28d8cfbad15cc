"""A burst of new sessions sharing a long system prompt spreads (real processes).

18 coding-agent sessions start at once on 3 simulated replicas behind a real
``kvgate serve``, all with the same system prompt of 2,000, 8,000 or 30,000 words
(~3.7k, ~15k and ~56k tokens), on the default profile and on ``tiny-long`` (``tiny``'s
numbers with a 131,072-token context: ``tiny``'s 8,192 tokens take only the 2,000-word
prompt, which runs on ``tiny`` itself too). Predict-on-route records the prompt on the
first session's replica, so every later new session sees its cheapest first turn there;
the placement term of ``cache-aware`` (`policies.placement`) must still spread them: no
replica gets more than half and every replica gets at least one, in every run, whatever
``policy.seed`` (four per case). Two runs of each case send the 18 first turns at
once, two stagger them over 1.5 s (earlier ones have finished their prefill: the replicas
hold the prompt for real, and the gateway has their usage). A 10-turn session started
afterwards stays on one replica (affinity is untouched).

One fleet per profile serves every case (each case has its own prompt, so the replicas'
caches do not carry over); a fresh gateway per run. ``time_scale`` keeps a 56k-token
prefill under a wall second.
"""
from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from loadtest.simulator.fleet import SimFleet
from loadtest.simulator.profile import load_profile
from tests.integration.conftest import Gateway, start_gateway

SESSIONS = 18
SEEDS = (1, 2, 3, 4)  # odd: all first turns at once; even: staggered over STAGGER_S
STAGGER_S = 1.5
WORDS = ("repository", "function", "always", "never", "tests", "module", "return", "style",
         "review", "commit", "branch", "typed", "docstring", "refactor", "async", "timeout")
# profile -> simulated seconds per wall second (the default profile prefills 40k tokens/s,
# tiny and tiny-long 10k tokens/s)
TIME_SCALE = {"kimi-k2.6-b200-tp8": 4.0, "tiny-long": 16.0, "tiny": 2.0}
CASES = [("kimi-k2.6-b200-tp8", 2_000), ("kimi-k2.6-b200-tp8", 8_000), ("kimi-k2.6-b200-tp8", 30_000),
         ("tiny", 2_000), ("tiny-long", 8_000), ("tiny-long", 30_000)]


def system_prompt(seed: int, words: int) -> str:
    rng = random.Random(seed * 100_003 + words)
    return "You are a coding agent. " + " ".join(rng.choice(WORDS) for _ in range(words))


class Fleets:
    """One 3-replica fleet per profile, started on first use and shared by the module."""

    def __init__(self, log_dir: pytest.TempPathFactory) -> None:
        self.log_dir = log_dir
        self.started: dict[str, SimFleet] = {}

    def get(self, profile: str) -> SimFleet:
        if profile not in self.started:
            fleet = SimFleet(3, profile=profile, time_scale=TIME_SCALE[profile], seed=11,
                             log_dir=self.log_dir.mktemp(profile))
            self.started[profile] = fleet.__enter__()
        return self.started[profile]


@pytest.fixture(scope="module")
def fleets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleets]:
    shared = Fleets(tmp_path_factory)
    yield shared
    for fleet in shared.started.values():
        fleet.stop()


def client(gw: Gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120.0)


async def _turn(oa: openai.AsyncOpenAI, model: str, messages: list[ChatCompletionMessageParam],
                session: str, delay_s: float = 0.0) -> tuple[str, str, str]:
    await asyncio.sleep(delay_s)
    raw = await oa.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=4, extra_headers={"x-kvgate-session": session})
    reply = raw.parse().choices[0].message.content or ""
    return raw.headers["x-kvgate-replica"], raw.headers["x-kvgate-route-reason"], reply


async def _burst(gw: Gateway, model: str, seed: int, words: int) -> tuple[list[tuple[str, str]], list[str]]:
    """18 first turns (at once, or staggered), then a 10-turn session: (replica, reason)
    of each first turn, and the replica of each turn of the long session."""
    system: ChatCompletionMessageParam = {"role": "system", "content": system_prompt(seed, words)}
    rng = random.Random(seed)
    delays = [rng.uniform(0.0, STAGGER_S) if seed % 2 == 0 else 0.0 for _ in range(SESSIONS)]
    oa = client(gw)
    try:
        first = await asyncio.gather(*(
            _turn(oa, model, [system, {"role": "user", "content": f"task {i}: fix the failing test"}],
                  f"burst-{seed}-{words}-{i}", delays[i])
            for i in range(SESSIONS)))
        messages: list[ChatCompletionMessageParam] = [system]
        long_session: list[str] = []
        for turn in range(10):
            messages.append({"role": "user", "content": f"step {turn}: run the tests again"})
            replica, _, reply = await _turn(oa, model, messages, f"long-{seed}-{words}")
            long_session.append(replica)
            messages.append({"role": "assistant", "content": reply})
    finally:
        await oa.close()
    return [(r, why) for r, why, _ in first], long_session


@pytest.mark.parametrize(("profile", "words"), CASES, ids=[f"{p}-{w}w" for p, w in CASES])
def test_burst_of_new_sessions_spreads_and_long_session_sticks(
    fleets: Fleets, tmp_path: Path, profile: str, words: int
) -> None:
    fleet = fleets.get(profile)
    model = load_profile(profile).served_model_name
    for seed in SEEDS:
        gw = start_gateway(fleet.urls, tmp_path / f"gateway-{seed}.log", "--set", f"policy.seed={seed}")
        try:
            burst, long_session = asyncio.run(_burst(gw, model, seed, words))
            gw.assert_quiet()
        finally:
            gw.proc.stop()
        counts = Counter(r for r, _ in burst)
        where = f"{profile}, {words} words, seed {seed}: {dict(counts)} {[why for _, why in burst]}"
        assert len(burst) == SESSIONS
        assert max(counts.values()) <= SESSIONS // 2, where
        assert set(counts) == set(fleet.urls), where  # every replica got at least one
        assert len(set(long_session)) == 1, f"{where}; long session: {long_session}"
