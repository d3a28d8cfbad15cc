"""Write-behind index writes across real gateway processes (issue 15).

Two ``kvgate serve`` processes with ``index.redis_write_behind = true`` on one real
``redis-server``, in front of three simulated replicas (the fixtures of
``test_shared_redis``): a session's first turn through
gateway A is routed without waiting for Redis, and once A's queue has flushed, its
second turn through gateway B lands on the same replica and hits the cache. A third
gateway whose drain task waits 30 s, and whose answers do not wait for it
(``index.redis_visible_wait_s = 0``), shows that shutdown (SIGTERM) flushes the queue.
"""
from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import pytest
import redis

from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import Gateway, start_gateway
from tests.integration_redis import test_shared_redis as shared
from tests.integration_redis.test_shared_redis import chat, prompt, shared_flags, until
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.redis

BEHIND = ("--set", "index.redis_write_behind=true")
redis_srv, fleet = shared.redis_srv, shared.fleet  # the same module fixtures, instantiated for this module


@pytest.fixture(scope="module")
def gateways(fleet: SimFleet, redis_srv: RedisServer, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[Gateway, Gateway]]:
    logs = tmp_path_factory.mktemp("gateways")
    with contextlib.ExitStack() as stops:
        started: list[Gateway] = []
        for name in ("a", "b"):
            started.append(start_gateway(fleet.urls, logs / f"{name}.log", *shared_flags(redis_srv.url), *BEHIND))
            stops.callback(started[-1].proc.stop)
        yield started[0], started[1]


def session_key(session: str) -> str:
    return f"kvgate:s:user:{session}@tiny"  # the ``user`` field, per model, is the session key (gateway.context)


def test_the_other_gateway_sees_the_session_after_the_flush(
        gateways: tuple[Gateway, Gateway], redis_srv: RedisServer) -> None:
    a, b = gateways
    client = redis.Redis.from_url(redis_srv.url)
    for i in range(3):
        session = f"behind-{i}"
        rng = random.Random(i)
        t1 = chat(a, session, [{"role": "user", "content": prompt(rng, 6000)}])
        key = session_key(session)

        def flushed(k: str = key) -> bool:
            return bool(client.exists(k))

        until(flushed, 10.0, "A's session write reaches Redis")
        t2 = chat(b, session, [*t1[3], {"role": "user", "content": prompt(rng, 300)}])
        assert t2[0] == t1[0], f"session {i}: turn 1 on {t1[0]}, turn 2 on {t2[0]}"
        assert t2[2] >= 0.9 * t2[1], f"session {i}: cached {t2[2]} of {t2[1]} prompt tokens"
    client.close()


def test_shutdown_flushes_the_queue(gateways: tuple[Gateway, Gateway], fleet: SimFleet, redis_srv: RedisServer,
                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    _, b = gateways
    slow = start_gateway(fleet.urls, tmp_path_factory.mktemp("slow") / "c.log", *shared_flags(redis_srv.url),
                         *BEHIND, "--set", "index.redis_flush_interval_s=30",
                         "--set", "index.redis_visible_wait_s=0")  # answers without waiting for the flush
    client = redis.Redis.from_url(redis_srv.url)
    try:
        t1, t2 = None, None
        t1 = chat(slow, "closing", [{"role": "user", "content": prompt(random.Random(50), 6000)}])
        assert not client.exists(session_key("closing")), "the drain task should still be waiting"
    finally:
        assert slow.proc.stop() is not None  # SIGTERM: graceful shutdown closes the index
    assert client.exists(session_key("closing")), "shutdown did not flush the queued writes"
    t2 = chat(b, "closing", [*t1[3], {"role": "user", "content": prompt(random.Random(51), 300)}])
    assert t2[0] == t1[0] and t2[2] >= 0.9 * t2[1]
    client.close()
