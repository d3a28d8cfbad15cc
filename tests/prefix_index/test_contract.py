"""The PrefixIndex contract, run against every backend (memory, Redis, Redis write-behind).

Hash lists here are shaped like real chains (a chain that diverges from another never
rejoins it; a block never appears twice), which is what ``gateway.prefix_hash`` produces
and what the Redis backend's default boundary search relies on.
"""
from __future__ import annotations

import asyncio
import random
import time

from prefix_index.base import PrefixIndex, PrefixMatch, ReplicaCapacity, ReplicaId, SessionEntry
from tests.prefix_index.conftest import MakeIndex

A, B, C = ReplicaId("http://127.0.0.1:1"), ReplicaId("http://127.0.0.1:2"), ReplicaId("http://127.0.0.1:3")
CHAIN = [1001 + i for i in range(10)]
BIG = 2**64 - 1  # hashes are unsigned 64-bit


def chain(start: int, n: int) -> list[int]:
    return [start + i for i in range(n)]


async def test_empty_index_matches_nothing(index: PrefixIndex) -> None:
    assert await index.match(CHAIN, [A, B]) == {A: PrefixMatch(), B: PrefixMatch()}
    assert await index.match([], [A]) == {A: PrefixMatch()}
    assert await index.match(CHAIN, []) == {}


async def test_longest_contiguous_prefix(index: PrefixIndex) -> None:
    await index.record(A, CHAIN)
    assert (await index.match(CHAIN, [A]))[A] == PrefixMatch(device_blocks=10)
    assert (await index.match(CHAIN[:4] + [7, 8, 9], [A]))[A].blocks == 4  # diverges at block 4
    assert (await index.match(CHAIN + [BIG, 5], [A]))[A].blocks == 10
    assert (await index.match(CHAIN[:1], [A]))[A].blocks == 1
    assert (await index.match([5, 6, 7], [A]))[A].blocks == 0


async def test_unknown_replicas_are_listed_empty(index: PrefixIndex) -> None:
    await index.record(A, CHAIN)
    got = await index.match(CHAIN, [B, A, C])
    assert got == {A: PrefixMatch(device_blocks=10), B: PrefixMatch(), C: PrefixMatch()}


async def test_several_replicas(index: PrefixIndex) -> None:
    await index.record(A, CHAIN)
    await index.record(B, CHAIN[:3])
    await index.record(C, [BIG, BIG - 1])
    got = await index.match(CHAIN, [A, B, C])
    assert got == {A: PrefixMatch(10, 0), B: PrefixMatch(3, 0), C: PrefixMatch()}
    assert (await index.match([BIG], [A, C]))[C] == PrefixMatch(1, 0)


async def test_device_overflow_demotes_to_host_and_host_overflow_drops(index: PrefixIndex) -> None:
    await index.set_capacity(A, ReplicaCapacity(device_blocks=3, host_blocks=2))
    five = chain(10, 5)
    await index.record(A, five)
    assert (await index.match(five, [A]))[A] == PrefixMatch(device_blocks=3, host_blocks=2)
    await index.record(A, chain(50, 2))  # 2 newer blocks: five[0] stays on device, five[1:3] host
    assert (await index.match(five, [A]))[A] == PrefixMatch(device_blocks=1, host_blocks=2)
    stats = await index.stats()
    assert (stats.device_blocks[A], stats.host_blocks[A]) == (3, 2)


async def test_chain_longer_than_capacity_keeps_its_prefix(index: PrefixIndex) -> None:
    await index.set_capacity(A, ReplicaCapacity(device_blocks=4, host_blocks=0))
    await index.record(A, chain(10, 9))
    assert (await index.match(chain(10, 9), [A]))[A] == PrefixMatch(device_blocks=4)


async def test_rerecord_touches_lru(index: PrefixIndex) -> None:
    await index.set_capacity(A, ReplicaCapacity(device_blocks=4, host_blocks=0))
    await index.record(A, [1, 2])
    await index.record(A, [3, 4])
    await index.record(A, [1, 2])  # touch: [3, 4] is now the least recent
    await index.record(A, [5, 6])
    got = await index.match([1, 2], [A]), await index.match([3, 4], [A]), await index.match([5, 6], [A])
    assert [g[A].blocks for g in got] == [2, 0, 2]


async def test_match_does_not_touch_lru(index: PrefixIndex) -> None:
    await index.set_capacity(A, ReplicaCapacity(device_blocks=4, host_blocks=0))
    await index.record(A, [1, 2])
    await index.record(A, [3, 4])
    await index.match([1, 2], [A])
    await index.record(A, [5, 6])
    assert (await index.match([1, 2], [A]))[A].blocks == 0


async def test_truncate_forgets_beyond_keep(index: PrefixIndex) -> None:
    await index.record(A, CHAIN)
    await index.record(B, CHAIN)
    await index.truncate(A, CHAIN, keep_blocks=3)
    got = await index.match(CHAIN, [A, B])
    assert got[A] == PrefixMatch(3, 0) and got[B] == PrefixMatch(10, 0)
    await index.truncate(A, CHAIN, keep_blocks=0)
    assert (await index.match(CHAIN, [A]))[A] == PrefixMatch()
    await index.truncate(C, CHAIN, keep_blocks=0)  # unknown replica: no error


async def test_truncate_refills_device_from_host(index: PrefixIndex) -> None:
    await index.set_capacity(A, ReplicaCapacity(device_blocks=2, host_blocks=4))
    await index.record(A, chain(10, 4))  # device: 10, 11  host: 12, 13
    await index.record(A, [99, 98])  # device: 99, 98  host: 10..13
    await index.truncate(A, [99, 98], keep_blocks=0)  # device has room: 10, 11 count as device again
    assert (await index.match(chain(10, 4), [A]))[A] == PrefixMatch(device_blocks=2, host_blocks=2)


async def test_set_capacity_shrink_evicts(index: PrefixIndex) -> None:
    await index.record(A, CHAIN)
    await index.set_capacity(A, ReplicaCapacity(device_blocks=3, host_blocks=2))
    assert (await index.match(CHAIN, [A]))[A] == PrefixMatch(device_blocks=3, host_blocks=2)
    await index.set_capacity(A, ReplicaCapacity(device_blocks=1, host_blocks=0))
    assert (await index.match(CHAIN, [A]))[A] == PrefixMatch(device_blocks=1)
    await index.set_capacity(A, ReplicaCapacity(device_blocks=0, host_blocks=0))
    assert (await index.match(CHAIN, [A]))[A] == PrefixMatch()


async def test_remove_replica_forgets_blocks_and_sessions(index: PrefixIndex) -> None:
    await index.record(A, CHAIN)
    await index.record(B, CHAIN)
    await index.set_session("s1", SessionEntry(A, 100, 1.0))
    await index.set_session("s2", SessionEntry(B, 200, 1.0))
    await index.remove_replica(A)
    got = await index.match(CHAIN, [A, B])
    assert got == {A: PrefixMatch(), B: PrefixMatch(10, 0)}
    assert await index.get_session("s1") is None
    assert await index.get_session("s2") == SessionEntry(B, 200, 1.0)
    stats = await index.stats()
    assert A not in stats.device_blocks and stats.device_blocks[B] == 10 and stats.sessions == 1
    await index.remove_replica(C)  # unknown: no error


async def test_sessions_set_get_overwrite(index: PrefixIndex) -> None:
    assert await index.get_session("nope") is None
    entry = SessionEntry(A, 12345, 1700000000.25)
    await index.set_session("k:1", entry)
    assert await index.get_session("k:1") == entry
    await index.set_session("k:1", SessionEntry(B, 7, 1700000001.5))
    assert await index.get_session("k:1") == SessionEntry(B, 7, 1700000001.5)


async def test_sessions_expire(make_index: MakeIndex) -> None:
    index = await make_index(session_ttl_s=0.2)
    await index.set_session("short", SessionEntry(A, 1, 0.0))
    deadline = time.monotonic() + 5.0
    while await index.get_session("short") is not None:
        assert time.monotonic() < deadline, "session did not expire within 5 s"
        await asyncio.sleep(0.05)


async def test_resident_tokens_windows(index: PrefixIndex) -> None:
    now = 10_000.0
    await index.set_session("a1", SessionEntry(A, 100, now - 10))
    await index.set_session("a2", SessionEntry(A, 50, now - 100))
    await index.set_session("b1", SessionEntry(B, 70, now - 1))
    assert await index.resident_tokens(now, 30) == {A: 100, B: 70}
    assert await index.resident_tokens(now, 1000) == {A: 150, B: 70}
    assert await index.resident_tokens(now, 0.5) == {}
    await index.set_session("a2", SessionEntry(B, 50, now))  # the session moved
    assert await index.resident_tokens(now, 1000) == {A: 100, B: 120}


async def test_stats(index: PrefixIndex) -> None:
    assert await index.stats() == await index.stats()
    await index.set_capacity(A, ReplicaCapacity(device_blocks=4, host_blocks=4))
    await index.set_capacity(B, ReplicaCapacity(device_blocks=100, host_blocks=0))
    await index.record(A, chain(1, 6))
    await index.set_session("s", SessionEntry(A, 1, 1.0))
    stats = await index.stats()
    assert stats.device_blocks == {A: 4, B: 0}
    assert stats.host_blocks == {A: 2, B: 0}
    assert stats.sessions == 1


async def test_record_unknown_replica_uses_default_capacity(make_index: MakeIndex) -> None:
    index = await make_index(default_device_blocks=5, default_host_blocks=1)
    await index.record(A, chain(1, 9))
    assert (await index.match(chain(1, 9), [A]))[A] == PrefixMatch(device_blocks=5, host_blocks=1)


async def test_long_chain(index: PrefixIndex) -> None:
    long = chain(1 << 40, 3000)
    await index.record(A, long)
    await index.record(B, long[:1500])
    got = await index.match(long, [A, B, C])
    assert got == {A: PrefixMatch(3000, 0), B: PrefixMatch(1500, 0), C: PrefixMatch()}


async def test_random_session_ids_never_grow_the_table_past_its_bound(make_index: MakeIndex) -> None:
    bound = 40
    index = await make_index(max_sessions=bound)
    rng = random.Random(10)
    keys = [f"rand-{rng.getrandbits(64):016x}" for _ in range(300)]
    for i, key in enumerate(keys):
        await index.set_session(key, SessionEntry(A, 10, 1000.0 + i))  # last use grows with i
        if i % 25 == 0:
            assert (await index.stats()).sessions <= bound
    stats = await index.stats()
    assert stats.sessions == bound and stats.session_evictions == len(keys) - bound
    assert all([await index.get_session(k) is not None for k in keys[-bound:]])
    assert all([await index.get_session(k) is None for k in keys[:-bound]])
    assert sum((await index.resident_tokens(2000.0, 10_000.0)).values()) == 10 * bound


async def test_the_session_bound_evicts_the_least_recently_used(make_index: MakeIndex) -> None:
    index = await make_index(max_sessions=3)
    for i, key in enumerate(["a", "b", "c"]):
        await index.set_session(key, SessionEntry(A, 1, 10.0 + i))
    await index.set_session("a", SessionEntry(B, 2, 20.0))  # a used again: b is now the oldest
    await index.set_session("d", SessionEntry(A, 1, 21.0))
    assert await index.get_session("b") is None
    assert [await index.get_session(k) for k in ("a", "c", "d")] == [
        SessionEntry(B, 2, 20.0), SessionEntry(A, 1, 12.0), SessionEntry(A, 1, 21.0)]
    assert (await index.stats()).session_evictions == 1
