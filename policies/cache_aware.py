"""`cache-aware`, the default policy: route to the lowest estimated time to first token.

Per candidate replica we estimate, in seconds, the TTFT this request would see there
(`policies.ttft_cost`: uncached prefill + host load-back + queue + decode interference
(per running request, and one decode step per prefill chunk on a decoding replica) +
saturation + eviction of the resident working set + queue externality, plus
``move_margin_s`` on every replica but the session's own, plus for a new session the
placement term of `policies.placement`) and pick the lowest.

Why this rule. Simulating real Claude Code sessions showed the rule that matters: stay
on the replica holding the session's KV unless its queue would delay the request by
more than the recompute a move would cost. Comparing full TTFT estimates gives exactly
that: an alternative replica pays the uncached prefill of the whole prompt. Threshold
rules (SGLang's "match rate > 0.3") pile sessions onto one replica; a linear cost in
blocks (Dynamo's) moves long sessions too eagerly.

Three terms make moves rarer than the bare TTFT comparison: ``queue_externality`` (0.5)
charges a recompute for the delay it adds to requests queued behind it,
``abandon_weight`` (1.0) charges a move once more for the KV it leaves behind, and
``move_margin_s`` (2.0 s) is hysteresis against flapping and stale load figures. A
100k-token session now moves when its home queue exceeds about 2.5 s x 2.5 + 2 s =
8.25 s (at 40k tokens/s); a 4k-token session when it exceeds about 2.2 s.

How the defaults were chosen (docs/benchmarks.md, section 1.3): a virtual-time replay of
the bench-peers setting (8 replicas of kimi-k2.6-b200-tp8 with KV pools x0.25, 128
Claude Code sessions in three disjoint slices, 32/64/128 concurrent and think times
x0.1, with and without a 60 s ramp). Every hit-rate point cache-aware lost to the
oracle came from moved turns (a move recomputes the session and evicts others); the
abandon charge and the 2 s margin halve the moves there (the figures are in that
section, not here). ``crowd_weight`` (0.1 per s) sends long prefills to replicas with fewer
live sessions (see `policies.ttft_cost`).

The *eviction* term accounts for the resident working set: KV of live sessions between
turns (``inputs.resident_tokens``). Tokens that would not fit in ``device_tokens +
host_tokens`` evict live sessions, which will be recomputed later. Only the marginal
overflow counts (what placing this request adds), and on the session's own replica its
previous turn is already resident, so only the growth counts.

A subagent's first turn (no session entry, parent entry present) treats the parent's
replica as holding ``parent_prefix_fraction`` of the prompt when the index knows no
prefix of it anywhere: subagents share tools and much of their context with the parent.

New sessions are placed for where they will live, not only for their first turn
(`policies.placement`): a burst of new sessions sharing a system prompt spreads instead
of following predict-on-route onto the first replica that holds the prompt; reason
``spread`` when a new session starts away from the longest match of its prompt.

Scores: ``(best + floor) / (cost + floor)`` with ``floor = tie_tolerance_s /
tie_tolerance``; 1.0 for the best. For a one-shot request (no session key), costs
are compared after subtracting the prefill every candidate pays at least: on a long
uncached prompt (a 48k-token document: 1.2 s everywhere, x1.5 with the externality) a
90 ms difference in queue or interleave is a real difference, not 5% of the whole and
so a tie (on the Mooncake trace such ties put long prompts on decoding replicas and set
the TTFT p99). A session's turns keep the tolerance on the whole cost: a new session
lives where it starts, so a herd of new sessions on the replica that looks a few
percent better in one snapshot costs far more than one slower first turn (and in the
Claude Code replays the strict comparison raised the TTFT p99 of the start-up burst). With this floor the picker's relative tolerance
``tie_tolerance`` means "within 5% or 20 ms of the best" (defaults), and the seeded rng
picks among those ties (herding defence). A second scorer, ``new-session`` (weight
0.15), only speaks for new sessions: it prefers NEW replicas (joined within
``new_replica_window_s``) and then replicas with a low resident fraction, so scale-out
takes new sessions first.

Precise mode (issue 13) adds knowledge, not a new rule: a match the replica's KV events
stated (`policies.routing.ExactMatch`) is believed where a prediction is only hoped. A
home known to hold less than ``lost_home_fraction`` of the session's last turn (or of the
prompt, when a compacted conversation is shorter) is *lost*: its KV was evicted, staying
saves nothing, so the move margin and
the home's "previous turn already resident" discount go, and the turn's full recompute
runs where it is cheapest (reason ``rehomed`` when that is not the home). Measured in
docs/results-precise.md.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from policies.base import RequestContext, RoutingInputs
from policies.config import parse_params, parse_weights
from policies.filters import is_new_session, standard_filters
from policies.framework import Explanation, Pipeline
from policies.pickers import MaxScorePicker
from policies.placement import is_new_conversation
from policies.ttft_cost import (
    CacheAwareParams,
    Costs,
    candidate_costs,
    home_replica,
    resident_fraction,
    score_floor_s,
)
from prefix_index.base import ReplicaId
from replicas.model import ReplicaView

NAME = "cache-aware"
_ID = operator.attrgetter("id")
DEFAULT_WEIGHTS = {"ttft": 1.0, "new-session": 0.15}


class EstimateMemo:
    """The estimates of the decision in progress, from the scorer to the explainer.

    The cost model is evaluated once per candidate per decision (`ttft_cost.candidate_costs`):
    `TtftScorer` stores its estimates here and
    `CacheAwareExplainer` takes them back when it is called for the same decision (the
    very same ``ctx``, ``inputs`` and ``candidates`` objects, which the pipeline passes to
    both, synchronously). Both are pure functions of those arguments, so reusing the
    scorer's values changes nothing; on any other call the explainer computes them
    itself. ``take`` empties the memo, so it holds one decision at most.
    """

    __slots__ = ("_estimates", "_key")

    def __init__(self) -> None:
        self._key: tuple[object, object, object] | None = None
        self._estimates: Costs | None = None

    def put(self, ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView],
            values: Costs) -> None:
        self._key = (ctx, inputs, candidates)
        self._estimates = values

    def take(self, ctx: RequestContext, inputs: RoutingInputs,
             candidates: Sequence[ReplicaView]) -> Costs | None:
        key, values = self._key, self._estimates
        self._key, self._estimates = None, None
        if key is None or key[0] is not ctx or key[1] is not inputs or key[2] is not candidates:
            return None
        return values


def ttft_scores(ctx: RequestContext, costs: Costs, floor: float, externality: float = 0.0) -> list[float]:
    """`TtftScorer`'s scores, aligned with ``costs.replicas``: (best + floor) / (cost + floor).

    One-shot requests (no session key): the prefill every candidate pays, and its
    ``externality`` (the request's ``queue_externality``), is no choice, so ties are judged
    on the rest."""
    totals = costs.total_s
    if not ctx.session.session and totals:
        common = min(costs.prefill_s) * (1.0 + externality)
        totals = [total - common for total in totals]
    best = min(totals, default=0.0)
    return [1.0 if cost <= best else (best + floor) / (cost + floor) for cost in totals]


class RequestParams:
    """The cost model's params for a request: ``queue_externality`` is
    ``oneshot_queue_externality`` for a request without a session key.

    Why (docs/benchmarks.md, section 1.11): with no session, nobody lives anywhere; what a
    one-shot request that leaves the replica holding its shared prefix (an app's system
    prompt and tools) for a less loaded one costs the fleet is not its own recompute once:
    the prefix then lives on two replicas, each hit less often, and later requests of the
    app pay it again. At 4x the rate of a shared-prefix workload without sessions the
    default externality (0.5) copied hot prefixes by load 1,234 times (reason ``balance``)
    and lost 1.5 points of hit rate to SGLang's rule; pricing the recompute 3x (tuned on
    the tuning half only) keeps the copies for real queues. Session turns keep
    ``queue_externality``: affinity and the abandon charge already price their moves."""

    __slots__ = ("oneshot", "session")

    def __init__(self, params: CacheAwareParams) -> None:
        self.session = params
        self.oneshot = dataclasses.replace(params, queue_externality=params.oneshot_queue_externality)

    def of(self, ctx: RequestContext) -> CacheAwareParams:
        return self.session if ctx.session.session else self.oneshot


class TtftScorer:
    """Score = (best + floor) / (cost + floor): 1.0 for the lowest estimated TTFT."""

    name = "ttft"

    def __init__(self, params: CacheAwareParams, memo: EstimateMemo | None = None) -> None:
        self.params = RequestParams(params)
        self.memo = memo
        self.floor = score_floor_s(params)

    def score(
        self, ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView]
    ) -> dict[ReplicaId, float]:
        p = self.params.of(ctx)
        costs = candidate_costs(ctx, inputs, candidates, home_replica(inputs, candidates), p)
        if self.memo is not None:
            self.memo.put(ctx, inputs, candidates, costs)
        return dict(zip(costs.replicas, ttft_scores(ctx, costs, self.floor, p.queue_externality), strict=True))


def new_session_score(inputs: RoutingInputs, view: ReplicaView, p: CacheAwareParams) -> float:
    """`NewSessionScorer`'s score of ``view`` for a new session: 1.0 for a NEW replica, else
    0.5 x the share of its KV capacity not held by resident sessions."""
    if inputs.now_s - view.added_at_s <= p.new_replica_window_s:
        return 1.0
    return 0.5 * (1.0 - resident_fraction(inputs, view, cap=1.0))


class NewSessionScorer:
    """For new sessions only: NEW replicas first, then a low resident fraction; else neutral 0."""

    name = "new-session"

    def __init__(self, params: CacheAwareParams) -> None:
        self.params = params

    def score(
        self, ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView]
    ) -> dict[ReplicaId, float]:
        if not is_new_session(inputs):
            return dict.fromkeys(map(_ID, candidates), 0.0)
        return {c.id: new_session_score(inputs, c, self.params) for c in candidates}


def explanation(
    ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView], chosen: ReplicaId,
    known: Costs,
) -> tuple[str, int, int]:
    """`CacheAwareExplainer`'s answer (reason, cached tokens, uncached tokens), from the
    decision's estimates (``known``, evaluated for the candidates and their home)."""
    i = known.replicas.index(chosen)
    cached, uncached = known.cached_tokens[i], known.uncached_tokens[i]
    best_cached = max(known.cached_tokens)
    holds_best = cached > 0 and cached >= best_cached  # cached tokens ignore home
    return _reason(ctx, inputs, candidates, chosen, known.terms.home, known.terms.home_lost, holds_best), cached, uncached


def _reason(
    ctx: RequestContext,
    inputs: RoutingInputs,
    candidates: Sequence[ReplicaView],
    chosen: ReplicaId,
    home: ReplicaId | None,
    home_lost: bool,
    holds_best: bool,
) -> str:
    if len(candidates) == 1:
        return "only-one"
    if home is not None:
        if chosen == home:
            return "affinity"
        return "rehomed" if home_lost else "moved"
    parent = inputs.parent_session
    if inputs.session is None and parent is not None and parent.replica == chosen:
        return "parent"
    if holds_best:
        return "prefix"
    if is_new_session(inputs):
        return "new-session"
    return "spread" if is_new_conversation(ctx, inputs) else "balance"


class CacheAwareExplainer:
    """Reasons: only-one, affinity, moved, rehomed, parent, prefix, new-session, spread, balance.

    ``rehomed``: the session left a home its KV events show lost (`ttft_cost.home_is_lost`).

    ``spread``: a new session started away from the longest match of its prompt (the
    shared prefix is recomputed there once; see `policies.placement`).
    """

    name = "cache-aware"

    def __init__(self, params: CacheAwareParams, memo: EstimateMemo | None = None) -> None:
        self.params = RequestParams(params)
        self.memo = memo

    def explain(
        self,
        ctx: RequestContext,
        inputs: RoutingInputs,
        candidates: Sequence[ReplicaView],
        chosen: ReplicaId,
    ) -> Explanation:
        known = self.memo.take(ctx, inputs, candidates) if self.memo is not None else None
        if known is None:  # not the scorer's decision: evaluate the model here (once per replica)
            known = candidate_costs(ctx, inputs, candidates, home_replica(inputs, candidates), self.params.of(ctx))
        return Explanation(*explanation(ctx, inputs, candidates, chosen, known))


def build(params: Mapping[str, Any] | None, seed: int | None) -> Pipeline:
    p = parse_params(CacheAwareParams, params, NAME)
    if p.prefill_tokens_per_s <= 0 or p.host_load_tokens_per_s <= 0:
        raise ValueError(f"policy {NAME!r}: throughputs must be > 0")
    weights = parse_weights(params, DEFAULT_WEIGHTS, NAME)
    memo = EstimateMemo()  # the scorer's estimates, handed to the explainer of the same decision
    return Pipeline(
        NAME,
        filters=standard_filters(),
        scorers=[(TtftScorer(p, memo), weights["ttft"]), (NewSessionScorer(p), weights["new-session"])],
        picker=MaxScorePicker(tolerance=p.tie_tolerance, random_ties=True),
        explainer=CacheAwareExplainer(p, memo),
        seed=seed,
        resident_window_s=p.resident_window_s,
    )
