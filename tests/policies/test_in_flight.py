"""`policies.routing.InFlightChains`: what a replica is about to store, which its KV events
cannot state yet, covers exact matches of requests without a session entry."""

from __future__ import annotations

import random

from policies.registry import make_policy
from policies.routing import ExactMatch, InFlightChains, RoutingCore, is_exact
from prefix_index.base import PrefixMatch, SessionEntry, common_chain_prefix
from tests.policies.support import BLOCK_TOKENS, ctx, rid, view


def test_common_chain_prefix() -> None:
    a = ctx(6_400, prefix="x").block_hashes  # 100 blocks
    assert common_chain_prefix(a, a) == 100 and common_chain_prefix(a, a[:37]) == 37
    assert common_chain_prefix(a, ()) == 0 and common_chain_prefix(a, a, b_len=12) == 12
    b = (*a[:60], *ctx(6_400, prefix="y").block_hashes[60:])
    assert common_chain_prefix(a, b) == 60 and common_chain_prefix(b, a) == 60


def test_an_exact_match_is_raised_to_what_a_request_in_flight_there_shares() -> None:
    chains = InFlightChains(window_s=10.0)
    sibling = ctx(12_800, prefix="sub")
    chains.add(100.0, rid(0), sibling.block_hashes)
    c = ctx(12_800, prefix="sub", request_id="r2")
    exact = {rid(0): ExactMatch(640, 0), rid(1): ExactMatch(0, 0), rid(2): PrefixMatch(0, 0)}
    out = chains.overlay(101.0, c, exact)
    assert out[rid(0)] == PrefixMatch(12_800, 0) and not is_exact(out[rid(0)])  # partly predicted
    assert out[rid(1)] is exact[rid(1)] and out[rid(2)] is exact[rid(2)]
    assert chains.overlay(111.5, c, exact) == exact  # past the window: the events must state it


def test_approximate_matches_are_never_raised() -> None:
    chains = InFlightChains()
    chains.add(0.0, rid(0), ctx(6_400).block_hashes)
    approx = {rid(0): PrefixMatch(3, 0)}
    assert chains.overlay(1.0, ctx(6_400), approx) == approx


def test_the_core_covers_a_sibling_routed_a_moment_ago_but_not_a_sessions_turn() -> None:
    core = RoutingCore(make_policy("cache-aware", seed=1), random.Random(1))
    views = [view(0), view(1)]
    nothing = {rid(0): ExactMatch(0, 0), rid(1): ExactMatch(0, 0)}
    first = ctx(12_800, session="a1", parent="p", prefix="task")
    d = core.decide(first, core.inputs(first, views, nothing, None, None, 50.0))
    core.account(first, d)
    sibling = ctx(12_800, session="a2", parent="p", prefix="task", request_id="r2")
    inputs = core.inputs(sibling, views, nothing, None, None, 50.1)
    assert inputs.matches[d.replica].blocks == 12_800 // BLOCK_TOKENS * BLOCK_TOKENS
    turn = ctx(12_800, session="a1", prefix="task", request_id="r3")
    home = SessionEntry(d.replica, 13_000, 50.0)
    assert core.inputs(turn, views, nothing, home, None, 50.2).matches == nothing


def test_without_kv_events_nothing_is_remembered_and_the_memory_is_bounded() -> None:
    core = RoutingCore(make_policy("cache-aware", seed=1), random.Random(1))
    views = [view(0), view(1)]
    approx = {rid(0): PrefixMatch(0, 0), rid(1): PrefixMatch(0, 0)}
    for i in range(20):  # an approximate-only fleet: no chain kept past its request
        c = ctx(6_400, prefix=f"p{i}", request_id=f"r{i}")
        core.account(c, core.decide(c, core.inputs(c, views, approx, None, None, float(i))))
    assert len(core.in_flight) == 0
    chains = InFlightChains(window_s=1e9, max_chains=8)
    for i in range(20):
        chains.add(float(i), rid(0), ctx(640, prefix=f"q{i}").block_hashes)
    assert len(chains) == 8
