"""Schema-driven fuzzing: schemathesis over the gateway's own ``/openapi.json``.

A real ``kvgate serve`` in front of 2 simulated replicas (``kvgate sim``, profile tiny).
Schemathesis generates cases from the document the gateway serves (positive and
negative: wrong types, missing fields, odd strings), one pytest case per operation;
admin operations carry the token. The gateway itself must never answer 5xx (a replica's
own error relayed as is is allowed: ``x-kvgate-replica`` names it and the body is not a
gateway error), must not crash, and must still be healthy afterwards.

Replica URLs that the admin API would accept are rewritten to loopback ports nothing
listens on before they are sent: a generated host name must never become a DNS query.
Seeded (``derandomize``), no example database.
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from gateway.admin import validate_replica_url
from gateway.errors import InvalidRequest
from gateway.openapi import openapi_document
from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import AUTH, Gateway, start_gateway

pytestmark = pytest.mark.safety

EXAMPLES_PER_OPERATION = 250  # plus each operation's coverage-phase cases
CHAT = "/v1/chat/completions"
CHAT_EXAMPLES = 100
MIN_CASES = 3000
GATEWAY_ERROR_TYPES = {"internal_error", "upstream_error", "service_unavailable", "invalid_request_error",
                       "authentication_error", "permission_error", "server_shutdown"}
schema = schemathesis.openapi.from_dict(openapi_document())
seen: dict[str, int] = {}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    logs = tmp_path_factory.mktemp("fuzz")
    with SimFleet(2, profile="tiny", time_scale=50.0, seed=17, log_dir=logs) as fleet:
        g = start_gateway(fleet.urls, logs / "gw.log")
        yield g
        healthy = httpx.get(g.url + "/ready", timeout=5.0)
        alive = g.proc.popen.poll() is None
        output = g.proc.output()
        g.proc.stop()
        assert alive and healthy.status_code == 200, output[-3000:]
        assert "Traceback" not in output, output[-5000:]
        print(f"schemathesis: {sum(seen.values())} cases", seen)  # shown with -s
        assert sum(seen.values()) >= MIN_CASES, seen


def _loopback(body: Any, rng: random.Random) -> None:
    """An acceptable replica URL in a body goes to a closed loopback port instead."""
    if isinstance(body, dict) and isinstance(body.get("url"), str):
        try:
            validate_replica_url(body["url"])
        except InvalidRequest:
            return
        body["url"] = f"http://127.0.0.1:{rng.randrange(1, 1024)}"


def _from_gateway(response: Any) -> bool:
    """True when the gateway produced this response itself (not a replica's relayed one)."""
    if response.headers.get("x-kvgate-replica", ["none"])[0] == "none":
        return True
    try:
        error = response.json().get("error")
    except ValueError:
        return False
    return isinstance(error, dict) and error.get("type") in GATEWAY_ERROR_TYPES


def _check(case: schemathesis.Case, gw: Gateway) -> None:
    headers = AUTH if case.path.startswith("/admin") else {}
    _loopback(case.body, random.Random(len(seen)))
    response = case.call(base_url=gw.url, headers=headers, timeout=30)
    seen[case.operation.label] = seen.get(case.operation.label, 0) + 1
    assert response.status_code < 500 or not _from_gateway(response), (
        case.operation.label, response.status_code, response.text[:500], case.body)


def fuzz(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


@schema.exclude(path=CHAT).parametrize()
@fuzz(EXAMPLES_PER_OPERATION)
def test_no_gateway_5xx(case: schemathesis.Case, gw: Gateway) -> None:
    _check(case, gw)


@schema.include(path=CHAT).parametrize()
@fuzz(CHAT_EXAMPLES)  # nested message arrays cost ~5x more to generate
def test_no_gateway_5xx_chat(case: schemathesis.Case, gw: Gateway) -> None:
    _check(case, gw)
