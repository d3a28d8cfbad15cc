"""The gateway's routing path, in virtual time: views, index reads, decide, hooks, leases.

`SimRouter` does for one simulated fleet what ``gateway/router.py`` + the registry do
for a real one, with the real policy and the real embedded index:

1. **Views.** One frozen ``ReplicaView`` per replica, built from (a) the gateway's own
   exact accounting (``replicas.load.LoadCounters`` held through a ``LoadLease`` per
   request: in flight, predicted uncached prefill until the first token, decoding) and
   (b) what the replica last *reported*: the engine's ``snapshot()`` taken at most every
   ``loads_poll_interval_s`` (the registry polls ``/v1/loads`` that often). Polls are
   lazy: a decision finding the last poll older than the interval polls first, so a
   reading is between 0 and ``loads_poll_interval_s`` old (a real poller's readings are
   uniformly so), and an idle fleet costs nothing.
2. **Snapshot.** ``index.match(block_hashes)``, the session and parent entries, and the
   resident working set when the core's cached one is stale, assembled by the gateway's
   own routing core (``policies.routing.RoutingCore``: the same caching and accounting).
3. ``core.decide(ctx, inputs)``; ``NoRoutableReplica`` -> the request is rejected.
4. ``core.account``, ``policy.on_routed`` (record the chain and the session), the lease
   counts the request.
5. On the first token ``lease.first_byte()``; on the end ``lease.release()`` and
   ``policy.on_completed`` with an ``Outcome`` carrying the engine's ``cached_tokens``, so
   the index feedback (truncate on over-prediction) runs as in production; the replica's
   learned speed (``replicas.speed``) is fed as the gateway feeds the registry's (and, at
   every poll, the accept length the replica's ``/v1/loads`` would report: its lifetime
   mean, on a replica running speculative decoding), and the views carry it (mixed fleets:
   each replica has its own capacity, speed and accept length).

Precise mode (``route(..., precise=matches)``, `loadtest.fleetsim.precise`): the matches
of the replicas in ``precise`` (tokens, from the engines' KV events) replace the
approximate index's (``policies.routing.merge_matches``; the approximate index is not
read when every replica is precise) and the policy decides over ``token_context(ctx)``,
as the gateway does; hooks and accounting keep the original context, so the approximate
index and the sessions are maintained as before.

The index and hooks are async (``prefix_index.base``); the embedded backend never
awaits, so `loadtest.fleetsim.sync.finished` drives each coroutine to completion without an event loop (and
fails loudly should a backend ever really wait).
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from loadtest.fleetsim.sync import finished
from loadtest.simulator.stats import EngineStats
from policies.base import (
    Decision,
    NoRoutableReplica,
    Outcome,
    Policy,
    RequestContext,
    RoutingInputs,
)
from policies.routing import RoutingCore, merge_matches, token_context
from prefix_index.base import PrefixIndex, PrefixMatch, ReplicaCapacity, ReplicaId
from replicas.load import LoadCounters, LoadLease
from replicas.model import ReplicaState, ReplicaView
from replicas.probe import Capacity, ReportedLoad
from replicas.speed import ReplicaSpeed


def reported_load(s: EngineStats, speculative: bool = True) -> ReportedLoad:
    """What the registry keeps of a replica's ``/v1/loads?include=core,spec`` answer, from the
    engine's stats (``speculative``: the replica runs speculative decoding, so its answer has
    the ``speculative`` section once a step ran; `loadtest.simulator.info.load_entry`)."""
    accept = s.spec_accept_length_avg if speculative and s.spec_accept_length_avg else None
    return ReportedLoad(s.num_running_reqs, s.num_waiting_reqs, s.num_waiting_uncached_tokens,
                        s.token_usage, s.max_running_requests, accept)


class SimRouter:
    """Routing for one simulated fleet (see the module docstring)."""

    def __init__(self, policy: Policy, index: PrefixIndex, ids: list[ReplicaId], specs: Sequence[Capacity],
                 snapshot: Any, block_tokens: int, seed: int, loads_poll_interval_s: float = 1.0,
                 held_prefill: Callable[[ReplicaId], tuple[int, ...]] | None = None,
                 speeds: Sequence[ReplicaSpeed] | None = None, speculative: Sequence[bool] = ()) -> None:
        """``specs``: each replica's capacity (aligned with ``ids``); ``speeds``: each
        replica's learned speed, fed by `completed` and `views` as the gateway feeds the
        registry's (None: the views carry none, the policy prices every replica at its
        constants); ``speculative``: which replicas run speculative decoding (empty: all)."""
        self.policy = policy
        self.index = index
        self.ids = ids
        self.specs = list(specs)
        self.speeds = list(speeds) if speeds is not None else None
        self.speculative = list(speculative) or [True] * len(ids)
        self._snapshot = snapshot  # engine index -> EngineStats at the current time
        self.core = RoutingCore(policy, random.Random(seed))  # the resident window is the policy's
        self.poll_s = loads_poll_interval_s
        self.held_prefill = held_prefill or (lambda rid: ())  # what admission holds (gateway.admission)
        self.counters = [LoadCounters() for _ in ids]
        self.reported = [ReportedLoad() for _ in ids]
        self._last_poll_s = -float("inf")
        self.polls = 0
        self._slot = {rid: i for i, rid in enumerate(ids)}
        for rid, spec in zip(ids, self.specs, strict=True):
            policy.on_replica_added(rid)
            capacity = ReplicaCapacity(spec.device_tokens // block_tokens, spec.host_tokens // block_tokens)
            finished(index.set_capacity(rid, capacity))

    def slot(self, rid: ReplicaId) -> int:
        return self._slot[rid]

    def _poll(self, now_s: float) -> None:
        if now_s - self._last_poll_s < self.poll_s:
            return
        self._last_poll_s = now_s
        self.polls += 1
        self.reported = [reported_load(self._snapshot(i), spec) for i, spec in enumerate(self.speculative)]
        for speed, r in zip(self.speeds or (), self.reported, strict=False):
            speed.observe_accept(r.spec_accept_length)

    def views(self, now_s: float) -> tuple[ReplicaView, ...]:
        self._poll(now_s)
        speeds = self.speeds
        return tuple(
            ReplicaView(
                id=rid, state=ReplicaState.ACTIVE, device_tokens=s.device_tokens,
                host_tokens=s.host_tokens, page_size=s.page_size, context_tokens=s.context_tokens,
                max_running_requests=s.max_running_requests, in_flight=c.in_flight,
                pending_prefill_tokens=c.pending_prefill_tokens, decoding=c.decoding,
                held_prefill=self.held_prefill(rid),
                reported_running=r.running, reported_waiting=r.waiting,
                reported_waiting_uncached_tokens=r.waiting_uncached_tokens,
                reported_token_usage=r.token_usage, added_at_s=0.0,
                prefill_tokens_per_s=None if speeds is None else speeds[i].prefill_tokens_per_s,
                decode_step_s=None if speeds is None else speeds[i].decode_step_s,
                spec_accept_length=None if speeds is None else speeds[i].spec_accept_length,
            )
            for i, (rid, s, c, r) in enumerate(zip(self.ids, self.specs, self.counters, self.reported))
        )

    def inputs(self, ctx: RequestContext, now_s: float,
               precise: dict[ReplicaId, PrefixMatch] | None = None) -> RoutingInputs:
        index, core = self.index, self.core
        matches: dict[ReplicaId, PrefixMatch] = (
            finished(index.match(ctx.block_hashes, self.ids))
            if ctx.block_hashes and (precise is None or len(precise) < len(self.ids)) else {}
        )
        if precise is not None:
            matches = merge_matches(matches, precise, approx_block_tokens=ctx.block_tokens)
        key, parent = ctx.session.session, ctx.session.parent
        if core.resident_fresh(now_s) is None:
            core.store_resident(now_s, finished(index.resident_tokens(now_s, core.resident_window_s)))
        return core.inputs(
            ctx, self.views(now_s), matches,
            finished(index.get_session(key)) if key is not None else None,
            finished(index.get_session(parent)) if parent is not None else None,
            now_s,
        )

    def route(self, ctx: RequestContext, now_s: float,
              precise: dict[ReplicaId, PrefixMatch] | None = None) -> tuple[Decision, LoadLease] | None:
        """Decide and record; None when no replica can take the request (rejected).

        ``precise``: token matches of the replicas known from KV events (module docstring)."""
        inputs = self.inputs(ctx, now_s, precise)
        try:
            decision = self.core.decide(ctx if precise is None else token_context(ctx, ctx.est_prompt_tokens),
                                        inputs)
        except NoRoutableReplica:
            return None
        self.core.account(ctx, decision)
        finished(self.policy.on_routed(ctx, decision, self.index, now_s))
        slot = self._slot[decision.replica]
        lease = LoadLease(decision.replica, self.counters[slot], decision.predicted_uncached_tokens)
        return decision, lease

    def completed(self, ctx: RequestContext, decision: Decision, outcome: Outcome, now_s: float,
                  stream_s: float | None = None) -> None:
        """``stream_s``: first to last token (the learned decode speed)."""
        if self.speeds is not None and outcome.ok:
            self.speeds[self._slot[decision.replica]].observe(
                outcome.prompt_tokens, outcome.cached_tokens, outcome.ttft_s, outcome.completion_tokens, stream_s)
        finished(self.policy.on_completed(ctx, decision, outcome, self.index, now_s))
