"""Outlier ejection: a replica that fails many distinct requests leaves routing for a while.

Pure (no I/O, no clock of its own): the registry feeds it one result per distinct
request that reached a replica, ``ok`` or a failure the replica is to blame for (connect
refused/reset, head or first-byte timeout, a stall or a break mid-stream, a 5xx not
judged the request's own: see gateway/proxy.py), and applies the ejections it returns.
Like Envoy's outlier detection, with its defaults (``registry.outlier``):

    consecutive    `consecutive_failures` (5) failures in a row
    failure_rate   over the last `window_s` (30 s): at least `min_requests` (10) results,
                   a failure fraction >= `failure_fraction` (0.5), and at least
                   `fleet_margin` (0.3) above the median fraction of the fleet's replicas,
                   so a failure that hits every replica alike ejects none

An ejection lasts `base_ejection_s` (30 s) x the number of ejections of that replica so
far, at most `max_ejection_s` (300 s). At most `max_ejection_percent` (50 %) of the
active replicas are ejected at once, and never the last one that is not. When the time
is up the replica is routable again, but its failure streak is kept until a success:
one more failure ejects it at once, for longer (a replica that is still broken pays
more, one that recovered loses nothing).

``suspect`` is the same mechanism for a probe that timed out (see replicas/registry.py):
a replica that accepts TCP but does not answer a trivial ``/ready`` within the probe
timeout is most likely hung (SIGSTOP, a deadlock, a long GC pause), and every request
routed there meanwhile would wait the head timeout. It is ejected at once (reason
``probe_timeout``, within the same cap), does not escalate the ejection time, and is
lifted by the first probe that answers.
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from prefix_index.base import ReplicaId
from replicas.config import OutlierConfig

REASONS = ("consecutive", "failure_rate", "probe_timeout")


@dataclass(slots=True)
class _Window:
    """Results per whole second over the window: deque of [second, total, failures]."""

    buckets: deque[list[int]] = field(default_factory=deque)
    total: int = 0
    failures: int = 0

    def add(self, now_s: float, ok: bool, window_s: float) -> None:
        second = int(now_s)
        self.prune(second - window_s)
        if not self.buckets or self.buckets[-1][0] != second:
            self.buckets.append([second, 0, 0])
        bucket = self.buckets[-1]
        bucket[1] += 1
        self.total += 1
        if not ok:
            bucket[2] += 1
            self.failures += 1

    def prune(self, oldest_s: float) -> None:
        while self.buckets and self.buckets[0][0] <= oldest_s:
            _, total, failures = self.buckets.popleft()
            self.total -= total
            self.failures -= failures

    def fraction(self) -> float:
        return self.failures / self.total if self.total else 0.0

    def clear(self) -> None:
        self.buckets.clear()
        self.total = self.failures = 0


@dataclass(slots=True)
class _State:
    consecutive: int = 0
    window: _Window = field(default_factory=_Window)
    ejections: int = 0
    until_s: float | None = None  # ejected until then
    reason: str = ""


class OutlierDetector:
    """Per-replica failure accounting and the ejection decisions (see the module docstring)."""

    def __init__(self, config: OutlierConfig) -> None:
        self.config = config
        self._states: dict[ReplicaId, _State] = {}

    def _state(self, rid: ReplicaId) -> _State:
        state = self._states.get(rid)
        if state is None:
            state = self._states[rid] = _State()
        return state

    def record(self, rid: ReplicaId, ok: bool, now_s: float, fleet: Collection[ReplicaId]) -> str | None:
        """One request's result on ``rid``; the reason when this ejects it (``fleet``: the
        active replicas, for the cap and the median)."""
        state = self._state(rid)
        state.window.add(now_s, ok, self.config.window_s)
        if ok:
            state.consecutive = 0
            return None
        state.consecutive += 1
        if not self.config.enabled or self.is_ejected(rid, now_s):
            return None
        reason = self._due(rid, state, now_s, fleet)
        if reason is None or not self._may_eject(rid, now_s, fleet):
            return None
        state.ejections += 1
        seconds = min(self.config.base_ejection_s * state.ejections, self.config.max_ejection_s)
        self._eject(state, now_s + seconds, reason)
        return reason

    def _due(self, rid: ReplicaId, state: _State, now_s: float, fleet: Collection[ReplicaId]) -> str | None:
        c = self.config
        if state.consecutive >= c.consecutive_failures:
            return "consecutive"
        window = state.window
        if window.total < c.min_requests or window.fraction() < c.failure_fraction:
            return None
        others = (self._fraction(other, now_s) for other in fleet if other != rid)
        fractions = [f for f in others if f is not None] + [window.fraction()]
        return "failure_rate" if window.fraction() >= statistics.median(fractions) + c.fleet_margin else None

    def _fraction(self, rid: ReplicaId, now_s: float) -> float | None:
        state = self._states.get(rid)
        if state is None:
            return None
        state.window.prune(int(now_s) - self.config.window_s)
        return state.window.fraction() if state.window.total else None

    def _may_eject(self, rid: ReplicaId, now_s: float, fleet: Collection[ReplicaId]) -> bool:
        members = [r for r in fleet if r != rid]
        ejected = sum(1 for r in members if self.is_ejected(r, now_s))
        cap = int(len(fleet) * self.config.max_ejection_percent / 100.0)
        return ejected + 1 <= cap and len(members) - ejected >= 1

    @staticmethod
    def _eject(state: _State, until_s: float, reason: str) -> None:
        state.until_s = until_s
        state.reason = reason
        state.window.clear()

    def suspect(self, rid: ReplicaId, now_s: float, fleet: Collection[ReplicaId]) -> bool:
        """A probe of ``rid`` timed out: eject it until a probe answers (True if ejected now)."""
        if not (self.config.enabled and self.config.eject_on_probe_timeout):
            return False
        if self.is_ejected(rid, now_s) or not self._may_eject(rid, now_s, fleet):
            return False
        self._eject(self._state(rid), now_s + self.config.max_ejection_s, "probe_timeout")
        return True

    def probe_answered(self, rid: ReplicaId) -> bool:
        """A probe of ``rid`` answered: lift a probe-timeout ejection (True if lifted)."""
        state = self._states.get(rid)
        if state is None or state.until_s is None or state.reason != "probe_timeout":
            return False
        state.until_s = None
        return True

    def is_ejected(self, rid: ReplicaId, now_s: float) -> bool:
        state = self._states.get(rid)
        return state is not None and state.until_s is not None and now_s < state.until_s

    def expire(self, now_s: float) -> list[ReplicaId]:
        """Replicas whose ejection time is over (they are routable again)."""
        back = [rid for rid, s in self._states.items() if s.until_s is not None and now_s >= s.until_s]
        for rid in back:
            self._states[rid].until_s = None
        return back

    def ejected_until(self, rid: ReplicaId) -> float | None:
        state = self._states.get(rid)
        return None if state is None else state.until_s

    def forget(self, rid: ReplicaId) -> None:
        self._states.pop(rid, None)
