"""`cache-aware` with exact matches (precise mode): a home whose events show it lost the
session's KV keeps no hold on the session; approximate matches decide as before."""

from __future__ import annotations

import random

from policies.registry import make_policy
from policies.routing import ExactMatch, is_exact, merge_matches, token_context
from policies.ttft_cost import CacheAwareParams, candidate_costs, request_terms
from prefix_index.base import PrefixMatch, ReplicaId, SessionEntry
from tests.policies.support import BLOCK_TOKENS, ctx, inputs, rid, view

PROMPT = 60_000


def _decide(home_match: PrefixMatch, home_queue: int, seed: int = 7) -> tuple[ReplicaId, str]:
    """A 60k-token turn of session s1 (home replica 0, queue ``home_queue`` tokens there),
    in token units as precise mode decides; replica 1 idle. (chosen replica, reason)."""
    c = token_context(ctx(PROMPT, session="s1"), PROMPT)
    views = [view(0, pending_prefill_tokens=home_queue), view(1)]
    snap = inputs(views, matches={rid(0): home_match, rid(1): ExactMatch(0, 0)},
                  session=SessionEntry(rid(0), PROMPT - 1_000, 9_990.0))
    d = make_policy("cache-aware", seed=seed).decide(c, snap, random.Random(seed))
    return d.replica, d.reason


def test_merge_marks_the_precise_matches_exact_and_they_compare_as_prefix_matches() -> None:
    merged = merge_matches({rid(0): PrefixMatch(3, 1), rid(1): PrefixMatch(2, 0)},
                           {rid(1): PrefixMatch(100, 28)}, approx_block_tokens=BLOCK_TOKENS)
    assert merged == {rid(0): PrefixMatch(192, 64), rid(1): PrefixMatch(100, 28)}
    assert not is_exact(merged[rid(0)]) and is_exact(merged[rid(1)])
    assert hash(merged[rid(1)]) == hash(ExactMatch(100, 28)) and merged[rid(1)].blocks == 128


def test_a_home_known_to_have_lost_the_session_gives_way_to_a_shorter_queue() -> None:
    # 1.5 s of queue at home: below the 2 s move margin, so a predicted home keeps the turn...
    assert _decide(PrefixMatch(0, 0), 60_000) == (rid(0), "affinity")
    # ...but when the home's KV events say it holds nothing, staying saves nothing
    assert _decide(ExactMatch(0, 0), 60_000) == (rid(1), "rehomed")


def test_a_home_that_still_holds_the_session_keeps_it() -> None:
    held = ExactMatch(PROMPT - 2_000, 0)
    assert _decide(held, 60_000) == (rid(0), "affinity")
    host = ExactMatch(0, PROMPT - 2_000)  # evicted to the host tier: a load, not lost
    assert _decide(host, 60_000) == (rid(0), "affinity")


def test_a_lost_home_is_one_candidate_among_equals() -> None:
    """No queue anywhere: the lost home has no claim left, the seeded tie-break decides."""
    outcomes = {_decide(ExactMatch(0, 0), 0, seed=s) for s in range(8)}
    assert outcomes == {(rid(0), "affinity"), (rid(1), "rehomed")}


def test_the_lost_home_is_charged_the_eviction_its_recompute_causes() -> None:
    p = CacheAwareParams()
    c = token_context(ctx(PROMPT, session="s1"), PROMPT)
    full = {rid(0): 520_000, rid(1): 520_000}  # both replicas' working sets at 500k capacity
    views = [view(0), view(1)]
    session = SessionEntry(rid(0), PROMPT - 1_000, 9_990.0)
    lost = inputs(views, matches={rid(0): ExactMatch(0, 0)}, session=session, resident=full)
    predicted = inputs(views, matches={rid(0): PrefixMatch(0, 0)}, session=session, resident=full)
    assert request_terms(c, lost, rid(0), p).home_lost
    assert not request_terms(c, predicted, rid(0), p).home_lost
    home_lost, other = candidate_costs(c, lost, views, rid(0), p, breakdown=True).breakdown or []
    home_predicted, _ = candidate_costs(c, predicted, views, rid(0), p, breakdown=True).breakdown or []
    assert home_predicted.eviction_s < home_lost.eviction_s == other.eviction_s
    assert other.affinity_s == 0.0  # nothing left to abandon, no margin


def test_approximate_matches_never_count_as_a_lost_home() -> None:
    c = ctx(PROMPT, session="s1")
    snap = inputs([view(0), view(1)], matches={rid(0): PrefixMatch(0, 0)},
                  session=SessionEntry(rid(0), PROMPT, 9_990.0))
    assert not request_terms(c, snap, rid(0), CacheAwareParams()).home_lost
