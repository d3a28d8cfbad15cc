"""Stop the work of a request whose client has left.

ASGI tells a server-side handler that its client disconnected only through ``receive()``
(``http.disconnect``); uvicorn's ``send`` to a closed connection returns silently. A
request that waits on a replica, or relays its stream, would otherwise go on to the end:
SGLang keeps generating for nobody, the load lease stays held.

``ClientWatch`` is an async context manager around that work: it cancels the working task
when the client leaves. Leaving the block with that cancellation swallows it (``left`` is
then True); any other cancellation (shutdown, a timeout) goes on. How it learns that the
client left:

- on kvgate's own edge (the request's ``ChunkWriter``, ``gateway.push_relay``), the
  connection tells it: ``EdgeProtocol.connection_lost`` calls the watch back. No task, no
  ``receive()``: a request costs no second task and its two steps, and every request of
  the connection is told, the one in progress on a pipelined connection too (uvicorn
  marks only the one it parsed last, so ``receive()`` never told that one);
- elsewhere (an ASGI server of another kind, the tests' ``httpx.ASGITransport``), one
  plain asyncio task awaits ``receive()`` (the body has been read by then: nothing but the
  disconnect can come). Starlette's ``StreamingResponse`` does the same with an anyio task
  group and two tasks per stream.
"""
from __future__ import annotations

import asyncio
from types import TracebackType
from typing import TYPE_CHECKING, Self

from starlette.types import Receive

if TYPE_CHECKING:
    from gateway.push_relay import ChunkWriter


async def _client_gone(receive: Receive) -> None:
    """Returns when the client disconnects."""
    while (await receive())["type"] != "http.disconnect":
        pass


class ClientWatch:
    """``async with ClientWatch(receive, writer) as watch:``; ``watch.left`` after the block.
    ``writer``: the request's edge writer when kvgate's edge serves it (else None)."""

    __slots__ = ("_done", "_receive", "_task", "_watcher", "_writer", "left")

    def __init__(self, receive: Receive, writer: ChunkWriter | None = None) -> None:
        self._receive = receive
        self._writer = writer
        self._watcher: asyncio.Future[None] | None = None
        self._done = False
        self.left = False

    async def __aenter__(self) -> Self:
        task = asyncio.current_task()
        assert task is not None, "ClientWatch runs inside a task"
        self._task = task
        if self._writer is not None:
            if not self._writer.watch(self._lost):
                self._lost()  # gone already: the work stops at its first wait
        else:
            self._watcher = asyncio.ensure_future(_client_gone(self._receive))
            self._watcher.add_done_callback(self._gone)
        return self

    def _gone(self, watcher: asyncio.Future[None]) -> None:
        if watcher.cancelled() or watcher.exception() is not None:
            return  # (exception() also marks a failed watcher's error as retrieved)
        self._lost()

    def _lost(self) -> None:
        if not self._done and not self.left:
            self.left = True
            self._task.cancel()

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool:
        self._done = True
        if self._writer is not None:
            self._writer.watch(None)
        elif self._watcher is not None:
            self._watcher.remove_done_callback(self._gone)
            self._watcher.cancel()
        # ours alone: swallowed; also cancelled from outside (shutdown): it goes on
        return kind is asyncio.CancelledError and self.left and self._task.uncancel() == 0
