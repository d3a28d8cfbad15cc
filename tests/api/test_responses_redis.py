"""Two gateways on one real redis-server share the Responses store: 20 concurrent
chains, each turn sent to the other gateway, land on the replica that created their
previous response. A gateway that never saw an id, and a replica that left, answer 404."""
from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from loadtest.simulator.fleet import SimFleet
from tests.api.conftest import MODEL
from tests.integration.conftest import Gateway, start_gateway
from tests.support.redis_server import redis_server

pytestmark = pytest.mark.redis
CHAINS, TURNS = 20, 3


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_server() as url:
        yield url


@pytest.fixture(scope="module")
def fleet3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    with SimFleet(3, profile="tiny", time_scale=20.0, seed=9, log_dir=tmp_path_factory.mktemp("fleet3")) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def gateways(fleet3: SimFleet, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Gateway]]:
    logs = tmp_path_factory.mktemp("gws")
    gws = [start_gateway(fleet3.urls, logs / f"gw{i}.log", "--redis-url", redis_url) for i in range(2)]
    yield gws
    for gw in gws:
        gw.proc.stop()


def create(gw: Gateway, chain: int, turn: int, previous: str | None) -> tuple[str, str, str]:
    body = {"model": MODEL, "input": f"chain {chain} turn {turn} " * 20, "max_output_tokens": 3,
            "instructions": f"You are chain {chain}. " * 10, "stream": turn % 2 == 1}
    if previous is not None:
        body["previous_response_id"] = previous
    with httpx.Client(timeout=60.0, trust_env=False) as client:
        r = client.post(gw.url + "/v1/responses", json=body)
        assert r.status_code == 200, r.text
        if body["stream"]:
            head = r.text.split("\n\n", 1)[0]
            rid = head.split('"id":"', 1)[1].split('"', 1)[0]
        else:
            rid = r.json()["id"]
    return rid, r.headers["x-kvgate-replica"], r.headers["x-kvgate-route-reason"]


def chain(gws: list[Gateway], k: int) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    previous: str | None = None
    for turn in range(TURNS):
        rid, replica, reason = create(gws[(k + turn) % 2], k, turn, previous)
        out.append((rid, replica, reason))
        previous = rid
    return out


def test_twenty_chains_across_two_gateways(gateways: list[Gateway]) -> None:
    with ThreadPoolExecutor(CHAINS) as pool:
        chains = list(pool.map(lambda k: chain(gateways, k), range(CHAINS)))
    for turns in chains:
        assert len({replica for _, replica, _ in turns}) == 1, turns
        assert all(reason == "previous-response" for _, _, reason in turns[1:]), turns
    assert len({turns[0][1] for turns in chains}) > 1  # the first turns spread over the fleet


def test_unknown_and_orphaned_ids(gateways: list[Gateway], fleet3: SimFleet, tmp_path: Path) -> None:
    rid, replica, _ = create(gateways[0], 99, 0, None)
    others = [u for u in fleet3.urls if u != replica]
    lone = start_gateway(others, tmp_path / "lone.log")  # no Redis, and without the creator
    try:
        r = httpx.post(lone.url + "/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": rid},
                       timeout=30.0, trust_env=False)
        assert r.status_code == 404 and r.json()["error"]["code"] == "previous_response_not_found"
    finally:
        lone.proc.stop()
    gw = gateways[1]
    assert gw.admin("DELETE", "/replicas", params={"url": replica}).status_code in (200, 204)
    try:
        r = httpx.post(gw.url + "/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": rid},
                       timeout=30.0, trust_env=False)
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "previous_response_not_found" and "left the fleet" in r.text
    finally:
        gw.admin("POST", "/replicas", json={"url": replica})
