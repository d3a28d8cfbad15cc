"""Learned per-replica speed over real processes: a `kvgate serve` in front of one simulated
`tiny` replica (prefill 10k tokens/s: a quarter of the fleet constant) learns from the
streams it relays, and shows the figures in /metrics and the admin API."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from loadtest.simulator.fleet import SimFleet
from replicas.speed import FLEET_DECODE_STEP_S, FLEET_PREFILL_TOKENS_PER_S
from tests.integration.conftest import GatewayFactory


@pytest.fixture
def fleet1(tmp_path: Path) -> Iterator[SimFleet]:
    with SimFleet(1, profile="tiny", time_scale=1.0, seed=5, log_dir=tmp_path) as fleet:
        yield fleet


def test_speed_is_learned_from_streams_and_shown(fleet1: SimFleet, make_gateway: GatewayFactory) -> None:
    gw = make_gateway(fleet1.urls)
    url = fleet1.urls[0]
    before = gw.replicas()[url]
    assert before["prefill_tokens_per_s"] == FLEET_PREFILL_TOKENS_PER_S
    oa = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60.0)
    for i in range(6):  # distinct prompts of a few thousand tokens: uncached prefills
        text = " ".join(f"request {i} line {j}: say something about item {j * 7 + i}." for j in range(300))
        chunks = list(oa.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": text}], max_tokens=12, stream=True,
            stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None
    view = gw.replicas()[url]
    # slower than the seeds on both counts, each request moving the figures a bounded step
    assert FLEET_PREFILL_TOKENS_PER_S / 4 <= view["prefill_tokens_per_s"] < FLEET_PREFILL_TOKENS_PER_S
    assert FLEET_DECODE_STEP_S < view["decode_step_s"] <= FLEET_DECODE_STEP_S * 4
    text = gw.metrics()
    assert f'kvgate_replica_prefill_tokens_per_second{{replica="{url}"}} {view["prefill_tokens_per_s"]!r}' in text
    assert f'kvgate_replica_decode_step_seconds{{replica="{url}"}}' in text
    gw.assert_quiet()
