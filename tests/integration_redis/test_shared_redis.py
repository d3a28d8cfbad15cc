"""Several gateway processes on one real redis-server (issue 4): shared prefix index,
shared replica state, leases, outages, bounded memory.

Real processes only: ``redis-server`` (tests/support/redis_server.py), simulated replicas
(``SimFleet``, profile ``tiny``), gateways (``kvgate serve --redis-url ... --replica ...``).
Every wait is bounded; the only timing bounds asserted are the ones the issue states
(a drain is seen by the other gateway within a second; a dead gateway's load is released
within the lease time).
"""
from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import Gateway, start_gateway
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.redis

LEASE_TTL_S = 3.0
SYNC_S = 0.2
Turn = tuple[str, int, int, list[dict[str, str]]]  # replica, prompt tokens, cached tokens, messages


def shared_flags(url: str) -> tuple[str, ...]:
    return ("--redis-url", url, "--set", f"registry.shared.sync_interval_s={SYNC_S}",
            "--set", f"registry.shared.lease_ttl_s={LEASE_TTL_S}", "--set", "index.redis_retry_s=0.2")


def until(cond: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.05) -> float:
    """Poll ``cond`` until true; returns the seconds it took; fails after ``timeout_s``."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"{what}: not within {timeout_s}s"
        time.sleep(poll_s)
    return time.monotonic() - t0


def prompt(rng: random.Random, chars: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "kv", "cache", "route", "token", "block", "prefix"]
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append(rng.choice(words) + str(rng.randrange(1000)))
    return " ".join(out)


def chat(gw: Gateway, session: str, messages: list[dict[str, str]], max_tokens: int = 8,
         timeout_s: float = 60.0) -> Turn:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "user": session}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=timeout_s)
    assert r.status_code == 200, r.text
    data = r.json()
    usage = data["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    answer = {"role": "assistant", "content": data["choices"][0]["message"]["content"]}
    return r.headers["x-kvgate-replica"], usage["prompt_tokens"], cached, [*messages, answer]


def two_turns(first: Gateway, second: Gateway, session: str, seed: int) -> tuple[Turn, Turn]:
    rng = random.Random(seed)
    t1 = chat(first, session, [{"role": "user", "content": prompt(rng, 6000)}])
    t2 = chat(second, session, [*t1[3], {"role": "user", "content": prompt(rng, 300)}])
    return t1, t2


def in_flight(gw: Gateway) -> int:
    return sum(int(v["in_flight"]) for v in gw.replicas().values())


@pytest.fixture(scope="module")
def redis_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    with SimFleet(3, profile="tiny", time_scale=4.0, seed=11, log_dir=tmp_path_factory.mktemp("fleet")) as f:
        yield f


@pytest.fixture(scope="module")
def gateways(fleet: SimFleet, redis_srv: RedisServer, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[Gateway, Gateway]]:
    logs = tmp_path_factory.mktemp("gateways")
    a = start_gateway(fleet.urls, logs / "a.log", *shared_flags(redis_srv.url))
    try:
        b = start_gateway(fleet.urls, logs / "b.log", *shared_flags(redis_srv.url))
    except BaseException:
        a.proc.stop()
        raise
    yield a, b
    a.proc.stop()
    b.proc.stop()


def test_turn_two_through_the_other_gateway_hits_the_cache(gateways: tuple[Gateway, Gateway]) -> None:
    a, b = gateways
    for i in range(3):
        t1, t2 = two_turns(a, b, f"affinity-{i}", seed=i)
        assert t2[0] == t1[0], f"session {i}: turn 1 on {t1[0]}, turn 2 on {t2[0]}"
        assert t2[2] >= 0.9 * t2[1], f"session {i}: cached {t2[2]} of {t2[1]} prompt tokens"


class LongRequests:
    """``n`` long streaming requests through a gateway, each in a thread; ``results()`` waits."""

    def __init__(self, gw: Gateway, n: int, max_tokens: int = 3000) -> None:
        self.pool = ThreadPoolExecutor(n)
        self.futures = [self.pool.submit(self._one, gw.url, i, max_tokens) for i in range(n)]

    @staticmethod
    def _one(url: str, i: int, max_tokens: int) -> int:
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"long request {i} " * 40}],
                "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "user": f"long-{i}"}
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120.0) as r:
                for _ in r.iter_bytes():
                    pass
            return r.status_code
        except httpx.HTTPError:
            return -1  # the gateway died under it

    def results(self, timeout_s: float = 120.0) -> list[int]:
        try:
            return [f.result(timeout=timeout_s) for f in self.futures]
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)


def test_drain_through_one_gateway_is_seen_by_the_other(gateways: tuple[Gateway, Gateway]) -> None:
    a, b = gateways
    load = LongRequests(a, 6)  # a busy replica stays draining (an idle one is removed at once)
    until(lambda: in_flight(a) >= 6, 20.0, "long requests running")
    url = max(a.replicas().values(), key=lambda v: int(v["in_flight"]))["url"]
    r = a.admin("POST", "/replicas/drain", json={"url": url, "deadline_s": 120})
    assert r.status_code == 200, r.text
    try:
        until(lambda: b.replicas()[url]["state"] == "draining", 1.0, "B sees the drain")
    finally:
        assert a.admin("POST", "/replicas/undrain", json={"url": url}).status_code == 200, "still draining"
    until(lambda: b.replicas()[url]["state"] == "active", 5.0, "B sees the undrain")
    assert load.results() == [200] * 6


def test_a_killed_gateway_releases_its_load_within_the_lease(
        fleet: SimFleet, redis_srv: RedisServer, gateways: tuple[Gateway, Gateway], tmp_path: Path) -> None:
    a, _ = gateways
    doomed = start_gateway(fleet.urls, tmp_path / "doomed.log", *shared_flags(redis_srv.url))
    try:
        load = LongRequests(doomed, 6)
        until(lambda: in_flight(a) >= 6, 20.0, "A sees the other gateway's requests in flight")
        doomed.proc.signal(signal.SIGKILL)
        until(lambda: in_flight(a) == 0, LEASE_TTL_S + 2 * SYNC_S + 1.0, "the dead gateway's load released")
        assert load.results(30.0) == [-1] * 6
    finally:
        doomed.proc.stop()


class Traffic:
    """Short chat requests through both gateways from ``threads`` threads until ``stop()``."""

    def __init__(self, gws: tuple[Gateway, Gateway], threads: int = 4) -> None:
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(gws, k), daemon=True) for k in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self, gws: tuple[Gateway, Gateway], k: int) -> None:
        rng, i = random.Random(k), 0
        while not self._stop.is_set():
            body = {"model": "tiny", "max_tokens": 4, "user": f"traffic-{k}-{i // 2}",
                    "messages": [{"role": "user", "content": prompt(rng, 1500)}]}
            try:
                status = httpx.post(gws[i % 2].url + "/v1/chat/completions", json=body, timeout=30.0).status_code
            except httpx.HTTPError:
                status = -1
            self.statuses.append(status)
            i += 1

    def wait_for(self, more: int, timeout_s: float = 60.0) -> None:
        target = len(self.statuses) + more
        until(lambda: len(self.statuses) >= target, timeout_s, f"{more} more requests")

    def stop(self) -> list[int]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60.0)
        return self.statuses


def test_redis_outage_fails_no_request_and_affinity_comes_back(
        gateways: tuple[Gateway, Gateway], redis_srv: RedisServer) -> None:
    a, b = gateways
    traffic = Traffic(gateways)
    try:
        traffic.wait_for(8)
        redis_srv.stop()
        traffic.wait_for(16)  # routed without Redis: local index, local replica state
        redis_srv.start()  # same port, empty: a restart
        traffic.wait_for(8)
    finally:
        statuses = traffic.stop()
    assert statuses and set(statuses) == {200}, f"failed requests: {[s for s in statuses if s != 200]}"
    tries = iter(range(1000))

    def affinity() -> bool:
        n = next(tries)
        t1, t2 = two_turns(a, b, f"after-restart-{n}", seed=100 + n)
        return t2[0] == t1[0] and t2[2] >= 0.9 * t2[1]

    until(affinity, 30.0, "turn 2 through B follows turn 1 through A again", poll_s=0.2)


def test_redis_memory_stays_bounded_over_a_long_replay(
        gateways: tuple[Gateway, Gateway], redis_srv: RedisServer, fleet: SimFleet) -> None:
    client = redis.Redis.from_url(redis_srv.url)
    samples: list[int] = []

    def session(i: int) -> None:
        rng = random.Random(1000 + i)
        messages = [{"role": "user", "content": prompt(rng, 8000)}]
        for turn in range(3):
            messages = chat(gateways[(i + turn) % 2], f"replay-{i}", messages, max_tokens=4)[3]
            messages.append({"role": "user", "content": prompt(rng, 300)})

    with ThreadPoolExecutor(4) as pool:
        for batch in range(6):  # 72 sessions of ~35 blocks: far more than 3 replicas hold
            list(pool.map(session, range(batch * 12, batch * 12 + 12), timeout=120))
            samples.append(int(client.info("memory")["used_memory"]))
    full = 0
    for url in fleet.urls:  # each replica's blocks stay within the capacity it reported
        d, h, nd, nh = (int(v or 0) for v in client.hmget(f"kvgate:m:{url}", "d", "h", "nd", "nh"))
        assert client.hlen(f"kvgate:t:{url}") == nd + nh <= d + h < 1000, (url, d, h, nd, nh)
        full += nd + nh == d + h
    assert full > 0, "the replay should overflow some replica's capacity"
    client.close()
    growth = samples[-1] - samples[len(samples) // 2]
    assert growth < 256 * 1024, f"used_memory kept growing: {samples}"
