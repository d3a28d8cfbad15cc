"""The floor of a Python HTTP gateway: a pass-through proxy, measured beside kvgate.

`kvgate bench peers --overhead` can run this as its target ``python-floor``: uvicorn on
uvloop with httptools (kvgate's server stack), a bare ASGI app and one ``aiohttp``
session (kvgate's client), forwarding every POST's body to a replica and relaying the
answer chunk by chunk. The replica: a hash of the session's ``x-claude-code-session-id``
header when there is one (the same session, the same replica, so `kvgate bench peers`
can run it in front of a fleet), else the next in turn. No parsing, no routing beyond
that, no index, no safety (no deadlines, no body cap, no retries): the cost that remains
when a Python gateway does nothing but pass bytes on this stack. The difference between
kvgate and this row is what kvgate's own work costs.

Not a product: it exists only to be measured.

``python-floor-granian`` (target) serves the same app with Granian, a Rust HTTP server
(ASGI interface, uvloop, HTTP/1 only), in place of uvicorn: what a compiled server under
the same Python app and client saves. ``python-floor-rsgi`` serves `RSGIPassThrough`, the same
proxy on Granian's native RSGI interface (docs/benchmarks.md, "HTTP server and upstream
client": why kvgate stays on ASGI).

    python -m loadtest.peers.python_floor --port 31900 --replica http://127.0.0.1:31001 [--replica ...]
    KVGATE_FLOOR_REPLICA=http://127.0.0.1:31001[,...] granian --interface asgi --port 31900 \
        --loop uvloop --http 1 --no-ws --factory loadtest.peers.python_floor:from_env
    KVGATE_FLOOR_REPLICA=... granian --interface rsgi ... --factory loadtest.peers.python_floor:rsgi_from_env
"""
from __future__ import annotations

import argparse
import itertools
import os
import zlib
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any, Generic, TypeVar

import aiohttp
import uvicorn
from multidict import CIMultiDict

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
HOP = frozenset({b"host", b"content-length", b"transfer-encoding", b"connection", b"keep-alive"})
SESSION_HEADER = b"x-claude-code-session-id"
T = TypeVar("T")


class Replicas(Generic[T]):
    """Which replica a request goes to: by a hash of its session id, else in turn."""

    def __init__(self, replicas: Sequence[T]) -> None:
        self.replicas = list(replicas)
        self.turn = itertools.cycle(self.replicas)

    def pick(self, session: bytes) -> T:
        return self.replicas[zlib.crc32(session) % len(self.replicas)] if session else next(self.turn)


class FloorApp:
    """An ASGI pass-through's frame: the lifespan (``start``, ``stop``), ``/health`` and
    ``/ready`` answered here, and every other request's body read whole for ``forward``."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["path"] in ("/health", "/ready"):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        await self.forward(scope, b"".join(parts), send)

    async def forward(self, scope: Scope, body: bytes, send: Send) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        """At the lifespan's start-up."""

    async def stop(self) -> None:
        """At the lifespan's shutdown."""

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return


class PassThrough(FloorApp):
    """Every request goes to a replica through one ``aiohttp`` session."""

    def __init__(self, replicas: Sequence[str]) -> None:
        self.replicas = Replicas([r.rstrip("/") for r in replicas])
        self.session: aiohttp.ClientSession | None = None

    async def forward(self, scope: Scope, body: bytes, send: Send) -> None:
        assert self.session is not None
        headers = CIMultiDict((k.decode("latin-1"), v.decode("latin-1"))
                              for k, v in scope["headers"] if k not in HOP)
        replica = self.replicas.pick(next((v for k, v in scope["headers"] if k == SESSION_HEADER), b""))
        async with self.session.request(scope["method"], replica + scope["path"], data=body,
                                        headers=headers) as answer:
            await send({"type": "http.response.start", "status": answer.status,
                        "headers": [(k, v) for k, v in answer.raw_headers if k.lower() not in HOP]})
            async for chunk in answer.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=256), cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False, skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
            trust_env=False)

    async def stop(self) -> None:
        if self.session is not None:
            await self.session.close()


class RSGIPassThrough:
    """The same pass-through on Granian's native interface (RSGI): no ASGI message dicts, a
    non-streamed answer handed over in one call, a stream written with ``send_bytes``."""

    def __init__(self, replicas: Sequence[str]) -> None:
        self.replicas = Replicas([r.rstrip("/") for r in replicas])
        self.session: aiohttp.ClientSession | None = None

    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        if scope.path in ("/health", "/ready"):
            protocol.response_bytes(200, [], b"ok")
            return
        if self.session is None:
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=256), cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False, skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
                trust_env=False)
        body = await protocol()
        headers = CIMultiDict((k, v) for k, v in scope.headers.items() if k.encode() not in HOP)
        replica = self.replicas.pick(scope.headers.get(SESSION_HEADER.decode(), "").encode())
        async with self.session.request(scope.method, replica + scope.path, data=body, headers=headers) as answer:
            out = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in answer.raw_headers if k.lower() not in HOP]
            if answer.content_type != "text/event-stream":
                protocol.response_bytes(answer.status, out, await answer.read())
                return
            transport = protocol.response_stream(answer.status, out)
            async for chunk in answer.content.iter_any():
                await transport.send_bytes(chunk)


def rsgi_from_env() -> RSGIPassThrough:
    """The RSGI app for Granian, replicas as in `from_env`."""
    return RSGIPassThrough(os.environ["KVGATE_FLOOR_REPLICA"].split(","))


def from_env() -> PassThrough:
    """The app for a server that imports it (Granian): the replicas from ``KVGATE_FLOOR_REPLICA``
    (comma-separated)."""
    return PassThrough(os.environ["KVGATE_FLOOR_REPLICA"].split(","))


def floor_parser(doc: str) -> argparse.ArgumentParser:
    """The command line every floor takes: where to listen, the replicas."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--replica", action="append", required=True)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = floor_parser(__doc__).parse_args(argv)
    uvicorn.run(PassThrough(args.replica), host=args.host, port=args.port, loop="uvloop", http="httptools",
                ws="none", log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
