"""Redis backend specifics: one round trip per match, TTLs and bounds, degrade and recover."""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
from redis.asyncio import Redis

from prefix_index.base import PrefixMatch, ReplicaCapacity, ReplicaId, SessionEntry
from prefix_index.config import IndexConfig
from prefix_index.factory import make_index
from prefix_index.local_index import FleetSizedIndex
from prefix_index.redis_backend import RedisPrefixIndex
from prefix_index.segments import SegmentPrefixIndex
from tests.support.procs import free_port
from tests.support.redis_server import RedisServer, redis_process

A, B = ReplicaId("http://127.0.0.1:1"), ReplicaId("http://127.0.0.1:2")


class CountingRedis(Redis):
    """Counts the commands this client sends (a script call is one EVALSHA)."""

    commands: list[str]

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        self.commands.append(str(args[0]))
        return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]


def cfg(url: str, **kw: Any) -> IndexConfig:
    # these tests read Redis's own layout and count round trips: every write awaited
    # (write-behind, the default, is tested in tests/gateway/test_index_write_behind.py)
    base: dict[str, Any] = {"backend": "redis", "redis_url": url, "redis_timeout_s": 2.0,
                            "redis_write_behind": False}
    return IndexConfig(**{**base, **kw})


async def until(cond: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own (it gets stopped and restarted)."""
    with redis_process() as server:
        yield server


@pytest.fixture
async def clean(redis_url: str) -> AsyncIterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


def test_factory_picks_backend(redis_url: str) -> None:
    assert isinstance(make_index(IndexConfig()), FleetSizedIndex)
    assert isinstance(make_index(IndexConfig(redis_url=redis_url)), RedisPrefixIndex)
    with pytest.raises(ValueError):
        make_index(IndexConfig(backend="redis"))


async def test_match_is_one_round_trip(redis_url: str, clean: redis.Redis) -> None:
    client = CountingRedis.from_url(redis_url)
    assert isinstance(client, CountingRedis)
    client.commands = []
    index = RedisPrefixIndex(cfg(redis_url), client=client)
    chain = list(range(1, 1501))
    for i in range(8):
        await index.record(ReplicaId(f"http://r{i}"), chain[: 100 * (i + 1)])
    await index.match(chain, [A])  # loads the script once
    client.commands.clear()
    got = await index.match(chain, [ReplicaId(f"http://r{i}") for i in range(8)] + [A])
    assert client.commands == ["EVALSHA"]
    assert got[ReplicaId("http://r7")] == PrefixMatch(800, 0) and got[A] == PrefixMatch()
    client.commands.clear()
    await index.record(A, chain)
    assert client.commands == ["EVALSHA"]
    await index.close()


async def test_keys_have_ttls_and_replicas_stay_bounded(redis_url: str, clean: redis.Redis) -> None:
    index = RedisPrefixIndex(cfg(redis_url, block_ttl_s=30, session_ttl_s=20, key_prefix="fleet1"))
    await index.set_capacity(A, ReplicaCapacity(device_blocks=50, host_blocks=50))
    for start in range(0, 5000, 500):
        await index.record(A, list(range(start + 1, start + 501)))
    await index.set_session("s", SessionEntry(A, 10, 1.0))
    assert clean.hlen(b"fleet1:t:" + A.encode()) == 100
    keys = clean.keys("*")
    assert keys and all(str(k).startswith("b'fleet1:") for k in keys)
    persistent = [k for k in keys if clean.pttl(k) < 0 and k != b"fleet1:clock" and k != b"fleet1:alive"]
    assert persistent == []
    assert 0 < clean.pttl(b"fleet1:g:" + A.encode()) <= 30_000
    assert 0 < clean.pttl(b"fleet1:s:s") <= 20_000
    await index.close()


async def test_block_set_expires_when_untouched(redis_url: str, clean: redis.Redis) -> None:
    index = RedisPrefixIndex(cfg(redis_url, block_ttl_s=0.2))
    await index.record(A, [1, 2, 3])

    async def gone() -> bool:
        return (await index.match([1, 2, 3], [A]))[A] == PrefixMatch()

    await until(gone, timeout_s=5.0)
    await index.close()


async def test_key_prefixes_isolate_fleets(redis_url: str, clean: redis.Redis) -> None:
    one, two = RedisPrefixIndex(cfg(redis_url, key_prefix="a")), RedisPrefixIndex(cfg(redis_url, key_prefix="b"))
    await one.record(A, [1, 2])
    assert (await two.match([1, 2], [A]))[A] == PrefixMatch()
    assert (await one.match([1, 2], [A]))[A] == PrefixMatch(2, 0)
    await one.close()
    await two.close()


async def test_write_behind_batches_and_flush(redis_url: str, clean: redis.Redis) -> None:
    index = RedisPrefixIndex(cfg(redis_url, redis_write_behind=True, redis_flush_interval_s=0.01))
    for i in range(50):
        await index.record(A, [i * 10 + 1, i * 10 + 2])
    await index.flush()
    assert (await index.match([491, 492], [A]))[A] == PrefixMatch(2, 0)
    assert (await index.local.match([491, 492], [A]))[A] == PrefixMatch(2, 0)
    await index.close()


async def test_degrades_logs_once_and_recovers_after_restart(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    index = RedisPrefixIndex(cfg(own_redis.url, redis_timeout_s=0.5, redis_retry_s=0.05))
    await index.record(A, [1, 2, 3])
    await index.set_session("s", SessionEntry(A, 30, 1.0))
    own_redis.stop()
    caplog.set_level(logging.WARNING, logger="kvgate.index.redis")
    for _ in range(5):  # answered locally, never raises
        assert (await index.match([1, 2, 3], [A]))[A] == PrefixMatch(3, 0)
        await index.record(B, [1, 2])
    assert index.degraded and index.degraded_total >= 10
    assert (await index.get_session("s")) == SessionEntry(A, 30, 1.0)
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    own_redis.start()  # same port, empty: a restart

    async def back() -> bool:
        return not index.degraded

    await until(back)
    got = await index.match([1, 2, 3], [A, B])  # Redis is empty; the local copy fills the gap
    assert got == {A: PrefixMatch(3, 0), B: PrefixMatch(2, 0)}
    assert (await index.get_session("s")) == SessionEntry(A, 30, 1.0)
    await index.record(A, [7, 8])
    assert (await index.match([7, 8], [A]))[A] == PrefixMatch(2, 0)
    assert redis.Redis.from_url(own_redis.url).exists(b"kvgate:t:" + A.encode())
    await index.close()


async def test_a_silent_redis_counts_as_degraded() -> None:
    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 20)
        await asyncio.sleep(30)

    port = free_port()
    server = await asyncio.start_server(never_answer, "127.0.0.1", port)
    index = RedisPrefixIndex(cfg(f"redis://127.0.0.1:{port}/0", redis_timeout_s=0.05, redis_retry_s=60))
    await index.record(A, [1, 2])
    assert (await index.match([1, 2], [A]))[A] == PrefixMatch(2, 0)
    assert index.degraded and index.degraded_total >= 1
    await index.close()
    server.close()


async def test_write_behind_outage_keeps_answering_locally(own_redis: RedisServer) -> None:
    index = RedisPrefixIndex(cfg(own_redis.url, redis_timeout_s=0.5, redis_retry_s=0.05, redis_write_behind=True))
    await index.set_capacity(A, ReplicaCapacity(device_blocks=2, host_blocks=2))
    await index.flush()
    own_redis.stop()
    await index.record(A, [1, 2, 3])
    await index.set_session("s", SessionEntry(A, 5, 100.0))
    await index.flush()  # fails quietly: the local copy has the writes
    assert index.degraded
    assert (await index.match([1, 2, 3], [A]))[A] == PrefixMatch(2, 1)
    assert await index.resident_tokens(100.0, 10.0) == {A: 5}
    assert (await index.stats()).device_blocks == {A: 2}
    own_redis.start()

    async def back() -> bool:
        return not index.degraded

    await until(back)
    await index.record(B, [9])
    await index.flush()
    assert (await index.match([9], [B]))[B] == PrefixMatch(1, 0)
    await index.close()


async def test_segment_layout_follows_the_embedded_backend_on_conversations(
        redis_url: str, clean: redis.Redis) -> None:
    """Interleaved growing conversations (a shared prompt, turns extending their chain, a few
    truncations) in small two-tier replicas: the Redis answers equal the embedded ones, and a
    replica keeps a few segments, not one entry per block."""
    rng = random.Random(5)
    caps = ReplicaCapacity(device_blocks=60, host_blocks=40)
    redis_index = RedisPrefixIndex(cfg(redis_url))
    memory = SegmentPrefixIndex(default_capacity=caps)
    replicas = [A, B]
    for rid in replicas:
        await redis_index.set_capacity(rid, caps)
        await memory.set_capacity(rid, caps)
    shared = [rng.getrandbits(64) for _ in range(8)]
    chains = [shared + [rng.getrandbits(64) for _ in range(10)] for _ in range(6)]
    for step in range(150):
        s = rng.randrange(len(chains))
        chains[s].extend(rng.getrandbits(64) for _ in range(rng.randrange(1, 6)))
        rid = replicas[s % 2]
        if rng.random() < 0.1:
            keep = rng.randrange(len(chains[s]))
            await redis_index.truncate(rid, chains[s], keep)
            await memory.truncate(rid, chains[s], keep)
        else:
            await redis_index.record(rid, chains[s])
            await memory.record(rid, chains[s])
        for chain in chains:
            assert await redis_index.match(chain, replicas) == await memory.match(chain, replicas), step
    assert await redis_index.stats() == await memory.stats()
    assert all(clean.hlen(f"kvgate:g:{rid}") <= 3 * len(chains) for rid in replicas)
    assert not redis_index.degraded
    await redis_index.close()


async def test_capacity_is_resent_when_redis_forgot_it(redis_url: str, clean: redis.Redis) -> None:
    index = RedisPrefixIndex(cfg(redis_url))
    await index.set_capacity(A, ReplicaCapacity(device_blocks=5, host_blocks=1))
    clean.flushdb()  # Redis lost its data (a restart nobody saw, or the keys expired)
    await index.record(A, list(range(1, 10)))
    assert (await index.match(list(range(1, 10)), [A]))[A] == PrefixMatch(device_blocks=5, host_blocks=1)
    await index.close()
