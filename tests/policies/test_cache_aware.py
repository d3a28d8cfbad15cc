"""Behaviour of the `cache-aware` policy on hand-built inputs (pure, no index)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from policies.base import NoRoutableReplica
from policies.registry import make_policy
from policies.ttft_cost import CacheAwareParams, estimate
from prefix_index.base import PrefixMatch, ReplicaId, SessionEntry
from replicas.model import ReplicaState
from tests.policies.support import BLOCK_TOKENS, Fleet, ctx, inputs, rid, view

NOW = 10_000.0


def held(tokens: int) -> PrefixMatch:
    return PrefixMatch(device_blocks=tokens // BLOCK_TOKENS)


def test_ten_turn_session_stays_on_its_replica() -> None:
    policy = make_policy("cache-aware", seed=1)
    rng = random.Random(1)
    fleet = Fleet.of(4)
    home: ReplicaId | None = None
    reasons = []
    for turn in range(10):
        prompt = 8_000 + turn * 6_000
        c = ctx(prompt, session="s1", request_id=f"t{turn}")
        matches = {home: held(prompt - 2_000)} if home is not None else None
        if home is not None and turn == 5:  # a modest queue at home does not move it
            fleet.views[home] = dataclasses.replace(fleet.views[home], pending_prefill_tokens=8_000)
        d = fleet.route(policy, c, rng, matches)
        home = home or d.replica
        assert d.replica == home
        reasons.append(d.reason)
    assert reasons[0] == "new-session" and set(reasons[1:]) == {"affinity"}


def test_new_sessions_without_prefix_spread_evenly() -> None:
    policy = make_policy("cache-aware", seed=2)
    fleet = Fleet.of(4)
    rng = random.Random(2)
    decisions = [
        fleet.route(policy, ctx(4_000, session=f"s{i}", prefix=f"p{i}"), rng) for i in range(16)
    ]
    assert sorted(fleet.counts(decisions).values()) == [4, 4, 4, 4]
    assert {d.reason for d in decisions} == {"new-session"}


def test_shared_system_prompt_does_not_pile_onto_one_replica() -> None:
    policy = make_policy("cache-aware", seed=3)
    fleet = Fleet.of(4)
    rng = random.Random(3)
    shared = {r: held(12_000) for r in fleet.views}  # every replica holds the system prompt
    decisions = [
        fleet.route(policy, ctx(14_000, session=f"s{i}", prefix="sys"), rng, shared)
        for i in range(24)
    ]
    counts = fleet.counts(decisions)
    assert max(counts.values()) - min(counts.values()) <= 2, counts


@pytest.mark.parametrize(
    ("prompt", "queue_tokens", "moves"),
    [
        (100_000, 40_000, False),  # 1 s queue < 2.5 s recompute: stay
        # 6 s queue < recompute x 1.5 (externality) + abandoned 99k (2.5 s) + 2 s margin
        (100_000, 240_000, False),
        (100_000, 360_000, True),  # 9 s queue > ~8.2 s: move
        (4_000, 2_000, False),  # small queue: stay
        (4_000, 120_000, True),  # a 3 s queue costs more than moving 4k tokens (~2.2 s)
    ],
)
def test_session_moves_only_when_queue_exceeds_recompute(
    prompt: int, queue_tokens: int, moves: bool
) -> None:
    policy = make_policy("cache-aware", seed=4)
    views = [view(0, pending_prefill_tokens=queue_tokens), view(1), view(2)]
    c = ctx(prompt, session="s")
    snap = inputs(
        views,
        matches={rid(0): held(prompt - 1_000)},
        session=SessionEntry(rid(0), prompt - 1_000, NOW - 5),
    )
    d = policy.decide(c, snap, random.Random(4))
    assert (d.replica != rid(0)) is moves
    assert d.reason == ("moved" if moves else "affinity")
    if not moves:
        assert d.predicted_cached_tokens == (prompt - 1_000) // BLOCK_TOKENS * BLOCK_TOKENS


def test_move_margin_prevents_flapping_between_equal_replicas() -> None:
    """Both replicas hold the prefix (e.g. after a move); the session stays where it is."""
    policy = make_policy("cache-aware", seed=5)
    both = {rid(0): held(20_000), rid(1): held(20_000)}
    for home in (rid(0), rid(1)):
        snap = inputs([view(0), view(1)], matches=both, session=SessionEntry(home, 20_000, NOW))
        for seed in range(20):
            assert (
                policy.decide(ctx(21_000, session="s"), snap, random.Random(seed)).replica == home
            )


def test_draining_and_removal_candidates_get_no_new_sessions() -> None:
    policy = make_policy("cache-aware", seed=6)
    fleet = Fleet.of(4)
    fleet.views[rid(0)] = dataclasses.replace(fleet.views[rid(0)], state=ReplicaState.DRAINING)
    fleet.views[rid(1)] = dataclasses.replace(fleet.views[rid(1)], removal_candidate=True)
    rng = random.Random(6)
    decisions = [
        fleet.route(policy, ctx(3_000, session=f"s{i}", prefix=f"p{i}"), rng) for i in range(20)
    ]
    assert {d.replica for d in decisions} == {rid(2), rid(3)}


def test_sessions_move_off_a_removal_candidate() -> None:
    policy = make_policy("cache-aware", seed=7)
    views = [view(0, removal_candidate=True), view(1)]
    snap = inputs(views, matches={rid(0): held(50_000)}, session=SessionEntry(rid(0), 50_000, NOW))
    assert policy.decide(ctx(51_000, session="s"), snap, random.Random(7)).replica == rid(1)
    alone = inputs([view(0, removal_candidate=True)], session=SessionEntry(rid(0), 50_000, NOW))
    assert policy.decide(ctx(51_000, session="s"), alone, random.Random(7)).replica == rid(0)


def test_no_routable_replica_raises() -> None:
    policy = make_policy("cache-aware")
    snap = inputs([view(0, state=ReplicaState.DRAINING), view(1, state=ReplicaState.UNHEALTHY)])
    with pytest.raises(NoRoutableReplica):
        policy.decide(ctx(1_000), snap, random.Random(0))


def test_subagent_first_turn_goes_to_parents_replica() -> None:
    policy = make_policy("cache-aware", seed=8)
    parent = SessionEntry(rid(2), 60_000, NOW - 1)
    snap = inputs([view(0), view(1), view(2), view(3)], parent=parent)
    for seed in range(20):
        d = policy.decide(ctx(20_000, session="sub", parent="main"), snap, random.Random(seed))
        assert (d.replica, d.reason) == (rid(2), "parent")
        assert d.predicted_cached_tokens > 0


def test_scale_out_takes_new_sessions_first() -> None:
    policy = make_policy("cache-aware", seed=9)
    fleet = Fleet.of(3, pending_prefill_tokens=20_000)  # the busy fleet that asked for scale-out
    fleet.views[rid(2)] = dataclasses.replace(
        fleet.views[rid(2)], added_at_s=NOW - 30, pending_prefill_tokens=0
    )
    fleet.resident = {rid(0): 200_000, rid(1): 250_000}
    rng = random.Random(9)
    first = [
        fleet.route(policy, ctx(2_000, session=f"s{i}", prefix=f"p{i}"), rng) for i in range(8)
    ]
    assert {d.replica for d in first} == {rid(2)}


def test_new_sessions_tie_break_to_new_replica_then_low_resident_fraction() -> None:
    policy = make_policy("cache-aware")
    idle = [view(0), view(1), view(2, added_at_s=NOW - 30)]
    resident = {rid(0): 400_000, rid(1): 0}
    for seed in range(20):
        assert policy.decide(
            ctx(2_000), inputs(idle, resident=resident), random.Random(seed)
        ).replica == rid(2)
    old = idle[:2]
    for seed in range(20):
        assert policy.decide(
            ctx(2_000), inputs(old, resident=resident), random.Random(seed)
        ).replica == rid(1)


def test_new_session_avoids_overflowing_a_full_replica() -> None:
    policy = make_policy("cache-aware", seed=10)
    views = [view(0, device_tokens=100_000), view(1, device_tokens=100_000)]
    snap = inputs(views, resident={rid(0): 95_000, rid(1): 10_000})
    for seed in range(10):
        assert policy.decide(ctx(30_000, session="new"), snap, random.Random(seed)).replica == rid(
            1
        )


def test_estimate_components() -> None:
    p = CacheAwareParams()
    v = view(
        0,
        pending_prefill_tokens=4_000,
        reported_waiting_uncached_tokens=8_000,
        decoding=3,
        reported_running=5,
    )
    snap = inputs([v], matches={rid(0): PrefixMatch(device_blocks=10, host_blocks=5)})
    e = estimate(ctx(2_000), snap, v, None, p)
    assert e.cached_tokens == 15 * BLOCK_TOKENS
    assert e.uncached_tokens == 2_000 - 15 * BLOCK_TOKENS
    assert e.prefill_s == pytest.approx(e.uncached_tokens / 40_000 + 5 * BLOCK_TOKENS / 1_000_000)
    assert e.queue_s == pytest.approx(8_000 / 40_000)  # max of own and reported, not the sum
    # per running request, plus one decode step between prefill chunks (one chunk here)
    assert e.interference_s == pytest.approx(0.002 * 5 + 0.015)
    assert e.affinity_s == 0.0 and e.eviction_s == 0.0 and e.placement_s == 0.0
    full = dataclasses.replace(v, max_running_requests=4, in_flight=5)
    assert estimate(ctx(2_000), snap, full, None, p).interference_s == pytest.approx(
        0.01 + 0.015 + 2 * 0.5
    )


def test_same_seed_same_decisions() -> None:
    def run(seed: int) -> list[str]:
        policy = make_policy("cache-aware", seed=seed)
        fleet = Fleet.of(5)
        rng = policy.new_rng()
        return [
            fleet.route(policy, ctx(3_000, session=f"s{i}", prefix=f"p{i}"), rng).replica
            for i in range(30)
        ]

    assert run(11) == run(11)


def test_overfull_home_charges_only_the_sessions_growth() -> None:
    """A session's previous turn is already resident at home: only its growth can evict."""
    p = CacheAwareParams()
    views = [view(0), view(1)]
    session = SessionEntry(rid(0), 90_000, NOW - 5)
    snap = inputs(
        views,
        matches={rid(0): held(90_000)},
        session=session,
        resident={rid(0): 600_000, rid(1): 600_000},  # both over their 500k capacity
    )
    c = ctx(100_000, session="s", max_tokens=0)
    home = estimate(c, snap, views[0], rid(0), p)
    away = estimate(c, snap, views[1], rid(0), p)
    assert home.eviction_s == pytest.approx(10_000 / p.prefill_tokens_per_s)
    assert away.eviction_s == pytest.approx(100_000 / p.prefill_tokens_per_s)


@pytest.mark.parametrize(("prompt", "moves"), [(8_000, True), (120_000, False)])
def test_abandoned_kv_makes_long_sessions_stickier(prompt: int, moves: bool) -> None:
    """The same 5 s queue at home moves a short session but not a long one."""
    policy = make_policy("cache-aware", seed=2)
    views = [view(0, pending_prefill_tokens=200_000), view(1), view(2)]
    snap = inputs(
        views,
        matches={rid(0): held(prompt - 1_000)},
        session=SessionEntry(rid(0), prompt - 1_000, NOW - 5),
    )
    d = policy.decide(ctx(prompt, session="s"), snap, random.Random(2))
    assert (d.replica != rid(0)) is moves


def test_long_first_turn_goes_where_fewer_sessions_live() -> None:
    """A 240k-token first turn blocks its replica for ~6 s: put it on the least crowded one."""
    policy = make_policy("cache-aware", seed=3)
    views = [view(i) for i in range(3)]
    resident = {rid(0): 450_000, rid(1): 100_000, rid(2): 300_000}
    snap = inputs(views, resident=resident)
    d = policy.decide(ctx(240_000, session="new", max_tokens=0), snap, random.Random(3))
    assert d.replica == rid(1)
    p = CacheAwareParams()
    crowded = estimate(ctx(240_000, max_tokens=0), snap, views[0], None, p)
    quiet = estimate(ctx(240_000, max_tokens=0), snap, views[1], None, p)
    assert crowded.externality_s > quiet.externality_s


@pytest.mark.parametrize("n", [3, 64])
def test_a_decision_evaluates_the_model_once(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """One decision evaluates the cost model once per candidate (N, not 2N+1), in one
    `candidate_costs` pass whatever the fleet size: the explainer takes the scorer's
    estimates back."""
    from policies import cache_aware, ttft_cost

    views = [view(i, in_flight=i) for i in range(n)]
    snap = inputs(views)
    calls: list[list[ReplicaId]] = []
    real = ttft_cost.candidate_costs

    def counting(*args: object, **kw: object) -> ttft_cost.Costs:
        calls.append([c.id for c in args[2]])  # type: ignore[attr-defined]
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(cache_aware, "candidate_costs", counting)
    make_policy("cache-aware", seed=0).decide(ctx(10_000, session="s"), snap, random.Random(0))
    assert calls == [[v.id for v in views]]


def test_estimate_is_the_decision_s_breakdown() -> None:
    """`estimate` (one replica, term by term) sums to the total a decision compares."""
    from policies.ttft_cost import candidate_costs

    views = [view(0, decoding=3, pending_prefill_tokens=20_000), view(1, reported_running=70)]
    c = ctx(50_000, session="s")
    snap = inputs(views, matches={rid(0): held(20_000)}, session=SessionEntry(rid(0), 30_000, NOW - 5),
                  resident={rid(0): 400_000, rid(1): 600_000})
    p = CacheAwareParams()
    costs = candidate_costs(c, snap, views, rid(0), p)
    for v, total in zip(views, costs.total_s, strict=True):
        assert estimate(c, snap, v, rid(0), p).total_s == total
