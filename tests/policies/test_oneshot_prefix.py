"""One-shot requests (no session key) sharing a prefix: the copy elsewhere is priced at
``oneshot_queue_externality`` (docs/benchmarks.md, section 1.11)."""

from __future__ import annotations

import random

import pytest

from policies.cache_aware import RequestParams
from policies.registry import make_policy
from policies.ttft_cost import CacheAwareParams
from prefix_index.base import PrefixMatch
from tests.policies.support import BLOCK_TOKENS, ctx, inputs, rid, view

PREFIX = 20_000  # an app's system prompt and tools, held by replica 0


def _decide(queue_tokens: int, params: dict[str, float] | None = None) -> tuple[str, str]:
    policy = make_policy("cache-aware", params, seed=1)
    views = [view(0, pending_prefill_tokens=queue_tokens), view(1), view(2)]
    held = {rid(0): PrefixMatch(device_blocks=PREFIX // BLOCK_TOKENS)}
    d = policy.decide(ctx(PREFIX + 300, prefix="app"), inputs(views, matches=held), random.Random(0))
    return d.replica, d.reason


@pytest.mark.parametrize("queue_tokens", [0, 20_000, 40_000])
def test_a_short_queue_keeps_the_shared_prefix_where_it_lives(queue_tokens: int) -> None:
    assert _decide(queue_tokens) == (rid(0), "prefix")


def test_the_session_externality_copies_the_prefix_for_the_same_queue() -> None:
    """What changed: at the session rate (0.5) a 40k-token queue (1 s) already beats the
    20k-token recompute (0.5 s + 0.25 s) and the prefix is copied."""
    replica, reason = _decide(40_000, {"oneshot_queue_externality": 0.5})
    assert replica != rid(0) and reason == "balance"


def test_a_long_queue_still_copies_the_prefix() -> None:
    replica, reason = _decide(200_000)  # 5 s of queue against 0.5 s x (1 + 3) of recompute
    assert replica != rid(0) and reason == "balance"


def test_session_turns_keep_the_session_externality() -> None:
    p = RequestParams(CacheAwareParams(queue_externality=0.5, oneshot_queue_externality=3.0))
    assert p.of(ctx(1_000, session="s")).queue_externality == 0.5
    assert p.of(ctx(1_000)).queue_externality == 3.0
