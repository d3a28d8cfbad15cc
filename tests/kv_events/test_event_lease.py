"""Several gateways on one real redis-server: each replica's KV events are consumed by
one of them (the lease holder), relayed to the others, and taken over when it dies."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq.asyncio

from gateway.kv_wiring import PreciseMode
from prefix_index.config import IndexConfig
from prefix_index.event_lease import EventLease
from replicas.kv_events import BlockStored
from tests.kv_events.test_wiring import PAGE, A, Publisher, until
from tests.kv_events.tokmodel import write_model
from tests.support.redis_server import redis_server

TTL_S = 0.6


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_server() as url:
        yield url


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


def gateway(redis_url: str, name: str, info: dict[str, Any]) -> PreciseMode:
    async def fetch(url: str) -> dict[str, Any]:
        return info

    lease = EventLease.from_url(redis_url, name, key_prefix=f"lease-test-{id(info)}", ttl_s=TTL_S)
    return PreciseMode(IndexConfig(), fetch, lease=lease)


def subscribed(mode: PreciseMode) -> int:
    return sum(len(r.subscribers) for r in mode._replicas.values())


async def test_one_consumer_relays_to_the_others_and_is_taken_over(
        redis_url: str, zctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    pub = Publisher(zctx, write_model(tmp_path / "model"))
    info = pub.info()
    gateways = [gateway(redis_url, f"gw{i}", info) for i in range(3)]
    try:
        for gw in gateways:
            assert await gw.discover(A)
        await until(lambda: sum(subscribed(g) for g in gateways) == 1)
        async with asyncio.timeout(10):  # until the holder's late-joining SUB gets a batch
            while gateways[0].index.blocks(A) == (0, 0) or gateways[2].index.blocks(A) == (0, 0) \
                    or gateways[1].index.blocks(A) == (0, 0):
                await pub.send([BlockStored((1000,), None, (), PAGE)], seq=0)
                await asyncio.sleep(0.02)
        await pub.send([BlockStored((1001, 1002), 1000, (), PAGE)])
        await until(lambda: all(g.index.blocks(A) == (3, 0) for g in gateways))
        holder = next(g for g in gateways if subscribed(g))
        applied = [g.stream_counts()["applied"] for g in gateways]
        assert sorted(applied)[:2] == [0, 0] and max(applied) >= 2  # the events came through ONE socket
        # the holder dies without releasing: its lease lapses, another gateway takes over
        lease = holder.lease
        holder.lease = None  # (close() would release the lease; a crash does not)
        await holder.close()
        assert lease is not None
        await lease.close()
        rest = [g for g in gateways if g is not holder]
        await until(lambda: sum(subscribed(g) for g in rest) == 1, timeout_s=10)
        new_holder = next(g for g in rest if subscribed(g))
        sub = next(s for r in new_holder._replicas.values() for s in r.subscribers)
        assert sub.tracker.expected == 2  # continues after the last relayed batch: a loss is a gap
        async with asyncio.timeout(10):
            while any(g.index.blocks(A) != (4, 0) for g in rest):
                await pub.send([BlockStored((1003,), 1002, (), PAGE)], seq=2)
                await asyncio.sleep(0.02)
        assert all(A not in g.index.uncertain for g in rest)
    finally:
        for gw in gateways:
            await gw.close()
