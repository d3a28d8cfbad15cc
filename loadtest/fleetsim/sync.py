"""Coroutines run to their end from a callback, outside any task, when they never wait.

kvgate's in-process index and its policy hooks are coroutines (the Redis backend's
are real waits) that, in process, finish without ever suspending. The callbacks path
(``gateway/callback_path.py``) runs them inside the connection's callback instead of
in a task of their own: ``finished`` for a value it needs now (raises when the coroutine
would wait, having closed it: the caller then takes the task path), ``run_now`` for
bookkeeping that must finish whatever happens (the rest goes on in a task when it does
wait; its failure is logged, never lost)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger("kvgate.eager")
T = TypeVar("T")


class WouldWait(RuntimeError):
    """The coroutine suspended: it cannot finish inside a callback."""


def finished(coro: Coroutine[Any, Any, T]) -> T:
    """The value of a coroutine that never suspends; raises ``WouldWait`` (the coroutine
    closed) when it does."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise WouldWait("a coroutine suspended; only in-process backends run inside a callback")


def run_now(coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None] | None:
    """Run ``coro`` now, to its end when it never waits (None); else its rest runs in a
    task (returned). Called outside any task: nothing in it may bind to the caller's task
    (an ``asyncio.timeout`` there raises, and is then logged as ``what``'s failure)."""
    try:
        yielded = coro.send(None)
    except StopIteration:
        return None
    except Exception:
        log.exception("%s failed", what)
        return None
    task = asyncio.ensure_future(_rest(coro, yielded))
    task.add_done_callback(lambda t: _log_failure(t, what))
    return task


async def _rest(coro: Coroutine[Any, Any, None], yielded: Any) -> None:
    """Drive a started coroutine as a task would: wait for what it yielded, resume it."""
    while True:
        try:
            if yielded is None:  # a bare yield (asyncio.sleep(0))
                await asyncio.sleep(0)
            elif asyncio.isfuture(yielded):
                yielded._asyncio_future_blocking = False
                await asyncio.wait([yielded])  # its outcome is the coroutine's to read
            else:
                yielded = coro.throw(RuntimeError(f"bad yield: {yielded!r}"))
                continue
        except asyncio.CancelledError as exc:
            try:
                yielded = coro.throw(exc)
            except StopIteration:
                return
            continue
        try:
            yielded = coro.send(None)
        except StopIteration:
            return


def _log_failure(task: asyncio.Task[None], what: str) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("%s failed: %s: %s", what, type(exc).__name__, exc, exc_info=exc)
