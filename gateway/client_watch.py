"""Stop the work of a request whose client has left.

ASGI tells a server-side handler that its client disconnected only through ``receive()``
(``http.disconnect``); a server's ``send`` to a closed connection may return silently. A
request that waits on a replica, or relays its stream, would otherwise go on to the end:
SGLang keeps generating for nobody, the load lease stays held.

``ClientWatch`` is an async context manager around that work: one plain asyncio task
awaits ``receive()`` (the body has been read by then: nothing but the disconnect can
come) and cancels the working task when the client leaves. Leaving the block with that
cancellation swallows it (``left`` is then True); any other cancellation (shutdown, a
timeout) goes on. Starlette's ``StreamingResponse`` does the same with an anyio task
group and two tasks per stream.
"""
from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Self

from starlette.types import Receive


async def _client_gone(receive: Receive) -> None:
    """Returns when the client disconnects."""
    while (await receive())["type"] != "http.disconnect":
        pass


class ClientWatch:
    """``async with ClientWatch(receive) as watch:``; ``watch.left`` after the block."""

    __slots__ = ("_done", "_receive", "_task", "_watcher", "left")

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._watcher: asyncio.Future[None] | None = None
        self._done = False
        self.left = False

    async def __aenter__(self) -> Self:
        task = asyncio.current_task()
        assert task is not None, "ClientWatch runs inside a task"
        self._task = task
        self._watcher = asyncio.ensure_future(_client_gone(self._receive))
        self._watcher.add_done_callback(self._gone)
        return self

    def _gone(self, watcher: asyncio.Future[None]) -> None:
        if watcher.cancelled() or watcher.exception() is not None:
            return  # (exception() also marks a failed watcher's error as retrieved)
        if not self._done and not self.left:
            self.left = True
            self._task.cancel()

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool:
        self._done = True
        if self._watcher is not None:
            self._watcher.remove_done_callback(self._gone)
            self._watcher.cancel()
        # ours alone: swallowed; also cancelled from outside (shutdown): it goes on
        return kind is asyncio.CancelledError and self.left and self._task.uncancel() == 0
