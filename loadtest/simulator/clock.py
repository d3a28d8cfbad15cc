"""Two clocks for the simulated replica engine.

``RealtimeDriver`` runs one ``ReplicaEngine`` inside an asyncio server: simulated time
advances ``time_scale`` simulated seconds per wall second from the driver's creation. Its
``run()`` task sleeps until the wall time of ``engine.next_event_s()`` (the end of the step
in progress), calls ``engine.advance(now)`` (engine callbacks therefore run in the event
loop) and is woken early by ``submit()``/``abort()``. No threads, no blocking calls.

``VirtualFleet`` runs many engines in virtual time, with no sleeping: a heap holds each
engine's next *milestone* (``engine.next_milestone_s()``: the next first token or finish)
and the caller's scheduled callbacks ``schedule(at_s, fn)`` (``fn(now_s)``), popped in time
order (ties in insertion order, so runs are deterministic). Engines are advanced lazily:
only at their milestones and when the caller submits to them, so a run of identical decode
steps costs one numpy plan, not one Python iteration per step. Streaming ``on_tokens``
callbacks are delivered when the engine is next advanced, each with its own ``now_s``;
``on_finish`` callbacks fire at their exact time, so a closed-loop driver can schedule the
next turn of a session from inside ``on_finish``.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable, Sequence

from loadtest.simulator.engine import EngineStats, ReplicaEngine, RequestListener, SimRequest

Callback = Callable[[float], None]


class RealtimeDriver:
    """Maps wall time to simulated time and drives one engine from an asyncio task."""

    def __init__(self, engine: ReplicaEngine, time_scale: float) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.engine = engine
        self.time_scale = time_scale
        self._wall0 = time.monotonic()
        self._sim0 = engine.now_s
        self._wake = asyncio.Event()

    def now_s(self) -> float:
        """Current simulated time."""
        return self._sim0 + (time.monotonic() - self._wall0) * self.time_scale

    def set_time_scale(self, time_scale: float) -> None:
        """Change the speed from now on (simulated time stays continuous)."""
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self._sim0, self._wall0 = self.now_s(), time.monotonic()
        self.time_scale = time_scale
        self._wake.set()

    def submit(self, req: SimRequest, listener: RequestListener) -> None:
        self.engine.submit(req, listener, self.now_s())
        self._wake.set()

    def abort(self, rid: str) -> None:
        self.engine.abort(rid, self.now_s())
        self._wake.set()

    def snapshot(self) -> EngineStats:
        """The engine's stats, brought up to the current simulated time."""
        self.engine.advance(self.now_s())
        return self.engine.snapshot()

    async def run(self) -> None:
        """Advance the engine at each of its events, until cancelled."""
        while True:
            self._wake.clear()
            now = self.now_s()
            self.engine.advance(now)
            nxt = self.engine.next_event_s()
            timeout = None if nxt is None else max(0.0, (nxt - now) / self.time_scale)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass


class VirtualFleet:
    """Many engines and the caller's events in one virtual timeline (no sleeping)."""

    def __init__(self, engines: Sequence[ReplicaEngine], start_s: float = 0.0) -> None:
        self.engines = list(engines)
        self._now = start_s
        self._seq = itertools.count()
        self._heap: list[tuple[float, int, int, Callback | None]] = []
        self._version = [0] * len(self.engines)
        self._pending: dict[int, int] = {}  # heap seq -> engine index
        for i in range(len(self.engines)):
            self._refresh(i)

    @property
    def now_s(self) -> float:
        return self._now

    def schedule(self, at_s: float, fn: Callback) -> None:
        """Call ``fn(now_s)`` at simulated time ``at_s`` (not before the current time)."""
        heapq.heappush(self._heap, (max(at_s, self._now), next(self._seq), -1, fn))

    def submit(self, engine_index: int, req: SimRequest, listener: RequestListener) -> None:
        """Submit to one engine at the current simulated time."""
        self.engines[engine_index].submit(req, listener, self._now)
        self._refresh(engine_index)

    def abort(self, engine_index: int, rid: str) -> None:
        self.engines[engine_index].abort(rid, self._now)
        self._refresh(engine_index)

    def snapshot(self, engine_index: int) -> EngineStats:
        """One engine's stats at the current simulated time."""
        engine = self.engines[engine_index]
        engine.advance(self._now)
        self._refresh(engine_index)
        return engine.snapshot()

    def run_until(self, until_s: float) -> None:
        """Process every event up to ``until_s``; then every engine is at ``until_s``."""
        while self._heap and self._heap[0][0] <= until_s:
            self._pop()
        self._now = max(self._now, until_s)
        for i, engine in enumerate(self.engines):
            engine.advance(self._now)
            self._refresh(i)

    def run(self, max_s: float = float("inf")) -> float:
        """Process events until none is left (or ``max_s``); returns the final time."""
        while self._heap and self._heap[0][0] <= max_s:
            self._pop()
        return self._now

    def _pop(self) -> None:
        at_s, seq, index, fn = heapq.heappop(self._heap)
        self._now = max(self._now, at_s)
        if fn is not None:
            fn(self._now)
            return
        if self._pending.get(seq) != self._version[index]:
            self._pending.pop(seq, None)
            return  # stale milestone
        del self._pending[seq]
        self.engines[index].advance(self._now)
        self._refresh(index)

    def _refresh(self, index: int) -> None:
        """Re-queue an engine's next milestone (older entries become stale)."""
        self._version[index] += 1
        nxt = self.engines[index].next_milestone_s()
        if nxt is not None:
            seq = next(self._seq)
            self._pending[seq] = self._version[index]
            heapq.heappush(self._heap, (max(nxt, self._now), seq, index, None))
