"""Fixtures of the agent-API tests: a real ``kvgate serve`` in front of simulated replicas.

Module-scoped: two ``tiny`` simulated replicas and one gateway per test module (real
processes on 127.0.0.1, ``tests/integration/conftest.py``'s helpers), stopped at teardown.
"""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import Gateway, start_gateway

MODEL = "tiny"


@pytest.fixture(scope="module")
def fleet2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    with SimFleet(2, profile="tiny", time_scale=20.0, seed=5, log_dir=tmp_path_factory.mktemp("fleet2")) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def gateway(fleet2: SimFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = start_gateway(fleet2.urls, tmp_path_factory.mktemp("gw") / "gateway.log")
    yield gw
    gw.proc.stop()


def raw_client(gw: Gateway) -> httpx.Client:
    return httpx.Client(base_url=gw.url, timeout=60.0, trust_env=False)
