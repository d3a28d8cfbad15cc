"""The TTFT cost model of the `cache-aware` policy (pure functions over a snapshot).

Per candidate replica, the estimated time to first token of this request there, in
seconds (see `policies/cache_aware.py` for why this rule, and README.md for params):

    prefill      = uncached / prefill_tokens_per_s + host_hit / host_load_tokens_per_s
                   (prefill_tokens_per_s and decode_step_s: the replica's own learned figures,
                   `ReplicaView`, where it has them; decode_weight_s scales with its step)
    queue        = max(pending_prefill_tokens, reported_waiting_uncached_tokens)
                   / prefill_tokens_per_s
                   (with requests held by admission: only the released part and the held
                   requests no larger than this one, `ReplicaView.prefill_ahead`)
    interference = decode_weight_s * max(decoding, reported_running)
                   + saturation_penalty_s * (busy - max_running_requests + 1)
                     (only when busy >= max_running_requests; busy = max(in_flight,
                     reported_running + reported_waiting))
    eviction     = marginal overflow of the resident working set
                   / prefill_tokens_per_s * eviction_weight
    externality  = uncached_s * (queue_externality + crowd_weight * crowd * uncached_s)
                   (uncached_s = uncached / prefill_tokens_per_s; crowd = the replica's
                   resident working set / its KV capacity, at most 1.5)
    affinity     = on every replica but the session's own: move_margin_s
                   + abandon_weight * (cached at home - cached here) / prefill_tokens_per_s
                   (no move_margin_s when the home is *lost*: its KV events, an
                   `ExactMatch`, show it holds < lost_home_fraction of the last turn;
                   its eviction term then gets no "previous turn resident" discount)
    interleave   = ceil(uncached / prefill_chunk_tokens) * decode_step_s, only on a
                   replica with requests running (chunks and decode steps alternate)
    placement    = a NEW session only: (spread_weight * (the replica's resident working
                   set - the candidates' mean, when positive) + abandon_weight * (the
                   prompt's longest match, when one replica alone holds it - what this
                   replica holds of it)) / prefill_tokens_per_s (`policies.placement`:
                   plan where the session will live)
    decode       = decode_time_weight * min(max_tokens, expected_output_tokens) / 5
                   * (decode_step_s - the fastest candidate's decode_step_s)
                   (decode_step_s: the time one stream takes for 5 tokens, its accept
                   length folded in, replicas/speed.py; `_add_decode`, after the pass)

Matched tokens come from the prefix index (``inputs.matches``, device and host tiers,
times ``ctx.block_tokens``). The gateway's own pending work and the replica's reported
queue overlap (both contain requests the gateway sent), so the queue takes their max.
*Externality*: a prefill delays every request queued behind it on that replica; a move
turns a small cached prefill into a full recompute, so it is charged for that delay too.
The *crowd* part grows with the square of the prefill: a 260k-token first turn holds a
replica for ~6.5 s (SGLang finishes a chunked prefill before admitting the next
request), and the sessions living there that send a turn meanwhile wait behind it, so
long prefills go to replicas with fewer live sessions.
*Abandon*: a move leaves the session's KV behind (a copy that only ages out of the old
replica's LRU) and recomputes it; charging that recompute once more makes moving a long
session much rarer than moving a short one (losing a long session's KV is what costs
hit rate).
*Interleave*: SGLang's scheduler (no mixed chunk) alternates prefill chunks of
``chunked_prefill_size`` tokens with decode steps while requests decode, so a prefill of
U uncached tokens on a replica that is decoding anything takes about ``ceil(U / chunk)``
decode steps longer than on an idle one (a 48k-token first turn: 6 steps, ~0.09 s).
``decode_weight_s`` per running request cannot see that: it is per prefill chunk, not
per running request. Defaults: SGLang's ``chunked_prefill_size`` 8192 for large GPUs
and a decode step of ~15 ms at low batch (the default profile's base step).

One implementation (issue 40): `candidate_costs`, one pass of plain arithmetic over the
candidates (no call or object per term), at every fleet size; its ``breakdown`` gives the
terms one by one, which `estimate` returns for one replica. A numpy form of the same
terms was faster from a few hundred replicas on (~0.48 against ~0.68 ms a decision at
512) but cost ~70 us a decision at one replica (against ~12): small fleets are the
common case, so the plain form is the one kept.
"""
# ruff: noqa: FURB136  (`candidate_costs` spells min/max as conditional expressions: no call each)

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass

from policies.base import RequestContext, RoutingInputs
from policies.placement import Placement, placement
from policies.routing import is_exact
from prefix_index.base import PrefixMatch, ReplicaId
from replicas.model import ReplicaView
from replicas.speed import DECODE_TOKENS_PER_STEP, FLEET_DECODE_STEP_S, FLEET_PREFILL_TOKENS_PER_S

_NO_MATCH = PrefixMatch()
_ID = operator.attrgetter("id")


@dataclass(frozen=True, slots=True)
class CacheAwareParams:
    prefill_tokens_per_s: float = FLEET_PREFILL_TOKENS_PER_S  # a replica's uncached prefill rate, when its
    # view has none of its own (ReplicaView.prefill_tokens_per_s, learned: replicas/speed.py)
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
    decode_step_s: float = FLEET_DECODE_STEP_S  # one decode step between two prefill chunks (when the
    # view has none of its own, ReplicaView.decode_step_s)
    spread_weight: float = 1.0  # new sessions: x recompute of the working set above the mean
    decode_time_weight: float = 1.0  # x the reply's extra decode time on a replica slower than the fastest
    expected_output_tokens: int = 300  # the reply's length the decode term assumes (at most max_tokens)
    lost_home_fraction: float = 0.25  # exact home match below this share of the last turn: lost
    oneshot_queue_externality: float = 3.0  # queue_externality for requests without a session key
    # (policies/cache_aware.py: shared prefixes, no sessions)


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
    decode_s: float = 0.0

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
            + self.decode_s
        )


def home_replica(inputs: RoutingInputs, candidates: Sequence[ReplicaView]) -> ReplicaId | None:
    """The session's replica, when it is still a candidate."""
    if inputs.session is None:
        return None
    home = inputs.session.replica
    return home if home in map(_ID, candidates) else None


def _parent_tokens(
    ctx: RequestContext, inputs: RoutingInputs, replica: ReplicaId, p: CacheAwareParams,
    any_match: bool,
) -> int:
    """Tokens assumed cached on the parent's replica for a subagent's first turn
    (``any_match``: the index knows a prefix of the prompt somewhere)."""
    parent = inputs.parent_session
    if (
        inputs.session is not None
        or parent is None
        or parent.replica != replica
        or ctx.block_tokens <= 0
    ):
        return 0
    if any_match:
        return 0  # the index knows a prefix somewhere: real matches decide
    shared = int(min(ctx.est_prompt_tokens, parent.tokens) * p.parent_prefix_fraction)
    return shared // ctx.block_tokens * ctx.block_tokens


def resident_fraction(inputs: RoutingInputs, view: ReplicaView, cap: float = 1.5) -> float:
    """The replica's resident working set over its KV capacity (device + host), in [0, cap]."""
    capacity = view.device_tokens + view.host_tokens
    if capacity <= 0:
        return 0.0
    return min(max(inputs.resident_tokens.get(view.id, 0) / capacity, 0.0), cap)


def _cached_tokens(ctx: RequestContext, inputs: RoutingInputs, replica: ReplicaId) -> int:
    match = inputs.matches.get(replica, _NO_MATCH)
    cached = (match.device_blocks + match.host_blocks) * ctx.block_tokens
    return min(cached, max(ctx.est_prompt_tokens, 0))


@dataclass(slots=True)  # not frozen: built once a decision, on the path (a frozen one costs ~3x)
class RequestTerms:
    """What every candidate's estimate shares, computed once per decision (`request_terms`),
    so a decision evaluates the model once per replica: O(N), not O(N^2) (the longest
    match, the mean working set and "any match anywhere" are fleet-wide)."""

    home: ReplicaId | None
    home_cached: int  # tokens the index says the session's replica holds (affinity)
    home_lost: bool  # its KV events say the home holds little of the last turn (`home_is_lost`)
    any_match: bool  # some replica holds a prefix (the subagent's parent guess is off)
    placement: Placement | None  # the placement term's fleet-wide inputs (None: no term)


def home_is_lost(
    ctx: RequestContext, inputs: RoutingInputs, home: ReplicaId | None, home_cached: int,
    p: CacheAwareParams,
) -> bool:
    """The session's replica is *known* (an `ExactMatch`, from its KV events) to hold less
    than ``lost_home_fraction`` of what it should: the session's last turn, or the prompt
    when that is shorter (a compacted conversation). Its KV was evicted, so staying saves
    nothing and the move margin does not apply. A turn that only grew a lot is not lost:
    the home still holds the whole previous turn."""
    if home is None or inputs.session is None or not is_exact(inputs.matches.get(home)):
        return False
    expected = min(max(ctx.est_prompt_tokens, 0), inputs.session.tokens)
    return home_cached < p.lost_home_fraction * expected


def request_terms(
    ctx: RequestContext, inputs: RoutingInputs, home: ReplicaId | None, p: CacheAwareParams
) -> RequestTerms:
    home_cached = _cached_tokens(ctx, inputs, home) if home is not None else 0
    return RequestTerms(
        home=home,
        home_cached=home_cached,
        home_lost=home_is_lost(ctx, inputs, home, home_cached, p),
        any_match=any(m.blocks for m in inputs.matches.values()),
        placement=placement(ctx, inputs, p.spread_weight),
    )


@dataclass(slots=True, eq=False)
class Costs:
    """`candidate_costs`' answer: per candidate, lists aligned with ``replicas``
    (``breakdown``: every candidate's terms, when asked for)."""

    replicas: list[ReplicaId]
    terms: RequestTerms
    cached_tokens: list[int]
    uncached_tokens: list[int]
    prefill_s: list[float]
    total_s: list[float]
    breakdown: list[TtftEstimate] | None = None


def candidate_costs(
    ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView],
    home: ReplicaId | None, p: CacheAwareParams, breakdown: bool = False,
) -> Costs:
    """The estimated TTFT of every candidate (the formula above), in one pass of plain
    arithmetic over the views' fields: no call or object per term, so a decision costs a
    few microseconds over a few replicas and stays linear in a large fleet. The terms are
    summed in the order of `TtftEstimate.total_s` (prefill, queue, interference, eviction,
    affinity, externality, placement); ``breakdown`` also returns them one by one
    (`estimate`), for tests and inspection."""
    t = request_terms(ctx, inputs, home, p)
    prompt, bt = max(ctx.est_prompt_tokens, 0), ctx.block_tokens
    fleet_pf, hl = p.prefill_tokens_per_s, p.host_load_tokens_per_s
    chunk, fleet_step, fleet_decode_w = p.prefill_chunk_tokens, p.decode_step_s, p.decode_weight_s
    decode_w_per_step = fleet_decode_w / fleet_step if fleet_step > 0 else 0.0
    matches, resident, session, parent = inputs.matches, inputs.resident_tokens, inputs.session, inputs.parent_session
    # the eviction term: on the session's replica its previous turn is already resident
    # (a lost home holds only what its events say)
    own_replica = session.replica if session is not None else None
    own_tokens = (t.home_cached if t.home_lost else session.tokens) if session is not None else 0
    extra = ctx.est_prompt_tokens + (ctx.max_tokens or 0)
    margin = 0.0 if t.home_lost else p.move_margin_s
    place = t.placement
    ids: list[ReplicaId] = []
    cached_l: list[int] = []
    uncached_l: list[int] = []
    prefill_l: list[float] = []
    total_l: list[float] = []
    step_l: list[float] = []  # each candidate's decode step (its own, else the constant)
    parts: list[TtftEstimate] | None = [] if breakdown else None
    # ``b if b > a else a`` is ``max(a, b)`` and ``b if b < a else a`` is ``min(a, b)``
    # (the builtins' very results, -0.0 and NaN included), without a call each
    for v in candidates:
        rid = v.id
        # the replica's own speed where it has one (a decode step scales the per-request
        # decode weight with it), else the fleet-wide constants
        pf = v.prefill_tokens_per_s or fleet_pf
        step = v.decode_step_s
        if step is None:
            step, decode_w = fleet_step, fleet_decode_w
        else:
            decode_w = decode_w_per_step * step
        m = matches.get(rid, _NO_MATCH)
        device = m.device_blocks * bt
        device = prompt if prompt < device else device
        host = m.host_blocks * bt
        host = prompt - device if prompt - device < host else host
        if device + host == 0 and parent is not None and parent.replica == rid:
            device = _parent_tokens(ctx, inputs, rid, p, t.any_match)
            device = prompt if prompt < device else device
        uncached = prompt - device - host
        uncached_s = uncached / pf
        prefill = uncached_s + host / hl
        if v.held_prefill:  # admission holds requests: only those no larger go first
            queue = v.prefill_ahead(uncached) / pf
        else:  # `ReplicaView.prefill_ahead` without held requests, without the call
            pending, waiting = v.pending_prefill_tokens, v.reported_waiting_uncached_tokens
            queue = (waiting if waiting > pending else pending) / pf
        running = v.reported_running if v.reported_running > v.decoding else v.decoding
        interference = decode_w * running
        if running > 0 and uncached > 0 and chunk > 0:
            interference += -(-uncached // chunk) * step
        slots = v.max_running_requests
        busy = v.reported_running + v.reported_waiting
        busy = busy if busy > v.in_flight else v.in_flight
        if slots > 0 and busy >= slots:
            interference += p.saturation_penalty_s * (busy - slots + 1)
        capacity = v.device_tokens + v.host_tokens
        before = resident.get(rid, 0)
        if capacity > 0:
            need = before - (own_tokens if rid == own_replica else 0)
            need = (need if need > 0 else 0) + extra
            over_after, over_before = need - capacity, before - capacity
            overflow = (over_after if over_after > 0 else 0) - (over_before if over_before > 0 else 0)
            eviction = (overflow if overflow > 0 else 0) / pf * p.eviction_weight
            crowd = before / capacity
            crowd = 0.0 if 0.0 > crowd else crowd
            crowd = 1.5 if 1.5 < crowd else crowd
        else:
            eviction = crowd = 0.0
        if t.home is None or rid == t.home:
            affinity = 0.0
        else:
            held = (m.device_blocks + m.host_blocks) * bt
            abandoned = t.home_cached - (prompt if prompt < held else held)
            affinity = margin + p.abandon_weight * (abandoned if abandoned > 0 else 0) / pf
        externality = uncached_s * (p.queue_externality + p.crowd_weight * crowd * uncached_s)
        if place is None:
            placing = 0.0
        else:
            excess = before - place.mean_resident
            left = place.sole_match_tokens - device - host
            placing = (p.spread_weight * (0.0 if 0.0 > excess else excess)
                       + p.abandon_weight * (0.0 if 0 > left else left)) / pf
        ids.append(rid)
        cached_l.append(device + host)
        uncached_l.append(uncached)
        prefill_l.append(prefill)
        total_l.append(prefill + queue + interference + eviction + affinity + externality + placing)
        step_l.append(step)
        if parts is not None:
            parts.append(TtftEstimate(rid, device + host, uncached, prefill, queue, interference, eviction,
                                      affinity, externality, placing))
    _add_decode(ctx, p, step_l, total_l, parts)
    return Costs(ids, t, cached_l, uncached_l, prefill_l, total_l, parts)


def _add_decode(ctx: RequestContext, p: CacheAwareParams, steps: list[float], totals: list[float],
                parts: list[TtftEstimate] | None) -> None:
    """The decode term, in place: on a candidate whose decode step (the time one stream takes
    for ``DECODE_TOKENS_PER_STEP`` tokens: slower hardware, drafts accepted less) is longer
    than the fastest candidate's, ``decode_time_weight`` x the reply's extra decode time
    there (``expected_output_tokens``, at most ``max_tokens``). Nothing on a fleet priced
    at one step (the constants, or equal figures), so the pass is skipped there."""
    fastest = min(steps, default=0.0)
    if p.decode_time_weight <= 0 or fastest <= 0 or max(steps) <= fastest:
        return
    out = p.expected_output_tokens if ctx.max_tokens is None else min(ctx.max_tokens, p.expected_output_tokens)
    per_step = p.decode_time_weight * max(out, 0) / DECODE_TOKENS_PER_STEP
    for i, step in enumerate(steps):
        extra = per_step * (step - fastest)
        totals[i] += extra
        if parts is not None:
            parts[i] = dataclasses.replace(parts[i], decode_s=extra)


def estimate(
    ctx: RequestContext, inputs: RoutingInputs, view: ReplicaView, home: ReplicaId | None,
    p: CacheAwareParams,
) -> TtftEstimate:
    """The TTFT estimate of routing this request to ``view``, term by term (for tests and
    inspection; decisions use `candidate_costs` over every candidate)."""
    parts = candidate_costs(ctx, inputs, [view], home, p, breakdown=True).breakdown
    assert parts is not None
    return parts[0]


def score_floor_s(p: CacheAwareParams) -> float:
    """The floor that makes a relative score tolerance mean "tie_tolerance or tie_tolerance_s"."""
    return p.tie_tolerance_s / p.tie_tolerance if p.tie_tolerance > 0 else p.tie_tolerance_s
