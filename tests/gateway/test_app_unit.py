"""Unit tests of the gateway app over httpx's ASGI transport, its upstream calls going
through the production clients (``AiohttpUpstream``, the probes' ``AiohttpGetter``, the
control plane's httpx client) over loopback HTTP to fake replicas
(``tests.support.fake_replicas``), in the test's own event loop."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web
from fastapi import FastAPI

from gateway.app import Gateway, create_app
from gateway.settings import Settings, load_settings
from tests.replicas.fakes import server_info_body
from tests.support.fake_replicas import FakeFleet, Handler, breaking, hang, json_reply, refuse

USAGE = {"prompt_tokens": 100, "completion_tokens": 3, "total_tokens": 103,
         "prompt_tokens_details": {"cached_tokens": 64}}

ok_completion = json_reply(200, {
    "id": "x", "object": "chat.completion", "model": "m", "usage": USAGE,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
}, {"x-upstream": "yes", "server": "fake"})

SERVER_INFO = server_info_body(max_total_num_tokens=64000, max_running_requests=8, hicache=False)

A, B = "A", "B"  # replica names: ``fleet.url(A)`` is the replica's address


def fake_fleet(handlers: Mapping[str, Handler], models: Mapping[str, str] | None = None) -> FakeFleet:
    """Replicas serving model "m" (or ``models``), each running its handler for inference calls."""
    return FakeFleet(handlers, models=models, model="m", server_info=SERVER_INFO)


UNIT_TOKEN = "unit-admin-token"  # the admin API always needs a credential


def settings_for(replicas: list[str], **extra: Any) -> Settings:
    overrides: dict[str, Any] = {
        "registry": {"replicas": replicas, "probe_interval_s": 60, "loads_poll_interval_s": 60},
        "policy": {"name": "round-robin", "seed": 1},
        **({} if {"admin", "admin_token"} & extra.keys() else {"admin": {"token": UNIT_TOKEN}}),
        **extra,
    }
    return load_settings(None, overrides)


async def until_routable(gateway: Gateway, timeout_s: float = 5.0) -> None:
    """A bounded poll until every replica of the registry is routable (the first probe, made
    at startup, normally did it already)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not all(v.routable for v in gateway.registry.views()):
        states = {v.id: v.state.value for v in gateway.registry.views()}
        assert asyncio.get_running_loop().time() < deadline, f"replicas not routable: {states}"
        await asyncio.sleep(0.01)


@asynccontextmanager
async def running(fleet: FakeFleet, app: FastAPI) -> AsyncIterator[Gateway]:
    """The fleet and ``app``'s lifespan around a test: the app's ``Gateway`` once every
    replica is routable, the replicas whose handler is ``refuse`` refusing connections from
    then on."""
    async with fleet, app.router.lifespan_context(app):
        gw: Gateway = app.state.gateway
        await until_routable(gw)
        await fleet.refuse_connections()
        yield gw


@asynccontextmanager
async def gateway(fleet: FakeFleet, settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app; it sends the default admin token unless a test set its own."""
    app = create_app(settings)
    auth = {"authorization": f"Bearer {UNIT_TOKEN}"} if settings.admin_token_value() == UNIT_TOKEN else {}
    async with running(fleet, app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=auth) as client:
            yield client


CHAT = b'{"model": "m",  "messages": [{"role": "user", "content": "hello"}], "x_unknown": {"k": [1, 2]}}'


async def test_body_bytes_and_headers_pass_through() -> None:
    fleet = fake_fleet({A: ok_completion})
    async with gateway(fleet, settings_for(fleet.urls(A))) as client:
        r = await client.post("/v1/chat/completions", content=CHAT, headers={
            "content-type": "application/json", "x-custom": "1", "connection": "keep-alive",
            "authorization": "Bearer sk-test", "te": "trailers", "user-agent": "my-agent"})
    assert r.status_code == 200
    assert r.headers["x-kvgate-replica"] == fleet.url(A)
    assert r.headers["x-kvgate-route-reason"]
    assert r.headers["x-upstream"] == "yes"
    assert r.json()["usage"] == USAGE
    (seen,) = fleet.seen
    assert seen.replica == A and seen.body == CHAT  # the very bytes the client sent
    assert seen.headers["x-custom"] == "1"
    assert "authorization" not in seen.headers  # the client's key stays (upstream.forward_authorization)
    assert "te" not in seen.headers and "connection" not in seen.headers
    assert seen.headers.getall("user-agent") == ["my-agent"]  # nothing of the gateway's own
    assert seen.headers["content-length"] == str(len(CHAT))


async def test_usage_feeds_metrics_and_lease_released() -> None:
    fleet = fake_fleet({A: ok_completion})
    async with gateway(fleet, settings_for(fleet.urls(A))) as client:
        await client.post("/v1/chat/completions", content=CHAT, headers={"content-type": "application/json"})
        metrics = (await client.get("/metrics")).text
        replicas = (await client.get("/admin/replicas")).json()["data"]
    assert "kvgate_reported_cached_tokens_total 64.0" in metrics
    assert "kvgate_prompt_tokens_total 100.0" in metrics
    assert 'kvgate_requests_total{endpoint="chat",model="m",status="200"} 1.0' in metrics
    assert "kvgate_cache_hit_ratio 0.64" in metrics
    assert f'kvgate_replica_state{{replica="{fleet.url(A)}",state="active"}} 1.0' in metrics
    assert "kvgate_policy_plugin_seconds_total{plugin=" in metrics
    assert replicas[0]["in_flight"] == 0 and replicas[0]["url"] == fleet.url(A)


server_error = json_reply(503, {"detail": "The request queue is full."})


@pytest.mark.parametrize("failing", [refuse, server_error])
async def test_failure_before_first_byte_retries_elsewhere(failing: Handler) -> None:
    fleet = fake_fleet({A: failing, B: ok_completion})
    async with gateway(fleet, settings_for(fleet.urls(A, B))) as client:
        replies = [await client.post("/v1/chat/completions", content=CHAT,
                                     headers={"content-type": "application/json"}) for _ in range(4)]
        metrics = (await client.get("/metrics")).text
        views = {v["url"]: v for v in (await client.get("/admin/replicas")).json()["data"]}
    assert all(r.status_code == 200 and r.headers["x-kvgate-replica"] == fleet.url(B) for r in replies)
    assert "kvgate_upstream_retries_total" in metrics
    assert views[fleet.url(A)]["in_flight"] == 0 and views[fleet.url(B)]["in_flight"] == 0


async def test_all_attempts_fail_gives_502_with_replica_header() -> None:
    fleet = fake_fleet({A: refuse, B: refuse})
    async with gateway(fleet, settings_for(fleet.urls(A, B))) as client:
        r = await client.post("/v1/chat/completions", content=CHAT, headers={"content-type": "application/json"})
    assert r.status_code == 502
    assert r.json()["error"]["type"] == "upstream_error"
    assert r.headers["x-kvgate-replica"] in fleet.urls(A, B)


async def test_last_replica_5xx_is_relayed() -> None:
    fleet = fake_fleet({A: server_error})
    async with gateway(fleet, settings_for(fleet.urls(A))) as client:
        r = await client.post("/v1/chat/completions", content=CHAT, headers={"content-type": "application/json"})
    assert r.status_code == 503 and r.json() == {"detail": "The request queue is full."}
    assert r.headers["x-kvgate-replica"] == fleet.url(A)


async def test_upstream_timeout_before_first_byte_is_504() -> None:
    fleet = fake_fleet({A: hang})
    async with gateway(fleet, settings_for(fleet.urls(A), upstream={"total_timeout_s": 0.3})) as client:
        r = await client.post("/v1/chat/completions", content=CHAT, headers={"content-type": "application/json"})
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"


async def test_no_replica_503_and_ready() -> None:
    fleet = fake_fleet({})
    async with gateway(fleet, settings_for([])) as client:
        r = await client.post("/v1/chat/completions", content=CHAT, headers={"content-type": "application/json"})
        ready = await client.get("/ready")
        health = await client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica_available"
    assert r.headers["x-kvgate-replica"] == "none"
    assert ready.status_code == 503 and health.status_code == 200


@pytest.mark.parametrize(("body", "content_type", "status"), [
    (b"{not json", "application/json", 400),
    (CHAT, "text/plain", 415),
    (b'{"model": "m"}', "application/json", 400),
    (b'{"model": "m", "messages": []}', "application/json", 400),
    (b'{"model": "m", "prompt": "x" }' + b" " * 2048, "application/json", 413),
])
async def test_bad_input(body: bytes, content_type: str, status: int) -> None:
    fleet = fake_fleet({A: ok_completion})
    s = settings_for(fleet.urls(A), hashing={"max_body_bytes": 1024})
    async with gateway(fleet, s) as client:
        path = "/v1/completions" if b"prompt" in body else "/v1/chat/completions"
        r = await client.post(path, content=body, headers={"content-type": content_type})
    assert r.status_code == status
    assert set(r.json()["error"]) == {"message", "type", "code", "param"}
    assert fleet.seen == []


async def test_models_union_and_unknown_route() -> None:
    fleet = fake_fleet({A: ok_completion, B: ok_completion}, models={A: "m1", B: "m2"})
    async with gateway(fleet, settings_for(fleet.urls(A, B))) as client:
        models = (await client.get("/v1/models")).json()
        missing = await client.get("/nope")
    assert sorted(m["id"] for m in models["data"]) == ["m1", "m2"]
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


async def test_admin_api_with_token() -> None:
    fleet = fake_fleet({A: ok_completion, B: ok_completion})
    a, b = fleet.urls(A, B)
    s = settings_for([a], admin={"token": "s3cret"}, index={"redis_url": None})
    auth = {"authorization": "Bearer s3cret"}
    async with gateway(fleet, s) as client:
        assert (await client.get("/admin/replicas")).status_code == 401
        wrong = await client.get("/admin/replicas", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 403 and wrong.json()["error"]["type"] == "permission_error"
        added = await client.post("/admin/replicas", json={"url": b}, headers=auth)
        assert added.status_code == 201 and added.json()["url"] == b
        drained = await client.post("/admin/replicas/drain", json={"url": a, "wait": True}, headers=auth)
        assert drained.status_code == 200 and drained.json()["removed"] is True
        r = await client.post("/v1/chat/completions", content=CHAT, headers={"content-type": "application/json"})
        assert r.headers["x-kvgate-replica"] == b
        assert (await client.post("/admin/replicas/undrain", json={"url": a}, headers=auth)).status_code == 404
        drain_b = await client.post("/admin/replicas/drain", json={"url": b, "deadline_s": 30}, headers=auth)
        assert drain_b.json()["state"] == "draining" or drain_b.json()["state"] == "removed"
        gone = await client.delete("/admin/replicas", params={"url": b}, headers=auth)
        assert gone.status_code in (200, 404)
        config = (await client.get("/admin/config", headers=auth)).json()
        bad = await client.post("/admin/replicas", json={"nope": 1}, headers=auth)
    assert config["admin"]["token"] == "***" and "s3cret" not in orjson.dumps(config).decode()
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"


async def test_drained_replica_gets_no_new_requests() -> None:
    fleet = fake_fleet({A: ok_completion, B: ok_completion})
    async with gateway(fleet, settings_for(fleet.urls(A, B))) as client:
        drained = await client.post("/admin/replicas/drain", json={"url": fleet.url(B), "deadline_s": 60})
        replies = [await client.post("/v1/chat/completions", content=CHAT,
                                     headers={"content-type": "application/json"}) for _ in range(3)]
    assert drained.status_code == 200
    assert {r.headers["x-kvgate-replica"] for r in replies} == {fleet.url(A)}


async def test_json_body_breaking_after_first_byte_is_502() -> None:
    fleet = fake_fleet({A: breaking("application/json", [b'{"id": "x", "choi'])})
    async with gateway(fleet, settings_for(fleet.urls(A))) as client:
        r = await client.post("/v1/chat/completions", content=CHAT, headers={"content-type": "application/json"})
        views = (await client.get("/admin/replicas")).json()["data"]
    assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
    assert r.headers["x-kvgate-replica"] == fleet.url(A)
    assert views[0]["in_flight"] == 0


async def test_sse_breaking_after_first_byte_ends_with_error_then_done() -> None:
    first = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"Hel'  # cut mid-event
    fleet = fake_fleet({A: breaking("text/event-stream", [first])})
    async with gateway(fleet, settings_for(fleet.urls(A))) as client:
        r = await client.post("/v1/chat/completions", content=CHAT, headers={"content-type": "application/json"})
        metrics = (await client.get("/metrics")).text
    assert r.status_code == 200 and r.headers["x-kvgate-replica"] == fleet.url(A)
    assert r.content.startswith(first + b"\n\n")  # the broken event is terminated, not glued to ours
    events = [e for e in r.content[len(first):].split(b"\n\n") if e]
    assert orjson.loads(events[0][6:])["error"]["type"] == "upstream_error"
    assert events[1] == b"data: [DONE]"
    assert 'kvgate_requests_total{endpoint="chat",model="m",status="502"} 1.0' in metrics


async def test_admin_locked_without_a_token_and_openapi_served() -> None:
    fleet = fake_fleet({A: ok_completion})
    s = settings_for(fleet.urls(A), admin={"token": None})
    async with gateway(fleet, s) as client:
        none = await client.get("/admin/replicas")
        some = await client.get("/admin/replicas", headers={"authorization": "Bearer anything"})
        document = (await client.get("/openapi.json")).json()
    assert none.status_code == 401 and some.status_code == 403
    assert document["openapi"].startswith("3.1") and "/v1/chat/completions" in document["paths"]
    assert document["paths"]["/admin/replicas"]["post"]["security"] == [{"adminToken": []}]


async def test_drain_remaining_on_the_registry_clock_and_admin_calls_counted() -> None:
    fleet = fake_fleet({A: ok_completion, B: ok_completion})
    async with gateway(fleet, settings_for(fleet.urls(A, B))) as client:
        drained = (await client.post("/admin/replicas/drain", json={"url": fleet.url(B), "deadline_s": 30})).json()
        bad = await client.post("/admin/replicas", json={"url": "http://[::1"})
        metrics = (await client.get("/metrics")).text
    assert drained["state"] == "removed" or 0 < drained["drain_remaining_s"] <= 30
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"
    assert 'kvgate_admin_requests_total{route="/admin/replicas",status="400"} 1.0' in metrics
    assert 'kvgate_admin_requests_total{route="/admin/replicas/drain",status="200"} 1.0' in metrics


STORED = {"id": "resp_unit1", "object": "response", "status": "completed"}
_created, _read = json_reply(200, {**STORED, "output": []}), json_reply(200, STORED)


async def stored_responses(request: web.Request) -> web.StreamResponse:
    """A replica with one stored response: creating it, then reading, cancelling, deleting it."""
    if request.method == "POST" and request.path == "/v1/responses":
        return await _created(request)
    return await _read(request)


async def test_a_trusted_tenant_header_names_the_owner() -> None:
    """With ``responses.tenant_header`` set (an authenticating proxy in front sets it), the
    header, not the key, is the tenant; without it the credential is; another tenant's id
    is the 404 of an unknown one, and nothing of it reaches the replica."""
    fleet = fake_fleet({A: stored_responses})
    s = settings_for(fleet.urls(A), responses={"tenant_header": "X-Tenant", "tenant_hash_key": "unit-key"})
    async with gateway(fleet, s) as client:
        made = await client.post("/v1/responses", json={"model": "m", "input": "x"},
                                 headers={"x-tenant": "acme", "authorization": "Bearer k1"})
        assert made.status_code == 200 and made.json()["id"] == "resp_unit1"
        same_tenant = await client.get("/v1/responses/resp_unit1", headers={"x-tenant": "acme",
                                                                            "authorization": "Bearer other"})
        assert same_tenant.status_code == 200
        seen = len(fleet.seen)
        unknown = await client.get("/v1/responses/resp_unit2", headers={"x-tenant": "acme"})
        for headers in ({"x-tenant": "globex"}, {"authorization": "Bearer k1"}, {"authorization": ""}):
            for method, path in (("GET", "/v1/responses/resp_unit1"), ("DELETE", "/v1/responses/resp_unit1"),
                                 ("POST", "/v1/responses/resp_unit1/cancel")):
                r = await client.request(method, path, headers=headers)
                assert (r.status_code, r.text.replace("unit1", "unit2")) == (404, unknown.text), (method, headers)
            r = await client.post("/v1/responses", json={"model": "m", "input": "x",
                                                         "previous_response_id": "resp_unit1"}, headers=headers)
            assert r.status_code == 404 and r.json()["error"]["code"] == "previous_response_not_found"
        assert len(fleet.seen) == seen  # no stranger's call reached the replica
