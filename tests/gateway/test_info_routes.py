"""SGLang's ``/model_info``, ``/server_info`` and ``/flush_cache`` through the gateway app
(unit: httpx's ASGI transport; fake replicas on loopback HTTP, ``tests.support.fake_replicas``).

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
from aiohttp import web
from fastapi import FastAPI

from gateway.app import Gateway, create_app
from gateway.settings import Settings
from prefix_index.base import ReplicaId
from tests.gateway.test_app_unit import UNIT_TOKEN, A, B, fake_fleet, running, settings_for
from tests.support.fake_replicas import FakeFleet, Seen, json_reply, text_reply

MODEL_INFO = {"model_path": "/models/tiny", "tokenizer_path": "/models/tiny", "served_model_name": "m",
              "is_generation": True}
AUTH = {"authorization": f"Bearer {UNIT_TOKEN}"}
FLUSHED = "Cache flushed.\n"

_model_info, _flushed, _not_found = json_reply(200, MODEL_INFO), text_reply(200, FLUSHED), \
    json_reply(404, {"detail": "Not Found"})


async def sglang_like(request: web.Request) -> web.StreamResponse:
    if request.path == "/model_info":
        return await _model_info(request)
    if request.path == "/flush_cache":
        return await _flushed(request)
    return await _not_found(request)


busy = text_reply(400, "Flush cache failed.\n")
broken = json_reply(500, {"detail": "boom"})


@asynccontextmanager
async def app_client(fleet: FakeFleet, settings: Settings) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """The app (its ``Gateway`` on ``app.state``) and a client with no credentials."""
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app)
    async with running(fleet, app), httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        yield app, client


def calls(fleet: FakeFleet, path: str) -> list[Seen]:
    return [seen for seen in fleet.seen if seen.path == path]


async def test_model_info_relayed_without_the_clients_key() -> None:
    fleet = fake_fleet({A: sglang_like})
    async with app_client(fleet, settings_for([ReplicaId(fleet.url(A))])) as (_, client):
        r = await client.get("/model_info", headers={"authorization": "Bearer sk-client"})
        old = await client.get("/get_model_info")
    assert r.status_code == 200 and r.json() == MODEL_INFO
    assert r.headers["x-kvgate-replica"] == fleet.url(A)
    assert old.status_code == 200 and old.json() == MODEL_INFO
    first, second = calls(fleet, "/model_info")  # the alias asks for the current path
    assert "authorization" not in first.headers and "authorization" not in second.headers


async def test_server_info_is_the_replicas_own() -> None:
    fleet = fake_fleet({A: sglang_like})
    async with app_client(fleet, settings_for(fleet.urls(A))) as (_, client):
        r = await client.get("/server_info")
        old = await client.get("/get_server_info")
    assert r.status_code == 200 and r.json()["max_total_num_tokens"] == 64000
    assert old.json() == r.json()


async def test_the_replica_key_is_sent_when_configured() -> None:
    fleet = fake_fleet({A: sglang_like})
    settings = settings_for(fleet.urls(A), upstream={"replica_api_key": "replica-secret"})
    async with app_client(fleet, settings) as (_, client):
        await client.get("/model_info", headers={"authorization": "Bearer sk-client"})
        flushed = await client.post("/flush_cache", headers=AUTH)
    assert flushed.status_code == 200
    for seen in calls(fleet, "/model_info") + calls(fleet, "/flush_cache"):
        assert seen.headers["authorization"] == "Bearer replica-secret"


async def test_no_replica_is_503_with_retry_after() -> None:
    async with app_client(fake_fleet({}), settings_for([])) as (_, client):
        info = await client.get("/model_info")
        flush = await client.post("/flush_cache", headers=AUTH)
    for r in (info, flush):
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "no_replica_available"


async def test_a_failing_replica_is_502() -> None:
    fleet = fake_fleet({A: broken})
    async with app_client(fleet, settings_for(fleet.urls(A))) as (_, client):
        r = await client.get("/model_info")
    assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"


@pytest.mark.parametrize(("headers", "status"), [({}, 401), ({"authorization": "Bearer nope"}, 403)])
async def test_flush_needs_the_admin_token(headers: dict[str, str], status: int) -> None:
    fleet = fake_fleet({A: sglang_like})
    async with app_client(fleet, settings_for(fleet.urls(A))) as (_, client):
        post = await client.post("/flush_cache", headers=headers)
        get = await client.get("/flush_cache", headers=headers)
    assert post.status_code == get.status_code == status
    assert calls(fleet, "/flush_cache") == []


async def test_flush_fans_out_and_clears_the_index() -> None:
    fleet = fake_fleet({A: sglang_like, B: sglang_like})
    ra = ReplicaId(fleet.url(A))
    async with app_client(fleet, settings_for(fleet.urls(A, B))) as (app, client):
        gateway: Gateway = app.state.gateway
        await gateway.index.record(ra, [11, 12, 13])
        r = await client.post("/flush_cache", headers=AUTH, params={"timeout": "2"})
        get = await client.get("/flush_cache", headers=AUTH)
        left = await gateway.index.match([11, 12, 13], [ra])
        await gateway.index.record(ra, [11])  # recording works again afterwards
        again = await gateway.index.match([11], [ra])
        metrics = (await client.get("/metrics")).text
    body: dict[str, Any] = r.json()
    assert r.status_code == 200 and get.status_code == 200, r.text
    assert body["flushed"] == 2 and body["failed"] == 0
    assert {x["url"] for x in body["replicas"]} == set(fleet.urls(A, B))
    assert all(x["status"] == 200 and x["index_cleared"] for x in body["replicas"])
    flushes = calls(fleet, "/flush_cache")
    assert sorted(seen.replica for seen in flushes) == [A, A, B, B]
    assert all("authorization" not in seen.headers for seen in flushes)  # the admin token stays
    assert flushes[0].query["timeout"] == "2.0"
    assert left[ra].blocks == 0 and again[ra].blocks == 1
    assert 'kvgate_admin_requests_total{route="/flush_cache",status="200"} 2.0' in metrics


async def test_a_replica_that_did_not_flush_is_listed_and_keeps_its_blocks() -> None:
    fleet = fake_fleet({A: busy, B: sglang_like})
    ra = ReplicaId(fleet.url(A))
    async with app_client(fleet, settings_for(fleet.urls(A, B))) as (app, client):
        gateway: Gateway = app.state.gateway
        await gateway.index.record(ra, [21, 22])
        r = await client.post("/flush_cache", headers=AUTH)
        kept = await gateway.index.match([21, 22], [ra])
    body = r.json()
    assert r.status_code == 502 and body["flushed"] == 1 and body["failed"] == 1
    failed = next(x for x in body["replicas"] if x["url"] == fleet.url(A))
    assert failed["status"] == 400 and not failed["flushed"] and not failed["index_cleared"]
    assert kept[ra].blocks == 2


@pytest.mark.parametrize("value", ["-1", "abc", "nan", "1e9"])
async def test_flush_timeout_is_checked(value: str) -> None:
    fleet = fake_fleet({A: sglang_like})
    async with app_client(fleet, settings_for(fleet.urls(A))) as (_, client):
        r = await client.post("/flush_cache", headers=AUTH, params={"timeout": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == "timeout"
    assert calls(fleet, "/flush_cache") == []
