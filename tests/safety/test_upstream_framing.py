"""Framing end to end (real processes): 1xx answers never leak one request's answer to
another, close-delimited bodies are relayed whole."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.conftest import Gateway, start_gateway
from tests.safety.raw_replica import raw_fleet

pytestmark = pytest.mark.safety
CLIENTS, PER_CLIENT = 8, 8


def _body(token: str, stream: bool) -> bytes:
    pad = "x" * 20_000  # a sizeable body, like the agent bodies curl sends with Expect
    return json.dumps({"model": "m", "stream": stream,
                       "messages": [{"role": "user", "content": f"{token} {pad}"}]}).encode()


async def _client(url: str, c: int) -> list[tuple[str, list[str]]]:
    """(token sent, ids received) for every request of client ``c``."""
    got: list[tuple[str, list[str]]] = []
    async with httpx.AsyncClient(base_url=url, timeout=20.0) as client:
        for r in range(PER_CLIENT):
            token, stream = f"c{c}-r{r}", r % 2 == 1
            headers = {"content-type": "application/json", "expect": "100-continue", "x-request-token": token}
            async with client.stream("POST", "/v1/chat/completions", content=_body(token, stream),
                                     headers=headers) as response:
                text = (await response.aread()).decode()
            assert response.status_code == 200, text
            if stream:
                ids = [json.loads(line[6:])["id"] for line in text.splitlines()
                       if line.startswith("data: {")]
            else:
                doc = json.loads(text)
                ids = [doc["id"]]
                assert "expect" not in {k for k, _ in doc["headers"]}
            got.append((token, ids))
    return got


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway in front of one raw replica that sends 100 and 103 before every answer."""
    log_dir = tmp_path_factory.mktemp("framing")
    with raw_fleet(1, log_dir, "--hints") as fleet:
        gateway = start_gateway(fleet.urls, log_dir / "gateway.log")
        try:
            yield gateway
        finally:
            gateway.proc.stop()


def test_1xx_answers_never_leak_under_concurrent_clients(gw: Gateway) -> None:
    async def run() -> list[list[tuple[str, list[str]]]]:
        return list(await asyncio.gather(*(_client(gw.url, c) for c in range(CLIENTS))))

    results = [pair for client in asyncio.run(asyncio.wait_for(run(), 60.0)) for pair in client]
    assert len(results) == CLIENTS * PER_CLIENT
    wrong = [(token, ids) for token, ids in results if not ids or set(ids) != {token}]
    assert wrong == []


def test_close_delimited_response_is_relayed_whole(gw: Gateway) -> None:
    for i in range(3):
        r = httpx.post(gw.url + "/v1/chat/completions", content=_body(f"t{i}", False), timeout=20.0,
                       headers={"content-type": "application/json", "x-request-token": f"t{i}",
                                "x-raw-mode": "close"})
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["id"] == f"t{i}" and doc["pad"] == "x" * 200_000
        assert r.headers["content-length"] == str(len(r.content))
