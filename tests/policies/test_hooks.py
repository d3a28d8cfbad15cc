"""Standard hooks against the embedded prefix index: record, session, feedback truncate."""

from __future__ import annotations

import random

from policies.base import Decision, Outcome
from policies.hooks import feedback_keep_blocks
from policies.registry import make_policy
from prefix_index.base import ReplicaCapacity, SessionEntry
from prefix_index.memory import MemoryPrefixIndex
from tests.policies.support import BLOCK_TOKENS, ctx, inputs, rid, view


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


async def _index() -> MemoryPrefixIndex:
    index = MemoryPrefixIndex(clock=Clock())
    for i in range(2):
        await index.set_capacity(rid(i), ReplicaCapacity(device_blocks=10_000))
    return index


async def test_on_routed_records_chain_and_session() -> None:
    index = await _index()
    policy = make_policy("cache-aware", seed=0)
    c = ctx(6_400, session="s1", max_tokens=100)
    d = policy.decide(c, inputs([view(0), view(1)]), random.Random(0))
    await policy.on_routed(c, d, index, 100.0)
    match = await index.match(c.block_hashes, [rid(0), rid(1)])
    assert match[d.replica].blocks == 100
    assert await index.get_session("s1") == SessionEntry(d.replica, 6_500, 100.0)
    timings = policy.timings()
    assert timings["hook/standard.on_routed"].calls == 1 and timings["scorer/ttft"].calls == 1


async def test_on_completed_truncates_on_a_large_miss_and_updates_session_size() -> None:
    index = await _index()
    policy = make_policy("cache-aware")
    c = ctx(6_400, session="s1")
    await index.record(rid(0), c.block_hashes)
    d = Decision(
        rid(0),
        "affinity",
        "cache-aware",
        predicted_cached_tokens=6_400,
        predicted_uncached_tokens=0,
    )
    await index.set_session("s1", SessionEntry(rid(0), 6_000, 99.0))
    await policy.on_completed(
        c,
        d,
        Outcome(True, 200, prompt_tokens=6_500, cached_tokens=640, completion_tokens=300),
        index,
        101.0,
    )
    assert (await index.match(c.block_hashes, [rid(0)]))[rid(0)].blocks == 10
    assert await index.get_session("s1") == SessionEntry(rid(0), 6_800, 101.0)


async def test_on_completed_keeps_a_session_that_moved_meanwhile() -> None:
    index = await _index()
    policy = make_policy("cache-aware")
    c = ctx(1_000, session="s1")
    await index.set_session("s1", SessionEntry(rid(1), 2_000, 100.0))
    d = Decision(rid(0), "affinity", "cache-aware")
    await policy.on_completed(
        c, d, Outcome(True, 200, prompt_tokens=1_000, completion_tokens=10), index, 101.0
    )
    assert (await index.get_session("s1")) == SessionEntry(rid(1), 2_000, 100.0)


def test_feedback_tolerance() -> None:
    c = ctx(64_000)

    def keep(predicted: int, cached: int | None) -> int | None:
        d = Decision(rid(0), "prefix", "p", predicted_cached_tokens=predicted)
        return feedback_keep_blocks(c, d, Outcome(True, 200, cached_tokens=cached))

    assert keep(10_000, None) is None
    assert keep(10_000, 9_000) is None  # within 50%
    assert keep(10_000, 4_000) == 4_000 // BLOCK_TOKENS
    assert keep(120, 0) is None  # within 2 blocks (128 tokens)
    assert keep(200, 0) == 0
    assert keep(200, None) is None
