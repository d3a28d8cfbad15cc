"""Stored Responses belong to the tenant that created them (issue 41, items 1 and 2).

Before: client B, with another API key or none, could GET, continue
(``previous_response_id``), cancel and DELETE client A's stored response, and a body's
``request_id`` (SGLang makes it the response id) naming A's id moved A's pin to B's
replica. Now every other tenant gets the very 404 of an unknown id, A keeps its
response, and a client-chosen ``request_id`` / ``rid`` is a 400.

Real processes: simulated replicas with their response store (``SimFleet``, profile
``tiny``) behind ``kvgate serve``; the shared variant runs two gateways on one real
``redis-server``, so ownership (and the tenant HMAC key, created once in Redis) holds
across gateways. Every wait is bounded (client timeouts, bounded gateway start).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtest.simulator.fleet import SimFleet
from tests.api.conftest import MODEL
from tests.integration.conftest import Gateway, start_gateway
from tests.support.redis_server import redis_server

pytestmark = pytest.mark.safety

TIMEOUT_S = 30.0
A = {"authorization": "Bearer sk-tenant-a"}
B = {"authorization": "Bearer sk-tenant-b"}
B_KEY = {"x-api-key": "sk-tenant-b"}
ANON: dict[str, str] = {}
OTHERS = {"b": B, "b-x-api-key": B_KEY, "anonymous": ANON}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    with SimFleet(2, profile="tiny", time_scale=20.0, seed=11, log_dir=tmp_path_factory.mktemp("fleet")) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def gateway(fleet: SimFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = start_gateway(fleet.urls, tmp_path_factory.mktemp("gw") / "gateway.log")
    yield gw
    gw.proc.stop()


def call(gw: Gateway, method: str, path: str, headers: dict[str, str], body: Any = None) -> httpx.Response:
    with httpx.Client(base_url=gw.url, timeout=TIMEOUT_S, trust_env=False) as client:
        return client.request(method, path, headers=headers, json=body)


def create(gw: Gateway, headers: dict[str, str], text: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "input": text * 10, "max_output_tokens": 3, "instructions": "Be brief. " * 5, **extra}
    return call(gw, "POST", "/v1/responses", headers, body)


def masked(r: httpx.Response, rid: str) -> tuple[int, str]:
    """The answer with the id it names masked: a stranger's id must look like an unknown one."""
    return r.status_code, r.text.replace(rid, "<id>")


def unknown_like(rid: str) -> str:
    """An id of the same shape that no one created."""
    return "resp_" + "0" * (len(rid) - len("resp_"))


def assert_invisible(gw: Gateway, rid: str, headers: dict[str, str]) -> None:
    """GET, cancel, DELETE and continuation of ``rid`` answer as for an unknown id."""
    never = unknown_like(rid)
    for method, path in (("GET", "/v1/responses/{}"), ("POST", "/v1/responses/{}/cancel"),
                         ("DELETE", "/v1/responses/{}")):
        got = call(gw, method, path.format(rid), headers)
        want = call(gw, method, path.format(never), headers)
        assert got.status_code == 404, (method, got.text)
        assert masked(got, rid) == masked(want, never), (method, got.text, want.text)
    got = create(gw, headers, "continue it ", previous_response_id=rid)
    want = create(gw, headers, "continue it ", previous_response_id=never)
    assert got.status_code == 404 and got.json()["error"]["code"] == "previous_response_not_found", got.text
    assert masked(got, rid) == masked(want, never)


def test_other_tenants_cannot_reach_a_stored_response(gateway: Gateway) -> None:
    made = create(gateway, A, "tenant a's secret plan ")
    assert made.status_code == 200, made.text
    rid, replica = made.json()["id"], made.headers["x-kvgate-replica"]
    before = call(gateway, "GET", f"/v1/responses/{rid}", A)
    assert before.status_code == 200 and before.json()["id"] == rid
    for headers in OTHERS.values():
        assert_invisible(gateway, rid, headers)
    after = call(gateway, "GET", f"/v1/responses/{rid}", A)  # B's DELETE and cancel changed nothing
    assert after.status_code == 200 and after.json() == before.json()
    turn = create(gateway, A, "next turn ", previous_response_id=rid)
    assert turn.status_code == 200, turn.text
    assert (turn.headers["x-kvgate-replica"], turn.headers["x-kvgate-route-reason"]) == (replica, "previous-response")
    assert call(gateway, "DELETE", f"/v1/responses/{rid}", A).status_code == 200
    assert call(gateway, "GET", f"/v1/responses/{rid}", A).status_code == 404


def test_anonymous_responses_are_not_a_keyed_tenants(gateway: Gateway) -> None:
    """Clients without a credential are one tenant: they share, and no keyed client sees theirs."""
    made = create(gateway, ANON, "anonymous work ")
    assert made.status_code == 200, made.text
    rid = made.json()["id"]
    assert call(gateway, "GET", f"/v1/responses/{rid}", ANON).status_code == 200
    assert_invisible(gateway, rid, A)
    assert call(gateway, "GET", f"/v1/responses/{rid}", ANON).status_code == 200


@pytest.mark.parametrize(("endpoint", "field", "body"), [
    ("/v1/responses", "request_id", {"model": MODEL, "input": "x", "max_output_tokens": 2}),
    ("/v1/chat/completions", "rid", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                     "max_tokens": 2}),
    ("/generate", "rid", {"text": "x", "sampling_params": {"max_new_tokens": 2}}),
])
def test_client_chosen_ids_are_refused(gateway: Gateway, endpoint: str, field: str, body: dict[str, Any]) -> None:
    """B naming A's response id as its own ``request_id`` (or any ``rid``): 400, and A's pin
    and content are unchanged."""
    made = create(gateway, A, "a's conversation ")
    assert made.status_code == 200, made.text
    rid, replica = made.json()["id"], made.headers["x-kvgate-replica"]
    before = call(gateway, "GET", f"/v1/responses/{rid}", A).json()
    for headers in (B, ANON, A):
        r = call(gateway, "POST", endpoint, headers, {**body, field: rid})
        assert r.status_code == 400, r.text
        assert r.headers["x-kvgate-route-reason"] == "rejected"
        error = r.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", field)
    assert call(gateway, "GET", f"/v1/responses/{rid}", A).json() == before
    turn = create(gateway, A, "a's next turn ", previous_response_id=rid)
    assert turn.status_code == 200 and turn.headers["x-kvgate-replica"] == replica, turn.text


# ---- two gateways on one Redis: ownership is shared -------------------------------------
@pytest.fixture(scope="module")
def shared(fleet: SimFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Gateway]]:
    logs = tmp_path_factory.mktemp("shared")
    with redis_server() as url:
        gws = [start_gateway(fleet.urls, logs / f"gw{i}.log", "--redis-url", url) for i in range(2)]
        try:
            yield gws
        finally:
            for gw in gws:
                gw.proc.stop()


@pytest.mark.redis
def test_ownership_holds_across_gateways_on_one_redis(shared: list[Gateway]) -> None:
    """A's response made on one gateway: A reads and continues it on the other (one HMAC
    key, created once in Redis), B and anonymous clients get 404 on both."""
    one, two = shared
    made = create(one, A, "shared plan ")
    assert made.status_code == 200, made.text
    rid, replica = made.json()["id"], made.headers["x-kvgate-replica"]
    for gw in (two, one):
        for headers in OTHERS.values():
            assert_invisible(gw, rid, headers)
        assert call(gw, "GET", f"/v1/responses/{rid}", A).status_code == 200
    turn = create(two, A, "next ", previous_response_id=rid)
    assert turn.status_code == 200 and turn.headers["x-kvgate-replica"] == replica, turn.text
    refused = call(two, "POST", "/v1/responses", B, {"model": MODEL, "input": "x", "request_id": rid})
    assert refused.status_code == 400, refused.text
