"""Frozen copy of policies/cache_aware.py before the once-per-replica restructuring (the reference
`test_cost_equivalence` checks the current code against; never edit)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from policies.base import RequestContext, RoutingInputs
from policies.config import parse_params, parse_weights
from policies.filters import is_new_session, standard_filters
from policies.framework import Explanation, Pipeline
from policies.pickers import MaxScorePicker
from prefix_index.base import ReplicaId
from replicas.model import ReplicaView
from tests.policies.legacy_cost.placement import is_new_conversation
from tests.policies.legacy_cost.ttft_cost import (
    CacheAwareParams,
    TtftEstimate,
    estimate,
    home_replica,
    resident_fraction,
    score_floor_s,
)

NAME = "cache-aware"
DEFAULT_WEIGHTS = {"ttft": 1.0, "new-session": 0.15}


class TtftScorer:
    """Score = (best + floor) / (cost + floor): 1.0 for the lowest estimated TTFT."""

    name = "ttft"

    def __init__(self, params: CacheAwareParams) -> None:
        self.params = params

    def score(
        self, ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView]
    ) -> dict[ReplicaId, float]:
        home = home_replica(inputs, candidates)
        estimates = [estimate(ctx, inputs, c, home, self.params) for c in candidates]
        # one-shot requests: the prefill every candidate pays is no choice, judge ties on the rest
        common = 0.0 if ctx.session.session else min((e.prefill_s for e in estimates), default=0.0)
        costs = {e.replica: e.total_s - common for e in estimates}
        best = min(costs.values(), default=0.0)
        floor = score_floor_s(self.params)
        return {
            rid: 1.0 if cost <= best else (best + floor) / (cost + floor)
            for rid, cost in costs.items()
        }


class NewSessionScorer:
    """For new sessions only: NEW replicas first, then a low resident fraction; else neutral 0."""

    name = "new-session"

    def __init__(self, params: CacheAwareParams) -> None:
        self.params = params

    def score(
        self, ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView]
    ) -> dict[ReplicaId, float]:
        if not is_new_session(inputs):
            return {c.id: 0.0 for c in candidates}
        out: dict[ReplicaId, float] = {}
        for c in candidates:
            if inputs.now_s - c.added_at_s <= self.params.new_replica_window_s:
                out[c.id] = 1.0
                continue
            out[c.id] = 0.5 * (1.0 - resident_fraction(inputs, c, cap=1.0))
        return out


class CacheAwareExplainer:
    """Reasons: only-one, affinity, moved, parent, prefix, new-session, spread, balance.

    ``spread``: a new session started away from the longest match of its prompt (the
    shared prefix is recomputed there once; see `policies.placement`).
    """

    name = "cache-aware"

    def __init__(self, params: CacheAwareParams) -> None:
        self.params = params

    def explain(
        self,
        ctx: RequestContext,
        inputs: RoutingInputs,
        candidates: Sequence[ReplicaView],
        chosen: ReplicaId,
    ) -> Explanation:
        home = home_replica(inputs, candidates)
        view = next(c for c in candidates if c.id == chosen)
        mine = estimate(ctx, inputs, view, home, self.params)
        return Explanation(
            self._reason(ctx, inputs, candidates, chosen, home, mine),
            mine.cached_tokens,
            mine.uncached_tokens,
        )

    def _reason(
        self,
        ctx: RequestContext,
        inputs: RoutingInputs,
        candidates: Sequence[ReplicaView],
        chosen: ReplicaId,
        home: ReplicaId | None,
        mine: TtftEstimate,
    ) -> str:
        if len(candidates) == 1:
            return "only-one"
        if home is not None:
            return "affinity" if chosen == home else "moved"
        parent = inputs.parent_session
        if inputs.session is None and parent is not None and parent.replica == chosen:
            return "parent"
        best_cached = max(
            estimate(ctx, inputs, c, None, self.params).cached_tokens for c in candidates
        )
        if mine.cached_tokens > 0 and mine.cached_tokens >= best_cached:
            return "prefix"
        if is_new_session(inputs):
            return "new-session"
        return "spread" if is_new_conversation(ctx, inputs) else "balance"


def build(params: Mapping[str, Any] | None, seed: int | None) -> Pipeline:
    p = parse_params(CacheAwareParams, params, NAME)
    if p.prefill_tokens_per_s <= 0 or p.host_load_tokens_per_s <= 0:
        raise ValueError(f"policy {NAME!r}: throughputs must be > 0")
    weights = parse_weights(params, DEFAULT_WEIGHTS, NAME)
    return Pipeline(
        NAME,
        filters=standard_filters(),
        scorers=[(TtftScorer(p), weights["ttft"]), (NewSessionScorer(p), weights["new-session"])],
        picker=MaxScorePicker(tolerance=p.tie_tolerance, random_ties=True),
        explainer=CacheAwareExplainer(p),
        seed=seed,
        resident_window_s=p.resident_window_s,
    )
