"""The floor of kvgate's own stack: its server and its client, none of its request work.

`kvgate bench peers --overhead` can run this as its target ``python-floor-kvgate``. It is
kvgate's HTTP server as ``kvgate serve`` runs it (uvicorn on uvloop with kvgate's
``EdgeProtocol``, ``GatewayServer`` and ``EdgeApp``: the edge's deadlines and caps, the push
relay's scope extension) and kvgate's upstream client (``gateway.h1_upstream.H1Upstream``),
with a bare app between them: read the body, pick the replica as ``python-floor`` does (a
hash of the session header, else in turn), send it, answer. A whole answer goes to the
client in one write (as ``gateway.relay.AnsweredResponse`` sends it); a streamed one is
pushed from the upstream connection (``gateway.push_relay.PushRun``, as ``RelayResponse``
relays it). No body parsing, context, index, policy, lease, admission, client watch,
metrics or retries.

So kvgate minus this row is what kvgate's own request work costs on the request's path,
and this row minus ``python-floor-protocol`` is what kvgate's stack costs above a bare
pass-through on asyncio Protocols. Not a product: it exists only to be measured.

    python -m loadtest.peers.stack_floor --port 31900 --replica http://127.0.0.1:31001 [--replica ...]
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from gateway.h1_upstream import H1Response, H1Upstream
from gateway.push_relay import PushRun, edge_writer
from gateway.serve_cmd import bind_listeners, gateway_server, uvicorn_config
from gateway.server import EdgeApp
from gateway.settings import Settings
from gateway.upstream_config import UpstreamConfig
from loadtest.peers.python_floor import (
    HOP,
    SESSION_HEADER,
    FloorApp,
    Replicas,
    Scope,
    Send,
    floor_parser,
)


class StackFloor(FloorApp):
    """Every request goes to a replica through kvgate's ``H1Upstream``."""

    def __init__(self, replicas: Sequence[str], config: UpstreamConfig) -> None:
        self.replicas = Replicas([r.rstrip("/") for r in replicas])
        self.config = config
        self.upstream: H1Upstream | None = None

    async def forward(self, scope: Scope, body: bytes, send: Send) -> None:
        assert self.upstream is not None
        headers: list[tuple[bytes, bytes]] = [(k, v) for k, v in scope["headers"] if k not in HOP]
        replica = self.replicas.pick(next((v for k, v in headers if k == SESSION_HEADER), b""))
        answer = await self.upstream.send(replica, scope["path"], body, headers)
        assert isinstance(answer, H1Response)
        out = [(k, v) for k, v in answer.headers.raw if k.lower() not in HOP]
        writer = edge_writer(scope)
        whole = answer.arrived()
        if whole is not None:  # the whole answer came with its head: one write, as AnsweredResponse
            with writer.one_write() if writer is not None else contextlib.nullcontext():
                await send({"type": "http.response.start", "status": answer.status_code,
                            "headers": [*out, (b"content-length", b"%d" % len(whole))]})
                await send({"type": "http.response.body", "body": whole})
            return
        await send({"type": "http.response.start", "status": answer.status_code, "headers": out})
        if writer is not None and writer.ready():  # pushed from the upstream connection, as RelayResponse
            await PushRun(answer, writer, self.config.stall_timeout_s, _ignore).run()
        else:
            async for chunk in answer.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def start(self) -> None:
        self.upstream = H1Upstream(self.config)

    async def stop(self) -> None:
        if self.upstream is not None:
            await self.upstream.close()


def _ignore(_: bytes) -> None:
    """The push run's usage feed: this floor reads no usage."""


def main(argv: Sequence[str] | None = None) -> None:
    args = floor_parser(__doc__).parse_args(argv)
    settings, sockets = bind_listeners(Settings(host=args.host, port=args.port, log_level="warning"))
    app: Any = EdgeApp(StackFloor(args.replica, settings.upstream), lambda: None)
    gateway_server(uvicorn_config(app, settings, 1), settings).run(sockets=sockets)


if __name__ == "__main__":
    main()
