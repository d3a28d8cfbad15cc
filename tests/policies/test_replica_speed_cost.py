"""The cost model prices each replica at its own speed (`ReplicaView.prefill_tokens_per_s`,
`decode_step_s`), and at the policy's constants where a view has none."""

from __future__ import annotations

import dataclasses
import random

import pytest

from policies.registry import make_policy
from policies.ttft_cost import CacheAwareParams, candidate_costs, estimate
from tests.policies.support import Fleet, ctx, inputs, view


def test_a_replica_twice_as_fast_has_half_the_prefill_and_queue() -> None:
    p = CacheAwareParams()
    slow = view(0, pending_prefill_tokens=8_000, decoding=3)
    fast = dataclasses.replace(slow, prefill_tokens_per_s=2 * p.prefill_tokens_per_s)
    snap = inputs([slow])
    a, b = estimate(ctx(20_000), snap, slow, None, p), estimate(ctx(20_000), snap, fast, None, p)
    assert b.prefill_s == pytest.approx(a.prefill_s / 2) and b.queue_s == pytest.approx(a.queue_s / 2)
    same = dataclasses.replace(slow, prefill_tokens_per_s=p.prefill_tokens_per_s, decode_step_s=p.decode_step_s)
    assert estimate(ctx(20_000), snap, same, None, p) == a  # its own figures equal to the constants: no change


def test_a_slower_decode_step_scales_the_interference() -> None:
    p = CacheAwareParams()
    v = view(0, decoding=5)
    slow = dataclasses.replace(v, decode_step_s=2 * p.decode_step_s)
    snap = inputs([v])
    base = estimate(ctx(20_000), snap, v, None, p).interference_s
    assert base == pytest.approx(5 * p.decode_weight_s + 3 * p.decode_step_s)  # 3 chunks of 8192
    assert estimate(ctx(20_000), snap, slow, None, p).interference_s == pytest.approx(2 * base)


@pytest.mark.parametrize("seed", range(8))
def test_new_sessions_go_to_the_faster_replica_when_both_are_busy(seed: int) -> None:
    """Equal queues: a tie (either replica, by seed) unless one replica drains it faster."""
    policy = make_policy("cache-aware", seed=seed)
    fleet = Fleet.of(2)
    ids = list(fleet.views)
    for r in ids:
        fleet.views[r] = dataclasses.replace(fleet.views[r], pending_prefill_tokens=40_000)
    fleet.views[ids[1]] = dataclasses.replace(fleet.views[ids[1]], prefill_tokens_per_s=60_000.0)
    d = fleet.route(policy, ctx(30_000, session="s", prefix="p"), random.Random(seed))
    assert d.replica == ids[1]


def test_drafts_accepted_less_are_priced_slower_by_the_decode_term() -> None:
    """Two replicas alike but for their decode step (the time for 5 tokens of one stream,
    its accept length folded in): the slower one pays the reply's extra decode time, the
    fastest nothing; at equal figures or at the constants there is no term."""
    p = CacheAwareParams()
    good = view(0, decode_step_s=0.015, spec_accept_length=5.0)
    poor = dataclasses.replace(view(1), decode_step_s=0.015 * 5.0 / 3.5, spec_accept_length=3.5)
    snap = inputs([good, poor])
    costs = candidate_costs(ctx(20_000, max_tokens=None), snap, [good, poor], None, p, breakdown=True)
    assert costs.breakdown is not None
    a, b = costs.breakdown
    assert a.decode_s == 0.0
    assert b.decode_s == pytest.approx(p.expected_output_tokens / 5.0 * (0.015 * 5.0 / 3.5 - 0.015))
    assert costs.total_s[1] > costs.total_s[0]
    short = candidate_costs(ctx(20_000, max_tokens=30), snap, [good, poor], None, p, breakdown=True).breakdown
    assert short is not None and short[1].decode_s == pytest.approx(b.decode_s / 10)  # at most max_tokens
    plain = [view(0), view(1)]
    assert all(e.decode_s == 0.0 for e in candidate_costs(ctx(20_000), inputs(plain), plain, None, p,
                                                          breakdown=True).breakdown or ())
    off = dataclasses.replace(p, decode_time_weight=0.0)
    assert candidate_costs(ctx(20_000, max_tokens=None), snap, [good, poor], None, off).total_s[1] == pytest.approx(
        costs.total_s[1] - b.decode_s)


@pytest.mark.parametrize("seed", range(8))
def test_a_new_session_goes_to_the_replica_whose_drafts_are_accepted_more(seed: int) -> None:
    policy = make_policy("cache-aware", seed=seed)
    fleet = Fleet.of(2)
    ids = list(fleet.views)
    fleet.views[ids[0]] = dataclasses.replace(fleet.views[ids[0]], decode_step_s=0.015 * 5.0 / 3.5,
                                              spec_accept_length=3.5)
    fleet.views[ids[1]] = dataclasses.replace(fleet.views[ids[1]], decode_step_s=0.015, spec_accept_length=5.0)
    d = fleet.route(policy, ctx(30_000, session="s", prefix="p"), random.Random(seed))
    assert d.replica == ids[1]
