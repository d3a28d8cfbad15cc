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
read is replaced by an empty answer (no prefix match), the failed write is dropped, and
``kvgate_index_degraded_total`` counts it. A failed session read is answered from
``Router.sessions``, the router's own bounded LRU of where it sent each session last
(updated on every routed and completed request), so an index that raises keeps session
affinity. (The Redis backend does not raise: it answers from its local copy, which also
holds the other gateways' sessions, ``prefix_index/redis_sessions.py``.)

Index writes and the first byte: ``routed`` is awaited before the proxy sends the
request upstream, so the hooks' *local* effects (the router's session LRU, the routing
core's resident set, a policy's own state, the embedded index) are in place before the
next decision: concurrent requests see earlier decisions. The remote write is the
backend's to defer: with ``index.redis_write_behind`` the Redis backend updates its local
copy and its pending writes at once, queues the Redis write (bounded, pipelined by one
task, flushed at shutdown: ``prefix_index/write_behind.py``) and returns without a round
trip, and its reads merge the pending writes, so this gateway reads its own decisions
before Redis has them. The embedded backends write in place (no I/O, nothing deferred).

Precise mode (``gateway.kv_wiring``, set as ``Router.precise``): for the replicas that
publish KV events, ``snapshot`` replaces the approximate matches with the event index's
exact ones, in tokens (``policies.routing.merge_matches``), and the policy decides over a
token-unit context (``token_context``: the exact prompt length), so the decision's
``predicted_cached_tokens`` (the ``x-kvgate-expected-cached-tokens`` header) is exact for
them. The hooks keep the request's own context (the approximate chain is still recorded:
it is the fallback when a replica's stream becomes uncertain). ``completed`` observes the
prediction error (predicted minus reported cached tokens) per mode.
"""
from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol, TypeVar

from gateway.metrics import GatewayMetrics
from policies.base import Decision, Outcome, Policy, RequestContext, RoutingInputs
from policies.routing import ANY_MODEL, RoutingCore, merge_matches, serving, token_context
from prefix_index.base import PrefixIndex, PrefixMatch, ReplicaCapacity, ReplicaId, SessionEntry
from prefix_index.session_table import SessionTable
from replicas.model import ReplicaState, ReplicaView

log = logging.getLogger("kvgate.router")
T = TypeVar("T")

LOCAL_SESSIONS = 100_000
"""Sessions the router remembers itself (~370 B each: ~37 MB at most): every session
active within the last hour of a gateway serving ~30 new sessions a second. The table is
the embedded index's own (``prefix_index.session_table.SessionTable``), without expiry:
least recently set evicted beyond the bound."""
PRECISE_PENDING = 65_536  # requests between snapshot and completion whose token context is kept


class PreciseResult(Protocol):
    @property
    def prompt_tokens(self) -> int: ...

    @property
    def matches(self) -> Mapping[ReplicaId, PrefixMatch]: ...


class PreciseLookup(Protocol):
    """``gateway.kv_wiring.PreciseMode``: exact matches, in tokens, for replicas with KV events
    (the prompt is tokenized off the event loop, hence awaited)."""

    async def lookup(self, ctx: RequestContext, replicas: Sequence[ReplicaId]) -> PreciseResult | None: ...


class Router:
    def __init__(
        self,
        policy: Policy,
        index: PrefixIndex,
        views: Callable[[], Sequence[ReplicaView]],
        metrics: GatewayMetrics,
        *,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
        local_sessions: int = LOCAL_SESSIONS,
        ids: Callable[[], Sequence[ReplicaId]] | None = None,
    ) -> None:
        """``ids``: the replicas of ``views()`` without their views (default: from them);
        the index is read for these, the views are taken after the reads."""
        self.policy = policy
        self.index = index
        self._views = views
        self._ids = ids if ids is not None else (lambda: [v.id for v in views()])
        self.metrics = metrics
        self.core = RoutingCore(policy, rng)  # the resident window is the policy's
        self.clock = clock
        self.sessions = SessionTable(math.inf, clock, max_sessions=local_sessions)
        self.precise: PreciseLookup | None = None
        # id(request context) -> (that context, its token-unit context, the replicas matched
        # precisely). Keyed by the object, not the request id a client may repeat; the entry
        # holds the context, so its id cannot be reused while the entry lives.
        self._precise: OrderedDict[int, tuple[RequestContext, RequestContext, frozenset[ReplicaId]]] = OrderedDict()

    async def _guarded(self, what: str, call: Awaitable[T], fallback: T) -> T:
        try:
            return await call
        except Exception as exc:  # noqa: BLE001 - any index failure degrades, counted and logged
            self.metrics.index_degraded.inc()
            log.warning("index %s failed (%s: %s); routing without it", what, type(exc).__name__, exc)
            return fallback

    async def _hook(self, what: str, call: Awaitable[None]) -> None:
        """A policy hook: its failure is the policy's (a bug), logged and counted, never the request's."""
        try:
            await call
        except Exception:
            self.metrics.policy_error(what)
            log.exception("policy hook %s failed", what)

    async def snapshot(self, ctx: RequestContext) -> RoutingInputs:
        """Everything the policy reads, taken once per request.

        On a remote backend (``concurrent_reads``) the index reads run concurrently (one
        round-trip wait instead of four); in-process ones are awaited in turn, since a task
        for each costs more than the read. The fleet's resident working set changes slowly
        and is cached for ``RESIDENT_CACHE_S`` (kept current by ``routed``). The replica views are read
        LAST, after every await: from there to the load lease nothing yields to the event
        loop, so concurrent requests each see the load of the decisions made before them
        (no herding on a stale snapshot).
        """
        now_s = self.clock()
        ids = self._ids()
        core = self.core
        fresh = core.resident_fresh(now_s)
        keys = ctx.session
        matching = bool(ctx.block_hashes and ids)
        if self.index.concurrent_reads:
            matches, session, parent, resident = await asyncio.gather(
                self._match(ctx, ids, matching), self._session(keys.session), self._session(keys.parent),
                self._resident(now_s, fresh))
        else:  # in-process reads finish without waiting: no task for each, none for what is known already
            matches = await self._match(ctx, ids, matching) if matching else {}
            session = await self._session(keys.session) if keys.session is not None else None
            parent = await self._session(keys.parent) if keys.parent is not None else None
            resident = fresh if fresh is not None else await self._resident(now_s, None)
        if fresh is None:
            core.store_resident(now_s, resident)
        if self.precise is not None:  # tokenized only for the replicas serving its model
            own = ids if ctx.model == ANY_MODEL else [v.id for v in serving(tuple(self._views()), ctx.model)]
            matches = await self._precise_matches(ctx, own, matches)
        return core.inputs(ctx, tuple(self._views()), matches, session, parent, now_s)

    async def _precise_matches(self, ctx: RequestContext, ids: Sequence[ReplicaId],
                         approx: Mapping[ReplicaId, PrefixMatch]) -> Mapping[ReplicaId, PrefixMatch]:
        """Exact matches for the replicas with events (the decision then runs in tokens)."""
        assert self.precise is not None
        try:
            answer = await self.precise.lookup(ctx, ids)
        except Exception as exc:  # noqa: BLE001 - a precise-mode bug degrades to approximate routing
            self.metrics.index_degraded.inc()
            log.warning("precise lookup failed (%s: %s); routing approximately", type(exc).__name__, exc)
            return approx
        if answer is None or not answer.matches:
            return approx
        self._precise[id(ctx)] = (ctx, token_context(ctx, answer.prompt_tokens), frozenset(answer.matches))
        while len(self._precise) > PRECISE_PENDING:
            self._precise.popitem(last=False)
        return merge_matches(approx, answer.matches, approx_block_tokens=ctx.block_tokens)

    async def _match(self, ctx: RequestContext, ids: Sequence[ReplicaId],
                     matching: bool) -> Mapping[ReplicaId, PrefixMatch]:
        """The index's matches of the request's blocks (none to look for: none)."""
        return await self._guarded("match", self.index.match(ctx.block_hashes, ids), {}) if matching else {}

    async def _resident(self, now_s: float, fresh: Mapping[ReplicaId, int] | None) -> Mapping[ReplicaId, int]:
        """The fleet's resident working set: ``fresh`` (cached), else read from the index."""
        if fresh is not None:
            return fresh
        return await self._guarded("resident_tokens", self.index.resident_tokens(now_s, self.core.resident_window_s),
                                   {})

    async def _session(self, key: str | None) -> SessionEntry | None:
        """The index's entry for the session; this router's own if the index fails."""
        if key is None:
            return None
        return await self._guarded("get_session", self.index.get_session(key), self.sessions.get(key))

    def decide(
        self, ctx: RequestContext, inputs: RoutingInputs, exclude: frozenset[ReplicaId] = frozenset()
    ) -> Decision:
        """The policy's choice among replicas not in ``exclude``; raises NoRoutableReplica."""
        decision = self.choose(ctx, inputs, exclude)
        self.count(decision)
        return decision

    def choose(
        self, ctx: RequestContext, inputs: RoutingInputs, exclude: frozenset[ReplicaId] = frozenset()
    ) -> Decision:
        """``decide`` without counting the decision (``count`` does, once it is acted on)."""
        precise = self._precise.get(id(ctx))
        return self.core.decide(precise[1] if precise is not None else ctx, inputs, exclude)

    def count(self, decision: Decision) -> None:
        self.metrics.routed(decision.policy, decision.reason, decision.predicted_cached_tokens)

    async def routed(self, ctx: RequestContext, decision: Decision) -> None:
        """Right after the lease, before anything yields: account, then run the hooks."""
        self.core.account(ctx, decision)
        now_s = self.clock()
        if ctx.session.session is not None:
            tokens = ctx.est_prompt_tokens + (ctx.max_tokens or 0)
            self.sessions.set(ctx.session.session, SessionEntry(decision.replica, tokens, now_s))
        await self._hook("on_routed", self.policy.on_routed(ctx, decision, self.index, now_s))

    def forget(self, ctx: RequestContext) -> None:
        """The request ends without ``completed`` (not routable): drop its precise context."""
        self._precise.pop(id(ctx), None)

    async def completed(self, ctx: RequestContext, decision: Decision, outcome: Outcome) -> None:
        precise = self._precise.pop(id(ctx), None)
        if outcome.cached_tokens is not None:
            mode = "precise" if precise is not None and decision.replica in precise[2] else "approximate"
            self.metrics.prediction(mode, decision.predicted_cached_tokens, outcome.cached_tokens)
        key = ctx.session.session
        mine = self.sessions.get(key) if key is not None else None
        if key is not None and outcome.ok and outcome.prompt_tokens is not None and (
                mine is None or mine.replica == decision.replica):  # not moved by a later turn
            tokens = outcome.prompt_tokens + (outcome.completion_tokens or 0)
            self.sessions.set(key, SessionEntry(decision.replica, tokens, self.clock()))
        await self._hook("on_completed", self.policy.on_completed(ctx, decision, outcome, self.index, self.clock()))



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

