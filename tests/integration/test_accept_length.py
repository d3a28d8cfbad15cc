"""Speculative accept length over real processes: a `kvgate serve` in front of two simulated
`tiny` replicas whose drafts are accepted differently (2.5 and 1.5 tokens per step) reads
each one's accept length from its `/v1/loads` and shows it in the admin API and /metrics,
and prices the one accepted less at a longer decode step."""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.simulator.fleet import SimFleet
from loadtest.simulator.profile import PROFILES_DIR
from tests.integration.conftest import GatewayFactory


@pytest.fixture
def two_replicas(tmp_path: Path) -> Iterator[tuple[str, str]]:
    poor = tmp_path / "tiny-poor.toml"
    (tmp_path / "good").mkdir()
    (tmp_path / "poor").mkdir()
    text = (PROFILES_DIR / "tiny.toml").read_text()
    assert "spec_accept_length = 2.5" in text
    poor.write_text(text.replace('name = "tiny"', 'name = "tiny-poor"').replace(
        "spec_accept_length = 2.5", "spec_accept_length = 1.5"))
    with (SimFleet(1, profile="tiny", time_scale=1.0, seed=1, log_dir=tmp_path / "good") as good,
          SimFleet(1, profile=str(poor), time_scale=1.0, seed=2, log_dir=tmp_path / "poor") as bad):
        yield good.urls[0], bad.urls[0]


def test_each_replica_s_accept_length_is_read_and_shown(two_replicas: tuple[str, str],
                                                         make_gateway: GatewayFactory) -> None:
    good, poor = two_replicas
    gw = make_gateway([good, poor])
    assert {url: v["spec_accept_length"] for url, v in gw.replicas().items()} == {good: None, poor: None}
    with httpx.Client(timeout=30.0, trust_env=False) as client:
        for url in (good, poor):  # decode something on each (straight to it: its /v1/loads counts all)
            r = client.post(url + "/generate", json={"text": "hello there " * 20,
                                                     "sampling_params": {"max_new_tokens": 61, "ignore_eos": True}})
            assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 61
    deadline = time.monotonic() + 30.0  # the registry polls /v1/loads every second
    views = gw.replicas()
    while any(v["spec_accept_length"] is None for v in views.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        views = gw.replicas()
    a, b = views[good]["spec_accept_length"], views[poor]["spec_accept_length"]
    # (tokens per verify step as the engine counts them: a reply's last step may yield fewer)
    assert a == pytest.approx(2.5, abs=0.15) and b == pytest.approx(1.5, abs=0.15)
    assert views[poor]["decode_step_s"] > views[good]["decode_step_s"]
    text = gw.metrics()
    assert f'kvgate_replica_spec_accept_length{{replica="{good}"}} {a!r}' in text
    assert f'kvgate_replica_spec_accept_length{{replica="{poor}"}} {b!r}' in text
    gw.assert_quiet()
