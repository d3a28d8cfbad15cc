"""The callbacks path (gateway/callback_path.py), over real processes: a small whole-answer
request routed and sent from the connection's callbacks keeps every bound and outcome of
the task path. Each test reads ``kvgate_callback_path_requests_total`` to know which path
the request took, so a test of the callbacks path cannot pass on the task path."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import Gateway, wait_until
from tests.safety.raw_replica import RawFleet, raw_gateway

pytestmark = pytest.mark.safety
TOTAL_TIMEOUT_S = 2.0
CHAT = "/v1/chat/completions"


def _count(gw: Gateway, status: int) -> float:
    found = re.search(rf'kvgate_requests_total\{{endpoint="chat",status="{status}"\}} (\S+)', gw.metrics())
    return float(found.group(1)) if found else 0.0


def _body(content: str = "hello", **extra: object) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": content}],
                       **extra}).encode()


def _post(client: httpx.Client, gw: Gateway, mode: str = "echo", body: bytes | None = None) -> httpx.Response:
    token = uuid.uuid4().hex
    r = client.post(gw.url + CHAT, content=body or _body(), headers={
        "content-type": "application/json", "x-raw-mode": mode, "x-request-token": token})
    if r.status_code == 200 and mode == "echo" and not body:
        assert r.json()["id"] == token  # this request's own answer
    return r


def _warm(gw: Gateway, client: httpx.Client) -> dict[str, float]:
    """A request leaves an idle upstream connection behind (the next can go on callbacks);
    the path's counts after it."""
    assert _post(client, gw).status_code == 200
    return gw.callback_outcomes()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RawFleet, Gateway]]:
    with raw_gateway(tmp_path_factory.mktemp("callbacks"), "--set", f"upstream.total_timeout_s={TOTAL_TIMEOUT_S}") \
            as pair:
        yield pair


def test_small_whole_answers_are_answered_on_callbacks_each_to_its_own_request(
        setup: tuple[RawFleet, Gateway]) -> None:
    _, gw = setup
    with httpx.Client(timeout=10.0) as client:
        before = _warm(gw, client)
        for _ in range(10):
            r = _post(client, gw)
            assert r.status_code == 200
            assert r.headers["x-kvgate-replica"] and r.headers["x-kvgate-route-reason"]
    assert gw.callback_outcomes()["answered"] - before["answered"] == 10
    gw.assert_quiet()


def test_streams_large_bodies_and_expect_continue_go_the_task_path(setup: tuple[RawFleet, Gateway]) -> None:
    _, gw = setup
    with httpx.Client(timeout=10.0) as client:
        before = _warm(gw, client)
        with client.stream("POST", gw.url + CHAT, content=_body(stream=True),
                           headers={"content-type": "application/json"}) as r:
            assert r.status_code == 200 and b"[DONE]" in r.read()
        assert _post(client, gw, body=_body("x" * 100_000)).status_code == 200
    host, port = gw.url.removeprefix("http://").split(":")
    body = _body()
    with socket.create_connection((host, int(port)), timeout=10.0) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\nexpect: 100-continue\r\n"
                     b"content-length: %d\r\n\r\n" % (CHAT.encode(), len(body)))
        assert sock.recv(4096).startswith(b"HTTP/1.1 100 ")  # asked for, before the body is sent
        sock.sendall(body)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
    assert gw.callback_outcomes() == before  # none of the three was taken


@pytest.mark.parametrize("mode", ["split", "close"])
def test_a_whole_answer_whose_body_comes_after_its_head_is_answered_on_callbacks(
        setup: tuple[RawFleet, Gateway], mode: str) -> None:
    """``split``: the head, then the body (with its length) 5 ms later, as uvicorn-served
    replicas (SGLang) write an answer; ``close``: a close-delimited body in pieces."""
    _, gw = setup
    with httpx.Client(timeout=10.0) as client:
        before = _warm(gw, client)
        token = uuid.uuid4().hex
        r = client.post(gw.url + CHAT, content=_body(), headers={
            "content-type": "application/json", "x-raw-mode": mode, "x-request-token": token})
    assert r.status_code == 200 and r.json()["id"] == token
    after = gw.callback_outcomes()
    assert after["answered"] - before["answered"] == 1
    assert after["handed_over"] == before["handed_over"]
    gw.assert_quiet()


def test_an_answer_past_the_read_bound_is_handed_to_the_task_whole(setup: tuple[RawFleet, Gateway]) -> None:
    """``large_split``: a body past ``PAUSE_BYTES`` (1 MiB) stops being read until a puller
    takes it: the task does, and relays it whole. (~3 MB: one read is at most 256 KiB, so
    the answer cannot end in the read that pauses it.)"""
    _, gw = setup
    with httpx.Client(timeout=10.0) as client:
        before = _warm(gw, client)
        token = uuid.uuid4().hex
        r = client.post(gw.url + CHAT, content=_body(), headers={
            "content-type": "application/json", "x-raw-mode": "large_split", "x-request-token": token})
    assert r.status_code == 200 and r.json()["id"] == token and len(r.json()["pad"]) == 3_000_000
    assert gw.callback_outcomes()["handed_over"] - before["handed_over"] == 1
    gw.assert_quiet()


def test_a_failing_answer_is_judged_by_the_task_path(setup: tuple[RawFleet, Gateway]) -> None:
    """``poison``: a 500 for that body; with no second replica to ask, it is relayed as it is."""
    from tests.safety.raw_replica import POISON

    _, gw = setup
    with httpx.Client(timeout=10.0) as client:
        before = _warm(gw, client)
        r = client.post(gw.url + CHAT, content=POISON,
                        headers={"content-type": "application/json", "x-raw-mode": "poison"})
    assert r.status_code == 500
    assert gw.callback_outcomes()["handed_over"] - before["handed_over"] == 1


@pytest.mark.parametrize("mode", ["hang", "half_body"])
def test_no_whole_answer_within_the_total_timeout_is_504_and_closed_upstream(
        setup: tuple[RawFleet, Gateway], mode: str) -> None:
    """``hang``: no answer at all; ``half_body``: its head and half its body, then nothing."""
    fleet, gw = setup
    with httpx.Client(timeout=10.0) as client:
        _warm(gw, client)
        before, gone = gw.callback_outcomes(), fleet.stats(0)["disconnects"]
        started = time.monotonic()
        r = _post(client, gw, mode)
        waited = time.monotonic() - started
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    assert waited >= TOTAL_TIMEOUT_S * 0.9
    assert gw.callback_outcomes()["handed_over"] - before["handed_over"] == 1
    wait_until(lambda: fleet.stats(0)["disconnects"] - gone == 1, 10.0, "the replica sees the request closed")
    wait_until(lambda: all(v["in_flight"] == 0 for v in gw.replicas().values()), 10.0, "the load released")


@pytest.mark.parametrize("mode", ["hang", "half_body"])
def test_a_client_that_leaves_closes_the_upstream_request_and_counts_499(
        setup: tuple[RawFleet, Gateway], mode: str) -> None:
    """``hang``: before the answer's head; ``half_body``: between its head and its end."""
    fleet, gw = setup
    with httpx.Client(timeout=10.0) as client:
        _warm(gw, client)
    before, gone, counted = gw.callback_outcomes(), fleet.stats(0)["disconnects"], _count(gw, 499)

    async def leave() -> None:
        async with httpx.AsyncClient(timeout=10.0) as client:
            await client.post(gw.url + CHAT, content=_body(), headers={"content-type": "application/json"})
            with pytest.raises(httpx.TimeoutException):  # (the warm connection: on callbacks)
                await client.post(gw.url + CHAT, content=_body(), timeout=0.5,
                                  headers={"content-type": "application/json", "x-raw-mode": mode})

    asyncio.run(leave())
    wait_until(lambda: fleet.stats(0)["disconnects"] - gone == 1, 10.0, "the replica sees the client leave")
    wait_until(lambda: _count(gw, 499) - counted == 1, 10.0, "the 499 counted")
    assert gw.callback_outcomes()["client_left"] - before["client_left"] == 1
    wait_until(lambda: all(v["in_flight"] == 0 for v in gw.replicas().values()), 10.0, "the load released")
    gw.assert_quiet()


def test_pipelined_requests_get_their_own_answers_in_order(setup: tuple[RawFleet, Gateway]) -> None:
    _, gw = setup
    host, port = gw.url.removeprefix("http://").split(":")
    tokens = [uuid.uuid4().hex for _ in range(4)]

    def request(token: str) -> bytes:
        body = _body(token)
        return (b"POST %s HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\nx-request-token: %s\r\n"
                b"content-length: %d\r\n\r\n%s" % (CHAT.encode(), token.encode(), len(body), body))

    before = gw.callback_outcomes()
    with socket.create_connection((host, int(port)), timeout=10.0) as sock:
        sock.sendall(request(tokens[0]))  # answered alone first: its upstream connection is then idle
        data = b""
        while b"chat.completion" not in data:
            data += sock.recv(65536)
        sock.sendall(b"".join(request(t) for t in tokens[1:]))
        while data.count(b"chat.completion") < len(tokens):
            chunk = sock.recv(65536)
            assert chunk, "connection closed early"
            data += chunk
    ids = [json.loads(part[part.index(b"{"):])["id"] for part in data.split(b"HTTP/1.1 ")[1:]]
    assert ids == tokens
    assert gw.callback_outcomes()["answered"] > before["answered"]


def _collected(gw: Gateway) -> float:
    """Objects the gateway's garbage collector found unreachable so far (every generation)."""
    return sum(float(v) for v in re.findall(r'python_gc_objects_collected_total\{generation="\d"\} (\S+)',
                                           gw.metrics()))


def test_requests_leave_no_cyclic_garbage(setup: tuple[RawFleet, Gateway]) -> None:
    """A request's objects are freed by reference counting when it ends: a cycle a request
    left behind (its scope, cycle and writer naming each other did) would be found by the
    collector, and each collection of them is a pause on some request's path. With k such
    objects a request, 600 requests set off a young collection every 700/k requests, each
    finding ~700: so fewer than 600 found in all means less than one a request."""
    _, gw = setup
    with httpx.Client(timeout=10.0) as client:
        _warm(gw, client)
        before, taken = _collected(gw), gw.callback_outcomes()
        for i in range(600):
            assert _post(client, gw, ("echo", "split")[i % 2]).status_code == 200
        with client.stream("POST", gw.url + CHAT, content=_body(stream=True),
                           headers={"content-type": "application/json"}) as r:  # (and the task path)
            assert r.status_code == 200 and b"[DONE]" in r.read()
        found = _collected(gw) - before
    assert gw.callback_outcomes()["answered"] - taken["answered"] == 600
    assert found < 600, f"{found:.0f} objects of cycles left by 600 requests"


def test_the_switch_turns_it_off(tmp_path: Path) -> None:
    with raw_gateway(tmp_path, "--set", "server.callback_path=false") as (_, gw), \
            httpx.Client(timeout=10.0) as client:
        for _ in range(5):
            assert _post(client, gw).status_code == 200
        assert sum(gw.callback_outcomes().values()) == 0


def test_a_request_on_callbacks_at_the_end_of_the_shutdown_grace_gets_503(tmp_path: Path) -> None:
    answer: list[httpx.Response] = []
    with raw_gateway(tmp_path, "--set", "server.shutdown_grace_s=1") as (fleet, gw), \
            httpx.Client(timeout=15.0) as client:
        assert _warm(gw, client)["cut"] == 0

        def hang() -> None:
            answer.append(client.post(gw.url + CHAT, content=_body(), headers={
                "content-type": "application/json", "x-raw-mode": "hang"}))

        thread = threading.Thread(target=hang)
        thread.start()
        wait_until(lambda: fleet.stats(0)["requests"] >= 2, 10.0, "the request reached the replica")
        gw.proc.signal(signal.SIGTERM)
        thread.join(15.0)
        gw.proc.popen.wait(15.0)
        log = gw.proc.output()
    assert answer and answer[0].status_code == 503
    assert answer[0].headers["retry-after"] == "1"
    assert answer[0].json()["error"]["type"] == "server_shutdown"
    assert "cutting 1 request(s) (1 on the callbacks path)" in log
    assert "Traceback" not in log
