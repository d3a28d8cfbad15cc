"""Unit tests of the proxy's pure parts and of the stream cleanup guarantees."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest
from starlette.types import Message

from gateway.proxy import RelayResponse, UsageSniffer, sse_error, upstream_headers, usage_of

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
    assert upstream_headers(raw) == [(b"x-session-id", b"s1"), (b"authorization", b"Bearer k")]


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
