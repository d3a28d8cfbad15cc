"""Simple baselines: `round-robin`, `random`, `least-load`.

Each is a `Pipeline` with the standard filters and hooks (so drain, scale-in and the
session table behave the same under every policy) and one scorer:

- round-robin: the candidate at position ``counter % len(candidates)`` scores 1, the
  rest 0; the counter advances in the ``on_routed`` hook (decide stays pure).
- random: every candidate scores 1; the picker breaks the tie with the seeded rng.
- least-load: fewest in-flight requests (the gateway's own count) wins:
  ``(min + 1) / (in_flight + 1)``; exact ties are broken by the rng.

None takes params (but ``weights``, which with one scorer changes nothing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from policies.base import Decision, RequestContext, RoutingInputs, Scorer
from policies.config import NoParams, parse_params, parse_weights
from policies.filters import standard_filters
from policies.framework import Explainer, Pipeline
from policies.hooks import Hook, NoopHook, StandardHooks
from policies.pickers import MaxScorePicker
from prefix_index.base import PrefixIndex, ReplicaId
from replicas.model import ReplicaView


class RoundRobin(NoopHook):
    """Scorer and hook at once: the score reads the counter, the hook advances it."""

    name = "round-robin"

    def __init__(self) -> None:
        self.counter = 0

    def score(
        self, ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView]
    ) -> dict[ReplicaId, float]:
        turn = self.counter % len(candidates) if candidates else 0
        return {c.id: 1.0 if i == turn else 0.0 for i, c in enumerate(candidates)}

    async def on_routed(
        self, ctx: RequestContext, decision: Decision, index: PrefixIndex, now_s: float
    ) -> None:
        self.counter += 1


class UniformScorer:
    name = "uniform"

    def score(
        self, ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView]
    ) -> dict[ReplicaId, float]:
        return {c.id: 1.0 for c in candidates}


class LeastLoadScorer:
    name = "least-load"

    def score(
        self, ctx: RequestContext, inputs: RoutingInputs, candidates: Sequence[ReplicaView]
    ) -> dict[ReplicaId, float]:
        low = min((c.in_flight for c in candidates), default=0)
        return {c.id: (low + 1) / (max(c.in_flight, low) + 1) for c in candidates}


def single_scorer_policy(
    name: str,
    scorer: Scorer,
    params: Mapping[str, Any] | None,
    seed: int | None,
    *,
    random_ties: bool,
    state: Hook | None = None,
    explainer: Explainer | None = None,
) -> Pipeline:
    """Standard filters, one scorer, a max-score picker; ``state`` runs before the standard hooks."""
    weights = parse_weights(params, {scorer.name: 1.0}, name)
    return Pipeline(
        name,
        filters=standard_filters(),
        scorers=[(scorer, weights[scorer.name])],
        picker=MaxScorePicker(random_ties=random_ties),
        explainer=explainer,
        hooks=[state, StandardHooks()] if state is not None else [StandardHooks()],
        seed=seed,
    )


def build_round_robin(params: Mapping[str, Any] | None, seed: int | None) -> Pipeline:
    parse_params(NoParams, params, "round-robin")
    rr = RoundRobin()
    return single_scorer_policy("round-robin", rr, params, seed, random_ties=False, state=rr)


def build_random(params: Mapping[str, Any] | None, seed: int | None) -> Pipeline:
    parse_params(NoParams, params, "random")
    return single_scorer_policy("random", UniformScorer(), params, seed, random_ties=True)


def build_least_load(params: Mapping[str, Any] | None, seed: int | None) -> Pipeline:
    parse_params(NoParams, params, "least-load")
    return single_scorer_policy("least-load", LeastLoadScorer(), params, seed, random_ties=True)
