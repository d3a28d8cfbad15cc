"""Index writes off the path to the first byte (issue 15): the Redis backend's write-behind.

A real ``redis-server``; the gateway app over httpx's ASGI transport with fake replicas on
loopback HTTP (``tests.support.fake_replicas``). ``GatedRedis`` holds every pipeline (the
write-behind batches) until its gate opens, so "the upstream request was sent before the
index write finished" is a fact the test can check, not a race. No timing is asserted.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
import redis
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from gateway.app import Gateway, create_app, make_client
from policies.registry import make_policy
from prefix_index.base import PrefixMatch, ReplicaId, SessionEntry
from prefix_index.config import IndexConfig
from prefix_index.redis_backend import RedisPrefixIndex
from prefix_index.write_behind import PendingWrites, QueuedWrite, WriteQueue
from replicas.probe import AiohttpGetter
from replicas.registry import Registry
from tests.gateway.test_app_unit import A, B, fake_fleet, ok_completion, running, settings_for
from tests.support.fake_replicas import FakeFleet
from tests.support.redis_server import redis_server

pytestmark = pytest.mark.redis

X, Y = ReplicaId("http://127.0.0.1:1"), ReplicaId("http://127.0.0.1:2")
PROMPT = " ".join(f"word{i}" for i in range(1200))  # ~10,000 characters: ~39 blocks


class GatedPipeline(Pipeline):
    gate: asyncio.Event
    waiting: list[int]

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        self.waiting.append(1)
        try:
            await asyncio.wait_for(self.gate.wait(), timeout=30.0)
        finally:
            self.waiting.pop()
        return await super().execute(raise_on_error)


class GatedRedis(Redis):
    """A client whose pipelines wait for ``gate``; single commands and scripts pass."""

    gate: asyncio.Event
    waiting: list[int]

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Pipeline:
        pipe = GatedPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.gate, pipe.waiting = self.gate, self.waiting
        return pipe


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_server() as url:
        yield url


@pytest.fixture
def clean(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


def cfg(url: str, **kw: Any) -> IndexConfig:
    base: dict[str, Any] = {"backend": "redis", "redis_url": url, "redis_timeout_s": 30.0,
                            "redis_write_behind": True, "redis_session_sync_s": 0.0}
    return IndexConfig(**{**base, **kw})


def gated(url: str, **kw: Any) -> tuple[RedisPrefixIndex, GatedRedis]:
    client = GatedRedis.from_url(url)
    assert isinstance(client, GatedRedis)
    client.gate, client.waiting = asyncio.Event(), []
    return RedisPrefixIndex(cfg(url, **kw), client=client), client


@asynccontextmanager
async def gateway_on(index: RedisPrefixIndex, fleet: FakeFleet) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    """The app, serving a ``Gateway`` built on ``index`` (cache-aware, replicas A and B)."""
    settings = settings_for(fleet.urls(A, B), policy={"name": "cache-aware", "seed": 1})
    app = create_app(settings)
    async with running(fleet, app):
        client = make_client(settings)
        registry = Registry(settings.registry, client, clock=time.time, probes=AiohttpGetter())
        policy = make_policy("cache-aware", {}, 1)
        gw = Gateway(settings, client, index, registry, policy)
        await gw.start()
        app.state.gateway = gw  # the lifespan's own gateway stays idle
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
                yield http, gw
        finally:
            await gw.close()


def chat(user: str) -> bytes:
    return orjson.dumps({"model": "m", "user": user, "max_tokens": 4,
                         "messages": [{"role": "user", "content": PROMPT}]})


async def until(cond: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_upstream_is_sent_while_the_index_write_is_held_and_later_decisions_see_it(
        redis_url: str, clean: redis.Redis) -> None:
    index, client = gated(redis_url)
    fleet = fake_fleet({A: ok_completion, B: ok_completion})
    async with gateway_on(index, fleet) as (http, gw):
        await until(lambda: all(v.routable for v in gw.registry.views()))
        first = await http.post("/v1/chat/completions", content=chat("s1"))
        assert first.status_code == 200
        home = first.headers["x-kvgate-replica"]
        assert [fleet.url(seen.replica) for seen in fleet.seen] == [home]  # sent and answered ...
        await until(lambda: bool(client.waiting))  # ... while its write waits at the gate
        assert clean.get(b"kvgate:s:user:s1@m") is None and not client.gate.is_set()

        again = await http.post("/v1/chat/completions", content=chat("s1"))  # the session's next request
        assert (again.headers["x-kvgate-replica"], again.headers["x-kvgate-route-reason"]) == (home, "affinity")
        other = await http.post("/v1/chat/completions", content=chat("s2"))  # a new session, same prompt
        assert other.headers["x-kvgate-route-reason"] in ("prefix", "spread")  # it saw s1's placement
        assert clean.get(b"kvgate:s:user:s1@m") is None

        client.gate.set()
        await index.flush()
        assert clean.get(b"kvgate:s:user:s1@m") is not None
        fresh = RedisPrefixIndex(cfg(redis_url, redis_write_behind=False))  # what another gateway reads
        assert (await fresh.get_session("user:s1@m")) is not None
        assert (await fresh.get_session("user:s1@m")).replica == home  # type: ignore[union-attr]
        await fresh.close()


async def test_pending_writes_are_read_back_at_once(redis_url: str, clean: redis.Redis) -> None:
    index, client = gated(redis_url)
    other = RedisPrefixIndex(cfg(redis_url, redis_write_behind=False))
    chain = list(range(1, 41))
    await index.record(X, chain)
    await index.set_session("s", SessionEntry(X, 100, 5.0))
    assert (await index.match(chain, [X, Y])) == {X: PrefixMatch(40, 0), Y: PrefixMatch()}
    assert (await index.match(chain[:10] + [999], [X]))[X] == PrefixMatch(10, 0)
    assert await index.get_session("s") == SessionEntry(X, 100, 5.0)
    assert (await other.match(chain, [X]))[X] == PrefixMatch() and await other.get_session("s") is None
    await index.truncate(X, chain, keep_blocks=5)  # feedback on a chain still queued
    assert (await index.match(chain, [X]))[X] == PrefixMatch(5, 0)
    client.gate.set()
    await index.flush()
    assert (await other.match(chain, [X]))[X] == PrefixMatch(5, 0)
    assert await other.get_session("s") == SessionEntry(X, 100, 5.0)
    assert len(index._pending) == 0
    await index.close()
    await other.close()


async def test_the_queue_is_bounded_and_counts_drops(redis_url: str, clean: redis.Redis) -> None:
    index = RedisPrefixIndex(cfg(redis_url, redis_queue_max=3, redis_flush_interval_s=60.0))
    for i in range(5):  # the drain task sleeps a minute: nothing leaves the queue
        async with asyncio.timeout(5.0):  # a write never blocks
            await index.set_session(f"s{i}", SessionEntry(X, i, float(i)))
    assert index.queued_writes == 3
    assert index.dropped_writes_total == 2 and index.degraded_total == 2
    assert await index.get_session("s0") is None  # dropped, and Redis never had it
    await index.flush()
    assert [clean.exists(f"kvgate:s:s{i}") for i in range(5)] == [0, 0, 1, 1, 1]
    await index.close()


async def test_close_flushes_the_queue(redis_url: str, clean: redis.Redis) -> None:
    index = RedisPrefixIndex(cfg(redis_url, redis_flush_interval_s=60.0))
    await index.record(X, [7, 8, 9])
    await index.set_session("s", SessionEntry(X, 3, 1.0))
    assert clean.get(b"kvgate:s:s") is None and index.queued_writes == 2
    await index.close()
    other = RedisPrefixIndex(cfg(redis_url, redis_write_behind=False))
    assert (await other.match([7, 8, 9], [X]))[X] == PrefixMatch(3, 0)
    assert await other.get_session("s") == SessionEntry(X, 3, 1.0)
    await other.close()


async def test_write_queue_order_failures_and_callbacks() -> None:
    sent: list[list[str]] = []
    fail = {"b"}

    async def send(batch: Any) -> list[object] | None:
        names = [w.name for w in batch]
        sent.append(names)
        if "x" in names:
            return None  # the batch was not delivered
        return [ValueError(n) if n in fail else n.upper() for n in names]

    done: list[tuple[str, object | None]] = []

    def record(name: str) -> Callable[[object | None], None]:
        return lambda result: done.append((name, result))

    queue = WriteQueue(send, max_items=10, delay_s=60.0, batch=2)
    for name in ("a", "b", "c", "x", "d"):
        queue.put(QueuedWrite(name, (), record(name)))
    await queue.flush()
    assert sent == [["a", "b"], ["c", "x"], ["d"]]
    assert done == [("a", "A"), ("b", None), ("c", None), ("x", None), ("d", "D")]
    assert (queue.sent_total, queue.failed_total, queue.dropped_total) == (2, 3, 0)
    await queue.close(1.0)


def test_pending_writes_settle_only_their_own_entry() -> None:
    pending = PendingWrites()
    first = pending.add_session("k", SessionEntry(X, 1, 1.0))
    pending.add_session("k", SessionEntry(Y, 2, 2.0))
    pending.session_done("k", first)  # the older write landed; the newer one is still queued
    assert pending.session("k") == SessionEntry(Y, 2, 2.0)
    seq = pending.add_chain(X, [1, 2, 3])
    pending.add_chain(Y, [1, 2])
    assert pending.longest([1, 2, 3, 4], [X, Y]) == {X: 3, Y: 2}
    pending.forget_replica(Y)
    assert pending.session("k") is None and pending.longest([1, 2], [Y]) == {}
    pending.chain_done(X, seq)
    assert len(pending) == 0
