"""Cache-aware scaling: which replica to remove first, and how many replicas the fleet needs.

Scale-in ranking (:func:`rank_for_scale_in`, pure). A replica's *cache value* is what
removing it would throw away: the resident working set of its live sessions (tokens of
sessions between turns that will come back), plus recent cache hits (tokens it served
from cache lately, ``hit_weight``), plus its in-flight requests (each worth
``in_flight_tokens`` tokens: they would have to finish or fail over). Replicas not
active (unhealthy, draining, joining) rank before active ones. Coldest first.

Pod deletion cost (:func:`deletion_costs`, :class:`PodDeletionCostAnnotator`). Kubernetes
removes the pod with the lowest ``controller.kubernetes.io/pod-deletion-cost`` first
when a Deployment scales in (after unready pods). The cost is the cache value in units
of ``cost_quantum_tokens`` (so small changes do not patch pods every tick), clamped to
int32. The annotator patches only pods whose cost changed.

Desired replicas (:func:`desired_replicas`, pure; :class:`ScaleAdvisor`, stateful). The
fleet's working set is compared with its cache capacity (device + HiCache host tokens
per replica): above ``high_watermark`` of capacity, or with queueing (waiting requests
above ``queue_per_replica`` per replica), scale out to the size that puts the working
set at the middle of the watermarks (at least one more). Below ``low_watermark`` (and
no queueing) for ``cooldown_s`` in a row, scale in by one: each removal loses a cache,
so the fleet shrinks one step per cooldown. The chosen removal candidates (the coldest
active replicas) are marked through ``set_removal_candidate`` so the policy stops giving
them new sessions and moves their sessions' next turns elsewhere, before Kubernetes
deletes the pod; new replicas get new sessions first (the policy reads ``added_at_s``).

The gateway (``gateway/scaling.py``) runs one advisor per model: every few seconds
``advice = await advisor.tick(views, resident, hits)`` over the replicas serving that
model, exports ``advice.desired_replicas`` as ``kvgate_desired_replicas{model}`` (KEDA
scales that model's pool on it) and hands the advisors' ``deletion_costs`` to a
``PodDeletionCostAnnotator``. An advisor knows nothing of models: "the fleet" above is
the views it is given.
"""
from __future__ import annotations

import inspect
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

from prefix_index.base import ReplicaId
from replicas.kube import ApiServer, KubeClient, annotate_pod, list_pods
from replicas.model import ReplicaState, ReplicaView

INT32_MAX = 2**31 - 1
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
_STATE_TIER = {ReplicaState.UNHEALTHY: 0, ReplicaState.DRAINING: 0, ReplicaState.REMOVED: 0,
               ReplicaState.JOINING: 1, ReplicaState.ACTIVE: 2}


@dataclass(frozen=True)
class ScaleParams:
    hit_weight: float = 1.0
    in_flight_tokens: int = 8192
    cost_quantum_tokens: int = 4096
    high_watermark: float = 0.85  # working set / capacity above which to scale out
    low_watermark: float = 0.5  # below which (for cooldown_s) to scale in by one
    queue_per_replica: float = 4.0  # waiting requests per replica that count as queueing
    cooldown_s: float = 600.0
    min_replicas: int = 1
    max_replicas: int = 64


@dataclass(frozen=True)
class ReplicaHeat:
    url: ReplicaId
    state: ReplicaState
    value: float  # tokens of cache value (see the module doc)


@dataclass(frozen=True)
class FleetSignal:
    replicas: int  # replicas that count toward the fleet size (not draining/removed)
    working_set_tokens: int
    capacity_tokens: int  # summed device + host tokens of those replicas
    waiting: int  # requests queued at the replicas (reported) + not yet streaming


@dataclass(frozen=True)
class ScaleAdvice:
    desired_replicas: int
    current_replicas: int
    reason: str  # "hold" | "working-set" | "queueing" | "low-usage" | "cooldown" | "bounds"
    ranking: tuple[ReplicaHeat, ...]  # coldest first
    removal_candidates: tuple[ReplicaId, ...]
    deletion_costs: Mapping[ReplicaId, int] = field(default_factory=dict)


def rank_for_scale_in(
    views: Sequence[ReplicaView], resident_tokens: Mapping[ReplicaId, int],
    hits: Mapping[ReplicaId, int], params: ScaleParams = ScaleParams(),
) -> list[ReplicaHeat]:
    """Every replica with its cache value, coldest (cheapest to remove) first."""
    return coldest_first(ReplicaHeat(v.id, v.state, resident_tokens.get(v.id, 0)
                                     + params.hit_weight * hits.get(v.id, 0) + params.in_flight_tokens * v.in_flight)
                         for v in views)


def coldest_first(heats: Iterable[ReplicaHeat]) -> list[ReplicaHeat]:
    """The scale-in order: replicas not active first, then by cache value (then URL)."""
    return sorted(heats, key=lambda h: (_STATE_TIER[h.state], h.value, h.url))


def deletion_costs(ranking: Sequence[ReplicaHeat], params: ScaleParams = ScaleParams()) -> dict[ReplicaId, int]:
    """The pod-deletion-cost of each replica: quantized cache value, int32, 0 if not active."""
    return {h.url: (min(INT32_MAX, int(h.value // params.cost_quantum_tokens))
                    if h.state is ReplicaState.ACTIVE else 0) for h in ranking}


def fleet_signal(views: Sequence[ReplicaView], resident_tokens: Mapping[ReplicaId, int]) -> FleetSignal:
    counted = [v for v in views if v.state in (ReplicaState.ACTIVE, ReplicaState.JOINING, ReplicaState.UNHEALTHY)]
    return FleetSignal(
        replicas=len(counted),
        working_set_tokens=sum(resident_tokens.get(v.id, 0) for v in views),
        capacity_tokens=sum(v.device_tokens + v.host_tokens for v in counted),
        waiting=sum(v.reported_waiting for v in counted),
    )


def desired_replicas(signal: FleetSignal, params: ScaleParams = ScaleParams()) -> tuple[int, str]:
    """The fleet size the signal asks for now, before the scale-in cooldown; with the reason."""
    n = signal.replicas
    per_replica = signal.capacity_tokens / n if n else 0.0
    mid = (params.high_watermark + params.low_watermark) / 2
    fit = math.ceil(signal.working_set_tokens / (mid * per_replica)) if per_replica else n
    queueing = n == 0 or signal.waiting > params.queue_per_replica * n
    if queueing:
        want, reason = max(n + 1, fit), "queueing"
    elif per_replica and signal.working_set_tokens > params.high_watermark * signal.capacity_tokens:
        want, reason = max(n + 1, fit), "working-set"
    elif per_replica and signal.working_set_tokens < params.low_watermark * signal.capacity_tokens:
        want = max(n - 1, fit)
        reason = "low-usage" if want < n else "hold"
    else:
        want, reason = n, "hold"
    bounded = min(params.max_replicas, max(params.min_replicas, want))
    return bounded, (reason if bounded == want else "bounds")


class RemovalMarker(Protocol):
    """The Registry's ``set_removal_candidate`` (sync or async)."""

    def set_removal_candidate(self, url: ReplicaId, flag: bool) -> Awaitable[None] | None: ...


class ScaleAdvisor:
    """Desired replicas with scale-in hysteresis, ranking, removal-candidate marking."""

    def __init__(self, params: ScaleParams = ScaleParams(), marker: RemovalMarker | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._params, self._marker, self._clock = params, marker, clock
        self._low_since: float | None = None
        self._marked: set[ReplicaId] = set()

    async def tick(self, views: Sequence[ReplicaView], resident_tokens: Mapping[ReplicaId, int],
                   hits: Mapping[ReplicaId, int]) -> ScaleAdvice:
        """One evaluation; marks/unmarks removal candidates when a marker was given."""
        signal = fleet_signal(views, resident_tokens)
        want, reason = desired_replicas(signal, self._params)
        now = self._clock()
        if want < signal.replicas:
            self._low_since = now if self._low_since is None else self._low_since
            if now - self._low_since < self._params.cooldown_s:
                want, reason = signal.replicas, "cooldown"
        else:
            self._low_since = None
        ranking = rank_for_scale_in(views, resident_tokens, hits, self._params)
        active = [h.url for h in ranking if h.state is ReplicaState.ACTIVE]
        candidates = tuple(active[: max(0, signal.replicas - want)])
        await self._mark(set(candidates))
        return ScaleAdvice(want, signal.replicas, reason, tuple(ranking), candidates,
                           deletion_costs(ranking, self._params))

    async def _mark(self, wanted: set[ReplicaId]) -> None:
        if self._marker is None:
            return
        for url, flag in [(u, False) for u in sorted(self._marked - wanted)] + \
                         [(u, True) for u in sorted(wanted - self._marked)]:
            result = self._marker.set_removal_candidate(url, flag)
            if inspect.isawaitable(result):
                await result
        self._marked = wanted


class PodDeletionCostAnnotator:
    """Writes pod-deletion-cost annotations on the replica pods (Role: list + patch pods).

    Pods are found by ``label_selector`` in the API server's namespace (``replicas.kube``:
    in cluster or a kubeconfig) and matched to replica URLs by pod IP. The client connects
    on the first :meth:`apply`; :meth:`aclose` closes it.
    """

    def __init__(self, api: ApiServer, label_selector: str) -> None:
        self._api, self._selector = api, label_selector
        self._kube: KubeClient | None = None

    async def apply(self, costs: Mapping[ReplicaId, int]) -> list[str]:
        """Patch the pods whose cost changed; returns their names. Raises ``KubeError``."""
        if self._kube is None:
            self._kube = await self._api.connect()
        pods = await list_pods(self._kube, self._selector)
        by_ip = {(pod.get("status") or {}).get("podIP"): pod for pod in pods}
        patched: list[str] = []
        for url, cost in sorted(costs.items()):
            pod = by_ip.get(urlsplit(url).hostname)
            if pod is None:
                continue
            name = pod["metadata"]["name"]
            current = (pod["metadata"].get("annotations") or {}).get(DELETION_COST)
            if current == str(cost):
                continue
            await annotate_pod(self._kube, name, {DELETION_COST: str(cost)})
            patched.append(name)
        return patched

    async def aclose(self) -> None:
        if self._kube is not None:
            await self._kube.aclose()
            self._kube = None
