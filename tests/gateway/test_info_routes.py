"""SGLang's ``/model_info``, ``/server_info`` and ``/flush_cache`` through the gateway app
(unit: httpx's ASGI transport, fake replicas behind ``httpx.MockTransport``).

Benchmark tools read the tokenizer path from the first two and ``bench_serving
--flush-cache`` calls the third: the gateway relays the info from a routable replica and
fans the flush out to every replica as an admin action, never leaking the admin token.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from gateway.app import Gateway, create_app
from gateway.settings import Settings
from prefix_index.base import ReplicaId
from tests.gateway.test_app_unit import UNIT_TOKEN, A, B, FakeFleet, reply, settings_for

MODEL_INFO = {"model_path": "/models/tiny", "tokenizer_path": "/models/tiny", "served_model_name": "m",
              "is_generation": True}
AUTH = {"authorization": f"Bearer {UNIT_TOKEN}"}
FLUSHED = "Cache flushed.\n"
RA = ReplicaId(A)


def sglang_like(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/model_info":
        return reply(200, MODEL_INFO)
    if request.url.path == "/flush_cache":
        return httpx.Response(200, text=FLUSHED)
    return reply(404, {"detail": "Not Found"})


def busy(request: httpx.Request) -> httpx.Response:
    return httpx.Response(400, text="Flush cache failed.\n")


def broken(request: httpx.Request) -> httpx.Response:
    return reply(500, {"detail": "boom"})


@asynccontextmanager
async def app_client(fleet: FakeFleet, settings: Settings) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """The app (its ``Gateway`` on ``app.state``) and a client with no credentials."""
    app = create_app(settings, transport=fleet.transport())
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        yield app, client


def calls(fleet: FakeFleet, path: str) -> list[tuple[str, httpx.Request]]:
    return [(base, request) for base, request, _ in fleet.seen if request.url.path == path]


async def test_model_info_relayed_without_the_clients_key() -> None:
    fleet = FakeFleet({A: sglang_like})
    async with app_client(fleet, settings_for([RA])) as (_, client):
        r = await client.get("/model_info", headers={"authorization": "Bearer sk-client"})
        old = await client.get("/get_model_info")
    assert r.status_code == 200 and r.json() == MODEL_INFO
    assert r.headers["x-kvgate-replica"] == A
    assert old.status_code == 200 and old.json() == MODEL_INFO
    (_, first), (_, second) = calls(fleet, "/model_info")  # the alias asks for the current path
    assert "authorization" not in first.headers and "authorization" not in second.headers


async def test_server_info_is_the_replicas_own() -> None:
    fleet = FakeFleet({A: sglang_like})
    async with app_client(fleet, settings_for([RA])) as (_, client):
        r = await client.get("/server_info")
        old = await client.get("/get_server_info")
    assert r.status_code == 200 and r.json()["max_total_num_tokens"] == 64000
    assert old.json() == r.json()


async def test_the_replica_key_is_sent_when_configured() -> None:
    fleet = FakeFleet({A: sglang_like})
    settings = settings_for([A], upstream={"replica_api_key": "replica-secret"})
    async with app_client(fleet, settings) as (_, client):
        await client.get("/model_info", headers={"authorization": "Bearer sk-client"})
        flushed = await client.post("/flush_cache", headers=AUTH)
    assert flushed.status_code == 200
    for _, request in calls(fleet, "/model_info") + calls(fleet, "/flush_cache"):
        assert request.headers["authorization"] == "Bearer replica-secret"


async def test_no_replica_is_503_with_retry_after() -> None:
    async with app_client(FakeFleet({}), settings_for([])) as (_, client):
        info = await client.get("/model_info")
        flush = await client.post("/flush_cache", headers=AUTH)
    for r in (info, flush):
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "no_replica_available"


async def test_a_failing_replica_is_502() -> None:
    async with app_client(FakeFleet({A: broken}), settings_for([RA])) as (_, client):
        r = await client.get("/model_info")
    assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"


@pytest.mark.parametrize(("headers", "status"), [({}, 401), ({"authorization": "Bearer nope"}, 403)])
async def test_flush_needs_the_admin_token(headers: dict[str, str], status: int) -> None:
    fleet = FakeFleet({A: sglang_like})
    async with app_client(fleet, settings_for([RA])) as (_, client):
        post = await client.post("/flush_cache", headers=headers)
        get = await client.get("/flush_cache", headers=headers)
    assert post.status_code == get.status_code == status
    assert calls(fleet, "/flush_cache") == []


async def test_flush_fans_out_and_clears_the_index() -> None:
    fleet = FakeFleet({A: sglang_like, B: sglang_like})
    async with app_client(fleet, settings_for([A, B])) as (app, client):
        gateway: Gateway = app.state.gateway
        await gateway.index.record(RA, [11, 12, 13])
        r = await client.post("/flush_cache", headers=AUTH, params={"timeout": "2"})
        get = await client.get("/flush_cache", headers=AUTH)
        left = await gateway.index.match([11, 12, 13], [RA])
        await gateway.index.record(RA, [11])  # recording works again afterwards
        again = await gateway.index.match([11], [RA])
        metrics = (await client.get("/metrics")).text
    body: dict[str, Any] = r.json()
    assert r.status_code == 200 and get.status_code == 200, r.text
    assert body["flushed"] == 2 and body["failed"] == 0
    assert {x["url"] for x in body["replicas"]} == {A, B}
    assert all(x["status"] == 200 and x["index_cleared"] for x in body["replicas"])
    flushes = calls(fleet, "/flush_cache")
    assert sorted(base for base, _ in flushes) == [A, A, B, B]
    assert all("authorization" not in request.headers for _, request in flushes)  # the admin token stays
    assert flushes[0][1].url.params["timeout"] == "2.0"
    assert left[RA].blocks == 0 and again[RA].blocks == 1
    assert 'kvgate_admin_requests_total{route="/flush_cache",status="200"} 2.0' in metrics


async def test_a_replica_that_did_not_flush_is_listed_and_keeps_its_blocks() -> None:
    fleet = FakeFleet({A: busy, B: sglang_like})
    async with app_client(fleet, settings_for([A, B])) as (app, client):
        gateway: Gateway = app.state.gateway
        await gateway.index.record(RA, [21, 22])
        r = await client.post("/flush_cache", headers=AUTH)
        kept = await gateway.index.match([21, 22], [RA])
    body = r.json()
    assert r.status_code == 502 and body["flushed"] == 1 and body["failed"] == 1
    failed = next(x for x in body["replicas"] if x["url"] == A)
    assert failed["status"] == 400 and not failed["flushed"] and not failed["index_cleared"]
    assert kept[RA].blocks == 2


@pytest.mark.parametrize("value", ["-1", "abc", "nan", "1e9"])
async def test_flush_timeout_is_checked(value: str) -> None:
    fleet = FakeFleet({A: sglang_like})
    async with app_client(fleet, settings_for([RA])) as (_, client):
        r = await client.post("/flush_cache", headers=AUTH, params={"timeout": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == "timeout"
    assert calls(fleet, "/flush_cache") == []
