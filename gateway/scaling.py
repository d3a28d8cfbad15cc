"""The gateway's scale loop: desired replicas per model, cache-value ranking, removal candidates.

Every ``scale.interval_s`` the loop (a task owned by the app's lifespan) groups the
registry's views by the model they serve (:func:`scale_group`: a replica's served model,
its sorted names joined by ``,`` when it serves several, ``""`` while it reports none) and
evaluates one ``replicas.scale.ScaleAdvisor.tick`` per group, each advisor with its own
hysteresis and cooldown, over

- the group's views (each model's pool scales on its own working set and queue),
- the resident working set per replica: ``index.resident_tokens(now, window)`` with the
  policy's ``resident_window_s`` (the same figure the router gives the policy),
- recent cache hits per replica: cached prompt tokens the replicas reported in ``usage``
  over the last ``scale.hits_window_s`` seconds (:class:`HitWindow`; the proxy calls
  ``gateway.hits.record(replica, cached_tokens)`` once per finished request),

exports ``kvgate_desired_replicas{model}`` (KEDA's signal, one series per group),
``kvgate_replica_cache_value_tokens`` and ``kvgate_replica_deletion_cost``, and, with
``scale.annotate_pods`` (in Kubernetes), writes ``controller.kubernetes.io/pod-deletion-cost``
on the replica pods so a scale-in deletes the coldest pod. A group whose replicas are all
gone is dropped with its advisor, its marks and its series. A fleet whose replicas report
no model is one group ``""``, exactly the fleet-wide advice; an empty fleet too (so the
signal, and the alert that reads it, stay present with no replica). A replica joins its
model's group once its ``/v1/models`` is read (at its first good probe, before it turns
active); until then it is in ``""``.

Removal candidates come from two sources, merged by :class:`CandidateMarks` before they
reach the registry: the advisors (after the low-usage cooldown; each marks through its
own :meth:`CandidateMarks.marker`, so none unmarks another's) and the operator
(``POST /admin/scale/prepare-removal {"count": N, "model"?}``: the N coldest active
replicas of the fleet, or of one model's group, kept until the next such call; ``count:
0`` clears). A candidate gets no new sessions and its sessions move on their next turn,
so little cache is lost when Kubernetes removes it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel, Field

from prefix_index.base import ReplicaId
from replicas.model import ReplicaState, ReplicaView
from replicas.scale import (
    PodDeletionCostAnnotator,
    ReplicaHeat,
    ScaleAdvice,
    ScaleAdvisor,
    ScaleParams,
    coldest_first,
)

log = logging.getLogger("kvgate.scaling")
_P = ScaleParams  # defaults of the advisor's parameters live in replicas/scale.py


class ScaleConfig(BaseModel):
    """The ``scale`` section: the advisor's parameters and how the gateway runs it."""

    interval_s: float = Field(default=5.0, gt=0, description="how often the scale advice is evaluated")
    hits_window_s: float = Field(default=300.0, gt=0, description="window of recent cache hits per replica")
    annotate_pods: bool = Field(default=False, description="write pod-deletion-cost on replica pods (Kubernetes)")
    namespace: str | None = Field(default=None, description="replica pods' namespace (None: the gateway pod's)")
    pod_selector: str = Field(default="app.kubernetes.io/name=sglang", description="label selector of replica pods")
    hit_weight: float = Field(default=_P.hit_weight, ge=0, description="weight of recent hit tokens in cache value")
    in_flight_tokens: int = Field(default=_P.in_flight_tokens, ge=0, description="cache value of one in-flight request")
    cost_quantum_tokens: int = Field(default=_P.cost_quantum_tokens, ge=1, description="tokens per deletion-cost unit")
    high_watermark: float = Field(default=_P.high_watermark, gt=0, description="working set / capacity: scale out")
    low_watermark: float = Field(default=_P.low_watermark, ge=0, description="below it for cooldown_s: scale in")
    queue_per_replica: float = Field(default=_P.queue_per_replica, ge=0, description="waiting per replica: scale out")
    cooldown_s: float = Field(default=_P.cooldown_s, ge=0, description="low usage this long before scaling in")
    min_replicas: int = Field(default=_P.min_replicas, ge=0)
    max_replicas: int = Field(default=_P.max_replicas, ge=1)

    def params(self) -> ScaleParams:
        return ScaleParams(self.hit_weight, self.in_flight_tokens, self.cost_quantum_tokens, self.high_watermark,
                           self.low_watermark, self.queue_per_replica, self.cooldown_s, self.min_replicas,
                           self.max_replicas)


class HitWindow:
    """Cached prompt tokens per replica over the last ``window_s`` seconds (rolling sum).

    ``record`` is on the request path: an append and an add (amortised O(1))."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._window_s, self._clock = window_s, clock
        self._events: dict[ReplicaId, deque[tuple[float, int]]] = {}
        self._sums: dict[ReplicaId, int] = {}

    def record(self, replica: ReplicaId, cached_tokens: int | None) -> None:
        if not cached_tokens:
            return
        events = self._events.get(replica)
        if events is None:
            events = self._events[replica] = deque()
            self._sums[replica] = 0
        events.append((self._clock(), cached_tokens))
        self._sums[replica] += cached_tokens
        if len(events) > 64:
            self._expire(replica, self._clock())

    def _expire(self, replica: ReplicaId, now: float) -> None:
        events = self._events[replica]
        while events and now - events[0][0] > self._window_s:
            self._sums[replica] -= events.popleft()[1]

    def totals(self) -> dict[ReplicaId, int]:
        now = self._clock()
        for replica in list(self._events):
            self._expire(replica, now)
            if not self._events[replica]:
                del self._events[replica], self._sums[replica]
        return dict(self._sums)


class CandidateRegistry(Protocol):
    """The Registry's part the marks drive."""

    def set_removal_candidate(self, url: str, flag: bool) -> None: ...


class CandidateMarks:
    """Merges the advisors' (one per model group) and the operator's removal candidates into
    the registry flag. A replica is marked while any of them marks it: a replica that moves
    to another group (its ``/v1/models`` answered) may be marked by its new group's advisor
    before the old one lets go of it."""

    def __init__(self, registry: CandidateRegistry) -> None:
        self._registry = registry
        self.auto: dict[str, set[ReplicaId]] = {}  # by scale group
        self.manual: set[ReplicaId] = set()

    def marked(self) -> set[ReplicaId]:
        return self.manual.union(*self.auto.values())

    def _apply(self, url: ReplicaId, before: bool) -> None:
        after = url in self.marked()
        if after != before:
            try:
                self._registry.set_removal_candidate(url, after)
            except KeyError:  # the replica left meanwhile
                log.debug("removal candidate %s: replica gone", url)

    def set_auto(self, group: str, url: ReplicaId, flag: bool) -> None:
        """Group ``group``'s advisor marks (or unmarks) ``url``."""
        before = url in self.marked()
        owned = self.auto.setdefault(group, set())
        (owned.add if flag else owned.discard)(url)
        self._apply(url, before)

    def marker(self, group: str) -> GroupMarker:
        """The ``RemovalMarker`` of group ``group``'s advisor."""
        return GroupMarker(self, group)

    def drop_group(self, group: str) -> None:
        """The group is gone: its advisor's marks go with it."""
        for url in sorted(self.auto.get(group, ())):
            self.set_auto(group, url, False)
        self.auto.pop(group, None)

    def set_manual(self, urls: Iterable[ReplicaId]) -> None:
        wanted = set(urls)
        changed = self.manual ^ wanted
        before = {u: u in self.marked() for u in changed}
        self.manual = wanted
        for url in sorted(changed):
            self._apply(url, before[url])

    def forget_missing(self, present: set[ReplicaId]) -> None:
        self.manual &= present


class UnknownGroup(LookupError):
    """No replica is in this scale group (``prepare_removal``'s model)."""


@dataclass(frozen=True)
class GroupMarker:
    """One advisor's ``RemovalMarker``: it marks in its own group's set only."""

    marks: CandidateMarks
    group: str

    def set_removal_candidate(self, url: ReplicaId, flag: bool) -> None:
        self.marks.set_auto(self.group, url, flag)


def scale_group(view: ReplicaView) -> str:
    """The model a replica is scaled with: its served name, several sorted and joined by
    ``,``, ``""`` while unknown (a one-model fleet whose replicas report none)."""
    return ",".join(sorted(view.models))


def scale_groups(views: Iterable[ReplicaView]) -> dict[str, tuple[ReplicaView, ...]]:
    """The views by :func:`scale_group`, sorted by group; an empty fleet is one empty group ``""``."""
    groups: dict[str, list[ReplicaView]] = {}
    for view in views:
        groups.setdefault(scale_group(view), []).append(view)
    return {group: tuple(groups[group]) for group in sorted(groups)} or {"": ()}


@dataclass(frozen=True)
class ScaleReport:
    """One evaluation: the advice per model group and the inputs it came from (admin API)."""

    advice: Mapping[str, ScaleAdvice]  # by scale group, sorted
    resident_tokens: Mapping[ReplicaId, int]
    hit_tokens: Mapping[ReplicaId, int]
    views: tuple[ReplicaView, ...]
    marked: frozenset[ReplicaId]

    def ranking(self, group: str | None = None) -> list[ReplicaHeat]:
        """Coldest first: one group's replicas, or (None) the whole fleet's."""
        if group is not None:
            return list(self.advice[group].ranking)
        return coldest_first(h for advice in self.advice.values() for h in advice.ranking)

    def candidate(self, group: str | None = None) -> ReplicaId | None:
        """The replica to remove next: a marked candidate, else the coldest active replica."""
        active = [h.url for h in self.ranking(group) if h.state is ReplicaState.ACTIVE]
        return next((u for u in active if u in self.marked), active[0] if active else None)

    def deletion_costs(self) -> dict[ReplicaId, int]:
        return {url: cost for advice in self.advice.values() for url, cost in advice.deletion_costs.items()}


class ResidentSource(Protocol):
    """The index's part the loop reads (``PrefixIndex.resident_tokens``)."""

    async def resident_tokens(self, now_s: float, window_s: float) -> dict[ReplicaId, int]: ...


class ScaleMetrics(Protocol):
    def scale_advice(self, advice: Mapping[str, ScaleAdvice]) -> None: ...

    def scale_error(self, stage: str) -> None: ...


class ScaleLoop:
    """Owns the advisors (one per model group), the hit window, the candidate marks and the
    optional annotator."""

    def __init__(self, config: ScaleConfig, registry: CandidateRegistry, views: Callable[[], Iterable[ReplicaView]],
                 index: ResidentSource, resident_window_s: float, metrics: ScaleMetrics,
                 annotator: PodDeletionCostAnnotator | None = None) -> None:
        self.config = config
        self.hits = HitWindow(config.hits_window_s)
        self.marks = CandidateMarks(registry)
        self.advisors: dict[str, ScaleAdvisor] = {}  # by scale group
        self._views, self._index, self._window_s = views, index, resident_window_s
        self._metrics = metrics
        self._annotator = annotator
        self._lock = asyncio.Lock()
        self.last: ScaleReport | None = None

    async def evaluate(self) -> ScaleReport:
        """One tick: advice per group, candidate marks, metrics (annotating pods is the loop's job)."""
        async with self._lock:
            views = tuple(self._views())
            self.marks.forget_missing({v.id for v in views})
            resident = await self._resident_tokens()
            hits = self.hits.totals()
            groups = scale_groups(views)
            for gone in sorted(set(self.advisors) - set(groups)):
                del self.advisors[gone]
                self.marks.drop_group(gone)
            advice = {group: await self._advisor(group).tick(members, resident, hits)
                      for group, members in groups.items()}
            self._metrics.scale_advice(advice)
            self.last = ScaleReport(advice, resident, hits, views, frozenset(self.marks.marked()))
            return self.last

    def _advisor(self, group: str) -> ScaleAdvisor:
        advisor = self.advisors.get(group)
        if advisor is None:
            advisor = self.advisors[group] = ScaleAdvisor(self.config.params(), marker=self.marks.marker(group))
        return advisor

    async def _resident_tokens(self) -> dict[ReplicaId, int]:
        try:
            return await self._index.resident_tokens(time.time(), self._window_s)
        except Exception as exc:  # noqa: BLE001 - a failing index degrades the advice, counted
            self._metrics.scale_error("index")
            log.warning("scale: resident tokens unavailable (%s: %s)", type(exc).__name__, exc)
            return {}

    async def prepare_removal(self, count: int, group: str | None = None) -> ScaleReport:
        """Mark the ``count`` coldest active replicas of the fleet, or of one model's group
        (current marks first, for stability); another group's marks stay. ``UnknownGroup``:
        no replica in ``group``."""
        report = await self.evaluate()
        if group is not None and group not in report.advice:
            raise UnknownGroup(group)
        scope = report.ranking(group)
        active = [h.url for h in scope if h.state is ReplicaState.ACTIVE]
        marked = self.marks.manual  # marked first, each part in the ranking's order (sorted is stable)
        chosen = sorted(active, key=lambda u: u not in marked)[:max(0, count)]
        self.marks.set_manual((self.marks.manual - {h.url for h in scope}) | set(chosen))
        return await self.evaluate()

    async def annotate(self, report: ScaleReport) -> None:
        if self._annotator is None:
            return
        try:
            patched = await self._annotator.apply(report.deletion_costs())
        except Exception as exc:  # noqa: BLE001 - API server trouble must not stop the loop; counted
            self._metrics.scale_error("annotate")
            log.warning("scale: pod-deletion-cost annotation failed (%s: %s)", type(exc).__name__, exc)
            return
        if patched:
            log.info("scale: pod-deletion-cost updated on %s", ", ".join(patched))

    async def close(self) -> None:
        if self._annotator is not None:
            await self._annotator.aclose()

    async def run(self) -> None:
        """Until cancelled: evaluate, annotate, sleep."""
        while True:
            try:
                report = await self.evaluate()
                await self.annotate(report)
            except Exception:  # a loop must survive one bad iteration
                self._metrics.scale_error("tick")
                log.exception("scale loop iteration failed")
            await asyncio.sleep(self.config.interval_s)


def make_annotator(config: ScaleConfig) -> PodDeletionCostAnnotator | None:
    """The pod annotator when ``annotate_pods`` (in a pod, else the kubeconfig; raises without either)."""
    if not config.annotate_pods:
        return None
    from replicas.kube import ApiServer

    return PodDeletionCostAnnotator(ApiServer.from_environment(config.namespace), config.pod_selector)


def report_json(report: ScaleReport) -> dict[str, object]:
    """``GET /admin/scale``: the fleet's totals, candidate and ranking (coldest first, each
    replica with its model group and cache value), and the advice per model group."""
    views = {v.id: v for v in report.views}
    costs = report.deletion_costs()
    ranking = [{"url": h.url, "model": scale_group(views[h.url]), "state": h.state.value,
                "cache_value_tokens": round(h.value), "resident_tokens": report.resident_tokens.get(h.url, 0),
                "hit_tokens": report.hit_tokens.get(h.url, 0), "in_flight": views[h.url].in_flight,
                "deletion_cost": costs.get(h.url, 0), "removal_candidate": h.url in report.marked}
               for h in report.ranking()]
    models = {group: {"desired_replicas": advice.desired_replicas, "current_replicas": advice.current_replicas,
                      "reason": advice.reason, "candidate": report.candidate(group),
                      "removal_candidates": sorted(h.url for h in advice.ranking if h.url in report.marked)}
              for group, advice in report.advice.items()}
    return {"desired_replicas": sum(a.desired_replicas for a in report.advice.values()),
            "current_replicas": sum(a.current_replicas for a in report.advice.values()),
            "candidate": report.candidate(), "ranking": ranking, "removal_candidates": sorted(report.marked),
            "models": models}
