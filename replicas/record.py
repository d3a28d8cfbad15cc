"""The registry's mutable record of one replica, and the frozen view made from it.

Only the registry mutates records; everything else sees ``ReplicaView`` snapshots.
``Ejections`` applies the outlier detector's decisions (replicas/outlier.py) to records:
the ``ejected`` flag, the listeners, the log, the totals by (replica, reason).
Load in a view = this gateway's leases (exact, immediate) + other gateways' published
leases (shared state; stale by up to one sync interval) ; the ``reported_*`` fields are
the replica's own ``/v1/loads`` (stale by up to one poll interval).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from prefix_index.base import ReplicaId
from replicas.drain import DrainInfo
from replicas.health import HealthTracker
from replicas.load import LoadCounters
from replicas.model import ReplicaState, ReplicaView
from replicas.outlier import OutlierDetector
from replicas.probe import Capacity, ReadyPath, ReportedLoad
from replicas.speed import ReplicaSpeed

log = logging.getLogger("replicas.registry")


class RegistryListener(Protocol):
    """Told about membership and state changes (the gateway calls policy hooks, sets
    index capacity, updates metrics). Called synchronously; exceptions are logged."""

    def on_added(self, view: ReplicaView) -> None: ...

    def on_removed(self, replica_id: ReplicaId) -> None: ...

    def on_state_changed(self, view: ReplicaView, old_state: ReplicaState) -> None: ...


def normalize_url(url: str) -> ReplicaId:
    """A replica id is its URL without trailing slashes (``http://127.0.0.1:31001``)."""
    return ReplicaId(url.strip().rstrip("/"))


@dataclass(slots=True, eq=False)
class ReplicaRecord:
    id: ReplicaId
    state: ReplicaState
    added_at_s: float
    health: HealthTracker
    static: bool = False
    counters: LoadCounters = field(default_factory=LoadCounters)
    remote: LoadCounters = field(default_factory=LoadCounters)  # other gateways, summed
    capacity: Capacity | None = None  # None until /server_info answered
    reported: ReportedLoad = field(default_factory=ReportedLoad)
    drain: DrainInfo | None = None
    removal_candidate: bool = False
    ever_ok: bool = False
    ready_path: ReadyPath = ReadyPath.READY
    model_cards: tuple[dict[str, Any], ...] | None = None  # None until /v1/models answered
    models: frozenset[str] = frozenset()  # the cards' ids (set with them)
    ejected: bool = False  # set and cleared by the registry from its OutlierDetector
    speed: ReplicaSpeed | None = None  # learned speed (replicas/speed.py); None: not learning
    _view: ReplicaView | None = field(default=None, repr=False)  # the last view, and what it was made of
    _view_of: tuple[object, ...] = field(default=(), repr=False)

    @property
    def operator_drain(self) -> bool:
        return self.drain is not None and self.drain.by_operator

    @property
    def total_in_flight(self) -> int:
        return self.counters.in_flight + max(0, self.remote.in_flight)

    def view(self, held_prefill: tuple[int, ...] = ()) -> ReplicaView:
        """``held_prefill``: what this gateway's admission holds for the replica.

        The last view again while nothing it is made of changed (every mutable input is
        in ``made_of``; capacity, reported loads and drain are replaced, never mutated):
        a request reads every replica's view, and at 512 replicas building them all
        cost ~1.9 ms a request, most of them unchanged since the last one."""
        c, r = self.counters, self.remote
        made_of = (self.state, c.in_flight, c.pending_prefill_tokens, c.decoding, r.in_flight,
                   r.pending_prefill_tokens, r.decoding, self.capacity, self.reported, self.drain,
                   self.removal_candidate, self.ejected, held_prefill, self.models, *self._speeds())
        if self._view is None or made_of != self._view_of:
            self._view = self._build_view(held_prefill)
        self._view_of = made_of  # (an equal new object, e.g. the same loads polled again: compared by identity next time)
        return self._view

    def set_reported(self, load: ReportedLoad) -> None:
        """A ``/v1/loads`` answer: kept, and its accept length fed to the learned speed."""
        self.reported = load
        if self.speed is not None:
            self.speed.observe_accept(load.spec_accept_length)

    def _speeds(self) -> tuple[float | None, float | None, float | None]:
        s = self.speed
        return (None, None, None) if s is None else (s.prefill_tokens_per_s, s.decode_step_s, s.spec_accept_length)

    def _build_view(self, held_prefill: tuple[int, ...]) -> ReplicaView:
        cap = self.capacity or Capacity()
        prefill_rate, decode_step, accept = self._speeds()
        c, r, rep = self.counters, self.remote, self.reported
        return ReplicaView(
            id=self.id,
            state=self.state,
            device_tokens=cap.device_tokens,
            host_tokens=cap.host_tokens,
            page_size=cap.page_size,
            context_tokens=cap.context_tokens,
            max_running_requests=cap.max_running_requests or rep.max_running_requests,
            models=self.models,
            in_flight=c.in_flight + max(0, r.in_flight),
            pending_prefill_tokens=c.pending_prefill_tokens + max(0, r.pending_prefill_tokens),
            decoding=c.decoding + max(0, r.decoding),
            held_prefill=held_prefill,
            reported_running=rep.running,
            reported_waiting=rep.waiting,
            reported_waiting_uncached_tokens=rep.waiting_uncached_tokens,
            reported_token_usage=rep.token_usage,
            added_at_s=self.added_at_s,
            drain_deadline_s=self.drain.deadline_s if self.drain else None,
            removal_candidate=self.removal_candidate,
            ejected=self.ejected,
            prefill_tokens_per_s=prefill_rate,
            decode_step_s=decode_step,
            spec_accept_length=accept,
        )


class ReplicaTable:
    """The records in registration order, and the listeners told about every change."""

    def __init__(self) -> None:
        self.records: dict[ReplicaId, ReplicaRecord] = {}
        self._listeners: list[RegistryListener] = []

    def add_listener(self, listener: RegistryListener) -> None:
        self._listeners.append(listener)

    def notify(self, method: str, *args: Any) -> None:
        for listener in self._listeners:
            try:
                getattr(listener, method)(*args)
            except Exception:  # a listener's bug must not break the registry
                log.exception("registry listener %r.%s failed", listener, method)

    def require(self, url: str) -> ReplicaRecord:
        rec = self.records.get(normalize_url(url))
        if rec is None:
            raise KeyError(f"unknown replica {url!r}")
        return rec

    def add(self, rec: ReplicaRecord) -> ReplicaRecord:
        self.records[rec.id] = rec
        log.info("replica %s added (%s)", rec.id, rec.state.value)
        self.notify("on_added", rec.view())
        return rec

    def remove(self, rid: ReplicaId, why: str) -> None:
        rec = self.records.pop(rid, None)
        if rec is None:
            return
        rec.state = ReplicaState.REMOVED
        log.info("replica %s %s (in flight here: %d)", rid, why, rec.counters.in_flight)
        self.notify("on_removed", rid)

    def set_state(
        self, rec: ReplicaRecord, new: ReplicaState, *, force_notify: bool = False
    ) -> None:
        """Change the state; listeners hear of it (also of a same-state change when forced)."""
        old = rec.state
        if new is old and not force_notify:
            return
        rec.state = new
        if new is not old:
            log.info("replica %s: %s -> %s", rec.id, old.value, new.value)
        self.notify("on_state_changed", rec.view(), old)


class Ejections:
    """The registry's side of outlier ejection (see the module docstring)."""

    def __init__(self, table: ReplicaTable, detector: OutlierDetector, clock: Callable[[], float]) -> None:
        self._table = table
        self._detector = detector
        self._clock = clock
        self.ejected: set[ReplicaId] = set()
        self.totals: dict[tuple[ReplicaId, str], int] = {}

    def _active(self) -> list[ReplicaId]:
        return [r.id for r in self._table.records.values() if r.state is ReplicaState.ACTIVE]

    def result(self, rec: ReplicaRecord, ok: bool) -> None:
        """One distinct request's result on ``rec`` (a failure the replica is to blame for)."""
        why = self._detector.record(rec.id, ok, self._clock(), () if ok else self._active())
        if why is not None:
            self._set(rec, why)

    def probe_timed_out(self, rec: ReplicaRecord) -> None:
        if self._detector.suspect(rec.id, self._clock(), self._active()):
            self._set(rec, "probe_timeout")

    def probe_answered(self, rec: ReplicaRecord) -> None:
        if self._detector.probe_answered(rec.id):
            self._unset(rec, "probe answered")

    def expire(self) -> None:
        for rid in self._detector.expire(self._clock()):
            rec = self._table.records.get(rid)
            if rec is not None:
                self._unset(rec, "ejection time over")

    def forget(self, rid: ReplicaId) -> None:
        self._detector.forget(rid)
        self.ejected.discard(rid)

    def _set(self, rec: ReplicaRecord, reason: str) -> None:
        until = self._detector.ejected_until(rec.id)
        left = 0.0 if until is None else until - self._clock()
        log.warning("replica %s ejected (%s)%s", rec.id, reason,
                    " until a probe answers" if reason == "probe_timeout" else f" for {left:.0f} s")
        key = (rec.id, reason)
        self.totals[key] = self.totals.get(key, 0) + 1
        self.ejected.add(rec.id)
        rec.ejected = True
        self._table.notify("on_state_changed", rec.view(), rec.state)

    def _unset(self, rec: ReplicaRecord, why: str) -> None:
        self.ejected.discard(rec.id)
        if rec.ejected:
            rec.ejected = False
            log.warning("replica %s back from ejection (%s)", rec.id, why)
            self._table.notify("on_state_changed", rec.view(), rec.state)
