"""Fake replicas on real loopback HTTP, in the test's own event loop, for unit tests of the
gateway app and proxy through its production clients (issue 40).

    fleet = FakeFleet({"A": json_reply(200, {"ok": 1}), "B": hang})
    settings = ...(replicas=fleet.urls("A", "B"))   # "http://127.0.0.1:<port>" each
    async with fleet:
        ...                                          # the gateway under test talks to them
    fleet.seen                                       # what they were sent (probes left out)

Each replica is an ``aiohttp.web`` server on ``127.0.0.1``; its port is picked by the
kernel when the fleet is made, so settings can name it before the fleet starts. It
answers the gateway's probes itself (``/ready``, ``/health``, ``/server_info``,
``/get_server_info``, ``/v1/loads``, ``/v1/models``: bodies from tests/replicas/fakes.py),
so it becomes routable; every other request is recorded (``Seen``) and handed to the
replica's handler, a plain aiohttp handler. Handlers for what replicas do:

- ``json_reply`` / ``text_reply``: an answer of any status (200, 400, 429, 5xx, ...);
- ``sse``: an event stream, chunk by chunk, with a delay before each;
- ``hang``: never answers (until the fleet closes): the gateway's timeouts fire;
- ``breaking``: a 200 head and some body bytes, then the connection is dropped;
- ``refuse``: answers the probes (routable) until ``FakeFleet.refuse_connections``, after
  which nothing listens on its port: every new connection is refused.

``closed_port_url()`` is a URL where nothing listens at all (refused from the start).
"""
from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import orjson
from aiohttp import web
from multidict import CIMultiDictProxy, MultiMapping

from tests.replicas.fakes import loads_body, server_info_body

__all__ = ["PROBE_PATHS", "FakeFleet", "Handler", "Seen", "breaking", "closed_port_url", "hang",
           "json_reply", "refuse", "sse", "text_reply"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
"""What a replica does with a request that is not a probe (an aiohttp handler)."""

PROBE_PATHS = frozenset({"/ready", "/health", "/server_info", "/get_server_info", "/v1/loads", "/v1/models"})
"""Paths the fleet answers itself, whatever the handler (not recorded in ``seen``)."""

_CLOSING = web.AppKey("closing", asyncio.Event)  # set when the fleet closes: hanging handlers return


@dataclass(frozen=True, slots=True)
class Seen:
    """One request a replica received."""

    replica: str  # the replica's name, as the test gave it
    method: str
    path: str
    query: MultiMapping[str]
    headers: CIMultiDictProxy[str]
    raw_headers: tuple[tuple[bytes, bytes], ...]  # as sent, in order
    body: bytes


# ------------------------------------------------------------------------------------ handlers
def json_reply(status: int, data: object, headers: Mapping[str, str] | None = None) -> Handler:
    """Answers ``status`` with ``data`` as JSON (and ``headers``)."""
    body = orjson.dumps(data)

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=status, body=body, content_type="application/json", headers=headers)

    return handler


def text_reply(status: int, text: str, headers: Mapping[str, str] | None = None) -> Handler:
    """Answers ``status`` with ``text`` (text/plain)."""
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=status, text=text, headers=headers)

    return handler


def sse(chunks: Sequence[bytes], delay_s: float = 0.0, status: int = 200) -> Handler:
    """A ``text/event-stream`` answer: each chunk written (and flushed) after ``delay_s``."""
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=status, headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for chunk in chunks:
            if delay_s:
                await asyncio.sleep(delay_s)
            await response.write(chunk)
        await response.write_eof()
        return response

    return handler


async def hang(request: web.Request) -> web.StreamResponse:
    """Reads the request and never answers (returns a 500 once the fleet closes)."""
    await request.app[_CLOSING].wait()
    return web.Response(status=500)


def breaking(content_type: str, chunks: Sequence[bytes], after_s: float = 0.1) -> Handler:
    """A 200 head and ``chunks`` of a body (chunked encoding), then, ``after_s`` later (time
    for the client to read them), the connection closed: the body never ends."""
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"content-type": content_type})
        await response.prepare(request)
        for chunk in chunks:
            await response.write(chunk)
        await asyncio.sleep(after_s)
        _drop(request)
        return response

    return handler


async def refuse(request: web.Request) -> web.StreamResponse:
    """A replica that refuses connections once ``FakeFleet.refuse_connections`` ran; a
    request that still reaches it (a connection opened before) has its connection closed."""
    _drop(request)
    return web.Response(status=500)


def _drop(request: web.Request) -> None:
    """Close the request's connection at once, nothing more sent."""
    if request.transport is not None:
        request.transport.abort()


def closed_port_url() -> str:
    """``http://127.0.0.1:<port>`` where nothing listens (a port bound, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# ------------------------------------------------------------------------------------ the fleet
class _Replica:
    """One fake replica: its listening socket (bound at once), its server once started."""

    def __init__(self, fleet: FakeFleet, name: str, handler: Handler, model: str) -> None:
        self.fleet, self.name, self.handler, self.model = fleet, name, handler, model
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.placeholder: socket.socket | None = None  # holds the port once it stops listening
        self.runner: web.AppRunner | None = None
        self.site: web.SockSite | None = None

    async def start(self) -> None:
        app = web.Application()
        app[_CLOSING] = self.fleet.closing
        app.router.add_route("*", "/{tail:.*}", self.dispatch)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self.runner.setup()
        self.site = web.SockSite(self.runner, self.sock)
        await self.site.start()

    async def stop_listening(self) -> None:
        """Close the listening socket; the port stays bound by a socket that does not listen,
        so connections to it are refused (and no other server takes it meanwhile)."""
        if self.site is not None:
            await self.site.stop()  # closes the listening socket
            self.site = None
        self.sock.close()
        if self.placeholder is None:
            placeholder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                placeholder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                placeholder.bind(("127.0.0.1", self.port))
            except OSError:  # (taken meanwhile: connections are refused or answered by another server)
                placeholder.close()
                return
            self.placeholder = placeholder

    async def close(self) -> None:
        if self.site is not None:
            await self.site.stop()
            self.site = None
        self.sock.close()
        if self.placeholder is not None:
            self.placeholder.close()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.fleet.calls.append((self.name, request.method, request.path_qs))
        if request.path in PROBE_PATHS:
            return self.probe(request.path)
        self.fleet.seen.append(Seen(self.name, request.method, request.path, request.query, request.headers,
                                    tuple(request.raw_headers), body))
        return await self.handler(request)

    def probe(self, path: str) -> web.Response:
        """What SGLang answers the gateway's probes (ready, capacity, loads, models)."""
        fleet = self.fleet
        if path in ("/ready", "/health"):
            return web.Response(status=200)
        if path in ("/server_info", "/get_server_info"):
            return _json({**fleet.server_info, "served_model_name": self.model})
        if path == "/v1/loads":
            return _json(fleet.loads)
        card = {"id": self.model, "object": "model", "created": 1700000000, "owned_by": "sglang",
                "root": self.model, "parent": None, "max_model_len": 131072}
        return _json({"object": "list", "data": [card]})


def _json(data: object) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


class FakeFleet:
    """Fake replicas by name, each on its own port; an async context manager (start, close).

    ``models``: the model each replica serves (default ``model``); ``server_info`` /
    ``loads``: the bodies of ``/server_info`` and ``/v1/loads`` (default: those of
    tests/replicas/fakes.py, idle). ``seen``: every request but the probes, in arrival
    order, over all replicas; ``calls``: (replica, method, path and query) of all."""

    def __init__(self, handlers: Mapping[str, Handler], *, models: Mapping[str, str] | None = None,
                 model: str = "m", server_info: Mapping[str, Any] | None = None,
                 loads: Mapping[str, Any] | None = None) -> None:
        self.server_info: dict[str, Any] = dict(server_info if server_info is not None else server_info_body())
        self.loads: dict[str, Any] = dict(loads if loads is not None else loads_body())
        self.seen: list[Seen] = []
        self.calls: list[tuple[str, str, str]] = []
        self.closing = asyncio.Event()
        models = models or {}
        self._replicas: dict[str, _Replica] = {}
        try:
            for name, handler in handlers.items():
                self._replicas[name] = _Replica(self, name, handler, models.get(name, model))
        except BaseException:
            for replica in self._replicas.values():
                replica.sock.close()
            raise

    def url(self, name: str) -> str:
        """The base URL of replica ``name``."""
        return self._replicas[name].url

    def urls(self, *names: str) -> list[str]:
        """The base URLs of ``names`` (all replicas when none is given)."""
        return [self.url(n) for n in names or self._replicas]

    def name_of(self, url: str) -> str:
        """The name of the replica at ``url``."""
        return next(r.name for r in self._replicas.values() if r.url == url)

    async def __aenter__(self) -> Self:
        try:
            for replica in self._replicas.values():
                await replica.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def refuse_connections(self, names: Iterable[str] | None = None) -> None:
        """Stop listening on ``names`` (default: the replicas whose handler is ``refuse``):
        new connections to them are refused from now on."""
        chosen = names if names is not None else [n for n, r in self._replicas.items() if r.handler is refuse]
        for name in chosen:
            await self._replicas[name].stop_listening()

    async def close(self) -> None:
        """Stop every replica (hanging handlers return first)."""
        self.closing.set()
        await asyncio.gather(*(r.close() for r in self._replicas.values()))
