"""The learned per-replica speed (replicas/speed.py): converges, bounded, robust to stalls."""

from __future__ import annotations

import math

import pytest

from replicas.speed import (
    DECODE_TOKENS_PER_STEP,
    FLEET_DECODE_STEP_S,
    FLEET_PREFILL_TOKENS_PER_S,
    MIN_PREFILL_TOKENS,
    RateEstimate,
    ReplicaSpeed,
    fleet_seed,
)


def test_starts_at_the_fleet_constants_or_its_seed() -> None:
    s = ReplicaSpeed()
    assert s.prefill_tokens_per_s == FLEET_PREFILL_TOKENS_PER_S
    assert s.decode_step_s == pytest.approx(FLEET_DECODE_STEP_S)
    seeded = ReplicaSpeed.seeded(60_000.0, 0.012)
    assert seeded.prefill_tokens_per_s == 60_000.0 and seeded.decode_step_s == pytest.approx(0.012)


def test_a_faster_replica_is_learned_within_a_few_dozen_requests() -> None:
    s = ReplicaSpeed()
    for _ in range(40):
        s.observe(60_000, 0, 1.0, 101, 100 * 0.012 / DECODE_TOKENS_PER_STEP)  # 60k tok/s, 12 ms steps
    assert s.prefill_tokens_per_s == pytest.approx(60_000, rel=0.02)
    assert s.decode_step_s == pytest.approx(0.012, rel=0.02)


def test_queued_requests_do_not_drag_the_rate_down() -> None:
    """Half the requests wait as long again as their prefill: the upper expectile stays
    near the unqueued rate, where a mean would sit near 2/3 of it."""
    s = ReplicaSpeed()
    for i in range(400):
        s.observe(40_000, None, 1.0 if i % 2 else 2.0, None, None)
    assert s.prefill_tokens_per_s > 0.9 * 40_000


def test_a_stall_moves_the_figure_at_most_one_bounded_step() -> None:
    est = RateEstimate(40_000.0)
    est.observe(400.0)  # a sample 100x slower
    most = math.exp(-est.alpha * (1 - est.q) * est.max_log_step)
    assert est.value == pytest.approx(40_000.0 * most) and est.value > 0.98 * 40_000
    fast = RateEstimate(40_000.0)
    fast.observe(4_000_000.0)  # and 100x faster
    assert fast.value == pytest.approx(40_000.0 * math.exp(fast.alpha * fast.q * fast.max_log_step))
    assert fast.value < 1.15 * 40_000


def test_a_replica_that_stalls_for_good_stays_within_a_quarter_of_its_seed() -> None:
    s = ReplicaSpeed()
    for _ in range(10_000):
        s.observe(40_000, 0, 100.0, 101, 1000.0)
    assert s.prefill_tokens_per_s == pytest.approx(FLEET_PREFILL_TOKENS_PER_S / 4)
    assert s.decode_step_s == pytest.approx(FLEET_DECODE_STEP_S * 4)
    for _ in range(10_000):
        s.observe(40_000, 0, 1e-6, 101, 1e-6)
    assert s.prefill_tokens_per_s == pytest.approx(FLEET_PREFILL_TOKENS_PER_S * 4)
    assert s.decode_step_s == pytest.approx(FLEET_DECODE_STEP_S / 4)


@pytest.mark.parametrize(("uncached", "ttft_s", "out", "stream_s"), [
    (MIN_PREFILL_TOKENS - 1, 0.001, None, None),  # too small a prefill: overheads dominate
    (None, 1.0, 1, 1.0),  # one output token: no stream time
    (50_000, 0.0, 100, 0.0),  # no time
    (50_000, None, 100, None),
    (50_000, math.inf, 100, math.nan),
])
def test_samples_that_say_nothing_are_ignored(uncached: int | None, ttft_s: float | None, out: int | None,
                                              stream_s: float | None) -> None:
    s = ReplicaSpeed()
    s.observe(uncached, None, ttft_s, out, stream_s)
    assert s.prefill.samples == 0 and s.decode.samples == 0


def test_the_prefill_rate_counts_only_uncached_tokens() -> None:
    s = ReplicaSpeed()
    s.observe(50_000, 49_500, 0.001, None, None)  # 500 uncached: too few to say anything
    assert s.prefill.samples == 0
    s.observe(50_000, 10_000, 0.5, None, None)  # 40k uncached in 0.5 s: 80k tokens/s, faster than the seed
    assert s.prefill.samples == 1 and s.prefill_tokens_per_s > FLEET_PREFILL_TOKENS_PER_S


def test_the_seed_follows_the_policy_params() -> None:
    assert fleet_seed({}) == (FLEET_PREFILL_TOKENS_PER_S, FLEET_DECODE_STEP_S)
    assert fleet_seed({"prefill_tokens_per_s": 20_000, "move_margin_s": 1.0}) == (20_000.0, FLEET_DECODE_STEP_S)
