"""A response's last byte waits for the gateway's index writes to reach Redis (issue 45).

A real ``redis-server``; the gateway app over httpx's ASGI transport with fake replicas
(``tests.gateway.test_index_write_behind``'s fixtures). ``GatedRedis`` holds every
write-behind pipeline at a gate, so the order "the write reached Redis, then the client
had the answer" is checked, not raced. ``index.redis_visible_wait_s`` bounds the wait:
past it the answer goes out and the late write is counted.
"""
from __future__ import annotations

import asyncio

import pytest
import redis

from prefix_index.base import ReplicaId
from prefix_index.redis_backend import RedisPrefixIndex
from tests.gateway.test_app_unit import A, B, fake_fleet, ok_completion
from tests.gateway.test_index_write_behind import (
    cfg,
    chat,
    clean,
    gated,
    gateway_on,
    redis_url,
    until,
)
from tests.support.fake_replicas import sse

pytestmark = pytest.mark.redis
__all__ = ["clean", "redis_url"]  # fixtures, imported for this module

SESSION = b"kvgate:s:user:s1@m"
STREAM = [b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n',
          b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1}}\n\n', b"data: [DONE]\n\n"]


@pytest.mark.parametrize("stream", [False, True])
async def test_the_answer_waits_until_its_routing_record_is_in_redis(
        redis_url: str, clean: redis.Redis, stream: bool) -> None:
    index, client = gated(redis_url, redis_visible_wait_s=30.0)
    handler = sse(STREAM) if stream else ok_completion
    fleet = fake_fleet({A: handler, B: handler})
    async with gateway_on(index, fleet) as (http, gw):
        await until(lambda: all(v.routable for v in gw.registry.views()))
        answer = asyncio.ensure_future(http.post("/v1/chat/completions", content=chat("s1")))
        await until(lambda: bool(client.waiting) and len(fleet.seen) == 1)  # sent upstream, write held
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert not answer.done() and clean.get(SESSION) is None  # the client has nothing yet
        client.gate.set()
        response = await asyncio.wait_for(answer, 10.0)
        assert response.status_code == 200 and clean.get(SESSION) is not None
        if stream:
            assert response.content == b"".join(STREAM)
        assert index.late_writes_total == 0


async def test_past_the_bound_the_answer_goes_out_and_is_counted(redis_url: str, clean: redis.Redis) -> None:
    index, client = gated(redis_url, redis_visible_wait_s=0.05)
    fleet = fake_fleet({A: ok_completion, B: ok_completion})
    async with gateway_on(index, fleet) as (http, gw):
        await until(lambda: all(v.routable for v in gw.registry.views()))
        response = await http.post("/v1/chat/completions", content=chat("s1"))
        assert response.status_code == 200 and clean.get(SESSION) is None  # answered, write still held
        assert index.late_writes_total == 1 and index.degraded_total >= 1
        client.gate.set()


async def test_without_write_behind_nothing_waits(redis_url: str, clean: redis.Redis) -> None:
    index = RedisPrefixIndex(cfg(redis_url, redis_write_behind=False))
    await index.record(ReplicaId("http://127.0.0.1:1"), [1, 2, 3])  # awaited: in Redis already
    assert await index.published() and index.late_writes_total == 0
    await index.close()
