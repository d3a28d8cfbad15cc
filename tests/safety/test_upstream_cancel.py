"""Clients that leave: the upstream request is cancelled (the replica sees the disconnect),
the request is counted as 499, nothing is logged as an error."""
from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.conftest import Gateway, wait_until
from tests.safety.raw_replica import RawFleet, raw_gateway

pytestmark = pytest.mark.safety
ABANDONED = 6  # of each kind: non-streaming, streaming


def _count_499(gw: Gateway) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=5.0).text
    found = re.findall(r'kvgate_requests_total\{endpoint="chat",model="[^"]*",status="499"\} (\S+)', text)
    return sum(float(n) for n in found)


async def _abandon(url: str, i: int) -> None:
    body = json.dumps({"model": "m", "stream": i % 2 == 1, "messages": [{"role": "user", "content": f"q{i}"}]})
    async with httpx.AsyncClient(timeout=0.5) as client:
        with pytest.raises(httpx.TimeoutException):
            await client.post(url + "/v1/chat/completions", content=body,
                              headers={"content-type": "application/json", "x-raw-mode": "hang"})


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RawFleet, Gateway]]:
    with raw_gateway(tmp_path_factory.mktemp("cancel")) as pair:
        yield pair


def test_abandoned_requests_are_cancelled_upstream_and_counted_499(setup: tuple[RawFleet, Gateway]) -> None:
    fleet, gw = setup
    gone, counted = fleet.stats(0)["disconnects"], _count_499(gw)

    async def run() -> None:
        await asyncio.gather(*(_abandon(gw.url, i) for i in range(2 * ABANDONED)))

    asyncio.run(asyncio.wait_for(run(), 20.0))
    wait_until(lambda: fleet.stats(0)["disconnects"] - gone == 2 * ABANDONED, 10.0,
               "the replica sees every client leave")
    wait_until(lambda: _count_499(gw) - counted == 2 * ABANDONED, 10.0, "499s counted")
    assert all(v["in_flight"] == 0 for v in gw.replicas().values())
    gw.assert_quiet()


def test_client_leaving_during_upload_is_a_quiet_499(setup: tuple[RawFleet, Gateway]) -> None:
    fleet, gw = setup
    sent, counted = fleet.stats(0)["requests"], _count_499(gw)
    host, port = gw.url.removeprefix("http://").split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=5.0) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                         b"content-length: 100000\r\n\r\n{\"model\": \"m\", \"messa")
    wait_until(lambda: _count_499(gw) - counted == 3, 10.0, "499s counted")
    assert fleet.stats(0)["requests"] == sent  # nothing reached the replica
    gw.assert_quiet()


@pytest.mark.xfail(strict=True, reason="Granian 2.8 (hyper) does not tell the request in progress that a "
                   "pipelining client closed (its receive() never returns http.disconnect while the next "
                   "request waits in the buffer): the replica's request runs to its end or to "
                   "upstream.total_timeout_s (docs/safety.md, Known gaps)")
def test_a_pipelining_client_that_leaves_cancels_the_request_in_progress(setup: tuple[RawFleet, Gateway]) -> None:
    """Two requests pipelined on one connection, the first held by the replica: the client
    closes. The first must be cancelled upstream too instead of holding its replica until
    a timeout."""
    fleet, gw = setup
    sent, gone, counted = fleet.stats(0)["requests"], fleet.stats(0)["disconnects"], _count_499(gw)
    host, port = gw.url.removeprefix("http://").split(":")
    body = b'{"model": "m", "messages": [{"role": "user", "content": "pipelined"}]}'
    one = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
           b"x-raw-mode: hang\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    with socket.create_connection((host, int(port)), timeout=5.0) as sock:
        sock.sendall(one + one)
        wait_until(lambda: fleet.stats(0)["requests"] - sent == 1, 10.0, "the first request reaches the replica")
    wait_until(lambda: fleet.stats(0)["disconnects"] - gone == 1, 10.0, "the replica sees the client leave")
    wait_until(lambda: _count_499(gw) - counted >= 1, 10.0, "the abandoned request counted 499")
    wait_until(lambda: all(v["in_flight"] == 0 for v in gw.replicas().values()), 10.0, "no load held")
    assert fleet.stats(0)["requests"] - sent == 1  # the second never started
    gw.assert_quiet()
