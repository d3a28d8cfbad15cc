"""Every bad input gets its OpenAI-shaped error, from a real gateway process."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from loadtest.simulator.fleet import SimFleet
from tests.integration.conftest import AUTH, Gateway, start_gateway

LIMIT = 4096


@pytest.fixture(scope="module")
def fleet1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    with SimFleet(1, profile="tiny", time_scale=2.0, seed=3, log_dir=tmp_path_factory.mktemp("fleet1")) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def gw(fleet1: SimFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gateway = start_gateway(fleet1.urls, tmp_path_factory.mktemp("gw") / "gateway.log",
                            "--set", f"hashing.max_body_bytes={LIMIT}")
    yield gateway
    gateway.proc.stop()


def _error(r: httpx.Response, status: int) -> dict[str, object]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert "x-kvgate-replica" in r.headers and "x-kvgate-route-reason" in r.headers
    return dict(error)


JSON = {"content-type": "application/json"}


@pytest.mark.parametrize(("path", "body", "headers", "status"), [
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [', JSON, 400),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}]}',
     {"content-type": "text/plain"}, 415),
    ("/v1/chat/completions", b'{"model": "tiny"}', JSON, 400),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": "hello"}', JSON, 400),
    ("/v1/completions", b'{"model": "tiny"}', JSON, 400),
    ("/v1/completions", b'{"model": "tiny", "prompt": "' + b"x" * (LIMIT + 10) + b'"}', JSON, 413),
    ("/v1/chat/completions", b"[1, 2, 3]", JSON, 400),
    ("/generate", b'{"sampling_params": {}}', JSON, 400),
])
def test_bad_request_bodies(gw: Gateway, path: str, body: bytes, headers: dict[str, str], status: int) -> None:
    _error(httpx.post(gw.url + path, content=body, headers=headers, timeout=10.0), status)


def test_body_over_limit_with_chunked_upload(gw: Gateway) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"y" * 1024
        yield b'"}'

    _error(httpx.post(gw.url + "/v1/completions", content=chunks(), headers=JSON, timeout=10.0), 413)


def test_admin_needs_token(gw: Gateway) -> None:
    assert _error(httpx.get(gw.url + "/admin/replicas", timeout=5.0), 401)["type"] == "authentication_error"
    wrong = httpx.get(gw.url + "/admin/replicas", headers={"authorization": "Bearer wrong"}, timeout=5.0)
    assert _error(wrong, 403)["type"] == "permission_error"
    assert httpx.get(gw.url + "/admin/replicas", headers=AUTH, timeout=5.0).status_code == 200
    unknown = httpx.post(gw.url + "/admin/replicas/drain", json={"url": "http://127.0.0.1:1"}, headers=AUTH,
                         timeout=5.0)
    assert _error(unknown, 404)["code"] == "not_found"


def test_no_routable_replica_503(gw: Gateway, fleet1: SimFleet) -> None:
    url = fleet1.urls[0]
    drain = httpx.post(gw.url + "/admin/replicas/drain", json={"url": url, "wait": True}, headers=AUTH, timeout=30.0)
    assert drain.status_code == 200
    try:
        r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user",
                       "content": "x"}]}, timeout=10.0)
        assert _error(r, 503)["code"] == "no_replica_available"
        assert httpx.get(gw.url + "/ready", timeout=5.0).status_code == 503
    finally:
        httpx.post(gw.url + "/admin/replicas", json={"url": url}, headers=AUTH, timeout=10.0)
