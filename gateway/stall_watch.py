"""A relayed stream's stall bound without a timer per chunk.

``asyncio.timeout`` around each read of a stream arms and cancels one event-loop timer per
SSE chunk (~5 us of Python a chunk, ~1 ms on a 200-token answer: issue 15's profile).
``StallWatch`` keeps *one* timer per stream: a read stamps the time (``reading`` /
``arrived``), and the timer, when it fires, re-arms itself at the last arrival + the limit
unless that moment has passed; then it cancels the task, the way ``asyncio.timeout`` does,
and ``stalled`` tells that cancellation from any other (``task.uncancel`` undoes it).

It cancels only while the task waits for the replica (between ``reading`` and
``arrived``): time spent sending to a slow client is not the replica's silence (the same
scope as the per-read ``asyncio.timeout`` it replaces). A stream silent for the limit ends
within one timer callback of it, never earlier.
"""
from __future__ import annotations

import asyncio


class StallWatch:
    """Cancels the current task when a read has waited ``limit_s`` for data."""

    __slots__ = ("_cancelling", "_handle", "_last", "_loop", "_reading", "_task", "fired", "limit_s")

    def __init__(self, limit_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None, "StallWatch runs inside a task"
        self._task = task
        self._cancelling = task.cancelling()  # cancellations pending before this watch
        self.limit_s = limit_s
        self._last = self._loop.time()
        self._reading = False
        self.fired = False
        self._handle: asyncio.TimerHandle | None = self._loop.call_at(self._last + limit_s, self._check)

    def reading(self) -> None:
        """A read starts: the silence is counted from now (or the last arrival, if later)."""
        self._last = self._loop.time()
        self._reading = True

    def arrived(self) -> None:
        """The read returned: the task is busy with the client until the next ``reading``."""
        self._reading = False

    def _check(self) -> None:
        due = self._last + self.limit_s
        if self._reading and self._loop.time() >= due:
            self._handle = None
            self.fired = True
            self._task.cancel()
        else:  # data came since (look again at the new deadline), or not waiting on the replica
            at = due if self._reading else max(due, self._loop.time() + self.limit_s)
            self._handle = self._loop.call_at(at, self._check)

    def stalled(self, exc: BaseException) -> bool:
        """True when ``exc`` is this watch's cancellation alone (then it is taken back from
        the task); False for any other, or when another cancellation came too (it goes on)."""
        if not (isinstance(exc, asyncio.CancelledError) and self.fired):
            return False
        self.fired = False
        return self._task.uncancel() <= self._cancelling

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
