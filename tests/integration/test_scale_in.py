"""Cache-aware scale-in over real processes: four simulated replicas, one real gateway.

Sessions are spread over the replicas by the gateway's own policy, then grown unevenly:
the sessions of one replica (the one with the fewest) stay small, every other session
grows. The gateway must name that replica as the one to remove (``GET /admin/scale``),
which the test checks against its own per-replica bookkeeping of what each replica
holds (the ``usage`` of each session's last turn on it: prompt + completion tokens).

Then the behaviour that matters: removing the chosen replica costs fewer cache hits on
the next turn of every session than removing another replica (seeded choice among the
rest). Both scenarios run on the same replicas (caches flushed in between) through a
fresh gateway, with deterministic seeds; the numbers are printed.

Finally ``POST /admin/scale/prepare-removal``: the candidate gets no new sessions and
its sessions' next turns go elsewhere.
"""
from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import Gateway, GatewayFactory

MIN_PER_REPLICA = 2  # sessions per replica before growing them
MAX_SESSIONS = 40
GROW_TURNS = 2
GROW_CHARS = 2400  # ~600 tokens per growth turn
WORDS = ("cache", "replica", "token", "prefix", "session", "agent", "tool", "result", "diff", "patch",
         "module", "kernel", "router", "stream", "batch", "queue", "index", "shard", "block", "page")


@dataclass
class Conv:
    key: str
    messages: list[dict[str, str]]
    replicas: list[str] = field(default_factory=list)
    tokens: int = 0  # prompt + completion of the last turn: what its replica holds for it

    @property
    def home(self) -> str:
        return self.replicas[-1]


@dataclass
class Turn:
    replica: str
    prompt: int
    cached: int


def text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


class Workload:
    """Sessions through one gateway, with per-replica bookkeeping."""

    def __init__(self, gw: Gateway, label: str, seed: int) -> None:
        self.gw, self.label, self.rng = gw, label, random.Random(seed)
        self.client = httpx.Client(timeout=30.0)
        self.convs: list[Conv] = []

    def close(self) -> None:
        self.client.close()

    def turn(self, conv: Conv, chars: int) -> Turn:
        conv.messages.append({"role": "user", "content": text(self.rng, chars)})
        body = {"model": "tiny", "messages": conv.messages, "max_tokens": 4, "ignore_eos": True}
        r = self.client.post(self.gw.url + "/v1/chat/completions", json=body,
                             headers={"x-kvgate-session": conv.key})
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        conv.messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
        usage = data["usage"]
        conv.replicas.append(r.headers["x-kvgate-replica"])
        conv.tokens = usage["prompt_tokens"] + usage["completion_tokens"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return Turn(conv.home, usage["prompt_tokens"], cached)

    def new_session(self) -> Conv:
        i = len(self.convs)
        conv = Conv(f"{self.label}-{i}", [{"role": "system", "content": f"[{self.label} {i}] " + text(self.rng, 800)}])
        self.convs.append(conv)
        self.turn(conv, 200)
        return conv

    def by_replica(self) -> dict[str, list[Conv]]:
        out: dict[str, list[Conv]] = defaultdict(list)
        for conv in self.convs:
            out[conv.home].append(conv)
        return out

    def spread(self, replicas: list[str]) -> None:
        """New sessions until every replica serves MIN_PER_REPLICA of them."""
        while min(len(self.by_replica().get(u, [])) for u in replicas) < MIN_PER_REPLICA:
            assert len(self.convs) < MAX_SESSIONS, {u: len(c) for u, c in self.by_replica().items()}
            self.new_session()

    def grow_all_but(self, cold: str) -> None:
        for _ in range(GROW_TURNS):
            for conv in self.convs:
                if conv.home != cold:
                    self.turn(conv, GROW_CHARS)

    def held_tokens(self, replicas: list[str]) -> dict[str, int]:
        """Ground truth: tokens each replica holds for the sessions it serves."""
        held = {u: 0 for u in replicas}
        for conv in self.convs:
            held[conv.home] += conv.tokens
        return held

    def next_turns(self) -> list[Turn]:
        return [self.turn(conv, 120) for conv in self.convs]


def scale(gw: Gateway) -> dict[str, Any]:
    r = gw.admin("GET", "/scale")
    r.raise_for_status()
    data: dict[str, Any] = r.json()
    return data


def hit_rate(turns: list[Turn]) -> float:
    return sum(t.cached for t in turns) / sum(t.prompt for t in turns)


@pytest.fixture
def fresh_fleet(fleet4: SimFleet) -> Iterator[SimFleet]:
    """The module's four replicas with empty caches."""
    for url in fleet4.urls:
        httpx.post(url + "/flush_cache", timeout=10.0).raise_for_status()
    yield fleet4


def uneven(gw: Gateway, urls: list[str], label: str, seed: int) -> tuple[Workload, str]:
    """Sessions on every replica; all but the least used replica's sessions grown."""
    work = Workload(gw, label, seed)
    work.spread(urls)
    counts = work.by_replica()
    cold = min(urls, key=lambda u: (len(counts[u]), u))
    work.grow_all_but(cold)
    return work, cold


def removal_scenario(gw: Gateway, urls: list[str], label: str, seed: int, pick_other: bool) -> dict[str, Any]:
    work, cold = uneven(gw, urls, label, seed)
    try:
        advice = scale(gw)
        held = work.held_tokens(urls)
        victim = advice["candidate"]
        if pick_other:
            victim = random.Random(seed).choice(sorted(u for u in urls if u != advice["candidate"]))
        r = gw.admin("POST", "/replicas/drain", json={"url": victim, "deadline_s": 10, "wait": True})
        assert r.status_code == 200 and r.json()["removed"], r.text
        after = work.next_turns()
        assert all(t.replica != victim for t in after)
        return {"advice": advice, "held": held, "cold": cold, "victim": victim,
                "hit_rate": hit_rate(after), "lost_tokens": held[victim],
                "sessions_moved": sum(1 for c in work.convs if c.replicas[-2] == victim)}
    finally:
        work.close()


def test_scale_in_chooses_least_cache_and_dips_less(fresh_fleet: SimFleet, make_gateway: GatewayFactory) -> None:
    urls = fresh_fleet.urls
    chosen = removal_scenario(make_gateway(urls), urls, "chosen", 101, pick_other=False)
    held = chosen["held"]
    ranking = chosen["advice"]["ranking"]
    assert chosen["advice"]["candidate"] == min(urls, key=lambda u: held[u]) == chosen["cold"], (held, ranking)
    assert ranking[0]["url"] == chosen["cold"]
    lowest, second = sorted(held.values())[:2]
    assert lowest * 2 < second  # the workload is clearly uneven
    for url in urls:
        httpx.post(url + "/flush_cache", timeout=10.0).raise_for_status()
    other = removal_scenario(make_gateway(urls), urls, "other", 101, pick_other=True)
    print(f"\nscale-in: ground truth held tokens per replica {held}")
    print("gateway ranking (coldest first): "
          + ", ".join(f"{r['url']}={r['cache_value_tokens']}" for r in ranking))
    for name, run in (("chosen", chosen), ("other", other)):
        print(f"remove {name} {run['victim']}: lost {run['lost_tokens']} tokens, {run['sessions_moved']} sessions "
              f"moved, next-turn hit rate {run['hit_rate']:.3f}")
    assert other["victim"] != other["advice"]["candidate"]
    assert chosen["hit_rate"] > other["hit_rate"], (chosen, other)


def test_prepare_removal_steers_sessions_away(fresh_fleet: SimFleet, make_gateway: GatewayFactory) -> None:
    urls = fresh_fleet.urls
    gw = make_gateway(urls)
    work, cold = uneven(gw, urls, "prep", 202)
    try:
        r = gw.admin("POST", "/scale/prepare-removal", json={"count": 1})
        assert r.status_code == 200, r.text
        marked = r.json()["removal_candidates"]
        assert marked == [cold] and gw.replicas()[cold]["removal_candidate"]
        its = [c for c in work.convs if c.home == cold]
        assert its
        fresh = [work.new_session() for _ in range(4)]
        assert all(c.home != cold for c in fresh)
        for conv in its:
            work.turn(conv, 120)
        assert all(c.home != cold for c in its)
        assert scale(gw)["removal_candidates"] == [cold]  # stays marked while the loop runs
        undo = gw.admin("POST", "/scale/prepare-removal", json={"count": 0})
    finally:
        work.close()
    assert undo.status_code == 200 and undo.json()["removal_candidates"] == []
