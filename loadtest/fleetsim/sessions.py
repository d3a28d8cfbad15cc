"""When each request is sent, in virtual time: closed-loop sessions or open-loop replay.

Same semantics as the real load driver (``loadtest/driver.py``), without sleeping:

- **Closed loop** (Claude Code, synthetic): a session sends turn ``i`` ``think_time *
  think_scale`` (capped at ``max_think_s``) after the response to turn ``i-1`` ended, and
  not before the subagents turn ``i-1`` started have all finished. A subagent's
  sub-conversation starts ``start_delay_s * think_scale`` after its parent turn's
  response, as the trace orders it (``Turn.subagents``). A rejected request ends at once
  and the session goes on, as with a 503 in the driver.
- **Session starts**: ``sessions_concurrent`` sessions at a time (the next starts when
  one ends; the first ones start uniformly over ``ramp_s``), or a Poisson process of
  ``session_rate`` sessions per second (seeded).
- **Open loop** (Mooncake, Bailian): every turn at its recorded ``arrival_s``.

Events go through ``VirtualFleet.schedule`` (never a direct call from inside an engine
callback), so the engine is never re-entered and recursion stays flat.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from loadtest.simulator.clock import VirtualFleet
from loadtest.workload import Session, Workload

Done = Callable[[float], None]


class Sender(Protocol):
    def stopped(self, now_s: float) -> bool:
        """No new request may be sent (request or time bound reached)."""
        ...

    def send(self, session: Session, turn: int, now_s: float, on_done: Done) -> None:
        """Send one turn now; ``on_done(t)`` when its response ended (or it was rejected)."""
        ...


@dataclass(frozen=True)
class Pacing:
    sessions_concurrent: int | None = 64
    session_rate: float | None = None  # sessions per simulated second (Poisson)
    think_scale: float = 1.0
    max_think_s: float | None = None
    ramp_s: float = 0.0
    seed: int = 0

    def think(self, seconds: float) -> float:
        s = max(seconds, 0.0) * self.think_scale
        return s if self.max_think_s is None else min(s, self.max_think_s)


class _Conversation:
    """One session (or subagent) in flight: its next turn and its running subagents."""

    __slots__ = ("env", "next_turn", "on_end", "ready", "session", "subs_running")

    def __init__(self, env: _Env, session: Session, on_end: Done) -> None:
        self.env = env
        self.session = session
        self.on_end = on_end
        self.next_turn = 0
        self.subs_running = 0
        self.ready = False

    def start(self, now_s: float) -> None:
        delay = self.env.pacing.think(self.session.start_delay_s) if self.session.parent else 0.0
        self.env.fleet.schedule(now_s + delay, self._ready)

    def _ready(self, now_s: float) -> None:
        self.ready = True
        self._maybe_send(now_s)

    def _maybe_send(self, now_s: float) -> None:
        if not self.ready or self.subs_running:
            return
        turns = self.session.turns
        if self.next_turn >= len(turns) or self.env.sender.stopped(now_s):
            self.next_turn = len(turns)
            self.on_end(now_s)
            return
        self.ready = False
        self.env.sender.send(self.session, self.next_turn, now_s, self._responded)

    def _responded(self, now_s: float) -> None:
        i = self.next_turn
        turn = self.session.turns[i]
        self.next_turn = i + 1
        for sub in turn.subagents:
            self.subs_running += 1
            _Conversation(self.env, sub, self._sub_ended).start(now_s)
        if self.next_turn >= len(self.session.turns):
            self.ready = True
            self.env.fleet.schedule(now_s, self._maybe_send)
            return
        think = self.env.pacing.think(self.session.turns[self.next_turn].think_time_s)
        self.env.fleet.schedule(now_s + think, self._ready)

    def _sub_ended(self, now_s: float) -> None:
        self.subs_running -= 1
        self.env.fleet.schedule(now_s, self._maybe_send)


@dataclass
class _Env:
    fleet: VirtualFleet
    sender: Sender
    pacing: Pacing


def start_closed_loop(workload: Workload, fleet: VirtualFleet, sender: Sender, pacing: Pacing) -> None:
    """Schedule the sessions of a closed-loop workload (see the module docstring)."""
    env = _Env(fleet, sender, pacing)
    pending: Iterator[Session] = iter(workload.sessions)

    def next_session(now_s: float) -> None:
        if sender.stopped(now_s):
            return
        session = next(pending, None)
        if session is not None:
            _Conversation(env, session, next_session).start(now_s)

    if pacing.session_rate:
        _poisson_starts(env, pending, random.Random(pacing.seed), pacing.session_rate)
        return
    n = max(1, pacing.sessions_concurrent or 1)
    for k in range(n):
        fleet.schedule(pacing.ramp_s * k / n, next_session)


def _poisson_starts(env: _Env, pending: Iterator[Session], rng: random.Random, rate: float) -> None:
    def arrive(now_s: float) -> None:
        if env.sender.stopped(now_s):
            return
        session = next(pending, None)
        if session is None:
            return
        _Conversation(env, session, lambda _t: None).start(now_s)
        env.fleet.schedule(now_s + rng.expovariate(rate), arrive)

    env.fleet.schedule(0.0, arrive)


def start_open_loop(workload: Workload, fleet: VirtualFleet, sender: Sender) -> None:
    """Schedule every turn at its recorded arrival time (one pending event at a time).

    Times are shifted so the first arrival is at 0.
    """
    items = sorted((t.arrival_s, k, i) for k, s in enumerate(workload.sessions)
                   for i, t in enumerate(s.turns))
    if not items:
        return
    t0 = items[0][0]
    it = iter(items)
    current = [items[0]]
    next(it)

    def arrive(now_s: float) -> None:
        _, k, i = current[0]
        if sender.stopped(now_s):
            return
        sender.send(workload.sessions[k], i, now_s, lambda _t: None)
        following = next(it, None)
        if following is not None:
            current[0] = following
            fleet.schedule(following[0] - t0, arrive)

    fleet.schedule(0.0, arrive)
