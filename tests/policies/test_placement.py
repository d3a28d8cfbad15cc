"""New sessions are placed where they will live (`policies.placement`), not herded."""

from __future__ import annotations

import random

import pytest

from policies.base import RequestContext, RoutingInputs
from policies.placement import excess_resident_tokens, is_new_conversation
from policies.registry import make_policy
from policies.ttft_cost import CacheAwareParams, estimate
from prefix_index.base import PrefixMatch, ReplicaId, SessionEntry
from tests.policies.support import BLOCK_TOKENS, Fleet, ctx, inputs, rid, view

SYSTEM_TOKENS = 10_688  # an ~8,000-word system prompt (~1.34 tokens per word), whole blocks
# shared system prompts of 2k, 8k and 30k words as the burst test's vocabulary tokenizes them
# (tests/integration/test_burst.py), and the ~8,000-word one above
PROMPT_TOKENS = (3_712, SYSTEM_TOKENS, 14_848, 55_808)
NOW = 10_000.0


def burst(seed: int, sessions: int = 18, replicas: int = 3,
          system_tokens: int = SYSTEM_TOKENS) -> tuple[Fleet, dict[ReplicaId, int]]:
    """Concurrent new sessions sharing the system prompt; predict-on-route after each.

    Nothing completes in between (a burst): every decision sees the load and the
    resident working set of the ones before it, and the system prompt is recorded on
    every replica a session was sent to.
    """
    policy = make_policy("cache-aware", seed=seed)
    rng = policy.new_rng()
    fleet = Fleet.of(replicas, device_tokens=2_000_000, host_tokens=4_000_000)
    holders: set[ReplicaId] = set()
    for i in range(sessions):
        c = ctx(system_tokens + 320, session=f"s{i}", prefix="sys", request_id=f"s{i}")
        held = {r: PrefixMatch(device_blocks=system_tokens // BLOCK_TOKENS) for r in holders}
        d = fleet.route(policy, c, rng, held)
        holders.add(d.replica)
    counts = {r: 0 for r in fleet.views}
    for entry in fleet.sessions.values():
        counts[entry.replica] += 1
    return fleet, counts


def held_on_first(tokens: int, resident: list[int]) -> RoutingInputs:
    """Three large replicas, ``tokens`` of the prompt on the first, resident working sets."""
    views = [view(i, device_tokens=2_000_000) for i in range(3)]
    return inputs(
        views,
        matches={rid(0): PrefixMatch(device_blocks=tokens // BLOCK_TOKENS)},
        resident={rid(i): r for i, r in enumerate(resident)},
    )


@pytest.mark.parametrize("system_tokens", PROMPT_TOKENS)
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6, 7])
def test_burst_of_new_sessions_sharing_a_system_prompt_spreads(seed: int, system_tokens: int) -> None:
    """Whatever the shared prompt's length: no constant in the rule is a prompt length."""
    _, counts = burst(seed, system_tokens=system_tokens)
    assert max(counts.values()) <= 9, counts  # no replica holds more than half
    assert min(counts.values()) >= 4, counts


@pytest.mark.parametrize("system_tokens", PROMPT_TOKENS)
@pytest.mark.parametrize(("replicas", "sessions"), [(8, 18), (8, 48)])
def test_burst_spreads_over_a_larger_fleet(replicas: int, sessions: int, system_tokens: int) -> None:
    """On 8 replicas no replica takes more than two sessions beyond its share. (Not every
    replica gets one: the excess is measured against the mean, and while most replicas
    hold sessions an empty one lowers the mean little; policies/placement.py.)"""
    _, counts = burst(5, sessions=sessions, replicas=replicas, system_tokens=system_tokens)
    assert max(counts.values()) <= -(-sessions // replicas) + 2, counts


def test_ten_turn_session_still_sticks_after_a_burst() -> None:
    fleet, _ = burst(3)
    policy = make_policy("cache-aware", seed=3)
    rng = policy.new_rng()
    home: ReplicaId | None = None
    for turn in range(10):
        prompt = SYSTEM_TOKENS + 2_000 + turn * 6_000
        c = ctx(prompt, session="long", prefix="sys", request_id=f"t{turn}")
        held = {r: PrefixMatch(device_blocks=SYSTEM_TOKENS // BLOCK_TOKENS) for r in fleet.views}
        if home is not None:
            held[home] = PrefixMatch(device_blocks=(prompt - 2_000) // BLOCK_TOKENS)
        d = fleet.route(policy, c, rng, held)
        home = home or d.replica
        assert d.replica == home
        assert d.reason in ("affinity", "prefix", "spread") if turn == 0 else d.reason == "affinity"


def test_spread_reason_names_a_new_session_started_away_from_the_shared_prefix() -> None:
    policy = make_policy("cache-aware", seed=1)
    snap = held_on_first(SYSTEM_TOKENS, [8 * 11_000, 11_000, 11_000])
    d = policy.decide(ctx(SYSTEM_TOKENS + 320, session="new", prefix="sys"), snap, random.Random(1))
    assert d.replica != rid(0) and d.reason == "spread"


def test_a_prefix_much_larger_than_the_excess_still_wins() -> None:
    """A 120k-token shared document is worth more than a small imbalance of sessions."""
    policy = make_policy("cache-aware", seed=1)
    snap = held_on_first(120_000, [60_000, 0, 0])
    d = policy.decide(ctx(121_000, session="new", prefix="doc"), snap, random.Random(1))
    assert d.replica == rid(0) and d.reason == "prefix"


def test_placement_term_applies_to_new_sessions_only() -> None:
    p = CacheAwareParams()
    views = [view(0), view(1), view(2)]
    resident = {rid(0): 90_000, rid(1): 30_000, rid(2): 0}
    shared = {rid(1): PrefixMatch(device_blocks=40)}  # a system prompt some replica holds
    new = inputs(views, resident=resident, matches=shared)
    assert excess_resident_tokens(new, views[0]) == pytest.approx(50_000)
    assert excess_resident_tokens(new, views[2]) == 0.0
    # 50k tokens above the mean, and the 2,560-token shared prefix held on replica 1 left behind
    assert estimate(ctx(5_000, session="n"), new, views[0], None, p).placement_s == pytest.approx(
        (50_000 + 2_560) / 40_000)
    assert estimate(ctx(5_000, session="n"), new, views[1], None, p).placement_s == 0.0
    # a session with a replica, a request without a session key, a subagent's first turn
    known = inputs(views, resident=resident, session=SessionEntry(rid(0), 9_000, NOW), matches=shared)
    sub = inputs(views, resident=resident, parent=SessionEntry(rid(0), 9_000, NOW), matches=shared)
    assert not is_new_conversation(ctx(5_000, session="n"), known)
    # nothing of the prompt anywhere: every replica pays the whole prefill, the other terms place it
    assert placement_s(ctx(5_000, session="n"), inputs(views, resident=resident), 1.0) == 0.0
    assert placement_s(ctx(5_000), new, 1.0) == 0.0
    assert placement_s(ctx(5_000, session="a", parent="n"), sub, 1.0) == 0.0
    assert placement_s(ctx(5_000, session="n"), new, 0.0) == 0.0


def placement_s(c: RequestContext, snap: RoutingInputs, weight: float) -> float:
    """The placement term on the first replica, for a request with no session entry."""
    return estimate(c, snap, snap.replicas[0], None, CacheAwareParams(spread_weight=weight)).placement_s


def test_interleave_charges_prefill_chunks_on_a_decoding_replica() -> None:
    p = CacheAwareParams()
    idle, busy = view(0), view(1, decoding=1)
    snap = inputs([idle, busy])
    c = ctx(48_000, max_tokens=0)
    assert estimate(c, snap, idle, None, p).interference_s == 0.0
    # 48k uncached tokens = 6 chunks of 8192, each followed by a decode step
    assert estimate(c, snap, busy, None, p).interference_s == pytest.approx(0.002 + 6 * 0.015)


def test_long_one_shot_prompt_prefers_the_idle_replica_over_a_decoding_one() -> None:
    """Without a session, ties are judged on the cost beyond the prefill all pay."""
    policy = make_policy("cache-aware", seed=5)
    views = [view(0, decoding=2), view(1), view(2, decoding=1)]
    for seed in range(5):
        d = policy.decide(ctx(60_000, prefix=f"doc{seed}"), inputs(views), random.Random(seed))
        assert d.replica == rid(1)


def test_once_two_replicas_hold_the_prompt_the_third_takes_new_sessions() -> None:
    """A staggered burst: two replicas hold the prompt and five sessions each, the third
    none. The prompt is shared (two holders), so starting on the third pays its recompute
    but no abandon charge, and the holders' excess sends the session there."""
    policy = make_policy("cache-aware", seed=4)
    session = 14_848 + 320
    views = [view(i, device_tokens=2_000_000) for i in range(3)]
    held = PrefixMatch(device_blocks=14_848 // BLOCK_TOKENS)
    snap = inputs(views, matches={rid(0): held, rid(1): held},
                  resident={rid(0): 5 * session, rid(1): 5 * session})
    c = ctx(session, session="new", prefix="sys")
    assert estimate(c, snap, views[2], None, CacheAwareParams()).placement_s == 0.0
    d = policy.decide(c, snap, random.Random(4))
    assert d.replica == rid(2) and d.reason == "spread"


def test_a_session_back_after_its_entry_expired_keeps_its_kv_under_an_ordinary_imbalance() -> None:
    """No session entry, but 150k tokens of the prompt on one replica (its own KV, as far as
    the gateway can tell a shared prefix): leaving it is charged as a move (abandon), so a
    replica 200k tokens above the others keeps it..."""
    policy = make_policy("cache-aware", seed=2)
    c = ctx(152_000, session="back", prefix="own")
    snap = held_on_first(150_000, [700_000, 500_000, 500_000])
    costs = [estimate(c, snap, v, None, CacheAwareParams()) for v in snap.replicas]
    # elsewhere: the excess is 0, the 150k tokens left behind are charged once more
    held = 150_000 // BLOCK_TOKENS * BLOCK_TOKENS
    assert costs[1].placement_s == pytest.approx(held / 40_000)
    assert costs[0].placement_s == pytest.approx((700_000 - 1_700_000 / 3) / 40_000)
    d = policy.decide(c, snap, random.Random(2))
    assert d.replica == rid(0) and d.reason == "prefix"


def test_a_long_match_leaves_a_replica_far_above_the_fleet() -> None:
    """... and one holding over 2.5 x the match above the mean gives it up (the same rule
    at every length: a burst's short shared prompt leaves after a few sessions)."""
    policy = make_policy("cache-aware", seed=2)
    snap = held_on_first(150_000, [1_400_000, 300_000, 300_000])
    d = policy.decide(ctx(152_000, session="back", prefix="own"), snap, random.Random(2))
    assert d.replica != rid(0) and d.reason == "spread"
