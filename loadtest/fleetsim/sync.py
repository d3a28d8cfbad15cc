"""Coroutines run to their end without an event loop, for the virtual-time simulation.

The in-process index and the policy hooks are coroutines (the Redis backend's are real
waits) that, in process, finish without ever suspending. The fleet simulation drives
them with ``finished`` (the coroutine protocol's ``send``; no event loop, no clock)."""
from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class WouldWait(RuntimeError):
    """The coroutine suspended: only in-process backends run in the simulation."""


def finished(coro: Coroutine[Any, Any, T]) -> T:
    """The value of a coroutine that never suspends; raises ``WouldWait`` (the coroutine
    closed) when it does."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise WouldWait("a coroutine suspended; only in-process backends run in the simulation")
