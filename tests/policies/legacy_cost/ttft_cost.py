"""Frozen copy of policies/ttft_cost.py before the once-per-replica restructuring (the reference
`test_cost_equivalence` checks the current code against; never edit)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.base import RequestContext, RoutingInputs
from prefix_index.base import PrefixMatch, ReplicaId
from replicas.model import ReplicaView
from tests.policies.legacy_cost.placement import spread_s


@dataclass(frozen=True, slots=True)
class CacheAwareParams:
    prefill_tokens_per_s: float = 40_000.0  # uncached prefill throughput of one replica
    host_load_tokens_per_s: float = 1_000_000.0  # HiCache host -> device load throughput
    decode_weight_s: float = 0.002  # prefill slowdown per running decode request
    saturation_penalty_s: float = 0.5  # wait per request beyond max_running_requests
    eviction_weight: float = 1.0  # how much a future recompute of evicted KV counts
    queue_externality: float = 0.5  # the delay this prefill adds to requests queued behind it
    move_margin_s: float = 2.0  # hysteresis: leave the session's replica only if this much better
    crowd_weight: float = 0.1  # per s: a long prefill delays the sessions living on its replica
    abandon_weight: float = 1.0  # a move also pays this x the recompute of the KV it leaves behind
    tie_tolerance: float = 0.05  # relative: costs within 5% of the best are ties
    tie_tolerance_s: float = 0.02  # absolute: ... or within 20 ms
    new_replica_window_s: float = 300.0  # a replica is NEW this long after joining
    resident_window_s: float = 600.0  # sessions seen within this window are resident
    parent_prefix_fraction: float = (
        0.5  # share of a subagent's prompt assumed cached on the parent's replica
    )
    prefill_chunk_tokens: int = 8192  # SGLang's chunked_prefill_size (large GPUs)
    decode_step_s: float = 0.015  # one decode step between two prefill chunks
    spread_weight: float = 1.0  # new sessions: x recompute of the working set above the mean
    placement_max_shared_tokens: int = 32_768  # a longer match is the session's own KV


@dataclass(frozen=True, slots=True)
class TtftEstimate:
    """The estimated TTFT of the request on one replica, by component (seconds)."""

    replica: ReplicaId
    cached_tokens: int
    uncached_tokens: int
    prefill_s: float
    queue_s: float
    interference_s: float
    eviction_s: float
    affinity_s: float
    externality_s: float = 0.0
    placement_s: float = 0.0

    @property
    def total_s(self) -> float:
        return (
            self.prefill_s
            + self.queue_s
            + self.interference_s
            + self.eviction_s
            + self.affinity_s
            + self.externality_s
            + self.placement_s
        )


def home_replica(inputs: RoutingInputs, candidates: Sequence[ReplicaView]) -> ReplicaId | None:
    """The session's replica, when it is still a candidate."""
    if inputs.session is None:
        return None
    home = inputs.session.replica
    return home if any(c.id == home for c in candidates) else None


def parent_tokens(
    ctx: RequestContext, inputs: RoutingInputs, replica: ReplicaId, p: CacheAwareParams
) -> int:
    """Tokens assumed cached on the parent's replica for a subagent's first turn."""
    parent = inputs.parent_session
    if (
        inputs.session is not None
        or parent is None
        or parent.replica != replica
        or ctx.block_tokens <= 0
    ):
        return 0
    if any(m.blocks for m in inputs.matches.values()):
        return 0  # the index knows a prefix somewhere: real matches decide
    shared = int(min(ctx.est_prompt_tokens, parent.tokens) * p.parent_prefix_fraction)
    return shared // ctx.block_tokens * ctx.block_tokens


def _interference_s(view: ReplicaView, uncached: int, p: CacheAwareParams) -> float:
    running = max(view.decoding, view.reported_running)
    cost = p.decode_weight_s * running
    if running > 0 and uncached > 0 and p.prefill_chunk_tokens > 0:
        cost += -(-uncached // p.prefill_chunk_tokens) * p.decode_step_s
    slots = view.max_running_requests
    busy = max(view.in_flight, view.reported_running + view.reported_waiting)
    if slots > 0 and busy >= slots:
        cost += p.saturation_penalty_s * (busy - slots + 1)
    return cost


def _eviction_s(
    ctx: RequestContext, inputs: RoutingInputs, view: ReplicaView, p: CacheAwareParams
) -> float:
    capacity = view.device_tokens + view.host_tokens
    if capacity <= 0:
        return 0.0
    own = (
        inputs.session.tokens
        if inputs.session is not None and inputs.session.replica == view.id
        else 0
    )
    before = inputs.resident_tokens.get(view.id, 0)
    need = max(before - own, 0) + ctx.est_prompt_tokens + (ctx.max_tokens or 0)
    overflow = max(max(need - capacity, 0) - max(before - capacity, 0), 0)
    return overflow / p.prefill_tokens_per_s * p.eviction_weight


def resident_fraction(inputs: RoutingInputs, view: ReplicaView, cap: float = 1.5) -> float:
    """The replica's resident working set over its KV capacity (device + host), in [0, cap]."""
    capacity = view.device_tokens + view.host_tokens
    if capacity <= 0:
        return 0.0
    return min(max(inputs.resident_tokens.get(view.id, 0) / capacity, 0.0), cap)


def _externality_s(
    uncached: int, inputs: RoutingInputs, view: ReplicaView, p: CacheAwareParams
) -> float:
    prefill_s = uncached / p.prefill_tokens_per_s
    crowd = resident_fraction(inputs, view)
    return prefill_s * (p.queue_externality + p.crowd_weight * crowd * prefill_s)


def _cached_tokens(ctx: RequestContext, inputs: RoutingInputs, replica: ReplicaId) -> int:
    match = inputs.matches.get(replica, PrefixMatch())
    cached = (match.device_blocks + match.host_blocks) * ctx.block_tokens
    return min(cached, max(ctx.est_prompt_tokens, 0))


def _affinity_s(
    ctx: RequestContext,
    inputs: RoutingInputs,
    view: ReplicaView,
    home: ReplicaId | None,
    p: CacheAwareParams,
) -> float:
    if home is None or view.id == home:
        return 0.0
    abandoned = _cached_tokens(ctx, inputs, home) - _cached_tokens(ctx, inputs, view.id)
    return p.move_margin_s + p.abandon_weight * max(abandoned, 0) / p.prefill_tokens_per_s


def estimate(
    ctx: RequestContext,
    inputs: RoutingInputs,
    view: ReplicaView,
    home: ReplicaId | None,
    p: CacheAwareParams,
) -> TtftEstimate:
    """The TTFT estimate of routing this request to ``view`` (pure)."""
    prompt = max(ctx.est_prompt_tokens, 0)
    match = inputs.matches.get(view.id, PrefixMatch())
    device = min(match.device_blocks * ctx.block_tokens, prompt)
    host = min(match.host_blocks * ctx.block_tokens, prompt - device)
    if device + host == 0:
        device = min(parent_tokens(ctx, inputs, view.id, p), prompt)
    uncached = prompt - device - host
    waiting = max(view.pending_prefill_tokens, view.reported_waiting_uncached_tokens)
    return TtftEstimate(
        replica=view.id,
        cached_tokens=device + host,
        uncached_tokens=uncached,
        prefill_s=uncached / p.prefill_tokens_per_s + host / p.host_load_tokens_per_s,
        queue_s=waiting / p.prefill_tokens_per_s,
        interference_s=_interference_s(view, uncached, p),
        eviction_s=_eviction_s(ctx, inputs, view, p),
        affinity_s=_affinity_s(ctx, inputs, view, home, p),
        externality_s=_externality_s(uncached, inputs, view, p),
        placement_s=spread_s(ctx, inputs, view, p.spread_weight, p.prefill_tokens_per_s,
                             p.placement_max_shared_tokens),
    )


def score_floor_s(p: CacheAwareParams) -> float:
    """The floor that makes a relative score tolerance mean "tie_tolerance or tie_tolerance_s"."""
    return p.tie_tolerance_s / p.tie_tolerance if p.tie_tolerance > 0 else p.tie_tolerance_s
