"""Routing glue: snapshot the fleet and the index, ask the policy, run its hooks.

The policy itself is pure (``policy.decide``); everything with side effects happens
here, in order: ``snapshot`` (registry views + index reads) -> ``decide`` ->
``routed`` (policy.on_routed: record the chain and the session) -> the proxy sends ->
``completed`` (policy.on_completed with the ``Outcome``).

Retries reuse the snapshot: ``decide(ctx, inputs, exclude=tried)`` re-runs the policy
over the same inputs with the replicas already tried filtered out, so the next-best
replica is the policy's own second choice (its filters still apply: a draining replica
never becomes a fallback).

A failing index (Redis down or slow) degrades routing, never the request: the failed
read is replaced by an empty answer (no prefix match, no session), the failed write is
dropped, and ``kvgate_index_degraded_total`` counts it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

from gateway.metrics import GatewayMetrics
from policies.base import Decision, Outcome, Policy, RequestContext, RoutingInputs
from prefix_index.base import PrefixIndex, PrefixMatch, ReplicaCapacity, ReplicaId, SessionEntry
from replicas.model import ReplicaState, ReplicaView

log = logging.getLogger("kvgate.router")
T = TypeVar("T")

NO_MATCH = PrefixMatch()
RESIDENT_CACHE_S = 1.0
"""How long the fleet's resident working set (a sum over live sessions) is reused."""


class Router:
    def __init__(
        self,
        policy: Policy,
        index: PrefixIndex,
        views: Callable[[], Sequence[ReplicaView]],
        metrics: GatewayMetrics,
        *,
        resident_window_s: float,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.index = index
        self._views = views
        self.metrics = metrics
        self.resident_window_s = resident_window_s
        self.rng = rng
        self.clock = clock
        self._resident_cache: tuple[float, Mapping[ReplicaId, int]] | None = None

    async def _guarded(self, what: str, call: Awaitable[T], fallback: T) -> T:
        try:
            return await call
        except Exception as exc:  # noqa: BLE001 - any index failure degrades, counted and logged
            self.metrics.index_degraded.inc()
            log.warning("index %s failed (%s: %s); routing without it", what, type(exc).__name__, exc)
            return fallback

    async def snapshot(self, ctx: RequestContext) -> RoutingInputs:
        """Everything the policy reads, taken once per request.

        The index reads run concurrently (one round-trip wait on a remote backend instead
        of four); the fleet's resident working set changes slowly and is cached for
        ``RESIDENT_CACHE_S`` (kept current by ``routed``). The replica views are read
        LAST, after every await: from there to the load lease nothing yields to the event
        loop, so concurrent requests each see the load of the decisions made before them
        (no herding on a stale snapshot).
        """
        now_s = self.clock()
        ids = [v.id for v in self._views()]
        empty: dict[ReplicaId, PrefixMatch] = {}
        matches, session, parent, resident = await asyncio.gather(
            self._guarded("match", self.index.match(ctx.block_hashes, ids), empty)
            if ctx.block_hashes and ids else _value(empty),
            self._guarded("get_session", self.index.get_session(ctx.session.session), None)
            if ctx.session.session is not None else _none(),
            self._guarded("get_session", self.index.get_session(ctx.session.parent), None)
            if ctx.session.parent is not None else _none(),
            self._resident(now_s),
        )
        replicas = tuple(self._views())
        if self._resident_cache is not None:
            resident = self._resident_cache[1]  # includes decisions made while we awaited
        return RoutingInputs(
            replicas=replicas,
            matches={v.id: matches.get(v.id, NO_MATCH) for v in replicas},
            session=session, parent_session=parent, resident_tokens=resident, now_s=now_s,
        )

    async def _resident(self, now_s: float) -> Mapping[ReplicaId, int]:
        if self._resident_cache is not None and now_s - self._resident_cache[0] < RESIDENT_CACHE_S:
            return self._resident_cache[1]
        resident: Mapping[ReplicaId, int] = await self._guarded(
            "resident_tokens", self.index.resident_tokens(now_s, self.resident_window_s), {}
        )
        self._resident_cache = (now_s, resident)
        return resident

    def decide(
        self, ctx: RequestContext, inputs: RoutingInputs, exclude: frozenset[ReplicaId] = frozenset()
    ) -> Decision:
        """The policy's choice among replicas not in ``exclude``; raises NoRoutableReplica."""
        if exclude:
            inputs = dataclasses.replace(
                inputs, replicas=tuple(v for v in inputs.replicas if v.id not in exclude)
            )
        decision = self.policy.decide(ctx, inputs, self.rng)
        self.metrics.routed(decision.policy, decision.reason, decision.predicted_cached_tokens)
        return decision

    async def routed(self, ctx: RequestContext, decision: Decision) -> None:
        """Right after the lease, before anything yields: account, then run the hooks."""
        self._account_resident(ctx, decision)
        await self._guarded("on_routed", self.policy.on_routed(ctx, decision, self.index, self.clock()), None)

    def _account_resident(self, ctx: RequestContext, decision: Decision) -> None:
        """Keep the cached resident set current between refreshes: a session just routed
        is resident on its replica now (sequential new sessions must see each other)."""
        if self._resident_cache is None or ctx.session.session is None:
            return
        taken_s, resident = self._resident_cache
        updated = dict(resident)
        updated[decision.replica] = updated.get(decision.replica, 0) + ctx.est_prompt_tokens + (ctx.max_tokens or 0)
        self._resident_cache = (taken_s, updated)

    async def completed(self, ctx: RequestContext, decision: Decision, outcome: Outcome) -> None:
        await self._guarded(
            "on_completed",
            self.policy.on_completed(ctx, decision, outcome, self.index, self.clock()),
            None,
        )



class FleetListener:
    """Registry listener: keeps the index's per-replica LRU sizes and the policy in step.

    A replica joins (``on_added``) -> ``policy.on_replica_added``; its capacity becomes
    known once ``/server_info`` answered (a later ``on_state_changed``) -> the index LRU
    is sized: ``device_tokens / block_tokens`` blocks (host likewise). A replica leaves
    -> ``index.remove_replica`` and ``policy.on_replica_removed``. Listener calls are
    synchronous; index calls are async, so they run as tasks this object owns.
    """

    def __init__(self, index: PrefixIndex, policy: Policy, block_tokens: float) -> None:
        self.index = index
        self.policy = policy
        self.block_tokens = max(block_tokens, 1e-9)
        self._sized: dict[ReplicaId, ReplicaCapacity] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def _spawn(self, what: str, call: Awaitable[None]) -> None:
        async def run() -> None:
            try:
                await call
            except Exception as exc:  # noqa: BLE001 - an index failure must not break the registry
                log.warning("index %s failed: %s: %s", what, type(exc).__name__, exc)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def capacity(self, view: ReplicaView) -> ReplicaCapacity:
        return ReplicaCapacity(int(view.device_tokens / self.block_tokens),
                               int(view.host_tokens / self.block_tokens))

    def _size(self, view: ReplicaView) -> None:
        if view.device_tokens <= 0:
            return  # capacity unknown yet: the index keeps its default
        capacity = self.capacity(view)
        if self._sized.get(view.id) != capacity:
            self._sized[view.id] = capacity
            self._spawn("set_capacity", self.index.set_capacity(view.id, capacity))

    def on_added(self, view: ReplicaView) -> None:
        self.policy.on_replica_added(view.id)
        self._size(view)

    def on_state_changed(self, view: ReplicaView, old_state: ReplicaState) -> None:
        self._size(view)

    def on_removed(self, replica_id: ReplicaId) -> None:
        self._sized.pop(replica_id, None)
        self.policy.on_replica_removed(replica_id)
        self._spawn("remove_replica", self.index.remove_replica(replica_id))

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


async def _value(value: T) -> T:
    return value


async def _none() -> SessionEntry | None:
    return None
