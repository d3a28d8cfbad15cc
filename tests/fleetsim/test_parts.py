"""Unit tests of the fleetsim parts: prompts, oracle, closed-loop pacing, and
``loadtest.fleetsim.sync.finished``, which drives the index and hooks without a loop."""
from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import numpy as np
import pytest

from loadtest import traces
from loadtest.fleetsim.oracle import Oracle
from loadtest.fleetsim.prompts import SessionPrompt
from loadtest.fleetsim.run import SimConfig, run_policy
from loadtest.fleetsim.sessions import Pacing
from loadtest.fleetsim.sync import WouldWait, finished
from loadtest.simulator.profile import load_profile
from tests.fleetsim.support import write_claude_traces


def test_equal_hash_prefixes_give_equal_token_prefixes() -> None:
    a = SessionPrompt("ns", "s1", 64, 100, want_text=True)
    b = SessionPrompt("ns", "s2", 64, 100, want_text=True)
    a.advance(0, (1, 2, 3))
    b.advance(0, (1, 2, 9))
    ta, tb = a.prompt_ids(3 * 64 + 10, 0), b.prompt_ids(3 * 64 + 10, 0)
    assert len(ta) == len(tb) == 202
    assert np.array_equal(ta[:128], tb[:128]) and not np.array_equal(ta[128:192], tb[128:192])
    assert not np.array_equal(ta[192:], tb[192:])  # tails are fresh per session
    assert a.hashes[:2] == b.hashes[:2] and a.hashes[2] != b.hashes[2]
    assert a.routing_text(202, 0)[:8] == b.routing_text(202, 0)[:8]
    other_ns = SessionPrompt("other", "s1", 64, 100, want_text=False)
    other_ns.advance(0, (1, 2, 3))
    assert other_ns.hashes[0] != a.hashes[0]


def test_incremental_turns_match_a_fresh_build() -> None:
    inc = SessionPrompt("ns", "s", 16, 4, want_text=True)
    inc.advance(0, (1, 2, 3))
    inc.advance(2, (7, 8, 9))  # keeps [1, 2], then 7, 8, 9
    fresh = SessionPrompt("ns", "s", 16, 4, want_text=True)
    fresh.advance(0, (1, 2, 7, 8, 9))
    assert inc.hashes == fresh.hashes
    assert np.array_equal(inc.tokens, fresh.tokens)
    assert inc.text == fresh.text
    assert len(inc.block_hashes()) == 4  # capped like the gateway's max_blocks
    assert len(inc.prompt_ids(40, 1)) == 40  # a partial last block is cut


def test_oracle_longest_seen_prefix() -> None:
    o = Oracle()
    assert o.match_blocks([1, 2, 3]) == 0
    o.record([1, 2, 3])
    assert o.match_blocks([1, 2, 3, 4]) == 3
    assert o.match_blocks([1, 5]) == 1
    assert o.cached_tokens([1, 2, 3, 4], 64, 100) == 100


def test_closed_loop_waits_think_time_after_each_response(tmp_path: Path) -> None:
    folder = write_claude_traces(tmp_path / "t", sessions=1, turns=5, seed=3)
    workload = traces.load([folder])
    session = workload.sessions[0]
    cfg = SimConfig(profile=load_profile("tiny"), replicas=2, gpus_per_replica=1,
                    pacing=Pacing(sessions_concurrent=1, think_scale=0.5))
    result = run_policy(workload, "cache-aware", cfg)
    main = [r for r in result.records if not r.agent]
    assert [r.turn for r in main] == list(range(5))
    subs = [r for r in result.records if r.agent]
    assert len(subs) == 2
    for prev, cur in itertools.pairwise(main):
        assert prev.finish_s is not None
        ready = prev.finish_s + 0.5 * session.turns[cur.turn].think_time_s
        if prev.turn == 1:  # turn 1 started the subagent: turn 2 waits for it too
            last_sub = max(r.finish_s or 0.0 for r in subs)
            ready = max(ready, last_sub)
        assert cur.arrival_s == pytest.approx(ready)
    parent_end = main[1].finish_s
    assert parent_end is not None
    delay = session.turns[1].subagents[0].start_delay_s
    assert subs[0].arrival_s == pytest.approx(parent_end + 0.5 * delay)


async def _doubled(x: int) -> int:
    return x * 2


def test_finished_returns_the_value_of_a_coroutine_that_does_not_wait() -> None:
    assert finished(_doubled(21)) == 42


def test_finished_refuses_a_coroutine_that_waits_and_closes_it() -> None:
    async def main() -> None:
        closed: list[bool] = []

        async def waits() -> int:
            try:
                await asyncio.sleep(1)
            finally:
                closed.append(True)
            return 1

        with pytest.raises(WouldWait):
            finished(waits())
        assert closed == [True]

    asyncio.run(main())
