"""Bounded state (issue 10, item 10): random session ids cannot grow the session table
without limit; the router's own session memory is bounded and answers when the index
fails. The Redis side of the bound runs in the contract suite
(tests/prefix_index/test_contract.py, every backend)."""
from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.metrics import GatewayMetrics
from gateway.router import Router
from loadtest.simulator.fleet import SimFleet
from policies.base import Decision, Outcome
from policies.registry import make_policy
from prefix_index.base import SessionEntry
from prefix_index.config import IndexConfig
from prefix_index.factory import make_index
from prefix_index.local_index import FleetSizedIndex
from prefix_index.memory import MemoryPrefixIndex
from prefix_index.session_table import SessionTable
from tests.integration.conftest import metric_value, start_gateway
from tests.policies.support import ctx, rid, view

pytestmark = pytest.mark.safety


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_session_table_bound_evicts_lru_and_counts_only_evictions() -> None:
    clock = Clock()
    table = SessionTable(ttl_s=100.0, clock=clock, max_sessions=10)
    rng = random.Random(3)
    for i in range(1000):
        clock.now = i * 0.01
        table.set(str(uuid.UUID(int=rng.getrandbits(128))), SessionEntry(rid(0), 1, clock.now))
        assert len(table) <= 10
    assert table.evictions == 990
    clock.now = 1000.0  # all expired: expiry is not eviction
    table.set("late", SessionEntry(rid(0), 1, clock.now))
    assert len(table) == 1 and table.evictions == 990


async def test_configured_bound_reaches_the_embedded_index_and_its_stats() -> None:
    index = make_index(IndexConfig(max_sessions=25))
    assert isinstance(index, FleetSizedIndex)
    for i in range(100):
        await index.set_session(f"user:{i}", SessionEntry(rid(0), 10, float(i)))
    stats = await index.stats()
    assert (stats.sessions, stats.session_evictions) == (25, 75)


def test_local_sessions_are_bounded_lru() -> None:
    local = Router(make_policy("cache-aware", None, 1), MemoryPrefixIndex(), list, GatewayMetrics(),
                   rng=random.Random(1), clock=lambda: 0.0, local_sessions=3).sessions
    for key in "abc":
        local.set(key, SessionEntry(rid(0), 1, 0.0))
    local.set("a", SessionEntry(rid(1), 2, 1.0))
    local.set("d", SessionEntry(rid(0), 1, 2.0))
    assert len(local) == 3 and local.get("b") is None and local.get("a") == SessionEntry(rid(1), 2, 1.0)


class FailingSessions(MemoryPrefixIndex):
    """An index whose session reads fail (a backend that raises on an outage)."""

    failing = False

    async def get_session(self, key: str) -> SessionEntry | None:
        if self.failing:
            raise ConnectionError("index down")
        return await super().get_session(key)


async def test_router_keeps_affinity_from_its_own_table_when_the_index_fails() -> None:
    index = FailingSessions()
    views = [view(i) for i in range(3)]
    metrics = GatewayMetrics()
    router = Router(make_policy("cache-aware", None, 1), index, lambda: views, metrics,
                    rng=random.Random(1), clock=lambda: 1000.0)
    request = ctx(4000, session="s-1", prefix="conv")
    decision = Decision(replica=rid(2), reason="test", policy="cache-aware")
    await router.routed(request, decision)
    await router.completed(request, decision, Outcome(ok=True, status=200, prompt_tokens=4000,
                                                      completion_tokens=50))
    index.failing = True
    inputs = await router.snapshot(ctx(4100, session="s-1", prefix="conv"))
    assert inputs.session == SessionEntry(rid(2), 4050, 1000.0)
    assert router.decide(ctx(4100, session="s-1", prefix="conv"), inputs).replica == rid(2)
    assert metric_value(metrics.exposition().decode(), "kvgate_index_degraded_total") >= 1


# --- through a real gateway -------------------------------------------------------------

@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    with SimFleet(1, profile="tiny", time_scale=8.0, seed=5, log_dir=tmp_path_factory.mktemp("fleet")) as f:
        yield f


def test_random_session_ids_through_the_gateway_stay_within_the_bound(fleet: SimFleet, tmp_path: Path) -> None:
    gw = start_gateway(fleet.urls, tmp_path / "gw.log", "--set", "index.max_sessions=20")
    rng = random.Random(8)
    try:
        with httpx.Client(timeout=30.0) as client:
            for _ in range(60):
                body: dict[str, Any] = {"model": "tiny", "max_tokens": 1, "user": f"{rng.getrandbits(64):x}",
                                        "messages": [{"role": "user", "content": "hi there"}]}
                assert client.post(gw.url + "/v1/chat/completions", json=body).status_code == 200
            text = client.get(gw.url + "/metrics").text
    finally:
        gw.proc.stop()
    assert metric_value(text, "kvgate_session_table_sessions") == 20
    assert metric_value(text, "kvgate_session_table_evictions_total") == 40

