"""Unit tests of the proxy's pure parts and of the cleanup guarantees of streamed and buffered answers."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from starlette.types import Message

from gateway.bodies import header_map
from gateway.relay import (
    AnsweredResponse,
    HeaderPolicy,
    RelayResponse,
    UsageSniffer,
    downstream_headers,
    sse_error,
    upstream_headers,
    usage_of,
)
from gateway.retry import PoisonBodies, RetryBudget
from tests.gateway.test_app_unit import CHAT, fake_fleet, gateway, ok_completion, settings_for
from tests.support.fake_replicas import FakeFleet, Handler, json_reply, refuse

USAGE_LINE = (b'data: {"id":"a","choices":[],"usage":{"prompt_tokens":1200,"total_tokens":1257,'
              b'"completion_tokens":57,"prompt_tokens_details":{"cached_tokens":1024}}}\n\n')
STREAM = (b'data: {"id":"a","choices":[{"index":0,"delta":{"content":"Hi"}}],"usage":null}\n\n'
          + USAGE_LINE + b"data: [DONE]\n\n")


@pytest.mark.parametrize("cut", [1, 7, 40, 90, 150, len(STREAM) - 3])
def test_usage_sniffer_survives_any_chunking(cut: int) -> None:
    sniffer = UsageSniffer()
    sniffer.feed(STREAM[:cut])
    sniffer.feed(STREAM[cut:])
    assert sniffer.usage() == (1200, 1024, 57)


def test_usage_sniffer_byte_by_byte_and_null_usage() -> None:
    sniffer = UsageSniffer()
    for i in range(len(STREAM)):
        sniffer.feed(STREAM[i:i + 1])
    assert sniffer.usage() == (1200, 1024, 57)
    only_null = UsageSniffer()
    only_null.feed(b'data: {"choices":[],"usage":null}\n\ndata: [DONE]\n\n')
    assert only_null.usage() == (None, None, None)


def test_usage_of_openai_and_generate() -> None:
    assert usage_of(orjson.loads(USAGE_LINE[6:])) == (1200, 1024, 57)
    generate = {"text": "x", "meta_info": {"prompt_tokens": 10, "cached_tokens": 8, "completion_tokens": 2}}
    assert usage_of(generate) == (10, 8, 2)
    assert usage_of({"usage": {"prompt_tokens": 5, "prompt_tokens_details": None}}) == (5, None, None)
    assert usage_of([1, 2]) == (None, None, None)
    assert usage_of({"usage": {"prompt_tokens": "12", "completion_tokens": -1}}) == (None, None, None)


def test_upstream_headers_drop_hop_by_hop_only() -> None:
    raw = [(b"host", b"gw"), (b"content-length", b"3"), (b"connection", b"keep-alive"),
           (b"Transfer-Encoding", b"chunked"), (b"x-session-id", b"s1"), (b"authorization", b"Bearer k")]
    assert upstream_headers(raw) == [(b"x-session-id", b"s1"), (b"x-forwarded-proto", b"http"),
                                     (b"x-forwarded-host", b"gw")]


def test_upstream_headers_hygiene() -> None:
    raw = [(b"Connection", b"keep-alive, X-Secret-Hop"), (b"x-secret-hop", b"1"), (b"Expect", b"100-continue"),
           (b"Proxy-Authorization", b"Basic x"), (b"proxy-foo", b"1"), (b"X-KVGate-Replica", b"http://evil"),
           (b"x-forwarded-for", b"10.0.0.1"), (b"X-Forwarded-Proto", b"https"), (b"authorization", b"Bearer c"),
           (b"x-keep", b"yes")]
    out = upstream_headers(raw, HeaderPolicy(), client="127.0.0.9")
    assert out == [(b"X-Forwarded-Proto", b"https"), (b"x-keep", b"yes"),
                   (b"x-forwarded-for", b"10.0.0.1, 127.0.0.9")]
    forwarded = upstream_headers(raw, HeaderPolicy(forward_authorization=True))
    assert (b"authorization", b"Bearer c") in forwarded
    keyed = upstream_headers(raw, HeaderPolicy(True, b"Bearer replica-key"))
    assert [v for k, v in keyed if k.lower() == b"authorization"] == [b"Bearer replica-key"]


def test_downstream_headers_drop_hop_by_hop_and_own_names() -> None:
    raw = [(b"connection", b"close, x-hop"), (b"x-hop", b"1"), (b"keep-alive", b"timeout=5"), (b"date", b"d"),
           (b"x-kvgate-replica", b"spoof"), (b"content-type", b"application/json"), (b"x-ok", b"1")]
    assert downstream_headers(raw) == [(b"content-type", b"application/json"), (b"x-ok", b"1")]


def test_sse_error_is_an_event_then_done() -> None:
    events = sse_error("boom").split(b"\n\n")
    assert orjson.loads(events[0][6:])["error"]["message"] == "boom"
    assert events[1] == b"data: [DONE]"


async def _cleanup_runs(disconnect_after: int) -> tuple[list[bytes], bool]:
    closed = asyncio.Event()
    sent: list[bytes] = []

    async def body() -> AsyncIterator[bytes]:
        for i in range(1000):
            yield b"data: %d\n\n" % i
            await asyncio.sleep(0)

    async def on_close() -> None:
        await asyncio.sleep(0)  # cleanup may await (index hooks) even when cancelled
        closed.set()

    receive_calls = 0

    async def receive() -> Message:
        nonlocal receive_calls
        receive_calls += 1
        if receive_calls == 1:
            return {"type": "http.request", "body": b"", "more_body": False}
        while len(sent) < disconnect_after:
            await asyncio.sleep(0)
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            sent.append(message["body"])

    response = RelayResponse(body(), 200, {"x-kvgate-replica": "r"}, on_close)
    await receive()  # the app consumed the request body before answering
    await asyncio.wait_for(response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send), 5.0)
    return sent, closed.is_set()


async def test_relay_cleanup_runs_on_client_disconnect() -> None:
    sent, closed = await _cleanup_runs(disconnect_after=3)
    assert closed and 3 <= len(sent) < 1000


async def test_relay_cleanup_runs_on_completion() -> None:
    sent, closed = await _cleanup_runs(disconnect_after=10_000)
    assert closed and len(sent) == 1000


# -- a buffered answer: sent first, its bookkeeping after, always -----------------------------
def _answered(order: list[str]) -> AnsweredResponse:
    async def on_close() -> None:
        await asyncio.sleep(0)  # the bookkeeping may await (index hooks)
        order.append("closed")

    return AnsweredResponse(b'{"ok":1}', 200, [(b"content-type", b"application/json")], on_close)


async def _no_receive() -> Message:
    raise AssertionError("a whole answer does not read the request")


async def test_answered_response_sends_then_runs_its_bookkeeping() -> None:
    order: list[str] = []

    async def send(message: Message) -> None:
        order.append(message["type"])
        if message["type"] == "http.response.start":
            assert (b"content-length", b"8") in message["headers"]

    await _answered(order)({"type": "http"}, _no_receive, send)
    assert order == ["http.response.start", "http.response.body", "closed"]


@pytest.mark.parametrize("failure", [OSError("client gone"), asyncio.CancelledError()])
async def test_answered_response_runs_its_bookkeeping_when_the_send_fails(failure: BaseException) -> None:
    order: list[str] = []

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            raise failure

    with pytest.raises(type(failure)):
        await _answered(order)({"type": "http"}, _no_receive, send)
    assert order == ["closed"]


async def test_an_abandoned_answer_runs_its_bookkeeping() -> None:
    order: list[str] = []
    await _answered(order).abandon()
    assert order == ["closed"]


def test_header_map_keeps_the_first_value_of_a_name() -> None:
    raw = [(b"x-session-id", b"a"), (b"Content-Type", b"application/json"), (b"x-session-id", b"b")]
    assert header_map(raw) == {"x-session-id": "a", "content-type": "application/json"}


# -- retry semantics over fake replicas (real loopback HTTP through AiohttpUpstream) ---------
A3, B3, C3 = "A3", "B3", "C3"  # replica names: ``fleet.url(A3)`` is the address


def _status(status: int) -> Handler:
    return json_reply(status, {"object": "error", "message": f"status {status}"})


async def _post_n(fleet: FakeFleet, n: int, body: bytes = CHAT) -> tuple[list[httpx.Response], dict[str, Any]]:
    async with gateway(fleet, settings_for(fleet.urls(A3, B3, C3))) as client:
        replies = [await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
                   for _ in range(n)]
        views = {fleet.name_of(v["url"]): v for v in (await client.get("/admin/replicas")).json()["data"]}
        metrics = (await client.get("/metrics")).text
    return replies, {"views": views, "metrics": metrics}


async def test_a_5xx_another_replica_answers_blames_the_first() -> None:
    fleet = fake_fleet({A3: _status(500), B3: ok_completion, C3: ok_completion})
    replies, seen = await _post_n(fleet, 15)
    assert all(r.status_code == 200 for r in replies)
    assert seen["views"][A3]["ejected"] and not seen["views"][B3]["ejected"]
    assert 'kvgate_upstream_retries_total{reason="status_5xx"}' in seen["metrics"]
    assert f'kvgate_replica_ejections_total{{reason="consecutive",replica="{fleet.url(A3)}"}} 1.0' \
        in seen["metrics"]


async def test_a_5xx_from_two_replicas_is_the_request_s_own() -> None:
    fleet = fake_fleet({A3: _status(500), B3: _status(500), C3: _status(500)})
    replies, seen = await _post_n(fleet, 12)
    assert [r.status_code for r in replies] == [500] * 12
    assert replies[0].json() == {"object": "error", "message": "status 500"}  # relayed as it is
    assert len(fleet.seen) == 13  # the first copy got a second opinion, the others no retry
    assert not any(v["ejected"] for v in seen["views"].values())
    assert 'kvgate_upstream_retries_total{reason="status_5xx"} 1.0' in seen["metrics"]


async def test_overload_is_retried_and_blames_nobody() -> None:
    fleet = fake_fleet({A3: _status(503), B3: _status(429), C3: ok_completion})
    replies, seen = await _post_n(fleet, 12)
    assert all(r.status_code == 200 and r.headers["x-kvgate-replica"] == fleet.url(C3) for r in replies)
    assert not any(v["ejected"] for v in seen["views"].values())
    assert 'kvgate_upstream_retries_total{reason="head_timeout"} 0.0' in seen["metrics"]  # pre-created
    assert "kvgate_retry_budget_exhausted_total 0.0" in seen["metrics"]


def test_retry_budget_and_poison_bodies() -> None:
    budget = RetryBudget(ratio=0.2, minimum=3)
    budget.requests = 10
    assert [budget.try_acquire() for _ in range(4)] == [True, True, True, False]
    budget.requests = 50
    assert budget.try_acquire()  # 20 % of 50 = 10
    budget.release()
    now = [0.0]
    poison = PoisonBodies(ttl_s=60.0, max_entries=2, clock=lambda: now[0])
    for body in (b"a", b"b", b"c"):
        poison.add(poison.fingerprint(body))
    assert poison.fingerprint(b"a") not in poison  # evicted (LRU bound)
    assert poison.fingerprint(b"c") in poison
    now[0] = 61.0
    assert poison.fingerprint(b"c") not in poison  # expired


async def test_spent_retry_budget_returns_the_first_error() -> None:
    fleet = fake_fleet({A3: _status(503), B3: _status(503), C3: _status(503)})
    s = settings_for(fleet.urls(A3, B3, C3), upstream={"retry_budget_min": 0, "retry_budget_ratio": 0.0})
    async with gateway(fleet, s) as client:
        r = await client.post("/v1/chat/completions", content=CHAT, headers={"content-type": "application/json"})
        metrics = (await client.get("/metrics")).text
    assert r.status_code == 503  # the replica's own answer, relayed
    assert len(fleet.seen) == 1  # one attempt, no retry
    assert "kvgate_retry_budget_exhausted_total 1.0" in metrics


async def test_refused_connection_is_retried_outside_the_budget() -> None:
    """Nothing was sent, so the retry adds no work: even a spent budget does not stop it
    (a replica that dies under load must not fail the requests about to reach it)."""
    fleet = fake_fleet({A3: refuse, B3: refuse, C3: ok_completion})
    s = settings_for(fleet.urls(A3, B3, C3), upstream={"retry_budget_min": 0, "retry_budget_ratio": 0.0})
    async with gateway(fleet, s) as client:
        rs = [await client.post("/v1/chat/completions", content=CHAT, headers={"content-type": "application/json"})
              for _ in range(3)]
        metrics = (await client.get("/metrics")).text
    assert [r.status_code for r in rs] == [200, 200, 200]
    assert {r.headers["x-kvgate-replica"] for r in rs} == {fleet.url(C3)}
    assert "kvgate_retry_budget_exhausted_total 0.0" in metrics
