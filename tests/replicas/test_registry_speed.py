"""The registry learns each replica's speed from finished requests and shows it in views."""

from __future__ import annotations

import pytest

from replicas.config import RegistryConfig
from replicas.registry import Registry
from replicas.speed import FLEET_DECODE_STEP_S, FLEET_PREFILL_TOKENS_PER_S
from tests.replicas.fakes import FakeClock, FakeFleet
from tests.replicas.test_registry import A, B, harness


async def test_observed_requests_move_only_their_replicas_figures() -> None:
    async with harness(A, B) as h:
        a0 = h.reg.get(A)
        assert a0 is not None
        assert a0.prefill_tokens_per_s == FLEET_PREFILL_TOKENS_PER_S
        assert a0.decode_step_s is not None and abs(a0.decode_step_s - FLEET_DECODE_STEP_S) < 1e-9
        for _ in range(30):
            h.reg.observe_speed(A + "/", 60_000, 0, 1.0, 101, 100 * 0.012 / 5)
        a, b = h.reg.get(A), h.reg.get(B)
        assert a is not None and b is not None
        assert a.prefill_tokens_per_s is not None and a.prefill_tokens_per_s > 55_000
        assert a.decode_step_s is not None and a.decode_step_s < 0.013
        assert b.prefill_tokens_per_s == FLEET_PREFILL_TOKENS_PER_S  # untouched
        h.reg.observe_speed("http://127.0.0.1:39999", 60_000, None, 1.0, None, None)  # unknown: ignored


async def test_a_replica_that_stalls_moves_at_most_one_bounded_step() -> None:
    async with harness(A) as h:
        h.reg.observe_speed(A, 40_000, 0, 100.0, 101, 1000.0)  # 100x slower than the seeds
        v = h.reg.get(A)
        assert v is not None and v.prefill_tokens_per_s is not None and v.decode_step_s is not None
        assert 0.98 * FLEET_PREFILL_TOKENS_PER_S < v.prefill_tokens_per_s < FLEET_PREFILL_TOKENS_PER_S
        assert FLEET_DECODE_STEP_S < v.decode_step_s < 1.02 * FLEET_DECODE_STEP_S


async def test_without_learning_views_carry_no_figures() -> None:
    async with harness(A, learn_speeds=False) as h:
        h.reg.observe_speed(A, 60_000, 0, 1.0, 101, 1.0)
        v = h.reg.get(A)
        assert v is not None and v.prefill_tokens_per_s is None and v.decode_step_s is None


async def test_every_replica_starts_at_the_registry_s_seed() -> None:
    fleet = FakeFleet()
    fleet.add(A)
    async with fleet.client() as client:
        reg = Registry(RegistryConfig(), client, clock=FakeClock(), speed_seed=(20_000.0, 0.03))
        v = await reg.add(A)
        assert v.prefill_tokens_per_s == 20_000.0 and v.decode_step_s == pytest.approx(0.03)
