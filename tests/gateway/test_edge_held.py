"""``EdgeProtocol``'s held requests (gateway/edge.py, ``HeldCycle``) over a stub transport:
which requests are held, and a held request that goes to its ASGI task gets the scope,
body and cycle uvicorn's own protocol gives the same bytes."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.edge import DEFER_MAX_BYTES, Edge, EdgeProtocol, EdgeServerState, HeldCycle
from gateway.push_relay import PUSH_EXTENSION, ChunkWriter
from gateway.settings import Settings

CHAT = b"/v1/chat/completions"


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.out.append(bytes(data))

    def writelines(self, data: Any) -> None:
        self.out.append(b"".join(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5555)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Taker:
    """The callbacks path's part: takes what ``take`` says, records what it was offered."""

    flights: tuple[()] = ()
    urls = frozenset({CHAT})

    def __init__(self, take: bool) -> None:
        self.taking = take
        self.offered: list[tuple[HeldCycle, ChunkWriter, Callable[[dict[str, object]], None]]] = []

    def take(self, edge: Edge, held: HeldCycle, writer: ChunkWriter,
             start_task: Callable[[dict[str, object]], None]) -> bool:
        self.offered.append((held, writer, start_task))
        return self.taking


Seen = list[tuple[dict[str, Any], list[dict[str, Any]]]]


def recording_app(seen: Seen) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        messages = [await receive()]
        while messages[-1].get("more_body"):
            messages.append(await receive())
        seen.append(({**scope, "extensions": dict(scope.get("extensions") or {})}, messages))  # (as it was:
        # the writer leaves the scope when the response is complete)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
    return app


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def protocol(loop: asyncio.AbstractEventLoop, seen: Seen, taker: Taker | None, ours: bool = True
             ) -> tuple[HttpToolsProtocol, Transport]:
    config = Config(recording_app(seen), http="httptools", loop="none", lifespan="off")
    config.load()
    if ours:
        edge = Edge(Settings().server, 100)
        edge.callbacks = taker
        proto: HttpToolsProtocol = EdgeProtocol(config, EdgeServerState(edge), {}, loop)
    else:
        proto = HttpToolsProtocol(config, ServerState(), {}, loop)
    transport = Transport()
    proto.connection_made(transport)
    return proto, transport


def request(path: bytes = CHAT, body: bytes = b'{"model":"m"}', extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    return (b"POST %s HTTP/%s\r\nHost: x\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s"
            % (path, version, extra, len(body), body))


def settle(loop: asyncio.AbstractEventLoop) -> None:
    loop.run_until_complete(asyncio.sleep(0.01))


def without_extensions(scope: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in scope.items() if k != "extensions"}


@pytest.mark.parametrize("version", [b"1.1", b"1.0"])
def test_a_held_request_sent_to_its_task_gets_uvicorns_scope_and_body(loop: asyncio.AbstractEventLoop,
                                                                      version: bytes) -> None:
    data = request(version=version)
    ref_seen: Seen = []
    ref, _ = protocol(loop, ref_seen, None, ours=False)
    ref.data_received(data)
    settle(loop)
    seen: Seen = []
    taker = Taker(take=False)
    proto, transport = protocol(loop, seen, taker)
    proto.data_received(data)
    assert len(taker.offered) == 1  # held, offered, refused: its task started
    settle(loop)
    (scope, messages), = seen
    (ref_scope, ref_messages), = ref_seen
    assert without_extensions(scope) == without_extensions(ref_scope)
    assert messages == ref_messages
    held, writer, _ = taker.offered[0]
    assert scope["extensions"][PUSH_EXTENSION] is writer and writer.cycle is not held  # uvicorn's cycle now
    assert writer.cycle.keep_alive == (version == b"1.1")
    assert transport.out and transport.out[-1].endswith(b"ok")


def test_a_hand_over_passes_its_extensions_to_the_task(loop: asyncio.AbstractEventLoop) -> None:
    seen: Seen = []
    taker = Taker(take=True)
    proto, _ = protocol(loop, seen, taker)
    proto.data_received(request())
    settle(loop)
    assert seen == []  # taken: no task
    _, _, start_task = taker.offered[0]
    start_task({"kvgate.resume": "begun"})
    settle(loop)
    (scope, messages), = seen
    assert scope["extensions"]["kvgate.resume"] == "begun" and PUSH_EXTENSION in scope["extensions"]
    assert messages == [{"type": "http.request", "body": b'{"model":"m"}', "more_body": False}]


@pytest.mark.parametrize("data", [
    request(path=CHAT + b"?x=1"),  # a query: uvicorn's path
    request(extra=b"Expect: 100-continue\r\n"),
    b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n",
    request(path=b"/v1/models"),
])
def test_only_a_post_to_a_target_exactly_is_held(loop: asyncio.AbstractEventLoop, data: bytes) -> None:
    seen: Seen = []
    taker = Taker(take=True)
    proto, _ = protocol(loop, seen, taker)
    proto.data_received(data)
    settle(loop)
    assert taker.offered == [] and len(seen) == 1


def test_a_request_pipelined_behind_a_held_one_waits_for_its_answer(loop: asyncio.AbstractEventLoop) -> None:
    seen: Seen = []
    taker = Taker(take=True)
    proto, transport = protocol(loop, seen, taker)
    proto.data_received(request(body=b'{"n":1}') + request(body=b'{"n":2}'))
    settle(loop)
    assert len(taker.offered) == 1 and seen == []  # the second is queued behind the first's answer
    _, writer, _ = taker.offered[0]
    assert writer.answer(200, [(b"content-length", b"1")], b"1")
    settle(loop)
    (_, messages), = seen  # the second went the task path, after the first's answer
    assert messages[0]["body"] == b'{"n":2}'
    assert transport.out[0].startswith(b"HTTP/1.1 200") and transport.out[0].endswith(b"1")


def test_a_large_body_starts_the_task_which_reads_it_all(loop: asyncio.AbstractEventLoop) -> None:
    seen: Seen = []
    taker = Taker(take=True)
    proto, _ = protocol(loop, seen, taker)
    body = b"x" * (DEFER_MAX_BYTES + 10)
    data = request(body=body)
    half = len(data) - 5000
    proto.data_received(data[:half])
    proto.data_received(data[half:])
    settle(loop)
    assert taker.offered == []
    (_, messages), = seen
    assert b"".join(m["body"] for m in messages) == body


def test_a_client_gone_mid_body_starts_the_task_with_the_disconnect(loop: asyncio.AbstractEventLoop) -> None:
    seen: Seen = []
    received: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        received.append(await receive())
    config = Config(app, http="httptools", loop="none", lifespan="off")
    config.load()
    edge = Edge(Settings().server, 100)
    edge.callbacks = Taker(take=True)
    proto = EdgeProtocol(config, EdgeServerState(edge), {}, loop)
    proto.connection_made(Transport())
    data = request(body=b"x" * 100)
    proto.data_received(data[:-50])
    assert proto.held is not None
    proto.connection_lost(None)
    settle(loop)
    assert received == [{"type": "http.disconnect"}] and seen == []
